"""Deterministic-mode benchmark: ``python -m fmoe2.bench --deterministic``.

Per shape (default: the three benchmark shapes) and batch, on fresh random bf16 data with softmax +
top-k routing, in one run:

* times (CUDA graphs, 10 calls per graph, CUDA events, median of replays; ``timing.py``) of fmoe2's
  default forward (prepared weights, ``path="auto"``, the tuned configs), of the options for the default's
  numerics (its config with bf16 atomic adds into the output, ``accumulate_fp32=False``, and with the float32
  accumulator, ``accumulate_fp32=True``; the two-stage path with the picked tiling), of deterministic
  mode (``deterministic=True``; with ``--candidates`` also the fixed tiling it takes where tilings were not
  measured alike, and one other), and of the vLLM-style baseline with the config its search picked for this
  device and point in ``<device>__<shape>.json`` of ``--out-dir``, else of the checkout's ``misc/bench`` (the
  first candidate where neither has one: marked in the report, and a warning);
* relative L2 errors against the float32 reference of each;
* reproducibility: the largest difference between 5 eager calls and a CUDA-graph replay of each mode,
  and for deterministic mode whether the first 8 tokens' rows computed alone (M=1 and M=8, other
  companions) are bitwise those of the full batch.

Writes ``<out-dir>/deterministic/<device>.json`` and ``.md``.
"""
from __future__ import annotations

import json
import os
import sys
from dataclasses import replace

import torch

import fmoe2
from fmoe2.gemm.config import CONFIG_DIR, FusedMoEConfig, _load_json, device_config_name
from fmoe2.gemm.fused_moe import forward_launches, plan_of
from fmoe2.shapes import ALL_SHAPES

from .provenance import provenance_line, run_record, write_result
from .search import baseline_candidates
from .timing import capture_graph, time_in_graph
from .vllm_style import GroupedGemmConfig, vllm_style_fused_experts

# Fixed tilings timed for deterministic mode with --candidates: defaults.json's (with adapters, fp8 weights, or
# GPUs whose tilings were not measured alike) and the CUDA large-batch rule's (128-row tiles).
CANDIDATES = {
    "fixed": FusedMoEConfig.from_dict(_load_json(os.path.join(CONFIG_DIR, "defaults.json"))["deterministic"]["cuda"]),
    "bm128": FusedMoEConfig(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, BLOCK_H=128, GROUP_M=8, num_warps=8, num_stages=4,
                            path="two_stage", S2_BLOCK_N=256, S2_BLOCK_K=64, S2_GROUP_M=8, s2_num_warps=8,
                            s2_num_stages=4),
}


def _time(fn, M: int) -> float:
    return time_in_graph(fn, replays=50 if M < 1024 else 15)


# The main benchmark's committed results (a checkout's misc/bench): where --out-dir has none of its own.
COMMITTED_RESULTS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                                 "misc", "bench")


def searched_baseline(out_dir: str, name: str, M: int, E: int, topk: int):
    """The baseline's configs for (shape, M) from the main benchmark's result file on this device (its
    search's pick) in ``out_dir``, else in :data:`COMMITTED_RESULTS`, else its first candidate, with a warning:
    an unsearched baseline can be several times slower (Mixtral M=1024 on an H200: 4.2 ms against 1.9)."""
    for folder in dict.fromkeys((out_dir, COMMITTED_RESULTS)):
        path = os.path.join(folder, f"{device_config_name()}__{name}.json")
        if os.path.exists(path):
            with open(path) as f:
                for row in json.load(f)["results"]:
                    if row["M"] == M:
                        cfg = GroupedGemmConfig(**row["baseline_config"])
                        return (cfg, cfg), "searched"
    print(f"warning: no searched vLLM-style config for {name} M={M} on this device (run python -m fmoe2.bench "
          f"--shapes {name} first): its first candidate is timed", file=sys.stderr, flush=True)
    return baseline_candidates(M, E, topk)[0], "first candidate"


def _max_diff(outs) -> float:
    return max((o.float() - outs[0].float()).abs().max().item() for o in outs)


def _repeat_and_replay(run, out) -> float:
    """Largest difference between 5 eager calls and one CUDA-graph replay of ``run`` (writing ``out``)."""
    outs = [run().clone() for _ in range(5)]
    graph = capture_graph(run)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    outs.append(out.clone())
    graph.reset()
    return _max_diff(outs)


