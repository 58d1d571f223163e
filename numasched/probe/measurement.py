"""Running the probe on a GPU: launch the kernels of :mod:`numasched.kernels.probe` and return
the raw measurement (:func:`measure`), or measure, analyse and save in one call (:func:`probe`).

Nothing here runs on a CPU: without a GPU (or with TRITON_INTERPRET=1) the calls raise
:class:`ProbeUnavailable`. The kernels are imported on first use, so importing this module (and
the analysis beside it) needs neither a GPU nor a Triton compile.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

import numpy as np

from .analysis import analyze
from .files import default_path, save

__all__ = ["ProbeUnavailable", "LINE", "BUFFER_BYTES", "DEFAULTS", "QUICK", "measure", "probe"]

LINE = 128                      # bytes per L2 line (Hopper, CDNA3)
BUFFER_BYTES = 24 << 20         # spans address bits up to 24; fits every L2 probed (H100 50 MB)
DEFAULTS = dict(lines=2048, iters=32, programs_per_sm=4)
QUICK = dict(lines=512, iters=16, programs_per_sm=2)


class ProbeUnavailable(RuntimeError):
    """The probe cannot run here (no GPU, interpreter mode, unsupported vendor)."""


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
    import triton

    from numasched.kernels.probe import _l2_latency_kernel

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
            _l2_latency_kernel[(n_prog,)](buf, offs, lat, pid_sm, clocks, lines, iters, AMD=False, num_warps=1)
        torch.cuda.synchronize()
        hbm = None
        if bandwidth:
            try:
                from .bandwidth import stream_read_bw

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
    """UNTESTED ON HARDWARE: XCC id of every workgroup of one launch, and the XCC count.

    (The L2 latency kernel has an AMD path too -- ``AMD=True``: s_memtime, s_memrealtime, sc1
    loads, CU id from HW_ID/XCC_ID -- that compiles for gfx942/gfx950, but it is not launched
    here: with no AMD GPU to check it against, only the XCC order is measured.)"""
    import triton

    from numasched.kernels.probe import _xcc_id_kernel

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
