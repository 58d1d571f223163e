"""SwiGLU GEMM at prefill sizes: ``silu(A @ B_gate) * (A @ B_up)``, a persistent kernel whose tile
loop and K loop are one loop (Triton fuses them), so the operand pipeline runs across tiles: the
next tile's first TMA loads are in flight while a tile's epilogue (the activation and the store)
runs. numasched.matmul_swiglu takes it from GLU_BIG_MIN_ROWS rows on Hopper (host:
numasched/gemm_glu.py); decode sizes keep the split-K kernel's GLU form (kernels/gemm_splitk.py),
whose many short units want no persistent loop.

Read top to bottom:

1. the grid is about one program per SM; program p takes tiles p, p + P, ... of the (M, N)
   output, each through the mapping policy (``MAPPING``: a tile order, e.g. grouped rows for L2
   reuse of B);
2. per K step one A tile and two B tiles (the gate's columns and the up's, N columns apart in B:
   a weight ``w.T`` whose first N rows are the gate's, read through its (2N, K) storage with
   ``B_TRANS``), two wgmma into two fp32 accumulators;
3. the epilogue: ``ROW_SCALE`` multiplies both by a factor per row of A (an RMSNorm whose weight
   was folded into B: its 1 / rms), then ``silu(g) * u`` in fp32, one rounding, and a TMA store of
   the (BLOCK_M, BLOCK_N) result (asynchronous: it drains under the next tile's K loop; ``C_TMA``
   off: masked stores, for an output TMA cannot address).

A gate tile's last columns past N read the first up columns: the store clips or masks them.
"""
import triton
import triton.language as tl

from numasched.mappings.jit import gemm_tile
from numasched.kernels.pdl import late_point, pdl_enter, pdl_late


@triton.jit
def glu_persistent_kernel(a_desc, b_desc, c_desc, c, scale, M, N, K, stride_cm, stride_cn,
                          MAPPING: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                          BLOCK_K: tl.constexpr, B_TRANS: tl.constexpr, ROW_SCALE: tl.constexpr,
                          C_TMA: tl.constexpr, FLATTEN: tl.constexpr = True, PDL: tl.constexpr = False):
    # a_desc: A (M, K), block [BLOCK_M, BLOCK_K]; b_desc: B (K, 2N), block [BLOCK_K, BLOCK_N], or
    # with B_TRANS its (2N, K) storage, block [BLOCK_N, BLOCK_K]; C_TMA: c_desc, C (M, N), block
    # [BLOCK_M, BLOCK_N]; else c, C's pointer with its strides (masked stores: an output TMA
    # cannot address); scale: (M,) fp32 (ROW_SCALE; else any pointer, unread)
    pdl_enter(PDL)  # PDL: wait for the previous kernel here (kernels/pdl.py)
    NM = tl.cdiv(M, BLOCK_M)
    NN = tl.cdiv(N, BLOCK_N)
    k_tiles = tl.cdiv(K, BLOCK_K)
    for tile in tl.range(tl.program_id(0), NM * NN, tl.num_programs(0), flatten=FLATTEN):
        tm, tn = gemm_tile(tile, NM, NN, MAPPING)
        off_m = tm * BLOCK_M
        off_n = tn * BLOCK_N
        acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for ki in range(0, k_tiles):
            off_k = ki * BLOCK_K
            a = a_desc.load([off_m, off_k])
            if B_TRANS:
                g = b_desc.load([off_n, off_k]).T
                u = b_desc.load([N + off_n, off_k]).T
            else:
                g = b_desc.load([off_k, off_n])
                u = b_desc.load([off_k, N + off_n])
            acc_g = tl.dot(a, g, acc_g)
            acc_u = tl.dot(a, u, acc_u)
        if ROW_SCALE:   # (s a) @ b = s (a @ b): the factor on both accumulators
            rows = off_m + tl.arange(0, BLOCK_M)
            s = tl.load(scale + rows, mask=rows < M, other=0.0)
            acc_g = acc_g * s[:, None]
            acc_u = acc_u * s[:, None]
        y = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u
        if C_TMA:
            c_desc.store([off_m, off_n], y.to(c_desc.dtype))
        else:
            rows = off_m + tl.arange(0, BLOCK_M)
            cols = off_n + tl.arange(0, BLOCK_N)
            tl.store(c + rows[:, None].to(tl.int64) * stride_cm + cols[None, :] * stride_cn, y.to(c.dtype.element_ty),
                     mask=(rows[:, None] < M) & (cols[None, :] < N))
    pdl_late(PDL)  # after the last tile (its epilogue is short against the loop)


late_point(glu_persistent_kernel)
