"""Deterministic mode's last launch: each token's output row, the sum of its top-k slot rows in slot order.

In deterministic mode (``fused_moe(..., deterministic=True)``, ``fmoe2.set_deterministic``) stage 2
stores the down GEMM of every routed (token, slot) pair into its own row, ``slot_rows[token * topk +
slot]`` (routing weight and down bias already applied, in the input dtype), instead of adding it into
the output with atomics. This kernel then writes::

    out[t] = slot_rows[t*topk + 0] + slot_rows[t*topk + 1] + ... + slot_rows[t*topk + topk-1]

summed in float32, left to right, and rounded once to the output dtype. Slots whose expert is dropped
(``expert_map`` -1, ids outside ``[0, E)``) were never written: they are skipped, as the sort skips
them. Each output element has one writer and a fixed order of additions, and nothing in a row depends
on the other tokens or on M: together with the tiling of the two stages
(``get_config(..., deterministic=True)``) the forward is bitwise reproducible and batch-invariant.

With ``ROUTED=False`` the same kernel casts the float32 accumulator of a forward whose config has
``accumulate_fp32`` (the GEMMs' atomic adds went there) to the output dtype: ``out[t] = rows[t]``.
"""
import triton
import triton.language as tl

from ..sorting.moe_sorting import _routed_sort_key


@triton.jit
def _combine_slots_kernel(
    slot_rows_ptr,  # [M * TOPK, H] input dtype: row token * TOPK + slot, written for kept slots only
    out_ptr,  # [M, H]
    topk_ids_ptr,  # [M * TOPK] int32/int64, row-major [M, TOPK]
    expert_map_ptr,  # [num_global_experts] int32 (HAS_EXPERT_MAP only)
    num_tokens,  # M
    H,
    num_global_experts,
    stride_slot_m,
    stride_out_m,
    TOPK: tl.constexpr,
    NUM_EXPERTS: tl.constexpr,  # local experts E: slots whose (mapped) id is outside [0, E) are skipped
    HAS_EXPERT_MAP: tl.constexpr,
    BLOCK_T: tl.constexpr,  # tokens per program
    BLOCK_H: tl.constexpr,  # columns per program
    ROUTED: tl.constexpr = True,  # False: TOPK = 1 and every row is read (the float32 accumulator's cast)
):
    """Grid: (cdiv(M, BLOCK_T), cdiv(H, BLOCK_H))."""
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    t_valid = offs_t < num_tokens
    h_valid = offs_h < H
    offs_t = offs_t.to(tl.int64)
    acc = tl.zeros([BLOCK_T, BLOCK_H], dtype=tl.float32)
    for slot in tl.static_range(TOPK):  # slot order: the one order of the additions
        entry = offs_t * TOPK + slot
        if ROUTED:
            key = _routed_sort_key(topk_ids_ptr, expert_map_ptr, None, entry, t_valid, num_global_experts, 0,
                                   NUM_EXPERTS, HAS_EXPERT_MAP, TOPK, False)
            kept = key < NUM_EXPERTS
        else:
            kept = t_valid
        row = tl.load(slot_rows_ptr + entry[:, None] * stride_slot_m + offs_h[None, :],
                      mask=kept[:, None] & h_valid[None, :], other=0.0)
        acc += row.to(tl.float32)
    tl.store(out_ptr + offs_t[:, None] * stride_out_m + offs_h[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=t_valid[:, None] & h_valid[None, :])
