"""Contexts: one process per GPU over Iris (``DistContext``); the simulated ranks of
``SimWorld`` (all ranks in one CPU process) live in :mod:`._sim`.

Both run the same kernels and the same host planning code (:mod:`._common` and one module per
collective); they differ in how symmetric memory is allocated, how the per-op header is
exchanged, and how launches are ordered (a real context launches one fused kernel per call; the
simulation launches each rank's producer phase before any consumer phase, because the
interpreter runs one program at a time).

The op modules depend on this module (heap budget, contexts), never the reverse.
"""
from __future__ import annotations

import bisect
import contextlib
import math
import os
import socket
from typing import Dict, List, Optional

import torch

MIN_ALLOC = 2 << 20          # Iris's vmem_chunked allocator rounds every allocation up to a power
DEFAULT_HEAP = 1 << 30       # of two of at least 2 MiB; the budget uses the same rule everywhere.
MAX_WORLD = 8                # flags name ranks as bits of an int32 status word; one host
# the status word: bit r, a wait of this rank ran the whole bound for rank r; bit STATUS_AFTER + r,
# rank r was missing at a wait after that (waits then give up at once; kernels/dist_common.py)
STATUS_AFTER = 16


def alloc_bytes(nbytes: int) -> int:
    """Bytes one symmetric allocation of ``nbytes`` takes from the heap (power of two, >= 2 MiB)."""
    return max(MIN_ALLOC, 1 << max(0, int(nbytes) - 1).bit_length())


