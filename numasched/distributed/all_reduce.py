"""All-reduce: every rank gets the element-wise sum of every rank's tensor (kernel: kernels/dist_allreduce.py).

Implementations (``impl=``): ``"oneshot"`` (each rank pushes its whole tensor to every peer and
sums W copies: one exchange, (W-1) n elements out of each rank), ``"twoshot"`` (reduce-scatter
then all-gather over the heap: two exchanges, 2 (W-1)/W n elements), ``"nccl"``
(``torch.distributed.all_reduce`` on the context's group), ``"ce"`` (two-shot with the data moved
by the copy engine, so that it takes no SMs from compute it overlaps: see ``_ce.all_reduce_ce``;
never picked by "auto", which times calls alone), and ``"auto"`` (default: the cheapest by
:mod:`.cost`). The sum is taken in fp32 in rank order: every rank gets bit-identical results.
"""
from __future__ import annotations

from typing import Optional

import torch

from numasched._validate import check_tensor

from . import cost
from ._common import DTYPES, Call, _aligned, _auto_nccl_ok, _cdiv, _check_device, _on_gpu, _Op, register, run

IMPLS = ("auto", "oneshot", "twoshot", "nccl", "ce")
# flags (2 phases, W sources, programs): sized for this many programs whatever the GPU
MAX_PROGRAMS = 1024


SMALL_BYTES = 256 << 10   # decode-size all-reduces: small chunks that divide n
MID_BYTES = 1 << 20       # up to here at two ranks: one small chunk per program (_cfg)


