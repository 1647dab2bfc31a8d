"""Tuner: ``python -m fmoe2.tune`` searches fused-kernel configs for shapes on this GPU.

    python -m fmoe2.tune --shape served|mixtral-8x7b,qwen3-30b-a3b|ExHxIxtopk [--m 1,16,128,1024,4096]
                         [--dtype bf16|fp16|fp8] [--deterministic] [--overwrite]

Writes ``fmoe2/gemm/configs/<device>/E=..,H=..,I=..,topk=..,dtype=...json`` (batch size -> best
config), which :func:`fmoe2.get_config` then picks by nearest batch size. Runs unchanged on ROCm.
It first says how many points and candidate configs it will time and roughly how long that takes, then after
each point what it picked and how long is left. Each point's entry is written as soon as it is found, and a rerun
skips the entries its files already hold: an interrupted run resumes where it stopped (``--overwrite`` retunes).
``--compile-workers N`` first runs each shape's candidates once in up to N processes side by side (as many as the GPU
memory holds, each with the shape's weights), so their kernels are in the Triton cache when the search times them.
``--deterministic`` tunes deterministic mode instead (``fused_moe(..., deterministic=True)``: two-stage
configs without K shares) into the file's ``"deterministic"`` entry, which it reads on GPUs whose tilings
were measured alike (``fmoe2.gemm.config.resolve_config``). ``--dtype fp8`` tunes fp8 weights (block scales, bf16
activations) into the bf16 file's ``"fp8"`` entry (``resolve_config`` reads it): each candidate as an fp8 forward runs
it (fitted to fp8), duplicates timed once.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from typing import List, Optional, Tuple

import torch

import fmoe2
from fmoe2.bench.__main__ import make_inputs
from fmoe2.bench.precompile import add_arguments as add_compile_arguments
from fmoe2.bench.precompile import compile_in_processes, run_each_once, share_of
from fmoe2.bench.search import deterministic_candidates, fmoe2_candidates, search_fmoe2
from fmoe2.gemm.config import CONFIG_DIR, ConfigMode, ConfigProblem, device_config_name, resolve_config, shape_file_name
from fmoe2.shapes import ALL_SHAPES, SERVED_SHAPES
from fmoe2.target import target_of

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.bfloat16}  # fp8: the activations' dtype
SECTIONS = ("deterministic", "fp8")  # entries of a tuned file besides the plain batch sizes


def fp8_candidates(M: int, E: int, H: int, I: int, topk: int, run) -> list:
    """:func:`~fmoe2.bench.search.fmoe2_candidates` as fp8 forwards run them: ``run(cfg)`` makes one forward
    with ``config=cfg`` and returns the config its plan holds (the fitted one). Duplicates removed, and
    candidates that fail to run (e.g. past the GPU's shared memory) left out."""
    seen, out = set(), []
    for cfg in fmoe2_candidates(M, E, H, I, topk, torch.bfloat16):
        try:
            fitted = run(cfg)
        except Exception as error:  # noqa: BLE001 - a candidate that cannot run is not a result
            print(f"  skipped {cfg.to_dict()}: {type(error).__name__}: {str(error)[:200]}", flush=True)
            continue
        if fitted not in seen:
            seen.add(fitted)
            out.append(fitted)
    return out


def _by_batch(entries: dict) -> dict:
    """``entries`` with its batch-size keys in increasing order, other keys after them."""
    return dict(sorted(entries.items(), key=lambda kv: (not kv[0].isdigit(), int(kv[0]) if kv[0].isdigit() else 0)))


# First guesses of one candidate's compile and timing, refined as the run goes: compiled in the timed process, and with
# --compile-workers 8 (H200, 2026-11-28: qwen3-235b-a22b-tp8 M=128, 66 candidates compiled in 8 processes in 16 s,
# searched in 22 s more).
SECONDS_PER_CANDIDATE = 2.5
SECONDS_PER_PRECOMPILED_CANDIDATE = 0.6


def tune_points(shapes: List[str], ms: List[int], a) -> List[Tuple[str, int]]:
    """The (shape, M) points still to tune: every pair, less those whose entry the shape's tuned file already holds
    (a rerun after an interruption resumes), unless ``--overwrite``."""
    todo = []
    for name in shapes:
        tuned = _load_tuned(_tuned_path(name, a))
        section = _section(a)
        done = tuned.get(section, {}) if section else tuned
        todo += [(name, M) for M in ms if a.overwrite or str(M) not in done]
    return todo


def _shape(name: str) -> Tuple[int, int, int, int]:
    return ALL_SHAPES[name] if name in ALL_SHAPES else tuple(int(v) for v in name.split("x"))


def _tuned_path(name: str, a) -> str:
    E, H, I, topk = _shape(name)
    return os.path.join(a.config_dir, device_config_name(), shape_file_name(E, H, I, topk, DTYPES[a.dtype]))


def _section(a) -> Optional[str]:
    return "deterministic" if a.deterministic else "fp8" if a.dtype == "fp8" else None


def _load_tuned(path: str) -> dict:
    if os.path.exists(path):
        with open(path) as f:
            return json.load(f)
    return {}


def _store(path: str, section: Optional[str], M: int, entry: dict) -> None:
    """Writes one tuned entry into the file at ``path`` at once (an interrupted run keeps what it finished)."""
    tuned = _load_tuned(path)
    (tuned.setdefault(section, {}) if section else tuned)[str(M)] = entry
    for name in SECTIONS:
        if name in tuned:
            tuned[name] = _by_batch(tuned[name])
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path + ".tmp", "w") as f:
        json.dump(_by_batch(tuned), f, indent=1)
        f.write("\n")
    os.replace(path + ".tmp", path)  # never a half-written file


