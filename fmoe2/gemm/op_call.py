"""What :func:`fmoe2.fused_moe` runs while ``torch.compile`` traces it: its arguments packed into the schema of
``torch.ops.fmoe2.fused_moe``.

The op is defined and implemented in ``fmoe2/ops.py`` (a floor above, since its implementation calls
``fused_moe``); this half sits beside ``fused_moe`` so that the eager function reaches the op through the
dispatcher (``torch.ops.fmoe2``, registered when ``fmoe2`` is imported) and never imports upward
(``tests/test_layers.py``). The schema and the packing both come from the call's description
(``fmoe2/gemm/call.py``).
"""
from __future__ import annotations

import torch

from .call import op_values


def fused_moe_op_call(values: dict) -> torch.Tensor:
    """One call's arguments (``{keyword: value}``, ``deterministic`` resolved already) passed to
    ``torch.ops.fmoe2.fused_moe`` (what ``fmoe2.fused_moe`` runs while ``torch.compile`` traces it); ``out`` is then
    filled by a copy."""
    result = torch.ops.fmoe2.fused_moe(*op_values(values))
    out = values["out"]
    if out is None:
        return result
    out.copy_(result)
    return out
