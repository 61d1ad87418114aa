# SPDX-License-Identifier: Apache-2.0
"""What the two roles must agree on before they exchange a single tensor.

Each side builds an ``AFDFingerprint`` from its own ``VllmConfig`` and sends it
when it connects. Any difference fails both sides with the list of fields that
differ, instead of garbage outputs or a hang on a mis-sized transfer.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vllm.distributed.afd_transfer.payload import AFD_PROTOCOL_VERSION

if TYPE_CHECKING:
    from vllm.config import VllmConfig


class AFDError(RuntimeError):
    """Base class of the errors AFD raises about its peers."""


class AFDHandshakeError(AFDError):
    """The roles disagree about the model, topology, connector or protocol."""


class AFDConnectionError(AFDError):
    """A peer could not be reached, or was lost."""


class AFDPeerGoneError(AFDConnectionError):
    """The peer went away before the handshake completed: its process
    exited, or its connection closed."""


class AFDPeerLostError(AFDConnectionError):
    """Raised in the thread that runs the model when the watchdog finds a
    peer gone (the details are logged as it happens)."""

    def __init__(self, *args: object) -> None:
        # Raised asynchronously, so it is built without arguments.
        super().__init__(*(args or ("AFD: a peer rank was lost; see the error logged above",)))


@dataclass(frozen=True)
class AFDFingerprint:
    """The settings both roles must share for their transfers to line up."""

    architecture: str
    hidden_size: int
    dtype: str
    num_layers: int
    num_attention_ranks: int
    num_ffn_ranks: int
    ffn_tensor_parallel_size: int
    ffn_enable_expert_parallel: bool
    connector: str
    compute_gate_on_attention: bool
    cudagraph_mode: str
    protocol_version: int = AFD_PROTOCOL_VERSION

    @classmethod
    def from_vllm_config(cls, vllm_config: VllmConfig, num_layers: int) -> AFDFingerprint:
        """``num_layers``: the exchanges per forward (``ExchangeShape``)."""
        model = vllm_config.model_config
        afd = vllm_config.afd_config
        assert afd is not None
        mode = vllm_config.compilation_config.cudagraph_mode
        return cls(
            architecture=model.architecture,
            hidden_size=model.get_hidden_size(),
            dtype=str(model.dtype).removeprefix("torch."),
            num_layers=num_layers,
            num_attention_ranks=afd.num_attention_ranks,
            num_ffn_ranks=afd.num_ffn_ranks,
            ffn_tensor_parallel_size=afd.ffn_tensor_parallel_size,
            ffn_enable_expert_parallel=afd.ffn_enable_expert_parallel,
            connector=afd.connector,
            compute_gate_on_attention=afd.compute_gate_on_attention,
            cudagraph_mode=mode.name if mode is not None else "NONE",
        )

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> AFDFingerprint:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})

    def differences(self, other: AFDFingerprint, mine: str, theirs: str) -> list[str]:
        """One line per field that differs, naming both values."""
        return [
            f"{f.name}: {mine}={getattr(self, f.name)!r}, {theirs}={getattr(other, f.name)!r}"
            for f in dataclasses.fields(self)
            if getattr(self, f.name) != getattr(other, f.name)
        ]


def mismatch_message(peer: str, differences: list[str]) -> str:
    return (
        f"AFD handshake with {peer} failed: the roles disagree on "
        + "; ".join(differences)
        + ". Start both roles with the same model, dtype, topology, connector "
        "FFN parallel sizes and cudagraph mode."
    )