def tune_point(name: str, M: int, prepared, dtype: torch.dtype, a, gen: torch.Generator) -> Tuple[dict, float, int]:
    """Searches one (shape, M) point; returns (the best config as stored, its us, candidates timed)."""
    E, H, I, topk = _shape(name)
    x, tw, ti = make_inputs(M, E, H, I, topk, gen)
    x, out = x.to(dtype), torch.empty(M, H, device="cuda", dtype=dtype)
    candidates = base_candidates(name, M, a) if a.deterministic else None
    if a.dtype == "fp8":
        def fitted(cfg, x=x, tw=tw, ti=ti):
            fmoe2.fused_moe(x, prepared, None, tw, ti, config=cfg)  # (raises for a candidate that cannot run)
            # The config that forward ran, from the resolver the forward asks.
            return resolve_config(ConfigProblem(M, E, H, I, topk, dtype), ConfigMode(fp8=True), target_of(), cfg)
        candidates = fp8_candidates(M, E, H, I, topk, fitted)
    best, us, results = search_fmoe2(M, E, H, I, topk, dtype,
                                     lambda cfg: lambda: fmoe2.fused_moe(x, prepared, None, tw, ti, out=out, config=cfg,
                                                                         deterministic=a.deterministic),
                                     f"{name} M={M}", candidates)
    if a.dtype == "fp8":
        best = fitted(best)  # (a tensor-descriptor twin runs with pointer loads: stored as it ran)
    return best.to_dict(), us, len(results)


def base_candidates(name: str, M: int, a) -> list:
    """The configs a point's search starts from (before fp8's fitting and the tensor-descriptor and PDL twins)."""
    E, H, I, topk = _shape(name)
    if a.deterministic:
        return deterministic_candidates(M, E, H, I, topk, DTYPES[a.dtype])
    return fmoe2_candidates(M, E, H, I, topk, torch.bfloat16 if a.dtype == "fp8" else DTYPES[a.dtype])


def compile_candidates(name: str, ms: List[int], a) -> None:
    """Runs this process's share (``--compile-share``) of each point's candidates once: their kernels land in the
    Triton cache, which the timed search then reads (``fmoe2/bench/precompile.py``)."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    prepared = prepared_weights(name, a, gen)
    E, H, I, topk = _shape(name)
    dtype = DTYPES[a.dtype]
    for M in ms:
        x, tw, ti = make_inputs(M, E, H, I, topk, gen)
        x, out = x.to(dtype), torch.empty(M, H, device="cuda", dtype=dtype)
        run_each_once([lambda cfg=cfg: fmoe2.fused_moe(x, prepared, None, tw, ti, out=out, config=cfg,
                                                       deterministic=a.deterministic)
                       for cfg in share_of(base_candidates(name, M, a), a.compile_share)])


def compile_in_parallel(name: str, ms: List[int], a) -> None:
    """Compiles shape ``name``'s candidates at ``ms`` in up to ``--compile-workers`` processes at once."""
    E, H, I, topk = _shape(name)
    weight_bytes = E * 3 * H * I * (1 if a.dtype == "fp8" else DTYPES[a.dtype].itemsize)
    command = [sys.executable, "-m", "fmoe2.tune", "--shape", name, "--m", ",".join(map(str, ms)), "--dtype", a.dtype]
    compile_in_processes(command + (["--deterministic"] if a.deterministic else []), a.compile_workers, weight_bytes,
                         name)


