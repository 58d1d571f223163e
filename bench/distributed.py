"""``numasched bench distributed``: fused cross-GPU kernels vs bulk-synchronous NCCL and torch
symmetric memory, side by side in one run (needs 2+ GPUs with NVLink; launches torchrun itself).

    numasched bench distributed [--quick] [--nproc N] [--only ag,rs,decode] [--iris-ops]
    # or by hand:  NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 \\
    #              torchrun --nproc-per-node 2 -m numasched.bench.distributed [--quick]

Per shape, every method runs the same fixed number of iterations on every rank (CUDA events;
an adaptive timer can deadlock collectives) and the slowest rank's median counts.

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
Targets: ours no slower than bulk and symm_mem everywhere and within 5% of T_lb; decode >= 1.2x
bulk and >= 1.7x single at >= 256k context. ``--iris-ops`` also tries Iris's own fused ops
(ctx.ops-style, time-limited in a separate torchrun; failures are reported, not fatal).
Results: bench/results/distributed-<gpu>-<date>.csv/.json (+ distributed_iris_ops-...).
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys

ENV = dict(NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NUMASCHED_CHECK_DATA="0")
H, HK, D = 32, 8, 128


def _parser():
    p = argparse.ArgumentParser(prog="numasched bench distributed", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="small grid (well under a minute of GPU time)")
    p.add_argument("--nproc", type=int, default=0, help="GPUs to use (default: all visible)")
    p.add_argument("--only", default="ag,rs,decode", help="comma-separated subset of ag, rs, decode")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--iris-ops", action="store_true", help="also try Iris's own fused ops (separate, time-limited)")
    p.add_argument("--iris-timeout", type=int, default=240, help="seconds allowed for the Iris-ops run")
    p.add_argument("--worker", default="", help=argparse.SUPPRESS)
    return p


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = _parser().parse_args(argv)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return _iris_ops_worker(args) if args.worker == "iris-ops" else _worker(args)
    return _launch(args, argv)


# ============================================================================ launcher
def _launch(args, argv) -> int:
    import torch

    n = args.nproc or (torch.cuda.device_count() if torch.cuda.is_available() else 0)
    cmd_hint = ("NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 torchrun --nproc-per-node 2 "
                "-m numasched.bench.distributed [--quick]")
    if n < 2:
        print(f"numasched bench distributed needs 2+ GPUs (found {n}). On a multi-GPU machine run\n  {cmd_hint}")
        return 0
    env = dict(os.environ, **ENV)
    base = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={n}", "-m", "numasched.bench.distributed"]
    passthrough = [a for a in argv if a != "--iris-ops"]
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
def _setup():
    import datetime

    import torch
    import torch.distributed as dist

    for k, v in ENV.items():
        os.environ.setdefault(k, v)
    local = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", timeout=datetime.timedelta(seconds=300), device_id=torch.device("cuda", local))
    return dist.get_rank(), dist.get_world_size()


def _timer(args):
    import torch
    import torch.distributed as dist

    from .common import bench_fixed_ms

    def t(fn):
        """Slowest rank's median ms over a fixed count; None (and the reason) on failure."""
        try:
            torch.cuda.synchronize()
            dist.barrier()
            ms = bench_fixed_ms(fn, warmup=args.warmup, iters=args.iters)
            err = ""
        except Exception as e:  # noqa: BLE001 - a peer that does not run is reported, not fatal
            ms, err = float("nan"), f"{type(e).__name__}: {str(e)[:120]}"
        x = torch.tensor([ms], device="cuda")
        dist.all_reduce(x, op=dist.ReduceOp.MAX)
        return float(x), err
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


