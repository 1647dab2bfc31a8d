"""LoRA benchmark: ``python -m fmoe2.bench --lora`` — fused multi-LoRA vs the plain fused forward
and vs the vLLM-style path with separate shrink/expand kernels, end to end, bf16.

Per shape and batch (default M = 1, 16, 128, 1024; rank 16; 4 adapters spread uniformly over the
tokens, 20% of tokens without one), each variant runs the config ``fused_moe`` picks for it
(with ``--search``: the best LoRA config, for every variant):

* ``plain``: ``fused_moe`` without adapters (``get_config``, fused or two-stage as tuned);
* ``lora``: mixed adapters; ``lora_none``: the adapters passed but every token -1;
  ``lora_one``: one adapter for all tokens (base-weight traffic must not depend on the mix); all
  three on ``get_config(lora=True)``, the plain pick with its tiling fitted to the adapters' steps
  (on the two-stage path the deltas come from LoRA launches, or at decode sizes from the stages
  themselves: ``lora_in_stages``);
* ``lora_other_path``: where the plain pick is two-stage, mixed adapters on the path the LoRA pick
  did not take, to check that choice in the same run;
* ``baseline`` / ``baseline_lora``: ``fmoe2/bench/vllm_style.py`` / ``vllm_style_lora.py``, base
  GEMM configs from this device's plain benchmark results (or searched when there are none).

Writes ``misc/bench/lora/<device>__<shape>.json``, ``misc/bench/lora/<device>.md`` and
``misc/<device>_lora.png``.
"""
from __future__ import annotations

import glob
import json
import math
import os

import torch

import fmoe2
from fmoe2.gemm.config import device_config_name, fit_lora_config_to_problem
from fmoe2.target import target_of

from .search import baseline_candidates, fmoe2_candidates, search
from .timing import time_in_graph, time_interleaved
from .vllm_style import GroupedGemmConfig, vllm_style_fused_experts
from .vllm_style_lora import prepare_baseline_lora, vllm_style_fused_experts_lora

BF16_TOL = 2.5e-2
# Rounds of the interleaved timing (time_interleaved): the none/plain ratio is judged against 1.02x, and
# timed once each, one after the other, the same code gave Mixtral M=1024 1.033x here and 1.013x in a
# script that took turns (H100, 2026-11-23).
TIMING_ROUNDS = 3


def make_adapters(num_loras, E, H, I, rank, gen, scaling=0.5):
    """Random bf16 adapters (:class:`fmoe2.MoELoRA`, ``num_loras`` of rank ``rank``) on ``gen``'s device, whose
    deltas are of the order of the base terms."""

    def rand(*shape, fan_in):
        return torch.randn(*shape, device=gen.device, dtype=torch.bfloat16, generator=gen) / math.sqrt(fan_in)

    return fmoe2.MoELoRA(
        gate_a=rand(num_loras, E, rank, H, fan_in=H), gate_b=rand(num_loras, E, I, rank, fan_in=rank),
        up_a=rand(num_loras, E, rank, H, fan_in=H), up_b=rand(num_loras, E, I, rank, fan_in=rank),
        down_a=rand(num_loras, E, rank, I, fan_in=I), down_b=rand(num_loras, E, H, rank, fan_in=rank),
        scaling=scaling)


def make_token_lora_ids(M, num_loras, gen, none_fraction):
    """int32 ``[M]``: adapters uniform over the tokens, about ``none_fraction`` of them -1, and at
    least one token with an adapter (at M=1 the one token may draw none, and a "mixed" batch would
    then time no adapter work at all)."""
    ids = torch.randint(0, num_loras, (M,), device=gen.device, dtype=torch.int32, generator=gen)
    ids[torch.rand(M, device=gen.device, generator=gen) < none_fraction] = -1
    if not bool((ids >= 0).any()):
        ids[0] = 0
    return ids


