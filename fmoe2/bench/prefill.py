"""Prefill against the GEMM limit: ``python -m fmoe2.bench --prefill``.

    python -m fmoe2.bench --prefill [--shapes mixtral-8x7b,qwen3-30b-a3b,deepseek-v2-lite,gpt-oss-20b]
                                    [--m 1024,4096,16384] [--routing uniform,skewed] [--tails 64]
                                    [--fp8-schemes block,channel] [--out-dir misc/bench]

Per shape, batch size and routing, in one run, each timed in a CUDA graph (CUDA events, median of replays):

* ``fmoe2``: ``fused_moe`` as a caller runs it (bf16, prepared weights, the config it picks, sort included,
  the shape's own activation and biases);
* ``fmoe2 TAIL_M=t``: the same config with tail tiles (``FusedMoEConfig.TAIL_M``; two-stage configs whose
  BLOCK_M exceeds t): a sorted tile holding at most t real rows computes t rows, not BLOCK_M;
* ``dense``: the forward's two GEMMs as dense cuBLAS batched products (``torch.bmm``) with every expert given
  ``M * topk / E`` rows, the balanced ideal of the same work (no gather, activation, padding or combine);
* ``grouped_mm``: the two GEMMs alone through ``torch._grouped_mm`` (CUTLASS grouped GEMM) on the routing's
  real rows per expert (no gather, activation or combine);
* ``fmoe2 fp8 <scheme>``: fp8 weights (uniform routing only), against the same-quantization reference.

Every fmoe2 result is checked against the float32 reference first (bf16: relative error <= 2.5e-2). Rate:
useful flops ``2 * M * topk * 3 * H * I`` over the time. ``padded`` is the rows the tiles compute over the
routed rows, with BLOCK_M-row tiles and with tails (from the routing's per-expert counts): the work a grouped
GEMM does beyond the dense ideal before any inefficiency of its own.

Routing: ``uniform``, softmax top-k of random logits; ``skewed``, the same with the first ``max(1, E // 8)``
experts' logits raised by 3 (they take most routed rows). Results: ``<out-dir>/prefill/<device>.json`` and
``.md``.
"""
from __future__ import annotations

import math
import os
from dataclasses import replace
from typing import Dict, List, Optional, Sequence

import torch

import fmoe2
from fmoe2.gemm.config import device_config_name
from fmoe2.gemm.fused_moe import plan_of
from fmoe2.shapes import ALL_SHAPES

from .provenance import provenance_line, run_record, write_result
from .timing import time_in_graph

PREFILL_SHAPES = ("mixtral-8x7b", "qwen3-30b-a3b", "deepseek-v2-lite", "gpt-oss-20b")
PREFILL_M = (1024, 4096, 16384)
ROUTINGS = ("uniform", "skewed")
BF16_TOL = 2.5e-2
FP8_TOL = 2.5e-2  # against the same-quantization reference (fmoe2/bench/fp8.py's bound)


def _time(fn) -> float:
    return time_in_graph(fn, calls_per_graph=5, replays=10, warmup=2)


