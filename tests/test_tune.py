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
                              deterministic=kw.get("deterministic", False), overwrite=kw.get("overwrite", False),
                              weights=kw.get("weights"))


def test_a_rerun_skips_the_entries_its_files_hold(tmp_path):
    a = _args(tmp_path)
    shapes, ms = ["gpt-oss-20b", "glm-4.5-air"], [1, 16, 128]
    assert tune_points(shapes, ms, a) == [(s, m) for s in shapes for m in ms]
    path = _tuned_path("gpt-oss-20b", a)
    assert os.path.dirname(path) == os.path.join(str(tmp_path), device_config_name())
    check = dict(rel_err=3e-3, bound=2.5e-2, faster_failed=0)
    _store(path, None, 1, {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128, "BLOCK_H": 128}, check)
    _store(path, None, 16, {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128, "BLOCK_H": 128}, check)
    _store(path, None, 128, {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128, "BLOCK_H": 128})  # never checked
    assert tune_points(shapes, ms, a) == [("gpt-oss-20b", 128)] + [("glm-4.5-air", m) for m in ms]
    assert tune_points(shapes, ms, _args(tmp_path, overwrite=True)) == [(s, m) for s in shapes for m in ms]
    # Other modes' entries are their own: an fp8 run still has every point to tune, and its entries keep the rest.
    fp8 = _args(tmp_path, dtype="fp8")
    assert tune_points(["gpt-oss-20b"], ms, fp8) == [("gpt-oss-20b", m) for m in ms]
    _store(_tuned_path("gpt-oss-20b", fp8), "fp8", 128, {"BLOCK_M": 16, "BLOCK_N": 128, "BLOCK_K": 128, "BLOCK_H": 128})
    # and so are a weight-only format's (the activations' dtype's file, the entry of the format's name)
    mxfp4 = _args(tmp_path, weights="mxfp4")
    assert _tuned_path("gpt-oss-20b", mxfp4) == path
    assert tune_points(["gpt-oss-20b"], ms, mxfp4) == [("gpt-oss-20b", m) for m in ms]
    _store(path, "mxfp4", 16, {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 64, "BLOCK_H": 64}, check)
    assert tune_points(["gpt-oss-20b"], ms, mxfp4) == [("gpt-oss-20b", 1), ("gpt-oss-20b", 128)]
    assert tune_points(["gpt-oss-20b"], ms, _args(tmp_path, weights="int8")) == [("gpt-oss-20b", m) for m in ms]
    with open(path) as f:
        stored = json.load(f)
    assert list(stored) == ["1", "16", "128", "checked", "fp8", "mxfp4"] and list(stored["fp8"]) == ["128"]
    assert list(stored["checked"]["mxfp4"]) == ["16"] and list(stored["mxfp4"]) == ["16"]
    assert not os.path.exists(path + ".tmp")


def test_a_new_files_keys_come_in_one_order(tmp_path):
    # a file a weight-only run starts has its records before its entry, as a file that had plain entries first
    path = _tuned_path("gpt-oss-20b", _args(tmp_path, weights="int8"))
    check = dict(rel_err=3e-3, bound=2.5e-2, faster_failed=0)
    _store(path, "int8", 16, {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 64, "BLOCK_H": 64}, check)
    _store(path, "mxfp4", 1, {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 64, "BLOCK_H": 64}, check)
    _store(path, None, 4, {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 64, "BLOCK_H": 64}, check)
    with open(path) as f:
        stored = json.load(f)
    assert list(stored) == ["4", "checked", "mxfp4", "int8"]
    assert list(stored["checked"]) == ["plain", "mxfp4", "int8"]


def test_weight_only_entries_run_as_stored():
    # The tuner stores a weight-only format's pick as its forward ran it (resolve_config's fit, fit_packed_config
    # included); read back, resolve_config fits it again: that second fit must leave it as it ran, for every
    # candidate of the tuner's grid (checked here at four shapes, five batch sizes, CUDA and ROCm).
    import torch

    from fmoe2.bench.search import fmoe2_candidates
    from fmoe2.gemm.config import ConfigMode, ConfigProblem, resolve_config
    from fmoe2.shapes import ALL_SHAPES
    from fmoe2.target import NAMED_TARGETS

    for target in (NAMED_TARGETS["sm_90"], NAMED_TARGETS["gfx942"]):
        for shape in ("gpt-oss-20b", "gpt-oss-120b", "qwen3-30b-a3b", "mixtral-8x7b"):
            E, H, I, topk = ALL_SHAPES[shape]
            for M in (1, 16, 128, 1024, 4096):
                problem = ConfigProblem(M, E, H, I, topk, torch.bfloat16)
                for fmt in ("mxfp4", "int4", "int8"):
                    mode = ConfigMode(weight_format=fmt)
                    for candidate in fmoe2_candidates(M, E, H, I, topk, torch.bfloat16, fmt):
                        ran = resolve_config(problem, mode, target, candidate)
                        assert resolve_config(problem, mode, target, ran) == ran, (shape, M, fmt, candidate)
                        # (pointer loads: launches.tma_enabled takes descriptors for 16-bit weights only)
                        assert not ran.tma, (shape, M, fmt, candidate)


