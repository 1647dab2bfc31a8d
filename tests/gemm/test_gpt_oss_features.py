"""What gpt-oss (and transformers' other expert layouts) need of fused_moe: gate/up and down biases, the
clamped swiglu_oai activation, interleaved gate/up rows and transposed weights read in place, on the
fused and the two-stage path, against the float64 reference (CPU interpreter in fp16/fp32, or the GPU)."""
from dataclasses import replace

import pytest
import torch

import fmoe2
from fmoe2 import FusedMoEConfig, fused_moe, prepare_weights
from fmoe2.reference import gated_activation
from helpers import DEVICE, assert_matches_reference, make_lora, make_problem, make_token_lora_ids, poisoned, rel_error

# 16-column slices and 16-wide steps: several slices per expert (the down bias must still be added once)
SMALL = FusedMoEConfig(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, BLOCK_H=16)
SMALL_TWO_STAGE = replace(SMALL, path="two_stage", S2_BLOCK_N=16, S2_BLOCK_K=16, S2_SPLIT_K=2)
CONFIGS = {"fused": SMALL, "two_stage": SMALL_TWO_STAGE}


def _biases(E, H, I, dtype, seed):
    gen = torch.Generator(device="cpu").manual_seed(100 + seed)
    return (torch.randn(E, 2 * I, generator=gen).to(DEVICE, dtype), torch.randn(E, H, generator=gen).to(DEVICE, dtype))


def _interleave(w1, b1):
    """gate rows then up rows -> g0, u0, g1, u1, ... (gpt-oss's order)."""
    E, two_i = w1.shape[:2]
    inter = two_i // 2
    w = torch.stack([w1[:, :inter], w1[:, inter:]], dim=2).reshape(w1.shape)
    b = torch.stack([b1[:, :inter], b1[:, inter:]], dim=2).reshape(b1.shape) if b1 is not None else None
    return w, b


