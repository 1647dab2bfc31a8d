"""The code-generation report compiles what the forward launches (issue 57): for every weight format and both paths,
the launches ``fmoe2.codegen.codegen_launches`` builds from meta tensors equal, launch by launch (entry kernel, grid,
constexprs, launch options, and the dtype and shape of every tensor argument), those a forward of the same problem
records at ``LaunchSpec.launch``; and ``fmoe2.get_config`` answers the config that forward ran. Under the interpreter
on the CPU (float16), compiled on a GPU (bf16)."""
import pytest
import torch

import fmoe2
from fmoe2 import int8, prepare_weights, quant4, quantize_fp8_weights
from fmoe2.codegen import codegen_launches
from fmoe2.gemm.config import device_config_name
from fmoe2.gemm.fused_moe import clear_plans
from fmoe2.launch import LaunchSpec
from fmoe2.target import target_of
from helpers import DEVICE, make_problem

DTYPE = torch.bfloat16 if DEVICE == "cuda" else torch.float16
M, E, H, I, TOPK = 5, 6, 64, 96, 2  # groups of 32 for int4 and int8 (the report's largest that divides H and I)
FORMATS = ["16bit", "fp8", "mxfp4", "int4", "int8"]


def prepared_weights(fmt: str):
    _, w1, w2, _, _ = make_problem(M, E, H, I, TOPK, torch.float32, device="cpu")
    if fmt == "16bit":
        return prepare_weights(w1.to(DEVICE, DTYPE), w2.to(DEVICE, DTYPE))
    if fmt == "fp8":
        (q1, s1), (q2, s2) = (quantize_fp8_weights(w.to(DEVICE), "block", (128, 128)) for w in (w1, w2))
        return prepare_weights(q1, q2, w1_scale=s1, w2_scale=s2, block_shape=(128, 128))
    zeros = {}
    if fmt == "mxfp4":
        (p1, s1), (p2, s2) = quant4.quantize_mxfp4(w1), quant4.quantize_mxfp4(w2)
    elif fmt == "int8":
        # (scales in the activations' dtype, as the code-generation report builds them)
        (p1, s1), (p2, s2) = int8.quantize_int8(w1.to(DTYPE), 32), int8.quantize_int8(w2.to(DTYPE), 32)
    else:
        (p1, s1, z1), (p2, s2, z2) = quant4.quantize_int4(w1.to(DTYPE), 32), quant4.quantize_int4(w2.to(DTYPE), 32)
        zeros = dict(w1_zero=z1.to(DEVICE), w2_zero=z2.to(DEVICE))
    return prepare_weights(p1.to(DEVICE), p2.to(DEVICE), w1_scale=s1.to(DEVICE), w2_scale=s2.to(DEVICE),
                           weight_format=fmt, **zeros)


def _described_value(v):
    """A launch argument compared between the report and a forward: a tensor by dtype and shape, a bundle (a tuple
    argument) element by element, anything else as it is (sizes and strides)."""
    if isinstance(v, torch.Tensor):
        return v.dtype, tuple(v.shape)
    if isinstance(v, tuple):
        return type(v).__name__, tuple(_described_value(e) for e in v)
    return v


def described(spec: LaunchSpec):
    tensors = {k: _described_value(v) for k, v in spec.args.items() if isinstance(v, (torch.Tensor, tuple))}
    return spec.name, spec.kernel.fn.__name__, tuple(spec.grid), spec.constexprs, spec.options, tensors


@pytest.mark.parametrize("path", ["fused", "two_stage"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_the_report_builds_the_launches_the_forward_runs(fmt, path, monkeypatch):
    target = target_of(DEVICE)
    if fmt == "fp8" and torch.float8_e4m3fn not in target.fp8_dtypes:
        pytest.skip("no fp8 matrix instructions here")
    prepared = prepared_weights(fmt)
    x, _, _, tw, ti = make_problem(M, E, H, I, TOPK, DTYPE)
    recorded, launch = [], LaunchSpec.launch

    def recording(spec):
        recorded.append(spec)
        return launch(spec)

    clear_plans()  # (a fresh plan: its first run passes every launch through LaunchSpec.launch)
    monkeypatch.setattr(LaunchSpec, "launch", recording)
    fmoe2.fused_moe(x, prepared, None, tw, ti.int(), path=path)
    monkeypatch.setattr(LaunchSpec, "launch", launch)
    reported = codegen_launches(target, (E, H, I, TOPK), M, DTYPE, fp8="block" if fmt == "fp8" else "",
                                weights=fmt if fmt in ("mxfp4", "int4", "int8") else "",
                                tuned_for=device_config_name(x.device), path=path)
    if path == "fused":  # the report's first forward is the fused path's, sort included
        ours = [r.spec for r in reported if r.config is None or r.config.path == "fused"]
    else:  # the report keeps the fused path's sort: the two-stage forward's launches after its sort
        ours = [r.spec for r in reported if r.config is not None and r.config.path == "two_stage"]
        recorded = [s for s in recorded if not s.name.startswith("sort")]
    assert [described(s) for s in ours] == [described(s) for s in recorded]
    gemm = next(r.config for r in reported if r.config is not None and r.config.path == path)
    assert gemm == fmoe2.get_config(M, E, H, I, TOPK, DTYPE, device=x.device, path=path, weight_format=fmt)
