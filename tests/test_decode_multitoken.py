"""Multi-token decode (speculative decoding) and paged page sizes, against a float64 reference.

q (batch, q_len, heads, head_dim) with 1 <= q_len <= 16 new tokens per sequence, already in the
cache and counted in cache_seqlens; causal, bottom-right aligned (token i sees the positions
< len - q_len + i + 1), as ``flash_attn_with_kvcache(causal=True)``. Paged caches of page sizes 1,
16, 64 and 256 with -1 in unused block-table slots, for one and several query tokens.

CPU: Triton's interpreter on small shapes (fp32, fp16, and bf16, which the host computes in fp32
there). GPU (-m gpu): real sizes, the autotuned path and CUDA-graph replay of a 4-D plan. Every
Triton test checks that the kernel ran (not the torch fallback) with outputs poisoned with NaN,
on fresh random data.
"""
import math
import warnings

import pytest
import torch

import numasched
import numasched.decode as D
from numasched import caps, observe, options
from numasched._plan import PLANS
from numasched._route import reset_warnings
from numasched.kernels import flash_decode as FD

from conftest import DEVICE

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")

TOL = {torch.float32: 2e-5, torch.float16: 1e-2, torch.bfloat16: 2e-2}


# ----------------------------------------------------------------------------- helpers
def reference(q, k_cache, v_cache, lens=None, block_table=None, scale=None):
    """float64 attention of q (B, H, D) or (B, Sq, H, D) over the cache, token i of Sq seeing the
    positions < len - Sq + i + 1: out like q, natural-log lse (B, H) or (B, Sq, H); a row that
    sees nothing gives zeros and -inf."""
    q4 = q if q.dim() == 4 else q[:, None]
    B, Sq, H, Dh = q4.shape
    if block_table is not None:
        bt = block_table.long().cpu().clamp(min=0)
        k = k_cache.cpu()[bt].reshape(B, -1, k_cache.shape[2], Dh)
        v = v_cache.cpu()[bt].reshape(B, -1, v_cache.shape[2], Dh)
    else:
        k, v = k_cache.cpu(), v_cache.cpu()
    HK, L = k.shape[2], k.shape[1]
    lens = torch.full((B,), L) if lens is None else lens.long().cpu()
    scale = 1 / math.sqrt(Dh) if scale is None else scale
    k = k.double().repeat_interleave(H // HK, dim=2)
    v = v.double().repeat_interleave(H // HK, dim=2)
    s = torch.einsum("bthd,blhd->bthl", q4.double().cpu(), k) * scale
    limit = lens[:, None] - Sq + 1 + torch.arange(Sq)[None, :]  # (B, Sq)
    valid = torch.arange(L)[None, None, :] < limit[:, :, None]
    s = s.masked_fill(~valid[:, :, None, :], float("-inf"))
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - lse[..., None]).nan_to_num(0.0)
    out = torch.einsum("bthl,blhd->bthd", p, v)
    if q.dim() == 3:
        out, lse = out[:, 0], lse[:, 0]
    return out, lse


def check(out, lse, ref_out, ref_lse, dtype):
    tol = TOL[dtype]
    assert out.shape == ref_out.shape and lse.shape == ref_lse.shape
    assert torch.isfinite(out).all(), "output has NaN/inf (unwritten or bad combine)"
    torch.testing.assert_close(out.double().cpu(), ref_out, atol=tol, rtol=tol)
    lse = lse.cpu()
    empty = torch.isinf(ref_lse)
    assert torch.equal(torch.isinf(lse) & (lse < 0), empty), "lse must be -inf exactly for rows that see nothing"
    torch.testing.assert_close(lse.double()[~empty], ref_lse[~empty], atol=tol, rtol=tol)
    assert torch.all(out.cpu()[empty] == 0), "a row that sees nothing must give zeros"


def _randn(g, *shape):
    return torch.randn(*shape, generator=g)


def make_contiguous(B, Sq, H, HK, Dh, L, dtype, device, seed=0):
    """q (B, Sq, H, Dh) (or (B, H, Dh) with Sq None) and a (B, L, HK, Dh) cache."""
    g = torch.Generator().manual_seed(seed)
    q = _randn(g, B, H, Dh) if Sq is None else _randn(g, B, Sq, H, Dh)
    k, v = _randn(g, B, L, HK, Dh), _randn(g, B, L, HK, Dh)
    return q.to(device, dtype), k.to(device, dtype), v.to(device, dtype)


def make_paged(B, Sq, H, HK, Dh, page, max_pages, lens, dtype, device, seed=0, spare_pages=3):
    """A paged cache with a random, non-identity block table; unused table slots hold -1."""
    g = torch.Generator().manual_seed(seed)
    num_pages = B * max_pages + spare_pages
    q = _randn(g, B, H, Dh) if Sq is None else _randn(g, B, Sq, H, Dh)
    k, v = _randn(g, num_pages, page, HK, Dh), _randn(g, num_pages, page, HK, Dh)
    perm = torch.randperm(num_pages, generator=g)[: B * max_pages].reshape(B, max_pages).to(torch.int32)
    used = torch.arange(max_pages)[None, :] < ((lens.long() + page - 1) // page)[:, None]
    bt = torch.where(used, perm, torch.full_like(perm, -1))
    assert (bt == -1).any(), "the table must hold -1 in unused slots"
    return (q.to(device, dtype), k.to(device, dtype), v.to(device, dtype), bt.to(device),
            lens.to(torch.int32).to(device))


@pytest.fixture
def launches():
    """Asserts the Triton path ran during the test (and no torch fallback did)."""
    with observe.record() as log:
        yield log
    assert log.count("flash_decode", kernel="flash_decode") > 0, "the Triton kernel did not run"
    assert not log.fallbacks(), "the torch fallback ran"


@pytest.fixture
def poisoned():
    """Outputs are filled with NaN before every launch."""
    with observe.record(poison=True) as log:
        yield log


@pytest.fixture(params=["fused", "kernel"])
def combine(request):
    with options.use(decode_combine=request.param):
        yield request.param


# ----------------------------------------------------------------------------- CPU (interpreter)
# (q_len, heads, kv_heads, head_dim, dtype, num_splits, combine): q_len 1-16, GQA groups 1, 4, 5, 7
# and 16, head dims 64, 96, 80 and 32, fp32 / fp16 / bf16, one split and several with either
# combine; lengths 0, 1, q_len - 1 (< q_len: the first tokens see nothing) and longer
CONTIGUOUS_CASES = [
    (2, 4, 4, 64, torch.float32, 1, "auto"),
    (3, 8, 2, 64, torch.float16, 3, "fused"),
    (3, 8, 2, 64, torch.float16, 3, "kernel"),
    (4, 10, 2, 96, torch.float32, 2, "kernel"),
    (8, 7, 1, 64, torch.float16, 4, "fused"),  # 56 rows in one 64-row tile, merged in the last split
    (16, 4, 1, 64, torch.float32, 2, "kernel"),
    (2, 16, 1, 80, torch.float32, 3, "fused"),
    (16, 16, 1, 32, torch.float32, 2, "fused"),  # 256 (token, head) rows: four row groups
    (4, 8, 2, 64, torch.bfloat16, 2, "fused"),
]


@pytest.mark.parametrize("case", CONTIGUOUS_CASES, ids=lambda c: f"sq{c[0]}-h{c[1]}-hk{c[2]}-d{c[3]}-"
                         f"{str(c[4])[6:]}-s{c[5]}-{c[6]}")
def test_multi_contiguous(case, poisoned, launches):
    Sq, H, HK, Dh, dtype, ns, combine = case
    B, L = 5, 40
    q, k, v = make_contiguous(B, Sq, H, HK, Dh, L, dtype, DEVICE, seed=Sq * 100 + H)
    lens = torch.tensor([40, 0, 1, Sq - 1, 23], dtype=torch.int32, device=DEVICE)
    with options.use(decode_combine=combine):
        out, lse = numasched.flash_decode(q, k, v, cache_seqlens=lens, num_splits=ns, return_lse=True)
        plan = D._planned(q, k, v, lens, None, None, ns, "auto", False)  # the plan that ran
    assert plan.combine == ("none" if ns == 1 else combine)
    assert out.shape == q.shape and out.dtype == dtype and out.is_contiguous()
    assert lse.shape == (B, Sq, H) and lse.dtype == torch.float32
    check(out, lse, *reference(q, k, v, lens), dtype)


# page sizes 1, 16, 64, 256 for one query token (3-D q) and several; -1 in unused table slots
@pytest.mark.parametrize("page,max_pages,lens", [
    (1, 24, [24, 0, 1, 2, 13]),
    (16, 4, [64, 0, 1, 3, 17]),
    (64, 2, [128, 0, 1, 3, 65]),
    (256, 2, [300, 0, 1, 3, 257]),
], ids=lambda x: str(x) if isinstance(x, int) else None)
@pytest.mark.parametrize("Sq", [None, 4])
def test_paged_page_sizes(page, max_pages, lens, Sq, poisoned, launches):
    B, H, HK, Dh = len(lens), 4, 2, 32
    dtype = torch.float16 if page == 16 else torch.float32
    q, k, v, bt, lens = make_paged(B, Sq, H, HK, Dh, page, max_pages, torch.tensor(lens), dtype, DEVICE,
                                   seed=page)
    # one split and several (the fused combine: G * Sq <= 16 rows)
    for ns in (1, 3):
        out, lse = numasched.flash_decode(q, k, v, cache_seqlens=lens, block_table=bt, num_splits=ns,
                                          return_lse=True)
        check(out, lse, *reference(q, k, v, lens, bt), dtype)


@pytest.mark.parametrize("Sq,H,HK,page", [(3, 10, 2, 16), (8, 8, 1, 64)])
def test_multi_paged(Sq, H, HK, page, combine, poisoned, launches):
    B, Dh, max_pages = 4, 64, 3
    lens = torch.tensor([page * max_pages, 0, Sq - 1, page + 2])
    q, k, v, bt, lens = make_paged(B, Sq, H, HK, Dh, page, max_pages, lens, torch.float32, DEVICE, seed=Sq)
    out, lse = numasched.flash_decode(q, k, v, cache_seqlens=lens, block_table=bt, num_splits=2, return_lse=True)
    check(out, lse, *reference(q, k, v, lens, bt), torch.float32)


@pytest.mark.parametrize("paged", [False, True])
def test_one_token_4d_equals_3d(paged, combine, launches):
    # q (B, 1, H, D) runs the single-token kernel on the same numbers: bit-identical results
    B, H, HK, Dh = 3, 8, 2, 32
    lens = torch.tensor([30, 0, 7])
    if paged:
        q, k, v, bt, lens = make_paged(B, None, H, HK, Dh, 8, 4, lens, torch.float32, DEVICE, seed=3)
    else:
        q, k, v = make_contiguous(B, None, H, HK, Dh, 30, torch.float32, DEVICE, seed=3)
        bt, lens = None, lens.to(torch.int32).to(DEVICE)
    for ns in (1, 3):
        out3, lse3 = numasched.flash_decode(q, k, v, cache_seqlens=lens, block_table=bt, num_splits=ns,
                                            return_lse=True)
        out4, lse4 = numasched.flash_decode(q[:, None], k, v, cache_seqlens=lens, block_table=bt, num_splits=ns,
                                            return_lse=True)
        assert out4.shape == (B, 1, H, Dh) and lse4.shape == (B, 1, H)
        assert torch.equal(out4[:, 0], out3) and torch.equal(lse4[:, 0], lse3)


def test_multi_whole_cache_strided_q_and_scale(poisoned, launches):
    # no cache_seqlens (each sequence is the whole cache), a q sliced out of a wider tensor, the
    # cache as k.transpose(1, 2) of (B, HK, L, D) (the HF layout), a custom scale
    B, Sq, H, HK, Dh, L = 2, 5, 4, 2, 32, 21
    g = torch.Generator().manual_seed(9)
    qw = torch.randn(B, Sq, H, 2 * Dh, generator=g).to(DEVICE)
    kb = torch.randn(B, HK, L, Dh, generator=g).to(DEVICE)
    vb = torch.randn(B, HK, L, Dh, generator=g).to(DEVICE)
    q, k, v = qw[..., :Dh], kb.transpose(1, 2), vb.transpose(1, 2)
    assert not q.is_contiguous() and not k.is_contiguous()
    out, lse = numasched.flash_decode(q, k, v, scale=0.2, num_splits=2, return_lse=True)
    assert out.is_contiguous()
    check(out, lse, *reference(q, k, v, scale=0.2), torch.float32)


def test_multi_plan_run_outputs_and_cache(launches):
    B, Sq, H, HK, Dh, L = 2, 3, 8, 2, 32, 24
    lens = torch.tensor([24, 2], dtype=torch.int32, device=DEVICE)
    q, k, v = make_contiguous(B, Sq, H, HK, Dh, L, torch.float32, DEVICE, seed=11)
    plan = numasched.plan_decode(q, k, v, cache_seqlens=lens, num_splits=2)
    assert plan.shape.q_len == Sq and plan.shape.q_4d and plan.row_groups == 1
    assert plan.grid == (B * HK * plan.row_groups * 2,) and plan.combine == "fused"
    assert plan._split.kwargs["SQ"] == Sq and plan._split.kwargs["BLOCK_G"] == 16
    for seed in range(2):  # one plan, several steps with new data
        q, k, v = make_contiguous(B, Sq, H, HK, Dh, L, torch.float32, DEVICE, seed=12 + seed)
        out, lse = plan.run(q, k, v, lens, return_lse=True)
        check(out, lse, *reference(q, k, v, lens), torch.float32)
    # caller's outputs of another layout (the non-thin launch path)
    out = torch.full((B, H, Sq, Dh), float("nan"), device=DEVICE).transpose(1, 2)
    lse = torch.full((H, B, Sq), float("nan"), device=DEVICE).permute(1, 2, 0)
    plan.run(q, k, v, lens, out=out, lse=lse)
    check(out, lse, *reference(q, k, v, lens), torch.float32)
    with pytest.raises(ValueError, match=r"out must have shape \(2, 3, 8, 32\)"):
        plan.run(q, k, v, lens, out=torch.empty(B, Sq, H, Dh + 1, device=DEVICE))
    with pytest.raises(ValueError, match=r"out must have 4 dimensions"):
        plan.run(q, k, v, lens, out=torch.empty(B, H, Dh, device=DEVICE))
    with pytest.raises(ValueError, match=r"lse must have shape \(2, 3, 8\)"):
        plan.run(q, k, v, lens, lse=torch.empty(B, Sq, H + 1, device=DEVICE))
    with pytest.raises(ValueError, match="q is .* but the plan was made for"):
        plan.run(q[:, :2], k, v, lens)
    # the plan cache: 3-D and 4-D q (and each q_len) get plans of their own
    PLANS.clear()
    for x in (q, q[:, :1], q[:, 0], q):
        numasched.flash_decode(x, k, v, cache_seqlens=lens, num_splits=2)
    assert len(PLANS.plans("flash_decode")) == 3


def test_row_tiling_and_combine_choice():
    assert FD.row_tiling(1, 4) == (16, 1) and FD.row_tiling(1, 64) == (64, 1)  # single token: as before
    assert FD.row_tiling(1, 128) == (128, 1)
    assert FD.row_tiling(4, 4) == (16, 1)  # GQA 4 x 4 tokens: the tile the single token pads to anyway
    assert FD.row_tiling(16, 4) == (64, 1)
    assert FD.row_tiling(16, 5) == (64, 2)  # 80 rows
    assert FD.row_tiling(16, 16) == (64, 4)
    assert FD.row_tiling(2, 128) == (64, 4)  # many heads per KV head: groups split a token's heads
    for sq in range(1, 17):
        for g in (1, 2, 4, 5, 7, 8, 16, 32):
            bg, r = FD.row_tiling(sq, g)
            assert bg >= 16 and bg & (bg - 1) == 0 and bg * r >= sq * g
            assert sq == 1 or (bg <= FD.MAX_ROWS and bg * (r - 1) < sq * g)
    q, k, v = (torch.empty(s, device=DEVICE) for s in ((2, 8, 8, 64), (2, 100, 2, 64), (2, 100, 2, 64)))
    auto = numasched.plan_decode(q[:, :4], k, v, num_splits=2)
    assert auto.combine == "fused" and auto.row_groups == 1  # 16 rows
    auto = numasched.plan_decode(q, k, v, num_splits=2)
    assert auto.combine == "kernel"  # 32 rows: the parallel combine kernel
    assert auto._launches[1].grid[0] == 2 * 8 * 8  # one program per (batch, token, head)


def test_multi_token_tuning_is_apart_and_prunes_two_warps():
    # the autotuner key of a multi-token launch differs from the single-token one of the same tile;
    # its 32-64-row tiles are not offered 2-warp configs (hundreds of registers per thread)
    assert FD.tune_key(4096, True, True) == FD.tune_key(4096, True, False) + FD.MULTI_TOKEN_TUNE
    k = torch.empty(1, 1, 1, 128, dtype=torch.bfloat16)
    for long in (False, True):
        tps = 1 << 16 if long else 512
        single = FD._prune_configs(FD._GPU_CONFIGS, {"K": k, "tune_key": FD.tune_key(tps, True, False)},
                                   PAGE_SIZE=0, BLOCK_D=128, BLOCK_G=32)
        multi = FD._prune_configs(FD._GPU_CONFIGS, {"K": k, "tune_key": FD.tune_key(tps, True, True)},
                                  PAGE_SIZE=0, BLOCK_D=128, BLOCK_G=32)
        assert multi and all(c.num_warps >= 4 for c in multi)
        assert {c.kwargs["BLOCK_N"] for c in multi} == {c.kwargs["BLOCK_N"] for c in single}  # same long-split rule
        if not long:
            assert any(c.num_warps == 2 for c in single)  # single-token tiles keep their candidates
    assert FD.fixed_config(False, 128, 64)["num_warps"] == 8 and FD.fixed_config(False, 128)["num_warps"] == 4


def test_multi_fused_counters_reset_with_row_groups(launches):
    B, Sq, H, HK, Dh, L = 1, 16, 16, 1, 16, 40  # four row groups, four arrival counters per sequence
    q, k, v = make_contiguous(B, Sq, H, HK, Dh, L, torch.float32, DEVICE, seed=21)
    with options.use(decode_combine="fused"):
        plan = numasched.plan_decode(q, k, v, num_splits=3)
        assert plan.row_groups == 4 and plan.combine == "fused"
        first = plan.run(q, k, v)
        second = plan.run(q, k, v)
    counters = D._counters(q.device, plan._items, caps.stream_handle(q.device))
    assert plan._items == 4 and int(counters[:4].abs().sum()) == 0
    assert torch.equal(first, second)
    torch.testing.assert_close(first.double(), reference(q, k, v)[0], atol=2e-5, rtol=2e-5)


def test_multi_torch_fallback(monkeypatch):
    # CPU tensors without the interpreter: the torch implementation, with the same causal rule
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    reset_warnings()
    B, Sq, H, HK, Dh = 3, 4, 4, 2, 16
    lens = torch.tensor([9, 0, 2])
    q, k, v, bt, lens = make_paged(B, Sq, H, HK, Dh, 4, 3, lens, torch.float32, "cpu", seed=22)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with observe.record() as log:
            out, lse = numasched.flash_decode(q, k, v, cache_seqlens=lens, block_table=bt, return_lse=True)
    assert log.kernels() == ["torch"]
    check(out, lse, *reference(q, k, v, lens, bt), torch.float32)


def test_multi_data_checks_reject_minus_one_in_used_slots():
    B, Sq, H, HK, Dh = 2, 3, 4, 2, 16
    lens = torch.tensor([9, 3])
    q, k, v, bt, lens = make_paged(B, Sq, H, HK, Dh, 4, 3, lens, torch.float32, DEVICE, seed=23)
    assert int(bt[1, 1]) == -1  # unused: accepted (the tests above)
    bad = bt.clone()
    bad[0, 2] = -1  # used by sequence 0 (tokens 8..9)
    with pytest.raises(ValueError, match=r"block_table\[0, 2\] = -1 is outside \[0, num_pages"):
        numasched.flash_decode(q, k, v, cache_seqlens=lens, block_table=bad)
    with pytest.raises(ValueError, match=r"cache_seqlens\[1\] = 13 is outside"):
        numasched.flash_decode(q, k, v, cache_seqlens=torch.tensor([9, 13], dtype=torch.int32, device=DEVICE),
                               block_table=bt)


def test_multi_custom_op_and_compile(launches):
    B, Sq, H, HK, Dh, L = 2, 3, 4, 2, 16, 20
    q, k, v = make_contiguous(B, Sq, H, HK, Dh, L, torch.float32, DEVICE, seed=24)
    lens = torch.tensor([20, 2], dtype=torch.int32, device=DEVICE)
    torch.library.opcheck(torch.ops.numasched.flash_decode.default, (q, k, v, lens, None, None, 2, "auto"),
                          test_utils=("test_schema", "test_faketensor"))

    def f(q, k, v, lens):
        out, lse = numasched.flash_decode(q, k, v, cache_seqlens=lens, num_splits=2, return_lse=True)
        return out * 2, lse

    torch._dynamo.reset()
    out, lse = torch.compile(f, backend="aot_eager", fullgraph=True)(q, k, v, lens)
    check(out / 2, lse, *reference(q, k, v, lens), torch.float32)


def test_empty_batch_4d():
    q, k, v = make_contiguous(2, 3, 4, 2, 16, 8, torch.float32, "cpu")
    out, lse = numasched.flash_decode(q[:0], k[:0], v[:0], return_lse=True)
    assert out.shape == (0, 3, 4, 16) and lse.shape == (0, 3, 4)


def test_bench_multi_token_dry_run(capsys):
    import argparse

    from numasched.bench import decode as bench

    assert bench.main(["--dry-run", "--sq", "2,16", "--heads", "gqa", "--batch", "1", "--ctx", "1024",
                       "--pages", "16", "256"]) == 0
    out = capsys.readouterr().out
    assert "q_len 2" in out and "q_len 16" in out and "rows 64 x 1 group(s)" in out
    assert "paged 256" in out and "causal_lower_right" in out and "FlashInfer paged prefill" in out
    assert bench._q_lens("4,2,4") == [4, 2]
    for bad in ("0", "17", "x", ""):
        with pytest.raises(argparse.ArgumentTypeError, match="query lengths"):
            bench._q_lens(bad)


# ----------------------------------------------------------------------------- GPU
gpu = pytest.mark.gpu


@gpu
@pytest.mark.parametrize("dtype,H,HK,Dh,Sq", [
    (torch.bfloat16, 32, 8, 128, 2), (torch.bfloat16, 32, 8, 128, 4), (torch.bfloat16, 32, 8, 128, 8),
    (torch.bfloat16, 32, 8, 128, 16), (torch.bfloat16, 28, 4, 128, 5), (torch.bfloat16, 16, 1, 64, 16),
    (torch.bfloat16, 8, 1, 256, 3), (torch.float16, 32, 8, 128, 4), (torch.float32, 32, 8, 128, 4)])
@pytest.mark.parametrize("page", [0, 16, 64, 256])
def test_gpu_multi_real_sizes(dtype, H, HK, Dh, Sq, page, combine, fixed_config, poisoned, launches):
    B, L = 6, 3000
    lens = torch.tensor([3000, 0, 1, Sq - 1, 2049, 777], dtype=torch.int32)
    if page:
        q, k, v, bt, lens = make_paged(B, Sq, H, HK, Dh, page, -(-L // page) + 1, lens, dtype, "cuda")
    else:
        q, k, v = make_contiguous(B, Sq, H, HK, Dh, L, dtype, "cuda")
        bt, lens = None, lens.cuda()
    ref = reference(q, k, v, lens, bt)
    for ns in (None, 1, 7):
        out, lse = numasched.flash_decode(q, k, v, cache_seqlens=lens, block_table=bt, num_splits=ns,
                                          return_lse=True)
        check(out, lse, *ref, dtype)


@gpu
@pytest.mark.parametrize("page", [0, 16])
def test_gpu_multi_one_token_equals_3d(page, fixed_config):
    B, H, HK, Dh, L = 4, 32, 8, 128, 4096
    lens = torch.tensor([4096, 1, 0, 999], dtype=torch.int32)
    if page:
        q, k, v, bt, lens = make_paged(B, None, H, HK, Dh, page, L // page, lens, torch.bfloat16, "cuda")
    else:
        q, k, v = make_contiguous(B, None, H, HK, Dh, L, torch.bfloat16, "cuda")
        bt, lens = None, lens.cuda()
    out3, lse3 = numasched.flash_decode(q, k, v, cache_seqlens=lens, block_table=bt, return_lse=True)
    out4, lse4 = numasched.flash_decode(q[:, None], k, v, cache_seqlens=lens, block_table=bt, return_lse=True)
    assert torch.equal(out4[:, 0], out3) and torch.equal(lse4[:, 0], lse3)


@gpu
@pytest.mark.parametrize("Sq,H,HK", [(4, 32, 8), (16, 32, 2)])
def test_gpu_multi_autotuned(Sq, H, HK, poisoned, launches):
    B, Dh, L, page = 2, 128, 32768, 16
    lens = torch.tensor([32768, 20000], dtype=torch.int32)
    q, k, v, bt, lens = make_paged(B, Sq, H, HK, Dh, page, L // page, lens, torch.bfloat16, "cuda")
    with options.use(autotune=True, decode_schedule="autotune"):   # the default is the model
        out, lse = numasched.flash_decode(q, k, v, cache_seqlens=lens, block_table=bt, return_lse=True)
    check(out, lse, *reference(q, k, v, lens, bt), torch.bfloat16)


@gpu
@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("Sq", [4, 16])
def test_gpu_multi_cuda_graph_replay(paged, Sq, combine, launches):
    B, H, HK, Dh, L, page = 4, 32, 8, 128, 4096, 16
    lens0 = torch.tensor([4096, 1000, 1, 0], dtype=torch.int32)
    if paged:
        q, k, v, bt, lens = make_paged(B, Sq, H, HK, Dh, page, L // page, lens0, torch.bfloat16, "cuda")
        bt = torch.where(bt < 0, 0, bt)  # replays change lengths: keep every entry valid
    else:
        q, k, v = make_contiguous(B, Sq, H, HK, Dh, L, torch.bfloat16, "cuda")
        bt, lens = None, lens0.cuda()
    plan = numasched.plan_decode(q, k, v, cache_seqlens=lens, block_table=bt)
    plan.run(q, k, v, lens, bt)  # warm-up: compile and autotune
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = plan.run(q, k, v, lens, bt, return_lse=True)
    for step in range(3):
        q.copy_(torch.randn_like(q))
        lens.copy_(torch.tensor([4096 - step, 1000 + step, Sq - 1 + step, step], dtype=torch.int32))
        graph.replay()
        torch.cuda.synchronize()
        check(out, lse, *reference(q, k, v, lens, bt), torch.bfloat16)


@gpu
def test_gpu_multi_torch_compile(fixed_config, launches):
    B, Sq, H, HK, Dh, L = 4, 4, 32, 8, 128, 2048
    q, k, v = make_contiguous(B, Sq, H, HK, Dh, L, torch.bfloat16, "cuda")
    lens = torch.tensor([2048, 1, 0, 999], dtype=torch.int32, device="cuda")

    def f(q, k, v, lens):
        out, lse = numasched.flash_decode(q * 1.0, k, v, cache_seqlens=lens, return_lse=True)
        return out.float() + 1.0, lse

    torch._dynamo.reset()
    out, lse = torch.compile(f, fullgraph=True)(q, k, v, lens)
    check(out - 1.0, lse, *reference(q, k, v, lens), torch.bfloat16)
