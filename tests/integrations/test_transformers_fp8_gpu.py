"""A tiny random fp8 model loaded as fp8 MoE checkpoints load in transformers, its experts run by fmoe2 (GPU:
skipped without one with fp8 matrix instructions, or without ``accelerate``, which transformers' fp8 loading needs).

Two ways in, both through ``from_pretrained`` and transformers' fine-grained fp8 quantizer: a bf16 checkpoint
quantized on load (``FineGrainedFP8Config``: e4m3 experts with one float32 scale per 128 x 128 block), and an fp8
checkpoint laid out as DeepSeek-V3's and the Qwen3 FP8 releases are (each expert's e4m3 weights with their
``weight_scale_inv`` beside them, a ``quantization_config`` in ``config.json``), read as pre-quantized. Only the
experts are quantized: transformers' own fp8 linear layers need a kernel downloaded from its hub at run time, and
fmoe2 is the experts' backend, not theirs.

Checked: the experts are transformers' ``FP8Experts`` with e4m3 weights and float32 block scales, fmoe2 computes every
experts call of a prefill and of the decode steps (no fallback) within 1e-2 of fmoe2's torch reference with the same
quantization, and within the fp8 error of the gated MLP on its dequantized weights; greedy decoding runs; the
fp8 checkpoint's experts hold the stored weights and scales bit for bit.
"""
import json
import os
import re
import shutil

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate", reason="transformers' fp8 quantizer needs accelerate")

import fmoe2  # noqa: E402
import fmoe2.integrations.transformers as backend  # noqa: E402  (registers "fmoe2")
from fmoe2.fp8 import dequantize_weights, weight_scale_view  # noqa: E402
from helpers import rel_error  # noqa: E402
from tiny_models import build, experts_modules  # noqa: E402

pytestmark = pytest.mark.gpu
SIZES = dict(hidden_size=256, moe_intermediate_size=128)  # whole 128 x 128 blocks, which transformers quantizes
BLOCK = (128, 128)
NOT_EXPERTS = [r".*self_attn", r".*mlp\.gate", "lm_head"]  # transformers' fp8 linear layers need its hub kernel
SAME_QUANT_TOL = 1e-2
DEQUANTIZED_TOL = 0.1  # fp8 activations against none (the CPU test of the experts module uses the same bound)


def _fp8_gpu():
    return torch.cuda.is_available() and torch.float8_e4m3fn in backend.target_of(torch.device("cuda")).fp8_dtypes


def _load(path, quantize: bool):
    from transformers import AutoModelForCausalLM, FineGrainedFP8Config

    options = dict(quantization_config=FineGrainedFP8Config(modules_to_not_convert=NOT_EXPERTS)) if quantize else {}
    model = AutoModelForCausalLM.from_pretrained(path, device_map="cuda", dtype=torch.bfloat16,
                                                 experts_implementation="fmoe2", **options)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model.eval()


