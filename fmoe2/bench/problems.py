"""Random benchmark problems: inputs and routing, expert weights and biases of a shape, and the relative error the
benchmarks check fused_moe's output with (shared by ``python -m fmoe2.bench``, its sections, the tuner and the other
benchmark tools)."""
from __future__ import annotations

import math

import torch

import fmoe2
from fmoe2.shapes import SHAPE_OPTIONS

BF16_TOL = 2.5e-2  # relative L2 error bound of a bf16 forward against the float32 reference


def make_inputs(M, E, H, I, topk, gen):
    """bf16 ``x [M, H]``, float32 ``topk_weights`` and int32 ``topk_ids [M, topk]`` (softmax + top-k of random
    logits) on ``gen``'s device."""
    x = torch.randn(M, H, device=gen.device, dtype=torch.bfloat16, generator=gen)
    logits = torch.randn(M, E, device=gen.device, generator=gen)
    topk_weights, topk_ids = torch.topk(logits.softmax(dim=-1), topk, dim=-1)
    return x, topk_weights, topk_ids.to(torch.int32)


def rel_err(out, ref):
    return ((out.float() - ref).norm() / ref.norm()).item()


def random_weights(E, H, I, gen):
    """Random bf16 expert weights ``w1 [E, 2I, H]``, ``w2 [E, H, I]`` on ``gen``'s device (the GPU in the
    benchmarks), scaled so every stage is O(1)."""
    w1 = torch.randn(E, 2 * I, H, device=gen.device, dtype=torch.bfloat16, generator=gen) / math.sqrt(H)
    w2 = torch.randn(E, H, I, device=gen.device, dtype=torch.bfloat16, generator=gen) / math.sqrt(I)
    return w1, w2


def random_biases(E, H, I, gen):
    """Random bf16 biases ``{"w1_bias": [E, 2I], "w2_bias": [E, H]}`` on ``gen``'s device, small beside the
    products."""
    return dict(w1_bias=torch.randn(E, 2 * I, device=gen.device, dtype=torch.bfloat16, generator=gen) * 0.1,
                w2_bias=torch.randn(E, H, device=gen.device, dtype=torch.bfloat16, generator=gen) * 0.1)


def make_weights(name, shape, gen):
    """Random bf16 expert weights of a benchmark shape (:func:`random_weights`), the shape's own computation
    (``SHAPE_OPTIONS``: activation, clamp) as ``fused_moe`` keywords, its biases (:func:`random_biases`, or an
    empty dict) and the weights prepared with them."""
    E, H, I, topk = shape
    w1, w2 = random_weights(E, H, I, gen)
    options = dict(SHAPE_OPTIONS.get(name, {}))
    biases = random_biases(E, H, I, gen) if options.pop("biases", False) else {}
    return w1, w2, options, biases, fmoe2.prepare_weights(w1, w2, **biases)
