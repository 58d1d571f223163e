"""KV caches for :class:`numasched.models.TPDecoder`: one per backend layout.

* :class:`PagedKVCache` (numasched backend): per layer (num_pages, page_size, kv_heads, head_dim)
  pages with an int32 block table, the layout ``numasched.flash_decode`` reads (vLLM's), or with
  ``head_major`` each page stored (kv_heads, page_size, head_dim) (FlashInfer's HND) and handed
  out as the (num_pages, page_size, kv_heads, head_dim) view of it. Pages are handed out
  contiguously per sequence (sequence b owns pages [b * P, (b + 1) * P)).
* :class:`ContiguousKVCache` (torch backend): per layer (batch, kv_heads, capacity, head_dim),
  the layout torch's SDPA reads without a copy (gpt-fast's static cache).

Both keep the lengths in a device tensor (``lens``, int32 (batch,)) so that a decode step can be
captured in a CUDA graph: a step computes its write slots and the lengths after it from ``lens``
on the device (:meth:`begin_decode`), writes K/V with ``index_copy_`` (:meth:`write`), and
advances ``lens`` in place (:meth:`end_decode`). Nothing reads tensor data on the host.
"""
from __future__ import annotations

from typing import Optional

import torch


class _KVCache:
    """What both layouts share: the sizes, ``lens`` and the per-step buffers."""

    layout = ""

    def __init__(self, *, layers: int, batch: int, capacity: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device):
        for name, v in (("layers", layers), ("batch", batch), ("capacity", capacity), ("kv_heads", kv_heads),
                        ("head_dim", head_dim)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise TypeError(f"dtype must be a floating-point torch.dtype (the K/V values), got {dtype!r}")
        self.layers, self.batch, self.capacity = layers, batch, capacity
        self.kv_heads, self.head_dim, self.dtype = kv_heads, head_dim, dtype
        self.device = torch.device(device)
        self.lens = torch.zeros(batch, dtype=torch.int32, device=self.device)
        # per decode step, recomputed on the device from lens (static buffers: graph-safe)
        self.lens_next = torch.zeros_like(self.lens)
        self.positions = torch.zeros(batch, dtype=torch.int64, device=self.device)
        self._write_index: Optional[torch.Tensor] = None

    # sizes
    def nbytes(self) -> int:
        """Bytes of K and V storage."""
        return 2 * self.k_all.numel() * self.k_all.element_size()

    @staticmethod
    def bytes_for(*, layers: int, batch: int, capacity: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                  page_size: int = 1) -> int:
        """K + V bytes a cache of these sizes takes (capacity rounded up to whole pages)."""
        for name, v in (("layers", layers), ("batch", batch), ("capacity", capacity), ("kv_heads", kv_heads),
                        ("head_dim", head_dim), ("page_size", page_size)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
        cap = -(-capacity // page_size) * page_size
        return 2 * layers * batch * cap * kv_heads * head_dim * torch.empty(0, dtype=dtype).element_size()

    # state
    def reset(self) -> None:
        """Empty every sequence (the K/V memory is left as it is)."""
        self.lens.zero_()

    def fill_random(self, context: int, *, std: float = 1.0, generator: Optional[torch.Generator] = None) -> None:
        """Make every sequence ``context`` tokens long with random K/V (benchmarks: a long context
        without prefilling it)."""
        if isinstance(context, bool) or not isinstance(context, int) or not 0 <= context <= self.capacity:
            raise ValueError(f"context must be an int in [0, capacity={self.capacity}], got {context!r}")
        self.k_all.normal_(0.0, std, generator=generator)
        self.v_all.normal_(0.0, std, generator=generator)
        self.lens.fill_(context)

    # prefill: every sequence starts empty and gets the same number of tokens
    def begin_prefill(self, seq_len: int) -> None:
        """Write slots for tokens 0..seq_len-1 of every sequence; lens becomes seq_len (the prompt
        is written into an empty cache)."""
        if not 1 <= seq_len <= self.capacity:
            raise ValueError(f"prompt length must be in [1, capacity={self.capacity}], got {seq_len}")
        pos = torch.arange(seq_len, device=self.device).expand(self.batch, seq_len)
        self._write_index = self._index(pos)
        self.lens.fill_(seq_len)

    # decode: one token per sequence, written at position lens, attended over lens + 1 tokens
    def begin_decode(self) -> None:
        torch.add(self.lens, 1, out=self.lens_next)
        self.positions.copy_(self.lens)
        self._write_index = self._index(self.positions[:, None])
        self._after_begin_decode()

    def end_decode(self, advance: bool = True) -> None:
        if advance:
            self.lens.copy_(self.lens_next)

    def _after_begin_decode(self) -> None:
        pass

    def _index(self, pos: torch.Tensor) -> torch.Tensor:  # pragma: no cover - per layout
        raise NotImplementedError

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, start: int = 0) -> None:  # pragma: no cover
        """Write k, v (tokens, kv_heads, head_dim) of the tokens ``start``, ``start + 1``, ... of
        this step's write slots (all of them by default)."""
        raise NotImplementedError

    def write_slots(self, tokens: int, start: int = 0) -> torch.Tensor:
        """This step's flat write slots (int64 on the device) of ``tokens`` tokens from token
        ``start``: what :meth:`write` writes at (paged: page * page_size + offset), for a kernel
        that writes the cache itself (numasched.qkv_rope_cache)."""
        if self.layout != "paged":
            raise NotImplementedError(f"write_slots: a {self.layout} cache writes one row per (token, head)")
        return self._write_rows(start, tokens)

    def _write_rows(self, start: int, tokens: int, per_token: int = 1) -> torch.Tensor:
        """This step's write index for ``tokens`` tokens from token ``start`` (tokens counted in
        the step's (sequence, position) order)."""
        if self._write_index is None:
            raise RuntimeError("the cache has no write slots yet: call begin_prefill(seq) or begin_decode() first")
        total = self._write_index.numel() // per_token
        if start == 0 and tokens == total:
            return self._write_index
        if not (0 <= start and start + tokens <= total):
            raise ValueError(f"start={start} with {tokens} tokens is outside this step's {total} write slots")
        return self._write_index[start * per_token:(start + tokens) * per_token]


class PagedKVCache(_KVCache):
    """Paged K/V (num_pages, page_size, kv_heads, head_dim) per layer, int32 block table
    (batch, pages per sequence); what ``numasched.flash_decode(..., block_table=)`` reads.

    ``head_major``: each page is stored (kv_heads, page_size, head_dim), so that one KV head's
    tokens of a page are one contiguous run (a decode program reads page_size x head_dim elements
    in a row instead of page_size rows kv_heads x head_dim apart); :meth:`k` / :meth:`v` are then
    (num_pages, page_size, kv_heads, head_dim) views of that storage (strides (kv_heads *
    page_size * head_dim, head_dim, page_size * head_dim, 1)), which flash_decode and
    qkv_rope_cache take as they are."""

    layout = "paged"

    def __init__(self, *, layers: int, batch: int, capacity: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device, page_size: int = 16, head_major: bool = False):
        if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size < 1:
            raise ValueError(f"page_size must be an integer >= 1, got {page_size!r}")
        if not isinstance(head_major, bool):
            raise TypeError(f"head_major must be True or False, got {head_major!r}")
        super().__init__(layers=layers, batch=batch, capacity=capacity, kv_heads=kv_heads, head_dim=head_dim,
                         dtype=dtype, device=device)
        self.page_size, self.head_major = page_size, head_major
        self.pages_per_seq = -(-capacity // page_size)
        self.capacity = self.pages_per_seq * page_size
        self.num_pages = batch * self.pages_per_seq
        if head_major:
            shape = (layers, self.num_pages, kv_heads, page_size, head_dim)
        else:
            shape = (layers, self.num_pages, page_size, kv_heads, head_dim)
        self.k_all = torch.zeros(shape, dtype=dtype, device=self.device)
        self.v_all = torch.zeros(shape, dtype=dtype, device=self.device)
        self.block_table = torch.arange(self.num_pages, dtype=torch.int32, device=self.device).view(
            batch, self.pages_per_seq)

    def k(self, layer: int) -> torch.Tensor:
        """Layer ``layer``'s K pages as (num_pages, page_size, kv_heads, head_dim) (a strided view
        when head-major)."""
        return self.k_all[layer].transpose(1, 2) if self.head_major else self.k_all[layer]

    def v(self, layer: int) -> torch.Tensor:
        return self.v_all[layer].transpose(1, 2) if self.head_major else self.v_all[layer]

    def _index(self, pos: torch.Tensor) -> torch.Tensor:
        """Flat slot (page * page_size + offset) of each (sequence, position)."""
        ps = self.page_size
        pages = torch.gather(self.block_table, 1, torch.div(pos, ps, rounding_mode="floor").to(torch.int64))
        return (pages.to(torch.int64) * ps + pos % ps).reshape(-1)

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, start: int = 0) -> None:
        """k, v (tokens, kv_heads, head_dim), tokens in (sequence, position) order."""
        idx = self._write_rows(start, k.shape[0])
        if self.head_major:   # (page, offset) of each token into the strided page views
            at = (torch.div(idx, self.page_size, rounding_mode="floor"), idx % self.page_size)
            self.k(layer).index_put_(at, k)
            self.v(layer).index_put_(at, v)
            return
        flat = (self.num_pages * self.page_size, self.kv_heads, self.head_dim)
        self.k_all[layer].view(flat).index_copy_(0, idx, k)
        self.v_all[layer].view(flat).index_copy_(0, idx, v)


class ContiguousKVCache(_KVCache):
    """K/V (batch, kv_heads, capacity, head_dim) per layer: SDPA's layout (gpt-fast's static cache).

    Decode attends over all ``capacity`` slots with an additive length mask, or, when :attr:`window` is set
    (an int fixed when a graph is captured), over the first ``window`` slots with no mask: right
    when every sequence has exactly ``window`` tokens after the step (benchmarks at one context)."""

    layout = "contiguous"

    def __init__(self, *, layers: int, batch: int, capacity: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device, page_size: int = 1):
        super().__init__(layers=layers, batch=batch, capacity=capacity, kv_heads=kv_heads, head_dim=head_dim,
                         dtype=dtype, device=device)
        shape = (layers, batch, kv_heads, capacity, head_dim)
        self.k_all = torch.zeros(shape, dtype=dtype, device=self.device)
        self.v_all = torch.zeros(shape, dtype=dtype, device=self.device)
        self.window: Optional[int] = None
        # additive (0 / -inf) rather than boolean: cuDNN's SDPA was faster with it (H200, batch 1 x 4k: 17 vs 21 us)
        self.mask = torch.zeros(batch, 1, 1, capacity, dtype=dtype, device=self.device)
        self._neg_inf = torch.tensor(float("-inf"), dtype=dtype, device=self.device)
        self._zero = torch.tensor(0.0, dtype=dtype, device=self.device)
        self._slots = torch.arange(capacity, dtype=torch.int32, device=self.device)
        self._rows = (torch.arange(batch, device=self.device)[:, None] * kv_heads
                      + torch.arange(kv_heads, device=self.device)[None, :]) * capacity   # (B, HK)

    def k(self, layer: int) -> torch.Tensor:
        return self.k_all[layer]

    def v(self, layer: int) -> torch.Tensor:
        return self.v_all[layer]

    def set_window(self, window: Optional[int]) -> None:
        """Attend over the first ``window`` slots without a mask (None: the length mask)."""
        if window is not None and (isinstance(window, bool) or not isinstance(window, int)
                                   or not 1 <= window <= self.capacity):
            raise ValueError(f"window must be an int in [1, capacity={self.capacity}] or None, got {window!r}")
        self.window = window

    def _after_begin_decode(self) -> None:
        if self.window is None:
            keep = self._slots[None, :] < self.lens_next[:, None]
            torch.where(keep, self._zero, self._neg_inf, out=self.mask.view(self.batch, self.capacity))

    def _index(self, pos: torch.Tensor) -> torch.Tensor:
        """Flat row of (sequence, kv head, position) in the (B * HK * capacity, D) view, in
        (sequence, position, head) order to match k.reshape(tokens * kv_heads, D)."""
        return (self._rows[:, None, :] + pos.to(torch.int64)[:, :, None]).reshape(-1)

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, start: int = 0) -> None:
        flat = (self.batch * self.kv_heads * self.capacity, self.head_dim)
        idx = self._write_rows(start, k.shape[0], self.kv_heads)
        self.k_all[layer].view(flat).index_copy_(0, idx, k.reshape(-1, self.head_dim))
        self.v_all[layer].view(flat).index_copy_(0, idx, v.reshape(-1, self.head_dim))
