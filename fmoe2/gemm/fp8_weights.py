"""fp8 weights (float8_e4m3fn; e4m3fnuz on gfx942) with float32 scales per block, channel or expert: the weight
format's GEMM loops, its entry kernels and the values its launches take.

A weight format beyond 16-bit is one module like this one (the entry kernels compose the shared parts of
``tiles.py``, ``activations.py``, ``epilogues.py`` and the 16-bit path's epilogues with the format's own loops),
plus its scale layout and ``prepare_weights`` conversion (``fmoe2/fp8.py``, ``layout.py``), its config fit
(``config.py``) and its reference (``fmoe2/reference.py``); ``launches.py`` registers it in
``FORMAT_ENTRIES``.

* x comes quantized by the sort launch (per row and group of 128 along H, ``fmoe2/fp8.py``); BLOCK_K is one
  activation group, so each K step's product is scaled by the rows' activation scales and the weight rows'
  scales ``s[e, row // SCALE_BLOCK_N, k0 // SCALE_BLOCK_K]`` (per-K-step block scaling, on the CUDA cores); with
  per-token activations (X_PER_ROW: one scale a row of x, weight scales constant along K) once after the loop
  (tiles of 64 rows and more) or by the scales' product each step (smaller tiles; ``_gate_up_fp8``);
* y is quantized per row and slice (one group) by the fused kernel before its down GEMM, by stage 1 where its
  slices are one group (``stage1_stores_fp8``), else by stage 2 per K step.

| entry | launch |
|---|---|
| ``_fused_fp8_kernel`` | the fused path (casting its accumulator itself where the launch gives ``final_out_ptr``) |
| ``_stage1_fp8_kernel`` | stage 1 (y stored in the input dtype, or in fp8 with its scales) |
| ``_stage2_fp8_kernel`` | stage 2 |
"""
from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from ..fp8 import FP8_GROUP, _quantize_rows, fp8_constexprs, x_scales_per_row
from ..grid_dependency import dependent_launch_prologue
from ..target import Target
from .bundles import Fp8Weights
from .epilogues import _cast_rows_last_added, _store_y, _zeroes_unrouted_rows
from .fused_moe_kernel import _activated, _expected_adds, _sorted_program
from .grouped_gemm_kernel import _add_bias, _stage2_program, _write_rows
from .tiles import _slice_columns


# ---------------------------------------------------------------------------------------------
# The GEMM loops
# ---------------------------------------------------------------------------------------------

