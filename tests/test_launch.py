"""The thin launch (numasched._launch.Launch), the plan cache and the routing helpers, on CPU.

The GPU branch of Launch is checked with stand-in kernels: the first call goes through Triton
(compiling, or autotuning once), later calls hand the arguments straight to the compiled kernel
with the constexpr tail appended; a capture before tuning uses the fixed config.
"""
import warnings

import pytest
import torch
import triton

from numasched import _launch, caps, mappings as M, options
from numasched._plan import PlanCache, PlanKey
from numasched._route import mapping_token, reset_warnings, warn_once


class _Param:
    def __init__(self, default=None, has_default=False):
        self.default, self.has_default = default, has_default


class _Compiled:
    """Stands in for triton's CompiledKernel: records what its launcher got."""

    function = "fn-handle"
    packed_metadata = "meta"

    def __init__(self):
        self.runs = []

    def run(self, *args):
        self.runs.append(args)

    def launch_metadata(self, *a):
        return "launch-meta"


class _Kernel:
    """Stands in for a JITFunction with arguments (x, n, A: constexpr, B: constexpr = 7)."""

    arg_names = ["x", "n", "A", "B"]
    params = [_Param(), _Param(), _Param(), _Param(7, True)]

    def __init__(self):
        self.calls = []
        self.compiled = _Compiled()

    def __getitem__(self, grid):
        def runner(*args, **kw):
            self.calls.append((grid, args, kw))
            return self.compiled
        return runner


class _Tuner:
    def __init__(self, best):
        self.calls, self.best_config = [], best

    def __getitem__(self, grid):
        def runner(*args, **kw):
            self.calls.append((grid, args, kw))
        return runner


@pytest.fixture
def gpu_like(monkeypatch):
    monkeypatch.setattr(_launch, "_raw_stream", lambda index: 1234)
    capturing = [False]
    monkeypatch.setattr(caps, "capturing_index", lambda index: capturing[0])
    return capturing


def test_thin_launch_after_first_call(gpu_like):
    k = _Kernel()
    la = _launch.Launch(k, 5, dict(A=3), device=torch.device("cuda", 0), config=dict(num_warps=4))
    la("x0", 10)
    assert len(k.calls) == 1 and k.calls[0][0] == (5, 1, 1) and k.calls[0][2] == dict(A=3, num_warps=4)
    la("x1", 10)
    la("x2", 10)
    assert len(k.calls) == 1, "later calls must not go through Triton's binder"
    runs = k.compiled.runs
    assert len(runs) == 2
    # grid, stream, function, metadata, no hooks, then every argument incl. the constexpr tail
    assert runs[1] == (5, 1, 1, 1234, "fn-handle", "meta", None, None, None, "x2", 10, 3, 7)


def test_thin_launch_gives_profiler_hooks_what_triton_gives(gpu_like):
    k = _Kernel()
    la = _launch.Launch(k, (2, 3), dict(A=1), device=torch.device("cuda", 0))
    la("x", 1)
    hook = lambda meta: None  # noqa: E731
    triton.knobs.runtime.launch_enter_hook.add(hook)
    try:
        la("y", 1)
    finally:
        triton.knobs.runtime.launch_enter_hook.remove(hook)
    run = k.compiled.runs[-1]
    assert run[6] == "launch-meta" and run[7] is triton.knobs.runtime.launch_enter_hook


def test_autotune_once_then_plain_kernel(gpu_like):
    k = _Kernel()
    best = triton.Config({"BLOCK": 32}, num_warps=2, num_stages=4)
    tuner = _Tuner(best)
    la = _launch.Launch(k, lambda kw: (kw["BLOCK"],), dict(A=1), device=torch.device("cuda", 0), tuner=tuner,
                        fixed=dict(BLOCK=64, num_warps=4, num_stages=3))
    assert not la.tuned and la.config is None
    gpu_like[0] = True  # capturing before tuning: the fixed config, nothing tuned
    la("x", 1)
    assert not tuner.calls and k.calls[-1][0] == (64, 1, 1) and k.calls[-1][2]["BLOCK"] == 64
    assert la.compiled is None
    gpu_like[0] = False
    la("x", 1)  # tunes
    assert len(tuner.calls) == 1 and "BLOCK" not in tuner.calls[0][2]
    assert la.tuned and {k: la.config[k] for k in ("BLOCK", "num_warps", "num_stages")} == dict(BLOCK=32, num_warps=2, num_stages=4)
    la("x", 1)  # the plain kernel with the chosen config, then thin
    assert k.calls[-1][0] == (32, 1, 1) and k.calls[-1][2]["num_warps"] == 2
    la("x", 1)
    assert len(tuner.calls) == 1 and len(k.compiled.runs) == 1


