"""The config rules of CUDA GPUs (``fmoe2/gemm/config.py`` asks them through :data:`~fmoe2.gemm.config.BACKENDS`).

The rules are data where they can be: the default tilings are ``configs/defaults.json``'s ``"cuda"`` list and
its ``"deterministic"`` section; this file says which entries a CUDA :class:`~fmoe2.target.Target` reads and the
budgets of widened configs (``fit_config``).
"""
from __future__ import annotations

import torch

from ..target import Target

# Weight-tile elements in flight (num_stages x tile) once widened: 3 x 64 KB stages fit sm_80's 164 KB of shared
# memory (and Hopper's 227 KB).
PIPELINE_ELEMENTS = 3 * 32768
MIN_WIDENED_STAGES = 3
LAUNCH_OPTIONS = ()  # FusedMoEConfig fields passed to a launch besides warps and stages


def tensor_descriptor_weights(target: Target) -> bool:
    """Whether a config's ``tma`` may load weight tiles through tensor descriptors (``launches.tma_enabled``): on sm_90
    and newer, where Triton lowers them to the bulk tensor copy engine (UTMALDG), and under the interpreter (the CPU
    tests compare both loads). Not before sm_90: there Triton lowers a descriptor load to pointer-load code whose
    two-stage K loops compiled to 5-7x the instructions of plain pointer loads under Triton 3.6 and 2.7-3.3x under
    3.9, with spills at 128 x 128 tiles (sm_80; Qwen3-30B-A3B M=16 and 1024, Mixtral-8x7B M=4096; 2026-11-29). A CUDA
    target of unknown architecture (``arch`` None outside the interpreter) takes pointer loads too."""
    return target.interpreter or (target.cuda_arch is not None and target.cuda_arch >= 90)


def default_rules(defaults: dict, target: Target) -> list:
    """The default rules (``defaults.json``, a list ordered by ``max_tokens_per_expert``) of ``target``."""
    return defaults["cuda"]


def deterministic_entry(rules: dict, target: Target) -> dict:
    """Deterministic mode's one tiling for every M (``defaults.json``'s ``"deterministic"`` section)."""
    return rules["cuda"]


def deterministic_takes_the_pick(rules: dict, target: Target, dtype: torch.dtype, lora: bool, fp8: bool) -> bool:
    """Whether deterministic mode may take the batch size's two-stage pick: on the GPUs of
    ``tiling_free_cuda_archs``, where a row's bits were measured not to depend on the tiling, with bf16 weights
    (the dtype measured), no adapters and no fp8 weights (docs/numerics.md#deterministic-mode)."""
    return target.cuda_arch in rules["tiling_free_cuda_archs"] and dtype == torch.bfloat16 and not lora and not fp8
