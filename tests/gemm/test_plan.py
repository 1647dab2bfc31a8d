"""The cached plan of a forward (fmoe2/gemm/plan.py) and its bound launches (fmoe2/launch.py): a changed
input never reuses a stale plan, bound launches pass exactly what Triton's JIT would, and a forward
whose plan is cached stays within its Python-call budget.

Under the interpreter kernels launch through the JIT on every call; the bound (direct) launches are
checked here against compiled-kernel stand-ins that record what they are given, and on the GPU for real
(tests/test_gpu.py)."""
import sys
from dataclasses import replace

import pytest
import torch
from triton.tools.tensor_descriptor import TensorDescriptor

import fmoe2
from fmoe2 import FusedMoEConfig, fused_moe, prepare_lora, prepare_weights
from fmoe2.gemm.fused_moe import PLANS, check_fused_moe_args, plan_of
from fmoe2.gemm.plan import INPUT_SOURCES, source_addresses
from fmoe2.gemm.fused_moe_kernel import _fused_cast_kernel
from fmoe2.launch import LaunchSpec, bind_launches, kernel_parameters, set_launch_mode
from helpers import DEVICE, assert_matches_reference, make_lora, make_problem, make_token_lora_ids, poisoned

SMALL = FusedMoEConfig(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, BLOCK_H=16)
SMALL_TWO_STAGE = replace(SMALL, path="two_stage", S2_BLOCK_N=16, S2_BLOCK_K=16)


class RecordingKernel:
    """Stands in for a Triton CompiledKernel: its launcher records each launch."""

    function = "function-handle"
    packed_metadata = "packed-metadata"

    def __init__(self):
        self.launches = []

    def run(self, *args):
        self.launches.append(args)


def _flat(value):
    """An argument as a bound launch passes it: device addresses for tensors, a descriptor's fields, a tuple's
    elements so."""
    if isinstance(value, tuple):
        return tuple(_flat(v) for v in value)
    if isinstance(value, torch.Tensor):
        return value.data_ptr()
    if isinstance(value, TensorDescriptor):
        return ("descriptor", value.base.data_ptr(), list(value.shape), list(value.strides),
                list(value.block_shape), value.padding)
    return value


def _jit_arguments(spec: LaunchSpec) -> list:
    """Every argument of ``spec`` in the kernel's order, as the JIT hands them to the launcher."""
    from fmoe2.launch import kernel_parameters

    args = []
    for name, default in kernel_parameters(spec.kernel):
        args.append(_flat(spec.args[name] if name in spec.args else spec.constexprs.get(name, default)))
    return args


def _call(seed, M=21, E=5, H=40, I=24, topk=3, dtype=torch.float16, prepared=True, lora=False, expert_map=False,
          tma=False, config=SMALL, biases=False):
    x, w1, w2, tw, ti = make_problem(M, E * (2 if expert_map else 1), H, I, topk, dtype, seed=seed)
    kwargs = dict(config=replace(config, tma=tma), out=poisoned(M, H, dtype))
    if expert_map:
        emap = torch.full((2 * E,), -1, dtype=torch.int32)
        emap[::2] = torch.arange(E, dtype=torch.int32)
        kwargs["expert_map"] = emap.to(DEVICE)
        w1, w2 = w1[::2].contiguous(), w2[::2].contiguous()
    if lora:
        kwargs["lora"] = prepare_lora(make_lora(3, E, H, I, 16, dtype, seed=seed))
        kwargs["token_lora_ids"] = make_token_lora_ids(M, 3, seed=seed)
    bias = {}
    if biases:
        gen = torch.Generator(device="cpu").manual_seed(seed)
        bias = dict(w1_bias=torch.randn(w1.shape[0], 2 * I, generator=gen).to(DEVICE, dtype),
                    w2_bias=torch.randn(w1.shape[0], H, generator=gen).to(DEVICE, dtype),
                    activation="swiglu_oai", swiglu_limit=7.0)
    if prepared:
        weights = (prepare_weights(w1, w2, pad_to=8, **{k: v for k, v in bias.items() if k.endswith("bias")}), None)
        kwargs.update({k: v for k, v in bias.items() if not k.endswith("bias")})
    else:
        weights = (w1, w2)
        kwargs.update(bias)
    return (x, *weights, tw, ti), kwargs, (x, w1, w2, tw, ti)


