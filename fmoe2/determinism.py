"""The global switch of deterministic mode (``fused_moe(..., deterministic=None)`` reads it).

Deterministic mode gives the same bits on every call and a token's output row whatever the batch
around it (docs/numerics.md#deterministic-mode). Code that calls :func:`fmoe2.fused_moe` without
the argument (the transformers experts backend, a model under ``torch.compile``, where the switch is
read when the call is traced into ``torch.ops.fmoe2.fused_moe``) follows this switch, as it follows
``torch.use_deterministic_algorithms(True)``. The op itself takes the resolved flag
(``deterministic=False`` unless passed).
"""
from __future__ import annotations

import warnings

import torch

_enabled = False


def set_deterministic(enabled: bool = True) -> None:
    """Turns deterministic mode on (or off) for every ``fused_moe`` call that does not pass
    ``deterministic``. ``torch.compile`` reads the switch while tracing and guards on it: switching
    it recompiles."""
    global _enabled
    if not isinstance(enabled, bool):
        raise TypeError(f"enabled must be a bool, got {type(enabled).__name__}")
    _enabled = enabled


def fused_path_under_the_switch() -> bool:
    """Whether a call with ``path="fused"`` and no ``deterministic`` argument runs deterministic mode while
    the global switch is on: it cannot (the fused kernel adds with atomics, in no fixed order), so a
    ``ValueError``; under ``torch.use_deterministic_algorithms(True, warn_only=True)`` alone, a warning
    and the fused path (False), as torch's own ops without a deterministic form do."""
    if not _enabled and torch.is_deterministic_algorithms_warn_only_enabled():
        warnings.warn("fmoe2.fused_moe(path='fused') adds its partial sums with atomics in no fixed order: not "
                      "deterministic (torch.use_deterministic_algorithms(True, warn_only=True))", stacklevel=3)
        return False
    raise ValueError("deterministic mode is on (fmoe2.set_deterministic(True) or "
                     "torch.use_deterministic_algorithms(True)) but path='fused' adds its partial sums with atomics, "
                     "in no fixed order: pass path='auto' or 'two_stage', or deterministic=False")


def deterministic_enabled() -> bool:
    """Whether ``fused_moe`` calls without ``deterministic`` run deterministic mode: after
    :func:`set_deterministic` (True), or while ``torch.use_deterministic_algorithms(True)`` is on (also with
    ``warn_only=True``: like torch's ops, fmoe2 then takes its deterministic form where it has one)."""
    return _enabled or torch.are_deterministic_algorithms_enabled()
