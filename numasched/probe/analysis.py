"""Analysis of a probe measurement: pure NumPy, runs (and is tested) on any CPU.

* :func:`sm_latency_matrix` -- per SM and line, the fastest program on that SM;
* :func:`cluster_sms` -- group SMs into L2 partitions from their latency profiles;
* :func:`line_partitions` -- the near partition of each line;
* :func:`address_bit_test` -- do single address bits or pairs of bits predict the near partition;
* :func:`round_robin_fit`, :func:`dispatch_summary` -- the program id -> SM (or XCC) order;
* :func:`analyze` -- a raw measurement (:func:`.measurement.measure` or :func:`.files.load_raw`) -> the result
  dict that ``Topology.from_probe`` reads; :func:`summary` -- that result as text.
"""
from __future__ import annotations

import itertools
from typing import Sequence

import numpy as np

__all__ = ["PAGE_SHIFT", "sm_latency_matrix", "cluster_sms", "line_partitions", "address_bit_test",
           "round_robin_fit", "dispatch_summary", "analyze", "summary"]

PAGE_SHIFT = 21                 # 2 MiB GPU pages: bits >= 21 of a virtual address are not physical bits


def sm_latency_matrix(lat, pid_sm):
    """Per SM and line, the fastest of the programs that ran on that SM.

    Args: lat (programs x lines) cycles per load; pid_sm (programs,) SM id of each program.
    Returns (sm_ids, M): the distinct SM ids seen (sorted) and M (len(sm_ids) x lines). Values
    that are not finite or not positive (a program that did not write) are ignored.
    """
    lat = np.asarray(lat, dtype=np.float64)
    pid_sm = np.asarray(pid_sm, dtype=np.int64)
    if lat.ndim != 2 or pid_sm.shape != (lat.shape[0],):
        raise ValueError(f"lat must be (programs, lines) and pid_sm (programs,); got {lat.shape} and {pid_sm.shape}")
    lat = np.where(np.isfinite(lat) & (lat > 0), lat, np.inf)
    ok = pid_sm >= 0
    sm_ids = np.unique(pid_sm[ok])
    M = np.full((len(sm_ids), lat.shape[1]), np.inf)
    np.minimum.at(M, np.searchsorted(sm_ids, pid_sm[ok]), lat[ok])
    M[~np.isfinite(M)] = np.nan
    return sm_ids, M


def _kmeans(Z, k, rng, n_init=8, max_iter=100):
    """Plain Lloyd k-means with k-means++ starts; returns the labels of the best of n_init runs."""
    n = len(Z)
    sq = (Z * Z).sum(1)
    best, best_ss = None, np.inf
    for _ in range(n_init):
        centers = [Z[rng.integers(n)]]
        for _ in range(1, k):
            d = np.min([((Z - c) ** 2).sum(1) for c in centers], axis=0)
            centers.append(Z[rng.choice(n, p=d / d.sum())] if d.sum() > 0 else Z[rng.integers(n)])
        C = np.array(centers)
        lab = None
        for _ in range(max_iter):
            d = sq[:, None] - 2 * Z @ C.T + (C * C).sum(1)[None, :]
            new = d.argmin(1)
            if lab is not None and np.array_equal(new, lab):
                break
            lab = new
            for c in range(k):
                members = Z[lab == c]
                C[c] = members.mean(0) if len(members) else Z[d.min(1).argmax()]
        ss = sum(((Z[lab == c] - C[c]) ** 2).sum() for c in range(k))
        if ss < best_ss:
            best, best_ss = lab.copy(), ss
    return best


