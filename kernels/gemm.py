"""GEMM ``C = A @ B`` with fp32 accumulation, one Triton kernel for every mapping policy.

Read top to bottom:

1. :func:`gemm_tile_acc` -- the epilogue-free core: the fp32 accumulator of one (BLOCK_M, BLOCK_N)
   output tile. It reads A and B either through TMA tensor descriptors (Hopper fast path: TMA
   copies into swizzled shared memory feed ``wgmma``; out-of-range rows/columns/K come back as
   zeros, so edges need no masks) or through plain pointers with masks (any strides, the
   interpreter, pre-Hopper and AMD GPUs). Other kernels (e.g. a fused all-gather + GEMM) can call
   it with their own operands.
2. :func:`_gemm_one_tile` -- program/tile id -> (tile_m, tile_n) through the policy's
   ``REMAP``/``ORDER`` device functions, the tile loop, then the store (TMA or masked pointers).
3. :func:`gemm_kernel` -- the kernel: one tile per program, or (``PERSISTENT``) a grid of about
   one program per SM that walks ``for tile in range(pid, num_tiles, num_programs)``; each tile
   id goes through the policy, so policies keep their meaning (for several domains the host makes
   num_programs a multiple of NUM_DOMAINS, so tile t still runs on domain t mod X).
4. Host side: configs (``triton.autotune`` on GPU keyed on M, N, K and the layout; one small
   fixed config in the interpreter), descriptors, and :func:`launch` which the public
   ``numasched.matmul`` calls.

A and B may each be a transposed view: A (M, K) with unit stride along M is read through a
descriptor of its (K, M) storage and transposed in registers (``.T`` is free: wgmma reads either
major order from shared memory for 16-bit types).
"""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import triton
import triton.language as tl

from .._validate import INT32_MAX

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
def _store_tile(c, c_desc, acc, off_m, off_n, M, N, stride_cm, stride_cn,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, C_TMA: tl.constexpr,
                EPILOGUE_SUBTILE: tl.constexpr, INT64: tl.constexpr):
    out_ty = c.dtype.element_ty
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
def _gemm_one_tile(tile, num_tiles, NM, NN, a, b, c, c_desc, M, N, K,
                   stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn,
                   REMAP: tl.constexpr, REMAP_PARAM: tl.constexpr, ORDER: tl.constexpr,
                   ORDER_PARAM: tl.constexpr, NUM_DOMAINS: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   USE_TMA: tl.constexpr, A_TRANS: tl.constexpr, B_TRANS: tl.constexpr, C_TMA: tl.constexpr,
                   EPILOGUE_SUBTILE: tl.constexpr, INPUT_PRECISION: tl.constexpr, INT64: tl.constexpr,
                   K_LOOP_WS: tl.constexpr):
    # The policy: logical id g (a domain remap), then the tile it names (a tile order).
    g = REMAP(tile, num_tiles, NUM_DOMAINS, REMAP_PARAM)
    tm, tn = ORDER(g, NM, NN, NUM_DOMAINS, ORDER_PARAM)
    off_m = tm * BLOCK_M
    off_n = tn * BLOCK_N
    acc = gemm_tile_acc(a, b, off_m, off_n, M, N, K, stride_am, stride_ak, stride_bk, stride_bn,
                        BLOCK_M, BLOCK_N, BLOCK_K, USE_TMA, A_TRANS, B_TRANS, INPUT_PRECISION, INT64, K_LOOP_WS)
    _store_tile(c, c_desc, acc, off_m, off_n, M, N, stride_cm, stride_cn,
                BLOCK_M, BLOCK_N, C_TMA, EPILOGUE_SUBTILE, INT64)


