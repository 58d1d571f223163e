"""``numasched simulate``: compare mapping policies for one kernel on one GPU topology.

    numasched simulate --gpu mi300x --kernel attention --batch 1 --heads 128 --kv-heads 128 \
        --seq 32768 --head-dim 128 --mapping all
    numasched simulate --kernel decode --heads 64 --kv-heads 8 --seq 131072 --splits 16 --json
    numasched simulate --kernel gemm --m 8192 --n 8192 --k 8192 --mapping all --plot gemm.png
"""
from __future__ import annotations

import argparse
import json
import sys


def add_parser(subparsers):
    p = subparsers.add_parser("simulate", help="L2 simulator: hit rates, traffic and time per mapping policy",
                              description=__doc__.split("\n\n")[0],
                              formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--gpu", default="mi300x", help="topology preset (numasched.topology.PRESETS)")
    p.add_argument("--kernel", choices=("attention", "decode", "gemm"), default="attention")
    p.add_argument("--mapping", default="all",
                   help="'all', 'auto', a policy name, or a comma-separated list of names")
    a = p.add_argument_group("attention / decode")
    a.add_argument("--batch", type=int, default=1)
    a.add_argument("--heads", type=int, default=32)
    a.add_argument("--kv-heads", type=int, default=None, help="default: --heads")
    a.add_argument("--seq", type=int, default=8192, help="query and key length (decode: key length)")
    a.add_argument("--seq-k", type=int, default=None, help="key length if it differs from --seq")
    a.add_argument("--head-dim", type=int, default=128)
    a.add_argument("--causal", action="store_true")
    a.add_argument("--splits", type=int, default=16, help="decode: splits of the key range")
    g = p.add_argument_group("gemm")
    g.add_argument("--m", type=int, default=8192)
    g.add_argument("--n", type=int, default=8192)
    g.add_argument("--k", type=int, default=8192)
    t = p.add_argument_group("tiles and machine")
    t.add_argument("--tile", default=None, help="tile sizes MxN or MxNxK (overrides --block-*)")
    t.add_argument("--block-m", type=int, default=128)
    t.add_argument("--block-n", type=int, default=None, help="default 64 (attention/decode), 128 (gemm)")
    t.add_argument("--block-k", type=int, default=64)
    t.add_argument("--dtype-bytes", type=int, default=2)
    t.add_argument("--occupancy", type=int, default=1, help="workgroups resident per compute unit")
    t.add_argument("--llc-ways", type=int, default=16, help="assumed last-level cache associativity")
    t.add_argument("--jitter", type=float, default=0.0,
                   help="relative spread of workgroup speeds (0: lockstep; 0.2 models strong drift)")
    t.add_argument("--skew", type=int, default=0,
                   help="largest random start delay of a workgroup after its slot frees, in steps")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--set-hash", choices=("auto", "xor", "none"), default="auto",
                   help="set index: XOR-folded address or line mod sets (auto: xor for power-of-two set counts)")
    t.add_argument("--tflops", type=float, default=None,
                   help="matrix peak for the compute term (default: datasheet figure of --gpu; 0: none)")
    o = p.add_argument_group("output")
    o.add_argument("--json", action="store_true", help="print a JSON list (one object per mapping)")
    o.add_argument("--plot", default=None, metavar="FILE.png", help="draw the comparison")
    o.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=run)
    return p


def build_model(args):
    from .models import AttentionModel, DecodeModel, GemmModel

    bm, bn, bk = args.block_m, args.block_n, args.block_k
    if args.tile:
        try:
            parts = [int(x) for x in args.tile.lower().split("x")]
        except ValueError:
            raise ValueError(f"--tile must look like 128x64 or 128x128x64, got {args.tile!r}") from None
        if len(parts) not in (2, 3):
            raise ValueError(f"--tile must look like 128x64 or 128x128x64, got {args.tile!r}")
        bm, bn = parts[:2]
        if len(parts) == 3:
            bk = parts[2]
    kvh = args.kv_heads if args.kv_heads is not None else args.heads
    if args.kernel == "attention":
        return AttentionModel(args.batch, args.heads, kvh, args.seq, args.seq_k or args.seq, args.head_dim,
                              bm, bn or 64, bool(args.causal), args.dtype_bytes)
    if args.kernel == "decode":
        return DecodeModel(args.batch, args.heads, kvh, args.seq_k or args.seq, args.head_dim, args.splits,
                           bn or 64, args.dtype_bytes)
    return GemmModel(args.m, args.n, args.k, bm, bn or 128, bk, args.dtype_bytes)


