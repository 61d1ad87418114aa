"""The FFN role's model holds exactly the checkpoint's MLPs and computes them.

Built the way `vllm afd-ffn` builds it (FFNWorker, vLLM's own loader), then
checked layer by layer against the MLP computed by hand from the safetensors
file. Runs in a subprocess: vLLM's distributed state is per process.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest


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


CHECK = """
import sys
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from vllm.afd.ffn.worker import FFNWorker
from vllm.afd.models.ffn_model import FFNModel
from vllm.engine.arg_utils import EngineArgs

model_dir = sys.argv[1]
config = EngineArgs(
    model=model_dir, dtype="float32", enforce_eager=True, afd_config={"role": "ffn"}
).create_engine_config()
worker = FFNWorker(config, 0)
worker.init_device()
worker.load_model()
model = worker.runner.model
assert isinstance(model, FFNModel)
names = sorted(n for n, _ in model.named_parameters())
assert names == sorted(
    f"model.layers.{i}.mlp.{p}.weight" for i in range(2) for p in ("gate_up_proj", "down_proj")
), names
weights = load_file(f"{model_dir}/model.safetensors")
hidden = config.model_config.get_hidden_size()
x = torch.randn(5, hidden, generator=torch.Generator().manual_seed(0))
for layer in range(2):
    w = {p: weights[f"model.layers.{layer}.mlp.{p}_proj.weight"] for p in ("gate", "up", "down")}
    expected = (F.silu(x @ w["gate"].T) * (x @ w["up"].T)) @ w["down"].T
    with torch.inference_mode():
        got = model(layer, x)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
print("FFN MODEL OK")
"""


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_ffn_model_matches_the_checkpoint(arch, request):
    assert "FFN MODEL OK" in run_check(CHECK, str(request.getfixturevalue(f"tiny_{arch}")))


MOE_CHECK = """
import sys
from vllm.afd.ffn.worker import FFNWorker
from vllm.engine.arg_utils import EngineArgs

