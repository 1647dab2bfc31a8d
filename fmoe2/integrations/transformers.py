"""fmoe2 as a Hugging Face transformers experts backend (transformers >= 5.7).

    import fmoe2.integrations.transformers  # registers "fmoe2"
    model = AutoModelForCausalLM.from_pretrained(name, experts_implementation="fmoe2")

transformers runs every MoE family's experts (``@use_experts_implementation``) through a backend
``fn(experts_module, hidden_states [T, H], top_k_index [T, k] int64, top_k_weights [T, k]) -> [T, H]``.
This one calls :func:`fmoe2.fused_moe` on the module's own parameters, read in place: no copy of the
expert weights, whatever their layout (``[E, 2I, H]`` / ``[E, H, I]``, or transposed ``[E, H, 2I]``
/ ``[E, I, H]`` as gpt-oss and aria store them; gate and up concatenated or interleaved), with their
biases; routing ids (int64) and weights (fp32 or the model dtype) go to the sort as they come.

What each experts module computes is read from the module, not from config strings: its
``_apply_gate`` (transformers' default ``act_fn(gate) * up``, or an override such as gpt-oss's
clamped SwiGLU) and the type of its ``act_fn``. The first eager call checks that reading
numerically: the module's own ``_apply_gate`` on random values must equal fmoe2's activation. A
module fmoe2 cannot compute exactly runs transformers' ``grouped_mm`` backend instead, with one
warning naming the reason: never a wrong result. Under expert parallelism (transformers 5.18+) ids
of other ranks' experts arrive as ids >= the local expert count with weight 0; fmoe2's sort drops
them at no cost.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

try:
    from transformers import activations as _activations
    from transformers.integrations import moe as _moe
except ImportError as error:  # pragma: no cover - depends on the installed transformers
    raise ImportError("fmoe2's transformers backend needs transformers >= 5.7 (its experts backends registry, "
                      "transformers.integrations.moe.ExpertsInterface): pip install 'fmoe2[transformers]'") from error

from .._validation import BF16_UNDER_THE_INTERPRETER, interpreter_computes_wrong, interpreter_enabled
from ..fp8 import FP8_DTYPES, FP8_GROUP
from ..gemm.fused_moe import fused_moe
from ..launch import tracing
from ..activations import SWIGLU_ALPHA
from ..reference import gated_activation
from ..target import target_of

BACKEND_NAME = "fmoe2"
# _apply_gate overrides fmoe2 computes, by the qualified name of the method, with the module attributes
# (then config fields) that hold their parameters. Each is checked against the module's own method on
# the first eager call.
OAI_SWIGLU_GATES = ("GptOssExperts._apply_gate", "OpenAIPrivacyFilterExperts._apply_gate",
                    "MiniMaxM3VLExperts._apply_gate")
CLAMPED_SILU_GATES = ("HYV4Experts._apply_gate", "HYV4VLExperts._apply_gate", "Glm5NextTextExperts._apply_gate",
                      "DeepseekV4Experts._apply_gate")
PROBE_ROWS, PROBE_COLUMNS, PROBE_SCALE = 8, 16, 12.0  # the check's random gate/up values (beyond the clamps)
# Where fmoe2.integrations.peft puts an experts module's adapters (an object whose call_arguments(num_tokens)
# gives fused_moe's lora/token_lora_ids for the selected adapters, or {}).
ADAPTERS_ATTRIBUTE = "fmoe2_adapters"
# Where a loader that keeps an experts module's weights in a format of fmoe2's own puts them (a PreparedMoEWeights in
# the instance dict, e.g. fmoe2.integrations.gpt_oss_mxfp4); the module then holds no gate_up_proj/down_proj.
PREPARED_ATTRIBUTE = "fmoe2_prepared"
# Its tensors are also the module's buffers (so that module.to() moves them): "fmoe2_w13", ... of these fields.
PREPARED_BUFFER_PREFIX = "fmoe2_"
PREPARED_FIELDS = ("w13", "w2", "b13", "b2", "s13", "s2")
REGISTERED_NAMES = set()  # the experts_implementation names that run this backend (register())


@dataclass(frozen=True)
class ExpertsSpec:
    """How fmoe2 computes one transformers experts module, or why it does not (``fallback``)."""

    activation: str = "silu"
    gate_up_interleaved: bool = False
    swiglu_alpha: float = SWIGLU_ALPHA
    swiglu_limit: Optional[float] = None
    fallback: str = ""  # the reason it runs transformers' grouped_mm instead ("": fmoe2 runs it)
    checked: bool = False  # the activation was checked against the module's _apply_gate
    # Read from a gate override fmoe2 does not know by name (its act_fn's activation): used only once checked.
    needs_check: bool = False


_SILU_TYPES = (_activations.SiLUActivation, torch.nn.SiLU)
_GELU_TANH_TYPES = tuple(getattr(_activations, name) for name in ("GELUTanh", "NewGELUActivation", "FastGELUActivation")
                         if hasattr(_activations, name))


def _activation_of(act_fn) -> Optional[str]:
    """fmoe2's name of a transformers activation module (or function), None when it has none."""
    if act_fn is F.silu or isinstance(act_fn, _SILU_TYPES):
        return "silu"
    if isinstance(act_fn, _activations.GELUActivation):
        return "gelu"
    if isinstance(act_fn, _GELU_TANH_TYPES):
        return "gelu_tanh"
    if isinstance(act_fn, torch.nn.GELU):
        return "gelu_tanh" if act_fn.approximate == "tanh" else "gelu"
    return None


