"""Offline compiles of every kernel for NVIDIA and AMD targets, on a CPU (no GPU needed).

Triton 3.6 compiles for ``GPUTarget("cuda", 90, 32)`` (it ships ptxas) and for
``GPUTarget("hip", "gfx942" | "gfx950", 64)`` (it ships the AMDGPU LLVM backend and lld) without a
device. :func:`compile_variant` compiles one named, representative variant of a kernel for one
target and reports what the compiler made of it:

* registers: NVIDIA ``ptxas -v`` (registers per thread, spill-store bytes, stack frame); AMD the
  kernel descriptor in the ``amdgcn`` text (``.vgpr_count``, which includes the AGPRs of the
  unified register file on CDNA3/4, ``.agpr_count``, ``.sgpr_count``, ``.vgpr_spill_count``,
  ``.sgpr_spill_count``, ``.private_segment_fixed_size`` = scratch bytes per lane, occupancy);
* shared memory (NVIDIA) / LDS (AMD) bytes: ``metadata.shared``;
* which matrix instructions (wgmma, mma.sync, v_mfma) and whether TMA copies were used.

:data:`VARIANTS` holds the variants per kernel family (flash decode, combine, prefill attention,
GEMM, the distributed kernels, the probe kernels); each uses ``policy.constexpr(1)`` for
``MAPPING`` and the argument values a launch of the host code passes (pointers 16-byte aligned,
ints divisible by 16 marked so and ints equal to 1 made constant, as the JIT specialises them).
NVIDIA-only paths are *switched off* on AMD with the reason stated (``Variant.off``), or replaced
per target (``Variant.per_target``, e.g. the distributed waits bounded by a poll count instead of
``%globaltimer`` on AMD, the probe's AMD inline assembly).

Compiling needs a process in which the kernels were defined without ``TRITON_INTERPRET=1``
(Triton picks the interpreter when a kernel is defined); ``python -m numasched.portability``
re-runs itself without the variable when it is set.

    python -m numasched.portability [--targets sm90,gfx942,gfx950] [--kernels flash_decode,gemm] [--out FILE.md]
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, Iterable, List, Optional, Sequence

__all__ = ["TARGETS", "SHARED_LIMITS", "Variant", "VARIANTS", "Interpreted", "parse_target", "shared_limit",
           "variants", "find", "compile_variant", "compile_kernel", "attention_report", "gemm_report", "report",
           "findings", "host_precision_check", "markdown", "main"]

TARGETS = ("sm90", "gfx942", "gfx950")


# ------------------------------------------------------------------------------------ targets
def parse_target(target: str):
    """"sm90" / "sm_90" -> GPUTarget("cuda", 90, 32); "gfx942" -> GPUTarget("hip", "gfx942", 64)."""
    from triton.backends.compiler import GPUTarget

    t = str(target).strip().lower()
    m = re.fullmatch(r"sm_?(\d+)a?", t)
    if m:
        return GPUTarget("cuda", int(m.group(1)), 32)
    if re.fullmatch(r"gfx[0-9a-f]+", t):
        return GPUTarget("hip", t, 64)
    raise ValueError(f"target must look like 'sm90' or 'gfx942', got {target!r}")


# Shared memory (NVIDIA, opt-in per block) / LDS (AMD, per workgroup) a launch may use: a config
# above it compiles but fails at launch ("out of resources").
SHARED_LIMITS = {"sm80": 166912, "sm86": 101376, "sm89": 101376, "sm90": 232448, "sm100": 232448,
                 "gfx90a": 65536, "gfx942": 65536, "gfx950": 163840}


def shared_limit(target: str) -> Optional[int]:
    """Bytes of shared memory / LDS one block may use on ``target`` (None: not known here)."""
    t = parse_target(target)
    return SHARED_LIMITS.get(f"sm{t.arch}" if t.backend == "cuda" else t.arch)


def _vendor(target: str) -> str:
    return "amd" if parse_target(target).backend == "hip" else "nvidia"


# ------------------------------------------------------------------------------------ compiling
class Interpreted(RuntimeError):
    """The kernel is an interpreter object (TRITON_INTERPRET=1 was set when it was defined)."""


def _signature(fn, values: dict):
    """(signature, constexprs, attrs) for ``fn`` from one value per argument, as the JIT would see a launch.

    A value is a type string for a runtime argument ("*bf16", "i32", "fp32", "tensordesc<...>"), a
    Python int/float for a runtime scalar (ints equal to 1 become constants, ints divisible by 16
    are marked so), or anything for a constexpr parameter (and None for an unused runtime argument,
    e.g. an absent descriptor). Pointers are marked 16-byte aligned (what torch allocations give).
    """
    if type(fn).__name__ not in ("JITFunction", "GluonJITFunction"):
        raise Interpreted("offline compiles need a process without TRITON_INTERPRET=1 (Triton picks the "
                          "interpreter when a kernel is defined): run it in a subprocess without the variable")
    missing = [n for n in fn.arg_names if n not in values]
    extra = [n for n in values if n not in fn.arg_names]
    if missing or extra:
        raise ValueError(f"{fn.__name__}: missing values for {missing}, unknown arguments {extra}")
    constexpr_params = {p.name for p in fn.params if p.is_constexpr}
    unspecialised = {p.name for p in fn.params if getattr(p, "do_not_specialize", False)}   # the JIT's do_not_specialize
    sig, const, attrs = {}, {}, {}
    for i, n in enumerate(fn.arg_names):
        v = values[n]
        if n in constexpr_params or v is None:
            sig[n], const[(i,)] = "constexpr", v
        elif isinstance(v, str):
            sig[n] = v
            if v.startswith("*"):
                attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(v, bool):
            raise ValueError(f"{fn.__name__}.{n}: a bool for a runtime argument; give 'i1' or make it constexpr")
        elif isinstance(v, int) and n in unspecialised:
            sig[n] = "i32" if -2 ** 31 <= v < 2 ** 31 else "i64"
        elif isinstance(v, int):
            if v == 1:
                sig[n], const[(i,)] = "constexpr", 1
            else:
                sig[n] = "i32" if -2**31 <= v < 2**31 else "i64"
                if v % 16 == 0:
                    attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(v, float):
            sig[n] = "fp32"
        else:
            raise ValueError(f"{fn.__name__}.{n}: cannot type a runtime argument from {v!r}")
    return sig, const, attrs


def _ptxas(ptx: str, capability: int, timeout: int) -> dict:
    """Registers, spill-store bytes and stack frame from ``ptxas -v`` (None where ptxas is absent)."""
    out = dict(registers=None, spill_bytes=None, stack_bytes=None)
    try:
        from triton.backends.nvidia.compiler import get_ptxas

        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "k.ptx")
            with open(path, "w") as f:
                f.write(ptx)
            arch = f"sm_{capability}a" if capability >= 90 else f"sm_{capability}"
            r = subprocess.run([get_ptxas(capability).path, f"-arch={arch}", "-v", path, "-o",
                                os.path.join(d, "k.cubin")], capture_output=True, text=True, timeout=timeout)
        text = r.stdout + r.stderr
    except Exception:  # pragma: no cover - no ptxas: the IR facts still stand
        return out
    m = re.search(r"Used (\d+) registers", text)
    sp = re.search(r"(\d+) bytes spill stores", text)
    st = re.search(r"(\d+) bytes stack frame", text)
    out.update(registers=int(m.group(1)) if m else None, spill_bytes=int(sp.group(1)) if sp else None,
               stack_bytes=int(st.group(1)) if st else None)
    return out


def _amd_stats(gcn: str) -> dict:
    """Register, spill and scratch counts from the kernel descriptor/metadata in the amdgcn text."""
    def num(key):  # a key of the kernel's metadata (YAML: "  .key: N" or "  - .key: N")
        m = re.search(rf"^\s*(?:-\s*)?\.{key}:\s*(\d+)", gcn, re.M)
        return int(m.group(1)) if m else None

    def comment(key):  # the compiler's summary comments ("; NumVgprs: N")
        m = re.search(rf"^; {key}:\s*(\d+)", gcn, re.M)
        return int(m.group(1)) if m else None

    vs, ss = num("vgpr_spill_count"), num("sgpr_spill_count")
    return dict(
        registers=num("vgpr_count"),                  # arch VGPRs + AGPRs (the unified file of CDNA3/4)
        arch_vgprs=comment("NumVgprs"), agprs=num("agpr_count"), sgprs=num("sgpr_count"),
        vgpr_spills=vs, sgpr_spills=ss,
        spill_bytes=None if vs is None else 4 * vs,   # VGPR spills go to scratch: 4 bytes per lane each
        stack_bytes=num("private_segment_fixed_size"),  # scratch bytes per lane
        occupancy=comment("Occupancy"))


def compile_kernel(fn, values: dict, target: str = "sm90", *, num_warps: int = 4, num_stages: int = 3,
                   keep_asm: bool = False, ptxas_timeout: int = 300, maxnreg: Optional[int] = None) -> dict:
    """Compile ``fn`` (a JITFunction) with one value per argument (see :func:`_signature`) for
    ``target`` and report: shared_bytes (NVIDIA shared / AMD LDS), registers (NVIDIA per thread; AMD
    VGPRs per lane incl. AGPRs), arch_vgprs, agprs, sgprs, spill_bytes, stack_bytes (NVIDIA stack
    frame / AMD scratch per lane), occupancy (AMD waves per SIMD), mma ("wgmma", "mma", "mfma" or
    None), wgmma, tma_load, loops (scf.for in the TTGIR), compile_s. Raises on a compile error."""
    import triton
    from triton.compiler import ASTSource

    tgt = parse_target(target)
    if "PDL" in getattr(fn, "arg_names", ()) and "PDL" not in values:
        # as the host launches it: programmatic dependent launch on NVIDIA sm_90+ with the current
        # trigger mode (kernels/pdl.py, numasched._launch.Launch)
        from numasched import options as _options
        from numasched.kernels.pdl import has_late_point, pdl_value

        pdl = pdl_value(_options.current().pdl_trigger, has_late_point(fn)) if _options.current().pdl else 0
        values = dict(values, PDL=pdl if tgt.backend == "cuda" and int(tgt.arch) >= 90 else 0)
    # other defaulted constexprs (e.g. GLU, HAS_BIAS) as a launch that does not pass them
    values = {**{p.name: p.default for p in getattr(fn, "params", ()) if p.has_default}, **values}
    sig, const, attrs = _signature(fn, values)
    t0 = time.perf_counter()
    opts = dict(num_warps=num_warps, num_stages=num_stages)
    if values.get("PDL"):   # the kernel waits for its predecessor: launched with the attribute
        opts["launch_pdl"] = True
    if maxnreg is not None:  # NVIDIA's register cap per thread (a launch option, as the host passes it)
        opts["maxnreg"] = int(maxnreg)
    if type(fn).__name__ == "GluonJITFunction":   # Gluon (explicit layouts, NVIDIA only here)
        from triton.experimental.gluon._runtime import GluonASTSource as ASTSource
    k = triton.compile(ASTSource(fn, sig, const, attrs), target=tgt, options=opts)
    ttgir = k.asm.get("ttgir", "")
    out = dict(shared_bytes=int(k.metadata.shared), registers=None, arch_vgprs=None, agprs=None, sgprs=None,
               spill_bytes=None, vgpr_spills=None, sgpr_spills=None, stack_bytes=None, occupancy=None,
               wgmma="ttng.warp_group_dot" in ttgir, tma_load="async_tma_copy_global_to_local" in ttgir,
               loops=ttgir.count("scf.for "))
    if tgt.backend == "cuda":
        ptx = k.asm["ptx"]
        out.update(_ptxas(ptx, tgt.arch, ptxas_timeout))
        out["mma"] = "wgmma" if "wgmma.mma_async" in ptx else ("mma" if "mma.sync" in ptx else None)
        out["tma_load"] = out["tma_load"] or "cp.async.bulk.tensor" in ptx
    else:
        gcn = k.asm["amdgcn"]
        out.update(_amd_stats(gcn))
        out["mma"] = "mfma" if "v_mfma" in gcn else None
    out["compile_s"] = round(time.perf_counter() - t0, 2)
    if keep_asm:
        out["asm"] = dict(k.asm)
    return out


# ------------------------------------------------------------------------------------ variants
@dataclass(frozen=True)
class Variant:
    """One representative compile of a kernel.

    ``build(vendor)`` ("nvidia" or "amd") returns ``(fn, values, num_warps, num_stages)``, or
    with a fifth element, a dict of further compile options (``maxnreg``);
    ``off`` maps a vendor to the reason the variant is switched off there; ``note`` is shown in
    the table (what differs per target and why)."""

    kernel: str
    name: str
    build: Callable[[str], tuple]
    off: Dict[str, str] = field(default_factory=dict)
    note: str = ""

    @property
    def key(self) -> str:
        return f"{self.kernel}/{self.name}"


def _mapping(name: str):
    from numasched import mappings

    return mappings.get(name).constexpr(1)


_PTR = "*bf16"
_TMA_OFF = ("TMA tensor descriptors (cp.async.bulk.tensor) are NVIDIA sm_90+; on AMD the host plans the "
            "pointer path (caps.tma_supported is False on ROCm)")
_GLUON_OFF = ("the Gluon kernels (kernels/gemm_ws.py, dist_gemm_ar_ws.py, gemm_weight_first.py) are code for NVIDIA "
              "sm_90 (wgmma, TMA, mbarriers, setmaxnreg); AMD runs the Triton kernels")
_CLOCK_NOTE = ("WAIT_CLOCK: sm90 True (%globaltimer wait bound); AMD False: %globaltimer is NVIDIA PTX, the "
               "wait is bounded by a poll count (ctx.wait_clock is False on ROCm)")
_PREC_NOTE = ("bf16 dots with input precision None (the target's default), as the host passes for 16-bit "
              "inputs ('tf32', which gfx950 refuses, only for fp32 on NVIDIA)")


# ---- flash decode
def _decode(paged: bool, combine: int, stages=None, prefetch: int = 0, tma: bool = False, block_n: int = 64):
    def build(vendor):
        from numasched.kernels import flash_decode as K

        B, HK, G, D, L = 8, 8, 4, 128, 32768
        ps = 16 if paged else 0
        values = dict(Q=_PTR, K=_PTR, V=_PTR, SEQLENS="*i32", BLOCK_TABLE="*i32", O=_PTR, LSE="*fp32",
                      PO="*fp32", PL="*fp32", COUNTER="*i32", qk_scale=0.1275, B=B, HK=HK, S=4, seqlen_max=L,
                      num_pages=B * L // 16, stride_qb=HK * G * D, stride_qs=0, stride_qh=D,
                      stride_kb=(ps if paged else L) * HK * D, stride_kn=HK * D, stride_kh=D,
                      stride_vb=(ps if paged else L) * HK * D, stride_vn=HK * D, stride_vh=D,
                      stride_sb=1, stride_tb=L // 16, stride_tp=1, stride_ob=HK * G * D, stride_os=0, stride_oh=D,
                      stride_lb=HK * G, stride_ls=0, stride_lh=1, tune_key=4,
                      G=G, BLOCK_G=16, HEAD_DIM=D, BLOCK_D=D, PAGE_SIZE=ps, HAS_SEQLENS=True, COMBINE=combine,
                      INT64=False, INPUT_PRECISION=None, COMBINE_BLOCK_S=16, SQ=1, ROW_GROUPS=1, BLOCK_N=block_n,
                      MAPPING=_mapping("head_first"), PREFETCH_TOKENS=prefetch,
                      KD=f"tensordesc<bf16[1, {block_n}, 1, {D}]>" if tma else None,
                      VD=f"tensordesc<bf16[1, {block_n}, 1, {D}]>" if tma else None)
        cfg = K.DEFAULT_GPU_CONFIG[paged]
        return K._flash_decode_kernel, values, cfg["num_warps"], stages or cfg["num_stages"]
    return build


def _decode_worklist(paged: bool):
    def build(vendor):
        from numasched.kernels import flash_decode as K
        from numasched.kernels import flash_decode_worklist as KW

        # the split variants' shapes (batch 8, GQA 32/8, d128, 32k tokens), as plan_decode_worklist launches them
        B, HK, G, D, L = 8, 8, 4, 128, 32768
        ps = 16 if paged else 0
        values = dict(Q=_PTR, K=_PTR, V=_PTR, SEQLENS="*i32", BLOCK_TABLE="*i32", O=_PTR, LSE="*fp32",
                      PO="*fp32", PL="*fp32", COUNTER="*i32", WORK="*i32", PROG="*i32", qk_scale=0.1275, HK=HK,
                      seqlen_max=L, num_pages=B * L // 16, stride_qb=HK * G * D, stride_qh=D,
                      stride_kb=(ps if paged else L) * HK * D, stride_kn=HK * D, stride_kh=D,
                      stride_vb=(ps if paged else L) * HK * D, stride_vn=HK * D, stride_vh=D,
                      stride_sb=1, stride_tb=L // 16, stride_tp=1, stride_ob=HK * G * D, stride_oh=D,
                      stride_lb=HK * G, stride_lh=1, tune_key=4,
                      G=G, BLOCK_G=16, HEAD_DIM=D, BLOCK_D=D, PAGE_SIZE=ps, HAS_SEQLENS=True, INT64=False,
                      INPUT_PRECISION=None, COMBINE_BLOCK_S=16, WORK_STRIDE=KW.WORK_FIELDS, BLOCK_N=64)
        cfg = KW.with_registers(K.DEFAULT_GPU_CONFIG[paged], vendor == "amd")
        return (KW._flash_decode_worklist_kernel, values, cfg["num_warps"], cfg["num_stages"],
                {"maxnreg": cfg["maxnreg"]} if "maxnreg" in cfg else {})
    return build


def _combine(vendor):
    from numasched.kernels import flash_decode as K

    values = dict(PO="*fp32", PL="*fp32", O=_PTR, LSE="*fp32", H=32, S=4, stride_ob=32 * 128, stride_os=0,
                  stride_oh=128, stride_lb=32, stride_ls=0, stride_lh=1, SQ=1, HEAD_DIM=128, BLOCK_D=128, BLOCK_S=16)
    return K._combine_kernel, values, 4, 1


# ---- prefill attention
def _attention(causal: bool, tma: bool, dtype: str = "bf16", bm: int = 128, bn: int = 64, warps: int = 8,
               stages: int = 3, head_dim: int = 128, policy: str = "head_first", num_domains: int = 1):
    def build(vendor):
        from numasched import mappings
        from numasched.kernels import attention_fwd as K

        B, H, HK, L, D = 2, 32, 8, 4096, head_dim
        p = f"*{dtype}"
        values = dict(Q=p, K=p, V=p, O=p, LSE="*fp32",
                      stride_qb=H * L * D, stride_qh=L * D, stride_qm=D,
                      stride_kb=HK * L * D, stride_kh=L * D, stride_kn=D,
                      stride_vb=HK * L * D, stride_vh=L * D, stride_vn=D,
                      stride_ob=H * L * D, stride_oh=L * D, stride_om=D,
                      B=B, H=H, HK=HK, Lq=L, Lk=L, qk_scale=0.1275, causal_offset=0,
                      Q_BUCKET=L, K_BUCKET=L, TMA_OK=int(tma),
                      HEAD_DIM=D, CAUSAL=causal, LPT=causal,
                      DOT_PRECISION="ieee" if dtype == "fp32" else None,
                      MAPPING=mappings.get(policy).constexpr(num_domains), BLOCK_M=bm, BLOCK_N=bn,
                      BLOCK_D=K.block_d(D), USE_TMA=tma)
        return K.attn_fwd_kernel, values, warps, stages
    return build


# ---- GEMM
def _gemm(path: str, dtype: str, persistent: bool, cfg=None, a_trans=False, b_trans=False, c_tma=True,
          policy="grouped", num_domains=1, int64=False, precision="default", stages=None):
    def build(vendor):
        from numasched import mappings
        from numasched.kernels import gemm as K

        c = cfg or K.gpu_configs(path, persistent, dtype == "fp32")[0]
        kw = dict(c.kwargs)
        bm, bn, bk = kw["BLOCK_M"], kw["BLOCK_N"], kw["BLOCK_K"]
        tma = path == "tma"
        values = dict(M=8192, N=8192, K=8192, stride_am=8192, stride_ak=1, stride_bk=8192, stride_bn=1,
                      stride_cm=8192, stride_cn=1, c=f"*{dtype}", bias=None, res=None, stride_rm=0, stride_rn=0,
                      HAS_BIAS=False, HAS_RES=False)
        if tma:
            values["a"] = f"tensordesc<{dtype}[{bk}, {bm}]>" if a_trans else f"tensordesc<{dtype}[{bm}, {bk}]>"
            values["b"] = f"tensordesc<{dtype}[{bn}, {bk}]>" if b_trans else f"tensordesc<{dtype}[{bk}, {bn}]>"
        else:
            values["a"] = values["b"] = f"*{dtype}"
        ctma = c_tma and tma
        values["c_desc"] = (f"tensordesc<{dtype}[{bm}, {bn // 2 if kw['EPILOGUE_SUBTILE'] else bn}]>"
                            if ctma else None)
        prec = ("ieee" if dtype == "fp32" else None) if precision == "default" else precision
        values.update(kw, MAPPING=mappings.get(policy).constexpr(num_domains), USE_TMA=tma, A_TRANS=a_trans,
                      B_TRANS=b_trans, C_TMA=ctma, INPUT_PRECISION=prec, INT64=int64)
        return K.gemm_kernel, values, c.num_warps, stages or c.num_stages
    return build


def _gemm_streamk(tma: bool, bm: int = 128, bn: int = 256, stages: int = 4):
    def build(vendor):
        from numasched import mappings
        from numasched.kernels import gemm_streamk as K

        bk = 64
        values = dict(M=1024, N=5120, K=5120, stride_am=5120, stride_ak=1, stride_bk=1, stride_bn=5120,
                      stride_cm=5120, stride_cn=1, stride_rm=0, stride_rn=0, c="*bf16", bias=None, res=None,
                      ws="*fp32", counters="*i32", dp_tiles=132, iters_per_tile=80, iters_per_program=17,
                      MAPPING=mappings.get("grouped").constexpr(1), BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
                      FIX_N=min(bn, 128), HAS_BIAS=False, HAS_RES=False, INPUT_PRECISION=None, USE_TMA=tma,
                      A_TRANS=False, B_TRANS=tma)
        if tma:   # B is the (N, K) storage of an F.linear weight, read through its descriptor
            values["a"] = f"tensordesc<bf16[{bm}, {bk}]>"
            values["b"] = f"tensordesc<bf16[{bn}, {bk}]>"
        else:
            values["a"] = values["b"] = "*bf16"
        return K.gemm_streamk_kernel, values, 8, stages
    return build


def _gemm_glu_prefill(row_scale: bool):
    def build(vendor):
        from numasched import mappings
        from numasched.kernels import gemm_splitk as K

        # numasched.matmul_swiglu at prefill sizes (gemm_glu.GLU_BIG_SCHEDULE): Llama-3-8B's gate/up
        # at TP 2, 4096 x (2 x 7168) x 4096, a 128 x 128 gate tile and its up tile, unsplit;
        # row_scale: a norm-free prefill's factor per row (``bias``, fp32) on the accumulators
        bm, bn, bk = 128, 128, 64
        values = dict(c="*bf16", bias="*fp32" if row_scale else None, res=None, ws="*fp32", counters="*i32",
                      M=4096, N=7168, K=4096, stride_am=4096, stride_ak=1, stride_bk=1, stride_bn=4096,
                      stride_cm=7168, stride_cn=1, stride_rm=0, stride_rn=0, k_per_split=4096, whole_tiles=0, a_ptr=None,
                      MAPPING=mappings.get("grouped").constexpr(1), SPLIT_K=1, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
                      HAS_BIAS=False, HAS_RES=False, INPUT_PRECISION=None, USE_TMA=True, A_TRANS=False,
                      B_TRANS=True, GLU=True, ROW_SCALE=row_scale,
                      a=f"tensordesc<bf16[{bm}, {bk}]>", b=f"tensordesc<bf16[{bn}, {bk}]>")
        return K.gemm_splitk_kernel, values, 8, 3
    return build


def _glu_persistent(row_scale: bool, stages: int = 3):
    def build(vendor):
        from numasched import mappings
        from numasched.kernels import gemm_glu as K

        # numasched.matmul_swiglu at prefill sizes: the persistent kernel, Llama-3-8B's gate/up at
        # TP 2 (4096 x (2 x 7168) x 4096), 128 x 128 gate and up tiles, the weight's (2N, K) storage
        bm, bn, bk = 128, 128, 64
        values = dict(a_desc=f"tensordesc<bf16[{bm}, {bk}]>", b_desc=f"tensordesc<bf16[{bn}, {bk}]>",
                      c_desc=f"tensordesc<bf16[{bm}, {bn}]>", c="*bf16", scale="*fp32", M=4096, N=7168, K=4096,
                      stride_cm=7168, stride_cn=1, MAPPING=mappings.get("grouped").constexpr(1), BLOCK_M=bm,
                      BLOCK_N=bn, BLOCK_K=bk, B_TRANS=True, ROW_SCALE=row_scale, C_TMA=True)
        return K.glu_persistent_kernel, values, 8, stages
    return build


def _gemm_ws_streamk(b_kmajor: bool = True, merge: int = 0, split: int = 0, a_last=(0, 0), bias: bool = False,
                     residual: bool = False):
    def build(vendor):
        from numasched.gemm_ws import WsConfig, descriptor_type
        from numasched.kernels.gemm_ws import gemm_ws_streamk_kernel

        cfg = WsConfig()
        b_block = [cfg.block_n, cfg.block_k] if b_kmajor else [cfg.block_k, cfg.block_n]
        values = dict(a_desc=descriptor_type("bf16", [cfg.block_m, cfg.block_k]),
                      b_desc=descriptor_type("bf16", b_block),
                      c_desc=descriptor_type("bf16", [cfg.block_m // 2, cfg.block_n]),
                      a1_desc=descriptor_type("bf16", [a_last[0] or cfg.block_m, cfg.block_k]),
                      a2_desc=descriptor_type("bf16", [a_last[1] or a_last[0] or cfg.block_m, cfg.block_k]),
                      work="*fp32", tickets="*i32", c_ptr="*bf16", stride_cm=2560, status="*i32", bound=10**9,
                      M=512, N=2560, K=8192, nsplit=max(split, 1), bias="*bf16", res="*bf16", stride_rm=2560,
                      stride_rn=1, STAGES=cfg.stages, GROUP_M=cfg.group_m,
                      CONSUMER_REGS=cfg.consumer_regs, LOADER_REGS=cfg.loader_regs, MERGE=merge, SPLIT=split > 0,
                      A_LAST=a_last[0], A_LAST2=a_last[1], BIAS=bias, RESIDUAL=residual)
        return gemm_ws_streamk_kernel, values, 4, 1, dict(maxnreg=cfg.maxnreg)
    return build


def _gemm_ws(block_n: int = 256, stages: int = 3, b_kmajor: bool = True, glu: bool = False, row_scale=False,
             peer_push: int = 0, tile_n: int = 0, a_last=(0, 0), block_m: int = 128, swap: bool = False,
             b_last=(0, 0), bias: bool = False, residual: bool = False):
    def build(vendor):
        from numasched.gemm_ws import WsConfig, descriptor_type, wide_config

        from numasched.kernels.gemm_ws import gemm_ws_kernel

        cfg = (wide_config(tile_n, block_m=block_m, swap=swap) if tile_n
               else WsConfig(block_n=block_n, stages=stages, glu=glu))
        box = lambda n: [n, cfg.block_k] if b_kmajor else [cfg.block_k, n]  # noqa: E731
        c_box = lambda n: [n, 64] if swap else [64, n]  # noqa: E731
        b_block = box(cfg.block_n)
        n1 = cfg.block_n1 or cfg.block_n
        values = dict(a_desc=descriptor_type("bf16", [cfg.block_m, cfg.block_k]),
                      b_desc=descriptor_type("bf16", b_block),
                      c_desc=descriptor_type("bf16", c_box(cfg.block_n)),
                      peer_desc=descriptor_type("bf16", [64, 64 if peer_push == 2 else cfg.block_n]),
                      b1_desc=descriptor_type("bf16", box(n1)),
                      c1_desc=descriptor_type("bf16", c_box(n1)),
                      a1_desc=descriptor_type("bf16", [a_last[0] or cfg.block_m, cfg.block_k]),
                      a2_desc=descriptor_type("bf16", [a_last[1] or a_last[0] or cfg.block_m, cfg.block_k]),
                      b2_desc=descriptor_type("bf16", [b_last[0] or cfg.block_n, cfg.block_k]),
                      b3_desc=descriptor_type("bf16", [b_last[1] or b_last[0] or cfg.block_n, cfg.block_k]),
                      bx_desc=descriptor_type("bf16", box(cfg.block_n2 or n1)),
                      cx_desc=descriptor_type("bf16", c_box(cfg.block_n2 or n1)),
                      scale="*fp32", M=8192, N=8192, K=8192, bias="*bf16", res="*bf16", stride_rm=8192, stride_rn=1,
                      r_desc=descriptor_type("bf16", c_box(cfg.block_n)), r1_desc=descriptor_type("bf16", c_box(n1)),
                      rx_desc=descriptor_type("bf16", c_box(cfg.block_n2 or n1)),
                      STAGES=cfg.stages, GROUP_M=cfg.group_m, BIAS=bias, RESIDUAL=int(residual),
                      GLU=glu, ROW_SCALE=row_scale, PEER_PUSH=int(peer_push), N1=cfg.block_n1, B_KMAJOR=b_kmajor,
                      CONSUMER_REGS=cfg.consumer_regs, LOADER_REGS=cfg.loader_regs, A_LAST=a_last[0],
                      A_LAST2=a_last[1], SWAP_C=swap, B_LAST0=b_last[0], B_LAST1=b_last[1], N2=cfg.block_n2)
        return gemm_ws_kernel, values, 4, 1, dict(maxnreg=cfg.maxnreg)
    return build


def _weight_first(rows: int = 16, glu: bool = False, splits: int = 2, pdl: int = 1, early=None, world: int = 1,
                  reduce: bool = False, nss: int = 0):
    def build(vendor):
        from numasched.gemm_weight_first import BAND, BLOCK_K, config
        from numasched.gemm_ws import descriptor_type
        from numasched.kernels.gemm_weight_first import weight_first_kernel

        cfg = config(rows, 4096, 4096, glu=glu, splits=splits)
        values = dict(w_desc=descriptor_type("bf16", [BAND, BLOCK_K]),
                      x_desc=descriptor_type("bf16", [cfg.block_t, BLOCK_K]), y="*bf16", ws="*fp32",
                      counters="*i32", M=rows, N=4096, K=4096, stride_ym=4096, stride_yn=1,
                      k_per_split=cfg.k_per_split, recv="*bf16", pcount="*i64", epoch="*i64", heap_bases="*i64",
                      rank=1, res="*bf16", ss="*fp32", xcount="*i32", status="*i32", bound=10**7, xsq="*fp32",
                      nss=nss or 2, eps=1e-5, SPLITS=cfg.splits, STAGES=cfg.stages, GLU=glu, PDL=pdl,
                      EARLY=cfg.stages if early is None else early, PUSH=world > 1 or reduce, WORLD=world,
                      REDUCE=reduce, NSS=nss)
        return weight_first_kernel, values, 4, 1
    return build


def _gemm_all_reduce_ws(residual: bool = True, direct: bool = True, rs: bool = False, rs_pairs: bool = False,
                        rs_early: bool = False, group: int = 8, block_n: int = 256):
    def build(vendor):
        from numasched.gemm_ws import descriptor_type, dist_config
        from numasched.kernels.dist_gemm_ar_ws import matmul_all_reduce_ws_kernel

        cfg = dist_config(block_n)
        half = [cfg.block_m // 2, cfg.block_n]
        chunk = [cfg.block_m // 2, 64]
        values = dict(a_desc=descriptor_type("bf16", [cfg.block_m, cfg.block_k]),
                      b_desc=descriptor_type("bf16", [cfg.block_n, cfg.block_k]),
                      out_desc=descriptor_type("bf16", half), out_peer_desc=descriptor_type("bf16", chunk),
                      recv_desc=descriptor_type("bf16", half), recv_peer_desc=descriptor_type("bf16", chunk),
                      flags="*i64", peer_flags="*i64", status="*i32", epoch="*i64", counters="*i32",
                      bound=10**7, rank=3, M=4096, N=4096, K=7168, STAGES=cfg.stages, RESIDUAL=residual,
                      DIRECT=direct, CONSUMER_REGS=cfg.consumer_regs, LOADER_REGS=cfg.loader_regs, RS=rs,
                      RS_PAIRS=rs_pairs, RS_EARLY=rs_early, GROUP=group)
        return matmul_all_reduce_ws_kernel, values, 4, 1, dict(maxnreg=cfg.maxnreg)
    return build


def _copy_rows(k: int, kp: int, vec: int, pad: int = 0):
    """Rows of ``k`` bf16 into rows of ``kp`` (numasched.gemm: whole 128-byte lines for
    options.gemm_align_a; with ``pad``, zeros past k for options.gemm_pad_k)."""
    def build(vendor):
        from numasched.kernels import copy_rows as CR

        values = dict(src="*bf16", dst="*bf16", K=k, stride_s=k, stride_d=kp, BLOCK_K=CR.block_k(kp if pad else k),
                      VEC=vec)
        if pad:
            values["PAD"] = 1
        return CR.copy_rows_kernel, values, 4, 1
    return build


def _gemm_splitk_medium(tail: bool):
    def build(vendor):
        from numasched import mappings
        from numasched.kernels import gemm_splitk as K

        # a medium-M GEMM (1024 x 2560 x 8192) in TMA-fed 128 x 128 tiles: 160 tiles, one wave of
        # 132 whole and, with TAIL, the 28 left over in 4 K parts
        bm, bn, bk = 128, 128, 64
        values = dict(c="*bf16", bias=None, res=None, ws="*fp32", counters="*i32",
                      M=1024, N=2560, K=8192, stride_am=8192, stride_ak=1, stride_bk=1, stride_bn=8192,
                      stride_cm=2560, stride_cn=1, stride_rm=0, stride_rn=0, k_per_split=2048,
                      whole_tiles=132 if tail else 0, a_ptr=None,
                      MAPPING=mappings.get("grouped").constexpr(1), SPLIT_K=4 if tail else 1, BLOCK_M=bm,
                      BLOCK_N=bn, BLOCK_K=bk, HAS_BIAS=False, HAS_RES=False, INPUT_PRECISION=None, USE_TMA=True,
                      A_TRANS=False, B_TRANS=True, TAIL=tail,
                      a=f"tensordesc<bf16[{bm}, {bk}]>", b=f"tensordesc<bf16[{bn}, {bk}]>")
        return K.gemm_splitk_kernel, values, 8, 6
    return build


def _gemm_splitk(prefetch: bool, glu: bool = False, kvec: int = 0):
    def build(vendor):
        from numasched import caps, mappings
        from numasched.kernels import gemm_splitk as K

        # a decode-size GEMM as numasched.matmul(x, W.T) plans it at M = 1 (16x64x128, 4 warps,
        # 6 stages, split 4; B is the (N, K) weight read through pointers)
        values = dict(a="*bf16", b="*bf16", c="*bf16", bias=None, res=None, ws="*fp32", counters="*i32",
                      M=1, N=6144, K=4096, stride_am=4096, stride_ak=1, stride_bk=1, stride_bn=4096,
                      stride_cm=6144, stride_cn=1, stride_rm=0, stride_rn=0, k_per_split=1024, whole_tiles=0, a_ptr=None,
                      MAPPING=mappings.get("grouped").constexpr(1), SPLIT_K=4, BLOCK_M=16, BLOCK_N=64,
                      BLOCK_K=128, HAS_BIAS=False, HAS_RES=False, INPUT_PRECISION=None, USE_TMA=False,
                      A_TRANS=False, B_TRANS=False, PREFETCH_B=96 if prefetch else 0)
        if glu:   # numasched.matmul_swiglu: B holds 2N columns (gate, up), the output N
            values.update(N=3072, stride_cm=3072, GLU=True)
        if kvec:   # K = 5000 (8 mod 16): the vector hints the host gives (gemm_splitk.k_vector)
            values.update(K=5000, stride_am=5000, stride_bn=5000, k_per_split=1280, A_K_VEC=kvec, B_K_VEC=kvec)
        # AMD: the host caps the pipeline stages to the LDS (numasched.caps.AMD_MAX_STAGES)
        return K.gemm_splitk_kernel, values, 4, 6 if vendor == "nvidia" else caps.AMD_MAX_STAGES["gemm"]
    return build


# ---- distributed
def _dist_cfg(vendor, stages=None):
    # the host's bf16 GPU config of the distributed GEMMs for N >= 256 (the same on every vendor)
    return dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, num_warps=8, num_stages=stages or 3)


def _all_gather(tma: bool, stages=None):
    def build(vendor):
        from numasched.kernels import dist_gemm as K

        c = _dist_cfg(vendor, stages)
        bm, bn, bk = c["BLOCK_M"], c["BLOCK_N"], c["BLOCK_K"]
        descs = (dict(a_desc=f"tensordesc<bf16[{bm}, {bk}]>", g_desc=f"tensordesc<bf16[{bm}, {bk}]>",
                      b_desc=f"tensordesc<bf16[{bk}, {bn}]>") if tma else dict(a_desc=None, g_desc=None, b_desc=None))
        values = dict(a_ptr=_PTR, g_ptr=_PTR, b_ptr=_PTR, c_ptr=_PTR, **descs, flags_ptr="*i32", status_ptr="*i32",
                      epoch_ptr="*i32", counters_ptr="*i32", heap_bases="*i64", rank=0, Ml=8192, N=14336, K=8192,
                      stride_bk=14336, stride_bn=1, stride_cm=14336, stride_cn=1, num_programs=132,
                      wait_bound=10**6, TICKET_LO=0, TICKET_HI=7168, MAPPING=_mapping("grouped"), WORLD=2,
                      BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, EVEN_K=True, COMM_PROGRAMS=16, PUSH_CHUNK=16384,
                      DO_PUSH=True, WAIT=True, BUMP_EPOCH=True, USE_TMA=tma, PROXY_FENCE=tma,
                      WAIT_CLOCK=vendor == "nvidia")
        return K.all_gather_matmul_kernel, values, c["num_warps"], c["num_stages"]
    return build


def _row_parallel_args(c, tma: bool, b_trans: bool) -> dict:
    """The arguments the two row-parallel fused GEMMs share: A and B (descriptors on the TMA path;
    B_TRANS: B's descriptor is of a (N, K) weight's storage), status, counters, heap, rank."""
    bm, bn, bk = c["BLOCK_M"], c["BLOCK_N"], c["BLOCK_K"]
    b_box = f"[{bn}, {bk}]" if b_trans else f"[{bk}, {bn}]"
    descs = (dict(a_desc=f"tensordesc<bf16[{bm}, {bk}]>", b_desc=f"tensordesc<bf16{b_box}>") if tma
             else dict(a_desc=None, b_desc=None))
    return dict(a_ptr=_PTR, b_ptr=_PTR, out_ptr=_PTR, **descs, status_ptr="*i32", counters_ptr="*i32",
                heap_bases="*i64", rank=0)


def _reduce_scatter(tma: bool, stages=None, flat: bool = False):
    def build(vendor):
        from numasched.kernels import dist_gemm as K

        c = _dist_cfg(vendor, stages)
        bm, bn, bk = c["BLOCK_M"], c["BLOCK_N"], c["BLOCK_K"]
        values = dict(**_row_parallel_args(c, tma, False), p_ptr=_PTR, flags_ptr="*i32", epoch_ptr="*i32",
                      Ms=8192, N=8192, Kl=14336, stride_am=14336, stride_ak=1, stride_bk=8192, stride_bn=1,
                      stride_om=8192, stride_on=1, num_programs=132, wait_bound=10**6, TICKET_LO=0,
                      TICKET_HI=4096, MAPPING=_mapping("grouped"), WORLD=2, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
                      EVEN_K=True, COMM=True, BUMP_EPOCH=True, USE_TMA=tma, WAIT_CLOCK=vendor == "nvidia",
                      FLAT=flat, OUT_CONTIG=flat)
        return K.matmul_reduce_scatter_kernel, values, c["num_warps"], c["num_stages"]
    return build


def _gemm_all_reduce(tma: bool, **flags):
    def build(vendor):
        from numasched.kernels import dist_gemm_ar as K

        c = _dist_cfg(vendor)
        bm, bn, bk = c["BLOCK_M"], c["BLOCK_N"], c["BLOCK_K"]
        # B as the w.T view of a (N, K) weight: its descriptor is of the (N, K) storage
        values = dict(**_row_parallel_args(c, tma, True), recv_ptr=_PTR, flags_ptr="*i64", epoch_ptr="*i64",
                      M=4096, N=4096, K=7168, stride_am=7168, stride_ak=1, stride_bk=1, stride_bn=7168,
                      stride_om=4096, stride_on=1, wait_bound=10**6, WORLD=2, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
                      EVEN_K=True, USE_TMA=tma, B_TRANS=tma, STAGES=7, BUMP_EPOCH=True,
                      WAIT_CLOCK=vendor == "nvidia", **flags)
        return K.matmul_all_reduce_kernel, values, c["num_warps"], c["num_stages"]
    return build


def _decode_exchange(vendor):
    from numasched.kernels import dist_decode as K

    values = dict(out_ptr=_PTR, lse_ptr="*fp32", ro_ptr=_PTR, rl_ptr="*fp32", flags_ptr="*i32", res_ptr=_PTR,
                  res_lse_ptr="*fp32", status_ptr="*i32", epoch_ptr="*i32", counters_ptr="*i32",
                  heap_bases="*i64", rank=0, B=16, H=32, D=128, stride_ob=4096, stride_oh=128, stride_od=1,
                  stride_lb=32, stride_lh=1, num_programs=16, wait_bound=10**6, WORLD=2, BLOCK_H=32,
                  BLOCK_D=128, DO_PUSH=True, DO_COMBINE=True, WAIT=True, BUMP_EPOCH=True,
                  WAIT_CLOCK=vendor == "nvidia")
    return K.decode_exchange_combine_kernel, values, 8, 1


def _remote_copy(vendor):
    from numasched.kernels import dist_common as K

    values = dict(src_ptr=_PTR, dst_ptr=_PTR, heap_bases="*i64", rank=0, peer=3, n=2**26, BLOCK=8192)
    return K.remote_copy_kernel, values, 8, 1


def _spin_probe(vendor):
    from numasched.kernels import dist_common as K

    return K.spin_probe_kernel, dict(flag_ptr="*i32", status_ptr="*i32", bound=32768, CLOCK=False), 1, 1


def _ce_signal(vendor):
    from numasched.kernels import dist_ce as K

    values = dict(flags_ptr="*i32", epoch_ptr="*i32", heap_bases="*i64", rank=0, dest=3, idx=5)
    return K.ce_signal_kernel, values, 1, 1


def _ce_wait(vendor):
    from numasched.kernels import dist_ce as K

    values = dict(flags_ptr="*i32", epoch_ptr="*i32", status_ptr="*i32", idx=5, src=3, wait_bound=10**6, LAG=1,
                  WAIT_CLOCK=vendor == "nvidia")
    return K.ce_wait_kernel, values, 1, 1


def _sum_partials(vendor):
    from numasched.kernels import dist_ce as K

    values = dict(own_ptr=_PTR, p_ptr=_PTR, out_ptr=_PTR, rank=0, n=2**24, WORLD=2, BLOCK=2048)
    return K.sum_partials_kernel, values, 4, 1


# ---- probe
_PROBE_SIG = dict(buf_ptr="*i64", offs_ptr="*i64", lat_ptr="*fp32", sm_ptr="*i32", clk_ptr="*i64",
                  n_lines="i32", iters="i32")


def _l2_latency(vendor):
    from numasched.kernels import probe as K

    return K._l2_latency_kernel, dict(_PROBE_SIG, AMD=vendor == "amd"), 1, 1


def _xcc_id(vendor):
    from numasched.kernels import probe as K

    return K._xcc_id_kernel, dict(out_ptr="*i32"), 1, 1



def _rope_cache(qk_norm: bool, prefill: bool = False, head_major: bool = False):
    def build(vendor):
        from numasched.kernels import rope_cache as K

        # Llama-3-8B at TP 2 (16 q heads, 4 kv heads, d128), a decode step of 16 tokens, pages of 16
        # (rows of the flattened cache; head_major: pages (kv_heads, 16, d) addressed by page and
        # offset); prefill: 4096 tokens, k and v also returned, each token's row scaled (norm-free)
        page, (sp, ss, sh) = (16, (8192, 128, 2048)) if head_major else (1, (512, 0, 128))
        values = dict(QKV="*bf16", COS="*bf16", SIN="*bf16", QW="*bf16", KW="*bf16", Q_OUT="*bf16", K_CACHE="*bf16",
                      V_CACHE="*bf16", SLOTS="*i64", K_OUT="*bf16", V_OUT="*bf16", RS="*fp32" if prefill else "*bf16",
                      T=4096 if prefill else 16, stride_qkv_t=3072, stride_cos_t=128, stride_sin_t=128,
                      stride_q_t=2048, stride_q_h=128, stride_kc_page=sp, stride_kc_slot=ss, stride_kc_h=sh,
                      stride_vc_page=sp, stride_vc_slot=ss, stride_vc_h=sh, eps=1e-6, rows=8192, HQ=16, HK=4,
                      HEAD_DIM=128, BLOCK_D=128, BLOCK_T=16, QK_NORM=qk_norm, KV_OUT=prefill, ROW_SCALE=prefill,
                      PAGE=page)
        return K.qkv_rope_cache_kernel, values, 4, 1
    return build

_AMD_CFG = ("an LDS-sized config for gfx942 (64 KiB of LDS per workgroup, less than the host's config above "
            "needs); NVIDIA plans the config above")
_AMD_CFG_NOTE = "the config above with fewer stages, so that it fits gfx942's 64 KiB of LDS (AMD only)"

VARIANTS: List[Variant] = [
    Variant("flash_decode", "contiguous-fused-bf16-d128-g4", _decode(False, 2),
            note="BLOCK_N 64, 4 warps, 3 stages (the host's fixed config); combine fused (last split merges); "
                 + _PREC_NOTE),
    Variant("flash_decode", "contiguous-partials-bf16-d128-g4", _decode(False, 1),
            note="partials for the separate combine kernel; " + _PREC_NOTE),
    Variant("flash_decode", "paged16-fused-bf16-d128-g4", _decode(True, 2),
            note="page size 16, BLOCK_N 64, 4 warps, 5 stages (the host's fixed config); combine fused; "
                 + _PREC_NOTE),
    Variant("flash_decode", "paged16-fused-bf16-d128-g4-prefetch", _decode(True, 2, prefetch=128),
            off={"amd": "cp.async.bulk.prefetch.L2 is NVIDIA PTX; the host sets PREFETCH_TOKENS on sm_90+ only"},
            note="the same with PREFETCH_TOKENS 128 (options.decode_prefetch): the chunk's first tokens into L2 "
                 "before the PDL wait"),
    Variant("flash_decode", "contiguous-fused-bf16-d128-g4-prefetch", _decode(False, 2, prefetch=128),
            off={"amd": "cp.async.bulk.prefetch.L2 is NVIDIA PTX; the host sets PREFETCH_TOKENS on sm_90+ only"},
            note="the contiguous layout with PREFETCH_TOKENS 128"),
    Variant("flash_decode", "contiguous-fused-bf16-d128-g4-tma", _decode(False, 2, tma=True), off={"amd": _TMA_OFF},
            note="options.decode_tma: the whole K/V tiles by TMA (4-D boxes of one tile of one head), the "
                 "partial last tile by masked loads"),
    Variant("flash_decode", "contiguous-none-bf16-d128-g4-tma-128", _decode(False, 0, tma=True, block_n=128),
            off={"amd": _TMA_OFF}, note="the same with the long-split config (128-token tiles, 4 warps, 3 stages), "
                                        "one split"),
    Variant("flash_decode", "contiguous-none-bf16-d128-g4-128", _decode(False, 0, block_n=128),
            note="the long-split config (128-token tiles, 4 warps, 3 stages), one split, pointer loads"),
    Variant("flash_decode", "paged16-fused-bf16-d128-g4-3stage", _decode(True, 2, 3), off={"nvidia": _AMD_CFG},
            note=_AMD_CFG_NOTE),
    Variant("flash_decode_worklist", "contiguous-bf16-d128-g4", _decode_worklist(False),
            note="persistent work-list kernel (ragged batches), the split kernel's fixed contiguous config, "
                 "maxnreg 248 on NVIDIA (kernels.flash_decode_worklist.max_registers); " + _PREC_NOTE),
    Variant("flash_decode_worklist", "paged16-bf16-d128-g4", _decode_worklist(True),
            note="page size 16, the split kernel's fixed paged config, maxnreg 248 on NVIDIA; " + _PREC_NOTE),
    Variant("combine", "bf16-d128-s16", _combine, note="BLOCK_S 16, 4 warps"),
    Variant("attention_fwd", "bf16-d128-pointer", _attention(False, False),
            note="128x64 tiles, 8 warps, 3 stages (the host's fixed config, pointer loads); " + _PREC_NOTE),
    Variant("attention_fwd", "bf16-d128-causal-pointer", _attention(True, False),
            note="128x64 tiles, 8 warps, 3 stages, LPT order; " + _PREC_NOTE),
    Variant("attention_fwd", "bf16-d128-causal-pointer-2stage", _attention(True, False, stages=2),
            off={"nvidia": _AMD_CFG}, note=_AMD_CFG_NOTE),
    Variant("attention_fwd", "bf16-d128-causal-tma", _attention(True, True), off={"amd": _TMA_OFF},
            note="device-side tensor descriptors (tl.make_tensor_descriptor)"),
    Variant("attention_fwd", "fp32-d128-pointer", _attention(False, False, "fp32", 32, 32, 4, 2),
            note="32x32 tiles, 4 warps, 2 stages, IEEE fp32 dots"),
    Variant("gemm", "bf16-pointer", _gemm("pointer", "bf16", False),
            note="128x256x64, 8 warps, 3 stages (the first pointer-path GPU config), one tile per program"),
    Variant("gemm", "bf16-pointer-persistent", _gemm("pointer", "bf16", True),
            note="128x256x64, 8 warps, 3 stages, persistent (flattened loops)"),
    Variant("gemm", "bf16-pointer-2stage", _gemm("pointer", "bf16", False, stages=2), off={"nvidia": _AMD_CFG},
            note=_AMD_CFG_NOTE),
    Variant("gemm", "fp32-pointer", _gemm("pointer", "fp32", False),
            note="128x128x32, 8 warps, 3 stages, IEEE fp32 dots"),
    Variant("gemm", "bf16-tma-persistent", _gemm("tma", "bf16", True), off={"amd": _TMA_OFF},
            note="128x256x64, 8 warps, 3 stages, subtiled TMA epilogue"),
    Variant("gemm", "fp32-tma", _gemm("tma", "fp32", False), off={"amd": _TMA_OFF},
            note="128x128x32, 8 warps, 3 stages, IEEE fp32 dots"),
    Variant("gemm_streamk", "bf16-tma-128x256", _gemm_streamk(True), off={"amd": _TMA_OFF},
            note="stream-K, 128x256x64, 8 warps, 4 stages, B through the descriptor of its (N, K) storage"),
    Variant("gemm_streamk", "bf16-tma-128x128", _gemm_streamk(True, 128, 128, 4), off={"amd": _TMA_OFF},
            note="stream-K, 128x128x64, 8 warps, 4 stages"),
    Variant("gemm_streamk", "bf16-pointer-128x128", _gemm_streamk(False, 128, 128, 3),
            note="stream-K, 128x128x64, 8 warps, 3 stages, pointer loads (pre-Hopper and AMD)"),
    Variant("gemm_splitk", "bf16-pointer-decode", _gemm_splitk(False),
            note="split-K 16x64x128, 4 warps, 6 stages (AMD: the capped stages), split 4 (M = 1 against a W.T "
                 "weight)"),
    Variant("gemm_splitk", "bf16-pointer-decode-kvec", _gemm_splitk(False, kvec=8),
            note="the same at K = 5000 with A_K_VEC = B_K_VEC = 8 (16-byte loads; without them one element at a time)"),
    Variant("copy_rows", "bf16-k5000", _copy_rows(5000, 5056, 8),
            note="A's rows into whole 128-byte lines (options.gemm_align_a)"),
    Variant("copy_rows", "bf16-k1537-pad", _copy_rows(1537, 1600, 1, pad=1),
            note="rows of an odd K into zero-padded whole lines (options.gemm_pad_k)"),
    Variant("gemm_splitk", "bf16-pointer-decode-prefetch", _gemm_splitk(True),
            off={"amd": "cp.async.bulk.prefetch.L2 is NVIDIA PTX; the host sets PREFETCH_B on sm_90+ only"},
            note="the same with PREFETCH_B (options.pdl_prefetch): the first 96 programs' B into L2 before "
                 "the PDL wait"),
    Variant("gemm_splitk", "bf16-pointer-decode-glu-prefetch", _gemm_splitk(True, glu=True),
            off={"amd": "cp.async.bulk.prefetch.L2 is NVIDIA PTX; the host sets PREFETCH_B on sm_90+ only"},
            note="the SwiGLU form (GLU: gate and up columns) with PREFETCH_B"),
    Variant("gemm_glu", "bf16-tma-persistent", _glu_persistent(False), off={"amd": _TMA_OFF},
            note="matmul_swiglu's prefill kernel: persistent, tile and K loops fused, 128 x 128 gate + up, 8 warps, "
                 "3 stages"),
    Variant("gemm_glu", "bf16-tma-persistent-row-scale", _glu_persistent(True), off={"amd": _TMA_OFF},
            note="the same with a factor per row (the norm-free prefill)"),
    Variant("gemm_splitk", "bf16-tma-glu-prefill", _gemm_glu_prefill(False), off={"amd": _TMA_OFF},
            note="matmul_swiglu's prefill tiles (128 x 128 gate + up, 8 warps, 3 stages, unsplit)"),
    Variant("gemm_splitk", "bf16-tma-glu-prefill-row-scale", _gemm_glu_prefill(True), off={"amd": _TMA_OFF},
            note="the same with a factor per row on the accumulators (a norm-free prefill)"),
    Variant("gemm_weight_first", "bf16-16-split2-pdl", _weight_first(), off={"amd": _GLUON_OFF},
            note="the weight-first decode GEMM (Gluon): the first stages' weight boxes before the PDL wait, "
                 "x's after; 64-row bands, two K parts"),
    Variant("gemm_weight_first", "bf16-16-glu-pdl", _weight_first(glu=True, splits=1), off={"amd": _GLUON_OFF},
            note="its SwiGLU form (gate and up bands in a slot, silu(gate) * up), unsplit"),
    Variant("gemm_weight_first", "bf16-64-split3-late", _weight_first(rows=64, splits=3, pdl=3),
            off={"amd": _GLUON_OFF}, note="64 rows of x, three K parts, the next kernel let go after the K loop"),
    Variant("gemm_weight_first", "bf16-16-split2-after", _weight_first(early=0), off={"amd": _GLUON_OFF},
            note="the A/B form: every box after the PDL wait"),
    Variant("gemm_weight_first", "bf16-16-split2-early2", _weight_first(early=2), off={"amd": _GLUON_OFF},
            note="two ring stages' weight boxes before the PDL wait, the rest after"),
    Variant("gemm_weight_first", "bf16-16-split2-push2", _weight_first(pdl=3, world=2), off={"amd": _GLUON_OFF},
            note="a row-parallel projection's form: each band also pushed to the peer, counted (the pushed "
                 "all-reduce + add + norm after it)"),
    Variant("gemm_weight_first", "bf16-1-split1-push4", _weight_first(rows=1, splits=1, pdl=3, world=4),
            off={"amd": _GLUON_OFF}, note="pushed to three peers, unsplit, one row (M = 1 and rank 1 are "
                                          "specialised as constants)"),
    Variant("gemm_weight_first", "bf16-16-split2-reduce2", _weight_first(pdl=1, world=2, reduce=True),
            off={"amd": _GLUON_OFF}, note="a row-parallel projection that finishes the all-reduce + add: each band "
                                          "pushed, the peer's band waited for (bounded), summed into the residual"),
    Variant("gemm_weight_first", "bf16-16-split1-reduce4", _weight_first(splits=1, pdl=1, world=4, reduce=True),
            off={"amd": _GLUON_OFF}, note="the same at four ranks, unsplit"),
    Variant("gemm_weight_first", "bf16-16-split2-scale", _weight_first(nss=64), off={"amd": _GLUON_OFF},
            note="rows scaled by RMSNorm's factor from 64 bands' sums of squares (x: the residual stream)"),
    Variant("gemm_weight_first", "bf16-16-glu-scale", _weight_first(glu=True, splits=1, nss=64),
            off={"amd": _GLUON_OFF}, note="the SwiGLU form with the row scale before the GLU"),
    Variant("gemm_ws", "bf16-128x256-s3", _gemm_ws(), off={"amd": _GLUON_OFF},
            note="warp-specialised (Gluon): a loader warp, two consumer warpgroups, maxnreg 168"),
    Variant("gemm_ws", "bf16-128x128-s5-b-rowmajor", _gemm_ws(128, 5, b_kmajor=False), off={"amd": _GLUON_OFF},
            note="B as a (K, N) row-major tensor"),
    Variant("gemm_ws", "bf16-128x160-wide", _gemm_ws(tile_n=160), off={"amd": _GLUON_OFF},
            note="tiles of 160 columns in two boxes (128 + 32), two accumulators a warpgroup"),
    Variant("gemm_ws", "bf16-128x80-wide", _gemm_ws(tile_n=80), off={"amd": _GLUON_OFF},
            note="tiles of 80 columns (64 + 16 boxes)"),
    Variant("gemm_ws", "bf16-128x208-three-boxes", _gemm_ws(tile_n=208), off={"amd": _GLUON_OFF},
            note="tiles of 208 columns (128 + 64 + 16 boxes)"),
    Variant("gemm_ws", "bf16-128x176-three-boxes-b-rowmajor", _gemm_ws(tile_n=176, b_kmajor=False),
            off={"amd": _GLUON_OFF}, note="tiles of 176 columns (128 + 32 + 16 boxes), B (K, N) row-major"),
    Variant("gemm_ws", "bf16-128x192-wide-b-rowmajor", _gemm_ws(tile_n=192, b_kmajor=False), off={"amd": _GLUON_OFF},
            note="tiles of 192 columns (128 + 64 boxes), B as a (K, N) row-major tensor"),
    Variant("gemm_ws", "bf16-128x256-s3-streamk", _gemm_ws_streamk(), off={"amd": _GLUON_OFF},
            note="stream-K: equal K ranges per program, partials summed by the tile's last piece"),
    Variant("gemm_ws", "bf16-128x256-s3-streamk-b-rowmajor", _gemm_ws_streamk(False), off={"amd": _GLUON_OFF},
            note="the stream-K form with B as a (K, N) row-major tensor"),
    Variant("gemm_ws", "bf16-128x256-s3-streamk-bands", _gemm_ws_streamk(merge=1), off={"amd": _GLUON_OFF},
            note="stream-K whose fix-up every contributor shares (a band of rows each, after its range)"),
    Variant("gemm_ws", "bf16-128x256-s3-split3", _gemm_ws_streamk(merge=1, split=3), off={"amd": _GLUON_OFF},
            note="split-K in three K parts in lockstep, the banded merge"),
    Variant("gemm_ws", "bf16-64x80-wide", _gemm_ws(tile_n=80, block_m=64), off={"amd": _GLUON_OFF},
            note="tiles of 64 x 80 (64 + 16 boxes): one consumer warpgroup and the loader"),
    Variant("gemm_ws", "bf16-64x128-last-box", _gemm_ws(tile_n=128, block_m=64, a_last=(32, 16)),
            off={"amd": _GLUON_OFF}, note="tiles of 64 x 128, the last tile row's A in boxes of 32 + 16 rows"),
    Variant("gemm_ws", "bf16-128x160-wide-last-box", _gemm_ws(tile_n=160, a_last=(16, 0)), off={"amd": _GLUON_OFF},
            note="the last tile row's A in boxes of 16 rows (M not a multiple of 128: no box past A's end)"),
    Variant("gemm_ws", "bf16-glu-128x128-s4-last-box", _gemm_ws(128, 4, glu=True, a_last=(32, 0)), off={"amd": _GLUON_OFF},
            note="SwiGLU with the last tile row's A in boxes of 32 rows"),
    Variant("gemm_ws", "bf16-128x128-split2-last-box", _gemm_ws_streamk(merge=1, split=2, a_last=(64, 16)),
            off={"amd": _GLUON_OFF}, note="the split-K form at 65-80 rows: A in boxes of 64 and 16 rows"),
    Variant("gemm_ws", "bf16-swap-128x96", _gemm_ws(tile_n=96, swap=True), off={"amd": _GLUON_OFF},
            note="the weight as A, y stored transposed (SWAP_C): 128 weight rows by 96 tokens"),
    Variant("gemm_ws", "bf16-swap-256x96", _gemm_ws(tile_n=96, block_m=256, swap=True), off={"amd": _GLUON_OFF},
            note="SWAP_C, four consumer warpgroups: 256 weight rows by 96 tokens"),
    Variant("gemm_ws", "bf16-swap-128x144-last-box", _gemm_ws(tile_n=144, swap=True, a_last=(64, 16)),
            off={"amd": _GLUON_OFF}, note="SWAP_C with the weight's last tile row in short boxes"),
    Variant("gemm_ws", "bf16-swap-128x144-last-b", _gemm_ws(tile_n=144, swap=True, b_last=(128, 16)),
            off={"amd": _GLUON_OFF}, note="SWAP_C with the tokens' last tile in short boxes (both boxes)"),
    Variant("gemm_ws", "bf16-swap-128x128-last-b", _gemm_ws(tile_n=128, swap=True, b_last=(64, 0)),
            off={"amd": _GLUON_OFF}, note="SWAP_C, one box, the tokens' last tile in a box of 64 rows"),
    Variant("gemm_ws", "bf16-128x160-bias-residual", _gemm_ws(tile_n=160, bias=True, residual=True),
            off={"amd": _GLUON_OFF}, note="the bias and residual epilogue, added in fp32 before each box's store"),
    Variant("gemm_ws", "bf16-swap-128x96-bias-residual", _gemm_ws(tile_n=96, swap=True, bias=True, residual=True),
            off={"amd": _GLUON_OFF}, note="the same in the transposed form: the bias along the kernel's rows"),
    Variant("gemm_ws", "bf16-128x128-split2-bias-residual",
            _gemm_ws_streamk(merge=1, split=2, bias=True, residual=True), off={"amd": _GLUON_OFF},
            note="the split-K form's banded merge adding the bias and the residual"),
    Variant("gemm_ws", "bf16-128x256-s3-peer-push", _gemm_ws(peer_push=1), off={"amd": _GLUON_OFF},
            note="a probe: every tile also TMA-stored into a peer GPU's twin of C"),
    Variant("gemm_ws", "bf16-128x256-s3-peer-paced", _gemm_ws(peer_push=2), off={"amd": _GLUON_OFF},
            note="a probe: the twin's copy in 64-column chunks spread over the next K loop"),
    Variant("dist", "matmul_all_reduce-ws-residual-direct", _gemm_all_reduce_ws(), off={"amd": _GLUON_OFF},
            note="two ranks on the warp-specialised GEMM: TMA copies paced over the next K loop"),
    Variant("dist", "matmul_all_reduce-ws", _gemm_all_reduce_ws(False, False), off={"amd": _GLUON_OFF},
            note="the same, out not in the heap: sums through the receive slots"),
    Variant("dist", "matmul_all_reduce-ws-128", _gemm_all_reduce_ws(block_n=128), off={"amd": _GLUON_OFF},
            note="128 x 128 tile pairs (where 256-wide pairs would add a round), DIRECT and the residual"),
    Variant("dist", "matmul_reduce_scatter-ws", _gemm_all_reduce_ws(False, False, rs=True), off={"amd": _GLUON_OFF},
            note="the same kernel as the two-rank reduce-scatter (RS): partials out, our slice summed"),
    Variant("dist", "matmul_reduce_scatter-ws-pairs", _gemm_all_reduce_ws(False, False, rs=True, rs_pairs=True),
            off={"amd": _GLUON_OFF}, note="the reduce-scatter's tiles in pairs (where pairs add no round)"),
    Variant("dist", "matmul_reduce_scatter-ws-pairs-early",
            _gemm_all_reduce_ws(False, False, rs=True, rs_pairs=True, rs_early=True), off={"amd": _GLUON_OFF},
            note="the pairs with the flag raised and the peer's partial fetched inside the next K loop"),
    Variant("dist", "matmul_reduce_scatter-ws-pairs-rows",
            _gemm_all_reduce_ws(False, False, rs=True, rs_pairs=True, group=0), off={"amd": _GLUON_OFF},
            note="the pairs with a slice's tiles row by row (the order before the grouped one)"),
    Variant("dist", "matmul_reduce_scatter-ws-early", _gemm_all_reduce_ws(False, False, rs=True, rs_early=True),
            off={"amd": _GLUON_OFF}, note="one list (the peer's tiles, then ours), the same early flag and fetch"),
    Variant("gemm_ws", "bf16-glu-128x128-s4-row-scale", _gemm_ws(128, 4, glu=True, row_scale=True),
            off={"amd": _GLUON_OFF}, note="SwiGLU: a gate and an up box per stage, two accumulators per warpgroup"),
    Variant("gemm_splitk", "bf16-tma-128x128", _gemm_splitk_medium(False), off={"amd": _TMA_OFF},
            note="unsplit 128x128x64 TMA tiles, 8 warps, 6 stages (the chooser's medium-M split-K tile)"),
    Variant("gemm_splitk", "bf16-tma-128x128-tail", _gemm_splitk_medium(True), off={"amd": _TMA_OFF},
            note="the same with TAIL: the whole wave's tiles whole, the remainder in 4 K parts"),
    Variant("rope_cache", "bf16-d128-llama", _rope_cache(False),
            note="QKV split + RoPE + paged K/V write, 16 tokens x 16/4 heads, 4 warps"),
    Variant("rope_cache", "bf16-d128-qk-norm", _rope_cache(True), note="the same with Qwen3's per-head q/k norms"),
    Variant("rope_cache", "bf16-d128-head-major", _rope_cache(False, head_major=True),
            note="the same into head-major pages (kv_heads, 16, d), addressed by page and offset"),
    Variant("rope_cache", "bf16-d128-prefill-row-scale", _rope_cache(False, prefill=True),
            note="a norm-free prefill's: 4096 tokens, k and v returned, each row scaled by its 1 / rms"),
    Variant("dist", "all_gather_matmul-pointer", _all_gather(False),
            note="world 2, 128x256x64, 8 warps, 3 stages (the host's bf16 config); " + _CLOCK_NOTE),
    Variant("dist", "all_gather_matmul-pointer-2stage", _all_gather(False, 2), off={"nvidia": _AMD_CFG},
            note=_AMD_CFG_NOTE),
    Variant("dist", "all_gather_matmul-tma", _all_gather(True), off={"amd": _TMA_OFF},
            note="TMA loads after fence.proxy.async (inline PTX, PROXY_FENCE)"),
    Variant("dist", "matmul_reduce_scatter-pointer", _reduce_scatter(False),
            note="world 2, 128x256x64, 8 warps, 3 stages; " + _CLOCK_NOTE),
    Variant("dist", "matmul_reduce_scatter-pointer-2stage", _reduce_scatter(False, 2), off={"nvidia": _AMD_CFG},
            note=_AMD_CFG_NOTE),
    Variant("dist", "matmul_reduce_scatter-tma", _reduce_scatter(True, flat=True), off={"amd": _TMA_OFF},
            note="static tickets in one loop over (tile, K step) (FLAT), a contiguous out"),
    Variant("dist", "matmul_reduce_scatter-tma-ticketed", _reduce_scatter(True), off={"amd": _TMA_OFF},
            note="dynamic tickets, a K loop per tile (options.fused_flat=False)"),
    Variant("dist", "matmul_all_reduce-tma-lagged", _gemm_all_reduce(True, CONTIG=True), off={"amd": _TMA_OFF},
            note="world 2, 4096 x 4096 x 7168 (Llama-3-8B's down projection at 4096 rows), 128x256x64, 8 warps, "
                 "3 stages, the lagged one-shot form"),
    Variant("dist", "matmul_all_reduce-tma-pairs", _gemm_all_reduce(True, PAIRS=True, CONTIG=True, FLAT=True),
            off={"amd": _TMA_OFF}, note="tile pairs (PAIRS) in one loop over (tile, K step) (FLAT), the TP prefill's form"),
    Variant("dist", "matmul_all_reduce-tma-pairs-residual-direct",
            _gemm_all_reduce(True, PAIRS=True, CONTIG=True, RESIDUAL=True, DIRECT=True, FLAT=True),
            off={"amd": _TMA_OFF},
            note="tile pairs with the residual add and the sums stored into the peer's out, FLAT (the TP 2 "
                 "prefill's default)"),
    Variant("dist", "matmul_all_reduce-tma-pairs-residual-tma-push",
            _gemm_all_reduce(True, PAIRS=True, CONTIG=True, RESIDUAL=True, FLAT=True, TMA_PUSH=True),
            off={"amd": _TMA_OFF},
            note="FLAT tile pairs with the residual add, the pushes as TMA stores into the peer's receive slots "
                 "(options.fused_tma_push; 213 KB of shared memory)"),
    Variant("dist", "matmul_all_reduce-tma-pairs-residual-direct-per-tile",
            _gemm_all_reduce(True, PAIRS=True, CONTIG=True, RESIDUAL=True, DIRECT=True), off={"amd": _TMA_OFF},
            note="the same with a K loop per tile (options.fused_flat=False)"),
    Variant("dist", "matmul_all_reduce-pointer-lagged", _gemm_all_reduce(False),
            note="the lagged form through pointer loads and strided stores (pre-Hopper and AMD); " + _CLOCK_NOTE),
    Variant("dist", "decode_exchange_combine", _decode_exchange, note="world 2, 32 heads x 128; " + _CLOCK_NOTE),
    Variant("dist", "remote_copy", _remote_copy, note="BLOCK 8192, 8 warps"),
    Variant("dist", "spin_probe", _spin_probe, note="poll-count bound (CLOCK False), as spin_ns launches it"),
    Variant("dist", "ce_signal", _ce_signal),
    Variant("dist", "ce_wait", _ce_wait, note=_CLOCK_NOTE),
    Variant("dist", "ce_sum_partials", _sum_partials, note="BLOCK 2048, world 2"),
    Variant("probe", "l2_latency", _l2_latency,
            note="inline asm per vendor: PTX %smid/%clock64/%globaltimer/ld.global.cg; AMD s_getreg HW_ID+XCC_ID, "
                 "s_memtime, s_memrealtime, global_load sc1 (AMD path never run on hardware)"),
    Variant("probe", "xcc_id", _xcc_id,
            off={"nvidia": "s_getreg_b32 HW_REG_XCC_ID is AMD ISA; NVIDIA's SM id comes from %smid in l2_latency"},
            note="AMD only (never run on hardware)"),
]


def variants(kernels: Optional[Iterable[str]] = None) -> List[Variant]:
    """The registered variants, optionally only those of some kernel families (or ``family/name`` keys)."""
    if kernels is None:
        return list(VARIANTS)
    want = set(kernels)
    return [v for v in VARIANTS if v.kernel in want or v.key in want]


def find(kernel: str, variant: str) -> Variant:
    for v in VARIANTS:
        if v.kernel == kernel and v.name == variant:
            return v
    raise KeyError(f"no variant {kernel}/{variant}; known: {[v.key for v in VARIANTS]}")


def compile_variant(kernel: str, variant: str, target: str = "sm90", *, keep_asm: bool = False) -> dict:
    """Compile one registered variant for ``target`` ("sm90", "gfx942", "gfx950", ...) and return a dict:
    target, kernel, variant, status ("ok", "error" or "off"), ok (True/False; None when off), error,
    reason (why it is off), note, num_warps, num_stages and the compiler facts of :func:`compile_kernel`
    (shared_bytes, registers, sgprs, spill_bytes, mma, tma_load, ...). A compile error is reported,
    not raised; running where the kernels are interpreter objects raises :class:`Interpreted`."""
    v = find(kernel, variant)
    vendor = _vendor(target)
    row = dict(target=target, kernel=kernel, variant=variant, note=v.note, status="ok", ok=True, error=None,
               reason=None, num_warps=None, num_stages=None)
    if vendor in v.off:
        row.update(status="off", ok=None, reason=v.off[vendor])
        return row
    fn, values, warps, stages, *extra = v.build(vendor)
    row.update(num_warps=warps, num_stages=stages, shared_limit=shared_limit(target), fits=None)
    try:
        row.update(compile_kernel(fn, values, target, num_warps=warps, num_stages=stages, keep_asm=keep_asm,
                                  **(extra[0] if extra else {})))
    except Interpreted:
        raise
    except Exception as e:  # a compile error is a result of the check
        row.update(status="error", ok=False, error=_error_text(e))
        return row
    if row["shared_limit"] is not None:
        row["fits"] = row["shared_bytes"] <= row["shared_limit"]
    return row


def _error_text(e: Exception) -> str:
    msg = [m.strip() for m in str(e).strip().splitlines() if m.strip() not in ("", "^")]
    return (type(e).__name__ + ": " + " | ".join(msg[-2:]))[:400]


def host_precision_check(target: str) -> Optional[str]:
    """Compile the fused decode variant with the input precision the host passes for bf16 today
    ("tf32", numasched/decode.py; numasched/attention.py passes the same DOT_PRECISION); returns
    the compile error, or None when it compiles. gfx950 refuses "tf32" (Triton 3.6 allows it on
    gfx942 only, where it maps to xf32), whatever the operand type."""
    fn, values, warps, stages = find("flash_decode", "contiguous-fused-bf16-d128-g4").build(_vendor(target))
    values = dict(values, INPUT_PRECISION="tf32")
    try:
        compile_kernel(fn, values, target, num_warps=warps, num_stages=stages)
    except Interpreted:
        raise
    except Exception as e:
        return _error_text(e)
    return None


def findings(rows: List[dict]) -> List[str]:
    """What the compiles say beyond "it compiles": configs over a target's shared/LDS limit, register
    spills, and the host's bf16 input precision on each AMD target of ``rows``."""
    out = []
    over = [r for r in rows if r.get("fits") is False]
    for r in over:
        out.append(f"`{r['kernel']}/{r['variant']}` on {r['target']}: {r['shared_bytes']} bytes of "
                   f"{'LDS' if r['target'].startswith('gfx') else 'shared memory'}, over the {r['shared_limit']} a "
                   f"block may use there: it compiles, but a launch fails (out of resources): the autotuner "
                   f"times such a config as infinitely slow and moves on, a fixed config (no autotuning, "
                   f"the distributed kernels) fails")
    for r in rows:
        if r["status"] == "ok" and (r.get("spill_bytes") or r.get("vgpr_spills")):
            out.append(f"`{r['kernel']}/{r['variant']}` on {r['target']}: register spills "
                       f"({r.get('spill_bytes')} bytes{'' if r['target'].startswith('sm') else ' per lane'})")
    for t in dict.fromkeys(r["target"] for r in rows):
        if _vendor(t) == "amd":
            err = host_precision_check(t)
            if err:
                out.append(f"{t}: refuses input precision 'tf32' for bf16 dots ({err}); the host passes None (the "
                           f"target's default) for 16-bit inputs since this was found, as the rows above do")
    if over:
        out.append("the configs over gfx942's LDS above are the NVIDIA defaults: on ROCm the host caps the "
                   "pipeline stages (numasched.caps.AMD_MAX_STAGES: 2 for GEMM and prefill, 3 for decode), which "
                   "the reduced-stage rows show fit")
    return out


