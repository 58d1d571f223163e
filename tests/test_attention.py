"""Prefill attention kernel, attention_forward and the SDPA drop-in.

On CPU the kernel runs in Triton's interpreter (tiny shapes, fp32/fp16: the interpreter's bf16
dot is wrong); GPU tests (marked gpu) use real sizes in bf16. Every comparison is against a
float64 reference on fresh random inputs; outputs are poisoned with NaN before each launch.
"""
import math
import warnings

import pytest
import torch
import torch.nn.functional as F

import numasched
from numasched import mappings as M
from numasched import observe, options, topology
from numasched import attention as A
from numasched._route import reset_warnings
from numasched.kernels import attention_fwd as K

from conftest import DEVICE, HAS_GPU

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")
TORCH_SDPA = F.scaled_dot_product_attention  # the real one, before any test patches it
INTERP_CFG_TMA = dict(BLOCK_M=16, BLOCK_N=16, USE_TMA=True, num_warps=4, num_stages=1)
INTERP_CFG_RECT = dict(BLOCK_M=32, BLOCK_N=16, USE_TMA=False, num_warps=4, num_stages=1)


_LOG = []


@pytest.fixture(autouse=True)
def _poison_and_count():
    """Every launch's outputs are NaN-poisoned first; ``calls()`` says which paths ran."""
    reset_warnings()
    with observe.record(poison=True) as log:
        _LOG[:] = [log]
        yield log


def calls() -> dict:
    """Paths that ran in this test: "kernel" (prefill launches), "decode", "fallback"."""
    log = _LOG[0]
    got = {"kernel": log.count("attention", kernel="attention"), "decode": log.count("flash_decode"),
           "fallback": len(log.fallbacks())}
    return {k: n for k, n in got.items() if n}


def ref_attention(q, k, v, causal=False, offset=0, scale=None):
    """float64 (out, lse) with GQA and the causal diagonal j <= i + offset; empty rows -> 0, -inf."""
    G = q.shape[1] // k.shape[1]
    qd, kd, vd = q.double(), k.double().repeat_interleave(G, 1), v.double().repeat_interleave(G, 1)
    s = qd @ kd.transpose(-1, -2) * (scale if scale is not None else q.shape[-1] ** -0.5)
    if causal:
        Lq, Lk = s.shape[-2:]
        i = torch.arange(Lq, device=s.device)[:, None]
        j = torch.arange(Lk, device=s.device)[None, :]
        s = s.masked_fill(j > i + offset, float("-inf"))
    lse = torch.logsumexp(s, -1)
    p = torch.softmax(s, -1).nan_to_num(0.0)
    return p @ vd, lse


def rand(*shape, dtype=torch.float32, device=DEVICE):
    return torch.randn(*shape, dtype=torch.float32, device=device).to(dtype)


def check(out, lse, ref_out, ref_lse, dtype):
    assert not out.isnan().any(), "some outputs were not written (NaN poison left)"
    assert not lse.isnan().any(), "some lse values were not written (NaN poison left)"
    tol = 2e-5 if dtype == torch.float32 else 1e-2
    err = (out.double() - ref_out).abs().max().item()
    assert err <= tol * max(1.0, ref_out.abs().max().item()), f"max abs error {err}"
    fin = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), fin)
    assert (lse.double()[fin] - ref_lse[fin]).abs().max().item() <= 1e-4
    assert (lse[~fin] == float("-inf")).all()


