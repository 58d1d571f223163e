"""Policy registry: grids, the Policy type, lookup, ``auto`` and per-kernel defaults.

A policy is a bijection from a linear program id (hardware dispatch order) to a work item.
It is made of two pieces that kernels compose, in the style of tritonBLAS's pid transforms:

* a *remap* ``g' = REMAP(g, W, NUM_DOMAINS, REMAP_PARAM)``, a bijection of [0, W) that
  reorders ids so that consecutive logical ids share a locality domain (identity if none);
* an *order* that turns the logical id into a work item:
    attention / decode: ``b, h, m = ORDER(g, B, H, HK, NB, NUM_DOMAINS, ORDER_PARAM)``
    gemm:               ``tm, tn = ORDER(g, NM, NN, NUM_DOMAINS, ORDER_PARAM)``.

Both exist twice with the same math: a vectorised NumPy reference and a ``@triton.jit`` device
function. Kernels receive the device functions as ``tl.constexpr`` arguments
(:meth:`Policy.kernel_args`), so one kernel serves every policy.

Decode uses the attention kind with ``AttentionGrid(batch, kv_heads, kv_heads, splits)``
(:func:`DecodeGrid`): its work item is (batch, kv_head, split).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Callable, Dict, Optional, Union

import numpy as np

KINDS = ("attention", "gemm", "remap")
KERNEL_KINDS = ("attention", "decode", "gemm")  # kinds a user sets defaults for
INT32_MAX = 2**31 - 1

# Bumped whenever what a name or "auto" resolves to may change (register, a new default, an auto
# rule): plan caches put it in their keys instead of the ids of registry objects.
_VERSION = [0]


def version() -> int:
    """A number that changes whenever a mapping name or "auto" may resolve differently."""
    return _VERSION[0]


def _bump() -> None:
    _VERSION[0] += 1


def _positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")
    return int(value)


positive_int = _positive_int  # public: other numasched modules validate sizes the same way


def check_num_domains(num_domains) -> int:
    X = _positive_int("num_domains", num_domains)
    if X > INT32_MAX:
        raise ValueError(f"num_domains = {X} overflows int32 (the kernels compute with it in 32 bits)")
    return X


def _as_pids(pids) -> np.ndarray:
    """Program ids as a flat int64 array; floats, bools and strings are refused (not truncated)."""
    a = np.asarray(pids)
    if a.size == 0:
        return a.astype(np.int64).reshape(-1)
    if a.dtype.kind not in "iu":
        raise ValueError(f"pids must be integers, got dtype {a.dtype}")
    return a.astype(np.int64).reshape(-1)


# --------------------------------------------------------------------------------------- grids
@dataclass(frozen=True)
class AttentionGrid:
    """Work items (batch, head, q_block): ``batch * heads * q_blocks`` programs.

    ``kv_heads`` must divide ``heads`` (GQA group = heads // kv_heads).
    """

    batch: int
    heads: int
    kv_heads: int
    q_blocks: int
    kind = "attention"

    def __post_init__(self):
        for f in ("batch", "heads", "kv_heads", "q_blocks"):
            _positive_int(f, getattr(self, f))
        if self.heads % self.kv_heads:
            raise ValueError(f"heads ({self.heads}) must be a multiple of kv_heads ({self.kv_heads})")
        if self.size > INT32_MAX:
            raise ValueError(f"AttentionGrid size {self.size} overflows int32 program ids")

    @property
    def size(self) -> int:
        return self.batch * self.heads * self.q_blocks

    @property
    def group(self) -> int:
        return self.heads // self.kv_heads

    @property
    def dims(self) -> tuple:
        return (self.batch, self.heads, self.kv_heads, self.q_blocks)

    @property
    def item_shape(self) -> tuple:
        return (self.batch, self.heads, self.q_blocks)


def DecodeGrid(batch: int, kv_heads: int, splits: int) -> AttentionGrid:
    """Flash Decode work items (batch, kv_head, split)."""
    for name, v in (("batch", batch), ("kv_heads", kv_heads), ("splits", splits)):
        _positive_int(name, v)  # errors name the decode arguments, not the attention fields
    return AttentionGrid(batch, kv_heads, kv_heads, splits)


@dataclass(frozen=True)
class GemmGrid:
    """Work items (tile_m, tile_n): ``tiles_m * tiles_n`` programs."""

    tiles_m: int
    tiles_n: int
    kind = "gemm"

    def __post_init__(self):
        _positive_int("tiles_m", self.tiles_m)
        _positive_int("tiles_n", self.tiles_n)
        if self.size > INT32_MAX:
            raise ValueError(f"GemmGrid size {self.size} overflows int32 program ids")

    @property
    def size(self) -> int:
        return self.tiles_m * self.tiles_n

    @property
    def dims(self) -> tuple:
        return (self.tiles_m, self.tiles_n)

    @property
    def item_shape(self) -> tuple:
        return (self.tiles_m, self.tiles_n)


@dataclass(frozen=True)
class LinearGrid:
    """Work items are ids 0..size-1 (what a remap permutes)."""

    size: int
    kind = "remap"

    def __post_init__(self):
        _positive_int("size", self.size)
        if self.size > INT32_MAX:
            raise ValueError(f"LinearGrid size {self.size} overflows int32 program ids")

    @property
    def dims(self) -> tuple:
        return (self.size,)

    @property
    def item_shape(self) -> tuple:
        return (self.size,)


Grid = Union[AttentionGrid, GemmGrid, LinearGrid]


# --------------------------------------------------------------------------------------- pieces
def _check_piece(piece) -> None:
    """A Remap's / Order's two halves must be there: a NumPy reference and a device function."""
    what = type(piece).__name__
    if not isinstance(piece.name, str) or not piece.name:
        raise ValueError(f"{what}.name must be a non-empty string, got {piece.name!r}")
    if not callable(piece.reference):
        raise ValueError(f"{what} {piece.name!r}: reference must be a NumPy function, got {piece.reference!r}")
    if piece.device is None:
        raise ValueError(f"{what} {piece.name!r}: device (its @triton.jit twin) is missing")


@dataclass(frozen=True)
class Remap:
    """A bijection of [0, W): NumPy ``reference(g, W, X, param)`` and device ``device(pid, W, X, PARAM)``."""

    name: str
    reference: Callable
    device: object
    default_param: int = 0
    doc: str = ""

    def __post_init__(self):
        _check_piece(self)


@dataclass(frozen=True)
class Order:
    """Logical id -> work item for one kind (see module doc for signatures)."""

    name: str
    kind: str
    reference: Callable
    device: object
    default_param: int = 0
    doc: str = ""

    def __post_init__(self):
        _check_piece(self)


@dataclass(frozen=True)
class Policy:
    """A registered mapping policy: ``order(remap(pid))``.

    For kind "remap" the policy is the remap alone (``order`` is None) and the work item is the
    remapped id.
    """

    name: str
    kind: str
    remap: Remap
    order: Optional[Order] = None
    remap_param: int = 0
    order_param: int = 0
    doc: str = ""

    def __post_init__(self):
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"Policy.name must be a non-empty string, got {self.name!r}")
        if self.kind not in KINDS:
            raise ValueError(f"Policy.kind must be one of {KINDS}, got {self.kind!r}")
        if not isinstance(self.remap, Remap):
            raise ValueError(f"policy {self.name!r}: remap must be a Remap, got {type(self.remap).__name__}")
        if self.order is not None and not isinstance(self.order, Order):
            raise ValueError(f"policy {self.name!r}: order must be an Order or None, got {type(self.order).__name__}")
        if self.kind == "remap" and self.order is not None:
            raise ValueError(f"policy {self.name!r} of kind 'remap' must have order=None")
        if self.kind != "remap" and (self.order is None or self.order.kind != self.kind):
            raise ValueError(f"policy {self.name!r} of kind {self.kind!r} needs an order of that kind")
        # A piece whose default parameter is >= 1 divides by it (chunk C, GROUP_M): 0 would be a
        # division by zero inside the kernel, so it is refused here, naming the parameter.
        for attr, piece in (("remap_param", self.remap), ("order_param", self.order)):
            v = getattr(self, attr)
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
                raise ValueError(f"policy {self.name!r}: {attr} must be an integer, got {v!r}")
            lo = 1 if piece is not None and piece.default_param >= 1 else 0
            if v < lo:
                raise ValueError(f"policy {self.name!r}: {attr} must be >= {lo}, got {v}")
        # Its token (see token()) is made now, not when a call first needs it: a call traced by
        # torch.compile must not write to the token table (the write would be deferred past the
        # custom op that reads it).
        object.__setattr__(self, "_token", _token_for(self))

    # -------------------------------------------------------------- host side
    def check_grid(self, grid) -> None:
        if getattr(grid, "kind", None) != self.kind:
            want = {"attention": "AttentionGrid", "gemm": "GemmGrid", "remap": "LinearGrid"}[self.kind]
            raise ValueError(
                f"mapping {self.name!r} is a {self.kind} policy and needs a {want}, got {type(grid).__name__}")

    def reference(self, pids, grid: Grid, num_domains: int) -> np.ndarray:
        """Work item of each program id: int64 array of shape (len(pids), k) (k=3, 2 or 1)."""
        self.check_grid(grid)
        X = check_num_domains(num_domains)
        g = _as_pids(pids)
        if g.size and (g.min() < 0 or g.max() >= grid.size):
            raise ValueError(f"pids must lie in [0, {grid.size}) for {grid}")
        g = np.asarray(self.remap.reference(g, grid.size, X, self.remap_param), dtype=np.int64)
        if self.order is None:
            return g.reshape(-1, 1)
        out = self.order.reference(g, grid, X, self.order_param)
        return np.asarray(out, dtype=np.int64).reshape(len(g), len(grid.item_shape))  # also for no pids

    def domains_of_items(self, grid: Grid, topology) -> np.ndarray:
        """Domain on which each work item runs, shaped ``grid.item_shape`` (under ``topology.dispatch``)."""
        if not hasattr(topology, "domain_of") or not hasattr(topology, "num_domains"):
            raise TypeError(f"topology must be a numasched.topology.Topology (e.g. Topology.preset('mi300x')), got "
                            f"{type(topology).__name__}")
        W = grid.size
        items = self.reference(np.arange(W), grid, topology.num_domains)
        dom = np.full(grid.item_shape, -1, dtype=np.int64)
        dom[tuple(items.T)] = topology.domain_of(np.arange(W))
        return dom

    def kernel_args(self, num_domains: int) -> Dict[str, object]:
        """The policy as five separate constexprs (REMAP, REMAP_PARAM, ORDER, ORDER_PARAM,
        NUM_DOMAINS), for kernels written against the building blocks directly."""
        X = check_num_domains(num_domains)
        args = dict(REMAP=self.remap.device, REMAP_PARAM=int(self.remap_param), NUM_DOMAINS=X)
        if self.order is not None:
            args.update(ORDER=self.order.device, ORDER_PARAM=int(self.order_param))
        return args

    def constexpr(self, num_domains: int) -> tuple:
        """The policy as ONE constexpr argument: ``(REMAP, REMAP_PARAM, ORDER, ORDER_PARAM,
        NUM_DOMAINS)``. A kernel takes it as ``MAPPING: tl.constexpr`` and maps a program id with
        the device helpers of :mod:`numasched.mappings.jit` (``gemm_tile``, ``attention_item``,
        ``decode_item``, ``remap_pid``). ORDER is None for a remap policy."""
        X = check_num_domains(num_domains)
        return (self.remap.device, int(self.remap_param), None if self.order is None else self.order.device,
                int(self.order_param), X)

    def __hash__(self):  # plan keys hash policies on every call: compute once
        h = self.__dict__.get("_hash")
        if h is None:
            h = hash((self.name, self.kind, self.remap, self.order, self.remap_param, self.order_param))
            object.__setattr__(self, "_hash", h)
        return h

    def with_params(self, *, remap_param: Optional[int] = None, order_param: Optional[int] = None) -> "Policy":
        kw = {}
        if remap_param is not None:
            kw["remap_param"] = _positive_int("remap_param", remap_param)
        if order_param is not None:
            kw["order_param"] = _positive_int("order_param", order_param)
        return dataclasses.replace(self, **kw)

    def __repr__(self) -> str:
        return f"Policy({self.name!r}, kind={self.kind!r})"


# --------------------------------------------------------------------------------------- registry
_REGISTRY: Dict[str, Policy] = {}


def register(policy: Policy, *, replace: bool = False) -> Policy:
    """Add a policy to the registry (the property tests then cover it)."""
    if not isinstance(policy, Policy):
        raise ValueError(f"register() needs a Policy, got {type(policy).__name__}")
    if policy.name in _REGISTRY and not replace:
        raise ValueError(f"a mapping named {policy.name!r} is already registered")
    if "#" in policy.name:
        raise ValueError(f"a registered mapping's name may not contain '#' (tokens use it): {policy.name!r}")
    _check_bijective(policy)
    _REGISTRY[policy.name] = policy
    _bump()
    return policy


# small grids a policy is tried on when registered (the property tests then cover many more)
_REGISTER_GRIDS = {"remap": lambda: [LinearGrid(n) for n in (1, 7, 24)],
                   "gemm": lambda: [GemmGrid(m, n) for m, n in ((1, 1), (3, 5), (8, 6))],
                   "attention": lambda: [AttentionGrid(2, 4, 2, 3), AttentionGrid(1, 1, 1, 5), DecodeGrid(2, 3, 4)]}


def _check_bijective(policy: "Policy") -> None:
    """Its NumPy reference must map the program ids of a few small grids onto their work items one
    to one (a wrong one would run some items twice and others never): checked before it is used."""
    for grid in _REGISTER_GRIDS[policy.kind]():
        for X in (1, 3, 8):
            try:
                items = policy.reference(np.arange(grid.size), grid, X)
            except Exception as e:   # a broken piece: named, with the grid it failed on
                raise ValueError(f"mapping {policy.name!r}: its reference failed on {grid}, {X} domains: "
                                 f"{type(e).__name__}: {e}") from None
            flat = np.ravel_multi_index(tuple(np.asarray(items).T), grid.item_shape) \
                if np.asarray(items).size and np.all((items >= 0) & (items < np.array(grid.item_shape))) else None
            if flat is None or not np.array_equal(np.sort(flat), np.arange(grid.size)):
                raise ValueError(f"mapping {policy.name!r} is not a bijection on {grid} with {X} domains: some "
                                 f"work items would run twice and others never")


def available(kind: Optional[str] = None) -> list:
    """Names of registered policies, optionally of one kind ("attention", "decode", "gemm", "remap")."""
    if kind is None:
        return sorted(_REGISTRY)
    k = _kind_of(kind)
    return sorted(n for n, p in _REGISTRY.items() if p.kind == k)


def get(name: str) -> Policy:
    """The registered policy called ``name`` (or the policy of a :func:`token`)."""
    if isinstance(name, Policy):
        return name
    if not isinstance(name, str):
        raise TypeError(f"mapping must be a policy name or a Policy, got {type(name).__name__}")
    p = _REGISTRY.get(name)
    if p is not None:
        return p
    if "#" in name:
        return from_token(name)
    raise ValueError(f"unknown mapping {name!r}; available: {available()}")


# --------------------------------------------------------------------------------------- tokens
# A torch custom op takes strings, not Policy objects. A Policy (say a composed one that was never
# registered) crosses the op boundary as a token "name#n"; tokens are per process and the table
# holds each distinct policy once (equal policies share a token), so it grows only with the
# number of distinct policies a program makes.
_TOKENS: Dict[str, Policy] = {}
_TOKEN_OF: Dict[Policy, str] = {}


def _token_for(policy: "Policy") -> str:
    t = _TOKEN_OF.get(policy)
    if t is None:
        t = f"{policy.name}#{len(_TOKENS)}"
        _TOKENS[t] = policy
        _TOKEN_OF[policy] = t
    return t


def token(policy: Policy) -> str:
    """A string that stands for ``policy`` in this process: its name if that is how it is
    registered, else ``"<name>#<n>"`` (what custom ops carry; equal policies share one)."""
    if not isinstance(policy, Policy):
        raise TypeError(f"token() needs a Policy, got {type(policy).__name__}")
    if _REGISTRY.get(policy.name) is policy:
        return policy.name
    return policy._token


def from_token(tok: str) -> Policy:
    """The policy a :func:`token` stands for."""
    p = _TOKENS.get(tok)
    if p is None:
        raise ValueError(f"mapping {tok!r} is a Policy token that this process did not make (tokens are per "
                         f"process: pass the Policy object itself, or register() it and pass its name)")
    return p


def check_kind(policy: Policy, kernel_kind: str) -> None:
    """Raise ValueError if ``policy`` cannot serve kernels of ``kernel_kind``."""
    if policy.kind != _kind_of(kernel_kind):
        raise ValueError(f"mapping {policy.name!r} is a {policy.kind} policy and cannot serve {kernel_kind} kernels; "
                         f"choose one of {available(kernel_kind)}")


def lookup(name: str) -> Optional[Policy]:
    """The registered policy called ``name``, or None (no error: plan caches key on it)."""
    return _REGISTRY.get(name)


def compose(remap: Union[str, Policy], order: Union[str, Policy], *, name: Optional[str] = None) -> Policy:
    """A new policy ``order(remap(pid))`` from a remap policy and an attention/gemm policy."""
    r, o = get(remap), get(order)
    if r.kind != "remap":
        raise ValueError(f"compose: remap must be a remap policy, {r.name!r} is of kind {r.kind!r}")
    if o.kind == "remap":
        raise ValueError(f"compose: order must be an attention or gemm policy, {o.name!r} is a remap")
    if o.remap.name != "identity":
        raise ValueError(f"compose: {o.name!r} already has a remap ({o.remap.name!r})")
    return Policy(name or f"{r.name}+{o.name}", o.kind, r.remap, o.order, r.remap_param, o.order_param,
                  doc=f"{r.name} then {o.name}")


def _kind_of(kernel_kind: str) -> str:
    if kernel_kind in ("attention", "decode", "prefill"):
        return "attention"
    if kernel_kind in ("gemm", "remap"):
        return kernel_kind
    raise ValueError(f"kernel kind must be one of attention, decode, prefill, gemm, remap; got {kernel_kind!r}")


# --------------------------------------------------------------------------------------- auto & defaults
_DEFAULTS: Dict[str, Policy] = {}  # the Policy itself, so a composed (unregistered) one works


def set_default(kernel_kind: str, mapping: Optional[str]) -> None:
    """Process-wide default mapping for a kernel kind ("attention", "decode", "gemm"); None resets to auto."""
    if kernel_kind not in KERNEL_KINDS:
        raise ValueError(f"kernel_kind must be one of {KERNEL_KINDS}, got {kernel_kind!r}")
    if mapping is None or mapping == "auto":
        _DEFAULTS.pop(kernel_kind, None)
        _bump()
        return
    p = get(mapping)
    check_kind(p, kernel_kind)
    _DEFAULTS[kernel_kind] = p
    _bump()


def get_default(kernel_kind: str) -> str:
    """Name of the default mapping set for a kernel kind, or "auto"."""
    if kernel_kind not in KERNEL_KINDS:
        raise ValueError(f"kernel_kind must be one of {KERNEL_KINDS}, got {kernel_kind!r}")
    p = _DEFAULTS.get(kernel_kind)
    return "auto" if p is None else p.name


def default_policy(kernel_kind: str) -> Optional[Policy]:
    """The Policy set as default for a kernel kind, or None (auto). Plan caches key on it."""
    if kernel_kind not in KERNEL_KINDS:
        raise ValueError(f"kernel_kind must be one of {KERNEL_KINDS}, got {kernel_kind!r}")
    return _DEFAULTS.get(kernel_kind)


# User rules for "auto", newest first: fn(kernel_kind, topology, grid, causal) -> Policy or None.
_AUTO_RULES: list = []


def register_auto(rule: Callable, *, kinds=KERNEL_KINDS) -> Callable:
    """Add a rule to ``mapping="auto"``: ``rule(kernel_kind, topology, grid, causal)`` returns a
    Policy (or a registered name) to use, or None to leave the choice to the next rule and finally
    the built-in one. Rules added later are asked first. Returns ``rule`` (for
    :func:`unregister_auto`). ``kinds`` limits the kernel kinds the rule is asked about."""
    if not callable(rule):
        raise TypeError(f"an auto rule must be callable, got {type(rule).__name__}")
    kinds = (kinds,) if isinstance(kinds, str) else tuple(kinds)
    for k in kinds:
        if k not in KERNEL_KINDS:
            raise ValueError(f"kinds must be among {KERNEL_KINDS}, got {k!r}")
    _AUTO_RULES.insert(0, (rule, kinds))
    _bump()
    return rule


def unregister_auto(rule: Callable) -> None:
    """Remove a rule added with :func:`register_auto` (no error if absent)."""
    _AUTO_RULES[:] = [(r, k) for r, k in _AUTO_RULES if r is not rule]
    _bump()


def auto(kernel_kind: str, topology, grid: Grid, *, causal: bool = False) -> Policy:
    """Pick a policy from the topology and the shape: the user rules of :func:`register_auto`
    first, then the built-in rule.

    Rules (why in mappings.md):
    * one locality domain (Hopper, generic): no placement to win; choose the order with the best
      temporal locality: head_first for attention (a head's blocks run together and share K/V),
      head_first for decode, grouped for GEMM.
    * several domains, round-robin dispatch: swizzled_head_first for non-causal attention and
      decode (each KV group's work stays on one domain); under causal masks AMD measured a loss
      from domain imbalance, so causal prefill keeps head_first. GEMM: chiplet_tiled.
    """
    kind = _kind_of(kernel_kind)
    for rule, kinds in _AUTO_RULES:
        if kernel_kind in kinds or (kernel_kind == "prefill" and "attention" in kinds):
            p = rule(kernel_kind, topology, grid, causal)
            if p is not None:
                p = get(p)
                if p.kind != kind:
                    raise ValueError(f"auto rule {getattr(rule, '__name__', rule)!r} returned the {p.kind} policy "
                                     f"{p.name!r} for {kernel_kind} kernels")
                return p
    multi = topology.num_domains > 1 and topology.dispatch != "single"
    if kind == "gemm":
        return get("chiplet_tiled" if multi else "grouped")
    if kind == "attention":
        if multi and not (causal and kernel_kind != "decode"):
            return get("swizzled_head_first")
        return get("head_first")
    raise ValueError(f"auto has no rule for kind {kernel_kind!r}")


def resolve(mapping, kernel_kind: str, topology, grid: Grid, *, causal: bool = False) -> Policy:
    """Turn a user's ``mapping=`` argument ("auto" or None, a name, a token or a Policy) into a
    Policy of the right kind. TypeError for another type, ValueError for an unknown name or a
    policy of another kind: the same for every op."""
    if mapping is None:
        mapping = "auto"
    if isinstance(mapping, str) and mapping == "auto":
        mapping = _DEFAULTS.get(kernel_kind, "auto")
    if isinstance(mapping, str) and mapping == "auto":
        p = auto(kernel_kind, topology, grid, causal=causal)
    elif not isinstance(mapping, (str, Policy)):
        raise TypeError(f"mapping must be 'auto', a policy name or a Policy, got {type(mapping).__name__}")
    else:
        p = get(mapping)
        check_kind(p, kernel_kind)
    if grid is not None:
        p.check_grid(grid)  # e.g. a GemmGrid handed to an attention kernel
    return p


def kernel_arg(mapping="auto", kernel_kind: str = "gemm", *, grid: Optional[Grid] = None, topology=None,
               causal: bool = False) -> tuple:
    """The ``MAPPING`` constexpr of a user kernel: ``mapping`` ("auto", a name or a Policy)
    resolved for ``kernel_kind`` ("gemm", "attention", "decode") on ``topology`` (default: the
    current one), as :meth:`Policy.constexpr`. ``grid`` is what "auto" and the checks see (an
    AttentionGrid, GemmGrid or DecodeGrid; optional)."""
    if topology is None:
        from numasched import topology as _topology

        topology = _topology.current()
    p = resolve(mapping, kernel_kind, topology, grid, causal=causal)
    return p.constexpr(topology.num_domains)
