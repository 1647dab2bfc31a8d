"""One call of :func:`fmoe2.fused_moe` as one frozen description, :class:`MoECall`, where a plan is built.

The public function keeps the vLLM/SGLang keywords and its hot path keeps its hand-written key
(``fused_moe.call_key``: a few microseconds, no object made). Everything slower reads the call from here:

* the checks (``fused_moe.check_fused_moe_args``) read it bundle by bundle;
* the registered op's schema and its packing (``fmoe2/ops.py``, ``op_call.py``): :meth:`MoECall.op_values`,
  :meth:`MoECall.from_op`, :func:`op_schema`, from each field's ``op`` slots;
* the plan's inputs (``plan.INPUT_SOURCES``): :data:`INPUT_SOURCES`, from each field's ``sources``;
  ``call_key`` writes its addresses in that order (``tests/gemm/test_call.py`` checks it slot by slot).

Each leaf field is named as ``fused_moe``'s keyword it holds. A new argument is one field: its bundle, its
default, its op slot (and, for a tensor the kernels read, its source), plus its check and :data:`KEYWORDS`.
"""
from __future__ import annotations

import json
from dataclasses import MISSING, dataclass, field, fields
from typing import Any, Dict, Optional, Tuple, Union

import torch

from ..activations import SWIGLU_ALPHA
from .config import FusedMoEConfig
from .layout import PreparedMoEWeights
from .lora import MoELoRA, PreparedMoELoRA

# fused_moe's parameters in its signature's order (positional order of call_key, check_fused_moe_args,
# plan_of, forward_launches, and the op's slot order)
KEYWORDS = ("hidden_states", "w1", "w2", "topk_weights", "topk_ids", "activation", "out", "expert_map", "config",
            "path", "lora", "token_lora_ids", "w1_bias", "w2_bias", "gate_up_interleaved", "swiglu_alpha",
            "swiglu_limit", "w1_scale", "w2_scale", "block_shape", "deterministic")
# The op's order of the fields' slots: KEYWORDS but path before config (as the schema has always had it, which
# positional callers of torch.ops.fmoe2.fused_moe rely on); a new field goes last in both.
OP_ORDER = KEYWORDS[:8] + ("path", "config") + KEYWORDS[10:]


def arg(op: Tuple[str, ...] = (), sources: Tuple[Tuple[str, str], ...] = (), default: Any = MISSING):
    """A leaf field: ``op`` its slots in the op's schema (``"type name[=default]"``; none: not in the op),
    ``sources`` the ``(name, where)`` device addresses the plan's launches read (``where``: a dotted path from
    the checked call, :func:`checked_sources`)."""
    return field(default=default, metadata=dict(op=op, sources=sources))


@dataclass(frozen=True)
class MoERouting:
    topk_weights: torch.Tensor = arg(("Tensor topk_weights",), (("topk_weights", "topk_weights"),))  # [M, topk]
    topk_ids: torch.Tensor = arg(("Tensor topk_ids",), (("topk_ids", "topk_ids"),))  # [M, topk] int32/int64
    # [E_global] int32, global expert id -> local id or -1
    expert_map: Optional[torch.Tensor] = arg(("Tensor? expert_map",), (("expert_map", "expert_map"),), None)


