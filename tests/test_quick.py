"""The quick tier (``python -m pytest tests -m quick``): every entry kernel of fmoe2 launched at least once, each forward
checked against the reference, in the fewest small forwards. For iterating on a kernel: the whole suite stays the
check before a change lands (docs/correctness.md).

Each scenario is a few small forwards (or sorts), each checked against its reference, and the set of entry kernels
they must launch, recorded at ``LaunchSpec.launch`` (every launch of a fresh plan passes there once; later calls of a
plan launch bound kernels). ``test_the_scenarios_cover_every_entry_kernel``
fails when a module of fmoe2 gains an entry kernel (a ``@triton.jit`` function whose name ends in ``kernel``, launched
by fmoe2 itself; the benchmark's own kernels aside) that no scenario launches. Runs under the Triton interpreter
(float16) and on a GPU (bf16).
"""
import importlib
import pkgutil
from dataclasses import replace

import pytest
import torch

import fmoe2
from fmoe2 import FusedMoEConfig, fused_moe, prepare_weights, quantize_fp8_weights
from fmoe2.launch import LaunchSpec
from fmoe2.target import target_of
from helpers import DEVICE, assert_matches_reference, make_lora, make_problem, make_token_lora_ids, poisoned, rel_error

pytestmark = pytest.mark.quick

DTYPE = torch.bfloat16 if DEVICE == "cuda" else torch.float16
SMALL = FusedMoEConfig(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, BLOCK_H=16)
TWO_STAGE = replace(SMALL, path="two_stage", S2_BLOCK_N=16, S2_BLOCK_K=16)
M, E, H, I, TOPK = 5, 6, 40, 24, 2  # E not a power of two, H and I not multiples of 16
FP8_TOL = 1e-2  # against the reference with the same quantization (tests/gemm/test_fp8.py)


def _sixteen_bit(**options):
    def run():
        x, w1, w2, tw, ti = make_problem(M, E, H, I, TOPK, DTYPE)
        out = fused_moe(x, w1, w2, tw, ti, out=poisoned(M, H, DTYPE), **options)
        kwargs = {k: v for k, v in options.items() if k in ("activation",)}
        assert_matches_reference(out, x, w1, w2, tw, ti, **kwargs)
    return run


def _one_token():
    x, w1, w2, tw, ti = make_problem(1, E, H, I, TOPK, DTYPE)
    config = replace(SMALL, accumulate_fp32=True)
    for _ in range(2):  # the one-launch decode; its kept accumulator is zero again after each call
        out = fused_moe(x, w1, w2, tw, ti, config=config, out=poisoned(1, H, DTYPE))
        assert_matches_reference(out, x, w1, w2, tw, ti)
    with fmoe2.sort_path_only():  # what a CUDA graph of the call runs: the sort, then the fused kernel casting rows
        out = fused_moe(x, w1, w2, tw, ti, config=config, out=poisoned(1, H, DTYPE))
    assert_matches_reference(out, x, w1, w2, tw, ti)


def _gpt_oss_style():
    x, w1, w2, tw, ti = make_problem(M, E, H, I, TOPK, DTYPE)
    gen = torch.Generator(device="cpu").manual_seed(7)
    biases = dict(w1_bias=torch.randn(E, 2 * I, generator=gen).to(DEVICE, DTYPE),
                  w2_bias=torch.randn(E, H, generator=gen).to(DEVICE, DTYPE))
    options = dict(activation="swiglu_oai", swiglu_limit=7.0, gate_up_interleaved=True, **biases)
    prepared = prepare_weights(w1, w2, **biases, gate_up_interleaved=True)
    out = fused_moe(x, prepared, None, tw, ti, config=TWO_STAGE, activation="swiglu_oai", swiglu_limit=7.0,
                    out=poisoned(M, H, DTYPE))
    assert_matches_reference(out, x, w1, w2, tw, ti, **options)


def _lora(config):
    def run():
        x, w1, w2, tw, ti = make_problem(M, E, H, I, TOPK, DTYPE)
        lora = make_lora(2, E, H, I, 8, DTYPE)
        ids = make_token_lora_ids(M, 2)
        out = fused_moe(x, w1, w2, tw, ti, config=config, lora=lora, token_lora_ids=ids, out=poisoned(M, H, DTYPE))
        assert_matches_reference(out, x, w1, w2, tw, ti, lora=lora, token_lora_ids=ids)
    return run


