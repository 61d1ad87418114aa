# SPDX-License-Identifier: Apache-2.0
"""FFN side: the control connections of the attention peers it serves.

``PeerConnections`` keeps, by attention rank, each admitted peer's
connection and whether it ended with a shutdown message (after a failed step
or not). ``ControlServer`` reads data-parallel peers' steps through it and
``SeparatePeers`` those of attention ranks of their own; both judge by it
whether a peer that closed without a shutdown message was lost or ended with
the deployment (``ending``).
"""

from __future__ import annotations

import socket


class PeerConnections:
    """An FFN rank's admitted attention peers: their connections and ends."""

    def __init__(self, peer_ranks: list[int]) -> None:
        self.peer_ranks = peer_ranks
        self.open: dict[int, socket.socket] = {}
        """Each connected peer's control connection, by attention rank."""
        self.finished: set[int] = set()
        """Peers that sent their shutdown message: closing is theirs to do."""
        self.failed: set[int] = set()
        """Peers whose shutdown followed a failed step of theirs."""

    def ending(self, rank: int) -> bool:
        """Whether every peer but ``rank`` (one at least) has shut down after
        finishing its work. A data-parallel rank that then closes without a
        shutdown message is part of the deployment's end, not a crash: it may
        have entered one more step, whose collectives wait for the ranks that
        have left, until vLLM's shutdown kills it (seen at the end of offline
        data-parallel runs). A peer that shut down after a failed step
        (``after_failure``) may have failed because ``rank`` died first."""
        others = [r for r in self.peer_ranks if r != rank]
        return (
            bool(others)
            and all(r in self.finished for r in others)
            and not self.failed.intersection(others)
        )

    def close(self) -> None:
        for conn in list(self.open.values()):
            conn.close()
        self.open.clear()
