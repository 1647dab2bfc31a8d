"""Kernel launches: a launch described as data (:class:`LaunchSpec`), and the same launch bound once
to its compiled kernel, then repeated with only the changing pointers passed (:class:`BoundLaunch`).

Why: Triton's ``kernel[grid](...)`` binds and specialises every parameter on every call. For the
fused kernel (about 60 parameters) that took longer than the kernels themselves at decode sizes
(docs/host_cost.md). A forward's plan (``fmoe2/gemm/plan.py``) runs each launch once through
Triton's JIT, which compiles it and hands back the compiled kernel, then launches that kernel
directly: a list of argument values fixed for the plan, with the device pointers of this call's
tensors written into their slots. Pointers are passed as ints, which Triton's launcher takes as
they are (no ``data_ptr()`` call, no pointer-attribute query).

What may differ between the calls of one plan is only what its key leaves open: device
addresses, all 16-byte aligned, as they were when the kernel was compiled (the JIT specialises
pointer alignment; the plan key holds the alignment). Shapes, strides, dtypes and every integer
argument are part of the key, so the compiled specialisation stays valid.

The launcher call is the one Triton's JIT makes itself (Triton 3.6 to 3.9):
``compiled.run(grid_x, grid_y, grid_z, stream, compiled.function, compiled.packed_metadata,
launch_metadata, enter_hook, exit_hook, *every_argument)``. Where the launcher is Triton 3.6's CUDA
launcher and the kernel needs no scratch memory, a bound launch calls the launcher's C function
directly with the same arguments (:func:`direct_launcher`): the Python ``__call__`` in between only
re-packs them and asks for no scratch (measured: docs/host_cost.md).
"""
from __future__ import annotations

import collections
import contextlib
import functools
import inspect
import threading
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

try:  # Triton >= 3.4
    from triton import knobs as _knobs
except ImportError:  # pragma: no cover - older Triton: launch hooks are not read
    _knobs = None
from triton.tools.tensor_descriptor import TensorDescriptor

from ._validation import interpreter_enabled

# Whether torch.compile is tracing (then fmoe2's functions call their registered ops instead of
# running); the dynamo-only check is the cheaper one where torch has it.
tracing = getattr(torch.compiler, "is_dynamo_compiling", torch.compiler.is_compiling)

# "direct": plans launch compiled kernels with pre-bound arguments; "jit": every launch goes through
# Triton's JIT (``kernel[grid](...)``). The benchmark's --host section measures both.
LAUNCH_MODES = ("direct", "jit")
_launch_mode = "direct"


def set_launch_mode(mode: str) -> None:
    """Selects how plans launch their kernels (``"direct"``, the default, or ``"jit"``)."""
    global _launch_mode
    if mode not in LAUNCH_MODES:
        raise ValueError(f"launch mode must be one of {LAUNCH_MODES}, got {mode!r}")
    _launch_mode = mode


def launch_mode() -> str:
    return _launch_mode


def _hook_active(hook) -> bool:
    """Whether a launch hook would call anything: Triton 3.6+ keeps a (usually empty) chain of hooks."""
    if hook is None:
        return False
    calls = getattr(hook, "calls", None)
    return bool(calls) if calls is not None else True


def launch_hooks_set() -> bool:
    """Whether a profiler installed Triton launch hooks (then launches go through the JIT, which
    calls them with their metadata)."""
    runtime = getattr(_knobs, "runtime", None)
    return runtime is not None and (_hook_active(runtime.launch_enter_hook) or _hook_active(runtime.launch_exit_hook))


def direct_launches() -> bool:
    """Whether plans launch their bound kernels directly now: launch mode "direct" and no Triton
    launch hook that would call anything (checked on every call, inline: it is on the hot path)."""
    if _launch_mode != "direct":
        return False
    runtime = getattr(_knobs, "runtime", None)
    if runtime is None:
        return True
    enter, leave = runtime.launch_enter_hook, runtime.launch_exit_hook
    return ((enter is None or not getattr(enter, "calls", True)) and (leave is None or not getattr(leave, "calls", True)))


