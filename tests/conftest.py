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
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


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
