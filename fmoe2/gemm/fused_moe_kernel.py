"""The entry kernels of the fused path and of stage 1 of the two-stage path, one per launch the plan makes.

One program owns one tile (BLOCK_M rows of one expert) and one slice of BLOCK_N columns of the intermediate
dimension:

    acc_gate, acc_up = x[tile] @ W_gate[e, slice]^T, x[tile] @ W_up[e, slice]^T   (fp32, over all H)
    y                = act(acc_gate) * acc_up * routing_weight                     (registers)
    out[tile]       += y @ W_down[e, :, slice]^T                                   (over H in BLOCK_H chunks,
                                                                                    relaxed atomic adds)

Each output element therefore receives ``topk * ceil(I / BLOCK_N)`` atomic adds, in the output dtype or
(``FusedMoEConfig.accumulate_fp32``, the default with 16-bit outputs) into a float32 accumulator.

| entry | launch (``launches.py``) |
|---|---|
| ``_fused_kernel`` | the fused path, 16-bit weights |
| ``_fused_cast_kernel`` | the same at decode sizes, casting its float32 accumulator itself (``fused_kernel_casts``); also the one-launch decode: no sort, tile t is the token's top-k slot t (``decodes_in_one_launch``) |
| ``_fused_lora_kernel`` | the fused path with adapters (``fused_lora.py``) |
| ``_stage1_kernel`` / ``_stage1_lora_kernel`` | stage 1: y stored in sorted row order, no down GEMM (``grouped_gemm_kernel.py`` does it) |

fp8 weights have their own entries (``fp8_weights.py``).

They are built from the shared ``@triton.jit`` parts: which rows and columns (``tiles.py``), the GEMM loops
(``operands.py``), the activation (``activations.py``), the adapters (``fused_lora.py``)
and the epilogues (``epilogues.py``). Each takes only the parameters its launch reads; a pointer a launch does
not use is None (Triton makes it a constexpr: no argument, and its branch is compiled out).

Grids: ``(num_grid_tiles * cdiv(I, BLOCK_N),)``, plus ``cdiv(M, BLOCK_M)`` programs where the kernel casts its
accumulator (they zero the output rows of tokens routed nowhere); programs past ``num_sorted_tiles`` or on a
gap tile (expert -1) exit at once (the decode's: on a dropped slot). With PDL the launch is a programmatic
dependent of the sort (CUDA sm_90+, ``grid_dependency.py``).
"""
import triton
import triton.language as tl

from ..grid_dependency import dependent_launch_prologue
from .activations import _activate
from .bundles import AdapterRows, ExpertOperand, ExpertWeights, TileAdapters
from .epilogues import _cast_rows_last_added, _store_y, _zeroes_unrouted_rows
from .fused_lora import _lora_down, _lora_gate_up, _lora_tile, _store_down_shrinks
from .operands import _add_gate_up_bias, _down_16bit, _expert_scales, _gate_up_16bit
from .tiles import (_fits_tail, _grouped_program, _kept_slots, _slice_columns, _slot_expert, _slot_rows, _sorted_rows,
                    _tile_expert)


# ---------------------------------------------------------------------------------------------
# Parts shared by the entries
# ---------------------------------------------------------------------------------------------

