"""Sweep of the sort's settings: one launch with several programs per expert, or two in chunks.

    python -m fmoe2.bench.sort_settings [--out-dir misc/bench/sort]

The measurements behind ``sort_programs`` and ``sort_chunk_size`` (``fmoe2/sorting/moe_sorting.py``),
on this GPU: the sort with the zeroing of a bf16 ``[M, H]`` output, ``moe_sorting``'s launches
alone (preallocated buffers, 64-row tiles), softmax + top-k routing of random logits. Variants:
the one-launch sort at 1, 2 and 4 programs per expert x 4 and 8 warps (``p2w4``...), the
two-launch sort in chunks of 256 to 2048 routing entries (``c512``...), and the shipped choice
(``auto``), taking turns over 5 rounds (``time_interleaved``). Points: the benchmark shapes and
four more expert counts (E=32 top-4, E=160 top-6, E=256 top-8, E=384 top-8), mostly at M=1024
and 4096, plus the batch sizes either side of the two-launch rule's threshold.

Every variant's buffers must equal the ``auto`` variant's bit for bit, and the ``auto`` variant
must hold the routing of ``moe_sorting_reference``. Writes ``<out-dir>/settings_<device>.json``.

    python -m fmoe2.bench.sort_settings --forward [--out-dir misc/bench/sort]

times the whole forward instead (``fused_moe`` on prepared weights, its picked config, bf16 data
as in ``python -m fmoe2.bench``) with the sort the rule picks against the one-launch sort, at the
benchmark shapes and batch sizes where ``sort_chunk_size`` picks chunks, 15 interleaved rounds;
writes ``<out-dir>/forward_<device>.json``.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import math
import os
import sys

import torch

from fmoe2.gemm.config import device_config_name
from fmoe2.reference import moe_sorting_reference
from fmoe2.shapes import SHAPES
from fmoe2.sorting import MoESortingResult, launch_moe_sorting
from fmoe2.target import target_of
from fmoe2 import fused_moe, prepare_weights
from fmoe2.sorting.moe_sorting import CHUNKED_SORT_WARPS, sort_chunk_size, sort_programs

from .provenance import run_record
from .timing import time_interleaved

ROUNDS = 5
BLOCK_M = 64
PARTS = (1, 2, 4)
WARPS = (4, 8)
# name: (E, H, topk), batch sizes
POINTS = {
    **{name: ((E, H, topk), (1024, 4096)) for name, (E, H, _, topk) in SHAPES.items()},
    "E=32,top-4": ((32, 2048, 4), (1024, 4096)),
    "E=160,top-6": ((160, 5120, 6), (1024, 4096)),
    "E=256,top-8": ((256, 7168, 8), (512, 1024, 4096)),
    "E=384,top-8": ((384, 7168, 8), (1024, 4096)),
}
POINTS["qwen3-30b-a3b"] = (POINTS["qwen3-30b-a3b"][0], (128, 1024, 2048, 4096, 8192))
POINTS["deepseek-v2-lite"] = (POINTS["deepseek-v2-lite"][0], (1024, 2048, 4096, 8192))
CHUNK_SIZES = (256, 512, 1024, 2048)
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
    (``auto``: parts, warps and chunk size, 0 for one launch) and each variant's median
    microseconds (``times_us``)."""
    logits = torch.randn(M, E, device="cuda", generator=gen)
    topk_weights, topk_ids = torch.topk(logits.softmax(dim=-1), topk, dim=-1)
    topk_ids = topk_ids.to(torch.int32)
    out = torch.randn(M, H, device="cuda", dtype=torch.bfloat16, generator=gen)
    variants = {"auto": (None, None, None)}
    variants.update({f"p{parts}w{warps}": (parts, warps, 0) for parts in PARTS for warps in WARPS})
    variants.update({f"c{size}": (None, None, size) for size in CHUNK_SIZES})
    fns, results = {}, {}
    for name, (parts, warps, chunk_size) in variants.items():
        result = MoESortingResult.allocate(M * topk, E, BLOCK_M, M, "cuda", chunk_size=chunk_size)

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
    chunk_size = results["auto"].chunk_size
    if chunk_size:
        auto = dict(parts=1, warps=CHUNKED_SORT_WARPS, chunk_size=chunk_size)
    else:
        auto_parts, auto_warps = sort_programs(E, M * topk, target_of(topk_ids.device).num_sms)
        auto = dict(parts=auto_parts, warps=auto_warps, chunk_size=0)
    return dict(auto=auto, times_us=time_interleaved(fns, rounds=ROUNDS))


