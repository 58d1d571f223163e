"""The GEMM chooser's split-K pricing A/B on one GPU: ``bench gemm_inference`` with every machine's
split-K merge constants as given (default: partials at 1x their L2 bytes and a 2 us sync, the
H100's before this session's refit), so a run beside the defaults in the same call compares the
two models' picks.
Run: python3 scripts/gemm_model_ab.py --partial-cost 1.0 --sync-us 2 -- [bench gemm_inference args]"""
import argparse
import dataclasses
import sys


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--partial-cost", type=float, default=1.0)
    ap.add_argument("--sync-us", type=float, default=2.0)
    args, rest = ap.parse_known_args()
    from numasched import gemm_schedule as GS

    for key, m in list(GS._KNOWN.items()):
        GS._KNOWN[key] = dataclasses.replace(m, reduce_sync_s=args.sync_us * 1e-6,
                                             splitk_partial_cost=args.partial_cost)
    GS._machine_of_index.cache_clear()
    from numasched.bench.gemm_inference import main as bench

    return bench([a for a in rest if a != "--"])


if __name__ == "__main__":
    sys.exit(main())
