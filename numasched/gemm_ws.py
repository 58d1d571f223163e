"""Host side of the warp-specialised Hopper GEMM (kernels/gemm_ws.py): check -> plan -> run.

``WsGemmPlan(a, b, out)`` checks that the kernel can take the operands (an sm_90 GPU, 16-bit
floats, TMA-compatible strides), and ``run`` launches one program per SM (fewer when there are
fewer tiles) through a thin launch (numasched._launch): Gluon's Python path on the first call,
the compiled kernel's C launcher after, with the TMA descriptors' tensor maps cached by base
pointer. Under CUDA graphs: first call eager.

``supported(a, b, out)`` says why not, as a string, or returns None; ``matmul_swiglu`` consults
it before it plans the kernel (``options.glu_ws``). ``host_descriptor`` and ``DeviceAddress`` are
shared with the fused collectives on the same kernel (numasched.distributed._ws).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import torch

__all__ = ["WsConfig", "WsGemmPlan", "supported", "descriptor_type", "host_descriptor", "descriptor_maker",
           "DeviceAddress", "DEFAULT_CONFIG", "wide_config", "split_config", "GLU_CONFIG", "STREAMK_CONFIG", "streamk_ranges", "split_parts",
           "merge_bands", "last_box_rows", "last_b_rows", "WsTailPlan", "tail_columns", "residual_by_tma"]


CONSUMER_ROWS = 64   # a consumer warpgroup's rows of a tile (wgmma's M), C's boxes


@dataclass(frozen=True)
class WsConfig:
    block_n: int = 256
    stages: int = 3
    group_m: int = 8
    block_m: int = 128   # two consumer warpgroups of 64 rows (64: one, the plain data-parallel form only)
    block_k: int = 64
    consumer_regs: int = 232
    loader_regs: int = 40
    maxnreg: int = 168   # 12 warps (3 warpgroups) x 168 = 64512 of the SM's 65536 registers
    glu: bool = False    # the SwiGLU form: a gate and an up box of block_n columns per stage
    streamk: bool = False   # equal K ranges per program, partials summed in-kernel (kernels/gemm_ws.py)
    sk_merge: int = 0       # stream-K's fix-up: 0 the tile's last piece sums it, 1 every contributor a band
    sk_split: int = 0       # S >= 2: split-K units (tile, K part) in K lockstep instead of ranges (bands)
    block_n1: int = 0       # > 0: tiles of block_n + block_n1 columns in two boxes (80 = 64 + 16, 160 = 128 + 32)
    block_n2: int = 0       # > 0 (with block_n1): a third box (208 = 128 + 64 + 16); untransposed only
    swap: bool = False      # the weight as A, C stored transposed (SWAP_C): block_m along N, tile_n along M

    @property
    def tile_n(self) -> int:
        """Output columns of a tile."""
        return self.block_n + self.block_n1 + self.block_n2

    def smem_bytes(self, elem: int = 2) -> int:
        stage = (self.block_m + (2 if self.glu else 1) * self.block_n + self.block_n1 + self.block_n2) * self.block_k * elem
        return self.stages * stage + self.block_m * self.tile_n * elem + 1024


def last_box_rows(M: int, block_m: int = 128) -> Tuple[int, int]:
    """The rows of A's boxes in the last tile row where it is at most 3/4 full: (R1, R2), a box of
    R1 rows and one of the next R2 (0: none), powers of two of at least 16 (a descriptor's box is
    a power of two) covering the row's rows: up to half a tile one box, then half a tile and a
    second of 16 or 32 rows. (0, 0) where every box is ``block_m`` rows (the last row full or
    more than 3/4 so). A 128-row box mostly past A's last row is slow on Hopper (bench/results,
    thirty-ninth session: 650 x 17504 x 3800 ran longer than 768 x 17504 x 3800)."""
    rem = M % block_m
    if rem == 0 or 4 * rem > 3 * block_m:
        return 0, 0
    half = block_m // 2
    if rem <= half:
        return max(16, 1 << (rem - 1).bit_length()), 0
    return half, max(16, 1 << (rem - half - 1).bit_length())


def last_b_rows(N: int, block_n: int, block_n1: int = 0) -> Tuple[int, int]:
    """The rows of B's boxes in the last tile column, where it is at most 3/4 full (B as (N, K)
    boxes of ``block_n`` and ``block_n1`` rows, a tile of their sum): (R0, R1), R0 rows of the
    first box and R1 of the second (0: not loaded), powers of two of at least 16; (0, 0) where
    every box is whole (the column full or more than 3/4 so). As last_box_rows for A: a box
    mostly past the tensor's last row is slow, and the transposed form's last tile along the
    tokens is often one (300 tokens in tiles of 128: 44 in the last)."""
    tile = block_n + block_n1
    rem = N % tile
    if rem == 0 or 4 * rem > 3 * tile:
        return 0, 0
    if rem <= block_n:
        r0 = min(block_n, max(16, 1 << (rem - 1).bit_length()))
        return (r0, 0) if r0 < block_n or block_n1 else (0, 0)
    r1 = max(16, 1 << (rem - block_n - 1).bit_length())
    return (block_n, r1) if r1 < block_n1 else (0, 0)


def split_config(block_n: int, split: int, smem: int = 200 * 1024) -> WsConfig:
    """Split-K in K lockstep with the banded merge (``sk_split``), tiles of 128 x ``block_n`` (64,
    128 or 256), as many stages (3-8) as fit in ``smem`` bytes of operand ring."""
    if block_n not in (64, 128, 256):
        raise ValueError(f"block_n must be 64, 128 or 256 for the split-K form, got {block_n}")
    stage = (128 + block_n) * 64 * 2
    return WsConfig(block_n=block_n, stages=max(3, min(8, smem // stage)), streamk=True, sk_merge=1,
                    sk_split=max(2, split))


def tail_columns(M: int, N: int, block_n: int, sms: int, block_m: int = 128) -> Tuple[int, int]:
    """Where a grid of 128 x ``block_n`` tiles leaves its last round on ``sms`` SMs part-empty:
    (n0, tail tiles), the first n0 columns (whole tile columns) holding as many tiles as whole
    rounds take (at most NM - 1 slots of the last of them idle, NM the tile rows) and the tiles of
    the columns past n0. (0, 0) where the tiles make whole rounds or less than one, or where the
    whole rounds hold no whole tile column (WsTailPlan)."""
    nm, nn = -(-M // block_m), -(-N // block_n)
    rounds, rest = divmod(nm * nn, sms)
    if not rounds or not rest:
        return 0, 0
    nn0 = rounds * sms // nm
    if not nn0:   # more tile rows than whole rounds' slots: no whole column to run data-parallel
        return 0, 0
    return nn0 * block_n, nm * (nn - nn0)


# Stages of a data-parallel ring at most, as shared memory allows. 64-row tiles: up to 12 (64 x 80
# tiles in 8 stages hold 147 KB in flight and took in about 94 GB/s an SM, 64 x 128 in 8, 197 KB,
# 122): on an H100 64 x 80 in 10-12 stages and 64 x 96 in 10 ran 0-10 % faster than in 8 at 16 of
# 16 shapes of 72-384 rows (bench/results/gemm-s40/h100-rings). 128-row tiles: 6 (80 and 96 wide in
# 7 stages ran 0.93-1.06x their 6-stage time over 10 shapes, h100-rings128).
WIDE_MAX_STAGES = {128: 6, 64: 12}


# Registers by tile rows (one consumer warpgroup per 64; a box's rows are a power of two, so no
# 192): the launch's cap (all warps, the loader's warpgroup included) and a worker consumer's
# raised share, within the SM's 65536 (a consumer of a 64 x 144 tile holds 72 fp32 accumulators a
# thread; 256 x 96 compiles for sm_90 without spills)
CONSUMER_REGS = {64: (168, 232), 128: (168, 232), 256: (96, 120)}


def wide_config(tile_n: int, smem: int = 227 * 1024, block_m: int = 128, max_stages: Optional[int] = None,
                swap: bool = False) -> WsConfig:
    """The data-parallel config of tiles ``block_m`` (64 rows a consumer warpgroup: 64 to 256) x
    ``tile_n`` columns (a multiple of 16 from 80 to 256: a power-of-two box, then a second of the
    rest, power of two too: 80 = 64 + 16, 96 = 64 + 32, 160 = 128 + 32, 192 = 128 + 64; or a power
    of two from 128; untransposed, also a third: 176 = 128 + 32 + 16, 208 = 128 + 64 + 16, 224 =
    128 + 64 + 32), and as many stages (3 to WIDE_MAX_STAGES, or ``max_stages``) as fit in
    ``smem`` bytes. ``swap``: the transposed form (SWAP_C), block_m along the weight's rows and
    tile_n along the tokens."""
    if tile_n % 16 or not 80 <= tile_n <= 256:   # (64: one box as wide as BLOCK_K, its orientation ambiguous)
        raise ValueError(f"tile_n must be a multiple of 16 from 80 to 256, got {tile_n}")
    if block_m not in CONSUMER_REGS:
        raise ValueError(f"block_m must be one of {tuple(CONSUMER_REGS)}, got {block_m}")
    if max_stages is not None and max_stages < 3:
        raise ValueError(f"max_stages must be at least 3, got {max_stages}")
    n0 = 1 << (tile_n.bit_length() - 1)
    n1 = tile_n - n0
    n2 = 0
    if n1 & (n1 - 1):
        n2 = n1 - (1 << (n1.bit_length() - 1))
        n1 -= n2
        if swap or n2 & (n2 - 1):
            raise ValueError(f"tile_n={tile_n} is not {'two' if swap else 'two or three'} power-of-two boxes")
    cap = WIDE_MAX_STAGES.get(block_m, WIDE_MAX_STAGES[128])
    top = cap if max_stages is None else min(max_stages, cap)
    maxnreg, regs = CONSUMER_REGS[block_m]
    for stages in range(top, 2, -1):
        cfg = WsConfig(block_n=n0, block_n1=n1, block_n2=n2, stages=stages, block_m=block_m, swap=swap,
                       maxnreg=maxnreg, consumer_regs=regs)
        if cfg.smem_bytes() <= smem or stages == 3:
            return cfg


# The fused GEMM + collectives' kernel (kernels/dist_gemm_ar_ws.py, numasched.distributed._ws): its
# tiles' widths and rings, 128 x 256 in 3 stages, 128 x 128 in 5 (a ring of 160 KB beside the two
# 64 x 128 staging tiles)
DIST_RING_STAGES = {256: 3, 128: 5}


def dist_config(block_n: int = 256) -> WsConfig:
    """The config of the fused collectives' ``block_n``-wide tiles (a key of DIST_RING_STAGES)."""
    if block_n not in DIST_RING_STAGES:
        raise ValueError(f"block_n must be one of {tuple(DIST_RING_STAGES)}, got {block_n}")
    return WsConfig(block_n=block_n, stages=DIST_RING_STAGES[block_n])


