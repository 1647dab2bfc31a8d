"""What the host refuses before any kernel runs, where running would give a wrong result or a confusing
error: bf16 under the Triton interpreter (its bf16 math is wrong, triton-lang/triton#11584),
``TRITON_INTERPRET=1`` set after fmoe2 was imported (Triton reads it when the kernels are decorated), and
inputs that require gradients in grad mode (fmoe2 is inference-only: the output would be silently detached)."""
import os
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch

import fmoe2
from fmoe2 import fused_moe, moe_sorting, prepare_weights
from fmoe2._validation import interpreter_enabled
from helpers import DEVICE, assert_matches_reference, make_problem, poisoned

under_interpreter = pytest.mark.skipif(not interpreter_enabled(), reason="the Triton interpreter (CPU) case")
M, E, H, I, TOPK = 5, 4, 32, 16, 2


def _problem(dtype=torch.float16):
    return make_problem(M, E, H, I, TOPK, dtype)


# ---- bf16 under the interpreter ------------------------------------------------------------------------

@under_interpreter
@pytest.mark.parametrize("prepared", [False, True], ids=["plain", "prepared"])
def test_bf16_is_refused_under_the_interpreter_before_any_kernel(prepared):
    x, w1, w2, tw, ti = _problem(torch.bfloat16)
    weights = (prepare_weights(w1, w2), None) if prepared else (w1, w2)  # (pure torch: no kernel, allowed)
    out = poisoned(M, H, torch.bfloat16)
    with pytest.raises(TypeError, match="hidden_states is bfloat16.*Triton interpreter") as error:
        fused_moe(x, *weights, tw, ti, out=out)
    message = str(error.value)
    assert "float16 or float32" in message and "GPU" in message and "11584" in message
    assert torch.isnan(out).all()  # the sort (which zeroes out first) never ran


@under_interpreter
def test_bf16_weights_are_named_under_the_interpreter():
    x, w1, w2, tw, ti = _problem(torch.float32)
    with pytest.raises(TypeError, match="w1 is bfloat16.*Triton interpreter"):
        fused_moe(x, w1.bfloat16(), w2.bfloat16(), tw, ti)
    with pytest.raises(TypeError, match="w1 is bfloat16.*Triton interpreter"):
        fused_moe(x, prepare_weights(w1.bfloat16(), w2.bfloat16()), None, tw, ti)


@under_interpreter
def test_the_registered_op_refuses_bf16_under_the_interpreter():
    x, w1, w2, tw, ti = _problem(torch.bfloat16)
    with pytest.raises(TypeError, match="hidden_states is bfloat16"):
        torch.ops.fmoe2.fused_moe(x, w1, w2, tw, ti, "silu", None, "auto", "", 0, 0, None, None, None, None, None,
                                  0, None, None, None, False, 1.702, None)


@under_interpreter
def test_bf16_routing_weights_and_outputs_stay_allowed_under_the_interpreter():
    # The interpreter loads bf16 exactly (bf16 -> fp32 is a shift) and stores zeros exactly: the sort's bf16
    # inputs and outputs are right, and so is an fp16 forward with bf16 routing weights.
    x, w1, w2, tw, ti = _problem(torch.float16)
    out = fused_moe(x, w1, w2, tw.bfloat16(), ti)
    assert_matches_reference(out, x, w1, w2, tw.bfloat16().float(), ti)
    zeroed = torch.randn(M, H).bfloat16()
    sorted_bf16 = moe_sorting(ti, tw.bfloat16(), E, 16, out=zeroed)
    sorted_fp32 = moe_sorting(ti, tw.bfloat16().float(), E, 16)
    assert torch.equal(sorted_bf16.sorted_weights, sorted_fp32.sorted_weights)
    assert (zeroed == 0).all()


# ---- TRITON_INTERPRET set after import -----------------------------------------------------------------

