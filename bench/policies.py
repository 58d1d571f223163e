"""``numasched bench policies``: the effect of the mapping policy on the GPU at hand.

For each kernel that is present (prefill attention; Flash Decode and GEMM when their modules
import) and a couple of sizes, times every registered policy of that kind on the same inputs,
with the kernel config held fixed (prefill: one fixed config; decode and GEMM: their first call
tunes, and their tuning keys do not include the policy), so the columns differ only by which
program runs which work item. Reported: ms, rate (TFLOP/s or TB/s of K/V read), ratio to the
policy ``auto`` picks here and to the fastest, and the policy ``auto`` picks.

On an NVIDIA GPU (one locality domain, topology dispatch "single") the policies differ only by
temporal order (which heads / tiles run together), so differences are expected to be small; on
a multi-domain GPU they also decide which domain's L2 holds what.

    numasched bench policies --quick
    numasched bench policies --kinds prefill
    numasched bench policies --l2 [--quick]   # L2 hit rate per policy, read with Nsight Compute
    numasched bench policies --dry-run        # the cases and policies, without a GPU
    TRITON_INTERPRET=1 numasched bench policies --cpu-check   # end to end on CPU, tiny sizes

``--l2`` reruns the same cases under ``ncu`` (clocks left alone: ``--clock-control none``; caches
flushed before each profiled kernel, ncu's default) with every policy's kernel profiled exactly
once (fixed kernel configs, NUMASCHED_AUTOTUNE=0; the warm-up calls are outside the profiled
range), and reports per policy the L2 sector hit rate, the DRAM bytes read and the kernel time
under the profiler (a cold-L2 time, not the timed figure above).
"""
from __future__ import annotations

import argparse
import sys

PREFILL = [  # (label, B, H, HK, S, D, causal)
    ("prefill b2 h32/8 8k d128", 2, 32, 8, 8192, 128, False),
    ("prefill b2 h32/8 8k d128 causal", 2, 32, 8, 8192, 128, True),
    ("prefill b4 h32 4k d64", 4, 32, 32, 4096, 64, False),
]
DECODE = [  # (label, B, H, HK, L, D)
    ("decode b8 32k h32/8 d128", 8, 32, 8, 32768, 128),
    ("decode b32 8k h32/8 d128", 32, 32, 8, 8192, 128),
]
GEMM = [("gemm 8192^3", 8192, 8192, 8192), ("gemm 16384x14336x8192", 16384, 14336, 8192)]
# --cpu-check (CPU, Triton interpreter): tiny sizes, fp32, to check the script end to end
DRY = {"prefill": [("prefill tiny", 1, 4, 2, 40, 64, True)], "decode": [("decode tiny", 2, 4, 2, 50, 64)],
       "gemm": [("gemm tiny", 40, 48, 32)]}
DEV = {"device": "cuda", "dtype": None}  # set in main()


def _each_policy(kind, registry_kind, label, auto, run, work, unit, bench_ms, rows):
    """Time ``run(mapping=name)`` for every registered policy of ``registry_kind``: one row each,
    with the rate ``work`` (FLOPs or bytes) / time in tera-units."""
    from numasched import mappings as M

    for name in M.available(registry_kind):
        fn = lambda name=name: run(mapping=name)  # noqa: E731
        fn()
        ms = bench_ms(fn)
        rows.append(dict(kind=kind, size=label, policy=name, auto=auto, ms=ms, rate=work / (ms * 1e-3) / 1e12,
                         unit=unit))


