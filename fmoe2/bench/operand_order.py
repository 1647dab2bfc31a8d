"""Which operand the weights should be in a decode GEMM: ``python -m fmoe2.bench.operand_order``.

A study for issue 58 (weight-only formats near their floor at decode), outside fmoe2's forward: one program per
expert and slice of N computes ``y[e] = x[e] @ dequant(w[e])^T`` for a few rows per expert, the gate/up GEMM of
a decode step, with the weights

- ``bf16``: 16-bit, the tile the B operand of ``tl.dot(x, w^T)`` (fmoe2's orientation today);
- ``int8``: int8 with one float32 scale per output channel (applied to the product), same orientation;
- ``int8-swapped``: the same weights as the A operand, ``acc^T = dequant(w) @ x^T`` (tokens on the MMA's N side;
  on sm_90 Triton can then issue wgmma with A from registers, where the other orientation takes mma.sync).

Each variant is checked against a float32 product first, then timed in CUDA graphs (median); the result is the
weight bytes read per microsecond against the measured copy bandwidth. Prints a table and writes
``<out-dir>/operand_order/<GPU>.md`` and ``.json``.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
from dataclasses import asdict, dataclass
from typing import Dict, List

import torch
import triton
import triton.language as tl

from .provenance import run_record
from .timing import time_in_graph


@triton.jit
def _expert_slice_gemm_kernel(
    x_ptr,  # [E * rows, K] bf16 (fp16 under the interpreter, whose bf16 dot is wrong), rows of expert e at e * rows
    w_ptr,  # [E, N, K] x's dtype or int8, K contiguous
    scale_ptr,  # [E, N] float32 (read only if SCALED)
    y_ptr,  # [E * rows, N] x's dtype
    rows, N, K,
    SCALED: tl.constexpr,  # int8 weights: y = (x @ w^T) * scale[n]
    SWAPPED: tl.constexpr,  # the weight tile is the dot's A operand (acc is [BLOCK_N, BLOCK_M])
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """Grid: (E, cdiv(N, BLOCK_N)); ``rows`` <= BLOCK_M."""
    expert = tl.program_id(0).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    row_mask = offs_m < rows
    n_mask = offs_n < N
    x_rows = x_ptr + (expert * rows + offs_m) * K
    w_rows = w_ptr + expert * N * K + offs_n.to(tl.int64) * K
    if SWAPPED:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_mask = k0 + offs_k < K
        if SWAPPED:
            w = tl.load(w_rows[:, None] + (k0 + offs_k)[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0)
            x_t = tl.load(x_rows[None, :] + (k0 + offs_k)[:, None], mask=row_mask[None, :] & k_mask[:, None],
                          other=0.0)
            acc = tl.dot(w.to(x_ptr.dtype.element_ty), x_t, acc)
        else:
            w_t = tl.load(w_rows[None, :] + (k0 + offs_k)[:, None], mask=n_mask[None, :] & k_mask[:, None], other=0)
            x = tl.load(x_rows[:, None] + (k0 + offs_k)[None, :], mask=row_mask[:, None] & k_mask[None, :],
                        other=0.0)
            acc = tl.dot(x, w_t.to(x_ptr.dtype.element_ty), acc)
    if SWAPPED:
        acc = tl.trans(acc)
    if SCALED:
        acc = acc * tl.load(scale_ptr + expert * N + offs_n, mask=n_mask, other=0.0)[None, :]
    y = y_ptr + (expert * rows + offs_m)[:, None] * N + offs_n[None, :]
    tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=row_mask[:, None] & n_mask[None, :])


@dataclass(frozen=True)
class Problem:
    name: str
    E: int  # experts hit
    rows: int  # rows per expert
    N: int  # 2 * I (gate and up)
    K: int  # H


# gpt-oss-20b's gate/up GEMM at batch 1 (4 experts hit, one row each) and 16 (top-4 of 32: all hit, 2 rows each);
# Qwen3-30B-A3B at batch 16 (top-8 of 128: about one row each)
PROBLEMS = [Problem("gpt-oss-20b M=1", 4, 1, 5760, 2880), Problem("gpt-oss-20b M=16", 32, 2, 5760, 2880),
            Problem("qwen3-30b-a3b M=16", 128, 1, 1536, 2048)]


@dataclass(frozen=True)
class Variant:
    weights: str  # bf16, int8, int8-swapped
    BLOCK_N: int
    BLOCK_K: int
    num_warps: int
    num_stages: int
    BLOCK_M: int = 16

    @property
    def label(self) -> str:
        return f"{self.weights} {self.BLOCK_N}x{self.BLOCK_K} {self.num_warps}w{self.num_stages}s"


def variants() -> List[Variant]:
    out = [Variant("bf16", n, 128, 4, s) for n, s in itertools.product((32, 64, 128), (3, 4))]
    out += [Variant("int8", n, k, 4, s) for n, k, s in itertools.product((32, 64, 128), (128, 256), (3, 4))]
    out += [Variant("int8-swapped", n, k, w, s)
            for n, k, w, s in itertools.product((64, 128), (128, 256), (4, 8), (3, 4))
            if n >= 16 * w and n * k <= 4096 * w]  # (128 x 256 with 4 warps spills on sm_90)
    return out


def make_operands(problem: Problem, device: str, dtype: torch.dtype = torch.bfloat16):
    g = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(problem.E * problem.rows, problem.K, generator=g).to(device, dtype)
    w_bf16 = (torch.randn(problem.E, problem.N, problem.K, generator=g) * 0.05).to(device, dtype)
    scale = w_bf16.float().abs().amax(dim=2).clamp_min(1e-8) / 127.0
    w_int8 = torch.round(w_bf16.float() / scale[:, :, None]).clamp(-127, 127).to(torch.int8)
    return x, w_bf16, w_int8, scale


def launch(variant: Variant, problem: Problem, x, w, scale, y) -> None:
    grid = (problem.E, triton.cdiv(problem.N, variant.BLOCK_N))
    _expert_slice_gemm_kernel[grid](x, w, scale, y, problem.rows, problem.N, problem.K,
                                    SCALED=variant.weights != "bf16", SWAPPED=variant.weights == "int8-swapped",
                                    BLOCK_M=variant.BLOCK_M, BLOCK_N=variant.BLOCK_N, BLOCK_K=variant.BLOCK_K,
                                    num_warps=variant.num_warps, num_stages=variant.num_stages)


def reference(problem: Problem, x, w, scale) -> torch.Tensor:
    xe = x.float().view(problem.E, problem.rows, problem.K)
    we = w.float() * (scale[:, :, None] if w.dtype == torch.int8 else 1.0)
    return torch.bmm(xe, we.transpose(1, 2)).reshape(problem.E * problem.rows, problem.N)


def copy_bandwidth_gbs() -> float:
    src = torch.randn(1 << 28, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    us = time_in_graph(lambda: torch.mul(src, 1, out=dst), calls_per_graph=5, replays=20)
    return 2 * src.numel() * src.element_size() / us / 1e3


def run(problems: List[Problem], chosen: List[Variant], device: str) -> List[dict]:
    rows = []
    for problem in problems:
        x, w_bf16, w_int8, scale = make_operands(problem, device, torch.bfloat16 if device == "cuda" else torch.float16)
        expected = {dtype: reference(problem, x, w, scale) for dtype, w in (("bf16", w_bf16), ("int8", w_int8))}
        for variant in chosen:
            w = w_bf16 if variant.weights == "bf16" else w_int8
            y = torch.full((problem.E * problem.rows, problem.N), float("nan"), device=device, dtype=x.dtype)
            launch(variant, problem, x, w, scale, y)
            ref = expected["bf16" if variant.weights == "bf16" else "int8"]
            rel_err = ((y.float() - ref).norm() / ref.norm()).item()
            if not rel_err < 1e-2:
                raise AssertionError(f"{problem.name} {variant.label}: relative error {rel_err}")
            us = time_in_graph(lambda: launch(variant, problem, x, w, scale, y), replays=30) if device == "cuda" else float("nan")
            weight_bytes = w.numel() * w.element_size()
            rows.append(dict(problem=problem.name, **asdict(variant), label=variant.label, us=us,
                             weight_gbs=weight_bytes / us / 1e3, rel_err=rel_err))
            print(f"{problem.name:20s} {variant.label:32s} {us:8.1f} us {weight_bytes / us / 1e3:7.0f} GB/s "
                  f"err {rel_err:.1e}", flush=True)
    return rows


def write_report(rows: List[dict], copy_gbs: float, record: dict, out_dir: str) -> str:
    name = record["device"].replace(" ", "_")
    folder = os.path.join(out_dir, "operand_order")
    os.makedirs(folder, exist_ok=True)
    best: Dict[tuple, dict] = {}
    for r in rows:
        key = (r["problem"], r["weights"])
        if key not in best or r["us"] < best[key]["us"]:
            best[key] = r
    lines = [f"# Weight operand order at decode: {name}", "",
             f"{record['date']}, torch {record['torch']}, Triton {record['triton']}; `{record['command']}`", "",
             "One GEMM per expert and slice of N (`fmoe2/bench/operand_order.py`), the gate/up GEMM of a decode step; "
             "microseconds per launch (CUDA graphs, median), the weight bytes over that time against the measured "
             f"copy bandwidth ({copy_gbs:.0f} GB/s). Fastest config of each kind:", "",
             "| problem | weights | config | us | weight GB/s | of copy bandwidth |", "|---|---|---|---|---|---|"]
    for (problem, weights), r in best.items():
        lines.append(f"| {problem} | {weights} | {r['label']} | {r['us']:.1f} | {r['weight_gbs']:.0f} | "
                     f"{r['weight_gbs'] / copy_gbs:.0%} |")
    lines += ["", "Every config:", "", "| problem | config | us | weight GB/s |", "|---|---|---|---|"]
    lines += [f"| {r['problem']} | {r['label']} | {r['us']:.1f} | {r['weight_gbs']:.0f} |" for r in rows]
    path = os.path.join(folder, name + ".md")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    with open(os.path.join(folder, name + ".json"), "w") as f:
        json.dump(dict(record=record, copy_gbs=copy_gbs, rows=rows), f, indent=1)
    return path


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m fmoe2.bench.operand_order", description=__doc__.split("\n")[0])
    parser.add_argument("--out-dir", default="misc/bench", help="results go to <out-dir>/operand_order/")
    parser.add_argument("--weights", default="bf16,int8,int8-swapped", help="comma-separated kinds")
    args = parser.parse_args(argv)
    kinds = args.weights.split(",")
    unknown = sorted(set(kinds) - {"bf16", "int8", "int8-swapped"})
    if unknown:
        parser.error(f"--weights takes bf16, int8, int8-swapped; got {unknown}")
    chosen = [v for v in variants() if v.weights in kinds]
    if not torch.cuda.is_available():
        # The interpreter checks the kernel on one small problem (no timing).
        run([Problem("small", 3, 2, 80, 96)], [Variant(k, 32, 32, 4, 1) for k in kinds], "cpu")
        print("no GPU: checked under the interpreter only")
        return
    record = run_record("python -m fmoe2.bench.operand_order", argv)
    copy_gbs = copy_bandwidth_gbs()
    rows = run(PROBLEMS, chosen, "cuda")
    print("wrote", write_report(rows, copy_gbs, record, args.out_dir))


if __name__ == "__main__":
    main()