def test_shape_arguments():
    p = argparse.ArgumentParser()
    assert _shape_names("gpt-oss-20b,deepseek-v3", p) == ["gpt-oss-20b", "deepseek-v3"]
    assert _shape_names("8,4096,14336,2", p) == ["8x4096x14336x2"] == _shape_names("8x4096x14336x2", p)
    assert _shape_names("8x256x128x2,gpt-oss-20b", p) == ["8x256x128x2", "gpt-oss-20b"]
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
        stored = json.load(f)
    entry = stored["1"]
    assert stored["checked"]["plain"]["1"]["rel_err"] <= stored["checked"]["plain"]["1"]["bound"] == 2.5e-2
    assert "(error " in first.stdout, first.stdout
    from fmoe2 import FusedMoEConfig

    FusedMoEConfig.from_dict(entry)  # a config fused_moe takes
    again = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0 and "0 points to tune (1 already in their tuned files" in again.stdout, again.stdout
    checked = subprocess.run(command + ["--recheck"], capture_output=True, text=True, timeout=300)
    assert checked.returncode == 0 and "8x256x128x2 M=1: error" in checked.stdout, checked.stdout + checked.stderr
    with open(path) as f:
        record = json.load(f)["checked"]["plain"]["1"]
    assert record["graph"] and record["rel_err"] <= 2.5e-2


