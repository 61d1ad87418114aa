# SPDX-License-Identifier: Apache-2.0
"""The data plane as torch custom ops, so torch.compile traces through them.

``vllm::afd_send`` hands one layer's hidden states to the FFN rank and returns
an empty handle tensor; ``vllm::afd_recv`` takes that handle (the data
dependency keeps the two ordered and stops dead-code elimination from
dropping the send) and returns the FFN output. The attention endpoint is
looked up inside the implementation, never passed as an argument; the stage
is the current DBO micro-batch (0 without DBO).
"""

from __future__ import annotations

import torch
from vllm.distributed.afd_transfer.afd_transfer_state import get_attention_endpoint
from vllm.utils.torch_utils import direct_register_custom_op
from vllm.v1.worker.ubatching import dbo_current_ubatch_id, dbo_yield


def _endpoint():
    endpoint = get_attention_endpoint()
    if endpoint is None:
        raise RuntimeError(
            "an AFD remote-FFN layer ran, but this process has no AFD attention endpoint; "
            "the attention role's worker creates it (VllmConfig.afd_config)"
        )
    return endpoint


def afd_send(hidden_states: torch.Tensor, layer_idx: int) -> torch.Tensor:
    endpoint = _endpoint()
    endpoint.timeline.enter_exchange()
    endpoint.data_plane.send_hidden_states(hidden_states, layer_idx, dbo_current_ubatch_id())
    endpoint.timeline.leave_exchange()
    return hidden_states.new_empty(0)


def afd_send_fake(hidden_states: torch.Tensor, layer_idx: int) -> torch.Tensor:
    return hidden_states.new_empty(0)


def afd_recv(handle: torch.Tensor, hidden_states: torch.Tensor, layer_idx: int) -> torch.Tensor:
    # With dual-batch overlap the other stage computes while this stage's
    # rows travel to the FFN rank and back (a no-op without DBO).
    dbo_yield()
    out = torch.empty_like(hidden_states)
    endpoint = _endpoint()
    endpoint.timeline.enter_exchange()
    endpoint.data_plane.recv_ffn_output(out, layer_idx, dbo_current_ubatch_id())
    endpoint.timeline.leave_exchange()
    return out


def afd_recv_fake(
    handle: torch.Tensor, hidden_states: torch.Tensor, layer_idx: int
) -> torch.Tensor:
    return torch.empty_like(hidden_states)


direct_register_custom_op("afd_send", afd_send, fake_impl=afd_send_fake)
direct_register_custom_op("afd_recv", afd_recv, fake_impl=afd_recv_fake)
