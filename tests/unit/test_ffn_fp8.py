"""FP8 block-quantized checkpoints (DeepSeek-V3's form) on the FFN side.

vLLM's CPU backend implements FP8 block quantization with AMX only: on a CPU
without AMX tiles, building an FP8 linear layer raises ("Failed to find a
kernel that can implement the ScaledMM linear layer ... CPUFp8BlockScaledMMKernel
requires AMX tile support"), while its FP8 MoE experts build and run.
So the tests here check where each weight and scale lands, not the linear
layers' arithmetic: the placement test lets the linear layers be built on
any CPU (nothing runs them), loads the checkpoint into stock vLLM's full
model and into each AFD role's model, and compares them tensor for tensor.
The Qwen3-MoE FFN rank has no FP8 linear layer (the router gate is left
unquantized), so it also runs, as `vllm afd-ffn` runs it, against the MoE
computed by hand from the dequantized checkpoint. Token equality with stock
vLLM on FP8 checkpoints is tests/gpu/test_afd_gpu_fp8.py's.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from vllm_afd_dev import ROOT

DEV_TOOLS_PATH = {
    "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
}
"""The check's environment: it imports vllm_afd_dev, also where it is not installed."""


def run_check(script: str, *args: str, env: dict[str, str] | None = None) -> str:
    """Run ``script`` in a fresh Python; its stdout, after it exits cleanly."""
    proc = subprocess.run(
        [sys.executable, "-c", script, *args],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **(env or {})},
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc.stdout


PLACEMENT_CHECK = """
import sys
import torch
from safetensors.torch import load_file
from vllm.afd.ffn.worker import FFNWorker
from vllm.afd.models.weight_roles import is_ffn_weight
from vllm.config import set_current_vllm_config
from vllm.engine.arg_utils import EngineArgs
from vllm.model_executor.kernels.linear.scaled_mm.cpu import CPUFp8BlockScaledMMKernel
from vllm.model_executor.model_loader import get_model_loader
from vllm.model_executor.model_loader.utils import initialize_model
from vllm.utils.torch_utils import set_default_torch_dtype

model_dir, gate_on_attention = sys.argv[1], sys.argv[2] == "gate-attn"

# Without AMX vLLM finds no CPU kernel for FP8 block linear layers and will
# not build them. Nothing here runs them: let them be built.
CPUFp8BlockScaledMMKernel.is_supported = classmethod(lambda cls, cc=None: (True, None))


def config(role):
    afd = role and {"role": role, "compute_gate_on_attention": gate_on_attention}
    return EngineArgs(
        model=model_dir, dtype="bfloat16", enforce_eager=True, afd_config=afd
    ).create_engine_config()


configs = {role: config(role) for role in ("ffn", "attention", None)}
FFNWorker(configs["ffn"], 0).init_device()  # vLLM's distributed state, a world of one


# Every model built stays alive: vLLM caches a model's pipeline-parallel
# missing layers by id(model) (models/utils.py), and the attention role's
# remote FFNs count as missing. A later model given a freed model's id would
# skip its FFN weights while loading (a quantized model's load does not check
# that every weight was loaded).
models = []


def loaded(vllm_config):
    # As vLLM's loader does, less the kernels' repacking after loading.
    with set_current_vllm_config(vllm_config), set_default_torch_dtype(torch.bfloat16):
        model = initialize_model(vllm_config=vllm_config)
        get_model_loader(vllm_config.load_config).load_weights(model, vllm_config.model_config)
    models.append(model)
    return {name: p.data for name, p in model.named_parameters()}


ffn, attention, stock = (loaded(configs[role]) for role in ("ffn", "attention", None))


def same(a, b):
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.dtype == torch.float8_e4m3fn:
        a, b = a.view(torch.uint8), b.view(torch.uint8)
    return torch.equal(a, b)


# Each role holds its own part of stock vLLM's model, under its names, tensor
# for tensor, and nothing else.
assert not ffn.keys() & attention.keys(), sorted(ffn.keys() & attention.keys())
both = ffn.keys() | attention.keys()
assert both == stock.keys(), sorted(stock.keys() ^ both)
for role, params in (("ffn", ffn), ("attention", attention)):
    for name, p in params.items():
        s = stock[name]
        assert same(p, s), (role, name, p.dtype, p.shape, s.dtype, s.shape)
assert all(".mlp." in n for n in ffn), sorted(ffn)
assert all(".mlp." not in n or n.endswith(".mlp.gate.weight") for n in attention), sorted(attention)

# And what they hold is the checkpoint's FFN, every FP8 weight and scale:
# stacked projections in vLLM's merged layers, experts in FusedMoE's layout.
checkpoint = load_file(f"{model_dir}/model.safetensors")
num_layers = configs["ffn"].model_config.hf_text_config.num_hidden_layers  # less the MTP layer
ffn_tensors = {n for n in checkpoint if is_ffn_weight(n, gate_on_attention, num_layers)}
assert any(n.endswith("_scale_inv") for n in ffn_tensors)
used = set()


def take(*names):
    used.update(names)
    return torch.cat([checkpoint[n] for n in names])


def expected(name):
    base, _, suffix = name.rpartition(".")  # suffix: weight or weight_scale_inv
    if ".experts." in base:  # FusedMoE: [expert, out, in] for w13 and w2
        block, kind = base.split(".experts.")[0], suffix.split("_")[0]
        suffix = suffix.removeprefix(kind + "_")
        projs = ("gate_proj", "up_proj") if kind == "w13" else ("down_proj",)
        n = 0
        while f"{block}.experts.{n}.down_proj.weight" in checkpoint:
            n += 1
        return torch.stack(
            [take(*(f"{block}.experts.{e}.{p}.{suffix}" for p in projs)) for e in range(n)]
        )
    if base.endswith("gate_up_proj"):
        stem = base.removesuffix("gate_up_proj")
        return take(f"{stem}gate_proj.{suffix}", f"{stem}up_proj.{suffix}")
    return take(name)


for name, p in ffn.items():
    want = expected(name)
    if p.dtype != torch.float8_e4m3fn:  # loading casts (the correction bias is float32)
        want = want.to(p.dtype)
    assert same(p, want), (name, p.dtype, p.shape)
assert used == ffn_tensors, sorted(used ^ ffn_tensors)
fp8 = [n for n, p in ffn.items() if p.dtype == torch.float8_e4m3fn]
scales = [n for n in ffn if n.endswith("weight_scale_inv")]
assert fp8 and len(scales) == len(fp8), (fp8, scales)
print("FP8 PLACEMENT OK", len(ffn), "FFN parameters,", len(attention), "attention parameters")
"""


