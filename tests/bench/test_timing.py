"""CPU checks of the benchmarks' timing order (the CUDA parts stubbed: which graph replays when)."""
import fmoe2.bench.timing as timing


class _Graph:
    def __init__(self, name, log):
        self.name, self.log = name, log

    def replay(self):
        self.log.append(("warm", self.name))

    def reset(self):
        pass


def test_graphs_take_turns_every_other_round_in_reverse(monkeypatch):
    # Each round replays every graph once as a warm-up then times it; odd rounds go in reverse, so no variant
    # holds the first place of every round. The medians are each graph's own times.
    log = []
    monkeypatch.setattr(timing, "capture_graph", lambda fn, calls, warmup_calls: _Graph(fn(), log))
    monkeypatch.setattr(timing.torch.cuda, "synchronize", lambda: None)
    speed = {"a": 1.0, "b": 2.0, "c": 3.0}
    monkeypatch.setattr(timing, "replay_times", lambda graph, calls, replays: (
        log.append(("time", graph.name)) or [speed[graph.name]] * replays))
    fns = {name: (lambda name=name: name) for name in "abc"}
    assert timing.time_graphs_in_turns(fns, rounds=3, calls=2, replays=4) == speed
    timed = [name for kind, name in log if kind == "time"]
    assert timed == list("abc") + list("cba") + list("abc")
    assert [name for kind, name in log if kind == "warm"] == timed