FORWARD_ROUNDS = 15
FORWARD_BATCHES = (1024, 2048, 4096, 8192)


@contextlib.contextmanager
def one_launch_sort():
    """Within it, every sort allocated takes the one-launch sort (``sort_chunk_size`` returns 0)."""
    module = importlib.import_module("fmoe2.sorting.moe_sorting")
    rule = module.sort_chunk_size
    module.sort_chunk_size = lambda num_keys, num_entries: 0
    try:
        yield
    finally:
        module.sort_chunk_size = rule


def forward_point(E: int, H: int, inter: int, topk: int, M: int, gen) -> dict:
    """Median microseconds of the forward with the shipped sort (``chunked``) and the one-launch sort
    (``one_launch``), after checking that both give the same output (to the atomics' rounding)."""
    from .problems import make_inputs

    w1 = torch.randn(E, 2 * inter, H, device="cuda", dtype=torch.bfloat16, generator=gen) / math.sqrt(H)
    w2 = torch.randn(E, H, inter, device="cuda", dtype=torch.bfloat16, generator=gen) / math.sqrt(inter)
    weights = prepare_weights(w1, w2)
    del w1, w2
    x, topk_weights, topk_ids = make_inputs(M, E, H, inter, topk, gen)
    outs = {name: torch.empty(M, H, device="cuda", dtype=torch.bfloat16) for name in ("chunked", "one_launch")}

    def chunked():
        fused_moe(x, weights, None, topk_weights, topk_ids, out=outs["chunked"])

    def one_launch():
        with one_launch_sort():
            fused_moe(x, weights, None, topk_weights, topk_ids, out=outs["one_launch"])

    chunked(), one_launch()
    diff = (outs["chunked"].float() - outs["one_launch"].float()).norm() / outs["one_launch"].float().norm()
    if not diff < 1e-2:
        raise SystemExit(f"E={E} M={M}: the two sorts' forwards differ (relative {diff:.2e})")
    return dict(chunk_size=sort_chunk_size(E, M * topk),
                times_us=time_interleaved({"chunked": chunked, "one_launch": one_launch}, rounds=FORWARD_ROUNDS))


def forward_main(a, gen, argv):
    """The ``--forward`` run: its output path and result record."""
    result = dict(**run_record("python -m fmoe2.bench.sort_settings", argv), rounds=FORWARD_ROUNDS, points=[])
    for name, (E, H, inter, topk) in SHAPES.items():
        for M in FORWARD_BATCHES:
            if not sort_chunk_size(E, M * topk):
                continue
            row = dict(shape=name, M=M, **forward_point(E, H, inter, topk, M, gen))
            result["points"].append(row)
            t = row["times_us"]
            print(f"{name} M={M} (chunks of {row['chunk_size']}): forward {t['chunked']:.1f} us, with the "
                  f"one-launch sort {t['one_launch']:.1f} us ({t['one_launch'] / t['chunked']:.3f}x)", flush=True)
    return os.path.join(a.out_dir, f"forward_{device_config_name()}.json"), result


def main(argv=None) -> int:
    """Runs the sweep on this GPU and writes ``<out-dir>/settings_<device>.json``."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--out-dir", default=os.path.join("misc", "bench", "sort"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--forward", action="store_true",
                        help="time the forward with the picked sort against the one-launch sort")
    a = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("the sort settings sweep needs a CUDA or ROCm GPU")
    gen = torch.Generator(device="cuda").manual_seed(a.seed)
    if a.forward:
        path, result = forward_main(a, gen, argv)
        os.makedirs(a.out_dir, exist_ok=True)
        with open(path, "w") as f:
            json.dump(result, f, indent=1)
        print(f"wrote {path}")
        return 0
    result = dict(**run_record("python -m fmoe2.bench.sort_settings", argv), block_m=BLOCK_M, rounds=ROUNDS,
                  points=[])
    for name, ((E, H, topk), ms) in POINTS.items():
        for M in ms:
            row = dict(shape=name, E=E, H=H, topk=topk, M=M, **sweep_point(E, H, topk, M, gen))
            result["points"].append(row)
            t = row["times_us"]
            best = min((k for k in t if k != "auto"), key=t.get)
            auto = row["auto"]
            auto_name = f"c{auto['chunk_size']}" if auto["chunk_size"] else f"p{auto['parts']}w{auto['warps']}"
            print(f"{name} M={M}: auto ({auto_name}) {t['auto']:.1f} us, "
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
