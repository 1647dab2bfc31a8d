"""PEFT adapters of the experts at decode: ``python -m fmoe2.bench.peft_decode``.

A transformers model built from a real config's layer sizes (``--model``, default Qwen3-30B-A3B, with
``--layers`` decoder layers, random bf16 weights on the GPU) and ``--adapters`` random PEFT adapters of
its experts (``LoraConfig(target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])``,
rank ``--rank``, made by PEFT itself). Greedy decode tokens/s (as ``python -m fmoe2.bench.model``
measures it: ``generate`` of ``--new-tokens`` tokens after a ``--prompt``-token prompt, the prefill
subtracted, medians of ``--repeats`` rounds that time every variant once in turn: eager decode is host-bound and
drifts over a run by more than the differences measured) of:

- ``base``: the model on the fmoe2 experts backend, no adapter;
- ``one_adapter``: one adapter for every sequence through fmoe2 (:mod:`fmoe2.integrations.peft`);
- ``mixed``: ``--adapters`` adapters mixed per sequence through fmoe2 (sequence ``b`` gets adapter
  ``b % adapters``);
- ``peft``: one adapter through PEFT's own path (``PeftModel``: ``W + dW`` rebuilt on every forward) on
  transformers' ``--peft-backend`` experts backend, on a second copy of the model (same weights).

Writes ``<out-dir>/peft/<device>.json`` and ``.md`` with the step-time ratios mixed / base and peft /
one_adapter.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch

from fmoe2.gemm.config import device_config_name
from fmoe2.gemm.lora import MAX_LORA_RANK, MAX_LORAS

from .model import MODELS, build_model, generate_times_in_turns
from .provenance import provenance_line, rewrite_report, run_record

TARGETS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
VARIANTS = ("base", "one_adapter", "mixed", "peft")


def make_adapters(model, count: int, rank: int):
    """``count`` random PEFT adapters of ``model``'s experts made by PEFT on ``model`` (which it wraps;
    ``init_lora_weights=False``: both factors random, not B = 0): the ``PeftModel`` with the first adapter
    active and each adapter's ``(state_dict, LoraConfig)``."""
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict

    config = LoraConfig(r=rank, lora_alpha=rank, target_modules=[], target_parameters=TARGETS,
                        init_lora_weights=False)
    names = [f"adapter{i}" for i in range(count)]
    torch.manual_seed(1)
    peft_model = get_peft_model(model, config, adapter_name=names[0])
    for name in names[1:]:
        peft_model.add_adapter(name, config)
    pairs = {name: (get_peft_model_state_dict(peft_model, adapter_name=name), peft_model.peft_config[name])
             for name in names}
    peft_model.set_adapter(names[0])
    return peft_model.eval(), pairs


def markdown(result: dict) -> str:
    lines = [f"# PEFT adapters of the experts at decode: {result['device']}", "",
             provenance_line(result), "",
             f"{result['model']} layer sizes, {result['layers']} layers, random bf16 weights; {result['adapters']} "
             f"random PEFT adapters of rank {result['rank']} on gate_up_proj and down_proj; prompt {result['prompt']}, "
             f"{result['new_tokens']} greedy tokens. Decode tokens/s. base: fmoe2 backend, no adapter; one adapter "
             "and mixed (one adapter per sequence, cycling): fmoe2 backend with fmoe2.integrations.peft; peft: "
             f"PeftModel (W + dW rebuilt every forward) on transformers' {result['peft_backend']} backend.", "",
             "| batch | base | one adapter | mixed | peft | mixed step / base step | peft step / one-adapter step |",
             "|---|---|---|---|---|---|---|"]
    by_batch = {}
    for row in result["rows"]:
        by_batch.setdefault(row["batch"], {})[row["variant"]] = row
    for batch, rows in sorted(by_batch.items()):
        rate = {v: rows[v].get("decode_tokens_per_s") for v in VARIANTS if v in rows}
        cells = [f"{rate[v]:.1f}" if rate.get(v) else rows.get(v, {}).get("error", "-")[:40] for v in VARIANTS]

        def ratio(slow, fast):
            return f"{rate[fast] / rate[slow]:.2f}x" if rate.get(slow) and rate.get(fast) else "-"

        lines.append(f"| {batch} | " + " | ".join(cells) + f" | {ratio('mixed', 'base')} | "
                     f"{ratio('peft', 'one_adapter')} |")
    return "\n".join(lines) + "\n"