class DevicePointer:
    """A device address and the dtype of what it points to: all Triton's launcher and tensor
    descriptors read of a tensor (``data_ptr()``, ``dtype``)."""

    __slots__ = ("ptr", "dtype")

    def __init__(self, ptr: int, dtype: torch.dtype):
        self.ptr = ptr
        self.dtype = dtype

    def data_ptr(self) -> int:
        return self.ptr


@dataclass
class LaunchSpec:
    """One kernel launch as data: what ``kernel[grid](**args, **constexprs, **options)`` takes."""

    name: str
    kernel: Any  # a triton.JITFunction
    grid: Tuple[int, ...]
    args: Dict[str, Any]  # runtime arguments (tensors, tensor descriptors, ints; None for an unused pointer)
    constexprs: Dict[str, Any]
    options: Dict[str, Any]  # num_warps, num_stages, launch_pdl, ROCm options

    def launch(self):
        """Launches through Triton's JIT; returns what it returns (the compiled kernel on GPUs). Under the
        Triton interpreter one launch runs at a time (:func:`interpreter_turn`)."""
        with interpreter_turn():
            return self.kernel[self.grid](**self.args, **self.constexprs, **self.options)


# The Triton interpreter runs a launch's programs one after another through module-level state (the program id
# it is at, among others), which two threads' launches at once would share: measured, concurrent calls failed
# with unrelated errors or returned wrong outputs (issue 44). Launches of fmoe2's kernels under it take turns.
INTERPRETER_LOCK = threading.RLock()


def interpreter_turn():
    """A context holding :data:`INTERPRETER_LOCK` under the Triton interpreter (re-entrant: a launch inside takes it
    again), and nothing on a GPU, where launches go to streams in order."""
    return INTERPRETER_LOCK if interpreter_enabled() else contextlib.nullcontext()


@functools.lru_cache(maxsize=None)
def kernel_parameters(kernel) -> Tuple[Tuple[str, Any], ...]:
    """``(name, default)`` of every parameter of a ``@triton.jit`` kernel (or its interpreted form), in
    order; a parameter without a default has ``inspect.Parameter.empty``."""
    return tuple((name, p.default) for name, p in inspect.signature(kernel.fn).parameters.items())


def _descriptor_at(template: TensorDescriptor, base: DevicePointer) -> TensorDescriptor:
    """``template`` with another base, without re-running its checks (the template passed them at
    the same shape, strides and alignment)."""
    desc = object.__new__(TensorDescriptor)
    desc.__dict__.update(template.__dict__)
    desc.base = base
    return desc


# Triton 3.6's CUDA launcher: ``__call__(grid_x, grid_y, grid_z, stream, function, *args)`` allocates the kernel's
# global and profile scratch (where it has any) and calls ``launch(grid_x, grid_y, grid_z, stream, function,
# cooperative, pdl, global_scratch, profile_scratch, *args)``, its compiled C function.
_CUDA_LAUNCHER_36_CALL = ("self", "gridX", "gridY", "gridZ", "stream", "function", "args")


@functools.lru_cache(maxsize=None)
def _call_parameters(launcher_type) -> Tuple[str, ...]:
    try:
        return tuple(inspect.signature(launcher_type.__call__).parameters)
    except (TypeError, ValueError):
        return ()


