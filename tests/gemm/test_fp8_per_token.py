"""Per-token activations for fp8 weights scaled per channel or per tensor (``fmoe2.fp8.PER_TOKEN_ACTIVATIONS``,
off by default: issue 59): the sort quantizes each row of x as one group, its bits those of the torch mirror, and
the gate/up GEMM scales its products once after the K loop (tiles of 64 rows and more) or each step; the forward
matches the reference that quantizes x the same way, on both paths, plain and prepared, and is told apart from the
per-group one."""
import pytest
import torch
import triton
import triton.language as tl

import fmoe2
from fmoe2 import FusedMoEConfig, fp8, fused_moe, prepare_weights
from fmoe2.gemm.fused_moe import PLANS, plan_of
from fmoe2.sorting.moe_sorting import _quantize_x_rows, x_quantization_values
from helpers import DEVICE, poisoned, rel_error
from test_fp8 import DTYPE, FP8, SAME_QUANT_TOL, _check, _fp8_problem, needs_fp8


@pytest.fixture
def per_token(monkeypatch):
    """Per-token activations on for the test (plans made before it keyed nothing on it: the cache is emptied)."""
    monkeypatch.setattr(fp8, "PER_TOKEN_ACTIVATIONS", True)
    PLANS.clear()
    yield
    PLANS.clear()


def _outliers(x):
    """x with one large column (per-token scales then differ much from per-group ones), of a different size in each
    row (so a row read with another row's scale shows)."""
    x = x.float().clone()
    x[:, 3] = 40.0 * (1 + torch.arange(x.shape[0], device=x.device))
    return x.to(DTYPE)


@needs_fp8
@pytest.mark.parametrize("prepared", [False, True], ids=["plain", "prepared"])
@pytest.mark.parametrize("path", ["fused", "two_stage"])
@pytest.mark.parametrize("scheme", ["channel", "tensor"])
def test_per_token_forward_matches_the_per_token_reference(per_token, scheme, path, prepared):
    # H not a multiple of 128 (a partial last tile of the row), E not a power of two, 13 rows (a partial row block)
    x, w1, w2, tw, ti, scales, unquantized = _fp8_problem(13, 6, 328, 136, 3, scheme, seed=3)
    x = _outliers(x)
    out = poisoned(13, 328, DTYPE)
    if prepared:
        p = prepare_weights(w1, w2, **scales)
        fused_moe(x, p, None, tw, ti, out=out, path=path)
        plan = plan_of(x, p, None, tw, ti, out=out, path=path)
    else:
        fused_moe(x, w1, w2, tw, ti, out=out, path=path, **scales)
        plan = plan_of(x, w1, w2, tw, ti, out=out, path=path, **scales)
    assert [e for e in plan.layout.entries if e[0] == "x_scale"][0][2] == (13, 1)  # one scale a row
    _check(out, x, w1, w2, tw, ti, scales, unquantized)


@needs_fp8
@pytest.mark.parametrize("prepared", [False, True], ids=["plain", "prepared"])
@pytest.mark.parametrize("block_m", [16, 64])
@pytest.mark.parametrize("path", ["fused", "two_stage"])
def test_both_forms_of_the_per_token_loop_match_the_reference(per_token, path, block_m, prepared):
    # Tiles of 64 rows and more sum the steps' products unscaled and scale after the loop; smaller ones scale each
    # step's product by the scales' product (fp8_weights._gate_up_fp8's CHAINED): both right, on gate and up rows
    # apart (plain) and interleaved (prepared), with rows of different scales, 70 rows over 5 experts (several tiles
    # an expert at 16 rows, partial tiles at both heights).
    x, w1, w2, tw, ti, scales, unquantized = _fp8_problem(70, 5, 328, 136, 2, "channel", seed=11)
    x = _outliers(x)
    two_stage = dict(path="two_stage", S2_BLOCK_N=64, S2_BLOCK_K=128, S2_GROUP_M=1) if path == "two_stage" else {}
    config = FusedMoEConfig(BLOCK_M=block_m, BLOCK_N=64, BLOCK_K=128, BLOCK_H=64, GROUP_M=1, num_warps=4,
                            num_stages=2, **two_stage)
    args, kwargs = ((x, prepare_weights(w1, w2, **scales), None, tw, ti), {}) if prepared else ((x, w1, w2, tw, ti),
                                                                                                scales)
    out = poisoned(70, 328, DTYPE)
    fused_moe(*args, out=out, config=config, **kwargs)
    assert plan_of(*args, out=out, config=config, **kwargs).config.BLOCK_M == block_m  # the form asked for ran
    _check(out, x, w1, w2, tw, ti, scales, unquantized)