def test_interpreted_launch_of_kernels_defined_before_the_variable(monkeypatch):
    # mappings' device functions were defined when TRITON_INTERPRET may not have been set: run
    # them through the interpreter anyway (the bug: every call raised an InterpreterError)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    got = M.device_map("grouped", M.GemmGrid(3, 5), 1)
    want = M.get("grouped").reference(range(15), M.GemmGrid(3, 5), 1)
    assert (got == want).all()


def test_plan_cache_is_bounded_lru():
    c = PlanCache(3)
    for i in range(5):
        c.put(PlanKey("op", (i,), (), ()), i)
    assert len(c) == 3 and c.get(PlanKey("op", (0,), (), ())) is None
    assert c.get(PlanKey("op", (2,), (), ())) == 2  # touched: now the newest
    c.put(PlanKey("op", (9,), (), ()), 9)
    assert c.get(PlanKey("op", (2,), (), ())) == 2 and c.get(PlanKey("op", (3,), (), ())) is None
    with pytest.raises(ValueError):
        PlanCache(0)


def test_options_are_values_with_named_errors():
    o = options.current()
    assert o == options.Options(**{f: getattr(o, f) for f in ("autotune", "check_data", "decode_combine",
                                                               "gemm_flatten", "dist_tma")})
    with options.use(autotune=not o.autotune) as new:
        assert options.current() == new and new.autotune != o.autotune and hash(new) != hash(o)
    assert options.current() == o
    with pytest.raises(TypeError, match="unknown option"):
        o.replace(bogus=1)
    with pytest.raises(ValueError, match="decode_combine"):
        options.Options(decode_combine="both")
    with pytest.raises(TypeError, match="autotune must be a bool"):
        options.Options(autotune=1)
    env = options.from_env({"NUMASCHED_AUTOTUNE": "0", "NUMASCHED_DECODE_COMBINE": "kernel",
                            "NUMASCHED_DIST_TMA": "1"})
    assert env.autotune is False and env.decode_combine == "kernel" and env.dist_tma is True
    # the PDL trigger: a mode, or the former bool (also in the environment: 1 / 0)
    assert options.Options(pdl_trigger=False).pdl_trigger == "none"
    assert options.Options(pdl_trigger=True).pdl_trigger == "early"
    assert options.from_env({"NUMASCHED_PDL_TRIGGER": "late"}).pdl_trigger == "late"
    assert options.from_env({"NUMASCHED_PDL_TRIGGER": "0"}).pdl_trigger == "none"
    assert options.from_env({"NUMASCHED_PDL_TRIGGER": " Late "}).pdl_trigger == "late"
    assert options.from_env({"NUMASCHED_PDL_TRIGGER": "off"}).pdl_trigger == "none"
    assert options.from_env({"NUMASCHED_PDL_TRIGGER": ""}).pdl_trigger == options.Options().pdl_trigger
    with pytest.raises(ValueError, match="pdl_trigger"):
        options.from_env({"NUMASCHED_PDL_TRIGGER": "sometimes"})
    with pytest.raises(ValueError, match="pdl_trigger"):
        options.Options(pdl_trigger="sometimes")