def direct_launcher(compiled) -> Tuple[Any, tuple]:
    """``(launch, prefix)``: ``launch(grid_x, grid_y, grid_z, stream, *prefix, *arguments)`` launches
    ``compiled`` as ``compiled.run(grid_x, grid_y, grid_z, stream, function, packed_metadata, None, None,
    None, *arguments)`` would. For Triton 3.6's CUDA launcher of a kernel without scratch memory that is
    its C function with the launch flags ahead; for any other launcher, ``compiled.run`` itself."""
    run = compiled.run
    prefix = (compiled.function, compiled.packed_metadata, None, None, None)
    if (type(run).__name__ == "CudaLauncher" and _call_parameters(type(run)) == _CUDA_LAUNCHER_36_CALL
            and not getattr(run, "gsan_enabled", False) and getattr(run, "global_scratch_size", 1) == 0
            and getattr(run, "profile_scratch_size", 1) == 0 and hasattr(run, "launch")):
        return run.launch, (compiled.function, run.launch_cooperative_grid, run.launch_pdl, None, None,
                            compiled.packed_metadata, None, None, None)
    return run, prefix


def descriptor_expansion(launch) -> Optional[Tuple[Any, list, Any]]:
    """``(c_launch, metadata, expand)`` where ``launch`` is Triton 3.6's wrapper of a launcher C function for
    kernels with tensor-descriptor arguments (``wrap_handle_tensordesc``'s ``inner``): the C function, the
    compiled metadata of each descriptor argument, and ``make_tensordesc_arg``, which turns a descriptor
    into the C function's arguments (for a TMA descriptor: ``cuTensorMapEncodeTiled``, on every launch).
    Bound launches expand each descriptor once per base address instead. None for any other launch."""
    if getattr(launch, "__name__", "") != "inner" or not getattr(launch, "__closure__", None):
        return None
    try:
        names = inspect.getclosurevars(launch)
    except (TypeError, ValueError):
        return None
    c_launch = names.nonlocals.get("launcher")
    metadata = names.nonlocals.get("tensordesc_meta")
    expand = names.globals.get("make_tensordesc_arg")
    if c_launch is None or metadata is None or expand is None or len(inspect.signature(expand).parameters) != 2:
        return None
    return c_launch, list(metadata), expand


MAX_CACHED_DESCRIPTORS = 256  # expanded descriptors a bound launch keeps per descriptor argument (one per layer)


