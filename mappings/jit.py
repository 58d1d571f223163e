"""Device-side helpers: a mapping policy in any Triton kernel, through one constexpr.

A kernel takes the policy as ``MAPPING: tl.constexpr`` and asks for its work item::

    @triton.jit
    def my_gemm(A, B, C, M, N, K, ..., MAPPING: tl.constexpr, BLOCK_M: tl.constexpr, ...):
        tm, tn = gemm_tile(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), MAPPING)
        ...

    my_gemm[grid](..., MAPPING=numasched.mappings.kernel_arg("grouped", "gemm"))

``MAPPING`` is the tuple ``(REMAP, REMAP_PARAM, ORDER, ORDER_PARAM, NUM_DOMAINS)`` of
:meth:`Policy.constexpr`; Triton specialises the kernel on it, so each policy compiles once and
costs no more than hand-written index math. One helper per kernel kind:

* :func:`gemm_tile`: program id -> (tile_m, tile_n) over a tiles_m x tiles_n grid;
* :func:`attention_item`: program id -> (batch, head, q_block);
* :func:`decode_item`: program id -> (batch, kv_head, split);
* :func:`remap_pid`: the domain remap alone (ids 0..W-1 -> 0..W-1).

They apply exactly the math of :meth:`Policy.reference` (the property tests check every
registered policy id for id), so the NumPy reference tells where each program's work lands.
"""
import triton
import triton.language as tl


@triton.jit
def remap_pid(pid, W, MAPPING: tl.constexpr):
    """Logical id of program ``pid`` among ``W`` programs (the policy's domain remap)."""
    return MAPPING[0](pid, W, MAPPING[4], MAPPING[1])


@triton.jit
def gemm_tile(pid, tiles_m, tiles_n, MAPPING: tl.constexpr):
    """(tile_m, tile_n) that program ``pid`` computes, for a GEMM policy."""
    g = MAPPING[0](pid, tiles_m * tiles_n, MAPPING[4], MAPPING[1])
    return MAPPING[2](g, tiles_m, tiles_n, MAPPING[4], MAPPING[3])


@triton.jit
def attention_item(pid, batch, heads, kv_heads, blocks, MAPPING: tl.constexpr):
    """(batch, head, block) that program ``pid`` computes, for an attention policy; ``heads``
    query heads share ``kv_heads`` KV heads (GQA), ``blocks`` query blocks per head."""
    g = MAPPING[0](pid, batch * heads * blocks, MAPPING[4], MAPPING[1])
    return MAPPING[2](g, batch, heads, kv_heads, blocks, MAPPING[4], MAPPING[3])


@triton.jit
def decode_item(pid, batch, kv_heads, splits, MAPPING: tl.constexpr):
    """(batch, kv_head, split) that program ``pid`` computes, for a decode (attention-kind) policy."""
    g = MAPPING[0](pid, batch * kv_heads * splits, MAPPING[4], MAPPING[1])
    return MAPPING[2](g, batch, kv_heads, kv_heads, splits, MAPPING[4], MAPPING[3])


@triton.jit
def gemm_split_unit(pid, tiles_m, tiles_n, splits, MAPPING: tl.constexpr):
    """(tile_m, tile_n, split) that program ``pid`` computes when each output tile's K range is cut
    into ``splits`` parts (split-K work units). The domain remap runs over all
    ``tiles_m * tiles_n * splits`` units, whose logical order keeps a tile's splits together, so
    under round-robin dispatch the splits of a tile (and the partial sums they exchange) share a
    locality domain; the tile then goes through the policy's order."""
    g = MAPPING[0](pid, tiles_m * tiles_n * splits, MAPPING[4], MAPPING[1])
    tm, tn = MAPPING[2](g // splits, tiles_m, tiles_n, MAPPING[4], MAPPING[3])
    return tm, tn, g % splits


@triton.jit
def gemm_tail_unit(pid, tiles_m, tiles_n, whole_tiles, splits, MAPPING: tl.constexpr):
    """(tile_m, tile_n, split, whole) for a grid whose first ``whole_tiles`` tiles (in the policy's
    order: the full waves) run whole and whose remaining tiles are cut into ``splits`` K parts
    each, so the last wave's work is spread over every SM. Units 0 .. whole_tiles - 1 are whole
    tiles, then a remainder tile's splits are consecutive; the domain remap runs over all units."""
    units = whole_tiles + (tiles_m * tiles_n - whole_tiles) * splits
    g = MAPPING[0](pid, units, MAPPING[4], MAPPING[1])
    whole = g < whole_tiles
    rest = tl.maximum(g - whole_tiles, 0)
    tile = tl.where(whole, g, whole_tiles + rest // splits)
    tm, tn = MAPPING[2](tile, tiles_m, tiles_n, MAPPING[4], MAPPING[3])
    return tm, tn, tl.where(whole, 0, rest % splits), whole