def weight_bytes_with_adapters(topk_ids: torch.Tensor, token_lora_ids: torch.Tensor, num_experts: int, H: int,
                               I: int, rank: int, num_loras: int) -> float:
    """Weight bytes a forward with adapters must read over those of the plain forward (>= 1).

    ``topk_ids`` ``[M, topk]`` and ``token_lora_ids`` ``[M]`` (int; -1 or any id outside
    ``[0, num_loras)`` = none). Every expert hit reads its base weights (``3 * H * I`` elements)
    either way; every (adapter, expert) pair hit adds that adapter's A and B of gate, up and down
    (``rank * (3 * H + 3 * I)`` elements, vLLM's layouts). Where the plain forward runs at the
    memory floor this ratio is the lowest LoRA / plain any method can reach.
    """
    experts = topk_ids.long()
    lora_ids = token_lora_ids.long()[:, None].expand_as(experts)
    has = (lora_ids >= 0) & (lora_ids < num_loras) & (experts >= 0) & (experts < num_experts)
    experts_hit = int(torch.unique(experts[(experts >= 0) & (experts < num_experts)]).numel())
    pairs_hit = int(torch.unique(lora_ids[has] * num_experts + experts[has]).numel())
    if experts_hit == 0:
        return 1.0
    return 1.0 + pairs_hit * rank * (3 * H + 3 * I) / (experts_hit * 3 * H * I)


def _plain_baseline_configs(plain_dir, name, M):
    """The baseline's tuned configs for this device, shape and batch from ``python -m fmoe2.bench``."""
    path = os.path.join(plain_dir, f"{device_config_name()}__{name}.json")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        rows = [r for r in json.load(f)["results"] if r["M"] == M]
    if not rows:
        return None
    cfg = GroupedGemmConfig(**rows[0]["baseline_config"])
    return cfg, cfg


