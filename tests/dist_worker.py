"""Multi-GPU checks of numasched.distributed, one process per GPU:

    NCCL_NVLS_ENABLE=0 torchrun --nproc-per-node 2 tests/dist_worker.py [--quick]

Each check runs on every rank; references are single-GPU computations on data gathered with
NCCL (float64/float32). Prints PASS/FAIL per check and rank, then "ALL PASSED" on rank 0 when
every check passed everywhere (exit code 0), else "SOME CHECKS FAILED" and exit code 1. The
timeout check runs last: it leaves the context out of step on purpose.

Keeping ranks in step when a check fails on one rank only:
  * inside a check, a wrong result is recorded (``Expect``), not raised, so the failing rank goes
    on making the same NCCL collectives as the others; the check fails at its end;
  * after every check all ranks agree on the outcome over a separate gloo group with a bounded
    wait (``--check-timeout`` + 60 s), so no rank starts the next check's collectives alone; a
    check that broke the context on some rank (timeout) stops the run (later checks are skipped);
  * each check's body runs under a wall-clock limit (``--check-timeout``, default 150 s): past it
    the rank prints the check's name and every thread's stack and exits with code 3 (torchrun
    then stops the others), instead of waiting for NCCL's 300 s watchdog.
"""
import argparse
import contextlib
import datetime
import os
import sys
import time
import traceback

import torch
import torch.distributed as dist

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")          # never NVLink multicast here
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
os.environ.setdefault("NUMASCHED_CHECK_DATA", "0")      # numasched.decode's data checks synchronise

import numasched  # noqa: E402
import numasched.distributed as nd  # noqa: E402
from numasched.distributed._watchdog import Watchdog  # noqa: E402

BF = torch.bfloat16
IMPLS = ("fused", "ce")


class Expect:
    """Soft assertions: a failing rank records the failure and keeps making the same collective
    calls as the others (an ``assert`` between two collectives would leave its peers in the second
    one alone); ``done`` raises at the end of the check."""

    def __init__(self):
        self.failures = []

    def __call__(self, cond, msg) -> bool:
        if not cond:
            self.failures.append(str(msg))
        return bool(cond)

    def call(self, what, fn, *args, **kwargs):
        """fn(...), or None with the exception recorded (e.g. ctx.check raising on one rank)."""
        try:
            return fn(*args, **kwargs)
        except Exception as e:  # noqa: BLE001
            self.failures.append(f"{what}: {type(e).__name__}: {e}")
            return None

    def done(self, msg: str) -> str:
        if self.failures:
            raise AssertionError("; ".join(self.failures[:6]) + (f" (+{len(self.failures) - 6} more)"
                                                                 if len(self.failures) > 6 else ""))
        return msg


def rel(x, ref):
    return float(torch.linalg.vector_norm(x.double() - ref.double()) / torch.linalg.vector_norm(ref.double()))


def _bad_blocks(c, ref, rows):
    """Which rank's row block of an all-gather result is wrong (rel. error per block of ``rows``)."""
    errs = [rel(c[s:s + rows], ref[s:s + rows]) for s in range(0, c.shape[0], rows)]
    return "per source rank: " + ", ".join(f"{e:.1e}" for e in errs)


def gather_rows(t):
    out = torch.empty((dist.get_world_size() * t.shape[0], *t.shape[1:]), dtype=t.dtype, device=t.device)
    dist.all_gather_into_tensor(out, t.contiguous())
    return out


def same_everywhere(t):
    """Bitwise equal on every rank."""
    g = gather_rows(t.reshape(1, -1))
    return all(torch.equal(g[0], g[i]) for i in range(g.shape[0]))


