"""Where bench decode --paged-only --no-eager's first-sequence check goes wrong (errors of 4-9 at
>= 32k tokens in its first GPU run, while scripts/paged_long_check.py finds the kernel right at the
same points): the eager output's error after each step of the bench's timing (warm-up on a side
stream, capture, replays with the read flush, the graph's release)."""
import sys

import torch

import numasched
from numasched.bench.common import bench_ms, capture, warm_up_for_capture
from numasched.bench.decode import HEADS, _first_sequence_error, _paged_cache


def main(spec="gqa:32:32768", page=16):
    hname, B, L = spec.split(":")
    B, L = int(B), int(L)
    H, HK = HEADS[hname]
    dev, dt = torch.device("cuda"), torch.bfloat16
    q = torch.randn(B, H, 128, device=dev, dtype=dt)
    lens = torch.full((B,), L, dtype=torch.int32, device=dev)
    kp, vp, bt = _paged_cache(B, L, int(page), HK, 128, dev, dt)

    def fn():
        return numasched.flash_decode(q, kp, vp, cache_seqlens=lens, block_table=bt)

    out = fn()
    torch.cuda.synchronize()
    keep = out.clone()
    print(spec, page, "eager:", _first_sequence_error(out, q, kp, vp, bt, L), flush=True)
    warm_up_for_capture(fn)
    print("  after the side-stream warm-up:", _first_sequence_error(out, q, kp, vp, bt, L),
          "out changed:", not torch.equal(out, keep), flush=True)
    g = capture(fn)
    print("  after capture:", _first_sequence_error(out, q, kp, vp, bt, L), "out changed:",
          not torch.equal(out, keep), flush=True)
    bench_ms(g.replay, warmup=5, rep=20, flush="read")
    print("  after replays (read flush):", _first_sequence_error(out, q, kp, vp, bt, L), "out changed:",
          not torch.equal(out, keep), flush=True)
    del g
    torch.cuda.synchronize()
    print("  after the graph's release:", _first_sequence_error(out, q, kp, vp, bt, L), "out changed:",
          not torch.equal(out, keep), "kept copy:", _first_sequence_error(keep, q, kp, vp, bt, L), flush=True)


if __name__ == "__main__":
    for a in sys.argv[1:] or ["gqa:32:32768:16", "gqa:32:32768:64", "gqa:8:131072:16"]:
        main(*a.rsplit(":", 1))
