"""Leave-one-shape-out check of the default rules: ``python -m fmoe2.bench.loso --report FILE.json``.

    python -m fmoe2.bench.defaults --loso --shapes all --compile-workers 12     (on the GPU: the data)
    python -m fmoe2.bench.loso --report misc/bench/defaults/<device>__bf16_uniform_loso.json    (the refit, anywhere)
    python -m fmoe2.bench.loso --report part1.json part2.json --out all.json     (runs of parts of the shapes, merged)

The default rules (``configs/defaults.json``) give one config per range of rows per expert (``M * topk / E``), and
were chosen by hand on every tuned shape, so the defaults benchmark cannot say how they do on a shape they were not
chosen on. This module refits them without each shape in turn and times the refit on the shape held out.

The data: ``python -m fmoe2.bench.defaults --loso`` times, at every point (shape, M), besides its usual variants,
each candidate a rule could take in that point's range, fitted to the point as ``fused_moe`` fits a caller's
config: the tuned entries (this GPU's tuned files of the shapes ``--loso-shapes`` names, by default the run's) at the
batch sizes in the same range (``tuned:<shape>@<M>``), and vLLM's default tiles on both paths
(``vllm-tiles/<path>``), which come from no shape. The fit, for a held-out shape S and a range: among the candidates
that do not come from S's model (a tensor-parallel slice is held out with the model's other slices, which often share
its tuned configs), the one with the lowest geometric mean of its time over the tuned entry's time (``auto``) at the
other models' points in that range. The report gives, at each of S's points, the refit rule's time over S's tuned
entry (issue 56's bar: within 1.10x at every held-out point), beside the shipped rules' (``defaults``, chosen with
S among the shapes). Only shapes with a tuned file take part (elsewhere ``auto`` is the rules themselves).

The same fit on every shape is the rule each range would take from the data: the report lists it, as a proposal for
``defaults.json``; ``--write-rules DIR`` writes fmoe2's ``defaults.json`` with those rules to DIR, which
``python -m fmoe2.bench.defaults --compare-defaults DIR`` then times against the shipped rules in one run.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
from statistics import geometric_mean
from typing import Callable, Collection, Dict, List, Optional

from fmoe2.gemm.config import (CONFIG_DIR, ConfigMode, ConfigProblem, FusedMoEConfig, PATHS, resolve_config,
                               shape_file_name)
from fmoe2.shapes import ALL_SHAPES

TUNED_PREFIX = "tuned:"
BAR = 1.10  # issue 56: the default rules within 1.10x of the tuned entry at every held-out point


def rule_range(bounds: List[float], tokens_per_expert: float) -> int:
    """Index of the range (of the default rules' ``max_tokens_per_expert`` bounds, the last open) holding
    ``tokens_per_expert``."""
    return next((i for i, b in enumerate(bounds) if tokens_per_expert <= b), len(bounds) - 1)


def tuned_entries(names: List[str], device: str, dtype, config_dir: str = CONFIG_DIR) -> Dict[str, dict]:
    """``tuned:<shape>@<M>`` -> ``{"shape", "M", "tokens_per_expert", "config"}`` for every plain batch size of the
    tuned files of ``names`` for ``device`` (shapes without a file give none)."""
    out = {}
    for name in names:
        E, H, I, topk = ALL_SHAPES[name]
        file = os.path.join(config_dir, device, shape_file_name(E, H, I, topk, dtype))
        if not os.path.exists(file):
            continue
        with open(file) as f:
            tuned = json.load(f)
        for m, cfg in tuned.items():
            if m.isdigit():
                out[f"{TUNED_PREFIX}{name}@{m}"] = dict(shape=name, M=int(m), tokens_per_expert=int(m) * topk / E,
                                                        config=cfg)
    return out


def loso_candidates(problem: ConfigProblem, mode: ConfigMode, target, entries: Dict[str, dict], bounds: List[float],
                    vllm_tiles: FusedMoEConfig) -> Dict[str, FusedMoEConfig]:
    """label -> the config fitted to ``problem``: the ``entries`` (:func:`tuned_entries`) whose batch size falls in
    the same range of rows per expert as ``problem``, on their own path, and ``vllm_tiles`` on both paths."""
    here = rule_range(bounds, problem.M * problem.topk / problem.E)
    out = {}
    for label, entry in entries.items():
        if rule_range(bounds, entry["tokens_per_expert"]) == here:
            cfg = FusedMoEConfig.from_dict(entry["config"])
            out[label] = resolve_config(problem, mode, target, cfg, path=cfg.path)
    for path in PATHS:
        out[f"vllm-tiles/{path}"] = resolve_config(problem, mode, target, vllm_tiles, path=path)
    return out


def _time(row: dict, label: str) -> Optional[float]:
    """The point's time of ``label`` (a candidate that fitted to the same config as another was timed once, under
    the other's label: ``row["same_as"]``); None where it was not timed or failed."""
    label = row.get("same_as", {}).get(label, label)
    t = row["us"].get(label)
    return t if t is not None and math.isfinite(t) and label not in row.get("failed", ()) else None


def model_of(shape: str) -> str:
    """The model a shape is a slice of: a tensor-parallel slice (``qwen3-235b-a22b-tp4``) is held out with its model's
    other slices, whose tuned entries are often the same configs."""
    return shape.split("-tp")[0]


def _from_model(label: str) -> Optional[str]:
    return model_of(label[len(TUNED_PREFIX):].rsplit("@", 1)[0]) if label.startswith(TUNED_PREFIX) else None


def fit_range(rows: List[dict], hold_out: Optional[str], score: Callable[[List[float]], float] = geometric_mean,
              from_no_model: Collection[str] = ()) -> Optional[tuple]:
    """(label, ``score`` of its times over ``auto``'s) of the best candidate over ``rows`` (one range's points; the
    points of the model ``hold_out``, every slice of it, left out, as are candidates from it but those named in
    ``from_no_model``, which misc/bench/defaults/loso_simulations.py uses); None without a candidate timed at every
    such point."""
    train = [r for r in rows if model_of(r["shape"]) != hold_out and _time(r, "auto")]
    if not train:
        return None
    labels = set(train[0]["candidates"])
    for r in train[1:]:
        labels &= set(r["candidates"])
    best = None
    for label in sorted(labels):
        if hold_out is not None and label not in from_no_model and _from_model(label) == hold_out:
            continue
        times = [(_time(r, label), _time(r, "auto")) for r in train]
        if any(t is None for t, _ in times):
            continue
        value = score([t / a for t, a in times])
        if best is None or value < best[1]:
            best = (label, value)
    return best


def _rows(result: dict) -> List[dict]:
    """The rows the refit reads: those with LOSO candidates (a run with ``--loso``) of shapes with a tuned file (only
    there is ``auto`` a tuned entry)."""
    tuned = set(result.get("tuned_shapes", ()))
    return [r for r in result["results"] if r.get("candidates") and r["shape"] in tuned]


def loso(result: dict) -> List[dict]:
    """Per held-out shape and point: the refit rule's label (fitted without the shape's model, every slice of it)
    and its time over the tuned entry's, and the shipped rules' (``defaults``) over it; ``own_over_tuned``: the
    shape's own tuned entry timed again as a candidate (the config ``auto`` runs, under another label) over
    ``auto``'s time, the spread of the point's timing (None where it was not a candidate)."""
    rows = _rows(result)
    bounds = result["rule_bounds"]
    by_range: Dict[int, List[dict]] = {}
    for r in rows:
        by_range.setdefault(rule_range(bounds, r["tokens_per_expert"]), []).append(r)
    out = []
    for shape in dict.fromkeys(r["shape"] for r in rows):
        for r in (r for r in rows if r["shape"] == shape):
            auto = _time(r, "auto")
            fit = fit_range(by_range[rule_range(bounds, r["tokens_per_expert"])], model_of(shape))
            t = _time(r, fit[0]) if fit else None
            own_label = f"{TUNED_PREFIX}{shape}@{r['M']}"
            own = _time(r, own_label) if own_label in r["candidates"] else None
            out.append(dict(shape=shape, M=r["M"], tokens_per_expert=r["tokens_per_expert"], auto_us=auto,
                            refit=fit[0] if fit else None, refit_us=t,
                            refit_over_tuned=t / auto if t and auto else None,
                            own_over_tuned=own / auto if own and auto else None,
                            defaults_over_tuned=_time(r, "defaults") / auto if _time(r, "defaults") and auto
                            else None))
    return out


def proposal(result: dict) -> List[dict]:
    """Per range of rows per expert: the candidate the fit on every shape picks (no shape held out), with the config
    a rule would take: a tuned entry as its file holds it (``loso_entries``), vLLM's tiles as fitted at the range's
    first point (they vary with M)."""
    rows = _rows(result)
    bounds = result["rule_bounds"]
    raw = result.get("loso_entries", {})
    out = []
    for i, bound in enumerate(bounds):
        in_range = [r for r in rows if rule_range(bounds, r["tokens_per_expert"]) == i]
        fit = fit_range(in_range, None) if in_range else None
        if fit:
            label = fit[0]
            config = raw[label]["config"] if label in raw else next(
                r["candidate_configs"][label] for r in in_range if label in r.get("candidate_configs", {}))
            out.append(dict(range=i, max_tokens_per_expert=bound, label=label, geomean_over_tuned=fit[1],
                            points=len(in_range), config=config))
    return out


def proposed_defaults(result: dict, shipped: dict) -> dict:
    """``shipped`` (a ``defaults.json``) with the rules of the run's backend (``result["rules_key"]``) replaced by
    :func:`proposal`'s: each range's config with the range's bound (and the shipped rule's
    ``min_fused_programs_per_sm`` where it has one: a fused proposal then still takes two stages on grids too small
    for it, which the LOSO timings, each candidate on its own path, did not apply; ``--compare-defaults`` times the
    rules as written); a range without a fit keeps its shipped rule. The source run is named under
    ``"_proposed_by"``. Raises ``ValueError`` where the run's ranges are not ``shipped``'s (rules changed since)."""
    if "rules_key" not in result:
        raise ValueError("the result does not say which list of defaults.json its rules are (rules_key): rerun "
                         "`python -m fmoe2.bench.defaults --loso`")
    key = result["rules_key"]
    rules = [dict(rule) for rule in shipped[key]]
    if [rule["max_tokens_per_expert"] for rule in rules] != result["rule_bounds"]:
        raise ValueError(f"the run's ranges {result['rule_bounds']} are not those of defaults.json's {key!r} rules "
                         f"{[rule['max_tokens_per_expert'] for rule in rules]}: the rules changed since the run")
    for p in proposal(result):
        kept = {k: rules[p["range"]][k] for k in ("min_fused_programs_per_sm",) if k in rules[p["range"]]}
        rules[p["range"]] = dict(p["config"], max_tokens_per_expert=p["max_tokens_per_expert"], **kept)
    runs = result.get("runs", [dict(command=result["command"], date=result["date"])])
    return dict(shipped, **{key: rules, "_proposed_by": "python -m fmoe2.bench.loso (proposal) from " +
                            "; ".join(f"{run['command']} ({run['date']})" for run in runs)})


def markdown(result: dict) -> str:
    held = loso(result)
    lines = [f"# Leave-one-shape-out: the default rules refit without each shape ({result['device']}, "
             f"{result['dtype']}, {result['routing']} routing)", "",
             "From " + "; ".join(f"`{run['command']}` ({run['date']})" for run in result.get(
                 "runs", [dict(command=result["command"], date=result["date"])]))
             + f" (torch {result.get('torch')}, Triton {result.get('triton')}). "
             "Each shape's rules are refit on the other models' shapes alone (`fmoe2/bench/loso.py`: per range of rows "
             "per expert, the candidate, from the other models' tuned entries and vLLM's tiles, with the lowest "
             "geometric mean of its time over the tuned entry's; a tensor-parallel slice is held out with its model's "
             "other slices), then timed on the held-out shape in the same run. "
             f"Ratios: time over the shape's tuned entry (`auto`); the bar is {BAR:.2f}x. `defaults`: the shipped "
             "rules, chosen with every shape. `own again`: the tuned entry's config timed again as a candidate, "
             "the same config under another label: how far apart one config's times come in this run.", "",
             "| held-out shape | M | rows/expert | tuned (us) | refit rule | refit / tuned | defaults / tuned | "
             "own again / tuned |",
             "|---|---|---|---|---|---|---|---|"]
    fmt = lambda v: f"{v:.2f}" if v is not None else "-"  # noqa: E731
    for h in held:
        mark = " **over**" if h["refit_over_tuned"] is not None and h["refit_over_tuned"] > BAR else ""
        lines.append(f"| {h['shape']} | {h['M']} | {h['tokens_per_expert']:g} | "
                     f"{h['auto_us']:.1f} | {h['refit'] or '-'} | {fmt(h['refit_over_tuned'])}{mark} | "
                     f"{fmt(h['defaults_over_tuned'])} | {fmt(h['own_over_tuned'])} |" if h["auto_us"] else
                     f"| {h['shape']} | {h['M']} | {h['tokens_per_expert']:g} | - | - | - | - | - |")
    worst = [h for h in held if h["refit_over_tuned"] is not None]
    if worst:
        over = [h for h in worst if h["refit_over_tuned"] > BAR]
        top = max(worst, key=lambda h: h["refit_over_tuned"])
        lines += ["", f"Worst held-out point: {top['shape']} M={top['M']}, {top['refit_over_tuned']:.2f}x; "
                  f"{len(over)} of {len(worst)} points over {BAR:.2f}x."]
        again = [h["own_over_tuned"] for h in held if h["own_over_tuned"] is not None]
        if again:
            lines.append(f"The tuned entries timed again as candidates: {min(again):.2f}-{max(again):.2f}x their "
                         f"`auto` time ({sum(abs(a - 1) > 0.03 for a in again)} of {len(again)} more than 3% "
                         "apart).")
    lines += ["", "The rules the fit on every shape picks (a proposal, not shipped):", "",
              "| rows per expert up to | candidate | geomean over tuned | points |", "|---|---|---|---|"]
    for p in proposal(result):
        lines.append(f"| {p['max_tokens_per_expert']:g} | {p['label']} | {p['geomean_over_tuned']:.3f} | "
                     f"{p['points']} |")
    return "\n".join(lines) + "\n"


def refit_report_path(result_path: str) -> str:
    """Where the LOSO report of a result file goes: beside it, ``<name>_refit.md``."""
    return result_path[:-len(".json")] + "_refit.md"


def write_report(result_path: str, result: dict) -> str:
    path = refit_report_path(result_path)
    with open(path, "w") as f:
        f.write(markdown(result))
    return path


def merged(results: List[dict]) -> dict:
    """Runs of ``python -m fmoe2.bench.defaults --loso`` over parts of one set of shapes (e.g. one GPU each, each
    with ``--loso-shapes`` naming them all) as one result: the first run's record, every run's rows, and each run's
    command and date under ``"runs"``. They must share the device, dtype, routing and rule ranges."""
    head = results[0]
    for other in results[1:]:
        for key in ("device", "dtype", "routing", "rule_bounds", "rules_key", "loso_entries"):
            if other.get(key) != head.get(key):
                raise ValueError(f"the runs differ in {key} (each part must draw its candidates from the same "
                                 f"shapes' tuned entries: --loso-shapes)" if key == "loso_entries" else
                                 f"the runs differ in {key}: {head.get(key)!r} and {other.get(key)!r}")
    points = [(row["shape"], row["M"]) for r in results for row in r["results"]]
    twice = sorted({p for p in points if points.count(p) > 1})
    if twice:
        raise ValueError(f"points in more than one run: {twice}")
    runs = [run for r in results for run in r.get("runs", [dict(command=r["command"], date=r["date"])])]
    tuned = list(dict.fromkeys(name for r in results for name in r.get("tuned_shapes", [])))
    return dict(head, runs=runs, tuned_shapes=tuned, results=[row for r in results for row in r["results"]])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m fmoe2.bench.loso", description=__doc__.split("\n\n")[0])
    p.add_argument("--report", required=True, nargs="+", metavar="JSON",
                   help="results of `python -m fmoe2.bench.defaults --loso`; one: its LOSO report beside it")
    p.add_argument("--out", default=None, metavar="JSON",
                   help="with several results: where their merged result goes (its LOSO report beside it)")
    p.add_argument("--write-rules", default=None, metavar="DIR",
                   help="also write DIR/defaults.json: fmoe2's with the proposed rules of the run's backend, for "
                        "`python -m fmoe2.bench.defaults --compare-defaults DIR` to time against the shipped ones")
    a = p.parse_args(argv)
    if len(a.report) > 1 and not a.out:
        p.error("several results need --out (their merged result file)")
    results = []
    for path in a.report:
        with open(path) as f:
            results.append(json.load(f))
        if not any(r.get("candidates") for r in results[-1]["results"]):
            p.error(f"{path} has no LOSO candidates: run `python -m fmoe2.bench.defaults --loso`")
    result, path = (results[0], a.out or a.report[0]) if len(results) == 1 else (merged(results), a.out)
    if path != a.report[0]:
        with open(path, "w") as f:
            json.dump(result, f, indent=1)
    print(f"wrote {write_report(path, result)}")
    if a.write_rules:
        with open(os.path.join(CONFIG_DIR, "defaults.json")) as f:
            shipped = json.load(f)
        try:
            proposed = proposed_defaults(result, shipped)
        except ValueError as error:
            p.error(str(error))
        os.makedirs(a.write_rules, exist_ok=True)
        rules_path = os.path.join(a.write_rules, "defaults.json")
        with open(rules_path, "w") as f:
            json.dump(proposed, f, indent=1)
        print(f"wrote {rules_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
