"""Baseline for the benchmark: vLLM's published Triton MoE algorithm, written here from its description.

    align (expanded ids token*topk+slot, one device kernel)
      -> grouped GEMM1 into cache1 [M*topk, 2I]
      -> gated activation into cache2 [M*topk, I]          (one kernel)
      -> grouped GEMM2 x routed weight into cache3 [M, topk, H]
      -> sum over top-k into out [M, H]                      (one kernel)

Five launches and three intermediate buffers. With fp8 weights (:func:`vllm_style_fused_experts_fp8`)
two more: the activations are quantized per token and group of 128 by a separate kernel before
each GEMM (vLLM's ``per_token_group_quant_fp8``), and the GEMMs read fp8 A and B with their scales. The align step is fmoe2's sorting kernel with
``EXPANDED_IDS`` (same cost model as vLLM's single-kernel align, no output zeroing); the GEMM is a
grouped GEMM over (expert tile, N block) programs in grouped launch order, like vLLM's
``fused_moe_kernel`` (``fmoe2/bench/grouped_gemm.py``, built from the K loops of fmoe2's stage 2). Its configs are picked from the same kind of search space as fmoe2's.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..fp8 import FP8_GROUP, _quantize_rows, fp8_constexprs
from ..gemm.activations import _gated_activation
from ..sorting import MoESortingResult, launch_moe_sorting
from .grouped_gemm import gathered_gemm


@dataclass(frozen=True)
class GroupedGemmConfig:
    BLOCK_M: int
    BLOCK_N: int
    BLOCK_K: int
    GROUP_M: int = 8
    num_warps: int = 4
    num_stages: int = 3


def vllm_default_config(M: int, E: int, fp8_block: bool = False, hip: bool = False) -> GroupedGemmConfig:
    """The config vLLM's Triton MoE path runs for a shape it has no tuned file for (its ``get_default_config``
    since vLLM PR #34846, read for facts, not copied): the tile height grows with the batch ``M`` alone; both GEMMs
    take the same config. ROCm runs 2 pipeline stages.

    * 16-bit weights: ``M <= 32``: 16 x 64 x 128 tiles, 4 warps, 4 stages; ``<= 64``: 32 x 64 x 128, 3 stages;
      ``<= 96``: 32 x 128 x 64; ``<= 128``: 64 x 128 x 64; ``<= 512``: the same with 8 warps; above: 128 x 128 x
      64, 8 warps. Groups of 16 tiles once ``M // E > 128``, else 1.
    * fp8 weights in 128 x 128 blocks: 16-row tiles up to ``M = 64``, 64 above; 128 x 128 (the scale block), 4 warps,
      3 stages; groups of 1 up to ``M = 16``, 32 above.
    """
    if fp8_block:
        return GroupedGemmConfig(BLOCK_M=16 if M <= 64 else 64, BLOCK_N=128, BLOCK_K=128, GROUP_M=1 if M <= 16 else 32,
                                 num_warps=4, num_stages=2 if hip else 3)
    if M <= 32:
        bm, bn, bk, warps, stages = 16, 64, 128, 4, 4
    elif M <= 64:
        bm, bn, bk, warps, stages = 32, 64, 128, 4, 3
    elif M <= 96:
        bm, bn, bk, warps, stages = 32, 128, 64, 4, 3
    elif M <= 128:
        bm, bn, bk, warps, stages = 64, 128, 64, 4, 3
    elif M <= 512:
        bm, bn, bk, warps, stages = 64, 128, 64, 8, 3
    else:
        bm, bn, bk, warps, stages = 128, 128, 64, 8, 3
    return GroupedGemmConfig(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=16 if M // max(E, 1) > 128 else 1,
                             num_warps=warps, num_stages=2 if hip else stages)


@triton.jit
def _gated_activation_kernel(
    gate_up_ptr,  # [R, 2I]: gate columns then up columns
    y_ptr,  # [R, I]
    I,
    ACTIVATION: tl.constexpr,
    BLOCK: tl.constexpr,
    SWIGLU_ALPHA: tl.constexpr = 1.702,
    SWIGLU_LIMIT: tl.constexpr = None,
):
    """Grid: (R, cdiv(I, BLOCK))."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    valid = offs < I
    gate = tl.load(gate_up_ptr + row * 2 * I + offs, mask=valid, other=0.0).to(tl.float32)
    up = tl.load(gate_up_ptr + row * 2 * I + I + offs, mask=valid, other=0.0).to(tl.float32)
    y = _gated_activation(gate, up, ACTIVATION, SWIGLU_ALPHA, SWIGLU_LIMIT)
    tl.store(y_ptr + row * I + offs, y.to(y_ptr.dtype.element_ty), mask=valid)


