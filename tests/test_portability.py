"""Every kernel compiles offline (no GPU) for AMD gfx942 and gfx950 through Triton's AMD backend, and
for NVIDIA sm_90 (numasched.portability; the committed table is bench/results/portability-*.md).

What runs: ``python -m numasched.portability`` in subprocesses without TRITON_INTERPRET (Triton
picks the interpreter when a kernel is defined), three at once: every registered variant for
gfx942, every registered variant for gfx950, and for sm90 the subset :data:`SM90_SUBSET` (one
variant per kernel family plus the ones switched off on NVIDIA; the sm90 rows pay for a ptxas run
each, and tests/test_attention.py, test_gemm.py and test_distributed.py compile the NVIDIA configs
in more detail). Variants that are switched off on a target are not skipped silently: the test
asserts the exact set of them and that each states its reason.
"""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import compiled_json

from numasched import portability as PT

REPO = Path(__file__).resolve().parents[1]

SM90_SUBSET = [
    "flash_decode/contiguous-fused-bf16-d128-g4", "combine/bf16-d128-s16", "attention_fwd/bf16-d128-causal-tma",
    "gemm/bf16-tma-persistent", "dist/all_gather_matmul-tma", "dist/decode_exchange_combine", "probe/l2_latency",
    "gemm_splitk/bf16-pointer-decode-prefetch", "gemm_splitk/bf16-pointer-decode-glu-prefetch",
    "flash_decode/paged16-fused-bf16-d128-g4-prefetch", "flash_decode/contiguous-fused-bf16-d128-g4-prefetch",
    "gemm_splitk/bf16-pointer-decode-kvec", "copy_rows/bf16-k5000", "copy_rows/bf16-k1537-pad",
] + [v.key for v in PT.VARIANTS if "nvidia" in v.off]

# (variant, vendor) pairs switched off, and why (a word the reason must contain)
EXPECTED_OFF = {
    **{(v.key, "amd"): "TMA" for v in PT.VARIANTS if v.name.endswith("-tma") or "-tma-" in v.name},
    **{(v.key, "nvidia"): "LDS" for v in PT.VARIANTS if "stage" in v.name},
    ("probe/xcc_id", "nvidia"): "AMD ISA",
    ("gemm_splitk/bf16-pointer-decode-prefetch", "amd"): "NVIDIA PTX",
    ("gemm_splitk/bf16-pointer-decode-glu-prefetch", "amd"): "NVIDIA PTX",
    ("flash_decode/paged16-fused-bf16-d128-g4-prefetch", "amd"): "NVIDIA PTX",
    ("flash_decode/contiguous-fused-bf16-d128-g4-prefetch", "amd"): "NVIDIA PTX",
    **{(v.key, "amd"): "Gluon" for v in PT.VARIANTS
       if v.kernel in ("gemm_ws", "gemm_weight_first") or "-ws" in v.name},
}


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
    out = tmp_path_factory.mktemp("portability")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    jobs = {"gfx942": [], "gfx950": [], "sm90": ["--kernels", ",".join(SM90_SUBSET)]}
    procs = {}
    for target, extra in jobs.items():
        cmd = [sys.executable, "-m", "numasched.portability", "--targets", target, "--quiet", "--no-findings",
               "--json", str(out / f"{target}.json"), "--out", str(out / f"{target}.md"), *extra]
        procs[target] = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                         text=True)
    res = {}
    for target, p in procs.items():
        stdout, stderr = p.communicate(timeout=300)
        assert p.returncode == 0, f"{target}: rc {p.returncode}\n{stdout[-3000:]}\n{stderr[-3000:]}"
        res[target] = json.loads((out / f"{target}.json").read_text())
        assert (out / f"{target}.md").read_text() == stdout  # --out writes what it prints
    return res


