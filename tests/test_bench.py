"""The bench scripts run end to end on CPU (--cpu-check, interpreter) or show their plan
(--dry-run), never monkeypatch the library, and ncu's CSV is read right."""
import ast
import csv
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from numasched.bench import policies

ROOT = Path(__file__).resolve().parents[1]

NCU_LOG = '''==PROF== Connected to process 4242
"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size","Grid Size","Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"
"0","4242","python3","127.0.0.1","gemm_kernel","1","7","(256, 1, 1)","(132, 1, 1)","0","9.0","Command line profiler metrics","dram__bytes_read.sum","byte","1,234,567"
"0","4242","python3","127.0.0.1","gemm_kernel","1","7","(256, 1, 1)","(132, 1, 1)","0","9.0","Command line profiler metrics","lts__t_sector_hit_rate.pct","%","87.5"
"1","4242","python3","127.0.0.1","attn_fwd_kernel","1","7","(256, 1, 1)","(64, 1, 1)","0","9.0","Command line profiler metrics","lts__t_sector_hit_rate.pct","%","42.25"
"1","4242","python3","127.0.0.1","attn_fwd_kernel","1","7","(256, 1, 1)","(64, 1, 1)","0","9.0","Command line profiler metrics","gpu__time_duration.sum","ns","n/a"
'''


def test_ncu_csv_gives_one_record_per_kernel_in_launch_order():
    ks = policies._parse_ncu_csv(NCU_LOG)
    assert [k["kernel"] for k in ks] == ["gemm_kernel", "attn_fwd_kernel"]
    assert ks[0]["dram__bytes_read.sum"] == 1234567.0        # thousands separators dropped
    assert ks[0]["lts__t_sector_hit_rate.pct"] == 87.5
    assert ks[1]["lts__t_sector_hit_rate.pct"] == 42.25
    assert "gpu__time_duration.sum" not in ks[1]              # an unreadable value is left out, not 0
    assert policies._parse_ncu_csv("no profiler output") == []


