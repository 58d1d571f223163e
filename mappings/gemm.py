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
