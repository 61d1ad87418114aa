"""What the benchmarks (benchmarks/) share with each other and with the
tests: results files (``results``), model shapes (``shapes``), the roofline
of one GPU (``roofline``), host profiles (``host_profile``), CUDA-graph
timing (``graph_timing``) and each process's GPU memory settings
(``gpu_memory``)."""
