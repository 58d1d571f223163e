"""SwiGLU activation: ``out = silu(gu[:, :n]) * gu[:, n:]`` (a transformer MLP's step between its
gate/up and down projections).

At decode sizes the data is a few hundred KB and the kernel's time is its boundaries: it sits
between two GEMMs that launch with programmatic dependent launch (kernels/pdl.py). Launched
with PDL itself, it starts during the gate/up GEMM's epilogue and lets the down projection
launch as soon as its own programs have started, where a kernel without PDL (e.g. a compiled
torch one) makes both neighbours wait for a full drain and launch.

Program (row, block) handles BLOCK_N columns of one row. silu is computed in fp32 and rounded to
the dtype, then multiplied by up and rounded again, as ``F.silu(g) * u`` does; the division is
the approximate one (2 ulp of fp32, below any dtype's rounding here).
"""
import triton
import triton.language as tl

from numasched.kernels.pdl import pdl_enter


@triton.jit
def swiglu_kernel(gu, out, n, stride_gm, stride_om, BLOCK_N: tl.constexpr, PDL: tl.constexpr = False):
    pdl_enter(PDL)  # PDL: wait for the previous kernel here (kernels/pdl.py)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    m = cols < n
    g = tl.load(gu + row * stride_gm + cols, mask=m, other=0.0)
    u = tl.load(gu + row * stride_gm + n + cols, mask=m, other=0.0)
    gf = g.to(tl.float32)
    act = tl.fdiv(gf, 1.0 + tl.exp(-gf), ieee_rounding=False).to(g.dtype)
    tl.store(out + row * stride_om + cols, (act.to(tl.float32) * u.to(tl.float32)).to(out.dtype.element_ty), mask=m)


# columns per program: a decode row of an 8B-70B MLP (n = 7168-28672 per GPU) in 4-14 programs
BLOCK_N = 2048
