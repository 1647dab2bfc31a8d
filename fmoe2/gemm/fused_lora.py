"""Multi-LoRA inside the fused kernels: the adapter work of one program (one tile, one I slice).

Tiles stay per expert (``fused_moe_kernel.py``), so the base weights are read exactly as without adapters
whatever the mix of adapters. The adapters a tile's rows use (``token_lora_ids``, -1 = none) are numbered
densely into slots; LORA_SLOTS slots (one group) are stacked into one operand of rank ``LORA_SLOTS * R``, so a
tile that mixes up to LORA_SLOTS adapters costs one product per step, not one per adapter
(``lora_kernel.py``'s building blocks):

* gate/up shrink: ``x @ A13[stack]^T`` (the gate rows of every slot, then their up rows) rides the base K
  loop and reuses the x tile already loaded; each row then keeps the columns of its own slot (``_own_rows``);
* gate/up expand: ``shrink_gate @ B13t[stack, gate rows, slice]`` (and up), added into the accumulators
  before the activation (after the loop, once per program);
* down: per slice ``t = y_slice @ A2[stack, :, slice]^T`` (the down GEMM is linear in y, so slice partials sum
  to the full shrink), each row's own slot kept; inside the down loop ``t @ B2t[stack, :, h chunk]`` joins the
  base partial (no extra atomics); on the two-stage path stage 1 stores ``t`` per slice instead
  (:func:`_store_down_shrinks`) and stage 2 sums and expands it.

Every adapter operand is loaded with H or I contiguous (``lora.py``); an operand's
:class:`~.bundles.AdapterRows` hold it at adapter 0 of the tile's expert (``ptr``) and its adapter and row strides
(``stride_l`` / ``stride_r``). Only tiles whose
rows use more than LORA_SLOTS adapters (possible when LORA_SLOTS < LORA_IDS) take further passes over H per
group, with atomic adds into their rows.

Decode tiles (one slot: fewer routed rows than experts) with a small slice (LORA_DECODE) have a short K loop,
so a batch without adapters skips numbering slots and the slice's B13t and A2 tiles load before the loop;
larger configs and wider slices keep the plain order (spills, shared memory):
docs/lora.md#decode-tiles-of-the-fused-kernel.
"""
import triton
import triton.language as tl

from .lora_kernel import (_down_shrink, _expand_gate_up, _own_rows, _own_shrink, _shrink_step, _slice_tile,
                          _split_gate_up, _stack, _tile_slots)
from .operands import _down_16bit, _gate_up_16bit


@triton.jit
def _lora_tile(token_lora_ids_ptr, lora_scaling_ptr, token, row_valid, num_loras, batch_has_lora,
               LORA_IDS: tl.constexpr, LORA_DECODE: tl.constexpr):
    """``_tile_slots`` of the tile's rows (row_lora, row_slot, present, slot_of, num_present) and each row's
    scaling (0 without an adapter). Decode tiles in a batch without adapters number no slots."""
    if LORA_DECODE:
        row_lora = tl.full(token.shape, -1, tl.int32)
        row_slot = row_lora
        present = tl.zeros([LORA_IDS], tl.int32)
        slot_of = present
        num_present = tl.full([], 0, tl.int32)
        if batch_has_lora:
            row_lora, row_slot, present, slot_of, num_present = _tile_slots(token_lora_ids_ptr, token, row_valid,
                num_loras, batch_has_lora=True, LORA_IDS=LORA_IDS)
    else:
        row_lora, row_slot, present, slot_of, num_present = _tile_slots(token_lora_ids_ptr, token, row_valid,
                                                                         num_loras, batch_has_lora, LORA_IDS)
    row_scale = tl.load(lora_scaling_ptr + row_lora, mask=row_lora >= 0, other=0.0)
    return row_lora, row_slot, present, slot_of, num_present, row_scale