def test_mapping_tokens_carry_unregistered_policies():
    pol = M.compose("xcd_remap_chunked", "block_first", name="test_token_policy")
    tok = mapping_token(pol, "attention")
    assert "#" in tok and M.get(tok) is pol and M.from_token(tok) is pol
    assert mapping_token(M.compose("xcd_remap_chunked", "block_first", name="test_token_policy"), "decode") == tok
    assert mapping_token("grouped", "gemm") == "grouped"
    with pytest.raises(ValueError, match="this process did not make"):
        M.get("head_first#999999")
    with pytest.raises(ValueError, match="cannot serve gemm"):
        mapping_token(pol, "gemm")
    with pytest.raises(TypeError, match="mapping must be"):
        mapping_token(3, "gemm")


def test_warn_once_points_at_the_caller():
    reset_warnings()
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        warn_once("test message xyz")
        warn_once("test message xyz")
    assert len(w) == 1 and w[0].filename == __file__ and issubclass(w[0].category, RuntimeWarning)


def test_registry_version_changes_with_what_names_resolve_to():
    v0 = M.version()
    rule = M.register_auto(lambda kind, topo, grid, causal: None)
    assert M.version() > v0
    M.unregister_auto(rule)
    v1 = M.version()
    M.set_default("gemm", "row_major")
    M.set_default("gemm", None)
    assert M.version() > v1


# ----------------------------------------------------------------------------- programmatic dependent launch
class _PdlKernel(_Kernel):
    arg_names = ["x", "n", "A", "B", "PDL"]
    params = _Kernel.params + [_Param(False, True)]


def test_pdl_only_for_kernels_that_wait_on_sm90_with_the_option(monkeypatch, gpu_like):
    cap = [(9, 0)]
    monkeypatch.setattr(caps, "capability", lambda device: cap[0])
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert _launch.wants_pdl(_PdlKernel(), cuda, False)
    assert not _launch.wants_pdl(_Kernel(), cuda, False)     # the kernel does not wait: never
    assert not _launch.wants_pdl(_PdlKernel(), cuda, True)   # the interpreter
    assert not _launch.wants_pdl(_PdlKernel(), cpu, False)
    with options.use(pdl=False):
        assert not _launch.wants_pdl(_PdlKernel(), cuda, False)
    cap[0] = (8, 0)
    assert not _launch.wants_pdl(_PdlKernel(), cuda, False)
    cap[0] = (9, 0)
    # the launch carries PDL=True (the kernel waits) and launch_pdl=True (the attribute) together,
    # and PDL lands in the constexpr tail of the thin launches
    k = _PdlKernel()
    with options.use(pdl_trigger="early"):
        launch = _launch.Launch(k, (4,), {"A": 3}, device=cuda, config={"num_warps": 4})
    launch("x", 10)
    (_, args, kw), = k.calls
    assert kw["PDL"] == 1 and kw["launch_pdl"] is True
    assert launch.tail == (3, 7, 1)
    with options.use(pdl_trigger=False):   # wait only: the next kernel launches at completion
        k3 = _PdlKernel()
        _launch.Launch(k3, (4,), {"A": 3}, device=cuda, config={"num_warps": 4})("x", 10)
        assert k3.calls[0][2]["PDL"] == 2 and k3.calls[0][2]["launch_pdl"] is True
    # "late": kernels with a late point (the GEMMs) trigger there (3), the others early (1)
    from numasched.kernels import flash_decode, gemm, gemm_splitk, gemm_streamk, pdl

    with options.use(pdl_trigger="late"):
        k5 = _PdlKernel()
        _launch.Launch(k5, (4,), {"A": 3}, device=cuda, config={"num_warps": 4})("x", 10)
        assert k5.calls[0][2]["PDL"] == 1
    for fn in (gemm.gemm_kernel, gemm_splitk.gemm_splitk_kernel, gemm_streamk.gemm_streamk_kernel,
               gemm.tuned_kernel("tma", None, False), flash_decode._flash_decode_kernel):
        assert pdl.has_late_point(fn)
    from numasched.kernels import copy_rows

    assert not pdl.has_late_point(flash_decode._combine_kernel) and not pdl.has_late_point(copy_rows.copy_rows_kernel)
    assert [pdl.pdl_value(t, late) for t in pdl.TRIGGER_MODES for late in (False, True)] == [1, 1, 1, 3, 2, 2]
    assert pdl.TRIGGER_MODES == options.TRIGGER_MODES
    # a plan's own options win over the current ones
    k4 = _PdlKernel()
    _launch.Launch(k4, (4,), {"A": 3}, device=cuda, config={"num_warps": 4},
                   options=options.current().replace(pdl=False))("x", 10)
    assert "PDL" not in k4.calls[0][2]
    with options.use(pdl=False):
        k2 = _PdlKernel()
        _launch.Launch(k2, (4,), {"A": 3}, device=cuda, config={"num_warps": 4})("x", 10)
        assert "launch_pdl" not in k2.calls[0][2] and "PDL" not in k2.calls[0][2]


