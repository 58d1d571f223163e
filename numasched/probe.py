"""``numasched probe``: measure the locality structure of the GPU at hand.

NVIDIA (tested design; see the report of the run for readings)
---------------------------------------------------------------
Question: does a GPU's L2 have partitions that are near to some SMs and far from others, and if
so, can a program choose a line's home partition by its address (so that placing a work item on
the right SMs makes its accesses near)?

Method, one kernel launch for every SM at once:

1. Launch ``programs_per_sm * num_sms`` one-warp programs. Each reads its SM id (``%smid``).
2. For each of N random 128-byte lines of a zeroed 24 MB buffer, the program does one warm-up load
   (the line is then in L2), then ``iters`` *dependent* loads ``v = load(p + v)`` that bypass L1
   (``ld.global.cg``): each load must wait for the previous one, so the time between two
   ``%clock64`` reads divided by ``iters`` is the L2 hit latency of that line seen from that SM.
3. The host keeps, per SM and line, the fastest program on that SM (least disturbed).

Analysis (pure NumPy, tested on CPU with planted structure): cluster SMs by their latency
profile over lines (:func:`cluster_sms`), find each line's near partition
(:func:`line_partitions`), test whether single address bits or pairs of bits (7..24) predict the
near partition (:func:`address_bit_test`), and summarise the program-id -> SM order of the first
wave (:func:`dispatch_summary`).

The kernel cannot run in Triton's interpreter (inline assembly has no interpreter path): without
a GPU the command says so and exits; ``--from-raw FILE.npz`` re-analyses a saved measurement.

AMD (UNTESTED ON HARDWARE)
--------------------------
Reads each workgroup's XCC id with ``s_getreg_b32 hwreg(HW_REG_XCC_ID, 0, 4)`` (register id 20,
bits 3:0 on gfx940/941/942, per the LLVM AMDGPU hwreg tables; it assembles for gfx942 with the
Triton 3.6 toolchain) and the XCC count from ``hipDeviceGetAttribute(..., 10018)``
(hipDeviceAttributeNumberOfXccs, HIP >= 7), then checks domain(pid) = (pid + offset) mod n.
No AMD GPU was available to this project: this path has never run on hardware.
"""
from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import re
import sys
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

__all__ = [
    "ProbeUnavailable", "probe", "measure", "analyze", "save", "load_raw", "default_path", "summary",
    "sm_latency_matrix", "cluster_sms", "line_partitions", "address_bit_test", "round_robin_fit",
    "dispatch_summary", "kernel_asm", "add_parser",
]

LINE = 128                      # bytes per L2 line (Hopper, CDNA3)
BUFFER_BYTES = 24 << 20         # spans address bits up to 24; fits every L2 probed (H100 50 MB)
PAGE_SHIFT = 21                 # 2 MiB GPU pages: bits >= 21 of a virtual address are not physical bits
DEFAULTS = dict(lines=2048, iters=32, programs_per_sm=4)
QUICK = dict(lines=512, iters=16, programs_per_sm=2)


class ProbeUnavailable(RuntimeError):
    """The probe cannot run here (no GPU, interpreter mode, unsupported vendor)."""


# ============================================================================ Triton kernels
import triton  # noqa: E402
import triton.language as tl  # noqa: E402


@triton.jit
def _smid():
    # Hardware id of the SM this program runs on.
    return tl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r", [], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _clock(after):
    # SM cycle counter. `after` is an unused operand: it orders this read after the value that
    # `after` depends on (in the SASS a consumer of the last load precedes the clock read).
    return tl.inline_asm_elementwise("mov.u64 $0, %clock64;", "=l,l", [after], dtype=tl.int64,
                                     is_pure=False, pack=1)


@triton.jit
def _globaltimer(after):
    # Nanosecond timer, to convert cycles to time.
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,l", [after], dtype=tl.int64,
                                     is_pure=False, pack=1)


