"""Failover by a redo (gloo, ``RedoFailover``; nccl, ``DeviceRedoFailover``):
what a redone forward repeats and what it does not, on both model
runners' hooks (``vllm.afd.attention.failover``).

Model Runner V1's ``_model_forward`` announces its step itself and is redone
whole (``redo_on_ffn_loss``); Model Runner V2 announces before its model
call (patch 0010), so only the call is redone and the kept step is
announced to the replacement again (``rerun_announced_on_ffn_loss``), while
its FULL graph replay announces itself (``rerun_on_ffn_loss``). The
endpoint here is an ``AttentionEndpoint`` with its real announcing and
counting, a fake control connection, and a replacement that joins at once.

On nccl no error reaches the forward: the watchdog's ``on_loss`` (called
here where it would come, while the GPU waits) aborts the communicator,
and the check after the forward finds the loss. The graphs hold the
aborted communicator, so the redo and every later step run eager: on V1
through the forward context's mode, on V2 through the None of the replay
and ``eager_after_graph_loss`` (patch 0027).
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
from vllm.afd.attention.failover import (
    eager_after_graph_loss,
    redo_on_ffn_loss,
    rerun_announced_on_ffn_loss,
    rerun_on_ffn_loss,
)
from vllm.afd.attention.step_hooks import publish_forward_step
from vllm.config import AFDConfig, CUDAGraphMode
from vllm.distributed.afd_transfer import afd_transfer_state
from vllm.distributed.afd_transfer.accounting import AttentionAccounting
from vllm.distributed.afd_transfer.afd_connector.base import StepExchange
from vllm.distributed.afd_transfer.endpoint.attention import AttentionEndpoint
from vllm.distributed.afd_transfer.failover import DeviceRedoFailover, Failover, RedoFailover
from vllm.distributed.afd_transfer.handshake import AFDConnectionError
from vllm.distributed.afd_transfer.step_stats import NULL_TIMELINE
from vllm.forward_context import ForwardContext, override_forward_context

ONE_STEP = ((4,),)
"""One stage, this rank's 4 tokens."""


class FakeClient:
    """A control connection: the payloads it sent; the first ``fail_sends``
    sends find the FFN rank gone."""

    address = "127.0.0.1:1"

    def __init__(self, fail_sends: int = 0) -> None:
        self.sent = []
        self.fail_sends = fail_sends

    def send_payload(self, payload) -> None:
        if self.fail_sends:
            self.fail_sends -= 1
            raise AFDConnectionError("lost the FFN rank (the announcement failed)")
        self.sent.append(payload)

    def stop_notice(self, wait_s: float) -> None:
        return None  # lost, not stopped on purpose

    def close(self) -> None:
        pass


class Endpoint(AttentionEndpoint):
    """An attention endpoint without sockets or a data plane."""

    rank = 0
    host = "127.0.0.1"
    port = 1

    def __init__(self, client: FakeClient, failover: bool = True) -> None:
        self.afd_config = AFDConfig(failover_timeout_s=30 if failover else 0)
        self.exchange = StepExchange()
        self.accounting = AttentionAccounting(0, NULL_TIMELINE)
        self.data_plane = SimpleNamespace(join=lambda facts: None, leave=lambda: None,
                                          device_facts=lambda: {})  # fmt: skip
        self.client = client
        self._next_step = 0
        self.failover = RedoFailover(self, None) if failover else Failover(self)

    def use_client(self, client) -> None:
        self.client = client

    def watch_again(self) -> None:
        pass

    def stop_watching(self) -> None:
        pass


@pytest.fixture
def replacements(monkeypatch):
    """The FFN ranks that take the lost one's place, in order, each a fresh
    control connection; ``resume_steps`` records the step each was told it
    runs again; ``dying``: how many of them find their announcement fails."""
    joined = SimpleNamespace(clients=[], resume_steps=[], dying=0)

    def connect(failover, cause, lost_at, in_place, **hello):
        assert not in_place
        joined.resume_steps.append(hello["resume_step"])
        client = FakeClient(fail_sends=1 if joined.dying else 0)
        joined.dying = max(0, joined.dying - 1)
        joined.clients.append(client)
        return client, SimpleNamespace(data_plane={})

    monkeypatch.setattr(RedoFailover, "_connect_replacement", connect)
    return joined


