"""Host cost per call: ``python -m fmoe2.bench --host`` (or ``python -m fmoe2.bench.host``).

What a caller pays on the CPU for each call outside a CUDA graph (Hugging Face transformers decodes
eagerly; vLLM and SGLang run eagerly above their graph-capture sizes), for the three benchmark
shapes at M=1, bf16, prepared weights, in one run on the GPU:

* references: a bare Triton launch of an empty kernel (through the JIT, and through its compiled
  kernel with the arguments bound, ``fmoe2.launch``), ``torch.add`` on a small tensor,
  ``torch.empty``;
* ``moe_sorting``; ``fused_moe`` on the fused and on the two-stage path; with LoRA adapters (rank
  16, 4 adapters, mixed) on both paths: each with plans launching directly (the default) and with
  every launch through Triton's JIT (``fmoe2.launch.set_launch_mode("jit")``);
* at one token, the one-launch decode against the same plan's sort path, in turns (host time and one eager
  call: ``fmoe2/gemm/decode.py``), and the decode's kernel alone in a CUDA graph; the GPU time of one eager
  launch of an empty kernel from an idle GPU, which every eager call pays beyond its kernels;
* the forward's GPU time four ways: one eager call timed with CUDA events from an idle GPU (what
  the host adds to one call's latency), back-to-back eager calls (events around 200 calls: what an
  eager model loop pays per layer), a CUDA-graph replay (per call of 10 calls per graph), and one replay
  of a one-call graph from an idle GPU, timed as the one eager call (the like-for-like graph latency);
* a two-layer MoE module (router, top-k, fused_moe, residual) per step: eager, and under
  ``torch.compile`` (``fullgraph=True``; default mode, and ``mode="reduce-overhead"``).

Host time per call: the median over ``ROUNDS`` rounds of ``CALLS`` back-to-back calls (no synchronising
within a round, each round starting on an idle GPU) of ``time.perf_counter_ns`` around each call. The
median of single calls leaves out the calls that a garbage collection or an interrupt lands in, and the
rounds are short enough that a forward slower on the GPU than on the host (Mixtral) never fills the
launch queue. Writes ``<out-dir>/host/<device>.json`` and ``.md``.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time

import torch
import triton

import fmoe2
from fmoe2.gemm.config import device_config_name
from fmoe2.gemm.fused_moe import call_key, plan_of
from fmoe2.launch import LaunchSpec, bind_launches, raw_stream, set_launch_mode
from fmoe2.shapes import ALL_SHAPES, SHAPES

from .provenance import provenance_line, run_record, write_result
from .timing import capture_graph, time_in_graph

# Back-to-back calls per round: few enough that the GPU's launch queue never fills (at Mixtral M=1 a forward
# takes 240 us on the GPU against 30 on the host; 200 calls of 3 launches each made the host wait, 2026-11-25;
# rounds of 50 calls timed as a whole still varied by up to 2x between runs of one code on the H200, 2026-11-26).
CALLS = 10
ROUNDS = 101
EAGER_CALLS = 200  # calls between the events of the back-to-back eager timing
DECODE_TURNS = 3  # turns of the one-launch decode against the sort path of the same plan
COMPILED_LAYERS = 2


@triton.jit
def _empty_kernel(x_ptr, n):
    pass


def host_us(fn, calls: int = CALLS, rounds: int = ROUNDS) -> float:
    """Median host microseconds of one call of ``fn``, over ``rounds`` rounds of ``calls`` back-to-back calls."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    clock = time.perf_counter_ns
    samples = []
    for _ in range(rounds):
        for _ in range(calls):
            start = clock()
            fn()
            samples.append(clock() - start)
        torch.cuda.synchronize()
    return statistics.median(samples) / 1e3


def eager_event_us(fn, calls: int = 1, rounds: int = 21) -> float:
    """Median GPU-side microseconds per call of ``calls`` eager calls between two CUDA events, each round
    starting from an idle GPU (``calls=1``: one call's latency, host work included)."""
    for _ in range(3):
        fn()
    samples = []
    for _ in range(rounds):
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1e3 / calls)
    return statistics.median(samples)


