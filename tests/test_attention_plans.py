"""The plan cache of numasched.attention: repeated eager calls reuse checks and launch plans."""
import torch

import numasched.attention as A
from numasched import topology


def _ref(q, k, v, causal):
    return torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=causal)


def test_cached_plan_fresh_data_and_no_custom_op(monkeypatch):
    def boom(*a, **k):
        raise AssertionError("eager call went through the custom op")

    monkeypatch.setattr(A, "_attention_forward_op", boom)
    A._PLANS.clear()
    for causal in (False, True):
        for _ in range(2):  # second call: plan hit, fresh random data must still be right
            q, k, v = (torch.randn(1, 2, 20, 16) for _ in range(3))
            before = A.calls["kernel"]
            out, _ = A.attention_forward(q, k, v, causal=causal)
            assert A.calls["kernel"] == before + 1
            torch.testing.assert_close(out.double(), _ref(q, k, v, causal), rtol=1e-5, atol=1e-5)
    assert len(A._PLANS) == 2


def test_plan_not_reused_across_mapping_topology_or_bad_input():
    q, k, v = (torch.randn(1, 2, 20, 16) for _ in range(3))
    A._PLANS.clear()
    A.attention_forward(q, k, v)
    with topology.use("mi300x"):
        A.attention_forward(q, k, v)
    A.attention_forward(q, k, v, mapping="head_first")
    assert len(A._PLANS) == 3
    try:  # same shapes, a dtype mismatch: the checks must still run
        A.attention_forward(q, k.half(), v)
    except TypeError as e:
        assert "key" in str(e)
    else:
        raise AssertionError("dtype mismatch not caught")
