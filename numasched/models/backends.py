"""The two backends :class:`numasched.models.TPDecoder` runs on: the same model code, different ops.

A backend supplies the operations that differ between the two implementations of a
tensor-parallel decoder, and the KV cache layout its attention reads:

=================  =========================================  ============================================
operation          ``NumaschedBackend``                       ``TorchBackend`` (bulk-synchronous baseline)
=================  =========================================  ============================================
linear             ``numasched.matmul(x, W.T)`` where it      ``F.linear(x, W)`` (cuBLAS)
                   led cuBLAS (``gemm="auto"``: cost.gemm_engine)
row_parallel       ``numasched.distributed.matmul_all_reduce``  ``F.linear`` then ``dist.all_reduce`` (NCCL)
                   (one fused GEMM + all-reduce; TP 1: matmul)
prefill attention  ``numasched.attention_forward(causal)``    ``F.scaled_dot_product_attention`` (cuDNN first)
decode attention   ``numasched.flash_decode`` on paged K/V    SDPA over a contiguous static cache
KV cache           :class:`PagedKVCache`                      :class:`ContiguousKVCache`
logits gather      ``numasched.distributed.all_reduce`` of    ``dist.all_gather_into_tensor``
                   the zero-padded rows (bounded waits)
=================  =========================================  ============================================

Norms, RoPE, SwiGLU, residual adds and the KV writes are shared code (numasched.models.llama).
The row-parallel projection is one call, ``row_parallel(x, w_local)``, so that numasched can fuse
the GEMM with its all-reduce; the baseline runs them one after the other (bulk-synchronous).
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.nn.functional as F

from .kv_cache import ContiguousKVCache, PagedKVCache


class ScaledRows:
    """The normalised rows of a unit-weight RMSNorm, not written: ``rows`` (the residual stream)
    and each row's factor as sums of squares (numasched.gemm_weight_first.RowScale). The
    projection that reads them scales its result's rows instead (a row factor commutes with the
    GEMM)."""

    __slots__ = ("rows", "scale")

    def __init__(self, rows: torch.Tensor, scale):
        self.rows, self.scale = rows, scale

    @property
    def shape(self):
        return self.rows.shape

    def normalised(self) -> torch.Tensor:
        """The rows RMSNorm would have written (torch; a fallback where no kernel takes the scale)."""
        sums = self.scale.sums[:, :self.rows.shape[0]].sum(0)
        inv = torch.rsqrt(sums / self.rows.shape[1] + self.scale.eps)
        return (self.rows.float() * inv[:, None]).to(self.rows.dtype)


def _dist_world(group=None) -> tuple:
    """(rank, world size) of torch.distributed's group, or (0, 1) when it is not initialised."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(group), dist.get_world_size(group)
    return 0, 1


def _torch_linear(x: torch.Tensor, w: torch.Tensor, out: Optional[torch.Tensor]) -> torch.Tensor:
    """cuBLAS's ``x @ w.T``, into ``out`` when given."""
    return F.linear(x, w) if out is None else torch.matmul(x, w.t(), out=out)


# numasched's all-reduce impls for the decoder's matmul_all_reduce / all_reduce (NumaschedBackend impl=)
AR_IMPLS = ("auto", "oneshot", "twoshot", "nccl", "bulk", "fused", "overlap")


_MAPPING_KINDS = ("gemm", "attention", "decode")


def _mapping_per_kind(mapping) -> dict:
    """NumaschedBackend's ``mapping``: "auto" / None, or a dict {kind: policy}, as one policy per
    kernel kind (a policy serves one kind: a GEMM raster cannot order attention tiles)."""
    from numasched._route import mapping_token

    if mapping is None or mapping == "auto":
        return dict.fromkeys(_MAPPING_KINDS, "auto")
    if not isinstance(mapping, dict):
        raise ValueError(f"mapping must be 'auto' or a dict of a policy per kind ({', '.join(_MAPPING_KINDS)}): one "
                         f"policy cannot serve the GEMMs, the attention and the decode, got {mapping!r}")
    bad = [k for k in mapping if k not in _MAPPING_KINDS]
    if bad:
        raise ValueError(f"mapping has unknown kinds {bad}; kinds: {', '.join(_MAPPING_KINDS)}")
    out = {k: mapping.get(k, "auto") for k in _MAPPING_KINDS}
    for k, m in out.items():
        try:
            mapping_token(m, k)
        except (TypeError, ValueError) as e:
            raise ValueError(f"mapping[{k!r}]: {e}") from None
    return out


def _flag(name: str, v) -> bool:
    if not isinstance(v, bool):
        raise TypeError(f"{name} must be True or False, got {v!r}")
    return v


def _scaled_rows(y, s):
    """``s[i] * y[i]`` in fp32, rounded to y's dtype (the unfused form of a row scale)."""
    return (y.float() * s[:, None]).to(y.dtype)