@pytest.fixture
def endpoint(monkeypatch):
    endpoint = Endpoint(FakeClient())
    monkeypatch.setattr(afd_transfer_state, "_AFD_ENDPOINT", endpoint)
    return endpoint


def failing_once(calls: list, result="hidden states"):
    """A forward whose first run loses the FFN rank in a transfer."""

    def forward(*args, **kwargs):
        calls.append((args, kwargs))
        if len(calls) == 1:
            raise AFDConnectionError("lost the FFN rank (gloo: Connection closed by peer)")
        return result

    return forward


def test_v2_eager_forward_runs_again_announced_again_to_the_replacement(endpoint, replacements):
    """V2: state updates, pre_forward, EPLB and step timing ran before the
    announcement, and are not in the redone callable; the step is announced
    again to the replacement, once, as it was first, and counted once."""
    first = endpoint.client
    endpoint.publish_step(ONE_STEP)  # patch 0010, before the model call
    calls = []
    out = rerun_announced_on_ffn_loss(failing_once(calls), "input_ids", positions="positions")
    assert out == "hidden states"
    assert calls == [(("input_ids",), {"positions": "positions"})] * 2  # the same inputs
    [announced] = first.sent
    [replacement] = replacements.clients
    assert replacement.sent == [announced]  # the same step, layout and flags
    assert replacements.resume_steps == [announced.step_id] == [0]
    assert endpoint._next_step == 1
    assert endpoint.accounting.tokens_sent == 4  # rolled back, then counted again
    assert endpoint.accounting.graph_stats.eager == 1
    assert endpoint.accounting.failovers == 1
    # The next step goes on from there, to the replacement.
    endpoint.publish_step(ONE_STEP)
    assert [p.step_id for p in replacement.sent] == [0, 1]


def test_v2_graph_replay_announces_itself_when_run_again(endpoint, replacements):
    """V2's FULL replay announces its step inside ``run_fullgraph`` (patch
    0011): run again, it announces it again itself, and nothing else does."""
    calls = []
    lose_once = failing_once(calls)

    def run_fullgraph(desc):
        endpoint.publish_step(((desc,),), is_graph_replaying=True)
        return lose_once(desc)

    assert rerun_on_ffn_loss(run_fullgraph, 4) == "hidden states"
    [replacement] = replacements.clients
    assert [(p.step_id, p.is_graph_replaying) for p in replacement.sent] == [(0, True)]
    assert endpoint._next_step == 1
    assert endpoint.accounting.graph_stats.replays == 1


def test_v1_forward_announcing_itself_is_redone_whole(endpoint, replacements):
    calls = []
    lose_once = failing_once(calls)

    @redo_on_ffn_loss
    def model_forward(x):
        endpoint.publish_step(ONE_STEP)
        return lose_once(x)

    assert model_forward(1) == "hidden states"
    [replacement] = replacements.clients
    assert [p.step_id for p in replacement.sent] == [0]
    assert endpoint.accounting.tokens_sent == 4


def test_an_announcement_that_finds_the_ffn_rank_gone_goes_to_the_replacement(
    endpoint, replacements
):
    """The FFN rank died between steps: the announcement fails before any of
    the step runs (V2 announces outside the redone call), and the step is
    the replacement's first; a replacement that dies at once is replaced."""
    endpoint.publish_step(ONE_STEP)
    endpoint.client.fail_sends = 1
    replacements.dying = 1
    endpoint.publish_step(ONE_STEP)
    dead, replacement = replacements.clients
    assert dead.sent == [] and [p.step_id for p in replacement.sent] == [1]
    assert replacements.resume_steps == [1, 1]
    assert endpoint._next_step == 2
    assert endpoint.accounting.tokens_sent == 8 and endpoint.accounting.failovers == 2


