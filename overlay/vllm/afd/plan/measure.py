# SPDX-License-Identifier: Apache-2.0
"""Measuring role times on this machine's GPU for ``vllm afd-plan
--calibrate``: one 1A1F deployment with both roles on the GPU (ipc, a
private MPS daemon), dummy weights, FULL_DECODE_ONLY graphs and
``time_steps``, the quantities the GPU benchmarks time
(benchmarks/afd_one_gpu_overlap.py): each role's compute and the attention
side's exchange per token layout, from the ranks' ``stats_dir`` records,
and the decode step. Needs a GPU; ``calibrate`` fits what it returns."""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

from vllm.afd.plan.calibrate import RoleSample

DEFAULT_POINTS = ((1, 512), (8, 2048), (64, 512), (256, 1024))
"""(batch, context): batches 1 and 64 touch different shares of the experts,
and batch times context varies apart from the batch (what the fit needs)."""
RECORD_WAIT_S = 60.0
DECODE_TOKENS = 32
"""Decode steps timed per point."""
STEP_REPEATS = 3
"""Timed pairs of generations per point; the step is their median. A
point's first generation is not timed: the first prefill of a new batch
took longer than a later one with 32 more decode steps (a negative step at
batch 8 and context 2048 on an H100)."""
LENGTH_SLACK = 8
"""Tokens of ``max_model_len`` beyond a point's context and decode steps."""


def gpu_memory_bytes() -> tuple[int, int]:
    """(free, total) bytes of the first visible GPU, from NVML: a CUDA
    context in this process (``mem_get_info``) would hold memory of its own
    and sit outside the MPS daemon the engine starts."""
    from vllm.platforms import current_platform
    from vllm.third_party import pynvml

    pynvml.nvmlInit()
    try:
        physical = current_platform.device_id_to_physical_device_id(0)
        info = pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(physical))
        return int(info.free), int(info.total)
    finally:
        pynvml.nvmlShutdown()


def _prompts(batch: int, length: int) -> list[dict]:
    """Prompts that share no prefix block (as the benchmarks' are)."""
    return [
        {"prompt_token_ids": [(7 * i + j) % 1000 + 10 for j in range(length)]} for i in range(batch)
    ]


def _read_record(stats: Path, who: str):
    from vllm.distributed.afd_transfer.step_stats import StepRecord

    deadline = time.monotonic() + RECORD_WAIT_S
    while True:  # the ranks write their records as they shut down
        try:
            return StepRecord.read(stats, who)
        except FileNotFoundError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def _replayed(record, batch: int):
    found = [
        t for t in record.step_times if t.kind == "replay" and sum(map(sum, t.layout)) == batch
    ]
    if len(found) != 1:
        raise RuntimeError(
            f"{record.who}: no single replayed layout of {batch} tokens "
            f"({found}); did the decode steps run as graphs?"
        )
    return found[0]


def measure_samples(
    model: str,
    points: tuple[tuple[int, int], ...],
    memory: dict,
    hf_overrides: dict | None = None,
    decode_tokens: int = DECODE_TOKENS,
) -> list[RoleSample]:
    """Role times of ``model`` at each (batch, context): the attention
    engine with the ``memory`` settings of a ``CalibrationBudget``, the
    model cut by ``hf_overrides`` where it is one."""
    from tqdm import tqdm
    from vllm import LLM, SamplingParams

    batches = sorted({b for b, _ in points})
    if len(batches) != len(points):
        raise ValueError("each batch once: role times are kept per token layout")
    longest = max(c for _, c in points) + decode_tokens + LENGTH_SLACK
    steps = {}
    with tempfile.TemporaryDirectory() as stats:
        llm = LLM(
            model=model,
            load_format="dummy",
            seed=0,
            enable_prefix_caching=False,
            max_model_len=longest,
            max_num_seqs=max(batches),
            max_num_batched_tokens=max(16384, longest),
            hf_overrides=hf_overrides,
            **memory,
            compilation_config={
                "cudagraph_mode": "FULL_DECODE_ONLY",
                "mode": 0,
                "cudagraph_capture_sizes": batches,
            },
            afd_config={
                "connector": "ipc",
                "spawn_ffn": True,
                "mps": "start",
                "time_steps": True,
                "stats_dir": stats,
            },
        )

        def generation_s(prompts: list[dict], tokens: int) -> float:
            params = SamplingParams(max_tokens=tokens, ignore_eos=True, temperature=0.0)
            start = time.perf_counter()
            llm.generate(prompts, params, use_tqdm=False)
            return time.perf_counter() - start

        for batch, context in tqdm(points, desc="calibrating", unit="point"):
            prompts = _prompts(batch, context)
            generation_s(prompts, 2)  # the batch's first prefill: untimed
            # A step is the difference of two generations of one batch, which
            # differ only in their decode steps (no prefix cache, one engine).
            pairs = [
                (generation_s(prompts, 2 + decode_tokens) - generation_s(prompts, 2))
                / decode_tokens
                for _ in range(STEP_REPEATS)
            ]
            steps[batch] = statistics.median(pairs)
        llm.llm_engine.engine_core.shutdown()
        attention = _read_record(Path(stats), "attention rank 0")
        ffn = _read_record(Path(stats), "FFN rank 0")
    samples = []
    for batch, context in points:
        a, f = _replayed(attention, batch), _replayed(ffn, batch)
        samples.append(
            RoleSample(
                batch,
                context + decode_tokens / 2,
                a.compute_ms / 1e3,
                f.compute_ms / 1e3,
                (a.exchange_ms - f.compute_ms) / 1e3,
                steps[batch],
            )
        )
    return samples
