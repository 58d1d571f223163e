"""A pure-Python model of the flag/epoch protocol of the distributed kernels (no GPU, no Triton).

Each rank runs ``calls`` kernels back to back (stream order: call e+1 starts when every program
of call e has finished); the programs of one kernel run concurrently, and ranks run
independently. A random scheduler interleaves single steps of all runnable programs:

    ("push", dest, item)    write our data for ``item`` into ``dest``'s buffer [slot][us]
    ("signal", dest, item)  flag[dest][us][item] = e                   (release)
    ("wait", src, item)     blocked until flag[us][src][item] >= e      (acquire)
    ("read", src, item)     start reading buffer [slot][src][item] of our heap
    ("done", src, item)     finish that read
    ("ack", src, item)      ack[src][us][item] = e: we are done with src's data   (impl "ce")
    ("wait_ack", dest, item)  blocked until ack[us][dest][item] >= e - 1          (impl "ce")

The model checks, for every interleaving it draws: no deadlock; every read sees the data of its
own call from start to finish (no push of a later call overwrote it: the double-buffering
argument in kernels/dist_gemm.py); flags never go backwards. ``slots=1`` (single buffering)
must fail this check for world >= 2, which shows the check can fail.

The two-rank warp-specialised kernel (``_ws`` ops: the all-reduce's tile pairs, the
reduce-scatter in one list or in pairs) is modelled per consumer: ``ws_tiles`` is its tile order,
and a tile's copy to the peer and its flag come during and after the next tile's K loop.

The step lists mirror the kernels: all-gather (producers push every row block to every peer,
consumers wait per (src, row block)), reduce-scatter (every tile of a peer's slice pushed from
registers; own tiles wait on every peer), decode (each batch row pushed to every peer, then
merged from every peer). The "_ce" variants model ``impl="ce"``: one buffer per peer (slot 0
always), a producer stream that waits for the consumer's ack of the previous call before each
copy, and a consumer stream that acks after reading; ``acks=False`` drops the ack wait (must fail).

First use of a signature: every rank allocates its buffers and flags with ``iris.zeros``, i.e. a
``zero_()`` queued on its own stream, not run at once. The model starts each rank with one
``init`` step that zeroes everything that rank owns (buffers, ready flags, acks). With
``init_barrier=True`` (what ``_common.run`` does: synchronize + barrier once the buffers exist) no
rank starts call 1 before every rank's init ran. With ``init_barrier=False`` a rank starts as
soon as its own init ran, so a fast peer can push (or signal) into a heap that is zeroed after
it: the read then sees no data (or the flag is lost: deadlock). That was the ``impl="ce"``
failure on 2 x H200 (rel. error 0.707 = 1/sqrt(2): the peer's half of the rows read as zeros).
"""
from __future__ import annotations

import random
from typing import Dict, List, Tuple

Step = Tuple[str, int, int]


class ProtocolError(AssertionError):
    pass


WS_OPS = ("matmul_all_reduce_ws", "matmul_reduce_scatter_ws", "matmul_reduce_scatter_ws_pairs")


