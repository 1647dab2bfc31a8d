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

4-bit weights (``fmoe2/quant4.py``: mxfp4, int4) are prepared the same way with their K dimension packed two
values per byte (``w13 [E, 2*I_pad, H_pad // 2]``, ``w2 [E, H_pad, I_pad // 2]`` uint8) and their group scales
in the weights' row order: mxfp4 ``s13 [E, 2*I_pad, H_pad // 32]`` uint8 e8m0, int4 ``s13 [E, 2*I_pad, H_pad //
G, 2]`` holding (scale, zero) per group in the scales' dtype; ``scale_block`` is ``(1, G)``. H_pad and I_pad
are then multiples of the group too; padded scales are zero, so padded values dequantize to zero.

int8 weights (``fmoe2/int8.py``) keep one value per byte (``w13 [E, 2*I_pad, H_pad]`` int8) with scales
``s13 [E, 2*I_pad, H_pad // G]`` in the scales' dtype (per channel scales repeated over groups of 128).
Each prepared tensor's format is in :data:`fmoe2.formats.WEIGHT_FORMATS` (``PreparedMoEWeights.weight_format``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional, Tuple

import torch
from einops import rearrange

from .._validation import FLOAT_DTYPES, check_tensor
from ..formats import (WEIGHT_FORMATS, WeightFormat, check_prepared_tensors, format_of_prepared, format_of_weights,
                       weight_format)
from ..fp8 import FP8_DTYPES, check_block_shape, to_e4m3fnuz, weight_scale_view
from .. import int8, quant4


def _round_up(x: int, m: int) -> int:
    return (x + m - 1) // m * m


# Passed by prepare_weights and PreparedMoEWeights.from_prepared (and kept by dataclasses.replace): a
# PreparedMoEWeights built by hand from other tensors, e.g. plain [E, 2I, H] weights whose gate rows come first, would
# pass every check and compute wrong (issue 57: relative error 1.42).
_PREPARED = object()


@dataclass
class PreparedMoEWeights:
    """Expert weights in fmoe2's prepared layout (see module docstring), made by :func:`prepare_weights`; rebuilt from
    tensors it made (a saved state, buffers of a module) by :meth:`from_prepared`."""

    w13: torch.Tensor  # [E, 2*I_pad, H_pad], gate/up rows interleaved, zero padded
    w2: torch.Tensor  # [E, H_pad, I_pad], zero padded
    hidden_size: int  # H (logical)
    intermediate_size: int  # I (logical)
    b13: Optional[torch.Tensor] = None  # [E, 2*I_pad] gate/up bias, interleaved like w13's rows, zero padded
    b2: Optional[torch.Tensor] = None  # [E, H_pad] down bias, zero padded
    # fp8 weights: float32 scale views [E, Sn, Sk] of w1 (the checkpoint's row order: the kernels map
    # interleaved rows back) and w2, and their block shape (block_n, block_k) (fmoe2/fp8.py). Weight-only formats
    # (mxfp4, int4, int8): their group scales in w13's / w2's row order (module docstring), scale_block (1, group)
    s13: Optional[torch.Tensor] = None
    s2: Optional[torch.Tensor] = None
    scale_block: Optional[Tuple[int, int]] = None
    # The format's name in fmoe2.formats.WEIGHT_FORMATS, stated by prepare_weights; None (weights rebuilt from their
    # prepared tensors, e.g. by the torch.library op): read off those tensors. Checked against them either way.
    weight_format: Optional[str] = None
    _made_by: object = field(default=None, repr=False, compare=False)

    def __post_init__(self):
        if self._made_by is not _PREPARED:
            raise TypeError("PreparedMoEWeights holds tensors in fmoe2's prepared layout (gate/up rows interleaved, "
                            "padded): make it with fmoe2.prepare_weights(w1, w2, ...), or rebuild one from the tensors "
                            "prepare_weights made (a saved state, a module's buffers) with "
                            "PreparedMoEWeights.from_prepared(w13, w2, hidden_size, intermediate_size, ...)")
        if self.weight_format is None:
            self.weight_format = format_of_prepared(self.w13, self.s13).name
        check_prepared_tensors(weight_format(self.weight_format), self.w13, self.s13, self.scale_block)

    @classmethod
    def from_prepared(cls, w13: torch.Tensor, w2: torch.Tensor, hidden_size: int, intermediate_size: int,
                      b13: Optional[torch.Tensor] = None, b2: Optional[torch.Tensor] = None,
                      s13: Optional[torch.Tensor] = None, s2: Optional[torch.Tensor] = None,
                      scale_block: Optional[Tuple[int, int]] = None,
                      weight_format: Optional[str] = None) -> "PreparedMoEWeights":
        """Prepared weights rebuilt from the tensors :func:`prepare_weights` made (its fields, in its layout:
        ``w13`` with gate/up rows interleaved); checked against their format as prepared ones are."""
        return cls(w13, w2, hidden_size, intermediate_size, b13, b2, s13, s2, scale_block, weight_format,
                   _made_by=_PREPARED)

    @property
    def format(self) -> WeightFormat:
        """The weights' :class:`~fmoe2.formats.WeightFormat`."""
        return WEIGHT_FORMATS[self.weight_format]

    @property
    def fp8(self) -> bool:
        return self.format.quantizes_activations

    @property
    def packed(self) -> bool:
        """Weight-only quantized weights (mxfp4, int4, int8), dequantized in the 16-bit kernels' operand loader."""
        return self.format.weight_only

    @property
    def group_size(self) -> Optional[int]:
        """K columns per scale of weight-only formats (None otherwise)."""
        return self.scale_block[1] if self.packed and self.scale_block is not None else None

    @property
    def num_experts(self) -> int:
        return self.w13.shape[0]

    @property
    def dtype(self) -> torch.dtype:
        return self.w13.dtype

    @property
    def device(self) -> torch.device:
        return self.w13.device

    def unprepare(self, experts: slice = slice(None), which: Tuple[int, ...] = (0, 1)):
        """Returns ``(w1 [E, 2I, H], w2 [E, H, I])`` in the plain layout (for references/tests); weight-only formats
        dequantized to float32. ``experts``: those experts only; ``which``: 0 for w1, 1 for w2 (the others None)."""
        H, inter = self.hidden_size, self.intermediate_size
        out = [None, None]
        for i in which:
            w, s = ((self.w13, self.s13), (self.w2, self.s2))[i]
            w = w[experts]
            if self.packed:
                w = self._dequantize(w, s[experts], torch.float32)
            if i == 0:
                gate_up = rearrange(w, "e (i two) h -> e two i h", two=2)[:, :, :inter, :H]
                out[0] = rearrange(gate_up, "e two i h -> e (two i) h").contiguous()
            else:
                out[1] = w[:, :H, :inter].contiguous()
        return tuple(out)

    def dequantized(self, dtype: torch.dtype = torch.float32):
        """``(w13, w2)`` of weight-only quantized weights dequantized to ``dtype``, in the prepared (interleaved,
        padded) layout."""
        return self._dequantize(self.w13, self.s13, dtype), self._dequantize(self.w2, self.s2, dtype)

    def _dequantize(self, w: torch.Tensor, s: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        if self.weight_format == "mxfp4":
            return quant4.dequantize_mxfp4(w, s, dtype)
        if self.weight_format == "int4":
            return quant4.dequantize_int4(w, s[..., 0], s[..., 1], self.group_size, dtype)
        if self.weight_format == "int8":
            return int8.dequantize_int8(w, s, self.group_size, dtype)
        raise ValueError(f"dequantized() is for weight-only formats; these are {self.weight_format}")

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
                    fp8_dtype: Optional[torch.dtype] = None, w1_zero: Optional[torch.Tensor] = None,
                    w2_zero: Optional[torch.Tensor] = None, weight_format: Optional[str] = None) -> PreparedMoEWeights:
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

    4-bit weights (``fmoe2/quant4.py``) are uint8, two values per byte along K: ``w1 [E, 2I, H // 2]`` and ``w2 [E,
    H, I // 2]`` (mxfp4 also as transformers' ``*_blocks [E, N, K // 32, 16]``), with their group scales:

    * mxfp4: ``w1_scale [E, 2I, H // 32]`` and ``w2_scale [E, H, I // 32]``, uint8 e8m0 (transformers'
      ``*_scales``);
    * int4: ``w1_scale [E, 2I, H // G]`` and ``w2_scale [E, H, I // G]`` (fp16/bf16/fp32, G = 32, 64 or 128), and
      their zero points ``w1_zero`` / ``w2_zero`` of the same shapes (integers in [0, 16]; None: symmetric, 8).
      GPTQ and AWQ layers convert with :func:`fmoe2.quant4.from_gptq` / :func:`~fmoe2.quant4.from_awq`.

    H and I must be multiples of the group. Biases of 4-bit weights may be in any float dtype (gpt-oss keeps
    float32 ones); they are added in float32.

    int8 weights (w8a16, ``fmoe2/int8.py``): ``w1 [E, 2I, H]`` and ``w2 [E, H, I]`` int8, symmetric, with scales per
    output channel (``w1_scale [E, 2I]``, ``w2_scale [E, H]``: vLLM's int8_w8a16) or per group of G = 32, 64 or 128
    columns (``[E, 2I, H // G]``, ``[E, H, I // G]``; H and I multiples of G), fp16/bf16/fp32; biases as 4-bit ones.

    ``weight_format``: the weights' format, a name of :data:`fmoe2.formats.WEIGHT_FORMATS` (``"16bit"``, ``"fp8"``,
    ``"mxfp4"``, ``"int4"``, ``"int8"``). None: the one the weights' dtype stores; uint8 weights hold mxfp4 or int4,
    so for them it must be given (it is never guessed from the scales).
    """
    if isinstance(pad_to, bool) or not isinstance(pad_to, int):
        raise TypeError(f"pad_to must be a positive int (the padded sizes' multiple), got {pad_to!r}")
    if pad_to < 1:
        raise ValueError(f"pad_to must be a positive int (the padded sizes' multiple), got {pad_to!r}")
    if not isinstance(gate_up_interleaved, bool):
        raise TypeError(f"gate_up_interleaved must be a bool (True: w1's rows are g0, u0, g1, u1, ...), got "
                        f"{gate_up_interleaved!r}")
    for name, w in (("w1", w1), ("w2", w2)):
        if not isinstance(w, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(w).__name__}")
    fmt = format_of_weights(w1, weight_format, "w1")
    if fmt.weight_only:
        return _prepare_weight_only(fmt, w1, w2, pad_to, w1_bias, w2_bias, gate_up_interleaved, w1_scale, w2_scale,
                                    w1_zero, w2_zero, block_shape, fp8_dtype)
    if w1_zero is not None or w2_zero is not None:
        raise ValueError(f"w1_zero/w2_zero go with int4 weights (uint8, packed); w1 is {w1.dtype}")
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
    fp8 = fmt.quantizes_activations
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
    w13 = _interleaved_rows(w1, i_pad, h_pad, gate_up_interleaved)
    w2p = _padded(w2, h_pad, i_pad)
    b13, b2 = _prepared_biases(w1_bias, w2_bias, i_pad, h_pad, gate_up_interleaved)
    return PreparedMoEWeights.from_prepared(w13, w2p, H, inter, b13, b2, s13.contiguous() if fp8 else None,
                                            s2.contiguous() if fp8 else None, scale_block, fmt.name)


def _interleaved_rows(t: torch.Tensor, i_pad: int, k_pad: int, gate_up_interleaved: bool) -> torch.Tensor:
    """``t [E, 2I, k, ...]`` (gate rows then up rows, or interleaved) as ``[E, 2*I_pad, k_pad, ...]``: rows g0, u0,
    g1, u1, ..., zero padded."""
    E, two_i, k = t.shape[:3]
    order = "e (i two) k ... -> e two i k ..." if gate_up_interleaved else "e (two i) k ... -> e two i k ..."
    out = t.new_zeros(E, 2, i_pad, k_pad, *t.shape[3:])
    out[:, :, :two_i // 2, :k] = rearrange(t, order, two=2)
    return rearrange(out, "e two i k ... -> e (i two) k ...").contiguous()


def _padded(t: torch.Tensor, rows: int, k_pad: int) -> torch.Tensor:
    """``t [E, N, k, ...]`` zero padded to ``[E, rows, k_pad, ...]`` (contiguous)."""
    out = t.new_zeros(t.shape[0], rows, k_pad, *t.shape[3:])
    out[:, :t.shape[1], :t.shape[2]] = t
    return out


def _prepared_biases(w1_bias, w2_bias, i_pad: int, h_pad: int, gate_up_interleaved: bool):
    """``(b13 [E, 2*I_pad] interleaved, b2 [E, H_pad])``, zero padded (None where not given)."""
    b13 = b2 = None
    if w1_bias is not None:
        b13 = _interleaved_rows(w1_bias[:, :, None], i_pad, 1, gate_up_interleaved)[:, :, 0].contiguous()
    if w2_bias is not None:
        b2 = w2_bias.new_zeros(w2_bias.shape[0], h_pad)
        b2[:, :w2_bias.shape[1]] = w2_bias
    return b13, b2


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


def _prepare_weight_only(fmt: WeightFormat, w1, w2, pad_to, w1_bias, w2_bias, gate_up_interleaved, w1_scale,
                         w2_scale, w1_zero, w2_zero, block_shape, fp8_dtype) -> PreparedMoEWeights:
    """:func:`prepare_weights` of weight-only formats (mxfp4, int4, int8; its docstring): checks the packing, the
    scales' shapes and dtypes, then interleaves and pads rows as for 16-bit weights and pads K to whole groups."""
    name = fmt.name
    per = fmt.values_per_element
    if block_shape is not None or fp8_dtype is not None:
        raise ValueError(f"block_shape and fp8_dtype go with fp8 weights, not with {name} weights")
    for what, w in (("w1", w1), ("w2", w2)):
        if w.dtype not in fmt.weight_dtypes:
            raise TypeError(f"{name} weights are {fmt.weight_dtypes[0]}: {what} is {w.dtype}")
    if name == "mxfp4":  # transformers' mxfp4 blocks [E, N, K // 32, 16]: the same bytes as [E, N, K // 2]
        w1 = w1.flatten(2) if w1.dim() == 4 else w1
        w2 = w2.flatten(2) if w2.dim() == 4 else w2
    stored = " // 2" if per == 2 else ""
    check_tensor("w1", w1, ndim=3, shape_doc=f"[E, 2I, H{stored}] ({fmt.weight_dtypes[0]})", contiguous=False)
    E, two_i, h_stored = w1.shape
    if two_i % 2:
        raise ValueError(f"w1 must have shape [E, 2I, H{stored}] (gate and up rows), got {tuple(w1.shape)}")
    H, inter = per * h_stored, two_i // 2
    check_tensor("w2", w2, shape=(E, H, None), shape_doc=f"[E, H, I{stored}] = [{E}, {H}, I{stored}]",
                 contiguous=False)
    if per * w2.shape[2] != inter:
        raise ValueError(f"w2 must have shape [E, H, I{stored}] = {[E, H, inter // per]} (I = {inter} from w1's "
                         f"rows), got {tuple(w2.shape)}")
    for what, t in (("w2", w2), ("w1_scale", w1_scale), ("w2_scale", w2_scale), ("w1_zero", w1_zero),
                    ("w2_zero", w2_zero), ("w1_bias", w1_bias), ("w2_bias", w2_bias)):
        if isinstance(t, torch.Tensor) and t.device != w1.device:
            raise ValueError(f"{what} is on {t.device} but w1 is on {w1.device}")
    if w1_scale is None or w2_scale is None:
        raise ValueError(f"{name} weights need their scales: w1_scale and w2_scale (mxfp4: uint8 e8m0 [E, N, "
                         f"K // 32]; int4: float [E, N, K // group]; int8: float [E, N] or [E, N, K // group])")
    if name != "int4" and (w1_zero is not None or w2_zero is not None):
        raise ValueError(f"{name} weights have no zero points: w1_zero/w2_zero go with int4 weights")
    for what, scale in (("w1_scale", w1_scale), ("w2_scale", w2_scale)):
        check_tensor(what, scale, dtypes=fmt.scale_dtypes, contiguous=False)
    per_channel = name == "int8" and w1_scale.dim() == 2
    if per_channel:  # (repeated over groups of int8.CHANNEL_GROUP columns: the kernels read one layout)
        group = int8.CHANNEL_GROUP
        check_tensor("w1_scale", w1_scale, shape=(E, two_i), shape_doc=f"[E, 2I] = {[E, two_i]} (per channel)",
                     contiguous=False)
        check_tensor("w2_scale", w2_scale, dtypes=(w1_scale.dtype,), shape=(E, H),
                     shape_doc=f"[E, H] = {[E, H]} (per channel, like w1_scale)", contiguous=False)
    else:
        check_tensor("w1_scale", w1_scale, ndim=3, shape=(E, two_i, None), shape_doc=f"[E, 2I, H // group] = "
                     f"[{E}, {two_i}, {H} // group]", contiguous=False)
        groups = w1_scale.shape[2]
        if groups < 1 or H % groups or H // groups not in fmt.groups:
            raise ValueError(f"w1_scale [E, 2I, H // group] has {groups} groups for H={H}: {name} groups are "
                             f"{fmt.groups} columns")
        group = H // groups
        for what, k in (("H", H), ("I", inter)):
            if k % group:
                raise ValueError(f"{name} weights need {what} a multiple of the group ({group}), got {what}={k}")
        check_tensor("w2_scale", w2_scale, dtypes=(w1_scale.dtype,), shape=(E, H, inter // group),
                     shape_doc=f"[E, H, I // {group}] = {[E, H, inter // group]} (the dtype of w1_scale)",
                     contiguous=False)
    s13, s2 = w1_scale, w2_scale
    if name == "int4":  # (scale, zero) side by side, in the scales' dtype
        s13, s2 = (torch.stack([s, z.to(s.dtype)], dim=-1) for s, z in
                   zip((w1_scale, w2_scale), _int4_zeros(w1_scale, w2_scale, w1_zero, w2_zero)))
    for what, bias, shape in (("w1_bias", w1_bias, (E, two_i)), ("w2_bias", w2_bias, (E, H))):
        if bias is not None:
            check_tensor(what, bias, dtypes=FLOAT_DTYPES, shape=shape, shape_doc=f"{list(shape)}", contiguous=False)
    k_multiple = pad_to * group // math.gcd(pad_to, group)
    h_pad, i_pad = _round_up(H, k_multiple), _round_up(inter, k_multiple)
    if per_channel:
        s13, s2 = int8.channel_scales_as_groups(s13, H, group), int8.channel_scales_as_groups(s2, inter, group)
    w13 = _interleaved_rows(w1, i_pad, h_pad // per, gate_up_interleaved)
    s13 = _interleaved_rows(s13, i_pad, h_pad // group, gate_up_interleaved)
    w2p = _padded(w2, h_pad, i_pad // per)
    s2 = _padded(s2, h_pad, i_pad // group)
    b13, b2 = _prepared_biases(w1_bias, w2_bias, i_pad, h_pad, gate_up_interleaved)
    return PreparedMoEWeights.from_prepared(w13, w2p, H, inter, b13, b2, s13, s2, (1, group), name)


def _int4_zeros(w1_scale, w2_scale, w1_zero, w2_zero):
    """int4's zero points of both weights, checked (None: symmetric, :data:`quant4.INT4_SYMMETRIC_ZERO`)."""
    if (w1_zero is None) != (w2_zero is None):
        raise ValueError("w1_zero and w2_zero go together (both None: symmetric int4, zero 8)")
    zeros = []
    for name, z, scale in (("w1_zero", w1_zero, w1_scale), ("w2_zero", w2_zero, w2_scale)):
        if z is None:
            zeros.append(torch.full(scale.shape, quant4.INT4_SYMMETRIC_ZERO, dtype=scale.dtype, device=scale.device))
            continue
        check_tensor(name, z, shape=tuple(scale.shape), shape_doc=f"{list(scale.shape)} like its scale",
                     contiguous=False)
        if z.is_floating_point() and not torch.equal(z, z.round()):
            raise ValueError(f"{name} must hold integer zero points")
        if z.numel() and (int(z.min()) < 0 or int(z.max()) > 16):
            raise ValueError(f"{name} must hold zero points in [0, 16], got [{int(z.min())}, {int(z.max())}]")
        zeros.append(z)
    return zeros
