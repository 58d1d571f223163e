"""Several ranks in one CPU process (``SimWorld``): the Triton interpreter over a fake symmetric
heap per rank, for tests. The kernels, flags, epochs and remote stores are the real ones; only
the order of launches differs from a real context (every rank's producer phase before any
rank's consumer phase: the interpreter runs one program at a time)."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ._common import OPS, check_headers
from ._context import HEAP_ALIGN, MAX_WORLD, _Base, check_heap_bases


@dataclass
class _SimRank(_Base):
    world_: "SimWorld"
    rank: int
    heap: torch.Tensor = field(repr=False)

    def __post_init__(self):
        w = self.world_
        self.world, self.device, self.num_sms = w.world, w.device, w.num_sms
        self.max_spins, self.timeout_s = w.max_spins, 0.0
        self._init_common(self.heap.numel(), ranges=True, recycle=w.recycle)

    @property
    def heap_bases(self):
        return self.world_.heap_bases

    def _heap_base(self) -> int:
        return self.heap.data_ptr()

    def _heap_span(self) -> int:
        return self.heap.numel()

    def _alloc(self, numel, dtype, off):
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        buf = self.heap[off:off + nbytes]
        buf.zero_()
        return buf.view(dtype)


class SimWorld:
    """``world`` ranks in one process on CPU (Triton interpreter): a heap per rank, shared heap_bases.

    ``run(op, per_rank_args)`` plays one collective call: header check across ranks, buffers on
    first use, then each rank's producer phase before any rank's consumer phase. The kernels,
    flags, epochs and remote stores are the real ones. ``recycle``: as ``init(recycle=True)``.
    """

    def __init__(self, world: int, *, heap_bytes: int = 64 << 20, num_sms: int = 3, max_spins: int = 200,
                 device="cpu", recycle: bool = False, _heaps=None):
        for name, v in (("world", world), ("heap_bytes", heap_bytes), ("num_sms", num_sms), ("max_spins", max_spins)):
            if isinstance(v, bool) or not isinstance(v, int):
                raise TypeError(f"{name} must be an int, got {v!r}")
        for name, v in (("num_sms", num_sms), ("max_spins", max_spins)):
            if v < 1:
                raise ValueError(f"{name} must be >= 1, got {v}")
        if not 1 <= world <= MAX_WORLD:
            raise ValueError(f"world must be in 1..{MAX_WORLD}, got {world}")
        if heap_bytes < 1:
            raise ValueError(f"heap_bytes must be >= 1, got {heap_bytes}")
        self.world, self.num_sms, self.max_spins, self.recycle = world, num_sms, max_spins, bool(recycle)
        self.device = torch.device(device)
        if _heaps is None:
            # heaps at 256-byte aligned addresses, as Iris's are (see check_heap_bases)
            raw = [torch.zeros(heap_bytes + HEAP_ALIGN, dtype=torch.uint8, device=self.device) for _ in range(world)]
            heaps = [h[-h.data_ptr() % HEAP_ALIGN:][:heap_bytes] for h in raw]
        else:
            heaps = _heaps
        check_heap_bases([h.data_ptr() for h in heaps])
        self.heap_bases = torch.tensor([h.data_ptr() for h in heaps], dtype=torch.int64, device=self.device)
        self.ranks = [_SimRank(self, r, heaps[r]) for r in range(world)]

    def split(self, groups, *, heap_bytes: int = 16 << 20) -> list:
        """One SimWorld per group of ranks (lists of this world's ranks, disjoint), as
        ``numasched.distributed.init(group=...)`` gives one context per process group: each
        group's heap is carved from its members' heaps, its ranks are numbered 0.. in the order
        given, and its calls never touch another group's memory or flags."""
        seen = [r for g in groups for r in g]
        if len(set(seen)) != len(seen) or any(not 0 <= r < self.world for r in seen):
            raise ValueError(f"groups must be disjoint lists of ranks in 0..{self.world - 1}, got {groups}")
        worlds = []
        for g in groups:
            heaps = []
            for r in g:
                rk = self.ranks[r]
                heaps.append(rk.alloc((heap_bytes,), torch.uint8, what=f"the heap of group {g}")[:heap_bytes])
            worlds.append(SimWorld(len(g), num_sms=self.num_sms, max_spins=self.max_spins, device=self.device,
                                   recycle=self.recycle, _heaps=heaps))
        return worlds

    def run(self, op: str, per_rank_args: list, *, skip_ranks=(), **kwargs) -> list:
        """Results of ``op`` ("all_gather_matmul", ...) on every rank; ``per_rank_args[r]`` is a tuple
        of rank r's positional arguments, ``kwargs`` go to every rank.

        ``skip_ranks``: ranks that do not take part (to test timeouts): they neither push nor wait.
        """
        if not isinstance(per_rank_args, (list, tuple)) or any(not isinstance(a, (tuple, list)) for a in per_rank_args):
            raise TypeError(f"{op}: per_rank_args must be a list of per-rank argument tuples")
        return self.run_each(op, [(tuple(a), kwargs) for a in per_rank_args], skip_ranks=skip_ranks)

    def run_each(self, op: str, per_rank: list, *, skip_ranks=()) -> list:
        """Like :meth:`run` with per-rank keyword arguments: ``per_rank[r] = (args, kwargs)``."""
        if op not in OPS:
            raise ValueError(f"unknown op {op!r}; one of {sorted(OPS)}")
        spec = OPS[op]
        if not isinstance(per_rank, (list, tuple)) or len(per_rank) != self.world:
            raise ValueError(f"{op}: give one entry per rank ({self.world}), got "
                             f"{len(per_rank) if isinstance(per_rank, (list, tuple)) else type(per_rank).__name__}")
        for r, entry in enumerate(per_rank):
            if (not isinstance(entry, tuple) or len(entry) != 2 or not isinstance(entry[0], (tuple, list))
                    or not isinstance(entry[1], dict)):
                raise TypeError(f"{op}: rank {r}'s entry must be (positional args tuple, kwargs dict), got "
                                f"{type(entry).__name__}")
        bad = [r for r in skip_ranks if isinstance(r, bool) or not isinstance(r, int) or not 0 <= r < self.world]
        if bad:
            raise ValueError(f"skip_ranks must be ranks in [0, {self.world}), got {bad}")
        for ctx in self.ranks:
            ctx._ensure_usable()
        calls = [spec.prepare(ctx, *per_rank[ctx.rank][0], **per_rank[ctx.rank][1]) for ctx in self.ranks]
        key = calls[0].key
        if any(c.key != key for c in calls) or key not in self.ranks[0].plans:
            check_headers(op, [c.header for c in calls])
            for ctx, c in zip(self.ranks, calls):
                with ctx.making_plan(c.key):
                    ctx.plans[c.key] = spec.plan(ctx, c)
        live = [ctx for ctx in self.ranks if ctx.rank not in skip_ranks]
        for ctx in live:
            if ctx.recycle:
                ctx.used(calls[ctx.rank].key, False)
        results = [None] * self.world
        phases = spec.sim_phases
        for ph in phases:
            for ctx in live:
                out = spec.launch(ctx, ctx.plans[calls[ctx.rank].key], calls[ctx.rank], phase=ph)
                if out is not None:
                    results[ctx.rank] = out
        for ctx in live:
            ctx.check(op)
        return results
