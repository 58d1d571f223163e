"""Why a decode call replayed from a CUDA graph ran 7-9 % slower than the same call launched
eagerly (pages of 16, 128 x 32k, 64/8 and 32/8 heads: bench/results/README.md, fourteenth session).

Builds one paged case, prints the plan, then times eager calls and graph replays alternately
(triton's do_bench, as `bench decode` does, and back-to-back calls without the L2 flush), and
with --calls 1 runs each mode a few times for Nsight Compute (`ncu --graph-profiling node`), so
the one kernel can be compared launch by launch. Run:
    python scripts/decode_graph_probe.py --heads 64/8 --batch 128 --ctx 32768 --page 16
(--layout blhd / bhld for the contiguous cache; NUMASCHED_PDL=0 in the environment for launches
without programmatic dependent launch).
"""
from __future__ import annotations

import argparse


def main(argv=None) -> int:
    import torch

    import numasched
    from numasched.bench.common import bench_fixed_ms, bench_ms, capture, warm_up_for_capture
    from numasched.bench.decode import _paged_cache

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--heads", default="64/8")
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--ctx", type=int, default=32768)
    p.add_argument("--page", type=int, default=16)
    p.add_argument("--layout", choices=("paged", "blhd", "bhld"), default="paged",
                   help="paged (pages of --page), contiguous (B, L, HK, D), or the (B, HK, L, D) view")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--profile", action="store_true", help="only a few launches of each mode (under ncu)")
    args = p.parse_args(argv)
    H, HK = (int(v) for v in args.heads.split("/"))
    B, L, D, dev, dt = args.batch, args.ctx, 128, torch.device("cuda"), torch.bfloat16
    torch.manual_seed(0)
    if args.layout == "paged":
        kp, vp, bt = _paged_cache(B, L, args.page, HK, D, dev, dt)
    elif args.layout == "blhd":
        kp = torch.randn(B, L, HK, D, device=dev, dtype=dt)
        vp = torch.randn(B, L, HK, D, device=dev, dtype=dt)
        bt = None
    else:
        kp = torch.randn(B, HK, L, D, device=dev, dtype=dt).transpose(1, 2)
        vp = torch.randn(B, HK, L, D, device=dev, dtype=dt).transpose(1, 2)
        bt = None
    q = torch.randn(B, H, D, device=dev, dtype=dt)
    lens = torch.full((B,), L, dtype=torch.int32, device=dev)
    plan = numasched.plan_decode(q, kp, vp, cache_seqlens=lens, block_table=bt)
    print(args.layout, args.heads, {k: getattr(plan, k, None) for k in ("num_splits", "combine", "config", "grid",
                                                                        "prefetch_tokens")}, flush=True)
    # as bench decode times it: without the range checks of cache_seqlens and block_table (a host sync)
    numasched.options.set(check_data=False)
    fn = lambda: numasched.flash_decode(q, kp, vp, cache_seqlens=lens, block_table=bt)  # noqa: E731
    fn()
    torch.cuda.synchronize()
    warm_up_for_capture(fn, 2)
    graph = capture(fn)
    if args.profile:
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        for _ in range(3):
            graph.replay()
        torch.cuda.synchronize()
        print("profiled: 3 eager, 3 replays", flush=True)
        return 0
    gb = 2 * B * L * HK * D * 2 / 1e9
    for r in range(args.rounds):
        te = bench_ms(fn, warmup=10, rep=100)
        tg = bench_ms(graph.replay, warmup=10, rep=100)
        fe = bench_fixed_ms(fn, warmup=3, iters=20, calls=5)
        fg = bench_fixed_ms(graph.replay, warmup=3, iters=20, calls=5)
        print(f"round {r}: do_bench eager {te * 1e3:.0f} us, graph {tg * 1e3:.0f} us ({tg / te:.3f}); "
              f"back to back eager {fe * 1e3:.0f}, graph {fg * 1e3:.0f} ({fg / fe:.3f}); "
              f"{gb / (te * 1e-3):.0f} / {gb / (tg * 1e-3):.0f} GB/s", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
