"""The config rules of ROCm GPUs (``fmoe2/gemm/config.py`` asks them through :data:`~fmoe2.gemm.config.BACKENDS`).

The default tilings are ``configs/defaults.json``'s ``"hip"`` list (and an architecture's own list where one
differs, ``"gfx950"``) and its ``"deterministic"`` section; this file says which entries a ROCm
:class:`~fmoe2.target.Target` reads, the budgets of widened configs and the ROCm-only launch options.
"""
from __future__ import annotations

import torch

from ..target import Target

# Weight-tile elements in flight once widened: 2 x 32 KB fit the 64 KiB LDS of gfx942.
PIPELINE_ELEMENTS = 2 * 16384
MIN_WIDENED_STAGES = 2
LAUNCH_OPTIONS = ("waves_per_eu", "matrix_instr_nonkdim", "kpack")  # passed to ROCm launches only


def tensor_descriptor_weights(target: Target) -> bool:
    """Whether a config's ``tma`` may load weight tiles through tensor descriptors (``launches.tma_enabled``): never
    on ROCm, where a descriptor load compiled to 2-byte loads for gfx942."""
    return False


def _arch(target: Target) -> str:
    return target.arch if isinstance(target.arch, str) else ""


def default_rules(defaults: dict, target: Target) -> list:
    """The default rules of ``target``: its architecture's own list where ``defaults.json`` has one, else
    ``"hip"``'s."""
    return defaults.get(_arch(target)) or defaults["hip"]


def deterministic_entry(rules: dict, target: Target) -> dict:
    """Deterministic mode's one tiling for every M: the architecture's entry, else ``"hip"``'s."""
    return rules.get(_arch(target)) or rules["hip"]


def deterministic_takes_the_pick(rules: dict, target: Target, dtype: torch.dtype, lora: bool, fp8: bool) -> bool:
    """Never: no ROCm GPU was measured to give a row the same bits whatever the tiling."""
    return False
