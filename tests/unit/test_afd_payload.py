"""The control payload's wire format and the FFN side's merge of peer payloads."""

from __future__ import annotations

import struct

import pytest
from vllm.distributed.afd_transfer.payload import (
    AFD_PROTOCOL_VERSION,
    ControlPayload,
    PayloadError,
    merge_peer_payloads,
)

CASES = [
    ControlPayload(step_id=0, token_counts=((7,),), is_profile=True),
    ControlPayload(step_id=41, token_counts=((4, 4),), is_graph_replaying=True),
    ControlPayload(step_id=2**40, token_counts=((3, 0), (5, 1)), is_warmup=True),
    ControlPayload(step_id=9, token_counts=((8,),), is_graph_capturing=True, is_warmup=True),
    ControlPayload.shutdown_message(12),
    ControlPayload.shutdown_message(12, after_failure=True),
]


@pytest.mark.parametrize("payload", CASES)
def test_round_trip(payload):
    wire = payload.encode()
    assert ControlPayload.decode(wire) == payload
    assert len(wire) == 18 + 4 * payload.num_stages * payload.num_peers


def test_layout_accessors():
    payload = ControlPayload(step_id=1, token_counts=((3, 0), (5, 1)))
    assert (payload.num_stages, payload.num_peers) == (2, 2)
    assert payload.flags == dict.fromkeys(
        [
            "is_warmup",
            "is_graph_capturing",
            "is_graph_replaying",
            "is_profile",
            "shutdown",
            "after_failure",
        ],
        False,
    )


@pytest.mark.parametrize(
    ("counts", "message"),
    [
        ((), "needs at least one stage"),
        (((1, 2), (3,)), "same peers"),
        (((-1,),), ">= 0"),
        (((1,),) * 5, "at most 4 stages"),
    ],
)
def test_bad_layouts(counts, message):
    with pytest.raises(PayloadError, match=message):
        ControlPayload(step_id=0, token_counts=counts)


def test_decode_rejects_foreign_and_newer_messages():
    wire = ControlPayload(step_id=3, token_counts=((2,),)).encode()
    with pytest.raises(PayloadError, match="not an AFD control message"):
        ControlPayload.decode(b"HTTP" + wire[4:])
    newer = wire[:4] + struct.pack("<H", AFD_PROTOCOL_VERSION + 1) + wire[6:]
    with pytest.raises(PayloadError, match="run the same vLLM-AFD build on both roles"):
        ControlPayload.decode(newer)
    with pytest.raises(PayloadError, match="expected 22"):
        ControlPayload.decode(wire + b"\0")
    with pytest.raises(PayloadError, match="too short"):
        ControlPayload.decode(wire[:5])


def test_merge_accepts_agreeing_peers():
    step = ControlPayload(step_id=5, token_counts=((4, 4),), is_graph_replaying=True)
    assert merge_peer_payloads([step, step], expected_step=5) == step


def test_an_idle_peers_dummy_batch_joins_a_real_step():
    real = ControlPayload(step_id=5, token_counts=((3, 1),))
    dummy = ControlPayload(step_id=5, token_counts=((3, 1),), is_warmup=True)
    assert merge_peer_payloads([real, dummy], expected_step=5) == real
    assert merge_peer_payloads([dummy, dummy], expected_step=5) == dummy


def test_a_peer_that_failed_marks_the_shutdown_step():
    done = ControlPayload.shutdown_message(9)
    failed = ControlPayload.shutdown_message(9, after_failure=True)
    assert merge_peer_payloads([done, failed], expected_step=9) == failed
    assert merge_peer_payloads([done, done], expected_step=9) == done


@pytest.mark.parametrize(
    ("payloads", "message"),
    [
        ([ControlPayload(step_id=6, token_counts=((1,),))], "announced step 6, expected 5"),
        (
            [
                ControlPayload(step_id=5, token_counts=((4, 4),)),
                ControlPayload(step_id=5, token_counts=((7, 1),)),
            ],
            "peers disagree on step 5",
        ),
        (
            [
                ControlPayload(step_id=5, token_counts=((4, 4),)),
                ControlPayload(step_id=5, token_counts=((4, 4),), is_graph_replaying=True),
            ],
            "peers disagree on step 5",
        ),
        ([ControlPayload(step_id=5, token_counts=((4, 4),))], "lists 2 peers"),
    ],
)
def test_merge_rejects_drift(payloads, message):
    with pytest.raises(PayloadError, match=message):
        merge_peer_payloads(payloads, expected_step=5)
