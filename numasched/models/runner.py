"""One decode step (every layer, the final norm, lm_head) replayed from a CUDA graph.

    runner = DecodeRunner(model, backend, cache)      # captures on CUDA; eager on CPU
    logits = runner(next_ids)                         # (batch, vocab); cache.lens += 1 on the device

The step reads its token ids from a static buffer and its positions, block table and lengths
from the cache's device tensors, so one capture serves every step of a generation. Before the
capture the step runs twice on a side stream (what torch asks; it also compiles the Triton kernels,
plans numasched's calls and makes the first call of each distributed op, which exchanges a header
between ranks), and ``cache.lens`` is put back afterwards. The logits tensor is the graph's
static output: the next replay overwrites it (clone it to keep it).
"""
from __future__ import annotations

from typing import Optional

import torch


class DecodeRunner:
    """A captured decode step of ``model`` on ``backend`` over ``cache``.

    graph: capture a CUDA graph (default: when the cache is on a CUDA device); False runs the same
        step eagerly (CPU, or to time the launch overhead).
    advance: each step advances ``cache.lens`` (generation). False replays the step at the same
        position (benchmarks at a fixed context).
    """

    def __init__(self, model, backend, cache, *, graph: Optional[bool] = None, advance: bool = True):
        self.model, self.backend, self.cache, self.advance = model, backend, cache, bool(advance)
        self.tokens = torch.zeros(cache.batch, dtype=torch.int64, device=cache.device)
        self._rope = model.rope_table(cache.capacity)   # kept alive: the graph reads it by address
        self.graph = None
        self.logits: Optional[torch.Tensor] = None
        use_graph = cache.device.type == "cuda" if graph is None else bool(graph)
        if use_graph:
            self.capture()

    def step_eager(self) -> torch.Tensor:
        """One step without the graph (what the graph holds)."""
        self.logits = self.model.decode(self.tokens, self.cache, self.backend, advance=self.advance)
        return self.logits

    def capture(self, warmup: int = 2) -> None:
        saved = self.cache.lens.clone()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(warmup):
                self.step_eager()
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        self.cache.lens.copy_(saved)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self.logits = self.model.decode(self.tokens, self.cache, self.backend, advance=self.advance)
        torch.cuda.synchronize()
        self.cache.lens.copy_(saved)
        self.graph = graph

    def replay(self) -> torch.Tensor:
        """One step on whatever is in :attr:`tokens` (the graph if captured)."""
        if self.graph is None:
            return self.step_eager()
        self.graph.replay()
        return self.logits

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        """Decode ``ids`` (batch,) at the cache's current lengths; returns the logits (batch, vocab)."""
        self.model._check_ids(ids, tuple(self.tokens.shape))   # (a copy_ would broadcast and truncate)
        self.tokens.copy_(ids)
        return self.replay()