afd = {"role": "ffn", "compute_gate_on_attention": sys.argv[2] == "gate-attn"}
config = EngineArgs(
    model=sys.argv[1], dtype="float32", enforce_eager=True, afd_config=afd
).create_engine_config()
worker = FFNWorker(config, 0)
worker.init_device()
worker.load_model()
names = [n for n, _ in worker.runner.model.named_parameters()]
print("EXCHANGES", worker.runner.model.num_layers, "")
print("PARAMS", " ".join(names))
"""


@pytest.mark.parametrize("gate", ["gate-ffn", "gate-attn"])
@pytest.mark.parametrize(
    "arch",
    ["qwen3_moe", "qwen2_moe", "deepseek_v2", "deepseek_v3", "deepseek_v32", "glm4_moe",
     "qwen3_5_moe", "kimi_k25", "glm_moe_dsa"],
)  # fmt: skip
def test_moe_ffn_model_holds_the_ffns_and_nothing_else(arch, gate, request):
    """The FFN rank of a MoE model: every layer's experts (and shared experts,
    and dense MLPs where the model has them), the router gate unless it runs
    on the attention side, the router's correction bias in both placements;
    no attention (DeepSeek-V3.2's and GLM-5's with its indexer), norm, embedding or head,
    nothing of the checkpoint's multi-token-prediction layer (DeepSeek-V3's
    GLM-4.5's and GLM-5's layer 2, Qwen3.5's ``mtp.*``) or of a vision tower
    (Qwen3.5-MoE's, whose decoder layers are under ``model.language_model.``
    and whose experts are stored as 3-D tensors; Kimi-K2.5's, whose layers
    are under ``language_model.model.``)."""
    model = request.getfixturevalue(f"tiny_{arch}")
    names = run_check(MOE_CHECK, str(model), gate).split("PARAMS ")[1].split()
    assert all(n.startswith(("model.layers.0.mlp.", "model.layers.1.mlp.")) for n in names), names
    moe_layer = "model.layers.1.mlp."  # layer 0 is dense in the DeepSeek and GLM checkpoints
    assert (f"{moe_layer}gate.weight" in names) == (gate == "gate-ffn")
    assert any(n.startswith(f"{moe_layer}experts.") for n in names), names
    has_bias = arch in ("deepseek_v3", "deepseek_v32", "glm4_moe", "kimi_k25", "glm_moe_dsa")
    assert (f"{moe_layer}gate.e_score_correction_bias" in names) == has_bias, names


def test_longcat_flash_ffn_model_holds_both_mlps_and_the_shortcut_moe(tiny_longcat_flash):
    """LongCat-Flash's FFN rank: per layer its two dense MLPs and its shortcut
    MoE block (router with its correction bias over routed and zero-compute
    experts, routed experts), under the checkpoint's names, and nothing of
    its two attentions or norms. Its forward runs on the GPU only
    (tests/gpu: vLLM's CPU fused-MoE kernel does not take its routing)."""
    out = run_check(MOE_CHECK, str(tiny_longcat_flash), "gate-ffn")
    # Two exchanges per decoder layer, on every release (0.26 counts the
    # model's attentions as its layers, 0.32 its decoder layers).
    assert "EXCHANGES 4 " in out, out
    names = out.split("PARAMS ")[1].split()
    expected = {
        f"model.layers.{i}.{p}"
        for i in range(2)
        for p in (
            "mlp.router.classifier.weight",
            "mlp.router.e_score_correction_bias",
            "mlp.experts.routed_experts.w13_weight",
            "mlp.experts.routed_experts.w2_weight",
            *(f"mlps.{j}.{w}.weight" for j in range(2) for w in ("gate_up_proj", "down_proj")),
        )
    }
    assert set(names) == expected, names


BATCH_INVARIANT_CHECK = """
import sys
from vllm.afd.ffn.worker import FFNWorker, init_batch_invariance
from vllm.engine.arg_utils import EngineArgs

batch_invariant = sys.modules[init_batch_invariance.__module__]  # its home moved in 0.29

config = EngineArgs(
    model=sys.argv[1], dtype="float32", enforce_eager=True, afd_config={"role": "ffn"}
).create_engine_config()
FFNWorker(config, 0).init_device()
print("BATCH INVARIANT MODE", batch_invariant._batch_invariant_MODE)
"""


@pytest.mark.parametrize("env", ["1", "0"])
def test_ffn_rank_follows_vllm_batch_invariant(env, tiny_qwen3):
    """VLLM_BATCH_INVARIANT=1 switches the FFN rank's kernels to vLLM's
    batch-invariant ones, as it does the attention side's; with it off they
    stay vLLM's defaults."""
    out = run_check(BATCH_INVARIANT_CHECK, str(tiny_qwen3), env={"VLLM_BATCH_INVARIANT": env})
    assert f"BATCH INVARIANT MODE {env == '1'}" in out


LOGITS_CHECK = """
import sys
import torch
from safetensors.torch import load_file
from vllm.afd.ffn.worker import FFNWorker
from vllm.afd.models.registry import ffn_input_width
from vllm.afd.models.remote_ffn import RemoteMoE
from vllm.engine.arg_utils import EngineArgs
from vllm.forward_context import set_forward_context

model_dir, gate_name = sys.argv[1], "model.layers.1.mlp.gate.weight"
afd = {"role": "ffn", "compute_gate_on_attention": True}
config = EngineArgs(
    model=model_dir, dtype="bfloat16", enforce_eager=True, afd_config=afd
).create_engine_config()
worker = FFNWorker(config, 0)
worker.init_device()
worker.load_model()
model = worker.runner.model
routing, hf_config = model.spec.routing, config.model_config.hf_text_config
# The attention side's stand-in for layer 1, its gate holding the checkpoint's.
gate = routing.build_gate(config, "model.layers.1.mlp")
with torch.no_grad():
    gate.weight.copy_(load_file(f"{model_dir}/model.safetensors")[gate_name])
if getattr(gate, "quant_method", None) is not None:  # as vLLM's loader finishes a layer
    gate.quant_method.process_weights_after_loading(gate)
remote = RemoteMoE(
    1, gate, routing.gate_name, routing.remote_parts, routing.router_logits,
    routing.wire_dtype(hf_config, torch.bfloat16),
)
x = torch.randn(5, config.model_config.get_hidden_size(), dtype=torch.bfloat16,
                generator=torch.Generator().manual_seed(0))
received = []
model.model.layers[1].mlp.experts.register_forward_pre_hook(
    lambda module, args, kwargs: received.append(kwargs["router_logits"]), with_kwargs=True
)
with torch.inference_mode(), set_forward_context(None, config, num_tokens=len(x)):
    sent = routing.router_logits(gate, x)
    rows = remote._pack(x)
    model(1, rows)
assert rows.shape[1] == ffn_input_width(config), (rows.shape, ffn_input_width(config))
print("SENT", sent.dtype, "RECEIVED", received[0].dtype)
print("EXACT", torch.equal(received[0], sent))
print("BF16 WOULD ROUND", not torch.equal(sent.to(torch.bfloat16).to(sent.dtype), sent))
"""


def test_float32_router_logits_reach_the_experts_bit_for_bit(tiny_glm4_moe):
    """GLM-4.5's router computes float32 logits, and its experts take them in
    float32. With the gate on the attention side of a bf16 model they travel
    in two bf16 columns each (its bytes) and the FFN rank's experts receive
    exactly what the gate computed. The logits here are not bf16 values, so
    rounding them on the way (how they travelled before, and what changed
    greedy tokens on a GPU) fails the check."""
    out = run_check(LOGITS_CHECK, str(tiny_glm4_moe))
    assert "SENT torch.float32 RECEIVED torch.float32" in out, out
    assert "EXACT True" in out and "BF16 WOULD ROUND True" in out, out
