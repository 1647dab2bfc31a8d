"""int8 weight-only expert weights (w8a16, fmoe2/int8.py): the torch mirror, prepare_weights with per-channel and
group scales, the kernels' operand loader bit for bit, and whole forwards against the float64 reference of the
dequantized weights on every path and feature (CPU interpreter in fp16/fp32, or the GPU), the real models' sizes on
the GPU eager and graph-replayed."""

import pytest
import torch

import fmoe2
from fmoe2 import fused_moe, int8, prepare_weights
from fmoe2._validation import BF16_UNDER_THE_INTERPRETER, interpreter_computes_wrong
from helpers import DEVICE, make_lora, make_problem, make_token_lora_ids, poisoned, rel_error
from test_packed_weights import (CONFIGS, LORA_SIZES, _loader_kernel, check, check_every_path,
                                 check_lora_expert_map_and_deterministic, check_repeated_and_graph_replayed)

GROUPS = [None, 32, 128]  # None: per output channel (vLLM's int8_w8a16)


def make_int8_problem(M, E, H, I, topk, group, dtype, seed=0, interleaved=False, biases=False, pad_to=64,
                      scale_dtype=torch.float16):
    """Random routing, x and prepared int8 weights (float32 biases where asked): helpers.make_problem's, the
    weights quantized per channel (``group`` None) or per group."""
    x, w1, w2, tw, ti = make_problem(M, E, H, I, topk, torch.float32, device="cpu", seed=seed)
    (q1, s1), (q2, s2) = int8.quantize_int8(w1.to(scale_dtype), group), int8.quantize_int8(w2.to(scale_dtype), group)
    gen = torch.Generator(device="cpu").manual_seed(100 + seed)
    b1 = torch.randn(E, 2 * I, generator=gen) if biases else None
    b2 = torch.randn(E, H, generator=gen) if biases else None
    to = lambda t: t.to(DEVICE) if t is not None else None  # noqa: E731
    prepared = prepare_weights(to(q1), to(q2), w1_scale=to(s1), w2_scale=to(s2), w1_bias=to(b1), w2_bias=to(b2),
                               gate_up_interleaved=interleaved, pad_to=pad_to)
    return x.to(DEVICE, dtype), prepared, tw.to(DEVICE), ti.to(DEVICE)


