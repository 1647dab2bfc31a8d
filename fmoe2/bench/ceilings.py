"""What a device reaches, and what each of fmoe2's launches takes: the copy bandwidth and bf16 matmul rate (a
forward's floor), dense cuBLAS products of a forward's GEMMs, and each launch of a forward timed alone."""
from __future__ import annotations

import torch

from fmoe2.gemm.fused_moe import forward_launches

from .timing import time_in_graph


def measure_ceilings() -> dict:
    """Device-to-device copy bandwidth (read + write bytes) and bf16 matmul rate on random data."""
    n = 1 << 30  # 1 GiB of bf16 per buffer
    src = torch.randn(n // 2, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    # An SM copy kernel (a captured same-dtype copy_ may become a copy-engine memcpy node, which is slower).
    copy_us = time_in_graph(lambda: torch.mul(src, 1, out=dst), calls_per_graph=5, replays=20)
    del src, dst
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    mm_us = time_in_graph(lambda: a @ b, calls_per_graph=5, replays=20)
    return {"copy_bytes_per_s": 2 * n / (copy_us * 1e-6), "bf16_flops_per_s": 2 * 8192**3 / (mm_us * 1e-6)}


def floor_us(moved_bytes: float, flops: float, ceilings: dict) -> float:
    """A forward's floor in us: ``moved_bytes`` over the measured copy bandwidth or ``flops`` over the measured bf16
    matmul rate (``measure_ceilings``), whichever is longer."""
    return max(moved_bytes / ceilings["copy_bytes_per_s"], flops / ceilings["bf16_flops_per_s"]) * 1e6


def dense_gemm_us(E, H, I, rows_per_expert, gen, timer=time_in_graph) -> float:
    """Calibration: the forward's two GEMMs as dense batched products through torch (cuBLAS) in bf16,
    ``rows_per_expert`` rows for each of the E experts (no gather, padding, activation or atomics):
    what a vendor GEMM library reaches at this size. ``timer``: how each product is timed."""
    opts = dict(device="cuda", dtype=torch.bfloat16, generator=gen)  # gen: its own, so the points' inputs stay put
    a, w13 = torch.randn(E, rows_per_expert, H, **opts), torch.randn(E, H, 2 * I, **opts)
    y, w2 = torch.randn(E, rows_per_expert, I, **opts), torch.randn(E, I, H, **opts)
    return timer(lambda: torch.bmm(a, w13)) + timer(lambda: torch.bmm(y, w2))


def stage_times(x, weights, topk_weights, topk_ids, config, out, lora=None, token_lora_ids=None, **options) -> dict:
    """Median us of each launch of fmoe2's forward alone (names from ``forward_launches``: sort, fused
    or stage1/stage2, and with adapters the two-stage path's lora_shrink/lora_expand launches), each
    in its own graph, on the buffers one full forward leaves behind."""
    launches = forward_launches(x, weights, None, topk_weights, topk_ids, out=out, config=config, lora=lora,
                                token_lora_ids=token_lora_ids, **options)
    for _, launch in launches:  # every launch then finds the buffers it reads filled
        launch()
    return {name: time_in_graph(launch) for name, launch in launches}