# ------------------------------------------------------------------------------------ compile reports
def attention_report(bm: int, bn: int, num_warps: int, num_stages: int, use_tma: bool, *, head_dim: int = 128,
                     causal: bool = False, dtype: str = "bf16", policy: str = "head_first", num_domains: int = 1,
                     target: str = "sm90") -> dict:
    """Compile the prefill kernel with one config for ``target`` (the former
    ``kernels.attention_fwd.compile_report``): shared bytes, wgmma/TMA use, registers, spills."""
    fn, values, w, s = _attention(causal, use_tma, dtype, bm, bn, num_warps, num_stages, head_dim, policy,
                                  num_domains)(_vendor(target))
    if dtype != "fp32":
        values["DOT_PRECISION"] = "tf32" if _vendor(target) == "nvidia" else None
    return compile_kernel(fn, values, target, num_warps=w, num_stages=s)


def gemm_report(config, *, dtype: str = "bf16", path: str = "tma", a_trans: bool = False, b_trans: bool = False,
                c_tma: bool = True, policy: str = "grouped", num_domains: int = 1, int64: bool = False,
                precision: Optional[str] = None, target: str = "sm90") -> dict:
    """Compile the GEMM kernel with one ``triton.Config`` for ``target`` (the former
    ``kernels.gemm.compile_report``): shared bytes, wgmma/TMA use, registers, spills."""
    fn, values, w, s = _gemm(path, dtype, bool(config.kwargs.get("PERSISTENT")), config, a_trans, b_trans, c_tma,
                             policy, num_domains, int64, precision)(_vendor(target))
    return compile_kernel(fn, values, target, num_warps=w, num_stages=s, ptxas_timeout=120)


