"""gpt-oss decoding from an mxfp4 checkpoint: ``python -m fmoe2.bench.gpt_oss_mxfp4``.

A few layers of gpt-oss at a real size (``--model gpt-oss-20b`` or ``gpt-oss-120b``), random weights, saved as the
published mxfp4 checkpoints are (:func:`fmoe2.integrations.gpt_oss_mxfp4.save_mxfp4_checkpoint`, under
``--work-dir``), then loaded twice: with the experts kept in 4 bits on fmoe2
(:func:`~fmoe2.integrations.gpt_oss_mxfp4.load_gpt_oss_mxfp4`), and by transformers alone (without the ``kernels``
package it dequantizes them to bf16), run with the ``fmoe2`` and ``grouped_mm`` experts backends. Per batch size:
greedy ``generate`` tokens/s, the runs taking turns (``fmoe2.bench.model.generate_times_in_turns``), the GPU memory
each model holds, the experts' bits per value, and the 4-bit model's logits against the dequantized model's (the
same values in bf16). Writes ``<out-dir>/gpt_oss_mxfp4/<device>__<model>.json`` and ``.md``.
"""
from __future__ import annotations

import argparse
import os
import statistics
import tempfile

import torch

from fmoe2.gemm.config import device_config_name

from .model import build_model, generate_times_in_turns
from .provenance import provenance_line, run_record, write_result


