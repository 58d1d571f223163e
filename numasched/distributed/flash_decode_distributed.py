"""Distributed decode attention: a KV sequence split across ranks, partials exchanged and merged
on arrival (kernel: kernels/dist_decode.py)."""
from __future__ import annotations

from typing import Callable, Optional

import torch

from numasched._validate import check_tensor

from ._common import DTYPES, Call, _aligned, _check_device, _Op, register, run


def torch_local_decode(q, k_cache, v_cache, cache_seqlens):
    """Reference partial decode: (out (B, H, D) in q's dtype, lse (B, H) fp32, natural log).

    Rows with no tokens give out = 0, lse = -inf. Used until/unless numasched.decode provides
    ``flash_decode(..., return_lse=True)``; swap with :func:`set_local_decode`.
    """
    B, H, D = q.shape
    S, HK = k_cache.shape[1], k_cache.shape[2]
    if H % HK:
        raise ValueError(f"q's {H} heads are not a multiple of k_cache's {HK} KV heads")
    capturing = cache_seqlens.is_cuda and torch.cuda.is_current_stream_capturing()
    if cache_seqlens.numel() and not capturing and int(cache_seqlens.max()) > S:   # (a reference: it reads them)
        raise ValueError(f"cache_seqlens holds {int(cache_seqlens.max())}, past the cache's {S} tokens")
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


@register
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
        bufs = [("flags", (W, c["B"]), torch.int64)]
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
        res, res_lse = t["out"], t["lse"]
        args = (o, l, ro, rl, bf["flags"], res, res_lse, ctx.status, bf["epoch"], bf["counters"],
                ctx.heap_bases, ctx.rank, c["B"], c["H"], c["D"], o.stride(0), o.stride(1), o.stride(2),
                l.stride(0), l.stride(1), G, ctx.wait_bound)
        # the partials come from the local decode: any strides and alignment
        layout = (_aligned(o), o.stride(), _aligned(l), l.stride(), _aligned(res), _aligned(res_lse))

        def build():
            from numasched.kernels.dist_decode import decode_exchange_combine_kernel

            kw = dict(WORLD=W, BLOCK_H=c["BLOCK_H"], BLOCK_D=c["BLOCK_D"],
                      DO_PUSH=phase in ("full", "push") and W > 1, DO_COMBINE=phase != "push",
                      WAIT=phase in ("full", "consume"), BUMP_EPOCH=phase in ("full", "consume"),
                      WAIT_CLOCK=ctx.wait_clock)
            if ctx.device.type != "cpu":
                kw["num_warps"] = c["num_warps"]
            return decode_exchange_combine_kernel, kw

        _Op._run(ctx, plan, call, phase, G, args, layout, () if phase == "push" else (res, res_lse), build)
        if phase == "push":
            return None
        return (res, res_lse) if call.extra["return_lse"] else res


def flash_decode_distributed(q, k_cache_local, v_cache_local, cache_seqlens_local, *, ctx, return_lse: bool = False,
                             out=None, check: bool = True, local_decode=None, communicate: bool = True):
    """Decode attention over a KV sequence split across ranks; every rank returns the full result.

    q: (B, H, D); k_cache_local, v_cache_local: (B, S_local, HK, D), this rank's part of the
    context; cache_seqlens_local: (B,) valid tokens of each row in this rank's part (0 allowed).
    Each rank computes its partial (out, lse), pushes it to every peer with a release flag and
    merges all partials as they arrive (same order on every rank: identical results).
    Returns out (B, H, D) (and lse (B, H), fp32 natural log, if ``return_lse``).
    """
    return run(ctx, "flash_decode_distributed", q, k_cache_local, v_cache_local, cache_seqlens_local,
               return_lse=return_lse, out=out, check=check, local_decode=local_decode, communicate=communicate)
