"""GPU memory budgets: each process's vLLM memory settings from the GPU's
total memory, so that the benchmarks and the GPU tests start on an 80 GB
H100 as on a 141 GB H200, and refuse what cannot fit, with the numbers,
before any engine starts.

**What the settings mean.** vLLM's ``gpu_memory_utilization`` is the
fraction of the *whole* GPU that one engine may use. At start-up the engine
checks that this much is free, after its own CUDA context and after what
every other process on the GPU holds; without ``kv_cache_memory_bytes`` it
then gives its KV cache that share less its weights and its profiled
activations (and a profile on a shared GPU counts what the neighbours
allocate meanwhile as its own). With ``kv_cache_memory_bytes`` the KV cache
has that size, and the fraction is only the start-up check. An FFN rank
(``vllm afd-ffn``, spawned by the attention engine or started by hand)
takes no memory setting: it holds its CUDA context, its FFN weights,
activations, transfer buffers and CUDA graphs, and no KV cache
(``vllm.afd.ffn.runner``). A spawned FFN rank has loaded its weights before
the attention engine's check (the engine connects to it first,
``vllm.afd.connection``).

**The plan.** Each process on a GPU needs its context and workspaces
(``PROCESS_BYTES``), its weights (from the model's shape,
``shape_weights``, or from a checkpoint's safetensors,
``checkpoint_weights``), its activations (``activation_bytes``: an
estimate at the engine's ``max_num_batched_tokens``) and its KV cache
(``kv_cache_bytes``: what the run wants). ``plan_gpu`` adds up the needs of
every process sharing the GPU; if they exceed ``1 - MARGIN`` of its total
(vLLM's own default, 0.92, leaves as much free) it raises
``GpuMemoryError``, naming each process's numbers and what to change.
Otherwise the spare goes to the engines whose KV cache vLLM sizes from its
profile, in equal shares, and each engine's ``gpu_memory_utilization`` is
what it allocates after its context over the GPU's total: the budgets of
all processes add up within the GPU, so each start-up check passes whoever
starts first.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

GiB = 2**30
PROCESS_BYTES = 1 * GiB
"""Per process, besides its tensors: the CUDA context, cuBLAS and NCCL
workspaces, the caching allocator's slack."""
MARGIN = 0.08
"""The share of the GPU no plan hands out: what the estimates miss."""
BLOCK_TOKENS = 16
"""vLLM's KV cache block: a sequence takes whole blocks."""
DEFAULT_BATCHED_TOKENS = 16384
"""vLLM's largest default ``max_num_batched_tokens`` (offline ``LLM`` on a
GPU of 70 GiB or more), for engine arguments that name none."""
DEFAULT_SEQUENCES = 1024
"""vLLM's largest default ``max_num_seqs``, likewise."""
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "half": 2, "auto": 2, "float32": 4, "float": 4}
SAFETENSORS_DTYPE_BYTES = {
    **{"F64": 8, "I64": 8, "F32": 4, "I32": 4, "BF16": 2, "F16": 2, "I16": 2},
    **{"F8_E4M3": 1, "F8_E5M2": 1, "I8": 1, "U8": 1, "BOOL": 1},
}
REMEDIES = (
    "fewer layers, a smaller batch or shorter sequences (less KV cache), fewer processes "
    "on the GPU, or a GPU with more memory"
)

FFN = "FFN rank"
ATTENTION = "attention engine"
COLOCATED = "colocated engine"


class GpuMemoryError(ValueError):
    """The processes meant to share a GPU do not fit it."""


@dataclass(frozen=True)
class RoleWeights:
    """A model's weight bytes by AFD role."""

    attention: int
    """Everything but the decoder layers' FFNs: embeddings, attention, norms, head."""
    ffn: int
    """The decoder layers' FFNs (MLPs or experts, and the router unless
    ``compute_gate_on_attention`` puts it on the attention side)."""

    @property
    def total(self) -> int:
        return self.attention + self.ffn


def text_config(config: dict) -> dict:
    """A config.json's language model part (a vision-language model's
    ``text_config``), with ``num_hidden_layers`` counting attention layers:
    LongCat-Flash's config.json gives only ``num_layers``, its decoder
    layers, each with two attentions (transformers derives the rest)."""
    text = config.get("text_config", config)
    if "num_hidden_layers" not in text and "num_layers" in text:
        return {**text, "num_hidden_layers": 2 * text["num_layers"]}
    return text


