"""The deterministic benchmark's report (fmoe2/bench/deterministic.py) from a result row."""
from fmoe2.bench.deterministic import markdown


def test_report_has_every_column_and_flags_a_row_that_is_not_batch_invariant():
    times = dict(default=10.0, bf16_atomic_adds=9.5, fp32_accumulator=10.0, two_stage=11.0, deterministic=12.0,
                 vllm_style=13.0, deterministic_fixed=14.0)
    errors = dict(default=2e-3, bf16_atomic_adds=9e-3, fp32_accumulator=2e-3, two_stage=4e-3, deterministic=3e-3,
                  vllm_style=4e-3)
    row = dict(shape="s", M=16, default_path="fused", default_launches=["sort", "fused", "cast"], us=times,
               rel_err=errors, max_diff_repeat_and_replay=dict(default=1e-2, deterministic=0.0),
               deterministic_over_default=1.2, vllm_style_over_deterministic=13 / 12, batch_invariant=False)
    md = markdown(dict(device="GPU", date="d", torch="t", triton="tr", command="c", results=[row]))
    assert "| s | 16 | 10.0 | fused | 3 | 12.0 | 1.200x | 13.0 | 1.08x | 2.00e-03 | 3.00e-03 | 4.00e-03 | 1.0e-02 " \
           "| 0.0e+00 | NO |" in md
    # Errors over the vLLM-style path's, times over the bf16 adds'.
    assert "| s | 16 | fused | 9.00e-03 | 2.25 | 2.00e-03 | 0.50 | 1.053x | 4.00e-03 | 1.00 | 1.158x | 3.00e-03 | " \
           "0.75 | 1.263x | 4.00e-03 |" in md
    assert "| s | 16 | 12.0 | 14.0 |" in md
    unsearched = dict(row, baseline_config_source="first candidate")
    assert "| 1.200x | 13.0* | 1.08x |" in markdown(dict(device="GPU", date="d", torch="t", triton="tr", command="c",
                                                          results=[unsearched]))


def test_the_baseline_config_comes_from_the_main_benchmarks_results_in_out_dir_or_the_checkout(tmp_path, monkeypatch,
                                                                                                capsys):
    import json

    import fmoe2.bench.deterministic as bench
    from fmoe2.bench.search import baseline_candidates

    monkeypatch.setattr(bench, "device_config_name", lambda: "GPU")
    picked = dict(baseline_candidates(16, 8, 2)[-1][0].__dict__)
    committed = tmp_path / "committed"
    committed.mkdir()
    (committed / "GPU__s.json").write_text(json.dumps({"results": [dict(M=16, baseline_config=picked)]}))
    monkeypatch.setattr(bench, "COMMITTED_RESULTS", str(committed))
    (cfg, _), source = bench.searched_baseline(str(tmp_path / "elsewhere"), "s", 16, 8, 2)  # none in --out-dir
    assert source == "searched" and cfg.__dict__ == picked
    first, source = bench.searched_baseline(str(tmp_path / "elsewhere"), "s", 1, 8, 2)  # no row for M=1
    assert source == "first candidate" and first == baseline_candidates(1, 8, 2)[0]
    assert "no searched vLLM-style config for s M=1" in capsys.readouterr().err
