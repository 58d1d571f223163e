"""Topology presets, dispatch rules, (de)serialisation, validation, detect() and from_probe."""
import json
import types
import warnings

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import numasched.topology as T
from numasched.topology import PRESETS, Topology

MB = 1 << 20

# Figures of shared/facts/hardware.md (published datasheets; H200 L2 measured):
# name: (domains, CUs or SMs per domain, L2 per domain, last-level cache, HBM TB/s, dispatch, vendor)
HARDWARE_MD = {
    "mi300x": (8, 38, 4 * MB, 256 * MB, 5.3, "round_robin", "amd"),
    "mi325x": (8, 38, 4 * MB, 256 * MB, 6.0, "round_robin", "amd"),
    "mi350x": (8, 32, 4 * MB, 256 * MB, 8.0, "round_robin", "amd"),
    "mi355x": (8, 32, 4 * MB, 256 * MB, 8.0, "round_robin", "amd"),
    "h100": (1, 132, 50 * MB, 0, 3.35, "single", "nvidia"),
    "h200": (1, 132, 62914560, 0, 4.8, "single", "nvidia"),  # torch reports 62914560 B
    "b200": (2, 74, 63 * MB, 0, 8.0, "round_robin", "nvidia"),  # 148 SMs, about 126 MB, 2 dies
}
TOTAL_CUS = {"mi300x": 304, "mi325x": 304, "mi350x": 256, "mi355x": 256, "h100": 132, "h200": 132, "b200": 148}


@pytest.mark.parametrize("name", sorted(HARDWARE_MD))
def test_presets_match_hardware_facts(name):
    t = Topology.preset(name)
    X, cus, l2, llc, hbm, dispatch, vendor = HARDWARE_MD[name]
    assert (t.num_domains, t.cus_per_domain, t.l2_bytes, t.llc_bytes) == (X, cus, l2, llc)
    assert t.hbm_bytes_per_s == pytest.approx(hbm * 1e12)
    assert (t.dispatch, t.vendor, t.num_cus) == (dispatch, vendor, TOTAL_CUS[name])
    assert t.l2_line == 128 and t.dispatch_offset == 0
    assert t.l2_sets * t.l2_ways * t.l2_line == t.l2_bytes


def test_preset_names():
    assert set(HARDWARE_MD) | {"generic"} == set(Topology.presets())
    assert Topology.preset("MI300X") is Topology.preset("mi-300x") is Topology.preset("MI_300x")
    with pytest.raises(ValueError, match="mi999"):
        Topology.preset("mi999")


# ------------------------------------------------------------------------------- dispatch rules
@settings(max_examples=40, deadline=None)
@given(X=st.integers(1, 16), data=st.data())
def test_domain_of_round_robin_with_offset(X, data):
    off = data.draw(st.integers(0, X - 1))
    t = Topology("rr", X, 1, 2048, dispatch="round_robin", dispatch_offset=off)
    g = np.array(data.draw(st.lists(st.integers(0, 10**6), min_size=1, max_size=50)))
    d = t.domain_of(g)
    assert d.dtype == np.int64
    assert np.array_equal(d, np.array([(int(p) + off) % X for p in g]))


def test_domain_of_table_and_single():
    t = Topology("tab", 3, 1, 2048, dispatch="table", dispatch_table=[2, 0, 1, 1])
    assert t.dispatch_table == (2, 0, 1, 1)  # a list is stored as a (hashable) tuple
    assert t.domain_of(np.arange(9)).tolist() == [2, 0, 1, 1, 2, 0, 1, 1, 2]
    assert t.domain_of(7).tolist() == 1  # scalars work too
    h = Topology.preset("h100")
    assert h.domain_of(np.arange(300)).tolist() == [0] * 300
    for bad in ([-1], [0.5], np.array([1.0]), ["a"]):
        with pytest.raises(ValueError, match="pids"):
            h.domain_of(bad)


# ------------------------------------------------------------------------------- (de)serialisation
@pytest.mark.parametrize("name", sorted(PRESETS))
def test_dict_round_trip(name):
    t = Topology.preset(name)
    assert Topology.from_dict(t.to_dict()) == t
    assert Topology.from_dict(json.loads(json.dumps(t.to_dict()))) == t


def test_dict_round_trip_table_and_offset():
    t = Topology("tab", 4, 8, 4096, dispatch="table", dispatch_table=(3, 1, 0, 2), source="x")
    assert Topology.from_dict(json.loads(json.dumps(t.to_dict()))) == t
    r = PRESETS["mi300x"].replace(dispatch_offset=4)
    assert Topology.from_dict(json.loads(json.dumps(r.to_dict()))) == r


