"""numasched probe: analysis on synthetic measurements with planted structure (CPU), CLI behaviour
without a GPU, the kernel's compiled code (CPU, no GPU needed), and the real quick probe (GPU)."""
import json
import re
import subprocess
import sys

import numpy as np
import pytest
import torch

from conftest import compiled_json

from numasched import probe as P
from numasched.cli import main as cli_main
from numasched.topology import Topology

BASE = 0x7F3A_0000_0000  # a 2 MiB-aligned virtual address, like a cudaMalloc'd 24 MB buffer


def bits_of(addr, *bits):
    return [((addr >> b) & 1).astype(np.int64) for b in bits]


def synthetic_raw(fast_rule, *, nsm=48, lines=640, groups=None, pps=2, gap=30.0, noise=3.0, seed=1,
                  sm_offset=6.0, device="NVIDIA H200"):
    """A raw measurement: latency = 260 + SM offset + gap if the line's fast group is not the SM's + noise.

    groups: partition of each SM (default: SM pairs alternate, like the H200 reading); fast_rule maps
    line addresses -> fast partition per line (None: no partition effect).
    """
    rng = np.random.default_rng(seed)
    if groups is None:
        groups = (np.arange(nsm) // 2) % 2
    groups = np.asarray(groups)
    line_idx = rng.choice((24 << 20) // 128, size=lines, replace=False)
    addr = (BASE + line_idx * 128).astype(np.uint64)
    fast = fast_rule(addr) if fast_rule is not None else None
    # dispatch: pid g -> SM, a shuffled but fixed first wave repeated pps times
    order = rng.permutation(nsm)
    pid_sm = np.tile(order, pps)
    offs = rng.uniform(-sm_offset, sm_offset, nsm)
    lat = 260.0 + offs[pid_sm][:, None] + rng.normal(0, noise, (len(pid_sm), lines))
    if fast is not None:
        lat += gap * (groups[pid_sm][:, None] != fast[None, :])
    # 2% disturbed readings: the host keeps the fastest program per SM, so spikes must not matter
    spikes = rng.random(lat.shape) < 0.02
    lat[spikes] += 200.0
    clocks = np.stack([np.full(len(pid_sm), 1.98e7), np.full(len(pid_sm), 1e7)], 1)
    raw = dict(vendor="nvidia", device=device, compute_capability="9.0", num_sms=nsm, l2_bytes=62914560,
               lat=lat, pid_sm=pid_sm, addresses=addr, clocks=clocks, hbm_bytes_per_s=4.3e12,
               settings=dict(lines=lines, iters=32, programs_per_sm=pps, buffer_bytes=24 << 20, seed=seed))
    return raw, groups, fast


def same_partition(labels, groups):
    """labels equal groups up to renaming."""
    labels, groups = np.asarray(labels), np.asarray(groups)
    pairs = set(zip(labels.tolist(), groups.tolist()))
    return len(pairs) == len(set(labels.tolist())) == len(set(groups.tolist()))


def xor_hash(addr):
    b = bits_of(addr, 7, 9, 10, 12, 14, 15, 17, 19, 20, 22, 23)
    return np.bitwise_xor.reduce(np.stack(b), axis=0)


# ------------------------------------------------------------------------------ analysis
def test_hashed_lines_give_two_partitions_not_addressable():
    raw, groups, fast = synthetic_raw(xor_hash)
    res = P.analyze(raw)
    assert res["num_partitions"] == 2
    assert res["sms_covered"] == raw["num_sms"] and res["uncovered_sms"] == []
    assert same_partition(res["sm_partition"], groups)
    assert res["near_cycles"] == pytest.approx(260, abs=5) and res["far_cycles"] == pytest.approx(290, abs=5)
    assert res["address_selects_partition"] is False
    at = res["address_test"]
    assert at["predictor"] is None and at["best_single"]["accuracy"] < 0.7 and at["best_pair"]["accuracy"] < 0.7
    assert "cannot be chosen by address" in res["verdict"]
    # the measured near partition per line matches the planted one (up to renaming)
    lp = P.line_partitions(P.sm_latency_matrix(raw["lat"], raw["pid_sm"])[1],
                           np.array([res["sm_partition"][s] for s in range(raw["num_sms"])]))
    clear = lp["near"] >= 0
    assert clear.mean() > 0.95 and same_partition(lp["near"][clear], fast[clear])
    topo = Topology.from_probe(res)
    assert topo.dispatch == "single" and topo.num_domains == 1 and topo.cus_per_domain == raw["num_sms"]


def test_bit12_is_addressable_and_gives_a_table_topology():
    raw, groups, fast = synthetic_raw(lambda a: bits_of(a, 12)[0])
    res = P.analyze(raw)
    assert res["num_partitions"] == 2 and same_partition(res["sm_partition"], groups)
    assert res["address_selects_partition"] is True
    assert res["address_test"]["predictor"]["bits"] == [12]
    assert res["address_test"]["predictor"]["accuracy"] > 0.98
    topo = Topology.from_probe(res)
    assert topo.dispatch == "table" and topo.num_domains == 2
    # the table is the partition of the SM each first-wave program ran on
    want = [res["sm_partition"][s] for s in raw["pid_sm"][: raw["num_sms"]]]
    assert list(topo.dispatch_table) == want
    assert list(topo.domain_of(np.arange(raw["num_sms"]))) == want


@pytest.mark.parametrize("rule,bits", [
    (lambda a: np.bitwise_xor(*bits_of(a, 9, 15)), [9, 15]),      # a hash of two bits
    (lambda a: np.bitwise_and(*bits_of(a, 12, 13)), [12, 13]),    # 25% / 75% of lines: unbalanced
])
def test_pairs_of_bits(rule, bits):
    raw, groups, _ = synthetic_raw(rule, seed=3)
    res = P.analyze(raw)
    at = res["address_test"]
    assert res["num_partitions"] == 2 and same_partition(res["sm_partition"], groups)
    assert res["address_selects_partition"] is True and at["predictor"]["bits"] == bits
    assert at["best_single"]["accuracy"] < 0.9


def test_bit_above_page_offset_is_not_addressable():
    raw, _, _ = synthetic_raw(lambda a: bits_of(a, 22)[0], seed=4)
    res = P.analyze(raw)
    at = res["address_test"]
    assert res["num_partitions"] == 2 and at["predictor"]["bits"] == [22]
    assert res["address_selects_partition"] is False and "page" in at["reason"]
    assert at["page"]["accuracy"] == 1.0


def test_no_partition_effect_is_one_domain():
    raw, _, _ = synthetic_raw(None, sm_offset=10.0, seed=5)
    res = P.analyze(raw)
    assert res["num_partitions"] == 1 and res["far_cycles"] is None
    assert set(res["sm_partition"]) == {0} and res["address_test"] is None
    assert Topology.from_probe(res).dispatch == "single"


def test_four_partitions():
    nsm = 48
    groups = np.arange(nsm) // 12
    raw, _, _ = synthetic_raw(lambda a: 2 * bits_of(a, 8)[0] + bits_of(a, 13)[0], nsm=nsm, groups=groups, seed=6)
    res = P.analyze(raw)
    assert res["num_partitions"] == 4 and same_partition(res["sm_partition"], groups)
    assert res["partition_sizes"] == [12, 12, 12, 12]
    assert res["address_test"]["predictor"]["bits"] == [8, 13] and res["address_selects_partition"]
    topo = Topology.from_probe(res)
    assert topo.num_domains == 4 and topo.cus_per_domain == 12


def test_subgroups_with_a_far_penalty_are_not_extra_partitions():
    """Half the SMs of each partition pay 8 more cycles on far lines (farther from the other
    partition): still two partitions, since the halves tie on near lines."""
    nsm = 48
    groups = (np.arange(nsm) // 2) % 2
    raw, _, fast = synthetic_raw(lambda a: bits_of(a, 10)[0], nsm=nsm, groups=groups, seed=7)
    extra = (np.arange(nsm) % 4 < 2) & (np.arange(nsm) >= 24)
    far = groups[raw["pid_sm"]][:, None] != fast[None, :]
    raw["lat"] = raw["lat"] + 8.0 * (extra[raw["pid_sm"]][:, None] & far)
    res = P.analyze(raw)
    assert res["num_partitions"] == 2 and same_partition(res["sm_partition"], groups)


def test_sm_latency_matrix_keeps_fastest_program_and_handles_gaps():
    lat = np.array([[300.0, 310.0], [280.0, np.nan], [290.0, 305.0], [0.0, 400.0]])
    pid_sm = np.array([5, 5, 9, 9])  # SM ids need not be contiguous
    sm_ids, M = P.sm_latency_matrix(lat, pid_sm)
    assert sm_ids.tolist() == [5, 9]
    np.testing.assert_array_equal(M, [[280.0, 310.0], [290.0, 305.0]])
    with pytest.raises(ValueError, match="pid_sm"):
        P.sm_latency_matrix(lat, pid_sm[:3])
    with pytest.raises(ValueError, match="M must be"):
        P.cluster_sms(np.zeros(5))


def test_round_robin_fit_and_dispatch_summary():
    rng = np.random.default_rng(0)
    pid = np.arange(512)
    d = (pid + 4) % 8
    assert P.round_robin_fit(d, 8) == {"offset": 4, "accuracy": 1.0}
    noisy = d.copy()
    noisy[rng.choice(512, 51, replace=False)] = 0
    fit = P.round_robin_fit(noisy, 8)
    assert fit["offset"] == 4 and 0.88 < fit["accuracy"] < 0.95
    with pytest.raises(ValueError, match="num_domains"):
        P.round_robin_fit(d, 0)
    # dispatch of 8 SMs, 2 partitions alternating by SM pair; pids go to SMs 6,7,0,1,...
    first = np.array([6, 7, 0, 1, 2, 3, 4, 5])
    part = {s: (s // 2) % 2 for s in range(8)}
    ds = P.dispatch_summary(np.concatenate([first, first]), part, 8)
    assert ds["distinct_sms_first_wave"] == 8 and ds["second_wave_same_sm"] == 1.0
    assert ds["first_wave_partition"] == [1, 1, 0, 0, 1, 1, 0, 0]
    assert ds["first_wave_per_partition"] == [4, 4] and ds["consecutive_same_partition"] == pytest.approx(4 / 7, abs=1e-3)


def test_amd_analysis_and_topology():
    """AMD path (untested on hardware): XCC ids of 304*2 workgroups with offset 6 -> round robin."""
    pid = np.arange(608)
    raw = dict(vendor="amd", device="AMD Instinct MI300X", arch="gfx942:sramecc+:xnack-", num_sms=304,
               l2_bytes=4 << 20, pid_xcc=(pid + 6) % 8, num_xcc_attribute=8)
    res = P.analyze(raw)
    assert res["num_partitions"] == 8 and res["round_robin"] == {"offset": 6, "accuracy": 1.0}
    assert res["workgroups_per_xcc"] == [76] * 8 and "untested" in res
    topo = Topology.from_probe(json.loads(json.dumps(res)))
    assert (topo.vendor, topo.dispatch, topo.dispatch_offset, topo.num_domains, topo.cus_per_domain) == (
        "amd", "round_robin", 6, 8, 38)
    assert topo.domain_of([0, 1, 2]).tolist() == [6, 7, 0]


# ------------------------------------------------------------------------------ files and CLI
def test_save_load_raw_and_cli_from_raw(tmp_path, capsys):
    raw, groups, _ = synthetic_raw(xor_hash, seed=8)
    res = P.analyze(raw)
    out = P.save(res, tmp_path / "probe-h200.json", raw)
    assert out.with_suffix(".npz").exists()
    back = P.load_raw(out.with_suffix(".npz"))
    np.testing.assert_array_equal(back["lat"], raw["lat"])
    assert back["device"] == raw["device"] and back["settings"] == raw["settings"]
    rc = cli_main(["probe", "--from-raw", str(out.with_suffix(".npz")), "--out", str(tmp_path / "re.json")])
    text = capsys.readouterr().out
    assert rc == 0 and "partitions: 2" in text and "cannot be chosen by address" in text
    data = json.loads((tmp_path / "re.json").read_text())
    assert data["sm_partition"] == res["sm_partition"] and data["address_selects_partition"] is False
    assert Topology.from_probe(tmp_path / "re.json").dispatch == "single"


def test_default_path(monkeypatch, tmp_path):
    monkeypatch.setenv("NUMASCHED_CACHE", str(tmp_path))
    assert P.default_path("NVIDIA H200") == tmp_path / "probe-h200.json"
    assert P.default_path("NVIDIA H100 80GB HBM3") == tmp_path / "probe-h100.json"
    assert P.default_path("Weird GPU (x)").name == "probe-weird-gpu-x.json"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message shown without a GPU")
def test_cli_without_gpu_exits_with_a_message(tmp_path, capsys):
    rc = cli_main(["probe", "--quick", "--out", str(tmp_path / "p.json")])
    err = capsys.readouterr().err
    assert rc == 2 and "no GPU visible" in err and "Traceback" not in err
    assert not (tmp_path / "p.json").exists()
    with pytest.raises(P.ProbeUnavailable, match="no GPU"):
        P.probe(quick=True, out=tmp_path / "p.json")


def test_cli_rejects_bad_arguments(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:  # rejected while parsing, naming the option
        cli_main(["probe", "--lines", "0"])
    assert e.value.code == 2 and "argument --lines: expected an integer >= 1" in capsys.readouterr().err
    assert cli_main(["probe", "--from-raw", str(tmp_path / "missing.npz")]) == 2
    assert "no such file" in capsys.readouterr().err


def test_kernel_compiles_with_the_intended_instructions():
    """Compile (no GPU needed) for sm_90, gfx942 and gfx950 in a fresh process without TRITON_INTERPRET:
    the PTX has %smid, L1-bypassing loads and clock reads; the AMD path of the same kernel reads the
    CU and XCC ids with s_getreg, the clocks with s_memtime / s_memrealtime and loads with sc1 (L2);
    the XCC-id kernel assembles HW_REG_XCC_ID. (The AMD code has never run on hardware.)"""
    code = ("import json; from numasched.probe import kernel_asm; a = kernel_asm('sm_90'); b = kernel_asm('gfx942');"
            "c = kernel_asm('gfx942', 'l2_latency'); d = kernel_asm('gfx950', 'l2_latency');"
            "print(json.dumps({'ptx': a['ptx'], 'gcn': b['amdgcn'], 'lat942': c['amdgcn'], 'lat950': d['amdgcn']}))")
    asm = compiled_json(code, timeout=120)
    ptx = asm["ptx"]
    assert "%smid" in ptx and "%globaltimer" in ptx
    assert ptx.count("ld.global.cg.u64") >= 2 and ptx.count("%clock64") >= 3
    assert "s_getreg_b32" in asm["gcn"] and "HW_REG_XCC_ID" in asm["gcn"]
    for gcn in (asm["lat942"], asm["lat950"]):
        assert "hwreg(HW_REG_HW_ID" in gcn and "hwreg(HW_REG_XCC_ID" in gcn
        assert gcn.count("s_memtime") >= 3 and gcn.count("s_memrealtime") >= 2
        assert len(re.findall(r"global_load_dwordx2 v\[\d+:\d+\], v\[\d+:\d+\], off sc1", gcn)) >= 2
        assert "%smid" not in gcn and "ld.global" not in gcn


def test_kernel_asm_rejects_bad_requests():
    with pytest.raises(ValueError, match="target must look like"):
        P.kernel_asm("volta")
    with pytest.raises(ValueError, match="AMD only"):
        P.kernel_asm("sm_90", "xcc_id")


def test_layout_device_code_in_kernels_and_no_bench_import():
    """Device code lives in numasched.kernels.probe; the host package imports neither numasched.bench
    nor the kernels (analysis runs without a Triton compile); bench.common re-exports the bandwidth
    reading from numasched.probe."""
    code = ("import sys, numasched.probe as P\n"
            "bad = sorted(m for m in sys.modules if m.startswith(('numasched.bench', 'numasched.kernels.probe')))\n"
            "print(bad)\n"
            "from numasched.bench import common\n"
            "from numasched.kernels import probe as K\n"
            "assert common.stream_read_bw is P.stream_read_bw\n"
            "assert all(hasattr(K, n) for n in ('_smid', '_clock', '_globaltimer', '_load_cg', '_l2_latency_kernel',"
            " '_xcc_id_kernel'))\n"
            "import numasched.cli as C; assert C.build_parser().parse_args(['probe', '--quick']).func is P.cli._cli\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip().splitlines()[0] == "[]"
    for name in P.__all__:
        assert hasattr(P, name), name


def test_read_graph_us_reads_every_word_of_each_buffer_it_times():
    """The same-size read (the GEMM bench's limit for reading W once): its kernel's sums cover
    every word of the buffer timed (interpreter), each buffer in turn, and bad buffers are refused."""
    from numasched.kernels.probe import stream_read_kernel
    from numasched.probe.bandwidth import READ_CONFIGS, read_graph_us

    gen = torch.Generator().manual_seed(7)
    # small integer words (exact in the kernel's fp32 sum), seen as bf16 pairs
    bufs = [torch.randint(-1000, 1000, (37, 25), generator=gen, dtype=torch.int32).view(torch.bfloat16) for _ in range(3)]
    seen = []

    def timer(fn_i, copies, calls):
        assert copies == len(bufs) and calls == 5
        for i in range(copies):
            out = fn_i(i)
            seen.append(out)
        return float(len(seen))  # decreasing "times" would pick the last; increasing keeps the first

    assert read_graph_us(bufs, 5, timer) == 3.0  # torch's sum timed first, kept as the fastest
    assert len(seen) == 3 * (1 + len(READ_CONFIGS))
    n = bufs[0].numel() // 2
    words = bufs[1].view(-1).view(torch.int32)
    grid = -(-n // (64 * 4))
    sink = torch.full((grid,), float("nan"))
    stream_read_kernel[(grid,)](words, sink, n, BLOCK=64, UNROLL=4)
    assert sink.sum().item() == words.double().sum().item()
    with pytest.raises(ValueError, match="bufs"):
        read_graph_us([bufs[0], bufs[1][:, :10]], 5, timer)
    odd = [torch.zeros(3, dtype=torch.bfloat16) for _ in range(3)]   # 6 bytes: read as 16-bit words
    seen.clear()
    read_graph_us(odd, 5, timer)
    assert len(seen) == 3 * (1 + len(READ_CONFIGS))


# ------------------------------------------------------------------------------ GPU
@pytest.mark.gpu
def test_quick_probe_on_gpu(tmp_path):
    nsm = torch.cuda.get_device_properties(0).multi_processor_count
    res = P.probe(quick=True, out=tmp_path / "probe.json", bandwidth=False)
    print(P.summary(res))
    assert res["sms_covered"] == nsm and res["uncovered_sms"] == []
    lc = res["latency_cycles"]
    assert 100 <= lc["min"] <= lc["median"] <= lc["max"] <= 2000
    assert len(res["partition_sizes"]) == res["num_partitions"] >= 1 and min(res["partition_sizes"]) > 0
    assert sum(res["partition_sizes"]) == nsm
    assert res["dispatch"]["distinct_sms_first_wave"] > nsm // 2
    raw = P.load_raw(tmp_path / "probe.npz")
    assert np.isfinite(raw["lat"]).all() and (raw["pid_sm"] >= 0).all()   # every program wrote
    assert 0.5 < res["sm_clock_ghz"] < 3.0
    if res["num_partitions"] > 1:
        assert res["far_cycles"] > res["near_cycles"]
    topo = Topology.from_probe(tmp_path / "probe.json")
    assert topo.num_cus in (nsm, (nsm // topo.num_domains) * topo.num_domains)


@pytest.mark.gpu
def test_stream_read_bw_on_gpu_is_a_rate_the_gpu_can_have():
    """The 1 GiB streaming read (back-to-back reads, no written flush): below the published HBM
    rate (H100 SXM 3.35 TB/s, H200 4.8) and above 0.7 of the model table's measured one."""
    from numasched.gemm_schedule import _KNOWN
    from numasched.probe.bandwidth import stream_read_bw

    name = torch.cuda.get_device_name(0).lower()
    known = next((k for k in ("h200", "h100") if k in name), None)
    if known is None:
        pytest.skip(f"no table entry for {name}")
    bw = stream_read_bw()
    assert stream_read_bw() == bw   # cached per device
    published = {"h200": 4.8e12, "h100": 3.35e12}[known]
    assert 0.7 * _KNOWN[known].hbm_bytes_per_s < bw < published, bw
