"""The warp-specialised Gluon GEMM (kernels/gemm_ws.py, numasched/gemm_ws.py).

Gluon has no interpreter: on CPU the kernel is compiled for sm_90 (in a subprocess without
TRITON_INTERPRET) and its structure checked; correctness runs on a Hopper GPU (``-m gpu``).
"""
import os
import re

import pytest
from conftest import compiled_json
from hypothesis import given, settings
from hypothesis import strategies as st
import torch

from numasched.gemm_ws import WsConfig, WsGemmPlan, last_box_rows, split_config, supported, wide_config

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_COMPILE = r"""
import json
from numasched import portability as P
rows = {}
for v in ("bf16-128x256-s3", "bf16-128x128-s5-b-rowmajor", "bf16-glu-128x128-s4-row-scale",
          "bf16-128x256-s3-peer-push", "bf16-128x256-s3-peer-paced", "bf16-128x160-wide", "bf16-128x80-wide",
          "bf16-128x192-wide-b-rowmajor"):
    r = P.compile_variant("gemm_ws", v, "sm90", keep_asm=True)
    r["ptx"] = "\n".join(" ".join(l.split()) for l in r.pop("asm", {}).get("ptx", "").splitlines())
    rows[v] = r
for v in ("bf16-128x160-wide-last-box", "bf16-glu-128x128-s4-last-box", "bf16-128x128-split2-last-box",
          "bf16-64x80-wide", "bf16-64x128-last-box"):
    r = P.compile_variant("gemm_ws", v, "sm90", keep_asm=True)
    r["ptx"] = "\n".join(" ".join(l.split()) for l in r.pop("asm", {}).get("ptx", "").splitlines())
    rows["last:" + v] = r
for v in ("bf16-swap-128x96", "bf16-swap-256x96", "bf16-swap-128x144-last-box", "bf16-swap-128x144-last-b",
          "bf16-swap-128x128-last-b"):
    r = P.compile_variant("gemm_ws", v, "sm90", keep_asm=True)
    r["ptx"] = "\n".join(" ".join(l.split()) for l in r.pop("asm", {}).get("ptx", "").splitlines())
    rows["swap:" + v] = r
for v in ("bf16-128x160-bias-residual", "bf16-swap-128x96-bias-residual", "bf16-128x128-split2-bias-residual"):
    r = P.compile_variant("gemm_ws", v, "sm90", keep_asm=True)
    r["ptx"] = "\n".join(" ".join(l.split()) for l in r.pop("asm", {}).get("ptx", "").splitlines())
    rows["epi:" + v] = r
for v in ("bf16-128x208-three-boxes", "bf16-128x176-three-boxes-b-rowmajor"):
    r = P.compile_variant("gemm_ws", v, "sm90", keep_asm=True)
    r["ptx"] = "\n".join(" ".join(l.split()) for l in r.pop("asm", {}).get("ptx", "").splitlines())
    rows["three:" + v] = r
for v in ("matmul_all_reduce-ws-residual-direct", "matmul_all_reduce-ws", "matmul_all_reduce-ws-128", "matmul_reduce_scatter-ws",
          "matmul_reduce_scatter-ws-pairs", "matmul_reduce_scatter-ws-pairs-early", "matmul_reduce_scatter-ws-early"):
    r = P.compile_variant("dist", v, "sm90", keep_asm=True)
    r["ptx"] = "\n".join(" ".join(l.split()) for l in r.pop("asm", {}).get("ptx", "").splitlines())
    rows["mar:" + v] = r
print(json.dumps(rows))
"""


@pytest.fixture(scope="module")
def compiled():
    return compiled_json(_COMPILE, cwd=REPO)


# two-box tiles: (box widths) by variant
_WIDE = {"bf16-128x160-wide": (128, 32), "bf16-128x80-wide": (64, 16), "bf16-128x192-wide-b-rowmajor": (128, 64)}


def _k_loop_windows(ptx: str, in_flight: int = 1):
    """The consumer's K-step code: from each operand wait (mbarrier.try_wait) that precedes a
    ``wgmma.wait_group in_flight`` to the slot release (mbarrier.arrive) after it."""
    lines = ptx.splitlines()
    for i, line in enumerate(lines):
        if f"wgmma.wait_group.sync.aligned {in_flight};" in line:
            start = max(j for j in range(i) if "mbarrier.try_wait" in lines[j])
            end = next(j for j in range(i, len(lines)) if "mbarrier.arrive" in lines[j])
            yield lines[start:end + 1]


def test_compiles_for_hopper_warp_specialised(compiled):
    for name, r in compiled.items():
        if name.startswith(("mar:", "last:", "swap:", "three:", "epi:")):
            continue
        assert r["status"] == "ok", (name, r["error"])
        assert r["spill_bytes"] == 0 and r["fits"], name
        ptx = r["ptx"]
        # a loader warpgroup gives registers up, the two consumer warpgroups take them
        assert "setmaxnreg.dec.sync.aligned.u32 40;" in ptx, name
        assert ptx.count("setmaxnreg.inc.sync.aligned.u32 232;") >= 1, name
        assert "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes" in ptx, name
        n = 256 if "128x256" in name or "glu" in name else 128   # GLU: gate and up side by side
        stores = ptx.count("cp.async.bulk.tensor.2d.global.shared::cta.bulk_group")
        # per consumer: C, and its peer twin at once or in four 64-column chunks (in the K loop,
        # after it when the loop is short, after the last tile); two-box tiles: a store per box
        assert stores == {"peer-push": 4, "peer-paced": 2 + 2 * 12}.get(name.split("s3-")[-1],
                                                                         4 if name in _WIDE else 2), name
        if "glu" in name:   # silu's exponential in the epilogue, the row factors loaded
            assert "ex2.approx" in ptx and "ld.global" in ptx, name
        for n in _WIDE.get(name, (n,)):   # one wgmma shape per box
            assert f"wgmma.mma_async.sync.aligned.m64n{n}k16.f32.bf16.bf16" in ptx, (name, n)


def test_three_box_tiles_compile_with_a_wgmma_and_a_store_per_box(compiled):
    """Tiles of three power-of-two boxes (208 = 128 + 64 + 16, 176 = 128 + 32 + 16, B either way
    round): no spills, three wgmma shapes and their output stores per consumer, and in each
    consumer's K loop the three boxes' wgmmas (4 k16 steps each) with at most a barrier of its own
    warpgroup, the previous step's three left in flight."""
    for name, boxes in (("three:bf16-128x208-three-boxes", (128, 64, 16)),
                        ("three:bf16-128x176-three-boxes-b-rowmajor", (128, 32, 16))):
        r = compiled[name]
        assert r["status"] == "ok", (name, r["error"])
        assert r["spill_bytes"] == 0 and r["fits"], name
        ptx = r["ptx"]
        for n in boxes:
            assert f"wgmma.mma_async.sync.aligned.m64n{n}k16.f32.bf16.bf16" in ptx, (name, n)
        assert ptx.count("cp.async.bulk.tensor.2d.global.shared::cta.bulk_group") == 6, name
        windows = list(_k_loop_windows(ptx, 3))
        assert len(windows) == 2, name
        for w in windows:
            bars = [x.strip() for x in w if re.search(r"\bbar(rier)?\.sync\b", x)]
            assert all(re.fullmatch(r"bar\.sync\s+\d+,\s*128;", b) for b in bars), (name, bars)
            assert sum("wgmma.mma_async" in x for x in w) == 12, name


