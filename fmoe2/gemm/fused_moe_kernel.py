"""The single fused MoE kernel: gate+up GEMM, activation, routing weight, down GEMM, atomic add.

One program owns one sorted tile (BLOCK_M rows of one expert) and one slice of BLOCK_N
columns of the intermediate dimension:

    acc_gate, acc_up = x[tile] @ W_gate[e, slice]^T, x[tile] @ W_up[e, slice]^T   (fp32, over all H)
    y                = act(acc_gate) * acc_up * routing_weight                     (registers)
    out[tile]       += y @ W_down[e, :, slice]^T                                   (over H in BLOCK_H chunks,
                                                                                    relaxed atomic adds)

Each output element therefore receives ``topk * ceil(I / BLOCK_N)`` atomic adds, in the output
dtype or (``FusedMoEConfig.accumulate_fp32``, the default with 16-bit outputs) into a float32
accumulator; with CAST_FINISHED_ROWS (at M=1: ``launches.fused_kernel_casts``) the program that makes
a token's last add casts its row to the output, counted by per-token counters after the accumulator
(``_cast_finished_rows``; docs/host_cost.md#one-launch-fewer-at-decode).

Programs are ordered so the slices of GROUP_M neighbouring tiles run together: with GROUP_M=1 all
slices of one tile are adjacent in launch order (its output rows stay hot in L2 while they are added
to); a larger GROUP_M lets tiles of one expert share weight slices in L2.

With ``STORE_Y`` the kernel is stage 1 of the two-stage path: it stores ``y`` (routing weight
applied) in sorted row order and skips the down GEMM, which ``grouped_gemm_kernel`` then does.
With ``STORE_Y`` and ``HAS_LORA`` it either adds the gate/up deltas that ``_lora_expand_kernel``
wrote (``LORA_DELTAS_READY``; ``fmoe2/gemm/lora_kernel.py`` says why) or, at decode sizes (see
``lora_in_stages`` in ``fmoe2/gemm/config.py``), computes them in its own loops as the fused
path does, and stores each row's down shrink of its slice, ``y_slice @ A2[adapter, :, slice]^T``,
which stage 2 sums over the slices and expands (``grouped_gemm_kernel.py``).

With ``HAS_LORA`` on the fused path (multi-LoRA, layouts in ``fmoe2/gemm/lora.py``) tiles stay per
expert, so the base weights are read exactly as without adapters whatever the mix of adapters. The adapters a
tile's rows use (token_lora_ids, -1 = none) are numbered densely into slots; LORA_SLOTS slots
(one group) are stacked into one operand of rank ``LORA_SLOTS * R``, so a tile that mixes up to
LORA_SLOTS adapters costs one product per step, not one per adapter:

* gate/up shrink: ``x @ A13[stack]^T`` (the gate rows of every slot, then their up rows) rides
  the base K loop and reuses the x tile already loaded; each row then keeps the columns of its
  own slot (``_own_rows``);
* gate/up expand: ``shrink_gate @ B13t[stack, gate rows, slice]`` (and up), added into the
  accumulators before the activation (after the loop, once per program);
* down: per slice ``t = y_slice @ A2[stack, :, slice]^T`` (the down GEMM is linear in y, so
  slice partials sum to the full shrink), each row's own slot kept; inside the down loop
  ``t @ B2t[stack, :, h chunk]`` joins the base partial (no extra atomics).

Every adapter operand is loaded with H or I contiguous (see ``fmoe2/gemm/lora.py``).

Only tiles whose rows use more than LORA_SLOTS adapters (possible when LORA_SLOTS < LORA_IDS)
take further passes over H per group, with atomic adds into their rows. Tiles without adapters
branch at run time to the plain loops; in a batch without any (the sort's ``num_lora_tokens`` is
0) no program loads its rows' adapter ids. ``HAS_LORA=False`` compiles the plain kernel.
"""
import triton
import triton.language as tl

from ..fp8 import _quantize_rows
from ..grid_dependency import dependent_launch_prologue
from ..sorting.moe_sorting import _routed_sort_key
from .lora_kernel import (_down_shrink, _expand_gate_up, _own_rows, _own_shrink, _shrink_step, _slice_tile,
                          _split_gate_up, _stack, _tile_slots)


@triton.jit
def _gated_activation(gate, up, ACTIVATION: tl.constexpr, SWIGLU_ALPHA: tl.constexpr = 1.702,
                      SWIGLU_LIMIT: tl.constexpr = None):
    """The gated activation in fp32: ``act(gate) * up`` for silu (SwiGLU), gelu (erf GeGLU) and gelu_tanh
    (tanh GeGLU); ``(up + 1) * gate * sigmoid(SWIGLU_ALPHA * gate)`` for swiglu_oai (gpt-oss). With
    SWIGLU_LIMIT (silu and swiglu_oai) gate is first clamped to at most the limit and up to [-limit, limit]."""
    if SWIGLU_LIMIT is not None:
        gate = tl.minimum(gate, SWIGLU_LIMIT)
        up = tl.minimum(tl.maximum(up, -SWIGLU_LIMIT), SWIGLU_LIMIT)
    if ACTIVATION == "silu":
        y = gate * tl.sigmoid(gate) * up
    elif ACTIVATION == "gelu":
        y = 0.5 * gate * (1.0 + tl.erf(gate * 0.7071067811865476)) * up
    elif ACTIVATION == "swiglu_oai":
        y = (up + 1.0) * gate * tl.sigmoid(SWIGLU_ALPHA * gate)
    else:
        # tanh(z) = 2*sigmoid(2z) - 1: portable (no libdevice) and overflow-safe.
        z = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)
        y = gate * tl.sigmoid(2.0 * z) * up
    return y


