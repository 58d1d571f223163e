"""``numasched simulate``: compare mapping policies for one kernel on one GPU topology.

    numasched simulate --gpu mi300x --kernel attention --batch 1 --heads 128 --kv-heads 128 \
        --seq 32768 --head-dim 128 --mapping all
    numasched simulate --kernel decode --heads 64 --kv-heads 8 --seq 131072 --splits 16 --json
    numasched simulate --kernel gemm --m 8192 --n 8192 --k 8192 --mapping all --plot gemm.png
    numasched simulate --kernel decode --ragged --batch 32 --seq 16384 --heads 32 --kv-heads 8
"""
from __future__ import annotations

import argparse
import contextlib
import json
import sys


# The synchronisation model the CLI uses when neither --skew nor --jitter is given. Of the three
# models the report compares (lockstep, skew 32, jitter .2; numasched.sim.report and
# docs/simulator.md), skew 32 is the closest to the SHM paper's measured MI300X L2 hit rates over
# all the cases there (8K, 32K, causal 8K): lockstep over-counts sharing between concurrent
# workgroups (block_first 57% simulated vs ~1% measured), and jitter .2 matches at 8K but destroys
# swizzled_head_first's reuse at 32K (25% vs 90-96% measured).
DEFAULT_SKEW = 32


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows "(default: X)" only where there is a default to show (not None / False)."""

    def _get_help_string(self, action):
        if action.default is None or action.default is False:
            return action.help
        return super()._get_help_string(action)


def add_parser(subparsers):
    from ..argtypes import nonneg_int, plot_path, positive_int, unit_float, nonneg_float

    p = subparsers.add_parser("simulate", help="L2 simulator: hit rates, traffic and time per mapping policy",
                              description=__doc__.split("\n\n")[0],
                              formatter_class=_HelpFormatter)
    p.add_argument("--gpu", type=_preset, default="mi300x", help="topology preset (numasched.topology.PRESETS)")
    p.add_argument("--kernel", choices=("attention", "decode", "gemm"), default="attention",
                   help="kernel model: prefill attention forward, split-KV decode, or GEMM")
    p.add_argument("--mapping", default="all",
                   help="'all', 'auto', a policy name, or a comma-separated list of names")
    a = p.add_argument_group("attention / decode")
    a.add_argument("--batch", type=positive_int, default=1, help="sequences per call")
    a.add_argument("--heads", type=positive_int, default=32, help="query heads")
    a.add_argument("--kv-heads", type=positive_int, default=None, help="key/value heads (default: --heads)")
    a.add_argument("--seq", type=positive_int, default=8192, help="query and key length (decode: key length)")
    a.add_argument("--seq-k", type=positive_int, default=None, help="key length if it differs from --seq")
    a.add_argument("--head-dim", type=positive_int, default=128, help="head dimension")
    a.add_argument("--causal", action="store_true", help="attention: causal mask (bottom-right aligned)")
    a.add_argument("--splits", type=positive_int, default=None,
                   help="decode: splits of the key range (default 16; --ragged: the host's choice for the GPU)")
    r = p.add_argument_group("ragged decode (--kernel decode): the split kernel against the work-list kernel")
    r.add_argument("--ragged", action="store_true",
                   help="a ragged batch: --batch lengths drawn uniformly from [--seq/16, --seq] (seed --seed)")
    r.add_argument("--lengths", type=_lengths, default=None, metavar="L1,L2,...",
                   help="a ragged batch with these lengths (implies --ragged; --batch is ignored)")
    r.add_argument("--schedule", type=_schedules, default=None,
                   help="comma list of static (split kernel, --mapping order), worklist (work list, one queue "
                        "per domain), worklist1 (work list, one queue); default all three")
    r.add_argument("--programs", type=positive_int, default=None,
                   help="work-list programs (default: numasched.decode_worklist.PROGRAMS_PER_SM per CU)")
    g = p.add_argument_group("gemm")
    g.add_argument("--m", type=positive_int, default=8192, help="GEMM rows of A and C")
    g.add_argument("--n", type=positive_int, default=8192, help="GEMM columns of B and C")
    g.add_argument("--k", type=positive_int, default=8192, help="GEMM inner dimension")
    g.add_argument("--streamk", action="store_true",
                   help="beside each policy's data-parallel GEMM, the stream-K kernel with its pieces by program "
                        "id (the kernel), in the policy's domain-remap order and K-aligned (numasched/sim/streamk.py); "
                        "--programs: persistent programs (default one per CU)")
    t = p.add_argument_group("tiles and machine")
    t.add_argument("--tile", type=_tile, default=None, help="tile sizes MxN or MxNxK (overrides --block-*)")
    t.add_argument("--block-m", type=positive_int, default=128, help="tile rows (attention: query rows)")
    t.add_argument("--block-n", type=positive_int, default=None,
                   help="tile columns (attention/decode: keys per step); default 64 (attention/decode), 128 (gemm)")
    t.add_argument("--block-k", type=positive_int, default=64, help="gemm: tile depth per K step")
    t.add_argument("--dtype-bytes", type=positive_int, default=2, help="bytes per element (2: fp16/bf16)")
    t.add_argument("--occupancy", type=positive_int, default=1, help="workgroups resident per compute unit")
    t.add_argument("--llc-ways", type=positive_int, default=16, help="assumed last-level cache associativity")
    s = p.add_argument_group(
        "synchronisation model",
        f"How closely the workgroups sharing an L2 stay in step (the assumption that matters most; "
        f"docs/simulator.md). Default: skew {DEFAULT_SKEW}, the model closest to the published MI300X L2 "
        f"hit rates over every case of 'numasched report' (lockstep over-counts sharing: block_first 57% "
        f"simulated vs ~1% measured; jitter .2 fits 8K but not 32K). --skew 0 --jitter 0 is lockstep; "
        f"giving --jitter alone turns the default skew off.")
    s.add_argument("--skew", type=nonneg_int, default=argparse.SUPPRESS,
                   help=f"largest random start delay of a workgroup after its slot frees, in steps "
                        f"(default {DEFAULT_SKEW}, or 0 when --jitter is given)")
    s.add_argument("--jitter", type=unit_float, default=0.0,
                   help="relative spread of workgroup speeds (0: none; 0.2 models strong drift)")
    s.add_argument("--seed", type=nonneg_int, default=0, help="random seed of the skew/jitter draws")
    t.add_argument("--set-hash", choices=("auto", "xor", "none"), default="auto",
                   help="set index: XOR-folded address or line mod sets (auto: xor for power-of-two set counts)")
    t.add_argument("--tflops", type=nonneg_float, default=None,
                   help="matrix peak for the compute term (default: datasheet figure of --gpu; 0: none)")
    o = p.add_argument_group("output")
    o.add_argument("--json", action="store_true", help="print a JSON list (one object per mapping)")
    o.add_argument("--plot", type=plot_path, default=None, metavar="FILE.png",
                   help="draw the comparison (needs matplotlib: pip install 'numasched[cli]')")
    o.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p.set_defaults(func=run)
    return p


def _lengths(text: str) -> tuple:
    """argparse type of --lengths: comma-separated token counts >= 0, at least one > 0."""
    try:
        out = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        out = ()
    if not out or min(out) < 0 or max(out) < 1:
        raise argparse.ArgumentTypeError(f"expected comma-separated lengths >= 0 (one > 0) such as 4096,300,0, "
                                         f"got {text!r}")
    return out


SCHEDULES = ("static", "worklist", "worklist1")


def _schedules(text: str) -> tuple:
    """argparse type of --schedule: a comma list of static, worklist, worklist1."""
    out = tuple(dict.fromkeys(x.strip() for x in text.split(",") if x.strip()))
    if not out or any(x not in SCHEDULES for x in out):
        raise argparse.ArgumentTypeError(f"expected a comma list of {', '.join(SCHEDULES)}, got {text!r}")
    return out


def _preset(text: str) -> str:
    """argparse type of --gpu: a topology preset name."""
    from ..topology import PRESETS

    if text not in PRESETS:
        raise argparse.ArgumentTypeError(f"expected a topology preset ({', '.join(sorted(PRESETS))}), got {text!r}")
    return text


def _tile(text: str):
    """argparse type of --tile: MxN or MxNxK, each >= 1."""
    try:
        parts = [int(x) for x in text.lower().split("x")]
    except ValueError:
        parts = []
    if len(parts) not in (2, 3) or min(parts) < 1:
        raise argparse.ArgumentTypeError(f"expected MxN or MxNxK with sizes >= 1 (e.g. 128x64), got {text!r}")
    return tuple(parts)


def sync_model(args) -> dict:
    """The simulate() keywords of the synchronisation model the arguments ask for."""
    skew = getattr(args, "skew", None)
    if skew is None:
        skew = 0 if args.jitter else DEFAULT_SKEW
    return dict(skew=skew, jitter=args.jitter)


def describe_sync(skew: int, jitter: float) -> str:
    parts = ([f"skew {skew}"] if skew else []) + ([f"jitter {jitter:g}"] if jitter else [])
    return "sync: " + (" + ".join(parts) if parts else "lockstep")


def build_model(args):
    from .models import AttentionModel, DecodeModel, GemmModel

    bm, bn, bk = args.block_m, args.block_n, args.block_k
    if args.tile:
        parts = args.tile if isinstance(args.tile, tuple) else _tile(args.tile)
        bm, bn = parts[:2]
        if len(parts) == 3:
            bk = parts[2]
    if bn is None:  # not given: the kernel's usual width (an explicit value is never replaced)
        bn = 128 if args.kernel == "gemm" else 64
    kvh = args.kv_heads if args.kv_heads is not None else args.heads
    seq_k = args.seq_k if args.seq_k is not None else args.seq
    if args.kernel == "attention":
        return AttentionModel(args.batch, args.heads, kvh, args.seq, seq_k, args.head_dim,
                              bm, bn, bool(args.causal), args.dtype_bytes)
    if args.kernel == "decode":
        return DecodeModel(args.batch, args.heads, kvh, seq_k, args.head_dim, args.splits or 16, bn, args.dtype_bytes)
    return GemmModel(args.m, args.n, args.k, bm, bn, bk, args.dtype_bytes)


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
    """simulate() for each policy name; a rich progress bar on stderr if ``progress`` and rich is
    installed (plain, silent otherwise)."""
    from .core import simulate

    bar = None
    if progress:
        try:
            from rich.console import Console
            from rich.progress import Progress
        except ImportError:  # rich is optional (pip install 'numasched[cli]')
            progress = False
        else:
            bar = Progress(console=Console(stderr=True), transient=True)
    results = []
    with (bar if bar is not None else contextlib.nullcontext()):
        for name in names:
            results.append(simulate(topology, model, name, occupancy=occupancy, llc_ways=llc_ways, jitter=jitter,
                                    skew=skew, seed=seed, peak_flops=peak_flops, set_hash=set_hash,
                                    progress=bar if bar is not None else False))
    return results


COLUMNS = ("mapping", "L2 hit", "L2 hit min..max", "LLC hit", "HBM GB", "LLC GB", "L2 GB", "balance",
           "time ms", "bound", "speedup")


def _rows(results):
    """(header, rows of strings): the speedup column is the slowest mapping's time over each
    mapping's, and its header names that baseline."""
    slowest = max(results, key=lambda r: r.time_s) if results else None
    worst = (slowest.time_s if slowest else 0.0) or 1.0
    header = list(COLUMNS)
    header[-1] = f"speedup vs {slowest.mapping}" if slowest else "speedup"
    rows = []
    for r in results:
        per = r.l2_hit_rate_per_domain
        rows.append([r.mapping, f"{100 * r.l2_hit_rate:.1f}%", f"{100 * min(per):.0f}..{100 * max(per):.0f}%",
                     f"{100 * r.llc_hit_rate:.1f}%", f"{r.hbm_bytes / 1e9:.2f}", f"{r.llc_bytes / 1e9:.2f}",
                     f"{r.l2_bytes / 1e9:.2f}", f"{r.work_balance:.2f}", f"{1e3 * r.time_s:.3f}", r.bottleneck,
                     f"{worst / r.time_s:.2f}x" if r.time_s else "-"])
    return header, rows