def test_k_loop_has_no_cta_wide_barrier(compiled):
    """What the kernel is for: between a consumer's operand wait and its slot release there is
    at most a barrier of its own warpgroup (``bar.sync N, 128``), never one of the whole CTA."""
    for name, r in compiled.items():
        if name.startswith(("mar:", "last:", "swap:", "three:", "epi:")):   # (the transposed form: its own test)
            continue
        wide = name in _WIDE   # two boxes: two wgmma groups a step, the previous pair waited for
        windows = list(_k_loop_windows(r["ptx"], 2 if wide else 1))
        assert len(windows) == 2, name          # one K loop per consumer warpgroup
        for w in windows:
            bars = [x.strip() for x in w if re.search(r"\bbar(rier)?\.sync\b", x)]
            assert all(re.fullmatch(r"bar\.sync\s+\d+,\s*128;", b) for b in bars), (name, bars)
            # BLOCK_K 64 = 4 x k16 per box
            assert sum("wgmma.mma_async" in x for x in w) == (8 if wide else 4), name


def test_fused_all_reduce_on_the_ws_kernel_compiles(compiled):
    """kernels/dist_gemm_ar_ws.py (all-reduce and reduce-scatter forms): warp-specialised as the
    GEMM, its K loops free of CTA-wide barriers, its flags raised after the TMA copies completed
    (not only read) and the async proxy fenced, with a system-scope release; bounded acquire polls."""
    for name in ("mar:matmul_all_reduce-ws-residual-direct", "mar:matmul_all_reduce-ws", "mar:matmul_all_reduce-ws-128",
                 "mar:matmul_reduce_scatter-ws", "mar:matmul_reduce_scatter-ws-pairs",
                 "mar:matmul_reduce_scatter-ws-pairs-early", "mar:matmul_reduce_scatter-ws-early"):
        r = compiled[name]
        assert r["status"] == "ok", (name, r["error"])
        assert r["fits"] and r["spill_bytes"] <= 64, (name, r["spill_bytes"])
        ptx = r["ptx"]
        wgmma = "m64n128k16" if name.endswith("-128") else "m64n256k16"
        assert "setmaxnreg.dec.sync.aligned.u32 40;" in ptx and wgmma in ptx, name
        assert "cp.async.bulk.wait_group 0; fence.proxy.async.global;" in ptx, name
        assert "atom.global.sys.release.exch.b64" in ptx and "ld.global.sys.acquire.b64" in ptx, name
        windows = list(_k_loop_windows(ptx))
        assert len(windows) == 2, name
        for w in windows:
            bars = [x.strip() for x in w if re.search(r"\bbar(rier)?\.sync\b", x)]
            assert all(re.fullmatch(r"bar\.sync\s+\d+,\s*128;", b) for b in bars), (name, bars)


def test_supported_names_the_argument():
    a = torch.zeros(64, 64, dtype=torch.bfloat16)
    b = torch.zeros(64, 64, dtype=torch.bfloat16)
    assert "a and b" in supported(a.float(), b.float())
    assert supported(torch.zeros(64, 63, dtype=torch.bfloat16)[:, :62], b[:62]).startswith("a must")
    assert supported(a, torch.zeros(64, 70, dtype=torch.bfloat16)[:, :65]).startswith("b must")
    assert supported(a, b, torch.zeros(64, 64, dtype=torch.float16)).startswith("out must")
    assert "SwiGLU" in supported(a, b, glu=True)          # a (K, 2n) row-major b: not the weight form
    assert "sm_90" in supported(a, b) or "Gluon" in supported(a, b)   # right operands, no Hopper here
    with pytest.raises(ValueError, match="not \\(M, K\\) and \\(K, N\\)"):
        WsGemmPlan(a, b[:32])
    with pytest.raises(ValueError, match="cannot run this"):
        WsGemmPlan(a, b)
    # no out given: the one a call makes must have TMA-addressable rows (N a multiple of 8)
    assert "N=1007" in supported(a, torch.zeros(1007, 64, dtype=torch.bfloat16).t())   # a weight's w.T


def test_config_fits_shared_memory():
    for cfg in (WsConfig(), WsConfig(block_n=128, stages=5)):
        assert cfg.smem_bytes() <= 227 * 1024


@pytest.mark.parametrize("tile_n", range(64, 257, 16))
def test_wide_config_cuts_a_tile_into_power_of_two_boxes(tile_n):
    """wide_config: tile_n = block_n + block_n1 (+ block_n2), powers of two, largest first (the
    later ones may be 0); the deepest ring of 3-6 stages that fits; the transposed form takes
    two boxes at most; widths of more boxes (240 = 128 + 64 + 32 + 16) or under 80 refused."""
    boxes = [1 << i for i in range(tile_n.bit_length() - 1, -1, -1) if tile_n >> i & 1]
    if len(boxes) > 3 or tile_n < 80:
        with pytest.raises(ValueError, match="tile_n"):
            wide_config(tile_n)
        return
    if len(boxes) == 3:
        with pytest.raises(ValueError, match="tile_n"):
            wide_config(tile_n, swap=True)
    cfg = wide_config(tile_n)
    assert cfg.tile_n == tile_n and [cfg.block_n, cfg.block_n1, cfg.block_n2] == (boxes + [0, 0])[:3]
    assert cfg.smem_bytes() <= 227 * 1024 and 3 <= cfg.stages <= 6
    assert cfg.stages == 6 or WsConfig(block_n=cfg.block_n, block_n1=cfg.block_n1, block_n2=cfg.block_n2,
                                       stages=cfg.stages + 1).smem_bytes() > 227 * 1024


def test_wide_config_of_64_row_tiles():
    """64-row tiles (one consumer warpgroup): deeper rings in the same shared memory; only the
    plain data-parallel form takes them."""
    for tile_n in (80, 96, 128, 160, 192, 256):
        c64, c128 = wide_config(tile_n, block_m=64), wide_config(tile_n)
        assert c64.block_m == 64 and c64.tile_n == tile_n and c64.stages >= c128.stages
        assert c64.smem_bytes() <= 227 * 1024
    with pytest.raises(ValueError, match="block_m"):
        wide_config(80, block_m=32)


