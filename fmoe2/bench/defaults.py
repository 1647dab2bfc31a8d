"""Defaults benchmark: ``python -m fmoe2.bench.defaults`` — what a user gets on a shape without a tuned file.

    python -m fmoe2.bench.defaults [--shapes served|all|NAME,...] [--m 1,16,128,1024,4096] [--dtype bf16|fp8]
                                   [--routing uniform|skewed] [--candidates] [--rounds 2] [--compile-workers 8]
                                   [--out-dir misc/bench/defaults]

Per shape and batch size, on fresh random data, each forward checked against the float32 reference first, then
timed in CUDA graphs (CUDA events, median of replays), the variants taking turns over ``--rounds`` rounds:

* ``auto``: ``fused_moe`` as shipped: the tuned file of this GPU where there is one, else the default rules;
* ``defaults``: the default rules alone (``get_config(tuned=False)``). For a shape with a tuned file this is its
  leave-one-shape-out number only where the rules were not fitted on that shape (the result file says which
  shapes the rules were fitted on: ``configs/defaults.json``'s ``"fitted_on"``);
* ``vllm-default``: the vLLM-style baseline (``fmoe2/bench/vllm_style.py``) with the config vLLM runs for a shape
  it has no tuned file for (``vllm_default_config``): what a vLLM user sees without a tuned file;
* with ``--candidates``, the data the default rules are fitted from: the rules next to the one that applies
  (each on both paths) and vLLM's default tiles on fmoe2's two paths, each fitted as ``fused_moe`` fits a caller's
  config;
* with ``--loso``, the leave-one-shape-out candidates (``fmoe2/bench/loso.py``): the tuned entries of the shapes of
  ``--loso-shapes`` (default: the run's) in the point's range of rows per expert, and vLLM's tiles; the result goes
  to ``<device>__bf16_<routing>_loso.json`` and the refit's report beside it (``..._loso_refit.md``).

fmoe2's forwards include the sort (``path="auto"`` as a user calls it); the baseline includes its align.
``--routing skewed``: the logits of ``max(1, E // 16)`` hot experts get +2, so a few experts take most tokens.
``--compile-workers N`` first runs each shape's variants once in up to N processes side by side
(``fmoe2/bench/precompile.py``; ``--warm-workers``, its earlier name, in the commands of the committed results), so the
Triton cache holds the kernels (compiling is most of a cold run's time) before the timed pass. Writes ``<out-dir>/<device>__<dtype>_<routing>.json`` after
every shape, its ``.md`` report (ratios from the same run) and a plot (``.png``, with matplotlib);
``--report FILE.json`` rewrites those two from a result file.
"""
from __future__ import annotations

import argparse
import dataclasses
from dataclasses import replace
import json
import os
import sys
from typing import Dict, List, Optional

import torch

import fmoe2
from fmoe2.gemm.config import (BACKENDS, CONFIG_DIR, PATHS, ConfigMode, ConfigProblem, FusedMoEConfig, _defaults,
                               device_config_name, resolve_config, shape_file_name)
from fmoe2.gemm.fused_moe import plan_of
from fmoe2.shapes import ALL_SHAPES, SERVED_SHAPES, SHAPES
from fmoe2.target import target_of

from .ceilings import floor_us, measure_ceilings
from .problems import BF16_TOL, make_weights, random_weights, rel_err
from .precompile import add_arguments as add_compile_arguments
from .precompile import compile_in_processes, run_each_once, share_of
from .provenance import provenance_line, rewrite_report, run_record
from .timing import time_graphs_in_turns
from .loso import TUNED_PREFIX, loso_candidates, rule_range, tuned_entries
from .loso import write_report as loso_report
from .vllm_style import vllm_default_config, vllm_style_fused_experts, vllm_style_fused_experts_fp8

FP8_TOL = 1e-2  # against the reference with the same quantization (fmoe2/bench/fp8.py's SAME_QUANT_TOL)
FP8_BASELINE_TOL = 3e-2  # the baseline quantizes the intermediate before its routing weight: a little further off