def _parameter(module, *names):
    """The first of ``names`` found on the module or its config."""
    for owner in (module, getattr(module, "config", None)):
        for name in names:
            value = getattr(owner, name, None)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                return float(value)
    return None


def classify(module) -> ExpertsSpec:
    """The spec read from the module's attributes alone (no tensors: torch.compile traces it)."""
    if not getattr(module, "has_gate", True):
        return ExpertsSpec(fallback="its experts have no gate (has_gate=False); fmoe2 computes gated experts")
    if getattr(module, "has_post_expert_norm", False):
        return ExpertsSpec(fallback="it normalises each expert's output (has_post_expert_norm)")
    interleaved = not getattr(module, "is_concatenated", True)
    gate = type(module)._apply_gate
    if gate is _moe._default_apply_gate:  # act_fn(gate) * up on [gate; up]
        activation = _activation_of(getattr(module, "act_fn", None))
        if activation is None:
            return ExpertsSpec(fallback=f"activation {type(getattr(module, 'act_fn', None)).__name__} is not one of "
                                        "fmoe2's (silu, gelu, gelu_tanh, swiglu_oai)")
        return ExpertsSpec(activation=activation)
    name = getattr(gate, "__qualname__", repr(gate))
    if name in OAI_SWIGLU_GATES:
        alpha = _parameter(module, "alpha", "swiglu_alpha")
        return ExpertsSpec("swiglu_oai", interleaved, alpha if alpha is not None else SWIGLU_ALPHA,
                           _parameter(module, "limit", "swiglu_limit"))
    if name in CLAMPED_SILU_GATES:
        limit = _parameter(module, "limit", "swiglu_limit")
        if limit is not None:
            return ExpertsSpec("silu", interleaved, SWIGLU_ALPHA, limit)
    # Another override (e.g. the activation computed in fp32, as fmoe2 does anyway): its act_fn's activation,
    # if the check confirms it.
    activation = _activation_of(getattr(module, "act_fn", None))
    if activation is not None:
        return ExpertsSpec(activation, interleaved, needs_check=True)
    return ExpertsSpec(fallback=f"its own gate ({name}) is not one fmoe2 computes")


