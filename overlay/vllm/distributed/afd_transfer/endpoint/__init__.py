# SPDX-License-Identifier: Apache-2.0
"""The role endpoints: one per AFD rank, owning its data plane and its end of
the control plane. ``attention.AttentionEndpoint`` announces each forward to
its FFN rank and outlives a lost one (``afd_transfer.failover``);
``ffn.FFNEndpoint`` serves every attention peer of one FFN rank; ``base``
holds what both share (set-up, transfer bounds, stopping, teardown)."""
