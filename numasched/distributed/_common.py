"""What the three collectives share: the call, its per-context plan of buffers, the cross-rank
header check, tile configs, the op base class, the registry and :func:`run`.

Each op (one module per collective: :mod:`.all_gather_matmul`, :mod:`.matmul_reduce_scatter`,
:mod:`.flash_decode_distributed`) registers a subclass of :class:`_Op` in :data:`OPS` with

    describe   shapes only (meta tensors work: heap sizing) -> :class:`Call`
    buffers    the symmetric-heap buffers a call needs (name, shape, dtype)
    prepare    argument checks naming the argument, then ``describe`` + output tensors
    launch     one phase of the call (below)

and is launched in one of these phases:
    full     one fused kernel (GPU)
    nocomm   the same kernel with communication switched off (timing only: peers' rows are wrong)
    nowait   matmul_all_reduce's FLAT pairs pushing to the peer but never waiting for its data
             (timing only: what the waits cost, against "full")
    push / consume   the producer part, then the consumer part (SimWorld: interpreter, one rank
             at a time, so every rank's push must run before any rank waits)

A fused launch goes through a :class:`numasched._launch.Launch` kept in the plan per phase (and
per grid and argument layout, see :meth:`_Op._run`): a repeat call skips Triton's argument
binding. Launch observers (:mod:`numasched.observe`) see every launch.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List

import torch

from numasched import caps
from numasched.caps import kernel_device_ok
from numasched import observe
from numasched import options as _options
from numasched._validate import check_int32_indexing, check_same, check_tensor

from ._context import alloc_bytes

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
    """One context's buffers for one call signature (``ctx.plans[call.key]``), its launch count
    and its thin launches (``launchers[(phase, programs, layout)]``)."""

    bufs: Dict[str, torch.Tensor]
    launches: int = 0
    launchers: Dict[tuple, Any] = field(default_factory=dict, repr=False)
    # pushed all_reduce_add_rmsnorm: 1 between a push_target and its call (a push not consumed
    # would leave the peers' counts a call ahead, every later call then reading stale rows)
    pending: int = 0


#: op name -> op class; the op modules register themselves (:func:`register`).
OPS: Dict[str, type] = {}


def register(cls):
    """Class decorator: make ``cls`` (a :class:`_Op` with a ``name``) callable through :func:`run`."""
    OPS[cls.name] = cls
    return cls


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


# ============================================================================ configs
def _on_gpu(t: torch.Tensor) -> bool:
    return t.device.type in ("cuda", "meta")


def _gemm_cfg(dtype, gpu: bool, n: int) -> dict:
    """Tile config: Hopper-friendly on GPU; tiny under the interpreter (its dot needs >= 16).

    The op modules call it as ``_common._gemm_cfg`` (scripts/dist_core_sweep.py replaces it)."""
    tma = _tma_default(gpu)
    if not gpu:
        return dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, num_warps=4, num_stages=1, COMM_PROGRAMS=2,
                    PUSH_CHUNK=128, USE_TMA=tma)
    if dtype == torch.float32:
        return dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=32, num_warps=4, num_stages=3, COMM_PROGRAMS=16,
                    PUSH_CHUNK=8192, USE_TMA=tma)
    bn = 256 if n >= 256 else 128
    # PUSH_CHUNK: 32 KB of bf16 per loop trip of a pushing program (8 x 16 B in flight per thread);
    # FLAT: the reduce-scatter's tiles as one pipelined loop over (tile, K step) where TMA feeds it
    # (kernels/dist_gemm.py, _rs_flat; options.fused_flat overrides)
    flat = _options.current().fused_flat
    return dict(BLOCK_M=128, BLOCK_N=bn, BLOCK_K=64, num_warps=8, num_stages=3, COMM_PROGRAMS=16,
                PUSH_CHUNK=16384, USE_TMA=tma, FLAT=True if flat is None else flat)


def _tma_default(gpu: bool) -> bool:
    """TMA descriptors for the fused GEMMs: ``numasched.options.current().dist_tma`` (True also
    works in the interpreter); None means on Hopper+ NVIDIA GPUs. The choice is part of the
    config, so of the call key: changing the option never reuses a plan made under another value."""
    opt = _options.current().dist_tma
    if opt is not None:
        return opt
    if not gpu or caps.is_hip() or not torch.cuda.is_available():
        return False
    try:
        from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: F401
    except ImportError:
        return False
    return caps.capability(torch.device("cuda"))[0] >= 9


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


def _aligned(t: torch.Tensor) -> bool:
    return t.data_ptr() % 16 == 0


IMPLS = ("auto", "fused", "ce", "bulk", "symm_mem")


def _check_impl(impl):
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS} (auto: the cost model's pick; fused Triton kernel; copy engine "
                         f"+ cuBLAS; bulk: NCCL + torch.matmul; symm_mem: torch symmetric memory's fused op), "
                         f"got {impl!r}")


def _resolve_impl(op: str, impl: str, M: int, N: int, K: int, dtype, world: int, bulk_ok: bool,
                  symm_ok: bool = False, ws: bool = False, num_sms: int = 132) -> str:
    """``impl`` with "auto" replaced by the cost model's pick (numasched.distributed.cost)."""
    _check_impl(impl)
    if impl != "auto":
        if impl in ("bulk", "symm_mem") and not bulk_ok:
            raise ValueError(f"impl={impl!r} needs a real context (numasched.distributed.init): a simulated rank has "
                             f"no process group")
        return impl
    from . import cost

    # the pick is a function of these, the link constants (cost.set_link replaces them), the
    # options and the GPU the GEMM model prices: memoised, an eager call's host time does not
    # pay for the model again (100-200 us a call on a 2-core CPU)
    device = torch.cuda.current_device() if torch.cuda.is_available() else -1
    return _auto_impl(op, M, N, K, dtype, world, bulk_ok, symm_ok, ws, num_sms, tuple(sorted(cost.LINKS.items())),
                      _options.current(), device)


