"""The one-launch decode (fmoe2/gemm/decode.py, launches.decodes_in_one_launch): an eager forward of one token on
the plain fused path runs one launch of the fused kernel, which reads the token's top-k slots itself and adds into
an accumulator kept per stream that it leaves zeroed. Checked under the interpreter against the float64 reference,
on poisoned outputs, with the launches each call made recorded; on the GPU (bound launches, CUDA graphs, two
streams) in tests/test_gpu.py."""
from dataclasses import replace

import pytest
import torch

import fmoe2
from fmoe2 import FusedMoEConfig, fused_moe, prepare_weights
from fmoe2.gemm.decode import kept_accumulators, release_kept_accumulators
from fmoe2.gemm.fused_moe import forward_launches
from fmoe2.launch import LaunchSpec
from helpers import DEVICE, assert_matches_reference, make_lora, make_problem, make_token_lora_ids, poisoned

SMALL = FusedMoEConfig(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, BLOCK_H=16)


@pytest.fixture
def launched(monkeypatch):
    """The names of the launches made through Triton's JIT since the test began (every launch, under the
    interpreter)."""
    names = []
    original = LaunchSpec.launch

    def launch(spec):
        names.append(spec.name)
        return original(spec)

    monkeypatch.setattr(LaunchSpec, "launch", launch)
    release_kept_accumulators()
    yield names
    release_kept_accumulators()


def _assert_decoded(launched):
    """The launches one call made through the JIT were the decode's: alone under the interpreter; on a GPU a plan's
    first call also runs (and binds) the sort path, which CUDA graphs capture, and later calls launch the bound
    decode directly (tests/test_gpu.py checks those)."""
    assert launched in (["decode"], ["sort", "fused", "decode"]) if DEVICE != "cpu" else launched == ["decode"], \
        launched
    launched.clear()


def _assert_kept_accumulators_zero():
    kept = kept_accumulators()
    assert kept, "no one-launch decode ran"
    for key, accumulator in kept.items():
        assert not accumulator.any(), (key, accumulator)


CASES = {
    "plain": dict(),
    "E not a power of two, odd H and I": dict(E=7, H=40, I=24, topk=3),
    "top-1": dict(topk=1),
    "top-8, two slots on one expert": dict(E=10, topk=8, ids=[[4, 1, 4, 0, 9, 3, 2, 7]]),
    "a dropped slot": dict(ids=[[2, 99, 5]]),
    "negative ids, int64": dict(ids=[[-1, 3, -7]], id_dtype=torch.int64),
    "fp32": dict(dtype=torch.float32, config=replace(SMALL, accumulate_fp32=True)),
    "prepared weights": dict(prepared=True),
    "expert_map": dict(expert_map=True),
    "biases, gpt-oss activation": dict(biases=True),
    "wide slices": dict(config=replace(SMALL, BLOCK_N=32, BLOCK_H=32)),
}


def _problem(E=6, H=48, I=40, topk=3, dtype=torch.float16, ids=None, id_dtype=torch.int32, seed=0, **_):
    x, w1, w2, tw, ti = make_problem(1, E, H, I, topk, dtype, seed=seed, id_dtype=id_dtype)
    if ids is not None:
        ti = torch.tensor(ids, dtype=id_dtype, device=DEVICE)
    return x, w1, w2, tw, ti


def _run(case, seed=0, out=True):
    """``(out, reference arguments and options)`` of one forward of ``CASES[case]``."""
    spec = CASES[case]
    x, w1, w2, tw, ti = _problem(seed=seed, **spec)
    kwargs = dict(config=spec.get("config", SMALL))
    ref_kwargs = {}
    E, H = w1.shape[0], x.shape[1]
    if spec.get("expert_map"):  # global ids over 2E experts, the even ones local
        expert_map = torch.full((2 * E,), -1, dtype=torch.int32)
        expert_map[::2] = torch.arange(E, dtype=torch.int32)
        kwargs["expert_map"] = ref_kwargs["expert_map"] = expert_map.to(DEVICE)
        ti = torch.tensor([[0, 3, 2 * E - 2]], dtype=torch.int32, device=DEVICE)  # one slot on another rank
    if spec.get("biases"):
        gen = torch.Generator(device="cpu").manual_seed(seed)
        kwargs.update(w1_bias=torch.randn(E, w1.shape[1], generator=gen).to(DEVICE, x.dtype),
                      w2_bias=torch.randn(E, H, generator=gen).to(DEVICE, x.dtype), activation="swiglu_oai",
                      swiglu_limit=7.0, gate_up_interleaved=True)
        ref_kwargs.update({k: kwargs[k] for k in ("w1_bias", "w2_bias", "activation", "swiglu_limit",
                                                   "gate_up_interleaved")})
    weights = (w1, w2)
    if spec.get("prepared"):
        weights = (prepare_weights(w1, w2, pad_to=8), None)
    if out:
        kwargs["out"] = poisoned(1, H, x.dtype)
    result = fused_moe(x, *weights, tw, ti, **kwargs)
    return result, (x, w1, w2, tw, ti), ref_kwargs


