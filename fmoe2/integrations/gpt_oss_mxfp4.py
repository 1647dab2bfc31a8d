"""gpt-oss from its mxfp4 checkpoint with the experts kept in 4 bits, on fmoe2 (no ``kernels`` package).

    from fmoe2.integrations.gpt_oss_mxfp4 import load_gpt_oss_mxfp4
    model = load_gpt_oss_mxfp4("path/to/gpt-oss-20b", device="cuda")   # experts_implementation="fmoe2"

transformers loads a gpt-oss mxfp4 checkpoint in 4 bits only through the ``kernels`` package (OpenAI's
triton_kernels); without it, it dequantizes the experts to bf16 (4x their bytes: gpt-oss-120b's no longer fit one
80 GB GPU). This loader builds the model from its config with every parameter on the meta device (buffers, such as
the rotary frequencies, as the model computes them), reads the checkpoint's tensors one at a time onto ``device``,
and gives each experts module the published ``*_blocks`` / ``*_scales`` (e2m1 values, two per byte, with e8m0
scales per 32) as fmoe2's prepared mxfp4 weights (``fmoe2.prepare_weights(..., weight_format="mxfp4")``: 4.25 bits
per value, gate/up rows interleaved as gpt-oss stores them). The experts then run on the ``"fmoe2"`` backend
(``fmoe2.integrations.transformers``), the rest of the model as transformers runs it.

The experts' weights and biases are held by the module as non-persistent buffers (``fmoe2_w13``, ...; ``.to()``
moves them), not as parameters: ``state_dict`` and ``save_pretrained`` do not include them (save the original
checkpoint instead), and there is no bf16 fallback (a call fmoe2 cannot run, e.g. one that needs gradients, raises
and says why). Expert parallelism is not supported by this loader.
"""
from __future__ import annotations

import contextlib
import json
import os
import threading
from typing import Dict, Iterator, Optional, Tuple, Union

import torch

from ..gemm.layout import PreparedMoEWeights, prepare_weights
from .transformers import (BACKEND_NAME, PREPARED_ATTRIBUTE, PREPARED_BUFFER_PREFIX, PREPARED_FIELDS,
                           prepared_weights_of)

EXPERT_TENSORS = ("gate_up_proj_blocks", "gate_up_proj_scales", "down_proj_blocks", "down_proj_scales")


_BUILD_LOCK = threading.Lock()  # one build at a time: each restores the register_parameter it replaced


@contextlib.contextmanager
def _parameters_on_meta() -> Iterator[None]:
    """Modules this thread builds inside register their parameters on the meta device and their buffers as they
    compute them (other threads' modules are built as usual)."""
    register = torch.nn.Module.register_parameter
    builder = threading.get_ident()

    def register_on_meta(module, name, param):
        if (threading.get_ident() == builder and isinstance(param, torch.nn.Parameter)
                and param.device.type != "meta"):
            param = torch.nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    with _BUILD_LOCK:
        torch.nn.Module.register_parameter = register_on_meta
        try:
            yield
        finally:
            torch.nn.Module.register_parameter = register


def checkpoint_files(path: str) -> list:
    """The ``.safetensors`` files of a checkpoint folder (those its index names, else every one there)."""
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
    else:
        names = sorted(n for n in os.listdir(path) if n.endswith(".safetensors"))
    if not names:
        raise FileNotFoundError(f"no .safetensors files in {path}")
    return [os.path.join(path, n) for n in names]


