"""The AFD process set-up: the environment a process of the deployment sets
for itself and the processes it starts, once it has built its config."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
from vllm.afd.platform import mps, process_setup
from vllm.afd.platform.process_setup import set_up_afd_process
from vllm.config import AFDConfig
from vllm.engine.arg_utils import EngineArgs

SET_UP = ("OMP_WAIT_POLICY", mps.THREAD_PERCENTAGE_VARIABLE)


@pytest.fixture
def clean_env(monkeypatch):
    """None of the variables the set-up writes, and each as it was after the test."""
    for variable in SET_UP:
        monkeypatch.setenv(variable, "")
        monkeypatch.delenv(variable)


@pytest.fixture
def daemons(monkeypatch) -> list[None]:
    """Each private MPS daemon the set-up asks for (none really starts here)."""
    started: list[None] = []
    monkeypatch.setattr(process_setup, "ensure_private_daemon", lambda: started.append(None))
    return started


def holder(device: str, **afd) -> SimpleNamespace:
    return SimpleNamespace(
        afd_config=AFDConfig(**afd), device_config=SimpleNamespace(device_type=device)
    )


def test_on_cpu_openmp_waits_passively_unless_told_otherwise(clean_env, daemons, monkeypatch):
    set_up_afd_process(holder("cpu"))
    assert os.environ["OMP_WAIT_POLICY"] == "PASSIVE"
    assert mps.THREAD_PERCENTAGE_VARIABLE not in os.environ and not daemons
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    set_up_afd_process(holder("cpu", role="ffn"))
    assert os.environ["OMP_WAIT_POLICY"] == "ACTIVE"


def test_on_gpus_each_role_takes_its_sm_share_and_mps_start_starts_a_daemon(clean_env, daemons):
    split = {"attention": 40, "ffn": 60}
    set_up_afd_process(
        holder("cuda", connector="ipc", mps="start", mps_active_thread_percentage=split)
    )
    assert os.environ[mps.THREAD_PERCENTAGE_VARIABLE] == "40" and len(daemons) == 1
    # The FFN side that spawn_ffn starts runs with "mps": "off" and its own share.
    ffn = holder("cuda", role="ffn", connector="ipc", mps="off",
                 mps_active_thread_percentage=split)  # fmt: skip
    set_up_afd_process(ffn)
    assert os.environ[mps.THREAD_PERCENTAGE_VARIABLE] == "60" and len(daemons) == 1
    assert "OMP_WAIT_POLICY" not in os.environ


def test_without_afd_nothing_is_set(clean_env, daemons):
    set_up_afd_process(SimpleNamespace(afd_config=None, device_config=None))
    assert not any(v in os.environ for v in SET_UP) and not daemons


def test_the_engine_config_sets_up_the_process_that_builds_it(tiny_qwen3, clean_env):
    """Every front end (LLM, vllm serve, vllm afd-ffn) builds its config
    with create_engine_config, before it starts any other process."""
    EngineArgs(model=str(tiny_qwen3)).create_engine_config()
    assert "OMP_WAIT_POLICY" not in os.environ  # stock vLLM: AFD sets nothing
    EngineArgs(model=str(tiny_qwen3), afd_config={}).create_engine_config()
    assert os.environ["OMP_WAIT_POLICY"] == "PASSIVE"