@triton.jit
def gemm_kernel(a, b, c, c_desc, M, N, K,
                stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn,
                REMAP: tl.constexpr, REMAP_PARAM: tl.constexpr, ORDER: tl.constexpr,
                ORDER_PARAM: tl.constexpr, NUM_DOMAINS: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                PERSISTENT: tl.constexpr, FLATTEN: tl.constexpr, WARP_SPECIALIZE: tl.constexpr,
                EPILOGUE_SUBTILE: tl.constexpr, USE_TMA: tl.constexpr, A_TRANS: tl.constexpr,
                B_TRANS: tl.constexpr, C_TMA: tl.constexpr, INPUT_PRECISION: tl.constexpr,
                INT64: tl.constexpr):
    """C (M, N) = A (M, K) @ B (K, N); ``c`` is always C's pointer (its dtype is the output's),
    ``c_desc`` its descriptor when C_TMA."""
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
            _gemm_one_tile(tile, num_tiles, NM, NN, a, b, c, c_desc, M, N, K,
                           stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn,
                           REMAP, REMAP_PARAM, ORDER, ORDER_PARAM, NUM_DOMAINS, BLOCK_M, BLOCK_N, BLOCK_K,
                           USE_TMA, A_TRANS, B_TRANS, C_TMA, EPILOGUE_SUBTILE, INPUT_PRECISION, INT64, False)
    else:
        _gemm_one_tile(pid, num_tiles, NM, NN, a, b, c, c_desc, M, N, K,
                       stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn,
                       REMAP, REMAP_PARAM, ORDER, ORDER_PARAM, NUM_DOMAINS, BLOCK_M, BLOCK_N, BLOCK_K,
                       USE_TMA, A_TRANS, B_TRANS, C_TMA, EPILOGUE_SUBTILE, INPUT_PRECISION, INT64,
                       WARP_SPECIALIZE)


# ----------------------------------------------------------------------------------------- configs
def _flatten_enabled() -> bool:
    """Flattened persistent loops (default on; NUMASCHED_GEMM_FLATTEN=0 turns them off)."""
    return os.environ.get("NUMASCHED_GEMM_FLATTEN", "1") != "0"


def _cfg(bm, bn, bk, warps, stages, persistent=False, subtile=False, ws=False):
    return triton.Config(dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, PERSISTENT=persistent,
                              FLATTEN=persistent and _flatten_enabled(), WARP_SPECIALIZE=ws, EPILOGUE_SUBTILE=subtile),
                         num_warps=warps, num_stages=stages, pre_hook=_set_block_shapes)


def gpu_configs(path: str, persistent: Optional[bool], fp32: bool) -> list:
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
            out.append(_cfg(bm, bn, bk, w, s, persistent=p, subtile=sub and path == "tma"))
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


_TUNE_KEY = ["M", "N", "K", "USE_TMA", "A_TRANS", "B_TRANS", "C_TMA", "INT64", "INPUT_PRECISION", "NUM_DOMAINS"]
_TUNED: dict = {}


def tuned_kernel(path: str, persistent: Optional[bool], fp32: bool):
    """The autotuned kernel for one (path, persistence, fp32) family (created once, cached)."""
    key = (path, persistent, fp32, _flatten_enabled())
    if key not in _TUNED:
        _TUNED[key] = triton.autotune(configs=gpu_configs(path, persistent, fp32), key=_TUNE_KEY)(gemm_kernel)
    return _TUNED[key]


# ----------------------------------------------------------------------------------------- host
def _is_interpreter() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def _tma_supported(device: torch.device) -> bool:
    if TensorDescriptor is None or device.type != "cuda" or torch.version.hip is not None:
        return False
    return _capability(device.index if device.index is not None else torch.cuda.current_device())[0] >= 9


@functools.lru_cache(maxsize=None)
def _capability(index) -> tuple:
    # cached: a device property query per launch is host time a small GEMM cannot hide
    return torch.cuda.get_device_capability(index)


@functools.lru_cache(maxsize=None)
def _sm_count(index) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def tma_view(t: torch.Tensor):
    """How TMA can read a 2-D tensor: ``(transposed, shape, strides)`` of a row-major descriptor
    over its storage -- (rows, cols) if the last dimension has unit stride, (cols, rows) with
    ``transposed`` if the first one has -- or None (unaligned base or leading stride).
    A dimension of size 1 has no meaningful stride; a padded one stands in for it."""
    es = t.element_size()
    if t.data_ptr() % 16:
        return None
    r, c = t.shape
    s0, s1 = t.stride()
    align = 16 // es

    def lead_ok(lead):
        return lead > 0 and (lead * es) % 16 == 0

    if s1 == 1 or c == 1:
        lead = s0 if r > 1 else triton.cdiv(c, align) * align
        if lead_ok(lead):
            return False, [r, c], [lead, 1]
    if s0 == 1 or r == 1:
        lead = s1 if c > 1 else triton.cdiv(r, align) * align
        if lead_ok(lead):
            return True, [c, r], [lead, 1]
    return None