# ------------------------------------------------------------------------------ kernel vs float64
CASES = [
    # B, H, HK, Lq, Lk, D, config
    pytest.param(2, 4, 2, 37, 29, 64, None, id="gqa-Lq>Lk-d64"),
    pytest.param(1, 2, 2, 20, 45, 128, INTERP_CFG_TMA, id="mha-Lq<Lk-d128-tma"),
    pytest.param(1, 4, 1, 33, 33, 64, INTERP_CFG_RECT, id="mqa-square-d64-bm32bn16"),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("B,H,HK,Lq,Lk,D,cfg", CASES)
def test_matches_float64(B, H, HK, Lq, Lk, D, cfg, causal, dtype):
    q, k, v = rand(B, H, Lq, D, dtype=dtype), rand(B, HK, Lk, D, dtype=dtype), rand(B, HK, Lk, D, dtype=dtype)
    out, lse = A.attention_forward(q, k, v, causal=causal, _config=cfg)
    assert out.shape == q.shape and out.dtype == dtype and lse.shape == (B, H, Lq) and lse.dtype == torch.float32
    check(out, lse, *ref_attention(q, k, v, causal), dtype)
    assert calls() == {"kernel": 1}


@pytest.mark.parametrize("D", [16, 40, 256])
def test_other_head_dims(D):
    # 40 is padded to 64 inside (masked loads); 16 is the tiny HF test model's head dim
    q, k, v = rand(1, 2, 18, D), rand(1, 2, 21, D), rand(1, 2, 21, D)
    out, lse = A.attention_forward(q, k, v, causal=True, scale=0.3)
    check(out, lse, *ref_attention(q, k, v, True, scale=0.3), torch.float32)


@pytest.mark.parametrize("cfg", [None, INTERP_CFG_TMA], ids=["pointers", "tma"])
def test_fully_masked_rows_are_zero(cfg):
    # bottom-right diagonal with Lq > Lk: the first Lq - Lk rows see no key
    q, k, v = rand(1, 2, 40, 64), rand(1, 2, 23, 64), rand(1, 2, 23, 64)
    off = 23 - 40
    out, lse = A.attention_forward(q, k, v, causal=True, causal_offset=off, _config=cfg)
    ref_out, ref_lse = ref_attention(q, k, v, True, off)
    assert (out[:, :, : 40 - 23] == 0).all() and (lse[:, :, : 40 - 23] == float("-inf")).all()
    check(out, lse, ref_out, ref_lse, torch.float32)
    # no key at all
    out0, lse0 = A.attention_forward(q, k[:, :, :0], v[:, :, :0])
    assert (out0 == 0).all() and (lse0 == float("-inf")).all()


def test_causal_offsets_positive():
    q, k, v = rand(1, 2, 24, 64), rand(1, 2, 50, 64), rand(1, 2, 50, 64)
    for off in (3, 50 - 24):
        out, lse = A.attention_forward(q, k, v, causal=True, causal_offset=off)
        check(out, lse, *ref_attention(q, k, v, True, off), torch.float32)


def test_strided_inputs():
    # q a transposed view of (B, S, H, D) memory; k and v slices of a packed (B, S, 2, HK, D) tensor
    B, S, H, HK, D = 2, 26, 4, 2, 64
    q = rand(B, S, H, D).transpose(1, 2)
    kv = rand(B, S + 5, 2, HK, D)
    k, v = kv[:, 3 : 3 + S, 0].transpose(1, 2), kv[:, 3 : 3 + S, 1].transpose(1, 2)
    assert not q.is_contiguous() and not k.is_contiguous()
    for cfg in (None, INTERP_CFG_TMA):
        out, lse = A.attention_forward(q, k, v, causal=True, _config=cfg)
        check(out, lse, *ref_attention(q, k, v, True), torch.float32)


@pytest.mark.parametrize("policy", M.available("attention"))
def test_every_policy_on_mi300x(policy):
    # 8 domains: the remaps are not the identity, and every work item must still be covered
    B, H, HK, Lq, Lk, D = 2, 8, 4, 35, 35, 64
    q, k, v = rand(B, H, Lq, D), rand(B, HK, Lk, D), rand(B, HK, Lk, D)
    with topology.use("mi300x"):
        for causal in (False, True):
            out, lse = A.attention_forward(q, k, v, causal=causal, mapping=policy)
            check(out, lse, *ref_attention(q, k, v, causal), torch.float32)


def test_policy_object_and_composed_policy():
    q, k, v = rand(1, 4, 20, 64), rand(1, 2, 20, 64), rand(1, 2, 20, 64)
    composed = M.compose("xcd_remap_chunked", "block_first", name="test_chunked_block_first")
    with topology.use("mi300x"):
        for mp in (M.get("swizzled_head_first"), composed):
            out, lse = A.attention_forward(q, k, v, mapping=mp)
            check(out, lse, *ref_attention(q, k, v), torch.float32)


def test_fresh_equal_policy_objects_share_one_token():
    """A program making a new (equal) Policy object per call must not grow the token table."""
    made = [M.compose("identity", "head_first", name="test_bounded") for _ in range(5)]
    toks = {M.token(p) for p in made}
    assert len(toks) == 1 and M.get(toks.pop()) == made[0]


def test_kernel_launch_is_policy_driven():
    """The policy reaches the kernel as one MAPPING constexpr (one kernel for every policy)."""
    q, k, v = rand(1, 2, 16, 64), rand(1, 2, 16, 64), rand(1, 2, 16, 64)
    with topology.use("mi300x"):
        A.attention_forward(q, k, v, mapping="swizzled_head_first")
        plan = numasched.plan_attention(q, k, v, mapping="swizzled_head_first")
    pol = M.get("swizzled_head_first")
    assert _LOG[0][-1].plan.policy is pol
    assert plan._launch.kwargs["MAPPING"] == pol.constexpr(8)


def test_composed_policy_under_torch_compile():
    """An unregistered (composed) policy crosses the custom op as a token (it failed with an
    internal key in the message)."""
    q, k, v = rand(1, 4, 20, 64), rand(1, 2, 20, 64), rand(1, 2, 20, 64)
    composed = M.compose("xcd_remap_chunked", "block_first", name="test_compiled_composed")
    with topology.use("mi300x"):
        f = torch.compile(lambda q, k, v: A.attention_forward(q, k, v, mapping=composed)[0], backend="aot_eager",
                          fullgraph=True)
        out = f(q, k, v)
    assert (out.double() - ref_attention(q, k, v)[0]).abs().max() < 2e-5


def test_public_plan_run():
    q, k, v = rand(2, 4, 20, 64), rand(2, 2, 20, 64), rand(2, 2, 20, 64)
    plan = numasched.plan_attention(q, k, v, causal=True)
    assert plan.policy is not None and plan.mode == "interpreter" and plan.grid is not None
    for seed in range(2):
        q, k, v = rand(2, 4, 20, 64), rand(2, 2, 20, 64), rand(2, 2, 20, 64)
        out, lse = plan.run(q, k, v)
        check(out, lse, *ref_attention(q, k, v, True), torch.float32)
    with pytest.raises(ValueError, match="query is .* but the plan was made for"):
        plan.run(q[:, :, :10], k, v)
    with pytest.raises(ValueError, match="out must have shape"):
        plan.run(q, k, v, out=torch.empty_like(q))  # contiguous (B, H, Lq, D): not the planned layout


def test_bf16_on_the_interpreter_is_computed_in_fp32():
    """The interpreter's bf16 dot is wrong upstream (errors of 1e8): never return that."""
    q, k, v = (t.bfloat16() for t in (rand(1, 2, 19, 64), rand(1, 2, 19, 64), rand(1, 2, 19, 64)))
    out, lse = A.attention_forward(q, k, v, causal=True)
    assert out.dtype == torch.bfloat16
    check(out, lse, *ref_attention(q, k, v, True), torch.bfloat16)
    sd = numasched.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert (sd.double() - ref_attention(q, k, v, True)[0]).abs().max() < 2e-2


# ------------------------------------------------------------------------------ custom op
def test_custom_op_traces_under_compile():
    q, k, v = rand(1, 2, 20, 64), rand(1, 2, 20, 64), rand(1, 2, 20, 64)

    def f(q, k, v):
        return A.attention_forward(q, k, v, causal=True)[0] * 2

    cf = torch.compile(f, backend="aot_eager", fullgraph=True)
    out = cf(q, k, v)
    ref, _ = ref_attention(q, k, v, True)
    assert (out.double() - 2 * ref).abs().max() < 1e-4
    assert calls().get("kernel", 0) >= 1
    # the drop-in's routing traces without graph breaks too
    sd = torch.compile(lambda q, k, v: numasched.scaled_dot_product_attention(q, k, v, is_causal=True),
                       backend="aot_eager", fullgraph=True)
    assert (sd(q, k, v).double() - ref).abs().max() < 1e-4
    res = torch.library.opcheck(torch.ops.numasched.attention_forward.default, (q, k, v, True, 0.125, 0, "auto"))
    assert all(v == "SUCCESS" for v in res.values()), res
    fake_out, fake_lse = torch.ops.numasched.attention_forward.default(
        q.to("meta"), k.to("meta"), v.to("meta"), True, 0.125, 0, "auto")
    assert fake_out.shape == q.shape and fake_out.stride() == A._out_like(q).stride()
    assert fake_lse.shape == (1, 2, 20) and fake_lse.dtype == torch.float32


# ------------------------------------------------------------------------------ SDPA drop-in
@pytest.fixture
def no_torch_sdpa(monkeypatch):
    """Make torch's SDPA raise, so a test proves the kernel path ran and not the fallback."""
    def boom(*a, **kw):
        raise AssertionError("torch's SDPA was called")

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", boom)
    return TORCH_SDPA


@pytest.mark.parametrize("Lq,Lk,causal,gqa", [(30, 30, True, False), (37, 21, True, True), (19, 40, True, False),
                                              (25, 33, False, True)])
def test_sdpa_kernel_path_matches_torch(Lq, Lk, causal, gqa, no_torch_sdpa):
    torch_sdpa = no_torch_sdpa
    H, HK = (4, 2) if gqa else (2, 2)
    q, k, v = rand(2, H, Lq, 64), rand(2, HK, Lk, 64), rand(2, HK, Lk, 64)
    out = numasched.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)
    want = torch_sdpa(q.double(), k.double(), v.double(), is_causal=causal, enable_gqa=gqa)
    assert (out.double() - want).abs().max() < 2e-5
    assert calls() == {"kernel": 1}