def _bulk_engine(requested: str, impl: str, M: int, t) -> str:
    """The GEMM a bulk (NCCL, then GEMM) call of ``M`` rows runs: torch.matmul (cuBLAS) where
    the caller named impl="bulk" (the bulk-synchronous baseline as such); where "auto" chose the
    bulk path, the GEMM the cost model prices faster for those rows (cost.gemm_engine)."""
    if impl != "bulk" or requested != "auto":
        return "torch"
    from . import cost

    return cost.gemm_engine(M, t.device)


def _matmul(engine: str, a, b, out=None):
    """``a @ b`` (into ``out`` when given) by ``engine``: "torch" (torch.matmul) or "numasched"."""
    if engine == "torch":
        return torch.matmul(a, b, out=out)
    from numasched.gemm import matmul

    return matmul(a, b, out=out)


@functools.lru_cache(maxsize=4096)
def _auto_impl(op, M, N, K, dtype, world, bulk_ok, symm_ok, ws, num_sms, links, opts, device) -> str:
    """_resolve_impl's "auto" (its arguments, the link constants, the options and the device make
    the key)."""
    from . import cost

    return cost.choose_gemm_collective(op, M, N, K, dtype, world, bulk_ok=bulk_ok, symm_mem_ok=symm_ok, ws=ws,
                                       num_sms=num_sms)


def _bulk_ok(ctx) -> bool:
    """Whether ``ctx`` can run torch.distributed collectives (a real context; not the simulation)."""
    return hasattr(ctx, "group")


def group_name(ctx) -> str:
    import torch.distributed as dist

    return (ctx.group if ctx.group is not None else dist.group.WORLD).group_name


def _symm_mem_ok(ctx) -> bool:
    """Whether torch symmetric memory's fused ops can run on ``ctx``'s group (checked once per
    context; enables the group for them on torch versions that need it)."""
    if not _bulk_ok(ctx):
        return False
    ok = getattr(ctx, "_symm_mem_ok", None)
    if ok is None:
        try:
            from torch.distributed import _symmetric_memory as symm_mem

            if hasattr(symm_mem, "enable_symm_mem_for_group"):
                symm_mem.enable_symm_mem_for_group(group_name(ctx))
            ok = hasattr(torch.ops.symm_mem, "fused_all_gather_matmul") and ctx.device.type == "cuda"
        except Exception:  # noqa: BLE001 - an older torch, no NVSHMEM/CUDA symmetric memory: not offered
            ok = False
        ctx._symm_mem_ok = ok
    return ok


