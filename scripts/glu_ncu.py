"""The prefill's SwiGLU GEMM kernels under Nsight Compute: the split-K kernel's big tiles (the
default) and the persistent kernel (kernels/gemm_glu.py), Llama-3-8B's gate/up at TP 2 (4096 x
2 x 7168 x 4096, bf16), three calls each, no CUDA graph (ncu profiles kernel launches).
Run: ncu --clock-control none -k regex:glu_persistent_kernel|gemm_splitk_kernel --launch-skip 2
--launch-count 1 --section SpeedOfLight --section WarpStateStats python3 scripts/glu_ncu.py [KIND]
where KIND is "splitk" or "persistent" (default: both, split-K first)."""
import sys

import torch

import numasched
from numasched import gemm_glu


def main():
    kinds = sys.argv[1:] or ["splitk", "persistent"]
    M, n, K = 4096, 7168, 4096
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(2 * n, K, device="cuda", dtype=torch.bfloat16) / K ** 0.5
    for kind in kinds:
        sched = gemm_glu.GLU_BIG_SCHEDULE if kind == "splitk" else gemm_glu.GLU_PERSISTENT_SCHEDULE
        plan = numasched.plan_matmul_swiglu(x, w.t(), schedule=sched)
        for _ in range(3):
            plan.run(x, w.t())
        torch.cuda.synchronize()
        print(kind, plan.path, plan.grid, flush=True)


if __name__ == "__main__":
    main()