class BoundLaunch:
    """A :class:`LaunchSpec` bound to its compiled kernel; repeated with new pointers only.

    ``source_of`` maps a device address of the spec's arguments to the index of its source in the
    per-call value list (the plan's inputs and workspace buffers). Each tensor argument becomes a
    pointer slot, each tensor descriptor a descriptor slot (its base the slot's pointer), each tuple
    argument (a bundle, ``fmoe2/gemm/bundles.py``) a tuple slot whose tensors are pointer slots of its
    own (the launcher takes any tuple where the kernel has one); everything else is kept as given.
    Raises ``KeyError`` when a tensor argument has no source, ``ValueError`` for a tuple holding a
    tuple or a descriptor (the JIT launches those).
    """

    __slots__ = ("name", "grid", "values", "pointer_slots", "descriptor_slots", "tuple_slots", "run", "prefix",
                 "compiled", "expansion", "expanded")

    def __init__(self, spec: LaunchSpec, compiled, source_of: Dict[int, int]):
        self.name = spec.name
        grid = tuple(spec.grid) + (1,) * (3 - len(spec.grid))
        self.grid = grid
        values: List[Any] = []
        pointer_slots: List[Tuple[int, int]] = []
        descriptor_slots: List[Tuple[int, int, TensorDescriptor]] = []
        tuple_slots: List[Tuple[int, list, Tuple[Tuple[int, int], ...]]] = []
        for position, (name, default) in enumerate(kernel_parameters(spec.kernel)):
            if name in spec.args:
                value = spec.args[name]
            elif name in spec.constexprs:
                value = spec.constexprs[name]
            else:
                value = default
            if isinstance(value, torch.Tensor):
                pointer_slots.append((position, source_of[value.data_ptr()]))
                value = 0
            elif isinstance(value, TensorDescriptor):
                template = _descriptor_at(value, DevicePointer(0, value.base.dtype))
                descriptor_slots.append((position, source_of[value.base.data_ptr()], template))
                value = None
            elif isinstance(value, tuple):
                tuple_slots.append((position, *_tuple_template(value, source_of)))
                value = None
            values.append(value)
        self.values = values
        self.pointer_slots = tuple(pointer_slots)
        self.descriptor_slots = tuple(descriptor_slots)
        self.tuple_slots = tuple(tuple_slots)
        self.compiled = compiled
        self.run, self.prefix = direct_launcher(compiled)
        # Triton 3.6, kernels with tensor descriptors: the C function, each descriptor's expansion cached by address.
        self.expansion = descriptor_expansion(self.run) if self.descriptor_slots and self.run is not compiled.run \
            else None
        if self.expansion is not None and len(self.expansion[1]) != len(self.descriptor_slots):
            self.expansion = None
        self.expanded: List[Dict[int, list]] = [{} for _ in self.descriptor_slots]

    def arguments(self, sources: Sequence[int]) -> list:
        """Every argument of the launch, in the kernel's order, with ``sources`` (device addresses,
        indexed as ``source_of``) written into the slots."""
        args = self.values.copy()
        for position, source in self.pointer_slots:
            args[position] = sources[source]
        for position, template, slots in self.tuple_slots:
            args[position] = _tuple_at(template, slots, sources)
        for position, source, template in self.descriptor_slots:
            args[position] = _descriptor_at(template, DevicePointer(sources[source], template.base.dtype))
        return args

    def __call__(self, stream: int, sources: Sequence[int]) -> None:
        args = self.values.copy()  # (arguments(), written out: this runs on every launch)
        for position, source in self.pointer_slots:
            args[position] = sources[source]
        for position, template, slots in self.tuple_slots:
            elements = template.copy()
            for index, source in slots:
                elements[index] = sources[source]
            args[position] = tuple(elements)
        grid_x, grid_y, grid_z = self.grid
        if self.expansion is not None:
            self._launch_expanded(stream, sources, args)
            return
        for position, source, template in self.descriptor_slots:
            args[position] = _descriptor_at(template, DevicePointer(sources[source], template.base.dtype))
        self.run(grid_x, grid_y, grid_z, stream, *self.prefix, *args)

    def _launch_expanded(self, stream: int, sources: Sequence[int], args: list) -> None:
        """The launch through the C function, each descriptor replaced by its expansion (made once per base
        address): what the wrapper would pass, without encoding a TMA descriptor on every launch."""
        c_launch, metadata, expand = self.expansion
        final = []
        start = 0
        for k, (position, source, template) in enumerate(self.descriptor_slots):
            ptr = sources[source]
            cache = self.expanded[k]
            expanded = cache.get(ptr)
            if expanded is None:
                if len(cache) >= MAX_CACHED_DESCRIPTORS:
                    cache.clear()
                expanded = cache[ptr] = list(expand(_descriptor_at(template, DevicePointer(ptr, template.base.dtype)),
                                                    metadata[k]))
            final += args[start:position]
            final += expanded
            start = position + 1
        final += args[start:]
        grid_x, grid_y, grid_z = self.grid
        c_launch(grid_x, grid_y, grid_z, stream, *self.prefix, *final)


def _tuple_template(value: tuple, source_of: Dict[int, int]) -> Tuple[list, Tuple[Tuple[int, int], ...]]:
    """``(elements, slots)`` of a tuple argument: its elements with each tensor's place left for its address, and
    ``(index, source)`` of each such place."""
    elements, slots = list(value), []
    for index, element in enumerate(value):
        if isinstance(element, (tuple, TensorDescriptor)):
            raise ValueError("a bound launch takes flat tuples of tensors, ints and None")
        if isinstance(element, torch.Tensor):
            slots.append((index, source_of[element.data_ptr()]))
            elements[index] = 0
    return elements, tuple(slots)


def _tuple_at(template: list, slots: Tuple[Tuple[int, int], ...], sources: Sequence[int]) -> tuple:
    """A tuple argument of :func:`_tuple_template` with the addresses of ``sources`` in its places."""
    elements = template.copy()
    for index, source in slots:
        elements[index] = sources[source]
    return tuple(elements)


