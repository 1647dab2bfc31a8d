"""Main job: ``python -m fmoe2`` runs a verified MoE forward.

On a GPU: a realistic bf16 problem (qwen3-30b-a3b's MoE layer by default), checked against the
float64 reference, then timed as a CUDA graph. Without a GPU: re-runs itself under the Triton
interpreter (``TRITON_INTERPRET=1``) on a small fp16 problem with odd sizes and checks it the same
way. Exits non-zero if any result is off.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys


def _needs_interpreter() -> bool:
    import torch

    from fmoe2._validation import interpreter_requested

    return not torch.cuda.is_available() and not interpreter_requested()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fmoe2", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--shape", default=None, help="E,H,I,topk (default: 128,2048,768,8 on GPU; 6,72,40,3 on CPU)")
    parser.add_argument("--m", type=int, default=None, help="tokens (default: 256 on GPU; 37 on CPU)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if _needs_interpreter():
        print("fmoe2: no GPU found; running a small forward under the Triton interpreter on the CPU", flush=True)
        env = dict(os.environ, TRITON_INTERPRET="1")
        return subprocess.call([sys.executable, "-m", "fmoe2", *(argv if argv is not None else sys.argv[1:])], env=env)

    import torch

    import fmoe2
    from fmoe2._validation import interpreter_enabled

    on_cpu = interpreter_enabled() and not torch.cuda.is_available()
    device = "cpu" if on_cpu else "cuda"
    dtype = torch.float16 if on_cpu else torch.bfloat16
    E, H, inter, topk = (int(v) for v in (args.shape or ("6,72,40,3" if on_cpu else "128,2048,768,8")).split(","))
    M = args.m or (37 if on_cpu else 256)
    gen = torch.Generator(device="cpu").manual_seed(args.seed)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(device=device, dtype=dtype)

    x = randn(M, H)
    w1 = randn(E, 2 * inter, H, scale=H**-0.5)
    w2 = randn(E, H, inter, scale=inter**-0.5)
    scores = torch.randn(M, E, generator=gen).softmax(dim=-1)
    topk_weights, topk_ids = torch.topk(scores, topk, dim=-1)
    topk_weights, topk_ids = topk_weights.to(device), topk_ids.to(device=device, dtype=torch.int32)
    prepared = fmoe2.prepare_weights(w1, w2)

    ref = fmoe2.fused_moe_reference(x.double(), w1.double(), w2.double(), topk_weights, topk_ids)
    tolerance = 5e-3 if dtype == torch.float16 else 2e-2
    print(f"fmoe2 {fmoe2.__version__} on {torch.cuda.get_device_name() if not on_cpu else 'CPU (Triton interpreter)'}")
    print(f"problem: M={M} E={E} H={H} I={inter} topk={topk} dtype={str(dtype).replace('torch.', '')}")
    ok = True
    for name, weights in (("plain weights", (w1, w2)), ("prepared weights", (prepared, None))):
        out = torch.full((M, H), float("nan"), dtype=dtype, device=device)  # poison: unwritten rows show
        fmoe2.fused_moe(x, weights[0], weights[1], topk_weights, topk_ids, out=out)
        err = ((out.double() - ref).norm() / ref.norm()).item()
        good = bool(torch.isfinite(out).all()) and err <= tolerance
        ok &= good
        print(f"  fused_moe ({name}): relative L2 error vs float64 reference {err:.2e} "
              f"(tolerance {tolerance:.0e}) {'OK' if good else 'FAILED'}")

    if not on_cpu:
        out = torch.empty_like(x)
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            fmoe2.fused_moe(x, prepared, None, topk_weights, topk_ids, out=out)  # compile outside the graph
        torch.cuda.current_stream().wait_stream(stream)
        with torch.cuda.graph(graph):
            fmoe2.fused_moe(x, prepared, None, topk_weights, topk_ids, out=out)
        out.fill_(float("nan"))  # the graph, not the warm-up call, must write the result
        times = []
        for _ in range(50):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3)
        times.sort()
        graph_err = ((out.double() - ref).norm() / ref.norm()).item()
        ok &= graph_err <= tolerance
        print(f"  CUDA graph replay: median {times[len(times) // 2]:.1f} us (sort + fused kernel), "
              f"relative error {graph_err:.2e}")
    print("OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
