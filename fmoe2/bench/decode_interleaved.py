"""Decode with the experts backends taking turns: ``python -m fmoe2.bench.decode_interleaved``.

At batch 1 a transformers decode step is bound by host work, whose speed drifts over a run on a shared
machine (2026-11-26, H200: one backend's rate varied 1.4x between rounds). ``python -m fmoe2.bench.model``
times each backend's runs one after another, so a drift lands on whichever backend runs then. Here every
round runs one greedy ``generate`` of each backend in turn (a 1-token ``generate`` first, for the prefill
time), on ``--layers`` decoder layers of a model's real sizes with random bf16 weights
(``fmoe2.bench.model.build_model``), and the decode rate of each backend is the median over rounds.
``--batch``: sequences per generate (1 by default); a backend that cannot run (out of memory) is
recorded with its error. ``--compile``: with a static cache, which transformers compiles (``torch.compile``) for the decode steps.
Writes ``<out-dir>/model/decode_interleaved_<device>[_batch<N>][_compiled].json`` and ``.md``.
"""
from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys

import torch

from fmoe2.gemm.config import device_config_name

from .model import MODELS, build_model, generate_times_in_turns
from .provenance import provenance_line, run_record, write_result


def markdown(result: dict) -> str:
    backends = result["backends"]
    compiled = " (static cache, compiled)" if result.get("compiled") else ""
    lines = [f"# Batch-{result.get('batch', 1)} decode{compiled}, backends taking turns: {result['device']}", "",
             provenance_line(result), "",
             f"{result['layers']} layers of each model's sizes, random bf16 weights, prompt {result['prompt']}, "
             f"{result['new_tokens']} greedy tokens, {result['rounds']} rounds; decode tokens/s, median over rounds "
             "(each round's rates in the JSON).", "",
             "| model | " + " | ".join(backends) + " | fmoe2 / best other |", "|---" * (len(backends) + 2) + "|"]
    for row in result["rows"]:
        medians = row["median_tokens_per_s"]
        others = [v for b, v in medians.items() if b != "fmoe2"]
        ratio = f"{medians['fmoe2'] / max(others):.2f}x" if "fmoe2" in medians and others else ""
        cells = [f"{medians[b]:.1f}" if b in medians else "did not run" for b in backends]
        lines.append(f"| {row['model']} | " + " | ".join(cells) + f" | {ratio} |")
    errors = [f"- {row['model']} {b}: {e}" for row in result["rows"] for b, e in row.get("errors", {}).items()]
    if errors:
        lines += ["", "Backends that did not run:", ""] + errors
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m fmoe2.bench.decode_interleaved", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--models", default="gpt-oss-20b,qwen3-30b-a3b", help=f"comma-separated names from {sorted(MODELS)}")
    p.add_argument("--backends", default="batched_mm,grouped_mm,fmoe2", help="experts backends, in turn order")
    p.add_argument("--layers", type=int, default=4, help="decoder layers of each model")
    p.add_argument("--prompt", type=int, default=64, help="prompt tokens")
    p.add_argument("--new-tokens", type=int, default=32, help="greedy tokens after the first")
    p.add_argument("--batch", type=int, default=1, help="sequences per generate")
    p.add_argument("--rounds", type=int, default=5, help="rounds (one generate of each backend per round)")
    p.add_argument("--compile", action="store_true", help="static cache: transformers compiles the decode steps")
    p.add_argument("--out-dir", default=os.path.join("misc", "bench"), help="results go to <out-dir>/model/")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("the decode benchmark needs a CUDA or ROCm GPU")
    import transformers

    import fmoe2.integrations.transformers as fmoe2_transformers

    fmoe2_transformers.register()
    backends = a.backends.split(",")
    result = {**run_record("python -m fmoe2.bench.decode_interleaved", argv), "transformers": transformers.__version__,
              "layers": a.layers, "prompt": a.prompt, "new_tokens": a.new_tokens, "rounds": a.rounds,
              "backends": backends, "compiled": a.compile, "batch": a.batch, "rows": []}
    generate_options = dict(do_sample=False, cache_implementation="static") if a.compile else dict(do_sample=False)
    for name in a.models.split(","):
        model = build_model(name, a.layers)
        gen = torch.Generator(device="cuda").manual_seed(1)
        ids = torch.randint(0, model.config.vocab_size, (a.batch, a.prompt), device="cuda", generator=gen)

        def generate(tokens: int, backend: str, model=model, ids=ids):
            model.set_experts_implementation(backend)
            with torch.no_grad():
                return model.generate(ids, max_new_tokens=tokens, **generate_options)

        times = generate_times_in_turns({b: functools.partial(generate, backend=b) for b in backends},
                                        a.new_tokens + 1, a.rounds)
        errors = {b: t["error"] for b, t in times.items() if "error" in t}
        for backend, error in errors.items():
            print(f"{name} {backend} did not run: {error}", flush=True)
        rates = {b: [a.batch * a.new_tokens / (total - prefill) for prefill, total in zip(t["prefill_s"], t["total_s"])]
                 for b, t in times.items() if "error" not in t}
        print(name, {b: [round(v, 1) for v in r] for b, r in rates.items()}, flush=True)
        result["rows"].append({"model": name, "tokens_per_s": rates, "errors": errors,
                               "median_tokens_per_s": {b: statistics.median(v) for b, v in rates.items()}})
        del model
        torch.cuda.empty_cache()
    suffix = (f"_batch{a.batch}" if a.batch != 1 else "") + ("_compiled" if a.compile else "")
    out = os.path.join(a.out_dir, "model", f"decode_interleaved_{device_config_name()}{suffix}.json")
    print(write_result(out, result, markdown))
    return 0


if __name__ == "__main__":
    sys.exit(main())
