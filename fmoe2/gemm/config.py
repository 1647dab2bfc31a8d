"""Kernel configs are data: JSON files under ``configs/``; :func:`get_config` is the one picker.

Lookup order:

1. a tuned file ``configs/<device>/E=<E>,H=<H>,I=<I>,topk=<topk>,dtype=<dtype>.json`` mapping
   batch sizes to configs (``{"1": {...}, "16": {...}}``); the nearest batch size wins;
2. otherwise ``configs/defaults.json``: per backend (``cuda``/``hip``, plus ``gfx950`` where it
   differs), a list of rules ordered by ``max_tokens_per_expert``; the first rule with
   ``M*topk/E <= max_tokens_per_expert`` wins.

Block sizes are then clamped to the problem (a block never exceeds the next power of two of the
dimension it tiles, and never goes under 16, the smallest matrix-instruction size), and for
16-bit outputs BLOCK_N is widened until each output element receives at most
``MAX_ATOMIC_ADDS`` atomic adds (``topk * ceil(I / BLOCK_N)``; on the two-stage path ``topk *
S2_SPLIT_K``, capped likewise): every add rounds the running sum
to the output dtype, so the error grows like the square root of their number (measurements:
docs/configs.md#atomic-adds-per-output-element).
A widened config keeps weight tiles of up to ``MAX_WEIGHT_TILE`` elements (BLOCK_K=64 at
BLOCK_N=256) with enough warps to hold them, and no more pipeline stages than the backend's
shared memory takes (``PIPELINE_ELEMENTS``); smaller tiles left the defaults well behind the tuned
configs (measurements: docs/configs.md#widened-weight-tiles). Last, every
config's loops are fitted to the GPU's shared memory for the input dtype (:func:`fit_shared_memory`).
"""
from __future__ import annotations

import functools
import json
import os
import re
from dataclasses import asdict, dataclass, fields, replace
from typing import Dict, Optional

import torch
import triton

from ..formats import WEIGHT_FORMATS, WEIGHT_ONLY_FORMATS, weight_format
from ..fp8 import FP8_GROUP
from ..target import DEFAULT_SHARED_MEMORY, Target, current_backend, target_of
from ..sorting import max_busy_tiles
from . import config_cuda, config_hip

# Each backend's rules, one file each (the same names in each).
BACKENDS = {"cuda": config_cuda, "hip": config_hip}

CONFIG_DIR = os.path.join(os.path.dirname(__file__), "configs")
PATHS = ("fused", "two_stage")
MAX_ATOMIC_ADDS = 128  # per output element, for bf16/fp16 outputs
MAX_BLOCK_N = 256
MAX_WEIGHT_TILE = 32768  # elements of the gate/up weight tile [2*BLOCK_N, BLOCK_K] once widened
MAX_DOWN_TILE = 16384  # elements of the down weight tile [BLOCK_H, BLOCK_N] once widened (BLOCK_H=128 at
# BLOCK_N=256 spilled on sm_80; BLOCK_H=64 measured as fast on the H200)
# A widened program gets >= tile/WEIGHT_TILE_PER_WARP warps: on sm_90, BLOCK_K=64 at BLOCK_N=256 spilled
# 40 instructions with 4 warps and none with 8.
WEIGHT_TILE_PER_WARP = 4096
MAX_ACC_REGS = 64  # fp32 gate/up accumulator registers per thread once widened
# Contiguous bytes of each K row of a gate or up weight tile read from N-contiguous weights with gate/up
# concatenated (ConfigProblem.n_contiguous_halves): one 128-byte cache line. A row is BLOCK_N elements there
# (interleaved rows: 2*BLOCK_N, K-contiguous ones: BLOCK_K). The H200's gpt-oss pick at M=1 and 8 (two-stage,
# BLOCK_N=32: 64-byte halves of lines, each warp's copy touching 8 lines where interleaved rows touch 4) ran 1.20x
# slower at M=8 than K-contiguous weights with the same instructions, registers and shared memory; interleaved rows at
# the same BLOCK_N ran 0.99x (misc/bench/layout/NVIDIA_H200.md).
MIN_WEIGHT_ROW_BYTES = 128
MAX_FUSED_ACC = 8 * 32 * 128  # fp32 gate/up accumulator elements of one fused program (8 warps x 128 registers)
FP8_MAX_ACC = MAX_FUSED_ACC // 2  # the same with fp8 weights (fit_fp8_config)
FP8_MAX_FUSED_ATOMIC_ADDS = 64  # per output element, for fp8 on the fused path (fp8_prefers_two_stage)
FP8_FUSED_MAX_TOKENS_PER_EXPERT = 16  # routed rows per expert up to which fp8 may take the fused path (same)
# With adapters, the two stages compute the deltas themselves (no LoRA launches) up to this many routed rows
# per expert (M*topk/E), LoRA launches run beyond (lora_in_stages). Measurements and the rule in full:
# docs/lora.md#deltas-in-the-stages-up-to-1-row-per-expert
LORA_IN_STAGES_MAX_TOKENS_PER_EXPERT = 1
# With adapters, fused slices beyond one wave are at least this wide (fit_lora_config_to_problem): narrow ones
# ran mixed adapters far slower. Measurements: docs/lora.md#slices-of-at-least-128-columns
LORA_MIN_BLOCK_N = 128
LORA_STACK_WIDTH = 128  # max stacked gate+up shrink columns (LORA_SLOTS * 2 * padded rank), see lora_constexprs


# Keys of a default rule (configs/defaults.json) that say when it applies, not how it tiles.
RULE_KEYS = ("max_tokens_per_expert", "min_fused_programs_per_sm")


