"""Sorting kernel: per-token routing -> expert-major tiles of BLOCK_M rows, in one launch.

Contract (worked example, M=4 tokens, topk=2, E=4 experts, block_m=4)::

    topk_ids     = [[2, 0], [2, 3], [0, 2], [2, 2]]      # token 3 picked expert 2 twice
    topk_weights = [[.6, .4], [.7, .3], [.5, .5], [.9, .1]]

    sorted_token_ids  = [0, 2, 4, 4,  4, 4, 4, 4,  0, 1, 2, 3,  3, 4, 4, 4,  1, 4, 4, 4,  4, 4, 4, 4]
    sorted_weights    = [.4, .5, 0, 0,  0, 0, 0, 0,  .6, .7, .5, .9,  .1, 0, 0, 0,  .3, 0, 0, 0,  0, 0, 0, 0]
    sorted_expert_ids = [0, -1, 2, 2, 3, -1]
    num_tokens_post_padded = [24],  num_sorted_tiles = [6]

* ids are **actual token ids** (not token*topk+slot); padding id is M (here 4), weight 0;
* experts appear in increasing order, each expert's entries in increasing (token, slot) order,
  padded to a multiple of block_m; experts with no tokens get no tile of their own (expert 1);
* **gap tiles** (expert id -1, padding rows) may sit between experts' tiles (tiles 1 and 5
  above). Consumers skip tiles whose expert is -1; ``num_sorted_tiles`` counts them, and is
  ``entries // block_m + min(E, entries)`` for ``entries`` kept routing entries;
* buffers are sized for the worst case, ``max_busy_tiles = M*topk // block_m + min(E, M*topk)``
  tiles, so shapes never depend on the routing (CUDA-graph safe); entries past
  ``num_tokens_post_padded`` hold the padding id, tiles past ``num_sorted_tiles`` hold -1;
* with ``expert_map`` (global id -> local id or -1), entries whose expert maps to -1 are
  dropped and tiles carry local ids. Any id outside ``[0, E)`` after mapping (for example -1)
  is dropped too.

Design: program ``e < E`` owns expert ``e`` and the tiles
``[floor(A(e) / block_m) + min(e, A(e)), same at e + 1)``, where ``A(e)`` counts the kept
entries of experts ``< e``. That range holds the expert's ``ceil(count / block_m)`` tiles (the
floor term grows by at least ``ceil(count / block_m) - 1``, the min term by at least 1 when the
expert has entries); the rest are gap tiles. One pass of comparisons gives ``A(e)``, so no
program builds the full per-expert histogram that a dense layout needs (Triton has no grid-wide
barrier to share one, and this keeps the sort to a single launch). The program then scans the
routing again, scatters its own entries with a running prefix sum, counting them as it goes,
and pads its range. Where the scan has 2 steps or more, an expert gets 2 programs that each
scatter half of the steps (``sort_programs``). Up to ``MAX_ZERO_PROGRAMS`` extra programs,
placed after the expert programs, zero the output buffer. With adapters (``fused_moe(...,
lora=...)``) one more program, the last, counts the tokens that have one (``num_lora_tokens``):
the LoRA kernels read that count first, so a batch whose tokens all have -1 skips their adapter
work.

Measured (Qwen3-30B-A3B routing, E=128, topk=8, M=4096, zeroing a 16 MB output). Dense layout,
H200: 256 zeroing programs launched before the expert programs took the sort from 34 us (no
zeroing) to 59 us; 64 programs launched after them take 37 us, of which 27 us were a histogram
pass (``tl.histogram``, bound by its shared-memory atomics). This layout, H100: 33 us with
pass 1 counting three keys per entry under a mask (294 SASS instructions per 4096-entry step
at 8 warps), 28 us with one unsigned comparison per entry and unmasked full steps (79
instructions), 23 us with 2 programs per expert at 4 warps (``sort_programs``). The scatter
(pass 2, about 650 instructions per step: a block-wide prefix sum and the stores' layout
conversions through shared memory) is what is left; splitting each step into rows scanned
within a warp kept Triton's store layout across warps and saved 25% of its instructions at
twice the counting cost.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from ..grid_dependency import gdc_launch_dependents
from ..multiprocessors import num_multiprocessors
from .._validation import (
    FLOAT_DTYPES,
    ID_DTYPES,
    check_out_overlaps,
    check_positive_int,
    check_same_device,
    check_tensor,
    on_device,
)

# Output zeroing: elements per store and the most programs that zero (each loops).
ZERO_BLOCK = 8192
MAX_ZERO_PROGRAMS = 64
MAX_SCAN_BLOCK = 4096


@dataclass
class MoESortingResult:
    """Device tensors produced by :func:`moe_sorting` (all on the routing tensors' device)."""

    sorted_token_ids: torch.Tensor  # int32 [max_num_tokens_padded]: token id, padding = M
    sorted_weights: torch.Tensor  # float32 [max_num_tokens_padded]: routing weight, padding = 0
    sorted_expert_ids: torch.Tensor  # int32 [max_num_tokens_padded // block_m]: local expert per tile, -1 on gap tiles and past the end
    num_tokens_post_padded: torch.Tensor  # int32 [1]: rows in use (padded expert tiles and gap tiles)
    num_sorted_tiles: torch.Tensor  # int32 [1]: tiles in use = num_tokens_post_padded // block_m
    block_m: int  # rows per tile
    num_tokens: int  # M, also the padding id
    # int32 [1], only when allocated with count_lora_tokens: tokens whose adapter id is in [0, num_loras)
    num_lora_tokens: Optional[torch.Tensor] = None

    @classmethod
    def allocate(cls, num_entries: int, num_experts: int, block_m: int, num_tokens: int, device,
                 count_lora_tokens: bool = False) -> "MoESortingResult":
        """Uninitialised worst-case buffers for ``num_entries = M*topk`` routing entries (and, with
        ``count_lora_tokens``, the adapter token count that the sort then writes)."""
        max_padded = max_num_tokens_padded(num_entries, num_experts, block_m)
        return cls(
            sorted_token_ids=torch.empty(max_padded, dtype=torch.int32, device=device),
            sorted_weights=torch.empty(max_padded, dtype=torch.float32, device=device),
            sorted_expert_ids=torch.empty(max_padded // block_m, dtype=torch.int32, device=device),
            num_tokens_post_padded=torch.empty(1, dtype=torch.int32, device=device),
            num_sorted_tiles=torch.empty(1, dtype=torch.int32, device=device),
            block_m=block_m,
            num_tokens=num_tokens,
            num_lora_tokens=torch.empty(1, dtype=torch.int32, device=device) if count_lora_tokens else None,
        )


def max_busy_tiles(num_entries: int, num_experts: int, block_m: int) -> int:
    """Most tiles (gap tiles included) any routing can use: ``num_entries // block_m + min(E,
    num_entries)``, reached when every entry is kept."""
    return num_entries // block_m + min(num_experts, num_entries)


def max_num_tokens_padded(num_entries: int, num_experts: int, block_m: int) -> int:
    """Worst-case sorted length: ``max_busy_tiles * block_m`` rows."""
    return max_busy_tiles(num_entries, num_experts, block_m) * block_m


@triton.jit
def _routed_sort_key(topk_ids_ptr, expert_map_ptr, token_lora_ids_ptr, offs, valid, num_global_experts,
                     num_loras, NUM_EXPERTS: tl.constexpr, HAS_EXPERT_MAP: tl.constexpr, TOPK: tl.constexpr,
                     LORA_KEYS: tl.constexpr):
    """Sort key (local expert) of each routing entry as uint32; dropped entries get a key >= NUM_EXPERTS.

    Callers compare keys with an expert ``e < NUM_EXPERTS`` only (``key < e``, ``key == e``), so any
    key outside ``[0, NUM_EXPERTS)`` (negative ids wrap to large unsigned values) is never counted:
    no separate keep mask. With LORA_KEYS the key is ``adapter * (NUM_EXPERTS // num_loras) +
    expert`` and entries of tokens without an adapter are dropped (the baseline's LoRA alignment).
    """
    if valid is None:  # a full step
        ids = tl.load(topk_ids_ptr + offs)  # int32 or int64
    else:
        ids = tl.load(topk_ids_ptr + offs, mask=valid, other=-1)
    if ids.dtype == tl.int64:  # range-check before narrowing: 2**32 + e must not become e
        ids = tl.where((ids >= 0) & (ids < num_global_experts), ids, -1).to(tl.int32)
    if HAS_EXPERT_MAP:
        in_range = (ids >= 0) & (ids < num_global_experts)
        ids = tl.load(expert_map_ptr + tl.where(in_range, ids, 0), mask=in_range, other=-1)
    if LORA_KEYS:
        num_base = NUM_EXPERTS // num_loras
        keep = (ids >= 0) & (ids < num_base)
        lora = tl.load(token_lora_ids_ptr + offs // TOPK, mask=keep, other=-1)
        keep = keep & (lora >= 0) & (lora < num_loras)
        ids = tl.where(keep, lora * num_base + ids, -1)
    return ids.to(tl.uint32, bitcast=True)


@triton.jit
def _store_lora_token_count(token_lora_ids_ptr, num_lora_tokens_ptr, num_tokens, num_loras,
                            SCAN_BLOCK: tl.constexpr):
    """num_lora_tokens = tokens whose adapter id is in [0, num_loras). The LoRA kernels read it first
    and, when it is 0, skip the tile's adapter ids (or, on the two-stage path, exit at once)."""
    count = tl.zeros([SCAN_BLOCK], dtype=tl.int32)
    for start in range(0, num_tokens, SCAN_BLOCK):
        offs = start + tl.arange(0, SCAN_BLOCK)
        lora = tl.load(token_lora_ids_ptr + offs, mask=offs < num_tokens, other=-1)
        count += ((lora >= 0) & (lora < num_loras)).to(tl.int32)
    tl.store(num_lora_tokens_ptr, tl.sum(count, axis=0))


@triton.jit
def _count_keys(topk_ids_ptr, expert_map_ptr, token_lora_ids_ptr, num_entries, num_global_experts, num_loras,
                expert_key, first_step, end_step, num_full_steps, COUNT_MINE: tl.constexpr, SCAN_BLOCK: tl.constexpr,
                NUM_EXPERTS: tl.constexpr, HAS_EXPERT_MAP: tl.constexpr, TOPK: tl.constexpr, LORA_KEYS: tl.constexpr):
    """Per-lane counts (two int32 ``[SCAN_BLOCK]``), over scan steps ``[first_step, end_step)``, of keys
    below ``expert_key`` and (with COUNT_MINE, else zeros) equal to it. Full steps load without a mask: the loop is bound by
    instruction issue, and at 8 warps a 4096-entry step takes 79 SASS instructions per thread
    unmasked, 106 masked (bounds checks and fill values)."""
    scan = tl.arange(0, SCAN_BLOCK)
    below = tl.zeros([SCAN_BLOCK], dtype=tl.int32)
    mine = tl.zeros([SCAN_BLOCK], dtype=tl.int32)
    for step in range(first_step, tl.minimum(end_step, num_full_steps)):
        offs = step * SCAN_BLOCK + scan
        key = _routed_sort_key(topk_ids_ptr, expert_map_ptr, token_lora_ids_ptr, offs, None, num_global_experts,
                               num_loras, NUM_EXPERTS, HAS_EXPERT_MAP, TOPK, LORA_KEYS)
        below += (key < expert_key).to(tl.int32)
        if COUNT_MINE:
            mine += (key == expert_key).to(tl.int32)
    for step in range(tl.maximum(first_step, num_full_steps), end_step):
        offs = step * SCAN_BLOCK + scan
        key = _routed_sort_key(topk_ids_ptr, expert_map_ptr, token_lora_ids_ptr, offs, offs < num_entries,
                               num_global_experts, num_loras, NUM_EXPERTS, HAS_EXPERT_MAP, TOPK, LORA_KEYS)
        below += (key < expert_key).to(tl.int32)
        if COUNT_MINE:
            mine += (key == expert_key).to(tl.int32)
    return below, mine


@triton.jit(do_not_specialize=["num_zero_programs", "num_parts"])
def _moe_sorting_kernel(
    topk_ids_ptr,  # [M * TOPK] int32/int64, row-major [M, TOPK]
    topk_weights_ptr,  # [M * TOPK] float
    expert_map_ptr,  # [num_global_experts] int32 (read only if HAS_EXPERT_MAP)
    token_lora_ids_ptr,  # [M] int32 (read only if LORA_KEYS or COUNT_LORA_TOKENS)
    sorted_token_ids_ptr,  # [max_num_padded] int32
    sorted_weights_ptr,  # [max_num_padded] float32
    sorted_expert_ids_ptr,  # [max_num_padded // BLOCK_M] int32
    num_tokens_post_padded_ptr,  # [1] int32
    num_sorted_tiles_ptr,  # [1] int32
    num_lora_tokens_ptr,  # [1] int32 (COUNT_LORA_TOKENS only)
    out_ptr,  # [out_numel] any dtype, zeroed when ZERO_OUT
    pad_id,  # id written into padding rows: M, or M * TOPK with EXPANDED_IDS
    num_entries,  # M * TOPK
    num_global_experts,
    max_num_padded,
    out_numel,
    num_zero_programs,  # programs that zero ``out`` (a runtime value: no recompile per batch size)
    num_parts,  # programs per expert: part p scatters the expert's entries in the p-th share of the scan steps
    num_loras,  # adapters (LORA_KEYS or COUNT_LORA_TOKENS only)
    # meta-parameters
    TOPK: tl.constexpr,
    NUM_EXPERTS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    SCAN_BLOCK: tl.constexpr,  # routing entries per step
    FILL_BLOCK: tl.constexpr,  # tail entries per store (the tail is up to min(E, M*TOPK)*BLOCK_M long)
    HAS_EXPERT_MAP: tl.constexpr,
    EXPANDED_IDS: tl.constexpr,  # store token*TOPK+slot (vLLM's convention, for the baseline) instead of token
    LORA_KEYS: tl.constexpr,  # sort by (adapter, expert): the baseline's LoRA alignment
    COUNT_LORA_TOKENS: tl.constexpr,  # one more program, the last, writes num_lora_tokens
    ZERO_OUT: tl.constexpr,
    ZERO_BLOCK: tl.constexpr,
    LAUNCH_DEPENDENTS: tl.constexpr = False,  # the next launch is a programmatic dependent (CUDA sm_90+)
):
    """Grid: (NUM_EXPERTS * num_parts + num_zero_programs [+ 1 with COUNT_LORA_TOKENS],). Programs
    ``e * num_parts + p`` sort expert e; the programs after them zero ``out`` (dispatched first, these
    delayed the sort: see the module docstring); the last one counts the tokens with an adapter."""
    if LAUNCH_DEPENDENTS:  # let the next kernel be scheduled now; it waits for this one's results itself
        gdc_launch_dependents()
    pid = tl.program_id(0)
    if COUNT_LORA_TOKENS:
        if pid == NUM_EXPERTS * num_parts + num_zero_programs:
            _store_lora_token_count(token_lora_ids_ptr, num_lora_tokens_ptr, num_entries // TOPK, num_loras,
                                    SCAN_BLOCK)
            return
    expert = pid // num_parts
    part = pid % num_parts
    if ZERO_OUT:
        if pid >= NUM_EXPERTS * num_parts:
            zero_pid = pid - NUM_EXPERTS * num_parts
            zero_offs = tl.arange(0, ZERO_BLOCK)
            zeros = tl.zeros([ZERO_BLOCK], dtype=out_ptr.dtype.element_ty)
            step = num_zero_programs.to(tl.int64) * ZERO_BLOCK
            for start in range(zero_pid.to(tl.int64) * ZERO_BLOCK, out_numel, step):
                offs = start + zero_offs
                tl.store(out_ptr + offs, zeros, mask=offs < out_numel)
            return
    scan = tl.arange(0, SCAN_BLOCK)
    expert_key = expert.to(tl.uint32)
    num_steps = tl.cdiv(num_entries, SCAN_BLOCK)
    num_full_steps = num_entries // SCAN_BLOCK  # steps past it (at most one) load under a mask
    steps_per_part = tl.cdiv(num_steps, num_parts)
    # With more parts than steps the spare parts start at the end: they count, scatter nothing and
    # (the last of them) pad; the clamp keeps their counting loops from walking past the entries.
    part_first_step = tl.minimum(part * steps_per_part, num_steps)
    part_end_step = tl.minimum(part_first_step + steps_per_part, num_steps)

    # Pass 1: entries of experts < e (A), and of e itself in the steps before this part's. The
    # expert's own count comes from pass 2, which needs its hits anyway.
    below, mine = _count_keys(topk_ids_ptr, expert_map_ptr, token_lora_ids_ptr, num_entries, num_global_experts,
                              num_loras, expert_key, 0, part_first_step, num_full_steps, True, SCAN_BLOCK,
                              NUM_EXPERTS, HAS_EXPERT_MAP, TOPK, LORA_KEYS)
    my_count_before_part = tl.sum(mine, axis=0)
    below_rest, _ = _count_keys(topk_ids_ptr, expert_map_ptr, token_lora_ids_ptr, num_entries, num_global_experts,
                                num_loras, expert_key, part_first_step, num_steps, num_full_steps, False, SCAN_BLOCK,
                                NUM_EXPERTS, HAS_EXPERT_MAP, TOPK, LORA_KEYS)
    num_below = tl.sum(below + below_rest, axis=0)
    # Expert e owns tiles [first_tile, next_first_tile): its own ceil(count / BLOCK_M), then gap tiles (-1).
    first_tile = num_below // BLOCK_M + tl.minimum(expert, num_below)

    # Pass 2: scatter this part's share of the expert's entries in (token, slot) order.
    rank_base = first_tile * BLOCK_M + my_count_before_part
    for step in range(part_first_step, part_end_step):
        offs = step * SCAN_BLOCK + scan
        key = _routed_sort_key(topk_ids_ptr, expert_map_ptr, token_lora_ids_ptr, offs, offs < num_entries,
                               num_global_experts, num_loras, NUM_EXPERTS, HAS_EXPERT_MAP, TOPK, LORA_KEYS)
        hit = key == expert_key
        hit_i32 = hit.to(tl.int32)
        dest = rank_base + tl.cumsum(hit_i32, axis=0) - 1
        weight = tl.load(topk_weights_ptr + offs, mask=hit, other=0.0).to(tl.float32)
        entry_id = offs if EXPANDED_IDS else offs // TOPK
        tl.store(sorted_token_ids_ptr + dest, entry_id.to(tl.int32), mask=hit)
        tl.store(sorted_weights_ptr + dest, weight, mask=hit)
        rank_base += tl.sum(hit_i32, axis=0)

    # The last part has seen all of the expert's entries: it pads the expert's last tile and its gap
    # tiles and labels both kinds of tile.
    if part == num_parts - 1:
        my_count = rank_base - first_tile * BLOCK_M
        my_tiles = tl.cdiv(my_count, BLOCK_M)
        next_first_tile = (num_below + my_count) // BLOCK_M + tl.minimum(expert + 1, num_below + my_count)
        pad_row = tl.arange(0, 2 * BLOCK_M)
        for start in range(rank_base, next_first_tile * BLOCK_M, 2 * BLOCK_M):
            pad_pos = start + pad_row
            pad_mask = pad_pos < next_first_tile * BLOCK_M
            tl.store(sorted_token_ids_ptr + pad_pos, tl.zeros([2 * BLOCK_M], dtype=tl.int32) + pad_id, mask=pad_mask)
            tl.store(sorted_weights_ptr + pad_pos, tl.zeros([2 * BLOCK_M], dtype=tl.float32), mask=pad_mask)
        for t in range(first_tile, next_first_tile, 2 * BLOCK_M):
            tiles = t + pad_row
            label = tl.where(tiles < first_tile + my_tiles, expert, -1)
            tl.store(sorted_expert_ids_ptr + tiles, label, mask=tiles < next_first_tile)

        # The last expert's range ends where all ranges end: it writes the counters and fills the
        # unused tail of the worst-case buffers.
        if expert == NUM_EXPERTS - 1:
            total_tiles = next_first_tile
            total_padded = total_tiles * BLOCK_M
            tl.store(num_tokens_post_padded_ptr, total_padded)
            tl.store(num_sorted_tiles_ptr, total_tiles)
            fill = tl.arange(0, FILL_BLOCK)
            for start in range(total_padded, max_num_padded, FILL_BLOCK):
                offs = start + fill
                tail = offs < max_num_padded
                tl.store(sorted_token_ids_ptr + offs, tl.zeros([FILL_BLOCK], dtype=tl.int32) + pad_id, mask=tail)
                tl.store(sorted_weights_ptr + offs, tl.zeros([FILL_BLOCK], dtype=tl.float32), mask=tail)
            max_tiles = max_num_padded // BLOCK_M
            for t in range(total_tiles, max_tiles, FILL_BLOCK):
                tiles = t + fill
                tl.store(sorted_expert_ids_ptr + tiles, tl.zeros([FILL_BLOCK], dtype=tl.int32) - 1,
                         mask=tiles < max_tiles)


def _check_sorting_args(topk_ids, topk_weights, num_experts, block_m, out, expert_map):
    check_tensor("topk_ids", topk_ids, ndim=2, dtypes=ID_DTYPES, shape_doc="[M, topk]")
    M, topk = topk_ids.shape
    check_tensor("topk_weights", topk_weights, dtypes=FLOAT_DTYPES, shape=(M, topk),
                 shape_doc=f"[M, topk] = [{M}, {topk}] like topk_ids")
    check_positive_int("num_experts", num_experts)
    check_positive_int("block_m", block_m)
    if topk < 1:
        raise ValueError(f"topk_ids must have at least one column (topk >= 1), got shape {tuple(topk_ids.shape)}")
    if block_m & (block_m - 1):
        raise ValueError(f"block_m must be a power of two, got {block_m}")
    if expert_map is not None:
        check_tensor("expert_map", expert_map, ndim=1, dtypes=(torch.int32,), shape_doc="[num_global_experts]")
        if expert_map.numel() < 1:
            raise ValueError("expert_map must have at least one entry")
    if out is not None:
        check_tensor("out", out, dtypes=None)
    check_same_device("topk_ids", topk_ids, topk_weights=topk_weights, expert_map=expert_map, out=out)
    check_out_overlaps(out, topk_ids=topk_ids, topk_weights=topk_weights, expert_map=expert_map)


def moe_sorting(
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    num_experts: int,
    block_m: int,
    *,
    out: Optional[torch.Tensor] = None,
    expert_map: Optional[torch.Tensor] = None,
) -> MoESortingResult:
    """Sorts routing into expert-major tiles and zeroes ``out``, in one kernel launch.

    Args:
        topk_ids: int32/int64 ``[M, topk]``, expert per (token, slot); global ids if ``expert_map``.
        topk_weights: float32 (or bf16/fp16) ``[M, topk]`` routing weights.
        num_experts: E, the number of (local) experts, i.e. ``w1.shape[0]``.
        block_m: rows per tile (a power of two), the fused kernel's BLOCK_M.
        out: optional contiguous tensor of any dtype, set to zero by the same launch.
        expert_map: optional int32 ``[E_global]``, global expert id -> local id or -1 (dropped).

    Returns:
        :class:`MoESortingResult`; see the module docstring for the exact contract.
    """
    _check_sorting_args(topk_ids, topk_weights, num_experts, block_m, out, expert_map)
    M, topk = topk_ids.shape
    result = MoESortingResult.allocate(M * topk, num_experts, block_m, M, topk_ids.device)
    launch_moe_sorting(topk_ids, topk_weights, num_experts, expert_map, result, out)
    return result


def sort_programs(num_keys: int, num_entries: int, num_compute_units: int) -> Tuple[int, int]:
    """``(num_parts, num_warps)`` of the sorting kernel: programs per expert (sort key) and warps
    per program.

    2 parts when the scan has at least 2 steps: each part still counts all entries (pass 1) but
    scatters only half of them (pass 2, the costlier). 8 warps when the expert programs fit
    one per multiprocessor and a step holds ``MAX_SCAN_BLOCK`` entries; else 4, which lets more
    programs share a multiprocessor. Sort with zeroing in us, ``python -m fmoe2.bench.sort_settings``
    (``misc/bench/sort``, 2026-11-24, median of 5 interleaved rounds; E experts, top-k k; parts p,
    warps w; the shipped choice starred):

    ==============  ==========  ==========  ==========  ==========
    E, k, M         p1 w4       p2 w4       p1 w8       p2 w8
    ==============  ==========  ==========  ==========  ==========
    H100
    32, 4, 4096     14.4        9.3         13.1        8.3*
    64, 6, 1024     8.9         6.9         8.0         6.4*
    64, 6, 4096     20.4        16.9        18.3        16.1*
    128, 8, 1024    9.1         7.8*        8.6         7.8
    128, 8, 4096    29.6        23.3*       28.0        27.1
    128, 8, 8192    57.7        43.3*       54.3        54.5
    160, 6, 4096    31.2        28.3*       29.3        29.5
    256, 8, 4096    56.6        53.6*       56.7        52.7
    H200
    64, 6, 4096     20.6        15.5        18.2        14.5*
    128, 8, 4096    28.3        22.2*       26.4        27.2
    160, 6, 4096    30.1        28.3*       28.5        25.8
    ==============  ==========  ==========  ==========  ==========

    3, 4 and 6 parts were at most 0.1 us faster than 1 or 2 parts, except at E=64, M=4096 (H100
    13.9 us, H200 13.6 us with 4 parts at 8 warps; the rule keeps 2). Mixtral (E=8) is bound by
    zeroing its 32 MB output at M=4096 (10.4-12.0 us in every setting of 1-2 parts).

    ``num_compute_units``: the GPU's multiprocessors (compute units on ROCm; ``num_multiprocessors``).
    """
    scan_block = scan_block_size(num_entries)
    num_parts = 2 if triton.cdiv(num_entries, scan_block) >= 2 else 1
    wide = scan_block == MAX_SCAN_BLOCK and num_keys * num_parts <= num_compute_units
    return num_parts, 8 if wide else 4


def scan_block_size(num_elements: int) -> int:
    """Elements per step of a loop over ``num_elements`` (``SCAN_BLOCK`` for the routing entries,
    ``FILL_BLOCK`` for the buffers' tail): all of them, as a power of two from 16 up to
    ``MAX_SCAN_BLOCK``."""
    return min(max(triton.next_power_of_2(num_elements), 16), MAX_SCAN_BLOCK)


def sorting_kernel_launch(topk_ids, topk_weights, num_experts: int, expert_map, result: MoESortingResult, out,
                          expanded_ids: bool = False, token_lora_ids=None, num_loras: int = 0,
                          lora_keys: bool = False, num_parts: Optional[int] = None, launch_dependents: bool = False,
                          num_warps: Optional[int] = None):
    """Grid, arguments and constexprs of the sorting kernel (shared by the launcher and ``fmoe2.codegen``).

    ``expanded_ids`` stores ``token*topk+slot`` with padding ``M*topk`` (vLLM's convention), used
    by the baseline in ``fmoe2.bench``; fmoe2 itself stores actual token ids. ``token_lora_ids``
    (int32 ``[M]``, with ``num_loras`` adapters) is read in two cases: where ``result`` has
    ``num_lora_tokens`` (fmoe2 with adapters) the sort counts the tokens with an adapter into it;
    with ``lora_keys`` the sort keys are ``adapter * num_experts + expert`` (``num_loras *
    num_experts`` keys; ``result`` must be allocated for that many) and tokens without an adapter
    are dropped: the baseline's LoRA alignment. ``launch_dependents``: the next launch is a
    programmatic dependent (``FusedMoEConfig.pdl``); the sort lets it be scheduled at once.
    ``num_parts``/``num_warps`` override :func:`sort_programs` (tests, ``fmoe2.bench.sort_settings``).
    """
    count_lora_tokens = result.num_lora_tokens is not None
    if (lora_keys or count_lora_tokens) != (token_lora_ids is not None):
        raise ValueError("token_lora_ids goes with lora_keys=True or a result allocated with count_lora_tokens=True "
                         f"(lora_keys={lora_keys}, count_lora_tokens={count_lora_tokens}, token_lora_ids "
                         f"{'given' if token_lora_ids is not None else 'None'})")
    M, topk = topk_ids.shape
    num_entries = M * topk
    out_numel = out.numel() if out is not None else 0
    num_zero_programs = min(triton.cdiv(out_numel, ZERO_BLOCK), MAX_ZERO_PROGRAMS)
    num_keys = num_experts * num_loras if lora_keys else num_experts
    scan_block = scan_block_size(num_entries)
    auto_parts, auto_warps = sort_programs(num_keys, num_entries, num_multiprocessors(topk_ids.device))
    num_parts = auto_parts if num_parts is None else num_parts
    num_warps = auto_warps if num_warps is None else num_warps
    grid = (num_keys * num_parts + num_zero_programs + int(count_lora_tokens),)
    args = dict(
        topk_ids_ptr=topk_ids,
        topk_weights_ptr=topk_weights,
        # Unused pointers get a harmless stand-in (never dereferenced when the flag is off).
        expert_map_ptr=expert_map if expert_map is not None else result.sorted_expert_ids,
        token_lora_ids_ptr=token_lora_ids if token_lora_ids is not None else result.sorted_expert_ids,
        sorted_token_ids_ptr=result.sorted_token_ids,
        sorted_weights_ptr=result.sorted_weights,
        sorted_expert_ids_ptr=result.sorted_expert_ids,
        num_tokens_post_padded_ptr=result.num_tokens_post_padded,
        num_sorted_tiles_ptr=result.num_sorted_tiles,
        num_lora_tokens_ptr=result.num_lora_tokens if count_lora_tokens else result.num_sorted_tiles,
        out_ptr=out if out is not None else result.sorted_weights,
        pad_id=num_entries if expanded_ids else M,
        num_entries=num_entries,
        num_global_experts=expert_map.numel() if expert_map is not None else num_experts,
        max_num_padded=result.sorted_token_ids.numel(),
        out_numel=out_numel,
        num_zero_programs=num_zero_programs,
        num_parts=num_parts,
        num_loras=num_loras,
    )
    constexprs = dict(
        TOPK=topk,
        NUM_EXPERTS=num_keys,
        BLOCK_M=result.block_m,
        SCAN_BLOCK=scan_block,
        FILL_BLOCK=scan_block_size(result.sorted_token_ids.numel()),
        HAS_EXPERT_MAP=expert_map is not None,
        EXPANDED_IDS=expanded_ids,
        LORA_KEYS=lora_keys,
        COUNT_LORA_TOKENS=count_lora_tokens,
        ZERO_OUT=num_zero_programs > 0,
        ZERO_BLOCK=ZERO_BLOCK,
        LAUNCH_DEPENDENTS=launch_dependents,
    )
    return grid, args, constexprs, {"num_warps": num_warps}


def launch_moe_sorting(topk_ids, topk_weights, num_experts: int, expert_map, result: MoESortingResult, out,
                       expanded_ids: bool = False, token_lora_ids=None, num_loras: int = 0, lora_keys: bool = False,
                       num_parts: Optional[int] = None, launch_dependents: bool = False,
                       num_warps: Optional[int] = None) -> None:
    """Launches the sorting kernel into the preallocated ``result`` buffers.

    Internal: arguments are assumed checked by :func:`moe_sorting` or :func:`fmoe2.fused_moe`.
    """
    grid, args, constexprs, options = sorting_kernel_launch(topk_ids, topk_weights, num_experts, expert_map, result,
                                                            out, expanded_ids, token_lora_ids, num_loras, lora_keys,
                                                            num_parts, launch_dependents, num_warps)
    with on_device(topk_ids):
        _moe_sorting_kernel[grid](**args, **constexprs, **options)
