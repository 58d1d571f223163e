"""``numasched.matmul``: C = A @ B through the policy-driven Triton GEMM (numasched.kernels.gemm).

    >>> import numasched
    >>> c = numasched.matmul(a, b)                          # policy from topology ("auto")
    >>> c = numasched.matmul(a, b, mapping="row_major", persistent=True)
    >>> numasched.matmul(a, b, out=c)                       # writes into c, returns c

Registered as the torch custom ops ``numasched::matmul`` (functional, with a backward) and
``numasched::matmul_out`` (writes ``out``), each with a fake implementation, so the call works
under ``torch.compile`` (fullgraph) and inside CUDA graphs. Plain eager calls skip the op
dispatcher (its Python overhead is as long as a small GEMM) unless autograd needs the op. The first call at a new shape on a GPU
autotunes (a few seconds); make it before capturing a CUDA graph.

Where no Triton kernel can run (CPU tensors without ``TRITON_INTERPRET=1``, or another device)
the call falls back to ``torch.matmul`` with a one-time warning.
"""
from __future__ import annotations

import warnings
from typing import Optional, Union

import torch

from . import mappings as M
from . import topology as _topology
from .mappings import default_policy as _default_policy
from ._validate import INT32_MAX, check_same, check_tensor, kernel_device_ok, launch_device

__all__ = ["matmul", "SUPPORTED_DTYPES"]

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_warned_fallback = False


def _check_inputs(a: torch.Tensor, b: torch.Tensor, out: Optional[torch.Tensor] = None) -> None:
    """Shape/dtype/device checks (also run by the fake implementations, i.e. at trace time)."""
    for name, t in (("a", a), ("b", b)):
        check_tensor(name, t, dtypes=SUPPORTED_DTYPES)
        if t.dim() != 2:
            raise ValueError(f"{name} must be a 2-D matrix, got shape {tuple(t.shape)} "
                             f"(batched inputs are not supported: loop or reshape to 2-D)")
    check_same("a", a, "b", b)
    if a.shape[1] != b.shape[0]:
        raise ValueError(f"inner dimensions differ: a is {tuple(a.shape)} and b is {tuple(b.shape)} "
                         f"(a.shape[1] must equal b.shape[0])")
    for name, size in (("M (a.shape[0])", a.shape[0]), ("K (a.shape[1])", a.shape[1]), ("N (b.shape[1])", b.shape[1])):
        if size > INT32_MAX:
            raise ValueError(f"{name} = {size} overflows int32; split the call")
    if out is not None:
        check_tensor("out", out, ndim=2)
        check_same("a", a, "out", out)
        want = (a.shape[0], b.shape[1])
        if tuple(out.shape) != want:
            raise ValueError(f"out has shape {tuple(out.shape)}, expected {want} for a {tuple(a.shape)} @ b {tuple(b.shape)}")


def _check_no_overlap(a, b, out) -> None:
    if out is None:
        return
    # an expanded out (stride 0) has elements that share memory: the tiles would race on them
    if any(st == 0 and n > 1 for n, st in zip(out.shape, out.stride())):
        raise ValueError(f"out has stride 0 in a dimension of size > 1 (shape {tuple(out.shape)}, strides "
                         f"{out.stride()}): several elements share memory; pass a tensor without expanded dims")
    lo, hi = out.data_ptr(), out.data_ptr() + max(out.numel(), 1) * out.element_size()
    for name, t in (("a", a), ("b", b)):
        if t.numel() and out.numel():
            tlo = t.data_ptr()
            thi = tlo + t.numel() * t.element_size()
            if t.untyped_storage().data_ptr() == out.untyped_storage().data_ptr() and tlo < hi and lo < thi:
                raise ValueError(f"out shares memory with {name}; pass a separate output tensor")


_POLICIES: dict = {}  # (mapping, M, N, topology, default) -> resolved policy, to skip resolve() per call