def bench_shape(name, shape, ms, out_dir, gen, candidates: bool):
    from .problems import make_inputs, make_weights, rel_err

    E, H, I, topk = shape
    w1, w2, options, biases, prepared = make_weights(name, shape, gen)
    rows = []
    for M in ms:
        x, tw, ti = make_inputs(M, E, H, I, topk, gen)
        out = torch.empty_like(x)

        def run(deterministic, config=None, out=out, x=x, tw=tw, ti=ti):
            return lambda: fmoe2.fused_moe(x, prepared, None, tw, ti, out=out, deterministic=deterministic,
                                           config=config, **options)

        base_cfgs, base_source = searched_baseline(out_dir, name, M, E, topk)
        run_base = lambda: vllm_style_fused_experts(x, w1, w2, tw, ti, *base_cfgs, **options, **biases)  # noqa: E731
        ref = fmoe2.fused_moe_reference(x.float(), w1.float(), w2.float(), tw, ti, **options,
                                        **{k: v.float() for k, v in biases.items()})
        picked = plan_of(x, prepared, None, tw, ti, out=out, deterministic=False, **options)
        if picked is None:
            run(False)()
            picked = plan_of(x, prepared, None, tw, ti, out=out, deterministic=False, **options)
        bf16_adds = replace(picked.config, accumulate_fp32=False)
        fp32_acc = replace(picked.config, accumulate_fp32=True)
        two_stage = replace(picked.config, path="two_stage", accumulate_fp32=False)
        variants = dict(default=run(False), bf16_atomic_adds=run(False, bf16_adds),
                        fp32_accumulator=run(False, fp32_acc), two_stage=run(False, two_stage),
                        deterministic=run(True), vllm_style=run_base)
        err = {k: rel_err(fn().clone(), ref) for k, fn in variants.items()}
        times = {k: _time(fn, M) for k, fn in variants.items()}
        if candidates:
            for label, cfg in CANDIDATES.items():
                times[f"deterministic_{label}"] = _time(run(True, cfg), M)
        default_path = picked.config.path
        det_config = plan_of(x, prepared, None, tw, ti, out=out, deterministic=True, **options).config
        spread = dict(default=_repeat_and_replay(run(False), out), deterministic=_repeat_and_replay(run(True), out))
        full = run(True)().clone()
        alone = []
        for count in (1, 8):
            sub = min(count, M)
            companions = torch.randn(max(0, count - sub), H, device="cuda", dtype=torch.bfloat16, generator=gen)
            c_logits = torch.randn(companions.shape[0], E, device="cuda", generator=gen)
            c_tw, c_ti = torch.topk(c_logits.softmax(dim=-1), topk, dim=-1)
            xs = torch.cat([x[:sub], companions])
            tws, tis = torch.cat([tw[:sub], c_tw]), torch.cat([ti[:sub], c_ti.to(torch.int32)])
            rows_alone = fmoe2.fused_moe(xs, prepared, None, tws, tis, deterministic=True, **options)[:sub]
            alone.append(torch.equal(rows_alone, full[:sub]))
        row = dict(shape=name, E=E, H=H, I=I, topk=topk, M=M, default_path=default_path,
                   default_launches=[n for n, _ in forward_launches(x, prepared, None, tw, ti, **options)],
                   deterministic_config=det_config.to_dict(), baseline_config=base_cfgs[0].__dict__,
                   baseline_config_source=base_source, us=times, rel_err=err, max_diff_repeat_and_replay=spread,
                   deterministic_over_default=times["deterministic"] / times["default"],
                   vllm_style_over_deterministic=times["vllm_style"] / times["deterministic"],
                   batch_invariant=all(alone))
        rows.append(row)
        print(f"{name:17s} M={M:6d} ({default_path}) " + "  ".join(f"{k} {times[k]:.1f} us err {err[k]:.2e}"
                                                               for k in variants)
              + f"  det/default {row['deterministic_over_default']:.3f}x  spread {spread['default']:.1e}/"
              f"{spread['deterministic']:.1e}  invariant {row['batch_invariant']}"
              + "".join(f"  {k} {v:.1f}" for k, v in times.items() if k.startswith("deterministic_")), flush=True)
    return rows


