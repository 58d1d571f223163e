"""Domain remaps: bijections of [0, W) that make consecutive logical ids share a domain.

Under round-robin dispatch program g runs on domain g mod X. A remap returns the *logical* id
g' that program g should work on; orders (attention, gemm) then turn g' into a work item.
"""
import numpy as np
import triton
import triton.language as tl

from ._registry import Policy, Remap, register


# ---------------------------------------------------------------------------- identity
def _identity_ref(g, W, X, param):
    return np.asarray(g, dtype=np.int64)


@triton.jit
def identity_remap(pid, W, NUM_DOMAINS: tl.constexpr, PARAM: tl.constexpr):
    return pid


IDENTITY = Remap("identity", _identity_ref, identity_remap, doc="g' = g")


# ---------------------------------------------------------------------------- contiguous
def _contiguous_ref(g, W, X, param):
    # q = W div X, r = W mod X; domain x = g mod X gets the contiguous run starting at x*q + min(x, r).
    g = np.asarray(g, dtype=np.int64)
    q, r = W // X, W % X
    x = g % X
    return x * q + np.minimum(x, r) + g // X


@triton.jit
def contiguous_remap(pid, W, NUM_DOMAINS: tl.constexpr, PARAM: tl.constexpr):
    q = W // NUM_DOMAINS
    r = W % NUM_DOMAINS
    x = pid % NUM_DOMAINS
    return x * q + tl.minimum(x, r) + pid // NUM_DOMAINS


CONTIGUOUS = Remap(
    "xcd_remap", _contiguous_ref, contiguous_remap,
    doc="contiguous remap (aiter remap_xcd, tritonBLAS chiplet_transform): domain x owns one "
        "contiguous run of W/X logical ids (the first W mod X domains one more). Bijective for every W, X.")


# ---------------------------------------------------------------------------- chunked
def _chunked_ref(g, W, X, C):
    g = np.asarray(g, dtype=np.int64)
    F = (W // (X * C)) * (X * C)  # ids >= F (a partial round) stay as they are
    l = g // X
    out = (l // C) * X * C + (g % X) * C + (l % C)
    return np.where(g < F, out, g)


@triton.jit
def chunked_remap(pid, W, NUM_DOMAINS: tl.constexpr, PARAM: tl.constexpr):
    # PARAM is the chunk C (>= 1, checked on the host)
    F = (W // (NUM_DOMAINS * PARAM)) * (NUM_DOMAINS * PARAM)
    l = pid // NUM_DOMAINS
    out = (l // PARAM) * (NUM_DOMAINS * PARAM) + (pid % NUM_DOMAINS) * PARAM + (l % PARAM)
    return tl.where(pid < F, out, pid)


CHUNKED = Remap(
    "xcd_remap_chunked", _chunked_ref, chunked_remap, default_param=8,
    doc="chunked remap with chunk C (PARAM): runs of C logical ids on one domain, round-robin over "
        "domains; the last partial round (ids >= floor(W/(X*C))*X*C) is left in place, which keeps it "
        "a bijection for every W.")

register(Policy("identity", "remap", IDENTITY, doc=IDENTITY.doc))
register(Policy("xcd_remap", "remap", CONTIGUOUS, doc=CONTIGUOUS.doc))
register(Policy("xcd_remap_chunked", "remap", CHUNKED, remap_param=CHUNKED.default_param, doc=CHUNKED.doc))
