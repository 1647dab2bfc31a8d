"""What fp8's scaling costs a Triton GEMM on this GPU: ``python -m fmoe2.bench.fp8_scaling``.

    python -m fmoe2.bench.fp8_scaling [--problems 8192x8192x4096,32768x1536x2048,8192x28672x4096]
                                      [--out-dir misc/bench]

fmoe2's fp8 loops (``fmoe2/gemm/fp8_weights.py``) scale every K step's product on the CUDA cores (activations are
quantized per row and group of 128 along K), which measured no faster than bf16 at prefill
(docs/performance.md#prefill-against-the-gemm-limit). This benchmark isolates that choice on one dense GEMM
``C[M, N] = A[M, K] @ B[N, K]^T`` (B laid out as fmoe2's weights, K contiguous), one Triton kernel with the
scaling as a constexpr, the same tile grid for each variant (best of the grid reported):

* ``bf16``: no scaling (the 16-bit path's loop);
* ``fp8 per step``: A's scales per row and group of BLOCK_K = 128, B's per row (channel); each step's product
  multiplied by both, as fmoe2 does now;
* ``fp8 epilogue``: A's scales per row over all of K, B's per row; the products accumulate unscaled and the
  scales apply once after the loop (what per-channel and per-tensor weights allow with per-token activations);
* ``cuBLAS fp8`` (``torch._scaled_mm``, row-wise scales) and ``cuBLAS bf16`` (``torch.mm``), for reference.

Each variant is checked against a float32 product of the dequantized operands (relative error <= 1e-2) before
it is timed (CUDA graph, CUDA events, median). Results: ``<out-dir>/fp8_scaling/<device>.json`` and ``.md``.
"""
from __future__ import annotations

import argparse
import os
from typing import Dict, List, Optional

import torch
import triton
import triton.language as tl

from fmoe2.fp8 import FP8_GROUP, fake_quantize_activations, quantize_activations
from fmoe2.gemm.config import device_config_name

from .provenance import provenance_line, run_record, write_result
from .timing import time_in_graph

NO_SCALES, PER_STEP, EPILOGUE = 0, 1, 2
VARIANTS = {"bf16": NO_SCALES, "fp8 per step": PER_STEP, "fp8 epilogue": EPILOGUE}
# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages); fp8 steps of BLOCK_K=128 are one activation group
TILES = {"bf16": [(128, 128, 64, 8, 4), (128, 256, 64, 8, 3), (128, 128, 64, 4, 4)],
         "fp8": [(128, 128, 128, 8, 4), (128, 256, 128, 8, 3), (128, 128, 128, 4, 4)]}
TOL = 1e-2


