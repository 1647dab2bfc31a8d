"""The layout benchmark's weights (fmoe2/bench/layout.py: each layout is what it says, the same values) and the
reports of the layout and decode benchmarks, on the CPU."""
import pytest
import torch

from fmoe2 import PreparedMoEWeights
from fmoe2.bench.decode_interleaved import markdown as decode_markdown
from fmoe2.bench.layout import LAYOUTS, layout_weights, ratios_to_k_contiguous
from fmoe2.bench.layout import markdown as layout_markdown


@pytest.mark.parametrize("interleaved", [False, True])
def test_each_layout_holds_the_same_weights_in_its_own_strides(interleaved):
    E, H, I = 3, 24, 40
    w1, w2 = torch.randn(E, 2 * I, H).half(), torch.randn(E, H, I).half()
    biases = dict(w1_bias=torch.randn(E, 2 * I).half(), w2_bias=torch.randn(E, H).half())
    k1, k2, keywords = layout_weights(w1, w2, "k_contiguous", interleaved, biases)
    assert k1.stride(2) == 1 and k2.stride(2) == 1 and keywords["gate_up_interleaved"] == interleaved
    n1, n2, keywords = layout_weights(w1, w2, "n_contiguous", interleaved, biases)
    assert (n1.stride(1), n2.stride(1)) == (1, 1) and n1.stride(2) == 2 * I and n2.stride(2) == H
    assert torch.equal(n1, w1) and torch.equal(n2, w2) and keywords["w1_bias"] is biases["w1_bias"]
    prepared, none, keywords = layout_weights(w1, w2, "prepared", interleaved, biases)
    assert isinstance(prepared, PreparedMoEWeights) and none is None and keywords == {}
    with pytest.raises(ValueError, match="layout"):
        layout_weights(w1, w2, "columns", interleaved, biases)
    assert LAYOUTS == ("k_contiguous", "n_contiguous", "prepared")


def test_layout_report_has_a_row_per_gate_up_order_with_ratios_to_k_contiguous():
    us = {f"{layout}/interleaved/bias": t for layout, t in zip(LAYOUTS, (100.0, 95.0, 101.0))}
    us.update({f"{layout}/concatenated/no_bias": t for layout, t in zip(LAYOUTS, (50.0, 60.0, 40.0))})
    ratio = ratios_to_k_contiguous(us)
    assert ratio["n_contiguous/interleaved/bias"] == 0.95 and ratio["n_contiguous/concatenated/no_bias"] == 1.2
    assert ratio["k_contiguous/concatenated/no_bias"] == 1.0
    row = dict(shape="gpt-oss-20b", M=64, us=us, rel_err={}, ratio=ratio)
    text = layout_markdown(dict(device="GPU", date="d", torch="t", triton="tr", command="c", rows=[row]))
    assert "| gpt-oss-20b | 64 | interleaved | bias | 100.0 | 95.0 | 101.0 | 0.95x | 1.01x |" in text
    assert "| gpt-oss-20b | 64 | concatenated | no bias | 50.0 | 60.0 | 40.0 | 1.20x | 0.80x |" in text


def test_decode_report_has_rates_agreement_and_logits_errors():
    result = dict(device="GPU", date="d", torch="t", triton="tr", command="c", transformers="5", layers=4, prompt=64,
                  new_tokens=32, rounds=3, backends=["eager", "grouped_mm", "fmoe2"], batches=[1, 64],
                  rows=[dict(model="gpt-oss-20b", batch=64, median_tokens_per_s={"eager": 100.0, "grouped_mm": 200.0,
                                                                                 "fmoe2": 500.0},
                             same_tokens_as_eager={"grouped_mm": 0.5, "fmoe2": 0.75},
                             errors={"batched_mm": "OutOfMemoryError"})],
                  logits_rel_err={"gpt-oss-20b": {"eager": {1: {"grouped_mm": 0.01, "fmoe2": 0.012}},
                                                  "eager_fp32": {64: {"eager": 0.02, "grouped_mm": 0.01,
                                                                      "fmoe2": 0.005}}}})
    text = decode_markdown(result)
    assert "| gpt-oss-20b | 64 | 100.0 | 200.0 | 500.0 | 2.50x | 75% / 50% |" in text
    assert "| gpt-oss-20b | 1 | 1.00e-02 | 1.20e-02 | 1.20x |" in text
    assert "| gpt-oss-20b | 64 | 2.00e-02 | 1.00e-02 | 5.00e-03 | 0.50x |" in text
    assert "gpt-oss-20b batch 64 batched_mm: OutOfMemoryError" in text


def test_decode_report_compares_fmoe2_and_the_ceiling_with_the_best_other_backend_alone():
    from fmoe2.bench.decode_interleaved import CEILING_BACKEND, no_experts

    result = dict(device="GPU", date="d", torch="t", triton="tr", command="c", transformers="5", layers=4, prompt=64,
                  new_tokens=32, rounds=3, backends=["grouped_mm", "fmoe2", CEILING_BACKEND], batches=[8],
                  rows=[dict(model="qwen3-30b-a3b", batch=8,
                             median_tokens_per_s={"grouped_mm": 100.0, "fmoe2": 110.0, CEILING_BACKEND: 115.0},
                             same_tokens_as_eager={"grouped_mm": 0.5, "fmoe2": 0.75}, errors={})],
                  logits_rel_err={"qwen3-30b-a3b": {"eager": {1: {"grouped_mm": 0.01, "fmoe2": 0.012}}}})
    text = decode_markdown(result)
    # fmoe2 over grouped_mm (not over the faster ceiling), then the ceiling over grouped_mm
    assert "| qwen3-30b-a3b | 8 | 100.0 | 110.0 | 115.0 | 1.10x | 1.15x | 75% / 50% |" in text
    assert "ceiling / best other" in text and CEILING_BACKEND not in text.split("Logits")[1]
    for report in (text, decode_markdown(dict(result, backends=["grouped_mm", "fmoe2"]))):
        for block in report.split("\n\n"):  # every table's rows as wide as its header
            rows = [line for line in block.splitlines() if line.startswith("|")]
            assert len({row.count("|") for row in rows}) <= 1, rows
    hidden = torch.randn(5, 16)
    assert torch.equal(no_experts(None, hidden, None, None), torch.zeros(5, 16))
