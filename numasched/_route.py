"""One routing helper for every op: eager call, torch custom op, or torch fallback; and warnings.

* :func:`plain_eager`: a call that can skip the custom-op dispatcher (its Python costs as much as
  a small kernel) -- not compiling, plain tensors, no dispatch mode, no autograd to record.
  Everything else goes through the op's ``torch.library`` custom op (torch.compile, fake and
  subclass tensors, tracing, autograd).
* :func:`mapping_token` / :func:`numasched.mappings.from_token`: a custom op takes strings only;
  a Policy object (also an unregistered, composed one) travels as a token.
* :func:`warn_once`: each distinct message once per process, attributed to the caller's line
  (the first frame outside numasched), so ``python -W error`` and warning filters point at user code.
"""
from __future__ import annotations

import os
import sys
import warnings

import torch

from . import mappings as _mappings

_PKG_DIRS = tuple(os.path.dirname(os.path.abspath(p)) + os.sep for p in (__file__, _mappings.__file__))


def plain_eager(*tensors) -> bool:
    """Whether a call on these tensors may run without the custom-op dispatcher."""
    if torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack() > 0:
        return False
    grad = torch.is_grad_enabled()
    for t in tensors:
        if t is None:
            continue
        if type(t) is not torch.Tensor:
            return False
        if grad and t.requires_grad:
            return False
    return True


def refuse_grad(name: str, *tensors) -> None:
    """An inference-only call (no backward) refuses inputs that require grad while autograd is on,
    naming itself, instead of returning an output whose backward would fail later."""
    if torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in tensors):
        raise RuntimeError(f"{name} has no backward (inference only); run it under torch.no_grad() or pass "
                           f"tensors that do not require grad")


def mapping_token(mapping, kernel_kind: str) -> str:
    """The string a custom op carries for a ``mapping=`` argument: "auto", a registered name, or
    a token for a Policy object (registered or not). Checks kind and name here, so errors name
    the argument before any tracing."""
    if mapping is None:  # None means "auto" in every call
        return "auto"
    if isinstance(mapping, str):
        if mapping == "auto":
            return mapping
        p = _mappings.get(mapping)  # unknown names raise ValueError naming the mapping
    elif isinstance(mapping, _mappings.Policy):
        p = mapping
    else:
        raise TypeError(f"mapping must be 'auto', a policy name or a Policy, got {type(mapping).__name__}")
    _mappings.check_kind(p, kernel_kind)
    return mapping if isinstance(mapping, str) else _mappings.token(p)


def _caller_stacklevel() -> int:
    """stacklevel of the first frame outside numasched (counted from warn_once's caller)."""
    f = sys._getframe(2)
    level = 2
    while f is not None and os.path.abspath(f.f_code.co_filename).startswith(_PKG_DIRS):
        f = f.f_back
        level += 1
    return level


_WARNED: set = set()


def warn_once(message: str, category=RuntimeWarning, *, key=None) -> None:
    """Warn with ``message`` the first time this ``key`` (default: the message) is seen."""
    k = (category, message if key is None else key)
    if k in _WARNED:
        return
    _WARNED.add(k)
    warnings.warn(message, category, stacklevel=_caller_stacklevel())


def reset_warnings() -> None:
    """Forget which warnings were given (tests)."""
    _WARNED.clear()
