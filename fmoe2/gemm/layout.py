"""Pre-shuffled expert weights, converted once at load time.

Plain layout (vLLM/SGLang convention): ``w1 [E, 2I, H]`` (rows ``0..I-1`` gate, ``I..2I-1`` up)
and ``w2 [E, H, I]``.

Prepared layout (:class:`PreparedMoEWeights`), both padded with zeros to ``pad_to`` elements
(default 64, i.e. 128-byte rows in bf16/fp16):

* ``w13 [E, 2*I_pad, H_pad]``: gate and up rows **interleaved**, row ``2j`` is gate row ``j``
  and row ``2j+1`` is up row ``j``. An intermediate slice ``[n0, n0+BLOCK_N)`` is then one
  contiguous block of ``2*BLOCK_N`` rows, so the kernel loads one ``[2*BLOCK_N, BLOCK_K]`` tile
  per K step and issues one matrix product of width ``2*BLOCK_N``; the gate/up split afterwards
  pairs neighbouring accumulator columns, which the matrix-instruction layouts keep in the same
  thread (no data movement).
* ``w2 [E, H_pad, I_pad]``: the plain layout, padded.

Padding makes every row start 16-byte aligned whatever H and I are, so tile loads stay
vectorised for odd sizes. Padding is zero and the kernel masks by the logical H and I, so the
result is the same as with the plain layout (with ``FusedMoEConfig.tma`` the weight tiles are not
masked: their padding meets zeros of x or y instead, so it must be finite, as the zeros written
here are).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import torch
from einops import rearrange

from .._validation import FLOAT_DTYPES, check_tensor
from ..fp8 import FP8_DTYPES, check_block_shape, to_e4m3fnuz, weight_scale_view


def _round_up(x: int, m: int) -> int:
    return (x + m - 1) // m * m


@dataclass
class PreparedMoEWeights:
    """Expert weights in fmoe2's prepared layout (see module docstring)."""

    w13: torch.Tensor  # [E, 2*I_pad, H_pad], gate/up rows interleaved, zero padded
    w2: torch.Tensor  # [E, H_pad, I_pad], zero padded
    hidden_size: int  # H (logical)
    intermediate_size: int  # I (logical)
    b13: Optional[torch.Tensor] = None  # [E, 2*I_pad] gate/up bias, interleaved like w13's rows, zero padded
    b2: Optional[torch.Tensor] = None  # [E, H_pad] down bias, zero padded
    # fp8 weights: float32 scale views [E, Sn, Sk] of w1 (the checkpoint's row order: the kernels map
    # interleaved rows back) and w2, and their block shape (block_n, block_k) (fmoe2/fp8.py)
    s13: Optional[torch.Tensor] = None
    s2: Optional[torch.Tensor] = None
    scale_block: Optional[Tuple[int, int]] = None

    @property
    def fp8(self) -> bool:
        return self.s13 is not None

    @property
    def num_experts(self) -> int:
        return self.w13.shape[0]

    @property
    def dtype(self) -> torch.dtype:
        return self.w13.dtype

    @property
    def device(self) -> torch.device:
        return self.w13.device

    def unprepare(self):
        """Returns ``(w1 [E, 2I, H], w2 [E, H, I])`` in the plain layout (for references/tests)."""
        H, inter = self.hidden_size, self.intermediate_size
        gate_up = rearrange(self.w13, "e (i two) h -> e two i h", two=2)[:, :, :inter, :H]
        w1 = rearrange(gate_up, "e two i h -> e (two i) h").contiguous()
        return w1, self.w2[:, :H, :inter].contiguous()

    def unprepare_biases(self):
        """Returns ``(w1_bias [E, 2I] gate then up, w2_bias [E, H])`` (None where there is none)."""
        H, inter = self.hidden_size, self.intermediate_size
        b1 = None
        if self.b13 is not None:
            b1 = rearrange(self.b13, "e (i two) -> e two i", two=2)[:, :, :inter].reshape(self.num_experts, 2 * inter)
        return b1, self.b2[:, :H].contiguous() if self.b2 is not None else None


