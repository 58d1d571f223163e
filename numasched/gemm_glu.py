"""SwiGLU GEMM: ``silu(a @ b_gate) * (a @ b_up)`` in one launch: check, plan, run.

    y = numasched.matmul_swiglu(x, w_gate_up.T)        # w_gate_up (2n, K): gate rows, then up rows
    plan = numasched.plan_matmul_swiglu(x, w_gate_up.T)  # once per signature
    y = plan.run(x, w_gate_up.T)                          # every step (graph-safe)

A transformer MLP's first projection is followed by ``silu(gate) * up``: with separate kernels
the (M, 2n) projection goes to memory and comes back, and at decode sizes the extra launch
costs more than the arithmetic. Here the split-K GEMM kernel (kernels/gemm_splitk.py, ``GLU``)
accumulates a gate tile and the matching up tile together (two weight tiles per K step, one A
tile) and stores ``silu(gate) * up`` in fp32 before the one rounding to the output dtype; split
partials of both halves are merged in split order by the last program (deterministic).

The schedule is the model's split-K pick for the (M, 2n, K) GEMM (numasched.gemm_schedule) with
half its tile width, so the launch has as many programs reading as many weight bytes each as
the plain projection would. Meant for decode-sized M (the split-K kernel's regime); any M runs.

The activation alone, for a gate/up projection run as a plain GEMM:

    y = numasched.swiglu(gu)       # silu(gu[:, :n]) * gu[:, n:], one PDL-launched kernel

(kernels/swiglu.py): between two of numasched's GEMMs it keeps the chain of dependent launches
that a compiled elementwise kernel breaks.
"""
from __future__ import annotations

from typing import Optional

import torch

from . import caps
from . import gemm_schedule as _sched
from . import mappings as M
from . import observe as _observe
from . import options as _options
from . import topology as _topology
from ._plan import PLANS, Plan, fast_signature, signature, upcast_like
from ._route import plain_eager, refuse_grad
from ._validate import check_int32_indexing, check_no_overlap, check_tensor
from .gemm import SUPPORTED_DTYPES, TensorDescriptor, _splitk_buffers, input_precision, tma_view

__all__ = ["matmul_swiglu", "plan_matmul_swiglu", "check_matmul_swiglu", "SwiGLUPlan", "swiglu", "plan_swiglu",
           "check_swiglu", "SwiGLUActPlan"]


def check_matmul_swiglu(a, b, out=None, row_scale=None):
    """Check without reading data; returns (M, n, K, dtype). ``b`` is (K, 2n): gate columns, then
    up columns (``w.T`` of an F.linear weight whose first n rows are the gate's); ``row_scale``
    (M,) contiguous fp32, one factor per row of ``a``."""
    check_tensor("a", a, ndim=2, dtypes=SUPPORTED_DTYPES)
    check_tensor("b", b, ndim=2, dtypes=(a.dtype,), device=a.device)
    Mdim, K = a.shape
    if b.shape[0] != K:
        raise ValueError(f"b has {b.shape[0]} rows but a has {K} columns (a @ b needs them equal)")
    if b.shape[1] % 2 or b.shape[1] == 0:
        raise ValueError(f"b must have an even, positive number of columns (gate then up), got {b.shape[1]}")
    n = b.shape[1] // 2
    if out is not None:
        check_tensor("out", out, ndim=2, dtypes=(a.dtype,), device=a.device)
        if tuple(out.shape) != (Mdim, n):
            raise ValueError(f"out must have shape {(Mdim, n)}, got {tuple(out.shape)}")
    if row_scale is not None:
        check_tensor("row_scale", row_scale, ndim=1, dtypes=(torch.float32,), device=a.device)
        if row_scale.shape[0] != Mdim or (Mdim > 1 and row_scale.stride(0) != 1):
            raise ValueError(f"row_scale must be a contiguous ({Mdim},) fp32 tensor (one factor per row of a), got "
                             f"shape {tuple(row_scale.shape)}, strides {row_scale.stride()}")
    for name, t in (("a", a), ("b", b)):
        check_int32_indexing(name, t)
    return Mdim, n, K, a.dtype


