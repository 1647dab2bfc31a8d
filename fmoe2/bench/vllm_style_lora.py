"""Baseline for ``python -m fmoe2.bench --lora``: the vLLM-style MoE path plus MoE-LoRA as
separate shrink and expand kernels (the published ``fused_moe_lora`` algorithm, written here
from its description)::

    align (experts)                      align (adapter, expert): tokens without adapter dropped
    grouped GEMM1       -> cache1 [M*topk, 2I]
      shrink  x @ A13^T -> s13 [M*topk, 2R]     (gate and up A stacked)
      expand  s13 @ B13^T  added into cache1   (block-diagonal B: gate cols, then up cols)
    activation          -> cache2 [M*topk, I]
    grouped GEMM2 x w   -> cache3 [M*topk, H]
      shrink  cache2 @ A2^T -> s2 [M*topk, R]
      expand  s2 @ B2^T x w  added into cache3
    sum over top-k      -> out [M, H]

Ten launches and five intermediate buffers. Shrink and expand are fmoe2's grouped GEMM
(``fmoe2/bench/grouped_gemm.py``) over the ``adapter * E + expert`` tiles of the second
alignment, on the adapters viewed as ``[L*E, ...]``. Like vLLM, the per-adapter scaling is folded
into the B matrices once (:func:`prepare_baseline_lora`); the expand adds with relaxed atomics
on rows no other program writes (an add, not a reduction).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

from .grouped_gemm import gathered_gemm
from ..gemm.lora import MoELoRA, padded_rank
from ..sorting import MoESortingResult, launch_moe_sorting, max_busy_tiles
from .vllm_style import GroupedGemmConfig, vllm_style_fused_experts


@dataclass
class BaselineLoRA:
    """Adapters in the baseline's layout, ``[L*E, rows, cols]``, scaling folded into B."""

    a13: torch.Tensor  # [L*E, 2*R_pad, H]: gate A rows then up A rows
    b13: torch.Tensor  # [L*E, 2I, 2*R_pad]: rows 0..I-1 [s*gate_b, 0], rows I.. [0, s*up_b]
    a2: torch.Tensor  # [L*E, R_pad, I]
    b2: torch.Tensor  # [L*E, H, R_pad], times s
    num_loras: int
    num_experts: int


def prepare_baseline_lora(lora: MoELoRA) -> BaselineLoRA:
    L, E, R, H = lora.gate_a.shape
    inter = lora.intermediate_size
    R_pad = padded_rank(R)
    s = lora.scaling.to(lora.dtype).view(L, 1, 1, 1)
    a13 = lora.gate_a.new_zeros(L, E, 2 * R_pad, H)
    a13[:, :, :R], a13[:, :, R_pad:R_pad + R] = lora.gate_a, lora.up_a
    b13 = lora.gate_a.new_zeros(L, E, 2 * inter, 2 * R_pad)
    b13[:, :, :inter, :R], b13[:, :, inter:, R_pad:R_pad + R] = lora.gate_b * s, lora.up_b * s
    a2 = lora.gate_a.new_zeros(L, E, R_pad, inter)
    a2[:, :, :R] = lora.down_a
    b2 = lora.gate_a.new_zeros(L, E, H, R_pad)
    b2[:, :, :, :R] = lora.down_b * s
    return BaselineLoRA(*(t.reshape(L * E, *t.shape[2:]) for t in (a13, b13, a2, b2)), num_loras=L, num_experts=E)


@dataclass(frozen=True)
class LoRAKernelConfigs:
    """Shrink/expand configs of the baseline (they share the adapter alignment's BLOCK_M)."""

    BLOCK_M: int = 16
    shrink_block_k: int = 64
    expand_block_n: int = 64
    num_warps: int = 4
    num_stages: int = 3


def default_lora_configs(num_entries: int, num_loras: int, num_experts: int) -> LoRAKernelConfigs:
    """BLOCK_M 16 while (adapter, expert) groups are small, 64 once they average >= 32 rows."""
    per_group = num_entries / (num_loras * num_experts)
    return LoRAKernelConfigs(BLOCK_M=64 if per_group >= 32 else 16)


