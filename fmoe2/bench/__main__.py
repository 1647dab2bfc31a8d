"""Benchmark: ``python -m fmoe2.bench`` — fmoe2 vs a vLLM-style Triton path, end to end, bf16.

    python -m fmoe2.bench [--shapes mixtral-8x7b,qwen3-30b-a3b,deepseek-v2-lite | --shape E,H,I,topk]
                          [--m 1,16,128,1024,4096] [--no-search] [--update] [--out-dir misc/bench]
                          [--compile-workers 8]
    python -m fmoe2.bench --lora [--rank 16] [--num-loras 4] [--search]     (see fmoe2/bench/lora.py)
    python -m fmoe2.bench --dtype fp8 [--scheme block|channel|tensor]       (see fmoe2/bench/fp8.py)
    python -m fmoe2.bench --deterministic [--candidates]                     (see fmoe2/bench/deterministic.py)
    python -m fmoe2.bench --prefill [--routing uniform,skewed] [--tails 64]   (see fmoe2/bench/prefill.py)

Per shape and batch: fresh random bf16 data, softmax+top-k routing of random logits; both methods
get their best config from the same grid of tiles, warps and stages (``fmoe2/bench/search.py``;
fmoe2 also searches its path and, on sm_90, tensor-descriptor loads), are timed like vLLM's
benchmark_moe.py (10 calls in one CUDA graph, CUDA events, median of replays; a point's variants
captured together and replayed in turns, ``TIMING``), then checked against the float32 reference
(the run stops at a result off it). Everything a caller pays is inside the timed call. The same run
measures the device ceilings (copy bandwidth, bf16 matmul rate) for the floor
``max(bytes of the experts hit + activations / bandwidth, flops / rate)``, times each launch of
fmoe2's forward alone and, at compute-bound points, the two GEMMs as dense cuBLAS batched products.
Writes ``<out-dir>/<device>__<shape>.json`` (with ``--update``, only the rows of the batch sizes
rerun are replaced; the file then lists each run its rows come from) and regenerates
``<out-dir>/<device>.md`` and the plots;
``python -m fmoe2.bench.report --write-configs`` turns fmoe2's searched configs into tuned files.
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import shlex
import sys

import torch
import triton

import fmoe2
from fmoe2.fp8 import SCHEMES
from fmoe2.gemm.config import device_config_name
from fmoe2.shapes import ALL_SHAPES, SHAPES

from .ceilings import dense_gemm_us, floor_us, measure_ceilings, stage_times
from .precompile import add_arguments as add_compile_arguments
from .precompile import compile_in_processes, run_each_once, share_of
from .problems import BF16_TOL, make_inputs, make_weights, rel_err
from .report import merge_results, write_report
from .search import baseline_candidates, final_round, fmoe2_candidates, search, search_fmoe2
from .timing import time_graphs_in_turns, time_in_graph
from .vllm_style import vllm_style_fused_experts


def try_vllm():
    try:
        from vllm.model_executor.layers.fused_moe import fused_experts  # type: ignore
    except Exception:  # noqa: BLE001 - vllm is optional
        return None
    return fused_experts


# A point's variants (fmoe2's pick, the default rules', fused_moe's own, plain weights, the fused path's best, the
# baseline) are captured together and replayed in turns: TIMING_TURNS rounds of TIMING_REPLAYS replays of 10 calls
# each (about the 50 replays a variant took alone before 2026-11-30), the median of all.
TIMING_TURNS = 3
TIMING_REPLAYS = 17
TIMING = (f"a point's variants captured together (10 calls per CUDA graph) and replayed in {TIMING_TURNS} turns of "
          f"{TIMING_REPLAYS} replays each, CUDA events, the median of all")


def distinct_configs(configs: dict) -> tuple:
    """(label -> config of the first label of each distinct config, label -> that first label for the others):
    each config is timed once; None (no such variant) is left out of both."""
    timed, same = {}, {}
    for label, cfg in configs.items():
        if cfg is None:
            continue
        first = next((other for other, c in timed.items() if c == cfg), None)
        if first is None:
            timed[label] = cfg
        else:
            same[label] = first
    return timed, same


def bench_shape(name, shape, ms, do_search, ceilings, gen):
    E, H, I, topk = shape
    w1, w2, options, biases, prepared = make_weights(name, shape, gen)
    vllm_fused_experts = try_vllm()
    rows = []
    for M in ms:
        x, tw, ti = make_inputs(M, E, H, I, topk, gen)
        out = torch.empty_like(x)
        experts_hit = int(torch.unique(ti).numel())
        flops = 2 * M * topk * 3 * H * I
        floor = floor_us(experts_hit * 3 * H * I * 2 + 2 * M * H * 2, flops, ceilings)

        def run_fmoe2(cfg):
            return lambda: fmoe2.fused_moe(x, prepared, None, tw, ti, out=out, config=cfg, **options)

        def run_base(cfgs):
            return lambda: vllm_style_fused_experts(x, w1, w2, tw, ti, *cfgs, **options, **biases)

        picked_cfg = fmoe2.get_config(M, E, H, I, topk, torch.bfloat16)  # what fused_moe runs here
        default_cfg = fmoe2.get_config(M, E, H, I, topk, torch.bfloat16, tuned=False)  # without a tuned file
        if do_search:
            f_cfg, t_final, f_all = search_fmoe2(M, E, H, I, topk, torch.bfloat16, run_fmoe2, f"{name} M={M} fmoe2")
            _, _, b_all = search(baseline_candidates(M, E, topk), run_base, f"{name} M={M} baseline")
            b_cfgs = final_round(b_all, run_base, f"{name} M={M} baseline")[0][0]  # (as fmoe2's search ends)
            fused_cfg = next(cfg for cfg, _ in f_all if cfg.path == "fused")  # (f_all is ranked, fastest first)
        else:
            f_cfg, b_cfgs = picked_cfg, baseline_candidates(M, E, topk)[0]
            fused_cfg = f_cfg if f_cfg.path == "fused" else None
            t_final = None

        # The point's variants take turns (TIMING_TURNS rounds, all captured first), before the float32 reference:
        # timed one after the other, the first after the searches and the reference (float32 copies of all the
        # weights, 45 GB at DeepSeek-V3) came out 11-12% above the same config's final-round time in the same run
        # at bandwidth-bound M=1 points, and the next ones not (2026-11-29: DeepSeek-V3 190.4 against 169.1 us,
        # then 170.6 with plain weights; gpt-oss-120b 64.9 against 58.6).
        # ("picked": what fused_moe runs here by itself, the tuned file's entry where there is one; the searched
        # best is an upper bound the tuned entries are meant to reach.)
        timed, same = distinct_configs({"fmoe2": f_cfg, "default": default_cfg, "picked": picked_cfg,
                                        "fused": fused_cfg})
        variants = {label: run_fmoe2(cfg) for label, cfg in timed.items()}
        variants["plain"] = lambda: fmoe2.fused_moe(x, w1, w2, tw, ti, out=out, config=f_cfg, **options, **biases)
        variants["baseline"] = run_base(b_cfgs)
        t = time_graphs_in_turns(variants, TIMING_TURNS, 10, TIMING_REPLAYS)
        t.update({label: t[first] for label, first in same.items()})
        t_f, t_default, t_picked, t_plain, t_b = (t[k] for k in ("fmoe2", "default", "picked", "plain", "baseline"))
        t_fused = t.get("fused", float("nan"))
        t_sort = time_in_graph(lambda: fmoe2.moe_sorting(ti, tw, E, f_cfg.BLOCK_M, out=out))
        stages = stage_times(x, prepared, tw, ti, f_cfg, out, **options)
        # Compute-bound points (>= 256 routed rows per expert): what cuBLAS reaches on the same GEMMs.
        dense_gen = torch.Generator(device="cuda").manual_seed(M)
        t_dense = dense_gemm_us(E, H, I, M * topk // E, dense_gen) if M * topk >= 256 * E else None
        vllm_us = time_in_graph(lambda: vllm_fused_experts(x, w1, w2, tw, ti)) if (
            vllm_fused_experts is not None and not options and not biases) else None

        ref = fmoe2.fused_moe_reference(x.float(), w1.float(), w2.float(), tw, ti, **options,
                                        **{k: v.float() for k, v in biases.items()})
        err_f = rel_err(fmoe2.fused_moe(x, prepared, None, tw, ti, config=f_cfg, **options), ref)
        err_b = rel_err(vllm_style_fused_experts(x, w1, w2, tw, ti, *b_cfgs, **options, **biases), ref)
        del ref
        sort_budget = (10.0 if M * topk <= 8192 else 25.0) + M * H * 2 / ceilings["copy_bytes_per_s"] * 1e6
        row = dict(shape=name, E=E, H=H, I=I, topk=topk, M=M, experts_hit=experts_hit,
                   fmoe2_us=t_f, fmoe2_final_round_us=t_final, fmoe2_path=f_cfg.path, fmoe2_fused_path_us=t_fused,
                   fmoe2_default_config_us=t_default, fmoe2_picked_us=t_picked,
                   fmoe2_picked_config=picked_cfg.to_dict(), fmoe2_plain_weights_us=t_plain,
                   baseline_us=t_b, speedup=t_b / t_f, floor_us=floor, fraction_of_floor=floor / t_f,
                   sort_us=t_sort, sort_budget_us=sort_budget, fmoe2_rel_err=err_f, baseline_rel_err=err_b,
                   stage_us=stages, flops=flops, dense_gemm_us=t_dense,
                   fmoe2_config=f_cfg.to_dict(), baseline_config=b_cfgs[0].__dict__)
        if vllm_us is not None:
            row["vllm_fused_experts_us"] = vllm_us
        rows.append(row)
        searched = "" if t_final is None else f"; final round {t_final:.1f}"
        print(f"{name:17s} M={M:6d}  fmoe2 {t_f:9.1f} us ({f_cfg.path}; fused {t_fused:.1f}{searched})  baseline {t_b:9.1f} us  speedup {t_b / t_f:5.2f}x  "
              f"floor {floor / t_f:6.1%}  sort {t_sort:6.1f}/{sort_budget:.1f} us  err {err_f:.1e}/{err_b:.1e}",
              flush=True)
        if max(err_f, err_b) > BF16_TOL or not (math.isfinite(err_f) and math.isfinite(err_b)):
            raise SystemExit(f"{name} M={M}: result off (fmoe2 {err_f:.2e}, baseline {err_b:.2e})")
    return rows


def compile_share(name, shape, ms, share: str, gen) -> None:
    """Runs this process's share (``--compile-share i/n``) of both searches' candidates once at each batch size, so
    their kernels are in the Triton cache when the searches time them (``fmoe2/bench/precompile.py``)."""
    E, H, I, topk = shape
    w1, w2, options, biases, prepared = make_weights(name, shape, gen)
    for M in ms:
        x, tw, ti = make_inputs(M, E, H, I, topk, gen)
        out = torch.empty_like(x)
        run_each_once([lambda cfg=cfg: fmoe2.fused_moe(x, prepared, None, tw, ti, out=out, config=cfg, **options)
                       for cfg in share_of(fmoe2_candidates(M, E, H, I, topk, torch.bfloat16), share)]
                      + [lambda cfgs=cfgs: vllm_style_fused_experts(x, w1, w2, tw, ti, *cfgs, **options, **biases)
                         for cfgs in share_of(baseline_candidates(M, E, topk), share)])


def write_results(path: str, result: dict, update: bool = False) -> dict:
    """Writes one shape's result file; with ``update`` an existing file keeps its rows of the batch
    sizes not in ``result`` (``merge_results``). Returns what was written."""
    if update and os.path.exists(path):
        with open(path) as f:
            result = merge_results(json.load(f), result)
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    return result


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m fmoe2.bench", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--shapes", default=None,
                   help=f"comma-separated names from {sorted(ALL_SHAPES)} (default: {','.join(SHAPES)}; with "
                        f"--dtype fp8 also deepseek-v3)")
    p.add_argument("--shape", default=None, help="a custom shape E,H,I,topk (replaces --shapes)")
    p.add_argument("--m", default="1,16,128,1024,4096", help="comma-separated batch sizes")
    p.add_argument("--no-search", action="store_true", help="use default configs instead of searching")
    p.add_argument("--update", action="store_true",
                   help="rerun only the batch sizes of --m: the result file keeps its rows of other batch sizes "
                        "(each row names the run it comes from)")
    p.add_argument("--out-dir", default=os.path.join("misc", "bench"),
                   help="result files <device>__<shape>.json, <device>.md and the plots go here")
    p.add_argument("--seed", type=int, default=0, help="seed of the random inputs and weights")
    p.add_argument("--lora", action="store_true",
                   help="multi-LoRA benchmark (default M 1,16,128,1024; results under <out-dir>/lora)")
    p.add_argument("--rank", type=int, default=16, help="LoRA rank with --lora")
    p.add_argument("--num-loras", type=int, default=4, help="adapters with --lora")
    p.add_argument("--search", action="store_true", help="with --lora: search fmoe2's config (either path) for LoRA")
    p.add_argument("--dtype", default="bf16", choices=("bf16", "fp8"),
                   help="fp8: fp8 weights against the vLLM-style fp8 baseline and fmoe2's bf16 (fmoe2/bench/fp8.py; "
                        "default shapes then add deepseek-v3)")
    p.add_argument("--scheme", default="block", choices=SCHEMES,
                   help="fp8 weight scales with --dtype fp8 (block: 128 x 128)")
    p.add_argument("--deterministic", action="store_true",
                   help="deterministic mode against the default forward and the vLLM-style path: times, errors, "
                        "reproducibility (results under <out-dir>/deterministic)")
    p.add_argument("--candidates", action="store_true",
                   help="with --deterministic: also time other fixed tilings for deterministic mode")
    add_compile_arguments(p, "both searches (plain bf16 runs)")
    p.add_argument("--prefill", action="store_true",
                   help="prefill against the GEMM limit: dense bmm and torch._grouped_mm of the same work, tail tiles, "
                        "fp8 (fmoe2/bench/prefill.py; default shapes then add gpt-oss-20b, default M 1024,4096,16384; "
                        "results under <out-dir>/prefill)")
    p.add_argument("--routing", default="uniform,skewed", help="with --prefill: routings (uniform, skewed)")
    p.add_argument("--tails", default="64", help="with --prefill: TAIL_M values timed beside the picked config")
    p.add_argument("--fp8-schemes", default="block,channel", help="with --prefill: fp8 schemes timed ('' for none)")
    p.add_argument("--host", action="store_true",
                   help="host cost per call instead (python -m fmoe2.bench.host; --shapes, --out-dir apply)")
    a = p.parse_args(argv)
    if a.shapes is None:
        a.shapes = ",".join(SHAPES)
        if a.prefill:
            from .prefill import PREFILL_SHAPES

            a.shapes = ",".join(PREFILL_SHAPES)
        if a.dtype == "fp8":
            from .fp8 import FP8_SHAPES

            a.shapes = ",".join(FP8_SHAPES)
    if a.host:
        from .host import main as host_main

        return host_main(["--shapes", a.shapes, "--out-dir", a.out_dir])
    if a.update and (a.lora or a.no_search):
        # --lora writes its own files whole; unsearched rows would become tuned configs (--write-configs).
        p.error("--update reruns searched plain results only (not with --lora or --no-search)")
    if a.prefill:
        from .prefill import ROUTINGS

        if a.lora or a.dtype != "bf16" or a.shape or a.deterministic:
            p.error("--prefill runs the named shapes (--shapes) in bf16 and fp8 itself (--fp8-schemes)")
        if any(r not in ROUTINGS for r in a.routing.split(",")):
            p.error(f"--routing must be a comma-separated subset of {ROUTINGS}, got {a.routing!r}")
        try:
            tails = [int(t) for t in a.tails.split(",") if t.strip()]
        except ValueError:
            tails = [0]
        if any(t < 16 or t & (t - 1) for t in tails):
            p.error(f"--tails must be comma-separated powers of two >= 16 (TAIL_M), got {a.tails!r}")
        if any(s not in SCHEMES for s in a.fp8_schemes.split(",") if s):
            p.error(f"--fp8-schemes must be a comma-separated subset of {SCHEMES}, got {a.fp8_schemes!r}")
    if not torch.cuda.is_available():
        p.error("the benchmark needs a CUDA or ROCm GPU")
    if a.shape:
        shapes = {"custom-" + a.shape.replace(",", "-"): tuple(int(v) for v in a.shape.split(","))}
    else:
        unknown = [s for s in a.shapes.split(",") if s not in ALL_SHAPES]
        if unknown:
            p.error(f"unknown shapes {unknown}; known: {sorted(ALL_SHAPES)}")
        shapes = {s: ALL_SHAPES[s] for s in a.shapes.split(",")}
    if a.lora and a.m == p.get_default("m"):
        a.m = "1,16,128,1024"
    if a.prefill and a.m == p.get_default("m"):
        a.m = "1024,4096,16384"
    ms = [int(m) for m in a.m.split(",")]
    gen = torch.Generator(device="cuda").manual_seed(a.seed)
    if a.compile_share:
        for name, shape in shapes.items():
            compile_share(name, shape, ms, a.compile_share, gen)
        return 0
    if a.prefill:  # (its own references: the dense and grouped GEMMs of each point)
        from .prefill import run_prefill_bench

        print(run_prefill_bench(list(shapes), ms, a.routing.split(","), [int(t) for t in a.tails.split(",") if t],
                                [s for s in a.fp8_schemes.split(",") if s], a.out_dir, gen, argv))
        return 0
    ceilings = measure_ceilings()
    device = torch.cuda.get_device_name()
    meta = dict(device=device, date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                torch=torch.__version__, triton=triton.__version__, hip=getattr(torch.version, "hip", None),
                command="python -m fmoe2.bench " + " ".join(shlex.quote(v) for v in (argv or sys.argv[1:])),
                ceilings=ceilings)
    print(f"{device}: copy {ceilings['copy_bytes_per_s'] / 1e12:.2f} TB/s, "
          f"bf16 matmul {ceilings['bf16_flops_per_s'] / 1e12:.0f} TFLOP/s", flush=True)
    if a.deterministic:
        from .deterministic import run_deterministic_bench

        if a.lora or a.dtype != "bf16" or a.shape:
            p.error("--deterministic runs the named bf16 shapes (--shapes), without --lora")
        print(run_deterministic_bench(list(shapes), ms, a.out_dir, gen, a.candidates, argv))
        return 0
    if a.dtype == "fp8":
        from .fp8 import run_fp8_bench

        if a.lora:
            p.error("--dtype fp8 does not take --lora: fp8 weights take no adapters yet")
        if a.shape:
            p.error("--dtype fp8 runs named shapes (--shapes)")
        print(run_fp8_bench(list(shapes), ms, a.scheme, a.out_dir, ceilings, gen, argv))
        return 0
    if a.lora:
        from .lora import bench_lora_shape, write_lora_report

        lora_dir = os.path.join(a.out_dir, "lora")
        os.makedirs(lora_dir, exist_ok=True)
        for name, shape in shapes.items():
            rows = bench_lora_shape(name, shape, ms, ceilings, gen, rank=a.rank, num_loras=a.num_loras,
                                    do_search=a.search, plain_dir=a.out_dir)
            with open(os.path.join(lora_dir, f"{device_config_name()}__{name}.json"), "w") as f:
                json.dump({**meta, "results": rows}, f, indent=1)
        print(write_lora_report(lora_dir, device_config_name(), os.path.dirname(os.path.abspath(a.out_dir))))
        return 0
    os.makedirs(a.out_dir, exist_ok=True)
    for name, shape in shapes.items():
        if a.compile_workers and not a.no_search:
            E, H, I, _ = shape  # each process holds the weights twice (plain and prepared)
            which = ["--shape", a.shape] if a.shape else ["--shapes", name]
            compile_in_processes([sys.executable, "-m", "fmoe2.bench", *which, "--m", a.m, "--seed", str(a.seed)],
                                 a.compile_workers, 2 * E * 3 * H * I * 2, name)
        rows = bench_shape(name, shape, ms, not a.no_search, ceilings, gen)
        path = os.path.join(a.out_dir, f"{device_config_name()}__{name}.json")
        write_results(path, {**meta, "timing": TIMING, "results": rows}, update=a.update)
    print(write_report(a.out_dir, device_config_name()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
