"""CPU checks of the benchmarks' timing order (the CUDA parts stubbed: which graph is captured, replays and is reset
when)."""
import pytest

import fmoe2.bench.timing as timing


class _Graph:
    def __init__(self, name, log):
        self.name, self.log = name, log

    def replay(self):
        self.log.append(("warm", self.name))

    def reset(self):
        self.log.append(("reset", self.name))


def _stubbed(monkeypatch, speed, log, fail_capture_of=None):
    def capture(fn, calls, warmup_calls):
        name = fn()
        if name == fail_capture_of:
            raise RuntimeError("capture failed")
        log.append(("capture", name))
        return _Graph(name, log)

    monkeypatch.setattr(timing, "capture_graph", capture)
    monkeypatch.setattr(timing.torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(timing, "replay_times", lambda graph, calls, replays: (
        log.append(("time", graph.name)) or [speed[graph.name]] * replays))
    return {name: (lambda name=name: name) for name in speed}


def test_each_round_captures_again_and_starts_further_on_so_no_graph_keeps_its_place(monkeypatch):
    # Each round captures every graph again, in its order, then replays each once as a warm-up and times it, then
    # resets them all; round i starts at graph i * n // rounds, so no variant holds the same place (in the round or in
    # the capture order, hence the same scratch addresses) in every round. The medians are each variant's own times.
    log = []
    speed = {"a": 1.0, "b": 2.0, "c": 3.0, "d": 4.0}
    fns = _stubbed(monkeypatch, speed, log)
    assert timing.time_graphs_in_turns(fns, rounds=2, calls=2, replays=4) == speed
    round_log = lambda order: ([("capture", n) for n in order]  # noqa: E731
                               + [e for n in order for e in (("warm", n), ("time", n))] + [("reset", n) for n in order])
    assert log == round_log("abcd") + round_log("cdab")
    log.clear()
    timing.time_graphs_in_turns(fns, rounds=4, calls=2, replays=4)
    assert log == round_log("abcd") + round_log("bcda") + round_log("cdab") + round_log("dabc")  # (each place once)


def test_a_failed_capture_resets_the_graphs_captured_before_it(monkeypatch):
    log = []
    fns = _stubbed(monkeypatch, {"a": 1.0, "b": 2.0, "c": 3.0}, log, fail_capture_of="c")
    with pytest.raises(RuntimeError, match="capture failed"):
        timing.time_graphs_in_turns(fns, rounds=2, calls=2, replays=4)
    assert log == [("capture", "a"), ("capture", "b"), ("reset", "a"), ("reset", "b")]