@dataclass(frozen=True)
class MoEWeights:
    """The experts: plain ``w1 [E, 2I, H]`` / ``w2 [E, H, I]`` with their biases, fp8 scales and row layout, or
    a :class:`PreparedMoEWeights` (``w2`` None) that carries its own."""

    w1: Union[torch.Tensor, PreparedMoEWeights] = arg(("Tensor w1",), (("w1", "problem.w1"),))
    w2: Optional[torch.Tensor] = arg(("Tensor? w2",), (("w2", "problem.w2"),))
    w1_bias: Optional[torch.Tensor] = arg(("Tensor? w1_bias",), (("w1_bias", "problem.w1_bias"),), None)
    w2_bias: Optional[torch.Tensor] = arg(("Tensor? w2_bias",), (("w2_bias", "problem.w2_bias"),), None)
    gate_up_interleaved: bool = arg(("bool gate_up_interleaved",), default=False)
    w1_scale: Optional[torch.Tensor] = arg(("Tensor? w1_scale=None",), (("w1_scale", "problem.w1_scale"),), None)
    w2_scale: Optional[torch.Tensor] = arg(("Tensor? w2_scale=None",), (("w2_scale", "problem.w2_scale"),), None)
    block_shape: Optional[Tuple[int, int]] = arg(("int[]? block_shape=None",), default=None)

    @property
    def prepared(self) -> bool:
        return isinstance(self.w1, PreparedMoEWeights)


@dataclass(frozen=True)
class MoEActivation:
    activation: str = arg(("str activation",), default="silu")  # fmoe2.activations.ACTIVATIONS
    swiglu_alpha: float = arg(("float swiglu_alpha",), default=SWIGLU_ALPHA)  # read where the table says
    swiglu_limit: Optional[float] = arg(("float? swiglu_limit",), default=None)  # clamp before the activation


_LORA_TENSORS = ("a13", "b13", "a2", "b2", "scaling")


@dataclass(frozen=True)
class MoEAdapters:
    lora: Optional[Union[MoELoRA, PreparedMoELoRA]] = arg(
        tuple(f"Tensor? lora_{n}" for n in _LORA_TENSORS) + ("int lora_rank",),
        tuple((f"lora.{n}", f"problem.lora.{n}") for n in _LORA_TENSORS), None)
    token_lora_ids: Optional[torch.Tensor] = arg(("Tensor? token_lora_ids",),
                                                 (("token_lora_ids", "problem.token_lora_ids"),), None)  # [M] int32


@dataclass(frozen=True)
class MoEOptions:
    out: Optional[torch.Tensor] = arg((), (("out", "out"),), None)  # the op allocates; fused_moe copies into out
    # (its slots carry the prepared weights' sizes too, where the schema has always had them)
    config: Optional[FusedMoEConfig] = arg(("str config", "int prepared_hidden_size",
                                            "int prepared_intermediate_size"), default=None)
    path: str = arg(("str path",), default="auto")
    deterministic: bool = arg(("bool deterministic=False",), default=False)  # resolved (fused_moe's None: the switch)