def ws_tiles(rank: int, tiles: int, pid: int, programs: int, rs: bool, pairs: bool = True) -> List[Tuple[int, int]]:
    """The (half, tile) list program ``pid`` of the two-rank warp-specialised kernel walks
    (kernels/dist_gemm_ar_ws.py, ``_schedule`` / ``_tile_at``): half 0 is a tile whose partial goes
    to the peer (A), half 1 one of ours (B). ``rs``: tiles of a slice (A: the peer slice's tile,
    B: ours), in pairs or as one list (the peer's first); else the all-reduce's tile pairs over the
    whole output, tile t being rank t % 2's (an odd last pair: rank 0's B, rank 1's A)."""
    P = programs
    if rs:
        if pairs:
            return [(j % 2, pid + (j // 2) * P) for j in range(2 * max(0, -(-(tiles - pid) // P)))]
        out = []
        for j in range(max(0, -(-(2 * tiles - pid) // P))):
            pos = pid + j * P
            out.append((int(pos >= tiles), pos - tiles * int(pos >= tiles)))
        return out
    mine = max(0, -(-(-(-tiles // 2) - pid) // P))
    q_last = pid + (mine - 1) * P
    odd_last = mine > 0 and 2 * q_last + 1 >= tiles
    n = 2 * mine - int(odd_last)
    out = []
    for j in range(n):
        half = (j % 2) | int(j == n - 1 and odd_last and rank == 0)
        out.append((half, 2 * (pid + (j // 2) * P) + (half + 1 - rank) % 2))
    return out


def _ws_program(rank: int, tiles: List[Tuple[int, int]], rs: bool, late_flag: bool = False) -> List[Step]:
    """Steps of one WS consumer: a staged tile's copy to the peer leaves during the next tile's K
    loop and its flag goes up after that loop, before the next tile's own wait; B waits for the
    peer's partial and reads it (all-reduce: then its sum goes back the same way); the all-reduce
    ends waiting for the peer's sums of its A tiles. ``late_flag`` (a model-only fault): the flag
    after the next tile's wait instead, which must deadlock. (``options.fused_rs_early`` moves the
    flag and an own tile's wait and read into that tile's K loop, in this order: the same steps.)"""
    peer = 1 - rank
    steps: List[Step] = []
    pending = None
    for half, t in tiles:
        late: List[Step] = []
        if pending is not None:   # paced over this tile's K loop, flagged after it
            steps.append(("push", peer, pending))
            (late if late_flag else steps).append(("signal", peer, pending))
            pending = None
        if half == 0:
            pending = t
        else:
            steps += [("wait", peer, t), ("read", peer, t), ("done", peer, t)]
            if not rs:
                pending = t
        steps += late
    if pending is not None:
        steps += [("push", peer, pending), ("signal", peer, pending)]
    if not rs:
        for half, t in tiles:
            if half == 0:
                steps += [("wait", peer, t), ("read", peer, t), ("done", peer, t)]
    return steps


def programs_for(op: str, rank: int, world: int, items: int, num_programs: int, rng: random.Random) -> List[List[Step]]:
    """The step lists of one call of ``op`` on ``rank`` (work split over ``num_programs`` programs)."""
    if op.startswith(WS_OPS):   # + "_late_flag": the model-only fault of _ws_program
        base = op[:-len("_late_flag")] if op.endswith("_late_flag") else op
        if base not in WS_OPS:
            raise ValueError(f"unknown op {op!r}")
        if world != 2:
            raise ValueError(f"{op} is a two-rank kernel, got world {world}")
        rs = base.startswith("matmul_reduce_scatter")
        return [_ws_program(rank, ws_tiles(rank, items, pid, num_programs, rs, base.endswith("_pairs")), rs,
                            late_flag=op.endswith("_late_flag"))
                for pid in range(num_programs)] or [[]]
    peers_from = [(rank + i) % world for i in range(1, world)]
    work: List[List[Step]] = []
    if op == "all_gather_matmul":
        # producers: rank-1 first, row block by row block; consumers: own shard, then rank+1, ...
        for i in range(1, world):
            dest = (rank - i) % world
            for it in range(items):
                work.append([("push", dest, it), ("signal", dest, it)])
        for src in peers_from:
            for it in range(items):
                work.append([("wait", src, it), ("read", src, it), ("done", src, it)])
    elif op == "matmul_reduce_scatter":
        for dest in peers_from:        # peer slices first, each tile pushed from registers
            for it in range(items):
                work.append([("push", dest, it), ("signal", dest, it)])
        for it in range(items):        # own slice last: every peer's partial of each tile
            steps: List[Step] = []
            for src in range(world):
                if src != rank:
                    steps += [("wait", src, it), ("read", src, it), ("done", src, it)]
            work.append(steps)
    elif op == "flash_decode_distributed":
        for it in range(items):        # one program per batch row: push to all, then merge all
            steps = []
            for dest in peers_from:
                steps += [("push", dest, it), ("signal", dest, it)]
            for src in range(world):
                if src != rank:
                    steps += [("wait", src, it), ("read", src, it), ("done", src, it)]
            work.append(steps)
    elif op in ("all_gather_matmul_ce", "matmul_reduce_scatter_ce"):
        # two streams: the producer (side) and the consumer (main); one "item" per peer shard
        order = [(rank - i) % world for i in range(1, world)] if op.startswith("all_gather") else peers_from
        prod: List[Step] = []
        for dest in order:
            prod += [("wait_ack", dest, 0), ("push", dest, 0), ("signal", dest, 0)]
        cons: List[Step] = []
        for src in peers_from:
            cons += [("wait", src, 0), ("read", src, 0), ("done", src, 0)]
        cons += [("ack", src, 0) for src in peers_from] if op.startswith("matmul") else []
        if op.startswith("all_gather"):   # all-gather acks right after each shard's GEMM
            cons = []
            for src in peers_from:
                cons += [("wait", src, 0), ("read", src, 0), ("done", src, 0), ("ack", src, 0)]
        return [p for p in (prod, cons) if p] or [[]]
    else:
        raise ValueError(f"unknown op {op!r}")
    # persistent programs take work items in order (dynamic tickets): deal them out round-robin
    progs: List[List[Step]] = [[] for _ in range(max(1, num_programs))]
    for i, w in enumerate(work):
        progs[i % len(progs)] += w
    return [p for p in progs if p] or [[]]


def simulate(op: str, world: int, *, calls: int = 4, items: int = 3, num_programs: int = 3, slots: int = 2,
             seed: int = 0, max_steps: int = 10**6, acks: bool = True, init_barrier: bool = True) -> Dict[str, int]:
    """Run one random interleaving; raise ProtocolError on a violation. Returns step statistics."""
    rng = random.Random(seed)
    if op.endswith("_ce"):
        slots = 1
    ack: Dict[Tuple[int, int, int], int] = {}     # (owner, consumer, item) -> epoch acked
    flag: Dict[Tuple[int, int, int], int] = {}    # (owner, src, item) -> epoch
    buf: Dict[Tuple[int, int, int, int], int] = {}  # (owner, slot, src, item) -> epoch of the data
    call_of = [0] * world                          # current call (epoch - 1) per rank
    running: List[List[List[Step]]] = [programs_for(op, r, world, items, num_programs, rng) for r in range(world)]
    reading: Dict[Tuple[int, int, int], int] = {}  # (rank, src, item) -> epoch being read
    inited = [False] * world                       # this rank's zero-fill of its new buffers has run
    steps = waits_blocked = 0
    while True:
        for r in range(world):   # finished kernels (or empty ones, world 1): the stream starts the next call
            while call_of[r] < calls and inited[r] and all(not p for p in running[r]):
                call_of[r] += 1
                if call_of[r] < calls:
                    running[r] = programs_for(op, r, world, items, num_programs, rng)
        runnable = []
        for r in range(world):
            if call_of[r] >= calls:
                continue
            if not inited[r]:
                runnable.append((r, -1))    # the queued zero_() of r's buffers and flags
                continue
            if call_of[r] == 0 and init_barrier and not all(inited):
                continue                    # synchronize + barrier after the buffers were created
            e = call_of[r] + 1
            for pi, prog in enumerate(running[r]):
                if not prog:
                    continue
                kind, peer, it = prog[0]
                if kind == "wait" and flag.get((r, peer, it), 0) < e:
                    waits_blocked += 1
                    continue
                if kind == "wait_ack" and acks and ack.get((r, peer, it), 0) < e - 1:
                    waits_blocked += 1
                    continue
                runnable.append((r, pi))
        if not runnable:
            if all(c >= calls for c in call_of):
                return dict(steps=steps, blocked_polls=waits_blocked)
            raise ProtocolError(f"{op}, world {world}: deadlock at calls {call_of}")
        r, pi = rng.choice(runnable)
        e = call_of[r] + 1
        if pi < 0:
            inited[r] = True
            steps += 1
            for d in (buf, flag, ack):
                for k in [k for k in d if k[0] == r]:
                    del d[k]
            continue
        slot = e % slots
        kind, peer, it = running[r][pi].pop(0)
        steps += 1
        if kind == "push":
            for (rr, src, item), ep in reading.items():
                if rr == peer and src == r and item == it and ep % slots == slot and ep != e:
                    raise ProtocolError(f"{op}, world {world}: rank {r} call {e} overwrote slot {slot} of rank {peer} "
                                        f"while it still reads call {ep}'s data (item {it})")
            buf[(peer, slot, r, it)] = e
        elif kind == "signal":
            if flag.get((peer, r, it), 0) > e:
                raise ProtocolError(f"{op}: flag went backwards")
            flag[(peer, r, it)] = e
        elif kind == "read":
            got = buf.get((r, slot, peer, it))
            if got != e:
                raise ProtocolError(f"{op}, world {world}: rank {r} call {e} read item {it} from rank {peer} and saw "
                                    f"call {got}'s data")
            reading[(r, peer, it)] = e
        elif kind == "ack":
            ack[(peer, r, it)] = e
        elif kind == "done":
            got = buf.get((r, slot, peer, it))
            del reading[(r, peer, it)]
            if got != e:
                raise ProtocolError(f"{op}, world {world}: rank {r} call {e}: item {it} from rank {peer} was "
                                    f"overwritten by call {got} during the read")
        if steps > max_steps:
            raise ProtocolError("too many steps")
