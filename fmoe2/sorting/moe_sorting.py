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
work. With fp8 weights (``QUANTIZE_X``, :func:`x_quantization_values`) up to
``MAX_X_QUANT_PROGRAMS`` programs after all others quantize ``hidden_states`` per token and group
of 128 (``fmoe2/fp8.py``; per token over all of H with its per-token activations, off by default) into a
buffer every GEMM program then reads: once per forward, not once per program, and no launch of its own.

Zeroing programs go after the expert programs because, launched before them, they delayed the
sort; the counting pass makes one unsigned comparison per entry and loads full steps without a
mask because it is bound by instruction issue; what is left is the scatter (measurements:
docs/sorting.md#the-one-launch-sort).

Chunked (two-launch) sort: the one-launch sort's work grows with ``E * M * topk`` (every
expert's program scans every entry). Where ``sort_chunk_size`` says so, a first launch
(``_count_chunk_keys_kernel``) counts each sort key in every chunk of 256-1024 routing entries
into a small table (``chunk_key_counts``, the only extra buffer), and the main kernel then runs
with ``CHUNKED``: one program per chunk reads the table (the key totals give every expert's first
row, the counts of earlier chunks the chunk's offset within it), sorts its chunk's
``key * chunk_size + position`` with ``tl.sort`` and writes each entry once; one program per
expert only pads and labels its tiles. Same buffers, bit for bit (tests compare both). With PDL
the scatter launch is a programmatic dependent of the count launch: its zeroing programs start
while the counts are taken. When it applies: ``sort_chunk_size`` (measurements:
docs/sorting.md#the-sort-in-one-or-two-launches).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, NamedTuple, Optional, Tuple

import torch
import triton
import triton.language as tl

from ..buffers import BufferLayout
from ..fp8 import FP8_GROUP, _quantize_rows, x_scales_per_row
from ..grid_dependency import gdc_launch_dependents, gdc_wait
from ..launch import BoundLaunch, LaunchSpec, PlanCache, bind_launches, direct_launches, run_bound, tracing
from ..target import target_of
from .._validation import (
    FLOAT_DTYPES,
    ID_DTYPES,
    check_out_overlaps,
    check_out_overlaps_at,
    check_positive_int,
    check_same_device,
    check_tensor,
    interpreter_enabled,
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
        ``count_lora_tokens``, the adapter token count that the sort then writes), in one allocation
        (:func:`sorting_buffers`). ``num_experts`` is the number of sort keys. ``chunk_size``:
        routing entries per chunk of the two-launch sort (a power of two), 0 for the one-launch
        sort; default ``sort_chunk_size``'s rule."""
        chunk_size = checked_chunk_size(num_experts, num_entries, chunk_size)
        layout = BufferLayout.of(sorting_buffers(num_entries, num_experts, block_m, count_lora_tokens, chunk_size))
        return cls.from_views(layout.views(layout.allocate(device)), block_m, num_tokens, chunk_size)

    @classmethod
    def on_block(cls, block: torch.Tensor, layout: BufferLayout, block_m: int, num_tokens: int,
                 chunk_size: int) -> "MoESortingResult":
        """The result whose buffers lie in ``block`` as ``layout`` (:func:`sorting_buffers`) places them,
        their tensor views made when first read: :func:`moe_sorting`'s cached path returns it without
        paying for views a caller may never use."""
        result = cls.__new__(cls)
        result.__dict__.update(block_m=block_m, num_tokens=num_tokens, chunk_size=chunk_size,
                               _block_and_layout=(block, layout))
        return result

    def __getattr__(self, name):
        # Only reached for a field of an ``on_block`` result not viewed yet: view them all now.
        pending = self.__dict__.pop("_block_and_layout", None)
        if pending is None:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        views = pending[1].views(pending[0])
        for field in ("sorted_token_ids", "sorted_weights", "sorted_expert_ids", "num_tokens_post_padded",
                      "num_sorted_tiles", "num_lora_tokens", "chunk_key_counts"):
            self.__dict__[field] = views.get(field)
        return getattr(self, name)

    @classmethod
    def from_views(cls, views: Dict[str, torch.Tensor], block_m: int, num_tokens: int,
                   chunk_size: int) -> "MoESortingResult":
        """The result whose buffers are the :func:`sorting_buffers` entries of ``views``."""
        return cls(views["sorted_token_ids"], views["sorted_weights"], views["sorted_expert_ids"],
                   views["num_tokens_post_padded"], views["num_sorted_tiles"], block_m, num_tokens,
                   views.get("num_lora_tokens"), views.get("chunk_key_counts"), chunk_size)


def checked_chunk_size(num_experts: int, num_entries: int, chunk_size: Optional[int] = None) -> int:
    """``chunk_size``, or ``sort_chunk_size``'s pick when None; refuses what is not 0 or a power of two."""
    if chunk_size is None:
        chunk_size = sort_chunk_size(num_experts, num_entries)
    if chunk_size < 0 or chunk_size & (chunk_size - 1):
        raise ValueError(f"chunk_size must be 0 or a power of two, got {chunk_size}")
    return chunk_size


def sorting_buffers(num_entries: int, num_experts: int, block_m: int, count_lora_tokens: bool = False,
                    chunk_size: int = 0) -> List[Tuple[str, torch.dtype, Tuple[int, ...]]]:
    """``(name, dtype, shape)`` of the sort's buffers (see :class:`MoESortingResult`) for
    ``num_entries = M*topk`` routing entries: sized for the worst case, so they depend on shapes only."""
    max_padded = max_num_tokens_padded(num_entries, num_experts, block_m)
    buffers = [("sorted_token_ids", torch.int32, (max_padded,)), ("sorted_weights", torch.float32, (max_padded,)),
               ("sorted_expert_ids", torch.int32, (max_padded // block_m,)),
               ("num_tokens_post_padded", torch.int32, (1,)), ("num_sorted_tiles", torch.int32, (1,))]
    if count_lora_tokens:
        buffers.append(("num_lora_tokens", torch.int32, (1,)))
    if chunk_size:
        buffers.append(("chunk_key_counts", torch.int32,
                        (triton.cdiv(num_entries, chunk_size), key_block_size(num_experts))))
    return buffers


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
    instruction issue (instruction counts: docs/sorting.md#unmasked-full-steps)."""
    scan = tl.arange(0, SCAN_BLOCK)
    below = tl.zeros([SCAN_BLOCK], dtype=tl.int32)
    mine = tl.zeros([SCAN_BLOCK], dtype=tl.int32)
    for step in range(first_step, tl.minimum(end_step, num_full_steps)):
        offs = step * SCAN_BLOCK + scan
        key = _routed_sort_key(topk_ids_ptr, expert_map_ptr, token_lora_ids_ptr, offs, valid=None,
                               num_global_experts=num_global_experts, num_loras=num_loras, NUM_EXPERTS=NUM_EXPERTS,
                               HAS_EXPERT_MAP=HAS_EXPERT_MAP, TOPK=TOPK, LORA_KEYS=LORA_KEYS)
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


class XQuantization(NamedTuple):
    """The x an fp8 forward's sort launch quantizes (a kernel argument: ``fmoe2/gemm/bundles.py`` says how Triton
    takes it): ``x [M, H]`` into fp8 ``x_q`` with float32 scales per row and ``X_GROUP`` columns."""

    x_ptr: Any  # [M, H]
    x_q_ptr: Any  # [M, H] fp8
    x_scale_ptr: Any  # [M, cdiv(H, X_GROUP)] float32 ([M, 1] with per-token activations: X_GROUP >= H)
    cols: Any  # H
    stride_x_m: Any
    stride_xq_m: Any


@triton.jit
def _quantize_x_rows(xq, num_x_rows, quant_pid, num_quant_programs, X_ROWS: tl.constexpr, X_GROUP: tl.constexpr,
                     FP8_MAX: tl.constexpr, SOFT_FP8_ROUNDING: tl.constexpr, FP8_MIN_NORMAL: tl.constexpr,
                     FP8_SUBNORMAL_STEP: tl.constexpr):
    """One quantizing program: ``X_ROWS`` x ``X_GROUP`` tiles of x in turn, each row's group quantized
    (``fmoe2/fp8.py``) into ``xq.x_q_ptr`` and its scale into ``xq.x_scale_ptr [rows, cdiv(xq.cols, X_GROUP)]``
    (``xq``: an :class:`XQuantization`)."""
    x_ptr, x_q_ptr, x_scale_ptr, x_cols, stride_x_m, stride_xq_m = xq
    groups = tl.cdiv(x_cols, X_GROUP)
    items = tl.cdiv(num_x_rows, X_ROWS) * groups
    for item in range(quant_pid, items, num_quant_programs):
        rows = (item // groups) * X_ROWS + tl.arange(0, X_ROWS)
        group = item % groups
        cols = group * X_GROUP + tl.arange(0, X_GROUP)
        row_valid = rows < num_x_rows
        rows = rows.to(tl.int64)
        mask = row_valid[:, None] & (cols < x_cols)[None, :]
        v = tl.load(x_ptr + rows[:, None] * stride_x_m + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        scaled, scale = _quantize_rows(v, FP8_MAX, SOFT_FP8_ROUNDING, FP8_MIN_NORMAL, FP8_SUBNORMAL_STEP)
        tl.store(x_q_ptr + rows[:, None] * stride_xq_m + cols[None, :], scaled.to(x_q_ptr.dtype.element_ty), mask=mask)
        tl.store(x_scale_ptr + rows * groups + group, scale, mask=row_valid)


@triton.jit
def _zero_out(out_ptr, out_numel, zero_pid, num_zero_programs, ZERO_BLOCK: tl.constexpr):
    """One of ``num_zero_programs`` programs zeroing ``out`` [out_numel], ZERO_BLOCK elements a store."""
    zero_offs = tl.arange(0, ZERO_BLOCK)
    zeros = tl.zeros([ZERO_BLOCK], dtype=out_ptr.dtype.element_ty)
    step = num_zero_programs.to(tl.int64) * ZERO_BLOCK
    for start in range(zero_pid.to(tl.int64) * ZERO_BLOCK, out_numel, step):
        offs = start + zero_offs
        tl.store(out_ptr + offs, zeros, mask=offs < out_numel)


@triton.jit
def _scan_expert(topk_ids_ptr, topk_weights_ptr, expert_map_ptr, token_lora_ids_ptr, sorted_token_ids_ptr,
                 sorted_weights_ptr, expert, part, num_parts, num_entries, num_global_experts, num_loras,
                 TOPK: tl.constexpr, NUM_EXPERTS: tl.constexpr, BLOCK_M: tl.constexpr, SCAN_BLOCK: tl.constexpr,
                 HAS_EXPERT_MAP: tl.constexpr, EXPANDED_IDS: tl.constexpr, LORA_KEYS: tl.constexpr):
    """One-launch sort, program (expert, part): counts the entries before the expert's, scatters its share of the
    expert's entries. Returns ``(num_below, first_tile, rank_base)``: kept entries of lower keys, the expert's
    first tile, and the row after the last one this part wrote."""
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
                              num_loras, expert_key, first_step=0, end_step=part_first_step,
                              num_full_steps=num_full_steps, COUNT_MINE=True, SCAN_BLOCK=SCAN_BLOCK,
                              NUM_EXPERTS=NUM_EXPERTS, HAS_EXPERT_MAP=HAS_EXPERT_MAP, TOPK=TOPK, LORA_KEYS=LORA_KEYS)
    my_count_before_part = tl.sum(mine, axis=0)
    below_rest, _ = _count_keys(topk_ids_ptr, expert_map_ptr, token_lora_ids_ptr, num_entries, num_global_experts,
                                num_loras, expert_key, part_first_step, num_steps, num_full_steps, COUNT_MINE=False,
                                SCAN_BLOCK=SCAN_BLOCK, NUM_EXPERTS=NUM_EXPERTS, HAS_EXPERT_MAP=HAS_EXPERT_MAP,
                                TOPK=TOPK, LORA_KEYS=LORA_KEYS)
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
    return num_below, first_tile, rank_base


@triton.jit
def _pad_and_label_tiles(sorted_token_ids_ptr, sorted_weights_ptr, sorted_expert_ids_ptr, num_tokens_post_padded_ptr,
                         num_sorted_tiles_ptr, expert, num_below, first_tile, rank_base, pad_id, max_num_padded,
                         NUM_EXPERTS: tl.constexpr, BLOCK_M: tl.constexpr, FILL_BLOCK: tl.constexpr):
    """The last part of an expert has seen all of its entries: it pads the expert's last tile and its gap tiles
    and labels both kinds of tile; the last expert's also writes the counters and fills the unused tail."""
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


@triton.jit(do_not_specialize=["num_zero_programs", "num_parts", "num_chunks", "num_quant_programs"])
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
    # fp8 forwards (QUANTIZE_X): the activations quantized once here, for the GEMMs to read (fmoe2/fp8.py)
    x_quantization=None,  # an XQuantization
    num_quant_programs=0,  # programs after all others that quantize x
    QUANTIZE_X: tl.constexpr = False,
    X_ROWS: tl.constexpr = 16,
    X_GROUP: tl.constexpr = 128,
    FP8_MAX: tl.constexpr = 448.0,
    SOFT_FP8_ROUNDING: tl.constexpr = False,
    FP8_MIN_NORMAL: tl.constexpr = 0.015625,
    FP8_SUBNORMAL_STEP: tl.constexpr = 0.001953125,
):
    """Grid: (num_chunks + NUM_EXPERTS * num_parts + num_zero_programs [+ 1 with COUNT_LORA_TOKENS],).
    With CHUNKED the first ``num_chunks`` programs scatter a chunk of entries each. Programs
    ``num_chunks + e * num_parts + p`` sort expert e (with CHUNKED, one per expert that only pads
    and labels its tiles); the programs after them zero ``out`` (dispatched first, these delayed
    the sort: see the module docstring); then the one that counts the tokens with an adapter; with
    QUANTIZE_X the last ``num_quant_programs`` quantize x."""
    if LAUNCH_DEPENDENTS:  # let the next kernel be scheduled now; it waits for this one's results itself
        gdc_launch_dependents()
    pid = tl.program_id(0)
    num_sort_programs = num_chunks + NUM_EXPERTS * num_parts
    if QUANTIZE_X:
        first_quant = num_sort_programs + num_zero_programs + COUNT_LORA_TOKENS
        if pid >= first_quant:
            _quantize_x_rows(x_quantization, num_entries // TOPK, pid - first_quant, num_quant_programs, X_ROWS,
                             X_GROUP, FP8_MAX, SOFT_FP8_ROUNDING, FP8_MIN_NORMAL, FP8_SUBNORMAL_STEP)
            return
    if COUNT_LORA_TOKENS:
        if pid == num_sort_programs + num_zero_programs:
            _store_lora_token_count(token_lora_ids_ptr, num_lora_tokens_ptr, num_entries // TOPK, num_loras,
                                    SCAN_BLOCK)
            return
    if ZERO_OUT:
        if pid >= num_sort_programs:
            _zero_out(out_ptr, out_numel, pid - num_sort_programs, num_zero_programs, ZERO_BLOCK)
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
        num_below, first_tile, rank_base = _scan_expert(
            topk_ids_ptr, topk_weights_ptr, expert_map_ptr, token_lora_ids_ptr, sorted_token_ids_ptr,
            sorted_weights_ptr, expert, part, num_parts, num_entries, num_global_experts, num_loras, TOPK, NUM_EXPERTS,
            BLOCK_M, SCAN_BLOCK, HAS_EXPERT_MAP, EXPANDED_IDS, LORA_KEYS)

    # The last part has seen all of the expert's entries: it pads the expert's last tile and its gap
    # tiles and labels both kinds of tile.
    if part == num_parts - 1:
        _pad_and_label_tiles(sorted_token_ids_ptr, sorted_weights_ptr, sorted_expert_ids_ptr, num_tokens_post_padded_ptr,
                             num_sorted_tiles_ptr, expert, num_below, first_tile, rank_base, pad_id, max_num_padded,
                             NUM_EXPERTS, BLOCK_M, FILL_BLOCK)


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
        :class:`MoESortingResult` (its buffers share one allocation); see the module docstring for
        the exact contract.

    As ``fmoe2.fused_moe`` does, a call with shapes, dtypes and devices seen before launches the
    kernels bound by that first call (``fmoe2/launch.py``); under ``torch.compile`` it is the op
    ``torch.ops.fmoe2.moe_sorting`` (one launch, separate buffers).
    """
    if tracing():
        return moe_sorting_op_call(topk_ids, topk_weights, num_experts, block_m, out, expert_map)
    call = _sort_call_key(topk_ids, topk_weights, num_experts, block_m, out, expert_map)
    plan = SORT_PLANS.get(call[0]) if call is not None else None
    if plan is not None and plan.launches is not None and direct_launches():
        if out is not None:
            check_out_overlaps_at(_SORT_SOURCES, call[1], plan.input_nbytes, 2)
        block = run_bound(plan.launches, call[1], plan.layout.nbytes, plan.offsets, plan.device)
        return MoESortingResult.on_block(block, plan.layout, block_m, plan.num_tokens, plan.chunk_size)
    _check_sorting_args(topk_ids, topk_weights, num_experts, block_m, out, expert_map)
    M, topk = topk_ids.shape
    chunk_size = checked_chunk_size(num_experts, M * topk)
    layout = BufferLayout.of(sorting_buffers(M * topk, num_experts, block_m, chunk_size=chunk_size))
    block = layout.allocate(topk_ids.device)
    result = MoESortingResult.from_views(layout.views(block), block_m, M, chunk_size)
    specs = sort_launch_specs(topk_ids, topk_weights, num_experts, expert_map, result, out)
    with on_device(topk_ids):
        compiled = [spec.launch() for spec in specs]
    if plan is None and call is not None and call[0][-1] and not interpreter_enabled():
        base = block.data_ptr()
        launches = bind_launches(specs, compiled, call[1] + [base + offset for offset in layout.offsets])
        nbytes = tuple(t.numel() * t.element_size() if t is not None else 0
                       for t in (topk_ids, topk_weights, out, expert_map))
        SORT_PLANS.put(call[0], SortPlan(layout, M, chunk_size, topk_ids.device, nbytes, launches))
    return result


def moe_sorting_op_call(topk_ids, topk_weights, num_experts, block_m, out=None, expert_map=None) -> MoESortingResult:
    """``fmoe2.moe_sorting`` as ``torch.ops.fmoe2.moe_sorting`` (what it runs while ``torch.compile``
    traces it; always the one-launch sort). The op is defined in ``fmoe2/ops.py``, a floor above: reached
    through the dispatcher, not imported."""
    ids, weights, experts, post_padded, tiles = torch.ops.fmoe2.moe_sorting(topk_ids, topk_weights, num_experts,
                                                                            block_m, out, expert_map)
    return MoESortingResult(ids, weights, experts, post_padded, tiles, block_m, topk_ids.shape[0])


@dataclass
class SortPlan:
    """:func:`moe_sorting` settled for one call key: its scratch layout and bound launches."""

    layout: BufferLayout
    num_tokens: int
    chunk_size: int
    device: torch.device
    input_nbytes: Tuple[int, ...]  # bytes of topk_ids, topk_weights, out, expert_map (0: absent)
    launches: Optional[List[BoundLaunch]]  # None: not bindable, every call goes through the JIT

    def __post_init__(self):
        self.offsets = self.layout.offsets  # read on every call


SORT_PLANS = PlanCache()
_SORT_SOURCES = ("topk_ids", "topk_weights", "out", "expert_map")


def _sort_call_key(topk_ids, topk_weights, num_experts, block_m, out, expert_map):
    """``(key, device addresses of topk_ids, topk_weights, out, expert_map)``, or None for
    arguments the key does not cover (validation then names them)."""
    try:
        sources = [topk_ids.data_ptr(), topk_weights.data_ptr(), out.data_ptr() if out is not None else 0,
                   expert_map.data_ptr() if expert_map is not None else 0]
        key = (type(num_experts), num_experts, type(block_m), block_m, topk_ids.shape, topk_ids.dtype,
               topk_ids.stride(), topk_ids.get_device(), topk_weights.shape, topk_weights.dtype, topk_weights.stride(),
               topk_weights.get_device(),
               (out.shape, out.dtype, out.stride(), out.get_device()) if out is not None else None,
               (expert_map.shape, expert_map.dtype, expert_map.stride(), expert_map.get_device())
               if expert_map is not None else None,
               (sources[0] | sources[1] | sources[2] | sources[3]) % 16 == 0)
        return key, sources
    except (AttributeError, TypeError):
        return None


def sort_programs(num_keys: int, num_entries: int, num_compute_units: int) -> Tuple[int, int]:
    """``(num_parts, num_warps)`` of the sorting kernel: programs per expert (sort key) and warps
    per program.

    2 parts when the scan has at least 2 steps: each part still counts all entries (pass 1) but
    scatters only half of them (pass 2, the costlier). 8 warps when the expert programs fit
    one per multiprocessor and a step holds ``MAX_SCAN_BLOCK`` entries; else 4, which lets more
    programs share a multiprocessor (measurements: docs/sorting.md#sort-programs-per-expert).

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
    entries that keep the table within 8192 counts (else 1024). Measurements:
    docs/sorting.md#the-sort-in-one-or-two-launches.
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
                          num_warps: Optional[int] = None, num_compute_units: Optional[int] = None,
                          x_quantization: Optional[Tuple[dict, dict]] = None):
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
    ``num_parts``/``num_warps`` override :func:`sort_programs` (tests, ``fmoe2.bench.sort_settings``),
    which otherwise picks them for ``num_compute_units`` multiprocessors (default: those of the
    routing tensors' GPU). Pointers the flags leave unused are None (constexpr: no launch argument).
    ``x_quantization``: ``(args, constexprs)`` of the programs that quantize x for an fp8 forward
    (:func:`x_quantization_values`), added after all others.
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
        if num_compute_units is None:
            num_compute_units = target_of(topk_ids.device).num_sms
        auto_parts, auto_warps = sort_programs(num_keys, num_entries, num_compute_units)
        num_parts = auto_parts if num_parts is None else num_parts
        num_warps = auto_warps if num_warps is None else num_warps
    num_quant_programs = x_quantization[0]["num_quant_programs"] if x_quantization is not None else 0
    grid = (num_chunks + num_keys * num_parts + num_zero_programs + int(count_lora_tokens) + num_quant_programs,)
    args = dict(
        topk_ids_ptr=topk_ids,
        topk_weights_ptr=topk_weights,
        expert_map_ptr=expert_map,
        token_lora_ids_ptr=token_lora_ids,
        sorted_token_ids_ptr=result.sorted_token_ids,
        sorted_weights_ptr=result.sorted_weights,
        sorted_expert_ids_ptr=result.sorted_expert_ids,
        num_tokens_post_padded_ptr=result.num_tokens_post_padded,
        num_sorted_tiles_ptr=result.num_sorted_tiles,
        num_lora_tokens_ptr=result.num_lora_tokens,
        chunk_key_counts_ptr=result.chunk_key_counts,
        out_ptr=out if num_zero_programs > 0 else None,
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
    if x_quantization is not None:
        args.update(x_quantization[0])
        constexprs.update(x_quantization[1])
    options = {"num_warps": num_warps}
    if chunked and launch_dependents:
        options["launch_pdl"] = True
    return grid, args, constexprs, options


X_QUANT_ROWS = 16  # rows of x per quantizing step
# Per-token activations: the values of x one quantizing step holds, whole rows (DeepSeek-V3's 7168 take a tile of
# 8192: 64 float32 registers a thread at 4 warps), so each row is read once, in one load
PER_ROW_TILE_ELEMENTS = 8192
MAX_X_QUANT_PROGRAMS = 1024


def x_quantization_values(x: torch.Tensor, x_q: torch.Tensor, x_scale: torch.Tensor, fp8_consts: dict
                          ) -> Tuple[dict, dict]:
    """``(args, constexprs)`` of the sort launch's x-quantizing programs: ``x [M, H]`` into ``x_q`` and
    ``x_scale [M, cdiv(H, FP8_GROUP)]``, or ``[M, 1]`` (per-token activations, ``fmoe2.fp8.x_group``: a row's tile
    is the whole row, X_ROWS rows of up to PER_ROW_TILE_ELEMENTS values a program step, one load and one pass), with
    ``fp8_consts`` (``fmoe2.fp8.fp8_constexprs``)."""
    M, H = x.shape
    rows, group = X_QUANT_ROWS, FP8_GROUP
    if x_scales_per_row(x_scale, H):
        group = triton.next_power_of_2(H)
        rows = max(1, PER_ROW_TILE_ELEMENTS // group)
    items = triton.cdiv(M, rows) * triton.cdiv(H, group)
    args = dict(x_quantization=XQuantization(x, x_q, x_scale, H, x.stride(0), x_q.stride(0)),
                num_quant_programs=min(items, MAX_X_QUANT_PROGRAMS))
    constexprs = dict(QUANTIZE_X=True, X_ROWS=rows, X_GROUP=group, FP8_MAX=fp8_consts["FP8_MAX"],
                      SOFT_FP8_ROUNDING=fp8_consts["SOFT_FP8_ROUNDING"], FP8_MIN_NORMAL=fp8_consts["FP8_MIN_NORMAL"],
                      FP8_SUBNORMAL_STEP=fp8_consts["FP8_SUBNORMAL_STEP"])
    return args, constexprs


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


def sort_launch_specs(topk_ids, topk_weights, num_experts: int, expert_map, result: MoESortingResult, out,
                      expanded_ids: bool = False, token_lora_ids=None, num_loras: int = 0, lora_keys: bool = False,
                      num_parts: Optional[int] = None, launch_dependents: bool = False,
                      num_warps: Optional[int] = None, num_compute_units: Optional[int] = None,
                      x_quantization: Optional[Tuple[dict, dict]] = None) -> List[LaunchSpec]:
    """The sort's launches (``sort_count`` first where the sort is chunked, then ``sort``); arguments
    as :func:`sorting_kernel_launch` takes them."""
    grid, args, constexprs, options = sorting_kernel_launch(topk_ids, topk_weights, num_experts, expert_map, result,
                                                            out, expanded_ids, token_lora_ids, num_loras, lora_keys,
                                                            num_parts, launch_dependents, num_warps,
                                                            num_compute_units, x_quantization)
    specs = []
    if constexprs["CHUNKED"]:
        specs.append(LaunchSpec("sort_count", _count_chunk_keys_kernel, *count_kernel_launch(args, constexprs)))
    specs.append(LaunchSpec("sort", _moe_sorting_kernel, grid, args, constexprs, options))
    return specs


def launch_moe_sorting(topk_ids, topk_weights, num_experts: int, expert_map, result: MoESortingResult, out,
                       expanded_ids: bool = False, token_lora_ids=None, num_loras: int = 0, lora_keys: bool = False,
                       num_parts: Optional[int] = None, launch_dependents: bool = False,
                       num_warps: Optional[int] = None) -> None:
    """Launches the sort into the preallocated ``result`` buffers, through Triton's JIT.

    Internal: arguments are assumed checked by :func:`moe_sorting` or :func:`fmoe2.fused_moe`.
    """
    with on_device(topk_ids):
        for spec in sort_launch_specs(topk_ids, topk_weights, num_experts, expert_map, result, out, expanded_ids,
                                      token_lora_ids, num_loras, lora_keys, num_parts, launch_dependents, num_warps):
            spec.launch()
