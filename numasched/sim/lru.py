"""Many independent set-associative LRU caches, simulated together with NumPy.

A *lane* is one cache set (or one class of sets that behave identically, see ``units.py``):
an ``ways``-way LRU over integer keys. :class:`LRUBank` holds ``n_lanes`` of them and keeps
their contents between calls, so a long access stream can be fed in chunks.

Why it is fast and still exact
------------------------------
Python cannot loop over 10^8 accesses, so the stream of each lane is cut into *rows* of
``seg`` accesses and all rows advance together, one column per NumPy step (lockstep over
thousands of rows: ~20 ns per access). A row does not know the cache state at its start, so it
first replays the ``warm`` accesses before it (warm-up, results discarded). This is exact
because of the LRU stack property: access i to key k hits iff fewer than ``ways`` distinct
other keys were touched since the previous access to k. Hence

* a key already seen inside the row (warm-up included) gets the true answer;
* a key seen for the first time in the row while the row's cache is already full (``ways``
  distinct keys since the row start) is a true miss;
* the only undecided case is a first sight while the row's cache still has an empty way.
  Such rows are recomputed with a warm-up twice as long, until it reaches the lane's start,
  where the answer is exact by construction.

The state carried between calls is each lane's top-``ways`` keys, in LRU-to-MRU order; it is
replayed as a prefix of the lane's next stream (an LRU that sees k1..kA gives exactly that
state). Consecutive repeats of a key in a lane are hits that do not change the LRU order, so
they are removed before the lockstep run.
"""
from __future__ import annotations

import numpy as np

_BIG = np.int32(1 << 29)  # subtracted from a matching way's stamp; stamps stay below 2**28


def _pow2_at_least(n: int) -> int:
    p = 1
    while p < n:
        p *= 2
    return p


