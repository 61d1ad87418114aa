"""Launching AFD and stock vLLM runs for the tests and the benchmarks:
``generate`` (greedy generation in fresh processes, ``worker`` being such a
process), ``launch`` (FFN ranks, servers, kills, metrics), ``gpu_settings``
(the GPU tests' engine settings and placements), ``net_hosts`` (hosts as
network namespaces) and ``one_gpu_ffn_group`` (an FFN group on one GPU)."""
