"""A vLLM source tree and the series applied to it.

Every change goes through a staging copy of the files it touches: patch-ng
applies (or reverts) the patches there, and only when all of them succeed are
the results copied into the tree and the manifest written. A failure therefore
leaves the tree exactly as it was.

On the pinned release every hunk must sit at the line its header names. On
another supported release a hunk may sit at another line, and lose up to
``RELEASE_FUZZ`` context lines at each end (GNU patch's offset and fuzz): the
patch is rewritten to that place and context before patch-ng applies it, and
the manifest records the texts as applied, so reversing is exact.

A patch that requires what the tree's release removed or does not have yet
(``Requires:`` in its header, ``series.REMOVED`` and ``series.ADDED``) is left
out, and ``apply``, ``check`` and ``status`` say so.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
import subprocess
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from .fetch import COMMIT_MARKER
from .hunks import apply_file_patch, occurrences, trimmed
from .series import FileHunk, FilePatch, Patch, Series, SeriesError

MANIFEST = "vllm/_afd_manifest.json"
RELEASE_FUZZ = 2
"""Context lines a hunk may lose at each end on a release other than the
pinned one (GNU patch's default)."""


def release_of(version: str) -> str:
    """'0.26.0+afd.x' / '0.26.0.dev3' -> '0.26.0'."""
    return re.split(r"[+]|\.dev|rc", version, maxsplit=1)[0]


@dataclass(frozen=True)
class TreeVersion:
    version: str | None  # from vllm/_version.py (wheels)
    commit: str | None  # from git (checkouts)

    def describe(self) -> str:
        return " ".join(x for x in (self.version, self.commit) if x) or "unknown"


class VllmTree:
    """A directory that holds the ``vllm`` package (a checkout or an unpacked
    wheel). ``root`` may also name the ``vllm`` package itself."""

    def __init__(self, root: Path):
        root = Path(root).resolve()
        if (root / "__init__.py").is_file() and (root / "config").is_dir():
            root = root.parent
        if not (root / "vllm" / "__init__.py").is_file():
            raise SeriesError(
                f"{root} holds no vllm package (expected {root}/vllm/__init__.py); "
                "pass the checkout root or the site-packages directory"
            )
        self.root = root

    # -- identity -------------------------------------------------------
    def version(self) -> TreeVersion:
        version = None
        vfile = self.root / "vllm" / "_version.py"
        if vfile.is_file():
            m = re.search(r"^__version__ = version = '([^']+)'", vfile.read_text(), re.M)
            version = m.group(1) if m else None
        commit = None
        marker = self.root / COMMIT_MARKER
        if marker.is_file():
            commit = marker.read_text().strip()
        elif (self.root / ".git").exists():
            proc = subprocess.run(
                ["git", "-C", str(self.root), "rev-parse", "HEAD"],
                capture_output=True,
                text=True,
            )
            commit = proc.stdout.strip() if proc.returncode == 0 else None
        return TreeVersion(version, commit)

    def release(self, series: Series) -> Series:
        """``series`` for this tree's vLLM release; refuses a release (or a
        checkout at a commit) the series does not support."""
        found = self.version()
        pin = series.pin
        if found.commit is not None:
            release = pin.version if found.commit == pin.commit else None
        elif found.version is not None:
            release = release_of(found.version)
            release = release if release in series.releases else None
        else:
            raise SeriesError(
                f"cannot tell which vLLM {self.root} is: no vllm/_version.py and "
                "no git checkout. The series needs vLLM "
                f"{' or '.join(series.releases)}."
            )
        if release is None:
            raise SeriesError(
                f"vLLM tree {self.root} is {found.describe()}, but the series "
                f"supports vLLM {', '.join(series.releases)} (a checkout must be at "
                f"commit {pin.commit}). Use a tree of one of those releases, or see how "
                f"far the series is from yours with 'scripts/apply_patches.py "
                f"rebase-check --vllm-version {release_of(found.version or '?')}'."
            )
        return series.for_release(release)

    # -- manifest -------------------------------------------------------
    def manifest(self) -> dict | None:
        path = self.root / MANIFEST
        return json.loads(path.read_text()) if path.is_file() else None

    def _write_manifest(self, series: Series, applied: list[Patch]) -> None:
        data = {
            "vllm_version": series.release,
            "vllm_commit": series.pin.commit if series.pinned else None,
            "series_hash": series.hash,
            "variants": series.varied(),
            "skipped": {p.name: why for p, why in series.skipped},
            # sha256: of the patch file (what status compares); text: as applied
            "patches": [
                {"name": p.name, "sha256": p.sha256, "text": a.text}
                for p, a in zip(series.patches, applied, strict=True)
            ],
            "overlay": sorted(series.overlay),
        }
        (self.root / MANIFEST).write_text(json.dumps(data, indent=1) + "\n")

    # -- operations -----------------------------------------------------
    def apply(self, series: Series, log=print) -> bool:
        """Apply ``series`` (for this tree's release); returns False when it
        was already applied."""
        series = self.release(series)
        for note in series.skip_notes():
            log(note)
        old = self.manifest()
        if old is not None and old["series_hash"] == series.hash:
            return False
        recorded = recorded_patches(old) if old else ()
        new_patches = series.patches
        files = files_of(recorded + new_patches)
        for path in series.overlay:
            owned = old is not None and path in old["overlay"]
            if (self.root / path).exists() and not owned:
                raise SeriesError(
                    f"overlay file {path} already exists in the vLLM tree: the "
                    "overlay may only add files. Rename it, or change the "
                    "upstream file with a patch instead."
                )
        with Staging(self.root, files) as stage:
            if recorded:
                log(f"reversing the series recorded in {MANIFEST} ({old['series_hash']})")
                stage.run(reversed(recorded), reverse=True)
            applied = stage.run(new_patches, reverse=False, log=log, relocate=not series.pinned)
            stage.commit()
        if old:
            for path in old["overlay"]:
                (self.root / path).unlink(missing_ok=True)
        for path, data in series.overlay.items():
            target = self.root / path
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(data)
        self._write_manifest(series, applied)
        return True

    def reverse(self, log=print) -> bool:
        """Undo what the manifest records; returns False on a pristine tree."""
        old = self.manifest()
        if old is None:
            return False
        recorded = recorded_patches(old)
        with Staging(self.root, files_of(recorded)) as stage:
            stage.run(reversed(recorded), reverse=True, log=log)
            stage.commit()
        for path in old["overlay"]:
            (self.root / path).unlink(missing_ok=True)
        (self.root / MANIFEST).unlink()
        return True

    def check(self, series: Series, log=print) -> Series:
        """Dry run: raise SeriesError if ``series`` does not apply here.
        Returns the series for this tree's release."""
        series = self.release(series)
        for note in series.skip_notes():
            log(note)
        with Staging(self.root, files_of(series.patches)) as stage:
            stage.run(series.patches, reverse=False, relocate=not series.pinned)
        return series

    def status(self, series: Series) -> list[tuple[str, str]]:
        """Per patch: 'applied', 'applied (patch file changed since)',
        'not applied' or 'conflicting: <where>', then 'skipped (<why>)' for
        each patch this release leaves out."""
        series = self.release(series)
        skipped = [(p.name, f"skipped ({why})") for p, why in series.skipped]
        old = self.manifest()
        if old is not None:
            recorded = {p["name"]: p["sha256"] for p in old["patches"]}
            out = []
            for p in series.patches:
                if p.name not in recorded:
                    out.append((p.name, "not applied (new since the tree was patched)"))
                elif recorded[p.name] != p.sha256:
                    out.append((p.name, "applied (patch file changed since)"))
                else:
                    out.append((p.name, "applied"))
            return out + skipped
        out = []
        with Staging(self.root, files_of(series.patches)) as stage:
            for p in series.patches:
                try:
                    stage.run([p], reverse=False, relocate=not series.pinned)
                    out.append((p.name, "not applied"))
                except SeriesError as e:
                    out.append((p.name, f"conflicting: {e}"))
        return out + skipped


def recorded_patches(manifest: dict) -> tuple[Patch, ...]:
    return tuple(Patch(path=Path(p["name"]), text=p["text"]) for p in manifest["patches"])


def files_of(patches: Iterable[Patch]) -> list[str]:
    return list(dict.fromkeys(f.path for p in patches for f in p.files))


class _PatchNgLog(logging.Handler):
    """Collects patch-ng's messages, which are its only error report."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


class Staging:
    """Copies of some tree files in a temporary directory, patched there."""

    def __init__(self, root: Path, files: list[str]):
        self.root = root
        self.files = files

    def __enter__(self) -> Staging:
        self.dir = Path(tempfile.mkdtemp(prefix="afd-stage-"))
        for rel in self.files:
            src = self.root / rel
            if src.is_file():
                (self.dir / rel).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(src, self.dir / rel)
        return self

    def __exit__(self, *exc) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)

    def run(
        self, patches: Iterable[Patch], reverse: bool, log=None, relocate: bool = False
    ) -> list[Patch]:
        """Apply (or revert) ``patches`` in order; returns them as applied.
        ``relocate``: first move each hunk to where its lines are."""
        done = []
        for patch in patches:
            if not patch.files:
                done.append(patch)
                continue
            missing = [f.path for f in patch.files if not (self.dir / f.path).is_file()]
            if missing:
                raise SeriesError(f"{patch.name}: {missing[0]} does not exist in the vLLM tree")
            if relocate and not reverse:
                patch = self._relocated(patch)
            # patch-ng writes file by file; keep the pre-patch state so a
            # failure is explained against it and leaves no half-applied patch
            saved = {f.path: (self.dir / f.path).read_bytes() for f in patch.files}
            handler = _PatchNgLog()
            ng_logger = logging.getLogger("patch_ng")
            ng_logger.addHandler(handler)
            ng_logger.setLevel(logging.INFO)
            try:
                ps = patch.patchset()
                ok = (
                    ps.revert(strip=1, root=str(self.dir))
                    if reverse
                    else ps.apply(strip=1, root=str(self.dir))
                )
            finally:
                ng_logger.removeHandler(handler)
            # patch-ng calls an already-applied file a success; we do not.
            if not ok or any("already patched" in m for m in handler.lines):
                for rel, data in saved.items():
                    (self.dir / rel).write_bytes(data)
                raise SeriesError(self._explain(patch, reverse, handler.lines, relocate))
            if log:
                log(f"{'reversed' if reverse else 'applied'} {patch.name}")
            done.append(patch)
        return done

    def _relocated(self, patch: Patch) -> Patch:
        """``patch`` moved to where its hunks are in the staged files, with
        up to ``RELEASE_FUZZ`` context lines dropped from a hunk's ends where
        they differ; a hunk so reduced must match at one place only.
        Returned unchanged where a hunk matches nowhere: patch-ng then fails,
        and ``_explain`` names the hunk."""
        files = []
        for fp in patch.files:
            text = (self.dir / fp.path).read_text().splitlines()
            results = apply_file_patch(text, fp, RELEASE_FUZZ, max_offset=None)[1]
            if not all(r.ok for r in results):
                return patch
            hunks, delta = [], 0
            for r in results:
                hunk = trimmed(r.hunk, r.fuzz)
                start = r.line + (hunk.start_src - r.hunk.start_src)  # in the text so far
                if r.fuzz and occurrences(text, hunk) != 1:
                    raise SeriesError(
                        f"{patch.name}: {fp.path} hunk #{hunk.index} matches only without "
                        f"{r.fuzz} context line(s), and then at several places. Write a "
                        "variant of the patch for this release (docs/patch-series.md)."
                    )
                hunks.append(FileHunk(hunk.index, start - delta, start, hunk.lines))
                delta += sum(x[0] == "+" for x in hunk.lines) - sum(x[0] == "-" for x in hunk.lines)
            files.append(FilePatch(fp.path, tuple(hunks)))
        return patch.with_files(files)

    def _explain(
        self, patch: Patch, reverse: bool, ng_lines: list[str], relocate: bool = False
    ) -> str:
        """Name the first file and hunk that does not match (exactly, or at
        any line with ``relocate``)."""
        verb = "reverse" if reverse else "apply"
        for fp in patch.files:
            text = (self.dir / fp.path).read_text().splitlines()
            if reverse:
                fp = _inverted(fp)
            if relocate:
                results = apply_file_patch(text, fp, RELEASE_FUZZ, max_offset=None)[1]
                fix = "Write a variant of the patch for this release (docs/patch-series.md)."
            else:
                results = apply_file_patch(text, fp)[1]
                fix = (
                    f"Refresh the patch against vLLM {'' if reverse else 'pristine '}sources "
                    "(scripts/apply_patches.py refresh)."
                )
            for r in results:
                if not r.ok:
                    return (
                        f"{patch.name} does not {verb}: {fp.path} hunk #{r.hunk.index} "
                        f"({r.hunk.header}) does not match the tree. {fix}"
                    )
        detail = "; ".join(ng_lines[-3:]) or "no detail from patch-ng"
        return f"{patch.name} does not {verb}: {detail}"

    def read(self, rel: str) -> str:
        path = self.dir / rel
        return path.read_text() if path.is_file() else ""

    def commit(self) -> None:
        for rel in self.files:
            staged = self.dir / rel
            if staged.is_file():
                shutil.copy2(staged, self.root / rel)


def _inverted(fp: FilePatch) -> FilePatch:
    """The same file patch with '+' and '-' swapped (for reverse checks)."""
    swap = {"+": "-", "-": "+", " ": " "}
    return FilePatch(
        path=fp.path,
        hunks=tuple(
            FileHunk(h.index, h.start_tgt, h.start_src, tuple(swap[x[0]] + x[1:] for x in h.lines))
            for h in fp.hunks
        ),
    )
