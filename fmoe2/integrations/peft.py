"""PEFT LoRA adapters of MoE experts, served unmerged by fmoe2's multi-LoRA kernels, several per batch.

    import fmoe2.integrations.transformers          # the "fmoe2" experts backend
    from fmoe2.integrations.peft import load_adapters

    model = AutoModelForCausalLM.from_pretrained(name, experts_implementation="fmoe2")
    adapters = load_adapters(model, {"math": "path/to/adapter", "code": "path/to/other"})
    with adapters.use(["math", "code", None]):      # one entry per sequence of the batch; None: the base model
        out = model.generate(input_ids, ...)

PEFT trains MoE experts with ``LoraConfig(target_parameters=["mlp.experts.gate_up_proj",
"mlp.experts.down_proj"])``: one ``ParamWrapper`` per targeted 3-D parameter, whose factors cover every
expert at once, ``lora_A.weight [E*r, in]`` (expert ``e``: rows ``e*r .. e*r+r-1``) and ``lora_B.weight
[out, E*r]`` (expert ``e``: columns ``e, E+e, 2E+e, ...``, rank-major), scaling ``lora_alpha / r``
(``lora_alpha / sqrt(r)`` with ``use_rslora``). ``in``/``out`` are the projection's input and output
sizes whatever the parameter's layout (``[E, out, in]``, or ``[E, in, out]`` where the experts module is
``is_transposed``, as gpt-oss). PEFT adds ``W + dW`` for every expert on every forward, so transformers'
experts backends only ever see merged weights and a batch cannot mix adapters. Here the factors go to
fmoe2's LoRA form per layer (:class:`fmoe2.MoELoRA`: gate, up and down factors, the gate/up rows of
``lora_B`` split as the module stores them, concatenated or interleaved) and the base weights stay as
they are; the experts backend applies the selected adapter of each token inside its kernels.

Saved keys (``adapter_model.safetensors``) name the experts module, not the parameter:
``...mlp.experts.lora_A.weight`` belongs to the outermost wrapper and ``...experts.base_layer.lora_A.weight``
to the one inside it. PEFT nests the wrappers in the order the module registers its parameters (the first
registered innermost), so with both targeted ``base_layer`` is ``gate_up_proj`` and the outer one
``down_proj``; shapes are checked against that reading.

Adapters that also target other modules (``target_modules``: attention, dense MLPs) keep PEFT's own LoRA
layers for those parts: they are injected into the model with PEFT (``inject_adapter_in_model``, no
adapter active outside :meth:`LoadedAdapters.use`) and get each sequence's adapter through PEFT's
mixed-batch forward (``adapter_names``). Refused with a ``ValueError`` before the model changes: DoRA,
LoRA biases, per-module rank or alpha patterns, ``modules_to_save``, fp8 experts; experts without a gate
(``up_proj``) have no fmoe2 LoRA form.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import re
import warnings
from dataclasses import dataclass, field
from typing import Dict, Iterator, List, Mapping, Optional, Sequence, Tuple, Union

import torch

from ..fp8 import FP8_DTYPES
from ..gemm.lora import MAX_LORA_RANK, MAX_LORAS, MoELoRA, PreparedMoELoRA, prepare_lora
from .transformers import ADAPTERS_ATTRIBUTE, REGISTERED_NAMES, experts_spec

# Experts parameters PEFT adapters are read for, in the order transformers' experts modules register them
# (which is PEFT's nesting order, the first innermost).
EXPERT_PARAMETERS = ("gate_up_proj", "down_proj")
CONFIG_NAME, WEIGHTS_NAMES = "adapter_config.json", ("adapter_model.safetensors", "adapter_model.bin")

PEFT_BASE = "__base__"  # PEFT's adapter name for "no adapter" in a mixed batch
LOADED_ATTRIBUTE = "fmoe2_loaded_adapters"  # the model's LoadedAdapters (a new load replaces it)

AdapterSource = Union[str, os.PathLike, Tuple[Mapping[str, torch.Tensor], object]]
SequenceAdapter = Union[str, int, None]

# "base_model.model." (PeftModel's prefix, absent in transformers' own load_adapter) and the adapter name
# segment after lora_A/lora_B that in-memory state dicts carry (".default.").
_PEFT_PREFIX = "base_model.model."
_NAMED_FACTOR = re.compile(r"\.(lora_[AB])\.[^.]+\.weight$")


@dataclass
class AdapterConfig:
    """What fmoe2 reads of a PEFT ``LoraConfig`` (``adapter_config.json``)."""

    rank: int
    scaling: float
    target_parameters: Tuple[str, ...]
    fields: dict  # the whole config, for PEFT's layers of the other targeted modules
    targets_modules: bool = False  # whether target_modules names modules besides the experts

    @classmethod
    def from_peft(cls, config, name: str) -> "AdapterConfig":
        """From a ``LoraConfig``, its ``to_dict()`` or a parsed ``adapter_config.json``; refuses what fmoe2
        cannot serve, naming the field."""
        fields = config.to_dict() if hasattr(config, "to_dict") else dict(config)
        where = f"adapter {name!r}"
        peft_type = str(fields.get("peft_type", "LORA")).rsplit(".", 1)[-1]
        if peft_type != "LORA":
            raise ValueError(f"{where}: peft_type is {peft_type}; fmoe2 serves LoRA adapters")
        for flag in ("use_dora", "lora_bias"):
            if fields.get(flag):
                raise ValueError(f"{where}: {flag}=True is not supported (fmoe2's experts LoRA is plain LoRA)")
        for pattern in ("rank_pattern", "alpha_pattern"):
            if fields.get(pattern):
                raise ValueError(f"{where}: {pattern} {fields[pattern]} is not supported (one rank and alpha for "
                                 "every experts module)")
        for unsupported in ("modules_to_save", "trainable_token_indices"):
            if fields.get(unsupported):
                raise ValueError(f"{where}: {unsupported}={fields[unsupported]!r} is not supported")
        modules = fields.get("target_modules")
        targets = tuple(fields.get("target_parameters") or ())
        if not targets:
            raise ValueError(f"{where}: no target_parameters: not an adapter of MoE experts")
        for target in targets:
            if target.rsplit(".", 1)[-1] not in EXPERT_PARAMETERS:
                raise ValueError(f"{where}: target parameter {target!r} is not one of the experts' "
                                 f"{EXPERT_PARAMETERS}")
        rank, alpha = int(fields["r"]), float(fields.get("lora_alpha", 8))
        if not 1 <= rank <= MAX_LORA_RANK:
            raise ValueError(f"{where}: r={rank}; fmoe2's LoRA kernels take ranks 1..{MAX_LORA_RANK}")
        scaling = alpha / math.sqrt(rank) if fields.get("use_rslora") else alpha / rank
        return cls(rank=rank, scaling=scaling, target_parameters=targets, fields=fields,
                   targets_modules=isinstance(modules, str) or bool(modules))


def read_adapter(source: AdapterSource, name: str) -> Tuple[AdapterConfig, Dict[str, torch.Tensor]]:
    """The config and factors of a PEFT adapter: a saved adapter folder (``adapter_config.json`` and
    ``adapter_model.safetensors`` or ``.bin``), or a ``(state_dict, config)`` pair (``config`` a
    ``LoraConfig`` or its dict). Keys come back without PeftModel's prefix and adapter name."""
    if isinstance(source, (str, os.PathLike)):
        folder = os.fspath(source)
        config_path = os.path.join(folder, CONFIG_NAME)
        if not os.path.isfile(config_path):
            raise ValueError(f"adapter {name!r}: {config_path} not found (a folder saved by PEFT's save_pretrained)")
        with open(config_path) as f:
            config = json.load(f)
        weights = [os.path.join(folder, w) for w in WEIGHTS_NAMES if os.path.isfile(os.path.join(folder, w))]
        if not weights:
            raise ValueError(f"adapter {name!r}: none of {WEIGHTS_NAMES} in {folder}")
        if weights[0].endswith(".safetensors"):
            from safetensors.torch import load_file

            state = load_file(weights[0])
        else:
            state = torch.load(weights[0], map_location="cpu", weights_only=True)
    elif isinstance(source, tuple) and len(source) == 2:
        state, config = source
        if not isinstance(state, Mapping):
            raise TypeError(f"adapter {name!r}: the state dict must be a mapping of names to tensors, got "
                            f"{type(state).__name__}")
    else:
        raise TypeError(f"adapter {name!r}: expected a saved adapter folder or a (state_dict, LoraConfig) pair, got "
                        f"{type(source).__name__}")
    factors = {}
    for key, tensor in state.items():
        key = key[len(_PEFT_PREFIX):] if key.startswith(_PEFT_PREFIX) else key
        factors[_NAMED_FACTOR.sub(r".\1.weight", key)] = tensor
    return AdapterConfig.from_peft(config, name), factors


