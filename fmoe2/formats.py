"""Weight formats: what each one is, in one registry.

A :class:`WeightFormat` is fixed when weights are prepared (:func:`fmoe2.prepare_weights` states it on the
:class:`~fmoe2.PreparedMoEWeights` it returns) and read everywhere else from :data:`WEIGHT_FORMATS`; nothing
outside this module tells formats apart by their tensors' dtypes. There are two kinds:

* formats that change the activations' side too (``fp8``: the sort launch quantizes x, and the format runs its
  own entry kernels, ``fmoe2/gemm/fp8_weights.py``);
* weight-only formats (``mxfp4``, ``int4``, ``int8``): the 16-bit entry kernels run them, their operand loader
  (``fmoe2/gemm/operands.py``) dequantizing each weight tile in registers, one branch per format.

In the kernels a weight-only format is told apart by the element types of its prepared tensors (a Triton
constexpr, free at run time), as :attr:`WeightFormat.kernel_encoding` records: mxfp4 is uint8 weights with uint8
scales, int4 uint8 weights with (scale, zero) float pairs, int8 int8 weights with float scales.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional, Tuple

import torch

from .fp8 import FP8_DTYPES

FLOAT_SCALE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@dataclass(frozen=True)
class WeightFormat:
    """One weight format (module docstring): its storage, its scales and what it supports.

    ``values_per_element``: K columns per stored weight element (2: two 4-bit values per byte). ``scale_entry``:
    for weight-only formats, the values each group holds in the prepared scale tensor's last dimension (1: a scale,
    2: a (scale, zero) pair); 0 where the format has no group scales. ``groups``: the group sizes (K columns per
    scale) it takes. ``unsupported``: ``(feature, reason)`` pairs."""

    name: str
    description: str
    weight_dtypes: Tuple[torch.dtype, ...]
    element_bits: int
    values_per_element: int = 1
    scale_dtypes: Tuple[torch.dtype, ...] = ()
    scale_entry: int = 0
    scale_doc: str = ""  # what a group's scale entry is, for errors
    groups: Tuple[int, ...] = ()
    quantizes_activations: bool = False
    dequantized_in_loader: bool = False
    takes_plain_weights: bool = True
    kernel_encoding: str = ""
    unsupported: Tuple[Tuple[str, str], ...] = ()

    @property
    def scale_tail(self) -> Tuple[int, ...]:
        """The prepared scale tensor's dimensions after ``[E, rows, K_pad // group]``: ``(2,)`` for (scale, zero)
        pairs, else none."""
        return (self.scale_entry,) if self.scale_entry > 1 else ()

    @property
    def weight_only(self) -> bool:
        """Weight-only formats are dequantized in the 16-bit entries' operand loader (module docstring)."""
        return self.dequantized_in_loader

    def reason_unsupported(self, feature: str) -> Optional[str]:
        """Why ``feature`` does not go with this format, or None where it does."""
        return dict(self.unsupported).get(feature)

    def check_group(self, group: int, what: str = "weights") -> int:
        """``group`` if this format takes it, else a ValueError naming the ones it takes."""
        if group not in self.groups:
            raise ValueError(f"{self.name} {what} have groups of {group} columns; {self.name} takes {self.groups}")
        return group


_PREPARE_FIRST = ("plain weights", "weight-only formats are prepared once at load time: fmoe2.prepare_weights(w1, "
                                   "w2, w1_scale=..., w2_scale=..., weight_format=...)")

