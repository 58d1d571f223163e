"""All-gather + GEMM: ``all_gather(a_local, dim=0) @ b`` (kernel: kernels/dist_gemm.py)."""
from __future__ import annotations

import torch

from numasched._validate import check_int32_indexing

from . import _common
from ._common import Call, _cdiv, _check_operands, _desc, _on_gpu, _aligned, _Op, _output, _policy
from ._common import _auto_nccl_ok, _auto_symm_mem_ok, _bulk_engine, _bulk_ok, _matmul, _resolve_impl, _tma_ok
from ._common import group_name, register, run


@register
class AllGatherMatmul(_Op):
    name = "all_gather_matmul"
    sim_phases = ("push", "consume")

    @staticmethod
    def describe(a_local, b, *, world, mapping="auto", impl="auto", cfg=None, bulk_ok=True, symm_ok=False) -> Call:
        Ml, K = a_local.shape
        N = b.shape[1]
        requested, impl = impl, _resolve_impl("all_gather_matmul", impl, Ml * world, N, K, a_local.dtype, world,
                                              bulk_ok, symm_ok)
        bulk_gemm = _bulk_engine(requested, impl, Ml * world, a_local)
        cfg = cfg or _common._gemm_cfg(a_local.dtype, _on_gpu(a_local), N)
        tms, tn = _cdiv(Ml, cfg["BLOCK_M"]), _cdiv(N, cfg["BLOCK_N"])
        policy, nd = _policy(mapping, tms, tn)
        header = dict(op="all_gather_matmul", a_local_shape=tuple(a_local.shape), b_shape=tuple(b.shape),
                      dtype=str(a_local.dtype), mapping=policy.name, impl=impl, world=world)
        if impl == "bulk":
            header["gemm"] = bulk_gemm
        key = ("all_gather_matmul", Ml, K, N, a_local.dtype, policy.name, impl, bulk_gemm, tuple(sorted(cfg.items())))
        return Call("all_gather_matmul", key, header, dict(a_local=a_local, b=b),
                    dict(cfg, Ml=Ml, K=K, N=N, TMS=tms, TN=tn, policy=policy, num_domains=nd, world=world, impl=impl,
                         bulk_gemm=bulk_gemm))

    @staticmethod
    def buffers(call) -> list:
        c, W = call.cfg, call.cfg["world"]
        if c["impl"] in ("bulk", "symm_mem"):  # NCCL's / torch's buffers, not the heap
            return []
        if c["impl"] == "ce":   # ready + ack flags per peer, one receive buffer per peer
            bufs = [("flags", (2, W), torch.int64)]
            if W > 1:
                bufs.append(("gather", (W, c["Ml"], c["K"]), call.tensors["a_local"].dtype))
            return bufs
        bufs = [("flags", (W, c["TMS"]), torch.int64)]
        if W > 1:
            bufs.append(("gather", (2, W, c["Ml"], c["K"]), call.tensors["a_local"].dtype))
        return bufs

    @classmethod
    def prepare(cls, ctx, a_local, b, *, mapping="auto", impl="auto", out=None, communicate=True):
        _check_operands(ctx, "a_local", a_local, "b", b, "K")
        check_int32_indexing("b", b)
        a_local = a_local.contiguous()   # pushed as flat row blocks; read with unit stride
        call = cls.describe(a_local, b, world=ctx.world, mapping=mapping, impl=impl,
                            bulk_ok=_bulk_ok(ctx) if impl != "auto" else _auto_nccl_ok(ctx),
                            symm_ok=_auto_symm_mem_ok(ctx))
        call.tensors["out"] = _output(out, (ctx.world * call.cfg["Ml"], call.cfg["N"]), a_local, call.cfg["impl"])
        call.extra["communicate"] = bool(communicate)
        call.extra["out_given"] = out is not None
        return call

    @staticmethod
    def _launch_ce(ctx, plan, call, phase):
        from ._ce import all_gather_matmul_ce

        return all_gather_matmul_ce(ctx, plan, call, phase)

    @staticmethod
    def _launch_bulk(ctx, plan, call, phase):
        """NCCL all-gather of the row blocks, then one GEMM: torch.matmul (the bulk-synchronous
        baseline), or numasched's where "auto" chose this path and it leads (cfg bulk_gemm)."""
        import torch.distributed as dist

        t = call.tensors
        a, b, out = t["a_local"], t["b"], t["out"]
        full = torch.empty((ctx.world * a.shape[0], a.shape[1]), dtype=a.dtype, device=a.device)
        dist.all_gather_into_tensor(full, a, group=ctx.group)
        _matmul(call.cfg["bulk_gemm"], full, b, out=out)
        return out

    @staticmethod
    def _launch_symm_mem(ctx, plan, call, phase):
        """torch symmetric memory's fused all-gather + matmul (copy engine + cuBLAS, overlapped)."""
        t = call.tensors
        _, (c,) = torch.ops.symm_mem.fused_all_gather_matmul(t["a_local"], [t["b"]], 0, group_name(ctx))
        if call.extra.get("out_given"):
            t["out"].copy_(c)
            return t["out"]
        return c

    @staticmethod
    def _launch_fused(ctx, plan, call, phase):
        c, t, bf = call.cfg, call.tensors, plan.bufs
        W, T = ctx.world, ctx.world * c["TMS"] * c["TN"]
        comm = max(1, min(c["COMM_PROGRAMS"], (W - 1) * c["TMS"]))
        G = max(1, min(ctx.num_sms, max(T, comm)))
        lo, hi = (0, 0) if phase == "push" else (0, T)
        a, b, out = t["a_local"], t["b"], t["out"]
        gather = bf.get("gather", a)
        use_tma = False
        if c["USE_TMA"]:
            g2 = gather.view(-1, c["K"])
            use_tma = _tma_ok(a, b, g2)
        if use_tma:
            bm, bn, bk = c["BLOCK_M"], c["BLOCK_N"], c["BLOCK_K"]
            descs = (_desc(a, [bm, bk]), _desc(g2, [bm, bk]), _desc(b, [bk, bn]))
        else:
            descs = (None, None, None)
        args = (a, gather, b, out, *descs, bf["flags"], ctx.status, bf["epoch"], bf["counters"], ctx.heap_bases,
                ctx.rank, c["Ml"], c["N"], c["K"], b.stride(0), b.stride(1), out.stride(0), out.stride(1),
                G, ctx.wait_bound, lo, hi)
        layout = (use_tma, _aligned(a), _aligned(b), b.stride(), _aligned(out), out.stride())

        def build():
            from numasched.kernels.dist_gemm import all_gather_matmul_kernel

            push = phase in ("full", "push")
            kw = _Op._gemm_kw(ctx, c, c["K"], use_tma, COMM_PROGRAMS=comm, PUSH_CHUNK=c["PUSH_CHUNK"],
                              DO_PUSH=push and W > 1, WAIT=phase in ("full", "consume"),
                              BUMP_EPOCH=phase in ("full", "consume"),
                              PROXY_FENCE=use_tma and ctx.device.type == "cuda" and torch.version.hip is None)
            return all_gather_matmul_kernel, kw

        _Op._run(ctx, plan, call, phase, G, args, layout, () if phase == "push" else (out,), build)
        return None if phase == "push" else out