def _worker(args) -> int:
    import torch
    import torch.distributed as dist

    import numasched.distributed as nd

    from .common import matmul_rate, write_results

    R, W = _setup()
    only = set(args.only.split(","))
    ag_shapes, rs_shapes, dec_shapes = _shapes(args.quick, W)
    bf = torch.bfloat16
    meta = lambda *s: torch.empty(*s, device="meta", dtype=bf)  # noqa: E731
    workload = ([("all_gather_matmul", meta(M // W, K), meta(K, N), dict(impl=i))
                 for M, K, N in ag_shapes if "ag" in only for i in ("fused", "ce")]
                + [("matmul_reduce_scatter", meta(M, K), meta(K, N), dict(impl=i))
                   for M, K, N in rs_shapes if "rs" in only for i in ("fused", "ce")]
                + [("flash_decode_distributed", meta(B, H, D), meta(B, 1, HK, D)) for B, _ in dec_shapes])
    ctx = nd.init(heap_bytes=nd.required_heap_bytes(workload, W) + (600 << 20), timeout_s=60.0)
    timed = _timer(args)
    bw = _link_bandwidth(ctx)
    rate = matmul_rate()
    if R == 0:
        print(f"world {W}: remote-store bandwidth {bw / 1e9:.0f} GB/s per rank, cuBLAS bf16 {rate / 1e12:.0f} TFLOP/s, "
              f"{ctx.spin_ns:.0f} ns per flag poll", flush=True)
    rows = []
    group = dist.group.WORLD.group_name
    symm_ok = _enable_symm_mem(group)

    def rel(x, ref):
        return float(torch.linalg.vector_norm(x.float() - ref.float()) / torch.linalg.vector_norm(ref.float()))

    # ------------------------------------------------------------------ all-gather + GEMM
    for M, K, N in (ag_shapes if "ag" in only else []):
        Ml = M // W
        a = torch.randn(Ml, K, device="cuda", dtype=bf)
        b = torch.randn(K, N, device="cuda", dtype=bf)
        full = torch.empty(M, K, device="cuda", dtype=bf)
        out = torch.empty(M, N, device="cuda", dtype=bf)
        dist.all_gather_into_tensor(full, a)
        ref = full @ b
        t_gemm, _ = timed(lambda: torch.matmul(full, b, out=out))
        t_bulk, _ = timed(lambda: (dist.all_gather_into_tensor(full, a), torch.matmul(full, b, out=out)))
        t_symm, e_symm = (float("nan"), "symm_mem unavailable")
        if symm_ok:
            t_symm, e_symm = timed(lambda: torch.ops.symm_mem.fused_all_gather_matmul(a, [b], 0, group))
        ours_out = torch.empty(M, N, device="cuda", dtype=bf)
        err = rel(nd.all_gather_matmul(a, b, ctx=ctx, out=ours_out), ref)
        t_ours, e_ours = timed(lambda: nd.all_gather_matmul(a, b, ctx=ctx, out=ours_out, check=False))
        t_noc, _ = timed(lambda: nd.all_gather_matmul(a, b, ctx=ctx, out=ours_out, check=False, communicate=False))
        err_ce = rel(nd.all_gather_matmul(a, b, ctx=ctx, out=ours_out, impl="ce"), ref)
        t_ce, e_ce = timed(lambda: nd.all_gather_matmul(a, b, ctx=ctx, out=ours_out, check=False, impl="ce"))
        ctx.check("all_gather_matmul")
        link = (W - 1) * Ml * K * 2 / bw * 1e3
        rows.append(_row("all_gather_matmul", f"M={M} K={K} N_local={N}", W, 2 * M * N * K, t_gemm, t_bulk, t_symm,
                         t_ours, t_ce, t_noc, link, max(err, err_ce),
                         "; ".join(x for x in (e_symm, e_ours, e_ce) if x)))

    # ------------------------------------------------------------------ GEMM + reduce-scatter
    for M, Kl, N in (rs_shapes if "rs" in only else []):
        a = torch.randn(M, Kl, device="cuda", dtype=bf)
        b = torch.randn(Kl, N, device="cuda", dtype=bf)
        part = torch.empty(M, N, device="cuda", dtype=bf)
        res = torch.empty(M // W, N, device="cuda", dtype=bf)
        torch.matmul(a, b, out=part)
        dist.reduce_scatter_tensor(res, part)
        ref = res.clone()
        t_gemm, _ = timed(lambda: torch.matmul(a, b, out=part))
        t_bulk, _ = timed(lambda: (torch.matmul(a, b, out=part), dist.reduce_scatter_tensor(res, part)))
        t_symm, e_symm = (float("nan"), "symm_mem unavailable")
        if symm_ok:
            t_symm, e_symm = timed(lambda: torch.ops.symm_mem.fused_matmul_reduce_scatter(a, b, "sum", 0, group))
        ours_out = torch.empty(M // W, N, device="cuda", dtype=bf)
        err = rel(nd.matmul_reduce_scatter(a, b, ctx=ctx, out=ours_out), ref)
        t_ours, e_ours = timed(lambda: nd.matmul_reduce_scatter(a, b, ctx=ctx, out=ours_out, check=False))
        t_noc, _ = timed(lambda: nd.matmul_reduce_scatter(a, b, ctx=ctx, out=ours_out, check=False, communicate=False))
        err_ce = rel(nd.matmul_reduce_scatter(a, b, ctx=ctx, out=ours_out, impl="ce"), ref)
        t_ce, e_ce = timed(lambda: nd.matmul_reduce_scatter(a, b, ctx=ctx, out=ours_out, check=False, impl="ce"))
        ctx.check("matmul_reduce_scatter")
        link = (W - 1) * (M // W) * N * 2 / bw * 1e3
        rows.append(_row("matmul_reduce_scatter", f"M={M} K_local={Kl} N={N}", W, 2 * M * N * Kl, t_gemm, t_bulk,
                         t_symm, t_ours, t_ce, t_noc, link, max(err, err_ce),
                         "; ".join(x for x in (e_symm, e_ours, e_ce) if x)))

    # ------------------------------------------------------------------ distributed decode
    local_decode = nd._ops.default_local_decode()
    for B, S in (dec_shapes if "decode" in only else []):
        try:
            rows.append(_decode_row(B, S, W, ctx, timed, local_decode, rel))
        except torch.cuda.OutOfMemoryError as e:
            rows.append(dict(op="flash_decode_distributed", shape=f"B={B} ctx={S // 1024}k", world=W,
                             note=f"out of memory: {str(e)[:100]}"))
        torch.cuda.empty_cache()

    if R == 0:
        cols = ["op", "shape", "world", "gemm_ms", "single_ms", "local_decode_ms", "bulk_ms", "symm_mem_ms",
                "fused_ms", "ce_ms", "best_impl", "ours_ms", "nocomm_ms", "fused_over_nocomm", "link_ms", "T_lb_ms",
                "ours_over_T_lb", "x_vs_bulk", "x_vs_symm_mem", "x_vs_single", "ours_TFLOPs", "err_vs_bulk", "target",
                "note"]
        write_results("distributed", rows, columns=cols,
                      meta=dict(world=W, remote_store_GBps=bw / 1e9, cublas_TFLOPs=rate / 1e12,
                                spin_ns=ctx.spin_ns, iters=args.iters, warmup=args.warmup))
    dist.barrier()
    dist.destroy_process_group()
    return 0


def _decode_row(B, S, W, ctx, timed, local_decode, rel):
    import torch
    import torch.distributed as dist

    import numasched.distributed as nd

    bf = torch.bfloat16
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
    t_single, _ = timed(lambda: local_decode(q, kw, vw, lens_w))
    t_bulk, _ = timed(bulk)
    t_ours, e_ours = timed(lambda: nd.flash_decode_distributed(q, k, v, lens, ctx=ctx, out=ours_out, check=False))
    t_noc, _ = timed(lambda: nd.flash_decode_distributed(q, k, v, lens, ctx=ctx, out=ours_out, check=False,
                                                         communicate=False))
    t_local, _ = timed(lambda: local_decode(q, k, v, lens))
    ctx.check("flash_decode_distributed")
    row = dict(op="flash_decode_distributed", shape=f"B={B} ctx={S // 1024}k", world=W,
                     single_ms=t_single, bulk_ms=t_bulk, ours_ms=t_ours, nocomm_ms=t_noc, local_decode_ms=t_local,
                     x_vs_bulk=t_bulk / t_ours, x_vs_single=t_single / t_ours,
                     target="x_vs_bulk>=1.2" + (", x_vs_single>=1.7" if S >= 262144 else ""),
                     err_vs_bulk=err, note=e_ours)
    return row



def _row(op, shape, W, flops, t_gemm, t_bulk, t_symm, t_fused, t_ce, t_noc, link, err, note):
    """Ratios use the better of our two implementations (best_impl says which)."""
    import math

    t_lb = max(t_gemm, link)
    best, t_ours = min((("fused", t_fused), ("ce", t_ce)), key=lambda x: math.inf if math.isnan(x[1]) else x[1])
    return dict(op=op, shape=shape, world=W, gemm_ms=t_gemm, bulk_ms=t_bulk, symm_mem_ms=t_symm, fused_ms=t_fused,
                ce_ms=t_ce, best_impl=best, ours_ms=t_ours, nocomm_ms=t_noc, link_ms=link, T_lb_ms=t_lb,
                ours_over_T_lb=t_ours / t_lb, x_vs_bulk=t_bulk / t_ours, x_vs_symm_mem=t_symm / t_ours,
                fused_over_nocomm=t_fused / t_noc, ours_TFLOPs=flops / (t_ours * 1e-3) / 1e12, err_vs_bulk=err,
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
            write_results("distributed_iris_ops", rows, meta=dict(world=W))

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
