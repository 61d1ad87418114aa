"""FFN rank groups on GPUs, eager and with FULL_DECODE_ONLY graphs (the
group's graphs hold its all-reduces).

On two GPUs: a tensor-parallel attention rank (TP 2, GPUs 0 and 1) served
by one FFN rank of two processes (GPUs 1 and 0, each sharing its GPU with
one attention TP rank; only TP rank 0 and the group's leader exchange, over
ipc). The group splits the MoE experts by their intermediate size (FFN TP 2)
or shares them out whole (FFN EP 2, vLLM's expert parallelism). Greedy
tokens must equal stock vLLM at the same parallel sizes
(``tensor_parallel_size=2``, with ``enable_expert_parallel`` for EP), whose
shards and reductions are the same. Each group process must hold half of
the experts' bytes, and with EP read only its half of the experts from the
checkpoint; the test prints both with each process's peak memory.

On one GPU (a test placement, ``vllm_afd_dev.harness.one_gpu_ffn_group``): attention
TP 1 and both processes of the FFN group on GPU 0, over ipc. The group sums
two shards where stock vLLM at TP 1 runs each MoE whole, so these runs use
float32 (TRITON_ATTN), where that difference in reduction order stays far
below the greedy margin (as in the tensor-parallel attention test). vLLM's
MLA backends take no float32, so DeepSeek-V2 runs its standard-attention
path there (``VLLM_MLA_DISABLE=1``, as on CPU); what the group splits (the
dense first layer, the routed and shared experts, grouped top-k routing) is
the same either way. The two-GPU shape also runs on one GPU, every process
on GPU 0: attention TP 2 as two engine processes (``run_tp_ranks_on_one_gpu``),
bf16 against stock vLLM at TP 2 placed the same way, DeepSeek-V2 with MLA.

On four GPUs, the same FFN EP 2 group runs on GPUs of its own (2 and 3,
``ffn_first_device``), started by hand, with nccl between the roles.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path

import pytest

from vllm_afd_dev.harness.generate import afd_engine_args, ffn_bytes_read, ffn_weight_bytes, run
from vllm_afd_dev.harness.gpu_settings import (
    EAGER_AND_GRAPHS,
    check_step_counters,
    engine,
    ffn_cli_args,
    needs_gpus,
    placement_env,
    recording_into,
    two_gpus,
)
from vllm_afd_dev.harness.launch import (
    ONE_GPU_FFN_GROUP,
    assert_every_prompt_changed,
    attention_args,
    checkpoint_expert_bytes,
    checkpoint_ffn_bytes,
    run_tp_ranks_on_one_gpu,
    running_ffn_rank,
    zeroed_ffn_rank,
)


def tp2_engine(mla: bool, setting: str = "eager") -> dict:
    return engine(setting, mla) | {"tensor_parallel_size": 2}


GROUPS = {
    "ffn_tp2": {"ffn_tensor_parallel_size": 2},
    "ffn_ep2": {"ffn_tensor_parallel_size": 2, "ffn_enable_expert_parallel": True},
}
PEAK = re.compile(r"AFD FFN group rank (\d) of 2 on (\S+): peak device memory ([\d.]+) MiB")


@functools.cache
def stock_tp2(model, mla: bool, expert_parallel: bool, setting: str = "eager") -> dict:
    ep = {"enable_expert_parallel": expert_parallel}
    return run(model, tp2_engine(mla, setting) | ep, stock=True)


@two_gpus
@pytest.mark.parametrize("setting", EAGER_AND_GRAPHS)
@pytest.mark.parametrize("group", GROUPS)
@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v2"])
def test_ffn_group_matches_stock_at_the_same_parallel_sizes(
    arch, group, setting, request, tmp_path
):
    model = request.getfixturevalue(f"tiny_{arch}")
    mla = arch == "deepseek_v2"
    engine_args = tp2_engine(mla, setting)
    args = afd_engine_args(engine_args, connector="ipc", stats_dir=str(tmp_path), **GROUPS[group])
    afd = run(model, args)
    expert_parallel = GROUPS[group].get("ffn_enable_expert_parallel", False)
    stock = stock_tp2(model, mla, expert_parallel, setting)
    assert afd["tokens"] == stock["tokens"]
    check_step_counters(tmp_path, setting)
    shares = check_group_shares(model, group, afd["log"], {"cuda:0", "cuda:1"})
    # A colocated TP rank holds the attention side's share plus the FFN's.
    assert afd["weight_bytes"] + shares[0] == stock["weight_bytes"]


def check_group_shares(model, group: str, log: str, devices: set[str]) -> list[int]:
    """Each process of the group holds half of the FFN weights, on
    ``devices``, and read its share of the checkpoint: every FFN tensor with
    tensor parallelism (the loaders slice them); with expert parallelism
    half of the experts' tensors fewer, left unread for the other process.
    Returns the weight bytes per process."""
    shares, peaks = ffn_weight_bytes(log), PEAK.findall(log)
    print(f"  {group}: FFN weight bytes per process {shares}, peak memory {peaks}")
    assert len(shares) == 2 and shares[0] == shares[1]
    assert len(peaks) == 2 and {device for _, device, _ in peaks} == devices
    ffn_bytes = sum(checkpoint_ffn_bytes(model, gate_on_attention=False))
    expert_parallel = GROUPS[group].get("ffn_enable_expert_parallel", False)
    unread = checkpoint_expert_bytes(model) // 2 if expert_parallel else 0
    reads = ffn_bytes_read(log)
    print(f"  {group}: checkpoint bytes read per process {reads} of {ffn_bytes}")
    assert reads == [ffn_bytes - unread] * 2
    return shares


FLOAT32 = dict(dtype="float32", attention_backend="TRITON_ATTN")
# The one-GPU float32 runs' environment per architecture. DeepSeek-V2: no MLA
# in float32 (above).
GPU0 = placement_env("ipc-1gpu")
FLOAT32_ENV = {"qwen3_moe": GPU0, "deepseek_v2": GPU0 | {"VLLM_MLA_DISABLE": "1"}}


@functools.cache
def stock_one_gpu(model, arch: str, setting: str) -> dict:
    return run(model, engine(setting) | FLOAT32, stock=True, env=FLOAT32_ENV[arch])


def one_gpu_group(
    arch: str, setting: str, group: str, stats_dir: Path | None = None
) -> tuple[dict, dict]:
    """The FFN side's and the attention side's arguments for one GPU, both
    recording into ``stats_dir``."""
    afd = GROUPS[group] | {"connector": "ipc"} | recording_into(stats_dir)
    ffn = {
        "engine": (*ffn_cli_args(setting, dtype="float32"), "--disable-custom-all-reduce"),
        "command": ONE_GPU_FFN_GROUP,
        "env": FLOAT32_ENV[arch],
        **afd,
    }
    return ffn, {"engine": engine(setting) | FLOAT32, **afd}


@pytest.mark.parametrize("setting", EAGER_AND_GRAPHS)
@pytest.mark.parametrize("group", GROUPS)
@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v2"])
def test_ffn_group_sharing_one_gpu_matches_stock(arch, group, setting, request, tmp_path):
    model = request.getfixturevalue(f"tiny_{arch}")
    ffn_args, attention = one_gpu_group(arch, setting, group, tmp_path)
    with running_ffn_rank(model, tmp_path, **ffn_args) as (port, log):
        afd = run(model, attention_args(port, **attention), env=FLOAT32_ENV[arch])
    assert afd["tokens"] == stock_one_gpu(model, arch, setting)["tokens"]
    ffn_log = log.read_text()
    check_step_counters(tmp_path, setting)
    check_group_shares(model, group, ffn_log, {"cuda:0"})


@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v2"])
def test_negative_control_ffn_group_on_one_gpu_with_a_zeroed_layer(arch, request, tmp_path):
    model, setting = request.getfixturevalue(f"tiny_{arch}"), "FULL_DECODE_ONLY"
    ffn_args, attention = one_gpu_group(arch, setting, "ffn_ep2")
    with zeroed_ffn_rank(model, tmp_path, **ffn_args) as port:
        broken = run(model, attention_args(port, **attention), env=FLOAT32_ENV[arch])
    assert_every_prompt_changed(broken["tokens"], stock_one_gpu(model, arch, setting)["tokens"])


@functools.cache
def stock_tp2_on_one_gpu(model, mla: bool, expert_parallel: bool, setting: str) -> dict:
    ep = {"enable_expert_parallel": expert_parallel}
    return run_tp_ranks_on_one_gpu(model, engine(setting, mla) | ep, stock=True, env=GPU0)


def tp2_beside_one_gpu_group(
    arch: str, setting: str, group: str, stats_dir: Path | None = None
) -> tuple[dict, dict]:
    """The FFN group's and the attention TP ranks' arguments, bf16, one GPU,
    both recording into ``stats_dir``."""
    afd = GROUPS[group] | {"connector": "ipc"} | recording_into(stats_dir)
    ffn_engine = (*ffn_cli_args(setting), "--disable-custom-all-reduce")
    ffn = dict(engine=ffn_engine, command=ONE_GPU_FFN_GROUP, env=GPU0, **afd)
    return ffn, {"engine": engine(setting, arch == "deepseek_v2"), **afd}


@pytest.mark.parametrize("setting", EAGER_AND_GRAPHS)
@pytest.mark.parametrize("group", GROUPS)
@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v2"])
def test_tp2_attention_and_ffn_group_sharing_one_gpu_match_stock_tp2(
    arch, group, setting, request, tmp_path
):
    """The two-GPU shape above with every process on GPU 0: attention TP 2
    (``run_tp_ranks_on_one_gpu``) and the FFN group (``ONE_GPU_FFN_GROUP``),
    bf16 against stock vLLM at TP 2 placed the same way, DeepSeek-V2 with
    MLA. Without vLLM's custom all-reduce (it needs a GPU per process)."""
    model = request.getfixturevalue(f"tiny_{arch}")
    ffn_args, attention = tp2_beside_one_gpu_group(arch, setting, group, tmp_path)
    with running_ffn_rank(model, tmp_path, **ffn_args) as (port, log):
        result = run_tp_ranks_on_one_gpu(model, attention_args(port, **attention), env=GPU0)
    expert_parallel = GROUPS[group].get("ffn_enable_expert_parallel", False)
    stock = stock_tp2_on_one_gpu(model, arch == "deepseek_v2", expert_parallel, setting)
    assert result["tokens"] == stock["tokens"]
    ffn_log = log.read_text()
    check_step_counters(tmp_path, setting)
    shares = check_group_shares(model, group, ffn_log, {"cuda:0"})
    assert result["weight_bytes"] + shares[0] == stock["weight_bytes"]


