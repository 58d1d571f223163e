"""Prefill attention forward (FlashAttention-2 style), one kernel for every mapping policy.

Layout: q (B, H, Lq, D), k and v (B, HK, Lk, D), any strides with a unit last stride; HK divides
H (GQA: query head h reads KV head h // (H // HK)). Outputs: o (B, H, Lq, D) (any strides) and
the log-sum-exp lse (B, H, Lq) in float32, natural log.

Masking: with CAUSAL, key j is visible to query i iff j <= i + causal_offset. causal_offset = 0
is torch's ``is_causal`` (top-left aligned); Lk - Lq is FlashAttention's bottom-right alignment.
A query row that sees no key gets zeros and lse = -inf (never NaN).

Work items: program ``pid`` works on query block m of head h of batch element b, where

    g = REMAP(pid, W, NUM_DOMAINS, REMAP_PARAM)                    # W = B * H * NB programs
    b, h, m = ORDER(g, B, H, HK, NB, NUM_DOMAINS, ORDER_PARAM)     # the mapping policy

so every registered attention policy runs with this one kernel (numasched/mappings).

The loop is FlashAttention-2's online softmax in base 2 (log2(e) folded into the scale), split
in two stages so that the common blocks pay for no mask at all:
  1. key blocks that every row of the query block sees in full: no masking;
  2. the blocks on the causal diagonal and the ragged end of the keys: masked.
Loads use TMA tensor descriptors (``tl.make_tensor_descriptor``, Hopper and later; zero padding
outside the tensor) or plain pointer loads (USE_TMA=False; the interpreter runs both).
"""
import functools
import os

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453


@triton.jit
def _attn_stage(acc, l_i, m_i, q, k_ptr, v_ptr, k_desc, v_desc, stride_kn, stride_vn,
                lo, hi, offs_m, Lk, qk_scale, causal_offset,
                MASKED: tl.constexpr, CAUSAL: tl.constexpr, HEAD_DIM: tl.constexpr,
                BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, USE_TMA: tl.constexpr,
                DOT_PRECISION: tl.constexpr):
    """One stage of the online softmax over key blocks [lo, hi); MASKED adds the key mask."""
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    for start_n in range(lo, hi, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        kn = start_n + offs_n
        # -- load K and V for this block (zeros beyond Lk and beyond HEAD_DIM) --
        if USE_TMA:
            k = k_desc.load([start_n, 0])
            v = v_desc.load([start_n, 0])
        else:
            kv_mask = offs_d[None, :] < HEAD_DIM
            if MASKED:
                kv_mask = kv_mask & (kn[:, None] < Lk)
            k = tl.load(k_ptr + kn[:, None] * stride_kn + offs_d[None, :], mask=kv_mask, other=0.0)
            v = tl.load(v_ptr + kn[:, None] * stride_vn + offs_d[None, :], mask=kv_mask, other=0.0)
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
        if MASKED:
            valid = kn[None, :] < Lk
            if CAUSAL:
                valid = valid & (kn[None, :] <= offs_m[:, None] + causal_offset)
            qk = tl.where(valid, qk * qk_scale, float("-inf"))
            m_ij = tl.maximum(m_i, tl.max(qk, 1))
            # a row that has seen no key yet keeps m = -inf; subtract 0 there so exp2 gives 0, not NaN
            m_sub = tl.where(m_ij == float("-inf"), 0.0, m_ij)
            p = tl.math.exp2(qk - m_sub[:, None])
        else:
            # every score is finite here: scale after the row max (one FMA per score)
            m_ij = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
            m_sub = m_ij
            p = tl.math.exp2(qk * qk_scale - m_ij[:, None])
        alpha = tl.math.exp2(m_i - m_sub)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)
        m_i = m_ij
    return acc, l_i, m_i