def table(results, title=""):
    """A rich Table of the results (rich must be installed; see :func:`text_table`)."""
    from rich.table import Table

    header, rows = _rows(results)
    tb = Table(title=title)
    for c in header:
        tb.add_column(c, justify="left" if c in ("mapping", "bound") else "right")
    for row in rows:
        tb.add_row(*row)
    return tb


def text_table(results, title="") -> str:
    """The same table as plain text (no rich needed)."""
    header, rows = _rows(results)
    widths = [max(len(c), *(len(r[i]) for r in rows)) if rows else len(c) for i, c in enumerate(header)]
    left = {0, 9}

    def line(cells):
        return "  ".join(c.ljust(w) if i in left else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))

    out = [title] if title else []
    out += [line(header), "  ".join("-" * w for w in widths)] + [line(r) for r in rows]
    return "\n".join(out)


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
    from ..topology import Topology

    sync = sync_model(args)
    if args.ragged or args.lengths:
        return run_ragged(args, sync)
    try:
        topo = Topology.preset(args.gpu)
        model = build_model(args)
        names = policies_for(args.mapping, args.kernel)
        peak = None if args.tflops is None else args.tflops * 1e12
        kw = dict(occupancy=args.occupancy, llc_ways=args.llc_ways, jitter=sync["jitter"], skew=sync["skew"],
                  seed=args.seed, peak_flops=peak, set_hash=args.set_hash,
                  progress=not args.no_progress and sys.stderr.isatty())
        if args.streamk:
            results = streamk_results(topo, model, names, args.programs or 0, kw)
        else:
            results = simulate_all(topo, model, names, **kw)
    except ValueError as e:
        print(f"numasched simulate: error: {e}", file=sys.stderr)
        return 2
    title = f"{topo.name}: {model.describe()}, occupancy {args.occupancy}, {describe_sync(**sync)}"
    if args.json:
        print(json.dumps([r.to_dict() for r in results], indent=1))
    else:
        try:
            from rich.console import Console
        except ImportError:  # rich is optional: plain text
            print(text_table(results, title))
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


