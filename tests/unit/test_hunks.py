"""The hunk locator: exact, offset, fuzz and failure, as rebase-check reports them."""

from __future__ import annotations

import pytest

from vllm_afd_dev.patchtool.hunks import apply_file_patch
from vllm_afd_dev.patchtool.series import FileHunk, FilePatch

BASE = [f"line {i}" for i in range(1, 21)]


def hunk(start: int) -> FilePatch:
    # replaces "line 10" with "ten", three lines of context each side
    body = (" line 7", " line 8", " line 9", "-line 10", "+ten", " line 11", " line 12", " line 13")
    return FilePatch("f.py", (FileHunk(1, start, start, body),))


def test_exact():
    out, [r] = apply_file_patch(BASE, hunk(7))
    assert r.exact and r.line == 7
    assert out[9] == "ten" and len(out) == len(BASE)


def test_offset_found_only_when_allowed():
    shifted = ["new"] * 5 + BASE
    _, [r] = apply_file_patch(shifted, hunk(7))
    assert not r.ok
    out, [r] = apply_file_patch(shifted, hunk(7), max_offset=None)
    assert r.ok and r.offset == 5 and r.fuzz == 0
    assert out[14] == "ten"


def test_fuzz_drops_outer_context():
    edited = list(BASE)
    edited[6] = "line 7 changed upstream"
    _, [r] = apply_file_patch(edited, hunk(7), max_fuzz=0, max_offset=None)
    assert not r.ok
    out, [r] = apply_file_patch(edited, hunk(7), max_fuzz=1, max_offset=None)
    assert r.ok and r.fuzz == 1 and out[9] == "ten"


@pytest.mark.parametrize("index", [9, 10])  # the removed line; inner context
def test_changed_core_fails_even_with_fuzz(index):
    edited = list(BASE)
    edited[index] = "rewritten upstream"
    _, [r] = apply_file_patch(edited, hunk(7), max_fuzz=2, max_offset=None)
    assert not r.ok and r.line is None


def test_every_failing_hunk_is_reported():
    two = FilePatch(
        "f.py",
        (
            FileHunk(1, 1, 1, (" line 1", "-line 2", "+two", " line 3")),
            FileHunk(2, 15, 15, (" line 15", "-line 16", "+sixteen", " line 17")),
        ),
    )
    edited = list(BASE)
    edited[1] = edited[15] = "gone"
    _, results = apply_file_patch(edited, two)
    assert [r.ok for r in results] == [False, False]
    assert [r.hunk.index for r in results] == [1, 2]
