"""The MLP's gate/up projection and SwiGLU at prefill sizes (one GPU, CUDA-graph replays).

The TP prefill runs the gate/up projection through cuBLAS and the activation as the model's
compiled elementwise kernel, which reads the (M, 2n) projection back from memory (Llama-3-8B
TP 2, 4096 tokens: 117 MB read, 58 MB written per layer). numasched.matmul_swiglu does both in
one launch; its plan was made for decode sizes. This times, for M = 512-8192 rows and the
Llama-3-8B MLP at TP 1 and TP 2 (n = 14336, 7168; K = 4096):

    cublas          F.linear(x, w_gate_up)                     (the GEMM alone)
    cublas+act      the same, then the compiled silu(g) * u   (what the prefill runs now)
    swiglu[SCHED]   numasched.matmul_swiglu with the plan's schedule ("plan") or a named one
                    (Schedule.parse of the (M, 2n, K) GEMM: the GLU tile is half its width)
    swiglu[plan, row_scale]  the plan's with a factor per row (a norm-free prefill's form)
    swiglu[tiled ... persistent]  the persistent kernel (kernels/gemm_glu.py), with and without
                    row factors
    swiglu[ws], swiglu[ws, row_scale]  the warp-specialised Gluon kernel (kernels/gemm_ws.py, GLU)
    ws-gemm         the warp-specialised kernel as the plain (M, 2n, K) GEMM (against cublas)

Errors are against the fp32 product of the same bf16 operands. Run: python3 scripts/glu_prefill_probe.py
[--rows 512,4096] [--schedules "splitk 128x256x64 w8 s4,..."]
"""
import argparse
import dataclasses

import torch
import torch.nn.functional as F

import numasched
from numasched.bench.common import graph_replay_ms
from numasched import gemm_ws
from numasched.gemm_schedule import Schedule
from numasched.models.llama import CompiledElementwise, silu_mul

SCHEDULES = ("splitk 128x256x64 w8 s3", "splitk 128x256x64 w8 s4", "splitk 128x128x64 w4 s4",
             "splitk 64x256x64 w4 s4", "splitk 256x128x64 w8 s3")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", default="512,1024,2048,4096,8192")
    p.add_argument("--inter", default="7168,14336", help="n: the gate's (and the up's) columns")
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--schedules", default=",".join(SCHEDULES))
    args = p.parse_args()
    act = CompiledElementwise(silu_mul)
    K = args.hidden
    print(f"# {torch.cuda.get_device_name()} torch {torch.__version__}", flush=True)
    for n in [int(v) for v in args.inter.split(",")]:
        w = torch.randn(2 * n, K, device="cuda", dtype=torch.bfloat16) / K ** 0.5
        for M in [int(v) for v in args.rows.split(",")]:
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            gu = (x.float() @ w.float().t())
            ref = F.silu(gu[:, :n]) * gu[:, n:]
            del gu
            flop = 2 * M * 2 * n * K
            row = {"cublas": lambda: F.linear(x, w), "cublas+act": lambda: act(F.linear(x, w), n)}
            plan = numasched.plan_matmul_swiglu(x, w.t())
            row[f"swiglu[plan {plan.schedule.describe() if plan.schedule else '-'}]"] = lambda pl=plan: pl.run(x, w.t())
            # a norm-free prefill's form (TPDecoder.fold_norms): each row scaled by a factor on the
            # accumulators (unit factors here, so the error column still compares with ref)
            ones = torch.ones(M, device="cuda", dtype=torch.float32)
            plan_rs = numasched.plan_matmul_swiglu(x, w.t(), row_scale=ones)
            row["swiglu[plan, row_scale]"] = lambda pl=plan_rs: pl.run(x, w.t(), None, ones)
            ws_opts = dataclasses.replace(numasched.options.current(), glu_ws=True)
            for name, rs in (("swiglu[ws]", None), ("swiglu[ws, row_scale]", ones)):
                pl = numasched.plan_matmul_swiglu(x, w.t(), row_scale=rs, options=ws_opts)
                if pl.path == "ws":
                    row[name] = lambda pl=pl, rs=rs: pl.run(x, w.t(), None, rs)
                else:
                    print(f"M {M} n {n}: {name} not planned (path {pl.path})", flush=True)
            if gemm_ws.supported(x, w.t()) is None:
                ws_plain = gemm_ws.WsGemmPlan(x, w.t())
                row["ws-gemm"] = lambda pl=ws_plain: pl.run(x, w.t())
            # '_' stands for a space (scripts/device.sh passes no spaces inside an argument)
            for text in [s.replace("_", " ") for s in args.schedules.split(",") if s.strip()]:
                try:
                    pl = numasched.plan_matmul_swiglu(x, w.t(), schedule=Schedule.parse(text))
                except Exception as e:   # a schedule this shape cannot take: say so, go on
                    print(f"M {M} n {n} {text}: {type(e).__name__}: {e}", flush=True)
                    continue
                row[f"swiglu[{text.strip()}]"] = lambda pl=pl: pl.run(x, w.t())
                if "persistent" in text:   # the persistent kernel with row factors too
                    pl = numasched.plan_matmul_swiglu(x, w.t(), schedule=Schedule.parse(text), row_scale=ones)
                    row[f"swiglu[{text.strip()}, row_scale]"] = lambda pl=pl: pl.run(x, w.t(), None, ones)
            out = []
            for name, fn in row.items():
                try:
                    us = graph_replay_ms(fn) * 1e3
                except Exception as e:
                    out.append(f"{name} FAILED {type(e).__name__}: {str(e)[:80]}")
                    continue
                err = ""
                if name not in ("cublas", "ws-gemm"):
                    y = fn().float()
                    err = f" err {((y - ref).norm() / ref.norm()).item():.1e}"
                out.append(f"{name} {us:.1f} us ({flop / us / 1e6:.0f} TF/s){err}")
            print(f"{M}x{2 * n}x{K} | " + " | ".join(out), flush=True)


if __name__ == "__main__":
    main()