def _auto_nccl_ok(ctx) -> bool:
    """Whether ``impl="auto"`` may route a call to NCCL (the bulk paths): a real context that is
    not ``bounded_only``. NCCL's waits have no bound inside a CUDA graph (its watchdog sees no
    work there): a stopped peer hangs the replay, where numasched's kernels raise TimeoutError."""
    return _bulk_ok(ctx) and not getattr(ctx, "bounded_only", False)


def _auto_symm_mem_ok(ctx) -> bool:
    """Whether ``impl="auto"`` may pick torch's symmetric-memory ops: they can run, and the context
    is not ``bounded_only`` (their barriers wait without a bound)."""
    return _symm_mem_ok(ctx) and not getattr(ctx, "bounded_only", False)


# ============================================================================ argument checks
def _check_device(ctx, name, t):
    if t.device != ctx.device:
        raise ValueError(f"{name} is on {t.device} but this rank's context is on {ctx.device}")
    if not kernel_device_ok(t):
        raise ValueError(f"{name} is on {t.device}: the kernels need a GPU, or TRITON_INTERPRET=1 on CPU")


def _check_operands(ctx, name_a, a, name_b, b, k_name):
    """The two GEMM operands of a distributed call: 2-D, same dtype, on this rank's GPU (ctx None:
    a shape-only plan, any device), inner sizes equal."""
    check_tensor(name_a, a, ndim=2, dtypes=DTYPES)
    check_tensor(name_b, b, ndim=2, dtypes=DTYPES)
    check_same(name_a, a, name_b, b)
    if ctx is not None:
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


# ============================================================================ launches
def _launch_kwargs(ctx, cfg):
    return {} if ctx.device.type == "cpu" else dict(num_warps=cfg["num_warps"],
                                                    num_stages=caps.cap_stages("gemm", cfg["num_stages"]))


def _first_use(ctx, kernel, grid, args, kwargs):
    """On a GPU: compile before any rank starts waiting (a rank still compiling must not look dead)."""
    if ctx.device.type == "cpu":
        return
    try:
        kernel.warmup(*args, grid=grid, **kwargs)
    except Exception:  # warmup is an optimisation; the barrier below still lines ranks up
        pass
    ctx.barrier()


def _make_plan(ctx, op, call, local_bufs=()) -> Plan:
    """Symmetric-heap buffers of ``op.buffers(call)`` + private ``local_bufs`` (name, shape, dtype),
    and the device epoch word and program counters every fused kernel keeps."""
    specs = op.buffers(call)
    order = range(len(specs))
    if ctx.recycle:   # room for all of them first (plans given back), then placed largest first, as
        # heap_room counts: the plan never stops half made in holes its first buffers took
        sizes = [alloc_bytes(_numel(shape) * torch.empty((), dtype=dt).element_size()) for _, shape, dt in specs]
        ctx.make_room(sizes)
        order = sorted(order, key=lambda i: -sizes[i])
    made = {}
    for i in order:
        name, shape, dt = specs[i]
        made[name] = ctx.alloc(shape, dt, what=f"{op.name} {name} buffer", owner=op.name)
    bufs = {name: made[name] for name, _, _ in specs}
    for name, shape, dt in local_bufs:
        bufs[name] = torch.empty(shape, dtype=dt, device=ctx.device)
    bufs["epoch"] = torch.zeros(1, dtype=torch.int64, device=ctx.device)   # int64: never wraps
    bufs["counters"] = torch.zeros(2, dtype=torch.int32, device=ctx.device)
    return Plan(bufs)


