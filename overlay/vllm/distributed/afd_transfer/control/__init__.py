# SPDX-License-Identifier: Apache-2.0
"""Rendezvous, handshake and control plane between attention and FFN ranks.

Every FFN rank listens on a port of its own; each of its attention peers
connects, proves the shared secret, says hello with its fingerprint and gets
back the FFN rank's verdict plus whatever the data plane needs to connect.
The same TCP connection then carries one ``ControlPayload`` per forward step.
Connectors share this package; only their data planes differ.

- ``framing``: the wire format (frames and their kinds), the handshake
  messages, socket set-up and the timeouts both sides share.
- ``server``: ``ControlServer``, the FFN side: checks its attention peers'
  hellos and welcomes them, receives the payloads and stops the peers.
- ``listener``: ``ControlListener``, the FFN rank's port: binds it (a
  standby waits for it), checks each connection's secret and answers
  standbys, each connection in a thread of its own.
- ``connections``: ``PeerConnections``, the admitted peers' control
  connections and whether each ended with a shutdown message.
- ``separate``: ``SeparatePeers``, which serves attention ranks that are
  deployments of their own: reads their steps, drops lost ones and takes
  restarted ones back.
- ``peers``: ``PeerPlaces``, their places and the merge of their steps.
- ``client``: the side that connects: ``ControlClient`` (an attention rank)
  and ``ask_served_rank_as_standby`` (a standby FFN rank).
"""