_AFTER_IMPORT = textwrap.dedent("""
    import os, torch, fmoe2
    os.environ["TRITON_INTERPRET"] = "1"  # too late: fmoe2's kernels were decorated for a GPU
    gen = torch.Generator().manual_seed(0)
    x, w1, w2 = torch.randn(4, 32, dtype=torch.float16), torch.randn(3, 32, 32).half(), torch.randn(3, 32, 16).half()
    tw, ti = torch.topk(torch.randn(4, 3).softmax(-1), 2)
    for name, call in (("fused_moe", lambda: fmoe2.fused_moe(x, w1, w2, tw, ti)),
                       ("moe_sorting", lambda: fmoe2.moe_sorting(ti, tw, 3, 16))):
        try:
            call()
        except Exception as error:
            print(name, type(error).__name__, "|", error)
        else:
            print(name, "ran")
""")


def test_triton_interpret_set_after_import_names_the_fix():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["CUDA_VISIBLE_DEVICES"] = ""  # a machine without a GPU
    run = subprocess.run([sys.executable, "-c", _AFTER_IMPORT], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    lines = dict(line.split(" ", 1) for line in run.stdout.splitlines())
    for name in ("fused_moe", "moe_sorting"):
        assert lines[name].startswith("ValueError |"), (name, lines[name], run.stderr[-2000:])
        assert "active drivers" not in lines[name]
        assert "TRITON_INTERPRET=1 was set after fmoe2 was imported" in lines[name], lines[name]
        assert "before importing fmoe2" in lines[name], lines[name]


# ---- inputs that require gradients ---------------------------------------------------------------------

@pytest.mark.parametrize("argument", ["hidden_states", "w1", "w2", "topk_weights"])
def test_inputs_that_require_grad_are_refused_in_grad_mode(argument):
    x, w1, w2, tw, ti = _problem(torch.float32)
    args = dict(hidden_states=x, w1=w1, w2=w2, topk_weights=tw)
    args[argument] = torch.nn.Parameter(args[argument])
    with pytest.raises(ValueError, match=f"{argument} requires grad.*inference-only.*torch.no_grad"):
        fused_moe(args["hidden_states"], args["w1"], args["w2"], args["topk_weights"], ti)
    for context in (torch.no_grad, torch.inference_mode):  # inference: silent, and right
        with context(), warnings.catch_warnings():
            warnings.simplefilter("error")
            out = fused_moe(args["hidden_states"], args["w1"], args["w2"], args["topk_weights"], ti)
        assert_matches_reference(out, x, w1, w2, tw, ti)


def test_grad_is_refused_on_a_cached_plan_too():
    x, w1, w2, tw, ti = _problem(torch.float32)
    with torch.no_grad():
        fused_moe(x, w1, w2, tw, ti)  # builds and caches the plan of these shapes
    with pytest.raises(ValueError, match="hidden_states requires grad"):
        fused_moe(x.clone().requires_grad_(), w1, w2, tw, ti)
    prepared = prepare_weights(w1, w2)
    with torch.no_grad():
        fused_moe(x, prepared, None, tw, ti)
    prepared.w13.requires_grad_()
    with pytest.raises(ValueError, match="w1.w13 requires grad"):
        fused_moe(x, prepared, None, tw, ti)


def test_grad_mode_without_grad_requiring_inputs_runs():
    x, w1, w2, tw, ti = _problem(torch.float16)
    assert torch.is_grad_enabled()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = fused_moe(x, w1, w2, tw, ti)
    assert not out.requires_grad
    assert_matches_reference(out, x, w1, w2, tw, ti)


def test_the_registered_op_refuses_grad():
    x, w1, w2, tw, ti = _problem(torch.float32)
    with pytest.raises(ValueError, match="hidden_states requires grad"):
        torch.ops.fmoe2.fused_moe(x.requires_grad_(), w1, w2, tw, ti, "silu", None, "auto", "", 0, 0, None, None,
                                  None, None, None, 0, None, None, None, False, 1.702, None)
