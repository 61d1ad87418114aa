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
    rows = remote._pack(x, None)
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


DEEPSEEK_V4_CHECK = """
import sys
import torch
from safetensors.torch import load_file
from vllm.afd.ffn.worker import FFNWorker
from vllm.afd.models.registry import ffn_input_width
from vllm.afd.models.remote_ffn import RemoteFFN, RemoteMoE
from vllm.engine.arg_utils import EngineArgs
from vllm.forward_context import set_forward_context

model_dir, gate_on_attention = sys.argv[1], sys.argv[2] == "gate-attn"
afd = {"role": "ffn", "compute_gate_on_attention": gate_on_attention}
config = EngineArgs(
    model=model_dir, dtype="bfloat16", enforce_eager=True, max_model_len=512, afd_config=afd
).create_engine_config()
worker = FFNWorker(config, 0)
worker.init_device()
worker.load_model()  # vLLM's loader refuses a parameter the checkpoint left unset
model = worker.runner.model
params = dict(model.named_parameters())
print("EXCHANGES", model.num_layers, "")
print("PARAMS", " ".join(params))
ckpt = load_file(f"{model_dir}/model.safetensors")
layer0, layer1 = "model.layers.0.ffn.", "model.layers.1.ffn."
print("TABLE", torch.equal(params[f"{layer0}gate.tid2eid"], ckpt["layers.0.ffn.gate.tid2eid"]))
print("BIAS", torch.equal(
    params[f"{layer1}gate.e_score_correction_bias"], ckpt["layers.1.ffn.gate.bias"]))
# an expert's stacked projections, gate (w1) rows first, and the shared
# expert's, as the checkpoint holds them
w13 = params[f"{layer1}experts.routed_experts.w13_weight"]
expert = torch.cat([ckpt[f"layers.1.ffn.experts.3.{w}.weight"] for w in ("w1", "w3")])
shared = torch.cat([ckpt[f"layers.1.ffn.shared_experts.{w}.weight"] for w in ("w1", "w3")])
print("EXPERT", torch.equal(w13[3], expert))
print("SHARED", torch.equal(params[f"{layer1}shared_experts.gate_up_proj.weight"], shared))

# Layer 0 routes by token id: what the attention side's stand-in sends, and
# what the block's experts are then handed (stopped there: vLLM's CPU MoE
# kernels take neither sqrt-softplus scores nor a token-id table).
hidden_size = config.model_config.get_hidden_size()
x = torch.randn(6, hidden_size, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
vocab = config.model_config.get_vocab_size()
ids = torch.tensor([0, 1, 255, 4097, 32767 % vocab, vocab - 1])
routing = model.spec.routing
if gate_on_attention:
    gate = routing.build_gate(config, "model.layers.0.mlp")
    with torch.no_grad():
        gate.weight.copy_(ckpt["layers.0.ffn.gate.weight"])
    gate.quant_method.process_weights_after_loading(gate)  # as vLLM's loader finishes a layer
    stand_in = RemoteMoE(0, gate, "gate", routing.remote_parts, routing.router_logits,
                         routing.wire_dtype(config.model_config.hf_config, torch.bfloat16))
else:
    stand_in = RemoteFFN(0)
handed = {}


class Handed(Exception):
    pass


def stop(module, args, kwargs):
    handed.update(kwargs)
    raise Handed


model.model.layers[0].ffn.experts.register_forward_pre_hook(stop, with_kwargs=True)
with torch.inference_mode(), set_forward_context(None, config, num_tokens=len(x)):
    rows = stand_in._pack(x, ids)
    try:
        model(0, rows)
    except Handed:
        pass
    if gate_on_attention:
        print("LOGITS", torch.equal(handed["router_logits"], routing.router_logits(gate, x)))
print("WIDTH", rows.shape[1], ffn_input_width(config), hidden_size)
print("HIDDEN", torch.equal(handed["hidden_states"], x))
print("IDS", handed["input_ids"].tolist() == ids.tolist(), handed["input_ids"].dtype)
"""