@triton.jit
def _lora_gate_up(x_rows, row_valid, w1_operand, offs_n, n_valid, offs_r, r_valid, I, H, a13, b13t, a2, adapters,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                  GATE_UP_INTERLEAVED: tl.constexpr, LORA_RANK: tl.constexpr, LORA_IDS: tl.constexpr,
                  LORA_SLOTS: tl.constexpr, LORA_STAGES: tl.constexpr, WEIGHT_GROUP: tl.constexpr):
    """Gate and up accumulators of a tile with adapters: the base GEMM (``w1_operand``: an
    :class:`~.bundles.ExpertOperand`) with every slot group's deltas added (``a13``, ``b13t``, ``a2``: the expert's
    :class:`~.bundles.AdapterRows` of A13, B13t and A2; ``adapters``: the tile's :class:`~.bundles.TileAdapters`).
    Returns gate, up and (decode tiles, loaded before the K loop) the slice's stacked A2 tile [STACK, BLOCK_N] of
    the first slot group; other tiles get zeros there and load it after the loop."""
    a13_expert, stride_la13_l, stride_la13_r = a13.ptr, a13.stride_l, a13.stride_r
    b13_expert, stride_lb13_l, stride_lb13_r = b13t.ptr, b13t.stride_l, b13t.stride_r
    a2_expert, stride_la2_l, stride_la2_r = a2.ptr, a2.stride_l, a2.stride_r
    row_slot, present, slot_of = adapters.row_slot, adapters.present, adapters.slot_of
    num_present, row_scale = adapters.num_present, adapters.row_scale
    STACK: tl.constexpr = LORA_SLOTS * LORA_RANK
    LORA_DECODE: tl.constexpr = (LORA_SLOTS == 1) and (LORA_RANK * BLOCK_N <= 2048)  # see the module docstring
    dtype = x_rows.dtype.element_ty
    lb_up = LORA_RANK * stride_lb13_r  # B13t rows: gate rows [0, R), up rows [R, 2R) (A13 likewise)
    la_rows, gu_slot, la_used = _stack(a13_expert, stride_la13_l, stride_la13_r, present, slot_of, first_slot=0,
                                       LORA_IDS=LORA_IDS, LORA_SLOTS=LORA_SLOTS, WIDTH=LORA_RANK, PARTS=2)
    la2 = tl.zeros([STACK, BLOCK_N], dtype)
    if LORA_DECODE:
        lb_rows, lb_slot, lb_used = _stack(b13_expert, stride_lb13_l, stride_lb13_r, present, slot_of, first_slot=0,
                                           LORA_IDS=LORA_IDS, LORA_SLOTS=LORA_SLOTS, WIDTH=LORA_RANK, PARTS=1)
        b13_gate_tile = _slice_tile(lb_rows, lb_used, offs_n, n_valid)
        b13_up_tile = _slice_tile(lb_rows + lb_up, lb_used, offs_n, n_valid)
        la2_rows, d_slot, la2_used = _stack(a2_expert, stride_la2_l, stride_la2_r, present, slot_of, first_slot=0,
                                            LORA_IDS=LORA_IDS, LORA_SLOTS=LORA_SLOTS, WIDTH=LORA_RANK, PARTS=1)
        la2 = _slice_tile(la2_rows, la2_used, offs_n, n_valid)
    gate, up, shrink = _gate_up_16bit(x_rows, row_valid, w1_operand, offs_n, n_valid, offs_r, r_valid, I, H, la_rows,
                                      la_used, BLOCK_M, BLOCK_N, BLOCK_K, GATE_UP_INTERLEAVED, WITH_LORA=True,
                                      STACK=2 * STACK, STAGES=LORA_STAGES, WEIGHT_GROUP=WEIGHT_GROUP)
    shrink_gate, shrink_up = _split_gate_up(_own_rows(shrink, row_slot, gu_slot, row_scale, dtype), BLOCK_M, STACK)
    if LORA_DECODE:
        gate = tl.dot(shrink_gate, b13_gate_tile, gate, input_precision="ieee")
        up = tl.dot(shrink_up, b13_up_tile, up, input_precision="ieee")
    else:
        lb_rows, lb_slot, lb_used = _stack(b13_expert, stride_lb13_l, stride_lb13_r, present, slot_of, first_slot=0,
                                           LORA_IDS=LORA_IDS, LORA_SLOTS=LORA_SLOTS, WIDTH=LORA_RANK, PARTS=1)
        gate, up = _expand_gate_up(gate, up, shrink_gate, shrink_up, lb_rows, lb_up, lb_used, offs_n, n_valid)
    if LORA_SLOTS < LORA_IDS:
        # Tiles using more than LORA_SLOTS adapters: one more pass over H per further group.
        offs_k = tl.arange(0, BLOCK_K)
        for first_slot in range(LORA_SLOTS, num_present, LORA_SLOTS):
            la_rows, gu_slot, la_used = _stack(a13_expert, stride_la13_l, stride_la13_r, present, slot_of, first_slot,
                                               LORA_IDS, LORA_SLOTS, LORA_RANK, PARTS=2)
            shrink = tl.zeros([BLOCK_M, 2 * STACK], dtype=tl.float32)
            for k0 in tl.range(0, H, BLOCK_K, num_stages=LORA_STAGES):
                k = k0 + offs_k
                k_valid = k < H
                a = tl.load(x_rows + k[None, :], mask=row_valid[:, None] & k_valid[None, :], other=0.0)
                shrink = _shrink_step(a, la_rows, la_used, k, k_valid, shrink)
            shrink_gate, shrink_up = _split_gate_up(_own_rows(shrink, row_slot, gu_slot, row_scale, dtype),
                                                    BLOCK_M, STACK)
            lb_rows, lb_slot, lb_used = _stack(b13_expert, stride_lb13_l, stride_lb13_r, present, slot_of, first_slot,
                                               LORA_IDS, LORA_SLOTS, LORA_RANK, PARTS=1)
            gate, up = _expand_gate_up(gate, up, shrink_gate, shrink_up, lb_rows, lb_up, lb_used, offs_n, n_valid)
    return gate, up, la2


