"""The GPU a forward is planned for, as the launch rules see it: backend, architecture,
multiprocessors and shared memory per program.

:func:`target_of` reads a device once (cached per device); :data:`NAMED_TARGETS` stand for GPUs
that are not here (``fmoe2.codegen`` compiles for them). Every launch rule that depends on the
GPU (tensor descriptors, programmatic dependent launch, the LoRA kernels' warps and splits, the
sort's programs) takes a :class:`Target`, so the rules read the same whether the GPU is present,
named, or replaced by the CPU interpreter.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional, Union

import torch

from ._validation import interpreter_enabled

# Assumed where no GPU is here to ask (the CPU interpreter, meta tensors): the H100's and H200's
# multiprocessors and shared memory per program (227 KiB).
DEFAULT_NUM_SMS = 132
DEFAULT_SHARED_MEMORY = 232448


@dataclass(frozen=True)
class Target:
    """What the launch rules need to know about a GPU."""

    backend: str  # "cuda" or "hip"
    arch: Union[int, str, None]  # CUDA: 10 * major + minor (90); HIP: "gfx942"; None: no GPU (the interpreter)
    num_sms: int  # multiprocessors (compute units on ROCm)
    shared_memory: int  # bytes of shared memory (LDS) one program may take
    interpreter: bool = False  # kernels run under the Triton interpreter on the CPU
    device_index: Optional[int] = None  # the GPU launches run on (None: a named target or the interpreter)

    @property
    def warp_size(self) -> int:
        """Threads per warp: 64 on the CDNA GPUs fmoe2 targets on ROCm (gfx90a, gfx942, gfx950), else 32."""
        return 64 if self.backend == "hip" else 32

    @property
    def cuda_arch(self) -> Optional[int]:
        """Compute capability as 10 * major + minor on CUDA, else None."""
        return self.arch if self.backend == "cuda" and isinstance(self.arch, int) else None

    @property
    def has_grid_dependency_control(self) -> bool:
        """Programmatic dependent launch (``griddepcontrol``): CUDA sm_90 and newer, never under the
        interpreter or on ROCm."""
        return not self.interpreter and self.cuda_arch is not None and self.cuda_arch >= 90

    @property
    def fp8_dtypes(self) -> tuple:
        """The fp8 weight dtypes its matrix instructions take: e4m3fn on CUDA sm_89 and newer and on
        gfx950, e4m3fnuz on gfx942 (MI300), none on older GPUs; the interpreter takes both."""
        if self.interpreter:
            return (torch.float8_e4m3fn, torch.float8_e4m3fnuz)
        if self.cuda_arch is not None:
            return (torch.float8_e4m3fn,) if self.cuda_arch >= 89 else ()
        return {"gfx942": (torch.float8_e4m3fnuz,), "gfx950": (torch.float8_e4m3fn,)}.get(self.arch, ())

    @property
    def pre_hopper_cuda(self) -> bool:
        """A CUDA GPU older than sm_90 (no wgmma, no bulk tensor copies, CAS-loop bf16 atomics)."""
        return self.cuda_arch is not None and self.cuda_arch < 90


def current_backend() -> str:
    """"hip" on ROCm builds of torch, else "cuda" (also under the CPU interpreter)."""
    return "hip" if getattr(torch.version, "hip", None) else "cuda"


# GPUs named by the codegen report: A100, H100/H200 SXM, B200, MI250X (one die), MI300X, MI355X.
NAMED_TARGETS = {
    "sm_80": Target("cuda", 80, 108, 166912),
    "sm_90": Target("cuda", 90, 132, 232448),
    "sm_100": Target("cuda", 100, 148, 232448),
    "gfx90a": Target("hip", "gfx90a", 110, 65536),
    "gfx942": Target("hip", "gfx942", 304, 65536),
    "gfx950": Target("hip", "gfx950", 256, 163840),
}

# Off-GPU (the CPU interpreter, meta tensors): the H100's and H200's multiprocessors and shared memory.
INTERPRETER_TARGET = Target(current_backend(), None, DEFAULT_NUM_SMS, DEFAULT_SHARED_MEMORY, interpreter=True)


def target_of(device=None) -> Target:
    """The :class:`Target` of ``device`` (a CUDA/HIP GPU, read once; None: the current GPU);
    :data:`INTERPRETER_TARGET` for CPU and meta devices, without a GPU and whenever
    ``TRITON_INTERPRET`` is set."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    if device.type != "cuda" or interpreter_enabled():
        return INTERPRETER_TARGET
    return _gpu_target(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _gpu_target(index: int) -> Target:
    import triton

    props = torch.cuda.get_device_properties(index)
    if current_backend() == "hip":
        arch: Union[int, str, None] = (getattr(props, "gcnArchName", "") or "").split(":")[0] or None
    else:
        arch = 10 * props.major + props.minor
    shared = int(triton.runtime.driver.active.utils.get_device_properties(index)["max_shared_mem"])
    return Target(current_backend(), arch, props.multi_processor_count, shared, device_index=index)