DEFAULT_CONFIG = WsConfig()
# SwiGLU: 128 x 128 output tiles (a 128 x 256 tile of the gate/up GEMM), 4 stages of 48 KB
GLU_CONFIG = WsConfig(block_n=128, stages=4, glu=True)
# stream-K: the same tiles and ring, the iterations cut evenly over the SMs
STREAMK_CONFIG = WsConfig(streamk=True)
SK_WAIT_NS = 10**9   # the banded merge's bound on a wait for a tile's pieces (all ranges end together)
SK_SPLIT_MAX_UNITS = 1024   # split-K units (their fp32 partials: 128 KB each, 128 MB at most)


def descriptor_type(dtype: str, block) -> str:
    """The signature type of a host descriptor of ``block`` ("bf16"/"fp16") as the Gluon JIT sees it
    (offline compiles: numasched.portability)."""
    from triton.experimental.gluon import language as gl

    layout = gl.NVMMASharedLayout.get_default_for(list(block), {"bf16": gl.bfloat16, "fp16": gl.float16}[dtype])
    return f"tensordesc<{dtype}[{block[0]}, {block[1]}],{layout!r}>"


class DeviceAddress:
    """A device address with a dtype, as a kernel argument or a descriptor's base: e.g. a peer
    GPU's buffer mapped into this GPU's address space by the symmetric heap."""

    def __init__(self, ptr: int, dtype):
        self.ptr, self.dtype = int(ptr), dtype

    def data_ptr(self) -> int:
        return self.ptr


