"""Model Runner V2's micro-batching with patch 0028, run on the CPU where
the installed vLLM has it (vLLM 0.30 on; the CPU venv of 0.32.0 in CI's
every_release run): an AFD attention rank without data-parallel peers gets
V2's micro-batch runner, takes V2's joint micro-batching decision alone,
builds its stages' forward contexts without DP metadata, and announces the
replays of its micro-batched graphs with their stages. V2's micro-batch
threads need CUDA streams, so the steps themselves run in the GPU tests
(tests/gpu/test_afd_gpu.py, test_dbo_1a1f_matches_colocated, the settings
without -V1)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

ubatch_utils = pytest.importorskip(
    "vllm.v1.worker.gpu.ubatch_utils",
    reason="this vLLM's Model Runner V2 has no micro-batching (vLLM 0.30 added it; "
    "patch 0028 is left out here)",
)
from vllm.afd.attention import step_hooks  # noqa: E402
from vllm.config import ParallelConfig, VllmConfig  # noqa: E402
from vllm.config.compilation import CUDAGraphMode  # noqa: E402
from vllm.distributed.afd_transfer import afd_transfer_state  # noqa: E402
from vllm.v1.worker.gpu import cudagraph_utils, dp_utils  # noqa: E402
from vllm.v1.worker.gpu.cudagraph_utils import BatchExecutionDescriptor  # noqa: E402
from vllm.v1.worker.ubatch_utils import maybe_create_ubatch_slices  # noqa: E402


class FakeEndpoint:
    """An AFD attention endpoint that keeps what it announces."""

    peer_ranks = [0]
    alone_as = None

    def __init__(self) -> None:
        self.sent: list[tuple] = []

    def publish_step(self, token_counts, **flags) -> None:
        self.sent.append((token_counts, flags))


@pytest.fixture
def attention_rank(monkeypatch) -> FakeEndpoint:
    """This process is an AFD attention rank (it has an endpoint)."""
    endpoint = FakeEndpoint()
    monkeypatch.setattr(afd_transfer_state, "get_attention_endpoint", lambda: endpoint)
    monkeypatch.setattr(step_hooks, "get_attention_endpoint", lambda: endpoint)
    return endpoint


def parallel(stages: int = 2, threshold: int = 4) -> ParallelConfig:
    split = {"enable_dbo": True} if stages == 2 else {"ubatch_size": stages}
    return ParallelConfig(
        **split, dbo_decode_token_threshold=threshold, dbo_prefill_token_threshold=threshold
    )


def test_an_afd_attention_rank_gets_v2s_micro_batch_runner_without_dp_peers(monkeypatch):
    built = []
    monkeypatch.setattr(ubatch_utils, "UBatchRunner", lambda *args: built.append(args) or "runner")
    config = SimpleNamespace(parallel_config=parallel())

    def build():
        return ubatch_utils.maybe_build_ubatch_runner(config, "cpu", None, [], None, 8)

    assert build() is None  # stock vLLM: micro-batching needs DP peers
    monkeypatch.setattr(afd_transfer_state, "get_attention_endpoint", FakeEndpoint)
    assert build() == "runner" and len(built) == 1
    config.parallel_config = ParallelConfig()  # no micro-batching asked for
    assert build() is None


class FakeGraphs:
    """A cudagraph manager holding FULL decode graphs of 16 tokens, one
    single-stage and its micro-batched twin (V2's ``_maybe_ubatch_twin``)."""

    def dispatch(self, num_reqs, num_tokens, uniform_token_count, num_active_loras,
                 max_query_len=None, num_ubatches=1):  # fmt: skip
        if num_tokens > 16 or uniform_token_count != 1:
            return BatchExecutionDescriptor(CUDAGraphMode.NONE, num_tokens, num_reqs,
                                            num_ubatches=num_ubatches)  # fmt: skip
        return BatchExecutionDescriptor(CUDAGraphMode.FULL, 16, 16, uniform_token_count=1,
                                        num_ubatches=num_ubatches)  # fmt: skip


def dispatch(num_tokens: int, uniform: int | None, allow: bool = True, stages: int = 2):
    """V2's execute_model asks for a step's descriptor, DP = 1."""
    return dp_utils.dispatch_cg_and_sync_dp(
        FakeGraphs(), num_tokens if uniform else 2, num_tokens, uniform, 1, 0,
        max_query_len=uniform or num_tokens, parallel_config=parallel(stages),
        allow_ubatching=allow, uniform_decode=uniform == 1,
    )  # fmt: skip


def test_without_afd_v2_decides_alone_as_before(one_process_world):
    desc, sync = dispatch(10, uniform=1)
    assert (desc.cg_mode, desc.num_tokens, desc.num_ubatches, sync) == (
        CUDAGraphMode.FULL, 16, 1, None)  # fmt: skip


@pytest.mark.parametrize("stages", [2, 3])
def test_an_afd_attention_rank_takes_v2s_joint_decision_alone(
    one_process_world, attention_rank, stages
):
    # A decode of 10 tokens: the micro-batched twin of the 16-token graph.
    desc, sync = dispatch(10, uniform=1, stages=stages)
    assert (desc.cg_mode, desc.num_tokens, desc.num_ubatches) == (CUDAGraphMode.FULL, 16, stages)
    assert sync.num_tokens_across_dp.tolist() == [16]
    # A decode of 6 would leave the twin's last stage padding only: eager stages.
    desc, _ = dispatch(6, uniform=1, stages=stages)
    assert (desc.cg_mode, desc.num_tokens, desc.num_ubatches) == (CUDAGraphMode.NONE, 6, stages)
    # A prefill chunk above the thresholds: eager stages.
    desc, _ = dispatch(12, uniform=None, stages=stages)
    assert (desc.cg_mode, desc.num_tokens, desc.num_ubatches) == (CUDAGraphMode.NONE, 12, stages)
    # Below the thresholds: one stage, the graph as without micro-batching.
    desc, _ = dispatch(2, uniform=1, stages=stages)
    assert (desc.cg_mode, desc.num_tokens, desc.num_ubatches) == (CUDAGraphMode.FULL, 16, 1)
    # A step that may not micro-batch (a dummy run without attention): as before.
    desc, sync = dispatch(10, uniform=1, allow=False, stages=stages)
    assert (desc.num_ubatches, sync) == (1, None)


def test_stages_without_dp_peers_get_no_dp_metadata(attention_rank):
    """V2 builds each stage's forward context; with DP peers its DP metadata
    holds the stage's count on every rank, alone it has none, as a step's
    forward context without peers has none."""
    config = VllmConfig(parallel_config=parallel())
    runner = SimpleNamespace(parallel_config=config.parallel_config, vllm_config=config)
    _, slices = maybe_create_ubatch_slices(True, np.ones(8, dtype=np.int32), 8, 8, 2)
    contexts = ubatch_utils.UBatchRunner._make_forward_contexts(
        runner, slices, [{}, {}], [{}, {}], [None, None]
    )
    assert [c.dp_metadata for c in contexts] == [None, None]


def test_a_twin_replay_is_announced_with_its_stages(attention_rank, monkeypatch):
    manager = object.__new__(cudagraph_utils.ModelCudaGraphManager)
    twin = BatchExecutionDescriptor(CUDAGraphMode.FULL, 8, 8, uniform_token_count=1,
                                    num_ubatches=2)  # fmt: skip
    single = BatchExecutionDescriptor(CUDAGraphMode.FULL, 8, 8, uniform_token_count=1)
    replayed = []
    graph = SimpleNamespace(replay=lambda: replayed.append(1))
    manager.graphs = {twin: graph, single: graph}
    manager.is_last_pp_rank = True
    manager.use_aux_hidden_state_outputs = False
    manager.hidden_states = torch.zeros(8, 4)
    manager.run_fullgraph(twin)
    manager.run_fullgraph(single)
    assert len(replayed) == 2
    assert attention_rank.sent == [
        (((4,), (4,)), {"is_graph_replaying": True}),
        (((8,),), {"is_graph_replaying": True}),
    ]


def test_the_twin_capture_forwards_are_announced_before_their_threads_run():
    """0028's capture hook sits in V2's ``ubatch_forward_fn``, before the
    ``finish()`` that releases the micro-batch threads, with the slices they
    run (the capture loop's forward context is not theirs)."""
    import ast
    import inspect
    import textwrap

    source = textwrap.dedent(inspect.getsource(cudagraph_utils.ModelCudaGraphManager.capture))
    [fn] = [
        node
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.FunctionDef) and node.name == "ubatch_forward_fn"
    ]
    calls = [ast.unparse(n) for n in ast.walk(fn) if isinstance(n, ast.Call)]
    hook = "publish_capture_forward(num_tokens, warmup, ubatch_state.slices)"
    assert hook in calls
    body = ast.unparse(fn)
    assert body.index(hook) < body.index("finish()")
