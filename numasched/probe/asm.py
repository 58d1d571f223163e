"""The probe kernels compiled offline (no GPU): their PTX / AMDGCN, to inspect the order of clock
reads and loads, and for CPU tests. Uses :mod:`numasched.portability`."""
from __future__ import annotations

from typing import Optional

from .measurement import ProbeUnavailable

__all__ = ["kernel_asm"]


def kernel_asm(arch: str = "sm_90", kernel: Optional[str] = None) -> dict:
    """Compile a probe kernel for ``arch`` ("sm_90", "gfx942", "gfx950", ...) and return its asm stages.

    ``kernel``: "l2_latency" (default on NVIDIA; on AMD its AMD inline assembly) or "xcc_id"
    (default on AMD; AMD only). Needs TRITON_INTERPRET unset when the kernels were defined
    (raises :class:`ProbeUnavailable` otherwise).
    """
    from numasched import portability

    target = portability.parse_target(arch)  # ValueError for a malformed arch
    amd = target.backend == "hip"
    kernel = kernel or ("xcc_id" if amd else "l2_latency")
    if kernel == "xcc_id" and not amd:
        raise ValueError("the xcc_id kernel is AMD only (s_getreg_b32 HW_REG_XCC_ID)")
    if kernel not in ("l2_latency", "xcc_id"):
        raise ValueError(f"kernel must be 'l2_latency' or 'xcc_id', got {kernel!r}")
    fn, values, warps, stages = portability.find("probe", kernel).build("amd" if amd else "nvidia")
    try:
        rep = portability.compile_kernel(fn, values, arch, num_warps=warps, num_stages=stages, keep_asm=True)
    except portability.Interpreted as e:
        raise ProbeUnavailable(f"kernel_asm: TRITON_INTERPRET=1 was set when the probe kernels were defined; "
                               f"{e}") from e
    return rep["asm"]
