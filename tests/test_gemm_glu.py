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


def _replays_right(m, n, k, replays, seed=0):
    """matmul_swiglu's automatic plan captured in a CUDA graph: each replay on fresh inputs, its
    output poisoned first, against float64."""
    x, b = _data(m, n, k, torch.bfloat16, device="cuda", seed=seed)
    plan = numasched.plan_matmul_swiglu(x, b)
    out = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
    plan.run(x, b, out)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        plan.run(x, b, out)
    for _ in range(replays):
        x.normal_()
        out.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        assert _err(out, x, b) < 1e-2, plan.path


@cpu
@pytest.mark.parametrize("m,n,k,dtype", [(1, 40, 64, torch.float32), (5, 24, 200, torch.float32),
                                         (17, 33, 97, torch.float16), (3, 16, 48, torch.float32),
                                         (2, 7, 35, torch.float32), (4, 24, 36, torch.float16)])
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
@pytest.mark.parametrize("split_k", [1, 2])
def test_swiglu_reads_a_partial_last_tile_row_through_pointers(split_k):
    """options.gemm_splitk_operands="b_tma_last": 37 rows in 16-row tiles, the partial third row
    reads A through masked pointer loads, the full ones through the descriptor; float64 agrees."""
    x, b = _data(37, 24, 160, torch.float32, seed=9)
    s = Schedule("splitk", 16, 32, 16, split_k, 4, 2)
    with options.use(gemm_splitk_tma=True, gemm_splitk_operands="b_tma_last"):
        plan = numasched.plan_matmul_swiglu(x, b, schedule=s)
        y = plan.run(x, b, torch.full((37, 24), float("nan")))
    assert plan.path == "tma" and plan.a_pointer == "b_tma_last"
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


@pytest.mark.parametrize("m,n,k,dtype,split_k,tma", [(5, 24, 200, torch.float32, 1, False),
                                                     (17, 33, 97, torch.float16, 1, False),
                                                     (6, 24, 160, torch.float32, 3, True),
                                                     (6, 24, 160, torch.float32, 1, True)])
def test_swiglu_row_scale_matches_float64(m, n, k, dtype, split_k, tma):
    """row_scale (a folded RMSNorm's 1 / rms per row): row i of a counts as s[i] * a[i], in the
    unsplit store, the split merge and the TMA path; a plan made with it refuses a call without."""
    x, b = _data(m, n, k, dtype, seed=m + k)
    sc = torch.rand(m, generator=torch.Generator().manual_seed(m)) * 3 + 0.1
    xs = (x.double() * sc.double()[:, None])
    sched = Schedule("splitk", 16, 32, 16, split_k, 4, 2) if tma else None
    with options.use(gemm_splitk_tma=tma):
        plan = numasched.plan_matmul_swiglu(x, b, schedule=sched, row_scale=sc)
        y = plan.run(x, b, torch.full((m, n), float("nan"), dtype=dtype), sc)
    assert plan.row_scale and (plan.path == "tma") == tma and plan.split_k == (split_k if tma else plan.split_k)
    assert _err(y, xs, b) < TOL[dtype]
    if not tma:   # the one call plans the same kernel
        assert torch.equal(numasched.matmul_swiglu(x, b, row_scale=sc), y)
    with pytest.raises(ValueError, match="row_scale is missing"):
        plan.run(x, b)
    with pytest.raises(TypeError, match="row_scale has dtype torch.float64"):
        numasched.matmul_swiglu(x, b, row_scale=sc.double())
    with pytest.raises(ValueError, match="row_scale must be a contiguous"):
        numasched.matmul_swiglu(x, b, row_scale=torch.ones(m + 1))


@cpu
@pytest.mark.parametrize("m,n,k,dtype,wt,scale", [(37, 40, 80, torch.float32, True, False),
                                                 (37, 40, 80, torch.float32, False, True),
                                                 (50, 24, 48, torch.float16, True, True),
                                                 (9, 70, 40, torch.bfloat16, True, False),
                                                 (20, 36, 24, torch.float32, True, "transposed")])
