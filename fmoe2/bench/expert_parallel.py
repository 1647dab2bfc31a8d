"""Expert parallelism with fmoe2 as transformers' experts backend, one process per rank.

    python -m fmoe2.bench.expert_parallel save DIR [--model qwen3-30b-a3b] [--layers 4]
    python -m torch.distributed.run --nproc-per-node 2 -m fmoe2.bench.expert_parallel decode DIR --out ep2.json
    python -m fmoe2.bench.expert_parallel decode DIR --out one.json            (one process: no parallelism)
    python -m torch.distributed.run --nproc-per-node 2 -m fmoe2.bench.expert_parallel decode DIR \
        --backend fmoe2,grouped_mm --out 'ep2_{backend}.json'                   (each backend in turn, one launch)
    python -m fmoe2.bench.expert_parallel compare one.json ep2.json [--min 0.95]
    python -m fmoe2.bench.expert_parallel table one.json ep2.json ep2_grouped_mm.json   (markdown: step times)

``save`` writes a model built from a real config's layer sizes with random weights (``fmoe2.bench.model``;
no download). ``decode`` loads a saved model and decodes greedily: under ``torch.distributed.run`` with
N processes, transformers (5.18+) splits it with ``DistributedConfig(tp_size=N, tp_plan="auto",
ep_size=N)``: the model's expert-parallel plan gives each rank E/N experts, and its experts backend
receives the ids of other ranks' experts as ids >= E/N with weight 0, which fmoe2 drops (the dense
layers take the model's own tensor-parallel plan). One process runs the whole model. NCCL on GPUs (one
per rank, ``cuda:LOCAL_RANK``), gloo on the CPU (set ``TRITON_INTERPRET=1`` there: the kernels run
under the Triton interpreter). It records the greedy tokens of ``--steps`` steps after a fixed random
prompt, how many experts calls each rank sent to fmoe2 (0 would mean transformers' own backend ran),
and with ``--time`` the decode step time per token at each ``--batch`` size (median of ``--repeats``
runs, after a warm-up). Several comma-separated ``--backend`` names decode in turn in the same processes, each
with the model loaded again, into one result each (``{backend}`` in ``--out`` is replaced by its name): one start of
the processes for all of them. ``compare`` prints the fraction of equal greedy tokens of two runs and exits 1
below ``--min``; ``table`` prints the decode step times of several runs side by side, with each run's provenance.

transformers' expert parallelism needs ``accelerate`` installed (it places the shards).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

PROMPT_TOKENS = 8


def _rank_device(world: int) -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def load(model_dir: str, backend: str, dtype: torch.dtype, world: int):
    """The saved model on this rank: split over ``world`` ranks by transformers' expert parallelism, or whole."""
    from transformers import AutoModelForCausalLM

    import fmoe2.integrations.transformers  # noqa: F401  (registers the "fmoe2" experts backend)

    if world > 1:
        from transformers.distributed import DistributedConfig

        config = DistributedConfig(tp_size=world, tp_plan="auto", ep_size=world)
        return AutoModelForCausalLM.from_pretrained(model_dir, experts_implementation=backend, dtype=dtype,
                                                    distributed_config=config)
    model = AutoModelForCausalLM.from_pretrained(model_dir, experts_implementation=backend, dtype=dtype)
    return model.to(_rank_device(1))


def count_fmoe2_calls():
    """Wraps the backend's fused_moe: returns a list whose length is the number of calls made since."""
    import fmoe2.integrations.transformers as backend

    calls = []
    inner = backend.fused_moe

    def counted(*args, **kwargs):
        calls.append(1)
        return inner(*args, **kwargs)

    backend.fused_moe = counted
    return calls


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    if torch.distributed.is_initialized():
        torch.distributed.barrier()


def decode_step_ms(model, ids, steps: int, repeats: int) -> float:
    """Median ms per decode step: (generate of ``steps`` tokens - generate of one) / (steps - 1)."""
    def timed(n):
        _sync(ids.device)
        start = time.perf_counter()
        model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)
        _sync(ids.device)
        return time.perf_counter() - start

    timed(steps)  # warm-up: compiles and plans
    return statistics.median((timed(steps) - timed(1)) / (steps - 1) * 1e3 for _ in range(repeats))


def decode(args) -> int:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}[args.dtype]
    calls = count_fmoe2_calls()
    for backend in args.backend.split(","):
        result = decode_backend(args, backend, dtype, world, calls)
        if rank == 0:
            import transformers

            from .provenance import run_record

            prog = "python -m fmoe2.bench.expert_parallel"
            if world > 1:  # (the launcher is part of the command: without it the same arguments run one process)
                prog = f"python -m torch.distributed.run --nproc-per-node {world} -m fmoe2.bench.expert_parallel"
            result.update(run_record(prog), transformers=transformers.__version__)
            with open(args.out.replace("{backend}", backend), "w") as f:
                json.dump(result, f, indent=1)
            print(json.dumps({p["batch"]: {k: v for k, v in p.items() if k != "tokens"} for p in result["points"]}))
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    return 0