def bind_launches(specs: Sequence[LaunchSpec], compiled: Sequence[Any], sources: Sequence[int]
                  ) -> Optional[List[BoundLaunch]]:
    """:class:`BoundLaunch` of each spec, given the compiled kernels its JIT launch returned and the
    device address of each source (0: absent). None where the launches cannot be bound: a compiled
    kernel the JIT did not hand back (the interpreter), two sources at one address, or a tensor
    argument that is no source."""
    source_of: Dict[int, int] = {}
    for index, ptr in enumerate(sources):
        if ptr:
            if ptr in source_of:
                return None
            source_of[ptr] = index
    if any(c is None or not hasattr(c, "packed_metadata") for c in compiled):
        return None
    try:
        return [BoundLaunch(spec, c, source_of) for spec, c in zip(specs, compiled)]
    except (KeyError, ValueError):
        return None


MAX_PLANS = 512  # plans a cache keeps (least recently used dropped): about one per layer shape, batch size and path


class PlanCache:
    """Launch plans by call key, the least recently used dropped beyond ``maxsize``."""

    def __init__(self, maxsize: int = MAX_PLANS):
        self.maxsize = maxsize
        self._plans: "collections.OrderedDict[tuple, Any]" = collections.OrderedDict()

    def get(self, key):
        plan = self._plans.get(key)
        if plan is not None:
            self._plans.move_to_end(key)
        return plan

    def put(self, key, plan) -> None:
        self._plans[key] = plan
        self._plans.move_to_end(key)
        while len(self._plans) > self.maxsize:
            self._plans.popitem(last=False)

    def clear(self) -> None:
        self._plans.clear()

    def __len__(self) -> int:
        return len(self._plans)


def raw_stream(device_index: int) -> int:
    """The current stream of a GPU, as Triton's launcher takes it."""
    return torch._C._cuda_getCurrentRawStream(device_index)


def run_bound(launches: Sequence[BoundLaunch], sources: Sequence[int], scratch_bytes: int,
              scratch_offsets: Sequence[int], device: torch.device,
              alone: Optional[Tuple[BoundLaunch, Callable[[torch.device, int], int]]] = None) -> Optional[torch.Tensor]:
    """Runs bound launches on the current stream of ``device``: ``sources`` (device addresses of the
    call's inputs) followed by those of the buffers in a fresh scratch block of ``scratch_bytes``
    (at ``scratch_offsets``). Returns the block. (A CPU ``device`` launches on stream 0: only tests
    bind launches there, to compiled-kernel stand-ins.)

    ``alone``: ``(launch, kept)``: unless the stream is being captured into a CUDA graph, that one launch runs
    instead, on ``sources`` and the address ``kept(device, stream)`` gives (a buffer kept per stream), and None
    is returned."""
    if device.type != "cuda":
        stream = 0
    else:
        index = device.index
        if torch._C._cuda_getDevice() != index:
            with torch.cuda.device(index):
                return run_bound(launches, sources, scratch_bytes, scratch_offsets, device, alone)
        stream = raw_stream(index)
        if alone is not None and torch._C._cuda_isCurrentStreamCapturing():
            alone = None
    if alone is not None:
        alone[0](stream, [*sources, alone[1](device, stream)])
        return None
    block = torch.empty(scratch_bytes, dtype=torch.uint8, device=device)
    base = block.data_ptr()
    values = [*sources, *[base + offset for offset in scratch_offsets]]
    for launch in launches:
        launch(stream, values)
    return block


__all__ = ["LaunchSpec", "BoundLaunch", "INTERPRETER_LOCK", "interpreter_turn", "DevicePointer", "PlanCache", "bind_launches", "direct_launcher",
           "descriptor_expansion", "set_launch_mode", "launch_mode",
           "raw_stream", "run_bound", "launch_hooks_set", "direct_launches", "LAUNCH_MODES"]
