"""Public ``fused_moe``: argument checks, config pick, then the launches: sort + fused kernel
(fused path, zero workspace) or sort + stage 1 + stage 2 (two-stage path; with adapters, a LoRA
shrink and expand run before stage 1 and again before stage 2, except at decode sizes, where the
stages compute the deltas themselves)."""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable, List, Optional, Tuple, Union

import torch
import triton
from triton.tools.tensor_descriptor import TensorDescriptor

from .._validation import (FLOAT_DTYPES, ID_DTYPES, check_out_overlaps, check_same_device, check_tensor,
                           interpreter_enabled, on_device)
from ..reference import ACTIVATIONS
from ..sorting import MoESortingResult, launch_moe_sorting, max_busy_tiles
from ..multiprocessors import num_multiprocessors, shared_memory_per_program
from .config import (LORA_STACK_WIDTH, PATHS, FusedMoEConfig, current_backend, fit_config, fit_lora_config_to_problem,
                     get_config, lora_in_stages)
from .fused_moe_kernel import _fused_moe_kernel
from .grouped_gemm_kernel import _grouped_gemm_kernel
from .layout import PreparedMoEWeights
from .lora import MoELoRA, PreparedMoELoRA, prepare_lora
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


def check_lora_args(lora, token_lora_ids, M, E, H, inter, dtype):
    """Checks the LoRA arguments of :func:`fused_moe`; returns ``lora`` (or None)."""
    if lora is None and token_lora_ids is None:
        return None
    if lora is None or token_lora_ids is None:
        missing = "lora" if lora is None else "token_lora_ids"
        raise ValueError(f"lora and token_lora_ids go together: {missing} is None")
    if not isinstance(lora, (MoELoRA, PreparedMoELoRA)):
        raise TypeError(f"lora must be a fmoe2.MoELoRA or PreparedMoELoRA, got {type(lora).__name__}")
    if lora.dtype != dtype:
        raise TypeError(f"lora weights have dtype {lora.dtype} but hidden_states has {dtype}")
    if (lora.num_experts, lora.hidden_size, lora.intermediate_size) != (E, H, inter):
        raise ValueError(f"lora is for E={lora.num_experts}, H={lora.hidden_size}, I={lora.intermediate_size} "
                         f"but the base weights have E={E}, H={H}, I={inter}")
    check_tensor("token_lora_ids", token_lora_ids, dtypes=(torch.int32,), shape=(M,),
                 shape_doc=f"[M] = [{M}] (adapter per token, -1 for none)")
    if lora.device != token_lora_ids.device:
        raise ValueError(f"lora is on {lora.device} but token_lora_ids is on {token_lora_ids.device}")
    return lora