def test_no_replacement_in_time_ends_the_rank(endpoint, monkeypatch):
    def none_came(failover, cause, lost_at, in_place, **hello):
        raise AFDConnectionError("no FFN rank took its place within 30 s")

    monkeypatch.setattr(RedoFailover, "_connect_replacement", none_came)
    endpoint.publish_step(ONE_STEP)
    calls = []
    with pytest.raises(AFDConnectionError, match="no FFN rank took its place"):
        rerun_announced_on_ffn_loss(failing_once(calls))
    assert len(calls) == 1


@pytest.mark.parametrize("rerun", [rerun_announced_on_ffn_loss, rerun_on_ffn_loss])
def test_without_failover_on_the_host_a_loss_is_raised(rerun, monkeypatch):
    """No failover (or an in-place one, whose failure is final), or no AFD
    at all: the helpers only call the forward."""
    calls = []
    monkeypatch.setattr(afd_transfer_state, "_AFD_ENDPOINT", None)
    assert rerun(lambda *a, **k: (a, k), 1, x=2) == ((1,), {"x": 2})
    with pytest.raises(AFDConnectionError):
        rerun(failing_once(calls))
    endpoint = Endpoint(FakeClient(), failover=False)
    monkeypatch.setattr(afd_transfer_state, "_AFD_ENDPOINT", endpoint)
    with pytest.raises(AFDConnectionError):
        rerun(failing_once(calls := []))
    assert len(calls) == 1


class NcclEndpoint(Endpoint):
    """An attention endpoint whose data plane waits on the device (nccl)."""

    peer_ranks = [0]
    alone_as = None

    def __init__(self, client: FakeClient) -> None:
        super().__init__(client)
        self.aborts = []
        abort = lambda: self.aborts.append(self._next_step)  # noqa: E731
        self.data_plane = SimpleNamespace(join=lambda facts: None, leave=lambda: None,
                                          device_facts=lambda: {}, device_waits=True,
                                          abort=abort)  # fmt: skip
        self.failover = DeviceRedoFailover(self, None)


@pytest.fixture
def nccl_endpoint(monkeypatch):
    """``NcclEndpoint``; the GPU waits it does are counted in ``gpu_waits``."""
    endpoint = NcclEndpoint(FakeClient())
    endpoint.gpu_waits = []
    monkeypatch.setattr(afd_transfer_state, "_AFD_ENDPOINT", endpoint)
    waiting = staticmethod(lambda: endpoint.gpu_waits.append(endpoint._next_step))
    monkeypatch.setattr(DeviceRedoFailover, "_wait_for_the_gpu", waiting)
    return endpoint


def losing_the_ffn_rank_once(endpoint, result="hidden states"):
    """A forward during whose first run the FFN rank is lost (the watchdog
    aborts the communicator); it then returns what the GPU computed."""
    runs = []

    def forward(*args):
        runs.append(args)
        if len(runs) == 1:
            assert endpoint.failover.on_loss()
        return result

    return forward, runs


@dataclasses.dataclass(frozen=True)
class Descriptor:
    """What ``eager_after_graph_loss`` reads of V2's BatchExecutionDescriptor."""

    cg_mode: CUDAGraphMode
    num_tokens: int