@dataclass(frozen=True)
class MoECall:
    """One call of :func:`fmoe2.fused_moe` (module docstring): its input, routing, weights, activation,
    adapters and options."""

    hidden_states: torch.Tensor = arg(("Tensor hidden_states",), (("hidden_states", "problem.x"),))  # [M, H]
    routing: MoERouting = None
    weights: MoEWeights = None
    activation: MoEActivation = MoEActivation()
    adapters: MoEAdapters = MoEAdapters()
    options: MoEOptions = MoEOptions()

    @classmethod
    def bind(cls, *args, **keywords) -> "MoECall":
        """The call of ``fused_moe(*args, **keywords)`` (positionals in :data:`KEYWORDS` order)."""
        if len(args) > len(KEYWORDS):
            raise TypeError(f"fused_moe takes {len(KEYWORDS)} arguments, got {len(args)} positional")
        if keywords:
            for name, value in zip(KEYWORDS, args):
                if name in keywords:
                    raise TypeError(f"fused_moe got multiple values for argument {name!r}")
                keywords[name] = value
            unknown = set(keywords) - set(LEAVES)
            if unknown:
                raise TypeError(f"fused_moe got unexpected keyword arguments {sorted(unknown)}")
        else:
            keywords = dict(zip(KEYWORDS, args))
        missing = [n for n in REQUIRED if n not in keywords]
        if missing:
            raise TypeError(f"fused_moe missing required arguments {missing}")
        return cls(**{bundle: (make(**{n: keywords[n] for n in names if n in keywords}) if make is not None else
                               keywords[names[0]]) for bundle, (make, names) in BUNDLES.items()})

    def arguments(self) -> Dict[str, Any]:
        """``{keyword: value}`` of every argument, in :data:`KEYWORDS` order (``fused_moe(**call.arguments())``)."""
        flat = {"hidden_states": self.hidden_states}
        for bundle in (self.routing, self.weights, self.activation, self.adapters, self.options):
            flat.update((f.name, getattr(bundle, f.name)) for f in fields(bundle))
        return {n: flat[n] for n in KEYWORDS}

    def op_values(self) -> list:
        """The call in ``torch.ops.fmoe2.fused_moe``'s slot order (:func:`op_values`)."""
        return op_values(self.arguments())

    @classmethod
    def from_op(cls, values, named=None) -> "MoECall":
        """The call that :meth:`op_values` packed (``values``: the op's arguments in slot order, ``named`` any
        given by name; slots left out take their schema defaults)."""
        slots = dict(OP_DEFAULTS)
        slots.update(zip(OP_SLOTS, values))
        slots.update(named or {})
        keywords = {name: slots[name] for name in KEYWORDS if name in slots}
        keywords["config"] = (FusedMoEConfig.from_dict(json.loads(slots["config"])) if slots["config"] else None)
        block = slots["block_shape"]
        keywords["block_shape"] = tuple(block) if block is not None else None
        inter = slots["prepared_intermediate_size"]
        if inter:  # prepared weights: their biases and scales travel as w1_bias ... block_shape
            prepared = PreparedMoEWeights.from_prepared(slots["w1"], slots["w2"], slots["prepared_hidden_size"], inter,
                                                        slots["w1_bias"], slots["w2_bias"], slots["w1_scale"],
                                                        slots["w2_scale"], keywords["block_shape"])
            keywords.update(w1=prepared,
                            w2=None, w1_bias=None, w2_bias=None, w1_scale=None, w2_scale=None, block_shape=None)
        keywords["lora"] = None
        if slots["lora_a13"] is not None:
            keywords["lora"] = PreparedMoELoRA(*(slots[f"lora_{n}"] for n in _LORA_TENSORS), slots["lora_rank"],
                                               slots["hidden_states"].shape[1], inter or slots["w1"].shape[1] // 2)
        return cls.bind(**keywords)


# leaf name -> its dataclass field; bundle -> (its class, its leaf names); None: a leaf of MoECall itself
LEAVES = {}
BUNDLES = {}
for _f in fields(MoECall):
    _cls = _f.type if isinstance(_f.type, type) else globals().get(_f.type)
    if _cls is not None and hasattr(_cls, "__dataclass_fields__"):
        BUNDLES[_f.name] = (_cls, tuple(g.name for g in fields(_cls)))
        LEAVES.update((g.name, g) for g in fields(_cls))
    else:
        BUNDLES[_f.name] = (None, (_f.name,))
        LEAVES[_f.name] = _f
del _f, _cls
REQUIRED = tuple(n for n in KEYWORDS if LEAVES[n].default is MISSING)


def _slot_name(declaration: str) -> str:
    return declaration.split()[1].split("=")[0]


# Each argument's op slots, in a plain dict: a dataclass field's metadata is a mappingproxy, and Dynamo breaks the
# graph where a traced call reads one after any dict was mutated in the same trace (transformers' Qwen2-MoE and OLMoE
# decode steps did: one break per compiled step, H200, 2026-11-28).
OP_SLOTS_OF = {name: tuple(LEAVES[name].metadata["op"]) for name in OP_ORDER}
# The op's slots in order, their schema, and the defaults of the trailing ones
OP_DECLARATIONS = tuple(d for name in OP_ORDER for d in OP_SLOTS_OF[name])
OP_SLOTS = tuple(_slot_name(d) for d in OP_DECLARATIONS)
OP_DEFAULTS = {_slot_name(d): {"None": None, "False": False}[d.split("=")[1]] for d in OP_DECLARATIONS if "=" in d}


def op_schema(name: str = "fused_moe") -> str:
    """The schema of ``torch.ops.fmoe2.fused_moe``, from each field's ``op`` slots."""
    return f"{name}({', '.join(OP_DECLARATIONS)}) -> Tensor"


# Per-call device addresses a plan's launches read, in this order (0 where absent): the sources of the required
# arguments, then the optional ones, each in the description's order; the scratch buffers' addresses follow.
_SOURCES = [(LEAVES[name].default is MISSING, source) for bundle, (_, names) in BUNDLES.items()
            for name in names for source in LEAVES[name].metadata["sources"]]
SOURCE_PATHS = tuple(s for required, s in _SOURCES if required) + tuple(s for required, s in _SOURCES if not required)
INPUT_SOURCES = tuple(name for name, _ in SOURCE_PATHS)
OUT_SOURCE = INPUT_SOURCES.index("out")
REQUIRED_SOURCES = sum(required for required, _ in _SOURCES)  # call_key's first addresses, always given
del _SOURCES


def checked_sources(problem, topk_weights, topk_ids, out, expert_map) -> list:
    """The tensors of :data:`INPUT_SOURCES` (None where absent), read from the checked ``problem``
    (``launches.MoEProblem``: prepared weights and adapters resolved) and the routing and output tensors."""
    scope = dict(problem=problem, topk_weights=topk_weights, topk_ids=topk_ids, out=out, expert_map=expert_map)
    found = []
    for _, where in SOURCE_PATHS:
        head, *rest = where.split(".")
        value = scope[head]
        for part in rest:
            value = getattr(value, part) if value is not None else None
        found.append(value)
    return found


def op_values(values: Dict[str, Any]) -> list:
    """The arguments of one call (``{keyword: value}`` in :data:`KEYWORDS` order) in ``torch.ops.fmoe2.fused_moe``'s
    slot order (:data:`OP_ORDER`, :func:`op_schema`): plain values and tensors, prepared weights and adapters as
    their tensors and sizes, a config as JSON. A function of the plain values, not of a :class:`MoECall`:
    ``torch.compile`` traces it (Dynamo builds no frozen dataclass inside a traced function)."""
    values = dict(values)
    sizes = (0, 0)
    p = values["w1"]
    if isinstance(p, PreparedMoEWeights):
        if any(values[n] is not None for n in ("w1_bias", "w2_bias", "w1_scale", "w2_scale", "block_shape")):
            # (the op's impl would pass them on as the prepared ones)
            raise ValueError("w1_bias/w2_bias/w1_scale/w2_scale/block_shape go with plain weights; prepared "
                             "weights carry theirs (fmoe2.prepare_weights(w1, w2, w1_bias=..., w1_scale=..., ...))")
        sizes = (p.hidden_size, p.intermediate_size)
        values.update(w1=p.w13, w2=p.w2, w1_bias=p.b13, w2_bias=p.b2, w1_scale=p.s13, w2_scale=p.s2,
                      block_shape=p.scale_block)
    lora = values["lora"]
    if lora is not None:
        from .lora import prepare_lora

        lora = prepare_lora(lora)
    config, alpha, limit, block = (values[n] for n in ("config", "swiglu_alpha", "swiglu_limit", "block_shape"))
    values.update(config=(config.to_json() if config is not None else "", *sizes),
                  lora=(tuple(getattr(lora, n) for n in _LORA_TENSORS) + (lora.rank,) if lora is not None else
                        (None,) * len(_LORA_TENSORS) + (0,)),
                  swiglu_alpha=float(alpha), swiglu_limit=float(limit) if limit is not None else None,
                  block_shape=list(block) if block is not None else None,
                  deterministic=bool(values["deterministic"]))
    flat = []
    for name in OP_ORDER:
        slots = OP_SLOTS_OF[name]
        if len(slots) == 1:
            flat.append(values[name])
        elif slots:
            flat.extend(values[name])
    return flat
