"""Public ``fused_moe``, in reading order: the op, argument validation, the plan, the launches.

A call computes its key from what costs no device work (shapes, dtypes, strides and devices of
its tensors, the other arguments, pointer alignment); a key seen before finds its plan
(``plan.py``), whose launches run with this call's pointers. A new key goes through the full
validation, picks and fits the config, lays out the scratch buffers, and runs the launches
through Triton's JIT once (``launches.py`` describes them), which binds them for the next call.
Under ``torch.compile`` the call is the registered op ``torch.ops.fmoe2.fused_moe``
(``fmoe2/ops.py``). Host cost per call and how it was measured: docs/host_cost.md.
"""
from __future__ import annotations

import math
from typing import Optional, Tuple, Union

import torch

from ..determinism import deterministic_enabled, fused_path_under_the_switch
from .._validation import (FLOAT_DTYPES, ID_DTYPES, check_inference_only, check_interpreter_dtype,
                           check_interpreter_fp8_nan, check_out_overlaps, check_same_device, check_tensor, on_device)
from ..launch import PlanCache, direct_launches, run_bound, tracing
from ..activations import ACTIVATION_TABLE, ACTIVATIONS, SWIGLU_ALPHA
from ..target import Target, target_of
from ..formats import check_not_prepare_only, plain_format
from .. import fp8 as _fp8
from ..fp8 import FP8_DTYPES
from .decode import one_launch_allowed
from .config import PATHS, ConfigMode, ConfigProblem, FusedMoEConfig, device_config_name, resolve_config
from .launches import MoEProblem
from .layout import PreparedMoEWeights, checked_weight_scales
from .lora import MoELoRA, PreparedMoELoRA, prepare_lora
from .call import KEYWORDS, MoECall, MoEWeights
from .plan import OUT_SOURCE, MoEPlan, build_plan

PLANS = PlanCache()


