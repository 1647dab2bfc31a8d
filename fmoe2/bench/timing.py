"""Timing as vLLM's benchmark_moe.py does it: N calls captured in one CUDA graph, CUDA events
around each replay, the median over many replays, divided by N."""
from __future__ import annotations

import statistics
from typing import Callable

import torch


def time_in_graph(fn: Callable[[], object], calls_per_graph: int = 10, replays: int = 50, warmup: int = 5) -> float:
    """Median microseconds per call of ``fn`` (which must be graph-safe)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):  # compile and autotune outside the graph
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls_per_graph):
            fn()
    for _ in range(warmup):
        graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls_per_graph)
    graph.reset()
    return statistics.median(times)