@triton.jit
def _gate_up(x_rows, row_valid, w1_expert, stride_w1_n, stride_w1_k, offs_n, n_valid, offs_r, r_valid, I, H, la_rows,
             la_used, w13_desc, w13_row0, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
             GATE_UP_INTERLEAVED: tl.constexpr, WITH_LORA: tl.constexpr, STACK: tl.constexpr, STAGES: tl.constexpr,
             s1_expert=None, stride_s1_n=0, stride_s1_k=0, FP8: tl.constexpr = False, FP8_MAX: tl.constexpr = 448.0,
             SOFT_FP8_ROUNDING: tl.constexpr = False, FP8_MIN_NORMAL: tl.constexpr = 0.015625,
             FP8_SUBNORMAL_STEP: tl.constexpr = 0.001953125, SCALE_BLOCK_N: tl.constexpr = 1,
             SCALE_BLOCK_K: tl.constexpr = 128, xq_rows=None, xs_rows=None):
    """Gate and up accumulators [BLOCK_M, BLOCK_N] (fp32, over all of H) of one slice.

    ``stride_w1_k``: the weights' stride along H (1, a constant, in fmoe2's layouts; transformers'
    transposed layouts are read through their strides).

    STAGES: pipeline depth of the K loop (None: the launch's num_stages).

    ``w13_desc`` (interleaved weights only; None: pointer loads): a tensor descriptor the weight
    tiles come through, this slice's first row at ``w13_row0``.

    WITH_LORA: also the stacked shrink ``x @ A[la_rows]^T`` [BLOCK_M, STACK] from the same x tiles
    (``la_rows``: [STACK] row pointers, ``la_used``: which are loaded).

    FP8 (fp8 weights, BLOCK_K = one activation group, ``fmoe2/fp8.py``): x comes quantized by the
    sort launch (``xq_rows``: [BLOCK_M, 1] fp8 row pointers, ``xs_rows``: [BLOCK_M] pointers to the
    rows' group scales), and each step's product is scaled by the rows' activation scales and the
    weight rows' scales ``s1_expert[orig_row // SCALE_BLOCK_N, k0 // SCALE_BLOCK_K]`` (orig_row: the
    row in the checkpoint's order, gate rows then up rows).
    """
    offs_k = tl.arange(0, BLOCK_K)
    shrink = tl.zeros([BLOCK_M, STACK], dtype=tl.float32)
    if GATE_UP_INTERLEAVED:
        w_rows = w1_expert + offs_r[:, None] * stride_w1_n
        if FP8:  # interleaved row r is gate row r // 2 (r even) or up row r // 2 (r odd) of the checkpoint
            s_rows = s1_expert + ((offs_r // 2 + (offs_r % 2) * I) // SCALE_BLOCK_N) * stride_s1_n
        acc = tl.zeros([BLOCK_M, 2 * BLOCK_N], dtype=tl.float32)
        for k0 in tl.range(0, H, BLOCK_K, num_stages=STAGES):
            k = k0 + offs_k
            k_valid = k < H
            a_mask = row_valid[:, None] & k_valid[None, :]
            if FP8:
                a = tl.load(xq_rows + k[None, :], mask=a_mask, other=0.0)
                sa = tl.load(xs_rows + k0 // BLOCK_K, mask=row_valid, other=0.0)
            else:
                a = tl.load(x_rows + k[None, :], mask=a_mask, other=0.0)
            if w13_desc is not None:  # rows past this expert's 2*I_pad are the next expert's: masked later
                b = w13_desc.load([w13_row0, k0])
            else:
                b = tl.load(w_rows + k[None, :] * stride_w1_k, mask=r_valid[:, None] & k_valid[None, :], other=0.0)
            if FP8:
                sb = tl.load(s_rows + (k0 // SCALE_BLOCK_K) * stride_s1_k, mask=r_valid, other=0.0)
                acc += tl.dot(a, tl.trans(b)) * (sa[:, None] * sb[None, :])
            else:
                acc = tl.dot(a, tl.trans(b), acc, input_precision="ieee")
            if WITH_LORA:
                shrink = _shrink_step(a, la_rows, la_used, k, k_valid, shrink)
        gate, up = tl.split(tl.reshape(acc, [BLOCK_M, BLOCK_N, 2]))
    else:
        gate_rows = w1_expert + offs_n[:, None] * stride_w1_n
        up_rows = gate_rows + I * stride_w1_n
        if FP8:
            sg_rows = s1_expert + (offs_n // SCALE_BLOCK_N) * stride_s1_n
            su_rows = s1_expert + ((I + offs_n) // SCALE_BLOCK_N) * stride_s1_n
        gate = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in tl.range(0, H, BLOCK_K, num_stages=STAGES):
            k = k0 + offs_k
            k_valid = k < H
            w_mask = n_valid[:, None] & k_valid[None, :]
            a_mask = row_valid[:, None] & k_valid[None, :]
            if FP8:
                a = tl.load(xq_rows + k[None, :], mask=a_mask, other=0.0)
                sa = tl.load(xs_rows + k0 // BLOCK_K, mask=row_valid, other=0.0)
            else:
                a = tl.load(x_rows + k[None, :], mask=a_mask, other=0.0)
            bg = tl.load(gate_rows + k[None, :] * stride_w1_k, mask=w_mask, other=0.0)
            bu = tl.load(up_rows + k[None, :] * stride_w1_k, mask=w_mask, other=0.0)
            if FP8:
                s_step = (k0 // SCALE_BLOCK_K) * stride_s1_k
                sg = tl.load(sg_rows + s_step, mask=n_valid, other=0.0)
                su = tl.load(su_rows + s_step, mask=n_valid, other=0.0)
                gate += tl.dot(a, tl.trans(bg)) * (sa[:, None] * sg[None, :])
                up += tl.dot(a, tl.trans(bu)) * (sa[:, None] * su[None, :])
            else:
                gate = tl.dot(a, tl.trans(bg), gate, input_precision="ieee")
                up = tl.dot(a, tl.trans(bu), up, input_precision="ieee")
            if WITH_LORA:
                shrink = _shrink_step(a, la_rows, la_used, k, k_valid, shrink)
    return gate, up, shrink


@triton.jit
def _down(y, out_rows, row_mask, w2_expert, stride_w2_h, stride_w2_i, offs_n, n_valid, H, ds_stacked, lb2_rows,
          lb2_used, w2_desc, w2_row0, slice_col0, bias2_expert, bias_weight, BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr,
          WITH_BASE: tl.constexpr, WITH_LORA: tl.constexpr, STAGES: tl.constexpr, HAS_BIAS: tl.constexpr = False,
          s2_expert=None, stride_s2_n=0, stride_s2_k=0, FP8: tl.constexpr = False, FP8_MAX: tl.constexpr = 448.0,
          SOFT_FP8_ROUNDING: tl.constexpr = False, FP8_MIN_NORMAL: tl.constexpr = 0.015625,
          FP8_SUBNORMAL_STEP: tl.constexpr = 0.001953125, SCALE_BLOCK_N: tl.constexpr = 1,
          SCALE_BLOCK_K: tl.constexpr = 128):
    """out[rows] += y @ W2[:, slice]^T (+ ds_stacked @ B2t[lb2_rows]), over H in BLOCK_H chunks, atomically.

    With HAS_BIAS (and WITH_BASE) also ``bias_weight[row] * bias2_expert[h]``: the down bias of the rows'
    expert times their routing weight, ``bias_weight`` zero in all slices but the first (the bias is
    added once per routed row).

    ``lb2_rows``: [STACK] pointers to the stacked rows of B2t ([R, H], H contiguous) at h = 0;
    WITH_BASE=False adds only the LoRA term (further slot groups); STAGES: pipeline depth (None:
    the launch's num_stages). ``w2_desc`` (None: pointer loads): a tensor descriptor the weight
    tiles come through, at (``w2_row0 + h``, ``slice_col0``).

    FP8 (fp8 weights, the slice one activation group): y is quantized per row once, and each
    chunk's product scaled by the rows' scales and ``s2_expert[h // SCALE_BLOCK_N, slice_col0 //
    SCALE_BLOCK_K]``.
    """
    tl.static_assert(not (FP8 and WITH_LORA), "LoRA deltas on fp8 base weights are not supported")
    if FP8:
        qy, sy = _quantize_rows(y.to(tl.float32), FP8_MAX, SOFT_FP8_ROUNDING, FP8_MIN_NORMAL, FP8_SUBNORMAL_STEP)
        qy = qy.to(w2_expert.dtype.element_ty)
        s2_col = s2_expert + (slice_col0 // SCALE_BLOCK_K) * stride_s2_k
    offs_h0 = tl.arange(0, BLOCK_H)
    for h0 in tl.range(0, H, BLOCK_H, num_stages=STAGES):
        offs_h = h0 + offs_h0
        h_valid = offs_h < H
        if WITH_BASE:
            if w2_desc is not None:
                w = w2_desc.load([w2_row0 + h0, slice_col0])
            else:
                w = tl.load(w2_expert + offs_h[:, None] * stride_w2_h + offs_n[None, :] * stride_w2_i,
                            mask=h_valid[:, None] & n_valid[None, :], other=0.0)
            if FP8:
                s2 = tl.load(s2_col + (offs_h // SCALE_BLOCK_N) * stride_s2_n, mask=h_valid, other=0.0)
                partial = tl.dot(qy, tl.trans(w)) * (sy[:, None] * s2[None, :])
            else:
                partial = tl.dot(y, tl.trans(w), input_precision="ieee")
            if HAS_BIAS:
                b2 = tl.load(bias2_expert + offs_h, mask=h_valid, other=0.0).to(tl.float32)
                partial += bias_weight[:, None] * b2[None, :]
        else:
            partial = tl.zeros([BLOCK_M, BLOCK_H], dtype=tl.float32)
        if WITH_LORA:
            lb2 = tl.load(lb2_rows[:, None] + offs_h[None, :], mask=lb2_used[:, None] & h_valid[None, :], other=0.0)
            partial = tl.dot(ds_stacked, lb2, partial, input_precision="ieee")
        tl.atomic_add(out_rows + offs_h[None, :], partial.to(out_rows.dtype.element_ty),
                      mask=row_mask[:, None] & h_valid[None, :], sem="relaxed")


@triton.jit
def _kept_slots(topk_ids_ptr, expert_map_ptr, token, row_valid, num_global_experts, TOPK: tl.constexpr,
                NUM_EXPERTS: tl.constexpr, HAS_EXPERT_MAP: tl.constexpr):
    """[BLOCK_M] int32: how many of each row's token's top-k slots route to a local expert, by the sort's
    own rule (``_routed_sort_key`` below NUM_EXPERTS); 0 for invalid rows."""
    kept = tl.zeros(token.shape, dtype=tl.int32)
    for slot in tl.static_range(TOPK):
        key = _routed_sort_key(topk_ids_ptr, expert_map_ptr, None, token * TOPK + slot, row_valid,
                               num_global_experts, 0, NUM_EXPERTS, HAS_EXPERT_MAP, TOPK, False)
        kept += (key < NUM_EXPERTS).to(tl.int32)
    return kept


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
                        NUM_EXPERTS: tl.constexpr, HAS_EXPERT_MAP: tl.constexpr):
    """Zeroes the output rows of BLOCK_M tokens from ``first_token`` that route to no local expert: no
    program adds into them, so none would cast them."""
    token = first_token + tl.arange(0, BLOCK_M).to(tl.int64)
    valid = token < num_tokens
    unrouted = valid & (_kept_slots(topk_ids_ptr, expert_map_ptr, token, valid, num_global_experts, TOPK,
                                    NUM_EXPERTS, HAS_EXPERT_MAP) == 0)
    if tl.max(unrouted.to(tl.int32), axis=0) > 0:
        offs_h0 = tl.arange(0, BLOCK_H)
        zeros = tl.zeros([BLOCK_M, BLOCK_H], dtype=final_out_ptr.dtype.element_ty)
        for h0 in range(0, H, BLOCK_H):
            offs_h = h0 + offs_h0
            tl.store(final_out_ptr + token[:, None] * stride_final_m + offs_h[None, :], zeros,
                     mask=unrouted[:, None] & (offs_h < H)[None, :])


@triton.jit
def _fused_moe_kernel(
    x_ptr,  # [M, H] bf16/fp16/fp32
    w1_ptr,  # plain: [E, 2I, H] gate rows then up rows; interleaved: [E, 2*I_pad, H_pad] (g0, u0, g1, u1, ...)
    w2_ptr,  # [E, H(_pad), I(_pad)]
    w13_desc,  # None, or a tensor descriptor of interleaved w1 viewed [E * 2*I_pad, H_pad], block [2*BLOCK_N, BLOCK_K]
    w2_desc,  # None, or a tensor descriptor of w2 viewed [E * H_pad, I_pad], block [BLOCK_H, BLOCK_N]
    w1_bias_ptr,  # [E, 2I(_pad)] in w1's row order (HAS_W1_BIAS only): gate/up bias
    w2_bias_ptr,  # [E, H(_pad)] (HAS_W2_BIAS only): down bias, added once per routed row, times its routing weight
    out_ptr,  # [M, H], zeroed by the sorting launch, receives atomic adds
    y_ptr,  # [num_grid_tiles * BLOCK_M, I] (STORE_Y only): activated, weighted intermediate in sorted order
    token_lora_ids_ptr,  # [M] int32 adapter per token, -1 = none (HAS_LORA only, like every lora_* below)
    lora_a13_ptr,  # [L, E, 2*LORA_RANK, H_pad]: gate A rows then up A rows
    lora_b13_ptr,  # [L, E, 2*LORA_RANK, I_pad]: gate B^T rows then up B^T rows
    lora_a2_ptr,  # [L, E, LORA_RANK, I_pad]
    lora_b2_ptr,  # [L, E, LORA_RANK, H_pad]: down B^T
    lora_scaling_ptr,  # [L] float32
    lora_delta13_ptr,  # [num_grid_tiles * BLOCK_M, >= 2*I] (STORE_Y with HAS_LORA): gate then up LoRA deltas per row
    lora_shrink2_ptr,  # [cdiv(I, BLOCK_N), num_grid_tiles * BLOCK_M, LORA_RANK] fp32 (deltas in the stages): down
    # shrinks of each slice
    w1_scale_ptr,  # FP8 only: [E, Sn, Sk] float32 scales of w1 in the checkpoint's row order (fmoe2/fp8.py)
    w2_scale_ptr,  # FP8 only: [E, Sn, Sk] float32 scales of w2
    y_scale_ptr,  # Y_FP8 only: [num_grid_tiles * BLOCK_M, cdiv(I, BLOCK_N)] float32 scales of the fp8 y
    x_q_ptr,  # FP8 only: [M, H] fp8 x, quantized by the sort launch
    x_scale_ptr,  # FP8 only: [M, cdiv(H, BLOCK_K)] float32 scales of x_q
    sorted_token_ids_ptr,  # [max_num_tiles * BLOCK_M] int32, padding = M
    sorted_weights_ptr,  # [max_num_tiles * BLOCK_M] fp32, padding = 0
    sorted_expert_ids_ptr,  # [max_num_tiles] int32
    num_sorted_tiles_ptr,  # [1] int32, tiles in use
    num_lora_tokens_ptr,  # [1] int32 (HAS_LORA): tokens with an adapter, counted by the sort
    num_tokens,  # M
    H,  # hidden size (logical)
    I,  # intermediate size (logical)
    num_grid_tiles,  # tiles the grid was sized for (>= any num_sorted_tiles)
    num_loras,  # L
    # strides
    stride_x_m,
    stride_w1_e,
    stride_w1_n,
    stride_w1_k,  # 1 (a constant) but for transposed weights read in place
    stride_w2_e,
    stride_w2_h,
    stride_w2_i,  # 1 (a constant) but for transposed weights read in place
    stride_b1_e,
    stride_b2_e,
    stride_out_m,
    stride_y_m,
    stride_delta13_m,
    stride_shrink2_split,
    stride_la13_l,
    stride_la13_e,
    stride_la13_r,
    stride_lb13_l,
    stride_lb13_e,
    stride_lb13_r,
    stride_la2_l,
    stride_la2_e,
    stride_la2_r,
    stride_lb2_l,
    stride_lb2_e,
    stride_lb2_r,
    stride_s1_e,  # FP8 only, like the strides below (0 along a dimension of size 1)
    stride_s1_n,
    stride_s1_k,
    stride_s2_e,
    stride_s2_n,
    stride_s2_k,
    stride_ys_m,  # Y_FP8 only
    stride_xq_m,  # FP8 only, like stride_xs_m
    stride_xs_m,
    # meta-parameters
    ACTIVATION: tl.constexpr,
    SWIGLU_ALPHA: tl.constexpr,  # swiglu_oai's alpha
    SWIGLU_LIMIT: tl.constexpr,  # None, or the clamp of gate and up before the activation (silu, swiglu_oai)
    HAS_W1_BIAS: tl.constexpr,
    HAS_W2_BIAS: tl.constexpr,
    GATE_UP_INTERLEAVED: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_H: tl.constexpr,
    GROUP_M: tl.constexpr,
    STORE_Y: tl.constexpr,  # two-stage path, stage 1: store y and stop (no down GEMM)
    HAS_LORA: tl.constexpr,
    LORA_DELTAS_READY: tl.constexpr,  # STORE_Y with HAS_LORA: add lora_delta13's deltas (else compute them here)
    LORA_RANK: tl.constexpr,  # padded rank (power of two >= 16)
    LORA_IDS: tl.constexpr,  # next_pow2(num_loras)
    LORA_SLOTS: tl.constexpr,  # adapters of one tile stacked into one operand (power of two <= LORA_IDS)
    LORA_STAGES: tl.constexpr,  # pipeline depth of the loops that carry adapter work (tiles without: num_stages)
    PDL: tl.constexpr,  # launched as a programmatic dependent of the previous launch (CUDA sm_90+)
    # fp8 weights (fmoe2/fp8.py): x comes quantized by the sort launch (x_q, per row and BLOCK_K columns); y is
    # quantized here per row and BLOCK_N columns (both FP8_GROUP); SOFT_FP8_ROUNDING under the interpreter only
    FP8: tl.constexpr,
    FP8_MAX: tl.constexpr,
    SOFT_FP8_ROUNDING: tl.constexpr,
    FP8_MIN_NORMAL: tl.constexpr,
    FP8_SUBNORMAL_STEP: tl.constexpr,
    SCALE_BLOCK_N: tl.constexpr,  # weight rows per scale (both weights)
    SCALE_BLOCK_K: tl.constexpr,  # weight columns per scale
    Y_FP8: tl.constexpr,  # STORE_Y with FP8 and BLOCK_N = FP8_GROUP: y stored quantized (fp8 y, scales per slice)
    # Sorted ids are token * IDS_PER_TOKEN + slot (padding M * IDS_PER_TOKEN) where > 1: the deterministic
    # mode's stage 1, whose stage 2 then stores one row per (token, slot) (fmoe2/gemm/combine_kernel.py)
    IDS_PER_TOKEN: tl.constexpr = 1,
    # The fused path's float32 accumulator (CAST_FINISHED_ROWS): out_ptr is the accumulator [M, H] followed by M
    # int32 add counters, both zeroed by the sort; the program that makes a token's last atomic add casts its row
    # to final_out, and cdiv(M, BLOCK_M) programs after the GEMM programs zero the rows of tokens routed nowhere.
    final_out_ptr=None,  # [M, H] input dtype
    topk_ids_ptr=None,  # [M * TOPK] int32/int64: each row's expected adds are its kept slots times the slices
    expert_map_ptr=None,  # [num_global_experts] int32 (HAS_EXPERT_MAP only)
    num_global_experts=0,
    stride_final_m=0,
    CAST_FINISHED_ROWS: tl.constexpr = False,
    TOPK: tl.constexpr = 1,
    NUM_EXPERTS: tl.constexpr = 1,
    HAS_EXPERT_MAP: tl.constexpr = False,
    # The one-launch decode (one token, no sort launch: launches.decodes_in_one_launch): tile t is the token's
    # slot t, its expert and weight read from topk_ids and topk_weights; the accumulator is a kept one that the
    # kernel leaves zeroed (CAST_FINISHED_ROWS with its reset), since no sort zeroes it.
    ROUTE_FROM_TOPK: tl.constexpr = False,
    topk_weights_ptr=None,  # [TOPK] (ROUTE_FROM_TOPK only) float32/bf16/fp16
):
    """Grid: (num_grid_tiles * cdiv(I, BLOCK_N) [+ cdiv(M, BLOCK_M) with CAST_FINISHED_ROWS],); programs past
    ``num_sorted_tiles`` or on a gap tile (expert -1) exit at once (with ROUTE_FROM_TOPK: on a dropped slot).

    Dots use input_precision="ieee": exact fp32 products for fp32 inputs (a testing dtype) and
    no effect on bf16/fp16 inputs; it is the one precision every backend accepts.
    """
    tl.static_assert(not (FP8 and HAS_LORA), "LoRA deltas on fp8 base weights are not supported")
    dependent_launch_prologue(PDL)  # with PDL: the next launch may start; wait for the sort's (or LoRA's) results
    if HAS_LORA:
        # Loaded with the tile's expert id: a batch without adapters then goes to the plain loops
        # without waiting for its rows' adapter ids (and stage 1 adds no deltas).
        batch_has_lora = tl.load(num_lora_tokens_ptr) > 0
    pid = tl.program_id(0)
    num_slices = tl.cdiv(I, BLOCK_N)
    if CAST_FINISHED_ROWS:
        if pid >= num_grid_tiles * num_slices:
            _zero_unrouted_rows(final_out_ptr, topk_ids_ptr, expert_map_ptr,
                                (pid - num_grid_tiles * num_slices).to(tl.int64) * BLOCK_M, num_tokens,
                                num_global_experts, H, stride_final_m, BLOCK_M, BLOCK_H, TOPK, NUM_EXPERTS,
                                HAS_EXPERT_MAP)
            return
    programs_per_group = GROUP_M * num_slices
    first_tile = (pid // programs_per_group) * GROUP_M
    group_tiles = tl.minimum(num_grid_tiles - first_tile, GROUP_M)
    local = pid % programs_per_group
    tile = first_tile + local % group_tiles
    slice_id = local // group_tiles
    if ROUTE_FROM_TOPK:
        tl.static_assert(CAST_FINISHED_ROWS and not HAS_LORA and not FP8 and not STORE_Y,
                         "the one-launch decode is the plain fused path with its float32 accumulator")
        key = _routed_sort_key(topk_ids_ptr, expert_map_ptr, None, tile, None, num_global_experts, 0, NUM_EXPERTS,
                               HAS_EXPERT_MAP, TOPK, False)
        if key >= NUM_EXPERTS:  # a dropped slot: no adds, and _kept_slots does not count it
            return
        expert = key.to(tl.int32, bitcast=True).to(tl.int64)
        offs_m = tl.arange(0, BLOCK_M)
        row_valid = offs_m < 1  # the one token, in the tile's first row
        token = tl.zeros([BLOCK_M], dtype=tl.int64)
        route_weight = tl.load(topk_weights_ptr + tile + offs_m, mask=row_valid, other=0.0).to(tl.float32)
    else:
        if tile >= tl.load(num_sorted_tiles_ptr):
            return
        expert = tl.load(sorted_expert_ids_ptr + tile).to(tl.int64)
        if expert < 0:  # a gap tile of the sorted layout
            return

        offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
        token = tl.load(sorted_token_ids_ptr + offs_m)
        if IDS_PER_TOKEN > 1:
            row_valid = token < num_tokens * IDS_PER_TOKEN
            token = token.to(tl.int64) // IDS_PER_TOKEN
        else:
            row_valid = token < num_tokens
            token = token.to(tl.int64)
        route_weight = tl.load(sorted_weights_ptr + offs_m)

    offs_n = slice_id * BLOCK_N + tl.arange(0, BLOCK_N)
    n_valid = offs_n < I
    offs_r = slice_id * (2 * BLOCK_N) + tl.arange(0, 2 * BLOCK_N)  # interleaved gate/up rows of the slice
    r_valid = offs_r < 2 * I
    x_rows = x_ptr + token[:, None] * stride_x_m
    w1_expert = w1_ptr + expert * stride_w1_e
    w2_expert = w2_ptr + expert * stride_w2_e
    if FP8:
        s1_expert = w1_scale_ptr + expert * stride_s1_e
        s2_expert = w2_scale_ptr + expert * stride_s2_e
        xq_rows = x_q_ptr + token[:, None] * stride_xq_m
        xs_rows = x_scale_ptr + token * stride_xs_m
    else:
        s1_expert = w1_scale_ptr
        s2_expert = w2_scale_ptr
        xq_rows = x_q_ptr
        xs_rows = x_scale_ptr
    out_rows = out_ptr + token[:, None] * stride_out_m
    # First descriptor rows (tensor-descriptor loads only) of this program's gate/up tile and this expert's w2.
    w13_row0 = (expert * (stride_w1_e // stride_w1_n)).to(tl.int32) + slice_id * (2 * BLOCK_N)
    w2_row0 = (expert * (stride_w2_e // stride_w2_h)).to(tl.int32)
    STACK: tl.constexpr = LORA_SLOTS * LORA_RANK  # stacked shrink width
    # Decode tiles (one slot: fewer routed rows than experts) with a small slice have a short K loop, so a batch
    # without adapters skips numbering slots and the slice's B13t and A2 tiles load before the loop; larger configs
    # and wider slices keep the plain order (spills, shared memory): docs/lora.md#decode-tiles-of-the-fused-kernel
    LORA_DECODE: tl.constexpr = (LORA_SLOTS == 1) and (LORA_RANK * BLOCK_N <= 2048)
    ADD_READY_DELTAS: tl.constexpr = STORE_Y and HAS_LORA and LORA_DELTAS_READY
    if HAS_LORA and not ADD_READY_DELTAS:
        if LORA_DECODE:
            row_lora = tl.full([BLOCK_M], -1, tl.int32)
            row_slot = row_lora
            present = tl.zeros([LORA_IDS], tl.int32)
            slot_of = present
            num_present = tl.full([], 0, tl.int32)
            if batch_has_lora:
                row_lora, row_slot, present, slot_of, num_present = _tile_slots(token_lora_ids_ptr, token, row_valid,
                                                                                 num_loras, True, LORA_IDS)
        else:
            row_lora, row_slot, present, slot_of, num_present = _tile_slots(token_lora_ids_ptr, token, row_valid,
                                                                             num_loras, batch_has_lora, LORA_IDS)
        row_scale = tl.load(lora_scaling_ptr + row_lora, mask=row_lora >= 0, other=0.0)
    else:
        num_present: tl.constexpr = 0  # a compile-time 0: the plain kernel takes only the plain branches
    if ADD_READY_DELTAS:
        # Two-stage path: LoRA deltas come ready from _lora_expand_kernel (see lora_kernel.py).
        gate, up, _ = _gate_up(x_rows, row_valid, w1_expert, stride_w1_n, stride_w1_k, offs_n, n_valid, offs_r, r_valid, I, H,
                               offs_n, n_valid, w13_desc, w13_row0, BLOCK_M, BLOCK_N, BLOCK_K, GATE_UP_INTERLEAVED,
                               False, 16, None)
        # Add the deltas _lora_expand_kernel wrote; rows without an adapter have none (their loads
        # are masked off). Nothing of this runs before or lives across the K loop, and in a batch
        # without adapters none of it runs.
        if batch_has_lora:
            row_lora = tl.load(token_lora_ids_ptr + token, mask=row_valid, other=-1)
            has = ((row_lora >= 0) & (row_lora < num_loras))[:, None] & n_valid[None, :]
            delta_rows = lora_delta13_ptr + offs_m.to(tl.int64)[:, None] * stride_delta13_m
            gate += tl.load(delta_rows + offs_n[None, :], mask=has, other=0.0).to(tl.float32)
            up += tl.load(delta_rows + I + offs_n[None, :], mask=has, other=0.0).to(tl.float32)
    elif num_present == 0:  # run-time branch with LoRA: tiles without adapters run the plain loops
        gate, up, _ = _gate_up(x_rows, row_valid, w1_expert, stride_w1_n, stride_w1_k, offs_n, n_valid, offs_r, r_valid, I, H,
                               offs_n, n_valid, w13_desc, w13_row0, BLOCK_M, BLOCK_N, BLOCK_K, GATE_UP_INTERLEAVED,
                               False, 16, None, s1_expert, stride_s1_n, stride_s1_k, FP8, FP8_MAX, SOFT_FP8_ROUNDING,
                               FP8_MIN_NORMAL, FP8_SUBNORMAL_STEP, SCALE_BLOCK_N, SCALE_BLOCK_K, xq_rows, xs_rows)
        if HAS_LORA and LORA_DECODE:
            # Read only on the LoRA side of the down GEMM; defined here because a value leaves a
            # run-time if only when both branches define it.
            la2 = tl.zeros([STACK, BLOCK_N], x_ptr.dtype.element_ty)
    else:
        dtype = x_ptr.dtype.element_ty
        a13_expert = lora_a13_ptr + expert * stride_la13_e
        b13_expert = lora_b13_ptr + expert * stride_lb13_e
        lb_up = LORA_RANK * stride_lb13_r  # B13t rows: gate rows [0, R), up rows [R, 2R) (A13 likewise)
        # Gate/up shrinks of the first slot group inside the base K loop, their expand after it.
        la_rows, gu_slot, la_used = _stack(a13_expert, stride_la13_l, stride_la13_r, present, slot_of, 0, LORA_IDS,
                                           LORA_SLOTS, LORA_RANK, 2)
        if LORA_DECODE:
            lb_rows, lb_slot, lb_used = _stack(b13_expert, stride_lb13_l, stride_lb13_r, present, slot_of, 0,
                                               LORA_IDS, LORA_SLOTS, LORA_RANK, 1)
            b13_gate_tile = _slice_tile(lb_rows, lb_used, offs_n, n_valid)
            b13_up_tile = _slice_tile(lb_rows + lb_up, lb_used, offs_n, n_valid)
            la2_rows, d_slot, la2_used = _stack(lora_a2_ptr + expert * stride_la2_e, stride_la2_l, stride_la2_r,
                                                present, slot_of, 0, LORA_IDS, LORA_SLOTS, LORA_RANK, 1)
            la2 = _slice_tile(la2_rows, la2_used, offs_n, n_valid)
        gate, up, shrink = _gate_up(x_rows, row_valid, w1_expert, stride_w1_n, stride_w1_k, offs_n, n_valid, offs_r, r_valid, I, H,
                                    la_rows, la_used, w13_desc, w13_row0, BLOCK_M, BLOCK_N, BLOCK_K,
                                    GATE_UP_INTERLEAVED, True, 2 * STACK, LORA_STAGES)
        shrink_gate, shrink_up = _split_gate_up(_own_rows(shrink, row_slot, gu_slot, row_scale, dtype), BLOCK_M, STACK)
        if LORA_DECODE:
            gate = tl.dot(shrink_gate, b13_gate_tile, gate, input_precision="ieee")
            up = tl.dot(shrink_up, b13_up_tile, up, input_precision="ieee")
        else:
            lb_rows, lb_slot, lb_used = _stack(b13_expert, stride_lb13_l, stride_lb13_r, present, slot_of, 0,
                                               LORA_IDS, LORA_SLOTS, LORA_RANK, 1)
            gate, up = _expand_gate_up(gate, up, shrink_gate, shrink_up, lb_rows, lb_up, lb_used, offs_n, n_valid)
        if LORA_SLOTS < LORA_IDS:
            # Tiles using more than LORA_SLOTS adapters: one more pass over H per further group.
            offs_k = tl.arange(0, BLOCK_K)
            for first_slot in range(LORA_SLOTS, num_present, LORA_SLOTS):
                la_rows, gu_slot, la_used = _stack(a13_expert, stride_la13_l, stride_la13_r, present, slot_of,
                                                   first_slot, LORA_IDS, LORA_SLOTS, LORA_RANK, 2)
                shrink = tl.zeros([BLOCK_M, 2 * STACK], dtype=tl.float32)
                for k0 in tl.range(0, H, BLOCK_K, num_stages=LORA_STAGES):
                    k = k0 + offs_k
                    k_valid = k < H
                    a = tl.load(x_rows + k[None, :], mask=row_valid[:, None] & k_valid[None, :], other=0.0)
                    shrink = _shrink_step(a, la_rows, la_used, k, k_valid, shrink)
                shrink_gate, shrink_up = _split_gate_up(_own_rows(shrink, row_slot, gu_slot, row_scale, dtype),
                                                        BLOCK_M, STACK)
                lb_rows, lb_slot, lb_used = _stack(b13_expert, stride_lb13_l, stride_lb13_r, present, slot_of,
                                                   first_slot, LORA_IDS, LORA_SLOTS, LORA_RANK, 1)
                gate, up = _expand_gate_up(gate, up, shrink_gate, shrink_up, lb_rows, lb_up, lb_used, offs_n, n_valid)

    if HAS_W1_BIAS:  # gate/up bias of this slice, in w1's row order
        b1 = w1_bias_ptr + expert * stride_b1_e
        if GATE_UP_INTERLEAVED:
            gate += tl.load(b1 + 2 * offs_n, mask=n_valid, other=0.0).to(tl.float32)[None, :]
            up += tl.load(b1 + 2 * offs_n + 1, mask=n_valid, other=0.0).to(tl.float32)[None, :]
        else:
            gate += tl.load(b1 + offs_n, mask=n_valid, other=0.0).to(tl.float32)[None, :]
            up += tl.load(b1 + I + offs_n, mask=n_valid, other=0.0).to(tl.float32)[None, :]
    # The down GEMM is linear in y, so the routing weight is applied once here.
    y = _gated_activation(gate, up, ACTIVATION, SWIGLU_ALPHA, SWIGLU_LIMIT) * route_weight[:, None]
    y = y.to(x_ptr.dtype.element_ty)
    if w13_desc is not None:
        # Columns past I came from padding or the next expert's rows; w2 has zeros there, but a value
        # that overflowed fp16 would still give inf * 0 = NaN in the down GEMM (the pointer path loads 0).
        y = tl.where(n_valid[None, :], y, 0.0)
    if STORE_Y:
        # Padding rows hold zeros (their x rows and routing weights are 0), so no row mask.
        y_rows = y_ptr + offs_m.to(tl.int64)[:, None] * stride_y_m + offs_n[None, :]
        if Y_FP8:  # quantized once here (the slice is one activation group) instead of by every stage-2 program
            qy, sy = _quantize_rows(y.to(tl.float32), FP8_MAX, SOFT_FP8_ROUNDING, FP8_MIN_NORMAL, FP8_SUBNORMAL_STEP)
            tl.store(y_rows, qy.to(y_ptr.dtype.element_ty), mask=n_valid[None, :])
            tl.store(y_scale_ptr + offs_m.to(tl.int64) * stride_ys_m + slice_id, sy)
        else:
            tl.store(y_rows, y, mask=n_valid[None, :])
        if not ADD_READY_DELTAS:
            if num_present > 0:
                # Deltas in the stages: this slice's down shrink of each row with an adapter, summed
                # over the slices and expanded by stage 2 (grouped_gemm_kernel.py).
                a2_expert = lora_a2_ptr + expert * stride_la2_e
                la2_rows, d_slot, la2_used = _stack(a2_expert, stride_la2_l, stride_la2_r, present, slot_of, 0,
                                                    LORA_IDS, LORA_SLOTS, LORA_RANK, 1)
                if not LORA_DECODE:
                    la2 = _slice_tile(la2_rows, la2_used, offs_n, n_valid)
                own = _own_shrink(y, la2, row_slot, d_slot, LORA_SLOTS, LORA_RANK)
                if LORA_SLOTS < LORA_IDS:
                    for first_slot in range(LORA_SLOTS, num_present, LORA_SLOTS):
                        la2_rows, d_slot, la2_used = _stack(a2_expert, stride_la2_l, stride_la2_r, present, slot_of,
                                                            first_slot, LORA_IDS, LORA_SLOTS, LORA_RANK, 1)
                        own += _own_shrink(y, _slice_tile(la2_rows, la2_used, offs_n, n_valid), row_slot, d_slot,
                                           LORA_SLOTS, LORA_RANK)
                shrink_rows = lora_shrink2_ptr + slice_id * stride_shrink2_split + offs_m.to(tl.int64) * LORA_RANK
                tl.store(shrink_rows[:, None] + tl.arange(0, LORA_RANK)[None, :], own,
                         mask=(row_slot >= 0)[:, None])
    else:
        # Down GEMM of this slice over all of H, added into the output (with the down bias, by the first slice).
        if HAS_W2_BIAS:
            bias2_expert = w2_bias_ptr + expert * stride_b2_e
        else:
            bias2_expert = w2_bias_ptr
        bias_weight = tl.where(slice_id == 0, route_weight, 0.0)
        if CAST_FINISHED_ROWS:  # loaded before the down loop, whose time hides it
            expected_adds = _kept_slots(topk_ids_ptr, expert_map_ptr, token, row_valid, num_global_experts, TOPK,
                                        NUM_EXPERTS, HAS_EXPERT_MAP) * num_slices
        if num_present == 0:
            _down(y, out_rows, row_valid, w2_expert, stride_w2_h, stride_w2_i, offs_n, n_valid, H, y, offs_n, n_valid,
                  w2_desc, w2_row0, slice_id * BLOCK_N, bias2_expert, bias_weight, BLOCK_M, BLOCK_H, True, False, None,
                  HAS_W2_BIAS, s2_expert, stride_s2_n, stride_s2_k, FP8, FP8_MAX, SOFT_FP8_ROUNDING, FP8_MIN_NORMAL,
                  FP8_SUBNORMAL_STEP, SCALE_BLOCK_N, SCALE_BLOCK_K)
        else:
            # Down shrink of this slice for a slot group, t = y_slice @ A2[stack, slice]^T (each row keeps
            # its own slot's columns); its expand t @ B2t[stack, h chunk] rides the down loop.
            a2_expert = lora_a2_ptr + expert * stride_la2_e
            b2_expert = lora_b2_ptr + expert * stride_lb2_e
            # (Decode tiles use only d_slot here: their A2 tile was loaded before the K loop.)
            la2_rows, d_slot, la2_used = _stack(a2_expert, stride_la2_l, stride_la2_r, present, slot_of, 0, LORA_IDS,
                                                LORA_SLOTS, LORA_RANK, 1)
            if not LORA_DECODE:
                la2 = _slice_tile(la2_rows, la2_used, offs_n, n_valid)
            lb2_rows, lb2_slot, lb2_used = _stack(b2_expert, stride_lb2_l, stride_lb2_r, present, slot_of, 0, LORA_IDS,
                                                  LORA_SLOTS, LORA_RANK, 1)
            _down(y, out_rows, row_valid, w2_expert, stride_w2_h, stride_w2_i, offs_n, n_valid, H,
                  _down_shrink(y, la2, row_slot, d_slot, row_scale),
                  lb2_rows, lb2_used, w2_desc, w2_row0, slice_id * BLOCK_N, bias2_expert, bias_weight, BLOCK_M, BLOCK_H,
                  True, True, LORA_STAGES, HAS_W2_BIAS)
            if LORA_SLOTS < LORA_IDS:
                # Further slot groups: their own pass over H, atomics on their rows only.
                for first_slot in range(LORA_SLOTS, num_present, LORA_SLOTS):
                    la2_rows, d_slot, la2_used = _stack(a2_expert, stride_la2_l, stride_la2_r, present, slot_of,
                                                        first_slot, LORA_IDS, LORA_SLOTS, LORA_RANK, 1)
                    lb2_rows, lb2_slot, lb2_used = _stack(b2_expert, stride_lb2_l, stride_lb2_r, present, slot_of,
                                                          first_slot, LORA_IDS, LORA_SLOTS, LORA_RANK, 1)
                    _down(y, out_rows, (row_slot >= first_slot) & (row_slot < first_slot + LORA_SLOTS), w2_expert,
                          stride_w2_h, stride_w2_i, offs_n, n_valid, H,
                          _down_shrink(y, _slice_tile(la2_rows, la2_used, offs_n, n_valid), row_slot, d_slot,
                                       row_scale),
                          lb2_rows, lb2_used, w2_desc, w2_row0, slice_id * BLOCK_N, bias2_expert, bias_weight, BLOCK_M,
                          BLOCK_H, False, True, LORA_STAGES)
        if CAST_FINISHED_ROWS:
            add_counts = (out_ptr + num_tokens * stride_out_m).to(tl.pointer_type(tl.int32), bitcast=True) + token
            _cast_finished_rows(out_rows, final_out_ptr + token[:, None] * stride_final_m, token, add_counts,
                                row_valid, expected_adds, H, stride_out_m, stride_final_m, out_ptr, final_out_ptr,
                                BLOCK_M, BLOCK_H, ROUTE_FROM_TOPK)