def fused_moe(
    hidden_states: torch.Tensor,
    w1: Union[torch.Tensor, PreparedMoEWeights],
    w2: Optional[torch.Tensor],
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    activation: str = "silu",
    out: Optional[torch.Tensor] = None,
    expert_map: Optional[torch.Tensor] = None,
    config: Optional[FusedMoEConfig] = None,
    path: str = "auto",
    lora: Optional[Union[MoELoRA, PreparedMoELoRA]] = None,
    token_lora_ids: Optional[torch.Tensor] = None,
    w1_bias: Optional[torch.Tensor] = None,
    w2_bias: Optional[torch.Tensor] = None,
    gate_up_interleaved: bool = False,
    swiglu_alpha: float = SWIGLU_ALPHA,
    swiglu_limit: Optional[float] = None,
    w1_scale: Optional[torch.Tensor] = None,
    w2_scale: Optional[torch.Tensor] = None,
    block_shape: Optional[Tuple[int, int]] = None,
    deterministic: Optional[bool] = None,
) -> torch.Tensor:
    """MoE forward in two launches and no intermediate buffer (or three, with the two-stage path).

    ``out[t] = sum_k topk_weights[t,k] * (act(x_t Wg_e^T) * (x_t Wu_e^T)) Wd_e^T``, ``e = topk_ids[t,k]``
    (with biases: ``act(x_t Wg_e^T + bg_e, x_t Wu_e^T + bu_e) Wd_e^T + bd_e``).

    Args:
        hidden_states: ``[M, H]`` bf16 or fp16 (fp32 is accepted too, mainly for testing).
        w1: ``[E, 2I, H]`` gate rows then up rows (any strides: a transposed ``[E, H, 2I]`` weight
            passes as ``w.transpose(1, 2)``, read in place), same dtype; or a :class:`PreparedMoEWeights`
            from :func:`fmoe2.prepare_weights` (then ``w2`` must be None).
        w2: ``[E, H, I]`` down weights (any strides), same dtype.
        topk_weights: ``[M, topk]`` float32 (bf16/fp16 accepted) routing weights.
        topk_ids: ``[M, topk]`` int32/int64 expert ids (global ids when ``expert_map`` is given);
            ids outside ``[0, E)`` (after the map) are dropped: they add nothing.
        activation: ``"silu"`` (SwiGLU), ``"gelu"`` (erf GeGLU), ``"gelu_tanh"`` (tanh GeGLU) or
            ``"swiglu_oai"`` (gpt-oss: ``(up + 1) * gate * sigmoid(swiglu_alpha * gate)``).
        out: optional ``[M, H]`` output in the input dtype; it is overwritten.
        expert_map: optional int32 ``[E_global]``, global expert id -> local id or -1; tokens
            routed to other ranks' experts contribute nothing (their rows may stay zero).
        config: optional :class:`FusedMoEConfig` overriding :func:`fmoe2.get_config`.
        path: ``"auto"`` (the config's path: tuned per device, batch and shape), ``"fused"`` (sort +
            one fused kernel, zero workspace) or ``"two_stage"`` (sort + stage 1 writing the
            intermediate + stage 2 down GEMM; workspace sizes in docs/paths.md).
        lora: optional :class:`fmoe2.MoELoRA` adapters (better: :func:`fmoe2.prepare_lora` of
            them, done once; an unprepared one is converted on every call).
        token_lora_ids: int32 ``[M]``, the adapter of each token, ``-1`` (or any id outside
            ``[0, max_loras)``) for none; required with ``lora``.
        w1_bias: optional ``[E, 2I]`` gate/up bias in ``w1``'s row order (plain weights; prepared
            weights carry theirs). w2_bias: optional ``[E, H]`` down bias, added once per routed
            (token, expert) pair and weighted like the rest.
        gate_up_interleaved: plain ``w1``'s rows (and ``w1_bias``) are g0, u0, g1, u1, ... (gpt-oss)
            instead of all gate rows then all up rows.
        swiglu_alpha: swiglu_oai's alpha. swiglu_limit: None, or (silu and swiglu_oai) clamp gate to
            at most it and up to ``[-limit, limit]`` before the activation (gpt-oss: 7.0).
        w1_scale, w2_scale: float32 scales of fp8 ``w1``/``w2`` (``float8_e4m3fn``; ``e4m3fnuz`` on
            gfx942): block-wise ``[E, cdiv(N, bn), cdiv(K, bk)]`` with ``block_shape=(bn, bk)`` (bk a
            multiple of 128; DeepSeek-V3: (128, 128)), per channel ``[E, N]`` or per expert ``[E]``
            (N, K: 2I, H for w1; H, I for w2). Activations are quantized to fp8 inside the kernels
            (per token and group of 128, ``fmoe2/fp8.py``); the output keeps the input dtype.
            Prepared fp8 weights carry their scales. Not with ``lora``.
        deterministic: True: the same bits on every call (eager or CUDA-graph replay), and a token's
            output row the same whatever M is and whichever tokens share the batch: the two-stage
            kernels with a tiling whose bits do not depend on M (``get_config(..., deterministic=True)``;
            a ``config`` passed runs as given on the two-stage path with ``S2_SPLIT_K=1``), stage 2
            storing one row per (token, slot) and a fourth launch summing them in slot order, in
            float32 (no atomics; workspace ``M * topk * H`` elements more; docs/numerics.md). None
            (default): :func:`fmoe2.deterministic_enabled` (``fmoe2.set_deterministic(True)`` or
            ``torch.use_deterministic_algorithms(True)``). ``path="fused"`` is refused with it.

    Returns:
        ``[M, H]`` in the dtype of ``hidden_states`` (``out`` when given).

    Gate/up accumulate in fp32; the activated intermediate, times the routing weight, is rounded to the input
    dtype before the down GEMM. The partial results are added with atomics: into a float32 accumulator cast to
    ``out`` last on the fused path with 16-bit weights, into ``out`` in its dtype elsewhere
    (``FusedMoEConfig.accumulate_fp32``; docs/numerics.md). With fp16, an intermediate value beyond 65504
    becomes inf, which the down GEMM turns into NaN across that token's output row, and an output value beyond
    65504 becomes inf: prefer bf16.
    No host synchronisation and no data-dependent shapes: safe to capture in a CUDA graph.
    Inference only: no autograd. In grad mode an input that requires grad raises a ``ValueError`` (the output
    would carry no gradient); under ``torch.no_grad()`` / ``torch.inference_mode()`` it runs.
    """
    if torch.is_grad_enabled():  # inference-only: refuse inputs that require grad (before the cached plan)
        # (written out, no Python call: this is the whole cost of a grad-mode call whose inputs need no gradient;
        # non-tensors read False here, validation names them)
        prepared = isinstance(w1, PreparedMoEWeights)
        w13, w2_t, b13, b2, s13, s2 = ((w1.w13, w1.w2, w1.b13, w1.b2, w1.s13, w1.s2) if prepared else
                                       (w1, w2, w1_bias, w2_bias, w1_scale, w2_scale))
        if (getattr(hidden_states, "requires_grad", False) or getattr(w13, "requires_grad", False)
                or getattr(w2_t, "requires_grad", False) or getattr(topk_weights, "requires_grad", False)
                or getattr(b13, "requires_grad", False) or getattr(b2, "requires_grad", False)
                or getattr(s13, "requires_grad", False) or getattr(s2, "requires_grad", False)
                or (lora is not None and (type(lora) is not PreparedMoELoRA or lora.a13.requires_grad
                                          or lora.b13.requires_grad or lora.a2.requires_grad
                                          or lora.b2.requires_grad or lora.scaling.requires_grad))):
            check_no_grad_args(hidden_states, w1, w2, topk_weights, w1_bias, w2_bias, lora, w1_scale, w2_scale)
    if deterministic is None:
        deterministic = deterministic_enabled()
        if deterministic and path == "fused":
            deterministic = fused_path_under_the_switch()
    if tracing():  # the registered op, its arguments packed as plain values (Dynamo builds no MoECall)
        from .op_call import fused_moe_op_call

        return fused_moe_op_call(dict(zip(KEYWORDS, (
            hidden_states, w1, w2, topk_weights, topk_ids, activation, out, expert_map, config, path, lora,
            token_lora_ids, w1_bias, w2_bias, gate_up_interleaved, swiglu_alpha, swiglu_limit, w1_scale, w2_scale,
            block_shape, deterministic))))
    call = call_key(hidden_states, w1, w2, topk_weights, topk_ids, activation, out, expert_map, config, path,
                    lora, token_lora_ids, w1_bias, w2_bias, gate_up_interleaved, swiglu_alpha, swiglu_limit,
                    w1_scale, w2_scale, block_shape, deterministic)
    plan = PLANS.get(call[0]) if call is not None else None
    if (plan is not None and plan.launches is not None and direct_launches()
            and not (plan.decode_pending and one_launch_allowed())):
        sources = call[1]
        if out is None:
            out = torch.empty_like(hidden_states)  # contiguous, as the key says hidden_states is
            sources[OUT_SOURCE] = out.data_ptr()
        else:
            plan.check_out_overlap(sources)
        alone = plan.alone
        if alone is not None and not one_launch_allowed():
            alone = None
        run_bound(plan.launches, sources, plan.scratch_bytes, plan.scratch_offsets, plan.device, alone)
        return out
    # Not cached (or not bindable): from here on the call is one description (call.py).
    described = MoECall.bind(hidden_states, w1, w2, topk_weights, topk_ids, activation, out, expert_map, config, path,
                             lora, token_lora_ids, w1_bias, w2_bias, gate_up_interleaved, swiglu_alpha, swiglu_limit,
                             w1_scale, w2_scale, block_shape, deterministic)
    return run_checked(described, call[0] if call is not None else None, plan)


