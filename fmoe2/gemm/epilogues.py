"""Epilogues of the fused kernels: what a program does with its tile after the GEMMs, besides the atomic adds.

* stage 1 of the two-stage path stores its intermediate ``y`` in sorted row order (:func:`_store_y`, fp8:
  quantized once per row and slice);
* the fused path with a float32 accumulator at decode sizes casts each finished row to the output in the
  program that makes the row's last add (:func:`_cast_finished_rows`), and zeroes the output rows of tokens
  routed nowhere (:func:`_zero_unrouted_rows`), which no program adds into
  (docs/host_cost.md#one-launch-fewer-at-decode; why the barriers: docs/correctness.md).
"""
import triton
import triton.language as tl

from ..fp8 import _quantize_rows
from .tiles import _kept_slots


@triton.jit
def _store_y(y, y_rows, n_valid, y_scale_rows, slice_id, FP8_MAX: tl.constexpr = 448.0,
             SOFT_FP8_ROUNDING: tl.constexpr = False, FP8_MIN_NORMAL: tl.constexpr = 0.015625,
             FP8_SUBNORMAL_STEP: tl.constexpr = 0.001953125):
    """Stores the slice's ``y`` [BLOCK_M, BLOCK_N] at ``y_rows`` ([BLOCK_M, BLOCK_N] pointers); padding rows hold
    zeros (their x rows and routing weights are 0), so no row mask. With ``y_scale_rows`` ([BLOCK_M] pointers to
    the rows' scales, the slice one activation group) y is stored quantized to fp8, once here instead of by
    every stage-2 program, and the rows' scales at column ``slice_id``."""
    if y_scale_rows is not None:
        qy, sy = _quantize_rows(y.to(tl.float32), FP8_MAX, SOFT_FP8_ROUNDING, FP8_MIN_NORMAL, FP8_SUBNORMAL_STEP)
        tl.store(y_rows, qy.to(y_rows.dtype.element_ty), mask=n_valid[None, :])
        tl.store(y_scale_rows + slice_id, sy)
    else:
        tl.store(y_rows, y, mask=n_valid[None, :])


@triton.jit
def _cast_finished_rows(acc_rows, final_rows, token, add_counts, row_valid, expected_adds, H, stride_acc_m,
                        stride_final_m, acc_ptr, final_ptr, BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr,
                        RESET: tl.constexpr = False):
    """Counts this program's adds into its rows and casts each row it finished (its token's last add:
    ``expected_adds``) from the float32 accumulator to the output. With RESET it also zeroes each finished
    row and its counter, leaving the accumulator as it found it (the one-launch decode's, which no sort zeroes).

    ``acc_rows``/``final_rows``: [BLOCK_M, 1] row pointers; ``add_counts``: [BLOCK_M] pointers to the
    rows' tokens' add counters (zeroed by the sort). The barrier puts every thread's atomic adds of
    this program before the counter's release; the counter's acquire puts the other programs' adds of
    a finished row before its loads, which go to L2 (".cg") where the atomics are. One finished row (the
    usual case at decode sizes: a tile holds few rows) is cast with the whole program on it, BLOCK_M *
    BLOCK_H columns a step, so its cast takes one or two steps of load latency."""
    tl.debug_barrier()
    seen = tl.atomic_add(add_counts, 1, mask=row_valid, sem="acq_rel")
    finished = row_valid & (seen == expected_adds - 1)
    num_finished = tl.sum(finished.to(tl.int32), axis=0)
    if num_finished == 1:
        row = tl.sum(tl.where(finished, token, 0), axis=0)
        offs = tl.arange(0, BLOCK_M * BLOCK_H)
        for h0 in range(0, H, BLOCK_M * BLOCK_H):
            cols = h0 + offs
            v = tl.load(acc_ptr + row * stride_acc_m + cols, mask=cols < H, other=0.0, cache_modifier=".cg")
            tl.store(final_ptr + row * stride_final_m + cols, v.to(final_ptr.dtype.element_ty), mask=cols < H)
            if RESET:
                # Only once every thread has read these columns: the compiler lays the zero stores out over the
                # threads its own way (sm_90: a thread loads and casts 8 columns but zeroes 4 others), and without
                # the barrier one thread zeroed columns another had not read yet (docs/correctness.md).
                tl.debug_barrier()
                tl.store(acc_ptr + row * stride_acc_m + cols, tl.zeros_like(v), mask=cols < H)
    elif num_finished > 1:
        offs_h0 = tl.arange(0, BLOCK_H)
        for h0 in range(0, H, BLOCK_H):
            offs_h = h0 + offs_h0
            mask = finished[:, None] & (offs_h < H)[None, :]
            v = tl.load(acc_rows + offs_h[None, :], mask=mask, other=0.0, cache_modifier=".cg")
            tl.store(final_rows + offs_h[None, :], v.to(final_rows.dtype.element_ty), mask=mask)
            if RESET:  # after every thread's reads, as above
                tl.debug_barrier()
                tl.store(acc_rows + offs_h[None, :], tl.zeros_like(v), mask=mask)
    if RESET:
        tl.store(add_counts, tl.zeros_like(seen), mask=finished)