def check_gate(module, spec: ExpertsSpec) -> ExpertsSpec:
    """``spec`` checked against the module's own ``_apply_gate`` on random gate/up values (fp32, past
    any clamp), in either gate/up order; a mismatch becomes a fallback."""
    if spec.fallback:
        return spec
    prepared = module.__dict__.get(PREPARED_ATTRIBUTE)
    device = prepared.w13.device if prepared is not None else _weight(module, "gate_up_proj").device
    gen = torch.Generator(device="cpu").manual_seed(0)
    projection = (torch.randn(PROBE_ROWS, 2 * PROBE_COLUMNS, generator=gen) * PROBE_SCALE).to(device)
    try:
        with torch.no_grad():
            expected = module._apply_gate(projection).float()
    except Exception as error:  # noqa: BLE001 - an override we cannot run on a probe: not ours to guess
        return ExpertsSpec(fallback=f"its gate could not be checked ({type(error).__name__}: {error})")
    for interleaved in (spec.gate_up_interleaved, not spec.gate_up_interleaved):
        gate, up = ((projection[:, 0::2], projection[:, 1::2]) if interleaved
                    else (projection[:, :PROBE_COLUMNS], projection[:, PROBE_COLUMNS:]))
        ours = gated_activation(gate, up, spec.activation, spec.swiglu_alpha, spec.swiglu_limit)
        if expected.shape == ours.shape and torch.allclose(expected, ours, rtol=1e-4, atol=1e-4):
            return ExpertsSpec(spec.activation, interleaved, spec.swiglu_alpha, spec.swiglu_limit, checked=True)
    name = getattr(type(module)._apply_gate, "__qualname__", "_apply_gate")
    return ExpertsSpec(fallback=f"its gate ({name}) differs from fmoe2's {spec.activation} on a check")


def experts_spec(module) -> ExpertsSpec:
    """The module's spec: read and checked on its first eager call, then kept on the module."""
    spec = getattr(module, "_fmoe2_spec", None)
    if spec is not None:
        return spec
    spec = classify(module)
    if not tracing():
        spec = check_gate(module, spec)
        module._fmoe2_spec = spec
    elif spec.needs_check:
        return ExpertsSpec(fallback=f"its own gate ({type(module).__name__}._apply_gate) is checked on an eager call "
                                    "first: run the model once before torch.compile traces it")
    return spec


def _requires_grad(module, hidden_states, top_k_weights) -> bool:
    """Whether this call is part of a graph autograd will differentiate: in grad mode, the hidden states, the
    routing weights (a trained router) or any of the module's parameters (weights, biases) require grad. (fmoe2
    refuses such a call: its output would carry no gradient.)"""
    if not torch.is_grad_enabled():
        return False
    if hidden_states.requires_grad or (top_k_weights is not None and top_k_weights.requires_grad):
        return True
    return any(p is not None and p.requires_grad for p in module._parameters.values())


def _runtime_fallback_reason(module, hidden_states, top_k_weights=None) -> str:
    """What any call needs whatever its weights' format: no gradients, a GPU or the interpreter, and no bf16
    under the interpreter (fmoe2.fused_moe refuses each of these; its transformers fallback is right)."""
    if _requires_grad(module, hidden_states, top_k_weights):
        return "gradients are required and fmoe2 is inference-only (run under torch.no_grad())"
    if hidden_states.device.type == "cpu" and not interpreter_enabled():
        return ("the model is on the CPU (fmoe2's kernels need a GPU, or TRITON_INTERPRET=1 set before fmoe2 is "
                "imported)")
    if interpreter_computes_wrong(hidden_states.dtype):
        return (f"the model is bf16, and {BF16_UNDER_THE_INTERPRETER} (load it in float16 or float32 to run fmoe2 "
                "on the CPU, or use a GPU)")
    return ""


def _weight(module, name: str) -> torch.Tensor:
    """A parameter of the module, read from its parameter dict (``nn.Module.__getattr__`` costs more, on
    every layer of every decode step); a weight held otherwise, by attribute."""
    weight = module._parameters.get(name)
    return weight if weight is not None else getattr(module, name)


def call_fallback_reason(module, hidden_states, weight: Optional[torch.Tensor] = None,
                         top_k_weights: Optional[torch.Tensor] = None) -> str:
    """Why this call cannot run on fmoe2 although the module can ("" when it can)."""
    weight = weight if weight is not None else _weight(module, "gate_up_proj")
    if hidden_states.dtype != weight.dtype:
        return f"hidden states ({hidden_states.dtype}) and expert weights ({weight.dtype}) differ in dtype"
    return _runtime_fallback_reason(module, hidden_states, top_k_weights)