def test_swiglu_persistent_kernel_matches_float64(m, n, k, dtype, wt, scale):
    """The persistent prefill kernel (a "tiled ... persistent" schedule; interpreter: 16 x 16
    tiles, three programs, so each loops over several tiles): gate tiles whose last columns run
    into the up half (n not a multiple of the tile), partial row tiles, K not a multiple of 16,
    B in both orders, with and without row factors; into a given out and a new one; outputs a
    TMA descriptor cannot address (bf16 rows of 70 elements, a column-major out) by masked
    stores."""
    from numasched import gemm_glu

    x, b = _data(m, n, k, dtype, wt, seed=m * n + k)
    transposed = scale == "transposed"
    sc = torch.rand(m, generator=torch.Generator().manual_seed(k)) * 3 + 0.1 if scale and not transposed else None
    want = x.double() * sc.double()[:, None] if sc is not None else x
    out = torch.full((n, m), float("nan"), dtype=dtype).T if transposed else torch.full((m, n), float("nan"),
                                                                                          dtype=dtype)
    with options.use(gemm_splitk_tma=True):
        plan = numasched.plan_matmul_swiglu(x, b, out if transposed else None,
                                            schedule=gemm_glu.GLU_PERSISTENT_SCHEDULE, row_scale=sc)
        y = plan.run(x, b, out, sc)
        y2 = None if transposed else plan.run(x, b, None, sc)
    assert plan.path == "tma-persistent" and plan.grid == (3,) and plan._tiles > 3
    assert plan._c_tma == (not transposed and (n * dtype.itemsize) % 16 == 0)
    assert y is out and _err(y, want, b) < TOL[dtype]
    assert y2 is None or torch.equal(y2, y)


@cpu
def test_swiglu_persistent_schedule_refusals_name_the_reason():
    from numasched import gemm_glu

    x, b = _data(8, 16, 32, torch.float32, seed=1)
    with options.use(gemm_splitk_tma=True):
        with pytest.raises(ValueError, match="schedule must be persistent"):
            numasched.plan_matmul_swiglu(x, b, schedule=Schedule.parse("tiled 128x256x64 w8 s3"))
        with pytest.raises(ValueError, match="a must be row-major"):
            numasched.plan_matmul_swiglu(x.T.contiguous().T, b, schedule=gemm_glu.GLU_PERSISTENT_SCHEDULE)
    with options.use(gemm_splitk_tma=False):
        with pytest.raises(ValueError, match="TMA descriptors are off"):
            numasched.plan_matmul_swiglu(x, b, schedule=gemm_glu.GLU_PERSISTENT_SCHEDULE)
    with pytest.raises(ValueError, match="split-K Schedule or a persistent tiled one"):
        numasched.plan_matmul_swiglu(x, b, schedule=Schedule.parse("streamk 128x256x64 w8 s3"))


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
    with pytest.raises(ValueError, match="schedule must be persistent"):
        numasched.plan_matmul_swiglu(x, torch.randn(8, 6), schedule=Schedule("tiled", 128, 256, 64))
    # a plan made without out refuses an out its kernel was not specialised for
    b = torch.randn(8, 6)
    plan = numasched.plan_matmul_swiglu(x, b)
    with pytest.raises(ValueError, match="16-byte aligned"):
        plan.run(x, b, out=torch.empty(10)[1:].view(3, 3))


@cpu
@pytest.mark.parametrize("m,n,k,dtype", [(40, 96, 64, torch.float32), (3, 48, 32, torch.float16)])
def test_swiglu_as_gemm_then_activation_matches_float64(m, n, k, dtype):
    """options.glu_fused=False: numasched.matmul into an (M, 2n) buffer, then numasched.swiglu;
    into a poisoned out, twice (its activation plan cached by out's signature); a row factor or a
    schedule asked for keeps the fused kernel."""
    x, b = _data(m, n, k, dtype, seed=m)
    with options.use(glu_fused=False):
        plan = numasched.plan_matmul_swiglu(x, b)
        assert plan.path == "two-kernel"
        for _ in range(2):
            out = torch.full((m, n), float("nan"), dtype=dtype)
            assert plan.run(x, b, out) is out and _err(out, x, b) < TOL[dtype]
        assert _err(numasched.matmul_swiglu(x, b), x, b) < TOL[dtype]
        scale = torch.rand(m) + 0.5
        assert numasched.plan_matmul_swiglu(x, b, row_scale=scale).path != "two-kernel"
        forced = Schedule.parse("splitk 16x32x16 w4 s1")
        assert numasched.plan_matmul_swiglu(x, b, schedule=forced).path != "two-kernel"


