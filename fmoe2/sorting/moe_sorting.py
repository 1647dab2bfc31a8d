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
routing again, scatters its own entries with a running prefix sum and pads its range. Where
the GPU has multiprocessors to spare, an expert gets 2 programs that each scatter half of the
scan steps (``scatter_parts``). Up to ``MAX_ZERO_PROGRAMS`` extra programs, placed after the
expert programs, zero the output buffer. With adapters (``fused_moe(..., lora=...)``) one more
program, the last, counts the tokens that have one (``num_lora_tokens``): the LoRA kernels read
that count first, so a batch whose tokens all have -1 skips their adapter work.

Measured (Qwen3-30B-A3B routing, E=128, topk=8, M=4096, zeroing a 16 MB output). Dense layout,
H200: 256 zeroing programs launched before the expert programs took the sort from 34 us (no
zeroing) to 59 us; 64 programs launched after them take 37 us, of which 27 us were a histogram
pass (``tl.histogram``, bound by its shared-memory atomics). This layout, H100, same run: 31-32
us vs 37 us dense (DeepSeek-V2-Lite M=4096: 22-24 us vs 27 us with one part, 18 us with two).
What is left is instruction issue: ncu shows 0.37 instructions issued per scheduler cycle with
2.1 warps resident per scheduler (116 registers allow 2 programs per multiprocessor); removing
the scatter's layout conversions, loading the weights densely with the ids, or pipelining the
scans (``num_stages`` 2-4) each changed the time by less than the run-to-run spread.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

