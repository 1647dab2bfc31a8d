"""The prefill benchmark (``python -m fmoe2.bench --prefill``, fmoe2/bench/prefill.py): the padded-rows count, the
report, and (GPU) a run of one shape end to end."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fmoe2.bench.prefill import markdown, padded_rows


def test_padded_rows_of_whole_and_tail_tiles():
    counts = torch.tensor([0, 1, 64, 65, 128, 129, 200])
    # BLOCK_M=128: 0, 128, 128, 128, 128, 256, 256
    assert padded_rows(counts, 128) == 1024
    # tails of 64: 1 -> 64, 64 -> 64, 65 -> 128, 129 -> 128 + 64, 200 -> 256
    assert padded_rows(counts, 128, 64) == 0 + 64 + 64 + 128 + 128 + 192 + 256


def test_report_lists_every_row():
    row = dict(shape="gpt-oss-20b", E=32, H=2880, I=2880, topk=4, M=1024, routing="uniform",
               config={"path": "two_stage", "BLOCK_M": 128}, max_rows_per_expert=150, mean_rows_per_expert=128,
               padded=1.4, padded_with_tail={"64": 1.2}, times_us={"fmoe2": 700.0, "fmoe2 TAIL_M=64": 600.0,
                                                                    "fmoe2 fp8 block": 500.0},
               rel_err={"fmoe2": 1e-3}, dense_us=450.0, grouped_mm_us=None,
               tflops={"fmoe2": 300.0, "fmoe2 TAIL_M=64": 350.0, "fmoe2 fp8 block": 420.0}, dense_tflops=466.0)
    result = dict(device="GPU", date="2026-11-28", torch="2.11", triton="3.6", command="python -m fmoe2.bench --prefill",
                  results=[row, dict(row, routing="skewed")])
    text = markdown(result)
    assert text.count("| gpt-oss-20b | 1024 |") == 2
    assert "TAIL_M=64: 600.0 (350, 0.75)" in text and "block: 500.0 (420, x1.40 bf16)" in text
    assert "0.64" in text  # dense / fmoe2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the benchmark needs a GPU")
def test_prefill_benchmark_of_one_shape(tmp_path):
    command = [sys.executable, "-m", "fmoe2.bench", "--prefill", "--shapes", "qwen3-30b-a3b", "--m", "1024",
               "--tails", "32,64", "--fp8-schemes", "channel", "--out-dir", str(tmp_path)]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    files = list((tmp_path / "prefill").glob("*.json"))
    assert len(files) == 1
    rows = json.loads(files[0].read_text())["results"]
    assert [(r["M"], r["routing"]) for r in rows] == [(1024, "uniform"), (1024, "skewed")]
    for r in rows:  # each fmoe2 variant was checked against the reference before it was timed
        assert all(v < 2.5e-2 for v in r["rel_err"].values()) and r["dense_us"] > 0, r
        assert r["padded"] >= 1.0 and all(v > 0 for v in r["times_us"].values())
    assert "fmoe2 fp8 channel" in rows[0]["times_us"] and "fmoe2 fp8 channel" not in rows[1]["times_us"]
    for r in rows:  # the tails below the picked two-stage config's BLOCK_M were timed beside it
        cfg = r["config"]
        expected = {f"fmoe2 TAIL_M={t}" for t in (32, 64) if cfg["path"] == "two_stage" and t < cfg["BLOCK_M"]}
        assert {k for k in r["times_us"] if "TAIL" in k} == expected and set(r["padded_with_tail"]) == {
            k.split("=")[1] for k in expected}


def test_prefill_arguments_are_checked_before_any_run():
    for bad in (["--tails", "48"], ["--routing", "zipf"]):
        proc = subprocess.run([sys.executable, "-m", "fmoe2.bench", "--prefill", *bad], capture_output=True,
                              text=True, timeout=300)
        assert proc.returncode == 2 and ("--tails" in proc.stderr or "--routing" in proc.stderr), proc.stderr


def test_plot_of_the_committed_result(tmp_path):
    pytest.importorskip("matplotlib")
    from fmoe2.bench.prefill import plot, plot_path

    committed = Path(__file__).resolve().parents[2] / "misc" / "bench" / "prefill" / "NVIDIA_H200.json"
    result = json.loads(committed.read_text())
    path = plot_path(str(tmp_path / "bench"), result["device"])
    assert path == str(tmp_path / "NVIDIA_H200_prefill.png")
    plot(result, path)
    assert open(path, "rb").read(8) == b"\x89PNG\r\n\x1a\n"
