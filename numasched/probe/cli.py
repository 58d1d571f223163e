"""The ``numasched probe`` command (registered by ``numasched.cli`` through :func:`add_parser`)."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..argtypes import nonneg_int, positive_int

from .analysis import analyze, summary
from .files import default_path, load_raw, save
from .measurement import BUFFER_BYTES, DEFAULTS, QUICK, ProbeUnavailable, probe

__all__ = ["add_parser"]


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "probe", help="measure the locality structure of the GPU at hand",
        description="Per-SM L2 hit latency by line: L2 partitions, near/far latency, whether a line's partition "
                    "follows its address, and the program -> SM dispatch order. Writes JSON for "
                    "Topology.from_probe. AMD: XCC id per workgroup (untested on hardware).")
    p.add_argument("--out", type=Path, help="JSON output (default ~/.cache/numasched/probe-<device>.json); "
                   "the raw measurement goes next to it as .npz")
    p.add_argument("--quick", action="store_true", help=f"small probe ({QUICK}); a few seconds of GPU time")
    p.add_argument("--lines", type=positive_int, help=f"random 128-byte lines (default {DEFAULTS['lines']})")
    p.add_argument("--iters", type=positive_int, help=f"dependent loads per line (default {DEFAULTS['iters']})")
    p.add_argument("--programs-per-sm", type=positive_int,
                   help=f"programs per SM (default {DEFAULTS['programs_per_sm']})")
    p.add_argument("--buffer-mb", type=positive_int, default=BUFFER_BYTES >> 20,
                   help="buffer the lines are drawn from, in MiB")
    p.add_argument("--seed", type=nonneg_int, default=0, help="seed of the random line addresses (default 0)")
    p.add_argument("--max-partitions", type=positive_int, default=4,
                   help="most L2 partitions the clustering of SMs may find (default 4)")
    p.add_argument("--no-raw", action="store_true", help="do not write the raw .npz")
    p.add_argument("--no-bandwidth", action="store_true", help="skip the streaming-read bandwidth reading")
    p.add_argument("--from-raw", type=Path, metavar="NPZ", help="re-analyse a saved raw measurement (no GPU needed)")
    p.set_defaults(func=_cli)
    return p


def _cli(args) -> int:
    for name in ("lines", "iters", "programs_per_sm", "buffer_mb", "max_partitions"):
        v = getattr(args, name)
        if v is not None and v < 1:
            print(f"numasched probe: --{name.replace('_', '-')} must be >= 1, got {v}", file=sys.stderr)
            return 2
    try:
        if args.from_raw:
            if not args.from_raw.exists():
                print(f"numasched probe: --from-raw {args.from_raw}: no such file", file=sys.stderr)
                return 2
            try:
                raw = load_raw(args.from_raw)
            except ValueError as e:
                print(f"numasched probe: --from-raw: {e}", file=sys.stderr)
                return 2
            res = analyze(raw, max_partitions=args.max_partitions)
            path = args.out or default_path(res["device"])
            save(res, path)
            res["path"] = str(path)
        else:
            res = probe(quick=args.quick, out=args.out, save_raw=not args.no_raw, max_partitions=args.max_partitions,
                        lines=args.lines, iters=args.iters, programs_per_sm=args.programs_per_sm,
                        buffer_bytes=args.buffer_mb << 20, seed=args.seed, bandwidth=not args.no_bandwidth)
    except ProbeUnavailable as e:
        print(f"numasched probe: {e}", file=sys.stderr)
        return 2
    except ValueError as e:
        print(f"numasched probe: {e}", file=sys.stderr)
        return 2
    print(summary(res))
    return 0
