"""Bad input at the weight formats' edges gets a clear error or a right answer, never a silently wrong one (issue 57,
item 5: each of these was silently wrong or obscure on 98a32ee)."""
from dataclasses import replace

import pytest
import torch

import fmoe2
from fmoe2 import fused_moe, prepare_weights, quant4, quantize_fp8_weights
from fmoe2.fp8 import dequantize_weights
from helpers import DEVICE, make_problem


def test_gate_up_interleaved_takes_a_bool_only():
    # "no" is truthy: it was read as True (relative error 1.42 against the concatenated reference)
    x, w1, w2, tw, ti = make_problem(4, 3, 32, 16, 2, torch.float16)
    with pytest.raises(TypeError, match="gate_up_interleaved must be a bool.*'no'"):
        fused_moe(x, w1, w2, tw, ti, gate_up_interleaved="no")
    with pytest.raises(TypeError, match="gate_up_interleaved must be a bool"):
        prepare_weights(w1, w2, gate_up_interleaved=1)


@pytest.mark.parametrize("pad_to", [64.0, "64", None, True, 0])
def test_pad_to_is_named_when_it_is_no_positive_int(pad_to):
    _, w1, w2, _, _ = make_problem(4, 3, 32, 16, 2, torch.float16)
    with pytest.raises(ValueError if pad_to == 0 and pad_to is not True else TypeError,
                       match="pad_to must be a positive int"):
        prepare_weights(w1, w2, pad_to=pad_to)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_four_bit_quantizers_refuse_what_their_codes_cannot_hold(bad):
    # A NaN weight gave NaN rows in the 16-bit forward and finite ones in the 4-bit forward (its group's scale and
    # codes finite); quantize_mxfp4 of a group reaching 10 with one NaN clipped the group to 6.
    w = torch.randn(4, 64)
    w[1, 7], w[1, 8] = bad, 10.0
    with pytest.raises(ValueError, match=r"NaN or inf .*index \[1, 7\].*mxfp4"):
        quant4.quantize_mxfp4(w)
    with pytest.raises(ValueError, match="NaN or inf.*int4"):
        quant4.quantize_int4(w.half(), 32)


def _dequantized(q, scale, scheme):
    E, N, K = q.shape
    if scheme == "block":
        return dequantize_weights(q, scale, 128, 128)
    return dequantize_weights(q, scale.reshape(E, N, 1), 1, K) if scheme == "channel" else \
        dequantize_weights(q, scale.reshape(E, 1, 1), N, K)


@pytest.mark.parametrize("scheme", ["block", "channel", "tensor"])
def test_fp8_quantizer_keeps_a_nan_weight_nan_and_its_neighbours_right(scheme):
    # One NaN made its block's scale 1 / 448: the block's other values clipped to +-1 (block), likewise its row or
    # expert. Now the scale comes from the finite values and the NaN stays NaN (e4m3 has no inf: inf becomes NaN too).
    w = torch.randn(2, 256, 256) * 3
    w[0, 5, 5], w[1, 7, 9] = float("nan"), float("inf")
    q, s = quantize_fp8_weights(w, scheme)
    back = _dequantized(q, s, scheme)
    nonfinite = ~torch.isfinite(w)
    assert torch.isnan(back[nonfinite]).all()
    clean = w.clone()
    clean[nonfinite] = 0.0
    expected = _dequantized(*quantize_fp8_weights(clean, scheme), scheme)
    assert torch.equal(back[~nonfinite], expected[~nonfinite])


def test_fp8_block_shape_is_checked_before_quantizing():
    w = torch.randn(1, 128, 128)
    for block in ((0, 128), (128,), (128.0, 128), "128x128"):
        with pytest.raises(ValueError, match="block_shape must be a pair of positive ints"):
            quantize_fp8_weights(w, "block", block)


