"""Grouped GEMM over sorted expert tiles: ``C[rows] (+)= A[rows] @ B[expert]^T``.

One kernel, two users:

* fmoe2's two-stage path, stage 2: A = the activated intermediate ``y`` in sorted order
  (row = sorted position, routing weight already applied), B = ``w2``, output rows = token ids,
  added with relaxed atomics into the output the sort zeroed (``topk`` adds per element, times
  ``SPLIT_K``: with SPLIT_K > 1 the programs of one output tile each take a share of K, which at
  decode sizes gives more, shorter programs);
* fmoe2's deterministic mode, stage 2: as above, but ids are ``token * topk + slot`` and each row is
  stored (no atomics) into its own row of a ``[M * topk, H]`` buffer, which
  ``fmoe2/gemm/combine_kernel.py`` then sums over the slots in a fixed order;
* the benchmark's vLLM-style baseline: A gathered by expanded id (``x[id // topk]`` or
  ``cache2[id]``), output stored at row ``id``, optionally times ``topk_weights[id]``.

Given tensor descriptors (fmoe2's stage 2 with ``FusedMoEConfig.tma``), B tiles and A tiles (A
not gathered) come through them (Hopper's bulk tensor copy engine) instead of pointer loads.

With ``HAS_LORA`` (fmoe2's stage 2 where the two stages compute the adapter deltas themselves, see
``lora_in_stages`` in ``fmoe2/gemm/config.py``) the programs of the first K share also add the
down deltas of their rows after the K loop: stage 1 stored each I slice's partial down shrink
``y_slice @ A2[adapter, :, slice]^T`` per row; they are summed here and expanded with
``B2t[adapter, :, N block]`` into the accumulator, before its one atomic add. (Shrinking inside
this K loop instead was slower: docs/lora.md#the-down-shrink-inside-the-stage-2-k-loop.)
"""
import triton
import triton.language as tl

from ..fp8 import _quantize_rows
from ..grid_dependency import gdc_wait
from .lora_kernel import _in_stack_columns, _rank_sums, _slice_tile, _stack, _tile_slots