def _fp8(path):
    def run():
        if torch.float8_e4m3fn not in target_of(DEVICE).fp8_dtypes:
            pytest.skip("no fp8 matrix instructions here")
        x, w1, w2, tw, ti = make_problem(M, E, 200, 136, TOPK, torch.float32)
        q1, s1 = quantize_fp8_weights(w1, "block", (128, 128))
        q2, s2 = quantize_fp8_weights(w2, "block", (128, 128))
        scales = dict(w1_scale=s1, w2_scale=s2, block_shape=(128, 128))
        x = x.to(DTYPE)
        out = fused_moe(x, q1, q2, tw, ti, path=path, out=poisoned(M, 200, DTYPE), **scales)
        ref = fmoe2.fused_moe_reference(x, q1, q2, tw, ti, **scales).float()
        assert torch.isfinite(out).all() and rel_error(out.float(), ref) <= FP8_TOL
    return run


def _weight_only(fmt):
    def run():
        from fmoe2 import int8, quant4

        x, w1, w2, tw, ti = make_problem(M, E, 64, 96, TOPK, torch.float32, device="cpu")
        if fmt == "mxfp4":
            (p1, s1), (p2, s2), zeros = quant4.quantize_mxfp4(w1), quant4.quantize_mxfp4(w2), {}
        elif fmt == "int8":  # (per channel)
            (p1, s1), (p2, s2), zeros = int8.quantize_int8(w1.half()), int8.quantize_int8(w2.half()), {}
        else:
            (p1, s1, z1), (p2, s2, z2) = quant4.quantize_int4(w1.half(), 32), quant4.quantize_int4(w2.half(), 32)
            zeros = dict(w1_zero=z1.to(DEVICE), w2_zero=z2.to(DEVICE))
        prepared = prepare_weights(p1.to(DEVICE), p2.to(DEVICE), w1_scale=s1.to(DEVICE), w2_scale=s2.to(DEVICE),
                                   weight_format=fmt, **zeros)
        x = x.to(DEVICE, DTYPE)
        for config in (SMALL, TWO_STAGE):
            out = fused_moe(x, prepared, None, tw.to(DEVICE), ti.to(DEVICE), config=config,
                            out=poisoned(M, 64, DTYPE))
            ref = fmoe2.fused_moe_reference(x.double(), prepared, None, tw.to(DEVICE), ti.to(DEVICE))
            assert torch.isfinite(out).all() and rel_error(out, ref) <= {torch.float16: 4e-3,
                                                                         torch.bfloat16: 2.5e-2}[DTYPE]
    return run


