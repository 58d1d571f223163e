"""``numasched report``: the main job.

1. The topology presets (what the library plans with).
2. The L2 simulator's prediction for MI300X-class GPUs next to the published results
   (no AMD GPU was available: these are predictions of the model, not measurements).
3. A kernel check: prefill attention, Flash Decode and GEMM, each under several mapping policies,
   against a float64 reference on fresh random inputs. On a CPU-only machine the kernels run in
   Triton's interpreter (small shapes); on a GPU they are compiled (larger shapes, bf16).
"""
from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
import time


def add_parser(sub) -> None:
    p = sub.add_parser("report", help="simulator report + kernel check (the main job)")
    p.add_argument("--full", action="store_true", help="the full simulator comparison (slower)")
    p.add_argument("--skip-sim", action="store_true", help="skip the simulator part")
    p.add_argument("--skip-kernels", action="store_true", help="skip the kernel check")
    p.set_defaults(func=run)


def _needs_interpreter() -> bool:
    import torch

    return not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1"


class _PlainConsole:
    """What report needs of rich's Console, as plain text (rich is optional: numasched[cli])."""

    def print(self, obj="") -> None:
        print(re.sub(r"\[/?(dim|red|bold)\]", "", obj) if isinstance(obj, str) else obj, flush=True)

    def rule(self, title: str = "") -> None:
        print(f"\n--- {title} ---", flush=True)


def _console():
    try:
        from rich.console import Console
    except ImportError:
        return _PlainConsole()
    return Console(width=160)


def _table(title: str, columns, rows):
    """A rich Table, or the same table as plain text when rich is not installed."""
    try:
        from rich.table import Table
    except ImportError:
        rows = [[re.sub(r"\[/?(dim|red|bold)\]", "", c) for c in r] for r in rows]
        widths = [max([len(c)] + [len(r[i]) for r in rows]) for i, c in enumerate(columns)]
        line = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths))  # noqa: E731
        return "\n".join([title, line(columns), "  ".join("-" * w for w in widths)] + [line(r) for r in rows])
    t = Table(title=title)
    for c in columns:
        t.add_column(c)
    for r in rows:
        t.add_row(*r)
    return t


def run(args) -> int:
    if not args.skip_kernels and _needs_interpreter():
        # Triton reads TRITON_INTERPRET when kernels are defined: run again in a process that has it.
        env = dict(os.environ, TRITON_INTERPRET="1")
        argv = [sys.executable, "-m", "numasched.cli", "report"] + [
            flag for flag, on in (("--full", args.full), ("--skip-sim", args.skip_sim)) if on]
        return subprocess.call(argv, env=env)
    console = _console()
    _topologies(console)
    status = 0
    if not args.skip_sim:
        from . import sim

        t0 = time.perf_counter()
        console.rule("L2 simulator: predicted locality on chiplet GPUs (model, not measurement)")
        console.print(sim.report(quick=not args.full))
        console.print(f"[dim]simulator part took {time.perf_counter() - t0:.1f} s[/dim]")
    if not args.skip_kernels:
        status |= _kernel_check(console)
    return status


def _topologies(console) -> None:
    from .topology import PRESETS

    rows = []
    for name in ("mi300x", "mi325x", "mi350x", "mi355x", "h100", "h200", "b200"):
        p = PRESETS[name]
        rows.append([name, str(p.num_domains), str(p.cus_per_domain), f"{p.l2_bytes >> 20} MB",
                     f"{p.llc_bytes >> 20} MB", f"{p.hbm_bytes_per_s / 1e12:.2f}", p.dispatch])
    console.print(_table("Topology presets", ("name", "domains", "CUs/domain", "L2/domain", "LLC", "HBM TB/s",
                                              "dispatch"), rows))


def _rel(out, ref) -> float:
    import torch

    return float(torch.linalg.vector_norm(out.double() - ref) / torch.linalg.vector_norm(ref))


