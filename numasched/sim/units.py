"""From tiles to *units*: groups of lines that an LRU cache treats as one.

Addresses
---------
Every tensor is a row-major matrix of cache lines ("line matrix"): ``rows`` rows of ``pitch``
lines, starting at ``base`` (a line index). Tensors that a kernel reads in whole rows (attention
Q/K/V, decode) are viewed in 1-D: pitch 1, one row per line, and a tile is the run of lines its
bytes touch. GEMM operands are viewed in 2-D: a tile is ``nr`` rows x ``nc`` lines. Every base
is a multiple of the number of sets of both caches, so a tensor's set pattern does not depend on
where the previous one ended.

Units
-----
A unit is ``rho`` consecutive rows x ``omega`` consecutive lines of one tensor. With set index
``line mod S`` (S sets, for the L2 and for the last-level cache), tile-level LRU equals
line-level LRU exactly when

1. the lines of a unit fall in pairwise different sets, and
2. any two units use either the same sets or disjoint sets ("classes" of sets), and
3. the lines of one unit are accessed back to back (a tile access reads its lines in row-major
   order, with no other access in between).

Then every set of a class sees the same sequence of units, so all its sets hold the same units
in the same LRU order and a unit hits or misses as a whole: one ``ways``-way LRU per class over
unit ids is the exact line-level result. (3) is the interleaving model: accesses of concurrent
workgroups interleave at tile granularity. The decomposition below picks the largest units that
satisfy (1) and (2) for both caches, by construction (gcd conditions), so the result is always
the line-level one; when the conditions force ``rho = omega = 1`` the simulation *is* line level
(only slower). Write g = gcd(pitch, S), pi = S / g, q = pitch / g:

* ``omega`` divides S of both caches, every pitch, every tile column offset and width;
* if all tensors share one pitch and pitch divides g (pitch | S) for both caches: ``rho``
  divides pi of both caches and every tile row offset and height. A unit's sets are then
  ``{band + g * ((q*r) mod pi)}`` for its rows r: the images of aligned blocks of rows under the
  bijection r -> q*r mod pi, which partition the sets (class id = block of ``q^-1``-rotated row);
* otherwise ``rho = 1``: a unit is ``omega`` lines of one row, sets ``[line, line+omega)``.

1-D tensors have pitch 1, so ``rho = gcd(S_l2, S_llc, all tile boundaries in lines)``: a unit is a
run of ``rho`` lines starting at a multiple of ``rho``.
"""
from __future__ import annotations

from dataclasses import dataclass
from math import gcd
from typing import List, Optional, Sequence

import numpy as np


@dataclass(frozen=True)
class TensorLines:
    """A tensor as a line matrix (see module doc)."""

    name: str
    rows: int
    pitch: int  # lines per row
    row_align: int  # every tile starts and ends on a multiple of this many rows (line-matrix rows)
    col_align: int = 1  # every tile column offset and width (in lines) is a multiple of this
    base: int = 0  # first line; set by layout()