@dataclass(frozen=True)
class FusedMoEConfig:
    """Tiling of the fused kernel (and BLOCK_M of the sort)."""

    BLOCK_M: int  # sorted rows per tile (one expert per tile)
    BLOCK_N: int  # intermediate-dimension slice owned by one program
    BLOCK_K: int  # hidden-dimension step of the gate+up GEMM
    BLOCK_H: int  # hidden-dimension chunk of the down GEMM (one atomic tile)
    GROUP_M: int = 1  # tiles whose slices are launched together (1: slice fastest)
    num_warps: int = 4
    num_stages: int = 3
    # Pipeline depth of the loops that carry adapter work (fused multi-LoRA); None: num_stages.
    # Tiles without adapters keep num_stages: their loops are other loops of the same kernel.
    lora_num_stages: Optional[int] = None
    # Prepared weights' tiles through tensor descriptors (Hopper's bulk tensor copy engine) instead of
    # pointer loads; CUDA only (ignored on ROCm and with plain weights). Off until measured faster.
    tma: bool = False
    # Programmatic dependent launch: each launch after the sort is scheduled while its predecessor
    # runs and waits for its results in-kernel (hides launch gaps); CUDA sm_90+ only. Off until measured faster.
    pdl: bool = False
    # ROCm only (ignored on CUDA, never passed to a CUDA launch):
    waves_per_eu: Optional[int] = None
    matrix_instr_nonkdim: Optional[int] = None
    kpack: Optional[int] = None
    # "fused" (zero workspace) or "two_stage" (stage 1 writes y [rows, I], stage 2 down GEMM)
    path: str = "fused"
    # Stage 2 of the two-stage path (grouped down GEMM, N = H, K = I):
    S2_BLOCK_N: int = 128
    S2_BLOCK_K: int = 64
    S2_GROUP_M: int = 8
    s2_num_warps: int = 8
    s2_num_stages: int = 3
    # Stage-2 programs per output tile, each over a share of I (more, shorter programs; S2_SPLIT_K
    # times the atomic adds per output element).
    S2_SPLIT_K: int = 1
    # Two-stage path (16-bit and 4-bit weights; stage 1 with LoRA launches and the fp8 entries compute whole tiles):
    # a sorted tile whose real rows fit in its first TAIL_M rows computes those only, in both stages (an expert's last tile; 0: off; a power of two below
    # BLOCK_M). Measurements: docs/performance.md#the-tail-tile
    TAIL_M: int = 0
    # The atomic adds go to a float32 accumulator [M, H] (zeroed by the sort) that is cast to the output dtype
    # (by the fused kernel at M=1, by one more launch elsewhere: launches.fused_kernel_casts): one rounding of
    # each output element instead of one per add. None: the rule of fmoe2/gemm/launches.py's accumulates_fp32
    # (on the fused path with 16-bit weights and outputs).
    accumulate_fp32: Optional[bool] = None

    def __post_init__(self):
        if self.path not in PATHS:
            raise ValueError(f"config path must be one of {PATHS}, got {self.path!r}")
        for name in ("BLOCK_M", "BLOCK_N", "BLOCK_K", "BLOCK_H", "S2_BLOCK_N", "S2_BLOCK_K"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 16 or v & (v - 1):
                raise ValueError(f"config {name} must be a power of two >= 16, got {v!r}")
        for name in ("num_warps", "s2_num_warps"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1 or v & (v - 1):
                raise ValueError(f"config {name} must be a power of two >= 1, got {v!r}")
        for name in ("GROUP_M", "S2_GROUP_M", "num_stages", "s2_num_stages", "S2_SPLIT_K"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"config {name} must be an int >= 1, got {v!r}")
        if not isinstance(self.TAIL_M, int) or self.TAIL_M < 0 or (self.TAIL_M and (self.TAIL_M < 16 or self.TAIL_M & (
                self.TAIL_M - 1) or self.TAIL_M >= self.BLOCK_M)):
            raise ValueError(f"config TAIL_M must be 0 or a power of two >= 16 below BLOCK_M={self.BLOCK_M}, "
                             f"got {self.TAIL_M!r}")
        if self.accumulate_fp32 is not None and not isinstance(self.accumulate_fp32, bool):
            raise ValueError(f"config accumulate_fp32 must be a bool or None, got {self.accumulate_fp32!r}")
        if self.lora_num_stages is not None and (not isinstance(self.lora_num_stages, int) or self.lora_num_stages < 1):
            raise ValueError(f"config lora_num_stages must be None or an int >= 1, got {self.lora_num_stages!r}")
        # Made once: torch.compile traces to_json() as a constant (it cannot trace json.dumps), and the
        # hash is taken on every fused_moe call given a config (plans are keyed by it).
        object.__setattr__(self, "_json", json.dumps(self.to_dict(), sort_keys=True))
        object.__setattr__(self, "_hash", hash(tuple(getattr(self, f.name) for f in fields(self))))

    def __hash__(self) -> int:
        return self._hash

    def launch_options(self, backend: str, stage2: bool = False) -> Dict[str, int]:
        """Keyword options for the Triton launch on ``backend`` ("cuda" or "hip")."""
        if stage2:
            opts = {"num_warps": self.s2_num_warps, "num_stages": self.s2_num_stages}
        else:
            opts = {"num_warps": self.num_warps, "num_stages": self.num_stages}
        opts.update({k: getattr(self, k) for k in BACKENDS[backend].LAUNCH_OPTIONS if getattr(self, k) is not None})
        return opts

    def to_dict(self) -> dict:
        d = {k: v for k, v in asdict(self).items() if v is not None}
        if not self.TAIL_M:  # (off: as configs written before the field read)
            del d["TAIL_M"]
        if self.path == "fused":  # stage-2 fields are meaningless there
            d = {k: v for k, v in d.items() if not k.lower().startswith("s2_")}
        return d

    def to_json(self) -> str:
        """:meth:`to_dict` as JSON (how ``torch.ops.fmoe2.fused_moe`` takes a config)."""
        return self._json

    @classmethod
    def from_dict(cls, d: dict) -> "FusedMoEConfig":
        known = {f.name for f in fields(cls)}
        unknown = set(d) - known - set(RULE_KEYS)
        if unknown:
            raise ValueError(f"unknown config keys {sorted(unknown)}; expected {sorted(known)}")
        return cls(**{k: v for k, v in d.items() if k in known})


def device_config_name(device: Optional[torch.device] = None) -> str:
    """File-system-safe GPU name, e.g. ``NVIDIA_H100_80GB_HBM3``; ``cpu`` without a GPU or for a tensor that is
    not on one (CPU, meta)."""
    if device is not None and torch.device(device).type != "cuda" or not torch.cuda.is_available():
        return "cpu"
    return re.sub(r"[^A-Za-z0-9]+", "_", torch.cuda.get_device_name(device)).strip("_")


def shape_file_name(E: int, H: int, I: int, topk: int, dtype: torch.dtype) -> str:
    return f"E={E},H={H},I={I},topk={topk},dtype={str(dtype).replace('torch.', '')}.json"


@functools.lru_cache(maxsize=None)
def _load_json(path: str):
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def lora_in_stages(cfg: FusedMoEConfig, M: int, E: int, topk: int) -> bool:
    """Whether a forward with adapters on ``cfg`` computes the adapter deltas inside the two stages of
    the two-stage path (stage 1 the gate/up deltas in its K loop as the fused kernel does, and each
    row's down shrink of its I slice; stage 2 sums those and expands them after its K loop): up to
    ``LORA_IN_STAGES_MAX_TOKENS_PER_EXPERT`` routed rows per expert. Beyond it every stage-1
    program's repeated gate/up shrink over H, with more rows and adapters per tile, costs more than
    the LoRA shrink and expand launches of ``fmoe2/gemm/lora_kernel.py``."""
    return cfg.path == "two_stage" and M * topk / E <= LORA_IN_STAGES_MAX_TOKENS_PER_EXPERT


def fused_grid_programs(cfg: FusedMoEConfig, M: int, E: int, I: int, topk: int) -> int:
    """The fused kernel's GEMM programs: the most tiles any routing can fill (``max_busy_tiles``) times the I slices
    (``ceil(I / BLOCK_N)``)."""
    return max_busy_tiles(M * topk, E, cfg.BLOCK_M) * triton.cdiv(I, cfg.BLOCK_N)


def fused_grid_fits_one_wave(cfg: FusedMoEConfig, M: int, E: int, I: int, topk: int, num_sms: int) -> bool:
    """Whether the fused kernel's grid (:func:`fused_grid_programs`) holds at most one program per multiprocessor
    (examples: docs/configs.md#grids-of-one-wave)."""
    return fused_grid_programs(cfg, M, E, I, topk) <= num_sms


def fit_lora_config_to_problem(cfg: FusedMoEConfig, M: int, E: int, H: int, I: int, topk: int, dtype: torch.dtype,
                               num_sms: int, backend: Optional[str] = None,
                               shared_memory: int = DEFAULT_SHARED_MEMORY,
                               in_stages: Optional[bool] = None) -> FusedMoEConfig:
    """:func:`fit_lora_config` for a problem's grid on ``num_sms`` multiprocessors with
    ``shared_memory`` bytes per program.

    A fused config whose grid is beyond one wave first gets slices of at least
    ``LORA_MIN_BLOCK_N`` columns (:func:`fit_config`'s widening; ``backend`` as there): every
    slice program of a tile reads the tile's gate/up A over all of H (``2R x H`` per adapter)
    whatever its width, so narrow slices multiply that traffic. Where the two stages carry the
    adapter work (:func:`lora_in_stages`) stage 1's slices are widened likewise (no atomic adds to
    cap there), then fitted (measurements: docs/lora.md#slices-of-at-least-128-columns).
    ``in_stages``: None for :func:`lora_in_stages`'s rule; deterministic mode passes True.
    """
    one_wave = fused_grid_fits_one_wave(cfg, M, E, I, topk, num_sms)
    if in_stages is None:
        in_stages = lora_in_stages(cfg, M, E, topk)
    if cfg.path == "fused" and cfg.BLOCK_N < LORA_MIN_BLOCK_N and not one_wave:
        cfg = fit_config(cfg, H, I, topk, dtype, backend=backend, min_block_n=LORA_MIN_BLOCK_N,
                         shared_memory=shared_memory)
        one_wave = fused_grid_fits_one_wave(cfg, M, E, I, topk, num_sms)  # fewer, wider slices
    elif in_stages and cfg.BLOCK_N < LORA_MIN_BLOCK_N:
        cfg = replace(cfg, BLOCK_N=max(cfg.BLOCK_N, min(LORA_MIN_BLOCK_N, triton.next_power_of_2(I))))
    return fit_lora_config(cfg, one_wave, shared_memory, dtype.itemsize, in_stages)


def gate_up_loop_shared_bytes(cfg: FusedMoEConfig, stages: int, element_bytes: int = 2, lora: bool = True) -> int:
    """Shared memory of a gate/up loop of the fused kernel: ``stages - 1`` buffers of the x tile,
    the gate/up weight tile and, with ``lora`` (the loop carrying adapter work), the widest stack
    of adapter A rows (``LORA_STACK_WIDTH``), each BLOCK_K wide. The kernel takes the larger of
    its two loops (checked against ``fmoe2.codegen``'s reports:
    docs/configs.md#shared-memory-of-the-loops)."""
    rows = cfg.BLOCK_M + 2 * cfg.BLOCK_N + (LORA_STACK_WIDTH if lora else 0)
    return pipelined_loop_bytes(stages, rows * cfg.BLOCK_K, element_bytes)


def fit_lora_config(cfg: FusedMoEConfig, one_wave: bool, shared_memory: int = DEFAULT_SHARED_MEMORY,
                    element_bytes: int = 2, in_stages: bool = False) -> FusedMoEConfig:
    """Keeps a fused config free of (large) spills and within shared memory with the LoRA steps compiled in.

    ``one_wave``: the grid holds at most one program per multiprocessor
    (:func:`fused_grid_fits_one_wave`). ``shared_memory``: bytes one program may take. The LoRA
    loops' stages come down first, then the plain loops', to 2 each, then BLOCK_K is halved, until
    both loops fit (:func:`gate_up_loop_shared_bytes`). ``element_bytes``: of the input dtype.
    Two-stage configs come back unchanged, unless ``in_stages`` (:func:`lora_in_stages`): their
    loops carry no adapter work then (the deltas come from ``_lora_shrink_kernel`` and
    ``_lora_expand_kernel``, see ``fmoe2/gemm/lora_kernel.py``). With ``in_stages`` stage 1's
    loops are fitted to shared memory as above (stage 2's loop carries no adapter work either way).

    Tiles without adapters run the plain loops with the config's num_stages; only the loops that
    carry adapter work get ``lora_num_stages``. But warps and shared memory are the whole kernel's,
    and they set how many programs share a multiprocessor. So (measurements:
    docs/lora.md#warps-stages-and-k-tiles-of-the-adapter-loops):

    * 8 warps where the pick has 4 and BLOCK_N >= 128, unless the grid is one wave: beyond one wave
      8 warps ran mixed adapters faster; within it the pick's 4 cost adapter-free tokens less.
    * The LoRA loops get 4 stages only with small weight tiles (2 x BLOCK_N x BLOCK_K <= 16384)
      and only within one wave: 4 stages leave one program per multiprocessor instead of two,
      which pays within one wave and costs every tile beyond.
    * With 64-row tiles BLOCK_K is halved until 2 x BLOCK_N x BLOCK_K <= 16384 (wider tiles did not
      fit shared memory at 3 stages).
    """
    if cfg.path != "fused":
        if not in_stages:
            return cfg
        stage1 = replace(cfg, lora_num_stages=cfg.lora_num_stages or cfg.num_stages)
        fitted = _fit_gate_up_shared_memory(stage1, shared_memory, element_bytes)
        return fitted if fitted != stage1 else cfg
    num_warps = 8 if cfg.num_warps < 8 and cfg.BLOCK_N >= 128 and not one_wave else cfg.num_warps
    block_k = cfg.BLOCK_K
    while cfg.BLOCK_M >= 64 and block_k > 16 and 2 * cfg.BLOCK_N * block_k > 16384:
        block_k //= 2
    four_lora_stages = one_wave and cfg.BLOCK_M == 16 and 2 * cfg.BLOCK_N * block_k <= 16384
    fitted = replace(cfg, BLOCK_K=block_k, num_warps=num_warps,
                     lora_num_stages=min(cfg.lora_num_stages or cfg.num_stages, 4 if four_lora_stages else 3))
    return _fit_gate_up_shared_memory(fitted, shared_memory, element_bytes)


def _fit_gate_up_shared_memory(fitted: FusedMoEConfig, shared_memory: int, element_bytes: int) -> FusedMoEConfig:
    """LoRA stages, then the plain loops' stages down to 2, then BLOCK_K halved, until both gate/up
    loops fit ``shared_memory`` (:func:`gate_up_loop_shared_bytes`)."""
    while True:
        lora_bytes = gate_up_loop_shared_bytes(fitted, fitted.lora_num_stages, element_bytes)
        plain_bytes = gate_up_loop_shared_bytes(fitted, fitted.num_stages, element_bytes, lora=False)
        if lora_bytes > shared_memory and fitted.lora_num_stages > 2:
            fitted = replace(fitted, lora_num_stages=fitted.lora_num_stages - 1)
        elif plain_bytes > shared_memory and fitted.num_stages > 2:
            fitted = replace(fitted, num_stages=fitted.num_stages - 1)
        elif max(lora_bytes, plain_bytes) > shared_memory and fitted.BLOCK_K > 16:
            fitted = replace(fitted, BLOCK_K=fitted.BLOCK_K // 2)
        else:
            return fitted


def fit_config(cfg: FusedMoEConfig, H: int, I: int, topk: int, dtype: torch.dtype, path: str = "auto",
               backend: Optional[str] = None, min_block_n: int = 16,
               shared_memory: int = DEFAULT_SHARED_MEMORY, fp8_weights: bool = False) -> FusedMoEConfig:
    """Clamps a config to the problem (see the module docstring); every config used goes through here.

    ``path`` ("fused"/"two_stage") switches the config's path first; "auto" keeps it. ``backend``
    ("cuda"/"hip", default: this machine's) sets the shared-memory budget of widened configs.
    ``min_block_n``: a fused config's slices are widened to at least this many columns (within
    ``next_pow2(I)``), with the same budgets as the atomic-add cap's widening; a two-stage config's
    stage-1 slices likewise (no budgets: its down GEMM is stage 2's). Last, the loops'
    buffers are fitted to ``shared_memory`` bytes per program for ``dtype``
    (:func:`fit_shared_memory`).

    ``fp8_weights``: the clamps only, for :func:`fit_fp8_config` to fit next. fp8 sets the fused slices and the
    K steps to one activation group and fits the loops to shared memory in fp8's bytes; the 16-bit widening
    (its stage, warp and down-tile cuts) and shared-memory fit would be partly undone by that and partly kept,
    and change the config again when it is fitted a second time.
    """
    backend = backend or current_backend()
    if path not in ("auto", cfg.path):
        cfg = replace(cfg, path=path)
    def cap(block, dim):
        return max(16, min(block, triton.next_power_of_2(dim)))

    block_m, block_n, block_k, block_h = cfg.BLOCK_M, cap(cfg.BLOCK_N, I), cfg.BLOCK_K, cfg.BLOCK_H
    num_warps, num_stages = cfg.num_warps, cfg.num_stages
    if cfg.path == "fused" and not fp8_weights:
        capped = dtype in (torch.bfloat16, torch.float16)  # 16-bit outputs round every atomic add
        while ((capped and topk * triton.cdiv(I, block_n) > MAX_ATOMIC_ADDS) or block_n < min_block_n) and \
                block_n < min(MAX_BLOCK_N, triton.next_power_of_2(I)):
            block_n *= 2
        if block_n > cfg.BLOCK_N:
            # Keep the widened weight tiles' shared memory and the accumulator's registers in budget.
            block_k = max(16, min(block_k, MAX_WEIGHT_TILE // (2 * block_n)))
            block_h = max(16, min(block_h, MAX_DOWN_TILE // block_n))
            budget = BACKENDS[backend].PIPELINE_ELEMENTS
            while num_stages > BACKENDS[backend].MIN_WIDENED_STAGES and num_stages * 2 * block_n * block_k > budget:
                num_stages -= 1
            while block_k > 16 and num_stages * 2 * block_n * block_k > budget:
                block_k //= 2
            while block_h > 16 and num_stages * block_h * block_n > budget:
                block_h //= 2
            while block_m > 16 and block_m * 2 * block_n > MAX_FUSED_ACC:
                block_m //= 2
            num_warps = max(num_warps, min(8, max(block_m * 2 * block_n // (32 * MAX_ACC_REGS),
                                                  2 * block_n * block_k // WEIGHT_TILE_PER_WARP)))
    elif cfg.path == "two_stage" and not fp8_weights:
        block_n = max(block_n, min(min_block_n, triton.next_power_of_2(I)))
    s2_block_k = cap(cfg.S2_BLOCK_K, I)
    # Stage 2's K shares: within the atomic-add cap for 16-bit outputs, and none empty (shares take
    # ceil(steps / split) steps each, so the fewest shares of that length cover the steps).
    s2_split_k = cfg.S2_SPLIT_K
    if dtype in (torch.bfloat16, torch.float16):
        s2_split_k = max(1, min(s2_split_k, MAX_ATOMIC_ADDS // topk))
    s2_steps = triton.cdiv(I, s2_block_k)
    s2_split_k = triton.cdiv(s2_steps, triton.cdiv(s2_steps, s2_split_k))
    cfg = replace(cfg, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=cap(block_k, H), BLOCK_H=cap(block_h, H),
                  TAIL_M=cfg.TAIL_M if cfg.TAIL_M < block_m else 0, num_warps=num_warps, num_stages=num_stages,
                  S2_BLOCK_N=cap(cfg.S2_BLOCK_N, H), S2_BLOCK_K=s2_block_k, S2_SPLIT_K=s2_split_k)
    if fp8_weights:
        return cfg
    return fit_shared_memory(cfg, dtype.itemsize, shared_memory)


# 4-bit weights (fmoe2/quant4.py) are dequantized in registers, in float32, one weight tile at a time: tiles of
# up to this many elements per thread of the program. Read off the code-generation report (python -m fmoe2.codegen
# --weights mxfp4, gpt-oss-120b's shape, Triton 3.9): the 16-bit M=1 pick's [2 x 128, 128] gate/up tile (128 per
# thread at 8 warps) took 255 registers and spilled on sm_90; halving BLOCK_K there removed the spills.
# With adapters (whose operands the fused kernel also holds) or tiles of more than 32 rows (whose accumulators take
# more registers) half that: at 64, the M=1 and M=16 picks with rank-16 adapters spilled 7-10 instructions on sm_90,
# and the M=4096 picks (128-row tiles, with a loader of the time that loaded the next step's tile ahead) 3-48.
# mxfp4's tiles of 128 rows a quarter: with the select-free e2m1 decode, at half the fused kernel's 128-row picks
# (qwen3-30b-a3b M=4096, gpt-oss-20b M=1024) spilled 2 instructions on sm_90 (255 registers). (int4's at a quarter
# spilled 2 at gpt-oss-20b M=1024 where they spill none at half: the fused 128-row kernels sit at the register limit.)
PACKED_TILE_ELEMENTS_PER_THREAD = 64


# The least K step of a weight-only format's loops: 16 bytes of a packed row (32 columns of 4-bit values, 16 of
# int8) (BLOCK_K, S2_BLOCK_K, and on the fused path the slice BLOCK_N, the down GEMM's K step). On an H200 (Triton
# 3.6, bf16) 4-bit K steps of 16 columns (8 bytes a row) in the pipelined weight loads came out wrong (relative
# errors 1.0-3.2, mxfp4 and int4 alike, any group, also at num_stages=1) where the interpreter and steps of 32 were
# right; int8's steps of 16 were right. Any config with a smaller step (a caller's, or a pick fitted to a small
# H or I) is raised.
LEAST_PACKED_K_STEP = {name: 16 * WEIGHT_FORMATS[name].values_per_element for name in WEIGHT_ONLY_FORMATS}


def fit_packed_config(cfg: FusedMoEConfig, warp_size: int = 32, lora: bool = False, *,
                      weight_format: str) -> FusedMoEConfig:
    """A config fitted for prepared 4-bit weights: the K steps of the gate/up tile (``2*BLOCK_N x BLOCK_K``), the
    down chunks (``BLOCK_H x BLOCK_N``) and stage 2's K steps (``S2_BLOCK_N x S2_BLOCK_K``) halved (not below 32)
    until each tile holds at most :data:`PACKED_TILE_ELEMENTS_PER_THREAD` elements per thread (half with
    adapters or more than 32 rows per tile, a quarter for mxfp4 with 128 rows or more); the K steps of
    ``weight_format`` (mxfp4, int4 or int8) at least its :data:`LEAST_PACKED_K_STEP`; pointer loads (``tma`` off:
    :func:`~.launches.tma_enabled` takes descriptors for 16-bit weights only, so the config says what runs)."""
    share = 4 if cfg.BLOCK_M >= 128 and weight_format == "mxfp4" else 2 if lora or cfg.BLOCK_M > 32 else 1
    limit = PACKED_TILE_ELEMENTS_PER_THREAD * warp_size // share
    least_step = LEAST_PACKED_K_STEP[weight_format]

    def fitted(block, other, warps):
        while block > 32 and block * other > limit * warps:
            block //= 2
        return block

    block_n = max(cfg.BLOCK_N, least_step) if cfg.path == "fused" else cfg.BLOCK_N
    changes = dict(BLOCK_N=block_n, BLOCK_K=max(fitted(cfg.BLOCK_K, 2 * block_n, cfg.num_warps), least_step),
                   BLOCK_H=fitted(cfg.BLOCK_H, block_n, cfg.num_warps))
    if cfg.path == "two_stage":
        changes["S2_BLOCK_K"] = max(fitted(cfg.S2_BLOCK_K, cfg.S2_BLOCK_N, cfg.s2_num_warps or cfg.num_warps),
                                    least_step)
    return replace(cfg, tma=False, **changes)


def fit_fp8_config(cfg: FusedMoEConfig, x_bytes: int, shared_memory: int = DEFAULT_SHARED_MEMORY,
                   grid: Optional[tuple] = None) -> FusedMoEConfig:
    """A (fitted) config made fit for fp8 weights (``fmoe2/fp8.py``): every K step one activation
    quantization group (BLOCK_K = S2_BLOCK_K = FP8_GROUP), and on the fused path each slice one group
    of the intermediate (BLOCK_N = FP8_GROUP), so a step's scales are one per row and weight row;
    pointer loads (``tma`` off). The widened accumulator keeps to ``MAX_FUSED_ACC`` elements and
    ``MAX_ACC_REGS`` registers per thread, the down tile to ``MAX_DOWN_TILE``; stages, then BLOCK_M,
    come down until the gate/up loop (fp8 weight tile, x tile of ``x_bytes`` per element) fits
    ``shared_memory``. The config's other choices are kept (the 16-bit pick's, or a tuned fp8 entry's:
    :func:`resolve_config`).

    Two-stage configs get stage-1 slices of one group too (stage 1 then stores y quantized, see
    ``stage1_stores_fp8``), unless ``grid`` = ``(M, E, I, topk, num_sms)`` says that grid would fit
    in one wave: then the pick's narrower slices (more programs at decode sizes) stay, and y stays
    16-bit."""
    group = FP8_GROUP
    block_m, block_n, num_warps = cfg.BLOCK_M, cfg.BLOCK_N, cfg.num_warps
    block_h, s2_block_n = cfg.BLOCK_H, cfg.S2_BLOCK_N
    if cfg.path == "fused":
        block_n = group
        block_h = max(16, min(block_h, MAX_DOWN_TILE // block_n))
    elif grid is not None and fused_grid_fits_one_wave(replace(cfg, BLOCK_N=group), *grid):
        block_n = min(block_n, group)
    else:
        block_n = group
    # Each step also holds the x (or y) tile in registers to quantize it: half the 16-bit accumulator budget
    # (at the full budget, 128 x 256 spilled 537 instructions on sm_90).
    while block_m > 16 and block_m * 2 * block_n > FP8_MAX_ACC:
        block_m //= 2
    while s2_block_n > 16 and block_m * s2_block_n > FP8_MAX_ACC:
        s2_block_n //= 2
    num_warps = max(num_warps, min(8, block_m * 2 * block_n // (32 * MAX_ACC_REGS)))
    s2_num_warps = max(cfg.s2_num_warps, min(8, block_m * s2_block_n // (32 * MAX_ACC_REGS)))
    stages = cfg.num_stages

    def gate_up_bytes(st, bm):
        return pipelined_loop_bytes(st, bm * group, x_bytes) + pipelined_loop_bytes(st, 2 * block_n * group, 1)

    while gate_up_bytes(stages, block_m) > shared_memory and stages > 2:
        stages -= 1
    while gate_up_bytes(stages, block_m) > shared_memory and block_m > 16:
        block_m //= 2
    s2_stages = cfg.s2_num_stages
    while pipelined_loop_bytes(s2_stages, (block_m * x_bytes + s2_block_n) * group, 1) > shared_memory \
            and s2_stages > 2:
        s2_stages -= 1
    return replace(cfg, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=group, BLOCK_H=block_h, num_warps=num_warps,
                   num_stages=stages, S2_BLOCK_N=s2_block_n, S2_BLOCK_K=group, s2_num_warps=s2_num_warps,
                   s2_num_stages=s2_stages, tma=False, TAIL_M=0)  # (the fp8 entries compute whole tiles)


def fp8_prefers_two_stage(fitted: FusedMoEConfig, M: int, E: int, I: int, topk: int, num_sms: int) -> bool:
    """Whether an fp8 forward left to ``path="auto"`` takes the two-stage path: unless the fused path
    adds at most ``FP8_MAX_FUSED_ATOMIC_ADDS`` partial results into each output element (``topk *
    ceil(I / 128)``: fp8 slices are one 128-column activation group), the batch routes at most
    ``FP8_FUSED_MAX_TOKENS_PER_EXPERT`` rows per expert (``M * topk / E``) and the fused grid
    (``fitted``, a fused fp8 config) is beyond one wave (:func:`fused_grid_fits_one_wave`).

    Measured on the H100 (2026-11-25, block-wise scales, misc/bench/fp8): each bf16 atomic add rounds,
    so the fused path's error against the same-quantization reference grew with their number (48 adds,
    Qwen3: 0.86-1.0%; 66, DeepSeek-V2-Lite: 0.93-1.1%; 128, DeepSeek-V3: 1.4%; 224, Mixtral: 1.7-1.9%)
    while the two-stage path's stayed at 0.35-0.62%. The two-stage path (stage 1 storing y quantized) was
    faster at M >= 1024 everywhere (Qwen3 M=1024: 297.9 us against 390.2 fused) and within one wave (Qwen3
    M=1: 20.9 against 30.4); the fused path was faster for Qwen3 at M=16 and 128 (135.5 and 221.6 us against
    143.2 and 225.1)."""
    adds = topk * triton.cdiv(I, FP8_GROUP)
    return (adds > FP8_MAX_FUSED_ATOMIC_ADDS or M * topk > FP8_FUSED_MAX_TOKENS_PER_EXPERT * E
            or fused_grid_fits_one_wave(replace(fitted, path="fused"), M, E, I, topk, num_sms))


def pipelined_loop_bytes(stages: int, tile_elements: int, element_bytes: int) -> int:
    """Shared memory of a software-pipelined loop: ``stages - 1`` buffers of the tiles it loads
    (``tile_elements`` per step), as Triton asks for at launch (checked:
    docs/configs.md#shared-memory-of-the-loops)."""
    return (stages - 1) * tile_elements * element_bytes


def fit_shared_memory(cfg: FusedMoEConfig, element_bytes: int, shared_memory: int = DEFAULT_SHARED_MEMORY
                      ) -> FusedMoEConfig:
    """A config whose loops fit ``shared_memory`` bytes per program with inputs of ``element_bytes``:
    per loop, pipeline stages come down first (to 2), then its K tile (the down loop's BLOCK_H) is
    halved (not under 16).

    Loops (tiles loaded per step): the gate/up loop of the fused kernel and of stage 1,
    ``(BLOCK_M + 2 * BLOCK_N) x BLOCK_K``; the fused kernel's down loop, ``BLOCK_H x BLOCK_N`` (same
    ``num_stages``); stage 2, ``(BLOCK_M + S2_BLOCK_N) x S2_BLOCK_K``. The configs tuned and shipped
    for bf16/fp16 fit as they are; fp32 inputs double the bytes, and some default configs then failed
    to launch (measurements: docs/configs.md#shared-memory-of-the-loops)."""
    def trim(stages, block, loop_bytes):
        while stages > 2 and loop_bytes(stages, block) > shared_memory:
            stages -= 1
        while block > 16 and loop_bytes(stages, block) > shared_memory:
            block //= 2
        return stages, block

    stages, block_k = trim(cfg.num_stages, cfg.BLOCK_K, lambda st, bk: gate_up_loop_shared_bytes(
        replace(cfg, BLOCK_K=bk), st, element_bytes, lora=False))
    block_h, s2_stages, s2_block_k = cfg.BLOCK_H, cfg.s2_num_stages, cfg.S2_BLOCK_K
    if cfg.path == "fused":
        stages, block_h = trim(stages, block_h, lambda st, bh: pipelined_loop_bytes(st, bh * cfg.BLOCK_N,
                                                                                     element_bytes))
    else:
        s2_rows = cfg.BLOCK_M + cfg.S2_BLOCK_N
        s2_stages, s2_block_k = trim(s2_stages, s2_block_k, lambda st, bk: pipelined_loop_bytes(st, s2_rows * bk,
                                                                                                element_bytes))
    return replace(cfg, num_stages=stages, BLOCK_K=block_k, BLOCK_H=block_h, s2_num_stages=s2_stages,
                   S2_BLOCK_K=s2_block_k)


def nearest_batch(batches, M: int):
    """The tuned batch size (an int or its string, as the tuned file's keys) nearest ``M``; the smaller on a tie."""
    return min(batches, key=lambda m: (abs(int(m) - M), int(m)))


# ---------------------------------------------------------------------------------------------
# The resolver: every caller (get_config, the plan build, codegen, the tuner) asks it
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ConfigProblem:
    """What a config depends on in a forward's problem."""

    M: int  # tokens
    E: int  # experts (local)
    H: int  # hidden size
    I: int  # expert intermediate size (the gate and up halves of w1 each have I rows)
    topk: int  # experts per token
    dtype: torch.dtype  # of the activations (and of 16-bit weights); fp8 weights: see ConfigMode.fp8
    # 16-bit w1 read in place with N contiguous (transposed [E, H, 2I] views) and gate/up concatenated: picked
    # configs get slices of at least MIN_WEIGHT_ROW_BYTES per K row (min_slice_columns); a caller's config is kept
    n_contiguous_halves: bool = False


def min_slice_columns(problem: ConfigProblem) -> int:
    """The fewest columns of a slice (BLOCK_N) a 16-bit fit of ``problem`` keeps: ``MIN_WEIGHT_ROW_BYTES`` per K row
    of a gate or up tile where ``problem.n_contiguous_halves``, else the smallest block (16)."""
    return max(16, MIN_WEIGHT_ROW_BYTES // problem.dtype.itemsize) if problem.n_contiguous_halves else 16


@dataclass(frozen=True)
class ConfigMode:
    """The kind of forward a config is for. Plain 16-bit weights: all False. A one-token (decode) forward takes
    the plain config; whether it then runs in one launch is ``launches.decodes_in_one_launch``'s rule."""

    lora: bool = False  # adapters passed (fused_moe(lora=...))
    fp8: bool = False  # fp8 weights, whatever their scale scheme (block, channel, expert): one config serves all
    deterministic: bool = False  # fused_moe(deterministic=True)
    # The weights' format, a name of fmoe2.formats.WEIGHT_FORMATS: weight-only ones (mxfp4, int4, int8) take the
    # 16-bit pick with its weight tiles fitted to dequantizing in registers (fit_packed_config); "fp8" is fp8=True
    weight_format: str = "16bit"

    def __post_init__(self):
        fmt = weight_format(self.weight_format)
        if fmt.quantizes_activations:
            object.__setattr__(self, "fp8", True)
        elif self.fp8 and fmt.name != "16bit":
            raise ValueError(f"ConfigMode(fp8=True) is for fp8 weights, not {fmt.name!r}")

    @property
    def weight_only(self) -> bool:
        return WEIGHT_FORMATS[self.weight_format].weight_only


def resolve_config(problem: ConfigProblem, mode: ConfigMode, target: Target, config: Optional[FusedMoEConfig] = None,
                   *, path: str = "auto", tuned_for: Optional[str] = None, config_dir: str = CONFIG_DIR
                   ) -> FusedMoEConfig:
    """The fitted config (its ``path`` the path taken) of a forward of ``problem`` in ``mode`` on ``target``.

    ``config``: the caller's, fitted like a picked one (the clamps and atomic-add cap of :func:`fit_config`, the
    adapters' steps, fp8's fit), or None to pick one: the tuned file of the GPU named ``tuned_for`` (a folder of
    ``config_dir``, ``device_config_name``; None: no tuned files) by nearest batch size, else the backend's
    default rules (module docstring). ``path``: "auto" (the config's), "fused" or "two_stage".

    * LoRA: the plain pick (or the caller's) through :func:`fit_lora_config_to_problem`.
    * fp8: a tuned ``"fp8"`` entry (stored as it ran) where there is one, else the 16-bit pick with its path by
      :func:`fp8_prefers_two_stage`; then :func:`fit_fp8_config`.
    * deterministic: the two-stage path without K shares: :func:`_deterministic_pick`, or the caller's config as
      given (batch invariance is then the caller's choice); adapters fitted with their deltas in the stages.
    * weight-only formats (``mode.weight_format``: mxfp4, int4, int8): the tuned file's entry of the format
      (stored as it ran, :func:`tuned_section`) where there is one, else any of the above; its weight tiles then
      fitted to dequantizing in registers (:func:`fit_packed_config`, with the target's warp size).
    * ``tma`` off where the target's backend takes no tensor-descriptor weight loads (``tensor_descriptor_weights``
      of ``config_cuda.py`` / ``config_hip.py``: ROCm, CUDA before sm_90 or of unknown architecture), ``pdl`` off
      where the GPU has no programmatic dependent launch (ROCm, CUDA before sm_90).
    """
    config = _resolve(problem, mode, target, config, path, tuned_for, config_dir)
    if mode.weight_only:
        config = fit_packed_config(config, target.warp_size, lora=mode.lora, weight_format=mode.weight_format)
    # (the config says what runs: pointer loads where the target takes no descriptor loads, plain launches where it
    # has no programmatic dependent launch; the interpreter keeps pdl, which it ignores, as callers give it)
    if config.tma and not BACKENDS[target.backend].tensor_descriptor_weights(target):
        config = replace(config, tma=False)
    if config.pdl and not target.interpreter and not target.has_grid_dependency_control:
        config = replace(config, pdl=False)
    return config


def _resolve(problem: ConfigProblem, mode: ConfigMode, target: Target, config: Optional[FusedMoEConfig], path: str,
             tuned_for: Optional[str], config_dir: str) -> FusedMoEConfig:
    """:func:`resolve_config` before a weight-only format's fit."""
    if mode.deterministic:
        if path not in ("auto", "two_stage"):
            raise ValueError(f"deterministic mode runs the two-stage kernels: path must be 'auto' or 'two_stage', "
                             f"got {path!r}")
        if config is None:
            config = _deterministic_pick(problem, mode, target, tuned_for, config_dir)
            if mode.lora:
                config = _fit_lora(config, problem, target, in_stages=True)
        else:
            config = _fit_given(replace(config, S2_SPLIT_K=1), problem, mode, target, "two_stage", mode.fp8)
        return fit_fp8_config(config, problem.dtype.itemsize, target.shared_memory) if mode.fp8 else config
    picked = config is None
    if picked and (mode.fp8 or mode.weight_only):
        tuned = tuned_config(problem, tuned_for, config_dir, (tuned_section(mode),))
        if tuned is not None:  # measured with weights of this format: its path too, unless the caller forces one
            config, picked = tuned, False
    if config is None:
        config = _plain_pick(problem, target, path, tuned_for, config_dir)
        if mode.lora:
            config = _fit_lora(config, problem, target)
    elif not mode.fp8:
        config = _fit_given(config, problem, mode, target, path)
    if not mode.fp8:
        return config
    grid = (problem.M, problem.E, problem.I, problem.topk, target.num_sms)

    def fp8_fit(cfg, fit_path):
        # The 16-bit fit's clamps only, then fp8's fit: a config that ran, stored by the tuner or passed back by a
        # caller, must run again as it did. (The 16-bit fit's widening and shared-memory fit, in 16-bit bytes,
        # changed 142 of the 998 configs the tuner tries at the four fp8 benchmark shapes on a second fit.)
        return fit_fp8_config(_fit_given(cfg, problem, mode, target, fit_path, fp8_weights=True),
                              problem.dtype.itemsize, target.shared_memory, grid)

    if not (picked and path == "auto"):
        return fp8_fit(config, path)
    # The path by fp8's own rule: the fused fit's grid decides it, the 16-bit pick's path does not.
    fused = fp8_fit(config, "fused")
    return fp8_fit(config, "two_stage") if fp8_prefers_two_stage(fused, *grid) else fused


def _fit_given(config: FusedMoEConfig, problem: ConfigProblem, mode: ConfigMode, target: Target, path: str,
               fp8_weights: bool = False) -> FusedMoEConfig:
    """A caller's (or a tuned fp8) config fitted like a picked one: :func:`fit_config` (``fp8_weights``: its clamps
    only) on ``target``, then with adapters :func:`fit_lora_config_to_problem`."""
    config = fit_config(config, problem.H, problem.I, problem.topk, problem.dtype, path, backend=target.backend,
                        shared_memory=target.shared_memory, fp8_weights=fp8_weights)
    return _fit_lora(config, problem, target, in_stages=True if mode.deterministic else None) if mode.lora else config


def _fit_lora(config: FusedMoEConfig, problem: ConfigProblem, target: Target,
              in_stages: Optional[bool] = None) -> FusedMoEConfig:
    """:func:`fit_lora_config_to_problem` of ``problem`` on ``target``."""
    return fit_lora_config_to_problem(config, problem.M, problem.E, problem.H, problem.I, problem.topk, problem.dtype,
                                      target.num_sms, target.backend, target.shared_memory, in_stages=in_stages)


def _defaults(config_dir: str) -> dict:
    """``defaults.json`` of ``config_dir``, else fmoe2's own."""
    return _load_json(os.path.join(config_dir, "defaults.json")) or _load_json(os.path.join(CONFIG_DIR, "defaults.json"))


# The sections of a tuned file besides its plain batch sizes, each keyed by batch size (python -m fmoe2.tune writes
# them, :func:`resolve_config` reads them): deterministic mode's, fp8 weights', each weight-only format's.
TUNED_SECTIONS = ("deterministic", "fp8", *WEIGHT_ONLY_FORMATS)


def tuned_section(mode: ConfigMode) -> Optional[str]:
    """The section of a tuned file that ``python -m fmoe2.tune`` writes for, and :func:`resolve_config` reads
    first in, a forward of ``mode``: ``"fp8"`` for fp8 weights, the format's name for weight-only ones (``"mxfp4"``,
    ``"int4"``, ``"int8"``; the activations 16-bit, the file the activations' dtype's), None for 16-bit weights (the
    file's plain batch sizes). Deterministic mode has its own section (:func:`_deterministic_pick`)."""
    if mode.fp8:
        return "fp8"
    return mode.weight_format if mode.weight_only else None


def tuned_config(problem: ConfigProblem, tuned_for: Optional[str], config_dir: str = CONFIG_DIR,
                 sections: tuple = (None,)) -> Optional[FusedMoEConfig]:
    """The entry nearest ``problem.M`` (:func:`nearest_batch`) of the tuned file of ``problem``'s shape in the
    folder ``tuned_for`` of ``config_dir``, as stored (not fitted); None without one. ``sections``: where to
    look, in order, a later one's batch size replacing an earlier one's: None for the file's plain batch sizes,
    ``"deterministic"``, ``"fp8"`` or a weight-only format's name for the entries ``python -m fmoe2.tune`` writes
    for those modes (:func:`tuned_section`)."""
    if tuned_for is None:
        return None
    tuned_file = _load_json(os.path.join(config_dir, tuned_for, shape_file_name(problem.E, problem.H, problem.I,
                                                                                problem.topk, problem.dtype))) or {}
    entries = {}
    for section in sections:
        items = ((m, c) for m, c in tuned_file.items() if m.isdigit()) if section is None else \
            tuned_file.get(section, {}).items()
        entries.update((int(m), c) for m, c in items)
    if not entries:
        return None
    return FusedMoEConfig.from_dict(entries[nearest_batch(entries, problem.M)])


def _plain_pick(problem: ConfigProblem, target: Target, path: str, tuned_for: Optional[str],
                config_dir: str) -> FusedMoEConfig:
    """The 16-bit pick: the tuned file's nearest batch size, else the first default rule with
    ``M*topk/E <= max_tokens_per_expert`` (the last one beyond them all); fitted (:func:`fit_config`)."""
    cfg = tuned_config(problem, tuned_for, config_dir)
    if cfg is None:
        rules = BACKENDS[target.backend].default_rules(_defaults(config_dir), target)
        tokens_per_expert = problem.M * problem.topk / problem.E
        rule = next((r for r in rules if tokens_per_expert <= r["max_tokens_per_expert"]), rules[-1])
        cfg = FusedMoEConfig.from_dict(rule)
        if path == "auto" and cfg.path == "fused" and _fused_grid_too_small(rule, cfg, problem, target):
            path = "two_stage"
    return fit_config(cfg, problem.H, problem.I, problem.topk, problem.dtype, path, target.backend,
                      min_slice_columns(problem), shared_memory=target.shared_memory)


def _fused_grid_too_small(rule: dict, cfg: FusedMoEConfig, problem: ConfigProblem, target: Target) -> bool:
    """Whether a default rule's fused tiling, fitted, would run fewer programs than its
    ``min_fused_programs_per_sm`` times the multiprocessors (the most tiles any routing fills, ``max_busy_tiles``,
    times the I slices): then the two-stage path, whose stage 2 spreads the down GEMM over H, is taken. Measured
    on the H100 at M=1 (misc/bench/defaults): Qwen3-235B-A22B's TP8 slice (I=192, 24 fused programs) 25.8 us
    two-stage against 36.8 fused, DeepSeek-V3's TP8 slice (I=256, 32) 46.6 against 59.5, the TP4 slice (I=384, 48)
    37.6 against 41.2; the TP2 slice (I=768, 96 programs) 59.4 fused against 60.9."""
    per_sm = rule.get("min_fused_programs_per_sm")
    if per_sm is None:
        return False
    fused = fit_config(cfg, problem.H, problem.I, problem.topk, problem.dtype, "fused", target.backend,
                       min_slice_columns(problem), shared_memory=target.shared_memory)
    return fused_grid_programs(fused, problem.M, problem.E, problem.I, problem.topk) < per_sm * target.num_sms


def _deterministic_pick(problem: ConfigProblem, mode: ConfigMode, target: Target, tuned_for: Optional[str],
                        config_dir: str) -> FusedMoEConfig:
    """The config of deterministic mode: always the two-stage path with ``S2_SPLIT_K=1`` (no K shares to add),
    and a tiling under which a token's row has the same bits whatever M is (batch invariance).

    The tiling decides the order of a row's additions only through what it hands the matrix instructions: the K
    loop chains them in K order whatever the tile sizes. Where the backend's rules say a row's bits do not depend
    on the tiling (``deterministic_takes_the_pick``: CUDA sm_90 with bf16 weights and no adapters or fp8 weights,
    measured: docs/numerics.md#deterministic-mode) the tuned config of the nearest batch size, one tuned for
    deterministic mode (a tuned file's ``"deterministic"`` entry, ``python -m fmoe2.tune --deterministic``)
    else the file's plain one, on the two-stage path; without a tuned file the two-stage pick of the default
    rules. Everywhere else one config for every M: the backend's entry in the ``"deterministic"`` section of
    ``defaults.json`` (a ``config_dir`` whose file has none: fmoe2's own)."""
    backend = BACKENDS[target.backend]
    rules = (_load_json(os.path.join(config_dir, "defaults.json")) or {}).get("deterministic") or \
        _load_json(os.path.join(CONFIG_DIR, "defaults.json"))["deterministic"]
    if backend.deterministic_takes_the_pick(rules, target, problem.dtype, mode.lora, mode.fp8):
        nearest = tuned_config(problem, tuned_for, config_dir, (None, "deterministic"))
        if nearest is not None:
            cfg = fit_config(replace(nearest, path="two_stage"), problem.H, problem.I, problem.topk, problem.dtype,
                             "two_stage", target.backend, min_slice_columns(problem),
                             shared_memory=target.shared_memory)
        else:
            cfg = _plain_pick(problem, target, "two_stage", None, config_dir)
        return replace(cfg, S2_SPLIT_K=1)
    cfg = replace(FusedMoEConfig.from_dict(backend.deterministic_entry(rules, target)), path="two_stage", S2_SPLIT_K=1)
    return fit_config(cfg, problem.H, problem.I, problem.topk, problem.dtype, "two_stage", target.backend,
                      min_slice_columns(problem), shared_memory=target.shared_memory)


def get_config(
    M: int,
    E: int,
    H: int,
    I: int,
    topk: int,
    dtype: torch.dtype,
    *,
    device: Optional[torch.device] = None,
    backend: Optional[str] = None,
    arch: Optional[str] = None,
    path: str = "auto",
    config_dir: str = CONFIG_DIR,
    tuned: bool = True,
    lora: bool = False,
    deterministic: bool = False,
    fp8: bool = False,
    cuda_arch: Optional[int] = None,
    tuned_for: Optional[str] = None,
    weight_format: str = "16bit",
    n_contiguous_halves: bool = False,
) -> FusedMoEConfig:
    """The config ``fused_moe`` runs for one problem (:func:`resolve_config`; the module docstring).

    ``dtype``: of the activations. ``device``: the GPU (default the current one). ``backend`` ("cuda"/"hip") and
    ``arch`` (e.g. "gfx950") name a GPU that is not there: its default rules with
    ``DEFAULT_SHARED_MEMORY`` and no tuned files (better: :func:`resolve_config` with a
    :data:`fmoe2.target.NAMED_TARGETS` entry, as ``fmoe2.codegen`` does). ``path`` ("fused" or "two_stage")
    forces a path; the picked tiling is then refitted to it. ``tuned=False`` skips tuned files: the shipped
    defaults, as on a GPU without a tuned file for the shape. ``lora=True``: with adapters. ``fp8=True``: with fp8
    weights (any scale scheme). ``weight_format``: the weights' format (``fmoe2.formats.WEIGHT_FORMATS``; e.g.
    ``"int8"``, or ``PreparedMoEWeights.weight_format``). ``deterministic=True``: deterministic mode (``cuda_arch``,
    e.g. 90, for a CUDA GPU that is not there). ``tuned_for``: the name of a GPU (``device_config_name``, e.g. ``"NVIDIA_H200"``) whose
    tuned files to read, also when ``backend``/``arch`` name a GPU that is not here (not in deterministic mode).
    ``n_contiguous_halves``: 16-bit ``w1`` passed as transposed ``[E, H, 2I]`` views with gate and up rows
    concatenated (N contiguous), as some transformers experts store them: the forward picks slices of at least
    ``MIN_WEIGHT_ROW_BYTES`` per K row there.
    """
    here = target_of(device)
    foreign = (backend is not None and backend != current_backend()) or arch is not None
    if foreign:
        backend = backend or current_backend()
        target = Target(backend, arch if arch is not None else cuda_arch if backend == "cuda" else None,
                        here.num_sms, DEFAULT_SHARED_MEMORY)
    else:
        target = replace(here, arch=cuda_arch) if cuda_arch is not None and here.backend == "cuda" else here
    # Tuned files belong to the GPU that is here (or the one named by tuned_for).
    folder = None if foreign or not tuned else device_config_name(device)
    if tuned and tuned_for is not None and not deterministic:
        folder = tuned_for
    return resolve_config(ConfigProblem(M, E, H, I, topk, dtype, n_contiguous_halves),
                          ConfigMode(lora, fp8, deterministic, weight_format), target, path=path, tuned_for=folder,
                          config_dir=config_dir)
