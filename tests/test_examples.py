"""The user-kernel examples (examples/) run under the interpreter and follow the policy's map.

Each example is a Triton kernel of a user's own that takes a numasched policy by name through one
``MAPPING`` constexpr; besides its result it records which program handled each work item, which
must equal the policy's NumPy reference map -- for every registered policy of the kind, on one
domain and on MI300X's eight.
"""
import importlib.util
from pathlib import Path

import pytest
import torch

from numasched import mappings as M, topology

from conftest import DEVICE

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def _load(name):
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("topo", [None, "mi300x"])
@pytest.mark.parametrize("name", M.available("gemm"))
def test_tiled_gemm_example(name, topo):
    ex = _load("tiled_gemm")
    a = torch.randn(50, 33, device=DEVICE)
    b = torch.randn(33, 70, device=DEVICE)
    with topology.use(topo or topology.current()):
        c, owner = ex.tiled_matmul(a, b, name)
        want = ex.expected_owner(name, *owner.shape, topology.current().num_domains)
    assert (c.double() - a.double() @ b.double()).abs().max() < 1e-4
    assert torch.equal(owner.cpu(), want), "the kernel did not follow the policy's reference map"


@pytest.mark.parametrize("topo", [None, "mi300x"])
@pytest.mark.parametrize("name", M.available("attention"))
def test_attention_blocks_example(name, topo):
    ex = _load("attention_blocks")
    q = torch.randn(2, 4, 37, 16, device=DEVICE)
    k = torch.randn(2, 2, 37, 16, device=DEVICE)
    with topology.use(topo or topology.current()):
        out, owner = ex.block_max_score(q, k, name)
        want = ex.expected_owner(name, 2, 4, 2, owner.shape[2], topology.current().num_domains)
    assert (out.double() - ex.reference(q, k)).abs().max() < 1e-4
    assert torch.equal(owner.cpu(), want), "the kernel did not follow the policy's reference map"


def test_a_broken_policy_is_caught_by_the_owner_map():
    # the check has teeth: the owner map of one policy does not match another's reference
    ex = _load("tiled_gemm")
    a, b = torch.randn(64, 16, device=DEVICE), torch.randn(16, 64, device=DEVICE)
    with topology.use("mi300x"):
        _, owner = ex.tiled_matmul(a, b, "row_major")
        assert not torch.equal(owner.cpu(), ex.expected_owner("chiplet_tiled", *owner.shape, 8))


@pytest.mark.parametrize("script", ["tiled_gemm", "attention_blocks"])
def test_examples_run_as_scripts(script):
    assert _load(script).main() == 0
