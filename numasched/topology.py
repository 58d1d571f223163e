"""Locality domains of a GPU, and how program ids reach them.

A :class:`Topology` is what the mapping policies, the simulator and ``auto`` choices read.
Figures come from ``shared/facts/hardware.md`` (published datasheets and our own H200/H100
measurements). AMD figures are published numbers; no AMD GPU was available to this project.

Dispatch rules
--------------
``round_robin``: domain(g) = (g + offset) mod num_domains (AMD MI300-class: one workgroup per
XCD in turn). ``table``: domain(g) = table[g mod len(table)] (a measured or hypothesised order).
``single``: one domain (Hopper: its two L2 partitions are address-hashed, so placement cannot
make accesses near; hardware.md).
"""
from __future__ import annotations

import dataclasses
import json
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np

__all__ = ["Topology", "detect", "PRESETS", "current", "set_current", "use"]

MB = 1 << 20


@dataclass(frozen=True)
class Topology:
    """Locality domains of one GPU.

    Attributes:
        name: preset or user name.
        num_domains: private-L2 domains (XCDs on AMD; 1 on NVIDIA, see module doc).
        cus_per_domain: compute units (AMD) or SMs (NVIDIA) per domain.
        l2_bytes: L2 capacity per domain.
        l2_ways: L2 associativity.
        l2_line: L2 line size in bytes.
        llc_bytes: shared last-level cache behind the L2s (AMD Infinity Cache); 0 if none.
        hbm_bytes_per_s: HBM bandwidth (published unless ``measured``).
        dispatch: "round_robin", "table" or "single".
        dispatch_offset: domain of program 0 under round-robin.
        dispatch_table: domain of program g is table[g mod len(table)] under "table".
        vendor: "amd", "nvidia" or "generic".
        l2_bw_bytes_per_s: aggregate L2 bandwidth (for the simulator's time model).
        llc_bw_bytes_per_s: last-level cache bandwidth.
        source: where the numbers come from.
    """

    name: str
    num_domains: int
    cus_per_domain: int
    l2_bytes: int
    l2_ways: int = 16
    l2_line: int = 128
    llc_bytes: int = 0
    hbm_bytes_per_s: float = 0.0
    dispatch: str = "round_robin"
    dispatch_offset: int = 0
    dispatch_table: tuple = ()
    vendor: str = "generic"
    l2_bw_bytes_per_s: float = 0.0
    llc_bw_bytes_per_s: float = 0.0
    source: str = ""

    def __post_init__(self):
        def integer(attr, lo):
            v = getattr(self, attr)
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < lo:
                raise ValueError(f"Topology.{attr} must be an integer >= {lo}, got {v!r}")

        def nonneg_number(attr):
            v = getattr(self, attr)
            if isinstance(v, bool) or not isinstance(v, (int, float, np.integer, np.floating)) or not v >= 0:
                raise ValueError(f"Topology.{attr} must be a number >= 0, got {v!r}")

        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"Topology.name must be a non-empty string, got {self.name!r}")
        for attr in ("num_domains", "cus_per_domain", "l2_bytes", "l2_ways", "l2_line"):
            integer(attr, 1)
        if self.num_domains > 2**31 - 1:
            raise ValueError(f"Topology.num_domains = {self.num_domains} overflows int32 (the kernels compute "
                             f"domain ids in 32 bits)")
        integer("llc_bytes", 0)
        for attr in ("hbm_bytes_per_s", "l2_bw_bytes_per_s", "llc_bw_bytes_per_s"):
            nonneg_number(attr)
        if self.l2_line & (self.l2_line - 1):
            raise ValueError(f"Topology.l2_line must be a power of two, got {self.l2_line}")
        if self.l2_bytes % (self.l2_line * self.l2_ways):
            raise ValueError(
                f"Topology.l2_bytes ({self.l2_bytes}) must be a multiple of l2_line*l2_ways "
                f"({self.l2_line * self.l2_ways})")
        if self.dispatch not in ("round_robin", "table", "single"):
            raise ValueError(
                f"Topology.dispatch must be 'round_robin', 'table' or 'single', got {self.dispatch!r}")
        integer("dispatch_offset", 0)
        if self.dispatch_offset >= self.num_domains:
            raise ValueError(f"Topology.dispatch_offset must lie in [0, num_domains={self.num_domains}), "
                             f"got {self.dispatch_offset}")
        try:
            table = tuple(self.dispatch_table)
        except TypeError:
            raise ValueError(f"Topology.dispatch_table must be a sequence of domain ids, "
                             f"got {self.dispatch_table!r}") from None
        bad = [d for d in table
               if isinstance(d, bool) or not isinstance(d, (int, np.integer)) or not 0 <= d < self.num_domains]
        if bad:
            raise ValueError(
                f"Topology.dispatch_table entries must be integers in [0, num_domains={self.num_domains}), "
                f"got {bad[:4]}")
        object.__setattr__(self, "dispatch_table", tuple(int(d) for d in table))  # lists -> hashable tuple
        if self.dispatch == "table" and not table:
            raise ValueError("Topology.dispatch_table must be non-empty when dispatch='table'")
        if self.dispatch == "single" and self.num_domains != 1:
            raise ValueError("Topology.dispatch='single' needs num_domains == 1")
        if self.vendor not in ("amd", "nvidia", "generic"):
            raise ValueError(f"Topology.vendor must be 'amd', 'nvidia' or 'generic', got {self.vendor!r}")

    def __hash__(self):  # plan keys hash the topology on every call: compute once
        h = self.__dict__.get("_hash")
        if h is None:
            h = hash(tuple(getattr(self, f.name) for f in dataclasses.fields(self)))
            object.__setattr__(self, "_hash", h)
        return h

    # ------------------------------------------------------------------ derived
    @property
    def num_cus(self) -> int:
        return self.num_domains * self.cus_per_domain

    @property
    def l2_sets(self) -> int:
        return self.l2_bytes // (self.l2_line * self.l2_ways)

    def domain_of(self, pids) -> np.ndarray:
        """Domain of each linear program id under this topology's dispatch rule."""
        g = np.asarray(pids)
        if g.size and g.dtype.kind not in "iu":
            raise ValueError(f"pids must be integers, got dtype {g.dtype}")
        g = g.astype(np.int64)
        if np.any(g < 0):
            raise ValueError("pids must be >= 0")
        if self.dispatch == "single":
            return np.zeros_like(g)
        if self.dispatch == "table":
            t = np.asarray(self.dispatch_table, dtype=np.int64)
            return t[g % len(t)]
        return (g + self.dispatch_offset) % self.num_domains

    def replace(self, **kw) -> "Topology":
        return dataclasses.replace(self, **kw)

    # ------------------------------------------------------------------ constructors
    @staticmethod
    def preset(name: str) -> "Topology":
        """A named preset: mi300x, mi325x, mi350x, mi355x, h100, h200, b200, generic."""
        key = str(name).lower().replace("-", "").replace("_", "")
        if key not in PRESETS:
            raise ValueError(f"unknown topology preset {name!r}; known: {sorted(PRESETS)}")
        return PRESETS[key]

    @staticmethod
    def presets() -> list:
        return sorted(PRESETS)

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["dispatch_table"] = list(self.dispatch_table)
        return d

    @staticmethod
    def from_dict(d: dict) -> "Topology":
        """Inverse of :meth:`to_dict` (also accepts the dict after a JSON round trip)."""
        if not isinstance(d, dict):
            raise ValueError(f"Topology.from_dict needs a dict, got {type(d).__name__}")
        d = dict(d)
        table = d.get("dispatch_table", ())
        if isinstance(table, (str, bytes)) or not isinstance(table, (list, tuple)):
            raise ValueError(f"Topology.from_dict: dispatch_table must be a list of domain indices, got {table!r}")
        d["dispatch_table"] = tuple(table)
        fields = {f.name for f in dataclasses.fields(Topology)}
        unknown = set(d) - fields
        if unknown:
            raise ValueError(f"unknown Topology fields: {sorted(unknown)}")
        missing = [f.name for f in dataclasses.fields(Topology)
                   if f.default is dataclasses.MISSING and f.name not in d]
        if missing:
            raise ValueError(f"Topology.from_dict: missing fields {missing}")
        return Topology(**d)

    @staticmethod
    def from_probe(path_or_result) -> "Topology":
        """Build a Topology from a probe result (``numasched probe`` JSON, or its dict).

        If the probe found that a line's home L2 partition cannot be chosen by address, the
        partitions are one domain for placement (dispatch "single"); otherwise the measured
        partition of each first-wave program (``dispatch_partition``: partition of the SM program g
        ran on) becomes a "table" dispatch over the partitions. An AMD result (vendor "amd",
        untested on hardware) gives "round_robin" with the measured offset, or its table.
        """
        if isinstance(path_or_result, (str, Path)):
            res = json.loads(Path(path_or_result).read_text())
        elif isinstance(path_or_result, dict):
            res = dict(path_or_result)
        else:
            raise ValueError(f"Topology.from_probe needs a probe JSON path or its dict, got "
                             f"{type(path_or_result).__name__}")
        if not isinstance(res, dict):
            raise ValueError(f"probe result must be a JSON object, got {type(res).__name__}")
        for key in ("device", "num_sms", "l2_bytes"):
            if key not in res:
                raise ValueError(f"probe result lacks {key!r}")
        if not isinstance(res["device"], str) or not res["device"]:
            raise ValueError(f"probe result: 'device' must be the GPU's name, got {res['device']!r}")
        nsm, l2, parts = res["num_sms"], res["l2_bytes"], res.get("num_partitions", 1)
        for key, v in (("num_sms", nsm), ("l2_bytes", l2), ("num_partitions", parts)):
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
                raise ValueError(f"probe result: {key!r} must be a positive integer, got {v!r}")
        if res.get("vendor") == "amd":
            return _amd_from_probe(res, nsm, parts)
        addressable = bool(res.get("address_selects_partition", False))
        base = _nvidia_base(res["device"])
        common = dict(l2_ways=base.l2_ways if base else 16, l2_line=128,
                      hbm_bytes_per_s=float(res.get("hbm_bytes_per_s") or (base.hbm_bytes_per_s if base else 0.0)),
                      vendor="nvidia", source=f"probe of {res['device']}")
        if parts <= 1 or not addressable:
            return Topology(name=f"probe:{res['device']}", num_domains=1, cus_per_domain=nsm,
                            l2_bytes=_round_l2(l2, common["l2_ways"]), dispatch="single", **common)
        # Prefer the measured program -> partition order; else assume program g runs on SM g mod num_sms.
        key = "dispatch_partition" if "dispatch_partition" in res else "sm_partition"
        table = res.get(key)
        if not isinstance(table, (list, tuple)) or len(table) != nsm:
            raise ValueError(f"probe result: {key!r} must list a partition for each of the {nsm} SMs "
                             f"when num_partitions > 1 and address_selects_partition is true")
        if any(isinstance(t, bool) or not isinstance(t, (int, np.integer)) or not 0 <= t < parts for t in table):
            raise ValueError(f"probe result: {key!r} entries must lie in [0, num_partitions={parts})")
        return Topology(name=f"probe:{res['device']}", num_domains=parts, cus_per_domain=max(1, nsm // parts),
                        l2_bytes=_round_l2(l2 // parts, common["l2_ways"]), dispatch="table",
                        dispatch_table=tuple(table), **common)


def _amd_from_probe(res: dict, ncu: int, parts: int) -> "Topology":
    """AMD probe result (XCC id per workgroup; untested on hardware) -> round_robin or table Topology."""
    key = _amd_key(str(res.get("arch", "")), res["device"])
    base = PRESETS[key] if key else None
    common = dict(name=f"probe:{res['device']}", num_domains=parts, cus_per_domain=max(1, ncu // parts),
                  l2_bytes=base.l2_bytes if base else _round_l2(res["l2_bytes"], 16),
                  llc_bytes=base.llc_bytes if base else 0, hbm_bytes_per_s=base.hbm_bytes_per_s if base else 0.0,
                  l2_bw_bytes_per_s=base.l2_bw_bytes_per_s if base else 0.0,
                  llc_bw_bytes_per_s=base.llc_bw_bytes_per_s if base else 0.0,
                  vendor="amd", source=f"probe of {res['device']} (XCC ids)")
    rr = res.get("round_robin") or {}
    if parts > 1 and rr.get("offset") is not None and float(rr.get("accuracy", 0)) >= 0.99:
        return Topology(dispatch="round_robin", dispatch_offset=int(rr["offset"]) % parts, **common)
    if parts == 1:
        return Topology(dispatch="single", **common)
    table = res.get("dispatch_partition")
    if not isinstance(table, (list, tuple)) or not table:
        raise ValueError("probe result: AMD result without a round-robin fit needs 'dispatch_partition'")
    return Topology(dispatch="table", dispatch_table=tuple(int(t) for t in table), **common)


def _round_l2(nbytes: int, ways: int, line: int = 128) -> int:
    unit = ways * line
    return max(unit, (nbytes // unit) * unit)


TB = 1e12
PRESETS = {
    "mi300x": Topology("mi300x", 8, 38, 4 * MB, 16, 128, 256 * MB, 5.3 * TB, "round_robin", vendor="amd",
                       l2_bw_bytes_per_s=8 * 2.0 * TB, llc_bw_bytes_per_s=17.2 * TB,
                       source="AMD MI300X spec; CDNA3 white paper"),
    "mi325x": Topology("mi325x", 8, 38, 4 * MB, 16, 128, 256 * MB, 6.0 * TB, "round_robin", vendor="amd",
                       l2_bw_bytes_per_s=8 * 2.0 * TB, llc_bw_bytes_per_s=17.2 * TB, source="AMD MI325X spec"),
    "mi350x": Topology("mi350x", 8, 32, 4 * MB, 16, 128, 256 * MB, 8.0 * TB, "round_robin", vendor="amd",
                       l2_bw_bytes_per_s=8 * 2.0 * TB, llc_bw_bytes_per_s=17.2 * TB, source="AMD MI350X spec"),
    "mi355x": Topology("mi355x", 8, 32, 4 * MB, 16, 128, 256 * MB, 8.0 * TB, "round_robin", vendor="amd",
                       l2_bw_bytes_per_s=8 * 2.0 * TB, llc_bw_bytes_per_s=17.2 * TB, source="AMD MI355X spec"),
    # Hopper: two address-hashed L2 partitions act as one domain for placement (measured, hardware.md).
    "h100": Topology("h100", 1, 132, 50 * MB, 16, 128, 0, 3.35 * TB, "single", vendor="nvidia",
                     l2_bw_bytes_per_s=10 * TB, source="NVIDIA H100 SXM datasheet; L2 as one domain (measured on H200)"),
    "h200": Topology("h200", 1, 132, 60 * MB, 16, 128, 0, 4.8 * TB, "single", vendor="nvidia",
                     l2_bw_bytes_per_s=10 * TB, source="NVIDIA H200 datasheet; torch reports 62914560 B L2 (measured)"),
    # B200: two dies; whether placement can make accesses near is not measured here (no B200 lent).
    "b200": Topology("b200", 2, 74, 63 * MB, 16, 128, 0, 8.0 * TB, "round_robin", vendor="nvidia",
                     l2_bw_bytes_per_s=16 * TB, source="published B200 figures; dispatch order undocumented (assumed)"),
    "generic": Topology("generic", 1, 1, 4 * MB, 16, 128, 0, 1.0 * TB, "single",
                        source="fallback for an unknown GPU"),
}


def _nvidia_base(device_name: str) -> Optional[Topology]:
    n = device_name.lower()
    for key in ("h200", "h100", "b200"):
        if key in n:
            return PRESETS[key]
    return None


def _amd_key(arch: str, name: str) -> Optional[str]:
    """Preset family for an AMD arch name (gfx942 = MI300 family, gfx950 = MI350 family)."""
    arch = str(arch).lower().split(":")[0]
    name = str(name).lower()
    if arch == "gfx942":
        return "mi325x" if "325" in name else "mi300x"
    if arch == "gfx950":
        return "mi355x" if "355" in name else "mi350x"
    return None


def _amd_topology(arch: str, name: str, num_cus: int) -> Optional[Topology]:
    """AMD topology from the arch name and the CU count the device reports.

    The arch picks the family (CUs per full XCD: 38 on gfx942, 32 on gfx950); the CU count tells
    how many XCDs this device has: 304 = 8 x 38 (MI300X/MI325X), 256 = 8 x 32 (MI350X/MI355X),
    228 = 6 x 38 (MI300A), and fewer in compute-partition modes (DPX 4 XCDs, QPX 2, CPX 1), where
    the workgroups of one logical device go round-robin over its own XCDs only. The XCD count is
    the smallest divisor n of the CU count with at most a full XCD's CUs per XCD (equal to
    CUs / CUs-per-XCD whenever that divides); other counts (harvested parts) are guesses, with a
    warning.
    """
    key = _amd_key(arch, name)
    if key is None:
        return None
    base = PRESETS[key]
    cus = int(num_cus or 0)
    if cus <= 0:
        warnings.warn(f"numasched.topology.detect: device reports {num_cus!r} CUs; assuming the full "
                      f"{key} preset", stacklevel=3)
        return base
    if cus == base.num_cus:
        return base
    per = base.cus_per_domain
    n = next(d for d in range(1, cus + 1) if cus % d == 0 and cus // d <= per)
    if cus % per:
        warnings.warn(f"numasched.topology.detect: {cus} CUs on {arch} is not a multiple of {per} CUs per XCD; "
                      f"assuming {n} XCDs of {cus // n} CUs", stacklevel=3)
    return base.replace(
        name=f"{key}:{n}xcd", num_domains=n, cus_per_domain=cus // n,
        l2_bw_bytes_per_s=base.l2_bw_bytes_per_s * n / base.num_domains,
        source=f"{base.source}; device reports {cus} CUs = {n} XCDs x {cus // n} (partition mode or "
               f"smaller part); HBM and Infinity Cache figures are the whole GPU's")


def detect(device=None) -> Topology:
    """The topology of the current GPU; a generic single-domain topology (with a warning) otherwise.

    AMD: arch gfx942/gfx950 plus the CU count (see :func:`_amd_topology`). NVIDIA: the preset whose
    name appears in the device name, with the SM count and L2 size the device reports.
    """
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a dependency
        torch = None
    if torch is None or not torch.cuda.is_available():
        warnings.warn("numasched.topology.detect: no GPU visible; using the 'generic' single-domain topology",
                      stacklevel=2)
        return PRESETS["generic"]
    props = torch.cuda.get_device_properties(device if device is not None else torch.cuda.current_device())
    if getattr(torch.version, "hip", None):
        arch = getattr(props, "gcnArchName", "") or ""
        topo = _amd_topology(arch, props.name, props.multi_processor_count)
        if topo is not None:
            return topo
    else:
        base = _nvidia_base(props.name)
        if base is not None:
            return base.replace(cus_per_domain=max(1, props.multi_processor_count // base.num_domains),
                                l2_bytes=_round_l2(props.L2_cache_size // base.num_domains, base.l2_ways))
    warnings.warn(f"numasched.topology.detect: no preset for {props.name!r}; using a generic single-domain "
                  f"topology with {props.multi_processor_count} compute units", stacklevel=2)
    return PRESETS["generic"].replace(name=f"generic:{props.name}",
                                      cus_per_domain=max(1, props.multi_processor_count),
                                      l2_bytes=_round_l2(max(props.L2_cache_size, 2048), 16))


# ---------------------------------------------------------------------------------- current topology
_CURRENT: Optional[Topology] = None


def current() -> Topology:
    """The topology kernels plan with: set by :func:`set_current` / :func:`use`, else :func:`detect` (cached)."""
    global _CURRENT
    if _CURRENT is None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            _CURRENT = detect()
    return _CURRENT


def set_current(topology) -> None:
    """Set the process-wide topology (a Topology or a preset name; None re-detects)."""
    global _CURRENT
    new = Topology.preset(topology) if isinstance(topology, str) else topology
    if new is not None and not isinstance(new, Topology):  # checked before assigning: a bad call changes nothing
        raise ValueError(f"topology must be a Topology, a preset name or None, got {type(topology).__name__}")
    _CURRENT = new


class use:
    """Context manager: ``with numasched.topology.use("mi300x"): ...`` plans kernels for that topology."""

    def __init__(self, topology):
        self._new = Topology.preset(topology) if isinstance(topology, str) else topology
        if not isinstance(self._new, Topology):
            raise ValueError(f"topology must be a Topology or a preset name, got {type(topology).__name__}")

    def __enter__(self):
        global _CURRENT
        self._old = _CURRENT
        _CURRENT = self._new
        return self._new

    def __exit__(self, *exc):
        global _CURRENT
        _CURRENT = self._old
        return False
