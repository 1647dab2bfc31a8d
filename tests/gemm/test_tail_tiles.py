"""Tail tiles (``FusedMoEConfig.TAIL_M``): on the two-stage path a sorted tile whose real rows fit in its first
TAIL_M rows computes only those, in stage 1 and stage 2 (``tiles._fits_tail``).

A forward's first call here runs on a scratch block filled with 0xFF bytes (NaN in every float dtype), so a row of
``y`` that a tail tile leaves unwritten and stage 2 did not mask would show as NaN in the output (later calls of the
same plan on a GPU allocate through the bound launches, not poisoned). The first tests see each stage's tail branch
run: stage 1 leaves the rows past a tail unwritten, stage 2 reads none of them. Routings put exactly a tail, one row
more, a whole tile and a tail, one row, none and a whole tile into experts. CPU interpreter (fp16 and fp32) and, on
a GPU, real models' sizes in bf16: eager, repeated and replayed in a CUDA graph."""
from dataclasses import replace

import pytest
import torch

import fmoe2
from fmoe2 import FusedMoEConfig, fused_moe, prepare_lora, prepare_weights
from fmoe2.buffers import BufferLayout
from fmoe2.gemm.config import fit_config, fit_fp8_config
from fmoe2.gemm.fused_moe import forward_launches
from helpers import DEVICE, assert_matches_reference, make_lora, make_problem, make_token_lora_ids, poisoned

TAIL = FusedMoEConfig(BLOCK_M=32, BLOCK_N=16, BLOCK_K=16, BLOCK_H=16, path="two_stage", S2_BLOCK_N=16, S2_BLOCK_K=16,
                      TAIL_M=16)


@pytest.fixture
def poisoned_scratch(monkeypatch):
    """Every scratch block a forward allocates is filled with 0xFF bytes; the blocks are listed with their
    layouts."""
    blocks = []
    allocate = BufferLayout.allocate

    def allocate_poisoned(layout, device):
        block = allocate(layout, device).fill_(255)
        blocks.append((layout, block))
        return block

    monkeypatch.setattr(BufferLayout, "allocate", allocate_poisoned)
    return blocks


def tail_tiles(sorted_token_ids, num_valid, block_m, tail_m):
    """Indices of the tiles holding 1..tail_m real rows (the ones a tail computes), and of those holding more."""
    tiles = sorted_token_ids.view(-1, block_m).cpu()
    real = (tiles < num_valid).sum(dim=1)
    return torch.nonzero((real > 0) & (real <= tail_m)).flatten(), torch.nonzero(real > tail_m).flatten()


def test_tail_tiles_compute_their_rows_only(poisoned_scratch):
    M, E, H, I, topk = 37, 5, 40, 48, 2
    x, w1, w2, tw, ti = make_problem(M, E, H, I, topk, torch.float16, seed=3)
    launches = forward_launches(x, w1, w2, tw, ti, config=TAIL, out=poisoned(M, H, torch.float16))
    for _, launch in launches:
        launch()
    layout, block = poisoned_scratch[-1]
    views = layout.views(block)
    ids, y = views["sorted_token_ids"], views["y"]
    tails, full = tail_tiles(ids, M, TAIL.BLOCK_M, TAIL.TAIL_M)
    assert len(tails) > 0 and len(full) > 0  # (37 * 2 rows over 5 experts: both kinds)
    y_tiles = y[:, :I].view(-1, TAIL.BLOCK_M, I).cpu()
    assert torch.isnan(y_tiles[tails, TAIL.TAIL_M:]).all(), "a tail tile computed rows past its tail"
    assert not torch.isnan(y_tiles[tails, :TAIL.TAIL_M]).any()
    assert not torch.isnan(y_tiles[full]).any()  # whole tiles compute (and zero) their padding rows
    result = fused_moe(x, w1, w2, tw, ti, config=TAIL, out=poisoned(M, H, torch.float16))
    assert_matches_reference(result, x, w1, w2, tw, ti)


def routed_by_counts(counts, device=DEVICE):
    """int32 ``topk_ids`` [sum(counts), 1]: expert e gets ``counts[e]`` rows (tokens in a shuffled order)."""
    ids = torch.cat([torch.full((n,), e, dtype=torch.int32) for e, n in enumerate(counts)])
    return ids[torch.randperm(len(ids), generator=torch.Generator().manual_seed(len(ids)))][:, None].to(device)


def boundary_counts(block_m, tail_m):
    """Rows per expert around the tail's edges: exactly a tail, one row past it, a whole tile and a tail, one row,
    none, exactly a whole tile."""
    return [tail_m, tail_m + 1, block_m + tail_m, 1, 0, block_m]


