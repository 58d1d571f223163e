"""Every kernel family once on small GPU shapes, checked against float64 references: the program
that runs under compute-sanitizer (memcheck, racecheck) in ``scripts/device.sh sanitizer``.

Small shapes with ragged edges (lengths not multiples of the blocks, a paged cache with a random
block table, transposed GEMM operands) so masked loads and stores are exercised; outputs are
poisoned with NaN where the call takes ``out=``. Fixed kernel configs (no autotuning: every launch is one the sanitizer
checks, and compilation happens once): the script sets ``numasched.options.set(autotune=False)`` itself, and
attention runs plans made with ``numasched.plan_attention(..., config=...)``. Exit code 1 if any result is wrong,
2 if it cannot run here.

    python3 scripts/sanitize_kernels.py
    compute-sanitizer --tool memcheck python3 scripts/sanitize_kernels.py
    TRITON_INTERPRET=1 python3 scripts/sanitize_kernels.py      # CPU: a dry check of this script
"""
import math
import os
import sys

import torch

import numasched
from numasched.kernels import attention_fwd as AK

# on a CPU (TRITON_INTERPRET=1) the same cases run as a dry check of this script; the interpreter
# computes bf16 dots wrongly, so bf16 becomes fp16 there
DEV = "cuda" if torch.cuda.is_available() else "cpu"
BF16 = torch.bfloat16 if DEV == "cuda" else torch.float16
torch.manual_seed(0)
failures = []


def check(name, got, ref, tol):
    err = float((got.double() - ref).norm() / ref.norm())
    ok = math.isfinite(err) and err < tol
    print(f"{'ok  ' if ok else 'FAIL'} {name}: relative error {err:.2e} (tolerance {tol:g})", flush=True)
    if not ok:
        failures.append(name)


def ref_attention(q, k, v, causal, offset=0):
    q, k, v = q.double(), k.double(), v.double()
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if causal:
        i = torch.arange(q.shape[2], device=q.device)[:, None]
        j = torch.arange(k.shape[2], device=q.device)[None, :]
        s = s.masked_fill(j > i + offset, float("-inf"))
    return torch.softmax(s, -1) @ v


def attention_cases():
    for dt, D, causal, tma in [(BF16, 128, True, True), (torch.float16, 64, False, False),
                               (BF16, 64, True, False)]:
        B, H, HK, Lq, Lk = 2, 4, 2, 200, 333
        q = torch.randn(B, H, Lq, D, device=DEV, dtype=dt)
        k = torch.randn(B, HK, Lk, D, device=DEV, dtype=dt)
        v = torch.randn(B, HK, Lk, D, device=DEV, dtype=dt)
        cfg = dict(AK.fixed_config(dt, D, tma_ok=tma))
        for mapping in ("head_first", "swizzled_head_first"):
            plan = numasched.plan_attention(q, k, v, causal=causal, causal_offset=Lk - Lq, mapping=mapping, config=cfg)
            out, _ = plan.run(q, k, v)
            check(f"attention {dt} d{D} causal={causal} tma={tma} {mapping}", out,
                  ref_attention(q, k, v, causal, Lk - Lq), 1e-2)