def _write_fp8_checkpoint(bf16, fp8):
    """``bf16``'s checkpoint with its experts stored as fp8 MoE checkpoints store them (DeepSeek-V3/R1, the Qwen3 FP8
    releases): each expert's gate/up/down weight in e4m3 beside its float32 ``weight_scale_inv`` ``[cdiv(N, 128),
    cdiv(K, 128)]``, and the quantization config in ``config.json``."""
    from safetensors.torch import load_file, save_file

    tensors = {}
    for key, value in load_file(os.path.join(bf16, "model.safetensors")).items():
        if re.search(r"\.experts\.\d+\.(gate|up|down)_proj\.weight$", key):
            q, scale = fmoe2.quantize_fp8_weights(value[None].float(), "block", BLOCK)
            tensors[key], tensors[key.removesuffix("weight") + "weight_scale_inv"] = q[0], scale[0]
        else:
            tensors[key] = value
    save_file(tensors, os.path.join(fp8, "model.safetensors"), metadata={"format": "pt"})
    for name in os.listdir(bf16):
        if name != "model.safetensors":
            shutil.copy(os.path.join(bf16, name), fp8)
    with open(os.path.join(fp8, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = dict(quant_method="fp8", activation_scheme="dynamic",
                                         weight_block_size=list(BLOCK), modules_to_not_convert=NOT_EXPERTS)
    with open(os.path.join(fp8, "config.json"), "w") as f:
        json.dump(config, f)
    return tensors


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """(bf16 checkpoint, fp8 checkpoint of the same model, the fp8 checkpoint's tensors)."""
    if not _fp8_gpu():
        pytest.skip("needs a GPU with fp8 matrix instructions")
    bf16, fp8 = tmp_path_factory.mktemp("qwen3_moe_bf16"), tmp_path_factory.mktemp("qwen3_moe_fp8")
    build("qwen3_moe", dtype=torch.bfloat16, sizes=SIZES).save_pretrained(bf16)
    return bf16, fp8, _write_fp8_checkpoint(bf16, fp8)


def _prompt(model):
    gen = torch.Generator(device="cpu").manual_seed(3)
    return torch.randint(0, model.config.vocab_size, (3, 10), generator=gen).to(model.device)


def _check_experts_calls(model, monkeypatch):
    """Every experts call of a prefill and 3 greedy decode steps: each one into fmoe2, each recomputed by the
    references."""
    from transformers.integrations.finegrained_fp8 import FP8Experts

    modules = experts_modules(model)
    assert modules and all(isinstance(m, FP8Experts) for m in modules), [type(m) for m in modules]
    into_fmoe2 = []
    inner = backend.fused_moe
    monkeypatch.setattr(backend, "fused_moe", lambda *args, **kwargs: into_fmoe2.append(1) or inner(*args, **kwargs))
    calls = []
    hooks = [m.register_forward_hook(lambda module, args, out: calls.append((module, args, out))) for m in modules]
    try:
        with torch.no_grad():
            tokens = model.generate(_prompt(model), max_new_tokens=4, do_sample=False)
    finally:
        for hook in hooks:
            hook.remove()
    assert tokens.shape == (3, 14)
    assert len(calls) == 4 * len(modules) and len(into_fmoe2) == len(calls), (len(calls), len(into_fmoe2))
    with torch.no_grad():  # (as the calls ran: generate runs without gradients)
        _check_calls(calls)


def _check_calls(calls):
    for module, (hidden, ids, weights), out in calls:
        assert module.gate_up_proj.dtype == torch.float8_e4m3fn and module.gate_up_proj_scale_inv.dtype == torch.float32
        assert backend.fp8_call_fallback_reason(module, hidden) == ""
        E, two_i, H = module.gate_up_proj.shape
        scales = dict(w1_scale=module.gate_up_proj_scale_inv, w2_scale=module.down_proj_scale_inv, block_shape=BLOCK)
        same = fmoe2.fused_moe_reference(hidden, module.gate_up_proj, module.down_proj, weights, ids, **scales)
        assert out.dtype == hidden.dtype and rel_error(out, same) <= SAME_QUANT_TOL, rel_error(out, same)
        w1 = dequantize_weights(module.gate_up_proj,
                                *weight_scale_view("s", scales["w1_scale"], E, two_i, H, BLOCK)[:3])
        w2 = dequantize_weights(module.down_proj,
                                *weight_scale_view("s", scales["w2_scale"], E, H, two_i // 2, BLOCK)[:3])
        dequantized = fmoe2.fused_moe_reference(hidden.float(), w1, w2, weights, ids)
        assert rel_error(out, dequantized) <= DEQUANTIZED_TOL, rel_error(out, dequantized)


def test_a_bf16_checkpoint_quantized_on_load_runs_its_fp8_experts_on_fmoe2(checkpoints, monkeypatch):
    bf16, _, _ = checkpoints
    _check_experts_calls(_load(bf16, quantize=True), monkeypatch)


def test_an_fp8_checkpoint_loads_its_experts_as_stored_and_runs_them_on_fmoe2(checkpoints, monkeypatch):
    _, fp8, stored = checkpoints
    model = _load(fp8, quantize=False)
    for layer, module in enumerate(experts_modules(model)):
        for fused, parts in (("gate_up_proj", ("gate_proj", "up_proj")), ("down_proj", ("down_proj",))):
            for suffix in ("weight", "weight_scale_inv"):
                name = fused + ("_scale_inv" if suffix == "weight_scale_inv" else "")
                expected = torch.stack([torch.cat([stored[f"model.layers.{layer}.mlp.experts.{e}.{part}.{suffix}"]
                                                   for part in parts]) for e in range(module.num_experts)])
                got = getattr(module, name)
                assert got.dtype == expected.dtype and got.shape == expected.shape, (name, got.shape, expected.shape)
                assert torch.equal(got.cpu().view(torch.uint8), expected.view(torch.uint8)), name
    _check_experts_calls(model, monkeypatch)
