"""The CUDA-graph A/B's pure parts on CPU (fmoe2/bench/graph_ab.py): ``--modes``, each mode's weights and the
arguments a copy prepares from them, the reference and its bound, the report's mode column."""
import math

import pytest
import torch

import fmoe2
from fmoe2.bench import graph_ab

E, H, I, TOPK = 4, 256, 128, 2  # H, I: whole 128 x 128 fp8 blocks, and a part block of 2I rows at I = 192 below


def test_modes_parse_in_order_once_and_refuse_unknown_names():
    assert graph_ab.parse_modes("plain") == ["plain"]
    assert graph_ab.parse_modes("fp8, lora,fp8,deterministic") == ["fp8", "lora", "deterministic"]
    with pytest.raises(ValueError, match="bf16"):
        graph_ab.parse_modes("plain,bf16")
    with pytest.raises(ValueError):
        graph_ab.parse_modes("")
    assert graph_ab.parse_args(["--other", "x"]).modes == ["plain"]
    assert graph_ab.parse_args(["--other", "x", "--modes", "lora,deterministic"]).modes == ["lora", "deterministic"]
    assert graph_ab.parse_args(["--report", "r.json"]).report == "r.json"  # no --other needed to rewrite a report
    for argv in (["--other", "x", "--modes", "int4"], ["--modes", "plain"]):
        with pytest.raises(SystemExit):
            graph_ab.parse_args(argv)


@pytest.mark.parametrize("mode", graph_ab.MODES)
def test_mode_weights_and_each_copys_arguments(mode):
    gen = torch.Generator().manual_seed(0)
    weights = graph_ab.mode_weights(mode, E, H, 192, gen)
    assert weights["w1"].shape == (E, 2 * 192, H) and weights["w2"].shape == (E, H, 192)
    if mode == "fp8":
        assert weights["w1"].dtype == weights["w2"].dtype == torch.float8_e4m3fn
        assert weights["scales"]["block_shape"] == (128, 128)
        assert weights["scales"]["w1_scale"].shape == (E, 3, 2) and weights["scales"]["w2_scale"].shape == (E, 2, 2)
        assert weights["bound"] == 2e-2
    else:
        assert weights["w1"].dtype == torch.bfloat16 and weights["scales"] == {} and weights["bound"] == 2.5e-2
    assert weights["options"] == ({"deterministic": True} if mode == "deterministic" else {})
    assert (weights["lora"] is not None) == (mode == "lora")
    args = graph_ab.copy_arguments(fmoe2, weights)
    if mode in graph_ab.UNPREPARED_MODES:  # the tensors themselves, K- or N-contiguous
        assert args["weights"][0] is weights["w1"] and args["weights"][1] is weights["w2"]
        assert (weights["w1"].stride(1) == 1 and weights["w2"].stride(1) == 1) == (mode == "transposed")
        assert weights["w1"].stride(2) == (2 * 192 if mode == "transposed" else 1)
    else:
        assert isinstance(args["weights"][0], fmoe2.PreparedMoEWeights) and args["weights"][1] is None
        assert (args["weights"][0].s13 is not None) == (mode == "fp8")
    if mode == "lora":
        lora = weights["lora"]
        assert isinstance(lora, fmoe2.MoELoRA) and lora.gate_a.shape == (graph_ab.NUM_LORAS, E, graph_ab.LORA_RANK, H)
        assert isinstance(args["lora"], fmoe2.PreparedMoELoRA) and args["lora"].rank == graph_ab.LORA_RANK
    else:
        assert args["lora"] is None


@pytest.mark.parametrize("mode", ["lora", "fp8"])
def test_reference_and_the_bound_check(mode):
    gen = torch.Generator().manual_seed(1)
    weights = graph_ab.mode_weights(mode, E, H, I, gen)
    from fmoe2.bench.problems import make_inputs

    x, tw, ti = make_inputs(3, E, H, I, TOPK, gen)
    ids = torch.tensor([0, -1, 3], dtype=torch.int32) if mode == "lora" else None
    ref = graph_ab.reference_output(weights, x, tw, ti, ids)
    assert ref.shape == (3, H) and ref.dtype == torch.float32 and torch.isfinite(ref).all()
    if mode == "lora":  # the adapters change the rows of tokens with one, not the row of the token without
        plain = fmoe2.fused_moe_reference(x.float(), weights["w1"].float(), weights["w2"].float(), tw, ti)
        assert torch.allclose(ref[1], plain[1]) and not torch.allclose(ref[0], plain[0])
    assert graph_ab.checked_error("ok", ref.to(torch.bfloat16), ref, weights["bound"]) < weights["bound"]
    with pytest.raises(SystemExit, match="off"):
        graph_ab.checked_error("off", ref * 1.1, ref, weights["bound"])
    nan = ref.clone()
    nan[0, 0] = math.nan
    with pytest.raises(SystemExit, match="nan"):
        graph_ab.checked_error("nan", nan, ref, weights["bound"])


def test_report_has_a_mode_column_and_reads_rows_from_before_modes():
    result = {"device": "GPU", "date": "2026-12-01", "torch": "2.9", "triton": "3.5", "command": "graph_ab", "rows": [
        dict(shape="tiny", M=16, mode="fp8", this_us=10.0, other_us=11.0, ratio=10 / 11),
        dict(shape="tiny", M=1, this_us=5.0, other_us=5.0, ratio=1.0)]}
    md = graph_ab.markdown(result)
    assert "| shape | M | mode | this | other | this / other |" in md
    assert "| tiny | 16 | fp8 | 10.0 | 11.0 | 0.909 |" in md
    assert "| tiny | 1 | plain | 5.0 | 5.0 | 1.000 |" in md
