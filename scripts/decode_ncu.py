"""Decode attention under Nsight Compute: numasched.flash_decode against cuDNN's SDPA at one
contiguous shape (issue 12: the grid's short contexts, where cuDNN leads by 1-4 %). Each of the
two runs ``--calls`` times on its own copy of K and V (more than twice the L2 in all, so each
profiled call reads from HBM, as in a decode step), no CUDA graph (ncu profiles launches).

Run (on the GPU machine, numasched installed):
  ncu --clock-control none -k regex:'_decode|cudnn|fmha|sm90' --launch-skip 4 --launch-count 4 \
      --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats \
      --section LaunchStats --section Occupancy --section SchedulerStats \
      python3 scripts/decode_ncu.py --heads 32/8 --batch 32 --ctx 1024
``--time``: CUDA-graph replay times of the two (median of replays), no profiler, as a check that
the profiled shape shows the bench's gap."""
import argparse

import torch
import torch.nn.functional as F


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--heads", default="32/8", help="query/KV heads, e.g. 32/8")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--ctx", type=int, default=1024)
    p.add_argument("--calls", type=int, default=8, help="calls of each contender (default 8)")
    p.add_argument("--time", action="store_true", help="CUDA-graph replay times instead of profiled launches")
    a = p.parse_args()
    import numasched
    from torch.nn.attention import SDPBackend, sdpa_kernel

    H, HK = (int(x) for x in a.heads.split("/"))
    B, L, D = a.batch, a.ctx, 128
    dev, dt = torch.device("cuda"), torch.bfloat16
    per_call = 2 * B * HK * L * D * 2
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    copies = max(2, -(-3 * l2 // per_call))
    q = torch.randn(B, H, D, device=dev, dtype=dt)
    lens = torch.full((B,), L, dtype=torch.int32, device=dev)
    # ours reads (B, L, HK, D); cuDNN's SDPA the (B, HK, L, D) view of the same storage
    kv = [(torch.randn(B, L, HK, D, device=dev, dtype=dt), torch.randn(B, L, HK, D, device=dev, dtype=dt))
          for _ in range(copies)]

    def ours(i):
        k, v = kv[i % copies]
        return numasched.flash_decode(q, k, v, cache_seqlens=lens)

    def cudnn(i):
        k, v = kv[i % copies]
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(q.view(B, H, 1, D), k.transpose(1, 2), v.transpose(1, 2),
                                                  enable_gqa=H != HK).view(B, H, D)

    err = (ours(0).float() - cudnn(0).float()).abs().max().item()
    plan = numasched.plan_decode(q, *kv[0], cache_seqlens=lens)
    print(f"{H}/{HK} B={B} L={L}: {copies} copies of {per_call / 1e6:.1f} MB; ours {plan.num_splits} split(s), "
          f"combine {plan.combine}; max |ours - cuDNN| {err:.2e}", flush=True)
    if a.time:
        from numasched.bench.common import graph_replay_ms

        for name, fn in (("ours", ours), ("cudnn", cudnn), ("ours", ours), ("cudnn", cudnn)):
            calls = [0]

            def step(fn=fn, calls=calls):
                calls[0] += 1
                return fn(calls[0])

            us = graph_replay_ms(lambda: [step() for _ in range(copies)]) * 1e3 / copies
            print(f"{name}: {us:.2f} us per call ({per_call / us / 1e6:.2f} TB/s)", flush=True)
        return
    for name, fn in (("ours", ours), ("cudnn", cudnn)):
        torch.cuda.synchronize()
        for i in range(a.calls):
            fn(i)
        torch.cuda.synchronize()
        print(name, "done", flush=True)


if __name__ == "__main__":
    main()