def _runner(model, selection, loaded, input_ids):
    """``run(new_tokens)``: one greedy generate of ``model`` on ``input_ids`` under ``selection`` (fmoe2 adapters
    per sequence; None: no adapter, or PEFT's own active adapter)."""
    def run(new_tokens):
        with torch.no_grad():
            if selection is None:
                return model.generate(input_ids, max_new_tokens=new_tokens, do_sample=False)
            with loaded.use(selection):
                return model.generate(input_ids, max_new_tokens=new_tokens, do_sample=False)
    return run


def decode_row(times: dict, batch: int, new_tokens: int) -> dict:
    """A result row from :func:`~fmoe2.bench.model.generate_times_in_turns`' times of one variant: the median
    prefill and the decode rate as ``python -m fmoe2.bench.model`` computes it,
    ``batch * (new_tokens - 1) / (median generate - median prefill)``."""
    if "error" in times:
        return {"error": times["error"]}
    first, whole = statistics.median(times["prefill_s"]), statistics.median(times["total_s"])
    return dict(prefill_s=first, decode_tokens_per_s=batch * (new_tokens - 1) / max(whole - first, 1e-9),
                peak_bytes=times["peak_bytes"])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m fmoe2.bench.peft_decode", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default="qwen3-30b-a3b", choices=sorted(MODELS), help="layer sizes of this model")
    p.add_argument("--layers", type=int, default=4, help="decoder layers")
    p.add_argument("--batches", default="1,8,64", help="comma-separated batch sizes")
    p.add_argument("--adapters", type=int, default=4, help="adapters mixed per sequence")
    p.add_argument("--rank", type=int, default=16, help="rank of every adapter")
    p.add_argument("--peft-backend", default="grouped_mm", help="transformers experts backend under PeftModel")
    p.add_argument("--prompt", type=int, default=64, help="prompt tokens")
    p.add_argument("--new-tokens", type=int, default=64, help="greedy tokens generated")
    p.add_argument("--repeats", type=int, default=5, help="timed rounds per batch size (median)")
    p.add_argument("--out-dir", default=os.path.join("misc", "bench"), help="results go to <out-dir>/peft/")
    p.add_argument("--report", default=None, metavar="JSON", help="only rewrite the markdown of a result file")
    a = p.parse_args(argv)
    if a.report:
        rewrite_report(a.report, markdown)
        return 0
    if not 1 <= a.adapters <= MAX_LORAS or not 1 <= a.rank <= MAX_LORA_RANK:
        raise SystemExit(f"--adapters must be in 1..{MAX_LORAS} and --rank in 1..{MAX_LORA_RANK}")
    if not torch.cuda.is_available():
        raise SystemExit("the PEFT decode benchmark needs a CUDA or ROCm GPU")
    import fmoe2.integrations.transformers  # noqa: F401  (registers "fmoe2")
    from fmoe2.integrations.peft import load_adapters

    batches = [int(v) for v in a.batches.split(",")]
    result = {**run_record("python -m fmoe2.bench.peft_decode", argv), "model": a.model, "layers": a.layers,
              "adapters": a.adapters, "rank": a.rank, "peft_backend": a.peft_backend, "prompt": a.prompt,
              "new_tokens": a.new_tokens, "rows": []}
    path = os.path.join(a.out_dir, "peft", f"{device_config_name()}.json")
    os.makedirs(os.path.dirname(path), exist_ok=True)

    peft_model, pairs = make_adapters(build_model(a.model, a.layers), a.adapters, a.rank)
    peft_model.get_base_model().set_experts_implementation(a.peft_backend)
    model = build_model(a.model, a.layers)  # the same weights (same seed), served by fmoe2
    model.set_experts_implementation("fmoe2")  # (use() checks that the experts run on fmoe2)
    loaded = load_adapters(model, pairs)
    names = loaded.names
    for batch in batches:
        selections = {"base": None, "one_adapter": [names[0]] * batch,
                      "mixed": [names[b % len(names)] for b in range(batch)]}
        input_ids = torch.randint(0, model.config.vocab_size, (batch, a.prompt), device="cuda",
                                  generator=torch.Generator(device="cuda").manual_seed(batch))
        runners = {variant: _runner(model, selections[variant], loaded, input_ids) for variant in selections}
        runners["peft"] = _runner(peft_model, None, None, input_ids)
        for variant, times in generate_times_in_turns(runners, a.new_tokens, a.repeats).items():
            row = dict(variant=variant, batch=batch, **decode_row(times, batch, a.new_tokens))
            print(json.dumps(row), flush=True)
            result["rows"].append(row)
        with open(path, "w") as f:
            json.dump(result, f, indent=1)
    print(rewrite_report(path, markdown, result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