@pytest.mark.parametrize("packing", ["gptq", "awq"])
def test_checkpoint_packings_name_a_column_count_not_a_multiple_of_eight(packing):
    N, K, group = 12, 64, 32
    scales = torch.ones(K // group, N, dtype=torch.float16)
    qweight = torch.zeros(K // 8, N, dtype=torch.int32) if packing == "gptq" else torch.zeros(K, 1, dtype=torch.int32)
    qzeros = torch.zeros(K // group, 1, dtype=torch.int32)
    convert = quant4.from_gptq if packing == "gptq" else quant4.from_awq
    with pytest.raises(ValueError, match="N = 12.*multiple of 8"):
        convert(qweight, qzeros, scales)


@pytest.mark.skipif(DEVICE != "cuda", reason="the interpreter reads fp8 NaN bytes as finite values (Triton 3.9)")
def test_an_fp8_nan_weight_gives_nan_in_the_rows_that_use_it_on_the_gpu():
    x, w1, w2, tw, ti = make_problem(6, 3, 256, 128, 1, torch.bfloat16)
    w1 = w1.float()
    w1[ti[0, 0], 0, 0] = float("nan")
    q1, s1 = quantize_fp8_weights(w1, "block")
    q2, s2 = quantize_fp8_weights(w2.float(), "block")
    out = fused_moe(x, q1, q2, tw, ti, w1_scale=s1, w2_scale=s2, block_shape=(128, 128))
    uses = (ti[:, 0] == ti[0, 0]).cpu()
    assert torch.isnan(out.float().cpu()[uses]).any(dim=1).all() and torch.isfinite(out.float().cpu()[~uses]).all()


def test_prepared_weights_are_made_by_prepare_weights_not_by_hand():
    # A PreparedMoEWeights built by hand from plain weights (gate rows then up rows) passed every check and computed
    # with the rows read as interleaved: relative error 1.42. Now only prepare_weights makes one, and from_prepared
    # rebuilds one from the tensors prepare_weights made.
    x, w1, w2, tw, ti = make_problem(4, 3, 64, 64, 2, torch.float16)
    with pytest.raises(TypeError, match=r"make it with fmoe2.prepare_weights.*from_prepared"):
        fmoe2.PreparedMoEWeights(w1, w2, 64, 64)
    prepared = prepare_weights(w1, w2)
    rebuilt = fmoe2.PreparedMoEWeights.from_prepared(prepared.w13, prepared.w2, 64, 64)
    assert torch.equal(fused_moe(x, rebuilt, None, tw, ti), fused_moe(x, prepared, None, tw, ti))
    assert replace(prepared, b13=None).w13 is prepared.w13  # (dataclasses.replace keeps working)


def test_fp8_nan_codes_are_refused_under_the_interpreter_and_propagate_on_a_gpu():
    # The interpreter read e4m3fn's NaN 0x7F as 480.0 and e4m3fnuz's 0x80 as -0.0: the forward came out finite where
    # the reference is NaN.
    x, w1, w2, tw, ti = make_problem(4, 3, 64, 64, 2, torch.float16)
    (q1, s1), (q2, s2) = quantize_fp8_weights(w1.float(), "channel"), quantize_fp8_weights(w2.float(), "channel")
    bits = q1.view(torch.uint8).clone()
    bits[int(ti[0, 0]), 3, 5] = 0x7F
    q1 = bits.view(q1.dtype)
    if DEVICE == "cpu":
        with pytest.raises(ValueError, match=r"w1 holds 1 fp8 NaN codes .* interpreter reads"):
            fused_moe(x, q1, q2, tw, ti, w1_scale=s1, w2_scale=s2)
        with pytest.raises(ValueError, match="fp8 NaN codes"):
            fused_moe(x, prepare_weights(q1, q2, w1_scale=s1, w2_scale=s2), None, tw, ti)
    else:
        out = fused_moe(x.bfloat16(), q1, q2, tw, ti, w1_scale=s1, w2_scale=s2)
        assert torch.isnan(out[0]).any()
