# SPDX-License-Identifier: Apache-2.0
"""Attention-FFN Disaggregation runtime: the FFN role (worker, runner, server),
the attention side's step hooks, and the model pieces of both roles."""