@pytest.mark.parametrize("case", list(CASES))
def test_one_token_runs_one_launch_and_matches_the_reference(case, launched):
    out, args, ref_kwargs = _run(case)
    _assert_decoded(launched)
    assert_matches_reference(out, *args, **ref_kwargs)
    _assert_kept_accumulators_zero()


def test_a_token_routed_nowhere_comes_out_zero(launched):
    x, w1, w2, tw, _ = _problem()
    ti = torch.tensor([[-1, 6, 1 << 20]], dtype=torch.int32, device=DEVICE)
    out = fused_moe(x, w1, w2, tw, ti, out=poisoned(1, x.shape[1], x.dtype), config=SMALL)
    _assert_decoded(launched)
    assert (out == 0).all()
    _assert_kept_accumulators_zero()


def test_calls_after_calls_find_the_kept_accumulator_zeroed(launched):
    # Each call's last adder casts the row, then zeroes it and the add counter: the next call, of this shape or of
    # a wider or narrower one (one accumulator per stream, grown to the widest), starts from zeros. Without the
    # reset the second call would add onto the first's sums.
    for seed, shape in enumerate([dict(H=48), dict(H=48), dict(H=120, I=24), dict(H=40), dict(H=120, I=24)]):
        x, w1, w2, tw, ti = _problem(seed=seed, **shape)
        out = fused_moe(x, w1, w2, tw, ti, out=poisoned(1, x.shape[1], x.dtype), config=SMALL)
        assert_matches_reference(out, x, w1, w2, tw, ti)
        _assert_kept_accumulators_zero()
        if DEVICE == "cpu" or seed in (0, 2, 3):  # (a GPU launches a plan's later calls directly, unrecorded)
            _assert_decoded(launched)
    assert not launched
    assert [a.numel() for a in kept_accumulators().values()] == [121]
    # The outgrown 49-element accumulator stays allocated (another thread's launch may hold its address) until
    # released.
    from fmoe2.gemm import decode

    assert [a.numel() for a in decode._OUTGROWN] == [49]
    release_kept_accumulators()
    assert not decode._OUTGROWN and not kept_accumulators()


def test_the_sort_path_at_one_token_gives_the_same_output():
    # What a CUDA-graph capture runs at M=1 (sort, then the fused kernel casting): the same sums.
    x, w1, w2, tw, ti = _problem(E=10, topk=8, seed=3)
    decoded = fused_moe(x, w1, w2, tw, ti, config=SMALL)
    sorted_path = poisoned(1, x.shape[1], x.dtype)
    runs = forward_launches(x, w1, w2, tw, ti, out=sorted_path, config=SMALL)
    assert [name for name, _ in runs] == ["sort", "fused"]
    for _, run in runs:
        run()
    assert_matches_reference(sorted_path, x, w1, w2, tw, ti)
    torch.testing.assert_close(sorted_path, decoded, rtol=2e-3, atol=2e-3)


@pytest.mark.parametrize("what", ["two tokens", "two-stage path", "adapters", "deterministic", "16-bit adds",
                                  "fp32 adds"])
def test_forwards_it_does_not_apply_to_keep_their_launches(what, launched):
    M = 2 if what == "two tokens" else 1
    x, w1, w2, tw, ti = make_problem(M, 6, 48, 40, 3, torch.float32 if what == "fp32 adds" else torch.float16)
    kwargs = dict(config=SMALL, out=poisoned(M, 48, x.dtype))
    ref_kwargs = {}
    if what == "two-stage path":
        kwargs["path"] = "two_stage"
    if what == "adapters":
        ref_kwargs = dict(lora=make_lora(2, 6, 48, 40, 16, torch.float16), token_lora_ids=make_token_lora_ids(1, 2))
        ref_kwargs["token_lora_ids"].fill_(1)
        kwargs.update(ref_kwargs)
    if what == "deterministic":
        kwargs.update(deterministic=True, path="auto")
    if what == "16-bit adds":
        kwargs["config"] = replace(SMALL, accumulate_fp32=False)
    out = fused_moe(x, w1, w2, tw, ti, **kwargs)
    assert_matches_reference(out, x, w1, w2, tw, ti, **ref_kwargs)
    assert "decode" not in launched and "sort" in launched, launched
    assert not kept_accumulators()