# Prefill sizes: 128 x 256 tiles of the (M, 2n, K) GEMM (a 128 x 128 gate tile and its up tile),
# unsplit, 3 stages. The model's split-K pick there (128 x 128, 6 stages: 128 x 64 GLU tiles)
# ran 1.2x the time of cuBLAS's GEMM + the compiled activation; these tiles ran 0.96-0.99x it at
# 1024-8192 rows and 0.97 at 512 (one H100, n = 7168 and 14336, K = 4096, graph replays;
# bench/results/glu-s23/glu_prefill_probe-h100.log).
GLU_BIG_SCHEDULE = _sched.Schedule.parse("splitk 128x256x64 w8 s3")
GLU_BIG_MIN_ROWS = 512
# The persistent kernel (kernels/gemm_glu.py: one program per SM, tile and K loops fused so the
# operand pipeline runs across tiles, a TMA store): a "tiled ... persistent" schedule names it.
# Off by default: slower than the split-K kernel's tiles at every size timed (one H100,
# bench/results/glu-persistent-s26/: 4096 x 2 x 7168 x 4096 900.9 us against 732.4, 534 TF/s
# against 657; 4 stages, 128 x 128 and K 128 tiles slower still), though its fused loop keeps
# two wgmma groups in flight as the split-K kernel's does.
GLU_PERSISTENT_SCHEDULE = _sched.Schedule.parse("tiled 128x256x64 w8 s3 persistent")
GLU_PERSISTENT_BY_DEFAULT = False   # options.glu_persistent overrides
# The warp-specialised Gluon kernel (kernels/gemm_ws.py, GLU form: a loader warp, two consumer
# warpgroups, no CTA-wide barrier in the K loop) at the same sizes, where it can take the operands
# (numasched.gemm_ws.supported: Hopper, 16-byte aligned rows).
GLU_WS_BY_DEFAULT = False   # options.glu_ws overrides
# Between those: the fused split-K kernel's GLU tiles are half the (M, 2n, K) schedule's width, and
# where that schedule is narrow or the rows fill several tile rows they ran far behind the two
# kernels numasched.matmul (the WS, row-group and wide tiles of the plain GEMM) + numasched.swiglu
# (one H200, Llama-3-8B MLP, bench/results/glu-s39/glu-forms.*): at 24-32 rows and n = 14336
# (16-column GLU tiles) 92 against 67-68 us, at 140-400 rows 1.2-1.9x (172 against 95 us at 140 x
# 14336, 78 against 48 at 140 x 7168), at 72 rows 1.05x; even or 5 % ahead only where its GLU
# tiles are 64 columns or more at up to 64 rows (35 against 37 us at 24-32 x 7168), and at 1-16
# rows (the weight stream, bench/results/glu-s18/: 71.7 against 72.3 us). So from GLU_FUSED_MAX_ROWS
# rows, or narrower GLU tiles than GLU_FUSED_MIN_COLS, up to GLU_BIG_MIN_ROWS, without a row
# factor: the two kernels (options.glu_fused forces either).
GLU_FUSED_MAX_ROWS = 64
GLU_FUSED_ANY_ROWS = 16
GLU_FUSED_MIN_COLS = 64


