"""Test setup: interpreter on CPU-only machines, a GPU marker that skips with a reason."""
import os

import pytest
import torch

HAS_GPU = torch.cuda.is_available()
if not HAS_GPU:
    # Must be set before triton compiles anything: kernels then run in Triton's interpreter.
    os.environ.setdefault("TRITON_INTERPRET", "1")

DEVICE = "cuda" if HAS_GPU else "cpu"


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU (run on the device machine)")
    for item in items:
        if "gpu" in item.keywords and not HAS_GPU:
            item.add_marker(skip_gpu)


def compiled_json(code: str, timeout: int = 300, cwd=None):
    """Run ``code`` in a Python subprocess without TRITON_INTERPRET (offline compiles need a
    process whose kernels were defined compiled) and return the JSON its last line prints."""
    import json
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True,
                       timeout=timeout)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.fixture
def device():
    return DEVICE


@pytest.fixture
def fixed_config():
    """One fixed kernel config on the GPU: autotuning every shape would compile dozens of variants."""
    from numasched import options

    with options.use(autotune=False):
        yield


def decode_reference(q, k_cache, v_cache, lens=None, block_table=None, scale=None):
    """float64 decode attention on q's device: out (B, H, D) and natural-log lse (B, H); zeros and
    -inf for an empty sequence. ``lens`` None: the whole cache; ``block_table``: a paged cache
    (padding entries clamped). GQA without repeating K/V per query head (real sizes fit a GPU)."""
    import math

    B, H, Dh = q.shape
    if block_table is not None:
        bt = block_table.long().clamp(min=0)
        k = k_cache[bt].reshape(B, -1, k_cache.shape[2], Dh)
        v = v_cache[bt].reshape(B, -1, v_cache.shape[2], Dh)
    else:
        k, v = k_cache, v_cache
    HK, L = k.shape[2], k.shape[1]
    lens = torch.full((B,), L) if lens is None else torch.as_tensor(lens)
    scale = 1 / math.sqrt(Dh) if scale is None else scale
    qg = q.double().reshape(B, HK, H // HK, Dh)
    s = torch.einsum("bkgd,blkd->bkgl", qg, k.double()) * scale
    valid = torch.arange(L, device=q.device)[None, :] < lens.to(q.device).long()[:, None]
    s = s.masked_fill(~valid[:, None, None, :], float("-inf"))
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - lse[..., None]).nan_to_num(0.0)
    out = torch.einsum("bkgl,blkd->bkgd", p, v.double())
    return out.reshape(B, H, Dh), lse.reshape(B, H)