@triton.jit
def _load_cg(ptr):
    # 8-byte load cached at L2 only (bypasses L1), so every load of the chain is an L2 access.
    return tl.inline_asm_elementwise("ld.global.cg.u64 $0, [$1];", "=l,l", [ptr], dtype=tl.int64,
                                     is_pure=False, pack=1)


@triton.jit
def _l2_latency_kernel(buf_ptr, offs_ptr, lat_ptr, sm_ptr, clk_ptr, n_lines, iters):
    # One program = one warp; all values are scalars, so the lanes do the same loads (one request).
    pid = tl.program_id(0)
    sm = _smid()
    c_start = _clock(pid.to(tl.int64))
    g_start = _globaltimer(c_start)
    sink = tl.zeros((), tl.int64)
    for j in range(n_lines):
        p = buf_ptr + tl.load(offs_ptr + j)      # first 8 bytes of line j
        v = _load_cg(p)                          # warm-up: line now in L2
        q = p + v                                # buf is zero: q == p, but the compiler cannot know
        t0 = _clock(q)
        for i in range(iters):
            v = _load_cg(q)                      # waits for the previous load: latency, not throughput
            q = p + v
        t1 = _clock(q)
        tl.store(lat_ptr + pid * n_lines + j, (t1 - t0).to(tl.float32) / iters)
        sink += v
    c_end = _clock(sink)
    g_end = _globaltimer(c_end)
    tl.store(clk_ptr + 2 * pid, c_end - c_start)
    tl.store(clk_ptr + 2 * pid + 1, g_end - g_start)
    # sink is 0 (zeroed buffer); adding it keeps the loads alive and checks the buffer was zero.
    tl.store(sm_ptr + pid, sm + sink.to(tl.int32))


@triton.jit
def _xcc_id_kernel(out_ptr):
    # AMD gfx942 (UNTESTED ON HARDWARE): XCC (die) that runs this workgroup; HW_REG_XCC_ID = 20, bits 3:0.
    pid = tl.program_id(0)
    xcc = tl.inline_asm_elementwise("s_getreg_b32 $0, hwreg(HW_REG_XCC_ID, 0, 4)", "=s", [], dtype=tl.int32,
                                    is_pure=False, pack=1)
    tl.store(out_ptr + pid, xcc)


_SIGNATURES = {
    "_l2_latency_kernel": {"buf_ptr": "*i64", "offs_ptr": "*i64", "lat_ptr": "*fp32", "sm_ptr": "*i32",
                           "clk_ptr": "*i64", "n_lines": "i32", "iters": "i32"},
    "_xcc_id_kernel": {"out_ptr": "*i32"},
}


def kernel_asm(arch: str = "sm_90") -> dict:
    """Compile the probe kernel for ``arch`` ("sm_90", "gfx942", ...) without a GPU; returns its asm stages.

    For inspection (PTX/SASS ordering of clock reads and loads) and for CPU tests. Needs
    TRITON_INTERPRET unset when this module was imported.
    """
    from triton.backends.compiler import GPUTarget
    from triton.runtime.jit import JITFunction

    if arch.startswith("sm_"):
        fn, target = _l2_latency_kernel, GPUTarget("cuda", int(arch[3:]), 32)
    elif arch.startswith("gfx"):
        fn, target = _xcc_id_kernel, GPUTarget("hip", arch, 64)
    else:
        raise ValueError(f"arch must look like 'sm_90' or 'gfx942', got {arch!r}")
    if not isinstance(fn, JITFunction):
        raise ProbeUnavailable("kernel_asm: TRITON_INTERPRET=1 was set when numasched.probe was imported; "
                               "the kernels are interpreter objects and cannot be compiled")
    src = triton.compiler.ASTSource(fn=fn, signature=_SIGNATURES[fn.__name__], constexprs={})
    return dict(triton.compile(src, target=target, options={"num_warps": 1}).asm)