# ---------------------------------------------------------------------------------------------
# Validation
# ---------------------------------------------------------------------------------------------

def check_no_grad_args(hidden_states, w1, w2, topk_weights, w1_bias=None, w2_bias=None, lora=None, w1_scale=None,
                       w2_scale=None):
    """In grad mode: refuses tensor arguments that require grad (fmoe2 is inference-only), naming the first
    (:func:`fused_moe` calls it when one may)."""
    named = {"hidden_states": hidden_states}
    if isinstance(w1, PreparedMoEWeights):
        named.update((f"w1.{n}", getattr(w1, n, None)) for n in ("w13", "w2", "b13", "b2", "s13", "s2"))
    else:
        named["w1"] = w1
    named.update(w2=w2, topk_weights=topk_weights, w1_bias=w1_bias, w2_bias=w2_bias, w1_scale=w1_scale,
                 w2_scale=w2_scale)
    if lora is not None:
        named.update((f"lora.{n}", v) for n, v in getattr(lora, "__dict__", {}).items())
    check_inference_only(**named)


def check_lora_args(lora, token_lora_ids, M, E, H, inter, dtype):
    """Checks the LoRA arguments of :func:`fused_moe`; returns ``lora`` (or None)."""
    if lora is None and token_lora_ids is None:
        return None
    if lora is None or token_lora_ids is None:
        missing = "lora" if lora is None else "token_lora_ids"
        raise ValueError(f"lora and token_lora_ids go together: {missing} is None")
    if not isinstance(lora, (MoELoRA, PreparedMoELoRA)):
        raise TypeError(f"lora must be a fmoe2.MoELoRA or PreparedMoELoRA, got {type(lora).__name__}")
    if lora.dtype != dtype:
        raise TypeError(f"lora weights have dtype {lora.dtype} but hidden_states has {dtype}")
    if (lora.num_experts, lora.hidden_size, lora.intermediate_size) != (E, H, inter):
        raise ValueError(f"lora is for E={lora.num_experts}, H={lora.hidden_size}, I={lora.intermediate_size} "
                         f"but the base weights have E={E}, H={H}, I={inter}")
    check_tensor("token_lora_ids", token_lora_ids, dtypes=(torch.int32,), shape=(M,),
                 shape_doc=f"[M] = [{M}] (adapter per token, -1 for none)")
    if lora.device != token_lora_ids.device:
        raise ValueError(f"lora is on {lora.device} but token_lora_ids is on {token_lora_ids.device}")
    return lora


