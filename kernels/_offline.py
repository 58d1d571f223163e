"""Compile a Triton kernel for an NVIDIA target without a GPU and report what the compiler made of it.

Triton ships ptxas, so a CPU machine can check shared memory, wgmma/TMA use, registers and spills
of the GPU configs. Needs a process without TRITON_INTERPRET=1 (Triton picks the interpreter when
kernels are defined).
"""
from __future__ import annotations

import os
import re
import subprocess
import tempfile


def compile_and_report(fn, signature: dict, constants: dict, attrs: dict, *, num_warps: int, num_stages: int,
                       capability: int = 90, ptxas_timeout: int = 300) -> dict:
    """Compile ``fn`` (a JITFunction) and return shared bytes, wgmma/TMA use, loop count, registers, spills."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    if type(fn).__name__ != "JITFunction":
        raise RuntimeError("compile reports need a process without TRITON_INTERPRET=1")
    k = triton.compile(ASTSource(fn, signature, constants, attrs), target=GPUTarget("cuda", capability, 32),
                       options=dict(num_warps=num_warps, num_stages=num_stages))
    ttgir = k.asm["ttgir"]
    out = dict(shared_bytes=k.metadata.shared, wgmma="ttng.warp_group_dot" in ttgir,
               tma_load="async_tma_copy_global_to_local" in ttgir, loops=ttgir.count("scf.for "),
               registers=None, spill_bytes=None)
    try:  # registers and spills: ptxas -v on the PTX
        from triton.backends.nvidia.compiler import get_ptxas

        with tempfile.TemporaryDirectory() as d:
            ptx = os.path.join(d, "k.ptx")
            with open(ptx, "w") as f:
                f.write(k.asm["ptx"])
            arch = f"sm_{capability}a" if capability == 90 else f"sm_{capability}"
            r = subprocess.run([get_ptxas(capability).path, f"-arch={arch}", "-v", ptx, "-o",
                                os.path.join(d, "k.cubin")], capture_output=True, text=True, timeout=ptxas_timeout)
        text = r.stdout + r.stderr
        m = re.search(r"Used (\d+) registers", text)
        sp = re.search(r"(\d+) bytes spill stores", text)
        out["registers"] = int(m.group(1)) if m else None
        out["spill_bytes"] = int(sp.group(1)) if sp else None
    except Exception:  # pragma: no cover - no ptxas: the IR facts above still stand
        pass
    return out