def test_swiglu_fused_rule():
    """gemm_glu.glu_fused_pays: the fused split-K kernel at 1-16 rows, and up to 64 rows where its
    GLU tiles (half the (M, 2n, K) schedule's columns) are 64 or more; else the GEMM then the
    activation (bench/results/glu-s39/)."""
    from numasched.gemm_glu import glu_fused_pays

    wide, narrow = Schedule.parse("splitk 32x128x128 w4 s5"), Schedule.parse("splitk 32x32x256 w4 s6")
    assert glu_fused_pays(16, narrow) and glu_fused_pays(1, narrow)
    assert glu_fused_pays(64, wide) and not glu_fused_pays(24, narrow)
    assert not glu_fused_pays(65, wide) and not glu_fused_pays(140, Schedule.parse("splitk 128x128x64 w8 s6"))


@gpu
@pytest.mark.parametrize("m", [24, 72, 140, 300])
def test_gpu_swiglu_as_gemm_then_activation_in_a_cuda_graph(m):
    """The automatic plan at 24-300 rows (the two kernels where glu_fused_pays says so) in a CUDA
    graph: fresh inputs each replay, the output poisoned before it."""
    _replays_right(m, 7168, 4096, replays=2, seed=m)


@gpu
@pytest.mark.parametrize("m,n,k", [(1, 7168, 4096), (4, 14336, 4096), (16, 7168, 4096), (64, 12800, 5120),
                                   (3, 1001, 777), (5, 7000, 5000)])
def test_gpu_swiglu_decode_sizes(m, n, k):
    x, b = _data(m, n, k, torch.bfloat16, seed=m, device="cuda")
    out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
    y = numasched.plan_matmul_swiglu(x, b).run(x, b, out)
    assert _err(y, x, b) < 1e-2


@gpu
@pytest.mark.parametrize("m,n,k", [(512, 7168, 4096), (1000, 1111, 640), (4096, 7168, 4096)])
def test_gpu_swiglu_prefill_sizes(m, n, k):
    """From GLU_BIG_MIN_ROWS rows the plan takes the persistent kernel or the big split-K tiles
    (options.glu_persistent; odd sizes too)."""
    from numasched import gemm_glu

    x, b = _data(m, n, k, torch.bfloat16, seed=m, device="cuda")
    for persistent in (None, False, True):   # options.glu_persistent (None: the module's default)
        out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
        with options.use(glu_persistent=persistent):
            plan = numasched.plan_matmul_swiglu(x, b)
            y = plan.run(x, b, out)
        want = gemm_glu.GLU_PERSISTENT_BY_DEFAULT if persistent is None else persistent
        assert plan.schedule == (gemm_glu.GLU_PERSISTENT_SCHEDULE if want else gemm_glu.GLU_BIG_SCHEDULE)
        assert plan.block_n == 128 and plan.path == ("tma-persistent" if want else "tma")
        assert _err(y, x, b) < 1e-2


@gpu
@pytest.mark.parametrize("m,n,k,scale", [(512, 7168, 4096, False), (1000, 1111, 640, True), (4096, 7168, 4096, True)])
def test_gpu_swiglu_persistent_kernel(m, n, k, scale):
    """The persistent prefill kernel in bf16 at prefill sizes (odd ones too), with and without row
    factors, poisoned outputs, against float64; two calls give the same bits."""
    from numasched import gemm_glu

    x, b = _data(m, n, k, torch.bfloat16, seed=m + 1, device="cuda")
    sc = torch.rand(m, device="cuda") * 2 + 0.25 if scale else None
    want = x.double() * sc.double()[:, None] if scale else x
    out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
    plan = numasched.plan_matmul_swiglu(x, b, schedule=gemm_glu.GLU_PERSISTENT_SCHEDULE, row_scale=sc)
    y = plan.run(x, b, out, sc)
    assert plan.path == "tma-persistent" and plan.block_n == 128
    assert _err(y, want, b) < 1e-2
    assert torch.equal(plan.run(x, b, None, sc), y)