def all_gather_matmul(a_local, b, *, ctx, mapping="auto", impl: str = "auto", out=None, check: bool = True,
                      communicate: bool = True):
    """``all_gather(a_local, dim=0) @ b`` in one fused kernel.

    a_local: (M_local, K), this rank's rows (rank r holds rows r*M_local ... of A); b: (K, N_local).
    Returns (M_local * world, N_local). Tiles of the local rows run first, then each peer's rows
    (rank+1, rank+2, ...) as their ready flags arrive; ``mapping`` (a GEMM policy name or "auto")
    orders the tiles inside each shard. ``check``: read the timeout status after the call
    (synchronises; skipped while capturing a CUDA graph). ``communicate=False`` times the kernel
    with communication switched off (peer rows are then garbage). ``impl="ce"``: the
    producer/consumer pair instead (cuBLAS GEMM per shard, copy-engine transfers on a side stream;
    no SM spent on communication; ``mapping`` then does not apply). ``impl="bulk"``: NCCL
    all-gather then torch.matmul. ``impl="auto"`` (default): fused or bulk, whichever
    :mod:`numasched.distributed.cost` predicts faster for this shape (fused in the simulation).
    """
    return run(ctx, "all_gather_matmul", a_local, b, mapping=mapping, impl=impl, out=out, check=check,
               communicate=communicate)