def check_fused_moe_args(hidden_states, w1, w2, topk_weights, topk_ids, activation, out, expert_map, config,
                         path="auto", lora=None, token_lora_ids=None) -> MoEProblem:
    """Validates every argument of :func:`fused_moe` on the host; raises TypeError/ValueError."""
    check_tensor("hidden_states", hidden_states, ndim=2, dtypes=FLOAT_DTYPES, shape_doc="[M, H]")
    M, H = hidden_states.shape
    dtype = hidden_states.dtype
    if isinstance(w1, PreparedMoEWeights):
        if w2 is not None:
            raise ValueError("w2 must be None when w1 is a PreparedMoEWeights (it already holds the down weights)")
        if w1.dtype != dtype:
            raise TypeError(f"prepared weights have dtype {w1.dtype} but hidden_states has {dtype}")
        if w1.hidden_size != H:
            raise ValueError(f"prepared weights have hidden size {w1.hidden_size} but hidden_states has H={H}")
        E, inter = w1.num_experts, w1.intermediate_size
        w1_t, w2_t, interleaved = w1.w13, w1.w2, True
        check_tensor("w1.w13", w1_t, ndim=3, dtypes=(dtype,), shape_doc="[E, 2*I_pad, H_pad]")
        check_tensor("w1.w2", w2_t, ndim=3, dtypes=(dtype,), shape_doc="[E, H_pad, I_pad]")
        if (w1_t.shape[1] % 2 or w1_t.shape[1] < 2 * inter or w1_t.shape[2] < H or w2_t.shape[0] != E
                or w2_t.shape[1] < H or w2_t.shape[2] < inter):
            raise ValueError(f"prepared weights are inconsistent with H={H}, I={inter}, E={E}: w13 "
                             f"{tuple(w1_t.shape)} must be [E, 2*I_pad, H_pad] and w2 {tuple(w2_t.shape)} "
                             f"[E, H_pad, I_pad] with I_pad >= I and H_pad >= H")
    else:
        check_tensor("w1", w1, ndim=3, dtypes=FLOAT_DTYPES, shape_doc="[E, 2I, H]")
        if w1.dtype != dtype:
            raise TypeError(f"w1 must have the dtype of hidden_states ({dtype}), got {w1.dtype}")
        E, two_i, w1_h = w1.shape
        if two_i % 2 or w1_h != H:
            raise ValueError(f"w1 must have shape [E, 2I, H] with H={H} (gate rows then up rows), got {tuple(w1.shape)}")
        inter = two_i // 2
        check_tensor("w2", w2, dtypes=(dtype,), shape=(E, H, inter), shape_doc=f"[E, H, I] = [{E}, {H}, {inter}]")
        w1_t, w2_t, interleaved = w1, w2, False
    if E < 1 or inter < 1 or H < 1:
        raise ValueError(f"w1 must have E >= 1 experts and H, I >= 1, got E={E}, H={H}, I={inter}")
    check_tensor("topk_ids", topk_ids, ndim=2, dtypes=ID_DTYPES, shape_doc=f"[M, topk] with M={M}")
    if topk_ids.shape[0] != M or topk_ids.shape[1] < 1:
        raise ValueError(f"topk_ids must have shape [M, topk] with M={M} and topk >= 1, got {tuple(topk_ids.shape)}")
    topk = topk_ids.shape[1]
    check_tensor("topk_weights", topk_weights, dtypes=FLOAT_DTYPES, shape=(M, topk),
                 shape_doc=f"[M, topk] = [{M}, {topk}] like topk_ids")
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    if expert_map is not None:
        check_tensor("expert_map", expert_map, ndim=1, dtypes=(torch.int32,), shape_doc="[num_global_experts]")
        if expert_map.numel() < 1:
            raise ValueError("expert_map must have at least one entry")
    if out is not None:
        check_tensor("out", out, dtypes=(dtype,), shape=(M, H), shape_doc=f"[M, H] = [{M}, {H}]")
        check_out_overlaps(out, hidden_states=hidden_states, w1=w1_t, w2=w2_t, topk_weights=topk_weights,
                           topk_ids=topk_ids, expert_map=expert_map)
    if path not in ("auto",) + PATHS:
        raise ValueError(f"path must be one of {('auto',) + PATHS}, got {path!r}")
    if config is not None and not isinstance(config, FusedMoEConfig):
        raise TypeError(f"config must be a fmoe2.FusedMoEConfig or None, got {type(config).__name__}")
    lora = check_lora_args(lora, token_lora_ids, M, E, H, inter, dtype)
    check_same_device("hidden_states", hidden_states, w1=w1_t, w2=w2_t, topk_weights=topk_weights,
                      topk_ids=topk_ids, expert_map=expert_map, out=out, token_lora_ids=token_lora_ids)
    # Every check has passed: only now convert unprepared adapters (allocates).
    prepared_lora = prepare_lora(lora) if lora is not None else None
    if out is not None and prepared_lora is not None:
        check_out_overlaps(out, token_lora_ids=token_lora_ids, **prepared_lora.tensors())
    return MoEProblem(hidden_states, w1_t, w2_t, interleaved, E, H, inter, topk, prepared_lora, token_lora_ids)


def grid_tiles(problem: MoEProblem, sorting: MoESortingResult) -> int:
    """Tiles the grids are sized for: the most any routing can fill (see ``max_busy_tiles``)."""
    return max_busy_tiles(problem.x.shape[0] * problem.topk, problem.num_experts, sorting.block_m)


