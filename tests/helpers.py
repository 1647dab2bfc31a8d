"""Shared test helpers: random MoE problems and the accuracy check against the reference."""
import math

import torch

import fmoe2

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# (M, E, H, I, topk) of the small forwards every mode is checked on against the reference.
SMALL_PROBLEMS = [
    (1, 4, 64, 32, 2),
    (7, 3, 40, 24, 3),  # H, I not multiples of 16, E not a power of two
    (33, 5, 72, 56, 1),
    (19, 10, 24, 20, 8),
]

# Relative L2 error bound vs the float64 reference per dtype: fp32 is exact up to summation
# order; fp16/bf16 round the intermediate y to the input dtype and add topk*ceil(I/BLOCK_N)
# partials into the output in that dtype.
REL_TOL = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 2.5e-2}


def make_problem(M, E, H, I, topk, dtype, device=DEVICE, seed=0, ids=None, id_dtype=torch.int32):
    """Fresh random inputs; weights scaled so every stage is O(1). Routing: softmax + top-k.

    On a GPU everything is drawn there by the GPU's generator, one expert's weights at a time (one expert's float32
    draw at most): on the CPU machine, drawing and scaling Mixtral-8x7B's 1.4 billion weights took about 40 s on two
    cores, and parallel test workers each drawing them made the GPU suite CPU-bound. On the CPU, the CPU generator's
    draws as before."""
    if torch.device(device).type == "cpu":
        gen = torch.Generator(device="cpu").manual_seed(seed)
        x = torch.randn(M, H, generator=gen)
        w1 = (torch.randn(E, 2 * I, H, generator=gen) / math.sqrt(H)).to(dtype)
        w2 = (torch.randn(E, H, I, generator=gen) / math.sqrt(I)).to(dtype)
    else:
        gen = torch.Generator(device=device).manual_seed(seed)
        x = torch.randn(M, H, generator=gen, device=device)
        w1, w2 = (expert_weights(E, rows, cols, dtype, device, gen) for rows, cols in ((2 * I, H), (H, I)))
    scores = torch.randn(M, E, generator=gen, device=gen.device).softmax(dim=-1)
    topk_weights, topk_ids = torch.topk(scores, topk, dim=-1)
    if ids is not None:
        topk_ids = ids
    return (x.to(dtype), w1, w2, topk_weights, topk_ids.to(dtype=id_dtype, device=device))


def expert_weights(E, rows, cols, dtype, device, gen):
    """(E, rows, cols) normal weights over sqrt(cols), in ``dtype``, drawn one expert at a time on ``device``."""
    w = torch.empty(E, rows, cols, dtype=dtype, device=device)
    for e in range(E):
        w[e] = torch.randn(rows, cols, generator=gen, device=device).div_(math.sqrt(cols))
    return w


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


def make_lora(num_loras, E, H, I, rank, dtype, device=DEVICE, seed=0, experts=None, scaling=None):
    """Random adapters whose deltas are O(1) like the base terms (so a missing delta shows).

    ``experts``: the experts that have adapters; the others hold zeros.
    """
    gen = torch.Generator(device="cpu").manual_seed(1000 + seed)

    def rand(*shape, fan_in):
        return torch.randn(*shape, generator=gen) / math.sqrt(fan_in)

    t = dict(gate_a=rand(num_loras, E, rank, H, fan_in=H), gate_b=rand(num_loras, E, I, rank, fan_in=rank),
             up_a=rand(num_loras, E, rank, H, fan_in=H), up_b=rand(num_loras, E, I, rank, fan_in=rank),
             down_a=rand(num_loras, E, rank, I, fan_in=I), down_b=rand(num_loras, E, H, rank, fan_in=rank))
    if experts is not None:
        keep = torch.zeros(E, dtype=torch.bool)
        keep[list(experts)] = True
        t = {k: v * keep.view(1, E, 1, 1) for k, v in t.items()}
    if scaling is None:
        scaling = [0.5 + 0.25 * l for l in range(num_loras)]
    return fmoe2.MoELoRA(**{k: v.to(dtype=dtype, device=device) for k, v in t.items()}, scaling=scaling)


def make_token_lora_ids(M, num_loras, device=DEVICE, seed=0, none_fraction=0.25):
    """Adapter per token: uniform over the adapters, ``none_fraction`` of tokens with none (-1)."""
    gen = torch.Generator(device="cpu").manual_seed(2000 + seed)
    ids = torch.randint(0, num_loras, (M,), generator=gen, dtype=torch.int32)
    ids[torch.rand(M, generator=gen) < none_fraction] = -1
    return ids.to(device)
