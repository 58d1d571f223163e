"""A ragged decode batch (sequence b has ``lengths[b]`` tokens) under two schedules:

* ``"static"``: ``numasched.flash_decode``'s split kernel. B * HK * S programs, program g runs
  (b, kvh, s) = ``policy.reference(g)`` on ``DecodeGrid(B, HK, S)`` (the mapping policy, "auto" by
  default); split s of sequence b covers tokens [s*c_b, min((s+1)*c_b, len_b)), c_b =
  ceil(len_b / S): every sequence is cut into S splits of its own length. S: the host's choice,
  ``numasched.decode.choose_num_splits(B, HK, capacity, CUs)``, unless given.
* ``"worklist"``: ``numasched.plan_decode_worklist``'s persistent kernel. P programs (default
  ``PROGRAMS_PER_SM`` per CU); program g runs the items ``build_worklist`` gives it (its domain's
  queue, equal budgets), one after another.

Accesses of an item, one per time step (see core.py): the pair's G query rows (Q), then its K and
V tiles of ``block_n`` tokens over [lo, hi) (K0, V0, K1, V1, ...; the last tile partial), then, for
a pair of several items (splits), the write of its G partial rows (fp32, tensor P, counted as an
access that fills the writer's L2: write-allocate), and for the item that finishes last among its
pair's, the merge: a read of all of the pair's partial rows. Which item finishes last depends on
the schedule: the simulator schedules once without merges, gives each merge to the pair's item
that ends last there, and schedules again with them (the merger is not re-chosen). The lse
partials (4 bytes a row) and output writes are not modelled.

Layout: Q (B, H, D) and K, V (B, HK, capacity, D) contiguous in ``dtype_bytes``; the partials of a
pair are n * G rows of D fp32 from its first row (item j's rows j*G .. j*G + G - 1), pairs one
after another: the lines the kernel's head-major layout touches are the same per pair.

Time: ``core``'s roofline terms plus "tail": the busiest slot's bytes streamed at its fair share of
HBM bandwidth (hbm_bw / slots), i.e. the time when every slot streams at the same rate and the
slowest decides. It is a pessimistic bound (slots left running alone may stream faster than their
share) and the measure of imbalance this model exists for; ``slot_balance`` is the busiest slot's
bytes over the mean.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from math import gcd

import numpy as np

from .. import mappings as M
from .models import KernelModel, _bytes_to_lines, _ceil_div, _line_align
from .units import TensorLines

SCHEDULES = ("static", "worklist")
PARTIAL_BYTES = 4  # fp32 partials


@dataclass(frozen=True)
class RaggedDecodeModel(KernelModel):
    """Flash Decode of a ragged batch (see the module doc).

    Args:
        lengths: tokens per sequence (a tuple of ints >= 0, at least one > 0).
        heads, kv_heads, head_dim: as DecodeModel.
        schedule: "static" (the split kernel) or "worklist" (the persistent work-list kernel).
        splits: static: splits per (batch, kv_head); 0 = the host's choice for the GPU.
        programs: worklist: persistent programs; 0 = PROGRAMS_PER_SM per CU of the GPU.
        block_n: tokens per K/V tile.
        dtype_bytes: bytes per element of q and the cache.
        capacity: tokens per sequence in the cache (0: the longest length).
        queues: worklist: "auto" (one queue per locality domain, as the host plans) or an int
            (1: one queue, the domains ignored; the comparison that shows what the queues do).
    """

    lengths: tuple
    heads: int
    kv_heads: int
    head_dim: int
    schedule: str = "static"
    splits: int = 0
    programs: int = 0
    block_n: int = 64
    dtype_bytes: int = 2
    capacity: int = 0
    queues: object = "auto"
    kind = "decode"
    schedule_dependent = True
    tail_term = True

    def __post_init__(self):
        if isinstance(self.lengths, (str, bytes)):
            raise ValueError(f"lengths must be a sequence of ints, got the string {self.lengths!r}")
        try:
            raw = list(self.lengths)
        except TypeError:
            raise ValueError(f"lengths must be a sequence of ints, got {self.lengths!r}") from None
        # whole numbers only (numpy integers and integral arrays' elements included), never truncated
        if any(isinstance(x, bool) or not isinstance(x, (int, np.integer)) for x in raw):
            raise ValueError(f"lengths must be a sequence of ints, got {self.lengths!r}")
        lens = tuple(int(x) for x in raw)
        if not lens:
            raise ValueError(f"lengths must be a non-empty sequence of ints, got {self.lengths!r}")
        if min(lens) < 0 or max(lens) < 1:
            raise ValueError(f"lengths must be >= 0 with at least one > 0, got min {min(lens)}, max {max(lens)}")
        object.__setattr__(self, "lengths", lens)
        for f in ("heads", "kv_heads", "head_dim", "block_n", "dtype_bytes"):
            M.positive_int(f, getattr(self, f))
        for f in ("splits", "programs", "capacity"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 0:
                raise ValueError(f"{f} must be an integer >= 0, got {v!r}")
        if self.heads % self.kv_heads:
            raise ValueError(f"heads ({self.heads}) must be a multiple of kv_heads ({self.kv_heads})")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {SCHEDULES}, got {self.schedule!r}")
        if not (self.queues == "auto" or (isinstance(self.queues, int) and not isinstance(self.queues, bool)
                                          and self.queues >= 1)):
            raise ValueError(f"queues must be 'auto' or an int >= 1, got {self.queues!r}")
        if self.capacity and self.capacity < max(lens):
            raise ValueError(f"capacity ({self.capacity}) must be >= the longest length ({max(lens)})")

    # ------------------------------------------------------------------ sizes
    @property
    def batch(self) -> int:
        return len(self.lengths)

    @property
    def cap(self) -> int:
        return self.capacity or max(self.lengths)

    @property
    def group(self) -> int:
        return self.heads // self.kv_heads

    @property
    def schedule_name(self) -> str:
        if self.schedule == "worklist" and self.queues != "auto":
            return f"worklist ({self.queues} queue{'s' if self.queues != 1 else ''})"
        return self.schedule

    def bind(self, topology) -> "RaggedDecodeModel":
        """A copy for this GPU: splits resolved (static: numasched.decode.choose_num_splits for its
        CUs) or programs (worklist: PROGRAMS_PER_SM per CU) and the host's work list made."""
        if self.schedule == "static":
            if self.splits:
                return replace(self)
            from ..decode import choose_num_splits

            return replace(self, splits=choose_num_splits(self.batch, self.kv_heads, self.cap, topology.num_cus))
        from ..decode_worklist import PROGRAMS_PER_SM

        bound = replace(self, programs=self.programs or PROGRAMS_PER_SM * topology.num_cus)
        object.__setattr__(bound, "_wl", bound.worklist(topology))
        return bound

    @property
    def grid(self):
        if self.schedule != "static" or not self.splits:
            raise ValueError("grid: only a static model bound to a GPU (splits known) has a policy grid")
        return M.DecodeGrid(self.batch, self.kv_heads, self.splits)

    def program_items(self, topology):
        if self.schedule == "static":
            return None
        return np.arange(self.programs, dtype=np.int64).reshape(-1, 1)

    def worklist(self, topology):
        """The host's work list for this batch on this topology (worklist schedule)."""
        from ..decode_worklist import build_worklist, program_domains

        P = self.programs
        return build_worklist(np.asarray(self.lengths), self.kv_heads, P, program_domains(topology, P, self.queues),
                              group=self.group)

    # ------------------------------------------------------------------ items
    def _items(self, items: np.ndarray):
        """Per item, in program order: program, pair, lo, hi, j, n, and each program's items."""
        HK, lens = self.kv_heads, np.asarray(self.lengths, dtype=np.int64)
        if self.schedule == "static":
            b, kvh, s = items[:, 0], items[:, 1], items[:, 2]
            S = self.splits
            L = lens[b]
            c = _ceil_div(L, S)
            lo = np.minimum(s * c, L)
            hi = np.minimum(lo + c, L)
            prog = np.arange(items.shape[0], dtype=np.int64)
            return dict(prog=prog, pair=b * HK + kvh, lo=lo, hi=hi, j=s, n=np.full_like(s, S))
        wl = self._wl
        w = wl.work.astype(np.int64)
        L = lens[w[:, 0] // HK]
        hi = np.where(w[:, 2] < 0, L, np.minimum(w[:, 2], L))
        return dict(prog=wl.item_program.astype(np.int64), pair=w[:, 0], lo=w[:, 1], hi=hi, j=w[:, 3], n=w[:, 4])

    def _access_counts(self, it) -> np.ndarray:
        ntiles = _ceil_div(np.maximum(it["hi"] - it["lo"], 0), self.block_n)
        return 1 + 2 * ntiles + (it["n"] > 1)

    def prepare(self, items, line):
        """The access table of every program (a bound model: see :meth:`bind`)."""
        if self.schedule == "worklist" and not hasattr(self, "_wl"):
            raise RuntimeError("a worklist model must be bound to a topology first (simulate() does it)")
        plan = dict(line=line)
        plan["it"] = self._items(items)
        plan["merge"] = np.zeros(plan["it"]["pair"].size, dtype=bool)
        self._table(plan, items.shape[0])
        object.__setattr__(self, "_last_items", plan["it"])
        return plan

    def n_accesses(self, items):
        return np.asarray(self._n_acc_cache, dtype=np.int64)

    def _table(self, plan, n_programs: int) -> None:
        """The flat access table: (tensor, first line, lines) of every access, program by program."""
        it, merge = plan["it"], plan["merge"]
        rb = self.head_dim * self.dtype_bytes
        G, HK, bn = self.group, self.kv_heads, self.block_n
        prow_b = self.head_dim * PARTIAL_BYTES
        cnt = self._access_counts(it) + merge
        n_items = cnt.size
        # items are in program order already (static: one per program; worklist: work rows)
        off = np.zeros(n_items + 1, dtype=np.int64)
        np.cumsum(cnt, out=off[1:])
        item_of = np.repeat(np.arange(n_items), cnt)
        k = np.arange(off[-1], dtype=np.int64) - off[:-1][item_of]
        pair, lo, hi = it["pair"][item_of], it["lo"][item_of], it["hi"][item_of]
        b, kvh = pair // HK, pair % HK
        ntiles = _ceil_div(np.maximum(it["hi"] - it["lo"], 0), bn)[item_of]
        t = (k - 1) >> 1
        tok0 = lo + t * bn
        is_q = k == 0
        is_kv = (k >= 1) & (k <= 2 * ntiles)
        is_w = (k == 2 * ntiles + 1) & (it["n"][item_of] > 1)
        is_m = ~(is_q | is_kv | is_w)
        n_pair = it["n"][item_of]
        prow0 = plan["prow0"][pair] if "prow0" in plan else None
        if prow0 is None:
            rows_per = np.where(it["n"] > 1, it["n"] * G, 0)
            per_pair = np.zeros(self.batch * HK, dtype=np.int64)
            np.maximum.at(per_pair, it["pair"], rows_per)
            plan["prow0"] = np.concatenate([[0], np.cumsum(per_pair)[:-1]])
            plan["partial_rows"] = int(per_pair.sum())
            prow0 = plan["prow0"][pair]
        tensor = np.select([is_q, is_kv, is_w | is_m], [0, 1 + ((k - 1) & 1), 3], 0)
        addr = np.select([is_q, is_kv, is_w, is_m],
                         [(b * self.heads + kvh * G) * rb, (pair * self.cap + tok0) * rb,
                          (prow0 + it["j"][item_of] * G) * prow_b, prow0 * prow_b], 0)
        nb = np.select([is_q, is_kv, is_w, is_m],
                       [np.full_like(k, G * rb), np.minimum(bn, hi - tok0) * rb, np.full_like(k, G * prow_b),
                        n_pair * G * prow_b], 0)
        r0, nr, _, _ = _bytes_to_lines(addr, nb, plan["line"])
        plan["tensor"], plan["r0"], plan["nr"] = tensor, r0, nr
        plan["item_off"] = off
        prog_cnt = np.bincount(it["prog"], weights=cnt, minlength=n_programs).astype(np.int64)
        plan["prog_off"] = np.concatenate([[0], np.cumsum(prog_cnt)[:-1]])
        object.__setattr__(self, "_n_acc_cache", prog_cnt)

    def place_merges(self, plan, items, start, dur) -> np.ndarray:
        """Give each pair's merge to its item that ends last under this schedule (ties: the later
        program); returns the programs' new access counts."""
        it = plan["it"]
        cnt = self._access_counts(it)
        # items of a program are consecutive, in order: end of item i = start + accesses through i
        first = np.concatenate([[0], np.flatnonzero(np.diff(it["prog"])) + 1]) if cnt.size else cnt
        cum = np.cumsum(cnt)
        base = np.repeat(np.concatenate([[0], cum[first[1:] - 1]]) if first.size else first,
                         np.diff(np.concatenate([first, [cnt.size]])))
        end = start[it["prog"]] + (cum - base) * np.asarray(dur)[it["prog"]]
        multi = it["n"] > 1
        merge = np.zeros(cnt.size, dtype=bool)
        if multi.any():
            idx = np.flatnonzero(multi)
            order = np.lexsort((it["prog"][idx], end[idx], it["pair"][idx]))  # by pair, then end, program
            srt = idx[order]
            last = np.r_[it["pair"][srt][1:] != it["pair"][srt][:-1], True]
            merge[srt[last]] = True
        plan["merge"] = merge
        self._table(plan, start.size)
        return self._n_acc_cache

    # ------------------------------------------------------------------ KernelModel
    def tensors(self, line):
        rb = self.head_dim * self.dtype_bytes
        G = self.group
        lens = np.asarray(self.lengths, dtype=np.int64)
        # tile boundaries in tokens: every length, split/item boundary and tile start
        g = gcd(self.block_n, self.cap)
        g = int(np.gcd.reduce(np.concatenate([[g], lens])))
        if self.schedule == "static":
            g = int(np.gcd.reduce(np.concatenate([[g], _ceil_div(lens, self.splits)])))
        else:
            from ..decode_worklist import GRANULE

            g = gcd(g, GRANULE)
        q = TensorLines("Q", _ceil_div(self.batch * self.heads * rb, line), 1, _line_align(G * rb, line))
        kv_rows = _ceil_div(self.batch * self.kv_heads * self.cap * rb, line)
        kv_al = _line_align(max(1, g) * rb, line)
        prow_b = self.head_dim * PARTIAL_BYTES
        rows = max(1, self._partial_rows())
        p = TensorLines("P", _ceil_div(rows * prow_b, line), 1, _line_align(G * prow_b, line))
        return [q, TensorLines("K", kv_rows, 1, kv_al), TensorLines("V", kv_rows, 1, kv_al), p]

    def _partial_rows(self) -> int:
        if self.schedule == "static":
            return self.batch * self.kv_heads * self.splits * self.group if self.splits > 1 else 0
        return int(self._wl.partial_rows)

    def tiles(self, plan, wg, k):
        idx = np.minimum(plan["prog_off"][wg] + k, plan["tensor"].size - 1)
        return plan["tensor"][idx], plan["r0"][idx], plan["nr"][idx], None, None

    def flops(self, items):
        it = self._last_items
        f = 4.0 * self.group * np.maximum(it["hi"] - it["lo"], 0) * self.head_dim
        return np.bincount(it["prog"], weights=f, minlength=items.shape[0])

    def to_dict(self) -> dict:
        d = asdict(self)
        d["lengths"] = list(self.lengths)
        d["kernel"] = "decode_ragged"
        return d

    def describe(self) -> str:
        lens = np.asarray(self.lengths)
        what = (f"{self.splits} splits" if self.schedule == "static" else f"{self.programs} programs")
        return (f"ragged decode B={self.batch} lengths {int(lens.min())}..{int(lens.max())} (mean {lens.mean():.0f}) "
                f"H={self.heads} HK={self.kv_heads} D={self.head_dim} {self.schedule} ({what}), tile {self.block_n}")


def lengths_uniform(batch: int, seq: int, seed: int = 0, low_fraction: int = 16) -> tuple:
    """Lengths drawn uniformly from [seq // low_fraction, seq] (the ragged benchmark's batches)."""
    for name, v in (("batch", batch), ("seq", seq), ("low_fraction", low_fraction)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
            raise ValueError(f"{name} must be an int >= 1, got {v!r}")
    rng = np.random.default_rng(seed)
    return tuple(int(x) for x in rng.integers(max(1, seq // low_fraction), seq + 1, batch))
