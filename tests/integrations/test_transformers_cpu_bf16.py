"""The "fmoe2" experts backend on the CPU never gives a wrong result: where fmoe2.fused_moe would refuse the call
(bf16 under the Triton interpreter, whose bf16 math is wrong: triton-lang/triton#11584; CPU tensors without the
interpreter), the backend runs transformers' own experts computation instead, with one warning per process and
reason, and the logits are those of transformers' eager experts. Tiny random Qwen3-MoE and gpt-oss models
(tiny_models.py, no downloads), in bf16, 3 layers, two forwards."""
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")

import fmoe2.integrations.transformers as backend  # noqa: E402  (registers "fmoe2")
from fmoe2._validation import interpreter_enabled  # noqa: E402
from helpers import rel_error  # noqa: E402
from tiny_models import available, build  # noqa: E402

INPUT_IDS = torch.tensor([[3, 17, 99, 5, 42, 8, 120], [7, 7, 64, 1, 88, 15, 2]])
LAYERS = 3
# fmoe2's bf16 forward under the interpreter was 1.39 (qwen3_moe, gpt_oss) from eager's logits before the fallback;
# transformers' grouped_mm and eager experts agree to the bit on the CPU (torch 2.13): any fallback gives eager's.
BF16_TOL = 1e-2
MODELS = [pytest.param(n, marks=pytest.mark.skipif(not available(n), reason=f"{n} is not in this transformers"))
          for n in ("qwen3_moe", "gpt_oss")]


def _two_forwards(model, impl):
    """Logits of two forwards of ``INPUT_IDS`` and the fmoe2 backend's warnings across both."""
    model.set_experts_implementation(impl)
    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("always")  # every warnings.warn call shows: the backend must dedup them itself
        logits = [model(INPUT_IDS).logits.float() for _ in range(2)]
    return logits, [str(w.message) for w in caught if "fmoe2 experts backend" in str(w.message)]


@pytest.mark.skipif(not interpreter_enabled(), reason="the Triton interpreter (CPU) case")
@pytest.mark.parametrize("model_type", MODELS)
def test_bf16_under_the_interpreter_falls_back_to_transformers_with_one_warning(model_type):
    model = build(model_type, dtype=torch.bfloat16, layers=LAYERS)
    (eager, _), _ = _two_forwards(model, "eager")
    backend._warned.clear()
    (first, second), messages = _two_forwards(model, "fmoe2")
    assert len(messages) == 1, messages  # not one per layer, nor per forward
    assert "bf16" in messages[0] and "Triton interpreter" in messages[0] and "float16 or float32" in messages[0]
    assert rel_error(first, eager) <= BF16_TOL and rel_error(second, eager) <= BF16_TOL, (
        rel_error(first, eager), rel_error(second, eager))


@pytest.mark.parametrize("model_type", MODELS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_a_cpu_model_without_the_interpreter_falls_back_with_one_warning(model_type, dtype, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # what a process without the interpreter sees
    assert not interpreter_enabled()
    model = build(model_type, dtype=dtype, layers=LAYERS)
    (eager, _), _ = _two_forwards(model, "eager")
    backend._warned.clear()
    (first, second), messages = _two_forwards(model, "fmoe2")
    assert len(messages) == 1 and "on the CPU" in messages[0], messages
    assert rel_error(first, eager) <= BF16_TOL and rel_error(second, eager) <= BF16_TOL
