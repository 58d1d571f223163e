"""``numasched bench gemm``: numasched.matmul vs cuBLAS (torch.matmul), side by side in one run.

Shapes: square 2048/4096/8192 and Llama-3 projection GEMMs at M = 16384 tokens (8B: fused QKV,
fused gate+up, down; 70B: o_proj, gate (TP=2 half of gate+up), down (TP=2 half of K)).

For each shape: cuBLAS and our kernel under each mapping policy (grouped, chiplet_tiled,
row_major by default), plus our kernel forced persistent / non-persistent (grouped). The first
call at a shape autotunes (config and, with persistent=None, persistence); the other policies
reuse that config (the tuning key has no policy), so policy columns differ only by tile order.

Times are medians. The main columns time both sides inside CUDA graphs (``do_bench_cudagraph``:
kernel time without Python launch cost); ``*_eager_ms`` columns time plain calls, which include
the host overhead (it matters only below ~4096^3). Reported: TFLOP/s, ratio cuBLAS time / ours
(>1 = ours faster), fraction of the measured cuBLAS 8192^3 rate, rel. error vs cuBLAS (by norm).
"""
from __future__ import annotations

import argparse
import math

SQUARE = [2048, 4096, 8192]
M_TOKENS = 16384
LLAMA = [  # (name, N, K)
    ("llama3-8b qkv", 6144, 4096),
    ("llama3-8b gate_up", 28672, 4096),
    ("llama3-8b down", 4096, 14336),
    ("llama3-70b o_proj", 8192, 8192),
    ("llama3-70b gate tp2", 14336, 8192),
    ("llama3-70b down tp2", 8192, 14336),
]
QUICK = [("square 4096", 4096, 4096, 4096), ("square 8192", 8192, 8192, 8192),
         ("llama3-70b gate tp2", M_TOKENS, 14336, 8192)]
DEFAULT_POLICIES = ["grouped", "chiplet_tiled", "row_major"]


def _shape_list(text: str) -> list:
    """argparse type of --shapes: comma-separated MxNxK, as (label, M, N, K)."""
    from numasched.argtypes import shape_list

    return [(f"{m}x{n}x{k}", m, n, k) for m, n, k in shape_list(text)]


def _policy_list(text: str) -> list:
    """argparse type of --policies: comma-separated registered GEMM policies."""
    from numasched import mappings as M

    names = [x.strip() for x in text.split(",") if x.strip()]
    bad = [x for x in names if x not in M.available("gemm")]
    if not names or bad:
        raise argparse.ArgumentTypeError(f"expected comma-separated GEMM policies from "
                                         f"{', '.join(M.available('gemm'))}, got {text!r}")
    return names


def _shapes(args) -> list:
    if args.shapes:
        return list(args.shapes)
    if args.quick:
        return list(QUICK)
    return [(f"square {n}", n, n, n) for n in SQUARE] + [(name, M_TOKENS, n, k) for name, n, k in LLAMA]


