"""The one-launch decode's float32 accumulators: kept between calls, one per device and stream.

An eager forward of one token (``launches.decodes_in_one_launch``) runs as one launch of the fused kernel,
without the sort launch that otherwise zeroes the float32 accumulator the kernel adds into. The kernel leaves
the accumulator as it found it instead: the program that makes the token's last add casts the row to the output,
then zeroes the row and the token's add counter. Calls on one stream run one after another, so one accumulator
per stream serves every layer and shape (grown to the largest hidden size seen); calls on two streams get two.
A call captured into a CUDA graph takes the sort path (``fmoe2.launch.run_bound``): a graph's replays may run on
any stream, where one kept buffer could be added into by two forwards at once. Why and what it saves:
docs/host_cost.md#the-one-launch-decode.
"""
from __future__ import annotations

from typing import Dict, Tuple

import torch

_ACCUMULATORS: Dict[Tuple[str, int, int], torch.Tensor] = {}


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


__all__ = ["kept_accumulator", "kept_accumulators", "release_kept_accumulators"]