def test_the_decode_can_be_turned_off_and_its_buffers_released(launched):
    x, w1, w2, tw, ti = _problem(seed=6)

    def call():
        out = fused_moe(x, w1, w2, tw, ti, out=poisoned(1, x.shape[1], x.dtype), config=SMALL)
        assert_matches_reference(out, x, w1, w2, tw, ti)

    with pytest.raises(TypeError, match="enabled must be a bool"):
        fmoe2.set_one_launch_decode(1)
    fmoe2.set_one_launch_decode(False)
    try:
        call()
    finally:
        fmoe2.set_one_launch_decode(True)
    assert "decode" not in launched and not kept_accumulators(), launched
    launched.clear()
    with fmoe2.sort_path_only():  # a caller's own op around fused_moe, under reduce-overhead
        call()
    assert "decode" not in launched and not kept_accumulators(), launched
    launched.clear()
    call()
    _assert_kept_accumulators_zero()
    # A kept accumulator left non-zero (a launch that did not finish) spoils the calls after it, until released;
    # clear_plan_cache releases them too.
    for accumulator in kept_accumulators().values():
        accumulator.fill_(1.0)
    fmoe2.clear_plan_cache()
    assert not kept_accumulators()
    call()
    _assert_kept_accumulators_zero()


def test_the_one_launch_decode_refuses_what_it_does_not_compute():
    from fmoe2.gemm.launches import decode_launch
    from fmoe2.gemm.fused_moe import check_fused_moe_args, pick_config
    from fmoe2.target import target_of

    x, w1, w2, tw, ti = make_problem(2, 6, 48, 40, 3, torch.float16)
    problem = check_fused_moe_args(x, w1, w2, tw, ti, "silu", None, None, SMALL)
    target = target_of(x.device)
    with pytest.raises(ValueError, match="one token's fused forward"):
        decode_launch(problem, tw, ti, "silu", torch.empty_like(x), None, pick_config(problem, SMALL, "auto", target),
                      target, torch.zeros(49, device=DEVICE))


def test_the_registered_op_runs_the_sort_path(launched):
    # torch.compile runs torch.ops.fmoe2.fused_moe, whose calls keep no buffer: Inductor's CUDA-graph trees run a
    # compiled step's first calls while allocating into their own pool, and a kept accumulator allocated there stops
    # them recording (the GPU test of reduce-overhead at M=1 runs the compiled model first). Eager calls after it
    # decode in one launch again.
    x, w1, w2, tw, ti = _problem(seed=4)
    prepared = prepare_weights(w1, w2)

    def forward(x, tw, ti):
        return fmoe2.fused_moe(x, prepared, None, tw, ti, config=SMALL)

    compiled = torch.compile(forward, fullgraph=True, backend="eager")(x, tw, ti)
    assert "decode" not in launched and "sort" in launched and not kept_accumulators(), launched
    launched.clear()
    eager = forward(x, tw, ti)
    _assert_decoded(launched)
    torch.testing.assert_close(compiled, eager, rtol=2e-3, atol=2e-3)
    assert_matches_reference(compiled, x, w1, w2, tw, ti)
    _assert_kept_accumulators_zero()