def _specs_and_sources(args, kwargs):
    """The launch descriptions of a call on its plan (built by a first call), on a fresh scratch block, and
    the device addresses of the call's sources (INPUT_SOURCES, then the scratch buffers)."""
    plan = plan_of(*args, **kwargs)
    out = kwargs["out"] if kwargs.get("out") is not None else torch.empty_like(args[0])
    options = {k: kwargs[k] for k in ("w1_bias", "w2_bias", "swiglu_limit") if k in kwargs}
    problem = check_fused_moe_args(*args, kwargs.get("activation", "silu"), out, kwargs.get("expert_map"),
                                   kwargs["config"], "auto", kwargs.get("lora"), kwargs.get("token_lora_ids"),
                                   **options)
    block = plan.layout.allocate(args[0].device)
    specs = plan.specs(problem, args[3], args[4], out, kwargs.get("expert_map"), block)
    sources = source_addresses(problem, args[3], args[4], out, kwargs.get("expert_map"))
    return plan, specs, sources + [block.data_ptr() + o for o in plan.layout.offsets]


VARIANTS = [
    dict(), dict(config=SMALL_TWO_STAGE), dict(prepared=False), dict(lora=True), dict(lora=True, config=SMALL_TWO_STAGE),
    dict(expert_map=True), dict(tma=True), dict(tma=True, config=SMALL_TWO_STAGE), dict(dtype=torch.float32),
    dict(biases=True), dict(biases=True, prepared=False), dict(biases=True, config=SMALL_TWO_STAGE),
]


@pytest.mark.parametrize("variant", VARIANTS)
def test_the_fast_path_reads_every_source_the_checked_path_does(variant):
    # The cached path takes each launch's pointers from call_key's list of addresses; the first (checked)
    # call bound the launches to the sources of the validated problem. The two lists must agree, entry by
    # entry (out aside: the cached path allocates it), or a launch reads a pointer of the wrong tensor or 0.
    from fmoe2.gemm.fused_moe import call_key

    args, kwargs, _ = _call(11, **variant)
    fused_moe(*args, **kwargs)
    _, _, sources = _specs_and_sources(args, kwargs)
    names = ("activation", "out", "expert_map", "config", "path", "lora", "token_lora_ids", "w1_bias", "w2_bias",
             "gate_up_interleaved", "swiglu_alpha", "swiglu_limit")
    defaults = dict(activation="silu", path="auto", gate_up_interleaved=False, swiglu_alpha=1.702)
    options = {n: kwargs.get(n, defaults.get(n)) for n in names}
    key, fast = call_key(*args, options["activation"], options["out"], options["expert_map"], options["config"],
                         options["path"], options["lora"], options["token_lora_ids"], options["w1_bias"],
                         options["w2_bias"], options["gate_up_interleaved"], options["swiglu_alpha"],
                         options["swiglu_limit"])
    assert fast == sources[:len(INPUT_SOURCES)], [n for n, a, b in zip(INPUT_SOURCES, fast, sources) if a != b]


@pytest.mark.parametrize("variant", VARIANTS)
def test_bound_launches_pass_what_the_jit_would(variant, monkeypatch):
    # A plan's launches are bound on one call's tensors; later calls only write their own device addresses
    # into the slots. For a second call with other tensors (other addresses, same key) the bound arguments
    # must equal, one by one, those of the launch descriptions built from that call's own tensors.
    import importlib

    if variant.get("tma"):  # the chunked sort too: its count launch and table
        monkeypatch.setattr(importlib.import_module("fmoe2.sorting.moe_sorting"), "sort_chunk_size",
                            lambda num_keys, num_entries: 16)
    first_args, first_kwargs, _ = _call(1, **variant)
    fused_moe(*first_args, **first_kwargs)
    plan, first_specs, first_sources = _specs_and_sources(first_args, first_kwargs)
    bound = bind_launches(first_specs, [RecordingKernel() for _ in first_specs], first_sources)
    assert bound is not None and [b.name for b in bound] == [s.name for s in first_specs]
    second_args, second_kwargs, _ = _call(2, **variant)
    assert plan_of(*second_args, **second_kwargs) is plan  # same key
    _, second_specs, second_sources = _specs_and_sources(second_args, second_kwargs)
    assert all(a != b for a, b in zip(first_sources, second_sources) if a)  # other tensors: other addresses
    for launch, spec in zip(bound, second_specs):
        assert [_flat(v) for v in launch.arguments(second_sources)] == _jit_arguments(spec), spec.name
        assert launch.grid == tuple(spec.grid) + (1,) * (3 - len(spec.grid))
    names = [s.name for s in first_specs]
    if variant.get("tma"):
        assert names[0] == "sort_count"
        assert any(isinstance(v, TensorDescriptor) for s in first_specs for v in s.args.values())


