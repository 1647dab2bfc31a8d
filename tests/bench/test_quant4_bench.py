"""The weight-only benchmark (fmoe2/bench/quant4.py): the int4 group of a shape (one that divides both K sizes), its
report, and the search grid fitted per format."""
import pytest

from fmoe2.bench.quant4 import int4_group
from fmoe2.shapes import ALL_SHAPES


def test_int4_group_divides_both_k_sizes():
    assert int4_group(4096, 1536) == 128
    assert int4_group(2880, 2880) == 64  # gpt-oss: 2880 = 45 x 64
    assert int4_group(96, 160) == 32
    with pytest.raises(ValueError, match="H=48, I=40"):
        int4_group(48, 40)
    for name, (E, H, I, topk) in ALL_SHAPES.items():
        if H % 32 == 0 and I % 32 == 0:
            group = int4_group(H, I)
            assert H % group == 0 and I % group == 0, name


def test_the_report_names_int4_with_its_group():
    from fmoe2.bench.quant4 import markdown

    def row(fmt, group):
        us = {"bf16": 100.0, fmt: 50.0, "vllm-w4a16": 80.0}
        return dict(shape="gpt-oss-20b", format=fmt, group=group, M=16, us=us, floor_us=25.0,
                    rel_err={"bf16": 1e-3, fmt: 4e-3})

    result = dict(device="GPU X", date="d", torch="t", triton="tr", command="c",
                  ceilings={"copy_bytes_per_s": 4.2e12}, rows=[row("int4", 64), row("mxfp4", 32)])
    text = markdown(result)
    assert "| gpt-oss-20b | int4-g64 | 16 | 100.0 | 50.0 | 2.00 | 25.0 | 50% | 80.0 | 1.60 | 4.0e-03 |" in text
    assert "| gpt-oss-20b | mxfp4 | 16 |" in text


def test_the_report_lists_each_launch_timed_alone():
    from fmoe2.bench.quant4 import markdown

    us = {"bf16": 100.0, "mxfp4": 60.0, "vllm-w4a16": 80.0}
    row = dict(shape="gpt-oss-20b", format="mxfp4", group=32, M=1, us=us, floor_us=13.0,
               rel_err={"bf16": 1e-3, "mxfp4": 4e-3},
               launches={"bf16": {"sort": 2.5, "stage1": 40.0, "stage2": 15.0},
                         "mxfp4": {"sort": 2.5, "stage1": 41.0, "stage2": 16.5}})
    result = dict(device="GPU X", date="d", torch="t", triton="tr", command="c",
                  ceilings={"copy_bytes_per_s": 4.2e12}, rows=[row, dict(row, M=16, launches=None)])
    result["rows"][0] = dict(row, us=dict(us, untuned=75.0), rel_err=dict(row["rel_err"], untuned=3e-3))
    result["rows"][1].pop("launches")
    text = markdown(result)
    assert ("| gpt-oss-20b | mxfp4 | 1 | sort 2.5, stage1 40.0, stage2 15.0 | sort 2.5, stage1 41.0, stage2 16.5 |"
            in text), text
    assert "| gpt-oss-20b | mxfp4 | 16 | sort" not in text  # (a row without the launches' times)
    assert "| gpt-oss-20b | mxfp4 | 1 | 60.0 | 75.0 | 1.25 | 3.0e-03 |" in text, text  # --untuned
    assert "| gpt-oss-20b | mxfp4 | 16 | 60.0 |" not in text


def test_the_untuned_pick_is_the_16bit_entry_fitted_as_the_forward_fits_a_callers_config():
    from types import SimpleNamespace

    import torch

    from fmoe2.bench.quant4 import untuned_pick
    from fmoe2.gemm.config import ConfigMode, ConfigProblem, resolve_config
    from fmoe2.target import NAMED_TARGETS

    shape = SimpleNamespace(E=32, H=2880, I=2880, topk=4)  # gpt-oss-20b, whose H200 file has mxfp4 entries
    problem = ConfigProblem(1024, 32, 2880, 2880, 4, torch.bfloat16)
    mode, target = ConfigMode(weight_format="mxfp4"), NAMED_TARGETS["sm_90"]
    tuned = resolve_config(problem, mode, target, tuned_for="NVIDIA_H200")
    plain = resolve_config(problem, ConfigMode(), target, tuned_for="NVIDIA_H200")
    untuned = resolve_config(problem, mode, target, untuned_pick(shape, 1024, target, "NVIDIA_H200"),
                             tuned_for="NVIDIA_H200")
    assert untuned != tuned and untuned.BLOCK_M == plain.BLOCK_M, (untuned, tuned, plain)


def test_the_search_grid_is_fitted_for_every_format():
    from fmoe2.bench.quant4 import FORMATS, search_candidates

    for fmt in FORMATS:  # ("int8-g128": the int8 format with groups)
        candidates = search_candidates(fmt, 16, 32, 2880, 2880, 4)
        assert candidates and len(set(candidates)) == len(candidates), fmt
        assert min(c.BLOCK_K for c in candidates) >= (16 if fmt.startswith("int8") else 32), fmt