def streamk_results(topo, model, names, programs: int, kw) -> list:
    """Per policy: the data-parallel GemmModel, then the stream-K kernel in both piece orders, and
    by program id K-aligned (options.gemm_streamk_k_aligned)."""
    from .core import simulate
    from .models import GemmModel
    from .streamk import PIECE_ORDERS, StreamKGemmModel

    if not isinstance(model, GemmModel):
        raise ValueError("--streamk needs --kernel gemm")
    out = []
    for name in names:
        out.append(simulate(topo, model, name, **kw))
        for order, k_aligned in [(o, False) for o in PIECE_ORDERS] + [("program", True)]:
            sk = StreamKGemmModel(model.m, model.n, model.k, model.block_m, model.block_n, model.block_k,
                                  model.dtype_bytes, programs, name, order, k_aligned)
            out.append(simulate(topo, sk, "auto", **kw))
    return out


def ragged_models(args) -> list:
    """(schedule label, RaggedDecodeModel, policy) for each --schedule of a --ragged run."""
    from .ragged import RaggedDecodeModel, lengths_uniform

    if args.kernel != "decode":
        raise ValueError("--ragged / --lengths need --kernel decode")
    lens = args.lengths or lengths_uniform(args.batch, args.seq_k or args.seq, args.seed)
    kvh = args.kv_heads if args.kv_heads is not None else args.heads
    bn = args.block_n or 64
    common = dict(lengths=lens, heads=args.heads, kv_heads=kvh, head_dim=args.head_dim, block_n=bn,
                  dtype_bytes=args.dtype_bytes)
    policy = "auto"
    if args.mapping not in ("all", "auto"):
        names = policies_for(args.mapping, "decode")
        if len(names) != 1:
            raise ValueError("--ragged takes one --mapping (the static schedule's order) or 'auto'")
        policy = names[0]
    out = []
    for sched in args.schedule or SCHEDULES:
        if sched == "static":
            out.append((sched, RaggedDecodeModel(schedule="static", splits=args.splits or 0, **common), policy))
        else:
            out.append((sched, RaggedDecodeModel(schedule="worklist", programs=args.programs or 0,
                                                 queues="auto" if sched == "worklist" else 1, **common), "auto"))
    return out


