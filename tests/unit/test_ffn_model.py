"""The FFN role's model holds exactly the checkpoint's MLPs and computes them.

Built the way `vllm afd-ffn` builds it (FFNWorker, vLLM's own loader), then
checked layer by layer against the MLP computed by hand from the safetensors
file. The models are built in a subprocess, as vLLM's distributed state is
per process, and all in one (the fixture ``built``): importing vLLM takes a
fresh process about 12 s, a tiny model's build a second or two. Between two
builds the process takes vLLM's distributed state down, so that each build
sets it up for its own model, as a process of its own would.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from typing import NamedTuple, NoReturn

import pytest

BUILD_PROCESS = """
import faulthandler
import json
import os
import sys
import traceback

import torch
import torch.nn.functional as F
import vllm
from safetensors.torch import load_file
from vllm.afd.ffn.worker import FFNWorker, init_batch_invariance
from vllm.afd.models.ffn_model import FFNModel
from vllm.afd.models.registry import ffn_input_width
from vllm.afd.models.remote_ffn import RemoteFFN, RemoteMoE
from vllm.distributed import cleanup_dist_env_and_memory
from vllm.engine.arg_utils import EngineArgs
from vllm.forward_context import set_forward_context

# What the running check reports, for its test to check.
reported = []


def report(*values):
    reported.append(" ".join(map(str, values)))


# Every worker built stays alive: vLLM caches a model's pipeline-parallel
# missing layers by id(model) (models/utils.py), which a later model could
# otherwise be given.
workers = []


def ffn_config(model_dir, dtype, afd, **engine_args):
    return EngineArgs(
        model=model_dir, dtype=dtype, enforce_eager=True, afd_config={"role": "ffn", **afd},
        **engine_args,
    ).create_engine_config()


def ffn_model(config):
    worker = FFNWorker(config, 0)
    worker.init_device()
    worker.load_model()
    workers.append(worker)
    return worker.runner.model


def ffn_model_matches_the_checkpoint(model_dir):
    config = ffn_config(model_dir, "float32", {})
    model = ffn_model(config)
    assert isinstance(model, FFNModel)
    names = sorted(n for n, _ in model.named_parameters())
    assert names == sorted(
        f"model.layers.{i}.mlp.{p}.weight" for i in range(2) for p in ("gate_up_proj", "down_proj")
    ), names
    weights = load_file(f"{model_dir}/model.safetensors")
    hidden = config.model_config.get_hidden_size()
    x = torch.randn(5, hidden, generator=torch.Generator().manual_seed(0))
    for layer in range(2):
        prefix = f"model.layers.{layer}.mlp."
        w = {p: weights[f"{prefix}{p}_proj.weight"] for p in ("gate", "up", "down")}
        expected = (F.silu(x @ w["gate"].T) * (x @ w["up"].T)) @ w["down"].T
        with torch.inference_mode():
            got = model(layer, x)
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    report("FFN MODEL OK")


def moe_ffn_model_params(model_dir, placement):
    afd = {"compute_gate_on_attention": placement == "gate-attn"}
    model = ffn_model(ffn_config(model_dir, "float32", afd))
    report("EXCHANGES", model.num_layers, "")
    report("PARAMS", " ".join(n for n, _ in model.named_parameters()))


def batch_invariant_mode(model_dir, env):
    batch_invariant = sys.modules[init_batch_invariance.__module__]  # its home moved in 0.29
    before = batch_invariant._batch_invariant_MODE
    os.environ["VLLM_BATCH_INVARIANT"] = env
    FFNWorker(ffn_config(model_dir, "float32", {}), 0).init_device()
    report("BATCH INVARIANT MODE", before, "->", batch_invariant._batch_invariant_MODE)


def router_logits_on_the_wire(model_dir):
    gate_name = "model.layers.1.mlp.gate.weight"
    config = ffn_config(model_dir, "bfloat16", {"compute_gate_on_attention": True})
    model = ffn_model(config)
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
    report("SENT", sent.dtype, "RECEIVED", received[0].dtype)
    report("EXACT", torch.equal(received[0], sent))
    report("BF16 WOULD ROUND", not torch.equal(sent.to(torch.bfloat16).to(sent.dtype), sent))