def host_descriptor(base, shape, strides, block):
    """A Gluon host TMA descriptor of ``base`` (a tensor or a DeviceAddress, 16-bit) with the
    default NVMMA shared layout of ``block``."""
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    dt = gl.bfloat16 if base.dtype == torch.bfloat16 else gl.float16
    return TensorDescriptor(base, list(shape), list(strides), list(block), gl.NVMMASharedLayout.get_default_for(block, dt))


def descriptor_maker(launch):
    """How to make the descriptors of a launch of a Gluon kernel (numasched._launch.Launch): Gluon
    ones (their layouts: the first launch compiles from them) until it has compiled, then plain
    ones (base, shape, strides, block), whose tensor maps the launch caches."""
    from numasched._launch import HostDesc

    return host_descriptor if launch.compiled is None else HostDesc


def _tma_ok(t: torch.Tensor) -> bool:
    """A 2-D view TMA can address: unit stride along its last dimension, the other 16-byte aligned."""
    return (t.dim() == 2 and t.stride(1) == 1 and (t.stride(0) * t.element_size()) % 16 == 0
            and t.data_ptr() % 16 == 0)


def supported(a: torch.Tensor, b: torch.Tensor, out: Optional[torch.Tensor] = None, glu: bool = False,
              swap: bool = False, out_stride: Optional[int] = None) -> Optional[str]:
    """None when the kernel can compute ``out = a @ b`` (``glu``: the SwiGLU form; ``swap``:
    ``out = (a @ b).T``; ``out_stride``: the row stride of the outs to come, where out is not
    given); otherwise the reason, naming the argument."""
    from numasched.kernels.gemm_ws import HAVE_GLUON

    if a.dtype not in (torch.bfloat16, torch.float16) or b.dtype != a.dtype:
        return f"a and b must both be bf16 or both fp16 (a {a.dtype}, b {b.dtype})"
    if not _tma_ok(a):
        return "a must be row-major with 16-byte aligned rows (K a multiple of 8)"
    if not (_tma_ok(b) or _tma_ok(b.t())):
        return ("b must be (K, N) row-major or the transpose of an (N, K) row-major weight, "
                "with 16-byte aligned rows")
    if glu and _tma_ok(b) and b.shape[1] > 1:
        return "b must be the transpose of a row-major (2n, K) gate/up weight for the SwiGLU form"
    if out is not None and (out.dtype != a.dtype or not _tma_ok(out)):
        return "out must be row-major with 16-byte aligned rows (N a multiple of 8), in a's dtype"
    n = a.shape[0] if swap else b.shape[1] // 2 if glu else b.shape[1]
    if out is None and out_stride is not None:
        if (out_stride * a.element_size()) % 16:
            return f"out_stride must keep rows 16-byte aligned (a multiple of {16 // a.element_size()}), got {out_stride}"
    elif out is None and (n * a.element_size()) % 16:
        # the out a call makes is contiguous: its rows must suit TMA too
        return f"the output's rows must be 16-byte aligned (N a multiple of {16 // a.element_size()}), got N={n}"
    if not HAVE_GLUON:
        return "this triton has no Gluon"
    from . import caps

    if not caps.hopper(a.device):
        return "needs an NVIDIA sm_90 GPU (Hopper)"
    if b.device != a.device or (out is not None and out.device != a.device):
        return "a, b and out must be on one device"
    return None