@triton.jit
def _gate_up_operands(x_ptr, w1_ptr, expert, token, slice_id, I, stride_x_m, stride_w1_e, stride_w1_n,
                      BLOCK_N: tl.constexpr):
    """``(offs_n, n_valid, offs_r, r_valid, x_rows, w1_expert, w13_row0)``: the slice's columns and interleaved
    rows (``_slice_columns``), the rows' x pointers [BLOCK_M, 1], the expert's w1, and the first descriptor row of
    the slice's gate/up tile (tensor-descriptor loads only)."""
    offs_n, n_valid, offs_r, r_valid = _slice_columns(slice_id, I, BLOCK_N)
    w13_row0 = (expert * (stride_w1_e // stride_w1_n)).to(tl.int32) + slice_id * (2 * BLOCK_N)
    x_rows = x_ptr + token[:, None] * stride_x_m
    return offs_n, n_valid, offs_r, r_valid, x_rows, w1_ptr + expert * stride_w1_e, w13_row0


@triton.jit
def _activated(gate, up, w1_bias_ptr, expert, stride_b1_e, route_weight, offs_n, n_valid, I, w13_desc,
               dtype: tl.constexpr, ACTIVATION: tl.constexpr, SWIGLU_ALPHA: tl.constexpr, SWIGLU_LIMIT: tl.constexpr,
               GATE_UP_INTERLEAVED: tl.constexpr):
    """The slice's intermediate from its gate and up accumulators: the gate/up bias (``w1_bias_ptr``: None or [E,
    2I(_pad)] in w1's row order), the activation and the routing weight, in ``dtype``."""
    b1_expert = None
    if w1_bias_ptr is not None:
        b1_expert = w1_bias_ptr + expert * stride_b1_e
    gate, up = _add_gate_up_bias(gate, up, b1_expert, offs_n, n_valid, I, GATE_UP_INTERLEAVED)
    y = _activate(gate, up, route_weight, dtype, ACTIVATION, SWIGLU_ALPHA, SWIGLU_LIMIT)
    if w13_desc is not None:
        # Columns past I came from padding or the next expert's rows; w2 has zeros there, but a value
        # that overflowed fp16 would still give inf * 0 = NaN in the down GEMM (the pointer path loads 0).
        y = tl.where(n_valid[None, :], y, 0.0)
    return y


@triton.jit
def _intermediate_16bit(x_ptr, stride_x_m, w1, expert, token, row_valid, route_weight, slice_id, H, I,
                        ACTIVATION: tl.constexpr, SWIGLU_ALPHA: tl.constexpr, SWIGLU_LIMIT: tl.constexpr,
                        GATE_UP_INTERLEAVED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr, WEIGHT_GROUP: tl.constexpr):
    """``(y, offs_n, n_valid)``: the slice's activated intermediate [BLOCK_M, BLOCK_N] in x's dtype, routing
    weight applied. ``w1`` (an :class:`~.bundles.ExpertWeights`): 16-bit weights (plain [E, 2I, H], gate rows then
    up rows; interleaved [E, 2*I_pad, H_pad], g0, u0, g1, u1, ...; its ``desc``: None, or a tensor descriptor of
    interleaved w1 viewed [E * 2*I_pad, H_pad], block [2*BLOCK_N, BLOCK_K]; its ``bias_ptr``: None or [E,
    2I(_pad)] in w1's row order), or prepared 4-bit weights (packed [E, 2*I_pad, H_pad // 2] uint8, its
    ``scale_ptr`` their group scales [E, 2*I_pad, ...]: ``operands._packed_weight_load``)."""
    offs_n, n_valid, offs_r, r_valid, x_rows, w1_expert, w13_row0 = _gate_up_operands(
        x_ptr, w1.ptr, expert, token, slice_id, I, stride_x_m, w1.stride_e, w1.stride_n, BLOCK_N)
    s1_expert, stride_s1_n = None, 0
    if w1.scale_ptr is not None:
        s1_expert, stride_s1_n = _expert_scales(w1.ptr, w1.scale_ptr, expert, w1.stride_e, w1.stride_n, WEIGHT_GROUP)
    w1_operand = ExpertOperand(w1_expert, w1.stride_n, w1.stride_k, w1.desc, w13_row0, s1_expert, stride_s1_n)
    gate, up, _ = _gate_up_16bit(x_rows, row_valid, w1_operand, offs_n, n_valid, offs_r, r_valid, I, H, offs_n, n_valid,
                                 BLOCK_M, BLOCK_N, BLOCK_K, GATE_UP_INTERLEAVED, WITH_LORA=False, STACK=16, STAGES=None,
                                 WEIGHT_GROUP=WEIGHT_GROUP)
    y = _activated(gate, up, w1.bias_ptr, expert, w1.stride_bias_e, route_weight, offs_n, n_valid, I, w1.desc,
                   x_ptr.dtype.element_ty, ACTIVATION, SWIGLU_ALPHA, SWIGLU_LIMIT, GATE_UP_INTERLEAVED)
    return y, offs_n, n_valid


@triton.jit
def _down_slice_16bit(y, out_rows, row_valid, w2, expert, route_weight, slice_id, offs_n, n_valid, H,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_H: tl.constexpr,
                      WEIGHT_GROUP: tl.constexpr):
    """The slice's down GEMM over all of H added into ``out_rows`` ([BLOCK_M, 1] row pointers). ``w2`` (an
    :class:`~.bundles.ExpertWeights`): 16-bit [E, H(_pad), I(_pad)] (its ``desc``: None, or a descriptor of w2
    viewed [E * H_pad, I_pad], block [BLOCK_H, BLOCK_N]), with the down bias (None or [E, H(_pad)]) added by the
    first slice, times the rows' routing weights; or 4-bit, packed [E, H_pad, I_pad // 2] with group scales."""
    b2_expert = None
    if w2.bias_ptr is not None:
        b2_expert = w2.bias_ptr + expert * w2.stride_bias_e
    w2_row0 = (expert * (w2.stride_e // w2.stride_n)).to(tl.int32)
    s2_expert, stride_s2_n = None, 0
    if w2.scale_ptr is not None:
        s2_expert, stride_s2_n = _expert_scales(w2.ptr, w2.scale_ptr, expert, w2.stride_e, w2.stride_n, WEIGHT_GROUP)
    w2_operand = ExpertOperand(w2.ptr + expert * w2.stride_e, w2.stride_n, w2.stride_k, w2.desc, w2_row0, s2_expert,
                               stride_s2_n)
    _down_16bit(y, out_rows, row_valid, w2_operand, offs_n, n_valid, H, y, offs_n, n_valid, slice_id * BLOCK_N,
                b2_expert, tl.where(slice_id == 0, route_weight, 0.0), BLOCK_M, BLOCK_H, WITH_BASE=True,
                WITH_LORA=False, STAGES=None, WEIGHT_GROUP=WEIGHT_GROUP)


@triton.jit
def _fused_program(pid, topk_ids_ptr, topk_weights_ptr, expert_map_ptr, sorted_token_ids_ptr, sorted_weights_ptr,
                   sorted_expert_ids_ptr, num_sorted_tiles_ptr, num_tokens, I, num_grid_tiles, num_global_experts,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr, TOPK: tl.constexpr,
                   NUM_EXPERTS: tl.constexpr, IDS_PER_TOKEN: tl.constexpr):
    """``(expert, slice_id, offs_m, token, row_valid, route_weight)`` of GEMM program ``pid`` (``tiles.py``); expert
    -1: nothing to do (its rows are then not loaded). Tiles are the sort's, or, without ``sorted_token_ids_ptr``
    (the one-launch decode), the token's top-k slots."""
    tile, slice_id = _grouped_program(pid, num_grid_tiles, tl.cdiv(I, BLOCK_N), GROUP_M)
    if sorted_token_ids_ptr is None:  # a dropped slot gets expert -1: no adds, and _kept_slots does not count it
        expert = _slot_expert(tile, topk_ids_ptr, expert_map_ptr, num_global_experts, TOPK, NUM_EXPERTS)
    else:
        expert = _tile_expert(tile, num_sorted_tiles_ptr, sorted_expert_ids_ptr)
    offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    token = tl.zeros([BLOCK_M], dtype=tl.int64)
    row_valid = offs_m < 0
    route_weight = tl.zeros([BLOCK_M], dtype=tl.float32)
    if expert >= 0:
        if sorted_token_ids_ptr is None:
            offs_m, token, row_valid, route_weight = _slot_rows(tile, topk_weights_ptr, BLOCK_M)
        else:
            offs_m, token, row_valid, route_weight = _sorted_rows(tile * BLOCK_M, sorted_token_ids_ptr,
                                                                  sorted_weights_ptr, num_tokens, BLOCK_M,
                                                                  IDS_PER_TOKEN)
    return expert, slice_id, offs_m, token, row_valid, route_weight


@triton.jit
def _sorted_program(pid, sorted_token_ids_ptr, sorted_weights_ptr, sorted_expert_ids_ptr, num_sorted_tiles_ptr,
                    num_tokens, I, num_grid_tiles, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr,
                    IDS_PER_TOKEN: tl.constexpr):
    """:func:`_fused_program` of a launch whose tiles are always the sort's (every launch but the one that may run
    the one-launch decode)."""
    return _fused_program(pid, topk_ids_ptr=None, topk_weights_ptr=None, expert_map_ptr=None,
                          sorted_token_ids_ptr=sorted_token_ids_ptr, sorted_weights_ptr=sorted_weights_ptr,
                          sorted_expert_ids_ptr=sorted_expert_ids_ptr, num_sorted_tiles_ptr=num_sorted_tiles_ptr,
                          num_tokens=num_tokens, I=I, num_grid_tiles=num_grid_tiles, num_global_experts=None,
                          BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, GROUP_M=GROUP_M, TOPK=1, NUM_EXPERTS=1,
                          IDS_PER_TOKEN=IDS_PER_TOKEN)


@triton.jit
def _expected_adds(final_out_ptr, topk_ids_ptr, expert_map_ptr, token, row_valid, num_global_experts, I,
                   BLOCK_N: tl.constexpr, TOPK: tl.constexpr, NUM_EXPERTS: tl.constexpr):
    """Where the kernel casts its accumulator (``final_out_ptr`` given): the adds each row's token gets, its kept
    slots times the slices ([BLOCK_M] int32; loaded before the GEMM loops, whose time hides it); else 0."""
    expected = 0
    if final_out_ptr is not None:
        expected = _kept_slots(topk_ids_ptr, expert_map_ptr, token, row_valid, num_global_experts, TOPK,
                               NUM_EXPERTS) * tl.cdiv(I, BLOCK_N)
    return expected


# ---------------------------------------------------------------------------------------------
# The fused path: 16-bit weights
# ---------------------------------------------------------------------------------------------

@triton.jit
def _fused_kernel(
    x_ptr,
    # ExpertWeights without their descriptors (see _intermediate_16bit, _down_slice_16bit): their scale_ptr None, or
    # the group scales of prepared 4-bit weights (fmoe2/quant4.py)
    w1, w2,
    w13_desc, w2_desc,  # None, or tensor descriptors of w1 and w2
    out_ptr,  # [M, H], zeroed by the sort launch, receives atomic adds
    sorted_token_ids_ptr,  # [max_num_tiles * BLOCK_M] int32, padding = M
    sorted_weights_ptr,  # [max_num_tiles * BLOCK_M] fp32, padding = 0
    sorted_expert_ids_ptr,  # [max_num_tiles] int32
    num_sorted_tiles_ptr,  # [1] int32, tiles in use
    num_tokens, H, I,  # M, hidden and intermediate sizes (logical)
    num_grid_tiles,  # tiles the grid was sized for (>= any num_sorted_tiles)
    stride_x_m, stride_out_m,
    ACTIVATION: tl.constexpr, SWIGLU_ALPHA: tl.constexpr, SWIGLU_LIMIT: tl.constexpr,
    GATE_UP_INTERLEAVED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_H: tl.constexpr, GROUP_M: tl.constexpr, PDL: tl.constexpr,
    WEIGHT_GROUP: tl.constexpr,  # K columns per scale of 4-bit weights (unused with 16-bit ones)
):
    dependent_launch_prologue(PDL)  # with PDL: the next launch may start; wait for the sort's results
    expert, slice_id, offs_m, token, row_valid, route_weight = _sorted_program(
        tl.program_id(0), sorted_token_ids_ptr, sorted_weights_ptr, sorted_expert_ids_ptr, num_sorted_tiles_ptr,
        num_tokens, I, num_grid_tiles, BLOCK_M, BLOCK_N, GROUP_M, IDS_PER_TOKEN=1)
    if expert >= 0:
        # (the descriptors into the bundles, built here: a jit function returning a None field fails on Triton 3.6)
        _fused_tile_16bit(x_ptr, stride_x_m, ExpertWeights(w1.ptr, w13_desc, *w1[2:]),
                          ExpertWeights(w2.ptr, w2_desc, *w2[2:]),
                          out_ptr + token[:, None] * stride_out_m, expert, slice_id, token, row_valid, route_weight, H,
                          I, ACTIVATION, SWIGLU_ALPHA, SWIGLU_LIMIT, GATE_UP_INTERLEAVED, BLOCK_M, BLOCK_N, BLOCK_K,
                          BLOCK_H, WEIGHT_GROUP)


@triton.jit
def _fused_tile_16bit(x_ptr, stride_x_m, w1, w2, out_rows, expert, slice_id, token, row_valid, route_weight, H, I,
                      ACTIVATION: tl.constexpr, SWIGLU_ALPHA: tl.constexpr, SWIGLU_LIMIT: tl.constexpr,
                      GATE_UP_INTERLEAVED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_K: tl.constexpr, BLOCK_H: tl.constexpr, WEIGHT_GROUP: tl.constexpr):
    """One program's whole fused forward from 16-bit (or prepared 4-bit) weights ``w1`` and ``w2``
    (:class:`~.bundles.ExpertWeights`): gate/up, activation, down added into ``out_rows``."""
    y, offs_n, n_valid = _intermediate_16bit(x_ptr, stride_x_m, w1, expert, token, row_valid, route_weight, slice_id,
                                             H, I, ACTIVATION, SWIGLU_ALPHA, SWIGLU_LIMIT, GATE_UP_INTERLEAVED,
                                             BLOCK_M, BLOCK_N, BLOCK_K, WEIGHT_GROUP)
    _down_slice_16bit(y, out_rows, row_valid, w2, expert, route_weight, slice_id, offs_n, n_valid, H, BLOCK_M,
                      BLOCK_N, BLOCK_H, WEIGHT_GROUP)


@triton.jit
def _fused_cast_kernel(
    x_ptr, w1, w2, w13_desc, w2_desc,  # as _fused_kernel's
    out_ptr,  # the float32 accumulator [M, H] followed by M int32 add counters, zero (the sort's, or a kept one)
    final_out_ptr,  # [M, H] in x's dtype: each row cast there by the program that adds into it last
    topk_ids_ptr,  # [M * TOPK] int32/int64: each row's expected adds are its kept slots times the slices
    topk_weights_ptr,  # None, or (the one-launch decode) [TOPK] float32/bf16/fp16
    expert_map_ptr,  # None or [num_global_experts] int32
    sorted_token_ids_ptr, sorted_weights_ptr, sorted_expert_ids_ptr, num_sorted_tiles_ptr,  # None for the decode
    num_tokens, H, I, num_grid_tiles, num_global_experts,
    stride_x_m, stride_out_m, stride_final_m,
    ACTIVATION: tl.constexpr, SWIGLU_ALPHA: tl.constexpr, SWIGLU_LIMIT: tl.constexpr,
    GATE_UP_INTERLEAVED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_H: tl.constexpr, GROUP_M: tl.constexpr, PDL: tl.constexpr, TOPK: tl.constexpr, NUM_EXPERTS: tl.constexpr,
    WEIGHT_GROUP: tl.constexpr,
):
    """``_fused_kernel`` into a float32 accumulator that it casts itself (``epilogues.py``). Its tiles are the
    sort's, or, for the one-launch decode (no sort launch before it, so no PDL), the one token's top-k slots (tile
    t: slot t, expert and weight read from topk_ids and topk_weights); the decode's accumulator is a kept one, which
    the last adder leaves zeroed with its counter."""
    dependent_launch_prologue(PDL)
    if _zeroes_unrouted_rows(final_out_ptr, topk_ids_ptr, expert_map_ptr, num_tokens, H, I, num_grid_tiles,
                             num_global_experts, stride_final_m, BLOCK_M, BLOCK_N, BLOCK_H, TOPK, NUM_EXPERTS):
        return  # (programs after the GEMM programs)
    expert, slice_id, offs_m, token, row_valid, route_weight = _fused_program(tl.program_id(0), topk_ids_ptr,
        topk_weights_ptr, expert_map_ptr, sorted_token_ids_ptr, sorted_weights_ptr, sorted_expert_ids_ptr,
        num_sorted_tiles_ptr, num_tokens, I, num_grid_tiles, num_global_experts, BLOCK_M, BLOCK_N, GROUP_M, TOPK,
        NUM_EXPERTS, IDS_PER_TOKEN=1)
    if expert >= 0:
        expected_adds = _expected_adds(final_out_ptr, topk_ids_ptr, expert_map_ptr, token, row_valid,
                                       num_global_experts, I, BLOCK_N, TOPK, NUM_EXPERTS)
        # (the descriptors into the bundles, built here: a jit function returning a None field fails on Triton 3.6)
        _fused_tile_16bit(x_ptr, stride_x_m, ExpertWeights(w1.ptr, w13_desc, *w1[2:]),
                          ExpertWeights(w2.ptr, w2_desc, *w2[2:]),
                          out_ptr + token[:, None] * stride_out_m, expert, slice_id, token, row_valid, route_weight, H,
                          I, ACTIVATION, SWIGLU_ALPHA, SWIGLU_LIMIT, GATE_UP_INTERLEAVED, BLOCK_M, BLOCK_N, BLOCK_K,
                          BLOCK_H, WEIGHT_GROUP)
        _cast_rows_last_added(out_ptr, final_out_ptr, token, row_valid, expected_adds, num_tokens, H, stride_out_m,
                              stride_final_m, BLOCK_M, BLOCK_H, sorted_token_ids_ptr is None)


# ---------------------------------------------------------------------------------------------
# The fused path with adapters, and with fp8 weights
# ---------------------------------------------------------------------------------------------

@triton.jit
def _fused_lora_kernel(
    x_ptr, w1, w2, w13_desc, w2_desc, out_ptr,  # as _fused_kernel's
    final_out_ptr, topk_ids_ptr, expert_map_ptr,  # None, or as _fused_cast_kernel's (the kernel casts out_ptr)
    token_lora_ids_ptr,  # [M] int32 adapter per token, -1 = none
    # The adapters' operands (AdapterWeights):
    lora_a13,  # [L, E, 2*LORA_RANK, H_pad]: gate A rows then up A rows
    lora_b13,  # [L, E, 2*LORA_RANK, I_pad]: gate B^T rows then up B^T rows
    lora_a2,  # [L, E, LORA_RANK, I_pad]
    lora_b2,  # [L, E, LORA_RANK, H_pad]: down B^T
    lora_scaling_ptr,  # [L] float32
    num_lora_tokens_ptr,  # [1] int32: tokens with an adapter, counted by the sort
    sorted_token_ids_ptr, sorted_weights_ptr, sorted_expert_ids_ptr, num_sorted_tiles_ptr,
    num_tokens, H, I, num_grid_tiles, num_loras, num_global_experts,
    stride_x_m, stride_out_m, stride_final_m,
    ACTIVATION: tl.constexpr, SWIGLU_ALPHA: tl.constexpr, SWIGLU_LIMIT: tl.constexpr,
    GATE_UP_INTERLEAVED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_H: tl.constexpr, GROUP_M: tl.constexpr, PDL: tl.constexpr, TOPK: tl.constexpr, NUM_EXPERTS: tl.constexpr,
    LORA_RANK: tl.constexpr,  # padded rank (power of two >= 16)
    LORA_IDS: tl.constexpr,  # next_pow2(num_loras)
    LORA_SLOTS: tl.constexpr,  # adapters of one tile stacked into one operand (power of two <= LORA_IDS)
    LORA_STAGES: tl.constexpr,  # pipeline depth of the loops that carry adapter work (tiles without: num_stages)
    WEIGHT_GROUP: tl.constexpr,
):
    """The fused path with multi-LoRA (``fused_lora.py``). Tiles without adapters branch at run time to the
    plain loops; in a batch without any (the sort's ``num_lora_tokens`` is 0) no program loads its rows'
    adapter ids."""
    STACK: tl.constexpr = LORA_SLOTS * LORA_RANK
    dependent_launch_prologue(PDL)
    # Loaded with the tile's expert id: a batch without adapters then goes to the plain loops without waiting
    # for its rows' adapter ids.
    batch_has_lora = tl.load(num_lora_tokens_ptr) > 0
    if final_out_ptr is not None:  # (programs after the GEMM programs)
        if _zeroes_unrouted_rows(final_out_ptr, topk_ids_ptr, expert_map_ptr, num_tokens, H, I, num_grid_tiles,
                                 num_global_experts, stride_final_m, BLOCK_M, BLOCK_N, BLOCK_H, TOPK, NUM_EXPERTS):
            return
    expert, slice_id, offs_m, token, row_valid, route_weight = _sorted_program(
        tl.program_id(0), sorted_token_ids_ptr, sorted_weights_ptr, sorted_expert_ids_ptr, num_sorted_tiles_ptr,
        num_tokens, I, num_grid_tiles, BLOCK_M, BLOCK_N, GROUP_M, IDS_PER_TOKEN=1)
    if expert < 0:
        return
    offs_n, n_valid, offs_r, r_valid, x_rows, w1_expert, w13_row0 = _gate_up_operands(
        x_ptr, w1.ptr, expert, token, slice_id, I, stride_x_m, w1.stride_e, w1.stride_n, BLOCK_N)
    row_lora, row_slot, present, slot_of, num_present, row_scale = _lora_tile(
        token_lora_ids_ptr, lora_scaling_ptr, token, row_valid, num_loras, batch_has_lora, LORA_IDS,
        (LORA_SLOTS == 1) and (LORA_RANK * BLOCK_N <= 2048))
    adapters = TileAdapters(row_slot, present, slot_of, num_present, row_scale)
    s1_expert, stride_s1_n = None, 0
    if w1.scale_ptr is not None:
        s1_expert, stride_s1_n = _expert_scales(w1.ptr, w1.scale_ptr, expert, w1.stride_e, w1.stride_n, WEIGHT_GROUP)
    w1_operand = ExpertOperand(w1_expert, w1.stride_n, w1.stride_k, w13_desc, w13_row0, s1_expert, stride_s1_n)
    if num_present == 0:  # run-time branch: tiles without adapters run the plain loops
        gate, up, _ = _gate_up_16bit(x_rows, row_valid, w1_operand, offs_n, n_valid, offs_r, r_valid, I, H, offs_n,
                                     n_valid, BLOCK_M, BLOCK_N, BLOCK_K, GATE_UP_INTERLEAVED, WITH_LORA=False, STACK=16,
                                     STAGES=None, WEIGHT_GROUP=WEIGHT_GROUP)
        la2 = tl.zeros([STACK, BLOCK_N], x_ptr.dtype.element_ty)  # (a value leaves a run-time if from both sides)
    else:
        a13 = AdapterRows(lora_a13.ptr + expert * lora_a13.stride_e, lora_a13.stride_l, lora_a13.stride_r)
        b13 = AdapterRows(lora_b13.ptr + expert * lora_b13.stride_e, lora_b13.stride_l, lora_b13.stride_r)
        a2 = AdapterRows(lora_a2.ptr + expert * lora_a2.stride_e, lora_a2.stride_l, lora_a2.stride_r)
        gate, up, la2 = _lora_gate_up(x_rows, row_valid, w1_operand, offs_n, n_valid, offs_r, r_valid, I, H, a13, b13,
                                      a2, adapters, BLOCK_M, BLOCK_N, BLOCK_K, GATE_UP_INTERLEAVED, LORA_RANK,
                                      LORA_IDS, LORA_SLOTS, LORA_STAGES, WEIGHT_GROUP)
    y = _activated(gate, up, w1.bias_ptr, expert, w1.stride_bias_e, route_weight, offs_n, n_valid, I, w13_desc,
                   x_ptr.dtype.element_ty, ACTIVATION, SWIGLU_ALPHA, SWIGLU_LIMIT, GATE_UP_INTERLEAVED)
    expected_adds = _expected_adds(final_out_ptr, topk_ids_ptr, expert_map_ptr, token, row_valid, num_global_experts,
                                   I, BLOCK_N, TOPK, NUM_EXPERTS)  # before the down loop, whose time hides it
    out_rows = out_ptr + token[:, None] * stride_out_m
    if num_present == 0:
        _down_slice_16bit(y, out_rows, row_valid, ExpertWeights(w2.ptr, w2_desc, *w2[2:]), expert, route_weight,
                          slice_id, offs_n, n_valid, H, BLOCK_M, BLOCK_N, BLOCK_H, WEIGHT_GROUP)
    else:
        b2_expert = None
        if w2.bias_ptr is not None:
            b2_expert = w2.bias_ptr + expert * w2.stride_bias_e
        s2_expert, stride_s2_n = None, 0
        if w2.scale_ptr is not None:
            s2_expert, stride_s2_n = _expert_scales(w2.ptr, w2.scale_ptr, expert, w2.stride_e, w2.stride_n,
                                                    WEIGHT_GROUP)
        w2_operand = ExpertOperand(w2.ptr + expert * w2.stride_e, w2.stride_n, w2.stride_k, w2_desc,
                                   (expert * (w2.stride_e // w2.stride_n)).to(tl.int32), s2_expert, stride_s2_n)
        a2 = AdapterRows(lora_a2.ptr + expert * lora_a2.stride_e, lora_a2.stride_l, lora_a2.stride_r)
        b2t = AdapterRows(lora_b2.ptr + expert * lora_b2.stride_e, lora_b2.stride_l, lora_b2.stride_r)
        _lora_down(y, la2, out_rows, row_valid, w2_operand, offs_n, n_valid, H, slice_id * BLOCK_N, b2_expert,
                   tl.where(slice_id == 0, route_weight, 0.0), a2, b2t, adapters, BLOCK_M, BLOCK_N, BLOCK_H, LORA_RANK,
                   LORA_IDS, LORA_SLOTS, LORA_STAGES, WEIGHT_GROUP)
    if final_out_ptr is not None:
        _cast_rows_last_added(out_ptr, final_out_ptr, token, row_valid, expected_adds, num_tokens, H, stride_out_m,
                              stride_final_m, BLOCK_M, BLOCK_H, RESET=False)


# ---------------------------------------------------------------------------------------------
# Stage 1 of the two-stage path: y stored in sorted row order
# ---------------------------------------------------------------------------------------------

@triton.jit
def _stage1_kernel(
    x_ptr, w1, w13_desc,  # as _fused_kernel's
    y_ptr,  # [num_grid_tiles * BLOCK_M, I]: activated, weighted intermediate in sorted row order
    sorted_token_ids_ptr, sorted_weights_ptr, sorted_expert_ids_ptr, num_sorted_tiles_ptr,
    num_tokens, H, I, num_grid_tiles,
    stride_x_m, stride_y_m,
    ACTIVATION: tl.constexpr, SWIGLU_ALPHA: tl.constexpr, SWIGLU_LIMIT: tl.constexpr,
    GATE_UP_INTERLEAVED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, PDL: tl.constexpr,
    # Sorted ids are token * IDS_PER_TOKEN + slot where > 1: the deterministic mode's (its stage 2 then stores
    # one row per (token, slot), fmoe2/gemm/combine_kernel.py)
    IDS_PER_TOKEN: tl.constexpr,
    WEIGHT_GROUP: tl.constexpr,
    # A tile whose real rows fit in its first TAIL_M computes and stores those rows only (0: never; tiles.
    # _fits_tail). Its other rows of y are left unwritten: stage 2 masks those rows' results.
    TAIL_M: tl.constexpr,
):
    dependent_launch_prologue(PDL)
    expert, slice_id, offs_m, token, row_valid, route_weight = _sorted_program(
        tl.program_id(0), sorted_token_ids_ptr, sorted_weights_ptr, sorted_expert_ids_ptr, num_sorted_tiles_ptr,
        num_tokens, I, num_grid_tiles, BLOCK_M, BLOCK_N, GROUP_M, IDS_PER_TOKEN)
    if expert < 0:
        return
    w1 = ExpertWeights(w1.ptr, w13_desc, *w1[2:])
    if TAIL_M > 0 and _fits_tail(row_valid, TAIL_M):
        tile, _ = _grouped_program(tl.program_id(0), num_grid_tiles, tl.cdiv(I, BLOCK_N), GROUP_M)
        tail_m, tail_token, tail_valid, tail_weight = _sorted_rows(tile * BLOCK_M, sorted_token_ids_ptr,
                                                                   sorted_weights_ptr, num_tokens, TAIL_M,
                                                                   IDS_PER_TOKEN)
        _stage1_rows(x_ptr, stride_x_m, w1, y_ptr, stride_y_m, expert, slice_id, tail_m, tail_token, tail_valid,
                     tail_weight, H, I, ACTIVATION, SWIGLU_ALPHA, SWIGLU_LIMIT, GATE_UP_INTERLEAVED, TAIL_M, BLOCK_N,
                     BLOCK_K, WEIGHT_GROUP)
    else:
        _stage1_rows(x_ptr, stride_x_m, w1, y_ptr, stride_y_m, expert, slice_id, offs_m, token, row_valid,
                     route_weight, H, I, ACTIVATION, SWIGLU_ALPHA, SWIGLU_LIMIT, GATE_UP_INTERLEAVED, BLOCK_M, BLOCK_N,
                     BLOCK_K, WEIGHT_GROUP)


@triton.jit
def _stage1_rows(x_ptr, stride_x_m, w1, y_ptr, stride_y_m, expert, slice_id, offs_m, token, row_valid, route_weight,
                 H, I, ACTIVATION: tl.constexpr, SWIGLU_ALPHA: tl.constexpr, SWIGLU_LIMIT: tl.constexpr,
                 GATE_UP_INTERLEAVED: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 WEIGHT_GROUP: tl.constexpr):
    """Stage 1 of ROWS sorted rows (``offs_m`` and their tokens, validity and routing weights) and one I slice of
    ``w1`` (an :class:`~.bundles.ExpertWeights`): y stored at the rows."""
    y, offs_n, n_valid = _intermediate_16bit(x_ptr, stride_x_m, w1, expert, token, row_valid, route_weight, slice_id,
                                             H, I, ACTIVATION, SWIGLU_ALPHA, SWIGLU_LIMIT, GATE_UP_INTERLEAVED, ROWS,
                                             BLOCK_N, BLOCK_K, WEIGHT_GROUP)
    _store_y(y, y_ptr + offs_m.to(tl.int64)[:, None] * stride_y_m + offs_n[None, :], n_valid, y_scale_rows=None,
             slice_id=slice_id)


@triton.jit
def _stage1_lora_kernel(
    x_ptr, w1, w13_desc, y_ptr,
    token_lora_ids_ptr, lora_a13, lora_b13, lora_a2, lora_scaling_ptr,  # as _fused_lora_kernel's
    num_lora_tokens_ptr,
    # Either the gate/up deltas _lora_expand_kernel wrote, [num_grid_tiles * BLOCK_M, >= 2*I] (gate then up per
    # sorted row; the adapter operands above are then None), or None: the deltas are computed here and each slice's
    # down shrinks stored into lora_shrink2 [cdiv(I, BLOCK_N), num_grid_tiles * BLOCK_M, LORA_RANK] fp32
    lora_delta13_ptr, lora_shrink2_ptr,
    sorted_token_ids_ptr, sorted_weights_ptr, sorted_expert_ids_ptr, num_sorted_tiles_ptr,
    num_tokens, H, I, num_grid_tiles, num_loras,
    stride_x_m, stride_y_m, stride_delta13_m, stride_shrink2_split,
    ACTIVATION: tl.constexpr, SWIGLU_ALPHA: tl.constexpr, SWIGLU_LIMIT: tl.constexpr,
    GATE_UP_INTERLEAVED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, PDL: tl.constexpr, IDS_PER_TOKEN: tl.constexpr,
    LORA_RANK: tl.constexpr, LORA_IDS: tl.constexpr, LORA_SLOTS: tl.constexpr, LORA_STAGES: tl.constexpr,
    WEIGHT_GROUP: tl.constexpr,
):
    """Stage 1 with multi-LoRA: adding the deltas the LoRA launches made ready (``lora_kernel.py`` says why), or,
    at decode sizes (``lora_in_stages`` in ``fmoe2/gemm/config.py``; always in deterministic mode), computing them
    in its own loops as the fused path does and storing each row's down shrink of its slice, ``y_slice @
    A2[adapter, :, slice]^T``, which stage 2 sums over the slices and expands (``grouped_gemm_kernel.py``)."""
    STACK: tl.constexpr = LORA_SLOTS * LORA_RANK
    dependent_launch_prologue(PDL)
    batch_has_lora = tl.load(num_lora_tokens_ptr) > 0
    expert, slice_id, offs_m, token, row_valid, route_weight = _sorted_program(
        tl.program_id(0), sorted_token_ids_ptr, sorted_weights_ptr, sorted_expert_ids_ptr, num_sorted_tiles_ptr,
        num_tokens, I, num_grid_tiles, BLOCK_M, BLOCK_N, GROUP_M, IDS_PER_TOKEN)
    if expert < 0:
        return
    offs_n, n_valid, offs_r, r_valid, x_rows, w1_expert, w13_row0 = _gate_up_operands(
        x_ptr, w1.ptr, expert, token, slice_id, I, stride_x_m, w1.stride_e, w1.stride_n, BLOCK_N)
    s1_expert, stride_s1_n = None, 0
    if w1.scale_ptr is not None:
        s1_expert, stride_s1_n = _expert_scales(w1.ptr, w1.scale_ptr, expert, w1.stride_e, w1.stride_n, WEIGHT_GROUP)
    w1_operand = ExpertOperand(w1_expert, w1.stride_n, w1.stride_k, w13_desc, w13_row0, s1_expert, stride_s1_n)
    if lora_delta13_ptr is not None:
        gate, up, _ = _gate_up_16bit(x_rows, row_valid, w1_operand, offs_n, n_valid, offs_r, r_valid, I, H, offs_n,
                                     n_valid, BLOCK_M, BLOCK_N, BLOCK_K, GATE_UP_INTERLEAVED, WITH_LORA=False, STACK=16,
                                     STAGES=None, WEIGHT_GROUP=WEIGHT_GROUP)
        # Rows without an adapter have no delta (their loads are masked off). Nothing of this runs before or
        # lives across the K loop, and in a batch without adapters none of it runs.
        if batch_has_lora:
            row_lora = tl.load(token_lora_ids_ptr + token, mask=row_valid, other=-1)
            has = ((row_lora >= 0) & (row_lora < num_loras))[:, None] & n_valid[None, :]
            delta_rows = lora_delta13_ptr + offs_m.to(tl.int64)[:, None] * stride_delta13_m
            gate += tl.load(delta_rows + offs_n[None, :], mask=has, other=0.0).to(tl.float32)
            up += tl.load(delta_rows + I + offs_n[None, :], mask=has, other=0.0).to(tl.float32)
    else:
        a2 = AdapterRows(lora_a2.ptr + expert * lora_a2.stride_e, lora_a2.stride_l, lora_a2.stride_r)
        row_lora, row_slot, present, slot_of, num_present, row_scale = _lora_tile(
            token_lora_ids_ptr, lora_scaling_ptr, token, row_valid, num_loras, batch_has_lora, LORA_IDS,
            (LORA_SLOTS == 1) and (LORA_RANK * BLOCK_N <= 2048))
        adapters = TileAdapters(row_slot, present, slot_of, num_present, row_scale)
        if num_present == 0:
            gate, up, _ = _gate_up_16bit(x_rows, row_valid, w1_operand, offs_n, n_valid, offs_r, r_valid, I, H, offs_n,
                                         n_valid, BLOCK_M, BLOCK_N, BLOCK_K, GATE_UP_INTERLEAVED, WITH_LORA=False,
                                         STACK=16, STAGES=None, WEIGHT_GROUP=WEIGHT_GROUP)
            la2 = tl.zeros([STACK, BLOCK_N], x_ptr.dtype.element_ty)
        else:
            gate, up, la2 = _lora_gate_up(
                x_rows, row_valid, w1_operand, offs_n, n_valid, offs_r, r_valid, I, H,
                AdapterRows(lora_a13.ptr + expert * lora_a13.stride_e, lora_a13.stride_l, lora_a13.stride_r),
                AdapterRows(lora_b13.ptr + expert * lora_b13.stride_e, lora_b13.stride_l, lora_b13.stride_r),
                a2, adapters, BLOCK_M, BLOCK_N, BLOCK_K, GATE_UP_INTERLEAVED, LORA_RANK, LORA_IDS, LORA_SLOTS,
                LORA_STAGES, WEIGHT_GROUP)
    y = _activated(gate, up, w1.bias_ptr, expert, w1.stride_bias_e, route_weight, offs_n, n_valid, I, w13_desc,
                   x_ptr.dtype.element_ty, ACTIVATION, SWIGLU_ALPHA, SWIGLU_LIMIT, GATE_UP_INTERLEAVED)
    _store_y(y, y_ptr + offs_m.to(tl.int64)[:, None] * stride_y_m + offs_n[None, :], n_valid, y_scale_rows=None,
             slice_id=slice_id)
    if lora_delta13_ptr is None:
        if num_present > 0:
            _store_down_shrinks(y, la2, lora_shrink2_ptr + slice_id * stride_shrink2_split
                                + offs_m.to(tl.int64) * LORA_RANK, offs_n, n_valid, a2, adapters, BLOCK_N, LORA_RANK,
                                LORA_IDS, LORA_SLOTS)