def layout(tensors: Sequence[TensorLines], modulus: int) -> List[TensorLines]:
    """Place tensors one after another, each base a multiple of ``modulus`` lines."""
    out, nxt = [], 0
    for t in tensors:
        base = -(-nxt // modulus) * modulus
        out.append(TensorLines(t.name, t.rows, t.pitch, t.row_align, t.col_align, base))
        nxt = base + t.rows * t.pitch
    return out


@dataclass(frozen=True)
class CacheGeom:
    sets: int
    ways: int


def xor_fold(lines: np.ndarray, sets: int) -> np.ndarray:
    """Hashed set index: the line address cut into log2(sets)-bit pieces, XORed together.

    Only bits above the set bits change a line's set, so an aligned run of lines inside one
    ``sets``-line block keeps being an aligned run of sets (what units need)."""
    s = sets.bit_length() - 1
    x = np.asarray(lines, dtype=np.int64)
    r = x & (sets - 1)
    y = x >> s
    while y.any():
        r ^= y & (sets - 1)
        y >>= s
    return r


class Decomposition:
    """Unit shape and class ids for a set of tensors and caches.

    ``hashed``: set index = xor_fold(line) instead of line mod S (S must be a power of two). The
    XOR of higher bits is constant on an aligned run of lines inside one S-line block, so 1-D units
    are unchanged; 2-D units become single-row runs (rho = 1), whose lines stay in one block.
    """

    def __init__(self, tensors: Sequence[TensorLines], caches: Sequence[CacheGeom], hashed: bool = False):
        self.tensors = list(tensors)
        self.caches = list(caches)
        self.hashed = bool(hashed)
        S = [c.sets for c in caches]
        if self.hashed:
            bad = [s for s in S if s & (s - 1)]
            if bad:
                raise ValueError(f"set_hash='xor' needs a power-of-two number of sets, got {bad[0]}")
        omega = 0
        for s in S:
            omega = gcd(omega, s)
        for t in tensors:
            omega = gcd(omega, gcd(t.pitch, t.col_align))
        pitches = {t.pitch for t in tensors}
        rho = 1
        self.shared_pitch = None
        if len(pitches) == 1 and not (self.hashed and pitches != {1}):
            p = pitches.pop()
            if all(s % p == 0 for s in S):  # pitch | S: g = pitch, q = 1, column offsets < g
                self.shared_pitch = p
                rho = 0
                for s in S:
                    rho = gcd(rho, s // p)
                for t in tensors:
                    rho = gcd(rho, t.row_align)
        self.rho, self.omega = int(rho), int(omega)
        self.lines_per_unit = self.rho * self.omega
        self.n_classes = [s // self.lines_per_unit for s in S]

    def classes(self, first_line: np.ndarray, row, col, cache: int) -> np.ndarray:
        """Class (set group) of units, given each unit's first line (and row, col in the 2-D case)."""
        S = self.caches[cache].sets
        if self.hashed:  # unit = aligned run inside one S-line block (see class doc)
            return xor_fold(first_line, S) // self.lines_per_unit
        if self.shared_pitch is not None and self.rho > 1 and self.shared_pitch > 1:
            p = self.shared_pitch
            pi = S // p  # rows per period (g = p since p | S, q = 1)
            band = (col % p) // self.omega
            block = (row % pi) // self.rho
            return block * (p // self.omega) + band
        # 1-D (pitch 1): a unit is rho lines from a multiple of rho; rho == 1: omega lines of one
        # row. Either way its sets are the aligned band [first, first + lines_per_unit) mod S.
        return (first_line % S) // self.lines_per_unit

    def describe(self) -> str:
        return (f"{self.rho} row(s) x {self.omega} line(s) = {self.lines_per_unit} lines per unit, "
                f"set index {'xor-folded' if self.hashed else 'line mod sets'}")


def expand_units(dec: Decomposition, tensor: np.ndarray, r0: np.ndarray, nr: np.ndarray,
                 c0: Optional[np.ndarray], nc: Optional[np.ndarray]):
    """Unit accesses of tile accesses (all in line-matrix coordinates; c0 = nc = None: 1-D).

    Returns (source index of each unit access, first line, row, col) with a tile's units in
    row-block-major order (row-major line order, which the exactness argument needs); row and
    col are None for 1-D tensors.
    """
    rho, om = dec.rho, dec.omega
    base = np.array([x.base for x in dec.tensors], dtype=np.int64)[tensor]
    if c0 is None:  # 1-D: units are runs of rho lines
        cnt = nr // rho
        if (cnt == 1).all():
            return None, base + r0, None, None
        src = np.repeat(np.arange(cnt.size), cnt)
        off = np.zeros(cnt.size + 1, dtype=np.int64)
        np.cumsum(cnt, out=off[1:])
        first = np.repeat(base + r0 - off[:-1] * rho, cnt) + np.arange(src.size, dtype=np.int64) * rho
        return src, first, None, None
    nrb = nr // rho
    ncb = nc // om
    cnt = nrb * ncb
    src = np.repeat(np.arange(cnt.size), cnt)
    off = np.zeros(cnt.size + 1, dtype=np.int64)
    np.cumsum(cnt, out=off[1:])
    local = np.arange(src.size, dtype=np.int64) - off[:-1][src]
    ncb_s = ncb[src]
    rb, cb = local // ncb_s, local % ncb_s
    pitch = np.array([x.pitch for x in dec.tensors], dtype=np.int64)[tensor][src]
    row = r0[src] + rb * rho
    col = c0[src] + cb * om
    first = base[src] + row * pitch + col
    return src, first, row, col
