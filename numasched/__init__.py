"""numasched: locality-aware scheduling for Triton attention and GEMM kernels.

Every operation has one shape: a pure check, a frozen plan from a public planning call, and a
``run`` that only launches; the one-call form looks its plan up in a bounded cache.

    numasched.flash_decode(q, k_cache, v_cache, ...)          plan_decode(...).run(...)
    (ragged batches)                                          plan_decode_worklist(...).run(...)
    numasched.scaled_dot_product_attention(q, k, v, ...)      (torch's signature)
    numasched.attention_forward(q, k, v, ...)                 plan_attention(...).run(...)
    numasched.matmul(a, b, ...)                               plan_matmul(...).run(...)
    (a weight whose rows straddle cache lines)                prepare_weight(w) once, then matmul(x, w.T)
    numasched.matmul_swiglu(x, w_gate_up.T)                   plan_matmul_swiglu(...).run(...)
    numasched.swiglu(gate_up)                                 plan_swiglu(...).run(...)
    numasched.qkv_rope_cache(qkv, cos, sin, k_cache, ...)     plan_qkv_rope_cache(...).run(...)

CPU-only users can import this package: Triton kernels compile on first use, and Iris (the
distributed parts) is imported only by ``numasched.distributed``. The public calls and
submodules below are imported on first use.
"""
from . import mappings  # noqa: F401
from . import topology  # noqa: F401
from . import options  # noqa: F401
from . import observe  # noqa: F401
from .topology import Topology, detect  # noqa: F401

__version__ = "0.2.0"

# name -> module that defines it (a module itself when the name is the module's last part)
_LAZY = {
    "flash_decode": "numasched.decode",
    "plan_decode": "numasched.decode",
    "DecodePlan": "numasched.decode",
    "plan_decode_worklist": "numasched.decode_worklist",
    "DecodeWorklistPlan": "numasched.decode_worklist",
    "scaled_dot_product_attention": "numasched.attention",
    "attention_forward": "numasched.attention",
    "plan_attention": "numasched.attention",
    "AttentionPlan": "numasched.attention",
    "matmul": "numasched.gemm",
    "plan_matmul": "numasched.gemm",
    "GemmPlan": "numasched.gemm",
    "prepare_weight": "numasched.gemm",
    "PerformanceWarning": "numasched.gemm",
    "matmul_swiglu": "numasched.gemm_glu",
    "plan_matmul_swiglu": "numasched.gemm_glu",
    "swiglu": "numasched.gemm_glu",
    "plan_swiglu": "numasched.gemm_glu",
    "SwiGLUPlan": "numasched.gemm_glu",
    "gemm_glu": "numasched.gemm_glu",
    "qkv_rope_cache": "numasched.rope_cache",
    "plan_qkv_rope_cache": "numasched.rope_cache",
    "RopeCachePlan": "numasched.rope_cache",
    "rope_cache": "numasched.rope_cache",
    "decode": "numasched.decode",
    "decode_worklist": "numasched.decode_worklist",
    "attention": "numasched.attention",
    "gemm": "numasched.gemm",
    "caps": "numasched.caps",
    "hf": "numasched.hf",
    "sim": "numasched.sim",
    "probe": "numasched.probe",
    "distributed": "numasched.distributed",
    "portability": "numasched.portability",
}

__all__ = sorted(["mappings", "topology", "options", "observe", "Topology", "detect", "set_default_mapping",
                  "__version__", *_LAZY])


def set_default_mapping(kernel_kind: str, mapping) -> None:
    """Process-wide default mapping for "attention", "decode" or "gemm" kernels (None/"auto" resets)."""
    mappings.set_default(kernel_kind, mapping)


def __getattr__(name):
    if name in _LAZY:
        import importlib

        mod = importlib.import_module(_LAZY[name])
        value = mod if mod.__name__.rsplit(".", 1)[-1] == name else getattr(mod, name)
        globals()[name] = value  # later lookups skip this hook (an import_module per call otherwise)
        return value
    raise AttributeError(f"module 'numasched' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_LAZY))
