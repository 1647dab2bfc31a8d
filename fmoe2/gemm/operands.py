"""The 16-bit GEMM loops of the fused kernels: gate/up over H, and down over H in chunks, and the gate/up bias.

16-bit weights (bf16/fp16, fp32 for tests) are the base format: :func:`_gate_up_16bit` and :func:`_down_16bit`
also carry the LoRA operands (the stacked shrink rides the gate/up K loop, the expand the down loop;
``lora_kernel.py``). Other weight formats have their loops in a module of their own (``fp8_weights.py``). ``stride_w1_k`` / ``stride_w2_i`` are 1 (a constant) but for
transposed weights read in place. Dots use input_precision="ieee": exact fp32 products for fp32 inputs (a
testing dtype) and no effect on bf16/fp16 inputs; it is the one precision every backend accepts.
"""
import triton
import triton.language as tl

from .lora_kernel import _shrink_step


@triton.jit
def _gate_up_16bit(x_rows, row_valid, w1_expert, stride_w1_n, stride_w1_k, offs_n, n_valid, offs_r, r_valid, I, H,
                   la_rows, la_used, w13_desc, w13_row0, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr, GATE_UP_INTERLEAVED: tl.constexpr, WITH_LORA: tl.constexpr,
                   STACK: tl.constexpr, STAGES: tl.constexpr):
    """Gate and up accumulators [BLOCK_M, BLOCK_N] (fp32, over all of H) of one slice, 16-bit weights.

    ``x_rows``: [BLOCK_M, 1] row pointers of x. STAGES: pipeline depth of the K loop (None: the launch's
    num_stages). ``w13_desc`` (interleaved weights only; None: pointer loads): a tensor descriptor the weight
    tiles come through, this slice's first row at ``w13_row0``.

    WITH_LORA: also the stacked shrink ``x @ A[la_rows]^T`` [BLOCK_M, STACK] from the same x tiles
    (``la_rows``: [STACK] row pointers, ``la_used``: which are loaded); returned third (zeros without).
    """
    offs_k = tl.arange(0, BLOCK_K)
    shrink = tl.zeros([BLOCK_M, STACK], dtype=tl.float32)
    if GATE_UP_INTERLEAVED:
        w_rows = w1_expert + offs_r[:, None] * stride_w1_n
        acc = tl.zeros([BLOCK_M, 2 * BLOCK_N], dtype=tl.float32)
        for k0 in tl.range(0, H, BLOCK_K, num_stages=STAGES):
            k = k0 + offs_k
            k_valid = k < H
            a = tl.load(x_rows + k[None, :], mask=row_valid[:, None] & k_valid[None, :], other=0.0)
            if w13_desc is not None:  # rows past this expert's 2*I_pad are the next expert's: masked later
                b = w13_desc.load([w13_row0, k0])
            else:
                b = tl.load(w_rows + k[None, :] * stride_w1_k, mask=r_valid[:, None] & k_valid[None, :], other=0.0)
            acc = tl.dot(a, tl.trans(b), acc, input_precision="ieee")
            if WITH_LORA:
                shrink = _shrink_step(a, la_rows, la_used, k, k_valid, shrink)
        gate, up = tl.split(tl.reshape(acc, [BLOCK_M, BLOCK_N, 2]))
    else:
        gate_rows = w1_expert + offs_n[:, None] * stride_w1_n
        up_rows = gate_rows + I * stride_w1_n
        gate = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in tl.range(0, H, BLOCK_K, num_stages=STAGES):
            k = k0 + offs_k
            k_valid = k < H
            w_mask = n_valid[:, None] & k_valid[None, :]
            a = tl.load(x_rows + k[None, :], mask=row_valid[:, None] & k_valid[None, :], other=0.0)
            bg = tl.load(gate_rows + k[None, :] * stride_w1_k, mask=w_mask, other=0.0)
            bu = tl.load(up_rows + k[None, :] * stride_w1_k, mask=w_mask, other=0.0)
            gate = tl.dot(a, tl.trans(bg), gate, input_precision="ieee")
            up = tl.dot(a, tl.trans(bu), up, input_precision="ieee")
            if WITH_LORA:
                shrink = _shrink_step(a, la_rows, la_used, k, k_valid, shrink)
    return gate, up, shrink


@triton.jit
def _add_gate_up_bias(gate, up, b1_expert, offs_n, n_valid, I, GATE_UP_INTERLEAVED: tl.constexpr):
    """gate and up plus the slice's gate/up bias (``b1_expert``: the expert's [2I(_pad)] bias in w1's row
    order); unchanged where ``b1_expert`` is None."""
    if b1_expert is not None:
        if GATE_UP_INTERLEAVED:
            gate += tl.load(b1_expert + 2 * offs_n, mask=n_valid, other=0.0).to(tl.float32)[None, :]
            up += tl.load(b1_expert + 2 * offs_n + 1, mask=n_valid, other=0.0).to(tl.float32)[None, :]
        else:
            gate += tl.load(b1_expert + offs_n, mask=n_valid, other=0.0).to(tl.float32)[None, :]
            up += tl.load(b1_expert + I + offs_n, mask=n_valid, other=0.0).to(tl.float32)[None, :]
    return gate, up


@triton.jit
def _down_16bit(y, out_rows, row_mask, w2_expert, stride_w2_h, stride_w2_i, offs_n, n_valid, H, ds_stacked, lb2_rows,
                lb2_used, w2_desc, w2_row0, slice_col0, b2_expert, bias_weight, BLOCK_M: tl.constexpr,
                BLOCK_H: tl.constexpr, WITH_BASE: tl.constexpr, WITH_LORA: tl.constexpr, STAGES: tl.constexpr):
    """out[rows] += y @ W2[:, slice]^T (+ ds_stacked @ B2t[lb2_rows]), over H in BLOCK_H chunks, atomically.

    ``b2_expert`` (None: no bias; WITH_BASE only): the down bias of the rows' expert, added times
    ``bias_weight[row]``, which is zero in all slices but the first (the bias is added once per routed row).

    ``lb2_rows``: [STACK] pointers to the stacked rows of B2t ([R, H], H contiguous) at h = 0;
    WITH_BASE=False adds only the LoRA term (further slot groups); STAGES: pipeline depth (None:
    the launch's num_stages). ``w2_desc`` (None: pointer loads): a tensor descriptor the weight
    tiles come through, at (``w2_row0 + h``, ``slice_col0``).
    """
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
            partial = tl.dot(y, tl.trans(w), input_precision="ieee")
            if b2_expert is not None:
                b2 = tl.load(b2_expert + offs_h, mask=h_valid, other=0.0).to(tl.float32)
                partial += bias_weight[:, None] * b2[None, :]
        else:
            partial = tl.zeros([BLOCK_M, BLOCK_H], dtype=tl.float32)
        if WITH_LORA:
            lb2 = tl.load(lb2_rows[:, None] + offs_h[None, :], mask=lb2_used[:, None] & h_valid[None, :], other=0.0)
            partial = tl.dot(ds_stacked, lb2, partial, input_precision="ieee")
        tl.atomic_add(out_rows + offs_h[None, :], partial.to(out_rows.dtype.element_ty),
                      mask=row_mask[:, None] & h_valid[None, :], sem="relaxed")

