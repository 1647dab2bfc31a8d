"""The weight formats' registry (fmoe2/formats.py): each format is stated once, when weights are prepared, and read
from the registry everywhere else; a format that cannot be told from a dtype is never guessed."""
from dataclasses import replace

import pytest
import torch

import fmoe2
from fmoe2 import fused_moe, int8, prepare_weights, quant4, quantize_fp8_weights
from fmoe2.formats import WEIGHT_FORMATS, format_of_prepared, weight_format
from fmoe2.gemm.config import fit_packed_config
from fmoe2.gemm.fused_moe import plan_of
from fmoe2.gemm.launches import FORMAT_ENTRIES
from fmoe2.target import target_of
from helpers import DEVICE, make_problem, rel_error

E, H, I = 2, 64, 32


def _prepared(name, device="cpu", dtype=torch.float32):
    """Small prepared weights of format ``name`` (quantized on the CPU, prepared on ``device``; 16-bit ones in
    ``dtype``)."""
    w1, w2 = torch.randn(E, 2 * I, H) / 8, torch.randn(E, H, I) / 6
    prepare = lambda *w, **k: prepare_weights(*(t.to(device) for t in w), **{  # noqa: E731
        n: v.to(device) if isinstance(v, torch.Tensor) else v for n, v in k.items()})
    if name == "16bit":
        return prepare(w1.to(dtype), w2.to(dtype))
    if name == "fp8":
        (q1, s1), (q2, s2) = quantize_fp8_weights(w1, "channel"), quantize_fp8_weights(w2, "channel")
        return prepare(q1, q2, w1_scale=s1, w2_scale=s2)
    if name == "mxfp4":
        (p1, s1), (p2, s2) = quant4.quantize_mxfp4(w1), quant4.quantize_mxfp4(w2)
        return prepare(p1, p2, w1_scale=s1, w2_scale=s2, weight_format="mxfp4")
    if name == "int4":
        (p1, s1, z1), (p2, s2, z2) = quant4.quantize_int4(w1.half(), 32), quant4.quantize_int4(w2.half(), 32)
        return prepare(p1, p2, w1_scale=s1, w2_scale=s2, w1_zero=z1, w2_zero=z2, weight_format="int4")
    (q1, s1), (q2, s2) = int8.quantize_int8(w1), int8.quantize_int8(w2)
    return prepare(q1, q2, w1_scale=s1, w2_scale=s2)


def test_the_registry_describes_every_format_consistently():
    assert set(WEIGHT_FORMATS) == {"16bit", "fp8", "mxfp4", "int4", "int8"}
    for name, fmt in WEIGHT_FORMATS.items():
        assert fmt.name == name and fmt.weight_dtypes and fmt.description
        # A format changes the activations (its own entries) or is dequantized in the 16-bit loader, not both
        assert not (fmt.quantizes_activations and fmt.weight_only)
        assert (name in FORMAT_ENTRIES) == fmt.quantizes_activations
        if fmt.weight_only:
            assert fmt.groups and fmt.scale_entry in (1, 2) and fmt.kernel_encoding and not fmt.takes_plain_weights
            assert fmt.reason_unsupported("plain weights")
        assert fmt.element_bits * fmt.values_per_element in (8, 16)
    assert weight_format("int8") is WEIGHT_FORMATS["int8"]
    with pytest.raises(ValueError, match="weight_format must be one of"):
        weight_format("int3")


@pytest.mark.parametrize("name", sorted(WEIGHT_FORMATS))
def test_prepared_weights_state_their_format_and_the_op_path_reads_it_back(name):
    prepared = _prepared(name)
    assert prepared.weight_format == name and prepared.format is WEIGHT_FORMATS[name]
    # Rebuilt from its tensors alone (as the torch.library op does): the same format
    rebuilt = fmoe2.PreparedMoEWeights.from_prepared(prepared.w13, prepared.w2, H, I, prepared.b13, prepared.b2,
                                                     prepared.s13, prepared.s2, prepared.scale_block)
    assert rebuilt.weight_format == name and format_of_prepared(prepared.w13, prepared.s13).name == name
    if WEIGHT_FORMATS[name].weight_only:  # the reference's dequantization knows every weight-only format
        w13, w2 = prepared.dequantized()
        assert w13.dtype == torch.float32 and torch.isfinite(w13).all() and torch.isfinite(w2).all()