def _ownership(X, lab, k, z, min_margin):
    """Per line: the fastest group (raw cycles), the margin to the runner-up, and whether it clears the noise.

    Threshold per line: max(min_margin, z * pooled within-group std * sqrt(1/n_best + 1/n_second)).
    """
    sizes = np.bincount(lab, minlength=k)
    G = np.stack([X[lab == c].mean(0) for c in range(k)])            # k x lines
    resid = X - G[lab]
    dof = max(1, len(X) - k)
    s = np.sqrt((resid ** 2).sum(0) / dof)                           # pooled std per line
    order = np.argsort(G, axis=0)
    best, second = order[0], order[1]
    cols = np.arange(X.shape[1])
    margin = G[second, cols] - G[best, cols]
    thresh = np.maximum(min_margin, z * s * np.sqrt(1.0 / sizes[best] + 1.0 / sizes[second]))
    return best, margin, margin >= thresh


def cluster_sms(M, *, max_k: int = 4, z: float = 4.0, min_margin: float = 4.0, min_line_frac: float = 0.05,
                seed: int = 0) -> np.ndarray:
    """Group SMs into L2 partitions from their latency profile over lines.

    k-means for k = 2..max_k on rows centred on their own mean (so a per-SM offset, such as the
    distance to the crossbar, does not drive the split). A split into k groups is kept only if every group
    is the clearly fastest group (margin above noise, see :func:`_ownership`) for at least
    ``min_line_frac`` of the lines: a partition must be *near* to some lines. Splitting one true
    partition in two gives groups that tie on every line, so it is refused. The largest k that
    passes wins (a k below the true count can fail: its merged groups have inflated spread).

    Args: M (sms x lines) latency in cycles; rows with NaN get label -1.
    Returns labels (sms,), 0..k-1, numbered in order of each group's first SM (row order).
    """
    M = np.asarray(M, dtype=np.float64)
    if M.ndim != 2 or M.shape[1] < 2:
        raise ValueError(f"M must be (sms, lines) with at least 2 lines, got shape {M.shape}")
    valid = np.isfinite(M).all(1)
    labels = np.full(len(M), -1, dtype=np.int64)
    X = M[valid]
    labels[valid] = 0
    if len(X) < 4:
        return labels
    Z = X - X.mean(1, keepdims=True)
    rng = np.random.default_rng(seed)
    best = np.zeros(len(X), dtype=np.int64)
    for k in range(2, max_k + 1):
        if len(X) < 2 * k:
            break
        lab = _kmeans(Z, k, rng)
        if np.bincount(lab, minlength=k).min() < 2:
            continue
        win, _, clear = _ownership(X, lab, k, z, min_margin)
        owned = np.bincount(win[clear], minlength=k)
        if owned.min() >= min_line_frac * X.shape[1]:
            best = lab   # keep the largest k that passes (a coarser k can fail: merged groups are noisy)
    # canonical numbering: group of the first SM is 0, and so on
    _, first = np.unique(best, return_index=True)
    remap = np.empty(best.max() + 1, dtype=np.int64)
    remap[best[np.sort(first)]] = np.arange(len(first))
    labels[valid] = remap[best]
    return labels


def line_partitions(M, labels, *, z: float = 4.0, min_margin: float = 4.0) -> dict:
    """Near partition of each line given the SM groups.

    Returns dict: near (lines,) partition that is clearly fastest, -1 where no group is clearly
    fastest; margin (lines,) cycles to the runner-up; group_cycles (k x lines) mean raw latency
    of each group; near_cycles / far_cycles (median over clear lines of the near group's and the
    other groups' mean latency; far is None with one group).
    """
    M = np.asarray(M, dtype=np.float64)
    labels = np.asarray(labels, dtype=np.int64)
    if labels.shape != (len(M),):
        raise ValueError(f"labels must have one entry per row of M ({len(M)}), got shape {labels.shape}")
    ok = labels >= 0
    X, lab = M[ok], labels[ok]
    k = int(lab.max()) + 1 if len(lab) else 0
    if k == 0:
        raise ValueError("labels: no SM has a partition (all -1)")
    G = np.stack([X[lab == c].mean(0) for c in range(k)])
    if k == 1:
        n = X.shape[1]
        return dict(near=np.zeros(n, dtype=np.int64), margin=np.zeros(n), group_cycles=G,
                    near_cycles=float(np.median(G[0])), far_cycles=None)
    win, margin, clear = _ownership(X, lab, k, z, min_margin)
    near = np.where(clear, win, -1)
    cols = np.flatnonzero(clear)
    if len(cols):
        near_c = float(np.median(G[win[cols], cols]))
        far_c = float(np.median((G[:, cols].sum(0) - G[win[cols], cols]) / (k - 1)))
    else:
        near_c = far_c = None
    return dict(near=near, margin=margin, group_cycles=G, near_cycles=near_c, far_cycles=far_c)