@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v2"])
def test_negative_control_tp2_attention_and_ffn_group_on_one_gpu(arch, request, tmp_path):
    model, setting = request.getfixturevalue(f"tiny_{arch}"), "FULL_DECODE_ONLY"
    ffn_args, attention = tp2_beside_one_gpu_group(arch, setting, "ffn_ep2")
    with zeroed_ffn_rank(model, tmp_path, **ffn_args) as port:
        broken = run_tp_ranks_on_one_gpu(model, attention_args(port, **attention), env=GPU0)
    stock = stock_tp2_on_one_gpu(model, arch == "deepseek_v2", True, setting)
    assert_every_prompt_changed(broken["tokens"], stock["tokens"])


@needs_gpus(4)
@pytest.mark.parametrize("setting", EAGER_AND_GRAPHS)
@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v2"])
def test_attention_tp2_and_ffn_ep2_on_their_own_gpus_over_nccl(arch, setting, request, tmp_path):
    """Four GPUs, each process on its own: attention TP 2 on GPUs 0 and 1, the
    FFN rank's two expert-parallel processes on GPUs 2 and 3, started by hand
    (``ffn_first_device``, as README says for tensor-parallel attention
    ranks on the same node), exchanging over nccl."""
    model = request.getfixturevalue(f"tiny_{arch}")
    mla = arch == "deepseek_v2"
    group = GROUPS["ffn_ep2"] | {"connector": "nccl"} | recording_into(tmp_path)
    ffn_args = dict(engine=ffn_cli_args(setting), ffn_first_device=2, **group)
    with running_ffn_rank(model, tmp_path, **ffn_args) as (port, log):
        afd = run(model, attention_args(port, engine=tp2_engine(mla, setting), **group))
    assert afd["tokens"] == stock_tp2(model, mla, True, setting)["tokens"]
    ffn_log = log.read_text()
    check_step_counters(tmp_path, setting)
    check_group_shares(model, "ffn_ep2", ffn_log, {"cuda:2", "cuda:3"})
