"""Every weight layout ``fused_moe`` takes, timed against each other: ``python -m fmoe2.bench.layout``.

The same bf16 expert weights handed over as

* ``k_contiguous``: ``w1 [E, 2I, H]``, ``w2 [E, H, I]`` contiguous (vLLM's and SGLang's layout);
* ``n_contiguous``: transposed views of ``[E, H, 2I]`` and ``[E, I, H]`` tensors, read in place (how
  transformers' gpt-oss and aria experts hold theirs, ``is_transposed``);
* ``prepared``: ``fmoe2.prepare_weights`` once, at load time;

with gate and up concatenated (gate rows, then up rows) or interleaved (g0, u0, g1, u1, ...: gpt-oss), with
or without biases. Each variant is first checked against the float32 reference (``fused_moe_reference``),
then all are captured in CUDA graphs and replayed in turns (``timing.time_graphs_in_turns``), so the ratios
come from one run. The ratio column is each layout's time over the ``k_contiguous`` one of the same gate/up
order and biases.

Writes ``<out-dir>/layout/<device>.json`` and ``.md``.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

import fmoe2
from fmoe2.gemm.config import device_config_name
from fmoe2.shapes import ALL_SHAPES, SHAPE_OPTIONS

from .problems import random_biases, random_weights
from .correctness import relative_error
from .provenance import provenance_line, run_record, write_result
from .timing import time_graphs_in_turns

LAYOUTS = ("k_contiguous", "n_contiguous", "prepared")
# Relative error to the float32 reference a bf16 forward stays within (its rounding: about 4e-3 measured).
MAX_REL_ERR = 2e-2


def n_contiguous(w: torch.Tensor) -> torch.Tensor:
    """``w [E, R, C]`` as a view of a ``[E, C, R]`` tensor holding the same values (stride 1 along R): how
    transformers' transposed experts (``is_transposed``) hold theirs."""
    return w.transpose(1, 2).contiguous().transpose(1, 2)


def layout_weights(w1: torch.Tensor, w2: torch.Tensor, layout: str, interleaved: bool, biases: dict,
                   n_contiguous_pair=None):
    """``(w1, w2, keywords)`` of ``fused_moe`` for the K-contiguous weights ``w1 [E, 2I, H]`` (gate/up in the
    order ``interleaved`` says), ``w2 [E, H, I]`` handed over in ``layout`` (:data:`LAYOUTS`);
    ``n_contiguous_pair``: the N-contiguous views of the pair, made once by the caller (None: made here)."""
    if layout == "prepared":
        return fmoe2.prepare_weights(w1, w2, gate_up_interleaved=interleaved, **biases), None, {}
    keywords = dict(gate_up_interleaved=interleaved, **biases)
    if layout == "n_contiguous":  # the transposed tensors as they are stored, passed as views
        return (*(n_contiguous_pair or (n_contiguous(w1), n_contiguous(w2))), keywords)
    if layout == "k_contiguous":
        return w1.contiguous(), w2.contiguous(), keywords
    raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")


def ratios_to_k_contiguous(times: dict) -> dict:
    """``{"layout/order/bias": us}`` -> each time over the ``k_contiguous`` one of the same order and biases."""
    return {key: us / times["k_contiguous/" + key.split("/", 1)[1]] for key, us in times.items()}


def bench_shape(name: str, ms, orders, bias_choices, rounds: int, gen, record=lambda row: None) -> list:
    """Rows (one per M) of shape ``name``: every layout x gate/up order x biases choice, checked against the
    float32 reference, then timed in CUDA graphs taking turns; ``record(row)`` is called after each row."""
    E, H, I, topk = ALL_SHAPES[name]
    options = dict(SHAPE_OPTIONS.get(name, {}))
    options.pop("biases", None)
    w1, w2 = random_weights(E, H, I, gen)
    all_biases = random_biases(E, H, I, gen)
    views = (n_contiguous(w1), n_contiguous(w2))  # one copy for every order and bias choice
    variants = {}  # "layout/order/bias" -> (w1, w2, keywords, interleaved, biases)
    for order in orders:
        interleaved = order == "interleaved"
        for with_bias in bias_choices:
            biases = all_biases if with_bias else {}
            for layout in LAYOUTS:
                variants[f"{layout}/{order}/{'bias' if with_bias else 'no_bias'}"] = (
                    *layout_weights(w1, w2, layout, interleaved, biases, views), interleaved, biases)
    rows = []
    for M in ms:
        x = torch.randn(M, H, device="cuda", generator=gen).to(torch.bfloat16)
        tw, ti = torch.topk(torch.randn(M, E, device="cuda", generator=gen).softmax(-1), topk)
        out = torch.empty_like(x)
        calls, errors, refs = {}, {}, {}
        for key, (a, b, keywords, interleaved, biases) in variants.items():
            combo = key.split("/", 1)[1]
            if combo not in refs:
                refs[combo] = fmoe2.fused_moe_reference(x.float(), w1, w2, tw, ti, gate_up_interleaved=interleaved,
                                                        **biases, **options).float()
            call = (lambda a=a, b=b, keywords=keywords:
                    fmoe2.fused_moe(x, a, b, tw, ti, out=out, **keywords, **options))
            out.fill_(float("nan"))  # poisoned: an unwritten element shows
            got = call()
            errors[key] = relative_error(got, refs[combo])
            if not errors[key] <= MAX_REL_ERR:
                raise SystemExit(f"{name} M={M} {key}: relative error {errors[key]:.2e} to the float32 "
                                 f"reference (above {MAX_REL_ERR})")
            calls[key] = call
        del refs
        times = time_graphs_in_turns(calls, rounds=rounds, calls=10, replays=20)
        row = dict(shape=name, M=M, us=times, rel_err=errors, ratio=ratios_to_k_contiguous(times))
        rows.append(row)
        record(row)
        print(f"{name} M={M}: " + ", ".join(f"{k} {v:.1f} us" for k, v in times.items()) +
              f"; worst ratio to k_contiguous {max(row['ratio'].values()):.2f}", flush=True)
        del calls
    return rows


