"""Same-run A/B of CUDA-graph time: this tree's ``fused_moe`` against another copy of fmoe2.

    python -m fmoe2.bench.graph_ab --other PATH [--modes plain,lora,fp8,deterministic] [--shapes ...]
                                   [--m 1,16,128,1024,4096] [--rounds 5]

``PATH`` is a folder holding a copy of the ``fmoe2`` package (for example ``git archive <commit>
fmoe2``, unpacked): it is imported under another name, so both run in one process on the same
inputs, each with the config its own ``get_config`` picks, their graphs taking turns over
``--rounds`` rounds (``time_interleaved``). A change to the call path must not slow the kernels
it launches: this is the check that a graph replay of the new code is as fast as the old.

``--modes`` (default ``plain``) picks the forwards, each through the public ``fused_moe`` of both copies, on
weights each copy prepares itself (``prepare_weights``, ``prepare_lora``) from the same tensors:

* ``plain``: bf16 weights;
* ``lora``: bf16 weights with 4 adapters of rank 16, about 20% of the tokens without one
  (``fmoe2/bench/lora.py``'s ``make_adapters`` and ``make_token_lora_ids``);
* ``fp8``: block-scaled fp8 weights, blocks of 128 x 128 (``quantize_fp8_weights``), prepared with their scales;
* ``deterministic``: bf16 weights, ``deterministic=True``;
* ``unprepared``: bf16 weights passed as they are, ``w1 [E, 2I, H]`` and ``w2 [E, H, I]`` (K-contiguous);
* ``transposed``: the same values as transposed views of N-contiguous ``[E, H, 2I]`` / ``[E, I, H]`` tensors, the
  layout of transformers' gpt-oss and aria experts (issue 55: these once ran 37x slower than K-contiguous weights).
  (``unprepared`` and ``transposed`` are ``fmoe2.bench.layout``'s ``k_contiguous`` and ``n_contiguous``.)

Before timing, both outputs of every point are checked against the float32 reference (``fused_moe_reference``;
fp8: the reference with the same quantization) within the correctness grid's bounds (``correctness.BOUND``).
Prints a table and writes ``<out-dir>/host/graph_ab_<device>.json``.
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import math
import os
import sys
from typing import List, Optional

import torch

import fmoe2
from fmoe2.gemm.config import device_config_name
from fmoe2.gemm.fused_moe import plan_of
from fmoe2.shapes import ALL_SHAPES, SHAPES

from .problems import make_inputs, random_weights
from .correctness import BOUND, FP8_BLOCK, relative_error
from .layout import n_contiguous
from .lora import make_adapters, make_token_lora_ids
from .provenance import provenance_line, rewrite_report, run_record, write_result
from .timing import time_interleaved

MODES = ("plain", "lora", "fp8", "deterministic", "unprepared", "transposed")
# Modes whose weights go to fused_moe as tensors, not prepared: K-contiguous [E, 2I, H] / [E, H, I] as made, or
# transposed views of N-contiguous [E, H, 2I] / [E, I, H] tensors (transformers' gpt-oss layout).
UNPREPARED_MODES = ("unprepared", "transposed")
# The LoRA benchmark's defaults (fmoe2/bench/lora.py): adapters, their rank, the share of tokens without one.
NUM_LORAS, LORA_RANK, NONE_FRACTION = 4, 16, 0.2


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


def parse_modes(text: str) -> List[str]:
    """``--modes``: comma-separated names from :data:`MODES`, in the order given, each once; raises
    ``ValueError`` for an unknown or missing one."""
    modes = []
    for mode in (m.strip() for m in text.split(",")):
        if mode not in MODES:
            raise ValueError(f"--modes takes names from {MODES}, got {mode!r}")
        if mode not in modes:
            modes.append(mode)
    return modes


def mode_weights(mode: str, E: int, H: int, I: int, gen: torch.Generator) -> dict:
    """The expert weights of one (shape, mode), made once on ``gen``'s device and shared by both copies:

    * ``w1 [E, 2I, H]``, ``w2 [E, H, I]``: bf16, or fp8 (``torch.float8_e4m3fn``) for ``fp8``;
    * ``scales``: ``prepare_weights`` and reference keywords (``w1_scale``, ``w2_scale`` float32, ``block_shape``);
    * ``lora``: a bf16 :class:`fmoe2.MoELoRA` of :data:`NUM_LORAS` adapters of rank :data:`LORA_RANK` (``lora``
      only), else None;
    * ``options``: further ``fused_moe`` keywords (``deterministic=True`` for ``deterministic``);
    * ``bound``: the relative L2 error allowed against the reference (``correctness.BOUND``).
    """
    w1, w2 = random_weights(E, H, I, gen)
    scales, lora, options = {}, None, {}
    if mode == "fp8":
        q1, s1 = fmoe2.quantize_fp8_weights(w1, "block", FP8_BLOCK)
        q2, s2 = fmoe2.quantize_fp8_weights(w2, "block", FP8_BLOCK)
        w1, w2, scales = q1, q2, dict(w1_scale=s1, w2_scale=s2, block_shape=FP8_BLOCK)
    elif mode == "lora":
        lora = make_adapters(NUM_LORAS, E, H, I, LORA_RANK, gen)
    elif mode == "deterministic":
        options = dict(deterministic=True)
    elif mode == "transposed":
        w1, w2 = n_contiguous(w1), n_contiguous(w2)
    elif mode not in ("plain", "unprepared"):
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    return dict(w1=w1, w2=w2, scales=scales, lora=lora, options=options, prepare=mode not in UNPREPARED_MODES,
                bound=BOUND["fp8" if mode == "fp8" else "bf16"])


def copy_arguments(package, weights: dict) -> dict:
    """``package``'s (this fmoe2 or the other copy) own arguments of :func:`mode_weights`' tensors: ``weights``,
    the ``(w1, w2)`` of ``fused_moe`` (the copy's ``prepare_weights`` with the scales and None, or the tensors
    themselves where the mode does not prepare them), and ``lora``, the copy's ``prepare_lora`` of its own
    ``MoELoRA`` built from the same tensors (each copy checks the classes it defines)."""
    if weights["prepare"]:
        pair = (package.prepare_weights(weights["w1"], weights["w2"], **weights["scales"]), None)
    else:
        pair = (weights["w1"], weights["w2"])
    lora = weights["lora"]
    if lora is not None:
        lora = package.prepare_lora(package.MoELoRA(**{f.name: getattr(lora, f.name)
                                                       for f in dataclasses.fields(lora)}))
    return dict(weights=pair, lora=lora)


def reference_output(weights: dict, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                     token_lora_ids: Optional[torch.Tensor]) -> torch.Tensor:
    """float32 ``[M, H]`` reference of one point. 16-bit weights: float32 throughout (adapters included). fp8: the
    reference with the kernels' quantization, on bf16 ``x`` (as ``correctness.check_point`` runs it)."""
    if weights["scales"]:
        return fmoe2.fused_moe_reference(x, weights["w1"], weights["w2"], topk_weights, topk_ids,
                                         **weights["scales"]).float()
    return fmoe2.fused_moe_reference(x.float(), weights["w1"].float(), weights["w2"].float(), topk_weights, topk_ids,
                                     lora=weights["lora"], token_lora_ids=token_lora_ids)