@triton.jit
def _lora_down(y, la2, out_rows, row_valid, w2_operand, offs_n, n_valid, H, slice_col0, b2_expert, bias_weight, a2,
               b2t, adapters, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_H: tl.constexpr,
               LORA_RANK: tl.constexpr, LORA_IDS: tl.constexpr, LORA_SLOTS: tl.constexpr, LORA_STAGES: tl.constexpr,
               WEIGHT_GROUP: tl.constexpr):
    """The fused path's down GEMM of a tile with adapters (``w2_operand``: an :class:`~.bundles.ExpertOperand`;
    ``a2``, ``b2t``: the expert's :class:`~.bundles.AdapterRows` of A2 and B2t; ``adapters``: the tile's
    :class:`~.bundles.TileAdapters`): the slice's down shrink of each slot group, ``t = y_slice @ A2[stack,
    slice]^T`` (each row keeps its own slot's columns), its expand ``t @ B2t[stack, h chunk]`` riding the base down
    loop (``la2``: decode tiles' A2 tile of the first group, loaded before the gate/up loop)."""
    a2_expert, stride_la2_l, stride_la2_r = a2.ptr, a2.stride_l, a2.stride_r
    b2t_expert, stride_lb2_l, stride_lb2_r = b2t.ptr, b2t.stride_l, b2t.stride_r
    row_slot, present, slot_of = adapters.row_slot, adapters.present, adapters.slot_of
    num_present, row_scale = adapters.num_present, adapters.row_scale
    LORA_DECODE: tl.constexpr = (LORA_SLOTS == 1) and (LORA_RANK * BLOCK_N <= 2048)  # see the module docstring
    la2_rows, d_slot, la2_used = _stack(a2_expert, stride_la2_l, stride_la2_r, present, slot_of, first_slot=0,
                                        LORA_IDS=LORA_IDS, LORA_SLOTS=LORA_SLOTS, WIDTH=LORA_RANK, PARTS=1)
    if not LORA_DECODE:
        la2 = _slice_tile(la2_rows, la2_used, offs_n, n_valid)
    lb2_rows, lb2_slot, lb2_used = _stack(b2t_expert, stride_lb2_l, stride_lb2_r, present, slot_of, first_slot=0,
                                          LORA_IDS=LORA_IDS, LORA_SLOTS=LORA_SLOTS, WIDTH=LORA_RANK, PARTS=1)
    _down_16bit(y, out_rows, row_valid, w2_operand, offs_n, n_valid, H,
                _down_shrink(y, la2, row_slot, d_slot, row_scale), lb2_rows, lb2_used, slice_col0, b2_expert,
                bias_weight, BLOCK_M, BLOCK_H, WITH_BASE=True, WITH_LORA=True, STAGES=LORA_STAGES,
                WEIGHT_GROUP=WEIGHT_GROUP)
    if LORA_SLOTS < LORA_IDS:
        # Further slot groups: their own pass over H, atomics on their rows only.
        for first_slot in range(LORA_SLOTS, num_present, LORA_SLOTS):
            la2_rows, d_slot, la2_used = _stack(a2_expert, stride_la2_l, stride_la2_r, present, slot_of, first_slot,
                                                LORA_IDS, LORA_SLOTS, LORA_RANK, PARTS=1)
            lb2_rows, lb2_slot, lb2_used = _stack(b2t_expert, stride_lb2_l, stride_lb2_r, present, slot_of, first_slot,
                                                  LORA_IDS, LORA_SLOTS, LORA_RANK, PARTS=1)
            _down_16bit(y, out_rows, (row_slot >= first_slot) & (row_slot < first_slot + LORA_SLOTS), w2_operand,
                        offs_n, n_valid, H,
                        _down_shrink(y, _slice_tile(la2_rows, la2_used, offs_n, n_valid), row_slot, d_slot,
                                     row_scale),
                        lb2_rows, lb2_used, slice_col0, b2_expert=None, bias_weight=bias_weight, BLOCK_M=BLOCK_M,
                        BLOCK_H=BLOCK_H, WITH_BASE=False, WITH_LORA=True, STAGES=LORA_STAGES, WEIGHT_GROUP=WEIGHT_GROUP)


