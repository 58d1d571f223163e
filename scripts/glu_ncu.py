"""The prefill's SwiGLU GEMM kernels under Nsight Compute: the split-K kernel's big tiles (the
default) and the persistent kernel (kernels/gemm_glu.py), Llama-3-8B's gate/up at TP 2 (4096 x
2 x 7168 x 4096, bf16), three calls each, no CUDA graph (ncu profiles kernel launches).
Run: ncu --clock-control none -k regex:glu_persistent_kernel|gemm_splitk_kernel --launch-skip 2
--launch-count 1 --section SpeedOfLight --section WarpStateStats python3 scripts/glu_ncu.py [KIND]
where KIND is "splitk" or "persistent" (default: both, split-K first). ``--time``: CUDA-graph
replay times of the two, twice, no profiler."""
import sys

import torch

import numasched
from numasched import gemm_glu


def _plan(kind, x, w, out):
    sched = gemm_glu.GLU_BIG_SCHEDULE if kind == "splitk" else gemm_glu.GLU_PERSISTENT_SCHEDULE
    return numasched.plan_matmul_swiglu(x, w.t(), out, schedule=sched)


def main():
    if sys.argv[1:2] == ["--time"]:   # CUDA-graph replay times of the two kernels, no profiler
        from numasched.bench.common import graph_replay_ms

        M, n, K = 4096, 7168, 4096
        x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(2 * n, K, device="cuda", dtype=torch.bfloat16) / K ** 0.5
        out = torch.empty(M, n, device="cuda", dtype=torch.bfloat16)
        ref = torch.nn.functional.silu(x.float() @ w[:n].float().t()) * (x.float() @ w[n:].float().t())
        for kind in ("splitk", "persistent", "splitk", "persistent"):
            plan = _plan(kind, x, w, out)
            us = graph_replay_ms(lambda: plan.run(x, w.t(), out)) * 1e3
            out.fill_(float("nan"))
            plan.run(x, w.t(), out)
            err = ((out.float() - ref).norm() / ref.norm()).item()
            print(f"{kind} ({plan.path}, C_TMA {getattr(plan, '_c_tma', None)}): {us:.1f} us, err {err:.1e}", flush=True)
        return
    kinds = sys.argv[1:] or ["splitk", "persistent"]
    M, n, K = 4096, 7168, 4096
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(2 * n, K, device="cuda", dtype=torch.bfloat16) / K ** 0.5
    out = torch.empty(M, n, device="cuda", dtype=torch.bfloat16)
    for kind in kinds:
        plan = _plan(kind, x, w, out)
        for _ in range(3):
            plan.run(x, w.t(), out)
        torch.cuda.synchronize()
        print(kind, plan.path, plan.grid, flush=True)


if __name__ == "__main__":
    main()
