"""refresh: regenerate one patch from an edited tree (the quilt workflow).

Edit the files of a patched tree, then ``refresh NNNN --vllm-dir DIR``. The
patch is rewritten as the difference between

* the pristine files with the patches *before* it applied, and
* the edited files with the patches *after* it reversed,

so that each patch keeps only its own change and the series stays ordered.
The patch's DEP-3 header is kept. ``--add PATH`` brings an upstream file the
patch did not touch yet into it. On a tree of another supported release X the
result is the patch's variant for X, ``patches/X/NAME``; except on the release
the patch itself is written for (``Series.written_for``: the pinned one, or
for a patch that requires what a later release added, the first supported
release with it), where it is the patch itself.
"""

from __future__ import annotations

import difflib
import json
from pathlib import Path

from .series import Patch, Series, SeriesError
from .tree import MANIFEST, Staging, VllmTree, files_of, recorded_patches


def refresh_patch(
    series: Series, name: str, tree: VllmTree, pristine: VllmTree, add: list[str], log=print
) -> Path:
    series = tree.release(series)
    patch = series.patch(name)
    k = series.patches.index(patch)
    relocate = not series.pinned
    before, after = series.patches[:k], series.patches[k + 1 :]
    own = list(dict.fromkeys([f.path for f in patch.files] + add))
    for rel in own:
        if not (pristine.root / rel).is_file():
            raise SeriesError(f"{rel} is not an upstream file; new files go in overlay/")

    with Staging(pristine.root, list(dict.fromkeys(files_of(before) + own))) as base:
        base.run(before, reverse=False, relocate=relocate)
        old = {rel: base.read(rel) for rel in own}
    with Staging(tree.root, list(dict.fromkeys(files_of(after) + own))) as edited:
        try:
            edited.run(reversed(_as_applied(tree, after) if relocate else after), reverse=True)
        except SeriesError as e:
            raise SeriesError(
                f"cannot take the later patches back out of {tree.root} ({e}); "
                "refresh the series from the last patch down"
            ) from e
        new = {rel: edited.read(rel) for rel in own}

    diff = []
    for rel in own:
        diff += difflib.unified_diff(
            old[rel].splitlines(keepends=True),
            new[rel].splitlines(keepends=True),
            fromfile=f"a/{rel}",
            tofile=f"b/{rel}",
        )
    if not diff:
        raise SeriesError(f"{patch.name} would be empty: the tree carries no change of its own")
    target = patch.path
    if series.release != series.written_for(patch):
        target = series.root / "patches" / series.release / patch.name
        target.parent.mkdir(exist_ok=True)
    target.write_text(patch.header + "".join(diff))
    log(f"refreshed {target.relative_to(series.root)} ({len(diff)} diff lines)")

    manifest = tree.manifest()
    if manifest is not None and manifest["series_hash"] == series.hash:
        # the tree held the series and now holds the refreshed one
        refreshed = Series.load(series.root).for_release(series.release)
        new_patch = refreshed.patch(name)
        for entry in manifest["patches"]:
            if entry["name"] == new_patch.name:
                entry.update(sha256=new_patch.sha256, text=new_patch.text)
        manifest["series_hash"] = refreshed.hash
        (tree.root / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    return target


def _as_applied(tree: VllmTree, patches: tuple[Patch, ...]) -> list[Patch]:
    """``patches`` as the tree's manifest records them: on a release other
    than the pinned one they were moved to where they apply there."""
    manifest = tree.manifest()
    recorded = {p.name: p for p in recorded_patches(manifest)} if manifest else {}
    missing = [p.name for p in patches if p.name not in recorded]
    if missing:
        raise SeriesError(
            f"{tree.root} does not record {missing[0]} as applied: apply the series to it "
            "(scripts/apply_patches.py apply) before editing and refreshing"
        )
    return [recorded[p.name] for p in patches]
