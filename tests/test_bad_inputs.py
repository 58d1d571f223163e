"""Bad input found when the library was tried as a new user would (issue: one shape for every op).

Each case here was a silent wrong result, an internal error or a crash before; now it is right or
a clear error naming the argument. (Other cases live beside their op's tests: bf16 on the
interpreter in test_attention/test_gemm/test_hf/test_decode, strided out= overlap in test_gemm,
unregistered policies under torch.compile in test_attention, bounded page indices in test_decode,
CLI in test_cli.)
"""
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
import triton
import triton.language as tl

import numasched
from numasched import mappings as M, topology
from numasched.caps import run_interpreted
from numasched.mappings.jit import gemm_tile


def test_interpreter_set_after_import_runs_every_call():
    # Triton picks JIT or interpreter when a kernel is defined: with TRITON_INTERPRET=1 set after
    # `import numasched` every call raised an internal InterpreterError.
    code = r"""
import os, torch
os.environ.pop("TRITON_INTERPRET", None)
import numasched
from numasched import mappings as M
M.get("grouped").remap.device  # the device functions exist (defined as JIT functions)
os.environ["TRITON_INTERPRET"] = "1"
torch.manual_seed(0)
a, b = torch.randn(20, 24), torch.randn(24, 18)
assert (numasched.matmul(a, b).double() - a.double() @ b.double()).abs().max() < 1e-4
q, k, v = torch.randn(1, 2, 9, 16), torch.randn(1, 2, 9, 16), torch.randn(1, 2, 9, 16)
ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
assert (numasched.scaled_dot_product_attention(q, k, v, is_causal=True) - ref).abs().max() < 1e-5
qd, kd = torch.randn(2, 4, 16), torch.randn(2, 11, 2, 16)
o = numasched.flash_decode(qd, kd, kd)
assert o.shape == (2, 4, 16) and torch.isfinite(o).all()
print("OK")
"""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "OK" in r.stdout, r.stderr[-3000:]


