"""Property tests of the mapping policies (numasched.mappings).

Notation: W programs, X domains, round-robin dispatch: program g runs on domain (g + offset) mod X.
ACC = the work items of one (batch, kv_head), i.e. one KV group.

Proven for EVERY registered policy (parametrised over ``mappings.available()``, so a newly
registered policy is covered with no new test code) and for every composition
``compose(remap, order)`` of a registered remap with an order-only policy:
  P1 bijection: pids 0..W-1 map one-to-one onto the work items, for random grids, random
     remap/order parameters and X = 1..16;
  P2 device == reference: the Triton device functions (``device_map``, Triton interpreter on
     CPU) give the NumPy reference's work item, id for id;
  P3 balance: the work items per domain differ by at most one, for any dispatch offset;
  P4 with one domain every remap is the identity (the policy is its order alone).
Per policy, under round-robin dispatch:
  identity: g' = g.
  xcd_remap: domain x's programs, in dispatch order, get one run of consecutive logical ids
     starting at x*(W div X) + min(x, W mod X); the runs tile [0, W).
  xcd_remap_chunked (chunk C): with F = floor(W/(X*C))*X*C, each aligned chunk of C logical ids
     below F runs as C consecutive programs of one domain (chunk k*X + x on domain x); ids >= F
     map to themselves.
  head_first / block_first / row_major / grouped: equal an independent loop construction of
     the orders in mappings.md (grouped = Triton's GROUP_SIZE_M raster).
  swizzled_head_first: every ACC lies on one domain when X | B*HK; otherwise at most X-1 ACCs
     straddle domains; each domain runs its ACCs one at a time (ACC index non-decreasing in its
     dispatch order); equals the SHM paper's formula with the batch folded into the head index
     (h' = b*H + h) whenever X | B*H, i.e. the paper's formula verbatim for B = 1.
  swizzled_block_first: when X | H, domain x runs only the heads [x*H/X, (x+1)*H/X).
  chiplet_tiled (group GM): any S consecutive programs of one domain (a wave, or all of its
     programs) touch at most min(nN, ceil((S-1)/GM)+1) B-column tiles and at most
     min(nM, S, GM*(ceil((S-1)/(GM*nN))+1)) A-row tiles when GM | nM; for any nM, with
     g = min(GM, nM mod GM or GM), at most min(nN, floor((S-2)/g)+2) columns and
     GM*(floor((S-2)/(g*nN))+2) rows (S >= 2). For an MI300X-sized wave (S = 38, X = 8, GM = 8)
     on nN odd >= 38, chiplet_tiled's worst wave touches <= 22 rows+columns while row_major's
     best touches >= 39.
  chiplet_tiled_chunked (C = GM^2): when GM | nM and GM | nN, every chunk of C consecutive
     programs of one domain (below F) is exactly a GM x GM square of tiles.
Errors: bad sizes, non-integers, X < 1, heads % kv_heads, wrong grid/kernel kind, out-of-range
pids, unknown names and zero parameters raise ValueError naming them; auto/resolve/set_default/
get_default follow the rules in mappings/_registry.py. Layout: only numasched.* is importable.
"""
import math
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from numasched import mappings as M
from numasched.topology import Topology

POLICIES = M.available()
REMAPS = M.available("remap")
# order-only policies (identity remap) can take any registered remap in front of them
ORDERS = [n for n in POLICIES if M.get(n).kind != "remap" and M.get(n).remap.name == "identity"]
COMPOSED = [f"{r}+{o}" for r in REMAPS for o in ORDERS]

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: Triton interpreter (conftest.py)
FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
INTERP = settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def rr(X, offset=0):
    """A round-robin topology with X domains (only num_domains / dispatch matter here)."""
    return Topology(f"rr{X}", X, 1, 2048, 16, 128, dispatch="round_robin", dispatch_offset=offset)


def policy_of(name):
    if "+" in name:
        r, o = name.split("+")
        return M.compose(r, o)
    return M.get(name)


# ------------------------------------------------------------------------------- strategies
@st.composite
def attention_grids(draw, max_b=4, max_hk=4, max_g=4, max_nb=9):
    hk = draw(st.integers(1, max_hk))
    return M.AttentionGrid(draw(st.integers(1, max_b)), hk * draw(st.integers(1, max_g)), hk,
                           draw(st.integers(1, max_nb)))