def experts_modules(model: torch.nn.Module) -> List[Tuple[str, torch.nn.Module]]:
    """``(name, module)`` of every gated experts module of a transformers model."""
    found = []
    for name, module in model.named_modules():
        if type(module).__name__ == "ParamWrapper":
            raise ValueError(f"{name} is a PEFT ParamWrapper: pass the base model (fmoe2 applies the adapters in "
                             "its kernels; a PeftModel would add them to the weights as well)")
        params = dict(module.named_parameters(recurse=False))
        if all(p in params and params[p].dim() == 3 for p in EXPERT_PARAMETERS):
            if params["gate_up_proj"].dtype in FP8_DTYPES:
                raise ValueError(f"{name}: fp8 expert weights ({params['gate_up_proj'].dtype}); fmoe2 runs LoRA "
                                 "adapters on bf16, fp16 and fp32 experts only")
            found.append((name, module))
    return found


def _targets(path: str, target: str) -> bool:
    """PEFT's suffix match of a target name: the whole path, or its end after a dot."""
    return path == target or path.endswith("." + target)


def _module_sizes(module) -> Tuple[int, int, int]:
    """``E, H, I`` of an experts module, from its gate_up_proj (``[E, 2I, H]``, or ``[E, H, 2I]`` transposed)."""
    E, a, b = module.gate_up_proj.shape
    H, two_i = (a, b) if getattr(module, "is_transposed", False) else (b, a)
    return E, H, two_i // 2