class _Op:
    """What the three ops share: buffers from :func:`_make_plan`, the launch dispatch, and the
    fused kernels' constexprs and thin, first-use-barriered launch."""

    name = ""
    sim_phases = ("push", "consume")

    @classmethod
    def plan(cls, ctx, call) -> Plan:
        return _make_plan(ctx, cls, call)

    @classmethod
    def launch(cls, ctx, plan, call, *, phase="full"):
        """Run one phase of the call: ``communicate=False`` makes any phase the timing-only
        "nocomm"; impl="ce" goes to the copy-engine pair, everything else to the fused kernel."""
        comm = call.extra.get("communicate", True)
        if comm is False:
            phase = "nocomm"
        elif comm == "nowait":   # timing only (matmul_all_reduce's FLAT pairs): pushes, no waits
            phase = "nowait"
        if call.cfg.get("impl") in ("ce", "bulk", "symm_mem"):
            impl = call.cfg["impl"]
            if observe.OBSERVERS:
                observe.notify(call.op, f"{call.op}.{impl}", (), () if phase == "push" else (call.tensors["out"],),
                               plan)
            plan.launches += 1
            return {"ce": cls._launch_ce, "bulk": cls._launch_bulk, "symm_mem": cls._launch_symm_mem}[impl](
                ctx, plan, call, phase)
        return cls._launch_fused(ctx, plan, call, phase)

    @staticmethod
    def _launch_ce(ctx, plan, call, phase):
        raise NotImplementedError

    @staticmethod
    def _launch_bulk(ctx, plan, call, phase):
        raise NotImplementedError

    @staticmethod
    def _launch_symm_mem(ctx, plan, call, phase):
        raise NotImplementedError

    @staticmethod
    def _launch_fused(ctx, plan, call, phase):
        raise NotImplementedError

    @staticmethod
    def _gemm_kw(ctx, c, k: int, use_tma: bool, **extra) -> dict:
        """The constexprs both fused GEMM kernels take (policy, tiles, world), plus ``extra``."""
        return dict(MAPPING=c["policy"].constexpr(c["num_domains"]), WORLD=ctx.world, BLOCK_M=c["BLOCK_M"],
                    BLOCK_N=c["BLOCK_N"], BLOCK_K=c["BLOCK_K"], EVEN_K=k % c["BLOCK_K"] == 0, USE_TMA=use_tma,
                    WAIT_CLOCK=ctx.wait_clock, **extra, **_launch_kwargs(ctx, c))

    @staticmethod
    def _run(ctx, plan, call, phase, programs: int, args: tuple, layout: tuple, outputs: tuple,
             build: Callable[[], tuple]) -> None:
        """Launch a fused kernel on ``programs`` programs through the plan's thin launch for
        (phase, programs, layout); ``build()`` -> (kernel, constexprs) makes it on first use.

        ``layout``: what Triton specialises on that may change between calls of one signature
        (strides, 16-byte alignment of the caller's tensors, the TMA choice); a new layout gets a
        Launch of its own, so the compiled kernel is never reused for arguments it was not
        specialised for. The plan's first launch is compiled and barriered (:func:`_first_use`)."""
        key = (phase, programs, layout)
        launch = plan.launchers.get(key)
        if launch is None:
            from numasched._launch import Launch

            kernel, kw = build()
            launch = plan.launchers[key] = Launch(kernel, (programs,), kw, device=ctx.device,
                                                  interpret=ctx.device.type == "cpu")
            if plan.launches == 0:
                # the launch's own constexprs and options (PDL, launch_pdl): the variant that runs
                _first_use(ctx, kernel, (programs,), args, launch.kwargs)
        if observe.OBSERVERS:
            observe.notify(call.op, launch.name, (programs,), outputs, plan)
        launch(*args)
        plan.launches += 1


# ============================================================================ one call
def check_context(ctx, op: str, alone: bool = True) -> None:
    """``ctx`` is a usable context (not broken by a timeout); ``alone``: a call made by this rank by
    itself, which a rank of a simulated world of several cannot make."""
    if not hasattr(ctx, "_ensure_usable") or not hasattr(ctx, "plans"):
        raise TypeError(f"{op}: ctx must be a context from numasched.distributed.init() (or a rank of a SimWorld), "
                        f"got {type(ctx).__name__}")
    ctx._ensure_usable()
    if alone and getattr(ctx, "world_", None) is not None and ctx.world > 1:
        raise ValueError("a simulated rank cannot call alone: use SimWorld.run(op, per_rank_args)")


