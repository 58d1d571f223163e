"""numasched.matmul_swiglu: silu(a @ b_gate) * (a @ b_up) in one split-K launch.

CPU (Triton's interpreter, fp32/fp16: its bf16 dot is wrong): float64 reference on fresh data,
outputs poisoned first; splits merged in split order (deterministic); TMA descriptors; argument
errors. GPU (-m gpu): decode sizes of real MLPs in bf16, and a CUDA-graph replay.
"""
import pytest
import torch
import torch.nn.functional as F

import numasched
from numasched import options
from numasched.gemm_schedule import Schedule

from conftest import HAS_GPU

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")
cpu = pytest.mark.skipif(HAS_GPU, reason="interpreter tests run on CPU-only machines")
gpu = pytest.mark.gpu
TOL = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 1e-2}


def _data(m, n, k, dtype, wt=True, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(device=device, dtype=dtype)
    w = torch.randn(2 * n, k, generator=g).to(device=device, dtype=dtype)
    b = w.T if wt else w.T.contiguous()
    return x, b


def _ref(x, b):
    n = b.shape[1] // 2
    gu = x.double() @ b.double()
    return F.silu(gu[:, :n]) * gu[:, n:]


def _err(y, x, b):
    assert not torch.isnan(y).any(), "unwritten (NaN-poisoned) output"
    r = _ref(x, b)
    return ((y.double() - r).norm() / r.norm().clamp_min(1e-30)).item()


@cpu
@pytest.mark.parametrize("m,n,k,dtype", [(1, 40, 64, torch.float32), (5, 24, 200, torch.float32),
                                         (17, 33, 97, torch.float16), (3, 16, 48, torch.float32),
                                         (2, 7, 35, torch.float32)])
@pytest.mark.parametrize("wt", [True, False])
def test_swiglu_matches_float64(m, n, k, dtype, wt):
    x, b = _data(m, n, k, dtype, wt, seed=m + n + k)
    plan = numasched.plan_matmul_swiglu(x, b)
    out = torch.full((m, n), float("nan"), dtype=dtype)
    y = plan.run(x, b, out)
    assert y is out and _err(y, x, b) < TOL[dtype]


@cpu
@pytest.mark.parametrize("split_k", [1, 3])
def test_swiglu_through_tma_descriptors_and_forced_splits(split_k):
    x, b = _data(6, 24, 160, torch.float32, seed=4)
    s = Schedule("splitk", 16, 32, 16, split_k, 4, 2)   # BLOCK_N halves to 16 for the two halves
    with options.use(gemm_splitk_tma=True):
        plan = numasched.plan_matmul_swiglu(x, b, schedule=s)
        y = plan.run(x, b, torch.full((6, 24), float("nan")))
    assert plan.path == "tma" and plan.split_k == split_k and plan.block_n == 16
    assert _err(y, x, b) < 1e-5


@cpu
def test_swiglu_is_deterministic_and_resets_its_counters():
    from numasched import gemm as api

    x, b = _data(4, 40, 256, torch.float32, seed=7)
    plan = numasched.plan_matmul_swiglu(x, b)
    assert plan.split_k > 1, "the shape must be split to test the merge"
    first = plan.run(x, b)
    for _ in range(3):
        assert torch.equal(plan.run(x, b), first)
    assert int(api._CTRS[("cpu", None, 0)][:plan._tiles].abs().sum()) == 0
    assert _err(first, x, b) < 1e-5
    # the one call caches its plan per signature and agrees with it
    assert torch.equal(numasched.matmul_swiglu(x, b), first)


def test_swiglu_argument_errors_name_the_argument():
    x = torch.randn(3, 8)
    with pytest.raises(ValueError, match="even, positive number of columns"):
        numasched.matmul_swiglu(x, torch.randn(8, 5))
    with pytest.raises(ValueError, match="b has 7 rows"):
        numasched.matmul_swiglu(x, torch.randn(7, 6))
    with pytest.raises(ValueError, match=r"out must have shape \(3, 3\)"):
        numasched.matmul_swiglu(x, torch.randn(8, 6), out=torch.empty(3, 6))
    with pytest.raises(TypeError):
        numasched.matmul_swiglu(x, torch.randn(8, 6).double())
    with pytest.raises(ValueError, match="split-K Schedule"):
        numasched.plan_matmul_swiglu(x, torch.randn(8, 6), schedule=Schedule("tiled", 128, 256, 64))
    # a plan made without out refuses an out its kernel was not specialised for
    b = torch.randn(8, 6)
    plan = numasched.plan_matmul_swiglu(x, b)
    with pytest.raises(ValueError, match="16-byte aligned"):
        plan.run(x, b, out=torch.empty(10)[1:].view(3, 3))


@gpu
@pytest.mark.parametrize("m,n,k", [(1, 7168, 4096), (4, 14336, 4096), (16, 7168, 4096), (64, 12800, 5120),
                                   (3, 1001, 777)])
def test_gpu_swiglu_decode_sizes(m, n, k):
    x, b = _data(m, n, k, torch.bfloat16, seed=m, device="cuda")
    out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
    y = numasched.plan_matmul_swiglu(x, b).run(x, b, out)
    assert _err(y, x, b) < 1e-2


@gpu
def test_gpu_swiglu_in_a_cuda_graph():
    x, b = _data(8, 7168, 4096, torch.bfloat16, device="cuda")
    plan = numasched.plan_matmul_swiglu(x, b)
    out = torch.empty(8, 7168, dtype=torch.bfloat16, device="cuda")
    plan.run(x, b, out)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        plan.run(x, b, out)
    for _ in range(3):
        x.normal_()
        out.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        assert _err(out, x, b) < 1e-2


@cpu
def test_swiglu_bf16_into_a_strided_out():
    """bf16 in the interpreter computes on fp32 stand-ins: they keep the planned strides, so an
    out that is a column slice of a wider buffer is written where it should be (a contiguous
    stand-in wrote rows out of place, past its end)."""
    x, b = _data(5, 40, 64, torch.bfloat16, seed=11)
    buf = torch.full((5, 80), float("nan"), dtype=torch.bfloat16)
    out = buf[:, :40]
    y = numasched.plan_matmul_swiglu(x, b, out).run(x, b, out)
    assert _err(y, x, b) < 1e-2 and torch.isnan(buf[:, 40:]).all()


@cpu
def test_swiglu_under_torch_compile_and_fake_tensors():
    """The custom op: fake tensors give the output's shape and dtype without running; a compiled
    function calling it matches the eager call; autograd is refused by name."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        y = numasched.matmul_swiglu(torch.empty(3, 16), torch.empty(16, 10))
    assert y.shape == (3, 5) and y.dtype == torch.float32
    x, b = _data(4, 24, 64, torch.float32, seed=2)
    f = torch.compile(lambda x, b: numasched.matmul_swiglu(x, b) * 2, backend="eager", fullgraph=True)
    assert torch.allclose(f(x, b), 2 * numasched.matmul_swiglu(x, b))
    with pytest.raises(RuntimeError, match="no backward"):
        numasched.matmul_swiglu(x.requires_grad_(), b)


# ---- numasched.swiglu_matmul: the activation on the A side, (silu(h[:, :k]) * h[:, k:]) @ b
def _data_in(m, n, k, dtype, wt=True, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(m, 2 * k, generator=g).to(device=device, dtype=dtype)
    w = torch.randn(n, k, generator=g).to(device=device, dtype=dtype) / k ** 0.5
    return h, (w.T if wt else w.T.contiguous())


def _err_in(y, h, b):
    assert not torch.isnan(y).any(), "unwritten (NaN-poisoned) output"
    k = b.shape[0]
    act = (F.silu(h[:, :k].double()) * h[:, k:].double())
    r = act @ b.double()
    return ((y.double() - r).norm() / r.norm().clamp_min(1e-30)).item()


@cpu
@pytest.mark.parametrize("m,n,k,dtype", [(1, 40, 64, torch.float32), (5, 24, 200, torch.float32),
                                         (17, 33, 97, torch.float16), (2, 7, 35, torch.float32)])
@pytest.mark.parametrize("wt", [True, False])
def test_swiglu_matmul_matches_float64(m, n, k, dtype, wt):
    h, b = _data_in(m, n, k, dtype, wt, seed=m + n + k)
    plan = numasched.plan_swiglu_matmul(h, b)
    out = torch.full((m, n), float("nan"), dtype=dtype)
    y = plan.run(h, b, out)
    assert y is out and plan.side == "in" and plan.path == "pointer"
    assert _err_in(y, h, b) < TOL[dtype]


@cpu
@pytest.mark.parametrize("split_k", [1, 3])
def test_swiglu_matmul_forced_splits_are_deterministic(split_k):
    """A given split-K schedule keeps its tile (no halving: the activation is on A), merges in
    split order (the same bits every call) and resets its counters; the one call agrees."""
    from numasched import gemm as api

    h, b = _data_in(6, 40, 160, torch.float32, seed=4)
    s = Schedule("splitk", 16, 32, 16, split_k, 4, 2)
    plan = numasched.plan_swiglu_matmul(h, b, schedule=s)
    first = plan.run(h, b, torch.full((6, 40), float("nan")))
    assert plan.split_k == split_k and plan.block_n == 32 and _err_in(first, h, b) < 1e-5
    for _ in range(2):
        assert torch.equal(plan.run(h, b), first)
    if split_k > 1:
        assert int(api._CTRS[("cpu", None, 0)][:plan._tiles].abs().sum()) == 0
    assert _err_in(numasched.swiglu_matmul(h, b), h, b) < 1e-5   # its own (default) schedule


@cpu
def test_swiglu_matmul_equals_the_two_step_form():
    """The fused operand is F.silu(g) * u as the model's elementwise step rounds it (fp16):
    the same GEMM on that tensor gives the same result to the GEMM's own rounding."""
    h, b = _data_in(4, 48, 64, torch.float16, seed=9)
    two_step = numasched.matmul(F.silu(h[:, :64]) * h[:, 64:], b)
    y = numasched.swiglu_matmul(h, b)
    assert (y.float() - two_step.float()).abs().max().item() <= 2e-3 * two_step.float().abs().max().item()


def test_swiglu_matmul_argument_errors_name_the_argument():
    h = torch.randn(3, 8)
    with pytest.raises(ValueError, match="h must have an even, positive number of columns"):
        numasched.swiglu_matmul(torch.randn(3, 7), torch.randn(4, 5))
    with pytest.raises(ValueError, match="b has 5 rows but h's gate half has 4"):
        numasched.swiglu_matmul(h, torch.randn(5, 6))
    with pytest.raises(ValueError, match=r"out must have shape \(3, 6\)"):
        numasched.swiglu_matmul(h, torch.randn(4, 6), out=torch.empty(3, 5))
    with pytest.raises(TypeError):
        numasched.swiglu_matmul(h, torch.randn(4, 6).double())
    with pytest.raises(ValueError, match="split-K Schedule"):
        numasched.plan_swiglu_matmul(h, torch.randn(4, 6), schedule=Schedule("tiled", 128, 256, 64))
    with pytest.raises(ValueError, match="side must be"):
        numasched.gemm_glu.SwiGLUPlan(h, torch.randn(4, 6), side="up")


@cpu
def test_swiglu_matmul_under_torch_compile_and_fake_tensors():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        y = numasched.swiglu_matmul(torch.empty(3, 16), torch.empty(8, 10))
    assert y.shape == (3, 10) and y.dtype == torch.float32
    h, b = _data_in(4, 24, 32, torch.float32, seed=2)
    f = torch.compile(lambda h, b: numasched.swiglu_matmul(h, b) * 2, backend="eager", fullgraph=True)
    assert torch.allclose(f(h, b), 2 * numasched.swiglu_matmul(h, b))
    with pytest.raises(RuntimeError, match="no backward"):
        numasched.swiglu_matmul(h.requires_grad_(), b)


@gpu
@pytest.mark.parametrize("m,n,k", [(1, 4096, 7168), (4, 4096, 7168), (16, 4096, 14336), (64, 5120, 12800),
                                   (3, 1001, 777)])
def test_gpu_swiglu_matmul_decode_sizes(m, n, k):
    h, b = _data_in(m, n, k, torch.bfloat16, seed=m, device="cuda")
    out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
    y = numasched.plan_swiglu_matmul(h, b).run(h, b, out)
    assert _err_in(y, h, b) < 1e-2


@gpu
def test_gpu_swiglu_matmul_in_a_cuda_graph():
    h, b = _data_in(8, 4096, 7168, torch.bfloat16, device="cuda")
    plan = numasched.plan_swiglu_matmul(h, b)
    out = torch.empty(8, 4096, dtype=torch.bfloat16, device="cuda")
    plan.run(h, b, out)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        plan.run(h, b, out)
    for _ in range(3):
        h.normal_()
        out.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        assert _err_in(out, h, b) < 1e-2
