"""gpt-oss-20b experts at decode sizes: ``python -m fmoe2.bench.gpt_oss_layout``.

``fused_moe`` on transformers' layout read in place (``gate_up_proj [E, H, 2I]`` interleaved,
``down_proj [E, I, H]``, as transposed views, with biases and the clamped swiglu_oai) against the
same weights prepared once (``prepare_weights``): CUDA-graph time per call, median of interleaved
rounds, and the two results' relative difference.
"""
from __future__ import annotations

import math
import sys

import torch

import fmoe2
from fmoe2.shapes import ALL_SHAPES

from .provenance import run_record
from .timing import time_interleaved


def main(argv=None) -> int:
    if not torch.cuda.is_available():
        raise SystemExit("this benchmark needs a CUDA or ROCm GPU")
    E, H, I, k = ALL_SHAPES["gpt-oss-20b"]
    g = torch.Generator(device="cuda").manual_seed(0)
    gate_up = torch.randn(E, H, 2 * I, device="cuda", dtype=torch.bfloat16, generator=g) / math.sqrt(H)
    down = torch.randn(E, I, H, device="cuda", dtype=torch.bfloat16, generator=g) / math.sqrt(I)
    b1 = torch.randn(E, 2 * I, device="cuda", dtype=torch.bfloat16, generator=g) * 0.1
    b2 = torch.randn(E, H, device="cuda", dtype=torch.bfloat16, generator=g) * 0.1
    act = dict(activation="swiglu_oai", swiglu_limit=7.0)
    w1, w2 = gate_up.transpose(1, 2), down.transpose(1, 2)
    prepared = fmoe2.prepare_weights(w1, w2, w1_bias=b1, w2_bias=b2, gate_up_interleaved=True)
    print(run_record("python -m fmoe2.bench.gpt_oss_layout", argv))
    for M in (1, 8, 64, 256):
        x = torch.randn(M, H, device="cuda", dtype=torch.bfloat16, generator=g)
        tw, ti = torch.topk(torch.randn(M, E, device="cuda", generator=g).softmax(-1), k)
        in_place = fmoe2.fused_moe(x, w1, w2, tw, ti, w1_bias=b1, w2_bias=b2, gate_up_interleaved=True, **act)
        once = fmoe2.fused_moe(x, prepared, None, tw, ti, **act)
        diff = ((in_place.float() - once.float()).norm() / once.float().norm()).item()
        t = time_interleaved({"in_place": lambda: fmoe2.fused_moe(x, w1, w2, tw, ti, w1_bias=b1, w2_bias=b2,
                                                                   gate_up_interleaved=True, **act),
                              "prepared": lambda: fmoe2.fused_moe(x, prepared, None, tw, ti, **act)}, rounds=3)
        path = fmoe2.get_config(M, E, H, I, k, torch.bfloat16).path
        print(f"M={M:4d} path={path:9s} in_place {t['in_place']:8.1f} us  prepared {t['prepared']:8.1f} us  "
              f"ratio {t['in_place'] / t['prepared']:.2f}  diff {diff:.1e}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
