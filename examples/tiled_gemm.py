"""A tiled GEMM of your own that takes a numasched mapping policy by name.

The kernel asks ``gemm_tile`` which output tile its program computes; the policy arrives as one
constexpr (``MAPPING``). It also writes, for every tile, the id of the program that computed it,
so the run can be checked against the policy's NumPy reference map.

    python examples/tiled_gemm.py                  # a GPU, or TRITON_INTERPRET=1 on a CPU
"""
import sys

import torch
import triton
import triton.language as tl

from numasched import mappings, topology
from numasched.mappings.jit import gemm_tile


@triton.jit
def tiled_matmul_kernel(A, B, C, OWNER, M, N, K, stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn,
                        MAPPING: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr):
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    # the one line a policy needs: which tile is mine
    tm, tn = gemm_tile(pid, tiles_m, tiles_n, MAPPING)
    offs_m = tm * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tn * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(A + offs_m[:, None] * stride_am + offs_k[None, :] * stride_ak,
                    mask=(offs_m[:, None] < M) & (offs_k[None, :] < K), other=0.0)
        b = tl.load(B + offs_k[:, None] * stride_bk + offs_n[None, :] * stride_bn,
                    mask=(offs_k[:, None] < K) & (offs_n[None, :] < N), other=0.0)
        acc = tl.dot(a, b, acc, input_precision="ieee")
    tl.store(C + offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn, acc.to(C.dtype.element_ty),
             mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))
    tl.store(OWNER + tm * tiles_n + tn, pid)


def tiled_matmul(a, b, mapping="auto", block=(16, 16, 16)):
    """``a @ b`` with the tile order of ``mapping`` (a GEMM policy name, "auto" or a Policy).
    Returns the product and the (tiles_m, tiles_n) map of the program that computed each tile."""
    M, K = a.shape
    N = b.shape[1]
    bm, bn, bk = block
    tiles_m, tiles_n = triton.cdiv(M, bm), triton.cdiv(N, bn)
    grid = mappings.GemmGrid(tiles_m, tiles_n)
    c = torch.empty(M, N, dtype=a.dtype, device=a.device)
    owner = torch.full((tiles_m, tiles_n), -1, dtype=torch.int32, device=a.device)
    tiled_matmul_kernel[(grid.size,)](
        a, b, c, owner, M, N, K, a.stride(0), a.stride(1), b.stride(0), b.stride(1), c.stride(0), c.stride(1),
        MAPPING=mappings.kernel_arg(mapping, "gemm", grid=grid), BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk)
    return c, owner


def expected_owner(mapping, tiles_m: int, tiles_n: int, num_domains: int):
    """The owner map the policy's NumPy reference predicts."""
    grid = mappings.GemmGrid(tiles_m, tiles_n)
    policy = mappings.resolve(mapping, "gemm", topology.current(), grid)
    items = policy.reference(range(grid.size), grid, num_domains)
    want = torch.full((tiles_m, tiles_n), -1, dtype=torch.int32)
    want[items[:, 0], items[:, 1]] = torch.arange(grid.size, dtype=torch.int32)
    return want


def main() -> int:
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    a = torch.randn(70, 45, device=dev)
    b = torch.randn(45, 90, device=dev)
    ok = True
    with topology.use("mi300x"):  # eight domains: the remaps are not the identity
        for name in ("row_major", "grouped", "chiplet_tiled", "chiplet_tiled_chunked"):
            c, owner = tiled_matmul(a, b, name)
            err = ((c.double() - a.double() @ b.double()).abs().max()).item()
            same = torch.equal(owner.cpu(), expected_owner(name, *owner.shape, topology.current().num_domains))
            ok &= err < 1e-4 and same
            print(f"{name:24s} max error {err:.1e}, owner map matches the reference: {same}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