@triton.jit
def _grouped_gemm_kernel(
    a_ptr,  # [num_a_rows, K]
    b_ptr,  # [E, N(_pad), K(_pad)]
    c_ptr,  # [num_c_rows, N]
    sorted_ids_ptr,  # [num_grid_tiles * BLOCK_M] int32 ids (token or expanded), padding >= num_valid_ids
    expert_ids_ptr,  # [max_tiles] int32
    num_sorted_tiles_ptr,  # [1] int32
    topk_weights_ptr,  # [num_valid_ids] float32 (read only if MUL_ROUTED_WEIGHT)
    a_desc,  # None, or a tensor descriptor of A [num_a_rows, K], block [BLOCK_M, BLOCK_K] (not with GATHER_A)
    b_desc,  # None, or a tensor descriptor of B viewed [E * b_rows_per_expert, K(_pad)], block [BLOCK_N, BLOCK_K]
    b_rows_per_expert,  # B.shape[1] (read with b_desc only)
    num_valid_ids,
    N,
    K,
    num_grid_tiles,
    # strides
    stride_a_m,
    stride_b_e,
    stride_b_n,
    stride_c_m,
    # meta-parameters
    GATHER_A: tl.constexpr,  # A row = id // A_ROW_DIVISOR (else the sorted position)
    A_ROW_DIVISOR: tl.constexpr,
    MUL_ROUTED_WEIGHT: tl.constexpr,
    ATOMIC_OUTPUT: tl.constexpr,  # relaxed atomic add at row id (else a store)
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    PDL: tl.constexpr = False,  # launched as a programmatic dependent of the previous launch (CUDA sm_90+)
    SPLIT_K: tl.constexpr = 1,  # programs per (tile, N block), each over a share of K (ATOMIC_OUTPUT only)
    # Down deltas of multi-LoRA (HAS_LORA; fmoe2's stage 2 only: ids are token ids, A is y in sorted order):
    token_lora_ids_ptr=None,  # [M] int32 adapter per token, -1 = none
    lora_shrink_ptr=None,  # [num_shrink_splits, num_grid_tiles * BLOCK_M, LORA_RANK] fp32: stage 1's partial shrinks
    lora_b_ptr=None,  # B2t [L, E, LORA_RANK, N_pad]
    lora_scaling_ptr=None,  # [L] float32
    num_lora_tokens_ptr=None,  # [1] int32: tokens with an adapter (from the sort)
    num_loras=0,
    num_shrink_splits=0,  # I slices of stage 1
    stride_shrink_split=0,
    stride_lb_l=0,
    stride_lb_e=0,
    stride_lb_r=0,
    HAS_LORA: tl.constexpr = False,
    LORA_RANK: tl.constexpr = 16,  # padded rank
    LORA_IDS: tl.constexpr = 1,  # next_pow2(num_loras)
    LORA_SLOTS: tl.constexpr = 1,  # adapters of one tile stacked into one operand
    LORA_SPLITS_PER_STEP: tl.constexpr = 1,  # partial shrinks loaded per step of their sum
    stride_b_k=1,  # B's stride along K: 1 (a constant) but for transposed weights read in place
    # Bias of B's outputs (HAS_BIAS), added once per row by the first K share: [E, N(_pad)]; with
    # SCALE_BIAS_BY_ROW_WEIGHT times the row's weight row_weights_ptr[sorted row] (fmoe2's stage 2, whose A
    # carries the routing weight already), else before MUL_ROUTED_WEIGHT's multiply (the baseline).
    bias_ptr=None,
    stride_bias_e=0,
    row_weights_ptr=None,  # [num_grid_tiles * BLOCK_M] float32 in sorted-row order (SCALE_BIAS_BY_ROW_WEIGHT)
    HAS_BIAS: tl.constexpr = False,
    SCALE_BIAS_BY_ROW_WEIGHT: tl.constexpr = False,
    # fp8 B (fmoe2/fp8.py): B's scales [E, Sn, Sk] (stride 0 along a dimension of size 1), the scale of
    # B[e, n, k] at [e, n // SCALE_BLOCK_N, k // SCALE_BLOCK_K]; A_FP8 = 1: A tiles are quantized here per row
    # (BLOCK_K = one activation group), 2: A is fp8 already with scales a_scale_ptr[A row, k // BLOCK_K]
    # (the baseline's separate quantization launch).
    b_scale_ptr=None,
    stride_bs_e=0,
    stride_bs_n=0,
    stride_bs_k=0,
    a_scale_ptr=None,
    stride_as_m=0,
    A_FP8: tl.constexpr = 0,
    FP8_MAX: tl.constexpr = 448.0,
    SOFT_FP8_ROUNDING: tl.constexpr = False,
    FP8_MIN_NORMAL: tl.constexpr = 0.015625,
    FP8_SUBNORMAL_STEP: tl.constexpr = 0.001953125,
    SCALE_BLOCK_N: tl.constexpr = 1,
    SCALE_BLOCK_K: tl.constexpr = 128,
    IDS_PER_TOKEN: tl.constexpr = 1,  # HAS_LORA: a row's token (for its adapter) is id // IDS_PER_TOKEN
):
    """Grid: (SPLIT_K * num_grid_tiles * cdiv(N, BLOCK_N),), grouped order over (tile, N block),
    K shares slowest; programs past ``num_sorted_tiles`` or on a gap tile (expert -1) exit at once."""
    tl.static_assert(SPLIT_K == 1 or ATOMIC_OUTPUT, "K shares add their partial products: SPLIT_K needs ATOMIC_OUTPUT")
    tl.static_assert(not HAS_LORA or not GATHER_A, "LoRA deltas: fmoe2's stage 2 only")
    if PDL:  # wait until the previous launch's results (y, the zeroed output) are visible
        gdc_wait()
    pid = tl.program_id(0)
    num_n_blocks = tl.cdiv(N, BLOCK_N)
    k_steps = tl.cdiv(tl.cdiv(K, BLOCK_K), SPLIT_K)  # K steps of each share
    k_first = (pid // (num_grid_tiles * num_n_blocks)) * k_steps * BLOCK_K
    k_end = tl.minimum(K, k_first + k_steps * BLOCK_K)
    pid = pid % (num_grid_tiles * num_n_blocks)
    programs_per_group = GROUP_M * num_n_blocks
    first_tile = (pid // programs_per_group) * GROUP_M
    group_tiles = tl.minimum(num_grid_tiles - first_tile, GROUP_M)
    tile = first_tile + (pid % programs_per_group) % group_tiles
    n_block = (pid % programs_per_group) // group_tiles
    if tile >= tl.load(num_sorted_tiles_ptr):
        return
    expert = tl.load(expert_ids_ptr + tile).to(tl.int64)
    if expert < 0:  # a gap tile of the sorted layout
        return
    offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    row_id = tl.load(sorted_ids_ptr + offs_m)
    row_valid = row_id < num_valid_ids
    row_id = row_id.to(tl.int64)
    offs_n = n_block * BLOCK_N + tl.arange(0, BLOCK_N)
    n_valid = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    if GATHER_A:
        a_row = row_id // A_ROW_DIVISOR
    else:
        a_row = offs_m.to(tl.int64)
    a_rows = a_ptr + a_row[:, None] * stride_a_m
    if A_FP8 > 0:
        bs_rows = b_scale_ptr + expert * stride_bs_e + (offs_n // SCALE_BLOCK_N) * stride_bs_n
    b_rows = b_ptr + expert * stride_b_e + offs_n[:, None] * stride_b_n
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    b_row0 = (expert * b_rows_per_expert).to(tl.int32) + n_block * BLOCK_N
    for k0 in range(k_first, k_end, BLOCK_K):
        k = k0 + offs_k
        k_valid = k < K
        if a_desc is not None:
            a = a_desc.load([tile * BLOCK_M, k0])  # rows past the descriptor's end read as zero
        else:
            a = tl.load(a_rows + k[None, :], mask=row_valid[:, None] & k_valid[None, :], other=0.0)
        if b_desc is not None:
            # Rows past this expert's N belong to the next expert: their columns are masked at the store.
            b = b_desc.load([b_row0, k0])
        else:
            b = tl.load(b_rows + k[None, :] * stride_b_k, mask=n_valid[:, None] & k_valid[None, :], other=0.0)
        if A_FP8 > 0:
            if A_FP8 == 1:
                qa, sa = _quantize_rows(a.to(tl.float32), FP8_MAX, SOFT_FP8_ROUNDING, FP8_MIN_NORMAL,
                                        FP8_SUBNORMAL_STEP)
                qa = qa.to(b.dtype)
            else:
                qa = a
                sa = tl.load(a_scale_ptr + a_row * stride_as_m + k0 // BLOCK_K, mask=row_valid, other=0.0)
            sb = tl.load(bs_rows + (k0 // SCALE_BLOCK_K) * stride_bs_k, mask=n_valid, other=0.0)
            acc += tl.dot(qa, tl.trans(b)) * (sa[:, None] * sb[None, :])
        else:
            acc = tl.dot(a, tl.trans(b), acc, input_precision="ieee")
    if HAS_LORA:
        # The first K share adds the deltas; a batch without adapters skips even numbering slots.
        if (k_first == 0) & (tl.load(num_lora_tokens_ptr) > 0):
            row_token = row_id
            if IDS_PER_TOKEN > 1:
                row_token = row_id // IDS_PER_TOKEN
            row_lora, row_slot, present, slot_of, num_present = _tile_slots(token_lora_ids_ptr, row_token, row_valid,
                                                                             num_loras, True, LORA_IDS)
            if num_present > 0:  # (tiles without an adapter in a batch with some: nothing to add)
                row_scale = tl.load(lora_scaling_ptr + row_lora, mask=row_lora >= 0, other=0.0)
                by_rank = _rank_sums(lora_shrink_ptr + offs_m.to(tl.int64) * LORA_RANK, row_slot >= 0,
                                     num_shrink_splits, stride_shrink_split, LORA_RANK, LORA_SPLITS_PER_STEP)
                b2_expert = lora_b_ptr + expert * stride_lb_e
                for first_slot in range(0, num_present, LORA_SLOTS):  # one slot group unless a tile mixes more
                    lb_rows, lb_slot, lb_used = _stack(b2_expert, stride_lb_l, stride_lb_r, present, slot_of,
                                                       first_slot, LORA_IDS, LORA_SLOTS, LORA_RANK, 1)
                    own = _in_stack_columns(by_rank, row_slot, lb_slot, row_scale, b2_expert.dtype.element_ty,
                                            LORA_RANK, LORA_SLOTS * LORA_RANK)
                    acc = tl.dot(own, _slice_tile(lb_rows, lb_used, offs_n, n_valid), acc, input_precision="ieee")
    if HAS_BIAS:
        bias = tl.load(bias_ptr + expert * stride_bias_e + offs_n, mask=n_valid, other=0.0).to(tl.float32)
        bias = tl.where(k_first == 0, bias, 0.0)[None, :]  # added by the first K share only
        if SCALE_BIAS_BY_ROW_WEIGHT:
            bias = bias * tl.load(row_weights_ptr + offs_m)[:, None]
        acc += bias
    if MUL_ROUTED_WEIGHT:
        acc = acc * tl.load(topk_weights_ptr + row_id, mask=row_valid, other=0.0)[:, None]
    c_ptrs = c_ptr + row_id[:, None] * stride_c_m + offs_n[None, :]
    c_mask = row_valid[:, None] & n_valid[None, :]
    if ATOMIC_OUTPUT:
        tl.atomic_add(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=c_mask, sem="relaxed")
    else:
        tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=c_mask)
