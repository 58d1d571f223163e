"""Shared benchmark plumbing: timing, measured limits, environment record, table/CSV/PNG output.

Every suite measures numasched side by side with its peers in one run, reports ratios and the
fraction of a *measured* limit (streaming-read bandwidth, cuBLAS rate, link bandwidth), and writes
its rows with the device, date and versions to the results folder.

Results folder (:func:`results_dir`), first match wins:

1. the suite's ``--out-dir DIR``;
2. the environment variable ``NUMASCHED_RESULTS_DIR``;
3. ``./bench/results`` if that folder exists in the current working directory: run from the root
   of a numasched checkout, results land beside the committed ones (bench/results/);
4. ``./bench-results`` in the current working directory (created on first use).

Relative paths are taken from the current working directory when a suite writes. Results never go
into the installed package (site-packages/numasched/bench), whatever the install.

rich (tables, progress bars) and matplotlib (PNG plots) are optional (``pip install
'numasched[cli]'``): without rich the tables print as plain text, without matplotlib no PNG is
written (a note says so).
"""
from __future__ import annotations

import csv
import datetime as _dt
import json
import os
import platform
from pathlib import Path
from typing import Callable, Iterable, List, Optional

from numasched.probe.bandwidth import stream_read_bw  # noqa: F401  (measured read bandwidth; lives with the probe)


def results_dir(out_dir=None) -> Path:
    """The folder results go to (the rule in the module doc); not created here."""
    if out_dir:
        return Path(out_dir).expanduser()
    env = os.environ.get("NUMASCHED_RESULTS_DIR")
    if env:
        return Path(env).expanduser()
    repo = Path.cwd() / "bench" / "results"
    return repo if repo.is_dir() else Path.cwd() / "bench-results"


def compact_png(path) -> bool:
    """Rewrite the PNG at ``path`` with a palette of at most 256 colours (plots have a few dozen):
    about a third of the bytes, so the committed results stay small enough to travel with the
    working tree to a GPU machine. Returns False (file left as it is) when it already has a
    palette or Pillow (matplotlib's own dependency) is missing."""
    try:
        from PIL import Image
    except ImportError:   # pragma: no cover - matplotlib always brings Pillow
        return False
    with Image.open(path) as im:
        if im.mode == "P":
            return False
        q = im.convert("RGB").quantize(colors=256, method=Image.Quantize.MEDIANCUT, dither=Image.Dither.NONE)
    q.save(path, format="PNG", optimize=True)
    return True


def save_plot(fig, path) -> None:
    """``fig.savefig(path)`` at 120 dpi, then :func:`compact_png`."""
    fig.savefig(path, dpi=120)
    compact_png(path)


def __getattr__(name):
    # RESULTS_DIR: the default results folder, resolved when read (the working directory of the run)
    if name == "RESULTS_DIR":
        return results_dir()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


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
    try:   # the options plans were made under (e.g. NUMASCHED_AUTOTUNE=0, NUMASCHED_PDL=0 runs)
        import dataclasses

        from numasched import options

        info["numasched_options"] = {k: v for k, v in dataclasses.asdict(options.current()).items()
                                     if not k.startswith("_")}
    except Exception:  # noqa: BLE001 - a results file without it is still a results file
        pass
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


FLUSH_MODES = ("zero", "read")
# as triton's do_bench: more than a Hopper L2 (H100 50 MiB, H200 60 MiB); no more than an MI300X's
# 256 MB Infinity Cache (not measured: no AMD GPU)
FLUSH_BYTES = 256 << 20
_flush_buf: dict = {}