def _majority_accuracy(cells, y, n_cells, k):
    counts = np.bincount(cells * k + y, minlength=n_cells * k).reshape(n_cells, k)
    return counts.max(1).sum() / len(y), counts.argmax(1), counts.sum(1)


def address_bit_test(addresses, near, *, bits: Sequence[int] = range(7, 25), threshold: float = 0.9,
                     page_shift: int = PAGE_SHIFT) -> dict:
    """Does an address bit, or a pair of bits, predict each line's near partition?

    For each bit (pair), lines are split by the bit value(s) and each cell predicts its most
    common partition (so a pair covers every function of two bits: XOR, AND, ...). Accuracy is
    measured on lines with a clear near partition (near >= 0).

    Addressable means: the best predictor reaches ``threshold``, beats "always the commonest
    partition" by half the remaining gap, and uses only bits below ``page_shift`` (bits of the
    offset inside a 2 MiB page are the same in virtual and physical addresses; higher bits are
    chosen by the driver's page mapping, not by the program). A page-level predictor is reported
    separately (``page``): near partition constant within each 2 MiB page.
    """
    a = np.asarray(addresses, dtype=np.uint64)
    near = np.asarray(near, dtype=np.int64)
    if a.shape != near.shape or a.ndim != 1:
        raise ValueError(f"addresses and near must be 1-D of equal length, got {a.shape} and {near.shape}")
    keep = near >= 0
    y, a = near[keep], a[keep]
    n = len(y)
    out = dict(lines_tested=int(n), threshold=threshold, page_shift=page_shift, bits_tested=[], bits_constant=[],
               single=[], best_single=None, best_pair=None, predictor=None, page=None, addressable=False)
    if n < 16:
        out["reason"] = f"only {n} lines have a clear near partition: too few to test"
        return out
    k = int(y.max()) + 1
    chance = float(np.bincount(y, minlength=k).max() / n)
    out["chance"] = chance
    B = {}
    for b in bits:
        col = ((a >> np.uint64(b)) & np.uint64(1)).astype(np.int64)
        if 0 < col.sum() < n:
            B[int(b)] = col
            out["bits_tested"].append(int(b))
        else:
            out["bits_constant"].append(int(b))

    def entry(bs, acc, rule):
        return {"bits": list(bs), "accuracy": round(float(acc), 4), "rule": [int(r) for r in rule]}

    singles = []
    for b, col in B.items():
        acc, rule, _ = _majority_accuracy(col, y, 2, k)
        singles.append(entry([b], acc, rule))
    pairs = []
    for b1, b2 in itertools.combinations(B, 2):
        acc, rule, _ = _majority_accuracy(2 * B[b1] + B[b2], y, 4, k)
        pairs.append(entry([b1, b2], acc, rule))
    out["single"] = sorted(singles, key=lambda e: -e["accuracy"])
    out["best_single"] = out["single"][0] if singles else None
    out["best_pair"] = max(pairs, key=lambda e: e["accuracy"]) if pairs else None

    def good(e):
        return e is not None and e["accuracy"] >= threshold and e["accuracy"] - chance >= 0.5 * (1 - chance)

    pred = out["best_single"] if good(out["best_single"]) else (out["best_pair"] if good(out["best_pair"]) else None)
    out["predictor"] = pred
    pages = (a >> np.uint64(page_shift)).astype(np.int64)
    _, pidx = np.unique(pages, return_inverse=True)
    pacc, _, _ = _majority_accuracy(pidx, y, int(pidx.max()) + 1, k)
    out["page"] = {"pages": int(pidx.max()) + 1, "accuracy": round(float(pacc), 4)}
    if pred is None:
        out["reason"] = ("no single bit or pair of bits in %d..%d predicts the near partition (best single %.2f, "
                         "best pair %.2f, chance %.2f): the line-to-partition map looks hashed"
                         % (min(bits), max(bits), out["best_single"]["accuracy"] if singles else float("nan"),
                            out["best_pair"]["accuracy"] if pairs else float("nan"), chance))
    elif max(pred["bits"]) >= page_shift:
        out["reason"] = (f"bits {pred['bits']} predict the near partition but lie above the 2 MiB page offset: "
                         f"set by the driver's page mapping, not by the program")
    else:
        out["addressable"] = True
        out["reason"] = f"address bit(s) {pred['bits']} predict the near partition (accuracy {pred['accuracy']:.3f})"
    return out


