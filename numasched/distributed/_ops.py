"""Host side of the three operations: argument checks, the cross-rank header, buffers, launches.

Each op is described once (``describe``: shapes only, so meta tensors work for heap sizing) and
launched in one of these phases:
    full     one fused kernel (GPU)
    nocomm   the same kernel with communication switched off (timing only: peers' rows are wrong)
    push / consume   the producer part, then the consumer part (SimWorld: interpreter, one rank
             at a time, so every rank's push must run before any rank waits)
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional

import torch

from numasched._validate import check_int32_indexing, check_same, check_tensor, kernel_device_ok

DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@dataclass
class Call:
    op: str
    key: tuple
    header: Dict[str, Any]
    tensors: Dict[str, Any]
    cfg: Dict[str, Any]
    extra: Dict[str, Any] = field(default_factory=dict)


@dataclass
class Plan:
    bufs: Dict[str, torch.Tensor]
    launches: int = 0


def check_headers(op: str, headers: List[dict]) -> None:
    """Every rank must make the same call: name the first field and rank that differ from rank 0."""
    ref = headers[0]
    for r, h in enumerate(headers[1:], 1):
        if h.get("op") != ref.get("op"):
            raise ValueError(f"ranks disagree on the collective call: rank 0 calls {ref.get('op')} but rank {r} "
                             f"calls {h.get('op')}; every rank must make the same calls in the same order")
        for k in ref:
            if h.get(k) != ref[k]:
                raise ValueError(f"{op}: {k} is {ref[k]} on rank 0 but {h.get(k)} on rank {r}; every rank must "
                                 f"pass the same shapes and dtypes")


def _on_gpu(t: torch.Tensor) -> bool:
    return t.device.type in ("cuda", "meta")


def _gemm_cfg(dtype, gpu: bool, n: int) -> dict:
    """Tile config: Hopper-friendly on GPU; tiny under the interpreter (its dot needs >= 16)."""
    tma = _tma_default(gpu)
    if not gpu:
        return dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, num_warps=4, num_stages=1, COMM_PROGRAMS=2,
                    PUSH_CHUNK=128, USE_TMA=tma)
    if dtype == torch.float32:
        return dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=32, num_warps=4, num_stages=3, COMM_PROGRAMS=16,
                    PUSH_CHUNK=8192, USE_TMA=tma)
    bn = 256 if n >= 256 else 128
    # PUSH_CHUNK: 32 KB of bf16 per loop trip of a pushing program (8 x 16 B in flight per thread)
    return dict(BLOCK_M=128, BLOCK_N=bn, BLOCK_K=64, num_warps=8, num_stages=3, COMM_PROGRAMS=16,
                PUSH_CHUNK=16384, USE_TMA=tma)


def _tma_default(gpu: bool) -> bool:
    """TMA descriptors for the fused GEMMs: on Hopper+ NVIDIA GPUs; NUMASCHED_DIST_TMA=0/1 overrides
    (1 also works in the interpreter)."""
    env = os.environ.get("NUMASCHED_DIST_TMA")
    if env in ("0", "1"):
        return env == "1"
    if not gpu or torch.version.hip is not None or not torch.cuda.is_available():
        return False
    try:
        from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.get_device_capability()[0] >= 9


def _tma_ok(*tensors) -> bool:
    """TMA needs 16-byte aligned bases and leading strides and a unit last stride."""
    for t in tensors:
        es = t.element_size()
        if t.dim() != 2 or t.stride(1) != 1 or (t.stride(0) * es) % 16 or t.data_ptr() % 16:
            return False
    return True


def _desc(t, block):
    from triton.tools.tensor_descriptor import TensorDescriptor

    return TensorDescriptor.from_tensor(t, block)


def _policy(mapping, tms: int, tn: int):
    from numasched import mappings as M
    from numasched import topology

    topo = topology.current()
    return M.resolve(mapping, "gemm", topo, M.GemmGrid(tms, tn)), topo.num_domains


def _cdiv(a, b):
    return -(-a // b)


def _check_device(ctx, name, t):
    if t.device != ctx.device:
        raise ValueError(f"{name} is on {t.device} but this rank's context is on {ctx.device}")
    if not kernel_device_ok(t):
        raise ValueError(f"{name} is on {t.device}: the kernels need a GPU, or TRITON_INTERPRET=1 on CPU")


IMPLS = ("fused", "ce")


def _check_impl(impl):
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS} (fused Triton kernel, or copy engine + cuBLAS), got {impl!r}")


def _launch_kwargs(ctx, cfg):
    return {} if ctx.device.type == "cpu" else dict(num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])


def _first_use(ctx, kernel, grid, args, kwargs):
    """On a GPU: compile before any rank starts waiting (a rank still compiling must not look dead)."""
    if ctx.device.type == "cpu":
        return
    try:
        kernel.warmup(*args, grid=grid, **kwargs)
    except Exception:  # warmup is an optimisation; the barrier below still lines ranks up
        pass
    ctx.barrier()


# ============================================================================ all-gather + GEMM
def _plan(ctx, op, call, local_bufs=()) -> Plan:
    """Symmetric-heap buffers of ``op.buffers(call)`` + private ``local_bufs`` (name, shape, dtype),
    and the device epoch word and program counters every fused kernel keeps."""
    bufs = {name: ctx.alloc(shape, dt, what=f"{op.name} {name} buffer") for name, shape, dt in op.buffers(call)}
    for name, shape, dt in local_bufs:
        bufs[name] = torch.empty(shape, dtype=dt, device=ctx.device)
    bufs["epoch"] = torch.zeros(1, dtype=torch.int32, device=ctx.device)
    bufs["counters"] = torch.zeros(2, dtype=torch.int32, device=ctx.device)
    return Plan(bufs)


def _check_operands(ctx, name_a, a, name_b, b, k_name):
    """The two GEMM operands of a distributed call: 2-D, same dtype, on this rank's GPU, inner sizes equal."""
    check_tensor(name_a, a, ndim=2, dtypes=DTYPES)
    check_tensor(name_b, b, ndim=2, dtypes=DTYPES)
    check_same(name_a, a, name_b, b)
    _check_device(ctx, name_a, a)
    if a.shape[1] != b.shape[0]:
        raise ValueError(f"{name_a} is {tuple(a.shape)} and {name_b} is {tuple(b.shape)}: {name_a}'s columns "
                         f"({k_name} = {a.shape[1]}) must equal {name_b}'s rows")
    if min(a.shape) < 1 or b.shape[1] < 1:
        raise ValueError(f"empty operand: {name_a} {tuple(a.shape)}, {name_b} {tuple(b.shape)}")


