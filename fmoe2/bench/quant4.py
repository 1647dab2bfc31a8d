"""Weight-only quantized expert weights (4-bit, int8) against 16-bit ones: ``python -m fmoe2.bench.quant4``.

    python -m fmoe2.bench.quant4 [--shapes gpt-oss-120b,gpt-oss-20b] [--format mxfp4|int4|int8|int8-g128]
                                 [--m 1,16,128,1024,4096] [--out misc/bench/quant4/<device>-mxfp4.json]
                                 [--untuned] [--launches] [--search]

Per shape and batch size, in one run on one GPU (CUDA graphs, CUDA events, median; the variants' graphs take
turns, so ratios compare like with like), uniform random routing:

* ``bf16``: fmoe2's forward on 16-bit weights (``path="auto"``, sort included);
* ``<format>``: fmoe2's forward on the same weights' quantized prepared form (mxfp4, or int4 with groups of 128
  (the largest of 128, 64, 32 that divides H and I: gpt-oss's 2880 takes 64) and fp16 (scale, zero) pairs:
  ``fmoe2/quant4.py``; int8 with bf16 scales per channel, or ``int8-g128`` per group
  of 128: ``fmoe2/int8.py``), dequantized in the kernels' operand loader;
* ``vllm-w4a16`` (4-bit formats): the benchmark's vLLM-style baseline (``fmoe2/bench/vllm_style.py``: align, two
  grouped GEMMs, activation and top-k sum kernels) on the same 4-bit weights, dequantized in its GEMMs' K loops as
  vLLM's wna16 kernel does, with vLLM's default config rule for an untuned shape.

With ``--untuned``, the quantized forward is also timed with the pick it would run without the format's tuned entry
(the shape's 16-bit pick, fitted to the format as ``fused_moe`` fits it): ``untuned``, what the entry gains.

With ``--launches``, each launch of the bf16 and of the quantized forward (the sort, fused or stage 1 and stage 2)
is also timed alone in its own graph (``ceilings.stage_times``): where a format's time goes.

With ``--search``, the quantized forward is also timed at every config of the tuner's grid (``fmoe2.bench.search``,
as ``fused_moe`` fits them to dequantizing in registers: ``fit_packed_config``), the fastest checked against the
reference: ``searched``, what configs alone can give the format before its GEMM core changes.

Each variant is first checked against the float32 reference on the dequantized 4-bit weights (relative L2 error;
the bf16 forward against the reference of its own weights). The floor is the 4-bit forward's: the bytes of the
experts hit (at the format's bits per value, scales included as the checkpoint stores them) and of the activations, over the measured copy
bandwidth (``python -m fmoe2.bench``'s ceilings). The weights are random (quantized from random bf16 weights, one
expert at a time), never zero.
"""
from __future__ import annotations

import argparse
import math
import os
from typing import Dict, List

import torch

import fmoe2
from .. import int8, quant4
from ..gemm.config import ConfigMode, ConfigProblem, device_config_name, fit_packed_config, resolve_config
from ..shapes import ALL_SHAPES as SHAPES
from ..target import target_of
from .ceilings import floor_us, measure_ceilings, stage_times
from .problems import rel_err
from .search import final_round, fmoe2_candidates, search
from .provenance import provenance_line, run_record, write_result
from .timing import time_graphs_in_turns
from .vllm_style import vllm_default_config, vllm_style_fused_experts

FORMATS = {"mxfp4": dict(group=quant4.MXFP4_GROUP), "int4": dict(group=128), "int8": dict(group=None),
           "int8-g128": dict(group=128)}
TOLERANCE = 2.5e-2  # bf16 activations: the 16-bit bound of tests/helpers.py


def int4_group(H: int, I: int) -> int:
    """The int4 group of a shape: 128, or the largest of 64 and 32 that divides both K sizes (H and I) where 128
    does not (GPTQ-style checkpoints of such models use a group that divides K)."""
    for group in (128, 64, 32):
        if H % group == 0 and I % group == 0:
            return group
    raise ValueError(f"int4 needs H and I multiples of 32, got H={H}, I={I}")


def quantized_expertwise(fmt: str, w: torch.Tensor, group=None):
    """``(packed, scale, zero)`` of ``w [E, N, K]``, one expert at a time (a layer's float32 temporaries of the
    rounding would not fit); ``group``: int4's (None: :data:`FORMATS`')."""
    parts = []
    for e in range(w.shape[0]):
        if fmt == "mxfp4":
            parts.append((*quant4.quantize_mxfp4(w[e]), None))
        elif fmt.startswith("int8"):
            parts.append((*int8.quantize_int8(w[e], FORMATS[fmt]["group"]), None))
        else:
            parts.append(quant4.quantize_int4(w[e].half(), group or FORMATS[fmt]["group"]))
    return tuple(torch.stack([p[i] for p in parts]) if parts[0][i] is not None else None for i in range(3))


