"""Stage 2 of the two-stage path: ``out[token] += y[sorted row] @ w2[expert]^T`` over sorted expert tiles.

A = the activated intermediate ``y`` in sorted order (row = sorted position, routing weight already applied),
B = ``w2`` [E, N(_pad), K(_pad)] (N = H, K = I), output rows = token ids, added with relaxed atomics into the
output the sort zeroed (``topk`` adds per element, times ``SPLIT_K``: with SPLIT_K > 1 the programs of one output
tile each take a share of K, which at decode sizes gives more, shorter programs). In deterministic mode ids are
``token * topk + slot`` and each row is stored (no atomics, ATOMIC_OUTPUT=False) into its own row of a ``[M *
topk, H]`` buffer, which ``combine_kernel.py`` then sums over the slots in a fixed order.

| entry | launch (``launches.stage2_kernel_launch``) |
|---|---|
| ``_stage2_kernel`` | 16-bit weights; A and B through tensor descriptors where given (``FusedMoEConfig.tma``, Hopper's bulk tensor copy engine); with adapters (where the two stages compute their deltas) adding the down deltas of the rows' adapters |

(fp8 weights: ``_stage2_fp8_kernel`` in ``fp8_weights.py``.)

With adapters (``lora_in_stages`` in ``fmoe2/gemm/config.py``) the programs of the first K share add the down
deltas of their rows after the K loop: stage 1 stored each I slice's partial down shrink ``y_slice @ A2[adapter,
:, slice]^T`` per row; they are summed here and expanded with ``B2t[adapter, :, N block]`` into the accumulator,
before its one atomic add. (Shrinking inside this K loop instead was slower:
docs/lora.md#the-down-shrink-inside-the-stage-2-k-loop.)

The K loops and epilogues are ``@triton.jit`` helpers the benchmark's vLLM-style baseline builds its own entry
from (``fmoe2/bench/grouped_gemm.py``). Grids: ``(SPLIT_K * num_grid_tiles * cdiv(N, BLOCK_N),)``, grouped order
over (tile, N block), K shares slowest; programs past ``num_sorted_tiles`` or on a gap tile (expert -1) exit at
once.
"""
import triton
import triton.language as tl

from ..grid_dependency import gdc_wait
from .bundles import DownDeltas, ExpertWeights, Stage2Tile
from .lora_kernel import _in_stack_columns, _rank_sums, _slice_tile, _stack, _tile_slots
from .operands import _expert_scales, _packed_dot, _packed_weight_load
from .tiles import _fits_tail, _grouped_program, _tile_expert