def _expert_factors(a: torch.Tensor, b: torch.Tensor, E: int, rank: int, in_features: int, out_features: int,
                    key: str) -> Tuple[torch.Tensor, torch.Tensor]:
    """PEFT's all-experts factors ``A [E*r, in]``, ``B [out, E*r]`` as per-expert ``[E, r, in]`` and
    ``[E, out, r]`` (module docstring)."""
    if tuple(a.shape) != (E * rank, in_features) or tuple(b.shape) != (out_features, E * rank):
        raise ValueError(f"{key}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} are not [E*r, in] = "
                         f"[{E * rank}, {in_features}] and [out, E*r] = [{out_features}, {E * rank}] (E={E}, r={rank})")
    return a.reshape(E, rank, in_features), b.reshape(out_features, rank, E).permute(2, 0, 1)


def module_lora_factors(module, module_name: str, config: AdapterConfig, factors: Mapping[str, torch.Tensor],
                        name: str) -> Dict[str, torch.Tensor]:
    """One adapter's factors for one experts module in :class:`fmoe2.MoELoRA`'s per-adapter layout
    (``gate_a``/``up_a [E, r, H]``, ``gate_b``/``up_b [E, I, r]``, ``down_a [E, r, I]``, ``down_b
    [E, H, r]``; parameters the adapter does not target are absent). Pops the keys it reads."""
    E, H, inter = _module_sizes(module)
    targeted = [p for p in EXPERT_PARAMETERS if any(_targets(f"{module_name}.{p}", t) for t in config.target_parameters)]
    out = {}
    for depth, param in enumerate(reversed(targeted)):  # the last registered is the outermost wrapper
        prefix = f"{module_name}{'.base_layer' * depth}"
        keys = [f"{prefix}.lora_{ab}.weight" for ab in "AB"]
        missing = [k for k in keys if k not in factors]
        if missing:
            raise ValueError(f"adapter {name!r}: no {missing[0]} (the {param} factors of {module_name})")
        a, b = (factors.pop(k) for k in keys)
        if param == "gate_up_proj":
            a_e, b_e = _expert_factors(a, b, E, config.rank, H, 2 * inter, f"adapter {name!r} {prefix}")
            interleaved = experts_spec(module).gate_up_interleaved
            gate_b, up_b = (b_e[:, 0::2], b_e[:, 1::2]) if interleaved else (b_e[:, :inter], b_e[:, inter:])
            out.update(gate_a=a_e, up_a=a_e, gate_b=gate_b, up_b=up_b)
        else:
            a_e, b_e = _expert_factors(a, b, E, config.rank, inter, H, f"adapter {name!r} {prefix}")
            out.update(down_a=a_e, down_b=b_e)
    return out