class Weights:
    """One shape's weights: bf16 plain, 4-bit prepared for fmoe2, 4-bit plain for the baseline."""

    def __init__(self, name: str, fmt: str, gen: torch.Generator):
        self.name, self.fmt = name, fmt
        self.E, self.H, self.I, self.topk = SHAPES[name]
        E, H, I = self.E, self.H, self.I
        w1 = (torch.randn(E, 2 * I, H, generator=gen) / math.sqrt(H)).to("cuda", torch.bfloat16)
        w2 = (torch.randn(E, H, I, generator=gen) / math.sqrt(I)).to("cuda", torch.bfloat16)
        self.bf16 = fmoe2.prepare_weights(w1, w2)
        group = int4_group(H, I) if fmt == "int4" else None
        (p1, s1, z1), (p2, s2, z2) = quantized_expertwise(fmt, w1, group), quantized_expertwise(fmt, w2, group)
        del w1, w2
        self.packed = fmoe2.prepare_weights(p1, p2, w1_scale=s1, w2_scale=s2, w1_zero=z1, w2_zero=z2,
                                            weight_format=fmt.split("-")[0])
        # The baseline's layout (4-bit): gate rows then up rows, unpadded, scales laid out like the packed rows.
        self.group = self.packed.group_size
        self.baseline = None
        stored = (p1, p2, s1, s2)
        if not fmt.startswith("int8"):
            self.baseline = stored = (p1, p2, self.packed_scales(s1, z1), self.packed_scales(s2, z2))
        self.bits_per_value = 8 * sum(t.numel() * t.element_size() for t in stored) / (3 * E * H * I)

    def packed_scales(self, scale, zero):
        if self.fmt == "mxfp4":
            return scale.contiguous()
        return torch.stack([scale, (zero if zero is not None else torch.full_like(scale, 8)).to(scale.dtype)],
                           dim=-1).contiguous()


def search_candidates(fmt: str, M: int, E: int, H: int, I: int, topk: int) -> list:
    """The tuner's grid at one point, fitted for format ``fmt`` (a key of :data:`FORMATS`) as ``fused_moe`` fits
    it, duplicates removed."""
    name = fmt.split("-")[0]
    return list(dict.fromkeys(fit_packed_config(c, weight_format=name)
                              for c in fmoe2_candidates(M, E, H, I, topk, torch.bfloat16, name)))


def searched(w: Weights, M: int, x, tw, ti, ref4) -> dict:
    """The fastest fitted config of the tuner's grid for the quantized forward at ``M`` (module docstring), checked
    against ``ref4``: ``{"config", "us", "rel_err", "tried"}``."""
    candidates = search_candidates(w.fmt, M, w.E, w.H, w.I, w.topk)
    out = torch.empty_like(x)
    run = lambda cfg: (lambda: fmoe2.fused_moe(x, w.packed, None, tw, ti, config=cfg, out=out))  # noqa: E731
    _, _, results = search(candidates, run, f"{w.name} {w.fmt} M={M}")
    best, us = final_round(results, run, f"{w.name} {w.fmt} M={M}")[0]  # (timed as the table's other columns)
    out.fill_(float("nan"))
    err = rel_err(run(best)().float(), ref4.float())
    return dict(config=best.to_dict(), us=us, rel_err=err, tried=len(results))


def untuned_pick(w: Weights, M: int, target=None, tuned_for=None):
    """The config the quantized forward of ``w`` at ``M`` picks without its format's tuned entry: the shape's 16-bit
    pick (passed as ``config=``, ``fused_moe`` fits it to the format). ``target``, ``tuned_for``: this GPU's."""
    problem = ConfigProblem(M, w.E, w.H, w.I, w.topk, torch.bfloat16)
    return resolve_config(problem, ConfigMode(), target or target_of(), tuned_for=tuned_for or device_config_name())