@dataclass
class TwoStageWorkspace:
    """Buffers of the two-stage path, in sorted-row order (``grid_tiles * BLOCK_M`` rows)."""

    # [rows, I] view of a [rows, I rounded up to 8] buffer (16-byte rows, for tensor descriptors), input
    # dtype: activated intermediate, routing weight applied
    y: torch.Tensor
    # With adapters: partial shrinks [splits, rows, 2R] / [splits, rows, R] float32 (R the padded rank)
    # of the gate/up and the down deltas, and the gate/up deltas [rows, 2I] (input dtype, gate then up);
    # only rows with an adapter are written and read. Where the stages compute the deltas
    # (deltas_in_stages) only lora_shrink2, one split per I slice of stage 1.
    lora_shrink13: Optional[torch.Tensor] = None
    lora_shrink2: Optional[torch.Tensor] = None
    lora_delta13: Optional[torch.Tensor] = None

    @classmethod
    def allocate(cls, problem: MoEProblem, sorting: MoESortingResult,
                 config: Optional[FusedMoEConfig] = None) -> "TwoStageWorkspace":
        """With adapters, the buffers of the LoRA shrink and expand launches, or with a ``config``
        whose stages compute the deltas (:func:`deltas_in_stages`) those of the down shrinks."""
        rows = grid_tiles(problem, sorting) * sorting.block_m
        x = problem.x
        # Row stride padded to 16 bytes so stage 2 can read y through a tensor descriptor.
        inter = problem.intermediate_size
        y = torch.empty(rows, -(-inter // 8) * 8, dtype=x.dtype, device=x.device)[:, :inter]
        ws = cls(y=y)
        if config is not None and deltas_in_stages(problem, config):
            ws.lora_shrink2 = torch.empty(triton.cdiv(inter, config.BLOCK_N), rows, problem.lora.padded_rank,
                                          dtype=torch.float32, device=x.device)
        elif problem.lora is not None:
            tiles, R = grid_tiles(problem, sorting), problem.lora.padded_rank
            for name, K, parts in (("lora_shrink13", problem.hidden_size, 2), ("lora_shrink2", inter, 1)):
                splits = lora_shrink_splits(tiles, K, x.device)
                setattr(ws, name, torch.empty(splits, rows, parts * R, dtype=torch.float32, device=x.device))
            ws.lora_delta13 = torch.empty(rows, 2 * inter, dtype=x.dtype, device=x.device)
        return ws


TMA_MAX_BLOCK = 256  # largest tensor-descriptor block dimension (a hardware limit of the copy engine)


def tma_enabled(config: FusedMoEConfig, problem: MoEProblem, backend: str) -> bool:
    """Whether weight tiles come through tensor descriptors: ``config.tma``, for prepared 16-bit
    weights (rows padded to 16 bytes, as descriptors need) on CUDA. Triton lowers descriptors to the
    bulk tensor copy engine (UTMALDG) on sm_90 and to pointer loads on sm_80; for gfx942 a descriptor
    load compiled to 2-byte loads, so HIP keeps its pointer loads. fp32 (a testing dtype) keeps
    pointer loads: with descriptors a picked fp32 config needed 287 KB of shared memory on sm_90."""
    return (config.tma and backend == "cuda" and problem.gate_up_interleaved
            and problem.x.dtype in (torch.bfloat16, torch.float16))


def pdl_enabled(config: FusedMoEConfig, problem: MoEProblem, backend: str) -> bool:
    """Whether the launches after the sort are programmatic dependents (``config.pdl``): on CUDA GPUs
    of compute capability 9 or newer (``griddepcontrol``), never under the interpreter or on ROCm.
    Meta tensors (``fmoe2.codegen``, which checks the target) take the config as given."""
    device = problem.x.device
    if not config.pdl or backend != "cuda" or device.type == "cpu" or interpreter_enabled():
        return False
    return device.type == "meta" or torch.cuda.get_device_capability(device)[0] >= 9


def _descriptor(t: torch.Tensor, block) -> Optional[TensorDescriptor]:
    """Tensor descriptor of ``t`` ([E, rows, cols] viewed as [E * rows, cols], or 2-D) in ``block``
    tiles; None (the kernels then use pointer loads) where the copy engine cannot take it: a block
    dimension over TMA_MAX_BLOCK, or a base address or row stride that is not a multiple of 16 bytes."""
    t2 = t.view(-1, t.shape[-1]) if t.dim() == 3 else t
    row_bytes = t2.stride(0) * t2.element_size()
    if max(block) > TMA_MAX_BLOCK or t2.stride(1) != 1 or row_bytes % 16 or t2.data_ptr() % 16:
        return None
    return TensorDescriptor.from_tensor(t2, list(block))


def fused_kernel_launch(problem: MoEProblem, out: torch.Tensor, sorting: MoESortingResult, activation: str,
                        config: FusedMoEConfig, backend: str, workspace: Optional[TwoStageWorkspace] = None):
    """Grid, arguments and options of the fused kernel (shared by the launcher and ``fmoe2.codegen``).

    With ``workspace`` it is stage 1 of the two-stage path: it stores the intermediate into
    ``workspace.y`` (and, with adapters, adds the gate/up deltas of ``workspace.lora_delta13``).
    """
    y = workspace.y if workspace is not None else None
    delta13 = workspace.lora_delta13 if workspace is not None else None
    # Deltas in the stages: stage 1 stores its slices' down shrinks.
    shrink2 = workspace.lora_shrink2 if workspace is not None and delta13 is None else None
    num_grid_tiles = grid_tiles(problem, sorting)
    grid = (num_grid_tiles * triton.cdiv(problem.intermediate_size, config.BLOCK_N),)
    tma = tma_enabled(config, problem, backend)
    args = dict(
        x_ptr=problem.x, w1_ptr=problem.w1, w2_ptr=problem.w2, out_ptr=out, y_ptr=y if y is not None else out,
        w13_desc=_descriptor(problem.w1, (2 * config.BLOCK_N, config.BLOCK_K)) if tma else None,
        w2_desc=_descriptor(problem.w2, (config.BLOCK_H, config.BLOCK_N)) if tma else None,
        sorted_token_ids_ptr=sorting.sorted_token_ids, sorted_weights_ptr=sorting.sorted_weights,
        sorted_expert_ids_ptr=sorting.sorted_expert_ids, num_sorted_tiles_ptr=sorting.num_sorted_tiles,
        num_tokens=problem.x.shape[0], H=problem.hidden_size, I=problem.intermediate_size,
        num_grid_tiles=num_grid_tiles,
        stride_x_m=problem.x.stride(0), stride_w1_e=problem.w1.stride(0), stride_w1_n=problem.w1.stride(1),
        stride_w2_e=problem.w2.stride(0), stride_w2_h=problem.w2.stride(1), stride_out_m=out.stride(0),
        stride_y_m=y.stride(0) if y is not None else 0,
        stride_delta13_m=delta13.stride(0) if delta13 is not None else 0,
        **_lora_args(problem, out),
        num_lora_tokens_ptr=_num_lora_tokens(problem, sorting, out),
        lora_delta13_ptr=delta13 if delta13 is not None else out,
        lora_shrink2_ptr=shrink2 if shrink2 is not None else out,
        stride_shrink2_split=shrink2.stride(0) if shrink2 is not None else 0,
    )
    constexprs = dict(
        ACTIVATION=activation, GATE_UP_INTERLEAVED=problem.gate_up_interleaved,
        BLOCK_M=config.BLOCK_M, BLOCK_N=config.BLOCK_N, BLOCK_K=config.BLOCK_K, BLOCK_H=config.BLOCK_H,
        GROUP_M=config.GROUP_M, STORE_Y=y is not None,
        HAS_LORA=problem.lora is not None,
        LORA_DELTAS_READY=delta13 is not None,
        # Unused without adapters: a constant there, so a LoRA-fitted config adds no plain compile.
        LORA_STAGES=(config.lora_num_stages or config.num_stages) if problem.lora is not None else 1,
        PDL=pdl_enabled(config, problem, backend),
        **lora_constexprs(problem.lora, problem.x.shape[0] * problem.topk, problem.num_experts),
    )
    return grid, args, constexprs, {**config.launch_options(backend), **_pdl_option(constexprs["PDL"])}


def _pdl_option(pdl: bool) -> dict:
    """The launch option that goes with a PDL=True kernel (its gdc_wait makes the early start safe)."""
    return {"launch_pdl": True} if pdl else {}


def deltas_in_stages(problem: MoEProblem, config: FusedMoEConfig) -> bool:
    """Whether this forward's two stages compute the adapter deltas themselves (no LoRA launches; the
    only LoRA workspace holds stage 1's down shrinks; :func:`fmoe2.gemm.config.lora_in_stages` says
    where)."""
    return problem.lora is not None and lora_in_stages(config, problem.x.shape[0], problem.num_experts, problem.topk)


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


def _num_lora_tokens(problem: MoEProblem, sorting: MoESortingResult, stand_in: torch.Tensor) -> torch.Tensor:
    """The sort's count of tokens with an adapter (``stand_in`` without adapters: never read)."""
    if problem.lora is None:
        return stand_in
    if sorting.num_lora_tokens is None:
        raise ValueError("with lora, the sorting result must be allocated with count_lora_tokens=True")
    return sorting.num_lora_tokens


# (pointer argument, stride prefix, row-stride suffix) of the LoRA tensors a13, b13, a2, b2.
_LORA_TENSOR_ARGS = (("lora_a13_ptr", "la13", "r"), ("lora_b13_ptr", "lb13", "r"), ("lora_a2_ptr", "la2", "r"),
                     ("lora_b2_ptr", "lb2", "r"))


def _lora_args(problem: MoEProblem, out: torch.Tensor) -> dict:
    """The fused kernel's LoRA arguments; without LoRA, stand-ins that are never dereferenced."""
    lora = problem.lora
    if lora is None:
        args = dict(token_lora_ids_ptr=out, lora_scaling_ptr=out, num_loras=0)
        tensors, strides = (out,) * 4, ((0, 0, 0),) * 4
    else:
        args = dict(token_lora_ids_ptr=problem.token_lora_ids, lora_scaling_ptr=lora.scaling,
                    num_loras=lora.num_loras)
        tensors = (lora.a13, lora.b13, lora.a2, lora.b2)
        strides = tuple(t.stride()[:3] for t in tensors)  # (adapter, expert, row)
    for (ptr_name, prefix, row), t, (s_l, s_e, s_row) in zip(_LORA_TENSOR_ARGS, tensors, strides):
        args.update({ptr_name: t, f"stride_{prefix}_l": s_l, f"stride_{prefix}_e": s_e, f"stride_{prefix}_{row}": s_row})
    return args


# Two-stage LoRA kernels (lora_kernel.py). The shrink's BLOCK_K: see lora_kernel_options. Expand
# BLOCK_N and the programs per multiprocessor from a sweep on the H100 (2026-11-23; rank 16, 4 adapters,
# mixed; Mixtral M=1-1024, Qwen3 and DeepSeek M=16-1024; BLOCK_N 64/128 x expand 1/2/4 x shrink 1/2
# programs per SM): 128 / 2 / 2 was best or within 2% of best at every point; BLOCK_N=64 was up to
# 2.5% slower, and one program per SM for both up to 6% slower (Qwen3 M=16: 331.7 vs 312.5 us).
LORA_BLOCK_K = 64  # shrink step
LORA_SHRINK_PROGRAMS_PER_SM = 2
LORA_EXPAND_PROGRAMS_PER_SM = 2
LORA_MAX_SHRINK_SPLITS = 16  # every expand program reads and sums this many partial shrinks


def lora_kernel_options(block_m: int, backend: str, cuda_arch: Optional[int]) -> dict:
    """Warps and pipeline stages of the two-stage LoRA kernels (``cuda_arch``: e.g. 90; None: unknown).

    CUDA sm_90 and newer (and an unknown GPU): 4 warps and 4 stages up to 64-row tiles, 8 warps for
    128 rows. H100 sweep (2026-11-23, the four LoRA launches summed, Qwen3 / DeepSeek M=1024, Mixtral
    M=128; 4 or 8 warps x 2-4 stages x shrink BLOCK_K 64/128): 4 warps, 4 stages, BLOCK_K=64 took
    114.8 / 77.3 / 45.0 us against 172.7 / 107.9 / 62.6 with 8 warps, 2 stages, BLOCK_K=128. That
    holds though the sm_90 gate/up expand then spills 10 instructions at 64-row tiles; at 128 rows 4
    warps spilled hundreds. Older CUDA GPUs (not measured): 8 warps, 2 stages, where sm_80 code has
    no spills up to 64-row tiles (with 4 warps the sm_80 down expand spilled 280 instructions at 64
    rows); at 128 rows Triton 3.9 spills 4 instructions in the gate/up shrink and Triton 3.6 42 in the
    down expand (3 stages: none under 3.9, 58 under 3.6; kept at 2 until measured on one). HIP:
    8 warps, 2 stages (4 stages of the shrink's tiles would not fit gfx942's 64 KiB of LDS;
    compiled without spills, see ``fmoe2.codegen``)."""
    if backend == "hip" or (cuda_arch is not None and cuda_arch < 90):
        return {"num_warps": 8, "num_stages": 2}
    return {"num_warps": 4 if block_m <= 64 else 8, "num_stages": 4}


def cuda_arch_of(device) -> Optional[int]:
    """Compute capability as 10 * major + minor of a CUDA device; None for CPU or meta tensors and
    under the interpreter."""
    device = torch.device(device)
    if device.type != "cuda" or interpreter_enabled():
        return None
    major, minor = torch.cuda.get_device_capability(device)
    return 10 * major + minor


def lora_expand_block_n(block_m: int, backend: str, cuda_arch: Optional[int]) -> int:
    """Expand columns per step.

    * sm_90 and newer (and an unknown GPU): 128 (H100 sweep, see above). At 128-row tiles (8 warps,
      4 stages) 128 columns against 64, the four LoRA launches summed (``python -m
      fmoe2.bench.lora_settings``, 2026-11-24, Mixtral / DeepSeek M=1024): H100 152.9 / 85.8 us
      against 168.1 / 87.5, H200 147.8 / 84.8 against 151.6 / 86.2. There the gate/up expand spills
      2 instructions under Triton 3.6 and none under 3.9. (4 warps, 3 stages, 64 columns: H100
      158.1 / 84.8 us, H200 151.0 / 81.2: best at DeepSeek, 3.4% behind at H100 Mixtral.)
    * HIP: 64 (128 spilled 65 VGPRs in the 32-row gate/up expand on gfx942).
    * Older CUDA GPUs: 128, 64 from 64-row tiles. There bf16 atomic adds are compare-and-swap loops
      and the down expand spills with wide tiles (sm_80, 8 warps, 2 stages, ``fmoe2.codegen`` over
      three shapes, M 1-4096): 64-row tiles at 128 columns spilled 60 instructions under Triton 3.6,
      128-row tiles at 128 columns 328 under Triton 3.9. With this rule Triton 3.9 spills nothing in
      the expands; Triton 3.6 still spills 42 in the 128-row down expand (at 32 columns that one was
      clean under 3.6 but spilled 48 under 3.9).
    """
    if backend == "hip":
        return 64
    if cuda_arch is not None and cuda_arch < 90:
        return 64 if block_m >= 64 else 128
    return 128


def lora_splits(num_grid_tiles: int, length: int, block: int, programs_per_sm: int, device) -> int:
    """Programs per tile sharing a loop of ``length`` in ``block`` steps: about ``programs_per_sm``
    programs per multiprocessor in all (off-GPU, the interpreter, 8 in all, so small tests split
    too), at most one per step."""
    device = torch.device(device)
    if device.type == "cuda":
        target = programs_per_sm * torch.cuda.get_device_properties(device).multi_processor_count
    else:
        target = 8
    return max(1, min(triton.cdiv(length, block), triton.cdiv(target, num_grid_tiles)))


def lora_shrink_splits(num_grid_tiles: int, K: int, device) -> int:
    """Splits of the shrink's K loop (H or I), hence partial shrinks per row in the workspace."""
    splits = lora_splits(num_grid_tiles, K, LORA_BLOCK_K, LORA_SHRINK_PROGRAMS_PER_SM, device)
    return min(LORA_MAX_SHRINK_SPLITS, splits)


def _lora_operands(problem: MoEProblem, workspace: TwoStageWorkspace, down: bool):
    """(shrink input, A, B, partial-shrink workspace, K, N) of the gate/up or the down deltas."""
    lora = problem.lora
    if down:
        return workspace.y, lora.a2, lora.b2, workspace.lora_shrink2, problem.intermediate_size, problem.hidden_size
    return problem.x, lora.a13, lora.b13, workspace.lora_shrink13, problem.hidden_size, problem.intermediate_size


def lora_shrink_launch(problem: MoEProblem, sorting: MoESortingResult, workspace: TwoStageWorkspace, down: bool,
                       backend: str, cuda_arch: Optional[int], pdl: bool = False):
    """Two-stage path with adapters: the partial shrinks ``x @ A13^T`` (before stage 1) or, with
    ``down``, ``y @ A2^T`` (after stage 1) into the workspace, K split over programs. ``pdl``:
    launched as a programmatic dependent (see ``pdl_enabled``)."""
    lora = problem.lora
    a, la, _, shrink, K, _ = _lora_operands(problem, workspace, down)
    args = dict(
        a_ptr=a, token_lora_ids_ptr=problem.token_lora_ids, lora_a_ptr=la, shrink_ptr=shrink,
        sorted_token_ids_ptr=sorting.sorted_token_ids, sorted_expert_ids_ptr=sorting.sorted_expert_ids,
        num_sorted_tiles_ptr=sorting.num_sorted_tiles, num_lora_tokens_ptr=_num_lora_tokens(problem, sorting, a),
        num_tokens=problem.x.shape[0], K=K, num_loras=lora.num_loras,
        stride_a_m=a.stride(0), stride_la_l=la.stride(0), stride_la_e=la.stride(1), stride_la_r=la.stride(2),
        stride_shrink_split=shrink.stride(0),
    )
    constexprs = dict(DOWN=down, BLOCK_M=sorting.block_m, BLOCK_K=LORA_BLOCK_K, PDL=pdl,
                      **lora_constexprs(lora, problem.x.shape[0] * problem.topk, problem.num_experts))
    options = {**lora_kernel_options(sorting.block_m, backend, cuda_arch), **_pdl_option(pdl)}
    return (grid_tiles(problem, sorting), shrink.shape[0]), args, constexprs, options


def lora_expand_launch(problem: MoEProblem, sorting: MoESortingResult, workspace: TwoStageWorkspace,
                       out: torch.Tensor, down: bool, backend: str, cuda_arch: Optional[int], pdl: bool = False):
    """Two-stage path with adapters: the gate/up deltas into ``workspace.lora_delta13`` (before stage 1)
    or, with ``down``, the down deltas added into ``out`` (before stage 2), from the summed partial
    shrinks, N split over programs (see ``fmoe2/gemm/lora_kernel.py``). ``pdl``: launched as a
    programmatic dependent."""
    lora = problem.lora
    num_grid_tiles = grid_tiles(problem, sorting)
    _, _, lb, shrink, _, N = _lora_operands(problem, workspace, down)
    dst = out if down else workspace.lora_delta13
    args = dict(
        shrink_ptr=shrink, token_lora_ids_ptr=problem.token_lora_ids, lora_b_ptr=lb, lora_scaling_ptr=lora.scaling,
        dst_ptr=dst, sorted_token_ids_ptr=sorting.sorted_token_ids, sorted_expert_ids_ptr=sorting.sorted_expert_ids,
        num_sorted_tiles_ptr=sorting.num_sorted_tiles, num_lora_tokens_ptr=_num_lora_tokens(problem, sorting, dst),
        num_tokens=problem.x.shape[0], N=N, num_loras=lora.num_loras,
        num_shrink_splits=shrink.shape[0], stride_shrink_split=shrink.stride(0), stride_dst_m=dst.stride(0),
        stride_lb_l=lb.stride(0), stride_lb_e=lb.stride(1), stride_lb_r=lb.stride(2),
    )
    block_n = lora_expand_block_n(sorting.block_m, backend, cuda_arch)
    constexprs = dict(DOWN=down, BLOCK_M=sorting.block_m, BLOCK_N=block_n, PDL=pdl,
                      **lora_constexprs(lora, problem.x.shape[0] * problem.topk, problem.num_experts))
    num_splits = lora_splits(num_grid_tiles, N, block_n, LORA_EXPAND_PROGRAMS_PER_SM, out.device)
    options = {**lora_kernel_options(sorting.block_m, backend, cuda_arch), **_pdl_option(pdl)}
    return (num_grid_tiles, num_splits), args, constexprs, options


def stage2_kernel_launch(problem: MoEProblem, out: torch.Tensor, sorting: MoESortingResult,
                         workspace: TwoStageWorkspace, config: FusedMoEConfig, backend: str):
    """Two-stage path, stage 2: ``out[token] += y[sorted row] @ w2[e]^T`` (grouped GEMM, atomics over top-k)."""
    y = workspace.y
    num_grid_tiles = grid_tiles(problem, sorting)
    H = problem.hidden_size
    lora = problem.lora if workspace.lora_delta13 is None else None  # down deltas here, or by their own launches
    grid = (config.S2_SPLIT_K * num_grid_tiles * triton.cdiv(H, config.S2_BLOCK_N),)
    tma = tma_enabled(config, problem, backend)
    args = dict(
        a_ptr=y, b_ptr=problem.w2, c_ptr=out, sorted_ids_ptr=sorting.sorted_token_ids,
        a_desc=_descriptor(y, (config.BLOCK_M, config.S2_BLOCK_K)) if tma else None,
        b_desc=_descriptor(problem.w2, (config.S2_BLOCK_N, config.S2_BLOCK_K)) if tma else None,
        b_rows_per_expert=problem.w2.shape[1],
        expert_ids_ptr=sorting.sorted_expert_ids, num_sorted_tiles_ptr=sorting.num_sorted_tiles,
        topk_weights_ptr=sorting.sorted_weights, num_valid_ids=problem.x.shape[0], N=H,
        K=problem.intermediate_size, num_grid_tiles=num_grid_tiles, stride_a_m=y.stride(0),
        stride_b_e=problem.w2.stride(0), stride_b_n=problem.w2.stride(1), stride_c_m=out.stride(0),
    )
    constexprs = dict(GATHER_A=False, A_ROW_DIVISOR=1, MUL_ROUTED_WEIGHT=False, ATOMIC_OUTPUT=True,
                      BLOCK_M=config.BLOCK_M, BLOCK_N=config.S2_BLOCK_N, BLOCK_K=config.S2_BLOCK_K,
                      GROUP_M=config.S2_GROUP_M, PDL=pdl_enabled(config, problem, backend),
                      SPLIT_K=config.S2_SPLIT_K)
    if lora is not None:
        shrink, b2 = workspace.lora_shrink2, lora.b2
        args.update(token_lora_ids_ptr=problem.token_lora_ids, lora_shrink_ptr=shrink, lora_b_ptr=b2,
                    lora_scaling_ptr=lora.scaling, num_lora_tokens_ptr=_num_lora_tokens(problem, sorting, out),
                    num_loras=lora.num_loras, num_shrink_splits=shrink.shape[0], stride_shrink_split=shrink.stride(0),
                    stride_lb_l=b2.stride(0), stride_lb_e=b2.stride(1), stride_lb_r=b2.stride(2))
        lora_consts = lora_constexprs(lora, problem.x.shape[0] * problem.topk, problem.num_experts)
        # Partial shrinks loaded per step of stage 2's sum: [splits, BLOCK_M, R] fp32, 4096 elements.
        splits_per_step = max(1, 4096 // (config.BLOCK_M * lora.padded_rank))
        constexprs.update(HAS_LORA=True, LORA_SPLITS_PER_STEP=splits_per_step, **lora_consts)
    return grid, args, constexprs, {**config.launch_options(backend, stage2=True), **_pdl_option(constexprs["PDL"])}


def fused_moe(
    hidden_states: torch.Tensor,
    w1: Union[torch.Tensor, PreparedMoEWeights],
    w2: Optional[torch.Tensor],
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    activation: str = "silu",
    out: Optional[torch.Tensor] = None,
    expert_map: Optional[torch.Tensor] = None,
    config: Optional[FusedMoEConfig] = None,
    path: str = "auto",
    lora: Optional[Union[MoELoRA, PreparedMoELoRA]] = None,
    token_lora_ids: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """MoE forward in two launches and no intermediate buffer (or three, with the two-stage path).

    ``out[t] = sum_k topk_weights[t,k] * (act(x_t Wg_e^T) * (x_t Wu_e^T)) Wd_e^T``, ``e = topk_ids[t,k]``.

    Args:
        hidden_states: ``[M, H]`` bf16 or fp16 (fp32 is accepted too, mainly for testing).
        w1: ``[E, 2I, H]`` gate rows then up rows, same dtype; or a :class:`PreparedMoEWeights`
            from :func:`fmoe2.prepare_weights` (then ``w2`` must be None).
        w2: ``[E, H, I]`` down weights, same dtype.
        topk_weights: ``[M, topk]`` float32 (bf16/fp16 accepted) routing weights.
        topk_ids: ``[M, topk]`` int32/int64 expert ids (global ids when ``expert_map`` is given).
        activation: ``"silu"`` (SwiGLU), ``"gelu"`` (erf GeGLU) or ``"gelu_tanh"`` (tanh GeGLU).
        out: optional ``[M, H]`` output in the input dtype; it is overwritten (zeroed by the sort).
        expert_map: optional int32 ``[E_global]``, global expert id -> local id or -1; tokens
            routed to other ranks' experts contribute nothing (their rows may stay zero).
        config: optional :class:`FusedMoEConfig` overriding :func:`fmoe2.get_config`.
        path: ``"auto"`` (the config's path: tuned per device, batch and shape, with or without
            adapters, see :func:`fmoe2.get_config`), ``"fused"``
            (sort + one fused kernel, zero workspace) or ``"two_stage"`` (sort + stage 1 writing
            the intermediate ``[rows, I]`` in the input dtype + stage 2 down GEMM with ``topk``
            atomic adds per output element; workspace ``y`` of at most
            ``rows = (M*topk // BLOCK_M + min(E, M*topk)) * BLOCK_M`` x I elements, and with
            ``lora`` also ``rows x 2I`` for the gate/up deltas, both in the input dtype, and the fp32
            partial shrinks, at most ``16 x rows x 3R`` (R the padded rank); adapters add four
            launches. Up to 1 routed row per expert the stages compute the deltas themselves: no
            extra launch, and only ``ceil(I / BLOCK_N) x rows x R`` fp32 of down shrinks).
        lora: optional :class:`fmoe2.MoELoRA` adapters (better: :func:`fmoe2.prepare_lora` of
            them, done once; an unprepared one is converted on every call). Their deltas are
            computed inside the fused kernel, or on the two-stage path by a shrink and an expand
            kernel before each stage, at decode sizes inside the stages (see ``fmoe2/gemm/lora.py``,
            ``fmoe2/gemm/lora_kernel.py`` and :func:`fmoe2.gemm.config.lora_in_stages`).
        token_lora_ids: int32 ``[M]``, the adapter of each token, ``-1`` (or any id outside
            ``[0, max_loras)``) for none; required with ``lora``.

    Returns:
        ``[M, H]`` in the dtype of ``hidden_states`` (``out`` when given).

    Gate/up accumulate in fp32; the activated intermediate is rounded to the input dtype before
    the down GEMM and partial results are added into ``out`` in the input dtype. With fp16,
    values beyond 65504 in the intermediate or the output become inf: prefer bf16.
    No host synchronisation and no data-dependent shapes: safe to capture in a CUDA graph.
    """
    problem = check_fused_moe_args(hidden_states, w1, w2, topk_weights, topk_ids, activation, out, expert_map, config,
                                   path, lora, token_lora_ids)
    M, H = hidden_states.shape
    if out is None:
        out = torch.empty_like(hidden_states)
    if M == 0:
        return out
    if config is None:
        config = get_config(M, problem.num_experts, H, problem.intermediate_size, problem.topk, hidden_states.dtype,
                            device=hidden_states.device, path=path, lora=problem.lora is not None)
    else:
        config = fit_given_config(config, problem, path)
    with on_device(hidden_states):
        for _, launch in forward_launches(problem, hidden_states, topk_weights, topk_ids, activation, out, expert_map,
                                          config):
            launch()
    return out


def fit_given_config(config: FusedMoEConfig, problem: MoEProblem, path: str = "auto") -> FusedMoEConfig:
    """A caller's config fitted like a picked one: clamps and the atomic-add precision cap
    (:func:`fit_config`), and with adapters their steps (:func:`fit_lora_config`)."""
    config = fit_config(config, problem.hidden_size, problem.intermediate_size, problem.topk, problem.x.dtype, path,
                        shared_memory=shared_memory_per_program(problem.x.device))
    if problem.lora is None:
        return config
    return fit_lora_config_to_problem(config, problem.x.shape[0], problem.num_experts, problem.hidden_size,
                                      problem.intermediate_size, problem.topk, problem.x.dtype,
                                      num_multiprocessors(problem.x.device),
                                      shared_memory=shared_memory_per_program(problem.x.device))


def forward_launches(problem: MoEProblem, hidden_states, topk_weights, topk_ids, activation: str, out: torch.Tensor,
                     expert_map, config: FusedMoEConfig) -> List[Tuple[str, Callable[[], None]]]:
    """The launches of one forward, in order, as ``(name, launch)`` pairs, their buffers (sorting
    results, two-stage workspace) allocated: ``sort``, then ``fused``, or ``stage1`` and ``stage2``
    (with adapters, unless the stages compute the deltas (:func:`deltas_in_stages`),
    ``lora_shrink13`` and ``lora_expand13`` before stage 1, ``lora_shrink2`` and ``lora_expand2``
    before stage 2).
    :func:`fused_moe` runs them in order; the benchmark also times each one alone."""
    M = hidden_states.shape[0]
    backend = current_backend()
    lora = problem.lora
    sorting = MoESortingResult.allocate(M * problem.topk, problem.num_experts, config.BLOCK_M, M, hidden_states.device,
                                        count_lora_tokens=lora is not None)
    # With PDL every launch after the sort starts while its predecessor runs and waits in-kernel; all but
    # stage 2 signal their dependents early. With adapters the sort also counts the tokens that have one.
    launches = [("sort", functools.partial(launch_moe_sorting, topk_ids, topk_weights, problem.num_experts,
                                           expert_map, sorting, out, token_lora_ids=problem.token_lora_ids,
                                           num_loras=lora.num_loras if lora is not None else 0,
                                           launch_dependents=pdl_enabled(config, problem, backend)))]

    def add(name, kernel, launch):
        grid, args, constexprs, options = launch
        launches.append((name, lambda: kernel[grid](**args, **constexprs, **options)))

    workspace = TwoStageWorkspace.allocate(problem, sorting, config) if config.path == "two_stage" else None
    lora_deltas = workspace is not None and lora is not None and not deltas_in_stages(problem, config)
    if lora_deltas:
        on = dict(backend=backend, cuda_arch=cuda_arch_of(hidden_states.device),
                  pdl=pdl_enabled(config, problem, backend))
        add("lora_shrink13", _lora_shrink_kernel, lora_shrink_launch(problem, sorting, workspace, down=False, **on))
        add("lora_expand13", _lora_expand_kernel,
            lora_expand_launch(problem, sorting, workspace, out, down=False, **on))
    add("fused" if workspace is None else "stage1", _fused_moe_kernel,
        fused_kernel_launch(problem, out, sorting, activation, config, backend, workspace))
    if workspace is not None:
        if lora_deltas:
            add("lora_shrink2", _lora_shrink_kernel, lora_shrink_launch(problem, sorting, workspace, down=True, **on))
            add("lora_expand2", _lora_expand_kernel,
                lora_expand_launch(problem, sorting, workspace, out, down=True, **on))
        add("stage2", _grouped_gemm_kernel, stage2_kernel_launch(problem, out, sorting, workspace, config, backend))
    return launches