def check_activation_args(activation, swiglu_alpha, swiglu_limit):
    """``(swiglu_alpha, swiglu_limit)`` as the kernels take them: floats, the alpha normalised where the
    activation does not read it; raises for bad values."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    for name, value in (("swiglu_alpha", swiglu_alpha), ("swiglu_limit", swiglu_limit)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise TypeError(f"{name} must be a float{' or None' if name == 'swiglu_limit' else ''}, got "
                            f"{type(value).__name__}")
    if swiglu_alpha is None or not math.isfinite(swiglu_alpha):
        raise ValueError(f"swiglu_alpha must be a finite float, got {swiglu_alpha!r}")
    if swiglu_limit is not None:
        if not ACTIVATION_TABLE[activation].takes_limit:
            takers = " and ".join(a.name for a in ACTIVATION_TABLE.values() if a.takes_limit)
            raise ValueError(f"swiglu_limit clamps {takers} only, not activation={activation!r}")
        if not swiglu_limit > 0 or not math.isfinite(swiglu_limit):
            raise ValueError(f"swiglu_limit must be a positive finite float or None, got {swiglu_limit!r}")
        swiglu_limit = float(swiglu_limit)
    return (float(swiglu_alpha) if ACTIVATION_TABLE[activation].reads_alpha else SWIGLU_ALPHA), swiglu_limit


def check_bias_args(w1_bias, w2_bias, E, H, inter, dtype, prepared):
    """Checks ``w1_bias [E, 2I]`` and ``w2_bias [E, H]`` (None: no bias)."""
    if prepared and (w1_bias is not None or w2_bias is not None):
        raise ValueError("w1_bias/w2_bias go with plain weights; prepared weights carry their biases "
                         "(fmoe2.prepare_weights(w1, w2, w1_bias=..., w2_bias=...))")
    if w1_bias is not None:
        check_tensor("w1_bias", w1_bias, dtypes=(dtype,), shape=(E, 2 * inter),
                     shape_doc=f"[E, 2I] = [{E}, {2 * inter}] in w1's row order")
    if w2_bias is not None:
        check_tensor("w2_bias", w2_bias, dtypes=(dtype,), shape=(E, H), shape_doc=f"[E, H] = [{E}, {H}]")


def check_fused_moe_args(*args, **keywords) -> MoEProblem:
    """Validates every argument of :func:`fused_moe` (given as to it) on the host; raises TypeError/ValueError."""
    return check_call(MoECall.bind(*args, **keywords))


def check_weights(weights: MoEWeights, H: int, dtype: torch.dtype):
    """Checks the weights bundle against ``hidden_states [M, H]`` of ``dtype``; returns ``(w1, w2, interleaved,
    E, I, w1_bias, w2_bias, w1_scale, w2_scale, scale_block, weight_format)`` as the kernels read them (prepared
    weights' own tensors, scale views; the format's name in ``fmoe2.formats.WEIGHT_FORMATS``)."""
    w1, w2, w1_bias, w2_bias = weights.w1, weights.w2, weights.w1_bias, weights.w2_bias
    w1_scale, w2_scale, block_shape = weights.w1_scale, weights.w2_scale, weights.block_shape
    gate_up_interleaved = weights.gate_up_interleaved
    if not isinstance(gate_up_interleaved, bool):  # ("no" is truthy: it read as True)
        raise TypeError(f"gate_up_interleaved must be a bool (True: w1's rows are g0, u0, g1, u1, ...), got "
                        f"{gate_up_interleaved!r}")
    if isinstance(w1, PreparedMoEWeights):
        if w2 is not None:
            raise ValueError("w2 must be None when w1 is a PreparedMoEWeights (it already holds the down weights)")
        if w1_scale is not None or w2_scale is not None or block_shape is not None:
            raise ValueError("w1_scale/w2_scale/block_shape go with plain fp8 weights; prepared weights carry their "
                             "scales (fmoe2.prepare_weights(w1, w2, w1_scale=..., w2_scale=..., block_shape=...))")
        check_interpreter_dtype("w1", w1.dtype)
        if w1.dtype != dtype and not (w1.fp8 or w1.packed):
            raise TypeError(f"prepared weights have dtype {w1.dtype} but hidden_states has {dtype}")
        if w1.hidden_size != H:
            raise ValueError(f"prepared weights have hidden size {w1.hidden_size} but hidden_states has H={H}")
        if gate_up_interleaved:
            raise ValueError("gate_up_interleaved describes plain weights; prepared weights are interleaved already")
        E, inter = w1.num_experts, w1.intermediate_size
        w1_t, w2_t, interleaved = w1.w13, w1.w2, True
        s13, s2, scale_block = w1.s13, w1.s2, w1.scale_block
        check_tensor("w1.w13", w1_t, ndim=3, dtypes=(w1.dtype,), shape_doc="[E, 2*I_pad, H_pad]")
        check_tensor("w1.w2", w2_t, ndim=3, dtypes=(w1.dtype,), shape_doc="[E, H_pad, I_pad]")
        if (s13 is not None) != (w1.fp8 or w1.packed) or (s2 is None) != (s13 is None):
            raise ValueError(f"prepared weights of dtype {w1.dtype} {'must not have' if s13 is not None else 'lack'} "
                             f"scales (prepare fp8 and 4-bit weights with their w1_scale/w2_scale)")
        per_byte = w1.format.values_per_element  # (4-bit weights: two K columns per byte)
        if (w1_t.shape[1] % 2 or w1_t.shape[1] < 2 * inter or per_byte * w1_t.shape[2] < H or w2_t.shape[0] != E
                or w2_t.shape[1] < H or per_byte * w2_t.shape[2] < inter):
            raise ValueError(f"prepared weights are inconsistent with H={H}, I={inter}, E={E}: w13 "
                             f"{tuple(w1_t.shape)} must be [E, 2*I_pad, H_pad{' // 2' * (per_byte > 1)}] and w2 "
                             f"{tuple(w2_t.shape)} [E, H_pad, I_pad{' // 2' * (per_byte > 1)}] with I_pad >= I and "
                             f"H_pad >= H")
        if w1.packed:
            check_packed_scales(w1, E)
        check_bias_args(w1_bias, w2_bias, E, H, inter, dtype, prepared=True)
        for name, bias, shape in (("w1.b13", w1.b13, (E, w1_t.shape[1])), ("w1.b2", w1.b2, (E, w2_t.shape[1]))):
            if bias is not None:
                # (4-bit weights' biases: any float dtype, added in float32; gpt-oss keeps float32 ones)
                check_tensor(name, bias, dtypes=FLOAT_DTYPES if w1.packed else (dtype,), shape=shape,
                             shape_doc=f"{list(shape)} (padded like the weights)")
        w1_bias, w2_bias = w1.b13, w1.b2
        weight_format = w1.weight_format
    else:
        # Any strides: transposed layouts (transformers' gpt-oss stores [E, H, 2I]) are read in place.
        check_not_prepare_only("w1", w1)
        check_tensor("w1", w1, ndim=3, dtypes=FLOAT_DTYPES + FP8_DTYPES, shape_doc="[E, 2I, H]", contiguous=False)
        check_interpreter_dtype("w1", w1.dtype)
        if w1.dtype != dtype and w1.dtype not in FP8_DTYPES:
            raise TypeError(f"w1 must have the dtype of hidden_states ({dtype}) or an fp8 dtype {FP8_DTYPES}, got "
                            f"{w1.dtype}")
        E, two_i, w1_h = w1.shape
        if two_i % 2 or w1_h != H:
            raise ValueError(f"w1 must have shape [E, 2I, H] with H={H} (gate rows then up rows, or interleaved "
                             f"with gate_up_interleaved=True), got {tuple(w1.shape)}")
        inter = two_i // 2
        check_tensor("w2", w2, dtypes=(w1.dtype,), shape=(E, H, inter), shape_doc=f"[E, H, I] = [{E}, {H}, {inter}]",
                     contiguous=False)
        s13, s2, scale_block = checked_weight_scales(w1, w2, w1_scale, w2_scale, block_shape, gate_up_interleaved)
        check_bias_args(w1_bias, w2_bias, E, H, inter, dtype, prepared=False)
        w1_t, w2_t, interleaved = w1, w2, bool(gate_up_interleaved)
        weight_format = plain_format(w1).name
    if E < 1 or inter < 1 or H < 1:
        raise ValueError(f"w1 must have E >= 1 experts and H, I >= 1, got E={E}, H={H}, I={inter}")
    for name, w in (("w1", w1_t), ("w2", w2_t)):
        check_interpreter_fp8_nan(name, w)
    return w1_t, w2_t, interleaved, E, inter, w1_bias, w2_bias, s13, s2, scale_block, weight_format


def check_packed_scales(w1: PreparedMoEWeights, E: int) -> None:
    """Checks the group scales of prepared weight-only quantized weights (mxfp4, int4, int8) against their weights,
    as the weights' format (``fmoe2/formats.py``) lays them out."""
    fmt, group = w1.format, w1.group_size
    fmt.check_group(group, "prepared weights")
    for name, w, scale in (("w1.s13", w1.w13, w1.s13), ("w1.s2", w1.w2, w1.s2)):
        k_pad = fmt.values_per_element * w.shape[2]
        if k_pad % group:
            raise ValueError(f"prepared {fmt.name} weights' rows ({k_pad} columns) must hold whole groups of "
                             f"{group} (fmoe2.prepare_weights pads them so)")
        shape = (E, w.shape[1], k_pad // group) + fmt.scale_tail
        # (contiguous like the weights: the kernels derive the scales' strides from theirs)
        check_tensor(name, scale, dtypes=fmt.scale_dtypes, shape=shape,
                     shape_doc=f"{list(shape)} ({fmt.scale_doc} of the weights' groups of {group})")


def check_call(call: MoECall) -> MoEProblem:
    """Validates every argument of one call of :func:`fused_moe` on the host; raises TypeError/ValueError."""
    hidden_states, routing, act, options = call.hidden_states, call.routing, call.activation, call.options
    topk_weights, topk_ids, expert_map = routing.topk_weights, routing.topk_ids, routing.expert_map
    out, config, path, deterministic = options.out, options.config, options.path, options.deterministic
    check_tensor("hidden_states", hidden_states, ndim=2, dtypes=FLOAT_DTYPES, shape_doc="[M, H]")
    M, H = hidden_states.shape
    dtype = hidden_states.dtype
    check_interpreter_dtype("hidden_states", dtype)  # (bf16 math is wrong under Triton's interpreter)
    (w1_t, w2_t, interleaved, E, inter, w1_bias, w2_bias, s13, s2, scale_block,
     weight_format) = check_weights(call.weights, H, dtype)
    check_tensor("topk_ids", topk_ids, ndim=2, dtypes=ID_DTYPES, shape_doc=f"[M, topk] with M={M}")
    if topk_ids.shape[0] != M or topk_ids.shape[1] < 1:
        raise ValueError(f"topk_ids must have shape [M, topk] with M={M} and topk >= 1, got {tuple(topk_ids.shape)}")
    topk = topk_ids.shape[1]
    check_tensor("topk_weights", topk_weights, dtypes=FLOAT_DTYPES, shape=(M, topk),
                 shape_doc=f"[M, topk] = [{M}, {topk}] like topk_ids")
    swiglu_alpha, swiglu_limit = check_activation_args(act.activation, act.swiglu_alpha, act.swiglu_limit)
    if expert_map is not None:
        check_tensor("expert_map", expert_map, ndim=1, dtypes=(torch.int32,), shape_doc="[num_global_experts]")
        if expert_map.numel() < 1:
            raise ValueError("expert_map must have at least one entry")
    if out is not None:
        check_tensor("out", out, dtypes=(dtype,), shape=(M, H), shape_doc=f"[M, H] = [{M}, {H}]")
        check_out_overlaps(out, hidden_states=hidden_states, w1=w1_t, w2=w2_t, topk_weights=topk_weights,
                           topk_ids=topk_ids, expert_map=expert_map, w1_bias=w1_bias, w2_bias=w2_bias)
    if path not in ("auto",) + PATHS:
        raise ValueError(f"path must be one of {('auto',) + PATHS}, got {path!r}")
    if not isinstance(deterministic, bool):
        raise TypeError(f"deterministic must be a bool or None, got {type(deterministic).__name__}")
    if deterministic and path == "fused":
        raise ValueError("deterministic=True runs the two-stage kernels (the fused kernel adds its partial sums "
                         "with atomics, in no fixed order): pass path='auto' or 'two_stage'")
    if config is not None and not isinstance(config, FusedMoEConfig):
        raise TypeError(f"config must be a fmoe2.FusedMoEConfig or None, got {type(config).__name__}")
    token_lora_ids = call.adapters.token_lora_ids
    lora = check_lora_args(call.adapters.lora, token_lora_ids, M, E, H, inter, dtype)
    check_same_device("hidden_states", hidden_states, w1=w1_t, w2=w2_t, topk_weights=topk_weights,
                      topk_ids=topk_ids, expert_map=expert_map, out=out, token_lora_ids=token_lora_ids,
                      w1_bias=w1_bias, w2_bias=w2_bias, w1_scale=s13, w2_scale=s2)
    if w1_t.dtype in FP8_DTYPES:
        if lora is not None:
            raise ValueError("lora with fp8 base weights is not supported yet: pass 16-bit weights with lora")
        supported = target_of(hidden_states.device).fp8_dtypes
        if w1_t.dtype not in supported:
            raise ValueError(f"fp8 weights of dtype {w1_t.dtype} need a GPU whose matrix instructions take them "
                             f"(CUDA sm_89 or newer and gfx950: float8_e4m3fn; gfx942: float8_e4m3fnuz); this "
                             f"device takes {supported or 'none'}"
                             + ("; fmoe2.prepare_weights converts e4m3fn weights to e4m3fnuz" if
                                supported == (torch.float8_e4m3fnuz,) else ""))
    # Every check has passed: only now convert unprepared adapters (allocates).
    prepared_lora = prepare_lora(lora) if lora is not None else None
    if out is not None and prepared_lora is not None:
        check_out_overlaps(out, token_lora_ids=token_lora_ids, **prepared_lora.tensors())
    routed = expert_map.numel() if expert_map is not None and expert_map.numel() > E else None
    return MoEProblem(hidden_states, w1_t, w2_t, interleaved, E, H, inter, topk, prepared_lora, token_lora_ids,
                      w1_bias, w2_bias, swiglu_alpha, swiglu_limit, s13, s2, scale_block, deterministic, routed,
                      weight_format)


# ---------------------------------------------------------------------------------------------
# The plan
# ---------------------------------------------------------------------------------------------

def _tensor_key(t: torch.Tensor) -> tuple:
    return t.shape, t.dtype, t.stride(), t.get_device()


def call_key(hidden_states, w1, w2, topk_weights, topk_ids, activation, out, expert_map, config, path, lora,
             token_lora_ids, w1_bias=None, w2_bias=None, gate_up_interleaved=False, swiglu_alpha=SWIGLU_ALPHA,
             swiglu_limit=None, w1_scale=None, w2_scale=None, block_shape=None, deterministic=False):
    """``(key, device addresses)`` of a call: the key holds everything the plan depends on and that
    validation checks (shapes, dtypes, strides, devices, which optional tensors are given, the
    other arguments, whether every pointer is 16-byte aligned); the addresses are the call's
    :data:`~fmoe2.gemm.call.INPUT_SOURCES` (``out``: 0 when not given). None for arguments the
    key does not cover (not tensors, unprepared adapters): the call then takes the checked path,
    which raises the right error or runs it."""
    if (type(activation) is not str or type(path) is not str or type(gate_up_interleaved) is not bool
            or type(swiglu_alpha) not in (float, int) or (swiglu_limit is not None and type(swiglu_limit) not in
                                                          (float, int))
            or (config is not None and type(config) is not FusedMoEConfig) or type(deterministic) is not bool):
        return None
    try:
        if type(w1) is PreparedMoEWeights:
            if (w2 is not None or w1_bias is not None or w2_bias is not None or w1_scale is not None
                    or w2_scale is not None or block_shape is not None):
                return None  # (validation names the argument)
            w1t, w2t = w1.w13, w1.w2
            weights = (w1.hidden_size, w1.intermediate_size, w1.scale_block)
            w1_bias, w2_bias = w1.b13, w1.b2  # the prepared weights' own biases
            w1_scale, w2_scale = w1.s13, w1.s2
        else:
            w1t, w2t = w1, w2
            weights = None if block_shape is None else tuple(block_shape)
        x, tw, ti = hidden_states, topk_weights, topk_ids
        # (slots in call.INPUT_SOURCES order: tests/gemm/test_call.py)
        sources = [x.data_ptr(), tw.data_ptr(), ti.data_ptr(), w1t.data_ptr(), w2t.data_ptr(), 0, 0, 0, 0, 0, 0, 0, 0,
                   0, 0, 0, 0]
        # (the five pointers' alignment first, at BASE_KEY_ALIGNED, where a field added to the key cannot move it)
        key = ((sources[0] | sources[1] | sources[2] | sources[3] | sources[4]) % 16 == 0,
               activation, path, config, weights, gate_up_interleaved, swiglu_alpha, swiglu_limit, deterministic,
               # (written out: this runs on every call)
               x.shape, x.dtype, x.stride(), x.get_device(), w1t.shape, w1t.dtype, w1t.stride(), w1t.get_device(),
               w2t.shape, w2t.dtype, w2t.stride(), w2t.get_device(), tw.shape, tw.dtype, tw.stride(), tw.get_device(),
               ti.shape, ti.dtype, ti.stride(), ti.get_device(),
               True)  # (the last field: the other pointers' alignment, True without any; extras follow it)
        if out is None and expert_map is None and lora is None and token_lora_ids is None and w1_bias is None \
                and w2_bias is None and w1_scale is None and w2_scale is None:
            return key, sources
        extra = []
        if out is not None:
            extra.extend(_tensor_key(out))
            sources[16] = out.data_ptr()
        else:
            extra.append(None)
        if expert_map is not None:
            extra.extend(_tensor_key(expert_map))
            sources[5] = expert_map.data_ptr()
        else:
            extra.append(None)
        if lora is not None or token_lora_ids is not None:
            if type(lora) is not PreparedMoELoRA or token_lora_ids is None:
                return None
            extra.extend((lora.rank, lora.hidden_size, lora.intermediate_size, *_tensor_key(token_lora_ids)))
            sources[15] = token_lora_ids.data_ptr()
            for i, t in enumerate((lora.a13, lora.b13, lora.a2, lora.b2, lora.scaling)):
                extra.extend(_tensor_key(t))
                sources[10 + i] = t.data_ptr()
        for i, tensor in ((6, w1_bias), (7, w2_bias), (8, w1_scale), (9, w2_scale)):
            if tensor is not None:
                extra.extend(_tensor_key(tensor))
                sources[i] = tensor.data_ptr()
            else:
                extra.append(None)
        if w1_scale is not None:  # fp8 weights: the per-token switch, off by default (a plan holds its quantization)
            extra.append(_fp8.PER_TOKEN_ACTIVATIONS)
        aligned = 0
        for ptr in sources[5:]:
            aligned |= ptr
        extra.append(aligned % 16 == 0)  # (now the key's last field)
        return key + tuple(extra), sources
    except (AttributeError, TypeError):  # not tensors: validation names the argument
        return None


BASE_KEY_ALIGNED = 0  # where the base key holds the alignment of the five pointers every call has


def key_aligned(key: tuple) -> bool:
    """Whether every pointer of the call of ``key`` is 16-byte aligned (its launches may be bound)."""
    return key[BASE_KEY_ALIGNED] and key[-1]


def clear_plans() -> None:
    """Drops every cached plan (they are rebuilt on the next calls)."""
    PLANS.clear()


def config_problem(problem: MoEProblem) -> Tuple[ConfigProblem, ConfigMode]:
    """What the config resolver reads of a forward's ``problem``: its sizes (and how its weights are laid out) and
    its mode."""
    mode = ConfigMode(lora=problem.lora is not None, fp8=problem.fp8, deterministic=problem.deterministic,
                      weight_format=problem.weight_format)
    w1 = problem.w1  # (N-contiguous, gate/up concatenated 16-bit weights: slices of whole cache lines per K row)
    halves = not problem.gate_up_interleaved and w1.stride(1) == 1 and w1.stride(2) != 1 and w1.dtype == problem.x.dtype
    shape = ConfigProblem(problem.num_tokens, problem.routed_experts or problem.num_experts, problem.hidden_size,
                          problem.intermediate_size, problem.topk, problem.x.dtype, n_contiguous_halves=halves)
    return shape, mode


def pick_config(problem: MoEProblem, config: Optional[FusedMoEConfig], path: str, target: Target) -> FusedMoEConfig:
    """The fitted config a forward of ``problem`` runs on ``target``: :func:`~fmoe2.gemm.config.resolve_config`'s
    (``config``: the caller's, or None), reading the tuned files of the GPU that holds ``problem``'s tensors."""
    shape, mode = config_problem(problem)
    return resolve_config(shape, mode, target, config, path=path, tuned_for=device_config_name(problem.x.device))


def plan_for(call: MoECall, problem: MoEProblem, out: torch.Tensor, bindable: bool) -> MoEPlan:
    """The plan of the checked ``call`` (``problem``) writing ``out``: its config picked and fitted for the target
    of its device."""
    target = target_of(call.hidden_states.device)
    options, routing = call.options, call.routing
    return build_plan(problem, call.activation.activation, pick_config(problem, options.config, options.path, target),
                      target, routing.topk_weights, routing.topk_ids, out, routing.expert_map, bindable=bindable)


def run_checked(call: MoECall, key=None, plan: Optional[MoEPlan] = None) -> torch.Tensor:
    """A call that validates every argument, then runs its plan through Triton's JIT: the first
    call of a key (which builds, runs and caches the plan), and every call whose launches cannot
    be bound (``MoEPlan.direct``)."""
    problem = check_call(call)
    hidden_states, routing, options = call.hidden_states, call.routing, call.options
    out = options.out if options.out is not None else torch.empty_like(hidden_states)
    if problem.num_tokens == 0:
        return out
    if plan is None:
        plan = plan_for(call, problem, out, bindable=key is not None and key_aligned(key))
        with on_device(hidden_states):
            plan.run_jit(problem, routing.topk_weights, routing.topk_ids, out, routing.expert_map)
        if key is not None:
            PLANS.put(key, plan)
        return out
    with on_device(hidden_states):
        plan.run_jit(problem, routing.topk_weights, routing.topk_ids, out, routing.expert_map)
    return out


def plan_of(*args, **keywords) -> Optional[MoEPlan]:
    """The cached plan a call of ``fused_moe(*args, **keywords)`` runs (None before its first run)."""
    key = call_key(**MoECall.bind(*args, **keywords).arguments())
    return PLANS.get(key[0]) if key is not None else None


# ---------------------------------------------------------------------------------------------
# The launches (each launch's description: launches.py; running them: plan.py)
# ---------------------------------------------------------------------------------------------

def forward_launches(*args, **keywords):
    """The launches of one forward of ``fused_moe(*args, **keywords)`` as ``(name, launch)`` pairs, on one
    scratch block kept for all of them (the benchmark times each alone; tests run them one by one). Launched
    through Triton's JIT."""
    call = MoECall.bind(*args, **keywords)
    problem = check_call(call)
    hidden_states, routing, options = call.hidden_states, call.routing, call.options
    out = options.out if options.out is not None else torch.empty_like(hidden_states)
    plan = plan_for(call, problem, out, bindable=False)
    block = plan.layout.allocate(hidden_states.device)
    specs = plan.specs(problem, routing.topk_weights, routing.topk_ids, out, routing.expert_map, block)

    def launch(spec):
        def run():
            with on_device(hidden_states):
                return spec.launch()
        run.spec, run.block = spec, block
        return run

    return [(spec.name, launch(spec)) for spec in specs]
