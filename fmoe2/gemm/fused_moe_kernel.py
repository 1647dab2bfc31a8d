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
base weights are read exactly as without adapters whatever the mix of adapters. The adapters a
tile's rows use (token_lora_ids, -1 = none) are numbered densely into slots; LORA_SLOTS slots
(one group) are stacked into one operand of rank ``LORA_SLOTS * R``, so a tile that mixes up to
LORA_SLOTS adapters costs one product per step, not one per adapter:

* gate/up shrink: ``x @ A13[stack]^T`` rides the base K loop and reuses the x tile already
  loaded; each row then keeps the columns of its own slot (``_own_slot``);
* gate/up expand: one product per adapter present, ``(rows of l) @ B13[l, slice]^T``, added into
  the accumulators before the activation (after the loop, once per program);
* down: per slice ``t = y_slice @ A2[l, :, slice]^T`` (the down GEMM is linear in y, so slice
  partials sum to the full shrink), spread into the stacked layout (``_to_slots``); inside the
  down loop ``t @ B2[stack, h chunk]^T`` joins the base partial (no extra atomics).

Only tiles whose rows use more than LORA_SLOTS adapters (possible when LORA_SLOTS < LORA_IDS)
take further passes over H per group, with atomic adds into their rows. Tiles without adapters
branch at run time to the plain loops. ``HAS_LORA=False`` compiles the plain kernel.
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
def _tile_slots(token_lora_ids_ptr, token, row_valid, num_loras, LORA_IDS: tl.constexpr):
    """Which adapters the tile's rows use, numbered densely in id order (their slots).

    Returns row_lora [BLOCK_M] (adapter id, -1: none, padding or out of range), row_slot
    [BLOCK_M] (-1 for none), present [LORA_IDS] (0/1 per adapter id), slot_of [LORA_IDS]
    (the slot of each present id) and num_present (slots in use).
    """
    row_lora = tl.load(token_lora_ids_ptr + token, mask=row_valid, other=-1)
    row_lora = tl.where((row_lora >= 0) & (row_lora < num_loras), row_lora, -1)
    ids = tl.arange(0, LORA_IDS)
    uses = row_lora[:, None] == ids[None, :]
    present = tl.max(uses.to(tl.int32), axis=0)
    slot_of = tl.sum(tl.where(ids[None, :] < ids[:, None], present[None, :], 0), axis=1)
    row_slot = tl.where(row_lora >= 0, tl.sum(tl.where(uses, slot_of[None, :], 0), axis=1), -1)
    return row_lora, row_slot, present, slot_of, tl.sum(present, axis=0)


@triton.jit
def _slot_adapter(present, slot_of, slot, LORA_IDS: tl.constexpr):
    """The adapter id in ``slot`` (int64 scalar)."""
    ids = tl.arange(0, LORA_IDS)
    return tl.sum(tl.where((present > 0) & (slot_of == slot), ids, 0), axis=0).to(tl.int64)


@triton.jit
def _stack(base, stride_l, stride_row, present, slot_of, first_slot, LORA_IDS: tl.constexpr,
           LORA_SLOTS: tl.constexpr, WIDTH: tl.constexpr):
    """Rows of a stacked adapter operand: slots [first_slot, first_slot + LORA_SLOTS), WIDTH rows each.

    Returns per stacked row [LORA_SLOTS * WIDTH]: its pointer ``base + adapter * stride_l + row *
    stride_row``, its slot, and whether the slot is in use (rows of unused slots are never loaded).
    """
    offs = tl.arange(0, LORA_SLOTS * WIDTH)
    slot = first_slot + offs // WIDTH
    ids = tl.arange(0, LORA_IDS)
    hit = (present[None, :] > 0) & (slot_of[None, :] == slot[:, None])
    adapter = tl.sum(tl.where(hit, ids[None, :], 0), axis=1).to(tl.int64)
    used = tl.max(hit.to(tl.int32), axis=1) > 0
    return base + adapter * stride_l + (offs % WIDTH) * stride_row, slot, used


@triton.jit
def _own_slot(stacked, row_slot, stack_slot, BLOCK_M: tl.constexpr, LORA_SLOTS: tl.constexpr, WIDTH: tl.constexpr):
    """[BLOCK_M, LORA_SLOTS*WIDTH] -> [BLOCK_M, WIDTH]: each row keeps its own slot's columns (0 if none)."""
    mine = tl.where(row_slot[:, None] == stack_slot[None, :], stacked, tl.zeros_like(stacked))
    return tl.sum(tl.reshape(mine, [BLOCK_M, LORA_SLOTS, WIDTH]), axis=1)