def routed_inputs(M: int, E: int, H: int, topk: int, routing: str, gen: torch.Generator):
    """bf16 ``x [M, H]``, float32 ``topk_weights`` and int32 ``topk_ids [M, topk]``: softmax + top-k of random
    logits; ``skewed`` adds 2 to the logits of ``max(1, E // 16)`` hot experts (chosen at random)."""
    x = torch.randn(M, H, device=gen.device, dtype=torch.bfloat16, generator=gen)
    logits = torch.randn(M, E, device=gen.device, generator=gen)
    if routing == "skewed":
        hot = torch.randperm(E, device=gen.device, generator=gen)[:max(1, E // 16)]
        logits[:, hot] += 2.0
    topk_weights, topk_ids = torch.topk(logits.softmax(dim=-1), topk, dim=-1)
    return x, topk_weights, topk_ids.to(torch.int32)


def rule_index(rules: List[dict], tokens_per_expert: float) -> int:
    """Index of the default rule that applies at ``tokens_per_expert`` (the last beyond them all)."""
    return rule_range([r["max_tokens_per_expert"] for r in rules], tokens_per_expert)


def candidate_configs(problem: ConfigProblem, fp8: bool, target) -> Dict[str, FusedMoEConfig]:
    """label -> fitted config: the default rules next to the one that applies, each on both paths; vLLM's default
    tiles on both paths; at up to 16 rows per expert the first rule's tiles on the two-stage path with two K shares
    in stage 2; on CUDA the applying rule with tensor descriptors and programmatic dependent launch (duplicates keep
    their first label)."""
    rules = BACKENDS[target.backend].default_rules(_defaults(CONFIG_DIR), target)
    here = rule_index(rules, problem.M * problem.topk / problem.E)
    raw = {f"rule{j}": FusedMoEConfig.from_dict(rules[j]) for j in range(max(0, here - 1), min(len(rules), here + 2))}
    raw["vllm-tiles"] = vllm_tiles(problem, fp8, target)
    if problem.M * problem.topk / problem.E <= 16:  # few rows per expert: stage 2 in two K shares (Mixtral's pick)
        raw["rule0-split2"] = replace(raw.get("rule0", FusedMoEConfig.from_dict(rules[0])), path="two_stage",
                                      S2_SPLIT_K=2, S2_BLOCK_K=128, s2_num_warps=4, s2_num_stages=4)
    if target.backend == "cuda":  # tensor descriptors and programmatic dependent launch, as most tuned picks take
        raw[f"rule{here}-tma-pdl"] = replace(raw[f"rule{here}"], tma=True, pdl=True)
    out, seen = {}, set()
    for name, cfg in raw.items():
        for path in (PATHS if "split2" not in name else ("two_stage",)):
            fitted = resolve_config(problem, ConfigMode(fp8=fp8), target, cfg, path=path)
            if fitted not in seen:
                seen.add(fitted)
                out[f"{name}/{path}"] = fitted
    return out


def vllm_tiles(problem: ConfigProblem, fp8: bool, target) -> FusedMoEConfig:
    """The tiles of vLLM's default rule at ``problem`` as an fmoe2 config (both stages alike; not fitted)."""
    v = vllm_default_config(problem.M, problem.E, fp8, target.backend == "hip")
    return FusedMoEConfig(BLOCK_M=v.BLOCK_M, BLOCK_N=v.BLOCK_N, BLOCK_K=v.BLOCK_K, BLOCK_H=128,
                          GROUP_M=max(1, v.GROUP_M), num_warps=v.num_warps, num_stages=v.num_stages,
                          S2_BLOCK_N=v.BLOCK_N, S2_BLOCK_K=v.BLOCK_K, s2_num_warps=v.num_warps,
                          s2_num_stages=v.num_stages)


def rule_bounds(target) -> List[float]:
    """The default rules' ``max_tokens_per_expert`` on ``target``, in order (the ranges :mod:`fmoe2.bench.loso`
    refits)."""
    return [r["max_tokens_per_expert"] for r in BACKENDS[target.backend].default_rules(_defaults(CONFIG_DIR), target)]


def rules_key(target) -> str:
    """The key of ``defaults.json`` holding ``target``'s default rules (``"cuda"``, ``"hip"`` or an architecture's)."""
    shipped = _defaults(CONFIG_DIR)
    rules = BACKENDS[target.backend].default_rules(shipped, target)
    return next(key for key, value in shipped.items() if value is rules)


@dataclasses.dataclass
class ShapeData:
    """One shape's weights as each method takes them."""

    name: str
    E: int
    H: int
    I: int
    topk: int
    w1: torch.Tensor  # bf16, or fp8 with --dtype fp8
    w2: torch.Tensor
    prepared: object
    options: dict  # fused_moe keywords of the shape (activation, clamp)
    baseline_extra: dict  # biases (bf16) or scales (fp8) the baseline takes
    reference_extra: dict  # what fused_moe_reference takes besides options


def shape_data(name: str, dtype: str, gen: torch.Generator) -> ShapeData:
    E, H, I, topk = ALL_SHAPES[name]
    if dtype == "bf16":
        w1, w2, options, biases, prepared = make_weights(name, (E, H, I, topk), gen)
        return ShapeData(name, E, H, I, topk, w1, w2, prepared, options, biases, dict(biases))
    # fp8 weights in 128 x 128 blocks, SwiGLU without biases (the baseline's fp8 path takes no biases).
    w1, w2 = random_weights(E, H, I, gen)
    (q1, s1), (q2, s2) = fmoe2.quantize_fp8_weights(w1, "block"), fmoe2.quantize_fp8_weights(w2, "block")
    del w1, w2
    scales = dict(w1_scale=s1, w2_scale=s2, block_shape=(128, 128))
    return ShapeData(name, E, H, I, topk, q1, q2, fmoe2.prepare_weights(q1, q2, **scales), {}, scales, scales)


def point_variants(data: ShapeData, M: int, dtype: str, candidates: bool, x, tw, ti, out,
                   compare_defaults: Optional[str] = None, loso_entries: Optional[dict] = None):
    """label -> (forward, tolerance, config or None): the variants of one point (``compare_defaults``: a folder
    whose ``defaults.json`` also gives a ``defaults@`` variant; ``loso_entries``: the tuned entries the
    leave-one-shape-out refit draws from, :func:`fmoe2.bench.loso.tuned_entries`: their candidates in this point's
    range of rows per expert, :func:`loso_variants`)."""
    fp8 = dtype == "fp8"
    target = target_of(x.device)
    problem = ConfigProblem(M, data.E, data.H, data.I, data.topk, torch.bfloat16)

    def fmoe2_run(cfg):
        return lambda: fmoe2.fused_moe(x, data.prepared, None, tw, ti, out=out, config=cfg, **data.options)

    defaults = resolve_config(problem, ConfigMode(fp8=fp8), target)  # no tuned_for: the default rules alone
    tol = FP8_TOL if fp8 else BF16_TOL
    variants = {"auto": (fmoe2_run(None), tol, None), "defaults": (fmoe2_run(defaults), tol, defaults)}
    if compare_defaults is not None:
        other = resolve_config(problem, ConfigMode(fp8=fp8), target, config_dir=compare_defaults)
        variants["defaults@other"] = (fmoe2_run(other), tol, other)
    base_cfg = vllm_default_config(M, data.E, fp8, target.backend == "hip")
    if fp8:
        base = lambda: vllm_style_fused_experts_fp8(x, data.w1, data.w2, tw, ti, base_cfg, base_cfg,  # noqa: E731
                                                    **data.baseline_extra)
    else:
        base = lambda: vllm_style_fused_experts(x, data.w1, data.w2, tw, ti, base_cfg, base_cfg,  # noqa: E731
                                                **data.options, **data.baseline_extra)
    variants["vllm-default"] = (base, FP8_BASELINE_TOL if fp8 else BF16_TOL, base_cfg)
    if candidates:
        for label, cfg in candidate_configs(problem, fp8, target).items():
            variants[label] = (fmoe2_run(cfg), tol, cfg)
    if loso_entries is not None:
        variants.update(loso_variants(problem, fp8, target, loso_entries, fmoe2_run, tol))
    return variants


def loso_variants(problem: ConfigProblem, fp8: bool, target, entries: dict, fmoe2_run, tol) -> dict:
    """The leave-one-shape-out candidates of a point (:func:`fmoe2.bench.loso.loso_candidates`): label -> (forward,
    tolerance, config). (Their ``vllm-tiles/<path>`` labels are ``--candidates``' own for the same configs.) One that
    fits to the config of an earlier variant is then not timed again but aliased to it (:func:`loso_aliases`)."""
    out = {}
    for label, cfg in loso_candidates(problem, ConfigMode(fp8=fp8), target, entries, rule_bounds(target),
                                      vllm_tiles(problem, fp8, target)).items():
        out[label] = (fmoe2_run(cfg), tol, cfg)
    return out


def loso_aliases(variants: dict) -> Dict[str, str]:
    """LOSO label -> the earlier variant label of the same fitted config (timed once, under that label)."""
    seen, same_as = {}, {}
    for label, (_, _, cfg) in variants.items():
        if not isinstance(cfg, FusedMoEConfig):
            continue
        if cfg in seen and is_loso_label(label):
            same_as[label] = seen[cfg]
        else:
            seen.setdefault(cfg, label)
    return same_as


def is_loso_label(label: str) -> bool:
    return label.startswith(TUNED_PREFIX) or label.startswith("vllm-tiles/")


def point_floor_us(data: ShapeData, M: int, topk_ids: torch.Tensor, ceilings: dict) -> float:
    """The forward's floor: the bytes of the experts hit (weights and scales) and of the activations in and out over
    the copy bandwidth, or its matmul FLOPs over the 16-bit matmul rate, whichever is longer."""
    hit = int(torch.unique(topk_ids).numel())
    weight_bytes = (data.w1[0].numel() * data.w1.element_size() + data.w2[0].numel() * data.w2.element_size())
    scale_bytes = sum(v[0].numel() * v.element_size() for k, v in data.baseline_extra.items() if k.endswith("_scale"))
    return floor_us(hit * (weight_bytes + scale_bytes) + 2 * M * data.H * 2, 2 * M * data.topk * 3 * data.H * data.I,
                    ceilings)


def bench_point(data: ShapeData, M: int, dtype: str, routing: str, candidates: bool, rounds: int,
                gen: torch.Generator, compare_defaults: Optional[str] = None, ceilings: Optional[dict] = None,
                compile_share: Optional[str] = None, loso_entries: Optional[dict] = None) -> Optional[dict]:
    """One point's row; with ``compile_share`` (a compiling process, ``fmoe2/bench/precompile.py``) only that share
    of its variants run once, and None."""
    x, tw, ti = routed_inputs(M, data.E, data.H, data.topk, routing, gen)
    out = torch.empty_like(x)
    variants = point_variants(data, M, dtype, candidates, x, tw, ti, out, compare_defaults, loso_entries)
    if loso_entries is not None:
        same_as = loso_aliases(variants)
        loso_configs = {label: cfg.to_dict() for label, (_, _, cfg) in variants.items() if is_loso_label(label)}
        variants = {label: v for label, v in variants.items() if label not in same_as}
    if compile_share:
        run_each_once(share_of([fn for fn, _, _ in variants.values()], compile_share))
        return None
    ref = fmoe2.fused_moe_reference(x, data.w1, data.w2, tw, ti, **data.options, **data.reference_extra)
    errors, failed = {}, []
    for label, (fn, tol, _) in variants.items():
        out.fill_(float("nan"))  # poisoned: an unwritten element shows
        errors[label] = rel_err(fn(), ref)
        if not (errors[label] <= tol):  # reported, not timed; the run goes on and ends in failure
            failed.append(label)
            print(f"FAILED {data.name} M={M} {label}: relative error {errors[label]:.2e} > {tol:.0e}", flush=True)
    heavy = M * data.topk * data.H * data.I > 2 ** 36  # a forward of several ms: fewer replays
    times = time_graphs_in_turns({label: fn for label, (fn, _, _) in variants.items() if label not in failed}, rounds,
                       3 if heavy else 10, 6 if heavy else 15)
    times.update({label: float("nan") for label in failed})
    auto_cfg = plan_of(x, data.prepared, None, tw, ti, out=out, **data.options)
    row = dict(shape=data.name, E=data.E, H=data.H, I=data.I, topk=data.topk, M=M,
               tokens_per_expert=M * data.topk / data.E, experts_hit=int(torch.unique(ti).numel()),
               floor_us=point_floor_us(data, M, ti, ceilings), us=times, rel_err=errors, failed=failed,
               configs={label: (cfg.to_dict() if isinstance(cfg, FusedMoEConfig) else dataclasses.asdict(cfg))
                        for label, (_, _, cfg) in variants.items() if cfg is not None},
               auto_config=auto_cfg.config.to_dict() if auto_cfg is not None else None)
    if loso_entries is not None:
        for label in loso_configs:
            row["configs"].pop(label, None)  # (kept once, in candidate_configs)
        row.update(candidates=sorted(loso_configs), candidate_configs=loso_configs, same_as=same_as)
    best_fmoe2 = min(v for k, v in times.items() if k != "vllm-default" and k not in failed)
    print(f"{data.name:20s} M={M:5d}  auto {times['auto']:8.1f}  defaults {times['defaults']:8.1f}  "
          f"vllm-default {times['vllm-default']:8.1f}  (x{times['vllm-default'] / times['auto']:.2f} auto, "
          f"x{times['vllm-default'] / times['defaults']:.2f} defaults)  best fmoe2 {best_fmoe2:8.1f} "
          f"[{min((k for k in times if k != 'vllm-default' and k not in failed), key=times.get)}]", flush=True)
    return row


def tuned_shapes(device: str) -> List[str]:
    """Named shapes with a tuned bf16 file for ``device`` (``configs/<device>/``)."""
    return [name for name, (E, H, I, topk) in ALL_SHAPES.items()
            if os.path.exists(os.path.join(CONFIG_DIR, device, shape_file_name(E, H, I, topk, torch.bfloat16)))]


def markdown(result: dict) -> str:
    lines = [f"# Without a tuned file: {result['device']}, {result['dtype']}, {result['routing']} routing", "",
             provenance_line(result), "",
             "Microseconds per forward in CUDA graphs (fmoe2 with its sort, `path=\"auto\"`; the vLLM-style baseline "
             "with its align), variants taking turns in the same run. `auto`: fused_moe as shipped (tuned file "
             f"where there is one: {', '.join(result['tuned_shapes']) or 'none'}); `defaults`: the default rules "
             f"alone (fitted on {', '.join(result['rules_fitted_on'])}); `vllm-default`: the baseline with vLLM's "
             "rule for an untuned shape. Ratios: baseline time / fmoe2 time (> 1: fmoe2 faster); `defaults / best`: "
             "the defaults' time over the best fmoe2 variant timed at the point. Floor: the bytes of the experts hit "
             "and of "
             "the activations over the measured copy bandwidth, or the FLOPs over the measured bf16 matmul rate.", ""]
    if result.get("note"):
        lines += [f"Note: {result['note']}", ""]
    other = result.get("compare_defaults")
    if other:
        lines += [f"`defaults@other`: the pick of the default rules in `{other}/defaults.json`, same run.", ""]
    lines += ["| shape | M | rows/expert | auto | defaults | " + ("defaults@other | " if other else "")
              + "vllm-default | x auto | x defaults | floor | defaults / floor | vllm-default / floor | "
              "best fmoe2 variant | defaults / best |", "|---" * (14 if other else 13) + "|"]
    for r in result["results"]:
        t = r["us"]
        best_label = min((k for k in t if k != "vllm-default" and k not in r.get("failed", ())), key=t.get)
        floor = r.get("floor_us")  # (runs before the floor was measured have none)
        floors = (f"{floor:.1f} | {t['defaults'] / floor:.2f} | {t['vllm-default'] / floor:.2f}" if floor
                  else "- | - | -")
        lines.append(f"| {r['shape']} | {r['M']} | {r['tokens_per_expert']:g} | {t['auto']:.1f} | {t['defaults']:.1f} "
                     + (f"| {t['defaults@other']:.1f} " if other else "")
                     + f"| {t['vllm-default']:.1f} | {t['vllm-default'] / t['auto']:.2f} | "
                     f"{t['vllm-default'] / t['defaults']:.2f} | {floors} | {best_label} {t[best_label]:.1f} | "
                     f"{t['defaults'] / t[best_label]:.2f} |")
    return "\n".join(lines) + "\n"


def plot(result: dict, path: str) -> Optional[str]:
    """``path`` (.png): per shape, the vLLM-style baseline's time with vLLM's default rule over fmoe2's (the default
    rules, and as shipped) by batch size; with ``compare_defaults`` also the other rules' time over this one's.
    None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    other = bool(result.get("compare_defaults"))
    fig, axes = plt.subplots(1, 2 if other else 1, figsize=(13 if other else 7, 5), squeeze=False)
    shapes = list(dict.fromkeys(r["shape"] for r in result["results"]))
    panels = [("vllm-default", "defaults", "vLLM-style with vLLM's default rule / fmoe2 defaults")]
    if other:
        panels.append(("defaults@other", "defaults", "previous default rules / new default rules (fmoe2)"))
    for ax, (num, den, title) in zip(axes[0], panels):
        ax.set_prop_cycle(color=plt.cm.tab20.colors[:len(shapes)])  # one colour per shape (up to 20)
        for name in shapes:
            rows = [r for r in result["results"] if r["shape"] == name]
            ax.plot([r["M"] for r in rows], [r["us"][num] / r["us"][den] for r in rows], marker="o", label=name)
        ax.axhline(1.0, color="gray", linestyle="--", linewidth=1)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("tokens M")
        ax.set_ylabel("time ratio (> 1: fmoe2's new defaults faster)")
        ax.set_title(title, fontsize=10)
        ax.grid(True, alpha=0.3)
    axes[0][-1].legend(fontsize=7, loc="upper left")
    fig.suptitle(f"Without a tuned file: {result['device']}, {result['dtype']}, {result['routing']} routing")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(prog="python -m fmoe2.bench.defaults", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--shapes", default="all",
                   help=f"served (issue 46's models: {','.join(SERVED_SHAPES)}), all (served and {','.join(SHAPES)}) "
                        f"or names from {sorted(ALL_SHAPES)}")
    p.add_argument("--m", default="1,16,128,1024,4096")
    p.add_argument("--dtype", default="bf16", choices=("bf16", "fp8"), help="weights (fp8: 128 x 128 block scales)")
    p.add_argument("--routing", default="uniform", choices=("uniform", "skewed"))
    p.add_argument("--candidates", action="store_true", help="also time the configs the default rules are fitted from")
    p.add_argument("--loso", action="store_true",
                   help="also time the leave-one-shape-out candidates (every run shape's tuned entries in the point's "
                        "range of rows per expert, vLLM's tiles): `python -m fmoe2.bench.loso --report` refits the "
                        "rules from them")
    p.add_argument("--loso-shapes", default=None,
                   help="with --loso: the shapes whose tuned entries are the candidates (served, all or names; "
                        "default: --shapes), e.g. all of them while this run times a part, one GPU each")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    add_compile_arguments(p, "every variant")
    # (the flag's earlier name, in the commands of the results in misc/bench/defaults)
    p.add_argument("--warm-workers", dest="compile_workers", type=int, help=argparse.SUPPRESS)
    p.add_argument("--compare-defaults", default=None,
                   help="a folder holding another defaults.json: its pick is timed too (variant defaults@other)")
    p.add_argument("--report", default=None, metavar="JSON",
                   help="only rewrite the report (.md) and plot (.png) of a result file, here without a GPU")
    p.add_argument("--out-dir", default=os.path.join("misc", "bench", "defaults"))
    a = p.parse_args(argv)
    if a.report:
        print(rewrite_report(a.report, markdown))
        print(plot(json.load(open(a.report)), a.report[:-len(".json")] + ".png") or "no plot: matplotlib is missing")
        return 0
    if not torch.cuda.is_available():
        p.error("the benchmark needs a CUDA or ROCm GPU")
    groups = {"served": list(SERVED_SHAPES), "all": list(SERVED_SHAPES) + list(SHAPES)}
    names = groups.get(a.shapes, a.shapes.split(","))
    loso_names = groups.get(a.loso_shapes, a.loso_shapes.split(",")) if a.loso_shapes else names
    unknown = [n for n in names + loso_names if n not in ALL_SHAPES]
    if unknown:
        p.error(f"unknown shapes {unknown}; known: {sorted(ALL_SHAPES)}")
    ms = [int(m) for m in a.m.split(",")]
    if a.loso and a.dtype != "bf16":
        p.error("--loso refits the 16-bit default rules: bf16 weights only")
    mode = (["--m", a.m, "--dtype", a.dtype, "--routing", a.routing, "--seed", str(a.seed)]
            + (["--candidates"] if a.candidates else []) + (["--loso", "--loso-shapes", ",".join(loso_names)]
                                                            if a.loso else [])
            + (["--compare-defaults", a.compare_defaults] if a.compare_defaults else []))
    ceilings = None if a.compile_share else measure_ceilings()
    device = device_config_name()
    loso_entries = tuned_entries(loso_names, device, torch.bfloat16) if a.loso else None
    result = {**run_record("python -m fmoe2.bench.defaults", argv), "dtype": a.dtype, "routing": a.routing,
              "rule_bounds": rule_bounds(target_of(torch.device("cuda"))),
              **({"loso_entries": loso_entries, "rules_key": rules_key(target_of(torch.device("cuda")))}
                 if a.loso else {}),
              "tuned_shapes": [n for n in tuned_shapes(device) if n in names],
              "rules_fitted_on": _defaults(CONFIG_DIR).get("fitted_on", list(SHAPES)), "ceilings": ceilings,
              "compare_defaults": a.compare_defaults, "results": []}
    path = os.path.join(a.out_dir, f"{device}__{a.dtype}_{a.routing}{'_loso' if a.loso else ''}.json")
    for name in names:
        if a.compile_workers and not a.compile_share:
            E, H, I, _ = ALL_SHAPES[name]  # a process holds about 4 bytes per weight (two bf16 copies, or fp8's)
            compile_in_processes([sys.executable, "-m", "fmoe2.bench.defaults", *mode, "--shapes", name],
                                 a.compile_workers, 4 * E * 3 * H * I, name)
        gen = torch.Generator(device="cuda").manual_seed(a.seed)
        data = shape_data(name, a.dtype, gen)
        for M in ms:
            row = bench_point(data, M, a.dtype, a.routing, a.candidates, a.rounds, gen, a.compare_defaults, ceilings,
                              a.compile_share, loso_entries)
            if row is not None:
                result["results"].append(row)
        del data
        torch.cuda.empty_cache()
        if not a.compile_share:
            os.makedirs(a.out_dir, exist_ok=True)
            with open(path, "w") as f:
                json.dump(result, f, indent=1)
            rewrite_report(path, markdown, result)
            plot(result, path[:-len(".json")] + ".png")
    if a.compile_share:
        return 0
    print(f"wrote {path}" + (f" and {loso_report(path, result)}" if a.loso else ""))
    failed = [(r["shape"], r["M"], label) for r in result["results"] for label in r["failed"]]
    if failed:
        print(f"{len(failed)} forwards off the reference (not timed): {failed}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
