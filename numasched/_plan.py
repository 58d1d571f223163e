"""What every op's plan shares: the plan cache, its typed key, tensor signatures, the base class.

Every public operation follows one pattern (docs/api.md):

    check(...)    pure checks of shapes, dtypes and arguments; works on fake and meta tensors
    plan(...)     a frozen plan: policy, topology, kernel config, grid, workspace sizes
    plan.run(...) launches; nothing else

and a one-call wrapper (``numasched.flash_decode`` ...) that looks its plan up in :data:`PLANS`
by a key built from the call's tensors and arguments and the process state a plan depends on
(topology, registered mappings, options). Keys hold values, never object ids or environment
variables. A key is a flat tuple (it is built on every call, and a flat tuple is the cheapest to
build and hash): the op's name, each tensor's (shape, strides, dtype, device, data pointer mod 16),
the call's other arguments, then :func:`state` -- :class:`PlanKey` names that layout.
"""
from __future__ import annotations

import collections
from typing import Any, NamedTuple, Optional

import torch

from . import mappings as _mappings
from . import options as _options
from . import topology as _topology

__all__ = ["PlanKey", "PlanCache", "PLANS", "Plan", "signature", "state", "TensorSig"]


class TensorSig(NamedTuple):
    """What a plan depends on of one tensor (Triton specialises on all of it)."""

    shape: tuple
    stride: tuple
    dtype: torch.dtype
    device: torch.device
    aligned: bool  # data pointer a multiple of 16 bytes

    def describe(self) -> str:
        return f"{tuple(self.shape)} {str(self.dtype).replace('torch.', '')} strides {tuple(self.stride)} on {self.device}"


def _aligned(t: torch.Tensor) -> bool:
    try:
        return t.data_ptr() % 16 == 0
    except RuntimeError:  # fake or functional tensors have no data: plan for aligned memory
        return True


def signature(t: Optional[torch.Tensor]) -> Optional[TensorSig]:
    """The :class:`TensorSig` of a tensor (None for None)."""
    if t is None:
        return None
    return TensorSig(t.shape, t.stride(), t.dtype, t.device, _aligned(t))


def fast_signature(t):
    """:func:`signature` as a plain tuple (the one-call paths build keys with it: cheaper).
    Raises for tensors without data (fake tensors); callers then take the checked path."""
    if t is None:
        return None
    return (t.shape, t.stride(), t.dtype, t.device, t.data_ptr() % 16 == 0)


def state() -> tuple:
    """The process state plans depend on: topology, the mapping registry's version, options."""
    return (_topology.current(), _mappings.version(), _options.current())


_REG = _mappings._registry


class PlanKey(NamedTuple):
    """The parts of a plan cache key: op name, tensor signatures, the call's other arguments,
    process state. The one-call paths build the same fields as one flat tuple (op name first)."""

    op: str
    tensors: tuple
    args: tuple
    state: tuple


class PlanCache:
    """A bounded least-recently-used map from :class:`PlanKey` to plan."""

    def __init__(self, maxsize: int = 4096):
        if maxsize < 1:
            raise ValueError(f"maxsize must be >= 1, got {maxsize}")
        self.maxsize = maxsize
        self._d: "collections.OrderedDict[Any, Any]" = collections.OrderedDict()
        self.hits = 0
        self.misses = 0

    def get(self, key):
        p = self._d.get(key)
        if p is None:
            self.misses += 1
            return None
        self.hits += 1
        self._d.move_to_end(key)
        return p

    def find(self, key_of, *args):
        """``(key, plan)`` for a call: ``key_of(*args)`` builds the key; a call whose arguments
        cannot make one (fake tensors have no data pointer; wrong types, which the checked path
        then names) gets ``(None, None)``."""
        try:
            key = key_of(*args)
        except (AttributeError, RuntimeError, TypeError):
            return None, None
        return key, self.get(key)

    def put(self, key, plan) -> None:
        self._d[key] = plan
        self._d.move_to_end(key)
        while len(self._d) > self.maxsize:
            self._d.popitem(last=False)

    def clear(self) -> None:
        self._d.clear()
        self.hits = self.misses = 0

    def __len__(self) -> int:
        return len(self._d)

    def __contains__(self, key) -> bool:
        return key in self._d

    def plans(self, op: Optional[str] = None) -> list:
        """The cached plans (of one op)."""
        return [p for k, p in self._d.items() if op is None or k[0] == op]


#: The one plan cache of the one-call APIs (numasched.flash_decode, matmul, attention, ...).
PLANS = PlanCache(4096)


