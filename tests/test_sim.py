"""numasched.sim: the fast tile-level simulator against a line-by-line brute force, plus checks
with answers known by hand, an ordering claim on MI300X, the CLI and argument errors.

All CPU, no Triton: the whole file takes well under a minute.
"""
import json

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from numasched import mappings as M
from numasched import sim
from numasched.sim.bruteforce import simulate_lines
from numasched.sim.lru import LRUBank, lru_reference
from numasched.topology import Topology

LINE = 128


def tiny_topology(domains=4, cus=2, sets=8, ways=4, llc_sets=32, llc_ways=4, dispatch="round_robin", offset=0,
                  chunk=1):
    table = tuple(d for d in range(domains) for _ in range(chunk)) if dispatch == "table" else ()
    return Topology("tiny", domains, cus, sets * ways * LINE, ways, LINE, llc_sets * llc_ways * LINE,
                    1e12, dispatch, offset % domains, table, l2_bw_bytes_per_s=1e12, llc_bw_bytes_per_s=2e12)


# ----------------------------------------------------------------------------------- the LRU engine
@settings(max_examples=40, deadline=None)
@given(st.integers(1, 5), st.integers(1, 9), st.integers(1, 40), st.integers(1, 1500), st.integers(1, 40),
       st.integers(1, 12), st.integers(0, 2**31 - 1), st.booleans())
