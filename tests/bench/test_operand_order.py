"""The operand-order study (fmoe2/bench/operand_order.py): each kind of weights and operand order computes the
product it times, on odd sizes (N and K not multiples of the blocks, fewer rows than BLOCK_M), under the
interpreter on the CPU or compiled on a GPU; and its report."""
import torch

from fmoe2.bench.operand_order import Problem, Variant, run, write_report

KINDS = ("bf16", "int8", "int8-swapped")


def test_every_kind_and_order_computes_the_product_on_odd_sizes():
    device = "cuda" if torch.cuda.is_available() else "cpu"
    block_n = 64 if device == "cuda" else 32  # (a swapped tile is the A operand: 16 rows per warp on the GPU)
    rows = run([Problem("odd", 3, 2, 80, 96), Problem("one row", 2, 1, 48, 40)],
               [Variant(kind, block_n, 32, 4, 2) for kind in KINDS], device)
    assert len(rows) == 6 and all(r["rel_err"] < 1e-2 for r in rows)


def test_the_report_names_the_fastest_config_of_each_kind(tmp_path):
    rows = [dict(problem="p", weights=kind, label=f"{kind} {n}", us=us, weight_gbs=1000.0 / us)
            for kind in KINDS for n, us in ((64, 2.0), (128, 1.0))]
    record = dict(device="GPU X", date="d", torch="t", triton="tr", command="c")
    text = open(write_report(rows, 2000.0, record, str(tmp_path))).read()
    for kind in KINDS:
        assert f"| p | {kind} | {kind} 128 | 1.0 | 1000 | 50% |" in text


def test_an_unknown_kind_of_weights_is_refused():
    import pytest

    from fmoe2.bench.operand_order import main

    with pytest.raises(SystemExit):
        main(["--weights", "bf16,int9"])