@triton.jit
def _to_slots(own, row_slot, stack_slot, BLOCK_M: tl.constexpr, LORA_SLOTS: tl.constexpr, WIDTH: tl.constexpr):
    """Inverse of ``_own_slot``: [BLOCK_M, WIDTH] -> [BLOCK_M, LORA_SLOTS*WIDTH], zeros outside the row's slot."""
    spread = tl.reshape(tl.broadcast_to(own[:, None, :], [BLOCK_M, LORA_SLOTS, WIDTH]), [BLOCK_M, LORA_SLOTS * WIDTH])
    return tl.where(row_slot[:, None] == stack_slot[None, :], spread, tl.zeros_like(spread))


@triton.jit
def _shrink_step(a, la_rows, la_used, k, k_valid, shrink):
    """One K step of the stacked LoRA shrink: shrink += a @ A[la_rows, k]^T (``a``: the x tile already loaded)."""
    la = tl.load(la_rows[:, None] + k[None, :], mask=la_used[:, None] & k_valid[None, :], other=0.0)
    return tl.dot(a, tl.trans(la), shrink, input_precision="ieee")


@triton.jit
def _gate_up(x_rows, row_valid, w1_expert, stride_w1_n, offs_n, n_valid, offs_r, r_valid, I, H, la_rows, la_used,
             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GATE_UP_INTERLEAVED: tl.constexpr,
             WITH_LORA: tl.constexpr, STACK: tl.constexpr):
    """Gate and up accumulators [BLOCK_M, BLOCK_N] (fp32, over all of H) of one slice.

    WITH_LORA: also the stacked shrink ``x @ A[la_rows]^T`` [BLOCK_M, STACK] from the same x tiles
    (``la_rows``: [STACK] row pointers, ``la_used``: which are loaded).
    """
    offs_k = tl.arange(0, BLOCK_K)
    shrink = tl.zeros([BLOCK_M, STACK], dtype=tl.float32)
    if GATE_UP_INTERLEAVED:
        w_rows = w1_expert + offs_r[:, None] * stride_w1_n
        acc = tl.zeros([BLOCK_M, 2 * BLOCK_N], dtype=tl.float32)
        for k0 in range(0, H, BLOCK_K):
            k = k0 + offs_k
            k_valid = k < H
            a = tl.load(x_rows + k[None, :], mask=row_valid[:, None] & k_valid[None, :], other=0.0)
            b = tl.load(w_rows + k[None, :], mask=r_valid[:, None] & k_valid[None, :], other=0.0)
            acc = tl.dot(a, tl.trans(b), acc, input_precision="ieee")
            if WITH_LORA:
                shrink = _shrink_step(a, la_rows, la_used, k, k_valid, shrink)
        gate, up = tl.split(tl.reshape(acc, [BLOCK_M, BLOCK_N, 2]))
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
            if WITH_LORA:
                shrink = _shrink_step(a, la_rows, la_used, k, k_valid, shrink)
    return gate, up, shrink


@triton.jit
def _down(y, out_rows, row_mask, w2_expert, stride_w2_h, offs_n, n_valid, H, ds_stacked, lb2_cols, lb2_used,
          stride_lb2_h, BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr, WITH_BASE: tl.constexpr,
          WITH_LORA: tl.constexpr):
    """out[rows] += y @ W2[:, slice]^T (+ ds_stacked @ B2[lb2_cols]^T), over H in BLOCK_H chunks, atomically.

    ``lb2_cols``: [STACK] pointers to the stacked B2 columns at h = 0; WITH_BASE=False adds only
    the LoRA term (further slot groups).
    """
    offs_h0 = tl.arange(0, BLOCK_H)
    for h0 in range(0, H, BLOCK_H):
        offs_h = h0 + offs_h0
        h_valid = offs_h < H
        if WITH_BASE:
            w = tl.load(w2_expert + offs_h[:, None] * stride_w2_h + offs_n[None, :],
                        mask=h_valid[:, None] & n_valid[None, :], other=0.0)
            partial = tl.dot(y, tl.trans(w), input_precision="ieee")
        else:
            partial = tl.zeros([BLOCK_M, BLOCK_H], dtype=tl.float32)
        if WITH_LORA:
            lb2 = tl.load(lb2_cols[None, :] + offs_h[:, None] * stride_lb2_h, mask=h_valid[:, None] & lb2_used[None, :],
                          other=0.0)
            partial = tl.dot(ds_stacked, tl.trans(lb2), partial, input_precision="ieee")
        tl.atomic_add(out_rows + offs_h[None, :], partial.to(out_rows.dtype.element_ty),
                      mask=row_mask[:, None] & h_valid[None, :], sem="relaxed")