def checked_error(label: str, out: torch.Tensor, ref: torch.Tensor, bound: float) -> float:
    """Relative L2 error of ``out`` against ``ref``; exits naming ``label`` when it is not finite or above
    ``bound`` (a copy that computes wrong is not timed)."""
    err = relative_error(out, ref)
    if not math.isfinite(err) or err > bound or not bool(torch.isfinite(out).all()):
        raise SystemExit(f"{label}: relative error {err:.2e} (bound {bound:.1e})")
    return err


def ab_point(other, name: str, mode: str, shape, M: int, weights: dict, args: dict, rounds: int,
             gen: torch.Generator) -> dict:
    """One row: both copies' forwards of batch ``M`` checked against the reference, then timed in CUDA graphs
    taking turns. ``args``: ``{"this": copy_arguments(fmoe2, ...), "other": copy_arguments(other, ...)}``."""
    E, H, I, topk = shape
    x, tw, ti = make_inputs(M, E, H, I, topk, gen)
    ids = make_token_lora_ids(M, NUM_LORAS, gen, NONE_FRACTION) if weights["lora"] is not None else None
    ref = reference_output(weights, x, tw, ti, ids)
    kwargs = {label: dict(weights["options"], **({"lora": args[label]["lora"], "token_lora_ids": ids}
                                                 if ids is not None else {})) for label in args}
    calls, errors = {}, {}
    for label, package in (("this", fmoe2), ("other", other)):
        out = torch.empty_like(x)
        calls[label] = (lambda fn=package.fused_moe, w=args[label]["weights"], out=out, kw=kwargs[label]:
                        fn(x, *w, tw, ti, out=out, **kw))
        errors[label] = checked_error(f"{name} M={M} {mode} ({label})", calls[label](), ref, weights["bound"])
    times = time_interleaved(calls, rounds=rounds)
    plan = plan_of(x, *args["this"]["weights"], tw, ti, **kwargs["this"])  # the config this tree ran
    return dict(shape=name, M=M, mode=mode, this_us=times["this"], other_us=times["other"],
                ratio=times["this"] / times["other"], this_rel_err=errors["this"], other_rel_err=errors["other"],
                config=plan.config.to_dict() if plan is not None else None)


