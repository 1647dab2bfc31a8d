"""Test setup: without a GPU, kernels run under the Triton interpreter on the CPU.

``TRITON_INTERPRET`` is read when kernels are decorated, so it is set here, before any test
module imports fmoe2. Compile tests run ``python -m fmoe2.codegen`` in a child process with
the variable removed.

On a machine with several GPUs, each pytest-xdist worker (``-n N``) is pinned to one of them, round robin
(worker ``gwK`` to GPU ``K mod GPUs``), by setting ``CUDA_VISIBLE_DEVICES`` before torch starts CUDA:
``python -m pytest tests -n 32`` on four GPUs runs eight workers on each. The GPUs are those listed in
``CUDA_VISIBLE_DEVICES`` where it is set, else every NVIDIA GPU the driver lists; ``FMOE2_TEST_GPUS`` (a count or
a comma-separated list of ids) overrides both (ROCm: set it; there ``HIP_VISIBLE_DEVICES`` is pinned).
"""
import os


def _test_gpus():
    """The GPU ids the workers are spread over (fewer than two: the environment is left as it is)."""
    given = os.environ.get("FMOE2_TEST_GPUS", "").strip()
    if given.isdigit():
        return [str(i) for i in range(int(given))]
    given = given or os.environ.get("CUDA_VISIBLE_DEVICES", "")
    if given:
        return [g.strip() for g in given.split(",") if g.strip()]
    try:  # the NVIDIA driver lists one folder per GPU (no CUDA call: CUDA must not start before the pinning)
        return [str(i) for i in range(len(os.listdir("/proc/driver/nvidia/gpus")))]
    except OSError:
        return []


def _pin_xdist_worker_to_one_gpu():
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    gpus = _test_gpus()
    if worker.startswith("gw") and len(gpus) >= 2:
        rocm = os.path.exists("/dev/kfd") and not os.path.exists("/proc/driver/nvidia")
        os.environ["HIP_VISIBLE_DEVICES" if rocm else "CUDA_VISIBLE_DEVICES"] = gpus[int(worker[2:]) % len(gpus)]


_pin_xdist_worker_to_one_gpu()

import pytest  # noqa: E402
import torch  # noqa: E402

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
