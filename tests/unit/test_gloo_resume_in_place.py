"""The gloo data plane failing over in place (``HostInPlaceFailover``): what
an attention rank sends a replacement, and what a replacement answers.

The attention side's gloo group is a stand-in that records each transfer
and fails the ones a test names (as a lost FFN rank's closed sockets fail
them); the failover is a stand-in that says where the replacement resumes.
The FFN side's group records what it sends."""

from __future__ import annotations

import pytest
import torch
from vllm.config import AFDConfig
from vllm.distributed.afd_transfer.afd_connector.base import DataPlaneSpec, StepExchange
from vllm.distributed.afd_transfer.afd_connector.gloo_connector import GlooDataPlane, _tag
from vllm.distributed.afd_transfer.handshake import AFDConnectionError
from vllm.distributed.afd_transfer.resume import PeerPosition, resume_plan

WIDTH, LAYERS = 4, 6


class Work:
    def __init__(self, run) -> None:
        self._run = run

    def wait(self, timeout=None) -> bool:
        self._run()
        return True


class Group:
    """A gloo group of two: its transfers, in order, as (kind, tag, rows);
    the ``fail`` ones ((kind, tag)) raise once, as a lost peer's do."""

    def __init__(self, fail=()) -> None:
        self.transfers: list[tuple[str, int, torch.Tensor | None]] = []
        self.fail = list(fail)

    def _transfer(self, kind: str, tag: int, rows, fill=None) -> Work:
        def run() -> None:
            if (kind, tag) in self.fail:
                self.fail.remove((kind, tag))
                raise RuntimeError("Connection closed by peer")
            if fill is not None:
                fill()
            self.transfers.append((kind, tag, rows))

        return Work(run)

    def send(self, tensors, dst, tag) -> Work:
        return self._transfer("send", tag, tensors[0].clone())

    def recv(self, tensors, src, tag) -> Work:
        return self._transfer("recv", tag, None, lambda: tensors[0].fill_(-tag))


def attention_plane(group: Group, starts: list[PeerPosition]):
    """An attention rank's gloo plane on ``group``, failing over in place:
    each loss resumes at the next of ``starts``; returns it and the
    positions its losses were reported at."""
    afd = AFDConfig(timeout_s=5)
    spec = DataPlaneSpec(afd, "attention", 0, 0, (0,), LAYERS, WIDTH, WIDTH, torch.float32, 64)
    reported: list[PeerPosition] = []

    def resume_after_loss(step: int, layer: int) -> PeerPosition:
        reported.append(PeerPosition(step, layer))
        return starts[len(reported) - 1]

    exchange = StepExchange(transfer_timeout_s=5, resume_after_loss=resume_after_loss)
    plane = GlooDataPlane(spec, exchange)
    plane._groups = {0: group}
    return plane, reported


def forward(plane: GlooDataPlane, step: int, layers: range) -> list[torch.Tensor]:
    """One step's layers: rows of ``step * 100 + layer`` out, the output back."""
    plane.exchange.step_id = step
    outputs = []
    for layer in layers:
        rows = torch.full((3, WIDTH), float(step * 100 + layer))
        plane.send_hidden_states(rows, layer, 0)
        rows.zero_()  # the model reuses its buffers: what was sent must be a copy
        out = torch.empty(3, WIDTH)
        plane.recv_ffn_output(out, layer, 0)
        outputs.append(out)
    return outputs


def sent(group: Group) -> list[tuple[int, float]]:
    """(tag, value) of every send, in order."""
    return [(tag, rows[0, 0].item()) for kind, tag, rows in group.transfers if kind == "send"]


