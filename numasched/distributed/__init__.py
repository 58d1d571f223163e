"""numasched.distributed: fused cross-GPU kernels over Iris's symmetric heap.

Launch one process per GPU with torchrun, then::

    import torch, torch.distributed as dist
    import numasched.distributed as nd
    dist.init_process_group("nccl")
    ctx = nd.init(workload=[("all_gather_matmul", a_local, b)])   # heap sized from the calls
    c = nd.all_gather_matmul(a_local, b, ctx=ctx)                   # (M_local*world, N_local)
    y = nd.matmul_reduce_scatter(a, b_local, ctx=ctx)               # (M/world, N), summed over ranks
    o = nd.flash_decode_distributed(q, k_local, v_local, lens_local, ctx=ctx)

Every rank must make the same calls with the same shapes and dtypes, in the same order (the
first call of each signature exchanges a small header through torch.distributed and raises
ValueError on a mismatch; later calls do not synchronise the host). A rank that never arrives
makes the others raise TimeoutError naming it after ``timeout_s`` (default 30 s) instead of
hanging; the context is then unusable. Calls can repeat back to back and be captured in a CUDA
graph (call once before capturing; the host-side timeout check is skipped while capturing: call
``ctx.check()`` after replaying).

Iris (``pip install tokenspeed-iris``) is imported only when a context is created: importing this
module needs neither Iris nor a GPU. ``SimWorld`` runs the same kernels for several ranks in one
CPU process under Triton's interpreter (tests). See docs/distributed.md.
"""
from __future__ import annotations

from typing import Optional

from ._context import DEFAULT_HEAP, MAX_WORLD, DistContext, SimWorld, alloc_bytes  # noqa: F401
from ._ops import required_heap_bytes, set_local_decode, torch_local_decode  # noqa: F401

__all__ = ["init", "DistContext", "SimWorld", "all_gather_matmul", "matmul_reduce_scatter",
           "flash_decode_distributed", "required_heap_bytes", "set_local_decode", "torch_local_decode"]


def init(heap_bytes: Optional[int] = None, *, workload=None, timeout_s: float = 30.0,
         allocator: Optional[str] = None) -> DistContext:
    """Start Iris on this rank (after ``torch.distributed.init_process_group("nccl")``).

    heap_bytes: symmetric heap per GPU. Default: what ``workload`` needs (a list of
        ``(op name, *tensors)`` as each rank will pass them; see :func:`required_heap_bytes`),
        or 1 GiB. A call whose buffers do not fit raises ValueError saying how much is missing.
    timeout_s: how long a rank waits for a peer's data before giving up (TimeoutError).
    allocator: Iris allocator; default "vmem_chunked" on NVIDIA (the only one that works there),
        Iris's default on AMD; the IRIS_ALLOCATOR environment variable overrides both.
    Raises RuntimeError when the GPUs lack peer access (torch.cuda.can_device_access_peer) or the
    ranks span hosts.
    """
    if heap_bytes is None:
        if workload:
            import torch.distributed as dist

            if not dist.is_initialized():
                raise RuntimeError("numasched.distributed.init: call torch.distributed.init_process_group('nccl') "
                                   "first (launch with torchrun)")
            heap_bytes = required_heap_bytes(workload, dist.get_world_size()) + alloc_bytes(1)
        else:
            heap_bytes = DEFAULT_HEAP
    if int(heap_bytes) < alloc_bytes(1):
        raise ValueError(f"heap_bytes must be at least {alloc_bytes(1)} (one allocation), got {heap_bytes}")
    return DistContext(int(heap_bytes), timeout_s=timeout_s, allocator=allocator)


def all_gather_matmul(a_local, b, *, ctx, mapping="auto", impl: str = "fused", out=None, check: bool = True,
                      communicate: bool = True):
    """``all_gather(a_local, dim=0) @ b`` in one fused kernel.

    a_local: (M_local, K), this rank's rows (rank r holds rows r*M_local ... of A); b: (K, N_local).
    Returns (M_local * world, N_local). Tiles of the local rows run first, then each peer's rows
    (rank+1, rank+2, ...) as their ready flags arrive; ``mapping`` (a GEMM policy name or "auto")
    orders the tiles inside each shard. ``check``: read the timeout status after the call
    (synchronises; skipped while capturing a CUDA graph). ``communicate=False`` times the kernel
    with communication switched off (peer rows are then garbage). ``impl="ce"``: the
    producer/consumer pair instead (cuBLAS GEMM per shard, copy-engine transfers on a side stream;
    no SM spent on communication; ``mapping`` then does not apply).
    """
    from ._ops import run

    return run(ctx, "all_gather_matmul", a_local, b, mapping=mapping, impl=impl, out=out, check=check,
               communicate=communicate)


def matmul_reduce_scatter(a, b_local, *, ctx, mapping="auto", impl: str = "fused", out=None, check: bool = True,
                          communicate: bool = True):
    """Row-parallel partner: this rank's (M / world, N) slice of ``sum over ranks of a @ b_local``.

    a: (M, K_local), b_local: (K_local, N); M must be a multiple of the world size. Partial tiles
    for peers are computed first and stored straight into their buffers; this rank's own slice
    comes last and sums all partials in rank order (fp32 accumulate). ``impl="ce"``: cuBLAS
    partials pushed by the copy engine on a side stream, then one summing kernel.
    """
    from ._ops import run

    return run(ctx, "matmul_reduce_scatter", a, b_local, mapping=mapping, impl=impl, out=out, check=check,
               communicate=communicate)


def flash_decode_distributed(q, k_cache_local, v_cache_local, cache_seqlens_local, *, ctx, return_lse: bool = False,
                             out=None, check: bool = True, local_decode=None, communicate: bool = True):
    """Decode attention over a KV sequence split across ranks; every rank returns the full result.

    q: (B, H, D); k_cache_local, v_cache_local: (B, S_local, HK, D), this rank's part of the
    context; cache_seqlens_local: (B,) valid tokens of each row in this rank's part (0 allowed).
    Each rank computes its partial (out, lse), pushes it to every peer with a release flag and
    merges all partials as they arrive (same order on every rank: identical results).
    Returns out (B, H, D) (and lse (B, H), fp32 natural log, if ``return_lse``).
    """
    from ._ops import run

    return run(ctx, "flash_decode_distributed", q, k_cache_local, v_cache_local, cache_seqlens_local,
               return_lse=return_lse, out=out, check=check, local_decode=local_decode, communicate=communicate)