def test_unbound_arguments_make_no_launches():
    # A tensor argument that is no source (here: an extra tensor) cannot be bound: the plan keeps the JIT.
    args, kwargs, _ = _call(3)
    fused_moe(*args, **kwargs)
    _, specs, sources = _specs_and_sources(args, kwargs)
    i = [spec.name for spec in specs].index("fused")
    stray = replace(specs[i], args={**specs[i].args, "x_ptr": torch.empty_like(args[0])})
    assert bind_launches(specs[:i] + [stray] + specs[i + 1:], [RecordingKernel() for _ in specs], sources) is None
    assert bind_launches(specs, [None] * len(specs), sources) is None  # the interpreter hands back no kernels
    twice = list(sources)
    twice[INPUT_SOURCES.index("topk_weights")] = twice[0]  # two sources at one address: ambiguous
    assert bind_launches(specs, [RecordingKernel() for _ in specs], twice) is None


def _bind_recording(args, kwargs):
    """Runs the call once (building its plan), then binds the plan's launches to recording kernels, so later
    calls take the direct path on the CPU."""
    fused_moe(*args, **kwargs)
    plan, specs, sources = _specs_and_sources(args, kwargs)
    kernels = [RecordingKernel() for _ in specs]
    plan.launches = bind_launches(specs, kernels, sources)
    assert plan.direct
    return plan, kernels


@pytest.mark.parametrize("lora", [False, True])
def test_a_cached_plan_launches_directly_with_this_calls_pointers(lora):
    args, kwargs, _ = _call(4, lora=lora)
    del kwargs["out"]
    plan, kernels = _bind_recording(args, kwargs)
    new_args, new_kwargs, _ = _call(5, lora=lora)
    del new_kwargs["out"]
    out = fused_moe(*new_args, **new_kwargs)  # the direct path: allocates out, launches each bound kernel once
    assert out.shape == args[0].shape and out.dtype == args[0].dtype
    for kernel, launch in zip(kernels, plan.launches):
        assert len(kernel.launches) == 1
        grid_x, grid_y, grid_z, stream, function, packed, metadata, enter, exit_hook, *kernel_args = kernel.launches[0]
        assert (grid_x, grid_y, grid_z) == launch.grid and stream == 0
        assert (function, packed, metadata, enter, exit_hook) == ("function-handle", "packed-metadata", None, None, None)
        for position, source in launch.pointer_slots:
            name = INPUT_SOURCES[source] if source < len(INPUT_SOURCES) else None
            if name == "hidden_states":
                assert kernel_args[position] == new_args[0].data_ptr()
            elif name == "out":
                assert kernel_args[position] == out.data_ptr()
            elif name == "topk_ids":
                assert kernel_args[position] == new_args[4].data_ptr()
    # Launch mode "jit" (and Triton launch hooks) take the JIT path again: nothing more is recorded.
    set_launch_mode("jit")
    try:
        assert not plan.direct
        assert_matches_reference(fused_moe(*new_args, **new_kwargs), *_call(5, lora=lora)[2],
                                 **({"lora": new_kwargs["lora"], "token_lora_ids": new_kwargs["token_lora_ids"]}
                                    if lora else {}))
    finally:
        set_launch_mode("direct")
    assert all(len(k.launches) == 1 for k in kernels)
    with pytest.raises(ValueError, match="launch mode"):
        set_launch_mode("fast")


class CudaLauncher:
    """Stands in for Triton 3.6's CUDA launcher: ``__call__`` asks for scratch where the kernel has any,
    then calls its C function ``launch`` (recorded here) with the launch flags ahead of the arguments."""

    def __init__(self, global_scratch_size=0):
        self.global_scratch_size, self.profile_scratch_size = global_scratch_size, 0
        self.launch_cooperative_grid, self.launch_pdl = False, True
        self.launches = []

    def launch(self, *args):
        self.launches.append(args)

    def __call__(self, gridX, gridY, gridZ, stream, function, *args):
        scratch = "scratch" if self.global_scratch_size else None
        self.launch(gridX, gridY, gridZ, stream, function, self.launch_cooperative_grid, self.launch_pdl, scratch,
                    None, *args)


