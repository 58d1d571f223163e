"""numasched.mappings: program-id -> work-item policies, as NumPy reference math and Triton device functions.

    >>> from numasched import mappings
    >>> mappings.available("attention")
    >>> p = mappings.get("swizzled_head_first")
    >>> p.reference(range(8), mappings.AttentionGrid(1, 8, 8, 4), num_domains=8)

In a Triton kernel of your own (docs/mappings.md, examples/)::

    from numasched.mappings.jit import gemm_tile
    tm, tn = gemm_tile(tl.program_id(0), tiles_m, tiles_n, MAPPING)     # MAPPING: tl.constexpr
    ... kernel[grid](..., MAPPING=mappings.kernel_arg("grouped", "gemm"))

Adding a policy: one new file in this folder that calls :func:`register`, and an import below.
The property tests (tests/test_mappings.py) iterate over the registry.
"""
from ._registry import (  # noqa: F401
    KINDS, KERNEL_KINDS, AttentionGrid, DecodeGrid, GemmGrid, LinearGrid, Order, Policy, Remap,
    auto, available, check_kind, compose, default_policy, from_token, get, get_default, kernel_arg, lookup,
    positive_int, register, register_auto, resolve, set_default, token, unregister_auto, version,
)
from . import remap, attention, gemm  # noqa: F401,E402  (registers the built-in policies)
# the building blocks, for kernels that compose them directly
from .remap import identity_remap, contiguous_remap, chunked_remap  # noqa: F401,E402
from .attention import block_first_order, head_first_order, swizzled_block_first_order  # noqa: F401,E402
from .gemm import grouped_order, row_major_order, split_units_reference, streamk_units_reference  # noqa: F401,E402
from .jit import attention_item, decode_item, gemm_split_unit, gemm_tile, remap_pid  # noqa: F401,E402
from ._device import device_map  # noqa: F401,E402