class Handed(Exception):
    pass


def deepseek_v4_ffn_model(model_dir, placement):
    gate_on_attention = placement == "gate-attn"
    config = ffn_config(model_dir, "bfloat16", {"compute_gate_on_attention": gate_on_attention},
                        max_model_len=512)
    model = ffn_model(config)  # vLLM's loader refuses a parameter the checkpoint left unset
    params = dict(model.named_parameters())
    report("EXCHANGES", model.num_layers, "")
    report("PARAMS", " ".join(params))
    ckpt = load_file(f"{model_dir}/model.safetensors")
    layer0, layer1 = "model.layers.0.ffn.", "model.layers.1.ffn."
    report("TABLE", torch.equal(params[f"{layer0}gate.tid2eid"], ckpt["layers.0.ffn.gate.tid2eid"]))
    report("BIAS", torch.equal(
        params[f"{layer1}gate.e_score_correction_bias"], ckpt["layers.1.ffn.gate.bias"]))
    # an expert's stacked projections, gate (w1) rows first, and the shared
    # expert's, as the checkpoint holds them
    w13 = params[f"{layer1}experts.routed_experts.w13_weight"]
    expert = torch.cat([ckpt[f"layers.1.ffn.experts.3.{w}.weight"] for w in ("w1", "w3")])
    shared = torch.cat([ckpt[f"layers.1.ffn.shared_experts.{w}.weight"] for w in ("w1", "w3")])
    report("EXPERT", torch.equal(w13[3], expert))
    report("SHARED", torch.equal(params[f"{layer1}shared_experts.gate_up_proj.weight"], shared))

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
            report("LOGITS", torch.equal(handed["router_logits"], routing.router_logits(gate, x)))
    report("WIDTH", rows.shape[1], ffn_input_width(config), hidden_size)
    report("HIDDEN", torch.equal(handed["hidden_states"], x))
    report("IDS", handed["input_ids"].tolist() == ids.tolist(), handed["input_ids"].dtype)


def release_accepts_deepseek_v4(model_dir):
    report("RELEASE", vllm.__version__.split("+")[0])
    try:
        ffn_config(model_dir, "bfloat16", {}, max_model_len=512)
        report("ACCEPTED")
    except Exception as e:
        report("REFUSED", e)


# One JSON line per build, in order, with what its check reported and, where
# it raised, the traceback: a failed build fails its own test only. A build
# that hangs ends the process, its threads' stacks in the log.
results, timeout, builds = sys.argv[1], float(sys.argv[2]), json.loads(sys.argv[3])
with open(results, "w") as out:
    for check, model_dir, *options in builds:
        reported, record = [], {}
        faulthandler.dump_traceback_later(timeout, exit=True)
        try:
            globals()[check](model_dir, *options)
        except Exception:
            record["error"] = traceback.format_exc()
        # Down after every build: vLLM would keep the parallel groups that the
        # first build set up for its model (an expert-parallel group only for
        # a MoE model), and what a failed build left half set up.
        cleanup_dist_env_and_memory()
        faulthandler.cancel_dump_traceback_later()
        record["reported"] = reported
        print(json.dumps(record), file=out, flush=True)
"""


class Build(NamedTuple):
    """A tiny checkpoint's FFN model for the build process to build, and the
    check to run on it. A test of a built model takes its Build as the
    parameter ``build``: the fixture ``built`` finds there what to build."""

    check: str  # a function of BUILD_PROCESS
    model: str  # the checkpoint: the fixture tiny_<model>
    option: str = ""  # the check's argument, if any

    def __str__(self) -> str:  # the test's id
        return "-".join(filter(None, (self.model, self.option)))


BATCH_INVARIANT_ON = Build("batch_invariant_mode", "qwen3", "1")

BUILD_TIMEOUT_S = 300
"""The longest a build may take (seconds), as long as each test's own process had."""