class LauncherKernel(RecordingKernel):
    def __init__(self, launcher):
        super().__init__()
        self.run = launcher


@pytest.mark.parametrize("scratch", [0, 64])
def test_bound_launches_call_triton_36s_launcher_function_as_its_call_would(scratch):
    # fmoe2.launch.direct_launcher: with Triton 3.6's CUDA launcher and no scratch memory a bound launch calls
    # the launcher's C function with exactly what its __call__ would pass; with scratch it goes through __call__.
    from fmoe2.launch import BoundLaunch

    args, kwargs, _ = _call(7)
    fused_moe(*args, **kwargs)
    plan, specs, sources = _specs_and_sources(args, kwargs)
    direct, through_call = CudaLauncher(scratch), CudaLauncher(scratch)
    bound = BoundLaunch(specs[-1], LauncherKernel(direct), {p: i for i, p in enumerate(sources) if p})
    bound(0, sources)
    through_call(*bound.grid, 0, "function-handle", "packed-metadata", None, None, None, *bound.arguments(sources))
    assert direct.launches == through_call.launches and len(direct.launches) == 1
    assert (bound.run == direct.launch) == (scratch == 0)


EXPANDED = []  # base addresses make_tensordesc_arg expanded


def make_tensordesc_arg(arg, metadata):
    """Stands in for Triton 3.6's expansion of a tensor descriptor (there: a TMA descriptor encoded)."""
    EXPANDED.append(arg.base.data_ptr())
    return [("tma", arg.base.data_ptr(), metadata), *arg.shape, *arg.strides]


def wrap_handle_tensordesc(launcher, tensordesc_indices, tensordesc_meta):
    """Triton 3.6's wrapper of a launcher C function whose kernel takes tensor descriptors."""
    def inner(*args):
        final_args = list(args[:13])
        k = 0
        for i, arg in enumerate(args[13:]):
            if i in tensordesc_indices:
                final_args.extend(make_tensordesc_arg(arg, tensordesc_meta[k]))
                k += 1
            else:
                final_args.append(arg)
        return launcher(*final_args)
    return inner


class DescriptorLauncher(CudaLauncher):
    def __init__(self, positions):
        super().__init__()
        metadata = [{"swizzle": k} for k in range(len(positions))]
        self.launch = wrap_handle_tensordesc(self.record, set(positions), metadata)

    def record(self, *args):
        self.launches.append(args)


DescriptorLauncher.__name__ = "CudaLauncher"  # direct_launcher takes Triton's launcher by its class name

def test_bound_launches_expand_each_tensor_descriptor_once_per_address():
    # fmoe2.launch.descriptor_expansion: with Triton 3.6's wrapper (a TMA descriptor encoded on every launch) a
    # bound launch passes the C function what the wrapper would, expanding each descriptor once per address.
    from fmoe2.launch import BoundLaunch

    args, kwargs, _ = _call(8, tma=True)
    fused_moe(*args, **kwargs)
    plan, specs, sources = _specs_and_sources(args, kwargs)
    spec = next(sp for sp in specs if any(isinstance(v, TensorDescriptor) for v in sp.args.values()))
    source_of = {p: i for i, p in enumerate(sources) if p}
    probe = BoundLaunch(spec, RecordingKernel(), source_of)
    positions = [position for position, _, _ in probe.descriptor_slots]
    direct, through_call = DescriptorLauncher(positions), DescriptorLauncher(positions)
    bound = BoundLaunch(spec, LauncherKernel(direct), source_of)
    assert bound.expansion is not None and positions
    EXPANDED.clear()
    for _ in range(3):
        bound(0, sources)
    assert len(EXPANDED) == len(positions)  # once per descriptor, not per launch
    for _ in range(3):
        through_call(*bound.grid, 0, "function-handle", "packed-metadata", None, None, None,
                     *bound.arguments(sources))
    assert direct.launches == through_call.launches
    moved = list(sources)
    moved[probe.descriptor_slots[0][1]] += 4096  # another layer's weights: a new expansion
    EXPANDED.clear()
    bound(0, moved)
    assert len(EXPANDED) == 1
    through_call(*bound.grid, 0, "function-handle", "packed-metadata", None, None, None, *bound.arguments(moved))
    assert direct.launches[-1] == through_call.launches[-1]


