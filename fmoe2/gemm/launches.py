"""The launches of one forward, as data: grid, arguments, constexprs and options of each kernel.

``forward_specs`` lists them in order (sort, then the fused kernel, or stage 1 and stage 2, with
the two-stage path's LoRA launches where they run); each ``*_launch`` function describes one
kernel. They are pure functions of the problem, the buffers, the config and the
:class:`~fmoe2.target.Target`, so the plan (``plan.py``), the code-generation report
(``fmoe2.codegen``, on meta tensors for a GPU that is not there) and the tests all read the same
launches. Every backend rule that decides a launch (tensor descriptors, programmatic dependent
launch, the LoRA kernels' warps, stages, columns and splits) is here, decided from the target.
Pointers a launch's flags leave unused are None: Triton makes them constexprs, so they are no
launch arguments and cannot be read by mistake.
"""
from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch
import triton
from triton.tools.tensor_descriptor import TensorDescriptor

from ..formats import WEIGHT_FORMATS, WeightFormat, format_of_prepared
from ..fp8 import FP8_GROUP, fp8_constexprs, x_group
from ..activations import SWIGLU_ALPHA
from ..launch import LaunchSpec, kernel_parameters
from ..sorting import MoESortingResult, max_busy_tiles, sort_launch_specs, sorting_buffers, x_quantization_values
from ..target import Target
from .combine_kernel import _cast_rows_kernel, _combine_slots_kernel
from .config import BACKENDS, LORA_STACK_WIDTH, FusedMoEConfig, lora_in_stages
from . import fp8_weights
from .bundles import AdapterWeights, ExpertWeights
from .fused_moe_kernel import _fused_cast_kernel, _fused_kernel, _fused_lora_kernel, _stage1_kernel, _stage1_lora_kernel
from .grouped_gemm_kernel import _stage2_kernel
from .lora import PreparedMoELoRA
from .lora_kernel import _lora_expand_kernel, _lora_shrink_kernel


@dataclass
class MoEProblem:
    """Checked views of the arguments of one ``fused_moe`` call."""

    x: torch.Tensor  # [M, H]
    w1: torch.Tensor  # plain [E, 2I, H] or interleaved [E, 2*I_pad, H_pad]
    w2: torch.Tensor  # [E, H(_pad), I(_pad)]
    gate_up_interleaved: bool
    num_experts: int
    hidden_size: int
    intermediate_size: int
    topk: int
    lora: Optional[PreparedMoELoRA] = None
    token_lora_ids: Optional[torch.Tensor] = None  # [M] int32
    w1_bias: Optional[torch.Tensor] = None  # [E, 2I(_pad)] in w1's row order
    w2_bias: Optional[torch.Tensor] = None  # [E, H(_pad)]
    swiglu_alpha: float = SWIGLU_ALPHA  # swiglu_oai's alpha (the default elsewhere)
    swiglu_limit: Optional[float] = None  # clamp of gate and up before silu / swiglu_oai
    # fp8 weights (fmoe2/fp8.py): [E, Sn, Sk] float32 scale views of w1 (checkpoint row order) and w2, and the
    # weights' scale block (block_n, block_k); None for 16/32-bit weights. Prepared 4-bit weights (uint8 w1/w2,
    # fmoe2/quant4.py): their group scales in the weights' row order, scale_block (1, group)
    w1_scale: Optional[torch.Tensor] = None
    w2_scale: Optional[torch.Tensor] = None
    scale_block: Optional[Tuple[int, int]] = None
    # Deterministic mode (fmoe2/gemm/combine_kernel.py): sorted ids token * topk + slot, stage 2 stores a row per
    # (token, slot) and a last launch sums them in slot order; no atomics, a tiling that does not depend on M
    deterministic: bool = False
    # Experts the routing chooses among when it is wider than the local weights (expert parallelism: expert_map's
    # length, the global count); None: num_experts. The config is picked for the full model's shape (rows per expert
    # M * topk / routed experts, the full model's tuned file): an expert-parallel slice does each local expert's
    # GEMMs as the full model does.
    routed_experts: Optional[int] = None
    # The weights' format, a name of fmoe2.formats.WEIGHT_FORMATS (prepared weights state theirs); None: read off w1
    # and w1_scale (fmoe2.formats.format_of_prepared)
    weight_format: Optional[str] = None

    def __post_init__(self):
        if self.weight_format is None:
            self.weight_format = format_of_prepared(self.w1, self.w1_scale).name

    @property
    def num_tokens(self) -> int:
        return self.x.shape[0]

    @property
    def format(self) -> WeightFormat:
        return WEIGHT_FORMATS[self.weight_format]

    @property
    def fp8(self) -> bool:
        """The format quantizes the activations too (fp8): it runs its own entries (:data:`FORMAT_ENTRIES`)."""
        return self.format.quantizes_activations

    @property
    def packed(self) -> bool:
        """Prepared weight-only formats (mxfp4, int4, int8): the 16-bit kernels dequantize them in their operand
        loader."""
        return self.format.weight_only


def grid_tiles(problem: MoEProblem, block_m: int) -> int:
    """Tiles the grids are sized for: the most any routing can fill (see ``max_busy_tiles``)."""
    return max_busy_tiles(problem.num_tokens * problem.topk, problem.num_experts, block_m)


# ---------------------------------------------------------------------------------------------
# Buffers of the two-stage path
# ---------------------------------------------------------------------------------------------