@triton.jit
def attn_fwd_kernel(Q, K, V, O, LSE,
                    stride_qb, stride_qh, stride_qm,
                    stride_kb, stride_kh, stride_kn,
                    stride_vb, stride_vh, stride_vn,
                    stride_ob, stride_oh, stride_om,
                    B, H, HK, Lq, Lk, qk_scale, causal_offset,
                    Q_BUCKET, K_BUCKET, TMA_OK,  # autotuning keys and pruning only
                    HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr, LPT: tl.constexpr,
                    DOT_PRECISION: tl.constexpr,
                    REMAP: tl.constexpr, REMAP_PARAM: tl.constexpr, ORDER: tl.constexpr,
                    ORDER_PARAM: tl.constexpr, NUM_DOMAINS: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                    USE_TMA: tl.constexpr):
    # ---- which work item: the mapping policy decides ----
    NB = tl.cdiv(Lq, BLOCK_M)
    W = B * H * NB
    g = REMAP(tl.program_id(0), W, NUM_DOMAINS, REMAP_PARAM)
    b, h, m = ORDER(g, B, H, HK, NB, NUM_DOMAINS, ORDER_PARAM)
    if LPT:
        # causal: the policy's block m runs the (NB-1-m)-th block, so the costliest blocks of a
        # head start first (longest-processing-time order); which program shares K/V is unchanged
        m = NB - 1 - m
    hk = h // (H // HK)
    start_m = m * BLOCK_M

    # 64-bit offsets of this (batch, head) slice; the kernel indexes inside a slice in int32
    q_ptr = Q + b.to(tl.int64) * stride_qb + h.to(tl.int64) * stride_qh
    k_ptr = K + b.to(tl.int64) * stride_kb + hk.to(tl.int64) * stride_kh
    v_ptr = V + b.to(tl.int64) * stride_vb + hk.to(tl.int64) * stride_vh
    o_ptr = O + b.to(tl.int64) * stride_ob + h.to(tl.int64) * stride_oh

    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)

    # ---- Q block: loaded once, stays in registers ----
    if USE_TMA:
        q_desc = tl.make_tensor_descriptor(q_ptr, shape=[Lq, HEAD_DIM], strides=[stride_qm, 1],
                                           block_shape=[BLOCK_M, BLOCK_D])
        k_desc = tl.make_tensor_descriptor(k_ptr, shape=[Lk, HEAD_DIM], strides=[stride_kn, 1],
                                           block_shape=[BLOCK_N, BLOCK_D])
        v_desc = tl.make_tensor_descriptor(v_ptr, shape=[Lk, HEAD_DIM], strides=[stride_vn, 1],
                                           block_shape=[BLOCK_N, BLOCK_D])
        o_desc = tl.make_tensor_descriptor(o_ptr, shape=[Lq, HEAD_DIM], strides=[stride_om, 1],
                                           block_shape=[BLOCK_M, BLOCK_D])
        q = q_desc.load([start_m, 0])
    else:
        k_desc = 0
        v_desc = 0
        q_mask = (offs_m[:, None] < Lq) & (offs_d[None, :] < HEAD_DIM)
        q = tl.load(q_ptr + offs_m[:, None] * stride_qm + offs_d[None, :], mask=q_mask, other=0.0)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    # ---- key ranges of the two stages ----
    if CAUSAL:
        # the first row of the block sees keys < start_m + causal_offset + 1, the last row keys
        # < start_m + BLOCK_M + causal_offset
        full_end = tl.minimum(start_m + causal_offset + 1, Lk)
        hi = tl.minimum(start_m + BLOCK_M + causal_offset, Lk)
    else:
        full_end = Lk
        hi = Lk
    full_end = tl.maximum(full_end, 0) // BLOCK_N * BLOCK_N
    hi = tl.maximum(hi, 0)

    # stage 1: key blocks every row sees in full
    acc, l_i, m_i = _attn_stage(acc, l_i, m_i, q, k_ptr, v_ptr, k_desc, v_desc, stride_kn, stride_vn,
                                0, full_end, offs_m, Lk, qk_scale, causal_offset,
                                False, CAUSAL, HEAD_DIM, BLOCK_N, BLOCK_D, USE_TMA, DOT_PRECISION)
    # stage 2: the diagonal and the ragged end, masked
    acc, l_i, m_i = _attn_stage(acc, l_i, m_i, q, k_ptr, v_ptr, k_desc, v_desc, stride_kn, stride_vn,
                                full_end, hi, offs_m, Lk, qk_scale, causal_offset,
                                True, CAUSAL, HEAD_DIM, BLOCK_N, BLOCK_D, USE_TMA, DOT_PRECISION)

    # ---- epilogue: normalise; rows that saw no key give 0 and lse = -inf ----
    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    out = acc / l_safe[:, None]
    lse = tl.where(empty, float("-inf"), (m_i + tl.math.log2(l_safe)) * 0.6931471805599453)
    lse_ptr = LSE + (b.to(tl.int64) * H + h) * Lq
    tl.store(lse_ptr + offs_m, lse, mask=offs_m < Lq)
    if USE_TMA:
        o_desc.store([start_m, 0], out.to(O.dtype.element_ty))
    else:
        o_mask = (offs_m[:, None] < Lq) & (offs_d[None, :] < HEAD_DIM)
        tl.store(o_ptr + offs_m[:, None] * stride_om + offs_d[None, :], out.to(O.dtype.element_ty), mask=o_mask)


