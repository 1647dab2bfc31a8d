"""The fp8 benchmark's report (fmoe2/bench/fp8.py) from a recorded result: the x-scales table only where a row timed
both quantizations of x, and what the main table's x was."""
from fmoe2.bench.fp8 import _with_x_scales, markdown
from fmoe2 import fp8


def _row(shape, M, x_scales=None, x_per_token=None):
    row = dict(shape=shape, M=M, fmoe2_fp8_us=100.0, fmoe2_fp8_path="two_stage", fmoe2_fp8_fused_us=120.0,
               fmoe2_fp8_two_stage_us=100.0, baseline_fp8_us=130.0, fmoe2_bf16_us=150.0, speedup_vs_baseline=1.3,
               speedup_vs_bf16=1.5, fraction_of_floor=0.5, rel_err_same_quant={"auto": 6e-3},
               baseline_rel_err_same_quant=7e-3, fp8_rel_err_vs_unquantized=6.4e-2)
    if x_per_token is not None:
        row["x_per_token"] = x_per_token
    if x_scales:
        row["x_scales"] = {name: dict(us=us, rel_err=err) for name, (us, err) in x_scales.items()}
    return row


def _result(rows, scheme):
    return {"device": "GPU", "date": "2026-11-30", "torch": "2.11", "triton": "3.6", "command": "python -m fmoe2.bench",
            "scheme": scheme, "results": rows}


def test_the_x_scales_table_has_the_rows_that_timed_both():
    text = markdown(_result([_row("qwen3-30b-a3b", 1024, {"per_token": (90.0, 6.0e-3), "per_group": (99.0, 6.1e-3)},
                                  x_per_token=True), _row("qwen3-30b-a3b", 16, x_per_token=True)], "channel"))
    assert "x: quantized per token" in text
    table = text.split("x quantized per token against per group")[1]
    assert "| qwen3-30b-a3b | 1024 | 90.0 | 99.0 | 1.10x | 6.0e-03 | 6.1e-03 |" in table
    assert "| qwen3-30b-a3b | 16 |" not in table
    assert "(3 rounds, each capturing again)" in text  # (the first recorded results: no round count in the rows)
    row = _row("qwen3-30b-a3b", 1024, {"per_token": (90.0, 6.0e-3), "per_group": (99.0, 6.1e-3)})
    row["x_scales_rounds"] = 4
    assert "(4 rounds, each capturing again)" in markdown(_result([row], "channel"))


def test_a_result_without_the_x_scales_reads_as_before():
    # (results recorded before the x-scales variants: x per group of 128, no second table)
    text = markdown(_result([_row("mixtral-8x7b", 128)], "block"))
    assert "x: quantized per group of 128" in text and "against per group" not in text
    assert "| mixtral-8x7b | 128 | 100.0 | two_stage |" in text


def test_the_x_scales_setting_is_put_back_even_when_the_call_raises():
    kept = fp8.PER_TOKEN_ACTIVATIONS
    seen = []
    assert _with_x_scales(not kept, lambda: seen.append(fp8.PER_TOKEN_ACTIVATIONS) or 7) == 7
    assert seen == [not kept] and fp8.PER_TOKEN_ACTIVATIONS == kept

    def fails():
        raise RuntimeError("x")
    try:
        _with_x_scales(not kept, fails)
    except RuntimeError:
        pass
    assert fp8.PER_TOKEN_ACTIVATIONS == kept