@pytest.mark.parametrize("target", ["gfx942", "gfx950", "sm90"])
def test_every_variant_compiles_with_register_counts(rows, target):
    got = rows[target]
    want = PT.VARIANTS if target != "sm90" else PT.variants(SM90_SUBSET)
    assert [(r["kernel"], r["variant"]) for r in got] == [(v.kernel, v.name) for v in want]
    vendor = "nvidia" if target == "sm90" else "amd"
    for r in got:
        key = f"{r['kernel']}/{r['variant']}"
        if (key, vendor) in EXPECTED_OFF:
            assert r["status"] == "off" and EXPECTED_OFF[key, vendor] in r["reason"], r
            continue
        assert r["status"] == "ok", r
        assert isinstance(r["registers"], int) and r["registers"] > 0, r
        assert isinstance(r["shared_bytes"], int) and r["num_warps"] >= 1, r
        if vendor == "amd":
            assert isinstance(r["sgprs"], int) and r["vgpr_spills"] is not None and r["stack_bytes"] is not None, r
            assert not r["tma_load"] and r["mma"] in ("mfma", None), r
        else:
            assert r["spill_bytes"] is not None, r
    # the off set is exactly the expected one: nothing else is switched off on this vendor
    off = {f"{r['kernel']}/{r['variant']}" for r in got if r["status"] == "off"}
    assert off == {k for (k, v) in EXPECTED_OFF if v == vendor and k in {x.key for x in want}}


def test_amd_specifics(rows):
    """The tensor-core paths use MFMA on AMD; the LDS-sized configs fit gfx942's 64 KiB; the AMD
    probe kernels compile to their AMD assembly (checked in detail in test_probe.py)."""
    for target in ("gfx942", "gfx950"):
        by = {f"{r['kernel']}/{r['variant']}": r for r in rows[target]}
        for key in ("flash_decode/paged16-fused-bf16-d128-g4", "attention_fwd/bf16-d128-pointer", "gemm/bf16-pointer",
                    "dist/all_gather_matmul-pointer"):
            assert by[key]["mma"] == "mfma", by[key]
        for v in PT.VARIANTS:
            if "nvidia" in v.off and "LDS" in v.off["nvidia"]:
                assert by[v.key]["fits"] is True and by[v.key]["shared_bytes"] <= 65536, by[v.key]


def test_sm90_tensor_core_paths(rows):
    """On sm90 the TMA variants use TMA and wgmma, fit shared memory and do not spill."""
    sm = {f"{r['kernel']}/{r['variant']}": r for r in rows["sm90"]}
    for key in ("attention_fwd/bf16-d128-causal-tma", "gemm/bf16-tma-persistent", "dist/all_gather_matmul-tma"):
        r = sm[key]
        assert r["tma_load"] and r["mma"] == "wgmma" and r["wgmma"], r
        assert r["fits"] is True and r["spill_bytes"] == 0, r


def test_compile_report_helpers():
    """attention_report / gemm_report (the former kernels' compile_report) compile one config."""
    code = ("import json\nfrom numasched import portability as P\nfrom numasched.kernels import gemm as G\n"
            "a = P.attention_report(128, 64, 8, 3, False, causal=True, target='gfx950')\n"
            "g = P.gemm_report(G.gpu_configs('pointer', False, True)[1], dtype='fp32', path='pointer', "
            "precision='ieee', target='gfx942')\n"
            "print(json.dumps([a, g]))\n")
    a, g = compiled_json(code, cwd=REPO)
    assert a["mma"] == "mfma" and a["registers"] > 0 and a["shared_bytes"] > 0 and not a["tma_load"]
    assert g["registers"] > 0 and g["sgprs"] > 0 and g["vgpr_spills"] is not None


def test_signature_and_targets():
    """The signature builder types arguments as a launch would, and refuses what it cannot type."""
    assert PT.parse_target("sm_90").arch == 90 and PT.parse_target("gfx950").backend == "hip"
    with pytest.raises(ValueError, match="target"):
        PT.parse_target("mi300")
    assert PT.shared_limit("gfx942") == 65536 and PT.shared_limit("sm90") == 232448
    with pytest.raises(KeyError, match="no variant"):
        PT.find("gemm", "nope")
    # in this (interpreter) process the kernels are interpreter objects: a compile must say so, not crash
    fn, values, _, _ = PT.find("probe", "l2_latency").build("amd")
    with pytest.raises(PT.Interpreted, match="TRITON_INTERPRET"):
        PT.compile_kernel(fn, values, "gfx942")


