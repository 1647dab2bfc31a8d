"""Same-run A/B of CUDA-graph time: this tree's ``fused_moe`` against another copy of fmoe2.

    python -m fmoe2.bench.graph_ab --other PATH [--shapes ...] [--m 1,16,128,1024,4096]

``PATH`` is a folder holding a copy of the ``fmoe2`` package (for example ``git archive <commit>
fmoe2``, unpacked): it is imported under another name, so both run in one process on the same
inputs, each with the config its own ``get_config`` picks, their graphs taking turns over
``--rounds`` rounds (``time_interleaved``). A change to the call path must not slow the kernels
it launches: this is the check that a graph replay of the new code is as fast as the old.
Prints a table and writes ``<out-dir>/host/graph_ab_<device>.json``.
"""
from __future__ import annotations

import argparse
import importlib.util
import math
import os
import sys

import torch

import fmoe2
from fmoe2.gemm.config import device_config_name
from fmoe2.shapes import SHAPES

from .provenance import provenance_line, rewrite_report, run_record, write_result
from .timing import time_interleaved


def import_copy(path: str, name: str = "fmoe2_other"):
    """The ``fmoe2`` package under ``path``, imported as ``name`` (its imports are relative). Its torch.library
    ops (``fmoe2/ops.py``) register under the namespace ``name``: torch takes one definition per namespace."""
    spec = importlib.util.spec_from_file_location(name, os.path.join(path, "fmoe2", "__init__.py"),
                                                  submodule_search_locations=[os.path.join(path, "fmoe2")])
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    library, register_fake = torch.library.Library, torch.library.register_fake

    class Renamed(library):
        def __init__(self, ns, *args, **kwargs):
            super().__init__(name if ns == "fmoe2" else ns, *args, **kwargs)

    def renamed_fake(op, *args, **kwargs):
        if isinstance(op, str) and op.startswith("fmoe2::"):
            op = name + op[len("fmoe2"):]
        return register_fake(op, *args, **kwargs)

    torch.library.Library, torch.library.register_fake = Renamed, renamed_fake
    try:
        spec.loader.exec_module(module)
    finally:
        torch.library.Library, torch.library.register_fake = library, register_fake
    return module


def markdown(result: dict) -> str:
    rows = result["rows"]
    lines = [f"# CUDA-graph time, this tree against another copy of fmoe2: {result['device']}", "",
             provenance_line(result), "",
             "Each forward with the config its own get_config picks, both taking turns in every round; us per call "
             "(median).", "", "| shape | M | this | other | this / other |", "|---|---|---|---|---|"]
    lines += [f"| {r['shape']} | {r['M']} | {r['this_us']:.1f} | {r['other_us']:.1f} | {r['ratio']:.3f} |"
              for r in rows]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m fmoe2.bench.graph_ab", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--other", help="folder holding the other copy of the fmoe2 package")
    p.add_argument("--report", default=None, metavar="JSON", help="only rewrite the markdown of a result file")
    p.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated names from {sorted(SHAPES)}")
    p.add_argument("--m", default="1,16,128,1024,4096", help="comma-separated batch sizes")
    p.add_argument("--rounds", type=int, default=5, help="interleaved timing rounds")
    p.add_argument("--out-dir", default=os.path.join("misc", "bench"), help="results go to <out-dir>/host/")
    a = p.parse_args(argv)
    if a.report:
        rewrite_report(a.report, markdown)
        return 0
    if not a.other:
        p.error("--other is required")
    if not torch.cuda.is_available():
        raise SystemExit("the A/B needs a CUDA or ROCm GPU")
    other = import_copy(a.other)
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    print(f"{'shape':18s} {'M':>6s} {'this us':>9s} {'other us':>9s} {'ratio':>6s}", flush=True)
    for name in a.shapes.split(","):
        E, H, I, topk = SHAPES[name]
        w1 = torch.randn(E, 2 * I, H, device="cuda", dtype=torch.bfloat16, generator=gen) / math.sqrt(H)
        w2 = torch.randn(E, H, I, device="cuda", dtype=torch.bfloat16, generator=gen) / math.sqrt(I)
        this_weights, other_weights = fmoe2.prepare_weights(w1, w2), other.prepare_weights(w1, w2)
        for M in (int(m) for m in a.m.split(",")):
            x = torch.randn(M, H, device="cuda", dtype=torch.bfloat16, generator=gen)
            tw, ti = torch.topk(torch.randn(M, E, device="cuda", generator=gen).softmax(-1), topk, dim=-1)
            ti = ti.to(torch.int32)
            out_this, out_other = torch.empty_like(x), torch.empty_like(x)
            ref = fmoe2.fused_moe_reference(x.float(), w1.float(), w2.float(), tw, ti)
            for fn, out in ((fmoe2.fused_moe, out_this), (other.fused_moe, out_other)):
                weights = this_weights if fn is fmoe2.fused_moe else other_weights
                fn(x, weights, None, tw, ti, out=out)
                err = ((out.float() - ref).norm() / ref.norm()).item()
                if not math.isfinite(err) or err > 2.5e-2:
                    raise SystemExit(f"{name} M={M}: relative error {err:.2e}")
            times = time_interleaved({
                "this": lambda: fmoe2.fused_moe(x, this_weights, None, tw, ti, out=out_this),
                "other": lambda: other.fused_moe(x, other_weights, None, tw, ti, out=out_other)}, rounds=a.rounds)
            row = dict(shape=name, M=M, this_us=times["this"], other_us=times["other"],
                       ratio=times["this"] / times["other"],
                       config=fmoe2.get_config(M, E, H, I, topk, torch.bfloat16).to_dict())
            rows.append(row)
            print(f"{name:18s} {M:6d} {row['this_us']:9.1f} {row['other_us']:9.1f} {row['ratio']:6.3f}", flush=True)
    result = {**run_record("python -m fmoe2.bench.graph_ab", argv), "rows": rows}
    write_result(os.path.join(a.out_dir, "host", f"graph_ab_{device_config_name()}.json"), result, markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
