"""Tuner: ``python -m fmoe2.tune`` searches fused-kernel configs for one shape on this GPU.

    python -m fmoe2.tune --shape mixtral-8x7b|E,H,I,topk [--m 1,16,128,1024,4096] [--dtype bf16] [--deterministic]

Writes ``fmoe2/gemm/configs/<device>/E=..,H=..,I=..,topk=..,dtype=...json`` (batch size -> best
config), which :func:`fmoe2.get_config` then picks by nearest batch size. Runs unchanged on ROCm.
``--deterministic`` tunes deterministic mode instead (``fused_moe(..., deterministic=True)``: two-stage
configs without K shares) into the file's ``"deterministic"`` entry, which it reads on GPUs whose tilings
were measured alike (``deterministic_config``).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys

import torch

import fmoe2
from fmoe2.bench.__main__ import make_inputs
from fmoe2.bench.search import deterministic_candidates, search_fmoe2
from fmoe2.gemm.config import CONFIG_DIR, device_config_name, shape_file_name
from fmoe2.shapes import SHAPES

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def _by_batch(entries: dict) -> dict:
    """``entries`` with its batch-size keys in increasing order, other keys after them."""
    return dict(sorted(entries.items(), key=lambda kv: (not kv[0].isdigit(), int(kv[0]) if kv[0].isdigit() else 0)))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m fmoe2.tune", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--shape", required=True, help=f"one of {sorted(SHAPES)} or E,H,I,topk")
    p.add_argument("--m", default="1,16,128,1024,4096", help="comma-separated batch sizes to tune")
    p.add_argument("--dtype", default="bf16", choices=sorted(DTYPES), help="input and weight dtype")
    p.add_argument("--config-dir", default=CONFIG_DIR,
                   help="where the tuned file <device>/E=..,H=..,I=..,topk=..,dtype=...json is written")
    p.add_argument("--deterministic", action="store_true", help="tune deterministic mode (its own entry)")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        p.error("tuning needs a CUDA or ROCm GPU")
    E, H, I, topk = SHAPES[a.shape] if a.shape in SHAPES else tuple(int(v) for v in a.shape.split(","))
    dtype = DTYPES[a.dtype]
    gen = torch.Generator(device="cuda").manual_seed(0)
    w1 = (torch.randn(E, 2 * I, H, device="cuda", generator=gen) / math.sqrt(H)).to(dtype)
    w2 = (torch.randn(E, H, I, device="cuda", generator=gen) / math.sqrt(I)).to(dtype)
    prepared = fmoe2.prepare_weights(w1, w2)
    path = os.path.join(a.config_dir, device_config_name(), shape_file_name(E, H, I, topk, dtype))
    tuned = {}
    if os.path.exists(path):
        with open(path) as f:
            tuned = json.load(f)
    entries = tuned.setdefault("deterministic", {}) if a.deterministic else tuned
    for M in (int(m) for m in a.m.split(",")):
        x, tw, ti = make_inputs(M, E, H, I, topk, gen)
        x, out = x.to(dtype), torch.empty(M, H, device="cuda", dtype=dtype)
        candidates = deterministic_candidates(M, E, H, I, topk, dtype) if a.deterministic else None
        best, us, _ = search_fmoe2(M, E, H, I, topk, dtype,
                                   lambda cfg: lambda: fmoe2.fused_moe(x, prepared, None, tw, ti, out=out, config=cfg,
                                                                       deterministic=a.deterministic),
                                   f"M={M}", candidates)
        entries[str(M)] = best.to_dict()
        print(f"M={M}: {us:.1f} us with {best.to_dict()}", flush=True)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        if "deterministic" in tuned:
            tuned["deterministic"] = _by_batch(tuned["deterministic"])
        json.dump(_by_batch(tuned), f, indent=1)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