def graph_one_replay_us(fn) -> float:
    """GPU us of one replay of a CUDA graph holding one call of ``fn``, from an idle GPU, timed as one eager call is
    (:func:`eager_event_us`): the graph's launch latency included, which the per-call time of a many-call graph
    (:func:`~fmoe2.bench.timing.time_in_graph`) spreads over its calls."""
    graph = capture_graph(fn, calls=1, warmup_calls=2)
    return eager_event_us(graph.replay)


def _empty_launch():
    """``(x, compiled, bound, sources)``: the empty kernel on a 64-element tensor, compiled, and bound as plans bind
    their launches (``fmoe2.launch``)."""
    x = torch.randn(64, device="cuda")
    compiled = _empty_kernel[(1,)](x, 64)
    spec = LaunchSpec("empty", _empty_kernel, (1,), dict(x_ptr=x, n=64), {}, {})
    return x, compiled, bind_launches([spec], [compiled], [x.data_ptr()])[0], [x.data_ptr()]


def reference_costs() -> dict:
    """Host us of the bare operations the forward's cost is made of."""
    x, compiled, bound, sources = _empty_launch()
    y = torch.randn(64, device="cuda")
    index = torch.cuda.current_device()
    args = bound.arguments(sources)
    return {
        "triton_empty_kernel_jit": host_us(lambda: _empty_kernel[(1,)](x, 64)),
        # The compiled kernel's launcher as the JIT calls it, with the arguments bound ...
        "triton_empty_kernel_run": host_us(lambda: compiled.run(1, 1, 1, raw_stream(index), compiled.function,
                                                                compiled.packed_metadata, None, None, None, *args)),
        # ... and as a bound launch calls it (fmoe2.launch.direct_launcher: Triton 3.6's C launch function).
        "triton_empty_kernel_bound": host_us(lambda: bound(raw_stream(index), sources)),
        "torch_add": host_us(lambda: torch.add(x, y)),
        "torch_empty": host_us(lambda: torch.empty(64, device="cuda")),
    }


def empty_launch_one_call_us() -> float:
    """GPU us of one eager call of the empty kernel's bound launch from an idle GPU, timed as a forward's one call is
    (:func:`eager_event_us`: the events around the Python call): what one eager call of any forward takes beyond its
    kernels' own time, with fmoe2's launch path."""
    _, _, bound, sources = _empty_launch()
    index = torch.cuda.current_device()
    return eager_event_us(lambda: bound(raw_stream(index), sources))


def _shape_inputs(shape, M, gen):
    E, H, I, topk = shape
    opts = dict(device="cuda", generator=gen)
    x = torch.randn(M, H, dtype=torch.bfloat16, **opts)
    w1 = torch.randn(E, 2 * I, H, dtype=torch.bfloat16, **opts) / math.sqrt(H)
    w2 = torch.randn(E, H, I, dtype=torch.bfloat16, **opts) / math.sqrt(I)
    logits = torch.randn(M, E, **opts)
    tw, ti = torch.topk(logits.softmax(-1), topk, dim=-1)
    return x, fmoe2.prepare_weights(w1, w2), (w1, w2), tw, ti.to(torch.int32)