def _output(out, shape, like, impl):
    """``out`` checked against the result's shape and dtype, or a new tensor."""
    if out is None:
        out = torch.empty(shape, dtype=like.dtype, device=like.device)
    else:
        check_tensor("out", out, ndim=2, dtypes=(like.dtype,), device=like.device)
        if tuple(out.shape) != tuple(shape):
            raise ValueError(f"out must have shape {tuple(shape)}, got {tuple(out.shape)}")
        if impl == "ce" and not out.is_contiguous():
            raise ValueError("out must be contiguous with impl='ce' (cuBLAS writes its row blocks)")
    check_int32_indexing("out", out)
    return out


class _Op:
    """What the three ops share: buffers from :func:`_plan`, the launch dispatch, and the fused
    kernels' constexprs and first-use launch."""

    @classmethod
    def plan(cls, ctx, call) -> Plan:
        return _plan(ctx, cls, call)

    @classmethod
    def launch(cls, ctx, plan, call, *, phase="full"):
        """Run one phase of the call: ``communicate=False`` makes any phase the timing-only
        "nocomm"; impl="ce" goes to the copy-engine pair, everything else to the fused kernel."""
        if not call.extra.get("communicate", True):
            phase = "nocomm"
        if call.cfg.get("impl") == "ce":
            plan.launches += 1
            return cls._launch_ce(ctx, plan, call, phase)
        return cls._launch_fused(ctx, plan, call, phase)

    @staticmethod
    def _gemm_kw(ctx, c, k: int, use_tma: bool, **extra) -> dict:
        """The constexprs both fused GEMM kernels take (policy, tiles, world), plus ``extra``."""
        return dict(**c["policy"].kernel_args(c["num_domains"]), WORLD=ctx.world, BLOCK_M=c["BLOCK_M"],
                    BLOCK_N=c["BLOCK_N"], BLOCK_K=c["BLOCK_K"], EVEN_K=k % c["BLOCK_K"] == 0, USE_TMA=use_tma,
                    WAIT_CLOCK=ctx.wait_clock, **extra, **_launch_kwargs(ctx, c))

    @staticmethod
    def _run(ctx, plan, kernel, programs: int, args, kw) -> None:
        """Launch a fused kernel on ``programs`` programs (compiled and barriered on first use)."""
        if plan.launches == 0:
            _first_use(ctx, kernel, (programs,), args, kw)
        kernel[(programs,)](*args, **kw)
        plan.launches += 1