@triton.jit
def _zero_unrouted_rows(final_out_ptr, topk_ids_ptr, expert_map_ptr, first_token, num_tokens, num_global_experts, H,
                        stride_final_m, BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr, TOPK: tl.constexpr,
                        NUM_EXPERTS: tl.constexpr):
    """Zeroes the output rows of BLOCK_M tokens from ``first_token`` that route to no local expert: no
    program adds into them, so none would cast them."""
    token = first_token + tl.arange(0, BLOCK_M).to(tl.int64)
    valid = token < num_tokens
    unrouted = valid & (_kept_slots(topk_ids_ptr, expert_map_ptr, token, valid, num_global_experts, TOPK,
                                    NUM_EXPERTS) == 0)
    if tl.max(unrouted.to(tl.int32), axis=0) > 0:
        offs_h0 = tl.arange(0, BLOCK_H)
        zeros = tl.zeros([BLOCK_M, BLOCK_H], dtype=final_out_ptr.dtype.element_ty)
        for h0 in range(0, H, BLOCK_H):
            offs_h = h0 + offs_h0
            tl.store(final_out_ptr + token[:, None] * stride_final_m + offs_h[None, :], zeros,
                     mask=unrouted[:, None] & (offs_h < H)[None, :])


@triton.jit
def _cast_rows_last_added(out_ptr, final_out_ptr, token, row_valid, expected_adds, num_tokens, H, stride_out_m,
                          stride_final_m, BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr, RESET: tl.constexpr):
    """:func:`_cast_finished_rows` of a tile's rows, whose adds went into the float32 accumulator ``out_ptr``
    [M, H], followed in memory by the M int32 add counters."""
    add_counts = (out_ptr + num_tokens * stride_out_m).to(tl.pointer_type(tl.int32), bitcast=True) + token
    _cast_finished_rows(out_ptr + token[:, None] * stride_out_m, final_out_ptr + token[:, None] * stride_final_m,
                        token, add_counts, row_valid, expected_adds, H, stride_out_m, stride_final_m, out_ptr,
                        final_out_ptr, BLOCK_M, BLOCK_H, RESET)


@triton.jit
def _zeroes_unrouted_rows(final_out_ptr, topk_ids_ptr, expert_map_ptr, num_tokens, H, I, num_grid_tiles,
                          num_global_experts, stride_final_m, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                          BLOCK_H: tl.constexpr, TOPK: tl.constexpr, NUM_EXPERTS: tl.constexpr):
    """Whether this program is one of those after the ``num_grid_tiles * cdiv(I, BLOCK_N)`` GEMM programs of a
    kernel that casts its accumulator; each of them zeroes the output rows of its BLOCK_M tokens that route nowhere
    (:func:`_zero_unrouted_rows`), and the caller returns."""
    pid = tl.program_id(0)
    num_gemm_programs = num_grid_tiles * tl.cdiv(I, BLOCK_N)
    zeroing = pid >= num_gemm_programs
    if zeroing:
        _zero_unrouted_rows(final_out_ptr, topk_ids_ptr, expert_map_ptr,
                            (pid - num_gemm_programs).to(tl.int64) * BLOCK_M, num_tokens, num_global_experts, H,
                            stride_final_m, BLOCK_M, BLOCK_H, TOPK, NUM_EXPERTS)
    return zeroing
