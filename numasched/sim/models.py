"""Kernel access models at tile granularity: which tiles each workgroup reads, in which order.

Layouts (row-major, contiguous):
* attention: Q [B, H, Sq, D], K and V [B, HK, Sk, D]; workgroup (b, h, m) reads its Q tile
  (rows m*BM.. of head h), then K_0, V_0, K_1, V_1, ... of KV head h // (H/HK). Causal: query
  row i sees keys j <= i + (Sk - Sq) (bottom-right aligned, as FlashAttention), so the
  workgroup stops after the tile holding the diagonal.
* decode: Q [B, H, D], K and V [B, HK, Sk, D]; workgroup (b, kvh, s) reads the G = H/HK query
  rows of its KV group, then the K/V tiles of its split (each split is a whole number of tiles).
* gemm: A [M, K], B [K, N]; workgroup (tm, tn) reads A(tm, kk) then B(kk, tn) for kk = 0..K/BK-1.

Only reads are modelled (output writes are a small, policy-independent share). Each tile access
is one time step of the workgroup that makes it (see ``core.py``).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from math import gcd
import numpy as np

from .. import mappings as M
from .units import TensorLines


_pos = M.positive_int  # same check, same messages as the grids'


def _line_align(step_bytes: int, line: int) -> int:
    """gcd of floor(x/line) and ceil(x/line) over all multiples x of step_bytes (tile boundaries)."""
    if step_bytes % line == 0:
        return step_bytes // line
    period = line // gcd(step_bytes, line)
    x = np.arange(period + 1, dtype=np.int64) * step_bytes
    vals = np.concatenate([x // line, -(-x // line), [period * step_bytes // line]])
    return int(np.gcd.reduce(vals))


def _ceil_div(a, b):
    return -(-a // b)


def _bytes_to_lines(a, n, line):
    """Line run [r0, r0 + nr) touched by bytes [a, a + n) (line is a power of two), no columns."""
    sh = int(line).bit_length() - 1
    r0 = a >> sh
    return r0, ((a + n + (line - 1)) >> sh) - r0, None, None


class KernelModel:
    """Interface shared by the three models."""

    kind = ""  # "attention", "decode" or "gemm" (what mappings.resolve takes)
    causal = False
    schedule_dependent = False  # accesses placed after a first schedule (place_merges)
    tail_term = False  # time model adds the slowest slot's streaming time ("tail")

    def bind(self, topology) -> "KernelModel":
        """This model with sizes that depend on the GPU resolved (default: itself)."""
        return self

    def program_items(self, topology):
        """The work item of every program when the model assigns them itself (None: a mapping
        policy over ``grid`` does)."""
        return None

    @property
    def grid(self):
        raise NotImplementedError

    def tensors(self, line: int):
        raise NotImplementedError

    def n_accesses(self, items: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    def prepare(self, items: np.ndarray, line: int) -> dict:
        """Per-program quantities that ``tiles`` gathers (items: policy.reference of every program)."""
        raise NotImplementedError

    def tiles(self, plan: dict, wg: np.ndarray, k: np.ndarray):
        """(tensor, r0, nr, c0 or None, nc or None) in line-matrix coordinates of access k of program wg.

        1-D models return None for the columns (one line per row)."""
        raise NotImplementedError

    def flops(self, items: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    def to_dict(self) -> dict:
        d = asdict(self)
        d["kernel"] = self.kind
        return d


@dataclass(frozen=True)
class AttentionModel(KernelModel):
    """Prefill attention (FlashAttention-2 forward): one workgroup per (batch, head, query block)."""

    batch: int
    heads: int
    kv_heads: int
    seq_q: int
    seq_k: int
    head_dim: int
    block_m: int = 128
    block_n: int = 64
    causal: bool = False
    dtype_bytes: int = 2
    kind = "attention"

    def __post_init__(self):
        for f in ("batch", "heads", "kv_heads", "seq_q", "seq_k", "head_dim", "block_m", "block_n", "dtype_bytes"):
            _pos(f, getattr(self, f))
        if self.heads % self.kv_heads:
            raise ValueError(f"heads ({self.heads}) must be a multiple of kv_heads ({self.kv_heads})")
        if not isinstance(self.causal, (bool, np.bool_)):
            raise ValueError(f"causal must be a bool, got {self.causal!r}")

    @property
    def q_blocks(self) -> int:
        return _ceil_div(self.seq_q, self.block_m)

    @property
    def grid(self):
        return M.AttentionGrid(self.batch, self.heads, self.kv_heads, self.q_blocks)

    def kv_tiles(self, m) -> np.ndarray:
        m = np.asarray(m, dtype=np.int64)
        if not self.causal:
            return np.full(m.shape, _ceil_div(self.seq_k, self.block_n), dtype=np.int64)
        last = np.minimum((m + 1) * self.block_m, self.seq_q)  # one past the block's last query row
        keys = np.clip(last + (self.seq_k - self.seq_q), 0, self.seq_k)
        return _ceil_div(keys, self.block_n)

    def tensors(self, line):
        rb = self.head_dim * self.dtype_bytes
        q = TensorLines("Q", _ceil_div(self.batch * self.heads * self.seq_q * rb, line), 1,
                        _line_align(gcd(self.block_m, self.seq_q) * rb, line))
        kv_rows = _ceil_div(self.batch * self.kv_heads * self.seq_k * rb, line)
        kv_al = _line_align(gcd(self.block_n, self.seq_k) * rb, line)
        return [q, TensorLines("K", kv_rows, 1, kv_al), TensorLines("V", kv_rows, 1, kv_al)]

    def n_accesses(self, items):
        return 1 + 2 * self.kv_tiles(items[:, 2])

    def prepare(self, items, line):
        b, h, m = items[:, 0], items[:, 1], items[:, 2]
        rb = self.head_dim * self.dtype_bytes
        G = self.heads // self.kv_heads
        return dict(line=line,
                    q_a=((b * self.heads + h) * self.seq_q + m * self.block_m) * rb,
                    q_n=np.minimum(self.block_m, self.seq_q - m * self.block_m) * rb,
                    kv_a=(b * self.kv_heads + h // G) * self.seq_k * rb)

    def tiles(self, plan, wg, k):
        rb = self.head_dim * self.dtype_bytes
        # K/V for every access, then patch the (rare) Q accesses k == 0
        key0 = ((k - 1) >> 1) * self.block_n
        a = plan["kv_a"][wg] + key0 * rb
        n = np.minimum(self.block_n, self.seq_k - key0) * rb
        tensor = 1 + ((k - 1) & 1)
        q = np.flatnonzero(k == 0)
        a[q] = plan["q_a"][wg[q]]
        n[q] = plan["q_n"][wg[q]]
        tensor[q] = 0
        return (tensor,) + _bytes_to_lines(a, n, plan["line"])

    def flops(self, items):
        m = items[:, 2]
        rows = np.minimum(self.block_m, self.seq_q - m * self.block_m)
        cols = np.minimum(self.kv_tiles(m) * self.block_n, self.seq_k)
        return 4.0 * rows * cols * self.head_dim

    def describe(self) -> str:
        return (f"attention B={self.batch} H={self.heads} HK={self.kv_heads} Sq={self.seq_q} Sk={self.seq_k} "
                f"D={self.head_dim} tiles {self.block_m}x{self.block_n}{' causal' if self.causal else ''}")


@dataclass(frozen=True)
class DecodeModel(KernelModel):
    """Flash Decode: one workgroup per (batch, KV head, split); it serves the G query heads of its group."""

    batch: int
    heads: int
    kv_heads: int
    seq_k: int
    head_dim: int
    splits: int = 16
    block_n: int = 64
    dtype_bytes: int = 2
    kind = "decode"

    def __post_init__(self):
        for f in ("batch", "heads", "kv_heads", "seq_k", "head_dim", "splits", "block_n", "dtype_bytes"):
            _pos(f, getattr(self, f))
        if self.heads % self.kv_heads:
            raise ValueError(f"heads ({self.heads}) must be a multiple of kv_heads ({self.kv_heads})")

    @property
    def split_len(self) -> int:
        """Keys per split: ceil(seq_k / splits) rounded up to whole tiles."""
        return _ceil_div(_ceil_div(self.seq_k, self.splits), self.block_n) * self.block_n

    @property
    def grid(self):
        return M.DecodeGrid(self.batch, self.kv_heads, self.splits)

    def _keys(self, s):
        s = np.asarray(s, dtype=np.int64)
        return np.clip(self.seq_k - s * self.split_len, 0, self.split_len)

    def tensors(self, line):
        rb = self.head_dim * self.dtype_bytes
        G = self.heads // self.kv_heads
        q = TensorLines("Q", _ceil_div(self.batch * self.heads * rb, line), 1, _line_align(G * rb, line))
        kv_rows = _ceil_div(self.batch * self.kv_heads * self.seq_k * rb, line)
        kv_al = _line_align(gcd(self.block_n, self.seq_k) * rb, line)
        return [q, TensorLines("K", kv_rows, 1, kv_al), TensorLines("V", kv_rows, 1, kv_al)]

    def n_accesses(self, items):
        return 1 + 2 * _ceil_div(self._keys(items[:, 2]), self.block_n)

    def prepare(self, items, line):
        b, kvh, s = items[:, 0], items[:, 1], items[:, 2]
        rb = self.head_dim * self.dtype_bytes
        G = self.heads // self.kv_heads
        return dict(line=line, q_a=(b * self.heads + kvh * G) * rb, s0=s * self.split_len,
                    kv_a=(b * self.kv_heads + kvh) * self.seq_k * rb)

    def tiles(self, plan, wg, k):
        rb = self.head_dim * self.dtype_bytes
        G = self.heads // self.kv_heads
        j = (k - 1) >> 1
        is_q = k == 0
        key0 = plan["s0"][wg] + j * self.block_n
        a = np.where(is_q, plan["q_a"][wg], plan["kv_a"][wg] + key0 * rb)
        n = np.where(is_q, G * rb, np.minimum(self.block_n, self.seq_k - key0) * rb)
        tensor = np.where(is_q, 0, 1 + ((k - 1) & 1))
        return (tensor,) + _bytes_to_lines(a, n, plan["line"])

    def flops(self, items):
        return 4.0 * (self.heads // self.kv_heads) * self._keys(items[:, 2]) * self.head_dim

    def describe(self) -> str:
        return (f"decode B={self.batch} H={self.heads} HK={self.kv_heads} Sk={self.seq_k} D={self.head_dim} "
                f"splits={self.splits} tile {self.block_n}")


@dataclass(frozen=True)
class GemmModel(KernelModel):
    """C = A @ B with A [M, K] and B [K, N] row-major; one workgroup per output tile."""

    m: int
    n: int
    k: int
    block_m: int = 128
    block_n: int = 128
    block_k: int = 64
    dtype_bytes: int = 2
    kind = "gemm"

    def __post_init__(self):
        for f in ("m", "n", "k", "block_m", "block_n", "block_k", "dtype_bytes"):
            _pos(f, getattr(self, f))

    def check_line(self, line: int) -> None:
        """The 2-D view needs every tile row to start on a cache line."""
        for f in ("k", "n", "block_k", "block_n"):
            if (getattr(self, f) * self.dtype_bytes) % line:
                raise ValueError(f"GemmModel: {f}*dtype_bytes = {getattr(self, f) * self.dtype_bytes} must be a "
                                 f"multiple of the {line}-byte cache line (rows of A and B tiles start on lines)")

    @property
    def grid(self):
        return M.GemmGrid(_ceil_div(self.m, self.block_m), _ceil_div(self.n, self.block_n))

    @property
    def k_steps(self) -> int:
        return _ceil_div(self.k, self.block_k)

    def tensors(self, line):
        self.check_line(line)
        e = self.dtype_bytes
        a = TensorLines("A", self.m, self.k * e // line, gcd(self.block_m, self.m),
                        gcd(self.block_k * e, self.k * e) // line)
        b = TensorLines("B", self.k, self.n * e // line, gcd(self.block_k, self.k),
                        gcd(self.block_n * e, self.n * e) // line)
        return [a, b]

    def n_accesses(self, items):
        return np.full(items.shape[0], 2 * self.k_steps, dtype=np.int64)

    def prepare(self, items, line):
        return dict(line=line, tm=items[:, 0], tn=items[:, 1])

    def tiles(self, plan, wg, k):
        line = plan["line"]
        tm, tn = plan["tm"][wg], plan["tn"][wg]
        e = self.dtype_bytes
        kk = k >> 1
        is_a = (k & 1) == 0
        kw = np.minimum(self.block_k, self.k - kk * self.block_k)
        a_r0, a_nr = tm * self.block_m, np.minimum(self.block_m, self.m - tm * self.block_m)
        a_c0, a_nc = kk * self.block_k * e // line, kw * e // line
        b_r0, b_nr = kk * self.block_k, kw
        b_c0 = tn * self.block_n * e // line
        b_nc = np.minimum(self.block_n, self.n - tn * self.block_n) * e // line
        return (np.where(is_a, 0, 1), np.where(is_a, a_r0, b_r0), np.where(is_a, a_nr, b_nr),
                np.where(is_a, a_c0, b_c0), np.where(is_a, a_nc, b_nc))

    def flops(self, items):
        tm, tn = items[:, 0], items[:, 1]
        rows = np.minimum(self.block_m, self.m - tm * self.block_m)
        cols = np.minimum(self.block_n, self.n - tn * self.block_n)
        return 2.0 * rows * cols * self.k

    def describe(self) -> str:
        return f"gemm M={self.m} N={self.n} K={self.k} tiles {self.block_m}x{self.block_n}x{self.block_k}"
