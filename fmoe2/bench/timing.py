"""Timing as vLLM's benchmark_moe.py does it: N calls captured in one CUDA graph, CUDA events
around each replay, the median over many replays, divided by N."""
from __future__ import annotations

import statistics
from typing import Callable, Dict, List

import torch


def capture_graph(fn: Callable[[], object], calls: int = 1, warmup_calls: int = 1) -> "torch.cuda.CUDAGraph":
    """A CUDA graph of ``calls`` calls of ``fn`` (graph-safe), after ``warmup_calls`` calls on a side
    stream (compiling, autotuning and the allocator's first allocations stay outside the graph)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warmup_calls):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return graph


def replay_times(graph: "torch.cuda.CUDAGraph", calls: int, replays: int) -> List[float]:
    """Microseconds per call of ``replays`` replays of ``graph`` (``calls`` calls each), each between CUDA events."""
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    return times


def time_in_graph(fn: Callable[[], object], calls_per_graph: int = 10, replays: int = 50, warmup: int = 5) -> float:
    """Median microseconds per call of ``fn`` (which must be graph-safe)."""
    graph = capture_graph(fn, calls=calls_per_graph, warmup_calls=2)
    for _ in range(warmup):
        graph.replay()
    torch.cuda.synchronize()
    times = replay_times(graph, calls_per_graph, replays)
    graph.reset()
    return statistics.median(times)


def time_graphs_in_turns(fns: Dict[str, Callable[[], object]], rounds: int, calls: int,
                         replays: int) -> Dict[str, float]:
    """Median us per call of each of ``fns`` (``calls`` calls per CUDA graph, ``replays`` replays of each per round),
    the variants taking turns over ``rounds`` rounds (a clock drift reaches every variant alike), each round starting
    ``len(fns) / rounds`` variants further on (round i at variant ``i * n // rounds``) and capturing its graphs again
    in that order. Why both: one config under two labels came out up to 9% apart in a run of 2026-11-29 (H200,
    M = 1024-4096, every graph captured once), and probes of 2026-11-30 (H200, one config under four labels, 4096
    tokens) found each capture's time its own: 818-827 or 837-842 us at Qwen3-235B TP4 whatever the label and whatever
    its place in the round, while the GPU ran at 1000-1650 MHz at its power limit. So each variant's median is taken
    over ``rounds`` captures, each at another place in the capture order (its scratch buffers at other addresses)
    and in the round."""
    names = list(fns)
    times = {name: [] for name in names}
    for i in range(rounds):
        start = i * len(names) // rounds
        order = names[start:] + names[:start]
        graphs = {}
        try:
            for name in order:
                graphs[name] = capture_graph(fns[name], calls=calls, warmup_calls=2 if i == 0 else 1)
            for name in order:
                graph = graphs[name]
                graph.replay()  # warm
                torch.cuda.synchronize()
                times[name] += replay_times(graph, calls, replays)
        finally:  # (a failed capture or replay leaves no graph holding its memory pool)
            for graph in graphs.values():
                graph.reset()
    return {name: statistics.median(t) for name, t in times.items()}


def time_interleaved(fns: Dict[str, Callable[[], object]], rounds: int = 3) -> Dict[str, float]:
    """Median microseconds per call of each of ``fns`` over ``rounds`` rounds of :func:`time_in_graph`,
    the functions taking turns within every round: a drift of the GPU's clocks over the run then
    reaches every variant alike, so ratios of close variants (a 1.02x target) compare like with like."""
    times = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            times[name].append(time_in_graph(fn))
    return {name: statistics.median(t) for name, t in times.items()}
