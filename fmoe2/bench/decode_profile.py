"""Where transformers' compiled decode step (static cache) spends its time, per experts backend:
``python -m fmoe2.bench.decode_profile``.

Builds the 4-layer Qwen3-30B-A3B model of ``fmoe2.bench.model`` and, for fmoe2 and batched_mm at batch 1:
runs a 9-token static-cache ``generate`` twice (transformers compiles the decode step), prints
Inductor's CUDA-graph counters (``cudagraph_skips`` counts graphs it did not capture), then profiles
one more ``generate`` and prints the kernels by CUDA time and the total GPU time.
"""
from __future__ import annotations

import sys

import torch
from torch._dynamo.utils import counters
from torch.profiler import ProfilerActivity, profile

from .model import build_model
from .provenance import run_record


def main(argv=None) -> int:
    if not torch.cuda.is_available():
        raise SystemExit("this profile needs a CUDA GPU")
    import fmoe2.integrations.transformers  # noqa: F401  (registers "fmoe2")

    print(run_record("python -m fmoe2.bench.decode_profile", argv))
    model = build_model("qwen3-30b-a3b", 4)
    ids = torch.randint(0, 1000, (1, 64), device="cuda")
    for backend in ("fmoe2", "batched_mm"):
        counters.clear()
        torch._dynamo.reset()
        model.set_experts_implementation(backend)
        with torch.no_grad():
            for _ in range(2):
                model.generate(ids, max_new_tokens=9, do_sample=False, cache_implementation="static")
            print(f"=== {backend}: inductor cudagraph counters "
                  f"{ {k: v for k, v in counters['inductor'].items() if 'cudagraph' in k} }", flush=True)
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
                model.generate(ids, max_new_tokens=9, do_sample=False, cache_implementation="static")
                torch.cuda.synchronize()
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=60))
    return 0


if __name__ == "__main__":
    sys.exit(main())
