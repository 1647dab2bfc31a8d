"""Leave-one-shape-out refit of the default rules (fmoe2/bench/loso.py): its candidates, the fit and its report (no
GPU); the defaults benchmark's --loso run end to end (GPU only)."""
import json
import math
from dataclasses import replace

import pytest
import torch

from fmoe2.bench.defaults import loso_aliases, rule_bounds
from fmoe2.bench.loso import fit_range, loso, loso_candidates, markdown, proposal, rule_range, tuned_entries
from fmoe2.bench.defaults import vllm_tiles
from fmoe2.gemm.config import ConfigMode, ConfigProblem, FusedMoEConfig, resolve_config
from fmoe2.shapes import ALL_SHAPES, SERVED_SHAPES
from fmoe2.target import NAMED_TARGETS


def test_candidates_are_the_tuned_entries_of_the_points_range_fitted_to_it():
    target = NAMED_TARGETS["sm_90"]
    bounds = rule_bounds(target)
    entries = tuned_entries(list(SERVED_SHAPES), "NVIDIA_H200", torch.bfloat16)
    assert len(entries) == 5 * len(SERVED_SHAPES)  # (every served shape has an H200 file of 5 batch sizes)
    assert entries["tuned:gpt-oss-20b@16"]["tokens_per_expert"] == 2.0
    for name, M in (("gpt-oss-20b", 1), ("mixtral-8x22b", 128), ("deepseek-v3", 4096), ("qwen3-30b-a3b", 40)):
        problem = ConfigProblem(M, *ALL_SHAPES[name], torch.bfloat16)
        here = rule_range(bounds, M * problem.topk / problem.E)
        candidates = loso_candidates(problem, ConfigMode(), target, entries, bounds, vllm_tiles(problem, False, target))
        tuned = [label for label in candidates if label.startswith("tuned:")]
        assert tuned and all(rule_range(bounds, entries[label]["tokens_per_expert"]) == here for label in tuned)
        assert len(tuned) == sum(rule_range(bounds, e["tokens_per_expert"]) == here for e in entries.values())
        assert {"vllm-tiles/fused", "vllm-tiles/two_stage"} <= set(candidates)
        for label, cfg in candidates.items():  # each as fused_moe runs it when passed it: fitting it again is a no-op
            assert resolve_config(problem, ConfigMode(), target, cfg, path=cfg.path) == cfg, (name, M, label)
            if label.startswith("tuned:"):
                assert cfg.path == FusedMoEConfig.from_dict(entries[label]["config"]).path


def test_rule_range():
    assert [rule_range([4, 12, 1e18], t) for t in (0.1, 4, 4.5, 12, 13, 1e20)] == [0, 0, 1, 1, 2, 2]


def test_a_candidate_fitting_to_an_earlier_variants_config_is_timed_under_its_label():
    a, b = (FusedMoEConfig(BLOCK_M=m, BLOCK_N=64, BLOCK_K=64, BLOCK_H=128) for m in (16, 32))
    variants = {"auto": (None, 0, None), "defaults": (None, 0, a), "tuned:x@1": (None, 0, b),
                "tuned:y@1": (None, 0, a), "tuned:z@16": (None, 0, b), "vllm-tiles/fused": (None, 0, replace(a, num_warps=8))}
    assert loso_aliases(variants) == {"tuned:y@1": "defaults", "tuned:z@16": "tuned:x@1"}


def _row(shape, M, tpe, us, failed=(), same_as=None):
    candidates = sorted(k for k in list(us) + list(same_as or {}) if k.startswith(("tuned:", "vllm-tiles/")))
    return dict(shape=shape, M=M, tokens_per_expert=tpe, us=us, failed=list(failed), same_as=same_as or {},
                candidates=candidates, candidate_configs={c: {"BLOCK_M": 16} for c in candidates})


