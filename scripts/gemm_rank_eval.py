"""Score the GEMM chooser's model on recorded timings, no GPU: at every recorded point, the
schedule the model ranks first among those that were timed there, against the fastest of them.

A model change is worth a grid run when it ranks the recorded timings better. Two sources:
``bench gemm_inference`` CSVs (their ``timed`` column: ``name=measured/estimate; ...``, the pick
and the next ``--top`` schedules) and ``scripts/gemv_probe.py`` logs (``sk TILE sSTAGES=us``, every
unsplit 16-row tile). Each point is compared within its own run. The estimates are recomputed
with numasched.gemm_schedule as imported (so a patched model can be scored: ``--patch FILE`` runs
a Python file first, which may replace functions or constants of ``gemm_schedule``), on the
machine given (``--machine h100``).

Run: python3 scripts/gemm_rank_eval.py [--machine h100] [--m-max 16] [--misses] [--patch FILE]
                                       [--small-pointer] FILE ... (CSVs and probe logs)"""
from __future__ import annotations

import argparse
import csv
import math
import re
import runpy
import sys
from collections import defaultdict

TIMED = re.compile(r"\s*(.+?)=([\d.]+)/([\d.]+)\s*$")
PROBE_POINT = re.compile(r"\s*(\d+) x\s+(\d+) x\s+(\d+) cublas")
PROBE_TILE = re.compile(r"sk (16x\d+x\d+) s(\d+)$")


def read_points(paths, m_max: int) -> dict:
    """{(source, M, N, K): {schedule name: us}} from gemm_inference CSVs and gemv_probe logs."""
    points: dict = defaultdict(dict)
    for path in paths:
        if path.endswith(".csv"):
            with open(path) as f:
                for row in csv.DictReader(f):
                    M, N, K = int(row["M"]), int(row["N"]), int(row["K"])
                    if M > m_max:
                        continue
                    for item in (row.get("timed") or "").split(";"):
                        m = TIMED.match(item)
                        if m:
                            points[(path, M, N, K)][m.group(1)] = float(m.group(2))
        else:
            cur = None
            with open(path) as f:
                for line in f:
                    m = PROBE_POINT.match(line)
                    if m:
                        cur = tuple(int(v) for v in m.groups())
                        cur = cur if cur[0] <= m_max else None
                    elif line.startswith("    cublas=") and cur:
                        for item in line.strip().split("; "):
                            key, _, value = item.partition("=")
                            t = PROBE_TILE.match(key)
                            if t:
                                points[(path, *cur)][f"splitk {t.group(1)} w4 s{t.group(2)}"] = float(value)
    return points


def _key(s) -> str:
    """A schedule as the chooser's candidates name it; a WS schedule without its stages (its ring
    is gemm_ws.wide_config's, deeper since some runs were recorded)."""
    if s.kind == "ws":
        return f"ws {s.block_m}x{s.block_n}x{s.block_k} split{s.split_k}" + (" swap" if s.swap else "")
    return s.describe()