@dataclass
class TwoStageWorkspace:
    """Buffers of the two-stage path, in sorted-row order (``grid_tiles * BLOCK_M`` rows)."""

    # [rows, I] view of a [rows, I rounded up to 8] buffer (16-byte rows, for tensor descriptors), input
    # dtype: activated intermediate, routing weight applied
    y: torch.Tensor
    # fp8 weights with 128-column stage-1 slices (stage1_stores_fp8): y is fp8, and these its float32 scales
    # [rows, cdiv(I, 128)]
    y_scale: Optional[torch.Tensor] = None
    # With adapters: partial shrinks [splits, rows, 2R] / [splits, rows, R] float32 (R the padded rank)
    # of the gate/up and the down deltas, and the gate/up deltas [rows, 2I] (input dtype, gate then up);
    # only rows with an adapter are written and read. Where the stages compute the deltas
    # (deltas_in_stages) only lora_shrink2, one split per I slice of stage 1.
    lora_shrink13: Optional[torch.Tensor] = None
    lora_shrink2: Optional[torch.Tensor] = None
    lora_delta13: Optional[torch.Tensor] = None
    # Deterministic mode: [M * topk, H] in the input dtype, stage 2's row of each (token, slot), which the combine
    # launch sums (rows of dropped slots are not written)
    slot_rows: Optional[torch.Tensor] = None

    @staticmethod
    def buffers(problem: MoEProblem, block_m: int, config: FusedMoEConfig, target: Target
                ) -> List[Tuple[str, torch.dtype, Tuple[int, ...]]]:
        """``(name, dtype, shape)`` of the buffers: ``y``, and with adapters those of the LoRA shrink
        and expand launches, or, where the stages compute the deltas (:func:`deltas_in_stages`),
        stage 1's down shrinks; in deterministic mode the slot rows."""
        tiles = grid_tiles(problem, block_m)
        rows = tiles * block_m
        inter, dtype = problem.intermediate_size, problem.x.dtype
        # Row stride padded to 16 bytes so stage 2 can read y through a tensor descriptor.
        buffers = [("y", dtype, (rows, -(-inter // 8) * 8))]
        if stage1_stores_fp8(problem, config):  # fp8 y and its scales, one per row and I slice
            buffers = [("y", problem.w1.dtype, (rows, -(-inter // 16) * 16)),
                       ("y_scale", torch.float32, (rows, triton.cdiv(inter, FP8_GROUP)))]
        if deltas_in_stages(problem, config):
            buffers.append(("lora_shrink2", torch.float32,
                            (triton.cdiv(inter, config.BLOCK_N), rows, problem.lora.padded_rank)))
        elif problem.lora is not None:
            R = problem.lora.padded_rank
            for name, K, parts in (("lora_shrink13", problem.hidden_size, 2), ("lora_shrink2", inter, 1)):
                buffers.append((name, torch.float32, (lora_shrink_splits(tiles, K, target), rows, parts * R)))
            buffers.append(("lora_delta13", dtype, (rows, 2 * inter)))
        if problem.deterministic:
            buffers.append(("slot_rows", dtype, (problem.num_tokens * problem.topk, problem.hidden_size)))
        return buffers

    @classmethod
    def from_views(cls, views: dict, intermediate_size: int) -> "TwoStageWorkspace":
        return cls(views["y"][:, :intermediate_size], views.get("y_scale"), views.get("lora_shrink13"),
                   views.get("lora_shrink2"), views.get("lora_delta13"), views.get("slot_rows"))

    @classmethod
    def allocate(cls, problem: MoEProblem, sorting: MoESortingResult, config: FusedMoEConfig,
                 target: Target) -> "TwoStageWorkspace":
        """The buffers as separate tensors (tests, ``fmoe2.codegen`` on meta tensors)."""
        views = {name: torch.empty(shape, dtype=dtype, device=problem.x.device)
                 for name, dtype, shape in cls.buffers(problem, sorting.block_m, config, target)}
        return cls.from_views(views, problem.intermediate_size)


# ---------------------------------------------------------------------------------------------
# Backend rules
# ---------------------------------------------------------------------------------------------

TMA_MAX_BLOCK = 256  # largest tensor-descriptor block dimension (a hardware limit of the copy engine)


def tma_enabled(config: FusedMoEConfig, problem: MoEProblem, target: Target) -> bool:
    """Whether weight tiles come through tensor descriptors: ``config.tma``, for prepared 16-bit
    weights (rows padded to 16 bytes, as descriptors need) on a target whose backend's rules take them
    (``tensor_descriptor_weights`` of ``config_cuda.py`` / ``config_hip.py``: CUDA sm_90 and newer, and the
    interpreter of a CUDA build). fp32 (a testing dtype) keeps
    pointer loads: with descriptors a picked fp32 config needed 287 KB of shared memory on sm_90.
    fp8 and 4-bit weights keep pointer loads (descriptors not measured with them yet)."""
    return (config.tma and BACKENDS[target.backend].tensor_descriptor_weights(target) and problem.gate_up_interleaved
            and problem.w1.dtype == problem.x.dtype
            and problem.x.dtype in (torch.bfloat16, torch.float16)
            and problem.w1.is_contiguous() and problem.w2.is_contiguous())


def pdl_enabled(config: FusedMoEConfig, target: Target) -> bool:
    """Whether the launches after the sort are programmatic dependents (``config.pdl``): on CUDA GPUs
    of compute capability 9 or newer (``griddepcontrol``), never under the interpreter or on ROCm."""
    return config.pdl and target.has_grid_dependency_control


def _pdl_option(pdl: bool) -> dict:
    """The launch option that goes with a PDL=True kernel (its gdc_wait makes the early start safe)."""
    return {"launch_pdl": True} if pdl else {}


def _descriptor(t: torch.Tensor, block) -> Optional[TensorDescriptor]:
    """Tensor descriptor of ``t`` ([E, rows, cols] viewed as [E * rows, cols], or 2-D) in ``block``
    tiles; None (the kernels then use pointer loads) where the copy engine cannot take it: a block
    dimension over TMA_MAX_BLOCK, or a base address or row stride that is not a multiple of 16 bytes."""
    t2 = t.view(-1, t.shape[-1]) if t.dim() == 3 else t
    row_bytes = t2.stride(0) * t2.element_size()
    if max(block) > TMA_MAX_BLOCK or t2.stride(1) != 1 or row_bytes % 16 or t2.data_ptr() % 16:
        return None
    return TensorDescriptor.from_tensor(t2, list(block))


def stage1_stores_fp8(problem: MoEProblem, config: FusedMoEConfig) -> bool:
    """Whether stage 1 of an fp8 forward stores y quantized: where its slices are one activation group
    (BLOCK_N = FP8_GROUP), so each row's group scale is known in one program. Stage 2 then reads fp8 y
    and its scales; otherwise it quantizes y's tiles itself, in every program of an N block."""
    return problem.fp8 and config.path == "two_stage" and config.BLOCK_N == FP8_GROUP


def deltas_in_stages(problem: MoEProblem, config: FusedMoEConfig) -> bool:
    """Whether this forward's two stages compute the adapter deltas themselves (no LoRA launches; the
    only LoRA workspace holds stage 1's down shrinks; :func:`fmoe2.gemm.config.lora_in_stages` says
    where). Always in deterministic mode: the LoRA launches split their K loops by the grid's size,
    hence by M, and add the down deltas with atomics."""
    return problem.lora is not None and (problem.deterministic or lora_in_stages(config, problem.num_tokens,
                                                                                  problem.num_experts, problem.topk))


def problem_lora_constexprs(problem: MoEProblem) -> dict:
    """:func:`lora_constexprs` of ``problem``'s routed rows; in deterministic mode those of a large batch
    whatever M is, so that the kernels' adapter operands do not change with M."""
    num_rows = problem.num_tokens * problem.topk
    if problem.deterministic:
        num_rows = max(num_rows, problem.num_experts)
    return lora_constexprs(problem.lora, num_rows, problem.num_experts)


def lora_constexprs(lora: Optional[PreparedMoELoRA], num_rows: int, num_experts: int) -> dict:
    """LORA_RANK, LORA_IDS and LORA_SLOTS for ``num_rows`` = M*topk routed rows.

    With fewer rows than experts, tiles hold about one row, hence one adapter: one slot.
    Otherwise as many slots as adapters within LORA_STACK_WIDTH: measured on the H200 (rank 16,
    4 adapters), 4 slots against 1 ran Qwen3/DeepSeek M=16 at 1.12x of the plain forward instead
    of 1.19-1.25x, and M=128 at 1.12-1.15x instead of 1.70-1.81x.
    """
    if lora is None:
        return dict(LORA_RANK=16, LORA_IDS=1, LORA_SLOTS=1)
    ids = triton.next_power_of_2(lora.num_loras)
    slots = min(ids, max(1, LORA_STACK_WIDTH // (2 * lora.padded_rank)))
    if num_rows < num_experts:
        slots = 1
    return dict(LORA_RANK=lora.padded_rank, LORA_IDS=ids, LORA_SLOTS=slots)


# Two-stage LoRA kernels (lora_kernel.py). The shrink's BLOCK_K: see lora_kernel_options. Expand
# BLOCK_N and the programs per multiprocessor from a sweep on the H100 (2026-11-23; rank 16, 4 adapters,
# mixed; Mixtral M=1-1024, Qwen3 and DeepSeek M=16-1024; BLOCK_N 64/128 x expand 1/2/4 x shrink 1/2
# programs per SM): 128 / 2 / 2 was best or within 2% of best at every point; BLOCK_N=64 was up to
# 2.5% slower, and one program per SM for both up to 6% slower (Qwen3 M=16: 331.7 vs 312.5 us).
LORA_BLOCK_K = 64  # shrink step
LORA_SHRINK_PROGRAMS_PER_SM = 2
LORA_EXPAND_PROGRAMS_PER_SM = 2
LORA_MAX_SHRINK_SPLITS = 16  # every expand program reads and sums this many partial shrinks
LORA_INTERPRETER_PROGRAMS = 8  # programs the LoRA splits aim for off-GPU, so small tests split too
LORA_SHRINK_SUM_ELEMENTS = 4096  # partial shrinks stage 2 loads per step of their sum ([splits, BLOCK_M, R] fp32)


def lora_kernel_options(block_m: int, target: Target) -> dict:
    """Warps and pipeline stages of the two-stage LoRA kernels.

    CUDA sm_90 and newer (and the interpreter): 4 warps and 4 stages up to 64-row tiles, 8 warps
    for 128 rows. Older CUDA GPUs and HIP: 8 warps, 2 stages. Measurements and spill counts behind
    these: docs/lora.md ("Two-stage LoRA kernel options")."""
    if target.backend == "hip" or target.pre_hopper_cuda:
        return {"num_warps": 8, "num_stages": 2}
    return {"num_warps": 4 if block_m <= 64 else 8, "num_stages": 4}


def lora_expand_block_n(block_m: int, target: Target) -> int:
    """Expand columns per step: 128 on sm_90 and newer (and the interpreter); 64 on HIP (128 spilled
    65 VGPRs in the 32-row gate/up expand on gfx942); on older CUDA GPUs 128, 64 from 64-row tiles
    (wider tiles spilled on sm_80). Measurements: docs/lora.md ("Two-stage LoRA kernel options")."""
    if target.backend == "hip":
        return 64
    if target.pre_hopper_cuda:
        return 64 if block_m >= 64 else 128
    return 128


def lora_splits(num_grid_tiles: int, length: int, block: int, programs_per_sm: int, target: Target) -> int:
    """Programs per tile sharing a loop of ``length`` in ``block`` steps: about ``programs_per_sm``
    programs per multiprocessor in all (off-GPU, ``LORA_INTERPRETER_PROGRAMS`` in all), at most one
    per step."""
    total = LORA_INTERPRETER_PROGRAMS if target.interpreter else programs_per_sm * target.num_sms
    return max(1, min(triton.cdiv(length, block), triton.cdiv(total, num_grid_tiles)))


def lora_shrink_splits(num_grid_tiles: int, K: int, target: Target) -> int:
    """Splits of the shrink's K loop (H or I), hence partial shrinks per row in the workspace."""
    splits = lora_splits(num_grid_tiles, K, LORA_BLOCK_K, LORA_SHRINK_PROGRAMS_PER_SM, target)
    return min(LORA_MAX_SHRINK_SPLITS, splits)


# ---------------------------------------------------------------------------------------------
# The kernels' launches
# ---------------------------------------------------------------------------------------------

def _lora_args(problem: MoEProblem) -> dict:
    """The fused kernel's LoRA arguments (None without adapters): the operands as
    :class:`~.bundles.AdapterWeights`."""
    lora = problem.lora
    names = ("lora_a13", "lora_b13", "lora_a2", "lora_b2")
    if lora is None:
        return dict(token_lora_ids_ptr=None, lora_scaling_ptr=None, num_loras=None, **dict.fromkeys(names))
    args = dict(token_lora_ids_ptr=problem.token_lora_ids, lora_scaling_ptr=lora.scaling, num_loras=lora.num_loras)
    for name, t in zip(names, (lora.a13, lora.b13, lora.a2, lora.b2)):
        args[name] = AdapterWeights(t, *t.stride()[:3])  # (adapter, expert, row)
    return args


def _expert_weights(w: torch.Tensor, scale: Optional[torch.Tensor], bias: Optional[torch.Tensor]) -> ExpertWeights:
    """Weights ``[E, N, K]`` (16-bit or packed), their group scales and bias as the 16-bit entries take them: an
    :class:`~.bundles.ExpertWeights` without its descriptor (a parameter of its own)."""
    return ExpertWeights(w, None, scale, bias, *w.stride(), bias.stride(0) if bias is not None else None)


# Entry kernel of each launch of the fused-kernel family with 16-bit weights: (decode, fused, stage 1) x (without,
# with adapters), where the fused path has a second entry that casts its float32 accumulator itself.
_FUSED_ENTRIES = {("fused", False): _fused_kernel, ("fused_cast", False): _fused_cast_kernel,
                  ("decode", False): _fused_cast_kernel, ("fused", True): _fused_lora_kernel,
                  ("fused_cast", True): _fused_lora_kernel, ("stage1", False): _stage1_kernel,
                  ("stage1", True): _stage1_lora_kernel}
# The entry modules of formats that quantize the activations too (fmoe2/formats.py), by MoEProblem.weight_format: each
# module's ENTRIES (launch name -> entry kernel), fused_values and stage2_values give its launches (fp8_weights.py
# says what such a module holds). Weight-only formats run the 16-bit entries.
FORMAT_ENTRIES = {"fp8": fp8_weights}


@functools.lru_cache(maxsize=None)
def _constexpr_names(kernel) -> frozenset:
    """Names of the parameters ``kernel`` annotates ``tl.constexpr``."""
    return frozenset(name for name, p in inspect.signature(kernel.fn).parameters.items()
                     if "constexpr" in str(p.annotation))


def entry_arguments(kernel, values: dict) -> Tuple[dict, dict]:
    """``(args, constexprs)``: the entries of ``values`` that ``kernel`` takes, split by its annotations.
    Raises where ``values`` lacks a parameter without default (a launch must say every value it reads)."""
    args, constexprs = {}, {}
    constexpr_names = _constexpr_names(kernel)
    for name, default in kernel_parameters(kernel):
        if name not in values:
            if default is inspect.Parameter.empty:
                raise ValueError(f"{kernel.fn.__name__} takes {name}, which the launch does not give")
            continue
        (constexprs if name in constexpr_names else args)[name] = values[name]
    return args, constexprs


def _fused_values(problem: MoEProblem, out: torch.Tensor, sorting: Optional[MoESortingResult], activation: str,
                  config: FusedMoEConfig, target: Target, workspace: Optional[TwoStageWorkspace]) -> dict:
    """Every value a fused-family entry kernel may take (each entry keeps those it declares): tensors, strides,
    sizes and constexprs, None for what this forward does not use."""
    y = workspace.y if workspace is not None else None
    delta13 = workspace.lora_delta13 if workspace is not None else None
    # Deltas in the stages: stage 1 stores its slices' down shrinks.
    shrink2 = workspace.lora_shrink2 if workspace is not None and delta13 is None else None
    y_scale = workspace.y_scale if workspace is not None else None
    tma = tma_enabled(config, problem, target)
    w1_scale, w2_scale = (problem.w1_scale, problem.w2_scale) if problem.packed else (None, None)
    values = dict(
        x_ptr=problem.x, out_ptr=out, y_ptr=y,
        w1=_expert_weights(problem.w1, w1_scale, problem.w1_bias),
        w2=_expert_weights(problem.w2, w2_scale, problem.w2_bias),
        w13_desc=_descriptor(problem.w1, (2 * config.BLOCK_N, config.BLOCK_K)) if tma else None,
        w2_desc=_descriptor(problem.w2, (config.BLOCK_H, config.BLOCK_N)) if tma else None,
        sorted_token_ids_ptr=sorting.sorted_token_ids if sorting is not None else None,
        sorted_weights_ptr=sorting.sorted_weights if sorting is not None else None,
        sorted_expert_ids_ptr=sorting.sorted_expert_ids if sorting is not None else None,
        num_sorted_tiles_ptr=sorting.num_sorted_tiles if sorting is not None else None,
        num_tokens=problem.num_tokens, H=problem.hidden_size, I=problem.intermediate_size,
        stride_x_m=problem.x.stride(0), stride_out_m=out.stride(0),
        WEIGHT_GROUP=problem.scale_block[1] if problem.packed else 1,
        stride_y_m=y.stride(0) if y is not None else None,
        y_scale_ptr=y_scale, stride_ys_m=y_scale.stride(0) if y_scale is not None else None,
        **_lora_args(problem),
        num_lora_tokens_ptr=_num_lora_tokens(problem, sorting),
        lora_delta13_ptr=delta13, stride_delta13_m=delta13.stride(0) if delta13 is not None else None,
        lora_shrink2_ptr=shrink2, stride_shrink2_split=shrink2.stride(0) if shrink2 is not None else None,
        final_out_ptr=None, topk_ids_ptr=None, topk_weights_ptr=None, expert_map_ptr=None, num_global_experts=None, stride_final_m=None,
        TOPK=1, NUM_EXPERTS=1,
        ACTIVATION=activation, SWIGLU_ALPHA=problem.swiglu_alpha, SWIGLU_LIMIT=problem.swiglu_limit,
        GATE_UP_INTERLEAVED=problem.gate_up_interleaved,
        BLOCK_M=config.BLOCK_M, BLOCK_N=config.BLOCK_N, BLOCK_K=config.BLOCK_K, BLOCK_H=config.BLOCK_H,
        GROUP_M=config.GROUP_M, PDL=pdl_enabled(config, target), TAIL_M=config.TAIL_M,
        LORA_STAGES=config.lora_num_stages or config.num_stages,
        IDS_PER_TOKEN=problem.topk if problem.deterministic else 1,
        **problem_lora_constexprs(problem),
    )
    if delta13 is not None:  # the adapters' deltas come ready: stage 1 reads none of their operands
        values.update({name: None for name in ("lora_a13", "lora_b13", "lora_a2", "lora_scaling_ptr")})
    return values


def fused_kernel_launch(problem: MoEProblem, out: torch.Tensor, sorting: MoESortingResult, activation: str,
                        config: FusedMoEConfig, target: Target, workspace: Optional[TwoStageWorkspace] = None,
                        quantized_x: Optional[Tuple[torch.Tensor, torch.Tensor]] = None,
                        cast_to: Optional[torch.Tensor] = None, topk_ids: Optional[torch.Tensor] = None,
                        expert_map: Optional[torch.Tensor] = None,
                        topk_weights: Optional[torch.Tensor] = None) -> LaunchSpec:
    """The launch of the fused kernel's family (``fused_moe_kernel.py``, one entry kernel per launch).

    With ``workspace`` it is stage 1 of the two-stage path: it stores the intermediate into
    ``workspace.y`` (and, with adapters, adds the gate/up deltas of ``workspace.lora_delta13``).
    ``quantized_x``: ``(x_q, x_scale)`` of an fp8 forward, filled by the sort launch (required with fp8).
    ``cast_to`` (fused path): the output, where ``out`` is a float32 accumulator ``[M, H]`` followed in
    memory by M int32 add counters (:func:`fused_accumulator`); the kernel casts each finished row to
    ``cast_to`` itself (it needs ``topk_ids`` and ``expert_map`` to know how many adds a row gets).
    ``topk_weights`` (with ``cast_to``, ``sorting`` None): the one-launch decode (:func:`decode_launch`).
    """
    if problem.fp8 and quantized_x is None:
        raise ValueError("an fp8 forward's fused kernel reads x quantized by the sort launch: quantized_x is None")
    if cast_to is not None and (workspace is not None or topk_ids is None):
        raise ValueError("the fused kernel casts its accumulator on the fused path only, and needs topk_ids")
    route_from_topk = topk_weights is not None
    if route_from_topk and (cast_to is None or problem.num_tokens != 1 or problem.lora is not None or problem.fp8):
        raise ValueError("the one-launch decode is one token's fused forward without adapters, 16-bit weights, "
                         "cast by the kernel")
    values = _fused_values(problem, out, sorting, activation, config, target, workspace)
    num_grid_tiles = problem.topk if route_from_topk else grid_tiles(problem, sorting.block_m)
    values.update(num_grid_tiles=num_grid_tiles)
    if cast_to is not None:
        values.update(final_out_ptr=cast_to, topk_ids_ptr=topk_ids, expert_map_ptr=expert_map,
                      num_global_experts=expert_map.numel() if expert_map is not None else problem.num_experts,
                      stride_final_m=cast_to.stride(0), TOPK=problem.topk, NUM_EXPERTS=problem.num_experts)
    if route_from_topk:  # no launch of ours before it to depend on
        values.update(topk_weights_ptr=topk_weights, PDL=False)
    name = "decode" if route_from_topk else "fused" if workspace is None else "stage1"
    launch = "fused_cast" if name == "fused" and cast_to is not None else name
    entries = FORMAT_ENTRIES.get(problem.weight_format)
    if entries is not None:
        kernel = entries.ENTRIES[launch]
        values.update(entries.fused_values(problem, target, quantized_x))
    else:
        kernel = _FUSED_ENTRIES[(launch, problem.lora is not None)]
    args, constexprs = entry_arguments(kernel, values)
    grid = (num_grid_tiles * triton.cdiv(problem.intermediate_size, config.BLOCK_N)
            + (triton.cdiv(problem.num_tokens, config.BLOCK_M) if cast_to is not None else 0),)
    return LaunchSpec(name, kernel, grid, args, constexprs,
                      {**config.launch_options(target.backend), **_pdl_option(values["PDL"])})


def _num_lora_tokens(problem: MoEProblem, sorting: Optional[MoESortingResult]) -> Optional[torch.Tensor]:
    """The sort's count of tokens with an adapter (None without adapters)."""
    if problem.lora is None:
        return None
    if sorting.num_lora_tokens is None:
        raise ValueError("with lora, the sorting result must be allocated with count_lora_tokens=True")
    return sorting.num_lora_tokens


def _lora_operands(problem: MoEProblem, workspace: TwoStageWorkspace, down: bool):
    """(shrink input, A, B, partial-shrink workspace, K, N) of the gate/up or the down deltas."""
    lora = problem.lora
    if down:
        return workspace.y, lora.a2, lora.b2, workspace.lora_shrink2, problem.intermediate_size, problem.hidden_size
    return problem.x, lora.a13, lora.b13, workspace.lora_shrink13, problem.hidden_size, problem.intermediate_size


def lora_shrink_launch(problem: MoEProblem, sorting: MoESortingResult, workspace: TwoStageWorkspace, down: bool,
                       target: Target, pdl: bool = False) -> LaunchSpec:
    """Two-stage path with adapters: the partial shrinks ``x @ A13^T`` (before stage 1) or, with
    ``down``, ``y @ A2^T`` (after stage 1) into the workspace, K split over programs. ``pdl``:
    launched as a programmatic dependent (see ``pdl_enabled``)."""
    lora = problem.lora
    a, la, _, shrink, K, _ = _lora_operands(problem, workspace, down)
    args = dict(
        a_ptr=a, token_lora_ids_ptr=problem.token_lora_ids, lora_a_ptr=la, shrink_ptr=shrink,
        sorted_token_ids_ptr=sorting.sorted_token_ids, sorted_expert_ids_ptr=sorting.sorted_expert_ids,
        num_sorted_tiles_ptr=sorting.num_sorted_tiles, num_lora_tokens_ptr=_num_lora_tokens(problem, sorting),
        num_tokens=problem.num_tokens, K=K, num_loras=lora.num_loras,
        stride_a_m=a.stride(0), stride_la_l=la.stride(0), stride_la_e=la.stride(1), stride_la_r=la.stride(2),
        stride_shrink_split=shrink.stride(0),
    )
    constexprs = dict(DOWN=down, BLOCK_M=sorting.block_m, BLOCK_K=LORA_BLOCK_K, PDL=pdl,
                      **problem_lora_constexprs(problem))
    options = {**lora_kernel_options(sorting.block_m, target), **_pdl_option(pdl)}
    return LaunchSpec("lora_shrink2" if down else "lora_shrink13", _lora_shrink_kernel,
                      (grid_tiles(problem, sorting.block_m), shrink.shape[0]), args, constexprs, options)


def lora_expand_launch(problem: MoEProblem, sorting: MoESortingResult, workspace: TwoStageWorkspace,
                       out: torch.Tensor, down: bool, target: Target, pdl: bool = False) -> LaunchSpec:
    """Two-stage path with adapters: the gate/up deltas into ``workspace.lora_delta13`` (before stage 1)
    or, with ``down``, the down deltas added into ``out`` (before stage 2), from the summed partial
    shrinks, N split over programs (see ``fmoe2/gemm/lora_kernel.py``). ``pdl``: launched as a
    programmatic dependent."""
    lora = problem.lora
    num_grid_tiles = grid_tiles(problem, sorting.block_m)
    _, _, lb, shrink, _, N = _lora_operands(problem, workspace, down)
    dst = out if down else workspace.lora_delta13
    args = dict(
        shrink_ptr=shrink, token_lora_ids_ptr=problem.token_lora_ids, lora_b_ptr=lb, lora_scaling_ptr=lora.scaling,
        dst_ptr=dst, sorted_token_ids_ptr=sorting.sorted_token_ids, sorted_expert_ids_ptr=sorting.sorted_expert_ids,
        num_sorted_tiles_ptr=sorting.num_sorted_tiles, num_lora_tokens_ptr=_num_lora_tokens(problem, sorting),
        num_tokens=problem.num_tokens, N=N, num_loras=lora.num_loras,
        num_shrink_splits=shrink.shape[0], stride_shrink_split=shrink.stride(0), stride_dst_m=dst.stride(0),
        stride_lb_l=lb.stride(0), stride_lb_e=lb.stride(1), stride_lb_r=lb.stride(2),
    )
    block_n = lora_expand_block_n(sorting.block_m, target)
    constexprs = dict(DOWN=down, BLOCK_M=sorting.block_m, BLOCK_N=block_n, PDL=pdl,
                      **problem_lora_constexprs(problem))
    num_splits = lora_splits(num_grid_tiles, N, block_n, LORA_EXPAND_PROGRAMS_PER_SM, target)
    options = {**lora_kernel_options(sorting.block_m, target), **_pdl_option(pdl)}
    return LaunchSpec("lora_expand2" if down else "lora_expand13", _lora_expand_kernel, (num_grid_tiles, num_splits),
                      args, constexprs, options)


def stage2_kernel_launch(problem: MoEProblem, out: torch.Tensor, sorting: MoESortingResult,
                         workspace: TwoStageWorkspace, config: FusedMoEConfig, target: Target) -> LaunchSpec:
    """Two-stage path, stage 2: ``out[token] += y[sorted row] @ w2[e]^T`` (grouped GEMM, atomics over top-k);
    in deterministic mode ``slot_rows[token * topk + slot] = y[sorted row] @ w2[e]^T``, stored."""
    y = workspace.y
    slot_rows = workspace.slot_rows
    deterministic = slot_rows is not None
    c = slot_rows if deterministic else out
    num_grid_tiles = grid_tiles(problem, sorting.block_m)
    H = problem.hidden_size
    lora = problem.lora if workspace.lora_delta13 is None else None  # down deltas here, or by their own launches
    grid = (config.S2_SPLIT_K * num_grid_tiles * triton.cdiv(H, config.S2_BLOCK_N),)
    tma = tma_enabled(config, problem, target)
    pdl = pdl_enabled(config, target)
    if deterministic and config.S2_SPLIT_K != 1:
        raise ValueError(f"deterministic mode adds no partial sums: S2_SPLIT_K must be 1, got {config.S2_SPLIT_K}")
    bias = problem.w2_bias  # y carries the routing weight; the bias is scaled by it here
    values = dict(
        a_ptr=y, b_ptr=problem.w2, c_ptr=c, sorted_ids_ptr=sorting.sorted_token_ids,
        a_desc=_descriptor(y, (config.BLOCK_M, config.S2_BLOCK_K)) if tma else None,
        b_desc=_descriptor(problem.w2, (config.S2_BLOCK_N, config.S2_BLOCK_K)) if tma else None,
        b_rows_per_expert=problem.w2.shape[1],
        expert_ids_ptr=sorting.sorted_expert_ids, num_sorted_tiles_ptr=sorting.num_sorted_tiles,
        num_valid_ids=problem.num_tokens * (problem.topk if deterministic else 1), N=H,
        K=problem.intermediate_size, num_grid_tiles=num_grid_tiles, stride_a_m=y.stride(0),
        stride_b_e=problem.w2.stride(0), stride_b_n=problem.w2.stride(1), stride_b_k=problem.w2.stride(2),
        stride_c_m=c.stride(0), bias_ptr=bias, stride_bias_e=bias.stride(0) if bias is not None else None,
        b_scale_ptr=problem.w2_scale if problem.packed else None, WEIGHT_GROUP=problem.scale_block[1] if problem.packed else 1,
        row_weights_ptr=sorting.sorted_weights if bias is not None else None,
        ATOMIC_OUTPUT=not deterministic, BLOCK_M=config.BLOCK_M, BLOCK_N=config.S2_BLOCK_N, BLOCK_K=config.S2_BLOCK_K,
        GROUP_M=config.S2_GROUP_M, PDL=pdl, SPLIT_K=config.S2_SPLIT_K, TAIL_M=config.TAIL_M,
        IDS_PER_TOKEN=problem.topk if deterministic else 1,
        token_lora_ids_ptr=None, lora_shrink_ptr=None, lora_b_ptr=None, lora_scaling_ptr=None, num_lora_tokens_ptr=None,
        num_loras=None, num_shrink_splits=None, stride_shrink_split=None, stride_lb_l=None, stride_lb_e=None,
        stride_lb_r=None, LORA_SPLITS_PER_STEP=1, **lora_constexprs(None, 0, 0),
    )
    kernel = _stage2_kernel
    entries = FORMAT_ENTRIES.get(problem.weight_format)
    if entries is not None:
        kernel = entries.ENTRIES["stage2"]
        values.update(entries.stage2_values(problem, target, workspace))
    if lora is not None:
        shrink, b2 = workspace.lora_shrink2, lora.b2
        values.update(token_lora_ids_ptr=problem.token_lora_ids, lora_shrink_ptr=shrink, lora_b_ptr=b2,
                      lora_scaling_ptr=lora.scaling, num_lora_tokens_ptr=_num_lora_tokens(problem, sorting),
                      num_loras=lora.num_loras, num_shrink_splits=shrink.shape[0], stride_shrink_split=shrink.stride(0),
                      stride_lb_l=b2.stride(0), stride_lb_e=b2.stride(1), stride_lb_r=b2.stride(2),
                      LORA_SPLITS_PER_STEP=max(1, LORA_SHRINK_SUM_ELEMENTS // (config.BLOCK_M * lora.padded_rank)),
                      **problem_lora_constexprs(problem))
    args, constexprs = entry_arguments(kernel, values)
    return LaunchSpec("stage2", kernel, grid, args, constexprs,
                      {**config.launch_options(target.backend, stage2=True), **_pdl_option(pdl)})


COMBINE_ELEMENTS = 2048  # output elements per combine program
COMBINE_MAX_BLOCK_H = 1024


def combine_launch(problem: MoEProblem, out: torch.Tensor, rows: torch.Tensor, topk_ids: Optional[torch.Tensor],
                   expert_map: Optional[torch.Tensor]) -> LaunchSpec:
    """Deterministic mode, last launch: ``out[t] = sum over slots, in order, of rows[t * topk + slot]``
    (``rows``: the workspace's slot rows); without ``topk_ids``, the cast of a float32 accumulator
    ``rows [M, H]`` to ``out`` (``FusedMoEConfig.accumulate_fp32``). ``fmoe2/gemm/combine_kernel.py``."""
    M, H = problem.num_tokens, problem.hidden_size
    block_h = min(COMBINE_MAX_BLOCK_H, triton.next_power_of_2(H))
    block_t = max(1, COMBINE_ELEMENTS // block_h)
    grid = (triton.cdiv(M, block_t), triton.cdiv(H, block_h))
    if topk_ids is None:
        return LaunchSpec("cast", _cast_rows_kernel, grid, dict(rows_ptr=rows, out_ptr=out, num_tokens=M, H=H,
                                                                stride_rows_m=rows.stride(0), stride_out_m=out.stride(0)),
                          dict(BLOCK_T=block_t, BLOCK_H=block_h), {"num_warps": 4})
    args = dict(slot_rows_ptr=rows, out_ptr=out, topk_ids_ptr=topk_ids, expert_map_ptr=expert_map, num_tokens=M, H=H,
                num_global_experts=expert_map.numel() if expert_map is not None else problem.num_experts,
                stride_slot_m=rows.stride(0), stride_out_m=out.stride(0))
    constexprs = dict(TOPK=problem.topk, NUM_EXPERTS=problem.num_experts, BLOCK_T=block_t, BLOCK_H=block_h)
    return LaunchSpec("combine", _combine_slots_kernel, grid, args, constexprs, {"num_warps": 4})


def forward_specs(problem: MoEProblem, topk_weights: torch.Tensor, topk_ids: torch.Tensor, activation: str,
                  out: torch.Tensor, expert_map: Optional[torch.Tensor], config: FusedMoEConfig, target: Target,
                  sorting: MoESortingResult, workspace: Optional[TwoStageWorkspace],
                  quantized_x: Optional[Tuple[torch.Tensor, torch.Tensor]] = None,
                  accumulator: Optional[torch.Tensor] = None) -> List[LaunchSpec]:
    """The launches of one forward, in order: ``sort`` (``sort_count`` before it where the sort is
    chunked), then ``fused``, or ``stage1`` and ``stage2`` (with adapters, unless the stages compute
    the deltas (:func:`deltas_in_stages`), ``lora_shrink13`` and ``lora_expand13`` before stage 1,
    ``lora_shrink2`` and ``lora_expand2`` before stage 2), and in deterministic mode ``combine`` last.
    ``workspace`` is None on the fused path. ``accumulator``: the float32 buffer of
    ``FusedMoEConfig.accumulate_fp32`` (:func:`forward_buffers`): the sort zeroes it and the GEMMs add
    into it; where :func:`fused_kernel_casts` the fused kernel casts each finished row to ``out`` itself,
    elsewhere a last launch, ``cast``, writes it to ``out``.
    ``quantized_x``: ``(x_q, x_scale)`` buffers of an fp8 forward, which the sort fills."""
    lora = problem.lora
    pdl = pdl_enabled(config, target)
    final_out = out
    if accumulator is not None:
        out = accumulator
    # With PDL every launch after the sort starts while its predecessor runs and waits in-kernel; all but
    # stage 2 signal their dependents early. With adapters the sort also counts the tokens that have one.
    x_quantization = None
    if quantized_x is not None:  # fp8: the sort launch quantizes x once for every GEMM program to read
        x_quantization = x_quantization_values(problem.x, *quantized_x, fp8_constexprs(problem.w1.dtype,
                                                                                      target.interpreter))
    # Deterministic mode: ids token * topk + slot, and no zeroing (the combine launch writes every element).
    specs = sort_launch_specs(topk_ids, topk_weights, problem.num_experts, expert_map, sorting,
                              None if problem.deterministic else out, expanded_ids=problem.deterministic,
                              token_lora_ids=problem.token_lora_ids, num_loras=lora.num_loras if lora is not None else 0,
                              launch_dependents=pdl, num_compute_units=target.num_sms, x_quantization=x_quantization)
    cast = [combine_launch(problem, final_out, accumulator, None, None)] if accumulator is not None else []
    if workspace is None:
        cast_to = None
        if fused_kernel_casts(problem, config):  # [M * H + M]: the rows, then the add counters the kernel casts by
            rows = accumulator[:problem.num_tokens * problem.hidden_size]
            out, cast_to = rows.view(problem.num_tokens, problem.hidden_size), final_out
            cast = []
        return specs + [fused_kernel_launch(problem, out, sorting, activation, config, target, quantized_x=quantized_x,
                                            cast_to=cast_to, topk_ids=topk_ids, expert_map=expert_map)] + cast
    lora_launches = lora is not None and not deltas_in_stages(problem, config)
    if lora_launches:
        specs += [lora_shrink_launch(problem, sorting, workspace, False, target, pdl),
                  lora_expand_launch(problem, sorting, workspace, out, False, target, pdl)]
    specs.append(fused_kernel_launch(problem, out, sorting, activation, config, target, workspace, quantized_x))
    if lora_launches:
        specs += [lora_shrink_launch(problem, sorting, workspace, True, target, pdl),
                  lora_expand_launch(problem, sorting, workspace, out, True, target, pdl)]
    specs.append(stage2_kernel_launch(problem, out, sorting, workspace, config, target))
    if problem.deterministic:
        specs.append(combine_launch(problem, out, workspace.slot_rows, topk_ids, expert_map))
    return specs + cast


def forward_buffers(problem: MoEProblem, config: FusedMoEConfig, target: Target, chunk_size: int
                    ) -> List[Tuple[str, torch.dtype, Tuple[int, ...]]]:
    """``(name, dtype, shape)`` of every buffer a forward allocates: the sort's (``chunk_size``: of
    the chunked sort, 0 for one launch), then on the two-stage path the workspace's, and the float32
    accumulator where the config has ``accumulate_fp32`` (not in deterministic mode, which sums in float32
    already)."""
    buffers = sorting_buffers(problem.num_tokens * problem.topk, problem.num_experts, config.BLOCK_M,
                              problem.lora is not None, chunk_size)
    if problem.fp8:  # x quantized by the sort launch
        M, H = problem.num_tokens, problem.hidden_size
        buffers += [("x_q", problem.w1.dtype, (M, -(-H // 16) * 16)),
                    ("x_scale", torch.float32, (M, triton.cdiv(H, x_group(H, problem.w1_scale))))]
    if config.path == "two_stage":
        buffers += TwoStageWorkspace.buffers(problem, config.BLOCK_M, config, target)
    if accumulates_fp32(problem, config):
        M, H = problem.num_tokens, problem.hidden_size
        # The fused kernel counts each token's adds after its rows (int32, zeroed with them by the sort).
        buffers.append(("accumulator", torch.float32, (M * H + M,) if fused_kernel_casts(problem, config) else (M, H)))
    return buffers


# Batch sizes up to which the fused kernel casts its float32 accumulator itself (one launch fewer: about 4.5 us of
# host time per call on the H200) instead of a cast launch after it. Same-run CUDA-graph time over the cast launch
# (H200, Qwen3 / DeepSeek-V2-Lite, 2026-11-26): 0.997x / 0.995x at M=1, 1.086x / 1.004x at 2, 1.006x / 1.011x at 4,
# 1.015x / 1.031x at 8, 1.014x / 1.008x at 16, 1.019x / 1.022x at 128: from two tokens on the kernel's own cast
# cost more GPU time than the cast launch (where the time goes was not measured;
# docs/host_cost.md#one-launch-fewer-at-decode).
KERNEL_CAST_MAX_TOKENS = 1


def fused_kernel_casts(problem: MoEProblem, config: FusedMoEConfig) -> bool:
    """Whether the fused kernel casts its float32 accumulator to the output itself (the fused path with the
    accumulator, up to :data:`KERNEL_CAST_MAX_TOKENS` tokens), each row by the program that adds into it last."""
    return (config.path == "fused" and problem.num_tokens <= KERNEL_CAST_MAX_TOKENS
            and accumulates_fp32(problem, config))


def decodes_in_one_launch(problem: MoEProblem, config: FusedMoEConfig) -> bool:
    """Whether an eager call (not one captured in a CUDA graph) may run the forward as one launch of the fused kernel,
    with no sort: one token, the fused path with the kernel's own cast (:func:`fused_kernel_casts`), no adapters,
    16-bit weights. Its accumulator is kept between calls (``fmoe2/gemm/decode.py``)."""
    return (problem.num_tokens == 1 and problem.lora is None and not problem.fp8  # (fp8: the sort quantizes x)
            and fused_kernel_casts(problem, config))


def decode_launch(problem: MoEProblem, topk_weights: torch.Tensor, topk_ids: torch.Tensor, activation: str,
                  out: torch.Tensor, expert_map: Optional[torch.Tensor], config: FusedMoEConfig, target: Target,
                  accumulator: torch.Tensor) -> LaunchSpec:
    """The one-launch decode (:func:`decodes_in_one_launch`): the fused kernel reads the token's top-k slots itself
    (tile t: slot t) and adds into ``accumulator`` (float32, at least ``H + 1`` elements, zero: ``H`` columns and
    the token's add counter), which the program that adds last casts to ``out`` and zeroes again."""
    rows = accumulator[:problem.hidden_size].view(1, problem.hidden_size)
    return fused_kernel_launch(problem, rows, None, activation, config, target, cast_to=out, topk_ids=topk_ids,
                               expert_map=expert_map, topk_weights=topk_weights)


def accumulates_fp32(problem: MoEProblem, config: FusedMoEConfig) -> bool:
    """Whether the forward's atomic adds go to a float32 accumulator cast to the output at the end (by the fused
    kernel itself where :func:`fused_kernel_casts`, else by a last launch; never in deterministic mode, which
    sums in float32 already): ``config.accumulate_fp32`` where set,
    else on the fused path with 16-bit weights and outputs. There the fused kernel adds ``topk * ceil(I /
    BLOCK_N)`` partial results into each output element, each add rounding in bf16, and its error was 2.2-3.2x
    the unfused vLLM-style path's (H100, Qwen3 and DeepSeek-V2-Lite, M=1-128); with the accumulator 0.60-0.63x,
    for 1.2-5.5% more time in CUDA graphs (measured with a cast launch at every M). The two-stage path adds
    ``topk * S2_SPLIT_K``
    times, within 1.12x of that error, where an accumulator cost up to 11.5% (docs/numerics.md#the-default-modes-error).
    fp8 weights keep 16-bit adds (the accumulator is not measured with them)."""
    if problem.deterministic:
        return False
    if config.accumulate_fp32 is not None:
        return config.accumulate_fp32
    return (config.path == "fused" and not problem.fp8
            and problem.x.dtype in (torch.bfloat16, torch.float16))


def forward_buffer_views(problem: MoEProblem, config: FusedMoEConfig, views: dict, chunk_size: int
                         ) -> Tuple[MoESortingResult, Optional[TwoStageWorkspace], Optional[tuple],
                                    Optional[torch.Tensor]]:
    """The sorting result, the (two-stage path) workspace, the (fp8) quantized x ``(x_q, x_scale)`` and the
    float32 accumulator held by ``views`` of :func:`forward_buffers` (None where absent)."""
    sorting = MoESortingResult.from_views(views, config.BLOCK_M, problem.num_tokens, chunk_size)
    workspace = TwoStageWorkspace.from_views(views, problem.intermediate_size) if config.path == "two_stage" else None
    quantized_x = (views["x_q"][:, :problem.hidden_size], views["x_scale"]) if "x_q" in views else None
    return sorting, workspace, quantized_x, views.get("accumulator")


__all__ = ["MoEProblem", "TwoStageWorkspace", "forward_specs", "forward_buffers", "forward_buffer_views",
           "fused_kernel_launch", "stage2_kernel_launch", "lora_shrink_launch", "lora_expand_launch",
           "combine_launch", "fused_kernel_casts", "decodes_in_one_launch", "decode_launch", "tma_enabled",
           "pdl_enabled", "deltas_in_stages", "lora_constexprs", "grid_tiles"]
