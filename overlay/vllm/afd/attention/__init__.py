# SPDX-License-Identifier: Apache-2.0
"""The attention role's side of AFD: the model-runner hooks that announce each
forward, micro-batch stages, data-parallel lockstep, failover of the forward
in flight, the FFN ranks it spawns, and its figures in vLLM's /metrics."""
