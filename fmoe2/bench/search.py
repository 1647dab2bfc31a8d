"""The config search space shared by the tuner (fmoe2) and the benchmark's baseline, so both get
the same chance: same BLOCK_M choices per batch, same BLOCK_N/BLOCK_K/warps/stages grid."""
from __future__ import annotations

import dataclasses
import itertools
import sys
import time
from typing import Callable, Iterable, List, Optional, Sequence, Tuple, TypeVar

import torch

from ..gemm.config import FusedMoEConfig, fit_config, current_backend
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


def fmoe2_candidates(M: int, E: int, H: int, I: int, topk: int, dtype: torch.dtype) -> List[FusedMoEConfig]:
    """fmoe2 configs to try, after the picker's own clamps (duplicates removed): the fused path
    always, the two-stage path once experts get more than 16 tokens each, and at decode sizes a few
    two-stage configs with narrow slices (the fused path's slices stay wide because of the atomic-add
    cap, which can leave multiprocessors idle: Qwen3 M=1 runs 96 fused programs on 132)."""
    hip = current_backend() == "hip"
    hip_opts = {"waves_per_eu": 0, "matrix_instr_nonkdim": 16} if hip else {}
    seen, out = set(), []

    def add(cfg):
        cfg = fit_config(cfg, H, I, topk, dtype)
        if cfg not in seen:
            seen.add(cfg)
            out.append(cfg)

    for bm, bn, bk, warps, stages, group in _grid(M, E, topk):
        add(FusedMoEConfig(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, BLOCK_H=64 if bn >= 256 else 128, GROUP_M=group,
                           num_warps=warps, num_stages=2 if hip else stages, **hip_opts))
    if _regime(M, E, topk) == "decode":
        for bn, s2_bn in itertools.product((32, 64), (64, 128)):
            bk = 64 if hip else 128  # 2 stages of 128-wide K tiles would not fit gfx942's 64 KiB of LDS
            add(FusedMoEConfig(BLOCK_M=16, BLOCK_N=bn, BLOCK_K=bk, BLOCK_H=128, GROUP_M=1, num_warps=4,
                               num_stages=2 if hip else 4, path="two_stage", S2_BLOCK_N=s2_bn, S2_BLOCK_K=bk,
                               S2_GROUP_M=1, s2_num_warps=4, s2_num_stages=2 if hip else 4, **hip_opts))
    else:
        for bm, bn, s2_bn, s2_stages in itertools.product(block_m_candidates(M, E, topk), (64, 128), (128, 256),
                                                          (3, 4)):
            add(FusedMoEConfig(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=64, BLOCK_H=128, GROUP_M=8, num_warps=8,
                               num_stages=2 if hip else 3, path="two_stage", S2_BLOCK_N=s2_bn, S2_BLOCK_K=64,
                               S2_GROUP_M=8, s2_num_warps=8, s2_num_stages=2 if hip else s2_stages, **hip_opts))
    return out


TMA_TWINS = 3  # fastest pointer-load configs retried with tensor-descriptor loads


def cuda_sm90_or_newer() -> bool:
    """A CUDA GPU of compute capability >= 9: tensor descriptors lower to TMA, PDL is there."""
    return current_backend() == "cuda" and torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9


def search_fmoe2(M: int, E: int, H: int, I: int, topk: int, dtype: torch.dtype,
                 run: Callable[[FusedMoEConfig], Callable[[], object]], label: str = ""):
    """:func:`search` over :func:`fmoe2_candidates`; then, on sm_90 and newer, over the ``tma=True``
    twins of the TMA_TWINS fastest and the ``pdl=True`` twin of the best so far (so the picked config
    says whether tensor descriptors and programmatic dependent launch pay).
    Returns (best, its time in us, all results)."""
    best, us, results = search(fmoe2_candidates(M, E, H, I, topk, dtype), run, label)
    if cuda_sm90_or_newer():
        fastest = [cfg for cfg, _ in sorted(results, key=lambda r: r[1])[:TMA_TWINS]]
        # Twins that fail (e.g. out of shared memory) are skipped like any candidate; none may run.
        _, _, twins = search([dataclasses.replace(cfg, tma=True) for cfg in fastest], run, label + " tma",
                             required=False)
        best = min(results + twins, key=lambda r: r[1])[0]
        _, _, pdl_twin = search([dataclasses.replace(best, pdl=True)], run, label + " pdl", required=False)
        results = results + twins + pdl_twin
        best, us = min(results, key=lambda r: r[1])
    return best, us, results


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


__all__ = ["fmoe2_candidates", "baseline_candidates", "search", "search_fmoe2", "block_m_candidates"]
