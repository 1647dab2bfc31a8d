"""LoRA building blocks shared by the kernels, and the LoRA shrink and expand kernels of the two-stage path.

A tile's rows may use different adapters (``token_lora_ids``, -1 = none). The adapters present
in a tile are numbered densely into slots (``_tile_slots``) and LORA_SLOTS of them at a time are
stacked into one operand of LORA_SLOTS * R rows (``_stack``), so one product serves a slot
group; each row then keeps only its own slot's columns (``_own_rows``). The fused kernel
(``fused_moe_kernel.py``) computes every delta inside its own programs.

Two-stage path with adapters (``fused_moe`` with ``path="two_stage"``, or "auto" where the config
picks it) beyond 1 routed row per expert (up to it the two stages compute the deltas themselves,
see ``lora_in_stages`` in ``config.py``), seven launches: sort, ``_lora_shrink_kernel`` and
``_lora_expand_kernel`` (gate/up), stage 1, the same two (down), stage 2:

* gate/up: ``delta13[row] = scale * (x_row @ A13[adapter]^T) @ B13t[adapter]`` ``[2I]`` (gate, then
  up; input dtype, sorted-row order); stage 1 adds it to its accumulators before the activation;
* down: ``out[token] += scale * (y_row @ A2[adapter]^T) @ B2t[adapter]`` with relaxed atomics
  (``y`` carries the routing weight), beside stage 2's adds.

The shrink splits K (H or I) over programs and writes fp32 partials ``[splits, rows, parts * R]``
(each row only its own adapter's R values per part); the expand sums them and splits the output
columns. Two kernels, because one doing both repeated the shrink in every column program. Not
inside the stages as the fused kernel does: there each I-slice program repeats the shrink over H,
and expanding inside stage 1 cost it resident programs; stage 1 only adds a ready delta, which
keeps its footprint as plain, and stage 2 is untouched (the down expand inside stage 2 made it
slower even without adapters). Measurements: docs/lora.md#rejected-designs.
"""
import triton
import triton.language as tl

from ..grid_dependency import dependent_launch_prologue


@triton.jit
def _tile_slots(token_lora_ids_ptr, token, row_valid, num_loras, batch_has_lora, LORA_IDS: tl.constexpr):
    """Which adapters the tile's rows use, numbered densely in id order (their slots).

    ``batch_has_lora``: whether any token of the batch has an adapter (the sort's count); without
    one the rows' adapter ids are not loaded, so the plain loops need not wait for that load.
    Returns row_lora [BLOCK_M] (adapter id, -1: none, padding or out of range), row_slot
    [BLOCK_M] (-1 for none), present [LORA_IDS] (0/1 per adapter id), slot_of [LORA_IDS]
    (the slot of each present id) and num_present (slots in use).
    """
    row_lora = tl.full(token.shape, -1, tl.int32)
    if batch_has_lora:
        row_lora = tl.load(token_lora_ids_ptr + token, mask=row_valid, other=-1)
        row_lora = tl.where((row_lora >= 0) & (row_lora < num_loras), row_lora, -1)
    ids = tl.arange(0, LORA_IDS)
    uses = row_lora[:, None] == ids[None, :]
    present = tl.max(uses.to(tl.int32), axis=0)
    slot_of = tl.sum(tl.where(ids[None, :] < ids[:, None], present[None, :], 0), axis=1)
    row_slot = tl.where(row_lora >= 0, tl.sum(tl.where(uses, slot_of[None, :], 0), axis=1), -1)
    return row_lora, row_slot, present, slot_of, tl.sum(present, axis=0)


