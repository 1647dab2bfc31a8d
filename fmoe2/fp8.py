"""FP8 expert weights: the scale schemes, the activation quantization the kernels apply, and its
torch mirror (used by the reference, the tests and the benchmark).

Weights ``w [E, N, K]`` are fp8 (``torch.float8_e4m3fn``; ``torch.float8_e4m3fnuz`` on gfx942)
with fp32 scales, ``w_real = w_fp8 * scale`` of the element's block, in one of three schemes:

* block-wise: ``scale [E, cdiv(N, block_n), cdiv(K, block_k)]`` with ``block_shape = (block_n,
  block_k)`` (DeepSeek-V3/R1 and the Qwen3 FP8 checkpoints: 128 x 128, their ``weight_scale_inv``);
* per output channel: ``scale [E, N]`` (or ``[E, N, 1]``);
* per tensor, that is per expert: ``scale [E]`` (or ``[E, 1]``, ``[E, 1, 1]``).

For ``w1 [E, 2I, H]`` N is 2I (gate rows then up rows, as in the checkpoint) and K is H; for
``w2 [E, H, I]`` N is H and K is I. Every scheme becomes one scale view ``[E, Sn, Sk]`` and a block
shape (:func:`weight_scale_view`), so the kernels read all three the same way: the scale of row
``n`` and column ``k`` is ``scale[e, n // block_n, k // block_k]`` (a dimension of size 1 has
stride 0 in the kernels).

Activations are quantized inside the kernels, dynamically, per token and group of
:data:`FP8_GROUP` consecutive elements along K: ``hidden_states`` along H before the gate/up
GEMM, the activated intermediate (routing weight applied, rounded to the input dtype) along I
before the down GEMM, whatever the weights' scheme. Per group: ``amax = max |v|`` (1 where the
group is all zero), ``q = fp8(clamp(v * (fp8_max / amax), -fp8_max, fp8_max))`` rounded to
nearest even, ``scale = amax / fp8_max``. vLLM quantizes per token over all of K for per-channel
weights; that needs the whole row before the first product, which the fused kernel's programs,
each owning a slice of I, never see. Groups of 128 are at least as accurate, and one rule for
every scheme keeps the fused and the two-stage paths bitwise alike in what they quantize.
"""
from __future__ import annotations

import os
from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e4m3fnuz)
# Per-token activations (issue 59; off unless FMOE2_FP8_PER_TOKEN=1 is in the environment when fmoe2 is imported):
# with weights scaled per channel or per tensor, x is quantized per token over all of H (one scale a row, as vLLM
# does for such weights), so the gate/up GEMM needs one pair of scales instead of one a 128-column step (applied once
# after the K loop, or each step at tiles under 64 rows: gemm/fp8_weights.py). The intermediate stays quantized per
# group of 128 (a program of the fused kernel holds only its slice of I). Block-scaled weights keep groups of 128
# either way. Off by default until the whole GPU suite has run with it on since the small tiles' loop changed
# (docs/fp8.md: the measurements).
PER_TOKEN_ACTIVATIONS = os.environ.get("FMOE2_FP8_PER_TOKEN") == "1"
FP8_GROUP = 128  # activation elements per quantization group (along K); also the kernels' K step with fp8
DEFAULT_BLOCK_SHAPE = (128, 128)
SCHEMES = ("block", "channel", "tensor")


def fp8_max(dtype: torch.dtype) -> float:
    """Largest finite value of an fp8 dtype (448 for e4m3fn, 240 for e4m3fnuz)."""
    return float(torch.finfo(dtype).max)