def round_robin_fit(pid_domain, num_domains: int) -> dict:
    """Best offset for domain(pid) = (pid + offset) mod num_domains, and the fraction of pids it explains."""
    d = np.asarray(pid_domain, dtype=np.int64)
    if num_domains < 1:
        raise ValueError(f"num_domains must be >= 1, got {num_domains}")
    ok = d >= 0
    pid = np.arange(len(d))[ok]
    if not ok.any():
        return {"offset": None, "accuracy": 0.0}
    diffs = (d[ok] - pid) % num_domains
    counts = np.bincount(diffs, minlength=num_domains)
    off = int(counts.argmax())
    return {"offset": off, "accuracy": round(float(counts[off] / ok.sum()), 4)}


def dispatch_summary(pid_sm, sm_partition: dict, num_sms: int) -> dict:
    """Program id -> SM order of the first wave (the first num_sms programs).

    Args: pid_sm (programs,); sm_partition mapping SM id -> partition (-1 unknown); num_sms.
    """
    pid_sm = np.asarray(pid_sm, dtype=np.int64)
    first = pid_sm[:num_sms]
    part = np.array([sm_partition.get(int(s), -1) for s in first], dtype=np.int64)
    k = int(max(sm_partition.values(), default=0)) + 1
    out = {
        "first_wave_sm": first.tolist(),
        "first_wave_partition": part.tolist(),
        "distinct_sms_first_wave": int(len(np.unique(first[first >= 0]))),
        "first_wave_per_partition": np.bincount(part[part >= 0], minlength=k).tolist(),
        "consecutive_same_partition": (round(float(np.mean(part[1:] == part[:-1])), 4) if len(part) > 1 else None),
        "round_robin": round_robin_fit(part, k) if k > 1 else None,
    }
    if len(pid_sm) >= 2 * num_sms:  # is the order a fixed table? (does pid g+num_sms land where g did?)
        out["second_wave_same_sm"] = round(float(np.mean(pid_sm[num_sms:2 * num_sms] == first)), 4)
    return out