def stack_adapters(module, per_adapter: Sequence[Tuple[AdapterConfig, Dict[str, torch.Tensor]]]) -> MoELoRA:
    """The adapters of one experts module as one :class:`fmoe2.MoELoRA` (adapter ``l`` at index ``l``), in the
    module's dtype and device; ranks padded with zeros to the largest, untargeted projections zero."""
    E, H, inter = _module_sizes(module)
    L, R = len(per_adapter), max(config.rank for config, _ in per_adapter)
    opts = dict(dtype=module.gate_up_proj.dtype, device=module.gate_up_proj.device)
    shapes = dict(gate_a=(E, R, H), up_a=(E, R, H), gate_b=(E, inter, R), up_b=(E, inter, R), down_a=(E, R, inter),
                  down_b=(E, H, R))
    tensors = {k: torch.zeros((L, *shape), **opts) for k, shape in shapes.items()}
    for index, (config, factors) in enumerate(per_adapter):
        r = config.rank
        for k, t in factors.items():
            target = tensors[k][index]
            # (detached: fmoe2 runs the factors, it does not train them; in grad mode a factor that requires grad
            # would make the stack require grad, which fmoe2.fused_moe refuses)
            (target[:, :r] if k.endswith("_a") else target[..., :r]).copy_(t.detach())
    return MoELoRA(**tensors, scaling=[config.scaling for config, _ in per_adapter])


