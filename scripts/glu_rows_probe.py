"""matmul_swiglu at decode sizes with A's partial last tile row read two ways (one GPU, CUDA graphs).

The split-K kernel reads A's last tile row through pointers where it is under 3/4 full
(``options.gemm_splitk_operands="auto"``, gemm_schedule.splitk_operands); "tma" reads every row
through the descriptor. For the Llama-3-8B MLP at TP 1 and TP 2 (gate/up 4096 -> 2 x 14336 and
2 x 7168) and M = 24-200 rows, each call checked against float64 (output poisoned first), then
timed in CUDA-graph replays beside torch's GEMM + silu * up. Writes a CSV (``--csv``) and prints
a table. Run: python3 scripts/glu_rows_probe.py [--ms 32,40,...] [--csv FILE]
"""
import argparse
import csv

import torch
import torch.nn.functional as F

import numasched
from numasched import options

from numasched.bench.common import graph_replay_ms

SHAPES = {"llama3-8b tp1": (4096, 14336), "llama3-8b tp2": (4096, 7168)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ms", default="24,32,40,48,64,72,80,96,100,128,140,200")
    ap.add_argument("--csv", default=None)
    ap.add_argument("--forms", action="store_true",
                    help="instead: the SwiGLU GEMM's other forms at these rows (the 512-row tiles, the WS kernel, "
                         "numasched.matmul then numasched.swiglu) beside the automatic plan and torch")
    args = ap.parse_args()
    if args.forms:
        return forms(args)
    rows = []
    for name, M, n, H, x, w, ref in _points(args.ms):
        row = {"shape": name, "M": M, "n": n, "K": H}
        for mode in ("auto", "tma"):
            with options.use(gemm_splitk_operands=mode):
                out = torch.full((M, n), float("nan"), device="cuda", dtype=torch.bfloat16)
                numasched.matmul_swiglu(x, w.t(), out=out)
                err = ((out.double() - ref).abs().max() / ref.abs().max()).item()
                assert err < 2e-2, (name, M, mode, err)
                row[f"{mode}_us"] = 1e3 * graph_replay_ms(lambda: numasched.matmul_swiglu(x, w.t(), out=out))
        row["torch_us"] = 1e3 * graph_replay_ms(lambda: (lambda g: F.silu(g[:, :n]) * g[:, n:])(x @ w.t()))
        row["tma_over_auto"] = row["tma_us"] / row["auto_us"]
        rows.append(row)
        print(f"{name:14s} M={M:4d}  auto {row['auto_us']:7.2f} us  tma {row['tma_us']:7.2f}  "
              f"torch {row['torch_us']:7.2f}  tma/auto {row['tma_over_auto']:.3f}", flush=True)
    _write(rows, args.csv)
    return 0


def _points(ms: str):
    """(shape, M, n, K, x, w, float64 reference) of every shape and M: fresh random operands."""
    for name, (H, n) in SHAPES.items():
        w = torch.randn(2 * n, H, device="cuda", dtype=torch.bfloat16) / H ** 0.5
        for M in (int(m) for m in ms.split(",")):
            x = torch.randn(M, H, device="cuda", dtype=torch.bfloat16)
            gu = x.double() @ w.double().t()
            yield name, M, n, H, x, w, F.silu(gu[:, :n]) * gu[:, n:]


def _write(rows, path) -> None:
    if path:
        with open(path, "w", newline="") as f:
            wr = csv.DictWriter(f, fieldnames=list(rows[0]))
            wr.writeheader()
            wr.writerows(rows)


def forms(args) -> int:
    from numasched import gemm_glu

    rows = []
    for name, M, n, H, x, w, ref in _points(args.ms):
        out = torch.full((M, n), float("nan"), device="cuda", dtype=torch.bfloat16)
        big = gemm_glu.plan_matmul_swiglu(x, w.t(), out, schedule=gemm_glu.GLU_BIG_SCHEDULE)
        calls = {
            "auto": lambda: numasched.matmul_swiglu(x, w.t(), out=out),
            "big_tiles": lambda: big.run(x, w.t(), out),
            "matmul_then_swiglu": lambda: numasched.swiglu(numasched.matmul(x, w.t()), out=out),
        }
        row = {"shape": name, "M": M, "n": n, "K": H}
        for key, fn in calls.items():
            out.fill_(float("nan"))
            fn()
            err = ((out.double() - ref).abs().max() / ref.abs().max()).item()
            assert err < 2e-2, (name, M, key, err)
            row[key + "_us"] = 1e3 * graph_replay_ms(fn)
        with options.use(glu_ws=True):
            out.fill_(float("nan"))
            numasched.matmul_swiglu(x, w.t(), out=out)
            err = ((out.double() - ref).abs().max() / ref.abs().max()).item()
            assert err < 2e-2, (name, M, "ws", err)
            row["ws_us"] = 1e3 * graph_replay_ms(lambda: numasched.matmul_swiglu(x, w.t(), out=out))
        row["torch_us"] = 1e3 * graph_replay_ms(lambda: (lambda g: F.silu(g[:, :n]) * g[:, n:])(x @ w.t()))
        rows.append(row)
        print(f"{name:14s} M={M:4d} " + "  ".join(f"{k[:-3]} {v:7.2f}" for k, v in row.items() if k.endswith("_us")),
              flush=True)
    _write(rows, args.csv)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