def weight_scale_view(name: str, scale: torch.Tensor, E: int, N: int, K: int,
                      block_shape: Optional[Tuple[int, int]]) -> Tuple[torch.Tensor, int, int, str]:
    """``(scale [E, Sn, Sk] float32 view, block_n, block_k, scheme)`` of a weight ``[E, N, K]``'s
    scale; raises ValueError/TypeError naming ``name`` for a scale that fits no scheme.

    ``block_shape`` given: block-wise, ``scale`` must be ``[E, cdiv(N, block_n), cdiv(K, block_k)]``.
    None: per channel (``[E, N]`` or ``[E, N, 1]``) or per tensor (``[E]``, ``[E, 1]``, ``[E, 1, 1]``).
    """
    if not isinstance(scale, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of float32 scales, got {type(scale).__name__}")
    if scale.dtype != torch.float32:
        raise TypeError(f"{name} must be float32, got {scale.dtype}")
    shape = tuple(scale.shape)
    if block_shape is not None:
        bn, bk = block_shape
        expected = (E, triton.cdiv(N, bn), triton.cdiv(K, bk))
        if shape != expected:
            raise ValueError(f"{name} must have shape [E, cdiv(N, {bn}), cdiv(K, {bk})] = {list(expected)} for "
                             f"block_shape={tuple(block_shape)} (N={N}, K={K}), got {list(shape)}")
        return scale, bn, bk, "block"
    # (A dimension of size 1 is read with stride 0, whatever its block size.)
    if shape in ((E, N), (E, N, 1)):
        return scale.reshape(E, N, 1), 1, FP8_GROUP, "channel"
    if shape in ((E,), (E, 1), (E, 1, 1)):
        return scale.reshape(E, 1, 1), 1, FP8_GROUP, "tensor"
    raise ValueError(f"{name} must be per channel [E, N] = [{E}, {N}], per tensor [E] = [{E}], or block-wise "
                     f"[E, cdiv(N, bn), cdiv(K, bk)] with block_shape=(bn, bk) given; got {list(shape)}")


def check_block_shape(block_shape) -> Optional[Tuple[int, int]]:
    """``block_shape`` as a tuple, or None; block_k must be a multiple of :data:`FP8_GROUP` (a kernel K
    step, one activation group, must lie in one weight block)."""
    if block_shape is None:
        return None
    if (not isinstance(block_shape, (tuple, list)) or len(block_shape) != 2
            or not all(isinstance(b, int) and not isinstance(b, bool) and b >= 1 for b in block_shape)):
        raise ValueError(f"block_shape must be a pair of positive ints (block_n, block_k), got {block_shape!r}")
    if block_shape[1] % FP8_GROUP:
        raise ValueError(f"block_shape's block_k must be a multiple of {FP8_GROUP}, got {tuple(block_shape)}")
    return tuple(block_shape)


# ---------------------------------------------------------------------------------------------
# Torch side: quantizing weights, and the activation quantization the kernels apply
# ---------------------------------------------------------------------------------------------

def quantize_weights(w: torch.Tensor, scheme: str = "block", block_shape: Tuple[int, int] = DEFAULT_BLOCK_SHAPE,
                     dtype: torch.dtype = torch.float8_e4m3fn) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(w_fp8 [E, N, K], scale)`` of a 16/32-bit weight ``[E, N, K]``: each block's (row's, expert's)
    absolute maximum maps to the fp8 maximum. ``scheme``: "block" (scale ``[E, cdiv(N, bn),
    cdiv(K, bk)]``), "channel" (``[E, N]``) or "tensor" (``[E]``). For tests, benchmarks and online
    quantization of a 16-bit checkpoint; fp8 checkpoints come with their own scales."""
    if scheme not in SCHEMES:
        raise ValueError(f"scheme must be one of {SCHEMES}, got {scheme!r}")
    if dtype not in FP8_DTYPES:
        raise TypeError(f"dtype must be one of {FP8_DTYPES}, got {dtype}")
    if w.dim() != 3:
        raise ValueError(f"w must be [E, N, K], got shape {list(w.shape)}")
    if scheme == "block" and (not isinstance(block_shape, (tuple, list)) or len(block_shape) != 2 or not all(
            isinstance(b, int) and not isinstance(b, bool) and b >= 1 for b in block_shape)):
        raise ValueError(f"block_shape must be a pair of positive ints (block_n, block_k), got {block_shape!r}")
    # A few experts at a time: float32 temporaries of a whole layer (DeepSeek-V3: 45 GB) would not fit.
    step = max(1, (1 << 28) // max(1, w.shape[1] * w.shape[2]))
    parts = [_quantize_expert_weights(w[e:e + step], scheme, block_shape, dtype) for e in range(0, w.shape[0], step)]
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])


def _quantize_expert_weights(w, scheme, block_shape, dtype):
    E, N, K = w.shape
    wf = w.float()
    finite = torch.isfinite(wf)
    # Scales from the finite values; a NaN or inf weight becomes fp8 NaN (e4m3 has no inf), as a 16-bit forward
    # would carry it (a NaN in a block's maximum had made its scale 1 / fp8_max: the block's other values clipped to 1).
    magnitude = torch.where(finite, wf.abs(), 0.0)
    if scheme == "block":
        bn, bk = block_shape
        sn, sk = triton.cdiv(N, bn), triton.cdiv(K, bk)
        padded = wf.new_zeros(E, sn * bn, sk * bk)
        padded[:, :N, :K] = magnitude
        amax = padded.view(E, sn, bn, sk, bk).amax(dim=(2, 4))
        scale = torch.where(amax > 0, amax, 1.0) / fp8_max(dtype)
        full = scale.repeat_interleave(bn, 1).repeat_interleave(bk, 2)[:, :N, :K]
    elif scheme == "channel":
        amax = magnitude.amax(dim=2)
        scale = torch.where(amax > 0, amax, 1.0) / fp8_max(dtype)
        full = scale[:, :, None]
    else:
        amax = magnitude.amax(dim=(1, 2))
        scale = torch.where(amax > 0, amax, 1.0) / fp8_max(dtype)
        full = scale[:, None, None]
    limit = fp8_max(dtype)
    quantized = torch.where(finite, (wf / full).clamp(-limit, limit), float("nan"))
    return quantized.to(dtype), scale.contiguous()


def nan_codes(w: torch.Tensor) -> torch.Tensor:
    """Where fp8 ``w`` holds NaN (bool, ``w``'s shape), read from its bits: e4m3fn's NaN is S.1111.111 (0x7F, 0xFF),
    e4m3fnuz's the one code 0x80."""
    bits = w.view(torch.uint8)
    return bits == 0x80 if w.dtype == torch.float8_e4m3fnuz else (bits & 0x7F) == 0x7F


def to_e4m3fnuz(w: torch.Tensor, scale: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(w [float8_e4m3fnuz], scale * 2)`` of ``float8_e4m3fn`` weights and their scale, for gfx942, whose
    matrix instructions take e4m3fnuz. Both formats have 4 exponent and 3 mantissa bits; e4m3fnuz's
    exponent bias is one higher, so each bit pattern is worth half as much there and the scale doubles.
    The conversion is exact: -0 becomes +0 and NaN (e4m3fn 0x7F/0xFF) e4m3fnuz's NaN (0x80); e4m3fn's
    largest values (+-448) keep their bits (+-224 in e4m3fnuz)."""
    if w.dtype != torch.float8_e4m3fn:
        raise TypeError(f"w must be float8_e4m3fn, got {w.dtype}")
    bits = w.view(torch.uint8)
    nan = nan_codes(w)
    bits = torch.where(bits == 0x80, torch.zeros_like(bits), bits)
    bits = torch.where(nan, torch.full_like(bits, 0x80), bits)
    return bits.view(torch.float8_e4m3fnuz), scale * 2


def dequantize_weights(w: torch.Tensor, scale: torch.Tensor, block_n: int, block_k: int) -> torch.Tensor:
    """float32 ``w * scale`` of fp8 ``w [E, N, K]`` and its ``[E, Sn, Sk]`` scale view with ``block_n`` x
    ``block_k`` blocks (a dimension of size 1 applies to every row or column)."""
    E, N, K = w.shape
    rows = (torch.arange(N, device=w.device) // block_n).clamp(max=scale.shape[1] - 1)
    cols = (torch.arange(K, device=w.device) // block_k).clamp(max=scale.shape[2] - 1)
    return w.float() * scale.float()[:, rows][:, :, cols]


def quantize_activations(v: torch.Tensor, dtype: torch.dtype, group: int = FP8_GROUP
                         ) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(q [R, K] fp8, scale [R, cdiv(K, group)] float32)`` of rows ``v [R, K]`` quantized as the kernels
    do (module docstring): the same fp32 operations, in the same order."""
    R, K = v.shape
    groups = triton.cdiv(K, group)
    padded = v.float().new_zeros(R, groups * group)
    padded[:, :K] = v.float()
    padded = padded.view(R, groups, group)
    amax = padded.abs().amax(dim=2)  # (NaN where the group holds NaN, kept as the kernels keep it)
    amax = torch.where(amax == 0, 1.0, amax)
    limit = fp8_max(dtype)
    # Tensor by tensor: torch divides by a Python scalar as a product with its reciprocal on GPUs, which
    # differs from a division in the last bit.
    limits = torch.full_like(amax, limit)
    inv = limits / amax
    q = (padded * inv[:, :, None]).clamp(-limit, limit).to(dtype)
    return q.view(R, groups * group)[:, :K], amax / limits


def x_group(hidden_size: int, w1_scale: torch.Tensor) -> int:
    """Columns of x per activation scale in an fp8 forward: all of H where :data:`PER_TOKEN_ACTIVATIONS` is on and
    ``w1_scale`` (its ``[E, Sn, Sk]`` view) is constant along K (``Sk == 1``: per channel, per tensor, or blocks
    as wide as H), else FP8_GROUP."""
    return hidden_size if PER_TOKEN_ACTIVATIONS and w1_scale.shape[-1] == 1 else FP8_GROUP


def x_scales_per_row(x_scale: torch.Tensor, hidden_size: int) -> bool:
    """Whether an fp8 forward's ``x_scale`` buffer (``[M, cdiv(H, x_group)]``) holds one scale a row of an x wider
    than one group: the launches' one test of per-token activations (the sort's tile, the gate/up loop's scaling)."""
    return x_scale.shape[1] == 1 and hidden_size > FP8_GROUP


def fake_quantize_activations(v: torch.Tensor, dtype: torch.dtype, group: int = FP8_GROUP) -> torch.Tensor:
    """float32 rows ``v [R, K]`` after the kernels' quantization and back (``q * scale``)."""
    q, scale = quantize_activations(v, dtype, group)
    return q.float() * scale.repeat_interleave(group, 1)[:, :v.shape[1]]


# ---------------------------------------------------------------------------------------------
# Kernel side
# ---------------------------------------------------------------------------------------------

@triton.jit
def _round_to_fp8_grid(v, MIN_NORMAL: tl.constexpr, SUBNORMAL_STEP: tl.constexpr):
    """fp32 ``v`` (within the fp8 range) rounded to the nearest fp8 e4m3 value, in fp32 arithmetic.

    Only under the Triton interpreter, whose fp32 -> fp8 conversion drops the carry when the
    mantissa rounds up to the next power of two (127.3 became 64 instead of 128; Triton 3.9): the
    value handed to it is then exact. Normal values: Veltkamp's split keeps the 4 leading
    significant bits (nearest; ties are not always to even). Subnormals: nearest multiple of
    ``SUBNORMAL_STEP`` (the 1.5 * 2^23 trick rounds to nearest even)."""
    t = v * 1048577.0  # 2^20 + 1: fp32's 24 significant bits minus e4m3's 4
    normal = t - (t - v)
    magic = 12582912.0  # 1.5 * 2^23
    subnormal = ((v / SUBNORMAL_STEP + magic) - magic) * SUBNORMAL_STEP
    return tl.where(tl.abs(v) < MIN_NORMAL, subnormal, normal)


@triton.jit
def _quantize_rows(v, FP8_MAX: tl.constexpr, SOFT_ROUNDING: tl.constexpr, MIN_NORMAL: tl.constexpr,
                   SUBNORMAL_STEP: tl.constexpr):
    """``(scaled [R, C] fp32, scale [R] fp32)`` of fp32 rows ``v``, one quantization group per row
    (module docstring): ``scaled.to(fp8)`` is the quantized row, ``scale`` its dequantization scale.
    SOFT_ROUNDING (the interpreter): ``scaled`` already on the fp8 grid (:func:`_round_to_fp8_grid`)."""
    # NaN propagates as through a 16-bit GEMM (tl.max, tl.maximum and tl.minimum drop it by default): a row
    # holding NaN gets the scale NaN and every element NaN; one holding +-inf gets the scale inf and NaN
    # where the inf was (inf * 0), so its products come out NaN too. Rows are independent. The row maximum
    # is taken on the bits: non-negative floats order as their int32 patterns, and NaN (sign cleared by abs: an
    # AND with 0x7fffffff on sm_90 and gfx942, Triton 3.9) lies above inf (a custom combine would do too, but runs
    # element by element in the interpreter).
    amax = tl.max(tl.abs(v).to(tl.int32, bitcast=True), axis=1).to(tl.float32, bitcast=True)
    amax = tl.where(amax == 0.0, 1.0, amax)
    limit = tl.full(amax.shape, FP8_MAX, tl.float32)
    inv = tl.math.div_rn(limit, amax)  # (plain "/" may be approximate on GPUs)
    scale = tl.math.div_rn(amax, limit)
    scaled = tl.minimum(tl.maximum(v * inv[:, None], -FP8_MAX, propagate_nan=tl.PropagateNan.ALL), FP8_MAX,
                        propagate_nan=tl.PropagateNan.ALL)
    if SOFT_ROUNDING:
        scaled = _round_to_fp8_grid(scaled, MIN_NORMAL, SUBNORMAL_STEP)
    return scaled, scale


def fp8_constexprs(dtype: Optional[torch.dtype], interpreter: bool) -> dict:
    """The fp8 constexprs of a kernel launch for weights of ``dtype`` (None or 16/32-bit: FP8=False)."""
    if dtype not in FP8_DTYPES:
        return dict(FP8=False, FP8_MAX=448.0, SOFT_FP8_ROUNDING=False, FP8_MIN_NORMAL=0.015625,
                    FP8_SUBNORMAL_STEP=0.001953125)
    info = torch.finfo(dtype)
    return dict(FP8=True, FP8_MAX=float(info.max), SOFT_FP8_ROUNDING=interpreter,
                FP8_MIN_NORMAL=float(info.smallest_normal), FP8_SUBNORMAL_STEP=float(info.smallest_normal) / 8)


__all__ = ["FP8_DTYPES", "FP8_GROUP", "DEFAULT_BLOCK_SHAPE", "quantize_weights", "dequantize_weights", "to_e4m3fnuz",
           "quantize_activations", "fake_quantize_activations", "weight_scale_view", "fp8_max"]