def run(ctx, op: str, *args, check: bool = True, **kwargs):
    """One call of ``op`` on a real (or one-rank simulated) context."""
    spec = OPS[op]
    check_context(ctx, op)
    call = spec.prepare(ctx, *args, **kwargs)
    plan = plan_for(ctx, op, call)
    # a capture: no status read (a host sync), and a plan a CUDA graph holds is never given back
    capturing = (check or ctx.recycle) and ctx.device.type == "cuda" and torch.cuda.is_current_stream_capturing()
    if ctx.recycle:
        ctx.used(call.key, capturing)
    out = spec.launch(ctx, plan, call, phase="full")
    if check and not capturing:
        ctx.check(op)
    return out


def plan_for(ctx, op: str, call: Call) -> Plan:
    """``ctx``'s plan for ``call`` (made on first use: the ranks' headers checked against each
    other, buffers, then a barrier)."""
    spec = OPS[op]
    plan = ctx.plans.get(call.key)
    if plan is None:
        check_headers(op, ctx.exchange(call.header) if hasattr(ctx, "exchange") else [call.header])
        with ctx.making_plan(call.key):
            plan = ctx.plans[call.key] = spec.plan(ctx, call)
        # The new buffers and flags were zero-filled with a zero_() queued on each rank's stream
        # (iris.zeros), not at once. A peer may push into our buffers and set our flags as soon as
        # its own first call starts, so no rank may start before every rank's fill has run: a push
        # that lands first is wiped (we read zeros) or its flag is lost (we time out). The fused
        # kernels got this barrier from _first_use (compile, then barrier); impl="ce" had none.
        # protocol.simulate(..., init_barrier=False) shows the failure. Once per signature.
        if hasattr(ctx, "barrier"):
            ctx.barrier()
    return plan


def required_heap_bytes(workload, world: int) -> int:
    """Heap bytes the given calls need: ``workload`` is a list of (op name, *tensors) with the
    tensors (meta tensors are fine) each rank will pass, and optionally a dict of keyword
    arguments last, e.g. ``[("all_gather_matmul", a_local, b), ("all_gather_matmul", a_local, b,
    {"impl": "ce"}), ("flash_decode_distributed", q, k_cache_local)]``."""
    if isinstance(world, bool) or not isinstance(world, int) or world < 1:
        raise ValueError(f"world must be a positive int (ranks), got {world!r}")
    total = 0
    for i, item in enumerate(workload):
        if not isinstance(item, (tuple, list)) or not item:
            raise TypeError(f"workload[{i}] must be a tuple (op name, *tensors[, kwargs]), got {item!r}")
        op, *tensors = item
        kw = tensors.pop() if tensors and isinstance(tensors[-1], dict) else {}
        if op not in OPS:
            raise ValueError(f"unknown op {op!r} in workload; one of {sorted(OPS)}")
        spec = OPS[op]
        names = {"all_gather_matmul": ("a_local", "b", "K"), "matmul_reduce_scatter": ("a", "b_local", "K_local"),
                 "matmul_all_reduce": ("a", "b_local", "K_local")}.get(op)
        if names is not None and len(tensors) >= 2:
            na, nb, nk = names
            _check_operands(None, f"workload[{i}] {na}", tensors[0], f"workload[{i}] {nb}", tensors[1], nk)
        if op == "matmul_reduce_scatter" and tensors[0].shape[0] % world:
            raise ValueError(f"matmul_reduce_scatter: a has {tensors[0].shape[0]} rows, not a multiple of {world}")
        call = spec.describe(*tensors, world=world, **kw)
        total += sum(alloc_bytes(_numel(s) * torch.empty((), dtype=dt).element_size())
                     for _, s, dt in spec.buffers(call))
    return total


def _numel(shape):
    n = 1
    for s in shape:
        n *= s
    return n