def decode_backend(args, backend: str, dtype: torch.dtype, world: int, calls: list) -> dict:
    """The decode result of one backend (every rank's calls into fmoe2 gathered; ``calls``: count_fmoe2_calls's)."""
    model = load(args.model_dir, backend, dtype, world)
    device = _rank_device(world)  # where load() put this rank's share
    vocab = model.config.get_text_config().vocab_size
    gen = torch.Generator().manual_seed(args.seed)
    batches = [int(b) for b in args.batch.split(",")]
    result = {"world_size": world, "backend": backend, "dtype": args.dtype, "steps": args.steps, "points": []}
    for batch in batches:
        ids = torch.randint(0, vocab, (batch, PROMPT_TOKENS), generator=gen).to(device)
        before = len(calls)
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=args.steps, min_new_tokens=args.steps, do_sample=False)
        point = {"batch": batch, "tokens": out[:, PROMPT_TOKENS:].tolist(), "fmoe2_calls": len(calls) - before}
        if args.time:
            with torch.no_grad():
                point["decode_step_ms"] = decode_step_ms(model, ids, args.steps, args.repeats)
        result["points"].append(point)
    if world > 1:  # every rank's calls into fmoe2
        counts = [None] * world
        torch.distributed.all_gather_object(counts, [p["fmoe2_calls"] for p in result["points"]])
        for i, point in enumerate(result["points"]):
            point["fmoe2_calls"] = [c[i] for c in counts]
    else:
        for point in result["points"]:
            point["fmoe2_calls"] = [point["fmoe2_calls"]]
    return result


def agreement(a: dict, b: dict) -> float:
    """Fraction of equal greedy tokens over the batches the two runs share."""
    equal = total = 0
    points_b = {p["batch"]: p for p in b["points"]}
    for p in a["points"]:
        if p["batch"] in points_b:
            ta, tb = torch.tensor(p["tokens"]), torch.tensor(points_b[p["batch"]]["tokens"])
            equal += int((ta == tb).sum())
            total += ta.numel()
    if total == 0:
        raise ValueError("the runs share no batch size")
    return equal / total


def step_time_table(runs: dict) -> str:
    """Markdown: decode ms per step of each run (``{name: decode result}``, columns; the ``table`` command names them
    by their paths as given) at each batch size (rows), then each run's backend, ranks and provenance."""
    batches = sorted({p["batch"] for r in runs.values() for p in r["points"] if "decode_step_ms" in p})
    names = list(runs)
    label = {n: f"{runs[n]['backend']}, {runs[n]['world_size']} rank{'s' if runs[n]['world_size'] > 1 else ''}"
             for n in names}
    lines = ["| batch | " + " | ".join(label[n] for n in names) + " |", "|---|" + "---|" * len(names)]
    for batch in batches:
        cells = []
        for n in names:
            point = next((p for p in runs[n]["points"] if p["batch"] == batch), {})
            cells.append(f"{point['decode_step_ms']:.2f}" if "decode_step_ms" in point else "-")
        lines.append(f"| {batch} | " + " | ".join(cells) + " |")
    lines.append("")
    for n in names:
        r = runs[n]
        versions = (f"torch {r.get('torch', '?')}, Triton {r.get('triton', '?')}, "
                    f"transformers {r.get('transformers', '?')}")
        lines.append(f"- `{n}`: {label[n]}, {r['dtype']}, {r.get('device', '?')}, {r.get('date', '?')}, {versions}; "
                     f"`{r.get('command', '?')}`")
    return "\n".join(lines) + "\n"


def save(args) -> int:
    from .model import build_model

    model = build_model(args.model, args.layers)
    model.save_pretrained(args.model_dir)
    print(f"saved {args.model} ({args.layers} layers) to {args.model_dir}")
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m fmoe2.bench.expert_parallel", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("save", help="save a model of a real config's layer sizes with random weights")
    s.add_argument("model_dir")
    s.add_argument("--model", default="qwen3-30b-a3b", help="a name of fmoe2.bench.model.MODELS")
    s.add_argument("--layers", type=int, default=4)
    d = sub.add_parser("decode", help="greedy decode of a saved model (under torch.distributed.run: split over ranks)")
    d.add_argument("model_dir")
    d.add_argument("--out", required=True,
                   help="result JSON (written by rank 0); {backend} in it is replaced by the backend's name")
    d.add_argument("--backend", default="fmoe2",
                   help="experts_implementation; comma-separated: each in turn (--out then needs {backend})")
    d.add_argument("--dtype", default="bf16", choices=("bf16", "fp16", "fp32"))
    d.add_argument("--steps", type=int, default=16, help="greedy tokens per sequence")
    d.add_argument("--batch", default="2", help="comma-separated batch sizes")
    d.add_argument("--seed", type=int, default=0, help="seed of the prompts")
    d.add_argument("--time", action="store_true", help="also time the decode steps")
    d.add_argument("--repeats", type=int, default=3, help="timed runs per batch with --time")
    c = sub.add_parser("compare", help="fraction of equal greedy tokens of two decode results")
    c.add_argument("a")
    c.add_argument("b")
    c.add_argument("--min", type=float, default=0.95, help="exit 1 below this fraction")
    t = sub.add_parser("table", help="markdown table of the decode step times of several decode results")
    t.add_argument("results", nargs="+")
    args = p.parse_args(argv)
    if args.command == "save":
        return save(args)
    if args.command == "decode":
        if "," in args.backend and "{backend}" not in args.out:
            p.error("several --backend names write one result each: put {backend} in --out")
        return decode(args)
    if args.command == "table":
        runs = {}
        for path in args.results:  # (by path as given: two files of one name in two folders stay two columns)
            with open(path) as f:
                runs[path] = json.load(f)
        print(step_time_table(runs), end="")
        return 0
    with open(args.a) as fa, open(args.b) as fb:
        frac = agreement(json.load(fa), json.load(fb))
    print(f"equal greedy tokens: {frac:.1%}")
    return 0 if frac >= args.min else 1


if __name__ == "__main__":
    sys.exit(main())