def _policy_for(mapping: Union[str, "M.Policy"], M_: int, N_: int, block_m: int = 128, block_n: int = 128):
    topo = _topology.current()
    default = _default_policy("gemm")
    key = None
    if type(mapping) is str:  # a Policy object is resolved each time (its id could be reused)
        # the registered object's id too: register(..., replace=True) can swap the policy behind a name
        registered = M.lookup(mapping)
        key = (mapping, M_, N_, block_m, block_n, id(topo), id(default), id(registered))
        hit = _POLICIES.get(key)
        if hit is not None:
            return hit[0], hit[1]
    grid = M.GemmGrid(max(1, -(-M_ // block_m)), max(1, -(-N_ // block_n)))
    policy = M.resolve(mapping, "gemm", topo, grid)
    if key is not None:
        if len(_POLICIES) >= 4096:
            _POLICIES.clear()
        _POLICIES[key] = (policy, topo.num_domains, topo, default, registered)  # keeps the keyed objects (ids) alive
    return policy, topo.num_domains


def _fallback(a, b, out):
    global _warned_fallback
    if not _warned_fallback:
        _warned_fallback = True
        warnings.warn(f"numasched.matmul: no Triton kernel can run on {a.device} (CPU tensors need "
                      f"TRITON_INTERPRET=1 set before triton is imported); using torch.matmul", RuntimeWarning,
                      stacklevel=3)
    if out is None:
        return torch.matmul(a, b)
    return out.copy_(torch.matmul(a, b))


def _run(a, b, out, mapping, persistent, **launch_kw):
    """Eager implementation shared by both custom ops (and by calls with an unregistered Policy)."""
    _check_inputs(a, b, out)
    _check_no_overlap(a, b, out)
    if not kernel_device_ok(a):
        return _fallback(a, b, out)
    Mdim, K = a.shape
    N = b.shape[1]
    if out is None:
        out = torch.empty((Mdim, N), dtype=a.dtype, device=a.device)
    if Mdim == 0 or N == 0:
        return out
    if K == 0:
        return out.zero_()
    from .kernels import gemm as _kernels

    policy, num_domains = _policy_for(mapping, Mdim, N)
    with launch_device(a):
        _kernels.launch(a, b, out, policy, num_domains, persistent=persistent, **launch_kw)
    return out


# ----------------------------------------------------------------------------------- custom ops
@torch.library.custom_op("numasched::matmul", mutates_args=())
def _matmul_op(a: torch.Tensor, b: torch.Tensor, mapping: str, persistent: Optional[bool]) -> torch.Tensor:
    return _run(a, b, None, mapping, persistent)


@_matmul_op.register_fake
def _matmul_fake(a, b, mapping, persistent):
    _check_inputs(a, b)
    return a.new_empty((a.shape[0], b.shape[1]))


def _setup_context(ctx, inputs, output):
    a, b, mapping, persistent = inputs
    ctx.save_for_backward(a, b)
    ctx.mapping, ctx.persistent = mapping, persistent


def _backward(ctx, grad):
    # dA = dC @ B^T and dB = A^T @ dC: transposed views, which the kernel reads without copies.
    a, b = ctx.saved_tensors
    ga = gb = None
    if ctx.needs_input_grad[0]:
        ga = torch.ops.numasched.matmul(grad, b.T, ctx.mapping, ctx.persistent)
    if ctx.needs_input_grad[1]:
        gb = torch.ops.numasched.matmul(a.T, grad, ctx.mapping, ctx.persistent)
    return ga, gb, None, None


_matmul_op.register_autograd(_backward, setup_context=_setup_context)


@torch.library.custom_op("numasched::matmul_out", mutates_args=("out",))
def _matmul_out_op(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, mapping: str,
                   persistent: Optional[bool]) -> None:
    _run(a, b, out, mapping, persistent)


@_matmul_out_op.register_fake
def _matmul_out_fake(a, b, out, mapping, persistent):
    _check_inputs(a, b, out)


# ----------------------------------------------------------------------------------- public call
def matmul(a: torch.Tensor, b: torch.Tensor, *, mapping: Union[str, "M.Policy"] = "auto",
           persistent: Optional[bool] = None, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``a @ b`` for 2-D fp16/bf16/fp32 matrices with fp32 accumulation (output in the input dtype).

    Args:
        a: (M, K) matrix; any strides (a transposed view is read without a copy).
        b: (K, N) matrix of the same dtype and device; any strides.
        mapping: "auto" (the topology's choice, or the default set with
            ``numasched.set_default_mapping("gemm", ...)``), a GEMM policy name from
            ``numasched.mappings.available("gemm")`` (grouped, chiplet_tiled, row_major,
            chiplet_tiled_chunked, ...) or a ``Policy``.
        persistent: True runs about one program per SM looping over tiles, False one program per
            tile, None lets the autotuner (GPU) or a tile-count heuristic (interpreter) choose.
        out: optional (M, N) output of a's dtype and device (any strides, not overlapping a or b).

    fp32 inputs use IEEE fp32 products unless ``torch.set_float32_matmul_precision`` allows TF32.
    """
    for name, t in (("a", a), ("b", b)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if out is not None and not isinstance(out, torch.Tensor):
        raise TypeError(f"out must be a torch.Tensor or None, got {type(out).__name__}")
    if out is not None and torch.is_grad_enabled() and (a.requires_grad or b.requires_grad or out.requires_grad):
        # as torch.matmul: the out= form records no autograd graph, so a gradient would be silently lost
        raise RuntimeError("matmul(..., out=...) does not support automatic differentiation, but an argument "
                           "requires grad; drop out= or run under torch.no_grad()")
    if persistent is not None and not isinstance(persistent, bool):
        raise TypeError(f"persistent must be True, False or None, got {persistent!r}")
    if isinstance(mapping, M.Policy):
        try:
            registered = M.get(mapping.name) is mapping
        except ValueError:
            registered = False
        if not registered:
            # An ad-hoc Policy cannot travel through an op schema: run eagerly.
            return _run(a, b, out, mapping, persistent)
        mapping = mapping.name
    elif not isinstance(mapping, str):
        raise TypeError(f"mapping must be 'auto', a policy name or a Policy, got {type(mapping).__name__}")
    if out is None:
        if torch.compiler.is_compiling() or (torch.is_grad_enabled() and (a.requires_grad or b.requires_grad)):
            return torch.ops.numasched.matmul(a, b, mapping, persistent)
    elif torch.compiler.is_compiling():
        torch.ops.numasched.matmul_out(a, b, out, mapping, persistent)
        return out
    # Plain eager call: skip the custom-op dispatcher (tens of microseconds of Python per call,
    # as much as a 2048^3 GEMM takes on an H200); the ops above serve torch.compile and autograd.
    return _run(a, b, out, mapping, persistent)
