"""The plan of a forward: what depends only on the call's key, settled once and cached.

A plan is built by the first call with a given key (``fused_moe.py`` makes the key: shapes, dtypes,
strides and devices of every tensor, which optional tensors are given, batch size, activation,
path, config, and whether every pointer is 16-byte aligned). It holds:

* the config, picked and fitted once (``config.resolve_config``, through ``pick_config``) for the
  :class:`~fmoe2.target.Target` (the backend rules: ``launches.py``);
* the layout of the one scratch allocation of a call (the sort's buffers and, on the two-stage
  path, the workspace: ``forward_buffers``);
* after its first run, the forward's launches bound to their compiled kernels
  (:class:`~fmoe2.launch.BoundLaunch`), and for one token the one-launch decode's launch: eager calls of
  one token on the plain fused path run one launch of the fused kernel and no sort, on an accumulator kept
  per stream (``decode.py``); calls captured into a CUDA graph run the sort and the fused kernel.

A later call with the same key then allocates its output (unless given) and the scratch block,
and launches the bound kernels with its own device pointers: no config lookup, no device query,
no argument binding. Where launches cannot be bound (the Triton interpreter, unaligned pointers,
Triton launch hooks, ``fmoe2.launch.set_launch_mode("jit")``) every call builds the launch
descriptions again from its tensors and launches them through Triton's JIT, with the plan's
config.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence, Tuple

import torch

from .._validation import check_out_overlaps_at
from ..buffers import BufferLayout
from ..launch import BoundLaunch, bind_launches, direct_launches, interpreter_turn, raw_stream
from ..sorting import checked_chunk_size
from ..target import Target
# The per-call device addresses a plan's launches read, in INPUT_SOURCES order (0 where absent; the scratch
# buffers' addresses follow): named by the call's description, read from the checked call by input_sources.
from .call import INPUT_SOURCES, OUT_SOURCE, checked_sources as input_sources  # noqa: F401  (INPUT_SOURCES as before)
from .config import FusedMoEConfig
from .decode import kept_accumulator, one_launch_allowed
from . import launches
from .launches import MoEProblem, forward_buffer_views, forward_buffers

def source_addresses(problem: MoEProblem, topk_weights, topk_ids, out, expert_map) -> List[int]:
    """The device address of each of the call's :data:`INPUT_SOURCES` (0 where absent)."""
    return [t.data_ptr() if t is not None else 0
            for t in input_sources(problem, topk_weights, topk_ids, out, expert_map)]


