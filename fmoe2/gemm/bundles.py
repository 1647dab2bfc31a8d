"""Typed bundles of kernel values: the entry kernels build them from their parameters, the ``@triton.jit`` helpers read
them by field name (``w2.stride_n``), so a helper takes a few bundles instead of dozens of loose pointers and
strides. They are ``NamedTuple``s, which Triton compiles to the same code as the loose values (checked when the
helpers took them: the sm_90 and gfx942 code of every launch the code-generation report builds came out the same,
but one compare with its operands swapped on gfx942) and the interpreter runs as Python tuples. Fields that are None
(no bias, 16-bit weights without scales, no descriptor) stay compile-time None, so ``if w.bias_ptr is not None``
still compiles the branch out. Constexprs stay separate parameters (a constexpr in a bundle passed to a helper is a
runtime value to it).

Some are kernel arguments too (the launches build them: ``launches.py``, ``fp8_weights.py``, the sort's x
quantization): :class:`ExpertWeights` (without its descriptor), :class:`Fp8Weights`, :class:`AdapterWeights` (and the
sort's ``XQuantization``). Triton's JIT types a tuple argument element by element, as it types loose ones (a stride
of 1 and a None field become constexprs, ints divisible by 16 get the hint), so the compiled code is that of the
loose arguments. Tensor descriptors stay parameters of their own: Triton's launchers unpack descriptors only at
the top level of the argument list. A parameter the JIT must not specialise (``do_not_specialize``, such as the
sort's program counts) stays loose too: Triton 3.6 and 3.9 specialise a tuple's elements whatever the flag says,
so a bundled count would compile once per value class (1, a multiple of 16, other).
"""
from typing import Any, NamedTuple


class ExpertWeights(NamedTuple):
    """One weight operand of the expert GEMMs, ``[E, N(_pad), K(_pad)]``: N the GEMM's output columns (2I for
    gate/up, H for down), K its reduction (H for gate/up, I for down). As a kernel argument its ``desc`` is None:
    the entry builds the bundle again with its descriptor parameter, ``ExpertWeights(w.ptr, desc, *w[2:])``, in
    its own body (a jit function that returns a bundle with a None field fails to compile on Triton 3.6)."""

    ptr: Any  # the weights: 16-bit, or the packed bytes of weight-only quantized ones
    desc: Any  # None, or a tensor descriptor of the weights viewed [E * N_pad, K_pad]
    scale_ptr: Any  # None (16-bit), or the weight-only formats' group scales, laid out like the packed rows
    bias_ptr: Any  # None, or the bias [E, N(_pad)]
    stride_e: Any
    stride_n: Any
    stride_k: Any
    stride_bias_e: Any


class Fp8Weights(NamedTuple):
    """fp8 expert weights ``[E, N, K]`` with their float32 scales ``[E, Sn, Sk]`` in the checkpoint's row order
    (block, channel or tensor scales: a stride is 0 along a dimension of size 1; ``fp8_weights.py``)."""

    ptr: Any
    scale_ptr: Any
    bias_ptr: Any  # None, or the bias [E, N]
    stride_e: Any
    stride_n: Any
    stride_k: Any
    stride_scale_e: Any
    stride_scale_n: Any
    stride_scale_k: Any
    stride_bias_e: Any


class ExpertOperand(NamedTuple):
    """One expert's weights as a K loop of ``operands.py`` reads them: rows ``stride_n`` apart (for packed
    weight-only formats, the packed row's length in bytes), columns ``stride_k`` apart, or through ``desc``."""

    ptr: Any  # the expert's weights: ExpertWeights.ptr + expert * stride_e
    stride_n: Any
    stride_k: Any
    desc: Any  # None (pointer loads), or a tensor descriptor of all experts' weights
    desc_row0: Any  # the first descriptor row of the expert's (and slice's) tile: descriptor loads only
    scale_ptr: Any  # None (16-bit), or the expert's group scales (``operands._expert_scales``)
    stride_scale_n: Any


class Stage2Tile(NamedTuple):
    """What a stage-2 program computes (``grouped_gemm_kernel._stage2_program``): its tile's expert and rows
    (from ``first_row``: ``offs_m``, their ids and which are real) and its block of output columns, over its share
    of K ``[k_first, k_end)``."""

    expert: Any
    n_block: Any
    k_first: Any
    k_end: Any
    first_row: Any
    offs_m: Any
    row_id: Any
    row_valid: Any
    offs_n: Any
    n_valid: Any


class DownDeltas(NamedTuple):
    """Stage 2's LoRA down deltas (``grouped_gemm_kernel.py``): stage 1's partial shrinks of the rows and the
    adapters' ``B2t`` they are expanded with. ``shrink_ptr`` None: no adapters (compiled out)."""

    token_lora_ids_ptr: Any  # [M] int32 adapter per token, -1 = none
    shrink_ptr: Any  # [num_shrink_splits, num_grid_tiles * BLOCK_M, LORA_RANK] fp32: stage 1's partial shrinks
    b2t_ptr: Any  # B2t [L, E, LORA_RANK, N_pad]
    scaling_ptr: Any  # [L] float32
    num_lora_tokens_ptr: Any  # [1] int32: tokens with an adapter (from the sort)
    num_loras: Any
    num_shrink_splits: Any  # I slices of stage 1
    stride_shrink_split: Any
    stride_b2t_l: Any
    stride_b2t_e: Any
    stride_b2t_r: Any


class AdapterWeights(NamedTuple):
    """A stacked LoRA operand ``[L, E, R, columns]`` as a kernel argument (``launches.py``): A13, B13t, A2 or B2t
    of ``fmoe2.gemm.lora.PreparedMoELoRA``."""

    ptr: Any
    stride_l: Any  # adapter
    stride_e: Any  # expert
    stride_r: Any  # row


class AdapterRows(NamedTuple):
    """One expert's rows of a stacked LoRA operand ``[L, E, R, columns]`` (``fused_lora.py``)."""

    ptr: Any  # the expert's rows: base + expert * stride_e
    stride_l: Any
    stride_r: Any


class TileAdapters(NamedTuple):
    """The adapters of a tile's rows (``fused_lora._lora_tile``)."""

    row_slot: Any  # [BLOCK_M] each row's slot among the adapters present (-1: none)
    present: Any  # [LORA_IDS] the adapters present, by slot
    slot_of: Any  # [LORA_IDS] each adapter's slot
    num_present: Any
    row_scale: Any  # [BLOCK_M] each row's scaling (0 without an adapter)