@triton.jit
def _gate_up_fp8(xq_rows, xs_rows, row_valid, w1_expert, stride_w1_n, stride_w1_k, offs_n, n_valid, offs_r,
                 r_valid, I, H, s1_expert, stride_s1_n, stride_s1_k, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, GATE_UP_INTERLEAVED: tl.constexpr, SCALE_BLOCK_N: tl.constexpr,
                 SCALE_BLOCK_K: tl.constexpr, X_PER_ROW: tl.constexpr):
    """Gate and up accumulators [BLOCK_M, BLOCK_N] (fp32) of one slice, fp8 weights (BLOCK_K = one activation
    group): x comes quantized by the sort launch (``xq_rows``: [BLOCK_M, 1] fp8 row pointers, ``xs_rows``:
    [BLOCK_M] pointers to the rows' group scales), and each step's product is scaled by the rows' activation
    scales and the weight rows' scales ``s1_expert[orig_row // SCALE_BLOCK_N, k0 // SCALE_BLOCK_K]`` (orig_row:
    the row in the checkpoint's order, gate rows then up rows). X_PER_ROW (per-token activations, with weight
    scales constant along K: ``fmoe2.fp8.x_group``): one scale a row of x and of w1. Tiles of 64 rows and more
    (CHAINED) sum the steps' products unscaled and scale once after the loop, each step's product still added to
    the fp32 accumulator in full (``max_num_imprecise_acc=BLOCK_K``: Hopper's fp8 matrix instructions keep fewer
    bits across a chain, which took the error against the same-quantization reference from 0.5% to 1.2-1.7% in a
    probe, docs/fp8.md; the wgmma code then adds each step's product: one FADD an element a step). Smaller tiles
    (``mma.sync``, fp8 upcast to fp16) add each step's product times the scales' product, computed once before the
    loop: chained there, the fused kernel at Qwen3-30B-A3B M=16 ran at 0.89x the per-group loop's speed on an H200,
    unchained at 1.01x."""
    offs_k = tl.arange(0, BLOCK_K)
    CHAINED: tl.constexpr = X_PER_ROW and BLOCK_M >= 64
    if GATE_UP_INTERLEAVED:
        w_rows = w1_expert + offs_r[:, None] * stride_w1_n
        # interleaved row r is gate row r // 2 (r even) or up row r // 2 (r odd) of the checkpoint
        s_rows = s1_expert + ((offs_r // 2 + (offs_r % 2) * I) // SCALE_BLOCK_N) * stride_s1_n
        acc = tl.zeros([BLOCK_M, 2 * BLOCK_N], dtype=tl.float32)
        if X_PER_ROW and not CHAINED:
            scale = tl.load(xs_rows, mask=row_valid, other=0.0)[:, None] * tl.load(s_rows, mask=r_valid,
                                                                                     other=0.0)[None, :]
        for k0 in tl.range(0, H, BLOCK_K):
            k = k0 + offs_k
            k_valid = k < H
            a = tl.load(xq_rows + k[None, :], mask=row_valid[:, None] & k_valid[None, :], other=0.0)
            b = tl.load(w_rows + k[None, :] * stride_w1_k, mask=r_valid[:, None] & k_valid[None, :], other=0.0)
            if not X_PER_ROW:
                sa = tl.load(xs_rows + k0 // BLOCK_K, mask=row_valid, other=0.0)
                sb = tl.load(s_rows + (k0 // SCALE_BLOCK_K) * stride_s1_k, mask=r_valid, other=0.0)
                acc += tl.dot(a, tl.trans(b)) * (sa[:, None] * sb[None, :])
            elif CHAINED:
                acc = tl.dot(a, tl.trans(b), acc, max_num_imprecise_acc=BLOCK_K)
            else:
                acc += tl.dot(a, tl.trans(b)) * scale
        if CHAINED:  # (the scales after the loop: not held in registers through it)
            acc *= tl.load(xs_rows, mask=row_valid, other=0.0)[:, None] * tl.load(s_rows, mask=r_valid,
                                                                                    other=0.0)[None, :]
        gate, up = tl.split(tl.reshape(acc, [BLOCK_M, BLOCK_N, 2]))
    else:
        gate_rows = w1_expert + offs_n[:, None] * stride_w1_n
        up_rows = gate_rows + I * stride_w1_n
        sg_rows = s1_expert + (offs_n // SCALE_BLOCK_N) * stride_s1_n
        su_rows = s1_expert + ((I + offs_n) // SCALE_BLOCK_N) * stride_s1_n
        gate = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        if X_PER_ROW and not CHAINED:
            sa = tl.load(xs_rows, mask=row_valid, other=0.0)[:, None]
            gate_scale = sa * tl.load(sg_rows, mask=n_valid, other=0.0)[None, :]
            up_scale = sa * tl.load(su_rows, mask=n_valid, other=0.0)[None, :]
        for k0 in tl.range(0, H, BLOCK_K):
            k = k0 + offs_k
            k_valid = k < H
            w_mask = n_valid[:, None] & k_valid[None, :]
            a = tl.load(xq_rows + k[None, :], mask=row_valid[:, None] & k_valid[None, :], other=0.0)
            bg = tl.load(gate_rows + k[None, :] * stride_w1_k, mask=w_mask, other=0.0)
            bu = tl.load(up_rows + k[None, :] * stride_w1_k, mask=w_mask, other=0.0)
            if not X_PER_ROW:
                sa = tl.load(xs_rows + k0 // BLOCK_K, mask=row_valid, other=0.0)
                s_step = (k0 // SCALE_BLOCK_K) * stride_s1_k
                sg = tl.load(sg_rows + s_step, mask=n_valid, other=0.0)
                su = tl.load(su_rows + s_step, mask=n_valid, other=0.0)
                gate += tl.dot(a, tl.trans(bg)) * (sa[:, None] * sg[None, :])
                up += tl.dot(a, tl.trans(bu)) * (sa[:, None] * su[None, :])
            elif CHAINED:
                gate = tl.dot(a, tl.trans(bg), gate, max_num_imprecise_acc=BLOCK_K)
                up = tl.dot(a, tl.trans(bu), up, max_num_imprecise_acc=BLOCK_K)
            else:
                gate += tl.dot(a, tl.trans(bg)) * gate_scale
                up += tl.dot(a, tl.trans(bu)) * up_scale
        if CHAINED:
            sa = tl.load(xs_rows, mask=row_valid, other=0.0)[:, None]
            gate *= sa * tl.load(sg_rows, mask=n_valid, other=0.0)[None, :]
            up *= sa * tl.load(su_rows, mask=n_valid, other=0.0)[None, :]
    return gate, up


@triton.jit
def _down_fp8(y, out_rows, row_mask, w2_expert, stride_w2_h, stride_w2_i, offs_n, n_valid, H, slice_col0, b2_expert,
              bias_weight, s2_expert, stride_s2_n, stride_s2_k, BLOCK_H: tl.constexpr, FP8_MAX: tl.constexpr,
              SOFT_FP8_ROUNDING: tl.constexpr, FP8_MIN_NORMAL: tl.constexpr, FP8_SUBNORMAL_STEP: tl.constexpr,
              SCALE_BLOCK_N: tl.constexpr, SCALE_BLOCK_K: tl.constexpr):
    """out[rows] += y @ W2[:, slice]^T with fp8 weights (the slice one activation group): y is quantized per
    row once, and each chunk's product scaled by the rows' scales and ``s2_expert[h // SCALE_BLOCK_N,
    slice_col0 // SCALE_BLOCK_K]``; the bias as in :func:`operands._down_16bit`."""
    qy, sy = _quantize_rows(y.to(tl.float32), FP8_MAX, SOFT_FP8_ROUNDING, FP8_MIN_NORMAL, FP8_SUBNORMAL_STEP)
    qy = qy.to(w2_expert.dtype.element_ty)
    s2_col = s2_expert + (slice_col0 // SCALE_BLOCK_K) * stride_s2_k
    offs_h0 = tl.arange(0, BLOCK_H)
    for h0 in tl.range(0, H, BLOCK_H):
        offs_h = h0 + offs_h0
        h_valid = offs_h < H
        w = tl.load(w2_expert + offs_h[:, None] * stride_w2_h + offs_n[None, :] * stride_w2_i,
                    mask=h_valid[:, None] & n_valid[None, :], other=0.0)
        s2 = tl.load(s2_col + (offs_h // SCALE_BLOCK_N) * stride_s2_n, mask=h_valid, other=0.0)
        partial = tl.dot(qy, tl.trans(w)) * (sy[:, None] * s2[None, :])
        if b2_expert is not None:
            b2 = tl.load(b2_expert + offs_h, mask=h_valid, other=0.0).to(tl.float32)
            partial += bias_weight[:, None] * b2[None, :]
        tl.atomic_add(out_rows + offs_h[None, :], partial.to(out_rows.dtype.element_ty),
                      mask=row_mask[:, None] & h_valid[None, :], sem="relaxed")


@triton.jit
def _tile_gemm_fp8(a_rows, a_scale_rows, row_valid, b_rows, bs_rows, n_valid, stride_b_k, stride_bs_k, k_first, k_end,
                   K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, FP8_MAX: tl.constexpr,
                   SOFT_FP8_ROUNDING: tl.constexpr, FP8_MIN_NORMAL: tl.constexpr, FP8_SUBNORMAL_STEP: tl.constexpr,
                   SCALE_BLOCK_K: tl.constexpr):
    """:func:`grouped_gemm_kernel._tile_gemm_16bit` with fp8 B (``bs_rows`` [BLOCK_N] pointers to its rows' scales,
    at K step 0):
    A's tiles are quantized here per row (BLOCK_K = one activation group), or, with ``a_scale_rows`` ([BLOCK_M]
    pointers to the rows' scales), A is fp8 already; each step's product is scaled by both."""
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(k_first, k_end, BLOCK_K):
        k = k0 + offs_k
        k_valid = k < K
        a = tl.load(a_rows + k[None, :], mask=row_valid[:, None] & k_valid[None, :], other=0.0)
        b = tl.load(b_rows + k[None, :] * stride_b_k, mask=n_valid[:, None] & k_valid[None, :], other=0.0)
        if a_scale_rows is None:
            qa, sa = _quantize_rows(a.to(tl.float32), FP8_MAX, SOFT_FP8_ROUNDING, FP8_MIN_NORMAL, FP8_SUBNORMAL_STEP)
            qa = qa.to(b.dtype)
        else:
            qa = a
            sa = tl.load(a_scale_rows + k0 // BLOCK_K, mask=row_valid, other=0.0)
        sb = tl.load(bs_rows + (k0 // SCALE_BLOCK_K) * stride_bs_k, mask=n_valid, other=0.0)
        acc += tl.dot(qa, tl.trans(b)) * (sa[:, None] * sb[None, :])
    return acc


@triton.jit
def _intermediate_fp8(x_q_ptr, x_scale_ptr, stride_xq_m, stride_xs_m, w1, expert, token, row_valid, route_weight,
                      slice_id, H, I, DTYPE: tl.constexpr, ACTIVATION: tl.constexpr, SWIGLU_ALPHA: tl.constexpr,
                      SWIGLU_LIMIT: tl.constexpr, GATE_UP_INTERLEAVED: tl.constexpr, BLOCK_M: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SCALE_BLOCK_N: tl.constexpr,
                      SCALE_BLOCK_K: tl.constexpr, X_PER_ROW: tl.constexpr):
    """:func:`fused_moe_kernel._intermediate_16bit` from fp8 weights ``w1`` (an :class:`~.bundles.Fp8Weights`) and
    the sort's fp8 x, y in ``DTYPE``."""
    offs_n, n_valid, offs_r, r_valid = _slice_columns(slice_id, I, BLOCK_N)
    gate, up = _gate_up_fp8(x_q_ptr + token[:, None] * stride_xq_m, x_scale_ptr + token * stride_xs_m, row_valid,
                            w1.ptr + expert * w1.stride_e, w1.stride_n, w1.stride_k, offs_n, n_valid, offs_r, r_valid,
                            I, H, w1.scale_ptr + expert * w1.stride_scale_e, w1.stride_scale_n, w1.stride_scale_k,
                            BLOCK_M, BLOCK_N, BLOCK_K, GATE_UP_INTERLEAVED, SCALE_BLOCK_N, SCALE_BLOCK_K, X_PER_ROW)
    y = _activated(gate, up, w1.bias_ptr, expert, w1.stride_bias_e, route_weight, offs_n, n_valid, I, w13_desc=None,
                   dtype=DTYPE, ACTIVATION=ACTIVATION, SWIGLU_ALPHA=SWIGLU_ALPHA, SWIGLU_LIMIT=SWIGLU_LIMIT,
                   GATE_UP_INTERLEAVED=GATE_UP_INTERLEAVED)
    return y, offs_n, n_valid


# ---------------------------------------------------------------------------------------------
# Entry kernels
# ---------------------------------------------------------------------------------------------

@triton.jit
def _fused_fp8_kernel(
    x_q_ptr,  # [M, H] fp8 x, quantized by the sort launch
    x_scale_ptr,  # [M, cdiv(H, BLOCK_K)] float32 scales of x_q ([M, 1] with X_PER_ROW)
    # Fp8Weights: fp8 weights as the 16-bit ones (pointer loads only), their [E, Sn, Sk] float32 scales in the
    # checkpoint's row order (fmoe2/fp8.py; stride 0 along a dimension of size 1), their biases
    w1, w2,
    out_ptr,
    final_out_ptr, topk_ids_ptr, expert_map_ptr,  # None, or as _fused_cast_kernel's (fused_moe_kernel.py)
    sorted_token_ids_ptr, sorted_weights_ptr, sorted_expert_ids_ptr, num_sorted_tiles_ptr,
    num_tokens, H, I, num_grid_tiles, num_global_experts,
    stride_xq_m, stride_xs_m, stride_out_m, stride_final_m,
    DTYPE: tl.constexpr,  # x's dtype: y is rounded to it before its quantization, as the 16-bit forward rounds y
    ACTIVATION: tl.constexpr, SWIGLU_ALPHA: tl.constexpr, SWIGLU_LIMIT: tl.constexpr,
    GATE_UP_INTERLEAVED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_H: tl.constexpr, GROUP_M: tl.constexpr, PDL: tl.constexpr, TOPK: tl.constexpr, NUM_EXPERTS: tl.constexpr,
    # y is quantized here per row and BLOCK_N columns (one activation group); SOFT_FP8_ROUNDING under the
    # interpreter only (fmoe2/fp8.py)
    FP8_MAX: tl.constexpr, SOFT_FP8_ROUNDING: tl.constexpr, FP8_MIN_NORMAL: tl.constexpr,
    FP8_SUBNORMAL_STEP: tl.constexpr,
    SCALE_BLOCK_N: tl.constexpr,  # weight rows per scale (both weights)
    SCALE_BLOCK_K: tl.constexpr,  # weight columns per scale
    X_PER_ROW: tl.constexpr,  # x_scale [M, 1]: per-token activations (fmoe2/fp8.py), w1 scaled per channel or tensor
):
    """The fused path with fp8 weights (``operands.py``); BLOCK_K and BLOCK_N are one activation group."""
    dependent_launch_prologue(PDL)
    if final_out_ptr is not None:  # (programs after the GEMM programs)
        if _zeroes_unrouted_rows(final_out_ptr, topk_ids_ptr, expert_map_ptr, num_tokens, H, I, num_grid_tiles,
                                 num_global_experts, stride_final_m, BLOCK_M, BLOCK_N, BLOCK_H, TOPK, NUM_EXPERTS):
            return
    expert, slice_id, offs_m, token, row_valid, route_weight = _sorted_program(
        tl.program_id(0), sorted_token_ids_ptr, sorted_weights_ptr, sorted_expert_ids_ptr, num_sorted_tiles_ptr,
        num_tokens, I, num_grid_tiles, BLOCK_M, BLOCK_N, GROUP_M, IDS_PER_TOKEN=1)
    if expert < 0:
        return
    y, offs_n, n_valid = _intermediate_fp8(x_q_ptr, x_scale_ptr, stride_xq_m, stride_xs_m, w1, expert, token,
                                           row_valid, route_weight, slice_id, H, I, DTYPE, ACTIVATION, SWIGLU_ALPHA,
                                           SWIGLU_LIMIT, GATE_UP_INTERLEAVED, BLOCK_M, BLOCK_N, BLOCK_K,
                                           SCALE_BLOCK_N, SCALE_BLOCK_K, X_PER_ROW)
    expected_adds = _expected_adds(final_out_ptr, topk_ids_ptr, expert_map_ptr, token, row_valid, num_global_experts,
                                   I, BLOCK_N, TOPK, NUM_EXPERTS)  # before the down loop, whose time hides it
    b2_expert = None
    if w2.bias_ptr is not None:
        b2_expert = w2.bias_ptr + expert * w2.stride_bias_e
    _down_fp8(y, out_ptr + token[:, None] * stride_out_m, row_valid, w2.ptr + expert * w2.stride_e, w2.stride_n,
              w2.stride_k, offs_n, n_valid, H, slice_id * BLOCK_N, b2_expert,
              tl.where(slice_id == 0, route_weight, 0.0),
              w2.scale_ptr + expert * w2.stride_scale_e, w2.stride_scale_n, w2.stride_scale_k, BLOCK_H, FP8_MAX,
              SOFT_FP8_ROUNDING, FP8_MIN_NORMAL, FP8_SUBNORMAL_STEP, SCALE_BLOCK_N, SCALE_BLOCK_K)
    if final_out_ptr is not None:
        _cast_rows_last_added(out_ptr, final_out_ptr, token, row_valid, expected_adds, num_tokens, H, stride_out_m,
                              stride_final_m, BLOCK_M, BLOCK_H, RESET=False)


@triton.jit
def _stage1_fp8_kernel(
    x_q_ptr, x_scale_ptr, w1,  # as _fused_fp8_kernel's
    y_ptr,  # [num_grid_tiles * BLOCK_M, I]: in DTYPE, or fp8 where y_scale_ptr is given
    y_scale_ptr,  # None, or [num_grid_tiles * BLOCK_M, cdiv(I, BLOCK_N)] float32 scales of the fp8 y (BLOCK_N is
    # then one activation group)
    sorted_token_ids_ptr, sorted_weights_ptr, sorted_expert_ids_ptr, num_sorted_tiles_ptr,
    num_tokens, H, I, num_grid_tiles,
    stride_xq_m, stride_xs_m, stride_y_m, stride_ys_m,
    DTYPE: tl.constexpr, ACTIVATION: tl.constexpr, SWIGLU_ALPHA: tl.constexpr, SWIGLU_LIMIT: tl.constexpr,
    GATE_UP_INTERLEAVED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, PDL: tl.constexpr, IDS_PER_TOKEN: tl.constexpr,
    FP8_MAX: tl.constexpr, SOFT_FP8_ROUNDING: tl.constexpr, FP8_MIN_NORMAL: tl.constexpr,
    FP8_SUBNORMAL_STEP: tl.constexpr, SCALE_BLOCK_N: tl.constexpr, SCALE_BLOCK_K: tl.constexpr,
    X_PER_ROW: tl.constexpr,
):
    dependent_launch_prologue(PDL)
    expert, slice_id, offs_m, token, row_valid, route_weight = _sorted_program(
        tl.program_id(0), sorted_token_ids_ptr, sorted_weights_ptr, sorted_expert_ids_ptr, num_sorted_tiles_ptr,
        num_tokens, I, num_grid_tiles, BLOCK_M, BLOCK_N, GROUP_M, IDS_PER_TOKEN)
    if expert < 0:
        return
    y, offs_n, n_valid = _intermediate_fp8(x_q_ptr, x_scale_ptr, stride_xq_m, stride_xs_m, w1, expert, token,
                                           row_valid, route_weight, slice_id, H, I, DTYPE, ACTIVATION, SWIGLU_ALPHA,
                                           SWIGLU_LIMIT, GATE_UP_INTERLEAVED, BLOCK_M, BLOCK_N, BLOCK_K,
                                           SCALE_BLOCK_N, SCALE_BLOCK_K, X_PER_ROW)
    y_scale_rows = None
    if y_scale_ptr is not None:
        y_scale_rows = y_scale_ptr + offs_m.to(tl.int64) * stride_ys_m
    _store_y(y, y_ptr + offs_m.to(tl.int64)[:, None] * stride_y_m + offs_n[None, :], n_valid, y_scale_rows, slice_id,
             FP8_MAX, SOFT_FP8_ROUNDING, FP8_MIN_NORMAL, FP8_SUBNORMAL_STEP)


@triton.jit
def _stage2_fp8_kernel(
    a_ptr,  # y [num_grid_tiles * BLOCK_M, K]: 16-bit (quantized here), or fp8 with a_scale_ptr
    a_scale_ptr,  # None, or [num_grid_tiles * BLOCK_M, cdiv(K, BLOCK_K)] float32 scales of an fp8 y (stage 1's)
    b_ptr,  # fp8 w2 [E, N, K]
    b_scale_ptr,  # [E, Sn, Sk] float32 (stride 0 along a dimension of size 1): B[e, n, k]'s at [e, n //
    # SCALE_BLOCK_N, k // SCALE_BLOCK_K]
    # as _stage2_kernel's (grouped_gemm_kernel.py):
    c_ptr, bias_ptr, row_weights_ptr, sorted_ids_ptr, expert_ids_ptr, num_sorted_tiles_ptr,
    num_valid_ids, N, K, num_grid_tiles,
    stride_a_m, stride_as_m, stride_b_e, stride_b_n, stride_b_k, stride_bs_e, stride_bs_n, stride_bs_k,
    stride_bias_e, stride_c_m,
    ATOMIC_OUTPUT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, PDL: tl.constexpr, SPLIT_K: tl.constexpr,
    FP8_MAX: tl.constexpr, SOFT_FP8_ROUNDING: tl.constexpr, FP8_MIN_NORMAL: tl.constexpr,
    FP8_SUBNORMAL_STEP: tl.constexpr, SCALE_BLOCK_N: tl.constexpr, SCALE_BLOCK_K: tl.constexpr,
):
    expert, tile, n_block, k_first, k_end, offs_m, row_id, row_valid, offs_n, n_valid = _stage2_program(
        sorted_ids_ptr, expert_ids_ptr, num_sorted_tiles_ptr, num_valid_ids, N, K, num_grid_tiles, BLOCK_M, BLOCK_N,
        BLOCK_K, GROUP_M, SPLIT_K, ATOMIC_OUTPUT, PDL)
    if expert < 0:
        return
    a_row = offs_m.to(tl.int64)
    a_scale_rows = None
    if a_scale_ptr is not None:
        a_scale_rows = a_scale_ptr + a_row * stride_as_m
    acc = _tile_gemm_fp8(a_ptr + a_row[:, None] * stride_a_m, a_scale_rows, row_valid,
                         b_ptr + expert * stride_b_e + offs_n[:, None] * stride_b_n,
                         b_scale_ptr + expert * stride_bs_e + (offs_n // SCALE_BLOCK_N) * stride_bs_n, n_valid,
                         stride_b_k, stride_bs_k, k_first, k_end, K, BLOCK_M, BLOCK_N, BLOCK_K, FP8_MAX,
                         SOFT_FP8_ROUNDING, FP8_MIN_NORMAL, FP8_SUBNORMAL_STEP, SCALE_BLOCK_K)
    acc = _add_bias(acc, bias_ptr, stride_bias_e, expert, row_weights_ptr, offs_m, offs_n, n_valid, k_first)
    _write_rows(acc, c_ptr, row_id, row_valid, offs_n, n_valid, stride_c_m, ATOMIC_OUTPUT)


# ---------------------------------------------------------------------------------------------
# The launches' values
# ---------------------------------------------------------------------------------------------

ENTRIES = {"fused": _fused_fp8_kernel, "fused_cast": _fused_fp8_kernel, "stage1": _stage1_fp8_kernel,
           "stage2": _stage2_fp8_kernel}
_TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


def scale_strides(scale: torch.Tensor) -> Tuple[int, int, int]:
    """Strides of an ``[E, Sn, Sk]`` scale view as the kernels read it: 0 along a dimension of size 1."""
    return tuple(st if size > 1 else 0 for size, st in zip(scale.shape, scale.stride()))


def _constants(problem, target: Target) -> dict:
    """The fp8 constants of the weights' dtype (``fmoe2/fp8.py``) and the scale block ``(block_n, block_k)``."""
    constants = {k: v for k, v in fp8_constexprs(problem.w1.dtype, target.interpreter).items() if k != "FP8"}
    block_n, block_k = problem.scale_block
    return dict(constants, SCALE_BLOCK_N=block_n, SCALE_BLOCK_K=block_k)


def fused_values(problem, target: Target, quantized_x: Optional[Tuple[torch.Tensor, torch.Tensor]]) -> dict:
    """The values the fused and stage-1 entries take beyond the 16-bit path's: the weights with their scales (as
    :class:`~.bundles.Fp8Weights`, in place of the 16-bit path's ``w1`` and ``w2``), x
    quantized by the sort launch (``quantized_x``: ``(x_q, x_scale)``), the input dtype and the fp8 constants."""
    x_q, x_scale = quantized_x
    return dict(_constants(problem, target), X_PER_ROW=x_scales_per_row(x_scale, problem.hidden_size),
                w1=_weights(problem.w1, problem.w1_scale, problem.w1_bias),
                w2=_weights(problem.w2, problem.w2_scale, problem.w2_bias), x_q_ptr=x_q, x_scale_ptr=x_scale,
                stride_xq_m=x_q.stride(0), stride_xs_m=x_scale.stride(0), DTYPE=_TL_DTYPES[problem.x.dtype])


def _weights(w: torch.Tensor, scale: torch.Tensor, bias: Optional[torch.Tensor]) -> Fp8Weights:
    """fp8 weights ``[E, N, K]`` with their scales and bias as the fused and stage-1 entries take them."""
    return Fp8Weights(w, scale, bias, *w.stride(), *scale_strides(scale), bias.stride(0) if bias is not None else None)


def stage2_values(problem, target: Target, workspace) -> dict:
    """The values stage 2's entry takes beyond the 16-bit path's: w2's scales, and y's where stage 1 stored y in
    fp8 (else stage 2 quantizes y per row and K step, S2_BLOCK_K being one group of FP8_GROUP)."""
    y_scale = workspace.y_scale
    s_e, s_n, s_k = scale_strides(problem.w2_scale)
    return dict(_constants(problem, target), b_scale_ptr=problem.w2_scale, stride_bs_e=s_e, stride_bs_n=s_n,
                stride_bs_k=s_k, a_scale_ptr=y_scale, stride_as_m=y_scale.stride(0) if y_scale is not None else None)


__all__ = ["ENTRIES", "FP8_GROUP", "fused_values", "scale_strides", "stage2_values"]
