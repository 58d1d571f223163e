"""The tree is the architecture: the import-linter contracts of pyproject.toml hold.

Layers (command line > tools > ops > plan/launch core > device code > mappings and models >
capabilities), the library never imports bench/, kernels/ holds no host planning, and no import
cycles between sibling modules. import-linter reads the package from the filesystem; the design's
folders kernels/, mappings/ and bench/ install as numasched.* (pyproject's package-dir), so the
test stages the installed layout in a temporary folder and runs ``lint-imports`` there.
"""
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _stage(dst: Path) -> None:
    def copy(src: Path, to: Path):
        for f in src.rglob("*.py"):
            t = to / f.relative_to(src)
            t.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(f, t)

    copy(ROOT / "numasched", dst / "numasched")
    for d in ("bench", "kernels", "mappings"):
        copy(ROOT / d, dst / "numasched" / d)
    shutil.copy2(ROOT / "pyproject.toml", dst / "pyproject.toml")


def _lint(stage: Path):
    exe = shutil.which("lint-imports")
    if exe is None:
        pytest.fail("lint-imports is not installed (pip install 'numasched[test]' installs import-linter)")
    env = {"PYTHONPATH": str(stage), "PATH": str(Path(sys.executable).parent) + ":/usr/bin:/bin"}
    return subprocess.run([exe, "--no-cache"], cwd=stage, env=env, capture_output=True, text=True, timeout=300)


def test_import_contracts_hold(tmp_path):
    _stage(tmp_path)
    r = _lint(tmp_path)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    assert "BROKEN" not in r.stdout and "KEPT" in r.stdout


def test_contracts_catch_a_violation(tmp_path):
    # the check has teeth: a library module that imports bench/ breaks a contract
    _stage(tmp_path)
    with open(tmp_path / "numasched" / "gemm.py", "a") as f:
        f.write("\nfrom numasched.bench import common as _bad  # noqa\n")
    r = _lint(tmp_path)
    assert r.returncode != 0 and "numasched.gemm" in r.stdout
