"""``numasched bench host_overhead``: host time per eager call of numasched's public calls, side by
side with torch's equivalent call (needs a CUDA GPU).

Small bf16 shapes, so that the kernels take a few microseconds and the wall time per call is the
host's (argument checks, the plan-cache lookup, Triton's launch):

    flash_decode                   batch 1, 32 query / 8 KV heads, 1024 tokens, d128
        vs torch SDPA decode       F.scaled_dot_product_attention(q.view(1, 32, 1, 128), k, v,
                                   enable_gqa=True), k and v (1, 8, 1024, 128); flash_decode reads
                                   the same cache through k.transpose(1, 2)
    matmul                         256 x 256 x 256                vs torch.matmul
    attention_forward              (2, 4, 128, 64) q, k, v        vs torch SDPA
    scaled_dot_product_attention   (2, 4, 128, 64) q, k, v        vs torch SDPA
    plan.run                       the plan of each of our calls made once (plan_decode,
                                   plan_matmul, plan_attention), then only ``plan.run``

Each call is timed N times back to back, best of 3 rounds, the GPU synchronised at the end of each
round (so a round ends when its last kernel has). Reported per case: microseconds per call, the
ratio ours / torch's equivalent, the target (<= 1.25x torch) met or missed, and the GPU time of one
call from a CUDA-graph replay (the kernel alone: wall time above it is host time). The table goes
to the results folder as host_overhead-<device>-<date>.csv / .json / .log.

    numasched bench host_overhead              # 1000 calls per round
    numasched bench host_overhead --quick      # 200 calls per round
    numasched bench host_overhead --dry-run    # the cases, without a GPU
"""
from __future__ import annotations

import argparse
import sys
import time
from typing import Callable, Dict, List, Optional, Tuple

TARGET = 1.25  # ours / torch's equivalent, per eager call
COLUMNS = ["case", "ours", "torch", "ours_us", "torch_us", "ratio", "target", "ours_gpu_us", "torch_gpu_us"]
# (case, our call, torch's equivalent): what --dry-run prints and the GPU run times
CASES = [
    ("flash_decode", "numasched.flash_decode(q (1,32,128), k, v = (1,8,1024,128).transpose(1,2))",
     "F.scaled_dot_product_attention(q (1,32,1,128), k, v (1,8,1024,128), enable_gqa=True)"),
    ("flash_decode plan.run", "plan_decode(...) once, then plan.run(q, k, v)", "the same SDPA decode"),
    ("matmul", "numasched.matmul(a, b) 256x256x256", "torch.matmul(a, b)"),
    ("matmul plan.run", "plan_matmul(a, b) once, then plan.run(a, b)", "torch.matmul(a, b)"),
    ("attention_forward", "numasched.attention_forward(q, k, v) (2,4,128,64)", "F.scaled_dot_product_attention(q, k, v)"),
    ("attention plan.run", "plan_attention(q, k, v) once, then plan.run(q, k, v)",
     "F.scaled_dot_product_attention(q, k, v)"),
    ("scaled_dot_product_attention", "numasched.scaled_dot_product_attention(q, k, v) (2,4,128,64)",
     "F.scaled_dot_product_attention(q, k, v)"),
]


def build_parser() -> argparse.ArgumentParser:
    from numasched.argtypes import out_dir, positive_int

    p = argparse.ArgumentParser(prog="numasched bench host_overhead", description=__doc__.split("\n\n")[0])
    p.add_argument("-n", "--calls", dest="n", type=positive_int, default=1000,
                   help="calls per round (best of 3 rounds)")
    p.add_argument("--quick", action="store_true", help="200 calls per round")
    p.add_argument("--gpu", action="store_true",
                   help="accepted for old command lines and ignored: the suite always runs on the GPU")
    p.add_argument("--out-dir", type=out_dir, default=None,
                   help="results folder (default: see numasched.bench.common)")
    p.add_argument("--dry-run", action="store_true",
                   help="print the cases and exit (no GPU needed, nothing timed)")
    return p


def _per_call_us(fn: Callable[[], object], n: int, sync: Callable[[], None]) -> float:
    """Best of 3 rounds of ``n`` back-to-back calls, synchronised at the end of each round."""
    for _ in range(10):  # compile, tune, fill the plan cache
        fn()
    sync()
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        for _ in range(n):
            fn()
        sync()
        best = min(best, (time.perf_counter() - t) / n * 1e6)
    return best


def _gpu_us(fn: Callable[[], object], notes: List[str], name: str) -> Optional[float]:
    """GPU microseconds of one call (CUDA-graph replay); None, with a note, if it cannot be captured."""
    import torch

    from .common import graph_replay_ms

    try:
        return graph_replay_ms(fn) * 1e3
    except Exception as e:  # noqa: BLE001 - reported as n/a, with why
        notes.append(f"{name}: no graph time ({type(e).__name__}: {str(e).splitlines()[0][:100] if str(e) else ''})")
        torch.cuda.synchronize()
        return None