def _checkpoint_tensors(path: str) -> Iterator[Tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    for file in checkpoint_files(path):
        with safe_open(file, framework="pt", device="cpu") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def _check_gpt_oss(config, what: str) -> None:
    if getattr(config, "model_type", None) != "gpt_oss":
        raise ValueError(f"{what} gpt-oss models (model_type 'gpt_oss'), got model_type "
                         f"{getattr(config, 'model_type', None)!r}")


def _mxfp4_config(config) -> None:
    """Checks that ``config`` is gpt-oss's with mxfp4 experts (a clear error naming what it found otherwise)."""
    _check_gpt_oss(config, "load_gpt_oss_mxfp4 loads")
    quantization = getattr(config, "quantization_config", None)
    method = quantization.get("quant_method") if isinstance(quantization, dict) else getattr(quantization,
                                                                                             "quant_method", None)
    if str(getattr(method, "value", method)) != "mxfp4":
        raise ValueError(f"the checkpoint's config has quantization_config {quantization!r}: load_gpt_oss_mxfp4 "
                         "takes mxfp4 checkpoints (quant_method 'mxfp4'); load others with "
                         "AutoModelForCausalLM.from_pretrained(..., experts_implementation='fmoe2')")


def _experts_modules(model) -> Dict[str, torch.nn.Module]:
    """The model's experts modules (those holding gate_up_proj and down_proj) by qualified name."""
    return {name: m for name, m in model.named_modules()
            if "gate_up_proj" in m._parameters and "down_proj" in m._parameters}


def _prepared_experts(module, tensors: Dict[str, torch.Tensor], name: str) -> PreparedMoEWeights:
    missing = [t for t in EXPERT_TENSORS if t not in tensors]
    if missing:
        raise ValueError(f"the checkpoint lacks {', '.join(f'{name}.{t}' for t in missing)} (mxfp4 experts are "
                         f"stored as {', '.join(EXPERT_TENSORS)})")
    E, H, two_i = module.gate_up_proj.shape  # gpt-oss: [E, H, 2I], the transpose of the blocks' [E, 2I, H]
    expected = {"gate_up_proj_blocks": (E, two_i, H // 32, 16), "gate_up_proj_scales": (E, two_i, H // 32),
                "down_proj_blocks": (E, H, two_i // 2 // 32, 16), "down_proj_scales": (E, H, two_i // 2 // 32)}
    for tensor, shape in expected.items():
        if tuple(tensors[tensor].shape) != shape or tensors[tensor].dtype != torch.uint8:
            raise ValueError(f"{name}.{tensor} has shape {tuple(tensors[tensor].shape)} and dtype "
                             f"{tensors[tensor].dtype}; the config's sizes (E={E}, H={H}, I={two_i // 2}) give "
                             f"{shape} uint8")
    return prepare_weights(tensors["gate_up_proj_blocks"], tensors["down_proj_blocks"], weight_format="mxfp4",
                           w1_scale=tensors["gate_up_proj_scales"], w2_scale=tensors["down_proj_scales"],
                           w1_bias=module.gate_up_proj_bias, w2_bias=module.down_proj_bias,
                           gate_up_interleaved=not getattr(module, "is_concatenated", True))


def load_gpt_oss_mxfp4(path: str, device: Union[str, torch.device, None] = None,
                       dtype: torch.dtype = torch.bfloat16, config=None):
    """A gpt-oss ``*ForCausalLM`` from the mxfp4 checkpoint folder ``path``, its experts in fmoe2's prepared mxfp4
    weights on ``device`` (default: the current CUDA device, else the CPU) and the other parameters in ``dtype``;
    ``experts_implementation="fmoe2"``. ``config``: the model's config (default: read from ``path``)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype must be a floating torch.dtype (the activations'), got {dtype!r}")
    device = torch.device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
    config = config if config is not None else AutoConfig.from_pretrained(path)
    _mxfp4_config(config)
    config = type(config).from_dict({k: v for k, v in config.to_dict().items() if k != "quantization_config"})
    with _parameters_on_meta():
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, experts_implementation=BACKEND_NAME)
    model.eval()
    experts = _experts_modules(model)
    packed: Dict[str, Dict[str, torch.Tensor]] = {name: {} for name in experts}
    for key, tensor in _checkpoint_tensors(path):
        owner, _, leaf = key.rpartition(".")
        if owner in experts and leaf in EXPERT_TENSORS:
            packed[owner][leaf] = tensor.to(device)
        else:
            _load_parameter(model, key, tensor.to(device, dtype if tensor.is_floating_point() else tensor.dtype))
        if owner in packed and _ready(experts[owner], packed[owner]):  # (the device holds one layer's raw blocks)
            _attach_prepared(experts[owner], _prepared_experts(experts[owner], packed.pop(owner), owner))
    _tie_embeddings(model, config)
    for name in packed:  # experts that never got all their tensors
        module = experts[name]
        lacking = [f"{name}.{t}" for t in EXPERT_TENSORS if t not in packed[name]]
        lacking += [f"{name}.{b}" for b in ("gate_up_proj_bias", "down_proj_bias") if module._parameters[b].is_meta]
        raise ValueError(f"the checkpoint lacks {', '.join(lacking)} (mxfp4 experts are stored as "
                         f"{', '.join(EXPERT_TENSORS)} and their biases)")
    still_meta = [n for n, p in model.named_parameters() if p.device.type == "meta"]
    if still_meta:
        raise ValueError(f"the checkpoint lacks {len(still_meta)} parameters of the model, e.g. {still_meta[:3]}")
    for module in model.modules():  # buffers as the model computed them, on the device
        for name, buffer in module._buffers.items():
            if buffer is not None:
                module._buffers[name] = buffer.to(device)
    return model


def _load_parameter(model, key: str, value: torch.Tensor) -> None:
    owner, _, leaf = key.rpartition(".")
    try:
        module = model.get_submodule(owner)
    except AttributeError:
        module = None
    if module is None or leaf not in module._parameters:
        raise ValueError(f"the checkpoint's {key} is no parameter of {type(model).__name__}")
    if tuple(value.shape) != tuple(module._parameters[leaf].shape):
        raise ValueError(f"the checkpoint's {key} has shape {tuple(value.shape)}, the model's "
                         f"{tuple(module._parameters[leaf].shape)}")
    module._parameters[leaf] = torch.nn.Parameter(value, requires_grad=False)


def _ready(module, tensors: Dict[str, torch.Tensor]) -> bool:
    """Whether an experts module has its blocks, scales and (loaded) biases."""
    return (all(t in tensors for t in EXPERT_TENSORS)
            and not any(module._parameters[b].is_meta for b in ("gate_up_proj_bias", "down_proj_bias")))


def _attach_prepared(module, prepared: PreparedMoEWeights) -> None:
    """Gives ``module`` its prepared experts in place of its weight and bias parameters: the prepared tensors become
    its (non-persistent) buffers, so ``module.to(...)`` moves them (the backend rebuilds the prepared weights from
    its buffers: :func:`fmoe2.integrations.transformers.prepared_weights_of`)."""
    for name in ("gate_up_proj", "down_proj", "gate_up_proj_bias", "down_proj_bias"):
        del module._parameters[name]
    for field in PREPARED_FIELDS:
        tensor = getattr(prepared, field)
        if tensor is not None:
            module.register_buffer(PREPARED_BUFFER_PREFIX + field, tensor, persistent=False)
    module.__dict__[PREPARED_ATTRIBUTE] = prepared


def _tie_embeddings(model, config) -> None:
    """With ``tie_word_embeddings``, the one of the input embedding and the output head the checkpoint lacks is the
    other (a checkpoint holding both keeps both, as transformers does)."""
    if not getattr(config, "tie_word_embeddings", False):
        return
    inputs, outputs = model.get_input_embeddings(), model.get_output_embeddings()
    if outputs is None:
        return
    if outputs.weight.is_meta and not inputs.weight.is_meta:
        outputs.weight = inputs.weight
    elif inputs.weight.is_meta and not outputs.weight.is_meta:
        inputs.weight = outputs.weight


MXFP4_QUANTIZATION_CONFIG = {"quant_method": "mxfp4", "modules_to_not_convert": [
    "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}


def save_mxfp4_checkpoint(model, folder: str, dtype: torch.dtype = torch.bfloat16) -> None:
    """Saves a (16- or 32-bit) gpt-oss ``model`` to ``folder`` as the published mxfp4 checkpoints are: each experts
    module's ``gate_up_proj`` / ``down_proj`` quantized (:func:`fmoe2.quant4.quantize_mxfp4`, the blocks of its
    ``[E, N, K]`` rows) as ``*_blocks [E, N, K // 32, 16]`` and ``*_scales [E, N, K // 32]`` uint8, the other
    tensors in ``dtype``, and the config with ``quantization_config`` mxfp4 (one ``model.safetensors``)."""
    from safetensors.torch import save_file

    from ..quant4 import quantize_mxfp4

    _check_gpt_oss(model.config, "save_mxfp4_checkpoint saves")
    experts = _experts_modules(model)
    tensors = {}
    for name, tensor in model.state_dict().items():
        owner, _, leaf = name.rpartition(".")
        if owner in experts and leaf in ("gate_up_proj", "down_proj"):
            rows = tensor.transpose(1, 2) if getattr(experts[owner], "is_transposed", False) else tensor
            packed, scales = quantize_mxfp4(rows.float().contiguous())
            tensors[name + "_blocks"] = packed.reshape(*packed.shape[:2], -1, 16).contiguous().cpu()
            tensors[name + "_scales"] = scales.contiguous().cpu()
        else:
            tensors[name] = tensor.to(dtype).contiguous().cpu()
    os.makedirs(folder, exist_ok=True)
    save_file(tensors, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
    config = type(model.config).from_dict(model.config.to_dict())
    config.quantization_config = dict(MXFP4_QUANTIZATION_CONFIG)
    config.save_pretrained(folder)


def experts_bytes(model) -> Tuple[int, int]:
    """``(bytes, values)`` of the model's prepared mxfp4 experts: weights and scales, and the weight values they
    hold (padding included)."""
    total, values = 0, 0
    for module in model.modules():
        prepared: Optional[PreparedMoEWeights] = prepared_weights_of(module)
        if prepared is not None:
            for t in (prepared.w13, prepared.w2, prepared.s13, prepared.s2):
                total += t.numel() * t.element_size()
            values += 2 * (prepared.w13.numel() + prepared.w2.numel())
    return total, values
