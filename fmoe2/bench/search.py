"""The config search space shared by the tuner (fmoe2) and the benchmark's baseline, so both get
the same chance: same BLOCK_M choices per batch, same BLOCK_N/BLOCK_K/warps/stages grid."""
from __future__ import annotations

import dataclasses
import itertools
import sys
import time
from typing import Callable, Iterable, List, Optional, Sequence, Tuple, TypeVar

import torch

from ..formats import WEIGHT_ONLY_FORMATS
from ..gemm.config import FusedMoEConfig, fit_config, get_config
from ..target import current_backend
from .timing import time_in_graph
from .vllm_style import GroupedGemmConfig

T = TypeVar("T")


def block_m_candidates(M: int, E: int, topk: int) -> Sequence[int]:
    """Tile heights tried at ``M*topk/E`` routed rows per expert. Tiles taller than the rows an expert
    gets are tried too: where the weights are much of what is read (up to a few hundred rows) one
    tall tile reads an expert's weights once where short tiles read them again. 2026-11-24 added
    64-row tiles at 17-64 rows and 128-row tiles at 65-256 (measured at 96 and 256 rows). H100
    bench (misc/bench, 2026-11-23 -> 2026-11-24, fmoe2 / baseline): Mixtral M=1024 2021 / 2332 ->
    1734 / 1863 us, Qwen3 M=4096 1023 / 1129 -> 821 / 979, DeepSeek M=1024 462 / 506 -> 445 / 485."""
    tokens_per_expert = M * topk / E
    if tokens_per_expert <= 16:
        return (16,)
    if tokens_per_expert <= 64:
        return (16, 32, 64)
    if tokens_per_expert <= 256:
        return (32, 64, 128)
    return (64, 128)


def _regime(M: int, E: int, topk: int) -> str:
    tokens_per_expert = M * topk / E
    return "decode" if tokens_per_expert <= 16 else "mid" if tokens_per_expert <= 256 else "large"


