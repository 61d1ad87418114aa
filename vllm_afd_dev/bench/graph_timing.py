"""CUDA-graph helpers shared by the round-trip benchmarks."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch


def capture_layers(layers: int, layer: Callable[[], object]) -> torch.cuda.CUDAGraph:
    """One CUDA graph of ``layers`` calls of ``layer``."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(layers):
            layer()
    return graph


def time_replays(graph: torch.cuda.CUDAGraph, replays: int) -> float:
    """Seconds for ``replays`` back-to-back replays, synchronised."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(replays):
        graph.replay()
    torch.cuda.synchronize()
    return time.perf_counter() - start


WARMUP_REPLAYS = 3


def us_per_layer(graph: torch.cuda.CUDAGraph, replays: int, layers: int) -> float:
    """Microseconds per layer of a graph of ``layers`` layers, timed over
    ``replays`` replays after ``WARMUP_REPLAYS`` untimed ones (a peer that
    replays in lockstep runs ``WARMUP_REPLAYS + replays``)."""
    time_replays(graph, WARMUP_REPLAYS)
    return 1e6 * time_replays(graph, replays) / replays / layers
