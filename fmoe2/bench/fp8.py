"""fp8 benchmark: ``python -m fmoe2.bench --dtype fp8 [--scheme block|channel|tensor]``.

Per shape (default: the three benchmark shapes and DeepSeek-V3's) and batch: random bf16 weights
quantized to fp8 e4m3 (``fmoe2.quantize_fp8_weights``; block-wise 128 x 128 by default), fresh
bf16 inputs and softmax + top-k routing. Timed in CUDA graphs (10 calls per graph, CUDA events,
median of replays; ``timing.py``), in one run:

* fmoe2 fp8, prepared weights, on the path ``path="auto"`` picks and on each path forced;
* with weights scaled per channel or per tensor: fmoe2 fp8 (``path="auto"``) with x quantized per token and per
  group of 128 (``fmoe2.fp8.PER_TOKEN_ACTIVATIONS``), the two timed in turns in the same run, each against the
  reference of its own quantization (the other columns take x as the switch is set: per group by default);
* the vLLM-style fp8 baseline (``vllm_style_fused_experts_fp8``: a separate per-token-group
  quantization launch before each GEMM, seven launches), the faster of two configs with BLOCK_K 128;
* fmoe2 bf16 on the same (unquantized) weights, prepared, ``path="auto"``;
* the fp8 memory floor: fp8 weight bytes of the experts hit, their scales and the bf16 activations
  in and out, over the measured copy bandwidth.

Checked against the reference with the same quantization (relative L2 error, at most 1e-2) and,
reported, against the unquantized bf16 forward. Writes ``<out-dir>/fp8/<device>__<scheme>.json``
and ``.md``.
"""
from __future__ import annotations

import math
import os

import torch

import fmoe2
from fmoe2 import fp8
from fmoe2.fp8 import FP8_GROUP
from fmoe2.gemm.config import device_config_name
from fmoe2.gemm.fused_moe import plan_of
from fmoe2.shapes import ALL_SHAPES

from .provenance import provenance_line, run_record, write_result
from .timing import time_graphs_in_turns, time_in_graph
from .vllm_style import GroupedGemmConfig, vllm_style_fused_experts_fp8

FP8_SHAPES = ("mixtral-8x7b", "qwen3-30b-a3b", "deepseek-v2-lite", "deepseek-v3")
SAME_QUANT_TOL = 1e-2


def baseline_fp8_candidates(M: int, E: int, topk: int):
    """Two configs of the baseline's GEMMs (shared BLOCK_M, BLOCK_K = one activation group) by routed
    rows per expert, of the tiles vLLM's block-scaled fp8 configs use."""
    rows = M * topk / E
    if rows <= 4:
        tiles = [(16, 64, 1, 4), (16, 128, 1, 4)]
    elif rows <= 64:
        tiles = [(32, 64, 8, 4), (64, 128, 8, 4)]
    else:
        tiles = [(64, 128, 8, 4), (128, 128, 8, 8)]
    return [(GroupedGemmConfig(bm, bn, FP8_GROUP, gm, w, 3),) * 2 for bm, bn, gm, w in tiles]


def _time(fn, M: int) -> float:
    """:func:`time_in_graph` with fewer replays at large batches (a DeepSeek-V3 forward at M=4096 takes ~10 ms)."""
    return time_in_graph(fn, replays=50 if M < 1024 else 12)


def _rel(out, ref):
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def _with_x_scales(per_token: bool, fn):
    """``fn()`` with x quantized per token (``per_token``) or per group of 128 (``fmoe2.fp8.PER_TOKEN_ACTIVATIONS``,
    which every fp8 call's plan key holds), the setting put back after."""
    kept = fp8.PER_TOKEN_ACTIVATIONS
    fp8.PER_TOKEN_ACTIVATIONS = per_token
    try:
        return fn()
    finally:
        fp8.PER_TOKEN_ACTIVATIONS = kept


X_SCALE_ROUNDS = 4  # (even: each of the two variants first in half the rounds, timing.time_graphs_in_turns)