@pytest.mark.parametrize("path", ["fused", "two_stage"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("layout", ["plain", "interleaved", "transposed", "transposed_concatenated", "prepared",
                                    "prepared_from_interleaved"])
def test_gpt_oss_expert_layouts_with_biases_and_clamped_swiglu(layout, dtype, path):
    M, E, H, I, topk = 13, 5, 40, 40, 4  # H, I not multiples of 16, E not a power of two, 3 slices of I
    x, w1, w2, tw, ti = make_problem(M, E, H, I, topk, dtype, seed=3)
    x = x * 4  # large activations, so the clamp at 7 acts on some of them
    b1, b2 = _biases(E, H, I, dtype, seed=3)
    act = dict(activation="swiglu_oai", swiglu_alpha=1.702, swiglu_limit=7.0)
    ref = fmoe2.fused_moe_reference(x.double(), w1.double(), w2.double(), tw, ti, w1_bias=b1.double(),
                                    w2_bias=b2.double(), **act)
    unclamped = fmoe2.fused_moe_reference(x.double(), w1.double(), w2.double(), tw, ti, w1_bias=b1.double(),
                                          w2_bias=b2.double(), activation="swiglu_oai")
    assert rel_error(unclamped, ref) > 1e-2  # the clamp matters on these inputs
    w1i, b1i = _interleave(w1, b1)
    if layout == "plain":
        args, extra = (w1, w2), dict(w1_bias=b1, w2_bias=b2)
    elif layout == "interleaved":
        args, extra = (w1i, w2), dict(w1_bias=b1i, w2_bias=b2, gate_up_interleaved=True)
    elif layout == "transposed":  # transformers' gpt-oss: gate_up_proj [E, H, 2I] interleaved, down_proj [E, I, H]
        gate_up_proj = w1i.transpose(1, 2).contiguous()
        down_proj = w2.transpose(1, 2).contiguous()
        args = (gate_up_proj.transpose(1, 2), down_proj.transpose(1, 2))
        extra = dict(w1_bias=b1i, w2_bias=b2, gate_up_interleaved=True)
        assert not args[0].is_contiguous() and not args[1].is_contiguous()
    elif layout == "transposed_concatenated":  # N-contiguous views, gate rows then up rows (aria's order)
        args = (w1.transpose(1, 2).contiguous().transpose(1, 2), w2.transpose(1, 2).contiguous().transpose(1, 2))
        extra = dict(w1_bias=b1, w2_bias=b2)
        assert args[0].stride(1) == 1 and args[1].stride(1) == 1
    elif layout == "prepared":
        args, extra = (prepare_weights(w1, w2, pad_to=8, w1_bias=b1, w2_bias=b2), None), {}
    else:
        args = (prepare_weights(w1i, w2, pad_to=8, w1_bias=b1i, w2_bias=b2, gate_up_interleaved=True), None)
        extra = {}
    out = fused_moe(x, *args, tw, ti, config=CONFIGS[path], out=poisoned(M, H, dtype), **act, **extra)
    tol = {torch.float32: 1e-5, torch.float16: 4e-3}[dtype]
    assert torch.isfinite(out).all()
    assert rel_error(out, ref) <= tol, rel_error(out, ref)


@pytest.mark.parametrize("path", ["fused", "two_stage"])
@pytest.mark.parametrize("which", ["w1_bias", "w2_bias"])
def test_each_bias_alone(which, path):
    M, E, H, I, topk = 9, 3, 32, 40, 2
    x, w1, w2, tw, ti = make_problem(M, E, H, I, topk, torch.float32, seed=5)
    b1, b2 = _biases(E, H, I, torch.float32, seed=5)
    bias = {"w1_bias": b1} if which == "w1_bias" else {"w2_bias": b2}
    out = fused_moe(x, w1, w2, tw, ti, config=CONFIGS[path], out=poisoned(M, H, torch.float32), **bias)
    assert_matches_reference(out, x, w1, w2, tw, ti, **bias)
    assert rel_error(out, fmoe2.fused_moe_reference(x, w1, w2, tw, ti)) > 1e-2  # the bias is there


@pytest.mark.parametrize("path", ["fused", "two_stage"])
def test_down_bias_added_once_per_routed_pair_with_dropped_entries_and_expert_map(path):
    # The down bias is weighted like the rest and added once per kept (token, expert) pair: entries
    # dropped by the expert map (or out of range) add nothing, several slices and K shares add it once.
    M, E, H, I, topk = 11, 4, 32, 72, 3
    x, w1_all, w2_all, tw, ti = make_problem(M, 2 * E, H, I, topk, torch.float32, seed=6)
    ti[0, 0] = 2 * E + 5  # out of range: dropped
    expert_map = torch.full((2 * E,), -1, dtype=torch.int32)
    expert_map[1::2] = torch.arange(E, dtype=torch.int32)
    expert_map = expert_map.to(DEVICE)
    w1, w2 = w1_all[1::2].contiguous(), w2_all[1::2].contiguous()
    b1, b2 = _biases(E, H, I, torch.float32, seed=6)
    out = fused_moe(x, w1, w2, tw, ti, expert_map=expert_map, w1_bias=b1, w2_bias=b2, config=CONFIGS[path],
                    out=poisoned(M, H, torch.float32))
    assert_matches_reference(out, x, w1, w2, tw, ti, expert_map=expert_map, w1_bias=b1, w2_bias=b2)


@pytest.mark.parametrize("path", ["fused", "two_stage", "two_stage_in_stages"])
def test_biases_with_lora(path, monkeypatch):
    import importlib

    limit = {"two_stage": -1, "two_stage_in_stages": float("inf")}.get(path)
    if limit is not None:
        monkeypatch.setattr(importlib.import_module("fmoe2.gemm.config"), "LORA_IN_STAGES_MAX_TOKENS_PER_EXPERT",
                            limit)
    M, E, H, I, topk = 17, 4, 40, 24, 2
    x, w1, w2, tw, ti = make_problem(M, E, H, I, topk, torch.float16, seed=7)
    b1, b2 = _biases(E, H, I, torch.float16, seed=7)
    lora = make_lora(3, E, H, I, 16, torch.float16, seed=7)
    ids = make_token_lora_ids(M, 3, seed=7)
    cfg = CONFIGS["fused" if path == "fused" else "two_stage"]
    out = fused_moe(x, w1, w2, tw, ti, w1_bias=b1, w2_bias=b2, lora=lora, token_lora_ids=ids, config=cfg,
                    activation="swiglu_oai", swiglu_limit=7.0, out=poisoned(M, H, torch.float16))
    assert_matches_reference(out, x, w1, w2, tw, ti, w1_bias=b1, w2_bias=b2, lora=lora, token_lora_ids=ids,
                             activation="swiglu_oai", swiglu_limit=7.0)


@pytest.mark.parametrize("path", ["fused", "two_stage"])
def test_clamped_silu(path):
    # DeepSeek-V4 / HY-V4 style: silu(gate.clamp(max=limit)) * up.clamp(-limit, limit).
    M, E, H, I, topk = 9, 3, 32, 24, 2
    x, w1, w2, tw, ti = make_problem(M, E, H, I, topk, torch.float32, seed=8)
    x = x * 8
    out = fused_moe(x, w1, w2, tw, ti, swiglu_limit=1.5, config=CONFIGS[path])
    assert_matches_reference(out, x, w1, w2, tw, ti, swiglu_limit=1.5)
    assert rel_error(out, fmoe2.fused_moe_reference(x, w1, w2, tw, ti)) > 1e-2


def test_reference_activations_follow_their_formulas():
    gate, up = torch.linspace(-12, 12, 97, dtype=torch.float64), torch.linspace(9, -9, 97, dtype=torch.float64)
    g, u = gate.clamp(max=7.0), up.clamp(-7.0, 7.0)
    torch.testing.assert_close(gated_activation(gate, up, "swiglu_oai", 1.702, 7.0),
                               (u + 1) * g * torch.sigmoid(1.702 * g))
    torch.testing.assert_close(gated_activation(gate, up, "silu", swiglu_limit=7.0), torch.nn.functional.silu(g) * u)
    torch.testing.assert_close(gated_activation(gate, up, "gelu_tanh"),
                               torch.nn.functional.gelu(gate, approximate="tanh") * up)


def test_prepared_biases_round_trip():
    x, w1, w2, tw, ti = make_problem(3, 4, 40, 24, 2, torch.float16)
    b1, b2 = _biases(4, 40, 24, torch.float16, seed=1)
    for interleaved in (False, True):
        w, b = _interleave(w1, b1) if interleaved else (w1, b1)
        p = prepare_weights(w, w2, pad_to=16, w1_bias=b, w2_bias=b2, gate_up_interleaved=interleaved)
        assert p.b13.shape == (4, 64) and p.b2.shape == (4, 48)
        back_w1, back_w2 = p.unprepare()
        back_b1, back_b2 = p.unprepare_biases()
        for got, want in ((back_w1, w1), (back_w2, w2), (back_b1, b1), (back_b2, b2)):
            torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("change,error,match", [
    (dict(w1_bias="shape"), ValueError, r"w1_bias must have shape \[E, 2I\]"),
    (dict(w2_bias="dtype"), TypeError, "w2_bias must have dtype"),
    (dict(prepared_with_bias=True), ValueError, "prepared weights carry their biases"),
    (dict(prepared_interleaved=True), ValueError, "prepared weights are interleaved already"),
    (dict(swiglu_limit=7.0, activation="gelu"), ValueError, "swiglu_limit clamps silu and swiglu_oai only"),
    (dict(swiglu_limit=-1.0), ValueError, "swiglu_limit must be a positive finite float"),
    (dict(swiglu_alpha="x"), TypeError, "swiglu_alpha must be a float"),
    (dict(activation="swiglu"), ValueError, "activation must be one of"),
])
def test_bad_bias_and_activation_arguments_are_refused(change, error, match):
    M, E, H, I = 4, 3, 32, 24
    x, w1, w2, tw, ti = make_problem(M, E, H, I, 2, torch.float16)
    b1, b2 = _biases(E, H, I, torch.float16, seed=2)
    kwargs = dict(activation=change.get("activation", "silu"))
    weights = (w1, w2)
    if change.get("w1_bias") == "shape":
        kwargs["w1_bias"] = b1[:, :I].contiguous()
    if change.get("w2_bias") == "dtype":
        kwargs["w2_bias"] = b2.float()
    if change.get("prepared_with_bias"):
        weights, kwargs["w2_bias"] = (prepare_weights(w1, w2), None), b2
    if change.get("prepared_interleaved"):
        weights, kwargs["gate_up_interleaved"] = (prepare_weights(w1, w2), None), True
    for name in ("swiglu_limit", "swiglu_alpha"):
        if name in change:
            kwargs[name] = change[name]
    with pytest.raises(error, match=match):
        fused_moe(x, *weights, tw, ti, **kwargs)

