"""Correctness grid on a GPU: ``python -m fmoe2.bench.correctness``.

    python -m fmoe2.bench.correctness [--shapes gpt-oss-20b,deepseek-v3 | all] [--m 1,2,3,16,128,1024,4096]
                                      [--variants bf16,bias,expert_map,fp8] [--repeats 5] [--workers 6]
                                      [--out misc/bench/correctness/<device>.json]

Every real model's expert sizes (``fmoe2.shapes.ALL_SHAPES``) at every batch size, in four variants:

* ``bf16``: plain bf16 weights, the model's activation (gpt-oss: swiglu_oai with its limit), no biases;
* ``bias``: prepared bf16 weights with gate/up and down biases (gpt-oss: gate/up rows interleaved as it
  stores them);
* ``expert_map``: plain bf16 weights of the even experts only, routed over all of them through an
  ``expert_map`` (expert parallelism: odd experts' entries are dropped);
* ``fp8``: block-wise (128 x 128) fp8 weights, prepared, against the reference with the same quantization.

Each point (bf16 ``x [M, H]``, float32 ``topk_weights`` and int64 ``topk_ids [M, topk]`` of softmax + top-k
routing, fresh per point) runs ``repeats`` eager calls, alternately into an ``out`` poisoned with NaN and into
one fused_moe allocates, and ``repeats`` replays of one captured CUDA graph, its output poisoned with NaN before
each. It passes when every call is finite and within the relative L2 bound of the float32 reference (``BOUND``:
bf16 2.5e-2; fp8 2e-2 against the reference with the same quantization). A race shows as a call that differs from
the others; ``spread`` is the largest relative L2 distance of a call of a point from its first (the float32
atomic adds of the fused path sum in a varying order, so it is small but not zero there). With top-1 routing
(Llama-4-Scout) a token of the ``expert_map`` variant may route only to a dropped expert: its row must then come
out exactly zero.

Shapes run in worker processes (compiling dominates: up to ``--workers`` at a time, admitted while their
estimated weight bytes fit in 80% of the GPU's memory). Writes the result (``provenance.py``) and a markdown
report with the worst error per shape, per variant and mode.
"""
from __future__ import annotations

import argparse
import os
import sys
import traceback
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from typing import Dict, List, Sequence

import torch

from .timing import capture_graph