class _Base:
    """What the ops need from a context: rank, world, device, heap allocation, status checking."""

    rank: int
    world: int
    device: torch.device
    heap_bases: torch.Tensor
    num_sms: int
    max_spins: int
    timeout_s: float
    wait_clock: bool = False   # waits bounded by the GPU clock (NVIDIA), else by max_spins polls

    @property
    def wait_bound(self) -> int:
        """The kernels' wait bound: nanoseconds with ``wait_clock``, else polls."""
        return int(self.timeout_s * 1e9) if self.wait_clock else int(self.max_spins)

    def _init_common(self, heap_bytes: int, *, ranges: bool = False, recycle: bool = False):
        """``ranges``: numasched places the buffers in a slab of its own (a group context, the
        simulation, ``recycle``), so it knows where each lies and can give plans' buffers back."""
        self.heap_bytes = int(heap_bytes)
        self.used_bytes = 0
        self.heap_owners: Dict[str, list] = {}   # owner -> [bytes, buffers]: who holds the heap (alloc's owner)
        self.plans: Dict[tuple, object] = {}
        self.broken: Optional[str] = None
        self.status = torch.zeros(1, dtype=torch.int32, device=self.device)  # bit r: rank r timed out
        if recycle and not ranges:
            raise ValueError("recycle needs a context that places its buffers itself (ranges=True)")
        self.recycle = bool(recycle)
        self._ranges = HeapRanges(self.heap_bytes) if ranges else None
        self._plan_heap: Dict[tuple, list] = {}   # plan key -> [(offset, bytes, owner)] of its heap buffers
        self._building: Optional[tuple] = None     # the key whose plan is being made (see making_plan)
        self._last_use: Dict[tuple, int] = {}      # plan key -> the call count at its latest call
        self._calls = 0
        self.pinned: set = set()                  # keys of plans a CUDA graph was captured with
        self.recycled = 0                         # plans whose buffers were given back (recycle)

    # --------------------------------------------------------------- symmetric memory
    def alloc(self, shape, dtype, *, what: str, owner: Optional[str] = None) -> torch.Tensor:
        """A zeroed symmetric tensor (same offset on every rank; call in the same order everywhere).
        ``owner`` (default ``what``): whom the heap-too-small error counts the bytes against."""
        numel = math.prod(shape)
        nbytes = alloc_bytes(numel * torch.empty((), dtype=dtype).element_size())
        if not self._placeable([nbytes]) and not self._recycle_for(nbytes):
            left = self.heap_bytes - self.used_bytes
            frag = (f" ({self._ranges.largest() / 2**20:.1f} MiB in one piece)"
                    if self._ranges is not None and self._ranges.largest() < min(left, nbytes) else "")
            advice = ("" if self.recycle else ", or init(recycle=True) to let plans that no CUDA graph holds give "
                      "their buffers back")
            raise ValueError(
                f"symmetric heap too small: {what} needs {nbytes / 2**20:.1f} MiB but only "
                f"{left / 2**20:.1f} of {self.heap_bytes / 2**20:.1f} MiB are left{frag}"
                f"{self._heap_holders()}{self._pinned_note()}; create the context with a larger heap_bytes, or pass "
                f"workload=[...] to init() (numasched.distributed.required_heap_bytes computes it){advice}")
        off = self._ranges.take(nbytes) if self._ranges is not None else None
        self.used_bytes += nbytes
        owner = owner or what
        rec = self.heap_owners.setdefault(owner, [0, 0])
        rec[0] += nbytes
        rec[1] += 1
        if self._building is not None:
            self._plan_heap.setdefault(self._building, []).append((off, nbytes, owner))
        return self._alloc(numel, dtype, off).view(*shape)

    # --------------------------------------------------------------- plans' buffers (recycle)
    @contextlib.contextmanager
    def making_plan(self, key):
        """Buffers allocated inside belong to the plan of ``key`` (given back with it, recycle)."""
        self._building = key
        try:
            yield
        except BaseException:
            if self._ranges is not None:   # a plan that failed half way keeps nothing (a slab: we free)
                self._release(key)
            else:                          # Iris placed them: only our record of them goes
                self._plan_heap.pop(key, None)
            raise
        finally:
            self._building = None

    def used(self, key, capturing: bool) -> None:
        """A call of the plan of ``key``: its recency, and whether a CUDA graph now holds it."""
        self._calls += 1
        self._last_use[key] = self._calls
        if capturing:
            self.pinned.add(key)

    def _victims(self) -> list:
        """Keys of the plans recycle may give back, least recently called first."""
        return sorted((k for k in self._plan_heap if k not in self.pinned and k != self._building),
                      key=lambda k: self._last_use.get(k, 0))

    def _placeable(self, sizes, victims=()) -> bool:
        """Whether buffers of these sizes fit, placed largest first as ``alloc`` would, once the
        plans of ``victims`` were given back (a simulation: nothing changes)."""
        sizes = sorted(sizes, reverse=True)
        freed = [(off, b) for k in victims for off, b, _ in self._plan_heap.get(k, ())]
        if self.used_bytes - sum(b for _, b in freed) + sum(sizes) > self.heap_bytes:
            return False
        if self._ranges is None:
            return True
        ranges = self._ranges.copy()
        for off, b in freed:
            ranges.give(off, b)
        return all(ranges.take(b) is not None for b in sizes)

    def heap_room(self, sizes) -> bool:
        """Whether buffers of these allocation sizes (alloc_bytes) would fit, counting what recycle
        could give back; the same verdict on every rank (their heaps are used alike)."""
        return self._placeable(list(sizes), self._victims() if self.recycle else ())

    def make_room(self, sizes) -> None:
        """With recycle: give back the least recently called plans that no CUDA graph holds until
        buffers of ``sizes`` fit (placed largest first), or none where they would not fit even
        then (``alloc`` raises the error). Every rank runs it at the same call (the same calls made
        in the same order fill the heap alike), waits for all its work, then for every rank (no
        kernel of a plan given back still runs anywhere), and frees the same plans: the offsets
        stay symmetric."""
        sizes = list(sizes)
        if not self.recycle or self._placeable(sizes):
            return
        victims = self._victims()
        if not victims or not self._placeable(sizes, victims):
            return   # not even with every plan given back: keep them
        if self.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return   # no synchronisation inside a capture: the caller gets the error
        self._quiesce()
        for k in victims:
            self._release(k)
            self.recycled += 1
            if self._placeable(sizes):
                return

    def _recycle_for(self, nbytes: int) -> bool:
        """An allocation outside a plan (``alloc`` of a caller's buffer) that does not fit: make
        room for it as for a plan's (:meth:`make_room`)."""
        self.make_room([nbytes])
        return self._placeable([nbytes])

    def _release(self, key) -> None:
        """Give the plan of ``key``'s heap buffers back and forget the plan (made again on its next call)."""
        for off, nbytes, owner in self._plan_heap.pop(key, ()):
            if off is not None:
                self._ranges.give(off, nbytes)
            self.used_bytes -= nbytes
            rec = self.heap_owners[owner]
            rec[0] -= nbytes
            rec[1] -= 1
            if rec[1] == 0:
                del self.heap_owners[owner]
        self.plans.pop(key, None)
        self._last_use.pop(key, None)

    def _quiesce(self) -> None:
        """Before buffers are reused: every rank's earlier work done (a real context: device sync
        and a barrier of the group; the simulation runs one call at a time)."""

    def _pinned_note(self) -> str:
        if not self.recycle or not self.pinned:
            return ""
        held = sum(b for k in self.pinned for _, b, _ in self._plan_heap.get(k, ()))
        return f"; {len(self.pinned)} plan(s) holding {held / 2**20:.1f} MiB are in CUDA graphs and stay"

    def _heap_holders(self, top: int = 4) -> str:
        """The heap-too-small error's " (held by OWNER X MiB in N buffers, ...)": the largest owners
        first (every call signature keeps its buffers for the context's life); "" for an empty heap."""
        if not self.heap_owners:
            return ""
        held = sorted(self.heap_owners.items(), key=lambda kv: -kv[1][0])
        parts = [f"{name} {b / 2**20:.1f} MiB in {n} buffer{'s' if n > 1 else ''}" for name, (b, n) in held[:top]]
        if len(held) > top:
            parts.append(f"{len(held) - top} more")
        keeps = ("plans in CUDA graphs keep theirs, recycle gave back the others it could" if self.recycle
                 else "each call signature keeps its buffers")
        return f" (held by {', '.join(parts)}: {keeps})"

    def heap_offset(self, t: torch.Tensor) -> Optional[int]:
        """The byte offset of ``t``'s first element from this rank's heap base where all of ``t``
        lies in the symmetric heap (a tensor from :meth:`alloc`, or a view of one), else None.
        Tensors at the same offset on every rank are symmetric: a peer can store into ours."""
        if t.device != self.device or t.numel() == 0:
            return None
        off = t.data_ptr() - self._heap_base()
        extent = (sum((n - 1) * st for n, st in zip(t.shape, t.stride())) + 1) * t.element_size()
        return off if off >= 0 and off + extent <= self._heap_span() else None

    # --------------------------------------------------------------- errors
    def check(self, op: str = "distributed op") -> None:
        """Raise TimeoutError if a wait gave up (reads a device word: synchronizes the stream)."""
        if self.broken:
            raise RuntimeError(self.broken)
        bits = int(self.status.item())
        if bits:
            ranks, behind = timed_out_ranks(bits, self.world)
            glob = getattr(self, "global_ranks", None)
            if glob is not None and glob != list(range(self.world)):   # a group context: say both numberings
                ranks, behind = ([f"{r} (global rank {glob[r]})" for r in rs] for rs in (ranks, behind))
            also = (f"; after that this rank stopped waiting, and rank(s) {behind} had not signalled either (alive "
                    f"ranks are behind then too, having waited out the bound themselves)" if behind else "")
            self.broken = (f"rank {self.rank}: a previous call timed out waiting for rank(s) {ranks}; this "
                           f"context's flags are out of step: create a new context")
            raise TimeoutError(
                f"{op} on rank {self.rank}: rank(s) {ranks} never signalled within the wait bound "
                f"(~{self.timeout_s:g} s{'' if self.wait_clock else f', {self.max_spins} polls'}); did every rank "
                f"make the same call?{also}")

    def _ensure_usable(self):
        if self.broken:
            raise RuntimeError(self.broken)


