"""numasched.sim: an L2 simulator for chiplet GPUs (MI300X-class), at tile granularity.

    >>> from numasched import sim
    >>> m = sim.AttentionModel(1, 128, 128, 32768, 32768, 128, block_m=128, block_n=64)
    >>> r = sim.simulate("mi300x", m, "swizzled_head_first")
    >>> r.l2_hit_rate, r.hbm_bytes, r.time_s

See ``core.py`` for the execution model, ``units.py`` for when the tile-level result equals the
line-level one (always, by the choice of unit), ``lru.py`` for the vectorised LRU, and
``bruteforce.py`` for the line-by-line reference. ``numasched simulate --help`` is the CLI.
"""
from .core import PEAK_FLOPS, SimResult, schedule, simulate  # noqa: F401
from .models import AttentionModel, DecodeModel, GemmModel, KernelModel  # noqa: F401
from .ragged import RaggedDecodeModel, lengths_uniform  # noqa: F401
from .streamk import StreamKGemmModel  # noqa: F401

__all__ = ["simulate", "SimResult", "AttentionModel", "DecodeModel", "GemmModel", "KernelModel",
           "RaggedDecodeModel", "StreamKGemmModel", "lengths_uniform", "report", "add_parser", "PEAK_FLOPS", "schedule"]


def add_parser(subparsers):
    from .cli import add_parser as _add

    return _add(subparsers)


def report(quick: bool = True) -> str:
    from .report import report as _report

    return _report(quick)