class AllGatherMatmul(_Op):
    name = "all_gather_matmul"
    sim_phases = ("push", "consume")

    @staticmethod
    def describe(a_local, b, *, world, mapping="auto", impl="fused", cfg=None) -> Call:
        Ml, K = a_local.shape
        N = b.shape[1]
        _check_impl(impl)
        cfg = cfg or _gemm_cfg(a_local.dtype, _on_gpu(a_local), N)
        tms, tn = _cdiv(Ml, cfg["BLOCK_M"]), _cdiv(N, cfg["BLOCK_N"])
        policy, nd = _policy(mapping, tms, tn)
        header = dict(op="all_gather_matmul", a_local_shape=tuple(a_local.shape), b_shape=tuple(b.shape),
                      dtype=str(a_local.dtype), mapping=policy.name, impl=impl, world=world)
        key = ("all_gather_matmul", Ml, K, N, a_local.dtype, policy.name, impl, tuple(sorted(cfg.items())))
        return Call("all_gather_matmul", key, header, dict(a_local=a_local, b=b),
                    dict(cfg, Ml=Ml, K=K, N=N, TMS=tms, TN=tn, policy=policy, num_domains=nd, world=world, impl=impl))

    @staticmethod
    def buffers(call) -> list:
        c, W = call.cfg, call.cfg["world"]
        if c["impl"] == "ce":   # ready + ack flags per peer, one receive buffer per peer
            bufs = [("flags", (2, W), torch.int32)]
            if W > 1:
                bufs.append(("gather", (W, c["Ml"], c["K"]), call.tensors["a_local"].dtype))
            return bufs
        bufs = [("flags", (W, c["TMS"]), torch.int32)]
        if W > 1:
            bufs.append(("gather", (2, W, c["Ml"], c["K"]), call.tensors["a_local"].dtype))
        return bufs

    @classmethod
    def prepare(cls, ctx, a_local, b, *, mapping="auto", impl="fused", out=None, communicate=True):
        _check_operands(ctx, "a_local", a_local, "b", b, "K")
        check_int32_indexing("b", b)
        a_local = a_local.contiguous()   # pushed as flat row blocks; read with unit stride
        call = cls.describe(a_local, b, world=ctx.world, mapping=mapping, impl=impl)
        call.tensors["out"] = _output(out, (ctx.world * call.cfg["Ml"], call.cfg["N"]), a_local, impl)
        call.extra["communicate"] = bool(communicate)
        return call

    @staticmethod
    def _launch_ce(ctx, plan, call, phase):
        from ._ce import all_gather_matmul_ce

        return all_gather_matmul_ce(ctx, plan, call, phase)

    @staticmethod
    def _launch_fused(ctx, plan, call, phase):
        from numasched.kernels.dist_gemm import all_gather_matmul_kernel as kernel

        c, t, bf = call.cfg, call.tensors, plan.bufs
        W, T = ctx.world, ctx.world * c["TMS"] * c["TN"]
        comm = max(1, min(c["COMM_PROGRAMS"], (W - 1) * c["TMS"]))
        G = max(1, min(ctx.num_sms, max(T, comm)))
        push = phase in ("full", "push")
        lo, hi = (0, 0) if phase == "push" else (0, T)
        a, b, out = t["a_local"], t["b"], t["out"]
        gather = bf.get("gather", a)
        g2 = gather.view(-1, c["K"])
        use_tma = c["USE_TMA"] and _tma_ok(a, b, g2)
        if use_tma:
            bm, bn, bk = c["BLOCK_M"], c["BLOCK_N"], c["BLOCK_K"]
            descs = (_desc(a, [bm, bk]), _desc(g2, [bm, bk]), _desc(b, [bk, bn]))
        else:
            descs = (None, None, None)
        args = (a, gather, b, out, *descs, bf["flags"], ctx.status, bf["epoch"], bf["counters"], ctx.heap_bases,
                ctx.rank, c["Ml"], c["N"], c["K"], b.stride(0), b.stride(1), out.stride(0), out.stride(1),
                G, ctx.wait_bound, lo, hi)
        kw = _Op._gemm_kw(ctx, c, c["K"], use_tma, COMM_PROGRAMS=comm, PUSH_CHUNK=c["PUSH_CHUNK"],
                          DO_PUSH=push and W > 1, WAIT=phase in ("full", "consume"),
                          BUMP_EPOCH=phase in ("full", "consume"),
                          PROXY_FENCE=use_tma and ctx.device.type == "cuda" and torch.version.hip is None)
        _Op._run(ctx, plan, kernel, G, args, kw)
        return None if phase == "push" else out