class Plan:
    """Base of the ops' plans.

    A plan is made by the op's planning call and is frozen: its public attributes describe the
    launch (``policy``, ``topology``, ``grid``, ``config``, ``workspace_bytes``) and ``run``
    launches on tensors with the signatures it was made for (``tensors``: name -> TensorSig).
    """

    op: str = ""
    _frozen = False

    def __setattr__(self, name, value):
        if self._frozen and not name.startswith("_"):
            raise AttributeError(f"{type(self).__name__} is frozen (make a new plan instead)")
        object.__setattr__(self, name, value)

    def _freeze(self) -> None:
        object.__setattr__(self, "_frozen", True)

    def check_signatures(self, **tensors) -> None:
        """Raise ValueError naming the first tensor whose signature differs from the plan's."""
        want = self.tensors
        for name, t in tensors.items():
            w = want.get(name)
            if w is None:
                if t is not None:
                    raise ValueError(f"{self.op} plan: {name} was None when the plan was made; make a new plan")
                continue
            if t is None:
                raise ValueError(f"{self.op} plan: {name} is missing (the plan was made with {w.describe()})")
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{self.op} plan: {name} must be a torch.Tensor, got {type(t).__name__}")
            if t.shape != w.shape or t.stride() != w.stride or t.dtype != w.dtype or t.device != w.device:
                raise ValueError(f"{self.op} plan: {name} is {signature(t).describe()} but the plan was made for "
                                 f"{w.describe()}; make a new plan (numasched.plan_*) for it")
            if w.aligned and not _aligned(t):
                raise ValueError(f"{self.op} plan: {name}'s data pointer is not 16-byte aligned, unlike the tensor "
                                 f"the plan was made for; make a new plan for it")
            if not w.aligned and _aligned(t):
                # the plan's kernels compile at their first call, for the alignment they see then:
                # a plan made for an unaligned tensor keeps to unaligned ones
                raise ValueError(f"{self.op} plan: {name}'s data pointer is 16-byte aligned, unlike the tensor the "
                                 f"plan was made for (its kernels may be compiled for either); make a new plan for it")

    def describe(self) -> dict:
        """The plan's public attributes as a dict (for printing and logging)."""
        return {k: getattr(self, k) for k in ("op", "policy", "topology", "grid", "config", "workspace_bytes")
                if hasattr(self, k)}

    def __repr__(self) -> str:
        d = self.describe()
        pol = d.get("policy")
        topo = d.get("topology")
        parts = [f"policy={getattr(pol, 'name', pol)!r}" if pol is not None else None,
                 f"topology={getattr(topo, 'name', topo)!r}" if topo is not None else None,
                 f"grid={d.get('grid')}", f"config={d.get('config')}",
                 f"workspace_bytes={d.get('workspace_bytes')}"]
        return f"{type(self).__name__}({', '.join(p for p in parts if p)})"


def upcast_like(t: torch.Tensor) -> torch.Tensor:
    """An fp32 copy of ``t`` with ``t``'s strides (``t.float()`` makes a non-dense view dense, so a
    plan's strides would no longer describe it): the interpreter's stand-in for its bf16 dot."""
    out = torch.empty_strided(t.size(), t.stride(), dtype=torch.float32, device=t.device)
    return out.copy_(t)


_SCRATCH: dict = {}


# Buffers replaced by a larger one are kept here for the life of the process: a CUDA graph
# captured earlier, or a plan's cached launch arguments, hold their addresses as plain integers,
# so freeing them would let a replay write into memory that now belongs to another tensor.
# Growth is geometric, so what is kept is at most about the size of the largest buffer.
_RETIRED: list = []


def grow_only(store: dict, key, numel: int, dtype: torch.dtype, device: torch.device, *, zero: bool = False,
              minimum: int = 0) -> torch.Tensor:
    """``store[key]``, replaced by one at least twice as large when it holds fewer than ``numel``
    elements; the replaced buffer is never freed (see ``_RETIRED``). ``zero``: new buffers start
    zeroed (arrival counters)."""
    buf = store.get(key)
    if buf is None or buf.numel() < numel:
        size = max(numel, minimum, 2 * buf.numel() if buf is not None else 0)
        if buf is not None:
            _RETIRED.append(buf)
        buf = store[key] = (torch.zeros if zero else torch.empty)(size, dtype=dtype, device=device)
    return buf


def scratch(shape: tuple, dtype: torch.dtype, device: torch.device, stream: int) -> torch.Tensor:
    """An output buffer nobody reads (e.g. the lse of a call that did not ask for it), reused by
    every launch on one stream (launches on a stream run in order) and made fresh while a CUDA
    graph is captured (the graph's memory pool owns it then)."""
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return torch.empty(shape, dtype=dtype, device=device)
    key = (shape, dtype, device, stream)
    t = _SCRATCH.get(key)
    if t is None:
        if len(_SCRATCH) >= 256:
            _SCRATCH.clear()
        t = _SCRATCH[key] = torch.empty(shape, dtype=dtype, device=device)
    return t