def forward_costs(name, shape, M, gen) -> dict:
    """Host us per call of the sort and the forward variants of one shape at batch ``M``, both launch
    modes, and the forward's eager and graph GPU times; also checks each result."""
    from .lora import make_adapters, make_token_lora_ids

    E, H, I, topk = shape
    x, prepared, plain, tw, ti = _shape_inputs(shape, M, gen)
    lora = fmoe2.prepare_lora(make_adapters(4, E, H, I, 16, gen))
    ids = make_token_lora_ids(M, 4, gen, 0.2)
    if M == 1:
        ids.fill_(1)  # one token: give it an adapter, so the adapter work is there to pay for
    ref = fmoe2.fused_moe_reference(x.float(), *plain, tw, ti)
    ref_lora = fmoe2.fused_moe_reference(x.float(), *plain, tw, ti, lora=lora, token_lora_ids=ids)
    variants = {
        "moe_sorting": (lambda: fmoe2.moe_sorting(ti, tw, E, 16), None),
        "fused_moe_fused": (lambda: fmoe2.fused_moe(x, prepared, None, tw, ti, path="fused"), ref),
        "fused_moe_two_stage": (lambda: fmoe2.fused_moe(x, prepared, None, tw, ti, path="two_stage"), ref),
        "fused_moe_auto": (lambda: fmoe2.fused_moe(x, prepared, None, tw, ti), ref),
        "fused_moe_lora_fused": (lambda: fmoe2.fused_moe(x, prepared, None, tw, ti, path="fused", lora=lora,
                                                         token_lora_ids=ids), ref_lora),
        "fused_moe_lora_two_stage": (lambda: fmoe2.fused_moe(x, prepared, None, tw, ti, path="two_stage", lora=lora,
                                                             token_lora_ids=ids), ref_lora),
    }
    row = {"shape": name, "M": M, "E": E, "H": H, "I": I, "topk": topk,
           "auto_path": fmoe2.get_config(M, E, H, I, topk, torch.bfloat16).path}
    for variant, (fn, reference) in variants.items():
        if reference is not None:
            out = fn()
            err = ((out.float() - reference).norm() / reference.norm()).item()
            if not math.isfinite(err) or err > 2.5e-2:
                raise SystemExit(f"{name} M={M} {variant}: relative error {err:.2e}")
            row[f"{variant}_rel_err"] = err
        row[f"{variant}_host_us"] = host_us(fn)
        set_launch_mode("jit")
        try:
            row[f"{variant}_host_us_jit_launch"] = host_us(fn)
        finally:
            set_launch_mode("direct")
    forward = variants["fused_moe_auto"][0]
    row["forward_graph_us"] = time_in_graph(forward)
    row["forward_graph_one_replay_us"] = graph_one_replay_us(forward)
    row["forward_eager_one_call_us"] = eager_event_us(forward)
    row["forward_eager_back_to_back_us"] = eager_event_us(forward, calls=EAGER_CALLS, rounds=5)
    plan = plan_of(x, prepared, None, tw, ti)
    row.update(one_launch_decode_costs(plan, forward))
    row.update(decode_kernel_costs(plan, x, prepared, tw, ti, forward))
    return row


def one_launch_decode_costs(plan, forward, turns: int = DECODE_TURNS) -> dict:
    """Host us and one-eager-call us of ``forward`` with its plan's one-launch decode (``plan.alone``) and with the
    same plan's sort path (what a CUDA-graph capture runs), in turns (the host's speed drifts within a run); the
    median of the turns' medians. Empty where the plan has no bound decode (two tokens or more, the two-stage
    path, adapters)."""
    if plan is None or plan.alone is None:
        return {}
    alone, samples = plan.alone, {}
    try:
        for _ in range(turns):
            for label, value in (("sort_path", None), ("one_launch", alone)):
                plan.alone = value
                samples.setdefault(f"decode_{label}_host_us", []).append(host_us(forward))
                samples.setdefault(f"decode_{label}_eager_one_call_us", []).append(eager_event_us(forward))
    finally:
        plan.alone = alone
    return {key: statistics.median(values) for key, values in samples.items()}


def decode_kernel_costs(plan, x, weights, topk_weights, topk_ids, forward) -> dict:
    """GPU us of the one-launch decode's kernel alone: its bound launch captured into a CUDA graph as a plain call
    (a captured forward takes the sort path instead), on an accumulator of its own, which must be zero again after
    the replays; its output is checked against ``forward``'s. Empty where the plan has no bound decode."""
    if plan is None or plan.alone is None:
        return {}
    out = torch.empty_like(x)
    call = call_key(x, weights, None, topk_weights, topk_ids, plan.activation, out, None, None, "auto", None, None)
    if call is None:
        raise SystemExit("the decode's call has no plan key (its arguments are not what the benchmark passes)")
    sources = call[1]
    accumulator = torch.zeros(plan.decode_numel, dtype=torch.float32, device=x.device)
    launch, index = plan.alone[0], x.device.index
    us = time_in_graph(lambda: launch(raw_stream(index), [*sources, accumulator.data_ptr()]))
    torch.cuda.synchronize()
    if accumulator.any():
        raise SystemExit("the one-launch decode left its accumulator non-zero")
    expected = forward()
    err = ((out.float() - expected.float()).norm() / expected.float().norm()).item()
    if not err < 1e-2:
        raise SystemExit(f"the captured one-launch decode is off the forward: relative error {err:.2e}")
    return {"decode_kernel_graph_us": us}