def bench_point(w: Weights, M: int, rounds: int, ceilings: dict, gen: torch.Generator, search_configs: bool = False,
                launches: bool = False, untuned: bool = False) -> dict:
    x = torch.randn(M, w.H, generator=gen).to("cuda", torch.bfloat16)
    scores = torch.randn(M, w.E, generator=gen).softmax(-1)
    tw, ti = torch.topk(scores, w.topk, dim=-1)
    tw, ti = tw.cuda(), ti.to("cuda", torch.int32)
    out = torch.empty_like(x)
    cfg = vllm_default_config(M, w.E)
    variants = {
        "bf16": lambda: fmoe2.fused_moe(x, w.bf16, None, tw, ti, out=out),
        w.fmt: lambda: fmoe2.fused_moe(x, w.packed, None, tw, ti, out=out),
    }
    if untuned:
        variants["untuned"] = lambda cfg=untuned_pick(w, M): fmoe2.fused_moe(x, w.packed, None, tw, ti, config=cfg,
                                                                             out=out)
    if w.baseline is not None:
        p1, p2, s1, s2 = w.baseline
        variants["vllm-w4a16"] = lambda: vllm_style_fused_experts(x, p1, p2, tw, ti, cfg, cfg, w1_group_scale=s1,
                                                                  w2_group_scale=s2, group=w.group)
    ref4 = fmoe2.fused_moe_reference(x, w.packed, None, tw, ti)
    ref16 = fmoe2.fused_moe_reference(x, w.bf16, None, tw, ti)
    errors, failed = {}, []
    for label, fn in variants.items():
        out.fill_(float("nan"))
        got = fn().float()
        ref = ref16 if label == "bf16" else ref4
        errors[label] = rel_err(got, ref.float())
        if not errors[label] <= TOLERANCE:
            failed.append(label)
            print(f"FAILED {w.name} M={M} {label}: relative error {errors[label]:.2e}", flush=True)
    heavy = M * w.topk * w.H * w.I > 2 ** 36
    times = time_graphs_in_turns({k: v for k, v in variants.items() if k not in failed}, rounds,
                                 3 if heavy else 10, 6 if heavy else 15)
    times.update({k: float("nan") for k in failed + ["vllm-w4a16"] if k not in times})
    hit = int(torch.unique(ti).numel())
    floor = floor_us(hit * 3 * w.H * w.I * w.bits_per_value / 8 + 2 * M * w.H * 2, 2 * M * w.topk * 3 * w.H * w.I,
                     ceilings)
    row = dict(shape=w.name, format=w.fmt, group=w.group, E=w.E, H=w.H, I=w.I, topk=w.topk, M=M, experts_hit=hit,
               bits_per_value=w.bits_per_value, floor_us=floor, us=times, rel_err=errors, failed=failed,
               vllm_config=cfg.__dict__)
    if launches:
        row["launches"] = {label: stage_times(x, weights, tw, ti, None, out)
                           for label, weights in (("bf16", w.bf16), (w.fmt, w.packed))}
        print(f"{w.name:14s} {w.fmt:5s} M={M:5d}  launches alone (us): "
              + "; ".join(f"{label} " + ", ".join(f"{k} {v:.1f}" for k, v in t.items())
                          for label, t in row["launches"].items()), flush=True)
    if search_configs:
        row["searched"] = searched(w, M, x, tw, ti, ref4)
        s = row["searched"]
        print(f"{w.name:14s} {w.fmt:5s} M={M:5d}  searched {s['us']:8.1f} (x{times['bf16'] / s['us']:.2f} of bf16, "
              f"error {s['rel_err']:.1e}, {s['tried']} configs) {s['config']}", flush=True)
    print(f"{w.name:14s} {w.fmt:5s} M={M:5d}  bf16 {times['bf16']:8.1f}  {w.fmt} {times[w.fmt]:8.1f} "
          f"(x{times['bf16'] / times[w.fmt]:.2f} of bf16, {floor / times[w.fmt]:.0%} of floor {floor:.1f})  "
          f"vllm-w4a16 {times['vllm-w4a16']:8.1f} (x{times['vllm-w4a16'] / times[w.fmt]:.2f})", flush=True)
    return row


def _format_label(row: dict) -> str:
    """The table's name of a row's format: int4 with its group (which depends on the shape: :func:`int4_group`)."""
    return f"int4-g{row['group']}" if row["format"] == "int4" and row.get("group") else row["format"]