class WsGemmPlan:
    """``out (M, N) = a (M, K) @ b (K, N)`` by the warp-specialised kernel, for these operands.
    With a ``config`` of ``glu=True``: b is (K, 2n) (gate columns, then up), out is (M, n) and gets
    ``silu(a @ b[:, :n]) * (a @ b[:, n:])``, each row of both first times ``row_scale`` when the
    plan is made with one ((M,) fp32)."""

    def __init__(self, a: torch.Tensor, b: torch.Tensor, out: Optional[torch.Tensor] = None,
                 config: WsConfig = DEFAULT_CONFIG, num_programs: Optional[int] = None,
                 row_scale: Optional[torch.Tensor] = None, peer_out_ptr: Optional[int] = None,
                 peer_paced: bool = False, out_stride: Optional[int] = None,
                 bias: Optional[torch.Tensor] = None, residual: Optional[torch.Tensor] = None):
        """``peer_out_ptr`` (a probe, scripts/ws_push_probe.py): the address, valid on this GPU
        (a peer's memory mapped here, e.g. by the symmetric heap), of a twin of ``out`` that every
        tile is also TMA-stored into: at once, or (``peer_paced``) in 64-column chunks spread over
        the next tile's K loop. ``out_stride`` (without ``out``): the row stride of the outs the
        calls will pass (a column slab of a wider output: WsTailPlan). ``bias`` / ``residual``
        (the plain GEMM, data-parallel or split-K form): out gets ``+ bias`` (one per column of
        out) ``+ residual`` (out's shape, any strides; it may be out itself), added in fp32 before
        the store; the calls then pass tensors laid out as these."""
        if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[0]:
            raise ValueError(f"a {tuple(a.shape)} and b {tuple(b.shape)} are not (M, K) and (K, N)")
        why = supported(a, b, out, glu=config.glu, swap=config.swap, out_stride=out_stride)
        if why:
            raise ValueError(f"the warp-specialised GEMM cannot run this: {why}")
        self.M, self.K = a.shape
        self.N = b.shape[1] // 2 if config.glu else b.shape[1]
        if out_stride is not None and (out is not None or config.swap or out_stride < self.N):
            raise ValueError(f"out_stride must be at least N={self.N}, for an untransposed plan made without out, "
                             f"got {out_stride}")
        # what the launch's descriptors are made for: the thin launch caches their tensor maps by
        # base pointer, so a call's operands must be laid out as these
        self._layout = (tuple(a.shape), a.stride(), tuple(b.shape), b.stride(),
                        out.stride() if out is not None else None if out_stride is None else (out_stride, 1))
        if config.glu and b.shape[1] % 2:
            raise ValueError(f"b must have an even number of columns (gate then up), got {b.shape[1]}")
        self.swap = config.swap
        if self.swap and (config.glu or config.streamk or peer_out_ptr is not None or _tma_ok(b)):
            raise ValueError("config.swap (out stored transposed) is for the plain data-parallel GEMM with b the "
                             "transpose of a row-major operand")
        self.out_shape = (self.N, self.M) if self.swap else (self.M, self.N)   # swap: out is (a @ b).T
        if out is not None and tuple(out.shape) != self.out_shape:
            raise ValueError(f"out must have shape {self.out_shape}, got {tuple(out.shape)}")
        if row_scale is not None and not config.glu:
            raise ValueError("row_scale is for the SwiGLU form (a config with glu=True)")
        self.row_scale = row_scale is not None
        self.bias, self.residual = bias is not None, residual is not None
        if self.bias or self.residual:
            if config.glu or peer_out_ptr is not None or (config.streamk and not config.sk_split):
                raise ValueError("bias and residual are for the plain GEMM (data-parallel or split-K form)")
            self._check_epilogue(bias, residual, a.device)
        self._res_strides = residual.stride() if residual is not None else (0, 0)
        # the data-parallel forms load a residual in y's dtype that TMA can address by TMA into C's
        # tiles during the K loop (1); others (and the split-K form's banded merge) by pointers (2)
        self.res_mode = (0 if residual is None else 1 if residual_by_tma(residual, a.dtype) and not config.streamk
                         else 2)
        self.peer = peer_out_ptr
        self.peer_mode = 0 if peer_out_ptr is None else (2 if peer_paced else 1)
        if peer_out_ptr is not None and (peer_out_ptr % 16 or config.glu):
            raise ValueError("peer_out_ptr must be 16-byte aligned, for the plain GEMM")
        self.config = config
        self.b_kmajor = not _tma_ok(b)   # b = w.t() of an (N, K) weight
        cfg = config
        if cfg.block_m not in CONSUMER_REGS or (cfg.block_m != 128 and (cfg.glu or cfg.streamk
                                                                          or peer_out_ptr is not None)):
            raise ValueError(f"config.block_m must be 128, or {tuple(CONSUMER_REGS)} for the plain data-parallel "
                             f"GEMM, got {cfg.block_m}")
        if cfg.block_n2 and (cfg.block_n2 & (cfg.block_n2 - 1) or not 16 <= cfg.block_n2 <= cfg.block_n1
                             or cfg.swap):
            raise ValueError(f"config.block_n2 must be a power of two from 16 to block_n1={cfg.block_n1} (a third box "
                             f"beside two, untransposed), got {cfg.block_n2}")
        if cfg.block_n1:
            if cfg.block_n1 & (cfg.block_n1 - 1) or not 16 <= cfg.block_n1 <= cfg.block_n:
                raise ValueError(f"config.block_n1 must be a power of two from 16 to block_n={cfg.block_n}, "
                                 f"got {cfg.block_n1}")
            if cfg.glu or cfg.streamk or peer_out_ptr is not None:
                raise ValueError("config.block_n1 (two-box tiles) is for the plain data-parallel GEMM")
        elif cfg.block_n == cfg.block_k and not self.b_kmajor:
            # the kernel reads B's orientation off a one-box tile's shape: a square box is taken as
            # an (N, K) weight's
            raise ValueError(f"config.block_n must differ from block_k={cfg.block_k} for a (K, N) row-major b")
        from numasched import options

        # A's last tile row in boxes of its own rows (options.gemm_ws_last_box)
        self.a_last = last_box_rows(self.M, cfg.block_m) if options.current().gemm_ws_last_box else (0, 0)
        self.dead_half = options.current().gemm_ws_dead_half
        # the transposed form's last token tile in boxes of its own rows (options.gemm_ws_last_box):
        # swap 128 x 128 at 300 tokens (44 in the last tile) 113.7 -> 88.3 us, 128 x 256 at 551
        # 431 -> 334 on an H100; the plain form's last weight tile showed no gain (bench/results/
        # gemm-s43/h100-last-b), so it keeps whole boxes
        self.b_last = (last_b_rows(self.N, cfg.block_n, cfg.block_n1)
                       if options.current().gemm_ws_last_box and self.swap else (0, 0))
        tiles = -(-self.M // cfg.block_m) * -(-self.N // cfg.tile_n)
        sms = torch.cuda.get_device_properties(a.device).multi_processor_count
        self.num_programs = max(1, min(tiles, num_programs or sms))
        if cfg.sk_merge not in (0, 1) or cfg.sk_split < 0:
            raise ValueError(f"config.sk_merge must be 0 or 1 and sk_split >= 0, got {cfg.sk_merge}, {cfg.sk_split}")
        if not cfg.streamk and (cfg.sk_merge or cfg.sk_split):
            raise ValueError("config.sk_merge and sk_split are for the stream-K form (streamk=True)")
        if cfg.streamk:
            if cfg.glu or peer_out_ptr is not None or row_scale is not None:
                raise ValueError("the stream-K form is for the plain GEMM (no glu, row_scale or peer copy)")
            k_steps = -(-self.K // cfg.block_k)
            total = tiles * k_steps
            if total < 1:
                raise ValueError(f"the stream-K form needs K >= 1, got K={self.K}")
            half = (cfg.block_m // 2) * cfg.block_n
            if cfg.sk_split:
                if cfg.sk_split < 2 or cfg.sk_merge != 1:
                    raise ValueError(f"sk_split must be >= 2 and take sk_merge=1 (the banded merge), got "
                                     f"sk_split={cfg.sk_split}, sk_merge={cfg.sk_merge}")
                if tiles > SK_SPLIT_MAX_UNITS:
                    raise ValueError(f"{tiles} tiles: more than {SK_SPLIT_MAX_UNITS} split-K units (their "
                                     "partials' workspace); use sk_split=0 (stream-K ranges)")
                # no empty K parts, and at most SK_SPLIT_MAX_UNITS units
                self.split = min(cfg.sk_split, k_steps, SK_SPLIT_MAX_UNITS // tiles)
                units = tiles * self.split
                self.num_programs = max(1, min(units, num_programs or sms))
                slots = 2 * units   # one a unit, two halves
            else:
                self.split = 0
                self.num_programs = max(1, min(total, num_programs or sms))
                if total * (self.num_programs + 1) >= 2**31:   # the kernel's range arithmetic is int32
                    raise ValueError(f"the stream-K form's iteration count ({total} on {self.num_programs} "
                                     "programs) overflows int32; use the data-parallel config")
                slots = 4 * self.num_programs   # a range's first and last piece, two halves each
            if cfg.sk_merge == 1 and max(self.num_programs, num_programs or 0) > sms:
                # the banded merge waits for other programs' partials: all must be resident at once
                raise ValueError(f"num_programs={num_programs} exceeds the {sms} SMs: the banded merge (sk_merge=1) "
                                 "needs every program resident (one per SM)")
            # fp32 partials; tickets per half tile (arrivals, departures), zero between calls (the
            # kernel leaves them so)
            self.work = torch.empty(slots * half, device=a.device, dtype=torch.float32)
            self.tickets = torch.zeros(4 * tiles, device=a.device, dtype=torch.int32)
            self.status = torch.zeros(1, device=a.device, dtype=torch.int32)   # sk_merge 1: a wait ran out
            # (per stream it runs on: a second stream gets buffers of its own, _run_streamk)
            self.workspace_bytes = 4 * (self.work.numel() + self.tickets.numel() + 1)
            self.fixup = 1   # a timing probe's 0, 2, 3, 4 (kernels/gemm_ws.py; scripts/ws_split_probe.py): wrong sums
            self._stream_bufs = {}
        else:
            self.workspace_bytes = 0
        self._launch = None

    def _check_epilogue(self, bias, residual, device) -> None:
        """bias: (out's columns,), residual: out's shape; floating point, on ``device``."""
        floats = (torch.float16, torch.bfloat16, torch.float32)
        if bias is not None and (bias.dim() != 1 or bias.shape[0] != self.out_shape[1] or bias.dtype not in floats
                                 or bias.device != device or bias.stride(0) != 1):
            raise ValueError(f"bias must be a contiguous float16/bfloat16/float32 vector of {self.out_shape[1]} entries "
                             f"on {device}, got {tuple(bias.shape)} {bias.dtype} on {bias.device}")
        if residual is not None and (tuple(residual.shape) != self.out_shape or residual.dtype not in floats
                                     or residual.device != device):
            raise ValueError(f"residual must be a float16/bfloat16/float32 tensor of shape {self.out_shape} on "
                             f"{device}, got {tuple(residual.shape)} {residual.dtype} on {residual.device}")

    def _epilogue_args(self, out, bias, residual) -> tuple:
        """The kernels' (bias, res, stride_rm, stride_rn): ``out`` where unused (unread)."""
        if (bias is not None) != self.bias or (residual is not None) != self.residual:
            raise ValueError("bias and residual must be given exactly when the plan was made with them")
        if residual is not None and residual.stride() != self._res_strides:
            raise ValueError(f"residual must have the plan's strides {self._res_strides}, got {residual.stride()}")
        if residual is not None and self.res_mode == 1 and residual.data_ptr() % 16:
            raise ValueError("residual must be 16-byte aligned, as at plan time (its tiles come by TMA)")
        rm, rn = self._res_strides
        return (bias if bias is not None else out, residual if residual is not None else out, rm, rn)

    def run(self, a: torch.Tensor, b: torch.Tensor, out: Optional[torch.Tensor] = None,
            row_scale: Optional[torch.Tensor] = None, bias: Optional[torch.Tensor] = None,
            residual: Optional[torch.Tensor] = None) -> torch.Tensor:
        from numasched._launch import HostDesc, Launch, hooked
        from numasched.kernels.gemm_ws import gemm_ws_kernel

        if (b.stride(1) != 1) != self.b_kmajor:   # the compiled B box is the plan's orientation
            want = "the transpose of an (N, K) weight" if self.b_kmajor else "(K, N) row-major"
            raise ValueError(f"b must be laid out as at plan time ({want}), got strides {tuple(b.stride())}")
        la, sa, lb, sb, so = self._layout
        if (tuple(a.shape), a.stride(), tuple(b.shape), b.stride()) != (la, sa, lb, sb):
            raise ValueError(f"a and b must have the plan's shapes and strides (a {la} {sa}, b {lb} {sb}), got a "
                             f"{tuple(a.shape)} {a.stride()}, b {tuple(b.shape)} {b.stride()}")
        if out is not None and (tuple(out.shape) != self.out_shape
                                or out.stride() != (so or (self.out_shape[1], 1))):
            raise ValueError(f"out must be {self.out_shape} with strides {so or (self.out_shape[1], 1)}, got "
                             f"{tuple(out.shape)} {out.stride()}")
        if (row_scale is not None) != self.row_scale:
            raise ValueError("row_scale must be given exactly when the plan was made with one")
        if out is None:
            out = torch.empty(self.out_shape, device=a.device, dtype=a.dtype)
        epi = self._epilogue_args(out, bias, residual)
        cfg = self.config
        if cfg.streamk:
            self._check_epilogue(bias, residual, a.device)
            return self._run_streamk(a, b, out, epi)
        if self._launch is None:   # the thin launch: Gluon's Python path once, then the C launcher
            self._launch = Launch(gemm_ws_kernel, self.num_programs,
                                  dict(STAGES=cfg.stages, GROUP_M=cfg.group_m, GLU=cfg.glu, ROW_SCALE=self.row_scale,
                                       CONSUMER_REGS=cfg.consumer_regs, LOADER_REGS=cfg.loader_regs,
                                       PEER_PUSH=self.peer_mode, N1=cfg.block_n1, B_KMAJOR=self.b_kmajor,
                                       A_LAST=self.a_last[0], A_LAST2=self.a_last[1],
                                       DEAD_HALF=self.dead_half, SWAP_C=self.swap, B_LAST0=self.b_last[0],
                                       B_LAST1=self.b_last[1], N2=cfg.block_n2, BIAS=self.bias,
                                       RESIDUAL=self.res_mode, num_warps=4, maxnreg=cfg.maxnreg),
                                  device=a.device)
            self._fulls = {}
        run = self._launch
        scale = row_scale if row_scale is not None else out
        fkey = None
        if run.raw is not None and not hooked():
            # the C launcher with the whole argument list of these data pointers, made once
            # (descriptors expanded into their tensor maps): an eager call's host work is a key
            # and a lookup (shapes and strides are the plan's, checked above)
            fkey = (a.data_ptr(), b.data_ptr(), out.data_ptr(), scale.data_ptr(), epi[0].data_ptr(), epi[1].data_ptr())
            full = self._fulls.get(fkey)
            if full is not None:
                run.call_full(full)
                return out
        # (a call's bias and residual checked where its argument list is made; the cached list
        # above is keyed by their addresses)
        self._check_epilogue(bias, residual, a.device)
        desc = descriptor_maker(run)
        a_d, b_d, c_d = self._descriptors(desc, a, b, out)
        peer = c_d if self.peer is None else desc(DeviceAddress(self.peer, out.dtype), out.shape, out.stride(),
                                                  [CONSUMER_ROWS, 64 if self.peer_mode == 2 else cfg.block_n])
        b1_d, c1_d = self._descriptors(desc, a, b, out, cfg.block_n1)[1:] if cfg.block_n1 else (b_d, c_d)
        bx_d, cx_d = self._descriptors(desc, a, b, out, cfg.block_n2)[1:] if cfg.block_n2 else (b_d, c_d)
        if self.res_mode == 1:   # the residual with C's boxes
            res = epi[1]
            r_ds = tuple(self._descriptors(desc, a, b, res, n)[2] if n else c
                         for n, c in ((cfg.block_n, c_d), (cfg.block_n1, c1_d), (cfg.block_n2, cx_d)))
        else:
            r_ds = (c_d, c1_d, cx_d)
        args = (a_d, b_d, c_d, peer, b1_d, c1_d, *self._last_boxes(desc, a, a_d), *self._last_b_boxes(desc, b, b_d),
                bx_d, cx_d, scale.data_ptr() if fkey is not None else scale, self.M, self.N, self.K,
                *((t.data_ptr() if fkey is not None else t) for t in epi[:2]), *epi[2:], *r_ds)
        run(*args)
        if fkey is not None and desc is HostDesc:
            run.keep_full(self._fulls, fkey, args)
        return out

    def _descriptors(self, desc, a, b, out, cols: Optional[int] = None):
        """A's (BLOCK_M, BLOCK_K) boxes, B's of ``cols`` (block_n) columns in the plan's
        orientation, out's boxes of a consumer's 64 rows and as many columns."""
        cfg = self.config
        cols = cols or cfg.block_n
        bt = b.t()
        return (desc(a, a.shape, a.stride(), [cfg.block_m, cfg.block_k]),
                desc(bt, bt.shape, bt.stride(), [cols, cfg.block_k]) if self.b_kmajor
                else desc(b, b.shape, b.stride(), [cfg.block_k, cols]),
                desc(out, out.shape, out.stride(), [cols, CONSUMER_ROWS] if self.swap else [CONSUMER_ROWS, cols]))

    def _last_boxes(self, desc, a, a_d):
        """A's descriptors of the last tile row's boxes (A_LAST, A_LAST2 rows), A's own where unused."""
        r1, r2 = self.a_last
        a1 = desc(a, a.shape, a.stride(), [r1, self.config.block_k]) if r1 else a_d
        return a1, (desc(a, a.shape, a.stride(), [r2, self.config.block_k]) if r2 else a1)

    def _last_b_boxes(self, desc, b, b_d):
        """B's descriptors of the last tile column's boxes (B_LAST0, B_LAST1 rows), B's own where unused."""
        r0, r1 = self.b_last
        if not r0:
            return b_d, b_d
        bt = b.t()
        b2 = desc(bt, bt.shape, bt.stride(), [r0, self.config.block_k])
        return b2, (desc(bt, bt.shape, bt.stride(), [r1, self.config.block_k]) if r1 else b2)

    def _run_streamk(self, a, b, out, epi):
        from numasched._launch import Launch
        from numasched.kernels.gemm_ws import gemm_ws_streamk_kernel

        cfg = self.config
        if self._launch is None:
            self._launch = Launch(gemm_ws_streamk_kernel, self.num_programs,
                                  dict(STAGES=cfg.stages, GROUP_M=cfg.group_m, CONSUMER_REGS=cfg.consumer_regs,
                                       LOADER_REGS=cfg.loader_regs, FIXUP=self.fixup, MERGE=cfg.sk_merge,
                                       SPLIT=self.split > 0, MERGE_RB=merge_rows(self.split, cfg.block_n),
                                       A_LAST=self.a_last[0], A_LAST2=self.a_last[1], BIAS=self.bias,
                                       RESIDUAL=self.residual, num_warps=4, maxnreg=cfg.maxnreg),
                                  device=a.device)
        # partials and counters per stream: two streams running this plan at once must not share
        # tickets (the plan's own serve the first stream it runs on)
        from numasched import caps

        key = caps.stream_handle(a.device)
        bufs = self._stream_bufs.get(key)
        if bufs is None:
            bufs = ((self.work, self.tickets, self.status) if not self._stream_bufs else
                    (torch.empty_like(self.work), torch.zeros_like(self.tickets), torch.zeros_like(self.status)))
            self._stream_bufs[key] = bufs
        work, tickets, status = bufs
        desc = descriptor_maker(self._launch)
        a_d, b_d, c_d = self._descriptors(desc, a, b, out)
        self._launch(a_d, b_d, c_d, *self._last_boxes(desc, a, a_d), work, tickets, out, out.stride(0), status,
                     SK_WAIT_NS, self.M, self.N, self.K, max(self.split, 1), *epi)
        return out

    def check(self):
        """Raise if a stream-K call's banded merge (``sk_merge=1``) gave up waiting for a piece
        (a program not resident beside the others, e.g. SMs taken by another kernel that waits on
        this one): its output's bands whose parts were missing are then NaN. Clears the error
        and the counters (every stream's), so the next call starts clean. Synchronises with the GPU."""
        if getattr(self, "status", None) is None:
            return
        bad = False
        for _, tickets, status in list(self._stream_bufs.values()) or [(None, self.tickets, self.status)]:
            if int(status.item()):
                # the counters of a call that gave up are not back at zero: clear them for the next
                tickets.zero_()
                status.zero_()
                bad = True
        if bad:
            raise RuntimeError(f"the stream-K GEMM's merge waited more than {SK_WAIT_NS / 1e9:g} s for a tile's "
                               f"pieces ({self.num_programs} programs: were they all resident?)")


class WsTailPlan:
    """``out (M, N) = a (M, K) @ b (K, N)`` in two launches of the warp-specialised kernel where
    its 128 x ``block_n`` tiles leave the last round part-empty (tail_columns): the data-parallel
    form over the first n0 columns (whole rounds, every SM a tile), then the split-K form over the
    rest, each of those tiles cut into ``split`` K parts on SMs of their own (K lockstep, the
    banded merge), so the last round costs about a ``split``-th of a tile's K loop and the
    partials' merge instead of a whole tile on a few SMs. Each launch reads its column slab of b
    and writes its slab of out through descriptors of the slab (out's rows strided as the whole)."""

    swap = False

    def __init__(self, a: torch.Tensor, b: torch.Tensor, out: Optional[torch.Tensor] = None, *, block_n: int,
                 split: int, max_stages: Optional[int] = None, sms: Optional[int] = None,
                 bias: Optional[torch.Tensor] = None, residual: Optional[torch.Tensor] = None):
        if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[0]:
            raise ValueError(f"a {tuple(a.shape)} and b {tuple(b.shape)} are not (M, K) and (K, N)")
        if block_n not in (128, 256):
            raise ValueError(f"block_n must be 128 or 256 (the data-parallel and split-K forms' common widths), "
                             f"got {block_n}")
        if split < 2:
            raise ValueError(f"split must be >= 2, got {split}")
        self.M, self.K = a.shape
        self.N = b.shape[1]
        if sms is None:
            from numasched import caps

            sms = caps.num_sms(a.device)
        self.n0, tail_tiles = tail_columns(self.M, self.N, block_n, sms)
        if not self.n0:
            raise ValueError(f"{self.M} x {self.N} in 128 x {block_n} tiles makes whole rounds on {sms} SMs, or "
                             "less than one: no tail to split (use the data-parallel or split-K form)")
        if out is not None and tuple(out.shape) != (self.M, self.N):
            raise ValueError(f"out must have shape {(self.M, self.N)}, got {tuple(out.shape)}")
        stride = None if out is not None else self.N
        n0 = self.n0
        self.dp = WsGemmPlan(a, b[:, :n0], None if out is None else out[:, :n0],
                             config=wide_config(block_n, max_stages=max_stages), out_stride=stride,
                             **_slabs(bias, residual, slice(0, n0)))
        self.tail = WsGemmPlan(a, b[:, n0:], None if out is None else out[:, n0:],
                               config=split_config(block_n, split), out_stride=stride,
                               **_slabs(bias, residual, slice(n0, self.N)))
        self.out_shape = (self.M, self.N)
        self.num_programs, self.config, self.split = self.dp.num_programs, self.dp.config, self.tail.split
        self.tail_tiles = tail_tiles
        self.workspace_bytes = self.tail.workspace_bytes

    def run(self, a: torch.Tensor, b: torch.Tensor, out: Optional[torch.Tensor] = None,
            bias: Optional[torch.Tensor] = None, residual: Optional[torch.Tensor] = None) -> torch.Tensor:
        if out is None:
            out = torch.empty(self.out_shape, device=a.device, dtype=a.dtype)
        n0 = self.n0
        self.dp.run(a, b[:, :n0], out[:, :n0], **_slabs(bias, residual, slice(0, n0)))
        self.tail.run(a, b[:, n0:], out[:, n0:], **_slabs(bias, residual, slice(n0, self.N)))
        return out

    def check(self):
        """As WsGemmPlan.check, for the split-K launch's banded merge."""
        self.tail.check()


def residual_by_tma(residual: torch.Tensor, dtype) -> bool:
    """Whether the data-parallel WS forms load ``residual`` by TMA (RESIDUAL 1, overlapped with the
    K loop): y's dtype, row-major with 16-byte aligned rows. Otherwise by pointers in the
    epilogue (RESIDUAL 2: correct, but the loads wait after each tile's K loop)."""
    return residual.dtype == dtype and _tma_ok(residual)


def _slabs(bias, residual, cols: slice) -> dict:
    """The bias and residual of a column slab of the output (WsTailPlan's two launches)."""
    return dict(bias=None if bias is None else bias[cols], residual=None if residual is None else residual[:, cols])


def streamk_ranges(tiles: int, k_steps: int, programs: int):
    """The stream-K kernel's schedule, as the kernel computes it: per program its (tile, first K
    step, end K step) pieces, and per tile (first, last) owning programs. A host twin of
    kernels/gemm_ws.py's range arithmetic (property-tested)."""
    total = tiles * k_steps
    owner = lambda i: ((i + 1) * programs - 1) // total  # noqa: E731
    pieces = []
    for p in range(programs):
        start, end = p * total // programs, (p + 1) * total // programs
        mine, i = [], start
        while i < end:
            t = i // k_steps
            k1 = min(k_steps, end - t * k_steps)
            mine.append((t, i - t * k_steps, k1))
            i = t * k_steps + k1
        pieces.append(mine)
    return pieces, [(owner(t * k_steps), owner(t * k_steps + k_steps - 1)) for t in range(tiles)]


def merge_rows(split: int, block_n: int) -> int:
    """Rows of the banded merge's bands (kernels/gemm_ws.py ``MERGE_RB``): 64 / RB contributors'
    bands go in flight at once, so a split of S parts takes bands of 64 / S rows (one round trip
    per band, each contributor a band or two), 8 for stream-K ranges and from 8 parts (at least
    8 rows at 64 columns, 4 at wider tiles: the band layout's rows)."""
    floor = 8 if block_n <= 64 else 4
    if split <= 0:
        return 8
    rows = 64
    while rows > floor and rows * split > 64:
        rows //= 2
    return rows


def split_parts(k_steps: int, split: int):
    """``sk_split``'s K parts of a tile, as the kernel cuts them (kernels/gemm_ws.py,
    ``_split_piece``): part s is K steps [s k_steps / S, (s + 1) k_steps / S)."""
    return [(s * k_steps // split, (s + 1) * k_steps // split) for s in range(split)]


def merge_bands(n: int, rows: int = 64, band: int = 8):
    """The banded merge's share of each of a tile's n contributors (``_band_merge_tile``): contributor
    j sums row bands j, j + n, ... of a half tile's ``rows`` rows, ``band`` rows each."""
    return [list(range(j, rows // band, n)) for j in range(n)]