WEIGHT_FORMATS: Dict[str, WeightFormat] = {f.name: f for f in (
    WeightFormat("16bit", "bf16/fp16 weights (fp32 for tests), the activations' dtype", weight_dtypes=(
        torch.bfloat16, torch.float16, torch.float32), element_bits=16),
    WeightFormat("fp8", "e4m3 weights with float32 scales per 2-D block, per output channel or per expert; the "
                 "sort launch quantizes x (fmoe2/fp8.py)", weight_dtypes=FP8_DTYPES, element_bits=8,
                 scale_dtypes=(torch.float32,), quantizes_activations=True,
                 unsupported=(("gate_up_interleaved", "fp8 scales are read in the checkpoint's gate-then-up row "
                               "order"),)),
    WeightFormat("mxfp4", "OCP mxfp4: e2m1 values two per byte, one e8m0 scale per 32 columns (gpt-oss; "
                 "fmoe2/quant4.py)", weight_dtypes=(torch.uint8,), element_bits=4, values_per_element=2,
                 scale_dtypes=(torch.uint8,), scale_entry=1, scale_doc="e8m0 scales", groups=(32,),
                 dequantized_in_loader=True,
                 takes_plain_weights=False, kernel_encoding="uint8 weights, uint8 scales",
                 unsupported=(_PREPARE_FIRST,)),
    WeightFormat("int4", "unsigned 4-bit values two per byte with a float scale and a zero point per group "
                 "(GPTQ, AWQ; fmoe2/quant4.py)", weight_dtypes=(torch.uint8,), element_bits=4, values_per_element=2,
                 scale_dtypes=FLOAT_SCALE_DTYPES, scale_entry=2, scale_doc="(scale, zero) pairs", groups=(32, 64, 128),
                 dequantized_in_loader=True, takes_plain_weights=False,
                 kernel_encoding="uint8 weights, (scale, zero) float pairs",
                 unsupported=(_PREPARE_FIRST,)),
    WeightFormat("int8", "symmetric int8 values with a float scale per output channel or per group of columns "
                 "(w8a16, vLLM's int8_w8a16; fmoe2/int8.py)", weight_dtypes=(torch.int8,), element_bits=8,
                 scale_dtypes=FLOAT_SCALE_DTYPES, scale_entry=1, scale_doc="scales", groups=(32, 64, 128),
                 dequantized_in_loader=True, takes_plain_weights=False, kernel_encoding="int8 weights, float scales",
                 unsupported=(_PREPARE_FIRST,)),
)}

# The weight-only formats' names (dequantized in the 16-bit entries' loader): each has its own tuned section and its
# least K step (gemm/config.py) and is a choice of python -m fmoe2.tune --weights.
WEIGHT_ONLY_FORMATS = tuple(name for name, fmt in WEIGHT_FORMATS.items() if fmt.weight_only)

# Formats prepare_weights cannot tell from the weights' dtype: it must be told (uint8 holds mxfp4 or int4, whose
# scales may even share a dtype: e8m0 scales cast to fp16 would read as int4 group scales).
AMBIGUOUS_DTYPES = {torch.uint8: ("mxfp4", "int4")}


def weight_format(name) -> WeightFormat:
    """The format named ``name`` (a :class:`WeightFormat` passes through); ValueError naming the known ones."""
    if isinstance(name, WeightFormat):
        return name
    if not isinstance(name, str) or name not in WEIGHT_FORMATS:
        raise ValueError(f"weight_format must be one of {sorted(WEIGHT_FORMATS)}, got {name!r}")
    return WEIGHT_FORMATS[name]


def format_of_weights(w: torch.Tensor, stated: Optional[str] = None, what: str = "w1") -> WeightFormat:
    """The format of weights ``w`` handed to :func:`fmoe2.prepare_weights`: ``stated`` (checked against ``w``'s
    dtype), or the one format stored in ``w``'s dtype. uint8 weights hold mxfp4 or int4: their format must be
    stated (never guessed from the scales' dtype)."""
    if stated is not None:
        fmt = weight_format(stated)
        if w.dtype not in fmt.weight_dtypes:
            raise TypeError(f"{what} of weight_format={fmt.name!r} must have a dtype in {fmt.weight_dtypes}, got "
                            f"{w.dtype}")
        return fmt
    if w.dtype in AMBIGUOUS_DTYPES:
        names = AMBIGUOUS_DTYPES[w.dtype]
        raise ValueError(f"{what} is {w.dtype}, which holds any of {names}: say which with weight_format= "
                         f"({', '.join(repr(n) for n in names)})")
    return plain_format(w, what)


