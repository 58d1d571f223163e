"""Test setup: interpreter on CPU-only machines, a GPU marker that skips with a reason."""
import os

import pytest
import torch

HAS_GPU = torch.cuda.is_available()
if not HAS_GPU:
    # Must be set before triton compiles anything: kernels then run in Triton's interpreter.
    os.environ.setdefault("TRITON_INTERPRET", "1")

DEVICE = "cuda" if HAS_GPU else "cpu"


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU (run on the device machine)")
    for item in items:
        if "gpu" in item.keywords and not HAS_GPU:
            item.add_marker(skip_gpu)


@pytest.fixture
def device():
    return DEVICE


@pytest.fixture
def fixed_config():
    """One fixed kernel config on the GPU: autotuning every shape would compile dozens of variants."""
    from numasched import options

    with options.use(autotune=False):
        yield
