"""``numasched bench distributed``: fused cross-GPU kernels vs bulk-synchronous NCCL and torch
symmetric memory, side by side in one run (needs 2+ GPUs with NVLink; launches torchrun itself).

    numasched bench distributed [--quick] [--nproc N] [--only ag,rs,decode] [--methods gemm,bulk,fused,...]
                                [--shape-timeout S] [--iris-ops]
    # or by hand:  NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 \\
    #              torchrun --nproc-per-node 2 -m numasched.bench.distributed [--quick]

Per shape, every method runs the same fixed number of iterations on every rank (CUDA events;
an adaptive timer can deadlock collectives) and the slowest rank's median counts. A GEMM-row
sample is ``--calls`` calls (default 5) queued back to back, divided by that count: the host's
launch work overlaps the previous call's kernels, as in a model's stream of layers (``--calls 1``
times single eager calls on an idle GPU, host work included). Decode rows time single eager calls
and, separately, CUDA-graph replays. Shapes run
small first, the ops interleaved; inside a shape the methods run in the order gemm, bulk, fused
(+ nocomm), symm_mem, ce (``--methods`` picks a subset). Every measurement is printed when it is
taken and every finished row is printed (``ROW ...``) and written to the CSV at once. Each shape
runs under a wall-clock limit (``--shape-timeout``, default 180 s): past it every rank prints the
shape, dumps all Python stacks and exits (code 3), so a hang says where it hung.

all-gather + GEMM (A rows sharded, (M/world, K) per rank; B (K, N_local)):
    gemm      torch.matmul of the whole (M, K) A with B: the GEMM alone (cuBLAS)
    bulk      NCCL all_gather_into_tensor, then torch.matmul
    symm_mem  torch.ops.symm_mem.fused_all_gather_matmul (copy-engine path: multicast off)
    fused     numasched.distributed.all_gather_matmul, impl="fused" (one fused Triton kernel)
    ce        the same with impl="ce" (cuBLAS per shard + copy-engine pushes on a side stream)
    ours      the better of fused and ce (best_impl); the ratios use it
    nocomm    fused with communication switched off (the fused kernel's compute alone)
    link      bytes each rank receives / measured remote-store bandwidth
    T_lb      max(gemm, link): nothing can beat it; the target is ours <= 1.05 T_lb
GEMM + reduce-scatter (A (M, K_local), B (K_local, N) per rank): the same with torch.matmul then
NCCL reduce_scatter_tensor, torch.ops.symm_mem.fused_matmul_reduce_scatter.
decode (KV split across ranks; B rows, 32 query / 8 KV heads, d 128, bf16):
    single    one GPU decoding the whole context (numasched.flash_decode)
    bulk      local decode, NCCL all_gather of (out, lse), merge in torch
    ours      numasched.distributed.flash_decode_distributed
    graph_*   the same three replayed from CUDA graphs (no host launch overhead)
Targets: ours no slower than bulk and symm_mem everywhere and within 5% of T_lb; decode >= 1.2x
bulk and >= 1.7x single at >= 256k context. ``--iris-ops`` also tries Iris's own fused ops
(ctx.ops-style, time-limited in a separate torchrun; failures are reported, not fatal).
Results: bench/results/distributed-<world>x<gpu>-<date>.csv/.json (+ distributed_iris_ops-...).
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

ENV = dict(NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NUMASCHED_CHECK_DATA="0")
H, HK, D = 32, 8, 128


def _subset(allowed):
    """argparse type: a comma-separated subset of ``allowed`` (a callable giving it), kept as text."""
    def check(text: str) -> str:
        names = [x for x in text.split(",") if x]
        bad = [x for x in names if x not in allowed()]
        if not names or bad:
            raise argparse.ArgumentTypeError(f"expected a comma-separated subset of {','.join(allowed())}, got {text!r}")
        return text
    return check


def build_parser():
    return _parser()


def _parser():
    from numasched.argtypes import nonneg_int, out_dir, positive_float, positive_int

    p = argparse.ArgumentParser(prog="numasched bench distributed", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="small grid (well under a minute of GPU time)")
    p.add_argument("--nproc", type=nonneg_int, default=0, help="GPUs to use (default: all visible)")
    p.add_argument("--only", type=_subset(lambda: ("ag", "rs", "decode")), default="ag,rs,decode",
                   help="comma-separated subset of ag, rs, decode")
    p.add_argument("--iters", type=positive_int, default=20, help="timed calls per measurement (every rank)")
    p.add_argument("--warmup", type=nonneg_int, default=5, help="untimed calls before each measurement")
    p.add_argument("--calls", type=positive_int, default=5,
                   help="GEMM rows: calls queued back to back per timed sample (1: single eager calls, "
                        "whose host launch work counts)")
    p.add_argument("--methods", type=_subset(lambda: METHODS), default=",".join(METHODS),
                   help="comma-separated subset of " + ",".join(METHODS) + " (decode uses bulk, fused, nocomm, gemm)")
    p.add_argument("--shape-timeout", type=positive_float, default=180.0,
                   help="wall-clock seconds per shape; past it every rank dumps its stacks and the run stops")
    p.add_argument("--iris-ops", action="store_true", help="also try Iris's own fused ops (separate, time-limited)")
    p.add_argument("--iris-timeout", type=positive_int, default=240, help="seconds allowed for the Iris-ops run")
    p.add_argument("--out-dir", type=out_dir, default=None,
                   help="results folder (default: see numasched.bench.common; passed to the ranks)")
    p.add_argument("--dry-run", action="store_true",
                   help="print the shapes and methods and exit (no GPU needed, nothing launched)")
    p.add_argument("--worker", default="", help=argparse.SUPPRESS)
    return p


def _dry_run(args) -> int:
    from .common import print_plan

    world = args.nproc or 2
    ag, rs, dec = _shapes(args.quick, world)
    only = args.only.split(",")
    lines = ([f"all_gather_matmul world {world}: M={M} K={K} N_local={N}" for M, K, N in ag if "ag" in only]
             + [f"matmul_reduce_scatter world {world}: M={M} K_local={K} N={N}" for M, K, N in rs if "rs" in only]
             + [f"flash_decode_distributed world {world}: batch {B}, context {S}, {H}/{HK} heads, d{D}"
                for B, S in dec if "decode" in only])
    return print_plan("distributed", lines, [f"methods: {args.methods}"]
                      + (["Iris's own fused ops (separate run)"] if args.iris_ops else []))


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = _parser().parse_args(argv)
    if args.dry_run:
        return _dry_run(args)
    if args.out_dir:   # the ranks (and this process) write there: numasched.bench.common.results_dir
        os.environ["NUMASCHED_RESULTS_DIR"] = str(os.path.abspath(args.out_dir))
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return _iris_ops_worker(args) if args.worker == "iris-ops" else _worker(args)
    return _launch(args, argv)


# ============================================================================ launcher
def _worker_argv(argv) -> list:
    """``argv`` without the launcher's own options (``--nproc N``, ``--iris-ops``): torchrun would
    read "--nproc" after the module name as its own --nproc-per-node."""
    launcher = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    launcher.add_argument("--nproc")
    launcher.add_argument("--iris-ops", action="store_true")
    return launcher.parse_known_args(argv)[1]


def _launch(args, argv) -> int:
    import torch

    n = args.nproc or (torch.cuda.device_count() if torch.cuda.is_available() else 0)
    cmd_hint = ("NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 torchrun --nproc-per-node 2 "
                "-m numasched.bench.distributed [--quick]")
    if n < 2:
        print(f"numasched bench distributed needs 2+ GPUs (found {n}); on a multi-GPU machine run: {cmd_hint}",
              file=sys.stderr)
        return 2
    env = dict(os.environ, **ENV)
    base = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={n}", "-m", "numasched.bench.distributed"]
    passthrough = _worker_argv(argv)
    print("launching:", " ".join(base + passthrough), flush=True)
    rc = subprocess.call(base + passthrough, env=env)
    if args.iris_ops:
        print(f"Iris's own ops (limit {args.iris_timeout} s):", flush=True)
        p = subprocess.Popen(base + passthrough + ["--worker", "iris-ops"], env=env, start_new_session=True)
        try:
            p.wait(timeout=args.iris_timeout)
            if p.returncode:
                print(f"Iris ops: torchrun exited with {p.returncode}")
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, 9)   # the process group this launcher created (start_new_session)
            p.wait()
            print(f"Iris ops: did not finish within {args.iris_timeout} s (killed); rows written so far are in "
                  f"bench/results/distributed_iris_ops-*.json")
    return rc


# ============================================================================ worker (one rank)
METHODS = ("gemm", "bulk", "fused", "nocomm", "symm_mem", "ce")
COLS = ["op", "shape", "world", "gemm_ms", "single_ms", "local_decode_ms", "bulk_ms", "symm_mem_ms", "fused_ms",
        "ce_ms", "best_impl", "ours_ms", "nocomm_ms", "fused_over_nocomm", "link_ms", "T_lb_ms", "ours_over_T_lb",
        "x_vs_bulk", "x_vs_symm_mem", "x_vs_single", "fused_host_us", "graph_single_ms", "graph_bulk_ms",
        "graph_ours_ms", "graph_x_vs_bulk", "graph_x_vs_single", "ours_TFLOPs", "err_vs_bulk", "target", "note"]


def _setup(limit: float = 0.0):
    from .common import init_rank

    for k, v in ENV.items():
        os.environ.setdefault(k, v)
    # NCCL's watchdog fires after our per-shape watchdog (which says what hung)
    return init_rank(max(300.0, 2 * limit + 60))


def _timer(args):
    import torch
    import torch.distributed as dist

    from .common import bench_fixed_ms

    def t(fn, calls=1):
        """Slowest rank's median ms over a fixed count (warmup + iters calls of ``fn`` on every rank,
        no early exit, no adaptive count: a rank doing one call more or less would leave the others
        in an unmatched collective); NaN everywhere if it failed on any rank."""
        try:
            torch.cuda.synchronize()
            dist.barrier()
            ms = bench_fixed_ms(fn, warmup=args.warmup, iters=args.iters, calls=calls)
            err = ""
        except Exception as e:  # noqa: BLE001 - e.g. an op missing on every rank; a one-sided
            ms, err = float("nan"), f"{type(e).__name__}: {str(e)[:120]}"   # failure is the watchdog's
        # one all-reduce (MAX) of (ms, failed): the slowest rank's time, and whether any rank failed
        x = torch.tensor([ms if ms == ms else float("inf"), 1.0 if err else 0.0], device="cuda")
        dist.all_reduce(x, op=dist.ReduceOp.MAX)
        if float(x[1]) or float(x[0]) == float("inf"):
            return float("nan"), err or "failed on another rank"
        return float(x[0]), err
    return t


def _link_bandwidth(ctx, nbytes=256 << 20):
    """Bytes/s one rank pushes to its neighbour with remote stores while every rank does the same."""
    import torch
    import torch.distributed as dist

    from numasched.kernels.dist_common import remote_copy_kernel

    from .common import bench_fixed_ms

    n = nbytes // 2
    dst = ctx.alloc((n,), torch.bfloat16, what="bandwidth probe")
    src = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    peer = (ctx.rank + 1) % ctx.world
    grid = (ctx.num_sms * 2,)
    fn = lambda: remote_copy_kernel[grid](src, dst, ctx.heap_bases, ctx.rank, peer, n, BLOCK=8192,  # noqa: E731
                                          num_warps=8)
    torch.cuda.synchronize()
    dist.barrier()
    ms = bench_fixed_ms(fn, warmup=3, iters=10)
    x = torch.tensor([ms], device="cuda")
    dist.all_reduce(x, op=dist.ReduceOp.MAX)
    return nbytes / (float(x) * 1e-3)


def _shapes(quick, world):
    ag = [(M, 8192, n) for M in ((4096, 16384) if quick else (4096, 16384, 32768))
          for n in ((28672 // world,) if quick else (28672 // world, 8192 // world))]
    rs = [(M, k, 8192) for M in ((4096, 16384) if quick else (4096, 16384, 32768))
          for k in ((28672 // world,) if quick else (28672 // world, 8192 // world))]
    dec = [(b, s) for b in ((1, 4) if quick else (1, 4, 16)) for s in ((131072, 262144) if quick else
                                                                       (131072, 262144, 1048576))]
    return ag, rs, dec


class _Out:
    """Rank 0: one line per measurement and per finished row as soon as it is measured (flushed),
    and the CSV rewritten after every row, so a run that dies still leaves its rows."""

    def __init__(self, rank: int, world: int):
        self.rank, self.rows = rank, []
        self.path = None
        if rank == 0:
            from .common import RESULTS_DIR, device_slug, env_info

            RESULTS_DIR.mkdir(parents=True, exist_ok=True)
            # the same name write_results gives the finished run's CSV (it overwrites this one)
            self.path = RESULTS_DIR / f"distributed-{world}x{device_slug()}-{env_info()['date'][:10]}.csv"

    def say(self, msg: str):
        if self.rank == 0:
            print(msg, flush=True)

    def add(self, row: dict):
        import csv

        self.rows.append(row)
        if self.rank != 0:
            return
        keys = ("gemm_ms", "bulk_ms", "fused_ms", "ce_ms", "symm_mem_ms", "single_ms", "ours_ms", "x_vs_bulk",
                "x_vs_symm_mem", "x_vs_single", "graph_x_vs_bulk", "graph_x_vs_single", "ours_over_T_lb",
                "err_vs_bulk")
        cells = " ".join(f"{k}={row[k]:.4g}" if isinstance(row.get(k), float) else f"{k}={row[k]}"
                         for k in keys if k in row)
        print(f"ROW {row['op']} {row['shape']}: {cells}" + (f"  note: {row['note']}" if row.get("note") else ""),
              flush=True)
        with open(self.path, "w", newline="") as f:   # the whole file each time: a killed run keeps its rows
            w = csv.DictWriter(f, fieldnames=COLS, extrasaction="ignore")
            w.writeheader()
            w.writerows(self.rows)


def _worker(args) -> int:
    import torch
    import torch.distributed as dist

    import numasched.distributed as nd
    from numasched.distributed._watchdog import Watchdog
    from numasched.distributed.flash_decode_distributed import default_local_decode

    from .common import matmul_rate, write_results

    R, W = _setup(args.shape_timeout)
    dog = Watchdog(R, stream=sys.stdout)
    only = set(args.only.split(","))
    methods = [m for m in args.methods.split(",") if m]
    bad = [m for m in methods if m not in METHODS]
    if bad:
        raise SystemExit(f"--methods: unknown {bad}; choose from {METHODS}")
    ag_shapes, rs_shapes, dec_shapes = _shapes(args.quick, W)
    bf = torch.bfloat16
    meta = lambda *s: torch.empty(*s, device="meta", dtype=bf)  # noqa: E731
    impls = [i for i in ("fused", "ce") if i in methods]
    workload = ([("all_gather_matmul", meta(M // W, K), meta(K, N), dict(impl=i))
                 for M, K, N in ag_shapes if "ag" in only for i in impls]
                + [("matmul_reduce_scatter", meta(M, K), meta(K, N), dict(impl=i))
                   for M, K, N in rs_shapes if "rs" in only for i in impls]
                + [("flash_decode_distributed", meta(B, H, D), meta(B, 1, HK, D)) for B, _ in dec_shapes])
    out = _Out(R, W)
    with dog.limit("setup (Iris context, link bandwidth, cuBLAS rate)", args.shape_timeout):
        ctx = nd.init(heap_bytes=nd.required_heap_bytes(workload, W) + (600 << 20), timeout_s=60.0)
        timed = _timer(args)
        bw = _link_bandwidth(ctx)
        rate = matmul_rate()
    out.say(f"world {W}: remote-store bandwidth {bw / 1e9:.0f} GB/s per rank, cuBLAS bf16 {rate / 1e12:.0f} TFLOP/s, "
            f"{ctx.spin_ns:.0f} ns per flag poll; {args.warmup}+{args.iters} calls per measurement, "
            f"limit {args.shape_timeout:g} s per shape; methods {','.join(methods)}")
    group = dist.group.WORLD.group_name
    symm_ok = "symm_mem" in methods and _enable_symm_mem(group)
    nan = float("nan")

    def rel(x, ref):
        return float(torch.linalg.vector_norm(x.float() - ref.float()) / torch.linalg.vector_norm(ref.float()))

    def measure(tag, name, fn, show=None, calls=1):
        """One method of one shape (skipped unless ``name`` is in --methods): the same fixed
        number of calls on every rank; printed at once."""
        if name not in methods:
            return nan, ""
        ms, err = timed(fn, calls)
        out.say(f"  {tag}: {show or name} {ms:.4g} ms" + (f" ({err})" if err else ""))
        return ms, err

    def ours_and_symm(tag, op, a, b, ours_out, ref, symm):
        """Our op (each impl in --methods: error against ``ref``, then timed; fused also with
        communication off) and torch symm_mem's op ``symm``, in the order fused, nocomm,
        symm_mem, ce. Returns the times by name, the errors and the failure notes."""
        t = dict(fused=nan, nocomm=nan, symm_mem=nan, ce=nan)
        errs, notes = [], []

        def impl(name):
            errs.append(rel(op(a, b, ctx=ctx, out=ours_out, impl=name), ref))
            out.say(f"  {tag}: {name} rel. error {errs[-1]:.2e}")
            t[name], e = measure(tag, name, lambda: op(a, b, ctx=ctx, out=ours_out, check=False, impl=name),
                                 calls=args.calls)
            notes.append(e)

        if "fused" in methods:
            impl("fused")
            t["nocomm"], _ = measure(tag, "nocomm", lambda: op(a, b, ctx=ctx, out=ours_out, check=False,
                                                               communicate=False), calls=args.calls)
            # host time of one eager call: 10 calls on every rank (their kernels wait for each
            # other), wall clock on the host before any synchronisation
            torch.cuda.synchronize()
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(10):
                op(a, b, ctx=ctx, out=ours_out, check=False)
            t["host_us"] = (time.perf_counter() - t0) / 10 * 1e6
            torch.cuda.synchronize()
            out.say(f"  {tag}: fused host time {t['host_us']:.0f} us per call")
        if symm_ok:
            t["symm_mem"], e = measure(tag, "symm_mem", symm, calls=args.calls)
            notes.append(e)
        if "ce" in methods:
            impl("ce")
        return t, errs, notes

    # ------------------------------------------------------------------ all-gather + GEMM
    def ag_row(M, K, N):
        Ml = M // W
        tag = f"all_gather_matmul M={M} K={K} N_local={N}"
        a = torch.randn(Ml, K, device="cuda", dtype=bf)
        b = torch.randn(K, N, device="cuda", dtype=bf)
        full = torch.empty(M, K, device="cuda", dtype=bf)
        c = torch.empty(M, N, device="cuda", dtype=bf)
        dist.all_gather_into_tensor(full, a)
        ref = full @ b
        ours_out = torch.empty(M, N, device="cuda", dtype=bf)
        t_gemm, _ = measure(tag, "gemm", lambda: torch.matmul(full, b, out=c), calls=args.calls)
        t_bulk, _ = measure(tag, "bulk", lambda: (dist.all_gather_into_tensor(full, a), torch.matmul(full, b, out=c)),
                            calls=args.calls)
        t, errs, notes = ours_and_symm(tag, nd.all_gather_matmul, a, b, ours_out, ref,
                                       lambda: torch.ops.symm_mem.fused_all_gather_matmul(a, [b], 0, group))
        ctx.check("all_gather_matmul")
        link = (W - 1) * Ml * K * 2 / bw * 1e3
        return _row("all_gather_matmul", f"M={M} K={K} N_local={N}", W, 2 * M * N * K, t_gemm, t_bulk,
                    t["symm_mem"], t["fused"], t["ce"], t["nocomm"], link, max(errs, default=nan),
                    "; ".join(x for x in notes if x), host_us=t.get("host_us", nan))

    # ------------------------------------------------------------------ GEMM + reduce-scatter
    def rs_row(M, Kl, N):
        tag = f"matmul_reduce_scatter M={M} K_local={Kl} N={N}"
        a = torch.randn(M, Kl, device="cuda", dtype=bf)
        b = torch.randn(Kl, N, device="cuda", dtype=bf)
        part = torch.empty(M, N, device="cuda", dtype=bf)
        res = torch.empty(M // W, N, device="cuda", dtype=bf)
        torch.matmul(a, b, out=part)
        dist.reduce_scatter_tensor(res, part)
        ref = res.clone()
        ours_out = torch.empty(M // W, N, device="cuda", dtype=bf)
        t_gemm, _ = measure(tag, "gemm", lambda: torch.matmul(a, b, out=part), calls=args.calls)
        t_bulk, _ = measure(tag, "bulk", lambda: (torch.matmul(a, b, out=part), dist.reduce_scatter_tensor(res, part)),
                            calls=args.calls)
        t, errs, notes = ours_and_symm(tag, nd.matmul_reduce_scatter, a, b, ours_out, ref,
                                       lambda: torch.ops.symm_mem.fused_matmul_reduce_scatter(a, b, "sum", 0, group))
        ctx.check("matmul_reduce_scatter")
        link = (W - 1) * (M // W) * N * 2 / bw * 1e3
        return _row("matmul_reduce_scatter", f"M={M} K_local={Kl} N={N}", W, 2 * M * N * Kl, t_gemm, t_bulk,
                    t["symm_mem"], t["fused"], t["ce"], t["nocomm"], link, max(errs, default=nan),
                    "; ".join(x for x in notes if x), host_us=t.get("host_us", nan))

    # ------------------------------------------------------------------ distributed decode
    local_decode = default_local_decode()

    def dec_row(B, S):
        try:
            return _decode_row(B, S, W, ctx, measure, local_decode, rel, out)
        except torch.cuda.OutOfMemoryError as e:   # same sizes everywhere: every rank gets here
            return dict(op="flash_decode_distributed", shape=f"B={B} ctx={S // 1024}k", world=W,
                        note=f"out of memory: {str(e)[:100]}")
        finally:
            torch.cuda.empty_cache()

    # cheapest and most important first: the small shape of every op, then the larger ones
    jobs = []
    lists = [[("ag", ag_row, s) for s in ag_shapes] if "ag" in only else [],
             [("rs", rs_row, s) for s in rs_shapes] if "rs" in only else [],
             [("decode", dec_row, s) for s in dec_shapes] if "decode" in only else []]
    for i in range(max(map(len, lists), default=0)):
        jobs += [lst[i] for lst in lists if i < len(lst)]
    for kind, fn, shape in jobs:
        label = f"{kind} {shape}"
        out.say(f"== {label}")
        with dog.limit(label, args.shape_timeout):
            out.add(fn(*shape))
    if R == 0:
        write_results("distributed", out.rows, columns=COLS, gpus=W,
                      meta=dict(world=W, remote_store_GBps=bw / 1e9, cublas_TFLOPs=rate / 1e12,
                                spin_ns=ctx.spin_ns, iters=args.iters, warmup=args.warmup, methods=methods,
                                gemm_calls_per_sample=args.calls))
    with dog.limit("teardown", 120):
        dist.barrier()
        dist.destroy_process_group()
    return 0


def _decode_row(B, S, W, ctx, measure, local_decode, rel, out):
    import torch
    import torch.distributed as dist

    import numasched.distributed as nd

    bf = torch.bfloat16
    tag = f"flash_decode_distributed B={B} ctx={S // 1024}k"
    Sl = S // W
    q = torch.randn(B, H, D, device="cuda", dtype=bf)
    kw = torch.randn(B, S, HK, D, device="cuda", dtype=bf)   # the whole context, for "single"
    vw = torch.randn(B, S, HK, D, device="cuda", dtype=bf)
    k, v = kw[:, :Sl], vw[:, :Sl]                            # this rank's part: a view, no copy
    lens = torch.full((B,), Sl, device="cuda", dtype=torch.int32)
    lens_w = torch.full((B,), S, device="cuda", dtype=torch.int32)
    packed = torch.empty(W, B, H, D + 1, device="cuda", dtype=torch.float32)

    def bulk():
        o, l = local_decode(q, k, v, lens)
        mine = torch.cat([o.float(), l[..., None]], -1)
        dist.all_gather_into_tensor(packed, mine[None])
        lse = packed[..., D]
        m = lse.amax(0)
        w = torch.exp(lse - m)
        return ((packed[..., :D] * w[..., None]).sum(0) / w.sum(0)[..., None]).to(bf)

    ref = bulk()
    ours_out = torch.empty(B, H, D, device="cuda", dtype=bf)
    err = rel(nd.flash_decode_distributed(q, k, v, lens, ctx=ctx, out=ours_out), ref)
    out.say(f"  {tag}: rel. error {err:.2e}")
    # decode has no gemm/symm_mem/ce; "bulk" and "fused" select its baseline and ours
    t_bulk, _ = measure(tag, "bulk", bulk)
    ours = lambda: nd.flash_decode_distributed(q, k, v, lens, ctx=ctx, out=ours_out, check=False)  # noqa: E731
    t_ours, e_ours = measure(tag, "fused", ours, show="ours")
    t_noc, _ = measure(tag, "nocomm", lambda: nd.flash_decode_distributed(q, k, v, lens, ctx=ctx, out=ours_out,
                                                                         check=False, communicate=False))
    # the local part alone, and one GPU decoding the whole context ("gemm" in --methods selects both)
    t_local, _ = measure(tag, "gemm", lambda: local_decode(q, k, v, lens), show="local decode")
    t_single, _ = measure(tag, "gemm", lambda: local_decode(q, kw, vw, lens_w), show="single GPU")
    # the same three as CUDA-graph replays (what a serving engine's decode step costs: no host
    # launch overhead, which dominates the eager figures at small batch)
    graphs = _capture_all({"bulk": bulk, "ours": ours, "single": lambda: local_decode(q, kw, vw, lens_w)})
    g = {name: (measure(tag, "fused" if name == "ours" else "gemm" if name == "single" else name, fn,
                        show=f"{name} (CUDA graph)")[0] if fn else float("nan"))
         for name, fn in graphs.items()}
    ctx.check("flash_decode_distributed")
    return dict(op="flash_decode_distributed", shape=f"B={B} ctx={S // 1024}k", world=W,
                single_ms=t_single, bulk_ms=t_bulk, ours_ms=t_ours, fused_ms=t_ours, nocomm_ms=t_noc,
                local_decode_ms=t_local, x_vs_bulk=t_bulk / t_ours, x_vs_single=t_single / t_ours,
                graph_single_ms=g["single"], graph_bulk_ms=g["bulk"], graph_ours_ms=g["ours"],
                graph_x_vs_bulk=g["bulk"] / g["ours"], graph_x_vs_single=g["single"] / g["ours"],
                target="x_vs_bulk>=1.2" + (", x_vs_single>=1.7" if S >= 262144 else ""),
                err_vs_bulk=err, note=e_ours)


def _capture_all(fns: dict) -> dict:
    """name -> the replay of a CUDA graph holding one call of fns[name], or None where capture failed
    on any rank (every rank then skips it: the replays contain collectives)."""
    import torch
    import torch.distributed as dist

    def everywhere(ok: bool) -> bool:   # one all-reduce on every path: ranks stay in step
        flag = torch.tensor([1.0 if ok else 0.0], device="cuda")
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        return float(flag) == 1.0

    from .common import capture, warm_up_for_capture

    out = {}
    for name, fn in fns.items():
        graph, ok = None, True
        try:
            warm_up_for_capture(fn)
        except Exception as e:  # noqa: BLE001 - reported, and the row shows NaN
            print(f"  {name}: warm-up before capture failed: {type(e).__name__}: {str(e)[:120]}", flush=True)
            ok = False
        if everywhere(ok):
            try:
                graph = capture(fn)
            except Exception as e:  # noqa: BLE001
                print(f"  {name}: CUDA graph capture failed: {type(e).__name__}: {str(e)[:120]}", flush=True)
                ok = False
            ok = everywhere(ok)
        else:
            ok = False
        out[name] = graph.replay if ok and graph is not None else None
    return out


def _row(op, shape, W, flops, t_gemm, t_bulk, t_symm, t_fused, t_ce, t_noc, link, err, note,
         host_us=float("nan")):
    """Ratios use the better of our two implementations (best_impl says which)."""
    import math

    t_lb = max(t_gemm, link)
    best, t_ours = min((("fused", t_fused), ("ce", t_ce)), key=lambda x: math.inf if math.isnan(x[1]) else x[1])
    return dict(op=op, shape=shape, world=W, gemm_ms=t_gemm, bulk_ms=t_bulk, symm_mem_ms=t_symm, fused_ms=t_fused,
                ce_ms=t_ce, best_impl=best, ours_ms=t_ours, nocomm_ms=t_noc, link_ms=link, T_lb_ms=t_lb,
                ours_over_T_lb=t_ours / t_lb, x_vs_bulk=t_bulk / t_ours, x_vs_symm_mem=t_symm / t_ours,
                fused_over_nocomm=t_fused / t_noc, fused_host_us=host_us,
                ours_TFLOPs=flops / (t_ours * 1e-3) / 1e12, err_vs_bulk=err,
                target="x_vs_bulk>=1, x_vs_symm_mem>=1, ours_over_T_lb<=1.05", note=note)


def _enable_symm_mem(group_name) -> bool:
    try:
        from torch.distributed import _symmetric_memory as symm_mem

        if hasattr(symm_mem, "enable_symm_mem_for_group"):
            symm_mem.enable_symm_mem_for_group(group_name)
        return True
    except Exception as e:  # noqa: BLE001
        print(f"torch symmetric memory unavailable: {e}")
        return False


# ============================================================================ Iris's own ops
def _iris_ops_worker(args) -> int:
    """Iris's fused ops on the same sizes (its all_gather_matmul gathers A along K; same bytes and
    FLOPs as ours). Each op runs once for correctness-free timing; a hang is cut by the launcher."""
    import torch
    import torch.distributed as dist

    import numasched.distributed as nd

    from .common import write_results

    R, W = _setup()
    ctx = nd.init(heap_bytes=8 << 30, timeout_s=60.0)
    ir = ctx.iris
    timed = _timer(args)
    rows = []

    def save():
        if R == 0:
            write_results("distributed_iris_ops", rows, meta=dict(world=W), gpus=W)

    ag_shapes, rs_shapes, _ = _shapes(True, W)
    import iris.ops as iops

    for M, K, N in ag_shapes[:1]:
        try:
            a = ir.randn(M, K // W, dtype=torch.bfloat16)
            b = torch.randn(K, N, device="cuda", dtype=torch.bfloat16)
            out = ir.zeros(M, N, dtype=torch.bfloat16)
            ms, err = timed(lambda: iops.all_gather_matmul(ir, out, a, b))
        except Exception as e:  # noqa: BLE001
            ms, err = float("nan"), f"{type(e).__name__}: {str(e)[:200]}"
        rows.append(dict(op="iris all_gather_matmul (K-sharded A)", shape=f"M={M} K={K} N_local={N}", ms=ms, note=err))
        save()
    for M, Kl, N in rs_shapes[:1]:
        try:
            a = ir.randn(M, Kl, dtype=torch.bfloat16)
            b = ir.randn(Kl, N, dtype=torch.bfloat16)
            out = ir.zeros(M, N, dtype=torch.bfloat16)
            ms, err = timed(lambda: iops.matmul_reduce_scatter(ir, out, a, b))
        except Exception as e:  # noqa: BLE001
            ms, err = float("nan"), f"{type(e).__name__}: {str(e)[:200]}"
        rows.append(dict(op="iris matmul_reduce_scatter", shape=f"M={M} K_local={Kl} N={N}", ms=ms, note=err))
        save()
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