def prepare_weights(w1: torch.Tensor, w2: torch.Tensor, *, pad_to: int = 64, w1_bias: Optional[torch.Tensor] = None,
                    w2_bias: Optional[torch.Tensor] = None, gate_up_interleaved: bool = False,
                    w1_scale: Optional[torch.Tensor] = None, w2_scale: Optional[torch.Tensor] = None,
                    block_shape: Optional[Tuple[int, int]] = None,
                    fp8_dtype: Optional[torch.dtype] = None) -> PreparedMoEWeights:
    """Converts plain ``w1 [E, 2I, H]`` and ``w2 [E, H, I]`` (any strides) to the prepared layout.

    ``w1_bias [E, 2I]`` and ``w2_bias [E, H]``: optional biases, ``w1_bias`` in ``w1``'s row order.
    ``gate_up_interleaved``: ``w1``'s rows (and ``w1_bias``) are g0, u0, g1, u1, ... instead of all
    gate rows then all up rows. Call once at load time; it allocates new tensors of (padded) weight
    size on the same device.

    fp8 weights (``float8_e4m3fn``/``float8_e4m3fnuz``) come with their float32 scales ``w1_scale``
    and ``w2_scale`` (block-wise with ``block_shape``, per channel or per expert: ``fmoe2/fp8.py``),
    kept in the checkpoint's row order; biases of fp8 weights are in the activations' dtype.
    ``fp8_dtype``: the fp8 dtype to prepare them in; None: theirs, unless the weights' GPU takes only
    e4m3fnuz (gfx942), where e4m3fn weights are converted (exactly, their scales doubled:
    :func:`fmoe2.fp8.to_e4m3fnuz`).
    """
    check_tensor("w1", w1, ndim=3, dtypes=FLOAT_DTYPES + FP8_DTYPES, shape_doc="[E, 2I, H]", contiguous=False)
    E, two_i, H = w1.shape
    if two_i % 2:
        raise ValueError(f"w1 must have shape [E, 2I, H] (gate rows then up rows), got {tuple(w1.shape)}")
    inter = two_i // 2
    check_tensor("w2", w2, dtypes=(w1.dtype,), shape=(E, H, inter), shape_doc=f"[E, H, I] = [{E}, {H}, {inter}]",
                 contiguous=False)
    if w2.device != w1.device:
        raise ValueError(f"w2 is on {w2.device} but w1 is on {w1.device}")
    if pad_to < 1:
        raise ValueError(f"pad_to must be >= 1, got {pad_to}")
    fp8 = w1.dtype in FP8_DTYPES
    s13, s2, scale_block = checked_weight_scales(w1, w2, w1_scale, w2_scale, block_shape, gate_up_interleaved)
    if fp8:
        w1, w2, s13, s2 = _to_fp8_dtype(w1, w2, s13, s2, fp8_dtype)
    elif fp8_dtype is not None:
        raise ValueError(f"fp8_dtype goes with fp8 weights; w1 is {w1.dtype}")
    bias_dtypes = FLOAT_DTYPES if fp8 else (w1.dtype,)
    for name, bias, shape in (("w1_bias", w1_bias, (E, two_i)), ("w2_bias", w2_bias, (E, H))):
        if bias is not None:
            check_tensor(name, bias, dtypes=bias_dtypes, shape=shape, shape_doc=f"{list(shape)}", contiguous=False)
            if bias.device != w1.device:
                raise ValueError(f"{name} is on {bias.device} but w1 is on {w1.device}")
    h_pad, i_pad = _round_up(H, pad_to), _round_up(inter, pad_to)
    order = "e (i two) h -> e two i h" if gate_up_interleaved else "e (two i) h -> e two i h"

    w13 = w1.new_zeros(E, 2, i_pad, h_pad)
    w13[:, :, :inter, :H] = rearrange(w1, order, two=2)
    w13 = rearrange(w13, "e two i h -> e (i two) h").contiguous()
    w2p = w2.new_zeros(E, h_pad, i_pad)
    w2p[:, :H, :inter] = w2
    b13 = b2 = None
    if w1_bias is not None:
        b13 = w1_bias.new_zeros(E, 2, i_pad)
        b13[:, :, :inter] = rearrange(w1_bias, order.replace(" h", ""), two=2)
        b13 = rearrange(b13, "e two i -> e (i two)").contiguous()
    if w2_bias is not None:
        b2 = w2_bias.new_zeros(E, h_pad)
        b2[:, :H] = w2_bias
    return PreparedMoEWeights(w13=w13, w2=w2p, hidden_size=H, intermediate_size=inter, b13=b13, b2=b2,
                              s13=s13.contiguous() if fp8 else None, s2=s2.contiguous() if fp8 else None,
                              scale_block=scale_block)