@triton.jit
def _k_share_program(pid, num_grid_tiles, N, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                     SPLIT_K: tl.constexpr):
    """``(tile, n_block, k_first, k_end)`` of program ``pid``: K shares slowest, (tile, N block) grouped."""
    num_n_blocks = tl.cdiv(N, BLOCK_N)
    k_steps = tl.cdiv(tl.cdiv(K, BLOCK_K), SPLIT_K)  # K steps of each share
    k_first = (pid // (num_grid_tiles * num_n_blocks)) * k_steps * BLOCK_K
    k_end = tl.minimum(K, k_first + k_steps * BLOCK_K)
    tile, n_block = _grouped_program(pid % (num_grid_tiles * num_n_blocks), num_grid_tiles, num_n_blocks, GROUP_M)
    return tile, n_block, k_first, k_end


@triton.jit
def _tile_gemm_16bit(a_rows, a_desc, a_row0, row_valid, b_expert, offs_n, b_desc, b_row0, n_valid, stride_b_n,
                     stride_b_k, k_first, k_end, K, bs_rows, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, WEIGHT_GROUP: tl.constexpr):
    """``A[rows] @ B[expert, N block]^T`` over K in ``[k_first, k_end)``, fp32 [BLOCK_M, BLOCK_N]; ``a_rows``
    [BLOCK_M, 1] pointers and B's rows ``offs_n`` of the expert's ``b_expert`` (``stride_b_n`` / ``stride_b_k``
    apart: any strides; tiles loaded ``[K, N]``, as ``operands.py`` says why), or tensor descriptors (None:
    pointer loads) at rows ``a_row0`` and ``b_row0`` (B's rows past this expert's N belong to the next expert:
    masked at the store; A's past the descriptor's end read as zero). ``bs_rows`` (None: 16-bit B): [BLOCK_N]
    pointers to the group scales of 4-bit B, whose rows are then packed, ``stride_b_n`` bytes apart
    (``operands._packed_weight_load``)."""
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    b_rows = b_expert + offs_n[:, None] * stride_b_n  # [BLOCK_N, 1] (4-bit loads)
    b_cols = b_expert + offs_n[None, :] * stride_b_n  # [1, BLOCK_N] (16-bit [K, N] tiles)
    for k0 in range(k_first, k_end, BLOCK_K):
        k = k0 + offs_k
        k_valid = k < K
        if a_desc is not None:
            a = a_desc.load([a_row0, k0])
        else:
            a = tl.load(a_rows + k[None, :], mask=row_valid[:, None] & k_valid[None, :], other=0.0)
        if bs_rows is not None:
            packed, scales = _packed_weight_load(b_rows, k0, stride_b_n, n_valid, bs_rows, BLOCK_K, WEIGHT_GROUP)
            acc = _packed_dot(a, packed, scales, acc, BLOCK_K, WEIGHT_GROUP)
        elif b_desc is not None:
            acc = tl.dot(a, tl.trans(b_desc.load([b_row0, k0])), acc, input_precision="ieee")
        else:
            b = tl.load(b_cols + k[:, None] * stride_b_k, mask=k_valid[:, None] & n_valid[None, :], other=0.0)
            acc = tl.dot(a, b, acc, input_precision="ieee")
    return acc


@triton.jit
def _add_bias(acc, bias_ptr, stride_bias_e, expert, row_weights_ptr, offs_m, offs_n, n_valid, k_first):
    """acc plus the bias of B's outputs (``bias_ptr``: [E, N(_pad)]; None: no bias), added by the first K share
    only, times the rows' weights ``row_weights_ptr[offs_m]`` where not None (fmoe2's stage 2, whose A carries the
    routing weight already)."""
    if bias_ptr is not None:
        bias = tl.load(bias_ptr + expert * stride_bias_e + offs_n, mask=n_valid, other=0.0).to(tl.float32)
        bias = tl.where(k_first == 0, bias, 0.0)[None, :]
        if row_weights_ptr is not None:
            bias = bias * tl.load(row_weights_ptr + offs_m)[:, None]
        acc += bias
    return acc


@triton.jit
def _write_rows(acc, c_ptr, row_id, row_valid, offs_n, n_valid, stride_c_m, ATOMIC_OUTPUT: tl.constexpr):
    """``C[row_id] += acc`` with relaxed atomics (ATOMIC_OUTPUT), else stored."""
    c_ptrs = c_ptr + row_id[:, None] * stride_c_m + offs_n[None, :]
    c_mask = row_valid[:, None] & n_valid[None, :]
    if ATOMIC_OUTPUT:
        tl.atomic_add(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=c_mask, sem="relaxed")
    else:
        tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=c_mask)


@triton.jit
def _stage2_program(sorted_ids_ptr, expert_ids_ptr, num_sorted_tiles_ptr, num_valid_ids, N, K, num_grid_tiles,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                    SPLIT_K: tl.constexpr, ATOMIC_OUTPUT: tl.constexpr, PDL: tl.constexpr):
    """``(expert, tile, n_block, k_first, k_end, offs_m, row_id, row_valid, offs_n, n_valid)`` of this program: its
    sorted tile's expert (-1: nothing to do), K share and rows (:func:`_stage2_rows`; loaded with the expert, stale
    for a tile past the sorted ones: the grid is sized for the worst routing, never used). With PDL it first waits
    for the previous launch's results (y, the zeroed output)."""
    tl.static_assert(SPLIT_K == 1 or ATOMIC_OUTPUT, "K shares add their partial products: SPLIT_K needs ATOMIC_OUTPUT")
    if PDL:
        gdc_wait()
    tile, n_block, k_first, k_end = _k_share_program(tl.program_id(0), num_grid_tiles, N, K, BLOCK_N, BLOCK_K, GROUP_M,
                                                     SPLIT_K)
    expert = _tile_expert(tile, num_sorted_tiles_ptr, expert_ids_ptr)
    offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    row_id = tl.zeros([BLOCK_M], dtype=tl.int64)
    row_valid = offs_m < 0
    if expert >= 0:  # (a program with nothing to do loads no rows)
        offs_m, row_id, row_valid = _stage2_rows(tile * BLOCK_M, sorted_ids_ptr, num_valid_ids, BLOCK_M)
    offs_n = n_block * BLOCK_N + tl.arange(0, BLOCK_N)
    return expert, tile, n_block, k_first, k_end, offs_m, row_id, row_valid, offs_n, offs_n < N


