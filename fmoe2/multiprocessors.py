"""Multiprocessors a launch has to fill: the GPU's, or an assumed count where there is no GPU to ask.

Used by the launch rules that depend on how many programs run at once (``sort_programs``,
``fit_lora_config``).
"""
from __future__ import annotations

import functools

import torch

from ._validation import interpreter_enabled

# Multiprocessors assumed where no GPU is here to ask (fmoe2.codegen, the CPU interpreter): the H100's and H200's.
DEFAULT_NUM_SMS = 132


def num_multiprocessors(device=None) -> int:
    """Multiprocessors (compute units on ROCm) of a CUDA/HIP ``device`` (None: the current one);
    ``DEFAULT_NUM_SMS`` for a CPU or meta device, without a GPU and under the interpreter."""
    if device is None:
        device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    device = torch.device(device)
    if device.type != "cuda" or interpreter_enabled():
        return DEFAULT_NUM_SMS
    return _cuda_multiprocessors(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _cuda_multiprocessors(index: int) -> int:
    # Asked on every launch (the sort's programs, the LoRA fit); a device's count never changes.
    return torch.cuda.get_device_properties(index).multi_processor_count
