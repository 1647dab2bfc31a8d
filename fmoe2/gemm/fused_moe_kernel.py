"""The single fused MoE kernel: gate+up GEMM, activation, routing weight, down GEMM, atomic add.

One program owns one sorted tile (BLOCK_M rows of one expert) and one slice of BLOCK_N
columns of the intermediate dimension:

    acc_gate, acc_up = x[tile] @ W_gate[e, slice]^T, x[tile] @ W_up[e, slice]^T   (fp32, over all H)
    y                = act(acc_gate) * acc_up * routing_weight                     (registers)
    out[tile]       += y @ W_down[e, :, slice]^T                                   (over H in BLOCK_H chunks,
                                                                                    relaxed atomic adds)

Each output element therefore receives ``topk * ceil(I / BLOCK_N)`` atomic adds in the output
dtype. Programs are ordered so the slices of GROUP_M neighbouring tiles run together: with
GROUP_M=1 all slices of one tile are adjacent in launch order (its output rows stay hot in L2
while they are added to); a larger GROUP_M lets tiles of one expert share weight slices in L2.

With ``STORE_Y`` the kernel is stage 1 of the two-stage path: it stores ``y`` (routing weight
applied) in sorted row order and skips the down GEMM, which ``grouped_gemm_kernel`` then does.

With ``HAS_LORA`` (multi-LoRA, layouts in ``fmoe2/gemm/lora.py``) tiles stay per expert, so the
base weights are read exactly as without adapters whatever the mix of adapters; the rows of a
tile may use different adapters (token_lora_ids, -1 = none):

* gate/up shrink ``x @ A13[l]^T``: the tile's first adapter rides the base K loop and reuses the
  x tile already loaded; each further adapter present in the tile (only tiles that mix adapters)
  takes one more pass over H, re-reading x (a few KB, from cache). Rows are disjoint, so all
  shrinks land in one ``[BLOCK_M, 2*R]`` tensor, scaled per row;
* gate/up expand: one product per adapter present, ``(rows of l) @ B13[l, slice]^T``, added into
  the accumulator before the activation;
* down: per slice ``t = y_slice @ A2[l, :, slice]^T`` (the down GEMM is linear in y, so slice
  partials sum to the full shrink); the first adapter's ``t @ B2[l, h chunk]^T`` joins the base
  partial inside the down loop (no extra atomics); further adapters of a mixing tile take one
  more pass over H after it, with atomic adds into their rows only. (A loop over adapters
  inside the down loop measured 1.3-1.8x slower on H200: it stops the weight pipelining.)

Tiles with no adapter skip every LoRA step (empty adapter range); ``HAS_LORA=False`` compiles
the plain kernel.
"""
import triton
import triton.language as tl


@triton.jit
def _gated_activation(gate, up, ACTIVATION: tl.constexpr):
    """act(gate) * up in fp32 for silu (SwiGLU), gelu (erf GeGLU) and gelu_tanh (tanh GeGLU)."""
    if ACTIVATION == "silu":
        act = gate * tl.sigmoid(gate)
    elif ACTIVATION == "gelu":
        act = 0.5 * gate * (1.0 + tl.erf(gate * 0.7071067811865476))
    else:
        # tanh(z) = 2*sigmoid(2z) - 1: portable (no libdevice) and overflow-safe.
        z = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)
        act = gate * tl.sigmoid(2.0 * z)
    return act * up


@triton.jit
def _tile_adapters(token_lora_ids_ptr, token, row_valid, num_loras):
    """Adapter of each row (-1: none, padding or out of range) and the range [first, end) present."""
    row_lora = tl.load(token_lora_ids_ptr + token, mask=row_valid, other=-1)
    row_lora = tl.where((row_lora >= 0) & (row_lora < num_loras), row_lora, -1)
    first = tl.min(tl.where(row_lora >= 0, row_lora, num_loras), axis=0)
    end = tl.max(row_lora, axis=0) + 1
    return row_lora, first, end


@triton.jit
def _rows_use(row_lora, lora):
    """True when some row of the tile uses adapter ``lora``."""
    return tl.max((row_lora == lora).to(tl.int32), axis=0) > 0