@triton.jit
def _stage2_rows(first_row, sorted_ids_ptr, num_valid_ids, ROWS: tl.constexpr):
    """``(offs_m, row_id, row_valid)`` of ROWS sorted rows from ``first_row`` (a tile's, or its tail's:
    ``tiles._fits_tail``): the rows, their ids (int64) and which are real."""
    offs_m = first_row + tl.arange(0, ROWS)
    row_id = tl.load(sorted_ids_ptr + offs_m).to(tl.int64)
    return offs_m, row_id, row_id < num_valid_ids


@triton.jit
def _stage2_kernel(
    a_ptr,  # y [num_grid_tiles * BLOCK_M, K] in sorted row order
    b_ptr,  # w2 [E, N(_pad), K(_pad)] (4-bit: packed [E, N_pad, K_pad // 2] uint8)
    b_scale_ptr,  # None, or the group scales of 4-bit w2 [E, N_pad, ...] (fmoe2/quant4.py)
    c_ptr,  # out [M, N] (atomic adds), or the deterministic mode's slot rows [M * topk, N] (stores)
    a_desc,  # None, or a tensor descriptor of A, block [BLOCK_M, BLOCK_K]
    b_desc,  # None, or a tensor descriptor of B viewed [E * b_rows_per_expert, K(_pad)], block [BLOCK_N, BLOCK_K]
    bias_ptr,  # None, or the down bias [E, N(_pad)], added times the row's routing weight
    row_weights_ptr,  # (bias only) [num_grid_tiles * BLOCK_M] float32 routing weights in sorted row order
    sorted_ids_ptr,  # [num_grid_tiles * BLOCK_M] int32 ids (token, or token * topk + slot), padding >= num_valid_ids
    expert_ids_ptr,  # [max_tiles] int32
    num_sorted_tiles_ptr,  # [1] int32
    # The down deltas of the rows' adapters (None without; see the module docstring):
    token_lora_ids_ptr,  # [M] int32 adapter per token, -1 = none
    lora_shrink_ptr,  # [num_shrink_splits, num_grid_tiles * BLOCK_M, LORA_RANK] fp32: stage 1's partial shrinks
    lora_b_ptr,  # B2t [L, E, LORA_RANK, N_pad]
    lora_scaling_ptr,  # [L] float32
    num_lora_tokens_ptr,  # [1] int32: tokens with an adapter (from the sort)
    b_rows_per_expert,  # B.shape[1] (read with b_desc only)
    num_valid_ids, N, K, num_grid_tiles, num_loras,
    num_shrink_splits,  # I slices of stage 1
    stride_a_m, stride_b_e, stride_b_n, stride_b_k, stride_bias_e, stride_c_m,
    stride_shrink_split, stride_lb_l, stride_lb_e, stride_lb_r,
    ATOMIC_OUTPUT: tl.constexpr,  # relaxed atomic add at row id (else a store)
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    PDL: tl.constexpr,  # launched as a programmatic dependent of the previous launch (CUDA sm_90+)
    SPLIT_K: tl.constexpr,  # programs per (tile, N block), each over a share of K (ATOMIC_OUTPUT only)
    LORA_RANK: tl.constexpr,  # padded rank
    LORA_IDS: tl.constexpr,  # next_pow2(num_loras)
    LORA_SLOTS: tl.constexpr,  # adapters of one tile stacked into one operand
    LORA_SPLITS_PER_STEP: tl.constexpr,  # partial shrinks loaded per step of their sum
    IDS_PER_TOKEN: tl.constexpr,  # a row's token (for its adapter) is id // IDS_PER_TOKEN
    WEIGHT_GROUP: tl.constexpr,  # K columns per scale of 4-bit weights (unused with 16-bit ones)
    # A tile whose real rows fit in its first TAIL_M computes those rows only (0: never; tiles._fits_tail), its A
    # rows through pointer loads (the descriptor's block is BLOCK_M rows)
    TAIL_M: tl.constexpr,
):
    expert, tile, n_block, k_first, k_end, offs_m, row_id, row_valid, offs_n, n_valid = _stage2_program(
        sorted_ids_ptr, expert_ids_ptr, num_sorted_tiles_ptr, num_valid_ids, N, K, num_grid_tiles, BLOCK_M, BLOCK_N,
        BLOCK_K, GROUP_M, SPLIT_K, ATOMIC_OUTPUT, PDL)
    if expert < 0:
        return
    w2 = ExpertWeights(b_ptr, b_desc, b_scale_ptr, bias_ptr, stride_b_e, stride_b_n, stride_b_k, stride_bias_e)
    deltas = DownDeltas(token_lora_ids_ptr, lora_shrink_ptr, lora_b_ptr, lora_scaling_ptr, num_lora_tokens_ptr,
                        num_loras, num_shrink_splits, stride_shrink_split, stride_lb_l, stride_lb_e, stride_lb_r)
    first_row = tile * BLOCK_M
    if TAIL_M > 0 and _fits_tail(row_valid, TAIL_M):
        tail_m, tail_id, tail_valid = _stage2_rows(first_row, sorted_ids_ptr, num_valid_ids, TAIL_M)
        _stage2_tile(a_ptr, stride_a_m, w2, b_rows_per_expert, c_ptr, stride_c_m, row_weights_ptr, deltas,
                     Stage2Tile(expert, n_block, k_first, k_end, first_row, tail_m, tail_id, tail_valid, offs_n,
                                n_valid), K, a_desc=None, ATOMIC_OUTPUT=ATOMIC_OUTPUT, ROWS=TAIL_M, BLOCK_N=BLOCK_N,
                     BLOCK_K=BLOCK_K, LORA_RANK=LORA_RANK, LORA_IDS=LORA_IDS, LORA_SLOTS=LORA_SLOTS,
                     LORA_SPLITS_PER_STEP=LORA_SPLITS_PER_STEP, IDS_PER_TOKEN=IDS_PER_TOKEN, WEIGHT_GROUP=WEIGHT_GROUP)
    else:
        _stage2_tile(a_ptr, stride_a_m, w2, b_rows_per_expert, c_ptr, stride_c_m, row_weights_ptr, deltas,
                     Stage2Tile(expert, n_block, k_first, k_end, first_row, offs_m, row_id, row_valid, offs_n,
                                n_valid), K, a_desc=a_desc, ATOMIC_OUTPUT=ATOMIC_OUTPUT, ROWS=BLOCK_M, BLOCK_N=BLOCK_N,
                     BLOCK_K=BLOCK_K, LORA_RANK=LORA_RANK, LORA_IDS=LORA_IDS, LORA_SLOTS=LORA_SLOTS,
                     LORA_SPLITS_PER_STEP=LORA_SPLITS_PER_STEP, IDS_PER_TOKEN=IDS_PER_TOKEN, WEIGHT_GROUP=WEIGHT_GROUP)


