"""The MLP's activation between two decode-size GEMMs (one GPU, CUDA-graph replays).

For M in 1, 4, 16 and the Llama-3-8B TP 2 MLP (gate/up 4096 -> 2 x 7168, down 7168 -> 4096):
gate/up GEMM + activation + down GEMM with the activation by torch (F.silu(g) * u), by
torch.compile, by numasched.swiglu (its PDL-launched kernel), and by numasched.matmul_swiglu
(fused into the gate/up GEMM); the two GEMMs alone. Run: python3 scripts/glu_probe.py
(The eighteenth session's down projection with the activation in its operand loads ran 2.6-6x
slower than its plain GEMM: each N tile recomputed the whole activation; removed.)
"""
import torch
import torch.nn.functional as F

import numasched
from numasched.bench.common import graph_replay_ms

H, n, N = 4096, 7168, 4096
compiled = torch.compile(lambda gu: F.silu(gu[:, :n]) * gu[:, n:], fullgraph=True, dynamic=False)
for M in (1, 4, 16):
    x = torch.randn(M, H, device="cuda", dtype=torch.bfloat16)
    wgu = torch.randn(2 * n, H, device="cuda", dtype=torch.bfloat16) / H ** 0.5
    wd = torch.randn(N, n, device="cuda", dtype=torch.bfloat16) / n ** 0.5
    gu = numasched.matmul(x, wgu.t())
    act = F.silu(gu[:, :n]) * gu[:, n:]
    variants = {
        "gemms alone": lambda: numasched.matmul(act, wd.t(), out=None) if numasched.matmul(x, wgu.t()) is not None else None,
        "torch silu * u": lambda: numasched.matmul(F.silu((g := numasched.matmul(x, wgu.t()))[:, :n]) * g[:, n:], wd.t()),
        "compiled": lambda: numasched.matmul(compiled(numasched.matmul(x, wgu.t())), wd.t()),
        "numasched.swiglu": lambda: numasched.matmul(numasched.swiglu(numasched.matmul(x, wgu.t())), wd.t()),
        "matmul_swiglu": lambda: numasched.matmul(numasched.matmul_swiglu(x, wgu.t()), wd.t()),
    }
    ref = numasched.matmul(act, wd.t()).float()
    for name, fn in variants.items():
        us = graph_replay_ms(fn) * 1e3
        y = fn().float()
        err = ((y - ref).norm() / ref.norm()).item()
        print(f"M {M:3d} {name:18s} {us:8.2f} us  err {err:.1e}", flush=True)