def _cases() -> Dict[str, Tuple[Callable[[], object], Callable[[], object]]]:
    """case -> (our call, torch's equivalent) on fresh GPU inputs."""
    import torch
    import torch.nn.functional as F

    import numasched

    dev, dt = "cuda", torch.bfloat16
    torch.manual_seed(0)
    # decode: the SDPA layout (B, HK, L, D); flash_decode reads the same cache as (B, L, HK, D) views
    qd = torch.randn(1, 32, 128, device=dev, dtype=dt)
    kb, vb = (torch.randn(1, 8, 1024, 128, device=dev, dtype=dt) for _ in range(2))
    kd, vd, q4 = kb.transpose(1, 2), vb.transpose(1, 2), qd.view(1, 32, 1, 128)
    a, b = (torch.randn(256, 256, device=dev, dtype=dt) for _ in range(2))
    q, k, v = (torch.randn(2, 4, 128, 64, device=dev, dtype=dt) for _ in range(3))

    decode_plan = numasched.plan_decode(qd, kd, vd)
    matmul_plan = numasched.plan_matmul(a, b)
    attention_plan = numasched.plan_attention(q, k, v)
    sdpa_decode = lambda: F.scaled_dot_product_attention(q4, kb, vb, enable_gqa=True)  # noqa: E731
    sdpa = lambda: F.scaled_dot_product_attention(q, k, v)  # noqa: E731
    mm = lambda: torch.matmul(a, b)  # noqa: E731
    return {
        "flash_decode": (lambda: numasched.flash_decode(qd, kd, vd), sdpa_decode),
        "flash_decode plan.run": (lambda: decode_plan.run(qd, kd, vd), sdpa_decode),
        "matmul": (lambda: numasched.matmul(a, b), mm),
        "matmul plan.run": (lambda: matmul_plan.run(a, b), mm),
        "attention_forward": (lambda: numasched.attention_forward(q, k, v), sdpa),
        "attention plan.run": (lambda: attention_plan.run(q, k, v), sdpa),
        "scaled_dot_product_attention": (lambda: numasched.scaled_dot_product_attention(q, k, v), sdpa),
    }


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    n = 200 if args.quick else args.n
    if args.dry_run:
        from .common import print_plan

        return print_plan("host_overhead", [f"{c}: {ours}  vs  {peer}" for c, ours, peer in CASES],
                          [f"{n} eager calls per round, best of 3 rounds; target ours <= {TARGET}x torch; "
                           f"GPU time of one call from a CUDA-graph replay"])
    import torch

    if not torch.cuda.is_available():
        print("numasched bench host_overhead needs a CUDA GPU (found none); --dry-run lists the cases",
              file=sys.stderr)
        return 2
    from .common import write_results

    described = {c: (ours, peer) for c, ours, peer in CASES}
    rows, notes = [], []
    sync = torch.cuda.synchronize
    print(f"host time per eager call, best of 3 rounds x {n} calls (synchronised per round):", flush=True)
    for name, (ours, peer) in _cases().items():
        ours_us, torch_us = _per_call_us(ours, n, sync), _per_call_us(peer, n, sync)
        ratio = ours_us / torch_us
        row = dict(case=name, ours=described[name][0], torch=described[name][1], ours_us=ours_us,
                   torch_us=torch_us, ratio=ratio, target=f"{'met' if ratio <= TARGET else 'missed'} (<= {TARGET}x)",
                   ours_gpu_us=_gpu_us(ours, notes, name), torch_gpu_us=_gpu_us(peer, notes, f"{name} (torch)"))
        rows.append(row)
        gpu = "/".join("n/a" if v is None else f"{v:.1f}" for v in (row["ours_gpu_us"], row["torch_gpu_us"]))
        print(f"  {name:30s} {ours_us:8.1f} us/call vs torch {torch_us:8.1f} us: {ratio:5.2f}x, target "
              f"{row['target']}; GPU time of one call {gpu} us (ours/torch)", flush=True)
    met = sum(r["ratio"] <= TARGET for r in rows)
    summary = (f"target ours <= {TARGET}x torch's equivalent per eager call: met in {met} of {len(rows)} cases; "
               f"{n} calls per round, best of 3 rounds")
    paths = write_results("host_overhead", rows, columns=COLUMNS, out_dir=args.out_dir, log="\n".join([summary] + notes),
                          meta=dict(calls_per_round=n, target_ratio=TARGET, notes=notes))
    print(summary)
    for line in notes:
        print(f"note: {line}")
    print("written:", ", ".join(str(v) for v in paths.values()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
