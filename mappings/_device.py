"""Run a policy's device functions over every program id (tests and users checking a policy).

One tiny Triton kernel per kind applies REMAP then ORDER exactly as numasched's kernels do, so
comparing its output with ``Policy.reference`` checks the device math id for id.
"""
import numpy as np
import torch
import triton
import triton.language as tl

from ._registry import check_num_domains, get


@triton.jit
def _attention_map_kernel(out, W, B, H, HK, NB, REMAP: tl.constexpr, REMAP_PARAM: tl.constexpr,
                          ORDER: tl.constexpr, ORDER_PARAM: tl.constexpr, NUM_DOMAINS: tl.constexpr,
                          BLOCK: tl.constexpr):
    pid = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = pid < W
    g = REMAP(pid, W, NUM_DOMAINS, REMAP_PARAM)
    b, h, m = ORDER(g, B, H, HK, NB, NUM_DOMAINS, ORDER_PARAM)
    tl.store(out + pid * 3 + 0, b, mask=mask)
    tl.store(out + pid * 3 + 1, h, mask=mask)
    tl.store(out + pid * 3 + 2, m, mask=mask)


@triton.jit
def _gemm_map_kernel(out, W, NM, NN, REMAP: tl.constexpr, REMAP_PARAM: tl.constexpr,
                     ORDER: tl.constexpr, ORDER_PARAM: tl.constexpr, NUM_DOMAINS: tl.constexpr,
                     BLOCK: tl.constexpr):
    pid = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = pid < W
    g = REMAP(pid, W, NUM_DOMAINS, REMAP_PARAM)
    tm, tn = ORDER(g, NM, NN, NUM_DOMAINS, ORDER_PARAM)
    tl.store(out + pid * 2 + 0, tm, mask=mask)
    tl.store(out + pid * 2 + 1, tn, mask=mask)


@triton.jit
def _remap_kernel(out, W, REMAP: tl.constexpr, REMAP_PARAM: tl.constexpr, NUM_DOMAINS: tl.constexpr,
                  BLOCK: tl.constexpr):
    pid = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out + pid, REMAP(pid, W, NUM_DOMAINS, REMAP_PARAM), mask=pid < W)


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
    args = policy.kernel_args(X)
    if policy.kind == "attention":
        _attention_map_kernel[launch](out, W, *grid.dims, BLOCK=BLOCK, **args)
    elif policy.kind == "gemm":
        _gemm_map_kernel[launch](out, W, *grid.dims, BLOCK=BLOCK, **args)
    else:
        _remap_kernel[launch](out, W, BLOCK=BLOCK, **args)
    return out.cpu().numpy().astype(np.int64)
