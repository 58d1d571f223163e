"""Brute-force reference for the simulator: every cache line, plain Python, no shortcuts.

Deliberately written apart from ``core.py``/``units.py``/``lru.py``: its own address arithmetic
(bytes -> lines, row by row), its own step-by-step slot loop, one ``OrderedDict`` LRU per cache
set. It shares only the inputs: the Topology (``domain_of``), the mapping policy
(``reference``), the model's parameters, and the documented layout rule (tensors one after
another, each starting at a multiple of ``lcm(l2 sets, llc sets) * line`` bytes). Use it on small
cases only (about a microsecond per line access).

Order of accesses: a program takes, in id order within its domain, the slot that frees first
(lowest slot on ties); its k-th tile access happens at tick start + k * ticks[g]; all accesses are
processed sorted by (tick, slot, domain), each tile's lines in row-major order.
"""
from __future__ import annotations

from collections import OrderedDict
from math import gcd

from .core import TICKS, access_ticks, start_delays  # random draws are inputs (same seed, same draws)


def _lines(a: int, b: int, line: int):
    """Lines holding bytes [a, b)."""
    return list(range(a // line, (b - 1) // line + 1)) if b > a else []


def _bases(sizes, align):
    bases, nxt = [], 0
    for s in sizes:
        base = -(-nxt // align) * align
        bases.append(base)
        nxt = base + s
    return bases


def _attention_tiles(md, item, bases, line):
    b, h, m = item
    rb = md.head_dim * md.dtype_bytes
    q0, q1 = m * md.block_m, min((m + 1) * md.block_m, md.seq_q)
    qrow = (b * md.heads + h) * md.seq_q
    tiles = [_lines(bases[0] + (qrow + q0) * rb, bases[0] + (qrow + q1) * rb, line)]
    kend = md.seq_k if not md.causal else min(max(q1 + md.seq_k - md.seq_q, 0), md.seq_k)
    kvrow = (b * md.kv_heads + h // (md.heads // md.kv_heads)) * md.seq_k
    for n0 in range(0, kend, md.block_n):
        n1 = min(n0 + md.block_n, md.seq_k)
        for base in (bases[1], bases[2]):  # K then V
            tiles.append(_lines(base + (kvrow + n0) * rb, base + (kvrow + n1) * rb, line))
    return tiles


def _decode_tiles(md, item, bases, line):
    b, kvh, s = item
    rb = md.head_dim * md.dtype_bytes
    G = md.heads // md.kv_heads
    q = (b * md.heads + kvh * G) * rb
    tiles = [_lines(bases[0] + q, bases[0] + q + G * rb, line)]
    per = -(-md.seq_k // md.splits)
    per = -(-per // md.block_n) * md.block_n
    kvrow = (b * md.kv_heads + kvh) * md.seq_k
    for n0 in range(s * per, min((s + 1) * per, md.seq_k), md.block_n):
        n1 = min(n0 + md.block_n, md.seq_k)
        for base in (bases[1], bases[2]):
            tiles.append(_lines(base + (kvrow + n0) * rb, base + (kvrow + n1) * rb, line))
    return tiles


def _gemm_tiles(md, item, bases, line):
    tm, tn = item
    e = md.dtype_bytes
    tiles = []
    for k0 in range(0, md.k, md.block_k):
        k1 = min(k0 + md.block_k, md.k)
        a = []
        for r in range(tm * md.block_m, min((tm + 1) * md.block_m, md.m)):
            a += _lines(bases[0] + (r * md.k + k0) * e, bases[0] + (r * md.k + k1) * e, line)
        bt = []
        n0, n1 = tn * md.block_n, min((tn + 1) * md.block_n, md.n)
        for r in range(k0, k1):
            bt += _lines(bases[1] + (r * md.n + n0) * e, bases[1] + (r * md.n + n1) * e, line)
        tiles += [a, bt]
    return tiles


def _set_of(ln: int, sets: int, hashed: bool) -> int:
    """line mod sets, or the XOR of the address's log2(sets)-bit pieces."""
    if not hashed:
        return ln % sets
    r = 0
    while ln:
        r ^= ln % sets
        ln //= sets
    return r


def _lru(od: OrderedDict, key, ways: int) -> bool:
    if key in od:
        od.move_to_end(key)
        return True
    od[key] = None
    if len(od) > ways:
        od.popitem(last=False)
    return False


def simulate_lines(topology, model, policy, occupancy: int = 1, llc_ways: int = 16, jitter: float = 0.0,
                   skew: int = 0, seed: int = 0, set_hash: str = "xor") -> dict:
    """Line-level counts: requested, L2 hits (per domain), LLC hits, HBM lines."""
    line = topology.l2_line
    X = topology.num_domains
    hashed = set_hash == "xor"
    s2 = topology.l2_bytes // (line * topology.l2_ways)
    s3 = topology.llc_bytes // (line * llc_ways) if topology.llc_bytes else 0
    align = (s2 * s3 // gcd(s2, s3) if s3 else s2) * line
    kind = model.kind
    if kind == "attention":
        sizes = [model.batch * model.heads * model.seq_q, model.batch * model.kv_heads * model.seq_k,
                 model.batch * model.kv_heads * model.seq_k]
        sizes = [s * model.head_dim * model.dtype_bytes for s in sizes]
        tiles_of = _attention_tiles
    elif kind == "decode":
        sizes = [model.batch * model.heads, model.batch * model.kv_heads * model.seq_k,
                 model.batch * model.kv_heads * model.seq_k]
        sizes = [s * model.head_dim * model.dtype_bytes for s in sizes]
        tiles_of = _decode_tiles
    else:
        sizes = [model.m * model.k * model.dtype_bytes, model.k * model.n * model.dtype_bytes]
        tiles_of = _gemm_tiles
    bases = _bases(sizes, align)

    grid = model.grid
    W = grid.size
    items = policy.reference(list(range(W)), grid, X)
    doms = [int(d) for d in topology.domain_of(list(range(W)))]
    ticks = [int(t) for t in access_ticks(W, jitter, seed)]
    delays = [int(t) * (1 if jitter == 0 else TICKS) for t in start_delays(W, skew, seed)]
    tiles = [tiles_of(model, tuple(int(v) for v in items[g]), bases, line) for g in range(W)]
    # slots: a program takes the slot that frees first (lowest slot on ties), in id order per domain
    C = topology.cus_per_domain * occupancy
    free = [[0] * C for _ in range(X)]
    events = []  # (tick, slot, domain, program, access index)
    for g in range(W):
        d = doms[g]
        s = min(range(C), key=lambda i: (free[d][i], i))
        t0 = free[d][s] + delays[g]
        for k in range(len(tiles[g])):
            events.append((t0 + k * ticks[g], s, d, g, k))
        free[d][s] = t0 + len(tiles[g]) * ticks[g]
    events.sort()
    l2 = [dict() for _ in range(X)]  # set -> OrderedDict
    llc = {}
    req = [0] * X
    hit2 = [0] * X
    hit3 = [0] * X
    for _, _, d, g, k in events:
        for ln in tiles[g][k]:
            req[d] += 1
            if _lru(l2[d].setdefault(_set_of(ln, s2, hashed), OrderedDict()), ln, topology.l2_ways):
                hit2[d] += 1
            elif s3 and _lru(llc.setdefault(_set_of(ln, s3, hashed), OrderedDict()), ln, llc_ways):
                hit3[d] += 1
    return {"requested_lines": req, "l2_hit_lines": hit2, "llc_hit_lines": hit3,
            "hbm_lines": sum(req) - sum(hit2) - sum(hit3)}