@dataclass
class MoEPlan:
    """A forward settled for one key (module docstring)."""

    config: FusedMoEConfig  # picked and fitted
    target: Target
    activation: str
    chunk_size: int  # routing entries per chunk of the two-launch sort; 0: one launch
    layout: BufferLayout  # the call's scratch block
    device: torch.device
    input_nbytes: Tuple[int, ...]  # bytes of each input source (0: absent), for the out-overlap check
    launches: Optional[List[BoundLaunch]] = None  # bound by the first run; None: launches go through the JIT
    bindable: bool = True  # whether the first run may bind (not under the interpreter, pointers 16-byte aligned)
    decodes: bool = False  # eager calls run the one-launch decode (launches.decodes_in_one_launch)
    hidden_size: int = 0

    def __post_init__(self):
        self.scratch_bytes, self.scratch_offsets = self.layout.nbytes, self.layout.offsets  # read on every call
        self.decode_numel = self.hidden_size + 1  # the kept accumulator: H columns, then the add counter
        # Once bound: (the one-launch decode, the address of a stream's kept accumulator) for run_bound's ``alone``.
        self.alone: Optional[Tuple[BoundLaunch, Callable[[torch.device, int], int]]] = None
        # Launches bound, the one-launch decode not yet (the first run was captured or the op's): the next call that
        # may run it goes through run_jit, which binds it.
        self.decode_pending = False

    def kept_accumulator_address(self, device: torch.device, stream: int) -> int:
        return kept_accumulator(device, stream, self.decode_numel).data_ptr()

    @property
    def launch_names(self) -> List[str]:
        return [launch.name for launch in self.launches] if self.launches is not None else []

    @property
    def direct(self) -> bool:
        """Whether calls launch the bound kernels directly."""
        return self.launches is not None and direct_launches()

    def specs(self, problem: MoEProblem, topk_weights, topk_ids, out, expert_map, block: torch.Tensor):
        """The launch descriptions of this call, on the scratch ``block``."""
        sorting, workspace, quantized_x, accumulator = forward_buffer_views(problem, self.config,
                                                                            self.layout.views(block), self.chunk_size)
        return launches.forward_specs(problem, topk_weights, topk_ids, self.activation, out, expert_map, self.config,
                                      self.target, sorting, workspace, quantized_x, accumulator)

    def run_jit(self, problem: MoEProblem, topk_weights, topk_ids, out, expert_map) -> None:
        """Runs the forward through Triton's JIT (which compiles on first use); binds the launches
        when they can be (first run of a bindable plan). A plan that ``decodes`` runs the one-launch decode
        unless the call is being captured into a CUDA graph; its first run runs (and binds) both forms, the
        sort path for graphs and the one-launch decode for eager calls (not inside ``decode.sort_path_only``)."""
        decode_now = self.decodes and one_launch_allowed() and not stream_capturing(problem.x.device)
        first = self.launches is None and self.bindable
        if decode_now and not first:
            self._run_decode(problem, topk_weights, topk_ids, out, expert_map, bind=self.decode_pending)
            return
        block = self.layout.allocate(problem.x.device)
        specs = self.specs(problem, topk_weights, topk_ids, out, expert_map, block)
        compiled = [spec.launch() for spec in specs]
        if first:
            sources = source_addresses(problem, topk_weights, topk_ids, out, expert_map)
            base = block.data_ptr()
            self.launches = bind_launches(specs, compiled, sources + [base + o for o in self.scratch_offsets])
            self.bindable = self.launches is not None
            if self.decodes and self.bindable:
                if decode_now:  # the same output again, to compile and bind the one-launch decode
                    self._run_decode(problem, topk_weights, topk_ids, out, expert_map, bind=True)
                else:
                    self.decode_pending = True

    def _run_decode(self, problem: MoEProblem, topk_weights, topk_ids, out, expert_map, bind: bool = False) -> None:
        """The one-launch decode through Triton's JIT, on the current stream's kept accumulator; with ``bind``,
        bound for the calls after it (``alone``)."""
        device = problem.x.device
        stream = raw_stream(device.index) if device.type == "cuda" else 0
        accumulator = kept_accumulator(device, stream, self.decode_numel)
        spec = launches.decode_launch(problem, topk_weights, topk_ids, self.activation, out, expert_map, self.config,
                                      self.target, accumulator)
        # Under the interpreter the programs run one after another on the host: an interrupted launch
        # (KeyboardInterrupt) or a failed one may have added into the kept accumulator and counted adds without the
        # last program's reset, which would spoil every later one-token call on this stream. It is zeroed before
        # another thread's launch may take the interpreter (an RLock: the launch takes it again inside).
        with interpreter_turn():
            try:
                compiled = spec.launch()
            except BaseException:
                accumulator.zero_()
                raise
        if bind:
            sources = source_addresses(problem, topk_weights, topk_ids, out, expert_map)
            bound = bind_launches([spec], [compiled], sources + [accumulator.data_ptr()])
            if bound is not None:
                self.alone = (bound[0], self.kept_accumulator_address)
            self.decode_pending = False  # (bound, or not bindable: no second try)

    def check_out_overlap(self, sources: Sequence[int]) -> None:
        """Refuses an ``out`` that shares memory with an input (it may be written while they are read)."""
        check_out_overlaps_at(INPUT_SOURCES, sources, self.input_nbytes, OUT_SOURCE)


def build_plan(problem: MoEProblem, activation: str, config: FusedMoEConfig, target: Target,
               topk_weights, topk_ids, out, expert_map, bindable: bool) -> MoEPlan:
    """The plan of ``problem`` run with the (fitted) ``config`` on ``target``."""
    chunk_size = checked_chunk_size(problem.num_experts, problem.num_tokens * problem.topk)
    layout = BufferLayout.of(forward_buffers(problem, config, target, chunk_size))
    nbytes = tuple(t.numel() * t.element_size() if t is not None else 0
                   for t in input_sources(problem, topk_weights, topk_ids, out, expert_map))
    return MoEPlan(config, target, activation, chunk_size, layout, problem.x.device, nbytes,
                   bindable=bindable and not target.interpreter,
                   decodes=launches.decodes_in_one_launch(problem, config), hidden_size=problem.hidden_size)


def stream_capturing(device: torch.device) -> bool:
    """Whether the current stream of ``device`` (the current device's) is being captured into a CUDA graph."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()