def test_splitk_prefetch_comes_before_the_pdl_wait():
    """sm_90 PTX of the decode-size split-K GEMM with PREFETCH_B: the weight's bulk L2 prefetches
    are issued, before the griddepcontrol.wait (the SwiGLU form: gate and up columns, twice as
    many); without PREFETCH_B there are none."""
    code = ("import json; from numasched import portability as P\n"
            "out = {}\n"
            "for v in ('bf16-pointer-decode-prefetch', 'bf16-pointer-decode-glu-prefetch', "
            "'bf16-pointer-decode'):\n"
            "    r = P.compile_variant('gemm_splitk', v, 'sm90', keep_asm=True)\n"
            "    out[v] = r['asm']['ptx'] if r['ok'] else r['error']\n"
            "print(json.dumps(out))\n")
    ptx = compiled_json(code)
    op = "cp.async.bulk.prefetch.L2.global"
    counts = {}
    for v in ("bf16-pointer-decode-prefetch", "bf16-pointer-decode-glu-prefetch"):
        pre = ptx[v]
        assert op in pre and "griddepcontrol.wait" in pre, v
        assert pre.index(op) < pre.index("griddepcontrol.wait"), v
        assert pre.rindex(op) < pre.index("griddepcontrol.wait"), v
        counts[v] = pre.count(op)
    assert counts["bf16-pointer-decode-glu-prefetch"] == 2 * counts["bf16-pointer-decode-prefetch"]
    assert op not in ptx["bf16-pointer-decode"] and "prefetch.global.L2" not in ptx["bf16-pointer-decode"]


def test_decode_kv_prefetch_comes_before_the_pdl_wait():
    """sm_90 PTX of flash_decode with PREFETCH_TOKENS (options.decode_prefetch): the chunk's K and
    V rows are bulk-prefetched into L2 before the griddepcontrol.wait, and nothing else touches
    the cache before it (the only loads there are the length and the page indices, which pick the
    addresses); without it there are no prefetches."""
    code = ("import json; from numasched import portability as P\n"
            "out = {}\n"
            "for v in ('paged16-fused-bf16-d128-g4-prefetch', 'contiguous-fused-bf16-d128-g4-prefetch', "
            "'paged16-fused-bf16-d128-g4'):\n"
            "    r = P.compile_variant('flash_decode', v, 'sm90', keep_asm=True)\n"
            "    out[v] = r['asm']['ptx'] if r['ok'] else r['error']\n"
            "print(json.dumps(out))\n")
    ptx = compiled_json(code)
    op = "cp.async.bulk.prefetch.L2.global"
    for v in ("paged16-fused-bf16-d128-g4-prefetch", "contiguous-fused-bf16-d128-g4-prefetch"):
        pre = ptx[v]
        assert op in pre and "griddepcontrol.wait" in pre, v
        wait = pre.index("griddepcontrol.wait")
        assert pre.rindex(op) < wait, v
        head = pre[:wait]
        # before the wait: the length (and, paged, the page indices) only; no cache loads, no stores
        assert "st.global" not in head and "cp.async.cg" not in head and "cp.async.ca" not in head, v
        loads = re.findall(r"ld\.global[.\w]*\.b(\d+)", head)
        assert all(int(w) <= 32 for w in loads), (v, loads)
        # the length is read again after the wait: the early (possibly stale) value only aimed
        # the prefetches
        assert re.search(r"ld\.global[.\w]*\.b32", pre[wait:]), v
    assert op not in ptx["paged16-fused-bf16-d128-g4"]


