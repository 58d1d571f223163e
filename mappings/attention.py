"""Attention orders: logical id -> (batch, head, q_block), and the SHM-style swizzles.

Grid: batch B, query heads H, KV heads HK (group G = H / HK), query blocks per head NB;
W = B * H * NB programs. Batch is the outermost index in every order. For decode the same
orders run on ``DecodeGrid(batch, kv_heads, splits)`` (H = HK, NB = splits).

Orders (mappings.md has the sources):
* block_first: consecutive ids walk heads; a head's blocks are H ids apart.
* head_first: consecutive ids walk a head's blocks (Triton's default flash-attention grid).
  Query heads of one KV group are adjacent, so a KV group's work is one contiguous id run.
* swizzled_block_first: block_first, with the head index remapped so that, under round-robin
  dispatch, domain x owns the head band [x*H/X, (x+1)*H/X).
* swizzled_head_first (SHM): the contiguous domain remap, then head_first. Domain x receives one
  contiguous run of W/X logical ids, i.e. whole KV groups (ACCs = one (batch, kv_head)) one
  after another, all blocks of an ACC before the next. Properties (tests/test_mappings.py):
  - every ACC lies on one domain when X divides the number of ACCs B*HK;
  - otherwise at most X-1 ACCs straddle domains (each of the X-1 run boundaries cuts at most
    one ACC); it stays a bijection for every shape;
  - it equals the SHM paper's formula with the batch folded into the head index
    (h' = b*H + h over B*H heads) whenever X | B*H; for B = 1 that is the paper's formula.
    The per-batch folding of mappings.md (b = g div (H*NB), SHM inside each batch) differs for
    B > 1 on purpose: it splits every KV group over several domains when X | H but X does not
    divide HK (GQA), even where X | B*HK would let each group stay whole.
"""
import numpy as np
import triton
import triton.language as tl

from ._registry import Order, Policy, register
from .remap import CONTIGUOUS, IDENTITY, _contiguous_ref, contiguous_remap


def _split_batch(g, H, NB):
    return g // (H * NB), g % (H * NB)


# ---------------------------------------------------------------------------- block_first
def _block_first_ref(g, grid, X, param):
    B, H, HK, NB = grid.dims
    b, g0 = _split_batch(g, H, NB)
    return np.stack([b, g0 % H, g0 // H], axis=1)


@triton.jit
def block_first_order(pid, B, H, HK, NB, NUM_DOMAINS: tl.constexpr, PARAM: tl.constexpr):
    b = pid // (H * NB)
    g0 = pid % (H * NB)
    return b, g0 % H, g0 // H


# ---------------------------------------------------------------------------- head_first
def _head_first_ref(g, grid, X, param):
    B, H, HK, NB = grid.dims
    b, g0 = _split_batch(g, H, NB)
    return np.stack([b, g0 // NB, g0 % NB], axis=1)


@triton.jit
def head_first_order(pid, B, H, HK, NB, NUM_DOMAINS: tl.constexpr, PARAM: tl.constexpr):
    b = pid // (H * NB)
    g0 = pid % (H * NB)
    return b, g0 // NB, g0 % NB


# ---------------------------------------------------------------------------- swizzled_block_first
def _swizzled_block_first_ref(g, grid, X, param):
    B, H, HK, NB = grid.dims
    b, g0 = _split_batch(g, H, NB)
    # the head slot of block_first goes through the contiguous remap over H heads
    return np.stack([b, _contiguous_ref(g0 % H, H, X, 0), g0 // H], axis=1)


@triton.jit
def swizzled_block_first_order(pid, B, H, HK, NB, NUM_DOMAINS: tl.constexpr, PARAM: tl.constexpr):
    b = pid // (H * NB)
    g0 = pid % (H * NB)
    h = contiguous_remap(g0 % H, H, NUM_DOMAINS, PARAM)
    return b, h, g0 // H


BLOCK_FIRST = Order("block_first", "attention", _block_first_ref, block_first_order,
                    doc="b = g div (H*NB); h = g0 mod H; m = g0 div H")
HEAD_FIRST = Order("head_first", "attention", _head_first_ref, head_first_order,
                   doc="b = g div (H*NB); h = g0 div NB; m = g0 mod NB")
SWIZZLED_BLOCK_FIRST = Order("swizzled_block_first", "attention", _swizzled_block_first_ref,
                             swizzled_block_first_order,
                             doc="block_first with h = contiguous_remap(g0 mod H over H heads)")

register(Policy("block_first", "attention", IDENTITY, BLOCK_FIRST, doc=BLOCK_FIRST.doc))
register(Policy("head_first", "attention", IDENTITY, HEAD_FIRST, doc=HEAD_FIRST.doc))
register(Policy("swizzled_block_first", "attention", IDENTITY, SWIZZLED_BLOCK_FIRST,
                doc=SWIZZLED_BLOCK_FIRST.doc))
register(Policy("swizzled_head_first", "attention", CONTIGUOUS, HEAD_FIRST,
                doc="SHM: contiguous domain remap, then head_first; a KV group's work stays on one "
                    "domain when X divides B*HK"))
