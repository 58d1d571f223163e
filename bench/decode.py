"""``numasched bench decode``: Flash Decode against its peers, side by side in one run.

Per point (heads, batch, context), bf16, head dim 128, one query token per sequence:

* numasched.flash_decode on a contiguous cache in its native layout (batch, ctx, kv_heads, d),
  on the ``k.transpose(1, 2)`` view of a (batch, kv_heads, ctx, d) tensor (what SDPA users have),
  and on a paged cache (page 16, random block table), each with the fused combine and, as a
  variant, the separate combine kernel;
* torch SDPA with each backend (FLASH / EFFICIENT / cuDNN through ``sdpa_kernel``; "n/a" where a
  backend has no kernel), FlexAttention's decode path (``torch.compile(flex_attention)``), and
  FlashInfer's ``BatchDecodeWithPagedKVCacheWrapper`` (paged, NHD) if importable.

Bytes moved = K + V read + q read + out written. Reported: time, TB/s, fraction of the measured
streaming-read bandwidth (bench.common.stream_read_bw), and the ratio best peer time / our time
(> 1: we are faster) against the best peer at that point in any layout. Our figures are for the
default (fused) combine; ``ours_kernel_combine_us`` is the separate-kernel variant.

    numasched bench decode --quick
    numasched bench decode --heads gqa        # the full grid, one head config per run
    numasched bench decode --heads mha
"""
from __future__ import annotations

import argparse
import math
from typing import Callable, Dict, List, Optional

HEADS = {"gqa": (32, 8), "mha": (32, 32)}
BATCHES = [1, 8, 32, 128]
CONTEXTS = [1024, 8192, 32768, 131072]
QUICK_POINTS = [("gqa", 1, 8192), ("gqa", 1, 131072), ("gqa", 8, 32768), ("gqa", 32, 8192), ("mha", 8, 8192)]
HEAD_DIM = 128
PAGE = 16
SDPA_BACKENDS = ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION")


def _parse(argv):
    p = argparse.ArgumentParser(prog="numasched bench decode", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help=f"a handful of points: {QUICK_POINTS}")
    p.add_argument("--heads", choices=["gqa", "mha", "all"], default="all",
                   help="32 query / 8 KV heads (gqa), 32 / 32 (mha), or both")
    p.add_argument("--batch", type=int, nargs="+", default=BATCHES)
    p.add_argument("--ctx", type=int, nargs="+", default=CONTEXTS)
    p.add_argument("--max-gb", type=float, default=40.0, help="skip points whose K+V cache exceeds this")
    p.add_argument("--no-flex", action="store_true", help="skip FlexAttention (it compiles once per shape)")
    p.add_argument("--no-flashinfer", action="store_true")
    p.add_argument("--mapping", default="auto", help="numasched mapping policy (default auto)")
    p.add_argument("--flashinfer-both", action="store_true",
                   help="time FlashInfer with and without tensor cores (default: tensor cores for group >= 4)")
    p.add_argument("--sweep-splits", type=int, nargs="*", default=None,
                   help="also time numasched at these split counts (extra rows; data for the split heuristic)")
    p.add_argument("--rep", type=int, default=100, help="timing window per measurement, ms")
    p.add_argument("--out-dir", default=None)
    return p.parse_args(argv)


def _points(args):
    if args.quick:
        return list(QUICK_POINTS)
    heads = ["gqa", "mha"] if args.heads == "all" else [args.heads]
    return [(h, b, c) for h in heads for b in args.batch for c in args.ctx]


