"""CPU checks of the benchmarks' timing order (the CUDA parts stubbed: which graph replays when)."""
import fmoe2.bench.timing as timing


class _Graph:
    def __init__(self, name, log):
        self.name, self.log = name, log

    def replay(self):
        self.log.append(("warm", self.name))

    def reset(self):
        pass


def test_each_round_captures_again_and_starts_further_on_so_no_graph_keeps_its_place(monkeypatch):
    # Each round captures every graph again, in its order, then replays each once as a warm-up and times it; round i
    # starts at graph i * n // rounds, so no variant holds the same place (in the round or in the capture order, hence
    # the same scratch addresses) in every round. The medians are each variant's own times.
    log = []
    monkeypatch.setattr(timing, "capture_graph", lambda fn, calls, warmup_calls: log.append(("capture", fn())) or _Graph(fn(), log))
    monkeypatch.setattr(timing.torch.cuda, "synchronize", lambda: None)
    speed = {"a": 1.0, "b": 2.0, "c": 3.0, "d": 4.0}
    monkeypatch.setattr(timing, "replay_times", lambda graph, calls, replays: (
        log.append(("time", graph.name)) or [speed[graph.name]] * replays))
    fns = {name: (lambda name=name: name) for name in "abcd"}
    assert timing.time_graphs_in_turns(fns, rounds=2, calls=2, replays=4) == speed
    timed = [name for kind, name in log if kind == "time"]
    assert timed == list("abcd") + list("cdab")
    assert [name for kind, name in log if kind == "warm"] == timed
    assert [name for kind, name in log if kind == "capture"] == timed
    log.clear()
    timing.time_graphs_in_turns(fns, rounds=4, calls=2, replays=4)
    rounds = ["".join(name for kind, name in log if kind == "time")[i:i + 4] for i in range(0, 16, 4)]
    assert rounds == ["abcd", "bcda", "cdab", "dabc"]  # (as many rounds as graphs: each place once)
    captured = "".join(name for kind, name in log if kind == "capture")
    assert captured == "".join(rounds)