@needs_fp8
@pytest.mark.parametrize("path", ["fused", "two_stage"])
def test_per_token_forward_is_told_apart_from_per_group(per_token, path):
    # Each row's first 128 columns hold 2**10 and meet zero weights: they set the row's one scale but add nothing to
    # the output, and the other columns (about 2**-6) fall into e4m3's subnormals under that scale (a few steps of
    # 2**-9), where their own group's scale keeps them normal. The two quantizations then give outputs far apart
    # (with x of one magnitude they differ by about as much as bf16's rounding does: 8e-3 against 3e-3 on an H200,
    # too close to tell), and the forward is the per-token one.
    x, w1, w2, tw, ti, scales, _ = _fp8_problem(13, 6, 328, 136, 3, "channel", seed=5)
    x = x.float() * 2.0 ** -6
    x[:, :128] = 2.0 ** 10
    x = x.to(DTYPE)
    w1.view(torch.uint8)[:, :, :128] = 0  # (the code of +0.0)
    out = poisoned(13, 328, DTYPE)
    fused_moe(x, w1, w2, tw, ti, out=out, path=path, **scales)
    assert torch.isfinite(out).all()
    err = rel_error(out.float(), fmoe2.fused_moe_reference(x, w1, w2, tw, ti, **scales).float())
    assert err <= SAME_QUANT_TOL
    fp8.PER_TOKEN_ACTIVATIONS = False
    per_group = fmoe2.fused_moe_reference(x, w1, w2, tw, ti, **scales).float()
    assert rel_error(out.float(), per_group) > 10 * max(err, 1e-3), (rel_error(out.float(), per_group), err)


@triton.jit
def _quantize_x_kernel(xq, num_rows, num_programs, X_ROWS: tl.constexpr, X_GROUP: tl.constexpr, FP8_MAX: tl.constexpr,
                       SOFT_FP8_ROUNDING: tl.constexpr, FP8_MIN_NORMAL: tl.constexpr, FP8_SUBNORMAL_STEP: tl.constexpr):
    """The sort launch's x-quantizing programs alone (``xq``: an XQuantization), with the launch's tile."""
    _quantize_x_rows(xq, num_rows, tl.program_id(0), num_programs, X_ROWS, X_GROUP, FP8_MAX, SOFT_FP8_ROUNDING,
                     FP8_MIN_NORMAL, FP8_SUBNORMAL_STEP)


