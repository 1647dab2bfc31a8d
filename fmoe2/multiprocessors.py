"""Multiprocessors a launch has to fill and the shared memory a program may take: the GPU's, or
assumed values where there is no GPU to ask.

Used by the launch rules that depend on how many programs run at once (``sort_programs``,
``fit_lora_config``) and on what fits in a program (``fit_lora_config``).
"""
from __future__ import annotations

import functools
from typing import Optional

import torch

from ._validation import interpreter_enabled

# Assumed where no GPU is here to ask (fmoe2.codegen, the CPU interpreter): the H100's and H200's multiprocessors
# and shared memory per program (227 KiB).
DEFAULT_NUM_SMS = 132
DEFAULT_SHARED_MEMORY = 232448


def _gpu_index(device) -> Optional[int]:
    """The CUDA/HIP device index of ``device`` (None: the current GPU), or None for a CPU or meta
    device, without a GPU and under the interpreter (then the assumed values apply)."""
    if device is None:
        device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    device = torch.device(device)
    if device.type != "cuda" or interpreter_enabled():
        return None
    return device.index if device.index is not None else torch.cuda.current_device()


def num_multiprocessors(device=None) -> int:
    """Multiprocessors (compute units on ROCm) of a CUDA/HIP ``device`` (None: the current one);
    ``DEFAULT_NUM_SMS`` for a CPU or meta device, without a GPU and under the interpreter."""
    index = _gpu_index(device)
    return DEFAULT_NUM_SMS if index is None else _cuda_multiprocessors(index)


def shared_memory_per_program(device=None) -> int:
    """Bytes of shared memory (LDS on ROCm) one program may take on a CUDA/HIP ``device`` (None:
    the current one), as Triton checks it at launch; ``DEFAULT_SHARED_MEMORY`` for a CPU or meta
    device, without a GPU and under the interpreter."""
    index = _gpu_index(device)
    return DEFAULT_SHARED_MEMORY if index is None else _cuda_shared_memory(index)


@functools.lru_cache(maxsize=None)
def _cuda_shared_memory(index: int) -> int:
    import triton

    return int(triton.runtime.driver.active.utils.get_device_properties(index)["max_shared_mem"])


@functools.lru_cache(maxsize=None)
def _cuda_multiprocessors(index: int) -> int:
    # Asked on every launch (the sort's programs, the LoRA fit); a device's count never changes.
    return torch.cuda.get_device_properties(index).multi_processor_count
