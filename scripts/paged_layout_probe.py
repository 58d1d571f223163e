"""Paged decode, two page layouts side by side (GPU): vLLM's NHD pages (num_pages, page_size,
kv_heads, D) against head-major HND pages (num_pages, kv_heads, page_size, D) handed to
``numasched.flash_decode`` as their (num_pages, page_size, kv_heads, D) view, the same data, and
FlashInfer's paged decode on each layout (``kv_layout`` "NHD" / "HND"), CUDA-graph replays after
a 256 MB read flush. Each output's first sequence is checked against float64.

    python scripts/paged_layout_probe.py [HEADS:BATCH:CTX ...] [--pages 16 64] [--csv FILE]

Points default to the TP 2 decoder's attention (tp2:16:32768, 16/4 heads) and grid points of the
four head configs. Data for ``options.paged_kv_head_major`` (the decoder's cache), not a benchmark
of record (the paged grids are ``numasched bench decode --pages``).
"""
import argparse
import csv
import os
import sys

import torch

import numasched
from numasched.bench.common import bench_ms, capture, warm_up_for_capture
from numasched.bench.decode import HEADS, _first_sequence_error, _flashinfer_pages, _paged_cache

POINTS = ["tp2:16:32768", "tp2:16:2048", "tp2:4:32768", "gqa:8:32768", "gqa:64:2048", "gqa64:32:8192",
          "mha:16:8192", "mha:128:512", "gqa28:32:4096", "gqa:1:131072"]


def graph_us(fn) -> float:
    warm_up_for_capture(fn, 2)
    return bench_ms(capture(fn).replay, warmup=5, rep=30, flush="read") * 1e3


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("points", nargs="*", default=POINTS, help="HEADS:BATCH:CTX (heads: " + ", ".join(HEADS) + ")")
    p.add_argument("--pages", type=int, nargs="+", default=[16, 64])
    p.add_argument("--csv", default=None)
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU")
        return 0
    try:
        import flashinfer as fi
    except Exception as e:  # noqa: BLE001
        fi = None
        print(f"(no FlashInfer: {type(e).__name__})")
    dev, dt, D = torch.device("cuda"), torch.bfloat16, 128
    rows = []
    ws = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
    for spec in args.points:
        hname, B, L = spec.split(":")
        B, L = int(B), int(L)
        H, HK = HEADS[hname]
        for page in args.pages:
            torch.manual_seed(B * 131 + L + page)
            q = torch.randn(B, H, D, device=dev, dtype=dt)
            kp, vp, bt = _paged_cache(B, L, page, HK, D, dev, dt)
            lens = torch.full((B,), L, dtype=torch.int32, device=dev)
            kh, vh = (t.transpose(1, 2).contiguous() for t in (kp, vp))   # (pages, HK, page, D) storage
            row = dict(heads=hname, batch=B, ctx=L, page=page)
            for name, (k, v) in (("nhd", (kp, vp)), ("hnd", (kh.transpose(1, 2), vh.transpose(1, 2)))):
                plan = numasched.plan_decode(q, k, v, cache_seqlens=lens, block_table=bt)
                out = plan.run(q, k, v, lens, bt)
                row[f"ns_{name}_us"] = graph_us(lambda: plan.run(q, k, v, lens, bt))  # noqa: B023
                row[f"ns_{name}_err"] = _first_sequence_error(out, q, kp, vp, bt, L)
                row["splits"], row["config"] = plan.num_splits, plan.config
            if fi is not None:
                indptr, indices, last = _flashinfer_pages(bt, L, page)
                for name, cache in (("nhd", (kp, vp)), ("hnd", (kh, vh))):
                    try:
                        w = fi.BatchDecodeWithPagedKVCacheWrapper(ws, name.upper(), use_tensor_cores=H // HK >= 4)
                        w.plan(indptr, indices, last, H, HK, D, page, pos_encoding_mode="NONE", q_data_type=dt,
                               kv_data_type=dt)
                        out = w.run(q, cache)
                        row[f"fi_{name}_us"] = graph_us(lambda: w.run(q, cache))  # noqa: B023
                        row[f"fi_{name}_err"] = _first_sequence_error(out, q, kp, vp, bt, L)
                    except Exception as e:  # noqa: BLE001
                        print(f"  flashinfer {name}: {type(e).__name__}: {str(e)[:100]}")
            gb = 2 * B * L * HK * D * 2 / 1e9
            print(f"{spec} page {page} ({gb:.2f} GB, {row['splits']} splits): numasched NHD {row['ns_nhd_us']:.1f} "
                  f"HND {row['ns_hnd_us']:.1f} us (HND/NHD time {row['ns_hnd_us'] / row['ns_nhd_us']:.3f}); "
                  f"FlashInfer NHD {row.get('fi_nhd_us', float('nan')):.1f} HND {row.get('fi_hnd_us', float('nan')):.1f}; "
                  f"errors {row['ns_nhd_err']:.1e} / {row['ns_hnd_err']:.1e}", flush=True)
            for k in ("ns_nhd_err", "ns_hnd_err", "fi_nhd_err", "fi_hnd_err"):
                if row.get(k) is not None and not row[k] < 2e-2:
                    print(f"  ERROR {k} = {row[k]}")
            rows.append(row)
            del kp, vp, kh, vh
            torch.cuda.empty_cache()
    if args.csv:
        os.makedirs(os.path.dirname(args.csv) or ".", exist_ok=True)
        keys = list(dict.fromkeys(k for r in rows for k in r))
        with open(args.csv, "w", newline="") as f:
            wr = csv.DictWriter(f, keys)
            wr.writeheader()
            wr.writerows(rows)
        print(f"{len(rows)} rows -> {args.csv}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
