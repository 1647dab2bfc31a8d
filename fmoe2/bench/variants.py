"""Variants benchmark: ``python -m fmoe2.bench.variants`` — fmoe2's picked config against its opt-in
variants, in one run, bf16:

* ``tma``: weight tiles through tensor descriptors; ``pdl``: programmatic dependent launch; both;
* at decode sizes (at most 16 routed rows per expert) the narrow-slice two-stage configs that the
  search also tries (``fmoe2/bench/search.py``).

    python -m fmoe2.bench.variants [--shapes mixtral-8x7b,...] [--m 1,16,128,1024,4096] [--out-dir misc/bench]

Same data and timing as ``python -m fmoe2.bench`` (fresh random bf16 data, softmax+top-k routing,
10 calls per CUDA graph, median of CUDA-event-timed replays); every variant is checked against the
float32 reference before it is timed. Writes ``<out-dir>/variants/<device>__<shape>.json`` and
regenerates ``<out-dir>/variants/<device>.md`` from every such file of the device.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import glob
import json
import math
import os
import shlex
import sys

import torch
import triton

import fmoe2
from fmoe2.gemm.config import device_config_name
from fmoe2.shapes import SHAPES

from .problems import BF16_TOL, make_inputs, rel_err
from .search import fmoe2_candidates
from .timing import time_in_graph


def variants_of(picked: fmoe2.FusedMoEConfig, M: int, E: int, H: int, I: int, topk: int) -> dict:
    """label -> config: the picked config, its tma/pdl variants and, at decode sizes, the search's
    narrow-slice two-stage configs."""
    out = {"picked": picked, "tma": dataclasses.replace(picked, tma=True),
           "pdl": dataclasses.replace(picked, pdl=True), "tma+pdl": dataclasses.replace(picked, tma=True, pdl=True)}
    if M * topk / E <= 16:
        for cfg in fmoe2_candidates(M, E, H, I, topk, torch.bfloat16):
            if cfg.path == "two_stage":
                out[f"two_stage N{cfg.BLOCK_N}x{cfg.num_stages}/S2N{cfg.S2_BLOCK_N}x{cfg.s2_num_stages}"
                    f"w{cfg.s2_num_warps}/K{cfg.S2_SPLIT_K}"] = cfg
    return out


def _markdown(runs: list) -> str:
    """One table over the runs (each a shape's JSON: metadata and ``results``)."""
    lines = [f"# fmoe2 opt-in variants on {runs[0]['device']}", "", "- runs (shape: date, versions, command):"]
    lines += [f"  - {run['results'][0]['shape'] if run['results'] else '-'}: {run['date']}, torch {run['torch']}, "
              f"Triton {run['triton']}, `{run['command']}`" for run in runs]
    lines += ["- bf16, 10 calls per CUDA graph, CUDA events, median of 50 replays; ratio = variant / picked, "
              "same run (below 1: faster); picked = `fmoe2.get_config` on this device at the time of the run", "",
              "| shape | M | variant | us | ratio | rel. err |", "|---|---|---|---|---|---|"]
    for r in (r for run in runs for r in run["results"]):
        us = f"{r['us']:.1f}" if r.get("us") else "-"
        ratio = f"{r['ratio']:.3f}" if r.get("ratio") else "-"
        err = f"{r['rel_err']:.1e}" if r.get("rel_err") is not None else r.get("error", "-")[:60]
        lines.append(f"| {r['shape']} | {r['M']} | {r['variant']} | {us} | {ratio} | {err} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m fmoe2.bench.variants", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--m", default="1,16,128,1024,4096")
    p.add_argument("--out-dir", default=os.path.join("misc", "bench"))
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        p.error("the benchmark needs a CUDA or ROCm GPU")
    gen = torch.Generator(device="cuda").manual_seed(a.seed)
    meta = dict(device=torch.cuda.get_device_name(),
                date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                torch=torch.__version__, triton=triton.__version__,
                command="python -m fmoe2.bench.variants " + " ".join(shlex.quote(v) for v in (argv or sys.argv[1:])))
    rows = []
    for name in a.shapes.split(","):
        E, H, I, topk = SHAPES[name]
        w1 = torch.randn(E, 2 * I, H, device="cuda", dtype=torch.bfloat16, generator=gen) / math.sqrt(H)
        w2 = torch.randn(E, H, I, device="cuda", dtype=torch.bfloat16, generator=gen) / math.sqrt(I)
        prepared = fmoe2.prepare_weights(w1, w2)
        for M in (int(m) for m in a.m.split(",")):
            x, tw, ti = make_inputs(M, E, H, I, topk, gen)
            out = torch.empty_like(x)
            ref = fmoe2.fused_moe_reference(x.float(), w1.float(), w2.float(), tw, ti)
            picked_us = None
            for label, cfg in variants_of(fmoe2.get_config(M, E, H, I, topk, torch.bfloat16), M, E, H, I, topk).items():
                row = dict(shape=name, M=M, variant=label, config=cfg.to_dict())
                try:
                    row["rel_err"] = rel_err(fmoe2.fused_moe(x, prepared, None, tw, ti, config=cfg), ref)
                    if not row["rel_err"] <= BF16_TOL:
                        raise RuntimeError(f"result off: relative error {row['rel_err']:.2e}")
                    row["us"] = time_in_graph(lambda: fmoe2.fused_moe(x, prepared, None, tw, ti, out=out, config=cfg))
                    picked_us = picked_us or row["us"]
                    row["ratio"] = row["us"] / picked_us
                except Exception as exc:  # noqa: BLE001 - a variant that fails is reported, the run goes on
                    row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
                rows.append(row)
                print(f"{name:17s} M={M:5d} {label:24s} " + (f"{row['us']:9.1f} us  x{row['ratio']:.3f}  "
                      f"err {row['rel_err']:.1e}" if "us" in row else row["error"]), flush=True)
    out_dir = os.path.join(a.out_dir, "variants")
    os.makedirs(out_dir, exist_ok=True)
    base = os.path.join(out_dir, device_config_name())
    for name in a.shapes.split(","):
        with open(f"{base}__{name}.json", "w") as f:
            json.dump({**meta, "results": [r for r in rows if r["shape"] == name]}, f, indent=1)
    print(write_variants_report(out_dir, device_config_name()))
    return 0


def write_variants_report(out_dir: str, device: str) -> str:
    """``<out_dir>/<device>.md`` from every ``<out_dir>/<device>__*.json``."""
    runs = []
    for path in sorted(glob.glob(os.path.join(out_dir, f"{device}__*.json"))):
        with open(path) as f:
            runs.append(json.load(f))
    md_path = os.path.join(out_dir, f"{device}.md")
    with open(md_path, "w") as f:
        f.write(_markdown(runs))
    return f"wrote {md_path}"


if __name__ == "__main__":
    sys.exit(main())
