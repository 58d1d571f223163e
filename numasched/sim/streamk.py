"""A stream-K GEMM (kernels/gemm_streamk.py) in the L2 simulator.

``P`` persistent programs (one per CU by default) run whole waves of output tiles, then the
remaining tiles' K iterations in one equal piece per program, as
``numasched.mappings.streamk_units_reference`` assigns them: tile ids through the mapping policy,
pieces by program id (``piece_order="program"``, what the kernel does) or in the order of the
policy's domain remap (``"remap"``: under a chiplet policy a tile's pieces, and the partials its
merge reads, on one domain). Program p runs on domain p mod X (round-robin dispatch).

Accesses of a piece, one per time step (see core.py): its A and B tiles for each K iteration
(A_k, B_k, as GemmModel), then, for a tile cut into several pieces, the write of its fp32
partial tile (tensor P: two slots per program, as the kernel's workspace; write-allocate), and
for the piece that finishes last, the merge: a read of each of the tile's partial slots. Which
piece finishes last depends on the schedule: the simulator schedules once without merges, gives
each merge to the piece that ends last there, and schedules again (as RaggedDecodeModel does).
The output tile's store is not modelled (the same under every order).

What it answers for a GPU we do not have (MI300X: eight XCDs, private L2s): which piece order
serves more of the operand tiles and partials from an XCD's L2. Found (chiplet_tiled, bf16):
the remap order raises the partials' L2 hit rate (1024 x 5120 x 5120, 128 x 128 tiles: 0.26
against 0.00; 512 x 2560 x 8192: 0.38 against 0.10) but lowers the operands' (A: 0.29 against
0.70 at 512 x 2560 x 8192), so the overall hit rate is lower or equal (0.18 / 0.78 against
0.32 / 0.79) and the HBM bytes the same: the kernel keeps program order.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, replace

import numpy as np

from .. import mappings as M
from .models import GemmModel
from .units import TensorLines

PARTIAL_BYTES = 4  # fp32 partial tiles
PIECE_ORDERS = ("program", "remap")


@dataclass(frozen=True)
class StreamKGemmModel(GemmModel):
    """C = A @ B (A [M, K], B [K, N] row-major) by the stream-K kernel (see the module doc).

    Args:
        m, n, k, block_m, block_n, block_k, dtype_bytes: as GemmModel.
        programs: persistent programs; 0 = one per CU of the GPU (rounded down to whole domains).
        mapping: the GEMM policy the kernel takes ("auto": the topology's pick).
        piece_order: "program" (the kernel: piece p to program p) or "remap" (the policy's
            domain remap over the programs).
        k_aligned: a piece's head in the next tile (K from 0) before its tail
            (``options.gemm_streamk_k_aligned``, on by default); False: the tail first.
    """

    programs: int = 0
    mapping: str = "auto"
    piece_order: str = "program"
    k_aligned: bool = False
    schedule_dependent = True

    def __post_init__(self):
        super().__post_init__()
        if isinstance(self.programs, bool) or not isinstance(self.programs, (int, np.integer)) or self.programs < 0:
            raise ValueError(f"programs must be an integer >= 0, got {self.programs!r}")
        if self.piece_order not in PIECE_ORDERS:
            raise ValueError(f"piece_order must be one of {PIECE_ORDERS}, got {self.piece_order!r}")
        if not isinstance(self.k_aligned, (bool, np.bool_)):
            raise TypeError(f"k_aligned must be a bool, got {self.k_aligned!r}")

    @property
    def schedule_name(self) -> str:
        aligned = ", K-aligned" if self.k_aligned else ""
        return f"{getattr(self, '_policy_name', self.mapping)} stream-K ({self.piece_order} order{aligned})"

    @property
    def gemm_grid(self):
        return GemmModel.grid.fget(self)

    @property
    def grid(self):
        raise ValueError("grid: the stream-K model assigns work to its programs itself (no policy grid)")

    def bind(self, topology) -> "StreamKGemmModel":
        """A copy for this GPU: programs resolved, the policy picked, the assignment made."""
        X = topology.num_domains
        P = self.programs or topology.num_cus
        if not self.programs and X > 1 and P >= X:
            P -= P % X
        P = max(1, min(P, self.gemm_grid.size * self.k_steps))
        pol = M.resolve(self.mapping, "gemm", topology, self.gemm_grid)
        bound = replace(self, programs=P)
        units = M.streamk_units_reference(pol, self.gemm_grid, self.k_steps, P, X, piece_order=self.piece_order,
                                          with_ids=True, k_aligned=self.k_aligned)
        object.__setattr__(bound, "_units", units)
        object.__setattr__(bound, "_policy_name", pol.name)
        return bound

    def program_items(self, topology):
        return np.arange(self.programs, dtype=np.int64).reshape(-1, 1)

    # ------------------------------------------------------------------ pieces
    def _pieces(self):
        """Per piece, in program order: prog, tm, tn, k_lo, k_hi, tile, slot, n (pieces of its tile)."""
        rows = [(p, *u) for p, us in enumerate(self._units) for u in us]
        a = np.asarray(rows, dtype=np.int64).reshape(-1, 7)
        prog, tm, tn, lo, hi, tile, v = (a[:, i] for i in range(7))
        n_of = np.bincount(tile, minlength=int(tile.max()) + 1)
        n = n_of[tile]
        # the kernel's workspace: slot 0 of virtual program v for the tile its piece starts in (the
        # lower tile id of its split tiles, whichever part runs first), 1 else
        first_tile = np.full(self.programs, np.iinfo(np.int64).max, dtype=np.int64)
        split = n > 1
        np.minimum.at(first_tile, v[split], tile[split])
        slot = v * 2 + (tile != first_tile[v]).astype(np.int64)
        return dict(prog=prog, tm=tm, tn=tn, lo=lo, hi=hi, tile=tile, slot=slot, n=n)

    def _access_counts(self, pc, merge) -> np.ndarray:
        return 2 * (pc["hi"] - pc["lo"]) + (pc["n"] > 1) + np.where(merge, pc["n"], 0)

    def prepare(self, items, line):
        if not hasattr(self, "_units"):
            raise RuntimeError("a stream-K model must be bound to a topology first (simulate() does it)")
        self.check_line(line)
        plan = dict(line=line, pc=self._pieces())
        plan["merge"] = np.zeros(plan["pc"]["prog"].size, dtype=bool)
        self._table(plan)
        return plan

    def _table(self, plan) -> None:
        """The flat access table (tensor, r0, nr, c0, nc) of every access, program by program."""
        pc, merge, line = plan["pc"], plan["merge"], plan["line"]
        e = self.dtype_bytes
        cnt = self._access_counts(pc, merge)
        off = np.zeros(cnt.size + 1, dtype=np.int64)
        np.cumsum(cnt, out=off[1:])
        piece = np.repeat(np.arange(cnt.size), cnt)
        j = np.arange(off[-1], dtype=np.int64) - off[:-1][piece]
        lo, hi, tm, tn = pc["lo"][piece], pc["hi"][piece], pc["tm"][piece], pc["tn"][piece]
        nk = 2 * (hi - lo)
        is_op = j < nk
        is_w = (j == nk) & (pc["n"][piece] > 1)
        is_m = ~(is_op | is_w)
        kk = lo + (j >> 1)
        is_a = is_op & ((j & 1) == 0)
        kw = np.minimum(self.block_k, self.k - kk * self.block_k)
        pr_cols = self.block_n * PARTIAL_BYTES // line
        # the merge's reads: the slots of the tile's pieces, in program order
        slots_of_tile = {}
        for i in np.flatnonzero(pc["n"] > 1):
            slots_of_tile.setdefault(int(pc["tile"][i]), []).append(int(pc["slot"][i]))
        m_slot = np.zeros(j.size, dtype=np.int64)
        for i in np.flatnonzero(merge):
            s = sorted(slots_of_tile[int(pc["tile"][i])])
            m_slot[off[i] + 2 * (pc["hi"][i] - pc["lo"][i]) + 1: off[i + 1]] = s
        tensor = np.select([is_a, is_op, is_w | is_m], [0, 1, 2], 0)
        r0 = np.select([is_a, is_op, is_w, is_m], [tm * self.block_m, kk * self.block_k,
                                                   pc["slot"][piece] * self.block_m, m_slot * self.block_m], 0)
        nr = np.select([is_a, is_op], [np.minimum(self.block_m, self.m - tm * self.block_m), kw], self.block_m)
        c0 = np.select([is_a, is_op], [kk * self.block_k * e // line, tn * self.block_n * e // line], 0)
        nc = np.select([is_a, is_op], [kw * e // line, np.minimum(self.block_n, self.n - tn * self.block_n) * e // line],
                       pr_cols)
        plan.update(tensor=tensor, r0=r0, nr=nr, c0=c0, nc=nc)
        prog_cnt = np.bincount(pc["prog"], weights=cnt, minlength=self.programs).astype(np.int64)
        plan["prog_off"] = np.concatenate([[0], np.cumsum(prog_cnt)[:-1]])
        object.__setattr__(self, "_n_acc_cache", prog_cnt)

    def n_accesses(self, items):
        return np.asarray(self._n_acc_cache, dtype=np.int64)

    def place_merges(self, plan, items, start, dur) -> np.ndarray:
        """Give each split tile's merge to its piece that ends last under this schedule."""
        pc = plan["pc"]
        cnt = self._access_counts(pc, np.zeros(pc["prog"].size, dtype=bool))
        first = np.concatenate([[0], np.flatnonzero(np.diff(pc["prog"])) + 1])
        cum = np.cumsum(cnt)
        base = np.repeat(np.concatenate([[0], cum[first[1:] - 1]]), np.diff(np.concatenate([first, [cnt.size]])))
        end = start[pc["prog"]] + (cum - base) * np.asarray(dur)[pc["prog"]]
        merge = np.zeros(cnt.size, dtype=bool)
        idx = np.flatnonzero(pc["n"] > 1)
        if idx.size:
            order = np.lexsort((pc["prog"][idx], end[idx], pc["tile"][idx]))
            srt = idx[order]
            last = np.r_[pc["tile"][srt][1:] != pc["tile"][srt][:-1], True]
            merge[srt[last]] = True
        plan["merge"] = merge
        self._table(plan)
        return self._n_acc_cache

    # ------------------------------------------------------------------ KernelModel
    def tensors(self, line):
        pcols = self.block_n * PARTIAL_BYTES // line
        return GemmModel.tensors(self, line) + [TensorLines("P", 2 * self.programs * self.block_m, pcols,
                                                            self.block_m, pcols)]

    def tiles(self, plan, wg, k):
        idx = np.minimum(plan["prog_off"][wg] + k, plan["tensor"].size - 1)
        return plan["tensor"][idx], plan["r0"][idx], plan["nr"][idx], plan["c0"][idx], plan["nc"][idx]

    def flops(self, items):
        pc = self._pieces()
        rows = np.minimum(self.block_m, self.m - pc["tm"] * self.block_m)
        cols = np.minimum(self.block_n, self.n - pc["tn"] * self.block_n)
        f = 2.0 * rows * cols * (pc["hi"] - pc["lo"]) * self.block_k
        return np.bincount(pc["prog"], weights=f, minlength=items.shape[0])

    def to_dict(self) -> dict:
        d = asdict(self)
        d["kernel"] = "gemm_streamk"
        return d

    def describe(self) -> str:
        return (f"stream-K gemm M={self.m} N={self.n} K={self.k} tiles {self.block_m}x{self.block_n}x{self.block_k}, "
                f"{self.programs or 'one per CU'} programs, pieces in {self.piece_order} order, " +
                ("K-aligned" if self.k_aligned else "tail first"))