@triton.jit
def _stage2_tile(a_ptr, stride_a_m, w2, b_rows_per_expert, c_ptr, stride_c_m, row_weights_ptr, deltas, work, K,
                 a_desc, ATOMIC_OUTPUT: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 LORA_RANK: tl.constexpr, LORA_IDS: tl.constexpr, LORA_SLOTS: tl.constexpr,
                 LORA_SPLITS_PER_STEP: tl.constexpr, IDS_PER_TOKEN: tl.constexpr, WEIGHT_GROUP: tl.constexpr):
    """Stage 2 of ROWS sorted rows and one block of output columns (``work``: a :class:`~.bundles.Stage2Tile`),
    over the program's share of K: the product of A (y, through ``a_desc`` where not None) with ``w2`` (an
    :class:`~.bundles.ExpertWeights`; its bias added times ``row_weights_ptr``'s routing weights), plus the rows'
    down deltas (``deltas``: a :class:`~.bundles.DownDeltas`), added (or stored) at the rows' ids (see
    :func:`_stage2_kernel`)."""
    bs_rows = None
    if w2.scale_ptr is not None:  # (laid out like B's packed rows: operands._expert_scales)
        bs_expert, stride_bs_n = _expert_scales(w2.ptr, w2.scale_ptr, work.expert, w2.stride_e, w2.stride_n,
                                                WEIGHT_GROUP)
        bs_rows = bs_expert + work.offs_n * stride_bs_n
    acc = _tile_gemm_16bit(a_ptr + work.offs_m.to(tl.int64)[:, None] * stride_a_m, a_desc, work.first_row,
                           work.row_valid, w2.ptr + work.expert * w2.stride_e, work.offs_n, w2.desc,
                           (work.expert * b_rows_per_expert).to(tl.int32) + work.n_block * BLOCK_N, work.n_valid,
                           w2.stride_n, w2.stride_k, work.k_first, work.k_end, K, bs_rows, ROWS, BLOCK_N, BLOCK_K,
                           WEIGHT_GROUP)
    if deltas.shrink_ptr is not None:
        # The first K share adds the deltas; a batch without adapters skips even numbering slots.
        if (work.k_first == 0) & (tl.load(deltas.num_lora_tokens_ptr) > 0):
            acc = _add_down_deltas(acc, work, deltas, LORA_RANK, LORA_IDS, LORA_SLOTS, LORA_SPLITS_PER_STEP,
                                   IDS_PER_TOKEN)
    acc = _add_bias(acc, w2.bias_ptr, w2.stride_bias_e, work.expert, row_weights_ptr, work.offs_m, work.offs_n,
                    work.n_valid, work.k_first)
    _write_rows(acc, c_ptr, work.row_id, work.row_valid, work.offs_n, work.n_valid, stride_c_m, ATOMIC_OUTPUT)