def fail(reason: str, detail: str) -> NoReturn:
    # The build process's traceback or log says where; the test's own would not.
    pytest.fail(f"{reason}:\n{detail}", pytrace=False)


@pytest.fixture(scope="module")
def built(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Callable[[Build], str]:
    """What each check reported, the builds of this session's selected tests
    all made in one process. A build that fails, or whose checkpoint's
    fixture fails or skips, fails or skips its own test only."""
    selected = dict.fromkeys(
        item.callspec.params["build"]
        for item in request.session.items
        if item.path == request.path and "build" in item.fixturenames
    )
    checkpoints, unavailable = {}, {}
    for build in selected:
        try:
            checkpoints[build] = str(request.getfixturevalue(f"tiny_{build.model}"))
        except (Exception, pytest.skip.Exception) as e:
            unavailable[build] = e
    # Batch-invariant mode, once on, stays on in the process (vLLM overrides
    # torch's kernels): the build that turns it on comes last.
    builds = sorted(checkpoints, key=lambda build: build == BATCH_INVARIANT_ON)
    args = [[b.check, checkpoints[b]] + ([b.option] if b.option else []) for b in builds]
    work = tmp_path_factory.mktemp("ffn-model-builds")
    results, log = work / "results.jsonl", work / "log"
    command = [sys.executable, "-c", BUILD_PROCESS, results, str(BUILD_TIMEOUT_S), json.dumps(args)]
    timeout = 300 + BUILD_TIMEOUT_S * len(builds)  # vLLM's import, then the builds
    with log.open("w") as log_file:
        try:
            returncode = subprocess.run(
                command,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                timeout=timeout,
            ).returncode
            ended = f"exited with status {returncode}"
        except subprocess.TimeoutExpired:
            returncode, ended = None, f"was stopped after {timeout} s"
    # One line per build, fewer where the process died in a build.
    lines = results.read_text().splitlines() if results.exists() else []
    records = dict(zip(builds, map(json.loads, lines), strict=False))

    def reported(build: Build) -> str:
        if build in unavailable:
            raise unavailable[build]
        record = records.get(build)
        if record is None:
            fail(f"the build process {ended} before it built {build}", log.read_text()[-4000:])
        out = "\n".join(record["reported"])
        if "error" in record:
            fail(f"{build} failed in the build process", f"{out}\n{record['error']}")
        # A process that fails after its last build (at exit) fails every test
        # with it, as each test's own process would have.
        if len(records) == len(builds) and returncode != 0:
            fail(f"the build process {ended} after its last build", log.read_text()[-4000:])
        return out

    return reported


@pytest.mark.parametrize(
    "build",
    [Build("ffn_model_matches_the_checkpoint", arch) for arch in ("qwen3", "llama")],
    ids=str,
)
def test_ffn_model_matches_the_checkpoint(build, built):
    assert "FFN MODEL OK" in built(build)


MOE_ARCHS = ["qwen3_moe", "qwen2_moe", "deepseek_v2", "deepseek_v3", "deepseek_v32", "glm4_moe",
             "qwen3_5_moe", "kimi_k25", "glm_moe_dsa"]  # fmt: skip


@pytest.mark.parametrize(
    "build",
    [
        Build("moe_ffn_model_params", arch, gate)
        for gate in ("gate-ffn", "gate-attn")
        for arch in MOE_ARCHS
    ],
    ids=str,
)
def test_moe_ffn_model_holds_the_ffns_and_nothing_else(build, built):
    """The FFN rank of a MoE model: every layer's experts (and shared experts,
    and dense MLPs where the model has them), the router gate unless it runs
    on the attention side, the router's correction bias in both placements;
    no attention (DeepSeek-V3.2's and GLM-5's with its indexer), norm, embedding or head,
    nothing of the checkpoint's multi-token-prediction layer (DeepSeek-V3's
    GLM-4.5's and GLM-5's layer 2, Qwen3.5's ``mtp.*``) or of a vision tower
    (Qwen3.5-MoE's, whose decoder layers are under ``model.language_model.``
    and whose experts are stored as 3-D tensors; Kimi-K2.5's, whose layers
    are under ``language_model.model.``)."""
    arch, gate = build.model, build.option
    names = built(build).split("PARAMS ")[1].split()
    assert all(n.startswith(("model.layers.0.mlp.", "model.layers.1.mlp.")) for n in names), names
    moe_layer = "model.layers.1.mlp."  # layer 0 is dense in the DeepSeek and GLM checkpoints
    assert (f"{moe_layer}gate.weight" in names) == (gate == "gate-ffn")
    assert any(n.startswith(f"{moe_layer}experts.") for n in names), names
    has_bias = arch in ("deepseek_v3", "deepseek_v32", "glm4_moe", "kimi_k25", "glm_moe_dsa")
    assert (f"{moe_layer}gate.e_score_correction_bias" in names) == has_bias, names


@pytest.mark.parametrize(
    "build", [Build("moe_ffn_model_params", "longcat_flash", "gate-ffn")], ids=str
)
def test_longcat_flash_ffn_model_holds_both_mlps_and_the_shortcut_moe(build, built):
    """LongCat-Flash's FFN rank: per layer its two dense MLPs and its shortcut
    MoE block (router with its correction bias over routed and zero-compute
    experts, routed experts), under the checkpoint's names, and nothing of
    its two attentions or norms. Its forward runs on the GPU only
    (tests/gpu: vLLM's CPU fused-MoE kernel does not take its routing)."""
    out = built(build)
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


@pytest.mark.parametrize(
    "build", [Build("batch_invariant_mode", "qwen3", env) for env in ("1", "0")], ids=str
)
def test_ffn_rank_follows_vllm_batch_invariant(build, built):
    """VLLM_BATCH_INVARIANT=1 switches the FFN rank's kernels to vLLM's
    batch-invariant ones, as it does the attention side's; with it off they
    stay vLLM's defaults. Off before the FFN rank starts, either way."""
    env = build.option
    assert f"BATCH INVARIANT MODE False -> {env == '1'}" in built(build)


@pytest.mark.parametrize("build", [Build("router_logits_on_the_wire", "glm4_moe")], ids=str)
def test_float32_router_logits_reach_the_experts_bit_for_bit(build, built):
    """GLM-4.5's router computes float32 logits, and its experts take them in
    float32. With the gate on the attention side of a bf16 model they travel
    in two bf16 columns each (its bytes) and the FFN rank's experts receive
    exactly what the gate computed. The logits here are not bf16 values, so
    rounding them on the way (how they travelled before, and what changed
    greedy tokens on a GPU) fails the check."""
    out = built(build)
    assert "SENT torch.float32 RECEIVED torch.float32" in out, out
    assert "EXACT True" in out and "BF16 WOULD ROUND True" in out, out


@pytest.mark.parametrize(
    "build",
    [Build("deepseek_v4_ffn_model", "deepseek_v4", gate) for gate in ("gate-ffn", "gate-attn")],
    ids=str,
)
def test_deepseek_v4_ffn_rank_holds_its_blocks_and_gets_each_rows_token_id(build, built):
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
    gate = build.option
    out = built(build)
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


@pytest.mark.parametrize("build", [Build("release_accepts_deepseek_v4", "deepseek_v4")], ids=str)
def test_deepseek_v4_is_refused_where_its_model_file_has_no_hook(build, built, series):
    """Patch 0031 hooks vLLM 0.26.0's NVIDIA DeepSeek-V4 model; from 0.32.0
    its MoE forward takes MegaMoE gate metadata and the series leaves the
    patch out (``Requires:``), and vLLM's CPU model file has no hook. There
    the config is refused, naming the model file and the release to use;
    without the refusal the attention side would run the experts itself."""
    out = built(build)
    release = out.split("RELEASE ")[1].split()[0]
    if release == series.pin.version:
        assert "ACCEPTED" in out, out
    else:
        assert "REFUSED" in out and "has no AFD hook" in out and "vLLM 0.26.0" in out, out