def test_the_direct_path_refuses_an_overlapping_out():
    args, kwargs, _ = _call(6)
    _bind_recording(args, kwargs)
    x = args[0]
    with pytest.raises(ValueError, match="out overlaps hidden_states"):
        fused_moe(*args, **{**kwargs, "out": x})


# Python-level function calls of one forward on a cached plan (sys.setprofile "call" events, not counting
# the recording kernels, which stand for Triton's C launcher), measured 2026-11-25 with the code of this
# change: 11 whatever the path (9 plus the config's hash, taken twice, since these calls pass a config),
# 6 more with adapters (their tensors' keys), and 2 per launch (3 fused at these M=21 tokens: sort, fused kernel and
# the cast of its float32 accumulator, which at M=1 the fused kernel does itself; 3 two-stage, 7 two-stage
# with adapters). A forward that rebuilt its config, layout
# or launch descriptions would make hundreds.
FIXED_CALLS, LORA_CALLS, CALLS_PER_LAUNCH, SLACK = 11, 6, 2, 2


def _python_calls(fn) -> list:
    """``file:function`` of every Python-level call ``fn()`` makes (sys.setprofile), the recording kernels' own
    calls left out (they stand for Triton's C launcher)."""
    calls = []

    def profile(frame, event, arg):
        if event == "call" and frame.f_code is not RecordingKernel.run.__code__:
            calls.append(f"{frame.f_code.co_filename.rsplit('/', 1)[-1]}:{frame.f_code.co_name}")

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return calls


@pytest.mark.parametrize("lora", [False, True])
@pytest.mark.parametrize("config", [SMALL, SMALL_TWO_STAGE], ids=["fused", "two_stage"])
def test_a_forward_on_a_cached_plan_stays_within_its_python_call_budget(config, lora):
    args, kwargs, _ = _call(7, lora=lora, config=config)
    del kwargs["out"]
    plan, _ = _bind_recording(args, kwargs)
    calls = _python_calls(lambda: fused_moe(*args, **kwargs))
    budget = FIXED_CALLS + LORA_CALLS * lora + CALLS_PER_LAUNCH * len(plan.launches) + SLACK
    assert len(plan.launches) == {(False, "fused"): 3, (False, "two_stage"): 3, (True, "fused"): 3,
                                  (True, "two_stage"): 7}[lora, config.path]
    assert len(calls) <= budget, calls


def _stream():
    """The stream a direct launch gets: the current one on a GPU, 0 on the CPU."""
    from fmoe2.launch import raw_stream

    return raw_stream(torch.cuda.current_device()) if DEVICE != "cpu" else 0


def _bind_recording_decode(args, kwargs):
    """As :func:`_bind_recording` for a one-token call, with the plan's one-launch decode bound to a recording
    kernel too (the interpreter binds neither)."""
    from fmoe2.gemm import launches
    from fmoe2.gemm.decode import kept_accumulator

    plan, kernels = _bind_recording(args, kwargs)
    assert plan.decodes and (plan.alone is None) == (DEVICE == "cpu")  # (a GPU binds it for real)
    out = torch.empty_like(args[0])
    problem = check_fused_moe_args(*args, "silu", out, None, kwargs["config"], "auto", None, None)
    accumulator = kept_accumulator(args[0].device, _stream(), plan.decode_numel)
    spec = launches.decode_launch(problem, args[3], args[4], "silu", out, None, plan.config, plan.target, accumulator)
    sources = source_addresses(problem, args[3], args[4], out, None)
    decode_kernel = RecordingKernel()
    bound = bind_launches([spec], [decode_kernel], sources + [accumulator.data_ptr()])
    plan.alone = (bound[0], plan.kept_accumulator_address)
    return plan, kernels, decode_kernel, accumulator