def bench_lora_shape(name, shape, ms, ceilings, gen, rank=16, num_loras=4, none_fraction=0.2, do_search=False,
                     plain_dir=os.path.join("misc", "bench")):
    from .ceilings import stage_times
    from .problems import make_inputs, rel_err

    E, H, I, topk = shape
    w1 = torch.randn(E, 2 * I, H, device="cuda", dtype=torch.bfloat16, generator=gen) / math.sqrt(H)
    w2 = torch.randn(E, H, I, device="cuda", dtype=torch.bfloat16, generator=gen) / math.sqrt(I)
    prepared = fmoe2.prepare_weights(w1, w2)
    lora = make_adapters(num_loras, E, H, I, rank, gen)
    lora_prepared = fmoe2.prepare_lora(lora)
    lora_base = prepare_baseline_lora(lora)
    rows = []
    for M in ms:
        x, tw, ti = make_inputs(M, E, H, I, topk, gen)
        out = torch.empty_like(x)
        ids_mixed = make_token_lora_ids(M, num_loras, gen, none_fraction)
        ids_none = torch.full((M,), -1, dtype=torch.int32, device="cuda")
        ids_one = torch.zeros(M, dtype=torch.int32, device="cuda")

        def run_fmoe2(cfg, ids=None):
            if ids is None:
                return lambda: fmoe2.fused_moe(x, prepared, None, tw, ti, out=out, config=cfg)
            return lambda: fmoe2.fused_moe(x, prepared, None, tw, ti, out=out, config=cfg, lora=lora_prepared,
                                           token_lora_ids=ids)

        cfg = fmoe2.get_config(M, E, H, I, topk, torch.bfloat16)  # what fused_moe runs without adapters
        lora_cfg = fmoe2.get_config(M, E, H, I, topk, torch.bfloat16, lora=True)  # ... and with them
        if do_search:
            cfg, _, _ = search(fmoe2_candidates(M, E, H, I, topk, torch.bfloat16), lambda c: run_fmoe2(c, ids_mixed),
                               f"{name} M={M} fmoe2 lora")
            lora_cfg = fit_lora_config_to_problem(cfg, M, E, H, I, topk, torch.bfloat16, target_of().num_sms,
                                                  shared_memory=target_of().shared_memory)
        base_cfgs = _plain_baseline_configs(plain_dir, name, M)
        if base_cfgs is None:
            base_cfgs, _, _ = search(baseline_candidates(M, E, topk),
                                     lambda c: (lambda: vllm_style_fused_experts(x, w1, w2, tw, ti, *c)),
                                     f"{name} M={M} baseline")

        ref = fmoe2.fused_moe_reference(x.float(), w1.float(), w2.float(), tw, ti, lora=lora, token_lora_ids=ids_mixed)
        err_f = rel_err(run_fmoe2(lora_cfg, ids_mixed)().clone(), ref)
        err_b = rel_err(vllm_style_fused_experts_lora(x, w1, w2, tw, ti, lora_base, ids_mixed, *base_cfgs), ref)
        t = time_interleaved(dict(
            plain_us=run_fmoe2(cfg),
            lora_us=run_fmoe2(lora_cfg, ids_mixed),
            lora_none_us=run_fmoe2(lora_cfg, ids_none),
            lora_one_us=run_fmoe2(lora_cfg, ids_one),
            baseline_us=lambda: vllm_style_fused_experts(x, w1, w2, tw, ti, *base_cfgs),
            baseline_lora_us=lambda: vllm_style_fused_experts_lora(x, w1, w2, tw, ti, lora_base, ids_mixed, *base_cfgs),
        ), rounds=TIMING_ROUNDS)
        t["lora_launch_us"] = stage_times(x, prepared, tw, ti, lora_cfg, out, lora=lora_prepared,
                                          token_lora_ids=ids_mixed)
        if cfg.path == "two_stage":
            other = "fused" if lora_cfg.path == "two_stage" else "two_stage"
            other_cfg = fmoe2.get_config(M, E, H, I, topk, torch.bfloat16, path=other, lora=True)
            t["lora_other_path_us"] = time_in_graph(run_fmoe2(other_cfg, ids_mixed))
        row = dict(shape=name, E=E, H=H, I=I, topk=topk, M=M, path=cfg.path, lora_path=lora_cfg.path, rank=rank,
                   num_loras=num_loras,
                   tokens_without_adapter=int((ids_mixed < 0).sum()), timing_rounds=TIMING_ROUNDS, **t,
                   weight_bytes_lora_over_plain=weight_bytes_with_adapters(ti, ids_mixed, E, H, I, rank, num_loras),
                   lora_over_plain=t["lora_us"] / t["plain_us"], none_over_plain=t["lora_none_us"] / t["plain_us"],
                   one_over_plain=t["lora_one_us"] / t["plain_us"],
                   speedup_vs_baseline_lora=t["baseline_lora_us"] / t["lora_us"],
                   baseline_lora_over_baseline=t["baseline_lora_us"] / t["baseline_us"],
                   fmoe2_rel_err=err_f, baseline_rel_err=err_b, fmoe2_config=cfg.to_dict(),
                   fmoe2_lora_config=lora_cfg.to_dict(),
                   baseline_config=base_cfgs[0].__dict__)
        rows.append(row)
        print(f"{name:17s} M={M:5d} {cfg.path:9s} plain {t['plain_us']:8.1f}  {lora_cfg.path:9s} lora {t['lora_us']:8.1f} "
              f"({row['lora_over_plain']:.2f}x)"
              f"  none {row['none_over_plain']:.3f}x  one {row['one_over_plain']:.2f}x  baseline lora "
              f"{t['baseline_lora_us']:8.1f} ({row['speedup_vs_baseline_lora']:.2f}x)  err {err_f:.1e}/{err_b:.1e}",
              flush=True)
        if max(err_f, err_b) > BF16_TOL or not (math.isfinite(err_f) and math.isfinite(err_b)):
            raise SystemExit(f"{name} M={M}: LoRA result off (fmoe2 {err_f:.2e}, baseline {err_b:.2e})")
    return rows


