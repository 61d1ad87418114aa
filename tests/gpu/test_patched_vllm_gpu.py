"""The patched CUDA tree on the GPU: AFD's graph-mode rule and stock equivalence.

Run on the GPU machine after the devkit is staged and the series applied
(scripts/gpu_prepare.sh apply), with PYTHONPATH=/tmp/site and
AFD_STOCK_VLLM=/tmp/vllm-pristine.
"""

from __future__ import annotations

import pytest

from vllm_afd_dev.harness.generate import run, stock_vllm_path
from vllm_afd_dev.harness.gpu_settings import GPU_ENGINE, memory_args


def test_afd_settles_full_decode_only_on_cuda(tiny_qwen3):
    from vllm.config import CUDAGraphMode
    from vllm.engine.arg_utils import EngineArgs

    def mode(**kw):
        return EngineArgs(model=str(tiny_qwen3), **kw).create_engine_config().compilation_config

    gpu_afd = {"connector": "nccl"}
    assert mode().cudagraph_mode == CUDAGraphMode.FULL_AND_PIECEWISE  # stock default
    assert mode(afd_config=gpu_afd).cudagraph_mode == CUDAGraphMode.FULL_DECODE_ONLY
    assert mode(afd_config=gpu_afd, enforce_eager=True).cudagraph_mode == CUDAGraphMode.NONE
    with pytest.raises(ValueError, match="got FULL_AND_PIECEWISE"):
        mode(afd_config=gpu_afd, compilation_config={"cudagraph_mode": "FULL_AND_PIECEWISE"})
    with pytest.raises(ValueError, match="gloo connector moves CPU tensors"):
        mode(afd_config={"connector": "gloo"})


@pytest.mark.parametrize("graphs", ["eager", "FULL_DECODE_ONLY"])
def test_patched_matches_stock_on_gpu(graphs, tiny_qwen3):
    engine = dict(GPU_ENGINE, **memory_args(), enforce_eager=graphs == "eager")
    if graphs != "eager":
        engine["compilation_config"] = {"cudagraph_mode": graphs}
    patched = run(tiny_qwen3, engine)
    stock = run(tiny_qwen3, engine, stock=True)
    assert stock["vllm"].startswith(str(stock_vllm_path()))
    assert patched["vllm"] != stock["vllm"]
    print(
        f"{graphs}: patched {patched['ms_per_step']:.2f} ms/step, "
        f"stock {stock['ms_per_step']:.2f} ms/step"
    )
    assert patched["tokens"] == stock["tokens"]