# ------------------------------------------------------------------------------------ the table
def report(targets: Sequence[str] = TARGETS, kernels: Optional[Iterable[str]] = None, *,
           progress: Optional[Callable[[dict], None]] = None) -> List[dict]:
    """:func:`compile_variant` for every registered variant (or those of ``kernels``) and target."""
    rows = []
    for v in variants(kernels):
        for t in targets:
            row = compile_variant(v.kernel, v.name, t)
            rows.append(row)
            if progress:
                progress(row)
    return rows


_FITS = {True: "yes", False: "**NO**", None: "-"}


def _cell(x) -> str:
    return "-" if x is None else str(x)


def markdown(rows: List[dict], *, title: str = "Portability: offline compiles per kernel and target",
             preamble: str = "", notes: Sequence[str] = ()) -> str:
    """The rows of :func:`report` as a Markdown document: one table, then the switched-off variants."""
    import triton

    targets = list(dict.fromkeys(r["target"] for r in rows))
    ok = [r for r in rows if r["status"] == "ok"]
    bad = [r for r in rows if r["status"] == "error"]
    off = [r for r in rows if r["status"] == "off"]
    keys = list(dict.fromkeys((r["kernel"], r["variant"]) for r in rows))
    lines = [f"# {title}", ""]
    if preamble:
        lines += [preamble.strip(), ""]
    lines += [f"Offline compiles with triton {triton.__version__} on a CPU (no GPU; no AMD hardware was used or "
              f"available): targets {', '.join(targets)}. {len(keys)} variants x {len(targets)} targets = "
              f"{len(rows)} compiles: {len(ok)} ok, {len(bad)} failed, {len(off)} switched off (reasons below).",
              "",
              "Columns: regs/VGPRs = registers per thread (NVIDIA, ptxas -v) or VGPRs per lane including AGPRs "
              "(AMD `.vgpr_count`, unified register file); AGPRs and SGPRs (AMD); shared/LDS = bytes of shared "
              "memory (NVIDIA) or LDS (AMD) per block (`metadata.shared`); spills = spill-store bytes (NVIDIA) "
              "or spilled VGPRs/SGPRs (AMD); stack/scratch = stack frame bytes (NVIDIA) or scratch bytes per "
              "lane (AMD); fits = shared/LDS within what a block may use on the target (sm90 227 KiB, gfx942 "
              "64 KiB, gfx950 160 KiB); occ = waves per SIMD (AMD); mma = matrix instructions found (wgmma, "
              "mma.sync, v_mfma); TMA = TMA copies in the code.",
              "",
              "| kernel | variant | target | ok | regs/VGPRs | AGPRs | SGPRs | shared/LDS B | fits | spills | "
              "stack/scratch B | occ | mma | TMA | warps/stages |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["status"] == "off":
            lines.append(f"| {r['kernel']} | {r['variant']} | {r['target']} | off | " + " | ".join(["-"] * 11) + " |")
            continue
        if r["status"] == "error":
            lines.append(f"| {r['kernel']} | {r['variant']} | {r['target']} | **FAILED** | "
                         + " | ".join(["-"] * 11) + " |")
            continue
        if r["target"].startswith("gfx"):
            spills = f"v{_cell(r.get('vgpr_spills'))}/s{_cell(r.get('sgpr_spills'))}"
        else:
            spills = f"{_cell(r.get('spill_bytes'))}"
        lines.append(
            f"| {r['kernel']} | {r['variant']} | {r['target']} | yes | {_cell(r.get('registers'))} | "
            f"{_cell(r.get('agprs'))} | {_cell(r.get('sgprs'))} | {_cell(r.get('shared_bytes'))} | "
            f"{_FITS[r.get('fits')]} | {spills} | "
            f"{_cell(r.get('stack_bytes'))} | {_cell(r.get('occupancy'))} | {_cell(r.get('mma'))} | "
            f"{'yes' if r.get('tma_load') else 'no'} | {r['num_warps']}/{r['num_stages']} |")
    lines += ["", "## Variants", ""]
    for k, name in keys:
        v = find(k, name)
        lines.append(f"* `{k}/{name}`" + (f": {v.note}" if v.note else ""))
    if off:
        lines += ["", "## Switched off", ""]
        seen = set()
        for r in off:
            key = (r["kernel"], r["variant"], r["reason"])
            if key in seen:
                continue
            seen.add(key)
            where = ", ".join(x["target"] for x in off if (x["kernel"], x["variant"], x["reason"]) == key)
            lines.append(f"* `{r['kernel']}/{r['variant']}` on {where}: {r['reason']}")
    if bad:
        lines += ["", "## Failed", ""]
        lines += [f"* `{r['kernel']}/{r['variant']}` on {r['target']}: {r['error']}" for r in bad]
    if notes:
        lines += ["", "## Findings", ""]
        lines += [f"* {n}" for n in notes]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    """``python -m numasched.portability``: compile the variants, print the Markdown table, write --out."""
    ap = argparse.ArgumentParser(prog="python -m numasched.portability", description=__doc__.split("\n\n")[0])
    ap.add_argument("--targets", default=",".join(TARGETS), help="comma-separated targets (default %(default)s)")
    ap.add_argument("--kernels", default=None, help="comma-separated kernel families or family/variant keys "
                    f"(default all: {', '.join(dict.fromkeys(v.kernel for v in VARIANTS))})")
    ap.add_argument("--out", default=None, help="also write the Markdown to this file")
    ap.add_argument("--preamble", default="", help="text put under the title")
    ap.add_argument("--json", default=None, help="also write the rows as JSON to this file")
    ap.add_argument("--no-findings", action="store_true", help="skip the Findings section (and its extra compiles)")
    ap.add_argument("--quiet", action="store_true", help="no per-compile progress on stderr")
    args = ap.parse_args(argv)
    targets = [t.strip() for t in args.targets.split(",") if t.strip()]
    try:
        for t in targets:
            parse_target(t)
    except ValueError as e:
        ap.error(str(e))
    kernels = [k.strip() for k in args.kernels.split(",")] if args.kernels else None
    if kernels is not None and not variants(kernels):
        ap.error(f"--kernels {args.kernels}: no such kernel family or variant")
    if os.environ.get("TRITON_INTERPRET") == "1":  # kernels would be interpreter objects: re-run without it
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        return subprocess.call([sys.executable, "-m", "numasched.portability", *(argv if argv is not None
                                                                                else sys.argv[1:])], env=env)

    def show(r):
        if not args.quiet:
            print(f"{r['kernel']}/{r['variant']} {r['target']}: {r['status']}"
                  + (f" ({r.get('compile_s')} s)" if r["status"] == "ok" else ""), file=sys.stderr, flush=True)

    rows = report(targets, kernels, progress=show)
    text = markdown(rows, preamble=args.preamble, notes=() if args.no_findings else findings(rows))
    print(text, end="")
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    if args.json:
        import json

        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 1 if any(r["status"] == "error" for r in rows) else 0


if __name__ == "__main__":
    raise SystemExit(main())