def _sorted_by_expert(result, num_tokens: int) -> dict:
    """``{expert: [(token, weight), ...]}`` read from a sort's tiles (padding rows left out)."""
    rows = int(result.num_tokens_post_padded.item())
    ids, weights = result.sorted_token_ids[:rows].tolist(), result.sorted_weights[:rows].tolist()
    out = {}
    for tile, expert in enumerate(result.sorted_expert_ids[:rows // result.block_m].tolist()):
        for row in range(tile * result.block_m, (tile + 1) * result.block_m):
            if expert >= 0 and ids[row] < num_tokens:
                out.setdefault(expert, []).append((ids[row], weights[row]))
    return out


def _chunked_sort():
    sorting_module = importlib.import_module("fmoe2.sorting.moe_sorting")
    num_tokens, num_experts = 300, 70
    _, _, _, tw, ti = make_problem(num_tokens, num_experts, 16, 16, 4, DTYPE)
    expected, rows = fmoe2.moe_sorting_reference(ti, tw, num_experts, 16)
    original = sorting_module.sort_chunk_size
    try:
        for chunk_size in (0, 256):  # one launch; then 1200 entries in five chunks
            sorting_module.sort_chunk_size = lambda num_keys, num_entries, chunk_size=chunk_size: chunk_size
            fmoe2.clear_plan_cache()  # (a sort's plan is kept per shape, not per chunk size)
            result = fmoe2.moe_sorting(ti, tw, num_experts, 16)
            assert int(result.num_tokens_post_padded.item()) == rows
            got = _sorted_by_expert(result, num_tokens)
            assert {e: sorted(v) for e, v in got.items()} == {e: sorted(v) for e, v in expected.items() if v}
    finally:
        sorting_module.sort_chunk_size = original


# name -> (run, the entry kernels it launches)
SCENARIOS = {
    # (16-bit weights on the fused path add into a float32 accumulator, cast to the output by a last launch)
    "fused": (_sixteen_bit(config=SMALL), {"_moe_sorting_kernel", "_fused_kernel", "_cast_rows_kernel"}),
    "one_token": (_one_token, {"_moe_sorting_kernel", "_fused_cast_kernel"}),
    "two_stage": (_sixteen_bit(config=TWO_STAGE, activation="gelu"),
                  {"_moe_sorting_kernel", "_stage1_kernel", "_stage2_kernel"}),
    "deterministic": (_sixteen_bit(deterministic=True),
                      {"_moe_sorting_kernel", "_stage1_kernel", "_stage2_kernel", "_combine_slots_kernel"}),
    "gpt_oss_style": (_gpt_oss_style, {"_moe_sorting_kernel", "_stage1_kernel", "_stage2_kernel"}),
    "lora_fused": (_lora(SMALL), {"_moe_sorting_kernel", "_fused_lora_kernel", "_cast_rows_kernel"}),
    "lora_two_stage": (_lora(TWO_STAGE), {"_moe_sorting_kernel", "_stage1_lora_kernel", "_stage2_kernel",
                                          "_lora_shrink_kernel", "_lora_expand_kernel"}),
    "fp8_fused": (_fp8("fused"), {"_moe_sorting_kernel", "_fused_fp8_kernel"}),
    "fp8_two_stage": (_fp8("two_stage"), {"_moe_sorting_kernel", "_stage1_fp8_kernel", "_stage2_fp8_kernel"}),
    "mxfp4": (_weight_only("mxfp4"), {"_moe_sorting_kernel", "_fused_kernel", "_cast_rows_kernel", "_stage1_kernel",
                                      "_stage2_kernel"}),
    "int4": (_weight_only("int4"), {"_moe_sorting_kernel", "_fused_kernel", "_cast_rows_kernel", "_stage1_kernel",
                                    "_stage2_kernel"}),
    "int8": (_weight_only("int8"), {"_moe_sorting_kernel", "_fused_kernel", "_cast_rows_kernel", "_stage1_kernel",
                                    "_stage2_kernel"}),
    "chunked_sort": (_chunked_sort, {"_count_chunk_keys_kernel", "_moe_sorting_kernel"}),
}


def entry_kernels() -> set:
    """The names of fmoe2's entry kernels: module-level ``@triton.jit`` functions named ``*kernel`` (the benchmark's
    own kernels aside)."""
    found = set()
    for info in pkgutil.walk_packages(fmoe2.__path__, "fmoe2."):
        if info.name.startswith(("fmoe2.bench", "fmoe2.integrations")) or info.name.endswith("__main__"):
            continue  # (the benchmark's kernels are its own; the integrations define none and import transformers)
        module = importlib.import_module(info.name)
        for name, value in vars(module).items():
            if name.endswith("kernel") and type(value).__name__ in ("JITFunction", "InterpretedFunction"):
                found.add(name)
    return found


def test_the_scenarios_cover_every_entry_kernel():
    launched = set().union(*(kernels for _, kernels in SCENARIOS.values()))
    assert launched == entry_kernels(), (sorted(entry_kernels() - launched), sorted(launched - entry_kernels()))


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_each_scenario_launches_its_kernels_and_matches_the_reference(scenario, monkeypatch):
    run, expected = SCENARIOS[scenario]
    launched = set()
    original = LaunchSpec.launch

    names = set()

    def recording(spec):
        launched.add(getattr(spec.kernel, "__name__", None) or spec.kernel.fn.__name__)
        names.add(spec.name)
        return original(spec)

    monkeypatch.setattr(LaunchSpec, "launch", recording)
    run()
    assert launched == expected, (sorted(launched - expected), sorted(expected - launched))
    if scenario == "one_token":  # both forms of a one-token call ran: the one-launch decode and the sort path's
        assert {"decode", "sort", "fused"} <= names, names