def test_policies_cpu_check_times_every_registered_policy(tmp_path):
    from numasched import mappings as M

    env = dict(os.environ, TRITON_INTERPRET="1")
    r = subprocess.run([sys.executable, "-m", "numasched.bench.policies", "--cpu-check", "--quick", "--out-dir",
                        str(tmp_path)], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    (path,) = tmp_path.glob("policies-*.csv")
    rows = list(csv.DictReader(open(path)))
    for kind, label in (("prefill", "attention"), ("decode", "decode"), ("gemm", "gemm")):
        got = {row["policy"] for row in rows if row["kind"] == kind}
        assert got == set(M.available(label)), kind
    assert all(float(row["ms"]) > 0 for row in rows)


# ----------------------------------------------------------------------------------- no monkeypatching
def _library_attribute_writes(path: Path) -> list:
    """Assignments (``X.attr = ...``, ``X.attr += ...``, ``setattr(X, ...)``, ``del X.attr``) to an
    attribute of a name bound by an import from numasched (``import numasched.decode as ND``,
    ``from numasched.kernels import gemm as KG``, ``from numasched.distributed import _ops``)."""
    tree = ast.parse(path.read_text())
    bound = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            bound |= {(a.asname or a.name.split(".")[0]) for a in node.names if a.name.split(".")[0] == "numasched"}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "numasched":
            bound |= {a.asname or a.name for a in node.names}
    found = []

    def base(target):
        while isinstance(target, ast.Attribute):
            target = target.value
        return target.id if isinstance(target, ast.Name) else None

    for node in ast.walk(tree):
        targets = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        elif isinstance(node, ast.Delete):
            targets = node.targets
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("setattr", "delattr"):
            if node.args and base(node.args[0]) in bound:
                found.append(f"{path.name}:{node.lineno}")
        for t in targets:
            for sub in (t.elts if isinstance(t, ast.Tuple) else [t]):
                if isinstance(sub, ast.Attribute) and base(sub) in bound:
                    found.append(f"{path.name}:{node.lineno}")
    return found


def test_bench_and_scripts_never_monkeypatch_the_library():
    files = sorted((ROOT / "bench").glob("*.py")) + sorted((ROOT / "scripts").glob("*.py"))
    assert len(files) > 8
    found = [hit for f in files for hit in _library_attribute_writes(f)]
    assert found == [], f"bench/scripts set attributes of numasched modules: {found}"


def test_the_monkeypatch_detector_sees_the_old_patterns(tmp_path):
    f = tmp_path / "old.py"
    f.write_text("import numasched.decode as ND\nfrom numasched.kernels import flash_decode as FD\n"
                 "from numasched.distributed import _common as _ops\nimport numasched\n"
                 "ND.CHECK_DATA = False\nFD.COMBINE_MODE = 'kernel'\n_ops._gemm_cfg = None\n"
                 "setattr(numasched.gemm, 'x', 1)\nnumasched.options.x = 1\nctx = object()\nctx.num_sms = 3\n")
    assert sorted(int(h.split(":")[1]) for h in _library_attribute_writes(f)) == [5, 6, 7, 8, 9]


# ----------------------------------------------------------------------------------- host_overhead
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only behaviour")
@pytest.mark.parametrize("extra", [[], ["--gpu"]])
def test_host_overhead_without_cuda_prints_one_line_and_exits_2(extra, tmp_path):
    r = subprocess.run([sys.executable, "-m", "numasched.bench.host_overhead", *extra], capture_output=True,
                       text=True, timeout=120, cwd=tmp_path)
    assert r.returncode == 2
    lines = (r.stdout + r.stderr).strip().splitlines()
    assert len(lines) == 1 and "CUDA GPU" in lines[0], lines
    assert not any(tmp_path.iterdir())


def test_host_overhead_dry_run_lists_each_call_beside_torch(capsys):
    from numasched.bench import host_overhead

    assert host_overhead.main(["--dry-run", "-n", "50"]) == 0
    out = capsys.readouterr().out
    for case in ("flash_decode", "flash_decode plan.run", "matmul", "matmul plan.run", "attention_forward",
                 "attention plan.run", "scaled_dot_product_attention"):
        assert f"  {case}: " in out
    assert "enable_gqa=True" in out and "torch.matmul" in out and "50 eager calls" in out and "1.25x" in out
    assert host_overhead.COLUMNS[:6] == ["case", "ours", "torch", "ours_us", "torch_us", "ratio"]


def test_host_overhead_times_n_calls_per_round_and_syncs_each_round():
    from numasched.bench.host_overhead import _per_call_us

    calls, syncs = [], []
    us = _per_call_us(lambda: calls.append(1), 7, lambda: syncs.append(len(calls)))
    assert len(calls) == 10 + 3 * 7 and syncs == [10, 17, 24, 31] and us >= 0


# ----------------------------------------------------------------------------------- public API use
def test_decode_bench_leaves_the_process_options_alone(capsys):
    import numasched
    from numasched.bench import decode

    before = numasched.options.current()
    assert decode.main(["--dry-run", "--heads", "gqa", "--batch", "1", "--ctx", "1024"]) == 0
    assert numasched.options.current() is before
    from numasched.decode import choose_num_splits

    assert f"{choose_num_splits(1, 8, 1024, 132)} splits on 132 SMs" in capsys.readouterr().out


def test_decode_bench_warms_up_on_its_first_point_that_fits():
    """bench decode runs its first point within --max-gb once more first, as a warm-up whose rows
    are dropped; every point still runs once, in order."""
    from numasched.bench import decode

    pts = [("gqa", 128, 131072), ("gqa", 1, 512), ("mha", 2, 1024)]
    sched = decode._schedule(pts, max_gb=1.0)   # 128 x 128k of 32/8 heads: 68.7 GB, skipped
    assert sched[0] == (("gqa", 1, 512), True)
    assert [p for p, warm in sched if not warm] == pts and sum(w for _, w in sched) == 1
    assert decode._schedule(pts, max_gb=1e-6) == [(p, False) for p in pts]   # none fits: no warm-up
    assert decode._schedule([], 10.0) == []


def test_decode_bench_page_sizes(capsys):
    from numasched.bench import decode

    assert decode._parse([]).pages == [decode.PAGE]
    assert decode._parse(["--sq", "2"]).pages == decode.MULTI_PAGES
    assert decode._parse(["--pages", "16", "64"]).pages == [16, 64]
    assert decode._parse(["--ragged", "--sq", "2"]).ragged   # no --pages given: no complaint
    with pytest.raises(SystemExit):
        decode._parse(["--ragged", "--pages", "64"])
    assert "--pages" in capsys.readouterr().err
    assert decode.main(["--dry-run", "--heads", "gqa", "--batch", "1", "--ctx", "1024", "--pages", "16", "64"]) == 0
    out = capsys.readouterr().out
    assert "paged 16, combine auto" in out and "paged 64, combine auto" in out


def test_decode_bench_flush_is_a_read_by_default_and_checked(capsys):
    from numasched.bench import common, decode

    assert decode._parse([]).timing == decode.Timing(100, "read")
    assert decode._parse(["--flush", "zero", "--rep", "50"]).timing == decode.Timing(50, "zero")
    with pytest.raises(SystemExit):
        decode._parse(["--flush", "write"])
    assert "--flush" in capsys.readouterr().err
    with pytest.raises(ValueError, match="flush"):
        common.bench_ms(lambda: None, flush="write")


def test_decode_bench_prefetch_is_asked_for_and_its_variant_needs_it(capsys):
    from numasched.bench import decode

    assert not decode._parse([]).prefetch and decode._parse(["--prefetch"]).prefetch
    assert decode._parse(["--prefetch", "--variant", "decode_prefetch=0"]).variant == [("decode_prefetch", 0)]
    for bad in (["--variant", "decode_prefetch=0"], ["--prefetch", "--sq", "2"]):
        with pytest.raises(SystemExit):   # a variant that changes nothing; a mode that has no prefetch
            decode._parse(bad)
        assert "prefetch" in capsys.readouterr().err
    assert decode.main(["--dry-run", "--heads", "gqa", "--batch", "16", "--ctx", "1024", "--prefetch"]) == 0
    assert "prefetch=True) contiguous (BLHD)" in capsys.readouterr().out


def test_decode_bench_summary_scores_paged_rows_against_flashinfer():
    """The grid summary: contiguous rows by their ratio to the best peer, paged rows by FlashInfer's
    time over ours (not the best peer's: cuDNN times a contiguous cache), the streaming-read
    target counted only from 256k tokens."""
    from numasched.bench import decode

    def row(layout, batch, ctx, ratio, ours, fi, frac):
        return dict(heads="32/8", batch=batch, ctx=ctx, layout=layout, ratio_vs_best_peer=ratio, ours_graph_us=ours,
                    flashinfer_graph_us=fi, frac_stream_read=frac)

    rows = [row("contiguous (BLHD)", 1, 512, 1.2, 10.0, None, 0.3),
            row("contiguous (BHLD view)", 64, 4096, 0.98, 500.0, None, 0.95),
            row("contiguous (BLHD)", 64, 8192, 1.0, 900.0, None, 0.91),
            # a paged row's ratio to the best peer (cuDNN, contiguous) must not count: 0.5 here
            row("paged 16", 64, 4096, 0.5, 100.0, 99.0, 0.93),
            row("paged 16", 8, 512, 0.5, 10.0, 12.0, 0.2),
            row("paged 64", 8, 512, 0.5, 10.0, None, 0.2),   # no FlashInfer time: not scored
            row("paged 64", 8, 1024, 0.5, 10.0, "skipped", 0.2)]   # nor a note (--no-flashinfer)
    lines = decode.summary(rows)
    assert len(lines) == 2
    cont, paged = lines
    assert cont.startswith("contiguous against the best peer: geomean 1.056,")   # (1.2 * 0.98 * 1.0) ** (1/3)
    assert ">= 1.00 at 2/3" in cont and ">= 0.99 at 2," in cont and "worst 0.980 (32/8 64 x 4096 contiguous (BHLD view))" in cont
    assert "at 1/2 points of >= 256k tokens (min 0.910)" in cont
    assert paged.startswith("paged 16 against FlashInfer: geomean 1.090,")   # (0.99 * 1.2) ** 0.5
    assert ">= 1.00 at 1/2" in paged and "worst 0.990 (32/8 64 x 4096 paged 16)" in paged
    assert "at 1/1 points" in paged and f">= {decode.STREAM_TARGET} of" in paged
    assert decode.STREAM_TARGET == 0.92   # issue 12's figure

def test_decode_bench_paged_cache_covers_a_partial_last_page():
    import torch

    from numasched.bench import decode

    kp, vp, bt = decode._paged_cache(2, 20, 16, 3, 8, "cpu", torch.float32)
    assert kp.shape == vp.shape == (4, 16, 3, 8) and bt.shape == (2, 2)
    assert sorted(bt.flatten().tolist()) == [0, 1, 2, 3]   # every page once, scattered
    indptr, indices, last = decode._flashinfer_pages(bt, 20, 16)
    assert indptr.tolist() == [0, 2, 4] and torch.equal(indices, bt.reshape(-1)) and last.tolist() == [4, 4]


def test_decode_bench_paged_only_times_the_paged_target_alone(capsys):
    """--paged-only: numasched's paged rows (default combine) against FlashInfer, nothing else; it
    refuses the flags that would leave it nothing to time or compare."""
    from numasched.bench import decode

    assert decode._parse(["--paged-only"]).paged_only and not decode._parse([]).paged_only
    for bad in (["--no-paged"], ["--sq", "2"], ["--ragged"], ["--host"], ["--no-flashinfer"]):
        with pytest.raises(SystemExit):
            decode._parse(["--paged-only", *bad])
        assert "--paged-only" in capsys.readouterr().err
    argv = ["--dry-run", "--heads", "gqa", "--batch", "8", "--ctx", "4096", "--pages", "16", "64", "--no-flex"]
    assert decode.main([*argv, "--paged-only"]) == 0
    out = capsys.readouterr().out
    assert "paged 16, combine auto" in out and "paged 64, combine auto" in out and "FlashInfer" in out
    assert "contiguous" not in out and "SDPA" not in out and "(the other)" not in out
    assert decode.main(argv) == 0
    out = capsys.readouterr().out
    assert "contiguous (BLHD)" in out and "SDPA" in out


def test_decode_bench_first_sequence_check_catches_a_wrong_output(device):
    """--paged-only's correctness column: flash_decode on a scattered paged cache (a partial last
    page, GQA 4) against the float64 reference of the first sequence; a poisoned output fails."""
    import numasched
    from numasched.bench import decode

    torch.manual_seed(0)
    B, L, page, HK, H, D = 2, 37, 16, 2, 8, 32
    kp, vp, bt = decode._paged_cache(B, L, page, HK, D, device, torch.float32)
    q = torch.randn(B, H, D, device=device)
    lens = torch.full((B,), L, dtype=torch.int32, device=device)
    out = numasched.flash_decode(q, kp, vp, cache_seqlens=lens, block_table=bt)
    assert decode._first_sequence_error(out, q, kp, vp, bt, L) < 1e-5
    bad = out.clone()
    bad[0, 3, 5] += 0.01
    assert decode._first_sequence_error(bad, q, kp, vp, bt, L) == pytest.approx(0.01, rel=1e-3)
    other = out.clone()
    other[1] += 1.0   # the second sequence is not the check's
    assert decode._first_sequence_error(other, q, kp, vp, bt, L) < 1e-5
    assert decode._first_sequence_error(None, q, kp, vp, bt, L) is None


def test_decode_bench_paged_only_run_on_the_interpreter(monkeypatch, tmp_path, capsys):
    """A --paged-only run end to end on the CPU (the interpreter, timings stubbed, no FlashInfer):
    one row per page size, each with its own float64 check; no contiguous row, no SDPA time."""
    if not os.environ.get("TRITON_INTERPRET"):
        pytest.skip("the CPU form runs flash_decode through Triton's interpreter")
    from numasched.bench import common, decode

    monkeypatch.setattr(common, "check_runnable", lambda suite: None)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(decode, "_setup", lambda args: (torch.device("cpu"), torch.float32, 1e12, 4, (None, "absent")))
    timings = []
    monkeypatch.setattr(decode, "_time", lambda fn, timing: timings.append("eager") or 0.01)
    monkeypatch.setattr(decode, "_graph_ms", lambda fn, timing, notes, name: timings.append("graph") or 0.008)
    argv = ["--paged-only", "--heads", "gqa", "--batch", "1", "--ctx", "40", "--pages", "16", "64"]
    for extra, eager in (([], 1), (["--no-eager"], 0)):
        out_dir = tmp_path / str(len(extra))
        timings.clear()
        assert decode.main([*argv, *extra, "--out-dir", str(out_dir)]) == 0
        rows = list(csv.DictReader(open(next(out_dir.glob("decode-*.csv")))))
        assert [r["layout"] for r in rows] == ["paged 16", "paged 64"]
        # the first point runs twice (a warm pass, dropped): two layouts, two passes
        assert timings.count("graph") == 4 and timings.count("eager") == 4 * eager
        for r in rows:
            assert float(r["max_abs_err_vs_sdpa"]) < 1e-5 and float(r["ours_graph_us"]) == pytest.approx(8.0)
            assert r["sdpa_cudnn_us"] == "skipped" and "flashinfer skipped: absent" in r["note"]
            assert r["ours_us"] == ("skipped (--no-eager)" if extra else "10.0")
            assert r["ratio_eager"] == ""   # no peer here; under --no-eager never a ratio of stand-ins
    # a call that cannot be captured is timed eagerly under --no-eager, and that time is kept
    monkeypatch.setattr(decode, "_graph_ms", lambda fn, timing, notes, name: None)
    out_dir = tmp_path / "uncaptured"
    assert decode.main([*argv, "--no-eager", "--out-dir", str(out_dir)]) == 0
    for r in csv.DictReader(open(next(out_dir.glob("decode-*.csv")))):
        assert r["ours_us"] == "10.0" and r["ours_graph_us"] == "n/a"
        assert float(r["frac_stream_read"]) > 0   # from the eager time it was measured at


def test_decode_bench_no_eager_needs_the_graph_grid(capsys):
    from numasched.bench import decode

    assert decode._parse(["--no-eager"]).no_eager
    for bad in (["--no-graph"], ["--sq", "2"], ["--ragged"], ["--host"]):
        with pytest.raises(SystemExit):
            decode._parse(["--no-eager", *bad])
        assert "--no-eager" in capsys.readouterr().err
    assert decode.main(["--dry-run", "--heads", "gqa", "--batch", "1", "--ctx", "1024", "--no-eager"]) == 0
    assert "CUDA-graph replay only (--no-eager)" in capsys.readouterr().out


def test_decode_configs_script_dry_run():
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "decode_configs.py"), "--dry-run", "--batch", "2",
                        "--ctx", "4096", "--splits", "4"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "B=2 ctx=4096" in r.stdout and "splits [4]" in r.stdout


