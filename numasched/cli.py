"""The ``numasched`` command.

Subcommands live beside the code they drive; each module exposes ``add_parser(subparsers)`` that
registers itself and sets ``func(args) -> int``:

    numasched report      simulator report + a kernel check (interpreter on CPU, compiled on GPU)
    numasched simulate    L2 simulator for a GPU topology and a kernel (numasched.sim)
    numasched probe       measure the locality structure of the GPU at hand (numasched.probe)
    numasched bench       benchmark suites side by side with peers (numasched.bench)
    numasched policies    list the registered mapping policies
"""
from __future__ import annotations

import argparse
import importlib
import sys

# (module, attribute) of each subcommand's add_parser; imported lazily so a broken optional part
# does not take the whole command down.
_SUBCOMMANDS = [
    ("numasched.report", "add_parser"),
    ("numasched.sim", "add_parser"),
    ("numasched.probe", "add_parser"),
    ("numasched.bench.cli", "add_parser"),
]


def _policies(args) -> int:
    from . import mappings

    for kind in mappings.KINDS:
        print(f"{kind}:")
        for name in mappings.available(kind):
            print(f"  {name:24s} {mappings.get(name).doc}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="numasched", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
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
