"""4-bit expert weights (mxfp4, int4 with group scales and zero points; fmoe2/quant4.py): the torch mirror, the
checkpoint packings, the kernels' operand loader bit for bit, and whole forwards against the float64 reference of
the dequantized weights, on every path and feature (CPU interpreter in fp16/fp32, or the GPU)."""
import math
from dataclasses import replace

import pytest
import torch
import triton
import triton.language as tl

import fmoe2
from fmoe2 import FusedMoEConfig, fused_moe, prepare_weights, quant4
from fmoe2._validation import BF16_UNDER_THE_INTERPRETER, interpreter_computes_wrong
from fmoe2.gemm.config import fit_packed_config
from fmoe2.gemm.fused_moe import plan_of
from fmoe2.gemm.decode import kept_accumulators, release_kept_accumulators
from fmoe2.launch import LaunchSpec
from fmoe2.gemm.operands import _packed_weight_dequant, _packed_weight_load
from helpers import DEVICE, make_lora, make_problem, make_token_lora_ids, poisoned, rel_error

SMALL = FusedMoEConfig(BLOCK_M=16, BLOCK_N=32, BLOCK_K=32, BLOCK_H=16)
CONFIGS = {
    "fused": SMALL,
    # K steps of 32 (the least of 4-bit weights: test_4bit_k_steps_hold_16_bytes_of_a_row): an int4 group of 64 or 128
    # spans several K steps (the loader's other branch)
    "two_stage": replace(SMALL, path="two_stage", BLOCK_K=32, S2_BLOCK_N=16, S2_BLOCK_K=32, S2_SPLIT_K=2),
    # several groups per K step: 2 x 32 x 128 tile elements at 4 warps are within fit_packed_config's bound
    "wide": replace(SMALL, BLOCK_N=32, BLOCK_K=128, BLOCK_H=32),
}


def test_the_configs_here_run_as_given():
    for name, config in CONFIGS.items():
        assert fit_packed_config(config, weight_format="int4") == config, name


def test_4bit_k_steps_hold_16_bytes_of_a_row():
    # 4-bit K steps of 16 columns came out wrong on an H200 (gemm/config.py: LEAST_PACKED_K_STEP): a caller's K steps
    # of 16 (BLOCK_K, S2_BLOCK_K, and the fused path's slice BLOCK_N, the down GEMM's K step) run as 32 (int8's as
    # given), and the forwards are right (in bf16 on the GPU, where the steps of 16 went wrong).
    narrow = replace(SMALL, BLOCK_N=16, BLOCK_K=16)
    narrow_two_stage = replace(narrow, path="two_stage", S2_BLOCK_N=16, S2_BLOCK_K=16)
    for fmt in ("mxfp4", "int4"):
        assert fit_packed_config(narrow, weight_format=fmt) == replace(narrow, BLOCK_N=32, BLOCK_K=32)
        assert fit_packed_config(narrow_two_stage, weight_format=fmt) == replace(narrow_two_stage, BLOCK_K=32,
                                                                                  S2_BLOCK_K=32)
    assert fit_packed_config(narrow_two_stage, weight_format="int8") == narrow_two_stage
    M, E, H, I, topk = 7, 3, 96, 160, 2
    dtype = torch.float32 if DEVICE == "cpu" else torch.bfloat16
    for fmt in ("mxfp4", "int4-g32"):
        x, prepared, tw, ti = make_packed_problem(M, E, H, I, topk, fmt, dtype, seed=8)
        for config in (narrow, narrow_two_stage):
            out = fused_moe(x, prepared, None, tw, ti, config=config, out=poisoned(M, H, dtype))
            ran = plan_of(x, prepared, None, tw, ti, config=config, out=out).config
            assert min(ran.BLOCK_K, ran.BLOCK_N if ran.path == "fused" else ran.S2_BLOCK_K) == 32, ran
            check(out, x, prepared, tw, ti)


FORMATS = ["mxfp4", "int4-g32-sym", "int4-g64", "int4-g128"]
# What the activations' rounding leaves: the weights are dequantized exactly, so the 16-bit bounds hold.
TOL = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 2.5e-2}


def _name(fmt):
    """The weight format's name of a test format (``"int4-g64"`` -> ``"int4"``)."""
    return fmt.split("-")[0]


def _group(fmt):
    return quant4.MXFP4_GROUP if fmt == "mxfp4" else int(fmt.split("-")[1][1:])


def quantized(fmt, w, scale_dtype=torch.float16):
    """``(packed, scale, zero)`` of float ``w [..., N, K]`` in format ``fmt``."""
    if fmt == "mxfp4":
        return (*quant4.quantize_mxfp4(w), None)
    return quant4.quantize_int4(w.to(scale_dtype), _group(fmt), symmetric=fmt.endswith("sym"))


