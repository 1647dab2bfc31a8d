"""Refits of the default rules simulated on the committed leave-one-shape-out runs (no GPU): which changes to the
refit would meet issue 56's bar (within 1.10x of the tuned entry at every held-out point). Usage, from the repository
root: python misc/bench/defaults/loso_simulations.py (output of 2026-11-30: loso_simulations_2026-11-30.txt;
docs/configs.md, leave-one-shape-out). Each variant refits every held-out model's points from the other models' points
and candidates (fmoe2/bench/loso.py's rules otherwise) and prints the geometric mean and worst of the refit's time
over the tuned entry's, and the points over the bar."""
import json
from statistics import geometric_mean

from fmoe2.bench import loso as L

RUNS = {"2026-11-30 (captured every round)": "misc/bench/defaults/NVIDIA_H200__bf16_uniform_loso.json",
        "2026-11-29 (captured once)": "misc/bench/defaults/NVIDIA_H200__bf16_uniform_loso_captured_once.json",
        "2026-11-29 (one turn order)": "misc/bench/defaults/NVIDIA_H200__bf16_uniform_loso_one_order.json"}
AS_IF_FROM_NO_MODEL = {"tuned:qwen3-235b-a22b-tp4@1", "tuned:qwen3-235b-a22b-tp8@4096"}


SCORES = {"geomean": geometric_mean, "worst": max,
          "90th percentile": lambda x: sorted(x)[int(0.9 * (len(x) - 1))]}
BUCKETS = {"none": lambda r: 0, "I <= 512": lambda r: r["I"] <= 512, "I <= 1024": lambda r: r["I"] <= 1024,
           "H <= 4096": lambda r: r["H"] <= 4096, "E >= 128": lambda r: r["E"] >= 128,
           "2I/H < 0.2": lambda r: 2 * r["I"] / r["H"] < 0.2, "top-8": lambda r: r["topk"] == 8}


def simulate(result, bounds, score="geomean", bucket="none", from_no_model=()):
    rows = L._rows(result)
    key = BUCKETS[bucket]
    ratios, over = [], []
    for r in rows:
        here = L.rule_range(bounds, r["tokens_per_expert"])
        in_range = [x for x in rows if L.rule_range(bounds, x["tokens_per_expert"]) == here]
        held = L.model_of(r["shape"])
        picked = L.fit_range([x for x in in_range if key(x) == key(r)], held, SCORES[score], from_no_model)
        if picked is None or L._time(r, picked[0]) is None:  # (no other model in the bucket: the range's fit)
            picked = L.fit_range(in_range, held, SCORES[score], from_no_model)
        ratio = L._time(r, picked[0]) / L._time(r, "auto")
        ratios.append(ratio)
        if ratio > L.BAR:
            over.append(f"{r['shape']} M={r['M']} {ratio:.3f} ({picked[0]})")
    geomean = geometric_mean(ratios)
    listed = (": " + "; ".join(over)) if over else ""
    return f"geomean {geomean:.3f}, worst {max(ratios):.3f}, {len(over)} over{listed}"


def main():
    results = {}
    for name, path in RUNS.items():
        with open(path) as f:
            results[name] = json.load(f)
    for name, result in results.items():
        bounds = result["rule_bounds"]
        print(f"== {name}: {RUNS[name]}")
        print(f"  as shipped (geomean, the rules' ranges): {simulate(result, bounds)}")
        for score in ("worst", "90th percentile"):
            print(f"  fit by {score}: {simulate(result, bounds, score=score)}")
        for extra in ([0.25], [0.13], [0.07, 0.25], [0.25, 1]):
            split = sorted(set(bounds) | set(extra))
            print(f"  ranges split at {extra}: {simulate(result, split)}")
        for bucket in BUCKETS:
            if bucket != "none":
                print(f"  second dimension {bucket}: {simulate(result, bounds, bucket=bucket)}")
        for score in ("geomean", "worst"):
            print(f"  Qwen3-235B's TP4 M=1 and TP8 M=4096 configs as if from no model, fit by {score}: "
                  f"{simulate(result, bounds, score=score, from_no_model=AS_IF_FROM_NO_MODEL)}")


if __name__ == "__main__":
    main()
