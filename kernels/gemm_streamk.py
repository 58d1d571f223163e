"""Stream-K GEMM: ``C = A @ B (+ bias) (+ residual)`` without a mostly empty last wave.

A data-parallel GEMM runs its T output tiles in waves of P programs (one per SM). When T is not a
multiple of P the last wave leaves SMs idle: 160 tiles of 128 x 256 on 132 SMs take two full tile
times, 1.21 tiles' worth of work. Stream-K hands the remainder out by K iterations instead:

1. **Data-parallel phase.** The first ``dp_tiles`` tiles (a multiple of P) run whole, program
   ``pid`` taking tiles pid, pid + P, ... in the mapping policy's order
   (``numasched.mappings.jit.gemm_tile``), stored with the epilogue as the tiled kernel does.
2. **Stream-K phase.** The remaining tiles' K iterations (``iters_per_tile`` each, BLOCK_K wide)
   form one range cut into P equal contiguous pieces of ``iters_per_program``, piece p to
   program p (NumPy twin: ``numasched.mappings.streamk_units_reference``). A piece may start
   or end inside a tile: it covers the tail of one tile and the head of the next at most (fewer
   tiles remain than programs); with ``K_ALIGNED`` the head runs first, so that all programs
   read nearby K columns at once. A tile covered by one piece is stored at once. Otherwise each
   piece's fp32 partial goes to the workspace (two slots per program: the tail's partial and the
   head's) and takes a ticket (an atomic counter per tile); the program that takes the
   last ticket sums the tile's partials **in program order** (deterministic: the same sum
   whichever finishes last), applies the epilogue, stores, and resets the counter for the next
   launch and for CUDA-graph replays. Nothing waits on another program, so nothing can hang.

Operands come through TMA descriptors (Hopper: A (M, K) or its (K, M) storage, B (K, N) or the
(N, K) storage of an F.linear weight) or plain masked pointers (any strides, the interpreter).
The merge reads the partials in column slices of ``FIX_N`` so a 128 x 256 tile's merge needs no
second full accumulator in registers. Host planning (``dp_tiles``, the pieces, workspace and
counters, the choice of this kernel) is numasched/gemm.py's and numasched/gemm_schedule.py's.
"""
import triton
import triton.language as tl

from numasched.kernels.gemm_splitk import _epilogue_store, load_ab_tma
from numasched.mappings.gemm import streamk_pieces as pieces, streamk_split as split_work  # noqa: F401 (host helpers)
from numasched.mappings.jit import gemm_tile
from numasched.kernels.pdl import late_point, pdl_enter, pdl_late