def test_nccl_v2_replay_lost_in_flight_runs_again_eager(nccl_endpoint, replacements):
    """V2: the replay that the abort ended returns None (patch 0027 then
    runs the step eager), its step rewound for the eager branch's own
    announcement; every later FULL step is turned eager."""
    full = Descriptor(CUDAGraphMode.FULL, 4)
    assert eager_after_graph_loss(full) is full  # before any loss
    lose_once, runs = losing_the_ffn_rank_once(nccl_endpoint)

    def run_fullgraph(desc):
        nccl_endpoint.publish_step(((desc.num_tokens,),), is_graph_replaying=True)
        return lose_once(desc)

    first = nccl_endpoint.client
    assert rerun_on_ffn_loss(run_fullgraph, full) is None
    assert len(runs) == 1 and nccl_endpoint.aborts == [1]
    assert nccl_endpoint._next_step == 0  # the step runs again, announced by the eager branch
    assert eager_after_graph_loss(full).cg_mode == CUDAGraphMode.NONE
    nccl_endpoint.publish_step(ONE_STEP)  # patch 0010, eager
    assert rerun_announced_on_ffn_loss(lambda: "hidden states") == "hidden states"
    [replacement] = replacements.clients
    assert [(p.step_id, p.is_graph_replaying) for p in first.sent] == [(0, True)]
    assert [(p.step_id, p.is_graph_replaying) for p in replacement.sent] == [(0, False)]
    assert replacements.resume_steps == [0]
    assert nccl_endpoint.gpu_waits == [1]  # the eager run's check waited for the GPU
    assert eager_after_graph_loss(full).cg_mode == CUDAGraphMode.NONE  # and stays so


def v1_model_forward(endpoint, modes: list, lose_once):
    """Model Runner V1's ``_model_forward`` (patches 0005, 0025): the hook
    announces the step, then CUDAGraphWrapper replays or runs eager as the
    forward context's mode says (``modes``)."""

    @redo_on_ffn_loss
    def model_forward():
        publish_forward_step(4)
        modes.append(_context.cudagraph_runtime_mode)
        return lose_once()

    _context = ForwardContext(no_compile_layers={}, attn_metadata={}, slot_mapping={},
                              cudagraph_runtime_mode=CUDAGraphMode.FULL)  # fmt: skip

    def run():
        _context.cudagraph_runtime_mode = CUDAGraphMode.FULL  # dispatched to a graph
        with override_forward_context(_context):
            return model_forward()

    return run


def test_nccl_v1_replay_lost_in_flight_runs_again_eager(nccl_endpoint, replacements):
    lose_once, runs = losing_the_ffn_rank_once(nccl_endpoint)
    modes = []
    step = v1_model_forward(nccl_endpoint, modes, lose_once)
    assert step() == "hidden states"
    assert modes == [CUDAGraphMode.FULL, CUDAGraphMode.NONE]
    [replacement] = replacements.clients
    assert [(p.step_id, p.is_graph_replaying) for p in replacement.sent] == [(0, False)]
    assert nccl_endpoint.accounting.graph_stats.eager == 1
    assert nccl_endpoint.accounting.graph_stats.replays == 0  # rolled back
    step()  # a later step dispatched to a graph runs eager too
    assert modes[-1] == CUDAGraphMode.NONE
    assert [p.step_id for p in replacement.sent] == [0, 1]


def test_nccl_loss_between_steps_reaches_the_next_announcement(nccl_endpoint, replacements):
    """The watchdog saw the loss between steps: the next step, dispatched to a
    graph, goes eager to the replacement, and nothing runs twice."""
    calls = []
    step = v1_model_forward(nccl_endpoint, [], lambda: calls.append(1) or "hidden states")
    step()
    assert nccl_endpoint.failover.on_loss()
    step()
    [replacement] = replacements.clients
    assert len(calls) == 2 and replacements.resume_steps == [1]
    assert [(p.step_id, p.is_graph_replaying) for p in replacement.sent] == [(1, False)]


def test_nccl_announcement_that_fails_before_a_replay_is_redone_eager(nccl_endpoint, replacements):
    """The announcement of a replay finds the FFN rank gone before the
    watchdog does: after the replacement joins, the graph must not run."""
    nccl_endpoint.client.fail_sends = 1
    calls = []
    modes = []
    step = v1_model_forward(nccl_endpoint, modes, lambda: calls.append(1) or "hidden states")
    assert step() == "hidden states"
    assert modes == [CUDAGraphMode.NONE] and len(calls) == 1
    [replacement] = replacements.clients
    assert [(p.step_id, p.is_graph_replaying) for p in replacement.sent] == [(0, False)]
