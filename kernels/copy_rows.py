"""Rows of a matrix copied into a buffer of another row stride: ``dst[m, :K] = src[m, :K]``.

numasched.matmul uses it to give A rows of whole 128-byte lines before the GEMM where A's own
rows are not (``options.gemm_align_a``): every tile column of the GEMM re-reads A, and a load of
a row that straddles two lines costs two. Program (row, chunk) copies BLOCK_K elements of one
row; both strides are the host's word on their vector width (VEC, see gemm_splitk._multiple), so
the copy moves 16-byte vectors where the rows allow it. With PDL (kernels/pdl.py) the GEMM after
it launches while it runs.

With PAD it also writes zeros into ``dst[m, K:stride_d]`` (the destination's whole row): the
K-padding path (``options.gemm_pad_k``) copies A and the weight W into rows of whole lines and
runs the GEMM over K rounded up, where the padded columns must be zeros in both, whatever a
reused buffer held before. The grid then covers ``stride_d`` columns; the stores stay within the
row, whose length is a multiple of 16 elements (Triton then knows it and vectorises them).
"""
import triton
import triton.language as tl

from numasched.kernels.gemm_splitk import _multiple
from numasched.kernels.pdl import pdl_enter


@triton.jit
def copy_rows_kernel(src, dst, K, stride_s, stride_d, BLOCK_K: tl.constexpr, VEC: tl.constexpr = 1,
                     PDL: tl.constexpr = 0, PAD: tl.constexpr = 0):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    pdl_enter(PDL)   # A may be the previous kernel's output
    k = _multiple(K, VEC)
    if PAD:   # the row's tail K..stride_d as zeros (the masked load's other)
        x = tl.load(src + row * _multiple(stride_s, VEC) + offs, mask=offs < k, other=0)
        tl.store(dst + row * stride_d + offs, x, mask=offs < stride_d)
    else:
        mask = offs < k
        x = tl.load(src + row * _multiple(stride_s, VEC) + offs, mask=mask)
        tl.store(dst + row * _multiple(stride_d, VEC) + offs, x, mask=mask)


def block_k(K: int) -> int:
    """Elements a program copies: a power of two, at most 2048."""
    return min(2048, triton.next_power_of_2(max(K, 16)))
