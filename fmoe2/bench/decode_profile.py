"""Where transformers' compiled decode step (static cache) spends its time, per experts backend:
``python -m fmoe2.bench.decode_profile``.

    python -m fmoe2.bench.decode_profile [--model qwen3-30b-a3b] [--batch 1] [--backends fmoe2,batched_mm]

Builds the 4-layer model of ``fmoe2.bench.model`` (``--model``, default Qwen3-30B-A3B) and, for each backend at
``--batch`` sequences: runs a 9-token static-cache ``generate`` twice (transformers compiles the decode step), prints
Inductor's CUDA-graph counters (``cudagraph_skips`` counts graphs it did not capture), Dynamo's graph breaks and
recompiles, times one more ``generate``, then profiles another and prints the kernels by CUDA time and the total GPU
time.
"""
from __future__ import annotations

import argparse
import sys
import time

import torch
from torch._dynamo.utils import counters
from torch.profiler import ProfilerActivity, profile

from .model import MODELS, build_model
from .provenance import run_record


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m fmoe2.bench.decode_profile", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen3-30b-a3b", choices=sorted(MODELS))
    p.add_argument("--batch", type=int, default=1, help="sequences per generate")
    p.add_argument("--backends", default="fmoe2,batched_mm", help="experts backends, comma-separated")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("this profile needs a CUDA GPU")
    import fmoe2.integrations.transformers  # noqa: F401  (registers "fmoe2")

    print(run_record("python -m fmoe2.bench.decode_profile", argv))
    model = build_model(a.model, 4)
    ids = torch.randint(0, 1000, (a.batch, 64), device="cuda")
    for backend in a.backends.split(","):
        counters.clear()
        torch._dynamo.reset()
        model.set_experts_implementation(backend)
        with torch.no_grad():
            for _ in range(2):
                model.generate(ids, max_new_tokens=9, do_sample=False, cache_implementation="static")
            print(f"=== {a.model} batch {a.batch} {backend}: inductor cudagraph counters "
                  f"{ {k: v for k, v in counters['inductor'].items() if 'cudagraph' in k} }, graph breaks "
                  f"{dict(counters['graph_break'])}, recompiles {dict(counters['recompiles'])}, dynamo stats "
                  f"{dict(counters['stats'])}", flush=True)
            torch.cuda.synchronize()
            start = time.perf_counter()
            model.generate(ids, max_new_tokens=9, do_sample=False, cache_implementation="static")
            torch.cuda.synchronize()
            print(f"one 9-token generate (unprofiled): {1e3 * (time.perf_counter() - start):.1f} ms", flush=True)
            with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
                model.generate(ids, max_new_tokens=9, do_sample=False, cache_implementation="static")
                torch.cuda.synchronize()
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=60))
    return 0


if __name__ == "__main__":
    sys.exit(main())