def _time(fn: Callable, rep: int) -> Optional[float]:
    from .common import bench_ms

    return bench_ms(fn, warmup=max(10, rep // 4), rep=rep)


def _try(fn: Callable, rep: int, notes: List[str], name: str):
    """Time fn; None (reported as n/a) if it raises (e.g. an SDPA backend without a kernel)."""
    import torch

    try:
        out = fn()
        torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001 - a peer that cannot run this case is "n/a", with why
        notes.append(f"{name}: {type(e).__name__}: {str(e).splitlines()[0][:80] if str(e) else ''}")
        return None, None
    return _time(fn, rep), out


def _flashinfer():
    try:
        import flashinfer  # noqa: F401

        return flashinfer, None
    except Exception as e:  # noqa: BLE001
        return None, f"{type(e).__name__}: {e}"


def main(argv=None) -> int:
    import torch
    import torch.nn.functional as F

    import numasched
    import numasched.decode as ND
    from numasched.kernels import flash_decode as FD

    from .common import progress, stream_read_bw, write_results

    args = _parse(argv)
    if not torch.cuda.is_available():
        print("numasched bench decode needs a CUDA GPU")
        return 1
    ND.CHECK_DATA = False  # the data checks synchronise; a serving loop turns them off too
    dev = torch.device("cuda")
    dt = torch.bfloat16
    read_bw = stream_read_bw()
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    fi, fi_err = (None, "disabled (--no-flashinfer)") if args.no_flashinfer else _flashinfer()
    flex = None
    if not args.no_flex:
        from torch.nn.attention.flex_attention import flex_attention

        # one compile per shape: lift dynamo's recompile limits, or later shapes would silently
        # run flex_attention eagerly (much slower) and be reported as FlexAttention
        for name, value in (("recompile_limit", 1024), ("cache_size_limit", 1024),
                            ("accumulated_recompile_limit", 8192), ("accumulated_cache_size_limit", 8192)):
            if hasattr(torch._dynamo.config, name):
                setattr(torch._dynamo.config, name, value)
        flex = torch.compile(flex_attention, dynamic=False)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    rows: List[Dict] = []
    pts = _points(args)
    for hname, B, L in progress(pts, description="decode"):
        H, HK = HEADS[hname]
        D = HEAD_DIM
        kv_bytes = 2 * B * L * HK * D * 2
        base = dict(heads=f"{H}/{HK}", batch=B, ctx=L, kv_GB=round(kv_bytes / 1e9, 3))
        if kv_bytes > args.max_gb * 1e9:
            rows.append(dict(base, layout="-", note=f"skipped: K+V {kv_bytes / 1e9:.1f} GB > --max-gb"))
            continue
        nbytes = kv_bytes + 2 * B * H * D * 2
        splits = FD.choose_num_splits(B, HK, L, sms)
        q = torch.randn(B, H, D, device=dev, dtype=dt)
        q4 = q.view(B, H, 1, D)
        lens = torch.full((B,), L, dtype=torch.int32, device=dev)
        peers: Dict[str, Optional[float]] = {}
        notes: List[str] = []
        ours: Dict[str, Dict[str, Optional[float]]] = {}

        def run_ours(layout, k, v, bt=None):
            res = {}
            for combine in ("fused", "kernel"):
                FD.COMBINE_MODE = combine
                fn = lambda: numasched.flash_decode(q, k, v, cache_seqlens=lens, block_table=bt,  # noqa: E731
                                                    mapping=args.mapping)
                res[combine], out = _try(fn, args.rep, notes, f"numasched {layout} {combine}")
            FD.COMBINE_MODE = "auto"
            ours[layout] = res
            for s in args.sweep_splits or ():
                fn = lambda: numasched.flash_decode(q, k, v, cache_seqlens=lens, block_table=bt,  # noqa: E731
                                                    num_splits=s, mapping=args.mapping)
                ours[f"{layout} S={s}"] = {"fused": _try(fn, args.rep, notes, f"numasched {layout} S={s}")[0],
                                           "splits": s}
            return out

        # -- contiguous (B, HK, L, D): the peers' layout; ours on its transpose view
        kb = torch.randn(B, HK, L, D, device=dev, dtype=dt)
        vb = torch.randn(B, HK, L, D, device=dev, dtype=dt)
        ref = None
        gqa = H != HK
        for be in SDPA_BACKENDS:
            with sdpa_kernel(getattr(SDPBackend, be)):
                fn = lambda: F.scaled_dot_product_attention(q4, kb, vb, enable_gqa=gqa)  # noqa: E731
                peers[f"sdpa_{be.split('_')[0].lower()}"], out = _try(fn, args.rep, notes, f"SDPA {be}")
            if ref is None and out is not None:
                ref = out.view(B, H, D).float()
        if flex is not None:
            peers["flex"], _ = _try(lambda: flex(q4, kb, vb, enable_gqa=gqa), args.rep, notes, "flex")
        out = run_ours("contiguous (BHLD view)", kb.transpose(1, 2), vb.transpose(1, 2))
        err = (out.float() - ref).abs().max().item() if (out is not None and ref is not None) else None
        del kb, vb
        torch.cuda.empty_cache()

        # -- contiguous (B, L, HK, D): the native layout
        kn = torch.randn(B, L, HK, D, device=dev, dtype=dt)
        vn = torch.randn(B, L, HK, D, device=dev, dtype=dt)
        run_ours("contiguous (BLHD)", kn, vn)
        del kn, vn
        torch.cuda.empty_cache()

        # -- paged: page 16, pages scattered by a random permutation
        pages = B * L // PAGE
        kp = torch.randn(pages, PAGE, HK, D, device=dev, dtype=dt)
        vp = torch.randn(pages, PAGE, HK, D, device=dev, dtype=dt)
        bt = torch.randperm(pages, device=dev, dtype=torch.int32).view(B, L // PAGE)
        run_ours(f"paged {PAGE}", kp, vp, bt)
        if fi is not None:
            ws = torch.empty(256 * 1024 * 1024, dtype=torch.uint8, device=dev)
            indptr = torch.arange(B + 1, device=dev, dtype=torch.int32) * (L // PAGE)
            last = torch.full((B,), PAGE, dtype=torch.int32, device=dev)
            best = None
            for tc in ((False, True) if args.flashinfer_both else (H // HK >= 4,)):
                try:
                    w = fi.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_tensor_cores=tc)
                    w.plan(indptr, bt.reshape(-1), last, H, HK, D, PAGE, pos_encoding_mode="NONE",
                           q_data_type=dt, kv_data_type=dt)
                except Exception as e:  # noqa: BLE001
                    notes.append(f"flashinfer tc={tc} plan: {type(e).__name__}: {str(e)[:80]}")
                    continue
                t, _ = _try(lambda: w.run(q, (kp, vp)), args.rep, notes, f"flashinfer tc={tc}")
                if t is not None and (best is None or t < best):
                    best = t
            peers["flashinfer"] = best
            del ws
        else:
            notes.append(f"flashinfer skipped: {fi_err}")
        del kp, vp, bt
        torch.cuda.empty_cache()

        # -- rows
        got = {k: v for k, v in peers.items() if v is not None}
        best_name = min(got, key=got.get) if got else None
        for layout, res in ours.items():
            t = res.get("fused")  # the default ("auto") combine
            tk = res.get("kernel")
            t_best = t
            row = dict(base, layout=layout, splits=res.get("splits", splits))
            row["ours_us"] = t * 1e3 if t else None
            row["ours_kernel_combine_us"] = tk * 1e3 if tk else None
            row["ours_TBps"] = nbytes / (t_best * 1e-3) / 1e12 if t_best else None
            row["frac_stream_read"] = nbytes / (t_best * 1e-3) / read_bw if t_best else None
            row["best_peer"] = best_name
            row["best_peer_us"] = got[best_name] * 1e3 if best_name else None
            row["ratio_vs_best_peer"] = got[best_name] / t_best if (best_name and t_best) else None
            for name in ("sdpa_flash", "sdpa_efficient", "sdpa_cudnn", "flex", "flashinfer"):
                v = peers.get(name, "skipped")
                row[f"{name}_us"] = "n/a" if v is None else (v * 1e3 if isinstance(v, float) else v)
            for name, v in got.items():
                row[f"{name}_TBps"] = nbytes / (v * 1e-3) / 1e12
            row["max_abs_err_vs_sdpa"] = err
            row["note"] = "; ".join(notes)
            rows.append(row)

    cols = ["heads", "batch", "ctx", "kv_GB", "layout", "splits", "ours_us", "ours_kernel_combine_us", "ours_TBps",
            "frac_stream_read", "best_peer", "best_peer_us", "ratio_vs_best_peer", "sdpa_flash_us",
            "sdpa_efficient_us", "sdpa_cudnn_us", "flex_us", "flashinfer_us", "max_abs_err_vs_sdpa", "note"]
    write_results("decode", rows, columns=cols, plot=_plot, out_dir=args.out_dir,
                  meta=dict(stream_read_TBps=read_bw / 1e12, mapping=args.mapping, quick=args.quick,
                            flashinfer=(getattr(fi, "__version__", "?") if fi else fi_err)))
    print(f"streaming read: {read_bw / 1e12:.2f} TB/s; ratio_vs_best_peer > 1 means numasched is faster. "
          f"Targets: ratio >= 1 everywhere, frac_stream_read >= 0.9 at batch x ctx >= 256k.")
    return 0


def _plot(rows, path):
    import matplotlib.pyplot as plt

    heads = sorted({r["heads"] for r in rows if r.get("ours_TBps")})
    fig, axes = plt.subplots(1, max(1, len(heads)), figsize=(7 * max(1, len(heads)), 4.5), squeeze=False)
    for ax, h in zip(axes[0], heads):
        rs = [r for r in rows if r["heads"] == h and r.get("ours_TBps")]
        pts = sorted({(r["batch"], r["ctx"]) for r in rs}, key=lambda p: (p[0] * p[1], p))
        x = list(range(len(pts)))
        for layout in sorted({r["layout"] for r in rs if "S=" not in r["layout"]}):
            y = [next((r["ours_TBps"] for r in rs if (r["batch"], r["ctx"]) == p and r["layout"] == layout),
                      math.nan) for p in pts]
            ax.plot(x, y, "o-", label=f"numasched {layout}")
        for peer in ("sdpa_flash", "sdpa_cudnn", "sdpa_efficient", "flex", "flashinfer"):
            y = [next((r.get(f"{peer}_TBps", math.nan) for r in rs if (r["batch"], r["ctx"]) == p), math.nan)
                 for p in pts]
            if any(not math.isnan(v) for v in y):
                ax.plot(x, y, "x--", label=peer)
        ax.set_xticks(x)
        ax.set_xticklabels([f"{b}x{c // 1024}k" for b, c in pts], rotation=45, ha="right")
        ax.set_ylabel("TB/s (K+V+q+out)")
        ax.set_title(f"decode, heads {h}, d{HEAD_DIM}, bf16")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())
