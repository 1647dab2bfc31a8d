"""Tuner: ``python -m fmoe2.tune`` searches fused-kernel configs for shapes on this GPU.

    python -m fmoe2.tune --shape served|mixtral-8x7b,qwen3-30b-a3b|ExHxIxtopk [--m 1,16,128,1024,4096]
                         [--dtype bf16|fp16|fp8] [--deterministic] [--overwrite]

Writes ``fmoe2/gemm/configs/<device>/E=..,H=..,I=..,topk=..,dtype=...json`` (batch size -> best
config), which :func:`fmoe2.get_config` then picks by nearest batch size. Runs unchanged on ROCm.
It first says how many points and candidate configs it will time and roughly how long that takes, then after
each point what it picked and how long is left. Each point's entry is written as soon as it is found, and a rerun
skips the checked entries its files already hold: an interrupted run resumes where it stopped (``--overwrite``
retunes).
``--compile-workers N`` first runs each shape's candidates once in up to N processes side by side (as many as the GPU
memory holds, each with the shape's weights), so their kernels are in the Triton cache when the search times them.
``--deterministic`` tunes deterministic mode instead (``fused_moe(..., deterministic=True)``: two-stage
configs without K shares) into the file's ``"deterministic"`` entry, which it reads on GPUs whose tilings
were measured alike (``fmoe2.gemm.config.resolve_config``). ``--dtype fp8`` tunes fp8 weights (block scales, bf16
activations) into the bf16 file's ``"fp8"`` entry (``resolve_config`` reads it): each candidate as an fp8 forward runs
it (fitted to fp8), duplicates timed once. ``--weights mxfp4|int4|int8`` tunes prepared weight-only quantized weights
(random weights quantized: mxfp4, int4 with the shape's group of ``fmoe2.bench.quant4.int4_group``, int8 per channel;
activations in ``--dtype``) into that file's entry of the format's name (``resolve_config`` reads it before the 16-bit
pick), each candidate stored as the forward fits it (``fit_packed_config``).

Every entry is checked before it is written: the picked config runs two eager forwards, each into an output poisoned
with NaN, on the point's inputs, and both must be finite and within the correctness grid's bound of the float32
reference (``fmoe2.bench.correctness.BOUND``: bf16 2.5e-2; fp8 2e-2 against the reference with the same
quantization). A config that fails gives way to the next fastest one, reported. The file's ``"checked"`` key keeps
each entry's error, bound and how many faster configs failed (``resolve_config`` reads only the entries); an entry
without that record (tuned before entries were checked) counts as still to tune.
``--gpus N`` (or ``all``) spreads the shapes over N visible GPUs: one process per GPU, each pinned to its GPU by
``CUDA_VISIBLE_DEVICES`` (ROCm: ``HIP_VISIBLE_DEVICES``), each tuning whole shapes (so no two write one file), the
largest estimated work first.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import threading
import time
from typing import Callable, List, Optional, Tuple

import torch

import fmoe2
from fmoe2.bench.problems import make_inputs
from fmoe2.bench.correctness import BOUND, relative_error
from fmoe2.bench.timing import capture_graph
from fmoe2.bench.precompile import add_arguments as add_compile_arguments
from fmoe2.bench.precompile import compile_in_processes, run_each_once, share_of
from fmoe2.bench.quant4 import int4_group, quantized_expertwise
from fmoe2.bench.search import FINALISTS, deterministic_candidates, fmoe2_candidates, search_fmoe2
from fmoe2.formats import WEIGHT_ONLY_FORMATS
from fmoe2.gemm.config import (CONFIG_DIR, ConfigMode, ConfigProblem, FusedMoEConfig, device_config_name,
                               resolve_config, shape_file_name, tuned_section, TUNED_SECTIONS)
from fmoe2.shapes import ALL_SHAPES, SERVED_SHAPES
from fmoe2.target import target_of

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.bfloat16}  # fp8: the activations' dtype
CHECKED = "checked"  # a tuned file's record of each entry's check: section ("plain" for the plain entries) -> M -> check
PLAIN = "plain"
CHECK_CALLS = 2  # eager forwards of a picked config compared with the reference (a race shows as one that differs)


def fitted_candidates(M: int, E: int, H: int, I: int, topk: int, dtype: torch.dtype, run,
                      weight_format: Optional[str] = None, fp8: bool = False) -> list:
    """:func:`~fmoe2.bench.search.fmoe2_candidates` of fp8 or weight-only (``weight_format``) weights as their
    forwards run them: ``run(cfg)`` makes one forward with ``config=cfg`` and returns the config its plan holds (the
    fitted one). Duplicates removed, and candidates that fail to run (e.g. past the GPU's shared memory) left
    out."""
    seen, out = set(), []
    for cfg in fmoe2_candidates(M, E, H, I, topk, dtype, weight_format, fp8):
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
    """``entries`` with its batch-size keys in increasing order, then the checks' records, then the entries of the
    modes (:data:`TUNED_SECTIONS`' order), other keys last: one order however a file was written."""
    named = (CHECKED, PLAIN, *TUNED_SECTIONS)

    def place(key: str):
        if key.isdigit():
            return 0, int(key)
        return (1, named.index(key)) if key in named else (2, 0)
    return dict(sorted(entries.items(), key=lambda kv: place(kv[0])))


# First guesses of one candidate's compile and timing, refined as the run goes: compiled in the timed process, and with
# --compile-workers 8 (H200, 2026-11-28: qwen3-235b-a22b-tp8 M=128, 66 candidates compiled in 8 processes in 16 s,
# searched in 22 s more).
SECONDS_PER_CANDIDATE = 2.5
SECONDS_PER_PRECOMPILED_CANDIDATE = 0.6


def tune_points(shapes: List[str], ms: List[int], a) -> List[Tuple[str, int]]:
    """The (shape, M) points still to tune: every pair, less those whose entry the shape's tuned file already holds
    with the record of its check (a rerun after an interruption resumes; an entry tuned before entries were checked is
    tuned again), unless ``--overwrite``."""
    todo = []
    for name in shapes:
        tuned = _load_tuned(_tuned_path(name, a))
        section = _section(a)
        done = tuned.get(section, {}) if section else tuned
        checked = tuned.get(CHECKED, {}).get(section or PLAIN, {})
        todo += [(name, M) for M in ms if a.overwrite or str(M) not in done or str(M) not in checked]
    return todo


def _shape(name: str) -> Tuple[int, int, int, int]:
    return ALL_SHAPES[name] if name in ALL_SHAPES else tuple(int(v) for v in name.split("x"))


def _tuned_path(name: str, a) -> str:
    E, H, I, topk = _shape(name)
    return os.path.join(a.config_dir, device_config_name(), shape_file_name(E, H, I, topk, DTYPES[a.dtype]))


def _mode(a) -> ConfigMode:
    """The forwards' :class:`ConfigMode`: fp8 or a weight-only format's weights, or 16-bit ones."""
    return ConfigMode(fp8=a.dtype == "fp8", weight_format=a.weights or "16bit")


def _section(a) -> Optional[str]:
    return "deterministic" if a.deterministic else tuned_section(_mode(a))


def _load_tuned(path: str) -> dict:
    if os.path.exists(path):
        with open(path) as f:
            return json.load(f)
    return {}


def _store(path: str, section: Optional[str], M: int, entry: dict, check: Optional[dict] = None) -> None:
    """Writes one tuned entry (and its check's record) into the file at ``path`` at once (an interrupted run keeps what
    it finished)."""
    tuned = _load_tuned(path)
    (tuned.setdefault(section, {}) if section else tuned)[str(M)] = entry
    records = tuned.setdefault(CHECKED, {})
    kept = {m: r for m, r in records.get(section or PLAIN, {}).items() if m != str(M)}  # (no stale record)
    records[section or PLAIN] = _by_batch({**kept, **({str(M): check} if check is not None else {})})
    if not any(records.values()):
        del tuned[CHECKED]
    else:
        tuned[CHECKED] = _by_batch(records)
    for name in TUNED_SECTIONS:
        if name in tuned:
            tuned[name] = _by_batch(tuned[name])
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path + ".tmp", "w") as f:
        json.dump(_by_batch(tuned), f, indent=1)
        f.write("\n")
    os.replace(path + ".tmp", path)  # never a half-written file


def checked_pick(results: list, forward: Callable, reference: torch.Tensor, out_dtype: torch.dtype, bound: float,
                 label: str, replay: Optional[Callable] = None, ranked: bool = False):
    """The fastest of ``results`` (``(config, us)`` pairs; tried by ``us``, or in the order given where ``ranked``,
    as :func:`fmoe2.bench.search.search_fmoe2` ranks them) whose ``forward(config, out)`` (``out``: ``[M, H]`` of
    ``out_dtype``) passes the check against ``reference`` (module docstring), with its check record (``rel_err``: the
    largest of the calls' errors, ``bound``, ``faster_failed``). ``replay(forward_of_out, out)``, where given, runs
    the forward once more as the search timed it (a CUDA graph replay: at one token eager calls run the one-launch
    decode, graphs the sort path). RuntimeError when none passes."""
    rejected = []
    for cfg, us in (results if ranked else sorted(results, key=lambda r: r[1])):
        errors = []
        calls = [lambda o, cfg=cfg: forward(cfg, o)] * CHECK_CALLS
        if replay is not None:
            calls.append(lambda o, cfg=cfg: replay(lambda into: forward(cfg, into), o))
        for call in calls:
            out = torch.full_like(reference, float("nan"), dtype=out_dtype)
            try:
                call(out)
            except Exception as error:  # noqa: BLE001 - a config that cannot run again is rejected like a wrong one
                errors.append(float("inf"))
                print(f"  {label}: {cfg.to_dict()} failed on its check: {type(error).__name__}: {error}", flush=True)
                break
            finite = bool(torch.isfinite(out).all())  # (synchronises)
            errors.append(relative_error(out, reference) if finite else float("inf"))
        if max(errors) <= bound:
            return cfg, us, dict(rel_err=max(errors), bound=bound, faster_failed=len(rejected),
                                 graph=replay is not None)
        rejected.append(cfg)
        print(f"  {label}: {cfg.to_dict()} ({us:.1f} us) is off the reference by {max(errors):.2e} > {bound}: "
              "the next fastest config is checked", flush=True)
    raise RuntimeError(f"{label}: none of the {len(results)} configs timed passed the check against the reference")


def replayed(forward_into: Callable, out: torch.Tensor) -> None:
    """``forward_into(out)`` captured in a CUDA graph, ``out`` poisoned with NaN again after the capture, and the
    graph replayed once."""
    graph = capture_graph(lambda: forward_into(out))
    out.fill_(float("nan"))
    graph.replay()
    graph.reset()


def point_inputs(name: str, M: int, prepared, dtype: torch.dtype, a, gen: torch.Generator):
    """One point's random inputs, its forward ``forward(cfg, out)`` and the reference it is checked against (float32
    throughout for 16-bit weights; fp8: the reference quantizes the activations as the kernels do)."""
    E, H, I, topk = _shape(name)
    x, tw, ti = make_inputs(M, E, H, I, topk, gen)
    x = x.to(dtype)
    # (weight-only formats: the dequantized weights exactly, so the 16-bit bound holds)
    reference = fmoe2.fused_moe_reference(x if a.dtype == "fp8" else x.float(), prepared, None, tw, ti).float()

    def forward(cfg, out):
        return fmoe2.fused_moe(x, prepared, None, tw, ti, out=out, config=cfg, deterministic=a.deterministic)
    return x, tw, ti, forward, reference


def tune_point(name: str, M: int, prepared, dtype: torch.dtype, a, gen: torch.Generator) -> Tuple[dict, float, int, dict]:
    """Searches one (shape, M) point; returns (the best config that passed its check, as stored, its us, candidates
    timed, the check's record)."""
    E, H, I, topk = _shape(name)
    x, tw, ti, forward, reference = point_inputs(name, M, prepared, dtype, a, gen)
    out = torch.empty(M, H, device="cuda", dtype=dtype)
    candidates = base_candidates(name, M, a) if a.deterministic else None
    stored_as_run = a.dtype == "fp8" or a.weights is not None
    if stored_as_run:
        def fitted(cfg, x=x, tw=tw, ti=ti):
            fmoe2.fused_moe(x, prepared, None, tw, ti, config=cfg)  # (raises for a candidate that cannot run)
            # The config that forward ran, from the resolver the forward asks.
            return resolve_config(ConfigProblem(M, E, H, I, topk, dtype), _mode(a), target_of(), cfg)
        candidates = fitted_candidates(M, E, H, I, topk, dtype, fitted, a.weights, a.dtype == "fp8")
    _, _, results = search_fmoe2(M, E, H, I, topk, dtype, lambda cfg: lambda: forward(cfg, out), f"{name} M={M}",
                                 candidates, fit=fitted if stored_as_run else None)
    best, us, check = checked_pick(results, forward, reference, x.dtype, BOUND["fp8" if a.dtype == "fp8" else "bf16"],
                                   f"{name} M={M}", replay=replayed, ranked=True)
    if stored_as_run:
        best = fitted(best)  # (e.g. fp8: a tensor-descriptor twin runs with pointer loads: stored as it ran)
    return best.to_dict(), us, len(results), check


def recheck(shapes: List[str], ms: List[int], a) -> int:
    """``--recheck``: each entry the shapes' tuned files hold at ``ms`` (of ``--dtype``'s, ``--weights``' or
    ``--deterministic``'s section) checked again as the tuner checks a pick, its record rewritten; no search. Returns
    how many failed (their entries stay, reported)."""
    failed = 0
    gen = torch.Generator(device="cuda").manual_seed(0)
    for name in shapes:
        path, section = _tuned_path(name, a), _section(a)
        tuned = _load_tuned(path)
        entries = tuned.get(section, {}) if section else {m: c for m, c in tuned.items() if m.isdigit()}
        points = [M for M in ms if str(M) in entries]
        if not points:
            continue
        prepared = prepared_weights(name, a, gen)
        for M in points:
            x, _, _, forward, reference = point_inputs(name, M, prepared, DTYPES[a.dtype], a, gen)
            cfg = FusedMoEConfig.from_dict(entries[str(M)])
            try:
                _, _, check = checked_pick([(cfg, 0.0)], forward, reference, x.dtype,
                                           BOUND["fp8" if a.dtype == "fp8" else "bf16"], f"{name} M={M}",
                                           replay=replayed)
            except RuntimeError as error:
                failed += 1
                print(f"FAILED {name} M={M}: {error}", flush=True)
                continue
            _store(path, section, M, entries[str(M)], check)
            print(f"{name} M={M}: error {check['rel_err']:.1e} (eager and a graph replay) -> {path}", flush=True)
        del prepared
        torch.cuda.empty_cache()
    return failed


def base_candidates(name: str, M: int, a) -> list:
    """The configs a point's search starts from (before fp8's fitting and the tensor-descriptor and PDL twins)."""
    E, H, I, topk = _shape(name)
    if a.deterministic:
        return deterministic_candidates(M, E, H, I, topk, DTYPES[a.dtype])
    return fmoe2_candidates(M, E, H, I, topk, torch.bfloat16 if a.dtype == "fp8" else DTYPES[a.dtype], a.weights,
                            a.dtype == "fp8")


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
    # About what a compiling process holds at its peak: the 16-bit draw, its prepared copy and the copies preparing
    # makes on the way (about 2.5x the draw's bytes, read from prepare_weights); fp8: also the quantizer's float32
    # chunks, about 5 GiB whatever the shape. worker_count leaves a fifth of the free memory besides.
    weight_bytes = E * 3 * H * I * DTYPES[a.dtype].itemsize * 5 // 2 + (5 << 30 if a.dtype == "fp8" else 0)
    command = [sys.executable, "-m", "fmoe2.tune", "--shape", name, "--m", ",".join(map(str, ms)), "--dtype", a.dtype]
    command += (["--deterministic"] if a.deterministic else []) + (["--weights", a.weights] if a.weights else [])
    compile_in_processes(command, a.compile_workers, weight_bytes, name)


def prepared_weights(name: str, a, gen: torch.Generator):
    """Random expert weights of shape ``name`` in ``--dtype``, prepared."""
    E, H, I, topk = _shape(name)
    dtype = DTYPES[a.dtype]
    # drawn in the 16-bit dtype: a float32 draw took twice the weights' bytes at its peak (DeepSeek-V3's compiling
    # processes ran out of memory on an H200, 2026-11-28)
    w1 = torch.randn(E, 2 * I, H, device="cuda", generator=gen, dtype=dtype).div_(math.sqrt(H))
    w2 = torch.randn(E, H, I, device="cuda", generator=gen, dtype=dtype).div_(math.sqrt(I))
    if a.dtype == "fp8":
        (q1, s1), (q2, s2) = fmoe2.quantize_fp8_weights(w1, "block"), fmoe2.quantize_fp8_weights(w2, "block")
        del w1, w2
        return fmoe2.prepare_weights(q1, q2, w1_scale=s1, w2_scale=s2, block_shape=(128, 128))
    if a.weights is not None:
        group = int4_group(H, I) if a.weights == "int4" else None
        (p1, s1, z1), (p2, s2, z2) = (quantized_expertwise(a.weights, w, group) for w in (w1, w2))
        del w1, w2
        return fmoe2.prepare_weights(p1, p2, w1_scale=s1, w2_scale=s2, w1_zero=z1, w2_zero=z2, weight_format=a.weights)
    return fmoe2.prepare_weights(w1, w2)


def _minutes(seconds: float) -> str:
    return f"{seconds / 60:.0f} min" if seconds >= 90 else f"{seconds:.0f} s"


def main(argv=None) -> int:
    # (allow_abbrev=False: --gpus re-runs this command line per GPU less its --shape and --gpus, spelled out)
    p = argparse.ArgumentParser(prog="python -m fmoe2.tune", description=__doc__.split("\n\n")[0], allow_abbrev=False,
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--shape", required=True,
                   help=f"comma-separated names from {sorted(ALL_SHAPES)} or shapes ExHxIxtopk (e.g. 32x2880x2880x4), or "
                        f"'served' ({len(SERVED_SHAPES)} served models' shapes: fmoe2.shapes.SERVED_SHAPES)")
    p.add_argument("--m", default="1,16,128,1024,4096", help="comma-separated batch sizes to tune")
    p.add_argument("--dtype", default="bf16", choices=sorted(DTYPES),
                   help="input and weight dtype (fp8: e4m3 weights with 128 x 128 block scales, bf16 inputs)")
    p.add_argument("--config-dir", default=CONFIG_DIR,
                   help="where the tuned file <device>/E=..,H=..,I=..,topk=..,dtype=...json is written")
    p.add_argument("--deterministic", action="store_true", help="tune deterministic mode (its own entry)")
    p.add_argument("--weights", default=None, choices=WEIGHT_ONLY_FORMATS,
                   help="tune weight-only quantized weights of this format (activations in --dtype) into the tuned "
                        "file's entry of that name (default: the weights in --dtype)")
    p.add_argument("--overwrite", action="store_true",
                   help="retune batch sizes the tuned file already holds (default: resume, skipping them)")
    p.add_argument("--recheck", action="store_true",
                   help="no search: check the entries the tuned files hold against the reference again (eager calls "
                        "and a CUDA graph replay) and rewrite their records, on one GPU; exit status 1 if one fails")
    p.add_argument("--gpus", default="1",
                   help="visible GPUs to spread the shapes over, one process each: a count or 'all'")
    add_compile_arguments(p, "the search")
    a = p.parse_args(argv)
    if a.deterministic and a.dtype == "fp8":
        p.error("--deterministic tunes 16-bit weights (fp8 weights take one fixed tiling in that mode)")
    if a.weights is not None and (a.deterministic or a.dtype == "fp8"):
        p.error(f"--weights {a.weights} tunes weight-only quantized weights with 16-bit activations: not with "
                "--deterministic or --dtype fp8")
    shapes = list(SERVED_SHAPES) if a.shape == "served" else _shape_names(a.shape, p)
    if not torch.cuda.is_available():
        p.error("tuning needs a CUDA or ROCm GPU")
    ms = [int(m) for m in a.m.split(",")]
    if a.compile_share:
        compile_candidates(shapes[0], ms, a)
        return 0
    shapes = _one_name_per_shape(shapes)
    try:
        gpus = visible_gpus(torch.cuda.device_count() if a.gpus == "all" else _count(a.gpus, p))
    except ValueError as error:
        p.error(str(error))
    if a.recheck:  # (seconds per entry, on one GPU: the spread below counts only the points still to tune)
        return 1 if recheck(shapes, ms, a) else 0
    if len(gpus) > 1 and len(shapes) > 1:
        return tune_on_gpus(shapes, ms, gpus, argv if argv is not None else sys.argv[1:], a)
    if len(gpus) > 1:
        print(f"one shape: tuned on one GPU (--gpus spreads shapes, {len(gpus)} asked)", flush=True)
    todo = tune_points(shapes, ms, a)
    skipped = len(shapes) * len(ms) - len(todo)
    dtype = DTYPES[a.dtype]
    # + tma twins and a pdl twin, and the final round's timings (two turns of its finalists: counted as candidates)
    planned = sum(len(base_candidates(n, M, a)) + 4 + 2 * FINALISTS for n, M in todo)
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
        entry, us, count, check = tune_point(name, M, prepared, dtype, a, gen)
        path = _tuned_path(name, a)
        _store(path, _section(a), M, entry, check)
        timed += count
        elapsed = time.time() - t0
        left = (planned - timed) * elapsed / max(timed, 1)
        print(f"[{i + 1}/{len(todo)}] {name} M={M}: {us:.1f} us with {entry} (error {check['rel_err']:.1e}) -> "
              f"{path}; {_minutes(elapsed)} "
              f"so far, about {_minutes(max(left, 0))} left", flush=True)
    return 0


def _one_name_per_shape(names: List[str]) -> List[str]:
    """``names`` less any that names a shape an earlier one names (``gpt-oss-20b`` and ``32x2880x2880x4``: one file)."""
    seen, unique = set(), []
    for name in names:
        if _shape(name) not in seen:
            seen.add(_shape(name))
            unique.append(name)
    return unique


def _count(value: str, parser) -> int:
    if not value.isdigit() or int(value) < 1:
        parser.error(f"--gpus takes a count >= 1 or 'all', got {value!r}")
    return int(value)


def visible_gpus(count: int) -> List[str]:
    """The ids of the first ``count`` visible GPUs as the visibility variable names them (the variable's own list where
    it is set); more than there are: ValueError."""
    variable = "HIP_VISIBLE_DEVICES" if torch.version.hip else "CUDA_VISIBLE_DEVICES"
    listed = [g.strip() for g in os.environ[variable].split(",") if g.strip()] if variable in os.environ else None
    available = listed if listed is not None else [str(i) for i in range(torch.cuda.device_count())]
    if count > len(available):
        raise ValueError(f"--gpus {count}: only {len(available)} GPUs are visible")
    return available[:count]


def spread_shapes(work: dict, lanes: int) -> List[List[str]]:
    """``work`` (shape -> estimated seconds) split into ``lanes`` lists of shapes, the largest first, each to the lane
    with the least work so far; empty lanes dropped."""
    loads, groups = [0.0] * lanes, [[] for _ in range(lanes)]
    for name, seconds in sorted(work.items(), key=lambda kv: -kv[1]):
        lane = loads.index(min(loads))
        loads[lane] += seconds
        groups[lane].append(name)
    return [group for group in groups if group]


def _without_gpus(argv: List[str]) -> List[str]:
    """``argv`` less its ``--shape`` and ``--gpus`` options (either spelling: ``--gpus 4`` or ``--gpus=4``)."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg in ("--gpus", "--shape"):
            skip = True
        elif not arg.startswith(("--gpus=", "--shape=")):
            out.append(arg)
    return out


def shown_line(raw: bytes) -> str:
    """One line of a tuner process's output as relayed: decoded (undecodable bytes replaced), a progress bar that
    redraws itself with carriage returns shown at its last state."""
    parts = raw.decode(errors="replace").rstrip("\r\n").split("\r")
    return next((part for part in reversed(parts) if part.strip()), "")


def tune_on_gpus(shapes: List[str], ms: List[int], gpus: List[str], argv: List[str], a) -> int:
    """Runs this tuner once per GPU of ``gpus`` (its environment pinned to that GPU) on its share of ``shapes``
    (:func:`spread_shapes` of each shape's points still to tune, weighted by its weights' size), the lines of each
    prefixed with its GPU; returns the first failing process's exit status, else 0."""
    work = {}
    for name in shapes:
        E, H, I, topk = _shape(name)
        points = tune_points([name], ms, a)
        if points:  # candidates to time, each taking longer the more weight bytes it reads
            work[name] = sum(len(base_candidates(n, M, a)) for n, M in points) * (1 + E * H * I / 2 ** 30)
    if not work:
        print("every point is already in its tuned file (--overwrite retunes them)", flush=True)
        return 0
    groups = spread_shapes(work, len(gpus))
    variable = "HIP_VISIBLE_DEVICES" if torch.version.hip else "CUDA_VISIBLE_DEVICES"
    rest = _without_gpus(argv)
    procs = []
    for gpu, group in zip(gpus, groups):
        print(f"GPU {gpu}: {', '.join(group)}", flush=True)
        procs.append((gpu, subprocess.Popen([sys.executable, "-m", "fmoe2.tune", "--shape", ",".join(group), *rest],
                                            env={**os.environ, variable: gpu}, stdout=subprocess.PIPE,
                                            stderr=subprocess.STDOUT)))

    def relay(gpu, proc):
        for raw in proc.stdout:
            print(f"[GPU {gpu}] {shown_line(raw)}", flush=True)

    relays = [threading.Thread(target=relay, args=pair) for pair in procs]
    for thread in relays:
        thread.start()
    for thread in relays:
        thread.join()
    codes = [proc.wait() for _, proc in procs]
    return next((code for code in codes if code), 0)


def _shape_names(value: str, parser) -> List[str]:
    """Named shapes of ``--shape`` (comma-separated), or the one custom ``ExHxIxtopk`` (or legacy ``E,H,I,topk``)."""
    parts = value.split(",")
    if len(parts) == 4 and all(part.isdigit() for part in parts):
        return ["x".join(parts)]

    def custom(part):
        return len(part.split("x")) == 4 and all(v.isdigit() for v in part.split("x"))

    if all(part in ALL_SHAPES or custom(part) for part in parts):
        return parts
    parser.error(f"--shape: names from {sorted(ALL_SHAPES)} or ExHxIxtopk shapes, comma-separated, or 'served'; got "
                 f"{value!r}")


if __name__ == "__main__":
    sys.exit(main())