def analyze(raw: dict, *, max_partitions: int = 4, z: float = 4.0, min_margin: float = 4.0,
            threshold: float = 0.9) -> dict:
    """Turn a raw measurement (from :func:`measure` or :func:`load_raw`) into the probe result dict."""
    if raw.get("vendor") == "amd":
        return _analyze_amd(raw)
    for key in ("device", "num_sms", "lat", "pid_sm", "addresses"):
        if key not in raw:
            raise ValueError(f"raw measurement lacks {key!r}")
    nsm = int(raw["num_sms"])
    sm_ids, M = sm_latency_matrix(raw["lat"], raw["pid_sm"])
    labels = cluster_sms(M, max_k=max_partitions, z=z, min_margin=min_margin)
    lp = line_partitions(M, labels, z=z, min_margin=min_margin)
    k = int(labels.max()) + 1
    ok = labels >= 0
    table_len = max(nsm, int(sm_ids.max()) + 1 if len(sm_ids) else 0)
    sm_partition = [-1] * table_len
    for s, lab in zip(sm_ids, labels):
        sm_partition[int(s)] = int(lab)
    part_of = {int(s): int(lab) for s, lab in zip(sm_ids, labels)}
    addr = address_bit_test(raw["addresses"], lp["near"], threshold=threshold) if k > 1 else None
    disp = dispatch_summary(raw["pid_sm"], part_of, nsm)
    A = M[ok]
    res = {
        "schema": 1, "tool": "numasched probe", "vendor": "nvidia", "device": str(raw["device"]),
        "compute_capability": raw.get("compute_capability"), "num_sms": nsm, "l2_bytes": int(raw.get("l2_bytes", 0)),
        "hbm_bytes_per_s": raw.get("hbm_bytes_per_s"), "settings": dict(raw.get("settings", {})),
        "versions": dict(raw.get("versions", {})),
        "sms_covered": int(len(sm_ids)),
        "uncovered_sms": [s for s in range(nsm) if s not in part_of],
        "latency_cycles": {"min": float(np.nanmin(A)), "median": float(np.nanmedian(A)), "max": float(np.nanmax(A))},
        "num_partitions": k,
        "partition_sizes": np.bincount(labels[ok], minlength=k).tolist(),
        "sm_partition": sm_partition,
        "partition_sms": [[int(s) for s in sm_ids[labels == c]] for c in range(k)],
        "near_cycles": lp["near_cycles"], "far_cycles": lp["far_cycles"],
        "far_over_near": (lp["far_cycles"] / lp["near_cycles"]) if lp["far_cycles"] else None,
        "lines_clear": int((lp["near"] >= 0).sum()), "lines": int(M.shape[1]),
        "lines_near_per_partition": np.bincount(lp["near"][lp["near"] >= 0], minlength=k).tolist(),
        "address_selects_partition": bool(addr and addr["addressable"]),
        "address_test": addr,
        "dispatch": disp,
        # partition of the SM each first-wave program ran on: the "table" dispatch of Topology.from_probe
        "dispatch_partition": disp["first_wave_partition"],
    }
    clocks = raw.get("clocks")
    if clocks is not None:
        c = np.asarray(clocks, dtype=np.float64).reshape(-1, 2)
        good = (c[:, 0] > 0) & (c[:, 1] > 0)
        ghz = float(np.median(c[good, 0] / c[good, 1])) if good.any() else None
        res["sm_clock_ghz"] = ghz
        if ghz:
            res["near_ns"] = res["near_cycles"] / ghz if res["near_cycles"] else None
            res["far_ns"] = res["far_cycles"] / ghz if res["far_cycles"] else None
    if k == 1:
        res["verdict"] = "one L2 domain: no group of SMs is clearly faster for any set of lines"
    elif res["address_selects_partition"]:
        res["verdict"] = (f"{k} L2 partitions, selectable by address ({addr['reason']}): placing work on the "
                          f"SMs of a line's partition makes its accesses near")
    else:
        res["verdict"] = (f"{k} L2 partitions, but a line's home partition cannot be chosen by address "
                          f"({addr['reason'] if addr else 'no test'}): for placement the L2 is one domain")
    return res