@triton.jit
def _topk_sum_kernel(
    partial_ptr,  # [M, TOPK, H]
    out_ptr,  # [M, H]
    H,
    TOPK: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Grid: (M, cdiv(H, BLOCK)); fp32 sum over the top-k partial outputs."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    valid = offs < H
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for k in tl.static_range(TOPK):
        acc += tl.load(partial_ptr + (row * TOPK + k) * H + offs, mask=valid, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * H + offs, acc.to(out_ptr.dtype.element_ty), mask=valid)


@triton.jit
def _per_token_group_quant_kernel(
    v_ptr,  # [R, K] 16-bit
    q_ptr,  # [R, K] fp8
    scale_ptr,  # [R, cdiv(K, GROUP)] float32
    K,
    GROUP: tl.constexpr,
    FP8_MAX: tl.constexpr,
    SOFT_FP8_ROUNDING: tl.constexpr,
    FP8_MIN_NORMAL: tl.constexpr,
    FP8_SUBNORMAL_STEP: tl.constexpr,
):
    """Grid: (R, cdiv(K, GROUP)); one group of one row, quantized as fmoe2's kernels do (fmoe2/fp8.py)."""
    row = tl.program_id(0).to(tl.int64)
    group = tl.program_id(1)
    offs = group * GROUP + tl.arange(0, GROUP)
    valid = offs < K
    v = tl.load(v_ptr + row * K + offs, mask=valid, other=0.0).to(tl.float32)
    scaled, scale = _quantize_rows(v[None, :], FP8_MAX, SOFT_FP8_ROUNDING, FP8_MIN_NORMAL, FP8_SUBNORMAL_STEP)
    tl.store(q_ptr + row * K + offs[None, :], scaled.to(q_ptr.dtype.element_ty), mask=valid[None, :])
    tl.store(scale_ptr + row * tl.cdiv(K, GROUP) + group + tl.arange(0, 1), scale)


def per_token_group_quant(v: torch.Tensor, fp8_dtype: torch.dtype):
    """``(q [R, K] fp8, scale [R, cdiv(K, 128)] float32)`` of 16-bit rows ``v``, one launch."""
    R, K = v.shape
    q = torch.empty(R, K, dtype=fp8_dtype, device=v.device)
    scale = torch.empty(R, triton.cdiv(K, FP8_GROUP), dtype=torch.float32, device=v.device)
    consts = fp8_constexprs(fp8_dtype, interpreter=v.device.type != "cuda")
    _per_token_group_quant_kernel[(R, triton.cdiv(K, FP8_GROUP))](
        v, q, scale, K, GROUP=FP8_GROUP, FP8_MAX=consts["FP8_MAX"], SOFT_FP8_ROUNDING=consts["SOFT_FP8_ROUNDING"],
        FP8_MIN_NORMAL=consts["FP8_MIN_NORMAL"], FP8_SUBNORMAL_STEP=consts["FP8_SUBNORMAL_STEP"])
    return q, scale


def _grouped_gemm(a, b, c, sorting, topk_weights, num_entries, a_row_divisor, mul_weight, cfg: GroupedGemmConfig,
                  bias=None, a_scale=None, b_scale=None, scale_block=None, group_scale=None, group=1):
    gathered_gemm(a, b, c, sorting, topk_weights, num_entries, a_row_divisor, mul_weight, False, cfg.BLOCK_M,
                  cfg.BLOCK_N, cfg.BLOCK_K, cfg.GROUP_M, cfg.num_warps, cfg.num_stages, bias, a_scale, b_scale,
                  scale_block, group_scale, group)


def _align(x, w1, topk_weights, topk_ids, block_m: int):
    """``(M, H, 2I, I, topk, M*topk, sorting)``: the baseline's alignment, one kernel like vLLM's CUDA op
    (never the two-launch chunked sort), expanded ids ``token*topk+slot``."""
    M, H = x.shape
    E, two_i, _ = w1.shape
    topk = topk_ids.shape[1]
    num_entries = M * topk
    sorting = MoESortingResult.allocate(num_entries, E, block_m, M, x.device, chunk_size=0)
    launch_moe_sorting(topk_ids, topk_weights, E, None, sorting, None, expanded_ids=True)
    return M, H, two_i, two_i // 2, topk, num_entries, sorting


def vllm_style_fused_experts(x, w1, w2, topk_weights, topk_ids, gemm1: GroupedGemmConfig, gemm2: GroupedGemmConfig,
                             activation: str = "silu", lora_steps=None, w1_bias=None,
                             w2_bias=None, swiglu_alpha: float = 1.702, swiglu_limit=None, w1_group_scale=None,
                             w2_group_scale=None, group: int = 1) -> torch.Tensor:
    """The unfused baseline; same math as :func:`fmoe2.fused_moe` (``w1`` gate rows then up rows; biases
    in the GEMMs' epilogues, as vLLM's kernel adds them). Both GEMMs share BLOCK_M (one sort).

    4-bit weights (w4a16, like vLLM's wna16 kernel: dequantized in the GEMMs' K loops): ``w1`` [E, 2I, H // 2] and
    ``w2`` [E, H, I // 2] packed (``fmoe2/quant4.py``) with their group scales ``w1_group_scale`` /
    ``w2_group_scale`` (contiguous, laid out like the packed rows) of ``group`` columns.

    ``lora_steps(weights)``, where given (``fmoe2/bench/vllm_style_lora.py``), makes the LoRA steps of the call from the
    flat float32 routing weights: their ``gate_up`` and ``down`` (alignment, shrink and expand kernels) run after each
    GEMM.
    """
    if gemm1.BLOCK_M != gemm2.BLOCK_M:
        raise ValueError("gemm1 and gemm2 configs must share BLOCK_M (one alignment serves both)")
    M, H, two_i, inter, topk, num_entries, sorting = _align(x, w1, topk_weights, topk_ids, gemm1.BLOCK_M)
    cache1 = torch.empty(num_entries, two_i, dtype=x.dtype, device=x.device)
    cache2 = torch.empty(num_entries, inter, dtype=x.dtype, device=x.device)
    cache3 = torch.empty(M, topk, H, dtype=x.dtype, device=x.device)
    weights = topk_weights.reshape(-1).float() if topk_weights.dtype != torch.float32 else topk_weights.reshape(-1)
    steps = lora_steps(weights) if lora_steps is not None else None
    _grouped_gemm(x, w1, cache1, sorting, weights, num_entries, topk, False, gemm1, w1_bias,
                  group_scale=w1_group_scale, group=group)
    if steps is not None:
        steps.gate_up(x, cache1)
    act_block = min(1024, triton.next_power_of_2(inter))
    _gated_activation_kernel[(num_entries, triton.cdiv(inter, act_block))](
        cache1, cache2, inter, ACTIVATION=activation, BLOCK=act_block,
        SWIGLU_ALPHA=float(swiglu_alpha) if activation == "swiglu_oai" else 1.702,
        SWIGLU_LIMIT=float(swiglu_limit) if swiglu_limit is not None else None)
    _grouped_gemm(cache2, w2, cache3.view(num_entries, H), sorting, weights, num_entries, 1, True, gemm2, w2_bias,
                  group_scale=w2_group_scale, group=group)
    if steps is not None:
        steps.down(cache2, cache3.view(num_entries, H))
    out = torch.empty_like(x)
    sum_block = min(1024, triton.next_power_of_2(H))
    _topk_sum_kernel[(M, triton.cdiv(H, sum_block))](cache3, out, H, TOPK=topk, BLOCK=sum_block)
    return out


def vllm_style_fused_experts_fp8(x, w1, w2, topk_weights, topk_ids, gemm1: GroupedGemmConfig,
                                 gemm2: GroupedGemmConfig, w1_scale, w2_scale, block_shape=None,
                                 activation: str = "silu") -> torch.Tensor:
    """The unfused baseline with fp8 weights (``fmoe2/fp8.py``'s schemes): seven launches, the
    activations quantized by their own kernel before each GEMM. Configs' BLOCK_K must be 128 (one
    activation group per K step, as vLLM's block-scaled configs use)."""
    from ..gemm.layout import checked_weight_scales

    if gemm1.BLOCK_M != gemm2.BLOCK_M or FP8_GROUP not in (gemm1.BLOCK_K, gemm2.BLOCK_K) or gemm1.BLOCK_K != gemm2.BLOCK_K:
        raise ValueError(f"gemm configs must share BLOCK_M and have BLOCK_K={FP8_GROUP}")
    s1, s2, scale_block = checked_weight_scales(w1, w2, w1_scale, w2_scale, block_shape)
    M, H, two_i, inter, topk, num_entries, sorting = _align(x, w1, topk_weights, topk_ids, gemm1.BLOCK_M)
    weights = topk_weights.reshape(-1).float()
    qx, sx = per_token_group_quant(x, w1.dtype)
    cache1 = torch.empty(num_entries, two_i, dtype=x.dtype, device=x.device)
    cache2 = torch.empty(num_entries, inter, dtype=x.dtype, device=x.device)
    cache3 = torch.empty(M, topk, H, dtype=x.dtype, device=x.device)
    _grouped_gemm(qx, w1, cache1, sorting, weights, num_entries, topk, False, gemm1, a_scale=sx, b_scale=s1,
                  scale_block=scale_block)
    act_block = min(1024, triton.next_power_of_2(inter))
    _gated_activation_kernel[(num_entries, triton.cdiv(inter, act_block))](cache1, cache2, inter, ACTIVATION=activation,
                                                                           BLOCK=act_block)
    q2, sy = per_token_group_quant(cache2, w1.dtype)
    _grouped_gemm(q2, w2, cache3.view(num_entries, H), sorting, weights, num_entries, 1, True, gemm2, a_scale=sy,
                  b_scale=s2, scale_block=scale_block)
    out = torch.empty_like(x)
    sum_block = min(1024, triton.next_power_of_2(H))
    _topk_sum_kernel[(M, triton.cdiv(H, sum_block))](cache3, out, H, TOPK=topk, BLOCK=sum_block)
    return out
