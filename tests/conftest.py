import os

import pytest
import torch

# Without a GPU, Triton kernels can only run in its interpreter; it must be chosen before triton is imported
# (the interpreter cannot call triton's own library functions if triton first loaded in compiled mode).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
