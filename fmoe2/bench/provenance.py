"""Provenance of a benchmark run, for its result file: device, date, versions and the exact command."""
from __future__ import annotations

import datetime
import shlex
import sys
from typing import Optional, Sequence

import torch
import triton


def run_record(prog: str, argv: Optional[Sequence[str]] = None) -> dict:
    """``device``, ``date`` (UTC), ``torch``, ``triton`` and ``command`` (``prog`` and its arguments:
    ``argv``, or ``sys.argv[1:]`` when None) of a run on the current CUDA/HIP device."""
    args = sys.argv[1:] if argv is None else argv
    return dict(device=torch.cuda.get_device_name(), date=datetime.datetime.now(datetime.timezone.utc).isoformat(),
                torch=torch.__version__, triton=triton.__version__,
                command=" ".join([prog, *(shlex.quote(v) for v in args)]))