RAGGED_COLUMNS = ("schedule", "programs", "L2 hit", "Q hit", "P hit", "HBM GB", "domain balance", "slot balance",
                  "tail ms", "time ms", "bound", "speedup")


def ragged_rows(results) -> tuple:
    """(header, rows) of a --ragged run; speedup: the first result's time over each one's."""
    base = results[0].time_s if results else 0.0
    header = list(RAGGED_COLUMNS)
    if results:
        header[-1] = f"speedup vs {results[0].mapping}"
    rows = []
    for r in results:
        k = r.kernel
        progs = f"{k['splits']} splits" if k["schedule"] == "static" else f"{k['programs']}"
        ph = r.l2_hit_rate_per_tensor
        rows.append([r.mapping, progs, f"{100 * r.l2_hit_rate:.2f}%", f"{100 * ph.get('Q', 0):.1f}%",
                     f"{100 * ph.get('P', 0):.1f}%", f"{r.hbm_bytes / 1e9:.3f}", f"{r.work_balance:.3f}",
                     f"{r.slot_balance:.3f}", f"{1e3 * r.time_terms_s.get('tail', 0.0):.3f}", f"{1e3 * r.time_s:.3f}",
                     r.bottleneck, f"{base / r.time_s:.2f}x" if r.time_s else "-"])
    return header, rows


