"""The command line: --version, exit codes, help on every option, argument errors that name the
option, the simulator's default synchronisation model, plain-text output without rich/matplotlib,
and the packaging around it (py.typed, LICENSE, extras)."""
import importlib
import importlib.util
import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import torch

import numasched
from numasched import cli
from numasched.bench.cli import SUITES

ROOT = Path(__file__).resolve().parents[1]
# Options without help text in modules outside this change (numasched/probe); listed so that the
# walk below stays strict for every other parser.
KNOWN_WITHOUT_HELP: set = set()


def _main(argv):
    """cli.main, with argparse's SystemExit turned into its exit code."""
    try:
        return cli.main(argv)
    except SystemExit as e:
        return e.code


def _run(args, env=None, cwd=None, timeout=300):
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout, cwd=cwd,
                          env=dict(os.environ, **(env or {})))


def _suite_parsers():
    return {s: importlib.import_module(f"numasched.bench.{s}").build_parser() for s in SUITES}


def _script(name):
    spec = importlib.util.spec_from_file_location(f"_script_{name}", ROOT / "scripts" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# ----------------------------------------------------------------------------------- --version, help
def test_version(capsys):
    assert _main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"numasched {numasched.__version__}"


def test_every_option_of_every_parser_has_help():
    missing = cli.check_help(cli.build_parser())
    for suite, parser in _suite_parsers().items():
        missing += cli.check_help(parser)
    missing += cli.check_help(_script("decode_configs").build_parser())
    assert set(missing) <= KNOWN_WITHOUT_HELP, sorted(set(missing) - KNOWN_WITHOUT_HELP)


def test_check_help_finds_an_option_without_help():
    import argparse

    p = argparse.ArgumentParser(prog="x")
    p.add_argument("--a", help="fine")
    p.add_argument("--b")
    p.add_argument("--c", help=" ")
    assert cli.check_help(p) == ["x --b", "x --c"]


# ----------------------------------------------------------------------------------- exit codes
@pytest.mark.parametrize("argv", [
    ["no-such-command"],
    [],
    ["simulate", "--no-such-option"],
    ["bench", "no-such-suite"],
    ["simulate", "--seq", "many"],
])
def test_bad_usage_exits_2(argv, capsys):
    assert _main(argv) == 2
    assert "error" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only exit code")
@pytest.mark.parametrize("suite", sorted(SUITES))
def test_gpu_suite_on_cpu_exits_nonzero_with_one_line(suite, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert _main(["bench", suite]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "GPU" in err, err
    assert not any(tmp_path.iterdir())  # nothing written


@pytest.mark.parametrize("suite", sorted(SUITES))
def test_every_suite_has_a_dry_run_that_times_nothing(suite, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    called = []
    monkeypatch.setattr("numasched.bench.common.bench_ms", lambda *a, **k: called.append(1))
    assert _main(["bench", suite, "--dry-run", "--quick"] if suite != "host_overhead"
                 else ["bench", suite, "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "--dry-run" in out and "nothing timed" in out and "contenders:" in out
    assert not called and not any(tmp_path.iterdir())


def test_dry_run_validates_its_arguments(capsys):
    assert _main(["bench", "gemm", "--dry-run", "--shapes", "64x64"]) == 2
    assert "--shapes" in capsys.readouterr().err
    assert _main(["bench", "decode", "--dry-run", "--mapping", "grouped"]) == 2   # a GEMM policy
    assert "--mapping" in capsys.readouterr().err
    assert _main(["bench", "gemm", "--dry-run", "--shapes", "64x32x16", "--policies", "row_major"]) == 0
    out = capsys.readouterr().out
    assert "M=64 N=32 K=16" in out and "mapping=row_major" in out and "mapping=grouped" not in out


# ----------------------------------------------------------------------------------- option errors
@pytest.mark.parametrize("argv,option", [
    (["simulate", "--block-n", "0"], "--block-n"),
    (["simulate", "--block-m", "-4"], "--block-m"),
    (["simulate", "--seq", "0"], "--seq"),
    (["simulate", "--seq", "-5"], "--seq"),
    (["simulate", "--tflops", "-1"], "--tflops"),
    (["simulate", "--tflops", "nan"], "--tflops"),
    (["simulate", "--tile", "0x64"], "--tile"),
    (["simulate", "--jitter", "1.5"], "--jitter"),
    (["simulate", "--splits", "0"], "--splits"),
    (["simulate", "--gpu", "mi999"], "--gpu"),
    (["bench", "decode", "--ctx", "0"], "--ctx"),
    (["bench", "prefill", "--seqs", "x"], "--seqs"),
    (["bench", "host_overhead", "-n", "0"], "--calls"),
    (["bench", "distributed", "--methods", "fused,nope"], "--methods"),
])
def test_invalid_values_are_rejected_naming_the_option(argv, option, capsys, monkeypatch):
    monkeypatch.setattr("numasched.sim.cli.simulate_all", _must_not_run)
    assert _main(argv) == 2
    err = capsys.readouterr().err
    assert f"argument {option}" in err or f"argument -n/{option}" in err, err
    assert "Traceback" not in err


def _must_not_run(*a, **k):
    raise AssertionError("the run started although an argument was invalid")


def test_block_n_is_used_as_given_never_replaced():
    from numasched.sim.cli import build_model

    p = cli.build_parser()
    assert build_model(p.parse_args(["simulate", "--block-n", "32"])).block_n == 32
    assert build_model(p.parse_args(["simulate"])).block_n == 64
    assert build_model(p.parse_args(["simulate", "--kernel", "gemm"])).block_n == 128
    assert build_model(p.parse_args(["simulate", "--kernel", "gemm", "--tile", "64x32x16"])).block_n == 32


@pytest.mark.parametrize("path", ["{tmp}/missing-folder/cmp.png", "{tmp}"])
def test_bad_plot_path_fails_at_parsing_before_the_run(path, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("numasched.sim.cli.simulate_all", _must_not_run)
    assert _main(["simulate", "--plot", path.format(tmp=tmp_path), "--no-progress"]) == 2
    assert "argument --plot" in capsys.readouterr().err


def test_plot_without_matplotlib_names_the_extra(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setattr("numasched.sim.cli.simulate_all", _must_not_run)
    assert _main(["simulate", "--plot", str(tmp_path / "x.png")]) == 2
    assert "pip install 'numasched[cli]'" in capsys.readouterr().err


def test_out_dir_that_is_a_file_is_rejected(tmp_path, capsys):
    f = tmp_path / "file"
    f.write_text("")
    assert _main(["bench", "gemm", "--dry-run", "--out-dir", str(f)]) == 2
    assert "argument --out-dir" in capsys.readouterr().err


# ----------------------------------------------------------------------------------- simulate defaults
def test_simulate_defaults_to_the_skew_model_and_labels_the_table(capsys):
    from numasched.sim.cli import DEFAULT_SKEW, sync_model

    p = cli.build_parser()
    assert DEFAULT_SKEW == 32  # the report's main setting, closest to the published counters
    assert sync_model(p.parse_args(["simulate"])) == dict(skew=32, jitter=0.0)
    assert sync_model(p.parse_args(["simulate", "--skew", "0"])) == dict(skew=0, jitter=0.0)   # lockstep
    assert sync_model(p.parse_args(["simulate", "--jitter", "0.2"])) == dict(skew=0, jitter=0.2)
    assert sync_model(p.parse_args(["simulate", "--jitter", "0.2", "--skew", "8"])) == dict(skew=8, jitter=0.2)
    sub = next(a for a in p._actions if a.dest == "command").choices["simulate"]
    assert "lockstep over-counts" in sub.format_help().replace("\n", " ").replace("  ", " ")
    assert _main(["simulate", "--heads", "8", "--seq", "512", "--mapping", "head_first,block_first",
                  "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "sync: skew 32" in out and "speedup vs " in out


def test_simulate_default_matches_an_explicit_skew_32(capsys):
    args = ["simulate", "--heads", "8", "--seq", "512", "--mapping", "head_first", "--json", "--no-progress"]

    def results(extra):
        assert _main(args + extra) == 0
        return [{k: v for k, v in r.items() if k != "sim_seconds"} for r in json.loads(capsys.readouterr().out)]

    default = results([])
    assert default[0]["skew"] == 32 and default[0]["jitter"] == 0.0
    assert results(["--skew", "32"]) == default
    assert results(["--skew", "0"])[0]["skew"] == 0


# ----------------------------------------------------------------------------------- optional rich/matplotlib
def test_library_imports_neither_rich_nor_matplotlib():
    code = ("import sys, numasched, numasched.cli, numasched.sim, numasched.sim.cli, numasched.sim.report, "
            "numasched.report, numasched.bench.common, numasched.bench.cli, numasched.bench.decode, "
            "numasched.bench.gemm, numasched.bench.prefill, numasched.bench.policies, numasched.bench.host_overhead; "
            "numasched.cli.build_parser(); "
            "bad = [m for m in ('rich', 'matplotlib') if m in sys.modules]; print(bad); sys.exit(1 if bad else 0)")
    r = _run(["-c", code])
    assert r.returncode == 0, r.stdout + r.stderr


def test_plain_text_without_rich_and_matplotlib(tmp_path):
    code = ("import sys; sys.modules['rich'] = None; sys.modules['matplotlib'] = None; "
            "from numasched.cli import main; sys.exit(main(sys.argv[1:]))")
    r = _run(["-c", code, "simulate", "--heads", "8", "--seq", "512", "--mapping", "head_first"])
    assert r.returncode == 0, r.stderr
    assert "speedup vs head_first" in r.stdout and "L2 hit" in r.stdout and "┃" not in r.stdout
    r = _run(["-c", code, "report", "--skip-sim", "--skip-kernels"])
    assert r.returncode == 0, r.stderr
    assert "Topology presets" in r.stdout and "mi300x" in r.stdout
    r = _run(["-c", code, "simulate", "--plot", str(tmp_path / "x.png")])
    assert r.returncode == 2 and "numasched[cli]" in r.stderr


def test_bench_results_without_rich_and_matplotlib(tmp_path):
    code = ("import sys; sys.modules['rich'] = None; sys.modules['matplotlib'] = None; "
            "from numasched.bench.common import write_results, progress; "
            "assert list(progress([1, 2], 'x')) == [1, 2]; "
            f"p = write_results('t', [dict(a=1, b=2.5)], plot=lambda rows, path: 1 / 0, out_dir={str(tmp_path)!r}, "
            "log='note'); print(sorted(p))")
    r = _run(["-c", code])
    assert r.returncode == 0, r.stderr
    assert "['csv', 'json', 'log']" in r.stdout and "pip install 'numasched[cli]'" in r.stdout
    (log,) = tmp_path.glob("t-*.log")
    assert "2.5" in log.read_text() and log.read_text().rstrip().endswith("note")


# ----------------------------------------------------------------------------------- results folder
def test_results_folder_rule(tmp_path, monkeypatch):
    from numasched.bench import common

    monkeypatch.delenv("NUMASCHED_RESULTS_DIR", raising=False)
    monkeypatch.chdir(tmp_path)
    assert common.results_dir() == tmp_path / "bench-results"
    # RESULTS_DIR is resolved when read (module __getattr__; a test elsewhere may have set a fixed one)
    assert common.__getattr__("RESULTS_DIR") == tmp_path / "bench-results"
    (tmp_path / "bench" / "results").mkdir(parents=True)   # a numasched checkout's root
    assert common.results_dir() == tmp_path / "bench" / "results"
    monkeypatch.setenv("NUMASCHED_RESULTS_DIR", str(tmp_path / "env"))
    assert common.results_dir() == tmp_path / "env"
    assert common.results_dir(tmp_path / "given") == tmp_path / "given"
    monkeypatch.delenv("NUMASCHED_RESULTS_DIR")
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")   # never the installed package's folder
    assert common.results_dir() == tmp_path / "elsewhere" / "bench-results"


def test_results_go_to_the_working_directory(tmp_path, monkeypatch):
    from numasched.bench import common

    monkeypatch.delenv("NUMASCHED_RESULTS_DIR", raising=False)
    monkeypatch.chdir(tmp_path)
    paths = common.write_results("t", [dict(a=1)])
    assert paths["csv"].parent == tmp_path / "bench-results" and paths["csv"].exists()


# ----------------------------------------------------------------------------------- packaging
def test_packaging():
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())
    proj = meta["project"]
    deps = " ".join(proj["dependencies"])
    assert "rich" not in deps and "matplotlib" not in deps
    extras = proj["optional-dependencies"]
    for extra in ("cli", "test"):
        assert any(d.startswith("rich") for d in extras[extra]) and any(d.startswith("matplotlib")
                                                                         for d in extras[extra])
    dist = extras["distributed"]
    assert any(d.startswith("tokenspeed-iris==") for d in dist)
    assert any(d.startswith("tokenspeed-tritonblas==") for d in dist)
    assert "py.typed" in meta["tool"]["setuptools"]["package-data"]["numasched"]
    assert (ROOT / "numasched" / "py.typed").exists()
    lic = (ROOT / "LICENSE").read_text()
    assert lic.startswith("MIT License") and "numasched authors" in lic
    assert proj["license"]["text"] == "MIT"


def test_tune_gemm_dry_run_and_bad_shapes(capsys):
    from numasched.cli import main

    assert main(["tune-gemm", "--shapes", "1x4096x4096,16x14336x4096", "--out", "t.json", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "1x4096x4096" in out and "16x14336x4096" in out
    with pytest.raises(SystemExit) as e:
        main(["tune-gemm", "--shapes", "0x4x4", "--out", "t.json"])
    assert e.value.code == 2 and "argument --shapes" in capsys.readouterr().err


def test_plan_gemm_shows_the_pick_as_matmul_plans_it(capsys):
    """``numasched plan-gemm``: on this machine, no GPU, the chooser's pick for a named GPU is the
    one numasched.matmul's model makes (the same _choose arguments for an aligned bf16 weight),
    listed with its estimate, the next candidates cheapest first, and the byte and flop floors;
    bad machines, dtypes and sizes are refused naming the argument."""
    from numasched import gemm_schedule as GS
    from numasched.cli import main
    from numasched.gemm_tune import explain

    for machine in ("h100", "h200"):
        e = explain(187, 6144, 3072, machine, top=4)
        want = GS._choose(187, 6144, 3072, 2, GS._KNOWN[machine], False, True, True, True, True, True)
        assert e["pick"] == want.describe() and e["pick_us"] == pytest.approx(want.est_s * 1e6)
        assert e["ws"] and e["aligned"] and len(e["next"]) == 4 and e["pick"] not in [d for d, _ in e["next"]]
        assert [t for _, t in e["next"]] == sorted(t for _, t in e["next"])
        assert 0 < e["floor_us"] < e["pick_us"] and 0 < e["tensor_us"] < e["pick_us"]
    amd = explain(13, 4111, 2053, "mi300x", "fp32", top=2)   # odd K: rows not 16-byte aligned, no WS
    assert not amd["aligned"] and not amd["ws"] and amd["pick"].startswith("splitk")
    assert all(GS.Schedule.parse(d).block_k <= GS.MISALIGNED_MAX_BLOCK_K for d, _ in amd["next"])
    assert main(["plan-gemm", "--shapes", "27x9216x3072,4096x4096x4096", "--machine", "h200", "--top", "2"]) == 0
    out = capsys.readouterr().out
    assert "27 x 9216 x 3072 bf16 on H200" in out and out.count("  next ") == 4 and "pick   ws 128x" in out
    for bad, word in ((["--machine", "a100"], "--machine"), (["--dtype", "int8"], "--dtype"), (["--top", "-1"], "--top")):
        with pytest.raises(SystemExit):
            main(["plan-gemm", "--shapes", "1x8x8", *bad])
        assert word in capsys.readouterr().err
    for kw, word in ((dict(machine="a100"), "machine"), (dict(dtype="int8"), "dtype")):
        with pytest.raises(ValueError, match=word):
            explain(1, 8, 8, **kw)
    with pytest.raises(ValueError, match="K must be a positive int"):
        explain(1, 8, 0)


def test_shapes_from_a_file(tmp_path, capsys):
    """``--shapes @FILE``: the shapes of a file (comments, commas or whitespace between them), the
    same list as written out; a missing or empty file, or a bad shape in it, is an argument error
    naming the file or the shape."""
    import argparse

    from numasched.argtypes import shape_list
    from numasched.cli import main

    f = tmp_path / "shapes.txt"
    f.write_text("# a comment\n3x15296x8528  14x4824x2584\n\n20x13504x9088, 1x2x3  # trailing\n")
    assert shape_list(f"@{f}") == [(3, 15296, 8528), (14, 4824, 2584), (20, 13504, 9088), (1, 2, 3)]
    listed = [tuple(int(v) for v in line.split("x")) for line in
              (ROOT / "bench" / "gemm_offgrid_shapes.txt").read_text().splitlines() if line and line[0] != "#"]
    assert shape_list(f"@{ROOT / 'bench' / 'gemm_offgrid_shapes.txt'}") == listed and len(listed) >= 40
    for text, words in ((f"@{tmp_path / 'none.txt'}", "none.txt"), ("@" + str(tmp_path / "empty"), "no MxNxK")):
        (tmp_path / "empty").write_text("# nothing\n")
        with pytest.raises(argparse.ArgumentTypeError, match=words):
            shape_list(text)
    f.write_text("3x4x0\n")
    with pytest.raises(argparse.ArgumentTypeError, match="3x4x0"):
        shape_list(f"@{f}")
    f.write_text("1x4096x4096\n16x14336x4096\n")
    assert main(["tune-gemm", "--shapes", f"@{f}", "--out", str(tmp_path / "t.json"), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "1x4096x4096" in out and "16x14336x4096" in out


def test_gemm_rank_eval_scores_recorded_timings(tmp_path, capsys):
    """scripts/gemm_rank_eval.py: at each recorded point the model's first choice among the timed
    schedules against the fastest, from a gemm_inference CSV and a gemv_probe log. Of two 16-row
    schedules at a large weight the one the model prices lower is recorded 7 % slower: a miss at
    both compared points (a point with one timed schedule is not compared); a patched model that
    prices it higher has none."""
    from numasched import gemm_schedule as GS

    mod = _script("gemm_rank_eval")
    m = GS._KNOWN["h100"]
    names = ("splitk 16x128x64 w4 s6", "splitk 16x32x256 w4 s6")
    est = {n: GS.estimate(GS.Schedule.parse(n), 1, 28672, 4096, 2, m, True, True) for n in names}
    a, b = sorted(names, key=est.get)   # a: the model's first choice
    assert est[a] < est[b]
    tile = {n: n.split()[1] for n in names}
    csv_path = tmp_path / "gemm_inference-h100.csv"
    csv_path.write_text("model,proj,M,N,K,timed\n"
                        f"x,y,1,28672,4096,{a}=86.18/1.0;{b}=80.30/2.0\n"
                        f"x,y,64,28672,4096,{a}=86.18/1.0\n")      # one schedule: no comparison
    log = tmp_path / "gemv_probe-h100.log"
    log.write_text("   16 x 28672 x  4096 cublas 83.7 pick 88.5\n"
                   f"    cublas=83.74; pick=88.47; sk {tile[a]} s6=88.08; sk {tile[b]} s6=81.85; read=76.3\n")
    pts = mod.read_points([str(csv_path), str(log)], 1 << 30)
    assert pts[(str(log), 16, 28672, 4096)] == {a: 88.08, b: 81.85} and len(pts) == 3
    res = mod.score(pts, m)
    assert len(res) == 2 and all(r > 1.07 and pick[2] == a for r, pick, _ in res.values())
    assert mod.main([str(csv_path), str(log), "--misses"]) == 0
    out = capsys.readouterr().out
    assert "points 2: pick within 3 % of the best timed 0" in out and f"pick {a}" in out
    patch = tmp_path / "patch.py"
    patch.write_text("from numasched import gemm_schedule as GS\n"
                     "_orig = GS.estimate\n"
                     "def estimate(s, *a, **k):\n"
                     f"    return _orig(s, *a, **k) * (2.0 if s.describe() == {a!r} else 1.0)\n"
                     "GS.estimate = estimate\n")
    orig = GS.estimate
    try:
        assert mod.main([str(csv_path), str(log), "--patch", str(patch)]) == 0
    finally:
        GS.estimate = orig
    assert "points 2: pick within 3 % of the best timed 2" in capsys.readouterr().out


def test_gemm_rank_eval_chooser_scores_the_ws_twin_it_runs(tmp_path):
    """gemm_rank_eval --chooser: where the chooser swaps its pick (128 x 128 Triton tiles split in K
    at 129-192 rows) for the WS twin (gemm_schedule.ws_split_twin) and the twin was timed, the
    pick's time is the twin's; without the twin timed, the Triton tiles' own."""
    from numasched import gemm_schedule as GS

    mod = _script("gemm_rank_eval")
    m = GS._KNOWN["h100"]
    M, N, K = 159, 3616, 7496
    chosen = GS._choose.__wrapped__(M, N, K, 2, m, False, True, True, True, True, False)
    assert chosen.kind == "ws" and chosen.split_k > 1, chosen           # the twin, as the chooser runs it
    triton = f"splitk 128x128x64 w8 s6 split{chosen.split_k}"
    other = "splitk 128x64x128 w8 s4"
    csv_path = tmp_path / "gemm_inference-h100.csv"
    csv_path.write_text("model,proj,M,N,K,timed\n"
                        f"x,y,{M},{N},{K},{triton}=41.9/1.0;{chosen.describe()}=40.0/1.0;{other}=60.0/1.0\n"
                        f"x,y,{M},{N},{K + 8},{triton}=41.9/1.0;{other}=60.0/1.0\n")
    res = mod.score(mod.read_points([str(csv_path)], 1 << 30), m, chooser=True)
    by_k = {key[3]: v for key, v in res.items()}
    assert by_k[K][1][2] == chosen.describe() and by_k[K][0] == 1.0     # the twin timed: its time, the best
    assert by_k[K + 8][1][2] == triton                                   # not timed: the Triton tiles'


def test_gluon_multicast_probe_compiles_a_cluster_load_offline(capsys):
    """scripts/gluon_multicast_probe.py: a TMA load into a tile replicated over a 2-CTA cluster,
    compiled for sm_90 without a GPU; it reports the copy instructions and whether they multicast
    (Triton 3.6: no); a cluster of 3 CTAs is refused naming the flag."""
    import re

    mod = _script("gluon_multicast_probe")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "gluon_multicast_probe.py")], capture_output=True,
                       text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "num_ctas=2" in r.stdout and re.search(r"multicast: (yes|no)", r.stdout)
    assert "cp.async.bulk.tensor" in r.stdout
    with pytest.raises(SystemExit):
        mod.main(["--ctas", "3"])
