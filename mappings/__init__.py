"""numasched.mappings: program-id -> work-item policies, as NumPy reference math and Triton device functions.

    >>> from numasched import mappings
    >>> mappings.available("attention")
    >>> p = mappings.get("swizzled_head_first")
    >>> p.reference(range(8), mappings.AttentionGrid(1, 8, 8, 4), num_domains=8)

Adding a policy: one new file in this folder that calls :func:`register`, and an import below.
The property tests (tests/test_mappings.py) iterate over the registry.
"""
from ._registry import (  # noqa: F401
    KINDS, KERNEL_KINDS, AttentionGrid, DecodeGrid, GemmGrid, LinearGrid, Order, Policy, Remap,
    auto, available, compose, default_policy, get, get_default, lookup, positive_int, register, resolve, set_default,
)
from . import remap, attention, gemm  # noqa: F401,E402  (registers the built-in policies)
from .remap import identity_remap, contiguous_remap, chunked_remap  # noqa: F401,E402
from ._device import device_map  # noqa: F401,E402