def test_decode_plan_with_fixed_config_and_splits_runs(device):
    """What scripts/decode_configs.py times: plan_decode(num_splits=, config=), then plan.run."""
    import numasched

    q = torch.randn(2, 8, 64, device=device)
    k, v = torch.randn(2, 100, 2, 64, device=device), torch.randn(2, 100, 2, 64, device=device)
    plan = numasched.plan_decode(q, k, v, num_splits=3, config=dict(BLOCK_N=32, num_warps=4, num_stages=2))
    assert plan.num_splits == 3
    out = plan.run(q, k, v)
    ref = torch.nn.functional.scaled_dot_product_attention(q[:, :, None], k.transpose(1, 2).repeat_interleave(4, 1),
                                                           v.transpose(1, 2).repeat_interleave(4, 1))[:, :, 0]
    assert torch.allclose(out, ref, atol=1e-4, rtol=1e-4)


def test_gemm_inference_extra_schedules_are_parsed_and_timed_beside_the_model(capsys):
    """--extra names schedules as the results do; they join the contenders (after the model's
    pick and its next ones, duplicates dropped), and a malformed one is refused naming the form."""
    from numasched.bench import gemm_inference as GI
    from numasched import gemm_schedule as GS

    args = GI.build_parser().parse_args(["--extra", "streamk 128x256x64 w8 s4 persistent; tiled 128x128x64 w8 s4 "
                                         "persistent", "--dry-run"])
    assert [s.describe() for s in args.extra] == ["streamk 128x256x64 w8 s4 persistent",
                                                  "tiled 128x128x64 w8 s4 persistent"]
    machine = GS._KNOWN["h200"]
    chosen = GS._choose(512, 5120, 5120, 2, machine, False, True, True)
    got = [s.describe() for _, s in GI._contenders(512, 5120, 5120, True, chosen, 2, machine, args.extra)]
    assert got[0] == chosen.describe() and got[-2:] == [s.describe() for s in args.extra]
    assert len(got) == len(set(got))
    with pytest.raises(SystemExit):
        GI.build_parser().parse_args(["--extra", "streamk 128x256 w8"])
    # the dry run names them among the contenders
    assert GI.main(["--shapes", "1x2560x8192", "--extra", "streamk 16x32x256 w4 s6", "--dry-run"]) == 0
    assert "streamk 16x32x256 w4 s6 (--extra)" in capsys.readouterr().out


