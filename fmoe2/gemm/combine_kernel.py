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

``_cast_rows_kernel`` casts the float32 accumulator of a forward whose config has ``accumulate_fp32`` (the GEMMs'
atomic adds went there) to the output dtype: ``out[t] = rows[t]``.
"""
import triton
import triton.language as tl

from ..sorting.moe_sorting import _routed_sort_key


@triton.jit
def _token_block(num_tokens, H, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr):
    """``(offs_t, offs_h, t_valid, h_valid)``: the program's BLOCK_T tokens (int64) and BLOCK_H columns."""
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    return offs_t.to(tl.int64), offs_h, offs_t < num_tokens, offs_h < H


@triton.jit
def _combine_slots_kernel(
    slot_rows_ptr,  # [M * TOPK, H] input dtype: row token * TOPK + slot, written for kept slots only
    out_ptr,  # [M, H]
    topk_ids_ptr,  # [M * TOPK] int32/int64, row-major [M, TOPK]
    expert_map_ptr,  # None or [num_global_experts] int32
    num_tokens,  # M
    H,
    num_global_experts,
    stride_slot_m,
    stride_out_m,
    TOPK: tl.constexpr,
    NUM_EXPERTS: tl.constexpr,  # local experts E: slots whose (mapped) id is outside [0, E) are skipped
    BLOCK_T: tl.constexpr,  # tokens per program
    BLOCK_H: tl.constexpr,  # columns per program
):
    """Grid: (cdiv(M, BLOCK_T), cdiv(H, BLOCK_H))."""
    offs_t, offs_h, t_valid, h_valid = _token_block(num_tokens, H, BLOCK_T, BLOCK_H)
    acc = tl.zeros([BLOCK_T, BLOCK_H], dtype=tl.float32)
    for slot in tl.static_range(TOPK):  # slot order: the one order of the additions
        entry = offs_t * TOPK + slot
        key = _routed_sort_key(topk_ids_ptr, expert_map_ptr, token_lora_ids_ptr=None, offs=entry, valid=t_valid,
                               num_global_experts=num_global_experts, num_loras=0, NUM_EXPERTS=NUM_EXPERTS,
                               HAS_EXPERT_MAP=expert_map_ptr is not None, TOPK=TOPK, LORA_KEYS=False)
        kept = key < NUM_EXPERTS
        row = tl.load(slot_rows_ptr + entry[:, None] * stride_slot_m + offs_h[None, :],
                      mask=kept[:, None] & h_valid[None, :], other=0.0)
        acc += row.to(tl.float32)
    tl.store(out_ptr + offs_t[:, None] * stride_out_m + offs_h[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=t_valid[:, None] & h_valid[None, :])


@triton.jit
def _cast_rows_kernel(
    rows_ptr,  # [M, H] float32: the accumulator of a forward with accumulate_fp32
    out_ptr,  # [M, H]
    num_tokens, H, stride_rows_m, stride_out_m,
    BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr,
):
    """``out[t] = rows[t]`` in out's dtype. Grid: (cdiv(M, BLOCK_T), cdiv(H, BLOCK_H))."""
    offs_t, offs_h, t_valid, h_valid = _token_block(num_tokens, H, BLOCK_T, BLOCK_H)
    mask = t_valid[:, None] & h_valid[None, :]
    row = tl.load(rows_ptr + offs_t[:, None] * stride_rows_m + offs_h[None, :], mask=mask, other=0.0)
    row = row.to(tl.float32).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + offs_t[:, None] * stride_out_m + offs_h[None, :], row, mask=mask)