@cpu
def test_swiglu_big_tile_rule():
    """The prefill rule: 2-byte operands from GLU_BIG_MIN_ROWS rows; its schedule is a 128 x 128
    gate tile and its up tile (half the (M, 2n) GEMM's 128 x 256), unsplit; it runs (interpreter,
    fp16, a small K) and matches float64."""
    from numasched import gemm_glu

    R = gemm_glu.GLU_BIG_MIN_ROWS
    assert gemm_glu.big_tiles(R, 7168, torch.bfloat16) and gemm_glu.big_tiles(R, 7168, torch.float16)
    assert not gemm_glu.big_tiles(R - 1, 7168, torch.bfloat16)
    assert not gemm_glu.big_tiles(R, 7168, torch.float32) and not gemm_glu.big_tiles(R, 64, torch.bfloat16)
    s = gemm_glu.GLU_BIG_SCHEDULE
    assert (s.kind, s.block_m, s.block_n, s.split_k) == ("splitk", 128, 256, 1)
    x, b = _data(130, 136, 64, torch.float16, seed=3)
    plan = numasched.plan_matmul_swiglu(x, b, schedule=s)
    y = plan.run(x, b, torch.full((130, 136), float("nan"), dtype=torch.float16))
    assert plan.block_n == 128 and plan.split_k == 1 and _err(y, x, b) < 1e-2


@gpu
def test_gpu_swiglu_in_a_cuda_graph():
    _replays_right(8, 7168, 4096, replays=3)


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


# ---- numasched.swiglu: the activation alone (its own PDL-launched kernel)
def _gu(m, n, dtype, seed=0, device="cpu", wide=0):
    g = torch.Generator().manual_seed(seed)
    buf = torch.randn(m, 2 * n + wide, generator=g).to(device=device, dtype=dtype) * 3
    return buf[:, :2 * n]   # wide > 0: rows of a wider buffer (a strided, non-contiguous gu)


def _act_ref(gu):
    n = gu.shape[1] // 2
    return F.silu(gu[:, :n].double()) * gu[:, n:].double()


@cpu
@pytest.mark.parametrize("m,n,dtype,wide", [(1, 40, torch.float32, 0), (5, 2100, torch.float32, 0),
                                            (16, 96, torch.float16, 0), (3, 33, torch.bfloat16, 10),
                                            (2, 7, torch.float32, 3)])
def test_swiglu_activation_matches_float64(m, n, dtype, wide):
    gu = _gu(m, n, dtype, seed=m + n, wide=wide)
    out = torch.full((m, n), float("nan"), dtype=dtype)
    y = numasched.swiglu(gu, out=out)
    assert y is out and not torch.isnan(y).any()
    r = _act_ref(gu)
    assert ((y.double() - r).norm() / r.norm()).item() < TOL[dtype]
    # the plan without out writes a new tensor; the same values
    assert torch.equal(numasched.swiglu(gu), y)


def test_swiglu_activation_argument_errors_name_the_argument():
    with pytest.raises(ValueError, match="gu must have an even, positive number of columns"):
        numasched.swiglu(torch.randn(3, 7))
    with pytest.raises(ValueError, match="gu's columns must be contiguous"):
        numasched.swiglu(torch.randn(8, 3).T)
    with pytest.raises(ValueError, match=r"out must have shape \(3, 4\)"):
        numasched.swiglu(torch.randn(3, 8), out=torch.empty(3, 5))
    with pytest.raises(TypeError):
        numasched.swiglu(torch.randn(3, 8), out=torch.empty(3, 4, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="no backward"):
        numasched.swiglu(torch.randn(3, 8, requires_grad=True))
    plan = numasched.plan_swiglu(torch.randn(3, 8))
    with pytest.raises(ValueError, match="made without out"):
        plan.run(torch.randn(3, 8), out=torch.empty(3, 8)[:, :4])


@gpu
@pytest.mark.parametrize("m,n", [(1, 7168), (16, 14336), (64, 12800), (3, 1001)])
def test_gpu_swiglu_activation_decode_sizes_and_graph(m, n):
    gu = _gu(m, n, torch.bfloat16, seed=m, device="cuda")
    out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
    numasched.swiglu(gu, out=out)
    r = _act_ref(gu)
    assert ((out.double() - r).norm() / r.norm()).item() < 1e-2
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        numasched.swiglu(gu, out=out)
    gu.normal_()
    out.fill_(float("nan"))
    g.replay()
    torch.cuda.synchronize()
    r = _act_ref(gu)
    assert ((out.double() - r).norm() / r.norm()).item() < 1e-2


@cpu
def test_swiglu_activation_under_torch_compile_and_fake_tensors():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        y = numasched.swiglu(torch.empty(3, 16))
    assert y.shape == (3, 8) and y.dtype == torch.float32
    gu = _gu(4, 24, torch.float32, seed=5)
    f = torch.compile(lambda gu: numasched.swiglu(gu) * 2, backend="eager", fullgraph=True)
    assert torch.allclose(f(gu), 2 * numasched.swiglu(gu))
