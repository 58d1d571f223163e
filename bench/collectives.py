"""``numasched bench collectives``: all-reduce and the GEMM collectives at tensor-parallel sizes,
``impl="auto"`` against every baseline, side by side in one run (2+ GPUs; launches torchrun).

    numasched bench collectives [--quick] [--nproc N] [--only ar,mar,ag,rs] [--rows 16,64,...]

Every time is a CUDA-graph replay (a graph of ``--calls`` calls, divided by that count; the
slowest rank's median of ``--iters`` replays), so host launch work is out of every number. A
point's contenders are captured first and then timed in interleaved rounds (alternating order):
timed one after the other, identical kernels under two names differed by up to 4 %.

all_reduce (bf16, bytes per rank): numasched one-shot, two-shot and auto (the cost model's pick,
named in ``auto_impl``) against NCCL (``dist.all_reduce``) and torch symmetric memory
(``one_shot_all_reduce`` and ``two_shot_all_reduce_`` on a buffer already in symmetric memory:
their best case, no copy in). ``x_vs_best`` = best peer time / auto time; ``busbw_GBs`` =
2 (W-1)/W bytes / auto time, NCCL's bus-bandwidth convention.
matmul_all_reduce (row-parallel projections: M x K_local x N): bulk (torch.matmul + NCCL) and
cuBLAS + symm_mem one-shot (copy into the symmetric buffer included) against numasched's auto;
also the one-kernel GEMM + all-reduce (``fused_us``), numasched GEMM then one-shot
(``two_kernels_us``) and row chunks overlapped with NCCL (``overlap_us``).
all_gather_matmul / matmul_reduce_scatter (column / row parallel): bulk (NCCL + torch.matmul),
torch symm_mem's fused op, numasched fused and auto. ``gemm_us``: bulk's GEMM alone (cuBLAS, the
same operands), so bulk / gemm_us is the most any overlap of the collective with it can give; the
run ends with auto against bulk from OVERLAP_MIN_ROWS rows where that ceiling is at least
OVERLAP_TARGET (issue 14: >= 1.2x "where overlap pays"). ``est_*_us``: the cost model's estimates
(numasched.distributed.cost), for calibration.
Results: bench/results/collectives-<world>x<gpu>-<date>.csv/.json/.png.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys

ENV = dict(NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NUMASCHED_CHECK_DATA="0")
AR_SIZES = [8 << 10, 64 << 10, 256 << 10, 512 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20]
AR_OFF_GRID = [24 << 10 | 6, (3 << 20) + 1000]   # sizes that are not powers of two
# issue 14: the all-reduce at or below torch symm_mem's one-shot latency up to this size, at or
# above NCCL's bandwidth beyond it
AR_SYMM_TARGET_BYTES = 512 << 10
M_GRID = [16, 64, 256, 1024, 4096, 16384]
# decode batches (a row per program up to the SMs) at Llama-3-8B's hidden size, and around the LL /
# flag crossing (options.arn_exchange="auto") at Qwen3-32B's
ARN_POINTS = [(4096, m) for m in (1, 2, 4, 6, 8, 12, 16, 64)] + [(5120, m) for m in (1, 4, 5, 8, 16)]
# a point's contenders are captured first, then timed in this many interleaved rounds (flush()).
# Odd, so that a transient spanning a round boundary (the last contender of round r is timed again
# first in round r + 1) takes two samples of a contender at most and cannot move its median. With
# four rounds (the upper of the two middle samples) the grid's first point once read 24-26 us for
# the two-shot and auto graphs, adjacent in every round, against 7.3 for auto's own one-shot kernel
# timed beside them (tp2-s50/coll; two reruns: 6.8-8.8 us): such a transient is the likely cause.
ROUNDS = 5
# (name, N, K) of Llama-3-8B and Qwen3-32B projections; K or N is divided by the world size
MAR_SHAPES = [("llama8b.o", 4096, 4096), ("llama8b.down", 4096, 14336), ("qwen32b.o", 5120, 8192),
              ("qwen32b.down", 5120, 25600)]
AG_SHAPES = [("llama8b.qkv", 6144, 4096), ("qwen32b.gate_up", 51200, 5120)]
RS_SHAPES = [("llama8b.down", 4096, 14336), ("qwen32b.o", 5120, 8192)]
# issue 14's overlap target: auto >= OVERLAP_TARGET x bulk from OVERLAP_MIN_ROWS rows, where bulk's
# time over its GEMM alone leaves that much to gain
OVERLAP_TARGET, OVERLAP_MIN_ROWS = 1.2, 2048
COLS = ["op", "shape", "M", "bytes", "nccl_us", "symm1_us", "symm2_us", "oneshot_us", "twoshot_us", "bulk_us", "gemm_us",
        "symm_us", "fused_us", "two_kernels_us", "overlap_us", "flag_us", "ll_us", "auto_us", "auto_impl", "best_peer", "x_vs_best", "busbw_GBs", "est_auto_us",
        "est_bulk_us", "err"]


def build_parser():
    from numasched.argtypes import out_dir, positive_int, positive_int_list, subset

    p = argparse.ArgumentParser(prog="numasched bench collectives", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="fewer sizes and shapes")
    p.add_argument("--nproc", type=positive_int, default=None, help="GPUs (default: all)")
    p.add_argument("--only", type=subset("ar", "mar", "ag", "rs", "arn"), default="ar,mar,ag,rs", help="subset of ar (all_reduce), mar (matmul_all_reduce), "
                                                           "ag (all_gather_matmul), rs (matmul_reduce_scatter); "
                                                           "arn (the decoder's all-reduce + add + RMSNorm at decode "
                                                           "rows, flag against LL exchange) only when named")
    p.add_argument("--rows", "--m", dest="m", type=positive_int_list, default=",".join(map(str, M_GRID)),
                   help="rows (M) of the GEMM collectives, comma-separated")
    p.add_argument("--calls", type=positive_int, default=5, help="calls per captured graph")
    p.add_argument("--iters", type=positive_int, default=20, help="timed replays per method")
    p.add_argument("--weight-copies", type=_copies, default=None,
                   help="copies of each GEMM collective's weight, call i of a graph reading copy i mod copies: "
                        "'auto' (default since 2026-11-28: enough that the calls stream it from HBM, more than "
                        "twice the L2, as a model's layers do and bench gemm_inference times) or a count; 1 is "
                        "the runs recorded before (one weight, which the L2 may keep between calls: cuBLAS read "
                        "a 42 MB weight 1.4x faster so on two H200s, bench/results/tp2-s48/)")
    p.add_argument("--dry-run", action="store_true", help="print the planned points and exit")
    p.add_argument("--out-dir", type=out_dir, default=None, help="results folder")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return p


def _copies(text: str):
    """--weight-copies: a positive count or "auto" (None)."""
    if text == "auto":
        return None
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"--weight-copies must be a positive count or 'auto', got {text!r}")
    return n


def weight_copy_count(nbytes: int, l2_bytes: int, wanted=None) -> int:
    """How many copies of a weight of ``nbytes`` a graph's calls rotate through: ``wanted`` if
    given, else enough that they stream from HBM (gemm_tune.stream_copies, bench gemm_inference's
    rule)."""
    from numasched.gemm_tune import stream_copies

    return wanted if wanted is not None else stream_copies(nbytes, l2_bytes)


def _points(args, world):
    ms = list(args.m)
    only = set(args.only)
    pts = []
    if "ar" in only:
        sizes = AR_SIZES[::2] + AR_OFF_GRID[:1] if args.quick else AR_SIZES + AR_OFF_GRID
        pts += [("all_reduce", f"{b} B", 0, b) for b in sizes]
    shapes = lambda s: s[:1] if args.quick else s  # noqa: E731
    if "mar" in only:
        pts += [("matmul_all_reduce", f"{n} N={N} K_local={K // world}", m, (N, K // world))
                for n, N, K in shapes(MAR_SHAPES) for m in ms]
    if "ag" in only:
        pts += [("all_gather_matmul", f"{n} K={K} N_local={N // world}", m, (N // world, K))
                for n, N, K in shapes(AG_SHAPES) for m in ms]
    if "arn" in only:
        pts += [("all_reduce_add_rmsnorm", f"N={n}", m, n) for n, m in ARN_POINTS]
    if "rs" in only:
        pts += [("matmul_reduce_scatter", f"{n} K_local={K // world} N={N}", m, (N, K // world))
                for n, N, K in shapes(RS_SHAPES) for m in ms]
    return pts


def _without_nproc(argv) -> list:
    """The arguments for the workers: ``--nproc N`` / ``--nproc=N`` dropped (torchrun gets it), ``--m``
    spelled ``--rows``."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == "--nproc":
            skip = True
        elif a == "--m" or a.startswith("--m="):
            # torchrun's parser takes "--m" for an abbreviation of its own options (ambiguous, exits)
            out.append("--rows" + a[3:])
        elif not a.startswith("--nproc="):
            out.append(a)
    return out


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.dry_run:
        from .common import print_plan

        world = args.nproc or 2
        return print_plan("collectives", [f"{op} {shape} M={m}" for op, shape, m, _ in _points(args, world)],
                          ["numasched auto/oneshot/twoshot/fused", "NCCL (+ torch.matmul)", "torch symm_mem"])
    if args.worker or "RANK" in os.environ:
        return _worker(args)
    import torch

    n = args.nproc or (torch.cuda.device_count() if torch.cuda.is_available() else 0)
    if n < 2:
        print(f"numasched bench collectives needs 2+ GPUs (found {n})", file=sys.stderr)
        return 2
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={n}", "-m", "numasched.bench.collectives",
           "--worker"] + _without_nproc(sys.argv[1:] if argv is None else argv)
    print("launching:", " ".join(cmd), flush=True)
    return subprocess.call(cmd, env=dict(os.environ, **ENV))