@pytest.mark.parametrize("gate", ["gate-ffn", "gate-attn"])
def test_deepseek_v4_ffn_rank_holds_its_blocks_and_gets_each_rows_token_id(gate, tiny_deepseek_v4):
    """DeepSeek-V4's FFN rank: every layer's MoE block (``ffn``) under the
    checkpoint's own names, the first layer's token-id table
    (``gate.tid2eid``) and the other layers' correction bias loaded as
    stored, the router gate unless it runs on the attention side, nothing of
    the multi-token-prediction layer or of attention. Its rows carry each
    token's id after the hidden states (and router logits): two bf16
    columns, the id's int32 bytes. The stand-in's rows reach the hash-routed
    layer's experts as the hidden states, logits and ids the attention side
    had. The forward itself runs on GPUs only (tests/gpu): vLLM's CPU MoE
    takes neither sqrt-softplus scores (0.26) nor, without AVX-512, a
    token-id table (0.32: ``hash_topk_cpu``)."""
    out = run_check(DEEPSEEK_V4_CHECK, str(tiny_deepseek_v4), gate)
    assert "EXCHANGES 3 " in out, out
    names = set(out.split("PARAMS ")[1].split("\n")[0].split())
    for layer in range(3):
        experts = [n for n in names if n.startswith(f"model.layers.{layer}.ffn.experts.")]
        assert sorted(n.rsplit(".", 1)[1] for n in experts) == ["w13_weight", "w2_weight"], names
    assert all(n.startswith(tuple(f"model.layers.{i}.ffn." for i in range(3))) for n in names)
    assert ("model.layers.1.ffn.gate.weight" in names) == (gate == "gate-ffn")
    assert "model.layers.0.ffn.gate.tid2eid" in names
    assert "model.layers.0.ffn.gate.e_score_correction_bias" not in names
    for loaded in ("TABLE", "BIAS", "EXPERT", "SHARED"):
        assert f"{loaded} True" in out, out
    hidden = 2048
    width = hidden + 2 + (2 * 16 if gate == "gate-attn" else 0)  # float32 logits of 16 experts
    assert f"WIDTH {width} {width} {hidden}" in out, out
    assert "HIDDEN True" in out and "IDS True torch.int64" in out, out
    if gate == "gate-attn":
        assert "LOGITS True" in out, out


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_token_ids_cross_the_wire_bit_for_bit(dtype):
    """A token id travels as its int32 bytes viewed as the rows' dtype, so
    any id arrives exact, whatever number its bytes spell in that dtype
    (zeros, subnormals, infinities, NaNs), through the copies the rows go
    through (concatenation, a column slice made contiguous)."""
    import torch
    from vllm.afd.models.spec import token_id_columns, token_ids_from_wire, token_ids_on_wire

    dtype = getattr(torch, dtype)
    ids = torch.tensor([0, 1, 0x7F80, 0x7FC0, 0xFFFF, 0x10000, 0x7F800000, 0x7FC00001, 2**31 - 1])
    hidden = torch.randn(len(ids), 8).to(dtype)
    columns = token_id_columns(dtype)
    rows = torch.cat([hidden, token_ids_on_wire(ids, dtype)], dim=-1)
    assert rows.shape == (len(ids), 8 + columns)
    assert columns == 4 // dtype.itemsize
    got = token_ids_from_wire(rows[:, -columns:].clone())
    assert got.dtype == torch.int64 and got.tolist() == ids.tolist()


REFUSAL_CHECK = """
import sys
import vllm
from vllm.engine.arg_utils import EngineArgs

print("RELEASE", vllm.__version__.split("+")[0])
try:
    EngineArgs(model=sys.argv[1], dtype="bfloat16", enforce_eager=True, max_model_len=512,
               afd_config={"role": "ffn"}).create_engine_config()
    print("ACCEPTED")
except Exception as e:
    print("REFUSED", e)
"""


def test_deepseek_v4_is_refused_where_its_model_file_has_no_hook(tiny_deepseek_v4, series):
    """Patch 0031 hooks vLLM 0.26.0's NVIDIA DeepSeek-V4 model; from 0.32.0
    its MoE forward takes MegaMoE gate metadata and the series leaves the
    patch out (``Requires:``), and vLLM's CPU model file has no hook. There
    the config is refused, naming the model file and the release to use;
    without the refusal the attention side would run the experts itself."""
    out = run_check(REFUSAL_CHECK, str(tiny_deepseek_v4))
    release = out.split("RELEASE ")[1].split()[0]
    if release == series.pin.version:
        assert "ACCEPTED" in out, out
    else:
        assert "REFUSED" in out and "has no AFD hook" in out and "vLLM 0.26.0" in out, out