# ------------------------------------------------------------------------------------ configs
def _config(bm, bn, warps, stages, tma):
    return triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "USE_TMA": tma}, num_warps=warps, num_stages=stages)


# Hopper guidance (triton.md, the Triton tutorial): BLOCK_M 128 with 8 warps (two warpgroups of
# 64 rows), BLOCK_N 64-128, 2-3 stages. Four warps on 128 rows fit registers only for D <= 64;
# a 64-row config covers short sequences and wide heads. (Compiled for sm_90 offline with
# compile_report: every 16-bit config below uses wgmma without spills at D 64 and 128.)
_GPU_SHAPES = [(128, 64, 8, 2), (128, 64, 8, 3), (128, 128, 8, 2), (128, 128, 8, 3), (64, 64, 4, 3)]
_NARROW_SHAPES = [(128, 64, 4, 3), (128, 128, 4, 2)]  # D <= 64 only
# fp32 uses IEEE dots (FMA, not tensor cores): small tiles, to limit register spills
_FP32_SHAPES = [(32, 32, 4, 2), (64, 32, 8, 2), (32, 32, 8, 1)]
GPU_CONFIGS = [_config(bm, bn, w, s, tma) for tma in (True, False)
               for (bm, bn, w, s) in _GPU_SHAPES + _NARROW_SHAPES + _FP32_SHAPES]
_FP32_KEYS = set(_FP32_SHAPES)
_NARROW_KEYS = set(_NARROW_SHAPES)

# The interpreter: small blocks so tiny test shapes still cover several blocks and both stages.
INTERPRETER_CONFIG = dict(BLOCK_M=16, BLOCK_N=16, USE_TMA=False, num_warps=4, num_stages=1)
# A fixed GPU config (no autotuning: quick benchmarks, CUDA graph capture without warm-up).
DEFAULT_GPU_CONFIG = dict(BLOCK_M=128, BLOCK_N=64, USE_TMA=True, num_warps=8, num_stages=3)


def fixed_config(dtype: torch.dtype, head_dim: int, tma_ok: bool = True) -> dict:
    """The config used without autotuning (NUMASCHED_AUTOTUNE=0, as the GPU tests run)."""
    if dtype == torch.float32:
        cfg = dict(BLOCK_M=32, BLOCK_N=32, num_warps=4, num_stages=2)
    elif head_dim > 128:
        cfg = dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=3)
    else:
        cfg = dict(DEFAULT_GPU_CONFIG)
    cfg["USE_TMA"] = bool(tma_ok)
    return cfg


def _keep(shape, tma, *, fp32: bool, head_dim: int, tma_ok: bool) -> bool:
    bm, bn, w, s = shape
    if tma and not tma_ok:
        return False
    if (shape in _FP32_KEYS) != fp32:
        return False
    if shape in _NARROW_KEYS and head_dim > 64:
        return False
    if head_dim > 128 and not fp32 and (bm > 64 or bn > 64):
        return False  # wide heads: keep Q, K and V tiles within shared memory
    return True


def _prune(configs, named_args, **kwargs):
    args = {**named_args, **kwargs}
    fp32 = args["Q"].dtype == torch.float32
    keep = [c for c in configs
            if _keep((c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages), c.kwargs["USE_TMA"],
                     fp32=fp32, head_dim=args["HEAD_DIM"], tma_ok=bool(args["TMA_OK"]))]
    return keep or [_config(32, 32, 4, 2, False)]


attn_fwd_autotuned = triton.autotune(
    GPU_CONFIGS, key=["Q_BUCKET", "K_BUCKET", "HEAD_DIM", "CAUSAL", "TMA_OK"],
    prune_configs_by={"early_config_prune": _prune})(attn_fwd_kernel)


# ------------------------------------------------------------------------------------ launch
def _bucket(n: int) -> int:
    """Autotuning key for a length: the next power of two (so HF's many lengths share tunings)."""
    return 1 << max(int(n) - 1, 0).bit_length()