def needs_int64(*tensors: torch.Tensor) -> bool:
    """Whether some tensor's largest element offset overflows int32."""
    for t in tensors:
        span = sum((s - 1) * abs(st) for s, st in zip(t.shape, t.stride()) if s > 0)
        if span > INT32_MAX:
            return True
    return False


def input_precision(dtype: torch.dtype) -> Optional[str]:
    """fp32 inputs: "ieee" unless torch allows TF32 (``torch.set_float32_matmul_precision``
    "high"/"medium"), to match torch.matmul. 16-bit inputs: the default (tensor cores)."""
    if dtype != torch.float32:
        return None
    return "ieee" if torch.get_float32_matmul_precision() == "highest" else "tf32"


@dataclass
class LaunchInfo:
    """What the last :func:`launch` ran (tests read it to show the Triton kernel ran)."""

    path: str
    persistent: Optional[bool]
    policy: str
    grid: tuple
    config: Optional[dict]
    int64: bool
    a_trans: bool
    b_trans: bool
    c_tma: bool


stats = {"launches": 0, "last": None}


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return _sm_count(device.index if device.index is not None else torch.cuda.current_device())
    return 8  # interpreter: a handful of "SMs" so persistent loops take several trips


def persistent_programs(num_tiles: int, num_sms: int, num_domains: int) -> int:
    """Persistent grid size: at most one program per SM, a multiple of the domain count when it
    can be (so tile t and program t mod P share domain t mod X under round-robin dispatch)."""
    p = max(1, min(num_sms, num_tiles))
    if num_domains > 1 and p >= num_domains:
        p -= p % num_domains
    return p


def choose_persistent(num_tiles: int, num_sms: int) -> bool:
    """Heuristic where no autotuner decides (interpreter): persistent once there are several
    waves of tiles, where launching a program per tile costs the most."""
    return num_tiles >= 2 * num_sms


def launch(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, policy, num_domains: int, *,
           persistent: Optional[bool] = None, path: str = "auto", config: Optional[triton.Config] = None,
           int64: Optional[bool] = None, num_programs: Optional[int] = None) -> LaunchInfo:
    """Run C = A @ B with Triton (inputs already validated; M, N, K >= 1).

    ``path``: "auto" (TMA on Hopper+ when the operands allow it, else pointers), "tma" or
    "pointer". ``config``: a fixed ``triton.Config`` (skips the autotuner). On GPU with no
    config, the autotuner picks the tile config and, when ``persistent`` is None, whether to run
    persistent. ``num_programs`` overrides the persistent grid size (tests).
    """
    # Everything below depends only on the call's signature (shapes, strides, 16-byte alignment,
    # dtype, device, policy, options, environment), so it is worked out once per signature and
    # kept; a repeat call only builds its descriptors and launches. Its autotuned config is kept
    # too: the autotuner's own per-call work (key building, pre-hook) costs tens of microseconds.
    key = (a.shape, b.shape, c.shape, a.stride(), b.stride(), c.stride(), a.data_ptr() % 16 == 0,
           b.data_ptr() % 16 == 0, c.data_ptr() % 16 == 0, a.dtype, b.dtype, c.dtype, a.device, id(policy),
           num_domains, persistent, path, id(config), int64, num_programs, _is_interpreter(),
           os.environ.get("NUMASCHED_AUTOTUNE"), os.environ.get("NUMASCHED_GEMM_FLATTEN"),
           torch.get_float32_matmul_precision())
    plan = _PLANS.get(key)
    if plan is None or plan.policy is not policy or plan.config is not config:   # ids can be reused
        plan = _plan(a, b, c, policy, num_domains, persistent, path, config, int64, num_programs)
        if len(_PLANS) >= 1024:
            _PLANS.clear()
        _PLANS[key] = plan
    if plan.use_tma:
        a_arg = TensorDescriptor(a, plan.a_view[1], plan.a_view[2], [16, 16])
        b_arg = TensorDescriptor(b, plan.b_view[1], plan.b_view[2], [16, 16])
        c_desc = TensorDescriptor(c, plan.c_view[1], plan.c_view[2], [16, 16]) if plan.c_tma else None
    else:
        a_arg, b_arg, c_desc = a, b, None
    args = (a_arg, b_arg, c, c_desc, *plan.sizes)
    if plan.meta is not None:
        if plan.use_tma:
            _set_block_shapes({"a": a_arg, "b": b_arg, "c_desc": c_desc, **plan.kw, **plan.meta})
        gemm_kernel[plan.grid_of(plan.meta)](*args, **plan.kw, **plan.meta)
    else:   # GPU, autotuning: the first call of this signature tunes (or finds its tuning)
        kernel = tuned_kernel(plan.path, persistent, plan.fp32)
        kernel[plan.grid_of](*args, **plan.kw)
        plan.meta = dict(kernel.best_config.all_kwargs())
    if plan.info is None:
        m = plan.meta
        plan.info = LaunchInfo(path=plan.path, persistent=bool(m["PERSISTENT"]), policy=policy.name,
                               grid=plan.grid_of(m), config=dict(m), int64=plan.int64, a_trans=plan.a_trans,
                               b_trans=plan.b_trans, c_tma=plan.c_tma)
    stats["launches"] += 1
    stats["last"] = plan.info
    return plan.info


