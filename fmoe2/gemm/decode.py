"""The one-launch decode's float32 accumulators: kept between calls, one per device and stream.

An eager forward of one token (``launches.decodes_in_one_launch``) runs as one launch of the fused kernel,
without the sort launch that otherwise zeroes the float32 accumulator the kernel adds into. The kernel leaves
the accumulator as it found it instead: the program that makes the token's last add casts the row to the output,
then zeroes the row and the token's add counter. Calls on one stream run one after another, so one accumulator
per stream serves every layer and shape (grown to the largest hidden size seen); calls on two streams get two.
A call captured into a CUDA graph takes the sort path (``fmoe2.launch.run_bound``): a graph's replays may run on
any stream, where one kept buffer could be added into by two forwards at once. So do the calls of the registered
op (``fmoe2/ops.py``, what ``torch.compile`` runs): Inductor's CUDA-graph trees run a compiled step's first
calls eagerly while every allocation of the thread goes to their private memory pool, and refuse to record a
graph while that pool holds an allocation they do not track, such as a kept accumulator (measured: torch 2.11,
``mode="reduce-overhead"``, M=1). Why and what it saves: docs/host_cost.md#the-one-launch-decode.
"""
from __future__ import annotations

import contextlib
import threading
from typing import Dict, Iterator, List, Tuple

import torch

_ACCUMULATORS: Dict[Tuple[str, int, int], torch.Tensor] = {}
# Accumulators outgrown by a wider call: kept alive until released, since a launch of another thread on the same
# stream may have taken the old address just before it was replaced.
_OUTGROWN: List[torch.Tensor] = []
_GROWING = threading.Lock()
_THREAD = threading.local()  # .sort_path_only: set inside sort_path_only()
_enabled = True


def set_one_launch_decode(enabled: bool) -> None:
    """Turns the one-launch decode on (the default) or off for every thread: off, eager one-token calls run the sort
    and the fused kernel, as CUDA graphs do, and keep no buffer between calls."""
    global _enabled
    if not isinstance(enabled, bool):
        raise TypeError(f"enabled must be a bool, got {type(enabled).__name__}")
    _enabled = enabled


def one_launch_allowed() -> bool:
    """Whether a one-token call of this thread may run the one-launch decode: on (:func:`set_one_launch_decode`)
    and not inside :func:`sort_path_only`."""
    return _enabled and not getattr(_THREAD, "sort_path_only", False)


@contextlib.contextmanager
def sort_path_only() -> Iterator[None]:
    """Calls of this thread inside run the sort path, which keeps no buffer between calls: the registered op's calls,
    and any caller's own op or graph-pool code around :func:`fmoe2.fused_moe` (``fmoe2.sort_path_only()``)."""
    previous = getattr(_THREAD, "sort_path_only", False)
    _THREAD.sort_path_only = True
    try:
        yield
    finally:
        _THREAD.sort_path_only = previous


def kept_accumulator(device: torch.device, stream: int, numel: int) -> torch.Tensor:
    """The zeroed float32 accumulator of ``stream`` on ``device`` (at least ``numel`` elements: ``H`` columns, then
    the add counter); allocated zeroed on ``stream`` the first time, and again, larger, when ``numel`` outgrows it."""
    key = (device.type, device.index if device.index is not None else -1, stream)
    accumulator = _ACCUMULATORS.get(key)
    if accumulator is None or accumulator.numel() < numel:
        with _GROWING:
            accumulator = _ACCUMULATORS.get(key)
            if accumulator is None or accumulator.numel() < numel:
                if accumulator is not None:
                    _OUTGROWN.append(accumulator)
                accumulator = _ACCUMULATORS[key] = torch.zeros(numel, dtype=torch.float32, device=device)
    return accumulator


def kept_accumulators() -> Dict[Tuple[str, int, int], torch.Tensor]:
    """Every kept accumulator in use by ``(device type, device index, stream)`` (for tests: each must be all zeros
    between calls)."""
    return dict(_ACCUMULATORS)


def release_kept_accumulators() -> None:
    """Drops the kept accumulators (the next one-launch decode on each stream allocates a zeroed one again): frees
    their memory, and recovers from a launch that did not finish (an interrupted or failed kernel can leave one
    non-zero, which would spoil every later one-token call on its stream). Call it with no decode in flight
    (after ``torch.cuda.synchronize()``); :func:`fmoe2.clear_plan_cache` calls it."""
    with _GROWING:
        _ACCUMULATORS.clear()
        _OUTGROWN.clear()


__all__ = ["kept_accumulator", "kept_accumulators", "release_kept_accumulators", "one_launch_allowed",
           "sort_path_only", "set_one_launch_decode"]
