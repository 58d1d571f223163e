"""argparse types shared by the ``numasched`` command, its subcommands and the bench suites.

A bad value is rejected while the arguments are parsed, before any work starts, and argparse's
message names the option (``argument --seq: expected an integer >= 1, got '0'``). This module
imports nothing of numasched: every layer may use it.
"""
from __future__ import annotations

import argparse
import importlib.util
import math
import os
from pathlib import Path


def _number(text: str, kind, what: str):
    try:
        value = kind(text)
    except (TypeError, ValueError):
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
    if isinstance(value, float) and not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
    return value


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    v = _number(text, int, "an integer >= 1")
    if v < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return v


def nonneg_int(text: str) -> int:
    """argparse type: an integer >= 0."""
    v = _number(text, int, "an integer >= 0")
    if v < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}")
    return v


def positive_float(text: str) -> float:
    """argparse type: a finite number > 0."""
    v = _number(text, float, "a finite number > 0")
    if v <= 0:
        raise argparse.ArgumentTypeError(f"expected a finite number > 0, got {text!r}")
    return v


def nonneg_float(text: str) -> float:
    """argparse type: a finite number >= 0."""
    v = _number(text, float, "a finite number >= 0")
    if v < 0:
        raise argparse.ArgumentTypeError(f"expected a finite number >= 0, got {text!r}")
    return v


def unit_float(text: str) -> float:
    """argparse type: a number in [0, 1)."""
    v = _number(text, float, "a number in [0, 1)")
    if not 0 <= v < 1:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1), got {text!r}")
    return v


def _writable_dir(d: Path) -> bool:
    return d.is_dir() and os.access(d, os.W_OK | os.X_OK)


def plot_path(text: str) -> Path:
    """argparse type for ``--plot FILE.png``: an output file (:func:`out_file`: its folder must
    exist and be writable), and matplotlib must be installed (it comes with ``pip install
    'numasched[cli]'``), so a bad path fails before the run rather than after it."""
    path = out_file(text)
    if importlib.util.find_spec("matplotlib") is None:
        raise argparse.ArgumentTypeError("plots need matplotlib: pip install 'numasched[cli]'")
    return path


def out_file(text: str) -> Path:
    """argparse type for an output file (``--out FILE``): not a folder, in an existing writable
    folder, so a bad path fails before a long run rather than after it."""
    path = Path(text).expanduser()
    if not text or path.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is a folder; give a file name")
    parent = path.parent if str(path.parent) else Path(".")
    if not parent.is_dir():
        raise argparse.ArgumentTypeError(f"cannot write {text!r}: folder {str(parent)!r} does not exist")
    if not _writable_dir(parent) or (path.exists() and not os.access(path, os.W_OK)):
        raise argparse.ArgumentTypeError(f"cannot write {text!r}: no write permission")
    return path


def positive_int_list(text: str) -> list:
    """argparse type: comma-separated integers >= 1 (at least one) -> [int, ...]."""
    try:
        vals = [positive_int(x) for x in text.split(",") if x.strip()]
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers >= 1, got {text!r}") from None
    if not vals:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers >= 1, got {text!r}")
    return vals


def subset(*choices: str):
    """argparse type factory: comma-separated names among ``choices`` (at least one) -> [name, ...]."""
    def parse(text: str) -> list:
        names = [x.strip() for x in text.split(",") if x.strip()]
        bad = [n for n in names if n not in choices]
        if bad or not names:
            raise argparse.ArgumentTypeError(f"expected comma-separated names among {', '.join(choices)}, got "
                                             f"{text!r}")
        return names
    parse.__name__ = "subset"
    return parse


def out_dir(text: str) -> Path:
    """argparse type for ``--out-dir``: an existing writable folder, or one that can be created
    (its nearest existing ancestor is a writable folder)."""
    path = Path(text).expanduser()
    if path.exists() and not path.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} exists and is not a folder")
    probe = path
    while not probe.exists():
        if probe.parent == probe:
            break
        probe = probe.parent
    if not _writable_dir(probe):
        raise argparse.ArgumentTypeError(f"cannot write into {text!r}: {str(probe)!r} is not a writable folder")
    return path


def check_help(parser: argparse.ArgumentParser) -> list:
    """Options of ``parser`` and its subparsers without help text: ["prog --option", ...] (tests)."""
    missing = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            listed = {a.dest for a in action._choices_actions if a.help and str(a.help).strip()}
            missing += [f"{parser.prog} {name} (no help line)" for name in action.choices if name not in listed]
            for sub in dict.fromkeys(action.choices.values()):
                missing += check_help(sub)
        elif action.help is None or (action.help != argparse.SUPPRESS and not str(action.help).strip()):
            missing.append(f"{parser.prog} {'/'.join(action.option_strings) or action.dest}")
    return missing


def shape_list(text: str) -> list:
    """argparse type of ``--shapes``: comma-separated MxNxK, each size >= 1 -> [(M, N, K), ...].
    ``@PATH`` reads them from a file instead: one or more per line, commas or whitespace between,
    ``#`` to the end of a line a comment (bench/gemm_offgrid_shapes.txt)."""
    if text.startswith("@"):
        path = text[1:]
        try:
            with open(path) as f:
                lines = [line.split("#", 1)[0] for line in f]
        except OSError as e:
            raise argparse.ArgumentTypeError(f"cannot read the shapes file {path!r}: {e.strerror or e}") from None
        text = ",".join(item for line in lines for item in line.replace(",", " ").split())
        if not text:
            raise argparse.ArgumentTypeError(f"the shapes file {path!r} holds no MxNxK shape")
    out = []
    for item in (x.strip() for x in text.split(",") if x.strip()):
        try:
            m, n, k = (int(v) for v in item.lower().split("x"))
        except ValueError:
            m = n = k = 0
        if min(m, n, k) < 1:
            raise argparse.ArgumentTypeError(f"expected comma-separated MxNxK sizes >= 1 (e.g. 4096x4096x4096), "
                                             f"got {item!r}")
        out.append((m, n, k))
    if not out:
        raise argparse.ArgumentTypeError("expected at least one MxNxK shape")
    return out
