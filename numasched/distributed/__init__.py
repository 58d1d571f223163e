"""numasched.distributed: fused cross-GPU kernels over Iris's symmetric heap.

Launch one process per GPU with torchrun, then::

    import torch, torch.distributed as dist
    import numasched.distributed as nd
    dist.init_process_group("nccl")
    ctx = nd.init(workload=[("all_gather_matmul", a_local, b)])   # heap sized from the calls
    c = nd.all_gather_matmul(a_local, b, ctx=ctx)                   # (M_local*world, N_local)
    y = nd.matmul_reduce_scatter(a, b_local, ctx=ctx)               # (M/world, N), summed over ranks
    z = nd.all_reduce(x, ctx=ctx)                                   # x summed over ranks, on every rank
    w = nd.matmul_all_reduce(a, b_local, ctx=ctx)                   # (M, N), summed over ranks
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

from ._context import DEFAULT_HEAP, MAX_WORLD, DistContext, alloc_bytes  # noqa: F401
from ._common import OPS, required_heap_bytes  # noqa: F401
# one module per collective; each registers its op in OPS. The public function of the same name
# is bound here after its module, so ``numasched.distributed.all_gather_matmul`` is the function
# (the module: importlib.import_module("numasched.distributed.all_gather_matmul")).
from .all_gather_matmul import all_gather_matmul  # noqa: F401
from .matmul_reduce_scatter import matmul_reduce_scatter  # noqa: F401
from .flash_decode_distributed import (flash_decode_distributed, set_local_decode,  # noqa: F401
                                       torch_local_decode)
from .all_reduce import all_reduce  # noqa: F401
from .all_reduce_add_rmsnorm import PushTarget, all_reduce_add_rmsnorm, push_target  # noqa: F401
from .all_reduce_add_bands import ReduceTarget, reduce_target  # noqa: F401
from .matmul_all_reduce import MatmulAllReducePlan, matmul_all_reduce, plan_matmul_all_reduce  # noqa: F401
from .matmul_all_reduce import matmul_all_reduce_plan  # noqa: F401
from . import cost  # noqa: F401
from ._sim import SimWorld  # noqa: F401

__all__ = ["init", "DistContext", "SimWorld", "all_reduce", "all_reduce_add_rmsnorm", "matmul_all_reduce", "plan_matmul_all_reduce",
           "matmul_all_reduce_plan", "push_target", "PushTarget", "reduce_target", "ReduceTarget",
           "MatmulAllReducePlan", "cost", "all_gather_matmul", "matmul_reduce_scatter",
           "flash_decode_distributed", "required_heap_bytes", "set_local_decode", "torch_local_decode"]


def init(heap_bytes: Optional[int] = None, *, workload=None, timeout_s: float = 30.0,
         allocator: Optional[str] = None, group=None, bounded_only: bool = False,
         recycle: bool = False) -> DistContext:
    """Start Iris on this rank (after ``torch.distributed.init_process_group("nccl")``).

    heap_bytes: symmetric heap per GPU. Default: what ``workload`` needs (a list of
        ``(op name, *tensors)`` as each rank will pass them; see :func:`required_heap_bytes`),
        or 1 GiB. A call whose buffers do not fit raises ValueError saying how much is missing.
    timeout_s: how long a rank waits for a peer's data before giving up (TimeoutError).
    allocator: Iris allocator; default "vmem_chunked" on NVIDIA (the only one that works there),
        Iris's default on AMD; the IRIS_ALLOCATOR environment variable overrides both.
    group: a torch.distributed process group of GPUs on this host (e.g. one tensor-parallel
        group of a job whose other dimension runs over NCCL); the ops then run over its members
        only, numbered by their rank in the group. Every rank of the world calls ``init`` at
        the same time (the Iris heap is created over the whole world), each with its own group.
    bounded_only: ``impl="auto"`` never routes a call to torch's symmetric-memory ops, whose
        barriers wait without a bound (a missing peer hangs the stream), nor to NCCL (the bulk
        paths and NCCL's all-reduce): eager, its waits end at the process group's timeout, but
        in a CUDA graph replay its watchdog sees no work and a stopped peer hangs the replay.
        numasched's own kernels wait at most ``timeout_s`` and raise TimeoutError naming the
        rank. Off by default: auto picks symm_mem or NCCL where it is fastest (all_gather_matmul
        at M >= 1024 on two H200s, bench/results/collectives-2xh200-2026-11-23.csv; NCCL's
        all-reduce from 8 MB on four ranks). Names a call asks for (``impl="nccl"``) still run.
    recycle: when a new call signature's buffers do not fit, give back the buffers of the least
        recently called plans that no CUDA graph was captured with (every rank waits for all its
        work and for the others once, then frees the same plans; a plan given back is made again
        on its next call) instead of raising. For servers whose shapes keep changing (prefill
        lengths): without it every signature keeps its buffers for the context's life. The heap is
        then one slab that numasched places buffers in (Iris reserves twice ``heap_bytes`` for its
        rounding, as for ``group``). A plan used in a capture is never given back
        (``ctx.pinned``); ``ctx.recycled`` counts the plans given back.
    Raises RuntimeError when the GPUs lack peer access (torch.cuda.can_device_access_peer) or the
    ranks span hosts.
    """
    if heap_bytes is None:
        if workload:
            import torch.distributed as dist

            if not dist.is_initialized():
                raise RuntimeError("numasched.distributed.init: call torch.distributed.init_process_group('nccl') "
                                   "first (launch with torchrun)")
            size = dist.get_world_size() if group is None else dist.get_world_size(group)
            heap_bytes = required_heap_bytes(workload, size) + alloc_bytes(1)
        else:
            heap_bytes = DEFAULT_HEAP
    if int(heap_bytes) < alloc_bytes(1):
        raise ValueError(f"heap_bytes must be at least {alloc_bytes(1)} (one allocation), got {heap_bytes}")
    return DistContext(int(heap_bytes), timeout_s=timeout_s, allocator=allocator, group=group,
                       bounded_only=bounded_only, recycle=recycle)

