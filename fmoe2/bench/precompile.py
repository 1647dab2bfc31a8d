"""Compiling in processes side by side before a search times its candidates.

Most of a cold search's time is Triton compiling each candidate's kernels, one after another. A tool that searches
(``python -m fmoe2.tune``, ``python -m fmoe2.bench``, ``python -m fmoe2.bench.defaults``) takes
``--compile-workers N``: it first starts up to N copies of
itself with ``--compile-share i/N``, each running its share of the candidates once (each with its own copy of the
weights, so as many as the GPU memory holds), which leaves their kernels in the Triton cache; the timed search then
loads them from there.
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import time
from typing import Callable, List, Sequence, TypeVar

import torch

T = TypeVar("T")
PROCESS_BYTES = 1 << 30  # a process's CUDA context and buffers besides its weights, about


def add_arguments(parser: argparse.ArgumentParser, searches: str) -> None:
    """``--compile-workers`` (and the hidden ``--compile-share`` of the processes it starts) for a tool whose
    ``searches`` (words for a help text) this speeds up."""
    parser.add_argument("--compile-workers", type=int, default=0,
                        help=f"processes that first compile each shape's candidates of {searches} side by side "
                             "(compiling is most of a cold search's time; as many as the GPU memory holds), 0: none")
    parser.add_argument("--compile-share", default=None, help=argparse.SUPPRESS)  # "i/n": a compiling process


def worker_count(requested: int, free_bytes: int, bytes_per_worker: int) -> int:
    """How many compiling processes fit beside each other within 80% of ``free_bytes``, each holding
    ``bytes_per_worker`` and :data:`PROCESS_BYTES`: at most ``requested``, at least 1."""
    return max(1, min(requested, int(0.8 * free_bytes // (bytes_per_worker + PROCESS_BYTES))))


def compile_in_processes(command: List[str], requested: int, bytes_per_worker: int, label: str) -> None:
    """Runs ``command`` (a search tool's own command line for one shape) in up to ``requested`` processes at once,
    each with ``--compile-share i/n``, and waits for them. A process that fails is reported; the timed search then
    compiles (and reports) what it did not."""
    count = worker_count(requested, torch.cuda.mem_get_info()[0], bytes_per_worker)
    t0 = time.time()
    procs = [subprocess.Popen([*command, "--compile-share", f"{i}/{count}"], stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True) for i in range(count)]
    for proc in procs:
        _, err = proc.communicate()
        if proc.returncode != 0:
            print(f"  a compiling process failed: {err[-1500:]}", file=sys.stderr, flush=True)
    print(f"{label}: candidates compiled in {count} processes in {time.time() - t0:.0f} s", flush=True)


def share_of(items: Sequence[T], share: str) -> List[T]:
    """The items of the share ``"i/n"``: every n-th from the i-th."""
    index, count = (int(v) for v in share.split("/"))
    if not 0 <= index < count:
        raise ValueError(f"--compile-share must be i/n with 0 <= i < n, got {share!r}")
    return list(items[index::count])


def run_each_once(forwards: Sequence[Callable[[], object]]) -> None:
    """Calls each forward once (compiling its kernels); one that fails is left to the timed search."""
    for forward in forwards:
        try:
            forward()
        except Exception:  # noqa: BLE001 - the search skips and reports a candidate that cannot run
            pass
    torch.cuda.synchronize()