class TwoLayerMoE(torch.nn.Module):
    """Router, softmax top-k, ``fmoe2.fused_moe`` and a residual, ``COMPILED_LAYERS`` times. The experts'
    prepared weights are buffers, as a model's weights are parameters: static inputs to CUDA graphs."""

    def __init__(self, shape, gen, layers=COMPILED_LAYERS):
        super().__init__()
        E, H, I, topk = shape
        self.topk, self.hidden_size, self.intermediate_size, self.layers = topk, H, I, layers
        for layer in range(layers):
            router = torch.randn(E, H, device="cuda", dtype=torch.bfloat16, generator=gen) / math.sqrt(H)
            w1 = torch.randn(E, 2 * I, H, device="cuda", dtype=torch.bfloat16, generator=gen) / math.sqrt(H)
            w2 = torch.randn(E, H, I, device="cuda", dtype=torch.bfloat16, generator=gen) / math.sqrt(I)
            prepared = fmoe2.prepare_weights(w1, w2)
            self.register_buffer(f"router{layer}", router)
            self.register_buffer(f"w13_{layer}", prepared.w13)
            self.register_buffer(f"w2_{layer}", prepared.w2)

    def forward(self, x):
        for layer in range(self.layers):
            logits = torch.nn.functional.linear(x, getattr(self, f"router{layer}")).float()
            weights, ids = torch.topk(logits.softmax(-1), self.topk, dim=-1)
            experts = fmoe2.PreparedMoEWeights.from_prepared(getattr(self, f"w13_{layer}"), getattr(self, f"w2_{layer}"),
                                                             self.hidden_size, self.intermediate_size)
            x = x + fmoe2.fused_moe(x, experts, None, weights, ids)
        return x


def compiled_module_costs(name, shape, M, gen) -> dict:
    """Step time (GPU, CUDA events, back-to-back steps) of :class:`TwoLayerMoE` eager and compiled."""
    module = TwoLayerMoE(shape, gen)
    x = torch.randn(M, shape[1], device="cuda", dtype=torch.bfloat16, generator=gen)
    row = {"shape": name, "M": M, "layers": COMPILED_LAYERS}
    with torch.no_grad():
        eager_out = module(x)
        row["eager_step_us"] = eager_event_us(lambda: module(x), calls=50, rounds=5)
        row["eager_step_host_us"] = host_us(lambda: module(x), calls=50, rounds=5)
        for mode in ("default", "reduce-overhead"):
            torch._dynamo.reset()
            compiled = torch.compile(module, fullgraph=True, mode=mode)
            out = compiled(x)
            out = compiled(x).clone()
            err = ((out.float() - eager_out.float()).norm() / eager_out.float().norm()).item()
            if not math.isfinite(err) or err > 2.5e-2:
                raise SystemExit(f"{name} M={M} compiled ({mode}): relative error {err:.2e} to eager")
            row[f"compiled_{mode}_rel_err_to_eager"] = err
            row[f"compiled_{mode}_step_us"] = eager_event_us(lambda: compiled(x), calls=50, rounds=5)
    return row


def _us(value) -> str:
    return "-" if value is None else f"{value:.1f}"


