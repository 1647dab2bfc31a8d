"""The benchmark's per-launch breakdown (stage_times, report table), on the CPU interpreter."""
import importlib
import json

import pytest
import torch

from fmoe2 import FusedMoEConfig, prepare_weights
from fmoe2.bench.report import write_report
from helpers import assert_matches_reference, make_lora, make_problem, make_token_lora_ids, poisoned

bench_main = importlib.import_module("fmoe2.bench.__main__")
ceilings = importlib.import_module("fmoe2.bench.ceilings")


def recording_timer(timed):
    """Stands in for the CUDA-graph timer: runs each launch once, in the order asked, into ``timed``.
    (A launch's return value is not used: on a GPU a Triton launch returns its compiled kernel.)"""
    def once(fn):
        fn()
        timed.append(fn)
        return 1.0
    return once


@pytest.mark.parametrize("path,names", [("fused", ["sort", "fused", "cast"]), ("two_stage", ["sort", "stage1", "stage2"])])
def test_stage_times_runs_each_launch_of_the_forward(monkeypatch, path, names):
    timed = []
    monkeypatch.setattr(ceilings, "time_in_graph", recording_timer(timed))
    M, E, H, I, topk = 21, 4, 40, 24, 2
    x, w1, w2, tw, ti = make_problem(M, E, H, I, topk, torch.float16, seed=3)
    cfg = FusedMoEConfig(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, BLOCK_H=16, path=path)
    out = poisoned(M, H, torch.float16)
    times = ceilings.stage_times(x, prepare_weights(w1, w2), tw, ti, cfg, out)
    assert list(times) == names and len(timed) == len(names)
    # The sort zeroes out and the later launches add into it: timed in order they give the forward.
    assert_matches_reference(out, x, w1, w2, tw, ti)


def test_stage_times_with_adapters_runs_the_lora_launches(monkeypatch):
    timed = []
    monkeypatch.setattr(ceilings, "time_in_graph", recording_timer(timed))
    M, E, H, I, topk = 21, 4, 40, 24, 2
    x, w1, w2, tw, ti = make_problem(M, E, H, I, topk, torch.float16, seed=4)
    lora = make_lora(3, E, H, I, 16, torch.float16)
    ids = make_token_lora_ids(M, 3)
    cfg = FusedMoEConfig(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, BLOCK_H=16, path="two_stage")
    out = poisoned(M, H, torch.float16)
    times = ceilings.stage_times(x, prepare_weights(w1, w2), tw, ti, cfg, out, lora=lora, token_lora_ids=ids)
    assert list(times) == ["sort", "lora_shrink13", "lora_expand13", "stage1", "lora_shrink2", "lora_expand2", "stage2"]
    assert len(timed) == 7
    assert_matches_reference(out, x, w1, w2, tw, ti, lora=lora, token_lora_ids=ids)


