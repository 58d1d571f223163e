"""Split-K GEMM for inference shapes: ``C = A @ B (+ bias) (+ residual)`` when M is small.

A decode step's projections have M = batch (1-256) rows against a weight of N x K: there are few
output tiles (N / BLOCK_N of them when M fits one tile row), too few to give every SM work, and
the time is the weight's bytes streamed from memory. So each output tile's K range is cut into
SPLIT_K parts, one program each, and a tile's partial sums are merged in the same launch:

1. Work units are (tile_m, tile_n, split): program ``pid`` takes
   ``gemm_split_unit(pid, NM, NN, SPLIT_K, MAPPING)`` (numasched.mappings.jit): the mapping
   policy's domain remap over all units keeps a tile's splits together, then its tile order.
2. A program accumulates its K range in fp32 (BLOCK_M may exceed M: rows are masked; the padded
   dot is free, the tensor cores idle in a bandwidth-bound problem). Operands come through
   pointers, or (USE_TMA, ``options.gemm_splitk_tma``) through TMA descriptors, which lets the
   medium-M tiles (M = 128-1024) run at the tiled kernel's tensor rate; with A_PTR, A through
   masked pointer loads beside B's descriptor (every tile, or the partial last tile row: a box
   running past A's last row is slow; ``options.gemm_splitk_operands``).
3. SPLIT_K == 1: the program applies the epilogue and stores. Otherwise it stores its fp32
   partial tile to a workspace and takes a ticket (an atomic counter per tile); the program that
   takes the last ticket sums the SPLIT_K partials **in split order** (the result does not depend
   on which program finished last: deterministic), applies the epilogue, stores, and resets the
   counter for the next launch (and for CUDA-graph replays).
4. TAIL (a medium M: more tiles than one wave, fewer than a whole number of waves): the first
   ``whole_tiles`` tiles (the full waves) run whole, and only the remaining tiles are cut into
   SPLIT_K parts, so the last wave keeps every SM busy instead of a fraction of them
   (``gemm_tail_unit``); a whole tile stores as in 3, a part as in 3's merge.

Pointer loads of a K that is not a multiple of 16 (A_K_VEC / B_K_VEC, host: :func:`k_vector`):
Triton knows an integer argument only as a multiple of 16 or not, so the rows of A and the columns
of a W.T view (K-contiguous) would load one element at a time. Where K and those operands' leading
strides are multiples of 8 (4, 2) elements, the kernel rounds them down to that multiple (a no-op
the compiler's alignment analysis understands) and the loads are 16- (8-, 4-) byte vectors again.
The same for an M-contiguous A (A_M_VEC: M and its leading stride) and an N-contiguous B
(B_N_VEC: N and its leading stride).

Epilogue: ``+ bias[n]`` (HAS_BIAS), ``+ residual[m, n]`` (HAS_RES), then the output's dtype.
Host planning (the schedule choice, workspace, counters) is numasched/gemm.py's.
"""
import math

import triton
import triton.language as tl

from numasched.mappings.jit import gemm_split_unit, gemm_tail_unit
from numasched.kernels.pdl import late_point, pdl_enter, pdl_late, pdl_trigger, prefetch_l2