def _x_scale_variants(x, prepared, tw, ti, out, q1, q2, scales, M):
    """``{"per_token" | "per_group": (us, relative error against the reference of that quantization)}``, the two
    timed in turns (``X_SCALE_ROUNDS`` rounds, each capturing again), for weights scaled per channel or per tensor."""
    variants = {name: (lambda per_token=per_token: _with_x_scales(
        per_token, lambda: fmoe2.fused_moe(x, prepared, None, tw, ti, out=out)))
        for name, per_token in (("per_token", True), ("per_group", False))}
    errors = {name: _with_x_scales(name == "per_token", lambda: _rel(
        fmoe2.fused_moe(x, prepared, None, tw, ti), fmoe2.fused_moe_reference(x, q1, q2, tw, ti, **scales)))
        for name in variants}
    heavy = M >= 1024
    times = time_graphs_in_turns(variants, X_SCALE_ROUNDS, 3 if heavy else 10, 6 if heavy else 15)
    return {name: (times[name], errors[name]) for name in variants}


def bench_fp8_shape(name, shape, ms, scheme, ceilings, gen):
    E, H, I, topk = shape
    block_shape = (128, 128) if scheme == "block" else None
    w1 = torch.randn(E, 2 * I, H, device="cuda", dtype=torch.bfloat16, generator=gen) / math.sqrt(H)
    w2 = torch.randn(E, H, I, device="cuda", dtype=torch.bfloat16, generator=gen) / math.sqrt(I)
    prepared_bf16 = fmoe2.prepare_weights(w1, w2)
    q1, s1 = fmoe2.quantize_fp8_weights(w1, scheme)
    q2, s2 = fmoe2.quantize_fp8_weights(w2, scheme)
    scales = dict(w1_scale=s1, w2_scale=s2, block_shape=block_shape)
    prepared = fmoe2.prepare_weights(q1, q2, **scales)
    scale_bytes = (s1.numel() + s2.numel()) * 4
    rows = []
    for M in ms:
        x = torch.randn(M, H, device="cuda", dtype=torch.bfloat16, generator=gen)
        logits = torch.randn(M, E, device="cuda", generator=gen)
        tw, ti = torch.topk(logits.softmax(dim=-1), topk, dim=-1)
        ti = ti.to(torch.int32)
        out = torch.empty_like(x)
        hit = int(torch.unique(ti).numel())
        floor_bytes = hit * 3 * H * I + scale_bytes * hit / E + 2 * M * H * 2
        floor_us = floor_bytes / ceilings["copy_bytes_per_s"] * 1e6

        ref = fmoe2.fused_moe_reference(x, q1, q2, tw, ti, **scales)
        unquantized = fmoe2.fused_moe_reference(x, w1, w2, tw, ti)
        errors = {}
        times = {}
        for path in ("auto", "fused", "two_stage"):
            errors[path] = _rel(fmoe2.fused_moe(x, prepared, None, tw, ti, path=path), ref)
            times[path] = _time(lambda: fmoe2.fused_moe(x, prepared, None, tw, ti, out=out, path=path), M)
        auto_path = plan_of(x, prepared, None, tw, ti).config.path
        err_vs_bf16 = _rel(fmoe2.fused_moe(x, prepared, None, tw, ti), unquantized)
        base = []
        for cfgs in baseline_fp8_candidates(M, E, topk):
            run = lambda cfgs=cfgs: vllm_style_fused_experts_fp8(x, q1, q2, tw, ti, *cfgs, **scales)  # noqa: E731
            base.append((_time(run, M), cfgs, _rel(run(), ref)))
        t_base, base_cfgs, err_base = min(base, key=lambda b: b[0])
        t_bf16 = _time(lambda: fmoe2.fused_moe(x, prepared_bf16, None, tw, ti, out=out), M)
        err_bf16 = _rel(fmoe2.fused_moe(x, prepared_bf16, None, tw, ti), unquantized)
        t_best = min(times["fused"], times["two_stage"])
        x_scales = (_x_scale_variants(x, prepared, tw, ti, out, q1, q2, scales, M) if scheme in ("channel", "tensor")
                    else None)
        row = dict(shape=name, E=E, H=H, I=I, topk=topk, M=M, scheme=scheme, experts_hit=hit,
                   fmoe2_fp8_us=times["auto"], fmoe2_fp8_path=auto_path, fmoe2_fp8_fused_us=times["fused"],
                   fmoe2_fp8_two_stage_us=times["two_stage"], baseline_fp8_us=t_base,
                   baseline_config=base_cfgs[0].__dict__, fmoe2_bf16_us=t_bf16,
                   speedup_vs_baseline=t_base / times["auto"], speedup_vs_bf16=t_bf16 / times["auto"],
                   floor_us=floor_us, fraction_of_floor=floor_us / times["auto"],
                   best_path_fraction_of_floor=floor_us / t_best,
                   rel_err_same_quant={k: v for k, v in errors.items()}, baseline_rel_err_same_quant=err_base,
                   fp8_rel_err_vs_unquantized=err_vs_bf16, bf16_rel_err_vs_unquantized=err_bf16,
                   x_per_token=fp8.PER_TOKEN_ACTIVATIONS)
        if x_scales:
            row["x_scales"] = {name: dict(us=t, rel_err=e) for name, (t, e) in x_scales.items()}
            row["x_scales_rounds"] = X_SCALE_ROUNDS
        rows.append(row)
        print(f"{name:17s} M={M:6d} fp8 {times['auto']:8.1f} us ({auto_path}; fused {times['fused']:.1f}, two-stage "
              f"{times['two_stage']:.1f})  baseline {t_base:8.1f}  bf16 {t_bf16:8.1f}  x{t_base / times['auto']:.2f} vs "
              f"baseline, x{t_bf16 / times['auto']:.2f} vs bf16, floor {floor_us / times['auto']:.0%}  err "
              f"{errors['auto']:.1e} (fused {errors['fused']:.1e}, two-stage {errors['two_stage']:.1e}; base "
              f"{err_base:.1e}; vs bf16 {err_vs_bf16:.1e})", flush=True)
        if x_scales:
            print(f"{'':17s} x per token {x_scales['per_token'][0]:8.1f} us, per group {x_scales['per_group'][0]:8.1f} "
                  f"(x{x_scales['per_group'][0] / x_scales['per_token'][0]:.2f}); errors "
                  f"{x_scales['per_token'][1]:.1e} / {x_scales['per_group'][1]:.1e}", flush=True)
            if not all(e <= SAME_QUANT_TOL for _, e in x_scales.values()):  # (NaN fails too)
                raise SystemExit(f"{name} M={M}: fp8 result off its reference: {x_scales}")
        # The gate is the path fused_moe picks; a forced fused path at a large I (Mixtral: 224 bf16 atomic adds per
        # output element with 128-column slices) may round more, and is reported.
        if errors["auto"] > SAME_QUANT_TOL or not all(math.isfinite(v) for v in errors.values()):
            raise SystemExit(f"{name} M={M}: fp8 result off the same-quantization reference: {errors}")
    return rows


