# SPDX-License-Identifier: Apache-2.0
"""Attention-FFN Disaggregation runtime, by role: ``attention`` (the model
runner's hooks and what an attention rank adds), ``ffn`` (the FFN role's
server, worker and runner), ``models`` (the pieces of both roles),
``platform`` (CPU thread binding, MPS), and ``connection``, which brings up
either role's endpoint."""
