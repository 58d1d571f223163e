"""The fused distributed GEMM kernels' compute core on one GPU (world 1: every tile is local, no
flags), against cuBLAS and numasched.matmul, for a few tile configs. Data for choosing the fused
kernels' config; not a benchmark of the distributed ops (``numasched bench distributed`` is).

    NCCL_NVLS_ENABLE=0 torchrun --nproc-per-node 1 scripts/dist_core_sweep.py
"""
import os

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")   # never NVLink multicast on the lent machines
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")

import torch
import torch.distributed as dist
import triton.testing

import numasched
import numasched.distributed as nd
from numasched.distributed._common import _gemm_cfg   # the default tile config (read only)

SHAPES = [(4096, 4096, 8192), (4096, 14336, 8192), (16384, 4096, 8192), (4096, 8192, 2048), (4096, 8192, 7168)]


# (name, config overrides, persistent): not persistent = as many programs as tiles, one ticket each
# (its extra config key gives it a plan of its own)
VARIANTS = [("default", {}, True), ("s4", dict(num_stages=4), True),
            ("128x128 w4 s4", dict(BLOCK_N=128, num_warps=4, num_stages=4), True),
            ("128x128 w8 s4", dict(BLOCK_N=128, num_warps=8, num_stages=4), True),
            ("pointer", dict(USE_TMA=False), True), ("a program per tile", dict(PROGRAM_PER_TILE=1), False)]


def run_with_config(ctx, op: str, a, b, over: dict, check: bool = True):
    """One call of ``op`` with its tile config changed by ``over``.

    numasched.distributed's ops take no config argument, so this does what its run() does with a
    call described under that config: the op's checks and output (prepare), the call re-described
    with the config (its key then differs, so the config gets a plan of its own), plan once (then
    a barrier), launch. Nothing in the library is replaced."""
    spec = nd.OPS[op]
    call = spec.prepare(ctx, a, b)
    first = next(iter(call.tensors))   # a_local (all-gather) or a (reduce-scatter), as prepared
    cfg = dict(_gemm_cfg(a.dtype, True, b.shape[1]), **over)
    fixed = spec.describe(call.tensors[first], b, world=ctx.world, cfg=cfg)
    fixed.tensors["out"] = call.tensors["out"]
    fixed.extra.update(call.extra)
    plan = ctx.plans.get(fixed.key)
    if plan is None:
        plan = ctx.plans[fixed.key] = spec.plan(ctx, fixed)
        ctx.barrier()   # every rank's buffers are zeroed before any peer pushes (as run() does)
    out = spec.launch(ctx, plan, fixed, phase="full")
    if check:
        ctx.check(op)
    return out


def main() -> None:
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl")
    ctx = nd.init(heap_bytes=1 << 30)
    for M, N, K in SHAPES:
        a = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(K, N, device="cuda", dtype=torch.bfloat16)
        ref = a.float() @ b.float()
        flops = 2 * M * N * K
        t_cublas = triton.testing.do_bench(lambda: a @ b, warmup=25, rep=100)
        t_ours = triton.testing.do_bench(lambda: numasched.matmul(a, b), warmup=25, rep=100)
        line = [f"M={M} N={N} K={K}: cuBLAS {t_cublas * 1e3:.0f} us ({flops / t_cublas / 1e9:.0f} TFLOP/s), "
                f"numasched.matmul {t_ours * 1e3:.0f} us"]
        for name, over, persistent in VARIANTS:
            sms = ctx.num_sms
            if not persistent:
                ctx.num_sms = 1 << 30
            for op in ("all_gather_matmul", "matmul_reduce_scatter"):
                try:
                    out = run_with_config(ctx, op, a, b, over)
                    err = ((out.float() - ref).norm() / ref.norm()).item()
                    t = triton.testing.do_bench(lambda: run_with_config(ctx, op, a, b, over, check=False),
                                                warmup=25, rep=100)
                    line.append(f"{op[:2].upper()} {name}: {t * 1e3:.0f} us ({t / t_cublas:.2f}x cuBLAS, err {err:.1e})")
                except Exception as e:  # noqa: BLE001
                    line.append(f"{op[:2].upper()} {name}: {type(e).__name__}: {str(e)[:120]}")
            ctx.num_sms = sms
        print("\n  ".join(line), flush=True)
    ctx.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
