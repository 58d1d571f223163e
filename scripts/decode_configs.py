"""Flash Decode diagnostic (GPU): for each (batch, context) given, the split count the heuristic
picks, the config the autotuner picks, and the CUDA-graph time of every contiguous-cache config at
several split counts. Data for the split heuristic and the config list, not a benchmark of peers.

Every timing runs a plan made with the public planning call:
``numasched.plan_decode(..., num_splits=S, config=dict(BLOCK_N=..., num_warps=..., num_stages=...))``.

    python scripts/decode_configs.py --batch 4 --ctx 65536 131072 262144 --splits 4 8 16
"""
import argparse
import sys

import torch

import numasched
from numasched.bench.common import graph_replay_ms
from numasched.cli import positive_int
from numasched.decode import choose_num_splits

# (BLOCK_N, num_warps, num_stages) tried for a contiguous cache: the autotuner's candidates
# (numasched/kernels/flash_decode.py, read only)
from numasched.kernels.flash_decode import _CONTIGUOUS_CONFIGS as CONFIGS


def graph_us(fn) -> float:
    return graph_replay_ms(fn, warmup=5, iters=30) * 1e3


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python scripts/decode_configs.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=positive_int, nargs="+", default=[4], help="batch sizes")
    p.add_argument("--ctx", type=positive_int, nargs="+", default=[131072], help="context lengths (tokens)")
    p.add_argument("--splits", type=positive_int, nargs="+", default=[4, 8, 16], help="split counts to sweep")
    p.add_argument("--heads", type=positive_int, nargs=2, default=[32, 8], metavar=("H", "HK"),
                   help="query and KV heads")
    p.add_argument("--dry-run", action="store_true", help="print the sweep and exit (no GPU needed)")
    return p


def main(argv=None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    H, HK, D = args.heads[0], args.heads[1], 128
    if H % HK:
        p.error(f"--heads: query heads ({H}) must be a multiple of KV heads ({HK})")
    if args.dry_run:
        for B in args.batch:
            for L in args.ctx:
                print(f"B={B} ctx={L} heads {H}/{HK}: auto splits (132 SMs) {choose_num_splits(B, HK, L, 132)}; "
                      f"splits {args.splits} x configs {CONFIGS}")
        return 0
    if not torch.cuda.is_available():
        print("scripts/decode_configs.py needs a CUDA GPU (found none); --dry-run prints the sweep", file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    nsm = torch.cuda.get_device_properties(dev).multi_processor_count
    with numasched.options.use(check_data=False):
        for B in args.batch:
            for L in args.ctx:
                q = torch.randn(B, H, D, device=dev, dtype=torch.bfloat16)
                k = torch.randn(B, L, HK, D, device=dev, dtype=torch.bfloat16)
                v = torch.randn(B, L, HK, D, device=dev, dtype=torch.bfloat16)
                gb = 2 * k.numel() * k.element_size() / 1e9
                auto = choose_num_splits(B, HK, L, nsm)
                plan = numasched.plan_decode(q, k, v)   # autotuned on its first run
                t_auto = graph_us(lambda: plan.run(q, k, v))
                print(f"B={B} ctx={L} ({gb:.2f} GB): auto splits {auto} (plan: {plan.num_splits}): {t_auto:.1f} us "
                      f"({gb / t_auto * 1e6 / 1e3:.2f} TB/s); autotuned config {plan.config}", flush=True)
                for s in args.splits:
                    row = []
                    for bn, w, st in CONFIGS:
                        fixed = numasched.plan_decode(q, k, v, num_splits=s,
                                                      config=dict(BLOCK_N=bn, num_warps=w, num_stages=st))
                        row.append(f"{bn}/{w}w/{st}s {graph_us(lambda: fixed.run(q, k, v)):.0f}")
                    print(f"  S={s}: " + ", ".join(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