def _lockstep(keys: np.ndarray, ways: int, check: int):
    """Run one LRU per column of ``keys`` ([T, R]) from an empty state.

    Returns (code [T, R] int8: 1 hit, 2 miss into an empty way, 0 miss with a full cache; full [R]: whether the cache had no empty way before column ``check``; final tags
    [ways, R]; final stamps [ways, R], negative for ways never filled).
    """
    T, R = keys.shape
    AP = _pow2_at_least(ways)
    if T * AP >= (1 << 28):
        raise ValueError("LRU row too long for int32 stamps")
    # int16 stamps when they fit: less memory traffic per step
    sdt, big = (np.int16, np.int16(1 << 14)) if T * AP < (1 << 13) else (np.int32, _BIG)
    tags = np.full((ways, R), -1, dtype=keys.dtype)
    # stamp*AP + way: the minimum over ways picks the LRU way and tells which way it is
    st = np.repeat((np.arange(ways, dtype=sdt) - AP)[:, None], R, axis=1)
    m_all = np.empty((T, R), dtype=sdt)
    eq = np.empty((ways, R), dtype=bool)
    sc = np.empty((ways, R), dtype=sdt)
    ar = np.arange(R, dtype=np.intp)
    tf, sf = tags.reshape(-1), st.reshape(-1)
    full = np.ones(R, dtype=bool)
    for t in range(T):
        if t == check:
            full = (st >= 0).all(axis=0)
        k = keys[t]
        np.equal(tags, k, out=eq)
        np.multiply(eq, big, out=sc)
        np.subtract(st, sc, out=sc)
        m = np.minimum.reduce(sc, axis=0)
        m_all[t] = m
        w = m & (AP - 1)
        flat = w.astype(np.intp) * R + ar
        tf[flat] = k
        sf[flat] = t * AP + w
    # classify here, where the hit threshold of this dtype is known: 1 hit, 2 empty-way miss, 0 miss
    code = (m_all < 0).view(np.int8) * 2 - (m_all < -(big // 2)).view(np.int8)
    return code, full, tags, st


class LRUBank:
    """``n_lanes`` independent ``ways``-way LRU caches, fed chunk by chunk."""

    def __init__(self, n_lanes: int, ways: int, key_dtype=np.int64, seg: int = 0, warm: int = 0):
        if n_lanes < 1 or ways < 1:
            raise ValueError(f"LRUBank needs n_lanes >= 1 and ways >= 1, got {n_lanes}, {ways}")
        self.n_lanes, self.ways = int(n_lanes), int(ways)
        self.key_dtype = np.dtype(key_dtype)
        self.state = np.full((self.n_lanes, self.ways), -1, dtype=self.key_dtype)  # LRU..MRU, -1 empty first
        self.seg, self.warm = seg, warm or 4 * self.ways
        self.rows_run = 0  # lockstep rows computed (statistics)
        self.rows_redone = 0

    def access(self, lane: np.ndarray, key: np.ndarray) -> np.ndarray:
        """Feed accesses (in time order); returns a bool array: hit or not, in the same order."""
        lane = np.asarray(lane)
        key = np.asarray(key)
        n = lane.size
        hits = np.ones(n, dtype=bool)
        if n == 0:
            return hits
        # group by lane, keeping time order (radix sort on 16-bit lanes)
        lt = lane.astype(np.uint16) if self.n_lanes <= 65536 else lane.astype(np.int64)
        order = np.argsort(lt, kind="stable")
        ls = lt[order]
        ks = key[order].astype(self.key_dtype, copy=False)
        keep = np.empty(n, dtype=bool)
        keep[0] = True
        np.not_equal(ks[1:], ks[:-1], out=keep[1:])
        keep[1:] |= ls[1:] != ls[:-1]  # drop consecutive repeats in a lane: hits, no LRU change
        kept = np.flatnonzero(keep)
        ls2, ks2 = ls[kept], ks[kept]
        cnt = np.bincount(ls2, minlength=self.n_lanes)
        active = np.flatnonzero(cnt)
        # prefix each active lane's stream with its carried state (non-empty keys, LRU first)
        st = self.state[active]
        nst = (st >= 0).sum(1)
        tot = nst + cnt[active]
        off = np.zeros(active.size + 1, dtype=np.int64)
        np.cumsum(tot, out=off[1:])
        comb = np.empty(int(off[-1]), dtype=self.key_dtype)
        # state part: empties are leading, so the non-empty ones are the last nst of each row
        col = np.arange(self.ways)
        smask = col[None, :] >= (self.ways - nst)[:, None]
        spos = off[:-1, None] + (col[None, :] - (self.ways - nst)[:, None])
        comb[spos[smask]] = st[smask]
        # chunk part: position in comb = rank in ls2 + per-lane shift
        first = np.zeros(self.n_lanes + 1, dtype=np.int64)
        np.cumsum(cnt, out=first[1:])
        shift = np.zeros(self.n_lanes, dtype=np.int64)
        shift[active] = off[:-1] + nst - first[active]
        rpos = np.arange(ls2.size, dtype=np.int64)
        rpos += shift[ls2]
        comb[rpos] = ks2

        code = self._run_lanes(comb, off, active)
        hits[order[kept]] = code[rpos] == 1  # dropped repeats stay True (hits)
        return hits

    # ------------------------------------------------------------------ rows
    def _run_lanes(self, comb, off, active):
        """Hit codes for the combined per-lane streams; updates self.state for ``active`` lanes."""
        lane_start, lane_end = off[:-1], off[1:]
        lens = lane_end - lane_start
        total = int(lens.sum())
        seg = self.seg or int(min(4096, max(256, -(-total // 8192))))
        nseg = -(-lens // seg)
        row_lane = np.repeat(np.arange(active.size), nseg)
        segoff = np.zeros(active.size + 1, dtype=np.int64)
        np.cumsum(nseg, out=segoff[1:])
        j = np.arange(row_lane.size) - segoff[row_lane]
        rec_start = lane_start[row_lane] + j * seg
        rec_end = np.minimum(rec_start + seg, lane_end[row_lane])
        ls_row = lane_start[row_lane]
        is_last = j == nseg[row_lane] - 1
        warm = np.full(row_lane.size, self.warm, dtype=np.int64)
        out = np.empty(comb.size, dtype=np.int8)
        todo = np.arange(row_lane.size)
        final_tags = np.full((row_lane.size, self.ways), -1, dtype=self.key_dtype)
        final_st = np.zeros((row_lane.size, self.ways), dtype=np.int32)
        comb_pad = np.concatenate([comb, np.zeros(seg + 1, dtype=comb.dtype)])
        while todo.size:
            start = np.maximum(ls_row[todo], rec_start[todo] - warm[todo])
            end = rec_end[todo]
            lens = end - start
            L = int(lens.max())
            if comb_pad.size < comb.size + L:
                comb_pad = np.concatenate([comb, np.zeros(L, dtype=comb.dtype)])
            # rows are contiguous slices of comb; columns past a row's end repeat its last key
            # (a hit on the MRU key: no change to the LRU order)
            K = np.lib.stride_tricks.sliding_window_view(comb_pad, L)[start]
            short = np.flatnonzero(lens < L)
            if short.size:
                cols = np.arange(L)
                K[short] = np.where(cols[None, :] < lens[short, None], K[short], comb[end[short] - 1][:, None])
            rec_off = rec_start[todo] - start
            from_lane_start = start == ls_row[todo]
            # rows not starting at their lane's start all have rec_off == warm of this pass
            w_pass = int(warm[todo][~from_lane_start].max()) if (~from_lane_start).any() else L
            code, full, tags, stamps = _lockstep(np.ascontiguousarray(K.T), self.ways, w_pass)
            self.rows_run += todo.size
            undecided = ~from_lane_start & ~full
            if undecided.any():  # exact check: an empty-way miss inside the recorded part?
                c = np.flatnonzero(undecided)
                cols = np.arange(L)[:, None]
                empty_miss = (code[:, c] == 2) & (cols >= rec_off[c][None, :]) & (cols < lens[c][None, :])
                undecided[c] = empty_miss.any(axis=0)
            # the state handed to the next chunk must be exact too
            undecided |= is_last[todo] & (stamps < 0).any(axis=0) & ~from_lane_start
            ok = np.flatnonzero(~undecided)
            # write back the recorded part of the decided rows
            rl = (end - rec_start[todo])[ok]
            rr = np.repeat(ok, rl)
            ro = np.zeros(ok.size + 1, dtype=np.int64)
            np.cumsum(rl, out=ro[1:])
            within = np.arange(rr.size, dtype=np.int64) - np.repeat(ro[:-1], rl)
            codeT = np.ascontiguousarray(code.T).reshape(-1)  # rows contiguous: a sequential gather
            out[rec_start[todo][rr] + within] = codeT[rr * L + rec_off[rr] + within]
            final_tags[todo[ok]] = tags[:, ok].T
            final_st[todo[ok]] = stamps[:, ok].T
            self.rows_redone += int(undecided.sum())
            warm[todo[undecided]] *= 2
            todo = todo[undecided]
        # new state of each active lane: its last row's ways sorted by stamp (empties first)
        last = np.nonzero(is_last)[0]
        o = np.argsort(final_st[last], axis=1, kind="stable")
        self.state[active[row_lane[last]]] = np.take_along_axis(final_tags[last], o, axis=1)
        return out


def lru_reference(keys, ways: int) -> np.ndarray:
    """One LRU over a key sequence, plain Python (for tests)."""
    stack: list = []
    out = np.zeros(len(keys), dtype=bool)
    for i, k in enumerate(keys):
        if k in stack:
            stack.remove(k)
            out[i] = True
        elif len(stack) == ways:
            stack.pop(0)
        stack.append(k)
    return out
