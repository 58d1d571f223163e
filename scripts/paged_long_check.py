"""Paged decode at long contexts on a GPU: several sequences' outputs against a float64 reference,
for the model's split count and 1, 2 and 4 splits, a repeated call (the same bits), and the same
data as a contiguous cache. Prints the plan (config, splits, combine, prefetch) and each check,
for the points given as HEADS:BATCH:CTX (default: 32k-128k points of the paged grids).
Fifty-seventh session, one H200: every error 4.2e-05 to 1.6e-04 (bench/results/decode-s57/)."""
import os
import sys

import torch

import numasched
from numasched.bench.decode import HEADS, _paged_cache


def seq_errors(out, q, kp, vp, bt, L, seqs):
    page, HK, D = kp.shape[1:]
    G = q.shape[1] // HK
    errs = []
    for b in seqs:
        rows = bt[b, :-(-L // page)].long()
        k = kp[rows].reshape(-1, HK, D)[:L].double()
        v = vp[rows].reshape(-1, HK, D)[:L].double()
        s = torch.einsum("kgd,lkd->kgl", q[b].double().view(HK, G, D), k) / D ** 0.5
        ref = torch.einsum("kgl,lkd->kgd", s.softmax(-1), v).reshape(HK * G, D)
        errs.append((out[b].double() - ref).abs().max().item())
    return errs


def main(points):
    dev = torch.device(os.environ.get("DEVICE", "cuda"))
    dt = torch.bfloat16 if dev.type == "cuda" else torch.float16   # (the interpreter: no bf16 dots)
    for spec in points:
        hname, B, L = spec.split(":")
        B, L = int(B), int(L)
        H, HK = HEADS[hname]
        torch.manual_seed(B * 7 + L)
        q = torch.randn(B, H, 128, device=dev, dtype=dt)
        lens = torch.full((B,), L, dtype=torch.int32, device=dev)
        for page in (16, 64):
            kp, vp, bt = _paged_cache(B, L, page, HK, 128, dev, dt)
            seqs = sorted({0, 1, B // 2, B - 1})
            for splits in (None, 1, 2, 4):
                kw = {} if splits is None else dict(num_splits=splits)
                plan = numasched.plan_decode(q, kp, vp, cache_seqlens=lens, block_table=bt, **kw)
                o1 = numasched.flash_decode(q, kp, vp, cache_seqlens=lens, block_table=bt, **kw)
                o2 = numasched.flash_decode(q, kp, vp, cache_seqlens=lens, block_table=bt, **kw)
                if dev.type == "cuda":
                    torch.cuda.synchronize()
                e = seq_errors(o1, q, kp, vp, bt, L, seqs)
                bad = int((o1.float().abs() > 1).sum())
                print(f"{hname} {B}x{L} page {page} splits {plan.num_splits} ({'auto' if splits is None else 'set'}) "
                      f"{plan.combine} cfg {plan.config} prefetch {getattr(plan, 'prefetch_tokens', None)}: "
                      f"errs {['%.2g' % x for x in e]} |out|>1 {bad} repeat-equal {torch.equal(o1, o2)}", flush=True)
            # the same data as a contiguous (B, L, HK, D) cache
            kc = kp[bt.long()].reshape(B, -1, HK, 128)[:, :L]
            vc = vp[bt.long()].reshape(B, -1, HK, 128)[:, :L]
            oc = numasched.flash_decode(q, kc, vc, cache_seqlens=lens)
            print(f"  contiguous copy: errs {['%.2g' % x for x in seq_errors(oc, q, kp, vp, bt, L, seqs)]}",
                  flush=True)
            del kp, vp, bt, kc, vc
            if dev.type == "cuda":
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main(sys.argv[1:] or ["gqa:32:32768", "gqa:64:32768", "gqa:64:16384", "gqa:8:131072", "mha:8:32768"])