class Backend:
    """Interface (and the parts both backends share). ``tp_size`` must equal the model's."""

    name = ""
    cache_class = ContiguousKVCache

    def __init__(self, tp_size: int = 1, group=None):
        if isinstance(tp_size, bool) or not isinstance(tp_size, int) or tp_size < 1:
            raise ValueError(f"tp_size must be an int >= 1 (tensor-parallel ranks), got {tp_size!r}")
        self.tp_size, self.group = tp_size, group

    def new_cache(self, model, *, batch: int, capacity: int, page_size: int = 16):
        """An empty KV cache of this backend's layout for ``model``'s local KV heads."""
        s = model.spec
        return self.cache_class(layers=s.layers, batch=batch, capacity=capacity, kv_heads=model.kv_heads_local,
                                head_dim=s.head_dim, dtype=model.dtype, device=model.device, page_size=page_size,
                                **self._cache_options())

    def _cache_options(self) -> dict:
        """Further keyword arguments of this backend's cache class (none here)."""
        return {}

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """(T, N_local) on every rank -> (T, N_local * world), rank r's columns at [r * N_local, ...)."""
        if self.tp_size == 1:
            return x
        T, N = x.shape
        return self.all_gather_rows(x).view(self.tp_size, T, N).permute(1, 0, 2).reshape(T, self.tp_size * N)

    # -- a sequence-parallel prefill (TPDecoder._stack_seq_parallel): the residual stream, the norms
    # and the residual adds on this rank's 1/tp of the rows; each column-parallel projection
    # all-gathers its input rows, each row-parallel one reduce-scatters its output rows
    prefill_seq_parallel = False

    def seq_parallel(self, batch: int, seq: int) -> bool:
        """Whether a prefill of ``batch`` x ``seq`` tokens runs sequence-parallel."""
        return bool(self.prefill_seq_parallel) and self.tp_size > 1 and (batch * seq) % self.tp_size == 0

    def group_rank(self) -> int:
        """This process's rank in the TP group the row gathers run on (the model's tp_rank must
        equal it: the sequence-parallel prefill keeps rows by the model's rank)."""
        if self.tp_size == 1:
            return 0
        import torch.distributed as dist

        return dist.get_rank(self.group)

    def all_gather_rows(self, x: torch.Tensor) -> torch.Tensor:
        """(T / tp, N) on every rank -> (T, N), rank r's rows at [r * T / tp, ...)."""
        if self.tp_size == 1:
            return x
        import torch.distributed as dist

        out = torch.empty((self.tp_size * x.shape[0], x.shape[1]), dtype=x.dtype, device=x.device)
        # all_gather_single where it exists (torch >= 2.13 deprecates the older name)
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        gather(out, x.contiguous(), group=self.group)
        return out

    def reduce_scatter_rows(self, y: torch.Tensor) -> torch.Tensor:
        """(T, N) on every rank -> this rank's (T / tp, N) rows of the sum over ranks."""
        if self.tp_size == 1:
            return y
        import torch.distributed as dist

        out = torch.empty((y.shape[0] // self.tp_size, y.shape[1]), dtype=y.dtype, device=y.device)
        dist.reduce_scatter_tensor(out, y.contiguous(), group=self.group)
        return out

    def all_gather_linear(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """``all_gather_rows(x) @ w.T``: a column-parallel projection of the gathered rows."""
        return self.linear(self.all_gather_rows(x), w)

    def linear_reduce_scatter(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """``reduce_scatter_rows(x @ w.T)``: a row-parallel projection, this rank's rows of its sum."""
        return self.reduce_scatter_rows(self.linear(x, w))

    # the operations that differ
    def linear(self, x: torch.Tensor, w: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``x @ w.T``; written into ``out`` when given (e.g. a buffer another stream reads next)."""
        raise NotImplementedError

    def row_parallel(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def row_parallel_add_norm(self, x, w, h, norm_w, eps: float, add_norm, norm=None, unit_norm: bool = False):
        """(h + row_parallel(x, w), its RMSNorm with norm_w): the projection and the layer's
        residual add + next norm; ``add_norm`` (and ``norm``, the RMSNorm alone) are the shared
        (compiled) elementwise kernels. A backend may fuse the three (numasched: ``fuse_norm=True``)
        or the first two (numasched: ``fuse_residual=True``, then ``norm``). ``h`` may be updated
        in place. ``unit_norm``: norm_w is all ones (folded into the projections that read the
        result: TPDecoder.fold_norms); a backend may then return, instead of the normalised rows,
        :class:`ScaledRows` of h, which only its own :meth:`linear` / :meth:`linear_swiglu` take."""
        return add_norm(self.row_parallel(x, w), h, norm_w, eps)

    def residual_stream(self, h: torch.Tensor, row_parallel_weights=()) -> torch.Tensor:
        """The residual stream a step starts from (``h``, the embeddings): ``h`` itself, or a copy
        where the backend wants it (numasched: in the symmetric heap, ``heap_residual``, where the
        row-parallel projections with these weights all add the residual in their kernel)."""
        return h

    def fuses_residual(self, x, w) -> bool:
        """Whether :meth:`row_parallel_add_norm` adds the residual inside the row-parallel
        projection for rows like ``x`` (then only the norm follows; the benchmark's components
        count the add as the projection's)."""
        return False

    def row_parallel_residual(self, x, w, h):
        """``h += row_parallel(x, w)`` in place, returning ``h`` (fused where
        :meth:`fuses_residual`)."""
        return h.add_(self.row_parallel(x, w))

    def rope_cache_write(self, qkv, cos, sin, heads: int, kv_heads: int, head_dim: int, q_w, k_w, eps: float,
                         cache, layer: int, qkv_rope):
        """A decode step's q from the fused QKV rows, after rotating q and k (Qwen3: per-head norms
        first) and writing k and v into ``cache`` at the step's slots; ``qkv_rope`` is the shared
        (compiled) elementwise kernel. A backend may fuse the three kernels (numasched:
        ``fuse_rope_cache=True``)."""
        return Backend.prefill_rope_cache(self, qkv, cos, sin, heads, kv_heads, head_dim, q_w, k_w, eps, cache, layer,
                                          qkv_rope)[0]

    def prefill_rope_cache(self, qkv, cos, sin, heads: int, kv_heads: int, head_dim: int, q_w, k_w, eps: float,
                           cache, layer: int, qkv_rope, row_scale=None):
        """A one-step prefill's (q, k, v) from the fused QKV rows (k rotated), with k and v also
        written into ``cache`` at the step's slots. ``row_scale`` (T,) fp32: token t's row counts
        as ``row_scale[t] * qkv[t]`` (a norm-free prefill, :meth:`norm_free`). A backend may fuse
        the kernels (numasched: ``fuse_rope_cache=True``)."""
        if row_scale is not None:
            qkv = _scaled_rows(qkv, row_scale)
        q, k, v = qkv_rope(qkv, cos, sin, heads, kv_heads, head_dim, q_w, k_w, eps)
        cache.write(layer, k, v)
        return q, k, v

    def fuses_swiglu(self, x, n: int) -> bool:
        """Whether :meth:`linear_swiglu` runs the projection and the activation as one kernel for
        rows like ``x`` (the benchmark's components count the activation as a GEMM's then)."""
        return False

    def linear_swiglu(self, x, w, n: int, swiglu, row_scale=None):
        """``silu(x @ w[:n].T) * (x @ w[n:].T)``: the MLP's gate/up projection and its activation;
        ``swiglu`` is the shared (compiled) elementwise kernel; ``row_scale`` (M,) fp32: row i of
        ``x`` counts as ``row_scale[i] * x[i]`` (a norm-free prefill). A backend may fuse the two
        (numasched: ``fuse_swiglu=True``)."""
        gu = self.linear(x, w)
        return swiglu(gu if row_scale is None else _scaled_rows(gu, row_scale), n)

    def norm_free(self, rows: int) -> bool:
        """Whether a prefill of ``rows`` rows of a model with folded norms (TPDecoder.fold_norms)
        skips writing the normalised rows: the projections read the residual stream and
        :meth:`prefill_rope_cache` / :meth:`linear_swiglu` scale by each row's 1 / rms."""
        return False

    def all_reduce(self, x: torch.Tensor, *, out: Optional[torch.Tensor] = None, check: bool = True) -> torch.Tensor:
        """The sum of ``x`` over the TP group, into ``out`` when given (``x`` itself: in place).
        ``check=False``: the call reads no status (no host sync, e.g. mid-prefill on another
        stream); the caller calls :meth:`check_peers` once its streams have joined."""
        raise NotImplementedError

    def all_reduce_overlapped(self, x: torch.Tensor) -> torch.Tensor:
        """In-place all-reduce of ``x`` issued on a communication stream while other streams
        compute (the row-chunked prefill); reads no status (the caller calls :meth:`check_peers`)."""
        return self.all_reduce(x, out=x, check=False)

    def prefill_attention(self, q, k, v, batch: int, seq: int) -> torch.Tensor:
        raise NotImplementedError

    # -- a prefill in row chunks whose all-reduces overlap the next chunk's compute (TPDecoder)
    def prefill_chunks(self, batch: int, seq: int) -> int:
        """Row chunks of a prefill (1: the whole prompt as one bulk-synchronous step)."""
        return 1

    def check_peers(self) -> None:
        """Raise if a peer failed in the collectives since the last check (no-op by default)."""

    def prefill_attention_rows(self, q, k, v) -> torch.Tensor:
        """The last ``q.shape[0]`` rows of a causal prefill of one sequence: q (rows, H, D)
        against the first L tokens' k/v (L, HK, D), bottom-right aligned; -> (rows, H * D)."""
        raise NotImplementedError

    def decode_attention(self, q, cache, layer: int) -> torch.Tensor:
        raise NotImplementedError


def _sdpa_backends(names: Optional[Sequence[str]]):
    """torch.nn.attention.SDPBackend members for ``names`` (None / empty: torch picks)."""
    if not names:
        return None
    from torch.nn.attention import SDPBackend

    try:
        return [getattr(SDPBackend, n) for n in names]
    except AttributeError as e:
        raise ValueError(f"sdpa_backends: unknown SDPA backend ({e}); names of torch.nn.attention.SDPBackend") from None


def _sdpa(backends, q, k, v, **kw):
    """F.scaled_dot_product_attention with ``backends`` in priority order on CUDA."""
    if backends is None or q.device.type != "cuda":
        return F.scaled_dot_product_attention(q, k, v, **kw)
    from torch.nn.attention import sdpa_kernel

    with sdpa_kernel(backends, set_priority=True):
        return F.scaled_dot_product_attention(q, k, v, **kw)


def _causal_sdpa(backends, q, k, v, batch: int, seq: int) -> torch.Tensor:
    """A causal prefill through SDPA: q (T, H, D), k/v (T, HK, D), T = batch * seq -> (T, H * D)."""
    T, H, D = q.shape
    qt, kt, vt = (t.view(batch, seq, -1, D).transpose(1, 2) for t in (q, k, v))
    out = _sdpa(backends, qt, kt, vt, is_causal=True, **({"enable_gqa": True} if H != k.shape[1] else {}))
    return out.transpose(1, 2).reshape(T, H * D)


class TorchBackend(Backend):
    """torch ops, NCCL (gloo on CPU) and SDPA: the bulk-synchronous baseline (gpt-fast style).

    sdpa_backends: SDPA backends in priority order (names of ``torch.nn.attention.SDPBackend``);
        default cuDNN, then FlashAttention, memory-efficient, math: the first that takes the
        inputs runs. None of them on CPU (torch picks).
    prefill_seq_parallel: run a TP prefill sequence-parallel (Megatron style: NCCL all-gather
        before each column-parallel projection, reduce-scatter after each row-parallel one, norms
        and residual adds on 1/tp of the rows); default False: the bulk-synchronous all-reduces.
    """

    name = "torch"
    cache_class = ContiguousKVCache
    DEFAULT_SDPA = ("CUDNN_ATTENTION", "FLASH_ATTENTION", "EFFICIENT_ATTENTION", "MATH")

    def __init__(self, tp_size: Optional[int] = None, group=None, sdpa_backends: Optional[Sequence[str]] = DEFAULT_SDPA,
                 *, prefill_seq_parallel: bool = False):
        if tp_size is None:
            tp_size = _dist_world(group)[1]
        super().__init__(tp_size, group)
        self.prefill_seq_parallel = _flag("prefill_seq_parallel", prefill_seq_parallel)
        self._sdpa = _sdpa_backends(sdpa_backends)

    def _attn(self, q, k, v, **kw):
        return _sdpa(self._sdpa, q, k, v, **kw)

    def linear(self, x, w, out=None):
        return _torch_linear(x, w, out)

    def all_reduce(self, x, *, out=None, check=True):
        # NCCL reduces in place (into out, x left alone when out is another tensor) and has no
        # status to read
        if out is not None and out is not x:
            x = out.copy_(x)
        if self.tp_size > 1:
            import torch.distributed as dist

            dist.all_reduce(x, group=self.group)
        return x

    def row_parallel(self, x, w):
        return self.all_reduce(F.linear(x, w))

    def prefill_attention(self, q, k, v, batch, seq):
        """q (T, H, D), k/v (T, HK, D) with T = batch * seq -> (T, H * D), causal."""
        return _causal_sdpa(self._sdpa, q, k, v, batch, seq)

    def decode_attention(self, q, cache: ContiguousKVCache, layer):
        """q (B, H, D) against the cache after this step's write, as a one-row SDPA query with
        ``enable_gqa`` (cuDNN's decode path takes that form; folding the query heads of one KV
        head into rows of one query was 8x slower with cuDNN at batch 1 x 32k on an H200)."""
        B, H, D = q.shape
        HK = cache.kv_heads
        gqa = {"enable_gqa": True} if H != HK else {}
        q1 = q.view(B, H, 1, D)
        k, v = cache.k(layer), cache.v(layer)
        if cache.window is not None:
            w = cache.window
            out = self._attn(q1, k[:, :, :w], v[:, :, :w], **gqa)
        else:
            out = self._attn(q1, k, v, attn_mask=cache.mask, **gqa)
        return out.reshape(B, H * D)


# NumaschedBackend.all_gather_rows sums a gather of more than this in pieces of it (heap per piece:
# two to four times its size, once per context)
GATHER_PIECE_BYTES = 8 << 20


class NumaschedBackend(Backend):
    """numasched's kernels: matmul, flash_decode over a paged cache, the fused decode-step kernels
    and the collectives of numasched.distributed at TP > 1; cuBLAS / cuDNN where numasched's
    kernels were measured slower (``gemm``, ``prefill_attention``).

    ctx: the ``numasched.distributed`` context (``numasched.distributed.init(...)``), required
        when tp_size > 1 (never used at TP 1). Made with ``bounded_only=True``, every collective
        of a decode step and of the one-step prefill waits bounded, so a rank that stops makes its
        peers' ``ctx.check()`` raise TimeoutError after a graph replay (the row and logits
        gathers are numasched's all-reduce; "auto" never picks NCCL or torch symm_mem there).
    fuse_all_reduce: True: ``matmul_all_reduce`` (one fused call); False: ``numasched.matmul``
        then ``numasched.distributed.all_reduce`` (for separating the two in timings).
    mapping: the mapping policy of numasched's calls: "auto" (default), or a dict of a policy per
        kernel kind, e.g. ``{"gemm": "grouped", "attention": "swizzled_head_first", "decode":
        "auto"}`` (kinds not named: "auto"); checked here, naming the kind.
    impl: the all-reduce implementation passed to the distributed calls ("auto": their cost model).
    check: let each distributed call read its status word (a timeout raises at once, but an eager
        call then synchronises); False leaves it to ``ctx.check()`` (graph replays never check).
    gemm: "auto" (numasched.matmul where it ran at least cuBLAS's speed on the inference grids:
        up to 128 rows, and from 512 on Hopper, numasched.distributed.cost.gemm_engine; cuBLAS
        between), "numasched" or "torch" for every projection.
    fuse_norm: at TP > 1 and up to 256 rows, run each row-parallel projection's all-reduce, the
        residual add and the next RMSNorm as one kernel
        (numasched.distributed.all_reduce_add_rmsnorm). On by default: on two H200s it took the
        Llama-3-8B decode step from 1.02-1.05x to 1.04-1.12x the bulk-synchronous baseline.
    prefill_overlap: row chunks of a one-prompt prefill (at least OVERLAP_MIN_ROWS rows each;
        default None = 1: one bulk step). Chunk c + 1 runs its attention and GEMMs on a second
        CUDA stream while chunk c's all-reduces run on a third (TPDecoder._stack_overlapped), so
        the all-reduces can overlap compute. Those all-reduces move their data by copy engine
        (``all_reduce_overlapped``: impl "ce", no SMs taken from the GEMMs they overlap). Opt-in:
        on two H100s (Llama-3-8B, TP 2, 4096 tokens; bench/results/tp2-s16-*overlap*) 2 / 4 chunks
        ran 1.027 / 0.968x torch's bulk-synchronous prefill against 1.035-1.055x in one step, and
        2 chunks with the SM two-shot 0.964x in the same call (two H200s, tenth session: 0.98 /
        1.00x): the copy engine's 16 MB all-reduce takes 104 us against the SM two-shot's 64.
    prefill_seq_parallel: run a TP prefill sequence-parallel: ``all_gather_matmul`` for the
        column-parallel projections (QKV, gate/up), ``matmul_reduce_scatter`` for the row-parallel
        ones (O, down), with ``impl="auto"`` (fused or NCCL + cuBLAS by the cost model; "bulk"
        where ``impl`` is "bulk"/"nccl" or ``gemm="torch"``, "fused" where ``impl="fused"``), and
        the residual adds and norms on 1/tp of the rows. Opt-in, not yet timed on GPUs (the
        all-reduce bytes are the same; the elementwise work per rank is 1/tp). Exclusive with
        ``prefill_overlap``.
    pdl_swiglu: where numasched's GEMM runs (decode sizes), ``silu(gate) * up`` by numasched's
        own kernel (numasched.swiglu, launched with programmatic dependent launch between the two
        projections' GEMMs) instead of the compiled elementwise one, whose launch makes both
        neighbouring GEMMs wait for a full drain. Applies where ``fuse_swiglu`` is off; on by
        default: on two H100s (Llama-3-8B, TP 2) the decode step was 0.2-0.5 % faster than with
        the compiled kernel at each of the 9 grid points (e.g. 16 x 8k 6.677 against 6.702 ms;
        bench/results/tp2-s18/swiglu-*).
    fuse_swiglu: where numasched's GEMM runs (decode sizes), the gate/up projection and
        ``silu(gate) * up`` in one launch (numasched.matmul_swiglu) instead of a GEMM and an
        elementwise kernel. On by default since the eighteenth session: on two H100s (Llama-3-8B,
        TP 2, the 9-point decode grid, one call) it took the step 0.2-1.0 % below numasched.swiglu's
        (``pdl_swiglu``) and 0.5-1.4 % below the compiled kernel's at every point (16 x 8k 6.636
        against 6.677 and 6.702 ms; bench/results/tp2-s18/swiglu-*). (The sixth session, on two
        H200s and before PDL, had measured -2.6 % at batch 1 and -1 % to +2 % at 4-16: not
        re-measured on H200s since.) ``False``: the GEMM, then the activation per ``pdl_swiglu``.
        With ``gemm="auto"`` it also covers prefill sizes on Hopper (from
        ``gemm_glu.GLU_BIG_MIN_ROWS`` rows, big tiles), where the projection is otherwise cuBLAS's:
        one H100, 4096 x 4096 -> 2 x 7168, 738 against 771 us for cuBLAS + the compiled activation.
    prefill_attention: the causal attention of a one-step prefill: "numasched"
        (numasched.attention_forward), "torch" (SDPA, cuDNN first, as the torch backend runs it) or
        "auto" (default): torch's on NVIDIA GPUs, where cuDNN's prefill kernel is faster
        (numasched's ran 0.73-0.88x cuDNN at head_dim 128 and 0.89-0.97x at 64 on an H200,
        bench/results/prefill-h200-*; Triton 3.6 does not warp-specialise on Hopper), numasched's
        elsewhere (AMD GPUs: not measured; CPU); ``mapping`` then applies to numasched's kernels
        only. Decode attention is always numasched's flash_decode, and the row-chunked prefill
        (``prefill_overlap``) keeps numasched's kernel (its chunks are bottom-right aligned).
        Measured at TP 1 on an H100 (Llama-3-8B, 4096 tokens): the prefill's attention 13.2 ms
        with numasched's kernel, 11.2 with "auto" (bench/results/e2e-s15-prefill/).
    fuse_rope_cache: in a decode step, split the QKV rows, rotate q and k and write k and v into
        the paged cache in one launch (numasched.qkv_rope_cache) instead of the compiled
        elementwise kernel and two ``index_copy_`` scatters (three kernel boundaries per layer).
        On by default: Llama-3-8B's decode step went from 1.007-1.057x to 1.011-1.098x the torch
        baseline at TP 1 (one H200) and from 1.038-1.255x to 1.056-1.333x at TP 2 (two H200s;
        bench/results/e2e-s15-tp1/, tp2-s15/). A one-step prefill too, the kernel also giving k
        and v contiguous for its attention (``return_kv``). ``False``: the unfused sequence.
    fuse_residual: where a row-parallel projection runs the fused GEMM + all-reduce (prefill
        sizes; decode sizes fuse the add and the norm into the all-reduce, ``fuse_norm``), the
        residual add in that kernel's epilogue (``matmul_all_reduce(residual=h)``), then the
        RMSNorm alone, instead of the sum to memory and the compiled add + RMSNorm reading it
        back. On by default; ``False``: the sum, then the compiled add + RMSNorm. Two H100s,
        Llama-3-8B TP 2, 4096 tokens, in one call: 55.60 against 56.22 ms (bench/results/tp2-s24b/).
    heap_residual: with ``fuse_residual`` at two ranks, the prefill's residual stream in the
        symmetric heap (one buffer of ``ctx``'s heap, reused), so that kernel's owner of a tile
        stores the sum straight into its peer's stream instead of a receive slot the peer copies
        from. On by default (off where the heap has no room); ``False``: the receive slots. Two
        H100s, the same prefill in one call: 55.97 against 56.30 ms (bench/results/tp2-s24c/).
    fold_norms: a prefill (from NORM_FREE_MIN_ROWS rows) of a model whose norm weights are folded
        into its projections (``TPDecoder.fold_norms()``) runs norm-free (:meth:`norm_free`): the
        QKV and gate/up projections read the residual stream, the RoPE + cache kernel and the
        SwiGLU GEMM scale each row by the norm's 1 / rms, computed by one reduction over the
        stream. Two RMSNorms per layer write no normalised rows and read none back. On by
        default (a model that is not folded runs its norms as before); ``False``: the norms.
        Two H200s, Llama-3-8B TP 2, 4096 tokens, folded against not, each pair in one call:
        55.06 / 55.34 ms and 54.86 / 54.78 ms (bench/results/tp2-s25d/, tp2-s25e/): the norms'
        component 0.5 ms lower, the step within the calls' spread.
    weight_first: the decode-size projections that run through :meth:`linear` and the fused
        gate/up + SwiGLU (QKV, gate/up, lm_head: each after a norm), and with
        ``options.weight_first_row_parallel`` (default) the row-parallel o_proj and down_proj
        before the fused all-reduce + add + norm (with ``options.weight_first_push``, default,
        that GEMM pushes its bands to the peers and the norm kernel only waits), by the
        weight-first GEMM (not with
        ``gemm="torch"``, which asks for cuBLAS everywhere)
        (numasched.gemm_weight_first: its programs, PDL-launched, read their first weight blocks
        before they wait for the kernel before them) where it takes the operands (an sm_90 GPU,
        up to WEIGHT_FIRST_MAX_ROWS rows, 16-bit, TMA-compatible rows); the other calls as
        before. None (default): on at tp_size > 1, where two H200s ran the TP 2 Llama-3-8B decode
        step 0.7-3.6 % faster with it (batch 1, 4, 16 x 2k, 32k); off at TP 1, where one H200 ran
        it -0.7 to +0.7 % (nothing latency-bound before the GEMMs to hide the weights behind;
        bench/results/README.md, fifty-fifth session).
    """

    name = "numasched"
    cache_class = PagedKVCache
    WEIGHT_FIRST_MAX_ROWS = 16

    def _cache_options(self) -> dict:
        """Head-major pages with ``options.paged_kv_head_major`` (off by default; see
        numasched.options): one KV head's tokens of a page in one contiguous run."""
        from numasched import options as _options

        return dict(head_major=_options.current().paged_kv_head_major)

    def __init__(self, tp_size: Optional[int] = None, ctx=None, *, group=None, fuse_all_reduce: bool = True,
                 mapping: str = "auto", impl: str = "auto", check: bool = True, gemm: str = "auto",
                 fuse_norm: bool = True, fuse_swiglu: bool = True, prefill_overlap: Optional[int] = None,
                 prefill_seq_parallel: bool = False, fuse_rope_cache: bool = True,
                 prefill_attention: str = "auto", pdl_swiglu: bool = True, fuse_residual: bool = True,
                 heap_residual: bool = True, fold_norms: bool = True, weight_first: Optional[bool] = None):
        if tp_size is None:
            tp_size = getattr(ctx, "world", None) or _dist_world(group)[1]
        super().__init__(tp_size, group)
        if self.tp_size > 1 and ctx is None:
            raise ValueError(f"ctx is required at tp_size {self.tp_size}: create it with "
                             f"numasched.distributed.init(...) after torch.distributed.init_process_group")
        if ctx is not None and getattr(ctx, "world", self.tp_size) != self.tp_size:
            raise ValueError(f"ctx spans {ctx.world} ranks but tp_size is {self.tp_size}")
        self.ctx, self.fuse_all_reduce = ctx, _flag("fuse_all_reduce", fuse_all_reduce)
        self.mapping = mapping
        self._maps = _mapping_per_kind(mapping)
        if self.group is None and ctx is not None:   # the row / column gathers run on the TP group
            self.group = getattr(ctx, "group", None)
        if gemm not in ("auto", "numasched", "torch"):
            raise ValueError(f"gemm must be 'auto', 'numasched' or 'torch', got {gemm!r}")
        known = AR_IMPLS
        if impl not in known:
            raise ValueError(f"impl must be one of {known}, got {impl!r}")
        self.impl, self.check, self.gemm = impl, _flag("check", check), gemm
        self.fuse_norm = _flag("fuse_norm", fuse_norm)
        self.fuse_swiglu = _flag("fuse_swiglu", fuse_swiglu)
        self.pdl_swiglu = _flag("pdl_swiglu", pdl_swiglu)
        self.fuse_rope_cache = _flag("fuse_rope_cache", fuse_rope_cache)
        self.fuse_residual = _flag("fuse_residual", fuse_residual)
        self.heap_residual = _flag("heap_residual", heap_residual)
        self.fold_norms = _flag("fold_norms", fold_norms)
        # None: where it gained (TP > 1: behind the all-reduce + norm's NVLink round trip)
        self.weight_first = self.tp_size > 1 if weight_first is None else _flag("weight_first", weight_first)
        self._wf_plans: dict = {}   # weight-first plans (or False: not taken) per operand signature
        self._reduce_ready: set = set()   # (plan, target) pairs compiled on every rank (_reduce_first_use)
        self._stream = None   # the residual stream's heap buffer (residual_stream)
        self._stream_fuses: dict = {}   # residual_stream's verdict per row count and shapes
        if prefill_attention not in ("auto", "numasched", "torch"):
            raise ValueError(f"prefill_attention must be 'auto', 'numasched' or 'torch', got {prefill_attention!r}")
        self.prefill_attention_impl = prefill_attention
        self._sdpa = _sdpa_backends(TorchBackend.DEFAULT_SDPA)
        if prefill_overlap is not None and (isinstance(prefill_overlap, bool) or not isinstance(prefill_overlap, int)
                                            or prefill_overlap < 1):
            raise ValueError(f"prefill_overlap must be a positive int or None, got {prefill_overlap!r}")
        self.prefill_overlap = prefill_overlap
        self.prefill_seq_parallel = _flag("prefill_seq_parallel", prefill_seq_parallel)
        if self.prefill_seq_parallel and (prefill_overlap or 1) > 1:
            raise ValueError("prefill_seq_parallel and prefill_overlap are two ways to run a TP prefill: pass one")
        import numasched

        self._ns = numasched
        self._nd = None
        if self.tp_size > 1:
            import numasched.distributed as nd

            needed = ("matmul_all_reduce", "all_reduce", "all_gather_matmul", "matmul_reduce_scatter")
            missing = [f for f in needed if not hasattr(nd, f)]
            if missing:
                raise RuntimeError(f"numasched.distributed has no {', '.join(missing)} in this version: the "
                                   f"numasched backend needs them at tp_size > 1")
            self._nd = nd

    def linear(self, x, w, out=None):
        if isinstance(x, ScaledRows):   # the weight-first GEMM scales its rows; anything else, the rows
            plan = self._weight_first_plan(x.rows, w, glu=False)
            if plan is not None and out is None:
                return plan.run(x.rows, w, scale=x.scale)
            x = x.normalised()
        plan = self._weight_first_plan(x, w, glu=False)
        if plan is not None and (out is None or out.is_contiguous()):
            return plan.run(x, w, out)
        if self._gemm_engine(x) == "torch":
            return _torch_linear(x, w, out)
        return self._ns.matmul(x, w.t(), out=out, mapping=self._maps["gemm"])

    def _weight_first_plan(self, x, w, glu: bool, splits=None):
        """The weight-first GEMM's plan for ``x @ w.T`` (``glu``: its SwiGLU form; ``splits``: its
        K parts, None: the config's), or None where ``weight_first`` is off, ``gemm="torch"`` asks
        for cuBLAS, or the kernel does not take the operands (kept per signature)."""
        if not (self.weight_first and self.gemm != "torch" and x.dim() == 2
                and x.shape[0] <= self.WEIGHT_FIRST_MAX_ROWS and x.is_cuda):
            return None
        from numasched import options as _options

        opts = _options.current()
        pdl = 1 if opts.pdl else 0   # in the key, as the library's plans key their options
        key = (tuple(x.shape), tuple(x.stride()), tuple(w.shape), tuple(w.stride()), x.dtype, x.device, glu, pdl,
               opts.weight_first_early, splits)
        plan = self._wf_plans.get(key)
        if plan is None:
            from numasched.gemm_weight_first import WeightFirstPlan, check

            try:
                check(x, w, glu=glu)
            except (TypeError, ValueError, RuntimeError):
                plan = False
            else:
                plan = WeightFirstPlan(x, w, glu=glu, pdl=pdl, early=opts.weight_first_early,
                                       splits=None if splits is None else min(splits, -(-x.shape[1] // 128)))
            self._wf_plans[key] = plan
        return plan or None

    def _row_parallel_weight_first(self, x, w):
        """The weight-first plan of a row-parallel decode projection (o_proj, down_proj) under
        ``options.weight_first_row_parallel``, else None (numasched's split-K GEMM, in
        matmul_all_reduce)."""
        from numasched import options as _options

        opts = _options.current()
        if not opts.weight_first_row_parallel:
            return None
        cap = opts.weight_first_row_splits_max_k
        splits = opts.weight_first_row_splits if opts.weight_first_row_splits and (not cap or x.shape[1] <= cap) \
            else None
        return self._weight_first_plan(x, w, glu=False, splits=splits)

    def fuses_swiglu(self, x, n):
        return self.fuse_swiglu and (self._glu_big(x, n) or self._gemm_engine(x) == "numasched")

    def linear_swiglu(self, x, w, n, swiglu, row_scale=None):
        if isinstance(x, ScaledRows):
            plan = self._weight_first_plan(x.rows, w, glu=True) if row_scale is None and w.shape[0] == 2 * n else None
            if plan is not None and self.fuses_swiglu(x.rows, n):
                return plan.run(x.rows, w, scale=x.scale)
            x = x.normalised()
        # where numasched's GEMM runs (decode sizes): one launch (numasched.matmul_swiglu), or the
        # GEMM then numasched's PDL-launched activation (numasched.swiglu); prefill sizes (from
        # GLU_BIG_MIN_ROWS rows, unless gemm="torch") the one launch too, its big-tile schedule
        # (gemm_glu.big_tiles): the (M, 2n) projection never goes to memory (a norm-free
        # prefill's row scale applied to its accumulators)
        if self.fuses_swiglu(x, n):
            plan = self._weight_first_plan(x, w, glu=True) if row_scale is None and w.shape[0] == 2 * n else None
            if plan is not None:
                return plan.run(x, w)
            return self._ns.matmul_swiglu(x, w.t(), row_scale=row_scale)
        if row_scale is not None:
            return super().linear_swiglu(x, w, n, swiglu, row_scale)
        if self._gemm_engine(x) == "numasched":
            if self.pdl_swiglu:
                return self._ns.swiglu(self.linear(x, w))
        return swiglu(self.linear(x, w), n)

    def rope_cache_write(self, qkv, cos, sin, heads, kv_heads, head_dim, q_w, k_w, eps, cache, layer, qkv_rope):
        if not (self.fuse_rope_cache and isinstance(cache, PagedKVCache)):
            return super().rope_cache_write(qkv, cos, sin, heads, kv_heads, head_dim, q_w, k_w, eps, cache, layer,
                                            qkv_rope)
        return self._fused_rope(qkv, cos, sin, heads, kv_heads, q_w, k_w, eps, cache, layer, return_kv=False)

    def prefill_rope_cache(self, qkv, cos, sin, heads, kv_heads, head_dim, q_w, k_w, eps, cache, layer, qkv_rope,
                           row_scale=None):
        # one launch (numasched.qkv_rope_cache with return_kv) instead of the compiled elementwise
        # kernel and two index_copy_ scatters: one H100, 4096 tokens at the Llama-3-8B TP 2 shape,
        # 35.8 + 21.4 us before (bench/results/ew-s23/); a norm-free prefill's row scale in it too
        if not (self.fuse_rope_cache and isinstance(cache, PagedKVCache)):
            return super().prefill_rope_cache(qkv, cos, sin, heads, kv_heads, head_dim, q_w, k_w, eps, cache, layer,
                                              qkv_rope, row_scale)
        return self._fused_rope(qkv, cos, sin, heads, kv_heads, q_w, k_w, eps, cache, layer, return_kv=True,
                                row_scale=row_scale)

    def _fused_rope(self, qkv, cos, sin, heads, kv_heads, q_w, k_w, eps, cache, layer, *, return_kv: bool,
                    row_scale=None):
        return self._ns.qkv_rope_cache(qkv, cos, sin, cache.k(layer), cache.v(layer), cache.write_slots(qkv.shape[0]),
                                       heads=heads, kv_heads=kv_heads, q_weight=q_w, k_weight=k_w, eps=eps,
                                       return_kv=return_kv, row_scale=row_scale)

    def norm_free(self, rows):
        # prefill sizes (the decode step's norms are fused into its all-reduce): the normalised
        # rows' write and read back (two per layer: 4096 x 4096 bf16, 64 MB of traffic each) give
        # way to a reduction that reads the stream once (rms_inv) and a scale in the kernels.
        # Only with the fused SwiGLU GEMM: unfused, the (M, 2n) gate/up output would be scaled in
        # a pass of its own (two H200s, Llama-3-8B TP 2, 4096 tokens: 70.8 ms against 56.6,
        # bench/results/tp2-s26d/)
        return self.fold_norms and self.fuse_swiglu and rows >= self.NORM_FREE_MIN_ROWS

    NORM_FREE_MIN_ROWS = 257

    def _glu_big(self, x, n: int) -> bool:
        from numasched.gemm_glu import GLU_BIG_MIN_ROWS, big_tiles

        if x.shape[0] < GLU_BIG_MIN_ROWS:   # decode sizes: nothing more to ask (a per-step host path)
            return False
        from numasched import caps

        return self.gemm == "auto" and x.is_cuda and caps.tma_supported(x.device) and big_tiles(x.shape[0], n,
                                                                                               x.dtype)

    def _gemm_engine(self, x) -> str:
        """numasched's GEMM for ``x``'s rows where it ran at least cuBLAS's speed on the inference
        grid (numasched.distributed.cost.gemm_engine), else cuBLAS; ``gemm="numasched"`` /
        ``"torch"`` forces one."""
        if self.gemm != "auto":
            return self.gemm
        from numasched.distributed.cost import gemm_engine

        return gemm_engine(x.shape[0], x.device)

    # impl= names one choice for both distributed calls; each takes the names it knows
    _AR_IMPL = {"bulk": "nccl", "fused": "auto", "overlap": "auto"}
    _MAR_IMPL = {"nccl": "bulk"}

    def all_reduce(self, x, *, out=None, check=True, impl=None):
        """``impl``: this call's all-reduce implementation (default: the backend's ``impl``)."""
        if self.tp_size == 1:
            return x if out is None or out is x else out.copy_(x)
        return self._nd.all_reduce(x, ctx=self.ctx, impl=impl or self._AR_IMPL.get(self.impl, self.impl),
                                   check=self.check and check, out=out)

    def all_reduce_overlapped(self, x):
        # the copy-engine two-shot: the SM kernels would take SMs from the GEMMs they overlap
        impl = self.OVERLAP_AR_IMPL if self.impl in ("auto", "overlap", "fused") else None
        return self.all_reduce(x, out=x, check=False, impl=impl)

    # the all-reduce of a row-chunked prefill (all_reduce_overlapped) when impl is "auto"
    OVERLAP_AR_IMPL = "ce"

    def row_parallel_add_norm(self, x, w, h, norm_w, eps, add_norm, norm=None, unit_norm=False):
        # fused: GEMM, then one kernel for the all-reduce, the residual add and the norm (one-shot:
        # decode-sized rows only; larger M keeps the all-reduce the cost model picks)
        if self.fuse_norm and self.tp_size > 1 and x.shape[0] <= self.FUSE_NORM_MAX_ROWS:
            plan = self._row_parallel_weight_first(x, w)
            if plan is not None:   # the GEMM's weights streamed behind the attention / gate-up
                from numasched import options as _options

                opts = _options.current()
                if (unit_norm and opts.weight_first_reduce and opts.weight_first_push and h.is_contiguous()
                        and h.dtype == x.dtype and x.shape[0] <= plan.cfg.block_t):
                    # the GEMM finishes the all-reduce and the add itself (h in place, its sums of
                    # squares a band); no norm kernel: the next projection scales its rows
                    from numasched.gemm_weight_first import RowScale

                    target = self._nd.reduce_target(h, ctx=self.ctx, bands=plan.cfg.bands, block_t=plan.cfg.block_t)
                    self._reduce_first_use(plan, x, w, target)
                    plan.run(x, w, reduce=target)
                    if self.check and not torch.cuda.is_current_stream_capturing():
                        self.ctx.check("row-parallel GEMM + all-reduce + add (weight-first, reduce)")
                    return h, ScaledRows(h, RowScale(target.ss, eps))
                if (opts.weight_first_push and x.shape[0] <= self.ctx.num_sms   # a row a program
                        and w.shape[1] >= opts.weight_first_push_min_k):
                    # its bands pushed to the peers as they finish; the norm kernel only waits
                    c = torch.empty((x.shape[0], w.shape[0]), device=x.device, dtype=x.dtype)
                    bands = plan.cfg.bands
                    target = self._nd.push_target(c, h, norm_w, eps, ctx=self.ctx, pushed=bands)
                    plan.run(x, w, out=c, push=target)
                    return self._nd.all_reduce_add_rmsnorm(c, h, norm_w, eps, ctx=self.ctx, check=self.check,
                                                           pushed=bands)
                c = plan.run(x, w)
                return self._nd.all_reduce_add_rmsnorm(c, h, norm_w, eps, ctx=self.ctx, check=self.check)
            return self._nd.matmul_all_reduce(x, w.t(), ctx=self.ctx, check=self.check, gemm=self.gemm,
                                              residual=h, norm_weight=norm_w, eps=eps)
        if norm is not None and self.fuses_residual(x, w):
            # the fused GEMM + all-reduce adds the residual in its epilogue (h + sum: the bits of
            # the unfused add), so the norm reads one tensor instead of the sum and the residual
            # and writes one fewer (4096 x 4096 bf16: 64 MB less traffic per projection)
            h = self.row_parallel_residual(x, w, h)
            return h, norm(h, norm_w, eps)
        return add_norm(self.row_parallel(x, w), h, norm_w, eps)

    def _reduce_first_use(self, plan, x, w, target) -> None:
        """Before a reducing GEMM's first launch with ``target``'s buffers: compile it on this rank,
        then a barrier, so no rank waits on a peer that is still compiling (the fused kernels'
        rule: numasched.distributed._common._first_use). The compile comes from one launch on
        stand-ins: every "peer" is this rank's own scratch copy (heap bases all equal), its flags
        far ahead (no wait), the residual a scratch copy; the kernel specialisation is the real
        call's. Not inside a capture (a barrier syncs the host; the launch would be captured)."""
        key = (id(plan), target.recv.data_ptr(), target.residual.data_ptr())
        if key in self._reduce_ready or torch.cuda.is_current_stream_capturing():
            return
        import dataclasses

        recv = torch.zeros_like(target.recv)
        stand_in = dataclasses.replace(
            target, recv=recv, flags=torch.full_like(target.flags, 1 << 62), ss=torch.empty_like(target.ss),
            epoch=torch.zeros_like(target.epoch), xcount=torch.zeros_like(target.xcount),
            status=torch.zeros_like(target.status), heap_bases=torch.full_like(target.heap_bases, recv.data_ptr()),
            residual=target.residual.clone())
        plan.run(x, w, reduce=stand_in)
        torch.cuda.current_stream().synchronize()
        self.ctx.barrier()
        self._reduce_ready.add(key)

    def _residual_in_kernel(self) -> bool:
        """The residual fusion on, at TP, where row-parallel projections run numasched's collectives."""
        return self.fuse_residual and self.fuse_all_reduce and self.tp_size > 1

    def fuses_residual(self, x, w) -> bool:
        # the switches, prefill rows, and the projection's plan the fused GEMM + all-reduce
        if not (self._residual_in_kernel() and x.shape[0] > self.FUSE_NORM_MAX_ROWS):
            return False
        plan = self._nd.matmul_all_reduce_plan(self.ctx, x, w.t(), impl=self._MAR_IMPL.get(self.impl, self.impl),
                                               gemm=self.gemm)
        return plan.impl == "fused"

    def residual_stream(self, h, row_parallel_weights=()):
        # two ranks, prefill sizes: a copy in the symmetric heap (one buffer, grown to a power of
        # two of rows, at the same offset on both ranks: both make the same calls), where the
        # fused GEMM + all-reduce's owner of a tile stores h + sum into its peer's stream directly.
        # Only where every row-parallel projection adds the residual in that kernel: one that
        # does not returns a new h (the compiled add + norm), and the stream would leave the heap
        # after the first layer (its fused calls then asking for plans of another key)
        if not (self.heap_residual and self._residual_in_kernel() and self.tp_size == 2 and h.is_cuda
                and h.dim() == 2 and h.shape[0] > self.FUSE_NORM_MAX_ROWS and row_parallel_weights):
            return h
        # whether every projection fuses, per row count and shapes: their plans are kept, so the
        # verdict holds (asked once: the plan lookup wants operands, two scratch tensors)
        key = (h.shape[0], h.dtype, tuple(tuple(w.shape) for w in row_parallel_weights))
        inputs = lambda: [torch.empty((h.shape[0], w.shape[1]), device=h.device, dtype=h.dtype)  # noqa: E731
                          for w in row_parallel_weights]   # the projections' inputs, for their plans
        fuse = self._stream_fuses.get(key)
        if fuse is None:
            fuse = self._stream_fuses[key] = all(self.fuses_residual(x, w) for x, w in zip(inputs(),
                                                                                            row_parallel_weights))
        if not fuse:
            return h
        from numasched.distributed._common import alloc_bytes
        from numasched.distributed.matmul_all_reduce import fused_heap_sizes

        buf = self._stream
        if buf is None or buf.dtype != h.dtype or buf.numel() < h.numel():
            xs = inputs()
            numel = (1 << (h.shape[0] - 1).bit_length()) * h.shape[1]
            # room for the stream and for the fused calls' own buffers (counted as if none were
            # made yet: their plans chose the fused kernel before the stream took any heap)
            need = [alloc_bytes(numel * h.element_size())] + [
                n for x, w in zip(xs, row_parallel_weights) for n in fused_heap_sizes(self.ctx, x, w.t())]
            if not self.ctx.heap_room(need):
                return h   # no room (the same verdict on both ranks: their heaps are used alike)
            buf = self._stream = self.ctx.alloc((numel,), h.dtype, what="the residual stream")
        return buf[:h.numel()].view(h.shape).copy_(h)

    def row_parallel_residual(self, x, w, h):
        # matmul_all_reduce(residual=) adds in the kernel where its plan is fused and after the
        # sum elsewhere (the same bits): no second look at the plan here
        if not self._residual_in_kernel():
            return super().row_parallel_residual(x, w, h)
        return self._nd.matmul_all_reduce(x, w.t(), ctx=self.ctx, impl=self._MAR_IMPL.get(self.impl, self.impl),
                                          check=self.check, gemm=self.gemm, residual=h)

    FUSE_NORM_MAX_ROWS = 256
    # a prefill chunk has at least this many rows (its GEMMs stay at cuBLAS's large-M rate)
    OVERLAP_MIN_ROWS = 512

    def prefill_chunks(self, batch, seq):
        # opt-in (default 1): on two H200s it did not pay (see the class doc). One prompt at a time.
        n = self.prefill_overlap if self.prefill_overlap is not None else 1
        if batch != 1 or n < 2:
            return 1
        return max(1, min(n, seq // self.OVERLAP_MIN_ROWS))

    def check_peers(self):
        if self.check and self.ctx is not None and not (torch.cuda.is_available()
                                                        and torch.cuda.is_current_stream_capturing()):
            self.ctx.check()

    def prefill_attention_rows(self, q, k, v):
        rows, H, D = q.shape
        out, _ = self._ns.attention_forward(q[None].transpose(1, 2), k[None].transpose(1, 2), v[None].transpose(1, 2),
                                            causal=True, causal_offset=k.shape[0] - rows, mapping=self._maps["attention"])
        return out.transpose(1, 2).reshape(rows, H * D)

    def _seq_impl(self) -> str:
        """The sequence-parallel prefill's collectives: "bulk" (NCCL + torch.matmul) where the
        backend asks for NCCL or for torch's GEMM, "fused" where it asks for fused kernels, else
        their cost model ("auto")."""
        if self.impl in ("bulk", "nccl") or self.gemm == "torch":
            return "bulk"
        return "fused" if self.impl == "fused" else "auto"

    def group_rank(self):
        return 0 if self.tp_size == 1 else self.ctx.rank

    def all_gather_rows(self, x):
        """The row gather (the logits' columns through :meth:`all_gather_last`, the
        sequence-parallel prefill's rows) over the symmetric heap, so that it waits bounded (a
        rank that stops makes its peers raise TimeoutError naming it, in a graph replay too;
        NCCL's all-gather would wait for it forever): each rank's rows in a zeroed
        (world * T, N) buffer, summed by numasched's one- or two-shot all-reduce (adding zeros
        is exact). A buffer over ``GATHER_PIECE_BYTES`` is summed in pieces of that size (the
        buffer padded to whole pieces): every piece is the same call, so one plan's heap buffers
        serve them all, where one call of the whole buffer would need heap for two to four copies
        of it (a 1100-token prefill's logits: hundreds of MB). ``impl`` "bulk" / "nccl": NCCL's
        all-gather."""
        if self.tp_size == 1 or self.impl in ("bulk", "nccl"):
            return super().all_gather_rows(x)
        from numasched.distributed import cost

        T, N = x.shape
        r = self.group_rank()
        n = self.tp_size * T * N
        piece = min(n, max(1, GATHER_PIECE_BYTES // x.element_size()))
        flat = x.new_zeros(-(-n // piece) * piece)
        buf = flat[:n].view(self.tp_size * T, N)
        buf[r * T:(r + 1) * T] = x
        impl = cost.choose_all_reduce(piece * x.element_size(), self.tp_size, allowed=("oneshot", "twoshot"))
        for lo in range(0, flat.numel(), piece):
            part = flat[lo:lo + piece]
            # the status read (a host sync) once, after the last piece: a wait that gave up in any
            # piece leaves its bit in the context's status word until then
            self.all_reduce(part, out=part, impl=impl, check=lo + piece == flat.numel())
        return buf

    def all_gather_linear(self, x, w):
        if self.tp_size == 1:
            return self.linear(x, w)
        return self._nd.all_gather_matmul(x, w.t(), ctx=self.ctx, mapping=self._maps["gemm"], impl=self._seq_impl(),
                                          check=self.check)

    def linear_reduce_scatter(self, x, w):
        if self.tp_size == 1:
            return self.linear(x, w)
        return self._nd.matmul_reduce_scatter(x, w.t(), ctx=self.ctx, mapping=self._maps["gemm"],
                                              impl=self._seq_impl(),
                                              check=self.check)

    def row_parallel(self, x, w):
        if self.tp_size == 1:
            return self.linear(x, w)
        if self.fuse_all_reduce:
            return self._nd.matmul_all_reduce(x, w.t(), ctx=self.ctx, impl=self._MAR_IMPL.get(self.impl, self.impl),
                                              check=self.check, gemm=self.gemm)
        return self.all_reduce(self.linear(x, w))

    def prefill_engine(self, device: torch.device) -> str:
        """Which kernel runs a one-step prefill's attention on ``device``: "numasched" or "torch"."""
        if self.prefill_attention_impl != "auto":
            return self.prefill_attention_impl
        from numasched import caps

        return "torch" if device.type == "cuda" and not caps.is_hip() else "numasched"

    def prefill_attention(self, q, k, v, batch, seq):
        if self.prefill_engine(q.device) == "torch":
            return _causal_sdpa(self._sdpa, q, k, v, batch, seq)
        T, H, D = q.shape
        qt, kt, vt = (t.view(batch, seq, -1, D).transpose(1, 2) for t in (q, k, v))
        out, _ = self._ns.attention_forward(qt, kt, vt, causal=True, mapping=self._maps["attention"])
        return out.transpose(1, 2).reshape(T, H * D)   # out is a (B, H, S, D) view of (B, S, H, D) memory

    def decode_attention(self, q, cache: PagedKVCache, layer):
        B, H, D = q.shape
        # prefetch: the kernel before is the RoPE + cache write (rope_cache_write), which leaves the
        # memory bus idle for the K/V prefetch (options.decode_prefetch)
        out = self._ns.flash_decode(q, cache.k(layer), cache.v(layer), cache_seqlens=cache.lens_next,
                                    block_table=cache.block_table, mapping=self._maps["decode"], prefetch=True)
        return out.reshape(B, H * D)


BACKENDS = {"numasched": NumaschedBackend, "torch": TorchBackend}