def test_report_breakdown_table(tmp_path):
    common = dict(shape="s", E=4, H=8, I=8, topk=2, speedup=1.0, baseline_us=2.0, floor_us=1.0, fraction_of_floor=0.5,
                  sort_us=1.0, sort_budget_us=10.0, fmoe2_default_config_us=2.0, fmoe2_rel_err=0.0,
                  baseline_rel_err=0.0, fmoe2_config={})
    rows = [dict(common, M=1, fmoe2_us=2.0, fmoe2_path="fused", flops=4e6, stage_us={"sort": 1.0, "fused": 1.0},
                 dense_gemm_us=None),
            dict(common, M=4096, fmoe2_us=300.0, fmoe2_path="two_stage", flops=3e12, fmoe2_config={"tma": True, "pdl": True},
                 stage_us={"sort": 10.0, "stage1": 200.0, "stage2": 100.0}, dense_gemm_us=200.0,
                 fmoe2_picked_us=310.5),  # (fused_moe's own pick: result files since 2026-11-29 time it)
            dict(common, M=8192, fmoe2_us=2.0, fmoe2_path="fused")]  # an older result without stage times
    run = dict(device="GPU X", date="d", command="c", torch="t", triton="tr",
               ceilings={"copy_bytes_per_s": 1e12, "bf16_flops_per_s": 1e15}, results=rows)
    (tmp_path / "GPU_X__s.json").write_text(json.dumps(run))
    write_report(str(tmp_path), "GPU_X", plot_dir=str(tmp_path))
    md = (tmp_path / "GPU_X.md").read_text()
    assert "| s | 1 | fused | 1.0 | 1.0, 4 | - | - | - |" in md
    assert "| s | 4096 | 300.0 | two_stage +tma +pdl |" in md and "| s | 1 | 2.0 | fused |" in md  # opt-in features
    assert "| 1.0 / 10.0 | 2.0 | 310.5 | 0.0e+00 / 0.0e+00 |" in md  # the own pick's column,
    assert "| 1.0 / 10.0 | 2.0 | - | 0.0e+00 / 0.0e+00 |" in md  # and "-" where an older file has none
    # stage 1: 2/3 of 3e12 flops in 200 us = 10000 TFLOP/s; stage 2: 1e12 in 100 us; dense: 3e12 in 200 us
    assert "| s | 4096 | two_stage | 10.0 | 200.0, 10000 | 100.0, 10000 | 200.0, 15000 | 1.50x |" in md
    assert "| s | 8192 |" not in md.split("## Where the time goes")[1]
    assert "Triton tr)" in md  # (a run that names no timing: the report's general line)
    (tmp_path / "GPU_X__s.json").write_text(json.dumps(dict(run, timing="in turns")))
    write_report(str(tmp_path), "GPU_X", plot_dir=str(tmp_path))
    assert "Triton tr; timing: in turns)" in (tmp_path / "GPU_X.md").read_text()


def test_variants_cover_the_opt_in_features_and_decode_two_stage():
    import fmoe2
    from fmoe2.bench.variants import variants_of

    E, H, I, topk = 128, 2048, 768, 8
    decode = variants_of(fmoe2.get_config(1, E, H, I, topk, torch.bfloat16), 1, E, H, I, topk)
    assert {"picked", "tma", "pdl", "tma+pdl"} <= set(decode)
    assert decode["tma+pdl"].tma and decode["tma+pdl"].pdl and not decode["picked"].tma
    assert any(c.path == "two_stage" and c.BLOCK_N <= 64 for c in decode.values())
    # Every decode two-stage candidate of the search under its own label (none overwrites another).
    from fmoe2.bench.search import fmoe2_candidates
    two_stage = [c for c in fmoe2_candidates(1, E, H, I, topk, torch.bfloat16) if c.path == "two_stage"]
    assert sorted(map(repr, two_stage)) == sorted(repr(c) for c in decode.values() if c.path == "two_stage")
    large = variants_of(fmoe2.get_config(4096, E, H, I, topk, torch.bfloat16), 4096, E, H, I, topk)
    assert set(large) == {"picked", "tma", "pdl", "tma+pdl"}