def test_sdpa_three_d_and_scale(no_torch_sdpa):
    q, k, v = rand(3, 17, 64), rand(3, 22, 64), rand(3, 22, 64)
    out = numasched.scaled_dot_product_attention(q, k, v, scale=0.2)
    want = no_torch_sdpa(q.double(), k.double(), v.double(), scale=0.2)
    assert out.shape == (3, 17, 64) and (out.double() - want).abs().max() < 2e-5


def _has_decode():
    try:
        import numasched.decode  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.mark.skipif(not _has_decode(), reason="numasched.decode (Flash Decode, another helper's module) is not there")
@pytest.mark.parametrize("causal,Lk", [(False, 37), (True, 1)])
def test_sdpa_decode_path_matches_torch(causal, Lk, no_torch_sdpa):
    q, k, v = rand(2, 4, 1, 64), rand(2, 2, Lk, 64), rand(2, 2, Lk, 64)
    out = numasched.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
    want = no_torch_sdpa(q.double(), k.double(), v.double(), is_causal=causal, enable_gqa=True)
    assert out.shape == (2, 4, 1, 64) and (out.double() - want).abs().max() < 2e-5
    assert calls() == {"decode": 1}


def test_sdpa_decode_passes_views_not_copies(monkeypatch):
    import numasched.decode as D

    seen = {}
    real = D.DecodePlan._run

    def spy(self, q, k_cache, v_cache, *a, **kw):
        seen.update(q=q, k=k_cache, v=v_cache, scale=self.scale)
        return real(self, q, k_cache, v_cache, *a, **kw)

    monkeypatch.setattr(D.DecodePlan, "_run", spy)
    q, k, v = rand(2, 4, 1, 64), rand(2, 2, 9, 64), rand(2, 2, 9, 64)
    numasched.scaled_dot_product_attention(q, k, v, enable_gqa=True, scale=0.5)
    assert seen["q"].shape == (2, 4, 64) and seen["q"].data_ptr() == q.data_ptr()
    assert seen["k"].shape == (2, 9, 2, 64) and seen["k"].data_ptr() == k.data_ptr()
    assert seen["v"].data_ptr() == v.data_ptr() and seen["scale"] == 0.5


