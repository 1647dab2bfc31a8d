"""The tuner's bookkeeping (no GPU needed): which points a run still has to tune, and entries written one by one, so
an interrupted run resumes where it stopped."""
import argparse
import json
import os

import pytest

from fmoe2.gemm.config import device_config_name
from fmoe2.bench.precompile import share_of, worker_count
from fmoe2.tune import _shape_names, _store, _tuned_path, tune_points


def _args(tmp_path, **kw):
    return argparse.Namespace(config_dir=str(tmp_path), dtype=kw.get("dtype", "bf16"),
                              deterministic=kw.get("deterministic", False), overwrite=kw.get("overwrite", False))


def test_a_rerun_skips_the_entries_its_files_hold(tmp_path):
    a = _args(tmp_path)
    shapes, ms = ["gpt-oss-20b", "glm-4.5-air"], [1, 16, 128]
    assert tune_points(shapes, ms, a) == [(s, m) for s in shapes for m in ms]
    path = _tuned_path("gpt-oss-20b", a)
    assert os.path.dirname(path) == os.path.join(str(tmp_path), device_config_name())
    _store(path, None, 1, {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128, "BLOCK_H": 128})
    _store(path, None, 16, {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128, "BLOCK_H": 128})
    assert tune_points(shapes, ms, a) == [("gpt-oss-20b", 128)] + [("glm-4.5-air", m) for m in ms]
    assert tune_points(shapes, ms, _args(tmp_path, overwrite=True)) == [(s, m) for s in shapes for m in ms]
    # Other modes' entries are their own: an fp8 run still has every point to tune, and its entries keep the rest.
    fp8 = _args(tmp_path, dtype="fp8")
    assert tune_points(["gpt-oss-20b"], ms, fp8) == [("gpt-oss-20b", m) for m in ms]
    _store(_tuned_path("gpt-oss-20b", fp8), "fp8", 128, {"BLOCK_M": 16, "BLOCK_N": 128, "BLOCK_K": 128, "BLOCK_H": 128})
    with open(path) as f:
        stored = json.load(f)
    assert list(stored) == ["1", "16", "fp8"] and list(stored["fp8"]) == ["128"]
    assert not os.path.exists(path + ".tmp")


def test_shape_arguments():
    p = argparse.ArgumentParser()
    assert _shape_names("gpt-oss-20b,deepseek-v3", p) == ["gpt-oss-20b", "deepseek-v3"]
    assert _shape_names("8,4096,14336,2", p) == ["8x4096x14336x2"] == _shape_names("8x4096x14336x2", p)
    with pytest.raises(SystemExit):
        _shape_names("gpt-oss-21b", p)


@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="tuning needs a GPU")
def test_tuning_a_small_shape_writes_its_entry_and_a_rerun_resumes(tmp_path):
    import subprocess
    import sys

    command = [sys.executable, "-m", "fmoe2.tune", "--shape", "8x256x128x2", "--m", "1", "--config-dir", str(tmp_path)]
    first = subprocess.run(command + ["--compile-workers", "2"], capture_output=True, text=True, timeout=900)
    assert first.returncode == 0, first.stderr[-3000:]
    assert "1 points to tune" in first.stdout and "[1/1] 8x256x128x2 M=1:" in first.stdout, first.stdout
    assert "8x256x128x2: candidates compiled in 2 processes" in first.stdout, first.stdout
    path = _tuned_path("8x256x128x2", _args(tmp_path))
    with open(path) as f:
        entry = json.load(f)["1"]
    from fmoe2 import FusedMoEConfig

    FusedMoEConfig.from_dict(entry)  # a config fused_moe takes
    again = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0 and "0 points to tune (1 already in their tuned files" in again.stdout, again.stdout


def test_compiling_processes_fit_the_free_memory_and_share_the_candidates():
    gib = 1 << 30
    assert worker_count(8, 80 * gib, 1 * gib) == 8
    assert worker_count(8, 80 * gib, 22 * gib) == 2  # DeepSeek-V3's bf16 weights on an H100
    assert worker_count(8, 10 * gib, 22 * gib) == 1  # one, however little is free
    items = list(range(10))
    shares = [share_of(items, f"{i}/3") for i in range(3)]
    assert sorted(sum(shares, [])) == items and shares[1] == [1, 4, 7]
    with pytest.raises(ValueError):
        share_of(items, "3/3")