# ---------------------------------------------------------------------------------------------
# The torch mirror and prepare_weights
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("group", GROUPS)
def test_quantized_weights_dequantize_close_to_the_original(group):
    w = torch.randn(3, 48, 256)
    q, scale = int8.quantize_int8(w, group)
    assert q.dtype == torch.int8 and q.shape == w.shape
    assert scale.shape == ((3, 48) if group is None else (3, 48, 256 // group))
    assert int(q.abs().max()) == 127  # each channel's or group's largest value maps to +-127
    assert rel_error(int8.dequantize_int8(q, scale, group), w) < 1e-2


def test_quantizing_refuses_nan_and_inf_and_bad_groups():
    w = torch.randn(4, 64)
    w[1, 3] = float("nan")
    with pytest.raises(ValueError, match="NaN or inf"):
        int8.quantize_int8(w)
    with pytest.raises(ValueError, match="group_size must be None"):
        int8.quantize_int8(torch.randn(4, 64), 48)
    with pytest.raises(ValueError, match="multiple of it"):
        int8.quantize_int8(torch.randn(4, 96), 64)


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("group", GROUPS)
def test_prepared_weights_are_the_inputs_dequantized(group, interleaved):
    """Each row keeps its scales (per channel ones repeated over the row's groups); odd H and I (per channel) are
    padded with zero weights."""
    E, (H, I) = 3, ((72, 40) if group is None else (2 * 128, 128))
    w1, w2 = torch.randn(E, 2 * I, H), torch.randn(E, H, I)
    (q1, s1), (q2, s2) = int8.quantize_int8(w1, group), int8.quantize_int8(w2, group)
    prepared = prepare_weights(q1, q2, w1_scale=s1, w2_scale=s2, gate_up_interleaved=interleaved, pad_to=32)
    assert prepared.weight_format == "int8" and prepared.packed and not prepared.fp8
    assert prepared.group_size == (int8.CHANNEL_GROUP if group is None else group)
    assert prepared.w13.dtype == torch.int8 and prepared.w13.shape[2] % prepared.group_size == 0
    d1, d2 = int8.dequantize_int8(q1, s1, group), int8.dequantize_int8(q2, s2, group)
    if interleaved:  # the inputs' rows are g0, u0, g1, u1, ...
        d1 = torch.cat([d1[:, 0::2], d1[:, 1::2]], dim=1)
    got1, got2 = prepared.unprepare()
    assert torch.equal(got1, d1) and torch.equal(got2, d2)


def test_weight_bytes_are_half_of_bf16_plus_the_scales():
    E, H, I = 2, 256, 128
    _, prepared, _, _ = make_int8_problem(1, E, H, I, 1, 128, torch.float32)
    weight_bytes = sum(t.numel() * t.element_size() for t in (prepared.w13, prepared.w2, prepared.s13, prepared.s2))
    assert weight_bytes * 8 == (8 + 16 / 128) * (3 * E * H * I)  # an fp16 scale per 128 values


def test_wrong_scales_zeros_and_unprepared_int8_weights_are_refused_by_name():
    E, H, I = 2, 64, 32
    (q1, s1), (q2, s2) = int8.quantize_int8(torch.randn(E, 2 * I, H)), int8.quantize_int8(torch.randn(E, H, I))
    with pytest.raises(ValueError, match="need their scales"):
        prepare_weights(q1, q2)
    with pytest.raises(ValueError, match="no zero points"):
        prepare_weights(q1, q2, w1_scale=s1, w2_scale=s2, w1_zero=s1, w2_zero=s2)
    with pytest.raises(ValueError, match=r"w2_scale must have shape \[E, H\]"):
        prepare_weights(q1, q2, w1_scale=s1, w2_scale=s2[:, :8])
    with pytest.raises(TypeError, match="w2_scale must have dtype"):
        prepare_weights(q1, q2, w1_scale=s1, w2_scale=s2.half())
    with pytest.raises(TypeError, match="w1_scale must have dtype"):
        prepare_weights(q1, q2, w1_scale=s1.to(torch.uint8), w2_scale=s2)
    with pytest.raises(ValueError, match="int8 groups"):
        prepare_weights(q1, q2, w1_scale=s1[:, :, None].expand(E, 2 * I, 4), w2_scale=s2[:, :, None])
    with pytest.raises(TypeError, match="int8 weights are torch.int8: w2 is torch.float32"):
        prepare_weights(q1, torch.randn(E, H, I), w1_scale=s1, w2_scale=s2)
    with pytest.raises(ValueError, match="block_shape and fp8_dtype go with fp8"):
        prepare_weights(q1, q2, w1_scale=s1, w2_scale=s2, block_shape=(128, 128))
    x, tw, ti = torch.randn(3, H), torch.rand(3, 1), torch.zeros(3, 1, dtype=torch.int32)
    with pytest.raises(TypeError, match="int8 weights.*prepared once at load time"):
        fused_moe(x, q1, q2, tw, ti)


# ---------------------------------------------------------------------------------------------
# The kernels' operand loader, bit for bit
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("into", ["float32", "scales-dtype"])
@pytest.mark.parametrize("scale_dtype", [torch.float16, torch.bfloat16], ids=["fp16-scales", "bf16-scales"])
@pytest.mark.parametrize("block_k", [16, 32, 64])
@pytest.mark.parametrize("group", [32, 64])
def test_the_loader_dequantizes_every_value_exactly(group, block_k, scale_dtype, into):
    # Into float32 the values are exact; into the scales' 16-bit dtype (the forward's tiles where the scales are in
    # the activations' dtype: 16-bit arithmetic) the exact values rounded once
    ROWS, K = 16, 192  # K not a multiple of the 128 block below: the last step runs past the row, masked
    q = torch.randint(-128, 128, (ROWS, K), dtype=torch.int8)
    q[0, :4] = torch.tensor([-128, -1, 0, 127], dtype=torch.int8)
    scale = ((torch.rand(ROWS, K // group) + 0.01) * torch.randn(ROWS, K // group).sign()).to(scale_dtype)
    scale[1, 0] = 3.0e4 if scale_dtype == torch.float16 else 1.0e37  # (q * scale past the 16-bit range: inf, as the
    scale[2, 0] = 0.0                                                # float32 product cast to it)
    if not interpreter_computes_wrong(scale_dtype):  # (the interpreter reads bf16 subnormals as 0)
        scale[3, 0] = -torch.finfo(scale_dtype).smallest_normal / 8  # (a subnormal scale; with q = 0, -0)
    want = int8.dequantize_int8(q, scale, group, torch.float32)
    out_dtype = torch.float32 if into == "float32" else scale_dtype
    if interpreter_computes_wrong(out_dtype):
        pytest.skip(BF16_UNDER_THE_INTERPRETER)
    width = -(-K // block_k) * block_k
    out = torch.full((ROWS, width), float("nan"), device=DEVICE, dtype=out_dtype)
    qd, sd = q.to(DEVICE), scale.to(DEVICE)
    _loader_kernel[(1,)](qd, sd, out, K, qd.stride(0), sd.stride(0), out.stride(0), ROWS, block_k, group)
    bits = torch.int32 if out_dtype == torch.float32 else torch.int16  # (bit for bit: -0 is not 0)
    assert torch.equal(out.cpu().view(bits), torch.nn.functional.pad(want, (0, width - K)).to(out_dtype).view(bits))


# ---------------------------------------------------------------------------------------------
# Whole forwards (interpreter: fp32 and fp16; the GPU: bf16 too)
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("path", ["fused", "two_stage", "wide"])
@pytest.mark.parametrize("group", GROUPS)
def test_forward_matches_the_dequantized_reference(group, path):
    H, I = ((100, 72) if group is None else (3 * group, 2 * group))  # per channel: H, I not multiples of 16
    M, E, topk = 11, 5, 3  # E not a power of two
    x, prepared, tw, ti = make_int8_problem(M, E, H, I, topk, group, torch.float32, seed=1)
    out = fused_moe(x, prepared, None, tw, ti, config=CONFIGS[path], out=poisoned(M, H, torch.float32))
    check(out, x, prepared, tw, ti)


@pytest.mark.parametrize("topk", [1, 8])
def test_top_k_extremes_in_fp16_with_the_picked_config(topk):
    M, E, H, I = 9, 10, 96, 160
    check_every_path(*make_int8_problem(M, E, H, I, topk, None, torch.float16, seed=2))


@pytest.mark.parametrize("path", ["fused", "two_stage"])
def test_biases_interleaved_rows_clamped_swiglu_and_expert_map(path):
    M, E, H, I, topk = 13, 5, 96, 64, 4
    x, prepared, tw, ti = make_int8_problem(M, E, H, I, topk, 32, torch.float16, seed=3, interleaved=True,
                                            biases=True)
    ti = (ti * 2 + 1).to(torch.int32)  # routed among 2E + 1 experts: the even ones are this rank's
    expert_map = torch.full((2 * E + 1,), -1, dtype=torch.int32, device=DEVICE)
    expert_map[1::2] = torch.arange(E, dtype=torch.int32, device=DEVICE)
    act = dict(activation="swiglu_oai", swiglu_alpha=1.702, swiglu_limit=7.0)
    out = fused_moe(x, prepared, None, tw, ti, expert_map=expert_map, path=path, out=poisoned(M, H, torch.float16),
                    **act)
    check(out, x, prepared, tw, ti, expert_map=expert_map, **act)


@pytest.mark.parametrize("path", ["fused", "two_stage"])
def test_lora_and_deterministic_mode(path):
    M, E, H, I, topk = 10, 4, 64, 96, 2
    x, prepared, tw, ti = make_int8_problem(M, E, H, I, topk, None, torch.float32, seed=4)
    lora = make_lora(3, E, H, I, 8, torch.float32, seed=4)
    ids = make_token_lora_ids(M, 3, seed=4)
    out = fused_moe(x, prepared, None, tw, ti, lora=lora, token_lora_ids=ids, config=CONFIGS[path],
                    out=poisoned(M, H, torch.float32))
    check(out, x, prepared, tw, ti, lora=lora, token_lora_ids=ids)
    first = fused_moe(x, prepared, None, tw, ti, deterministic=True)
    check(first, x, prepared, tw, ti)
    assert torch.equal(fused_moe(x, prepared, None, tw, ti, deterministic=True), first)


def test_one_token_both_ways():
    # One token eagerly runs the one-launch decode; under the sort path too.
    x, prepared, tw, ti = make_int8_problem(1, 6, 64, 64, 2, None, torch.float16, seed=5)
    check(fused_moe(x, prepared, None, tw, ti), x, prepared, tw, ti)
    with fmoe2.sort_path_only():
        check(fused_moe(x, prepared, None, tw, ti), x, prepared, tw, ti)


# ---------------------------------------------------------------------------------------------
# The GPU: bf16, the real models' sizes, eager repeated and graph-replayed
# ---------------------------------------------------------------------------------------------

def _random_int8(E, H, I, group, seed):
    """Prepared int8 weights of random values and scales, made on the GPU (no float copy of a layer: DeepSeek-V3's
    would take 45 GB): scales keep each row's dot products O(1)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def weight(N, K):
        q = torch.randint(-128, 128, (E, N, K), dtype=torch.int8, device="cuda", generator=gen)
        shape = (E, N) if group is None else (E, N, K // group)
        scale = (torch.rand(shape, device="cuda", generator=gen) + 0.5) / (80 * K ** 0.5)
        return q, scale.to(torch.bfloat16)

    (q1, s1), (q2, s2) = weight(2 * I, H), weight(H, I)
    return prepare_weights(q1, q2, w1_scale=s1, w2_scale=s2)


# (E, H, I, topk) and the group: per channel, or groups of 128 where H and I take them (gpt-oss's 2880: 64)
REAL = {"gpt-oss-20b": ((32, 2880, 2880, 4), 64), "deepseek-v3": ((256, 7168, 2048, 8), 128),
        "qwen3-235b-a22b": ((128, 4096, 1536, 8), None), "mixtral-8x7b": ((8, 4096, 14336, 2), None)}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("shape", sorted(REAL))
def test_real_model_sizes_in_bf16_eager_repeated_and_graph_replayed(shape):
    # One layer per shape for every M (DeepSeek-V3's takes 11 GB in int8; the reference dequantizes one expert at
    # a time); M = 1, 16, 128 and 4096, each on every path, repeated, then replayed from a CUDA graph.
    (E, H, I, topk), group = REAL[shape]
    prepared = _random_int8(E, H, I, group, seed=E)
    for M in (1, 16, 128, 4096):
        gen = torch.Generator(device="cuda").manual_seed(M)
        x = torch.randn(M, H, device="cuda", generator=gen).to(torch.bfloat16)
        tw, ti = torch.topk(torch.randn(M, E, device="cuda", generator=gen).softmax(-1), topk, dim=-1)
        ti = ti.to(torch.int32)
        # (the reference dequantizes the experts hit, one at a time)
        check_repeated_and_graph_replayed(x, prepared, tw, ti, fmoe2.fused_moe_reference(x, prepared, None, tw, ti))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("path", ["fused", "two_stage"])
def test_lora_expert_map_and_deterministic_mode_in_bf16(path):
    check_lora_expert_map_and_deterministic(_random_int8(*LORA_SIZES[1:4], 64, seed=11), path)