def _analyze_amd(raw: dict) -> dict:
    """UNTESTED ON HARDWARE: XCC count and the round-robin rule from pid -> XCC ids."""
    pid_xcc = np.asarray(raw["pid_xcc"], dtype=np.int64)
    seen = np.unique(pid_xcc[pid_xcc >= 0])
    n = raw.get("num_xcc_attribute") or (int(seen.max()) + 1 if len(seen) else 1)
    rr = round_robin_fit(pid_xcc, int(n))
    return {
        "schema": 1, "tool": "numasched probe", "vendor": "amd", "device": str(raw["device"]),
        "arch": raw.get("arch", ""), "num_sms": int(raw["num_sms"]), "l2_bytes": int(raw.get("l2_bytes", 0)),
        "settings": dict(raw.get("settings", {})), "versions": dict(raw.get("versions", {})),
        "num_partitions": int(n), "xcc_ids_seen": seen.tolist(),
        "xcc_count_source": "hipDeviceAttributeNumberOfXccs" if raw.get("num_xcc_attribute") else "ids seen",
        "workgroups_per_xcc": np.bincount(pid_xcc[pid_xcc >= 0], minlength=int(n)).tolist(),
        "round_robin": rr,
        "dispatch_partition": pid_xcc[: max(int(n), min(len(pid_xcc), 64))].tolist(),
        "address_selects_partition": None,
        "untested": "AMD path written from the ISA documentation; never run on hardware by this project",
        "verdict": (f"{n} XCDs; domain = (pid + {rr['offset']}) mod {n} explains {rr['accuracy']:.0%} of workgroups"),
    }


def summary(res: dict) -> str:
    """Human-readable summary of a probe result."""
    lines = [f"numasched probe: {res['device']} ({res['vendor']}, {res['num_sms']} SMs/CUs, "
             f"L2 {res.get('l2_bytes', 0) / 2**20:.0f} MiB)"]
    if res["vendor"] == "amd":
        rr = res["round_robin"]
        lines += [f"  XCDs: {res['num_partitions']} ({res['xcc_count_source']}), workgroups per XCD "
                  f"{res['workgroups_per_xcc']}",
                  f"  round robin: offset {rr['offset']}, explains {rr['accuracy']:.1%} of workgroups",
                  f"  NOTE: {res['untested']}"]
    else:
        lc = res["latency_cycles"]
        clk = res.get("sm_clock_ghz")
        lines.append(f"  SMs covered {res['sms_covered']}/{res['num_sms']}; L2 hit latency min {lc['min']:.0f} "
                     f"median {lc['median']:.0f} max {lc['max']:.0f} cycles" + (f" (SM clock {clk:.2f} GHz)" if clk else ""))
        lines.append(f"  partitions: {res['num_partitions']} of sizes {res['partition_sizes']}")
        if res["num_partitions"] > 1:
            lines.append(f"  near {res['near_cycles']:.0f} cycles, far {res['far_cycles']:.0f} cycles "
                         f"(far/near {res['far_over_near']:.3f}); {res['lines_clear']}/{res['lines']} lines "
                         f"with a clear near partition, per partition {res['lines_near_per_partition']}")
            for c, sms in enumerate(res["partition_sms"]):
                lines.append(f"  partition {c}: SMs {_ranges(sms)}")
            at = res["address_test"]
            bs, bp = at.get("best_single"), at.get("best_pair")
            if bs:
                lines.append(f"  address bits {min(at['bits_tested'])}..{max(at['bits_tested'])}: best single bit "
                             f"{bs['bits']} {bs['accuracy']:.3f}, best pair {bp['bits'] if bp else '-'} "
                             f"{bp['accuracy'] if bp else float('nan'):.3f}, chance {at['chance']:.3f}; "
                             f"per 2 MiB page {at['page']['accuracy']:.3f} over {at['page']['pages']} pages")
        d = res["dispatch"]
        lines.append(f"  dispatch: first wave hits {d['distinct_sms_first_wave']} distinct SMs; first 24 pids -> SMs "
                     f"{d['first_wave_sm'][:24]}")
        if d.get("round_robin"):
            lines.append(f"  round robin over partitions explains {d['round_robin']['accuracy']:.1%} of the first wave")
    lines.append(f"  verdict: {res['verdict']}")
    if res.get("path"):
        lines.append(f"  written: {res['path']}")
    return "\n".join(lines)


def _ranges(ids) -> str:
    ids = sorted(ids)
    out, start = [], None
    for i, s in enumerate(ids):
        if start is None:
            start = s
        if i + 1 == len(ids) or ids[i + 1] != s + 1:
            out.append(f"{start}-{s}" if s != start else f"{s}")
            start = None
    return ", ".join(out)
