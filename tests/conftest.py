"""Test setup: without a GPU, kernels run under the Triton interpreter on the CPU.

``TRITON_INTERPRET`` is read when kernels are decorated, so it is set here, before any test
module imports fmoe2. Compile tests run ``python -m fmoe2.codegen`` in a child process with
the variable removed.
"""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

from helpers import DEVICE  # noqa: E402


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA or ROCm GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def device():
    return DEVICE


@pytest.fixture(autouse=True)
def fresh_plans():
    """Every test starts without cached plans: one that patches a launch rule must see it applied."""
    import fmoe2

    fmoe2.clear_plan_cache()
    yield
    fmoe2.clear_plan_cache()


@pytest.fixture(autouse=True)
def give_back_gpu_memory():
    """After each test on a GPU, the memory its tensors held goes back to the device: the suite runs in parallel
    workers on one GPU (``-n 12``), and a worker's cached blocks would otherwise starve the others (out-of-memory
    failures, the main job's among them)."""
    yield
    if torch.cuda.is_available():
        import gc

        gc.collect()
        torch.cuda.empty_cache()


@pytest.fixture
def deterministic_off():
    """Restores the global switches of deterministic mode that a test turns on."""
    import fmoe2

    yield
    fmoe2.set_deterministic(False)
    torch.use_deterministic_algorithms(False)