@triton.jit
def _scaled_gemm_kernel(a_ptr, b_ptr, c_ptr, a_scale_ptr, b_scale_ptr, M, N, K, stride_am, stride_bn, stride_cm,
                        stride_asm, SCALING: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    """``C = (A @ B^T)`` scaled by SCALING (module docstring): A [M, K], B [N, K], C [M, N] bf16;
    ``a_scale_ptr`` [M, K // BLOCK_K] (PER_STEP) or [M] (EPILOGUE), ``b_scale_ptr`` [N]."""
    pid = tl.program_id(0)
    num_n = tl.cdiv(N, BLOCK_N)
    group = pid // (GROUP_M * num_n)
    first_m = group * GROUP_M
    rows_in_group = tl.minimum(tl.cdiv(M, BLOCK_M) - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * num_n)) % rows_in_group
    pid_n = (pid % (GROUP_M * num_n)) // rows_in_group
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_valid, n_valid = offs_m < M, offs_n < N
    a_rows = a_ptr + offs_m.to(tl.int64)[:, None] * stride_am
    b_rows = b_ptr + offs_n.to(tl.int64)[:, None] * stride_bn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if SCALING != 0:  # (0 NO_SCALES, 1 PER_STEP, 2 EPILOGUE)
        sb = tl.load(b_scale_ptr + offs_n, mask=n_valid, other=0.0)
    for k0 in range(0, K, BLOCK_K):
        a = tl.load(a_rows + (k0 + offs_k)[None, :], mask=m_valid[:, None], other=0.0)
        b = tl.load(b_rows + (k0 + offs_k)[None, :], mask=n_valid[:, None], other=0.0)
        if SCALING == 1:
            sa = tl.load(a_scale_ptr + offs_m * stride_asm + k0 // BLOCK_K, mask=m_valid, other=0.0)
            acc += tl.dot(a, tl.trans(b)) * (sa[:, None] * sb[None, :])
        else:
            acc = tl.dot(a, tl.trans(b), acc)
    if SCALING == 2:
        acc = acc * tl.load(a_scale_ptr + offs_m, mask=m_valid, other=0.0)[:, None] * sb[None, :]
    tl.store(c_ptr + offs_m.to(tl.int64)[:, None] * stride_cm + offs_n[None, :], acc.to(c_ptr.dtype.element_ty),
             mask=m_valid[:, None] & n_valid[None, :])


def scaled_gemm(a, b, scaling: int, a_scale=None, b_scale=None, out=None, tile=(128, 128, 64, 8, 4)):
    """``_scaled_gemm_kernel`` on ``a`` [M, K], ``b`` [N, K] into bf16 ``out`` [M, N]; K a multiple of BLOCK_K."""
    M, K = a.shape
    N = b.shape[0]
    bm, bn, bk, warps, stages = tile
    if K % bk:
        raise ValueError(f"K={K} must be a multiple of BLOCK_K={bk}")
    out = torch.empty(M, N, device=a.device, dtype=torch.bfloat16) if out is None else out
    grid = (triton.cdiv(M, bm) * triton.cdiv(N, bn),)
    _scaled_gemm_kernel[grid](a, b, out, a_scale, b_scale, M, N, K, a.stride(0), b.stride(0), out.stride(0),
                              a_scale.stride(0) if a_scale is not None and a_scale.dim() == 2 else 1,
                              SCALING=scaling, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, num_warps=warps,
                              num_stages=stages)
    return out


def operands(M: int, N: int, K: int, device, fp8_dtype, gen) -> Dict[str, tuple]:
    """Each variant's ``(a, b, a_scale, b_scale)`` from one random bf16 problem, and the float32 reference of
    each (its own quantization's dequantized product; fmoe2's own quantization, ``fmoe2.fp8``)."""
    a = torch.randn(M, K, device=device, generator=gen).to(torch.bfloat16)
    b = (torch.randn(N, K, device=device, generator=gen) / K ** 0.5).to(torch.bfloat16)
    qb, sb = quantize_activations(b, fp8_dtype, K)  # per row of B: per output channel
    q_step, s_step = quantize_activations(a, fp8_dtype, FP8_GROUP)
    q_row, s_row = quantize_activations(a, fp8_dtype, K)
    deq_b = fake_quantize_activations(b, fp8_dtype, K)
    return {"bf16": ((a, b, None, None), a.float() @ b.float().T),
            "fp8 per step": ((q_step, qb, s_step.contiguous(), sb[:, 0].contiguous()),
                             fake_quantize_activations(a, fp8_dtype, FP8_GROUP) @ deq_b.T),
            "fp8 epilogue": ((q_row, qb, s_row[:, 0].contiguous(), sb[:, 0].contiguous()),
                             fake_quantize_activations(a, fp8_dtype, K) @ deq_b.T)}


def bench_problem(M: int, N: int, K: int, gen) -> dict:
    from .problems import rel_err

    fp8_dtype = torch.float8_e4m3fn
    problem = operands(M, N, K, "cuda", fp8_dtype, gen)
    flops = 2 * M * N * K
    row = dict(M=M, N=N, K=K, variants={})
    for name, ((a, b, sa, sb), ref) in problem.items():
        best = None
        for tile in TILES["bf16" if name == "bf16" else "fp8"]:
            try:
                out = scaled_gemm(a, b, VARIANTS[name], sa, sb, tile=tile)
            except Exception as error:  # noqa: BLE001 - a tile past the shared memory is not a result
                print(f"  {name} {tile}: {type(error).__name__}: {str(error)[:120]}", flush=True)
                continue
            err = rel_err(out, ref)
            if err > TOL:
                raise SystemExit(f"{M}x{N}x{K} {name} {tile}: relative error {err:.2e} > {TOL}")
            us = time_in_graph(lambda: scaled_gemm(a, b, VARIANTS[name], sa, sb, out=out, tile=tile),
                               calls_per_graph=5, replays=20)
            if best is None or us < best["us"]:
                best = dict(us=us, tflops=flops / us / 1e6, tile=list(tile), rel_err=err)
        row["variants"][name] = best
    (a, b, _, _), ref = problem["bf16"]
    us = time_in_graph(lambda: torch.mm(a, b.T), calls_per_graph=5, replays=20)
    row["variants"]["cuBLAS bf16"] = dict(us=us, tflops=flops / us / 1e6, rel_err=rel_err(torch.mm(a, b.T), ref))
    (qa, qb, sa, sb), ref = problem["fp8 epilogue"]
    try:
        def run():
            return torch._scaled_mm(qa, qb.T, scale_a=sa[:, None], scale_b=sb[None, :], out_dtype=torch.bfloat16)
        err = rel_err(run(), ref)
        us = time_in_graph(run, calls_per_graph=5, replays=20)
        row["variants"]["cuBLAS fp8"] = dict(us=us, tflops=flops / us / 1e6, rel_err=err)
    except (RuntimeError, AttributeError) as error:
        print(f"  torch._scaled_mm row-wise unavailable: {str(error).splitlines()[0][:120]}", flush=True)
    print(f"{M}x{N}x{K}: " + ", ".join(f"{k} {v['tflops']:.0f} TFLOP/s" for k, v in row["variants"].items() if v),
          flush=True)
    return row


def markdown(result: dict) -> str:
    names = list(VARIANTS) + ["cuBLAS bf16", "cuBLAS fp8"]
    lines = [f"# fp8 scaling in a Triton GEMM, {result['device']}", "", provenance_line(result), "",
             "TFLOP/s (best tile of the grid; us) of `C[M, N] = A[M, K] @ B[N, K]^T`, bf16 output; fp8 e4m3fn; "
             "each checked against the float32 product of its own dequantized operands first.", "",
             "| M x N x K | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    for r in result["results"]:
        cells = [f"{r['variants'][n]['tflops']:.0f} ({r['variants'][n]['us']:.1f})" if r["variants"].get(n) else "-"
                 for n in names]
        lines.append(f"| {r['M']} x {r['N']} x {r['K']} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m fmoe2.bench.fp8_scaling", description=__doc__.split("\n\n")[0])
    p.add_argument("--problems", default="8192x8192x4096,32768x1536x2048,8192x28672x4096",
                   help="comma-separated MxNxK (K a multiple of 128)")
    p.add_argument("--out-dir", default=os.path.join("misc", "bench"))
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        p.error("the benchmark needs a CUDA GPU")
    gen = torch.Generator(device="cuda").manual_seed(0)
    result = {**run_record("python -m fmoe2.bench.fp8_scaling", argv), "results": []}
    path = os.path.join(a.out_dir, "fp8_scaling", f"{device_config_name()}.json")
    for spec in a.problems.split(","):
        M, N, K = (int(v) for v in spec.split("x"))
        result["results"].append(bench_problem(M, N, K, gen))
        report = write_result(path, result, markdown)
    print(report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