def test_gemm_inference_ws_forms_are_parsed_and_configured():
    """--ws takes the WS GEMM's forms by name (an unknown one refused, naming the choices); split-K
    gets S = SMs // tiles K parts, at least 2."""
    from numasched.bench import gemm_inference as GI

    assert GI.build_parser().parse_args(["--ws", "dp,split", "--dry-run"]).ws == ["dp", "split"]
    with pytest.raises(SystemExit):
        GI.build_parser().parse_args(["--ws", "dp,nope"])
    assert GI.ws_config("split", 128, 2560, 132).sk_split == 13    # 10 tiles
    assert GI.ws_config("split", 512, 2560, 132).sk_split == 3     # 40 tiles
    assert GI.ws_config("split", 4096, 6144, 132).sk_split == 2    # 768 tiles: at least 2
    assert GI.ws_config("bands", 512, 2560, 132).sk_merge == 1 and not GI.ws_config("dp", 1, 1, 132).streamk
    # wNNN: data-parallel tiles of that width in up to three power-of-two boxes; other widths refused
    assert GI.build_parser().parse_args(["--ws", "w160,w80", "--dry-run"]).ws == ["w160", "w80"]
    assert GI.ws_config("w160", 512, 5120, 132).tile_n == 160 and GI.ws_config("w80", 1, 1, 132).block_n1 == 16
    k = GI.ws_config("k128", 128, 4096, 132)   # 32 tiles of 128 x 128: 4 K parts
    assert (k.block_n, k.sk_split, k.sk_merge, k.streamk) == (128, 4, 1, True)
    assert GI.ws_config("k64", 256, 8192, 132).sk_split == 2   # 256 tiles: at least 2
    assert GI.ws_config("w208", 512, 25600, 132).block_n2 == 16   # 128 + 64 + 16
    for bad in ("w240", "w64", "wx", "k96", "k"):
        with pytest.raises(SystemExit):
            GI.build_parser().parse_args(["--ws", bad])


