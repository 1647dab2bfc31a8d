"""Benchmark report: JSON results -> markdown table and plots.

    python -m fmoe2.bench.report [misc/bench] [DEVICE_NAME] [--write-configs]

Reads ``<dir>/<device>__*.json`` (written by ``python -m fmoe2.bench``) and writes
``<dir>/<device>.md`` plus ``<dir>/../<device>_speedup.png`` and ``..._floor.png``. With
``--write-configs`` it also stores fmoe2's searched configs as tuned files under
``fmoe2/gemm/configs/<device>/`` (the benchmark's search is the tuner's search).
"""
from __future__ import annotations

import glob
import json
import math
import os
import sys


def _load(out_dir: str, device: str):
    runs = []
    for path in sorted(glob.glob(os.path.join(out_dir, f"{device}__*.json"))):
        with open(path) as f:
            runs.append(json.load(f))
    return runs


def merge_results(old: dict, new: dict) -> dict:
    """A partial rerun (``python -m fmoe2.bench --update``): ``new``'s rows replace ``old``'s rows of
    the same batch sizes, the other rows of ``old`` stay. Every row keeps the date of the run it comes
    from (``run_date``) and the file keeps the metadata of each earlier run that still has rows
    (``earlier_runs``): its date, command, versions and ceilings."""
    new_ms = {r["M"] for r in new["results"]}
    meta_keys = [k for k in old if k not in ("results", "earlier_runs")]
    kept = [dict(r, run_date=r.get("run_date", old["date"])) for r in old["results"] if r["M"] not in new_ms]
    rows = sorted(kept + [dict(r, run_date=new["date"]) for r in new["results"]], key=lambda r: r["M"])
    dates = {r["run_date"] for r in kept}
    earlier = [run for run in [{k: old[k] for k in meta_keys}] + old.get("earlier_runs", []) if run["date"] in dates]
    return {**{k: v for k, v in new.items() if k != "earlier_runs"}, "results": rows, "earlier_runs": earlier}


def _run_lines(runs) -> list:
    """One line per run (one command; a run may cover several shapes, a table several runs); a run
    that gave only some rows of a shape's file names their batch sizes."""
    by_run = {}
    for file in runs:
        rows = file["results"]
        for run in [file] + file.get("earlier_runs", []):
            shape = rows[0]["shape"] if rows else ""
            if file.get("earlier_runs"):
                shape += " M=" + ",".join(str(r["M"]) for r in rows if r.get("run_date", file["date"]) == run["date"])
            by_run.setdefault((run["date"], run["command"]), (run, []))[1].append(shape)
    return [f"  - {date}: `{command}` ({', '.join(shapes)}; copy {r['ceilings']['copy_bytes_per_s'] / 1e12:.2f} "
            f"TB/s, bf16 matmul {r['ceilings']['bf16_flops_per_s'] / 1e12:.0f} TFLOP/s; torch {r['torch']}, "
            f"Triton {r['triton']}{'; timing: ' + r['timing'] if r.get('timing') else ''})"
            for (date, command), (r, shapes) in sorted(by_run.items())]


def _us_or_dash(us) -> str:
    """A time in us, or "-" for a field a result file predates."""
    return "-" if us is None else f"{us:.1f}"


def _table(runs) -> str:
    lines = ["| shape | M | fmoe2 (us) | path | fused path only (us) | baseline (us) | speedup | fmoe2 / floor | "
             "sort (us) / budget | fmoe2 default config, no tuned file (us) | fused_moe's own pick (us) | "
             "rel. err fmoe2 / baseline |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    speedups = []
    for run in runs:
        for r in run["results"]:
            speedups.append(r["speedup"])
            # Opt-in features of the picked config: tensor-descriptor loads, programmatic dependent launch.
            opts = "".join(f" +{k}" for k in ("tma", "pdl") if r.get("fmoe2_config", {}).get(k))
            lines.append(f"| {r['shape']} | {r['M']} | {r['fmoe2_us']:.1f} | {r.get('fmoe2_path', 'fused')}{opts} | "
                         f"{r.get('fmoe2_fused_path_us', r['fmoe2_us']):.1f} | {r['baseline_us']:.1f} | "
                         f"{r['speedup']:.2f}x | {r['fraction_of_floor']:.0%} | {r['sort_us']:.1f} / "
                         f"{r['sort_budget_us']:.1f} | {r['fmoe2_default_config_us']:.1f} | "
                         f"{_us_or_dash(r.get('fmoe2_picked_us'))} | "
                         f"{r['fmoe2_rel_err']:.1e} / {r['baseline_rel_err']:.1e} |")
    geo = math.exp(sum(math.log(s) for s in speedups) / len(speedups)) if speedups else float("nan")
    lines.append(f"\nGeometric-mean speedup over {len(speedups)} points: **{geo:.2f}x**")
    return "\n".join(lines)


def _breakdown(runs) -> str:
    """Per-launch times (``stage_us``) of the points that have them, with each GEMM launch's share of
    the flops over its time, and the dense cuBLAS calibration (``dense_gemm_us``) where measured."""
    lines = ["| shape | M | path | sort (us) | fused or stage 1 (us, TFLOP/s) | stage 2 (us, TFLOP/s) | "
             "dense cuBLAS bmm (us, TFLOP/s) | fmoe2 / dense |", "|---|---|---|---|---|---|---|---|"]
    for run in runs:
        for r in run["results"]:
            st = r.get("stage_us")
            if not st:
                continue
            flops = r["flops"]
            if "stage1" in st:  # stage 1 does gate+up (2/3 of the flops), stage 2 the down GEMM
                first = f"{st['stage1']:.1f}, {flops * 2 / 3 / st['stage1'] / 1e6:.0f}"
                second = f"{st['stage2']:.1f}, {flops / 3 / st['stage2'] / 1e6:.0f}"
            else:
                first, second = f"{st['fused']:.1f}, {flops / st['fused'] / 1e6:.0f}", "-"
            dense = r.get("dense_gemm_us")
            dense_cells = (f"{dense:.1f}, {flops / dense / 1e6:.0f} | {r['fmoe2_us'] / dense:.2f}x" if dense
                           else "- | -")
            lines.append(f"| {r['shape']} | {r['M']} | {r.get('fmoe2_path', 'fused')} | {st['sort']:.1f} | {first} | "
                         f"{second} | {dense_cells} |")
    return "\n".join(lines) if len(lines) > 2 else ""


def _plots(runs, plot_dir: str, device: str):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    paths = []
    for key, ylabel, fname, ref in (("speedup", "speedup vs vLLM-style Triton path", "speedup", 1.0),
                                    ("fraction_of_floor", "fraction of floor (memory/compute)", "floor", None)):
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for run in runs:
            rs = run["results"]
            ax.plot([r["M"] for r in rs], [r[key] for r in rs], marker="o", label=rs[0]["shape"] if rs else "")
        if ref is not None:
            ax.axhline(ref, color="gray", linestyle="--", linewidth=1)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("tokens M")
        ax.set_ylabel(ylabel)
        ax.set_title(f"fmoe2 on {runs[0]['device']} (bf16)")
        ax.grid(True, alpha=0.3)
        ax.legend()
        path = os.path.join(plot_dir, f"{device}_{fname}.png")
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)
        paths.append(path)
    return paths