def prepared_weights(name: str, a, gen: torch.Generator):
    """Random expert weights of shape ``name`` in ``--dtype``, prepared."""
    E, H, I, topk = _shape(name)
    dtype = DTYPES[a.dtype]
    w1 = (torch.randn(E, 2 * I, H, device="cuda", generator=gen) / math.sqrt(H)).to(dtype)
    w2 = (torch.randn(E, H, I, device="cuda", generator=gen) / math.sqrt(I)).to(dtype)
    if a.dtype == "fp8":
        (q1, s1), (q2, s2) = fmoe2.quantize_fp8_weights(w1, "block"), fmoe2.quantize_fp8_weights(w2, "block")
        del w1, w2
        return fmoe2.prepare_weights(q1, q2, w1_scale=s1, w2_scale=s2, block_shape=(128, 128))
    return fmoe2.prepare_weights(w1, w2)


def _minutes(seconds: float) -> str:
    return f"{seconds / 60:.0f} min" if seconds >= 90 else f"{seconds:.0f} s"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m fmoe2.tune", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--shape", required=True,
                   help=f"comma-separated names from {sorted(ALL_SHAPES)}, 'served' ({len(SERVED_SHAPES)} served "
                        f"models' shapes: fmoe2.shapes.SERVED_SHAPES), or one shape ExHxIxtopk (e.g. 32x2880x2880x4)")
    p.add_argument("--m", default="1,16,128,1024,4096", help="comma-separated batch sizes to tune")
    p.add_argument("--dtype", default="bf16", choices=sorted(DTYPES),
                   help="input and weight dtype (fp8: e4m3 weights with 128 x 128 block scales, bf16 inputs)")
    p.add_argument("--config-dir", default=CONFIG_DIR,
                   help="where the tuned file <device>/E=..,H=..,I=..,topk=..,dtype=...json is written")
    p.add_argument("--deterministic", action="store_true", help="tune deterministic mode (its own entry)")
    p.add_argument("--overwrite", action="store_true",
                   help="retune batch sizes the tuned file already holds (default: resume, skipping them)")
    add_compile_arguments(p, "the search")
    a = p.parse_args(argv)
    if a.deterministic and a.dtype == "fp8":
        p.error("--deterministic tunes 16-bit weights (fp8 weights take one fixed tiling in that mode)")
    shapes = list(SERVED_SHAPES) if a.shape == "served" else _shape_names(a.shape, p)
    if not torch.cuda.is_available():
        p.error("tuning needs a CUDA or ROCm GPU")
    ms = [int(m) for m in a.m.split(",")]
    if a.compile_share:
        compile_candidates(shapes[0], ms, a)
        return 0
    todo = tune_points(shapes, ms, a)
    skipped = len(shapes) * len(ms) - len(todo)
    dtype = DTYPES[a.dtype]
    planned = sum(len(base_candidates(n, M, a)) + 4 for n, M in todo)  # + tma twins and a pdl twin
    per = SECONDS_PER_PRECOMPILED_CANDIDATE if a.compile_workers else SECONDS_PER_CANDIDATE
    print(f"{len(todo)} points to tune ({skipped} already in their tuned files: --overwrite retunes them), about "
          f"{planned} candidate configs: roughly {_minutes(planned * per)} at {per} s each (compiling included)",
          flush=True)
    t0, timed, current, prepared = time.time(), 0, None, None
    gen = torch.Generator(device="cuda").manual_seed(0)
    for i, (name, M) in enumerate(todo):
        if name != current:
            prepared, current = None, name
            torch.cuda.empty_cache()
            if a.compile_workers:
                compile_in_parallel(name, [m for n, m in todo if n == name], a)
            prepared = prepared_weights(name, a, gen)
        entry, us, count = tune_point(name, M, prepared, dtype, a, gen)
        path = _tuned_path(name, a)
        _store(path, _section(a), M, entry)
        timed += count
        elapsed = time.time() - t0
        left = (planned - timed) * elapsed / max(timed, 1)
        print(f"[{i + 1}/{len(todo)}] {name} M={M}: {us:.1f} us with {entry} -> {path}; {_minutes(elapsed)} "
              f"so far, about {_minutes(max(left, 0))} left", flush=True)
    return 0


def _shape_names(value: str, parser) -> List[str]:
    """Named shapes of ``--shape`` (comma-separated), or the one custom ``ExHxIxtopk`` (or legacy ``E,H,I,topk``)."""
    parts = value.split(",")
    if all(part in ALL_SHAPES for part in parts):
        return parts
    if len(parts) == 4 and all(part.isdigit() for part in parts):
        return ["x".join(parts)]
    if len(parts) == 1 and len(value.split("x")) == 4 and all(v.isdigit() for v in value.split("x")):
        return [value]
    parser.error(f"--shape: names from {sorted(ALL_SHAPES)}, 'served', or one ExHxIxtopk; got {value!r}")


if __name__ == "__main__":
    sys.exit(main())