BATCHES = (1, 2, 3, 16, 128, 1024, 4096)
VARIANTS = ("bf16", "bias", "expert_map", "fp8")
# bf16: the tests' bound (REL_TOL). fp8, against the reference with the same quantization: the fused path adds its
# partial sums in bf16 (fp8 forwards keep 16-bit adds), so its error grows with the adds per output element,
# top-k * ceil(I / BLOCK_N): 8.3-9.3e-3 at 44-48 adds, 0.98-1.05e-2 at 64 (OLMoE, Llama-4-Scout; H200, the grids
# of 2026-11-27), against 3.5-6.0e-3 on the two-stage path. A dropped slot or slice is off by more than 0.1.
BOUND = {"bf16": 2.5e-2, "fp8": 2e-2}
FP8_BLOCK = (128, 128)
ONE_LAUNCH_DECODE = "decode (one launch)"  # a point's launch list where eager calls ran the one-launch decode


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Relative L2 error of ``out`` against ``ref`` (same shape, any float dtypes). A reference of zeros (a token
    routed only to dropped experts) takes an output of exact zeros: anything else is off by ~1e30."""
    ref = ref.float()
    return ((out.float() - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def point_inputs(variant: str, name: str, shape, gen: torch.Generator) -> dict:
    """The weights and ``fused_moe`` keywords of one (shape, variant), and ``E_route``: the experts routed over."""
    import fmoe2
    from fmoe2.shapes import SHAPE_OPTIONS

    from .problems import random_biases, random_weights

    E, H, inter, topk = shape
    options = dict(SHAPE_OPTIONS.get(name, {}))
    options.pop("biases", None)
    if variant == "expert_map":
        local = (E + 1) // 2  # the even experts
        w1, w2 = random_weights(local, H, inter, gen)
        expert_map = torch.full((E,), -1, dtype=torch.int32, device="cuda")
        expert_map[0::2] = torch.arange(local, dtype=torch.int32, device="cuda")
        return dict(weights=(w1, w2), kwargs=dict(options, expert_map=expert_map), reference=dict(), E_route=E)
    w1, w2 = random_weights(E, H, inter, gen)
    if variant == "bf16":
        return dict(weights=(w1, w2), kwargs=options, reference=dict(), E_route=E)
    if variant == "bias":
        interleaved = options.get("activation") == "swiglu_oai"  # gpt-oss stores g0, u0, g1, u1, ...
        w1_bias, w2_bias = random_biases(E, H, inter, gen).values()
        if interleaved:
            w1 = torch.stack([w1[:, :inter], w1[:, inter:]], dim=2).reshape(E, 2 * inter, H)
            w1_bias = torch.stack([w1_bias[:, :inter], w1_bias[:, inter:]], dim=2).reshape(E, 2 * inter)
        reference = dict(w1_bias=w1_bias, w2_bias=w2_bias, gate_up_interleaved=interleaved)
        prepared = fmoe2.prepare_weights(w1, w2, w1_bias=w1_bias, w2_bias=w2_bias, gate_up_interleaved=interleaved)
        return dict(weights=(w1, w2), prepared=prepared, kwargs=options, reference=reference, E_route=E)
    if variant == "fp8":
        q1, s1 = fmoe2.quantize_fp8_weights(w1, "block", FP8_BLOCK)
        q2, s2 = fmoe2.quantize_fp8_weights(w2, "block", FP8_BLOCK)
        del w1, w2
        reference = dict(w1_scale=s1, w2_scale=s2, block_shape=FP8_BLOCK)
        prepared = fmoe2.prepare_weights(q1, q2, w1_scale=s1, w2_scale=s2, block_shape=FP8_BLOCK)
        return dict(weights=(q1, q2), prepared=prepared, kwargs=options, reference=reference, E_route=E)
    raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")


def check_point(inputs: dict, M: int, H: int, topk: int, repeats: int, gen: torch.Generator, fp8: bool) -> dict:
    """Eager calls and graph replays of one batch size against the float32 reference (module docstring)."""
    import fmoe2
    from fmoe2.gemm.fused_moe import plan_of

    # (int64 ids, not make_inputs' int32 of the benchmarks: the grid covers the other id dtype)
    x = torch.randn(M, H, device="cuda", generator=gen).to(torch.bfloat16)
    scores = torch.randn(M, inputs["E_route"], device="cuda", generator=gen).softmax(dim=-1)
    topk_weights, topk_ids = torch.topk(scores, topk, dim=-1)
    w1, w2 = inputs["weights"]
    kwargs = inputs["kwargs"]
    # bf16: float32 throughout. fp8: the reference quantizes as the kernels do, rounds y to x's dtype and returns
    # x's dtype (bf16) too, so where the kernels add nothing up in another order (top-1 on the two-stage path) the
    # two can agree to the bit.
    ref = fmoe2.fused_moe_reference(x if fp8 else x.float(), w1, w2, topk_weights, topk_ids, **kwargs,
                                    **inputs["reference"]).float()
    prepared = inputs.get("prepared")
    call_w1, call_w2 = (prepared, None) if prepared is not None else (w1, w2)
    if prepared is None and inputs["reference"]:  # plain weights with biases (unused by the variants above)
        kwargs = dict(kwargs, **inputs["reference"])

    def call(out=None):
        return fmoe2.fused_moe(x, call_w1, call_w2, topk_weights, topk_ids, out=out, **kwargs)

    outs, errors, nonfinite = {"eager": [], "graph": []}, {"eager": [], "graph": []}, 0
    for r in range(repeats):  # a NaN-poisoned out, then a fresh one (allocated by fused_moe), in turns
        out = torch.full((M, H), float("nan"), device="cuda", dtype=torch.bfloat16) if r % 2 == 0 else None
        out = call(out)
        torch.cuda.synchronize()
        outs["eager"].append(out.float())
    plan = plan_of(x, call_w1, call_w2, topk_weights, topk_ids, **kwargs)
    launches = ([ONE_LAUNCH_DECODE] if plan is not None and plan.alone is not None else []) + (
        plan.launch_names if plan is not None else [])
    static = torch.empty(M, H, device="cuda", dtype=torch.bfloat16)
    graph = capture_graph(lambda: call(static))
    for _ in range(repeats):
        static.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        outs["graph"].append(static.float().clone())
    graph.reset()
    bound = BOUND["fp8" if fp8 else "bf16"]
    finite_ref = torch.isfinite(ref).all().item()
    for mode in outs:
        for out in outs[mode]:
            nonfinite += int((~torch.isfinite(out)).sum().item())
            errors[mode].append(relative_error(out, ref))
    everything = outs["eager"] + outs["graph"]
    spread = max(relative_error(out, everything[0]) for out in everything)
    worst = {mode: max(errors[mode]) for mode in errors}
    return dict(M=M, eager_max_error=worst["eager"], graph_max_error=worst["graph"], eager_errors=errors["eager"],
                graph_errors=errors["graph"], nonfinite=nonfinite, spread=spread, bound=bound, launches=launches,
                ok=bool(finite_ref and nonfinite == 0 and max(worst.values()) <= bound))


def check_shape(name: str, variant: str, batches: Sequence[int], repeats: int, seed: int = 0,
                shape=None) -> List[dict]:
    """Every batch size of one (shape, variant); one record each (an exception becomes a failed record).
    ``shape``: ``(E, H, I, topk)`` instead of the named model's (its options still apply), e.g. fewer experts."""
    import fmoe2
    from fmoe2.shapes import ALL_SHAPES

    shape = tuple(shape) if shape is not None else ALL_SHAPES[name]
    E, H, inter, topk = shape
    gen = torch.Generator(device="cuda").manual_seed(seed)
    records = []
    try:
        inputs = point_inputs(variant, name, shape, gen)
    except Exception:  # noqa: BLE001 - reported as a failed point
        return [dict(shape=name, variant=variant, M=M, ok=False, error=traceback.format_exc(limit=3)) for M in batches]
    for M in batches:
        try:
            record = check_point(inputs, M, H, topk, repeats, gen, fp8=variant == "fp8")
        except Exception:  # noqa: BLE001
            record = dict(M=M, ok=False, error=traceback.format_exc(limit=5))
        records.append(dict(shape=name, variant=variant, **record))
        fmoe2.clear_plan_cache()
    return records