@triton.jit
def _acc_iters(a, b, tm, tn, k_lo, k_hi, M, N, K, stride_am, stride_ak, stride_bk, stride_bn,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_TMA: tl.constexpr,
               A_TRANS: tl.constexpr, B_TRANS: tl.constexpr, INPUT_PRECISION: tl.constexpr):
    """fp32 sum over the K iterations [k_lo, k_hi) (BLOCK_K each) of tile (tm, tn)."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if USE_TMA:
        # past K (and past M, N) the descriptors read zeros
        for ki in range(k_lo, k_hi):
            a_t, b_t = load_ab_tma(a, b, tm, tn, ki * BLOCK_K, BLOCK_M, BLOCK_N, A_TRANS, B_TRANS)
            acc = tl.dot(a_t, b_t, acc, input_precision=INPUT_PRECISION)
    else:
        offs_m = tm * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = tn * BLOCK_N + tl.arange(0, BLOCK_N)
        a_rows = a + offs_m[:, None].to(tl.int64) * stride_am
        b_cols = b + offs_n[None, :].to(tl.int64) * stride_bn
        for ki in range(k_lo, k_hi):
            offs_k = ki * BLOCK_K + tl.arange(0, BLOCK_K)
            mask_k = offs_k < K
            a_t = tl.load(a_rows + offs_k[None, :] * stride_ak, mask=(offs_m[:, None] < M) & mask_k[None, :],
                          other=0.0)
            b_t = tl.load(b_cols + offs_k[:, None] * stride_bk, mask=mask_k[:, None] & (offs_n[None, :] < N),
                          other=0.0)
            acc = tl.dot(a_t, b_t, acc, input_precision=INPUT_PRECISION)
    return acc


@triton.jit
def gemm_streamk_kernel(a, b, c, bias, res, ws, counters, M, N, K,
                        stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn, stride_rm, stride_rn,
                        dp_tiles, iters_per_tile, iters_per_program,
                        MAPPING: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr, FIX_N: tl.constexpr, HAS_BIAS: tl.constexpr,
                        HAS_RES: tl.constexpr, INPUT_PRECISION: tl.constexpr, USE_TMA: tl.constexpr,
                        A_TRANS: tl.constexpr, B_TRANS: tl.constexpr, K_ALIGNED: tl.constexpr = False,
                        PDL: tl.constexpr = False):
    pdl_enter(PDL)  # PDL: wait for the previous kernel here (kernels/pdl.py)
    pid = tl.program_id(0)
    P = tl.num_programs(0)
    NM = tl.cdiv(M, BLOCK_M)
    NN = tl.cdiv(N, BLOCK_N)
    num_tiles = NM * NN
    I = iters_per_tile
    offs_bm = tl.arange(0, BLOCK_M)
    offs_bn = tl.arange(0, BLOCK_N)

    # ---- 1. whole tiles, P at a time
    for tile in range(pid, dp_tiles, P):
        tm, tn = gemm_tile(tile, NM, NN, MAPPING)
        acc = _acc_iters(a, b, tm, tn, 0, I, M, N, K, stride_am, stride_ak, stride_bk, stride_bn,
                         BLOCK_M, BLOCK_N, BLOCK_K, USE_TMA, A_TRANS, B_TRANS, INPUT_PRECISION)
        _epilogue_store(acc, c, bias, res, tm * BLOCK_M + offs_bm, tn * BLOCK_N + offs_bn, M, N,
                        stride_cm, stride_cn, stride_rm, stride_rn, HAS_BIAS, HAS_RES)

    # ---- 2. the remaining tiles' K iterations, one contiguous piece per program, by program id.
    #    (Handing them out in the order of the policy's domain remap would put a tile's pieces on
    #    one XCD; the simulator found that it raises the partials' L2 hits on an MI300X but lowers
    #    the operands' more: numasched/sim/streamk.py, docs/mappings.md.) ``v`` names the piece.
    #    Fewer tiles remain than programs, so a piece (W <= I iterations) lies in one tile or in
    #    two: the tail [k_lo, I) of the tile it starts in and the head [0, k_end) of the next.
    #    K_ALIGNED runs the head first: every program is then within K iterations
    #    [tau, tau + I - W] at time tau (a piece that crosses a tile at tau or tau + I - W), so
    #    the programs read one band of A and B columns at once, as a data-parallel wave does.
    #    Tail first (the default, the order measured so far), the programs' K positions spread
    #    over the whole of K. (The simulator's H200 reads 0.39-1.00x the HBM bytes K-aligned:
    #    scripts/sim_streamk_orders.py. Not yet timed on a GPU.)
    v = pid
    W = iters_per_program
    total = (num_tiles - dp_tiles) * I
    it = v * W
    end = tl.minimum(it + W, total)
    first_tile = it // I  # the tile this program's piece starts in: its partial goes to slot 0
    tail_lo = it - first_tile * I
    tail_hi = tl.minimum(I, tail_lo + (end - it))
    head_hi = end - (first_tile + 1) * I  # > 0: the piece runs into the next tile
    tile_elems = BLOCK_M * BLOCK_N
    for seg in range(2):
        if K_ALIGNED:
            head = seg == 0
        else:
            head = seg == 1
        t = tl.where(head, first_tile + 1, first_tile)
        k_lo = tl.where(head, 0, tail_lo)
        k_hi = tl.where(head, head_hi, tail_hi)
        if (it < end) & (k_hi > k_lo):
            tm, tn = gemm_tile(dp_tiles + t, NM, NN, MAPPING)
            acc = _acc_iters(a, b, tm, tn, k_lo, k_hi, M, N, K, stride_am, stride_ak, stride_bk, stride_bn,
                             BLOCK_M, BLOCK_N, BLOCK_K, USE_TMA, A_TRANS, B_TRANS, INPUT_PRECISION)
            offs_m = tm * BLOCK_M + offs_bm
            if (k_lo == 0) & (k_hi == I):
                _epilogue_store(acc, c, bias, res, offs_m, tn * BLOCK_N + offs_bn, M, N,
                                stride_cm, stride_cn, stride_rm, stride_rn, HAS_BIAS, HAS_RES)
            else:
                slot = tl.where(t == first_tile, 0, 1)
                base = (v * 2 + slot).to(tl.int64) * tile_elems
                tl.store(ws + base + offs_bm[:, None] * BLOCK_N + offs_bn[None, :], acc)
                # every thread's stores before the release of the ticket; the last arrival reads the
                # others' partials through L2 (.cg), never a stale L1 line
                tl.debug_barrier()
                p_first = (t * I) // W
                p_last = ((t + 1) * I - 1) // W
                ctr = counters + t
                ticket = tl.atomic_add(ctr, 1, sem="acq_rel")
                if ticket == p_last - p_first:
                    for h in tl.static_range(BLOCK_N // FIX_N):
                        cols = h * FIX_N + tl.arange(0, FIX_N)
                        tot = tl.zeros((BLOCK_M, FIX_N), dtype=tl.float32)
                        for p in range(p_first, p_last + 1):  # program order: the same sum every time
                            ps = tl.where((p * W) // I == t, 0, 1)
                            pb = (p * 2 + ps).to(tl.int64) * tile_elems
                            tot += tl.load(ws + pb + offs_bm[:, None] * BLOCK_N + cols[None, :], cache_modifier=".cg")
                        _epilogue_store(tot, c, bias, res, offs_m, tn * BLOCK_N + cols, M, N,
                                        stride_cm, stride_cn, stride_rm, stride_rn, HAS_BIAS, HAS_RES)
                    tl.atomic_xchg(ctr, 0)  # ready for the next launch
    pdl_late(PDL)  # every K iteration of this program is done (PDL "late": the next kernel may launch)


late_point(gemm_streamk_kernel)


# ------------------------------------------------------------------------------------ host helpers
def workspace_numel(programs: int, block_m: int, block_n: int) -> int:
    """fp32 workspace: two partial tiles per program."""
    return 2 * programs * block_m * block_n
