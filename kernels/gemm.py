"""GEMM ``C = A @ B`` with fp32 accumulation, one Triton kernel for every mapping policy.

Read top to bottom:

1. :func:`gemm_tile_acc` -- the epilogue-free core: the fp32 accumulator of one (BLOCK_M, BLOCK_N)
   output tile. It reads A and B either through TMA tensor descriptors (Hopper fast path: TMA
   copies into swizzled shared memory feed ``wgmma``; out-of-range rows/columns/K come back as
   zeros, so edges need no masks) or through plain pointers with masks (any strides, the
   interpreter, pre-Hopper and AMD GPUs). Other kernels (e.g. a fused all-gather + GEMM) can call
   it with their own operands.
2. :func:`_gemm_one_tile` -- program/tile id -> (tile_m, tile_n) through the policy
   (``MAPPING``, one constexpr; ``numasched.mappings.jit.gemm_tile``), the tile loop, then the
   store (TMA or masked pointers).
3. :func:`gemm_kernel` -- the kernel: one tile per program, or (``PERSISTENT``) a grid of about
   one program per SM that walks ``for tile in range(pid, num_tiles, num_programs)``; each tile
   id goes through the policy, so policies keep their meaning (for several domains the host makes
   num_programs a multiple of the domain count, so tile t still runs on domain t mod X).
4. Configs: ``triton.autotune`` on GPU keyed on M, N, K and the layout; one small fixed config
   in the interpreter. Host planning (layouts, descriptors, launches) is numasched/gemm.py's.

A and B may each be a transposed view: A (M, K) with unit stride along M is read through a
descriptor of its (K, M) storage and transposed in registers (``.T`` is free: wgmma reads either
major order from shared memory for 16-bit types).
"""
from __future__ import annotations

from typing import Optional

import triton
import triton.language as tl

from numasched import caps
from numasched.mappings.jit import gemm_tile
from numasched.kernels.pdl import late_point, pdl_enter, pdl_late

try:  # host-side TMA descriptors (triton >= 3.3); the interpreter understands them too
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - older triton
    TensorDescriptor = None


# ----------------------------------------------------------------------------------------- device
@triton.jit
def _tile_offsets(off_m, off_n, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, INT64: tl.constexpr):
    """Row and column indices of a tile (int64 when a tensor spans more than 2^31 elements)."""
    offs_m = off_m + tl.arange(0, BLOCK_M)
    offs_n = off_n + tl.arange(0, BLOCK_N)
    if INT64:
        offs_m = offs_m.to(tl.int64)
        offs_n = offs_n.to(tl.int64)
    return offs_m, offs_n


