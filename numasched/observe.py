"""Launch observers: one hook that sees every kernel launch and every fallback.

    >>> with numasched.observe.record(poison=True) as log:
    ...     out = numasched.flash_decode(q, k, v)
    >>> log.ops()            # ['flash_decode']
    >>> log.count("flash_decode")

An observer is a callable taking a :class:`LaunchEvent`; it runs on the host just *before* the
launch, so it may fill the outputs (``poison=True`` fills floating outputs with NaN: an element
the kernel fails to write then shows). Fallbacks to torch report ``kernel="torch"``. With no
observer registered a launch pays one list check.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, List, Optional

import torch

__all__ = ["LaunchEvent", "add", "remove", "record", "LaunchLog"]


@dataclass(frozen=True)
class LaunchEvent:
    """One launch.

    Attributes:
        op: the public operation ("flash_decode", "attention", "matmul", "all_gather_matmul", ...).
        kernel: the kernel's name, "torch" for a fallback to torch, or the part of an op
            ("flash_decode.combine").
        grid: programs launched (empty for a fallback).
        outputs: the tensors this launch writes.
        plan: the plan that launched (None for a fallback).
        reason: why a fallback ran (empty for kernel launches).
    """

    op: str
    kernel: str
    grid: tuple = ()
    outputs: tuple = ()
    plan: object = None
    reason: str = ""


OBSERVERS: List[Callable[[LaunchEvent], None]] = []


def add(fn: Callable[[LaunchEvent], None]) -> Callable[[LaunchEvent], None]:
    """Call ``fn(event)`` before every launch from now on; returns ``fn`` (pass it to :func:`remove`)."""
    if not callable(fn):
        raise TypeError(f"an observer must be callable, got {type(fn).__name__}")
    OBSERVERS.append(fn)
    return fn


def remove(fn) -> None:
    """Stop calling ``fn`` (no error if it was not registered)."""
    try:
        OBSERVERS.remove(fn)
    except ValueError:
        pass


def notify(op: str, kernel: str, grid=(), outputs=(), plan=None, reason: str = "") -> None:
    """Tell every observer (callers check ``OBSERVERS`` first, so an idle hook costs nothing)."""
    event = LaunchEvent(op, kernel, tuple(grid), tuple(o for o in outputs if o is not None), plan, reason)
    for fn in list(OBSERVERS):
        fn(event)


class LaunchLog(list):
    """The events seen by :func:`record`."""

    def ops(self) -> list:
        return [e.op for e in self]

    def kernels(self) -> list:
        return [e.kernel for e in self]

    def count(self, op: Optional[str] = None, *, kernel: Optional[str] = None) -> int:  # type: ignore[override]
        return sum(1 for e in self if (op is None or e.op == op) and (kernel is None or e.kernel == kernel))

    def fallbacks(self) -> list:
        return [e for e in self if e.kernel == "torch"]


class record:
    """Context manager recording every launch into a :class:`LaunchLog`.

    ``poison=True`` fills each launch's floating-point outputs with NaN first (and integer
    outputs with -7), so an output element the kernel does not write is caught by the caller's
    comparison."""

    def __init__(self, *, poison: bool = False):
        self.poison = poison
        self.log = LaunchLog()

    def _observe(self, event: LaunchEvent) -> None:
        if self.poison:
            for t in event.outputs:
                if t.is_floating_point():
                    t.fill_(float("nan"))
                elif t.dtype is not torch.bool:
                    t.fill_(-7)
        self.log.append(event)

    def __enter__(self) -> LaunchLog:
        add(self._observe)
        return self.log

    def __exit__(self, *exc):
        remove(self._observe)
        return False