@triton.jit
def _add_down_deltas(acc, work, deltas, LORA_RANK: tl.constexpr, LORA_IDS: tl.constexpr, LORA_SLOTS: tl.constexpr,
                     LORA_SPLITS_PER_STEP: tl.constexpr, IDS_PER_TOKEN: tl.constexpr):
    """acc plus the rows' down deltas (``work``: a :class:`~.bundles.Stage2Tile`; ``deltas``: a
    :class:`~.bundles.DownDeltas`): stage 1's partial shrinks of the rows summed over the I slices, times each
    row's scaling, expanded with its adapter's ``B2t[:, N block]``, one slot group at a time."""
    row_id, row_valid, offs_m, offs_n, n_valid = work.row_id, work.row_valid, work.offs_m, work.offs_n, work.n_valid
    row_token = row_id
    if IDS_PER_TOKEN > 1:
        row_token = row_id // IDS_PER_TOKEN
    row_lora, row_slot, present, slot_of, num_present = _tile_slots(deltas.token_lora_ids_ptr, row_token, row_valid,
                                                                    deltas.num_loras, batch_has_lora=True,
                                                                    LORA_IDS=LORA_IDS)
    if num_present > 0:  # (tiles without an adapter in a batch with some: nothing to add)
        row_scale = tl.load(deltas.scaling_ptr + row_lora, mask=row_lora >= 0, other=0.0)
        by_rank = _rank_sums(deltas.shrink_ptr + offs_m.to(tl.int64) * LORA_RANK, row_slot >= 0,
                             deltas.num_shrink_splits, deltas.stride_shrink_split, LORA_RANK, LORA_SPLITS_PER_STEP)
        b2_expert = deltas.b2t_ptr + work.expert * deltas.stride_b2t_e
        for first_slot in range(0, num_present, LORA_SLOTS):  # one slot group unless a tile mixes more
            lb_rows, lb_slot, lb_used = _stack(b2_expert, deltas.stride_b2t_l, deltas.stride_b2t_r, present, slot_of,
                                               first_slot, LORA_IDS, LORA_SLOTS, LORA_RANK, PARTS=1)
            own = _in_stack_columns(by_rank, row_slot, lb_slot, row_scale, b2_expert.dtype.element_ty, LORA_RANK,
                                    LORA_SLOTS * LORA_RANK)
            acc = tl.dot(own, _slice_tile(lb_rows, lb_used, offs_n, n_valid), acc, input_precision="ieee")
    return acc