def _tma_ok(*tensors) -> bool:
    """TMA needs 16-byte aligned bases and 16-byte multiples for every non-unit stride."""
    if not tensors[0].is_cuda or torch.cuda.get_device_capability(tensors[0].device)[0] < 9:
        return False
    if getattr(torch.version, "hip", None):
        return False
    for t in tensors:
        es = t.element_size()
        if t.data_ptr() % 16 or any((s * es) % 16 for s in t.stride()[:-1]) or (t.shape[-1] * es) % 16:
            return False
    return True


def _scratch_alloc(size: int, alignment: int, stream):
    # device-side tensor descriptors need a little global memory per program
    return torch.empty(size, dtype=torch.int8, device="cuda")


def _ensure_allocator():
    from triton.runtime import _allocation

    if isinstance(_allocation._allocator.get(), _allocation.NullAllocator):
        triton.set_allocator(_scratch_alloc)


@functools.lru_cache(maxsize=None)
def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def block_d(head_dim: int) -> int:
    return max(16, triton.next_power_of_2(head_dim))


_TMA_BROKEN = []  # set when the TMA variant failed to compile on this machine (then never retried)


class LaunchPlan:
    """Everything a launch needs that depends only on shapes, strides, dtype, flags and policy:
    built once per such key by :func:`plan_launch` (numasched.attention caches it), so a repeated
    call does no host work beyond the Triton launch itself. ``config`` is None until the autotuner
    has chosen (the first launch); from then on launches go straight to the kernel with it."""

    __slots__ = ("ints", "constexprs", "config", "grid", "interp", "tma_ok", "B", "H", "Lq")

    def __init__(self, ints, constexprs, config, interp, tma_ok, B, H, Lq):
        self.ints, self.constexprs, self.interp, self.tma_ok = ints, constexprs, interp, tma_ok
        self.B, self.H, self.Lq = B, H, Lq
        self.config = self.grid = None
        if config is not None:
            self._fix(config)

    def _fix(self, config: dict) -> None:
        self.config = dict(self.constexprs, **config)
        self.grid = (self.B * self.H * triton.cdiv(self.Lq, config["BLOCK_M"]),)


def plan_launch(q, k, v, out, *, scale: float, causal: bool, causal_offset: int, policy_args: dict,
                config: dict = None, lpt: bool = None) -> LaunchPlan:
    """The launch plan for these inputs (the arguments of :func:`attention_fwd`). Valid for any
    tensors with the same shapes, strides, dtype, device and 16-byte alignment as these."""
    B, H, Lq, D = q.shape
    HK, Lk = k.shape[1], k.shape[2]
    interp = _interpreting() or not q.is_cuda
    if lpt is None:
        lpt = bool(causal) and not interp
    tma_ok = (not interp) and not _TMA_BROKEN and _tma_ok(q, k, v, out)
    dot_precision = "ieee" if q.dtype == torch.float32 else "tf32"
    constexprs = dict(Q_BUCKET=_bucket(Lq), K_BUCKET=_bucket(Lk), TMA_OK=int(tma_ok), HEAD_DIM=D,
                      CAUSAL=bool(causal), LPT=bool(lpt), DOT_PRECISION=dot_precision, BLOCK_D=block_d(D),
                      **policy_args)
    ints = (q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
            v.stride(0), v.stride(1), v.stride(2), out.stride(0), out.stride(1), out.stride(2),
            B, H, HK, Lq, Lk, float(scale) * LOG2E, int(causal_offset))
    if config is None and interp:
        config = INTERPRETER_CONFIG
    if config is None and os.environ.get("NUMASCHED_AUTOTUNE", "1") == "0":
        config = fixed_config(q.dtype, D, tma_ok)
    if config is not None:
        config = dict(config)
        if config.get("USE_TMA") and not interp and not tma_ok:
            config["USE_TMA"] = False
    return LaunchPlan(ints, constexprs, config, interp, tma_ok, B, H, Lq)


