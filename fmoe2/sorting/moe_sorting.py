"""Sorting kernel: per-token routing -> expert-major tiles of BLOCK_M rows, in one launch (two for
large batches of many experts).

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
barrier to share one, and this keeps the sort to a single launch; large batches of many experts
take the chunked sort below, which shares it through a second launch). The program then scans the
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

Chunked (two-launch) sort: the one-launch sort's work grows with ``E * M * topk`` (every
expert's program scans every entry: 43.6 us for Qwen3 at M=8192 on the H100). Where
``sort_chunk_size`` says so, a first launch (``_count_chunk_keys_kernel``) counts each sort key
in every chunk of 256-1024 routing entries into a small table (``chunk_key_counts``, the only
extra buffer), and the main kernel then runs with ``CHUNKED``: one program per chunk reads the
table (the key totals give every expert's first row, the counts of earlier chunks the chunk's
offset within it), sorts its chunk's ``key * chunk_size + position`` with ``tl.sort`` and writes
each entry once; one program per expert only pads and labels its tiles. Same buffers, bit for
bit (tests compare both). With PDL the scatter launch is a programmatic dependent of the count
launch: its zeroing programs start while the counts are taken. Qwen3 M=8192: 20.5 us, M=4096:
11.2 us (23.4 in one launch); see ``sort_chunk_size``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from ..grid_dependency import gdc_launch_dependents, gdc_wait
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
# Chunked mode (``sort_chunk_size``): the most elements of the per-chunk count table loaded at a
# time, the largest table the chunk size is picked for, and warps of both launches.
MAX_COUNT_TILE = 4096
MAX_COUNT_TABLE = 8192
CHUNKED_SORT_WARPS = 4


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
    # Chunked mode only (``chunk_size > 0``): int32 [num_chunks, key_block], kept entries per sort key
    # in each chunk of ``chunk_size`` routing entries, written by the first of the sort's two launches
    chunk_key_counts: Optional[torch.Tensor] = None
    chunk_size: int = 0  # routing entries per chunk; 0: the sort is one launch

    @classmethod
    def allocate(cls, num_entries: int, num_experts: int, block_m: int, num_tokens: int, device,
                 count_lora_tokens: bool = False, chunk_size: Optional[int] = None) -> "MoESortingResult":
        """Uninitialised worst-case buffers for ``num_entries = M*topk`` routing entries (and, with
        ``count_lora_tokens``, the adapter token count that the sort then writes). ``num_experts``
        is the number of sort keys. ``chunk_size``: routing entries per chunk of the two-launch
        sort (a power of two), 0 for the one-launch sort; default ``sort_chunk_size``'s rule."""
        max_padded = max_num_tokens_padded(num_entries, num_experts, block_m)
        if chunk_size is None:
            chunk_size = sort_chunk_size(num_experts, num_entries)
        if chunk_size < 0 or chunk_size & (chunk_size - 1):
            raise ValueError(f"chunk_size must be 0 or a power of two, got {chunk_size}")
        return cls(
            sorted_token_ids=torch.empty(max_padded, dtype=torch.int32, device=device),
            sorted_weights=torch.empty(max_padded, dtype=torch.float32, device=device),
            sorted_expert_ids=torch.empty(max_padded // block_m, dtype=torch.int32, device=device),
            num_tokens_post_padded=torch.empty(1, dtype=torch.int32, device=device),
            num_sorted_tiles=torch.empty(1, dtype=torch.int32, device=device),
            block_m=block_m,
            num_tokens=num_tokens,
            num_lora_tokens=torch.empty(1, dtype=torch.int32, device=device) if count_lora_tokens else None,
            chunk_key_counts=(torch.empty(triton.cdiv(num_entries, chunk_size), key_block_size(num_experts),
                                          dtype=torch.int32, device=device) if chunk_size else None),
            chunk_size=chunk_size,
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


@triton.jit
def _count_chunk_keys_kernel(
    topk_ids_ptr,  # [M * TOPK] int32/int64
    expert_map_ptr,  # [num_global_experts] int32 (read only if HAS_EXPERT_MAP)
    token_lora_ids_ptr,  # [M] int32 (read only if LORA_KEYS)
    chunk_key_counts_ptr,  # [num_chunks, KEY_BLOCK] int32
    num_entries,
    num_global_experts,
    num_loras,
    TOPK: tl.constexpr,
    NUM_EXPERTS: tl.constexpr,
    KEY_BLOCK: tl.constexpr,  # power of two >= NUM_EXPERTS: the table's row length
    CHUNK_SIZE: tl.constexpr,
    HAS_EXPERT_MAP: tl.constexpr,
    LORA_KEYS: tl.constexpr,
    LAUNCH_DEPENDENTS: tl.constexpr = False,  # the scatter launch is a programmatic dependent
):
    """First launch of the chunked sort. Grid: (num_chunks,). Program c counts the kept entries of
    each sort key among routing entries ``[c * CHUNK_SIZE, (c + 1) * CHUNK_SIZE)``."""
    if LAUNCH_DEPENDENTS:
        gdc_launch_dependents()
    chunk = tl.program_id(0)
    offs = chunk * CHUNK_SIZE + tl.arange(0, CHUNK_SIZE)
    key = _routed_sort_key(topk_ids_ptr, expert_map_ptr, token_lora_ids_ptr, offs, offs < num_entries,
                           num_global_experts, num_loras, NUM_EXPERTS, HAS_EXPERT_MAP, TOPK, LORA_KEYS)
    kept = key < NUM_EXPERTS
    counts = tl.histogram(tl.where(kept, key, 0).to(tl.int32, bitcast=True), KEY_BLOCK, mask=kept)
    tl.store(chunk_key_counts_ptr + chunk * KEY_BLOCK + tl.arange(0, KEY_BLOCK), counts)


@triton.jit
def _sum_chunk_key_counts(chunk_key_counts_ptr, num_chunks, chunk, KEY_BLOCK: tl.constexpr,
                          COUNT_ROWS: tl.constexpr):
    """Per sort key (two int32 ``[KEY_BLOCK]``): kept entries in all chunks, and in chunks before ``chunk``."""
    keys = tl.arange(0, KEY_BLOCK)
    rows = tl.arange(0, COUNT_ROWS)
    totals = tl.zeros([KEY_BLOCK], dtype=tl.int32)
    before = tl.zeros([KEY_BLOCK], dtype=tl.int32)
    for first_row in range(0, num_chunks, COUNT_ROWS):
        row = first_row + rows
        counts = tl.load(chunk_key_counts_ptr + row[:, None] * KEY_BLOCK + keys[None, :],
                         mask=(row < num_chunks)[:, None], other=0)
        totals += tl.sum(counts, axis=0)
        before += tl.sum(tl.where((row < chunk)[:, None], counts, 0), axis=0)
    return totals, before


@triton.jit
def _scatter_chunk(topk_ids_ptr, topk_weights_ptr, expert_map_ptr, token_lora_ids_ptr, chunk_key_counts_ptr,
                   sorted_token_ids_ptr, sorted_weights_ptr, chunk, key_totals, keys_before_chunk, num_entries,
                   num_global_experts, num_loras, TOPK: tl.constexpr, NUM_EXPERTS: tl.constexpr,
                   BLOCK_M: tl.constexpr, KEY_BLOCK: tl.constexpr, CHUNK_SIZE: tl.constexpr,
                   HAS_EXPERT_MAP: tl.constexpr, EXPANDED_IDS: tl.constexpr, LORA_KEYS: tl.constexpr):
    """Chunked mode: writes the kept entries of one chunk to their rows. Sorting the chunk's
    ``key * CHUNK_SIZE + position`` puts each key's entries together in (token, slot) order; the
    entry at sorted position p with key k goes to row ``first_row(k) + (entries of k in earlier
    chunks) + p - (entries of this chunk with a key below k)``, so a key's rows are consecutive."""
    keys = tl.arange(0, KEY_BLOCK)
    num_below = tl.cumsum(key_totals, axis=0) - key_totals
    first_row = (num_below // BLOCK_M + tl.minimum(keys, num_below)) * BLOCK_M
    own = tl.load(chunk_key_counts_ptr + chunk * KEY_BLOCK + keys)
    row_of_position = first_row + keys_before_chunk - (tl.cumsum(own, axis=0) - own)
    position = tl.arange(0, CHUNK_SIZE)
    offs = chunk * CHUNK_SIZE + position
    key = _routed_sort_key(topk_ids_ptr, expert_map_ptr, token_lora_ids_ptr, offs, offs < num_entries,
                           num_global_experts, num_loras, NUM_EXPERTS, HAS_EXPERT_MAP, TOPK, LORA_KEYS)
    key = tl.minimum(key, NUM_EXPERTS).to(tl.int32)  # every dropped entry sorts last
    packed = tl.sort(key * CHUNK_SIZE + position)
    sorted_key = packed // CHUNK_SIZE
    kept = sorted_key < NUM_EXPERTS
    dest = tl.gather(row_of_position, tl.where(kept, sorted_key, 0), 0) + position
    entry = chunk * CHUNK_SIZE + packed % CHUNK_SIZE
    weight = tl.load(topk_weights_ptr + entry, mask=kept, other=0.0).to(tl.float32)
    entry_id = entry if EXPANDED_IDS else entry // TOPK
    tl.store(sorted_token_ids_ptr + dest, entry_id.to(tl.int32), mask=kept)
    tl.store(sorted_weights_ptr + dest, weight, mask=kept)


@triton.jit(do_not_specialize=["num_zero_programs", "num_parts", "num_chunks"])
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
    chunk_key_counts_ptr,  # [num_chunks, KEY_BLOCK] int32 (CHUNKED only)
    out_ptr,  # [out_numel] any dtype, zeroed when ZERO_OUT
    pad_id,  # id written into padding rows: M, or M * TOPK with EXPANDED_IDS
    num_entries,  # M * TOPK
    num_global_experts,
    max_num_padded,
    out_numel,
    num_zero_programs,  # programs that zero ``out`` (a runtime value: no recompile per batch size)
    num_parts,  # programs per expert: part p scatters the expert's entries in the p-th share of the scan steps
    num_loras,  # adapters (LORA_KEYS or COUNT_LORA_TOKENS only)
    num_chunks,  # chunk programs (CHUNKED only; 0 otherwise)
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
    CHUNKED: tl.constexpr = False,  # second launch of the chunked sort: chunk_key_counts holds the counts
    KEY_BLOCK: tl.constexpr = 1,  # CHUNKED: power of two >= NUM_EXPERTS, the count table's row length
    CHUNK_SIZE: tl.constexpr = 1,  # CHUNKED: routing entries per chunk
    COUNT_ROWS: tl.constexpr = 1,  # CHUNKED: count table rows loaded at a time
    WAIT_FOR_COUNTS: tl.constexpr = False,  # CHUNKED: launched as a programmatic dependent of the count launch
):
    """Grid: (num_chunks + NUM_EXPERTS * num_parts + num_zero_programs [+ 1 with COUNT_LORA_TOKENS],).
    With CHUNKED the first ``num_chunks`` programs scatter a chunk of entries each. Programs
    ``num_chunks + e * num_parts + p`` sort expert e (with CHUNKED, one per expert that only pads
    and labels its tiles); the programs after them zero ``out`` (dispatched first, these delayed
    the sort: see the module docstring); the last one counts the tokens with an adapter."""
    if LAUNCH_DEPENDENTS:  # let the next kernel be scheduled now; it waits for this one's results itself
        gdc_launch_dependents()
    pid = tl.program_id(0)
    num_sort_programs = num_chunks + NUM_EXPERTS * num_parts
    if COUNT_LORA_TOKENS:
        if pid == num_sort_programs + num_zero_programs:
            _store_lora_token_count(token_lora_ids_ptr, num_lora_tokens_ptr, num_entries // TOPK, num_loras,
                                    SCAN_BLOCK)
            return
    if ZERO_OUT:
        if pid >= num_sort_programs:
            zero_pid = pid - num_sort_programs
            zero_offs = tl.arange(0, ZERO_BLOCK)
            zeros = tl.zeros([ZERO_BLOCK], dtype=out_ptr.dtype.element_ty)
            step = num_zero_programs.to(tl.int64) * ZERO_BLOCK
            for start in range(zero_pid.to(tl.int64) * ZERO_BLOCK, out_numel, step):
                offs = start + zero_offs
                tl.store(out_ptr + offs, zeros, mask=offs < out_numel)
            return
    if CHUNKED:
        if WAIT_FOR_COUNTS:  # the zeroing programs above need nothing from the count launch
            gdc_wait()
        key_totals, keys_before_chunk = _sum_chunk_key_counts(chunk_key_counts_ptr, num_chunks, pid, KEY_BLOCK,
                                                              COUNT_ROWS)
        if pid < num_chunks:
            _scatter_chunk(topk_ids_ptr, topk_weights_ptr, expert_map_ptr, token_lora_ids_ptr, chunk_key_counts_ptr,
                           sorted_token_ids_ptr, sorted_weights_ptr, pid, key_totals, keys_before_chunk, num_entries,
                           num_global_experts, num_loras, TOPK, NUM_EXPERTS, BLOCK_M, KEY_BLOCK, CHUNK_SIZE,
                           HAS_EXPERT_MAP, EXPANDED_IDS, LORA_KEYS)
            return
        expert = pid - num_chunks
        part = 0
        keys = tl.arange(0, KEY_BLOCK)
        num_below = tl.sum(tl.where(keys < expert, key_totals, 0), axis=0)
        first_tile = num_below // BLOCK_M + tl.minimum(expert, num_below)
        rank_base = first_tile * BLOCK_M + tl.sum(tl.where(keys == expert, key_totals, 0), axis=0)
    else:
        expert = pid // num_parts
        part = pid % num_parts
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
    """Sorts routing into expert-major tiles and zeroes ``out``, in one kernel launch (two where
    ``sort_chunk_size`` picks the chunked sort: large batches of 64 experts or more).

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
    (``misc/bench/sort``, median of 5 interleaved rounds; E experts, top-k k; parts p, warps w; the
    shipped choice starred; where ``sort_chunk_size`` gives fmoe2 the two-launch sort, marked c,
    the baseline's alignment in ``fmoe2.bench``, one kernel, still runs this one):

    ================  ==========  ==========  ==========  ==========
    E, k, M           p1 w4       p2 w4       p1 w8       p2 w8
    ================  ==========  ==========  ==========  ==========
    H100, 2026-11-24 (second sweep)
    8, 2, 1024        4.2*        4.3         4.4         4.3
    8, 2, 4096        11.4        11.7        11.2        11.6*
    32, 4, 1024       6.1         5.9         5.4*        5.2
    32, 4, 4096       14.9        10.3        13.4        9.2*
    64, 6, 1024       9.1         7.0         8.1         6.3*
    64, 6, 4096 c     20.3        16.1        18.4        15.2*
    128, 8, 128       3.6*        3.6         3.7         3.8
    128, 8, 1024 c    9.5         7.9*        8.8         8.2
    128, 8, 4096 c    29.2        23.4*       27.4        27.2
    128, 8, 8192 c    57.0        43.6*       53.5        54.4
    160, 6, 4096 c    31.2        28.9*       29.3        29.8
    256, 8, 4096 c    57.6        54.0*       56.9        53.5
    H200, 2026-11-24 (first sweep)
    64, 6, 4096       20.6        15.5        18.2        14.5*
    128, 8, 4096      28.3        22.2*       26.4        27.2
    160, 6, 4096      30.1        28.3*       28.5        25.8
    ================  ==========  ==========  ==========  ==========

    More parts: in the H100 sweep 4 parts were slower than the best of 1 or 2 wherever the one
    launch runs for fmoe2 (E=64, M=1024: 7.0 us at 8 warps against 6.3); they were faster at E=64,
    M=2048 and 4096 (8.6 and 13.7 us against 9.9 and 15.2), where fmoe2 sorts in chunks (8.2 and
    11.0 us). The first sweep also tried 3 and 6 parts: at most 0.1 us faster than 1 or 2 parts.
    Mixtral (E=8) is bound by zeroing its 32 MB output at M=4096 (11.2-11.7 us in every setting of
    1-2 parts).

    ``num_compute_units``: the GPU's multiprocessors (compute units on ROCm; ``num_multiprocessors``).
    """
    scan_block = scan_block_size(num_entries)
    num_parts = 2 if triton.cdiv(num_entries, scan_block) >= 2 else 1
    wide = scan_block == MAX_SCAN_BLOCK and num_keys * num_parts <= num_compute_units
    return num_parts, 8 if wide else 4


def sort_chunk_size(num_keys: int, num_entries: int) -> int:
    """Routing entries per chunk of the two-launch sort, or 0 for the one-launch sort.

    The one-launch sort's work grows with ``num_keys * num_entries`` (every expert's program scans
    every entry); the two-launch sort handles each entry once but pays a second launch, a sort of
    each chunk (``tl.sort``, whose time grows faster than the chunk), and a read of the whole count
    table (``num_chunks x key_block`` int32) in each of its programs. So: two launches above
    ``2**19`` key-entry pairs with 64 keys or more, in the smallest chunks of 256, 512 or 1024
    entries that keep the table within 8192 counts (else 1024).

    Sort with zeroing in us, ``python -m fmoe2.bench.sort_settings`` (``misc/bench/sort``, H100,
    2026-11-24, median of 5 interleaved rounds; E experts, top-k k; the one-launch sort at the
    ``sort_programs`` choice, the two-launch sort in chunks of c; the shipped choice starred):

    ============  =======  =======  =======  =======
    E, k, M       1 launch c256     c512     c1024
    ============  =======  =======  =======  =======
    128, 8, 128   3.6*     5.9      6.8      11.7
    64, 6, 1024   6.3*     6.3      7.3      10.5
    128, 8, 1024  7.9      6.7*     7.7      12.8
    160, 6, 1024  9.8      7.9*     7.7      13.0
    256, 8, 512   9.0      7.2*     8.5      13.6
    256, 8, 1024  14.9     8.4*     10.4     15.5
    384, 8, 1024  17.2     9.9      11.4*    16.4
    64, 6, 2048   9.9      8.2*     8.9      12.7
    128, 8, 2048  13.0     8.4*     8.0      13.4
    128, 8, 4096  23.4     15.1     11.2*    13.0
    64, 6, 4096   15.2     11.0*    13.8     15.3
    160, 6, 4096  28.9     30.5     23.3     19.6*
    256, 8, 4096  54.0     39.3     27.9     28.3*
    384, 8, 4096  60.4     44.8     27.4     29.7*
    128, 8, 8192  43.6     30.5     23.9     20.5*
    64, 6, 8192   28.1     25.4     17.9*    25.0
    ============  =======  =======  =======  =======

    Chunks of 2048 took 26-52 us everywhere. Below 64 experts the chunks gained at most 0.1 us:
    E=32 top-4 took 5.4 and 9.2 us in one launch at M=1024 and 4096, 5.3 and 9.8 in the best
    chunks; Mixtral (E=8) 4.2 and 11.6 against 5.5 and 13.5. (The sweep's ``auto`` column was
    taken with an earlier draft of this rule, one launch up to ``2**20`` pairs and chunks of 512
    or 1024; the choices starred here are read from the other columns.)
    """
    if num_keys < 64 or num_keys * num_entries <= 2 ** 19:
        return 0
    key_block = key_block_size(num_keys)
    for chunk_size in (256, 512):
        if triton.cdiv(num_entries, chunk_size) * key_block <= MAX_COUNT_TABLE:
            return chunk_size
    return 1024


def key_block_size(num_keys: int) -> int:
    """Row length of the chunked sort's count table: ``num_keys`` as a power of two (at least 16)."""
    return max(triton.next_power_of_2(num_keys), 16)


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
    programmatic dependent (``FusedMoEConfig.pdl``); the sort lets it be scheduled at once, and a
    chunked sort's second launch is then a programmatic dependent of its count launch too
    (``launch_pdl``; its chunk and expert programs wait for the counts).
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
    chunked = result.chunk_key_counts is not None
    if chunked:
        if num_parts not in (None, 1):
            raise ValueError(f"num_parts={num_parts}: the chunked sort (chunk_size={result.chunk_size}) has one "
                             "program per expert")
        num_chunks, key_block = result.chunk_key_counts.shape
        num_parts = 1
        num_warps = CHUNKED_SORT_WARPS if num_warps is None else num_warps
    else:
        num_chunks, key_block = 0, 1
        auto_parts, auto_warps = sort_programs(num_keys, num_entries, num_multiprocessors(topk_ids.device))
        num_parts = auto_parts if num_parts is None else num_parts
        num_warps = auto_warps if num_warps is None else num_warps
    grid = (num_chunks + num_keys * num_parts + num_zero_programs + int(count_lora_tokens),)
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
        chunk_key_counts_ptr=result.chunk_key_counts if chunked else result.num_sorted_tiles,
        out_ptr=out if out is not None else result.sorted_weights,
        pad_id=num_entries if expanded_ids else M,
        num_entries=num_entries,
        num_global_experts=expert_map.numel() if expert_map is not None else num_experts,
        max_num_padded=result.sorted_token_ids.numel(),
        out_numel=out_numel,
        num_zero_programs=num_zero_programs,
        num_parts=num_parts,
        num_loras=num_loras,
        num_chunks=num_chunks,
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
        CHUNKED=chunked,
        KEY_BLOCK=key_block,
        CHUNK_SIZE=result.chunk_size if chunked else 1,
        COUNT_ROWS=max(MAX_COUNT_TILE // key_block, 1) if chunked else 1,
        WAIT_FOR_COUNTS=chunked and launch_dependents,
    )
    options = {"num_warps": num_warps}
    if chunked and launch_dependents:
        options["launch_pdl"] = True
    return grid, args, constexprs, options


def count_kernel_launch(args: dict, constexprs: dict):
    """Grid, arguments and constexprs of the chunked sort's first launch (``_count_chunk_keys_kernel``),
    taken from those of its second (``sorting_kernel_launch`` on a result allocated in chunked
    mode), so both launches key the routing alike. With ``LAUNCH_DEPENDENTS`` (the forward's
    launches are programmatic dependents) the second launch is a programmatic dependent of it too."""
    num_chunks = args["chunk_key_counts_ptr"].shape[0]
    count_args = {name: args[name] for name in ("topk_ids_ptr", "expert_map_ptr", "token_lora_ids_ptr",
                                                 "chunk_key_counts_ptr", "num_entries", "num_global_experts",
                                                 "num_loras")}
    count_constexprs = {name: constexprs[name] for name in ("TOPK", "NUM_EXPERTS", "KEY_BLOCK", "CHUNK_SIZE",
                                                             "HAS_EXPERT_MAP", "LORA_KEYS", "LAUNCH_DEPENDENTS")}
    return (num_chunks,), count_args, count_constexprs, {"num_warps": CHUNKED_SORT_WARPS}


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
        if constexprs["CHUNKED"] and args["num_chunks"] > 0:
            count_grid, count_args, count_constexprs, count_options = count_kernel_launch(args, constexprs)
            _count_chunk_keys_kernel[count_grid](**count_args, **count_constexprs, **count_options)
        _moe_sorting_kernel[grid](**args, **constexprs, **options)