@triton.jit
def gemm_tile_acc(a, b, off_m, off_n, M, N, K,
                  stride_am, stride_ak, stride_bk, stride_bn,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                  USE_TMA: tl.constexpr, A_TRANS: tl.constexpr, B_TRANS: tl.constexpr,
                  INPUT_PRECISION: tl.constexpr, INT64: tl.constexpr, WARP_SPECIALIZE: tl.constexpr):
    """fp32 accumulator of the output tile whose top-left element is (off_m, off_n).

    USE_TMA: ``a`` and ``b`` are tensor descriptors. A_TRANS: ``a`` describes the (K, M) storage
    with block [BLOCK_K, BLOCK_M] (else (M, K), block [BLOCK_M, BLOCK_K]); B_TRANS: ``b`` describes
    (N, K) with block [BLOCK_N, BLOCK_K] (else (K, N), block [BLOCK_K, BLOCK_N]). The strides are
    then unused.
    Pointer path: ``a``/``b`` are pointers with the given element strides; INT64 computes offsets
    in 64 bits (tensors spanning more than 2**31 elements).
    """
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_tiles = tl.cdiv(K, BLOCK_K)
    if USE_TMA:
        for ki in tl.range(0, k_tiles, warp_specialize=WARP_SPECIALIZE):
            off_k = ki * BLOCK_K
            if A_TRANS:
                a_tile = a.load([off_k, off_m]).T
            else:
                a_tile = a.load([off_m, off_k])
            if B_TRANS:
                b_tile = b.load([off_n, off_k]).T
            else:
                b_tile = b.load([off_k, off_n])
            acc = tl.dot(a_tile, b_tile, acc, input_precision=INPUT_PRECISION)
    else:
        offs_m, offs_n = _tile_offsets(off_m, off_n, BLOCK_M, BLOCK_N, INT64)
        mask_m = offs_m < M
        mask_n = offs_n < N
        # Row/column parts of the addresses do not change along K: compute them once.
        a_rows = a + offs_m[:, None] * stride_am
        b_cols = b + offs_n[None, :] * stride_bn
        for ki in range(0, k_tiles):
            offs_k = ki * BLOCK_K + tl.arange(0, BLOCK_K)
            if INT64:
                offs_k = offs_k.to(tl.int64)
            mask_k = offs_k < K
            a_tile = tl.load(a_rows + offs_k[None, :] * stride_ak, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
            b_tile = tl.load(b_cols + offs_k[:, None] * stride_bk, mask=mask_k[:, None] & mask_n[None, :], other=0.0)
            acc = tl.dot(a_tile, b_tile, acc, input_precision=INPUT_PRECISION)
    return acc


@triton.jit
def _store_tile(c, c_desc, bias, res, acc, off_m, off_n, M, N, stride_cm, stride_cn, stride_rm, stride_rn,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, C_TMA: tl.constexpr,
                EPILOGUE_SUBTILE: tl.constexpr, INT64: tl.constexpr, HAS_BIAS: tl.constexpr,
                HAS_RES: tl.constexpr):
    out_ty = c.dtype.element_ty
    # epilogue: + bias[n], + residual[m, n], in fp32, before the conversion to C's dtype
    if HAS_BIAS or HAS_RES:
        offs_m, offs_n = _tile_offsets(off_m, off_n, BLOCK_M, BLOCK_N, INT64)
        if HAS_BIAS:
            acc = acc + tl.load(bias + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
        if HAS_RES:
            acc = acc + tl.load(res + offs_m[:, None] * stride_rm + offs_n[None, :] * stride_rn,
                                mask=(offs_m[:, None] < M) & (offs_n[None, :] < N), other=0.0).to(tl.float32)
    if C_TMA:
        if EPILOGUE_SUBTILE:
            # Two (BLOCK_M, BLOCK_N/2) stores: half the shared-memory staging buffer, which leaves
            # room for one more pipeline stage with 128x256 tiles.
            halves = tl.permute(tl.reshape(acc, (BLOCK_M, 2, BLOCK_N // 2)), (0, 2, 1))
            c0, c1 = tl.split(halves)
            c_desc.store([off_m, off_n], c0.to(out_ty))
            c_desc.store([off_m, off_n + BLOCK_N // 2], c1.to(out_ty))
        else:
            c_desc.store([off_m, off_n], acc.to(out_ty))
    else:
        offs_m, offs_n = _tile_offsets(off_m, off_n, BLOCK_M, BLOCK_N, INT64)
        ptrs = c + offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn
        tl.store(ptrs, acc.to(out_ty), mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


@triton.jit
def _gemm_one_tile(tile, num_tiles, NM, NN, a, b, c, c_desc, bias, res, M, N, K,
                   stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn, stride_rm, stride_rn,
                   MAPPING: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   USE_TMA: tl.constexpr, A_TRANS: tl.constexpr, B_TRANS: tl.constexpr, C_TMA: tl.constexpr,
                   EPILOGUE_SUBTILE: tl.constexpr, INPUT_PRECISION: tl.constexpr, INT64: tl.constexpr,
                   K_LOOP_WS: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr,
                   PDL: tl.constexpr, LAST: tl.constexpr):
    # The policy: a domain remap of the tile id, then the tile it names (a tile order).
    tm, tn = gemm_tile(tile, NM, NN, MAPPING)
    off_m = tm * BLOCK_M
    off_n = tn * BLOCK_N
    acc = gemm_tile_acc(a, b, off_m, off_n, M, N, K, stride_am, stride_ak, stride_bk, stride_bn,
                        BLOCK_M, BLOCK_N, BLOCK_K, USE_TMA, A_TRANS, B_TRANS, INPUT_PRECISION, INT64, K_LOOP_WS)
    if LAST:  # this program's last tile: its K loop is done (PDL "late": the next kernel may launch)
        pdl_late(PDL)
    _store_tile(c, c_desc, bias, res, acc, off_m, off_n, M, N, stride_cm, stride_cn, stride_rm, stride_rn,
                BLOCK_M, BLOCK_N, C_TMA, EPILOGUE_SUBTILE, INT64, HAS_BIAS, HAS_RES)


@triton.jit
def gemm_kernel(a, b, c, c_desc, bias, res, M, N, K,
                stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn, stride_rm, stride_rn,
                MAPPING: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                PERSISTENT: tl.constexpr, FLATTEN: tl.constexpr, WARP_SPECIALIZE: tl.constexpr,
                EPILOGUE_SUBTILE: tl.constexpr, USE_TMA: tl.constexpr, A_TRANS: tl.constexpr,
                B_TRANS: tl.constexpr, C_TMA: tl.constexpr, INPUT_PRECISION: tl.constexpr,
                INT64: tl.constexpr, HAS_BIAS: tl.constexpr = False, HAS_RES: tl.constexpr = False,
                PDL: tl.constexpr = False):
    """C (M, N) = A (M, K) @ B (K, N) (+ bias[n]) (+ res[m, n]); ``c`` is always C's pointer (its
    dtype is the output's), ``c_desc`` its descriptor when C_TMA."""
    pdl_enter(PDL)  # PDL: wait for the previous kernel here (kernels/pdl.py)
    pid = tl.program_id(0)
    NM = tl.cdiv(M, BLOCK_M)
    NN = tl.cdiv(N, BLOCK_N)
    num_tiles = NM * NN
    if PERSISTENT:
        # flatten fuses the tile and K loops so the pipeliner prefetches the next tile's operands
        # during this tile's epilogue. WARP_SPECIALIZE is kept for experiments only (no config sets
        # it: see gpu_configs).
        for tile in tl.range(pid, num_tiles, tl.num_programs(0), flatten=FLATTEN,
                             warp_specialize=WARP_SPECIALIZE):
            _gemm_one_tile(tile, num_tiles, NM, NN, a, b, c, c_desc, bias, res, M, N, K,
                           stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn, stride_rm, stride_rn,
                           MAPPING, BLOCK_M, BLOCK_N, BLOCK_K,
                           USE_TMA, A_TRANS, B_TRANS, C_TMA, EPILOGUE_SUBTILE, INPUT_PRECISION, INT64, False,
                           HAS_BIAS, HAS_RES, PDL, False)
        pdl_late(PDL)  # persistent: after the last tile (its epilogue is short against the loop)
    else:
        _gemm_one_tile(pid, num_tiles, NM, NN, a, b, c, c_desc, bias, res, M, N, K,
                       stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn, stride_rm, stride_rn,
                       MAPPING, BLOCK_M, BLOCK_N, BLOCK_K,
                       USE_TMA, A_TRANS, B_TRANS, C_TMA, EPILOGUE_SUBTILE, INPUT_PRECISION, INT64,
                       WARP_SPECIALIZE, HAS_BIAS, HAS_RES, PDL, True)


late_point(gemm_kernel)


# ----------------------------------------------------------------------------------------- configs
def _cfg(bm, bn, bk, warps, stages, persistent=False, subtile=False, ws=False, flatten=True):
    stages = caps.cap_stages("gemm", stages)  # AMD: what fits the LDS
    return triton.Config(dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, PERSISTENT=persistent,
                              FLATTEN=persistent and flatten, WARP_SPECIALIZE=ws, EPILOGUE_SUBTILE=subtile),
                         num_warps=warps, num_stages=stages, pre_hook=_set_block_shapes)


def gpu_configs(path: str, persistent: Optional[bool], fp32: bool, flatten: bool = True) -> list:
    """The handful of configs autotuned on GPU for one path ("tma"/"pointer") and persistence
    choice (True, False, or None = both, the autotuner picks)."""
    if fp32:
        base = [(128, 128, 32, 8, 3, False), (64, 128, 32, 4, 4, False), (128, 64, 32, 4, 4, False)]
    elif path == "tma":
        # 128x256x64 / 8 warps is the Hopper sweet spot (two consumer warpgroups of 64x256);
        # subtiling the epilogue frees 32 KB so 4 stages fit in 227 KB.
        base = [(128, 256, 64, 8, 3, True), (128, 256, 64, 8, 4, True), (256, 128, 64, 8, 3, False),
                (128, 128, 64, 4, 4, False), (128, 128, 64, 8, 4, False)]
    else:
        base = [(128, 256, 64, 8, 3, False), (128, 128, 64, 4, 4, False), (128, 128, 32, 4, 4, False),
                (64, 128, 64, 4, 4, False)]
    modes = [False, True] if persistent is None else [bool(persistent)]
    out = []
    for p in modes:
        for (bm, bn, bk, w, s, sub) in base:
            out.append(_cfg(bm, bn, bk, w, s, persistent=p, subtile=sub and path == "tma", flatten=flatten))
    # No warp-specialized configs: with triton 3.6 on sm_90, WARP_SPECIALIZE on the K loop fails in
    # the NVGPUWarpSpecialization pass (RuntimeError, which triton.autotune does not catch), and on
    # the persistent loop it is silently not applied (checked by compiling for sm_90 on CPU).
    return out


def cpu_config(persistent: bool) -> triton.Config:
    """The interpreter's fixed config: small tiles so tiny test shapes still span several tiles."""
    return _cfg(16, 16, 16, 1, 1, persistent=persistent)


def _set_block_shapes(nargs: dict) -> None:
    """Config pre-hook: host descriptors carry their block shape, which depends on the config."""
    bm, bn, bk = nargs["BLOCK_M"], nargs["BLOCK_N"], nargs["BLOCK_K"]
    a, b, c_desc = nargs["a"], nargs["b"], nargs.get("c_desc")
    if TensorDescriptor is not None and isinstance(a, TensorDescriptor):
        a.block_shape = [bk, bm] if nargs["A_TRANS"] else [bm, bk]
    if TensorDescriptor is not None and isinstance(b, TensorDescriptor):
        b.block_shape = [bn, bk] if nargs["B_TRANS"] else [bk, bn]
    if TensorDescriptor is not None and isinstance(c_desc, TensorDescriptor):
        c_desc.block_shape = [bm, bn // 2] if nargs["EPILOGUE_SUBTILE"] else [bm, bn]


_TUNE_KEY = ["M", "N", "K", "USE_TMA", "A_TRANS", "B_TRANS", "C_TMA", "INT64", "INPUT_PRECISION", "MAPPING"]
_TUNED: dict = {}


def tuned_kernel(path: str, persistent: Optional[bool], fp32: bool, flatten: bool = True):
    """The autotuned kernel for one (path, persistence, fp32, flatten) family (created once, cached)."""
    key = (path, persistent, fp32, flatten)
    if key not in _TUNED:
        _TUNED[key] = triton.autotune(configs=gpu_configs(path, persistent, fp32, flatten), key=_TUNE_KEY)(gemm_kernel)
    return _TUNED[key]