def test_sdpa_causal_single_query_many_keys_uses_prefill(no_torch_sdpa):
    # torch's top-left causal mask: a single query sees key 0 only; Flash Decode does not do that
    q, k, v = rand(1, 2, 1, 64), rand(1, 2, 12, 64), rand(1, 2, 12, 64)
    out = numasched.scaled_dot_product_attention(q, k, v, is_causal=True)
    want = no_torch_sdpa(q.double(), k.double(), v.double(), is_causal=True)
    assert (out.double() - want).abs().max() < 2e-5 and (out - v[:, :, :1]).abs().max() < 1e-6
    assert calls() == {"kernel": 1}


FALLBACKS = {
    "mask": (dict(attn_mask=torch.rand(20, 24) > 0.3), torch.float32, "attn_mask"),
    "dropout": (dict(dropout_p=0.5), torch.float32, "dropout"),
    "float64": ({}, torch.float64, "dtype"),
}


@pytest.mark.parametrize("case", sorted(FALLBACKS))
def test_sdpa_fallback_warns_once(case):
    kw, dtype, word = FALLBACKS[case]
    q, k, v = rand(1, 2, 20, 64, dtype=dtype), rand(1, 2, 24, 64, dtype=dtype), rand(1, 2, 24, 64, dtype=dtype)
    torch.manual_seed(1)
    with pytest.warns(RuntimeWarning, match=word):
        out = numasched.scaled_dot_product_attention(q, k, v, **kw)
    torch.manual_seed(1)
    want = F.scaled_dot_product_attention(q, k, v, **kw)
    assert torch.equal(out, want)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # second time: no warning
        numasched.scaled_dot_product_attention(q, k, v, **kw)
    assert calls() == {"fallback": 2}