def _result():
    # Range 0 (<= 4 rows per expert): shapes a, b, c. a's own entry is the best on every shape; b's is next.
    rows = [_row("a", 1, 0.5, {"auto": 10.0, "defaults": 11.0, "tuned:a@1": 10.0, "tuned:b@1": 10.5,
                               "tuned:c@1": 13.0, "vllm-tiles/fused": 14.0}),
            _row("b", 1, 0.5, {"auto": 20.0, "defaults": 21.0, "tuned:a@1": 19.0, "tuned:c@1": 30.0,
                               "vllm-tiles/fused": 25.0}, same_as={"tuned:b@1": "defaults"}),
            _row("c", 1, 0.5, {"auto": 30.0, "defaults": 36.0, "tuned:a@1": 30.0, "tuned:b@1": 33.0,
                               "tuned:c@1": 30.0, "vllm-tiles/fused": float("nan")}, failed=["vllm-tiles/fused"]),
            # Range 1: two shapes, each refit on the other alone: b's entry (1.0 at b, vLLM's tiles 1.075) runs 1.3x at a.
            _row("a", 128, 64.0, {"auto": 100.0, "defaults": 104.0, "tuned:a@128": 100.0, "tuned:b@128": 130.0,
                                  "vllm-tiles/fused": 115.0}),
            _row("b", 128, 64.0, {"auto": 200.0, "defaults": 230.0, "tuned:a@128": 190.0, "tuned:b@128": 210.0,
                                  "vllm-tiles/fused": 215.0})]
    entries = {f"tuned:{n}@{m}": dict(shape=n, M=m, tokens_per_expert=0.5 if m == 1 else 64.0, config={"BLOCK_M": m})
               for n in "abc" for m in (1, 128)}
    return dict(device="GPU", dtype="bf16", routing="uniform", date="today", torch="t", triton="tr", command="cmd",
                rule_bounds=[4, 1e18], tuned_shapes=["a", "b", "c"], loso_entries=entries, results=rows)


def test_the_refit_never_takes_the_held_out_shapes_entries():
    result = _result()
    rows0 = [r for r in result["results"] if r["M"] == 1]
    # Held out b: over a and c, a's entry has ratios 1.0 and 1.0 (c's vLLM tiles failed: out everywhere).
    assert fit_range(rows0, "b") == ("tuned:a@1", 1.0)
    label, score = fit_range(rows0, "a")  # a's own entry is out: b's (aliased to b's defaults at b) beats c's
    assert label == "tuned:b@1" and math.isclose(score, math.sqrt(1.05 * 1.1))
    held = {(h["shape"], h["M"]): h for h in loso(result)}
    assert held["a", 1]["refit"] == "tuned:b@1" and math.isclose(held["a", 1]["refit_over_tuned"], 1.05)
    assert held["b", 1]["refit"] == "tuned:a@1" and math.isclose(held["b", 1]["refit_over_tuned"], 0.95)
    assert held["c", 1]["defaults_over_tuned"] == pytest.approx(1.2)
    assert held["a", 128]["refit"] == "tuned:b@128" and held["a", 128]["refit_over_tuned"] == pytest.approx(1.3)
    assert held["b", 128]["refit"] == "tuned:a@128" and held["b", 128]["refit_over_tuned"] == pytest.approx(0.95)
    assert all(h["refit"] is None or not h["refit"].startswith(f"tuned:{h['shape']}@") for h in held.values())
    assert [(p["max_tokens_per_expert"], p["label"], p["config"]) for p in proposal(result)] == [
        (4, "tuned:a@1", {"BLOCK_M": 1}), (1e18, "tuned:a@128", {"BLOCK_M": 128})]  # (as the tuned files hold them)


def test_the_fit_takes_another_score_and_labels_as_if_from_no_model():
    # (misc/bench/defaults/loso_simulations.py's refits) Held out a: b's entry is best by the geometric mean
    # (1.05 and 1.1), by the worst ratio too; a's own entry, offered as if from no model, beats it (0.95 at b, 1.0
    # at c).
    rows0 = [r for r in _result()["results"] if r["M"] == 1]
    assert fit_range(rows0, "a", score=max) == ("tuned:b@1", pytest.approx(1.1))
    assert fit_range(rows0, "a", from_no_model={"tuned:a@1"}) == ("tuned:a@1", pytest.approx(math.sqrt(0.95 * 1.0)))