def test_stage2_tail_tiles_read_no_row_past_their_tail(poisoned_scratch):
    # Run the forward, then make row TAIL_M of a one-row tail tile a real row (a token's id, a y row of 1000s; the
    # tile's two real rows still fit its tail) and run stage 2 again on a zeroed output: a tail program never reads
    # that row, so the output is unchanged; a whole-tile program adds it to that token (checked: TAIL_M=0 in the
    # same setup changes the output).
    counts = boundary_counts(TAIL.BLOCK_M, TAIL.TAIL_M)
    M, E, H, I = sum(counts), len(counts), 40, 48
    for tail_m, changes in ((TAIL.TAIL_M, False), (0, True)):
        x, w1, w2, tw, ti = make_problem(M, E, H, I, 1, torch.float16, seed=4, ids=routed_by_counts(counts))
        launches = dict(forward_launches(x, w1, w2, tw, ti, config=TAIL, out=poisoned(M, H, torch.float16)))
        for name in ("sort", "stage1", "stage2"):
            launches[name]()
        stage2 = launches["stage2"].spec
        out = stage2.args["c_ptr"]
        first = out.clone()
        layout, block = poisoned_scratch[-1]
        views = layout.views(block)
        ids, y = views["sorted_token_ids"], views["y"]
        tails, _ = tail_tiles(ids, M, TAIL.BLOCK_M, TAIL.TAIL_M)
        real = (ids.view(-1, TAIL.BLOCK_M)[tails] < M).sum(dim=1)
        tile = int(tails[real.argmin()])  # the one-row tail: with one more real row it still fits its tail
        row = tile * TAIL.BLOCK_M + TAIL.TAIL_M
        assert ids[row].item() >= M  # (padding before)
        ids[row] = 0
        y[row].fill_(1000.0)
        out.zero_()
        stage2.constexprs["TAIL_M"] = tail_m
        launches["stage2"]()
        assert torch.equal(out, first) != changes, f"TAIL_M={tail_m}"


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("block_m,tail_m", [(32, 16), (64, 16), (64, 32)])
@pytest.mark.parametrize("routing", ["boundaries", "random", "empty_experts"])
def test_matches_reference(routing, block_m, tail_m, dtype, poisoned_scratch):
    ids, M, E, topk = None, 53, 6, 3
    if routing == "boundaries":
        counts = boundary_counts(block_m, tail_m)
        ids, M, topk = routed_by_counts(counts), sum(counts), 1
    elif routing == "empty_experts":  # experts 1, 3, 5, about 53 rows each
        ids = (torch.randint(0, 3, (M, topk), generator=torch.Generator().manual_seed(1)) * 2 + 1).to(torch.int32)
    x, w1, w2, tw, ti = make_problem(M, E, 48, 40, topk, dtype, seed=block_m + tail_m, ids=ids)
    cfg = replace(TAIL, BLOCK_M=block_m, TAIL_M=tail_m)
    for weights in ((w1, w2), (prepare_weights(w1, w2), None)):
        out = fused_moe(x, *weights, tw, ti, config=cfg, out=poisoned(M, x.shape[1], dtype))
        assert_matches_reference(out, x, w1, w2, tw, ti)
    if routing == "boundaries":  # (the others leave a tail or not, by the tiling)
        sorted_ids = fmoe2.moe_sorting(ti, tw, E, block_m).sorted_token_ids
        assert len(tail_tiles(sorted_ids, M, block_m, tail_m)[0]) == 3


def test_with_every_two_stage_feature(poisoned_scratch):
    # Biases, a clamped swiglu, interleaved rows, expert parallelism, deterministic mode, stage-2 K shares.
    M, E, H, I, topk = 45, 6, 40, 56, 2
    x, w1, w2, tw, ti = make_problem(M, E, H, I, topk, torch.float16, seed=11)
    assert len(tail_tiles(fmoe2.moe_sorting(ti, tw, E, TAIL.BLOCK_M).sorted_token_ids, M, TAIL.BLOCK_M,
                          TAIL.TAIL_M)[0]) > 0
    gen = torch.Generator().manual_seed(5)
    b1 = (torch.randn(E, 2 * I, generator=gen) * 0.1).to(x)
    b2 = (torch.randn(E, H, generator=gen) * 0.1).to(x)
    expert_map = torch.tensor([0, -1, 1, 2, -1, 3], dtype=torch.int32, device=DEVICE)
    local = [0, 2, 3, 5]
    swiglu = dict(activation="swiglu_oai", swiglu_alpha=1.702, swiglu_limit=7.0)
    ref_kw = dict(w1_bias=b1.double()[local], w2_bias=b2.double()[local], **swiglu)
    cases = [dict(), dict(deterministic=True), dict(config=replace(TAIL, S2_SPLIT_K=2))]
    for extra in cases:
        kw = {"config": TAIL, **extra}
        out = fused_moe(x, w1[local], w2[local], tw, ti, expert_map=expert_map, w1_bias=b1[local], w2_bias=b2[local],
                        out=poisoned(M, H, torch.float16), **swiglu, **kw)
        assert_matches_reference(out, x, w1[local], w2[local], tw, ti, expert_map=expert_map, **ref_kw)


