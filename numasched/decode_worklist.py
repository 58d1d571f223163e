"""Decode attention over ragged batches: a work list of KV chunks in equal per-program budgets,
planned once per batch layout, walked by a persistent kernel (check, plan, run).

    plan = numasched.plan_decode_worklist(q, k_cache, v_cache, lengths=lens_host,
                                          cache_seqlens=lens, block_table=bt)   # once per batch layout
    for step in range(n):
        out = plan.run(q, k_cache, v_cache, cache_seqlens=lens, block_table=bt)  # only launches
        ...                                                                      # lens grow on the GPU
    if plan.stale(new_lens_host):                                                # re-plan now and then
        plan = numasched.plan_decode_worklist(...)

Why: ``numasched.flash_decode`` cuts every (batch, kv_head) into the same number of splits of its
own length. With ragged lengths the programs of long sequences take much longer than those of
short ones, and a launch lasts as long as its longest chunk. Here the host cuts the whole batch
into items of about equal cost and hands each program a list of them.

The plan (:func:`build_worklist`, pure NumPy; the simulator uses it too). Each (batch, kv_head)
"pair" is a run of tokens; a work item is a token range of one pair, costing its tokens plus
``ITEM_OVERHEAD_TOKENS``; the total cost is cut into equal budgets, one per program:

* **Queues.** One queue per locality domain of the topology (``topology.current().num_domains``:
  8 on MI300X, 1 on NVIDIA). Program g belongs to domain ``topology.domain_of(g)`` (round-robin
  dispatch) and runs items of its domain's queue only, so the chunks of one KV head, and the
  partials their merge reads, stay in one L2. The pairs, in index order (batch-major), are dealt
  to the queues by sequential budget cutting: queue q takes pairs until its share of the total
  cost (in proportion to its programs) is reached, and the pair that crosses the boundary is cut
  there. So at most X - 1 pairs span two queues, and the queues end within one cut's slack
  (``MIN_PIECE_TOKENS + GRANULE`` tokens and an item's overhead) of their shares.
* **Programs.** Each queue's pairs are cut the same way into equal budgets for its programs, in
  program-id order: a program runs a contiguous run of the queue's tokens (a few whole short pairs
  and the parts of at most two long ones), so every program ends within one cut's slack of the
  mean. Odd-ranked programs of a queue run their run backwards, so the two parts of a pair cut
  between neighbours run at the same time (both first or both last) and the merge finds the
  partials in the L2 they were written to. Cuts fall on multiples of ``GRANULE`` tokens and leave at least ``MIN_PIECE_TOKENS`` on
  either side (a pair shorter than ``MIN_CHUNK_TOKENS`` = 256 is never cut); a piece that cannot
  be cut goes whole to whichever side leaves the smaller error. The overhead of the items the cuts
  add is part of the budgets. ``chunk_tokens`` is the longest item.
* **Items.** Pair p's items are numbered j = 0..n-1 by start; the last one is open-ended
  (end = -1: up to the sequence's length at run time), so the plan stays correct while sequences
  grow. Pairs of several items get rows in an fp32 partial buffer; the last item to finish merges.
* **Arrays.** ``work`` int32 (items, 8): (pair, start, end or -1, j, n, first partial row, 0, 0)
  in program order, and ``prog_ptr`` int32 (P + 1,): program g runs rows prog_ptr[g] ..
  prog_ptr[g+1]-1. Both are copied to the device once, when the plan is made; ``run`` only
  launches: no host reads of device data, no allocation of plan arrays (CUDA-graph safe; keep the
  plan alive as long as a graph that captured it).

Run-time lengths come from ``cache_seqlens`` on the device. An item whose range starts at or past a
sequence's current length is empty, so any lengths up to the capacity give the right result; only
the balance depends on how close they are to the planned ``lengths``. :meth:`DecodeWorklistPlan.stale`
says when a new plan would balance markedly better. Unlike ``flash_decode``, ``run`` never
range-checks ``cache_seqlens`` / ``block_table`` (that reads device data); the kernel bounds every
index it reads, and :meth:`DecodeWorklistPlan.check_data` runs the checks on request.

Single-token decode only: q (batch, heads, head_dim). Multi-token decode (4-D q) runs on
``numasched.plan_decode``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from . import caps
from . import decode as D
from . import observe as _observe
from . import options as _options
from . import topology as _topology
from ._plan import Plan, grow_only, signature
from ._validate import check_config, check_positive_int, check_tensor

__all__ = ["plan_decode_worklist", "DecodeWorklistPlan", "Worklist", "build_worklist", "check_lengths",
           "GRANULE", "MIN_PIECE_TOKENS", "MIN_CHUNK_TOKENS", "ITEM_OVERHEAD_TOKENS", "PROGRAMS_PER_SM",
           "SPLIT_MIN_PAIRS_PER_SM", "choose_schedule"]

# Items are cut at multiples of this many tokens (every BLOCK_N of the configs divides it, so only
# a pair's last item ends in a partial tile). Finer cuts (32, pieces of 64) planned much better
# balance on the ragged grid's work-list points (max/mean 1.029 -> 1.007 mean, 1.117 -> 1.026
# worst) but did not run faster on an H100 (48 rows: 0.999x geomean, 28/4 8 x 4k 34.5 -> 35.7 us;
# bench/results/decode-s22-ragged-g32/): the cuts inside tiles cost what the balance gained.
GRANULE = 128
# Shortest piece a cut leaves on either side: a pair shorter than twice this (256 tokens) is never
# cut (no partials, no merge). 128 balanced better than 256 at the same items per program (planner
# only: max/mean program cost 1.017 against 1.027 over ragged batches of >= 1 GB, 8-128 x 4k-64k,
# on 264 and 608 programs).
MIN_PIECE_TOKENS = 128
MIN_CHUNK_TOKENS = 2 * MIN_PIECE_TOKENS
# Cost of an item beyond its tokens, in tokens of streaming: q load, pipeline fill, partial write
# (the split heuristic's per-program overhead, numasched.decode.PROGRAM_OVERHEAD_TOKENS).
ITEM_OVERHEAD_TOKENS = D.PROGRAM_OVERHEAD_TOKENS
# Programs per SM/CU of the persistent grid: two resident programs per SM let one stream while the
# other starts or merges an item (the kernel's register budget, kernels/flash_decode_worklist.
# RESIDENT_PROGRAMS, is set for this many). Measured with it on an H200: ragged batches at 1.053x
# FlashInfer (geomean over 70 rows) and 0.94-1.07 of the streaming read at >= 1 GB
# (bench/results/decode_ragged-h200-2026-11-23.*); one program per SM was not compared.
PROGRAMS_PER_SM = 2
# schedule="auto": from this many (sequence, KV head) pairs per SM on, the plan runs the split
# kernel (numasched.flash_decode's plan) instead of the work list. With that many pairs the split
# kernel's programs already come in many waves that the GPU balances by itself, and its
# per-length tile config streams faster than the work list's fixed 64-token one. One H100, ragged
# batches (lengths uniform in [L/16, L]; bench/results/decode-s22-ragged/): at 1024-4096 pairs
# (7.8-31 per SM) the split kernel took 0.947-1.010x the work list's time (17 of 24 rows faster,
# MHA 128 x 4k 0.947); at 256-512 pairs (1.9-3.9 per SM) 1.01-1.14x (the work list faster at 23
# of 24 rows). Nothing was measured between 3.9 and 7.8 pairs per SM: 6 splits the gap. On one
# locality domain only: on several (MI300X) the work list's per-domain queues keep a KV head's
# chunks in one L2, which the split kernel does not (simulator, not measured).
SPLIT_MIN_PAIRS_PER_SM = 6
SCHEDULES = ("auto", "worklist", "split")
WORK_FIELDS = 8  # int32 fields per work item (kernels/flash_decode_worklist.py)


# ----------------------------------------------------------------------------- lengths
def check_lengths(lengths, batch: int, capacity: Optional[int] = None, name: str = "lengths") -> np.ndarray:
    """Host-side per-sequence token counts as an int64 NumPy array, checked: a list/tuple of ints,
    a NumPy integer array or an integer torch tensor (a GPU tensor is copied to the host: one
    sync), 1-D with ``batch`` entries, each in [0, capacity]. Errors name the argument."""
    if isinstance(lengths, torch.Tensor):
        if lengths.dtype.is_floating_point or lengths.dtype.is_complex or lengths.dtype == torch.bool:
            raise TypeError(f"{name} must hold integers, got a tensor of dtype {lengths.dtype}")
        arr = lengths.detach().to("cpu", torch.int64).numpy()
    elif isinstance(lengths, np.ndarray):
        if lengths.dtype.kind not in "iu":
            raise TypeError(f"{name} must hold integers, got a NumPy array of dtype {lengths.dtype}")
        arr = lengths.astype(np.int64)
    elif isinstance(lengths, (list, tuple)):
        bad = [x for x in lengths if isinstance(x, bool) or not isinstance(x, (int, np.integer))]
        if bad:
            raise TypeError(f"{name} must hold ints, got {type(bad[0]).__name__} {bad[0]!r}")
        arr = np.asarray(lengths, dtype=np.int64).reshape(-1)
    else:
        raise TypeError(f"{name} must be a list of ints, a NumPy integer array or an integer torch.Tensor, "
                        f"got {type(lengths).__name__}")
    if arr.ndim != 1:
        raise ValueError(f"{name} must be 1-D (one length per sequence), got shape {tuple(arr.shape)}")
    if arr.shape[0] != batch:
        raise ValueError(f"{name} has {arr.shape[0]} entries but q batch is {batch}")
    if arr.size and arr.min() < 0:
        i = int(np.flatnonzero(arr < 0)[0])
        raise ValueError(f"{name}[{i}] = {int(arr[i])} is negative")
    if capacity is not None and arr.size and arr.max() > capacity:
        i = int(np.flatnonzero(arr > capacity)[0])
        raise ValueError(f"{name}[{i}] = {int(arr[i])} exceeds the cache capacity {capacity}")
    return arr


# ----------------------------------------------------------------------------- the work list
@dataclass(frozen=True, eq=False)
class Worklist:
    """A batch layout cut into work items (see the module doc); NumPy arrays, host side.

    Attributes:
        lengths: planned tokens per sequence (int64, (batch,)).
        kv_heads, group: KV heads; query heads per KV head (rows of a partial).
        num_programs, num_queues, chunk_tokens: P, X, the chunk length.
        domains: queue (domain) of each program, (P,).
        work: int32 (items, 8) in program order: pair, start, end (-1: open), j, n, first partial
            row of the pair (prow0; head i's partial of item j is row prow0 + i*n + j), 0, 0.
        prog_ptr: int32 (P + 1,): program g runs work rows prog_ptr[g] .. prog_ptr[g+1]-1.
        item_queue, item_program: queue and program of each work row.
        item_cost: planned cost of each work row (tokens + ITEM_OVERHEAD_TOKENS).
        pair_items: items per pair (pair = batch * kv_heads + kv_head), (batch * kv_heads,).
        partial_rows: rows of the fp32 partial buffers (group * items of the pairs with n > 1).
        program_cost, queue_cost: planned cost per program and per queue.
    """

    lengths: np.ndarray
    kv_heads: int
    group: int
    num_programs: int
    num_queues: int
    chunk_tokens: int
    domains: np.ndarray
    work: np.ndarray
    prog_ptr: np.ndarray
    item_queue: np.ndarray
    item_program: np.ndarray
    item_cost: np.ndarray
    pair_items: np.ndarray
    partial_rows: int
    program_cost: np.ndarray
    queue_cost: np.ndarray

    @property
    def num_items(self) -> int:
        return int(self.work.shape[0])

    @property
    def max_pair_items(self) -> int:
        return int(self.pair_items.max()) if self.pair_items.size else 1

    @property
    def balance(self) -> float:
        """Slowest program's planned cost over the mean (1.0: perfectly even)."""
        return _balance(self.program_cost)

    @property
    def split_pairs(self) -> int:
        """Pairs whose items went to more than one queue."""
        if self.num_items == 0:
            return 0
        pairs = self.work[:, 0].astype(np.int64)
        key = np.unique(pairs * self.num_queues + self.item_queue)
        per_pair = np.bincount(key // self.num_queues, minlength=self.pair_items.size)
        return int((per_pair > 1).sum())

    def item_tokens(self, lengths: Optional[np.ndarray] = None) -> np.ndarray:
        """Tokens each work row covers when the sequences have these lengths (default: planned)."""
        lens = self.lengths if lengths is None else np.asarray(lengths, dtype=np.int64)
        if self.num_items == 0:
            return np.zeros(0, dtype=np.int64)
        b = self.work[:, 0].astype(np.int64) // self.kv_heads
        L = lens[b]
        end = self.work[:, 2].astype(np.int64)
        hi = np.where(end < 0, L, np.minimum(end, L))
        return np.maximum(hi - self.work[:, 1], 0)

    def program_cost_for(self, lengths) -> np.ndarray:
        """Cost per program when the sequences have these lengths (the plan unchanged)."""
        cost = self.item_tokens(lengths) + ITEM_OVERHEAD_TOKENS
        return np.bincount(self.item_program, weights=cost, minlength=self.num_programs).astype(np.int64)


def _balance(costs: np.ndarray) -> float:
    costs = np.asarray(costs, dtype=np.float64)
    m = costs.mean() if costs.size else 0.0
    return float(costs.max() / m) if m > 0 else 1.0


def _greedy(pieces: list, caps_, min_piece: int, unit: int, level: bool = False, pad: Optional[float] = None):
    """Pieces ([pair, start, end] token ranges, in order) into bins of costs at most ``caps_`` (a
    piece costs its tokens plus ITEM_OVERHEAD_TOKENS), each bin taking as much as it can: a piece
    that does not fit whole is cut at the largest multiple of ``unit`` tokens that fits and leaves
    at least ``min_piece`` tokens on both sides (if there is one), the rest opening the next bin.
    Returns the bins, or None when they run out.

    ``level``: a bin takes about its weighted share of what is left plus ``pad`` (default: one
    cut's slack or the largest piece, the smaller; never more than its cap), so indivisible pieces
    are spread over the bins instead of leaving the last ones short."""
    nb = len(caps_)
    out = [[] for _ in range(nb)]
    caps_ = np.asarray(caps_, dtype=np.float64)
    left = sum(e - s + ITEM_OVERHEAD_TOKENS for _, s, e in pieces)
    # a leveled bin may pass its share by one uncuttable piece (at most one cut's slack), so every
    # bin takes at least its share and the last one never overflows
    if pad is None:
        pad = _leveled_pad(pieces, min_piece, unit)

    def room_of(k):
        if not level:
            return caps_[k]
        return min(caps_[k], left * caps_[k] / caps_[k:].sum() + pad)

    k, room = 0, room_of(0)
    for pair, s, e in pieces:
        while True:
            cost = e - s + ITEM_OVERHEAD_TOKENS
            if cost <= room:
                out[k].append([pair, s, e])
                room -= cost
                left -= cost
                break
            t = min(int((room - ITEM_OVERHEAD_TOKENS) // unit), (e - s - min_piece) // unit) * unit
            if t >= min_piece:
                out[k].append([pair, s, s + t])
                left -= t   # (the cut-off part paid its own item overhead; the rest still owes one)
                s += t
            k += 1
            if k == nb:
                return None
            room = room_of(k)
    return out


def _leveled_pad(pieces: list, min_piece: int, unit: int) -> float:
    """The leveled fill's default pad: one cut's slack, or the largest piece if that is less."""
    return min(max((e - s + ITEM_OVERHEAD_TOKENS for _, s, e in pieces), default=0),
               2 * min_piece + unit + 2 * ITEM_OVERHEAD_TOKENS)


def _spread(bins, weights) -> float:
    """Largest minus smallest bin cost per unit weight."""
    costs = [sum(e - s + ITEM_OVERHEAD_TOKENS for _, s, e in b) / wt for b, wt in zip(bins, weights)]
    return max(costs) - min(costs)


def _fill(pieces: list, weights, min_piece: int, unit: int) -> list:
    """Split ``pieces`` (in order) into ``len(weights)`` bins of costs at most b * weight, for the
    smallest b (bisected to half a token, or 2e-5 of b) for which :func:`_greedy` fits them all. So the largest bin
    (per unit weight) is as small as sequential cutting allows: at most about one cut's slack
    (``min_piece + unit + ITEM_OVERHEAD_TOKENS``) above the mean, and only pieces that cross a
    bin's end are cut."""
    w = np.asarray(weights, dtype=np.float64)
    if w.size == 1:
        return [[list(x) for x in pieces]]
    total = sum(e - s + ITEM_OVERHEAD_TOKENS for _, s, e in pieces)
    lo = total / w.sum()  # cannot fit below the mean (cuts only add overhead)
    hi = lo + 2 * min_piece + unit + 2 * ITEM_OVERHEAD_TOKENS
    while _greedy(pieces, hi * w, min_piece, unit) is None:
        lo, hi = hi, 2 * hi
    while hi - lo > max(0.5, 2e-5 * hi):  # to half a token (large budgets: 2e-5 of it)
        mid = 0.5 * (lo + hi)
        if _greedy(pieces, mid * w, min_piece, unit) is None:
            lo = mid
        else:
            hi = mid
    bins = _greedy(pieces, hi * w, min_piece, unit)
    # Filling each bin to the budget can leave the last bins short when the pieces are
    # indivisible (e.g. items of a few tokens, each paying the item overhead): a leveled fill
    # (same caps) is taken when it spreads the bins less. Its pad is halved while it still fits: a
    # pad of a whole cut's slack can fill the first bins to the cap again (19 sequences, a few
    # tokens each but one, on 8 programs: 0-917 tokens with the full pad, 453-917 with half).
    pad = _leveled_pad(pieces, min_piece, unit)
    for _ in range(4):
        leveled = _greedy(pieces, hi * w, min_piece, unit, level=True, pad=pad)
        if leveled is None:
            break
        if _spread(leveled, w) < _spread(bins, w):
            bins = leveled
        pad /= 2
    return bins


def build_worklist(lengths, kv_heads: int, num_programs: int, domains=None, *, group: int = 1,
                   chunk_tokens: Optional[int] = None) -> Worklist:
    """Cut a batch of sequences of these ``lengths`` (tokens; each of ``kv_heads`` KV heads is one
    pair per sequence) into work items for ``num_programs`` programs; ``domains[g]`` is the queue
    (locality domain) of program g (default: all 0, one queue). See the module doc.

    ``chunk_tokens``: also cut every pair into near-equal items of at most this many tokens first
    (and take min(MIN_PIECE_TOKENS, chunk_tokens) as the shortest piece of a cut and
    gcd(chunk_tokens, GRANULE) as the cut unit); tests use it to get several items per pair on
    short sequences."""
    lens = np.asarray(lengths, dtype=np.int64).reshape(-1)
    HK = int(kv_heads)
    P = int(num_programs)
    if P < 1:
        raise ValueError(f"num_programs must be >= 1, got {P}")
    dom = np.zeros(P, dtype=np.int64) if domains is None else np.asarray(domains, dtype=np.int64).reshape(-1)
    if dom.shape != (P,) or (dom.size and dom.min() < 0):
        raise ValueError(f"domains must give a queue >= 0 for each of the {P} programs, got shape {dom.shape}")
    X = int(dom.max()) + 1
    if chunk_tokens is not None and int(chunk_tokens) < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    min_piece = MIN_PIECE_TOKENS if chunk_tokens is None else min(MIN_PIECE_TOKENS, int(chunk_tokens))
    unit = GRANULE if chunk_tokens is None else math.gcd(int(chunk_tokens), GRANULE)

    # -- pieces: pairs in index order (batch-major), pre-cut into near-equal unit-aligned pieces of
    #    at most chunk_tokens when asked (so the n - 1 closed pieces end before L: none is empty)
    n_pairs = lens.size * HK
    pieces = []
    for p in range(n_pairs):
        L = int(lens[p // HK])
        if chunk_tokens is None or L <= chunk_tokens:
            pieces.append([p, 0, L])
            continue
        n = -(-L // int(chunk_tokens))
        step = -(-(-(-L // n)) // unit) * unit
        pieces += [[p, j * step, min((j + 1) * step, L)] for j in range(n)]

    # -- queues: each domain's share of the cost (proportional to its programs), filled in pair
    #    order: a pair is cut only at a queue's end (at most X - 1 pairs span two queues)
    per_queue = np.bincount(dom, minlength=X)
    live = [x for x in range(X) if per_queue[x] > 0]
    by_queue = dict(zip(live, _fill(pieces, per_queue[live], min_piece, unit)))
    # -- programs: within a queue, equal budgets in program-id order, cut the same way
    #    A pair cut between a queue's programs r and r + 1 ends program r's run and starts r + 1's:
    #    odd-ranked programs run their items in reverse, so both parts run at the same time (at the
    #    start or the end of both runs), in one L2 with one queue per domain, and the merge reads
    #    partials written moments before.
    prog_pieces = [[] for _ in range(P)]
    for x in live:
        pids = np.flatnonzero(dom == x)
        for r, (g, lst) in enumerate(zip(pids.tolist(), _fill(by_queue[x], np.ones(pids.size), min_piece, unit))):
            prog_pieces[g] = lst[::-1] if r % 2 else lst

    # -- items: j = rank of the piece within its pair (by start), n = pieces of the pair; the last
    #    piece of a pair is open-ended; partial rows for pairs of several items, in pair order
    rows = [(g, pos, pair, s, e) for g in range(P) for pos, (pair, s, e) in enumerate(prog_pieces[g])]
    work = np.zeros((len(rows), WORK_FIELDS), dtype=np.int64)
    item_program = np.asarray([r[0] for r in rows], dtype=np.int64)
    if rows:
        work[:, 0] = [r[2] for r in rows]
        work[:, 1] = [r[3] for r in rows]
        work[:, 2] = [r[4] for r in rows]
    pair = work[:, 0]
    n_of = np.bincount(pair, minlength=n_pairs).astype(np.int64)
    order = np.lexsort((work[:, 1], pair))  # by pair, then start
    first = np.concatenate([[0], np.cumsum(n_of)[:-1]]) if n_pairs else n_of
    jj = np.empty(len(rows), dtype=np.int64)
    jj[order] = np.arange(len(rows)) - np.repeat(first, n_of)
    item_cost = work[:, 2] - work[:, 1] + ITEM_OVERHEAD_TOKENS
    work[:, 2] = np.where(jj == n_of[pair] - 1, -1, work[:, 2])
    rows_per = np.where(n_of > 1, n_of * int(group), 0)
    prow0 = np.concatenate([[0], np.cumsum(rows_per)[:-1]]).astype(np.int64) if n_pairs else rows_per
    work[:, 3] = jj
    work[:, 4] = n_of[pair]
    work[:, 5] = prow0[pair]
    if work.size and work.max() > caps.INT32_MAX:
        raise ValueError("the work list's indices overflow int32 (partial rows or token positions)")
    prog_ptr = np.zeros(P + 1, dtype=np.int64)
    np.cumsum(np.bincount(item_program, minlength=P), out=prog_ptr[1:])
    prog_cost = np.bincount(item_program, weights=item_cost, minlength=P).astype(np.int64)
    queue_cost = np.bincount(dom, weights=prog_cost, minlength=X).astype(np.int64)
    chunk = int(chunk_tokens) if chunk_tokens is not None else int(item_cost.max() - ITEM_OVERHEAD_TOKENS) if rows else 0
    return Worklist(lengths=lens.copy(), kv_heads=HK, group=int(group), num_programs=P, num_queues=X,
                    chunk_tokens=chunk, domains=dom, work=work.astype(np.int32), prog_ptr=prog_ptr.astype(np.int32),
                    item_queue=dom[item_program], item_program=item_program, item_cost=item_cost,
                    pair_items=n_of, partial_rows=int(rows_per.sum()), program_cost=prog_cost,
                    queue_cost=queue_cost)


def program_domains(topology, num_programs: int, queues="auto") -> np.ndarray:
    """Queue of each program: its locality domain under the topology's dispatch (``queues="auto"``),
    one queue (``queues=1``), or round-robin over ``queues`` queues (another int)."""
    pids = np.arange(num_programs, dtype=np.int64)
    if queues == "auto" or queues == topology.num_domains:
        return np.asarray(topology.domain_of(pids), dtype=np.int64)
    return pids % int(queues)


def choose_schedule(pairs: int, num_sms: int, num_domains: int) -> str:
    """``schedule="auto"``: "split" (numasched.flash_decode's split kernel) for a batch of at least
    ``SPLIT_MIN_PAIRS_PER_SM`` (sequence, KV head) pairs per SM on a GPU of one locality domain,
    else "worklist" (see SPLIT_MIN_PAIRS_PER_SM)."""
    return "split" if num_domains == 1 and pairs >= SPLIT_MIN_PAIRS_PER_SM * num_sms else "worklist"


# ----------------------------------------------------------------------------- the plan
class DecodeWorklistPlan(Plan):
    """A planned ragged-batch decode: made by :func:`plan_decode_worklist`, run with :meth:`run`.

    Attributes:
        shape: DecodeShape of the call (3-D q only).
        scale: softmax scale.
        topology: the topology the queues were made for.
        lengths: the planned lengths (tuple).
        worklist: the :class:`Worklist` (host arrays).
        num_programs, num_queues, chunk_tokens, num_items: P, X, the chunk, the items.
        balance: planned slowest program's cost over the mean.
        grid: (num_programs,).
        work, prog_ptr: the work list on the device (int32; allocated once, here).
        mode: "kernel", "interpreter", "torch" (no Triton device) or "empty" (batch 0).
        config: kernel config (None until autotuning has chosen one).
        workspace_bytes: fp32 partial buffers per stream.
        tensors: the TensorSig of each argument the plan was made for.
        schedule: what ``run`` launches: "worklist" (the persistent work-list kernel) or "split"
            (the split kernel of :func:`numasched.plan_decode`, ``split_plan``, for batches of many
            pairs: :func:`choose_schedule`); the work list is planned either way (``worklist``,
            ``balance``), but with "split" nothing of it goes to the device, and ``grid``,
            ``config`` and ``workspace_bytes`` are the split plan's.
    """

    op = "flash_decode_worklist"

    def __init__(self, q, k_cache, v_cache, cache_seqlens, block_table, *, lengths, scale, num_programs, queues,
                 chunk_tokens, config, options: _options.Options, mode: Optional[str] = None,
                 schedule: str = "worklist"):
        check_tensor("q", q)
        if schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
        if q.dim() == 4:
            raise ValueError(f"q must have 3 dimensions (batch, heads, head_dim) for the work-list decode, got shape "
                             f"{tuple(q.shape)}; multi-token decode (a 4-D q) runs on numasched.plan_decode")
        shape = D.check_decode(q, k_cache, v_cache, cache_seqlens, block_table, scale, None, "auto")
        check_positive_int("num_programs", num_programs)
        check_positive_int("chunk_tokens", chunk_tokens)
        if isinstance(queues, bool) or not isinstance(queues, (str, int)):
            raise TypeError(f"queues must be 'auto' or an int >= 1, got {type(queues).__name__}")
        if (isinstance(queues, str) and queues != "auto") or (isinstance(queues, int) and queues < 1):
            raise ValueError(f"queues must be 'auto' or an int >= 1, got {queues!r}")
        lens = check_lengths(lengths, shape.batch, shape.capacity)
        self.shape = shape
        self.scale = float(scale) if scale is not None else 1.0 / math.sqrt(shape.head_dim)
        self.options = options
        self.tensors = dict(q=signature(q), k_cache=signature(k_cache), v_cache=signature(v_cache),
                            cache_seqlens=signature(cache_seqlens), block_table=signature(block_table))
        dev = q.device
        self.device = dev
        self.topology = _topology.current()
        self._out_stride = torch.empty_like(q, device="meta").stride()
        self._lse_stride = D._contiguous_strides(shape.lse_shape)
        self._so = (self._out_stride[0], self._out_stride[1], self._lse_stride[0], self._lse_stride[1])
        if mode is None:
            mode = "empty" if shape.batch == 0 else caps.launch_mode(dev)
        self.mode = mode
        B, H, HK, Dh = shape.batch, shape.heads, shape.kv_heads, shape.head_dim
        if schedule == "auto":
            # a caller's own grid, chunk or config asks for the work-list kernel
            forced = num_programs is not None or chunk_tokens is not None or config is not None or queues != "auto"
            schedule = "worklist" if forced or mode != "kernel" else choose_schedule(
                B * HK, caps.num_sms(dev), self.topology.num_domains)
        self.schedule = schedule
        # the split kernel's plan: run() reads no device data (no range checks: check_data off)
        self.split_plan = None if schedule == "worklist" else D.plan_decode(
            q, k_cache, v_cache, cache_seqlens=cache_seqlens, block_table=block_table, scale=scale,
            options=options.replace(check_data=False))
        G = H // HK
        P = int(num_programs) if num_programs is not None else PROGRAMS_PER_SM * caps.num_sms(dev)
        wl = build_worklist(lens, HK, P, program_domains(self.topology, P, queues), group=G,
                            chunk_tokens=chunk_tokens)
        self.worklist = wl
        self.lengths = tuple(int(x) for x in lens)
        self.num_programs = P
        self.num_queues = wl.num_queues
        self.chunk_tokens = wl.chunk_tokens
        self.num_items = wl.num_items
        self.balance = wl.balance
        self.grid = (P,)
        self.config = None
        self._pairs = B * HK
        self._rows = wl.partial_rows
        self._pl_offset = -(-wl.partial_rows * Dh // 32) * 32  # keeps the lse partials 128-byte aligned
        self._ws_numel = self._pl_offset + wl.partial_rows if wl.partial_rows else 0
        self.workspace_bytes = 4 * self._ws_numel
        self._views: dict = {}
        self._launch = None
        self.work = self.prog_ptr = None
        if self.split_plan is not None:
            # the split kernel runs: its grid, config and workspace are what a launch uses (the
            # work list above stays for inspection; nothing of it goes to the device)
            sp = self.split_plan
            self.grid, self.config, self.workspace_bytes = sp.grid, sp.config, sp.workspace_bytes
            self._freeze()
            return
        if mode in ("empty", "torch"):
            self._freeze()
            return
        # the work list on the device, once (run() passes these very tensors every time)
        self.work = torch.from_numpy(wl.work).to(dev)
        self.prog_ptr = torch.from_numpy(wl.prog_ptr).to(dev)
        from .kernels import flash_decode as K
        from .kernels import flash_decode_worklist as KW

        block_g, _ = K.row_tiling(1, G)
        paged = shape.page_size > 0
        self._upcast = mode == "interpreter" and q.dtype == torch.bfloat16
        int64 = max(D._span(k_cache), D._span(v_cache)) > D.INT64_THRESHOLD
        self._tune_key = K.tune_key(wl.chunk_tokens, k_cache.stride(1) == Dh, False)
        precision = "ieee" if q.dtype == torch.float32 or self._upcast else None
        meta = dict(G=G, BLOCK_G=block_g, HEAD_DIM=Dh, BLOCK_D=max(16, D._next_pow2(Dh)),
                    PAGE_SIZE=int(shape.page_size), HAS_SEQLENS=cache_seqlens is not None, INT64=int64,
                    INPUT_PRECISION=precision, COMBINE_BLOCK_S=K.combine_block_s(wl.max_pair_items),
                    WORK_STRIDE=KW.WORK_FIELDS)
        # 64-token tiles whatever the item length: two programs per SM must fit in shared memory
        # (128-token tiles took 2292 against 1983 us at 64 x 32k, pages of 16: decode-configs-paged-*)
        fixed = KW.with_registers(K.fixed_config(paged, Dh, block_g, smem_limit=caps.shared_memory_per_block(dev)),
                                  caps.is_hip())
        from ._launch import Launch

        if mode == "interpreter":
            self.config = dict(K.INTERPRET_CONFIG)
            launch = Launch(KW._flash_decode_worklist_kernel, self.grid, meta, config=self.config, device=dev,
                            interpret=True)
        elif config is not None:
            self.config = dict(config) if "maxnreg" in config else KW.with_registers(config, caps.is_hip())
            launch = Launch(KW._flash_decode_worklist_kernel, self.grid, meta, config=self.config, device=dev,
                            options=self.options)
        elif not options.autotune or options.decode_schedule == "model":
            self.config = fixed
            launch = Launch(KW._flash_decode_worklist_kernel, self.grid, meta, config=fixed, device=dev,
                            options=self.options)
        else:
            launch = Launch(KW._flash_decode_worklist_kernel, self.grid, meta, device=dev,
                            tuner=KW._flash_decode_worklist_tuned, fixed=fixed, options=self.options)
        self._launch = launch
        self._args_cache = self._scalars(q, k_cache, v_cache, cache_seqlens, block_table)
        self._freeze()

    # ---------------------------------------------------------------- description
    def describe(self) -> dict:
        d = super().describe()
        wl = getattr(self, "worklist", None)
        d.update(num_programs=getattr(self, "num_programs", None), num_queues=getattr(self, "num_queues", None),
                 chunk_tokens=getattr(self, "chunk_tokens", None), num_items=getattr(self, "num_items", None),
                 split_pairs=wl.split_pairs if wl is not None else None,
                 balance=round(self.balance, 4) if hasattr(self, "balance") else None,
                 mode=getattr(self, "mode", None), schedule=getattr(self, "schedule", None))
        return d

    def __repr__(self) -> str:
        d = self.describe()
        topo = getattr(d.get("topology"), "name", d.get("topology"))
        return (f"DecodeWorklistPlan(schedule={d['schedule']!r}, topology={topo!r}, grid={d.get('grid')}, "
                f"queues={d['num_queues']}, "
                f"items={d['num_items']}, chunk_tokens={d['chunk_tokens']}, balance={d['balance']}, "
                f"config={d.get('config')}, workspace_bytes={d.get('workspace_bytes')})")

    # ---------------------------------------------------------------- host helpers (not in run)
    def predicted_balance(self, lengths=None) -> float:
        """Slowest program's cost over the mean if the sequences had these lengths (host values;
        default: the planned ones) and this plan ran them."""
        if lengths is None:
            return self.balance
        lens = check_lengths(lengths, self.shape.batch, self.shape.capacity)
        return _balance(self.worklist.program_cost_for(lens))

    def stale(self, lengths, tolerance: float = 0.1) -> bool:
        """Whether a new plan for these lengths (host values, e.g. the lengths after some decode
        steps) would balance the programs markedly better: this plan's predicted slowest program
        more than ``tolerance`` above a fresh plan's. The plan stays *correct* either way. Never
        with the split schedule (its programs follow the run-time lengths: nothing to re-plan)."""
        if isinstance(tolerance, bool) or not isinstance(tolerance, (int, float)):
            raise TypeError(f"tolerance must be a number, got {type(tolerance).__name__}")
        if not tolerance >= 0:
            raise ValueError(f"tolerance must be >= 0, got {tolerance!r}")
        lens = check_lengths(lengths, self.shape.batch, self.shape.capacity)
        if self.schedule == "split":
            return False
        wl = self.worklist
        fresh = build_worklist(lens, wl.kv_heads, wl.num_programs, wl.domains, group=wl.group)
        now = self.worklist.program_cost_for(lens).max()
        return bool(now > fresh.program_cost.max() * (1.0 + tolerance))

    def fits(self, lengths, tolerance: float = 0.1) -> bool:
        """``not stale(lengths, tolerance)``."""
        return not self.stale(lengths, tolerance)

    def check_data(self, cache_seqlens=None, block_table=None) -> None:
        """The range checks ``flash_decode`` runs with ``options.check_data`` (they read device
        data: one sync). ``run`` never calls them."""
        D.check_decode_data(self.shape, cache_seqlens, block_table)

    # ---------------------------------------------------------------- launch arguments
    def _scalars(self, q, k_cache, v_cache, cache_seqlens, block_table) -> tuple:
        s = self.shape
        stride_sb = cache_seqlens.stride(0) if cache_seqlens is not None else 0
        stride_tb, stride_tp = block_table.stride() if block_table is not None else (0, 0)
        qs = q.stride()
        return (self.scale * caps.LOG2E, s.kv_heads, int(s.capacity), max(s.num_pages, 1), qs[0], qs[1],
                k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
                v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), stride_sb, stride_tb, stride_tp)

    def _partials(self, stream: int, capturing: bool):
        R, Dh = self._rows, self.shape.head_dim
        if capturing:  # the graph's pool owns them
            return (torch.empty((R, Dh), dtype=torch.float32, device=self.device),
                    torch.empty((R,), dtype=torch.float32, device=self.device))
        key = (self.device.type, self.device.index, stream)
        flat = D._WORKSPACE.get(key)  # shared with flash_decode's plans: launches on a stream run in order
        hit = self._views.get(stream)
        if hit is not None and hit[0] is flat:
            return hit[1], hit[2]
        if flat is None or flat.numel() < self._ws_numel:
            flat = grow_only(D._WORKSPACE, key, self._ws_numel, torch.float32, self.device)
        po = flat[: R * Dh].view(R, Dh)
        pl = flat[self._pl_offset: self._pl_offset + R]
        self._views[stream] = (flat, po, pl)
        return po, pl

    # ---------------------------------------------------------------- run
    def run(self, q, k_cache, v_cache, cache_seqlens=None, block_table=None, *, out=None, lse=None,
            return_lse: bool = False):
        """Launch on tensors with the signatures the plan was made for; returns out (and lse).

        Only launches: no host reads of device data, no data checks (see :meth:`check_data`), no
        allocation besides the outputs when not given (CUDA-graph safe). ``out`` (q's shape and
        dtype) and ``lse`` ((batch, heads) fp32) are written when given (any strides)."""
        self.check_signatures(q=q, k_cache=k_cache, v_cache=v_cache, cache_seqlens=cache_seqlens,
                              block_table=block_table)
        s = self.shape
        if out is not None:
            check_tensor("out", out, ndim=3, dtypes=(q.dtype,), device=q.device)
            if tuple(out.shape) != s.out_shape:
                raise ValueError(f"out must have shape {s.out_shape}, got {tuple(out.shape)}")
        if lse is not None:
            check_tensor("lse", lse, ndim=2, dtypes=(torch.float32,), device=q.device)
            if tuple(lse.shape) != s.lse_shape:
                raise ValueError(f"lse must have shape {s.lse_shape}, got {tuple(lse.shape)}")
        want = return_lse or lse is not None
        o, l = self._run(q, k_cache, v_cache, cache_seqlens, block_table, out, lse, want)
        return (o, l) if return_lse else o

    def _run(self, q, k_cache, v_cache, cache_seqlens, block_table, out=None, lse=None, want_lse=True):
        if self.split_plan is not None:
            return self.split_plan._run(q, k_cache, v_cache, cache_seqlens, block_table, out, lse, want_lse)
        s = self.shape
        dev = self.device
        out, lse, thin = D.prepare_outputs(self, q, out, lse, want_lse)
        mode = self.mode
        if mode == "empty":
            return out, lse
        if mode == "torch":
            if _observe.OBSERVERS:
                _observe.notify(self.op, "torch", (), (out, lse), self,
                                f"the Triton kernel cannot run on {dev} tensors (needs a GPU, or TRITON_INTERPRET=1 "
                                f"for CPU tensors)")
            o, l = D._torch_decode(q, k_cache, v_cache, cache_seqlens, block_table, self.scale, s)
            out.copy_(o)
            lse.copy_(l)
            return out, lse
        res_out = out
        if self._upcast:  # fp32 copies: the interpreter's bf16 dot is wrong
            q, k_cache, v_cache = q.float(), k_cache.float(), v_cache.float()
            out = torch.empty(out.shape, dtype=torch.float32, device=dev)
            thin = False
        stream = caps.stream_handle(dev)
        counter = D._counters(dev, self._pairs, stream)
        po, pl = self._partials(stream, caps.capturing(dev)) if self._rows else (lse, lse)
        if _observe.OBSERVERS:
            _observe.notify(self.op, "flash_decode_worklist", self.grid, (res_out, lse), self)
        # unused pointer arguments get stand-ins of the same dtype (one autotuning key either way)
        tensors = (q, k_cache, v_cache, counter if cache_seqlens is None else cache_seqlens,
                   counter if block_table is None else block_table, out, lse, po, pl, counter, self.work,
                   self.prog_ptr)
        launch = self._launch
        if mode == "interpreter":
            so = (out.stride(0), out.stride(1), lse.stride(0), lse.stride(1))
            launch(*tensors, *self._args_cache, *so, self._tune_key)
        else:
            if thin and launch.raw is not None:
                tensors = tuple(t.data_ptr() for t in tensors)
            so = self._so if thin else (out.stride(0), out.stride(1), lse.stride(0), lse.stride(1))
            with caps.launch_device(q):
                (launch if thin else launch.triton_call)(*tensors, *self._args_cache, *so, self._tune_key)
            if self.config is None and launch.tuned:
                object.__setattr__(self, "config", dict(launch.config))
        if out is not res_out:
            res_out.copy_(out)
        return res_out, lse


# ----------------------------------------------------------------------------- planning
def plan_decode_worklist(q, k_cache, v_cache, *, lengths, cache_seqlens=None, block_table=None, scale=None,
                         num_programs: Optional[int] = None, queues="auto", chunk_tokens: Optional[int] = None,
                         config: Optional[dict] = None, options: Optional[_options.Options] = None,
                         schedule: str = "auto") -> DecodeWorklistPlan:
    """Plan a ragged-batch decode: the batch cut into work items of near-equal cost for a
    persistent kernel (module doc). Make it once per batch layout, run it every step.

    Args: q, k_cache, v_cache, cache_seqlens, block_table, scale as :func:`numasched.flash_decode`
        (q 3-D: one new token per sequence), plus
        lengths: host-side tokens per sequence at plan time (list of ints, NumPy or CPU tensor; a
            GPU tensor is copied: one sync): what the items are cut from. At run time the kernel
            reads ``cache_seqlens`` on the device, so the sequences may grow (or shrink) between
            steps; :meth:`DecodeWorklistPlan.stale` says when re-planning would rebalance.
        num_programs: the persistent grid (default PROGRAMS_PER_SM per SM/CU).
        queues: "auto" (one queue per locality domain of ``numasched.topology.current()``), 1 (one
            queue), or another int (round-robin over that many queues).
        chunk_tokens: force the chunk length (default from the total, see the module doc); items
            are then cut at multiples of gcd(chunk_tokens, GRANULE) tokens.
        config: a fixed kernel config ``dict(BLOCK_N=..., num_warps=..., num_stages=...)``.
        options: :class:`numasched.options.Options` (``autotune``; ``check_data`` is not used:
            run never reads device data).
        schedule: "auto" (default: the split kernel of :func:`numasched.plan_decode` for batches
            of at least ``SPLIT_MIN_PAIRS_PER_SM`` pairs per SM on one locality domain, where it
            was measured faster, else the work list; a given num_programs, chunk_tokens, config
            or queues means the work list), "worklist" or "split".
    """
    if isinstance(cache_seqlens, int) and not isinstance(cache_seqlens, bool):
        if not 0 <= cache_seqlens <= caps.INT32_MAX:
            raise ValueError(f"cache_seqlens = {cache_seqlens} is outside [0, {caps.INT32_MAX}]")
        cache_seqlens = torch.full((q.shape[0],), cache_seqlens, dtype=torch.int32, device=q.device)
    opts = options if options is not None else _options.current()
    if not isinstance(opts, _options.Options):
        raise TypeError(f"options must be a numasched.options.Options, got {type(options).__name__}")
    config = check_config("config", config, ("BLOCK_N", "num_warps", "num_stages", "maxnreg"))
    return DecodeWorklistPlan(q, k_cache, v_cache, cache_seqlens, block_table, lengths=lengths, scale=scale,
                              num_programs=num_programs, queues=queues, chunk_tokens=chunk_tokens, config=config,
                              options=opts, schedule=schedule)
