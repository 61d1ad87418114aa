"""Waits before serving take ``startup_timeout_s``, real steps ``timeout_s``.

Both ends of a real gloo connector pair in this process (the FFN rank's in a
thread): the attention side stalls inside a warm-up forward, as it does
while it compiles its model, for longer than ``timeout_s``, and the FFN
rank waits; the same stall in a real step is an error naming the bound.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch
from vllm.distributed.afd_transfer.afd_connector.factory import AFDConnectorFactory
from vllm.distributed.afd_transfer.handshake import AFDConnectionError
from vllm.engine.arg_utils import EngineArgs

from generate import free_port

STALL_S = 3.0
TIMEOUT_S = 1.0


def connector(model, role: str, port: int):
    afd = {"role": role, "port": port, "timeout_s": TIMEOUT_S, "startup_timeout_s": 30}
    config = EngineArgs(model=str(model), enforce_eager=True, afd_config=afd)
    vllm_config = config.create_engine_config()
    hidden = vllm_config.model_config.get_hidden_size()
    return AFDConnectorFactory.create_connector(vllm_config, 0, input_width=hidden)


@pytest.fixture
def pair(tiny_qwen3):
    port = free_port()
    ffn, attention = connector(tiny_qwen3, "ffn", port), connector(tiny_qwen3, "attention", port)
    serving = threading.Thread(target=ffn.connect)
    serving.start()
    attention.connect()
    serving.join()
    yield ffn, attention
    for end in (attention, ffn):
        end.close()


def test_a_warm_up_stall_is_waited_for_and_a_real_one_is_an_error(pair):
    ffn, attention = pair
    rows = torch.ones(2, ffn.input_width, dtype=ffn.dtype)
    attention.publish_step(((2,),), is_warmup=True)
    assert ffn.next_step().is_warmup
    threading.Timer(STALL_S, attention.send_hidden_states, (rows, 0, 0)).start()
    start = time.monotonic()
    (received,) = ffn.recv_hidden_states(0, 0, (2,))
    assert time.monotonic() - start >= STALL_S - 0.5 and torch.equal(received, rows)

    attention.publish_step(((2,),))
    assert ffn.next_step().is_real
    start = time.monotonic()
    with pytest.raises(AFDConnectionError, match=f"stalled for over {TIMEOUT_S:.0f} s"):
        ffn.recv_hidden_states(1, 0, (2,))
    assert time.monotonic() - start < STALL_S