def timed_out_ranks(bits: int, world: int) -> tuple:
    """(ranks this rank waited the whole bound for, further ranks missing only at the waits after
    that) from a status word (STATUS_AFTER). A word with only the second kind (no first timeout
    recorded) names those as the first."""
    first = [r for r in range(world) if bits >> r & 1]
    after = [r for r in range(world) if bits >> (STATUS_AFTER + r) & 1 and r not in first]
    return (first, after) if first else (after, [])


# ============================================================================ one GPU per process
def _peer_access_error(devices: List[int], hosts: List[str], access: List[List[Optional[bool]]],
                       gpu_ids: Optional[List[str]] = None) -> Optional[str]:
    """Why these ranks cannot share an Iris heap, or None (pure function: tested on CPU).

    devices[i]: rank i's device index; gpu_ids[i]: its GPU's UUID (default: the index);
    access[i][j]: can rank i's GPU access rank j's as a peer (None: rank j's GPU is not visible to
    rank i, e.g. CUDA_VISIBLE_DEVICES differs per process).
    """
    gpu_ids = [str(d) for d in devices] if gpu_ids is None else [str(g) for g in gpu_ids]
    if len(set(hosts)) > 1:
        return (f"numasched.distributed needs every rank on one host (Iris maps peer memory through the "
                f"local driver); ranks run on {sorted(set(hosts))}")
    if len(set(gpu_ids)) < len(gpu_ids):
        return f"two ranks share a GPU (GPUs by rank: {gpu_ids}); run one rank per GPU"
    n = len(devices)
    hidden = [(i, j) for i in range(n) for j in range(n) if i != j and access[i][j] is None]
    if hidden:
        i, j = hidden[0]
        return (f"rank {j}'s GPU is not visible to rank {i} (CUDA_VISIBLE_DEVICES differs between ranks?); "
                f"Iris needs every GPU visible to every rank, one rank per GPU (rank r uses GPU r)")
    bad = [(i, j) for i in range(n) for j in range(n) if i != j and not access[i][j]]
    if bad:
        i, j = bad[0]
        return (f"GPU {devices[i]} (rank {i}) cannot access GPU {devices[j]} (rank {j}) as a peer "
                f"(torch.cuda.can_device_access_peer is False; pairs without access: {bad}). Iris needs "
                f"peer-to-peer access between every pair of GPUs, NVLink in practice")
    return None