def markdown(result: dict) -> str:
    ref = result["references"]
    lines = [f"# Host cost per call: {result['device']}", "",
             provenance_line(result), "",
             "| reference | host us per call |", "|---|---|"]
    lines += [f"| {k} | {v:.1f} |" for k, v in ref.items()]
    lines += ["", "Host us per call (plans launching directly / every launch through Triton's JIT), bf16, "
              "prepared weights, back-to-back calls:", "",
              "| shape | M | moe_sorting | fused | two-stage | LoRA fused | LoRA two-stage |", "|---|---|---|---|---|---|---|"]
    for row in result["forward"]:
        cells = [f"{row[f'{v}_host_us']:.1f} / {row[f'{v}_host_us_jit_launch']:.1f}"
                 for v in ("moe_sorting", "fused_moe_fused", "fused_moe_two_stage", "fused_moe_lora_fused",
                           "fused_moe_lora_two_stage")]
        lines.append(f"| {row['shape']} | {row['M']} | " + " | ".join(cells) + " |")
    lines += ["", "GPU time of one forward (`path=\"auto\"`), us: one eager call from an idle GPU (CUDA events), "
              "eager calls back to back, CUDA-graph replay (per call of a 10-call graph), and one replay of a "
              "one-call graph from an idle GPU (timed as the eager call, its launch latency included):", "",
              "| shape | M | path | eager, one call | eager, back to back | graph | one call / graph "
              "| graph, one replay | one call / one replay |",
              "|---|---|---|---|---|---|---|---|---|"]
    for row in result["forward"]:
        one_replay = row.get("forward_graph_one_replay_us")  # (results recorded before it have none)
        lines.append(f"| {row['shape']} | {row['M']} | {row['auto_path']} | {row['forward_eager_one_call_us']:.1f} | "
                     f"{row['forward_eager_back_to_back_us']:.1f} | {row['forward_graph_us']:.1f} | "
                     f"{row['forward_eager_one_call_us'] / row['forward_graph_us']:.2f}x | {_us(one_replay)} | "
                     + (f"{row['forward_eager_one_call_us'] / one_replay:.2f}x |" if one_replay else "- |"))
    floor = result.get("empty_launch_one_call_us")
    if floor is not None:
        lines += ["", f"One eager call of an empty kernel's bound launch from an idle GPU took {floor:.1f} us (timed as "
                  "the forward's one call, host time included): one eager call of a forward takes at least that plus "
                  "its kernels."]
    decode_rows = [row for row in result["forward"] if "decode_one_launch_host_us" in row]
    if decode_rows:
        lines += ["", "The one-launch decode (eager calls of one token: the fused kernel alone, no sort) against the "
                  "same plan's sort path (sort + fused kernel, what a CUDA graph captures), "
                  f"{DECODE_TURNS} turns each, us: host per call, and one eager call from an idle GPU over the graph "
                  "time:", "",
                  "| shape | M | host, sort path | host, one launch | one call, sort path | one call, one launch | "
                  "one launch / graph | decode kernel alone, graph |", "|---|---|---|---|---|---|---|---|"]
        for row in decode_rows:
            lines.append(f"| {row['shape']} | {row['M']} | {row['decode_sort_path_host_us']:.1f} | "
                         f"{row['decode_one_launch_host_us']:.1f} | {row['decode_sort_path_eager_one_call_us']:.1f} | "
                         f"{row['decode_one_launch_eager_one_call_us']:.1f} | "
                         f"{row['decode_one_launch_eager_one_call_us'] / row['forward_graph_us']:.2f}x | "
                         f"{_us(row.get('decode_kernel_graph_us'))} |")
    if result.get("compiled"):
        lines += ["", f"A {COMPILED_LAYERS}-layer MoE module (router, top-k, fused_moe, residual), us per step "
                  "(GPU, back-to-back steps):", "",
                  "| shape | M | eager | torch.compile | torch.compile reduce-overhead |", "|---|---|---|---|---|"]
        for row in result["compiled"]:
            lines.append(f"| {row['shape']} | {row['M']} | {row['eager_step_us']:.1f} | "
                         f"{row['compiled_default_step_us']:.1f} | {row['compiled_reduce-overhead_step_us']:.1f} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m fmoe2.bench.host", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated names from {sorted(ALL_SHAPES)}")
    p.add_argument("--m", default="1", help="comma-separated batch sizes")
    p.add_argument("--no-compile", action="store_true", help="skip the torch.compile module timings")
    p.add_argument("--out-dir", default=os.path.join("misc", "bench"), help="results go to <out-dir>/host/")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("the host-cost benchmark needs a CUDA or ROCm GPU")
    gen = torch.Generator(device="cuda").manual_seed(a.seed)
    result = {**run_record("python -m fmoe2.bench.host", argv), "references": reference_costs(),
              "empty_launch_one_call_us": empty_launch_one_call_us(), "forward": [],
              "compiled": []}
    print(json.dumps(result["references"]), flush=True)
    for name in a.shapes.split(","):
        for M in (int(m) for m in a.m.split(",")):
            row = forward_costs(name, ALL_SHAPES[name], M, gen)
            result["forward"].append(row)
            print(json.dumps(row), flush=True)
            if not a.no_compile:
                row = compiled_module_costs(name, ALL_SHAPES[name], M, gen)
                result["compiled"].append(row)
                print(json.dumps(row), flush=True)
    print(write_result(os.path.join(a.out_dir, "host", f"{device_config_name()}.json"), result, markdown))
    return 0


if __name__ == "__main__":
    sys.exit(main())
