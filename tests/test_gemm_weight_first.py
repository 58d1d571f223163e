"""The weight-first decode GEMM (kernels/gemm_weight_first.py, numasched/gemm_weight_first.py).

Gluon has no interpreter: on CPU the kernel is compiled for sm_90 (in a subprocess without
TRITON_INTERPRET) and its instruction order checked (the weight boxes before the PDL wait, x's
after); correctness runs on a Hopper GPU (``-m gpu``).
"""
import os

import pytest
import torch
import triton
from hypothesis import given, settings
from hypothesis import strategies as st
import triton.language as tl
from conftest import compiled_json
from triton.language.extra.cuda import gdc_launch_dependents

from numasched.gemm_weight_first import BAND, BLOCK_K, MAX_ROWS, SMEM, config

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_COMPILE = r"""
import json
from numasched import portability as P
rows = {}
for v in ("bf16-16-split2-pdl", "bf16-16-glu-pdl", "bf16-64-split3-late", "bf16-16-split2-after",
          "bf16-16-split2-early2", "bf16-16-split2-push2", "bf16-1-split1-push4", "bf16-16-split2-reduce2",
          "bf16-16-split1-reduce4", "bf16-16-split2-scale", "bf16-16-glu-scale"):
    r = P.compile_variant("gemm_weight_first", v, "sm90", keep_asm=True)
    r["ptx"] = "\n".join(" ".join(l.split()) for l in r.pop("asm", {}).get("ptx", "").splitlines())
    rows[v] = r
print(json.dumps(rows))
"""

TMA_LOAD = "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes"


@pytest.fixture(scope="module")
def compiled():
    return compiled_json(_COMPILE, cwd=REPO)


def _loads_around_wait(ptx: str):
    """(TMA loads before griddepcontrol.wait, TMA loads after it): the instructions in the PTX's
    text, each written once (the prologue's static stages unrolled, the K loop's refill once)."""
    lines = ptx.splitlines()
    wait = next(i for i, ln in enumerate(lines) if "griddepcontrol.wait" in ln)
    return sum(TMA_LOAD in ln for ln in lines[:wait]), sum(TMA_LOAD in ln for ln in lines[wait:])


def test_compiles_for_hopper_with_wgmma_and_no_spills(compiled):
    for name, r in compiled.items():
        assert r["status"] == "ok", (name, r["error"])
        assert r["spill_bytes"] == 0 and r["fits"], name
        assert r["wgmma"] and r["tma_load"], name
        rows = 64 if name.startswith("bf16-64") else 16
        assert f"wgmma.mma_async.sync.aligned.m64n{rows}k16.f32.bf16.bf16" in r["ptx"], name
        assert r["shared_bytes"] <= SMEM + 1024, name


