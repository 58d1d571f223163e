"""``numasched bench prefill``: prefill attention forward vs SDPA FLASH, cuDNN and EFFICIENT.

For each shape (batch, 32 heads, head dim 64/128, sequence 1k-16k, causal or not, bf16) it
times, in one run and on the same inputs:
    numasched          the Triton kernel (autotuned; ``--fixed``: one fixed config, TMA and
                       pointer-load variants side by side)
    sdpa-flash         torch SDPA, FLASH_ATTENTION backend (FlashAttention-2)
    sdpa-cudnn         torch SDPA, CUDNN_ATTENTION backend
    sdpa-efficient     torch SDPA, EFFICIENT_ATTENTION backend
and reports TFLOP/s (4*B*H*L*L*D, causal counted as half), numasched's ratio to FLASH and cuDNN,
the fraction of the measured cuBLAS bf16 rate, and numasched's error against SDPA FLASH. Each provider timed twice: eager calls (``ms``, what a Python loop gets, host overhead included)
and one call captured in a CUDA graph and replayed (``graph_ms``, the GPU's time); the ratios
use graph times (``x_*_eager`` the eager ones). Rows print as they come and
``prefill-partial.csv`` is rewritten after every point.
Targets (H200): >= 1.1x FLASH, >= 0.9x cuDNN.

    numasched bench prefill --quick          # a few points, fixed configs: well under a minute
    numasched bench prefill                  # the full grid (autotunes once per shape key)
    numasched bench prefill --dry-run        # the points and contenders, without a GPU
    TRITON_INTERPRET=1 numasched bench prefill --cpu-check   # end to end on CPU, tiny shapes
"""
from __future__ import annotations

import argparse
import sys


def _sdpa_fn(q, k, v, causal, backend):
    gqa = q.shape[1] != k.shape[1]
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    b = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
         "efficient": SDPBackend.EFFICIENT_ATTENTION}[backend]

    def fn():
        with sdpa_kernel([b]):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)

    return fn


def _graph_ms(fn, bench_ms):
    """``fn`` captured once in a CUDA graph, then timed as ``g.replay()``: the GPU time without the
    host's per-call Python (eager calls at small sizes are bound by it). None if capture fails."""
    import torch

    from .common import capture, warm_up_for_capture

    try:
        warm_up_for_capture(fn, times=2)
        return bench_ms(capture(fn).replay)
    except Exception as e:  # e.g. a backend that cannot be captured
        print(f"graph capture failed: {type(e).__name__}: {str(e).splitlines()[0][:120]}", flush=True)
        torch.cuda.synchronize()
        return None


