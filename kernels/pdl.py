"""Programmatic dependent launch (PDL, NVIDIA sm_90+): a kernel's launch overlaps its predecessor.

In a decode step every kernel is short (a few microseconds), so the gap between two dependent
kernels (the launch of the next one after the previous one has drained) is a large part of the
step. With PDL a kernel launched with ``launch_pdl=True`` may start while the kernel before it in
the stream is still running; it must then wait (``griddepcontrol.wait``) before it touches memory
that kernel writes or reads. Every kernel here that opts in takes a ``PDL`` constexpr and calls
:func:`pdl_enter` first: it lets the next kernel launch as soon as every program of this one has
started (``griddepcontrol.launch_dependents``), then waits for the previous kernel to complete
and its writes to be visible. Both instructions are no-ops for a kernel launched without the
attribute.

When the next kernel may launch (the ``PDL`` value, ``options.pdl_trigger``):
1 "early": at the start of every program. The next kernel's programs then become resident, and
wait, wherever this kernel leaves room: on a GPU this kernel does not fill, they take the free SM
slots of its last wave, which is what a chain of small dependent kernels wants (0.65 against 1.16
us per boundary, scripts/pdl_probe.py), but two back-to-back GEMMs lost with it (their programs
were placed, and piled up, before this one's last wave drained).
3 "late": a kernel that has a late point (:func:`pdl_late`, after its main loop: the tiled and
split-K GEMMs once a program's K loop is done, before its epilogue; the persistent GEMM and
stream-K once a program's last tile or piece is done) triggers there, so the next kernel
launches during the epilogues; a kernel without one triggers early.
2 "none": the next kernel launches when this one completes (its launch is still prepared).
Measured (bench/results/README.md, eighth session): decode-size GEMMs back to back ran at 1.006 /
0.939 / 0.999x cuBLAS with late / early / none.

The host side (numasched._launch.Launch) sets ``PDL`` and ``launch_pdl`` together, on NVIDIA
sm_90+ with ``options.pdl`` (measured: scripts/pdl_probe.py).

A kernel may do index arithmetic and :func:`prefetch_l2` of data no earlier kernel writes (its
weights) between :func:`pdl_trigger` and :func:`pdl_enter`; nothing else may come before the wait
(tests/test_launch.py checks every kernel's statements before it).
"""
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@triton.jit
def pdl_trigger(PDL: tl.constexpr):
    """Let the next kernel launch now (PDL == 1; a later call has no further effect)."""
    if PDL == 1:
        gdc_launch_dependents()


@triton.jit
def pdl_enter(PDL: tl.constexpr):
    # PDL: 0 off; 1 let the next kernel launch now, then wait; 2 wait only (the next kernel
    # launches when this one completes: no early start that could take this one's SM slots);
    # 3 wait only here, the kernel triggers at its late point (pdl_late)
    if PDL:
        pdl_trigger(PDL)
        gdc_wait()


@triton.jit
def pdl_late(PDL: tl.constexpr):
    """A kernel's late trigger point (PDL == 3): after its main loop, before its epilogue."""
    if PDL == 3:
        gdc_launch_dependents()


# Kernels that call pdl_late (the host gives them PDL = 3 under options.pdl_trigger == "late";
# the others then trigger early): their Python functions, registered by late_point below each
# such kernel's definition.
_LATE_POINT: set = set()


def _python_function(fn):
    while hasattr(fn, "fn"):   # an autotuner around a JITFunction around the Python function
        fn = fn.fn
    return fn


def late_point(fn):
    """Mark ``fn`` (a @triton.jit kernel) as having a :func:`pdl_late` call; returns ``fn``."""
    _LATE_POINT.add(_python_function(fn))
    return fn


def has_late_point(fn) -> bool:
    """Whether ``fn`` (a @triton.jit kernel or an autotuner around one) calls pdl_late."""
    return _python_function(fn) in _LATE_POINT


# options.pdl_trigger -> the PDL constexpr of a kernel with / without a late point
TRIGGER_MODES = ("early", "late", "none")


def pdl_value(trigger: str, late: bool) -> int:
    return {"early": 1, "none": 2, "late": 3 if late else 1}[trigger]


@triton.jit
def prefetch_l2(ptrs, nbytes, mask):
    """Ask ``nbytes`` bytes from each address where ``mask`` holds into L2 (NVIDIA sm_90
    ``cp.async.bulk.prefetch.L2``: one instruction per contiguous run, carried out by the TMA
    unit; nothing is returned and nothing waits), so it may run before :func:`pdl_enter`'s wait
    on data the previous kernel does not write (weights). Addresses 16-byte aligned, ``nbytes`` a
    multiple of 16 (the host checks). Not for the interpreter (inline PTX)."""
    tl.inline_asm_elementwise(
        "{ .reg .pred pf; setp.ne.s32 pf, $3, 0; @pf cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
        "=r,l,r,r", [ptrs, nbytes, mask.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)