def test_weight_boxes_come_before_the_pdl_wait_and_x_after(compiled):
    """The point of the kernel: by default every prologue weight box is issued before
    griddepcontrol.wait and only x's boxes after it; the A/B form (EARLY 0) issues all of them
    after, EARLY 2 the first two stages' before and the rest after."""
    for name in ("bf16-16-split2-pdl", "bf16-16-glu-pdl", "bf16-64-split3-late"):
        ptx = compiled[name]["ptx"]
        stages = config(64 if "64-" in name else 16, 4096, 4096, glu="glu" in name).stages
        nw = 2 if "glu" in name else 1   # GLU: a gate and an up box a step
        before, after = _loads_around_wait(ptx)
        assert before == stages * nw, (name, before)
        assert after == stages + nw + 1, (name, after)   # x's boxes of those stages, then the loop's refill
    before, after = _loads_around_wait(compiled["bf16-16-split2-after"]["ptx"])
    assert before == 0 and after == 2 * config(16, 4096, 4096).stages + 2
    before, after = _loads_around_wait(compiled["bf16-16-split2-early2"]["ptx"])
    assert before == 2 and after == 2 * config(16, 4096, 4096).stages - 2 + 2
    # PDL 1 lets the next kernel launch before the wait; 3 after the wait, once (not in the K loop:
    # the PTX's block order puts the loop anywhere, so the count stands for its place)
    ptx = compiled["bf16-16-split2-pdl"]["ptx"].splitlines()
    assert next(i for i, ln in enumerate(ptx) if "launch_dependents" in ln) < next(
        i for i, ln in enumerate(ptx) if "griddepcontrol.wait" in ln)
    late = compiled["bf16-64-split3-late"]["ptx"].splitlines()
    assert sum("launch_dependents" in ln for ln in late) == 1
    assert next(i for i, ln in enumerate(late) if "launch_dependents" in ln) > next(
        i for i, ln in enumerate(late) if "griddepcontrol.wait" in ln)
    # split-K: a ticket per band, the last arrival's reads of the partials through L2
    assert "atom.global.gpu.acq_rel.add" in compiled["bf16-16-split2-pdl"]["ptx"]
    assert "ld.global.cg" in compiled["bf16-16-split2-pdl"]["ptx"]
    assert "ex2.approx" in compiled["bf16-16-glu-pdl"]["ptx"]   # silu's exponential


def test_push_stores_the_band_then_counts_it_on_each_peer(compiled):
    """PUSH: the band's stores (to y and to each peer), a CTA barrier, then one release add at
    system scope a peer, by one thread; nothing at system scope without PUSH."""
    for name, peers in (("bf16-16-split2-push2", 1), ("bf16-1-split1-push4", 3)):
        lines = compiled[name]["ptx"].splitlines()
        adds = [i for i, ln in enumerate(lines) if "atom.global.sys.release.add.u64" in ln]
        assert len(adds) == peers and all(lines[i].startswith("@%p") for i in adds), name
        bars = [i for i, ln in enumerate(lines) if "bar.sync" in ln]
        bar = max(i for i in bars if i < adds[0])
        before = max(i for i in bars if i < bar)
        stores = [i for i, ln in enumerate(lines) if "st.global" in ln]
        # the band's stores between the two barriers: y's and each peer's, one 16-byte store a
        # thread each (a 64 x 16 band on 128 threads, 8 consecutive columns a thread: the layout
        # conversion and the heap-offset hint), none after the barrier that orders them before the adds
        band = [lines[i] for i in stores if before < i < bar]
        assert len(band) == 1 + peers and all("st.global.v4.b32" in ln for ln in band), (name, band)
        assert not any(i > bar for i in stores), name
        # the consumer's epoch (the slot) read through L2 after the PDL wait
        wait = next(i for i, ln in enumerate(lines) if "griddepcontrol.wait" in ln)
        epoch = [i for i, ln in enumerate(lines) if "ld.global.cg.b64" in ln]
        assert len(epoch) == 1 and wait < epoch[0] < bar, name
    for name in ("bf16-16-split2-pdl", "bf16-16-glu-pdl"):
        assert ".sys." not in compiled[name]["ptx"], name
    # y's own stores are 16 bytes in every form (never one 2-byte store an element)
    for name, r in compiled.items():
        assert "st.global.b16" not in r["ptx"] and "st.global.v4.b32" in r["ptx"], name


