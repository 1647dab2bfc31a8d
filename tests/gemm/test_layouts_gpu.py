"""Weights in every layout fused_moe takes, on the GPU (skipped without one): transformers' transposed views
(``gate_up_proj [E, H, 2I]``, ``down_proj [E, I, H]``: N-contiguous, read in place), at gpt-oss's sizes, right on
each call, eager and graph-replayed, and not much slower than the K-contiguous layout.

On main 98a32ee the views ran gpt-oss-20b at M=64 37x slower than the contiguous weights (issue 55): every weight
tile was loaded as ``[N, K]`` and transposed for the dot, and for N-contiguous weights that load compiled to
register loads without ``cp.async`` (3662 spill instructions in stage 1 on sm_90). The tiles are now loaded in the
dot's own ``[K, N]`` orientation: pipelined copies for both layouts (``fmoe2/gemm/operands.py``).
"""
import pytest
import torch

import fmoe2
from fmoe2.bench.timing import capture_graph, time_graphs_in_turns
from fmoe2.shapes import ALL_SHAPES
from helpers import REL_TOL, poisoned, rel_error

pytestmark = pytest.mark.gpu

ACT = dict(activation="swiglu_oai", swiglu_limit=7.0)


def gpt_oss_views(name):
    """``(views, keywords)``: gpt-oss's experts as transformers holds them, drawn on the GPU: interleaved gate/up
    ``gate_up_proj [E, H, 2I]`` and ``down_proj [E, I, H]`` as the ``[E, 2I, H]`` / ``[E, H, I]`` views fused_moe
    takes (N-contiguous), and the biases with ``gate_up_interleaved=True``. No contiguous copy is made (gpt-oss-120b's
    weights are 6.4 GB in bf16, and the suite runs 8 workers per GPU): the reference reads the views too."""
    E, H, I, topk = ALL_SHAPES[name]
    gen = torch.Generator(device="cuda").manual_seed(0)
    bf16 = dict(device="cuda", dtype=torch.bfloat16, generator=gen)
    gate_up_proj = torch.randn(E, H, 2 * I, **bf16) / H ** 0.5
    down_proj = torch.randn(E, I, H, **bf16) / I ** 0.5
    b1, b2 = torch.randn(E, 2 * I, **bf16) * 0.1, torch.randn(E, H, **bf16) * 0.1
    return (gate_up_proj.transpose(1, 2), down_proj.transpose(1, 2)), dict(w1_bias=b1, w2_bias=b2,
                                                                          gate_up_interleaved=True)


def routing(M, E, H, topk, seed):
    """``(x [M, H] bf16, topk_weights [M, topk] fp32, topk_ids [M, topk] int64)``, softmax routing."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(M, H, device="cuda", generator=gen).to(torch.bfloat16)
    tw, ti = torch.topk(torch.randn(M, E, device="cuda", generator=gen).softmax(-1), topk)
    return x, tw, ti


@pytest.mark.parametrize("M", [1, 8, 64, 512, 4096])
@pytest.mark.parametrize("name", ["gpt-oss-20b", "gpt-oss-120b"])
def test_transposed_views_at_gpt_oss_sizes_right_on_every_call_and_replay(name, M):
    E, H, I, topk = ALL_SHAPES[name]
    views, keywords = gpt_oss_views(name)
    assert views[0].stride(1) == 1 and views[1].stride(1) == 1  # N-contiguous
    x, tw, ti = routing(M, E, H, topk, seed=M)
    ref = fmoe2.fused_moe_reference(x.float(), *views, tw, ti, **keywords, **ACT)
    out = poisoned(M, H, torch.bfloat16, "cuda")
    first = fmoe2.fused_moe(x, *views, tw, ti, out=out, **keywords, **ACT).clone()
    assert torch.isfinite(first).all() and rel_error(first, ref) <= REL_TOL[torch.bfloat16], rel_error(first, ref)
    for _ in range(2):  # the bound launches of later calls (atomic adds in any order: within rounding of the first)
        out.fill_(float("nan"))
        again = fmoe2.fused_moe(x, *views, tw, ti, out=out, **keywords, **ACT)
        assert rel_error(again, ref) <= REL_TOL[torch.bfloat16]
    graph = capture_graph(lambda: fmoe2.fused_moe(x, *views, tw, ti, out=out, **keywords, **ACT))
    for _ in range(2):
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.isfinite(out).all() and rel_error(out, ref) <= REL_TOL[torch.bfloat16]


@pytest.mark.parametrize("M", [64, 512])
def test_transposed_gpt_oss_views_are_not_much_slower_than_contiguous_weights(M):
    # Issue 55's bar: the module's views at most 1.5x the K-contiguous layout's time (a ratio of one process's CUDA
    # graphs, taking turns); on 98a32ee 37x at M=64 and 1.91x at M=512, now 0.99x and 1.02x (H200).
    name = "gpt-oss-20b"
    E, H, I, topk = ALL_SHAPES[name]
    views, keywords = gpt_oss_views(name)
    contiguous = (views[0].contiguous(), views[1].contiguous())
    x, tw, ti = routing(M, E, H, topk, seed=0)
    out = torch.empty_like(x)
    times = time_graphs_in_turns({
        "views": lambda: fmoe2.fused_moe(x, *views, tw, ti, out=out, **keywords, **ACT),
        "contiguous": lambda: fmoe2.fused_moe(x, *contiguous, tw, ti, out=out, **keywords, **ACT)},
        rounds=3, calls=10, replays=10)
    assert times["views"] <= 1.5 * times["contiguous"], times
