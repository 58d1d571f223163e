"""``numasched bench SUITE [suite args]``: each suite is a module numasched.bench.<suite> with
``build_parser()`` and ``main(argv) -> int``.

Every suite takes ``--dry-run`` (parse and validate the arguments, print the planned points and
contenders, exit 0 without a GPU and without timing) and ``--out-dir`` (results folder; default:
see numasched.bench.common). Exit codes: 0 ok, 2 bad usage or no GPU to run on, 1 a failed run.
"""
from __future__ import annotations

import importlib

SUITES = {
    "decode": "Flash Decode vs SDPA (FLASH/EFFICIENT/cuDNN), FlexAttention, FlashInfer",
    "prefill": "prefill attention forward vs SDPA FLASH and cuDNN",
    "gemm": "GEMM vs cuBLAS (torch.matmul)",
    "gemm_inference": "inference-shape GEMMs (M = batch) vs cuBLAS, and the schedule chooser vs the best timed",
    "policies": "effect of the mapping policies on this GPU (time per policy, per kernel)",
    "distributed": "all-gather+GEMM, GEMM+reduce-scatter, distributed decode (torchrun, 2+ GPUs)",
    "host_overhead": "host time per eager call of the public calls vs torch's equivalents (GPU)",
    "collectives": "all-reduce, GEMM+all-reduce and the GEMM collectives with impl='auto' vs NCCL, symm_mem (2+ GPUs)",
    "e2e": "TP Llama-3-8B / Qwen3-8B decode step and prefill on numasched vs torch+NCCL+SDPA, CUDA graphs (torchrun at TP > 1)",
}


def add_parser(sub) -> None:
    p = sub.add_parser("bench", help="run a benchmark suite side by side with its peers",
                       description="Suites: " + "; ".join(f"{k}: {v}" for k, v in SUITES.items()))
    p.add_argument("suite", choices=sorted(SUITES), help="the suite to run (see above)")
    p.add_argument("suite_args", nargs="...", help="arguments for the suite (--help for its own)")
    p.set_defaults(func=_run)


def _run(args) -> int:
    mod = importlib.import_module(f"numasched.bench.{args.suite}")
    return int(mod.main(args.suite_args) or 0)