# ============================================================================ GEMM + reduce-scatter
class MatmulReduceScatter(_Op):
    name = "matmul_reduce_scatter"
    sim_phases = ("push", "consume")

    @staticmethod
    def describe(a, b_local, *, world, mapping="auto", impl="fused", cfg=None) -> Call:
        M, Kl = a.shape
        N = b_local.shape[1]
        Ms = M // world
        _check_impl(impl)
        cfg = cfg or _gemm_cfg(a.dtype, _on_gpu(a), N)
        tms, tn = _cdiv(Ms, cfg["BLOCK_M"]), _cdiv(N, cfg["BLOCK_N"])
        policy, nd = _policy(mapping, tms, tn)
        header = dict(op="matmul_reduce_scatter", a_shape=tuple(a.shape), b_local_shape=tuple(b_local.shape),
                      dtype=str(a.dtype), mapping=policy.name, impl=impl, world=world)
        key = ("matmul_reduce_scatter", M, Kl, N, a.dtype, policy.name, impl, tuple(sorted(cfg.items())))
        return Call("matmul_reduce_scatter", key, header, dict(a=a, b_local=b_local),
                    dict(cfg, Ms=Ms, Kl=Kl, N=N, TMS=tms, TN=tn, policy=policy, num_domains=nd, world=world,
                         impl=impl))

    @staticmethod
    def buffers(call) -> list:
        c, W = call.cfg, call.cfg["world"]
        if c["impl"] == "ce":
            bufs = [("flags", (2, W), torch.int32)]
            if W > 1:
                bufs.append(("partials", (W, c["Ms"], c["N"]), call.tensors["a"].dtype))
            return bufs
        bufs = [("flags", (W, c["TMS"] * c["TN"]), torch.int32)]
        if W > 1:
            bufs.append(("partials", (2, W, c["Ms"], c["N"]), call.tensors["a"].dtype))
        return bufs

    @classmethod
    def prepare(cls, ctx, a, b_local, *, mapping="auto", impl="fused", out=None, communicate=True):
        _check_operands(ctx, "a", a, "b_local", b_local, "K_local")
        if a.shape[0] % ctx.world:
            raise ValueError(f"a has {a.shape[0]} rows, not a multiple of the world size {ctx.world} "
                             f"(each rank returns a.shape[0] / world rows)")
        check_int32_indexing("a", a)
        check_int32_indexing("b_local", b_local)
        call = cls.describe(a, b_local, world=ctx.world, mapping=mapping, impl=impl)
        call.tensors["out"] = _output(out, (call.cfg["Ms"], call.cfg["N"]), a, impl)
        call.extra["communicate"] = bool(communicate)
        return call

    @classmethod
    def plan(cls, ctx, call) -> Plan:
        local = ()
        if call.cfg["impl"] == "ce":   # cuBLAS outputs: partial slices for peers, our own partial
            c, dt = call.cfg, call.tensors["a"].dtype
            local = (("stage", (ctx.world, c["Ms"], c["N"]), dt), ("own", (c["Ms"], c["N"]), dt))
        return _plan(ctx, cls, call, local)

    @staticmethod
    def _launch_ce(ctx, plan, call, phase):
        from ._ce import matmul_reduce_scatter_ce

        return matmul_reduce_scatter_ce(ctx, plan, call, phase)

    @staticmethod
    def _launch_fused(ctx, plan, call, phase):
        from numasched.kernels.dist_gemm import matmul_reduce_scatter_kernel as kernel

        c, t, bf = call.cfg, call.tensors, plan.bufs
        W, TS = ctx.world, c["TMS"] * c["TN"]
        lo, hi = {"push": (0, (W - 1) * TS), "consume": ((W - 1) * TS, W * TS)}.get(phase, (0, W * TS))
        G = max(1, min(ctx.num_sms, hi - lo))
        a, b, out = t["a"], t["b_local"], t["out"]
        if W == 1:   # no partial buffer: the kernel never touches it
            partials = out
        else:
            partials = bf["partials"]
        use_tma = c["USE_TMA"] and _tma_ok(a, b)
        if use_tma:
            descs = (_desc(a, [c["BLOCK_M"], c["BLOCK_K"]]), _desc(b, [c["BLOCK_K"], c["BLOCK_N"]]))
        else:
            descs = (None, None)
        args = (a, b, out, partials, *descs, bf["flags"], ctx.status, bf["epoch"], bf["counters"], ctx.heap_bases,
                ctx.rank, c["Ms"], c["N"], c["Kl"], a.stride(0), a.stride(1), b.stride(0), b.stride(1),
                out.stride(0), out.stride(1), G, ctx.wait_bound, lo, hi)
        kw = _Op._gemm_kw(ctx, c, c["Kl"], use_tma, COMM=phase != "nocomm", BUMP_EPOCH=phase in ("full", "consume"))
        _Op._run(ctx, plan, kernel, G, args, kw)
        return None if phase == "push" else out