# ============================================================================ measurement (GPU)
def _require_gpu(device=None):
    try:
        import torch
    except ImportError as e:  # pragma: no cover - torch is a dependency
        raise ProbeUnavailable(f"torch is not importable ({e})") from e
    if not torch.cuda.is_available():
        raise ProbeUnavailable("no GPU visible (torch.cuda.is_available() is False). The probe times "
                               "inline-assembly loads on the GPU and has no CPU/interpreter path; run it "
                               "on a machine with an NVIDIA (or AMD) GPU, or re-analyse a saved "
                               "measurement with --from-raw FILE.npz")
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise ProbeUnavailable("TRITON_INTERPRET=1 is set: the probe's inline assembly has no interpreter "
                               "path; unset TRITON_INTERPRET and run again")
    dev = torch.device("cuda", torch.cuda.current_device() if device is None else int(device))
    return torch, dev


def measure(*, lines: int = DEFAULTS["lines"], iters: int = DEFAULTS["iters"],
            programs_per_sm: int = DEFAULTS["programs_per_sm"], buffer_bytes: int = BUFFER_BYTES,
            seed: int = 0, device=None, bandwidth: bool = True) -> dict:
    """Run the probe kernel once (after one warm-up launch) and return the raw measurement.

    Raw keys: vendor, device, num_sms, l2_bytes, lat (programs x lines, cycles per load),
    pid_sm (SM of each program), addresses (virtual byte address of each line), clocks
    (programs x [cycles, ns]), settings, hbm_bytes_per_s. On AMD: see :func:`_measure_amd`.
    """
    torch, dev = _require_gpu(device)
    if getattr(torch.version, "hip", None):
        return _measure_amd(torch, dev, programs_per_sm=programs_per_sm)
    for name, v, lo in (("lines", lines, 16), ("iters", iters, 1), ("programs_per_sm", programs_per_sm, 1),
                        ("buffer_bytes", buffer_bytes, 1 << 20)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < lo:
            raise ValueError(f"{name} must be an integer >= {lo}, got {v!r}")
    if lines > buffer_bytes // LINE:
        raise ValueError(f"lines ({lines}) exceeds the {buffer_bytes // LINE} lines of buffer_bytes={buffer_bytes}")
    props = torch.cuda.get_device_properties(dev)
    nsm = props.multi_processor_count
    # Zeroed buffer: every load returns 0, so the dependent chain stays on its line.
    buf = torch.zeros(buffer_bytes // 8, dtype=torch.int64, device=dev)
    rng = np.random.default_rng(seed)
    line_idx = rng.choice(buffer_bytes // LINE, size=lines, replace=False).astype(np.int64)
    offs = torch.from_numpy(line_idx * (LINE // 8)).to(dev)
    n_prog = programs_per_sm * nsm
    lat = torch.empty((n_prog, lines), dtype=torch.float32, device=dev)
    pid_sm = torch.empty(n_prog, dtype=torch.int32, device=dev)
    clocks = torch.empty((n_prog, 2), dtype=torch.int64, device=dev)
    with torch.cuda.device(dev):
        for _ in range(2):  # first launch compiles and fills L2 and TLBs; the second is the measurement
            lat.fill_(float("nan"))
            pid_sm.fill_(-1)
            clocks.fill_(-1)
            _l2_latency_kernel[(n_prog,)](buf, offs, lat, pid_sm, clocks, lines, iters, num_warps=1)
        torch.cuda.synchronize()
        hbm = None
        if bandwidth:
            try:
                from .bench.common import stream_read_bw

                hbm = float(stream_read_bw())
            except Exception:  # a failed bandwidth reading must not lose the latency probe
                hbm = None
    return {
        "vendor": "nvidia", "device": props.name, "compute_capability": f"{props.major}.{props.minor}",
        "num_sms": int(nsm), "l2_bytes": int(getattr(props, "L2_cache_size", 0)),
        "lat": lat.cpu().numpy().astype(np.float64), "pid_sm": pid_sm.cpu().numpy().astype(np.int64),
        "addresses": (buf.data_ptr() + line_idx * LINE).astype(np.uint64),
        "clocks": clocks.cpu().numpy(), "hbm_bytes_per_s": hbm,
        "settings": dict(lines=int(lines), iters=int(iters), programs_per_sm=int(programs_per_sm),
                         buffer_bytes=int(buffer_bytes), seed=int(seed)),
        "versions": {"torch": torch.__version__, "triton": triton.__version__},
    }


def _hip_xcc_count(device_index: int) -> Optional[int]:
    """hipDeviceGetAttribute(hipDeviceAttributeNumberOfXccs = 10018); None where not available (HIP < 7)."""
    import ctypes

    try:
        hip = ctypes.CDLL("libamdhip64.so")
        n = ctypes.c_int(0)
        if hip.hipDeviceGetAttribute(ctypes.byref(n), ctypes.c_int(10018), ctypes.c_int(device_index)) == 0:
            return int(n.value) if n.value > 0 else None
    except OSError:
        pass
    return None


def _measure_amd(torch, dev, *, programs_per_sm: int) -> dict:
    """UNTESTED ON HARDWARE: XCC id of every workgroup of one launch, and the XCC count."""
    props = torch.cuda.get_device_properties(dev)
    n_prog = max(1, programs_per_sm) * props.multi_processor_count
    out = torch.full((n_prog,), -1, dtype=torch.int32, device=dev)
    with torch.cuda.device(dev):
        _xcc_id_kernel[(n_prog,)](out, num_warps=1)
        torch.cuda.synchronize()
    return {"vendor": "amd", "device": props.name, "arch": getattr(props, "gcnArchName", ""),
            "num_sms": int(props.multi_processor_count), "l2_bytes": int(getattr(props, "L2_cache_size", 0)),
            "pid_xcc": out.cpu().numpy().astype(np.int64), "num_xcc_attribute": _hip_xcc_count(dev.index),
            "settings": dict(programs_per_sm=int(programs_per_sm)),
            "versions": {"torch": torch.__version__, "triton": triton.__version__}}


# ============================================================================ analysis (pure NumPy)
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


# ============================================================================ files and the API
def _slug(name: str) -> str:
    n = name.lower()
    for key in ("h200", "h100", "h20", "b200", "gb200", "a100", "l40s", "mi300x", "mi325x", "mi350x", "mi355x"):
        if re.search(rf"\b{key}\b", n.replace("-", " ")):
            return key
    return re.sub(r"[^a-z0-9]+", "-", n).strip("-")[:40] or "gpu"


def default_path(device_name: str) -> Path:
    """~/.cache/numasched/probe-<device>.json (NUMASCHED_CACHE or XDG_CACHE_HOME override the folder)."""
    root = os.environ.get("NUMASCHED_CACHE") or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "numasched"
    return Path(root) / f"probe-{_slug(device_name)}.json"


def _jsonable(o):
    if isinstance(o, dict):
        return {str(k): _jsonable(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [_jsonable(v) for v in o]
    if isinstance(o, np.integer):
        return int(o)
    if isinstance(o, np.floating):
        o = float(o)
    if isinstance(o, float) and not math.isfinite(o):
        return None
    if isinstance(o, np.ndarray):
        return _jsonable(o.tolist())
    return o


def save(result: dict, path, raw: Optional[dict] = None) -> Path:
    """Write the result JSON; with ``raw``, also the raw measurement next to it (same stem, .npz)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(_jsonable(result), indent=1) + "\n")
    if raw is not None:
        arrays = {k: np.asarray(v) for k, v in raw.items() if isinstance(v, np.ndarray)}
        meta = {k: v for k, v in raw.items() if not isinstance(v, np.ndarray)}
        np.savez_compressed(path.with_suffix(".npz"), meta=np.array(json.dumps(_jsonable(meta))), **arrays)
    return path


def load_raw(path) -> dict:
    """Read a raw measurement written by :func:`save` (for re-analysis on any machine)."""
    with np.load(Path(path), allow_pickle=False) as z:
        raw = json.loads(str(z["meta"])) if "meta" in z.files else {}
        raw.update({k: z[k] for k in z.files if k != "meta"})
    return raw


def probe(*, quick: bool = False, out=None, save_raw: bool = True, device=None, max_partitions: int = 4,
          **settings) -> dict:
    """Measure and analyse; write JSON to ``out`` (default :func:`default_path`). Returns the result dict.

    ``settings``: lines, iters, programs_per_sm, buffer_bytes, seed, bandwidth (see :func:`measure`).
    Raises :class:`ProbeUnavailable` without a GPU.
    """
    kw = dict(QUICK if quick else DEFAULTS)
    kw.update({k: v for k, v in settings.items() if v is not None})
    raw = measure(device=device, **kw)
    result = analyze(raw, max_partitions=max_partitions)
    result["settings"]["quick"] = bool(quick)
    path = Path(out) if out else default_path(result["device"])
    save(result, path, raw if save_raw else None)
    result["path"] = str(path)
    return result


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


# ============================================================================ CLI
def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "probe", help="measure the locality structure of the GPU at hand",
        description="Per-SM L2 hit latency by line: L2 partitions, near/far latency, whether a line's partition "
                    "follows its address, and the program -> SM dispatch order. Writes JSON for "
                    "Topology.from_probe. AMD: XCC id per workgroup (untested on hardware).")
    p.add_argument("--out", type=Path, help="JSON output (default ~/.cache/numasched/probe-<device>.json); "
                   "the raw measurement goes next to it as .npz")
    p.add_argument("--quick", action="store_true", help=f"small probe ({QUICK}); a few seconds of GPU time")
    p.add_argument("--lines", type=int, help=f"random 128-byte lines (default {DEFAULTS['lines']})")
    p.add_argument("--iters", type=int, help=f"dependent loads per line (default {DEFAULTS['iters']})")
    p.add_argument("--programs-per-sm", type=int, help=f"programs per SM (default {DEFAULTS['programs_per_sm']})")
    p.add_argument("--buffer-mb", type=int, default=BUFFER_BYTES >> 20, help="buffer the lines are drawn from")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-partitions", type=int, default=4)
    p.add_argument("--no-raw", action="store_true", help="do not write the raw .npz")
    p.add_argument("--no-bandwidth", action="store_true", help="skip the streaming-read bandwidth reading")
    p.add_argument("--from-raw", type=Path, metavar="NPZ", help="re-analyse a saved raw measurement (no GPU needed)")
    p.set_defaults(func=_cli)
    return p


def _cli(args) -> int:
    for name in ("lines", "iters", "programs_per_sm", "buffer_mb", "max_partitions"):
        v = getattr(args, name)
        if v is not None and v < 1:
            print(f"numasched probe: --{name.replace('_', '-')} must be >= 1, got {v}", file=sys.stderr)
            return 2
    try:
        if args.from_raw:
            if not args.from_raw.exists():
                print(f"numasched probe: --from-raw {args.from_raw}: no such file", file=sys.stderr)
                return 2
            raw = load_raw(args.from_raw)
            res = analyze(raw, max_partitions=args.max_partitions)
            path = args.out or default_path(res["device"])
            save(res, path)
            res["path"] = str(path)
        else:
            res = probe(quick=args.quick, out=args.out, save_raw=not args.no_raw, max_partitions=args.max_partitions,
                        lines=args.lines, iters=args.iters, programs_per_sm=args.programs_per_sm,
                        buffer_bytes=args.buffer_mb << 20, seed=args.seed, bandwidth=not args.no_bandwidth)
    except ProbeUnavailable as e:
        print(f"numasched probe: {e}", file=sys.stderr)
        return 2
    except ValueError as e:
        print(f"numasched probe: {e}", file=sys.stderr)
        return 2
    print(summary(res))
    return 0