def write_lora_report(out_dir: str, device: str, plot_dir: str) -> str:
    runs = []
    for path in sorted(glob.glob(os.path.join(out_dir, f"{device}__*.json"))):
        with open(path) as f:
            runs.append(json.load(f))
    if not runs:
        return f"no LoRA results for {device} in {out_dir}"
    head = runs[0]
    r0 = head["results"][0]
    lines = [f"# fmoe2 multi-LoRA benchmark on {head['device']}", "",
             f"- rank {r0['rank']}, {r0['num_loras']} adapters uniform over the tokens, about 20% of tokens without "
             "one; bf16; 10 calls per CUDA graph, CUDA events, median of 50 replays (and of the rounds in which the "
             "variants take turns, where a run lists them)",
             "- plain = fmoe2 without adapters on the path `get_config` picks (path column); LoRA, none (adapters "
             "passed, every token -1) and one (a single adapter for all tokens) on the path `get_config(lora=True)` "
             "picks (LoRA path column), as `fused_moe` runs them; other path = mixed adapters on the path the LoRA "
             "pick did not take, where the plain pick is two-stage",
             "- weight bytes, LoRA / plain: the base weights of the experts hit plus the adapters of every (adapter, "
             "expert) pair the mixed batch hits, over the base weights alone (`weight_bytes_with_adapters`): where "
             "the plain forward reads its weights at the memory floor, no LoRA method gets below this LoRA / plain"]
    if any("lora_path" not in r for run in runs for r in run["results"]):
        lines.append("- results from before `get_config(lora=True)` (2026-11-23) ran the LoRA columns on the plain "
                     "pick's path; their other path is the fused one")
    lines.append("- runs:")
    for run in runs:
        rounds = max(r.get("timing_rounds", 1) for r in run["results"])
        lines.append(f"  - {', '.join(sorted({r['shape'] for r in run['results']}))}: {run['date']}, torch "
                     f"{run['torch']}, Triton {run['triton']}, `{run['command']}`"
                     + (f", {rounds} interleaved rounds" if rounds > 1 else ""))
    lines += ["",
              "| shape | M | path | plain (us) | LoRA path | LoRA (us) | LoRA / plain | weight bytes, LoRA / plain | "
              "none / plain | one / plain | "
              "LoRA, other path (us) | baseline (us) | baseline LoRA (us) | speedup vs baseline LoRA | "
              "rel. err fmoe2 / baseline |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for run in runs:
        for r in run["results"]:
            # Results from before get_config(lora=True) ran LoRA on the plain path and timed the fused one beside it.
            other_us = r.get("lora_other_path_us", r.get("lora_fused_us"))
            other = f"{other_us:.1f}" if other_us is not None else "-"
            path = r.get("path", "fused")
            nbytes = r.get("weight_bytes_lora_over_plain")  # results from before this column lack it
            nbytes = f"{nbytes:.3f}x" if nbytes is not None else "-"
            lines.append(f"| {r['shape']} | {r['M']} | {path} | {r['plain_us']:.1f} | {r.get('lora_path', path)} | "
                         f"{r['lora_us']:.1f} | {r['lora_over_plain']:.2f}x | {nbytes} | {r['none_over_plain']:.3f}x | "
                         f"{r['one_over_plain']:.2f}x | {other} | {r['baseline_us']:.1f} | {r['baseline_lora_us']:.1f} | "
                         f"{r['speedup_vs_baseline_lora']:.2f}x | {r['fmoe2_rel_err']:.1e} / {r['baseline_rel_err']:.1e} |")
    launches = [(r["shape"], r["M"], r["lora_launch_us"]) for run in runs for r in run["results"]
                if r.get("lora_launch_us")]
    if launches:
        lines += ["", "Launches of the mixed-adapter forward (LoRA path), each timed alone in its own graph (us):", "",
                  "| shape | M | launches |", "|---|---|---|"]
        lines += [f"| {shape} | {M} | " + ", ".join(f"{name} {us:.1f}" for name, us in times.items()) + " |"
                  for shape, M, times in launches]
    md_path = os.path.join(out_dir, f"{device}.md")
    with open(md_path, "w") as f:
        f.write("\n".join(lines) + "\n")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return f"wrote {md_path}"
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for run in runs:
        rs = run["results"]
        ms = [r["M"] for r in rs]
        axes[0].plot(ms, [r["lora_over_plain"] for r in rs], marker="o", label=rs[0]["shape"])
        axes[1].plot(ms, [r["speedup_vs_baseline_lora"] for r in rs], marker="o", label=rs[0]["shape"])
    axes[0].axhline(1.10, color="gray", linestyle="--", linewidth=1)
    axes[1].axhline(1.5, color="gray", linestyle="--", linewidth=1)
    for ax, ylabel in zip(axes, ("LoRA forward / plain forward", "speedup vs vLLM-style LoRA path")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("tokens M")
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.suptitle(f"fmoe2 multi-LoRA on {head['device']} (bf16, rank {r0['rank']}, {r0['num_loras']} adapters)")
    fig.tight_layout()
    plot_path = os.path.join(plot_dir, f"{device}_lora.png")
    fig.savefig(plot_path, dpi=100)
    plt.close(fig)
    return f"wrote {md_path} {plot_path}"