def _kernel_check(console) -> int:
    """Each kernel vs float64, under several policies, on fresh random inputs; returns nonzero on failure."""
    import torch

    from . import topology
    from .attention import attention_forward
    from .decode import flash_decode
    from .gemm import matmul

    gpu = torch.cuda.is_available()
    dev = "cuda" if gpu else "cpu"
    dt = torch.bfloat16 if gpu else torch.float32  # the interpreter's bf16 dot is wrong (triton.md)
    tol = 2e-2 if gpu else 1e-4
    # shapes: real on GPU, tiny under the interpreter
    B, H, HK, S, D = (2, 32, 8, 2048, 128) if gpu else (1, 4, 2, 48, 64)
    M, N, K = (4096, 4096, 4096) if gpu else (70, 50, 40)
    g = torch.Generator(device="cpu").manual_seed(int(time.time()))
    rnd = lambda *s: torch.randn(*s, generator=g).to(dev, dt)  # noqa: E731

    rows, failed = [], 0
    console.rule(f"Kernel check on {'GPU ' + torch.cuda.get_device_name(0) if gpu else 'CPU (Triton interpreter)'}")
    for topo in ("current", "mi300x"):
        with (topology.use("mi300x") if topo == "mi300x" else contextlib.nullcontext()):
            q, k, v = rnd(B, H, S, D), rnd(B, HK, S, D), rnd(B, HK, S, D)
            for causal in (False, True):
                for mp in ("head_first", "swizzled_head_first", "block_first"):
                    t0 = time.perf_counter()
                    out, _ = attention_forward(q, k, v, causal=causal, mapping=mp)
                    ref = _ref_attention(q, k, v, causal)
                    rows.append(("prefill" + (" causal" if causal else ""), topo, mp, _rel(out, ref), time.perf_counter() - t0))
            kc, vc = rnd(B, S, HK, D), rnd(B, S, HK, D)
            qd = rnd(B, H, D)
            lens = torch.randint(1, S + 1, (B,), generator=g).to(dev, torch.int32)
            for mp in ("head_first", "swizzled_head_first"):
                t0 = time.perf_counter()
                out = flash_decode(qd, kc, vc, cache_seqlens=lens, mapping=mp)
                ref = _ref_decode(qd, kc, vc, lens)
                rows.append(("decode", topo, mp, _rel(out, ref), time.perf_counter() - t0))
            a, b = rnd(M, K), rnd(K, N)
            for mp in ("grouped", "chiplet_tiled", "row_major"):
                t0 = time.perf_counter()
                out = matmul(a, b, mapping=mp)
                ref = a.double() @ b.double()
                rows.append(("gemm", topo, mp, _rel(out, ref), time.perf_counter() - t0))
    cells = []
    for kern, topo, mp, err, sec in rows:
        ok = err < tol
        failed += not ok
        cells.append([kern, topo, mp, f"{err:.2e}", "yes" if ok else "[red]NO[/red]", f"{sec:.2f}"])
    console.print(_table(f"relative error vs float64 ({dt}, tolerance {tol:g})",
                         ("kernel", "topology", "mapping", "rel. error", "ok", "seconds"), cells))
    console.print("all kernel checks passed" if not failed else f"[red]{failed} kernel checks failed[/red]")
    return 1 if failed else 0


def _ref_attention(q, k, v, causal):
    import torch

    G = q.shape[1] // k.shape[1]
    qd, kd, vd = q.double(), k.double().repeat_interleave(G, 1), v.double().repeat_interleave(G, 1)
    s = qd @ kd.transpose(-1, -2) / q.shape[-1] ** 0.5
    if causal:
        Lq, Lk = s.shape[-2:]
        s = s.masked_fill(~torch.ones(Lq, Lk, dtype=torch.bool, device=s.device).tril(), float("-inf"))
    return torch.softmax(s, -1) @ vd


def _ref_decode(q, kc, vc, lens):
    import torch

    B, H, D = q.shape
    HK = kc.shape[2]
    out = torch.empty(B, H, D, dtype=torch.float64, device=q.device)
    for b in range(B):
        L = int(lens[b])
        kb = kc[b, :L].double().transpose(0, 1).repeat_interleave(H // HK, 0)  # (H, L, D)
        vb = vc[b, :L].double().transpose(0, 1).repeat_interleave(H // HK, 0)
        s = (q[b].double().unsqueeze(1) @ kb.transpose(-1, -2)).squeeze(1) / D**0.5
        out[b] = (torch.softmax(s, -1).unsqueeze(1) @ vb).squeeze(1)
    return out