def test_sdpa_fallback_other_reasons(monkeypatch):
    q, k, v = rand(1, 2, 9, 12), rand(1, 2, 9, 12), rand(1, 2, 9, 12)
    with pytest.warns(RuntimeWarning, match="head dims"):
        out = numasched.scaled_dot_product_attention(q, k, v)
    assert torch.allclose(out, F.scaled_dot_product_attention(q, k, v))
    q, k, v = (rand(1, 2, 9, 64).requires_grad_() for _ in range(3))
    with pytest.warns(RuntimeWarning, match="backward"):
        out = numasched.scaled_dot_product_attention(q, k, v)
    out.sum().backward()
    assert q.grad is not None
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # CPU tensors without the interpreter
    q, k, v = rand(1, 2, 9, 64), rand(1, 2, 9, 64), rand(1, 2, 9, 64)
    with pytest.warns(RuntimeWarning, match="TRITON_INTERPRET"):
        numasched.scaled_dot_product_attention(q, k, v)
    assert calls() == {"fallback": 3}


# ------------------------------------------------------------------------------ errors
def _qkv(B=1, H=4, HK=2, Lq=8, Lk=8, D=64, dtype=torch.float32):
    return rand(B, H, Lq, D, dtype=dtype), rand(B, HK, Lk, D, dtype=dtype), rand(B, HK, Lk, D, dtype=dtype)