def fp8_call_fallback_reason(module, hidden_states, top_k_weights: Optional[torch.Tensor] = None) -> str:
    """Why this call of an fp8 experts module (transformers' ``FP8Experts``: e4m3 ``gate_up_proj``,
    ``down_proj`` and their ``*_scale_inv``) cannot run on fmoe2 ("" when it can)."""
    weight, scale = module.gate_up_proj, module.gate_up_proj_scale_inv
    if getattr(module, "activation_scheme", "dynamic") != "dynamic":
        return f"activation_scheme={module.activation_scheme!r}: fmoe2 quantizes activations dynamically"
    if weight.dtype not in FP8_DTYPES:
        return f"expert weights of dtype {weight.dtype} are no fp8 e4m3 (fmoe2 takes {FP8_DTYPES})"
    if scale.dtype != torch.float32 or module.down_proj_scale_inv.dtype != torch.float32:
        return f"weight scales of dtype {scale.dtype} (fmoe2 takes float32 scales)"
    block = getattr(module, "block_size", None)
    E, two_i, H = weight.shape
    expected = (E, -(-two_i // block[0]), -(-H // block[1])) if block is not None else (E, 1, 1)
    if block is not None and block[1] % FP8_GROUP:
        return f"block_size {tuple(block)}: fmoe2 takes blocks whose K is a multiple of {FP8_GROUP}"
    if tuple(scale.shape) != expected:
        return f"gate_up_proj_scale_inv has shape {tuple(scale.shape)}, not {expected} for block_size {block}"
    if weight.dtype not in target_of(hidden_states.device).fp8_dtypes:
        return f"this device's matrix instructions do not take {weight.dtype}"
    if hidden_states.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return f"hidden states of dtype {hidden_states.dtype}"
    return _runtime_fallback_reason(module, hidden_states, top_k_weights)


_warned = set()


def _fallback(module, reason: str, hidden_states, top_k_index, top_k_weights, registry=None):
    if not tracing() and (type(module), reason) not in _warned:
        _warned.add((type(module), reason))
        warnings.warn(f"fmoe2 experts backend: {type(module).__name__} runs transformers' grouped_mm instead: "
                      f"{reason}", stacklevel=3)
    registry = registry if registry is not None else _moe.ALL_EXPERTS_FUNCTIONS
    return registry["grouped_mm"](module, hidden_states, top_k_index, top_k_weights)


def fmoe2_experts_forward(module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                          top_k_weights: torch.Tensor) -> torch.Tensor:
    """The ``"fmoe2"`` experts backend: ``fmoe2.fused_moe`` on the module's parameters, in place (or on the prepared
    weights a loader left at :data:`PREPARED_ATTRIBUTE`)."""
    spec = experts_spec(module)
    prepared = prepared_weights_of(module)
    if prepared is not None:
        return _prepared_experts_forward(module, prepared, spec, hidden_states, top_k_index, top_k_weights)
    w1 = None if spec.fallback else _weight(module, "gate_up_proj")
    reason = spec.fallback or call_fallback_reason(module, hidden_states, w1, top_k_weights)
    # (set by fmoe2.integrations.peft as a plain attribute: in the instance dict, no __getattr__ miss)
    adapters = module.__dict__.get(ADAPTERS_ATTRIBUTE)
    lora = adapters.call_arguments(hidden_states) if adapters is not None else {}
    if reason:
        if lora:  # transformers' backends know nothing of fmoe2's adapters: never drop them silently
            raise RuntimeError(f"fmoe2 experts backend: {type(module).__name__} has LoRA adapters selected but "
                               f"cannot run on fmoe2: {reason}")
        return _fallback(module, reason, hidden_states, top_k_index, top_k_weights)
    w2 = _weight(module, "down_proj")
    if getattr(module, "is_transposed", False):  # [E, H, 2I] / [E, I, H]: read through their strides
        w1, w2 = w1.transpose(1, 2), w2.transpose(1, 2)
    biases = {}
    if getattr(module, "has_bias", False):
        biases = dict(w1_bias=_weight(module, "gate_up_proj_bias"), w2_bias=_weight(module, "down_proj_bias"))
    if not hidden_states.is_contiguous():
        hidden_states = hidden_states.contiguous()
    return fused_moe(hidden_states, w1, w2, top_k_weights, top_k_index, activation=spec.activation,
                     gate_up_interleaved=spec.gate_up_interleaved, swiglu_alpha=spec.swiglu_alpha,
                     swiglu_limit=spec.swiglu_limit, **biases, **lora)


def prepared_weights_of(module):
    """The prepared weights a loader left on ``module`` (None: none), rebuilt from its buffers where ``module.to()``
    replaced them since."""
    prepared = module.__dict__.get(PREPARED_ATTRIBUTE)
    if prepared is None:
        return None
    buffers = module._buffers  # (every call of the layer: plain lookups, no tensor work)
    fields = {f: buffers.get(PREPARED_BUFFER_PREFIX + f) for f in PREPARED_FIELDS}
    if any(fields[f] is not getattr(prepared, f) for f in PREPARED_FIELDS):  # module.to() replaced some
        prepared = type(prepared).from_prepared(fields["w13"], fields["w2"], prepared.hidden_size,
                                                prepared.intermediate_size, fields["b13"], fields["b2"], fields["s13"],
                                                fields["s2"], prepared.scale_block, prepared.weight_format)
        module.__dict__[PREPARED_ATTRIBUTE] = prepared
    return prepared


def _prepared_experts_forward(module, prepared, spec: ExpertsSpec, hidden_states, top_k_index, top_k_weights):
    """fused_moe on prepared weights (biases inside); no transformers backend can run them, so a call fmoe2 cannot
    run raises, naming the reason."""
    reason = spec.fallback or _runtime_fallback_reason(module, hidden_states, top_k_weights)
    if reason:
        raise RuntimeError(f"fmoe2 experts backend: {type(module).__name__} holds fmoe2's prepared "
                           f"{prepared.weight_format} weights, which only fmoe2 runs, and this call cannot run on "
                           f"fmoe2: {reason}")
    adapters = module.__dict__.get(ADAPTERS_ATTRIBUTE)
    lora = adapters.call_arguments(hidden_states) if adapters is not None else {}
    if not hidden_states.is_contiguous():
        hidden_states = hidden_states.contiguous()
    return fused_moe(hidden_states, prepared, None, top_k_weights, top_k_index, activation=spec.activation,
                     swiglu_alpha=spec.swiglu_alpha, swiglu_limit=spec.swiglu_limit, **lora)


def fmoe2_fp8_experts_forward(module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                              top_k_weights: torch.Tensor) -> torch.Tensor:
    """The ``"fmoe2"`` backend of transformers' fine-grained fp8 experts (``FP8Experts``, the experts of
    DeepSeek-V3-style fp8 checkpoints): ``fmoe2.fused_moe`` on the e4m3 weights and their block (or
    per-expert) scales in place, activations quantized inside the kernels (``fmoe2/fp8.py``)."""
    spec = experts_spec(module)
    reason = spec.fallback or fp8_call_fallback_reason(module, hidden_states, top_k_weights)
    if reason:
        return _fallback(module, reason, hidden_states, top_k_index, top_k_weights, _fp8_registry())
    block = getattr(module, "block_size", None)
    if not hidden_states.is_contiguous():
        hidden_states = hidden_states.contiguous()
    return fused_moe(hidden_states, module.gate_up_proj, module.down_proj, top_k_weights, top_k_index,
                     activation=spec.activation, gate_up_interleaved=spec.gate_up_interleaved,
                     swiglu_alpha=spec.swiglu_alpha, swiglu_limit=spec.swiglu_limit,
                     w1_scale=module.gate_up_proj_scale_inv, w2_scale=module.down_proj_scale_inv,
                     block_shape=tuple(block) if block is not None else None)


def _fp8_registry():
    """transformers' registry of fp8 experts functions (None where this transformers has none)."""
    try:
        from transformers.integrations.finegrained_fp8 import ALL_FP8_EXPERTS_FUNCTIONS
    except ImportError:
        return None
    return ALL_FP8_EXPERTS_FUNCTIONS


def register(name: str = BACKEND_NAME) -> str:
    """Registers the backend under ``name`` in transformers' experts registry and, where transformers has
    one, its fp8 experts registry (idempotent); returns ``name``. Importing this module registers
    ``"fmoe2"``."""
    _moe.ExpertsInterface.register(name, fmoe2_experts_forward)
    REGISTERED_NAMES.add(name)
    fp8_registry = _fp8_registry()
    if fp8_registry is not None:
        type(fp8_registry).register(name, fmoe2_fp8_experts_forward)
    return name


register()

__all__ = ["register", "fmoe2_experts_forward", "fmoe2_fp8_experts_forward", "experts_spec", "classify", "check_gate", "ExpertsSpec",
           "BACKEND_NAME", "ADAPTERS_ATTRIBUTE", "PREPARED_ATTRIBUTE", "REGISTERED_NAMES",
           "prepared_weights_of"]