def test_only_shapes_with_a_tuned_file_take_part_and_a_models_slices_are_held_out_together():
    result = _result()
    assert {h["shape"] for h in loso(dict(result, tuned_shapes=["a", "b"]))} == {"a", "b"}
    # c as a tensor-parallel slice of a: held out with a, c's entries and points are out of a's refit and a's of c's
    for row in result["results"]:
        row["candidates"] = [c.replace("tuned:c@", "tuned:a-tp2@") for c in row["candidates"]]
        row["us"] = {k.replace("tuned:c@", "tuned:a-tp2@"): v for k, v in row["us"].items()}
        row["shape"] = row["shape"].replace("c", "a-tp2")
    held = {(h["shape"], h["M"]): h for h in loso(dict(result, tuned_shapes=["a", "b", "a-tp2"]))}
    assert held["a", 1]["refit"] == held["a-tp2", 1]["refit"] == "tuned:b@1"  # (b's points alone)
    assert held["b", 1]["refit"] == "tuned:a@1"


def test_report_names_the_points_over_the_bar():
    report = markdown(_result())
    assert "| a | 128 | 64 | 100.0 | tuned:b@128 | 1.30 **over** | 1.04 | 1.00 |" in report
    assert "| b | 1 | 0.5 | 20.0 | tuned:a@1 | 0.95 | 1.05 | 1.05 |" in report  # (b's entry: timed as defaults)
    assert "| b | 128 | 64 | 200.0 | tuned:a@128 | 0.95 | 1.15 | 1.05 |" in report
    assert "Worst held-out point: a M=128, 1.30x; 1 of 5 points over 1.10x." in report
    assert "timed again as candidates: 1.00-1.05x their `auto` time (2 of 5 more than 3% apart)" in report


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the benchmark needs a GPU")
def test_loso_run_of_two_shapes_with_compiling_processes(tmp_path):
    import subprocess
    import sys

    from fmoe2.gemm.config import device_config_name

    shapes = ["qwen3-30b-a3b", "deepseek-v2-lite"]
    if any(not tuned_entries([name], device_config_name(), torch.bfloat16) for name in shapes):
        pytest.skip("no tuned file of these shapes for this GPU")
    # (the compiling processes each time one shape, with both shapes' entries as candidates: --loso-shapes)
    command = [sys.executable, "-m", "fmoe2.bench.defaults", "--shapes", ",".join(shapes), "--m", "1", "--loso",
               "--compile-workers", "2", "--rounds", "1", "--out-dir", str(tmp_path)]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    [path] = [p for p in tmp_path.iterdir() if p.name.endswith("__bf16_uniform_loso.json")]
    result = json.loads(path.read_text())
    for r in result["results"]:  # both shapes' entries of the range among each point's candidates, each timed
        assert any(c.startswith("tuned:qwen3-30b-a3b@") for c in r["candidates"]), r["candidates"]
        assert any(c.startswith("tuned:deepseek-v2-lite@") for c in r["candidates"]), r["candidates"]
        assert not r["failed"] and all(r["us"][r["same_as"].get(c, c)] > 0 for c in r["candidates"]), r
    held = loso(result)
    assert len(held) == 2 and all(h["refit_over_tuned"] > 0 for h in held)
    assert all(not h["refit"].startswith(f"tuned:{h['shape']}@") for h in held)
    assert (tmp_path / path.name.replace(".json", "_refit.md")).exists()


