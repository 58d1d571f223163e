"""The plan cache of numasched.attention: repeated eager calls reuse checks and launch plans."""
import torch

import numasched.attention as A
from numasched import mappings as M, observe, topology
from numasched._plan import PLANS


def _ref(q, k, v, causal):
    return torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=causal)


def test_cached_plan_fresh_data_and_no_custom_op(monkeypatch):
    def boom(*a, **k):
        raise AssertionError("eager call went through the custom op")

    monkeypatch.setattr(A, "_attention_forward_op", boom)
    PLANS.clear()
    with observe.record(poison=True) as log:
        for causal in (False, True):
            for _ in range(2):  # second call: plan hit, fresh random data must still be right
                q, k, v = (torch.randn(1, 2, 20, 16) for _ in range(3))
                before = log.count("attention")
                out, _ = A.attention_forward(q, k, v, causal=causal)
                assert log.count("attention") == before + 1
                torch.testing.assert_close(out.double(), _ref(q, k, v, causal), rtol=1e-5, atol=1e-5)
    assert len(PLANS.plans("attention")) == 2 and PLANS.hits >= 2


def test_plan_not_reused_across_mapping_topology_or_bad_input():
    q, k, v = (torch.randn(1, 2, 20, 16) for _ in range(3))
    PLANS.clear()
    A.attention_forward(q, k, v)
    with topology.use("mi300x"):
        A.attention_forward(q, k, v)
    A.attention_forward(q, k, v, mapping="head_first")
    assert len(PLANS.plans("attention")) == 3
    try:  # same shapes, a dtype mismatch: the checks must still run
        A.attention_forward(q, k.half(), v)
    except TypeError as e:
        assert "key" in str(e)
    else:
        raise AssertionError("dtype mismatch not caught")


def test_plan_follows_a_replaced_registration():
    # register(..., replace=True) swaps the policy behind a name: a cached plan must not keep
    # launching the old one (the key holds the registry's version).
    q, k, v = (torch.randn(1, 2, 20, 16) for _ in range(3))
    PLANS.clear()
    name = "test_attn_plans_replaced"
    try:
        first = M.register(M.compose("identity", "head_first", name=name))
        with observe.record() as log:
            A.attention_forward(q, k, v, mapping=name)
        assert log[-1].plan.policy is first
        second = M.register(M.compose("identity", "block_first", name=name), replace=True)
        with observe.record() as log:
            out, _ = A.attention_forward(q, k, v, mapping=name)
        assert log[-1].plan.policy is second
        torch.testing.assert_close(out.double(), _ref(q, k, v, False), rtol=1e-5, atol=1e-5)
    finally:
        M._registry._REGISTRY.pop(name, None)


def test_empty_batch_or_heads_give_empty_outputs():
    # torch returns empty outputs for batch 0 / heads 0; the kernel call raised (grid of size 0)
    for B, H in ((0, 2), (1, 0)):
        q, k, v = (torch.randn(B, H, 20, 16) for _ in range(3))
        for _ in range(2):  # and again through the plan cache
            out, lse = A.attention_forward(q, k, v, causal=True)
            assert out.shape == (B, H, 20, 16) and lse.shape == (B, H, 20)


def test_first_call_before_the_topology_is_known_is_cached_under_its_later_key(monkeypatch):
    """With no topology set or detected yet (a fresh process), an op's first eager call plans it
    and its second hits that plan: the key holds the resolved topology, not the unset setting
    (which the first plan's detection changes). Attention, decode, GEMM and the SwiGLU GEMM."""
    import numasched

    q, k, v = (torch.randn(1, 2, 20, 16) for _ in range(3))
    qd, kd, vd = torch.randn(2, 4, 16), torch.randn(2, 24, 2, 16), torch.randn(2, 24, 2, 16)
    a, b, b2 = torch.randn(8, 32), torch.randn(32, 16), torch.randn(32, 16)
    calls = {"attention": lambda: A.attention_forward(q, k, v),
             "flash_decode": lambda: numasched.flash_decode(qd, kd, vd),
             "matmul": lambda: numasched.matmul(a, b),
             "matmul_swiglu": lambda: numasched.matmul_swiglu(a, torch.cat([b, b2], 1))}
    for op, call in calls.items():
        monkeypatch.setattr(topology, "_CURRENT", None)
        PLANS.clear()
        for _ in range(2):
            call()
        assert len(PLANS) == 1 and PLANS.hits >= 1, (op, len(PLANS), PLANS.hits)
