"""Which rows and columns a GEMM program works on: the ``@triton.jit`` helpers every entry kernel starts with.

A program of the fused kernels (``fused_moe_kernel.py``) owns one tile of rows and one slice of BLOCK_N
intermediate columns; a program of stage 2 (``grouped_gemm_kernel.py``) one tile and one block of output
columns. Tiles come from the sort (``fmoe2/sorting``): BLOCK_M rows of one expert, padded with an id past the
valid ones; the one-launch decode has no sort, and its tile t is the token's top-k slot t.

Programs are ordered so the column blocks of GROUP_M neighbouring tiles run together: with GROUP_M=1 all
blocks of one tile are adjacent in launch order (its output rows stay hot in L2 while they are added to); a
larger GROUP_M lets tiles of one expert share weight blocks in L2.
"""
import triton
import triton.language as tl

from ..sorting.moe_sorting import _routed_sort_key


@triton.jit
def _grouped_program(pid, num_grid_tiles, num_blocks, GROUP_M: tl.constexpr):
    """``(tile, block)`` of program ``pid`` in the grouped order over ``num_grid_tiles`` tiles x ``num_blocks``
    column blocks."""
    programs_per_group = GROUP_M * num_blocks
    first_tile = (pid // programs_per_group) * GROUP_M
    group_tiles = tl.minimum(num_grid_tiles - first_tile, GROUP_M)
    local = pid % programs_per_group
    return first_tile + local % group_tiles, local // group_tiles


@triton.jit
def _tile_expert(tile, num_sorted_tiles_ptr, sorted_expert_ids_ptr):
    """The expert (int64) of sorted ``tile``; -1 where the program has nothing to do: the tile is past the
    sorted tiles (the grid is sized for the worst routing) or a gap tile of the sorted layout."""
    # A masked load, not a branch that yields the expert: the branch made gfx942's fp8 fused kernel take 252 VGPRs
    # instead of 152 (Triton 3.6, Qwen3 M=1), and fewer matrix instructions.
    in_use = tile < tl.load(num_sorted_tiles_ptr)
    return tl.load(sorted_expert_ids_ptr + tile, mask=in_use, other=-1).to(tl.int64)


@triton.jit
def _sorted_rows(first_row, sorted_token_ids_ptr, sorted_weights_ptr, num_tokens, ROWS: tl.constexpr,
                 IDS_PER_TOKEN: tl.constexpr):
    """``(offs_m, token, row_valid, route_weight)`` of ROWS sorted rows from ``first_row`` (a tile's first, or its
    tail's: :func:`_fits_tail`): the rows [ROWS], their tokens (int64), which rows are real, and their routing
    weights (fp32, 0 on padding). Sorted ids are token ids, or ``token * IDS_PER_TOKEN + slot`` where
    IDS_PER_TOKEN > 1 (the deterministic mode's, padding ``M * IDS_PER_TOKEN``)."""
    offs_m = first_row + tl.arange(0, ROWS)
    token = tl.load(sorted_token_ids_ptr + offs_m)
    if IDS_PER_TOKEN > 1:
        row_valid = token < num_tokens * IDS_PER_TOKEN
        token = token.to(tl.int64) // IDS_PER_TOKEN
    else:
        row_valid = token < num_tokens
        token = token.to(tl.int64)
    route_weight = tl.load(sorted_weights_ptr + offs_m)
    return offs_m, token, row_valid, route_weight


@triton.jit
def _fits_tail(row_valid, TAIL_M: tl.constexpr):
    """Whether a sorted tile's real rows (``row_valid`` [BLOCK_M]) all lie in its first TAIL_M rows, so that its
    programs may compute those rows only. The sort writes each expert's rows from the start of its first tile and
    pads its last tile at the end (``fmoe2/sorting``), so a tile holding at most TAIL_M real rows holds them there.
    With uniform routing an expert's last tile holds on average half a tile of padding, most of the work a grouped
    GEMM wastes at 1-4 tiles per expert (docs/performance.md#the-tail-tile). Callers test ``TAIL_M > 0 and
    _fits_tail(...)``: a constexpr test first, so that without tails the tail branch is not compiled (a value
    returned by a jit function is not a constexpr to its caller)."""
    return tl.sum(row_valid.to(tl.int32), axis=0) <= TAIL_M


@triton.jit
def _slot_expert(slot, topk_ids_ptr, expert_map_ptr, num_global_experts, TOPK: tl.constexpr,
                 NUM_EXPERTS: tl.constexpr):
    """The one-launch decode's tile ``slot``: the local expert (int64) of the token's top-k ``slot``, -1 for a
    dropped slot (another rank's expert, or an id out of range), by the sort's own rule."""
    key = _routed_sort_key(topk_ids_ptr, expert_map_ptr, token_lora_ids_ptr=None, offs=slot, valid=None,
                           num_global_experts=num_global_experts, num_loras=0, NUM_EXPERTS=NUM_EXPERTS,
                           HAS_EXPERT_MAP=expert_map_ptr is not None, TOPK=TOPK, LORA_KEYS=False)
    return tl.where(key < NUM_EXPERTS, key.to(tl.int32, bitcast=True).to(tl.int64), -1)


@triton.jit
def _slot_rows(slot, topk_weights_ptr, BLOCK_M: tl.constexpr):
    """``(offs_m, token, row_valid, route_weight)`` of the one-launch decode's tile: the one token in its first
    row, with the routing weight of its top-k ``slot``."""
    offs_m = tl.arange(0, BLOCK_M)
    row_valid = offs_m < 1
    token = tl.zeros([BLOCK_M], dtype=tl.int64)
    route_weight = tl.load(topk_weights_ptr + slot + offs_m, mask=row_valid, other=0.0).to(tl.float32)
    return offs_m, token, row_valid, route_weight


@triton.jit
def _slice_columns(slice_id, I, BLOCK_N: tl.constexpr):
    """``(offs_n, n_valid, offs_r, r_valid)``: the slice's intermediate columns, and its gate/up rows of the
    interleaved layout (g0, u0, g1, u1, ...)."""
    offs_n = slice_id * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_r = slice_id * (2 * BLOCK_N) + tl.arange(0, 2 * BLOCK_N)
    return offs_n, offs_n < I, offs_r, offs_r < 2 * I


@triton.jit
def _kept_slots(topk_ids_ptr, expert_map_ptr, token, row_valid, num_global_experts, TOPK: tl.constexpr,
                NUM_EXPERTS: tl.constexpr):
    """[BLOCK_M] int32: how many of each row's token's top-k slots route to a local expert, by the sort's
    own rule (``_routed_sort_key`` below NUM_EXPERTS); 0 for invalid rows."""
    kept = tl.zeros(token.shape, dtype=tl.int32)
    for slot in tl.static_range(TOPK):
        key = _routed_sort_key(topk_ids_ptr, expert_map_ptr, token_lora_ids_ptr=None, offs=token * TOPK + slot,
                               valid=row_valid, num_global_experts=num_global_experts, num_loras=0,
                               NUM_EXPERTS=NUM_EXPERTS, HAS_EXPERT_MAP=expert_map_ptr is not None, TOPK=TOPK,
                               LORA_KEYS=False)
        kept += (key < NUM_EXPERTS).to(tl.int32)
    return kept