def test_reduce_pushes_flags_then_waits_bounded_and_scale_reads_the_sums(compiled):
    """REDUCE: after the PDL wait, the band's stores to the peers, a CTA barrier, one release
    exchange at system scope a peer (the flag), then the bounded acquire poll (the global timer),
    the peers' parts through L2, and the residual's store; the last band publishes the epoch. The
    row scale: a square root of the sums, and no system-scope operation."""
    for name, peers in (("bf16-16-split2-reduce2", 1), ("bf16-16-split1-reduce4", 3)):
        lines = compiled[name]["ptx"].splitlines()
        wait = next(i for i, ln in enumerate(lines) if "griddepcontrol.wait" in ln)
        flags = [i for i, ln in enumerate(lines) if "atom.global.sys.release.exch.b64" in ln]
        assert len(flags) == peers and all(lines[i].startswith("@%p") for i in flags), name
        polls = [i for i, ln in enumerate(lines) if "ld.global.sys.acquire.b64" in ln]
        assert polls and min(polls) > max(flags) > wait, name
        bar = max(i for i, ln in enumerate(lines) if "bar.sync" in ln and i < flags[0])
        pushed = [i for i, ln in enumerate(lines) if "st.global.v4.b32" in ln and wait < i < bar]
        assert len(pushed) == peers, name   # a 16-byte store a thread a peer
        assert any("%globaltimer" in ln for ln in lines[max(flags):]), name
        assert any("ld.global.cg.v4" in ln for ln in lines[min(polls):]), name
        assert any("atom.global.gpu.release.exch.b64" in ln for ln in lines[min(polls):]), name   # the epoch
    for name in ("bf16-16-split2-scale", "bf16-16-glu-scale"):
        lines = compiled[name]["ptx"].splitlines()
        wait = next(i for i, ln in enumerate(lines) if "griddepcontrol.wait" in ln)
        roots = [i for i, ln in enumerate(lines) if "sqrt" in ln]
        # the sums the previous kernel wrote are read (and their root taken) after the PDL wait
        assert roots and min(roots) > wait, name


def test_config_fills_the_sms_once_and_fits_shared_memory():
    c = config(16, 3072, 4096)               # the TP 2 QKV projection of Llama-3-8B
    assert (c.block_t, c.bands, c.splits, c.k_per_split) == (16, 48, 2, 2048) and c.units == 96
    assert ((BAND + 16) * BLOCK_K * 2) * c.stages <= SMEM
    g = config(16, 7168, 4096, glu=True)     # its gate/up: 112 bands of gate + up rows
    assert g.splits == 1 and g.units == 112 and ((2 * BAND + 16) * BLOCK_K * 2) * g.stages <= SMEM
    assert config(1, 4096, 2048).units == 128 and config(33, 64, 4096).block_t == 64
    assert config(16, 100, 1000, sms=132).splits == 8   # K = 1000: eight steps of 128, the last partial
    assert config(16, 100, 1000, splits=3).k_per_split == 384 and config(16, 100, 1000, splits=3).splits == 3
    assert config(16, 100, 300, splits=3).splits == 3 and config(16, 100, 257, splits=3).splits == 3
    assert config(16, 64, 130, splits=2).k_per_split == 128   # two parts: 128 and the 2 left over
    for bad, match in (dict(M=65), "at most 64"), (dict(M=0), "M must"), (dict(splits=40), "splits"), \
            (dict(stages=99), "stages"), (dict(K=True), "K must"):
        kw = dict(M=16, N=256, K=4096)
        kw.update(bad)
        with pytest.raises(ValueError, match=match):
            config(kw.pop("M"), kw.pop("N"), kw.pop("K"), **kw)


@settings(max_examples=200, deadline=None)
@given(M=st.integers(1, MAX_ROWS), N=st.integers(1, 40000), K=st.integers(8, 30000), glu=st.booleans(),
       sms=st.integers(1, 304), splits=st.one_of(st.none(), st.integers(1, 64)))