def test_every_pdl_kernel_waits_before_touching_memory():
    """A kernel launched with PDL may start while its predecessor still runs: nothing before its
    wait (kernels/pdl.py: ``pdl_enter``) may load, store or do atomics; index arithmetic, the
    early trigger and L2 prefetches of weights are allowed (helpers of the same module are
    followed; imported index-math helpers are allowlisted). One exception, named here: flash_decode's
    ``_prefetch_kv`` loads a sequence length and page indices before the wait, which only pick the
    addresses of L2 prefetches (clamped into the cache; a stale value costs a useless prefetch; a
    prefetch returns no data); it and the helpers it calls must store nothing."""
    import ast
    import inspect

    from numasched.kernels import (dist_allreduce, dist_gemm_ar, flash_decode, flash_decode_worklist, gemm,
                                   gemm_splitk, gemm_streamk, swiglu)

    memory = {"load", "store", "atomic_add", "atomic_xchg", "atomic_cas", "atomic_max", "atomic_min", "atomic_or",
              "atomic_and", "gdc_wait"}
    imported_index_math = {"gemm_split_unit", "gemm_tail_unit", "gemm_tile", "decode_item"}
    hints = {"_prefetch_kv"}   # loads that only pick prefetch addresses (the docstring)

    def touches(node, helpers, seen) -> list:
        bad = []
        for call in (n for n in ast.walk(node) if isinstance(n, ast.Call)):
            f = call.func
            name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", None)
            if name in memory:
                bad.append(name)
            elif isinstance(f, ast.Name) and name in hints:
                # loads allowed, nothing else that touches memory, in it or any helper it calls
                bad += [f"{name}: {b}" for b in touches(helpers[name], helpers, seen | {name}) if b != "load"]
            elif isinstance(f, ast.Name) and name in helpers and name not in seen:
                bad += touches(helpers[name], helpers, seen | {name})
            elif isinstance(f, ast.Name) and name not in helpers and name not in imported_index_math \
                    and name not in ("pdl_trigger", "prefetch_l2", "range", "max", "min", "int"):
                bad.append(name)   # an unknown helper before the wait: not allowed
        return bad

    found = 0
    for mod in (dist_allreduce, dist_gemm_ar, flash_decode, flash_decode_worklist, gemm, gemm_splitk, gemm_streamk,
                swiglu):
        tree = ast.parse(inspect.getsource(mod))
        helpers = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}
        for fn in helpers.values():
            # every function taking PDL is a kernel, except helpers that only pass it on to pdl_late
            if "PDL" not in [a.arg for a in fn.args.args] or fn.name in ("_gemm_one_tile",):
                continue
            found += 1
            body = [s for s in fn.body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
            waits = [i for i, st in enumerate(body)
                     if isinstance(st, ast.Expr) and isinstance(st.value, ast.Call)
                     and getattr(st.value.func, "id", None) == "pdl_enter"]
            assert waits, f"{mod.__name__}.{fn.name} never calls pdl_enter at its top level"
            for st in body[:waits[0]]:
                assert not touches(st, helpers, {fn.name}), \
                    f"{mod.__name__}.{fn.name}: {touches(st, helpers, {fn.name})} before the PDL wait"
    assert found >= 10


@pytest.mark.gpu
@pytest.mark.parametrize("prefetch,trigger", [(False, "early"), (True, "early"), (False, "late"), (True, "late"),
                                              (False, "none")])
def test_pdl_chain_in_a_cuda_graph_reads_each_predecessors_output(monkeypatch, prefetch, trigger):
    """Dependent launches (decode-size GEMMs, weights plain and as ``W.T`` views, then a decode
    reading a GEMM's output) captured in one graph with PDL on, with and without the split-K
    GEMM's weight prefetch and the decode's K/V prefetch before the wait, each trigger mode: every kernel must see its
    predecessor's writes (outputs poisoned between replays)."""
    import numasched
    import numasched.decode

    monkeypatch.setattr(numasched.decode, "PREFETCH_MIN_BATCH", 1)   # the batch-1 decode below prefetches too,
    monkeypatch.setattr(numasched.decode, "PREFETCH_CHUNK_RATIO", 0)  # its short splits as well
    dev = "cuda"
    torch.manual_seed(0)
    ws = [torch.randn(256, 256, device=dev, dtype=torch.float16) / 16 for _ in range(4)]
    ws = [w if i % 2 else w.T.contiguous().T for i, w in enumerate(ws)]   # both unit-stride layouts
    x = torch.randn(8, 256, device=dev, dtype=torch.float16)
    k = torch.randn(1, 512, 2, 128, device=dev, dtype=torch.float16)
    v = torch.randn_like(k)
    wg = (torch.randn(512, 256, device=dev, dtype=torch.float16) / 16).T   # SwiGLU gate/up, a W.T view

    def step():
        y = x
        for w in ws:
            y = numasched.matmul(y, w)
        y = numasched.matmul_swiglu(y, wg)     # 256 columns: gate 256 -> silu(g) * u
        y = numasched.swiglu(numasched.matmul(y, wg))   # the same, as a GEMM then the PDL activation
        q = y[:1].reshape(1, 2, 128)           # depends on the last GEMM
        return numasched.flash_decode(q, k, v, prefetch=prefetch)

    # prefetch: also the decode's K/V rows into L2 before its wait (options.decode_prefetch)
    with options.use(pdl=True, pdl_prefetch=prefetch, pdl_trigger=trigger, decode_prefetch=128 if prefetch else 0):
        ref_y = x.double()
        for w in ws:
            ref_y = ref_y @ w.double()
        for _ in range(2):
            gu = ref_y @ wg.double()
            ref_y = torch.nn.functional.silu(gu[:, :256]) * gu[:, 256:]
        qd = ref_y[:1].reshape(1, 2, 1, 128)
        kd, vd = k.double().transpose(1, 2), v.double().transpose(1, 2)
        ref = torch.softmax(qd @ kd.transpose(-1, -2) / 128 ** 0.5, -1) @ vd
        from numasched.bench.common import capture, warm_up_for_capture

        if prefetch:   # the decode below does take the prefetch path
            assert numasched.plan_decode(torch.empty(1, 2, 128, device=dev, dtype=torch.float16), k, v,
                                         prefetch=True).prefetch_tokens
        step()
        warm_up_for_capture(step)
        held = {}
        g = capture(lambda: held.update(out=step()))
        out = held["out"]
        for _ in range(3):
            out.fill_(float("nan"))
            g.replay()
            torch.cuda.synchronize()
            torch.testing.assert_close(out.double().reshape(1, 2, 128), ref.reshape(1, 2, 128), rtol=2e-2, atol=2e-2)


def test_keep_full_caches_pointer_only_argument_lists_first_in_first_out():
    """Launch.keep_full: a complete argument list is kept under its key only when it holds no
    tensor (a cached list must not keep a caller's tensor alive nor stand for another one's
    pointer), at most ``limit`` lists, the oldest dropped first."""
    from numasched._launch import Launch

    run = Launch.__new__(Launch)
    run.desc_pos, run.tail = (), (7,)
    fulls = {}
    run.keep_full(fulls, "t", (torch.zeros(1), 3))
    assert fulls == {}
    for i in range(4):
        run.keep_full(fulls, i, (100 + i, 3), limit=3)
    assert list(fulls) == [1, 2, 3] and fulls[3] == (103, 3, 7)
