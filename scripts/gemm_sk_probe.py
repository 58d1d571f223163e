"""Where the stream-K form of the WS GEMM (kernels/gemm_ws.py) spends its time, one GPU, bf16,
out = x @ w.T, CUDA-graph replays, us: cuBLAS, the data-parallel WS kernel, stream-K on every SM;
timing-only forms with wrong sums (partial pieces dropped, i.e. no fix-up; partials stored only;
stored and ticketed, no merge); the banded merge (sk_merge=1: every contributor sums a band of
rows after its range); split-K in K lockstep with that merge (sk_split = SMs / tiles); stream-K
on a half and a quarter of the SMs, with a loader of 88 registers, and with 128 x 128 tiles in 4
stages. Run: python3 scripts/gemm_sk_probe.py [--shapes M:N:K,...]"""
import argparse

import torch

from numasched.bench.common import graph_replay_ms
import dataclasses

from numasched.gemm_ws import DEFAULT_CONFIG, STREAMK_CONFIG, WsGemmPlan


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="512:2560:8192,64:4096:4096,512:5120:5120,4096:6144:4096")
    args = ap.parse_args()
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    print(f"device {torch.cuda.get_device_name()}, {sms} SMs")
    cols = ("cublas", "dp", "sk", "sk-nofix", "sk-store", "sk-tkt", "sk-bands", "split", "sk-P/2", "sk-P/4", "sk-L88",
            "sk-s4")
    print(f"{'M x N x K':>20} " + " ".join(f"{c:>8}" for c in cols) + "  err(sk, bands, split)")
    for spec in args.shapes.split(","):
        M, N, K = (int(v) for v in spec.split(":"))
        x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
        w = torch.randn(N, K, device=dev, dtype=torch.bfloat16) / K ** 0.5
        out = torch.empty(M, N, device=dev, dtype=torch.bfloat16)
        ref = x.float() @ w.float().t()
        t = {"cublas": graph_replay_ms(lambda: torch.matmul(x, w.t(), out=out)) * 1e3}
        dp = WsGemmPlan(x, w.t(), out, config=DEFAULT_CONFIG)
        t["dp"] = graph_replay_ms(lambda: dp.run(x, w.t(), out)) * 1e3
        sk = WsGemmPlan(x, w.t(), out, config=STREAMK_CONFIG)
        out.fill_(float("nan"))
        sk.run(x, w.t(), out)
        err = ((out.float() - ref).abs().max() / ref.abs().max()).item()
        t["sk"] = graph_replay_ms(lambda: sk.run(x, w.t(), out)) * 1e3
        for mode in (0, 3, 2):   # partial pieces dropped; stored only; stored and ticketed (no merge)
            probe = WsGemmPlan(x, w.t(), out, config=STREAMK_CONFIG)
            probe.fixup = mode
            t[f"fix{mode}"] = graph_replay_ms(lambda: probe.run(x, w.t(), out)) * 1e3
        bands = WsGemmPlan(x, w.t(), out, config=dataclasses.replace(STREAMK_CONFIG, sk_merge=1))
        out.fill_(float("nan"))
        bands.run(x, w.t(), out)
        err = max(err, ((out.float() - ref).abs().max() / ref.abs().max()).item())
        t["bands"] = graph_replay_ms(lambda: bands.run(x, w.t(), out)) * 1e3
        bands.check()
        # split-K in K lockstep with the banded merge: S = SMs // tiles K parts (at least 2)
        tiles = -(-M // 128) * -(-N // 256)
        try:
            split = WsGemmPlan(x, w.t(), out, config=dataclasses.replace(STREAMK_CONFIG, sk_merge=1,
                                                                           sk_split=max(2, sms // tiles)))
            out.fill_(float("nan"))
            split.run(x, w.t(), out)
            err = max(err, ((out.float() - ref).abs().max() / ref.abs().max()).item())
            t["split"] = graph_replay_ms(lambda: split.run(x, w.t(), out)) * 1e3
            split.check()
        except ValueError as e:   # too many units for the workspace
            print(f"  split: {e}")
            t["split"] = float("nan")
        for d in (2, 4):
            pl = WsGemmPlan(x, w.t(), out, config=STREAMK_CONFIG, num_programs=sms // d)
            t[f"p{d}"] = graph_replay_ms(lambda: pl.run(x, w.t(), out)) * 1e3
        # the loader warp with more registers (its range arithmetic), and four stages of 128 x 128
        for name, cfg in (("l88", dataclasses.replace(STREAMK_CONFIG, loader_regs=88)),
                          ("s4", dataclasses.replace(STREAMK_CONFIG, block_n=128, stages=4))):
            try:
                pl = WsGemmPlan(x, w.t(), out, config=cfg)
                t[name] = graph_replay_ms(lambda: pl.run(x, w.t(), out)) * 1e3
            except Exception as e:  # report, go on
                print(f"  {name}: {type(e).__name__}: {str(e).splitlines()[0][:160]}")
                t[name] = float("nan")
        print(f"{M:>5} x {N:>5} x {K:>5} " + " ".join(f"{v:8.1f}" for v in t.values()) + f"  {err:.1e}", flush=True)


if __name__ == "__main__":
    main()