def _read_flush(device) -> Callable[[], object]:
    """A read of FLUSH_BYTES that leaves the L2 full of *clean* lines (none of the timed call's
    data, nothing to write back)."""
    import torch

    buf = _flush_buf.get(device)
    if buf is None:
        buf = _flush_buf[device] = torch.ones(FLUSH_BYTES // 4, dtype=torch.int32, device=device)
    sink = torch.empty((), dtype=torch.int64, device=device)
    return lambda: torch.sum(buf, dim=0, out=sink)


def bench_ms(fn: Callable[[], object], *, warmup: int = 25, rep: int = 100, flush: str = "zero") -> float:
    """Median time in ms of ``fn`` on the GPU, each call timed alone with CUDA events after an L2
    flush; ``warmup`` and ``rep`` are milliseconds (as triton's do_bench).

    flush="zero": triton's do_bench, whose flush *writes* 256 MB (``cache.zero_()``): the timed
    call starts with the whole L2 dirty, and its first L2-size of reads also writes those lines
    back (an H200's 60 MiB: about 9 us of every contender's time from 134 MB of reads,
    bench/results/decode-s52/flush-*).
    flush="read": the flush *reads* 256 MB instead, so the call starts with a cold L2 of clean
    lines, as in a model's step, where the kernels before attention stream weights."""
    if flush not in FLUSH_MODES:
        raise ValueError(f"flush: one of {FLUSH_MODES}, got {flush!r}")
    if flush == "zero":
        import triton.testing

        return float(triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))
    import torch

    clear = _read_flush(torch.device("cuda", torch.cuda.current_device()))
    fn()
    torch.cuda.synchronize()
    st, en = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    st.record()
    for _ in range(5):
        clear()
        fn()
    en.record()
    torch.cuda.synchronize()
    est = max(st.elapsed_time(en) / 5, 1e-3)
    for _ in range(max(1, int(warmup / est))):
        fn()
    n = max(1, int(rep / est))
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
    for i in range(n):
        clear()
        starts[i].record()
        fn()
        ends[i].record()
    torch.cuda.synchronize()
    times = sorted(s.elapsed_time(e) for s, e in zip(starts, ends))
    return float(times[len(times) // 2])


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


def dist_graph_us(fn: Callable[[], object], *, calls: int = 5, iters: int = 15) -> float:
    """Microseconds per call of ``fn`` replayed from a CUDA graph of ``calls`` calls, the slowest
    rank's median of ``iters`` replays (every rank of the default process group calls it)."""
    import torch
    import torch.distributed as dist

    warm_up_for_capture(fn, 2)
    dist.barrier()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            fn()
    torch.cuda.synchronize()
    dist.barrier()
    us = bench_fixed_ms(g.replay, warmup=3, iters=iters) * 1e3 / calls
    x = torch.tensor([us], device="cuda")
    dist.all_reduce(x, op=dist.ReduceOp.MAX)
    return float(x)


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
    """A rich progress bar over ``iterable`` (the plain iterable when rich is not installed)."""
    try:
        from rich.progress import track
    except ImportError:
        return iterable
    return track(iterable, description=description, total=total, transient=False)


def text_table(title: str, columns: List[str], rows: List[dict]) -> str:
    """``rows`` as a plain-text table (what the .log files hold, and the screen without rich)."""
    cells = [[_fmt(r.get(c)) for c in columns] for r in rows]
    widths = [max([len(c)] + [len(r[i]) for r in cells]) for i, c in enumerate(columns)]
    line = lambda cs: "  ".join(c.ljust(w) for c, w in zip(cs, widths)).rstrip()  # noqa: E731
    return "\n".join([title, line(columns), "  ".join("-" * w for w in widths)] + [line(r) for r in cells])


def write_results(suite: str, rows: List[dict], *, columns: Optional[List[str]] = None,
                  plot: Optional[Callable] = None, out_dir: Optional[Path] = None, meta: Optional[dict] = None,
                  gpus: int = 1, log: Optional[str] = None) -> dict:
    """Print a table, write CSV + JSON metadata (+ PNG if ``plot(rows, path)`` is given and
    matplotlib is installed; + ``.log`` holding the table as text and ``log`` after it, if ``log``
    is given). Returns the paths. Files are named ``<suite>-<device>-<date>`` in
    :func:`results_dir`; a multi-GPU run (``gpus`` > 1) names the device ``<gpus>x<device>`` so
    runs on different world sizes never overwrite each other."""
    out_dir = results_dir(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    info = env_info()
    if meta:
        info.update(meta)
    dev = device_slug() if gpus <= 1 else f"{gpus}x{device_slug()}"
    stem = f"{suite}-{dev}-{info['date'][:10]}"
    columns = columns or (list(rows[0].keys()) if rows else [])
    title = f"{suite} on {info.get('device')} ({info['date']}, torch {info['torch']}, triton {info['triton']})"
    text = text_table(title, columns, rows)
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        print(text, flush=True)
    else:
        table = Table(title=title)
        for c in columns:
            table.add_column(c)
        for r in rows:
            table.add_row(*[_fmt(r.get(c)) for c in columns])
        Console(width=200).print(table)
    paths = {"csv": out_dir / f"{stem}.csv", "json": out_dir / f"{stem}.json"}
    if log is not None:
        paths["log"] = out_dir / f"{stem}.log"
        paths["log"].write_text(text + "\n" + (log + "\n" if log else ""))
    with open(paths["csv"], "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=columns, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
    paths["json"].write_text(json.dumps({"env": info, "rows": rows}, indent=1, default=str))
    if plot is not None and rows:
        try:
            import matplotlib
        except ImportError:
            print("no PNG plot: matplotlib is not installed (pip install 'numasched[cli]')", flush=True)
        else:
            matplotlib.use("Agg")
            paths["png"] = out_dir / f"{stem}.png"
            plot(rows, paths["png"])
    return paths


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return "" if v is None else str(v)


def check_runnable(suite: str, cpu_check: bool = False) -> Optional[int]:
    """None if the suite can run here; else print one line saying why (stderr) and return the
    exit code, 2.

    A suite needs a CUDA GPU, or (suites with ``--cpu-check``) TRITON_INTERPRET=1 in the
    environment for a run end to end in Triton's interpreter (Triton reads it at import)."""
    import sys

    import torch

    if cpu_check and os.environ.get("TRITON_INTERPRET") != "1":
        print("--cpu-check needs TRITON_INTERPRET=1 in the environment (triton reads it at import)", file=sys.stderr)
        return 2
    if not torch.cuda.is_available() and not cpu_check:
        print(f"numasched bench {suite} needs a CUDA GPU (found none); --dry-run shows what it would run",
              file=sys.stderr)
        return 2
    return None


def print_plan(suite: str, lines: List[str], contenders: List[str]) -> int:
    """What ``--dry-run`` prints: the planned points and contenders; returns exit code 0."""
    print(f"numasched bench {suite} --dry-run: {len(lines)} point(s), nothing timed")
    for line in lines:
        print(f"  {line}")
    print("contenders:")
    for c in contenders:
        print(f"  {c}")
    return 0


def init_rank(timeout_s: float = 600.0) -> tuple:
    """This torchrun rank's GPU (``LOCAL_RANK``) and its NCCL process group; returns (rank, world).
    ``timeout_s``: NCCL's watchdog, set above any watchdog of the caller's that says what hung."""
    import torch
    import torch.distributed as dist

    local = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", timeout=_dt.timedelta(seconds=timeout_s), device_id=torch.device("cuda", local))
    return dist.get_rank(), dist.get_world_size()


def sweep_timer(ctx, out, ref, line: list, res: Optional[dict] = None) -> Callable:
    """A ``timed(name, fn, check=None)`` for the distributed sweeps (scripts/mar_sweep.py,
    scripts/rs_ws_sweep.py): ``fn``'s time in CUDA-graph replays (dist_graph_us, the slowest
    rank's), ``ctx``'s status read after it; ``check`` (optional) runs once with ``out`` poisoned
    and its result is compared with ``ref`` (a float64 tensor). Appends "name us [err e]" (or the
    error) to ``line`` and the time to ``res[name]``."""
    import torch

    def timed(name, fn, check=None):
        try:
            t = dist_graph_us(fn, calls=3, iters=10)
            ctx.check("sweep")
            err = ""
            if check is not None:
                out.fill_(float("nan"))
                got = check()
                torch.cuda.synchronize()
                err = f" err {((got.double() - ref).norm() / ref.norm()).item():.1e}"
            if res is not None:
                res[name] = t
            line.append(f"{name} {t:.1f}{err}")
        except Exception as e:  # noqa: BLE001 - a sweep records a form's failure and goes on
            line.append(f"{name} ERR {type(e).__name__}: {str(e)[:120]}")

    return timed
