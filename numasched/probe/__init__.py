"""``numasched probe``: measure the locality structure of the GPU at hand.

NVIDIA (tested design; see the report of the run for readings)
---------------------------------------------------------------
Question: does a GPU's L2 have partitions that are near to some SMs and far from others, and if
so, can a program choose a line's home partition by its address (so that placing a work item on
the right SMs makes its accesses near)?

Method, one kernel launch for every SM at once:

1. Launch ``programs_per_sm * num_sms`` one-warp programs. Each reads its SM id (``%smid``).
2. For each of N random 128-byte lines of a zeroed 24 MB buffer, the program does one warm-up load
   (the line is then in L2), then ``iters`` *dependent* loads ``v = load(p + v)`` that bypass L1
   (``ld.global.cg``): each load must wait for the previous one, so the time between two
   ``%clock64`` reads divided by ``iters`` is the L2 hit latency of that line seen from that SM.
3. The host keeps, per SM and line, the fastest program on that SM (least disturbed).

Analysis (pure NumPy, tested on CPU with planted structure): cluster SMs by their latency
profile over lines (:func:`cluster_sms`), find each line's near partition
(:func:`line_partitions`), test whether single address bits or pairs of bits (7..24) predict the
near partition (:func:`address_bit_test`), and summarise the program-id -> SM order of the first
wave (:func:`dispatch_summary`).

The kernel cannot run in Triton's interpreter (inline assembly has no interpreter path): without
a GPU the command says so and exits; ``--from-raw FILE.npz`` re-analyses a saved measurement.

AMD (UNTESTED ON HARDWARE)
--------------------------
Reads each workgroup's XCC id with ``s_getreg_b32 hwreg(HW_REG_XCC_ID, 0, 4)`` (register id 20,
bits 3:0 on gfx940/941/942, per the LLVM AMDGPU hwreg tables; it assembles for gfx942 with the
Triton 3.6 toolchain) and the XCC count from ``hipDeviceGetAttribute(..., 10018)``
(hipDeviceAttributeNumberOfXccs, HIP >= 7), then checks domain(pid) = (pid + offset) mod n.
No AMD GPU was available to this project: this path has never run on hardware.

Layout
------
* :mod:`numasched.kernels.probe` -- the device code (inline PTX and its AMD counterparts);
* :mod:`.measurement` -- runs the kernels on a GPU (:func:`measure`, :func:`probe`);
* :mod:`.analysis` -- pure NumPy, tested on CPU (:func:`analyze`, :func:`cluster_sms`, ...);
* :mod:`.files` -- result JSON and raw ``.npz`` (:func:`save`, :func:`load_raw`, :func:`default_path`);
* :mod:`.bandwidth` -- streaming-read bandwidth (:func:`stream_read_bw`);
* :mod:`.asm` -- the kernels compiled offline, no GPU (:func:`kernel_asm`);
* :mod:`.cli` -- ``numasched probe`` (:func:`add_parser`).
"""
from .analysis import (PAGE_SHIFT, address_bit_test, analyze, cluster_sms, dispatch_summary,  # noqa: F401
                       line_partitions, round_robin_fit, sm_latency_matrix, summary)
from .asm import kernel_asm  # noqa: F401
from .bandwidth import stream_read_bw  # noqa: F401
from .cli import add_parser  # noqa: F401
from .files import default_path, load_raw, save  # noqa: F401
from .measurement import BUFFER_BYTES, DEFAULTS, LINE, QUICK, ProbeUnavailable, measure, probe  # noqa: F401

__all__ = [
    "ProbeUnavailable", "probe", "measure", "analyze", "save", "load_raw", "default_path", "summary",
    "sm_latency_matrix", "cluster_sms", "line_partitions", "address_bit_test", "round_robin_fit",
    "dispatch_summary", "kernel_asm", "add_parser", "stream_read_bw",
]