@pytest.mark.parametrize("gate", ["gate-ffn", "gate-attn"])
@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3"])
def test_fp8_weights_land_where_stock_vllm_puts_them(arch, gate, request):
    """Every FP8 weight and block scale of the FFN (dense MLP gate_up/down,
    shared experts, routed experts' w13/w2 in FusedMoE's layout) is on the FFN
    side, equal to stock vLLM's model loaded from the same checkpoint, and the
    attention side holds none of them."""
    env = {"VLLM_MLA_DISABLE": "1"}  # vLLM has no MLA on CPU
    model = request.getfixturevalue(f"tiny_{arch}_fp8")
    out = run_check(PLACEMENT_CHECK, str(model), gate, env=env)
    assert "FP8 PLACEMENT OK" in out


MOE_RUN_CHECK = """
import sys
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from vllm.afd.ffn.worker import FFNWorker
from vllm.engine.arg_utils import EngineArgs
from vllm.forward_context import set_forward_context

from vllm_afd_dev.models.fp8_checkpoint import dequantize_weight

model_dir = sys.argv[1]
config = EngineArgs(
    model=model_dir, dtype="bfloat16", enforce_eager=True, afd_config={"role": "ffn"}
).create_engine_config()
worker = FFNWorker(config, 0)
worker.init_device()
worker.load_model()
model = worker.runner.model
ckpt = load_file(f"{model_dir}/model.safetensors")
hf = config.model_config.hf_text_config


def weight(name):
    return dequantize_weight(ckpt[name], ckpt[f"{name}_scale_inv"])


x = torch.randn(7, hf.hidden_size, generator=torch.Generator().manual_seed(0)).bfloat16()
for layer in range(hf.num_hidden_layers):
    p = f"model.layers.{layer}.mlp."
    logits = F.linear(x, ckpt[p + "gate.weight"]).float()
    top, experts = torch.softmax(logits, -1).topk(hf.num_experts_per_tok, -1)
    top = top / top.sum(-1, keepdim=True)
    expected = torch.zeros(x.shape)
    for t in range(x.shape[0]):
        for w, e in zip(top[t], experts[t].tolist()):
            g, u, d = (weight(f"{p}experts.{e}.{n}_proj.weight") for n in ("gate", "up", "down"))
            xt = x[t].float()
            expected[t] += w * (d @ (F.silu(g @ xt) * (u @ xt)))
    with torch.inference_mode(), set_forward_context(None, config, num_tokens=x.shape[0]):
        got = model(layer, x).float()
    torch.testing.assert_close(got, expected, rtol=0.05, atol=0.01 * expected.abs().max().item())
print("FP8 MOE OK")
"""


@pytest.mark.skipif(
    not torch.cpu._is_avx512_supported(),
    reason="vLLM's CPU FP8 MoE kernel (torch.ops._C.convert_weight_packed) comes only with "
    "its AVX-512 builds, and this CPU has no AVX-512",
)
def test_fp8_moe_ffn_rank_computes_the_dequantized_experts(tiny_qwen3_moe_fp8):
    """The Qwen3-MoE FFN rank on its FP8 checkpoint, built and loaded as
    `vllm afd-ffn` does (vLLM's CPU FP8 MoE kernel, weights repacked), gives
    each layer's MoE of the dequantized weights, within bf16 rounding."""
    out = run_check(MOE_RUN_CHECK, str(tiny_qwen3_moe_fp8), env=DEV_TOOLS_PATH)
    assert "FP8 MOE OK" in out
