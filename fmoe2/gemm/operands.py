"""The 16-bit GEMM loops of the fused kernels: gate/up over H, and down over H in chunks, and the gate/up bias.

16-bit weights (bf16/fp16, fp32 for tests) are the base format: :func:`_gate_up_16bit` and :func:`_down_16bit` also
carry the LoRA operands (the stacked shrink rides the gate/up K loop, the expand the down loop; ``lora_kernel.py``).
Other weight formats have their loops in a module of their own (``fp8_weights.py``). The weights' K strides
(``ExpertOperand.stride_k``) are 1 (a constant) but for transposed weights read in place. Dots use
input_precision="ieee": exact fp32 products for fp32 inputs (a testing dtype) and no effect on bf16/fp16 inputs; it
is the one precision every backend accepts.

Weight tiles come through pointers as ``[K, N]``, the dot's own operand shape, whichever of the weight's
dimensions is contiguous. For K-contiguous weights (``[E, 2I, H]``) the gate/up loop compiles to the same PTX as an
``[N, K]`` load and a ``tl.trans`` did (sm_80, sm_90; the down loops' code changed, their speed did not: graph A/B
against the old code 0.97-1.01x on the H200, and 0.98-1.06x in a noisier run whose 1.06x was at kernels whose code
did not change); for N-contiguous ones (transformers' transposed ``[E, H, 2I]`` views) the ``[N, K]`` load and
transpose compiled to register loads without ``cp.async`` and spilled (3662 spill instructions in stage 1 of
gpt-oss-20b's H200 pick at M=64, which ran 37x slower than with K-contiguous weights: issue 55). Tensor-descriptor
tiles come as their block, ``[N, K]``, and are transposed for the dot.
"""
import triton
import triton.language as tl

from .lora_kernel import _shrink_step


# ---------------------------------------------------------------------------------------------
# Weight-only formats (fmoe2/formats.py: mxfp4, int4, int8): the operand loader that dequantizes them into the
# 16-bit loops. A format is told apart by its prepared tensors' element types (constexprs): mxfp4 uint8 weights
# with uint8 e8m0 scales, int4 uint8 weights with (scale, zero) float pairs, int8 int8 weights with float scales.
# ---------------------------------------------------------------------------------------------

@triton.jit
def _e2m1_values(packed, HIGH: tl.constexpr):
    """float32 values of the e2m1 codes in the low (HIGH False) or high nibbles of ``packed`` (int32 bytes; a code's
    bit 3 its sign, bits 2..1 its exponent, bit 0 its mantissa). The code moved to float32 bits 31 and 24..22 reads
    as ``value * 2**-126`` (exponent 0 as the float's zero and a denormal, 0.5 * 2**-126), multiplied back by
    2**126: exact, as the multiply keeps denormals (PTX ``mul.f32``, no ``.ftz``). On sm_90 a dequantized value
    with its group scale and cast to bf16 takes 6.5 instructions this way, 11.4 where a select built each code's
    exponent (a dequant micro-kernel's SASS, Triton 3.9)."""
    top = packed << (24 if HIGH else 28)  # the code in bits 31..28
    bits = (top >> 6) & -0x7E400000  # (arithmetic shift: the sign to bits 31..25; the mask 0x81C00000 keeps 31, 24..22)
    return bits.to(tl.float32, bitcast=True) * 8.507059173023462e37  # 2**126


