"""The ``numasched`` command.

Subcommands live beside the code they drive; each module exposes ``add_parser(subparsers)`` that
registers itself and sets ``func(args) -> int``:

    numasched report      simulator report + a kernel check (interpreter on CPU, compiled on GPU)
    numasched simulate    L2 simulator for a GPU topology and a kernel (numasched.sim)
    numasched probe       measure the locality structure of the GPU at hand (numasched.probe)
    numasched bench       benchmark suites side by side with peers (numasched.bench)
    numasched policies    list the registered mapping policies
    numasched tune-gemm   time GEMM schedules for given shapes into a table the chooser consults

Exit codes, for every subcommand and bench suite: 0 success; 2 bad usage (argparse's code: an
unknown option, or a value an option's type rejects, with a message naming the option); 2 also
when the command cannot run on this machine (e.g. a GPU suite without a CUDA GPU); 1 when it ran
and something failed (a wrong kernel result, a failed measurement).

The argparse types (:mod:`numasched.argtypes`: ``positive_int``, ``plot_path``, ...) are shared
by the subcommands and the bench suites: a bad value is rejected while the arguments are parsed,
before any work starts, and argparse's message names the option (``argument --seq: ...``).
"""
from __future__ import annotations

import argparse
import importlib
import sys

from .argtypes import (  # noqa: F401  (re-exported: the subcommands' and suites' types)
    check_help, nonneg_float, nonneg_int, out_dir, plot_path, positive_float, positive_int, unit_float,
)

# (module, attribute) of each subcommand's add_parser; imported lazily so a broken optional part
# does not take the whole command down.
_SUBCOMMANDS = [
    ("numasched.report", "add_parser"),
    ("numasched.sim", "add_parser"),
    ("numasched.probe", "add_parser"),
    ("numasched.bench.cli", "add_parser"),
    ("numasched.gemm_tune", "add_parser"),
    ("numasched.gemm_tune", "add_plan_parser"),
]


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