@triton.jit
def _stack(base, stride_l, stride_row, present, slot_of, first_slot, LORA_IDS: tl.constexpr,
           LORA_SLOTS: tl.constexpr, WIDTH: tl.constexpr, PARTS: tl.constexpr):
    """Rows of a stacked adapter operand: slots [first_slot, first_slot + LORA_SLOTS), WIDTH rows each.

    With PARTS=2 (gate and up) the stack is [part 0 of every slot, part 1 of every slot], part p
    of a slot being its rows [p*WIDTH, (p+1)*WIDTH). Returns per stacked row
    [PARTS * LORA_SLOTS * WIDTH]: its pointer ``base + adapter * stride_l + row * stride_row``, its
    slot, and whether the slot is in use (rows of unused slots are never loaded).
    """
    offs = tl.arange(0, PARTS * LORA_SLOTS * WIDTH)
    in_part = offs % (LORA_SLOTS * WIDTH)
    slot = first_slot + in_part // WIDTH
    row = (offs // (LORA_SLOTS * WIDTH)) * WIDTH + offs % WIDTH
    ids = tl.arange(0, LORA_IDS)
    hit = (present[None, :] > 0) & (slot_of[None, :] == slot[:, None])
    adapter = tl.sum(tl.where(hit, ids[None, :], 0), axis=1).to(tl.int64)
    used = tl.max(hit.to(tl.int32), axis=1) > 0
    return base + adapter * stride_l + row * stride_row, slot, used


@triton.jit
def _own_rows(stacked, row_slot, stack_slot, row_scale, dtype):
    """A stacked product [BLOCK_M, STACK] -> each row keeps its own slot's columns, scaled, in ``dtype``.

    Column c of a stacked product is row @ (adapter of slot stack_slot[c]); only the row's own
    adapter's columns are its LoRA terms, the rest are zeroed.
    """
    mine = tl.where(row_slot[:, None] == stack_slot[None, :], stacked, tl.zeros_like(stacked))
    return (mine * row_scale[:, None]).to(dtype)


@triton.jit
def _slice_tile(rows, used, offs_n, n_valid):
    """[STACK, BLOCK_N]: the slice's columns of stacked adapter rows (``rows`` [STACK] pointers at column
    0, ``used``: the rows of slots in use; others load zeros)."""
    return tl.load(rows[:, None] + offs_n[None, :], mask=used[:, None] & n_valid[None, :], other=0.0)


@triton.jit
def _expand_gate_up(gate, up, shrink_gate, shrink_up, b13_rows, b13_up, b13_used, offs_n, n_valid):
    """gate += shrink_gate @ B13t[stack, slice], up += shrink_up @ B13t[stack + R, slice].

    ``shrink_*`` [BLOCK_M, STACK] hold each row's own (scaled) shrinks; ``b13_rows`` [STACK] point at
    the gate rows of B13t, ``b13_up`` is the offset from a gate row to its up row. (Each load is
    followed by its product: loading both first raised sm_90 spills at 64-row tiles, 22 -> 34.)
    """
    gate = tl.dot(shrink_gate, _slice_tile(b13_rows, b13_used, offs_n, n_valid), gate, input_precision="ieee")
    up = tl.dot(shrink_up, _slice_tile(b13_rows + b13_up, b13_used, offs_n, n_valid), up, input_precision="ieee")
    return gate, up


@triton.jit
def _down_shrink(y, a2_tile, row_slot, stack_slot, row_scale):
    """Stacked down shrink of one slice, y @ a2_tile^T [BLOCK_M, STACK] (``a2_tile``: the slice's
    stacked A2 rows [STACK, BLOCK_N]), each row's own slot kept."""
    stacked = tl.dot(y, tl.trans(a2_tile), input_precision="ieee")
    return _own_rows(stacked, row_slot, stack_slot, row_scale, y.dtype)


@triton.jit
def _own_shrink(y, a2_tile, row_slot, stack_slot, LORA_SLOTS: tl.constexpr, LORA_RANK: tl.constexpr):
    """[BLOCK_M, LORA_RANK] fp32, unscaled: each row's down shrink of one slice, ``y @ A2[own adapter, :,
    slice]^T`` (``a2_tile``: the slice's stacked A2 rows [STACK, BLOCK_N]; rows whose slot is not in the
    stack get zeros)."""
    stacked = tl.dot(y, tl.trans(a2_tile), input_precision="ieee")
    mine = tl.where(row_slot[:, None] == stack_slot[None, :], stacked, tl.zeros_like(stacked))
    return tl.sum(tl.reshape(mine, [y.shape[0], LORA_SLOTS, LORA_RANK]), axis=1)


@triton.jit
def _shrink_step(a, la_rows, la_used, k, k_valid, shrink):
    """One K step of the stacked LoRA shrink: shrink += a @ A[la_rows, k]^T (``a``: the x tile already loaded)."""
    la = tl.load(la_rows[:, None] + k[None, :], mask=la_used[:, None] & k_valid[None, :], other=0.0)
    return tl.dot(a, tl.trans(la), shrink, input_precision="ieee")


@triton.jit
def _split_gate_up(shrink, BLOCK_M: tl.constexpr, STACK: tl.constexpr):
    """[BLOCK_M, 2*STACK] (gate stack, then up stack) -> the two [BLOCK_M, STACK] halves."""
    return tl.split(tl.permute(tl.reshape(shrink, [BLOCK_M, 2, STACK]), (0, 2, 1)))


@triton.jit
def _batch_lora_tokens(num_lora_tokens_ptr, PDL: tl.constexpr):
    """The two-stage LoRA kernels' prologue: with PDL, wait for the previous launch (see
    ``dependent_launch_prologue``); then the sort's count of tokens with an adapter. When it is 0
    every program exits at once (a batch passed with adapters whose tokens all have -1)."""
    dependent_launch_prologue(PDL)
    return tl.load(num_lora_tokens_ptr)


@triton.jit
def _tile_rows(token_lora_ids_ptr, sorted_token_ids_ptr, sorted_expert_ids_ptr, num_sorted_tiles_ptr, tile,
               num_tokens, num_loras, BLOCK_M: tl.constexpr, LORA_IDS: tl.constexpr):
    """A tile's rows and adapters, for the two-stage LoRA kernels (after ``_batch_lora_tokens``).

    Returns expert (int64; -1 when the tile has nothing to do: beyond the sorted tiles, a gap
    tile, or no row with an adapter), offs_m [BLOCK_M] (sorted rows), token [BLOCK_M] (int64),
    row_valid, and ``_tile_slots``'s row_lora, row_slot, present, slot_of and num_present.
    """
    offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    # Entries past the sorted tiles are stale (the grid is sized for the worst routing): loaded, never used.
    expert = tl.load(sorted_expert_ids_ptr + tile).to(tl.int64)
    expert = tl.where(tile < tl.load(num_sorted_tiles_ptr), expert, -1)
    token = tl.load(sorted_token_ids_ptr + offs_m)
    # (a scalar condition folded into the bound: the interpreter rejects masks made by `scalar & block`)
    row_valid = token < tl.where(expert >= 0, num_tokens, 0)
    token = token.to(tl.int64)
    row_lora, row_slot, present, slot_of, num_present = _tile_slots(token_lora_ids_ptr, token, row_valid, num_loras,
                                                                    batch_has_lora=True, LORA_IDS=LORA_IDS)
    expert = tl.where(num_present > 0, expert, -1)
    return expert, offs_m, token, row_valid, row_lora, row_slot, present, slot_of, num_present


@triton.jit
def _split_share(length, BLOCK: tl.constexpr):
    """[begin, end) of this program's share of ``length`` (whole BLOCK steps) when program_id(1) of
    num_programs(1) splits it; empty for trailing splits when the steps do not divide evenly."""
    per_split = tl.cdiv(tl.cdiv(length, tl.num_programs(1)), BLOCK) * BLOCK
    begin = tl.program_id(1) * per_split
    return begin, tl.minimum(begin + per_split, length)


@triton.jit
def _lora_shrink_kernel(
    a_ptr,  # gate/up: x [M, K=H]; DOWN: y [num_grid_tiles * BLOCK_M, K=I] in sorted-row order
    token_lora_ids_ptr,  # [M] int32 adapter per token, -1 = none
    lora_a_ptr,  # gate/up: A13 [L, E, 2*LORA_RANK, H_pad]; DOWN: A2 [L, E, LORA_RANK, I_pad]
    shrink_ptr,  # [num_splits, num_grid_tiles * BLOCK_M, PARTS * LORA_RANK] float32: partial shrinks
    sorted_token_ids_ptr,  # [num_grid_tiles * BLOCK_M] int32, padding = M
    sorted_expert_ids_ptr,  # [num_grid_tiles] int32, -1 on gap tiles
    num_sorted_tiles_ptr,  # [1] int32
    num_lora_tokens_ptr,  # [1] int32: tokens with an adapter (from the sort)
    num_tokens,  # M
    K,  # shrink length: H (gate/up) or I (down)
    num_loras,
    stride_a_m,
    stride_la_l,
    stride_la_e,
    stride_la_r,
    stride_shrink_split,
    DOWN: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    LORA_RANK: tl.constexpr,  # padded rank
    LORA_IDS: tl.constexpr,
    LORA_SLOTS: tl.constexpr,
    PDL: tl.constexpr,  # launched as a programmatic dependent of the previous launch (CUDA sm_90+)
):
    """Grid: (num_grid_tiles, num_splits). Program (tile, split) shrinks the split-th share of K:
    ``shrink[split, row, part * R + r] = (a_row @ A[adapter of row, part * R + r, share]^T)`` (unscaled),
    for the rows with an adapter only (``_lora_expand_kernel`` sums the splits and reads no other row).
    Splitting K keeps the serial loop short at small batches, where few tiles would each walk all of
    H or I; every split also writes zeros for an empty share, so no partial is left unset."""
    if _batch_lora_tokens(num_lora_tokens_ptr, PDL) == 0:
        return
    expert, offs_m, token, row_valid, row_lora, row_slot, present, slot_of, num_present = _tile_rows(
        token_lora_ids_ptr, sorted_token_ids_ptr, sorted_expert_ids_ptr, num_sorted_tiles_ptr, tl.program_id(0),
        num_tokens, num_loras, BLOCK_M, LORA_IDS)
    if expert < 0:
        return
    k_begin, k_end = _split_share(K, BLOCK_K)
    PARTS: tl.constexpr = 1 if DOWN else 2
    STACK: tl.constexpr = LORA_SLOTS * LORA_RANK
    if DOWN:
        a_rows = a_ptr + offs_m.to(tl.int64) * stride_a_m
    else:
        a_rows = a_ptr + token * stride_a_m
    offs_k = tl.arange(0, BLOCK_K)
    a_expert = lora_a_ptr + expert * stride_la_e
    split = tl.program_id(1).to(tl.int64)
    dst_rows = shrink_ptr + split * stride_shrink_split + offs_m.to(tl.int64) * (PARTS * LORA_RANK)
    # More than LORA_SLOTS adapters in a tile: one shrink per slot group.
    for first_slot in range(0, num_present, LORA_SLOTS):
        la_rows, a_slot, la_used = _stack(a_expert, stride_la_l, stride_la_r, present, slot_of, first_slot, LORA_IDS,
                                          LORA_SLOTS, LORA_RANK, PARTS)
        shrink = tl.zeros([BLOCK_M, PARTS * STACK], dtype=tl.float32)
        for k0 in range(k_begin, k_end, BLOCK_K):
            k = k0 + offs_k
            k_valid = k < k_end
            a = tl.load(a_rows[:, None] + k[None, :], mask=row_valid[:, None] & k_valid[None, :], other=0.0)
            shrink = _shrink_step(a, la_rows, la_used, k, k_valid, shrink)
        # Each row stores only its own slot's columns: stacked column c (part c // STACK, rank index
        # c % R) is its entry part * R + r.
        cols = tl.arange(0, PARTS * STACK)
        entry = (cols // STACK) * LORA_RANK + cols % LORA_RANK
        own = row_valid[:, None] & (row_slot[:, None] == a_slot[None, :])
        tl.store(dst_rows[:, None] + entry[None, :], shrink, mask=own)


@triton.jit
def _summed_shrink(rows, row_slot, stack_slot, num_splits, stride_split, row_scale, dtype, LORA_RANK: tl.constexpr,
                   STACK: tl.constexpr):
    """[BLOCK_M, STACK]: each row's shrink (``rows`` points at one part of its entries) summed over the
    splits, scaled, in the columns of its own slot (zeros elsewhere), in ``dtype``."""
    ptrs = rows[:, None] + (tl.arange(0, STACK) % LORA_RANK)[None, :]
    mine = row_slot[:, None] == stack_slot[None, :]
    total = tl.load(ptrs, mask=mine, other=0.0)
    for _ in range(1, num_splits):
        ptrs += stride_split
        total += tl.load(ptrs, mask=mine, other=0.0)
    return (total * row_scale[:, None]).to(dtype)


@triton.jit
def _rank_sums(rows, has_lora, num_splits, stride_split, LORA_RANK: tl.constexpr, SPLITS_PER_STEP: tl.constexpr):
    """[BLOCK_M, LORA_RANK] fp32: the R entries of each row with an adapter (``rows`` points at them,
    ``has_lora`` [BLOCK_M]) summed over ``num_splits`` partials, SPLITS_PER_STEP loaded at once (stage 2
    of the deltas in the stages sums one partial per I slice of stage 1: a hundred or more)."""
    ptrs = rows[None, :, None] + tl.arange(0, LORA_RANK)[None, None, :]
    splits = tl.arange(0, SPLITS_PER_STEP)
    total = tl.zeros([rows.shape[0], LORA_RANK], dtype=tl.float32)
    for first in range(0, num_splits, SPLITS_PER_STEP):
        split = first + splits
        step = tl.load(ptrs + (split.to(tl.int64) * stride_split)[:, None, None],
                       mask=has_lora[None, :, None] & (split < num_splits)[:, None, None], other=0.0)
        total += tl.sum(step, axis=0)
    return total


@triton.jit
def _in_stack_columns(by_rank, row_slot, stack_slot, row_scale, dtype, LORA_RANK: tl.constexpr, STACK: tl.constexpr):
    """[BLOCK_M, STACK]: each row's R values (``by_rank`` [BLOCK_M, R]) scaled, in the columns of its own
    slot of a stack (``stack_slot`` [STACK]), zeros elsewhere, in ``dtype``."""
    spread = tl.reshape(tl.broadcast_to(by_rank[:, None, :], [by_rank.shape[0], STACK // LORA_RANK, LORA_RANK]),
                        [by_rank.shape[0], STACK])
    mine = row_slot[:, None] == stack_slot[None, :]
    return (tl.where(mine, spread, 0.0) * row_scale[:, None]).to(dtype)


@triton.jit
def _lora_expand_kernel(
    shrink_ptr,  # [num_splits, num_grid_tiles * BLOCK_M, PARTS * LORA_RANK] float32 from _lora_shrink_kernel
    token_lora_ids_ptr,  # [M] int32 adapter per token, -1 = none
    lora_b_ptr,  # gate/up: B13t [L, E, 2*LORA_RANK, I_pad]; DOWN: B2t [L, E, LORA_RANK, H_pad]
    lora_scaling_ptr,  # [L] float32
    dst_ptr,  # gate/up: delta13 [num_grid_tiles * BLOCK_M, 2*I] (stored); DOWN: out [M, H] (atomic adds)
    sorted_token_ids_ptr,  # [num_grid_tiles * BLOCK_M] int32, padding = M
    sorted_expert_ids_ptr,  # [num_grid_tiles] int32, -1 on gap tiles
    num_sorted_tiles_ptr,  # [1] int32
    num_lora_tokens_ptr,  # [1] int32: tokens with an adapter (from the sort)
    num_tokens,  # M
    N,  # output columns per part: I (gate/up) or H (down)
    num_loras,
    num_shrink_splits,  # splits of the shrink kernel's launch
    stride_shrink_split,
    stride_dst_m,
    stride_lb_l,
    stride_lb_e,
    stride_lb_r,
    DOWN: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    LORA_RANK: tl.constexpr,  # padded rank
    LORA_IDS: tl.constexpr,
    LORA_SLOTS: tl.constexpr,
    PDL: tl.constexpr,  # launched as a programmatic dependent of the previous launch (CUDA sm_90+)
):
    """Grid: (num_grid_tiles, num_splits); program (tile, split) expands the split-th share of the N
    columns: ``dst[row, part * N + n] (+)= scale * shrink[row, part] @ B[adapter, part, n]``. Tiles
    without adapters (all tiles, when the batch has none) exit at once; rows without an adapter are
    neither written nor added to (stage 1 masks them)."""
    if _batch_lora_tokens(num_lora_tokens_ptr, PDL) == 0:
        return
    expert, offs_m, token, row_valid, row_lora, row_slot, present, slot_of, num_present = _tile_rows(
        token_lora_ids_ptr, sorted_token_ids_ptr, sorted_expert_ids_ptr, num_sorted_tiles_ptr, tl.program_id(0),
        num_tokens, num_loras, BLOCK_M, LORA_IDS)
    if expert < 0:
        return
    n_begin, n_end = _split_share(N, BLOCK_N)
    row_scale = tl.load(lora_scaling_ptr + row_lora, mask=row_lora >= 0, other=0.0)
    PARTS: tl.constexpr = 1 if DOWN else 2
    STACK: tl.constexpr = LORA_SLOTS * LORA_RANK
    if DOWN:
        dst_rows = dst_ptr + token * stride_dst_m
    else:
        dst_rows = dst_ptr + offs_m.to(tl.int64) * stride_dst_m
    dtype = lora_b_ptr.dtype.element_ty
    shrink_rows = shrink_ptr + offs_m.to(tl.int64) * (PARTS * LORA_RANK)
    b_expert = lora_b_ptr + expert * stride_lb_e
    for first_slot in range(0, num_present, LORA_SLOTS):
        lb_rows, lb_slot, lb_used = _stack(b_expert, stride_lb_l, stride_lb_r, present, slot_of, first_slot, LORA_IDS,
                                           LORA_SLOTS, LORA_RANK, PARTS=1)
        rows = (_in_group(row_slot, first_slot, LORA_SLOTS) & row_valid)[:, None]
        if DOWN:
            own = _summed_shrink(shrink_rows, row_slot, lb_slot, num_shrink_splits, stride_shrink_split, row_scale,
                                 dtype, LORA_RANK, STACK)
            for n0 in range(n_begin, n_end, BLOCK_N):
                offs_n = n0 + tl.arange(0, BLOCK_N)
                n_valid = offs_n < n_end
                lb = tl.load(lb_rows[:, None] + offs_n[None, :], mask=lb_used[:, None] & n_valid[None, :], other=0.0)
                delta = tl.dot(own, lb, input_precision="ieee")
                tl.atomic_add(dst_rows[:, None] + offs_n[None, :], delta.to(dst_ptr.dtype.element_ty),
                              mask=rows & n_valid[None, :], sem="relaxed")
        else:
            own_gate = _summed_shrink(shrink_rows, row_slot, lb_slot, num_shrink_splits, stride_shrink_split,
                                      row_scale, dtype, LORA_RANK, STACK)
            own_up = _summed_shrink(shrink_rows + LORA_RANK, row_slot, lb_slot, num_shrink_splits,
                                    stride_shrink_split, row_scale, dtype, LORA_RANK, STACK)
            for n0 in range(n_begin, n_end, BLOCK_N):
                offs_n = n0 + tl.arange(0, BLOCK_N)
                n_valid = offs_n < n_end
                mask = lb_used[:, None] & n_valid[None, :]
                lb_gate = tl.load(lb_rows[:, None] + offs_n[None, :], mask=mask, other=0.0)
                lb_up = tl.load(lb_rows[:, None] + LORA_RANK * stride_lb_r + offs_n[None, :], mask=mask, other=0.0)
                dst = dst_rows[:, None] + offs_n[None, :]
                store_mask = rows & n_valid[None, :]
                tl.store(dst, tl.dot(own_gate, lb_gate, input_precision="ieee").to(dtype), mask=store_mask)
                tl.store(dst + N, tl.dot(own_up, lb_up, input_precision="ieee").to(dtype), mask=store_mask)


@triton.jit
def _in_group(row_slot, first_slot, LORA_SLOTS: tl.constexpr):
    """Rows whose slot belongs to the group [first_slot, first_slot + LORA_SLOTS)."""
    return (row_slot >= first_slot) & (row_slot < first_slot + LORA_SLOTS)
