"""The gated activations of the GEMM kernels: one ``@triton.jit`` function per name, and the dispatch by name.

Each takes the fp32 gate and up accumulators of a tile and returns ``act(gate) * up`` (the same math as
:func:`fmoe2.reference.gated_activation`). A new activation is a function here, an entry in
:data:`KERNEL_ACTIVATIONS` and a branch of :func:`_gated_activation`, plus its reference. The dispatch has no
fall-through branch: a name without a function fails the compile (and the host refuses it before any launch,
``check_activation_args``).
"""
import triton
import triton.language as tl

from ..activations import ACTIVATIONS


@triton.jit
def _silu_glu(gate, up, alpha):
    return gate * tl.sigmoid(gate) * up


@triton.jit
def _gelu_glu(gate, up, alpha):
    return 0.5 * gate * (1.0 + tl.erf(gate * 0.7071067811865476)) * up


@triton.jit
def _gelu_tanh_glu(gate, up, alpha):
    # tanh(z) = 2*sigmoid(2z) - 1: portable (no libdevice) and overflow-safe.
    z = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)
    return gate * tl.sigmoid(2.0 * z) * up


@triton.jit
def _swiglu_oai(gate, up, alpha):
    """gpt-oss's: ``(up + 1) * gate * sigmoid(alpha * gate)``."""
    return (up + 1.0) * gate * tl.sigmoid(alpha * gate)


KERNEL_ACTIVATIONS = {"silu": _silu_glu, "gelu": _gelu_glu, "gelu_tanh": _gelu_tanh_glu, "swiglu_oai": _swiglu_oai}
assert tuple(KERNEL_ACTIVATIONS) == ACTIVATIONS, "every activation the host accepts has its kernel function"


@triton.jit
def _gated_activation(gate, up, ACTIVATION: tl.constexpr, SWIGLU_ALPHA: tl.constexpr = 1.702,
                      SWIGLU_LIMIT: tl.constexpr = None):
    """``ACTIVATION``'s function of gate and up (fp32 [BLOCK_M, BLOCK_N]). With SWIGLU_LIMIT (silu and
    swiglu_oai) gate is first clamped to at most the limit and up to [-limit, limit]."""
    if SWIGLU_LIMIT is not None:
        gate = tl.minimum(gate, SWIGLU_LIMIT)
        up = tl.minimum(tl.maximum(up, -SWIGLU_LIMIT), SWIGLU_LIMIT)
    if ACTIVATION == "silu":
        y = _silu_glu(gate, up, SWIGLU_ALPHA)
    elif ACTIVATION == "gelu":
        y = _gelu_glu(gate, up, SWIGLU_ALPHA)
    elif ACTIVATION == "gelu_tanh":
        y = _gelu_tanh_glu(gate, up, SWIGLU_ALPHA)
    elif ACTIVATION == "swiglu_oai":
        y = _swiglu_oai(gate, up, SWIGLU_ALPHA)
    else:
        tl.static_assert(False, "unknown ACTIVATION: add its function to fmoe2/gemm/activations.py")
    return y


@triton.jit
def _activate(gate, up, route_weight, dtype: tl.constexpr, ACTIVATION: tl.constexpr, SWIGLU_ALPHA: tl.constexpr,
              SWIGLU_LIMIT: tl.constexpr):
    """The tile's intermediate ``act(gate, up) * route_weight`` in ``dtype`` (the down GEMM is linear in it, so
    the routing weight is applied once here)."""
    y = _gated_activation(gate, up, ACTIVATION, SWIGLU_ALPHA, SWIGLU_LIMIT) * route_weight[:, None]
    return y.to(dtype)
