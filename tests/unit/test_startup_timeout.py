"""Waits before serving last as long as the peer lives; real steps take ``timeout_s``.

Both ends of a real gloo connector pair: the attention side stalls inside a
warm-up forward, as it does while it compiles its model, for longer than
``timeout_s`` and ``startup_timeout_s`` together, and the FFN rank waits; the
same stall in a real step is an error naming the bound. An attention process
killed inside such a warm-up wait ends it at once, naming the lost rank.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import pytest
import torch
from vllm.afd.models.registry import ffn_exchange_shape
from vllm.distributed.afd_transfer.endpoint.attention import AttentionEndpoint
from vllm.distributed.afd_transfer.endpoint.ffn import FFNEndpoint
from vllm.distributed.afd_transfer.handshake import AFDConnectionError
from vllm.engine.arg_utils import EngineArgs

from vllm_afd_dev.harness.generate import free_port, worker_env

STALL_S = 3.0
TIMEOUT_S = 1.0
STARTUP_TIMEOUT_S = 1.0
"""Bounds the handshake and the group's assembly, not the start-up forwards."""


def endpoint(model, role: str, port: int):
    afd = {
        "role": role,
        "port": port,
        "timeout_s": TIMEOUT_S,
        "startup_timeout_s": STARTUP_TIMEOUT_S,
    }
    config = EngineArgs(model=str(model), enforce_eager=True, afd_config=afd)
    vllm_config = config.create_engine_config()
    endpoint_class = AttentionEndpoint if role == "attention" else FFNEndpoint
    return endpoint_class(vllm_config, 0, ffn_exchange_shape(vllm_config))


@pytest.fixture
def pair(tiny_qwen3):
    port = free_port()
    ffn, attention = endpoint(tiny_qwen3, "ffn", port), endpoint(tiny_qwen3, "attention", port)
    serving = threading.Thread(target=ffn.connect)
    serving.start()
    attention.connect()  # the attention end retries until the FFN end listens
    serving.join()
    yield ffn, attention
    for end in (attention, ffn):
        end.close()


def test_a_warm_up_stall_is_waited_for_and_a_real_one_is_an_error(pair):
    ffn, attention = pair
    rows = torch.ones(2, ffn.spec.input_width, dtype=ffn.spec.dtype)
    attention.publish_step(((2,),), is_warmup=True)
    assert ffn.next_step().is_warmup
    threading.Timer(STALL_S, attention.data_plane.send_hidden_states, (rows, 0, 0)).start()
    start = time.monotonic()
    (received,) = ffn.data_plane.recv_hidden_states(0, 0, (2,))
    assert time.monotonic() - start >= STALL_S - 0.5 and torch.equal(received, rows)

    attention.publish_step(((2,),))
    assert ffn.next_step().is_real
    start = time.monotonic()
    with pytest.raises(AFDConnectionError, match=f"stalled for over {TIMEOUT_S:.0f} s"):
        ffn.data_plane.recv_hidden_states(1, 0, (2,))
    assert time.monotonic() - start < STALL_S


# The attention end in a process of its own, to be killed inside a warm-up.
ATTENTION_IN_WARM_UP = """
import sys, time
from vllm.afd.models.registry import ffn_exchange_shape
from vllm.distributed.afd_transfer.endpoint.attention import AttentionEndpoint
from vllm.engine.arg_utils import EngineArgs
afd = {"role": "attention", "port": int(sys.argv[2]), "timeout_s": 1.0, "startup_timeout_s": 30}
config = EngineArgs(model=sys.argv[1], enforce_eager=True, afd_config=afd).create_engine_config()
end = AttentionEndpoint(config, 0, ffn_exchange_shape(config))
end.connect()
end.publish_step(((2,),), is_warmup=True)
time.sleep(600)  # compiling, as far as the FFN rank can tell
"""


def test_an_attention_process_killed_in_a_warm_up_ends_the_wait_at_once(tiny_qwen3):
    port = free_port()
    ffn = endpoint(tiny_qwen3, "ffn", port)
    ffn.afd_config.startup_timeout_s = 120  # for the child to start
    child = subprocess.Popen(
        [sys.executable, "-c", ATTENTION_IN_WARM_UP, str(tiny_qwen3), str(port)],
        env=worker_env(),
    )
    try:
        ffn.connect()
        # Its watchdog would end this process; the transfer's own failure is tested.
        ffn._watchdog.stop()
        assert ffn.next_step().is_warmup
        killer = threading.Timer(STALL_S, child.kill)
        killer.start()
        start = time.monotonic()
        with pytest.raises(AFDConnectionError, match=r"lost attention ranks \[0\] while receiving"):
            ffn.data_plane.recv_hidden_states(0, 0, (2,))
        waited = time.monotonic() - start
        assert STALL_S - 0.5 <= waited < STALL_S + 10, waited
    finally:
        child.kill()
        child.wait(timeout=30)
        ffn.close()