def score(points: dict, machine, elt: int = 2, small_tma: bool = True, chooser: bool = False,
          swap: bool = False) -> dict:
    """Per point: (pick's time / best time, pick, best). The pick is the lowest estimate among the
    timed schedules the chooser could take there (K rows not 16-byte aligned: K blocks of at most
    MISALIGNED_MAX_BLOCK_K, as the chooser filters them). ``small_tma=False``: runs from before
    the thirty-eighth session, whose tiles of under 64 rows read both operands through pointers
    (gemm_schedule.splitk_operands since). ``chooser``: only the timed schedules that are among
    the chooser's own candidates there (gemm_schedule.candidates with tail splits and the WS
    kernel, and their WS twins), and the pick is gemm_schedule.pick's among them in candidate order
    (the WS split-K margin, the ties' rule; its WS twin where ws_split_twin swaps it and the twin
    was timed), the one the chooser would make as the model now stands; ``swap``:
    with the WS kernel's transposed form among them (options.gemm_ws_swap)."""
    from numasched import gemm_schedule as GS

    out = {}
    for key, timed in points.items():
        _, M, N, K = key
        aligned = (K * elt) % 16 == 0
        scheds = []
        order = None   # chooser: the candidates' order at this point
        twins = {}     # chooser: a candidate's WS twin, which the chooser runs where it picks it
        if chooser:
            cands = GS.candidates(M, N, K, elt, machine, tail=True, ws=True, ws_swap=swap)
            order = {_key(c): i for i, c in enumerate(cands)}
            for c in cands if aligned else ():
                twin = GS.ws_split_twin(c, M, N, K, elt, machine)
                if twin is not None:
                    twins[c.describe()] = _key(twin)
        for name, us in timed.items():
            try:
                s = GS.Schedule.parse(name)
            except ValueError:
                continue
            if not aligned and s.block_k > GS.MISALIGNED_MAX_BLOCK_K:
                continue
            if order is not None and _key(s) not in order and _key(s) not in twins.values():
                continue
            # (the chooser reads 64+-row split-K tiles through TMA where the operands allow it)
            tma = aligned and (small_tma or s.block_m >= 64)
            scheds.append((GS.estimate(s, M, N, K, elt, machine, tma, aligned), us, name, s))
        if len(scheds) < 2:
            continue
        best = min(scheds, key=lambda t: t[1])
        if order is None:
            pick = min(scheds, key=lambda t: t[0])
        else:
            own = sorted((t for t in scheds if _key(t[3]) in order), key=lambda t: order[_key(t[3])])
            if not own:
                continue
            chosen = GS.pick([(t[3], t[0]) for t in own], M, elt, machine, splitk_tma=aligned and small_tma)
            pick = next(t for t in own if t[3].describe() == chosen.describe())
            # (where the chooser swaps its pick for the WS twin, gemm_schedule.ws_split_twin, and the
            # twin was timed: the twin's time)
            twin = twins.get(chosen.describe())
            pick = next((t for t in scheds if _key(t[3]) == twin), pick) if twin else pick
        out[key] = (pick[1] / best[1], pick[:3], best[:3])
    return out


def summary(result: dict) -> str:
    ratios = [r for r, _, _ in result.values()]
    if not ratios:
        return "no point with two or more timed schedules"
    g = math.exp(sum(map(math.log, ratios)) / len(ratios))
    return (f"points {len(ratios)}: pick within 3 % of the best timed {sum(r <= 1.03 for r in ratios)}, "
            f"within 5 % {sum(r <= 1.05 for r in ratios)}; geomean pick / best {g:.4f}, worst {max(ratios):.3f}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="+", help="bench gemm_inference CSVs and gemv_probe logs")
    ap.add_argument("--machine", default="h100", help="a key of gemm_schedule._KNOWN (default h100)")
    ap.add_argument("--m-max", type=int, default=1 << 30, help="only points with M up to this")
    ap.add_argument("--patch", default=None, help="a Python file run first (a model variant)")
    ap.add_argument("--chooser", action="store_true",
                    help="only the timed schedules among the chooser's candidates at each point")
    ap.add_argument("--swap", action="store_true",
                    help="--chooser: with the WS kernel's transposed form among its candidates (gemm_ws_swap)")
    ap.add_argument("--misses", action="store_true", help="list the points whose pick is > 3 %% off the best")
    ap.add_argument("--small-pointer", action="store_true",
                    help="runs from before 2026-11-27's thirty-eighth session: tiles of under 64 rows through pointers")
    args = ap.parse_args(argv)
    if args.patch:
        runpy.run_path(args.patch)
    from numasched import gemm_schedule as GS

    if args.machine not in GS._KNOWN:
        ap.error(f"--machine must be one of {sorted(GS._KNOWN)}, got {args.machine!r}")
    result = score(read_points(args.files, args.m_max), GS._KNOWN[args.machine], small_tma=not args.small_pointer,
                   chooser=args.chooser, swap=args.swap)
    print(summary(result))
    if args.misses:
        for (src, M, N, K), (r, pick, best) in sorted(result.items(), key=lambda kv: -kv[1][0]):
            if r > 1.03:
                print(f"  {M}x{N}x{K} ({src.split('/')[-2]}): pick {pick[2]} {pick[1]:.2f} us (est {pick[0] * 1e6:.1f}) "
                      f"| best {best[2]} {best[1]:.2f} us (est {best[0] * 1e6:.1f})  {r:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
