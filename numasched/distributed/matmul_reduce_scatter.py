"""GEMM + reduce-scatter: this rank's slice of ``sum over ranks of a @ b_local`` (kernel: kernels/dist_gemm.py)."""
from __future__ import annotations

import torch

from numasched import options
from numasched._validate import check_int32_indexing

from . import _common, _ws, cost
from ._common import Call, Plan, _aligned, _bulk_ok, _cdiv, _check_operands, _desc, _make_plan, _on_gpu, _Op
from ._common import _auto_nccl_ok, _auto_symm_mem_ok, _bulk_engine, _matmul, group_name
from ._common import _output, _policy, _resolve_impl, _tma_ok, register, run


@register
class MatmulReduceScatter(_Op):
    name = "matmul_reduce_scatter"
    sim_phases = ("push", "consume")

    @staticmethod
    def describe(a, b_local, *, world, mapping="auto", impl="auto", cfg=None, bulk_ok=True, symm_ok=False,
                 ws=False, num_sms=132) -> Call:
        """``ws``: the warp-specialised kernel may run it (numasched.distributed._ws.ws_wanted); it
        does where ``cost.rs_ws_pays`` (or always, under ``options.fused_ws=True``)."""
        M, Kl = a.shape
        N = b_local.shape[1]
        Ms = M // world
        requested, impl = impl, _resolve_impl("matmul_reduce_scatter", impl, M, N, Kl, a.dtype, world, bulk_ok,
                                              symm_ok, ws, num_sms)
        bulk_gemm = _bulk_engine(requested, impl, M, a)
        cfg = cfg or _common._gemm_cfg(a.dtype, _on_gpu(a), N)
        if ws and impl == "fused" and (options.current().fused_ws or cost.rs_ws_pays(M, N, world, num_sms)):
            cfg = dict(cfg, WS=True)
        tms, tn = _cdiv(Ms, cfg["BLOCK_M"]), _cdiv(N, cfg["BLOCK_N"])
        policy, nd = _policy(mapping, tms, tn)
        header = dict(op="matmul_reduce_scatter", a_shape=tuple(a.shape), b_local_shape=tuple(b_local.shape),
                      dtype=str(a.dtype), mapping=policy.name, impl=impl, world=world)
        if impl == "bulk":
            header["gemm"] = bulk_gemm
        key = ("matmul_reduce_scatter", M, Kl, N, a.dtype, policy.name, impl, bulk_gemm, tuple(sorted(cfg.items())))
        return Call("matmul_reduce_scatter", key, header, dict(a=a, b_local=b_local),
                    dict(cfg, Ms=Ms, Kl=Kl, N=N, TMS=tms, TN=tn, policy=policy, num_domains=nd, world=world,
                         impl=impl, bulk_gemm=bulk_gemm))

    @staticmethod
    def buffers(call) -> list:
        c, W = call.cfg, call.cfg["world"]
        if c["impl"] in ("bulk", "symm_mem"):  # NCCL's / torch's buffers, not the heap
            return []
        if c["impl"] == "ce":
            bufs = [("flags", (2, W), torch.int64)]
            if W > 1:
                bufs.append(("partials", (W, c["Ms"], c["N"]), call.tensors["a"].dtype))
            return bufs
        # (W, 2 x tiles): the WS kernel's flags are per half tile (options.fused_ws; the Triton kernel's in the first half)
        bufs = [("flags", (W, 2 * c["TMS"] * c["TN"]), torch.int64)]
        if W > 1:
            bufs.append(("partials", (2, W, c["Ms"], c["N"]), call.tensors["a"].dtype))
        return bufs

    @classmethod
    def prepare(cls, ctx, a, b_local, *, mapping="auto", impl="auto", out=None, communicate=True):
        _check_operands(ctx, "a", a, "b_local", b_local, "K_local")
        if a.shape[0] % ctx.world:
            raise ValueError(f"a has {a.shape[0]} rows, not a multiple of the world size {ctx.world} "
                             f"(each rank returns a.shape[0] / world rows)")
        check_int32_indexing("a", a)
        check_int32_indexing("b_local", b_local)
        call = cls.describe(a, b_local, world=ctx.world, mapping=mapping, impl=impl,
                            bulk_ok=_bulk_ok(ctx) if impl != "auto" else _auto_nccl_ok(ctx),
                            symm_ok=_auto_symm_mem_ok(ctx), ws=_ws.ws_wanted(ctx),
                            num_sms=getattr(ctx, "num_sms", 132))
        call.tensors["out"] = _output(out, (call.cfg["Ms"], call.cfg["N"]), a, call.cfg["impl"])
        call.extra["communicate"] = bool(communicate)
        call.extra["out_given"] = out is not None
        return call

    @classmethod
    def plan(cls, ctx, call) -> Plan:
        local = ()
        if call.cfg["impl"] == "ce":   # cuBLAS outputs: partial slices for peers, our own partial
            c, dt = call.cfg, call.tensors["a"].dtype
            local = (("stage", (ctx.world, c["Ms"], c["N"]), dt), ("own", (c["Ms"], c["N"]), dt))
        return _make_plan(ctx, cls, call, local)

    @staticmethod
    def _launch_ce(ctx, plan, call, phase):
        from ._ce import matmul_reduce_scatter_ce

        return matmul_reduce_scatter_ce(ctx, plan, call, phase)

    @staticmethod
    def _launch_bulk(ctx, plan, call, phase):
        """One GEMM of all rows, then NCCL reduce-scatter: torch.matmul (the bulk-synchronous
        baseline), or numasched's where "auto" chose this path and it leads (cfg bulk_gemm)."""
        import torch.distributed as dist

        t = call.tensors
        part = _matmul(call.cfg["bulk_gemm"], t["a"], t["b_local"])
        out = t["out"]
        if out.is_contiguous():
            dist.reduce_scatter_tensor(out, part, group=ctx.group)
        else:
            res = torch.empty_like(out, memory_format=torch.contiguous_format)
            dist.reduce_scatter_tensor(res, part, group=ctx.group)
            out.copy_(res)
        return out

    @staticmethod
    def _launch_symm_mem(ctx, plan, call, phase):
        """torch symmetric memory's fused matmul + reduce-scatter (cuBLAS + copy engine, overlapped)."""
        t = call.tensors
        y = torch.ops.symm_mem.fused_matmul_reduce_scatter(t["a"], t["b_local"], "sum", 0, group_name(ctx))
        if call.extra.get("out_given"):
            t["out"].copy_(y)
            return t["out"]
        return y

    @staticmethod
    def _launch_fused(ctx, plan, call, phase):
        c, t, bf = call.cfg, call.tensors, plan.bufs
        W, TS = ctx.world, c["TMS"] * c["TN"]
        lo, hi = {"push": (0, (W - 1) * TS), "consume": ((W - 1) * TS, W * TS)}.get(phase, (0, W * TS))
        G = max(1, min(ctx.num_sms, hi - lo))
        a, b, out = t["a"], t["b_local"], t["out"]
        if W == 1:   # no partial buffer: the kernel never touches it
            partials = out
        else:
            partials = bf["partials"]
        b_trans = b.stride(1) != 1 and b.stride(0) == 1   # w.T of an (N, K) weight
        b_store = b.T if b_trans else b
        if (W == 2 and phase == "full" and c.get("WS")
                and _ws.ws_ok(ctx, a, b_store, out, c["Ms"], c["N"], c["Kl"])):
            # the tile pairs on the warp-specialised kernel (RS): one pair a (peer, ours) slice tile
            return _ws.launch(ctx, plan, a=a, b_store=b_store, b_trans=b_trans, out=out, recv=partials,
                              flags=bf["flags"], epoch=bf["epoch"], counters=bf["counters"], rows=c["Ms"],
                              N=c["N"], K=c["Kl"], residual=False, direct=False, rs=True)
        use_tma = c["USE_TMA"] and _tma_ok(a, b)
        if use_tma:
            descs = (_desc(a, [c["BLOCK_M"], c["BLOCK_K"]]), _desc(b, [c["BLOCK_K"], c["BLOCK_N"]]))
        else:
            descs = (None, None)
        args = (a, b, out, partials, *descs, bf["flags"], ctx.status, bf["epoch"], bf["counters"], ctx.heap_bases,
                ctx.rank, c["Ms"], c["N"], c["Kl"], a.stride(0), a.stride(1), b.stride(0), b.stride(1),
                out.stride(0), out.stride(1), G, ctx.wait_bound, lo, hi)
        layout = (use_tma, _aligned(a), a.stride(), _aligned(b), b.stride(), _aligned(out), out.stride())

        def build():
            from numasched.kernels.dist_gemm import matmul_reduce_scatter_kernel

            # FLAT: static tickets in one pipelined loop (GPU, TMA, the whole ticket range, two ranks:
            # kernels/dist_gemm.py, _rs_flat)
            flat = (bool(c.get("FLAT")) and use_tma and ctx.device.type != "cpu" and phase in ("full", "nocomm")
                    and ctx.world == 2)
            kw = _Op._gemm_kw(ctx, c, c["Kl"], use_tma, COMM=phase != "nocomm",
                              BUMP_EPOCH=phase in ("full", "consume"), FLAT=flat, OUT_CONTIG=flat and out.is_contiguous())
            return matmul_reduce_scatter_kernel, kw

        _Op._run(ctx, plan, call, phase, G, args, layout, () if phase == "push" else (out,), build)
        return None if phase == "push" else out


def matmul_reduce_scatter(a, b_local, *, ctx, mapping="auto", impl: str = "auto", out=None, check: bool = True,
                          communicate: bool = True):
    """Row-parallel partner: this rank's (M / world, N) slice of ``sum over ranks of a @ b_local``.

    a: (M, K_local), b_local: (K_local, N); M must be a multiple of the world size. Partial tiles
    for peers are computed first and stored straight into their buffers; this rank's own slice
    comes last and sums all partials in rank order (fp32 accumulate). ``impl="ce"``: cuBLAS
    partials pushed by the copy engine on a side stream, then one summing kernel. ``impl="bulk"``:
    torch.matmul then NCCL reduce-scatter. ``impl="auto"`` (default): fused or bulk by
    :mod:`numasched.distributed.cost` (fused in the simulation).
    """
    return run(ctx, "matmul_reduce_scatter", a, b_local, mapping=mapping, impl=impl, out=out, check=check,
               communicate=communicate)