from ..grid_dependency import gdc_launch_dependents
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
SORT_NUM_WARPS = 8


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
def _routed_local_expert(topk_ids_ptr, expert_map_ptr, token_lora_ids_ptr, offs, valid, num_global_experts,
                         num_loras, NUM_EXPERTS: tl.constexpr, HAS_EXPERT_MAP: tl.constexpr, TOPK: tl.constexpr,
                         LORA_KEYS: tl.constexpr):
    """Sort key of each routing entry (its local expert), and whether it is kept (in range after mapping).

    With LORA_KEYS the key is ``adapter * (NUM_EXPERTS // num_loras) + expert`` and entries of
    tokens without an adapter are dropped (the baseline's LoRA alignment).
    """
    ids = tl.load(topk_ids_ptr + offs, mask=valid, other=-1)  # int32 or int64: range-check before narrowing
    if HAS_EXPERT_MAP:
        in_range = valid & (ids >= 0) & (ids < num_global_experts)
        ids = tl.load(expert_map_ptr + tl.where(in_range, ids, 0), mask=in_range, other=-1)
    if LORA_KEYS:
        num_base = NUM_EXPERTS // num_loras
        keep = valid & (ids >= 0) & (ids < num_base)
        lora = tl.load(token_lora_ids_ptr + offs // TOPK, mask=keep, other=-1)
        keep = keep & (lora >= 0) & (lora < num_loras)
        ids = lora * num_base + ids
    else:
        keep = valid & (ids >= 0) & (ids < NUM_EXPERTS)
    return tl.where(keep, ids, 0).to(tl.int32), keep


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

    # Pass 1: entries of experts < e (A) and of e itself (all, and in steps before this part's).
    below = tl.zeros([SCAN_BLOCK], dtype=tl.int32)
    mine = tl.zeros([SCAN_BLOCK], dtype=tl.int32)
    mine_before_part = tl.zeros([SCAN_BLOCK], dtype=tl.int32)
    num_steps = tl.cdiv(num_entries, SCAN_BLOCK)
    steps_per_part = tl.cdiv(num_steps, num_parts)
    part_first_step = part * steps_per_part
    part_end_step = tl.minimum(part_first_step + steps_per_part, num_steps)
    for step in range(0, num_steps):
        offs = step * SCAN_BLOCK + scan
        ids, keep = _routed_local_expert(topk_ids_ptr, expert_map_ptr, token_lora_ids_ptr, offs, offs < num_entries,
                                         num_global_experts, num_loras, NUM_EXPERTS, HAS_EXPERT_MAP, TOPK, LORA_KEYS)
        below += (keep & (ids < expert)).to(tl.int32)
        hit = keep & (ids == expert)
        mine += hit.to(tl.int32)
        mine_before_part += (hit & (step < part_first_step)).to(tl.int32)
    num_below = tl.sum(below, axis=0)
    my_count = tl.sum(mine, axis=0)
    my_count_before_part = tl.sum(mine_before_part, axis=0)
    # Expert e owns tiles [first_tile, next_first_tile): its own my_tiles, then gap tiles (-1).
    first_tile = num_below // BLOCK_M + tl.minimum(expert, num_below)
    my_tiles = tl.cdiv(my_count, BLOCK_M)
    next_first_tile = (num_below + my_count) // BLOCK_M + tl.minimum(expert + 1, num_below + my_count)

    # The last expert's range ends where all ranges end: its first program writes the counters and
    # fills the unused tail of the worst-case buffers.
    if (expert == NUM_EXPERTS - 1) & (part == 0):
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

    # Pass 2: scatter this part's share of the expert's entries in (token, slot) order.
    if my_count > 0:
        rank_base = first_tile * BLOCK_M + my_count_before_part
        for step in range(part_first_step, part_end_step):
            offs = step * SCAN_BLOCK + scan
            ids, keep = _routed_local_expert(topk_ids_ptr, expert_map_ptr, token_lora_ids_ptr, offs,
                                             offs < num_entries, num_global_experts, num_loras, NUM_EXPERTS,
                                             HAS_EXPERT_MAP, TOPK, LORA_KEYS)
            hit = keep & (ids == expert)
            hit_i32 = hit.to(tl.int32)
            dest = rank_base + tl.cumsum(hit_i32, axis=0) - 1
            weight = tl.load(topk_weights_ptr + offs, mask=hit, other=0.0).to(tl.float32)
            entry_id = offs if EXPANDED_IDS else offs // TOPK
            tl.store(sorted_token_ids_ptr + dest, entry_id.to(tl.int32), mask=hit)
            tl.store(sorted_weights_ptr + dest, weight, mask=hit)
            rank_base += tl.sum(hit_i32, axis=0)

    # Pad the expert's last tile and its gap tiles, then label both kinds of tile.
    if part == num_parts - 1:
        pad_row = tl.arange(0, 2 * BLOCK_M)
        for start in range(first_tile * BLOCK_M + my_count, next_first_tile * BLOCK_M, 2 * BLOCK_M):
            pad_pos = start + pad_row
            pad_mask = pad_pos < next_first_tile * BLOCK_M
            tl.store(sorted_token_ids_ptr + pad_pos, tl.zeros([2 * BLOCK_M], dtype=tl.int32) + pad_id, mask=pad_mask)
            tl.store(sorted_weights_ptr + pad_pos, tl.zeros([2 * BLOCK_M], dtype=tl.float32), mask=pad_mask)
        for t in range(first_tile, next_first_tile, 2 * BLOCK_M):
            tiles = t + pad_row
            label = tl.where(tiles < first_tile + my_tiles, expert, -1)
            tl.store(sorted_expert_ids_ptr + tiles, label, mask=tiles < next_first_tile)


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


def scatter_parts(num_keys: int, num_scan_steps: int, device) -> int:
    """Programs per expert (sort key): 2 when twice the keys fit on the GPU's multiprocessors and
    the scan has at least 2 steps, else 1.

    Each part still runs pass 1 over all entries but scatters only its share of the steps, so a
    second part helps only where it runs on an otherwise idle multiprocessor. H100, sort time with
    2 parts vs 1: DeepSeek-V2-Lite (E=64) M=1024 7.0-7.2 vs 9.3 us, M=4096 17.9-18.5 vs 22.4-24.5 us;
    Qwen3-30B-A3B (E=128, 256 programs on 132 multiprocessors) M=4096 33-34 vs 31-32 us; 4 parts
    were slower than 2 at every point measured.
    """
    if num_scan_steps < 2 or torch.device(device).type != "cuda":
        return 1
    num_compute_units = torch.cuda.get_device_properties(device).multi_processor_count
    return 2 if 2 * num_keys <= num_compute_units else 1


def sorting_kernel_launch(topk_ids, topk_weights, num_experts: int, expert_map, result: MoESortingResult, out,
                          expanded_ids: bool = False, token_lora_ids=None, num_loras: int = 0,
                          lora_keys: bool = False, num_parts: Optional[int] = None, launch_dependents: bool = False):
    """Grid, arguments and constexprs of the sorting kernel (shared by the launcher and ``fmoe2.codegen``).

    ``expanded_ids`` stores ``token*topk+slot`` with padding ``M*topk`` (vLLM's convention), used
    by the baseline in ``fmoe2.bench``; fmoe2 itself stores actual token ids. ``token_lora_ids``
    (int32 ``[M]``, with ``num_loras`` adapters) is read in two cases: where ``result`` has
    ``num_lora_tokens`` (fmoe2 with adapters) the sort counts the tokens with an adapter into it;
    with ``lora_keys`` the sort keys are ``adapter * num_experts + expert`` (``num_loras *
    num_experts`` keys; ``result`` must be allocated for that many) and tokens without an adapter
    are dropped: the baseline's LoRA alignment. ``launch_dependents``: the next launch is a
    programmatic dependent (``FusedMoEConfig.pdl``); the sort lets it be scheduled at once.
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
    scan_block = min(max(triton.next_power_of_2(num_entries), 16), MAX_SCAN_BLOCK)
    if num_parts is None:
        num_parts = scatter_parts(num_keys, triton.cdiv(num_entries, scan_block), topk_ids.device)
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
        FILL_BLOCK=min(max(triton.next_power_of_2(result.sorted_token_ids.numel()), 16), MAX_SCAN_BLOCK),
        HAS_EXPERT_MAP=expert_map is not None,
        EXPANDED_IDS=expanded_ids,
        LORA_KEYS=lora_keys,
        COUNT_LORA_TOKENS=count_lora_tokens,
        ZERO_OUT=num_zero_programs > 0,
        ZERO_BLOCK=ZERO_BLOCK,
        LAUNCH_DEPENDENTS=launch_dependents,
    )
    return grid, args, constexprs, {"num_warps": SORT_NUM_WARPS}


def launch_moe_sorting(topk_ids, topk_weights, num_experts: int, expert_map, result: MoESortingResult, out,
                       expanded_ids: bool = False, token_lora_ids=None, num_loras: int = 0, lora_keys: bool = False,
                       num_parts: Optional[int] = None, launch_dependents: bool = False) -> None:
    """Launches the sorting kernel into the preallocated ``result`` buffers.

    Internal: arguments are assumed checked by :func:`moe_sorting` or :func:`fmoe2.fused_moe`.
    """
    grid, args, constexprs, options = sorting_kernel_launch(topk_ids, topk_weights, num_experts, expert_map, result,
                                                            out, expanded_ids, token_lora_ids, num_loras, lora_keys,
                                                            num_parts, launch_dependents)
    with on_device(topk_ids):
        _moe_sorting_kernel[grid](**args, **constexprs, **options)
