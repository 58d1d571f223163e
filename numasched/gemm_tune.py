"""``numasched tune-gemm``: time GEMM schedules on this GPU and write a table the chooser consults.

The schedule chooser (numasched.gemm_schedule) picks from a model with no tuning at run time.
Where a deployment knows its shapes, this command times, per shape, the model's pick and the next
``--top`` schedules by the model's estimate (each in a CUDA graph of calls that read their own
copy of the weight, so the weight comes from HBM), and writes the fastest into a JSON table.
Point the options at it and the chooser takes the table's entry for those shapes:

    numasched tune-gemm --shapes 1x4096x4096,16x14336x4096 --out gemm-table.json
    NUMASCHED_GEMM_TABLE=gemm-table.json python serve.py     # or options.set(gemm_table=...)

Tuning happens when this command runs, never inside a call.
"""
from __future__ import annotations

import argparse
import itertools
import json
import math
import sys
import time

__all__ = ["tune", "graph_us", "linear_operands", "baseline_us", "checked_us", "explain", "add_parser",
           "add_plan_parser"]

WARM_S = 0.02   # graph_us: seconds of replays before the timed ones


def graph_us(fn_i, copies: int, calls: int) -> float:
    """Median microseconds per call over replays of a CUDA graph of ``calls`` calls, call i using
    input copy ``i mod copies`` (warmed up, compiled and first-use buffers made outside capture)."""
    import torch

    for i in range(copies):
        fn_i(i)
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn_i(0)
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(calls):
            fn_i(i % copies)
    # replay for at least WARM_S first: a timing of a few ms right after the host-side gap
    # between points (allocations, planning, capture) may catch the GPU's clocks ramping up (on the
    # H200 the first contender timed at a point, the chooser's pick, ran up to 1.46x a near-identical
    # schedule timed after it at M = 1-2; bench/results/gemm-tie-full/)
    t0 = time.perf_counter()
    while True:
        g.replay()
        torch.cuda.synchronize()
        if time.perf_counter() - t0 >= WARM_S:
            break
    times = []
    for _ in range(7):
        st, en = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        st.record()
        g.replay()
        en.record()
        en.synchronize()
        times.append(st.elapsed_time(en) * 1e3 / calls)
    times.sort()
    return times[len(times) // 2]


def stream_copies(nbytes: int, l2_bytes: int) -> int:
    """Copies of a weight of ``nbytes`` that calls reading them in turn stream from HBM: more than
    twice ``l2_bytes`` in all, at least two."""
    return max(2, math.ceil(2 * l2_bytes / max(1, nbytes)) + 1)


def linear_operands(M: int, N: int, K: int, dtype=None, device=None):
    """(x, ws, outs, ref, copies) for timing ``y = x @ W.T`` as a model's layer runs it: x (M, K),
    enough copies of a weight W (N, K) (scaled by 1 / sqrt(K)) that a graph of calls, call i
    reading copy i mod copies, streams them from HBM (more than twice the L2), one output per
    copy, and the float64 product of x and the first copy."""
    import torch

    device = device or torch.device("cuda")
    dtype = dtype or torch.bfloat16
    l2 = torch.cuda.get_device_properties(device).L2_cache_size
    copies = stream_copies(N * K * torch.empty((), dtype=dtype).element_size(), l2)
    ws = [torch.randn(N, K, device=device, dtype=dtype) / K ** 0.5 for _ in range(copies)]
    x = torch.randn(M, K, device=device, dtype=dtype)
    outs = [torch.empty(M, N, device=device, dtype=dtype) for _ in range(copies)]
    return x, ws, outs, x.double() @ ws[0].double().T, copies


def baseline_us(x, ws, outs, copies: int, calls: int):
    """({"cublas": us, "pick": us}, the chooser's plan) of ``linear_operands``' product: torch.matmul
    and numasched's own pick, each in CUDA graphs of ``calls`` calls (graph_us)."""
    import torch

    import numasched

    pick = numasched.plan_matmul(x, ws[0].T, outs[0])
    return ({"cublas": graph_us(lambda i: torch.matmul(x, ws[i].T, out=outs[i]), copies, calls),
             "pick": graph_us(lambda i: pick.run(x, ws[i].T, outs[i]), copies, calls)}, pick)


def checked_us(plan, x, ws, outs, ref, copies: int, calls: int) -> float:
    """``plan.run(x, w.T, out)``'s graph_us time over ``linear_operands``' copies, after one call
    into a poisoned output checked against ``ref`` (AssertionError beyond 1e-2 relative)."""
    outs[0].fill_(float("nan"))
    plan.run(x, ws[0].T, outs[0])
    err = ((outs[0].double() - ref).abs().max() / ref.abs().max()).item()
    if not err < 1e-2:
        raise AssertionError(f"relative error {err:.2e}")
    return graph_us(lambda i: plan.run(x, ws[i].T, outs[i]), copies, calls)


def tune(shapes, *, top: int = 6, calls: int = 20, dtype=None, log=print) -> dict:
    """{table key: schedule fields} of the fastest timed schedule for each (M, N, K), with
    ``y = x @ W.T`` operands (W (N, K) row-major, as a linear layer holds it)."""
    import torch

    import numasched
    from numasched import gemm_schedule as GS

    dtype = dtype or torch.bfloat16
    dev = torch.device("cuda")
    machine = GS.Machine.of(dev)
    elt = torch.empty((), dtype=dtype).element_size()
    l2 = torch.cuda.get_device_properties(dev).L2_cache_size
    table = {}
    for m, n, k in shapes:
        copies = max(2, min(64, math.ceil(2 * l2 / (n * k * elt))))
        x = torch.randn(m, k, device=dev, dtype=dtype)
        ws = [torch.randn(n, k, device=dev, dtype=dtype) for _ in range(copies)]
        outs = [torch.empty(m, n, device=dev, dtype=dtype) for _ in range(copies)]
        own = numasched.plan_matmul(x, ws[0].T, outs[0])
        tma = own.path == "tma" or own.kernel in ("tiled", "ws")

        def by_model(use_ws):
            opts = numasched.options.current()
            return [s for _, s in GS.ranked(m, n, k, elt, machine, splitk_only=not tma, ws=use_ws,
                                            tail=opts.gemm_tail_split, ws_swap=use_ws and opts.gemm_ws_swap,
                                            wide3=use_ws)]   # (three-box widths: tuned, not chosen)
        ranked = [own.schedule]
        if own.kernel == "ws":   # the chooser took the WS widths: time them and the Triton schedules in turn
            ranked += [s for pair in itertools.zip_longest(by_model(True), by_model(False)) for s in pair]
        else:
            ranked += by_model(False)
        seen, best = set(), None
        for s in ranked:
            if s is None or s.describe() in seen or len(seen) > top:
                continue
            seen.add(s.describe())
            try:
                plan = numasched.plan_matmul(x, ws[0].T, outs[0], schedule=s)
                t = graph_us(lambda i, plan=plan: plan._run(x, ws[i].T, outs[i]), copies, calls)
            except Exception as e:  # a schedule that does not run here is skipped, and said
                log(f"{m}x{n}x{k}: {s.describe()} skipped ({type(e).__name__}: {str(e)[:120]})")
                continue
            if best is None or t < best[0]:
                best = (t, s)
        if best is not None:
            key, val = GS.table_entry(m, n, k, dtype, machine.name, best[1])
            val["measured_us"] = round(best[0], 3)
            table[key] = val
            log(f"{m}x{n}x{k}: {best[1].describe()} {best[0]:.2f} us (model's pick: "
                f"{own.schedule.describe() if own.schedule else own.kernel})")
        del ws, outs
    return table


def add_parser(sub) -> argparse.ArgumentParser:
    from .argtypes import nonneg_int, out_file, positive_int, shape_list

    p = sub.add_parser("tune-gemm", help="time GEMM schedules for a list of shapes into a table the chooser consults",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", type=shape_list, required=True, help="comma-separated MxNxK, or @FILE of them (y = x @ W.T, W is N x K)")
    p.add_argument("--out", type=out_file, required=True,
                   help="JSON table to write (merged into an existing one); its folder must exist")
    p.add_argument("--top", type=nonneg_int, default=6, help="schedules timed besides the model's pick (default 6)")
    p.add_argument("--calls", type=positive_int, default=20, help="calls per CUDA graph (default 20)")
    p.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16", help="operand dtype (default bf16)")
    p.add_argument("--dry-run", action="store_true", help="print the shapes and exit (no GPU needed)")
    p.set_defaults(func=_cli)
    return p


def _cli(args) -> int:
    if args.dry_run:
        print(f"numasched tune-gemm --dry-run: {len(args.shapes)} shape(s), nothing timed; table -> {args.out}")
        for m, n, k in args.shapes:
            print(f"  {m}x{n}x{k} {args.dtype}: the model's pick and the next {args.top} schedules")
        return 0
    import torch

    if not torch.cuda.is_available():
        print("numasched tune-gemm needs a CUDA GPU (found none); --dry-run shows what it would time",
              file=sys.stderr)
        return 2
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    table = tune(args.shapes, top=args.top, calls=args.calls, dtype=dtype)
    data = {"schedules": {}}
    try:
        with open(args.out) as f:
            old = json.load(f)
        if isinstance(old, dict) and isinstance(old.get("schedules"), dict):
            data = old
    except (OSError, ValueError):
        pass
    data["schedules"].update(table)
    data["note"] = "numasched tune-gemm: fastest timed schedule per shape; consulted by the chooser first"
    with open(args.out, "w") as f:
        json.dump(data, f, indent=1, sort_keys=True)
    print(f"wrote {len(table)} schedule(s) to {args.out}")
    return 0


# ----------------------------------------------------------------------------- numasched plan-gemm
PLAN_MACHINES = ("h100", "h200", "mi300x", "mi355x")


def explain(M: int, N: int, K: int, machine: str = "h200", dtype: str = "bf16", top: int = 5) -> dict:
    """What the chooser makes of ``y = x @ W.T`` (x M x K, W N x K, contiguous) on ``machine`` (a
    key of gemm_schedule's known GPUs), with no GPU: the pick as ``numasched.matmul`` takes it
    with the default options where the rows are 16-byte aligned (TMA; the warp-specialised kernel
    on the Hopper parts at 16 bits), its estimate, the next ``top`` candidates by estimate and
    the floors (operands read and output written once at the streaming rate; the flops at the
    dense 16-bit tensor rate). Rows that are not 16-byte aligned are shown as the pointer kernels take
    them; the per-call copies of an odd K (options.gemm_pad_k) and a tuned table are not."""
    from . import gemm_schedule as GS

    if machine not in PLAN_MACHINES:
        raise ValueError(f"machine must be one of {PLAN_MACHINES}, got {machine!r}")
    elt = {"bf16": 2, "fp16": 2, "fp32": 4}.get(dtype)
    if elt is None:
        raise ValueError(f"dtype must be bf16, fp16 or fp32, got {dtype!r}")
    for name, v in (("M", M), ("N", N), ("K", K)):
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a positive int, got {v!r}")
    mach = GS._KNOWN[machine]
    aligned = (K * elt) % 16 == 0
    tma = aligned
    ws = elt == 2 and aligned and (N * elt) % 16 == 0 and machine in ("h100", "h200")
    pick = GS._choose(M, N, K, elt, mach, not tma, tma, aligned, True, ws, ws)
    ranked = GS.ranked(M, N, K, elt, mach, splitk_only=not tma or elt > 2, tail=True, ws=ws, splitk_tma=tma,
                       aligned=aligned, ws_swap=ws)
    if not aligned:
        ranked = [(t, s) for t, s in ranked if s.block_k <= GS.MISALIGNED_MAX_BLOCK_K]
    return dict(shape=(M, N, K), machine=mach.name, dtype=dtype, aligned=aligned, ws=ws, pick=pick.describe(),
                pick_us=pick.est_s * 1e6, floor_us=GS.streaming_floor_s(M, N, K, elt, mach) * 1e6,
                tensor_us=2.0 * M * N * K / mach.tensor_flops * 1e6,
                next=[(s.describe(), t * 1e6) for t, s in ranked if s.describe() != pick.describe()][:top])


def add_plan_parser(sub) -> argparse.ArgumentParser:
    from .argtypes import nonneg_int, shape_list

    p = sub.add_parser("plan-gemm", help="show the GEMM chooser's pick and its next candidates for shapes (no GPU)",
                       description="The schedule numasched.matmul's model picks for y = x @ W.T on a named GPU, "
                                   "its estimate and the next candidates, computed on this machine (no GPU, no "
                                   "timing): what `bench gemm_inference` would time beside the pick.")
    p.add_argument("--shapes", type=shape_list, required=True, help="comma-separated MxNxK, or @FILE of them")
    p.add_argument("--machine", choices=PLAN_MACHINES, default="h200", help="the GPU model (default h200)")
    p.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="bf16", help="operand dtype (default bf16)")
    p.add_argument("--top", type=nonneg_int, default=5, help="candidates shown after the pick (default 5)")
    p.set_defaults(func=_plan_cli)
    return p


def _plan_cli(args) -> int:
    for M, N, K in args.shapes:
        e = explain(M, N, K, args.machine, args.dtype, args.top)
        notes = ([] if e["aligned"] else ["rows not 16-byte aligned: pointer loads"]) + \
            (["WS kernel weighed"] if e["ws"] else [])
        print(f"{M} x {N} x {K} {e['dtype']} on {e['machine']}" + (f" ({'; '.join(notes)})" if notes else ""))
        print(f"  pick   {e['pick']:44s} {e['pick_us']:9.2f} us (model)   floors: bytes {e['floor_us']:.2f} us, "
              f"flops {e['tensor_us']:.2f} us")
        for desc, us in e["next"]:
            print(f"  next   {desc:44s} {us:9.2f} us")
    return 0