def test_collectives_launcher_passes_no_nproc_to_its_workers():
    """`--nproc 4` (two words) once reached the workers as a stray "4": every rank exited with a usage error."""
    from numasched.bench.collectives import _without_nproc, build_parser

    for argv in (["--quick", "--nproc", "4", "--out-dir", "x"], ["--nproc=4", "--quick", "--out-dir", "x"]):
        fwd = _without_nproc(argv)
        assert fwd == ["--quick", "--out-dir", "x"]
        args = build_parser().parse_args(["--worker", *fwd])   # the worker's parser accepts what is left
        assert args.quick and args.nproc is None


def test_collectives_launcher_spells_rows_for_torchrun():
    """`--m 48,384` reached torchrun's own parser, which took "--m" for an ambiguous abbreviation of
    its options (--max-restarts, --module, ...) and exited; the workers now get `--rows`."""
    import argparse
    import importlib

    from numasched.bench.collectives import _without_nproc, build_parser

    for argv in (["--only", "ag", "--m", "48,384"], ["--only", "ag", "--m=48,384"], ["--rows", "48,384", "--only", "ag"]):
        fwd = _without_nproc(argv)
        assert "--m" not in fwd and not any(a.startswith("--m=") for a in fwd)
        assert build_parser().parse_args(["--worker", *fwd]).m == [48, 384]
        # torchrun's parser accepts the forwarded arguments after the module name
        run = importlib.import_module("torch.distributed.run")
        ns = run.get_args_parser().parse_args(["--nproc-per-node=2", "-m", "numasched.bench.collectives", "--worker", *fwd])
        assert isinstance(ns, argparse.Namespace) and ns.training_script_args[-len(fwd):] == fwd


def test_collectives_arn_points_only_when_named():
    from numasched.bench import collectives as C

    a = C.build_parser().parse_args([])
    assert not any(p[0] == "all_reduce_add_rmsnorm" for p in C._points(a, 2))
    pts = C._points(C.build_parser().parse_args(["--only", "arn"]), 2)
    assert [(p[3], p[2]) for p in pts] == C.ARN_POINTS and all(p[0] == "all_reduce_add_rmsnorm" for p in pts)
    assert {1, 16} <= {m for _, m in C.ARN_POINTS} and len({n for n, _ in C.ARN_POINTS}) >= 2
    assert {"flag_us", "ll_us"} <= set(C.COLS)


def test_collectives_weight_copies_stream_from_hbm_by_default():
    """--weight-copies: "auto" by default (enough copies that a graph's calls read more than
    twice the L2, at least two), or a count (1: one weight, as the runs before 2026-11-28);
    anything else is refused naming the option."""
    from numasched.bench import collectives as C

    auto = C.build_parser().parse_args([]).weight_copies
    assert auto == C.build_parser().parse_args(["--weight-copies", "auto"]).weight_copies
    assert C.build_parser().parse_args(["--weight-copies", "3"]).weight_copies == 3
    assert C.build_parser().parse_args(["--weight-copies", "1"]).weight_copies == 1
    l2 = 50 << 20
    for nbytes in (8 << 20, 42 << 20, 262 << 20):
        n = C.weight_copy_count(nbytes, l2, auto)
        assert n >= 2 and n * nbytes > 2 * l2 and (n == 2 or (n - 2) * nbytes < 2 * l2), (nbytes, n)
    assert C.weight_copy_count(42 << 20, l2, 1) == 1
    for bad in ("0", "-1", "many"):
        with pytest.raises(SystemExit):
            C.build_parser().parse_args(["--weight-copies", bad])
    assert "--weight-copies" in C.build_parser().format_help()