_PLANS: dict = {}


@dataclass
class _Plan:
    path: str
    use_tma: bool
    c_tma: bool
    a_trans: bool
    b_trans: bool
    int64: bool
    fp32: bool
    a_view: Optional[tuple]
    b_view: Optional[tuple]
    c_view: Optional[tuple]
    sizes: tuple          # M, N, K and the strides, as the kernel takes them
    kw: dict              # policy and layout constexprs
    grid_of: Callable     # meta -> grid
    meta: Optional[dict]  # the config to launch (None: ask the autotuner)
    policy: object        # kept: the key holds only their ids
    config: Optional[triton.Config]
    info: Optional[LaunchInfo] = None


def _plan(a, b, c, policy, num_domains, persistent, path, config, int64, num_programs) -> _Plan:
    config_arg = config   # the plan is keyed on what the caller passed
    M, K = a.shape
    N = b.shape[1]
    dev = a.device
    interp = _is_interpreter() and dev.type == "cpu"
    a_view, b_view, c_view = tma_view(a), tma_view(b), tma_view(c)
    if path == "auto":
        # The interpreter takes the pointer path unless asked (both are tested there).
        path = "tma" if (_tma_supported(dev) and a_view is not None and b_view is not None) else "pointer"
    if path == "tma":
        if TensorDescriptor is None or not (interp or _tma_supported(dev)):
            raise ValueError("path='tma' needs a Hopper (sm_90+) GPU or the interpreter")
        if a_view is None or b_view is None:
            raise ValueError("path='tma' needs 16-byte aligned a and b with one unit-stride dimension")
    elif path != "pointer":
        raise ValueError(f"path must be 'auto', 'tma' or 'pointer', got {path!r}")
    use_tma = path == "tma"
    # The store goes through TMA only for a row-major C (any other C takes masked pointer stores).
    c_tma = use_tma and c_view is not None and not c_view[0]
    if int64 is None:
        int64 = needs_int64(a, b, c)
    a_trans = bool(a_view[0]) if use_tma else False
    b_trans = bool(b_view[0]) if use_tma else False

    fp32 = a.dtype == torch.float32
    nsm = _num_sms(dev)
    sizes = (M, N, K, a.stride(0), a.stride(1), b.stride(0), b.stride(1), c.stride(0), c.stride(1))
    kw = dict(policy.kernel_args(num_domains), USE_TMA=use_tma, A_TRANS=a_trans, B_TRANS=b_trans,
              C_TMA=c_tma, INPUT_PRECISION=input_precision(a.dtype), INT64=int64)

    def grid(meta):   # plain integer arithmetic: triton.cdiv is a slower call on the host
        tiles = -(-M // meta["BLOCK_M"]) * -(-N // meta["BLOCK_N"])
        if meta["PERSISTENT"]:
            return (num_programs or persistent_programs(tiles, nsm, num_domains),)
        return (tiles,)

    if config is None and interp:
        tiles16 = triton.cdiv(M, 16) * triton.cdiv(N, 16)
        config = cpu_config(choose_persistent(tiles16, nsm) if persistent is None else bool(persistent))
    if config is None and os.environ.get("NUMASCHED_AUTOTUNE", "1") == "0":
        # autotuning off (GPU tests): the first config of the family, compiled once
        config = gpu_configs(path, bool(persistent), fp32)[0]
    meta = None
    if config is not None:
        meta = dict(config.all_kwargs())
        if persistent is not None:
            meta["PERSISTENT"] = bool(persistent)
            meta["FLATTEN"] = bool(persistent) and _flatten_enabled()
    return _Plan(path=path, use_tma=use_tma, c_tma=c_tma, a_trans=a_trans, b_trans=b_trans, int64=int64, fp32=fp32,
                 a_view=a_view, b_view=b_view, c_view=c_view, sizes=sizes, kw=kw, grid_of=grid,
                 meta=meta, policy=policy, config=config_arg)


# ----------------------------------------------------------------------------------------- offline check
def compile_report(config: triton.Config, *, dtype: str = "bf16", path: str = "tma", a_trans: bool = False,
                   b_trans: bool = False, c_tma: bool = True, policy: str = "grouped", num_domains: int = 1,
                   int64: bool = False, precision: Optional[str] = None, capability: int = 90) -> dict:
    """Compile the kernel for an NVIDIA target without a GPU (triton ships ptxas) and report what
    the compiler made of it: shared memory, wgmma and TMA use, registers and spills.

    Needs a process without TRITON_INTERPRET=1 (triton picks the interpreter at decoration time).
    """
    from .. import mappings as _M
    from ._offline import compile_and_report

    fn = gemm_kernel
    if not hasattr(fn, "arg_names"):
        raise RuntimeError("compile_report needs a process without TRITON_INTERPRET=1")
    kw = dict(config.kwargs)
    bm, bn, bk = kw["BLOCK_M"], kw["BLOCK_N"], kw["BLOCK_K"]
    const = dict(_M.get(policy).kernel_args(num_domains), **kw, USE_TMA=path == "tma", A_TRANS=a_trans,
                 B_TRANS=b_trans, C_TMA=c_tma and path == "tma", INPUT_PRECISION=precision, INT64=int64)
    sig = {}
    if path == "tma":
        sig["a"] = f"tensordesc<{dtype}[{bk}, {bm}]>" if a_trans else f"tensordesc<{dtype}[{bm}, {bk}]>"
        sig["b"] = f"tensordesc<{dtype}[{bn}, {bk}]>" if b_trans else f"tensordesc<{dtype}[{bk}, {bn}]>"
    else:
        sig["a"] = sig["b"] = f"*{dtype}"
    sig["c"] = f"*{dtype}"
    if const["C_TMA"]:
        sig["c_desc"] = f"tensordesc<{dtype}[{bm}, {bn // 2 if kw['EPILOGUE_SUBTILE'] else bn}]>"
    else:
        const["c_desc"] = None
    for n in ("M", "N", "K", "stride_am", "stride_bk", "stride_cm"):
        sig[n] = "i32"
    for n in ("stride_ak", "stride_bn", "stride_cn"):  # unit inner strides, as the JIT specializes them
        const[n] = 1
    signature = {n: ("constexpr" if n in const else sig[n]) for n in fn.arg_names}
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]]
             for n in ("a", "b", "c", "M", "N", "K", "stride_am", "stride_bk", "stride_cm")
             if not signature[n].startswith(("tensordesc", "constexpr"))}
    return compile_and_report(fn, signature, {n: v for n, v in const.items() if n in fn.arg_names}, attrs,
                              num_warps=config.num_warps, num_stages=config.num_stages, capability=capability,
                              ptxas_timeout=120)


def _main(argv=None) -> int:
    """``python -m numasched.kernels.gemm``: compile every GPU config for sm_90 and print JSON lines."""
    import json

    for path in ("tma", "pointer"):
        for fp32 in (False, True):
            for cfg in gpu_configs(path, None, fp32):
                dtype = "fp32" if fp32 else "bf16"
                rep = compile_report(cfg, dtype=dtype, path=path, precision="tf32" if fp32 else None)
                print(json.dumps(dict(path=path, dtype=dtype, **cfg.kwargs, num_warps=cfg.num_warps,
                                      num_stages=cfg.num_stages, **rep)), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(_main())