@triton.jit
def _store_down_shrinks(y, la2, shrink_rows, offs_n, n_valid, a2, adapters, BLOCK_N: tl.constexpr,
                        LORA_RANK: tl.constexpr, LORA_IDS: tl.constexpr, LORA_SLOTS: tl.constexpr):
    """Stage 1 computing the deltas itself: this slice's down shrink of each row with an adapter (``a2``: the
    expert's :class:`~.bundles.AdapterRows` of A2; ``adapters``: the tile's :class:`~.bundles.TileAdapters`),
    stored at ``shrink_rows`` ([BLOCK_M] pointers to the rows' LORA_RANK floats of this slice), for stage 2 to sum
    over the slices and expand (``grouped_gemm_kernel.py``)."""
    a2_expert, stride_la2_l, stride_la2_r = a2.ptr, a2.stride_l, a2.stride_r
    row_slot, present, slot_of = adapters.row_slot, adapters.present, adapters.slot_of
    num_present = adapters.num_present
    LORA_DECODE: tl.constexpr = (LORA_SLOTS == 1) and (LORA_RANK * BLOCK_N <= 2048)  # see the module docstring
    la2_rows, d_slot, la2_used = _stack(a2_expert, stride_la2_l, stride_la2_r, present, slot_of, first_slot=0,
                                        LORA_IDS=LORA_IDS, LORA_SLOTS=LORA_SLOTS, WIDTH=LORA_RANK, PARTS=1)
    if not LORA_DECODE:
        la2 = _slice_tile(la2_rows, la2_used, offs_n, n_valid)
    own = _own_shrink(y, la2, row_slot, d_slot, LORA_SLOTS, LORA_RANK)
    if LORA_SLOTS < LORA_IDS:
        for first_slot in range(LORA_SLOTS, num_present, LORA_SLOTS):
            la2_rows, d_slot, la2_used = _stack(a2_expert, stride_la2_l, stride_la2_r, present, slot_of, first_slot,
                                                LORA_IDS, LORA_SLOTS, LORA_RANK, PARTS=1)
            own += _own_shrink(y, _slice_tile(la2_rows, la2_used, offs_n, n_valid), row_slot, d_slot, LORA_SLOTS,
                               LORA_RANK)
    tl.store(shrink_rows[:, None] + tl.arange(0, LORA_RANK)[None, :], own, mask=(row_slot >= 0)[:, None])
