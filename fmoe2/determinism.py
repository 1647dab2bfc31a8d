"""The global switch of deterministic mode (``fused_moe(..., deterministic=None)`` reads it).

Deterministic mode gives the same bits on every call and a token's output row whatever the batch
around it (docs/numerics.md#deterministic-mode). Code that calls :func:`fmoe2.fused_moe` without
the argument (the transformers experts backend, a model under ``torch.compile``, where the switch is
read when the call is traced into ``torch.ops.fmoe2.fused_moe``) follows this switch, as it follows
``torch.use_deterministic_algorithms(True)``. The op itself takes the resolved flag
(``deterministic=False`` unless passed).
"""
from __future__ import annotations

import torch

_enabled = False


def set_deterministic(enabled: bool = True) -> None:
    """Turns deterministic mode on (or off) for every ``fused_moe`` call that does not pass
    ``deterministic``. Calls traced by ``torch.compile`` keep the mode they were traced with."""
    global _enabled
    if not isinstance(enabled, bool):
        raise TypeError(f"enabled must be a bool, got {type(enabled).__name__}")
    _enabled = enabled


def deterministic_enabled() -> bool:
    """Whether ``fused_moe`` calls without ``deterministic`` run deterministic mode: after
    :func:`set_deterministic` (True), or while ``torch.use_deterministic_algorithms(True)`` is on."""
    return _enabled or torch.are_deterministic_algorithms_enabled()