def _to_fp8_dtype(w1, w2, s13, s2, fp8_dtype):
    """Weights and scales in ``fp8_dtype`` (None: what the weights' GPU takes, see :func:`prepare_weights`)."""
    from ..target import target_of

    if fp8_dtype is None:
        supported = target_of(w1.device).fp8_dtypes
        fp8_dtype = torch.float8_e4m3fnuz if supported == (torch.float8_e4m3fnuz,) else w1.dtype
    if fp8_dtype == w1.dtype:
        return w1, w2, s13, s2
    if (w1.dtype, fp8_dtype) != (torch.float8_e4m3fn, torch.float8_e4m3fnuz):
        raise ValueError(f"fp8 weights convert from float8_e4m3fn to float8_e4m3fnuz only, not {w1.dtype} to {fp8_dtype}")
    (w1, s13), (w2, s2) = to_e4m3fnuz(w1, s13), to_e4m3fnuz(w2, s2)
    return w1, w2, s13, s2


def checked_weight_scales(w1: torch.Tensor, w2: torch.Tensor, w1_scale, w2_scale, block_shape,
                          gate_up_interleaved: bool = False):
    """``(w1 scale view, w2 scale view, (block_n, block_k))`` of fp8 plain weights (``fmoe2/fp8.py``);
    ``(None, None, None)`` for 16/32-bit weights, which take no scales. Raises for missing or misshapen
    scales, a scale on another device, and interleaved fp8 rows (their scales' row order is not defined)."""
    E, two_i, H = w1.shape
    if w1.dtype not in FP8_DTYPES:
        if w1_scale is not None or w2_scale is not None or block_shape is not None:
            raise ValueError(f"w1_scale, w2_scale and block_shape go with fp8 weights {FP8_DTYPES}; w1 is {w1.dtype}")
        return None, None, None
    if w1_scale is None or w2_scale is None:
        raise ValueError(f"fp8 weights ({w1.dtype}) need their float32 scales: w1_scale and w2_scale "
                         f"(block-wise with block_shape, per channel [E, N] or per expert [E])")
    if gate_up_interleaved:
        raise ValueError("gate_up_interleaved is not supported with fp8 weights (scales are read in gate-then-up "
                         "row order)")
    block_shape = check_block_shape(block_shape)
    # (Per channel and per expert read alike: either may go with the other.)
    s13, bn, bk, _ = weight_scale_view("w1_scale", w1_scale, E, two_i, H, block_shape)
    s2, _, _, _ = weight_scale_view("w2_scale", w2_scale, E, H, two_i // 2, block_shape)
    for name, scale in (("w1_scale", w1_scale), ("w2_scale", w2_scale)):
        if scale.device != w1.device:
            raise ValueError(f"{name} is on {scale.device} but w1 is on {w1.device}")
    return s13, s2, (bn, bk)