def test_timeline_summary_counts_overlaps_once_and_idle_time_per_step():
    """bench/timeline.py's arithmetic on recorded kernels: two steps, overlapping kernels (PDL)
    counted once in busy, each kernel's own time in its kind, gaps where no kernel ran."""
    from numasched.bench.timeline import kind_of, summarize

    us = [("gemm_splitk_kernel", 0, 10), ("all_reduce_add_rmsnorm_kernel", 8, 14),   # 2 us overlap
          ("_flash_decode_kernel", 20, 30),                                           # 6 us idle before
          ("gemm_splitk_kernel", 100, 110), ("ncclDevKernel_AllReduce", 112, 120)]    # step 2
    s = summarize(us, steps=2)
    assert s["span_ms"] == pytest.approx(120 / 1e3 / 2)
    assert s["busy_ms"] == pytest.approx((14 + 10 + 10 + 8) / 1e3 / 2)
    assert s["gap_ms"] == pytest.approx((120 - 42) / 1e3 / 2)
    assert s["kernels"] == 2.5
    assert s["by_kind"]["gemm (numasched split-K)"] == pytest.approx(20 / 1e3 / 2)
    assert list(s["by_kind"])[0] == "gemm (numasched split-K)"   # largest first
    # owned: the norm kernel that started at 8 under the GEMM adds 4 (10 -> 14); the owned times sum to busy
    assert s["own_by_kind"]["all-reduce + add + norm"] == pytest.approx(4 / 1e3 / 2)
    assert s["own_by_kind"]["gemm (numasched split-K)"] == pytest.approx(20 / 1e3 / 2)
    assert sum(s["own_by_kind"].values()) == pytest.approx(s["busy_ms"])
    assert kind_of("ncclDevKernel_AllReduce") == "nccl" and kind_of("triton_poi_fused_add_0") == "elementwise (compiled)"
    assert kind_of("sm90_xmma_gemm_bf16") == "gemm (cuBLAS)" and kind_of("mystery") == "other"
    assert summarize([], 3)["gap_ms"] == 0.0
    with pytest.raises(ValueError, match="steps"):
        summarize(us, 0)


def test_timeline_names_numasched_and_cublas_kernels():
    """Every GEMM numasched launches is named as its own (not as cuBLAS through the generic
    "gemm"), and cuBLASLt's Hopper kernels (nvjet) count as cuBLAS's GEMMs, not "other"."""
    from numasched.bench.timeline import is_gemm, kind_of

    assert kind_of("gemm_ws_kernel") == "gemm (numasched WS)"
    assert kind_of("gemm_ws_streamk_kernel") == "gemm (numasched WS)"
    assert kind_of("glu_persistent_kernel") == "gemm (numasched SwiGLU)"
    assert kind_of("weight_first_kernel") == "gemm (numasched weight-first)"
    assert kind_of("all_gather_matmul_kernel") == "all-gather + gemm (fused)"
    assert kind_of("matmul_reduce_scatter_kernel") == "gemm + reduce-scatter (fused)"
    assert kind_of("matmul_all_reduce_ws_kernel") == "gemm + all-reduce (fused)"
    assert kind_of("nvjet_tst_128x64_64x8_1x2_h_bz_coopA_TNT") == "gemm (cuBLAS)"
    assert kind_of("void splitKreduce_kernel<32, 16, int, float>") == "gemm (cuBLAS)"
    assert kind_of("attn_fwd_kernel") == "prefill attention (numasched)"
    assert kind_of("BatchDecodeWithPagedKVCacheKernel") == "attention (FlashInfer)"
    assert all(is_gemm(kind_of(n)) for n in ("gemm_splitk_kernel", "nvjet_x", "all_gather_matmul_kernel",
                                             "matmul_all_reduce_kernel", "glu_persistent_kernel"))
    assert not any(is_gemm(kind_of(n)) for n in ("all_reduce_add_rmsnorm_kernel", "_flash_decode_kernel", "mystery"))


def test_timeline_gemm_roles_per_step_and_a_mismatch():
    """GEMM launches take their role by launch order within each step (two steps of qkv, o and a
    head); owned times by role sum to the GEMM kinds' owned times; a step with a launch more than
    the roles (a library's split-K reduce) leaves the roles unmatched."""
    from numasched.bench.timeline import describe, summarize

    step = [("gemm_splitk_kernel", 0, 10), ("rope", 10, 12), ("gemm_splitk_kernel", 11, 20),   # o starts under rope
            ("all_reduce_add_rmsnorm_kernel", 20, 25), ("nvjet_head", 25, 45)]
    us = step + [(n, s + 100, e + 100) for n, s, e in step]
    roles = ["qkv", "o", "lm_head"]
    s = summarize(us, steps=2, gemm_roles=roles)
    assert s["by_role"] == pytest.approx({"qkv": 10 / 1e3, "o": 9 / 1e3, "lm_head": 20 / 1e3})
    assert s["own_by_role"] == pytest.approx({"qkv": 10 / 1e3, "o": 8 / 1e3, "lm_head": 20 / 1e3})
    gemm_owned = sum(v for k, v in s["own_by_kind"].items() if k.startswith("gemm"))
    assert sum(s["own_by_role"].values()) == pytest.approx(gemm_owned)
    assert s["gemm_launches"] == 3 and "GEMMs by role (owned ms): qkv 0.010, o 0.008" in describe(s)
    extra = us + [("splitKreduce_kernel", 46, 47)]
    t = summarize(extra, steps=2, gemm_roles=roles)
    assert t["by_role"] is None and t["gemm_launches"] == 3.5 and "not matched (3.5 GEMM launches" in describe(t)
    assert "by_role" not in summarize(us, steps=2)   # no roles asked: no role keys


