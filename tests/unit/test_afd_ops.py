"""The data-plane ops trace under torch.compile's machinery without a peer.

Tracing with fake tensors runs only the fake implementations, so this needs
no endpoint: it checks that the ops are registered, that their fake outputs
have the right shapes, and that the traced graph keeps send before recv.
"""

from __future__ import annotations

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx
from vllm.afd.models.remote_ffn import RemoteFFN

# A RemoteFFN asks the TP group whether it sends: a world of one here.
pytestmark = pytest.mark.usefixtures("one_process_world")


def test_remote_ffn_traces_to_send_then_recv():
    layer = RemoteFFN(layer_idx=3)
    graph = make_fx(layer, tracing_mode="fake")(torch.randn(5, 16))
    calls = [n for n in graph.graph.nodes if n.op == "call_function"]
    names = [str(n.target) for n in calls]
    assert names == ["vllm.afd_send.default", "vllm.afd_recv.default"], names
    send, recv = calls
    assert send.args[1] == 3 and recv.args[2] == 3  # the layer index travels as a constant
    assert recv.args[0] is send  # the handle orders the pair
    out = [n for n in graph.graph.nodes if n.op == "output"][0]
    assert out.args[0] is recv


def test_without_an_endpoint_the_op_says_why():
    with pytest.raises(RuntimeError, match="this process has no AFD attention endpoint"):
        RemoteFFN(layer_idx=0)(torch.randn(2, 4))
