"""The benchmark's tuned files (fmoe2/bench/report.py write_tuned_configs) keep what the tuner wrote besides."""
import json

from fmoe2.bench.report import write_tuned_configs


def test_rewritten_tuned_files_keep_the_deterministic_and_fp8_entries(tmp_path):
    picked = {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128, "BLOCK_H": 128, "path": "fused"}
    result = {"results": [dict(E=8, H=64, I=32, topk=2, M=m, fmoe2_config=picked, fmoe2_rel_err=3e-3) for m in (1, 16)]}
    (tmp_path / "GPU__s.json").write_text(json.dumps(result))
    tuned = tmp_path / "configs" / "GPU" / "E=8,H=64,I=32,topk=2,dtype=bfloat16.json"
    tuned.parent.mkdir(parents=True)
    sections = {"deterministic": {"1": dict(picked, path="two_stage")}, "fp8": {"16": dict(picked, BLOCK_N=128)}}
    fp8_check = {"16": dict(rel_err=6e-3, bound=2e-2, faster_failed=0, graph=True)}
    checked = {"plain": {"4096": dict(rel_err=4e-3, bound=2.5e-2, faster_failed=0, graph=True)}, "fp8": fp8_check}
    tuned.write_text(json.dumps({"1": {"BLOCK_M": 64}, "4096": {"BLOCK_M": 64}, **sections, "checked": checked}))
    assert write_tuned_configs(str(tmp_path), "GPU", str(tmp_path / "configs")) == [str(tuned)]
    plain = {m: dict(rel_err=3e-3, bound=2.5e-2, faster_failed=0, graph=False) for m in ("1", "16")}
    assert json.loads(tuned.read_text()) == {"1": picked, "16": picked, **sections,
                                             "checked": {"plain": plain, "fp8": fp8_check}}