def markdown(result: dict) -> str:
    rows = result["rows"]
    lines = [f"# CUDA-graph time, this tree against another copy of fmoe2: {result['device']}", "",
             provenance_line(result), "",
             "Each forward with the config its own get_config picks, both taking turns in every round; us per call "
             "(median).", "", "| shape | M | mode | this | other | this / other |", "|---|---|---|---|---|---|"]
    lines += [f"| {r['shape']} | {r['M']} | {r.get('mode', 'plain')} | {r['this_us']:.1f} | {r['other_us']:.1f} | "
              f"{r['ratio']:.3f} |" for r in rows]
    return "\n".join(lines) + "\n"


def parse_args(argv=None) -> argparse.Namespace:
    """The command line (module docstring); ``modes`` parsed into a list (:func:`parse_modes`)."""
    p = argparse.ArgumentParser(prog="python -m fmoe2.bench.graph_ab", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--other", help="folder holding the other copy of the fmoe2 package")
    p.add_argument("--report", default=None, metavar="JSON", help="only rewrite the markdown of a result file")
    p.add_argument("--modes", default="plain", help=f"comma-separated forwards from {MODES}")
    p.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated names from {sorted(ALL_SHAPES)}")
    p.add_argument("--m", default="1,16,128,1024,4096", help="comma-separated batch sizes")
    p.add_argument("--rounds", type=int, default=5, help="interleaved timing rounds")
    p.add_argument("--out-dir", default=os.path.join("misc", "bench"), help="results go to <out-dir>/host/")
    a = p.parse_args(argv)
    try:
        a.modes = parse_modes(a.modes)
    except ValueError as e:
        p.error(str(e))
    if not a.report and not a.other:
        p.error("--other is required")
    return a


def main(argv=None) -> int:
    a = parse_args(argv)
    if a.report:
        rewrite_report(a.report, markdown)
        return 0
    if not torch.cuda.is_available():
        raise SystemExit("the A/B needs a CUDA or ROCm GPU")
    other = import_copy(a.other)
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    print(f"{'shape':18s} {'M':>6s} {'mode':13s} {'this us':>9s} {'other us':>9s} {'ratio':>6s}", flush=True)
    for name in a.shapes.split(","):
        E, H, I, topk = ALL_SHAPES[name]
        for mode in a.modes:
            weights = mode_weights(mode, E, H, I, gen)
            args = {"this": copy_arguments(fmoe2, weights), "other": copy_arguments(other, weights)}
            for M in (int(m) for m in a.m.split(",")):
                row = ab_point(other, name, mode, ALL_SHAPES[name], M, weights, args, a.rounds, gen)
                rows.append(row)
                print(f"{name:18s} {M:6d} {mode:13s} {row['this_us']:9.1f} {row['other_us']:9.1f} "
                      f"{row['ratio']:6.3f}", flush=True)
            del weights, args  # one mode's weights at a time (DeepSeek-V2-Lite, Mixtral: GBs each)
    result = {**run_record("python -m fmoe2.bench.graph_ab", argv), "rows": rows}
    write_result(os.path.join(a.out_dir, "host", f"graph_ab_{device_config_name()}.json"), result, markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