def test_k_vectors_make_pointer_loads_16_bytes_wide():
    """sm_90 PTX of the decode-size split-K tile at K = 5000 (kernels/gemm_splitk.k_vector):
    without the hints every operand element is its own 2-byte load; with A_K_VEC = B_K_VEC = 8
    the loads are 16-byte cp.async, as at K = 4096. The row copy of A moves 16-byte vectors; the
    padding copy of an odd K (options.gemm_pad_k) loads an element at a time but stores 16-byte
    vectors into its whole-line rows."""
    code = ("import json, re; from numasched import portability as P\n"
            "out = {}\n"
            "fn, values, w, s = P.find('gemm_splitk', 'bf16-pointer-decode-kvec').build('nvidia')\n"
            "for vec in (1, 8):\n"
            "    ptx = P.compile_kernel(fn, dict(values, A_K_VEC=vec, B_K_VEC=vec), 'sm90', num_warps=w, num_stages=s,"
            " keep_asm=True)['asm']['ptx']\n"
            "    out[vec] = [len(re.findall(r'ld\\.global(?:\\.\\w+)*\\.b16', ptx)),"
            " len(re.findall(r'cp\\.async\\.c[ag]\\.shared\\.global[^;]*, 0x10[,;]', ptx))]\n"
            "fn, values, w, s = P.find('copy_rows', 'bf16-k5000').build('nvidia')\n"
            "ptx = P.compile_kernel(fn, values, 'sm90', num_warps=w, num_stages=s, keep_asm=True)['asm']['ptx']\n"
            "out['copy'] = [len(re.findall(r'ld\\.global(?:\\.\\w+)*\\.v4', ptx)), len(re.findall(r'\\.b16 ', ptx))]\n"
            "fn, values, w, s = P.find('copy_rows', 'bf16-k1537-pad').build('nvidia')\n"
            "ptx = P.compile_kernel(fn, values, 'sm90', num_warps=w, num_stages=s, keep_asm=True)['asm']['ptx']\n"
            "out['pad'] = [len(re.findall(r'st\\.global(?:\\.\\w+)*\\.v4', ptx)),"
            " len(re.findall(r'st\\.global(?:\\.\\w+)*\\.b16', ptx))]\n"
            "print(json.dumps(out))\n")
    got = compiled_json(code, timeout=600)
    assert got["1"][0] > 0 and got["1"][1] == 0, got        # one element at a time
    assert got["8"][0] == 0 and got["8"][1] > 0, got        # 16-byte cp.async
    assert got["copy"][0] > 0, got
    assert got["pad"][0] > 0 and got["pad"][1] == 0, got    # whole-vector stores of the padded rows


def test_late_pdl_trigger_comes_after_the_k_loop():
    """sm_90 PTX of the GEMM kernels with PDL = 3 ("late", kernels/pdl.py): the wait comes first
    and the launch_dependents after every tensor-core instruction; with PDL = 1 the trigger
    precedes the wait."""
    code = ("import json; from numasched import portability as P\n"
            "out = {}\n"
            "for kern, var in (('gemm_splitk', 'bf16-pointer-decode'), ('gemm', 'bf16-tma-persistent'), "
            "('gemm', 'bf16-pointer'), ('gemm_streamk', 'bf16-tma-128x128'), "
            "('flash_decode', 'contiguous-fused-bf16-d128-g4')):\n"
            "    fn, values, w, s, *x = P.find(kern, var).build('nvidia')\n"
            "    for pdl in (1, 3):\n"
            "        r = P.compile_kernel(fn, dict(values, PDL=pdl), 'sm90', num_warps=w, num_stages=s, keep_asm=True)\n"
            "        out[f'{kern}/{var}/{pdl}'] = r['asm']['ptx']\n"
            "print(json.dumps(out))\n")
    ptx = compiled_json(code, timeout=600)
    assert len(ptx) == 10
    for key, text in ptx.items():
        wait, trig = text.index("griddepcontrol.wait"), text.index("griddepcontrol.launch_dependents")
        last = max(text.rfind("wgmma.mma_async"), text.rfind("mma.sync"))
        if key.endswith("/1"):
            assert trig < wait, key
        else:
            assert wait < trig and trig > last, key


def test_signature_keeps_do_not_specialize_arguments_runtime():
    """An int argument the kernel marks do_not_specialize stays a runtime i32 even when it is 1 (as
    the JIT launches it), where other ints equal to 1 become constants: an offline compile then
    builds the code a launch runs."""
    code = r"""
import json
from numasched import portability as P
from numasched.kernels.dist_allreduce import all_reduce_kernel as k   # do_not_specialize=["n", "iters"]

names = [p.name for p in k.params]
values = {n: 1 for n in names}
values.update({n: "*bf16" for n in ("x_ptr", "out_ptr", "buf_ptr", "buf2_ptr")})
values.update({n: "*i32" for n in ("flags_ptr", "status_ptr", "epoch_ptr", "counters_ptr")})
values["heap_bases"] = "*i64"
for p in k.params:
    if p.is_constexpr:
        values[p.name] = 1
sig, const, attrs = P._signature(k, values)
print(json.dumps(dict(n=sig["n"], iters=sig["iters"], shard=sig["shard"])))
"""
    r = compiled_json(code, cwd=str(Path(__file__).resolve().parent.parent))
    assert r == {"n": "i32", "iters": "i32", "shard": "constexpr"}
