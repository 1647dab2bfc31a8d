"""Host-side argument checks shared by the public ops.

Every check runs before any kernel is launched and raises ``TypeError`` (wrong type or dtype)
or ``ValueError`` (wrong shape, device, layout or value) naming the argument. None of them
reads device memory, so they are CUDA-graph safe.
"""
from __future__ import annotations

import contextlib
import os
from typing import Iterable, Optional, Sequence

import torch

from .fp8 import FP8_DTYPES, nan_codes

FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
ID_DTYPES = (torch.int32, torch.int64)

_TRUE = ("1", "true", "on", "yes", "y")  # Triton's reading of a boolean variable (getenv_bool), any case


def interpreter_requested() -> bool:
    """Whether Triton would interpret a kernel decorated now: ``TRITON_INTERPRET`` read as Triton reads it
    ("1", "true", "on", "yes" in any case; "0", "2" or " 1" are off). (os.environ, not Triton's knobs: torch.compile
    traces this, and cannot trace Triton's C getenv.)"""
    return os.environ.get("TRITON_INTERPRET", "").lower() in _TRUE


# Triton reads TRITON_INTERPRET when a kernel is decorated (@triton.jit), so fmoe2's kernels, decorated when fmoe2
# is imported (this module is imported with them), are interpreted or compiled by what it said then.
INTERPRETER_AT_IMPORT = interpreter_requested()


def interpreter_enabled() -> bool:
    """True when fmoe2's kernels run under Triton's interpreter (on the CPU): ``TRITON_INTERPRET=1`` was set when
    fmoe2 was imported and still is (:func:`check_interpreter_setting` refuses a setting changed since)."""
    return INTERPRETER_AT_IMPORT and interpreter_requested()


def check_interpreter_setting() -> None:
    """Refuses a ``TRITON_INTERPRET`` changed since fmoe2 was imported: the kernels are what it said then, and
    a kernel run of the other kind fails deep inside Triton ("0 active drivers" on a machine without a GPU)."""
    now = interpreter_requested()
    if now == INTERPRETER_AT_IMPORT:
        return
    if now:
        raise ValueError(
            "TRITON_INTERPRET=1 was set after fmoe2 was imported: Triton reads it when it decorates kernels, which "
            "happens when fmoe2 is imported, so fmoe2's kernels were built for a GPU and cannot run under the "
            "interpreter (on the CPU). Set TRITON_INTERPRET=1 in the environment before importing fmoe2 (in the "
            "shell, or os.environ['TRITON_INTERPRET'] = '1' before the first `import fmoe2`, in a new process)")
    raise ValueError(
        "TRITON_INTERPRET was unset after fmoe2 was imported with TRITON_INTERPRET=1: fmoe2's kernels were decorated "
        "for Triton's interpreter then. Keep TRITON_INTERPRET=1 set (it must be set before importing fmoe2), or "
        "run GPU work in a new process without it")


def interpreter_computes_wrong(dtype: torch.dtype) -> bool:
    """Whether fmoe2's kernels would compute ``dtype`` wrong: bf16 under Triton's interpreter."""
    return dtype == torch.bfloat16 and interpreter_enabled()


BF16_UNDER_THE_INTERPRETER = (
    "under the Triton interpreter (TRITON_INTERPRET=1, the CPU) bf16 kernel math is wrong: its bf16 tl.dot multiplies "
    "raw bit patterns (triton-lang/triton#11584; relative errors of 1e11 were seen) and fp32->bf16 casts truncate")


def check_interpreter_dtype(name: str, dtype: torch.dtype) -> None:
    """Refuses bf16 kernel inputs under Triton's interpreter, which computes them wrong (``TypeError``)."""
    if interpreter_computes_wrong(dtype):
        raise TypeError(f"{name} is bfloat16, and {BF16_UNDER_THE_INTERPRETER}. Use float16 or float32 on the CPU "
                        "(hidden_states and weights as .half() or .float()), or run bf16 on a GPU without "
                        "TRITON_INTERPRET")


def check_interpreter_fp8_nan(name: str, w: torch.Tensor) -> None:
    """Refuses fp8 weights holding NaN codes under Triton's interpreter, which reads them as finite numbers (e4m3fn
    0x7F as 480, e4m3fnuz 0x80 as -0): the forward came out finite where the reference's is NaN (``ValueError``; on a
    GPU they propagate as NaN, as bf16 NaN weights do)."""
    if w.dtype in FP8_DTYPES and w.device.type == "cpu" and interpreter_enabled():
        nan = nan_codes(w)
        if bool(nan.any()):
            where = [int(i) for i in nan.nonzero()[0].tolist()]
            raise ValueError(f"{name} holds {int(nan.sum())} fp8 NaN codes (the first at index {where}), which the "
                             "Triton interpreter reads as finite numbers (e4m3fn 0x7F as 480.0, e4m3fnuz 0x80 as "
                             "-0.0): the forward would come out finite where it must be NaN. Run fp8 weights holding "
                             "NaN on a GPU")


