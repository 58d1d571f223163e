"""``numasched bench SUITE [suite args]``: each suite is a module numasched.bench.<suite> with main(argv)."""
from __future__ import annotations

import importlib

SUITES = {
    "decode": "Flash Decode vs SDPA (FLASH/EFFICIENT/cuDNN), FlexAttention, FlashInfer",
    "prefill": "prefill attention forward vs SDPA FLASH and cuDNN",
    "gemm": "GEMM vs cuBLAS (torch.matmul)",
    "policies": "effect of the mapping policies on this GPU (time per policy, per kernel)",
    "distributed": "all-gather+GEMM, GEMM+reduce-scatter, distributed decode (torchrun, 2+ GPUs)",
    "host_overhead": "Python host time per eager call of the public calls (launch replaced by a no-op)",
}


def add_parser(sub) -> None:
    p = sub.add_parser("bench", help="run a benchmark suite side by side with its peers",
                       description="Suites: " + "; ".join(f"{k}: {v}" for k, v in SUITES.items()))
    p.add_argument("suite", choices=sorted(SUITES))
    p.add_argument("suite_args", nargs="...", help="arguments for the suite (--help for its own)")
    p.set_defaults(func=_run)


def _run(args) -> int:
    mod = importlib.import_module(f"numasched.bench.{args.suite}")
    return int(mod.main(args.suite_args) or 0)