def test_e2e_timeline_rows_and_flag():
    from numasched.bench import e2e

    t = dict(span_ms=1.0, busy_ms=0.8, gap_ms=0.2, kernels=10, by_kind={"gemm": 0.5, "nccl": 0.3})
    rows = [dict(kind="decode", batch=1, context=2048, numasched_timeline=t, torch_step_ms=1.0),
            dict(kind="decode", batch=4, context=2048)]
    out = e2e.timeline_rows(rows, ["numasched", "torch"])
    assert [r["what"] for r in out] == ["(span)", "(kernels busy)", "(idle between kernels)", "gemm", "nccl"]
    assert out[2]["ms_per_step"] == 0.2 and all(r["backend"] == "numasched" and r["batch"] == 1 for r in out)
    assert out[3]["owned_ms_per_step"] is None   # a summary without owned times (older runs) leaves them empty
    roles = dict(t, own_by_kind={"gemm": 0.4}, by_role={"qkv": 0.2, "o": 0.3}, own_by_role={"qkv": 0.15, "o": 0.25})
    out = e2e.timeline_rows([dict(kind="decode", batch=1, context=2048, numasched_timeline=roles)], ["numasched"])
    assert [(r["what"], r["owned_ms_per_step"]) for r in out[-2:]] == [("gemm: qkv", 0.15), ("gemm: o", 0.25)]
    assert e2e.decode_gemm_roles(2) == ["qkv", "o", "gate_up", "down"] * 2 + ["lm_head"]
    assert e2e.main(["--dry-run", "--timeline"]) == 0