def _grid(args):
    if args.cpu_check:
        return [(1, 64, 40), (1, 128, 33)]
    if args.quick:
        return [(2, 128, 4096), (2, 128, 8192), (4, 64, 4096)]
    pts = []
    for d in args.dims:
        for s in args.seqs:
            b = args.batch or max(1, min(4, 16384 // s))  # about 16k tokens per call, batch 1-4
            pts.append((b, d, s))
    return pts


def _cfg_str(cfg) -> str:
    """'128x64 w8 s3 tma' for a config dict or a triton.Config."""
    if cfg is None:
        return ""
    if not isinstance(cfg, dict):
        cfg = dict(cfg.kwargs, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return (f"{cfg['BLOCK_M']}x{cfg['BLOCK_N']} w{cfg['num_warps']} s{cfg['num_stages']} "
            f"{'tma' if cfg['USE_TMA'] else 'ptr'}")


def _fmt(v) -> str:
    return f"{v:.4g}" if isinstance(v, float) else ("" if v is None else str(v))


def _write_partial(rows, cols, out_dir) -> None:
    """The rows so far, rewritten after every point (prefill-partial.csv): a run cut short keeps them."""
    import csv

    from .common import results_dir

    d = results_dir(out_dir)
    d.mkdir(parents=True, exist_ok=True)
    with open(d / "prefill-partial.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=cols, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)


def _plot(rows, path):
    import matplotlib.pyplot as plt
    from .common import save_plot

    keys = sorted({(r["head_dim"], r["causal"]) for r in rows})
    fig, axes = plt.subplots(1, len(keys), figsize=(5 * len(keys), 4), squeeze=False)
    for ax, (d, c) in zip(axes[0], keys):
        sub = [r for r in rows if r["head_dim"] == d and r["causal"] == c]
        for prov in sorted({r["provider"] for r in sub}):
            pts = sorted((r["seq"], r.get("graph_tflops") or r["tflops"]) for r in sub
                         if r["provider"] == prov and (r.get("graph_tflops") or r["tflops"]))
            if pts:
                ax.plot(*zip(*pts), marker="o", label=prov)
        ax.set_xscale("log", base=2)
        ax.set_title(f"d{d} {'causal' if c else 'non-causal'}")
        ax.set_xlabel("sequence length")
        ax.set_ylabel("TFLOP/s (CUDA graph replay where measured)")
        ax.legend(fontsize=7)
    fig.tight_layout()
    save_plot(fig, path)


PEERS = ("flash", "cudnn", "efficient")


def _attention_mapping(text: str) -> str:
    """argparse type of --mapping: "auto" or a registered attention policy."""
    from numasched import mappings as M

    if text == "auto" or text in M.available("attention"):
        return text
    raise argparse.ArgumentTypeError(f"expected 'auto' or an attention policy "
                                     f"({', '.join(M.available('attention'))}), got {text!r}")


def _head_dim(text: str) -> int:
    """argparse type of --dims: a head dimension the kernel supports."""
    from numasched.attention import supported_head_dim
    from numasched.argtypes import positive_int

    d = positive_int(text)
    if not supported_head_dim(d):
        raise argparse.ArgumentTypeError(f"head dimension {d} is not supported by the kernel")
    return d


def build_parser() -> argparse.ArgumentParser:
    from numasched.argtypes import out_dir, positive_int

    p = argparse.ArgumentParser(prog="numasched bench prefill", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="a few points with fixed configs (well under a minute)")
    p.add_argument("--dims", type=_head_dim, nargs="+", default=[64, 128], help="head dimensions (default 64 128)")
    p.add_argument("--seqs", type=positive_int, nargs="+", default=[1024, 2048, 4096, 8192, 16384],
                   help="sequence lengths (query = key length)")
    p.add_argument("--batch", type=positive_int, default=None, help="batch for every point (default: 1-4, ~16k tokens)")
    p.add_argument("--heads", type=positive_int, default=32, help="query heads")
    p.add_argument("--kv-heads", type=positive_int, default=None, help="KV heads (GQA); default = heads")
    p.add_argument("--causal", choices=["both", "yes", "no"], default="both", help="causal mask, no mask, or both")
    p.add_argument("--fixed", action="store_true", help="fixed kernel configs (TMA and pointers) instead of autotuning")
    p.add_argument("--mapping", type=_attention_mapping, default="auto", help="numasched mapping policy (default auto)")
    p.add_argument("--peers", nargs="*", choices=PEERS, default=list(PEERS), help="torch SDPA backends to time")
    p.add_argument("--out-dir", type=out_dir, default=None, help="results folder (default: see numasched.bench.common)")
    p.add_argument("--no-graph", action="store_true", help="eager timings only (no CUDA graph replay)")
    p.add_argument("--dry-run", action="store_true",
                   help="print the points and contenders and exit (no GPU needed, nothing timed)")
    p.add_argument("--cpu-check", action="store_true",
                   help="run end to end on CPU (needs TRITON_INTERPRET=1; tiny shapes, timings meaningless)")
    return p


def main(argv=None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    if args.kv_heads is not None and args.heads % args.kv_heads:
        p.error(f"--heads ({args.heads}) must be a multiple of --kv-heads ({args.kv_heads})")
    if args.dry_run:
        from .common import print_plan

        causals = {"both": "non-causal and causal", "yes": "causal", "no": "non-causal"}[args.causal]
        H, HK = args.heads, args.kv_heads or args.heads
        lines = [f"batch {b}, heads {H}/{HK}, head dim {d}, seq {s}, {causals}, bf16" for b, d, s in _grid(args)]
        ours = ("numasched-tma and numasched-ptr (fixed configs)" if args.fixed or args.quick
                else "numasched (autotuned)")
        return print_plan("prefill", lines, [f"{ours}, mapping {args.mapping}"] + [f"sdpa-{x}" for x in args.peers]
                          + ([] if args.no_graph else ["each also as a CUDA-graph replay"]))
    import torch

    from .common import check_runnable

    if (rc := check_runnable("prefill", args.cpu_check)) is not None:
        return rc
    dev = "cpu" if args.cpu_check else "cuda"
    from numasched.attention import attention_forward
    from numasched.kernels import attention_fwd as K

    from .common import bench_ms, matmul_rate, progress, write_results

    if args.cpu_check:
        import time

        def bench_ms(fn):  # noqa: F811  one untimed-quality call: the interpreter is not a GPU
            t = time.perf_counter()
            fn()
            return (time.perf_counter() - t) * 1e3

        def matmul_rate():  # noqa: F811
            return 1e12

    fixed = args.fixed or args.quick or args.cpu_check
    variants = ({"numasched-tma": K.DEFAULT_GPU_CONFIG,
                 "numasched-ptr": dict(K.DEFAULT_GPU_CONFIG, USE_TMA=False)} if fixed and not args.cpu_check
                else {"numasched-tma": dict(K.INTERPRETER_CONFIG, USE_TMA=True),
                      "numasched-ptr": K.INTERPRETER_CONFIG} if args.cpu_check else {"numasched": None})
    causals = {"both": [False, True], "yes": [True], "no": [False]}[args.causal]
    H, HK = args.heads, args.kv_heads or args.heads
    peak = matmul_rate()
    graph_ms = (lambda fn: None) if args.cpu_check or args.no_graph else (lambda fn: _graph_ms(fn, bench_ms))
    cols = ["batch", "heads", "kv_heads", "head_dim", "seq", "causal", "provider", "ms", "graph_ms", "tflops",
            "graph_tflops", "x_flash", "x_cudnn", "x_flash_eager", "x_cudnn_eager", "frac_cublas",
            "rel_err_vs_flash", "config"]
    rows = []
    points = [(b, d, s, c) for (b, d, s) in _grid(args) for c in causals]
    for b, d, s, causal in progress(points, "prefill"):
        torch.manual_seed(0)
        q = torch.randn(b, H, s, d, device=dev, dtype=torch.float32 if args.cpu_check else torch.bfloat16)
        k = torch.randn(b, HK, s, d, device=dev, dtype=torch.float32 if args.cpu_check else torch.bfloat16)
        v = torch.randn(b, HK, s, d, device=dev, dtype=torch.float32 if args.cpu_check else torch.bfloat16)
        flops = 4 * b * H * s * s * d * (0.5 if causal else 1.0)
        base = dict(batch=b, heads=H, kv_heads=HK, head_dim=d, seq=s, causal=causal)
        times, gtimes, errs, cfgs = {}, {}, {}, {}
        ref = None
        if "flash" in args.peers:
            try:
                ref = _sdpa_fn(q, k, v, causal, "flash")().float()
            except RuntimeError:
                ref = None
        for name, cfg in variants.items():
            fn = lambda cfg=cfg: attention_forward(q, k, v, causal=causal, mapping=args.mapping, _config=cfg)  # noqa: E731
            out = fn()[0]
            if ref is not None:
                errs[name] = ((out.float() - ref).norm() / ref.norm()).item()
            times[name] = bench_ms(fn)
            gtimes[name] = graph_ms(fn)
            best = getattr(K.attn_fwd_autotuned, "best_config", None)
            cfgs[name] = _cfg_str(cfg if cfg is not None else best)
        for peer in args.peers:
            fn = _sdpa_fn(q, k, v, causal, peer)
            try:
                fn()
                times[f"sdpa-{peer}"] = bench_ms(fn)
                gtimes[f"sdpa-{peer}"] = graph_ms(fn)
            except RuntimeError as e:  # backend not available for this shape / build
                times[f"sdpa-{peer}"] = None
                gtimes[f"sdpa-{peer}"] = None
                print(f"sdpa-{peer} unavailable at {base}: {str(e).splitlines()[0][:120]}")
        new = []
        for name, ms in times.items():
            gms = gtimes.get(name)
            tf = flops / (ms * 1e-3) / 1e12 if ms else None
            gtf = flops / (gms * 1e-3) / 1e12 if gms else None
            best_tf = gtf or tf  # ratios and fractions on graph times where there are some
            new.append(dict(base, provider=name, ms=ms, graph_ms=gms, tflops=tf, graph_tflops=gtf,
                            frac_cublas=(best_tf * 1e12 / peak) if best_tf else None,
                            rel_err_vs_flash=errs.get(name), config=cfgs.get(name)))
        peers = {r["provider"]: r for r in new if r["provider"].startswith("sdpa")}
        for r in new:
            if not r["provider"].startswith("numasched"):
                continue
            for peer in ("flash", "cudnn"):
                pr = peers.get(f"sdpa-{peer}")
                if pr and r["graph_tflops"] and pr["graph_tflops"]:
                    r[f"x_{peer}"] = r["graph_tflops"] / pr["graph_tflops"]
                elif pr and r["tflops"] and pr["tflops"] and not pr["graph_tflops"]:
                    r[f"x_{peer}"] = r["tflops"] / pr["tflops"]  # no graph time: eager ratio stands in
                if pr and r["tflops"] and pr["tflops"]:
                    r[f"x_{peer}_eager"] = r["tflops"] / pr["tflops"]
        rows.extend(new)
        for r in new:  # progressive output: a long run shows (and keeps) what it has
            print("  " + " ".join(f"{c}={_fmt(r.get(c))}" for c in ("batch", "head_dim", "seq", "causal",
                                                                     "provider", "ms", "graph_ms", "graph_tflops",
                                                                     "x_flash", "x_cudnn", "x_flash_eager")),
                  flush=True)
        _write_partial(rows, cols, args.out_dir)
        del q, k, v, ref
        if not args.cpu_check:
            torch.cuda.empty_cache()
    paths = write_results("prefill", rows, columns=cols, plot=_plot, out_dir=args.out_dir,
                          meta=dict(cublas_bf16_tflops=peak / 1e12, mapping=args.mapping,
                                    note="TFLOP/s = 4*B*H*L^2*D/time, causal counted as half; ms: eager calls, graph_ms: "
                                         "one call captured in a CUDA graph, timed as replay; x_flash/x_cudnn on "
                                         "graph times (x_*_eager on eager times); "
                                         "targets >= 1.1x sdpa-flash and >= 0.9x sdpa-cudnn"))
    ours = [r for r in rows if r["provider"].startswith("numasched") and r.get("x_flash")]
    if ours:
        import statistics

        for name in sorted({r["provider"] for r in ours}):
            sub = [r for r in ours if r["provider"] == name]
            xf = statistics.geometric_mean([r["x_flash"] for r in sub])
            xc = [r["x_cudnn"] for r in sub if r.get("x_cudnn")]
            xe = [r["x_flash_eager"] for r in sub if r.get("x_flash_eager")]
            print(f"{name}: geomean {xf:.3f}x sdpa-flash" + (f", {statistics.geometric_mean(xc):.3f}x sdpa-cudnn"
                                                             if xc else "")
                  + f" (graph replay where measured) over {len(sub)} points"
                  + (f"; eager calls: {statistics.geometric_mean(xe):.3f}x sdpa-flash" if xe else ""))
    print("written:", ", ".join(str(v) for v in paths.values()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