def run_plan(plan: LaunchPlan, q, k, v, out, lse) -> int:
    """Launch the kernel on tensors that match ``plan``. Returns the number of programs (-1 when
    the autotuner ran this call)."""
    if not plan.interp:
        _ensure_allocator()  # device-side descriptors (USE_TMA) take their scratch from it
    if plan.config is not None:
        attn_fwd_kernel[plan.grid](q, k, v, out, lse, *plan.ints, **plan.config)
        return plan.grid[0]
    B, H, Lq = plan.B, plan.H, plan.Lq
    grid = lambda meta: (B * H * triton.cdiv(Lq, meta["BLOCK_M"]),)  # noqa: E731
    args = plan.constexprs
    try:
        attn_fwd_autotuned[grid](q, k, v, out, lse, *plan.ints, **args)
    except Exception as e:  # the TMA variant is new in Triton; keep working without it
        if not args["TMA_OK"]:
            raise
        import warnings

        warnings.warn(f"numasched attention: the TMA variant failed ({type(e).__name__}: {e}); "
                      f"using pointer loads from now on", RuntimeWarning, stacklevel=3)
        _TMA_BROKEN.append(repr(e))
        args["TMA_OK"] = 0
        attn_fwd_autotuned[grid](q, k, v, out, lse, *plan.ints, **args)
    # The autotuner's choice for this key never changes: later launches skip its wrapper
    # (Triton's Autotuner.run passes exactly these kwargs to the kernel).
    best = attn_fwd_autotuned.best_config
    plan._fix(dict(best.all_kwargs()))
    return -1


def attention_fwd(q, k, v, out, lse, *, scale: float, causal: bool, causal_offset: int, policy_args: dict,
                  config: dict = None, lpt: bool = None, plan: LaunchPlan = None):
    """Launch the kernel on checked inputs (numasched.attention does the checks).

    ``config``: None autotunes on GPU (fixed small blocks in the interpreter; ``fixed_config``
    when NUMASCHED_AUTOTUNE=0); or a dict with
    BLOCK_M, BLOCK_N, USE_TMA, num_warps, num_stages. ``lpt`` (default: causal on GPU) runs a
    head's costliest causal blocks first. ``plan``: a :func:`plan_launch` result for these
    arguments (the other arguments are then not read again). Returns the number of programs
    launched (-1 when the autotuner ran).
    """
    if plan is None:
        plan = plan_launch(q, k, v, out, scale=scale, causal=causal, causal_offset=causal_offset,
                           policy_args=policy_args, config=config, lpt=lpt)
    return run_plan(plan, q, k, v, out, lse)


# ------------------------------------------------------------------------------------ offline check
def compile_report(bm: int, bn: int, num_warps: int, num_stages: int, use_tma: bool, *, head_dim: int = 128,
                   causal: bool = False, dtype: str = "bf16", policy: str = "head_first", num_domains: int = 1,
                   capability: int = 90) -> dict:
    """Compile the kernel for an NVIDIA target without a GPU (Triton ships ptxas) and report what the
    compiler made of it: shared memory, wgmma and TMA use, registers and spill bytes.

    Needs a process without TRITON_INTERPRET=1 (Triton picks the interpreter at decoration time).
    """
    from .. import mappings as _M
    from ._offline import compile_and_report

    fn = attn_fwd_kernel
    const = dict(_M.get(policy).kernel_args(num_domains), HEAD_DIM=head_dim, CAUSAL=causal, LPT=causal,
                 DOT_PRECISION="ieee" if dtype == "fp32" else "tf32", BLOCK_M=bm, BLOCK_N=bn,
                 BLOCK_D=block_d(head_dim), USE_TMA=use_tma)
    ptrs = {"Q": f"*{dtype}", "K": f"*{dtype}", "V": f"*{dtype}", "O": f"*{dtype}", "LSE": "*fp32"}
    sig = {n: ("constexpr" if n in const else ptrs.get(n, "fp32" if n == "qk_scale" else "i32"))
           for n in fn.arg_names}
    # what the JIT sees for contiguous inputs: 16-byte aligned pointers and strides divisible by 16
    aligned = list(ptrs) + [n for n in fn.arg_names if n.startswith("stride_")]
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    return compile_and_report(fn, sig, const, attrs, num_warps=num_warps, num_stages=num_stages,
                              capability=capability)


def _main(argv=None) -> int:
    """``python -m numasched.kernels.attention_fwd``: compile every GPU config for sm_90, print JSON lines."""
    import json

    for dtype in ("bf16", "fp32"):
        for d in (64, 128):
            for causal in (False, True):
                for c in GPU_CONFIGS:
                    shape = (c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages)
                    if not _keep(shape, c.kwargs["USE_TMA"], fp32=dtype == "fp32", head_dim=d, tma_ok=True):
                        continue
                    rep = compile_report(*shape, c.kwargs["USE_TMA"], head_dim=d, causal=causal, dtype=dtype)
                    print(json.dumps(dict(dtype=dtype, head_dim=d, causal=causal, config=list(shape),
                                          tma=c.kwargs["USE_TMA"], **rep)), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(_main())