def test_runs_of_parts_of_the_shapes_merge_into_one_refit(tmp_path):
    from fmoe2.bench.loso import main, merged

    whole = _result()
    parts = [dict(whole, command=f"part {i}", results=[r for r in whole["results"] if (r["shape"] == "a") == (i == 0)])
             for i in range(2)]
    for i, part in enumerate(parts):
        (tmp_path / f"p{i}.json").write_text(json.dumps(part))
    assert loso(merged(parts)) == loso(whole)
    with pytest.raises(ValueError, match="rule_bounds"):
        merged([parts[0], dict(parts[1], rule_bounds=[8, 1e18])])
    with pytest.raises(ValueError, match="--loso-shapes"):  # a part whose candidates came from other shapes
        merged([parts[0], dict(parts[1], loso_entries={})])
    with pytest.raises(ValueError, match=r"\('a', 1\)"):  # a point run twice
        merged([parts[0], parts[1], dict(parts[0], command="again")])
    assert main(["--report", str(tmp_path / "p0.json"), str(tmp_path / "p1.json"), "--out",
                 str(tmp_path / "all.json")]) == 0
    report = (tmp_path / "all_refit.md").read_text()
    assert "`part 0` (today); `part 1` (today)" in report and "| b | 1 | 0.5 | 20.0 | tuned:a@1 | 0.95 |" in report
    with pytest.raises(SystemExit):  # several results and nowhere to merge them
        main(["--report", str(tmp_path / "p0.json"), str(tmp_path / "p1.json")])


def test_the_proposed_rules_replace_the_runs_backends_list(tmp_path):
    from fmoe2.bench.loso import main, proposed_defaults

    shipped = {"_doc": "d", "cuda": [{"BLOCK_M": 16, "max_tokens_per_expert": 4, "min_fused_programs_per_sm": 0.4},
                                     {"BLOCK_M": 128, "max_tokens_per_expert": 1e18}], "hip": [{"BLOCK_M": 32}]}
    result = dict(_result(), rules_key="cuda")
    out = proposed_defaults(result, shipped)
    assert out["cuda"] == [{"BLOCK_M": 1, "max_tokens_per_expert": 4, "min_fused_programs_per_sm": 0.4},
                           {"BLOCK_M": 128, "max_tokens_per_expert": 1e18}]  # (tuned:a@1 and tuned:a@128's configs)
    assert out["hip"] == shipped["hip"] and out["_doc"] == "d" and "cmd (today)" in out["_proposed_by"]
    with pytest.raises(ValueError, match="rules_key"):  # (which list of defaults.json: the run must say)
        proposed_defaults(_result(), shipped)
    with pytest.raises(ValueError, match="changed since"):  # ranges that are not the shipped rules' any more
        proposed_defaults(result, dict(shipped, cuda=[dict(shipped["cuda"][0], max_tokens_per_expert=12),
                                                      shipped["cuda"][1]]))
    # fmoe2's own defaults.json: a run with its ranges gets its list rewritten whole, the rest of the file kept
    from fmoe2.bench.defaults import rule_bounds

    bounds = rule_bounds(NAMED_TARGETS["sm_90"])
    rows = [dict(r, tokens_per_expert=bounds[0] if r["M"] == 1 else bounds[-1]) for r in result["results"]]
    (tmp_path / "r.json").write_text(json.dumps(dict(result, rule_bounds=bounds, results=rows)))
    assert main(["--report", str(tmp_path / "r.json"), "--write-rules", str(tmp_path / "rules")]) == 0
    written = json.loads((tmp_path / "rules" / "defaults.json").read_text())
    assert [r["max_tokens_per_expert"] for r in written["cuda"]] == bounds
    assert written["cuda"][0]["BLOCK_M"] == 1 and written["cuda"][-1]["BLOCK_M"] == 128  # (a@1's and a@128's)
    shipped_cuda = __import__("fmoe2").gemm.config._defaults(__import__("fmoe2").gemm.config.CONFIG_DIR)["cuda"]
    assert written["cuda"][1:-1] == shipped_cuda[1:-1] and written["deterministic"]  # (ranges without rows kept)
    (tmp_path / "old.json").write_text(json.dumps(dict(result, rule_bounds=[4, 1e18])))
    with pytest.raises(SystemExit):
        main(["--report", str(tmp_path / "old.json"), "--write-rules", str(tmp_path / "rules2")])


def test_rules_key_names_the_list_the_target_reads():
    from fmoe2.bench.defaults import rules_key

    assert [rules_key(NAMED_TARGETS[t]) for t in ("sm_90", "sm_80", "gfx942", "gfx950")] == ["cuda", "cuda", "hip",
                                                                                              "gfx950"]