def test_wide_config_stages_up_to_the_cap_or_the_schedule_s():
    """WIDE_MAX_STAGES (64-row tiles 12, 128-row 6) bound the ring, shared memory the rest; a
    ``max_stages`` (a schedule's own, numasched.gemm plans a "ws" schedule so) bounds it lower."""
    from numasched.gemm_ws import WIDE_MAX_STAGES

    assert wide_config(80, block_m=64).stages == WIDE_MAX_STAGES[64] == 12
    assert wide_config(96, block_m=64).stages == 10   # 11 would not fit
    assert wide_config(80).stages == WIDE_MAX_STAGES[128] == 6
    for tile_n in (80, 96, 128, 160, 192, 256):
        for block_m in (64, 128):
            full = wide_config(tile_n, block_m=block_m)
            for cap in (3, 5, 8, 16):
                c = wide_config(tile_n, block_m=block_m, max_stages=cap)
                assert c.stages == min(cap, full.stages) and c.smem_bytes() <= 227 * 1024
            bigger = WsConfig(block_n=full.block_n, block_n1=full.block_n1, stages=full.stages + 1, block_m=block_m)
            assert full.stages == WIDE_MAX_STAGES[block_m] or bigger.smem_bytes() > 227 * 1024
    with pytest.raises(ValueError, match="max_stages"):
        wide_config(128, max_stages=2)


def test_wide_config_errors_name_the_field():
    for bad in (48, 72, 272):
        with pytest.raises(ValueError, match="tile_n"):
            wide_config(bad)


# ------------------------------------------------------------------------------------------ GPU
def _hopper():
    return torch.cuda.is_available() and torch.version.hip is None and torch.cuda.get_device_capability()[0] == 9


def _operands(M, N, K, dtype, b_weight):
    """Fresh a (M, K), b (K, N) (a weight's w.T, or row-major), out poisoned with NaN, and the
    float64 reference."""
    torch.manual_seed(M + N + K)
    a = torch.randn(M, K, device="cuda", dtype=dtype)
    w = torch.randn(N, K, device="cuda", dtype=dtype)
    b = w.t() if b_weight else w.t().contiguous()
    return a, b, torch.full((M, N), float("nan"), device="cuda", dtype=dtype), a.double() @ b.double()


def _rel(out, ref):
    return ((out.double() - ref).abs().max() / ref.abs().max()).item()


# the stream-K forms: the tile's last piece merges; every contributor a band; split-K in lockstep
_SK_FORMS = {"last-piece": WsConfig(streamk=True), "bands": WsConfig(streamk=True, sk_merge=1),
             "split3": WsConfig(streamk=True, sk_merge=1, sk_split=3),
             "split8": WsConfig(streamk=True, sk_merge=1, sk_split=8)}


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs an sm_90 GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("b_weight", [True, False])
@pytest.mark.parametrize("cfg", [WsConfig(), WsConfig(block_n=128, stages=5, group_m=1)], ids=["256s3", "128s5"])
@pytest.mark.parametrize("M,N,K", [(1, 264, 72), (97, 520, 1000), (300, 4096, 4096), (1031, 1000, 3000),
                                   (4096, 2048, 512)])
def test_matches_float64(M, N, K, cfg, b_weight, dtype):
    a, b, out, ref = _operands(M, N, K, dtype, b_weight)
    WsGemmPlan(a, b, out, config=cfg).run(a, b, out)
    assert _rel(out, ref) < 1e-2


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs an sm_90 GPU")
@pytest.mark.parametrize("b_weight", [True, False])
@pytest.mark.parametrize("block_m", [128, 64])
@pytest.mark.parametrize("tile_n", [80, 96, 128, 144, 160, 192, 176, 208, 224])
@pytest.mark.parametrize("M,N,K", [(97, 520, 1000), (300, 2560, 4096), (1031, 1000, 3000), (128, 8, 64), (40, 704, 600)])
def test_wide_tiles_match_float64(M, N, K, tile_n, block_m, b_weight):
    """Two- and three-box tiles: N cut at tile_n (the later boxes partly or wholly past N at the
    edge: 520 in tiles of 208 ends 104 in); tiles of 128 rows (two consumer warpgroups) or 64 (one)."""
    for dtype in (torch.bfloat16, torch.float16):
        a, b, out, ref = _operands(M, N, K, dtype, b_weight)
        plan = WsGemmPlan(a, b, out, config=wide_config(tile_n, block_m=block_m))
        plan.run(a, b, out)
        assert _rel(out, ref) < 1e-2, dtype
        for _ in range(2):   # again, through the C launcher, then its cached argument list
            out.fill_(float("nan"))
            plan.run(a, b, out)
            assert _rel(out, ref) < 1e-2, dtype
        assert plan._fulls, "the C launcher's argument list was not cached"


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs an sm_90 GPU")
@pytest.mark.parametrize("block_m", [128, 256, 64])
@pytest.mark.parametrize("tile_n", [80, 96, 144, 256])
@pytest.mark.parametrize("M,N,K", [(97, 520, 1000), (271, 2600, 4104), (551, 1000, 3000), (65, 8, 64), (40, 704, 600)])
def test_swapped_tiles_match_float64(M, N, K, tile_n, block_m):
    """The transposed form (config.swap, kernels/gemm_ws.py SWAP_C): the weight (N, K) as the
    kernel's A, x.T as its B, y = x @ w.T stored transposed tile by tile; tiles past M and N at
    the edges, 1-4 consumer warpgroups. Through numasched.matmul's schedule too."""
    import numasched
    from numasched.gemm_schedule import Schedule

    for dtype in (torch.bfloat16, torch.float16):
        x, wt, out, ref = _operands(M, N, K, dtype, True)
        cfg = wide_config(tile_n, block_m=block_m, swap=True)
        if cfg.smem_bytes() > 227 * 1024:
            pytest.skip(f"{block_m} x {tile_n} does not fit in shared memory")
        plan = WsGemmPlan(wt.T, x.T, out, config=cfg)
        for _ in range(3):   # Gluon's path, the C launcher, its cached argument list
            out.fill_(float("nan"))
            plan.run(wt.T, x.T, out)
            assert _rel(out, ref) < 1e-2, dtype
        s = Schedule("ws", block_m, tile_n, 64, 1, 4, cfg.stages, True, swap=True)
        out.fill_(float("nan"))
        got = numasched.plan_matmul(x, wt, out, schedule=s).run(x, wt, out)
        assert got.data_ptr() == out.data_ptr() and _rel(out, ref) < 1e-2, dtype
    with pytest.raises(ValueError, match="out must have shape"):   # (M, N), not (M + 8, N)
        WsGemmPlan(wt.T, x.T, torch.empty(M + 8, N, device="cuda", dtype=x.dtype), config=cfg)


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs an sm_90 GPU")
def test_wide_config_refuses_other_forms():
    a, b, out, _ = _operands(256, 512, 512, torch.bfloat16, True)
    for cfg in (WsConfig(block_n=128, block_n1=48), WsConfig(block_n=64, block_n1=128),
                WsConfig(block_n=128, block_n1=32, streamk=True)):
        with pytest.raises(ValueError, match="block_n"):
            WsGemmPlan(a, b, out, config=cfg)
    # a 64 x 64 box of a (K, N) row-major b would be read as an (N, K) weight's
    with pytest.raises(ValueError, match="row-major b"):
        WsGemmPlan(a, b.contiguous(), out, config=WsConfig(block_n=64))
    WsGemmPlan(a, b, out, config=WsConfig(block_n=64))   # a weight's w.T: fine


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs an sm_90 GPU")
def test_thin_launch_takes_fresh_tensors_each_call():
    """After the first call the plan launches through the compiled kernel's C launcher; new
    operand and output tensors each call (an eager user's) must still be read and written."""
    w = torch.randn(640, 512, device="cuda", dtype=torch.bfloat16)
    plan = None
    for i in range(4):
        a = torch.randn(384, 512, device="cuda", dtype=torch.bfloat16)
        out = torch.full((384, 640), float("nan"), device="cuda", dtype=torch.bfloat16)
        plan = plan or WsGemmPlan(a, w.t(), out)
        plan.run(a, w.t(), out)
        ref = a.double() @ w.double().t()
        assert ((out.double() - ref).abs().max() / ref.abs().max()).item() < 1e-2, i
    assert plan._launch.raw is not None, "the later calls did not take the C launcher"


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs an sm_90 GPU")
@pytest.mark.parametrize("M,N,K,cfg", [(512, 768, 1024, WsConfig()), (256, 1536, 5120, _SK_FORMS["last-piece"]),
                                       (256, 1536, 5120, _SK_FORMS["bands"]), (256, 1536, 5120, _SK_FORMS["split3"]),
                                       (512, 2600, 1024, WsConfig(block_n=64, block_n1=16, stages=6)),
                                       (246, None, 2560, "tail")],
                         ids=["data-parallel", "stream-k", "stream-k-bands", "split-k-3", "wide-80", "tail-8"])
