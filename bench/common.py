"""Shared benchmark plumbing: timing, measured limits, environment record, table/CSV/PNG output.

Every suite measures numasched side by side with its peers in one run, reports ratios and the
fraction of a *measured* limit (streaming-read bandwidth, cuBLAS rate, link bandwidth), and writes
its rows with the device, date and versions under bench/results/.
"""
from __future__ import annotations

import csv
import datetime as _dt
import json
import os
import platform
from pathlib import Path
from typing import Callable, Iterable, List, Optional

RESULTS_DIR = Path(os.environ.get("NUMASCHED_RESULTS_DIR", Path(__file__).resolve().parent / "results"))


def env_info() -> dict:
    """Device, date and versions for a results file."""
    import torch
    import triton

    info = {
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
    }
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        info.update(device=p.name, sms=p.multi_processor_count, l2_bytes=getattr(p, "L2_cache_size", 0),
                    cuda=torch.version.cuda, gpus=torch.cuda.device_count())
    else:
        info.update(device="cpu")
    return info


def device_slug() -> str:
    import torch

    if not torch.cuda.is_available():
        return "cpu"
    n = torch.cuda.get_device_name(0).lower()
    for k in ("h200", "h100", "b200", "a100", "mi300x", "mi355x"):
        if k in n:
            return k
    return n.replace(" ", "_")[:24]


def bench_ms(fn: Callable[[], object], *, warmup: int = 25, rep: int = 100) -> float:
    """Median time in ms of ``fn`` on the GPU (CUDA events; triton's do_bench, median)."""
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))


def bench_fixed_ms(fn: Callable[[], object], *, warmup: int = 5, iters: int = 20, calls: int = 1) -> float:
    """Median ms per call over a fixed iteration count (safe with collectives: every rank runs the
    same count). Each sample times ``calls`` calls queued back to back: with 1, the host's launch
    work before the first kernel counts (an eager call on an idle GPU); with several, it overlaps
    the previous call's kernels as in a steady stream of calls."""
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(calls):
            fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / calls)
    times.sort()
    return times[len(times) // 2]


def warm_up_for_capture(fn: Callable[[], object], times: int = 1) -> None:
    """Run ``fn`` on a side stream and wait for it, as torch asks before a CUDA-graph capture."""
    import torch

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(times):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()


def capture(fn: Callable[[], object]):
    """One call of ``fn`` recorded in a CUDA graph (warm it up first); replay with ``.replay()``."""
    import torch

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    torch.cuda.synchronize()
    return graph


def graph_replay_ms(fn: Callable[[], object], *, warmup: int = 10, iters: int = 200) -> float:
    """Median ms of replaying a CUDA graph that holds one call of ``fn`` (warmed up first): the
    call's GPU time, without the host's launch work."""
    warm_up_for_capture(fn, 2)
    return bench_fixed_ms(capture(fn).replay, warmup=warmup, iters=iters)


_LIMITS: dict = {}


def stream_read_bw() -> float:
    """Measured streaming-read bandwidth (bytes/s): torch sum over 1 GiB of fp32 (cached per process)."""
    import torch

    if "read" not in _LIMITS:
        x = torch.rand(256 * 1024 * 1024, device="cuda")
        ms = bench_ms(lambda: x.sum(), warmup=10, rep=50)
        _LIMITS["read"] = x.numel() * 4 / (ms * 1e-3)
        del x
    return _LIMITS["read"]


def matmul_rate(n: int = 8192) -> float:
    """Measured bf16 cuBLAS rate (FLOP/s) at n^3 on random data (cached per process)."""
    import torch

    key = f"mm{n}"
    if key not in _LIMITS:
        a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
        ms = bench_ms(lambda: a @ b)
        _LIMITS[key] = 2 * n**3 / (ms * 1e-3)
    return _LIMITS[key]


def progress(iterable: Iterable, description: str, total: Optional[int] = None):
    """A rich progress bar over ``iterable``."""
    from rich.progress import track

    return track(iterable, description=description, total=total, transient=False)


def write_results(suite: str, rows: List[dict], *, columns: Optional[List[str]] = None,
                  plot: Optional[Callable] = None, out_dir: Optional[Path] = None, meta: Optional[dict] = None,
                  gpus: int = 1) -> dict:
    """Print a table, write CSV + JSON metadata (+ PNG if ``plot(rows, path)`` is given). Returns the paths.
    Files are named ``<suite>-<device>-<date>``; a multi-GPU run (``gpus`` > 1) names the device
    ``<gpus>x<device>`` so runs on different world sizes never overwrite each other."""
    from rich.console import Console
    from rich.table import Table

    out_dir = Path(out_dir or RESULTS_DIR)
    out_dir.mkdir(parents=True, exist_ok=True)
    info = env_info()
    if meta:
        info.update(meta)
    dev = device_slug() if gpus <= 1 else f"{gpus}x{device_slug()}"
    stem = f"{suite}-{dev}-{info['date'][:10]}"
    columns = columns or (list(rows[0].keys()) if rows else [])
    table = Table(title=f"{suite} on {info.get('device')} ({info['date']}, torch {info['torch']}, triton {info['triton']})")
    for c in columns:
        table.add_column(c)
    for r in rows:
        table.add_row(*[_fmt(r.get(c)) for c in columns])
    Console(width=200).print(table)
    paths = {"csv": out_dir / f"{stem}.csv", "json": out_dir / f"{stem}.json"}
    with open(paths["csv"], "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=columns, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
    paths["json"].write_text(json.dumps({"env": info, "rows": rows}, indent=1, default=str))
    if plot is not None and rows:
        import matplotlib

        matplotlib.use("Agg")
        paths["png"] = out_dir / f"{stem}.png"
        plot(rows, paths["png"])
    return paths


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return "" if v is None else str(v)


def check_runnable(suite: str, dry_run: bool) -> Optional[int]:
    """None if the suite can run here; else print why and return the exit code (2).

    A suite needs a CUDA GPU, or ``--dry-run`` under TRITON_INTERPRET=1 (Triton reads it at import)."""
    import sys

    import torch

    if dry_run and os.environ.get("TRITON_INTERPRET") != "1":
        print("--dry-run needs TRITON_INTERPRET=1 in the environment (triton reads it at import)", file=sys.stderr)
        return 2
    if not torch.cuda.is_available() and not dry_run:
        print(f"numasched bench {suite} needs a CUDA GPU (or --dry-run)", file=sys.stderr)
        return 2
    return None