@pytest.mark.skipif(DEVICE != "cpu", reason="a launch interrupted midway exists under the interpreter only")
def test_an_interrupted_call_leaves_no_dirty_accumulator(monkeypatch, launched):
    # Ctrl-C in a notebook during a one-token CPU call: the interpreter runs the programs one after another, so the
    # first programs have added into the kept accumulator and counted their adds when the interrupt comes. Before
    # the fix the next call found the counter past zero, cast a partial row (relative error 0.3-0.55) and left the
    # rest behind for the call after it.
    from fmoe2.gemm import epilogues

    x, w1, w2, tw, ti = _problem(E=10, topk=8, seed=7)
    original, calls = epilogues._cast_finished_rows, []

    def interrupted(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:  # two programs have added and counted
            raise KeyboardInterrupt
        return original(*args, **kwargs)

    monkeypatch.setattr(epilogues, "_cast_finished_rows", interrupted)
    with pytest.raises(KeyboardInterrupt):
        fused_moe(x, w1, w2, tw, ti, config=SMALL)
    monkeypatch.setattr(epilogues, "_cast_finished_rows", original)
    assert len(calls) == 3
    _assert_kept_accumulators_zero()
    for seed in (8, 9):
        x, w1, w2, tw, ti = _problem(E=10, topk=8, seed=seed)
        out = fused_moe(x, w1, w2, tw, ti, out=poisoned(1, x.shape[1], x.dtype), config=SMALL)
        assert_matches_reference(out, x, w1, w2, tw, ti)
        _assert_kept_accumulators_zero()


def test_calls_from_several_threads_at_once_stay_right(launched):
    # Under the interpreter the programs of a launch run through module-level state of Triton's: before the fix two
    # threads' launches at once failed with unrelated errors or, at one token, returned wrong rows and left the kept
    # accumulator dirty for the next call. On a GPU the threads' launches go to one stream, one after another.
    import threading

    problems = [_problem(E=10, topk=8, seed=20 + t) if t % 2 == 0 else
                make_problem(5, 10, 48, 40, 8, torch.float16, seed=20 + t) for t in range(4)]
    outs, errors = [None] * len(problems), []

    def work(t):
        try:
            for _ in range(2):
                outs[t] = fused_moe(*problems[t], config=SMALL)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(repr(e))

    threads = [threading.Thread(target=work, args=(t,)) for t in range(len(problems))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors
    for out, problem in zip(outs, problems):
        assert_matches_reference(out, *problem)
    _assert_kept_accumulators_zero()
    x, w1, w2, tw, ti = _problem(E=10, topk=8, seed=30)
    assert_matches_reference(fused_moe(x, w1, w2, tw, ti, config=SMALL), x, w1, w2, tw, ti)


@pytest.mark.skipif(DEVICE != "cpu", reason="a launch interrupted midway exists under the interpreter only")
def test_an_interrupted_call_does_not_spoil_another_threads_waiting_call(monkeypatch, launched):
    # The interrupted launch's accumulator is zeroed before the interpreter is free again: a second thread's
    # one-token call that waited for it starts from zeros, and its own adds are not wiped halfway.
    import threading
    import time

    from fmoe2.gemm import epilogues

    original, calls, started = epilogues._cast_finished_rows, [], threading.Event()
    interrupted_thread = threading.current_thread()

    def interrupted(*args, **kwargs):
        if threading.current_thread() is interrupted_thread:
            calls.append(1)
            started.set()
            if len(calls) == 3:
                time.sleep(0.5)  # the other thread is waiting for the interpreter by now
                raise KeyboardInterrupt
        return original(*args, **kwargs)

    monkeypatch.setattr(epilogues, "_cast_finished_rows", interrupted)
    # The zeroing must happen while this thread still holds the interpreter (else the waiting thread may be
    # adding into the accumulator by then: a matter of thread scheduling, so checked directly).
    from fmoe2.gemm import plan as plan_module
    from fmoe2.launch import INTERPRETER_LOCK

    kept, zeroed_holding = plan_module.kept_accumulator, []

    def watched(*args):
        accumulator = kept(*args)
        if threading.current_thread() is interrupted_thread:
            real_zero = accumulator.zero_
            accumulator.zero_ = lambda: (zeroed_holding.append(INTERPRETER_LOCK._is_owned()), real_zero())[1]
        return accumulator

    monkeypatch.setattr(plan_module, "kept_accumulator", watched)
    other = _problem(E=10, topk=8, seed=11)
    result = {}

    def waiting_call():
        started.wait()
        result["out"] = fused_moe(*other, config=SMALL)

    thread = threading.Thread(target=waiting_call)
    thread.start()
    with pytest.raises(KeyboardInterrupt):
        fused_moe(*_problem(E=10, topk=8, seed=10), config=SMALL)
    thread.join()
    assert zeroed_holding == [True]
    assert_matches_reference(result["out"], *other)
    for accumulator in kept_accumulators().values():
        accumulator.__dict__.pop("zero_", None)
    _assert_kept_accumulators_zero()