def test_cuda_graph_replay_sees_new_inputs(M, N, K, cfg):
    """Each form captured in a CUDA graph computes fresh inputs on replay (the tail form: two
    launches over column slabs, N past the SMs' whole round of 128 x 256 tiles by four columns)."""
    from numasched.gemm_ws import WsTailPlan

    if cfg == "tail":
        N = 256 * (-(-torch.cuda.get_device_properties(0).multi_processor_count // 2) + 4)
    a = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
    plan = (WsTailPlan(a, w.t(), out, block_n=256, split=8) if cfg == "tail"
            else WsGemmPlan(a, w.t(), out, config=cfg))
    plan.run(a, w.t(), out)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        plan.run(a, w.t(), out)
    for _ in range(3):
        a.copy_(torch.randn_like(a))
        out.fill_(float("nan"))
        g.replay()
        ref = a.double() @ w.double().t()
        assert ((out.double() - ref).abs().max() / ref.abs().max()).item() < 1e-2


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs an sm_90 GPU")
@pytest.mark.parametrize("with_scale", [False, True])
@pytest.mark.parametrize("M,n,K", [(1, 136, 72), (300, 520, 1000), (1031, 7168, 4096), (4096, 1000, 512)])
def test_swiglu_form_matches_float64(M, n, K, with_scale):
    from numasched.gemm_ws import GLU_CONFIG

    torch.manual_seed(M + n + K)
    a = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(2 * n, K, device="cuda", dtype=torch.bfloat16) / K ** 0.5
    b = w.t()
    scale = torch.rand(M, device="cuda", dtype=torch.float32) + 0.5 if with_scale else None
    out = torch.full((M, n), float("nan"), device="cuda", dtype=torch.bfloat16)
    WsGemmPlan(a, b, out, config=GLU_CONFIG, row_scale=scale).run(a, b, out, scale)
    gu = a.double() @ b.double()
    if with_scale:
        gu = gu * scale.double()[:, None]
    ref = torch.nn.functional.silu(gu[:, :n]) * gu[:, n:]
    assert ((out.double() - ref).abs().max() / ref.abs().max()).item() < 1e-2


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs an sm_90 GPU")
def test_matmul_swiglu_routes_prefill_sizes_to_it():
    import dataclasses

    import numasched

    opts = dataclasses.replace(numasched.options.current(), glu_ws=True)
    a = torch.randn(1024, 1024, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(2 * 768, 1024, device="cuda", dtype=torch.bfloat16) / 32
    plan = numasched.plan_matmul_swiglu(a, w.t(), options=opts)
    assert plan.path == "ws"
    out = plan.run(a, w.t())
    gu = a.double() @ w.double().t()
    ref = torch.nn.functional.silu(gu[:, :768]) * gu[:, 768:]
    assert ((out.double() - ref).abs().max() / ref.abs().max()).item() < 1e-2
    off = numasched.plan_matmul_swiglu(a, w.t(), options=dataclasses.replace(opts, glu_ws=False))
    assert off.path != "ws"


def test_ws_collective_launch_paths_pass_the_same_geometry(monkeypatch):
    """distributed._ws.launch (CPU, a recording stand-in for the compiled launch): the first call
    hands Gluon descriptors to the launch, the next plain ones of the same base, shape, strides and
    block, the third with the same pointers reuses that argument list through the C-launcher path,
    and a new operand pointer builds a new one."""
    import types

    from numasched import _launch
    from numasched.distributed import _ws

    class Recorder:
        def __init__(self, fn, grid, kwargs, device):
            self.kwargs, self.compiled, self.raw, self.calls, self.fulls = kwargs, None, None, [], []

        def __call__(self, *args):
            self.calls.append(args)
            self.compiled = self.raw = object()

        def full_args(self, args):
            return tuple(args)

        def call_full(self, full):
            self.fulls.append(full)

    monkeypatch.setattr(_launch, "Launch", Recorder)

    def first_b_block(run):
        return run.calls[0][1].block_shape

    rows, N, K = 256, 512, 128
    heap = torch.zeros(1 << 22, dtype=torch.bfloat16)
    out, recv = heap[:rows * N].view(rows, N), heap[rows * N:5 * rows * N].view(2, 2, rows, N)
    flags = torch.zeros(2, 2 * 8, dtype=torch.int64)
    ctx = types.SimpleNamespace(rank=0, num_sms=132, max_spins=1000, timeout_s=10.0, device=torch.device("cpu"),
                                heap_bases_host=[heap.data_ptr(), heap.data_ptr() + (1 << 30)],
                                status=torch.zeros(1, dtype=torch.int32))
    plan = types.SimpleNamespace(launchers={}, launches=0)
    w = torch.randn(N, K, dtype=torch.bfloat16)
    a1, a2 = torch.randn(rows, K, dtype=torch.bfloat16), torch.randn(rows, K, dtype=torch.bfloat16)
    kw = dict(b_store=w, b_trans=True, out=out, recv=recv, flags=flags, epoch=torch.zeros(1, dtype=torch.int64),
              counters=torch.zeros(2, dtype=torch.int32), rows=rows, N=N, K=K, residual=False, direct=True, rs=False)
    for a in (a1, a1, a1, a2):
        _ws.launch(ctx, plan, a=a, **kw)
    (run,) = [v for k, v in plan.launchers.items() if k[0] == "ws"]
    assert len(run.calls) == 3 and len(run.fulls) == 1 and plan.launches == 4
    # B as (K, N) row-major on the same plan: a launch of its own (the compiled B box differs;
    # sharing one gave wrong sums on two H100s), with (K, N) boxes
    _ws.launch(ctx, plan, a=a1, **dict(kw, b_store=w.t().contiguous(), b_trans=False))
    runs = {k[-1]: v for k, v in plan.launchers.items() if k[0] == "ws"}
    assert set(runs) == {True, False} and len(run.calls) == 3
    assert list(runs[False].calls[0][1].block_shape) == [64, 256] and list(first_b_block(run)) == [256, 64]
    first, second, fresh = run.calls
    assert run.fulls[0] == second   # the cached list is the second call's, reused as it is

    def geometry(d):
        return (d.base.data_ptr(), list(d.shape), list(d.strides), list(d.block_shape))

    assert [type(d).__name__ for d in first[:6]] == ["TensorDescriptor"] * 6
    assert [type(d) for d in second[:6]] == [_launch.HostDesc] * 6
    assert [geometry(d) for d in first[:6]] == [geometry(d) for d in second[:6]]
    def plain(x):   # pointer arguments (tensors, the peer's flags) by address
        return ("ptr", x.data_ptr()) if hasattr(x, "data_ptr") else x

    assert [plain(x) for x in first[6:]] == [plain(x) for x in second[6:]]
    assert geometry(fresh[0])[0] == a2.data_ptr() and geometry(second[0])[0] == a1.data_ptr()
    # the peer's out and receive slots: this rank's offsets in the peer's heap
    assert geometry(first[3])[0] == ctx.heap_bases_host[1] + (out.data_ptr() - heap.data_ptr())
    assert geometry(first[5])[0] == ctx.heap_bases_host[1] + (recv.data_ptr() - heap.data_ptr())


@settings(max_examples=200, deadline=None)
@given(tiles=st.integers(1, 300), k_steps=st.integers(1, 200), sms=st.integers(1, 140))
def test_streamk_ranges_cover_every_iteration_once(tiles, k_steps, sms):
    """The stream-K schedule (numasched.gemm_ws.streamk_ranges, the kernel's arithmetic): every
    (tile, K step) in exactly one program's range; a range holds at most two pieces of shared tiles
    (its first and its last), the rest whole tiles; a tile's owners are the programs that hold a
    piece of it, and the slot the merger reads for each (a range that began before the tile: its
    last piece) is the slot that program wrote."""
    from numasched.gemm_ws import streamk_ranges

    programs = min(sms, tiles * k_steps)
    pieces, owners = streamk_ranges(tiles, k_steps, programs)
    seen = {}
    total = tiles * k_steps
    for p, mine in enumerate(pieces):
        assert mine, "an empty range"
        start = p * total // programs
        shared = []
        for j, (t, k0, k1) in enumerate(mine):
            assert 0 <= k0 < k1 <= k_steps
            for k in range(k0, k1):
                assert (t, k) not in seen
                seen[(t, k)] = p
            first, last = owners[t]
            if first != last:
                shared.append(j)
                slot = int(t * k_steps + k0 != start)          # the writer's slot
                assert slot == int(p * total // programs < t * k_steps)   # the merger's rule
            else:
                assert (k0, k1) == (0, k_steps) and first == p
        assert all(j in (0, len(mine) - 1) for j in shared)
    assert len(seen) == total
    for t, (first, last) in enumerate(owners):
        assert {seen[(t, k)] for k in range(k_steps)} == set(range(first, last + 1))


@settings(max_examples=200, deadline=None)
@given(k_steps=st.integers(1, 400), split=st.integers(2, 16), n=st.integers(2, 40))
def test_split_parts_and_merge_bands_cover_once(k_steps, split, n):
    """sk_split's K parts (the kernel's arithmetic): contiguous, in order, none empty once S is
    capped at the K steps (as WsGemmPlan caps it); the banded merge's shares: every row band of a
    half tile summed by exactly one contributor, whatever n."""
    from numasched.gemm_ws import merge_bands, split_parts

    S = min(split, k_steps)
    parts = split_parts(k_steps, S)
    assert parts[0][0] == 0 and parts[-1][1] == k_steps
    assert all(a < b for a, b in parts) and all(parts[i][1] == parts[i + 1][0] for i in range(S - 1))
    shares = merge_bands(n)
    assert sorted(b for share in shares for b in share) == list(range(8))


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs an sm_90 GPU")
@pytest.mark.parametrize("form", list(_SK_FORMS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("b_weight", [True, False])
@pytest.mark.parametrize("M,N,K", [(1, 264, 72), (97, 520, 1000), (512, 2560, 8192), (300, 4096, 4096),
                                   (1031, 1000, 3000), (128, 256, 64), (4096, 2048, 512), (128, 2560, 8192)])
def test_streamk_matches_float64_and_repeats_its_bits(M, N, K, b_weight, dtype, form):
    a, b, out, ref = _operands(M, N, K, dtype, b_weight)
    plan = WsGemmPlan(a, b, out, config=_SK_FORMS[form])
    plan.run(a, b, out)
    assert _rel(out, ref) < 1e-2
    first = out.clone()
    for _ in range(3):   # the tickets are back at zero; the merge order fixes the bits
        out.fill_(float("nan"))
        plan.work.fill_(float("nan"))   # a partial read before it was written shows
        plan.run(a, b, out)
        assert torch.equal(out, first)
    assert not plan.tickets.any()
    plan.check()   # no wait ran out


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs an sm_90 GPU")
@pytest.mark.parametrize("form", list(_SK_FORMS))
@pytest.mark.parametrize("programs", [1, 2, 7])
def test_streamk_on_few_programs(form, programs):
    """Few programs: a range spans many tiles, and split-K programs own several units of one tile
    (the banded merge's contributor then departs once per unit)."""
    a, b, out, ref = _operands(300, 1000, 3000, torch.bfloat16, True)
    plan = WsGemmPlan(a, b, out, config=_SK_FORMS[form], num_programs=programs)
    plan.work.fill_(float("nan"))
    plan.run(a, b, out)
    assert _rel(out, ref) < 1e-2
    assert not plan.tickets.any()
    plan.check()


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs an sm_90 GPU")
def test_streamk_config_errors_name_the_field():
    a, b, out, _ = _operands(256, 512, 512, torch.bfloat16, True)
    for cfg, field in ((WsConfig(sk_merge=1), "sk_merge"), (WsConfig(streamk=True, sk_merge=2), "sk_merge"),
                       (WsConfig(streamk=True, sk_split=4), "sk_split"),
                       (WsConfig(streamk=True, sk_split=-1), "sk_split")):
        with pytest.raises(ValueError, match=field):
            WsGemmPlan(a, b, out, config=cfg)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    with pytest.raises(ValueError, match="num_programs"):
        WsGemmPlan(a, b, out, config=_SK_FORMS["bands"], num_programs=sms + 1)


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs an sm_90 GPU")
@pytest.mark.parametrize("block_n", [64, 128])
@pytest.mark.parametrize("M,N,K", [(128, 4096, 4096), (256, 2600, 8200), (97, 1000, 3000)])
def test_narrow_split_k_matches_float64(M, N, K, block_n):
    """split_config: split-K in K lockstep with 128 x 64 / 128 x 128 tiles, poisoned output,
    twice (the tickets back at zero between calls)."""
    a, b, out, ref = _operands(M, N, K, torch.bfloat16, True)
    tiles = -(-M // 128) * -(-N // block_n)
    plan = WsGemmPlan(a, b, out, config=split_config(block_n, 132 // tiles))
    for _ in range(2):
        out.fill_(float("nan"))
        plan.run(a, b, out)
        plan.check()
        assert _rel(out, ref) < 1e-2


def test_last_box_rows_only_where_the_last_tile_row_is_at_most_three_quarters_full():
    """The last tile row's A boxes: one or two powers of two (at least 16 rows) that cover its
    rows, the first half a tile where there are two, never as tall as the tile together, none
    where the row is full or more than 3/4 full."""
    for M in range(1, 1100):
        r1, r2 = last_box_rows(M)
        rem = M % 128
        if rem == 0 or rem > 96:
            assert (r1, r2) == (0, 0), M
            continue
        assert r1 in (16, 32, 64) and r2 in (0, 16, 32) and r1 + r2 >= rem and r1 + r2 < 128, (M, r1, r2)
        assert (r2 > 0) == (rem > 64) and (r2 == 0 or r1 == 64), (M, r1, r2)
        assert r1 + r2 - rem < max(16, rem - (64 if r2 else 0)), (M, r1, r2)   # less than doubled


def test_last_box_compiles_with_both_a_loads(compiled):
    """The last-box variants compile for sm_90 without spills, and their loader issues one more
    2-D TMA load than the same kernel without (A's short box beside its full one)."""
    tma = "cp.async.bulk.tensor.2d.shared::cluster.global"
    for v, plain in (("bf16-128x160-wide-last-box", "bf16-128x160-wide"),
                     ("bf16-glu-128x128-s4-last-box", "bf16-glu-128x128-s4-row-scale"),
                     ("bf16-128x128-split2-last-box", None)):
        r = compiled["last:" + v]
        assert r["ok"], (v, r.get("error"))
        assert r["spill_bytes"] == 0 and r["fits"], v
        loads = r["ptx"].count(tma)
        if plain:
            assert loads == compiled[plain]["ptx"].count(tma) + 1, (v, loads)
        else:
            assert loads >= 4, (v, loads)   # A's three descriptors (64 + 16 rows) and B's


def test_64_row_tiles_compile_with_one_consumer(compiled):
    """Tiles of 64 rows: one consumer warpgroup beside the loader (one register raise for it, no
    second K loop), no spills, its wgmma 64 rows by each box's columns."""
    for v, boxes in (("bf16-64x80-wide", (64, 16)), ("bf16-64x128-last-box", (128,))):
        r = compiled["last:" + v]
        assert r["ok"] and r["spill_bytes"] == 0 and r["fits"], (v, r.get("error"))
        ptx = r["ptx"]
        assert "setmaxnreg.dec.sync.aligned.u32 40;" in ptx, v
        assert "setmaxnreg.dec.sync.aligned.u32 232;" not in ptx, v     # no second consumer's share
        assert len(list(_k_loop_windows(ptx, 2 if len(boxes) == 2 else 1))) == 1, v
        for n in boxes:
            assert f"wgmma.mma_async.sync.aligned.m64n{n}k16.f32.bf16.bf16" in ptx, (v, n)


def test_transposed_form_compiles_with_transposed_stores(compiled):
    """SWAP_C (the weight as A, y stored transposed): the consumers' tiles go to shared memory by
    transposing stmatrix (the plain form's is not transposed), then TMA stores; one wgmma shape
    per box, a K loop per consumer (two or four), no spills, within shared memory; with B's last
    tile column in short boxes (B_LAST0/1) too (their bits: test_last_b_box_gives_the_bits_of_full_boxes)."""
    plain = compiled["bf16-128x256-s3"]["ptx"]
    assert "stmatrix.sync.aligned.m8n8.x4.shared.b16" in plain and ".trans.shared" not in plain
    for v, consumers, boxes in (("bf16-swap-128x96", 2, (64, 32)), ("bf16-swap-256x96", 4, (64, 32)),
                                ("bf16-swap-128x144-last-box", 2, (128, 16)), ("bf16-swap-128x144-last-b", 2, (128, 16)),
                                ("bf16-swap-128x128-last-b", 2, (128,))):
        r = compiled["swap:" + v]
        assert r["ok"] and r["spill_bytes"] == 0 and r["fits"], (v, r.get("error"))
        ptx = r["ptx"]
        assert "stmatrix.sync.aligned.m8n8.x4.trans.shared.b16" in ptx, v
        assert "stmatrix.sync.aligned.m8n8.x4.shared.b16" not in ptx, v
        assert "cp.async.bulk.tensor.2d.global.shared::cta.bulk_group" in ptx, v
        for n in boxes:
            assert f"wgmma.mma_async.sync.aligned.m64n{n}k16.f32.bf16.bf16" in ptx, (v, n)
        windows = list(_k_loop_windows(ptx, len(boxes)))
        assert len(windows) == consumers, v
        for w in windows:   # no CTA-wide barrier in a consumer's K step
            bars = [x.strip() for x in w if re.search(r"\bbar(rier)?\.sync\b", x)]
            assert all(re.fullmatch(r"bar\.sync\s+\d+,\s*128;", b) for b in bars), (v, bars)


def test_bias_and_residual_epilogue_compiles_without_spills(compiled):
    """BIAS / RESIDUAL: the data-parallel (two boxes), transposed and split-K forms compile for
    sm_90 within shared memory, no spills; the epilogue's loads are plain global loads after the
    K loop (the plain kernel has none: its epilogue is the store alone)."""
    assert "ld.global" not in compiled["bf16-128x256-s3"]["ptx"]
    for v in ("bf16-128x160-bias-residual", "bf16-swap-128x96-bias-residual", "bf16-128x128-split2-bias-residual"):
        r = compiled["epi:" + v]
        assert r["ok"] and r["spill_bytes"] == 0 and r["fits"], (v, r.get("error"))
        assert "ld.global" in r["ptx"], v
        assert "wgmma.mma_async" in r["ptx"], v


def _epilogue_operands(M, N, K, bias_dtype, res_dtype):
    """x (M, K), w (N, K), a bias and a residual (fresh), out poisoned, the float64 reference."""
    torch.manual_seed(3 * M + N + K)
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16)
    bias = torch.randn(N, device="cuda", dtype=bias_dtype) * 10
    res = torch.randn(M, N, device="cuda", dtype=res_dtype) * 10
    ref = x.double() @ w.double().t() + bias.double() + res.double()
    return x, w, bias, res, torch.full((M, N), float("nan"), device="cuda", dtype=torch.bfloat16), ref


_EPI_FORMS = {"dp256": dict(config=WsConfig()), "wide160": dict(config=wide_config(160)),
              "three208": dict(config=wide_config(208)), "rows64": dict(config=wide_config(96, block_m=64)),
              "swap96": dict(config=wide_config(96, swap=True)), "swap256x144": dict(config=wide_config(144, block_m=256, swap=True)),
              "split3": dict(config=split_config(128, 3)), "split8": dict(config=split_config(256, 8))}


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs an sm_90 GPU")
@pytest.mark.parametrize("form", list(_EPI_FORMS))
@pytest.mark.parametrize("bias_dtype,res_dtype", [(torch.float32, torch.bfloat16), (torch.bfloat16, torch.float32)])
@pytest.mark.parametrize("M,N,K", [(1, 264, 72), (97, 520, 1000), (300, 4104, 2048), (1031, 1000, 3000)])
def test_bias_and_residual_match_float64(M, N, K, bias_dtype, res_dtype, form):
    """y = x @ w.T + bias + residual by every WS form (data-parallel of one, two and three boxes,
    64-row tiles, transposed with 128 and 256 weight rows a tile, split-K), against float64 with
    out poisoned; the eager path three times (Gluon's path, the C launcher, its cached arguments),
    a residual with a column stride (a transposed view), and the residual being out itself."""
    x, w, bias, res, out, ref = _epilogue_operands(M, N, K, bias_dtype, res_dtype)
    cfg = _EPI_FORMS[form]["config"]
    a, b = (w, x.t()) if cfg.swap else (x, w.t())
    plan = WsGemmPlan(a, b, out, config=cfg, bias=bias, residual=res)
    for _ in range(3):
        out.fill_(float("nan"))
        plan.run(a, b, out, bias=bias, residual=res)
        assert _rel(out, ref) < 1e-2, form
    # a residual laid out column-major (strides (1, M)) and in out's own memory
    res_t = res.t().contiguous().t()
    plan_t = WsGemmPlan(a, b, out, config=cfg, bias=bias, residual=res_t)
    out.fill_(float("nan"))
    plan_t.run(a, b, out, bias=bias, residual=res_t)
    assert _rel(out, ref) < 1e-2, form
    if res_dtype == torch.bfloat16:
        inplace = res.clone()
        plan_in = WsGemmPlan(a, b, inplace, config=cfg, bias=bias, residual=inplace)
        plan_in.run(a, b, inplace, bias=bias, residual=inplace)
        assert _rel(inplace, ref) < 1e-2, form
    with pytest.raises(ValueError, match="bias and residual must be given"):
        plan.run(a, b, out)
    with pytest.raises(ValueError, match="bias must be"):
        WsGemmPlan(a, b, out, config=cfg, bias=bias[:-1])


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs an sm_90 GPU")
def test_bias_and_residual_through_matmul_every_ws_route_and_in_graphs():
    """numasched.matmul with a bias and a residual takes the WS kernel where the chooser does
    (512 rows: a data-parallel width) and runs each named WS form (transposed, split-K, tail) with
    the epilogue; in a CUDA graph each replay sees fresh inputs, bias and residual."""
    import numasched
    from numasched.gemm_schedule import Schedule

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    cases = [(512, 2560, 4096, None), (300, 2600, 4104, "ws 128x144x64 w4 s5 swap persistent"),
             (100, 4096, 4096, "ws 128x128x64 w4 s6 split3 persistent"),
             (246, 256 * (-(-sms // 2) + 4), 2560, "ws 128x256x64 w4 s3 split8 tail persistent")]
    for M, N, K, name in cases:
        x, w, bias, res, out, ref = _epilogue_operands(M, N, K, torch.bfloat16, torch.bfloat16)
        kw = {} if name is None else dict(schedule=Schedule.parse(name))
        plan = numasched.plan_matmul(x, w.t(), out, bias=bias, residual=res, **kw)
        assert plan.kernel == "ws", (M, N, K, plan.kernel)
        plan.run(x, w.t(), out, bias=bias, residual=res)
        assert _rel(out, ref) < 1e-2, (M, N, K)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            plan.run(x, w.t(), out, bias=bias, residual=res)
        for _ in range(2):
            x.copy_(torch.randn_like(x))
            bias.copy_(torch.randn_like(bias))
            res.copy_(torch.randn_like(res))
            out.fill_(float("nan"))
            g.replay()
            ref = x.double() @ w.double().t() + bias.double() + res.double()
            assert _rel(out, ref) < 1e-2, (M, N, K, "graph")


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs an sm_90 GPU")
@pytest.mark.parametrize("form", ["dp", "wide160", "split2", "glu"])
@pytest.mark.parametrize("M", [1, 17, 40, 70, 100, 140, 650])
def test_last_box_gives_the_bits_of_full_boxes(M, form):
    """A's last tile row in short boxes (options.gemm_ws_last_box) against 128-row boxes: the
    same bits in every row below M (the stale rows of the slot feed only rows past M), and the
    float64 reference; run twice (stale shared memory from the first call's tiles)."""
    from numasched import options
    from numasched.gemm_ws import GLU_CONFIG

    N, K = 1000, 1000
    torch.manual_seed(M)
    a = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(2 * N if form == "glu" else N, K, device="cuda", dtype=torch.bfloat16) / K ** 0.5
    cfg = {"dp": WsConfig(), "wide160": wide_config(160), "split2": split_config(128, 2), "glu": GLU_CONFIG}[form]
    outs = []
    for last in (True, False):
        with options.use(gemm_ws_last_box=last):
            out = torch.full((M, N), float("nan"), device="cuda", dtype=torch.bfloat16)
            plan = WsGemmPlan(a, w.t(), out, config=cfg)
            assert (plan.a_last[0] > 0) == (last and 0 < M % 128 <= 96), (last, plan.a_last)
            for _ in range(2):
                out.fill_(float("nan"))
                plan.run(a, w.t(), out)
            outs.append(out)
    gu = a.double() @ w.double().t()
    ref = torch.nn.functional.silu(gu[:, :N]) * gu[:, N:] if form == "glu" else gu
    assert _rel(outs[0], ref) < 1e-2
    assert torch.equal(outs[0], outs[1])


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs an sm_90 GPU")
@pytest.mark.parametrize("swap", [True, False])
@pytest.mark.parametrize("tile_n", [128, 144, 96, 160])
@pytest.mark.parametrize("cols", [296, 1000, 40, 1104])
def test_last_b_box_gives_the_bits_of_full_boxes(cols, tile_n, swap):
    """B's last tile column in short boxes (gemm_ws.last_b_rows, options.gemm_ws_last_box; the
    transposed form's, where ``cols`` are the tokens) against whole boxes: the same bits, the
    float64 reference, twice (stale shared memory). The plain form keeps whole boxes."""
    from numasched import options
    from numasched.gemm_ws import last_b_rows

    other, K = 520, 1000
    M, N = (cols, other) if swap else (other, cols)
    torch.manual_seed(cols + tile_n)
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16) / K ** 0.5
    cfg = wide_config(tile_n, swap=swap)
    a, b = (w, x.t()) if swap else (x, w.t())
    outs = []
    for last in (True, False):
        with options.use(gemm_ws_last_box=last):
            out = torch.full((M, N), float("nan"), device="cuda", dtype=torch.bfloat16)
            plan = WsGemmPlan(a, b, out, config=cfg)
            assert plan.b_last == (last_b_rows(cols, cfg.block_n, cfg.block_n1) if last and swap else (0, 0))
            for _ in range(2):
                out.fill_(float("nan"))
                plan.run(a, b, out)
            outs.append(out)
    assert _rel(outs[0], x.double() @ w.double().t()) < 1e-2
    assert torch.equal(outs[0], outs[1])


def test_last_b_rows_only_where_the_last_tile_column_is_at_most_three_quarters_full():
    from numasched.gemm_ws import last_b_rows

    for n0, n1 in [(128, 0), (256, 0), (64, 16), (64, 32), (128, 16), (128, 32), (128, 64)]:
        tile = n0 + n1
        for N in range(1, 3 * tile + 1):
            r0, r1 = last_b_rows(N, n0, n1)
            rem = N % tile
            if r0 == 0:
                assert rem == 0 or 4 * rem > 3 * tile or (n1 == 0 and rem > n0 // 2) or (rem > n0 and
                                                                                       rem - n0 > n1 // 2), (N, n0, n1)
                continue
            assert r0 <= n0 and r1 <= n1 and r0 >= 16 and (r1 == 0 or r1 >= 16)
            assert r0 & (r0 - 1) == 0 and r1 & (r1 - 1) == 0
            assert (r0 if r1 == 0 else n0 + r1) >= rem              # the boxes cover the column's rows
            assert r0 + r1 < tile                                    # and load fewer than whole boxes
            assert r1 == 0 or r0 == n0


def test_split_config_fits_and_refuses_other_widths():
    for bn in (64, 128, 256):
        cfg = split_config(bn, 4)
        assert cfg.streamk and cfg.sk_merge == 1 and cfg.sk_split == 4 and 3 <= cfg.stages <= 8
        assert cfg.stages * (128 + bn) * 64 * 2 <= 200 * 1024
    assert split_config(128, 1).sk_split == 2
    with pytest.raises(ValueError, match="block_n"):
        split_config(96, 2)


def test_hopper_check_never_takes_an_amd_part(monkeypatch):
    """caps.hopper (what gemm_ws.supported and the WS collectives ask): ROCm's torch reports an
    MI300X (gfx942) as capability 9.4, which must not read as an sm_90 GPU."""
    from numasched import caps

    monkeypatch.setattr(caps, "capability", lambda device: (9, 4))
    monkeypatch.setattr(torch.version, "hip", "6.2", raising=False)
    assert not caps.hopper(torch.device("cuda", 0))
    monkeypatch.setattr(torch.version, "hip", None, raising=False)
    assert caps.hopper(torch.device("cuda", 0))
    monkeypatch.setattr(caps, "capability", lambda device: (10, 0))
    assert not caps.hopper(torch.device("cuda", 0))
    assert not caps.hopper(torch.device("cpu"))


@settings(max_examples=300, deadline=None)
@given(M=st.integers(1, 5000), N=st.integers(1, 60000), block_n=st.sampled_from([128, 256]),
       sms=st.integers(1, 140))
def test_tail_columns_leave_whole_rounds_then_a_tail(M, N, block_n, sms):
    """tail_columns: the first n0 columns hold whole tile columns whose tiles fill whole rounds
    but for fewer than a tile column's worth of slots (NM), and the tiles past them are the rest
    of the grid, fewer than a round; (0, 0) exactly where the tiles make whole rounds or less
    than one, or the whole rounds hold no whole tile column."""
    from numasched.gemm_ws import tail_columns

    nm, nn = -(-M // 128), -(-N // block_n)
    rounds, rest = divmod(nm * nn, sms)
    n0, tail = tail_columns(M, N, block_n, sms)
    if not rounds or not rest or rounds * sms < nm:
        assert (n0, tail) == (0, 0)
        return
    assert n0 % block_n == 0 and 0 < n0 < N
    dp = nm * (n0 // block_n)
    assert rounds * sms - nm < dp <= rounds * sms
    assert dp + tail == nm * nn and 0 < tail < sms + nm


def test_tail_plan_errors_name_the_argument():
    """WsTailPlan refuses, naming the argument, before it plans a launch (no GPU needed)."""
    from numasched.gemm_ws import WsTailPlan

    a, b = torch.empty(246, 512, dtype=torch.bfloat16), torch.empty(512, 17920, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="block_n must be 128 or 256"):
        WsTailPlan(a, b, block_n=192, split=4, sms=132)
    with pytest.raises(ValueError, match="split must be >= 2"):
        WsTailPlan(a, b, block_n=256, split=1, sms=132)
    with pytest.raises(ValueError, match="no tail to split"):
        WsTailPlan(a, b[:, :256 * 66], block_n=256, split=4, sms=132)   # 132 tiles: one whole round
    with pytest.raises(ValueError, match="not \\(M, K\\) and \\(K, N\\)"):
        WsTailPlan(a, b.T, block_n=256, split=4, sms=132)


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs an sm_90 GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("b_weight", [True, False])
@pytest.mark.parametrize("M,K,block_n,split,extra", [(246, 1000, 256, 4, 4), (1031, 3000, 128, 2, 3),
                                                     (300, 4096, 128, 3, 1), (129, 2048, 256, 16, 2)])
def test_tail_plan_matches_float64_and_repeats_its_bits(M, K, block_n, split, extra, dtype, b_weight):
    """The WS tail form: whole rounds data-parallel over the first columns, the last round's tiles
    split in K over the rest (N past whole rounds by ``extra`` tile columns, the last one partial):
    float64 reference, poisoned output, the same bits on every call, the tickets back at zero;
    a plan made without out writes a contiguous out, one made with out its slabs."""
    from numasched.gemm_ws import WsTailPlan

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    nm = -(-M // 128)
    N = block_n * (-(-sms // nm) + extra) - 40
    a, b, out, ref = _operands(M, N, K, dtype, b_weight)
    for planned_out in (out, None):
        plan = WsTailPlan(a, b, planned_out, block_n=block_n, split=split)
        assert 0 < plan.n0 < N and plan.split == split
        out.fill_(float("nan"))
        plan.run(a, b, out)
        assert _rel(out, ref) < 1e-2
        first = out.clone()
        for _ in range(2):
            out.fill_(float("nan"))
            plan.tail.work.fill_(float("nan"))   # a partial read before it was written shows
            plan.run(a, b, out)
            assert torch.equal(out, first)
        assert not plan.tail.tickets.any()
        plan.check()
        assert _rel(plan.run(a, b), ref) < 1e-2   # its own contiguous out