def randn(*shape, dtype=BF, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(*shape, device="cuda", dtype=torch.float32, generator=g).to(dtype)


def capture_on_every_rank(calls, warm: bool = True):
    """``calls()`` once eagerly (headers, buffers) if ``warm``, then captured in a CUDA graph on a
    side stream, every rank in step (barriers before and after)."""
    if warm:
        calls()
    torch.cuda.synchronize()
    dist.barrier()
    graph = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        with torch.cuda.graph(graph, stream=s):
            calls()
    torch.cuda.current_stream().wait_stream(s)
    dist.barrier()
    return graph


# ----------------------------------------------------------------------------------- checks
def check_all_gather_matmul(ctx, quick):
    R, W = ctx.rank, ctx.world
    shapes = [(2048, 4096, 3584), (300, 1000, 200)] + ([] if quick else [(8192, 8192, 14336 // W * 2)])
    msgs, ok = [], Expect()
    for i, (Ml, K, N) in enumerate(shapes):
        a = randn(Ml, K, seed=100 * i + R)
        b = randn(K, N, seed=100 * i + 77)          # same B on every rank
        ref = gather_rows(a).float() @ b.float()
        for impl in IMPLS:
            out = torch.full((W * Ml, N), float("nan"), device="cuda", dtype=BF)
            c = nd.all_gather_matmul(a, b, ctx=ctx, out=out, impl=impl)
            ok(c is out and torch.isfinite(c).all(), f"{impl} {(Ml, K, N)}: unwritten (NaN) output elements")
            e = rel(c, ref)
            ok(e < 1e-2, f"{impl} {(Ml, K, N)}: relative error {e:.2e} ({_bad_blocks(c, ref, Ml)})")
            ok(same_everywhere(c), f"{impl} {(Ml, K, N)}: ranks disagree")
            msgs.append(f"{impl} {Ml}x{K}x{N}: {e:.1e}")
    return ok.done("; ".join(msgs))


def check_matmul_reduce_scatter(ctx, quick):
    R, W = ctx.rank, ctx.world
    shapes = [(4096, 2048, 4096), (300 * W, 1000, 200)] + ([] if quick else [(16384, 14336 // W * 2, 8192)])
    msgs, ok = [], Expect()
    for i, (M, Kl, N) in enumerate(shapes):
        a = randn(M, Kl, seed=200 * i + R)
        b = randn(Kl, N, seed=200 * i + 50 + R)
        part = a.float() @ b.float()
        dist.all_reduce(part)
        Ms = M // W
        ref = part[R * Ms:(R + 1) * Ms]
        for impl in IMPLS:
            out = torch.full((Ms, N), float("nan"), device="cuda", dtype=BF)
            y = nd.matmul_reduce_scatter(a, b, ctx=ctx, out=out, impl=impl)
            ok(y is out and torch.isfinite(y).all(), f"{impl} {(M, Kl, N)}: unwritten (NaN) output elements")
            e = rel(y, ref)
            ok(e < 1e-2, f"{impl} {(M, Kl, N)}: relative error {e:.2e}")
            msgs.append(f"{impl} {M}x{Kl}x{N}: {e:.1e}")
    # the fused tiles as one loop over (tile, K step) with static tickets (options.fused_flat) against
    # ticketed tiles with a K loop each: the same bits, into a contiguous out and a strided one.
    # 9000 x 1100: 4500 rows a rank (a partial row tile), 360 tiles, 2-3 a program
    from numasched import options

    M, Kl, N = 9000, 700, 1100
    a, b = randn(M, Kl, seed=5000 + R), randn(Kl, N, seed=5050 + R)
    part = a.float() @ b.float()
    dist.all_reduce(part)
    Ms = M // W
    ref = part[R * Ms:(R + 1) * Ms]
    got = []
    for flat in (False, True):
        with options.use(fused_flat=flat):
            y = nd.matmul_reduce_scatter(a, b, ctx=ctx, impl="fused")
            wide = torch.full((Ms, N + 8), float("nan"), device="cuda", dtype=BF)
            z = nd.matmul_reduce_scatter(a, b, ctx=ctx, impl="fused", out=wide[:, :N])
            ok(rel(y, ref) < 1e-2 and torch.equal(y, z) and not wide[:, N:].isfinite().any(),
               f"fused_flat={flat} {(M, Kl, N)}: wrong ({rel(y, ref):.1e}, strided out {rel(z, ref):.1e})")
            got.append(y.clone())
    ok(torch.equal(got[0], got[1]), f"{(M, Kl, N)}: fused_flat changes the bits")
    msgs.append(f"{M}x{Kl}x{N} flat/ticketed same bits")
    # the tile pairs on the warp-specialised Gluon kernel (options.fused_ws, RS; Hopper, a slice's
    # rows a multiple of 64, rows of 16 bytes, a contiguous out): B as a weight's w.T and (K, N)
    from numasched.kernels.gemm_ws import HAVE_GLUON

    if W == 2 and HAVE_GLUON and torch.cuda.get_device_capability()[0] == 9:
        # 4544 rows a rank: 36 tile rows, the last one half, 180 tiles a slice (the flat order on
        # 132 SMs); 4032 rows: 224 tiles a slice (pairs add no round: the pair order)
        # K_local 704: A's rows 1408 bytes, a TMA multiple of 16 (at 700 ws_ok refused and the
        # Triton kernel ran: the spy caught it)
        for (M, Kl, N), pairs in (((9088, 704, 1104), False), ((8064, 704, 1600), True)):
            a, w = randn(M, Kl, seed=5100 + R), randn(N, Kl, seed=5150 + R)
            part = a.float() @ w.float().T
            dist.all_reduce(part)
            Ms = M // W
            ref = part[R * Ms:(R + 1) * Ms]
            for b in (w.T, w.T.contiguous()):
                res = {}
                for ws in (False, True):
                    with options.use(fused_ws=ws), _ws_launches() as took:
                        res[ws] = nd.matmul_reduce_scatter(a, b, ctx=ctx, impl="fused").clone()
                    ok(rel(res[ws], ref) < 1e-2, f"fused_ws={ws} {(M, Kl, N)}: wrong ({rel(res[ws], ref):.1e})")
                    ok([t[:3] for t in took] == ([(False, False, True)] if ws else [])
                       and all(pairs in {f[0] for f in t[3]} for t in took),
                       f"fused_ws={ws} {(M, Kl, N)}: WS launches {took} (the reduce-scatter, pairs={pairs}, expected)")
                same = torch.equal(res[True], res[False])
                msgs.append(f"{M}x{Kl}x{N} WS ({'pairs' if pairs else 'flat'}) "
                            f"{'same bits as' if same else 'within 1e-2 of'} the Triton kernel")
                # the flag raised and the peer's partial fetched inside the K loop: the same sums
                # (and a slice's tiles row by row or in groups of tile rows: options.fused_ws_group)
                for early, group in ((False, 0), (True, 0), (True, 8), (False, 8)):
                    with options.use(fused_ws=True, fused_rs_early=early, fused_ws_group=group), \
                            _ws_launches() as took:
                        got = nd.matmul_reduce_scatter(a, b, ctx=ctx, impl="fused").clone()
                    ok(torch.equal(got, res[True]) and [t[:3] for t in took] == [(False, False, True)]
                       and (pairs, early) in took[0][3],
                       f"fused_rs_early={early}, groups of {group} {(M, Kl, N)}: WS launches {took}, "
                       f"{'same bits' if torch.equal(got, res[True]) else 'not the same bits'} as the default")
    return ok.done("; ".join(msgs))


@contextlib.contextmanager
def _ws_launches():
    """The warp-specialised launches (numasched.distributed._ws.launch) made inside the block, as
    (residual, direct, rs, forms) tuples: whether a call took the WS kernel, and the (rs_pairs,
    rs_early) forms its plan holds launchers of."""
    from numasched.distributed import _ws

    seen, launch = [], _ws.launch

    def spy(ctx, plan, **kw):
        out = launch(ctx, plan, **kw)
        forms = {k[4:6] for k in plan.launchers if isinstance(k, tuple) and k[:4] == ("ws", kw["residual"],
                                                                                      kw["direct"], kw["rs"])}
        seen.append((kw["residual"], kw["direct"], kw["rs"], forms, kw.get("block_n", 256)))
        return out

    _ws.launch = spy
    try:
        yield seen
    finally:
        _ws.launch = launch


def _decode_inputs(R, W, B=4, H=32, HK=8, D=128, S=4096, seed=0):
    q = randn(B, H, D, seed=seed + 999)                       # same q everywhere
    k, v = randn(B, S, HK, D, seed=seed + 10 * R), randn(B, S, HK, D, seed=seed + 10 * R + 1)
    g = torch.Generator().manual_seed(seed + R)
    lens = torch.randint(1, S + 1, (B,), generator=g, dtype=torch.int32)
    if R == 0:
        lens[1] = 0            # rank 0 holds nothing of row 1
    lens[B - 1] = 0            # the last row is empty everywhere
    return q, k, v, lens.cuda()


def _decode_reference(q, k, v, lens):
    W = dist.get_world_size()
    ks, vs = gather_rows(k[None]), gather_rows(v[None])
    ls = gather_rows(lens[None])
    outs, lses = [], []
    for b in range(q.shape[0]):
        kk = torch.cat([ks[r, b, :int(ls[r, b])] for r in range(W)]).double()
        vv = torch.cat([vs[r, b, :int(ls[r, b])] for r in range(W)]).double()
        o, l = nd.torch_local_decode(q[b:b + 1].double(), kk[None], vv[None],
                                     torch.tensor([kk.shape[0]], device="cuda"))
        outs.append(o[0])
        lses.append(l[0])
    return torch.stack(outs), torch.stack(lses)


def check_fused_pointer_path(ctx, quick):
    """The fused kernels without TMA descriptors (the default on Hopper is TMA): same checks."""
    R, W = ctx.rank, ctx.world
    with numasched.options.use(dist_tma=False):   # part of the call key: plans of their own
        a, b = randn(700, 1000, seed=41 + R), randn(1000, 600, seed=42)
        c = nd.all_gather_matmul(a, b, ctx=ctx)
        e1 = rel(c, gather_rows(a).float() @ b.float())
        ar, br = randn(300 * W, 1000, seed=43 + R), randn(1000, 600, seed=44 + R)
        part = ar.float() @ br.float()
        dist.all_reduce(part)
        e2 = rel(nd.matmul_reduce_scatter(ar, br, ctx=ctx), part[R * 300:(R + 1) * 300])
        # GEMM + all-reduce with several tiles per program (two ranks: PAIRS), K not a multiple of 64
        am, bm = randn(4608, 1000, seed=45 + R), randn(1000, 1100, seed=46 + R)
        part = am.float() @ bm.float()
        dist.all_reduce(part)
        y = nd.matmul_all_reduce(am, bm, ctx=ctx, impl="fused")
        e3 = rel(y, part)
        same = same_everywhere(y)
    assert e1 < 1e-2 and e2 < 1e-2 and e3 < 1e-2 and same, (e1, e2, e3, same)
    return f"all_gather_matmul {e1:.1e}, matmul_reduce_scatter {e2:.1e}, matmul_all_reduce {e3:.1e}"


def check_flash_decode_distributed(ctx, quick):
    R, W = ctx.rank, ctx.world
    q, k, v, lens = _decode_inputs(R, W)
    ref_o, ref_l = _decode_reference(q, k, v, lens)
    msgs, ok = [], Expect()
    for name, fn in (("numasched.decode", None), ("torch", nd.torch_local_decode)):
        if name == "numasched.decode":
            try:
                from numasched.decode import flash_decode  # noqa: F401
            except ImportError:
                continue
        out = torch.full_like(q, float("nan"))
        o, l = nd.flash_decode_distributed(q, k, v, lens, ctx=ctx, out=out, return_lse=True, local_decode=fn)
        B = q.shape[0]
        ok(o is out and torch.isfinite(o).all(), f"{name}: unwritten (NaN) output elements")
        e = rel(o[:B - 1], ref_o[:B - 1])
        ok(e < 1e-2, f"{name}: relative error {e:.2e}")
        ok((o[B - 1] == 0).all() and torch.isneginf(l[B - 1]).all(), f"{name}: empty row must give 0 / -inf")
        ok(torch.allclose(l[:B - 1].double(), ref_l[:B - 1].double(), atol=1e-2), f"{name}: lse differs")
        ok(same_everywhere(o), f"{name}: ranks disagree")
        msgs.append(f"{name}: {e:.1e}")
    return ok.done("; ".join(msgs))


def check_back_to_back(ctx, quick):
    """Many calls of all three ops interleaved, no host sync in between (epochs, double buffers)."""
    R, W = ctx.rank, ctx.world
    n = 10 if quick else 40
    Ml, K, N = 1024, 2048, 1536
    b = randn(K, N, seed=5)
    a_list = [randn(Ml, K, seed=1000 + 10 * i + R) for i in range(n)]
    ar = [randn(512 * W, 1024, seed=3000 + 10 * i + R) for i in range(n)]
    br = randn(1024, 768, seed=4000 + R)
    q, k, v, lens = _decode_inputs(R, W, B=2, S=2048, seed=7)
    outs, rs_outs, dec = [], [], []
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for i in range(n):
        impl = IMPLS[i % 2]
        outs.append(nd.all_gather_matmul(a_list[i], b, ctx=ctx, check=False, impl=impl))
        rs_outs.append(nd.matmul_reduce_scatter(ar[i], br, ctx=ctx, check=False, impl=IMPLS[(i // 2) % 2]))
        dec.append(nd.flash_decode_distributed(q * (1 + i / n), k, v, lens, ctx=ctx, check=False))
    torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    ok = Expect()
    ok.call("ctx.check", ctx.check, "back to back")
    for i in range(n):
        ref = gather_rows(a_list[i]).float() @ b.float()
        e = rel(outs[i], ref)
        ok(e < 1e-2, f"all_gather_matmul call {i} (impl {IMPLS[i % 2]}): {e:.1e} ({_bad_blocks(outs[i], ref, Ml)})")
        part = ar[i].float() @ br.float()
        dist.all_reduce(part)
        e = rel(rs_outs[i], part[R * 512:(R + 1) * 512])
        ok(e < 1e-2, f"matmul_reduce_scatter call {i} (impl {IMPLS[(i // 2) % 2]}): {e:.1e}")
        ok(same_everywhere(dec[i]), f"decode call {i} differs across ranks")
    return ok.done(f"{n} x 3 calls in {dt * 1e3:.1f} ms")


def check_cuda_graph(ctx, quick):
    R, W = ctx.rank, ctx.world
    Ml, K, N = 1024, 2048, 1536
    a, b = randn(Ml, K, seed=11 + R), randn(K, N, seed=12)
    out = torch.empty((W * Ml, N), device="cuda", dtype=BF)
    out_ce = torch.empty((W * Ml, N), device="cuda", dtype=BF)
    ar, br = randn(512 * W, 1024, seed=13 + R), randn(1024, 768, seed=14 + R)
    rs_out = torch.empty((512, 768), device="cuda", dtype=BF)
    q, k, v, lens = _decode_inputs(R, W, B=2, S=2048, seed=9)
    dout = torch.empty_like(q)

    def calls():
        nd.all_gather_matmul(a, b, ctx=ctx, out=out)
        nd.all_gather_matmul(a, b, ctx=ctx, out=out_ce, impl="ce")    # side stream inside the graph
        nd.matmul_reduce_scatter(ar, br, ctx=ctx, out=rs_out, impl="ce")
        nd.flash_decode_distributed(q, k, v, lens, ctx=ctx, out=dout, local_decode=nd.torch_local_decode)

    graph = capture_on_every_rank(calls)                             # first calls: headers + buffers
    ok = Expect()
    for i in range(5):
        a.copy_(randn(Ml, K, seed=500 + 10 * i + R))
        q.copy_(q * 1.01)
        graph.replay()
        torch.cuda.synchronize()
        ok.call(f"replay {i}: ctx.check", ctx.check, "graph replay")
        ref = gather_rows(a).float() @ b.float()
        ok(rel(out, ref) < 1e-2, f"replay {i}: all_gather_matmul wrong ({_bad_blocks(out, ref, Ml)})")
        ok(rel(out_ce, ref) < 1e-2, f"replay {i}: all_gather_matmul impl='ce' wrong ({_bad_blocks(out_ce, ref, Ml)})")
        part = ar.float() @ br.float()
        dist.all_reduce(part)
        ok(rel(rs_out, part[R * 512:(R + 1) * 512]) < 1e-2, f"replay {i}: matmul_reduce_scatter impl='ce' wrong")
        ok(same_everywhere(dout), f"replay {i}: decode differs across ranks")
        ar.copy_(randn(512 * W, 1024, seed=600 + 10 * i + R))
    return ok.done("5 replays")


def check_comm_off(ctx, quick):
    R = ctx.rank
    Ml, K, N = 1024, 2048, 1536
    a, b = randn(Ml, K, seed=21 + R), randn(K, N, seed=22)
    W, ok = ctx.world, Expect()
    for impl in IMPLS:
        c = nd.all_gather_matmul(a, b, ctx=ctx, communicate=False, impl=impl)
        ok(c.shape[0] == W * Ml and rel(c[R * Ml:(R + 1) * Ml], a.float() @ b.float()) < 1e-2,
           f"{impl}: local rows wrong with comm off")
        # the real call right after still works (comm-off calls leave the epochs alone)
        c = nd.all_gather_matmul(a, b, ctx=ctx, impl=impl)
        ref = gather_rows(a).float() @ b.float()
        ok(rel(c, ref) < 1e-2, f"{impl}: the call after a comm-off call is wrong ({_bad_blocks(c, ref, Ml)})")
    return ok.done("ok")


def check_first_calls(ctx, quick):
    """The first call of a new signature on fresh buffers, many times, both impls: each new plan's
    buffers are zero-filled on each rank's stream, and a peer's pushes must not land before that
    fill ran (the impl="ce" race seen on H200: rank 1 read zeros for rank 0's rows)."""
    R, W = ctx.rank, ctx.world
    n = 6 if quick else 16
    ok, worst = Expect(), 0.0
    for i in range(n):
        Ml, K, N = 96 + 8 * i, 512 + 64 * (i % 3), 136 + 8 * i   # a new signature every time
        a, b = randn(Ml, K, seed=7000 + 10 * i + R), randn(K, N, seed=7001 + 10 * i)
        ar, br = randn(Ml * W, K, seed=7002 + 10 * i + R), randn(K, N, seed=7003 + 10 * i + R)
        ref = gather_rows(a).float() @ b.float()
        part = ar.float() @ br.float()
        dist.all_reduce(part)
        for impl in IMPLS:
            c = nd.all_gather_matmul(a, b, ctx=ctx, impl=impl)
            e = rel(c, ref)
            ok(e < 1e-2, f"all_gather_matmul {impl} {(Ml, K, N)} first call: {e:.2e} ({_bad_blocks(c, ref, Ml)})")
            y = nd.matmul_reduce_scatter(ar, br, ctx=ctx, impl=impl)
            e2 = rel(y, part[R * Ml:(R + 1) * Ml])
            ok(e2 < 1e-2, f"matmul_reduce_scatter {impl} {(Ml * W, K, N)} first call: {e2:.2e}")
            worst = max(worst, e, e2)
    return ok.done(f"{n} new signatures x 2 ops x 2 impls, worst {worst:.1e}")


def check_header_mismatch(ctx, quick):
    R = ctx.rank
    a, b = randn(64 * (R + 1), 256, seed=1), randn(256, 128, seed=2)
    try:
        nd.all_gather_matmul(a, b, ctx=ctx)
    except ValueError as e:
        assert "rank 0" in str(e) and "a_local_shape" in str(e), str(e)
        return str(e)[:120]
    raise AssertionError("no error for shapes that differ between ranks")


def check_heap_too_small(ctx, quick):
    saved = ctx.heap_bytes
    ctx.heap_bytes = ctx.used_bytes + (1 << 20)
    try:
        nd.all_gather_matmul(randn(4096, 4096, seed=3), randn(4096, 512, seed=4), ctx=ctx, impl="fused")
    except ValueError as e:
        assert "heap too small" in str(e)
        return str(e)[:120]
    finally:
        ctx.heap_bytes = saved
    raise AssertionError("no error for a heap that is too small")


def check_timeout(ctx, quick):
    """Ranks != 0 skip one call: rank 0 must raise TimeoutError naming them, not hang."""
    R, W = ctx.rank, ctx.world
    a, b = randn(1024, 2048, seed=31 + R), randn(2048, 1536, seed=32)
    # numasched's own kernel (auto may route this size to torch's symm_mem, which waits its own way)
    nd.all_gather_matmul(a, b, ctx=ctx, impl="fused")   # known signature: no header exchange below
    torch.cuda.synchronize()
    dist.barrier()
    if R != 0:
        return "skipped the call on purpose"
    t0 = time.perf_counter()
    try:
        nd.all_gather_matmul(a, b, ctx=ctx, impl="fused")
    except TimeoutError as e:
        dt = time.perf_counter() - t0
        for r in range(1, W):
            assert str(r) in str(e)
        # bounded in time, not just eventually: every waiting program of the grid polls at once
        assert dt < 2 * ctx.timeout_s + 10, f"the TimeoutError took {dt:.0f} s (timeout_s={ctx.timeout_s})"
        return f"after {dt:.1f} s (timeout_s={ctx.timeout_s}, {ctx.spin_ns:.0f} ns/poll): {str(e)[:100]}"
    raise AssertionError("no TimeoutError")


def check_timeout_ws(ctx, quick):
    """The warp-specialised fused GEMM + all-reduce and GEMM + reduce-scatter (the defaults at
    prefill sizes on two Hopper ranks) with a peer that never comes, inside CUDA graphs: both
    ranks capture one graph of each op; rank 0 replays the all-reduce's and rank 1 the
    reduce-scatter's, so each waits for flags the other never raises. Each must finish its replay
    within 2 x timeout_s and raise TimeoutError naming the other at ctx.check(), not hang. Breaks
    the context: run it alone (--only timeout_ws) or last."""
    from numasched.distributed import _ws

    R, W = ctx.rank, ctx.world
    if W != 2 or not _ws.ws_wanted(ctx):
        return "skipped: the WS kernels run on two Hopper ranks"
    if ctx.broken:
        return "skipped: the context is already out of step (run it alone: --only timeout_ws)"
    # 256 tiles of 128 x 256 (tile pairs on 132 SMs); 4096 rows a slice (a multiple of 64)
    a, b = randn(8192, 704, seed=61 + R), randn(1000, 704, seed=62).T
    ops = ("matmul_all_reduce", "matmul_reduce_scatter")
    graphs = {}
    for op in ops:   # plans, compiles and the WS kernel taken eagerly on both ranks, then captured
        with _ws_launches() as took:
            graphs[op] = capture_on_every_rank(lambda op=op: getattr(nd, op)(a, b, ctx=ctx, impl="fused",
                                                                             check=False))
        assert len(took) == 2, f"{op}: the WS kernel did not run (eager, then captured): {took}"
    op, peer = ops[R], 1 - R
    t0 = time.perf_counter()
    graphs[op].replay()
    torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    assert dt < 2 * ctx.timeout_s + 10, f"{op}: the replay took {dt:.0f} s (timeout_s={ctx.timeout_s})"
    try:
        ctx.check("graph replay")
    except TimeoutError as e:
        assert str(peer) in str(e), f"{op}: the TimeoutError does not name rank {peer}: {e}"
        return f"{op} (WS, graph replay) gave up after {dt:.1f} s: {str(e)[:100]}"
    raise AssertionError(f"no TimeoutError after replaying the WS {op} alone")


def check_all_reduce(ctx, quick):
    """Every impl and size against a float64 sum of every rank's data; identical on every rank;
    in place; repeated calls."""
    R, W = ctx.rank, ctx.world
    # 384 KB + 10 bytes and 768 KB of bf16: the two-rank mid sizes' 4 KB (last chunk partial) and
    # 8 KB chunks, one per program (all_reduce._cfg)
    sizes = [1, 4097, 65536 + 3, 196608 + 5, 393216, 1 << 20] + ([] if quick else [8 << 20])
    msgs, ok = [], Expect()
    for i, n in enumerate(sizes):
        for dt in ((BF, torch.float32) if n == 4097 else (BF,)):
            for impl in ("oneshot", "twoshot", "nccl", "ce", "auto"):
                for rep in range(2):
                    x = randn(n, dtype=dt, seed=1000 * i + 10 * rep + R)
                    ref = gather_rows(x.double().reshape(1, -1)).sum(0)
                    out = torch.full_like(x, float("nan"))
                    y = nd.all_reduce(x, ctx=ctx, impl=impl, out=out)
                    e = rel(y, ref)
                    ok(y is out and torch.isfinite(y).all(), f"{impl} n={n} {dt}: unwritten (NaN) elements")
                    ok(e < (1e-2 if dt == BF else 1e-5), f"{impl} n={n} {dt}: relative error {e:.2e}")
                    ok(same_everywhere(y), f"{impl} n={n} {dt}: ranks disagree")
            msgs.append(f"n={n}: {e:.1e}")
    x = randn(3, 1000, seed=5 + R)
    ref = gather_rows(x.double().reshape(1, -1)).sum(0).reshape(3, 1000)
    y = nd.all_reduce(x, ctx=ctx, out=x)
    ok(y is x and rel(x, ref) < 1e-2, "in place (out=x) wrong")
    x = randn(3, 1000, seed=7 + R)
    ref = gather_rows(x.double().reshape(1, -1)).sum(0).reshape(3, 1000)
    y = nd.all_reduce(x, ctx=ctx, out=x, impl="ce")
    same = same_everywhere(x)   # a collective: every rank calls it, whatever its own result
    ok(y is x and rel(x, ref) < 1e-2 and same, "impl='ce' in place (out=x) wrong")
    return ok.done("; ".join(msgs))


def check_matmul_all_reduce(ctx, quick):
    R, W = ctx.rank, ctx.world
    # 4480 x 1100: 175 tiles of 128 x 256, an odd count of more than one per program (PAIRS)
    shapes = [(1, 14336 // W, 4096), (16, 4096 // W, 4096), (256, 14336 // W, 4096), (37, 999, 515),
              (2050, 4096 // W, 4096), (4480, 1400 // W, 1100)]
    msgs, ok = [], Expect()
    for i, (M, Kl, N) in enumerate(shapes):
        a = randn(M, Kl, seed=300 * i + R)
        w = randn(N, Kl, seed=300 * i + 50 + R)        # an F.linear weight: b_local = w.T
        ref = a.double() @ w.double().T
        dist.all_reduce(ref)
        for impl in ("auto", "oneshot", "twoshot", "bulk", "overlap", "fused"):
            out = torch.full((M, N), float("nan"), device="cuda", dtype=BF)
            y = nd.matmul_all_reduce(a, w.T, ctx=ctx, out=out, impl=impl)
            e = rel(y, ref)
            ok(y is out and e < 1e-2, f"{impl} {(M, Kl, N)}: relative error {e:.2e}")
            ok(same_everywhere(y), f"{impl} {(M, Kl, N)}: ranks disagree")
        plan = nd.plan_matmul_all_reduce(a, w.T, world=W)
        msgs.append(f"{M}x{Kl}x{N}: {plan.impl} {plan.gemm}+{plan.all_reduce} {e:.1e}")
        if M <= 256:   # the layer epilogue fused into the all-reduce: residual add + RMSNorm
            h = randn(M, N, seed=300 * i + 99)           # the same residual stream on every rank
            ln = randn(N, seed=300 * i + 98)
            r_ref = (h.double() + ref.to(BF).double()).to(BF).double()
            y_ref = ln.double() * (r_ref * torch.rsqrt(r_ref.pow(2).mean(-1, keepdim=True) + 1e-5)).to(BF).double()
            r, y = nd.matmul_all_reduce(a, w.T, ctx=ctx, residual=h, norm_weight=ln, eps=1e-5)
            same = same_everywhere(y)   # a collective: every rank calls it, whatever its own result
            ok(r is h and rel(r, r_ref) < 1e-2 and rel(y, y_ref) < 2e-2 and same,
               f"{(M, Kl, N)}: fused residual + RMSNorm wrong ({rel(r, r_ref):.1e}, {rel(y, y_ref):.1e})")
        # the residual alone (a prefill's add in the epilogue where the plan is fused): the bits of
        # the plain call's sum added to it, in place, the same on every rank
        for impl in ("auto", "fused"):
            h0 = randn(M, N, seed=300 * i + 97)          # the same residual stream on every rank
            h = h0.clone()
            plain = nd.matmul_all_reduce(a, w.T, ctx=ctx, impl=impl)
            want = h + plain
            r = nd.matmul_all_reduce(a, w.T, ctx=ctx, impl=impl, residual=h)
            same = same_everywhere(r)
            ok(r is h and torch.equal(r, want) and same,
               f"{impl} {(M, Kl, N)}: residual add wrong ({rel(r, want):.1e}, same on every rank: {same})")
            if impl == "fused" and M > 256:   # in the symmetric heap: the peer stores its sums into it
                hh = ctx.alloc((M, N), BF, what="a residual")   # the same offset on every rank
                hh.copy_(h0)
                r = nd.matmul_all_reduce(a, w.T, ctx=ctx, impl=impl, residual=hh)
                same = same_everywhere(r)
                ok(r is hh and torch.equal(r, want) and same,
                   f"{impl} {(M, Kl, N)}: residual in the heap wrong ({rel(r, want):.1e}, same everywhere: {same})")
    # the tile pairs as one loop over (tile, K step) (options.fused_flat, two ranks) against a K
    # loop per tile: the same bits, plain and with the residual in the heap (the peer's sums
    # stored into it). 9088 x 1100: 355 tiles, 178 pairs: some programs two, one an odd last pair
    from numasched import options

    M, Kl, N = 9088, 1400 // W, 1100
    a, w = randn(M, Kl, seed=4000 + R), randn(N, Kl, seed=4050 + R)
    h0 = randn(M, N, seed=4099)
    ref = a.double() @ w.double().T
    dist.all_reduce(ref)
    got = []
    # (FLAT, TMA_PUSH): the per-tile loop, FLAT, FLAT with the pushes as TMA stores
    for flat, push in ((False, False), (True, False), (True, True)):
        with options.use(fused_flat=flat, fused_tma_push=push):
            y = nd.matmul_all_reduce(a, w.T, ctx=ctx, impl="fused")
            hh = ctx.alloc((M, N), BF, what="a residual")
            hh.copy_(h0)
            r = nd.matmul_all_reduce(a, w.T, ctx=ctx, impl="fused", residual=hh)
            got.append((y.clone(), r.clone(), same_everywhere(y) and same_everywhere(r)))
            ok(rel(y, ref) < 1e-2 and torch.equal(r, h0 + y),
               f"fused_flat={flat} fused_tma_push={push} {(M, Kl, N)}: wrong ({rel(y, ref):.1e}, "
               f"residual {rel(r, h0 + y):.1e})")
    ok(all(g[2] for g in got) and all(torch.equal(got[0][0], g[0]) and torch.equal(got[0][1], g[1]) for g in got),
       f"{(M, Kl, N)}: fused_flat / fused_tma_push change the bits or ranks disagree")
    msgs.append(f"{M}x{Kl}x{N} per-tile/flat/TMA-push same bits")
    # the tile pairs on the warp-specialised Gluon kernel (options.fused_ws; Hopper, M a multiple
    # of 64, rows of 16 bytes): through the receive slots (plain out) and DIRECT (the residual in
    # the heap); against the Triton FLAT kernel's result
    from numasched.kernels.gemm_ws import HAVE_GLUON

    def ws_against_triton(M, Kl, N, seed, width):
        """fused_ws off and on at (M, Kl, N): plain (through the receive slots), the residual in
        the heap (DIRECT), B as (K, N); right against the float64 reference, the WS launches of
        ``width``-wide tiles where it is on (two ranks), ranks agreeing; whether the bits are
        the Triton kernel's."""
        a, w = randn(M, Kl, seed=seed + R), randn(N, Kl, seed=seed + 50 + R)
        ref = a.double() @ w.double().T
        dist.all_reduce(ref)
        h0 = randn(M, N, seed=seed + 99)
        res = {}
        for ws in (False, True):
            with options.use(fused_ws=ws), _ws_launches() as took:
                y = nd.matmul_all_reduce(a, w.T, ctx=ctx, impl="fused")
                hh = ctx.alloc((M, N), BF, what="a residual")
                hh.copy_(h0)
                r = nd.matmul_all_reduce(a, w.T, ctx=ctx, impl="fused", residual=hh)
                y2 = nd.matmul_all_reduce(a, w.T.contiguous(), ctx=ctx, impl="fused")   # B as (K, N)
                res[ws] = (y.clone(), r.clone(), same_everywhere(y) and same_everywhere(r))
                ok(rel(y, ref) < 1e-2 and torch.equal(r, h0 + y) and torch.equal(y2, y),
                   f"fused_ws={ws} {(M, Kl, N)}: wrong ({rel(y, ref):.1e}, residual {rel(r, h0 + y):.1e}, "
                   f"B as (K, N) {rel(y2, ref):.1e})")
            # (residual, direct, rs, width) of each WS launch: plain, DIRECT, B as (K, N)
            want = [(False, False, False, width), (True, True, False, width), (False, False, False, width)]
            ok([(t[0], t[1], t[2], t[4]) for t in took] == (want if ws and W == 2 else []),
               f"fused_ws={ws} {(M, Kl, N)}: WS launches {took}")
        ok(res[True][2], f"fused_ws {(M, Kl, N)}: ranks disagree")
        return torch.equal(res[True][0], res[False][0]) and torch.equal(res[True][1], res[False][1])

    if HAVE_GLUON and torch.cuda.get_device_capability()[0] == 9:
        # 256 tiles of 128 x 256 (the last tile row half, the last column partial): tile pairs
        # on 132 SMs, so the WS kernel runs (it takes pairs only); A's rows of 16-byte multiples
        # (TMA; 700 ran Triton)
        M, Kl, N = 8128, 1408 // W, 1000
        same = ws_against_triton(M, Kl, N, 4100, 256)
        msgs.append(f"{M}x{Kl}x{N} WS {'same bits as' if same else 'within 1e-2 of'} FLAT")
        # 128-wide tile pairs (cost.fused_ar_ws_width): 10 tile rows x 67 columns of 128 (the
        # last partial), 670 tiles, where 340 tiles of 256 columns take three rounds one at a time
        # and four in pairs
        M, Kl, N = 1216, 1408 // W, 8456
        same = ws_against_triton(M, Kl, N, 4200, 128)
        msgs.append(f"{M}x{Kl}x{N} WS 128-wide {'same bits as' if same else 'within 1e-2 of'} Triton")
    return ok.done("; ".join(msgs))


def _arn_reference(xs, h, w, eps):
    """all_reduce_add_rmsnorm's (r, y) from every rank's x (a list in rank order): the sum in fp32 in
    rank order, rounded; r = h + s rounded (no reduction order: the kernel's r must match bit for
    bit); y in float64 from r (the kernel's norm sum runs in fp32: y may differ by a rounding)."""
    s = torch.zeros_like(xs[0], dtype=torch.float32)
    for x in xs:
        s += x.float()
    r = (h.float() + s.to(h.dtype).float()).to(h.dtype)
    rf = r.double()
    inv = 1.0 / torch.sqrt((rf * rf).mean(-1, keepdim=True) + eps)
    return r, (w.double() * (rf * inv).to(h.dtype).double()).to(h.dtype)


def _arn_compare(allx, outs, h, w, eps):
    """(elements where the flag and LL outputs differ beyond a rounding, rows whose y differ at
    all, notes naming the calls and rows that are wrong) for every call's outputs ``outs``
    ({"flag": [(r, y)], "ll": [(r, y)]}) from ``allx`` (ranks x calls x M x N, every rank's x).
    r must be bit-identical between the forms and to the reference (anything else is wrong data);
    y within one rounding of the other form's (the normalised value one bf16 step apart, 2^-7
    relative, then the weight's product rounded once more) and near the float64 reference."""
    differ, y_rows, notes = 0, 0, []
    for i in range(allx.shape[1]):
        r_ref, y_ref = _arn_reference([allx[src, i] for src in range(allx.shape[0])], h, w, eps)
        (r_f, y_f), (r_l, y_l) = outs["flag"][i], outs["ll"][i]
        far = (y_f.float() - y_l.float()).abs() > 2.0 ** -6 * torch.maximum(y_f.float().abs(), y_l.float().abs())
        d = int((r_f != r_l).sum()) + int(far.sum())
        differ += d
        y_rows += int((y_f != y_l).any(dim=-1).sum())
        for ex in outs:
            r, y = outs[ex][i]
            off = (y.float() - y_ref.float()).abs() > 0.02 * y_ref.float().abs() + 1e-2
            if int((r != r_ref).sum()) or int(off.sum()):
                rows = sorted(set((r != r_ref).nonzero()[:, 0].tolist()) | set(off.nonzero()[:, 0].tolist()))
                notes.append(f"call {i} {ex}: r wrong in {int((r != r_ref).sum())}, y off in {int(off.sum())} "
                             f"elements (rows {rows})")
        if d and len(notes) < 8:
            rows = sorted(set((r_f != r_l).nonzero()[:, 0].tolist()) | set(far.nonzero()[:, 0].tolist()))
            notes.append(f"call {i}: flag and LL differ beyond a rounding in {d} elements (rows {rows})")
    return differ, y_rows, notes


def check_arn_exchanges_agree(ctx, quick):
    """The decode-size all-reduce + add + RMSNorm by flag and by LL words (options.arn_exchange, in
    the plan's key), over many calls without a host sync and with one rank made late now and then
    (torch.cuda._sleep), at 1, 4 and 16 rows: the same residual bits, which must be h + sum(x) bit
    for bit (anything else is wrong data, a race), and a y within one rounding of the other
    exchange's (the norm's sum runs in each form's register layout: two H200s gave 23 elements of
    one row in 3200 a bf16 step apart) and of a float64 reference. Every call's outputs are kept
    and checked afterwards against the gathered inputs."""
    R, W = ctx.rank, ctx.world
    ok, msgs = Expect(), []
    eps = 1e-5
    for M in (1, 4, 16):
        h, ln = randn(M, 4096, seed=61), randn(4096, seed=62)
        g = torch.Generator(device="cuda").manual_seed(63 + R)
        calls = 24 if quick else 200
        xs, outs = [], {"flag": [], "ll": []}
        for i in range(calls):
            x = torch.randn(M, 4096, device="cuda", generator=g).to(BF)
            xs.append(x)
            for exchange in ("flag", "ll"):
                if R == W - 1 and i % 5 == (0 if exchange == "flag" else 2):
                    torch.cuda._sleep(20000 * (1 + i % 3))   # a late rank: the others wait for its part
                # LL needs the row-per-program path
                with numasched.options.use(arn_exchange=exchange, arn_one_row=True):
                    outs[exchange].append(nd.all_reduce_add_rmsnorm(x, h, ln, eps, ctx=ctx,
                                                                   residual_out=torch.empty_like(h), check=False))
        torch.cuda.synchronize()
        ok.call(f"M={M}: ctx.check", ctx.check, "all_reduce_add_rmsnorm")
        ok(any(k[0] == "all_reduce_add_rmsnorm" and k[1] == M and k[-1] is True for k in ctx.plans
               if isinstance(k, tuple)), f"M={M}: no LL plan was made (the comparison would be vacuous)")
        allx = gather_rows(torch.stack(xs).reshape(calls, -1)).reshape(W, calls, M, 4096)
        differ, y_rows, notes = _arn_compare(allx, outs, h, ln, eps)
        ok(not notes, f"M={M}: " + "; ".join(notes[:8]))
        ok(differ == 0, f"M={M}: flag and LL exchanges differ beyond a rounding in {differ} elements over {calls} calls")
        for ex in outs:
            ok(same_everywhere(outs[ex][-1][1]), f"M={M}: ranks disagree ({ex})")
        msgs.append(f"M={M}: {calls} calls, r identical, y a rounding apart in {y_rows} of {calls * M} rows")
    return ok.done("; ".join(msgs))


def check_bulk_and_auto(ctx, quick):
    """impl='bulk' and 'auto' of the two GEMM collectives, at a small and a large M."""
    R, W = ctx.rank, ctx.world
    msgs, ok = [], Expect()
    for Ml in (8, 1024):
        a, b = randn(Ml, 1024, seed=41 + R), randn(1024, 768, seed=42)
        ref = gather_rows(a).float() @ b.float()
        ar, br = randn(Ml * W, 512, seed=43 + R), randn(512, 640, seed=44 + R)
        part = ar.float() @ br.float()
        dist.all_reduce(part)
        for impl in ("bulk", "auto", "symm_mem"):
            c = nd.all_gather_matmul(a, b, ctx=ctx, impl=impl)
            ok(rel(c, ref) < 1e-2, f"all_gather_matmul {impl} M_local={Ml}: wrong")
            y = nd.matmul_reduce_scatter(ar, br, ctx=ctx, impl=impl)
            ok(rel(y, part[R * Ml:(R + 1) * Ml]) < 1e-2, f"matmul_reduce_scatter {impl} M={Ml * W}: wrong")
        from numasched.distributed import cost
        from numasched.distributed.all_gather_matmul import AllGatherMatmul
        from numasched.distributed.matmul_reduce_scatter import MatmulReduceScatter

        # where "auto" takes the bulk path, its GEMM is the engine rule's (numasched's at decode rows)
        ag = AllGatherMatmul.describe(a, b, world=W, impl="auto").cfg
        rs = MatmulReduceScatter.describe(ar, br, world=W, impl="auto").cfg
        for name, c, m in (("all_gather_matmul", ag, Ml * W), ("matmul_reduce_scatter", rs, Ml * W)):
            want = cost.gemm_engine(m, a.device) if c["impl"] == "bulk" else "torch"
            ok(c["bulk_gemm"] == want, f"{name} auto M={m}: bulk GEMM {c['bulk_gemm']}, the rule says {want}")
        msgs.append(f"M_local={Ml}: auto picks ag "
                    f"{cost.choose_gemm_collective('all_gather_matmul', Ml * W, 768, 1024, BF, W, symm_mem_ok=True)} "
                    f"({ag['impl']}, GEMM {ag['bulk_gemm']}), rs "
                    f"{cost.choose_gemm_collective('matmul_reduce_scatter', Ml * W, 640, 512, BF, W, symm_mem_ok=True)} "
                    f"({rs['impl']}, GEMM {rs['bulk_gemm']})")
    return ok.done("; ".join(msgs))


def check_all_reduce_graph(ctx, quick):
    """all_reduce and matmul_all_reduce captured in one CUDA graph, replayed on fresh data."""
    R, W = ctx.rank, ctx.world
    x = randn(4096, seed=51 + R)
    y = torch.empty_like(x)
    a, w = randn(16, 2048, seed=52 + R), randn(4096, 2048, seed=53 + R)
    z = torch.empty((16, 4096), device="cuda", dtype=BF)
    a2 = randn(1024, 2048, seed=54 + R)
    z2 = torch.empty((1024, 4096), device="cuda", dtype=BF)
    z3 = torch.empty((16, 4096), device="cuda", dtype=BF)
    z4 = torch.empty((1024, 4096), device="cuda", dtype=BF)   # fused from 256 rows: communication programs
    y2 = torch.empty_like(x)
    # the decoder's all-reduce + residual add + RMSNorm at decode size, a row per program: 4 rows by
    # the LL exchange, 16 by the flag (options.arn_exchange="auto")
    xn, hn, ln = randn(4, 4096, seed=55 + R), randn(4, 4096, seed=56), randn(4096, seed=57)
    rn, yn = torch.empty_like(xn), torch.empty_like(xn)
    xm, hm = randn(16, 4096, seed=58 + R), randn(16, 4096, seed=59)
    rm, ym = torch.empty_like(xm), torch.empty_like(xm)

    def calls():
        nd.all_reduce_add_rmsnorm(xn, hn, ln, 1e-5, ctx=ctx, residual_out=rn, out=yn, check=False)
        nd.all_reduce_add_rmsnorm(xm, hm, ln, 1e-5, ctx=ctx, residual_out=rm, out=ym, check=False)
        nd.all_reduce(x, ctx=ctx, out=y, check=False)
        nd.all_reduce(x, ctx=ctx, out=y2, check=False, impl="ce")   # copy-engine copies in the graph
        nd.matmul_all_reduce(a, w.T, ctx=ctx, out=z, check=False)
        nd.matmul_all_reduce(a2, w.T, ctx=ctx, out=z2, check=False, impl="overlap")   # side stream in the graph
        nd.matmul_all_reduce(a, w.T, ctx=ctx, out=z3, check=False, impl="fused")
        nd.matmul_all_reduce(a2, w.T, ctx=ctx, out=z4, check=False, impl="fused")

    graph = capture_on_every_rank(calls)
    ok = Expect()
    # the plans the graph's two calls took (earlier checks made plans of the same shapes with the
    # exchange forced, so the plan table alone does not say which one ran): LL at 4 rows, the flag
    # at 16 (options.arn_exchange="auto"), and those plans made
    from numasched.distributed._common import OPS
    took = {}
    for xx, hh in ((xn, hn), (xm, hm)):
        call = OPS["all_reduce_add_rmsnorm"].prepare(ctx, xx, hh, ln, 1e-5)
        took[xx.shape[0]] = (call.key in ctx.plans, call.cfg["ll"])
    ok(took == {4: (True, True), 16: (True, False)}, f"the graph's all_reduce_add_rmsnorm plans (made, LL): {took} "
       "(want LL at 4 x 4096, the flag at 16 x 4096: options.arn_exchange='auto')")
    for i in range(5):
        x.copy_(randn(4096, seed=700 + 10 * i + R))
        a.copy_(randn(16, 2048, seed=800 + 10 * i + R))
        xn.copy_(randn(4, 4096, seed=600 + 10 * i + R))
        xm.copy_(randn(16, 4096, seed=650 + 10 * i + R))
        for t in (rn, yn, rm, ym):
            t.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        ok.call(f"replay {i}: ctx.check", ctx.check, "graph replay")
        sn = gather_rows(xn.double().reshape(1, -1)).sum(0).reshape(4, 4096)
        r_ref = (hn.double() + sn.to(BF).double()).to(BF).double()
        y_ref = ln.double() * (r_ref * torch.rsqrt(r_ref.pow(2).mean(-1, keepdim=True) + 1e-5)).to(BF).double()
        # every rank makes every collective call (same_everywhere first, never skipped by an `and`)
        same = [same_everywhere(t) for t in (yn, y2, z3, z4)]
        ok(rel(rn, r_ref) < 1e-2 and rel(yn, y_ref) < 2e-2 and same[0],
           f"replay {i}: all_reduce_add_rmsnorm wrong ({rel(rn, r_ref):.1e}, {rel(yn, y_ref):.1e})")
        sm = gather_rows(xm.double().reshape(1, -1)).sum(0).reshape(16, 4096)
        rm_ref = (hm.double() + sm.to(BF).double()).to(BF).double()
        ym_ref = ln.double() * (rm_ref * torch.rsqrt(rm_ref.pow(2).mean(-1, keepdim=True) + 1e-5)).to(BF).double()
        same_m = same_everywhere(ym)
        ok(rel(rm, rm_ref) < 1e-2 and rel(ym, ym_ref) < 2e-2 and same_m,
           f"replay {i}: all_reduce_add_rmsnorm 16 rows wrong ({rel(rm, rm_ref):.1e}, {rel(ym, ym_ref):.1e})")
        ref = gather_rows(x.double().reshape(1, -1)).sum(0)
        ok(rel(y, ref) < 1e-2, f"replay {i}: all_reduce wrong")
        ok(rel(y2, ref) < 1e-2 and same[1], f"replay {i}: all_reduce impl='ce' wrong")
        zr = a.double() @ w.double().T
        dist.all_reduce(zr)
        ok(rel(z, zr) < 1e-2, f"replay {i}: matmul_all_reduce wrong")
        ok(rel(z3, zr) < 1e-2 and same[2], f"replay {i}: matmul_all_reduce impl='fused' wrong")
        zr2 = a2.double() @ w.double().T
        dist.all_reduce(zr2)
        ok(rel(z2, zr2) < 1e-2, f"replay {i}: matmul_all_reduce impl='overlap' wrong")
        ok(rel(z4, zr2) < 1e-2 and same[3], f"replay {i}: matmul_all_reduce impl='fused' 1024 rows wrong")
        a2.copy_(randn(1024, 2048, seed=900 + 10 * i + R))
    return ok.done("5 replays")


def check_group(ctx, quick):
    """A context over a process group (here: every rank, numbered in reverse, and one group per
    rank): results as on the world context; then a rank that skips a replayed graph makes its
    peers raise TimeoutError naming it (the group context is broken on purpose; the world
    context is untouched)."""
    R, W = ctx.rank, ctx.world
    ok = Expect()
    singles = [dist.new_group([r]) for r in range(W)]
    rev = dist.new_group(list(range(W))[::-1])
    g1 = nd.init(heap_bytes=256 << 20, timeout_s=5.0, group=singles[R])
    ok(g1.world == 1 and g1.rank == 0, f"singleton group context: world {g1.world}, rank {g1.rank}")
    x = randn(1000, seed=61 + R)
    ok(torch.equal(nd.all_reduce(x, ctx=g1), x), "all_reduce over a one-rank group is not the input")
    g = nd.init(heap_bytes=256 << 20, timeout_s=5.0, group=rev)
    members = dist.get_process_group_ranks(rev)
    ok(g.world == W and g.rank == members.index(R), f"group rank {g.rank} for global rank {R} (members {members})")
    ref = gather_rows(x.double().reshape(1, -1)).sum(0)
    for impl in ("oneshot", "twoshot", "nccl"):
        ok(rel(nd.all_reduce(x, ctx=g, impl=impl), ref) < 1e-2, f"group all_reduce {impl} wrong")
    a, b = randn(64, 512, seed=62 + R), randn(512, 256, seed=63 + R)
    zr = a.double() @ b.double()
    dist.all_reduce(zr)
    ok(rel(nd.matmul_all_reduce(a, b, ctx=g), zr) < 1e-2, "group matmul_all_reduce wrong")
    # a rank that stops: graph replay on every rank but the last member
    y = torch.empty_like(x)
    nd.all_reduce(x, ctx=g, out=y)
    graph = capture_on_every_rank(lambda: nd.all_reduce(x, ctx=g, out=y, check=False), warm=False)
    quitter = members[-1]
    if R != quitter:
        t0 = time.perf_counter()
        graph.replay()
        try:
            g.check("all_reduce graph replay")
            ok(False, "no TimeoutError after a replay whose peer never arrived")
        except TimeoutError as e:
            dt = time.perf_counter() - t0
            named = f"global rank {quitter}" in str(e) or f"[{members.index(quitter)}]" in str(e)
            ok(named or W == 1, f"TimeoutError does not name the missing rank: {e}")
            ok(dt < 2 * g.timeout_s + 5, f"TimeoutError after {dt:.1f} s (timeout_s {g.timeout_s})")
    dist.barrier()
    return ok.done(f"group of {W} (members {members}) and singletons ok; timeout in a graph named the missing rank")


def check_recycle(ctx, quick):
    """A context with recycle=True and a small heap: many signatures of all_reduce (both
    shot counts) and of the fused GEMM + all-reduce, each against a float64 reference, so that
    plans are given back and made again many times; a plan captured in a CUDA graph first is
    never given back (its replay on fresh data stays right); every rank frees the same plans."""
    R, W = ctx.rank, ctx.world
    ok = Expect()
    # small enough that plans must be given back, large enough for one all-reduce of the biggest
    # signature (its receive buffer grows with the ranks: 64 MiB of 64 at 4 ranks) beside the pinned plan
    g = nd.init(heap_bytes=(32 << 20) * W, timeout_s=5.0, recycle=True)
    xg = randn(1 << 20, seed=71 + R)
    yg = torch.empty_like(xg)
    graph = capture_on_every_rank(lambda: nd.all_reduce(xg, ctx=g, out=yg, impl="twoshot", check=False))
    ok(len(g.pinned) == 1, f"{len(g.pinned)} plans pinned by the capture (expected 1)")
    b = randn(1024, 2048, seed=72 + R)
    for i in range(12 if quick else 24):
        n = (1 << 21) + 4096 * i
        x = randn(n, seed=100 + 10 * i + R)
        ref = gather_rows(x.double().reshape(1, -1)).sum(0)
        impl = ("oneshot", "twoshot")[i % 2]
        y = nd.all_reduce(x, ctx=g, impl=impl)
        ok(rel(y, ref) < 1e-2, f"all_reduce {impl} n={n}: relative error {rel(y, ref):.2e}")
        a = randn(256 + 64 * (i % 6), 1024, seed=200 + i + R)
        zr = a.double() @ b.double()
        dist.all_reduce(zr)
        z = nd.matmul_all_reduce(a, b, ctx=g, impl="fused")
        ok(rel(z, zr) < 1e-2, f"fused matmul_all_reduce M={a.shape[0]}: relative error {rel(z, zr):.2e}")
        ok(g.used_bytes <= g.heap_bytes, f"heap over its budget: {g.used_bytes} > {g.heap_bytes}")
    # the graph's plan survived every round: replay on fresh data
    xg.copy_(randn(1 << 20, seed=73 + R))
    ref = gather_rows(xg.double().reshape(1, -1)).sum(0)
    graph.replay()
    ok.call("replay check", g.check, "recycle graph replay")
    ok(rel(yg, ref) < 1e-2, f"the pinned plan's replay: relative error {rel(yg, ref):.2e}")
    counts = gather_rows(torch.tensor([[g.recycled, g.used_bytes]], device="cuda", dtype=torch.float64))
    ok(bool((counts == counts[0]).all()), f"ranks recycled differently: {counts.tolist()}")
    ok(g.recycled > 0, "nothing was given back (the heap never filled)")
    return ok.done(f"{g.recycled} plans given back and made again, {len(g.plans)} kept, the pinned graph replayed")


CHECKS = [check_all_reduce, check_matmul_all_reduce, check_arn_exchanges_agree, check_bulk_and_auto, check_all_reduce_graph, check_group,
          check_all_gather_matmul, check_matmul_reduce_scatter, check_first_calls, check_fused_pointer_path,
          check_flash_decode_distributed, check_back_to_back, check_cuda_graph, check_comm_off, check_header_mismatch,
          check_heap_too_small, check_recycle, check_timeout, check_timeout_ws]


def _agree(group, R, W, ok: bool, broken: bool):
    """Every rank's (passed, context broken) flags, over the gloo group (bounded by its timeout).
    Raises if a peer never arrives (it hung in the check: its watchdog will say where)."""
    t = torch.zeros(2 * W, dtype=torch.int32)
    t[R], t[W + R] = int(ok), int(broken)
    dist.all_reduce(t, group=group)
    return [bool(x) for x in t[:W]], [bool(x) for x in t[W:]]


def run_checks(ctx, checks, *, quick=False, limit=150.0, repeat=1, agree_group=None, last_breaks=None):
    """Run ``checks`` on every rank, agreeing on each outcome before the next; returns
    (failed: [(check name, failing ranks)], stopped: bool). ``last_breaks``: the check (or a tuple
    of them) allowed to leave the context out of step (the timeout checks)."""
    R, W = ctx.rank, ctx.world
    dog = Watchdog(R, stream=sys.stdout)
    breakers = last_breaks if isinstance(last_breaks, tuple) else (last_breaks,)
    failed = []
    for rep in range(repeat):
        for fn in checks:
            if fn in breakers and rep < repeat - 1:
                continue    # it breaks the context: only in the last round
            name = fn.__name__[len("check_"):] + (f"#{rep + 1}" if repeat > 1 else "")
            t0 = time.perf_counter()
            with dog.limit(f"check {name}", limit):
                try:
                    msg = fn(ctx, quick)
                    ok = True
                except Exception as e:  # noqa: BLE001 - report, then agree with the other ranks
                    ok, msg = False, f"{type(e).__name__}: {e}\n{traceback.format_exc()[-1500:]}"
                if torch.cuda.is_available():
                    try:
                        torch.cuda.synchronize()
                    except Exception as e:  # noqa: BLE001
                        ok, msg = False, f"{msg}; torch.cuda.synchronize: {type(e).__name__}: {e}"
            print(f"[rank {R}] {'PASS' if ok else 'FAIL'} {name} ({time.perf_counter() - t0:.1f} s): {msg}", flush=True)
            try:
                passed, broken = _agree(agree_group, R, W, ok, bool(ctx.broken))
            except Exception as e:  # noqa: BLE001 - a peer never finished the check
                print(f"[rank {R}] FAIL {name}: the other ranks did not report within the bounded wait "
                      f"({type(e).__name__}: {str(e)[:200]}); stopping", flush=True)
                failed.append((name, ["?"]))
                return failed, True
            bad = [r for r in range(W) if not passed[r]]
            if bad:
                failed.append((name, bad))
                if R == 0:
                    print(f"FAILED {name} on rank(s) {bad}", flush=True)
            if any(broken):
                rest = [f.__name__[len("check_"):] for f in checks[checks.index(fn) + 1:]]
                if fn in breakers:   # it breaks the context on purpose: the rest cannot run after it
                    if R == 0:
                        print(f"context out of step after {name}, as that check leaves it; not run after it: "
                              f"{rest or 'none'} (run each alone: --only NAME)", flush=True)
                else:   # a check that should leave the context in step did not: a failure of its own
                    failed.append((f"{name} (context left out of step)", [r for r in range(W) if broken[r]]))
                    if R == 0:
                        print(f"context out of step on rank(s) {[r for r in range(W) if broken[r]]} after {name}: "
                              f"stopping (the remaining checks would only time out): {rest}", flush=True)
                return failed, True
    return failed, False


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--only", default="", help="comma-separated check names (without check_)")
    ap.add_argument("--check-timeout", type=float, default=150.0,
                    help="wall-clock limit of one check's body in seconds (0: none)")
    ap.add_argument("--repeat", type=int, default=1, help="run the selected checks this many times (races)")
    args = ap.parse_args()
    names = [fn.__name__[len("check_"):] for fn in CHECKS]
    only = [n for n in args.only.split(",") if n]
    unknown = [n for n in only if n not in names]
    if unknown:
        ap.error(f"unknown check(s) {unknown}; known: {names}")
    local = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local)
    limit = args.check_timeout
    # NCCL's own watchdog must fire after ours (ours names the check and dumps the stacks)
    dist.init_process_group("nccl", timeout=datetime.timedelta(seconds=max(300.0, 2 * limit + 60)),
                            device_id=torch.device("cuda", local))
    # outcomes travel over gloo: a rank left in an NCCL collective cannot mismatch them, and the
    # wait is bounded
    agree_group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=(limit or 600) + 60))
    t0 = time.perf_counter()
    ctx = nd.init(heap_bytes=8 << 30, timeout_s=10.0)
    R = ctx.rank
    if R == 0:
        print(f"context: world {ctx.world}, allocator {ctx.allocator}, {ctx.spin_ns:.0f} ns per poll, "
              f"max_spins {ctx.max_spins}, init {time.perf_counter() - t0:.1f} s, check limit {limit:g} s",
              flush=True)
    selected = [fn for fn in CHECKS if not only or fn.__name__[len("check_"):] in only]
    failed, stopped = run_checks(ctx, selected, quick=args.quick, limit=limit, repeat=args.repeat,
                                 agree_group=agree_group, last_breaks=(check_timeout, check_timeout_ws))
    return finish(R, failed, stopped)


def finish(R, failed, stopped) -> int:
    if R == 0:
        if failed:
            print("SOME CHECKS FAILED: " + "; ".join(f"{n} on rank(s) {r}" for n, r in failed), flush=True)
        else:
            print("ALL PASSED", flush=True)
    sys.stdout.flush()
    sys.stderr.flush()
    if stopped:           # a peer may still sit in a collective: skip the process-group teardown
        os._exit(1 if failed else 0)
    try:
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001
        pass
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
