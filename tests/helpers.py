"""Shared test helpers: random MoE problems and the accuracy check against the reference."""
import math

import torch

import fmoe2

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# Relative L2 error bound vs the float64 reference per dtype: fp32 is exact up to summation
# order; fp16/bf16 round the intermediate y to the input dtype and add topk*ceil(I/BLOCK_N)
# partials into the output in that dtype.
REL_TOL = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 2.5e-2}


def make_problem(M, E, H, I, topk, dtype, device=DEVICE, seed=0, ids=None, id_dtype=torch.int32):
    """Fresh random inputs; weights scaled so every stage is O(1). Routing: softmax + top-k."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    x = torch.randn(M, H, generator=gen)
    w1 = torch.randn(E, 2 * I, H, generator=gen) / math.sqrt(H)
    w2 = torch.randn(E, H, I, generator=gen) / math.sqrt(I)
    scores = torch.randn(M, E, generator=gen).softmax(dim=-1)
    topk_weights, topk_ids = torch.topk(scores, topk, dim=-1)
    if ids is not None:
        topk_ids = ids
    to = dict(device=device)
    return (x.to(dtype=dtype, **to), w1.to(dtype=dtype, **to), w2.to(dtype=dtype, **to),
            topk_weights.to(**to), topk_ids.to(dtype=id_dtype, **to))


def poisoned(M, H, dtype, device=DEVICE):
    """An output buffer full of NaN: any element the forward does not write shows up."""
    return torch.full((M, H), float("nan"), dtype=dtype, device=device)


def rel_error(out, ref):
    ref = ref.double()
    denom = ref.norm().item() or 1.0
    return (out.double() - ref).norm().item() / denom


def assert_matches_reference(out, x, w1, w2, topk_weights, topk_ids, **kwargs):
    ref = fmoe2.fused_moe_reference(x.double(), w1.double(), w2.double(), topk_weights, topk_ids, **kwargs)
    assert out.shape == ref.shape and out.dtype == x.dtype
    assert torch.isfinite(out).all(), "output holds NaN/inf (unwritten or overflowed elements)"
    err = rel_error(out, ref)
    assert err <= REL_TOL[x.dtype], f"relative L2 error {err:.3e} > {REL_TOL[x.dtype]:.1e}"
    return err