def _cfg(dtype, gpu: bool, n: Optional[int] = None, two: bool = False, world: int = 2) -> dict:
    if not gpu:   # the interpreter: tiny chunks, so a test covers several chunks and programs
        return dict(BLOCK=64, num_warps=4)
    es = dtype.itemsize
    if n is not None and n * es <= SMALL_BYTES:
        # At most 4 KB a chunk, the largest power of two (down to 512 bytes) that divides n: a
        # partial chunk stores element by element (its mask is not provably 16-aligned), and
        # 8 KB in one 16 KB chunk took 15.1 us on 4 H200s (9.1 on 2), in 4-8 KB chunks 6.0-7.5
        # (bench/results/tp4-s13/ar-sweep-small-*.log). One 16-byte vector per thread.
        block = 4096 // es
        while block > 512 // es and n % block:
            block //= 2
        if n % block:
            block = 4096 // es
        return dict(BLOCK=block, num_warps=max(1, min(8, block * es // 512)))
    if n is not None and world <= 2 and n * es <= MID_BYTES:
        # 256 KB - 1 MB at two ranks: chunks small enough for one chunk per program (4 KB up to
        # 512 KB, 8 KB up to 1 MB: 64-128 programs on 132 SMs), pipelined (not BULK). Two H200s,
        # five interleaved rounds each (bench/results/tp2-s52/ar-sweep.log), one-shot medians at
        # 384 KB / 512 KB / 768 KB / 1 MB: 9.0 / 8.8 / 11.0 / 11.8 us, against 10.1 / 9.8 / 11.7 /
        # 12.3 with the BULK 16 KB chunks before, torch symm_mem's two-shot 10.0 / 9.7 / 11.2 /
        # 12.5 and NCCL 11.7 / 12.8 / 14.8 / 16.9. Four ranks keep BULK: not measured there.
        block = (4096 if n * es <= MID_BYTES // 2 else 8192) // es
        return dict(BLOCK=block, num_warps=8)
    # Above 256 KB (1 MB at two ranks): BULK (every chunk of a stage pushed, then one signal: a
    # signal is a system-scope fence, and the pipelined loop's two per chunk held two-shot at 79 us
    # for 16 MB and 139 for 32 MB on two H100s, NCCL's speed; BULK 64 / 112, torch symm_mem's
    # two-shot 62 / 111; on four H100s 122 -> 115 at 16 MB, 433 -> 354 at 64 MB). Chunks of 16 KB; one-shot from
    # 4 MB at two ranks 32 KB (22.2 against 23.6 us; 1 MB 12.0 / 12.2, a tie, where 32 KB chunks
    # leave 32 programs; at four ranks 32 KB lost at 4 MB, 69.9 against 61.4 us).
    # scripts/ar_sweep.py, bench/results/ar-s16/.
    big_one = not two and world <= 2 and n * es >= 4 << 20
    return dict(BLOCK=(32768 if big_one else 16384) // es, num_warps=8, BULK=True)


def _check_impl(impl, allowed=IMPLS, name="impl"):
    if impl not in allowed:
        raise ValueError(f"{name} must be one of {allowed}, got {impl!r}")


@register
class AllReduce(_Op):
    name = "all_reduce"
    sim_phases = ("push", "reduce", "gather")

    @staticmethod
    def describe(x, *, world, impl="auto", cfg=None, num_sms=132, bulk_ok=True) -> Call:
        _check_impl(impl)
        n, dt = x.numel(), x.dtype
        if impl == "auto":   # NCCL only where there is a process group (not in the simulation)
            allowed = ("oneshot", "twoshot", "nccl") if bulk_ok else ("oneshot", "twoshot")
            chosen = cost.choose_all_reduce(n * x.element_size(), world, allowed=allowed)
        else:
            chosen = impl
        if world == 1 and chosen != "nccl":
            chosen = "oneshot"   # a copy (no peer)
        cfg = dict(_cfg(dt, _on_gpu(x), n, chosen == "twoshot", world), **(cfg or {}))
        per_sm = cfg.pop("programs_per_sm", 1)
        block = cfg["BLOCK"]
        two = chosen == "twoshot"
        if chosen == "ce":   # shards of ceil(n / world) elements; the copy engine needs no chunking
            span = _cdiv(max(n, 1), world)
            header = dict(op="all_reduce", numel=n, dtype=str(dt), impl=chosen, world=world)
            return Call("all_reduce", ("all_reduce", n, dt, chosen), header, dict(x=x),
                        dict(n=n, span=span, impl=chosen, world=world))
        # a shard is a whole number of chunks, so every rank's shard starts 16-element aligned
        span = _cdiv(_cdiv(n, world), block) * block if two else _cdiv(max(n, 1), 16) * 16
        chunks = max(1, _cdiv(span, block))
        programs = max(1, min(num_sms * per_sm, MAX_PROGRAMS, chunks))
        header = dict(op="all_reduce", numel=n, dtype=str(dt), impl=chosen, world=world, programs=programs,
                      config=tuple(sorted(cfg.items())))
        key = ("all_reduce", n, dt, chosen, programs, tuple(sorted(cfg.items())))
        return Call("all_reduce", key, header, dict(x=x),
                    dict(cfg, n=n, span=span, programs=programs, iters=_cdiv(chunks, programs), impl=chosen,
                         world=world))

    @staticmethod
    def buffers(call) -> list:
        c, W, dt = call.cfg, call.cfg["world"], call.tensors["x"].dtype
        if c["impl"] == "nccl" or W == 1:
            return []
        if c["impl"] == "ce":   # ready/ack of the reduce-scatter and of the all-gather; receive slots
            return [("flags", (4, W), torch.int64), ("recv", (W * c["span"],), dt), ("gath", (W * c["span"],), dt)]
        bufs = [("flags", (2, W, MAX_PROGRAMS), torch.int64), ("recv", (2, W, c["span"]), dt)]
        if c["impl"] == "twoshot":
            bufs.append(("reduced", (2, W * c["span"]), dt))
        return bufs

    @classmethod
    def prepare(cls, ctx, x, *, impl="auto", out=None, config=None):
        check_tensor("x", x, dtypes=DTYPES)
        _check_device(ctx, "x", x)
        if not x.is_contiguous():
            raise ValueError(f"x must be contiguous (shape {tuple(x.shape)}, strides {x.stride()}); call .contiguous()")
        if out is None:
            out = torch.empty_like(x)
        else:
            check_tensor("out", out, dtypes=(x.dtype,), device=x.device)
            if tuple(out.shape) != tuple(x.shape) or not out.is_contiguous():
                raise ValueError(f"out must be a contiguous tensor of x's shape {tuple(x.shape)}, got shape "
                                 f"{tuple(out.shape)}, strides {out.stride()}")
            if out.data_ptr() != x.data_ptr() and x.numel():
                lo, hi = x.data_ptr(), x.data_ptr() + x.numel() * x.element_size()
                olo = out.data_ptr()
                if olo < hi and lo < olo + out.numel() * out.element_size():
                    raise ValueError("out overlaps x without being x; pass out=x (in place) or a separate tensor")
        if x.numel() >= 2**31:
            raise ValueError(f"x has {x.numel()} elements; at most 2^31 - 1 are supported")
        if config is not None:
            def pow2(v, lo):
                return isinstance(v, int) and not isinstance(v, bool) and v >= lo and v & (v - 1) == 0

            bad = set(config) - {"BLOCK", "num_warps", "programs_per_sm", "BULK"}
            ok = (not bad and pow2(config.get("BLOCK", 16), 16) and pow2(config.get("num_warps", 1), 1)
                  and isinstance(config.get("programs_per_sm", 1), int) and config.get("programs_per_sm", 1) >= 1
                  and isinstance(config.get("BULK", False), bool))
            if not ok:
                raise ValueError(f"config: keys BLOCK (a power of two >= 16 elements), num_warps (a power of two), "
                                 f"programs_per_sm (an int >= 1), BULK (True / False); got {config}")
        if config is not None and impl == "ce":
            raise ValueError("config tunes the one-shot / two-shot kernels; impl='ce' (copy engine) takes none")
        call = cls.describe(x, world=ctx.world, impl=impl, num_sms=ctx.num_sms, cfg=config, bulk_ok=_auto_nccl_ok(ctx))
        if call.cfg["impl"] == "nccl" and not hasattr(ctx, "group"):
            raise ValueError("impl='nccl' needs a real context (numasched.distributed.init); a simulated rank has no "
                             "process group")
        call.tensors["out"] = out
        return call

    @staticmethod
    def _launch_ce(ctx, plan, call, phase):
        from ._ce import all_reduce_ce

        return all_reduce_ce(ctx, plan, call, phase)

    @staticmethod
    def _launch_fused(ctx, plan, call, phase):
        c, t = call.cfg, call.tensors
        x, out = t["x"], t["out"]
        if x.numel() == 0:
            return None if phase == "push" else out
        if c["impl"] == "nccl":
            import torch.distributed as dist

            if out.data_ptr() != x.data_ptr():
                out.copy_(x)
            dist.all_reduce(out, group=ctx.group)
            plan.launches += 1
            return out
        if ctx.world == 1:
            if out.data_ptr() != x.data_ptr():
                out.copy_(x)
            return None if phase == "push" else out
        two = c["impl"] == "twoshot"
        stages = {"full": 7, "push": 1, "reduce": 2, "gather": 4}[phase]
        if phase == "gather" and not two:
            return out
        bf = plan.bufs
        recv = bf["recv"]
        args = (x, out, recv, bf.get("reduced", recv), bf["flags"], ctx.status, bf["epoch"], bf["counters"],
                ctx.heap_bases, ctx.rank, c["n"], c["span"], c["iters"], ctx.wait_bound)
        layout = (_aligned(x), _aligned(out))
        last = "full" if phase == "full" else ("gather" if two else "reduce")

        def build():
            from numasched.kernels.dist_allreduce import all_reduce_kernel

            kw = dict(WORLD=ctx.world, BLOCK=c["BLOCK"], TWO_SHOT=two, STAGES=stages, BUMP_EPOCH=phase == last,
                      WAIT_CLOCK=ctx.wait_clock, ONE_PROGRAM=c["programs"] == 1, BULK=bool(c.get("BULK", False)))
            if ctx.device.type != "cpu":
                kw["num_warps"] = c["num_warps"]
            return all_reduce_kernel, kw

        _Op._run(ctx, plan, call, phase, c["programs"], args, layout, () if phase == "push" else (out,), build)
        return None if phase == "push" else out


def all_reduce(x, *, ctx, impl: str = "auto", out=None, check: bool = True, config=None):
    """Element-wise sum of ``x`` over the context's ranks, returned on every rank.

    x: any shape, contiguous, fp16/bf16/fp32, on this rank's GPU. out: a tensor of x's shape
    and dtype (``out=x`` reduces in place); default a new one. impl: "auto" (the cost model's
    pick among "oneshot", "twoshot" and "nccl"; see :mod:`numasched.distributed.cost`), one of
    them, or "ce" (two-shot by copy engine: for overlapping compute on another stream). Graph-capturable like the other ops (call once before capturing); a peer that never
    arrives gives TimeoutError naming it (``check=False``: call ``ctx.check()`` yourself).
    config: override of the kernel config (``BLOCK`` elements per chunk, ``num_warps``,
    ``programs_per_sm``, ``BULK``: each stage over all of a program's chunks, then one signal), for tuning (scripts/ar_sweep.py); every rank must pass the same.
    """
    return run(ctx, "all_reduce", x, impl=impl, out=out, check=check, config=config)
