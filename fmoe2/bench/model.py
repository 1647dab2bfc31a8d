"""Model-level benchmark: ``python -m fmoe2.bench.model`` — transformers MoE models decoding with each
experts backend.

Models are built from real configs' layer sizes with random bf16 weights on the GPU (no download),
``--layers`` decoder layers each: Qwen3-30B-A3B, Mixtral-8x7B, gpt-oss-20b, Qwen1.5-MoE-A2.7B and OLMoE-1B-7B.
For every model, batch size and backend (transformers' ``eager``, ``grouped_mm``, ``batched_mm``, and
``fmoe2``), greedy ``generate`` of ``--new-tokens`` tokens after a ``--prompt``-token prompt: the prefill time (a
``generate`` of one token) and the decode rate ``batch * (new_tokens - 1) / (t_generate - t_prefill)``,
median of ``--repeats`` timed runs after a warm-up run, the GPU synchronised around each. ``--compile``
adds runs with a static cache, which transformers compiles (``torch.compile``) for the decode steps,
for the backends named by ``--compile-backends``. Each backend's greedy tokens are compared with the
``eager`` backend's: with random weights (transformers' initialisation, std 0.02) the routers' top-k
and the greedy picks are near ties, which bf16 rounding flips in every backend, transformers' own
included, so that agreement measures rounding, not correctness (the tests check correctness).
Writes ``<out-dir>/model/<device>.json`` and ``.md``.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

from fmoe2.gemm.config import device_config_name

from .provenance import rewrite_report, run_record

# Real configs' layer sizes (the models' own config.json values), fewer layers.
MODELS = {
    "qwen3-30b-a3b": ("qwen3_moe", dict(hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                                        num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
                                        num_experts_per_tok=8, vocab_size=151936, norm_topk_prob=True,
                                        max_position_embeddings=4096)),
    "mixtral-8x7b": ("mixtral", dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
                                     num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2,
                                     vocab_size=32000, max_position_embeddings=4096)),
    "gpt-oss-20b": ("gpt_oss", dict(hidden_size=2880, intermediate_size=2880, num_attention_heads=64,
                                    num_key_value_heads=8, head_dim=64, num_local_experts=32, num_experts_per_tok=4,
                                    vocab_size=201088, sliding_window=128, max_position_embeddings=4096)),
    "gpt-oss-120b": ("gpt_oss", dict(hidden_size=2880, intermediate_size=2880, num_attention_heads=64,
                                     num_key_value_heads=8, head_dim=64, num_local_experts=128, num_experts_per_tok=4,
                                     vocab_size=201088, sliding_window=128, max_position_embeddings=4096)),
    # Qwen1.5-MoE-A2.7B (qwen2_moe: a shared expert beside the routed ones) and OLMoE-1B-7B
    "qwen1.5-moe-a2.7b": ("qwen2_moe", dict(hidden_size=2048, intermediate_size=5632, moe_intermediate_size=1408,
                                            shared_expert_intermediate_size=5632, num_attention_heads=16,
                                            num_key_value_heads=16, num_experts=60, num_experts_per_tok=4,
                                            vocab_size=151936, max_position_embeddings=4096)),
    "olmoe-1b-7b": ("olmoe", dict(hidden_size=2048, intermediate_size=1024, num_attention_heads=16,
                                  num_key_value_heads=16, num_experts=64, num_experts_per_tok=8, vocab_size=50304,
                                  max_position_embeddings=4096)),
}
BACKENDS = ("eager", "grouped_mm", "batched_mm", "fmoe2")


def build_model(name: str, layers: int):
    from transformers import AutoModelForCausalLM
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    model_type, sizes = MODELS[name]
    extra = {}
    if model_type == "gpt_oss":  # alternate sliding and full attention, as the real model does
        extra["layer_types"] = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]
    config = CONFIG_MAPPING[model_type](**sizes, num_hidden_layers=layers, **extra)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.generation_config.eos_token_id = None  # always generate the requested tokens
    model.generation_config.pad_token_id = 0
    return model.eval()


def _synchronize():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed_synchronized(fn):
    """(seconds, result) of ``fn()`` from an idle GPU to an idle GPU: a whole ``generate``, host work included."""
    _synchronize()
    start = time.perf_counter()
    result = fn()
    _synchronize()
    return time.perf_counter() - start, result


def generate_times_in_turns(runs: dict, tokens: int, rounds: int) -> dict:
    """Seconds of greedy generates of each of ``runs`` (name -> ``run(new_tokens)``, one ``generate``), the runs
    taking turns: eager decode is host-bound and the host's speed drifts over a run by more than the differences
    measured (a backend's rate varied 1.4x between rounds on a shared H200), so every round times each run once in
    turn, a 1-token generate (the prefill) then one of ``tokens``. Before the rounds each run makes one generate of
    ``tokens`` (compiles, plans, allocator); a run that raises there is recorded with its error and left out.
    Returns name -> ``{"prefill_s": [...], "total_s": [...], "peak_bytes": warm-up peak or None}`` or
    ``{"error": str}``, in the order of ``runs``."""
    out = {}
    for name, run in runs.items():
        try:
            if torch.cuda.is_available():
                torch.cuda.reset_peak_memory_stats()
            run(tokens)
            peak = torch.cuda.max_memory_allocated() if torch.cuda.is_available() else None
            out[name] = {"prefill_s": [], "total_s": [], "peak_bytes": peak}
        except Exception as error:  # noqa: BLE001 - recorded (e.g. out of memory), not fatal
            out[name] = {"error": f"{type(error).__name__}: {str(error)[:300]}"}
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    running = [name for name in runs if "error" not in out[name]]
    for _ in range(rounds):
        for name in running:
            out[name]["prefill_s"].append(timed_synchronized(lambda: runs[name](1))[0])
            out[name]["total_s"].append(timed_synchronized(lambda: runs[name](tokens))[0])
    return out


def run_point(model, backend: str, batch: int, prompt: int, new_tokens: int, repeats: int, compiled: bool, gen):
    """(prefill s, decode tokens/s, generated tokens, peak GPU bytes) of one backend at one batch size."""
    model.set_experts_implementation(backend)
    torch.cuda.reset_peak_memory_stats()
    input_ids = torch.randint(0, model.config.vocab_size, (batch, prompt), device="cuda", generator=gen)
    kwargs = dict(do_sample=False, cache_implementation="static") if compiled else dict(do_sample=False)
    with torch.no_grad():
        model.generate(input_ids, max_new_tokens=new_tokens, **kwargs)  # warm-up (compiles)
        prefill = statistics.median(timed_synchronized(lambda: model.generate(input_ids, max_new_tokens=1, **kwargs))[0]
                                    for _ in range(repeats))
        runs = [timed_synchronized(lambda: model.generate(input_ids, max_new_tokens=new_tokens, **kwargs))
                for _ in range(repeats)]
    total = statistics.median(t for t, _ in runs)
    tokens = runs[-1][1][:, prompt:]
    return prefill, batch * (new_tokens - 1) / max(total - prefill, 1e-9), tokens, torch.cuda.max_memory_allocated()


def markdown(result: dict) -> str:
    lines = [f"# Model-level decode: {result['device']}", "",
             f"{result['date']}, torch {result['torch']}, Triton {result['triton']}, transformers "
             f"{result['transformers']}; `{result['command']}`", "",
             f"{result['layers']} layers of each model's sizes, random bf16 weights, prompt {result['prompt']}, "
             f"{result['new_tokens']} greedy tokens. Decode tokens/s (prefill ms). `same tokens`: greedy tokens "
             "equal to the eager backend's, fmoe2 / grouped_mm (random weights make near-tie picks that bf16 "
             "rounding flips in any backend: not a correctness measure).", ""]
    for mode in ("eager", "compiled"):
        rows = [r for r in result["rows"] if r["mode"] == mode and "error" not in r]
        if not rows:
            continue
        backends = [b for b in BACKENDS if any(r["backend"] == b for r in rows)]
        lines += [f"## {'Without torch.compile' if mode == 'eager' else 'torch.compile, static cache'}", "",
                  "| model | batch | " + " | ".join(backends) + " | fmoe2 over best other | same tokens |",
                  "|---|---|" + "---|" * (len(backends) + 2)]
        for model in dict.fromkeys(r["model"] for r in rows):
            for batch in sorted({r["batch"] for r in rows if r["model"] == model}):
                cell = {r["backend"]: r for r in rows if r["model"] == model and r["batch"] == batch}
                others = [cell[b]["decode_tokens_per_s"] for b in backends if b != "fmoe2" and b in cell]
                ratio = (f"{cell['fmoe2']['decode_tokens_per_s'] / max(others):.2f}x"
                         if "fmoe2" in cell and others else "")
                same = " / ".join(f"{cell[b]['same_tokens_as_eager']:.0%}" if "same_tokens_as_eager" in cell.get(b, {})
                                  else "-" for b in ("fmoe2", "grouped_mm"))
                lines.append(f"| {model} | {batch} | " + " | ".join(
                    f"{cell[b]['decode_tokens_per_s']:.0f} ({cell[b]['prefill_s'] * 1e3:.1f})" if b in cell else ""
                    for b in backends) + f" | {ratio} | {same} |")
        lines.append("")
    rows = [r for r in result["rows"] if "peak_bytes" in r and r["mode"] == "eager"]
    if rows:
        lines += ["GPU memory, GiB: the model's weights, then the peak of a generate and what stays allocated after it "
                  "(eager runs):", "", "| model | batch | weights | " + " | ".join(
                      f"{b} peak / after" for b in BACKENDS) + " |", "|---|---|---|" + "---|" * len(BACKENDS)]
        for model in dict.fromkeys(r["model"] for r in rows):
            for batch in sorted({r["batch"] for r in rows if r["model"] == model}):
                cell = {r["backend"]: r for r in rows if r["model"] == model and r["batch"] == batch}
                weights = next(iter(cell.values()))["model_bytes"] / 2**30
                lines.append(f"| {model} | {batch} | {weights:.2f} | " + " | ".join(
                    f"{cell[b]['peak_bytes'] / 2**30:.2f} / {cell[b]['resident_bytes'] / 2**30:.2f}" if b in cell else ""
                    for b in BACKENDS) + " |")
        lines.append("")
    errors = [r for r in result["rows"] if "error" in r]
    if errors:
        lines += ["Points that did not run:", ""] + [f"- {r['model']} {r['mode']} {r['backend']} batch {r['batch']}: "
                                                   f"{r['error']}" for r in errors] + [""]
    return "\n".join(lines)


def plot(result: dict, path: str) -> None:
    """Decode tokens/s against batch size, one panel per model, one line per backend (eager runs)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in result["rows"] if r["mode"] == "eager" and "error" not in r]
    models = list(dict.fromkeys(r["model"] for r in rows))
    fig, axes = plt.subplots(1, len(models), figsize=(4.2 * len(models), 3.8), squeeze=False)
    for ax, model in zip(axes[0], models):
        for backend in BACKENDS:
            points = sorted((r["batch"], r["decode_tokens_per_s"]) for r in rows
                            if r["model"] == model and r["backend"] == backend)
            if points:
                ax.plot(*zip(*points), marker="o", label=backend)
        ax.set(xscale="log", yscale="log", xlabel="batch", title=model)
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].set_ylabel("decode tokens/s")
    axes[0][-1].legend()
    fig.suptitle(f"{result['layers']} layers, random bf16 weights, {result['device']} "
                 f"(transformers {result['transformers']}): decode without torch.compile", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m fmoe2.bench.model", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--models", default=",".join(MODELS), help=f"comma-separated names from {sorted(MODELS)}")
    p.add_argument("--layers", type=int, default=4, help="decoder layers of each model")
    p.add_argument("--batches", default="1,8,64,256", help="comma-separated batch sizes")
    p.add_argument("--backends", default=",".join(BACKENDS), help="experts backends to time")
    p.add_argument("--prompt", type=int, default=64, help="prompt tokens")
    p.add_argument("--new-tokens", type=int, default=32, help="greedy tokens generated")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per point (median)")
    p.add_argument("--compile", action="store_true", help="also time static-cache runs, which transformers compiles")
    p.add_argument("--compile-backends", default="batched_mm,fmoe2", help="backends of the compiled runs")
    p.add_argument("--compile-models", default="qwen3-30b-a3b", help="models of the compiled runs")
    p.add_argument("--compile-batches", default="1,8,64", help="batch sizes of the compiled runs")
    p.add_argument("--out-dir", default=os.path.join("misc", "bench"), help="results go to <out-dir>/model/")
    p.add_argument("--report", default=None, metavar="JSON",
                   help="only rewrite the markdown (and, for eager runs, the plot misc/<device>_model_decode.png) "
                        "of a result file")
    a = p.parse_args(argv)
    if a.report:
        rewrite_report(a.report, markdown)
        with open(a.report) as f:
            result = json.load(f)
        if len({r["backend"] for r in result["rows"] if r["mode"] == "eager" and "error" not in r}) > 1:
            device = result["device"].replace(" ", "_")
            plot(result, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(a.report)))),
                                      f"{device}_model_decode.png"))
        return 0
    if not torch.cuda.is_available():
        raise SystemExit("the model benchmark needs a CUDA or ROCm GPU")
    import transformers

    import fmoe2.integrations.transformers  # noqa: F401  (registers "fmoe2")

    result = {**run_record("python -m fmoe2.bench.model", argv), "transformers": transformers.__version__,
              "layers": a.layers, "prompt": a.prompt, "new_tokens": a.new_tokens, "rows": []}
    out_dir = os.path.join(a.out_dir, "model")
    os.makedirs(out_dir, exist_ok=True)
    for name in a.models.split(","):
        model = build_model(name, a.layers)
        model_bytes = torch.cuda.memory_allocated()  # the weights (nothing else is allocated yet)
        plans = [("eager", b, n) for n in (int(v) for v in a.batches.split(",")) for b in a.backends.split(",")]
        if a.compile and name in a.compile_models.split(","):
            plans += [("compiled", b, int(n)) for n in a.compile_batches.split(",") for b in a.compile_backends.split(",")]
        reference = {}
        for mode, backend, batch in plans:
            try:
                prefill, rate, tokens, peak = run_point(model, backend, batch, a.prompt, a.new_tokens, a.repeats,
                                                        mode == "compiled",
                                                        torch.Generator(device="cuda").manual_seed(batch))
            except Exception as error:  # noqa: BLE001 - a backend that cannot run a point: recorded, not fatal
                row = dict(model=name, mode=mode, backend=backend, batch=batch, error=f"{type(error).__name__}: "
                                                                                     f"{str(error)[:300]}")
                print(json.dumps(row), flush=True)
                result["rows"].append(row)
                continue
            row = dict(model=name, mode=mode, backend=backend, batch=batch, prefill_s=prefill,
                       decode_tokens_per_s=rate, peak_bytes=peak, resident_bytes=torch.cuda.memory_allocated(),
                       model_bytes=model_bytes)
            if backend == "eager" and mode == "eager":
                reference[batch] = tokens
            if backend != "eager" and batch in reference:  # (greedy picks among near ties: see the docstring)
                row["same_tokens_as_eager"] = (tokens == reference[batch]).float().mean().item()
            result["rows"].append(row)
            print(json.dumps(row), flush=True)
            with open(os.path.join(out_dir, f"{device_config_name()}.json"), "w") as f:
                json.dump(result, f, indent=1)
        del model
        torch.cuda.empty_cache()
        torch._dynamo.reset()
    print(rewrite_report(os.path.join(out_dir, f"{device_config_name()}.json"), markdown, result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