@triton.jit
def _fused_moe_kernel(
    x_ptr,  # [M, H] bf16/fp16/fp32
    w1_ptr,  # plain: [E, 2I, H] gate rows then up rows; interleaved: [E, 2*I_pad, H_pad] (g0, u0, g1, u1, ...)
    w2_ptr,  # [E, H(_pad), I(_pad)]
    out_ptr,  # [M, H], zeroed by the sorting launch, receives atomic adds
    y_ptr,  # [num_grid_tiles * BLOCK_M, I] (STORE_Y only): activated, weighted intermediate in sorted order
    token_lora_ids_ptr,  # [M] int32 adapter per token, -1 = none (HAS_LORA only, like every lora_* below)
    lora_a13_ptr,  # [L, E, 2*LORA_RANK, H_pad]: gate A rows then up A rows
    lora_b13_ptr,  # [L, E, 2*I, LORA_RANK]: gate rows then up rows
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
    LORA_IDS: tl.constexpr,  # next_pow2(num_loras)
    LORA_SLOTS: tl.constexpr,  # adapters of one tile stacked into one operand (power of two <= LORA_IDS)
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

    offs_n = slice_id * BLOCK_N + tl.arange(0, BLOCK_N)
    n_valid = offs_n < I
    offs_r = slice_id * (2 * BLOCK_N) + tl.arange(0, 2 * BLOCK_N)  # interleaved gate/up rows of the slice
    r_valid = offs_r < 2 * I
    x_rows = x_ptr + token[:, None] * stride_x_m
    w1_expert = w1_ptr + expert * stride_w1_e
    w2_expert = w2_ptr + expert * stride_w2_e
    out_rows = out_ptr + token[:, None] * stride_out_m
    GU_STACK: tl.constexpr = LORA_SLOTS * 2 * LORA_RANK  # stacked gate+up shrink width
    if HAS_LORA:
        row_lora, row_slot, present, slot_of, num_present = _tile_slots(token_lora_ids_ptr, token, row_valid,
                                                                         num_loras, LORA_IDS)
        row_scale = tl.load(lora_scaling_ptr + row_lora, mask=row_lora >= 0, other=0.0)
    else:
        num_present: tl.constexpr = 0  # a compile-time 0: the plain kernel takes only the plain branches
    if num_present == 0:  # run-time branch with LoRA: tiles without adapters run the plain loops
        gate, up, _ = _gate_up(x_rows, row_valid, w1_expert, stride_w1_n, offs_n, n_valid, offs_r, r_valid, I, H,
                               offs_n, n_valid, BLOCK_M, BLOCK_N, BLOCK_K, GATE_UP_INTERLEAVED, False, 16)
    else:
        offs_c = tl.arange(0, 2 * LORA_RANK)
        a13_expert = lora_a13_ptr + expert * stride_la13_e
        # Gate/up shrink of the first slot group inside the base K loop.
        la_rows, gu_slot, la_used = _stack(a13_expert, stride_la13_l, stride_la13_r, present, slot_of, 0, LORA_IDS,
                                           LORA_SLOTS, 2 * LORA_RANK)
        gate, up, shrink = _gate_up(x_rows, row_valid, w1_expert, stride_w1_n, offs_n, n_valid, offs_r, r_valid, I, H,
                                    la_rows, la_used,
                                    BLOCK_M, BLOCK_N, BLOCK_K, GATE_UP_INTERLEAVED, True, GU_STACK)
        shrink = _own_slot(shrink, row_slot, gu_slot, BLOCK_M, LORA_SLOTS, 2 * LORA_RANK)
        if LORA_SLOTS < LORA_IDS:
            # Tiles using more than LORA_SLOTS adapters: one more pass over H per further group.
            offs_k = tl.arange(0, BLOCK_K)
            for first_slot in range(LORA_SLOTS, num_present, LORA_SLOTS):
                la_rows, gu_slot, la_used = _stack(a13_expert, stride_la13_l, stride_la13_r, present, slot_of,
                                                   first_slot, LORA_IDS, LORA_SLOTS, 2 * LORA_RANK)
                group_shrink = tl.zeros([BLOCK_M, GU_STACK], dtype=tl.float32)
                for k0 in range(0, H, BLOCK_K):
                    k = k0 + offs_k
                    k_valid = k < H
                    a = tl.load(x_rows + k[None, :], mask=row_valid[:, None] & k_valid[None, :], other=0.0)
                    group_shrink = _shrink_step(a, la_rows, la_used, k, k_valid, group_shrink)
                shrink += _own_slot(group_shrink, row_slot, gu_slot, BLOCK_M, LORA_SLOTS, 2 * LORA_RANK)
        shrink = (shrink * row_scale[:, None]).to(x_ptr.dtype.element_ty)
        # Expand, once per adapter present: columns [0, R) of the shrink are gate, [R, 2R) up.
        gate_col = offs_c < LORA_RANK
        b13_cols = (lora_b13_ptr + expert * stride_lb13_e + offs_n[:, None] * stride_lb13_n
                    + (offs_c % LORA_RANK)[None, :])
        for slot in tl.range(0, num_present, num_stages=1):  # not pipelined: it would multiply shared memory
            b13 = b13_cols + _slot_adapter(present, slot_of, slot, LORA_IDS) * stride_lb13_l
            lbg = tl.load(b13, mask=n_valid[:, None] & gate_col[None, :], other=0.0)
            lbu = tl.load(b13 + I * stride_lb13_n, mask=n_valid[:, None] & ~gate_col[None, :], other=0.0)
            rows_shrink = tl.where((row_slot == slot)[:, None], shrink, tl.zeros_like(shrink))
            gate = tl.dot(rows_shrink, tl.trans(lbg), gate, input_precision="ieee")
            up = tl.dot(rows_shrink, tl.trans(lbu), up, input_precision="ieee")

    # The down GEMM is linear in y, so the routing weight is applied once here.
    y = _gated_activation(gate, up, ACTIVATION) * route_weight[:, None]
    y = y.to(x_ptr.dtype.element_ty)
    if STORE_Y:
        # Padding rows hold zeros (their x rows and routing weights are 0), so no row mask.
        tl.store(y_ptr + offs_m.to(tl.int64)[:, None] * stride_y_m + offs_n[None, :], y, mask=n_valid[None, :])
        return

    # Down GEMM of this slice over all of H, added into the output.
    if num_present == 0:
        _down(y, out_rows, row_valid, w2_expert, stride_w2_h, offs_n, n_valid, H, y, offs_n, n_valid, 0,
              BLOCK_M, BLOCK_H, True, False)
    else:
        # Down shrink of this slice, t = y_slice @ A2[l, :, slice]^T, once per adapter present.
        offs_rank = tl.arange(0, LORA_RANK)
        a2_rows = lora_a2_ptr + expert * stride_la2_e + offs_rank[:, None] * stride_la2_r + offs_n[None, :]
        down_shrink = tl.zeros([BLOCK_M, LORA_RANK], dtype=tl.float32)
        for slot in tl.range(0, num_present, num_stages=1):  # not pipelined: it would multiply shared memory
            la2 = tl.load(a2_rows + _slot_adapter(present, slot_of, slot, LORA_IDS) * stride_la2_l,
                          mask=n_valid[None, :], other=0.0)
            down_shrink = tl.dot(tl.where((row_slot == slot)[:, None], y, tl.zeros_like(y)), tl.trans(la2),
                                 down_shrink, input_precision="ieee")
        down_shrink = (down_shrink * row_scale[:, None]).to(x_ptr.dtype.element_ty)
        # Its expand joins the base partial in the down loop, for the first slot group.
        b2_expert = lora_b2_ptr + expert * stride_lb2_e
        lb2_cols, d_slot, lb2_used = _stack(b2_expert, stride_lb2_l, 1, present, slot_of, 0, LORA_IDS, LORA_SLOTS,
                                            LORA_RANK)
        _down(y, out_rows, row_valid, w2_expert, stride_w2_h, offs_n, n_valid, H,
              _to_slots(down_shrink, row_slot, d_slot, BLOCK_M, LORA_SLOTS, LORA_RANK),
              lb2_cols, lb2_used, stride_lb2_h, BLOCK_M, BLOCK_H, True, True)
        if LORA_SLOTS < LORA_IDS:
            # Further slot groups: their own pass over H, atomics on their rows only.
            for first_slot in range(LORA_SLOTS, num_present, LORA_SLOTS):
                lb2_cols, d_slot, lb2_used = _stack(b2_expert, stride_lb2_l, 1, present, slot_of, first_slot, LORA_IDS,
                                                    LORA_SLOTS, LORA_RANK)
                _down(y, out_rows, (row_slot >= first_slot) & (row_slot < first_slot + LORA_SLOTS), w2_expert,
                      stride_w2_h, offs_n, n_valid, H,
                      _to_slots(down_shrink, row_slot, d_slot, BLOCK_M, LORA_SLOTS, LORA_RANK),
                      lb2_cols, lb2_used, stride_lb2_h, BLOCK_M, BLOCK_H, False, True)