def make_packed_problem(M, E, H, I, topk, fmt, dtype, seed=0, interleaved=False, biases=False, pad_to=64,
                        blocks=False):
    """Random routing, x, and prepared 4-bit weights (with float32 biases where asked): helpers.make_problem's, the
    weights quantized (``blocks``: mxfp4 given as transformers' ``[E, N, K // 32, 16]`` blocks)."""
    x, w1, w2, tw, ti = make_problem(M, E, H, I, topk, torch.float32, device="cpu", seed=seed)
    p1, s1, z1 = quantized(fmt, w1)
    p2, s2, z2 = quantized(fmt, w2)
    gen = torch.Generator(device="cpu").manual_seed(100 + seed)
    b1 = torch.randn(E, 2 * I, generator=gen) if biases else None
    b2 = torch.randn(E, H, generator=gen) if biases else None
    if blocks:
        p1, p2 = p1.view(E, 2 * I, H // 32, 16), p2.view(E, H, I // 32, 16)
    to = lambda t: t.to(DEVICE) if t is not None else None  # noqa: E731
    prepared = prepare_weights(to(p1), to(p2), w1_scale=to(s1), w2_scale=to(s2), w1_zero=to(z1), w2_zero=to(z2),
                               w1_bias=to(b1), w2_bias=to(b2), gate_up_interleaved=interleaved, pad_to=pad_to,
                               weight_format=_name(fmt))
    return x.to(DEVICE, dtype), prepared, tw.to(DEVICE), ti.to(DEVICE)


def check(out, x, prepared, tw, ti, **kwargs):
    ref = fmoe2.fused_moe_reference(x.double(), prepared, None, tw, ti, **kwargs)
    assert out.shape == ref.shape and out.dtype == x.dtype
    assert torch.isfinite(out).all(), "output holds NaN/inf (unwritten or overflowed elements)"
    err = rel_error(out, ref)
    assert err <= TOL[x.dtype], f"relative L2 error {err:.3e} > {TOL[x.dtype]:.1e}"
    return ref


# ---------------------------------------------------------------------------------------------
# The torch mirror and the checkpoint packings
# ---------------------------------------------------------------------------------------------

def test_nibbles_pack_the_even_column_low():
    codes = torch.arange(16).repeat(3, 2)  # [3, 32]
    packed = quant4.pack_nibbles(codes)
    assert packed.dtype == torch.uint8 and packed.shape == (3, 16)
    assert int(packed[0, 0]) == 0x10 and int(packed[0, 1]) == 0x32
    assert torch.equal(quant4.unpack_nibbles(packed), codes)


def test_mxfp4_values_and_scales_follow_the_e2m1_and_e8m0_tables():
    codes = torch.arange(16).repeat(1, 2)  # one group of 32: every code twice
    packed = quant4.pack_nibbles(codes)
    for exponent in (0, 3, -5):
        scales = torch.tensor([[127 + exponent]], dtype=torch.uint8)
        got = quant4.dequantize_mxfp4(packed, scales, torch.float64)
        want = torch.tensor(quant4.E2M1_VALUES, dtype=torch.float64).repeat(1, 2) * 2.0 ** exponent
        assert torch.equal(got, want)


@pytest.mark.parametrize("fmt", FORMATS)
def test_quantized_weights_dequantize_close_to_the_original(fmt):
    w = torch.randn(3, 48, 256)
    packed, scale, zero = quantized(fmt, w)
    got = (quant4.dequantize_mxfp4(packed, scale) if fmt == "mxfp4"
           else quant4.dequantize_int4(packed, scale, zero, _group(fmt)))
    assert rel_error(got, w) < (0.2 if fmt == "mxfp4" else 0.15)


@pytest.mark.parametrize("group", quant4.INT4_GROUPS)
def test_gptq_and_awq_packings_convert_exactly(group):
    K, N = 256, 48
    packed, scale, zero = quant4.quantize_int4(torch.randn(N, K).half(), group)
    for zero_offset in (0, 1):
        qweight, qzeros, scales = quant4.to_gptq(packed, scale, zero, zero_offset=zero_offset)
        assert qweight.shape == (K // 8, N) and qzeros.shape == (K // group, N // 8) and scales.shape == (K // group, N)
        got = quant4.from_gptq(qweight, qzeros, scales, torch.arange(K) // group, zero_offset=zero_offset)
        assert all(torch.equal(a, b) for a, b in zip(got, (packed, scale, zero)))
    qweight, qzeros, scales = quant4.to_awq(packed, scale, zero)
    assert qweight.shape == (K, N // 8) and qzeros.shape == (K // group, N // 8)
    got = quant4.from_awq(qweight, qzeros, scales)
    assert all(torch.equal(a, b) for a, b in zip(got, (packed, scale, zero)))


def test_gptq_nibble_order_is_along_k():
    """One int32 of qweight holds K rows 8i..8i+7 in nibbles 0..7 (GPTQ's packing, written out by hand)."""
    qweight = torch.tensor([[0x76543210, 0x0FEDCBA9]], dtype=torch.int32).repeat(4, 1)  # [K // 8 = 4, N = 2]
    packed, _, _ = quant4.from_gptq(qweight, None, torch.ones(1, 2, dtype=torch.float16))
    codes = quant4.unpack_nibbles(packed)  # [N, K]
    assert codes[0, :8].tolist() == list(range(8))
    assert codes[1, :8].tolist() == [9, 10, 11, 12, 13, 14, 15, 0]


def test_gptq_zeros_and_awq_order_against_hand_written_words():
    """GPTQ's qzeros hold eight N columns per int32, nibble j = column 8c + j, the stored value one below the zero
    point (original format; 15 stored is 16); AWQ's nibble i holds column 8c + (0, 2, 4, 6, 1, 3, 5, 7)[i]."""
    qweight = torch.tensor([[0x76543210]], dtype=torch.int32).repeat(4, 8)  # [K // 8 = 4, N = 8]
    qzeros = torch.tensor([[0x7654321F]], dtype=torch.int32)  # [1 group, N // 8 = 1]
    _, _, zeros = quant4.from_gptq(qweight, qzeros, torch.ones(1, 8, dtype=torch.float16))
    assert zeros[:, 0].tolist() == [16, 2, 3, 4, 5, 6, 7, 8]
    awq_qweight = torch.tensor([[0x76543210]], dtype=torch.int32).repeat(32, 1)  # [K = 32, N // 8 = 1]
    packed, _, awq_zeros = quant4.from_awq(awq_qweight, torch.tensor([[0x76543210]], dtype=torch.int32),
                                           torch.ones(1, 8, dtype=torch.float16))
    assert quant4.unpack_nibbles(packed)[:, 0].tolist() == [0, 4, 1, 5, 2, 6, 3, 7]
    assert awq_zeros[:, 0].tolist() == [0, 4, 1, 5, 2, 6, 3, 7]


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("fmt", ["mxfp4", "int4-g32", "int4-g64-sym"])
def test_prepared_weights_are_the_inputs_dequantized(fmt, interleaved):
    """prepare_weights keeps each row's scales with its row (and the zero points given, 16 included): the prepared
    weights dequantize to the inputs' dequantization, gate rows then up rows."""
    E, H, I = 3, 192, 64  # I padded to 64: no padding rows; H = 3 groups of 64
    w1, w2 = torch.randn(E, 2 * I, H), torch.randn(E, H, I)
    (p1, s1, z1), (p2, s2, z2) = quantized(fmt, w1), quantized(fmt, w2)
    if fmt == "int4-g32":
        z1[0, 0, 0], z2[1, 2, 1] = 16, 0  # the zero points' range ends
    prepared = prepare_weights(p1, p2, w1_scale=s1, w2_scale=s2, w1_zero=z1, w2_zero=z2,
                               gate_up_interleaved=interleaved, pad_to=32, weight_format=_name(fmt))
    dequantize = (quant4.dequantize_mxfp4 if fmt == "mxfp4" else
                  lambda p, s, z: quant4.dequantize_int4(p, s, z, _group(fmt)))
    d1, d2 = dequantize(p1, s1, z1), dequantize(p2, s2, z2)
    if interleaved:  # the inputs' rows are g0, u0, g1, u1, ...
        d1 = torch.cat([d1[:, 0::2], d1[:, 1::2]], dim=1)
    got1, got2 = prepared.unprepare()
    assert torch.equal(got1, d1) and torch.equal(got2, d2)


def test_gptq_act_order_and_bad_packings_are_refused():
    packed, scale, zero = quant4.quantize_int4(torch.randn(16, 128).half(), 32)
    qweight, qzeros, scales = quant4.to_gptq(packed, scale, zero)
    with pytest.raises(ValueError, match="act-order"):
        quant4.from_gptq(qweight, qzeros, scales, torch.randperm(128) // 32)
    with pytest.raises(TypeError, match="qweight must be an int32"):
        quant4.from_gptq(qweight.float(), qzeros, scales)
    with pytest.raises(ValueError, match="group size"):
        quant4.from_gptq(qweight, qzeros[:3], scales[:3])


# ---------------------------------------------------------------------------------------------
# The kernels' operand loader, bit for bit
# ---------------------------------------------------------------------------------------------

@triton.jit
def _loader_kernel(w_ptr, s_ptr, out_ptr, K, stride_w, stride_s, stride_out, ROWS: tl.constexpr,
                   BLOCK_K: tl.constexpr, GROUP: tl.constexpr):
    rows = tl.arange(0, ROWS)
    offs_k = tl.arange(0, BLOCK_K)
    for k0 in range(0, K, BLOCK_K):  # (the rows are K // 2 bytes long: stride_w)
        packed, scales = _packed_weight_load(w_ptr + rows[:, None] * stride_w, k0, stride_w, rows < ROWS,
                                             s_ptr + rows * stride_s, BLOCK_K, GROUP)
        # (in out's dtype: the float32 path, or with scales of that 16-bit dtype its own)
        tile = _packed_weight_dequant(packed, scales, BLOCK_K, GROUP, out_ptr.dtype.element_ty)
        tl.store(out_ptr + rows[:, None] * stride_out + (k0 + offs_k)[None, :], tile)  # (whole tiles, past K too)


@pytest.mark.parametrize("block_k", [16, 32, 64])
@pytest.mark.parametrize("fmt,scale_dtype", [("mxfp4", torch.uint8), ("int4-g32", torch.float16),
                                             ("int4-g32", torch.bfloat16), ("int4-g32", torch.float32)],
                         ids=["mxfp4", "int4-fp16-scales", "int4-bf16-scales", "int4-fp32-scales"])
@pytest.mark.parametrize("into", ["float32", "scales-dtype"])
def test_the_loader_dequantizes_every_code_exactly(fmt, block_k, scale_dtype, into):
    # Into float32 the values are exact; into the scales' 16-bit dtype (the forward's tiles where the scales are in
    # the activations' dtype) the exact values rounded once
    out_dtype = torch.float32 if into == "float32" or fmt == "mxfp4" else scale_dtype
    if interpreter_computes_wrong(out_dtype):
        pytest.skip(BF16_UNDER_THE_INTERPRETER)
    ROWS, K = 16, 96  # K not a multiple of 64: the last step runs past the row, masked
    codes = torch.randint(0, 16, (ROWS, K))
    codes[0, :16] = torch.arange(16)
    packed = quant4.pack_nibbles(codes).to(DEVICE)
    if fmt == "mxfp4":
        scale = torch.randint(100, 150, (ROWS, K // 32), dtype=torch.uint8)
        scale[1, 0] = 0  # reads as 0
        want = quant4.dequantize_mxfp4(packed.cpu(), scale, torch.float32)
        s = scale.to(DEVICE)
    else:
        # 16-bit scales take one fused multiply-add, float32 ones (q - zero) * scale: exact either way
        scale = (torch.rand(ROWS, K // 32) + 0.01).to(scale_dtype)
        zero = torch.randint(0, 16, (ROWS, K // 32))
        want = quant4.dequantize_int4(packed.cpu(), scale, zero, 32, torch.float32)
        s = torch.stack([scale, zero.to(scale_dtype)], dim=-1).to(DEVICE)
    # The tiles past K must read zeros, not the next row's bytes (the rows are contiguous)
    width = -(-K // block_k) * block_k
    out = torch.full((ROWS, width), float("nan"), device=DEVICE, dtype=out_dtype)
    _loader_kernel[(1,)](packed, s, out, K, packed.stride(0), s.stride(0), out.stride(0), ROWS, block_k, 32)
    assert torch.equal(out.cpu(), torch.nn.functional.pad(want, (0, width - K)).to(out_dtype))


# ---------------------------------------------------------------------------------------------
# Whole forwards
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("path", ["fused", "two_stage", "wide"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_forward_matches_the_dequantized_reference(fmt, path):
    group = _group(fmt)
    H, I = (3 * group, 5 * group) if group < 128 else (128, 256)  # H, I not multiples of 128 where the group allows
    M, E, topk = 11, 5, 3  # E not a power of two
    x, prepared, tw, ti = make_packed_problem(M, E, H, I, topk, fmt, torch.float32, seed=1)
    assert prepared.weight_format == fmt.split("-")[0] and prepared.group_size == group
    out = fused_moe(x, prepared, None, tw, ti, config=CONFIGS[path], out=poisoned(M, H, torch.float32))
    check(out, x, prepared, tw, ti)


@pytest.mark.parametrize("topk", [1, 8])
@pytest.mark.parametrize("fmt", ["mxfp4", "int4-g32"])
def test_top_k_extremes_in_fp16_with_the_picked_config(fmt, topk):
    M, E, H, I = 9, 10, 96, 160
    check_every_path(*make_packed_problem(M, E, H, I, topk, fmt, torch.float16, seed=2))


def check_every_path(x, prepared, tw, ti):
    """Forwards on each path ("auto" too) into poisoned outputs, each against the reference."""
    for path in ("auto", "fused", "two_stage"):
        out = fused_moe(x, prepared, None, tw, ti, path=path, out=poisoned(*x.shape, x.dtype))
        check(out, x, prepared, tw, ti)


@pytest.mark.parametrize("path", ["fused", "two_stage"])
def test_gpt_oss_checkpoint_layout_with_biases_clamped_swiglu_and_expert_map(path):
    """gpt-oss as published: mxfp4 blocks [E, 2I, H // 32, 16] with interleaved gate/up rows, e8m0 scales,
    float32 biases, swiglu_oai clamped at 7; this rank holds 5 of 8 experts."""
    M, E, H, I, topk = 13, 5, 96, 64, 4
    x, prepared, tw, ti = make_packed_problem(M, E, H, I, topk, "mxfp4", torch.float16, seed=3, interleaved=True,
                                              biases=True, blocks=True)
    gen = torch.Generator().manual_seed(3)
    ti = torch.stack([torch.randperm(8, generator=gen)[:topk] for _ in range(M)]).to(DEVICE, torch.int32)
    expert_map = torch.tensor([0, -1, 1, 2, -1, 3, 4, -1], dtype=torch.int32, device=DEVICE)
    act = dict(activation="swiglu_oai", swiglu_alpha=1.702, swiglu_limit=7.0)
    out = fused_moe(x * 4, prepared, None, tw, ti, config=CONFIGS[path], expert_map=expert_map,
                    out=poisoned(M, H, torch.float16), **act)
    check(out, x * 4, prepared, tw, ti, expert_map=expert_map, **act)
    assert prepared.b13.dtype == torch.float32  # kept as published, added in float32


def test_transformers_block_layout_prepares_like_the_flat_one():
    E, H, I = 2, 64, 64
    p1, s1 = quant4.quantize_mxfp4(torch.randn(E, 2 * I, H))
    p2, s2 = quant4.quantize_mxfp4(torch.randn(E, H, I))
    flat = prepare_weights(p1, p2, w1_scale=s1, w2_scale=s2, gate_up_interleaved=True, weight_format="mxfp4")
    blocks = prepare_weights(p1.view(E, 2 * I, H // 32, 16), p2.view(E, H, I // 32, 16), w1_scale=s1, w2_scale=s2,
                             gate_up_interleaved=True, weight_format="mxfp4")
    assert torch.equal(flat.w13, blocks.w13) and torch.equal(flat.s13, blocks.s13)
    assert flat.w13.shape == (E, 2 * I, H // 2) and flat.w13.element_size() * flat.w13.numel() == E * 2 * I * H // 2


@pytest.mark.parametrize("fmt", ["mxfp4", "int4-g32"])
def test_one_token_decodes_in_one_launch_call_after_call(fmt, monkeypatch):
    M, E, H, I, topk = 1, 6, 64, 96, 4
    x, prepared, tw, ti = make_packed_problem(M, E, H, I, topk, fmt, torch.float16, seed=4)
    launched = []
    original = LaunchSpec.launch
    monkeypatch.setattr(LaunchSpec, "launch", lambda spec: (launched.append(spec.name), original(spec))[1])
    release_kept_accumulators()
    first = fused_moe(x, prepared, None, tw, ti, config=SMALL, out=poisoned(M, H, torch.float16))
    check(first, x, prepared, tw, ti)
    assert launched == (["decode"] if DEVICE == "cpu" else ["sort", "fused", "decode"]), launched
    for _ in range(2):
        assert torch.equal(fused_moe(x, prepared, None, tw, ti, config=SMALL), first)
    assert all(not acc.any() for acc in kept_accumulators().values())
    release_kept_accumulators()


def test_deterministic_mode_gives_the_same_bits_whatever_the_batch():
    M, E, H, I, topk = 12, 4, 64, 64, 2
    x, prepared, tw, ti = make_packed_problem(M, E, H, I, topk, "int4-g32", torch.float16, seed=5)
    out = fused_moe(x, prepared, None, tw, ti, deterministic=True)
    check(out, x, prepared, tw, ti)
    alone = fused_moe(x[3:4], prepared, None, tw[3:4], ti[3:4], deterministic=True)
    assert torch.equal(alone[0], out[3])
    assert torch.equal(fused_moe(x, prepared, None, tw, ti, deterministic=True), out)


@pytest.mark.parametrize("path", ["fused", "two_stage"])
def test_lora_adapters_on_4bit_experts(path):
    M, E, H, I, topk = 10, 3, 64, 64, 2
    x, prepared, tw, ti = make_packed_problem(M, E, H, I, topk, "mxfp4", torch.float32, seed=6)
    lora = make_lora(2, E, H, I, 8, torch.float32, seed=6)
    ids = make_token_lora_ids(M, 2, seed=6)
    out = fused_moe(x, prepared, None, tw, ti, lora=lora, token_lora_ids=ids, config=CONFIGS[path],
                    out=poisoned(M, H, torch.float32))
    ref = check(out, x, prepared, tw, ti, lora=lora, token_lora_ids=ids)
    assert rel_error(ref, fmoe2.fused_moe_reference(x.double(), prepared, None, tw, ti)) > 1e-2  # deltas matter


def test_no_tokens_and_all_tokens_on_one_expert():
    M, E, H, I, topk = 20, 4, 64, 64, 1
    x, prepared, tw, ti = make_packed_problem(M, E, H, I, topk, "int4-g64", torch.float32, seed=7)
    one = torch.full_like(ti, 2)
    out = fused_moe(x, prepared, None, tw, one, out=poisoned(M, H, torch.float32))
    check(out, x, prepared, tw, one)
    empty = fused_moe(x[:0], prepared, None, tw[:0], ti[:0])
    assert empty.shape == (0, H)


def test_prepared_4bit_weights_keep_4_bits():
    E, H, I = 4, 256, 128
    _, prepared, _, _ = make_packed_problem(1, E, H, I, 1, "mxfp4", torch.float32)
    weight_bytes = sum(t.numel() * t.element_size() for t in (prepared.w13, prepared.w2, prepared.s13, prepared.s2))
    assert weight_bytes * 8 == 4.25 * (3 * E * H * I)
    _, prepared, _, _ = make_packed_problem(1, E, H, I, 1, "int4-g128", torch.float32)
    weight_bytes = sum(t.numel() * t.element_size() for t in (prepared.w13, prepared.w2, prepared.s13, prepared.s2))
    assert weight_bytes * 8 == (4 + 32 / 128) * (3 * E * H * I)  # fp16 (scale, zero) per group


# ---------------------------------------------------------------------------------------------
# Errors before any launch
# ---------------------------------------------------------------------------------------------

def test_wrong_packings_scales_and_zeros_are_refused_by_name():
    E, H, I = 2, 64, 32
    p1, s1 = quant4.quantize_mxfp4(torch.randn(E, 2 * I, H))
    p2, s2 = quant4.quantize_mxfp4(torch.randn(E, H, I))
    mx = dict(weight_format="mxfp4")
    with pytest.raises(ValueError, match="say which with weight_format="):
        prepare_weights(p1, p2, w1_scale=s1, w2_scale=s2)
    with pytest.raises(ValueError, match="need their scales"):
        prepare_weights(p1, p2, **mx)
    with pytest.raises(ValueError, match=r"w2_scale must have shape"):
        prepare_weights(p1, p2, w1_scale=s1, w2_scale=s2[:, :, :0], **mx)
    with pytest.raises(ValueError, match="no zero points"):
        prepare_weights(p1, p2, w1_scale=s1, w2_scale=s2, w1_zero=s1, w2_zero=s2, **mx)
    with pytest.raises(TypeError, match="w2 is torch.float32"):
        prepare_weights(p1, torch.randn(E, H, I), w1_scale=s1, w2_scale=s2, **mx)
    with pytest.raises(ValueError, match=r"w2 must have shape \[E, H, I // 2\]"):
        prepare_weights(p1, p2[:, :, :8], w1_scale=s1, w2_scale=s2, **mx)
    q1, f1, z1 = quant4.quantize_int4(torch.randn(E, 2 * I, H).half(), 32)
    q2, f2, z2 = quant4.quantize_int4(torch.randn(E, H, I).half(), 32)
    i4 = dict(weight_format="int4")
    with pytest.raises(ValueError, match="w1_zero and w2_zero go together"):
        prepare_weights(q1, q2, w1_scale=f1, w2_scale=f2, w1_zero=z1, **i4)
    with pytest.raises(ValueError, match=r"w1_zero must hold zero points in \[0, 16\]"):
        prepare_weights(q1, q2, w1_scale=f1, w2_scale=f2, w1_zero=z1.int() + 9, w2_zero=z2, **i4)
    with pytest.raises(ValueError, match="int4 groups"):
        prepare_weights(q1, q2, w1_scale=f1[:, :, :1].repeat(1, 1, 3), w2_scale=f2, **i4)
    with pytest.raises(ValueError, match="w1_zero/w2_zero go with int4"):
        prepare_weights(torch.randn(E, 2 * I, H), torch.randn(E, H, I), w1_zero=z1)
    q1, f1, _ = quant4.quantize_int4(torch.randn(E, 2 * I, 128).half(), 64)
    q2, f2, _ = quant4.quantize_int4(torch.randn(E, 128, 64).half(), 64)
    with pytest.raises(ValueError, match="need I a multiple of the group"):
        prepare_weights(q1[:, :2 * 32], q2[:, :, :16], w1_scale=f1[:, :2 * 32], w2_scale=f2[:, :, :1], **i4)


def test_mismatched_prepared_scales_and_plain_4bit_weights_are_refused():
    M, E, H, I = 3, 2, 64, 32
    x, prepared, tw, ti = make_packed_problem(M, E, H, I, 1, "mxfp4", torch.float32)
    bad = replace(prepared, s2=prepared.s2[:, :, :1])
    with pytest.raises(ValueError, match=r"w1.s2 must have shape"):
        fused_moe(x, bad, None, tw, ti)
    with pytest.raises(ValueError, match="need their scales"):
        fused_moe(x, replace(prepared, s13=None, s2=None), None, tw, ti)
    with pytest.raises(TypeError, match="prepared once at load time"):
        fused_moe(x, prepared.w13, prepared.w2, tw, ti)


# ---------------------------------------------------------------------------------------------
# The GPU: bf16, the real models' sizes, CUDA graphs
# ---------------------------------------------------------------------------------------------

def _random_packed(fmt, E, H, I, seed, device="cuda"):
    """Prepared 4-bit weights of random codes and scales (no float copy of the layer is made: gpt-oss-120b's would
    take 25 GB): scales keep each row's dot products O(1)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    group = _group(fmt)

    def weight(N, K):
        packed = torch.randint(0, 256, (E, N, K // 2), dtype=torch.uint8, device=device, generator=gen)
        if fmt == "mxfp4":  # e2m1 magnitudes average about 2: scale about 1 / (2 sqrt(K))
            centre = 127 - round(math.log2(2 * math.sqrt(K)))
            return packed, torch.randint(centre - 1, centre + 2, (E, N, K // group), dtype=torch.uint8,
                                         device=device, generator=gen), None
        scale = (torch.rand(E, N, K // group, device=device, generator=gen) + 0.5) / (5 * math.sqrt(K))
        zero = torch.randint(6, 11, (E, N, K // group), dtype=torch.uint8, device=device, generator=gen)
        return packed, scale.to(torch.bfloat16), zero

    (p1, s1, z1), (p2, s2, z2) = weight(2 * I, H), weight(H, I)
    return prepare_weights(p1, p2, w1_scale=s1, w2_scale=s2, w1_zero=z1, w2_zero=z2, gate_up_interleaved=True,
                           weight_format=_name(fmt))


def _reference_on_hit_experts(x, prepared, tw, ti, **kwargs):
    """The float32 reference computed on the experts ``ti`` routes to only (dequantizing a whole layer of
    gpt-oss-120b would take 12 GB more)."""
    hit = torch.unique(ti.long())
    local = torch.full((prepared.num_experts,), -1, dtype=torch.long, device=ti.device)
    local[hit] = torch.arange(hit.numel(), device=ti.device)
    sub = replace(prepared, w13=prepared.w13[hit], w2=prepared.w2[hit], s13=prepared.s13[hit], s2=prepared.s2[hit],
                  b13=prepared.b13[hit] if prepared.b13 is not None else None,
                  b2=prepared.b2[hit] if prepared.b2 is not None else None)
    return fmoe2.fused_moe_reference(x, sub, None, tw, local[ti.long()].to(ti.dtype), **kwargs)


GPT_OSS = {"gpt-oss-20b": (32, 2880, 2880, 4), "gpt-oss-120b": (128, 2880, 2880, 4)}
GPU_CASES = [("gpt-oss-20b", M) for M in (1, 16, 128, 1024, 65536)] + [("gpt-oss-120b", M) for M in (1, 4, 16)]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("fmt", ["mxfp4", "int4-g64"])  # (H = I = 2880: groups of 128 do not divide them)
@pytest.mark.parametrize("shape,M", GPU_CASES)
def test_gpt_oss_sizes_in_bf16_eager_repeated_and_graph_replayed(shape, M, fmt):
    E, H, I, topk = GPT_OSS[shape]
    prepared = _random_packed(fmt, E, H, I, seed=M)
    gen = torch.Generator(device="cuda").manual_seed(M)
    x = torch.randn(M, H, device="cuda", generator=gen).to(torch.bfloat16)
    tw, ti = torch.topk(torch.randn(M, E, device="cuda", generator=gen).softmax(-1), topk, dim=-1)
    ti = ti.to(torch.int32)
    act = dict(activation="swiglu_oai", swiglu_alpha=1.702, swiglu_limit=7.0)
    check_repeated_and_graph_replayed(x, prepared, tw, ti, _reference_on_hit_experts(x, prepared, tw, ti, **act), **act)


def check_repeated_and_graph_replayed(x, prepared, tw, ti, ref, **act):
    """bf16 forwards on each path into poisoned outputs against ``ref``, each repeated, then one replayed from a
    CUDA graph into a NaN-filled output."""
    M, H = x.shape
    for path in ("auto", "fused", "two_stage"):
        out = fused_moe(x, prepared, None, tw, ti, path=path, out=poisoned(M, H, torch.bfloat16, "cuda"), **act)
        assert torch.isfinite(out).all(), (M, path)
        err = rel_error(out, ref)
        assert err <= TOL[torch.bfloat16], (M, path, err)
        again = fused_moe(x, prepared, None, tw, ti, path=path, **act)
        assert rel_error(again, out) <= 1e-2, (M, path)  # (atomic adds: the order, not the values, may change)
    out = torch.full((M, H), float("nan"), dtype=torch.bfloat16, device="cuda")
    graph_fn = lambda: fused_moe(x, prepared, None, tw, ti, out=out, **act)  # noqa: E731
    graph_fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graph_fn()
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert rel_error(out, ref) <= TOL[torch.bfloat16], M


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("path", ["fused", "two_stage"])
def test_lora_expert_map_and_deterministic_mode_in_bf16(path):
    check_lora_expert_map_and_deterministic(_random_packed("mxfp4", *LORA_SIZES[1:4], seed=11), path)


LORA_SIZES = (64, 6, 320, 192, 4)  # M, E, H, I, topk of check_lora_expert_map_and_deterministic


def check_lora_expert_map_and_deterministic(prepared, path):
    """bf16 forwards of ``prepared`` (weights of :data:`LORA_SIZES`) on ``path`` with adapters and an ``expert_map``
    (6 of 12 experts here) against the reference; deterministic mode repeated bit for bit."""
    M, E, H, I, topk = LORA_SIZES
    gen = torch.Generator(device="cuda").manual_seed(11)
    x = torch.randn(M, H, device="cuda", generator=gen).to(torch.bfloat16)
    tw, _ = torch.topk(torch.randn(M, 12, device="cuda", generator=gen).softmax(-1), topk, dim=-1)
    ti = torch.stack([torch.randperm(12, device="cuda", generator=gen)[:topk] for _ in range(M)]).to(torch.int32)
    expert_map = torch.tensor([0, -1, 1, -1, 2, -1, 3, -1, 4, -1, 5, -1], dtype=torch.int32, device="cuda")
    lora = make_lora(3, E, H, I, 16, torch.bfloat16, seed=11)
    ids = make_token_lora_ids(M, 3, seed=11)
    config = replace(CONFIGS["fused" if path == "fused" else "two_stage"], BLOCK_K=64, BLOCK_N=64)
    out = fused_moe(x, prepared, None, tw, ti, lora=lora, token_lora_ids=ids, expert_map=expert_map, config=config)
    ref = fmoe2.fused_moe_reference(x, prepared, None, tw, ti, lora=lora, token_lora_ids=ids, expert_map=expert_map)
    assert rel_error(out, ref) <= TOL[torch.bfloat16]
    first = fused_moe(x, prepared, None, tw, ti, expert_map=expert_map, deterministic=True)
    assert rel_error(first, fmoe2.fused_moe_reference(x, prepared, None, tw, ti, expert_map=expert_map)) <= 2.5e-2
    for _ in range(3):
        assert torch.equal(fused_moe(x, prepared, None, tw, ti, expert_map=expert_map, deterministic=True), first)


def test_tuned_entries_of_the_weights_format_are_read_with_their_path(tmp_path, monkeypatch):
    # python -m fmoe2.tune --weights F writes the entry "F" of the shape's tuned file (the activations' dtype's file);
    # forwards of F weights take its nearest batch size's config, its path included (a caller's path still forces
    # one), fitted to dequantizing; forwards of other formats do not read it (the plain entries, fitted, instead).
    import importlib
    import json

    from fmoe2.gemm.config import ConfigMode, shape_file_name, tuned_config, tuned_section

    assert [tuned_section(ConfigMode(weight_format=f)) for f in ("mxfp4", "int4", "int8", "16bit")] == \
        ["mxfp4", "int4", "int8", None]
    assert tuned_section(ConfigMode(fp8=True)) == "fp8"
    config_module = importlib.import_module("fmoe2.gemm.config")
    fused_moe_module = importlib.import_module("fmoe2.gemm.fused_moe")
    E, H, I, topk = 5, 96, 160, 2
    dtype = torch.float32 if DEVICE == "cpu" else torch.bfloat16
    two_stage = FusedMoEConfig(BLOCK_M=16, BLOCK_N=32, BLOCK_K=64, BLOCK_H=32, path="two_stage", S2_BLOCK_N=32,
                               S2_BLOCK_K=64)
    fused = FusedMoEConfig(BLOCK_M=16, BLOCK_N=64, BLOCK_K=32, BLOCK_H=32, path="fused")
    (tmp_path / "GPU").mkdir()
    (tmp_path / "GPU" / shape_file_name(E, H, I, topk, dtype)).write_text(json.dumps(
        {"1": fused.to_dict(), "mxfp4": {"1": two_stage.to_dict(), "64": fused.to_dict()}}))
    monkeypatch.setattr(config_module, "tuned_config", lambda problem, tuned_for, config_dir, sections=(None,):
                        tuned_config(problem, "GPU", str(tmp_path), sections))
    fused_moe_module.clear_plans()
    try:
        for M, fmt, path, expected in ((3, "mxfp4", "auto", two_stage), (40, "mxfp4", "auto", fused),
                                       (3, "mxfp4", "fused", None), (3, "int4-g32", "auto", fused)):
            x, prepared, tw, ti = make_packed_problem(M, E, H, I, topk, fmt, dtype, seed=M)
            out = fused_moe(x, prepared, None, tw, ti, path=path, out=poisoned(M, H, dtype))
            check(out, x, prepared, tw, ti)
            ran = plan_of(x, prepared, None, tw, ti, path=path, out=out).config
            assert ran.path == (expected.path if expected else path), (M, fmt, path, ran)
            if expected is not None:  # its tiles, as fitted (which keeps these)
                assert (ran.BLOCK_M, ran.BLOCK_N, ran.BLOCK_K) == (expected.BLOCK_M, expected.BLOCK_N,
                                                                   expected.BLOCK_K), (M, fmt, ran)
    finally:
        fused_moe_module.clear_plans()