def grids(kind, small=False):
    if kind == "attention":
        return attention_grids(max_b=2, max_nb=5) if small else attention_grids()
    if kind == "gemm":
        n = 12 if small else 40
        return st.builds(M.GemmGrid, st.integers(1, n), st.integers(1, n))
    return st.builds(M.LinearGrid, st.integers(1, 300 if small else 3000))


@st.composite
def policy_params(draw, p):
    """The policy with random remap/order parameters where its pieces take one (chunk C, GROUP_M)."""
    kw = {}
    if p.remap.default_param >= 1:
        kw["remap_param"] = draw(st.integers(1, 12))
    if p.order is not None and p.order.default_param >= 1:
        kw["order_param"] = draw(st.integers(1, 12))
    return p.with_params(**kw) if kw else p


def flat_items(p, grid, X):
    items = p.reference(np.arange(grid.size), grid, X)
    return np.ravel_multi_index(tuple(items.T), grid.item_shape)


# ------------------------------------------------------------------------------- P1-P4: every policy
def _check_bijection_and_balance(p, grid, X, offset):
    flat = flat_items(p, grid, X)
    assert np.array_equal(np.sort(flat), np.arange(grid.size)), f"{p.name} not a bijection on {grid}, X={X}"
    dom = p.domains_of_items(grid, rr(X, offset))
    assert dom.min() >= 0  # every item got a domain
    counts = np.bincount(dom.ravel(), minlength=X)
    assert counts.max() - counts.min() <= 1


@pytest.mark.parametrize("name", POLICIES + COMPOSED)
@FAST
@given(data=st.data())
def test_bijective_and_balanced(name, data):
    p = data.draw(policy_params(policy_of(name)))
    grid = data.draw(grids(p.kind))
    X = data.draw(st.integers(1, 16))
    _check_bijection_and_balance(p, grid, X, data.draw(st.integers(0, X - 1)))


@pytest.mark.parametrize("name", POLICIES + COMPOSED)
@settings(max_examples=20, deadline=None)
@given(data=st.data())
def test_one_domain_means_no_remap(name, data):
    p = data.draw(policy_params(policy_of(name)))
    grid = data.draw(grids(p.kind))
    pids = np.arange(grid.size)
    got = p.reference(pids, grid, 1)
    if p.order is None:
        assert np.array_equal(got[:, 0], pids)
    else:
        want = p.order.reference(pids, grid, 1, p.order_param)
        assert np.array_equal(got, want)


@pytest.mark.parametrize("name", POLICIES + COMPOSED)
@INTERP
@given(data=st.data())
def test_device_matches_reference(name, data):
    p = data.draw(policy_params(policy_of(name)))
    grid = data.draw(grids(p.kind, small=True))
    X = data.draw(st.sampled_from([1, 2, 3, 5, 8, 16]))
    dev = M.device_map(p, grid, X, device=DEVICE)  # poisoned with -7 before the launch
    ref = p.reference(np.arange(grid.size), grid, X)
    assert dev.shape == ref.shape
    assert np.array_equal(dev, ref), f"{p.name} device != reference on {grid}, X={X}"


def test_device_map_ran_the_kernel():
    # device_map poisons its output with -7: every slot must have been written by the kernel.
    out = M.device_map("xcd_remap", M.LinearGrid(257), 8, device=DEVICE)
    assert out.shape == (257, 1) and (out >= 0).all()


# ------------------------------------------------------------------------------- remaps
@FAST
@given(W=st.integers(1, 5000), X=st.integers(1, 16))
def test_xcd_remap_gives_each_domain_one_run(W, X):
    g = M.get("xcd_remap").reference(np.arange(W), M.LinearGrid(W), X)[:, 0]
    q, r = divmod(W, X)
    start = 0
    for x in range(X):
        run = g[x::X]  # domain x's programs, in dispatch order
        n = q + (x < r)
        assert len(run) == n
        assert np.array_equal(run, start + np.arange(n))
        assert start == x * q + min(x, r)
        start += n
    assert start == W


