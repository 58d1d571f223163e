"""Run a policy's device functions over every program id (tests and users checking a policy).

One tiny Triton kernel per kind maps every id through the public device helpers of
:mod:`numasched.mappings.jit` (which numasched's own kernels use too), so comparing its output with
``Policy.reference`` checks the device math id for id.
"""
import numpy as np
import torch
import triton
import triton.language as tl

from ._registry import check_num_domains, get
from .jit import attention_item, gemm_tile, remap_pid


@triton.jit
def _attention_map_kernel(out, W, B, H, HK, NB, MAPPING: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = pid < W
    b, h, m = attention_item(pid, B, H, HK, NB, MAPPING)
    tl.store(out + pid * 3 + 0, b, mask=mask)
    tl.store(out + pid * 3 + 1, h, mask=mask)
    tl.store(out + pid * 3 + 2, m, mask=mask)


@triton.jit
def _gemm_map_kernel(out, W, NM, NN, MAPPING: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = pid < W
    tm, tn = gemm_tile(pid, NM, NN, MAPPING)
    tl.store(out + pid * 2 + 0, tm, mask=mask)
    tl.store(out + pid * 2 + 1, tn, mask=mask)


@triton.jit
def _remap_kernel(out, W, MAPPING: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out + pid, remap_pid(pid, W, MAPPING), mask=pid < W)


def device_map(policy, grid, num_domains: int, device="cpu") -> np.ndarray:
    """Work item of every program id 0..W-1 computed by the policy's Triton device functions.

    On CPU this needs ``TRITON_INTERPRET=1`` set before triton is imported.
    ``policy`` is a Policy or a registered name.
    """
    policy = get(policy)
    policy.check_grid(grid)
    X = check_num_domains(num_domains)
    W = grid.size
    k = {"attention": 3, "gemm": 2, "remap": 1}[policy.kind]
    out = torch.full((W, k), -7, dtype=torch.int32, device=device)  # poison: -7 is no valid item
    BLOCK = 128
    launch = (triton.cdiv(W, BLOCK),)
    kernel = {"attention": _attention_map_kernel, "gemm": _gemm_map_kernel, "remap": _remap_kernel}[policy.kind]
    args = (out, W, *grid.dims) if policy.kind != "remap" else (out, W)
    kw = dict(MAPPING=policy.constexpr(X), BLOCK=BLOCK)
    if device == "cpu" or getattr(device, "type", None) == "cpu":
        from numasched.caps import run_interpreted   # works whenever TRITON_INTERPRET was set

        run_interpreted(kernel, launch, args, kw)
    else:
        kernel[launch](*args, **kw)
    return out.cpu().numpy().astype(np.int64)
