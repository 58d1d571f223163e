"""Probe results on disk: the result JSON, the raw measurement next to it (.npz), the default path."""
from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path
from typing import Optional

import numpy as np

__all__ = ["default_path", "save", "load_raw"]


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
    try:
        z = np.load(Path(path), allow_pickle=False)
    except (OSError, ValueError, EOFError) as e:
        raise ValueError(f"{path} is not a numasched raw probe file (.npz written by numasched probe): "
                         f"{type(e).__name__}") from None
    if not hasattr(z, "files"):   # a bare .npy array, not an archive
        raise ValueError(f"{path} is not a numasched raw probe file (.npz written by numasched probe)")
    with z:
        raw = json.loads(str(z["meta"])) if "meta" in z.files else {}
        raw.update({k: z[k] for k in z.files if k != "meta"})
    return raw