def test_a_cached_one_token_plan_launches_the_decode_alone():
    args, kwargs, _ = _call(11, M=1)
    del kwargs["out"]
    plan, kernels, decode_kernel, accumulator = _bind_recording_decode(args, kwargs)
    new_args, new_kwargs, _ = _call(12, M=1)
    del new_kwargs["out"]
    out = fused_moe(*new_args, **new_kwargs)
    assert all(not k.launches for k in kernels) and len(decode_kernel.launches) == 1
    launch = plan.alone[0]
    grid_x, grid_y, grid_z, stream, function, packed, metadata, enter, exit_hook, *kernel_args = \
        decode_kernel.launches[0]
    assert (grid_x, grid_y, grid_z) == launch.grid and stream == _stream()
    by_name = dict(zip([name for name, _ in kernel_parameters(_fused_cast_kernel)], kernel_args))
    assert by_name["x_ptr"] == new_args[0].data_ptr() and by_name["final_out_ptr"] == out.data_ptr()
    assert by_name["out_ptr"] == accumulator.data_ptr()
    assert by_name["topk_weights_ptr"] == new_args[3].data_ptr() and by_name["topk_ids_ptr"] == new_args[4].data_ptr()
    assert by_name["sorted_token_ids_ptr"] is None and by_name["num_tokens"] == 1


def test_a_one_token_forward_on_its_cached_decode_stays_within_its_python_call_budget():
    args, kwargs, _ = _call(13, M=1)
    del kwargs["out"]
    _bind_recording_decode(args, kwargs)
    calls = _python_calls(lambda: fused_moe(*args, **kwargs))
    # One launch, and the kept accumulator's address (the plan's method and the lookup it calls).
    assert len(calls) <= FIXED_CALLS + CALLS_PER_LAUNCH + 2 + SLACK, calls


def test_a_plan_first_run_by_the_op_binds_its_decode_at_the_next_eager_call(monkeypatch):
    # A plan whose first run could not run the one-launch decode (inside the registered op, or captured) binds it at
    # the next call that may: that call takes the checked path once, the calls after it launch the decode alone.
    from fmoe2.gemm.decode import sort_path_only

    args, kwargs, _ = _call(14, M=1)
    del kwargs["out"]
    with sort_path_only():
        plan, kernels = _bind_recording(args, kwargs)
        plan.bindable, plan.decode_pending = True, True  # as a GPU leaves a plan first run inside the op
        fused_moe(*args, **kwargs)  # still the sort path, directly
    assert [len(k.launches) for k in kernels] == [1, 1] and plan.alone is None
    decode_kernel = RecordingKernel()
    original = LaunchSpec.launch

    def launch(spec):  # the interpreter hands back no compiled kernel: stand one in for the decode
        original(spec)
        return decode_kernel if spec.name == "decode" else None

    monkeypatch.setattr(LaunchSpec, "launch", launch)
    out = fused_moe(*args, **kwargs)  # binds the decode (its JIT run computes this call's output)
    assert plan.alone is not None and plan.alone[0].compiled is decode_kernel and not plan.decode_pending
    assert_matches_reference(out, *_call(14, M=1)[2])
    fused_moe(*args, **kwargs)
    assert len(decode_kernel.launches) == 1 and [len(k.launches) for k in kernels] == [1, 1]


def _changed(args, kwargs, what):
    x, w1, w2, tw, ti = args
    if what == "M":
        M = x.shape[0] - 4
        return (x[:M].contiguous(), w1, w2, tw[:M].contiguous(), ti[:M].contiguous()), {
            **kwargs, "out": poisoned(M, x.shape[1], x.dtype)}
    if what == "dtype":
        prepared = prepare_weights(*w1.unprepare(), pad_to=8)
        f32 = prepare_weights(prepared.unprepare()[0].float(), prepared.unprepare()[1].float(), pad_to=8)
        return (x.float(), f32, None, tw, ti), {**kwargs, "out": poisoned(x.shape[0], x.shape[1], torch.float32)}
    if what == "weights object":  # plain weights instead of prepared ones
        return (x, *w1.unprepare(), tw, ti), kwargs
    if what == "expert_map":
        return args, {**kwargs, "expert_map": torch.arange(w1.num_experts, dtype=torch.int32, device=DEVICE)}
    if what == "lora":
        M, E = x.shape[0], w1.num_experts
        return args, {**kwargs, "lora": prepare_lora(make_lora(2, E, x.shape[1], w1.intermediate_size, 8, x.dtype)),
                      "token_lora_ids": make_token_lora_ids(M, 2)}
    if what == "topk_ids dtype":
        return (x, w1, w2, tw, ti.long()), kwargs
    if what == "path":
        return args, {**kwargs, "path": "two_stage"}
    if what == "activation":
        return args, {**kwargs, "activation": "gelu"}
    if what == "config":
        return args, {**kwargs, "config": replace(kwargs["config"], BLOCK_N=32)}
    if what == "out given":
        return args, {k: v for k, v in kwargs.items() if k != "out"}
    raise AssertionError(what)