@triton.jit
def _fused_moe_kernel(
    x_ptr,  # [M, H] bf16/fp16/fp32
    w1_ptr,  # plain: [E, 2I, H] gate rows then up rows; interleaved: [E, 2*I_pad, H_pad] (g0, u0, g1, u1, ...)
    w2_ptr,  # [E, H(_pad), I(_pad)]
    out_ptr,  # [M, H], zeroed by the sorting launch, receives atomic adds
    y_ptr,  # [num_grid_tiles * BLOCK_M, I] (STORE_Y only): activated, weighted intermediate in sorted order
    token_lora_ids_ptr,  # [M] int32 adapter per token, -1 = none (HAS_LORA only, like every lora_* below)
    lora_a13_ptr,  # [L, E, 2*LORA_RANK, H_pad]: gate A rows then up A rows
    lora_b13_ptr,  # [L, E, 2*I, 2*LORA_RANK]: gate/up rows interleaved, block diagonal
    lora_a2_ptr,  # [L, E, LORA_RANK, I_pad]
    lora_b2_ptr,  # [L, E, H, LORA_RANK]
    lora_scaling_ptr,  # [L] float32
    sorted_token_ids_ptr,  # [max_num_tiles * BLOCK_M] int32, padding = M
    sorted_weights_ptr,  # [max_num_tiles * BLOCK_M] fp32, padding = 0
    sorted_expert_ids_ptr,  # [max_num_tiles] int32
    num_sorted_tiles_ptr,  # [1] int32, tiles in use
    num_tokens,  # M
    H,  # hidden size (logical)
    I,  # intermediate size (logical)
    num_grid_tiles,  # tiles the grid was sized for (>= any num_sorted_tiles)
    num_loras,  # L
    # strides
    stride_x_m,
    stride_w1_e,
    stride_w1_n,
    stride_w2_e,
    stride_w2_h,
    stride_out_m,
    stride_y_m,
    stride_la13_l,
    stride_la13_e,
    stride_la13_r,
    stride_lb13_l,
    stride_lb13_e,
    stride_lb13_n,
    stride_la2_l,
    stride_la2_e,
    stride_la2_r,
    stride_lb2_l,
    stride_lb2_e,
    stride_lb2_h,
    # meta-parameters
    ACTIVATION: tl.constexpr,
    GATE_UP_INTERLEAVED: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_H: tl.constexpr,
    GROUP_M: tl.constexpr,
    STORE_Y: tl.constexpr,  # two-stage path, stage 1: store y and stop (no down GEMM)
    HAS_LORA: tl.constexpr,
    LORA_RANK: tl.constexpr,  # padded rank (power of two >= 16)
):
    """Grid: (num_grid_tiles * cdiv(I, BLOCK_N),); programs past ``num_sorted_tiles`` exit at once.

    Dots use input_precision="ieee": exact fp32 products for fp32 inputs (a testing dtype) and
    no effect on bf16/fp16 inputs; it is the one precision every backend accepts.
    """
    pid = tl.program_id(0)
    num_slices = tl.cdiv(I, BLOCK_N)
    programs_per_group = GROUP_M * num_slices
    first_tile = (pid // programs_per_group) * GROUP_M
    group_tiles = tl.minimum(num_grid_tiles - first_tile, GROUP_M)
    local = pid % programs_per_group
    tile = first_tile + local % group_tiles
    slice_id = local // group_tiles
    if tile >= tl.load(num_sorted_tiles_ptr):
        return

    expert = tl.load(sorted_expert_ids_ptr + tile).to(tl.int64)
    offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    token = tl.load(sorted_token_ids_ptr + offs_m)
    row_valid = token < num_tokens
    token = token.to(tl.int64)
    route_weight = tl.load(sorted_weights_ptr + offs_m)

    offs_k = tl.arange(0, BLOCK_K)
    offs_n = slice_id * BLOCK_N + tl.arange(0, BLOCK_N)
    n_valid = offs_n < I
    x_rows = x_ptr + token[:, None] * stride_x_m
    w1_expert = w1_ptr + expert * stride_w1_e
    offs_r = slice_id * (2 * BLOCK_N) + tl.arange(0, 2 * BLOCK_N)  # interleaved gate/up rows of the slice
    r_valid = offs_r < 2 * I
    if HAS_LORA:
        row_lora, lora_first, lora_end = _tile_adapters(token_lora_ids_ptr, token, row_valid, num_loras)
        rows_first = row_lora == lora_first
        offs_r2 = tl.arange(0, 2 * LORA_RANK)
        # All-false rows when the tile has no adapter: its shrink loads move no data.
        la_first_valid = offs_r2 < tl.where(lora_first < num_loras, 2 * LORA_RANK, 0)
        la13_first = (lora_a13_ptr + tl.minimum(lora_first, num_loras - 1).to(tl.int64) * stride_la13_l
                      + expert * stride_la13_e + offs_r2[:, None] * stride_la13_r)
        shrink = tl.zeros([BLOCK_M, 2 * LORA_RANK], dtype=tl.float32)

    # Gate + up over all of H, fp32 accumulation.
    if GATE_UP_INTERLEAVED:
        w_rows = w1_expert + offs_r[:, None] * stride_w1_n
        acc = tl.zeros([BLOCK_M, 2 * BLOCK_N], dtype=tl.float32)
        for k0 in range(0, H, BLOCK_K):
            k = k0 + offs_k
            k_valid = k < H
            a = tl.load(x_rows + k[None, :], mask=row_valid[:, None] & k_valid[None, :], other=0.0)
            b = tl.load(w_rows + k[None, :], mask=r_valid[:, None] & k_valid[None, :], other=0.0)
            acc = tl.dot(a, tl.trans(b), acc, input_precision="ieee")
            if HAS_LORA:
                la = tl.load(la13_first + k[None, :], mask=la_first_valid[:, None] & k_valid[None, :], other=0.0)
                shrink = tl.dot(tl.where(rows_first[:, None], a, tl.zeros_like(a)), tl.trans(la), shrink,
                                input_precision="ieee")
    else:
        gate_rows = w1_expert + offs_n[:, None] * stride_w1_n
        up_rows = gate_rows + I * stride_w1_n
        gate = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, H, BLOCK_K):
            k = k0 + offs_k
            k_valid = k < H
            w_mask = n_valid[:, None] & k_valid[None, :]
            a = tl.load(x_rows + k[None, :], mask=row_valid[:, None] & k_valid[None, :], other=0.0)
            bg = tl.load(gate_rows + k[None, :], mask=w_mask, other=0.0)
            bu = tl.load(up_rows + k[None, :], mask=w_mask, other=0.0)
            gate = tl.dot(a, tl.trans(bg), gate, input_precision="ieee")
            up = tl.dot(a, tl.trans(bu), up, input_precision="ieee")
            if HAS_LORA:
                la = tl.load(la13_first + k[None, :], mask=la_first_valid[:, None] & k_valid[None, :], other=0.0)
                shrink = tl.dot(tl.where(rows_first[:, None], a, tl.zeros_like(a)), tl.trans(la), shrink,
                                input_precision="ieee")
        if HAS_LORA:  # the LoRA expand works on the interleaved accumulator layout
            acc = tl.reshape(tl.join(gate, up), [BLOCK_M, 2 * BLOCK_N])

    if HAS_LORA:
        # Further adapters of a tile that mixes them: one more pass over H each (rows are disjoint).
        for lora in range(lora_first + 1, lora_end):
            if _rows_use(row_lora, lora):
                rows = row_lora == lora
                la13 = (lora_a13_ptr + tl.cast(lora, tl.int64) * stride_la13_l + expert * stride_la13_e
                        + offs_r2[:, None] * stride_la13_r)
                for k0 in range(0, H, BLOCK_K):
                    k = k0 + offs_k
                    k_valid = k < H
                    a = tl.load(x_rows + k[None, :], mask=rows[:, None] & k_valid[None, :], other=0.0)
                    la = tl.load(la13 + k[None, :], mask=k_valid[None, :], other=0.0)
                    shrink = tl.dot(a, tl.trans(la), shrink, input_precision="ieee")
        row_scale = tl.load(lora_scaling_ptr + row_lora, mask=row_lora >= 0, other=0.0)
        shrink = (shrink * row_scale[:, None]).to(x_ptr.dtype.element_ty)
        # Expand: gate and up deltas of this slice, one product per adapter present.
        for lora in range(lora_first, lora_end):
            if _rows_use(row_lora, lora):
                lb13 = (lora_b13_ptr + tl.cast(lora, tl.int64) * stride_lb13_l + expert * stride_lb13_e
                        + offs_r[:, None] * stride_lb13_n + offs_r2[None, :])
                lb = tl.load(lb13, mask=r_valid[:, None], other=0.0)
                acc = tl.dot(tl.where((row_lora == lora)[:, None], shrink, tl.zeros_like(shrink)), tl.trans(lb), acc,
                             input_precision="ieee")
        gate, up = tl.split(tl.reshape(acc, [BLOCK_M, BLOCK_N, 2]))
    elif GATE_UP_INTERLEAVED:
        gate, up = tl.split(tl.reshape(acc, [BLOCK_M, BLOCK_N, 2]))

    # The down GEMM is linear in y, so the routing weight is applied once here.
    y = _gated_activation(gate, up, ACTIVATION) * route_weight[:, None]
    y = y.to(x_ptr.dtype.element_ty)
    if STORE_Y:
        # Padding rows hold zeros (their x rows and routing weights are 0), so no row mask.
        tl.store(y_ptr + offs_m.to(tl.int64)[:, None] * stride_y_m + offs_n[None, :], y, mask=n_valid[None, :])
        return

    if HAS_LORA:
        # Down shrink of this slice, t = y_slice @ A2[l, :, slice]^T per adapter, rows disjoint.
        offs_rank = tl.arange(0, LORA_RANK)
        down_shrink = tl.zeros([BLOCK_M, LORA_RANK], dtype=tl.float32)
        for lora in range(lora_first, lora_end):
            if _rows_use(row_lora, lora):
                la2 = tl.load(lora_a2_ptr + tl.cast(lora, tl.int64) * stride_la2_l + expert * stride_la2_e
                              + offs_rank[:, None] * stride_la2_r + offs_n[None, :], mask=n_valid[None, :], other=0.0)
                down_shrink = tl.dot(tl.where((row_lora == lora)[:, None], y, tl.zeros_like(y)), tl.trans(la2),
                                     down_shrink, input_precision="ieee")
        down_shrink = (down_shrink * row_scale[:, None]).to(x_ptr.dtype.element_ty)
        down_shrink_first = tl.where(rows_first[:, None], down_shrink, tl.zeros_like(down_shrink))
        lb2_first = (lora_b2_ptr + tl.minimum(lora_first, num_loras - 1).to(tl.int64) * stride_lb2_l
                     + expert * stride_lb2_e + offs_rank[None, :])
        lb2_first_valid = offs_rank < tl.where(lora_first < num_loras, LORA_RANK, 0)  # no adapter: no load

    # Down GEMM of this slice over all of H, added into the output.
    w2_expert = w2_ptr + expert * stride_w2_e
    out_rows = out_ptr + token[:, None] * stride_out_m
    offs_h0 = tl.arange(0, BLOCK_H)
    for h0 in range(0, H, BLOCK_H):
        offs_h = h0 + offs_h0
        h_valid = offs_h < H
        w = tl.load(w2_expert + offs_h[:, None] * stride_w2_h + offs_n[None, :],
                    mask=h_valid[:, None] & n_valid[None, :], other=0.0)
        partial = tl.dot(y, tl.trans(w), input_precision="ieee")
        if HAS_LORA:  # the first adapter's delta joins the base partial: no extra atomics
            lb2 = tl.load(lb2_first + offs_h[:, None] * stride_lb2_h, mask=h_valid[:, None] & lb2_first_valid[None, :],
                          other=0.0)
            partial = tl.dot(down_shrink_first, tl.trans(lb2), partial, input_precision="ieee")
        tl.atomic_add(out_rows + offs_h[None, :], partial.to(out_ptr.dtype.element_ty),
                      mask=row_valid[:, None] & h_valid[None, :], sem="relaxed")

    if HAS_LORA:
        # Tiles that mix adapters: the further adapters' down deltas in one more pass over H, added
        # into their rows only. Kept out of the loop above, whose weight pipelining a nested
        # adapter loop would break.
        if lora_end - lora_first > 1:
            rows_rest = row_lora > lora_first
            for h0 in range(0, H, BLOCK_H):
                offs_h = h0 + offs_h0
                h_valid = offs_h < H
                partial = tl.zeros([BLOCK_M, BLOCK_H], dtype=tl.float32)
                for lora in range(lora_first + 1, lora_end):
                    if _rows_use(row_lora, lora):
                        lb2 = tl.load(lora_b2_ptr + tl.cast(lora, tl.int64) * stride_lb2_l + expert * stride_lb2_e
                                      + offs_h[:, None] * stride_lb2_h + offs_rank[None, :], mask=h_valid[:, None],
                                      other=0.0)
                        partial = tl.dot(tl.where((row_lora == lora)[:, None], down_shrink, tl.zeros_like(down_shrink)),
                                         tl.trans(lb2), partial, input_precision="ieee")
                tl.atomic_add(out_rows + offs_h[None, :], partial.to(out_ptr.dtype.element_ty),
                              mask=rows_rest[:, None] & h_valid[None, :], sem="relaxed")