def _worker(args) -> int:
    import torch
    import torch.distributed as dist

    import numasched.distributed as nd
    from numasched import options as ns_options
    from numasched.distributed import cost
    from numasched.distributed._ws import ws_wanted
    from numasched.distributed.all_reduce_add_rmsnorm import AllReduceAddRmsnorm
    from numasched.distributed.matmul_all_reduce import plan_key as mar_plan_key

    from .common import bench_fixed_ms, init_rank, warm_up_for_capture, write_results

    for k, v in ENV.items():
        os.environ.setdefault(k, v)
    R, W = init_rank()
    ctx = nd.init(heap_bytes=32 << 30, timeout_s=30.0)
    group = dist.group.WORLD.group_name
    bf = torch.bfloat16
    nan = float("nan")
    try:
        from torch.distributed import _symmetric_memory as symm_mem

        if hasattr(symm_mem, "enable_symm_mem_for_group"):
            symm_mem.enable_symm_mem_for_group(group)
        has_symm = True
    except Exception as e:  # noqa: BLE001
        print(f"torch symmetric memory unavailable: {e}")
        has_symm = False

    def say(msg):
        if R == 0:
            print(msg, flush=True)

    pending = []   # (column, graph) of the current point, timed together by flush()
    call = [0]     # the call being captured: the GEMM collectives' fn reads weight copy call mod copies
    l2_bytes = torch.cuda.get_device_properties(torch.cuda.current_device()).L2_cache_size

    def copies_of(w):
        """``w`` and the --weight-copies - 1 clones the calls of a graph rotate through (no more
        than a graph's --calls: the rest would never be read)."""
        n = min(args.calls, weight_copy_count(w.numel() * w.element_size(), l2_bytes, args.weight_copies))
        return [w] + [w.clone() for _ in range(n - 1)]

    def graph_us(key, fn):
        """Capture a CUDA graph of --calls calls of ``fn`` for column ``key``; flush() times it."""
        try:
            call[0] = 0
            warm_up_for_capture(fn, 2)
            dist.barrier()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                for i in range(args.calls):
                    call[0] = i
                    fn()
            call[0] = 0
            torch.cuda.synchronize()
            ctx.check("bench")
        except Exception as e:  # noqa: BLE001
            say(f"    failed: {type(e).__name__}: {str(e)[:160]}")
            g = None
        ok = torch.tensor([0.0 if g is None else 1.0], device="cuda")
        dist.all_reduce(ok, op=dist.ReduceOp.MIN)   # a graph every rank could capture, or none
        pending.append((key, g if float(ok) > 0 else None))

    def flush(row):
        """Time the point's graphs in ROUNDS interleaved rounds (alternating order), so that a drift
        of the clocks or of the link during the point falls on every contender alike; each column
        is the slowest rank's median us per call over its rounds' samples."""
        samples = {key: [] for key, _ in pending}
        live = [(key, g) for key, g in pending if g is not None]
        per_round = max(3, args.iters // ROUNDS)
        for r in range(ROUNDS):
            for key, g in (live if r % 2 == 0 else live[::-1]):
                dist.barrier()
                try:
                    samples[key].append(bench_fixed_ms(g.replay, warmup=1, iters=per_round) * 1e3 / args.calls)
                    ctx.check("bench")
                except Exception as e:  # noqa: BLE001
                    say(f"    failed: {type(e).__name__}: {str(e)[:160]}")
                    samples[key].append(float("inf"))
        for key, _ in pending:
            v = sorted(samples[key])[len(samples[key]) // 2] if samples[key] else float("inf")
            x = torch.tensor([v], device="cuda")
            dist.all_reduce(x, op=dist.ReduceOp.MAX)
            row[key] = nan if float(x) == float("inf") else float(x)
        pending.clear()

    def rel(x, ref):
        return float(torch.linalg.vector_norm(x.double() - ref.double()) / torch.linalg.vector_norm(ref.double()))

    def symm_buffer(numel):
        t = symm_mem.empty(numel, dtype=bf, device="cuda")
        symm_mem.rendezvous(t, group)
        return t

    # warm up (clocks, NCCL channels, cuBLAS handles) for about a second before the first point:
    # the first point of a cold run read 1.5x slow once (8 KB all-reduce 10.0 us against 6.4 us)
    warm = torch.randn(4 << 20, device="cuda", dtype=bf)
    wm = torch.randn(4096, 4096, device="cuda", dtype=bf)
    for _ in range(50):
        dist.all_reduce(warm)
        torch.matmul(wm, wm)
    torch.cuda.synchronize()
    del warm, wm
    rows = []
    for op, shape, m, extra in _points(args, W):
        row = dict(op=op, shape=shape, M=m)
        g = torch.Generator(device="cuda").manual_seed(R * 1000 + len(rows))
        if op == "all_reduce":
            n = extra // 2
            row["bytes"] = extra
            x = torch.randn(n, device="cuda", dtype=bf, generator=g)
            out = torch.empty_like(x)
            ref = x.double()
            dist.all_reduce(ref)
            nbuf = x.clone()
            graph_us("nccl_us", lambda: dist.all_reduce(nbuf))
            if has_symm:
                sb = symm_buffer(n)
                sb.copy_(x)
                so = torch.empty_like(x)
                graph_us("symm1_us", lambda: torch.ops.symm_mem.one_shot_all_reduce_out(sb, "sum", group, so))
                graph_us("symm2_us", lambda: torch.ops.symm_mem.two_shot_all_reduce_(sb, "sum", group))
            errs = []
            for impl in ("oneshot", "twoshot", "auto"):
                errs.append(rel(nd.all_reduce(x, ctx=ctx, impl=impl, out=out), ref))
                graph_us(f"{impl}_us", lambda: nd.all_reduce(x, ctx=ctx, impl=impl, out=out, check=False))
            row["auto_impl"] = cost.choose_all_reduce(extra, W)
            row["est_auto_us"] = cost.all_reduce_s(row["auto_impl"], extra, W) * 1e6
            row["est_bulk_us"] = cost.all_reduce_s("nccl", extra, W) * 1e6
            peer_keys = ("nccl_us", "symm1_us", "symm2_us")
        elif op == "matmul_all_reduce":
            N, Kl = extra
            a = torch.randn(m, Kl, device="cuda", dtype=bf, generator=g)
            w = torch.randn(N, Kl, device="cuda", dtype=bf, generator=g) / Kl ** 0.5
            bs = [c.T for c in copies_of(w)]
            b = bs[0]
            B = lambda: bs[call[0] % len(bs)]  # noqa: E731
            out = torch.empty(m, N, device="cuda", dtype=bf)
            row["bytes"] = m * N * 2
            ref = a.double() @ w.double().T
            dist.all_reduce(ref)
            c = torch.empty(m, N, device="cuda", dtype=bf)
            graph_us("bulk_us", lambda: (torch.matmul(a, B(), out=c), dist.all_reduce(c)))
            graph_us("gemm_us", lambda: torch.matmul(a, B(), out=c))
            if has_symm:
                sb = symm_buffer(m * N).view(m, N)
                so = torch.empty(m * N, device="cuda", dtype=bf)
                graph_us("symm_us", lambda: (torch.matmul(a, B(), out=sb),
                                             torch.ops.symm_mem.one_shot_all_reduce_out(sb.view(-1), "sum", group, so)))
            # every variant timed below is checked first (the largest error is reported)
            row["err"] = max(rel(nd.matmul_all_reduce(a, b, ctx=ctx, out=out, **kw), ref)
                             for kw in ({}, dict(impl="fused"), dict(gemm="numasched", impl="oneshot"),
                                        dict(impl="overlap")))
            # the plan the call made (it weighs the fused kernel only where its operands and the
            # heap allow, which a bare plan_matmul_all_reduce does not know)
            plan = ctx.plans[mar_plan_key(a, b)]
            row["auto_impl"] = f"{plan.impl}:{plan.gemm}+{plan.all_reduce}"
            graph_us("auto_us", lambda: nd.matmul_all_reduce(a, B(), ctx=ctx, out=out, check=False))
            graph_us("two_kernels_us", lambda: nd.matmul_all_reduce(a, B(), ctx=ctx, out=out, check=False,
                                                                    gemm="numasched", impl="oneshot"))
            graph_us("fused_us", lambda: nd.matmul_all_reduce(a, B(), ctx=ctx, out=out, check=False, impl="fused"))
            graph_us("overlap_us", lambda: nd.matmul_all_reduce(a, B(), ctx=ctx, out=out, check=False,
                                                                impl="overlap"))
            row["est_auto_us"] = plan.est_us
            row["est_bulk_us"] = nd.plan_matmul_all_reduce(a, b, world=W, impl="bulk").est_us
            peer_keys = ("bulk_us", "symm_us")
        elif op == "all_reduce_add_rmsnorm":
            # NCCL + torch's add and RMSNorm (bulk) against numasched's kernel with each exchange
            N = extra
            x = torch.randn(m, N, device="cuda", dtype=bf, generator=g)
            h = torch.randn(m, N, device="cuda", dtype=bf, generator=torch.Generator(device="cuda").manual_seed(7))
            g2 = torch.Generator(device="cuda").manual_seed(8)
            ln = 1 + 0.1 * torch.randn(N, device="cuda", dtype=bf, generator=g2)
            row["bytes"] = m * N * 2
            s_ref = x.double()
            dist.all_reduce(s_ref)
            r_ref = (h.double() + s_ref.to(bf).double()).to(bf)
            y_ref = torch.nn.functional.rms_norm(r_ref.float(), (N,), ln.float(), 1e-5)
            c, r_out, y = x.clone(), torch.empty_like(x), torch.empty_like(x)

            def bulk():
                c.copy_(x)
                dist.all_reduce(c)
                r_out.copy_(h + c)
                return torch.nn.functional.rms_norm(r_out, (N,), ln, 1e-5)

            graph_us("bulk_us", bulk)
            errs = []
            for exchange, key in (("flag", "flag_us"), ("ll", "ll_us")):
                # options.arn_exchange is in the plan's key: each setting its own plan
                with ns_options.use(arn_exchange=exchange):
                    nd.all_reduce_add_rmsnorm(x, h, ln, 1e-5, ctx=ctx, residual_out=r_out, out=y)
                    errs.append(max(rel(r_out, r_ref), rel(y, y_ref)))
                    graph_us(key, lambda: nd.all_reduce_add_rmsnorm(x, h, ln, 1e-5, ctx=ctx, residual_out=r_out,
                                                                    out=y, check=False))
            graph_us("auto_us", lambda: nd.all_reduce_add_rmsnorm(x, h, ln, 1e-5, ctx=ctx, residual_out=r_out, out=y,
                                                                  check=False))
            # what auto ran (options.arn_exchange as set, "auto" by default); arn_one_row=False or
            # ROCm leave LL off, and the ll column then times the flag exchange
            row["auto_impl"] = "ll" if AllReduceAddRmsnorm.describe(x, h, ln, world=W, num_sms=ctx.num_sms).cfg["ll"] \
                else "flag"
            row["err"] = max(errs)
            peer_keys = ("bulk_us",)
        else:
            ag = op == "all_gather_matmul"
            if ag:
                Nl, K = extra
                Ml = max(1, m // W)
                a = torch.randn(Ml, K, device="cuda", dtype=bf, generator=g)
                b = torch.randn(K, Nl, device="cuda", dtype=bf, generator=g) / K ** 0.5
                bs = copies_of(b)
                B = lambda: bs[call[0] % len(bs)]  # noqa: E731
                full = torch.empty(Ml * W, K, device="cuda", dtype=bf)
                c = torch.empty(Ml * W, Nl, device="cuda", dtype=bf)
                bulk = lambda: (dist.all_gather_into_tensor(full, a), torch.matmul(full, B(), out=c))  # noqa: E731
                gemm = lambda: torch.matmul(full, B(), out=c)  # noqa: E731
                symm = lambda: torch.ops.symm_mem.fused_all_gather_matmul(a, [B()], 0, group)  # noqa: E731
                fn = nd.all_gather_matmul
                dims = (Ml * W, Nl, K)
            else:
                N, Kl = extra
                Mt = max(W, m // W * W)
                a = torch.randn(Mt, Kl, device="cuda", dtype=bf, generator=g)
                b = torch.randn(Kl, N, device="cuda", dtype=bf, generator=g) / Kl ** 0.5
                bs = copies_of(b)
                B = lambda: bs[call[0] % len(bs)]  # noqa: E731
                part = torch.empty(Mt, N, device="cuda", dtype=bf)
                res = torch.empty(Mt // W, N, device="cuda", dtype=bf)
                bulk = lambda: (torch.matmul(a, B(), out=part), dist.reduce_scatter_tensor(res, part))  # noqa: E731
                gemm = lambda: torch.matmul(a, B(), out=part)  # noqa: E731
                symm = lambda: torch.ops.symm_mem.fused_matmul_reduce_scatter(a, B(), "sum", 0, group)  # noqa: E731
                fn = nd.matmul_reduce_scatter
                dims = (Mt, N, Kl)
            row["bytes"] = dims[0] * dims[1] * 2
            graph_us("bulk_us", bulk)
            graph_us("gemm_us", gemm)
            if has_symm:
                graph_us("symm_us", symm)
            ref = fn(a, b, ctx=ctx, impl="bulk")
            row["err"] = max(rel(fn(a, b, ctx=ctx, impl=i), ref) for i in ("auto", "fused"))
            graph_us("fused_us", lambda: fn(a, B(), ctx=ctx, impl="fused", check=False))
            graph_us("auto_us", lambda: fn(a, B(), ctx=ctx, impl="auto", check=False))
            # the model as the op consults it (the WS reduce-scatter on two Hopper ranks)
            ws = dict(ws=ws_wanted(ctx), num_sms=ctx.num_sms)
            row["auto_impl"] = cost.choose_gemm_collective(op, *dims, bf, W, symm_mem_ok=has_symm, **ws)
            row["est_auto_us"] = cost.gemm_collective_s(op, row["auto_impl"], *dims, bf, W, **ws) * 1e6
            if row["auto_impl"] == "bulk":   # NCCL, then the engine rule's GEMM (cost.gemm_engine)
                row["auto_impl"] = f"bulk:{cost.gemm_engine(dims[0], a.device)}"
            row["est_bulk_us"] = cost.gemm_collective_s(op, "bulk", *dims, bf, W) * 1e6
            peer_keys = ("bulk_us", "symm_us")
        flush(row)
        if op == "all_reduce":
            row["err"] = max(errs)
            row["busbw_GBs"] = 2 * (W - 1) / W * extra / (row["auto_us"] * 1e-6) / 1e9
        peers = {k: row.get(k, nan) for k in peer_keys}
        live = {k: v for k, v in peers.items() if v == v}
        if live:
            best = min(live, key=live.get)
            row["best_peer"] = best[:-3]
            row["x_vs_best"] = live[best] / row["auto_us"]
        say(f"ROW {op} {shape} M={m}: " + " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                                                  for k, v in row.items() if k not in ("op", "shape", "M")))
        rows.append(row)
    if R == 0:
        write_results("collectives", rows, columns=COLS, plot=_plot, gpus=W,
                      meta=dict(world=W, calls_per_graph=args.calls, iters=args.iters,
                                weight_copies=args.weight_copies or "auto"),
                      out_dir=args.out_dir)
        ar = [r for r in rows if "x_vs_best" in r and r["x_vs_best"] == r["x_vs_best"]]
        if ar:
            worst = min(ar, key=lambda r: r["x_vs_best"])
            print(f"auto vs best baseline: worst {worst['x_vs_best']:.3f} at {worst['op']} {worst['shape']} "
                  f"M={worst['M']}; {sum(r['x_vs_best'] >= 0.995 for r in ar)}/{len(ar)} points >= 1.00 (0.5% noise)")
        for line in (all_reduce_summary(rows), overlap_summary(rows)):
            if line:
                print(line)
    dist.barrier()
    dist.destroy_process_group()
    return 0


def all_reduce_summary(rows) -> str:
    """Issue 14's all-reduce target as its own line: auto against torch symm_mem's one-shot
    (symm1_us / auto_us) up to AR_SYMM_TARGET_BYTES, against NCCL (nccl_us / auto_us) above, each
    with its count >= 1.00 (0.5 % noise) and its worst point. "" without all-reduce rows."""
    def ok(r, key):
        return isinstance(r.get(key), float) and r[key] == r[key] and r[key] > 0

    ar = [r for r in rows if r["op"] == "all_reduce" and ok(r, "auto_us")]
    out = []
    for label, key, pts in (
            (f"<= {AR_SYMM_TARGET_BYTES >> 10} KB against torch symm_mem's one-shot", "symm1_us",
             [r for r in ar if r["bytes"] <= AR_SYMM_TARGET_BYTES and ok(r, "symm1_us")]),
            (f"> {AR_SYMM_TARGET_BYTES >> 10} KB against NCCL", "nccl_us",
             [r for r in ar if r["bytes"] > AR_SYMM_TARGET_BYTES and ok(r, "nccl_us")])):
        if pts:
            x = [(r[key] / r["auto_us"], r) for r in pts]
            worst, wr = min(x, key=lambda t: t[0])
            out.append(f"{label}: {sum(v >= 0.995 for v, _ in x)}/{len(x)} >= 1.00, worst {worst:.3f} at {wr['shape']}")
    return ("all_reduce " + "; ".join(out)) if out else ""


def overlap_summary(rows) -> str:
    """Auto against bulk (bulk_us / auto_us) at the GEMM collectives' points of OVERLAP_MIN_ROWS
    rows and more: the worst where bulk / its GEMM alone is at least OVERLAP_TARGET (overlap can
    reach the target there), and the points where it is not (with that ceiling). "" if none."""
    def ok(r, *keys):
        return all(isinstance(r.get(k), float) and r[k] == r[k] and r[k] > 0 for k in keys)

    pts = [r for r in rows if r["op"] != "all_reduce" and r["M"] >= OVERLAP_MIN_ROWS and ok(r, "bulk_us", "auto_us")]
    if not pts:
        return ""
    pays = [r for r in pts if ok(r, "gemm_us") and r["bulk_us"] / r["gemm_us"] >= OVERLAP_TARGET]
    rest = [r for r in pts if r not in pays]
    out = []
    if pays:
        worst = min(pays, key=lambda r: r["bulk_us"] / r["auto_us"])
        met = sum(r["bulk_us"] / r["auto_us"] >= OVERLAP_TARGET for r in pays)
        out.append(f"auto vs bulk from {OVERLAP_MIN_ROWS} rows where bulk / its GEMM >= {OVERLAP_TARGET}: "
                   f"{met}/{len(pays)} >= {OVERLAP_TARGET}x, worst {worst['bulk_us'] / worst['auto_us']:.3f} at "
                   f"{worst['op']} {worst['shape']} M={worst['M']}")
    def ceiling(r):
        return f"ceiling {r['bulk_us'] / r['gemm_us']:.3f}" if ok(r, "gemm_us") else "no GEMM time"

    if rest:
        out.append("below that ceiling: " + "; ".join(
            f"{r['op']} {r['shape']} M={r['M']} {r['bulk_us'] / r['auto_us']:.3f}x ({ceiling(r)})" for r in rest))
    return "\n".join(out)


def _plot(rows, path):
    import matplotlib.pyplot as plt
    from .common import save_plot

    ar = [r for r in rows if r["op"] == "all_reduce"]
    other = [r for r in rows if r["op"] != "all_reduce" and r.get("x_vs_best") == r.get("x_vs_best")]
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
    ax = axes[0]
    for key, label in (("auto_us", "numasched auto"), ("nccl_us", "NCCL"), ("symm1_us", "symm_mem one-shot"),
                       ("symm2_us", "symm_mem two-shot")):
        pts = sorted((r["bytes"], r.get(key)) for r in ar if r.get(key) == r.get(key) and r.get(key) is not None)
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("bytes per rank")
    ax.set_ylabel("us per all-reduce (CUDA graph)")
    ax.legend()
    ax = axes[1]
    for op in ("matmul_all_reduce", "all_gather_matmul", "matmul_reduce_scatter"):
        pts = [(r["M"], r["x_vs_best"]) for r in other if r["op"] == op]
        if pts:
            ax.scatter([p[0] for p in pts], [p[1] for p in pts], label=op)
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xscale("log")
    ax.set_xlabel("M (rows)")
    ax.set_ylabel("best baseline time / auto time")
    ax.legend()
    fig.tight_layout()
    save_plot(fig, path)


if __name__ == "__main__":
    sys.exit(main())
