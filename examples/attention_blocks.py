"""A per-(batch, head, block) kernel of your own that takes a numasched attention policy by name.

For each query row the kernel computes the largest scaled score against every key of its KV head,
``max_j (q_i . k_j) * scale`` (the running max of an attention kernel's softmax), one program per
(batch, query head, query block). It reads all of a KV head's keys for each of its blocks, as
attention does, so the policy decides which programs share K in one L2. ``attention_item`` says
which (batch, head, block) a program owns; the policy arrives as one constexpr. The kernel also
records which program handled each item, checked against the policy's NumPy reference map.

    python examples/attention_blocks.py           # a GPU, or TRITON_INTERPRET=1 on a CPU
"""
import sys

import torch
import triton
import triton.language as tl

from numasched import mappings, topology
from numasched.mappings.jit import attention_item


@triton.jit
def block_max_score_kernel(Q, K, OUT, OWNER, B, H, HK, L, scale, MAPPING: tl.constexpr, D: tl.constexpr,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    pid = tl.program_id(0)
    NB = tl.cdiv(L, BLOCK_M)
    # the one line a policy needs: which (batch, head, block) is mine
    b, h, m = attention_item(pid, B, H, HK, NB, MAPPING)
    hk = h // (H // HK)
    rows = m * BLOCK_M + tl.arange(0, BLOCK_M)
    d = tl.arange(0, D)
    q = tl.load(Q + ((b * H + h) * L + rows[:, None]) * D + d[None, :], mask=rows[:, None] < L, other=0.0)
    best = tl.full([BLOCK_M], float("-inf"), tl.float32)
    for n0 in range(0, L, BLOCK_N):
        cols = n0 + tl.arange(0, BLOCK_N)
        k = tl.load(K + ((b * HK + hk) * L + cols[:, None]) * D + d[None, :], mask=cols[:, None] < L, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
        s = tl.where(cols[None, :] < L, s, float("-inf"))
        best = tl.maximum(best, tl.max(s, 1))
    tl.store(OUT + (b * H + h) * L + rows, best, mask=rows < L)
    tl.store(OWNER + (b * H + h) * NB + m, pid)


def block_max_score(q, k, mapping="auto", block=(16, 16)):
    """q (B, H, L, D), k (B, HK, L, D), contiguous: the row-wise max scaled score (B, H, L) and the
    (B, H, blocks) map of the program that handled each (batch, head, block)."""
    B, H, L, D = q.shape
    HK = k.shape[1]
    bm, bn = block
    NB = triton.cdiv(L, bm)
    grid = mappings.AttentionGrid(B, H, HK, NB)
    out = torch.empty(B, H, L, dtype=torch.float32, device=q.device)
    owner = torch.full((B, H, NB), -1, dtype=torch.int32, device=q.device)
    block_max_score_kernel[(grid.size,)](q, k, out, owner, B, H, HK, L, D ** -0.5,
                                         MAPPING=mappings.kernel_arg(mapping, "attention", grid=grid), D=D,
                                         BLOCK_M=bm, BLOCK_N=bn)
    return out, owner


def expected_owner(mapping, B: int, H: int, HK: int, NB: int, num_domains: int):
    """The owner map the policy's NumPy reference predicts."""
    grid = mappings.AttentionGrid(B, H, HK, NB)
    policy = mappings.resolve(mapping, "attention", topology.current(), grid)
    items = policy.reference(range(grid.size), grid, num_domains)
    want = torch.full((B, H, NB), -1, dtype=torch.int32)
    want[items[:, 0], items[:, 1], items[:, 2]] = torch.arange(grid.size, dtype=torch.int32)
    return want


def reference(q, k):
    G = q.shape[1] // k.shape[1]
    s = q.double() @ k.double().repeat_interleave(G, 1).transpose(-1, -2) * q.shape[-1] ** -0.5
    return s.amax(-1)


def main() -> int:
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    q = torch.randn(2, 8, 40, 32, device=dev)
    k = torch.randn(2, 2, 40, 32, device=dev)
    ok = True
    with topology.use("mi300x"):
        for name in ("block_first", "head_first", "swizzled_block_first", "swizzled_head_first"):
            out, owner = block_max_score(q, k, name)
            err = (out.double() - reference(q, k)).abs().max().item()
            same = torch.equal(owner.cpu(), expected_owner(name, 2, 8, 2, owner.shape[2],
                                                           topology.current().num_domains))
            ok &= err < 1e-4 and same
            print(f"{name:22s} max error {err:.1e}, owner map matches the reference: {same}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