def _estimated_bytes(name: str, variant: str) -> int:
    """Peak GPU bytes of one (shape, variant), roughly: its bf16 weights (3 * E * H * I elements) times what the
    variant holds at once (bias: the plain weights and a prepared copy, with the reference's float32 expert; fp8:
    fp8 weights, a prepared copy and the bf16 ones quantized from; expert_map: half the experts), and 2 GiB for
    the CUDA context and the activations."""
    from fmoe2.shapes import ALL_SHAPES

    E, H, inter, _ = ALL_SHAPES[name]
    weights = 3 * E * H * inter * 2
    factor = {"bf16": 1.0, "bias": 2.2, "expert_map": 0.6, "fp8": 2.2}[variant]
    return int(weights * factor) + (2 << 30)


def _worker(name: str, variant: str, batches: Sequence[int], repeats: int) -> List[dict]:
    try:
        return check_shape(name, variant, batches, repeats)
    finally:  # (a worker process takes the next task: its cached blocks would count against the budget)
        torch.cuda.empty_cache()


def run_grid(shapes: Sequence[str], variants: Sequence[str], batches: Sequence[int], repeats: int,
             workers: int) -> List[dict]:
    """:func:`check_shape` of every (shape, variant), in up to ``workers`` processes at a time that fit the GPU."""
    budget = int(0.8 * torch.cuda.get_device_properties(0).total_memory)
    tasks = sorted(((s, v) for s in shapes for v in variants), key=lambda t: -_estimated_bytes(*t))
    records: List[dict] = []
    import multiprocessing

    with ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        running: Dict[object, tuple] = {}  # future -> (shape, variant)
        while tasks or running:
            used = sum(_estimated_bytes(*task) for task in running.values())
            admitted = next((t for t in tasks if not running or used + _estimated_bytes(*t) <= budget), None)
            if admitted is not None and len(running) < workers:
                tasks.remove(admitted)
                running[pool.submit(_worker, *admitted, batches, repeats)] = admitted
                continue
            done, _ = wait(list(running), return_when=FIRST_COMPLETED)
            for future in done:
                task = running.pop(future)
                try:
                    task_records = future.result()
                except Exception:  # noqa: BLE001 - a worker that died: its points fail, the grid goes on
                    task_records = [dict(shape=task[0], variant=task[1], M=M, ok=False,
                                         error=traceback.format_exc(limit=3)) for M in batches]
                for record in task_records:
                    records.append(record)
                    status = "ok" if record["ok"] else "FAILED"
                    print(f"{record['shape']:18s} {record['variant']:10s} M={record['M']:<5d} {status} "
                          f"eager {record.get('eager_max_error', float('nan')):.2e} "
                          f"graph {record.get('graph_max_error', float('nan')):.2e}", flush=True)
    order = {(s, v): i for i, (s, v) in enumerate((s, v) for s in shapes for v in variants)}
    return sorted(records, key=lambda r: (order[(r["shape"], r["variant"])], r["M"]))