def test_update_replaces_only_the_rerun_batch_sizes(tmp_path):
    from fmoe2.bench.report import merge_results, write_tuned_configs

    def run(date, command, ms, us, copy):
        rows = [dict(shape="s", E=4, H=8, I=8, topk=2, M=M, fmoe2_us=us, baseline_us=2 * us, speedup=2.0,
                     floor_us=1.0, fraction_of_floor=0.5, sort_us=1.0, sort_budget_us=10.0,
                     fmoe2_default_config_us=us, fmoe2_rel_err=0.0, baseline_rel_err=0.0, fmoe2_config={"BLOCK_M": M})
                for M in ms]
        return dict(device="GPU X", date=date, command=command, torch="t" + date, triton="tr",
                    ceilings={"copy_bytes_per_s": copy, "bf16_flops_per_s": 1e15}, results=rows)

    path = str(tmp_path / "GPU_X__s.json")
    bench_main.write_results(path, run("d1", "bench all", [1, 16, 128], 3.0, 1e12))
    bench_main.write_results(path, run("d2", "bench --m 16", [16], 5.0, 2e12), update=True)
    # d1 keeps rows (M=1, 128) two merges back: its own date and metadata must survive.
    third = bench_main.write_results(path, run("d3", "bench --m 16 again", [16], 7.0, 3e12), update=True)
    assert [(r["M"], r["fmoe2_us"], r["run_date"]) for r in third["results"]] == [(1, 3.0, "d1"), (16, 7.0, "d3"),
                                                                                  (128, 3.0, "d1")]
    assert third["date"] == "d3" and [(r["command"], r["torch"]) for r in third["earlier_runs"]] == [("bench all", "td1")]
    fourth = merge_results(third, run("d4", "bench --m 1", [1], 9.0, 4e12))
    assert [r["run_date"] for r in fourth["results"]] == ["d4", "d3", "d1"]
    assert [r["command"] for r in fourth["earlier_runs"]] == ["bench --m 16 again", "bench all"]  # newest first
    fifth = merge_results(fourth, run("d5", "bench --m 128", [128], 11.0, 5e12))  # d1 has no rows left
    assert [r["command"] for r in fifth["earlier_runs"]] == ["bench --m 1", "bench --m 16 again"]  # newest first
    (tmp_path / "GPU_X__s.json").write_text(json.dumps(fifth))
    write_report(str(tmp_path), "GPU_X", plot_dir=str(tmp_path))
    md = (tmp_path / "GPU_X.md").read_text()
    # Each run line has that run's batch sizes, ceilings and versions.
    assert ("  - d3: `bench --m 16 again` (s M=16; copy 3.00 TB/s, bf16 matmul 1000 TFLOP/s; torch td3, Triton tr)"
            in md)
    assert "  - d4: `bench --m 1` (s M=1; copy 4.00 TB/s, bf16 matmul 1000 TFLOP/s; torch td4, Triton tr)" in md
    assert "  - d5: `bench --m 128` (s M=128; copy 5.00 TB/s" in md
    assert "d1" not in md and "d2" not in md and "| s | 16 | 7.0 |" in md and "| s | 128 | 11.0 |" in md
    # Tuned files come from every row, whichever run it comes from.
    (tuned,) = write_tuned_configs(str(tmp_path), "GPU_X", str(tmp_path / "configs"))
    assert set(json.loads(open(tuned).read())) == {"1", "16", "128", "checked"}  # (each entry's check record)
    # A rewrite keeps the other tuners' entries and their records (python -m fmoe2.tune --deterministic, --dtype fp8,
    # --weights mxfp4).
    with open(tuned, "w") as f:
        json.dump({"1": {}, "deterministic": {"1": {"BLOCK_M": 16}}, "fp8": {"4": {"BLOCK_M": 32}},
                   "mxfp4": {"16": {"BLOCK_M": 64}}, "checked": {"mxfp4": {"16": {"rel_err": 1e-3}}}}, f)
    write_tuned_configs(str(tmp_path), "GPU_X", str(tmp_path / "configs"))
    rewritten = json.loads(open(tuned).read())
    assert set(rewritten) == {"1", "16", "128", "deterministic", "fp8", "mxfp4", "checked"}
    assert rewritten["deterministic"] == {"1": {"BLOCK_M": 16}} and rewritten["mxfp4"] == {"16": {"BLOCK_M": 64}}
    assert rewritten["checked"]["mxfp4"] == {"16": {"rel_err": 1e-3}} and set(rewritten["checked"]) == {"plain", "mxfp4"}


@pytest.mark.parametrize("flag", ["--lora", "--no-search"])
def test_update_refuses_results_it_cannot_merge(flag, capsys):
    with pytest.raises(SystemExit):
        bench_main.main(["--update", flag])
    # The usage line names --update too: check the refusal itself (on a CPU machine the next error
    # would be the missing GPU).
    assert "--update reruns searched plain results only" in capsys.readouterr().err



def test_each_distinct_config_of_a_point_is_timed_once():
    from fmoe2.bench.__main__ import distinct_configs

    a, b = object(), object()
    timed, same = distinct_configs({"fmoe2": a, "default": b, "picked": a, "fused": None})
    assert timed == {"fmoe2": a, "default": b} and same == {"picked": "fmoe2"}
    timed, same = distinct_configs({"fmoe2": a, "default": a, "picked": a, "fused": a})
    assert timed == {"fmoe2": a} and same == {"default": "fmoe2", "picked": "fmoe2", "fused": "fmoe2"}