def markdown(result: dict) -> str:
    lines = [f"# gpt-oss from an mxfp4 checkpoint: {result['device']}, {result['model']} sizes, "
             f"{result['layers']} layers", "", provenance_line(result), "",
             f"Experts: {result['experts_bits_per_value']:.3f} bits per value in 4 bits; GPU memory held by each model "
             f"after loading: mxfp4 {result['model_bytes']['mxfp4'] / 2**30:.2f} GiB, dequantized bf16 "
             f"{result['model_bytes']['bf16'] / 2**30:.2f} GiB. Logits of the mxfp4 model (fmoe2) against the "
             f"dequantized model (eager experts), relative error: {result['logits_rel_err']:.2e} "
             f"(the dequantized model on fmoe2's bf16 path: {result['logits_rel_err_bf16_fmoe2']:.2e}).", "",
             f"Decode tokens/s (prompt {result['prompt']}, {result['new_tokens']} greedy tokens, median of "
             f"{result['rounds']} rounds, the runs taking turns):", "",
             "| batch | " + " | ".join(result["runs"]) + " | mxfp4 / best bf16 |", "|---|" + "---|" * (len(result["runs"]) + 1)]
    for row in result["rows"]:
        rates = [row["tokens_per_s"].get(r) for r in result["runs"]]
        bf16 = [row["tokens_per_s"].get(r) for r in result["runs"] if r.startswith("bf16") and row["tokens_per_s"].get(r)]
        ratio = (f"{row['tokens_per_s']['mxfp4 fmoe2'] / max(bf16):.2f}x"
                 if bf16 and row["tokens_per_s"].get("mxfp4 fmoe2") else "-")
        lines.append(f"| {row['batch']} | " + " | ".join(f"{r:.1f}" if r else "error" for r in rates) + f" | {ratio} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m fmoe2.bench.gpt_oss_mxfp4", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default="gpt-oss-120b", choices=["gpt-oss-20b", "gpt-oss-120b"])
    p.add_argument("--layers", type=int, default=4, help="decoder layers")
    p.add_argument("--prompt", type=int, default=64, help="prompt tokens")
    p.add_argument("--new-tokens", type=int, default=32, help="greedy tokens after the first")
    p.add_argument("--batches", default="1,8,64", help="comma-separated sequences per generate")
    p.add_argument("--rounds", type=int, default=3, help="rounds (one generate of each run per round)")
    p.add_argument("--work-dir", default=None, help="where the checkpoint is written (default: a temporary folder)")
    p.add_argument("--out-dir", default=os.path.join("misc", "bench"), help="results go to <out-dir>/gpt_oss_mxfp4/")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("the gpt-oss mxfp4 benchmark needs a CUDA or ROCm GPU")
    import transformers

    import fmoe2.integrations.transformers  # noqa: F401  (registers "fmoe2")
    from fmoe2.integrations.gpt_oss_mxfp4 import experts_bytes, load_gpt_oss_mxfp4, save_mxfp4_checkpoint

    batches = [int(b) for b in a.batches.split(",")]
    scratch = tempfile.TemporaryDirectory(prefix="gpt_oss_mxfp4_") if a.work_dir is None else None
    work = a.work_dir or scratch.name  # (a temporary checkpoint goes when the run ends)
    source = build_model(a.model, a.layers)
    save_mxfp4_checkpoint(source, work)
    del source
    torch.cuda.empty_cache()
    held = {}
    before = torch.cuda.memory_allocated()
    mxfp4 = load_gpt_oss_mxfp4(work, device="cuda")
    held["mxfp4"] = torch.cuda.memory_allocated() - before
    before = torch.cuda.memory_allocated()
    # (dequantized to bf16 even where the kernels package would keep 4 bits; device_map needs accelerate)
    placement = dict(device_map="cuda") if transformers.utils.is_accelerate_available() else {}
    bf16 = transformers.AutoModelForCausalLM.from_pretrained(
        work, dtype=torch.bfloat16, quantization_config=transformers.Mxfp4Config(dequantize=True),
        **placement).cuda().eval()
    held["bf16"] = torch.cuda.memory_allocated() - before
    for model in (mxfp4, bf16):
        model.generation_config.eos_token_id = None  # always generate the requested tokens
        model.generation_config.pad_token_id = 0
    total, values = experts_bytes(mxfp4)
    gen = torch.Generator(device="cuda").manual_seed(1)
    ids = torch.randint(0, mxfp4.config.vocab_size, (2, a.prompt), device="cuda", generator=gen)
    with torch.no_grad():
        bf16.set_experts_implementation("eager")
        want = bf16(ids).logits.float()
        got = mxfp4(ids).logits.float()
        bf16.set_experts_implementation("fmoe2")
        bf16_fmoe2 = bf16(ids).logits.float()
    result = {**run_record("python -m fmoe2.bench.gpt_oss_mxfp4", argv), "transformers": transformers.__version__,
              "model": a.model, "layers": a.layers, "prompt": a.prompt, "new_tokens": a.new_tokens,
              "rounds": a.rounds, "experts_bits_per_value": 8 * total / values, "model_bytes": held,
              "logits_rel_err": ((got - want).norm() / want.norm()).item(),
              "logits_rel_err_bf16_fmoe2": ((bf16_fmoe2 - want).norm() / want.norm()).item(),
              "runs": ["mxfp4 fmoe2", "bf16 fmoe2", "bf16 grouped_mm"], "rows": []}
    print(f"experts {result['experts_bits_per_value']:.3f} bits/value; held {held}; logits error "
          f"{result['logits_rel_err']:.2e}", flush=True)
    for batch in batches:
        prompt = torch.randint(0, mxfp4.config.vocab_size, (batch, a.prompt), device="cuda", generator=gen)

        def run(model, backend):
            def generate(tokens: int):
                model.set_experts_implementation(backend)
                with torch.no_grad():
                    return model.generate(prompt, max_new_tokens=tokens, do_sample=False)
            return generate

        times = generate_times_in_turns({"mxfp4 fmoe2": run(mxfp4, "fmoe2"), "bf16 fmoe2": run(bf16, "fmoe2"),
                                         "bf16 grouped_mm": run(bf16, "grouped_mm")}, a.new_tokens, a.rounds)
        rates = {}
        for name, t in times.items():
            if "error" in t:
                rates[name] = None
                continue
            decode = [total_s - prefill_s for total_s, prefill_s in zip(t["total_s"], t["prefill_s"])]
            rates[name] = batch * (a.new_tokens - 1) / max(statistics.median(decode), 1e-9)
        result["rows"].append(dict(batch=batch, tokens_per_s=rates, errors={n: t["error"] for n, t in times.items()
                                                                            if "error" in t}))
        print(f"batch {batch}: " + ", ".join(f"{n} {r:.1f}" if r else f"{n} error" for n, r in rates.items()),
              flush=True)
    out = os.path.join(a.out_dir, "gpt_oss_mxfp4", f"{device_config_name()}__{a.model}.json")
    print(write_result(out, result, markdown))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
