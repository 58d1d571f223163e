"""The warp-specialised Gluon GEMM (kernels/gemm_ws.py) against cuBLAS and numasched.matmul.

One GPU, bf16, ``out = x @ w.T`` as F.linear has it (w is (N, K) row-major), CUDA-graph replays.
Each config of the kernel is first checked against the fp32 product of the same operands (its
output poisoned with NaN before the call), then timed beside torch.matmul (cuBLAS) and
numasched.matmul (the model's schedule). Run: python3 scripts/gemm_ws_probe.py [--shapes
M:N:K,...] [--configs BN/STAGES/GROUP_M|sk,...] [--b-rowmajor] ("sk": the stream-K form)
"""
import argparse

import torch

import numasched
from numasched.bench.common import graph_replay_ms
from numasched.gemm_ws import WsConfig, WsGemmPlan

SHAPES = ("4096:14336:4096,4096:3072:4096,4096:4096:2048,4096:4096:7168,4096:4096:4096,8192:8192:8192,"
          "2048:5120:12800,1024:2560:8192,1024:4096:14336,512:5120:5120,512:2560:8192,256:28672:4096,"
          "256:4096:4096,128:4096:14336,3000:5000:7000,1000:1000:1000")
CONFIGS = "256/3/8,128/4/8,128/5/8,256/3/1"


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default=SHAPES)
    p.add_argument("--configs", default=CONFIGS)
    p.add_argument("--b-rowmajor", action="store_true", help="b as a (K, N) row-major tensor instead of w.T")
    args = p.parse_args()
    torch.manual_seed(0)
    dev = torch.device("cuda")
    print(f"device {torch.cuda.get_device_name()}, torch {torch.__version__}, numasched {numasched.__version__}")
    configs = []
    for c in args.configs.split(","):
        if c == "sk":   # the stream-K form (128 x 256 tiles, 3 stages)
            configs.append(WsConfig(streamk=True))
            continue
        bn, st, gm = (int(x) for x in c.split("/"))
        configs.append(WsConfig(block_n=bn, stages=st, group_m=gm))
    print(f"{'M x N x K':>22} {'cublas':>8} {'numasched':>9} " + " ".join(("sk" if c.streamk else f"{c.block_n}/{c.stages}/{c.group_m}").rjust(10) for c in configs)
          + "   best/cublas  TFLOP/s(best)  max rel err")
    for spec in args.shapes.split(","):
        M, N, K = (int(x) for x in spec.split(":"))
        x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
        w = torch.randn(N, K, device=dev, dtype=torch.bfloat16) / K ** 0.5
        b = w.t().contiguous() if args.b_rowmajor else w.t()
        ref = (x.float() @ w.float().t())
        scale = ref.abs().max().item()
        out = torch.empty(M, N, device=dev, dtype=torch.bfloat16)
        t_cublas = graph_replay_ms(lambda: torch.matmul(x, b, out=out)) * 1e3
        t_ns = graph_replay_ms(lambda: numasched.matmul(x, b, out=out)) * 1e3
        times, errs = [], []
        for cfg in configs:
            try:
                plan = WsGemmPlan(x, b, out, config=cfg)
                out.fill_(float("nan"))
                plan.run(x, b, out)
                torch.cuda.synchronize()
                err = ((out.float() - ref).abs().max().item()) / scale
                errs.append(err)
                if not err < 1e-2:
                    times.append(float("nan"))
                    continue
                times.append(graph_replay_ms(lambda: plan.run(x, b, out)) * 1e3)
            except Exception as e:  # a config that does not compile or fit: report, go on
                print(f"  {spec} {cfg}: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
                times.append(float("nan"))
                errs.append(float("nan"))
        ok = [t for t in times if t == t]
        best = min(ok) if ok else float("nan")
        tf = 2 * M * N * K / (best * 1e-6) / 1e12 if ok else float("nan")
        print(f"{M:>6} x {N:>6} x {K:>6} {t_cublas:8.1f} {t_ns:9.1f} " + " ".join(f"{t:10.1f}" for t in times)
              + f"   {t_cublas / best:11.3f}  {tf:13.0f}  {max(errs):.1e}", flush=True)


if __name__ == "__main__":
    main()