class DistContext(_Base):
    """Iris symmetric heap + per-op buffers, flags and epochs for one rank (one process per GPU).

    Create with :func:`numasched.distributed.init` after ``torch.distributed.init_process_group("nccl")``.
    """

    def __init__(self, heap_bytes: int, *, timeout_s: float = 30.0, allocator: Optional[str] = None, group=None,
                 bounded_only: bool = False, recycle: bool = False):
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("numasched.distributed.init: call torch.distributed.init_process_group('nccl') "
                               "first (launch with torchrun)")
        if not torch.cuda.is_available():
            raise RuntimeError("numasched.distributed.init needs CUDA/ROCm GPUs (on CPU use SimWorld for tests)")
        # group: the ranks this context's ops run over (a TP group inside a larger job); None: all.
        # The Iris heap spans the whole world (every rank creates it, collectively); a group
        # context addresses only its members' heaps and takes its buffers from a slab of its own.
        self.group = group
        members = list(range(dist.get_world_size())) if group is None else dist.get_process_group_ranks(group)
        self.global_ranks = members
        self.rank = members.index(dist.get_rank()) if dist.get_rank() in members else -1
        self.world = len(members)
        # (a rank outside its group is refused below, on every rank at once: raising here alone
        # would leave the other ranks waiting in the world-wide exchange)
        if dist.get_world_size() > MAX_WORLD:
            raise ValueError(f"world size {dist.get_world_size()} > {MAX_WORLD}: one host of up to {MAX_WORLD} GPUs "
                             f"is supported")
        if self.world > MAX_WORLD:
            raise ValueError(f"world size {self.world} > {MAX_WORLD}: one host of up to {MAX_WORLD} GPUs is supported")
        dev = dist.get_rank() % torch.cuda.device_count()   # Iris binds rank r to GPU r mod count
        torch.cuda.set_device(dev)
        # peer access: every rank reports which GPUs (by UUID) it can reach, every rank decides alike
        def uuid(d):
            return str(getattr(torch.cuda.get_device_properties(d), "uuid", d))

        reach = {uuid(d): (d == dev or torch.cuda.can_device_access_peer(dev, d))
                 for d in range(torch.cuda.device_count())}
        rows: list = [None] * dist.get_world_size()
        dist.all_gather_object(rows, (socket.gethostname(), dev, uuid(dev), reach, self.rank >= 0))
        outside = [r for r, row in enumerate(rows) if not row[4]]
        if outside:
            raise ValueError(f"group: global rank(s) {outside} passed a group they are not members of; every rank "
                             f"passes its own group (this rank's: {members})")
        rows = [rows[g] for g in members]
        ids = [r[2] for r in rows]
        access = [[rows[i][3].get(ids[j]) for j in range(self.world)] for i in range(self.world)]
        err = _peer_access_error([r[1] for r in rows], [r[0] for r in rows], access, ids)
        if err:
            raise RuntimeError(err)

        if allocator is None:   # NVIDIA: only vmem_chunked works ("torch" needs DMA-BUF export, AMD only)
            allocator = os.environ.get("IRIS_ALLOCATOR") or ("torch" if torch.version.hip else "vmem_chunked")
        try:
            import iris
        except Exception as e:  # OSError without a CUDA runtime, ImportError without the package
            raise ImportError(f"numasched.distributed needs Iris: pip install tokenspeed-iris ({e})") from e
        # a group context, and one that recycles plans' buffers, sub-allocate one slab (numasched
        # places every buffer): the Iris heap gets room for the slab's power-of-two rounding
        slab = group is not None or recycle
        self._iris_bytes = int(heap_bytes) * (2 if slab else 1)
        self.iris = iris.iris(self._iris_bytes, allocator_type=allocator)
        self.allocator = allocator
        self.device = torch.device(f"cuda:{dev}")
        bases = self.iris.get_heap_bases()
        self._slab = None
        if group is not None:
            bases = bases[torch.tensor(members, device=bases.device)].contiguous()
        if slab:
            self._slab = self.iris.zeros(int(heap_bytes), dtype=torch.uint8)
        self.heap_bases = bases
        self.heap_bases_host = [int(x) for x in self.heap_bases.cpu().tolist()]   # for copy-engine pushes
        try:   # agreed across ranks: a rank that raised alone would leave the others in the barrier below
            check_heap_bases(self.heap_bases_host)
            bad_bases = None
        except RuntimeError as e:
            bad_bases = str(e)
        verdicts: list = [None] * dist.get_world_size()
        dist.all_gather_object(verdicts, bad_bases)
        bad = [(r, v) for r, v in enumerate(verdicts) if v]
        if bad:
            raise RuntimeError(f"rank {bad[0][0]}: {bad[0][1]}")
        self.side_stream = None
        self.num_sms = torch.cuda.get_device_properties(dev).multi_processor_count
        self._init_common(heap_bytes, ranges=slab, recycle=recycle)
        self.timeout_s = float(timeout_s)
        self.bounded_only = bool(bounded_only)   # impl="auto" never picks torch's symm_mem or NCCL (init's doc)
        self.max_spins = self._spins_for(self.timeout_s)
        # NVIDIA: bound waits by %globaltimer (a poll count is far too long when every program of a
        # grid polls at once); AMD keeps the calibrated poll count (no clock path written yet)
        self.wait_clock = torch.version.hip is None
        dist.barrier()

    def _heap_base(self) -> int:
        return self.heap_bases_host[self.rank]

    def _heap_span(self) -> int:
        return self._iris_bytes

    def _alloc(self, numel, dtype, off):
        if self._slab is None:
            return self.iris.zeros(numel, dtype=dtype)
        # a slab (group context, recycle): the same offsets on every member, because members make
        # the same calls (HeapRanges is deterministic)
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        buf = self._slab[off:off + nbytes]
        buf.zero_()
        return buf.view(dtype)

    def _quiesce(self) -> None:
        self.barrier()

    def exchange(self, obj) -> list:
        """Every member's ``obj`` (host collective; used once per new op signature)."""
        import torch.distributed as dist

        out: list = [None] * self.world
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def barrier(self):
        import torch.distributed as dist

        torch.cuda.synchronize()
        dist.barrier(group=self.group)

    def _spins_for(self, timeout_s: float) -> int:
        """Polls that take about ``timeout_s``: time a bounded wait on a flag nobody sets."""
        from numasched.kernels.dist_common import spin_ns

        try:
            ns = max(spin_ns(self.device), 20.0)
        except Exception:  # calibration is a nicety; assume 1 us per poll
            ns = 1000.0
        self.spin_ns = ns
        return int(min(2**31 - 1, max(1000, timeout_s * 1e9 / ns)))


