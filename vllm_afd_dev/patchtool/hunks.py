"""Locating hunks in a file that may have moved on: offsets and fuzz.

patch-ng applies a hunk only at the exact line its header names, which is
right for the pinned tree and useless for asking how far a newer vLLM release
has drifted. This module answers that question (and names the first hunk that
does not match when patch-ng refuses a patch) the way GNU patch would: search
outwards from the expected line, then retry with up to ``max_fuzz`` context
lines dropped from each end of the hunk.
"""

from __future__ import annotations

from dataclasses import dataclass

from .series import FileHunk, FilePatch


@dataclass(frozen=True)
class HunkResult:
    hunk: FileHunk
    line: int | None  # 1-based line where it matched, None if nowhere
    offset: int = 0
    fuzz: int = 0

    @property
    def ok(self) -> bool:
        return self.line is not None

    @property
    def exact(self) -> bool:
        return self.ok and self.offset == 0 and self.fuzz == 0


def _body(hunk: FileHunk, fuzz: int) -> tuple[list[str], int]:
    """The lines of ``hunk`` with up to ``fuzz`` context lines dropped at
    each end, and how many leading lines were dropped."""
    lines = list(hunk.lines)
    lead = 0
    while lead < fuzz and lead < len(lines) and lines[lead][0] == " ":
        lead += 1
    trail = 0
    while trail < fuzz and trail < len(lines) - lead and lines[-1 - trail][0] == " ":
        trail += 1
    return lines[lead : len(lines) - trail], lead


def _split(hunk: FileHunk, fuzz: int) -> tuple[list[str], list[str], int]:
    """Old and new lines of ``hunk`` with up to ``fuzz`` context lines dropped
    at each end; also how many leading lines were dropped."""
    body, lead = _body(hunk, fuzz)
    old = [line[1:] for line in body if line[0] in " -"]
    new = [line[1:] for line in body if line[0] in " +"]
    return old, new, lead


def trimmed(hunk: FileHunk, fuzz: int) -> FileHunk:
    """``hunk`` without the context lines that fuzz ``fuzz`` drops."""
    body, lead = _body(hunk, fuzz)
    return FileHunk(hunk.index, hunk.start_src + lead, hunk.start_tgt + lead, tuple(body))


def occurrences(text: list[str], hunk: FileHunk) -> int:
    """How many times the lines ``hunk`` replaces appear in ``text``."""
    old = [line[1:] for line in hunk.lines if line[0] in " -"]
    return sum(text[i : i + len(old)] == old for i in range(len(text) - len(old) + 1))


def _find(text: list[str], old: list[str], expected: int, lo: int) -> int | None:
    """Index of ``old`` in ``text`` at or after ``lo``, nearest to ``expected``."""
    last = len(text) - len(old)
    for distance in range(0, max(expected - lo, last - expected) + 1):
        for pos in (expected - distance, expected + distance):
            if lo <= pos <= last and text[pos : pos + len(old)] == old:
                return pos
    return None


def apply_file_patch(
    text: list[str], file_patch: FilePatch, max_fuzz: int = 0, max_offset: int | None = 0
) -> tuple[list[str], list[HunkResult]]:
    """Apply the hunks of ``file_patch`` to ``text`` (lines without newlines).

    Returns the patched lines and one result per hunk. A hunk that matches
    nowhere is left out and reported with ``line=None``; later hunks are still
    tried, so one call reports every failing hunk. ``max_offset=None`` allows
    any offset.
    """
    out = list(text)
    results = []
    delta = 0  # lines added minus removed by the hunks applied so far
    lo = 0  # hunks apply in order and never overlap
    for hunk in file_patch.hunks:
        for fuzz in range(max_fuzz + 1):
            old, new, lead = _split(hunk, fuzz)
            expected = hunk.start_src - 1 + delta + lead
            pos = _find(out, old, expected, lo)
            if pos is not None and (max_offset is None or abs(pos - expected) <= max_offset):
                out[pos : pos + len(old)] = new
                results.append(HunkResult(hunk, pos + 1 - lead, pos - expected, fuzz))
                delta += len(new) - len(old)
                lo = pos + len(new)
                break
        else:
            results.append(HunkResult(hunk, None))
    return out, results
