"""4-bit expert weights with 16-bit activations (w4a16): the formats, their torch mirror, and the checkpoint
packings converted once by :func:`fmoe2.prepare_weights`.

Two formats, both two values per byte along K (the low nibble holds the even column, the high nibble the odd
one) and one scale per group of consecutive K columns of a row:

* **mxfp4** (OCP microscaling, gpt-oss's published experts): values are e2m1 (sign, 2-bit exponent, 1-bit
  mantissa: 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives), groups of :data:`MXFP4_GROUP` = 32, scales e8m0
  (uint8 ``s``: the power of two ``2**(s - 127)``). transformers stores ``*_blocks [E, N, K // 32, 16]`` and
  ``*_scales [E, N, K // 32]``: the blocks are exactly this packing.
* **int4** with group scales and zero points (GPTQ, AWQ, compressed-tensors W4A16): unsigned values ``q`` in
  ``[0, 16)``, ``w = (q - zero) * scale`` per group of 32, 64 or 128 along K, zero points in ``[0, 16]`` (the
  original GPTQ format reaches 16); symmetric weights have zero 8.
  GPTQ and AWQ pack eight values into an int32 (GPTQ along K, AWQ along N in its own order):
  :func:`from_gptq` and :func:`from_awq` convert one linear layer's tensors to this packing.

In fmoe2's prepared layout (``fmoe2/gemm/layout.py``) an int4 weight's scale and zero of a group sit side by
side, ``[E, N, K // group, 2]`` in the scales' dtype (both exact: the zero is a small integer), so the kernels
read both with one load; mxfp4 keeps its uint8 scales ``[E, N, K // 32]``. The kernels dequantize in their
operand loader (``fmoe2/gemm/operands.py``) and multiply in the activations' dtype.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

MXFP4_GROUP = 32  # values per e8m0 scale
INT4_GROUPS = (32, 64, 128)  # group sizes of int4 weights
INT4_SYMMETRIC_ZERO = 8  # the zero point of symmetric int4 weights
PACKED_FORMATS = ("mxfp4", "int4")
# e2m1 code -> value (bit 3 the sign)
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """``[..., K // 2]`` uint8 -> ``[..., K]`` int64 codes in ``[0, 16)``: byte j holds column 2j (low nibble)
    and 2j + 1 (high nibble)."""
    p = packed.to(torch.int64)
    return torch.stack([p & 15, p >> 4], dim=-1).flatten(-2)


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """``[..., K]`` codes in ``[0, 16)`` (K even) -> ``[..., K // 2]`` uint8, the inverse of :func:`unpack_nibbles`."""
    if codes.shape[-1] % 2:
        raise ValueError(f"packing needs an even number of columns, got {codes.shape[-1]}")
    c = codes.to(torch.int64)
    return (c[..., 0::2] | (c[..., 1::2] << 4)).to(torch.uint8)


def dequantize_mxfp4(packed: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``[..., N, K]`` in ``dtype`` from mxfp4 ``packed [..., N, K // 2]`` (uint8) and ``scales [..., N, K // 32]``
    (uint8 e8m0). The scale 0 reads as 0 (it is ``2**-127``; the kernels give 0 too). Exact in float32; one
    expert (leading index) at a time, so a whole layer's temporaries need not fit."""
    if packed.dim() == 3:
        return torch.stack([dequantize_mxfp4(p, s, dtype) for p, s in zip(packed, scales)])
    lut = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=packed.device)
    values = lut[unpack_nibbles(packed)]
    exponent = scales.to(torch.int32) - 127
    factor = torch.where(scales > 0, torch.pow(2.0, exponent.to(torch.float32)), 0.0)
    values = values.unflatten(-1, (scales.shape[-1], -1)) * factor[..., None]
    return values.flatten(-2).to(dtype)


def dequantize_int4(packed: torch.Tensor, scales: torch.Tensor, zeros: Optional[torch.Tensor], group_size: int,
                    dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``[..., N, K]`` in ``dtype`` from int4 ``packed [..., N, K // 2]``, ``scales [..., N, K // group_size]`` and
    ``zeros`` of the scales' shape (None: symmetric, zero 8): ``(q - zero) * scale``, exact in float32 for 16-bit
    scales; one expert (leading index) at a time."""
    if packed.dim() == 3:
        return torch.stack([dequantize_int4(p, s, z, group_size, dtype) for p, s, z in
                            zip(packed, scales, zeros if zeros is not None else [None] * len(packed))])
    q = unpack_nibbles(packed).to(torch.float32).unflatten(-1, (-1, group_size))
    zero = zeros.to(torch.float32) if zeros is not None else torch.full_like(scales, INT4_SYMMETRIC_ZERO,
                                                                             dtype=torch.float32)
    return ((q - zero[..., None]) * scales.to(torch.float32)[..., None]).flatten(-2).to(dtype)


def _check_finite(w: torch.Tensor, fmt: str) -> None:
    """4-bit codes hold no NaN or inf: a weight holding one is refused (quantized, it became a finite value, and
    the forward finite where the 16-bit one is not)."""
    bad = ~torch.isfinite(w)
    if bad.any():
        where = [int(i) for i in bad.nonzero()[0].tolist()]
        raise ValueError(f"w holds {int(bad.sum())} NaN or inf values (the first at index {where}): {fmt} codes "
                         "cannot represent them")


def quantize_mxfp4(w: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(packed [..., N, K // 2] uint8, scales [..., N, K // 32] uint8)`` of a float weight ``[..., N, K]`` (K a
    multiple of 32): each group's scale is the power of two that brings its largest magnitude to at most 6
    (e2m1's largest), values rounded to the nearest e2m1 value (a tie to the smaller magnitude). For tests and benchmarks:
    gpt-oss is published in this format."""
    if w.shape[-1] % MXFP4_GROUP:
        raise ValueError(f"mxfp4 needs K a multiple of {MXFP4_GROUP}, got {w.shape[-1]}")
    _check_finite(w, "mxfp4")
    g = w.to(torch.float32).unflatten(-1, (-1, MXFP4_GROUP))
    amax = g.abs().amax(-1)
    # smallest power of two p with amax / p <= 6
    exponent = torch.ceil(torch.log2(torch.where(amax > 0, amax / 6.0, 1.0))).clamp(-126, 127)
    scales = (exponent + 127).to(torch.uint8)
    scaled = g / torch.pow(2.0, exponent)[..., None]
    magnitudes = torch.tensor(E2M1_VALUES[:8], device=w.device)
    # nearest magnitude (argmin: on a tie the first, smaller one)
    distance = (scaled.abs()[..., None] - magnitudes).abs()
    code = distance.argmin(-1)
    code = code | ((scaled < 0).to(torch.int64) << 3)
    return pack_nibbles(code.flatten(-2)), scales


def quantize_int4(w: torch.Tensor, group_size: int = 128, symmetric: bool = False
                  ) -> Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """``(packed [..., N, K // 2] uint8, scales [..., N, K // group_size] in w's dtype, zeros uint8 of the scales'
    shape or None)`` of a float weight ``[..., N, K]``, round to nearest. Symmetric: zero 8, scale ``amax / 7``
    (None returned for the zeros); else ``scale = (max - min) / 15`` and ``zero = round(-min / scale)``. For tests
    and benchmarks (checkpoints come quantized: :func:`from_gptq`, :func:`from_awq`)."""
    if group_size not in INT4_GROUPS:
        raise ValueError(f"group_size must be one of {INT4_GROUPS}, got {group_size}")
    if w.shape[-1] % group_size:
        raise ValueError(f"int4 needs K a multiple of group_size={group_size}, got {w.shape[-1]}")
    _check_finite(w, "int4")
    g = w.to(torch.float32).unflatten(-1, (-1, group_size))
    if symmetric:
        scale = (g.abs().amax(-1) / 7.0).to(w.dtype).float()
        scale = torch.where(scale > 0, scale, 1.0)
        q = torch.clamp(torch.round(g / scale[..., None]) + INT4_SYMMETRIC_ZERO, 0, 15)
        zeros = None
    else:
        lo, hi = g.amin(-1).clamp(max=0), g.amax(-1).clamp(min=0)
        scale = ((hi - lo) / 15.0).to(w.dtype).float()
        scale = torch.where(scale > 0, scale, 1.0)
        zero = torch.clamp(torch.round(-lo / scale), 0, 15)
        q = torch.clamp(torch.round(g / scale[..., None]) + zero[..., None], 0, 15)
        zeros = zero.to(torch.uint8)
    return pack_nibbles(q.flatten(-2)), scale.to(w.dtype), zeros


# ---------------------------------------------------------------------------------------------
# Checkpoint packings (one linear layer each; stack the experts' results for prepare_weights)
# ---------------------------------------------------------------------------------------------

_AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AWQ's int32 holds the N columns 0, 2, 4, 6, 1, 3, 5, 7 in nibbles 0..7


def _int32_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """``[..., C]`` int32 -> ``[..., C, 8]`` int64 nibbles, nibble i = bits 4i..4i+3."""
    p = packed.to(torch.int64) & 0xFFFFFFFF
    shifts = torch.arange(0, 32, 4, device=packed.device)
    return (p[..., None] >> shifts) & 15


def _check_int32(name: str, t: torch.Tensor, shape: Tuple[int, ...]) -> None:
    if not isinstance(t, torch.Tensor) or t.dtype != torch.int32:
        raise TypeError(f"{name} must be an int32 tensor, got {getattr(t, 'dtype', type(t).__name__)}")
    if tuple(t.shape) != shape:
        raise ValueError(f"{name} must have shape {list(shape)}, got {list(t.shape)}")


def _check_columns(N: int) -> None:
    """The checkpoints pack eight N columns per int32 (qzeros; AWQ's qweight too): N must then be a multiple of 8."""
    if N % 8:
        raise ValueError(f"scales [K // G, N] give N = {N}: GPTQ and AWQ layers pack eight columns per int32, so N must "
                         "be a multiple of 8")


def from_gptq(qweight: torch.Tensor, qzeros: Optional[torch.Tensor], scales: torch.Tensor,
              g_idx: Optional[torch.Tensor] = None, *, zero_offset: int = 1
              ) -> Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """``(packed [N, K // 2] uint8, scales [N, K // G], zeros [N, K // G] uint8)`` of one GPTQ linear layer:
    ``qweight [K // 8, N]`` int32 (eight K rows per int32, row 8i + j in nibble j), ``qzeros [K // G, N // 8]``
    int32 (eight N columns per int32), ``scales [K // G, N]`` (fp16/bf16). ``zero_offset``: what the stored zero
    lacks (1 for the original GPTQ format, whose kernels add one, so zero points run from 1 to 16; 0 for the v2
    format). ``qzeros`` None:
    symmetric. ``g_idx`` (act-order): accepted only where it is the plain ``k // G`` order; a permuted order
    would need x permuted along H inside the kernel."""
    if scales.dim() != 2:
        raise ValueError(f"scales must be [K // G, N], got shape {list(scales.shape)}")
    num_groups, N = scales.shape
    if qzeros is not None:  # (qweight packs along K; qzeros along N)
        _check_columns(N)
    _check_int32("qweight", qweight, (qweight.shape[0], N))
    K = qweight.shape[0] * 8
    if K % num_groups or (K // num_groups) not in INT4_GROUPS:
        raise ValueError(f"qweight [K // 8, N] = {list(qweight.shape)} and scales {list(scales.shape)} give group "
                         f"size K / groups = {K / num_groups}; supported: {INT4_GROUPS}")
    group = K // num_groups
    if g_idx is not None:
        plain = torch.arange(K, device=g_idx.device) // group
        if g_idx.shape != (K,) or not torch.equal(g_idx.to(torch.int64), plain):
            raise ValueError("g_idx with act-order (a permuted group order) is not supported: re-export the "
                             "checkpoint without desc_act, or with g_idx = k // group_size")
    q = _int32_nibbles(qweight).permute(0, 2, 1).reshape(K, N)  # [K, N]
    zeros = None
    if qzeros is not None:
        _check_int32("qzeros", qzeros, (num_groups, N // 8))
        # (the original format's stored 15 is a zero point of 16: kept, not clamped; prepared zeros are floats)
        zeros = (_int32_nibbles(qzeros).reshape(num_groups, N) + zero_offset).T.to(torch.uint8)
    return pack_nibbles(q.T), scales.T.contiguous(), zeros.contiguous() if zeros is not None else None


def from_awq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor
             ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(packed [N, K // 2] uint8, scales [N, K // G], zeros [N, K // G] uint8)`` of one AWQ (GEMM-packed) linear
    layer: ``qweight [K, N // 8]`` and ``qzeros [K // G, N // 8]`` int32 (eight N columns per int32 in AWQ's order
    0, 2, 4, 6, 1, 3, 5, 7), ``scales [K // G, N]``."""
    if scales.dim() != 2:
        raise ValueError(f"scales must be [K // G, N], got shape {list(scales.shape)}")
    num_groups, N = scales.shape
    _check_columns(N)
    _check_int32("qweight", qweight, (qweight.shape[0], N // 8))
    K = qweight.shape[0]
    if K % num_groups or (K // num_groups) not in INT4_GROUPS:
        raise ValueError(f"qweight [K, N // 8] = {list(qweight.shape)} and scales {list(scales.shape)} give group "
                         f"size {K / num_groups}; supported: {INT4_GROUPS}")
    _check_int32("qzeros", qzeros, (num_groups, N // 8))
    order = torch.tensor(_AWQ_ORDER, device=qweight.device)
    inverse = torch.argsort(order)

    def columns(packed):  # [R, N // 8] -> [R, N] in column order
        nib = _int32_nibbles(packed)  # nibble i holds column 8c + order[i]
        return nib[..., inverse].reshape(packed.shape[0], N)

    q = columns(qweight)
    zeros = columns(qzeros)
    return pack_nibbles(q.T), scales.T.contiguous(), zeros.T.contiguous().to(torch.uint8)


def to_gptq(w_packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, *, zero_offset: int = 1
            ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """GPTQ's ``(qweight, qzeros, scales)`` of one layer in this module's packing (the inverse of :func:`from_gptq`;
    for tests: checkpoints come in GPTQ's packing)."""
    q = unpack_nibbles(w_packed).T  # [K, N]
    K, N = q.shape
    shifts = torch.arange(0, 32, 4, device=q.device)
    qweight = (q.reshape(K // 8, 8, N) << shifts[None, :, None]).sum(1)
    z = (zeros.T.to(torch.int64) - zero_offset) & 15  # [G, N]
    qzeros = (z.reshape(z.shape[0], N // 8, 8) << shifts).sum(-1)
    as_int32 = lambda t: torch.where(t >= 2 ** 31, t - 2 ** 32, t).to(torch.int32)  # noqa: E731
    return as_int32(qweight), as_int32(qzeros), scales.T.contiguous()


def to_awq(w_packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor
           ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """AWQ's ``(qweight, qzeros, scales)`` of one layer in this module's packing (the inverse of :func:`from_awq`;
    for tests)."""
    order = torch.tensor(_AWQ_ORDER, device=w_packed.device)
    shifts = torch.arange(0, 32, 4, device=w_packed.device)

    def pack(columns):  # [R, N] -> [R, N // 8] int32, nibble i = column 8c + order[i]
        R, N = columns.shape
        grouped = columns.to(torch.int64).reshape(R, N // 8, 8)[..., order]
        v = (grouped << shifts).sum(-1)
        return torch.where(v >= 2 ** 31, v - 2 ** 32, v).to(torch.int32)

    return pack(unpack_nibbles(w_packed).T), pack(zeros.T), scales.T.contiguous()


__all__ = ["MXFP4_GROUP", "INT4_GROUPS", "PACKED_FORMATS", "E2M1_VALUES", "pack_nibbles", "unpack_nibbles",
           "dequantize_mxfp4", "dequantize_int4", "quantize_mxfp4", "quantize_int4", "from_gptq", "from_awq",
           "to_gptq", "to_awq"]