def test_e2e_read_floor():
    """bench e2e's read floor: per rank, the K/V of context + 1 tokens and the weights a step
    multiplies by (layer shards, lm_head rows; not the embedding table), counted here from the
    Llama-3-8B config's own numbers; the fraction per backend, none for a failed point."""
    from argparse import Namespace

    from numasched.bench import e2e

    _, spec = e2e._spec(Namespace(model="llama3-8b", layers=None))
    kv = 16 * 32769 * 32 * 2 * (8 // 2) * 128 * 2                # batch x tokens x layers x K,V x heads x dim x bf16
    layer = 4096 * (32 + 2 * 8) * 128 + 32 * 128 * 4096 + 3 * 4096 * 14336
    w = 2 * (32 * layer // 2 + 128256 // 2 * 4096)
    assert e2e.read_bytes(spec, 2, 16, 32768) == kv + w
    assert abs((kv + w) / 1e9 - 41.87) < 0.01                    # 34.36 GB of K/V, 7.50 GB of weights
    assert e2e.read_bytes(spec, 1, 1, 0) == 2 * (32 * 2 * 8 * 128 + 32 * layer + 128256 * 4096)
    row = dict(kind="decode", batch=16, context=32768, numasched_step_ms=10.0, torch_step_ms=float("nan"))
    e2e._add_floor(row, spec, Namespace(tp=2), 4.0e12)
    assert abs(row["read_floor_ms"] - (kv + w) / 4.0e9) < 1e-9 and row["stream_tb_s"] == 4.0
    assert abs(row["numasched_of_floor"] - row["read_floor_ms"] / 10.0) < 1e-12 and "torch_of_floor" not in row
    assert "read_floor_ms" in e2e._columns(["numasched"]) and "numasched_of_floor" in e2e._columns(["numasched"])
    with pytest.raises(ValueError, match="num_key_value_heads"):
        e2e.read_bytes(spec, 16, 1, 0)                          # 8 KV heads on 16 ranks: refused
    # --isolate: each run measured its own rate; the merged row takes the slower one for both
    # fractions (their ratio is then the speedup), whichever run came last
    gb = (kv + w) / 1e9
    runs = {}
    for b, bw, ms in (("numasched", 4.6, 10.0), ("torch", 4.4, 11.0)):
        r = dict(kind="decode", batch=16, context=32768, **{f"{b}_step_ms": ms})
        e2e._add_floor(r, spec, Namespace(tp=2), bw * 1e12)
        runs[b] = [r]
    for order in (runs, dict(reversed(list(runs.items())))):
        m = e2e.merge_rows(order, 2)[0]
        assert m["stream_tb_s"] == 4.4 and abs(m["read_floor_ms"] - gb / 4.4) < 1e-9
        assert abs(m["torch_of_floor"] / m["numasched_of_floor"] - 10.0 / 11.0) < 1e-12
        assert abs(m["speedup"] - 1.1) < 1e-12
    # the model's weights estimate (memory check): the embedding table whole, lm_head's rows
    s = e2e._sizes(spec, Namespace(tp=2, new=32, page_size=16), 16, 32768)
    assert abs(s["weights_gb"] - (w + 2 * 128256 * 4096) / 1e9) < 1e-9


def test_compact_png_keeps_the_pixels_of_a_plot(tmp_path):
    """bench.common.compact_png: a plot's few colours survive the palette exactly, the file gets
    smaller, and a second pass leaves it alone."""
    Image = pytest.importorskip("PIL.Image")
    from numasched.bench.common import compact_png

    rng = np.random.default_rng(0)
    colours = np.array([[255, 255, 255], [31, 119, 180], [255, 127, 14], [44, 160, 44], [0, 0, 0]], np.uint8)
    rgb = colours[rng.integers(0, len(colours), size=(120, 200))]
    path = tmp_path / "plot.png"
    Image.fromarray(np.dstack([rgb, np.full(rgb.shape[:2], 255, np.uint8)]), "RGBA").save(path)
    size = path.stat().st_size
    assert compact_png(path) is True
    with Image.open(path) as im:
        assert im.mode == "P"
        assert np.array_equal(np.asarray(im.convert("RGB")), rgb)
    assert path.stat().st_size < size
    assert compact_png(path) is False


def test_collectives_all_reduce_summary_judges_issue_14s_target():
    """bench collectives' all-reduce line: auto against torch symm_mem's one-shot up to 512 KB and
    against NCCL above it (not the best of every baseline), 0.5 % noise allowed, the worst point
    named; sizes without the peer's time and the GEMM collectives are left out."""
    from numasched.bench import collectives as C

    nan = float("nan")

    def ar(nbytes, auto, symm1, nccl):
        return dict(op="all_reduce", shape=f"{nbytes} B", M=0, bytes=nbytes, auto_us=auto, symm1_us=symm1,
                    nccl_us=nccl, symm2_us=1.0)   # (symm2 faster than all: not the target's peer)

    rows = [ar(8 << 10, 8.0, 8.5, 10.0), ar(512 << 10, 11.9, 11.7, 12.6), ar(24 << 10, 6.5, nan, 9.6),
            ar(1 << 20, 11.8, 15.7, 17.3), ar(64 << 20, 230.0, 388.0, 228.0),
            dict(op="matmul_all_reduce", shape="x", M=16, bytes=1, auto_us=1.0, symm1_us=9.0, nccl_us=9.0)]
    line = C.all_reduce_summary(rows)
    assert line.startswith("all_reduce ")
    assert "<= 512 KB against torch symm_mem's one-shot: 1/2 >= 1.00, worst 0.983 at 524288 B" in line
    assert "> 512 KB against NCCL: 1/2 >= 1.00, worst 0.991 at 67108864 B" in line
    assert C.all_reduce_summary(rows[-1:]) == ""


def test_collectives_overlap_summary_splits_by_the_gemm_ceiling():
    """bench collectives' last line for issue 14's overlap target: auto against bulk from
    OVERLAP_MIN_ROWS rows, judged where bulk / its GEMM alone reaches OVERLAP_TARGET; points below
    that ceiling are listed with it; rows under the minimum, all-reduces and unmeasured times are
    left out."""
    from numasched.bench import collectives as C

    nan = float("nan")
    rows = [
        # pays (1666 / 1300 = 1.28): 1666 / 1473 = 1.131, the worst of those that pay
        dict(op="matmul_reduce_scatter", shape="llama8b.down", M=16384, bulk_us=1666.0, gemm_us=1300.0, auto_us=1473.0),
        dict(op="matmul_all_reduce", shape="llama8b.o", M=4096, bulk_us=244.0, gemm_us=96.0, auto_us=146.0),
        # below the ceiling (3569 / 3200 = 1.115)
        dict(op="matmul_all_reduce", shape="qwen32b.down", M=16384, bulk_us=3569.0, gemm_us=3200.0, auto_us=3535.0),
        dict(op="matmul_reduce_scatter", shape="qwen32b.o", M=1024, bulk_us=95.0, gemm_us=60.0, auto_us=101.0),
        dict(op="all_reduce", shape="8192 B", M=0, bulk_us=nan, auto_us=7.0),
        dict(op="all_gather_matmul", shape="llama8b.qkv", M=4096, bulk_us=244.0, gemm_us=nan, auto_us=172.0),
    ]
    lines = C.overlap_summary(rows).splitlines()
    assert len(lines) == 2
    assert lines[0].startswith(f"auto vs bulk from {C.OVERLAP_MIN_ROWS} rows") and "1/2 >= 1.2x" in lines[0]
    assert "worst 1.131 at matmul_reduce_scatter llama8b.down M=16384" in lines[0]
    assert "qwen32b.down M=16384 1.010x (ceiling 1.115)" in lines[1]
    assert "llama8b.qkv M=4096 1.419x (no GEMM time)" in lines[1] and "M=1024" not in lines[1]
    assert C.overlap_summary(rows[3:5]) == ""


def test_gemm_inference_epilogue_is_named_in_the_plan_and_refused_with_the_ws_forms(capsys):
    """--epilogue: the dry run names the bias / residual on every point and cuBLAS's two-kernel
    baseline; with --ws or --prepared-weight it is refused (they time numasched without it)."""
    from numasched.bench import gemm_inference as GI

    assert GI.main(["--dry-run", "--shapes", "512x4096x4096", "--epilogue", "both"]) == 0
    out = capsys.readouterr().out
    assert "y = x @ W.T + b + h" in out and "torch.addmm(b, x, W.T), then + h" in out
    assert GI.main(["--dry-run", "--shapes", "512x4096x4096", "--epilogue", "residual"]) == 0
    out = capsys.readouterr().out
    assert "y = x @ W.T + h" in out and "torch.matmul(x, W.T), then + h" in out
    for other in (["--ws", "dp"], ["--prepared-weight"], ["--weight-first"]):
        with pytest.raises(SystemExit):
            GI.main(["--dry-run", "--epilogue", "bias"] + other)
    with pytest.raises(SystemExit):
        GI.build_parser().parse_args(["--epilogue", "gelu"])
    with pytest.raises(SystemExit):   # the weight-first GEMM reads the weights as given
        GI.main(["--dry-run", "--weight-first", "--prepared-weight"])
    capsys.readouterr()
    assert GI.main(["--dry-run", "--shapes", "16x3072x4096", "--weight-first"]) == 0
    assert "the weight-first decode GEMM at M <= 64 (--weight-first)" in capsys.readouterr().out