def routing(M: int, E: int, topk: int, kind: str, gen):
    """float32 ``topk_weights`` and int32 ``topk_ids`` [M, topk] of routing ``kind`` (module docstring)."""
    logits = torch.randn(M, E, device="cuda", generator=gen)
    if kind == "skewed":
        logits[:, :max(1, E // 8)] += 3.0
    elif kind != "uniform":
        raise ValueError(f"routing must be one of {ROUTINGS}, got {kind!r}")
    weights, ids = torch.topk(logits.softmax(dim=-1), topk, dim=-1)
    return weights, ids.to(torch.int32)


def padded_rows(counts: torch.Tensor, block_m: int, tail_m: int = 0) -> int:
    """Rows the tiles of one forward compute for per-expert routed-row ``counts``: whole BLOCK_M tiles, an
    expert's last tile ``tail_m`` rows where its rows fit (tail tiles)."""
    full = counts // block_m * block_m
    rest = counts - full
    last = torch.where(rest == 0, 0, torch.where(rest <= tail_m, tail_m, block_m)) if tail_m else \
        torch.where(rest == 0, 0, block_m)
    return int((full + last).sum())


def grouped_mm_us(x, w1, w2, topk_ids, E: int) -> Optional[float]:
    """The two GEMMs through ``torch._grouped_mm`` on the routing's rows per expert (x's rows gathered in expert
    order beforehand, not timed); None where this torch has no grouped GEMM for the GPU."""
    grouped_mm = getattr(torch, "_grouped_mm", None)
    if grouped_mm is None:
        return None
    order = torch.argsort(topk_ids.flatten(), stable=True)
    a = x[order // topk_ids.shape[1]].contiguous()
    offs = torch.cumsum(torch.bincount(topk_ids.flatten(), minlength=E), 0).to(torch.int32)
    b13 = w1.transpose(1, 2)  # [E, H, 2I], column-major as the grouped GEMM takes its second operand
    b2 = w2.transpose(1, 2)  # [E, I, H]
    y = torch.randn(a.shape[0], w2.shape[2], device="cuda", dtype=torch.bfloat16)
    try:
        grouped_mm(a, b13, offs=offs)
        grouped_mm(y, b2, offs=offs)
    except (RuntimeError, NotImplementedError) as error:
        print(f"  torch._grouped_mm unavailable here: {str(error).splitlines()[0][:120]}", flush=True)
        return None
    return _time(lambda: grouped_mm(a, b13, offs=offs)) + _time(lambda: grouped_mm(y, b2, offs=offs))


def bench_prefill_shape(name: str, ms: Sequence[int], routings: Sequence[str], tails: Sequence[int],
                        fp8_schemes: Sequence[str], gen) -> List[dict]:
    from .ceilings import dense_gemm_us
    from .problems import make_weights, rel_err

    E, H, I, topk = ALL_SHAPES[name]
    w1, w2, options, biases, prepared = make_weights(name, (E, H, I, topk), gen)
    fp8_weights = {}
    for scheme in fp8_schemes:
        q1, s1 = fmoe2.quantize_fp8_weights(w1, scheme)
        q2, s2 = fmoe2.quantize_fp8_weights(w2, scheme)
        scales = dict(w1_scale=s1, w2_scale=s2, block_shape=(128, 128) if scheme == "block" else None)
        fp8_weights[scheme] = (q1, q2, scales, fmoe2.prepare_weights(q1, q2, **scales, **biases))
    rows = []
    for M in ms:
        flops = 2 * M * topk * 3 * H * I
        x = torch.randn(M, H, device="cuda", dtype=torch.bfloat16, generator=gen)
        out = torch.empty_like(x)
        t_dense = dense_gemm_us(E, H, I, -(-M * topk // E), gen, timer=_time)
        for kind in routings:
            tw, ti = routing(M, E, topk, kind, gen)
            counts = torch.bincount(ti.flatten().long(), minlength=E).cpu()
            ref = fmoe2.fused_moe_reference(x.float(), w1.float(), w2.float(), tw, ti,
                                            **{k: v.float() for k, v in biases.items()}, **options)
            err = rel_err(fmoe2.fused_moe(x, prepared, None, tw, ti, **options), ref)
            config = plan_of(x, prepared, None, tw, ti, **options).config
            variants = {"fmoe2": None}
            for tail in tails:
                if config.path == "two_stage" and tail < config.BLOCK_M:
                    variants[f"fmoe2 TAIL_M={tail}"] = replace(config, TAIL_M=tail)
            times, errors = {}, {"fmoe2": err}
            for label, cfg in variants.items():
                kw = dict(options, config=cfg) if cfg is not None else options
                if cfg is not None:
                    errors[label] = rel_err(fmoe2.fused_moe(x, prepared, None, tw, ti, **kw), ref)
                if errors[label] > BF16_TOL or not math.isfinite(errors[label]):
                    raise SystemExit(f"{name} M={M} {kind} {label}: relative error {errors[label]:.2e} > {BF16_TOL}")
                times[label] = _time(lambda kw=kw: fmoe2.fused_moe(x, prepared, None, tw, ti, out=out, **kw))
            t_grouped = grouped_mm_us(x, w1, w2, ti, E)
            row = dict(shape=name, E=E, H=H, I=I, topk=topk, M=M, routing=kind, config=config.to_dict(),
                       max_rows_per_expert=int(counts.max()), mean_rows_per_expert=M * topk / E,
                       padded=padded_rows(counts, config.BLOCK_M) / (M * topk),
                       padded_with_tail={str(t): padded_rows(counts, config.BLOCK_M, t) / (M * topk)
                                         for t in tails if config.path == "two_stage" and t < config.BLOCK_M},
                       times_us=times, rel_err=errors, dense_us=t_dense, grouped_mm_us=t_grouped,
                       tflops={k: flops / v / 1e6 for k, v in times.items()}, dense_tflops=flops / t_dense / 1e6)
            if kind == "uniform":
                for scheme, (q1, q2, scales, fp8_prepared) in fp8_weights.items():
                    fp8_ref = fmoe2.fused_moe_reference(x.float(), q1, q2, tw, ti, **scales,
                                                        **{k: v.float() for k, v in biases.items()}, **options)
                    fp8_err = rel_err(fmoe2.fused_moe(x, fp8_prepared, None, tw, ti, **options), fp8_ref)
                    if fp8_err > FP8_TOL or not math.isfinite(fp8_err):
                        raise SystemExit(f"{name} M={M} fp8 {scheme}: relative error {fp8_err:.2e} > {FP8_TOL}")
                    label = f"fmoe2 fp8 {scheme}"
                    times[label] = _time(lambda w=fp8_prepared: fmoe2.fused_moe(x, w, None, tw, ti, out=out,
                                                                                **options))
                    errors[label] = fp8_err
                    row["tflops"][label] = flops / times[label] / 1e6
            rows.append(row)
            best_tail = min(((v, k) for k, v in times.items() if k.startswith("fmoe2 TAIL")),
                            default=(times["fmoe2"], "fmoe2"))
            print(f"{name:17s} M={M:6d} {kind:8s} fmoe2 {times['fmoe2']:9.1f} us ({flops / times['fmoe2'] / 1e6:4.0f} "
                  f"TFLOP/s, {t_dense / times['fmoe2']:.2f} of dense)  {best_tail[1]} {best_tail[0]:9.1f}  dense "
                  f"{t_dense:9.1f}  grouped_mm {t_grouped or float('nan'):9.1f}  padded {row['padded']:.2f} "
                  + " ".join(f"{k.split()[-1]} {v:.1f}" for k, v in times.items() if 'fp8' in k), flush=True)
    return rows


def markdown(result: dict) -> str:
    lines = [f"# Prefill against the GEMM limit, {result['device']}", "",
             provenance_line(result), "",
             "Times in us (TFLOP/s of useful work); `of dense`: the dense bmm's time over fmoe2's (1.0 = as fast as "
             "the balanced dense GEMMs). `padded`: rows the BLOCK_M tiles compute over the routed rows (with "
             "tails: in brackets). fmoe2 runs its picked config (`BLOCK_M`/path given); `TAIL_M=t` the same "
             "config with tail tiles.", "",
             "| shape | M | routing | max/mean rows per expert | config | padded | fmoe2 | of dense | tails | "
             "dense bmm | grouped_mm | fp8 |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["results"]:
        t = r["times_us"]
        tails = ", ".join(f"{k.split()[-1]}: {v:.1f} ({r['tflops'][k]:.0f}, {r['dense_us'] / v:.2f})"
                          for k, v in t.items() if "TAIL" in k)
        fp8 = ", ".join(f"{k.split()[-1]}: {v:.1f} ({r['tflops'][k]:.0f}, x{t['fmoe2'] / v:.2f} bf16)"
                        for k, v in t.items() if "fp8" in k)
        pad = f"{r['padded']:.2f}" + (" (" + ", ".join(f"{k}: {v:.2f}" for k, v in r["padded_with_tail"].items())
                                      + ")" if r["padded_with_tail"] else "")
        cfg = r["config"]
        grouped = f"{r['grouped_mm_us']:.1f}" if r["grouped_mm_us"] else "-"
        lines.append(f"| {r['shape']} | {r['M']} | {r['routing']} | {r['max_rows_per_expert']} / "
                     f"{r['mean_rows_per_expert']:.0f} | {cfg['path']} BLOCK_M={cfg['BLOCK_M']} | {pad} | "
                     f"{t['fmoe2']:.1f} ({r['tflops']['fmoe2']:.0f}) | {r['dense_us'] / t['fmoe2']:.2f} | "
                     f"{tails or '-'} | {r['dense_us']:.1f} ({r['dense_tflops']:.0f}) | {grouped} | {fp8 or '-'} |")
    return "\n".join(lines) + "\n"


def plot(result: dict, path: str) -> None:
    """Fraction of the dense GEMMs' speed (dense time / time) against M, one panel per shape: fmoe2 on uniform and
    skewed routing, its best tail setting (uniform), the two GEMMs of ``torch._grouped_mm`` and fmoe2 with fp8
    weights (uniform); the target (0.9) dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["results"]
    shapes = list(dict.fromkeys(r["shape"] for r in rows))
    fig, axes = plt.subplots(1, len(shapes), figsize=(3.6 * len(shapes), 3.6), squeeze=False)
    for ax, shape in zip(axes[0], shapes):
        def line(routing_kind, value, label, **style):
            points = sorted((r["M"], value(r)) for r in rows if r["shape"] == shape and r["routing"] == routing_kind)
            points = [(m, v) for m, v in points if v is not None]
            if points:
                ax.plot([m for m, _ in points], [v for _, v in points], marker="o", label=label, **style)

        def of_dense(label):
            return lambda r: r["dense_us"] / r["times_us"][label] if label in r["times_us"] else None

        def best_tail(r):
            tails = [v for k, v in r["times_us"].items() if "TAIL" in k]
            return r["dense_us"] / min(tails) if tails else None

        line("uniform", of_dense("fmoe2"), "fmoe2, uniform")
        line("skewed", of_dense("fmoe2"), "fmoe2, skewed")
        line("uniform", best_tail, "fmoe2 best tail, uniform", linestyle=":")
        line("uniform", lambda r: r["dense_us"] / r["grouped_mm_us"] if r["grouped_mm_us"] else None,
             "torch._grouped_mm GEMMs, uniform", linestyle="--")
        for scheme in ("block", "channel"):
            line("uniform", of_dense(f"fmoe2 fp8 {scheme}"), f"fmoe2 fp8 {scheme}, uniform", alpha=0.6)
        ax.axhline(0.9, color="gray", linewidth=0.8, linestyle="--")
        ax.set(xscale="log", xlabel="M (tokens)", title=shape, ylim=(0, 1.3))
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].set_ylabel("dense bmm time / time")
    axes[0][-1].legend(fontsize=7)
    fig.suptitle(f"Prefill against dense cuBLAS GEMMs of the same work, {result['device']}, Triton "
                 f"{result['triton']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_path(out_dir: str, device: str) -> str:
    """``misc/<device>_prefill.png`` beside ``misc/bench`` (``out_dir``'s parent)."""
    name = "".join(c if c.isalnum() else "_" for c in device).strip("_")
    return os.path.join(os.path.dirname(os.path.abspath(out_dir)), f"{name}_prefill.png")


def run_prefill_bench(shapes: Sequence[str], ms: Sequence[int], routings: Sequence[str], tails: Sequence[int],
                      fp8_schemes: Sequence[str], out_dir: str, gen, argv=None) -> str:
    """Runs the shapes in turn; the result file is rewritten after each (a run cut short keeps those done)."""
    result: Dict = {**run_record("python -m fmoe2.bench", argv), "results": []}
    path = os.path.join(out_dir, "prefill", f"{device_config_name()}.json")
    report = ""
    for name in shapes:
        result["results"] += bench_prefill_shape(name, ms, routings, tails, fp8_schemes, gen)
        torch.cuda.empty_cache()
        report = write_result(path, result, markdown)
    try:
        plot(result, plot_path(out_dir, result["device"]))
    except ImportError:  # matplotlib is optional (the "plot" extra)
        pass
    return report


def main(argv: Optional[List[str]] = None) -> int:
    """``python -m fmoe2.bench.prefill <result.json> [--out-dir misc/bench]``: the report and the plot of a result
    file again (the benchmark itself runs as ``python -m fmoe2.bench --prefill``)."""
    import argparse
    import json

    p = argparse.ArgumentParser(prog="python -m fmoe2.bench.prefill", description=main.__doc__)
    p.add_argument("result", help="a result file of python -m fmoe2.bench --prefill")
    p.add_argument("--out-dir", default=os.path.join("misc", "bench"), help="the plot goes beside this folder")
    a = p.parse_args(argv)
    with open(a.result) as f:
        result = json.load(f)
    print(write_result(a.result, result, markdown))
    plot(result, plot_path(a.out_dir, result["device"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
