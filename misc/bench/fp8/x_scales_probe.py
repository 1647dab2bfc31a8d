"""Per-token vs per-group x at small M, fp8 per channel: each launch of one forward alone (CUDA graphs) and the
whole forward, both settings in turns. Usage: PYTHONPATH=. python misc/bench/fp8/x_scales_probe.py qwen3-30b-a3b
16,128 (output of 2026-11-30: x_scales_probe_2026-11-30.txt; docs/fp8.md, per-token activations)."""
import math
import sys

import torch

import fmoe2
from fmoe2.bench.fp8 import _with_x_scales
from fmoe2.bench.timing import time_graphs_in_turns
from fmoe2.gemm.fused_moe import forward_launches, plan_of
from fmoe2.shapes import ALL_SHAPES

name = sys.argv[1]
E, H, I, topk = ALL_SHAPES[name]
gen = torch.Generator(device="cuda").manual_seed(0)
w1 = torch.randn(E, 2 * I, H, device="cuda", dtype=torch.bfloat16, generator=gen) / math.sqrt(H)
w2 = torch.randn(E, H, I, device="cuda", dtype=torch.bfloat16, generator=gen) / math.sqrt(I)
q1, s1 = fmoe2.quantize_fp8_weights(w1, "channel")
q2, s2 = fmoe2.quantize_fp8_weights(w2, "channel")
prepared = fmoe2.prepare_weights(q1, q2, w1_scale=s1, w2_scale=s2)
for M in [int(m) for m in sys.argv[2].split(",")]:
    x = torch.randn(M, H, device="cuda", dtype=torch.bfloat16, generator=gen)
    tw, ti = torch.topk(torch.randn(M, E, device="cuda", generator=gen).softmax(-1), topk, dim=-1)
    ti = ti.to(torch.int32)
    out = torch.empty_like(x)
    fns = {}
    for per_token in (True, False):
        tag = "tok" if per_token else "grp"
        _with_x_scales(per_token, lambda: fmoe2.fused_moe(x, prepared, None, tw, ti, out=out))
        plan = _with_x_scales(per_token, lambda: plan_of(x, prepared, None, tw, ti, out=out))
        print(M, tag, plan.config.path, plan.launch_names, {e[0]: e[2] for e in plan.layout.entries if "scale" in e[0]},
              flush=True)
        fns[f"{tag} forward"] = (lambda pt=per_token: _with_x_scales(
            pt, lambda: fmoe2.fused_moe(x, prepared, None, tw, ti, out=out)))
        for lname, run in _with_x_scales(per_token, lambda: forward_launches(x, prepared, None, tw, ti, out=out)):
            run()
            fns[f"{tag} {lname}"] = run
    t = time_graphs_in_turns(fns, 3, 10, 20)
    for k, v in t.items():
        print(f"  M={M:5d} {k:28s} {v:8.2f} us", flush=True)
