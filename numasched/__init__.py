"""numasched: locality-aware scheduling for Triton attention and GEMM kernels.

CPU-only users can import this package: Triton kernels compile on first use, and Iris (the
distributed parts) is imported only by ``numasched.distributed``.

Public calls (imported lazily):
    numasched.scaled_dot_product_attention(q, k, v, ..., mapping="auto")
    numasched.flash_decode(q, k_cache, v_cache, ..., mapping="auto")
    numasched.matmul(a, b, mapping="auto")
"""
from . import mappings  # noqa: F401
from . import topology  # noqa: F401
from .topology import Topology, detect  # noqa: F401

__version__ = "0.1.0"

_LAZY = {
    "flash_decode": "numasched.decode",
    "scaled_dot_product_attention": "numasched.attention",
    "attention_forward": "numasched.attention",
    "matmul": "numasched.gemm",
    "sim": "numasched.sim",
    "distributed": "numasched.distributed",
}


def set_default_mapping(kernel_kind: str, mapping) -> None:
    """Process-wide default mapping for "attention", "decode" or "gemm" kernels (None/"auto" resets)."""
    mappings.set_default(kernel_kind, mapping)


def __getattr__(name):
    if name in _LAZY:
        import importlib

        mod = importlib.import_module(_LAZY[name])
        value = mod if mod.__name__.endswith(name) else getattr(mod, name)
        globals()[name] = value  # later lookups skip this hook (an import_module per call otherwise)
        return value
    raise AttributeError(f"module 'numasched' has no attribute {name!r}")