def _prefill_cases(sizes, bench_ms, rows):
    import torch

    from numasched import mappings as M
    from numasched import topology
    from numasched.attention import attention_forward
    from numasched.kernels import attention_fwd as K

    for label, B, H, HK, S, D, causal in sizes:
        q = torch.randn(B, H, S, D, **DEV)
        k = torch.randn(B, HK, S, D, **DEV)
        v = torch.randn(B, HK, S, D, **DEV)
        grid = M.AttentionGrid(B, H, HK, -(-S // K.DEFAULT_GPU_CONFIG["BLOCK_M"]))
        auto = M.resolve("auto", "attention", topology.current(), grid, causal=causal).name
        flops = 4 * B * H * S * S * D * (0.5 if causal else 1.0)
        cfg = K.DEFAULT_GPU_CONFIG if DEV["device"] == "cuda" else None
        _each_policy("prefill", "attention", label, auto,
                     lambda mapping: attention_forward(q, k, v, causal=causal, mapping=mapping, _config=cfg),
                     flops, "TFLOP/s", bench_ms, rows)
        del q, k, v


def _decode_cases(sizes, bench_ms, rows):
    import torch

    from numasched import mappings as M
    from numasched import topology
    from numasched.decode import flash_decode

    for label, B, H, HK, L, D in sizes:
        q = torch.randn(B, H, D, **DEV)
        kc = torch.randn(B, L, HK, D, **DEV)
        vc = torch.randn(B, L, HK, D, **DEV)
        nbytes = 2 * kc.numel() * kc.element_size()
        auto = M.resolve("auto", "decode", topology.current(), M.DecodeGrid(B, HK, 1)).name
        flash_decode(q, kc, vc)  # tunes once; the policy is not in the tuning key
        _each_policy("decode", "decode", label, auto, lambda mapping: flash_decode(q, kc, vc, mapping=mapping),
                     nbytes, "TB/s", bench_ms, rows)
        del q, kc, vc


def _gemm_cases(sizes, bench_ms, rows):
    import torch

    from numasched import mappings as M
    from numasched import topology
    from numasched.gemm import matmul

    for label, m, n, k in sizes:
        a = torch.randn(m, k, **DEV)
        b = torch.randn(k, n, **DEV)
        auto = M.resolve("auto", "gemm", topology.current(), M.GemmGrid(-(-m // 128), -(-n // 128))).name
        matmul(a, b)
        _each_policy("gemm", "gemm", label, auto, lambda mapping: matmul(a, b, mapping=mapping), 2 * m * n * k,
                     "TFLOP/s", bench_ms, rows)
        del a, b


# ------------------------------------------------------------------ L2 hit rates with ncu
L2_METRICS = ("lts__t_sector_hit_rate.pct", "dram__bytes_read.sum", "gpu__time_duration.sum")
L2_KERNELS = "regex:^(attn_fwd_kernel|_flash_decode_kernel|gemm_kernel)$"


def _profiled_once(fn):
    """The worker's ``bench_ms``: one call of fn inside the profiled range (ncu --profile-from-start off)."""
    import torch

    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    fn()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()
    return float("nan")


def _parse_ncu_csv(text: str) -> list:
    """ncu --csv output -> one dict {metric: value} per profiled kernel, in launch order."""
    import csv
    import io

    lines = text[text.find('"ID"'):] if '"ID"' in text else ""
    kernels: dict = {}
    for rec in csv.DictReader(io.StringIO(lines)):
        try:
            value = float(rec["Metric Value"].replace(",", ""))
        except (KeyError, ValueError):
            continue
        kernels.setdefault(int(rec["ID"]), {"kernel": rec.get("Kernel Name", "")})[rec["Metric Name"]] = value
    return [kernels[i] for i in sorted(kernels)]


def _l2(args) -> int:
    """Launcher of ``--l2``: the cases under ncu, then one row per (size, policy) with its counters."""
    import json
    import os
    import shutil
    import subprocess
    import tempfile

    from .common import write_results

    ncu = shutil.which("ncu")
    if ncu is None:
        print("--l2 needs Nsight Compute (ncu) on the PATH", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        rows_path, log = os.path.join(tmp, "rows.json"), os.path.join(tmp, "ncu.csv")
        worker = [sys.executable, "-m", "numasched.bench.policies", "--l2-worker", rows_path, "--kinds", *args.kinds]
        worker += ["--quick"] if args.quick else []
        worker += ["--topology", args.topology] if args.topology else []
        cmd = [ncu, "--clock-control", "none", "--profile-from-start", "off", "--kernel-name", L2_KERNELS,
               "--metrics", ",".join(L2_METRICS), "--csv", "--print-units", "base", "--log-file", log, *worker]
        print("running:", " ".join(cmd), flush=True)
        rc = subprocess.call(cmd, env=dict(os.environ, NUMASCHED_AUTOTUNE="0"))
        if rc or not os.path.exists(rows_path):
            print(f"ncu run failed (exit code {rc}); its log:", file=sys.stderr)
            print(open(log).read()[-3000:] if os.path.exists(log) else "(none)", file=sys.stderr)
            return rc or 1
        rows = json.load(open(rows_path))
        kernels = _parse_ncu_csv(open(log).read())
    if len(kernels) != len(rows):
        print(f"ncu profiled {len(kernels)} kernels for {len(rows)} calls: cannot match them up", file=sys.stderr)
        return 1
    for r, k in zip(rows, kernels):
        r.update(kernel=k["kernel"], l2_hit_pct=k.get(L2_METRICS[0]), dram_read_GB=k.get(L2_METRICS[1], 0) / 1e9,
                 ncu_ms=k.get(L2_METRICS[2], 0) / 1e6)
    cols = ["kind", "size", "policy", "auto", "l2_hit_pct", "dram_read_GB", "ncu_ms", "kernel"]
    paths = write_results("policies_l2", rows, columns=cols, out_dir=args.out_dir,
                          meta=dict(metrics=L2_METRICS, note="one profiled call per policy, cold L2 (ncu "
                                    "--cache-control all), clocks not locked (--clock-control none)"))
    print("written:", ", ".join(str(v) for v in paths.values()))
    return 0


def _plot(rows, path):
    import matplotlib.pyplot as plt
    from .common import save_plot

    sizes = list(dict.fromkeys(r["size"] for r in rows))
    fig, axes = plt.subplots(1, len(sizes), figsize=(4.2 * len(sizes), 4), squeeze=False)
    for ax, size in zip(axes[0], sizes):
        sub = [r for r in rows if r["size"] == size]
        ax.bar(range(len(sub)), [r["rate"] for r in sub], color=["C1" if r["policy"] == r.get("auto") else "C0"
                                                                 for r in sub])
        ax.set_xticks(range(len(sub)), [r["policy"] for r in sub], rotation=60, ha="right", fontsize=7)
        ax.set_title(size, fontsize=9)
        ax.set_ylabel(sub[0]["unit"])
    fig.tight_layout()
    save_plot(fig, path)


KINDS = ("prefill", "decode", "gemm")


def _topology_preset(text: str) -> str:
    """argparse type of --topology: a preset of numasched.topology."""
    from numasched.topology import PRESETS

    if text not in PRESETS:
        raise argparse.ArgumentTypeError(f"expected a topology preset ({', '.join(sorted(PRESETS))}), got {text!r}")
    return text


def build_parser() -> argparse.ArgumentParser:
    from numasched.argtypes import out_dir

    p = argparse.ArgumentParser(prog="numasched bench policies", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="one size per kernel")
    p.add_argument("--kinds", nargs="+", default=list(KINDS), choices=KINDS, help="kernels to time")
    p.add_argument("--topology", type=_topology_preset, default=None,
                   help="plan for this topology preset instead of the detected one (changes NUM_DOMAINS)")
    p.add_argument("--out-dir", type=out_dir, default=None, help="results folder (default: see numasched.bench.common)")
    p.add_argument("--l2", action="store_true", help="L2 hit rate per policy with Nsight Compute (ncu)")
    p.add_argument("--l2-worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--dry-run", action="store_true",
                   help="print the cases and policies and exit (no GPU needed, nothing timed)")
    p.add_argument("--cpu-check", action="store_true",
                   help="run end to end on CPU (needs TRITON_INTERPRET=1; tiny sizes, timings meaningless)")
    return p


def _dry_run(args) -> int:
    from numasched import mappings as M

    from .common import print_plan

    sizes = {"prefill": PREFILL, "decode": DECODE, "gemm": GEMM}
    registry = {"prefill": "attention", "decode": "decode", "gemm": "gemm"}
    lines, contenders = [], []
    for kind in args.kinds:
        for case in (sizes[kind][:1] if args.quick else sizes[kind]):
            lines.append(f"{case[0]}" + (f" (topology {args.topology})" if args.topology else ""))
        contenders.append(f"{kind}: every {registry[kind]} policy: {', '.join(M.available(registry[kind]))}")
    if args.l2:
        contenders.append("--l2: each under Nsight Compute (L2 hit rate, DRAM bytes, kernel time)")
    return print_plan("policies", lines, contenders)


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.dry_run:
        return _dry_run(args)
    import importlib

    import torch

    from .common import check_runnable

    if (rc := check_runnable("policies", args.cpu_check)) is not None:
        return rc
    if args.l2:
        return _l2(args)
    from numasched import topology

    from .common import bench_ms, progress, write_results

    DEV.update(device="cpu", dtype=torch.float32) if args.cpu_check else DEV.update(device="cuda", dtype=torch.bfloat16)
    if args.cpu_check:
        import time

        def bench_ms(fn):  # noqa: F811
            t = time.perf_counter()
            fn()
            return (time.perf_counter() - t) * 1e3
    if args.l2_worker:
        bench_ms = _profiled_once  # noqa: F811

    if args.topology:
        topology.set_current(args.topology)
    cases = {"prefill": (_prefill_cases, PREFILL, "numasched.attention"),
             "decode": (_decode_cases, DECODE, "numasched.decode"),
             "gemm": (_gemm_cases, GEMM, "numasched.gemm")}
    rows = []
    for kind in progress(args.kinds, "policies"):
        fn, sizes, module = cases[kind]
        try:
            importlib.import_module(module)
        except ImportError as e:
            print(f"skipping {kind}: {module} is not available ({e})")
            continue
        if args.cpu_check:
            sizes = DRY[kind]
        fn(sizes[:1] if args.quick else sizes, bench_ms, rows)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    if args.l2_worker:   # the launcher matches these rows with ncu's kernels, in order
        import json

        with open(args.l2_worker, "w") as f:
            json.dump([{k: r[k] for k in ("kind", "size", "policy", "auto")} for r in rows], f)
        return 0
    for size in dict.fromkeys(r["size"] for r in rows):
        sub = [r for r in rows if r["size"] == size]
        best = min(r["ms"] for r in sub)
        ref = next((r["ms"] for r in sub if r["policy"] == r["auto"]), None)
        for r in sub:
            r["x_best"] = best / r["ms"]
            r["x_auto"] = ref / r["ms"] if ref else None
    cols = ["kind", "size", "policy", "ms", "rate", "unit", "x_auto", "x_best", "auto"]
    paths = write_results("policies", rows, columns=cols, plot=_plot, out_dir=args.out_dir,
                          meta=dict(topology=topology.current().name,
                                    note="x_auto / x_best: time of auto's pick (of the fastest) / this time"))
    print("written:", ", ".join(str(v) for v in paths.values()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