@needs_fp8
@pytest.mark.parametrize("H", [328, 100, 7168])
@pytest.mark.parametrize("per_row", [True, False], ids=["per-token", "per-group"])
def test_the_sorts_x_quantization_is_its_torch_mirror_bit_for_bit(per_row, H):
    # 21 rows, rows of different sizes, one large column and a zero row (scale 1); per token a row is one tile of
    # the next power of two (H = 328: 512, masked past H; 7168, DeepSeek-V3's: 8192), per group 128-column tiles.
    # The launch's values (x_quantization_values) pick the tile from x_scale's shape.
    M = 21
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(M, H, generator=gen) * torch.logspace(-2, 2, M)[:, None]
    x[:, 3] = 40.0 * (1 + torch.arange(M))
    x[5] = 0.0
    group = H if per_row else 128
    want_q, want_s = fp8.quantize_activations(x, FP8, group=group)
    x_dev = x.to(DEVICE)
    x_q = torch.empty(M, H, dtype=FP8, device=DEVICE)
    x_scale = torch.full((M, triton.cdiv(H, group)), float("nan"), device=DEVICE)
    args, constexprs = x_quantization_values(x_dev, x_q, x_scale, fp8.fp8_constexprs(FP8, DEVICE != "cuda"))
    assert constexprs["X_GROUP"] == (triton.next_power_of_2(H) if per_row and H > 128 else 128)
    programs = args["num_quant_programs"]
    _quantize_x_kernel[(programs,)](args["x_quantization"], M, programs, constexprs["X_ROWS"], constexprs["X_GROUP"],
                                    constexprs["FP8_MAX"], constexprs["SOFT_FP8_ROUNDING"],
                                    constexprs["FP8_MIN_NORMAL"], constexprs["FP8_SUBNORMAL_STEP"])
    assert torch.equal(x_scale.cpu(), want_s)
    got, want = x_q.cpu().view(torch.uint8).int(), want_q.view(torch.uint8).int()
    if DEVICE == "cuda":
        assert torch.equal(got, want)
        return
    # The interpreter's soft rounding (test_fp8.py's mirror test) gives +0 for a tiny negative value (the mirror -0),
    # and breaks an exact tie away from even: then the neighbouring code of the same sign, rarely
    zeros = ((got & 127) == 0) & ((want & 127) == 0)
    mismatches = (got != want) & ~zeros
    assert mismatches.sum().item() <= M * H // 500, mismatches.sum().item()
    assert ((got - want)[mismatches].abs() == 1).all() and ((got ^ want)[mismatches] < 128).all()


@needs_fp8
def test_block_scaled_weights_keep_per_group_activations(per_token):
    # Per-token activations need weight scales constant along K: weights with several blocks along H keep 128-column
    # groups
    x, w1, w2, tw, ti, scales, unquantized = _fp8_problem(9, 5, 328, 136, 2, "block", seed=6)
    out = poisoned(9, 328, DTYPE)
    fused_moe(x, w1, w2, tw, ti, out=out, **scales)
    plan = plan_of(x, w1, w2, tw, ti, out=out, **scales)
    assert [e for e in plan.layout.entries if e[0] == "x_scale"][0][2] == (9, 3)
    _check(out, x, w1, w2, tw, ti, scales, unquantized)


@needs_fp8
@pytest.mark.parametrize("prepared", [False, True], ids=["plain", "prepared"])
def test_the_switch_is_part_of_the_plan_key(monkeypatch, prepared):
    # A call planned with the switch off must not reuse that plan once it is on (the plan holds the quantization):
    # the same call, the cache kept, gets a plan of one scale a row.
    x, w1, w2, tw, ti, scales, _ = _fp8_problem(7, 4, 328, 136, 2, "channel", seed=8)
    args = (x, prepare_weights(w1, w2, **scales), None, tw, ti) if prepared else (x, w1, w2, tw, ti)
    kwargs = {} if prepared else scales
    out = poisoned(7, 328, DTYPE)
    x_scale_shape = lambda: [e for e in plan_of(*args, out=out, **kwargs).layout.entries  # noqa: E731
                             if e[0] == "x_scale"][0][2]
    monkeypatch.setattr(fp8, "PER_TOKEN_ACTIVATIONS", False)
    fused_moe(*args, out=out, **kwargs)
    assert x_scale_shape() == (7, 3)
    monkeypatch.setattr(fp8, "PER_TOKEN_ACTIVATIONS", True)
    fused_moe(*args, out=out, **kwargs)
    assert x_scale_shape() == (7, 1)
    PLANS.clear()
