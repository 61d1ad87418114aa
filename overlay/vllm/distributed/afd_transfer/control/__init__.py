# SPDX-License-Identifier: Apache-2.0
"""Rendezvous, handshake and control plane between attention and FFN ranks.

Every FFN rank listens on a port of its own; each of its attention peers
connects, proves the shared secret, says hello with its fingerprint and gets
back the FFN rank's verdict plus whatever the data plane needs to connect.
The same TCP connection then carries one ``ControlPayload`` per forward step.
Connectors share this package; only their data planes differ.

- ``framing``: the wire format (frames and their kinds), the handshake
  messages, socket set-up and the timeouts both sides share.
- ``server``: ``ControlServer``, the FFN side: admits its attention peers,
  answers standbys, receives the payloads and stops the peers.
- ``client``: the side that connects: ``ControlClient`` (an attention rank)
  and ``ask_served_rank_as_standby`` (a standby FFN rank).
"""
