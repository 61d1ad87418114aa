"""`vllm afd-ffn` runs one process per FFN rank and group rank: a failed
process takes down its own group (whose other processes would wait for it
forever), never another FFN rank; on CPU each process's OpenMP threads are
bound as vLLM binds its workers'; a rank leaves no files behind."""

from __future__ import annotations

import gc
import multiprocessing
import os
import sys
import time

import pytest
from vllm.afd.ffn.server import _join_stopping_failed_groups
from vllm.afd.ffn.worker import FFNWorker
from vllm.afd.platform.cpu_binding import (
    WORKER_BINDING_ENV,
    FFNThreadBinding,
    without_worker_binding,
)
from vllm.engine.arg_utils import EngineArgs


def _exit_with(code: int, after_s: float) -> None:
    time.sleep(after_s)
    sys.exit(code)


def _groups(spec: list[list[tuple[int, float]]]) -> list[list]:
    ctx = multiprocessing.get_context("fork")
    groups = [
        [
            ctx.Process(target=_exit_with, args=args, name=f"AFD_FFN_{r}_TP{g}")
            for g, args in enumerate(group)
        ]
        for r, group in enumerate(spec)
    ]
    for p in (p for group in groups for p in group):
        p.start()
    return groups


def test_a_failed_process_stops_its_group_and_spares_the_other_ranks():
    # FFN rank 0: its follower fails at once, its leader would run for a minute.
    # FFN rank 1: both processes finish cleanly after the failure.
    started = time.monotonic()
    groups = _groups([[(0, 60.0), (3, 0.0)], [(0, 1.0), (0, 1.0)]])
    failed = _join_stopping_failed_groups(groups)
    assert time.monotonic() - started < 30
    assert failed == {"AFD_FFN_0_TP0": -15, "AFD_FFN_0_TP1": 3}
    assert [p.exitcode for p in groups[1]] == [0, 0]


def test_clean_exits_report_nothing():
    assert _join_stopping_failed_groups(_groups([[(0, 0.1)], [(0, 0.2)]])) == {}


# On CPU the FFN processes' OpenMP threads follow VLLM_CPU_OMP_THREADS_BIND,
# applied around each process's start as vLLM applies it to its workers.


def _binding_env() -> dict[str, str | None]:
    return {k: os.environ.get(k) for k in WORKER_BINDING_ENV}


def test_each_ffn_process_starts_with_its_own_core_list(monkeypatch):
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")
    before = _binding_env()
    binding = FFNThreadBinding(2)
    for index in (0, 1):
        with binding.around_start(index):
            assert os.environ["OMP_NUM_THREADS"] == "1"
            places = [os.environ.get(k) for k in ("OMP_PLACES", "GOMP_CPU_AFFINITY")]
            assert f"{{{index}}}" in places or str(index) in places, places
    assert _binding_env() == before


def test_nobind_leaves_the_environment_alone(monkeypatch):
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    before = _binding_env()
    with FFNThreadBinding(2).around_start(1):
        assert _binding_env() == before


def test_a_core_list_per_process_is_required(monkeypatch):
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")
    with pytest.raises(ValueError, match="FFN side's 3 processes.*one core list per process"):
        FFNThreadBinding(3)


def test_a_spawned_ffn_side_drops_the_attention_workers_binding(monkeypatch):
    inherited = {"OMP_PLACES": "{0}", "OMP_NUM_THREADS": "1", "PATH": "/bin"}
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")
    assert without_worker_binding(inherited) == {"PATH": "/bin"}
    # With nobind these variables are the user's own.
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    assert without_worker_binding(inherited) == inherited


def test_a_one_process_ffn_rank_removes_its_rendezvous_folder(tiny_qwen3):
    """A rank of one process makes a folder for its group's file store; it
    goes with the worker, so starts of `vllm afd-ffn` do not pile up folders."""
    config = EngineArgs(model=str(tiny_qwen3), afd_config={"role": "ffn"}).create_engine_config()
    worker = FFNWorker(config, 0)
    folder = worker.group_store.parent
    assert folder.is_dir()
    del worker
    gc.collect()
    assert not folder.exists()