def test_from_dict_errors():
    d = PRESETS["mi300x"].to_dict()
    with pytest.raises(ValueError, match="colour"):
        Topology.from_dict({**d, "colour": 1})
    del d["num_domains"]
    with pytest.raises(ValueError, match="num_domains"):
        Topology.from_dict(d)
    with pytest.raises(ValueError, match="dict"):
        Topology.from_dict([1, 2])


# ------------------------------------------------------------------------------- validation
BASE = dict(name="t", num_domains=4, cus_per_domain=2, l2_bytes=4096)


@pytest.mark.parametrize("kw, word", [
    (dict(num_domains=0), "num_domains"),
    (dict(num_domains=2.0), "num_domains"),
    (dict(num_domains=True), "num_domains"),
    (dict(cus_per_domain=-1), "cus_per_domain"),
    (dict(l2_bytes=0), "l2_bytes"),
    (dict(l2_bytes=5000), "l2_bytes"),  # not a multiple of line * ways
    (dict(l2_ways=0), "l2_ways"),
    (dict(l2_line=96), "l2_line"),
    (dict(llc_bytes=-1), "llc_bytes"),
    (dict(llc_bytes="big"), "llc_bytes"),
    (dict(hbm_bytes_per_s=-1.0), "hbm_bytes_per_s"),
    (dict(l2_bw_bytes_per_s=float("nan")), "l2_bw_bytes_per_s"),
    (dict(dispatch="random"), "dispatch"),
    (dict(dispatch_offset=4), "dispatch_offset"),
    (dict(dispatch_offset=-1), "dispatch_offset"),
    (dict(dispatch_offset=1.5), "dispatch_offset"),
    (dict(dispatch="table"), "dispatch_table"),
    (dict(dispatch="table", dispatch_table=(0, 4)), "dispatch_table"),
    (dict(dispatch="table", dispatch_table=(0, "a")), "dispatch_table"),
    (dict(dispatch="table", dispatch_table=5), "dispatch_table"),
    (dict(dispatch="single"), "single"),
    (dict(vendor="intel"), "vendor"),
    (dict(name=""), "name"),
])
def test_validation(kw, word):
    with pytest.raises(ValueError, match=word):
        Topology(**{**BASE, **kw})


# ------------------------------------------------------------------------------- current / use
@pytest.fixture
def saved_current():
    old = T._CURRENT
    yield
    T._CURRENT = old


def test_current_set_and_use(saved_current):
    T.set_current("h100")
    assert T.current() is PRESETS["h100"]
    with T.use("mi300x") as t:
        assert t is PRESETS["mi300x"] and T.current() is t
    assert T.current() is PRESETS["h100"]
    with pytest.raises(ValueError, match="topology"):
        T.set_current(5)
    assert T.current() is PRESETS["h100"]  # a failed set changes nothing
    with pytest.raises(ValueError, match="topology"):
        T.use(5)
    with pytest.raises(ValueError, match="nope"):
        T.set_current("nope")


# ------------------------------------------------------------------------------- detect()
def test_detect_without_gpu_warns_generic(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.warns(UserWarning, match="generic"):
        assert T.detect() is PRESETS["generic"]


def _fake_gpu(monkeypatch, name, cus, l2, arch=None):
    props = types.SimpleNamespace(name=name, multi_processor_count=cus, L2_cache_size=l2)
    if arch is not None:
        props.gcnArchName = arch
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: props)
    monkeypatch.setattr(torch.version, "hip", "6.4.0" if arch is not None else None)


@pytest.mark.parametrize("arch, name, cus, want, X, per", [
    ("gfx942:sramecc+:xnack-", "AMD Instinct MI300X", 304, "mi300x", 8, 38),
    ("gfx942:sramecc+:xnack-", "AMD Instinct MI325X", 304, "mi325x", 8, 38),
    ("gfx950:sramecc+:xnack-", "AMD Instinct MI355X", 256, "mi355x", 8, 32),
    ("gfx950", "AMD Instinct MI350X", 256, "mi350x", 8, 32),
    ("gfx942", "AMD Instinct MI300X", 152, "mi300x:4xcd", 4, 38),  # DPX partition
    ("gfx942", "AMD Instinct MI300X", 38, "mi300x:1xcd", 1, 38),  # CPX partition: one XCD
    ("gfx942", "AMD Instinct MI300A", 228, "mi300x:6xcd", 6, 38),  # APU: 6 XCDs
    ("gfx950", "AMD Instinct MI355X", 64, "mi355x:2xcd", 2, 32),  # QPX
])
def test_detect_amd(monkeypatch, arch, name, cus, want, X, per):
    _fake_gpu(monkeypatch, name, cus, 4 * MB, arch)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a recognised CU count must not warn
        t = T.detect()
    assert (t.name, t.num_domains, t.cus_per_domain, t.num_cus) == (want, X, per, cus)
    assert t.vendor == "amd" and t.dispatch == "round_robin" and t.l2_bytes == 4 * MB
    if X == 8:
        assert t is PRESETS[want]