@dataclass
class AdapterSelection:
    """The adapter of each sequence of the batch being run (:meth:`LoadedAdapters.use`), shared by the
    model's experts modules and PEFT layers; ``indices`` None: no adapter (the base model)."""

    indices: Optional[List[int]] = None  # [B] adapter index per sequence, -1 for the base model
    names: Optional[List[str]] = None  # [B] the same as PEFT's adapter names ("__base__": none)
    _token_ids: Dict[tuple, torch.Tensor] = field(default_factory=dict)  # per token count and device
    _token_names: Dict[int, List[str]] = field(default_factory=dict)  # per row count

    def token_lora_ids(self, num_tokens: int, device: torch.device) -> Optional[torch.Tensor]:
        """int32 ``[num_tokens]`` on ``device``: each token's adapter, the tokens of a batch of B sequences
        flattened sequence-major (as transformers hands them to its experts); None without a selection."""
        if self.indices is None:
            return None
        ids = self._token_ids.get((num_tokens, device))
        if ids is None:
            ids = torch.tensor(self._per_row(self.indices, num_tokens), dtype=torch.int32, device=device)
            self._token_ids[(num_tokens, device)] = ids
        return ids

    def row_names(self, num_rows: int) -> List[str]:
        """PEFT's ``adapter_names`` for an input of ``num_rows`` rows: one per sequence (``[B, S, ...]``
        inputs), or one per token where a module gets the batch flattened (``[B*S, ...]``: routers,
        shared experts)."""
        names = self._token_names.get(num_rows)
        if names is None:
            names = self._token_names[num_rows] = self._per_row(self.names, num_rows)
        return names

    @staticmethod
    def _per_row(per_sequence: list, num_rows: int) -> list:
        batch = len(per_sequence)
        if num_rows % batch:
            raise ValueError(f"a layer got {num_rows} rows, not a multiple of the {batch} sequences whose adapters "
                             "were selected: select one adapter per sequence of the batch")
        return [v for v in per_sequence for _ in range(num_rows // batch)]


@dataclass
class ExpertsAdapters:
    """What one experts module carries (as ``module.fmoe2_adapters``) for the fmoe2 backend: the stacked,
    prepared factors of every adapter and the model's selection."""

    lora: PreparedMoELoRA
    selection: AdapterSelection

    def call_arguments(self, hidden_states: torch.Tensor) -> dict:
        """``fused_moe``'s ``lora``/``token_lora_ids`` for a call on ``hidden_states [T, H]`` ({} without a
        selection). Factors that no longer match the model's dtype or device (``model.to(...)`` after
        loading) follow it, once."""
        ids = self.selection.token_lora_ids(hidden_states.shape[0], hidden_states.device)
        if ids is None:
            return {}
        lora = self.lora
        if lora.dtype != hidden_states.dtype or lora.device != hidden_states.device:
            move = dict(device=hidden_states.device, dtype=hidden_states.dtype)
            self.lora = lora = dataclasses.replace(lora, a13=lora.a13.to(**move), b13=lora.b13.to(**move),
                                                   a2=lora.a2.to(**move), b2=lora.b2.to(**move),
                                                   scaling=lora.scaling.to(hidden_states.device))
        return dict(lora=lora, token_lora_ids=ids)


@dataclass
class LoadedAdapters:
    """The adapters :func:`load_adapters` put on a model: ``names[l]`` is adapter index ``l``."""

    model: torch.nn.Module
    names: List[str]
    modules: List[torch.nn.Module]
    selection: AdapterSelection
    peft_layers: List[torch.nn.Module] = field(default_factory=list)  # PEFT's LoRA layers of other modules
    hooks: list = field(default_factory=list)  # forward pre-hooks: the model's check, the PEFT layers' selection
    had_peft_config: bool = False  # whether the model had a peft_config before PEFT's layers were injected

    def adapter_indices(self, adapters: Sequence[SequenceAdapter]) -> List[int]:
        """The adapter index of each per-sequence entry: a loaded name, an index, or None/-1 (base: -1)."""
        if isinstance(adapters, (str, bytes)) or not isinstance(adapters, Sequence) or not len(adapters):
            raise TypeError("adapters must be a non-empty sequence with one entry per sequence of the batch "
                            "(an adapter name, its index, or None / -1 for the base model)")
        ids = []
        for i, entry in enumerate(adapters):
            if entry is None:
                ids.append(-1)
            elif isinstance(entry, str):
                if entry not in self.names:
                    raise ValueError(f"adapters[{i}]: no adapter named {entry!r}; loaded: {self.names}")
                ids.append(self.names.index(entry))
            elif isinstance(entry, int) and not isinstance(entry, bool):
                if not -1 <= entry < len(self.names):
                    raise ValueError(f"adapters[{i}] = {entry}: an index in [-1, {len(self.names)})")
                ids.append(entry)
            else:
                raise TypeError(f"adapters[{i}] must be a name, an index or None, got {type(entry).__name__}")
        return ids

    def check_runnable(self) -> None:
        """Raises where selected adapters would not run: the set is no longer on the model, or its experts
        run on another backend than fmoe2's (which would ignore them)."""
        if any(getattr(getattr(m, ADAPTERS_ATTRIBUTE, None), "selection", None) is not self.selection
               for m in self.modules):
            raise ValueError("these adapters are no longer on the model (unloaded, or replaced by a later "
                             "load_adapters): selecting them would run the model without them")
        for implementation in {getattr(getattr(m, "config", None), "_experts_implementation", None)
                               for m in self.modules}:
            if implementation not in REGISTERED_NAMES:
                raise ValueError(f"the model's experts run on {implementation!r}, which ignores fmoe2's adapters: "
                                 "run it with experts_implementation='fmoe2' "
                                 "(model.set_experts_implementation('fmoe2'))")

    @contextlib.contextmanager
    def use(self, adapters: Sequence[SequenceAdapter]) -> Iterator[None]:
        """Runs the model's forwards inside the block with adapter ``adapters[b]`` for sequence ``b`` of
        the batch (``model(...)`` and ``model.generate(...)`` alike; a forward of another batch size
        raises); outside it, the base model."""
        ids = self.adapter_indices(adapters)
        self.check_runnable()
        selection = self.selection
        previous = selection.indices, selection.names, selection._token_ids, selection._token_names
        # A batch of base sequences only runs no LoRA work at all.
        selected = max(ids) >= 0
        selection.indices = ids if selected else None
        selection.names = [self.names[i] if i >= 0 else PEFT_BASE for i in ids] if selected else None
        selection._token_ids, selection._token_names = {}, {}
        try:
            yield
        finally:
            selection.indices, selection.names, selection._token_ids, selection._token_names = previous

    def unload(self) -> None:
        """Removes the adapters from the model: the experts modules' factors, the hooks, and PEFT's layers
        of other modules (each replaced by the layer it wrapped)."""
        for module in self.modules:
            if getattr(getattr(module, ADAPTERS_ATTRIBUTE, None), "selection", None) is self.selection:
                delattr(module, ADAPTERS_ATTRIBUTE)
        for hook in self.hooks:
            hook.remove()
        wrapped = {id(layer) for layer in self.peft_layers}
        for name, module in list(self.model.named_modules()):
            if id(module) in wrapped:
                parent_name, _, child = name.rpartition(".")
                setattr(self.model.get_submodule(parent_name) if parent_name else self.model, child,
                        module.get_base_layer())
        peft_config = getattr(self.model, "peft_config", None)
        if self.peft_layers and isinstance(peft_config, dict):
            for name in self.names:
                peft_config.pop(name, None)
            if not peft_config and not self.had_peft_config:
                del self.model.peft_config
        self.peft_layers, self.hooks = [], []
        if getattr(self.model, LOADED_ATTRIBUTE, None) is self:
            delattr(self.model, LOADED_ATTRIBUTE)


def _batch_size(args, kwargs) -> Optional[int]:
    """The batch size of a transformers model's forward call (``input_ids`` or ``inputs_embeds``)."""
    for value in (kwargs.get("input_ids"), kwargs.get("inputs_embeds"), args[0] if args else None):
        if isinstance(value, torch.Tensor) and value.dim() >= 2:
            return value.shape[0]
    return None


def load_adapters(model: torch.nn.Module, adapters: Mapping[str, AdapterSource]) -> LoadedAdapters:
    """Loads PEFT adapters of a transformers MoE model's experts into fmoe2's LoRA form, unmerged.

    ``adapters``: name -> a folder saved by PEFT (``save_pretrained``) or a ``(state_dict, LoraConfig)``
    pair (``get_peft_model_state_dict(peft_model, adapter_name=n)``, ``peft_model.peft_config[n]``), at
    most 16, ranks up to 64; ``model``: the base model (not a ``PeftModel``), run with
    ``experts_implementation="fmoe2"``. Each experts module gets the stacked, prepared factors of every
    adapter; the parts of other modules become PEFT's own layers (module docstring). A later call
    replaces the set. Select adapters per sequence with :meth:`LoadedAdapters.use`. Every key of every
    adapter must be read, and its shapes must match the model: otherwise ``ValueError`` before the model
    changes.
    """
    if not isinstance(adapters, Mapping) or not adapters:
        raise TypeError("adapters must be a non-empty mapping of adapter names to PEFT adapter folders or "
                        "(state_dict, LoraConfig) pairs")
    if len(adapters) > MAX_LORAS:
        raise ValueError(f"{len(adapters)} adapters; fmoe2's LoRA kernels take at most {MAX_LORAS} at once")
    modules = experts_modules(model)
    if not modules:
        raise ValueError("the model has no experts module with 3-D gate_up_proj and down_proj parameters")
    for name in adapters:
        if not isinstance(name, str) or not name or "." in name or name == PEFT_BASE:
            raise ValueError(f"adapter name {name!r}: a non-empty string without dots, not {PEFT_BASE!r}")
    previous = getattr(model, LOADED_ATTRIBUTE, None)
    foreign = [n for n, m in model.named_modules() if type(m).__module__.startswith("peft.")
               and (previous is None or all(m is not layer for layer in previous.peft_layers))]
    if foreign:
        raise ValueError(f"{foreign[0]} is a PEFT layer fmoe2 did not load: pass the base model without PEFT's "
                         "layers (fmoe2 loads the adapters' parts of other modules itself)")
    read = {name: read_adapter(source, name) for name, source in adapters.items()}
    per_module = []
    for module_name, module in modules:
        per_adapter = [(config, module_lora_factors(module, module_name, config, factors, name))
                       for name, (config, factors) in read.items()]
        per_module.append((module, per_adapter))
    for name, (config, factors) in read.items():  # what is left: factors of other modules' PEFT layers
        check_module_factors(model, name, config, factors)
    loras = [prepare_lora(stack_adapters(module, per_adapter)) for module, per_adapter in per_module]
    # The model changes from here on.
    if previous is not None:
        previous.unload()
    selection = AdapterSelection()
    for (module, _), lora in zip(per_module, loras):
        setattr(module, ADAPTERS_ATTRIBUTE, ExpertsAdapters(lora, selection))
    loaded = LoadedAdapters(model, list(adapters), [m for m, _ in per_module], selection,
                            had_peft_config=hasattr(model, "peft_config"))
    setattr(model, LOADED_ATTRIBUTE, loaded)

    def check_call(module, args, kwargs):
        if selection.indices is None:
            return None
        loaded.check_runnable()
        batch = _batch_size(args, kwargs)
        if batch is not None and batch != len(selection.indices):
            raise ValueError(f"a batch of {batch} sequences with {len(selection.indices)} adapters selected: "
                             "select one adapter per sequence (LoadedAdapters.use)")
        return None

    loaded.hooks.append(model.register_forward_pre_hook(check_call, with_kwargs=True))
    with_modules = {name: (config, factors) for name, (config, factors) in read.items() if factors}
    if with_modules:
        try:
            loaded.peft_layers = inject_peft_layers(model, with_modules, selection, loaded.hooks)
        except Exception:
            loaded.peft_layers = [m for m in model.modules()
                                  if type(m).__module__.startswith("peft.") and hasattr(m, "get_base_layer")]
            loaded.unload()
            raise
    return loaded


def check_module_factors(model: torch.nn.Module, name: str, config: AdapterConfig,
                         factors: Mapping[str, torch.Tensor]) -> None:
    """Checks that an adapter's keys other than its experts' are LoRA factors (``A [r, in]``, ``B [out,
    r]``) of the model's linear layers that its ``target_modules`` names, and that every such layer has
    both (PEFT's layers will compute them)."""
    if not factors:
        return
    if not config.targets_modules:
        raise ValueError(f"adapter {name!r}: {len(factors)} keys match no experts module of the model, e.g. "
                         f"{sorted(factors)[:3]}")
    targets = config.fields.get("target_modules")
    linears = {}
    for path, module in model.named_modules():
        linear = module if isinstance(module, torch.nn.Linear) else getattr(module, "base_layer", None)
        if not isinstance(linear, torch.nn.Linear) or not path:
            continue
        if isinstance(targets, str):
            hit = re.fullmatch(targets, path) is not None
        else:
            hit = any(_targets(path, t) for t in targets)
        if hit:
            linears[path] = linear
    expected = {}
    for path, linear in linears.items():
        expected[f"{path}.lora_A.weight"] = (config.rank, linear.in_features)
        expected[f"{path}.lora_B.weight"] = (linear.out_features, config.rank)
    for key in sorted(factors):
        if key not in expected:
            raise ValueError(f"adapter {name!r}: {key} is not a LoRA factor of a linear layer of the model that its "
                             f"target_modules {targets!r} names")
        if tuple(factors[key].shape) != expected[key]:
            raise ValueError(f"adapter {name!r}: {key} has shape {tuple(factors[key].shape)}, not "
                             f"{list(expected[key])} (r={config.rank})")
    missing = sorted(set(expected) - set(factors))
    if missing:
        raise ValueError(f"adapter {name!r}: no {missing[0]} (its target_modules {targets!r} name that layer)")


def inject_peft_layers(model: torch.nn.Module, adapters: Mapping[str, Tuple[AdapterConfig, Dict[str, torch.Tensor]]],
                       selection: AdapterSelection, hooks: list) -> List[torch.nn.Module]:
    """PEFT's own LoRA layers for the modules besides the experts that ``adapters`` target, injected into the
    model (``inject_adapter_in_model``) with their factors, no adapter active; a forward pre-hook on each
    (appended to ``hooks``) passes the selection's ``adapter_names`` (PEFT's mixed-batch forward). Returns
    the layers."""
    from peft import LoraConfig, inject_adapter_in_model, set_peft_model_state_dict
    from peft.tuners.lora.layer import LoraLayer

    init_fields = {f.name for f in dataclasses.fields(LoraConfig) if f.init}
    for name, (config, factors) in adapters.items():
        fields = {k: v for k, v in config.fields.items() if k in init_fields}
        fields.update(target_parameters=None, init_lora_weights=False, inference_mode=True)
        with warnings.catch_warnings():  # a second adapter: PEFT warns that the model has a peft_config already
            warnings.filterwarnings("ignore", message="Already found a `peft_config`")
            inject_adapter_in_model(LoraConfig(**fields), model, adapter_name=name)
        result = set_peft_model_state_dict(model, dict(factors), adapter_name=name)
        missing = [k for k in result.missing_keys if f".{name}." in k and ".lora_" in k]
        if result.unexpected_keys or missing:
            raise ValueError(f"adapter {name!r}: PEFT's layers did not take its factors (unexpected "
                             f"{result.unexpected_keys[:3]}, missing {missing[:3]})")
    layers = [m for m in model.modules() if isinstance(m, LoraLayer) and any(n in m.lora_A for n in adapters)]

    def pass_selection(module, args, kwargs):
        if selection.names is None:
            return None
        x = args[0] if args else next(iter(kwargs.values()))
        return args, {**kwargs, "adapter_names": selection.row_names(x.shape[0])}

    for layer in layers:
        layer.set_adapter([])  # outside LoadedAdapters.use: the base model
        hooks.append(layer.register_forward_pre_hook(pass_selection, with_kwargs=True))
    return layers


__all__ = ["load_adapters", "LoadedAdapters", "AdapterConfig", "read_adapter", "stack_adapters",
           "module_lora_factors", "experts_modules", "check_module_factors", "inject_peft_layers"]
