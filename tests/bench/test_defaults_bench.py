"""The defaults benchmark: vLLM's default-config rule, the candidates it times, its report (no GPU); one run end to end
(GPU only)."""
import pytest
import torch

from fmoe2.bench.defaults import candidate_configs, markdown, rule_index
from fmoe2.bench.vllm_style import vllm_default_config
from fmoe2.gemm.config import ConfigMode, ConfigProblem, resolve_config
from fmoe2.shapes import ALL_SHAPES
from fmoe2.target import NAMED_TARGETS


def test_vllm_default_rule_by_batch_size():
    tiles = lambda M, E=32: (lambda c: (c.BLOCK_M, c.BLOCK_N, c.BLOCK_K, c.num_warps, c.num_stages))(
        vllm_default_config(M, E))
    assert tiles(1) == tiles(32) == (16, 64, 128, 4, 4)
    assert tiles(33) == tiles(64) == (32, 64, 128, 4, 3)
    assert tiles(65) == tiles(96) == (32, 128, 64, 4, 3)
    assert tiles(97) == tiles(128) == (64, 128, 64, 4, 3)
    assert tiles(129) == tiles(512) == (64, 128, 64, 8, 3)
    assert tiles(513) == tiles(65536) == (128, 128, 64, 8, 3)
    # Groups of 16 tiles once more than 128 tokens per expert (M // E > 128).
    assert vllm_default_config(4096, 32).GROUP_M == 1 and vllm_default_config(4128, 32).GROUP_M == 16
    assert vllm_default_config(4096, 8, hip=True).num_stages == 2
    fp8 = [vllm_default_config(M, 256, fp8_block=True) for M in (16, 64, 65)]
    assert [(c.BLOCK_M, c.GROUP_M) for c in fp8] == [(16, 1), (16, 32), (64, 32)]
    assert all((c.BLOCK_N, c.BLOCK_K, c.num_warps) == (128, 128, 4) for c in fp8)


def test_candidates_are_fitted_configs_that_run_as_they_are():
    # Each candidate is what fused_moe runs when passed it: fitting it again changes nothing.
    target = NAMED_TARGETS["sm_90"]
    for name in ("gpt-oss-20b", "mixtral-8x22b", "qwen3-235b-a22b-tp8"):
        for M in (1, 16, 128, 1024, 4096):
            for fp8 in (False, True):
                problem = ConfigProblem(M, *ALL_SHAPES[name], torch.bfloat16)
                candidates = candidate_configs(problem, fp8, target)
                assert len(set(candidates.values())) == len(candidates) >= 4
                for label, cfg in candidates.items():
                    assert label.endswith("/" + cfg.path), label
                    assert resolve_config(problem, ConfigMode(fp8=fp8), target, cfg) == cfg, (name, M, label)


def test_rule_index_and_report():
    rules = [{"max_tokens_per_expert": 4}, {"max_tokens_per_expert": 12}, {"max_tokens_per_expert": 1e18}]
    assert [rule_index(rules, t) for t in (0.1, 4, 4.5, 12, 13, 1e6)] == [0, 0, 1, 1, 2, 2]
    row = dict(shape="s", M=1, tokens_per_expert=0.5, floor_us=0.8, failed=["rule0/fused"],
               us={"auto": 1.0, "defaults": 1.1, "vllm-default": 1.5, "rule0/fused": float("nan"), "rule1/fused": 0.9})
    result = dict(device="GPU", dtype="bf16", routing="uniform", date="today", torch="t", triton="tr", command="cmd",
                  tuned_shapes=[], rules_fitted_on=["s"], results=[row])
    report = markdown(result)
    assert "| s | 1 | 0.5 | 1.0 | 1.1 | 1.5 | 1.50 | 1.36 | 0.8 | 1.38 | 1.88 | rule1/fused 0.9 | 1.22 |" in report


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the benchmark needs a GPU")
def test_defaults_benchmark_of_one_shape_with_compiling_processes(tmp_path):
    import json
    import subprocess
    import sys

    command = [sys.executable, "-m", "fmoe2.bench.defaults", "--shapes", "qwen3-30b-a3b", "--m", "1,40", "--candidates",
               "--compile-workers", "2", "--rounds", "1", "--out-dir", str(tmp_path)]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "qwen3-30b-a3b: candidates compiled in 2 processes" in proc.stdout, proc.stdout
    [path] = [p for p in tmp_path.iterdir() if p.name.endswith("__bf16_uniform.json")]
    rows = json.loads(path.read_text())["results"]
    assert [r["M"] for r in rows] == [1, 40]
    for r in rows:  # every variant checked against the reference, none off it, each timed
        assert not r["failed"] and {"auto", "defaults", "vllm-default"} <= set(r["us"]), r
        assert all(t > 0 for t in r["us"].values()) and r["floor_us"] > 0, r
