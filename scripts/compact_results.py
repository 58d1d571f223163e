"""Rewrite the PNG plots under bench/results (or the folders given) with a palette of at most
256 colours (bench.common.compact_png): the committed results must stay small enough to travel
with the working tree to a GPU machine (64 MiB a call, the FlashInfer wheels included).

    python scripts/compact_results.py [FOLDER ...]
"""
from __future__ import annotations

import argparse
import os
from pathlib import Path

from numasched.bench.common import compact_png


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folders", nargs="*", default=["bench/results"], help="folders to walk (default bench/results)")
    args = ap.parse_args()
    before = after = n = 0
    for folder in args.folders:
        if not Path(folder).is_dir():
            ap.error(f"folders: {folder!r} is not a folder")
        for path in sorted(Path(folder).rglob("*.png")):
            size = os.path.getsize(path)
            if compact_png(path):
                n += 1
                before += size
                after += os.path.getsize(path)
    print(f"{n} PNGs rewritten: {before / 2**20:.1f} -> {after / 2**20:.1f} MiB")


if __name__ == "__main__":
    main()
