"""Per-token activations for fp8 weights scaled per channel or per tensor (``fmoe2.fp8.PER_TOKEN_ACTIVATIONS``,
experimental, off by default: issue 59): the sort quantizes each row of x as one group, its bits those of the torch
mirror, and the gate/up GEMM scales its products once after the K loop; the forward matches the reference that
quantizes x the same way, on both paths, plain and prepared, and is told apart from the per-group one."""
import pytest
import torch
import triton
import triton.language as tl

import fmoe2
from fmoe2 import fp8, fused_moe, prepare_weights
from fmoe2.gemm.fused_moe import PLANS, plan_of
from fmoe2.sorting.moe_sorting import XQuantization, _quantize_x_rows
from helpers import DEVICE, poisoned, rel_error
from test_fp8 import DTYPE, FP8, _check, _fp8_problem, needs_fp8


@pytest.fixture
def per_token(monkeypatch):
    """Per-token activations on for the test (plans made before it keyed nothing on it: the cache is emptied)."""
    monkeypatch.setattr(fp8, "PER_TOKEN_ACTIVATIONS", True)
    PLANS.clear()
    yield
    PLANS.clear()


def _outliers(x):
    """x with one large column (per-token scales then differ much from per-group ones)."""
    x = x.float().clone()
    x[:, 3] = 40.0
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
    err = _check(out, x, w1, w2, tw, ti, scales, unquantized)
    # Told apart from per-group quantization: the per-group reference is much further off
    fp8.PER_TOKEN_ACTIVATIONS = False
    per_group = fmoe2.fused_moe_reference(x, w1, w2, tw, ti, **scales).float()
    assert rel_error(out.float(), per_group) > 3 * max(err, 1e-3)


@triton.jit
def _quantize_x_kernel(xq, num_rows, num_programs, X_PER_ROW: tl.constexpr, FP8_MAX: tl.constexpr,
                       SOFT_FP8_ROUNDING: tl.constexpr, FP8_MIN_NORMAL: tl.constexpr, FP8_SUBNORMAL_STEP: tl.constexpr):
    """The sort launch's x-quantizing programs alone (``xq``: an XQuantization), 16 rows and 128 columns a tile."""
    _quantize_x_rows(xq, num_rows, tl.program_id(0), num_programs, 16, 128, X_PER_ROW, FP8_MAX, SOFT_FP8_ROUNDING,
                     FP8_MIN_NORMAL, FP8_SUBNORMAL_STEP)


@needs_fp8
@pytest.mark.parametrize("per_row", [True, False], ids=["per-token", "per-group"])
def test_the_sorts_x_quantization_is_its_torch_mirror_bit_for_bit(per_row):
    # 21 rows (a partial block of 16), H = 328 (three 128-column tiles, the last partial), one large column and a
    # zero row (scale 1); per token the row's tiles share one scale, read in a first pass
    M, H = 21, 328
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(M, H, generator=gen) * torch.logspace(-2, 2, M)[:, None]
    x[:, 3] = 40.0
    x[5] = 0.0
    group = H if per_row else 128
    want_q, want_s = fp8.quantize_activations(x, FP8, group=group)
    x_dev = x.to(DEVICE)
    x_q = torch.empty(M, H, dtype=FP8, device=DEVICE)
    x_scale = torch.full((M, triton.cdiv(H, group)), float("nan"), device=DEVICE)
    consts = fp8.fp8_constexprs(FP8, interpreter=DEVICE != "cuda")
    xq = XQuantization(x_dev, x_q, x_scale, H, x_dev.stride(0), x_q.stride(0))
    _quantize_x_kernel[(3,)](xq, M, 3, per_row, consts["FP8_MAX"], consts["SOFT_FP8_ROUNDING"],
                             consts["FP8_MIN_NORMAL"], consts["FP8_SUBNORMAL_STEP"])
    assert torch.equal(x_scale.cpu(), want_s)
    mismatches = (x_q.cpu().view(torch.uint8) != want_q.view(torch.uint8)).sum().item()
    # (the interpreter's soft rounding breaks exact ties away from even: rare, test_fp8.py's mirror test says)
    assert mismatches <= (M * H // 1000 if DEVICE != "cuda" else 0), mismatches


@needs_fp8
def test_block_scaled_weights_keep_per_group_activations(per_token):
    # Per-token activations need weight scales constant along K: block-scaled weights keep 128-column groups
    x, w1, w2, tw, ti, scales, unquantized = _fp8_problem(9, 5, 328, 136, 2, "block", seed=6)
    out = poisoned(9, 328, DTYPE)
    fused_moe(x, w1, w2, tw, ti, out=out, **scales)
    plan = plan_of(x, w1, w2, tw, ti, out=out, **scales)
    assert [e for e in plan.layout.entries if e[0] == "x_scale"][0][2] == (9, 3)
    _check(out, x, w1, w2, tw, ti, scales, unquantized)
