"""GPU check of the thin launch: repeated calls of one plan on fresh data stay right.

A plan's first call goes through Triton; later calls hand arguments to the compiled kernel's C
launcher directly (numasched._launch), with TMA descriptors cached by base pointer. This script
runs every public call several times per shape on fresh random inputs (new tensors, so new
pointers, and the same tensors refilled, so cached descriptors), with NaN-poisoned outputs, and
compares with a float64 reference (fp32 for GEMM). It also times eager calls of each to show the
direct path is the one taken (Launch.raw set).

    python3 scripts/thin_launch_check.py          # on a CUDA GPU
"""
import sys

import torch
import torch.nn.functional as F

import numasched
from numasched import observe
from numasched._plan import PLANS


def rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def main() -> int:
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    dev, bf = "cuda", torch.bfloat16
    bad = []
    with observe.record(poison=True):
        # decode: contiguous and paged, with and without lse, one split and several
        for B, H, HK, L in ((1, 32, 8, 1024), (4, 32, 8, 8192), (64, 32, 8, 512)):
            k = torch.randn(B, L, HK, 128, device=dev, dtype=bf)
            v = torch.randn(B, L, HK, 128, device=dev, dtype=bf)
            lens = torch.randint(1, L + 1, (B,), device=dev, dtype=torch.int32)
            for step in range(4):
                q = torch.randn(B, H, 128, device=dev, dtype=bf)
                if step == 2:
                    k.normal_()
                out = numasched.flash_decode(q, k, v, cache_seqlens=lens)
                ref = F.scaled_dot_product_attention(
                    q.double()[:, :, None], k.double().transpose(1, 2), v.double().transpose(1, 2),
                    attn_mask=(torch.arange(L, device=dev)[None, :] < lens[:, None])[:, None, None, :],
                    enable_gqa=True)[:, :, 0]
                e = rel(out, ref)
                if not e < 1e-2:
                    bad.append(("flash_decode", B, L, step, e))
        # attention through the drop-in and attention_forward
        for shape in ((2, 8, 1000, 128), (1, 4, 77, 64)):
            for step in range(3):
                q, k, v = (torch.randn(*shape, device=dev, dtype=bf) for _ in range(3))
                out = numasched.scaled_dot_product_attention(q, k, v, is_causal=True)
                ref = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=True)
                e = rel(out, ref)
                o2, _ = numasched.attention_forward(q, k, v, causal=True)
                e2 = rel(o2, ref)
                if not (e < 1e-2 and e2 < 1e-2):
                    bad.append(("attention", shape, step, e, e2))
        # GEMM: TMA path, new tensors (new descriptors) and refilled ones (cached descriptors)
        for M, N, K in ((256, 256, 256), (16, 4096, 4096), (3000, 5000, 700)):
            a = torch.randn(M, K, device=dev, dtype=bf)
            w = torch.randn(N, K, device=dev, dtype=bf)
            for step in range(5):
                if step % 2:
                    a.normal_()
                    w.normal_()
                else:
                    a = torch.randn(M, K, device=dev, dtype=bf)
                    w = torch.randn(N, K, device=dev, dtype=bf)
                c = numasched.matmul(a, w.T)
                e = rel(c, a.float() @ w.float().T)
                if not e < 1e-2:
                    bad.append(("matmul", M, N, K, step, e))
    torch.cuda.synchronize()
    plans = [p for p in PLANS.plans() if hasattr(p, "op")]  # (the SDPA routes hold plans too)
    direct = {p.op: [] for p in plans}
    for p in plans:
        launch = getattr(p, "_split", None) or getattr(p, "_launch", None)
        if launch is not None and hasattr(launch, "raw"):
            direct[p.op].append(launch.raw is not None)
    for op, flags in direct.items():
        print(f"{op:14s} plans {len(flags):2d}, on the direct C-launcher path: {sum(flags)}")
    if bad:
        for b in bad:
            print("WRONG", b)
        return 1
    print("thin launch check: ALL OK (every repeated call matched the reference)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
