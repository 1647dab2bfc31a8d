"""The gated activations fmoe2 knows: one table, name -> what the activation reads (floor 0, see
``tests/test_layers.py``: the host checks, the launches, the ops and the references all read it here).

The kernels compute each activation with its own ``@triton.jit`` function (``fmoe2/gemm/activations.py``, whose
dispatch has no fall-through: an unknown name fails the compile); a name missing from :data:`ACTIVATION_TABLE` is
refused on the host before any launch (``check_activation_args`` in ``fmoe2/gemm/fused_moe.py``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Tuple

SWIGLU_ALPHA = 1.702  # gpt-oss's default (GptOssConfig.swiglu_alpha)


@dataclass(frozen=True)
class Activation:
    """What a gated activation ``f(gate, up)`` (both float32 ``[rows, I]``) reads besides gate and up.

    Attributes:
        name: the ``activation=`` string of :func:`fmoe2.fused_moe`.
        reads_alpha: reads ``swiglu_alpha`` (float); elsewhere the kernels get :data:`SWIGLU_ALPHA`, so the alpha
            does not split the compiled kernels of activations that ignore it.
        takes_limit: accepts ``swiglu_limit`` (float or None), the clamp of gate and up before the activation.
        formula: the function, as the references compute it (``fmoe2.reference.gated_activation``).
    """

    name: str
    reads_alpha: bool
    takes_limit: bool
    formula: str


ACTIVATION_TABLE: Dict[str, Activation] = {a.name: a for a in (
    Activation("silu", reads_alpha=False, takes_limit=True, formula="silu(gate) * up (SwiGLU)"),
    Activation("gelu", reads_alpha=False, takes_limit=False, formula="gelu(gate) * up (erf GeGLU)"),
    Activation("gelu_tanh", reads_alpha=False, takes_limit=False, formula="gelu_tanh(gate) * up (tanh GeGLU)"),
    Activation("swiglu_oai", reads_alpha=True, takes_limit=True,
               formula="(up + 1) * gate * sigmoid(swiglu_alpha * gate) (gpt-oss)"),
)}
ACTIVATIONS: Tuple[str, ...] = tuple(ACTIVATION_TABLE)  # the names, in the table's order

