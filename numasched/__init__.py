"""numasched: locality-aware scheduling for Triton attention and GEMM kernels.

CPU-only users can import this package: Triton kernels compile on first use, and Iris (the
distributed parts) is imported only by ``numasched.distributed``.
"""
from .topology import Topology, detect  # noqa: F401
from . import topology  # noqa: F401
from . import mappings  # noqa: F401

__version__ = "0.1.0"
