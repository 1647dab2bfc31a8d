"""The host-cost benchmark's report (fmoe2/bench/host.py) from a recorded result: every table, the one-launch decode's
rows only for the forwards that have one."""
from fmoe2.bench.host import decode_kernel_costs, markdown, one_launch_decode_costs


def _row(shape, decode):
    row = {"shape": shape, "M": 1, "auto_path": "fused", "forward_graph_us": 28.0, "forward_eager_one_call_us": 50.0,
           "forward_eager_back_to_back_us": 30.0}
    for variant in ("moe_sorting", "fused_moe_fused", "fused_moe_two_stage", "fused_moe_lora_fused",
                    "fused_moe_lora_two_stage"):
        row[f"{variant}_host_us"], row[f"{variant}_host_us_jit_launch"] = 20.0, 200.0
    if decode:
        row.update(decode_sort_path_host_us=27.0, decode_one_launch_host_us=15.0,
                   decode_sort_path_eager_one_call_us=55.0, decode_one_launch_eager_one_call_us=42.0)
    return row


def test_the_report_has_a_decode_row_for_each_forward_with_one_launch():
    result = {"device": "GPU", "date": "2026-11-27", "torch": "2.11", "triton": "3.6",
              "command": "python -m fmoe2.bench.host", "references": {"torch_add": 7.0},
              "forward": [_row("qwen3-30b-a3b", True), _row("mixtral-8x7b", False)], "compiled": []}
    text = markdown(result)
    # (a result recorded before the decode kernel's own column)
    assert "| qwen3-30b-a3b | 1 | 27.0 | 15.0 | 55.0 | 42.0 | 1.50x | - |" in text
    decode_table = text.split("The one-launch decode")[1]
    assert "mixtral-8x7b" not in decode_table
    assert "empty kernel" not in text  # (no recorded one-call floor: no sentence about it)
    assert "| qwen3-30b-a3b | 1 | fused | 50.0 | 30.0 | 28.0 | 1.79x | - | - |" in text  # (no one-replay time)
    assert one_launch_decode_costs(None, lambda: None) == {}
    assert decode_kernel_costs(None, None, None, None, None, lambda: None) == {}


def test_the_decode_table_gives_the_kernel_alone_and_the_one_call_floor():
    row = _row("deepseek-v2-lite", True)
    row["decode_kernel_graph_us"] = 30.3
    result = {"device": "GPU", "date": "2026-11-27", "torch": "2.11", "triton": "3.6",
              "command": "python -m fmoe2.bench.host",
              "references": {"torch_add": 7.0}, "empty_launch_one_call_us": 18.5,
              "forward": [row], "compiled": []}
    text = markdown(result)
    assert "| deepseek-v2-lite | 1 | 27.0 | 15.0 | 55.0 | 42.0 | 1.50x | 30.3 |" in text
    assert "empty kernel's bound launch from an idle GPU took 18.5 us" in text
    row["forward_graph_one_replay_us"] = 40.0
    assert "| deepseek-v2-lite | 1 | fused | 50.0 | 30.0 | 28.0 | 1.79x | 40.0 | 1.25x |" in markdown(result)
