"""The simulator: dispatch, execution order, per-domain L2s, shared last-level cache, time model.

Execution model (what "exact" is measured against)
--------------------------------------------------
* Program ids 0..W-1 are dispatched in order; program g belongs to domain
  ``topology.domain_of(g)`` and runs the work item ``policy.reference(g)``.
* Each domain has ``cus_per_domain * occupancy`` slots. A domain starts its programs in id order;
  a program takes the free slot that freed first (lowest slot on ties). Domains do not wait for
  each other.
* A program may wait ``skew``-bounded random steps after its slot frees (launch latency), and
  with ``jitter`` each workgroup runs at its own constant speed; both default to 0 (lockstep).
* A workgroup makes one tile access per time step (attention: Q, then K_0, V_0, K_1, ...), so it
  occupies its slot for as many steps as it has accesses; the next program starts in that slot
  at the following step.
* Within a step, accesses are ordered by slot, then by domain (domains interleave finely, which
  matters only for the shared last-level cache). A tile access reads its lines in row-major
  order, back to back.
* Each domain has a private L2 (``l2_ways``-way LRU; set = XOR-fold of the line address when
  set counts are powers of two, else or with ``set_hash="none"`` line mod sets). Its misses go
  to the shared last-level cache (``llc_ways``-way LRU, same line size; a single cache, address slices
  not modelled) in the global order above; the LLC's misses go to HBM. Reads only.

``bruteforce.py`` implements the same model line by line in plain Python; the tests check that
both agree.
"""
from __future__ import annotations

import heapq
import time
from dataclasses import asdict, dataclass, field
from math import gcd
from typing import Dict, List, Optional

import numpy as np

from .. import mappings as M
from ..topology import Topology
from .lru import LRUBank
from .models import KernelModel
from .units import CacheGeom, Decomposition, expand_units, layout

TICKS = 1024  # ticks per access at nominal speed when jitter > 0

# Dense fp16/bf16 matrix peak (published datasheet figures, no sparsity), for the compute term of
# the time model. Override with simulate(..., peak_flops=...).
PEAK_FLOPS = {
    "mi300x": 1307.4e12, "mi325x": 1307.4e12, "mi350x": 2300e12, "mi355x": 2500e12,
    "h100": 989e12, "h200": 989e12, "b200": 2250e12,
}


@dataclass
class SimResult:
    """What one simulation produced. Byte counts are whole cache lines."""

    mapping: str
    topology: str
    kernel: dict
    occupancy: int
    jitter: float
    skew: int
    set_hash: str
    num_domains: int
    requested_bytes: int
    l2_bytes: int  # served by the domains' L2s
    llc_bytes: int  # served by the last-level cache
    hbm_bytes: int
    l2_hit_rate: float
    llc_hit_rate: float  # of the L2 misses
    l2_hit_rate_per_domain: List[float]
    requested_bytes_per_domain: List[int]
    hbm_bytes_per_domain: List[int]
    workgroups_per_domain: List[int]
    flops_per_domain: List[float]
    finish_step_per_domain: List[int]  # in nominal access steps
    work_balance: float  # max / mean of flops per domain (1 = even)
    time_s: float  # rough predicted time: the largest term of time_terms_s
    time_terms_s: Dict[str, float]
    bottleneck: str
    unit_lines: int  # lines per simulated unit (1 = line-level)
    exact: bool  # equals the line-level LRU of the execution model
    sim_seconds: float
    notes: List[str] = field(default_factory=list)
    # bytes requested per slot (compute unit x occupancy): max / mean (1 = every slot as busy)
    slot_balance: float = 1.0
    # L2 hit rate and requested bytes per tensor of the model (Q, K, V, ...)
    l2_hit_rate_per_tensor: Dict[str, float] = field(default_factory=dict)
    requested_bytes_per_tensor: Dict[str, int] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)


def _check_int(name, v, lo=1):
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < lo:
        raise ValueError(f"{name} must be an integer >= {lo}, got {v!r}")
    return int(v)


def access_ticks(num_programs: int, jitter: float, seed: int = 0) -> np.ndarray:
    """Duration of one tile access of each program, in ticks.

    jitter 0: every access takes 1 tick (all workgroups advance in lockstep). jitter j > 0: program
    g takes round(TICKS * (1 + j * u_g)) ticks per access, u_g uniform in [-1, 1] (seeded), so
    workgroups drift apart at constant relative speeds, as they do on hardware.
    """
    if jitter == 0:
        return np.ones(num_programs, dtype=np.int64)
    u = np.random.default_rng(seed).uniform(-1.0, 1.0, num_programs)
    return np.maximum(1, np.rint(TICKS * (1.0 + jitter * u))).astype(np.int64)