@pytest.mark.parametrize("what", ["M", "dtype", "weights object", "expert_map", "lora", "topk_ids dtype", "path",
                                  "activation", "config", "out given"])
def test_a_changed_input_never_reuses_a_stale_plan(what):
    args, kwargs, _ = _call(8)
    fused_moe(*args, **kwargs)
    first = plan_of(*args, **kwargs)
    assert first is not None and len(PLANS) == 1
    new_args, new_kwargs = _changed(args, kwargs, what)
    out = fused_moe(*new_args, **new_kwargs)
    second = plan_of(*new_args, **new_kwargs)
    assert second is not None and second is not first and len(PLANS) == 2
    x, w1, w2, tw, ti = new_args
    if w2 is None:
        w1, w2 = w1.unprepare()
    extra = {k: new_kwargs[k] for k in ("expert_map", "lora", "token_lora_ids", "activation") if k in new_kwargs}
    assert_matches_reference(out, x, w1, w2, tw, ti, **extra)


def test_same_key_other_tensors_share_one_plan():
    # Plans hold no tensors: another layer's weights (same shapes) and other inputs reuse the plan.
    args, kwargs, reference_args = _call(9)
    fused_moe(*args, **kwargs)
    other_args, other_kwargs, other_reference = _call(10)
    out = fused_moe(*other_args, **other_kwargs)
    assert len(PLANS) == 1
    assert_matches_reference(out, *other_reference)


def test_the_plan_cache_is_bounded():
    from fmoe2.launch import PlanCache

    cache = PlanCache(maxsize=2)
    cache.put("a", 1), cache.put("b", 2)
    assert cache.get("a") == 1  # a is now the most recently used
    cache.put("c", 3)
    assert cache.get("b") is None and cache.get("a") == 1 and cache.get("c") == 3 and len(cache) == 2
    cache.clear()
    assert len(cache) == 0


def test_moe_sorting_caches_its_plan():
    from fmoe2.sorting.moe_sorting import SORT_PLANS

    x, w1, w2, tw, ti = make_problem(13, 6, 32, 16, 2, torch.float16)
    first = fmoe2.moe_sorting(ti, tw, 6, 16)
    again = fmoe2.moe_sorting(ti, tw, 6, 16)
    for name in ("sorted_token_ids", "sorted_weights", "sorted_expert_ids", "num_tokens_post_padded",
                 "num_sorted_tiles"):
        assert torch.equal(getattr(first, name), getattr(again, name)), name
    # The interpreter cannot bind launches: no plan is kept, nothing stale can be found later.
    assert len(SORT_PLANS) == (0 if DEVICE == "cpu" else 1)


def test_a_sort_result_on_its_block_views_its_buffers_when_read():
    # moe_sorting's cached path returns the result without making its tensor views; reading a field makes
    # them, as from_views would have.
    from fmoe2.buffers import BufferLayout
    from fmoe2.sorting import MoESortingResult, sorting_buffers

    layout = BufferLayout.of(sorting_buffers(40, 6, 16, count_lora_tokens=True, chunk_size=16))
    block = layout.allocate(DEVICE)
    block.copy_(torch.arange(layout.nbytes, dtype=torch.int64).to(torch.uint8))
    eager = MoESortingResult.from_views(layout.views(block), 16, 20, 16)
    lazy = MoESortingResult.on_block(block, layout, 16, 20, 16)
    assert "sorted_token_ids" not in lazy.__dict__ and lazy.num_tokens == 20  # nothing viewed yet
    assert lazy.sorted_weights.data_ptr() == eager.sorted_weights.data_ptr()
    for name in ("sorted_token_ids", "sorted_weights", "sorted_expert_ids", "num_tokens_post_padded",
                 "num_sorted_tiles", "num_lora_tokens", "chunk_key_counts"):
        got, want = getattr(lazy, name), getattr(eager, name)
        assert got.shape == want.shape and got.dtype == want.dtype and got.data_ptr() == want.data_ptr(), name
    with pytest.raises(AttributeError, match="no attribute 'nonexistent'"):
        lazy.nonexistent