def test_a_lost_answer_is_asked_again_with_this_layers_rows():
    group = Group(fail=[("recv", _tag(2, 0))])
    plane, reported = attention_plane(group, [PeerPosition(7, 2)])
    outputs = forward(plane, 7, range(LAYERS))
    assert reported == [PeerPosition(7, 2)]
    # layer 2's rows went twice: to the lost rank and to its replacement
    assert sent(group) == [(_tag(0, 0), 700.0), (_tag(1, 0), 701.0), (_tag(2, 0), 702.0),
                           (_tag(2, 0), 702.0), (_tag(3, 0), 703.0), (_tag(4, 0), 704.0),
                           (_tag(5, 0), 705.0)]  # fmt: skip
    assert [o[0, 0].item() for o in outputs] == [-_tag(layer, 0) for layer in range(LAYERS)]


def test_a_peer_a_layer_ahead_sends_the_layer_before_again():
    # Lost while sending layer 3; another peer still waits for layer 2's
    # output, so the replacement resumes there and needs these rows too.
    group = Group(fail=[("send", _tag(3, 0))])
    plane, reported = attention_plane(group, [PeerPosition(7, 2)])
    forward(plane, 7, range(LAYERS))
    assert reported == [PeerPosition(7, 3)]
    assert sent(group)[2:6] == [(_tag(2, 0), 702.0), (_tag(2, 0), 702.0), (_tag(3, 0), 703.0),
                                (_tag(4, 0), 704.0)]  # fmt: skip


def test_across_a_step_the_last_layer_of_the_step_before_is_sent_again():
    # Lost at the next step's first transfer; the replacement resumes at
    # the last layer of step 7, where another peer stands.
    group = Group(fail=[("send", _tag(0, 0))])
    plane, _ = attention_plane(group, [PeerPosition(7, LAYERS - 1)])
    plane.exchange.step_id = 7
    forward(plane, 7, range(LAYERS - 1, LAYERS))  # step 7's last layer
    group.transfers.clear()
    forward(plane, 8, range(1))
    assert sent(group) == [(_tag(LAYERS - 1, 0), 705.0), (_tag(0, 0), 800.0)]


def test_after_an_announcement_only_the_kept_rows_at_or_past_the_start_go_again():
    group = Group()
    plane, _ = attention_plane(group, [])
    forward(plane, 7, range(LAYERS))
    group.transfers.clear()
    plane.send_kept_again(PeerPosition(8, 0))  # everything of step 7 answered
    assert sent(group) == []
    plane.send_kept_again(PeerPosition(7, LAYERS - 1))
    assert sent(group) == [(_tag(LAYERS - 1, 0), 705.0)]


def test_without_failover_in_place_a_lost_transfer_raises():
    group = Group(fail=[("recv", _tag(1, 0))])
    plane, _ = attention_plane(group, [])
    plane.exchange.resume_after_loss = None
    with pytest.raises(AFDConnectionError, match="while waiting for the FFN output of layer 1"):
        forward(plane, 7, range(LAYERS))
    assert not plane._kept  # nothing is copied without failover in place


def test_a_replacement_answers_only_the_peers_that_still_wait():
    afd = AFDConfig(role="ffn", num_attention_ranks=2, timeout_s=5)
    spec = DataPlaneSpec(afd, "ffn", 0, 0, (0, 1), LAYERS, WIDTH, WIDTH, torch.float32, 64)
    plane = GlooDataPlane(spec, StepExchange(transfer_timeout_s=5))
    plane._groups = {0: Group(), 1: Group()}
    # peer 0 waits for layer 2's output; peer 1 has it and stands at layer 3
    plane.exchange.resuming = resume_plan([PeerPosition(7, 2), PeerPosition(7, 3)], LAYERS)
    outputs = [torch.ones(3, WIDTH), torch.ones(2, WIDTH)]
    plane.send_ffn_output(outputs, 2, 0)
    assert [len(plane._groups[p].transfers) for p in (0, 1)] == [1, 0]
    assert plane.exchange.resuming is None  # the resumed layer is answered
    plane.send_ffn_output(outputs, 3, 0)
    assert [len(plane._groups[p].transfers) for p in (0, 1)] == [2, 1]
