"""Per-call cost model of the collectives: which implementation a call with ``impl="auto"`` runs.

Every estimate is latency + bytes / bandwidth, in seconds, from a :class:`Link` describing the
GPUs' interconnect (defaults: two H200s over NVLink, fitted to measurements here; see
:class:`Link`). GEMM times come from numasched's schedule model (numasched.gemm_schedule).

The choice is recorded in each call's plan (``cfg["impl"]``), printed by the benchmark, and can
be forced with ``impl=``. The model decides between implementations that are all correct, so a
wrong constant costs time, never a wrong result.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

__all__ = ["Link", "LINK", "LINKS", "all_reduce_s", "choose_all_reduce", "fused_matmul_all_reduce_s", "gemm_engine",
           "rs_ws_pays", "rs_ws_pairs", "fused_ar_ws_width", "gemm_time_s", "link_for", "set_link", "two_kernel_gemm_s"]


@dataclass(frozen=True)
class Link:
    """Latency (us) and effective bandwidth (bytes/s) of each way to move data between the GPUs.

    Defaults: two H200s (NV18), CUDA-graph replays, fitted to scripts/ar_sweep.py and bench
    collectives on 2026-11-23 (bench/results/collectives-*.csv, ar_sweep-*.log): numasched
    one-shot 7.6 / 10.8 / 24.3 / 80.7 / 308 us and two-shot 10.6 / 13.2 / 22.8 / 67.9 / 255 us at
    64 KB / 1 / 4 / 16 / 64 MB per rank; NCCL 10.2 / 15.2 / 33.5 / 75.6 / 247 us (it changes
    algorithm with the size: two regimes). One-shot and two-shot refitted on 2026-11-26 to the
    kernels' BULK schedule above 256 KB (two H100s, NV18 as the H200s; scripts/ar_sweep.py,
    bench/results/ar-s16/): one-shot 12.0 / 22.2 / 70.6 / 134 us and two-shot 15.7 / 25.4 / 64.2 /
    112 us at 1 / 4 / 16 / 32 MB.
    """

    oneshot_us: float = 7.0
    oneshot_bw: float = 255e9      # bytes each rank sends, (W-1) n, per second
    twoshot_us: float = 13.0
    twoshot_bw: float = 340e9      # 2 (W-1)/W n per second
    nccl_us: float = 9.5
    nccl_bw: float = 180e9         # small messages
    nccl_large_us: float = 18.0
    nccl_large_bw: float = 294e9   # large messages (bus bandwidth)
    push_bw: float = 340e9         # remote stores with every SM pushing (the fused GEMM kernels)
    flag_us: float = 3.0           # a flag raised by one GPU seen by the other's spin


LINK = Link()
# Four H200s of one host (bench/results/tp4-s13/ar/, 2026-11-26): two-shot's three stages and
# W - 1 peers per stage cost more latency and bandwidth than at two ranks (1 / 4 / 16 MB: 20.1 /
# 41.0 / 116 us); NCCL's large-message algorithm is faster per ring byte (16 / 64 MB: 98.8 / 323
# us) and its small one slower (8 KB - 1 MB: 12.9-21.5 us); one-shot 15.5 / 24.1 us at 512 KB / 1 MB.
# With these the model picks the measured fastest of numasched/NCCL at all 10 sizes of that run.
LINKS = {2: LINK, 4: replace(LINK, oneshot_us=7.5, oneshot_bw=200e9, twoshot_us=13.0, twoshot_bw=235e9,
                             nccl_us=12.5, nccl_large_us=24.0, nccl_large_bw=337e9)}


def link_for(world: int, link: Link = None) -> Link:
    """``link`` if given, else the constants measured at the largest world size <= ``world``
    (8 ranks use the 4-rank constants: no 8-GPU machine has been measured)."""
    return link if link is not None else _measured_at(LINKS, world)


def _measured_at(table: dict, world: int):
    """``table``'s entry for the largest measured world size <= ``world`` (the smallest one's below
    every measured size)."""
    fits = [w for w in table if w <= world]
    return table[max(fits) if fits else min(table)]


def set_link(world: int = 2, **fields) -> Link:
    """Replace model constants for ``world`` ranks (e.g. after measuring another machine);
    returns the new Link."""
    global LINK
    LINKS[world] = replace(link_for(world), **fields)
    if world == 2:
        LINK = LINKS[2]
    return LINKS[world]


def all_reduce_s(impl: str, nbytes: int, world: int, link: Link = None) -> float:
    """Estimated seconds of one all-reduce of ``nbytes`` per rank over ``world`` ranks."""
    L = link_for(world, link)
    if world <= 1:
        return 0.0
    ring = 2 * (world - 1) / world * nbytes
    if impl == "oneshot":
        return L.oneshot_us * 1e-6 + (world - 1) * nbytes / L.oneshot_bw
    if impl == "twoshot":
        return L.twoshot_us * 1e-6 + ring / L.twoshot_bw
    if impl == "nccl":
        return min(L.nccl_us * 1e-6 + ring / L.nccl_bw, L.nccl_large_us * 1e-6 + ring / L.nccl_large_bw)
    raise ValueError(f"unknown all-reduce implementation {impl!r}")


def choose_all_reduce(nbytes: int, world: int, *, allowed=("oneshot", "twoshot", "nccl"), link: Link = None) -> str:
    """The fastest of ``allowed`` by :func:`all_reduce_s` (ties: the first listed)."""
    for name, v, lo in (("nbytes", nbytes, 0), ("world", world, 1)):
        # (symbolic sizes under torch.compile pass: only plain values are range-checked)
        if isinstance(v, (bool, float, str)) or (isinstance(v, int) and v < lo):
            raise ValueError(f"{name} must be an int >= {lo}, got {v!r}")
    return min(allowed, key=lambda impl: all_reduce_s(impl, nbytes, world, link))


# Which GEMM a model-chosen collective+GEMM (and the TP decoder's projections) runs: numasched's
# where it ran at least cuBLAS's speed on the issue-13 inference grid of both Hopper GPUs, else
# cuBLAS. Per-M geomean of cuBLAS time / numasched's (H200 bench/results/gemm-s47/h200-grid, H100
# gemm-s45/h100-grid, 11-12 shapes each): 1.02-1.05 on both at M <= 128; 1.005 / 0.979 at 256;
# 1.00-1.07 from 512 rows (the warp-specialised kernel's regime). The rule of 2026-11-22 (up to 64
# rows: the Triton kernels ran 0.74-0.93 of cuBLAS above) holds where that kernel is not there.
NUMASCHED_GEMM_MAX_M = 128
NUMASCHED_GEMM_WS_MIN_M = 512


def gemm_engine(m: int, device=None) -> str:
    """``"numasched"`` or ``"torch"``: which GEMM a model-chosen collective+GEMM runs for ``m``
    rows on ``device`` (None: the current CUDA device; a CPU or meta device, or no GPU: the rule
    without the warp-specialised kernel). See NUMASCHED_GEMM_MAX_M."""
    if m <= NUMASCHED_GEMM_MAX_M:
        return "numasched"
    if m >= NUMASCHED_GEMM_WS_MIN_M and _ws_gemm_device(device):
        return "numasched"
    return "torch"


def _cuda_device(device):
    """``device`` as a CUDA torch.device (None: the current one), or None where it is not a GPU
    (a CPU or meta device, or no GPU at all)."""
    import torch

    if device is None:
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
    device = torch.device(device)
    return device if device.type == "cuda" else None


def _ws_gemm_device(device) -> bool:
    """Whether numasched's GEMM runs the warp-specialised kernel on ``device`` (Hopper, Gluon,
    ``options.gemm_ws`` not off)."""
    from numasched import caps, options

    device = _cuda_device(device)
    if device is None or not (options.current().gemm_ws and caps.hopper(device)):
        return False
    from numasched.kernels.gemm_ws import HAVE_GLUON

    return bool(HAVE_GLUON)


# ----------------------------------------------------------------------------- GEMM + collective
# A fused GEMM+collective kernel starts a persistent grid, keeps per-tile flags and (at small M)
# cuts the rows into one shard per rank, so each rank's shard re-reads the whole weight: its GEMM
# time is modelled as W GEMMs of one shard. Fitted to the two-H200 runs of 2026-11-22 (fused
# 48 us vs bulk 26 us at M = 16, 183 vs 241 us at M = 2048; bench/results/distributed-*.csv).
FUSED_FIXED_US = 20.0
FUSED_GEMM_OVER_WHOLE = 1.05


def gemm_s(M: int, N: int, K: int, dtype) -> float:
    """Modelled seconds of an (M, K) x (K, N) GEMM (numasched.gemm_schedule's pick and estimate)."""
    from numasched.gemm_schedule import choose

    return choose(max(M, 1), max(N, 1), max(K, 1), dtype).est_s


# (fp32, see gemm_time_s) The schedule model ranks schedules; its absolute times run high from a few hundred rows (on
# the inference grid of two H200 runs, bench/results/gemm-s14-full/, the geomean of estimate /
# measured per M: 0.90 at 128, 1.19 at 256, 1.28 at 512, 1.32 at 1024, 1.37 at 4096), and cuBLAS
# runs those sizes faster than numasched (cuBLAS time / numasched's: 0.90 at M = 128-256, 0.88 at
# 512, 0.94 at 1024, 0.98 from 2048; about 1.0-1.05 up to 64 rows). GEMM + collective choices
# compare a numasched GEMM (fused) with cuBLAS ones (bulk, symm_mem) plus fixed costs of tens of
# microseconds, so they price GEMMs with these measured ratios (log-linear in M between points).
# (Up to 128 rows the estimate is used as it is: 0.90-1.02 there, the ranking's own regime.)
EST_OVER_MEASURED = {128: 1.0, 256: 1.19, 512: 1.28, 1024: 1.32, 4096: 1.37}
CUBLAS_OVER_NUMASCHED = {64: 1.0, 128: 0.90, 512: 0.88, 1024: 0.94, 2048: 0.98}


def _log_interp(x: int, table: dict) -> float:
    import math

    xs = sorted(table)
    lx = math.log2(max(x, 1))
    if lx <= math.log2(xs[0]):
        return table[xs[0]]
    for lo, hi in zip(xs, xs[1:]):
        if lx <= math.log2(hi):
            f = (lx - math.log2(lo)) / (math.log2(hi) - math.log2(lo))
            return table[lo] * (1 - f) + table[hi] * f
    return table[xs[-1]]


# 16-bit GEMMs are priced with the chooser as it runs them on Hopper (the warp-specialised kernel
# among the candidates, its model fitted to measured times): on the inference grid (H200,
# bench/results/gemm-s42/grid; H100, gemm-s40/h100-grid9) that estimate over the measured cuBLAS
# time is 0.93-1.06 up to 2048 rows and 0.87-0.91 from 4096 (geomean per M, both GPUs), and cuBLAS
# and numasched's times are within 3 % of each other at every M, so both engines get the same
# time. The Triton-only estimate the tables above correct ran 1.5x (H200) to 1.95x (H100) the
# measured times from 256 rows, the tables 1.34-1.46: on two H100s the reduce-scatter's cuBLAS
# GEMM was priced 25 % high at 1024-1536 rows (bench/results/tp2-s42/call3) and "auto" took the
# fused kernel at Llama-3-8B down 1536 rows (0.943-0.950 of torch symm_mem).
EST_WS_OVER_MEASURED = {64: 1.0, 128: 0.95, 256: 0.97, 512: 0.95, 1024: 0.98, 4096: 0.91, 16384: 0.87}


def gemm_time_s(M: int, N: int, K: int, dtype, engine: str = "numasched") -> float:
    """Expected seconds of an (M, K) x (K, N) GEMM run by ``engine`` ("numasched" or "torch",
    i.e. cuBLAS): 16-bit, the chooser's estimate with the warp-specialised kernel over
    EST_WS_OVER_MEASURED; otherwise :func:`gemm_s` corrected by the measured ratios above."""
    if engine not in ("numasched", "torch"):
        raise ValueError(f"engine must be 'numasched' or 'torch', got {engine!r}")
    if _elt(dtype) == 2:
        from numasched.gemm_schedule import choose

        est = choose(max(M, 1), max(N, 1), max(K, 1), dtype, ws=True, splitk_tma=True, tail=True).est_s
        return est / _log_interp(M, EST_WS_OVER_MEASURED)
    t = gemm_s(M, N, K, dtype) / _log_interp(M, EST_OVER_MEASURED)
    return t * _log_interp(M, CUBLAS_OVER_NUMASCHED) if engine == "torch" else t


def nccl_move_s(nbytes_received: int, link: Link = None) -> float:
    """NCCL all-gather / reduce-scatter in which each rank receives ``nbytes_received``."""
    L = link or LINK
    return min(L.nccl_us * 1e-6 + nbytes_received / L.nccl_bw,
               L.nccl_large_us * 1e-6 + nbytes_received / L.nccl_large_bw)


def rs_ws_pays(M: int, N: int, world: int, num_sms: int = 132) -> bool:
    """Whether the two-rank reduce-scatter runs on the warp-specialised kernel by default
    (kernels/dist_gemm_ar_ws.py, RS): where its 2 T tiles (T a slice's 128 x 256 tiles) take more
    than one round of programs, so each partial's copy to the peer is paced over a next tile's K
    loop. In one round every copy leaves after the last K loop, unhidden: two H100s,
    bench/results/tp2-s28a/, 147.5 against the Triton kernel's 95.6 us at 1024 x 4096 x 7168 (T 64),
    174.8 against 189.6 at 2048 rows (T 128, two rounds)."""
    T = -(-(M // max(world, 1)) // RS_TILE[0]) * -(-N // RS_TILE[1])
    return world == 2 and 2 * T > num_sms


def rs_ws_pairs(tiles: int, programs: int) -> bool:
    """Whether the WS reduce-scatter walks its 2 x ``tiles`` tiles (a slice's ``tiles``, the
    peer's and ours) in pairs (the peer slice's tile q, then ours) rather than as one list: where
    pairs add no round (2 ceil(T / P) against ceil(2 T / P); 160 tiles on 132 programs: four
    rounds in pairs, three in one list, 204.7 against 160-166 us at 2048 x 5120 x 4096 on two
    H100s). Where they are equal, pairs: at 16384 x 4096 x 7168 they ran 1484-1593 us in four calls,
    the one list 1604 in one (bench/results/tp2-s28a/ to s28e/)."""
    return 2 * _rounds(tiles, programs) <= _rounds(2 * tiles, programs)


def gemm_collective_s(op: str, impl: str, M: int, N: int, K: int, dtype, world: int, link: Link = None,
                      ws: bool = False, num_sms: int = 132) -> float:
    """Modelled seconds of ``op`` ("all_gather_matmul": M rows in all, K, N per rank;
    "matmul_reduce_scatter": M rows, K per rank, N) run as ``impl`` ("fused", "bulk" or
    "symm_mem"). ``ws``: the fused reduce-scatter may take the warp-specialised kernel (a Hopper
    GPU, two ranks: numasched.distributed._ws.ws_ok); it does where :func:`rs_ws_pays`."""
    L = link_for(world, link)
    es = _elt(dtype)
    shard = max(1, M // world)
    if op == "all_gather_matmul":
        moved = (world - 1) * shard * K * es
    elif op == "matmul_reduce_scatter":
        moved = (world - 1) * shard * N * es
    else:
        raise ValueError(f"unknown op {op!r}")
    if impl == "bulk":   # NCCL, then torch.matmul
        return gemm_time_s(M, N, K, dtype, "torch") + nccl_move_s(moved, L)
    if impl == "fused" and op == "matmul_reduce_scatter" and es == 2 and world == 2:
        # rounds of 128 x BLOCK_N tiles (every slice's) on one program per SM, a tile's K loop at
        # RS_SM_FLOPS, times the kernel's measured factor (see RS_WS_OVER)
        bn = 256 if N >= 256 else 128
        T = -(-shard // 128) * -(-N // bn)   # a slice's tiles
        tiles = world * T
        tile_s = 2 * 128 * bn * K / RS_SM_FLOPS
        if ws and rs_ws_pays(M, N, world, num_sms):
            programs = min(num_sms, tiles)   # (_ws.launch's grid: one program per tile, at most the SMs)
            if rs_ws_pairs(T, programs):     # program q takes pair q: T programs busy
                rounds, busy = 2 * _rounds(T, programs), min(T, programs)
            else:
                rounds, busy = _rounds(tiles, programs), programs
            over = RS_WS_OVER
        else:
            rounds, busy, over = _rounds(tiles, num_sms), min(tiles, num_sms), RS_TRITON_OVER
        return over * rs_busy_factor(busy, num_sms) * rounds * tile_s + L.flag_us * 1e-6
    if impl == "fused":
        # W GEMMs of one row shard each, and never less than the whole GEMM and its per-tile flags
        # and pushes (FUSED_GEMM_OVER_WHOLE): the schedule model's time per row is not monotonic
        # in M, and its dip at 768 rows once had "auto" run the fused kernel at 1536 (0.85x)
        g = max(world * gemm_time_s(shard, N, K, dtype), FUSED_GEMM_OVER_WHOLE * gemm_time_s(M, N, K, dtype))
        return max(g, moved / L.push_bw) + (FUSED_FIXED_US + L.flag_us) * 1e-6
    if impl == "symm_mem":   # copy engine overlapped with cuBLAS: a floor, then the GEMM plus its tail
        tail = SYMM_MEM_OVER_US[op]
        per_mb = SYMM_MEM_TAIL_US_PER_MB.get(op)
        if per_mb is not None and world == 2:   # measured on two ranks
            tail = max(tail, per_mb * moved / 2**20 - SYMM_MEM_TAIL_OFFSET_US)
        # its cuBLAS GEMMs are one per rank's row chunk (the reduce-scatter's: a destination's
        # slice; the all-gather's: a source's shard, as it lands), each reading the whole weight,
        # from HBM again where it does not fit the L2 (SYMM_MEM_L2_BYTES). The reduce-scatter on
        # two H100s: Llama-3-8B down (a 59 MB weight) at 768 rows took 120 us against 115 at 1024
        # (tp2-s29d), where the whole GEMM's model put it at 83 and auto ran it (0.75x the best).
        # The all-gather on two H200s (tp2-s47/coll, coll2): Qwen3-32B gate_up (262 MB) at 1024
        # rows 477-497 us against bulk's 436-439, where the whole GEMM's model put it at 398
        # against bulk's 409 and auto ran it (0.87-0.89x the best); Llama-3-8B QKV (25 MB) at 1024
        # rows ran its cuBLAS GEMM's time plus 25 us, as the whole GEMM prices it.
        g = gemm_time_s(M, N, K, dtype, "torch")
        if op == "matmul_reduce_scatter" or K * N * es > SYMM_MEM_L2_BYTES:
            g = max(g, world * gemm_time_s(shard, N, K, dtype, "torch"))
        return max(_symm_mem_min_us(op, world), tail + g * 1e6) * 1e-6
    raise ValueError(f"unknown implementation {impl!r}")


# numasched's one-kernel GEMM + all-reduce (kernels/dist_gemm_ar.py) with its TMA-fed 128 x 256
# tiles (from FUSED_AR_MIN_ROWS rows): a persistent grid of one program per SM, so its GEMM pays
# wave quantisation on top of the schedule model's time, and every output tile is pushed to each
# peer (remote stores at push_bw). On two H200s (bench/results/collectives-2xh200-2026-11-23.csv,
# 02:25 UTC run) the sum of the two fits the measured kernel within a few per cent at M >= 1024
# and orders it right against the two-kernel and NCCL paths at 15 of 16 points of M >= 256
# (the 16th within 1 %); narrower tiles below 256 rows were 1.1-2x slower than the alternatives,
# so "auto" only weighs the fused kernel from FUSED_AR_MIN_ROWS.
FUSED_AR_TILE = (128, 256)
FUSED_AR_MIN_ROWS = 256
# Refitted once the all-reduce got faster (BULK, 2026-11-26): the pushes of every wave but the
# last half hidden under the next wave's compute, and the kernel's GEMM FUSED_AR_GEMM_OVER times
# the schedule model's (Triton against cuBLAS). Over the twelve M >= 1024 points of Llama-3-8B and
# Qwen3-32B's o / down projections (two H100s: bench/results/tp2-s16/collectives/; two H200s:
# collectives-mar-fused-*, their two-kernel times less the all-reduce's measured gain) every pick
# is within 3 % of the faster path (geomean 0.998); the old form (pushes after the GEMM) ran the
# two-kernel path at 16384 x 4096 x 2048, 0.86x the fused kernel, once the two-shot sped up.
FUSED_AR_GEMM_OVER = 1.10
FUSED_AR_PUSH_HIDDEN = 0.5
# Two ranks with several tiles per program run PAIRS (each tile pair's all-reduce in two halves,
# the peer's tile first). Two H200s (bench/results/tp2-s23-a/mar-sweep-tp2-h200.log): 4096 x 4096
# x 2048 171.3 us and x 7168 379.2 (cuBLAS 95.1 / 301.2, the two-kernel path with the two-shot
# 205 / 415): its GEMM at about cuBLAS's rate and about 75 us of the 32 MB's push not hidden at
# both. Fitted to those ratios against the two-kernel path as this module prices it (the
# schedule model's GEMM estimate plus the all-reduce's).
# (0.94 fits those two; 1.02 keeps the two H100 points where PAIRS lost to NCCL + cuBLAS or
# nearly did, 16384 x 5120 x 12800: 3547 against 3482 us and 2048 x 4096 x 7168: 209 against 216,
# on the right side: bench/results/tp2-s23-b/mar-sweep-tp2-h100.log.)
FUSED_PAIRS_GEMM_OVER = 1.02
FUSED_PAIRS_PUSH_EXPOSED = 0.75


def fused_pairs(tiles: int, programs: int) -> bool:
    """Whether the two-rank fused GEMM + all-reduce takes tile pairs (PAIRS): with several tiles
    per program, and only where pairs do not add a round of tiles (a program does two tiles a
    pair: 320 tiles on 132 programs are three rounds one tile at a time but four in pairs, and
    ran 612 against 498 us at 2048 x 5120 x 12800 on two H100s)."""
    return _rounds(tiles, programs) > 1 and 2 * _rounds(-(-tiles // 2), programs) <= _rounds(tiles, programs)


def _rounds(units: int, programs: int) -> int:
    """Rounds of ``units`` work units on ``programs`` programs, one unit a program a round."""
    return -(-units // max(1, programs))


# Two ranks, refit in the twenty-eighth session (two H100s, bench/results/tp2-s28a/, s28b/, s28d/,
# s28e/: Llama-3-8B o / down and Qwen3-32B o / down, 512-16384 rows, on and off the grid): priced
# against the model's cuBLAS GEMM (gemm_time_s), as the two-kernel paths are, the kernel's time is
# that GEMM over its wave efficiency plus a share of the pushed bytes at push_bw: the median share
# 0.3 for the warp-specialised tile pairs, 0.6 for the Triton pairs, 0.9 one tile at a time. With
# the long-GEMM rate below, its picks over those 54 points: the worst 0.967 of the faster path, two
# below 0.99, and against the best baseline (NCCL + cuBLAS, torch symm_mem) 0.979 at worst (4096 x
# 5120 x 12800); the form above picked the two-kernel path where the fused kernel was 1.27x faster
# (6144 x 5120 x 4096): 0.785 of the faster path at worst, 12 points below 0.99.
FUSED_AR2_EXPOSED = {"ws": 0.3, "pairs": 0.6, "single": 0.9}
# One round of tiles on part of the SMs (80-100 tiles at 640 rows of Llama-3-8B o and Qwen3-32B
# o / down) runs faster per tile, as the reduce-scatter's does (RS_IDLE_SM_GAIN): without that
# factor the model priced the fused kernel 10-20 % high there and ran the two-kernel path at 0.93-0.97
# of it (bench/results/tp2-s43/coll-offrows); with it every recorded pick of the matmul_all_reduce
# cases is within 1 % of the faster path but one (0.970), where 5 of 8 were at 640-3072 rows.
# The one regime where that fails: a GEMM of milliseconds. At 16384 x 5120 x 12800 (3.1 ms of
# cuBLAS GEMM) the fused kernel ran 3807 / 3888 us (WS) and 3952 / 4188 (Triton pairs) against
# 3573-3582 for cuBLAS + the two-shot (tp2-s28a/b/e; tp2-s23-b: 3547 against 3482): its GEMM at
# about 1.17x cuBLAS's time, where every shorter point (up to 1.4 ms: 16384 x 4096 x 7168) ran at
# it. Why is not measured (clocks under sustained tensor and link load are one guess); the model
# prices GEMMs longer than FUSED_AR2_LONG_S at that rate on H100s (and GPUs not measured). Two
# H200s do not: there the WS fused kernel ran 3370 and 3439 us against 3781 / 3840 for numasched
# + two-shot and 3586 / 3659 for NCCL + cuBLAS (bench/results/tp2-s47/coll, tp2-s48/call2/coll),
# its GEMM at 0.96-0.98 of the modelled cuBLAS time, as at the shorter points.
FUSED_AR2_LONG_S = 2e-3
FUSED_AR2_LONG_OVER = {"h100": 1.17, "h200": 1.0}
FUSED_AR2_LONG_OVER_DEFAULT = 1.17


def fused_long_over(device=None) -> float:
    """FUSED_AR2_LONG_OVER for ``device`` (default: the current CUDA device; none: the default)."""
    import torch

    device = _cuda_device(device)
    if device is None:
        return FUSED_AR2_LONG_OVER_DEFAULT
    name = torch.cuda.get_device_name(device).lower()
    return next((v for k, v in FUSED_AR2_LONG_OVER.items() if k in name), FUSED_AR2_LONG_OVER_DEFAULT)


# The warp-specialised kernel's tiles are 128 x 256, or 128 x 128 where 256-wide tile pairs would
# add a round of tiles and 128-wide pairs would not (Qwen3-32B o and down at 4096 rows: 640 tiles
# of 256 columns are five rounds one at a time but six in pairs, so the Triton kernel ran them one
# at a time, 1.13x and 1.05x NCCL + cuBLAS on two H100s against a ceiling of 1.78x and 1.26x,
# bench/results/tp2-s42/call3; 1280 tiles of 128 columns are ten rounds either way). A 128-wide
# tile's GEMM runs FUSED_AR2_NARROW_OVER times the 256-wide one's (the WS GEMM's 128 x 128 tiles
# against 128 x 256 on the H200 grid). Timed on two H100s (tp2-s42/call11): Qwen3-32B down at 4096
# rows 856 us (the Triton kernel one tile at a time: 885; "auto" now runs it, 1.105x bulk against
# torch + two-shot's 1.022x before), Qwen3-32B o 372 (363): the model's 312 is 16 % low there,
# where the exchange of 128-wide tiles hides less behind K loops of 64 steps (fitting either point
# alone gives 1.04 or 1.31; 1.31 would have "auto" take torch + two-shot at Qwen3-32B down).
FUSED_AR2_NARROW_OVER = 1.07


def fused_ar_ws_width(M: int, N: int, num_sms: int = 132) -> int:
    """The warp-specialised fused GEMM + all-reduce's tile width for an (M, N) output (see above):
    128 where 256-wide tiles take more than one round, pairs of them would add one, and pairs of
    128-wide tiles would not; else 256 (in one round of 256-wide tiles the kernel runs them one at
    a time, unlagged)."""
    wide = -(-M // FUSED_AR_TILE[0]) * -(-N // FUSED_AR_TILE[1])
    narrow = -(-M // FUSED_AR_TILE[0]) * -(-N // (FUSED_AR_TILE[1] // 2))
    adds = _rounds(wide, num_sms) > 1 and not fused_pairs(wide, num_sms)
    return 128 if adds and fused_pairs(narrow, num_sms) else 256


def fused_matmul_all_reduce_s(M: int, N: int, K: int, dtype, world: int, num_sms: int = 132,
                              link: Link = None, ws: bool = False, device=None) -> float:
    """Modelled seconds of numasched's fused GEMM + all-reduce kernel for an (M, K) x (K, N)
    partial product on each of ``world`` ranks (big-tile path: M >= FUSED_AR_MIN_ROWS). Two ranks:
    on the scale of :func:`gemm_time_s` (``ws``: the tile pairs run on the warp-specialised
    kernel); more: on :func:`gemm_s`'s (compare with the two-kernel paths on the same scale:
    :func:`two_kernel_gemm_s`). ``device``: the GPU whose long-GEMM rate applies
    (:func:`fused_long_over`; default the current one)."""
    L = link_for(world, link)
    width = fused_ar_ws_width(M, N, num_sms) if ws and world == 2 else FUSED_AR_TILE[1]
    tiles = -(-M // FUSED_AR_TILE[0]) * -(-N // width)
    pushed = (world - 1) * M * N * _elt(dtype)
    pairs = world == 2 and fused_pairs(tiles, num_sms)
    if world == 2:
        units = 2 * _rounds(-(-tiles // 2), num_sms) if pairs else _rounds(tiles, num_sms)
        wave_eff = tiles / (units * max(1, num_sms))
        share = FUSED_AR2_EXPOSED["ws" if ws and pairs else "pairs" if pairs else "single"]
        g = gemm_time_s(M, N, K, dtype, "torch") * (FUSED_AR2_NARROW_OVER if width < FUSED_AR_TILE[1] else 1.0)
        if g > FUSED_AR2_LONG_S:
            g *= fused_long_over(device)
        if units == 1:   # one part-empty round: its busy SMs run faster, as the reduce-scatter's (rs_busy_factor)
            g *= rs_busy_factor(tiles, num_sms)
        return g / wave_eff + share * pushed / L.push_bw + L.flag_us * 1e-6
    waves = -(-tiles // max(1, num_sms))
    wave_eff = tiles / (waves * max(1, num_sms))
    hidden = FUSED_AR_PUSH_HIDDEN * (waves - 1) / waves
    return (FUSED_AR_GEMM_OVER * gemm_s(M, N, K, dtype) / wave_eff + (1 - hidden) * pushed / L.push_bw
            + L.flag_us * 1e-6)


def two_kernel_gemm_s(M: int, N: int, K: int, dtype, world: int, engine: str = "torch") -> float:
    """The GEMM of a two-kernel GEMM + all-reduce on the scale :func:`fused_matmul_all_reduce_s`
    uses for ``world`` ranks: :func:`gemm_time_s` of ``engine`` for two, :func:`gemm_s` for more."""
    return gemm_time_s(M, N, K, dtype, engine) if world == 2 else gemm_s(M, N, K, dtype)


# torch symmetric memory's fused ops (copy engine + cuBLAS, overlapped): flat at small M, then the
# cuBLAS GEMM plus a tail. Two H200s (bench/results/tp2-s14/collectives/, Llama-3-8B QKV and down
# projections): all-gather + matmul 32.7 / 36.2 / 42.4 us at M = 16 / 64 / 256, GEMM + 14-29 us
# at 1024-4096; matmul + reduce-scatter 66 us at M = 16-256, GEMM + 15-19 us at 1024-4096. (A
# fixed cost on top of the GEMM, as before, made "auto" run the bulk path at M = 1024, 0.89x the
# best, and the fused kernel at 4096-16384, 0.95-0.98x.)
# Four H200s (bench/results/tp4-s13/collectives/): floors of 54-57 and 90-94 us. Eight ranks use
# the four-rank floors (no 8-GPU machine has been measured: an extrapolation, as link_for's).
SYMM_MEM_MIN_US = {2: {"all_gather_matmul": 33.0, "matmul_reduce_scatter": 64.0},
                   4: {"all_gather_matmul": 54.0, "matmul_reduce_scatter": 92.0}}
SYMM_MEM_OVER_US = {"all_gather_matmul": 25.0, "matmul_reduce_scatter": 24.0}
# (the reduce-scatter's 24 us since gemm_time_s prices 16-bit GEMMs by the WS-aware estimate, 20
# before: its cuBLAS GEMM 15 % closer to the measured at 1024-1536 rows, the tail takes that share;
# over the two H100s' recordings of the current fused kernel, tp2-s42/call3 coll, rs1 and rs2, the
# pick is within 1 % of the best at 24 of 24 points, 20 with the former pricing)
# The reduce-scatter's tail grows with the bytes each rank receives: on two H100s and two H200s
# (bench/results/tp2-s28a/rsws*-tp2-h100.log, tp2-s26b/rs-flat1-tp2-h200.log, Llama-3-8B down and
# Qwen3-32B o at 1024-16384 rows) its time less the model's cuBLAS GEMM is 21-28 us at 4-10 MB,
# 50-62 at 17-21 MB and 255-280 at 67-84 MB: about 3.4 us a MiB less 7.5 (the fixed tail alone
# had "auto" take it at 4096 and 16384 rows, 0.96-0.99x the Triton fused kernel).
SYMM_MEM_TAIL_US_PER_MB = {"matmul_reduce_scatter": 3.4}
# A weight larger than this is read from HBM by each of the all-gather's chunk GEMMs (Hopper's
# 50 MB L2; 40 leaves room for the activations and outputs).
SYMM_MEM_L2_BYTES = 40 * 2**20
SYMM_MEM_TAIL_OFFSET_US = 7.5
# The fused reduce-scatter (16-bit, two ranks measured) as rounds of tiles: each program takes a
# 128 x 256 tile's whole K loop, so its time is the rounds of all slices' tiles on the SMs times
# a tile's time at a per-SM rate (700 TFLOP/s on 132 SMs, Hopper's dense bf16 as cuBLAS reaches
# it), times a factor. Two H100s (bench/results/tp2-s28a/, tp2-s28c/, Llama-3-8B down and Qwen3-32B
# o at 1024-16384 rows): the Triton kernel 1.07-1.18x; under one round (T < SMs: 16-256 rows) the
# Triton kernel 0.87-0.89x. The warp-specialised one (rs_ws_pays) with its tiles grouped and the
# early flag (bench/results/tp2-s41/call4: Llama-3-8B down, Qwen3-32B o and down, 2048-16384 rows)
# 0.94-1.06x, geomean 1.00 (before both, tp2-s28*: 1.00-1.10x, geomean 1.05).
# (The earlier form, W GEMMs of a row shard, put the Triton kernel at 147 us at 1024 x 4096 x 7168,
# measured 95: "auto" ran torch's at 112. It stays for more ranks, whose kernel was not re-measured.)
RS_SM_FLOPS = 700e12 / 132
RS_TILE = (128, 256)
RS_TRITON_OVER = 1.10
RS_WS_OVER = 1.00
# A tile runs faster on an SM while other SMs idle (more of the L2 and HBM bandwidth each, clock
# headroom): the per-SM rate above is for every SM busy. Two H100s (bench/results/tp2-s41/call5):
# the warp-specialised kernel's 80 tile pairs on 80 of 132 SMs (Qwen3-32B o, 1024 rows) ran 0.89x
# two rounds at that rate (92.5 us against 104.2 modelled, which had "auto" take torch symm_mem,
# 100.3 us: 0.935 of the best); the Triton kernel's one round of 32-40 tiles (16-256 rows)
# 0.79-0.88x. A tile's time is scaled by 1 - RS_IDLE_SM_GAIN x the idle SMs' fraction.
RS_IDLE_SM_GAIN = 0.30


def rs_busy_factor(busy: int, num_sms: int) -> float:
    """The fused reduce-scatter's tile time with ``busy`` of ``num_sms`` SMs working, over its time
    with all of them (RS_IDLE_SM_GAIN)."""
    idle = max(0.0, 1.0 - busy / max(1, num_sms))
    return 1.0 - RS_IDLE_SM_GAIN * idle


def _symm_mem_min_us(op: str, world: int) -> float:
    return _measured_at(SYMM_MEM_MIN_US, world)[op]


def choose_gemm_collective(op: str, M: int, N: int, K: int, dtype, world: int, *, bulk_ok: bool = True,
                           symm_mem_ok: bool = False, link: Link = None, ws: bool = False,
                           num_sms: int = 132) -> str:
    """"fused", "bulk" or "symm_mem" for one call, by :func:`gemm_collective_s` ("fused" where
    neither other is possible: the simulation)."""
    if not bulk_ok or world == 1:
        return "fused"
    impls = ("fused", "bulk", "symm_mem") if symm_mem_ok else ("fused", "bulk")
    t = {impl: gemm_collective_s(op, impl, M, N, K, dtype, world, link, ws=ws, num_sms=num_sms) for impl in impls}
    return min(t, key=t.get)


def _elt(dtype) -> int:
    import torch

    return torch.empty((), dtype=dtype).element_size()