def check_inference_only(**tensors) -> None:
    """Refuses inputs that require gradients while grad mode is on (call it only then: ``torch.is_grad_enabled()``).
    fmoe2 is inference-only: its output has no autograd graph, so a training step would silently get no
    gradient through it. Non-tensors are skipped (validation names them)."""
    for name, t in tensors.items():
        if isinstance(t, torch.Tensor) and t.requires_grad:
            raise ValueError(
                f"{name} requires grad and grad mode is on, but fmoe2 is inference-only (no autograd): the output "
                "would carry no gradient. Run it under torch.no_grad() or torch.inference_mode(), or pass "
                f"{name}.detach(); to train, use a differentiable MoE implementation (e.g. fmoe2.fused_moe_reference)")


def _dtype_names(dtypes: Iterable[torch.dtype]) -> str:
    return "/".join(str(d).replace("torch.", "") for d in dtypes)


def check_tensor(
    name: str,
    t,
    *,
    ndim: Optional[int] = None,
    dtypes: Optional[Sequence[torch.dtype]] = None,
    shape: Optional[Sequence[Optional[int]]] = None,
    shape_doc: str = "",
    contiguous: bool = True,
) -> torch.Tensor:
    """Checks one tensor argument; ``shape`` entries of ``None`` match any size."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if dtypes is not None and t.dtype not in dtypes:
        raise TypeError(f"{name} must have dtype {_dtype_names(dtypes)}, got {t.dtype}")
    expect = shape_doc or (f"{ndim}-D" if ndim is not None else "")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name} must be {expect}, got shape {tuple(t.shape)}")
    if shape is not None:
        if t.dim() != len(shape) or any(s is not None and s != d for s, d in zip(shape, t.shape)):
            raise ValueError(f"{name} must have shape {expect}, got {tuple(t.shape)}")
    if contiguous and not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous (call .contiguous() first); got strides {t.stride()}")
    return t


def check_same_device(reference_name: str, reference: torch.Tensor, **others) -> None:
    """All named tensors on ``reference``'s device, and that device usable by the kernels."""
    for name, t in others.items():
        if t is not None and t.device != reference.device:
            raise ValueError(f"{name} is on {t.device} but {reference_name} is on {reference.device}")
    dev = reference.device
    if dev.type == "cpu" or INTERPRETER_AT_IMPORT:  # (GPU tensors run the compiled kernels whatever it says now)
        check_interpreter_setting()
    if dev.type == "cpu" and not interpreter_enabled():
        raise ValueError(
            f"{reference_name} is on the CPU: fmoe2 kernels need a CUDA or ROCm GPU tensor; to run them on "
            "the CPU set TRITON_INTERPRET=1 in the environment before importing fmoe2"
        )
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"{reference_name} is on {dev}; fmoe2 supports CUDA/ROCm devices ('cuda')")


def check_positive_int(name: str, v) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise TypeError(f"{name} must be an int, got {type(v).__name__}")
    if v < 1:
        raise ValueError(f"{name} must be >= 1, got {v}")
    return v


def on_device(t: torch.Tensor):
    """Context in which Triton launches on ``t``'s GPU (it launches on the current device)."""
    return torch.cuda.device(t.device) if t.device.type == "cuda" else contextlib.nullcontext()


def check_out_overlaps(out: Optional[torch.Tensor], **inputs) -> None:
    """Refuses an ``out`` that shares memory with any input (it is zeroed while they are read)."""
    if out is None:
        return
    for name, t in inputs.items():
        if t is not None:
            check_no_overlap("out", out, name, t)


def check_no_overlap(name_a: str, a: torch.Tensor, name_b: str, b: torch.Tensor) -> None:
    """Refuses an output that shares memory with an input it would clobber."""
    a0, b0 = a.data_ptr(), b.data_ptr()
    a1 = a0 + a.numel() * a.element_size()
    b1 = b0 + b.numel() * b.element_size()
    if a.numel() and b.numel() and a0 < b1 and b0 < a1:
        raise ValueError(f"{name_a} overlaps {name_b} in memory; fmoe2 zeroes {name_a} before reading {name_b}")


def check_out_overlaps_at(names, addresses, nbytes, out_index: int) -> None:
    """:func:`check_out_overlaps` on device addresses and byte sizes (0 bytes: absent), ``out`` the
    ``out_index``-th: what a cached plan checks per call, without creating tensors."""
    out_start = addresses[out_index]
    out_end = out_start + nbytes[out_index]
    for i, (name, start, size) in enumerate(zip(names, addresses, nbytes)):
        if size and i != out_index and start < out_end and out_start < start + size:
            raise ValueError(f"out overlaps {name} in memory; fmoe2 may write out before it has read {name}")
