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
from typing import Dict, Iterator, Tuple

import torch

_ACCUMULATORS: Dict[Tuple[str, int, int], torch.Tensor] = {}
_THREAD = threading.local()  # .sort_path_only: set inside sort_path_only()


def one_launch_allowed() -> bool:
    """Whether a one-token call of this thread may run the one-launch decode (not inside :func:`sort_path_only`)."""
    return not getattr(_THREAD, "sort_path_only", False)


@contextlib.contextmanager
def sort_path_only() -> Iterator[None]:
    """Calls of this thread inside run the sort path, which keeps no buffer between calls (the registered op's)."""
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
        accumulator = _ACCUMULATORS[key] = torch.zeros(numel, dtype=torch.float32, device=device)
    return accumulator


def kept_accumulators() -> Dict[Tuple[str, int, int], torch.Tensor]:
    """Every kept accumulator by ``(device type, device index, stream)`` (for tests: each must be all zeros
    between calls)."""
    return dict(_ACCUMULATORS)


def release_kept_accumulators() -> None:
    """Drops the kept accumulators (the next one-launch decode on each stream allocates its own again)."""
    _ACCUMULATORS.clear()


__all__ = ["kept_accumulator", "kept_accumulators", "release_kept_accumulators", "one_launch_allowed",
           "sort_path_only"]