@triton.jit
def _uint4_values(code):
    """float32 values of int4 codes (int32 in [0, 16)): ``2**23 + code`` has the code in its low mantissa bits."""
    return (code | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0


@triton.jit
def _packed_weight_load(w_rows, k0, row_bytes, rows_valid, s_rows, BLOCK_K: tl.constexpr, GROUP: tl.constexpr):
    """``(packed, scales)``: the raw values [ROWS, BLOCK_K // per element] and group scales of a weight-only
    quantized tile at columns ``[k0, k0 + BLOCK_K)`` (``k0`` a multiple of BLOCK_K), for
    :func:`_packed_weight_dequant`. ``w_rows``: [ROWS, 1] pointers to the rows' stored values (4-bit: two columns
    per byte, the even one in the low nibble; int8: one per byte), ``row_bytes`` long (the prepared row: zero past
    the logical K, whole groups); ``s_rows``: [ROWS] pointers to the rows' scales, uint8 e8m0 (mxfp4), (scale,
    zero) pairs (int4) or floats (int8), one per GROUP columns. Bytes past the row, and invalid rows, load as zero
    bytes and scales. The mask is by whole bytes of a row whose length is a multiple of 16 (the JIT's hint): the
    loads stay vectorised (masking by the logical K made them byte loads). The loops call it for the step they
    multiply, so Triton's pipeliner stages the loads through shared memory (cp.async, num_stages deep; an earlier
    loop that loaded the next step's tile into registers by hand kept them out of the pipeline: no cp.async for the
    weights in the sm_90 code, and 0.34-0.78x the bf16 forward's speed for int8 on an H200)."""
    PER_BYTE: tl.constexpr = 1 if w_rows.dtype.element_ty == tl.int8 else 2
    PAIRS: tl.constexpr = PER_BYTE == 2 and s_rows.dtype.element_ty != tl.uint8  # int4's (scale, zero)
    kb = k0 // PER_BYTE + tl.arange(0, BLOCK_K // PER_BYTE)
    packed = tl.load(w_rows + kb[None, :], mask=rows_valid[:, None] & (kb < row_bytes)[None, :], other=0)
    # BLOCK_K // GROUP groups per step, or one group over several steps: the scales [ROWS, groups] (x 2 for int4's
    # pairs) either way, the dequant's shapes then alike. (Steps of 8 bytes a row came out wrong on an H200 where
    # the interpreter was right: configs never ask them, LEAST_PACKED_K_STEP of gemm/config.py.)
    GROUPS: tl.constexpr = BLOCK_K // GROUP if BLOCK_K >= GROUP else 1
    g = k0 // GROUP + tl.arange(0, GROUPS)
    g_mask = rows_valid[:, None] & (g < row_bytes * PER_BYTE // GROUP)[None, :]
    if PAIRS:
        scales = tl.load(s_rows[:, None, None] + (2 * g)[None, :, None] + tl.arange(0, 2)[None, None, :],
                         mask=g_mask[:, :, None], other=0.0)
    else:
        scales = tl.load(s_rows[:, None] + g[None, :], mask=g_mask, other=0)
    return packed, scales


@triton.jit
def _scaled_by_group(w, scales, MXFP4: tl.constexpr, INT8: tl.constexpr):
    """``w`` (float32 values, a group's columns on the last axis) times its group's scale: mxfp4 ``2**(s - 127)``
    (the scale 0 reads as 0), int8 ``scale``, int4 ``(w - zero) * scale``; ``scales`` one axis fewer than ``w`` (a
    trailing pair axis more for int4)."""
    if MXFP4:
        w = w * tl.expand_dims((scales.to(tl.int32) << 23).to(tl.float32, bitcast=True), -1)
    elif INT8:
        w = w * tl.expand_dims(scales.to(tl.float32), -1)
    else:
        SIXTEEN_BIT: tl.constexpr = scales.dtype.primitive_bitwidth == 16
        scale, zero = tl.split(scales.to(tl.float32))
        if SIXTEEN_BIT:
            # q * scale - zero * scale in one fused multiply-add: with 16-bit scales and zero points both products
            # are exact in float32, so the one rounding gives (q - zero) * scale's bits, in one instruction fewer
            w = tl.fma(w, tl.expand_dims(scale, -1), -tl.expand_dims(zero * scale, -1))
        else:  # (float32 scales: zero * scale would round first)
            w = (w - tl.expand_dims(zero, -1)) * tl.expand_dims(scale, -1)
    return w


@triton.jit
def _packed_weight_dequant(packed, scales, BLOCK_K: tl.constexpr, GROUP: tl.constexpr, dtype: tl.constexpr):
    """The [ROWS, BLOCK_K] tile in ``dtype`` of :func:`_packed_weight_load`'s ``(packed, scales)``: mxfp4 ``e2m1 *
    2**(s - 127)``, int4 ``(q - zero) * scale``, int8 ``q * scale``, exact in float32 (int8 and int4 for 16-bit
    scales), then rounded to ``dtype`` (mxfp4 values are exact in bf16 within its range; the others and fp16 need
    the rounding); int8 with scales in ``dtype`` (16-bit) in ``dtype``'s arithmetic, to the same bits."""
    ROWS: tl.constexpr = packed.shape[0]
    INT8: tl.constexpr = packed.dtype == tl.int8
    MXFP4: tl.constexpr = scales.dtype == tl.uint8
    GROUPS: tl.constexpr = BLOCK_K // GROUP if BLOCK_K >= GROUP else 1  # (the scales' axis 1)
    if INT8 and scales.dtype == dtype and dtype.primitive_bitwidth == 16:
        # Scales in the activations' 16-bit dtype: int8 codes are exact in it, and its multiply rounds the exact
        # q * scale once, as float32's exact product cast to dtype does: the same bits, without float32. Triton
        # turns int8 into 16-bit floats with integer ops and a packed add; float32 took a conversion per value (I2F,
        # a quarter-rate instruction on sm_90) and a pack back (F2FP): gpt-oss-20b's M=1 stage-1 K loop on sm_90
        # 376 instructions with fp16 scales (the float32 path), 311 with bf16 ones (this one; Triton 3.9, 3.6
        # alike). (int4 likewise, (q - zero) * scale with the code in a 16-bit float's mantissa: 526 -> 443 with
        # bf16 scales on sm_90, but one VGPR spill on gfx950 at M=4096: branch probe-4bit-16bit.)
        w = tl.reshape(packed.to(dtype), [ROWS, GROUPS, BLOCK_K // GROUPS]) * tl.expand_dims(scales, -1)
        w = tl.reshape(w, [ROWS, BLOCK_K])
    else:
        if INT8:
            w = packed.to(tl.float32)
        else:
            packed = packed.to(tl.int32)
            if MXFP4:
                w = tl.join(_e2m1_values(packed, HIGH=False), _e2m1_values(packed, HIGH=True))
            else:
                w = tl.join(_uint4_values(packed & 15), _uint4_values(packed >> 4))
            w = tl.reshape(w, [ROWS, BLOCK_K])  # (column 2j from the low nibble, 2j + 1 from the high one)
        w = tl.reshape(_scaled_by_group(tl.reshape(w, [ROWS, GROUPS, BLOCK_K // GROUPS]), scales, MXFP4, INT8),
                       [ROWS, BLOCK_K])
    return w.to(dtype)


@triton.jit
def _packed_dot(a, packed, scales, acc, BLOCK_K: tl.constexpr, GROUP: tl.constexpr):
    """``acc + a @ W^T`` of a weight-only quantized tile ``W`` given as :func:`_packed_weight_load`'s ``(packed,
    scales)``, dequantized by :func:`_packed_weight_dequant`. (``tl.dot_scaled`` of bf16 x e2m1 was tried for
    mxfp4: on an H200 with Triton 3.6 it gave relative errors of 1.5 at some tilings, so it is not used:
    docs/quant4.md.)"""
    return tl.dot(a, tl.trans(_packed_weight_dequant(packed, scales, BLOCK_K, GROUP, a.dtype)), acc,
                  input_precision="ieee")


@triton.jit
def _expert_scales(w_ptr, scale_ptr, expert, stride_w_e, stride_w_n, WEIGHT_GROUP: tl.constexpr):
    """``(scales, stride_s_n)``: the expert's group scales of prepared weight-only quantized weights ``w_ptr``
    (``scale_ptr`` not None) and their row stride, from the weights' strides (the scales are laid out like the
    weights' rows, contiguous: ``fused_moe.check_packed_scales``). Callers keep None for 16-bit weights (a tuple
    holding None does not compile)."""
    PER_BYTE: tl.constexpr = 1 if w_ptr.dtype.element_ty == tl.int8 else 2
    PER_GROUP: tl.constexpr = 2 if PER_BYTE == 2 and scale_ptr.dtype.element_ty != tl.uint8 else 1  # int4: pairs
    stride_s_n = stride_w_n * PER_BYTE // WEIGHT_GROUP * PER_GROUP
    return scale_ptr + expert * (stride_w_e // stride_w_n * stride_s_n), stride_s_n


@triton.jit
def _gate_up_16bit(x_rows, row_valid, w1_operand, offs_n, n_valid, offs_r, r_valid, I, H, la_rows, la_used,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   GATE_UP_INTERLEAVED: tl.constexpr, WITH_LORA: tl.constexpr, STACK: tl.constexpr,
                   STAGES: tl.constexpr, WEIGHT_GROUP: tl.constexpr):
    """Gate and up accumulators [BLOCK_M, BLOCK_N] (fp32, over all of H) of one slice, 16-bit weights.

    ``x_rows``: [BLOCK_M, 1] row pointers of x. STAGES: pipeline depth of the K loop (None: the launch's
    num_stages). ``w1_operand``: the expert's w1, an :class:`~.bundles.ExpertOperand`: its ``desc`` (interleaved
    weights only; None: pointer loads) a tensor descriptor the weight tiles come through, this slice's first row
    at its ``desc_row0``; its ``scale_ptr`` (None: 16-bit weights) the expert's group scales of prepared 4-bit
    weights (interleaved rows ``stride_scale_n`` apart, WEIGHT_GROUP columns
    per scale), loaded by :func:`_packed_weight_load` and multiplied by :func:`_packed_dot`.

    WITH_LORA: also the stacked shrink ``x @ A[la_rows]^T`` [BLOCK_M, STACK] from the same x tiles
    (``la_rows``: [STACK] row pointers, ``la_used``: which are loaded); returned third (zeros without).
    """
    w1_expert, stride_w1_n, stride_w1_k = w1_operand.ptr, w1_operand.stride_n, w1_operand.stride_k
    w13_desc, w13_row0 = w1_operand.desc, w1_operand.desc_row0
    s1_expert, stride_s1_n = w1_operand.scale_ptr, w1_operand.stride_scale_n
    offs_k = tl.arange(0, BLOCK_K)
    shrink = tl.zeros([BLOCK_M, STACK], dtype=tl.float32)
    if GATE_UP_INTERLEAVED:
        w_rows = w1_expert + offs_r[:, None] * stride_w1_n  # [2*BLOCK_N, 1] (4-bit loads)
        w_cols = w1_expert + offs_r[None, :] * stride_w1_n  # [1, 2*BLOCK_N] (16-bit [K, N] tiles)
        acc = tl.zeros([BLOCK_M, 2 * BLOCK_N], dtype=tl.float32)
        if s1_expert is not None:
            s_rows = s1_expert + offs_r * stride_s1_n
        for k0 in tl.range(0, H, BLOCK_K, num_stages=STAGES):
            k = k0 + offs_k
            k_valid = k < H
            a = tl.load(x_rows + k[None, :], mask=row_valid[:, None] & k_valid[None, :], other=0.0)
            if s1_expert is not None:
                packed, scales = _packed_weight_load(w_rows, k0, stride_w1_n, r_valid, s_rows, BLOCK_K, WEIGHT_GROUP)
                acc = _packed_dot(a, packed, scales, acc, BLOCK_K, WEIGHT_GROUP)
            else:
                if w13_desc is not None:  # rows past this expert's 2*I_pad are the next expert's: masked later
                    acc = tl.dot(a, tl.trans(w13_desc.load([w13_row0, k0])), acc, input_precision="ieee")
                else:  # (loaded [K, N], as the dot takes it: see the module docstring)
                    b = tl.load(w_cols + k[:, None] * stride_w1_k, mask=r_valid[None, :] & k_valid[:, None],
                                other=0.0)
                    acc = tl.dot(a, b, acc, input_precision="ieee")
            if WITH_LORA:
                shrink = _shrink_step(a, la_rows, la_used, k, k_valid, shrink)
        gate, up = tl.split(tl.reshape(acc, [BLOCK_M, BLOCK_N, 2]))
    else:
        tl.static_assert(s1_expert is None, "4-bit weights are prepared, with interleaved gate/up rows")
        gate_cols = w1_expert + offs_n[None, :] * stride_w1_n  # [1, BLOCK_N]
        up_cols = gate_cols + I * stride_w1_n
        gate = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in tl.range(0, H, BLOCK_K, num_stages=STAGES):
            k = k0 + offs_k
            k_valid = k < H
            w_mask = k_valid[:, None] & n_valid[None, :]
            a = tl.load(x_rows + k[None, :], mask=row_valid[:, None] & k_valid[None, :], other=0.0)
            bg = tl.load(gate_cols + k[:, None] * stride_w1_k, mask=w_mask, other=0.0)
            bu = tl.load(up_cols + k[:, None] * stride_w1_k, mask=w_mask, other=0.0)
            gate = tl.dot(a, bg, gate, input_precision="ieee")
            up = tl.dot(a, bu, up, input_precision="ieee")
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
def _down_16bit(y, out_rows, row_mask, w2_operand, offs_n, n_valid, H, ds_stacked, lb2_rows, lb2_used, slice_col0,
                b2_expert, bias_weight, BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr, WITH_BASE: tl.constexpr,
                WITH_LORA: tl.constexpr, STAGES: tl.constexpr, WEIGHT_GROUP: tl.constexpr):
    """out[rows] += y @ W2[:, slice]^T (+ ds_stacked @ B2t[lb2_rows]), over H in BLOCK_H chunks, atomically.

    ``b2_expert`` (None: no bias; WITH_BASE only): the down bias of the rows' expert, added times
    ``bias_weight[row]``, which is zero in all slices but the first (the bias is added once per routed row).

    ``lb2_rows``: [STACK] pointers to the stacked rows of B2t ([R, H], H contiguous) at h = 0;
    WITH_BASE=False adds only the LoRA term (further slot groups); STAGES: pipeline depth (None:
    the launch's num_stages). ``w2_operand``: the expert's w2, an :class:`~.bundles.ExpertOperand` (rows H,
    columns I): its ``desc`` (None: pointer loads) a tensor descriptor the weight tiles come through, at
    (``desc_row0 + h``, ``slice_col0``); its ``scale_ptr`` (None: 16-bit weights) the expert's group scales of
    prepared 4-bit weights (their rows are zero past I, and so is y).
    """
    w2_expert, stride_w2_h, stride_w2_i = w2_operand.ptr, w2_operand.stride_n, w2_operand.stride_k
    w2_desc, w2_row0 = w2_operand.desc, w2_operand.desc_row0
    s2_expert, stride_s2_n = w2_operand.scale_ptr, w2_operand.stride_scale_n
    offs_h0 = tl.arange(0, BLOCK_H)
    for h0 in tl.range(0, H, BLOCK_H, num_stages=STAGES):
        offs_h = h0 + offs_h0
        h_valid = offs_h < H
        if WITH_BASE:
            if s2_expert is not None:
                packed, scales = _packed_weight_load(w2_expert + offs_h[:, None] * stride_w2_h, slice_col0, stride_w2_h,
                                                     h_valid, s2_expert + offs_h * stride_s2_n, y.shape[1], WEIGHT_GROUP)
                partial = _packed_dot(y, packed, scales, tl.zeros([BLOCK_M, BLOCK_H], dtype=tl.float32),
                                      y.shape[1], WEIGHT_GROUP)
            else:
                if w2_desc is not None:
                    partial = tl.dot(y, tl.trans(w2_desc.load([w2_row0 + h0, slice_col0])), input_precision="ieee")
                else:
                    w = tl.load(w2_expert + offs_n[:, None] * stride_w2_i + offs_h[None, :] * stride_w2_h,
                                mask=n_valid[:, None] & h_valid[None, :], other=0.0)
                    partial = tl.dot(y, w, input_precision="ieee")
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