@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="tuning needs a GPU")
def test_tuning_weight_only_weights_writes_the_formats_entry(tmp_path):
    import subprocess
    import sys

    import torch

    from fmoe2 import FusedMoEConfig
    from fmoe2.gemm.config import ConfigMode, ConfigProblem, resolve_config
    from fmoe2.target import target_of

    command = [sys.executable, "-m", "fmoe2.tune", "--shape", "8x256x128x2", "--m", "1,64", "--weights", "mxfp4",
               "--config-dir", str(tmp_path)]
    run = subprocess.run(command, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "2 points to tune" in run.stdout, run.stdout
    with open(_tuned_path("8x256x128x2", _args(tmp_path, weights="mxfp4"))) as f:
        stored = json.load(f)
    assert list(stored) == ["checked", "mxfp4"] and list(stored["mxfp4"]) == ["1", "64"]  # (no plain entries)
    for M in (1, 64):
        assert stored["checked"]["mxfp4"][str(M)]["rel_err"] <= stored["checked"]["mxfp4"][str(M)]["bound"] == 2.5e-2
        entry = FusedMoEConfig.from_dict(stored["mxfp4"][str(M)])
        # stored as the forward ran it: the forward reading it runs it unchanged
        problem = ConfigProblem(M, 8, 256, 128, 2, torch.bfloat16)
        assert resolve_config(problem, ConfigMode(weight_format="mxfp4"), target_of(), entry) == entry
    again = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0 and "0 points to tune (2 already in their tuned files" in again.stdout, again.stdout
    refused = subprocess.run(command + ["--dtype", "fp8"], capture_output=True, text=True, timeout=120)
    assert refused.returncode != 0 and "--weights mxfp4" in refused.stderr, refused.stderr


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


class _Config:
    def __init__(self, name):
        self.name = name

    def to_dict(self):
        return {"name": self.name}


def test_the_fastest_config_that_matches_the_reference_is_picked():
    import torch

    from fmoe2.tune import checked_pick

    reference = torch.randn(6, 8)
    wrong, unwritten, right, slow = (_Config(n) for n in ("wrong", "unwritten", "right", "slow"))
    written = {"wrong": reference + 1.0, "right": reference, "slow": reference}

    def forward(cfg, out):
        assert out.dtype == torch.float16 and torch.isnan(out).all()  # each call starts from a poisoned output
        if cfg.name in written:
            out.copy_(written[cfg.name])

    results = [(slow, 30.0), (right, 20.0), (unwritten, 5.0), (wrong, 10.0)]
    best, us, check = checked_pick(results, forward, reference, torch.float16, 2.5e-2, "test")
    assert best is right and us == 20.0 and check["faster_failed"] == 2 and check["rel_err"] < 1e-3
    # The search's ranked results are walked in their order (the final round's times come first, on another clock
    # than the quick times after them)
    best, us, _ = checked_pick([(wrong, 9.0), (slow, 12.0), (right, 3.0)], forward, reference, torch.float16,
                               2.5e-2, "test", ranked=True)
    assert best is slow and us == 12.0
    with pytest.raises(RuntimeError, match="none of the 2 configs"):
        checked_pick([(wrong, 1.0), (unwritten, 2.0)], forward, reference, torch.float16, 2.5e-2, "test")
    calls = []

    def racy(cfg, out):  # right once, then wrong: a race shows on the second call
        calls.append(cfg)
        out.copy_(reference if len(calls) % 2 else reference * 2)

    with pytest.raises(RuntimeError):
        checked_pick([(right, 1.0)], racy, reference, torch.float16, 2.5e-2, "test")

    replaying = []

    def graph_forward(cfg, out):  # right when called, wrong for "right" when replayed as a CUDA graph would
        forward(cfg, out)
        if replaying and cfg is right:
            out.mul_(2)

    def replay(forward_into, out):
        replaying.append(True)
        try:
            forward_into(out)
        finally:
            replaying.clear()

    best, _, check = checked_pick(results, graph_forward, reference, torch.float16, 2.5e-2, "test", replay=replay)
    assert best is slow and check["faster_failed"] == 3 and check["graph"]
    assert not checked_pick(results, forward, reference, torch.float16, 2.5e-2, "test")[2]["graph"]


def test_checks_are_recorded_beside_the_entries(tmp_path):
    path = _tuned_path("gpt-oss-20b", _args(tmp_path))
    entry = {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128, "BLOCK_H": 128}
    _store(path, None, 16, entry, dict(rel_err=3e-3, bound=2.5e-2, faster_failed=0))
    _store(path, "fp8", 1, entry, dict(rel_err=9e-3, bound=2e-2, faster_failed=1))
    _store(path, None, 1, entry, dict(rel_err=2e-3, bound=2.5e-2, faster_failed=0))
    with open(path) as f:
        stored = json.load(f)
    assert list(stored["checked"]["plain"]) == ["1", "16"] and stored["checked"]["fp8"]["1"]["faster_failed"] == 1
    _store(path, None, 16, entry)  # an entry written without a check keeps no older record
    with open(path) as f:
        assert list(json.load(f)["checked"]["plain"]) == ["1"]
    from fmoe2.gemm.config import ConfigProblem, tuned_config

    import torch

    # the loader reads the entries alone
    assert tuned_config(ConfigProblem(16, 32, 2880, 2880, 4, torch.bfloat16), device_config_name(), str(tmp_path),
                        (None,)) is not None


def test_shapes_are_spread_over_gpus_largest_first():
    from fmoe2.tune import _one_name_per_shape, _without_gpus, shown_line, spread_shapes

    work = {"a": 10.0, "b": 7.0, "c": 5.0, "d": 4.0, "e": 1.0}
    assert spread_shapes(work, 2) == [["a", "d"], ["b", "c", "e"]]  # 14 and 13
    assert spread_shapes(work, 8) == [["a"], ["b"], ["c"], ["d"], ["e"]]
    assert _without_gpus(["--shape", "served", "--gpus", "4", "--dtype", "fp8", "--gpus=2", "--shape=x"]) == \
        ["--dtype", "fp8"]
    assert _one_name_per_shape(["gpt-oss-20b", "32x2880x2880x4", "8x256x128x2", "gpt-oss-20b"]) == \
        ["gpt-oss-20b", "8x256x128x2"]
    assert shown_line(b"\r  s M=1 [#   ] 1/4\r  s M=1 [####] 4/4 best 9.1 us\n") == "  s M=1 [####] 4/4 best 9.1 us"
    assert shown_line(b"[1/2] s M=1: 9.1 us \xff\n") == "[1/2] s M=1: 9.1 us \ufffd"


@pytest.mark.gpu
def test_tuning_on_two_gpus_spreads_the_shapes(tmp_path):
    import subprocess
    import sys

    # two GPUs: the first two this process was given, else (an xdist worker pinned to one) two the driver lists
    given = [g for g in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if g.strip()]
    try:
        listed = [str(i) for i in range(len(os.listdir("/proc/driver/nvidia/gpus")))]
    except OSError:
        listed = []
    gpus = given if len(given) >= 2 else listed
    if len(gpus) < 2:
        pytest.skip("needs two GPUs")
    command = [sys.executable, "-m", "fmoe2.tune", "--shape", "8x256x128x2,4x128x256x1", "--m", "1", "--gpus", "2",
               "--config-dir", str(tmp_path)]
    run = subprocess.run(command, capture_output=True, text=True, timeout=900,
                         env={**os.environ, "CUDA_VISIBLE_DEVICES": ",".join(gpus[:2])})
    assert run.returncode == 0, run.stdout[-3000:]
    assert f"GPU {gpus[0]}: " in run.stdout and f"GPU {gpus[1]}: " in run.stdout, run.stdout[-3000:]
    assert f"[GPU {gpus[1]}] [1/1]" in run.stdout and "\r" not in run.stdout, run.stdout[-3000:]
    for shape in ("8x256x128x2", "4x128x256x1"):
        with open(_tuned_path(shape, _args(tmp_path))) as f:
            stored = json.load(f)
        assert "1" in stored and stored["checked"]["plain"]["1"]["rel_err"] <= 2.5e-2


def test_recheck_runs_on_one_gpu_whatever_gpus_asks(monkeypatch):
    # (spread over GPUs, a recheck found no point still to tune and checked nothing)
    import fmoe2.tune as tune

    calls = []
    monkeypatch.setattr(tune.torch.cuda, "is_available", lambda: True)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    monkeypatch.setattr(tune, "recheck", lambda shapes, ms, a: calls.append(("recheck", shapes)) or 0)
    monkeypatch.setattr(tune, "tune_on_gpus", lambda *args: calls.append(("spread",)) or 0)
    assert tune.main(["--shape", "gpt-oss-20b,glm-4.5-air", "--recheck", "--gpus", "2"]) == 0
    assert calls == [("recheck", ["gpt-oss-20b", "glm-4.5-air"])]


@pytest.mark.parametrize("extra", [["--dtype", "fp8"], ["--deterministic"]])
def test_weight_only_tuning_refuses_fp8_and_deterministic_mode(extra, capsys):
    # --weights tunes weight-only weights with 16-bit activations: with fp8 weights or deterministic mode it is refused
    # by name before anything runs (no GPU needed to be told).
    from fmoe2.tune import main

    with pytest.raises(SystemExit):
        main(["--shape", "gpt-oss-20b", "--weights", "mxfp4", *extra])
    assert "--weights mxfp4 tunes weight-only quantized weights" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--shape", "gpt-oss-20b", "--weights", "int5"])
    assert "invalid choice: 'int5'" in capsys.readouterr().err


@pytest.mark.parametrize("mode", [dict(fp8=True), dict(weight_format="int4"), dict(weight_format="mxfp4"),
                                  dict(weight_format="int8"), dict()], ids=["fp8", "int4", "mxfp4", "int8", "16bit"])
def test_a_fitted_search_starts_from_its_modes_rules_pick(mode):
    # fp8's rules take the two-stage path at decode where the 16-bit pick runs fused: the search's first candidate is
    # the mode's own rules pick (fmoe2_candidates), so a search times what runs without a tuned file.
    import torch

    from fmoe2.gemm.config import ConfigMode, ConfigProblem, get_config, resolve_config
    from fmoe2.shapes import ALL_SHAPES
    from fmoe2.target import target_of
    from fmoe2.tune import fitted_candidates

    config_mode = ConfigMode(fp8=mode.get("fp8", False), weight_format=mode.get("weight_format", "16bit"))
    for shape in ("qwen3-30b-a3b", "gpt-oss-20b", "deepseek-v3"):
        E, H, I, topk = ALL_SHAPES[shape]
        for M in (1, 16, 128, 1024, 4096):
            problem = ConfigProblem(M, E, H, I, topk, torch.bfloat16)
            pick = get_config(M, E, H, I, topk, torch.bfloat16, tuned=False, **mode)
            ran = fitted_candidates(M, E, H, I, topk, torch.bfloat16,
                                    lambda cfg: resolve_config(problem, config_mode, target_of(), cfg),
                                    mode.get("weight_format"), mode.get("fp8", False))
            assert ran[0] == pick and len(set(ran)) == len(ran) > 10, (shape, M)
