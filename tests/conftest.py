"""Test setup: without a GPU, kernels run under the Triton interpreter on the CPU.

``TRITON_INTERPRET`` is read when kernels are decorated, so it is set here, before any test
module imports fmoe2. Compile tests run ``python -m fmoe2.codegen`` in a child process (tests/compile_child.py) with
the variable removed.

On a machine with several GPUs, each pytest-xdist worker (``-n N``) is pinned to one of them, round robin
(worker ``gwK`` to GPU ``K mod GPUs``), by setting ``CUDA_VISIBLE_DEVICES`` (ROCm: ``HIP_VISIBLE_DEVICES``) before
torch starts CUDA: ``python -m pytest tests -n 32`` on four GPUs runs eight workers on each. The GPUs are those
listed in that variable where it is set (empty: none, nothing is pinned), else every GPU the NVIDIA driver lists;
``FMOE2_TEST_GPUS`` takes a count (the first ones of those) or a comma-separated list of ids instead.
"""
import os


def _test_gpus():
    """The GPU ids the workers are spread over, as the pinned variable takes them (fewer than two: the
    environment is left as it is)."""
    visible_name = "HIP_VISIBLE_DEVICES" if _rocm() else "CUDA_VISIBLE_DEVICES"
    if visible_name in os.environ:  # (also when empty: no GPU, as the user asked)
        visible = [g.strip() for g in os.environ[visible_name].split(",") if g.strip()]
    else:
        try:  # the NVIDIA driver lists one folder per GPU (no CUDA call: CUDA must not start before the pinning)
            visible = [str(i) for i in range(len(os.listdir("/proc/driver/nvidia/gpus")))]
        except OSError:
            visible = []
    given = os.environ.get("FMOE2_TEST_GPUS", "").strip()
    if given.isdigit():  # a count: the first ones of those visible
        return visible[:int(given)] if visible else [str(i) for i in range(int(given))]
    return [g.strip() for g in given.split(",") if g.strip()] if given else visible


def _rocm():
    return os.path.exists("/dev/kfd") and not os.path.exists("/proc/driver/nvidia")


def _pin_xdist_worker_to_one_gpu():
    """Worker ``gwK`` of pytest-xdist sees GPU ``K mod GPUs`` alone (module docstring)."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    gpus = _test_gpus()
    if worker.startswith("gw") and len(gpus) >= 2:
        os.environ["HIP_VISIBLE_DEVICES" if _rocm() else "CUDA_VISIBLE_DEVICES"] = gpus[int(worker[2:]) % len(gpus)]


_pin_xdist_worker_to_one_gpu()

import pytest  # noqa: E402
import torch  # noqa: E402


def _share_the_cpus_among_xdist_workers():
    """Each of N pytest-xdist workers takes 1/N of the CPUs it may run on for torch's own threads (at least one): by
    default every worker runs about as many threads as the machine has cores, and 32 workers on 64 CPUs oversubscribed
    them many times over."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0") or 0)
    if workers > 1:
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        torch.set_num_threads(max(1, cpus // workers))


_share_the_cpus_among_xdist_workers()
if int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0") or 0) > 1:
    # Inductor compiles in the worker itself, not in a pool of its own of up to 32 processes per worker (read when
    # torch._inductor is first imported, at the first torch.compile): 32 workers' pools are a thousand processes to
    # start and stop (the four-GPU run of 11-29 reported every test but had not exited when its limit came).
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

from helpers import DEVICE  # noqa: E402


# Files whose tests take longest (compiling for several targets, whole transformers models under the interpreter, the
# searched benchmark), run first: pytest-xdist hands tests out in collection order, and a long test collected last kept
# one of two CPU workers busy alone for minutes at the end (2026-11-28: 96% of the tests done 6.5 minutes before the
# end of a 14-minute run).
SLOW_FILES_FIRST = ("tests/bench/test_bench_gpu.py", "tests/test_codegen.py", "tests/integrations/test_expert_parallel.py",
                    "tests/integrations/test_peft.py", "tests/gemm/test_packed_weights.py")


def _slow_rank(item) -> int:
    path = item.nodeid.split("::")[0]
    return SLOW_FILES_FIRST.index(path) if path in SLOW_FILES_FIRST else len(SLOW_FILES_FIRST)


def pytest_collection_modifyitems(config, items):
    items.sort(key=_slow_rank)  # (stable: the order within each file and among the others stays)
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