def test_config_units_cover_every_k_step_once(M, N, K, glu, sms, splits):
    """The kernel's units (band = pid // SPLITS, K from (pid % SPLITS) * k_per_split, at most
    k_per_split) cover each band's K steps exactly once, no part empty; the default split count
    fills at most the SMs (or takes one part when the bands alone exceed them)."""
    iters = -(-K // BLOCK_K)
    if splits is not None and splits > iters:
        with pytest.raises(ValueError, match="splits"):
            config(M, N, K, glu=glu, sms=sms, splits=splits)
        return
    c = config(M, N, K, glu=glu, sms=sms, splits=splits)
    assert c.k_per_split % BLOCK_K == 0 and c.bands == -(-N // BAND) and c.block_t >= M
    steps = []
    for part in range(c.splits):
        k0 = part * c.k_per_split
        n_iter = -(-min(K - k0, c.k_per_split) // BLOCK_K)
        assert n_iter >= 1   # no empty part (its unit would wait for nothing and store zeros)
        steps += [k0 // BLOCK_K + i for i in range(n_iter)]
    assert steps == list(range(iters))
    if splits is None:
        assert c.units <= max(sms, c.bands)
    else:
        assert c.splits <= splits
    stage = ((2 if glu else 1) * BAND + c.block_t) * BLOCK_K * 2
    assert c.stages * stage <= SMEM


def test_early_stages():
    from numasched.gemm_weight_first import early_stages

    assert early_stages(None, 10) == 10 and early_stages(0, 10) == 0 and early_stages(3, 10) == 3
    assert early_stages(64, 10) == 10   # at most the ring's stages
    for bad in (-1, True, 2.0):
        with pytest.raises(ValueError, match="early must be"):
            early_stages(bad, 10)


def test_check_names_the_argument():
    from numasched.gemm_weight_first import check

    x = torch.zeros(4, 64, dtype=torch.bfloat16)
    w = torch.zeros(32, 64, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="x must be bf16"):
        check(x.float(), w)
    with pytest.raises(ValueError, match="w has 48 columns"):
        check(x, torch.zeros(32, 48, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="w must be row-major"):
        check(x, torch.zeros(64, 32, dtype=torch.bfloat16).t())
    with pytest.raises(ValueError, match="glu: w must hold"):
        check(x, torch.zeros(33, 64, dtype=torch.bfloat16), glu=True)
    with pytest.raises(ValueError, match="x has 65 rows"):
        check(torch.zeros(MAX_ROWS + 1, 64, dtype=torch.bfloat16), w)
    with pytest.raises(ValueError, match="out must be"):
        check(x, w, out=torch.zeros(4, 31, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="sm_90"):   # a CPU tensor: no Hopper GPU
        check(x, w)


# --------------------------------------------------------------------------- GPU (Hopper)
def _hopper():
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


def _ref(x, w, glu):
    y = x.double() @ w.double().t()
    if glu:
        n = w.shape[0] // 2
        g, u = y[:, :n], y[:, n:]
        y = g * torch.sigmoid(g) * u
    return y


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs an sm_90 GPU")
@pytest.mark.parametrize("M,N,K,glu,splits", [(1, 3072, 4096, False, None), (16, 3072, 4096, False, 1),
                                              (5, 200, 1000, False, 3), (16, 7168, 4096, True, None),
                                              (13, 136, 520, True, 2), (33, 4096, 2048, False, None),
                                              (64, 96, 4104, False, 5), (2, 64, 8, False, 1)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_matches_float64(M, N, K, glu, splits, dtype):
    """Fresh random operands, the output poisoned first, two calls (the split-K counters reset),
    against float64; odd N (a partial band), K not a multiple of 128 (a partial last box)."""
    from numasched.gemm_weight_first import WeightFirstPlan

    torch.manual_seed(M * 7 + N + K)
    x = torch.randn(M, K, device="cuda", dtype=dtype)
    w = torch.randn(2 * N if glu else N, K, device="cuda", dtype=dtype) / K ** 0.5
    plan = WeightFirstPlan(x, w, glu=glu, splits=splits)
    ref = _ref(x, w, glu)
    for _ in range(2):
        out = torch.full((M, N), float("nan"), device="cuda", dtype=dtype)
        plan.run(x, w, out)
        torch.cuda.synchronize()
        err = ((out.double() - ref).abs().max() / ref.abs().max()).item()
        assert err < 1e-2, err
    assert int(plan.counters.abs().sum()) == 0


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs an sm_90 GPU")
@pytest.mark.parametrize("world,rank,M,splits", [(2, 0, 16, 2), (2, 1, 1, None), (3, 2, 5, 1)])
def test_push_stores_each_band_in_the_peers_slot_and_counts_it(world, rank, M, splits):
    """PUSH on one GPU, the peers' heaps faked as other buffers of it (heap_bases): y against
    float64 (poisoned), every peer's receive slot ``epoch + 1 & 1``, part ``rank``, equal to y and
    the other slot untouched, and the peer's count raised by one a band, over calls that move the
    consumer's epoch (both slots); nothing written to our own heap's receive buffer."""
    from numasched.distributed import PushTarget
    from numasched.gemm_weight_first import WeightFirstPlan

    torch.manual_seed(world * 10 + rank + M)
    N, K = 200, 1000   # a partial last band and a partial last K box
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16) / K ** 0.5
    plan = WeightFirstPlan(x, w, splits=splits)
    bands = plan.cfg.bands
    recv_bytes = 2 * world * M * N * 2
    heaps = [torch.zeros(recv_bytes + 4096, device="cuda", dtype=torch.uint8) for _ in range(world)]
    bases = torch.tensor([h.data_ptr() for h in heaps], device="cuda", dtype=torch.int64)
    assert all(b % 256 == 0 for b in bases.tolist())

    def views(h):   # the same offsets in every heap: recv at 0, the counts after it
        return (h[:recv_bytes].view(torch.bfloat16).view(2, world, M, N),
                h[recv_bytes:recv_bytes + 8 * world].view(torch.int64))

    recv, pcount = views(heaps[rank])
    epoch = torch.zeros(1, device="cuda", dtype=torch.int64)
    ref = x.double() @ w.double().t()
    for call in range(3):
        for h in heaps:
            views(h)[0].fill_(float("nan"))
        out = torch.full((M, N), float("nan"), device="cuda", dtype=torch.bfloat16)
        plan.run(x, w, out, push=PushTarget(recv, pcount, epoch, bases, rank, world, bands))
        torch.cuda.synchronize()
        assert ((out.double() - ref).abs().max() / ref.abs().max()).item() < 1e-2
        slot = (call + 1) % 2
        for d in range(world):
            r, c = views(heaps[d])
            if d == rank:
                assert torch.isnan(r.float()).all() and int(c.abs().sum()) == 0
                continue
            assert torch.equal(r[slot, rank], out), (call, d)
            assert torch.isnan(r[1 - slot].float()).all() and torch.isnan(r[slot, (rank + 1) % world].float()).all()
            assert c.tolist() == [bands * (call + 1) if s == rank else 0 for s in range(world)], (call, d)
        epoch += 1   # the consumer's call of this epoch ran
    assert int(plan.counters.abs().sum()) == 0


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs an sm_90 GPU")
@pytest.mark.parametrize("M,N,K,glu,splits", [(16, 3072, 4096, False, None), (5, 200, 1000, False, 3),
                                              (16, 7168, 4096, True, None), (3, 136, 520, True, 2),
                                              (1, 64, 256, False, 1)])
def test_row_scale_matches_float64(M, N, K, glu, splits):
    """RowScale: row m of the result times 1 / sqrt(sum of sums[:, m] / K + eps), before the GLU,
    against float64 (poisoned output, two calls), with 1, 3 and 64 parts of sums (rows past M
    hold garbage the kernel must ignore)."""
    from numasched.gemm_weight_first import RowScale, WeightFirstPlan

    torch.manual_seed(M + N + K)
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(2 * N if glu else N, K, device="cuda", dtype=torch.bfloat16) / K ** 0.5
    plan = WeightFirstPlan(x, w, glu=glu, splits=splits)
    for parts in (1, 3, 64):
        sums = torch.rand(parts, plan.cfg.block_t, device="cuda") * K / parts + 0.1
        sums[:, M:] = float("nan")
        inv = torch.rsqrt(sums[:, :M].double().sum(0) / K + 1e-5)
        y = x.double() @ w.double().t()
        if glu:
            g, u = y[:, :N] * inv[:, None], y[:, N:] * inv[:, None]
            ref = g * torch.sigmoid(g) * u
        else:
            ref = y * inv[:, None]
        for _ in range(2):
            out = torch.full((M, N), float("nan"), device="cuda", dtype=torch.bfloat16)
            plan.run(x, w, out, scale=RowScale(sums, 1e-5))
            torch.cuda.synchronize()
            err = ((out.double() - ref).abs().max() / ref.abs().max()).item()
            assert err < 1e-2, (parts, err)
    with pytest.raises(ValueError, match="scale.sums"):
        plan.run(x, w, scale=RowScale(torch.zeros(2, plan.cfg.block_t + 1, device="cuda"), 1e-5))
    with pytest.raises(ValueError, match="scale.eps"):
        plan.run(x, w, scale=RowScale(torch.zeros(2, plan.cfg.block_t, device="cuda"), -1.0))


def _fake_reduce(world, rank, M, N, bands, block_t, bound_us=10**6):
    """A ReduceTarget on one GPU: every rank's heap another buffer of it (receive slots, then the
    flags), our residual, sums, epoch, exit count and status word; returns (target, heap views)."""
    from numasched.distributed import ReduceTarget

    recv_bytes = 2 * world * M * N * 2
    flag_bytes = 8 * world * bands
    heaps = [torch.zeros(recv_bytes + flag_bytes + 4096, device="cuda", dtype=torch.uint8) for _ in range(world)]
    bases = torch.tensor([h.data_ptr() for h in heaps], device="cuda", dtype=torch.int64)

    def views(h):
        return (h[:recv_bytes].view(torch.bfloat16).view(2, world, M, N),
                h[recv_bytes:recv_bytes + flag_bytes].view(torch.int64).view(world, bands))

    recv, flags = views(heaps[rank])
    res = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
    t = ReduceTarget(recv, flags, torch.full((bands, block_t), float("nan"), device="cuda"),
                     torch.zeros(1, device="cuda", dtype=torch.int64), torch.zeros(2, device="cuda", dtype=torch.int32),
                     torch.zeros(1, device="cuda", dtype=torch.int32), bound_us, bases, rank, world, res)
    return t, [views(h) for h in heaps]


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs an sm_90 GPU")
@pytest.mark.parametrize("world,rank,M,splits", [(2, 0, 16, 2), (2, 1, 1, None), (3, 2, 5, 1)])
def test_reduce_sums_the_peers_bands_into_the_residual(world, rank, M, splits):
    """REDUCE on one GPU, the peers faked (their parts and flags put in our heap before the call):
    the residual becomes residual + sum over ranks (rank order, rounded) against float64; our band
    lands in every peer's slot ``e & 1``, part ``rank``, and the peer's flag of (rank, band) holds
    e; the band's sums of squares are the new residual's; the epoch moves by one a call and the
    exit count is left zero; over three calls (both slots)."""
    from numasched.gemm_weight_first import WeightFirstPlan

    torch.manual_seed(world * 10 + rank + M)
    N, K = 200, 1000
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16) / K ** 0.5
    plan = WeightFirstPlan(x, w, splits=splits)
    c = plan.cfg
    t, heaps = _fake_reduce(world, rank, M, N, c.bands, c.block_t)
    own = x.double() @ w.double().t()
    for call in range(1, 4):
        slot = call % 2
        parts = {d: torch.randn(M, N, device="cuda", dtype=torch.bfloat16) for d in range(world) if d != rank}
        for d, p in parts.items():
            t.recv[slot, d] = p
            t.flags[d] = call
        before = t.residual.double().clone()
        assert plan.run(x, w, reduce=t) is t.residual
        torch.cuda.synchronize()
        total = sum(own if d == rank else parts[d].double() for d in range(world))
        ref = before + total
        err = ((t.residual.double() - ref).abs().max() / ref.abs().max()).item()
        assert err < 1e-2, (call, err)
        h = t.residual.double()
        want = torch.stack([(h[:, b * 64:(b + 1) * 64] ** 2).sum(1) for b in range(c.bands)])
        got = t.ss[:, :M].double()
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-6), (call, (got - want).abs().max())
        assert (t.ss[:, M:] == 0).all()
        for d in range(world):
            if d == rank:
                continue
            r, f = heaps[d]
            assert ((r[slot, rank].double() - own).abs().max() / own.abs().max()).item() < 1e-2
            assert (f[rank] == call).all(), (call, d, f)
        assert int(t.epoch) == call and int(t.xcount.abs().sum()) == 0 and int(t.status) == 0
    assert int(plan.counters.abs().sum()) == 0


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs an sm_90 GPU")
def test_reduce_wait_is_bounded_and_names_the_peer():
    """A peer that never sends: the bands' waits give up after the bound and set that peer's bit
    of the status word, not the bit of the peer that sent; the launch ends."""
    from numasched.gemm_weight_first import WeightFirstPlan

    x = torch.randn(4, 512, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(256, 512, device="cuda", dtype=torch.bfloat16)
    plan = WeightFirstPlan(x, w, splits=1)
    t, _ = _fake_reduce(3, 0, 4, 256, plan.cfg.bands, plan.cfg.block_t, bound_us=20000)
    t.flags[1] = 1     # rank 1 sent; rank 2 never does
    plan.run(x, w, reduce=t)
    torch.cuda.synchronize()
    bits = int(t.status)
    assert bits & (1 << 2) and not bits & (1 << 1), bin(bits)


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs an sm_90 GPU")
def test_thin_launch_follows_each_calls_pointers_strides_and_specialisation():
    """run's thin launch: Gluon's path on a signature's first call, then the C launcher with an
    argument list cached per (pointers, strides). Outputs of two specialisations (row stride a
    multiple of 16 and not), new x tensors and w views of another row stride (a signature each:
    tensor maps are cached by base pointer), each call checked
    against float64 with its output poisoned, several rounds (cached argument lists reused)."""
    from numasched.gemm_weight_first import WeightFirstPlan

    M, N, K = 5, 200, 1000
    torch.manual_seed(3)
    w_big = torch.randn(N, K + 24, device="cuda", dtype=torch.bfloat16) / K ** 0.5
    ws = (w_big[:, :K].contiguous(), w_big[:, :K])   # row strides K and K + 24
    x0 = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    plan = WeightFirstPlan(x0, ws[0], pdl=1)
    outs = (torch.empty(M, N, device="cuda", dtype=torch.bfloat16),              # row stride 200
            torch.empty(M, 2 * N, device="cuda", dtype=torch.bfloat16)[:, :N])   # row stride 400
    xs = [torch.randn(M, K, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
    for _ in range(3):
        for x in xs:
            for w in ws:
                for out in outs:
                    out.fill_(float("nan"))
                    plan.run(x, w, out)
                    torch.cuda.synchronize()
                    ref = _ref(x, w, False)
                    assert ((out.double() - ref).abs().max() / ref.abs().max()).item() < 1e-2
    assert len(plan._launches) == 2 * 2 and int(plan.counters.abs().sum()) == 0   # y's and w's strides
    assert 0 < len(plan._fulls) <= 3 * 2 * 2


@triton.jit
def _late_writer(src, dst, n, spin_ns, BLOCK: tl.constexpr):
    """Lets the next kernel launch at once (PDL), waits ``spin_ns``, then writes dst from src: a
    PDL-launched reader that did not wait for it would read the old dst."""
    gdc_launch_dependents()
    t0 = tl.extra.cuda.globaltimer()
    while tl.extra.cuda.globaltimer() - t0 < spin_ns:
        pass
    for i in range(0, n, BLOCK):
        offs = i + tl.arange(0, BLOCK)
        tl.store(dst + offs, tl.load(src + offs, mask=offs < n), mask=offs < n)


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs an sm_90 GPU")
@pytest.mark.parametrize("pdl,early", [(1, None), (3, None), (1, 0), (1, 2)])
def test_pdl_chain_in_a_graph_reads_the_previous_kernels_x(pdl, early):
    """Launched with PDL behind a kernel that lets it start at once and writes x 20 us later, in
    a CUDA graph replayed with new x each time: the weights may come early, x must be the new one."""
    from numasched.gemm_weight_first import WeightFirstPlan

    M, N, K = 16, 3072, 4096
    src = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    x = torch.empty_like(src)
    w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16) / K ** 0.5
    plan = WeightFirstPlan(src, w, pdl=pdl, early=early)
    out = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)

    def step():
        _late_writer[(1,)](src, x, src.numel(), 20_000, BLOCK=1024, num_warps=4)
        plan.run(x, w, out)

    step()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        step()
    for _ in range(3):
        src.copy_(torch.randn_like(src))
        out.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        ref = _ref(src, w, False)
        assert ((out.double() - ref).abs().max() / ref.abs().max()).item() < 1e-2


def test_early_option_from_the_environment():
    """options.weight_first_early: None (every stage) unless NUMASCHED_WEIGHT_FIRST_EARLY gives a
    count; a bad value names the variable or the field."""
    from numasched import options

    assert options.from_env({}).weight_first_early is None
    assert options.from_env({"NUMASCHED_WEIGHT_FIRST_EARLY": "2"}).weight_first_early == 2
    with pytest.raises(ValueError, match="NUMASCHED_WEIGHT_FIRST_EARLY"):
        options.from_env({"NUMASCHED_WEIGHT_FIRST_EARLY": "all"})
    with pytest.raises(ValueError, match="weight_first_early"):
        options.Options(weight_first_early=-1)


def test_reduce_option_from_the_environment():
    """options.weight_first_reduce: off unless NUMASCHED_WEIGHT_FIRST_REDUCE is set to anything but
    0 (the options' switches); the field itself takes a bool only."""
    from numasched import options

    assert not options.from_env({}).weight_first_reduce
    assert not options.from_env({"NUMASCHED_WEIGHT_FIRST_REDUCE": "0"}).weight_first_reduce
    assert options.from_env({"NUMASCHED_WEIGHT_FIRST_REDUCE": "1"}).weight_first_reduce
    with pytest.raises(TypeError, match="weight_first_reduce"):
        options.Options(weight_first_reduce=1)
    # the row-parallel GEMMs' K parts (an A/B knob)
    o = options.from_env({})
    assert (o.weight_first_row_splits, o.weight_first_row_splits_max_k) == (1, 2048)   # o_proj-sized K: one part
    assert options.from_env({"NUMASCHED_WEIGHT_FIRST_ROW_SPLITS": "0"}).weight_first_row_splits == 0
    for bad in ("-1", "two"):
        with pytest.raises(ValueError, match="NUMASCHED_WEIGHT_FIRST_ROW_SPLITS"):
            options.from_env({"NUMASCHED_WEIGHT_FIRST_ROW_SPLITS": bad})
    with pytest.raises(ValueError, match="weight_first_row_splits"):
        options.Options(weight_first_row_splits=-1)
    assert options.from_env({"NUMASCHED_WEIGHT_FIRST_ROW_SPLITS_MAX_K": "0"}).weight_first_row_splits_max_k == 0
    with pytest.raises(ValueError, match="NUMASCHED_WEIGHT_FIRST_ROW_SPLITS_MAX_K"):
        options.from_env({"NUMASCHED_WEIGHT_FIRST_ROW_SPLITS_MAX_K": "-1"})
    with pytest.raises(ValueError, match="weight_first_row_splits_max_k"):
        options.Options(weight_first_row_splits_max_k=-1)