# ============================================================================ distributed decode
def torch_local_decode(q, k_cache, v_cache, cache_seqlens):
    """Reference partial decode: (out (B, H, D) in q's dtype, lse (B, H) fp32, natural log).

    Rows with no tokens give out = 0, lse = -inf. Used until/unless numasched.decode provides
    ``flash_decode(..., return_lse=True)``; swap with :func:`set_local_decode`.
    """
    B, H, D = q.shape
    S, HK = k_cache.shape[1], k_cache.shape[2]
    qf = q.float().view(B, HK, H // HK, D)
    s = torch.einsum("bkgd,bskd->bkgs", qf, k_cache.float()) / D**0.5
    valid = torch.arange(S, device=q.device)[None, :] < cache_seqlens.to(q.device).long()[:, None]  # (B, S)
    s = s.masked_fill(~valid[:, None, None, :], float("-inf"))
    lse = torch.logsumexp(s, dim=-1)                                     # (B, HK, G)
    p = torch.exp(s - torch.where(torch.isinf(lse), 0.0, lse)[..., None])
    out = torch.einsum("bkgs,bskd->bkgd", p, v_cache.float())
    return out.reshape(B, H, D).to(q.dtype), lse.reshape(B, H).float()


_LOCAL_DECODE: Optional[Callable] = None


def set_local_decode(fn: Optional[Callable]) -> None:
    """Use ``fn(q, k_cache, v_cache, cache_seqlens) -> (out, lse)`` for the per-rank part (None: default)."""
    global _LOCAL_DECODE
    _LOCAL_DECODE = fn


def default_local_decode() -> Callable:
    """numasched.decode.flash_decode(..., return_lse=True) when it exists, else the torch reference."""
    if _LOCAL_DECODE is not None:
        return _LOCAL_DECODE
    try:
        import inspect

        from numasched.decode import flash_decode
        if "return_lse" in inspect.signature(flash_decode).parameters:
            return lambda q, k, v, lens: flash_decode(q, k, v, cache_seqlens=lens, return_lse=True)
    except ImportError:
        pass
    return torch_local_decode


class FlashDecodeDistributed(_Op):
    name = "flash_decode_distributed"
    sim_phases = ("push", "consume")

    @staticmethod
    def describe(q, k_cache_local, v_cache_local=None, cache_seqlens_local=None, *, world, cfg=None) -> Call:
        B, H, D = q.shape
        HK = k_cache_local.shape[2]
        header = dict(op="flash_decode_distributed", q_shape=tuple(q.shape), kv_heads=HK, dtype=str(q.dtype),
                      world=world)
        key = ("flash_decode_distributed", B, H, D, HK, q.dtype)
        bh, bd = 1 << max(0, H - 1).bit_length(), 1 << max(0, D - 1).bit_length()
        return Call("flash_decode_distributed", key, header, dict(q=q),
                    dict(B=B, H=H, D=D, BLOCK_H=bh, BLOCK_D=bd, num_warps=4 if bh * bd <= 4096 else 8,
                         world=world))

    @staticmethod
    def buffers(call) -> list:
        c, W = call.cfg, call.cfg["world"]
        bufs = [("flags", (W, c["B"]), torch.int32)]
        if W > 1:
            bufs += [("recv_out", (2, W, c["B"], c["H"], c["D"]), call.tensors["q"].dtype),
                     ("recv_lse", (2, W, c["B"], c["H"]), torch.float32)]
        return bufs

    @classmethod
    def prepare(cls, ctx, q, k_cache_local, v_cache_local, cache_seqlens_local, *, out=None, return_lse=False,
                local_decode=None, communicate=True):
        check_tensor("q", q, ndim=3, dtypes=DTYPES)
        check_tensor("k_cache_local", k_cache_local, ndim=4, dtypes=(q.dtype,))
        check_tensor("v_cache_local", v_cache_local, ndim=4, dtypes=(q.dtype,))
        check_tensor("cache_seqlens_local", cache_seqlens_local, ndim=1, dtypes=(torch.int32, torch.int64))
        for name, t in (("q", q), ("k_cache_local", k_cache_local), ("v_cache_local", v_cache_local),
                        ("cache_seqlens_local", cache_seqlens_local)):
            _check_device(ctx, name, t)
        B, H, D = q.shape
        if k_cache_local.shape != v_cache_local.shape:
            raise ValueError(f"k_cache_local {tuple(k_cache_local.shape)} and v_cache_local "
                             f"{tuple(v_cache_local.shape)} must have the same shape")
        if k_cache_local.shape[0] != B or k_cache_local.shape[3] != D:
            raise ValueError(f"k_cache_local must be (batch={B}, seq, kv_heads, head_dim={D}), got "
                             f"{tuple(k_cache_local.shape)}")
        HK = k_cache_local.shape[2]
        if H % HK:
            raise ValueError(f"q's heads ({H}) must be a multiple of k_cache_local's kv_heads ({HK})")
        if cache_seqlens_local.shape[0] != B:
            raise ValueError(f"cache_seqlens_local must have {B} entries (one per batch row), got "
                             f"{cache_seqlens_local.shape[0]}")
        call = cls.describe(q, k_cache_local, world=ctx.world)
        if out is None:
            out = torch.empty((B, H, D), dtype=q.dtype, device=q.device)
        else:
            check_tensor("out", out, ndim=3, dtypes=(q.dtype,), device=q.device)
            if tuple(out.shape) != (B, H, D) or not out.is_contiguous():
                raise ValueError(f"out must be a contiguous ({B}, {H}, {D}) tensor, got {tuple(out.shape)}")
        call.tensors.update(k=k_cache_local, v=v_cache_local, lens=cache_seqlens_local, out=out,
                            lse=torch.empty((B, H), dtype=torch.float32, device=q.device))
        call.extra.update(return_lse=return_lse, local_decode=local_decode or default_local_decode(),
                          communicate=bool(communicate))
        return call

    @staticmethod
    def _launch_fused(ctx, plan, call, phase):
        from numasched.kernels.dist_decode import decode_exchange_combine_kernel as kernel

        c, t, bf = call.cfg, call.tensors, plan.bufs
        if phase != "consume":   # the local part (the consume phase of the simulation reuses it)
            o, l = call.extra["local_decode"](t["q"], t["k"], t["v"], t["lens"])
            if tuple(o.shape) != (c["B"], c["H"], c["D"]) or tuple(l.shape) != (c["B"], c["H"]):
                raise RuntimeError(f"local decode returned out {tuple(o.shape)}, lse {tuple(l.shape)}; expected "
                                   f"{(c['B'], c['H'], c['D'])} and {(c['B'], c['H'])}")
            call.extra["partial"] = (o.to(t["q"].dtype), l.float())
        o, l = call.extra["partial"]
        W = ctx.world
        G = max(1, min(ctx.num_sms, c["B"]))
        ro = bf.get("recv_out", o)
        rl = bf.get("recv_lse", l)
        args = (o, l, ro, rl, bf["flags"], t["out"], t["lse"], ctx.status, bf["epoch"], bf["counters"],
                ctx.heap_bases, ctx.rank, c["B"], c["H"], c["D"], o.stride(0), o.stride(1), o.stride(2),
                l.stride(0), l.stride(1), G, ctx.wait_bound)
        kw = dict(WORLD=W, BLOCK_H=c["BLOCK_H"], BLOCK_D=c["BLOCK_D"], DO_PUSH=phase in ("full", "push") and W > 1,
                  DO_COMBINE=phase != "push", WAIT=phase in ("full", "consume"),
                  BUMP_EPOCH=phase in ("full", "consume"), WAIT_CLOCK=ctx.wait_clock)
        if ctx.device.type != "cpu":
            kw["num_warps"] = c["num_warps"]
        _Op._run(ctx, plan, kernel, G, args, kw)
        if phase == "push":
            return None
        return (t["out"], t["lse"]) if call.extra["return_lse"] else t["out"]


OPS = {"all_gather_matmul": AllGatherMatmul, "matmul_reduce_scatter": MatmulReduceScatter,
       "flash_decode_distributed": FlashDecodeDistributed}


def run(ctx, op: str, *args, check: bool = True, **kwargs):
    """One call of ``op`` on a real (or one-rank simulated) context."""
    spec = OPS[op]
    ctx._ensure_usable()
    if getattr(ctx, "world_", None) is not None and ctx.world > 1:
        raise ValueError("a simulated rank cannot call alone: use SimWorld.run(op, per_rank_args)")
    call = spec.prepare(ctx, *args, **kwargs)
    plan = ctx.plans.get(call.key)
    if plan is None:
        check_headers(op, ctx.exchange(call.header) if hasattr(ctx, "exchange") else [call.header])
        plan = ctx.plans[call.key] = spec.plan(ctx, call)
        # The new buffers and flags were zero-filled with a zero_() queued on each rank's stream
        # (iris.zeros), not at once. A peer may push into our buffers and set our flags as soon as
        # its own first call starts, so no rank may start before every rank's fill has run: a push
        # that lands first is wiped (we read zeros) or its flag is lost (we time out). The fused
        # kernels got this barrier from _first_use (compile, then barrier); impl="ce" had none.
        # protocol.simulate(..., init_barrier=False) shows the failure. Once per signature.
        if hasattr(ctx, "barrier"):
            ctx.barrier()
    out = spec.launch(ctx, plan, call, phase="full")
    if check and not (ctx.device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
        ctx.check(op)
    return out


def required_heap_bytes(workload, world: int) -> int:
    """Heap bytes the given calls need: ``workload`` is a list of (op name, *tensors) with the
    tensors (meta tensors are fine) each rank will pass, and optionally a dict of keyword
    arguments last, e.g. ``[("all_gather_matmul", a_local, b), ("all_gather_matmul", a_local, b,
    {"impl": "ce"}), ("flash_decode_distributed", q, k_cache_local)]``."""
    from ._context import alloc_bytes

    total = 0
    for item in workload:
        op, *tensors = item
        kw = tensors.pop() if tensors and isinstance(tensors[-1], dict) else {}
        if op not in OPS:
            raise ValueError(f"unknown op {op!r} in workload; one of {sorted(OPS)}")
        spec = OPS[op]
        if op == "matmul_reduce_scatter" and tensors[0].shape[0] % world:
            raise ValueError(f"matmul_reduce_scatter: a has {tensors[0].shape[0]} rows, not a multiple of {world}")
        call = spec.describe(*tensors, world=world, **kw)
        total += sum(alloc_bytes(_numel(s) * torch.empty((), dtype=dt).element_size()) for _, s, dt in spec.buffers(call))
    return total


def _numel(shape):
    n = 1
    for s in shape:
        n *= s
    return n
