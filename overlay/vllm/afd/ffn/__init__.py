# SPDX-License-Identifier: Apache-2.0
"""The FFN role: the ``vllm afd-ffn`` server, one worker per FFN process, its
model runner and CUDA graphs, the group of an FFN rank over several devices,
and its HTTP ``/health`` and ``/metrics``."""
