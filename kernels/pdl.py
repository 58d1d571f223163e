"""Programmatic dependent launch (PDL, NVIDIA sm_90+): a kernel's launch overlaps its predecessor.

In a decode step every kernel is short (a few microseconds), so the gap between two dependent
kernels (the launch of the next one after the previous one has drained) is a large part of the
step. With PDL a kernel launched with ``launch_pdl=True`` may start while the kernel before it in
the stream is still running; it must then wait (``griddepcontrol.wait``) before it touches memory
that kernel writes or reads. Every kernel here that opts in takes a ``PDL`` constexpr and calls
:func:`pdl_enter` first: it lets the next kernel launch as soon as every program of this one has
started (``griddepcontrol.launch_dependents``), then waits for the previous kernel to complete
and its writes to be visible. Both instructions are no-ops for a kernel launched without the
attribute. The host side (numasched._launch.Launch) sets ``PDL`` and ``launch_pdl`` together,
on NVIDIA sm_90+ with ``options.pdl`` (measured: scripts/pdl_probe.py).

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
    # launches when this one completes: no early start that could take this one's SM slots)
    if PDL:
        pdl_trigger(PDL)
        gdc_wait()


@triton.jit
def prefetch_l2(ptrs, mask):
    """An L2 prefetch hint for each address where ``mask`` holds (NVIDIA ``prefetch.global.L2``):
    nothing is returned and nothing waits, so it may run before :func:`pdl_enter`'s wait on data
    the previous kernel does not write (weights). Not for the interpreter (inline PTX)."""
    tl.inline_asm_elementwise(
        "{ .reg .pred pf; setp.ne.s32 pf, $2, 0; @pf prefetch.global.L2 [$1]; mov.u32 $0, 0; }",
        "=r,l,r", [ptrs, mask.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)