def test_errors_name_the_argument():
    q, k, v = _qkv()
    af = A.attention_forward
    with pytest.raises(TypeError, match="key has dtype"):
        af(q, k.half(), v)
    with pytest.raises(TypeError, match="query has dtype torch.float64"):
        af(q.double(), k, v)
    with pytest.raises(ValueError, match="value is on meta"):
        af(q, k, v.to("meta"))
    with pytest.raises(ValueError, match="query must have 4 dimensions"):
        af(q[0], k, v)
    with pytest.raises(ValueError, match="not a multiple of the 3 heads of key"):
        af(q, rand(1, 3, 8, 64), rand(1, 3, 8, 64))
    with pytest.raises(ValueError, match="key has head dim 32"):
        af(q, rand(1, 2, 8, 32), rand(1, 2, 8, 32))
    with pytest.raises(ValueError, match="value has shape"):
        af(q, k, rand(1, 2, 9, 64))
    with pytest.raises(ValueError, match="key has batch 2"):
        af(q, rand(2, 2, 8, 64), rand(2, 2, 8, 64))
    with pytest.raises(ValueError, match="query head dim 12"):
        af(rand(1, 4, 8, 12), rand(1, 2, 8, 12), rand(1, 2, 8, 12))
    with pytest.raises(ValueError, match="unit stride"):
        af(q.transpose(-1, -2), k, v)
    with pytest.raises(ValueError, match="scale"):
        af(q, k, v, scale=-1.0)
    with pytest.raises(ValueError, match="unknown mapping"):
        af(q, k, v, mapping="no_such_policy")
    with pytest.raises(ValueError, match="gemm policy"):
        af(q, k, v, mapping="grouped")
    with pytest.raises(TypeError, match="mapping must be"):
        af(q, k, v, mapping=3)
    with pytest.raises(TypeError, match="causal must be a bool"):
        af(q, k, v, causal="yes")
    with pytest.raises(TypeError, match="causal must be a bool"):
        af(q, k, v, causal=1)


def test_int32_overflow_is_refused():
    # meta tensors: the shape/stride check runs before anything touches memory
    big = torch.empty_strided((1, 2, 4, 64), (2**33, 64, 2**30, 1), device="meta")
    small = torch.empty((1, 2, 4, 64), device="meta")
    with pytest.raises(ValueError, match="key spans .* overflows int32"):
        A.attention_forward(small, big, small)


def test_sdpa_errors_name_the_argument():
    q, k, v = _qkv()
    sd = numasched.scaled_dot_product_attention
    with pytest.raises(ValueError, match="unless enable_gqa=True"):
        sd(q, k, v)
    with pytest.raises(ValueError, match="not a multiple of the 3 heads of key"):
        sd(q, rand(1, 3, 8, 64), rand(1, 3, 8, 64), enable_gqa=True)
    with pytest.raises(TypeError, match="value has dtype"):
        sd(q, k, v.half(), enable_gqa=True)
    with pytest.raises(TypeError, match="key must be a torch.Tensor"):
        sd(q, None, v)
    with pytest.raises(ValueError, match="value has length"):
        sd(q, k, rand(1, 2, 9, 64), enable_gqa=True)
    with pytest.raises(TypeError, match="is_causal must be a bool"):  # torch raises TypeError too
        sd(q, k, v, is_causal=1, enable_gqa=True)
    with pytest.raises(TypeError, match="mapping must be"):
        sd(q, k, v, enable_gqa=True, mapping=2.5)


def test_sdpa_mqa_broadcasts_like_torch(no_torch_sdpa):
    # one KV head with enable_gqa=False: torch broadcasts it over the query heads; so do we
    q, k, v = rand(2, 4, 9, 64), rand(2, 1, 11, 64), rand(2, 1, 11, 64)
    out = numasched.scaled_dot_product_attention(q, k, v, is_causal=True)
    want = no_torch_sdpa(q.double(), k.double(), v.double(), is_causal=True)
    assert (out.double() - want).abs().max() < 2e-5 and calls() == {"kernel": 1}


