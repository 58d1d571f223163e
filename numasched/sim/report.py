"""The simulator's comparison with the published MI300X attention results (SHM paper, mappings.md).

``report(quick)`` returns plain text: for H = HK = 128, head dim 128, 128x64 tiles, batch 1 on the
mi300x preset, the L2 hit rate of each attention order under three synchronisation models, next
to the paper's range, plus traffic and the predicted time. Quick mode (one 8K context) takes
about ten seconds on one core; the full mode adds 32K and causal 8K (a few minutes).
"""
from __future__ import annotations

import time

PAPER = {  # SHM paper, MI300X, FA2-style forward, H = 128 (mappings.md)
    "swizzled_head_first": "90-96%",
    "head_first": "40-60%",
    "block_first": "~1%",
    "swizzled_block_first": "n/a",
}
ORDER = ("block_first", "swizzled_block_first", "head_first", "swizzled_head_first")


def _cases(quick: bool):
    if quick:
        return [(8192, False)]
    return [(8192, False), (32768, False), (8192, True)]


# drift settings compared: (label, simulate kwargs)
SETTINGS = (("lockstep", {}), ("skew 32", {"skew": 32}), ("jitter .2", {"jitter": 0.2}))
MAIN = "skew 32"  # the setting whose traffic and time the table shows


def comparison_rows(quick: bool = True):
    """Simulate the SHM setting; one dict per (context, causal, mapping)."""
    from .core import simulate
    from .models import AttentionModel

    rows = []
    for seq, causal in _cases(quick):
        model = AttentionModel(1, 128, 128, seq, seq, 128, 128, 64, causal, 2)
        res = {lab: {p: simulate("mi300x", model, p, **kw) for p in ORDER} for lab, kw in SETTINGS}
        base = res[MAIN]["block_first"].time_s
        for p in ORDER:
            r = res[MAIN][p]
            rows.append(dict(seq=seq, causal=causal, mapping=p, paper=PAPER[p],
                             hits={lab: res[lab][p].l2_hit_rate for lab, _ in SETTINGS},
                             hbm=r.hbm_bytes, time=r.time_s, bound=r.bottleneck, balance=r.work_balance,
                             speedup=base / r.time_s if r.time_s else float("nan")))
    return rows


def report(quick: bool = True) -> str:
    """The comparison table as text (quick: < 20 s on one core)."""
    t0 = time.perf_counter()
    rows = comparison_rows(quick)
    labs = [lab for lab, _ in SETTINGS]
    head = (f"{'context':>8} {'mapping':<21} {'paper':>6} | " + " ".join(f"{lab:>9}" for lab in labs) +
            f" | {'HBM GB':>8} {'time ms':>8} {'vs bf':>6} {'bound':>7} {'balance':>7}")
    lines = [
        "Simulated MI300X attention forward (numasched.sim) vs the SHM paper's measured L2 hit rates.",
        "H = HK = 128, D = 128, 128x64 tiles, batch 1, occupancy 1, XOR-hashed L2 set index.",
        "L2 hit rate under three synchronisation models: lockstep (all workgroups advance together),",
        "skew 32 (each workgroup starts 0-32 steps late), jitter .2 (speeds differ by up to 20%).",
        f"Traffic, time (max of compute at datasheet peak, L2, LLC, HBM) and speedup over block_first: {MAIN}.",
        "",
        head,
        "-" * len(head),
    ]
    for r in rows:
        ctx = f"{r['seq'] // 1024}K{' causal' if r['causal'] else ''}"
        hits = " ".join(f"{100 * r['hits'][lab]:8.1f}%" for lab in labs)
        lines.append(f"{ctx:>8} {r['mapping']:<21} {r['paper']:>6} | {hits} | {r['hbm'] / 1e9:8.2f} "
                     f"{1e3 * r['time']:8.2f} {r['speedup']:5.2f}x {r['bound']:>7} {r['balance']:7.3f}")
    held, failed = [], []
    for seq, causal in _cases(quick):
        by = {r["mapping"]: r["hits"] for r in rows if r["seq"] == seq and r["causal"] == causal}
        for lab in labs:
            ok = by["swizzled_head_first"][lab] > by["head_first"][lab] > by["block_first"][lab]
            (held if ok else failed).append(f"{seq // 1024}K{' causal' if causal else ''}/{lab}")
    verdict = ("holds in every case above, as measured" if not failed else
               f"holds in {len(held)} of {len(held) + len(failed)} cases (not in: {', '.join(failed)})")
    lines += [
        "",
        f"The order swizzled_head_first > head_first > block_first (L2 hit) {verdict}.",
        "Magnitudes depend on how closely the workgroups sharing an L2 stay in step, which the simulator",
        "takes as an input (no feedback from cache misses to speed): lockstep over-counts sharing",
        f"between concurrent workgroups of a head (block_first {100 * rows[0]['hits']['lockstep']:.0f}% vs ~1% "
        "measured); with drift the",
        "numbers move toward the paper's ranges. Details, 32K/128K numbers and caveats: docs/simulator.md.",
        f"(simulated in {time.perf_counter() - t0:.1f} s)",
    ]
    return "\n".join(lines)
