"""The grid of problems whose picked configs are pinned in ``tests/gemm/data/config_table.json``.

Each row is ``(target, shape, mode, path, given)``, each value a list with one entry per batch size of
:data:`BATCHES`: ``"<index into configs><path run><flags>"``. The path run is ``D`` where an eager call runs
the one-launch decode, else the config's path, ``F`` fused or ``T`` two-stage; flags (``launches.py``'s rules,
kept for the record): ``a`` float32 accumulator, ``c`` the fused kernel casts it, ``d`` adapter deltas in the two
stages, ``q`` stage 1 stores y in fp8. ``record_config_table.py`` writes the file; ``test_config_table.py`` checks it.

Problems are built on meta tensors (as ``fmoe2.codegen`` does), so GPUs that are not here can be named:
:data:`TARGETS` maps a name to its :class:`~fmoe2.target.Target` and the tuned-file folder it reads (None: no
tuned files, as on a GPU without any).
"""
from __future__ import annotations

from typing import Dict, Iterator, Optional, Tuple

import torch

from fmoe2.codegen import _meta_lora
from fmoe2.gemm.config import FusedMoEConfig
from fmoe2.gemm.launches import (MoEProblem, accumulates_fp32, decodes_in_one_launch, deltas_in_stages,
                                 fused_kernel_casts, stage1_stores_fp8)
from fmoe2.shapes import ALL_SHAPES, SHAPES
from fmoe2.target import INTERPRETER_TARGET, NAMED_TARGETS, Target

BATCHES = (1, 2, 3, 16, 128, 1024, 4096, 65536)
# E not a power of two, H and I not multiples of 16.
ODD_SHAPES = {"odd-6x1000x520": (6, 1000, 520, 2), "odd-3x200x100": (3, 200, 100, 1),
              "odd-160x5120x1544": (160, 5120, 1544, 6)}
GRID_SHAPES = {**ALL_SHAPES, **ODD_SHAPES}
# name -> (target, tuned-file folder or None)
TARGETS: Dict[str, Tuple[Target, Optional[str]]] = {
    "H100": (NAMED_TARGETS["sm_90"], "NVIDIA_H100_80GB_HBM3"),
    "H200": (NAMED_TARGETS["sm_90"], "NVIDIA_H200"),
    "sm_80": (NAMED_TARGETS["sm_80"], None),
    "gfx942": (NAMED_TARGETS["gfx942"], None),
    "interpreter": (INTERPRETER_TARGET, None),
}
# mode -> (dtype, lora, fp8, deterministic, gpt-oss style: biases, interleaved gate/up, swiglu_oai)
MODES = {
    "bf16": (torch.bfloat16, False, False, False, False),
    "fp16": (torch.float16, False, False, False, False),
    "lora": (torch.bfloat16, True, False, False, False),
    "fp8": (torch.bfloat16, False, True, False, False),
    "det": (torch.bfloat16, False, False, True, False),
    "det-lora": (torch.bfloat16, True, False, True, False),
    "det-fp8": (torch.bfloat16, False, True, True, False),
    "det-fp16": (torch.float16, False, False, True, False),
    "gpt-oss": (torch.bfloat16, False, False, False, True),
}
# Configs a caller passes (fused_moe(config=...)).
GIVEN = {
    "none": None,
    "fused64": FusedMoEConfig(BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, BLOCK_H=128, GROUP_M=8, num_warps=4, num_stages=3),
    "two16": FusedMoEConfig(BLOCK_M=16, BLOCK_N=32, BLOCK_K=128, BLOCK_H=64, num_warps=4, num_stages=4,
                            path="two_stage", S2_BLOCK_N=64, S2_BLOCK_K=128, S2_SPLIT_K=4),
}
GIVEN_SHAPES = ("qwen3-30b-a3b", "mixtral-8x7b", "odd-6x1000x520")


def rows() -> Iterator[Tuple[str, str, str, str, str]]:
    """Every ``(target, shape, mode, path, given)`` of the grid."""
    for target in TARGETS:
        for shape in GRID_SHAPES:
            for mode, (_, _, _, deterministic, _) in MODES.items():
                paths = ("auto", "two_stage") if deterministic else ("auto", "fused", "two_stage")
                for path in paths:
                    for given in GIVEN:
                        if given != "none" and shape not in GIVEN_SHAPES:
                            continue
                        if path != "auto" and given == "none" and shape not in SHAPES and shape not in ODD_SHAPES:
                            continue
                        yield target, shape, mode, path, given


def meta_problem(shape: str, mode: str, M: int, target: Target) -> MoEProblem:
    """The checked problem of a forward of ``shape`` in ``mode`` at batch size ``M``, on meta tensors."""
    E, H, inter, topk = GRID_SHAPES[shape]
    dtype, lora, fp8, deterministic, gpt_oss = MODES[mode]
    meta = dict(device="meta")
    weight_dtype = dtype
    if fp8:
        weight_dtype = torch.float8_e4m3fnuz if target.arch == "gfx942" else torch.float8_e4m3fn
    x = torch.empty(M, H, dtype=dtype, **meta)
    w1 = torch.empty(E, 2 * inter, H, dtype=weight_dtype, **meta)
    w2 = torch.empty(E, H, inter, dtype=weight_dtype, **meta)
    problem = MoEProblem(x, w1, w2, gpt_oss, E, H, inter, topk, deterministic=deterministic)
    if lora:
        problem.lora = _meta_lora(4, E, H, inter, 16, dtype)
        problem.token_lora_ids = torch.empty(M, dtype=torch.int32, **meta)
    if fp8:
        problem.w1_scale = torch.empty(E, -(-2 * inter // 128), -(-H // 128), dtype=torch.float32, **meta)
        problem.w2_scale = torch.empty(E, -(-H // 128), -(-inter // 128), dtype=torch.float32, **meta)
        problem.scale_block = (128, 128)
    if gpt_oss:
        problem.w1_bias = torch.empty(E, 2 * inter, dtype=dtype, **meta)
        problem.w2_bias = torch.empty(E, H, dtype=dtype, **meta)
        problem.swiglu_limit = 7.0
    return problem


def outcome(problem: MoEProblem, config: FusedMoEConfig) -> Tuple[dict, str]:
    """``(config dict, "<path run><flags>")`` of a forward of ``problem`` on the fitted ``config``."""
    path = "D" if decodes_in_one_launch(problem, config) else {"fused": "F", "two_stage": "T"}[config.path]
    flags = "".join(flag for flag, rule in (("a", accumulates_fp32), ("c", fused_kernel_casts),
                                            ("d", deltas_in_stages), ("q", stage1_stores_fp8))
                    if rule(problem, config))
    return config.to_dict(), path + flags


__all__ = ["BATCHES", "GRID_SHAPES", "TARGETS", "MODES", "GIVEN", "rows", "meta_problem", "outcome"]
