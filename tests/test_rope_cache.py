"""numasched.qkv_rope_cache: the QKV split + RoPE + KV-cache write kernel against a float64
reference (interpreter on CPU; the real sizes on a GPU), its checks, its plan."""
import pytest
import torch

import numasched
from numasched.rope_cache import check_qkv_rope_cache, plan_qkv_rope_cache, qkv_rope_cache, reference


def _case(T, H, HK, D, dtype, norm, pages=7, page_size=4, device="cpu", seed=0):
    g = torch.Generator(device).manual_seed(seed)
    qkv = torch.randn(T, (H + 2 * HK) * D, generator=g, device=device).to(dtype)
    pos = torch.arange(T, device=device, dtype=torch.float64)[:, None] * torch.rand(
        D // 2, generator=g, device=device, dtype=torch.float64)[None, :]
    emb = torch.cat((pos, pos), -1)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    qw = (1 + 0.3 * torch.randn(D, generator=g, device=device)).to(dtype) if norm else None
    kw = (1 + 0.3 * torch.randn(D, generator=g, device=device)).to(dtype) if norm else None
    kc = torch.full((pages, page_size, HK, D), float("nan"), dtype=dtype, device=device)   # poisoned
    vc = kc.clone()
    slots = torch.randperm(pages * page_size, generator=g, device=device)[:T]
    return qkv, cos, sin, qw, kw, kc, vc, slots


class _Rows:
    """Rows (slots) of a paged cache of any strides, read when indexed."""

    def __init__(self, cache):
        self.cache, self.shape = cache, (cache.shape[0] * cache.shape[1],) + tuple(cache.shape[2:])

    def __getitem__(self, idx):
        idx = idx.to(torch.int64)
        return self.cache[idx // self.cache.shape[1], idx % self.cache.shape[1]]


def _want(qkv, cos, sin, qw, kw, H, HK, eps=1e-6):
    f = (lambda t: None if t is None else t.double())
    return reference(qkv.double(), cos.double(), sin.double(), H, HK, f(qw), f(kw), eps)


def _rel(a, b):
    return ((a.double() - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


@pytest.mark.parametrize("T,H,HK,D,dtype,norm", [
    (1, 4, 1, 16, torch.float32, False),        # one token, group of 4
    (5, 5, 1, 32, torch.float32, True),         # group of 5, Qwen3's norms
    (19, 6, 3, 16, torch.float16, True),        # two row blocks, a partial one
    (17, 7, 7, 8, torch.float16, False),        # MHA, tiny heads
    (3, 2, 2, 24, torch.float32, False),        # head_dim not a power of two (masked lanes)
])
def test_matches_float64_reference_and_writes_only_its_slots(T, H, HK, D, dtype, norm):
    qkv, cos, sin, qw, kw, kc, vc, slots = _case(T, H, HK, D, dtype, norm, pages=8)
    if dtype == torch.float32:
        slots = slots.to(torch.int32)   # both index dtypes
    q = qkv_rope_cache(qkv, cos, sin, kc, vc, slots, heads=H, kv_heads=HK, q_weight=qw, k_weight=kw)
    rq, rk, rv = _want(qkv, cos, sin, qw, kw, H, HK)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    kf, vf = kc.view(-1, HK, D), vc.view(-1, HK, D)
    idx = slots.to(torch.int64)
    assert q.shape == (T, H, D) and q.dtype == dtype
    assert _rel(q, rq) < tol and _rel(kf[idx], rk) < tol and _rel(vf[idx], rv) < tol
    # every other row of the caches is untouched (still NaN)
    other = torch.ones(kf.shape[0], dtype=torch.bool)
    other[idx] = False
    assert torch.isnan(kf[other]).all() and torch.isnan(vf[other]).all()


@pytest.mark.parametrize("T,H,HK,D,dtype,norm,kernel", [
    (19, 6, 3, 16, torch.float16, True, True),    # two row blocks, Qwen3's norms
    (5, 4, 2, 32, torch.float32, False, True),
    (7, 4, 2, 16, torch.float32, True, False),    # the torch fallback
])
def test_head_major_pages_take_each_slot_at_its_page_and_offset(T, H, HK, D, dtype, norm, kernel, monkeypatch):
    """A paged cache stored head-major ((pages, kv_heads, page_size, D), handed over as its
    (pages, page_size, kv_heads, D) view, whose rows do not flatten): slot s goes to page s // 4,
    offset s % 4 of every head, nothing else is written; k and v views of different strides are
    addressed alike."""
    if not kernel:
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    qkv, cos, sin, qw, kw, _, _, slots = _case(T, H, HK, D, dtype, norm, pages=6, page_size=4, seed=T)
    k_store = torch.full((6, HK, 4, D), float("nan"), dtype=dtype)
    v_store = torch.full((6, 4 + 1, HK, 4, D), float("nan"), dtype=dtype)[:, 1]   # another page stride
    kc, vc = k_store.transpose(1, 2), v_store.transpose(1, 2)
    plan = plan_qkv_rope_cache(qkv, cos, sin, kc, vc, slots, heads=H, kv_heads=HK, q_weight=qw, k_weight=kw)
    assert plan.page == 4 and plan.rows == 24 and plan.mode == ("interpreter" if kernel else "torch")
    q = plan.run(qkv, cos, sin, kc, vc, slots, qw, kw)
    rq, rk, rv = _want(qkv, cos, sin, qw, kw, H, HK)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    idx = slots.to(torch.int64)
    pg, off = idx // 4, idx % 4
    assert _rel(q, rq) < tol
    assert _rel(k_store[pg, :, off], rk) < tol and _rel(v_store[pg, :, off], rv) < tol
    written = torch.zeros(6, 4, dtype=torch.bool)
    written[pg, off] = True
    assert torch.isnan(k_store.transpose(1, 2)[~written]).all() and torch.isnan(v_store.transpose(1, 2)[~written]).all()
    # a cache that is neither rows nor pages, and k / v addressed differently, are named
    with pytest.raises(ValueError, match="k_cache .* not a paged"):
        qkv_rope_cache(qkv, cos, sin, k_store.permute(2, 0, 1, 3)[:, :, :, :].transpose(0, 1)[None], vc, slots,
                       heads=H, kv_heads=HK)
    with pytest.raises(ValueError, match="addressed alike"):
        qkv_rope_cache(qkv, cos, sin, kc, torch.zeros(24, HK, D, dtype=dtype), slots, heads=H, kv_heads=HK)
    # pages of one shape, K head-major, V in vLLM's layout (its rows flatten): both by page and
    # offset; a -1 slot and (checks off) one past the rows write nothing
    v_rows = torch.full((6, 4, HK, D), float("nan"), dtype=dtype)
    k_store.fill_(float("nan"))
    s2 = slots.clone()
    s2[0], s2[-1] = -1, 24
    with numasched.options.use(check_data=False):
        q = qkv_rope_cache(qkv, cos, sin, kc, v_rows, s2, heads=H, kv_heads=HK, q_weight=qw, k_weight=kw)
    keep = (s2 >= 0) & (s2 < 24)
    pg, off = s2[keep] // 4, s2[keep] % 4
    assert _rel(q, rq) < tol and _rel(k_store[pg, :, off], rk[keep]) < tol and _rel(v_rows[pg, off], rv[keep]) < tol
    assert torch.isnan(k_store).sum() == (24 - int(keep.sum())) * HK * D and torch.isnan(v_rows).sum() == torch.isnan(
        k_store).sum()


@pytest.mark.parametrize("T,H,HK,D,dtype,norm", [(19, 6, 3, 16, torch.float16, True), (5, 4, 1, 32, torch.float32, False),
                                                (1, 2, 2, 16, torch.float32, True)])
def test_row_scale_scales_each_token_first(T, H, HK, D, dtype, norm):
    """row_scale (a folded RMSNorm's 1 / rms per token): token t's row counts as s[t] * qkv[t]
    before the per-head norms and the rotation, for q, the cache's k and v and the returned k, v;
    a plan made with it refuses a call without it, and a bad one is named."""
    qkv, cos, sin, qw, kw, kc, vc, slots = _case(T, H, HK, D, dtype, norm, pages=8, seed=T)
    sc = torch.rand(T, generator=torch.Generator().manual_seed(T)) * 3 + 0.1
    q, k, v = qkv_rope_cache(qkv, cos, sin, kc, vc, slots, heads=H, kv_heads=HK, q_weight=qw, k_weight=kw,
                             return_kv=True, row_scale=sc)
    rq, rk, rv = _want(qkv.double() * sc.double()[:, None], cos, sin, qw, kw, H, HK)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    idx = slots.to(torch.int64)
    assert _rel(q, rq) < tol and _rel(k, rk) < tol and _rel(v, rv) < tol
    assert _rel(kc.view(-1, HK, D)[idx], rk) < tol and _rel(vc.view(-1, HK, D)[idx], rv) < tol
    plan = plan_qkv_rope_cache(qkv, cos, sin, kc, vc, slots, heads=H, kv_heads=HK, q_weight=qw, k_weight=kw,
                               row_scale=sc)
    assert plan.row_scale
    with pytest.raises(ValueError, match="row_scale is missing"):
        plan.run(qkv, cos, sin, kc, vc, slots, qw, kw)
    with pytest.raises(ValueError, match=r"row_scale must be a contiguous \(%d,\) fp32" % T):
        qkv_rope_cache(qkv, cos, sin, kc, vc, slots, heads=H, kv_heads=HK, q_weight=qw, k_weight=kw,
                       row_scale=torch.ones(T + 1))


@pytest.mark.parametrize("T,H,HK,D,dtype,norm", [(19, 6, 3, 16, torch.float16, True), (5, 4, 1, 32, torch.float32, False)])
def test_return_kv_gives_contiguous_k_and_v_of_every_token(T, H, HK, D, dtype, norm):
    """return_kv (a prefill's attention reads k and v contiguous): the rotated k and the v of every
    token, padding tokens (slot -1) included, besides the cache rows; q as without it."""
    qkv, cos, sin, qw, kw, kc, vc, slots = _case(T, H, HK, D, dtype, norm, pages=8, seed=3)
    slots[1] = -1   # a padding token: not in the cache, still in k and v
    q, k, v = qkv_rope_cache(qkv, cos, sin, kc, vc, slots, heads=H, kv_heads=HK, q_weight=qw, k_weight=kw,
                             return_kv=True)
    rq, rk, rv = _want(qkv, cos, sin, qw, kw, H, HK)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert k.shape == v.shape == (T, HK, D) and k.is_contiguous() and v.is_contiguous()
    assert _rel(q, rq) < tol and _rel(k, rk) < tol and _rel(v, rv) < tol
    keep = slots >= 0
    kf, vf = kc.view(-1, HK, D), vc.view(-1, HK, D)
    assert torch.equal(kf[slots[keep]], k[keep]) and torch.equal(vf[slots[keep]], v[keep])
    q2 = qkv_rope_cache(qkv, cos, sin, kc, vc, slots, heads=H, kv_heads=HK, q_weight=qw, k_weight=kw)
    assert isinstance(q2, torch.Tensor) and torch.equal(q2, q)   # a plan of its own without return_kv
    with pytest.raises(TypeError, match="return_kv"):
        qkv_rope_cache(qkv, cos, sin, kc, vc, slots, heads=H, kv_heads=HK, q_weight=qw, k_weight=kw, return_kv=1)


def test_out_and_plan_reuse_and_signature_checks():
    T, H, HK, D = 4, 4, 2, 16
    qkv, cos, sin, qw, kw, kc, vc, slots = _case(T, H, HK, D, torch.float32, False)
    plan = plan_qkv_rope_cache(qkv, cos, sin, kc, vc, slots, heads=H, kv_heads=HK)
    assert plan.grid == (1, H + 2 * HK) and plan.rows == kc.shape[0] * kc.shape[1]
    out = torch.full((T, H, D), float("nan"))
    assert plan.run(qkv, cos, sin, kc, vc, slots, out=out) is out
    rq, rk, _ = _want(qkv, cos, sin, None, None, H, HK)
    assert _rel(out, rq) < 1e-5
    # a second step: new rows, new slots, same plan (the graph-safe path)
    qkv2 = torch.randn_like(qkv)
    slots2 = (slots + 1) % plan.rows
    q2 = plan.run(qkv2, cos, sin, kc, vc, slots2)
    assert _rel(kc.view(-1, HK, D)[slots2], _want(qkv2, cos, sin, None, None, H, HK)[1]) < 1e-5
    assert _rel(q2, _want(qkv2, cos, sin, None, None, H, HK)[0]) < 1e-5
    with pytest.raises(ValueError, match="qkv"):
        plan.run(qkv[:2], cos, sin, kc, vc, slots)
    with pytest.raises(ValueError, match="q_weight was None"):
        plan.run(qkv, cos, sin, kc, vc, slots, q_weight=torch.ones(D), k_weight=torch.ones(D))


def test_strided_cos_sin_views_as_the_decoder_passes_them():
    """The decoder's cos/sin are views of one (T, 2, D) table (row stride 2 D)."""
    T, H, HK, D = 6, 2, 1, 16
    qkv, cos, sin, _, _, kc, vc, slots = _case(T, H, HK, D, torch.float32, False)
    cs = torch.stack((cos, sin), 1)
    q = qkv_rope_cache(qkv, cs[:, 0], cs[:, 1], kc, vc, slots, heads=H, kv_heads=HK)
    assert _rel(q, _want(qkv, cos, sin, None, None, H, HK)[0]) < 1e-5


def test_bad_slots_are_named_and_padding_slots_write_nothing():
    T, H, HK, D = 3, 2, 1, 8
    qkv, cos, sin, _, _, kc, vc, slots = _case(T, H, HK, D, torch.float32, False, pages=2, page_size=4)
    bad = slots.clone()
    bad[1] = 8   # the cache has 8 rows
    with pytest.raises(ValueError, match=r"slots\[1\] = 8 is outside the cache's rows \[0, 8\)"):
        qkv_rope_cache(qkv, cos, sin, kc, vc, bad, heads=H, kv_heads=HK)
    # -1 (padding) passes the check and writes nothing; with the checks off, neither does any
    # other slot outside [0, rows): the guard rows after the cache stay as they were
    big = torch.full((2 * 8 + 8, HK, D), 7.0)
    k_in, v_in = big[:8], torch.full((8, HK, D), 7.0)
    qkv_rope_cache(qkv, cos, sin, k_in, v_in, torch.tensor([2, -1, 5]), heads=H, kv_heads=HK)
    _, rk, rv = _want(qkv, cos, sin, None, None, H, HK)
    assert _rel(k_in[2], rk[0]) < 1e-5 and _rel(v_in[5], rv[2]) < 1e-5
    assert (k_in[[0, 1, 3, 4, 6, 7]] == 7.0).all() and (v_in[[0, 1, 3, 4, 6, 7]] == 7.0).all()
    with numasched.options.use(check_data=False):
        qkv_rope_cache(qkv, cos, sin, k_in, v_in, torch.tensor([1000, -5, 6]), heads=H, kv_heads=HK)
    assert (big[8:] == 7.0).all() and (k_in[[0, 1, 3, 4, 7]] == 7.0).all()
    assert _rel(k_in[6], rk[2]) < 1e-5


def test_strided_slots_misaligned_out_and_empty_caches_are_refused():
    T, H, HK, D = 3, 2, 1, 8
    qkv, cos, sin, _, _, kc, vc, slots = _case(T, H, HK, D, torch.float32, False)
    strided = torch.stack((slots, slots), 1)[:, 0]
    with pytest.raises(ValueError, match="slots must be contiguous"):
        qkv_rope_cache(qkv, cos, sin, kc, vc, strided, heads=H, kv_heads=HK)
    plan = plan_qkv_rope_cache(qkv, cos, sin, kc, vc, slots, heads=H, kv_heads=HK)
    buf = torch.empty(T * H * D + 1)
    with pytest.raises(ValueError, match="16-byte aligned"):
        plan.run(qkv, cos, sin, kc, vc, slots, out=buf[1:].view(T, H, D))
    with pytest.raises(ValueError, match="k_cache has no rows"):
        check_qkv_rope_cache(qkv, cos, sin, kc[:0], vc[:0], slots, heads=H, kv_heads=HK)
    with pytest.raises(ValueError, match="k_cache has 28 rows but v_cache has 24"):
        check_qkv_rope_cache(qkv, cos, sin, kc, vc[:6], slots, heads=H, kv_heads=HK)
    for eps in (-1.0, float("nan"), "x", True):
        with pytest.raises(ValueError, match="eps must be a finite number"):
            check_qkv_rope_cache(qkv, cos, sin, kc, vc, slots, heads=H, kv_heads=HK, eps=eps)
    with pytest.raises(TypeError, match="heads must be a positive int"):
        qkv_rope_cache(qkv, cos, sin, kc, vc, slots, heads=True, kv_heads=HK)


@pytest.mark.parametrize("change,match", [
    (dict(heads=0), "heads must be >= 1"),
    (dict(qkv_cols=-1), "qkv has .* columns, not a multiple"),
    (dict(cos_rows=-1), "cos must be a"),
    (dict(k_heads=3), "k_cache must end in"),
    (dict(slots_len=-1), "slots must hold one row per token"),
    (dict(slots_dtype=torch.float32), "slots"),
    (dict(only_q_weight=True), "q_weight and k_weight go together"),
    (dict(cache_dtype=torch.float16), "k_cache"),
    (dict(strided_cache=True), "cannot be viewed as"),
])
def test_bad_arguments_are_named(change, match):
    T, H, HK, D = 4, 2, 1, 8
    qkv, cos, sin, _, _, kc, vc, slots = _case(T, H, HK, D, torch.float32, False)
    kw = dict(heads=change.get("heads", H), kv_heads=HK)
    if "qkv_cols" in change:
        qkv = qkv[:, :-1]
    if "cos_rows" in change:
        cos = cos[:-1]
    if "k_heads" in change:
        kc = torch.zeros(7, 4, 3, D)
    if "slots_len" in change:
        slots = slots[:-1]
    if "slots_dtype" in change:
        slots = slots.to(change["slots_dtype"])
    if "only_q_weight" in change:
        kw["q_weight"] = torch.ones(D)
    if "cache_dtype" in change:
        kc = kc.to(change["cache_dtype"])
    if "strided_cache" in change:
        # rows 16 apart within blocks of 72 rows: no uniform run, and not (pages, page_size, ...)
        # either (a 4-D paged view of any strides is addressed by page and offset)
        kc = torch.zeros(2, 7, 9, HK, D)[:, :, ::2]
    with pytest.raises((ValueError, TypeError), match=match):
        check_qkv_rope_cache(qkv, cos, sin, kc, vc, slots, **kw)


@pytest.mark.gpu
@pytest.mark.parametrize("norm,head_major", [(False, False), (True, False), (False, True)])
def test_gpu_llama_sizes_in_a_cuda_graph(norm, head_major):
    """Llama-3-8B at TP 2 (16 q heads, 4 kv heads, d128), 16 tokens, pages of 16 (also head-major
    pages, options.paged_kv_head_major), bf16: eager, then replayed from a CUDA graph on new
    inputs (output poisoned first)."""
    T, H, HK, D = 16, 16, 4, 128
    qkv, cos, sin, qw, kw, kc, vc, slots = _case(T, H, HK, D, torch.bfloat16, norm, pages=64, page_size=16,
                                                 device="cuda")
    if head_major:
        kc, vc = (torch.full((64, HK, 16, D), float("nan"), dtype=torch.bfloat16, device="cuda").transpose(1, 2)
                  for _ in range(2))
    q = qkv_rope_cache(qkv, cos, sin, kc, vc, slots, heads=H, kv_heads=HK, q_weight=qw, k_weight=kw)
    rq, rk, rv = _want(qkv, cos, sin, qw, kw, H, HK)
    kf, vf = _Rows(kc), _Rows(vc)   # rows read when indexed (after the replay too)
    assert _rel(q, rq) < 1e-2 and _rel(kf[slots], rk) < 1e-2 and _rel(vf[slots], rv) < 1e-2
    out = torch.empty_like(q)
    with numasched.options.use(check_data=False):
        qkv_rope_cache(qkv, cos, sin, kc, vc, slots, heads=H, kv_heads=HK, q_weight=qw, k_weight=kw, out=out)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            qkv_rope_cache(qkv, cos, sin, kc, vc, slots, heads=H, kv_heads=HK, q_weight=qw, k_weight=kw, out=out)
    qkv.copy_(torch.randn_like(qkv))
    slots.copy_(torch.randperm(kf.shape[0], device="cuda")[:T])
    out.fill_(float("nan"))
    g.replay()
    torch.cuda.synchronize()
    rq, rk, _ = _want(qkv, cos, sin, qw, kw, H, HK)
    assert _rel(out, rq) < 1e-2 and _rel(kf[slots], rk) < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("norm", [False, True])
def test_gpu_prefill_size_with_k_and_v_returned(norm):
    """A 4096-token prefill at the Llama-3-8B TP 2 shape, pages of 16, bf16, return_kv."""
    T, H, HK, D = 4096, 16, 4, 128
    qkv, cos, sin, qw, kw, kc, vc, slots = _case(T, H, HK, D, torch.bfloat16, norm, pages=300, page_size=16,
                                                 device="cuda")
    q, k, v = qkv_rope_cache(qkv, cos, sin, kc, vc, slots, heads=H, kv_heads=HK, q_weight=qw, k_weight=kw,
                             return_kv=True)
    rq, rk, rv = _want(qkv, cos, sin, qw, kw, H, HK)
    kf, vf = kc.view(-1, HK, D), vc.view(-1, HK, D)
    assert _rel(q, rq) < 1e-2 and _rel(k, rk) < 1e-2 and _rel(v, rv) < 1e-2
    assert torch.equal(kf[slots], k) and torch.equal(vf[slots], v)


def test_torch_fallback_without_interpreter_and_empty_steps(monkeypatch):
    from numasched import observe

    T, H, HK, D = 5, 3, 1, 16
    qkv, cos, sin, qw, kw, kc, vc, slots = _case(T, H, HK, D, torch.float32, True)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    plan = plan_qkv_rope_cache(qkv, cos, sin, kc, vc, slots, heads=H, kv_heads=HK, q_weight=qw, k_weight=kw)
    assert plan.mode == "torch"
    with observe.record() as log:
        q = plan.run(qkv, cos, sin, kc, vc, slots, qw, kw)
    assert log.kernels() == ["torch"]
    rq, rk, rv = _want(qkv, cos, sin, qw, kw, H, HK)
    assert _rel(q, rq) < 1e-5 and _rel(kc.view(-1, HK, D)[slots], rk) < 1e-5
    empty = plan_qkv_rope_cache(qkv[:0], cos[:0], sin[:0], kc, vc, slots[:0], heads=H, kv_heads=HK)
    assert empty.mode == "empty" and empty.run(qkv[:0], cos[:0], sin[:0], kc, vc, slots[:0]).shape == (0, H, D)
