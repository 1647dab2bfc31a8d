"""Tuner: ``python -m fmoe2.tune`` searches fused-kernel configs for one shape on this GPU.

    python -m fmoe2.tune --shape mixtral-8x7b|E,H,I,topk [--m 1,16,128,1024,4096] [--dtype bf16|fp16|fp8]
                         [--deterministic]

Writes ``fmoe2/gemm/configs/<device>/E=..,H=..,I=..,topk=..,dtype=...json`` (batch size -> best
config), which :func:`fmoe2.get_config` then picks by nearest batch size. Runs unchanged on ROCm.
``--deterministic`` tunes deterministic mode instead (``fused_moe(..., deterministic=True)``: two-stage
configs without K shares) into the file's ``"deterministic"`` entry, which it reads on GPUs whose tilings
were measured alike (``fmoe2.gemm.config.resolve_config``). ``--dtype fp8`` tunes fp8 weights (block scales, bf16
activations) into the bf16 file's ``"fp8"`` entry (``resolve_config`` reads it): each candidate as an fp8 forward runs
it (fitted to fp8), duplicates timed once.
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
from fmoe2.bench.search import deterministic_candidates, fmoe2_candidates, search_fmoe2
from fmoe2.gemm.config import CONFIG_DIR, ConfigMode, ConfigProblem, device_config_name, resolve_config, shape_file_name
from fmoe2.shapes import ALL_SHAPES
from fmoe2.target import target_of

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.bfloat16}  # fp8: the activations' dtype
SECTIONS = ("deterministic", "fp8")  # entries of a tuned file besides the plain batch sizes


def fp8_candidates(M: int, E: int, H: int, I: int, topk: int, run) -> list:
    """:func:`~fmoe2.bench.search.fmoe2_candidates` as fp8 forwards run them: ``run(cfg)`` makes one forward
    with ``config=cfg`` and returns the config its plan holds (the fitted one). Duplicates removed, and
    candidates that fail to run (e.g. past the GPU's shared memory) left out."""
    seen, out = set(), []
    for cfg in fmoe2_candidates(M, E, H, I, topk, torch.bfloat16):
        try:
            fitted = run(cfg)
        except Exception as error:  # noqa: BLE001 - a candidate that cannot run is not a result
            print(f"  skipped {cfg.to_dict()}: {type(error).__name__}: {str(error)[:200]}", flush=True)
            continue
        if fitted not in seen:
            seen.add(fitted)
            out.append(fitted)
    return out


def _by_batch(entries: dict) -> dict:
    """``entries`` with its batch-size keys in increasing order, other keys after them."""
    return dict(sorted(entries.items(), key=lambda kv: (not kv[0].isdigit(), int(kv[0]) if kv[0].isdigit() else 0)))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m fmoe2.tune", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--shape", required=True, help=f"one of {sorted(ALL_SHAPES)} or E,H,I,topk")
    p.add_argument("--m", default="1,16,128,1024,4096", help="comma-separated batch sizes to tune")
    p.add_argument("--dtype", default="bf16", choices=sorted(DTYPES),
                   help="input and weight dtype (fp8: e4m3 weights with 128 x 128 block scales, bf16 inputs)")
    p.add_argument("--config-dir", default=CONFIG_DIR,
                   help="where the tuned file <device>/E=..,H=..,I=..,topk=..,dtype=...json is written")
    p.add_argument("--deterministic", action="store_true", help="tune deterministic mode (its own entry)")
    a = p.parse_args(argv)
    if a.deterministic and a.dtype == "fp8":
        p.error("--deterministic tunes 16-bit weights (fp8 weights take one fixed tiling in that mode)")
    if not torch.cuda.is_available():
        p.error("tuning needs a CUDA or ROCm GPU")
    E, H, I, topk = ALL_SHAPES[a.shape] if a.shape in ALL_SHAPES else tuple(int(v) for v in a.shape.split(","))
    dtype = DTYPES[a.dtype]
    gen = torch.Generator(device="cuda").manual_seed(0)
    w1 = (torch.randn(E, 2 * I, H, device="cuda", generator=gen) / math.sqrt(H)).to(dtype)
    w2 = (torch.randn(E, H, I, device="cuda", generator=gen) / math.sqrt(I)).to(dtype)
    if a.dtype == "fp8":
        (q1, s1), (q2, s2) = fmoe2.quantize_fp8_weights(w1, "block"), fmoe2.quantize_fp8_weights(w2, "block")
        prepared = fmoe2.prepare_weights(q1, q2, w1_scale=s1, w2_scale=s2, block_shape=(128, 128))
    else:
        prepared = fmoe2.prepare_weights(w1, w2)
    path = os.path.join(a.config_dir, device_config_name(), shape_file_name(E, H, I, topk, dtype))
    tuned = {}
    if os.path.exists(path):
        with open(path) as f:
            tuned = json.load(f)
    section = "deterministic" if a.deterministic else "fp8" if a.dtype == "fp8" else None
    entries = tuned.setdefault(section, {}) if section else tuned
    for M in (int(m) for m in a.m.split(",")):
        x, tw, ti = make_inputs(M, E, H, I, topk, gen)
        x, out = x.to(dtype), torch.empty(M, H, device="cuda", dtype=dtype)
        candidates = deterministic_candidates(M, E, H, I, topk, dtype) if a.deterministic else None
        if a.dtype == "fp8":
            def fitted(cfg, x=x, tw=tw, ti=ti):
                fmoe2.fused_moe(x, prepared, None, tw, ti, config=cfg)  # (raises for a candidate that cannot run)
                # The config that forward ran, from the resolver the forward asks.
                return resolve_config(ConfigProblem(M, E, H, I, topk, dtype), ConfigMode(fp8=True), target_of(), cfg)
            candidates = fp8_candidates(M, E, H, I, topk, fitted)
        best, us, _ = search_fmoe2(M, E, H, I, topk, dtype,
                                   lambda cfg: lambda: fmoe2.fused_moe(x, prepared, None, tw, ti, out=out, config=cfg,
                                                                       deterministic=a.deterministic),
                                   f"M={M}", candidates)
        if a.dtype == "fp8":
            best = fitted(best)  # (a tensor-descriptor twin runs with pointer loads: stored as it ran)
        entries[str(M)] = best.to_dict()
        print(f"M={M}: {us:.1f} us with {best.to_dict()}", flush=True)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        for name in SECTIONS:
            if name in tuned:
                tuned[name] = _by_batch(tuned[name])
        json.dump(_by_batch(tuned), f, indent=1)
        f.write("\n")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
