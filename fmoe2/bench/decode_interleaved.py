"""Decode with the experts backends taking turns: ``python -m fmoe2.bench.decode_interleaved``.

At batch 1 a transformers decode step is bound by host work, whose speed drifts over a run on a shared
machine (2026-11-26, H200: one backend's rate varied 1.4x between rounds). ``python -m fmoe2.bench.model``
times each backend's runs one after another, so a drift lands on whichever backend runs then. Here every
round runs one greedy ``generate`` of each backend in turn (a 1-token ``generate`` first, for the prefill
time), on ``--layers`` decoder layers of a model's real sizes with random bf16 weights
(``fmoe2.bench.model.build_model``), and the decode rate of each backend is the median over rounds.
``--batches``: sequences per generate, one table row each; a backend that cannot run (out of memory) is
recorded with its error. ``--compile``: with a static cache, which transformers compiles (``torch.compile``) for
the decode steps.

Beside the speed, per model: the share of each backend's greedy tokens equal to the ``eager`` backend's
(random weights make near-tie picks that bf16 rounding flips in any backend: agreement measures rounding, not
correctness), and each backend's logits' relative error for a forward of 1 token and of ``--prompt`` tokens (one
sequence) to the eager backend's and to a float32 copy of the model on the eager backend (``--logits-only``: these
alone).

``--ceiling`` adds a backend ``no_experts`` whose experts call returns zeros at once (no routing, no weights read): the
rest of the model's step alone, the most any experts backend could reach. Where its rate over the best other
backend's is below a target, no experts backend can meet that target in this mode (eager decode is bound by
transformers' host work per layer, not by the experts).
Writes ``<out-dir>/model/decode_interleaved_<device>[_batch<N>|_batches][_compiled|_logits].json`` and ``.md``
(``_batch<N>`` for a single batch size other than 1, ``_batches`` for several); ``--plot PNG JSON...`` draws result
files.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys

import torch

from fmoe2.gemm.config import device_config_name

from .correctness import relative_error
from .model import MODELS, build_model, generate_times_in_turns
from .provenance import provenance_line, run_record, write_result

REFERENCE_BACKEND = "eager"  # transformers' loop over the experts, in the model's dtype
CEILING_BACKEND = "no_experts"  # the experts call as a zeros allocation: the step's rate without experts work


def no_experts(module, hidden_states, top_k_index, top_k_weights):
    """An experts backend that computes nothing (zeros of the output's shape): the ceiling of any backend. Traced by
    torch.compile, the zeros read the routing weights (one fused op), so the compiled step keeps the router that an
    experts backend needs (unread, Inductor would drop it as dead code)."""
    zeros = torch.zeros_like(hidden_states)
    if torch.compiler.is_compiling():
        zeros = zeros + top_k_weights.sum().to(zeros.dtype) * 0
    return zeros


def register_ceiling() -> str:
    """Registers :func:`no_experts` as transformers' experts backend :data:`CEILING_BACKEND`; returns its name."""
    from transformers.integrations import moe

    moe.ExpertsInterface.register(CEILING_BACKEND, no_experts)
    return CEILING_BACKEND


def _compared(medians: dict) -> list:
    """The rates fmoe2 is compared with: every backend's but fmoe2's and the ceiling's."""
    return [v for b, v in medians.items() if b not in ("fmoe2", CEILING_BACKEND)]


def markdown(result: dict) -> str:
    backends = result["backends"]
    ceiling = CEILING_BACKEND in backends
    compiled = " (static cache, compiled)" if result.get("compiled") else ""
    lines = [f"# Decode{compiled}, backends taking turns: {result['device']}", "",
             provenance_line(result) + f", transformers {result.get('transformers', '?')}", ""]
    if result["rows"]:
        lines += [f"{result['layers']} layers of each model's sizes, random bf16 weights, prompt {result['prompt']}, "
                  f"{result['new_tokens']} greedy tokens, {result['rounds']} rounds; decode tokens/s, median over "
                  "rounds (each round's rates in the JSON). `same tokens`: the share of greedy tokens equal to the "
                  "eager backend's (fmoe2 / grouped_mm; random weights make near ties that rounding flips)." +
                  (f" `{CEILING_BACKEND}`: an experts call that returns zeros at once, the rest of the step alone; "
                   "`ceiling / best other`: the most any experts backend could gain over the best other one."
                   if ceiling else ""), "",
                  "| model | batch | " + " | ".join(backends) + " | fmoe2 / best other |" +
                  (" ceiling / best other |" if ceiling else "") + " same tokens |",
                  "|---|---" + "|---" * (len(backends) + 2 + ceiling) + "|"]
    else:
        lines += [f"{result['layers']} layers of each model's sizes, random bf16 weights."]
    for row in result["rows"]:
        medians = row["median_tokens_per_s"]
        others = _compared(medians)
        ratio = f"{medians['fmoe2'] / max(others):.2f}x" if "fmoe2" in medians and others else ""
        if ceiling:
            ratio += " | " + (f"{medians[CEILING_BACKEND] / max(others):.2f}x"
                              if CEILING_BACKEND in medians and others else "")
        cells = [f"{medians[b]:.1f}" if b in medians else "did not run" for b in backends]
        same = row.get("same_tokens_as_eager", {})
        agreement = " / ".join(f"{same[b]:.0%}" if b in same else "-" for b in ("fmoe2", "grouped_mm"))
        lines.append(f"| {row['model']} | {row.get('batch', result.get('batch', 1))} | " + " | ".join(cells) +
                     f" | {ratio} | {agreement} |")
    for reference, title in (("eager", "the eager backend's (the model's dtype)"),
                             ("eager_fp32", "a float32 copy of the model on the eager backend (the exact forward)")):
        by_model = {model: errors[reference] for model, errors in result.get("logits_rel_err", {}).items()
                    if reference in errors}
        if not by_model:
            continue
        compared = [b for b in backends if (reference != "eager" or b != REFERENCE_BACKEND) and b != CEILING_BACKEND]
        lines += ["", f"Logits' relative error to {title}, one sequence of 1 and of {result['prompt']} tokens:", "",
                  "| model | tokens | " + " | ".join(compared) + " | fmoe2 / grouped_mm |",
                  "|---|---" + "|---" * (len(compared) + 1) + "|"]
        for model, by_tokens in by_model.items():
            for tokens, errs in by_tokens.items():
                ratio = f"{errs['fmoe2'] / errs['grouped_mm']:.2f}x" if errs.get("grouped_mm") and "fmoe2" in errs else ""
                lines.append(f"| {model} | {tokens} | " + " | ".join(
                    f"{errs[b]:.2e}" if b in errs else "-" for b in compared) + f" | {ratio} |")
    errors = [f"- {row['model']} batch {row.get('batch', 1)} {b}: {e}" for row in result["rows"]
              for b, e in row.get("errors", {}).items()]
    if errors:
        lines += ["", "Backends that did not run:", ""] + errors
    return "\n".join(lines) + "\n"


def plot(results: list, path: str) -> None:
    """Decode tokens/s against batch size, one panel per model, one line per backend, one line style per result
    (runs of :func:`main` with several ``--batches``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(dict.fromkeys(row["model"] for result in results for row in result["rows"]))
    backends = list(dict.fromkeys(b for result in results for b in result["backends"]))
    fig, axes = plt.subplots(1, len(models), figsize=(3.6 * len(models), 3.6), squeeze=False)
    for ax, model in zip(axes[0], models):
        for color, backend in zip(plt.rcParams["axes.prop_cycle"].by_key()["color"], backends):
            for run, result in enumerate(results):
                style = ("-", "--", ":", "-.")[run % 4]
                points = sorted((row.get("batch", result.get("batch", 1)), row["median_tokens_per_s"][backend])
                                for row in result["rows"]
                                if row["model"] == model and backend in row["median_tokens_per_s"])
                if points:
                    ax.plot(*zip(*points), style, marker="o", color=color,
                            label=f"{backend}" + (f" (run {run + 1})" if len(results) > 1 else ""))
        ax.set(xscale="log", yscale="log", xlabel="batch", title=model)
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].set_ylabel("decode tokens/s")
    axes[0][-1].legend(fontsize=6)
    first = results[0]
    fig.suptitle(f"{first['layers']} layers, random bf16 weights, {first['device']}, transformers "
                 f"{first.get('transformers', '?')}: greedy decode, experts backends taking turns", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def logits_errors(model, backends, lengths, gen) -> dict:
    """``{reference: {tokens: {backend: relative error}}}``: each backend's logits of one random sequence of each
    length against two references: the :data:`REFERENCE_BACKEND`'s in the model's dtype (``"eager"``: how far a
    backend is from transformers' own rounding) and a float32 copy of the model on the eager backend
    (``"eager_fp32"``: how far it is from the exact forward; the eager bf16 backend is measured against it too;
    left out where the copy does not fit in GPU memory). A backend that raises is left out."""
    import copy

    errors = {"eager": {}, "eager_fp32": {}}
    try:
        exact = copy.deepcopy(model).float()
        exact.set_experts_implementation(REFERENCE_BACKEND)
    except torch.cuda.OutOfMemoryError:  # (a float32 copy of many layers may not fit beside the model)
        exact = None
        del errors["eager_fp32"]
        torch.cuda.empty_cache()
    for length in lengths:
        ids = torch.randint(0, model.config.vocab_size, (1, length), device="cuda", generator=gen)
        with torch.no_grad():
            references = {"eager_fp32": exact(ids).logits.float()} if exact is not None else {}
            model.set_experts_implementation(REFERENCE_BACKEND)
            references["eager"] = model(ids).logits.float()
            for name in errors:
                errors[name][length] = {}
            for backend in backends:
                model.set_experts_implementation(backend)
                try:
                    logits = model(ids).logits.float()
                except Exception:  # noqa: BLE001 - recorded by the timing as the backend's error
                    continue
                for name, reference in references.items():
                    if not (name == "eager" and backend == REFERENCE_BACKEND):
                        errors[name][length][backend] = relative_error(logits, reference)
    del exact
    torch.cuda.empty_cache()
    return errors


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m fmoe2.bench.decode_interleaved", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--models", default="gpt-oss-20b,qwen3-30b-a3b", help=f"comma-separated names from {sorted(MODELS)}")
    p.add_argument("--backends", default="eager,batched_mm,grouped_mm,fmoe2", help="experts backends, in turn order")
    p.add_argument("--layers", type=int, default=4, help="decoder layers of each model")
    p.add_argument("--prompt", type=int, default=64, help="prompt tokens")
    p.add_argument("--new-tokens", type=int, default=32, help="greedy tokens after the first")
    p.add_argument("--batches", default="1", help="comma-separated sequences per generate")
    p.add_argument("--rounds", type=int, default=5, help="rounds (one generate of each backend per round)")
    p.add_argument("--ceiling", action="store_true",
                   help=f"add the backend {CEILING_BACKEND!r} (an experts call that computes nothing): the ceiling")
    p.add_argument("--compile", action="store_true", help="static cache: transformers compiles the decode steps")
    p.add_argument("--logits-only", action="store_true", help="only the logits' errors (no decode timing)")
    p.add_argument("--out-dir", default=os.path.join("misc", "bench"), help="results go to <out-dir>/model/")
    p.add_argument("--plot", nargs="+", metavar=("PNG", "JSON"), default=None,
                   help="only draw result files (JSON ...) into the picture PNG")
    a = p.parse_args(argv)
    if a.plot:
        if len(a.plot) < 2:
            p.error("--plot takes the picture's path, then one or more result files")
        results = []
        for path in a.plot[1:]:
            with open(path) as f:
                results.append(json.load(f))
        plot(results, a.plot[0])
        return 0
    unknown = [m for m in a.models.split(",") if m not in MODELS]
    if unknown:
        p.error(f"unknown models {unknown}: choose from {sorted(MODELS)}")
    try:
        batches = [int(b) for b in a.batches.split(",")]
    except ValueError:
        p.error(f"--batches must be comma-separated ints, got {a.batches!r}")
    if not torch.cuda.is_available():
        raise SystemExit("the decode benchmark needs a CUDA or ROCm GPU")
    import transformers

    import fmoe2.integrations.transformers as fmoe2_transformers

    fmoe2_transformers.register()
    backends = a.backends.split(",")
    if a.ceiling and CEILING_BACKEND not in backends:
        backends.append(CEILING_BACKEND)
    if CEILING_BACKEND in backends:
        register_ceiling()
    result = {**run_record("python -m fmoe2.bench.decode_interleaved", argv), "transformers": transformers.__version__,
              "layers": a.layers, "prompt": a.prompt, "new_tokens": a.new_tokens, "rounds": a.rounds,
              "backends": backends, "compiled": a.compile, "batches": batches, "rows": [], "logits_rel_err": {}}
    generate_options = dict(do_sample=False, cache_implementation="static") if a.compile else dict(do_sample=False)
    suffix = (f"_batch{batches[0]}" if batches != [1] and len(batches) == 1 else "_batches" if len(batches) > 1
              else "") + ("_compiled" if a.compile else "")
    suffix = "_logits" if a.logits_only else suffix
    out = os.path.join(a.out_dir, "model", f"decode_interleaved_{device_config_name()}{suffix}.json")
    for name in a.models.split(","):
        model = build_model(name, a.layers)
        gen = torch.Generator(device="cuda").manual_seed(1)
        result["logits_rel_err"][name] = logits_errors(model, [b for b in backends if b != CEILING_BACKEND],
                                                       (1, a.prompt), gen)
        print(name, "logits relative error to eager:", result["logits_rel_err"][name], flush=True)
        for batch in [] if a.logits_only else batches:
            ids = torch.randint(0, model.config.vocab_size, (batch, a.prompt), device="cuda", generator=gen)

            def generate(tokens: int, backend: str, model=model, ids=ids):
                model.set_experts_implementation(backend)
                with torch.no_grad():
                    return model.generate(ids, max_new_tokens=tokens, **generate_options)

            times = generate_times_in_turns({b: functools.partial(generate, backend=b) for b in backends},
                                            a.new_tokens + 1, a.rounds)
            errors = {b: t["error"] for b, t in times.items() if "error" in t}
            for backend, error in errors.items():
                print(f"{name} batch {batch} {backend} did not run: {error}", flush=True)
            rates = {b: [batch * a.new_tokens / (total - prefill) for prefill, total in zip(t["prefill_s"],
                                                                                            t["total_s"])]
                     for b, t in times.items() if "error" not in t}
            same = {}
            try:  # (the eager backend's tokens, also where it is not among the timed backends)
                reference = generate(a.new_tokens + 1, REFERENCE_BACKEND)[:, a.prompt:]
                same = {b: (generate(a.new_tokens + 1, b)[:, a.prompt:] == reference).float().mean().item()
                        for b in rates if b not in (REFERENCE_BACKEND, CEILING_BACKEND)}
            except Exception as error:  # noqa: BLE001 - recorded, not fatal (e.g. out of memory)
                errors["same_tokens"] = f"{type(error).__name__}: {str(error)[:300]}"
                torch.cuda.empty_cache()
            print(name, batch, {b: [round(v, 1) for v in r] for b, r in rates.items()}, "same tokens", same,
                  flush=True)
            result["rows"].append({"model": name, "batch": batch, "tokens_per_s": rates, "errors": errors,
                                   "median_tokens_per_s": {b: statistics.median(v) for b, v in rates.items()},
                                   "same_tokens_as_eager": same})
            write_result(out, result, markdown)  # after every point: a run cut short keeps what it measured
        del model
        torch.cuda.empty_cache()
    print(write_result(out, result, markdown))
    return 0


if __name__ == "__main__":
    sys.exit(main())