def _experts(cfg: dict) -> int:
    return (
        cfg.get("num_local_experts") or cfg.get("num_experts") or cfg.get("n_routed_experts") or 0
    )


def _head_dim(cfg: dict) -> int:
    return cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]


def _is_moe_layer(cfg: dict, layer: int) -> bool:
    if not _experts(cfg) or layer in cfg.get("mlp_only_layers", []):
        return False
    return (layer + 1) % cfg.get("decoder_sparse_step", 1) == 0


def shape_weights(
    config: dict, dtype_bytes: int = 2, gate_on_attention: bool = False
) -> RoleWeights:
    """The weight bytes of a model of ``config``'s shape (a Qwen3 / Llama
    style dense or MoE config, as the benchmarks build them,
    ``vllm_afd_dev.bench.shapes``), ``dtype_bytes`` per parameter."""
    cfg = text_config(config)
    h, layers = cfg["hidden_size"], cfg["num_hidden_layers"]
    hd = _head_dim(cfg)
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    per_layer = h * q + 2 * h * kv + q * h + 2 * h + 2 * hd  # projections, norms, q/k norms
    embeddings = cfg["vocab_size"] * h * (1 if cfg.get("tie_word_embeddings") else 2) + h
    attention = layers * per_layer + embeddings
    ffn = 0
    experts = _experts(cfg)
    for layer in range(layers):
        if not _is_moe_layer(cfg, layer):
            ffn += 3 * h * cfg["intermediate_size"]
            continue
        router = h * experts
        ffn += experts * 3 * h * cfg["moe_intermediate_size"]
        ffn += 3 * h * cfg.get("shared_expert_intermediate_size", 0)
        if gate_on_attention:
            attention += router
        else:
            ffn += router
    return RoleWeights(attention * dtype_bytes, ffn * dtype_bytes)


def checkpoint_tensor_bytes(model: Path) -> Iterator[tuple[str, int]]:
    """Each tensor of ``model``'s safetensors files (one or sharded), and its
    bytes, from the files' headers."""
    from safetensors import safe_open

    for file in sorted(model.glob("*.safetensors")):
        with safe_open(file, "pt") as f:
            for name in f.keys():
                tensor = f.get_slice(name)
                nbytes = SAFETENSORS_DTYPE_BYTES[tensor.get_dtype()]
                yield name, math.prod(tensor.get_shape()) * nbytes


def checkpoint_weights(model: Path, gate_on_attention: bool = False) -> RoleWeights:
    """The weight bytes by role of the checkpoint in directory ``model``, in
    its own dtype (a float32 checkpoint run in bf16 holds half of it), split
    as the roles read it (``vllm.afd.models.weight_roles``; a
    multi-token-prediction layer's FFN is neither's, and not counted)."""
    from vllm.afd.models.weight_roles import is_ffn_weight

    layers = text_config(json.loads((model / "config.json").read_text()))["num_hidden_layers"]
    attention = ffn = 0
    for name, nbytes in checkpoint_tensor_bytes(model):
        if is_ffn_weight(name, gate_on_attention, layers):
            ffn += nbytes
        elif not is_ffn_weight(name, gate_on_attention):
            attention += nbytes
    return RoleWeights(attention, ffn)


def model_weights(model: Path, engine_args: dict) -> RoleWeights:
    """The weight bytes by role of model directory ``model`` run with
    ``engine_args``: its checkpoint's, or, where it has none (dummy weights
    over a config), its shape's."""
    if any(model.glob("*.safetensors")):
        return checkpoint_weights(model, gate_on_attention(engine_args))
    config = json.loads((model / "config.json").read_text())
    return shape_weights(config, engine_dtype_bytes(engine_args), gate_on_attention(engine_args))