def markdown(result: dict) -> str:
    from .provenance import provenance_line

    records = result["records"]
    failed = [r for r in records if not r["ok"]]
    seen = {("fp8" if r["variant"] == "fp8" else "bf16"): r["bound"] for r in records if "bound" in r}
    bounds = ", ".join(f"{kind} {bound:.1e}" + (" (same-quantization reference)" if kind == "fp8" else "")
                       for kind, bound in sorted(seen.items()))
    lines = [f"# Correctness grid, {result['device']}", "",
             provenance_line(result), "",
             f"{len(records)} points ({result['repeats']} eager calls and {result['repeats']} graph replays each, "
             f"every output poisoned with NaN before the call but every other eager call's, which allocates its own), "
             f"{len(records) - len(failed)} passed, {len(failed)} failed. Bounds (relative L2 against the float32 "
             f"reference): {bounds}.", "",
             "Worst relative L2 error per shape and variant over every batch size, eager / graph (the batch size "
             "of the worst in brackets):", "",
             "| shape | " + " | ".join(result["variants"]) + " |",
             "|---" * (1 + len(result["variants"])) + "|"]
    for shape in result["shapes"]:
        cells = []
        for variant in result["variants"]:
            rows = [r for r in records if r["shape"] == shape and r["variant"] == variant]
            if any("error" in r for r in rows) or not rows:
                cells.append("error")
                continue
            e = max(rows, key=lambda r: r["eager_max_error"])
            g = max(rows, key=lambda r: r["graph_max_error"])
            mark = "" if all(r["ok"] for r in rows) else " FAILED"
            cells.append(f"{e['eager_max_error']:.1e} ({e['M']}) / {g['graph_max_error']:.1e} ({g['M']}){mark}")
        lines.append(f"| {shape} | " + " | ".join(cells) + " |")
    lines += ["", "Largest spread between the calls of one point (relative L2 distance from the first call): "
              f"{max((r.get('spread', 0.0) for r in records), default=0.0):.1e}."]
    if failed:
        lines += ["", "## Failed points", ""]
        for r in failed:
            detail = r.get("error", "").strip().splitlines()[-1:] or [
                f"eager {r['eager_errors']}, graph {r['graph_errors']}, non-finite {r['nonfinite']}"]
            lines.append(f"- {r['shape']} {r['variant']} M={r['M']}: {detail[0]}")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    from fmoe2.gemm.config import device_config_name
    from fmoe2.shapes import ALL_SHAPES

    from .provenance import run_record, write_result

    p = argparse.ArgumentParser(prog="python -m fmoe2.bench.correctness", description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default="all", help=f"comma-separated names from {sorted(ALL_SHAPES)}, or all "
                                                   "(every named shape)")
    p.add_argument("--m", default=",".join(map(str, BATCHES)), help="comma-separated batch sizes")
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated from {VARIANTS}")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--workers", type=int, default=6)
    p.add_argument("--out", default=None, help="result file (default misc/bench/correctness/<device>.json)")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        p.error("the correctness grid runs on a GPU (the CPU tests cover small shapes under the interpreter)")
    shapes = list(ALL_SHAPES) if a.shapes == "all" else a.shapes.split(",")
    unknown = [s for s in shapes if s not in ALL_SHAPES]
    variants = a.variants.split(",")
    if unknown or any(v not in VARIANTS for v in variants):
        p.error(f"unknown shapes {unknown} or variants {variants}; known: {sorted(ALL_SHAPES)}, {VARIANTS}")
    batches = [int(m) for m in a.m.split(",")]
    records = run_grid(shapes, variants, batches, a.repeats, a.workers)
    result = dict(run_record("python -m fmoe2.bench.correctness", argv), shapes=shapes, variants=variants,
                  batches=batches, repeats=a.repeats, records=records)
    out = a.out or os.path.join("misc", "bench", "correctness", device_config_name() + ".json")
    print(write_result(out, result, markdown))
    return 0 if all(r["ok"] for r in records) else 1


if __name__ == "__main__":
    sys.exit(main())