def markdown(result: dict) -> str:
    lines = [f"# Weight layouts: {result['device']}", "", provenance_line(result), "",
             "`fused_moe` time per call (us, CUDA graphs, median over rounds taken in turns) of the same bf16 "
             "weights handed over K-contiguous (`[E, 2I, H]`), N-contiguous (transposed views of `[E, H, 2I]`, "
             "transformers' gpt-oss layout) and prepared; each checked against the float32 reference first. "
             "The ratio is the time over the K-contiguous one of the same gate/up order and biases.", "",
             "| shape | M | gate/up | biases | k_contiguous | n_contiguous | prepared | n / k | prepared / k |",
             "|---|---|---|---|---|---|---|---|---|"]
    for row in result["rows"]:
        combos = sorted({key.split("/", 1)[1] for key in row["us"]})
        for combo in combos:
            order, bias = combo.split("/")
            us = {layout: row["us"][f"{layout}/{combo}"] for layout in LAYOUTS}
            ratio = {layout: row["ratio"][f"{layout}/{combo}"] for layout in LAYOUTS}
            lines.append(f"| {row['shape']} | {row['M']} | {order} | {bias.replace('_', ' ')} | "
                         f"{us['k_contiguous']:.1f} | {us['n_contiguous']:.1f} | {us['prepared']:.1f} | "
                         f"{ratio['n_contiguous']:.2f}x | {ratio['prepared']:.2f}x |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m fmoe2.bench.layout", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--shapes", default="gpt-oss-20b,gpt-oss-120b", help=f"comma-separated names of {sorted(ALL_SHAPES)}")
    p.add_argument("--m", default="1,8,64,512,4096", help="comma-separated batch sizes")
    p.add_argument("--orders", default="interleaved,concatenated", help="gate/up orders: interleaved, concatenated")
    p.add_argument("--biases", default="with", help="with, without, or both")
    p.add_argument("--rounds", type=int, default=5, help="rounds of replays, the variants taking turns")
    p.add_argument("--out-dir", default=os.path.join("misc", "bench"), help="results go to <out-dir>/layout/")
    a = p.parse_args(argv)
    shapes = [s for s in a.shapes.split(",") if s]
    unknown = [s for s in shapes if s not in ALL_SHAPES]
    orders = [o for o in a.orders.split(",") if o]
    if unknown:
        p.error(f"unknown shapes {unknown}: choose from {sorted(ALL_SHAPES)}")
    if not orders or set(orders) - {"interleaved", "concatenated"}:
        p.error(f"--orders takes interleaved and/or concatenated, got {a.orders!r}")
    if a.biases not in ("with", "without", "both"):
        p.error(f"--biases takes with, without or both, got {a.biases!r}")
    try:
        ms = [int(m) for m in a.m.split(",")]
    except ValueError:
        p.error(f"--m must be comma-separated ints, got {a.m!r}")
    if not torch.cuda.is_available():
        raise SystemExit("this benchmark needs a CUDA or ROCm GPU")
    bias_choices = {"with": (True,), "without": (False,), "both": (True, False)}[a.biases]
    result = dict(run_record("python -m fmoe2.bench.layout", argv), rows=[])
    gen = torch.Generator(device="cuda").manual_seed(0)
    path = os.path.join(a.out_dir, "layout", device_config_name() + ".json")

    def record(row):  # after every row: a run cut short keeps what it measured
        result["rows"].append(row)
        write_result(path, result, markdown)

    for name in shapes:
        bench_shape(name, ms, orders, bias_choices, a.rounds, gen, record)
    print(write_result(path, result, markdown))
    return 0


if __name__ == "__main__":
    sys.exit(main())