def start_delays(num_programs: int, skew: int, seed: int = 0) -> np.ndarray:
    """Steps each program waits after its slot frees before it starts: uniform in [0, skew] (seeded).

    Models dispatch and launch latency: the phases of a domain's slots then wander apart by a random
    walk over successive workgroups, while a running workgroup keeps the nominal speed."""
    if skew == 0:
        return np.zeros(num_programs, dtype=np.int64)
    return np.random.default_rng([seed, 1]).integers(0, skew + 1, num_programs).astype(np.int64)


def schedule(domains: np.ndarray, n_acc: np.ndarray, num_domains: int, slots: int, ticks=None, delays=None):
    """Start tick and slot of every program (see module doc)."""
    domains, n_acc = np.asarray(domains), np.asarray(n_acc)
    for name, v in (("num_domains", num_domains), ("slots", slots)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
            raise ValueError(f"{name} must be an int >= 1, got {v!r}")
    if domains.shape != n_acc.shape or domains.ndim != 1:
        raise ValueError(f"domains and n_acc must be 1-D arrays of one length, got shapes {domains.shape} and "
                         f"{n_acc.shape}")
    if domains.size and (domains.min() < 0 or domains.max() >= num_domains):
        raise ValueError(f"domains must lie in [0, num_domains = {num_domains}), got {domains.min()}..{domains.max()}")
    W = domains.size
    dur = np.ones(W, dtype=np.int64) if ticks is None else np.asarray(ticks, dtype=np.int64)
    delay = np.zeros(W, dtype=np.int64) if delays is None else np.asarray(delays, dtype=np.int64)
    length = n_acc * dur
    start = np.empty(W, dtype=np.int64)
    slot = np.empty(W, dtype=np.int64)
    for d in range(num_domains):
        ids = np.flatnonzero(domains == d)
        if ids.size == 0:
            continue
        n = length[ids]
        if (n == n[0]).all() and not delay[ids].any():  # equal lengths: waves of `slots` programs
            r = np.arange(ids.size)
            start[ids] = (r // slots) * n[0]
            slot[ids] = r % slots
            continue
        heap = [(0, s) for s in range(slots)]
        for g, ng, dl in zip(ids.tolist(), n.tolist(), delay[ids].tolist()):
            t, s = heapq.heappop(heap)
            start[g] = t + dl
            slot[g] = s
            heapq.heappush(heap, (t + dl + ng, s))
    return start, slot


def _resolve_policy(policy, model, topology):
    if isinstance(policy, M.Policy):
        p = policy
        kind = "attention" if model.kind in ("attention", "decode") else "gemm"
        if p.kind != kind:
            raise ValueError(f"policy {p.name!r} is a {p.kind} policy; the {model.kind} model needs a {kind} policy")
        return p
    if not isinstance(policy, str):
        raise ValueError(f"policy must be a name, 'auto' or a Policy, got {type(policy).__name__}")
    return M.resolve(policy, model.kind, topology, model.grid, causal=bool(model.causal))


def simulate(topology, kernel_model: KernelModel, policy="auto", *, occupancy: int = 1, llc_ways: int = 16,
             peak_flops: Optional[float] = None, jitter: float = 0.0, skew: int = 0, seed: int = 0, set_hash: str = "auto", progress=False,
             chunk_units: int = 3_000_000) -> SimResult:
    """Simulate one kernel under one mapping policy on one topology.

    Args:
        topology: a Topology or a preset name ("mi300x", ...).
        kernel_model: AttentionModel, DecodeModel, GemmModel or RaggedDecodeModel.
        policy: registered policy name, "auto", or a Policy (a model that assigns work to programs
            itself, RaggedDecodeModel(schedule="worklist"), takes "auto" only).
        occupancy: workgroups resident per compute unit.
        llc_ways: associativity assumed for the last-level cache (not in Topology).
        peak_flops: matrix peak for the compute term; None: PEAK_FLOPS[topology.name] if known,
            0: no compute term.
        jitter: relative spread of workgroup speeds (0 = lockstep; see access_ticks).
        skew: largest start delay of a workgroup after its slot frees, in steps (see start_delays).
        seed: seed of the speed and delay draws.
        set_hash: "xor" (set index = XOR-fold of the line address, as hardware hashes indexes to
            avoid power-of-two conflicts), "none" (line mod sets) or "auto" (xor when every set
            count is a power of two, else none).
        progress: a rich Progress to add a task to, True for a bar of its own, or False.
        chunk_units: unit accesses simulated per NumPy batch (memory vs overhead).
    """
    t_start = time.perf_counter()
    if isinstance(topology, str):
        topology = Topology.preset(topology)
    if not isinstance(topology, Topology):
        raise ValueError(f"topology must be a Topology or a preset name, got {type(topology).__name__}")
    if not isinstance(kernel_model, KernelModel):
        raise ValueError(f"kernel_model must be an AttentionModel, DecodeModel, GemmModel or RaggedDecodeModel, "
                         f"got {type(kernel_model).__name__}")
    occupancy = _check_int("occupancy", occupancy)
    llc_ways = _check_int("llc_ways", llc_ways)
    chunk_units = _check_int("chunk_units", chunk_units)
    if peak_flops is not None and (isinstance(peak_flops, bool) or not isinstance(peak_flops, (int, float))
                                   or not 0 <= peak_flops < float("inf")):
        raise ValueError(f"peak_flops must be a finite number >= 0 or None, got {peak_flops!r}")
    if isinstance(jitter, bool) or not isinstance(jitter, (int, float)) or not 0 <= jitter < 1:
        raise ValueError(f"jitter must be a number in [0, 1), got {jitter!r}")
    seed = _check_int("seed", seed, lo=0)
    skew = _check_int("skew", skew, lo=0)
    if set_hash not in ("xor", "none", "auto"):
        raise ValueError(f"set_hash must be 'xor', 'none' or 'auto', got {set_hash!r}")
    # models whose sizes depend on the GPU (e.g. a split count chosen for its CUs) bind to it first
    kernel_model = kernel_model.bind(topology)
    X = topology.num_domains
    line = topology.l2_line
    own = kernel_model.program_items(topology)  # a model that assigns work to programs itself
    if own is None:
        pol = _resolve_policy(policy, kernel_model, topology)
        name = pol.name
        grid = kernel_model.grid
        W = grid.size
        pids = np.arange(W, dtype=np.int64)
        items = pol.reference(pids, grid, X)
    else:
        if not (policy is None or policy == "auto"):
            raise ValueError(f"the {kernel_model.schedule_name} schedule assigns work to programs itself; it takes "
                             f"no mapping policy (got {getattr(policy, 'name', policy)!r})")
        name = kernel_model.schedule_name
        items = own
        W = items.shape[0]
        pids = np.arange(W, dtype=np.int64)
    plan = kernel_model.prepare(items, line)
    n_acc = kernel_model.n_accesses(items).astype(np.int64)
    dom = topology.domain_of(pids).astype(np.int64)
    slots = topology.cus_per_domain * occupancy
    dur = access_ticks(W, float(jitter), seed)
    delays = start_delays(W, skew, seed) * (1 if jitter == 0 else TICKS)
    start, slot = schedule(dom, n_acc, X, slots, dur, delays)
    if kernel_model.schedule_dependent:
        # accesses that depend on who finishes when (the last item of a pair merges): placed from
        # this schedule, then the programs are scheduled again with them
        n_acc = kernel_model.place_merges(plan, items, start, dur).astype(np.int64)
        start, slot = schedule(dom, n_acc, X, slots, dur, delays)
    end = start + n_acc * dur
    lockstep = bool((dur == 1).all())
    track = slot * X + dom  # order within a step: slot, then domain
    n_tracks = slots * X

    caches = [CacheGeom(topology.l2_sets, topology.l2_ways)]
    has_llc = topology.llc_bytes > 0
    if has_llc:
        if topology.llc_bytes % (line * llc_ways):
            raise ValueError(f"llc_bytes ({topology.llc_bytes}) must be a multiple of l2_line*llc_ways "
                             f"({line * llc_ways})")
        caches.append(CacheGeom(topology.llc_bytes // (line * llc_ways), llc_ways))
    mod = 1
    for c in caches:
        mod = mod * c.sets // gcd(mod, c.sets)
    if set_hash == "auto":
        set_hash = "xor" if all(c.sets & (c.sets - 1) == 0 for c in caches) else "none"
    tensors = layout(kernel_model.tensors(line), mod)
    dec = Decomposition(tensors, caches, hashed=set_hash == "xor")
    last_line = max(t.base + t.rows * t.pitch for t in tensors)
    kdt = np.int32 if last_line < 2**31 - 1 else np.int64
    n2 = dec.n_classes[0]
    l2 = LRUBank(X * n2, topology.l2_ways, key_dtype=kdt)
    llc = LRUBank(dec.n_classes[1], llc_ways, key_dtype=kdt) if has_llc else None

    req = np.zeros(X, dtype=np.int64)
    req_prog = np.zeros(W, dtype=np.int64)
    n_t = len(tensors)
    req_t = np.zeros(n_t, dtype=np.int64)
    hit_t = np.zeros(n_t, dtype=np.int64)
    hit2 = np.zeros(X, dtype=np.int64)
    hitl = np.zeros(X, dtype=np.int64)
    T_total = int(end.max())
    # units per tile access, from a sample, sizes the time window of a batch
    rng = np.random.default_rng(1)
    sw = rng.integers(0, W, 4096)
    sk = (rng.random(4096) * n_acc[sw]).astype(np.int64)
    st_ = kernel_model.tiles(plan, sw, sk)
    per = float(np.mean((st_[2] // dec.rho) * (1 if st_[4] is None else st_[4] // dec.omega)))
    dt = max(1, int(chunk_units / (n_tracks * max(per, 1.0)))) * (1 if lockstep else TICKS)
    n_chunks = -(-T_total // dt)

    bar, task, own = None, None, False
    if progress is not None and progress is not False:
        if progress is True:
            from rich.progress import Progress

            bar, own = Progress(transient=True), True
            bar.start()
        else:
            bar = progress
        task = bar.add_task(f"simulate {name}", total=n_chunks)
    try:
        for T0 in range(0, T_total, dt):
            T1 = min(T0 + dt, T_total)
            if lockstep:
                wg, kk = _window(start, end, track, T0, T1, n_tracks)
            else:
                wg, kk = _window_sorted(start, end, dur, track, T0, T1, n_tracks)
            if wg.size == 0:
                continue
            tt, r0, nr, c0, nc = kernel_model.tiles(plan, wg, kk)
            src, first, row, col = expand_units(dec, tt, r0, nr, c0, nc)
            d = dom[wg] if src is None else dom[wg][src]
            keys = first.astype(kdt, copy=False)
            h2 = l2.access(d * n2 + dec.classes(first, row, col, 0), keys)
            req += np.bincount(d, minlength=X)
            req_prog += np.bincount(wg if src is None else wg[src], minlength=W)
            tu = tt if src is None else tt[src]
            req_t += np.bincount(tu, minlength=n_t)
            hit_t += np.bincount(tu, weights=h2, minlength=n_t).astype(np.int64)
            hit2 += np.bincount(d, weights=h2, minlength=X).astype(np.int64)
            if llc is not None:
                miss = np.flatnonzero(~h2)
                fm = first[miss]
                hl = llc.access(dec.classes(fm, None if row is None else row[miss],
                                            None if col is None else col[miss], 1), keys[miss])
                hitl += np.bincount(d[miss], weights=hl, minlength=X).astype(np.int64)
            if bar is not None:
                bar.advance(task)
    finally:
        if own:
            bar.stop()

    lb = dec.lines_per_unit * line
    req_b, l2_b, llc_b = req * lb, hit2 * lb, hitl * lb
    hbm_b = req_b - l2_b - llc_b
    flops = np.bincount(dom, weights=kernel_model.flops(items), minlength=X)
    wgs = np.bincount(dom, minlength=X)
    finish = np.zeros(X, dtype=np.int64)
    np.maximum.at(finish, dom, -(-end // (1 if lockstep else TICKS)))
    miss_b = int(req_b.sum() - l2_b.sum())

    terms = {}
    if topology.l2_bw_bytes_per_s > 0:
        terms["l2"] = float(req_b.max() / (topology.l2_bw_bytes_per_s / X))
    if has_llc and topology.llc_bw_bytes_per_s > 0:
        terms["llc"] = float(miss_b / topology.llc_bw_bytes_per_s)
    if topology.hbm_bytes_per_s > 0:
        terms["hbm"] = float(hbm_b.sum() / topology.hbm_bytes_per_s)
    pf = PEAK_FLOPS.get(topology.name, 0.0) if peak_flops is None else float(peak_flops)
    if pf > 0:
        terms["compute"] = float(flops.max() / (pf / X))
    slot_b = np.bincount(slot * X + dom, weights=req_prog, minlength=n_tracks) * lb
    slot_balance = float(slot_b.max() / slot_b.mean()) if slot_b.mean() > 0 else 1.0
    if kernel_model.tail_term and topology.hbm_bytes_per_s > 0:
        # the busiest slot streaming at its fair share of HBM bandwidth (models whose time is set by
        # their slowest program: a ragged decode)
        terms["tail"] = float(slot_b.max() / (topology.hbm_bytes_per_s / n_tracks))
    bottleneck = max(terms, key=terms.get) if terms else "none"
    notes = [f"units: {dec.describe()}", f"lockstep rows {l2.rows_run} (L2) + {llc.rows_run if llc else 0} (LLC); "
             f"recomputed {l2.rows_redone + (llc.rows_redone if llc else 0)}"]
    return SimResult(
        mapping=name, topology=topology.name, kernel=kernel_model.to_dict(), occupancy=occupancy,
        jitter=float(jitter), skew=skew, set_hash=set_hash,
        num_domains=X,
        requested_bytes=int(req_b.sum()), l2_bytes=int(l2_b.sum()), llc_bytes=int(llc_b.sum()),
        hbm_bytes=int(hbm_b.sum()),
        l2_hit_rate=float(hit2.sum() / max(1, req.sum())),
        llc_hit_rate=float(hitl.sum() / max(1, req.sum() - hit2.sum())),
        l2_hit_rate_per_domain=[float(h / r) if r else 0.0 for h, r in zip(hit2, req)],
        requested_bytes_per_domain=[int(x) for x in req_b],
        hbm_bytes_per_domain=[int(x) for x in hbm_b],
        workgroups_per_domain=[int(x) for x in wgs],
        flops_per_domain=[float(x) for x in flops],
        finish_step_per_domain=[int(x) for x in finish],
        work_balance=float(flops.max() / flops.mean()) if flops.mean() > 0 else 1.0,
        time_s=float(max(terms.values())) if terms else 0.0,
        time_terms_s=terms, bottleneck=bottleneck,
        unit_lines=dec.lines_per_unit, exact=True,
        sim_seconds=time.perf_counter() - t_start, notes=notes, slot_balance=slot_balance,
        l2_hit_rate_per_tensor={t.name: float(h / r) if r else 0.0 for t, h, r in zip(tensors, hit_t, req_t)},
        requested_bytes_per_tensor={t.name: int(r * lb) for t, r in zip(tensors, req_t)},
    )


def _window(start, end, track, T0, T1, n_tracks):
    """(program, access index) of every access in steps [T0, T1), in (step, slot, domain) order."""
    sel = np.flatnonzero((start < T1) & (end > T0))
    lo = np.maximum(start[sel], T0)
    cnt = np.minimum(end[sel], T1) - lo
    rep = np.repeat(sel, cnt)
    off = np.zeros(cnt.size + 1, dtype=np.int64)
    np.cumsum(cnt, out=off[1:])
    t = np.repeat(lo - off[:-1], cnt) + np.arange(rep.size, dtype=np.int64)
    cell = (t - T0) * n_tracks + track[rep]
    g = np.full((T1 - T0) * n_tracks, -1, dtype=np.int64)
    g[cell] = np.arange(rep.size)
    g = g[g >= 0]
    wg = rep[g]
    return wg, t[g] - start[wg]


def _window_sorted(start, end, dur, track, T0, T1, n_tracks):
    """As _window for programs of different speeds: accesses at ticks start + k*dur in [T0, T1)."""
    sel = np.flatnonzero((start < T1) & (end > T0))
    s, d = start[sel], dur[sel]
    n = (end[sel] - s) // d
    k_lo = np.clip(-(-(T0 - s) // d), 0, n)
    k_hi = np.clip(-(-(T1 - s) // d), 0, n)
    cnt = k_hi - k_lo
    rep = np.repeat(sel, cnt)
    off = np.zeros(cnt.size + 1, dtype=np.int64)
    np.cumsum(cnt, out=off[1:])
    k = np.repeat(k_lo - off[:-1], cnt) + np.arange(rep.size, dtype=np.int64)
    tau = start[rep] + k * dur[rep]
    order = np.argsort(tau * n_tracks + track[rep])  # keys are unique: one access per track per tick
    return rep[order], k[order]
