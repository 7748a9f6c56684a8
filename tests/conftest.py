import os

import pytest
import torch

# Without a GPU, Triton kernels can only run in its interpreter; it must be chosen before triton is imported
# (the interpreter cannot call triton's own library functions if triton first loaded in compiled mode).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
    # The test models are tiny: intra-op threads only contend with each other and with the server processes the
    # tests start (which inherit this), measured 20x slower on 2 busy cores; one thread each.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
elif "PYTEST_XDIST_WORKER_COUNT" in os.environ:
    # on a GPU machine the CPU references still run: each of the workers gets its share of the cores, not all of them
    workers = int(os.environ["PYTEST_XDIST_WORKER_COUNT"])
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // workers)))
if "OMP_NUM_THREADS" in os.environ:
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
if torch.cuda.is_available():
    # Kernels compile on the GPU as they do in a server, which sets Triton's JIT hooks (ds4x.kernels.jit_watch):
    # with a hook set Triton serializes a kernel's constexprs to JSON first, which a Gluon layout argument once
    # failed, in every test that ran after the hooks happened to be set
    from ds4x.kernels.jit_watch import watch

    watch()


def pytest_runtest_logreport(report):
    """DS4X_TEST_TIMES=FILE: each test phase's seconds, outcome and id appended as it ends (a GPU run cut short by
    its time limit still says where the time went; --durations prints only at the end)."""
    path = os.environ.get("DS4X_TEST_TIMES")
    if path and "PYTEST_XDIST_WORKER" not in os.environ:  # with xdist the controller hears every worker's reports
        with open(path, "a") as f:
            f.write(f"{report.duration:9.2f} {report.when:8} {report.outcome:7} {report.nodeid}\n")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(autouse=True)
def _dense_mirrors_off():
    """Dense mirrors are a process-wide switch that a decode slot pool turns on; each test starts with it off
    (a GPU test of exact per-row bits must not inherit another test's mirrors)."""
    from ds4x.kernels.quant_matmul import use_dense_mirrors

    use_dense_mirrors(False)
    yield
    use_dense_mirrors(False)
