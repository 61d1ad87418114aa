# SPDX-License-Identifier: Apache-2.0
"""``vllm afd-plan``: which A:F split, batch and micro-batch stages serve a
model best on given GPUs, and how AFD compares with colocated data-parallel
+ expert-parallel serving. ``hardware`` (GPU presets), ``shapes`` (model
shapes), ``rates`` (a GPU's effective rates: roofline defaults or a
calibrated profile), ``cost`` (each role's time per decode step), ``search``
(the plan), ``calibrate`` (fitting measured role times, GPU-free) and
``measure`` (measuring them on a GPU)."""
