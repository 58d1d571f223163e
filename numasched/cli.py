"""The ``numasched`` command.

Subcommands live beside the code they drive; each module exposes ``add_parser(subparsers)`` that
registers itself and sets ``func(args) -> int``:

    numasched report      simulator report + a kernel check (interpreter on CPU, compiled on GPU)
    numasched simulate    L2 simulator for a GPU topology and a kernel (numasched.sim)
    numasched probe       measure the locality structure of the GPU at hand (numasched.probe)
    numasched bench       benchmark suites side by side with peers (numasched.bench)
    numasched policies    list the registered mapping policies

Exit codes, for every subcommand and bench suite: 0 success; 2 bad usage (argparse's code: an
unknown option, or a value an option's type rejects, with a message naming the option); 2 also
when the command cannot run on this machine (e.g. a GPU suite without a CUDA GPU); 1 when it ran
and something failed (a wrong kernel result, a failed measurement).

The argparse types below (:func:`positive_int`, :func:`plot_path`, ...) are shared by the
subcommands and the bench suites: a bad value is rejected while the arguments are parsed, before
any work starts, and argparse's message names the option (``argument --seq: ...``).
"""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import math
import os
import sys
from pathlib import Path

# (module, attribute) of each subcommand's add_parser; imported lazily so a broken optional part
# does not take the whole command down.
_SUBCOMMANDS = [
    ("numasched.report", "add_parser"),
    ("numasched.sim", "add_parser"),
    ("numasched.probe", "add_parser"),
    ("numasched.bench.cli", "add_parser"),
]


# ----------------------------------------------------------------------------- argparse types
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
    """argparse type for ``--plot FILE.png``: the folder must exist and be writable, and matplotlib
    must be installed (it comes with ``pip install 'numasched[cli]'``), so a bad path fails before
    the run rather than after it."""
    path = Path(text).expanduser()
    if not text or path.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is a folder; give a file name such as cmp.png")
    parent = path.parent if str(path.parent) else Path(".")
    if not parent.is_dir():
        raise argparse.ArgumentTypeError(f"cannot write {text!r}: folder {str(parent)!r} does not exist")
    if not _writable_dir(parent) or (path.exists() and not os.access(path, os.W_OK)):
        raise argparse.ArgumentTypeError(f"cannot write {text!r}: no write permission")
    if importlib.util.find_spec("matplotlib") is None:
        raise argparse.ArgumentTypeError("plots need matplotlib: pip install 'numasched[cli]'")
    return path


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


# ----------------------------------------------------------------------------- the command
def _policies(args) -> int:
    from . import mappings

    for kind in mappings.KINDS:
        print(f"{kind}:")
        for name in mappings.available(kind):
            print(f"  {name:24s} {mappings.get(name).doc}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    from . import __version__

    parser = argparse.ArgumentParser(prog="numasched", description=__doc__.split("\n\n")[0])
    parser.add_argument("--version", action="version", version=f"numasched {__version__}",
                        help="print the version of numasched and exit")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND",
                                help="one of the subcommands below ('numasched COMMAND --help' for its options)")
    p = sub.add_parser("policies", help="list the registered mapping policies")
    p.set_defaults(func=_policies)
    for mod, attr in _SUBCOMMANDS:
        try:
            add = getattr(importlib.import_module(mod), attr, None)
        except ModuleNotFoundError as e:  # a part not written yet
            if e.name and e.name.startswith("numasched"):
                continue
            raise
        if add is not None:
            add(sub)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
