"""Is the SwiGLU activation free in the down projection's A loads? (one GPU, CUDA-graph replays)

The TP prefill's MLP is gate/up GEMM -> silu(g) * u -> down GEMM (+ all-reduce). Today either
numasched's SwiGLU GEMM does the first two (a Triton GEMM, slower than cuBLAS at 4096 rows), or
cuBLAS does the GEMM and an elementwise kernel the activation (Llama-3-8B TP 2: 117 MB read and
58 MB written per layer). A third way: cuBLAS for gate/up, and the activation computed from the
(M, 2n) projection as the down GEMM loads its A tiles (TMA -> registers -> silu * u -> wgmma with
A from registers). This times one TMA GEMM kernel in both forms at the down projection's shapes:

    cublas            F.linear(act, w_down)                          (the GEMM alone, act given)
    act+cublas        silu_mul(gu) then F.linear                     (what the unfused prefill runs)
    tma               this file's kernel, A = act                    (its plain speed)
    tma[glu]          this file's kernel, A tiles = silu(g) * u from gu (the fused prologue)

Errors against the fp32 product. Run: python3 scripts/glu_prologue_probe.py [--rows 4096]
"""
import argparse

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor


@triton.jit
def _glu_a(g, u):
    """silu(g) * u in fp32, rounded to the operands' dtype (as the elementwise kernel stores it)."""
    gf = g.to(tl.float32)
    return (gf / (1.0 + tl.exp(-gf)) * u.to(tl.float32)).to(g.dtype)


@triton.jit
def gemm_prologue_kernel(a_desc, b_desc, c_desc, M, N, K, n_glu, GROUP_M: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GLU: tl.constexpr):
    """C (M, N) = A (M, K) @ B, B the (N, K) storage of an F.linear weight. GLU: A's (M, 2 n_glu)
    storage holds [gate | up]; the kernel's A tile at K offset k is silu(gate[:, k]) * up[:, k]."""
    pid = tl.program_id(0)
    tm_n = tl.cdiv(M, BLOCK_M)
    tn_n = tl.cdiv(N, BLOCK_N)
    # grouped order: GROUP_M row tiles share the column tiles' B reads in L2
    per = GROUP_M * tn_n
    gid = pid // per
    first = gid * GROUP_M
    gsz = tl.minimum(tm_n - first, GROUP_M)
    tm = first + (pid % per) % gsz
    tn = (pid % per) // gsz
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        if GLU:
            g = a_desc.load([tm * BLOCK_M, k * BLOCK_K])
            u = a_desc.load([tm * BLOCK_M, n_glu + k * BLOCK_K])
            a = _glu_a(g, u)
        else:
            a = a_desc.load([tm * BLOCK_M, k * BLOCK_K])
        b = b_desc.load([tn * BLOCK_N, k * BLOCK_K]).T
        acc = tl.dot(a, b, acc)
    c_desc.store([tm * BLOCK_M, tn * BLOCK_N], acc.to(c_desc.dtype))


def run_gemm(a, w, out, glu_n=0, bm=128, bn=256, bk=64, warps=8, stages=3, group_m=8):
    M = a.shape[0]
    N, K = w.shape
    a_desc = TensorDescriptor.from_tensor(a, [bm, bk])
    b_desc = TensorDescriptor.from_tensor(w, [bn, bk])
    c_desc = TensorDescriptor.from_tensor(out, [bm, bn])
    grid = (triton.cdiv(M, bm) * triton.cdiv(N, bn),)
    gemm_prologue_kernel[grid](a_desc, b_desc, c_desc, M, N, K, glu_n, GROUP_M=group_m, BLOCK_M=bm, BLOCK_N=bn,
                               BLOCK_K=bk, GLU=bool(glu_n), num_warps=warps, num_stages=stages)
    return out


def main():
    from numasched.bench.common import graph_replay_ms
    from numasched.models.llama import CompiledElementwise, silu_mul

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", default="1024,4096,8192")
    p.add_argument("--shapes", default="4096x7168,4096x14336,5120x12800",
                   help="NxK of the down projection (K = n, the gate's columns)")
    p.add_argument("--configs", default="128x256x64w8s3,128x256x64w8s4,128x128x64w8s4,128x256x32w8s4")
    args = p.parse_args()
    act_k = CompiledElementwise(silu_mul)
    print(f"# {torch.cuda.get_device_name()} torch {torch.__version__} triton {triton.__version__}", flush=True)
    for shape in args.shapes.split(","):
        N, K = (int(v) for v in shape.split("x"))
        w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16) / K ** 0.5
        for M in [int(v) for v in args.rows.split(",")]:
            gu = torch.randn(M, 2 * K, device="cuda", dtype=torch.bfloat16)
            act = act_k(gu, K)
            ref = act.float() @ w.float().t()
            out = torch.full((M, N), float("nan"), device="cuda", dtype=torch.bfloat16)
            flop = 2 * M * N * K
            row = {"cublas": lambda: F.linear(act, w), "act+cublas": lambda: F.linear(act_k(gu, K), w)}
            for cfg in args.configs.split(","):
                bm, bn, rest = cfg.split("x")
                bk, rest = rest.split("w")
                warps, stages = rest.split("s")
                kw = dict(bm=int(bm), bn=int(bn), bk=int(bk), warps=int(warps), stages=int(stages))
                row[f"tma {cfg}"] = lambda kw=kw: run_gemm(act, w, out, **kw)
                row[f"tma[glu] {cfg}"] = lambda kw=kw: run_gemm(gu, w, out, glu_n=K, **kw)
            cells = []
            for name, fn in row.items():
                try:
                    out.fill_(float("nan"))
                    y = fn().float()
                    err = ((y - ref).norm() / ref.norm()).item()
                    us = graph_replay_ms(fn) * 1e3
                except Exception as e:   # a config this GPU cannot take: say so, go on
                    cells.append(f"{name} FAILED {type(e).__name__}: {str(e)[:80]}")
                    continue
                cells.append(f"{name} {us:.1f} us ({flop / us / 1e6:.0f} TF/s, err {err:.1e})")
            print(f"{M}x{N}x{K} | " + " | ".join(cells), flush=True)


if __name__ == "__main__":
    main()