@triton.jit
def _epilogue_store(acc, c, bias, res, offs_m, offs_n, M, N, stride_cm, stride_cn, stride_rm, stride_rn,
                    HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr):
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    if HAS_BIAS:
        acc = acc + tl.load(bias + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
    if HAS_RES:
        acc = acc + tl.load(res + offs_m[:, None] * stride_rm + offs_n[None, :] * stride_rn, mask=mask,
                            other=0.0).to(tl.float32)
    tl.store(c + offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn, acc.to(c.dtype.element_ty), mask=mask)


@triton.jit
def _load_b_tma(b, tn, k0, BLOCK_N: tl.constexpr, B_TRANS: tl.constexpr, N_OFF):
    """B's tile of tile column tn at K offset k0 through its descriptor: B (K, N) or its (N, K)
    storage (B_TRANS, the weight W of F.linear), columns from N_OFF (the SwiGLU's up half: N)."""
    if B_TRANS:
        return b.load([N_OFF + tn * BLOCK_N, k0]).T
    else:
        return b.load([k0, N_OFF + tn * BLOCK_N])


@triton.jit
def load_ab_tma(a, b, tm, tn, k0, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, A_TRANS: tl.constexpr,
                B_TRANS: tl.constexpr):
    """The A and B tiles of output tile (tm, tn) at K offset k0 through TMA descriptors: A (M, K)
    or its (K, M) storage (A_TRANS), B as _load_b_tma; past the edges the descriptors read zeros.
    Shared with the stream-K kernel."""
    if A_TRANS:
        a_t = a.load([k0, tm * BLOCK_M]).T
    else:
        a_t = a.load([tm * BLOCK_M, k0])
    return a_t, _load_b_tma(b, tn, k0, BLOCK_N, B_TRANS, 0)


@triton.jit
def _glu_store(g, u, c, offs_m, offs_n, M, N, stride_cm, stride_cn):
    """SwiGLU epilogue: silu(g) * u in fp32, then the output's dtype."""
    y = g / (1.0 + tl.exp(-g)) * u
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    tl.store(c + offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn, y.to(c.dtype.element_ty), mask=mask)


@triton.jit
def _prefetch_b(b, n0, N, k_lo, k_hi, stride_bn, BLOCK_N: tl.constexpr, GLU: tl.constexpr):
    """L2 prefetch of this unit's B: B is a weight's ``W.T`` view (unit stride along K), so each
    of its BLOCK_N columns' K range [k_lo, k_hi) is one contiguous run of W's row, one bulk
    prefetch each (GLU: the up half's columns N + n too). The host sets PREFETCH_B only where
    every run is 16-byte aligned and a multiple of 16 bytes long."""
    n = n0 + tl.arange(0, BLOCK_N)
    run = b + n.to(tl.int64) * stride_bn + k_lo
    nbytes = (k_hi - k_lo) * (b.dtype.element_ty.primitive_bitwidth // 8) + tl.zeros([BLOCK_N], tl.int32)
    live = (n < N) & (k_hi > k_lo)
    prefetch_l2(run, nbytes, live)
    if GLU:
        prefetch_l2(run + N.to(tl.int64) * stride_bn, nbytes, live)


@triton.jit
def _store_tile(acc, acc_u, c, bias, res, offs_m, offs_n, M, N, stride_cm, stride_cn, stride_rm, stride_rn,
                HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, GLU: tl.constexpr, ROW_SCALE: tl.constexpr = False,
                scale=None):
    if GLU:
        if ROW_SCALE:   # one fp32 factor per row of A (loaded before the K loop): (s a) @ b = s (a @ b)
            acc, acc_u = acc * scale[:, None], acc_u * scale[:, None]
        _glu_store(acc, acc_u, c, offs_m, offs_n, M, N, stride_cm, stride_cn)
    else:
        _epilogue_store(acc, c, bias, res, offs_m, offs_n, M, N, stride_cm, stride_cn, stride_rm, stride_rn,
                        HAS_BIAS, HAS_RES)


@triton.jit
def _merge_parts(acc, acc_u, c, bias, res, ws, counters, tm, tn, split, NM, NN, offs_m, offs_n, M, N,
                 stride_cm, stride_cn, stride_rm, stride_rn, SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, GLU: tl.constexpr,
                 ROW_SCALE: tl.constexpr = False, scale=None):
    # partial tile -> workspace [SPLIT_K, NM*BLOCK_M, NN*BLOCK_N] (fp32, padded: no masks);
    # GLU: the up half's partials in a second such block after it
    ld = NN * BLOCK_N
    plane = (NM * BLOCK_M).to(tl.int64) * ld
    rows = offs_m[:, None].to(tl.int64) * ld + offs_n[None, :]
    tl.store(ws + split * plane + rows, acc)
    if GLU:
        tl.store(ws + (SPLIT_K + split) * plane + rows, acc_u)
    # every thread's stores before the release of the ticket; the last arrival reads the
    # others' partials through L2 (.cg), never a stale L1 line
    tl.debug_barrier()
    ctr = counters + tm * NN + tn
    ticket = tl.atomic_add(ctr, 1, sem="acq_rel")
    if ticket == SPLIT_K - 1:
        total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        total_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)  # GLU: the up half (unused otherwise)
        for s in range(0, SPLIT_K):  # split order: the same sum whoever arrives last
            total += tl.load(ws + s * plane + rows, cache_modifier=".cg")
            if GLU:
                total_u += tl.load(ws + (SPLIT_K + s) * plane + rows, cache_modifier=".cg")
        _store_tile(total, total_u, c, bias, res, offs_m, offs_n, M, N, stride_cm, stride_cn, stride_rm, stride_rn,
                    HAS_BIAS, HAS_RES, GLU, ROW_SCALE, scale)
        tl.atomic_xchg(ctr, 0)  # ready for the next launch


@triton.jit
def _multiple(x, V: tl.constexpr):
    # x, a multiple of V (the host's word), written so that Triton's alignment analysis knows it
    if V > 1:
        x = x // V * V
    return x


@triton.jit
def _k_loop_tma(a, b, acc, acc_u, tm, tn, k_lo, k_hi, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_K: tl.constexpr, A_TRANS: tl.constexpr, B_TRANS: tl.constexpr, GLU: tl.constexpr,
                INPUT_PRECISION: tl.constexpr):
    """The K loop with A and B through their descriptors (GLU: the up half's B tile too; a gate
    tile's last columns past N read the first up columns: masked on store)."""
    for k0 in range(k_lo, k_hi, BLOCK_K):
        a_t, b_t = load_ab_tma(a, b, tm, tn, k0, BLOCK_M, BLOCK_N, A_TRANS, B_TRANS)
        acc = tl.dot(a_t, b_t, acc, input_precision=INPUT_PRECISION)
        if GLU:
            acc_u = tl.dot(a_t, _load_b_tma(b, tn, k0, BLOCK_N, B_TRANS, N), acc_u, input_precision=INPUT_PRECISION)
    return acc, acc_u


@triton.jit
def _k_loop_a_pointer(a, b, acc, acc_u, tn, offs_m, mask_m, k_lo, k_hi, stride_am, N, BLOCK_N: tl.constexpr,
                      BLOCK_K: tl.constexpr, B_TRANS: tl.constexpr, GLU: tl.constexpr,
                      INPUT_PRECISION: tl.constexpr, A_K_VEC: tl.constexpr):
    """The K loop with A (K-contiguous) through masked pointer loads and B through its descriptor."""
    stride_am = _multiple(stride_am, A_K_VEC)
    k_hi = _multiple(k_hi, A_K_VEC)
    a_rows = a + offs_m[:, None].to(tl.int64) * stride_am
    for k0 in range(k_lo, k_hi, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        a_t = tl.load(a_rows + offs_k[None, :], mask=mask_m[:, None] & (offs_k[None, :] < k_hi), other=0.0)
        acc = tl.dot(a_t, _load_b_tma(b, tn, k0, BLOCK_N, B_TRANS, 0), acc, input_precision=INPUT_PRECISION)
        if GLU:
            acc_u = tl.dot(a_t, _load_b_tma(b, tn, k0, BLOCK_N, B_TRANS, N), acc_u, input_precision=INPUT_PRECISION)
    return acc, acc_u


@triton.jit
def gemm_splitk_kernel(a, b, c, bias, res, ws, counters, M, N, K,
                       stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn, stride_rm, stride_rn,
                       k_per_split, whole_tiles, a_ptr,
                       MAPPING: tl.constexpr, SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, HAS_BIAS: tl.constexpr,
                       HAS_RES: tl.constexpr, INPUT_PRECISION: tl.constexpr, USE_TMA: tl.constexpr,
                       A_TRANS: tl.constexpr, B_TRANS: tl.constexpr, GLU: tl.constexpr = False,
                       PDL: tl.constexpr = False, PREFETCH_B: tl.constexpr = 0, TAIL: tl.constexpr = False,
                       ROW_SCALE: tl.constexpr = False, A_K_VEC: tl.constexpr = 1, B_K_VEC: tl.constexpr = 1,
                       A_M_VEC: tl.constexpr = 1, B_N_VEC: tl.constexpr = 1, A_PTR: tl.constexpr = 0):
    # GLU (numasched.matmul_swiglu): B holds 2N columns, gate then up; the program accumulates
    # both halves of its tile's columns (two B tiles per K step) and stores silu(gate) * up (N
    # columns), so the MLP's activation costs no kernel and no round trip of the 2N-wide output.
    # ROW_SCALE (GLU): ``bias`` holds an fp32 factor per row of A, applied to both halves before
    # the activation (an RMSNorm whose weight was folded into B: its 1/rms per row)
    M = _multiple(M, A_M_VEC)   # (the *_VEC constexprs: see "Pointer loads" above; no-ops otherwise)
    N = _multiple(N, B_N_VEC)
    NM = tl.cdiv(M, BLOCK_M)
    NN = tl.cdiv(N, BLOCK_N)
    if TAIL:   # whole tiles first, then the remainder's tiles in SPLIT_K parts (whole_tiles: host)
        tm, tn, split, whole = gemm_tail_unit(tl.program_id(0), NM, NN, whole_tiles, SPLIT_K, MAPPING)
    else:
        tm, tn, split = gemm_split_unit(tl.program_id(0), NM, NN, SPLIT_K, MAPPING)
    offs_m = tm * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tn * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N

    # ---- this unit's K range (a multiple of BLOCK_K long; the last split may be shorter or empty)
    k_lo = split * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    if TAIL:
        k_hi = tl.where(whole, K, k_hi)
    if PREFETCH_B > 0:
        # PDL: the weights (B) are no earlier kernel's output, so the first PREFETCH_B programs
        # (the host's L2 budget: those resident while the previous kernel runs) ask their B
        # into L2 before they wait for it (pointer path, B a W.T view; kernels/pdl.py)
        pdl_trigger(PDL)
        if tl.program_id(0) < PREFETCH_B:
            _prefetch_b(b, tn * BLOCK_N, N, k_lo, k_hi, stride_bn, BLOCK_N, GLU)
    pdl_enter(PDL)  # PDL: wait for the previous kernel here (kernels/pdl.py)
    if ROW_SCALE:   # the rows' factors (``bias``) now: their load latency hides under the K loop
        scale = tl.load(bias + offs_m, mask=mask_m, other=0.0)
    else:
        scale = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)  # GLU: the up half (unused otherwise)
    if USE_TMA:
        # descriptors (Hopper): A (M, K) or its (K, M) storage (A_TRANS), B (K, N) or its (N, K)
        # storage (B_TRANS, a weight W of F.linear); a split starts on a BLOCK_K boundary, so a
        # block never crosses into the next split, and past K the descriptor reads zeros.
        # A_PTR (options.gemm_splitk_operands): A (K-contiguous) through masked pointer loads, so
        # a tile whose rows run past M reads no box out of A's bounds -- 1: every tile (``a`` is
        # the pointer), 2: the last tile row where it is partial (``a_ptr``; the others through
        # ``a``, the descriptor)
        if A_PTR == 1:
            acc, acc_u = _k_loop_a_pointer(a, b, acc, acc_u, tn, offs_m, mask_m, k_lo, k_hi, stride_am, N, BLOCK_N,
                                           BLOCK_K, B_TRANS, GLU, INPUT_PRECISION, A_K_VEC)
        elif A_PTR == 2:
            if (tm + 1) * BLOCK_M > M:
                acc, acc_u = _k_loop_a_pointer(a_ptr, b, acc, acc_u, tn, offs_m, mask_m, k_lo, k_hi, stride_am, N,
                                               BLOCK_N, BLOCK_K, B_TRANS, GLU, INPUT_PRECISION, A_K_VEC)
            else:
                acc, acc_u = _k_loop_tma(a, b, acc, acc_u, tm, tn, k_lo, k_hi, N, BLOCK_M, BLOCK_N, BLOCK_K, A_TRANS,
                                         B_TRANS, GLU, INPUT_PRECISION)
        else:
            acc, acc_u = _k_loop_tma(a, b, acc, acc_u, tm, tn, k_lo, k_hi, N, BLOCK_M, BLOCK_N, BLOCK_K, A_TRANS,
                                     B_TRANS, GLU, INPUT_PRECISION)
    else:
        # K_VEC (host): K and the K-contiguous operands' leading strides are multiples of it
        stride_am = _multiple(stride_am, A_K_VEC)
        stride_bn = _multiple(stride_bn, B_K_VEC)
        k_hi = _multiple(k_hi, max(A_K_VEC, B_K_VEC))
        stride_ak = _multiple(stride_ak, A_M_VEC)   # an M-contiguous A / N-contiguous B: their leading strides
        stride_bk = _multiple(stride_bk, B_N_VEC)
        a_rows = a + offs_m[:, None].to(tl.int64) * stride_am
        b_cols = b + offs_n[None, :].to(tl.int64) * stride_bn
        for k0 in range(k_lo, k_hi, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            mask_k = offs_k < k_hi
            a_t = tl.load(a_rows + offs_k[None, :] * stride_ak, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
            b_t = tl.load(b_cols + offs_k[:, None] * stride_bk, mask=mask_k[:, None] & mask_n[None, :], other=0.0)
            acc = tl.dot(a_t, b_t, acc, input_precision=INPUT_PRECISION)
            if GLU:
                b_u = tl.load(b + (offs_n[None, :].to(tl.int64) + N) * stride_bn + offs_k[:, None] * stride_bk,
                              mask=mask_k[:, None] & mask_n[None, :], other=0.0)
                acc_u = tl.dot(a_t, b_u, acc_u, input_precision=INPUT_PRECISION)
    pdl_late(PDL)  # the K loop is done (PDL "late": the next kernel may launch)

    if TAIL:
        if whole:
            _store_tile(acc, acc_u, c, bias, res, offs_m, offs_n, M, N, stride_cm, stride_cn, stride_rm, stride_rn,
                        HAS_BIAS, HAS_RES, GLU, ROW_SCALE, scale)
        else:
            _merge_parts(acc, acc_u, c, bias, res, ws, counters, tm, tn, split, NM, NN, offs_m, offs_n, M, N,
                         stride_cm, stride_cn, stride_rm, stride_rn, SPLIT_K, BLOCK_M, BLOCK_N, HAS_BIAS, HAS_RES, GLU,
                         ROW_SCALE, scale)
    elif SPLIT_K == 1:
        _store_tile(acc, acc_u, c, bias, res, offs_m, offs_n, M, N, stride_cm, stride_cn, stride_rm, stride_rn,
                    HAS_BIAS, HAS_RES, GLU, ROW_SCALE, scale)
    else:
        _merge_parts(acc, acc_u, c, bias, res, ws, counters, tm, tn, split, NM, NN, offs_m, offs_n, M, N,
                     stride_cm, stride_cn, stride_rm, stride_rn, SPLIT_K, BLOCK_M, BLOCK_N, HAS_BIAS, HAS_RES, GLU,
                     ROW_SCALE, scale)


late_point(gemm_splitk_kernel)


# ------------------------------------------------------------------------------------ configs
def config(block_m: int, block_n: int, block_k: int, num_warps: int, num_stages: int) -> dict:
    return dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=num_warps, num_stages=num_stages)


# Candidate tiles of the schedule chooser (numasched/gemm_schedule.py) and of opt-in autotuning.
# Skinny problems stream B: long BLOCK_K runs along B's contiguous K, deep pipelines, and narrow
# BLOCK_N so there are tiles to spread. BLOCK_M covers M (16 is the smallest dot).
BLOCK_MS = (16, 32, 64, 128)
BLOCK_NS = (32, 64, 128)
BLOCK_KS = (64, 128, 256)
INTERPRETER_CONFIG = config(16, 16, 16, 4, 1)


def prefetch_programs(b, K: int, k_per_split: int, block_n: int, grid: int, l2_bytes: int, tail: bool = False,
                      halves: int = 1) -> int:
    """PREFETCH_B of a launch (``options.pdl_prefetch``): 0 where B is not a weight's ``W.T`` view
    whose per-column K runs are 16-byte aligned multiples of 16 bytes (the bulk prefetch's rule),
    else how many programs prefetch: as many as half the L2 holds (the programs resident while
    the previous kernel runs take the lowest ids; a weight larger than that is streamed as
    usual past its first part). ``halves``: 2 for the SwiGLU kernel (gate and up columns);
    ``tail``: whole tiles read all of K."""
    elt = b.element_size()
    if b.dim() != 2 or b.stride(0) != 1 or l2_bytes <= 0 or grid <= 0:
        return 0
    if b.data_ptr() % 16 or (b.stride(1) * elt) % 16 or (K * elt) % 16 or (k_per_split * elt) % 16:
        return 0
    per_program = block_n * (K if tail else min(K, k_per_split)) * elt * halves
    return int(max(1, min(grid, (l2_bytes // 2) // per_program)))


def vector_width(elt: int, *sizes: int) -> int:
    """The largest power of two of at most 16 bytes of elements dividing every one of ``sizes``,
    or 1 where they are all multiples of 16 elements already (Triton's own specialisation)."""
    g = math.gcd(*sizes)
    if g % 16 == 0:
        return 1
    v = 16 // elt
    while v > 1 and g % v:
        v //= 2
    return v


def k_vector(M: int, N: int, K: int, k_per_split: int, a_stride: tuple, b_stride: tuple, elt: int) -> dict:
    """The vector constexprs of a pointer-path launch, for A (M, K) and B (K, N): a K-contiguous
    operand's width divides K, the K per split and its leading stride (A_K_VEC, B_K_VEC); an
    M-contiguous A's divides M and its leading stride (A_M_VEC), an N-contiguous B's N and its
    leading stride (B_N_VEC). 1 where Triton knows it itself (multiples of 16 elements) and for
    an operand with neither dimension contiguous."""
    a_k, b_k = a_stride[1] == 1, b_stride[0] == 1
    a_m, b_n = a_stride[0] == 1 and not a_k, b_stride[1] == 1 and not b_k
    leads = ([a_stride[0]] if a_k else []) + ([b_stride[1]] if b_k else [])
    vk = vector_width(elt, K, k_per_split, *leads) if leads else 1
    return dict(A_K_VEC=vk if a_k else 1, B_K_VEC=vk if b_k else 1,
                A_M_VEC=vector_width(elt, M, a_stride[1]) if a_m else 1,
                B_N_VEC=vector_width(elt, N, b_stride[0]) if b_n else 1)


def a_pointer_constants(mode: str, a, K: int, k_per_split: int) -> dict:
    """The A_PTR constexprs of a TMA-fed launch whose A (K-contiguous) goes through pointers:
    ``mode`` "b_tma" (every tile) or "b_tma_last" (the partial last tile row), with A's vector
    width along K (see k_vector)."""
    return dict(A_PTR=1 if mode == "b_tma" else 2, A_K_VEC=vector_width(a.element_size(), K, k_per_split, a.stride(0)))


def shared_bytes(block_m: int, block_n: int, block_k: int, num_stages: int, elt: int) -> int:
    """Shared memory of the operand pipeline: A and B tiles for every stage (an upper bound:
    compiled for sm_90, the mma.sync tiles took num_stages - 1 buffers and the wgmma ones
    num_stages)."""
    return (block_m + block_n) * block_k * elt * max(1, num_stages)
