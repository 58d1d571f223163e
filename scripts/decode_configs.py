"""Flash Decode diagnostic (GPU): for each (batch, context) given, the split count the heuristic
picks, the config the autotuner picks, and the CUDA-graph time of every contiguous-cache config at
several split counts. Data for the split heuristic and the config list, not a benchmark of peers.

    python scripts/decode_configs.py --batch 4 --ctx 65536 131072 262144 --splits 4 8 16
"""
import argparse

import torch
import triton

import numasched
from numasched.bench.common import graph_replay_ms
from numasched.kernels import flash_decode as FD


class _Force(dict):
    """Stands in for flash_decode's tuned-config table: every lookup gives one config."""

    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg

    def get(self, key, default=None):
        return self.cfg


def graph_us(fn) -> float:
    return graph_replay_ms(fn, warmup=5, iters=30) * 1e3


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, nargs="+", default=[4])
    p.add_argument("--ctx", type=int, nargs="+", default=[131072])
    p.add_argument("--splits", type=int, nargs="+", default=[4, 8, 16])
    p.add_argument("--heads", type=int, nargs=2, default=[32, 8])
    args = p.parse_args()
    H, HK, D = args.heads[0], args.heads[1], 128
    dev = torch.device("cuda")
    nsm = FD.num_sms(dev)
    for B in args.batch:
        for L in args.ctx:
            q = torch.randn(B, H, D, device=dev, dtype=torch.bfloat16)
            k = torch.randn(B, L, HK, D, device=dev, dtype=torch.bfloat16)
            v = torch.randn(B, L, HK, D, device=dev, dtype=torch.bfloat16)
            gb = 2 * k.numel() * k.element_size() / 1e9
            auto = FD.choose_num_splits(B, HK, L, nsm)
            fn = lambda s=None: numasched.flash_decode(q, k, v, num_splits=s)  # noqa: E731
            t_auto = graph_us(fn)
            tuned = {key: str(c) for key, c in FD._TUNED_CONFIGS.items()}
            print(f"B={B} ctx={L} ({gb:.2f} GB): auto splits {auto}: {t_auto:.1f} us "
                  f"({gb / t_auto * 1e6 / 1e3:.2f} TB/s); tuned so far {tuned}", flush=True)
            for s in args.splits:
                row = []
                for bn, w, st in FD._CONTIGUOUS_CONFIGS:
                    cfg = triton.Config({"BLOCK_N": bn}, num_warps=w, num_stages=st)
                    saved = FD._TUNED_CONFIGS
                    FD._TUNED_CONFIGS = _Force(cfg)   # every plan launches with cfg
                    try:
                        t = graph_us(lambda: fn(s))
                    finally:
                        FD._TUNED_CONFIGS = saved
                    row.append(f"{bn}/{w}w/{st}s {t:.0f}")
                print(f"  S={s}: " + ", ".join(row), flush=True)


if __name__ == "__main__":
    main()
