"""GEMM tile orders: logical id -> (tile_m, tile_n) over an nM x nN tile grid.

* row_major: tile_m = g div nN, tile_n = g mod nN (no grouping; the baseline).
* grouped: Triton's GROUP_SIZE_M raster with GM = PARAM (default 8): ids walk a band of GM tile
  rows column by column, so concurrently running tiles share A rows and B columns. Equals
  CUTLASS's raster-along-N with swizzle GM when GM is a power of two.
* chiplet_tiled: the contiguous domain remap, then grouped: each domain works on one compact
  region of tiles that share A rows and B columns (AMD's chiplet-tiled GEMM).
* chiplet_tiled_chunked: the chunked remap with C = GM*GM, then grouped: each domain gets GM x GM
  squares of tiles in turn (hipBLASLt / tritonBLAS style); the last partial round stays in place.
"""
import numpy as np
import triton
import triton.language as tl

from ._registry import Order, Policy, register
from .remap import CHUNKED, CONTIGUOUS, IDENTITY


def _row_major_ref(g, grid, X, param):
    nM, nN = grid.dims
    return np.stack([g // nN, g % nN], axis=1)


@triton.jit
def row_major_order(pid, NM, NN, NUM_DOMAINS: tl.constexpr, PARAM: tl.constexpr):
    return pid // NN, pid % NN


def _grouped_ref(g, grid, X, GM):
    nM, nN = grid.dims
    n = GM * nN
    first = (g // n) * GM
    gm = np.minimum(nM - first, GM)
    r = g % n
    return np.stack([first + r % gm, r // gm], axis=1)


@triton.jit
def grouped_order(pid, NM, NN, NUM_DOMAINS: tl.constexpr, PARAM: tl.constexpr):
    # min(PARAM, NM) * NN <= NM * NN, which fits int32 (GemmGrid checks it), while PARAM * NN
    # need not; when NM < PARAM both give the same tile (every id lies in the first band)
    n = tl.minimum(NM, PARAM) * NN
    first = (pid // n) * PARAM
    gm = tl.minimum(NM - first, PARAM)
    r = pid % n
    return first + r % gm, r // gm


ROW_MAJOR = Order("row_major", "gemm", _row_major_ref, row_major_order, doc="tile_m = g div nN; tile_n = g mod nN")
GROUPED = Order("grouped", "gemm", _grouped_ref, grouped_order, default_param=8,
                doc="Triton GROUP_SIZE_M raster (GM = order_param)")

GROUP_M = GROUPED.default_param
register(Policy("row_major", "gemm", IDENTITY, ROW_MAJOR, doc=ROW_MAJOR.doc))
register(Policy("grouped", "gemm", IDENTITY, GROUPED, order_param=GROUP_M, doc=GROUPED.doc))
register(Policy("chiplet_tiled", "gemm", CONTIGUOUS, GROUPED, order_param=GROUP_M,
                doc="contiguous domain remap, then grouped raster"))
register(Policy("chiplet_tiled_chunked", "gemm", CHUNKED, GROUPED, remap_param=GROUP_M * GROUP_M,
                order_param=GROUP_M, doc="chunked domain remap (C = GM*GM), then grouped raster"))


def split_units_reference(policy, pids, grid, splits: int, num_domains: int):
    """NumPy twin of ``mappings.jit.gemm_split_unit``: (tile_m, tile_n, split) of each program id
    among ``grid.size * splits`` split-K work units, int64 array of shape (len(pids), 3)."""
    from ._registry import GemmGrid, _as_pids, check_num_domains, get, positive_int

    policy = get(policy)
    if policy.kind != "gemm":
        raise ValueError(f"split-K units need a gemm policy, {policy.name!r} is of kind {policy.kind!r}")
    if not isinstance(grid, GemmGrid):
        raise ValueError(f"split-K units need a GemmGrid, got {type(grid).__name__}")
    S = positive_int("splits", splits)
    X = check_num_domains(num_domains)
    W = grid.size * S
    g = _as_pids(pids)
    if g.size and (g.min() < 0 or g.max() >= W):
        raise ValueError(f"pids must lie in [0, {W}) for {grid} with {S} splits")
    g = np.asarray(policy.remap.reference(g, W, X, policy.remap_param), dtype=np.int64)
    tiles = np.asarray(policy.order.reference(g // S, grid, X, policy.order_param), dtype=np.int64).reshape(-1, 2)
    return np.concatenate([tiles, (g % S)[:, None]], axis=1)


def streamk_units_reference(policy, grid, iters_per_tile: int, programs: int, num_domains: int, *,
                            piece_order: str = "program", with_ids: bool = False, k_aligned: bool = False) -> list:
    """NumPy twin of the stream-K kernel's work assignment (kernels/gemm_streamk.py): for each
    physical program 0..programs-1 the list of (tile_m, tile_n, k_lo, k_hi) it computes, in K
    iterations. Whole waves first (program p: tile ids p, p + programs, ...), then the stream-K
    pieces, piece p to program p (``piece_order="program"``, what the kernel does) or in the
    order of the policy's domain remap over the programs (``"remap"``: a tile's pieces on one
    domain under a chiplet policy; an alternative the simulator compares, numasched/sim/streamk.py);
    every tile id goes through the policy (remap over all tiles, then its order) as ``gemm_tile``
    does. ``with_ids``: entries are (tile_m, tile_n, k_lo, k_hi, tile_id, virtual_program);
    ``k_aligned``: a piece's two parts in the kernel's order (see :func:`streamk_pieces`)."""
    if piece_order not in ("remap", "program"):
        raise ValueError(f"piece_order must be 'remap' or 'program', got {piece_order!r}")
    from ._registry import GemmGrid, check_num_domains, get, positive_int

    policy = get(policy)
    if policy.kind != "gemm" or not isinstance(grid, GemmGrid):
        raise ValueError("stream-K units need a gemm policy and a GemmGrid")
    I = positive_int("iters_per_tile", iters_per_tile)
    P = positive_int("programs", programs)
    X = check_num_domains(num_domains)
    T = grid.size
    dp, _ = streamk_split(T, I, P)
    tile_of = policy.reference(np.arange(T), grid, X)           # tile id -> (tm, tn)
    v_of = (np.asarray(policy.remap.reference(np.arange(P), P, X, policy.remap_param), dtype=np.int64)
            if piece_order == "remap" else np.arange(P, dtype=np.int64))
    virt = streamk_pieces(T, I, P, k_aligned=k_aligned)
    out = []
    for p in range(P):
        v = int(v_of[p])
        whole = [(t, lo, hi, p) for t, lo, hi in virt[p] if t < dp]    # by physical program
        sk = [(t, lo, hi, v) for t, lo, hi in virt[v] if t >= dp]      # by virtual program
        out.append([(int(tile_of[t][0]), int(tile_of[t][1]), lo, hi) + ((t, w) if with_ids else ())
                    for t, lo, hi, w in whole + sk])
    return out


# ---- stream-K work decomposition (kernels/gemm_streamk.py walks it; host planning sizes it)
def streamk_split(tiles: int, iters_per_tile: int, programs: int) -> tuple:
    """(dp_tiles, iters_per_program) for ``tiles`` tiles of ``iters_per_tile`` K iterations on
    ``programs`` programs: whole waves run data-parallel, the remainder's iterations are cut into
    ``programs`` equal pieces (0 when the tiles fill whole waves)."""
    if tiles < 1 or iters_per_tile < 1 or programs < 1:
        raise ValueError(f"tiles, iters_per_tile and programs must be >= 1, got {tiles}, {iters_per_tile}, {programs}")
    dp = (tiles // programs) * programs
    rest = (tiles - dp) * iters_per_tile
    return dp, -(-rest // programs) if rest else 0


def streamk_pieces(tiles: int, iters_per_tile: int, programs: int, *, k_aligned: bool = False) -> list:
    """The reference partition in tile-id space: for each virtual program (the position of a
    program in the policy's remap order), its list of (tile, k_lo, k_hi) in iterations, in the
    order the kernel computes them: data-parallel tiles first (those by physical program: tile p,
    p + programs, ...), then its stream-K piece. Fewer tiles remain than programs, so a piece is
    the tail of one tile and the head of the next at most; ``k_aligned``
    (``options.gemm_streamk_k_aligned``) lists the head (K from 0) before the tail.
    ``numasched.mappings.streamk_units_reference`` maps it through a policy."""
    dp, W = streamk_split(tiles, iters_per_tile, programs)
    out = [[(t, 0, iters_per_tile) for t in range(p, dp, programs)] for p in range(programs)]
    total = (tiles - dp) * iters_per_tile
    for p in range(programs):
        it, end = p * W, min(p * W + W, total)
        segs = []
        while it < end:
            t = it // iters_per_tile
            lo = it - t * iters_per_tile
            hi = min(iters_per_tile, lo + end - it)
            segs.append((dp + t, lo, hi))
            it += hi - lo
        out[p].extend(segs[::-1] if k_aligned else segs)
    return out
