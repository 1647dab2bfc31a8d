"""The fp8-scaling benchmark's kernel (fmoe2/bench/fp8_scaling.py), under the interpreter or on the GPU: each
scaling variant against the float32 product of its own dequantized operands (fmoe2.fp8's quantization), and the
report."""
import pytest
import torch
from helpers import DEVICE

from fmoe2.bench.problems import rel_err
from fmoe2.bench.fp8_scaling import VARIANTS, markdown, operands, scaled_gemm


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_each_scaling_matches_its_reference(name):
    gen = torch.Generator(device=DEVICE).manual_seed(1)
    (a, b, sa, sb), ref = operands(40, 48, 256, DEVICE, torch.float8_e4m3fn, gen)[name]
    if name == "bf16" and DEVICE == "cpu":  # (bf16 math is wrong under the interpreter: fp16 there)
        a, b = a.half(), b.half()
    out = scaled_gemm(a, b, VARIANTS[name], sa, sb, tile=(16, 16, 128, 4, 2))
    assert rel_err(out, ref) < 1e-2  # the bf16 output's rounding
    if name != "bf16":  # the unscaled product is far off: the scales were applied
        assert rel_err(scaled_gemm(a, b, VARIANTS["bf16"], None, None, tile=(16, 16, 128, 4, 2)), ref) > 0.5


def test_k_must_be_whole_steps():
    t = torch.randn(16, 256, device=DEVICE).half()
    with pytest.raises(ValueError, match="BLOCK_K"):
        scaled_gemm(t, t, 0, tile=(16, 16, 96, 4, 2))


def test_report():
    row = dict(M=1, N=2, K=128, variants={"bf16": dict(us=2.0, tflops=1.0), "fp8 epilogue": dict(us=1.0, tflops=2.0)})
    text = markdown(dict(device="GPU", date="d", torch="t", triton="tr", command="c", results=[row]))
    assert "| 1 x 2 x 128 | 1 (2.0) | - | 2 (1.0) | - | - |" in text