def policies_for(mapping: str, kernel: str):
    from .. import mappings as M

    kind = "gemm" if kernel == "gemm" else "attention"
    if mapping == "all":
        return M.available(kind)
    names = [m.strip() for m in mapping.split(",") if m.strip()]
    if not names:
        raise ValueError("--mapping is empty")
    for n in names:
        if n != "auto":
            p = M.get(n)
            if p.kind != kind:
                raise ValueError(f"--mapping {n!r} is a {p.kind} policy; --kernel {kernel} needs one of "
                                 f"{M.available(kind)}")
    return names


def simulate_all(topology, model, names, *, occupancy=1, llc_ways=16, jitter=0.0, skew=0, seed=0,
                 peak_flops=None, set_hash="auto", progress=True):
    from rich.console import Console
    from rich.progress import Progress

    from .core import simulate

    results = []
    bar = Progress(console=Console(stderr=True), transient=True, disable=not progress)
    with bar:
        for name in names:
            results.append(simulate(topology, model, name, occupancy=occupancy, llc_ways=llc_ways, jitter=jitter,
                                    skew=skew, seed=seed, peak_flops=peak_flops, set_hash=set_hash,
                                    progress=bar))
    return results


def table(results, title=""):
    from rich.table import Table

    worst = max(r.time_s for r in results) or 1.0
    tb = Table(title=title)
    for c in ("mapping", "L2 hit", "L2 hit min..max", "LLC hit", "HBM GB", "LLC GB", "L2 GB", "balance",
              "time ms", "bound", "speedup"):
        tb.add_column(c, justify="left" if c in ("mapping", "bound") else "right")
    for r in results:
        per = r.l2_hit_rate_per_domain
        tb.add_row(r.mapping, f"{100 * r.l2_hit_rate:.1f}%", f"{100 * min(per):.0f}..{100 * max(per):.0f}%",
                   f"{100 * r.llc_hit_rate:.1f}%", f"{r.hbm_bytes / 1e9:.2f}", f"{r.llc_bytes / 1e9:.2f}",
                   f"{r.l2_bytes / 1e9:.2f}", f"{r.work_balance:.2f}", f"{1e3 * r.time_s:.3f}", r.bottleneck,
                   f"{worst / r.time_s:.2f}x" if r.time_s else "-")
    return tb


def plot(results, path, title=""):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r.mapping for r in results]
    fig, ax = plt.subplots(1, 3, figsize=(4 + 2.2 * len(names), 4))
    ax[0].bar(names, [100 * r.l2_hit_rate for r in results], color="tab:blue")
    ax[0].set_ylabel("L2 hit rate (%)")
    ax[0].set_ylim(0, 100)
    bottom = [0.0] * len(results)
    for label, key, col in (("L2", "l2_bytes", "tab:green"), ("LLC", "llc_bytes", "tab:orange"),
                            ("HBM", "hbm_bytes", "tab:red")):
        vals = [getattr(r, key) / 1e9 for r in results]
        ax[1].bar(names, vals, bottom=bottom, label=label, color=col)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax[1].set_ylabel("bytes served (GB)")
    ax[1].legend()
    ax[2].bar(names, [1e3 * r.time_s for r in results], color="tab:purple")
    ax[2].set_ylabel("predicted time (ms)")
    for a in ax:
        a.tick_params(axis="x", rotation=30)
        for lab in a.get_xticklabels():
            lab.set_horizontalalignment("right")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run(args) -> int:
    from rich.console import Console

    from ..topology import Topology

    try:
        topo = Topology.preset(args.gpu)
        model = build_model(args)
        names = policies_for(args.mapping, args.kernel)
        peak = None if args.tflops is None else args.tflops * 1e12
        results = simulate_all(topo, model, names, occupancy=args.occupancy, llc_ways=args.llc_ways,
                               jitter=args.jitter, skew=args.skew, seed=args.seed, peak_flops=peak, set_hash=args.set_hash,
                               progress=not args.no_progress and sys.stderr.isatty())
    except ValueError as e:
        print(f"numasched simulate: error: {e}", file=sys.stderr)
        return 2
    title = f"{topo.name}: {model.describe()}, occupancy {args.occupancy}" + (
        f", jitter {args.jitter}" if args.jitter else "") + (f", skew {args.skew}" if args.skew else "")
    if args.json:
        print(json.dumps([r.to_dict() for r in results], indent=1))
    else:
        con = Console()
        if not con.is_terminal:
            con = Console(width=160)
        con.print(table(results, title))
    if args.plot:
        plot(results, args.plot, title)
        if not args.json:
            print(f"wrote {args.plot}")
    return 0