def markdown(result: dict) -> str:
    lines = [f"# Weight-only quantized expert weights against bf16 ({result['device']})", "", provenance_line(result),
             "", "Times in us per forward (CUDA graphs, median); `x bf16`: the bf16 forward's time over the quantized "
             "one's; `floor`: quantized weight bytes of the experts hit plus activations over the copy bandwidth "
             f"({result['ceilings']['copy_bytes_per_s'] / 1e12:.2f} TB/s measured).", "",
             "| shape | format | M | bf16 | quantized | x bf16 | floor | % of floor | vllm-w4a16 | x vllm-w4a16 | "
             "rel err |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        us, f = r["us"], r["format"]
        lines.append(f"| {r['shape']} | {_format_label(r)} | {r['M']} | {us['bf16']:.1f} | {us[f]:.1f} | "
                     f"{us['bf16'] / us[f]:.2f} | "
                     f"{r['floor_us']:.1f} | {r['floor_us'] / us[f]:.0%} | {us['vllm-w4a16']:.1f} | "
                     f"{us['vllm-w4a16'] / us[f]:.2f} | {r['rel_err'][f]:.1e} |")
    rows = [r for r in result["rows"] if "untuned" in r["us"]]
    if rows:
        lines += ["", "`--untuned`: the quantized forward with the pick it makes without the format's tuned entry, "
                  "same run (us).", "", "| shape | format | M | quantized | untuned pick | untuned / quantized | "
                  "rel err untuned |", "|---|---|---|---|---|---|---|"]
        for r in rows:
            us = r["us"]
            lines.append(f"| {r['shape']} | {_format_label(r)} | {r['M']} | {us[r['format']]:.1f} | "
                         f"{us['untuned']:.1f} | {us['untuned'] / us[r['format']]:.2f} | "
                         f"{r['rel_err']['untuned']:.1e} |")
    rows = [r for r in result["rows"] if "launches" in r]
    if rows:
        lines += ["", "`--launches`: each launch of the forward alone in its own graph (us): bf16, then the quantized "
                  "weights.", "", "| shape | format | M | bf16 launches | quantized launches |", "|---|---|---|---|---|"]
        for r in rows:
            cells = [", ".join(f"{k} {v:.1f}" for k, v in r["launches"][label].items())
                     for label in ("bf16", r["format"])]
            lines.append(f"| {r['shape']} | {_format_label(r)} | {r['M']} | {cells[0]} | {cells[1]} |")
    rows = [r for r in result["rows"] if "searched" in r]
    if rows:
        lines += ["", "`--search`: the fastest fitted config of the tuner's grid for the quantized forward (checked "
                  "against the reference), and its speed over the bf16 forward's time above.", "",
                  "| shape | format | M | searched | x bf16 | % of floor | rel err | configs | config |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for r in rows:
            s, c = r["searched"], r["searched"]["config"]
            tiles = (f"{c.get('path')} {c['BLOCK_M']}x{c['BLOCK_N']}x{c['BLOCK_K']} h{c.get('BLOCK_H')}, "
                     f"{c['num_warps']}w{c['num_stages']}s")
            lines.append(f"| {r['shape']} | {_format_label(r)} | {r['M']} | {s['us']:.1f} | "
                         f"{r['us']['bf16'] / s['us']:.2f} | "
                         f"{r['floor_us'] / s['us']:.0%} | {s['rel_err']:.1e} | {s['tried']} | {tiles} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fmoe2.bench.quant4", description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="gpt-oss-120b,gpt-oss-20b", help="comma-separated names of fmoe2.shapes")
    parser.add_argument("--format", default="mxfp4", choices=sorted(FORMATS))
    parser.add_argument("--m", default="1,16,128,1024,4096", help="comma-separated batch sizes")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of the variants' turns")
    parser.add_argument("--out", default=None, help="result file (.json; a .md report beside it)")
    parser.add_argument("--untuned", action="store_true",
                        help="also time the quantized forward with its pick without the format's tuned entry")
    parser.add_argument("--launches", action="store_true",
                        help="also time each launch of the bf16 and the quantized forward alone")
    parser.add_argument("--search", action="store_true",
                        help="also time the quantized forward at every fitted config of the tuner's grid")
    a = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("the benchmark needs a GPU")
    names = a.shapes.split(",")
    for name in names:
        if name not in SHAPES:
            parser.error(f"unknown shape {name!r}; known: {sorted(SHAPES)}")
    ms = [int(m) for m in a.m.split(",")]
    record = run_record("python -m fmoe2.bench.quant4", argv)
    ceilings = measure_ceilings()
    gen = torch.Generator().manual_seed(0)
    rows: List[Dict] = []
    out = a.out or os.path.join("misc", "bench", "quant4",
                                f"{record['device'].replace(' ', '_')}-{a.format}.json")
    for name in names:
        weights = Weights(name, a.format, gen)
        for M in ms:
            rows.append(bench_point(weights, M, a.rounds, ceilings, gen, a.search, a.launches, a.untuned))
            report = write_result(out, dict(record, ceilings=ceilings, rows=rows), markdown)  # (kept if cut short)
        del weights
        torch.cuda.empty_cache()
    print(report)
    return 1 if any(r["failed"] for r in rows) else 0


if __name__ == "__main__":
    raise SystemExit(main())