@pytest.mark.parametrize("name", ["mxfp4", "int4", "int8"])
def test_every_weight_only_format_runs_both_paths(name):
    # (the interpreter in float32; a GPU in bf16)
    prepared = _prepared(name, DEVICE)
    dtype = torch.float32 if DEVICE == "cpu" else torch.bfloat16
    x, _, _, tw, ti = make_problem(5, E, H, I, 2, dtype, device=DEVICE, seed=3)
    ref = fmoe2.fused_moe_reference(x.double(), prepared, None, tw, ti)
    for path in ("fused", "two_stage"):
        out = fused_moe(x, prepared, None, tw, ti, path=path)
        assert rel_error(out, ref) < (1e-5 if DEVICE == "cpu" else 2.5e-2), (name, path)


def test_mxfp4_scales_cast_to_half_are_never_read_as_int4_scales():
    # Issue 57: e8m0 scales passed as .half() were taken as int4 group scales (all rows non-finite, no error).
    (p1, s1), (p2, s2) = quant4.quantize_mxfp4(torch.randn(E, 2 * I, H)), quant4.quantize_mxfp4(torch.randn(E, H, I))
    with pytest.raises(ValueError, match="say which with weight_format="):
        prepare_weights(p1, p2, w1_scale=s1.half(), w2_scale=s2.half())
    with pytest.raises(TypeError, match=r"w1_scale must have dtype"):
        prepare_weights(p1, p2, w1_scale=s1.half(), w2_scale=s2.half(), weight_format="mxfp4")
    with pytest.raises(TypeError, match="weight_format='int8' must have a dtype"):
        prepare_weights(p1, p2, w1_scale=s1, w2_scale=s2, weight_format="int8")
    with pytest.raises(ValueError, match="weight_format must be one of"):
        prepare_weights(p1, p2, w1_scale=s1, w2_scale=s2, weight_format="fp4")


def test_hand_built_prepared_weights_are_checked_against_their_stated_format():
    mx = _prepared("mxfp4")
    with pytest.raises(ValueError, match=r"int4 weights' scales are \[E, 2\*I_pad, K_pad // group, 2\]"):
        replace(mx, s13=mx.s13.half(), s2=mx.s2.half(), weight_format="int4")
    with pytest.raises(ValueError, match="mxfp4 weights' scales are"):
        replace(mx, s13=mx.s13.half(), s2=mx.s2.half())
    with pytest.raises(ValueError, match="prepared int8 weights are stored in"):
        replace(mx, weight_format="int8")
    with pytest.raises(ValueError, match="16bit weights take no scales"):
        replace(_prepared("16bit"), s13=mx.s13)
    with pytest.raises(ValueError, match="int4 takes"):
        replace(_prepared("int4"), scale_block=(1, 48))


@pytest.mark.parametrize("path", ["auto", "fused", "two_stage"])
@pytest.mark.parametrize("name", sorted(WEIGHT_FORMATS))
def test_get_config_answers_what_the_forward_of_each_format_runs(name, path):
    # The format enters resolve_config as data (ConfigMode.weight_format): get_config with the weights' format gives
    # the config the forward's plan holds, weight-only fits included (no fit applied by the caller).
    dtype = torch.float32 if DEVICE == "cpu" else torch.bfloat16
    prepared = _prepared(name, DEVICE, dtype)
    x, _, _, tw, ti = make_problem(5, E, H, I, 2, dtype, device=DEVICE, seed=4)
    fmoe2.fused_moe(x, prepared, None, tw, ti, path=path)
    ran = plan_of(x, prepared, None, tw, ti, path=path).config
    asked = fmoe2.get_config(5, E, H, I, 2, dtype, path=path, weight_format=prepared.weight_format,
                             device=x.device if DEVICE != "cpu" else None)
    assert asked == ran
    if WEIGHT_FORMATS[name].weight_only:  # (the 16-bit pick, fitted: a different config where the fit bites)
        assert asked == fit_packed_config(fmoe2.get_config(5, E, H, I, 2, dtype, path=path,
                                                           device=x.device if DEVICE != "cpu" else None),
                                          target_of(x.device).warp_size, weight_format=name)