def test_detect_amd_unusual_cu_count_warns(monkeypatch):
    _fake_gpu(monkeypatch, "AMD Instinct MI308X", 80, 4 * MB, "gfx942")
    with pytest.warns(UserWarning, match="80 CUs"):
        t = T.detect()
    assert (t.num_domains, t.cus_per_domain) == (4, 20)  # smallest XCD count with <= 38 CUs each


def test_detect_amd_unknown_arch_is_generic(monkeypatch):
    _fake_gpu(monkeypatch, "AMD Instinct MI250X", 110, 8 * MB, "gfx90a")
    with pytest.warns(UserWarning, match="no preset"):
        t = T.detect()
    assert t.num_domains == 1 and t.cus_per_domain == 110 and t.dispatch == "single"


@pytest.mark.parametrize("name, sms, l2, want, X", [
    ("NVIDIA H100 80GB HBM3", 132, 50 * MB, "h100", 1),
    ("NVIDIA H200", 132, 62914560, "h200", 1),
    ("NVIDIA B200", 148, 126 * MB, "b200", 2),
])
def test_detect_nvidia(monkeypatch, name, sms, l2, want, X):
    _fake_gpu(monkeypatch, name, sms, l2)
    t = T.detect()
    assert t.name == want and t.num_domains == X and t.num_cus == sms and t.l2_bytes * X == l2


def test_detect_unknown_nvidia_is_generic(monkeypatch):
    _fake_gpu(monkeypatch, "NVIDIA A100-SXM4-80GB", 108, 40 * MB)
    with pytest.warns(UserWarning, match="A100"):
        t = T.detect()
    assert (t.num_domains, t.cus_per_domain, t.l2_bytes, t.dispatch) == (1, 108, 40 * MB, "single")


# ------------------------------------------------------------------------------- from_probe
PROBE = {"device": "NVIDIA H200", "num_sms": 132, "l2_bytes": 62914560, "num_partitions": 2,
         "address_selects_partition": False, "sm_partition": [(s // 2) % 2 for s in range(132)]}


def test_from_probe_hashed_l2_is_one_domain(tmp_path):
    t = Topology.from_probe(PROBE)
    assert (t.num_domains, t.cus_per_domain, t.dispatch, t.vendor) == (1, 132, "single", "nvidia")
    assert t.l2_bytes == 62914560 and t.hbm_bytes_per_s == PRESETS["h200"].hbm_bytes_per_s
    p = tmp_path / "probe.json"
    p.write_text(json.dumps(PROBE))
    assert Topology.from_probe(p) == t and Topology.from_probe(str(p)) == t


def test_from_probe_addressable_partitions_give_a_table():
    t = Topology.from_probe({**PROBE, "address_selects_partition": True, "hbm_bytes_per_s": 4.3e12})
    assert (t.num_domains, t.cus_per_domain, t.dispatch) == (2, 66, "table")
    assert t.l2_bytes == 62914560 // 2 and t.hbm_bytes_per_s == 4.3e12
    g = np.arange(400)
    assert np.array_equal(t.domain_of(g), np.array(PROBE["sm_partition"])[g % 132])


@pytest.mark.parametrize("change, word", [
    (dict(device=None), "device"),
    (dict(num_sms=None), "num_sms"),
    (dict(l2_bytes=None), "l2_bytes"),
    (dict(num_sms=0), "num_sms"),
    (dict(num_partitions=1.5), "num_partitions"),
    (dict(address_selects_partition=True, sm_partition=[0, 1]), "sm_partition"),
])
def test_from_probe_errors(change, word):
    res = {k: v for k, v in {**PROBE, **change}.items() if v is not None}
    with pytest.raises(ValueError, match=word):
        Topology.from_probe(res)
