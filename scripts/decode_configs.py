"""Flash Decode diagnostic (GPU): for each (batch, context) given, the split count the heuristic
picks, the config the autotuner picks (unless --no-auto), the CUDA-graph time of every config of the
layout at several split counts, and the ragged work-list kernel on the same (uniform) batch. Data
for the split heuristic and the config list, not a benchmark of peers.

Every timing runs a plan made with the public planning calls:
``numasched.plan_decode(..., num_splits=S, config=dict(BLOCK_N=..., num_warps=..., num_stages=...))``
and ``numasched.plan_decode_worklist(..., lengths=..., num_programs=P, config=...)``.

    python scripts/decode_configs.py --batch 4 --ctx 65536 131072 262144 --splits 4 8 16
    python scripts/decode_configs.py --batch 8 64 --ctx 32768 --page 16 --splits 1 2 3 4 --no-auto \
        --extra 128/4/7 64/4/9 --worklist 1 2 --csv bench/results/decode-configs.csv
"""
import argparse
import csv
import sys

import torch

import numasched
from numasched.bench.common import FLUSH_MODES, bench_ms, capture, graph_replay_ms, warm_up_for_capture
from numasched.cli import nonneg_int, positive_int
from numasched.decode import choose_num_splits, stream_scale

# (BLOCK_N, num_warps, num_stages) tried per layout: the autotuner's candidates
# (numasched/kernels/flash_decode.py, read only)
from numasched.kernels.flash_decode import _CONTIGUOUS_CONFIGS, _PAGED_CONFIGS


ITERS = 30  # graph replays per timing (--iters)
FLUSH = "read"   # --flush


def graph_us(fn) -> float:
    """Median us of replays of a graph of one call of ``fn``: each after a 256 MB read (FLUSH
    "read", bench.common.bench_ms: the L2 cold and clean, as after a model's weight reads), or
    back to back ("none": a cache smaller than the L2 is then read from it; the setting of the
    sweeps before the fifty-second session)."""
    if FLUSH == "none":
        return graph_replay_ms(fn, warmup=5, iters=ITERS) * 1e3
    warm_up_for_capture(fn, 2)
    return bench_ms(capture(fn).replay, warmup=5, rep=ITERS, flush=FLUSH) * 1e3


def timed(make, run_args) -> float:
    """Graph time of the plan ``make()`` builds (NaN, reported, when the config cannot run, e.g.
    too much shared memory)."""
    try:
        plan = make()
        return graph_us(lambda: plan.run(*run_args[0], **run_args[1]))
    except Exception as e:  # one config that does not fit must not end the sweep
        print(f"    ({type(e).__name__}: {(str(e).splitlines() or [''])[0][:120]})", flush=True)
        return float("nan")


def _cfg(text: str):
    try:
        bn, w, st = (int(x) for x in text.split("/"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"a config is BLOCK_N/num_warps/num_stages, e.g. 128/4/7; got {text!r}")
    return bn, w, st


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python scripts/decode_configs.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=positive_int, nargs="+", default=[4], help="batch sizes")
    p.add_argument("--ctx", type=positive_int, nargs="+", default=[131072], help="context lengths (tokens)")
    p.add_argument("--splits", type=positive_int, nargs="+", default=[4, 8, 16], help="split counts to sweep")
    p.add_argument("--heads", type=positive_int, nargs=2, default=[32, 8], metavar=("H", "HK"),
                   help="query and KV heads")
    p.add_argument("--page", type=nonneg_int, default=0, help="page size of a paged cache (0: contiguous)")
    p.add_argument("--configs", type=_cfg, nargs="*", default=None,
                   help="configs to time (default: the autotuner's candidates for the layout)")
    p.add_argument("--extra", type=_cfg, nargs="*", default=[], help="configs timed besides those")
    p.add_argument("--worklist", type=positive_int, nargs="*", default=[],
                   help="also time the work-list kernel with this many programs per SM (each)")
    p.add_argument("--no-auto", action="store_true", help="skip the autotuned plan (slow: it tunes)")
    p.add_argument("--iters", type=positive_int, default=ITERS,
                   help="graph replays per timing (median) with --flush none; else ms of timed replays")
    p.add_argument("--flush", choices=("none",) + FLUSH_MODES, default=FLUSH,
                   help="before each timed replay: read (default) or zero 256 MB (bench.common.bench_ms), or none "
                        "(back to back: small caches then hit the L2)")
    p.add_argument("--csv", default=None, help="append one row per timing to this CSV file")
    p.add_argument("--dry-run", action="store_true", help="print the sweep and exit (no GPU needed)")
    return p