def write_report(out_dir: str, device: str, plot_dir: str = None) -> str:
    runs = _load(out_dir, device)
    if not runs:
        return f"no results for {device} in {out_dir}"
    plot_dir = plot_dir or os.path.dirname(os.path.abspath(out_dir))
    head = runs[0]
    md = [f"# fmoe2 benchmark on {head['device']}", "",
          "- runs (date, command, shape, ceilings measured in the same run, versions):", *_run_lines(runs),
          "- timing: 10 calls per CUDA graph, CUDA events, median of 50 replays, each variant on its own (a run that "
          "names its timing above: as it says); sort and zeroing inside fmoe2's time, alignment, activation and "
          "top-k sum inside the baseline's", "",
          _table(runs)]
    breakdown = _breakdown(runs)
    if breakdown:
        md += ["", "## Where the time goes", "",
               "Each launch of fmoe2's picked config timed alone (own graph); TFLOP/s = the launch's share of the "
               "flops over its time. Dense cuBLAS bmm: the same two GEMMs as batched dense products with the "
               "routed rows spread evenly over the experts (a calibration of what a GEMM library reaches at "
               "this size; no gather, padding, activation or atomics).", "", breakdown]
    md_path = os.path.join(out_dir, f"{device}.md")
    with open(md_path, "w") as f:
        f.write("\n".join(md) + "\n")
    plots = _plots(runs, plot_dir, device)
    return _table(runs) + "\n" + (breakdown + "\n" if breakdown else "") + f"wrote {md_path} " + " ".join(plots)


def write_tuned_configs(out_dir: str, device: str, config_dir: str):
    """fmoe2's best config per batch size, per shape, as the tuned files :func:`fmoe2.get_config` reads (a
    file's ``"deterministic"`` and ``"fp8"`` entries, from ``python -m fmoe2.tune --deterministic`` and
    ``--dtype fp8``, are kept, with their check records; each plain entry's record is the benchmark's check of it
    against the float32 reference)."""
    import torch

    from ..gemm.config import TUNED_SECTIONS, shape_file_name
    from .correctness import BOUND

    paths = []
    for run in _load(out_dir, device):
        rs = run["results"]
        if not rs:
            continue
        r0 = rs[0]
        path = os.path.join(config_dir, device, shape_file_name(r0["E"], r0["H"], r0["I"], r0["topk"], torch.bfloat16))
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tuned = {str(r["M"]): r["fmoe2_config"] for r in rs}
        # each entry's check (fmoe2.tune's record): the benchmark's run of the picked config against the float32
        # reference, which stops the run where it fails
        checked = {"plain": {str(r["M"]): dict(rel_err=r["fmoe2_rel_err"], bound=BOUND["bf16"], faster_failed=0, graph=False)
                             for r in rs}}
        if os.path.exists(path):  # the entries other tuners wrote stay (fmoe2.tune --deterministic, --dtype fp8,
            with open(path) as f:  # --weights F)
                old = json.load(f)
            tuned.update({section: old[section] for section in TUNED_SECTIONS if old.get(section)})
            checked.update({section: records for section, records in old.get("checked", {}).items()
                            if section in TUNED_SECTIONS})
        tuned["checked"] = checked
        with open(path, "w") as f:
            json.dump(tuned, f, indent=1)
            f.write("\n")
        paths.append(path)
    return paths


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    out_dir = args[0] if args else os.path.join("misc", "bench")
    if len(args) > 1:
        devices = [args[1]]
    else:
        devices = sorted({os.path.basename(p).split("__")[0] for p in glob.glob(os.path.join(out_dir, "*__*.json"))})
    for d in devices:
        print(write_report(out_dir, d))
        if "--write-configs" in sys.argv:
            from ..gemm.config import CONFIG_DIR

            print("\n".join(write_tuned_configs(out_dir, d, CONFIG_DIR)))