def kv_cache_bytes(
    config: dict,
    sequences: int,
    tokens_per_sequence: int,
    max_model_len: int = 0,
    dtype_bytes: int = 2,
) -> int:
    """A KV cache for ``sequences`` of ``tokens_per_sequence`` tokens each,
    in whole blocks, and at least one sequence of ``max_model_len`` tokens
    (vLLM refuses to start with less), plus the block vLLM keeps back (its
    null block)."""
    cfg = text_config(config)
    if cfg.get("kv_lora_rank"):  # MLA: one latent vector and a rope key per token
        width = cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"]
    else:
        width = 2 * cfg["num_key_value_heads"] * _head_dim(cfg)
    per_token = dtype_bytes * cfg["num_hidden_layers"] * width
    blocks = max(sequences * -(-tokens_per_sequence // BLOCK_TOKENS),
                 -(-max_model_len // BLOCK_TOKENS))  # fmt: skip
    return per_token * (blocks + 1) * BLOCK_TOKENS


def activation_bytes(
    config: dict,
    role: str,
    tokens: int,
    sequences: int,
    dtype_bytes: int = 2,
    stages: int = 1,
) -> int:
    """An estimate of what one process of ``role`` (``FFN``, ``ATTENTION``
    or ``COLOCATED``) allocates besides its weights and KV cache, with
    ``tokens`` per step (``max_num_batched_tokens``: vLLM profiles that
    many) and up to ``sequences`` per batch: the hidden states and each
    layer's intermediates, once more for the decode graphs' pool, and on
    the attention side the logits and sampler copies (float32) and the ipc
    connector's transfer slots (one each way per stage, at least three)."""
    cfg = text_config(config)
    h = cfg["hidden_size"]
    hd = _head_dim(cfg)
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    dense = cfg.get("intermediate_size") or 4 * h
    if _experts(cfg):
        expert = cfg.get("moe_intermediate_size") or dense
        ffn = cfg["num_experts_per_tok"] * (3 * expert + h) + 2 * _experts(cfg)
        ffn += 3 * cfg.get("shared_expert_intermediate_size", 0)
    else:
        ffn = 3 * dense
    attention = 2 * q + 2 * kv + h
    per_token = 4 * h + {FFN: ffn, ATTENTION: attention, COLOCATED: attention + ffn}[role]
    held = dtype_bytes * per_token * (tokens + sequences)  # the profile's peak, the graphs' pool
    if role != FFN:
        held += 3 * 4 * sequences * cfg["vocab_size"]
    if role == ATTENTION:
        held += 2 * max(3, stages) * tokens * h * dtype_bytes
    return held


@dataclass(frozen=True)
class Process:
    """One process on a GPU and what it holds there."""

    name: str
    weight_bytes: int
    activation_bytes: int
    kv_cache_bytes: int = 0
    """Its KV cache; with ``profiled_kv``, the least it needs."""
    engine: bool = True
    """A vLLM engine (takes ``gpu_memory_utilization``); False: an FFN rank."""
    profiled_kv: bool = False
    """vLLM sizes its KV cache from its memory profile (no
    ``kv_cache_memory_bytes``): the plan's spare adds to it."""
    headroom_bytes: int = 0
    """More for it, beyond the estimates: for a profiled KV cache on a
    shared GPU, what the neighbours may allocate while it profiles."""

    @property
    def tensor_bytes(self) -> int:
        """What it allocates after its CUDA context."""
        return self.weight_bytes + self.activation_bytes + self.kv_cache_bytes + self.headroom_bytes

    @property
    def need_bytes(self) -> int:
        return PROCESS_BYTES + self.tensor_bytes

    def describe(self) -> str:
        parts = [f"weights {self.weight_bytes / GiB:.2f}",
                 f"activations {self.activation_bytes / GiB:.2f}"]  # fmt: skip
        if self.kv_cache_bytes:
            least = "at least " if self.profiled_kv else ""
            parts.append(f"KV cache {least}{self.kv_cache_bytes / GiB:.2f}")
        if self.headroom_bytes:
            parts.append(f"headroom {self.headroom_bytes / GiB:.2f}")
        parts.append(f"context {PROCESS_BYTES / GiB:.2f}")
        return f"{self.name} {self.need_bytes / GiB:.2f} GiB ({', '.join(parts)})"


@dataclass(frozen=True)
class Budget:
    """One process's share of a GPU and its vLLM settings."""

    process: Process
    budget_bytes: int
    """Its need, plus its share of the spare for a profiled KV cache."""
    gpu_memory_utilization: float | None
    """None for an FFN rank, which takes no memory setting."""
    kv_cache_memory_bytes: int | None
    """None where vLLM sizes the KV cache (or there is none)."""

    def engine_args(self) -> dict:
        """Its settings as ``LLM`` / ``EngineArgs`` keyword arguments."""
        found: dict = {}
        if self.gpu_memory_utilization is not None:
            found["gpu_memory_utilization"] = self.gpu_memory_utilization
        if self.kv_cache_memory_bytes is not None:
            found["kv_cache_memory_bytes"] = self.kv_cache_memory_bytes
        return found


@dataclass(frozen=True)
class GpuPlan:
    """The processes sharing one GPU, each with its budget."""

    gpu: str
    total_bytes: int
    budgets: tuple[Budget, ...]
    spare_bytes: int
    """What the plan leaves unused (``MARGIN`` aside)."""

    def __getitem__(self, name: str) -> Budget:
        for budget in self.budgets:
            if budget.process.name == name:
                return budget
        raise KeyError(
            f"no process {name!r} on {self.gpu}: {[b.process.name for b in self.budgets]}"
        )

    def describe(self) -> str:
        lines = [f"{self.gpu}, {self.total_bytes / GiB:.2f} GiB: spare "
                 f"{self.spare_bytes / GiB:.2f} GiB, margin {MARGIN:.0%}"]  # fmt: skip
        for b in self.budgets:
            settings = ", ".join(f"{k}={v}" for k, v in b.engine_args().items())
            lines.append(f"  {b.process.describe()}: {settings or 'no memory setting'}")
        return "\n".join(lines)

    def as_dict(self) -> dict:
        """For a results file."""
        return {
            "gpu": self.gpu,
            "total_bytes": self.total_bytes,
            "margin": MARGIN,
            "spare_bytes": self.spare_bytes,
            "processes": {
                b.process.name: {
                    "need_bytes": b.process.need_bytes,
                    "weight_bytes": b.process.weight_bytes,
                    "activation_bytes": b.process.activation_bytes,
                    "kv_cache_bytes": b.process.kv_cache_bytes,
                    "budget_bytes": b.budget_bytes,
                    **b.engine_args(),
                }
                for b in self.budgets
            },
        }


def _fraction(nbytes: int, total: int, up: bool) -> float:
    """``nbytes / total`` to three decimals, rounded ``up`` or down, within (0, 1]."""
    thousandths = nbytes * 1000 / total
    rounded = math.ceil(thousandths) if up else math.floor(thousandths)
    return min(max(rounded, 1), 1000) / 1000


def plan_gpu(
    total_bytes: int, processes: list[Process], gpu: str = "the GPU", remedies: str = REMEDIES
) -> GpuPlan:
    """Each of ``processes``' budget on one GPU of ``total_bytes``, or
    ``GpuMemoryError`` if their needs exceed ``1 - MARGIN`` of it (the
    module docstring). ``remedies``: what the caller can change, for the
    error."""
    names = [p.name for p in processes]
    if len(set(names)) != len(names):
        raise ValueError(f"process names repeat: {names}")
    usable = int(total_bytes * (1 - MARGIN))
    need = sum(p.need_bytes for p in processes)
    if need > usable:
        lines = "\n".join(f"  {p.describe()}" for p in processes)
        raise GpuMemoryError(
            f"GPU memory: {gpu} has {total_bytes / GiB:.2f} GiB, of which a plan may give "
            f"{usable / GiB:.2f} GiB ({1 - MARGIN:.0%}); the {len(processes)} process(es) "
            f"sharing it need {need / GiB:.2f} GiB, {(need - usable) / GiB:.2f} GiB too "
            f"much:\n{lines}\nTo fit: {remedies}."
        )
    spare = usable - need
    profiled = [p for p in processes if p.engine and p.profiled_kv]
    extra = spare // len(profiled) if profiled else 0
    budgets = []
    for p in processes:
        held = p.tensor_bytes + (extra if p in profiled else 0)
        utilization = kv = None
        if p.engine:
            # A fixed KV cache: the fraction is only the start-up check, so
            # round up; a profiled one takes all of it, so round down.
            utilization = _fraction(held, total_bytes, up=not p.profiled_kv)
            kv = None if p.profiled_kv else p.kv_cache_bytes
        budgets.append(Budget(p, PROCESS_BYTES + held, utilization, kv))
    return GpuPlan(gpu, total_bytes, tuple(budgets), spare - extra * len(profiled))


def gpu_total_bytes(index: int = 0) -> int:
    """The total memory of visible GPU ``index``, as vLLM's start-up check
    counts it (``get_device_properties``: it creates no CUDA context, which
    ``mem_get_info`` would, in a process that starts the engines)."""
    import torch

    return torch.cuda.get_device_properties(index).total_memory


def engine_dtype_bytes(engine_args: dict) -> int:
    """Bytes per parameter of ``engine_args``' dtype (bf16 by default)."""
    return DTYPE_BYTES[str(engine_args.get("dtype", "bfloat16")).removeprefix("torch.")]


def gate_on_attention(engine_args: dict) -> bool:
    afd = engine_args.get("afd_config")
    return bool(afd and afd.get("compute_gate_on_attention"))


def deployment(
    config: dict,
    engine_args: dict,
    kv_cache: int,
    profiled_kv: bool = False,
    dp_size: int = 1,
    weights: RoleWeights | None = None,
) -> dict[str, Process]:
    """The processes of one engine of ``config``'s shape with ``engine_args``
    (their dtype, ``max_num_batched_tokens``, ``max_num_seqs``, micro-batch
    stages and ``afd_config``) and a KV cache of ``kv_cache`` bytes (with
    ``profiled_kv``, the least it needs): with an ``afd_config``, ``FFN``
    and ``ATTENTION``; without, ``COLOCATED``, which as one of ``dp_size``
    data-parallel ranks holds its share of a MoE's experts (vLLM shards
    them over the ranks). ``weights``: by default from the shape
    (``shape_weights``). By name; place them on GPUs with ``plan_gpu``."""
    dtype = engine_dtype_bytes(engine_args)
    afd = engine_args.get("afd_config")
    if weights is None:
        weights = shape_weights(config, dtype, gate_on_attention(engine_args))
    tokens = engine_args.get("max_num_batched_tokens") or DEFAULT_BATCHED_TOKENS
    sequences = engine_args.get("max_num_seqs") or DEFAULT_SEQUENCES
    stages = engine_args.get("ubatch_size") or (2 if engine_args.get("enable_dbo") else 1)

    def activations(role: str) -> int:
        return activation_bytes(config, role, tokens, sequences, dtype, stages)

    kv = dict(kv_cache_bytes=kv_cache, profiled_kv=profiled_kv)
    if not afd:
        ffn = weights.ffn // dp_size if _experts(text_config(config)) else weights.ffn
        return {
            COLOCATED: Process(COLOCATED, weights.attention + ffn, activations(COLOCATED), **kv)
        }
    return {
        FFN: Process(FFN, weights.ffn, activations(FFN), engine=False),
        ATTENTION: Process(ATTENTION, weights.attention, activations(ATTENTION), **kv),
    }


def engine_process(processes: dict[str, Process]) -> str:
    """The name of the engine among a ``deployment``'s processes."""
    return ATTENTION if ATTENTION in processes else COLOCATED


def one_gpu_memory(
    total_bytes: int,
    config: dict,
    engine_args: dict,
    kv_cache: int,
    gpu: str = "the GPU",
    remedies: str = REMEDIES,
    weights: RoleWeights | None = None,
) -> tuple[dict, GpuPlan]:
    """The memory settings of ``engine_args``' engine when every process of
    its deployment (``deployment``: the FFN rank and the attention engine,
    or the colocated engine alone) shares one GPU of ``total_bytes``, with a
    fixed KV cache of ``kv_cache`` bytes; and the plan."""
    processes = deployment(config, engine_args, kv_cache, weights=weights)
    plan = plan_gpu(total_bytes, list(processes.values()), gpu, remedies)
    return plan[engine_process(processes)].engine_args(), plan


def own_gpus_memory(
    total_bytes: int,
    config: dict,
    engine_args: dict,
    kv_cache: int,
    dp_size: int = 1,
    remedies: str = REMEDIES,
) -> tuple[dict, list[GpuPlan]]:
    """The memory settings of ``engine_args``' engine when each process of
    its deployment has a GPU of ``total_bytes`` of its own (the attention
    engine and the FFN rank, or each of ``dp_size`` colocated data-parallel
    ranks), the engine's KV cache sized by vLLM from its profile: at least
    ``kv_cache`` bytes, and the rest of its GPU; and the plans, one per
    process."""
    processes = deployment(config, engine_args, kv_cache, profiled_kv=True, dp_size=dp_size)
    plans = {name: plan_gpu(total_bytes, [p], f"the GPU of the {name}", remedies)
             for name, p in processes.items()}  # fmt: skip
    engine = engine_process(processes)
    return plans[engine][engine].engine_args(), list(plans.values())


def cli_args(memory: dict) -> list[str]:
    """Memory settings (``Budget.engine_args``) as ``vllm serve`` arguments."""
    return [f"--{k.replace('_', '-')}={v}" for k, v in memory.items()]


# The GPU tests (tests/gpu): tiny checkpoints, fixed 1 GiB KV caches, groups
# of tests side by side on one GPU (vllm_afd_dev.gpu_groups).
TEST_KV_CACHE_BYTES = 2**30
TEST_ACTIVATION_BYTES = 512 * 2**20
"""A tiny model's activations and graph pools at the tests' batches (the
FFN processes' peaks, weights and graphs included, were 35-367 MiB,
docs/gpu-runs.md)."""
TEST_ENGINES_PER_GROUP = 2
TEST_FFN_PROCESSES_PER_GROUP = 2
"""The most processes one test puts on a GPU: a tensor-parallel attention
rank (two engine processes, each with its KV cache) and an FFN rank group
of two (tests/gpu/test_afd_gpu_ffn_group.py)."""
TEST_PROFILE_HEADROOM = 2 * GiB
"""For the test whose engine sizes its KV cache from its profile: what
neighbours starting meanwhile may allocate, which vLLM counts as its own."""
TEST_GROUPS_ENV = "AFD_GPU_TEST_GROUPS"
"""How many test groups share a test process's GPU: scripts/gpu_test_groups.py
sets it for each group; unset, as many as that script runs side by side by
default."""
TEST_ENGINE = "test engine"
PROFILED_TEST_ENGINE = "profiled test engine"
TEST_REMEDIES = (
    "fewer test groups side by side (scripts/gpu_test_groups.py --jobs) or a GPU with more memory"
)


def gpu_test_plan(total_bytes: int, groups: int, weight_bytes: int) -> GpuPlan:
    """One GPU shared by ``groups`` test groups (one pytest process each),
    each running up to ``TEST_ENGINES_PER_GROUP`` engine processes and
    ``TEST_FFN_PROCESSES_PER_GROUP`` FFN processes of tiny checkpoints of at
    most ``weight_bytes``; one of the engines may be the test's whose
    engine profiles its KV cache (``PROFILED_TEST_ENGINE``)."""
    engine = dict(weight_bytes=weight_bytes, activation_bytes=TEST_ACTIVATION_BYTES)
    processes = [Process(PROFILED_TEST_ENGINE, **engine, kv_cache_bytes=TEST_KV_CACHE_BYTES,
                         profiled_kv=True, headroom_bytes=TEST_PROFILE_HEADROOM)]  # fmt: skip
    for g in range(groups):
        processes += [
            Process(f"{TEST_ENGINE} {g}.{i}", **engine, kv_cache_bytes=TEST_KV_CACHE_BYTES)
            for i in range(TEST_ENGINES_PER_GROUP - 1 if g == 0 else TEST_ENGINES_PER_GROUP)
        ] + [
            Process(f"test FFN process {g}.{i}", **engine, engine=False)
            for i in range(TEST_FFN_PROCESSES_PER_GROUP)
        ]
    return plan_gpu(total_bytes, processes, f"a GPU shared by {groups} test group(s)",
                    TEST_REMEDIES)  # fmt: skip


def gpu_test_engine_args(plan: GpuPlan, profiled_kv: bool = False) -> dict:
    """A test engine's memory settings in ``gpu_test_plan``'s ``plan``;
    ``profiled_kv``: those of the engine that profiles its KV cache."""
    return plan[PROFILED_TEST_ENGINE if profiled_kv else f"{TEST_ENGINE} 0.0"].engine_args()


def largest_checkpoint_bytes(models: Path) -> int:
    """The largest total weight bytes of the checkpoints under ``models``
    (``tiny-*`` directories with safetensors), 0 if none."""
    return max(
        (
            checkpoint_weights(d).total
            for d in sorted(models.glob("tiny-*"))
            if (d / "config.json").is_file() and any(d.glob("*.safetensors"))
        ),
        default=0,
    )


def most_test_groups(total_bytes: int, weight_bytes: int) -> int:
    """The most test groups that ``gpu_test_plan`` fits on a GPU of ``total_bytes``."""
    groups = 0
    while True:
        try:
            gpu_test_plan(total_bytes, groups + 1, weight_bytes)
        except GpuMemoryError:
            return groups
        groups += 1