def _lora_gemm(a, b, c, sorting, weights, num_entries, a_row_divisor, mul_weight, add, block_m, block_n, block_k,
               cfg: LoRAKernelConfigs):
    """``c[id] = a[id // divisor] @ b[adapter*E+expert]^T`` (or ``+=`` with ``add``) over the adapter tiles."""
    gathered_gemm(a, b, c, sorting, weights, num_entries, a_row_divisor, mul_weight, add, block_m, block_n, block_k, 1,
                  cfg.num_warps, cfg.num_stages)


class LoRASteps:
    """The baseline's LoRA launches around :func:`vllm_style_fused_experts`' two GEMMs."""

    def __init__(self, lora: BaselineLoRA, token_lora_ids, topk_ids, topk_weights, flat_weights,
                 cfg: LoRAKernelConfigs = None):
        M, topk = topk_ids.shape
        self.lora, self.weights, self.num_entries = lora, flat_weights, M * topk
        self.topk = topk
        self.cfg = cfg or default_lora_configs(self.num_entries, lora.num_loras, lora.num_experts)
        self.sorting = MoESortingResult.allocate(self.num_entries, lora.num_loras * lora.num_experts,
                                                 self.cfg.BLOCK_M, M, topk_ids.device, chunk_size=0)  # one kernel
        launch_moe_sorting(topk_ids, topk_weights, lora.num_experts, None, self.sorting, None, expanded_ids=True,
                           token_lora_ids=token_lora_ids, num_loras=lora.num_loras, lora_keys=True)

    def _gemm(self, a, b, c, a_row_divisor, mul_weight, add, block_n, block_k):
        _lora_gemm(a, b, c, self.sorting, self.weights, self.num_entries, a_row_divisor, mul_weight, add,
                   self.cfg.BLOCK_M, block_n, block_k, self.cfg)

    def gate_up(self, x, cache1):
        """``cache1 [M*topk, 2I] += (x @ A13^T) @ B13^T`` for entries with an adapter."""
        two_r = self.lora.a13.shape[1]
        shrink = torch.empty(self.num_entries, two_r, dtype=x.dtype, device=x.device)
        self._gemm(x, self.lora.a13, shrink, self.topk, False, False, two_r,
                   min(self.cfg.shrink_block_k, triton.next_power_of_2(x.shape[1])))
        self._gemm(shrink, self.lora.b13, cache1, 1, False, True, self.cfg.expand_block_n, two_r)

    def down(self, cache2, cache3):
        """``cache3 [M*topk, H] += w * (cache2 @ A2^T) @ B2^T`` for entries with an adapter."""
        rank = self.lora.a2.shape[1]
        shrink = torch.empty(self.num_entries, rank, dtype=cache2.dtype, device=cache2.device)
        self._gemm(cache2, self.lora.a2, shrink, 1, False, False, rank,
                   min(self.cfg.shrink_block_k, triton.next_power_of_2(cache2.shape[1])))
        self._gemm(shrink, self.lora.b2, cache3, 1, True, True, self.cfg.expand_block_n, rank)


def vllm_style_fused_experts_lora(x, w1, w2, topk_weights, topk_ids, lora: BaselineLoRA, token_lora_ids,
                                  gemm1: GroupedGemmConfig, gemm2: GroupedGemmConfig,
                                  lora_cfg: LoRAKernelConfigs = None, activation: str = "silu") -> torch.Tensor:
    """The unfused baseline with LoRA; same math as ``fmoe2.fused_moe(..., lora=...)``."""
    return vllm_style_fused_experts(
        x, w1, w2, topk_weights, topk_ids, gemm1, gemm2, activation,
        lora_steps=lambda weights: LoRASteps(lora, token_lora_ids, topk_ids, topk_weights, weights, lora_cfg))