def decode_cases():
    B, H, HK, D, L, page = 3, 8, 2, 128, 700, 16
    q = torch.randn(B, H, D, device=DEV, dtype=BF16)
    k = torch.randn(B, L, HK, D, device=DEV, dtype=BF16)
    v = torch.randn(B, L, HK, D, device=DEV, dtype=BF16)
    lens = torch.tensor([700, 1, 333], device=DEV, dtype=torch.int32)

    def ref():
        outs = []
        for b in range(B):
            n = int(lens[b])
            outs.append(ref_attention(q[b, None, :, None], k[b, :n].transpose(0, 1)[None], v[b, :n].transpose(0, 1)[None],
                                      False)[0, :, 0])
        return torch.stack(outs)

    r = ref()
    for splits in (None, 5):
        out = numasched.flash_decode(q, k, v, cache_seqlens=lens, num_splits=splits, mapping="swizzled_head_first")
        check(f"decode contiguous splits={splits}", out, r, 1e-2)
    # paged: the same tokens scattered over a shuffled pool of pages
    pages = -(-L // page)
    perm = torch.randperm(B * pages, device=DEV)
    table = perm.view(B, pages).to(torch.int32)
    kp = torch.empty(B * pages, page, HK, D, device=DEV, dtype=BF16)
    vp = torch.empty_like(kp)
    pad = pages * page - L
    kp[perm] = torch.nn.functional.pad(k, (0, 0, 0, 0, 0, pad)).view(B * pages, page, HK, D)
    vp[perm] = torch.nn.functional.pad(v, (0, 0, 0, 0, 0, pad)).view(B * pages, page, HK, D)
    out = numasched.flash_decode(q, kp, vp, cache_seqlens=lens, block_table=table, num_splits=3)
    check("decode paged page=16 splits=3", out, r, 1e-2)
    # the ragged work list (persistent kernel, in-kernel merge) and multi-token decode
    # 128-token chunks: the long pairs are cut into several items, so the in-kernel merge runs
    plan = numasched.plan_decode_worklist(q, k, v, lengths=lens.tolist(), cache_seqlens=lens, num_programs=4,
                                          chunk_tokens=128)
    assert plan.num_items > B * HK, "the work list must cut pairs (merge path)"
    check("decode work list contiguous (merging)", plan.run(q, k, v, cache_seqlens=lens), r, 1e-2)
    plan = numasched.plan_decode_worklist(q, kp, vp, lengths=lens.tolist(), cache_seqlens=lens, block_table=table,
                                          num_programs=4, chunk_tokens=128)
    check("decode work list paged (merging)", plan.run(q, kp, vp, cache_seqlens=lens, block_table=table), r, 1e-2)
    # multi-token decode: 3 and 16 new tokens per sequence (the last query row sees every token)
    for sq in (3, 16):
        qm = torch.randn(B, sq, H, D, device=DEV, dtype=BF16)
        qm[:, -1] = q
        outm = numasched.flash_decode(qm, k, v, cache_seqlens=lens, num_splits=3)
        check(f"decode multi-token Sq={sq} (last row)", outm[:, -1], r, 1e-2)




def gemm_cases():
    for (m, n, k), trans, persistent, dt in [((300, 200, 136), False, False, BF16),
                                             ((257, 129, 96), True, True, torch.float16),
                                             ((64, 96, 40), False, None, torch.float32)]:
        a = torch.randn(m, k, device=DEV, dtype=dt)
        b = torch.randn(n, k, device=DEV, dtype=dt).t() if trans else torch.randn(k, n, device=DEV, dtype=dt)
        out = torch.full((m, n), float("nan"), device=DEV, dtype=dt)
        for mapping in ("grouped", "chiplet_tiled"):
            numasched.matmul(a, b, mapping=mapping, persistent=persistent, out=out)
            check(f"gemm {m}x{n}x{k} {dt} transposed_b={trans} persistent={persistent} {mapping}", out,
                  a.double() @ b.double(), 1e-2 if dt != torch.float32 else 1e-5)
    # the sixth/seventh sessions' kernels: split-K (pointer and TMA tiles), stream-K, the SwiGLU split-K
    from numasched.gemm_schedule import Schedule

    a = torch.randn(37, 512, device=DEV, dtype=BF16)
    w = torch.randn(384, 512, device=DEV, dtype=BF16)
    ref = a.double() @ w.double().T
    for sched in (Schedule("splitk", 16, 64, 64, 4, 4, 3), Schedule("splitk", 64, 64, 64, 3, 4, 3),
                  Schedule("streamk", 64, 64, 64, 1, 4, 3, True)):
        plan = numasched.plan_matmul(a, w.T, schedule=sched, num_programs=5 if sched.kind == "streamk" else None)
        check(f"gemm {sched.kind} {sched.block_m}x{sched.block_n} split {sched.split_k}", plan.run(a, w.T), ref, 1e-2)
    g = numasched.matmul_swiglu(a, w.T)
    gu = ref
    check("matmul_swiglu", g, torch.nn.functional.silu(gu[:, :192]) * gu[:, 192:], 2e-2)
    # the twenty-third session's: matmul_swiglu's prefill tiles (128 x 256, from 512 rows; odd sizes)
    a2 = torch.randn(515, 320, device=DEV, dtype=BF16)
    w2 = torch.randn(2 * 136, 320, device=DEV, dtype=BF16)
    gu2 = a2.double() @ w2.double().T
    check("matmul_swiglu prefill tiles", numasched.matmul_swiglu(a2, w2.T),
          torch.nn.functional.silu(gu2[:, :136]) * gu2[:, 136:], 2e-2)


def rope_cases():
    """qkv_rope_cache, a decode step and a prefill returning k and v (the twenty-third session's),
    a padding slot (-1) among them."""
    from numasched.rope_cache import reference

    T, H, HK, D = 37, 8, 2, 64
    qkv = torch.randn(T, (H + 2 * HK) * D, device=DEV, dtype=BF16)
    ang = torch.arange(T, device=DEV, dtype=torch.float32)[:, None] * torch.rand(D // 2, device=DEV)[None, :]
    cos, sin = (torch.cat((f(ang), f(ang)), -1).to(BF16) for f in (torch.cos, torch.sin))
    kc = torch.full((8, 16, HK, D), float("nan"), device=DEV, dtype=BF16)
    vc = kc.clone()
    slots = torch.randperm(128, device=DEV)[:T]
    slots[3] = -1
    rq, rk, rv = reference(qkv.double(), cos.double(), sin.double(), H, HK)
    q = numasched.qkv_rope_cache(qkv, cos, sin, kc, vc, slots, heads=H, kv_heads=HK)
    check("qkv_rope_cache", q, rq, 1e-2)
    q, k, v = numasched.qkv_rope_cache(qkv, cos, sin, kc, vc, slots, heads=H, kv_heads=HK, return_kv=True)
    check("qkv_rope_cache return_kv q", q, rq, 1e-2)
    check("qkv_rope_cache return_kv k", k, rk, 1e-2)
    check("qkv_rope_cache return_kv v", v, rv, 1e-2)


def hopper_cases():
    """sm_90 only (the Gluon kernels): the warp-specialised GEMM (data-parallel and split-K in
    lockstep), the weight-first decode GEMM (split-K counters over two calls, the GLU form, a
    RowScale), and the SwiGLU activation kernel; N not a multiple of the tiles, K not a multiple of
    the boxes."""
    if DEV != "cuda" or torch.cuda.get_device_capability()[0] != 9:
        print("hopper cases: skipped (not an sm_90 GPU)", flush=True)
        return
    from numasched.gemm_weight_first import RowScale, WeightFirstPlan
    from numasched.gemm_ws import WsConfig, WsGemmPlan, split_config

    for (m, n, k), cfg in [((97, 520, 1000), WsConfig()), ((97, 1000, 3000), split_config(128, 2))]:
        a = torch.randn(m, k, device=DEV, dtype=BF16)
        b = torch.randn(n, k, device=DEV, dtype=BF16).t()
        out = torch.full((m, n), float("nan"), device=DEV, dtype=BF16)
        WsGemmPlan(a, b, out, config=cfg).run(a, b, out)
        check(f"gemm_ws {m}x{n}x{k} split {cfg.sk_split}", out, a.double() @ b.double(), 1e-2)
    for (m, n, k), glu, splits in [((5, 200, 1000), False, 3), ((13, 136, 520), True, 2), ((16, 384, 1024), False, 1)]:
        x = torch.randn(m, k, device=DEV, dtype=BF16)
        w = torch.randn(2 * n if glu else n, k, device=DEV, dtype=BF16) / k ** 0.5
        plan = WeightFirstPlan(x, w, glu=glu, splits=splits)
        y = x.double() @ w.double().T
        ref = torch.nn.functional.silu(y[:, :n]) * y[:, n:] if glu else y
        for call in range(2):   # the split-K counters are left zero for the second call
            out = torch.full((m, n), float("nan"), device=DEV, dtype=BF16)
            plan.run(x, w, out)
            check(f"weight-first {m}x{n}x{k} glu={glu} splits={splits} call {call}", out, ref, 1e-2)
    # RMSNorm's row factor from a producer's per-part sums of squares (the reduce form's consumer)
    m, n, k, parts = 16, 256, 512, 8
    x = torch.randn(m, k, device=DEV, dtype=BF16)
    w = torch.randn(n, k, device=DEV, dtype=BF16) / k ** 0.5
    plan = WeightFirstPlan(x, w)
    xf = x.float()
    sums = torch.zeros(256, plan.cfg.block_t, device=DEV, dtype=torch.float32)
    sums[:parts, :m] = (xf * xf).view(m, parts, k // parts).sum(-1).T
    out = torch.full((m, n), float("nan"), device=DEV, dtype=BF16)
    plan.run(x, w, out, scale=RowScale(sums[:parts], 1e-6))
    inv = 1.0 / torch.sqrt((x.double() ** 2).mean(-1, keepdim=True) + 1e-6)
    check("weight-first row scale", out, (x.double() * inv) @ w.double().T, 1e-2)
    gu = torch.randn(37, 2 * 200, device=DEV, dtype=BF16)
    check("swiglu", numasched.swiglu(gu), torch.nn.functional.silu(gu[:, :200].double()) * gu[:, 200:].double(), 1e-2)


if __name__ == "__main__":
    if DEV == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        print("scripts/sanitize_kernels.py needs a CUDA GPU (or TRITON_INTERPRET=1 for a dry run on CPU)",
              file=sys.stderr)
        sys.exit(2)
    numasched.options.set(autotune=False)
    attention_cases()
    decode_cases()
    gemm_cases()
    rope_cases()
    hopper_cases()
    if DEV == "cuda":
        torch.cuda.synchronize()
    print("ALL OK" if not failures else f"FAILED: {failures}", flush=True)
    sys.exit(1 if failures else 0)