def _time(fn, graph: bool) -> float:
    import triton.testing

    from .common import bench_ms

    if graph:
        return float(triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median"))
    return bench_ms(fn)


def _plot(rows, path):
    import matplotlib.pyplot as plt
    from .common import save_plot

    names = [r["shape"] for r in rows]
    x = range(len(rows))
    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(rows)), 4))
    ax.bar([i - 0.2 for i in x], [r["cublas_tflops"] for r in rows], width=0.4, label="cuBLAS")
    ax.bar([i + 0.2 for i in x], [r["ours_tflops"] for r in rows], width=0.4, label="numasched (best policy)")
    ax.set_xticks(list(x))
    ax.set_xticklabels(names, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("TFLOP/s")
    ax.legend()
    fig.tight_layout()
    save_plot(fig, path)
    plt.close(fig)


def build_parser() -> argparse.ArgumentParser:
    from numasched.argtypes import out_dir

    p = argparse.ArgumentParser(prog="numasched bench gemm", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="3 shapes (4096^3, 8192^3, 16384x14336x8192)")
    p.add_argument("--shapes", type=_shape_list, default=None,
                   help="comma-separated MxNxK list (overrides the default grid)")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp16"], help="operand and output dtype")
    p.add_argument("--policies", type=_policy_list, default=list(DEFAULT_POLICIES),
                   help=f"comma-separated GEMM policies (default {','.join(DEFAULT_POLICIES)})")
    p.add_argument("--no-graph", action="store_true", help="time plain calls only (no CUDA graphs)")
    p.add_argument("--no-persistent-split", action="store_true", help="skip the forced persistent/non-persistent runs")
    p.add_argument("--out-dir", type=out_dir, default=None, help="results folder (default: see numasched.bench.common)")
    p.add_argument("--dry-run", action="store_true",
                   help="print the shapes and contenders and exit (no GPU needed, nothing timed)")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    policies = list(args.policies)
    if args.dry_run:
        from .common import print_plan

        contenders = ["cuBLAS (torch.matmul)"] + [f"numasched.matmul mapping={p}" for p in policies]
        if not args.no_persistent_split:
            contenders += [f"numasched.matmul mapping={policies[0]} persistent=True / False"]
        contenders += ["timed in CUDA graphs, plus eager calls"] if not args.no_graph else ["eager calls"]
        return print_plan("gemm", [f"{label}: M={m} N={n} K={k} {args.dtype}" for label, m, n, k in _shapes(args)],
                          contenders)
    from .common import check_runnable

    if (rc := check_runnable("gemm")) is not None:
        return rc
    import torch

    import numasched

    from .common import matmul_rate, progress, write_results

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    graph = not args.no_graph
    ref_rate = matmul_rate(8192)  # FLOP/s, measured cuBLAS bf16 8192^3
    shapes = _shapes(args)
    rows = []
    for label, m, n, k in progress(shapes, "gemm shapes"):
        torch.manual_seed(0)
        a = torch.randn(m, k, device="cuda", dtype=dtype)
        b = torch.randn(k, n, device="cuda", dtype=dtype)
        flop = 2.0 * m * n * k
        tflops = lambda ms: flop / (ms * 1e-3) / 1e12  # noqa: E731
        ref = torch.matmul(a, b)
        cublas_ms = _time(lambda: torch.matmul(a, b), graph)
        cublas_eager = _time(lambda: torch.matmul(a, b), False) if graph else cublas_ms
        row = dict(shape=label, M=m, N=n, K=k, cublas_ms=cublas_ms, cublas_tflops=tflops(cublas_ms))

        out = torch.empty(m, n, device="cuda", dtype=dtype)
        per_policy = {}
        info = None
        for pol in policies:
            numasched.matmul(a, b, mapping=pol, out=out)  # autotunes on the first policy
            torch.cuda.synchronize()
            if info is None:
                # the plan of that call (the autotuner's choice is cached: this plan reuses it)
                info = numasched.plan_matmul(a, b, out, mapping=pol)
                info.run(a, b, out)
                torch.cuda.synchronize()
                err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
            per_policy[pol] = _time(lambda: numasched.matmul(a, b, mapping=pol, out=out), graph)
            row[f"{pol}_ms"] = per_policy[pol]
        best = min(per_policy, key=per_policy.get)
        ours_ms = per_policy[best]
        row.update(ours_ms=ours_ms, ours_tflops=tflops(ours_ms), best_policy=best, ratio=cublas_ms / ours_ms,
                   frac_cublas8192=tflops(ours_ms) * 1e12 / ref_rate)
        if not args.no_persistent_split:
            for flag, col in ((True, "persistent_ms"), (False, "nonpersistent_ms")):
                numasched.matmul(a, b, mapping=policies[0], persistent=flag, out=out)
                row[col] = _time(lambda: numasched.matmul(a, b, mapping=policies[0], persistent=flag, out=out), graph)
        row["ours_eager_ms"] = _time(lambda: numasched.matmul(a, b, mapping=best, out=out), False) if graph else ours_ms
        row["cublas_eager_ms"] = cublas_eager
        cfg = info.config
        row.update(path=info.path, persistent=info.persistent,
                   config=f"{cfg['BLOCK_M']}x{cfg['BLOCK_N']}x{cfg['BLOCK_K']} w{cfg['num_warps']} s{cfg['num_stages']}"
                          + (" sub" if cfg.get("EPILOGUE_SUBTILE") else ""),
                   rel_err=err)
        rows.append(row)
        del a, b, ref, out
        torch.cuda.empty_cache()

    cols = (["shape", "M", "N", "K", "cublas_tflops", "ours_tflops", "ratio", "frac_cublas8192", "best_policy"]
            + [f"{p}_ms" for p in policies] + ["cublas_ms"]
            + ([] if args.no_persistent_split else ["persistent_ms", "nonpersistent_ms"])
            + ["ours_eager_ms", "cublas_eager_ms", "path", "persistent", "config", "rel_err"])
    geo = math.exp(sum(math.log(r["ratio"]) for r in rows) / len(rows))
    meta = dict(cublas_8192_tflops=ref_rate / 1e12, dtype=args.dtype, timing="cudagraph" if graph else "eager",
                geomean_ratio=geo, target_ratio=0.95)
    write_results("gemm", rows, columns=cols, plot=_plot, out_dir=args.out_dir, meta=meta)
    print(f"measured cuBLAS 8192^3: {ref_rate / 1e12:.0f} TFLOP/s; geometric-mean ratio cuBLAS/ours "
          f"{geo:.3f} (target >= 0.95); timing: {meta['timing']}")
    bad = [r["shape"] for r in rows if not r["rel_err"] < 1e-2]
    if bad:
        print(f"WARNING: relative error >= 1e-2 vs cuBLAS for {bad}")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
