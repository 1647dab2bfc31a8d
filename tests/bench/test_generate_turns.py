"""The decode benchmarks' timing loop (fmoe2/bench/model.py generate_times_in_turns) and the PEFT benchmark's
rows from it (fmoe2/bench/peft_decode.py decode_row), with stand-in generate functions on the CPU."""
import pytest

from fmoe2.bench.model import generate_times_in_turns
from fmoe2.bench.peft_decode import decode_row


def test_runs_take_turns_after_a_warm_up_and_a_failing_run_is_recorded_and_left_out():
    calls = []

    def run(name):
        def generate(tokens):
            calls.append((name, tokens))
            if name == "oom":
                raise RuntimeError("CUDA out of memory")
        return generate

    times = generate_times_in_turns({"a": run("a"), "oom": run("oom"), "b": run("b")}, tokens=9, rounds=2)
    warm_up = [("a", 9), ("oom", 9), ("b", 9)]
    one_round = [("a", 1), ("a", 9), ("b", 1), ("b", 9)]
    assert calls == warm_up + one_round * 2
    assert list(times) == ["a", "oom", "b"]
    assert times["oom"] == {"error": "RuntimeError: CUDA out of memory"}
    assert len(times["a"]["prefill_s"]) == len(times["b"]["total_s"]) == 2


def test_a_row_has_the_median_prefill_and_the_decode_rate_of_the_model_benchmark():
    times = {"prefill_s": [0.1, 0.3, 0.2], "total_s": [1.2, 0.9, 1.0], "peak_bytes": 7}
    row = decode_row(times, batch=8, new_tokens=33)
    assert row["prefill_s"] == 0.2 and row["peak_bytes"] == 7
    assert row["decode_tokens_per_s"] == pytest.approx(8 * 32 / (1.0 - 0.2))
    assert decode_row({"error": "OutOfMemoryError"}, 8, 33) == {"error": "OutOfMemoryError"}
