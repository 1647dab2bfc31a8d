"""The benchmark's searched run end to end on a small shape (GPU only): both searches after the candidates were
compiled in two processes, the result file and its report."""
import json
import os
import subprocess
import sys

import pytest
import torch


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the benchmark needs a GPU")
def test_searched_benchmark_of_a_small_shape_with_compiling_processes(tmp_path):
    # One batch size (two took 122 s of a GPU suite on an H200, the suite's slowest test: the search's candidates
    # at each M are compiled cold); the search and its grids have CPU tests (tests/test_tune.py, test_vllm_style.py)
    command = [sys.executable, "-m", "fmoe2.bench", "--shape", "8,256,128,2", "--m", "1", "--compile-workers", "2",
               "--out-dir", str(tmp_path / "bench")]  # (the plots go to the folder above)
    proc = subprocess.run(command, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "custom-8-256-128-2: candidates compiled in 2 processes" in proc.stdout, proc.stdout
    files = [f for f in os.listdir(tmp_path / "bench") if f.endswith("__custom-8-256-128-2.json")]
    assert len(files) == 1, os.listdir(tmp_path / "bench")
    with open(tmp_path / "bench" / files[0]) as f:
        rows = json.load(f)["results"]
    assert [r["M"] for r in rows] == [1]
    for r in rows:  # checked against the float32 reference (after the timings; the run stops where it is off)
        assert r["fmoe2_rel_err"] < 2.5e-2 and r["baseline_rel_err"] < 2.5e-2 and r["fmoe2_us"] > 0, r
        assert r["fmoe2_final_round_us"] > 0, r  # (the searched pick's own final-round time, beside its re-time)
        assert r["fmoe2_picked_us"] > 0 and r["fmoe2_picked_config"]["BLOCK_M"] > 0, r  # (fused_moe's own pick)
    assert "final round" in proc.stderr, proc.stderr[-2000:]