def markdown(result: dict) -> str:
    lines = [f"# Deterministic mode and the default's numerics: {result['device']}", "",
             provenance_line(result), "",
             "Microseconds per forward in CUDA graphs (bf16, prepared weights). Default: `path=\"auto\"` with the tuned "
             "configs; deterministic: `deterministic=True`; vLLM-style: the baseline with the config its search "
             "picked on this device in the main benchmark (`*`: none was found, its first candidate). Errors: "
             "relative L2 against the float32 reference. Spread: largest difference between 5 eager calls and a "
             "CUDA-graph replay. Invariant: the first token's row computed alone, and the first 8 tokens' rows computed "
             "as a batch of 8 (below M=8 with random other tokens), are bitwise those of the full batch (the GPU "
             "tests check other companions at M = 1, 7, 64, 1000).", "",
             "| shape | M | default | path | launches | deterministic | det / default | vLLM-style | vLLM-style / det "
             "| err default | err det | err vLLM-style | spread default | spread det | invariant |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["results"]:
        t, e, s = r["us"], r["rel_err"], r["max_diff_repeat_and_replay"]
        lines.append(
            f"| {r['shape']} | {r['M']} | {t['default']:.1f} | {r['default_path']} | {len(r['default_launches'])} | "
            f"{t['deterministic']:.1f} | {r['deterministic_over_default']:.3f}x | {t['vllm_style']:.1f}"
            f"{'' if r.get('baseline_config_source', 'searched') == 'searched' else '*'} | "
            f"{r['vllm_style_over_deterministic']:.2f}x | {e['default']:.2e} | {e['deterministic']:.2e} | "
            f"{e['vllm_style']:.2e} | {s['default']:.1e} | {s['deterministic']:.1e} | "
            f"{'yes' if r['batch_invariant'] else 'NO'} |")
    lines += ["", "Errors (relative L2 against float32) and times of the options for the default's numerics: the picked "
              "config with bf16 atomic adds into the output (`accumulate_fp32=False`, the default before 2026-11-25) and "
              "with a float32 accumulator (`accumulate_fp32=True`: the adds go to a float32 buffer, one more launch "
              "casts it; the default on the fused path since), the two-stage path with the picked tiling, "
              "deterministic mode. `x`: error over the vLLM-style path's; times over the bf16 adds'.", "",
              "| shape | M | path | bf16 adds err | x | fp32 acc. err | x | time | two-stage err | x | time "
              "| det err | x | time | vLLM-style err |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["results"]:
        t, e = r["us"], r["rel_err"]
        base = e["vllm_style"]

        def cell(k):
            return f"{e[k]:.2e} | {e[k] / base:.2f}"

        def ratio(k):
            return f"{t[k] / t['bf16_atomic_adds']:.3f}x"

        lines.append(f"| {r['shape']} | {r['M']} | {r['default_path']} | {cell('bf16_atomic_adds')} | "
                     f"{cell('fp32_accumulator')} | {ratio('fp32_accumulator')} | {cell('two_stage')} | "
                     f"{ratio('two_stage')} | {cell('deterministic')} | {ratio('deterministic')} | {base:.2e} |")
    extra = sorted({k for r in result["results"] for k in r["us"] if k.startswith("deterministic_")})
    if extra:
        lines += ["", "Fixed tilings for deterministic mode (us; `fixed`: the one it takes with adapters, fp8 weights "
                  "or where tilings were not measured alike):", "",
                  "| shape | M | deterministic | " + " | ".join(k[len("deterministic_"):] for k in extra) + " |",
                  "|---|---|---|" + "---|" * len(extra)]
        for r in result["results"]:
            lines.append(f"| {r['shape']} | {r['M']} | {r['us']['deterministic']:.1f} | "
                         + " | ".join(f"{r['us'].get(k, float('nan')):.1f}" for k in extra) + " |")
    return "\n".join(lines) + "\n"


def run_deterministic_bench(shapes, ms, out_dir, gen, candidates=False, argv=None) -> str:
    """Runs the shapes in turn, rewriting the result file after each."""
    result = {**run_record("python -m fmoe2.bench", argv), "results": []}
    path = os.path.join(out_dir, "deterministic", f"{device_config_name()}.json")
    report = ""
    for name in shapes:
        result["results"] += bench_shape(name, ALL_SHAPES[name], ms, out_dir, gen, candidates)
        report = write_result(path, result, markdown)
    return report


__all__ = ["run_deterministic_bench", "markdown", "CANDIDATES"]