def markdown(result: dict) -> str:
    lines = [f"# fp8 MoE forward ({result['scheme']} scales): {result['device']}", "",
             provenance_line(result), "",
             "Microseconds per forward in CUDA graphs; fmoe2 fp8 on prepared weights (`path=\"auto\"`, and each path "
             "forced); the vLLM-style fp8 baseline quantizes activations in separate launches; fmoe2 bf16 runs the "
             "unquantized weights. Floor: fp8 bytes of the experts hit + scales + activations over the measured copy "
             "bandwidth. Errors: relative L2 against the reference with the same quantization (fmoe2's pick; the baseline, "
             "which quantizes the intermediate before the routing weight), "
             "and fmoe2 fp8 against the unquantized bf16 forward. x: "
             + ("quantized per token (one scale a row; per group of 128 with block-scaled weights)"
                if result["results"] and result["results"][0].get("x_per_token") else "quantized per group of 128")
             + ".", "",
             "| shape | M | fmoe2 fp8 | path | fused / two-stage | baseline fp8 | fmoe2 bf16 | vs baseline | vs bf16 "
             "| of floor | err | base err | err vs bf16 |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["results"]:
        lines.append(
            f"| {r['shape']} | {r['M']} | {r['fmoe2_fp8_us']:.1f} | {r['fmoe2_fp8_path']} | "
            f"{r['fmoe2_fp8_fused_us']:.1f} / {r['fmoe2_fp8_two_stage_us']:.1f} | {r['baseline_fp8_us']:.1f} | "
            f"{r['fmoe2_bf16_us']:.1f} | {r['speedup_vs_baseline']:.2f}x | {r['speedup_vs_bf16']:.2f}x | "
            f"{r['fraction_of_floor']:.0%} | {r['rel_err_same_quant']['auto']:.1e} | "
            f"{r['baseline_rel_err_same_quant']:.1e} | {r['fp8_rel_err_vs_unquantized']:.1e} |")
    x_rows = [r for r in result["results"] if r.get("x_scales")]
    if x_rows:
        rounds = x_rows[0].get("x_scales_rounds", 3)  # (the first results, 2026-11-30, ran 3 rounds)
        lines += ["", "x quantized per token against per group of 128 (`fmoe2.fp8.PER_TOKEN_ACTIVATIONS`), "
                  f"`path=\"auto\"`, the two timed in turns in the same run ({rounds} rounds, each capturing again), "
                  "each against the reference of its own quantization:", "",
                  "| shape | M | per token (us) | per group (us) | per group / per token | err per token "
                  "| err per group |",
                  "|---|---|---|---|---|---|---|"]
        for r in x_rows:
            t, g = r["x_scales"]["per_token"], r["x_scales"]["per_group"]
            lines.append(f"| {r['shape']} | {r['M']} | {t['us']:.1f} | {g['us']:.1f} | {g['us'] / t['us']:.2f}x | "
                         f"{t['rel_err']:.1e} | {g['rel_err']:.1e} |")
    return "\n".join(lines) + "\n"


def plot(result: dict, path: str) -> None:
    """fmoe2 fp8's speedup over fmoe2 bf16 and over the vLLM-style fp8 baseline against M, one panel per
    shape, and its fraction of the fp8 memory floor."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["results"]
    shapes = list(dict.fromkeys(r["shape"] for r in rows))
    fig, axes = plt.subplots(1, len(shapes), figsize=(3.6 * len(shapes), 3.4), squeeze=False)
    for ax, shape in zip(axes[0], shapes):
        points = sorted((r["M"], r["speedup_vs_bf16"], r["speedup_vs_baseline"], r["fraction_of_floor"])
                        for r in rows if r["shape"] == shape)
        ms = [p[0] for p in points]
        for column, label in ((1, "over fmoe2 bf16"), (2, "over vLLM-style fp8"), (3, "of the fp8 floor")):
            ax.plot(ms, [p[column] for p in points], marker="o", label=label)
        ax.axhline(1.0, color="gray", linewidth=0.8)
        ax.set(xscale="log", xlabel="M (tokens)", title=shape, ylim=(0, 2.2))
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].set_ylabel("ratio")
    axes[0][-1].legend(fontsize=8)
    fig.suptitle(f"fmoe2 fp8 ({result['scheme']} scales), {result['device']}, Triton {result['triton']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_path(out_dir: str, scheme: str) -> str:
    """``misc/<device>_fp8_<scheme>.png`` beside ``misc/bench`` (``out_dir``'s parent)."""
    misc = os.path.dirname(os.path.abspath(out_dir))
    return os.path.join(misc, f"{device_config_name()}_fp8_{scheme}.png")


def run_fp8_bench(shapes, ms, scheme, out_dir, ceilings, gen, argv=None) -> str:
    """Runs the shapes in turn; the result file is rewritten after each shape (a run cut short keeps
    the shapes it finished)."""
    result = {**run_record("python -m fmoe2.bench", argv), "scheme": scheme, "ceilings": ceilings, "results": []}
    path = os.path.join(out_dir, "fp8", f"{device_config_name()}__{scheme}.json")
    report = ""
    for name in shapes:
        result["results"] += bench_fp8_shape(name, ALL_SHAPES[name], ms, scheme, ceilings, gen)
        torch.cuda.empty_cache()  # the shape's weights are gone: DeepSeek-V3's need most of an 80 GB GPU
        report = write_result(path, result, markdown)
    try:
        plot(result, plot_path(out_dir, scheme))
    except ImportError:  # matplotlib is optional (the "plot" extra)
        pass
    return report
