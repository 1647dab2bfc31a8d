"""Sweep of the sorting kernel's programs per expert and warps.

    python -m fmoe2.bench.sort_settings [--out-dir misc/bench/sort]

The measurements behind ``sort_programs`` (``fmoe2/sorting/moe_sorting.py``), on this GPU: the
sort with the zeroing of a bf16 ``[M, H]`` output, ``moe_sorting``'s launch alone (preallocated
buffers, 64-row tiles), softmax + top-k routing of random logits, at 1, 2, 3, 4 and 6 programs
per expert x 4 and 8 warps and at the shipped choice (``auto``), the variants taking turns over 5
rounds (``time_interleaved``). Points: the benchmark shapes and three more expert counts (E=32
top-4, E=160 top-6, E=256 top-8) at M=1024 and 4096, Qwen3-30B-A3B also at M=128 and 8192.

Every variant's buffers must equal the ``auto`` variant's bit for bit, and the ``auto`` variant
must hold the routing of ``moe_sorting_reference``. Writes ``<out-dir>/settings_<device>.json``.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

from fmoe2.gemm.config import device_config_name
from fmoe2.reference import moe_sorting_reference
from fmoe2.shapes import SHAPES
from fmoe2.sorting import MoESortingResult, launch_moe_sorting
from fmoe2.multiprocessors import num_multiprocessors
from fmoe2.sorting.moe_sorting import sort_programs

from .provenance import run_record
from .timing import time_interleaved

ROUNDS = 5
BLOCK_M = 64
PARTS = (1, 2, 3, 4, 6)
WARPS = (4, 8)
# name: (E, H, topk), batch sizes
POINTS = {
    **{name: ((E, H, topk), (1024, 4096)) for name, (E, H, _, topk) in SHAPES.items()},
    "E=32,top-4": ((32, 2048, 4), (1024, 4096)),
    "E=160,top-6": ((160, 5120, 6), (1024, 4096)),
    "E=256,top-8": ((256, 7168, 8), (1024, 4096)),
}
POINTS["qwen3-30b-a3b"] = (POINTS["qwen3-30b-a3b"][0], (128, 1024, 4096, 8192))
BUFFERS = ("sorted_token_ids", "sorted_weights", "sorted_expert_ids", "num_tokens_post_padded", "num_sorted_tiles")


def check_against_reference(result: MoESortingResult, topk_ids, topk_weights, E: int) -> None:
    """Per expert, the tiles hold exactly the reference's (token, weight) entries, in token order."""
    expected, total = moe_sorting_reference(topk_ids, topk_weights, E, BLOCK_M)
    if result.num_tokens_post_padded.item() != total:
        raise SystemExit(f"rows in use {result.num_tokens_post_padded.item()}, reference {total}")
    ids = result.sorted_token_ids[:total].view(-1, BLOCK_M).cpu()
    weights = result.sorted_weights[:total].view(-1, BLOCK_M).cpu()
    tiles = result.sorted_expert_ids[:total // BLOCK_M].cpu()
    for e in range(E):
        rows = ids[tiles == e].flatten()
        kept = rows < topk_ids.shape[0]
        got = list(zip(rows[kept].tolist(), weights[tiles == e].flatten()[kept].tolist()))
        if got != expected[e]:
            raise SystemExit(f"expert {e}: tiles differ from the reference")


def sweep_point(E: int, H: int, topk: int, M: int, gen) -> dict:
    """Times every variant at one point after checking its buffers; returns the shipped choice
    (``auto``: parts and warps) and each variant's median microseconds (``times_us``)."""
    logits = torch.randn(M, E, device="cuda", generator=gen)
    topk_weights, topk_ids = torch.topk(logits.softmax(dim=-1), topk, dim=-1)
    topk_ids = topk_ids.to(torch.int32)
    out = torch.randn(M, H, device="cuda", dtype=torch.bfloat16, generator=gen)
    variants = {"auto": (None, None)}
    variants.update({f"p{parts}w{warps}": (parts, warps) for parts in PARTS for warps in WARPS})
    fns, results = {}, {}
    for name, (parts, warps) in variants.items():
        result = MoESortingResult.allocate(M * topk, E, BLOCK_M, M, "cuda")

        def launch(result=result, parts=parts, warps=warps):
            launch_moe_sorting(topk_ids, topk_weights, E, None, result, out, num_parts=parts, num_warps=warps)

        launch()
        fns[name], results[name] = launch, result
    for name, result in results.items():
        for buf in BUFFERS:
            if not torch.equal(getattr(result, buf), getattr(results["auto"], buf)):
                raise SystemExit(f"E={E} M={M} {name}: {buf} differs from the shipped choice's")
    check_against_reference(results["auto"], topk_ids, topk_weights, E)
    out.fill_(1.0)
    fns["auto"]()
    if not bool((out == 0).all()):
        raise SystemExit(f"E={E} M={M}: output not zeroed")
    auto_parts, auto_warps = sort_programs(E, M * topk, num_multiprocessors(topk_ids.device))
    return dict(auto=dict(parts=auto_parts, warps=auto_warps), times_us=time_interleaved(fns, rounds=ROUNDS))


def main(argv=None) -> int:
    """Runs the sweep on this GPU and writes ``<out-dir>/settings_<device>.json``."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--out-dir", default=os.path.join("misc", "bench", "sort"))
    parser.add_argument("--seed", type=int, default=0)
    a = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("the sort settings sweep needs a CUDA or ROCm GPU")
    gen = torch.Generator(device="cuda").manual_seed(a.seed)
    result = dict(**run_record("python -m fmoe2.bench.sort_settings", argv), block_m=BLOCK_M, rounds=ROUNDS,
                  points=[])
    for name, ((E, H, topk), ms) in POINTS.items():
        for M in ms:
            row = dict(shape=name, E=E, H=H, topk=topk, M=M, **sweep_point(E, H, topk, M, gen))
            result["points"].append(row)
            t = row["times_us"]
            best = min((k for k in t if k != "auto"), key=t.get)
            print(f"{name} M={M}: auto (p{row['auto']['parts']}w{row['auto']['warps']}) {t['auto']:.1f} us, "
                  f"best {best} {t[best]:.1f} us; " + " ".join(f"{k} {v:.1f}" for k, v in t.items() if k != "auto"),
                  flush=True)
    os.makedirs(a.out_dir, exist_ok=True)
    path = os.path.join(a.out_dir, f"settings_{device_config_name()}.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