HEAP_ALIGN = 256


class HeapRanges:
    """Where a slab's buffers lie: free ranges, first fit, neighbours merged when given back.
    Deterministic, so ranks that allocate and free alike get the same offsets (the heap stays
    symmetric). Without frees it hands out offsets in order, as a bump allocator would."""

    def __init__(self, size: int):
        self.size = int(size)
        self.free: List[list] = [[0, self.size]] if size > 0 else []   # [offset, bytes], by offset

    def copy(self) -> "HeapRanges":
        other = HeapRanges(0)
        other.size, other.free = self.size, [list(r) for r in self.free]
        return other

    def largest(self) -> int:
        return max((n for _, n in self.free), default=0)

    def take(self, nbytes: int) -> Optional[int]:
        """The offset of ``nbytes`` in the first free range that holds them, or None."""
        for i, (off, n) in enumerate(self.free):
            if n >= nbytes:
                if n == nbytes:
                    del self.free[i]
                else:
                    self.free[i] = [off + nbytes, n - nbytes]
                return off
        return None

    def give(self, off: int, nbytes: int) -> None:
        """Free [off, off + nbytes) (it must be taken and lie in the slab)."""
        if off < 0 or nbytes <= 0 or off + nbytes > self.size:
            raise ValueError(f"range [{off}, {off + nbytes}) is outside the slab of {self.size} bytes")
        i = bisect.bisect_left(self.free, [off, 0])
        if (i > 0 and self.free[i - 1][0] + self.free[i - 1][1] > off) or (
                i < len(self.free) and off + nbytes > self.free[i][0]):
            raise ValueError(f"range [{off}, {off + nbytes}) is already free")
        self.free.insert(i, [off, nbytes])
        if i + 1 < len(self.free) and off + nbytes == self.free[i + 1][0]:   # merge with the next
            self.free[i][1] += self.free.pop(i + 1)[1]
        if i > 0 and self.free[i - 1][0] + self.free[i - 1][1] == off:       # and with the previous
            self.free[i - 1][1] += self.free.pop(i)[1]


def check_heap_bases(bases) -> None:
    """The kernels move pointers between heaps by whole multiples of 16 elements (so remote stores
    stay 16-byte vectors: kernels/dist_common.translate); that needs heap bases that differ by
    multiples of 256 bytes. Iris's heaps are page aligned; anything else is refused here."""
    bad = [r for r, b in enumerate(bases) if (b - bases[0]) % HEAP_ALIGN]
    if bad:
        raise RuntimeError(f"symmetric heap of rank(s) {bad} is not {HEAP_ALIGN}-byte aligned relative to rank 0's "
                           f"(bases {[hex(b) for b in bases]}); the kernels' remote addressing needs it")