def plain_format(w: torch.Tensor, what: str = "w1") -> WeightFormat:
    """The format of weights of dtype ``w.dtype`` stored one value per element (16-bit, fp8, int8)."""
    for fmt in WEIGHT_FORMATS.values():
        if w.dtype in fmt.weight_dtypes and w.dtype not in AMBIGUOUS_DTYPES:
            return fmt
    known = sorted({str(d) for f in WEIGHT_FORMATS.values() for d in f.weight_dtypes})
    raise TypeError(f"{what} has dtype {w.dtype}, which is no weight format's ({', '.join(known)})")


def check_not_prepare_only(what: str, w) -> None:
    """A TypeError where plain weights ``w`` (handed to ``fused_moe`` unprepared) are of a format that must be
    prepared first (the weight-only ones: the kernels read their prepared layout only)."""
    if not isinstance(w, torch.Tensor):
        return
    names = [f.name for f in WEIGHT_FORMATS.values() if w.dtype in f.weight_dtypes and not f.takes_plain_weights]
    if names:
        raise TypeError(f"{what} is {w.dtype} ({' or '.join(names)} weights): these are prepared once at load time, "
                        f"fmoe2.prepare_weights(w1, w2, w1_scale=..., w2_scale=..., weight_format="
                        f"{names[0]!r}), and passed as w1 with w2=None")


def format_of_prepared(w13: torch.Tensor, s13: Optional[torch.Tensor]) -> WeightFormat:
    """The format of tensors that :func:`fmoe2.prepare_weights` made (``w13`` and its scales ``s13``), for
    prepared weights rebuilt from them without their stated format (the torch.library op carries tensors only).
    Prepared layouts differ where checkpoints' do not: int4's scales are (scale, zero) pairs ``[..., 2]``, mxfp4's
    uint8; the result is checked against the tensors by :func:`check_prepared_tensors` all the same."""
    if w13.dtype in AMBIGUOUS_DTYPES:
        mxfp4 = s13 is not None and s13.dtype == torch.uint8
        return WEIGHT_FORMATS["mxfp4" if mxfp4 else "int4"]
    return plain_format(w13, "w13")


def check_prepared_tensors(fmt: WeightFormat, w13: torch.Tensor, s13: Optional[torch.Tensor],
                           scale_block: Optional[Tuple[int, int]]) -> None:
    """Checks that prepared weights ``w13`` with scales ``s13`` are stored as ``fmt`` stores them (the weights'
    dtype, the scales' dtype and trailing dimension): a format stated wrongly, or scales of another format (mxfp4's
    e8m0 scales cast to fp16 are not int4 group scales), fail here with a ValueError."""
    if w13.dtype not in fmt.weight_dtypes:
        raise ValueError(f"prepared {fmt.name} weights are stored in {fmt.weight_dtypes}; w13 is {w13.dtype}")
    if not fmt.scale_dtypes:
        if s13 is not None:
            raise ValueError(f"prepared {fmt.name} weights take no scales; s13 is given")
        return
    if s13 is None:
        raise ValueError(f"prepared {fmt.name} weights need their scales (s13, s2)")
    if s13.dtype not in fmt.scale_dtypes:
        raise ValueError(f"prepared {fmt.name} weights' scales are {fmt.scale_dtypes}; s13 is {s13.dtype}")
    if fmt.weight_only:
        tail = fmt.scale_tail
        if s13.dim() != 3 + len(tail) or tuple(s13.shape[3:]) != tail:
            raise ValueError(f"prepared {fmt.name} weights' scales are [E, 2*I_pad, K_pad // group"
                             f"{''.join(f', {d}' for d in tail)}]; s13 has shape {tuple(s13.shape)}")
        if scale_block is None or scale_block[0] != 1:
            raise ValueError(f"prepared {fmt.name} weights have scale_block (1, group); got {scale_block}")
        fmt.check_group(scale_block[1], "prepared weights")


__all__ = ["WeightFormat", "WEIGHT_FORMATS", "WEIGHT_ONLY_FORMATS", "weight_format", "format_of_weights", "plain_format",
           "check_not_prepare_only", "format_of_prepared", "check_prepared_tensors"]