def run_ragged(args, sync) -> int:
    """``numasched simulate --kernel decode --ragged``: the schedules side by side (simulated)."""
    from .core import simulate
    from ..topology import Topology

    try:
        topo = Topology.preset(args.gpu)
        peak = None if args.tflops is None else args.tflops * 1e12
        results = []
        for label, model, policy in ragged_models(args):
            r = simulate(topo, model, policy, occupancy=args.occupancy, llc_ways=args.llc_ways, jitter=sync["jitter"],
                         skew=sync["skew"], seed=args.seed, peak_flops=peak, set_hash=args.set_hash)
            if label == "static":
                r.mapping = f"static ({r.mapping})"
            results.append(r)
    except ValueError as e:
        print(f"numasched simulate: error: {e}", file=sys.stderr)
        return 2
    m = results[0].kernel
    lens = m["lengths"]
    title = (f"{topo.name}: ragged decode B={len(lens)} lengths {min(lens)}..{max(lens)} (mean {sum(lens) / len(lens):.0f}) "
             f"H={m['heads']} HK={m['kv_heads']} D={m['head_dim']}, occupancy {args.occupancy}, "
             f"{describe_sync(**sync)} (simulated, not measured)")
    if args.json:
        print(json.dumps([r.to_dict() for r in results], indent=1))
        return 0
    header, rows = ragged_rows(results)
    widths = [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(header)]
    print(title)
    print("  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(header, widths))))
    print("  ".join("-" * w for w in widths))
    for row in rows:
        print("  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths))))
    print("Q hit / P hit: L2 hit rate of the query rows and of the partials (writes fill the writer's L2, the merge "
          "reads them); tail: the busiest slot streaming at its fair share of HBM bandwidth (docs/simulator.md).")
    if args.plot:
        plot(results, args.plot, title)
        print(f"wrote {args.plot}")
    return 0
