"""The LoRA benchmark's report: the LoRA pick's path, the other path's time, and results from before it."""
import json

from fmoe2.bench.lora import write_lora_report


def _row(M, path, **extra):
    return dict(shape="tiny", M=M, path=path, rank=16, num_loras=4, plain_us=100.0, lora_us=110.0,
                lora_over_plain=1.1, none_over_plain=1.01, one_over_plain=1.05, baseline_us=120.0,
                baseline_lora_us=200.0, speedup_vs_baseline_lora=200 / 110, fmoe2_rel_err=1e-2, baseline_rel_err=5e-3,
                **extra)


def _write(tmp_path, device, rows):
    run = dict(device=device, date="2026-11-23", torch="2.11", triton="3.6", command="python -m fmoe2.bench --lora",
               results=rows)
    (tmp_path / f"{device}__tiny.json").write_text(json.dumps(run))
    write_lora_report(str(tmp_path), device, str(tmp_path))
    return (tmp_path / f"{device}.md").read_text()


def test_lora_report_shows_the_lora_path_and_the_other_path(tmp_path):
    md = _write(tmp_path, "GPU", [_row(1, "two_stage", lora_path="fused", lora_other_path_us=150.0),
                                  _row(16, "fused", lora_path="fused")])
    assert "| tiny | 1 | two_stage | 100.0 | fused | 110.0 | 1.10x |" in md
    assert "| 150.0 |" in md and "| tiny | 16 | fused | 100.0 | fused | 110.0 |" in md
    assert "results from before" not in md


def test_lora_report_reads_results_from_before_the_lora_pick(tmp_path):
    md = _write(tmp_path, "OLD", [_row(1, "two_stage", lora_fused_us=150.0)])
    assert "| tiny | 1 | two_stage | 100.0 | two_stage | 110.0 |" in md and "| 150.0 |" in md
    assert "results from before `get_config(lora=True)`" in md


def test_lora_report_lists_the_launch_times_where_measured(tmp_path):
    launches = {"sort": 3.0, "lora_shrink13": 4.0, "lora_expand13": 5.5, "stage1": 50.0, "lora_shrink2": 4.5,
                "lora_expand2": 3.5, "stage2": 30.0}
    md = _write(tmp_path, "GPU", [_row(1024, "two_stage", lora_path="two_stage", lora_launch_us=launches),
                                  _row(16, "fused", lora_path="fused")])
    assert ("| tiny | 1024 | sort 3.0, lora_shrink13 4.0, lora_expand13 5.5, stage1 50.0, lora_shrink2 4.5, "
            "lora_expand2 3.5, stage2 30.0 |") in md
    assert "| tiny | 16 |" not in md.split("Launches of the mixed-adapter forward")[1]


def test_lora_report_names_the_interleaved_rounds_of_a_run(tmp_path):
    md = _write(tmp_path, "GPU", [_row(1, "fused", lora_path="fused", timing_rounds=3)])
    assert "`python -m fmoe2.bench --lora`, 3 interleaved rounds" in md
    md = _write(tmp_path, "OLD", [_row(1, "fused", lora_path="fused")])  # results from before the rounds
    assert "interleaved rounds" not in md


def test_time_interleaved_takes_turns_and_keeps_the_median(monkeypatch):
    import fmoe2.bench.timing as timing

    calls = []
    fake = {"a": iter([5.0, 1.0, 3.0]), "b": iter([2.0, 9.0, 4.0])}
    monkeypatch.setattr(timing, "time_in_graph", lambda fn: fn())
    got = timing.time_interleaved({name: (lambda name=name: calls.append(name) or next(fake[name]))
                                   for name in ("a", "b")}, rounds=3)
    assert calls == ["a", "b"] * 3 and got == {"a": 3.0, "b": 4.0}


def test_weight_bytes_with_adapters_counts_the_adapter_expert_pairs_hit():
    import torch

    from fmoe2.bench.lora import weight_bytes_with_adapters

    H, I, rank = 64, 32, 4
    per_pair = rank * (3 * H + 3 * I) / (3 * H * I)
    topk_ids = torch.tensor([[0, 1], [1, 2], [0, 1], [3, 2]])
    # Pairs hit: (0,0), (0,1) from tokens 0 and 2 (counted once), (1,1), (1,2); token 3 has none (-1), and
    # an id >= num_loras is none too. Experts hit: 0, 1, 2, 3.
    lora_ids = torch.tensor([0, 1, 0, -1])
    assert abs(weight_bytes_with_adapters(topk_ids, lora_ids, 4, H, I, rank, 2) - (1 + 4 * per_pair / 4)) < 1e-12
    assert weight_bytes_with_adapters(topk_ids, torch.tensor([5, 5, 5, 5]), 4, H, I, rank, 2) == 1.0
    assert weight_bytes_with_adapters(topk_ids, torch.full((4,), -1), 4, H, I, rank, 2) == 1.0
    one = torch.zeros(4, dtype=torch.int32)  # one adapter for every token: one pair per expert hit
    assert abs(weight_bytes_with_adapters(topk_ids, one, 4, H, I, rank, 2) - (1 + per_pair)) < 1e-12
    # Experts outside [0, E) (another rank's, with expert_map) read nothing.
    assert abs(weight_bytes_with_adapters(torch.tensor([[0, 7]]), torch.tensor([0]), 4, H, I, rank, 1)
               - (1 + per_pair)) < 1e-12


def test_lora_report_shows_the_weight_bytes_ratio_where_measured(tmp_path):
    md = _write(tmp_path, "GPU", [_row(1, "fused", lora_path="fused", weight_bytes_lora_over_plain=1.0286),
                                  _row(16, "fused", lora_path="fused")])
    assert "| tiny | 1 | fused | 100.0 | fused | 110.0 | 1.10x | 1.029x | 1.010x |" in md
    assert "| tiny | 16 | fused | 100.0 | fused | 110.0 | 1.10x | - | 1.010x |" in md


def test_benchmark_adapter_ids_give_at_least_one_token_an_adapter():
    import torch

    from fmoe2.bench.lora import make_token_lora_ids

    gen = torch.Generator().manual_seed(0)
    assert make_token_lora_ids(5, 4, gen, none_fraction=1.0).tolist() == [0, -1, -1, -1, -1]
    ids = make_token_lora_ids(4096, 4, gen, none_fraction=0.2)
    assert ids.dtype == torch.int32 and 0.15 < float((ids < 0).float().mean()) < 0.25 and int(ids.max()) == 3
