"""The patch series: the pinned vLLM release, the ordered patches, the overlay."""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

import patch_ng

PROJECT_ROOT = Path(__file__).resolve().parents[2]
PATCH_NAME = re.compile(r"^\d{4}-[a-z0-9]+(-[a-z0-9]+)+\.patch$")


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

    def patchset(self) -> patch_ng.PatchSet:
        """A fresh patch-ng parse (patch-ng's apply() consumes its items)."""
        parsed = patch_ng.fromstring(self.text.encode())
        if not parsed or not parsed.items:
            raise SeriesError(f"{self.name}: patch-ng cannot parse a diff in it")
        return parsed

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
    overlay: dict[str, bytes] = field(repr=False)  # tree-relative path -> bytes

    @classmethod
    def load(cls, root: Path = PROJECT_ROOT) -> Series:
        pin = Pin.load(root / "VLLM_COMMIT")
        patches = []
        for path in sorted((root / "patches").glob("*.patch")):
            if not PATCH_NAME.match(path.name):
                raise SeriesError(f"patch name {path.name!r} does not follow NNNN-area-what.patch")
            patches.append(Patch(path=path, text=path.read_text()))
        overlay_root = root / "overlay"
        overlay = {
            p.relative_to(overlay_root).as_posix(): p.read_bytes()
            for p in sorted(overlay_root.rglob("*"))
            if p.is_file() and "__pycache__" not in p.parts
        }
        return cls(root=root, pin=pin, patches=tuple(patches), overlay=overlay)

    def patch(self, name: str) -> Patch:
        for p in self.patches:
            if name in (p.name, p.path.stem) or p.name.startswith(f"{name}-"):
                return p
        raise SeriesError(
            f"no patch named {name!r}; the series is: " + ", ".join(p.name for p in self.patches)
        )

    @cached_property
    def hash(self) -> str:
        """Short content hash of pin + patches + overlay (the wheel's local
        version and the manifest's identity)."""
        h = hashlib.sha256()
        h.update(f"{self.pin.commit} {self.pin.tag}\n".encode())
        for p in self.patches:
            h.update(p.name.encode() + b"\0" + p.text.encode() + b"\0")
        for path, data in self.overlay.items():
            h.update(path.encode() + b"\0" + data + b"\0")
        return h.hexdigest()[:10]