@FAST
@given(W=st.integers(1, 5000), X=st.integers(1, 16), C=st.integers(1, 40))
def test_xcd_remap_chunked_runs_and_tail(W, X, C):
    p = M.get("xcd_remap_chunked").with_params(remap_param=C)
    g = p.reference(np.arange(W), M.LinearGrid(W), X)[:, 0]
    F = (W // (X * C)) * (X * C)
    pids = np.arange(W)
    assert np.array_equal(g[F:], pids[F:])  # identity on the tail
    inv = np.argsort(g)[:F]  # program running logical id L
    L = np.arange(F)
    k, x, i = L // (X * C), (L % (X * C)) // C, L % C
    # chunk k*X + x runs on domain x as C consecutive programs of that domain
    assert np.array_equal(inv, (k * C + i) * X + x)


# ------------------------------------------------------------------------------- orders, independently
def _loop_order(name, grid, GM=None):
    if name in ("head_first", "block_first"):
        B, H, HK, NB = grid.dims
        if name == "head_first":
            return [(b, h, m) for b in range(B) for h in range(H) for m in range(NB)]
        return [(b, h, m) for b in range(B) for m in range(NB) for h in range(H)]
    nM, nN = grid.dims
    if name == "row_major":
        return [(i, j) for i in range(nM) for j in range(nN)]
    out = []  # grouped: bands of GM tile rows, each walked column by column
    for first in range(0, nM, GM):
        for j in range(nN):
            out.extend((i, j) for i in range(first, min(first + GM, nM)))
    return out


@pytest.mark.parametrize("name", ["head_first", "block_first", "row_major", "grouped"])
@settings(max_examples=25, deadline=None)
@given(data=st.data())
def test_plain_orders_match_loop_construction(name, data):
    p = data.draw(policy_params(M.get(name)))
    grid = data.draw(grids(p.kind))
    X = data.draw(st.integers(1, 16))
    got = p.reference(np.arange(grid.size), grid, X)
    assert np.array_equal(got, np.array(_loop_order(name, grid, p.order_param)))


# ------------------------------------------------------------------------------- attention locality
def _acc_domains(grid, dom):
    """Set of domains of each ACC: dom is shaped (B, H, NB)."""
    B, H, HK, NB = grid.dims
    G = grid.group
    per_acc = dom.reshape(B, HK, G * NB)  # heads of a KV group are h = kv*G .. kv*G+G-1
    return [set(np.unique(a)) for a in per_acc.reshape(B * HK, -1)]


@FAST
@given(grid=attention_grids(max_b=6, max_hk=8), X=st.integers(1, 16), data=st.data())
def test_swizzled_head_first_keeps_kv_groups_whole(grid, X, data):
    p = M.get("swizzled_head_first")
    offset = data.draw(st.integers(0, X - 1))
    dom = p.domains_of_items(grid, rr(X, offset))
    accs = _acc_domains(grid, dom)
    straddling = sum(len(s) > 1 for s in accs)
    n_acc = grid.batch * grid.kv_heads
    if n_acc % X == 0:
        assert straddling == 0
    else:
        assert straddling <= X - 1
    # each domain runs its ACCs one at a time: ACC index never goes back in its dispatch order
    items = p.reference(np.arange(grid.size), grid, X)
    acc = items[:, 0] * grid.kv_heads + items[:, 1] // grid.group
    for x in range(X):
        seq = acc[(np.arange(grid.size) + offset) % X == x]
        assert np.all(np.diff(seq) >= 0)


def _shm_paper(g, B, H, NB, X):
    """SHM paper's swizzled head-first (mappings.md), needs X | H."""
    b, g0 = g // (H * NB), g % (H * NB)
    x = g0 % X
    k = g0 // (X * NB)
    m = (g0 % (X * NB)) // X
    return np.stack([b, x * (H // X) + k, m], axis=1)


@FAST
@given(B=st.integers(1, 6), hk=st.integers(1, 8), G=st.integers(1, 4), NB=st.integers(1, 9), data=st.data())
def test_swizzled_head_first_is_shm_with_batch_folded_into_heads(B, hk, G, NB, data):
    H = hk * G
    X = data.draw(st.sampled_from([d for d in range(1, 17) if (B * H) % d == 0]))
    grid = M.AttentionGrid(B, H, hk, NB)
    g = np.arange(grid.size)
    got = M.get("swizzled_head_first").reference(g, grid, X)
    folded = _shm_paper(g, 1, B * H, NB, X)  # one batch of B*H heads, h' = b*H + h
    want = np.stack([folded[:, 1] // H, folded[:, 1] % H, folded[:, 2]], axis=1)
    assert np.array_equal(got, want)
    if B == 1:  # the paper's formula verbatim
        assert np.array_equal(got, _shm_paper(g, B, H, NB, X))


def test_per_batch_shm_would_split_gqa_groups():
    # Why the batch is folded into the heads: H=8, HK=2 (G=4), B=4, X=8. X | B*HK, so every
    # KV group can stay on one domain (ours does); SHM applied per batch puts one query head per
    # domain and so spreads every group over 4 domains.
    B, H, HK, NB, X = 4, 8, 2, 3, 8
    grid = M.AttentionGrid(B, H, HK, NB)
    ours = _acc_domains(grid, M.get("swizzled_head_first").domains_of_items(grid, rr(X)))
    assert all(len(s) == 1 for s in ours)
    g = np.arange(grid.size)
    items = _shm_paper(g, B, H, NB, X)
    dom = np.full(grid.item_shape, -1)
    dom[tuple(items.T)] = g % X
    assert all(len(s) == 4 for s in _acc_domains(grid, dom))


@FAST
@given(B=st.integers(1, 4), X=st.integers(1, 16), k=st.integers(1, 3), NB=st.integers(1, 9), data=st.data())
def test_swizzled_block_first_owns_head_bands(B, X, k, NB, data):
    H = X * k
    hk = data.draw(st.sampled_from([d for d in range(1, H + 1) if H % d == 0]))
    grid = M.AttentionGrid(B, H, hk, NB)
    dom = M.get("swizzled_block_first").domains_of_items(grid, rr(X))
    band = np.arange(H) // k  # head h belongs to band h div (H/X)
    assert np.array_equal(dom, np.broadcast_to(band[None, :, None], dom.shape))


# ------------------------------------------------------------------------------- gemm locality
def _window_distinct(seq, S):
    """Distinct values in every window of S consecutive entries of seq (S clipped to len)."""
    S = min(S, len(seq))
    w = np.sort(np.lib.stride_tricks.sliding_window_view(seq, S), axis=1)
    return 1 + (np.diff(w, axis=1) != 0).sum(axis=1)


def _domain_windows(p, grid, X, S):
    """(rows, cols) distinct counts of every S-window of every domain's programs."""
    items = p.reference(np.arange(grid.size), grid, X)
    out = []
    for x in range(min(X, grid.size)):
        t = items[x::X]
        out.append((_window_distinct(t[:, 0], S), _window_distinct(t[:, 1], S), len(t)))
    return out


@settings(max_examples=80, deadline=None)
@given(GM=st.integers(1, 8), bands=st.integers(1, 8), rem=st.integers(0, 7), nN=st.integers(1, 48),
       X=st.integers(1, 16), S=st.integers(1, 80))
def test_chiplet_tiled_windows_are_compact(GM, bands, rem, nN, X, S):
    rem = rem % GM
    nM = GM * bands + rem
    grid = M.GemmGrid(nM, nN)
    p = M.get("chiplet_tiled").with_params(order_param=GM)
    for rows, cols, n in _domain_windows(p, grid, X, S):
        s = min(S, n)
        if rem == 0:
            assert cols.max() <= min(nN, -(-(s - 1) // GM) + 1)
            assert rows.max() <= min(nM, s, GM * (-(-(s - 1) // (GM * nN)) + 1))
        elif s >= 2:
            g = min(GM, rem)
            assert cols.max() <= min(nN, (s - 2) // g + 2)
            assert rows.max() <= min(nM, s, GM * ((s - 2) // (g * nN) + 2))


@pytest.mark.parametrize("nN", [39, 45, 51, 63])
@pytest.mark.parametrize("nM", [16, 40, 64])
def test_chiplet_tiled_beats_row_major_per_wave(nM, nN):
    # MI300X: X = 8 XCDs of 38 CUs, GROUP_M = 8; nN odd so row_major's wave hits 38 columns.
    X, S = 8, 38
    grid = M.GemmGrid(nM, nN)
    chip = max((r + c).max() for r, c, _ in _domain_windows(M.get("chiplet_tiled"), grid, X, S))
    row = min((r + c).min() for r, c, _ in _domain_windows(M.get("row_major"), grid, X, S))
    assert chip <= 2 * 8 + math.ceil((S - 1) / 8) + 1 == 22
    assert row >= S + 1
    assert chip < row


@settings(max_examples=40, deadline=None)
@given(GM=st.integers(1, 6), a=st.integers(1, 8), b=st.integers(1, 8), X=st.integers(1, 16))
def test_chiplet_tiled_chunked_runs_squares(GM, a, b, X):
    grid = M.GemmGrid(GM * a, GM * b)
    p = M.get("chiplet_tiled_chunked").with_params(remap_param=GM * GM, order_param=GM)
    C, W = GM * GM, grid.size
    F = (W // (X * C)) * (X * C)
    items = p.reference(np.arange(F), grid, X)
    pid = np.arange(F)
    key = (pid // X) // C * X + pid % X  # (chunk round, domain): C consecutive programs of a domain
    for k in np.unique(key):
        t = items[key == k]
        assert len(t) == C
        assert len(np.unique(t[:, 0])) == GM and len(np.unique(t[:, 1])) == GM
        assert t[:, 0].max() - t[:, 0].min() == GM - 1 and t[:, 1].max() - t[:, 1].min() == GM - 1


# ------------------------------------------------------------------------------- errors
@pytest.mark.parametrize("make, word", [
    (lambda: M.AttentionGrid(0, 2, 2, 2), "batch"),
    (lambda: M.AttentionGrid(1, -2, 2, 2), "heads"),
    (lambda: M.AttentionGrid(1, 2, 2, 1.5), "q_blocks"),
    (lambda: M.AttentionGrid(1, 2, "2", 2), "kv_heads"),
    (lambda: M.AttentionGrid(True, 2, 2, 2), "batch"),
    (lambda: M.AttentionGrid(1, 6, 4, 2), "kv_heads"),
    (lambda: M.DecodeGrid(1, 0, 4), "kv_heads"),
    (lambda: M.DecodeGrid(1, 2, 0), "splits"),
    (lambda: M.GemmGrid(0, 3), "tiles_m"),
    (lambda: M.GemmGrid(3, 2.0), "tiles_n"),
    (lambda: M.LinearGrid(-1), "size"),
    (lambda: M.AttentionGrid(2**16, 2**16, 1, 1), "int32"),
])
def test_bad_grids(make, word):
    with pytest.raises(ValueError, match=word):
        make()


@pytest.mark.parametrize("X", [0, -3, 2.0, True, "8"])
def test_bad_num_domains(X):
    p, grid = M.get("swizzled_head_first"), M.AttentionGrid(1, 2, 2, 2)
    for call in (lambda: p.reference([0], grid, X), lambda: p.kernel_args(X), lambda: M.device_map(p, grid, X)):
        with pytest.raises(ValueError, match="num_domains"):
            call()


@pytest.mark.parametrize("pids", [[-1], [8], [0.5, 1.0], np.array([1.0]), ["a"], [True]])
def test_bad_pids(pids):
    with pytest.raises(ValueError, match="pids"):
        M.get("head_first").reference(pids, M.AttentionGrid(1, 2, 2, 4), 2)


@pytest.mark.parametrize("name", POLICIES)
def test_wrong_grid_kind(name):
    p = M.get(name)
    wrong = M.GemmGrid(2, 2) if p.kind != "gemm" else M.AttentionGrid(1, 2, 2, 2)
    with pytest.raises(ValueError, match=name):
        p.reference([0], wrong, 2)
    with pytest.raises(ValueError, match=name):
        M.device_map(p, wrong, 2)


def test_unknown_names():
    with pytest.raises(ValueError, match="no_such"):
        M.get("no_such")
    with pytest.raises(ValueError, match="no_such"):
        M.compose("no_such", "head_first")
    with pytest.raises(ValueError, match="no_such"):
        M.resolve("no_such", "attention", rr(8), M.AttentionGrid(1, 2, 2, 2))
    with pytest.raises(ValueError, match="no_such"):
        M.set_default("attention", "no_such")
    with pytest.raises(ValueError, match="bogus"):
        M.available("bogus")
    with pytest.raises(ValueError, match="bogus"):
        M.resolve("auto", "bogus", rr(8), M.AttentionGrid(1, 2, 2, 2))
    with pytest.raises(ValueError, match="bogus"):
        M.get_default("bogus")
    with pytest.raises(TypeError, match="mapping"):  # a wrong type is a TypeError in every call
        M.get(3)


def test_bad_parameters_and_compositions():
    with pytest.raises(ValueError, match="remap_param"):
        M.get("xcd_remap_chunked").with_params(remap_param=0)
    with pytest.raises(ValueError, match="order_param"):
        M.get("grouped").with_params(order_param=-1)
    chunked = M.get("xcd_remap_chunked")
    with pytest.raises(ValueError, match="remap_param"):
        M.Policy("bad", "remap", chunked.remap, remap_param=0)  # would divide by zero in the kernel
    with pytest.raises(ValueError, match="order_param"):
        M.Policy("bad", "gemm", chunked.remap, M.get("grouped").order, remap_param=4, order_param=0)
    with pytest.raises(ValueError, match="remap"):
        M.compose("head_first", "grouped")
    with pytest.raises(ValueError, match="xcd_remap"):
        M.compose("xcd_remap", "xcd_remap_chunked")
    with pytest.raises(ValueError, match="swizzled_head_first"):
        M.compose("xcd_remap", "swizzled_head_first")  # already has a remap
    with pytest.raises(ValueError, match="already registered"):
        M.register(M.get("head_first"))


# ------------------------------------------------------------------------------- auto / resolve / defaults
@pytest.fixture
def clean_defaults():
    saved = {k: M.get_default(k) for k in M.KERNEL_KINDS}
    for k in M.KERNEL_KINDS:
        M.set_default(k, None)
    yield
    for k, v in saved.items():
        M.set_default(k, v)


ATT, GEMM, DEC = M.AttentionGrid(2, 8, 2, 4), M.GemmGrid(8, 8), M.DecodeGrid(2, 8, 4)


@pytest.mark.parametrize("topo", ["h100", "h200", "generic"])
@pytest.mark.parametrize("causal", [False, True])
def test_auto_single_domain(topo, causal, clean_defaults):
    t = Topology.preset(topo)
    assert M.resolve("auto", "attention", t, ATT, causal=causal).name == "head_first"
    assert M.resolve(None, "decode", t, DEC, causal=causal).name == "head_first"
    assert M.resolve("auto", "gemm", t, GEMM).name == "grouped"


@pytest.mark.parametrize("topo", ["mi300x", "mi325x", "mi350x", "mi355x"])
def test_auto_amd(topo, clean_defaults):
    t = Topology.preset(topo)
    assert M.resolve("auto", "attention", t, ATT).name == "swizzled_head_first"
    assert M.resolve("auto", "attention", t, ATT, causal=True).name == "head_first"  # causal prefill
    assert M.resolve("auto", "prefill", t, ATT, causal=True).name == "head_first"
    assert M.resolve("auto", "decode", t, DEC, causal=True).name == "swizzled_head_first"
    assert M.resolve("auto", "gemm", t, GEMM).name == "chiplet_tiled"
    assert M.auto("gemm", t, GEMM).name == "chiplet_tiled"


def test_resolve_kinds_and_defaults(clean_defaults):
    t = Topology.preset("mi300x")
    assert M.resolve("block_first", "attention", t, ATT).name == "block_first"
    assert M.resolve(M.get("row_major"), "gemm", t, GEMM).name == "row_major"
    with pytest.raises(ValueError, match="chiplet_tiled"):
        M.resolve("chiplet_tiled", "attention", t, ATT)  # a gemm policy for an attention kernel
    with pytest.raises(ValueError, match="swizzled_head_first"):
        M.resolve("swizzled_head_first", "gemm", t, GEMM)
    with pytest.raises(ValueError, match="GemmGrid"):
        M.resolve("auto", "attention", t, GEMM)  # grid of the wrong kind
    with pytest.raises(TypeError, match="mapping"):
        M.resolve(3, "attention", t, ATT)
    with pytest.raises(ValueError, match="grouped"):
        M.set_default("attention", "grouped")
    with pytest.raises(ValueError, match="kernel_kind"):
        M.set_default("prefill", "head_first")
    assert M.get_default("attention") == "auto"
    M.set_default("attention", "block_first")
    assert M.get_default("attention") == "block_first"
    assert M.resolve("auto", "attention", t, ATT).name == "block_first"
    assert M.resolve("head_first", "attention", t, ATT).name == "head_first"  # explicit beats default
    assert M.resolve("auto", "decode", t, DEC).name == "swizzled_head_first"  # other kinds untouched
    comp = M.compose("xcd_remap_chunked", "grouped")  # not registered: a default all the same
    M.set_default("gemm", comp)
    assert M.resolve("auto", "gemm", t, GEMM) is comp
    M.set_default("attention", "auto")
    assert M.get_default("attention") == "auto"
    assert M.resolve("auto", "attention", t, ATT).name == "swizzled_head_first"


# ------------------------------------------------------------------------------- packaging
def test_installed_layout():
    # Run from /tmp so the repo root (with its mappings/ and kernels/ folders) is not on sys.path.
    code = ("import importlib.util as u, numasched.mappings, numasched.kernels;"
            "print([u.find_spec(n) for n in ('mappings', 'kernels', 'bench')])")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run([sys.executable, "-c", code], cwd="/tmp", env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[None, None, None]"


# ------------------------------------------------------------------------------ split-K work units
import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from numasched.caps import run_interpreted  # noqa: E402
from numasched.mappings import split_units_reference  # noqa: E402
from numasched.mappings.jit import gemm_split_unit  # noqa: E402


@triton.jit
def _split_units_kernel(OUT, W, NM, NN, S, MAPPING: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = pid < W
    tm, tn, sp = gemm_split_unit(pid, NM, NN, S, MAPPING)
    tl.store(OUT + pid * 3, tm, mask=m)
    tl.store(OUT + pid * 3 + 1, tn, mask=m)
    tl.store(OUT + pid * 3 + 2, sp, mask=m)

@pytest.mark.parametrize("name", [n for n in POLICIES if M.get(n).kind == "gemm"] + [
    c for c in COMPOSED if M.get(c.split("+")[1]).kind == "gemm"])
def test_split_units_are_a_bijection_and_the_device_agrees(name):
    pol = M.get(name) if "+" not in name else M.compose(*name.split("+"))

    for (nm, nn), S, X in [((3, 5), 4, 8), ((1, 7), 3, 1), ((4, 4), 1, 8), ((2, 9), 5, 3)]:
        grid = M.GemmGrid(nm, nn)
        W = grid.size * S
        ref = split_units_reference(pol, np.arange(W), grid, S, X)
        assert len({tuple(r) for r in ref}) == W, "not a bijection onto (tile_m, tile_n, split)"
        assert ref[:, 0].max() < nm and ref[:, 1].max() < nn and ref[:, 2].max() < S
        out = torch.full((W, 3), -7, dtype=torch.int32)
        run_interpreted(_split_units_kernel, (triton.cdiv(W, 64),), (out, W, nm, nn, S),
                        dict(MAPPING=pol.constexpr(X), BLOCK=64))
        assert (out.numpy() == ref).all()
        if X > 1 and pol.remap.name == "xcd_remap":
            # the contiguous remap keeps a tile's splits on one domain when X divides the units
            dom = np.arange(W) % X
            for t in {tuple(r[:2]) for r in ref}:
                owners = {dom[i] for i in range(W) if tuple(ref[i, :2]) == t}
                if W % X == 0:
                    assert len(owners) <= 2


def test_register_refuses_broken_or_non_bijective_policies():
    """Found by an audit (sixty-first session): a Remap without its functions, an order given by
    name and a remap sending every id to 0 were accepted and failed (or ran items twice) later."""
    ident, grouped = M.get("identity"), M.get("grouped")
    with pytest.raises(ValueError, match="reference must be a NumPy function"):
        M.Remap("no_fns", None, None)
    with pytest.raises(ValueError, match="device .* is missing"):
        M.Remap("no_device", lambda g, W, X, p: g, None)
    with pytest.raises(ValueError, match="order must be an Order"):
        M.Policy("p1", "gemm", ident.remap, "grouped")
    zero = M.Policy("all_zero_t", "remap", M.Remap("all_zero", lambda g, W, X, p: g * 0, ident.remap.device))
    with pytest.raises(ValueError, match="not a bijection"):
        M.register(zero)
    flat = M.Policy("flat_t", "gemm", ident.remap, M.Order("flat", "gemm", lambda g, grid, X, p: g,
                                                           grouped.order.device))
    with pytest.raises(ValueError, match="its reference failed"):
        M.register(flat)
    assert "all_zero_t" not in M.available() and "flat_t" not in M.available()
