"""Expert parallelism on the CPU: ``fmoe2.bench.expert_parallel`` under ``torch.distributed.run`` with two
gloo processes (the kernels under the Triton interpreter). A tiny random Qwen3-MoE and gpt-oss, split
over the two ranks by transformers' own expert parallelism with ``experts_implementation="fmoe2"``,
decode the greedy tokens of the same model in one process, and both ranks run their experts through
fmoe2. The same script runs on GPUs with NCCL (the two-GPU run: fmoe2/bench/expert_parallel.py)."""
import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")

from tiny_models import available, build  # noqa: E402


def _expert_parallel_in_transformers() -> bool:
    try:
        from transformers.distributed import DistributedConfig
    except ImportError:
        return False
    return "ep_size" in getattr(DistributedConfig, "__dataclass_fields__", {})


pytestmark = [
    pytest.mark.skipif(not _expert_parallel_in_transformers(), reason="transformers without expert parallelism (5.18+)"),
    pytest.mark.skipif(importlib.util.find_spec("accelerate") is None,
                       reason="transformers' expert parallelism needs accelerate"),
    pytest.mark.skipif(not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
                       reason="no gloo backend in this torch"),
]


TEARDOWN_ABORT = "terminate called without an active exception"


def _decode(model_dir, out, processes: int, backends: str = "fmoe2") -> dict:
    """The results by backend of one launch: ``out`` has ``{backend}`` in it where ``backends`` names several."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={processes}"] \
        if processes > 1 else [sys.executable]
    command = [*launcher, "-m", "fmoe2.bench.expert_parallel", "decode", str(model_dir), "--out", str(out), "--dtype",
               "fp32", "--steps", "16", "--batch", "2", "--backend", backends]
    proc = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600)
    if proc.returncode and processes > 1 and TEARDOWN_ABORT in proc.stderr:
        # A rank aborted in C++ with no Python error (std::terminate on a joinable thread, no traceback): 3 of 26
        # two-process runs on a 2-core machine under load (2026-11-29; 0 of 18 on the tree before that day's
        # changes, none of which starts a thread: the cause is not found), never twice in a row. Once more.
        first = proc.stderr
        proc = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600)
        assert proc.returncode == 0, f"twice: {first[-2000:]}\n---\n{proc.stderr[-2000:]}"
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = {}
    for backend in backends.split(","):
        with open(str(out).replace("{backend}", backend)) as f:
            results[backend] = json.load(f)
    return results


@pytest.mark.parametrize("model_type", ["qwen3_moe", "gpt_oss"])
def test_two_expert_parallel_ranks_decode_the_tokens_of_one_process(model_type, tmp_path):
    if not available(model_type):
        pytest.skip(f"{model_type} is not in this transformers")
    model = build(model_type, layers=2)  # 4 experts: 2 per rank
    model.save_pretrained(tmp_path / "model")
    one = _decode(tmp_path / "model", tmp_path / "one.json", 1)["fmoe2"]
    # Both backends' runs on two ranks in one launch: starting two processes (torch, transformers) was most of a run's
    # time on the CPU.
    two, own_two = _decode(tmp_path / "model", tmp_path / "two_{backend}.json", 2, "fmoe2,grouped_mm").values()
    from fmoe2.bench.expert_parallel import agreement

    assert (two["backend"], own_two["backend"]) == ("fmoe2", "grouped_mm")
    assert two["world_size"] == 2 and len(two["points"][0]["fmoe2_calls"]) == 2
    assert "torch.distributed.run --nproc-per-node 2 -m fmoe2.bench.expert_parallel decode" in two["command"]
    assert one["command"].startswith("python -m fmoe2.bench.expert_parallel decode") and one["device"] == "cpu"
    assert all(calls > 0 for calls in two["points"][0]["fmoe2_calls"])  # both ranks' experts ran on fmoe2
    assert one["points"][0]["fmoe2_calls"][0] > 0
    assert agreement(one, two) >= 0.95
    # transformers' own experts (grouped_mm: its eager experts of gpt-oss raise on the other ranks' ids) on the same
    # split decode the same tokens. In bf16 (2026-11-27, tiny Qwen3-MoE) fmoe2 on two H200s decoded exactly the tokens
    # of transformers' eager experts on two gloo ranks, and on one GPU those of one process, while one rank and two
    # ranks differed at 19% of positions with either backend: docs/transformers.md#expert-parallelism-on-two-gpus.
    assert own_two["world_size"] == 2 and own_two["points"][0]["fmoe2_calls"] == [0, 0]
    assert agreement(two, own_two) >= 0.95


def test_several_backends_in_one_launch_need_a_result_name_each():
    from fmoe2.bench.expert_parallel import main

    with pytest.raises(SystemExit) as refused:  # (one --out for both: the second result would overwrite the first)
        main(["decode", "model", "--out", "ep2.json", "--backend", "fmoe2,grouped_mm"])
    assert refused.value.code == 2


def test_the_step_time_table_sets_runs_side_by_side():
    from fmoe2.bench.expert_parallel import step_time_table

    def run(backend, world, times):
        return {"backend": backend, "world_size": world, "dtype": "bf16", "device": "GPU", "date": "2026-11-27",
                "torch": "2.11", "triton": "3.6", "command": "python -m fmoe2.bench.expert_parallel decode",
                "points": [{"batch": b, "decode_step_ms": t} for b, t in times.items()]}

    text = step_time_table({"one.json": run("fmoe2", 1, {1: 4.891, 8: 5.0}),
                            "ep2.json": run("grouped_mm", 2, {1: 11.25})})
    assert "| batch | fmoe2, 1 rank | grouped_mm, 2 ranks |" in text
    assert "| 1 | 4.89 | 11.25 |" in text and "| 8 | 5.00 | - |" in text
    assert "`ep2.json`: grouped_mm, 2 ranks, bf16, GPU, 2026-11-27" in text