def test_lru_bank_matches_plain_lru(lanes, ways, nkeys, n, seg, warm, seed, sticky):
    """Rows with short warm-ups, chunked feeding and repeated keys give exactly the plain LRU answer."""
    rng = np.random.default_rng(seed)
    lane = rng.integers(0, lanes, n)
    key = rng.integers(0, nkeys, n)
    if sticky:  # long runs of one key (the duplicate-removal path)
        key = np.repeat(rng.integers(0, nkeys, n // 4 + 1), 4)[:n]
    bank = LRUBank(lanes, ways, seg=seg, warm=warm)
    parts = np.split(np.arange(n), np.sort(rng.integers(0, n, 3)))
    got = np.concatenate([bank.access(lane[p], key[p]) for p in parts])
    want = np.zeros(n, dtype=bool)
    for l in range(lanes):
        idx = np.flatnonzero(lane == l)
        want[idx] = lru_reference(key[idx].tolist(), ways)
    assert (got == want).all()


# ----------------------------------------------------------------------------------- brute force
def _model(draw):
    kind = draw(st.sampled_from(["attention", "decode", "gemm"]))
    if kind == "attention":
        kvh = draw(st.integers(1, 3))
        return sim.AttentionModel(draw(st.integers(1, 2)), kvh * draw(st.sampled_from([1, 2])), kvh,
                                  draw(st.integers(16, 160)), draw(st.integers(16, 160)),
                                  draw(st.sampled_from([16, 40, 64])), draw(st.sampled_from([16, 32])),
                                  draw(st.sampled_from([8, 16])), draw(st.booleans()), 2)
    if kind == "decode":
        kvh = draw(st.integers(1, 3))
        return sim.DecodeModel(draw(st.integers(1, 2)), kvh * draw(st.sampled_from([1, 4])), kvh,
                               draw(st.integers(30, 400)), draw(st.sampled_from([32, 64])),
                               draw(st.integers(1, 6)), draw(st.sampled_from([16, 32])), 2)
    return sim.GemmModel(draw(st.integers(16, 200)), 64 * draw(st.integers(1, 4)), 64 * draw(st.integers(1, 5)),
                         draw(st.sampled_from([32, 64])), draw(st.sampled_from([64, 128])), 64, 2)


@st.composite
def cases(draw):
    model = _model(draw)
    kind = "gemm" if model.kind == "gemm" else "attention"
    policy = draw(st.sampled_from(M.available(kind)))
    topo = tiny_topology(domains=draw(st.integers(1, 4)), cus=draw(st.integers(1, 3)),
                         sets=draw(st.sampled_from([4, 8, 16])), ways=draw(st.sampled_from([2, 4, 8])),
                         llc_sets=draw(st.sampled_from([0, 16, 64])), llc_ways=4,
                         # round-robin with an offset, or chunked dispatch written as a table
                         dispatch=draw(st.sampled_from(["round_robin", "table"])), offset=draw(st.integers(0, 3)),
                         chunk=draw(st.integers(1, 3)))
    return (topo, model, policy, draw(st.integers(1, 2)), draw(st.sampled_from([0.0, 0.0, 0.1])),
            draw(st.sampled_from(["xor", "none"])), draw(st.integers(0, 3)), draw(st.sampled_from([0, 0, 3])))


def _compare(topo, model, policy, occ, jitter, set_hash, seed, skew=0):
    fast = sim.simulate(topo, model, policy, occupancy=occ, llc_ways=4, jitter=jitter, set_hash=set_hash,
                        seed=seed, skew=skew, peak_flops=0)
    ref = simulate_lines(topo, model, M.get(policy), occupancy=occ, llc_ways=4, jitter=jitter, seed=seed,
                         skew=skew, set_hash=set_hash)
    req = np.array(ref["requested_lines"])
    hit2 = np.array(ref["l2_hit_lines"])
    # the claim is "agrees within 0.5 percentage points"; the method is exact, so counts must match
    assert abs(fast.l2_hit_rate - hit2.sum() / req.sum()) <= 0.005
    for d in range(topo.num_domains):
        if req[d]:
            assert abs(fast.l2_hit_rate_per_domain[d] - hit2[d] / req[d]) <= 0.005
    assert fast.requested_bytes == req.sum() * LINE
    assert fast.requested_bytes_per_domain == [int(x) * LINE for x in req]
    assert fast.l2_bytes == hit2.sum() * LINE
    assert fast.llc_bytes == sum(ref["llc_hit_lines"]) * LINE
    assert fast.hbm_bytes == ref["hbm_lines"] * LINE
    return fast


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_matches_line_level_brute_force(case):
    _compare(*case)


@pytest.mark.parametrize("policy,causal,occ,llc", [
    ("swizzled_head_first", False, 1, True),
    ("head_first", True, 2, False),
    ("block_first", True, 1, True),
    ("swizzled_block_first", False, 2, True),
])
def test_brute_force_named_cases(policy, causal, occ, llc):
    """Several policies, with and without LLC, occupancy 1 and 2, causal; multi-unit tiles and reuse."""
    topo = tiny_topology(domains=4, cus=2, sets=32, ways=8, llc_sets=64 if llc else 0)
    model = sim.AttentionModel(2, 8, 4, 256, 256, 64, 32, 16, causal, 2)
    fast = _compare(topo, model, policy, occ, 0.0, "xor", 0, skew=2 if occ == 2 else 0)
    assert fast.unit_lines > 1  # the tile-level path, not line level
    assert 0 < fast.l2_bytes < fast.requested_bytes  # a case with both hits and misses


def test_gemm_2d_units_match_brute_force():
    """Square GEMM with line-mod-sets indexing: multi-row units (the 2-D unit path)."""
    topo = tiny_topology(domains=2, cus=2, sets=16, ways=4, llc_sets=64)
    model = sim.GemmModel(256, 256, 256, 64, 64, 64, 2)
    fast = _compare(topo, model, "chiplet_tiled", 1, 0.0, "none", 0)
    assert fast.unit_lines > 1


# ----------------------------------------------------------------------------------- known answers
def test_conservation_and_requested_bytes():
    model = sim.AttentionModel(1, 16, 8, 1024, 1024, 64, 64, 32, False, 2)
    r = sim.simulate("mi300x", model, "head_first")
    assert r.l2_bytes + r.llc_bytes + r.hbm_bytes == r.requested_bytes
    assert sum(r.requested_bytes_per_domain) == r.requested_bytes
    # every workgroup reads its Q tile once and all of K and V of its KV head (non-causal)
    W = 16 * (1024 // 64)
    assert r.requested_bytes == W * (64 * 64 * 2 + 2 * 1024 * 64 * 2)
    assert r.flops_per_domain and abs(sum(r.flops_per_domain) - 4 * 16 * 1024 * 1024 * 64) < 1


@pytest.mark.parametrize("policy", ["swizzled_head_first", "block_first"])
def test_everything_fits_only_compulsory_misses(policy):
    """L2s and LLC larger than the data, no set conflicts: each domain misses exactly once per line
    it touches; the LLC then serves every line a second domain asks for."""
    B, H, HK, S, D = 1, 4, 2, 64, 32
    q_lines, kv_lines = B * H * S * D * 2 // LINE, B * HK * S * D * 2 // LINE
    topo = tiny_topology(domains=2, cus=2, sets=8, ways=64, llc_sets=8, llc_ways=64)
    model = sim.AttentionModel(B, H, HK, S, S, D, 16, 16, False, 2)
    r = sim.simulate(topo, model, policy, llc_ways=64, set_hash="none")
    if policy == "swizzled_head_first":  # domain d: heads 2d, 2d+1 = KV head d only
        l2_miss = q_lines + 2 * kv_lines
        llc_hits = 0
    else:  # block_first with H = 4, X = 2: each domain runs heads of both KV heads
        per_domain = q_lines // 2 + 2 * kv_lines
        l2_miss = 2 * per_domain
        llc_hits = l2_miss - (q_lines + 2 * kv_lines)
    assert (r.requested_bytes - r.l2_bytes) // LINE == l2_miss
    assert r.llc_bytes // LINE == llc_hits
    assert r.hbm_bytes // LINE == q_lines + 2 * kv_lines


def test_ordering_on_mi300x():
    """Non-causal H=128 on MI300X: swizzled_head_first > head_first > block_first, in lockstep and with
    drifting workgroups (derived from the simulation, no expected numbers)."""
    model = sim.AttentionModel(1, 128, 128, 4096, 4096, 128, 128, 64, False, 2)
    for jitter in (0.0, 0.2):
        hit = {p: sim.simulate("mi300x", model, p, jitter=jitter).l2_hit_rate
               for p in ("swizzled_head_first", "head_first", "block_first")}
        assert hit["swizzled_head_first"] > hit["head_first"] > hit["block_first"], (jitter, hit)


def test_causal_balance_is_reported():
    """Causal prefill: later query blocks do more work; swizzled_head_first keeps each head's blocks
    on one domain, so per-domain work stays even when heads are spread evenly."""
    model = sim.AttentionModel(1, 16, 16, 2048, 2048, 64, 128, 64, True, 2)
    r = sim.simulate("mi300x", model, "swizzled_head_first")
    assert 1.0 <= r.work_balance < 1.01
    assert r.time_s == max(r.time_terms_s.values())
    assert set(r.to_dict()) >= {"mapping", "l2_hit_rate", "hbm_bytes", "llc_bytes", "time_s"}


# ----------------------------------------------------------------------------------- CLI
def test_cli_json_and_plot(capsys, tmp_path):
    from numasched.cli import main

    png = tmp_path / "cmp.png"
    rc = main(["simulate", "--gpu", "mi300x", "--kernel", "attention", "--batch", "1", "--heads", "16",
               "--kv-heads", "8", "--seq", "1024", "--head-dim", "64", "--mapping", "all", "--json",
               "--plot", str(png), "--no-progress"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert [r["mapping"] for r in out] == M.available("attention")
    for r in out:
        assert 0.0 <= r["l2_hit_rate"] <= 1.0 and r["hbm_bytes"] > 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_gemm_and_decode_table(capsys):
    from numasched.cli import main

    assert main(["simulate", "--kernel", "gemm", "--m", "512", "--n", "512", "--k", "256", "--mapping",
                 "chiplet_tiled,grouped", "--no-progress"]) == 0
    assert "chiplet_tiled" in capsys.readouterr().out
    assert main(["simulate", "--kernel", "decode", "--heads", "16", "--kv-heads", "4", "--seq", "4096",
                 "--splits", "4", "--causal", "--occupancy", "2", "--tile", "32x32", "--mapping", "auto",
                 "--no-progress"]) == 0
    assert "swizzled_head_first" in capsys.readouterr().out
    assert main(["simulate", "--kernel", "gemm", "--mapping", "head_first", "--no-progress"]) == 2
    assert "gemm" in capsys.readouterr().err


# ----------------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("make,word", [
    (lambda: sim.AttentionModel(1, 6, 4, 64, 64, 64), "kv_heads"),
    (lambda: sim.AttentionModel(1, 4, 4, 0, 64, 64), "seq_q"),
    (lambda: sim.AttentionModel(1, 4, 4, 64, 64, 64, block_m=2.5), "block_m"),
    (lambda: sim.AttentionModel(1, 4, 4, 64, 64, 64, causal="yes"), "causal"),
    (lambda: sim.DecodeModel(1, 4, 4, 64, 64, splits=0), "splits"),
    (lambda: sim.GemmModel(64, 64, 64, block_k=-1), "block_k"),
    (lambda: sim.simulate("mi300x", sim.GemmModel(64, 64, 100)), "k*dtype_bytes"),
    (lambda: sim.simulate("mi300x", sim.GemmModel(64, 64, 64), occupancy=0), "occupancy"),
    (lambda: sim.simulate("mi300x", sim.GemmModel(64, 64, 64), jitter=1.5), "jitter"),
    (lambda: sim.simulate("mi300x", sim.GemmModel(64, 64, 64), "head_first"), "gemm"),
    (lambda: sim.simulate("mi300x", "not a model"), "kernel_model"),
    (lambda: sim.simulate("mi300x", sim.GemmModel(64, 64, 64), set_hash="crc"), "set_hash"),
])
def test_bad_arguments_name_the_argument(make, word):
    with pytest.raises(ValueError, match=word.replace("*", r"\*")):
        make()


def test_report_quick_mentions_every_order():
    text = sim.report(quick=True)
    for p in ("block_first", "head_first", "swizzled_head_first", "90-96%"):
        assert p in text


# ------------------------------------------------------------------ stream-K GEMM
def test_streamk_reads_what_the_data_parallel_gemm_reads_plus_its_partials():
    """Stream-K cuts K, not the work: every A and B tile is requested as often as by the
    data-parallel GEMM, plus one fp32 write of each split piece's partial and one read of it by
    the merge (and the simulator's L2 sees it whole, whichever order the pieces go in)."""
    topo = Topology.preset("mi300x")
    m, n, k, bm, bn, bk = 256, 1024, 2048, 128, 128, 64
    dp = sim.simulate(topo, sim.GemmModel(m, n, k, bm, bn, bk), "chiplet_tiled")
    for order in ("program", "remap"):
        model = sim.StreamKGemmModel(m, n, k, bm, bn, bk, programs=24, mapping="chiplet_tiled", piece_order=order)
        r = sim.simulate(topo, model, "auto")
        for t in ("A", "B"):
            assert r.requested_bytes_per_tensor[t] == dp.requested_bytes_per_tensor[t]
        units = M.streamk_units_reference("chiplet_tiled", M.GemmGrid(2, 8), k // bk, 24, 8)
        split = [u for us in units for u in us if (u[2], u[3]) != (0, k // bk)]
        assert r.requested_bytes_per_tensor["P"] == 2 * len(split) * bm * bn * 4
        assert r.mapping == f"chiplet_tiled stream-K ({order} order)"


def test_streamk_remap_order_keeps_partials_in_one_xcd_l2():
    """In the policy's remap order a split tile's pieces run on one XCD, so its merge finds more
    of the partials in that XCD's L2 than when pieces go by program id (lockstep)."""
    topo = Topology.preset("mi300x")
    hit = {}
    for order in ("program", "remap"):
        model = sim.StreamKGemmModel(512, 2560, 2048, 128, 128, 64, mapping="chiplet_tiled", piece_order=order)
        hit[order] = sim.simulate(topo, model, "auto").l2_hit_rate_per_tensor["P"]
    assert hit["remap"] > hit["program"]


def test_streamk_k_aligned_pieces_read_fewer_hbm_bytes_when_operands_exceed_l2():
    """H200 model (one 50 MB L2): 96 tiles of 128 x 256 on 132 SMs are all cut into pieces. Tail
    first, the programs' K positions spread over all of K and A + B (122 MB) stream from HBM
    several times; K-aligned (a piece's head in the next tile first) they stay within a band of
    I - W K iterations, so fewer bytes come from HBM -- still more than the data-parallel
    kernel's single pass, which reads each operand byte about once."""
    m, n, k = 320, 8192, 7168
    dp = sim.simulate("h200", sim.GemmModel(m, n, k, 128, 256, 64), "auto").hbm_bytes
    tail, aligned = (sim.simulate("h200", sim.StreamKGemmModel(m, n, k, 128, 256, 64, k_aligned=a), "auto").hbm_bytes
                     for a in (False, True))
    floor = (m * k + n * k) * 2
    assert dp < 1.05 * floor
    assert aligned < 0.6 * tail and dp < aligned


def test_cli_streamk_compares_both_orders(capsys):
    from numasched.cli import main

    assert main(["simulate", "--kernel", "gemm", "--m", "256", "--n", "1024", "--k", "1024", "--tile", "128x128",
                 "--streamk", "--mapping", "chiplet_tiled", "--programs", "40", "--json", "--no-progress"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["mapping"] for r in rows] == ["chiplet_tiled", "chiplet_tiled stream-K (program order)",
                                           "chiplet_tiled stream-K (remap order)",
                                           "chiplet_tiled stream-K (program order, K-aligned)"]
    assert main(["simulate", "--kernel", "decode", "--streamk", "--no-progress"]) == 2
