"""int8 expert weights with 16-bit activations (w8a16): the format's torch mirror and quantizer.

Symmetric int8 values ``q`` in ``[-128, 127]``, ``w = q * scale``, with one float scale per output channel (row
``n`` of ``[N, K]``: vLLM's ``int8_w8a16`` checkpoints, scales ``[E, N]``) or per group of 32, 64 or 128
consecutive K columns of a row (``[E, N, K // group]``). :func:`fmoe2.prepare_weights` takes either; per channel
scales are repeated over groups of :data:`CHANNEL_GROUP` columns, so the kernels read one layout (the repeats cost
2-4% of the weights' bytes). The kernels' operand loader (``fmoe2/gemm/operands.py``) dequantizes each tile into
the activations' dtype, ``q * scale`` rounded once: in that dtype's arithmetic where the scales are in it (16-bit),
else in float32 and then rounded.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

INT8_GROUPS = (32, 64, 128)  # group sizes of group-scaled int8 weights
CHANNEL_GROUP = 128  # the group per channel scales are repeated over in the prepared layout


def dequantize_int8(w: torch.Tensor, scales: torch.Tensor, group_size: Optional[int] = None,
                    dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``[..., N, K]`` in ``dtype`` from int8 ``w [..., N, K]`` and ``scales``: ``[..., N]`` per channel
    (``group_size`` None) or ``[..., N, K // group_size]``; exact in float32, one expert (leading index) at a time."""
    if w.dim() == 3:
        return torch.stack([dequantize_int8(q, s, group_size, dtype) for q, s in zip(w, scales)])
    q = w.to(torch.float32)
    if group_size is None:
        return (q * scales.to(torch.float32)[..., None]).to(dtype)
    return (q.unflatten(-1, (-1, group_size)) * scales.to(torch.float32)[..., None]).flatten(-2).to(dtype)


def quantize_int8(w: torch.Tensor, group_size: Optional[int] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(q [..., N, K] int8, scales in w's dtype)`` of a float weight ``[..., N, K]``, round to nearest with
    ``scale = amax / 127``: per channel (``group_size`` None: scales ``[..., N]``) or per group of ``group_size``
    columns (scales ``[..., N, K // group_size]``). NaN and inf are refused (int8 cannot hold them). For tests and
    benchmarks: checkpoints come quantized."""
    if group_size is not None and group_size not in INT8_GROUPS:
        raise ValueError(f"group_size must be None (per channel) or one of {INT8_GROUPS}, got {group_size!r}")
    if group_size is not None and w.shape[-1] % group_size:
        raise ValueError(f"int8 groups of {group_size} need K a multiple of it, got {w.shape[-1]}")
    bad = ~torch.isfinite(w)
    if bad.any():
        raise ValueError(f"w holds {int(bad.sum())} NaN or inf values: int8 codes cannot represent them")
    g = w.to(torch.float32)
    g = g[..., None, :] if group_size is None else g.unflatten(-1, (-1, group_size))
    scale = (g.abs().amax(-1) / 127.0).to(w.dtype).to(torch.float32)  # (rounded to the dtype they are stored in)
    scale = torch.where(scale > 0, scale, 1.0)
    q = torch.clamp(torch.round(g / scale[..., None]), -128, 127).to(torch.int8)
    q = q[..., 0, :] if group_size is None else q.flatten(-2)
    scale = scale[..., 0] if group_size is None else scale
    return q, scale.to(w.dtype)


def channel_scales_as_groups(scales: torch.Tensor, k: int, group: int = CHANNEL_GROUP) -> torch.Tensor:
    """Per channel ``scales [E, N]`` repeated as group scales ``[E, N, ceil(k / group)]`` (the prepared layout)."""
    return scales[..., None].expand(*scales.shape, -(-k // group)).contiguous()


__all__ = ["INT8_GROUPS", "CHANNEL_GROUP", "dequantize_int8", "quantize_int8", "channel_scales_as_groups"]
