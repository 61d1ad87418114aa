"""The GPU test groups (tests/gpu/groups.toml) and their runner
(scripts/gpu_test_groups.py, vllm_afd_dev.gpu_groups), on the CPU: the plan
of a suite, and groups of stand-in tests run side by side."""

from __future__ import annotations

import subprocess
import sys

import pytest

from vllm_afd_dev import ROOT
from vllm_afd_dev.gpu_groups import (
    DEFAULT_JOBS,
    Group,
    group_environments,
    load_groups,
    main,
    parts,
    run_groups,
    suite,
)

CALL_LIMIT_S = 540
"""The runner's default --timeout: one call on the GPU machine (10 minutes a
command) with room for its start."""


def test_every_group_names_existing_files_and_fits_one_call():
    groups = load_groups()
    assert len({g.name for g in groups}) == len(groups)
    for g in groups:
        assert all((ROOT / f).is_file() and f.startswith("tests/gpu/") for f in g.files), g
        assert 0 < g.budget_s <= CALL_LIMIT_S, g
        assert "-k" not in g.pytest_args


def test_suite_all_takes_the_groups_one_gpu_runs_in_parts_of_at_most_jobs():
    groups = load_groups()
    one_gpu = suite("all", groups, gpus=1)
    assert one_gpu and all(g.gpus == 1 for g in one_gpu)
    assert {g.name for g in groups if g.gpus > 1} and not {g for g in one_gpu if g.gpus > 1}
    assert suite("all", groups, gpus=8) == groups
    cut = parts(one_gpu, DEFAULT_JOBS)
    assert sorted(g.name for part in cut for g in part) == sorted(g.name for g in one_gpu)
    assert all(0 < len(part) <= DEFAULT_JOBS for part in cut)
    assert len(cut) == -(-len(one_gpu) // DEFAULT_JOBS)
    with pytest.raises(ValueError, match="unknown suite"):
        suite("nightly", groups, gpus=1)


def test_a_bad_group_is_refused_naming_it(tmp_path):
    path = tmp_path / "groups.toml"
    path.write_text('[[group]]\nname = "x"\nfiles = ["tests/gpu/test_afd_gpu.py"]\nmps = true\n')
    with pytest.raises(ValueError, match=r"group 1 \(x\).*missing \['budget_s'\]"):
        load_groups(path)
    path.write_text('[[group]]\nname = "x"\nfiles = ["a.py"]\nbudget_s = 1\nmps = false\n' * 2)
    with pytest.raises(ValueError, match="group names repeat"):
        load_groups(path)


def test_a_group_is_one_pytest_process_of_the_gpu_tests():
    group = Group("g", ("tests/gpu/test_afd_gpu.py",), "eager and V1", gpus=2)
    assert group.devices == "0,1"
    assert group.command()[1:] == [
        "-m", "pytest", "-m", "gpu", "tests/gpu/test_afd_gpu.py", "-k", "eager and V1",
        "-v", "-s", "-p", "no:cacheprovider",
    ]  # fmt: skip
    everything = Group("all", ("tests/gpu/test_flag_kernels.py",), "", visible="3")
    assert "-k" not in everything.command() and everything.devices == "3"


def test_list_prints_the_plan_and_the_budget_sum(capsys):
    assert main(["--suite", "all", "--list"]) == 0
    plan = capsys.readouterr().out
    one_gpu = suite("all", load_groups(), gpus=1)
    total = sum(g.budget_s for g in one_gpu)
    assert plan.startswith(f"suite all: {len(one_gpu)} groups, budgets {total:.0f} s in all")
    assert "part 1:" in plan and "left out (more GPUs than --gpus)" in plan
    with pytest.raises(SystemExit):
        main(["--suite", "all", "--part", "99", "--list"])
    with pytest.raises(SystemExit):
        main(["--suite", "all", "--list", "--group-env", "nosuch", "A=1"])


def test_only_takes_the_named_groups_into_one_call(capsys):
    assert main(["--only", "patched", "1a1f", "--list"]) == 0
    plan = capsys.readouterr().out
    assert plan.startswith("suite of --only: 2 groups, budgets 600 s in all")
    assert [line.split()[0] for line in plan.splitlines()[2:]] == ["patched", "1a1f"]
    with pytest.raises(SystemExit):
        main(["--only", "1a1f", "nosuch", "--list"])
    with pytest.raises(SystemExit):
        main(["--only", "1a1f", "--suite", "all", "--list"])


def test_the_command_runs_as_a_script():
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gpu_test_groups.py"), "--suite", "all",
         "--gpus", "2", "--list"],
        capture_output=True, text=True, cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "dp-2gpu" in proc.stdout and "nccl-4gpu" in proc.stdout.split("left out")[-1]


def test_groups_run_side_by_side_and_report_failures_and_time_outs(tmp_path, capsys):
    tests = tmp_path / "tests"
    tests.mkdir()
    (tests / "test_stand_in.py").write_text(
        "import os, time\nimport pytest\n\npytestmark = pytest.mark.gpu\n\n"
        "def test_passes():\n    assert os.environ['CUDA_VISIBLE_DEVICES'] == '0'\n\n"
        "def test_fails():\n    assert os.environ.get('EXTRA') == 'yes'\n\n"
        "def test_hangs():\n    time.sleep(60)\n"
    )
    file = str(tests / "test_stand_in.py")
    groups = [Group("ok", (file,), "passes"), Group("bad", (file,), "fails"),
              Group("slow", (file,), "hangs"), Group("fixed", (file,), "fails")]  # fmt: skip
    logs = tmp_path / "logs"
    extra = {"fixed": {"EXTRA": "yes"}}
    failed = run_groups(groups, logs, 20, group_environments(mps=False), extra)
    assert sorted(failed) == ["bad", "slow"]
    out = capsys.readouterr().out
    assert "slow: killed: out of time" in out and "ok: " in out and "1 passed" in out
    assert "1 passed" in (logs / "fixed.log").read_text()