def test_mapping_none_means_auto_everywhere(no_torch_sdpa):
    q, k, v = _qkv(H=2, HK=2)
    a, _ = A.attention_forward(q, k, v, mapping=None)
    b = numasched.scaled_dot_product_attention(q, k, v, mapping=None)
    assert torch.equal(a, b)
    d = numasched.flash_decode(q[:, :, 0], k.transpose(1, 2), v.transpose(1, 2), mapping=None)
    assert d.shape == (1, 2, 64)


# ------------------------------------------------------------------------------ GPU, real sizes
def _ref_gpu(q, k, v, causal):
    """float64 reference one KV head at a time (bounded memory at real sizes)."""
    G = q.shape[1] // k.shape[1]
    outs = [ref_attention(q[:, j * G:(j + 1) * G], k[:, j:j + 1], v[:, j:j + 1], causal)[0]
            for j in range(k.shape[1])]
    return torch.cat(outs, 1)


@pytest.mark.gpu
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("cfg", [None, K.DEFAULT_GPU_CONFIG, dict(K.DEFAULT_GPU_CONFIG, USE_TMA=False)],
                         ids=["default", "fixed-tma", "fixed-pointers"])
def test_gpu_bf16_real_sizes(D, causal, cfg):
    B, H, HK, S = 2, 32, 8, 2048 + 77  # ragged length: partial last blocks
    q, k, v = rand(B, H, S, D, dtype=torch.bfloat16), rand(B, HK, S, D, dtype=torch.bfloat16), \
        rand(B, HK, S, D, dtype=torch.bfloat16)
    out, lse = A.attention_forward(q, k, v, causal=causal, _config=cfg)
    torch.cuda.synchronize()
    assert not out.isnan().any() and not lse.isnan().any()
    ref = _ref_gpu(q, k, v, causal)
    rel = (torch.linalg.vector_norm(out.double() - ref) / torch.linalg.vector_norm(ref)).item()
    assert rel < 1e-2, rel


@pytest.mark.gpu
def test_gpu_fp32_is_ieee_and_lse():
    q, k, v = _qkv(B=1, H=8, HK=2, Lq=700, Lk=900, D=128)
    q, k, v = q.cuda(), k.cuda(), v.cuda()
    out, lse = A.attention_forward(q, k, v, causal=True, causal_offset=200)
    check(out, lse, *ref_attention(q, k, v, True, 200), torch.float32)


@pytest.mark.gpu
def test_gpu_torch_compile_and_cuda_graph():
    q, k, v = (rand(2, 16, 1024, 128, dtype=torch.bfloat16) for _ in range(3))

    def f(q, k, v):
        return numasched.scaled_dot_product_attention(q, k, v, is_causal=True) + 1

    want = F.scaled_dot_product_attention(q, k, v, is_causal=True) + 1
    eager = f(q, k, v)  # warm-up: autotuning happens here, outside capture
    cf = torch.compile(f, fullgraph=True)
    assert (cf(q, k, v).float() - want.float()).abs().max() < 3e-2
    g = torch.cuda.CUDAGraph()
    static_out = None
    with torch.cuda.graph(g):
        static_out = f(q, k, v)
    q.copy_(torch.randn_like(q))
    g.replay()
    torch.cuda.synchronize()
    want2 = F.scaled_dot_product_attention(q, k, v, is_causal=True) + 1
    assert (static_out.float() - want2.float()).abs().max() < 3e-2
    assert (eager.float() - want.float()).abs().max() < 3e-2


@pytest.mark.gpu
def test_gpu_policies_all_agree():
    q, k, v = (rand(1, 32, 1500, 128, dtype=torch.bfloat16) for _ in range(3))
    base, _ = A.attention_forward(q, k, v, causal=True, mapping="head_first")
    for name in M.available("attention"):
        out, _ = A.attention_forward(q, k, v, causal=True, mapping=name)
        assert torch.equal(out, base), name  # same work per item: bitwise equal whatever the order