@triton.jit
def _tiles_of(PIDS, OUT, N, NM, NN, MAPPING: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    m = i < N
    pid = tl.load(PIDS + i, mask=m, other=0)
    tm, tn = gemm_tile(pid, NM, NN, MAPPING)
    tl.store(OUT + i * 2, tm, mask=m)
    tl.store(OUT + i * 2 + 1, tn, mask=m)


@pytest.mark.parametrize("policy", ["grouped", "chiplet_tiled", "chiplet_tiled_chunked", "row_major"])
@pytest.mark.parametrize("nm,nn", [(1, 2**30), (3, 7 * 10**8 // 3), (2**16, 2**15 - 1)])
def test_gemm_orders_do_not_overflow_int32_on_large_grids(policy, nm, nn):
    # GemmGrid accepts any grid of up to 2^31 - 1 tiles; the grouped order formed GM * NN, which
    # overflowed int32 for NN above ~2.7e8. Device math vs the int64 NumPy reference at ids
    # spread over the whole grid.
    grid = M.GemmGrid(nm, nn)
    pids = np.unique(np.linspace(0, grid.size - 1, 61).astype(np.int64))
    for X in (1, 8):
        want = M.get(policy).reference(pids, grid, X)
        out = torch.full((len(pids), 2), -7, dtype=torch.int32)
        run_interpreted(_tiles_of, (1,), (torch.tensor(pids, dtype=torch.int32), out, len(pids), nm, nn),
                        dict(MAPPING=M.get(policy).constexpr(X), BLOCK=64))
        assert (out.numpy() == want).all(), (policy, X)


def test_topology_refuses_num_domains_beyond_int32():
    with pytest.raises(ValueError, match="num_domains .* overflows int32"):
        topology.Topology.preset("mi300x").replace(num_domains=2**31, dispatch_offset=0)
    with pytest.raises(ValueError, match="num_domains"):
        M.get("grouped").constexpr(2**31)


def test_lazy_public_names_are_listed():
    names = dir(numasched)
    for n in ("flash_decode", "plan_decode", "matmul", "plan_matmul", "scaled_dot_product_attention",
              "plan_attention", "options", "observe", "distributed"):
        assert n in names and n in numasched.__all__, n
    assert callable(numasched.plan_decode) and numasched.decode.__name__ == "numasched.decode"
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        numasched.nope


def test_decode_bf16_on_the_interpreter_is_computed_in_fp32():
    torch.manual_seed(3)
    q = torch.randn(2, 8, 32).bfloat16()
    k, v = torch.randn(2, 40, 2, 32).bfloat16(), torch.randn(2, 40, 2, 32).bfloat16()
    out = numasched.flash_decode(q, k, v)
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.double()[:, :, None], k.double().transpose(1, 2), v.double().transpose(1, 2), enable_gqa=True)[:, :, 0]
    assert out.dtype == torch.bfloat16 and (out.double() - ref).abs().max() < 2e-2


def test_package_ships_types_and_license():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    assert os.path.exists(os.path.join(os.path.dirname(numasched.__file__), "py.typed"))
    assert os.path.exists(os.path.join(root, "LICENSE"))


# ---------------------------------------------------------------------------------------------
# Found by an audit of the public calls with bad inputs (sixty-first session), each a silent
# wrong result or an error that did not name the argument before.

def test_matmul_refuses_a_strided_or_expanded_bias():
    # the kernels read bias as N consecutive elements: a stride-2 view read the wrong entries,
    # an expanded (stride-0) one read past its storage
    a, b = torch.randn(16, 32), torch.randn(32, 16)
    for bias in (torch.randn(16, 2)[:, 0], torch.randn(1).expand(16)):
        with pytest.raises(ValueError, match="bias must be contiguous"):
            numasched.matmul(a, b, bias=bias)
        with pytest.raises(ValueError, match="bias must be contiguous"):
            numasched.plan_matmul(a, b, bias=bias)
    bias = torch.randn(16)
    ref = a.double() @ b.double() + bias.double()
    assert (numasched.matmul(a, b, bias=bias).double() - ref).abs().max() < 1e-4


def test_glu_swiglu_and_decode_refuse_outputs_that_share_memory():
    torch.manual_seed(0)
    x, w = torch.randn(16, 256), torch.randn(256, 256)
    with pytest.raises(ValueError, match="out shares memory with a"):
        numasched.matmul_swiglu(x, w, out=x[:, :128])   # the GEMM would read rows it had overwritten
    # also once a plan for that output layout is cached (the key holds layouts, not addresses)
    x2 = torch.randn(16, 256)
    numasched.matmul_swiglu(x2, w, out=torch.empty(16, 256)[:, :128])
    with pytest.raises(ValueError, match="out shares memory with a"):
        numasched.matmul_swiglu(x2, w, out=x2[:, :128])
    gu2 = torch.randn(8, 64)
    numasched.swiglu(gu2, out=torch.empty(8, 64)[:, :32])
    with pytest.raises(ValueError, match="out shares memory with gu"):
        numasched.swiglu(gu2, out=gu2[:, 32:])
    a, b = torch.randn(8, 32), torch.randn(32, 32)
    with pytest.raises(ValueError, match="out has stride 0"):
        numasched.matmul_swiglu(a, b, out=torch.empty(1, 16).expand(8, 16))
    gu = torch.randn(8, 32)
    with pytest.raises(ValueError, match="out has stride 0"):
        numasched.swiglu(gu, out=torch.empty(1, 16).expand(8, 16))
    q, k = torch.randn(2, 4, 32), torch.randn(2, 16, 2, 32)
    lens = torch.tensor([5, 16], dtype=torch.int32)
    plan = numasched.plan_decode(q, k, k, cache_seqlens=lens)
    with pytest.raises(ValueError, match="out has stride 0"):
        plan.run(q, k, k, lens, out=torch.empty(1, 4, 32).expand(2, 4, 32))
    with pytest.raises(ValueError, match="out shares memory with q"):
        plan.run(q, k, k, lens, out=q)
    # separate outputs still work, and agree with the plan's own
    out = torch.full_like(q, float("nan"))
    assert torch.equal(plan.run(q, k, k, lens, out=out), plan.run(q, k, k, lens))


def test_inference_only_calls_refuse_inputs_that_require_grad():
    # before: qkv_rope_cache silently returned q without grad; flash_decode / attention_forward
    # returned outputs whose backward failed later with torch's generic message
    q = torch.randn(2, 4, 32, requires_grad=True)
    k = torch.randn(2, 16, 2, 32)
    with pytest.raises(RuntimeError, match="flash_decode has no backward"):
        numasched.flash_decode(q, k, k)
    q4 = torch.randn(1, 2, 12, 32, requires_grad=True)
    with pytest.raises(RuntimeError, match="attention_forward has no backward"):
        numasched.attention_forward(q4, q4.detach(), q4.detach())
    T, H, HK, D = 3, 4, 2, 16
    qkv = torch.randn(T, (H + 2 * HK) * D, requires_grad=True)
    cos, sin = torch.ones(T, D), torch.zeros(T, D)
    kc, vc = torch.zeros(4, 8, HK, D), torch.zeros(4, 8, HK, D)
    with pytest.raises(RuntimeError, match="qkv_rope_cache has no backward"):
        numasched.qkv_rope_cache(qkv, cos, sin, kc, vc, torch.arange(T), heads=H, kv_heads=HK)
    with torch.no_grad():   # the same calls under no_grad run
        assert numasched.flash_decode(q, k, k).shape == q.shape
        numasched.qkv_rope_cache(qkv, cos, sin, kc, vc, torch.arange(T), heads=H, kv_heads=HK)


def test_flags_are_checked_whatever_the_plan_cache_holds():
    # True == 1 in a cache key: a plan made for scale=1 / persistent=True let scale=True /
    # persistent=1 through without their type checks
    q = torch.randn(1, 4, 12, 32)
    numasched.scaled_dot_product_attention(q, q, q, scale=1)
    with pytest.raises(TypeError, match="scale"):
        numasched.scaled_dot_product_attention(q, q, q, scale=True)
    a, b = torch.randn(8, 32), torch.randn(32, 16)
    numasched.matmul(a, b, persistent=True)
    with pytest.raises(TypeError, match="persistent"):
        numasched.matmul(a, b, persistent=1)
    k = torch.randn(1, 16, 2, 32)
    with pytest.raises(TypeError, match="return_lse"):
        numasched.flash_decode(torch.randn(1, 4, 32), k, k, return_lse="no")


@pytest.mark.parametrize("config,match", [("fast", "config must be a dict"), (42, "config must be a dict"),
                                          ({"bogus": 1}, "unknown key 'bogus'"),
                                          ({"BLOCK_N": 7}, r"config\['BLOCK_N'\] must be an int power of two"),
                                          ({"num_warps": True}, r"config\['num_warps'\]")])
def test_hand_given_kernel_configs_are_checked_by_name(config, match):
    qd, kd = torch.randn(2, 4, 32), torch.randn(2, 16, 2, 32)
    with pytest.raises((TypeError, ValueError), match=match):
        numasched.plan_decode(qd, kd, kd, config=config)
    with pytest.raises((TypeError, ValueError), match=match):
        numasched.plan_decode_worklist(qd, kd, kd, lengths=[16, 16], config=config)
    q = torch.randn(1, 2, 12, 32)
    with pytest.raises((TypeError, ValueError), match=match):
        numasched.plan_attention(q, q, q, config=config)


def test_plan_matmul_checks_schedule_and_config_types():
    a, b = torch.randn(8, 32), torch.randn(32, 16)
    with pytest.raises(TypeError, match="schedule must be a numasched.gemm_schedule.Schedule"):
        numasched.plan_matmul(a, b, schedule="garbage")
    with pytest.raises(TypeError, match="config must be a triton.Config"):
        numasched.plan_matmul(a, b, config="fast")


def test_distributed_shape_planners_check_their_arguments():
    import numasched.distributed as nd

    a = torch.randn(8, 32)
    with pytest.raises(ValueError, match="K_local = 32"):
        nd.plan_matmul_all_reduce(a, torch.randn(16, 16), world=2)
    with pytest.raises(ValueError, match="world"):
        nd.plan_matmul_all_reduce(a, torch.randn(32, 16), world=-3)
    with pytest.raises(TypeError, match="world"):
        nd.plan_matmul_all_reduce(a, torch.randn(32, 16), world=2.5)
    with pytest.raises(TypeError, match="a has dtype torch.int32"):
        nd.plan_matmul_all_reduce(a.int(), torch.ones(32, 16, dtype=torch.int32), world=2)
    with pytest.raises(TypeError, match="a must be a torch.Tensor"):
        nd.plan_matmul_all_reduce(a.tolist(), torch.randn(32, 16), world=2)
    assert nd.plan_matmul_all_reduce(a, torch.randn(32, 16), world=2).describe().startswith("matmul_all_reduce 8x16x32")
    with pytest.raises(ValueError, match="world must be a positive int"):
        nd.required_heap_bytes([("all_reduce", torch.randn(8, 8))], world=0)
    with pytest.raises(ValueError, match="K = 32"):
        nd.required_heap_bytes([("all_gather_matmul", a, torch.randn(16, 16))], world=2)
    with pytest.raises(TypeError, match=r"workload\[0\] must be a tuple"):
        nd.required_heap_bytes(["all_reduce"], world=2)
    with pytest.raises(ValueError, match="heap_bytes"):
        nd.SimWorld(1, heap_bytes=-5)
    with pytest.raises(TypeError, match="world must be an int"):
        nd.SimWorld(2.0)


def test_qkv_rope_cache_refuses_one_cache_for_both_and_expanded_caches():
    T, H, HK, D = 3, 4, 2, 16
    qkv = torch.randn(T, (H + 2 * HK) * D)
    cos, sin = torch.ones(T, D), torch.zeros(T, D)
    slots = torch.tensor([0, 3, 5])
    c = torch.zeros(10, HK, D)
    with pytest.raises(ValueError, match="k_cache and v_cache start at the same address"):
        numasched.qkv_rope_cache(qkv, cos, sin, c, c, slots, heads=H, kv_heads=HK)
    with pytest.raises(ValueError, match="k_cache has stride 0"):
        numasched.qkv_rope_cache(qkv, cos, sin, torch.zeros(1, HK, D).expand(10, HK, D), torch.zeros(10, HK, D),
                                 slots, heads=H, kv_heads=HK)
    kc, vc = torch.zeros(10, HK, D), torch.zeros(10, HK, D)
    numasched.qkv_rope_cache(qkv, cos, sin, kc, vc, slots, heads=H, kv_heads=HK)
    assert torch.equal(vc[slots], qkv.view(T, H + 2 * HK, D)[:, H + HK:])


def test_checks_hold_when_the_plan_cache_hits():
    # the plan caches key on layouts and flags, not addresses: the per-call checks must still run
    T, H, HK, D = 3, 4, 2, 16
    qkv = torch.randn(T, (H + 2 * HK) * D)
    cos, sin = torch.ones(T, D), torch.zeros(T, D)
    slots = torch.tensor([0, 3, 5])
    numasched.qkv_rope_cache(qkv, cos, sin, torch.zeros(10, HK, D), torch.zeros(10, HK, D), slots, heads=H,
                             kv_heads=HK)
    c = torch.zeros(10, HK, D)
    with pytest.raises(ValueError, match="k_cache and v_cache start at the same address"):
        numasched.qkv_rope_cache(qkv, cos, sin, c, c, slots, heads=H, kv_heads=HK)
    q, k = torch.randn(1, 4, 32), torch.randn(1, 16, 2, 32)
    numasched.flash_decode(q, k, k, scale=1.0)
    numasched.flash_decode(q, k, k)
    with pytest.raises(TypeError, match="return_lse"):
        numasched.flash_decode(q, k, k, return_lse="no")
    with pytest.raises(TypeError, match="scale"):
        numasched.flash_decode(q, k, k, scale=True)


def test_overlap_checks_read_no_data():
    # meta outputs (plans from signatures) pass; expanded ones are still refused by layout
    from numasched._validate import check_no_overlap

    gu = torch.empty(8, 64, device="meta")
    check_no_overlap(torch.empty(8, 32, device="meta"), gu=gu)
    check_no_overlap(torch.empty(8, 64, device="meta")[:, :32], gu=gu)
    with pytest.raises(ValueError, match="stride 0"):
        check_no_overlap(torch.empty(1, 32, device="meta").expand(8, 32), gu=gu)
    # big column slices of one matrix (past the element-by-element limit) are told apart by layout
    big = torch.empty(5000, 2000)
    check_no_overlap(big[:, 1000:], a=big[:, :1000])
    with pytest.raises(ValueError, match="out shares memory with a"):
        check_no_overlap(big[:, 500:1500], a=big[:, :1000])
    # a transposed or permuted output is checked by its strides alone
    check_no_overlap(torch.empty(4, 8).T, a=torch.empty(8, 4))
    check_no_overlap(torch.empty(2, 3, 4).permute(2, 0, 1), q=torch.empty(4, 2, 3))


@pytest.mark.parametrize("op", ["swiglu", "matmul_swiglu"])
def test_glu_with_out_compiles_fullgraph(op):
    # the overlap check runs in the eager plan, not in the traced wrapper
    gu, a, b = torch.randn(8, 64), torch.randn(8, 32), torch.randn(32, 64)
    if op == "swiglu":
        fn = torch.compile(lambda x, o: numasched.swiglu(x, out=o), backend="eager", fullgraph=True)
        out = fn(gu, torch.empty(8, 32))
        ref = torch.nn.functional.silu(gu[:, :32]) * gu[:, 32:]
    else:
        fn = torch.compile(lambda x, w, o: numasched.matmul_swiglu(x, w, out=o), backend="eager", fullgraph=True)
        out = fn(a, b, torch.empty(8, 32))
        y = a.double() @ b.double()
        ref = torch.nn.functional.silu(y[:, :32]) * y[:, 32:]
    assert (out.double() - ref.double()).abs().max() < 1e-3


def test_all_reduce_add_rmsnorm_refuses_an_out_on_the_residual_or_of_another_dtype():
    import numasched.distributed as nd

    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(4, 16, generator=g) for _ in range(2)]
    h, w = torch.randn(4, 16, generator=g), torch.ones(16)
    hs = [h.clone(), h.clone()]
    # out=residual would leave the normalised rows where the new residual stream belongs
    with pytest.raises(ValueError, match="out shares memory with residual"):
        nd.SimWorld(2).run_each("all_reduce_add_rmsnorm", [((xs[i], hs[i], w, 1e-6), dict(out=hs[i])) for i in range(2)])
    with pytest.raises(TypeError, match="out has dtype torch.int32"):
        nd.SimWorld(2).run_each("all_reduce_add_rmsnorm", [((xs[i], h.clone(), w, 1e-6),
                                                             dict(out=torch.empty(4, 16, dtype=torch.int32)))
                                                            for i in range(2)])
    # out may be x itself (the pushed form's own use)
    res = nd.SimWorld(2).run_each("all_reduce_add_rmsnorm", [((xs[i].clone(), h.clone(), w, 1e-6), {})
                                                              for i in range(2)])
    r = (h.double() + xs[0].double() + xs[1].double())
    ref = r / torch.sqrt((r * r).mean(-1, keepdim=True) + 1e-6)
    assert (res[0][1].double() - ref).abs().max() < 1e-4


def test_ragged_model_lengths_are_whole_numbers():
    from numasched import sim

    for bad in ("4096", (300.9, 7.5), (True, 5)):
        with pytest.raises(ValueError, match="lengths must be a sequence of ints"):
            sim.RaggedDecodeModel(bad, 32, 8, 128)
    assert sim.RaggedDecodeModel(np.array([300, 7]), 32, 8, 128).lengths == (300, 7)


def test_cli_arguments_are_checked_before_any_run(tmp_path):
    from numasched.bench import collectives, e2e
    from numasched import cli

    p = collectives.build_parser()
    for argv in (["--rows", "abc"], ["--rows", "0,3"], ["--nproc", "-3"], ["--calls", "-5"], ["--iters", "0"],
                 ["--only", "foo"]):
        with pytest.raises(SystemExit):
            p.parse_args(argv)
    args = p.parse_args(["--rows", "16,64", "--only", "ar,mar"])
    assert args.m == [16, 64] and args.only == ["ar", "mar"]
    with pytest.raises(SystemExit):
        e2e.build_parser().parse_args(["--ar-impl", "ring"])
    for out in (str(tmp_path), str(tmp_path / "missing" / "t.json")):
        with pytest.raises(SystemExit):
            cli.main(["tune-gemm", "--shapes", "16x64x64", "--out", out, "--dry-run"])
    assert cli.main(["tune-gemm", "--shapes", "16x64x64", "--out", str(tmp_path / "t.json"), "--dry-run"]) == 0


def test_sim_and_distributed_helpers_check_their_numbers():
    import numasched.distributed as nd
    from numasched import sim
    from numasched.distributed import cost

    m = sim.AttentionModel(1, 2, 2, 128, 128, 64, block_m=64, block_n=64)
    for bad in (float("nan"), True, float("inf")):
        with pytest.raises(ValueError, match="peak_flops"):
            sim.simulate("mi300x", m, peak_flops=bad)
    with pytest.raises(ValueError, match="slots must be an int >= 1"):
        sim.schedule(np.array([0, 1]), np.array([1, 1]), 2, 0)
    with pytest.raises(ValueError, match="domains must lie in"):   # was: uninitialised start ticks
        sim.schedule(np.array([0, 1, 5]), np.array([1, 1, 1]), 2, 1)
    for args, name in (((-3, 100), "batch"), ((4, 0), "seq")):
        with pytest.raises(ValueError, match=name):
            sim.lengths_uniform(*args)
    ctx = nd.SimWorld(1).ranks[0]
    with pytest.raises(ValueError, match="eps must be a finite"):   # inf zeroed the output
        nd.all_reduce_add_rmsnorm(torch.randn(4, 16), torch.randn(4, 16), torch.ones(16), float("inf"), ctx=ctx)
    for args in ((-5, 2), (1024, 0), (1024.0, 2)):
        with pytest.raises(ValueError):
            cost.choose_all_reduce(*args)
    world = nd.SimWorld(2)
    x = torch.randn(8, 8)
    with pytest.raises(ValueError, match="unknown op 'all_to_all'"):
        world.run("all_to_all", [(x,), (x,)])
    with pytest.raises(ValueError, match="one entry per rank"):
        world.run("all_reduce", [(x,)])
    with pytest.raises(TypeError, match="per-rank argument tuples"):
        world.run("all_reduce", [x, x])
    with pytest.raises(ValueError, match="skip_ranks"):
        world.run("all_reduce", [(x,), (x,)], skip_ranks=[7])
    with pytest.raises(ValueError, match="num_sms"):
        nd.SimWorld(1, num_sms=0)


def test_topology_probe_and_reference_helpers_name_what_is_wrong(tmp_path):
    import numasched.distributed as nd
    from numasched.models import TPDecoder
    from numasched.probe.files import load_raw
    from numasched.topology import Topology

    d = Topology.preset("mi300x").to_dict()
    for bad in (None, 3, "01"):
        with pytest.raises(ValueError, match="dispatch_table must be a list"):
            Topology.from_dict(dict(d, dispatch_table=bad))
    with pytest.raises(ValueError, match="needs a probe JSON path or its dict"):
        Topology.from_probe(42)
    with pytest.raises(ValueError, match="'device' must be the GPU's name"):
        Topology.from_probe({"device": 5, "num_sms": 132, "l2_bytes": 50 << 20})
    with pytest.raises(TypeError, match="topology must be a numasched.topology.Topology"):
        M.get("grouped").domains_of_items(M.GemmGrid(2, 2), "mi300x")
    junk = tmp_path / "junk.txt"
    junk.write_text("not a probe")
    with pytest.raises(ValueError, match="not a numasched raw probe file"):
        load_raw(junk)
    q, k = torch.randn(2, 3, 32), torch.randn(2, 16, 2, 32)
    with pytest.raises(ValueError, match="not a multiple of k_cache's 2 KV heads"):
        nd.torch_local_decode(q, k, k, torch.tensor([5, 16], dtype=torch.int32))
    with pytest.raises(ValueError, match="past the cache's 16 tokens"):
        nd.torch_local_decode(torch.randn(2, 4, 32), k, k, torch.tensor([5, 40], dtype=torch.int32))
    with pytest.raises(TypeError, match="model must be a transformers"):
        TPDecoder.from_hf({})