def _cache(B, L, HK, D, page, dev):
    """K, V and the block table (None when contiguous): pages in a random order."""
    if not page:
        return (torch.randn(B, L, HK, D, device=dev, dtype=torch.bfloat16),
                torch.randn(B, L, HK, D, device=dev, dtype=torch.bfloat16), None)
    per = -(-L // page)
    k = torch.randn(B * per, page, HK, D, device=dev, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    bt = torch.randperm(B * per, device=dev, dtype=torch.int64).to(torch.int32).reshape(B, per)
    return k, v, bt


def main(argv=None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    global ITERS, FLUSH
    ITERS, FLUSH = args.iters, args.flush
    H, HK, D = args.heads[0], args.heads[1], 128
    if H % HK:
        p.error(f"--heads: query heads ({H}) must be a multiple of KV heads ({HK})")
    configs = list(args.configs if args.configs is not None
                   else (_PAGED_CONFIGS if args.page else _CONTIGUOUS_CONFIGS)) + list(args.extra)
    layout = f"paged {args.page}" if args.page else "contiguous"
    if args.dry_run:
        for B in args.batch:
            for L in args.ctx:
                print(f"B={B} ctx={L} heads {H}/{HK} {layout}: auto splits (132 SMs) "
                      f"{choose_num_splits(B, HK, L, 132, paged=bool(args.page))}; splits {args.splits} x configs {configs}; "
                      f"work list {args.worklist} programs per SM")
        return 0
    if not torch.cuda.is_available():
        print("scripts/decode_configs.py needs a CUDA GPU (found none); --dry-run prints the sweep", file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    nsm = torch.cuda.get_device_properties(dev).multi_processor_count
    rows = []

    def record(B, L, kind, splits, cfg, us, gb):
        rows.append(dict(heads=f"{H}/{HK}", batch=B, ctx=L, layout=layout, kind=kind, splits=splits,
                         config=cfg, us=round(us, 2), TBps=round(gb / us * 1e3, 3)))

    with numasched.options.use(check_data=False, decode_schedule="autotune"):   # the "autotuned" row tunes
        for B in args.batch:
            for L in args.ctx:
                q = torch.randn(B, H, D, device=dev, dtype=torch.bfloat16)
                k, v, bt = _cache(B, L, HK, D, args.page, dev)
                lens = torch.full((B,), L, device=dev, dtype=torch.int32)
                run = ((q, k, v), dict(cache_seqlens=lens, block_table=bt))
                gb = 2 * B * L * HK * D * 2 / 1e9
                auto = choose_num_splits(B, HK, L, nsm, paged=bool(args.page), stream_scale=stream_scale(dev))
                print(f"B={B} ctx={L} heads {H}/{HK} {layout} ({gb:.2f} GB): auto splits {auto}", flush=True)
                if not args.no_auto:
                    plan = numasched.plan_decode(q, k, v, cache_seqlens=lens, block_table=bt)  # tunes on first run
                    t = graph_us(lambda: plan.run(q, k, v, cache_seqlens=lens, block_table=bt))
                    record(B, L, "autotuned", plan.num_splits, str(plan.config), t, gb)
                    print(f"  autotuned (splits {plan.num_splits}): {t:.1f} us ({gb / t * 1e3:.2f} TB/s), "
                          f"config {plan.config}", flush=True)
                for s in args.splits:
                    row = []
                    for bn, w, st in configs:
                        t = timed(lambda: numasched.plan_decode(
                            q, k, v, cache_seqlens=lens, block_table=bt, num_splits=s,
                            config=dict(BLOCK_N=bn, num_warps=w, num_stages=st)), run)
                        record(B, L, "split", s, f"{bn}/{w}/{st}", t, gb)
                        row.append(f"{bn}/{w}w/{st}s {t:.0f}")
                    print(f"  S={s}: " + ", ".join(row), flush=True)
                for per_sm in args.worklist:
                    row = []
                    for bn, w, st in configs:
                        t = timed(lambda: numasched.plan_decode_worklist(
                            q, k, v, lengths=[L] * B, cache_seqlens=lens, block_table=bt, num_programs=per_sm * nsm,
                            config=dict(BLOCK_N=bn, num_warps=w, num_stages=st)), run)
                        record(B, L, "worklist", per_sm * nsm, f"{bn}/{w}/{st}", t, gb)
                        row.append(f"{bn}/{w}w/{st}s {t:.0f}")
                    print(f"  work list, {per_sm} programs/SM: " + ", ".join(row), flush=True)
    if args.csv and rows:
        import os

        new = not os.path.exists(args.csv)
        with open(args.csv, "a", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            if new:
                w.writeheader()
            w.writerows(rows)
        print(f"{len(rows)} rows -> {args.csv}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
