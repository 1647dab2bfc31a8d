"""Pure-torch references for the fmoe2 ops, used by the tests and the benchmark.

They run on any device, take the same arguments as the kernels and favour clarity over speed.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F

from .activations import ACTIVATIONS, SWIGLU_ALPHA  # noqa: F401  (fmoe2.reference.SWIGLU_ALPHA as before)


def gated_activation(gate: torch.Tensor, up: torch.Tensor, activation: str, swiglu_alpha: float = SWIGLU_ALPHA,
                     swiglu_limit: Optional[float] = None) -> torch.Tensor:
    """The gated MLP's activation of the gate and up projections: ``act(gate) * up`` for silu (SwiGLU), gelu
    (erf GeGLU) and gelu_tanh (tanh GeGLU); ``(up + 1) * gate * sigmoid(swiglu_alpha * gate)`` for
    swiglu_oai (gpt-oss). With ``swiglu_limit`` (silu and swiglu_oai) gate is first clamped to at most
    the limit and up to ``[-limit, limit]``."""
    if swiglu_limit is not None:
        gate = gate.clamp(max=swiglu_limit)
        up = up.clamp(-swiglu_limit, swiglu_limit)
    if activation == "silu":
        return F.silu(gate) * up
    if activation == "gelu":
        return F.gelu(gate, approximate="none") * up
    if activation == "gelu_tanh":
        return F.gelu(gate, approximate="tanh") * up
    if activation == "swiglu_oai":
        return (up + 1) * gate * torch.sigmoid(swiglu_alpha * gate)
    raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")


def local_expert_ids(topk_ids: torch.Tensor, num_experts: int, expert_map: Optional[torch.Tensor]) -> torch.Tensor:
    """Maps routing ids to local experts; -1 where the entry is dropped (other rank, or out of range)."""
    ids = topk_ids.long()
    if expert_map is not None:
        in_range = (ids >= 0) & (ids < expert_map.numel())
        ids = torch.where(in_range, expert_map.long()[ids.clamp(0, expert_map.numel() - 1)], -1)
    return torch.where((ids >= 0) & (ids < num_experts), ids, -1)


def moe_sorting_reference(
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    num_experts: int,
    block_m: int,
    *,
    expert_map: Optional[torch.Tensor] = None,
) -> Tuple[Dict[int, List[Tuple[int, float]]], int]:
    """Per local expert, the sorted list of (token, weight) routed to it, and the rows in use.

    This is what :func:`fmoe2.moe_sorting` must hold, independent of tile order. The rows in use
    are ``(kept // block_m + min(num_experts, kept)) * block_m`` for ``kept`` routing entries:
    every expert's padded tiles plus the gap tiles of the layout (see :mod:`fmoe2.sorting.moe_sorting`).
    """
    ids = local_expert_ids(topk_ids, num_experts, expert_map).cpu()
    weights = topk_weights.float().cpu()
    per_expert: Dict[int, List[Tuple[int, float]]] = {e: [] for e in range(num_experts)}
    M, topk = ids.shape
    for t in range(M):
        for k in range(topk):
            e = int(ids[t, k])
            if e >= 0:
                per_expert[e].append((t, float(weights[t, k])))
    num_kept = sum(len(v) for v in per_expert.values())
    return per_expert, (num_kept // block_m + min(num_experts, num_kept)) * block_m


def _plain_weights(w1, w2, w1_bias, w2_bias, gate_up_interleaved, w1_scale=None, w2_scale=None, block_shape=None):
    """``(w1 [E, 2I, H] gate rows then up rows, w2 [E, H, I], w1_bias [E, 2I] gate then up, w2_bias, fp8)`` of
    either weight form; ``fp8``: ``(w1 scale view, w2 scale view, block shape)`` of fp8 weights, else None."""
    from .gemm.layout import PreparedMoEWeights, checked_weight_scales

    if isinstance(w1, PreparedMoEWeights):
        s13, s2, scale_block = (w1.s13, w1.s2, w1.scale_block) if w1.fp8 else (None, None, None)
        w1_bias, w2_bias = w1.unprepare_biases()
        if w1.packed:  # (weight-only formats: dequantized exactly, in float32, one expert at a time)
            return _DequantizedExperts(w1, 0), _DequantizedExperts(w1, 1), w1_bias, w2_bias, None
        w1, w2 = w1.unprepare()
    else:
        s13, s2, scale_block = checked_weight_scales(w1, w2, w1_scale, w2_scale, block_shape, gate_up_interleaved)
        if gate_up_interleaved:  # rows g0, u0, g1, u1, ...
            w1 = torch.cat([w1[:, 0::2], w1[:, 1::2]], dim=1)
            if w1_bias is not None:
                w1_bias = torch.cat([w1_bias[:, 0::2], w1_bias[:, 1::2]], dim=1)
    fp8 = (s13, s2, scale_block) if s13 is not None else None
    return w1, w2, w1_bias, w2_bias, fp8


class _DequantizedExperts:
    """``w1 [E, 2I, H]`` (``which`` 0) or ``w2 [E, H, I]`` (1) of prepared weight-only quantized weights in the plain
    layout, dequantized to float32 one expert at a time when indexed (a whole layer in float32 would not fit:
    DeepSeek-V3's w1 takes 30 GB)."""

    def __init__(self, prepared, which: int):
        self.prepared, self.which = prepared, which
        E, H, inter = prepared.num_experts, prepared.hidden_size, prepared.intermediate_size
        self.shape = (E, 2 * inter, H) if which == 0 else (E, H, inter)

    def __getitem__(self, e: int) -> torch.Tensor:
        return self.prepared.unprepare(slice(e, e + 1), (self.which,))[self.which][0]


def _expert_weight(w, e, fp8, which, compute):
    """Expert ``e`` of ``w`` in ``compute`` dtype, dequantized one expert at a time (a whole fp8 layer in
    float32 would not fit: DeepSeek-V3's w1 takes 30 GB)."""
    if fp8 is None:
        return w[e].to(compute)
    from .fp8 import dequantize_weights

    scale, block = fp8[which], fp8[2]
    return dequantize_weights(w[e:e + 1], scale[e:e + 1], *block)[0].to(compute)


def fused_moe_reference(
    hidden_states: torch.Tensor,
    w1,
    w2: Optional[torch.Tensor],
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    activation: str = "silu",
    out: Optional[torch.Tensor] = None,
    expert_map: Optional[torch.Tensor] = None,
    lora=None,
    token_lora_ids: Optional[torch.Tensor] = None,
    w1_bias: Optional[torch.Tensor] = None,
    w2_bias: Optional[torch.Tensor] = None,
    gate_up_interleaved: bool = False,
    swiglu_alpha: float = SWIGLU_ALPHA,
    swiglu_limit: Optional[float] = None,
    w1_scale: Optional[torch.Tensor] = None,
    w2_scale: Optional[torch.Tensor] = None,
    block_shape: Optional[Tuple[int, int]] = None,
) -> torch.Tensor:
    """``out[t] = sum_k w[t,k] * (act(x_t Wg_e^T + bg_e, x_t Wu_e^T + bu_e) Wd_e^T + bd_e)`` with
    ``e = topk_ids[t,k]`` (``act``: :func:`gated_activation`; biases zero when not given).

    fp8 weights (with ``w1_scale``/``w2_scale``, or prepared): the weights dequantized, and the
    activations quantized as the kernels do (``fmoe2/fp8.py``): ``x`` per token and group of 128
    along H (per token over all of H with per-token activations: ``fp8.x_group``); the intermediate
    after the routing weight, rounded to the input dtype, along I.

    With ``lora`` (:class:`fmoe2.MoELoRA` or its prepared form) and ``token_lora_ids`` ``[M]``,
    a token with adapter ``l`` in ``[0, max_loras)`` adds ``s_l * (v A[l,e]^T) B[l,e]^T`` to each
    of its gate, up and down projections (``v`` = the projection's input).

    Args match :func:`fmoe2.fused_moe` (``w1`` may be a :class:`fmoe2.PreparedMoEWeights`).
    Computes in float32, or float64 when ``hidden_states`` is float64, and returns
    ``[M, H]`` in ``hidden_states.dtype`` (written into ``out`` when given).
    """
    w1, w2, w1_bias, w2_bias, fp8 = _plain_weights(w1, w2, w1_bias, w2_bias, gate_up_interleaved, w1_scale, w2_scale,
                                                   block_shape)
    compute = torch.float64 if hidden_states.dtype == torch.float64 else torch.float32
    x = hidden_states.to(compute)
    fp8_dtype = w1.dtype if fp8 is not None else None
    if fp8 is not None:
        from .fp8 import fake_quantize_activations, x_group

        x = fake_quantize_activations(x, fp8_dtype, x_group(x.shape[1], fp8[0])).to(compute)
    E, two_i, _ = w1.shape
    inter = two_i // 2
    ids = local_expert_ids(topk_ids, E, expert_map)
    if lora is not None:
        from .gemm.lora import PreparedMoELoRA

        if isinstance(lora, PreparedMoELoRA):
            lora = lora.unprepare()
        lora_ids = token_lora_ids.long()
        lora_ids = torch.where((lora_ids >= 0) & (lora_ids < lora.num_loras), lora_ids, -1)

    def lora_delta(v, token, a, b, e):
        """Rows of ``v`` (inputs of tokens ``token``) times their adapters' ``a[l, e]``, ``b[l, e]``."""
        delta = torch.zeros(v.shape[0], b.shape[2], dtype=compute, device=v.device)
        for l in range(lora.num_loras):
            rows = lora_ids[token] == l
            if rows.any():
                shrink = v[rows] @ a[l, e].to(compute).T
                delta[rows] = float(lora.scaling[l]) * (shrink @ b[l, e].to(compute).T)
        return delta

    result = torch.zeros_like(x)
    for e in range(E):
        token, slot = torch.nonzero(ids == e, as_tuple=True)
        if token.numel() == 0:
            continue
        w1e = _expert_weight(w1, e, fp8, 0, compute)
        xe = x[token]
        gate = xe @ w1e[:inter].T
        up = xe @ w1e[inter:].T
        if w1_bias is not None:
            gate = gate + w1_bias[e, :inter].to(compute)
            up = up + w1_bias[e, inter:].to(compute)
        if lora is not None:
            gate = gate + lora_delta(xe, token, lora.gate_a, lora.gate_b, e)
            up = up + lora_delta(xe, token, lora.up_a, lora.up_b, e)
        y = gated_activation(gate, up, activation, swiglu_alpha, swiglu_limit)
        routing = topk_weights[token, slot].to(compute)[:, None]
        if fp8 is not None:  # the kernels quantize y after its routing weight, rounded to the input dtype
            y = fake_quantize_activations((y.float() * routing.float()).to(hidden_states.dtype), fp8_dtype).to(compute)
            down = y @ _expert_weight(w2, e, fp8, 1, compute).T
            if w2_bias is not None:
                down = down + routing * w2_bias[e].to(compute)
            result.index_add_(0, token, down)
            continue
        down = y @ w2[e].to(compute).T
        if w2_bias is not None:
            down = down + w2_bias[e].to(compute)
        if lora is not None:
            down = down + lora_delta(y, token, lora.down_a, lora.down_b, e)
        contrib = down * routing
        result.index_add_(0, token, contrib)
    result = result.to(hidden_states.dtype)
    if out is not None:
        out.copy_(result)
        return out
    return result