def test_with_adapters_and_4bit_weights(poisoned_scratch):
    # Tails in every expert but the last; adapters with their own launches (here above 1 routed row per expert) and
    # with the deltas inside the stages (deterministic mode: stage 2 adds the down deltas of the tail's rows).
    counts = [16, 37, 1, 32]
    M, E, H, I = sum(counts), len(counts), 64, 64
    x, w1, w2, tw, ti = make_problem(M, E, H, I, 1, torch.float16, seed=2, ids=routed_by_counts(counts))
    lora = prepare_lora(make_lora(2, E, H, I, 16, torch.float16))
    ids = make_token_lora_ids(M, 2)
    for extra in (dict(), dict(deterministic=True)):
        out = fused_moe(x, w1, w2, tw, ti, config=TAIL, lora=lora, token_lora_ids=ids,
                        out=poisoned(M, H, torch.float16), **extra)
        assert_matches_reference(out, x, w1, w2, tw, ti, lora=lora, token_lora_ids=ids)
    p1, s1 = fmoe2.quant4.quantize_mxfp4(w1.float().cpu())
    p2, s2 = fmoe2.quant4.quantize_mxfp4(w2.float().cpu())
    prepared = prepare_weights(p1.to(DEVICE), p2.to(DEVICE), w1_scale=s1.to(DEVICE), w2_scale=s2.to(DEVICE),
                               weight_format="mxfp4")
    d1, d2 = (fmoe2.quant4.dequantize_mxfp4(p, s).to(x) for p, s in ((p1, s1), (p2, s2)))
    out = fused_moe(x, prepared, None, tw, ti, config=replace(TAIL, BLOCK_K=32, S2_BLOCK_K=32),
                    out=poisoned(M, H, torch.float16))
    assert_matches_reference(out, x, d1.to(DEVICE), d2.to(DEVICE), tw, ti)


def test_config_checks_and_fitting():
    for bad in (8, 24, 32, 64, -16, 16.0):
        with pytest.raises(ValueError, match="TAIL_M"):
            replace(TAIL, TAIL_M=bad)  # BLOCK_M=32: 16 is the one tail
    fitted = fit_config(replace(TAIL, BLOCK_M=64, TAIL_M=32), 4096, 1024, 2, torch.bfloat16, "two_stage")
    assert (fitted.BLOCK_M, fitted.TAIL_M) == (64, 32)
    widened = fit_config(FusedMoEConfig(BLOCK_M=256, BLOCK_N=16, BLOCK_K=64, BLOCK_H=64, TAIL_M=128), 4096, 4096, 8,
                         torch.bfloat16, "fused")
    assert widened.BLOCK_M < 256 and widened.TAIL_M == 0  # (a fused config's rows cut below its tail)
    fp8 = fit_fp8_config(replace(TAIL, BLOCK_M=64, TAIL_M=32), 2)
    assert fp8.TAIL_M == 0  # the fp8 entries compute whole tiles


# ---------------------------------------------------------------------------------------------
# GPU: real models' sizes
# ---------------------------------------------------------------------------------------------

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
REAL = {"gpt-oss-20b": (32, 2880, 2880, 4), "mixtral-8x7b": (8, 4096, 14336, 2), "qwen3-30b-a3b": (128, 2048, 768, 8)}


@gpu
@pytest.mark.parametrize("M", [1024, 4096])
@pytest.mark.parametrize("shape", sorted(REAL))
def test_real_sizes_eager_repeated_and_graphed(shape, M, poisoned_scratch):
    E, H, I, topk = REAL[shape]
    x, w1, w2, tw, ti = make_problem(M, E, H, I, topk, torch.bfloat16, seed=M)
    weights = prepare_weights(w1, w2)
    base = fmoe2.gemm.config.get_config(M, E, H, I, topk, torch.bfloat16)
    cfg = replace(base, path="two_stage", BLOCK_M=128, TAIL_M=64)
    first = fused_moe(x, weights, None, tw, ti, config=cfg, out=poisoned(M, H, torch.bfloat16))
    assert_matches_reference(first, x, w1, w2, tw, ti)
    again = fused_moe(x, weights, None, tw, ti, config=cfg, out=poisoned(M, H, torch.bfloat16))
    assert (again - first).abs().max().item() <= 2 * first.abs().max().item() * 2 ** -7  # atomics' order only
    out = poisoned(M, H, torch.bfloat16)
    fused_moe(x, weights, None, tw, ti, config=cfg, out=out)  # compiled and planned before the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fused_moe(x, weights, None, tw, ti, config=cfg, out=out)
    for _ in range(2):
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert_matches_reference(out, x, w1, w2, tw, ti)


def test_the_search_tries_tails_with_tall_two_stage_tiles():
    from fmoe2.bench.search import TAIL_OF_128, deterministic_candidates, fmoe2_candidates

    candidates = fmoe2_candidates(4096, 8, 4096, 14336, 2, torch.bfloat16)  # Mixtral M=4096: 1024 rows per expert
    tails = [c for c in candidates if c.TAIL_M]
    assert tails and all(c.TAIL_M == TAIL_OF_128 and c.BLOCK_M == 128 and c.path == "two_stage" for c in tails)
    assert {replace(c, TAIL_M=0) for c in tails} <= set(candidates)  # each beside its config without tails
    assert not any(c.TAIL_M for c in fmoe2_candidates(1, 8, 4096, 14336, 2, torch.bfloat16))  # decode: none
    assert not any(c.TAIL_M for c in deterministic_candidates(4096, 8, 4096, 14336, 2, torch.bfloat16))