def glu_fused_pays(M: int, schedule) -> bool:
    """Whether the fused split-K SwiGLU kernel runs an (M, n) SwiGLU GEMM whose (M, 2n, K)
    split-K schedule is ``schedule`` (see GLU_FUSED_*), rather than the GEMM then the activation."""
    return M <= GLU_FUSED_ANY_ROWS or (M <= GLU_FUSED_MAX_ROWS and schedule.block_n // 2 >= GLU_FUSED_MIN_COLS)


def big_tiles(M: int, n: int, dtype) -> bool:
    """Whether :data:`GLU_BIG_SCHEDULE` runs an (M, n) SwiGLU GEMM: from GLU_BIG_MIN_ROWS rows
    of 2-byte operands (the sizes it was measured at)."""
    return M >= GLU_BIG_MIN_ROWS and n >= 128 and dtype.itemsize == 2


class SwiGLUPlan(Plan):
    """A planned SwiGLU GEMM (:func:`plan_matmul_swiglu`). Attributes: M, n, K; schedule (the
    split-K Schedule for the (M, 2n, K) GEMM); block_n (the GLU tile: half the schedule's);
    split_k; path ("tma" or "pointer"); mode ("kernel", "interpreter", "torch", "empty"); grid;
    config; workspace_bytes; tensors; row_scale (whether the plan takes one)."""

    op = "matmul_swiglu"

    def __init__(self, a, b, out=None, *, schedule=None, options: Optional[_options.Options] = None,
                 row_scale=None):
        Mdim, n, K, dtype = check_matmul_swiglu(a, b, out, row_scale)
        options = options if options is not None else _options.current()
        self.M, self.n, self.K = Mdim, n, K
        self.row_scale = row_scale is not None
        self.tensors = dict(a=signature(a), b=signature(b), out=signature(out), row_scale=signature(row_scale))
        self.device = dev = a.device
        self.topology = _topology.current()
        self.schedule = self.config = self.policy = None
        self.grid, self.block_n, self.split_k, self.path, self.workspace_bytes = (), 0, 1, "pointer", 0
        self.a_pointer = ""   # split-K on TMA: "b_tma_last", A's partial last tile row through pointers
        self._launch = None
        self.mode = "empty" if Mdim == 0 or K == 0 else caps.launch_mode(dev)
        if self.mode in ("empty", "torch"):
            self._freeze()
            return
        from ._launch import Launch
        from .kernels import gemm_splitk as KS

        interp = self.mode == "interpreter"
        self._upcast = interp and dtype == torch.bfloat16  # the interpreter's bf16 dot is wrong
        a_view, b_view = tma_view(a), tma_view(b)
        tma_possible = (options.gemm_splitk_tma and a_view is not None and b_view is not None
                        and TensorDescriptor is not None)
        automatic, two_kernels = schedule is None, False
        if schedule is None and not interp and big_tiles(Mdim, n, dtype) and self._plan_ws(a, b, out, row_scale,
                                                                                         options):
            self._freeze()
            return
        if schedule is None and not interp:
            if big_tiles(Mdim, n, dtype) and tma_possible and caps.tma_supported(dev):
                persistent = options.glu_persistent
                persistent = GLU_PERSISTENT_BY_DEFAULT if persistent is None else persistent
                # the persistent kernel reads A through a row-major descriptor
                schedule = GLU_PERSISTENT_SCHEDULE if persistent and not a_view[0] else GLU_BIG_SCHEDULE
            else:
                schedule = _sched.choose(Mdim, 2 * n, K, dtype, dev, splitk_only=True,
                                         splitk_tma=tma_possible and caps.tma_supported(dev))
                if options.glu_fused is None and not glu_fused_pays(Mdim, schedule):
                    two_kernels = row_scale is None   # the GEMM, then the activation (GLU_FUSED_*)
        if options.glu_fused is False and row_scale is None and automatic:   # (a schedule asked for is fused)
            two_kernels = True
        if two_kernels:
            from .gemm import plan_matmul

            self.schedule, self.path = schedule, "two-kernel"
            self._mm = plan_matmul(a, b, options=options)
            self._act = {}
            self._freeze()
            return
        if schedule is not None and schedule.kind == "tiled":
            self._plan_persistent(a, b, out, a_view, b_view, schedule, tma_possible, interp, dtype, options)
            self._freeze()
            return
        if schedule is not None:
            if schedule.kind != "splitk":
                raise ValueError(f"schedule must be a split-K Schedule or a persistent tiled one, got kind "
                                 f"{schedule.kind!r}")
            cfg = dict(schedule.config())
            cfg["BLOCK_N"] = max(16, schedule.block_n // 2)
            S = schedule.split_k
        else:  # the interpreter: small tiles, split while there are few tiles (tests the merge)
            cfg = dict(KS.INTERPRETER_CONFIG)
            tiles = -(-Mdim // cfg["BLOCK_M"]) * -(-n // cfg["BLOCK_N"])
            S = max(1, min(4, K // (2 * cfg["BLOCK_K"]), 8 // tiles))
        if interp:
            cfg.update(num_warps=4, num_stages=1)
        self.schedule, self.split_k, self.block_n = schedule, S, cfg["BLOCK_N"]
        self.config = cfg
        bk = cfg["BLOCK_K"]
        self._kps = -(-(-(-K // S)) // bk) * bk
        NM, NN = -(-Mdim // cfg["BLOCK_M"]), -(-n // cfg["BLOCK_N"])
        self._tiles = NM * NN
        self._ws_numel = 2 * S * NM * cfg["BLOCK_M"] * NN * cfg["BLOCK_N"] if S > 1 else 0
        self.workspace_bytes = 4 * self._ws_numel
        # TMA as the split-K GEMM takes it: Hopper, tiles of 64+ rows (or the interpreter when asked)
        use_tma = tma_possible and ((interp and schedule is not None)
                                    or (not interp and caps.tma_supported(dev) and cfg["BLOCK_M"] >= 64))
        self.path = "tma" if use_tma else "pointer"
        self._views = (a_view, b_view) if use_tma else None
        self.policy = M.resolve("auto", "gemm", self.topology, M.GemmGrid(max(1, NM), max(1, NN)))
        c = out if out is not None else torch.empty((Mdim, n), dtype=dtype, device="meta")
        self._c_stride = c.stride()
        self._sizes = (Mdim, n, K, a.stride(0), a.stride(1), b.stride(0), b.stride(1), c.stride(0), c.stride(1),
                       0, 0, self._kps, 0)
        const = dict(MAPPING=self.policy.constexpr(self.topology.num_domains), SPLIT_K=S, HAS_BIAS=False,
                     HAS_RES=False, INPUT_PRECISION="ieee" if self._upcast else input_precision(dtype),
                     USE_TMA=use_tma, A_TRANS=bool(use_tma and a_view[0]), B_TRANS=bool(use_tma and b_view[0]),
                     GLU=True, ROW_SCALE=self.row_scale)
        if not use_tma:   # pointer loads: K's vector width where Triton would not see it (kernels/gemm_splitk.py)
            const.update(KS.k_vector(Mdim, n, K, self._kps, a.stride(), b.stride(), a.element_size()))
        # A's partial last tile row through pointers, as numasched.matmul's split-K takes it
        # (gemm_schedule.splitk_operands "b_tma_last"; with the SwiGLU epilogue 1.09-1.16x faster at
        # 72-80 rows on an H200, bench/results/glu-s39/glu-rows.*)
        mode = options.gemm_splitk_operands
        if mode == "auto" and not interp:
            mode = _sched.splitk_operands(cfg["BLOCK_M"], cfg["BLOCK_N"], Mdim)
        if use_tma and mode == "b_tma_last" and Mdim % cfg["BLOCK_M"] and not a_view[0] and a.stride(1) == 1:
            self.a_pointer = mode
        if self.a_pointer:
            const.update(KS.a_pointer_constants(mode, a, K, self._kps))
        self.grid = (self._tiles * S,)
        if (options.pdl and options.pdl_prefetch and not interp and not use_tma
                and caps.pdl_supported(dev)):   # B into L2 before the PDL wait (kernels/pdl.py)
            const["PREFETCH_B"] = KS.prefetch_programs(b, K, self._kps, cfg["BLOCK_N"], self.grid[0],
                                                       caps.l2_bytes(dev), halves=2)
        self._launch = Launch(KS.gemm_splitk_kernel, self.grid, const, config=cfg, device=dev, interpret=interp,
                              options=options)
        self._freeze()

    def _plan_ws(self, a, b, out, row_scale, options) -> bool:
        """The warp-specialised kernel when the options ask for it and it can take the operands."""
        from . import gemm_ws as W

        ws = options.glu_ws if options.glu_ws is not None else GLU_WS_BY_DEFAULT
        if not ws or W.supported(a, b, out, glu=True) is not None:
            return False
        self._ws = W.WsGemmPlan(a, b, out, config=W.GLU_CONFIG, row_scale=row_scale)
        self.path, self.config, self.block_n = "ws", W.GLU_CONFIG, W.GLU_CONFIG.block_n
        self.grid = (self._ws.num_programs,)
        return True

    def _plan_persistent(self, a, b, out, a_view, b_view, schedule, tma_possible, interp, dtype, options):
        """The persistent kernel (kernels/gemm_glu.py) for a "tiled ... persistent" schedule: TMA
        descriptors for A (row-major), B (either order) and the output; about one program per SM."""
        from ._launch import Launch
        from .kernels import gemm_glu as KG

        why = ("schedule must be persistent" if not schedule.persistent
               else "TMA descriptors are off or not supported here" if not tma_possible
               else "a must be row-major (unit stride along K)" if a_view[0]
               else None)
        if why is None and not interp and not caps.tma_supported(self.device):
            why = f"{self.device} has no TMA"
        if why is not None:
            raise ValueError(f"schedule {schedule.describe()!r} runs the persistent SwiGLU kernel: {why}")
        cfg = dict(BLOCK_M=schedule.block_m, BLOCK_N=max(16, schedule.block_n // 2), BLOCK_K=schedule.block_k,
                   num_warps=4 if interp else schedule.num_warps, num_stages=1 if interp else schedule.num_stages)
        if interp:   # the interpreter: its dot needs >= 16; small tiles so that programs loop over several
            cfg.update(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16)
        self.schedule, self.split_k, self.block_n, self.config = schedule, 1, cfg["BLOCK_N"], cfg
        self.path = "tma-persistent"
        NM, NN = -(-self.M // cfg["BLOCK_M"]), -(-self.n // cfg["BLOCK_N"])
        self._tiles, self._ws_numel = NM * NN, 0
        self.grid = (max(1, min(self._tiles, 3 if interp else caps.num_sms(self.device))),)
        self._views = (a_view, b_view)
        # the output through a TMA descriptor where one can address it (row-major, 16-byte aligned
        # base and row stride: a contiguous out of n % 8 == 0 bf16 columns), else masked stores
        if out is not None:
            cv = tma_view(out)
            self._c_tma, self._c_stride = cv is not None and not cv[0], out.stride()
        else:   # run() makes a contiguous (M, n) out
            self._c_tma, self._c_stride = (self.n * dtype.itemsize) % 16 == 0, (self.n, 1)
        self.policy = M.resolve("auto", "gemm", self.topology, M.GemmGrid(max(1, NM), max(1, NN)))
        const = dict(MAPPING=self.policy.constexpr(self.topology.num_domains), BLOCK_M=cfg["BLOCK_M"],
                     BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"], B_TRANS=bool(b_view[0]),
                     ROW_SCALE=self.row_scale, C_TMA=self._c_tma)
        self._launch = Launch(KG.glu_persistent_kernel, self.grid, const, config=cfg, device=self.device,
                              interpret=interp, options=options)

    def _run_persistent(self, a, b, out, row_scale):
        (_, ashape, astr), (bt, bshape, bstr) = self._views
        bm, bn, bk = self.config["BLOCK_M"], self.config["BLOCK_N"], self.config["BLOCK_K"]
        a_desc = TensorDescriptor(a, ashape, astr, [bm, bk])
        b_desc = TensorDescriptor(b, bshape, bstr, [bn, bk] if bt else [bk, bn])
        c_desc = None
        if self._c_tma:
            c_view = tma_view(out)
            if c_view is None or c_view[0]:
                raise ValueError("out's data pointer is not 16-byte aligned (the plan's kernel stores through a "
                                 "TMA descriptor); make a plan with out= for it")
            c_desc = TensorDescriptor(out, c_view[1], c_view[2], [bm, bn])
        with caps.launch_device(a):
            self._launch(a_desc, b_desc, c_desc, out, row_scale if row_scale is not None else out, self.M, self.n,
                         self.K, out.stride(0), out.stride(1))

    def run(self, a, b, out=None, row_scale=None) -> torch.Tensor:
        """``silu(a @ b[:, :n]) * (a @ b[:, n:])`` into ``out`` (a new (M, n) tensor when None); with
        ``row_scale`` (a plan made with one) row i of ``a`` counts as ``row_scale[i] * a[i]``."""
        self.check_signatures(a=a, b=b, out=out if self.tensors["out"] is not None else None, row_scale=row_scale)
        given = out is not None
        if out is None:
            out = torch.empty((self.M, self.n), dtype=a.dtype, device=a.device)
        elif self.tensors["out"] is None:
            check_tensor("out", out, ndim=2, dtypes=(a.dtype,), device=a.device)
            if tuple(out.shape) != (self.M, self.n) or out.stride() != (self.n, 1):
                raise ValueError(f"out must be a contiguous ({self.M}, {self.n}) tensor for this plan (it was made "
                                 f"without out), got shape {tuple(out.shape)} with strides {out.stride()}")
            if out.data_ptr() % 16:
                raise ValueError("out's data pointer is not 16-byte aligned (the plan's kernel is specialised "
                                 "for aligned outputs); make a plan with out= for it")
        if given:   # every call (a plan's signatures hold out's layout, not its address)
            check_no_overlap(out, a=a, b=b, row_scale=row_scale)
        if self.mode == "empty":
            return out.zero_() if self.K == 0 else out
        if self.mode == "torch":
            if _observe.OBSERVERS:
                _observe.notify(self.op, "torch", (), (out,), self,
                                f"no Triton kernel can run on {self.device} (CPU tensors need TRITON_INTERPRET=1)")
            gu = a.float() @ b.float()
            if row_scale is not None:
                gu = gu * row_scale[:, None]
            return out.copy_(torch.nn.functional.silu(gu[:, :self.n]) * gu[:, self.n:])
        res = out
        if self._upcast:   # fp32 stand-ins with the planned strides (the kernel's arguments)
            a, b = upcast_like(a), upcast_like(b)
            out = torch.empty_strided((self.M, self.n), self._c_stride, dtype=torch.float32, device=a.device)
        if self.path == "two-kernel":   # numasched.matmul into an (M, 2n) buffer, then numasched.swiglu
            gu = self._mm.run(a, b)
            key = fast_signature(out)
            act = self._act.get(key)
            if act is None:
                act = self._act.setdefault(key, SwiGLUActPlan(gu, out))
            return act.run(gu, out)
        if self.path == "ws":
            if _observe.OBSERVERS:
                _observe.notify(self.op, "gemm_ws", self.grid, (res,), self)
            with caps.launch_device(a):
                return self._ws.run(a, b, out, row_scale)
        if self.path == "tma-persistent":
            if _observe.OBSERVERS:
                _observe.notify(self.op, "glu_persistent", self.grid, (res,), self)
            self._run_persistent(a, b, out, row_scale)
            if out is not res:
                res.copy_(out)
            return res
        dev = self.device
        if self._ws_numel:
            ws, ctr = _splitk_buffers(dev, self._ws_numel, self._tiles, caps.stream_handle(dev), caps.capturing(dev))
        else:
            ws = ctr = out
        if self._views is not None:
            (at, ashape, astr), (bt, bshape, bstr) = self._views
            bm, bn, bk = self.config["BLOCK_M"], self.config["BLOCK_N"], self.config["BLOCK_K"]
            a_arg = TensorDescriptor(a, ashape, astr, [bk, bm] if at else [bm, bk])
            b_arg = TensorDescriptor(b, bshape, bstr, [bn, bk] if bt else [bk, bn])
        else:
            a_arg, b_arg = a, b
        if _observe.OBSERVERS:
            _observe.notify(self.op, "splitk", self.grid, (res,), self)
        with caps.launch_device(a):
            self._launch(a_arg, b_arg, out, row_scale if row_scale is not None else out, out, ws, ctr, *self._sizes,
                         a if self.a_pointer else out)
        if out is not res:
            res.copy_(out)
        return res


def plan_matmul_swiglu(a, b, out=None, *, schedule=None, options: Optional[_options.Options] = None,
                       row_scale=None) -> SwiGLUPlan:
    """Plan :func:`matmul_swiglu` for operands like these (only their signatures are read).
    ``schedule``: a split-K Schedule of the (M, 2n, K) GEMM to use instead of the model's."""
    return SwiGLUPlan(a, b, out, schedule=schedule, options=options, row_scale=row_scale)


def _key(a, b, out, row_scale=None):
    return ("matmul_swiglu", a.shape, a.stride(), a.dtype, a.device, a.data_ptr() & 15, b.shape, b.stride(),
            b.device, b.data_ptr() & 15, None if out is None else (out.shape, out.stride(), out.data_ptr() & 15),
            row_scale is not None, a.device.type != "cuda" and caps.interpreting(), _topology.current(),
            _options._CURRENT)


def _run(a, b, out=None, row_scale=None):
    key, plan = PLANS.find(_key, a, b, out, row_scale)
    if plan is None:
        plan = SwiGLUPlan(a, b, out, row_scale=row_scale)
        if key is not None:
            PLANS.put(key, plan)
    return plan.run(a, b, out, row_scale)


# torch.compile, fake tensors and dispatch modes see one custom op (no autograd: inference)
@torch.library.custom_op("numasched::matmul_swiglu", mutates_args=())
def _swiglu_op(a: torch.Tensor, b: torch.Tensor, row_scale: Optional[torch.Tensor] = None) -> torch.Tensor:
    check_matmul_swiglu(a, b, None, row_scale)
    return _run(a, b, None, row_scale)


@_swiglu_op.register_fake
def _swiglu_fake(a, b, row_scale=None):
    Mdim, n, _, dtype = check_matmul_swiglu(a, b, None, row_scale)
    return a.new_empty((Mdim, n), dtype=dtype)


def matmul_swiglu(a: torch.Tensor, b: torch.Tensor, *, out: Optional[torch.Tensor] = None,
                  row_scale: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``silu(a @ b[:, :n]) * (a @ b[:, n:])`` for a (M, K) and b (K, 2n) (any strides; ``w.T`` of a
    (2n, K) gate/up weight is read without a copy), fp32 accumulation, one launch. Returns (M, n)
    in a's dtype (into ``out`` when given). ``row_scale`` (M,) fp32: row i of ``a`` counts as
    ``row_scale[i] * a[i]``, applied to the fp32 accumulators before the activation (an RMSNorm
    whose weight is folded into ``b``: its 1 / rms per row, so the normalised rows never go to
    memory). Plans are cached per signature. Inference only (no autograd); under torch.compile
    it is the custom op ``numasched::matmul_swiglu``."""
    check_matmul_swiglu(a, b, out, row_scale)
    if row_scale is None:
        return _route("matmul_swiglu", _run, torch.ops.numasched.matmul_swiglu, (a, b), out)
    return _route("matmul_swiglu", lambda a_, b_, s_, o_: _run(a_, b_, o_, s_), torch.ops.numasched.matmul_swiglu,
                  (a, b, row_scale), out)


def _route(name, eager, op, args, out):
    """A checked call of this module's ops: the eager plan where it may run without the
    dispatcher, else the custom op ``op`` (no autograd: refused by name)."""
    if plain_eager(*args, out):
        return eager(*args, out)
    refuse_grad(name, *args, out)
    y = op(*args)
    return y if out is None else out.copy_(y)


# ---------------------------------------------------------------- the activation alone
def check_swiglu(gu, out=None):
    """Check without reading data; returns (M, n, dtype). ``gu`` is (M, 2n): gate columns, then up
    columns, unit stride along them (a gate/up projection's output)."""
    check_tensor("gu", gu, ndim=2, dtypes=SUPPORTED_DTYPES)
    Mdim, two_n = gu.shape
    if two_n % 2 or two_n == 0:
        raise ValueError(f"gu must have an even, positive number of columns (gate then up), got {two_n}")
    if gu.stride(1) != 1 and Mdim > 0:
        raise ValueError(f"gu's columns must be contiguous (stride 1), got strides {gu.stride()}")
    n = two_n // 2
    if out is not None:
        check_tensor("out", out, ndim=2, dtypes=(gu.dtype,), device=gu.device)
        if tuple(out.shape) != (Mdim, n):
            raise ValueError(f"out must have shape {(Mdim, n)}, got {tuple(out.shape)}")
        if out.stride(1) != 1 and Mdim > 0:
            raise ValueError(f"out's columns must be contiguous (stride 1), got strides {out.stride()}")
    for name, t in (("gu", gu), ("out", out)):
        if t is not None:
            check_int32_indexing(name, t)
    return Mdim, n, gu.dtype


class SwiGLUActPlan(Plan):
    """A planned :func:`swiglu` (M, n; grid; mode: "kernel", "interpreter", "torch", "empty")."""

    op = "swiglu"

    def __init__(self, gu, out=None, *, options: Optional[_options.Options] = None):
        Mdim, n, _ = check_swiglu(gu, out)
        self.M, self.n = Mdim, n
        self.tensors = dict(gu=signature(gu), out=signature(out))
        self.device = gu.device
        self.mode = "empty" if Mdim == 0 else caps.launch_mode(gu.device)
        self.grid, self._launch = (), None
        if self.mode in ("kernel", "interpreter"):
            from ._launch import Launch
            from .kernels import swiglu as K

            bn = K.BLOCK_N if self.mode == "kernel" else 64
            self.grid = (Mdim, -(-n // bn))
            self._launch = Launch(K.swiglu_kernel, self.grid, dict(BLOCK_N=bn), config={"num_warps": 4},
                                  device=gu.device, interpret=self.mode == "interpreter", options=options)
        self._freeze()

    def run(self, gu, out=None) -> torch.Tensor:
        """``silu(gu[:, :n]) * gu[:, n:]`` into ``out`` (a new (M, n) tensor when None)."""
        self.check_signatures(gu=gu, out=out if self.tensors["out"] is not None else None)
        given = out is not None
        if out is None:
            out = torch.empty((self.M, self.n), dtype=gu.dtype, device=gu.device)
        elif self.tensors["out"] is None:   # the kernel was specialised for the plan's own output
            check_swiglu(gu, out)
            if out.stride() != (self.n, 1) or out.data_ptr() % 16:
                raise ValueError(f"out must be a contiguous, 16-byte aligned ({self.M}, {self.n}) tensor for this "
                                 f"plan (it was made without out), got strides {out.stride()}; make a plan with out=")
        if given:   # every call (a plan's signatures hold out's layout, not its address)
            check_no_overlap(out, gu=gu)
        if self.mode == "empty":
            return out
        if self.mode == "torch":
            if _observe.OBSERVERS:
                _observe.notify(self.op, "torch", (), (out,), self,
                                f"no Triton kernel can run on {self.device} (CPU tensors need TRITON_INTERPRET=1)")
            return out.copy_(torch.nn.functional.silu(gu[:, :self.n]) * gu[:, self.n:])
        if _observe.OBSERVERS:
            _observe.notify(self.op, "kernel", self.grid, (out,), self)
        with caps.launch_device(gu):
            self._launch(gu, out, self.n, gu.stride(0), out.stride(0))
        return out


def plan_swiglu(gu, out=None, *, options: Optional[_options.Options] = None) -> SwiGLUActPlan:
    """Plan :func:`swiglu` for tensors like these (only their signatures are read)."""
    return SwiGLUActPlan(gu, out, options=options)


def _act_key(gu, out):
    return ("swiglu", fast_signature(gu), fast_signature(out), gu.device.type != "cuda" and caps.interpreting(),
            _options._CURRENT)


def _act_run(gu, out=None):
    key, plan = PLANS.find(_act_key, gu, out)
    if plan is None:
        plan = SwiGLUActPlan(gu, out)
        if key is not None:
            PLANS.put(key, plan)
    return plan.run(gu, out)


@torch.library.custom_op("numasched::swiglu", mutates_args=())
def _act_op(gu: torch.Tensor) -> torch.Tensor:
    check_swiglu(gu)
    return _act_run(gu)


@_act_op.register_fake
def _act_fake(gu):
    Mdim, n, dtype = check_swiglu(gu)
    return gu.new_empty((Mdim, n), dtype=dtype)


def swiglu(gu: torch.Tensor, *, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``silu(gu[:, :n]) * gu[:, n:]`` for gu (M, 2n) (gate columns, then up): silu in fp32,
    rounded to the dtype, times up, rounded (as ``F.silu(g) * u``). One kernel, launched with
    programmatic dependent launch on NVIDIA sm_90+ (kernels/swiglu.py). Returns (M, n) (into
    ``out`` when given); plans cached per signature. Inference only (no autograd); under
    torch.compile it is the custom op ``numasched::swiglu``."""
    check_swiglu(gu, out)
    return _route("swiglu", _act_run, torch.ops.numasched.swiglu, (gu,), out)