def _grid(M: int, E: int, topk: int):
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages, GROUP_M) tried by both methods."""
    regime = _regime(M, E, topk)
    bms = block_m_candidates(M, E, topk)
    if regime == "decode":
        return itertools.product(bms, (64, 128, 256), (64, 128), (4, 8), (3, 4), (1,))
    if regime == "mid":
        return itertools.product(bms, (64, 128, 256), (64, 128), (4, 8), (3,), (1, 16))
    return itertools.product(bms, (64, 128, 256), (64,), (4, 8), (3,), (8, 32))


# Two-stage configs tried at decode sizes: stage 1 (BLOCK_N, num_stages) x stage 2 (S2_BLOCK_N,
# s2_num_warps, s2_num_stages, S2_SPLIT_K), 4 warps for stage 1, K tiles of 128 (64 on HIP). From
# H100 sweeps of each stage alone (2026-11-24, Mixtral, us; scratch runs, not committed): stage 1 at
# M=1 best 160.8 (32 columns, 3 stages) against 163.4 for the earlier fixed (64, 4), at M=16 541.4
# (64, 5) and 541.9 (128, 3) against 546.4; stage 2 at M=1 80.5-80.7 with 2 or 4 K shares against
# 83.4 without, at M=16 275.0 (256 columns, 8 warps, 3 stages, 2 shares) against 279.2. Whole
# forwards, same run: M=1 248.6 -> 244.1 us, M=16 829.1 -> 817.6 us (baseline 251.7 and 824.2).
DECODE_TWO_STAGE = {
    "cuda": (((32, 3), (64, 4), (64, 5), (128, 3)),
             ((64, 4, 4, 1), (128, 4, 4, 1), (128, 4, 4, 2), (256, 8, 3, 2))),
    "hip": (((32, 2), (64, 2)), ((64, 4, 2, 1), (128, 4, 2, 1), (128, 4, 2, 2))),
}

# Weight-only formats' stage 1 at decode sizes, besides the 16-bit ones: (BLOCK_N, BLOCK_K, num_warps, num_stages), each
# with the stage-2 choices above. A 4-bit tile carries a quarter of a 16-bit one's bytes, so at M=1 the 16-bit picks'
# grids keep too few bytes in flight (gpt-oss-20b, int4 and mxfp4: stage 1 took 88-92% of bf16's time for a quarter
# of its bytes, H200, 2026-11-29): narrower slices (twice the programs) and longer K steps (more bytes a step). Each
# compiles for sm_90 without spills at gpt-oss-20b's M=1 in every format (Triton 3.9; stage 1's registers: int4
# 91-104, mxfp4 96-148, int8 60-138; loop instructions of 16x256 against the 32x128 pick: int4 550 / 526, mxfp4
# 620 / 588, int8 370 / 311). Not yet timed: the tuner's searches try them (python -m fmoe2.tune --weights F).
PACKED_DECODE_STAGE1 = ((16, 128, 4, 4), (16, 256, 4, 3), (16, 256, 4, 4), (32, 256, 8, 3), (32, 256, 8, 4))

# Stage 1's (BLOCK_N, num_stages) tried above decode sizes (8 warps, K tiles of 64). The 4-stage
# pipeline was added after H100 sweeps of stage 1 alone (2026-11-24, scratch runs, not committed;
# us, BLOCK_M=128, tensor descriptors on, 3 stages at 64 / 128 columns -> 4 stages at 128): Mixtral
# M=1024 1119.8 / 1041.8 -> 964.7, Qwen3 M=4096 489.9 / 471.3 -> 457.1, DeepSeek M=4096 637.9 /
# 607.7 -> 583.8; no gain at up to 96 rows per expert (DeepSeek M=1024 286.0 / 291.7 -> 291.6).
# 4 stages at 64 columns lost everywhere (542.8, 706.6, 1178.2 at those three points); 5 stages at
# 128 columns do not fit shared memory. Stage 2 had no config off the grid faster by more than 1%.
STAGE1_LARGE = ((64, 3), (128, 3), (128, 4))
# Tail tiles (FusedMoEConfig.TAIL_M) tried with 128-row two-stage tiles of 128-column slices: on the H200
# (2026-11-28, misc/bench/prefill) 64-row tails gained at some points (gpt-oss-20b M=4096 1587.5 -> 1434.7 us,
# DeepSeek-V2-Lite M=4096 804.9 -> 768.2) and lost at others (Mixtral M=1024 1424.8 -> 1511.9), so the search
# decides (docs/performance.md#the-tail-tile).
TAIL_OF_128 = 64
DECODE_TALL_TILES_FROM = 4  # rows per expert above which decode-sized batches also try the taller two-stage tiles


def fmoe2_candidates(M: int, E: int, H: int, I: int, topk: int, dtype: torch.dtype,
                     weight_format: Optional[str] = None, fp8: bool = False) -> List[FusedMoEConfig]:
    """fmoe2 configs to try, after the picker's own clamps (duplicates removed): the fused path
    always, the two-stage path once experts get more than 16 tokens each, and at decode sizes the
    ``DECODE_TWO_STAGE`` configs, with narrow slices and stage-2 K shares (the fused path's slices stay
    wide because of the atomic-add cap; that cap is not what holds the fused path back at decode: on
    the H100, 2026-11-24, Qwen3 M=1 took 32.8 us with 32-column slices past the cap, 192 programs,
    against 32.4 with the 64 the cap allows, 96 programs on 132 multiprocessors). First of all the default rules' pick
    for the weights' mode (what ``fused_moe`` runs without a tuned file with 16-bit weights, or ``fp8`` ones, or
    those of ``weight_format``), which the grid does not always hold (the rules' tensor descriptors and PDL, their
    128-row tiles, fp8's two-stage decode): a search times it, and ends on a slower config only where the timings
    disagree (a tuned fp8 entry ran slower than the rules on the H200, 2026-11-29, misc/bench/defaults:
    Qwen3-30B-A3B M=4096 853 us against 780). ``weight_format`` (a weight-only format's name): at decode sizes
    also the ``PACKED_DECODE_STAGE1`` stage-1 tilings (CUDA)."""
    hip = current_backend() == "hip"
    hip_opts = {"waves_per_eu": 0, "matrix_instr_nonkdim": 16} if hip else {}
    seen, out = set(), []

    def add(cfg):
        cfg = fit_config(cfg, H, I, topk, dtype)
        if cfg not in seen:
            seen.add(cfg)
            out.append(cfg)

    # (as the resolver fitted it for its mode: the 16-bit fit of the grid below would refit an fp8 pick's stages)
    rules_pick = get_config(M, E, H, I, topk, dtype, tuned=False, fp8=fp8, weight_format=weight_format or "16bit")
    seen.add(rules_pick)
    out.append(rules_pick)

    for bm, bn, bk, warps, stages, group in _grid(M, E, topk):
        add(FusedMoEConfig(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, BLOCK_H=64 if bn >= 256 else 128, GROUP_M=group,
                           num_warps=warps, num_stages=2 if hip else stages, **hip_opts))
    if _regime(M, E, topk) == "decode":
        bk = 64 if hip else 128  # 2 stages of 128-wide K tiles would not fit gfx942's 64 KiB of LDS
        stage1s, stage2s = DECODE_TWO_STAGE["hip" if hip else "cuda"]
        for (bn, stages), (s2_bn, s2_warps, s2_stages, split) in itertools.product(stage1s, stage2s):
            add(FusedMoEConfig(BLOCK_M=16, BLOCK_N=bn, BLOCK_K=bk, BLOCK_H=128, GROUP_M=1, num_warps=4,
                               num_stages=stages, path="two_stage", S2_BLOCK_N=s2_bn, S2_BLOCK_K=bk,
                               S2_GROUP_M=1, s2_num_warps=s2_warps, s2_num_stages=s2_stages, S2_SPLIT_K=split,
                               **hip_opts))
        if weight_format in WEIGHT_ONLY_FORMATS and not hip:
            for (bn, bk, warps, stages), (s2_bn, s2_warps, s2_stages, split) in itertools.product(
                    PACKED_DECODE_STAGE1, stage2s):
                add(FusedMoEConfig(BLOCK_M=16, BLOCK_N=bn, BLOCK_K=bk, BLOCK_H=128, GROUP_M=1, num_warps=warps,
                                   num_stages=stages, path="two_stage", S2_BLOCK_N=s2_bn, S2_BLOCK_K=128,
                                   S2_GROUP_M=1, s2_num_warps=s2_warps, s2_num_stages=s2_stages, S2_SPLIT_K=split))
    tokens_per_expert = M * topk / E
    if _regime(M, E, topk) != "decode" or tokens_per_expert > DECODE_TALL_TILES_FROM:
        # At 5-16 rows per expert a busy expert overflows a 16-row tile and its weights are read again: taller tiles
        # on the two-stage path too (H100, 2026-11-28, misc/bench/defaults: gpt-oss-20b M=128, 16 rows per expert,
        # 64-row two-stage 586 us against 650 for the 16-row fused pick).
        bms = block_m_candidates(M, E, topk) if _regime(M, E, topk) != "decode" else (32, 64)
        for bm, (bn, stages), s2_bn, s2_stages in itertools.product(bms, STAGE1_LARGE, (128, 256), (3, 4)):
            tails = (0, TAIL_OF_128) if bm == 128 and bn == 128 else (0,)
            for tail in tails:
                add(FusedMoEConfig(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=64, BLOCK_H=128, GROUP_M=8, num_warps=8,
                                   num_stages=2 if hip else stages, path="two_stage", S2_BLOCK_N=s2_bn,
                                   S2_BLOCK_K=64, S2_GROUP_M=8, s2_num_warps=8,
                                   s2_num_stages=2 if hip else s2_stages, TAIL_M=tail, **hip_opts))
    return out


def deterministic_candidates(M: int, E: int, H: int, I: int, topk: int, dtype: torch.dtype) -> List[FusedMoEConfig]:
    """Configs tried for deterministic mode (``fmoe2.tune --deterministic``): :func:`fmoe2_candidates` as
    deterministic mode runs them, on the two-stage path without K shares or tail tiles (duplicates removed)."""
    seen, out = set(), []
    for cfg in fmoe2_candidates(M, E, H, I, topk, dtype):
        # No tails: a row would then be computed by 64- or 128-row matrix instructions depending on how many rows
        # its expert got, which no batch-invariance test covers.
        cfg = fit_config(dataclasses.replace(cfg, path="two_stage", S2_SPLIT_K=1, TAIL_M=0), H, I, topk, dtype,
                         "two_stage")
        if cfg not in seen:
            seen.add(cfg)
            out.append(cfg)
    return out


TMA_TWINS = 3  # fastest pointer-load configs retried with tensor-descriptor loads
# Configs of a quick search timed again as the benchmark times its picks (time_in_graph's defaults), in two turns.
# The quick timing (3 calls a graph, 10 replays) and the full one disagree: on the H200 (2026-11-29, Qwen3-235B
# TP1/TP2/TP4) the quick search's pick ran 12-15% slower in its full timing at M=4096 and 4% at M=1024, 5% faster
# at M=1, so a pick by quick times alone can be the wrong one.
FINALISTS = 4


def cuda_sm90_or_newer() -> bool:
    """A CUDA GPU of compute capability >= 9: tensor descriptors lower to TMA, PDL is there."""
    return current_backend() == "cuda" and torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9


def search_fmoe2(M: int, E: int, H: int, I: int, topk: int, dtype: torch.dtype,
                 run: Callable[[FusedMoEConfig], Callable[[], object]], label: str = "",
                 candidates: Optional[List[FusedMoEConfig]] = None,
                 fit: Optional[Callable[[FusedMoEConfig], FusedMoEConfig]] = None):
    """:func:`search` over ``candidates`` (default :func:`fmoe2_candidates`); then, on sm_90 and newer, over the ``tma=True``
    twins of the TMA_TWINS fastest and the ``pdl=True`` twin of the best so far (so the picked config
    says whether tensor descriptors and programmatic dependent launch pay); then :func:`final_round`.
    ``fit`` (candidates fitted as the forward runs them, e.g. fp8 and weight-only formats, where the fit drops
    ``tma``): a twin is fitted first and left out where it runs as a config already timed.
    Returns (best, its final-round time in us, every result fastest first as :func:`final_round` ranks them)."""
    if candidates is None:
        candidates = fmoe2_candidates(M, E, H, I, topk, dtype)
    _, _, results = search(candidates, run, label)
    if cuda_sm90_or_newer():
        fit = fit or (lambda cfg: cfg)

        def new_twins(cfgs, timed):
            seen, out = {cfg for cfg, _ in timed}, []
            for cfg in cfgs:
                try:
                    cfg = fit(cfg)
                except Exception as exc:  # noqa: BLE001 - a twin that cannot run is skipped, as search skips it
                    print(f"\n  {label}: skipped {cfg}: {type(exc).__name__}", file=sys.stderr)
                    continue
                if cfg not in seen:
                    seen.add(cfg)
                    out.append(cfg)
            return out

        fastest = [cfg for cfg, _ in sorted(results, key=lambda r: r[1])[:TMA_TWINS]]
        # Twins that fail (e.g. out of shared memory) are skipped like any candidate; none may run.
        _, _, twins = search(new_twins([dataclasses.replace(cfg, tma=True) for cfg in fastest], results), run,
                             label + " tma", required=False)
        best = min(results + twins, key=lambda r: r[1])[0]
        _, _, pdl_twin = search(new_twins([dataclasses.replace(best, pdl=True)], results + twins), run,
                                label + " pdl", required=False)
        results = results + twins + pdl_twin
    results = final_round(results, run, label)
    best, us = results[0]
    return best, us, results


def final_round(results: List[Tuple[T, float]], run: Callable[[T], Callable[[], object]], label: str = "",
                finalists: int = FINALISTS) -> List[Tuple[T, float]]:
    """``results`` (``(candidate, quick us)`` of :func:`search`) ranked again: the ``finalists`` fastest timed as
    :func:`time_in_graph` times by default, in two turns (fastest first, then in reverse: a GPU whose clock drifts
    over the round favours none), each at the mean of its two times. Returns every result, fastest first: the
    finalists by their final time, then the others by their quick time (a list to walk in order, as the tuner's
    check does: the quick times of the others are on another clock than the finalists'), then any finalist that
    failed to run again (``inf``). Fewer than 2 results come back as they are, with their quick times."""
    ranked = sorted(results, key=lambda r: r[1])
    top, rest = ranked[:finalists], ranked[finalists:]
    if len(top) < 2:
        return ranked
    times = [[] for _ in top]
    for order in (range(len(top)), reversed(range(len(top)))):
        for i in order:
            try:
                times[i].append(time_in_graph(run(top[i][0])))
            except Exception as exc:  # noqa: BLE001 - as in search: a config that cannot run now is out
                times[i].append(float("inf"))
                print(f"\n  {label}: final round skipped {top[i][0]}: {type(exc).__name__}", file=sys.stderr)
    final = sorted(((cand, sum(t) / len(t)) for (cand, _), t in zip(top, times)), key=lambda r: r[1])
    print(f"  {label} final round: " + ", ".join(f"{us:.1f}" for _, us in final) + " us", file=sys.stderr,
          flush=True)
    ran = [r for r in final if r[1] != float("inf")]
    return ran + rest + [r for r in final if r[1] == float("inf")]


def baseline_candidates(M: int, E: int, topk: int) -> List[Tuple[GroupedGemmConfig, GroupedGemmConfig]]:
    """Baseline (GEMM1, GEMM2) configs to try: the same grid, one config shared by both GEMMs."""
    out = []
    for bm, bn, bk, warps, stages, _ in _grid(M, E, topk):
        cfg = GroupedGemmConfig(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, num_warps=warps, num_stages=stages)
        out.append((cfg, cfg))
    return out


def search(candidates: Iterable[T], run: Callable[[T], Callable[[], object]], label: str = "",
           calls_per_graph: int = 3, replays: int = 10,
           required: bool = True) -> Tuple[Optional[T], float, List[Tuple[T, float]]]:
    """Times each candidate (quickly) and returns (best, its time in us, all results).

    Candidates that fail to compile or launch (e.g. out of shared memory) are skipped; if none ran,
    RuntimeError, or with ``required=False`` (None, inf, []).
    Progress goes to stderr as a one-line bar.
    """
    candidates = list(candidates)
    results = []
    t0 = time.time()
    for i, cand in enumerate(candidates):
        try:
            us = time_in_graph(run(cand), calls_per_graph=calls_per_graph, replays=replays, warmup=2)
            results.append((cand, us))
        except Exception as exc:  # noqa: BLE001 - a config the GPU cannot run is just skipped
            print(f"\n  skipped {cand}: {type(exc).__name__}: {str(exc).splitlines()[0][:120]}", file=sys.stderr)
        done = i + 1
        bar = "#" * (20 * done // len(candidates))
        best = min(results, key=lambda r: r[1])[1] if results else float("nan")
        print(f"\r  {label} [{bar:<20}] {done}/{len(candidates)} best {best:.1f} us ({time.time() - t0:.0f} s)",
              end="", file=sys.stderr, flush=True)
    print(file=sys.stderr)
    if not results:
        if not required:
            return None, float("inf"), []
        raise RuntimeError(f"no candidate config ran for {label}")
    best, us = min(results, key=lambda r: r[1])
    return best, us, results


__all__ = ["fmoe2_candidates", "baseline_candidates", "search", "search_fmoe2", "final_round", "block_m_candidates"]
