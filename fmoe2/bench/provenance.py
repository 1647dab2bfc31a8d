"""Provenance of a benchmark run, for its result file: device, date, versions and the exact command;
and the result files themselves (JSON plus its markdown report)."""
from __future__ import annotations

import datetime
import json
import os
import shlex
import sys
from typing import Callable, Optional, Sequence

import torch
import triton


def run_record(prog: str, argv: Optional[Sequence[str]] = None) -> dict:
    """``device``, ``date`` (UTC), ``torch``, ``triton`` and ``command`` (``prog`` and its arguments:
    ``argv``, or ``sys.argv[1:]`` when None) of a run on the current CUDA/HIP device (``"cpu"`` without one)."""
    args = sys.argv[1:] if argv is None else argv
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    return dict(device=device, date=datetime.datetime.now(datetime.timezone.utc).isoformat(),
                torch=torch.__version__, triton=triton.__version__,
                command=" ".join([prog, *(shlex.quote(v) for v in args)]))


def provenance_line(result: dict) -> str:
    """The report line that says where a result came from: date, versions and the command."""
    return f"{result['date']}, torch {result['torch']}, Triton {result['triton']}; `{result['command']}`"


def write_result(path: str, result: dict, markdown: Callable[[dict], str]) -> str:
    """Writes ``result`` to ``path`` (``.json``) and its report beside it (``.md``); returns the report."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    return rewrite_report(path, markdown, result)


def rewrite_report(path: str, markdown: Callable[[dict], str], result: Optional[dict] = None) -> str:
    """Writes the markdown report (``.md``) of the result file ``path`` (read unless ``result`` is given)."""
    if result is None:
        with open(path) as f:
            result = json.load(f)
    report = markdown(result)
    with open(path[:-len(".json")] + ".md", "w") as f:
        f.write(report)
    return report
