"""Named buffers carved out of one allocation.

A forward needs a handful of scratch buffers (the sort's outputs, the two-stage path's
intermediate). Allocating them as one block costs one allocator call instead of several, and
their device addresses are then the block's address plus offsets fixed for the plan
(``fmoe2/gemm/plan.py``), so a launch can be given them without creating tensor views.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Sequence, Tuple

import torch

BUFFER_ALIGNMENT = 256  # bytes between buffer starts (the caching allocator's own block alignment)


@dataclass(frozen=True)
class BufferLayout:
    """Named ``(dtype, shape)`` buffers at byte offsets of one ``uint8`` block."""

    entries: Tuple[Tuple[str, torch.dtype, Tuple[int, ...], int], ...]  # (name, dtype, shape, byte offset)
    nbytes: int

    @classmethod
    def of(cls, buffers: Sequence[Tuple[str, torch.dtype, Tuple[int, ...]]]) -> "BufferLayout":
        """Places ``(name, dtype, shape)`` buffers one after another, each at a multiple of
        ``BUFFER_ALIGNMENT`` bytes."""
        entries, offset = [], 0
        for name, dtype, shape in buffers:
            entries.append((name, dtype, tuple(shape), offset))
            numel = 1
            for size in shape:
                numel *= size
            offset += -(-numel * dtype.itemsize // BUFFER_ALIGNMENT) * BUFFER_ALIGNMENT
        return cls(tuple(entries), max(offset, BUFFER_ALIGNMENT))

    @property
    def names(self) -> Tuple[str, ...]:
        return tuple(e[0] for e in self.entries)

    @property
    def offsets(self) -> Tuple[int, ...]:
        return tuple(e[3] for e in self.entries)

    def allocate(self, device) -> torch.Tensor:
        """The uninitialised block."""
        return torch.empty(self.nbytes, dtype=torch.uint8, device=device)

    def views(self, block: torch.Tensor) -> Dict[str, torch.Tensor]:
        """Each buffer as a tensor view of ``block``."""
        views = {}
        for name, dtype, shape, offset in self.entries:
            numel = 1
            for size in shape:
                numel *= size
            views[name] = block[offset:offset + numel * dtype.itemsize].view(dtype).view(shape)
        return views
