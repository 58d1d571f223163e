"""The GEMM schedule chooser: tile shape, split-K and kernel from a model, no run-time tuning.

For ``C (M, N) = A (M, K) @ B (K, N)`` it weighs three kernels:

* ``splitk`` (kernels/gemm_splitk.py): pointer loads, any BLOCK_M from 16, each output tile's K
  range cut into ``split_k`` work units merged in the same launch. The inference regime: M is a
  batch (1-256), there are few tiles, and the time is B's bytes streamed from memory.
* ``tiled`` (kernels/gemm.py): persistent TMA/wgmma tiles of 128 x 256, 64 x 128 or 64 x 256
  (128 x 128 tiles run in the split-K kernel, unsplit). Medium and large M: the time is
  tensor-core work.
* ``streamk`` (kernels/gemm_streamk.py): whole waves of tiles, then the remainder's K iterations
  in equal pieces (from 1024 rows, up to a few waves of tiles).

The model (:func:`estimate`) prices each candidate on a :class:`Machine` (SMs, shared memory,
HBM bandwidth, tensor rate, L2 bandwidth):

* work units run in waves of ``sms * occupancy`` (occupancy from shared memory and warps);
* a unit streams its B tile (BLOCK_N x its K range) and its A tile (BLOCK_M x K range, at a
  tenth of the price: A is small and read from L2) at its share of the bandwidth (the active units split
  HBM bandwidth, each at most a few times an SM's fair share), and does ``2 * BLOCK_M * BLOCK_N *
  K range`` flops (padded rows cost too) at its SM's share of the tensor rate; its time is the
  larger of the two plus a fixed start-up (first loads, pipeline fill);
* a split-K tile pays for writing and re-reading its fp32 partials through L2 and one
  synchronisation; every launch pays a fixed cost;
* split-K tiles of at most 16 rows (the weights streamed once, M <= 16) are priced per SM instead
  (:func:`_weight_stream_s`): programs dealt to the SMs round-robin, the SMs sharing HBM as they
  drain, one start, a cost for co-resident programs.

:func:`choose` returns the cheapest candidate (operands whose rows are not 16-byte aligned only
with K blocks of at most MISALIGNED_MAX_BLOCK_K, at MISALIGNED_SM_BW_SHARE), unless a tuned table (``numasched tune-gemm``,
``options.gemm_table``) has an entry for the shape. Where K is not a multiple of 16 bytes,
:func:`pad_k_pays` says whether numasched.gemm copies the operands into zero-padded whole-line
rows first and plans the aligned GEMM over the padded K. No AMD GPU was available: the AMD machine
figures are datasheet numbers and the model has been checked on an H200 only.
"""
from __future__ import annotations

import functools
import math
import json
import re
from dataclasses import dataclass, replace
from typing import Optional, Tuple

import torch

from . import caps

__all__ = ["Machine", "Schedule", "candidates", "ranked", "estimate", "choose", "inflight_bytes", "load_table"]


# A TMA-fed 16-row program's round trip (see the weight-stream notes below; H200 figure: 1.5 us
# until the fifty-first session, see WEIGHT_STREAM_TMA_LONG_K)
WEIGHT_STREAM_TMA_LATENCY_S = 1.8e-6


@dataclass(frozen=True)
class Machine:
    """What the model knows of a GPU."""

    name: str
    sms: int
    smem_bytes: int          # shared memory (LDS) a block may use
    hbm_bytes_per_s: float   # sustained streaming read (measured where known)
    tensor_flops: float      # dense 16-bit matrix rate (measured where known)
    l2_bytes_per_s: float
    warps_per_sm: int = 64
    launch_s: float = 2.5e-6      # a launch, seen from the GPU (graph replay)
    unit_start_s: float = 0.8e-6  # a program's first loads and pipeline fill
    sm_bw_share: float = 1.5      # an SM alone streams at most this many times its fair share
    reduce_sync_s: float = 2.0e-6  # split-K: the ticket and the last program's merge
    splitk_partial_cost: float = 1.0   # split-K's fp32 partials cost this many times their bytes through L2
    partial_row_cost: float = 1.0      # 128-row split-K tiles under 128 rows (cut in K or narrow): x the model's time
    ws64: bool = False                 # the WS kernel's 64-row tiles weighed (WS64_*: timed on this GPU)
    co_resident_split: bool = False    # 17-64-row split-K tiles priced for sharing an SM (CO_RESIDENT_*: timed here)
    stream_tma_latency_s: float = WEIGHT_STREAM_TMA_LATENCY_S   # (see there) a TMA-fed 16-row program's round trip

    @staticmethod
    def of(device: Optional[torch.device] = None) -> "Machine":
        """The machine of a CUDA device (or the H200 figures for the interpreter / no GPU)."""
        if device is None or device.type != "cuda":
            return _KNOWN["h200"]
        idx = device.index if device.index is not None else torch.cuda.current_device()
        return _machine_of_index(idx)


# Measured here on an H200 and an H100 (bench/results, device KINDS.md): streaming read about
# 4.3 / 3.0 TB/s, dense bf16 about 790 TFLOP/s. MI300X / MI355X: datasheet (5.3 / 8 TB/s, 1307 /
# 2300 TFLOP/s), derated like the NVIDIA ones -- no AMD GPU was available to measure.
_KNOWN = {
    # partial_row_cost: at 33-127 rows the split-K kernel's 128-row tiles (A's rows under M through
    # pointers, B through TMA) ran 1.21-1.28x their modelled time on the H200 where cut in K parts
    # or 64 columns wide (geomean of 462 timings, 0.96-1.67; bench/results/gemm-s38/: ragged*,
    # pairs*, off-final-*; gemm-s39/: mid-*, sp1/), 1.01x unsplit 128 x 128 (100 timings), where
    # the WS split-K form with A's short last boxes ran 0.97x its own (gemm-s39/sp1/).
    "h200": Machine("H200", 132, 227 * 1024, 4.3e12, 7.9e14, 1.2e13, partial_row_cost=1.2, ws64=True,
                    co_resident_split=True),
    # the H100's split-K merge refit to a sweep of 21 schedules at each of 33 points of M = 64-256
    # (bench/results/gemm-ws-s30/sweep-h100/): its fp32 partials at 1.5x their L2 bytes and 5 us of
    # sync took the pick's time over the best timed from 0.938 to 0.975 (geomean), within 5 % at
    # 20 -> 26 points (the 128 x 128 tiles in 2-6 K parts it took at 128 rows ran 1.2-1.3x the
    # 128 x 64 tiles in fewer). The H200's sweep (gemm-sweep-*) is indifferent at M <= 256 (0.973
    # -> 0.974) and its grid run of this session had 3 of 7 changed picks slower: it keeps 1x, 2 us.
    # ws64: the 64-row WS tiles timed at 72-200 rows of the 11 projections (bench/results/gemm-s39/
    # h100-ws64/): the model's pick with them against without, cuBLAS / ours 0.945 -> 0.967 (33 points)
    # stream_tma_latency_s: the TMA-fed 16-row tiles timed at M <= 16 of the grid (pick and next two
    # by the model, three runs: bench/results/gemm-s40/h100-grid5-7/): with the H200's 1.5 us the
    # 64-program 16 x 64 x 128 tiles ran 4-7 % behind the 128-program pointer-fed 16 x 32 x 256 at
    # 4096 x 4096 / 14336 and 16 x 128 x 128 (40 programs) 3-4 % behind 16 x 64 x 128 at 5120
    # columns; at 1.8-3 us the pick is within 3 % of the fastest timed at 167 of those 168 points
    # (116 at 1.5 us), and at 691 of the 777 H100 points of gemm-s39/s40 (621)
    "h100": Machine("H100", 132, 227 * 1024, 3.0e12, 7.9e14, 1.1e13, reduce_sync_s=5.0e-6, splitk_partial_cost=1.5,
                    ws64=True, stream_tma_latency_s=2.0e-6, co_resident_split=True),
    "mi300x": Machine("MI300X", 304, 64 * 1024, 4.2e12, 9.0e14, 1.4e13),
    "mi355x": Machine("MI355X", 256, 160 * 1024, 6.4e12, 1.6e15, 1.6e13),
}


# A is small and each tile column re-reads it from L2: it costs a fraction of B's HBM bytes
# (0.1, fitted to the H200 runs of bench gemm_inference, where narrow BLOCK_N beat split-K).
A_WEIGHT = 0.1
# The split-K kernel's big tiles reach a fraction of the TMA-fed tiled kernel's tensor rate (its
# operands come through registers); fitted to the medium-M points (M = 128-1024) of the H200 runs.
SPLITK_MMA_EFFICIENCY = 0.5


# Stream-K is weighed for problems of at most this many waves of output tiles, and from this many
# rows (see candidates): on the H200 (bench/results/gemm_inference-h200-2026-11-23.csv) its pieces
# ran 1.3-1.9x the model's time where every tile was cut into pieces (M = 128-512: few tiles),
# while the split-K and tiled kernels ran 0.6-1.0x theirs; from 1024 rows, with whole waves first,
# it beat the best other schedule at several points (5120 x 12800: 198 against 254 us).
STREAMK_MAX_WAVES = 4
STREAMK_MIN_ROWS = 1024
# Operands whose rows are not 16-byte aligned (an odd K in bf16) are read without vector loads:
# an SM then streams at most this share of its fair bandwidth, so more, smaller units pay (H200:
# 3 x 5003 x 4093 ran 60 us unsplit and 27 us in 4 splits; 97 x 3001 x 1537 38 vs 25 in 2).
MISALIGNED_SM_BW_SHARE = 0.5
# ... and without cp.async the pipeline's stages go through registers: K blocks of 128-256 then
# ran 2-20x as long as 64 (H200, bench/results/gemm-late-full/: 3 x 5003 x 4093 16x128x128 in 3
# splits 104 us against 24 with 16x128x64 in 6; 301 x 7001 x 3011 128x64x128 921 us; 97 x 3001 x
# 1537 128x64x128 in 2 splits 103 against 24 with 128x64x64): misaligned operands take 64.
MISALIGNED_MAX_BLOCK_K = 64
# Ties (schedules the model prices the same: one tile shape with another K block) go to the one
# with more bytes in flight per SM, from 32-row tiles: on the H200 (bench/results/gemm-sweep-*,
# 25 schedules timed per point at M = 64-1024) 128 x 64 tiles ran 3-5 % faster with K blocks of
# 128 in 4 stages than of 64 in 6, 128 x 128 ones 4-8 % slower with 128 in 3 stages, 64 x 32 ones
# faster with three resident programs of K 64; with 16-row tiles (M <= 16) the deeper K blocks
# ran 1-5 % slower, so those keep the first of the ties.
TIE_MIN_BLOCK_M = 32
# Split-K tiles of at most WEIGHT_STREAM_MAX_ROWS rows (M <= 16: the weights streamed once) are
# priced per SM (_weight_stream_s): programs go to the SMs round-robin, each SM streams its
# programs' bytes at most at its programs' rate (WEIGHT_STREAM_SM_BYTES_PER_S shared by `occ` at a
# time), the SMs share HBM and one that finishes early hands its share on (the others then run at
# their cap), the start cost is paid once (an SM's next program starts as its last one drains),
# and a grid that puts two or more programs at once on an SM takes CO_RESIDENT_COST longer. The
# gate is the tile (16 rows), not M: 16-row tiles are candidates at any M. The per-wave model
# charged a part-empty last wave whole and co-residency nothing: on the H100 it took 16 x 128 x
# 64 (two programs per SM, 86-88 us at 28672 x 4096) over 16 x 128 x 128 in 5 stages (one per SM,
# 1.7 waves: 81-82 us; gemv-s32/, gemm-s31/gemv-h100/). Scored on the recorded timings
# (scripts/gemm_rank_eval.py): the pick within 3 % of the best timed at 137 of 142 H100 points with
# M <= 16 (131 before), 280 of 308 at every M (274), 418 of 488 of the WS sweeps (403), no changed
# pick more than 1.2 % slower; the H200's 558 recorded points with M <= 16 are unchanged (491 ->
# 490). CO_RESIDENT_COST from 0.07 to 0.3 gives the same picks.
# An SM streaming 16-row tiles once others are done reaches at least WEIGHT_STREAM_SM_BYTES_PER_S
# (a rate of the SM's own loads in flight, not a share of the GPU's bandwidth), or the machine's
# sm_bw_share of its fair share where that is more: at 25600 x 5120 (200 tiles of 16 x 128, 68 SMs
# with a second) 16 x 128 x 128 in 5 stages ran 89.0-91.1 us at M = 1-16 on an H100, no slower per
# byte than at 28672 x 4096 (224 tiles), which needs the 68 SMs at 44 GB/s, 1.94x their share (the
# 1.5x cap priced it 100.6 us and took the 64 x 256 TMA tiles, 94.8-98.3; gemm-s34/m16-grid/). On
# an H200 1.5x its share is more (49 GB/s): its picks stay as they were timed. Only where some SMs
# run more programs than others (more programs than SMs): grids of fewer programs, each SM alone
# from the start, were not measured (at 1 x 1024 x 5120 the higher cap would take 32 unsplit
# programs over 128 split ones). Scored on every
# recorded timing: H100 M <= 16 187 -> 192 of 197 within 3 %, every M 330 -> 335 of 363, the WS
# sweeps and the H200's recorded points unchanged (917/1054, 588/714).
WEIGHT_STREAM_MAX_ROWS = 16
CO_RESIDENT_COST = 0.10
# The same cost, on the data-parallel model, for split-K tiles of 17-64 rows where an SM holds
# several programs and there are more of them than SMs (CO_RESIDENT_MAX_ROWS). On an H200,
# 23-28 rows (bench/results/gemm-s47/h200-offgrid, h200-fresh42): 32 x 64 x 64 in two K parts,
# three programs an SM, ran 1.16-1.26x the unsplit 32 x 128 x 128 tiles (one an SM) the model
# put 2-12 % slower; 32 x 64 x 64 ran 1.10-1.20x its estimate wherever timed, 32 x 128 x 128
# 0.87-1.0x. Scored on every recorded timing of the current kernels: H200 (sessions 36-47) 3244
# -> 3284 of 3677 picks within 3 % of the best timed, H100 (sessions 30-47) 2016 -> 2035 of 2373.
# Only where timed (Machine.co_resident_split: the H200 and the H100; on the MI355X model it would
# move 7 of 300 random picks at 17-64 rows, unmeasured).
CO_RESIDENT_MAX_ROWS = 64
WEIGHT_STREAM_SM_BYTES_PER_S = 45.5e9
# ... and one whose tiles read both operands through TMA descriptors (16-row tiles of 64+
# columns, splitk_operands) streams from the start at least its programs' B bytes in flight (the
# stages but one) per WEIGHT_STREAM_TMA_LATENCY_S: on the H200 (bench/results/gemm-s38/m16/,
# fewer programs than SMs) 16 x 128 x 128 in 5 stages (128 KiB in flight) streamed 84-91 GB/s a
# program (6144 x 4096: 48 programs, 15.8 us; 5120 x 5120: 40, 17.8 us), which the pointer-era
# cap priced at 25-30 us, and 16 x 64 x 128 in 6 (80 KiB) 52-53 GB/s (4096 x 4096 and 4096 x
# 14336, 64 programs); at 25600 x 5120 16 x 128 x 128 took 62.2 us against the 68.6 of the
# tiled kernel the model had taken. The H100 was not measured with these tiles through TMA.
# K blocks longer than WEIGHT_STREAM_TMA_MAX_BLOCK_K count as that long (16 x 64 x 256 in 5 stages
# streamed 65 GB/s at 4096 x 14336, not the 87 of its 128 KiB in flight: 31.3 against 29.4 us for
# the pointer-fed 16 x 32 x 256, gemm-s38/m16-model/). Among tiles the model prices the same (the
# weight streamed at the HBM rate either way) the one with the most B bytes in flight so counted
# goes first (16 x 128 x 128 in 5 stages ran 0.8-5 % faster than 16 x 128 x 64 in 6 at 5 of 5 points).
# (WEIGHT_STREAM_TMA_LATENCY_S: above Machine, whose stream_tma_latency_s defaults to it)
WEIGHT_STREAM_TMA_MAX_BLOCK_K = 128
# ... in the ties' rule. The rate cap counts the K past it at WEIGHT_STREAM_TMA_LONG_K: on the
# H200, 16 x 64 x 256 in 5 stages ran 0.80-1.04x (median 0.96) the time of 16 x 64 x 128 in 6
# wherever 80 programs or fewer stream (5120 columns: 77 recorded points of 5120 x 5120, 3072-
# 12800 deep), 1.00-1.06x from 96 (6144 x 4096: 73 points, median 1.036); the H100 the reverse at
# 80 (1.06x). With the H200's latency 1.5 -> 1.8 us (WEIGHT_STREAM_TMA_LATENCY_S; the capped rate made 16
# x 64 x 256 lose there), scored on every recorded H200 timing of sessions 37-51
# (scripts/gemm_rank_eval.py --chooser, 76 runs): M <= 16 839 -> 884 of 944 picks within 3 % of
# the best timed (geomean pick / best 1.0087 -> 1.0066), every M 2971 -> 3016 of 3345; the H100's
# 2399 points unchanged at any share (their ties keep the cap). Changed picks slower than before:
# 4824 x 2584 (1.03x, 18 points), 5120 x 12800 at 17-64 rows (16 x 128 x 128 in 2 parts, 1.02x,
# 45), 11264 x 2848 and 1824 x 15184 (1.02x, one each). Timed after the change at 7 changed picks
# (two off the grid), each faster than the old pick: 0.896-0.986x (bench/results/gemm-s51/
# m16-new-model/); not yet as a whole grid.
WEIGHT_STREAM_TMA_LONG_K = 0.5
# The stream-K phase's K iterations cost this much more than the model's streaming/tensor time
# (pipeline restarts per piece, partial tiles through L2; fitted to the same run).
STREAMK_PIECE_COST = 1.5
# The warp-specialised Gluon GEMM (kernels/gemm_ws.py, Hopper, 16-bit, bias / residual in its epilogue):
# data-parallel tiles of 128 rows and WS_TILE_NS columns (two power-of-two boxes: 80 = 64 + 16,
# 160 = 128 + 32), a loader warp feeding two wgmma warpgroups, persistent. Its widths fill the
# SMs where 128 and 256 leave a wave part-empty, as cuBLAS's 80-, 168-wide tiles do. Timed on an
# H100 beside the Triton pick at M = 128-2048 (bench/results/gemm-ws-s30/, 55 points x 7 widths)
# the best width ran 0.80-1.0x the Triton pick's time from 512 rows (one point 1.05x) and was
# mixed below (0.9-1.14x at 256 rows): from WS_MIN_ROWS the chooser takes the WS family, the
# width by the model below; under it the Triton schedules.
WS_TILE_NS = (256, 192, 160, 144, 128, 96, 80)
# ... and of three power-of-two boxes (kernels/gemm_ws.py N2; the untransposed form only), for
# where N / SMs falls between the widths above (25600 columns: 124 tiles of 208 where 256 leaves
# 100 SMs a tile and 192 makes 134). Timed on an H100 against the two-box widths at 14 shapes
# (bench/results/gemm-s44/h100-three): 1.02-1.08x faster than the model's two-box pick at four
# (646 x 8536 x 2416 51.4 against 55.3 us with 256; 2048 x 6656 x 4096; 863 x 6320 x 8632;
# 128 x 25600 x 5120), 0.89-0.95x at six where the model, pricing a box past the first as
# WS_TWO_BOX_COLS columns, took them (224 at 14336 columns: 114 against 108 us). The chooser does not
# weigh them (``wide3``: gemm_tune does, so a tuned table can name them where they win).
WS_TILE_NS3 = (224, 208, 176)
WS_MIN_ROWS = 512
# ... and from WS_FILL_MIN_ROWS rows where the model's width gives at least WS_FILL x the SMs in
# tiles and K is at least WS_FILL_MIN_K (64 K steps a tile): every width timed at 256 rows beside
# the Triton pick (bench/results/gemm-s36/ws256/, H200; gemm-ws-s30/, H100), the model's width
# ran 1.00-1.10x faster on the H200 at the 7 of 11 projections that meet both (5120 x 12800
# 1.10, 14336 x 8192 1.08, 5120 x 5120 1.05, 28672 x 4096 1.03; on the H100 0.96-1.11, geomean
# 1.02) and 0.73-0.96x at the 4 that do not (2560 x 8192: 64 tiles; 4096 x 4096 and 4096 x
# 14336: 104; 8192 x 2048: 32 K steps). The WS model's estimates there ran 0.90-1.04x the times.
#
# With A's last tile row in short boxes (gemm_ws.last_box_rows, the thirty-ninth session) the WS
# widths ran 1.14-1.35x faster than the Triton pick at 140-200 rows on the H200 (140 x 10240 x
# 6896: 55.2 against 74.6 us; 200 x 8192 x 7168: 43.5 against 50.1; gemm-s39/dp1/), the model
# ranking them so: the same rule from more than one tile row.
WS_FILL_MIN_ROWS = 129
WS_FILL = 0.8
WS_FILL_MIN_K = 4096
# ... and where the WS model gives at least WS_MIN_S: at 512-1024 rows and 10 us or less (1000^3,
# 768^3, 512 x 1024 x 1024, 1024 x 2048 x 1024) the Triton split-K tiles ran 0.80-0.95x its time on
# the H100 (their fixed costs are smaller); from 25 us the two were even or WS ahead.
WS_MIN_S = 12e-6
# The WS model, per K step of 64 per tile: the slowest of the tile's flops at its SM's share of
# the tensor rate (WS_RATE times the machine's; a two-box tile as if WS_TWO_BOX_COLS more columns:
# the second wgmma's fixed cost), B's and A's bytes from HBM (B shared by the tile rows of a group
# of 8, A by as many tile columns) at WS_HBM times the streaming rate and both from L2 at WS_L2
# times its rate, WS_MISALIGNED more where a row of K is not a whole number of 128-byte lines
# (each box row then spans two); plus WS_TILE_START_S a tile. Fitted to the 673 WS times of this
# session's H100 runs (bench/results/gemm-ws-s30/: the widths run, the grid twice, 15 shapes off
# it; rms log error 0.089, worst 0.30).
WS_RATE, WS_HBM, WS_L2, WS_TWO_BOX_COLS, WS_MISALIGNED, WS_TILE_START_S = 1.018, 1.118, 1.084, 15.4, 0.35, 1.42e-6
# (WS_MISALIGNED was 0.56 from that fit, which had 128-row tiles only; the 64-row tiles keep it as
# WS64_MISALIGNED. At 0.35 for the 128-row ones the chooser's pick is within 3 % of the best timed
# at 2684 of the H200's 3038 recorded points (gemm-s36 to s42; 2663 at 0.56), within 5 % at 2797
# (2782), the H100's 1528 1368 / 1446 (1367 / 1445); 0.2-0.45 score within 3 points of it. Fresh
# random shapes off the grid on an H100 (gemm-s42/h100-fresh/): 271 x 16992 x 13424 and 280 x
# 17704 x 9648, K rows not whole lines, ran 288.7 and 210.6 us in 128 x 256 tiles against 354.6
# and 257.5 for the 64 x 192 tiles that 0.56 priced ahead.)
WS64_MISALIGNED = 0.56
# From WS_SPLIT_MIN_ROWS to WS_SPLIT_MAX_ROWS rows (one 128-row tile row, at least half full): the
# WS kernel's split-K form (gemm_ws.split_config:
# tiles of 128 x WS_SPLIT_NS, S K parts in K lockstep, one unit per SM, the banded merge): every
# SM streams the weight where the tiles alone fill a few (K loops on all SMs ran 0.82-0.98x
# cuBLAS's time at M = 128, K >= 8192 on an H100), then the fp32 partials (S per tile) go to L2
# and back at WS_SPLIT_PARTIAL_L2 of its rate, plus WS_SPLIT_SYNC_S (arrivals, the wait, the
# bands' stores). Fitted to 40 times of 8 shapes, M = 64-256, on an H100 (bench/results/
# ws-split-s31/: loop x 0.98, rms log error 0.074). At 64 rows (half the tile's MMA rows idle; the
# Triton 64-row tiles ran 43.6 against 51.1 us at 64 x 4096 x 14336) and at 256 (three of four
# picks slower: 256 x 5120 x 5120 41.8 against 29.3) it lost in the grid run (ws-split-s31/mid-h100/).
WS_SPLIT_NS = (64, 128, 256)
WS_SPLITS = (2, 3, 4, 6, 8)
WS_SPLIT_MIN_ROWS, WS_SPLIT_MAX_ROWS = 65, 128
WS_SPLIT_PARTIAL_L2, WS_SPLIT_SYNC_S = 0.10, 2.4e-6
# ... taken only where its estimate is under WS_SPLIT_MARGIN times the best Triton schedule's: the
# Triton model's estimates ran 0.93-1.67x their measured times at those 8 shapes (the split form's
# 0.92-1.09x), so a small modelled lead was no lead (128 x 4096 x 4096: 22.0 against 19.0 us)
WS_SPLIT_MARGIN = 0.95
# The WS tail form (gemm_ws.WsTailPlan, Schedule(kind "ws", tail=True)): where the 128 x 128 or
# 128 x 256 tiles leave the last round part-empty, whole rounds run data-parallel over the first
# columns and the last round's tiles (the columns past them) run in the split-K form, S K parts
# each on SMs of their own. Priced as the two launches the WS model prices (the data-parallel
# slab, then the split slab). Weighed with the tail split-K schedules (options.gemm_tail_split)
# from WS_FILL_MIN_ROWS rows and WS_TAIL_MIN_K, WS_TAIL_SPLITS parts (at least two K steps each),
# where the tail's units fit on the SMs. Timed on an H100 at the 19 shapes where the model took it
# (bench/results/gemm-s45/h100-tail: 8 of the grid, 11 off it), beside the best pick
# without it: at K >= 4096 the tail ran 1.04-1.10x faster at 8 (760 x 14336 x 8192 282.1 ->
# 256.0 us, 1024 x 25600 x 5120 432.6 -> 392.5, 512 x 14336 x 8192 184.4 -> 171.3; cuBLAS 275.3,
# 409.6, 193.2), even at 4 and 0.92-0.98x at 4 (512 x 25600 x 5120 191.7 -> 207.4, where 160-wide
# data-parallel tiles fill 4.85 rounds; 373 x 13808 x 6920 137.1 -> 142.6); its estimates ran
# 0.88-1.16x its times, as the data-parallel widths' did (0.86-1.13x). Under K = 4096 (four points
# at 187-246 rows, K 2560-3728) it lost to the Triton picks (0.81-0.98x: the WS model's short K
# loops, as for the 64-row tiles), hence WS_TAIL_MIN_K.
WS_TAIL_NS = (128, 256)
WS_TAIL_SPLITS = (2, 3, 4, 6, 8, 12, 16)
WS_TAIL_MIN_K = WS_FILL_MIN_K
WS_TAIL_MARGIN = 1.0
# Its estimates over S are flat near their lowest (the split units' bandwidth share grows as they
# get fewer), while the times fell with more parts: 512 x 25600 x 5120 207.4 / 200.0 / 197.0 us
# at S = 8 / 12 / 16 (modelled 189.0 / 188.8 / 189.4), 760 x 14336 x 8192 270 / 277 / 256 at
# S = 4 / 6 / 8 (262.0 / 259.9 / 259.3; h100-tail). Among the tail schedules of the pick's width
# priced within WS_TAIL_TIE of it, the most parts go first.
WS_TAIL_TIE = 1.02
# The WS kernel's tiles of 64 rows (one consumer warpgroup, gemm_ws.wide_config(block_m=64)),
# weighed from WS64_MIN_ROWS to WS64_MAX_ROWS rows (two to eight tile rows) where K is at least
# WS_FILL_MIN_K, by the WS model above. Timed on the H200 beside the Triton picks at 64-128 rows of
# the 11 projections and 26 shapes off the grid (bench/results/gemm-s39/ws64-*): the best width ran
# 0.85-0.94x the Triton pick's time at 72-128 x 5120 x 5120, 6144 x 4096, 5120 x 12800 and 140-200
# rows, e.g. 128 x 5120 x 12800 41.4 us against 47.7 (cuBLAS 43.5), but 1.1-1.3x at 64 rows (one
# tile row: half the SMs) and at 8192 x 2048 (32 K steps). Taken by the model there (pick / best
# timed 1.037 -> 1.024 at those 70 points, within 3 % at 37 -> 48). Weighed where Machine.ws64
# (the H200 and the H100, where they were timed).
# Widths WS64_TILE_NS (not 256: its four-stage ring ran 1.2x the model's time), each only where
# its tiles fill WS_FILL of the SMs (2560 x 8192 and 4096 x 14336 at 72-96 rows: 64-104 tiles of
# 80, 1.1-1.2x the Triton pick).
WS64_MIN_ROWS, WS64_MAX_ROWS = 65, 512
# K below WS_FILL_MIN_K, timed on an H100 at 32 shapes of 72-250 rows and K 1704-3584
# (bench/results/gemm-s44/h100-ws64k: every 64-row width beside the picks): the model's pick with the
# 64-row tiles weighed from K = 2048 ran 1.053x faster (geomean of the 25 it could be scored at; 9
# faster by > 3 %, up to 1.39x at 159 x 21000 x 2048; 2 slower: 220 x 17784 x 3272 0.785), but the
# grid's 8192 x 2048 (72-128 rows) 0.93-0.97x, as on the H200 before. The same 32 shapes on an H200
# (gemm-s47/h200-ws64k): where W's rows are whole 128-byte lines and K >= WS64_MIN_K_LINES (40 K
# steps and more) the best 64-row width ran 1.06-1.53x faster than the pick at 18 of 19 points,
# where they are not (K 1704, 2072, 3272) 0.68-1.0x, and at 8192 x 2048 0.91-1.16x. Weighed from
# WS64_MIN_K_LINES there: on the recorded timings the picks it changes ran 1.25x faster (H200, 12
# of 12 faster) and 1.10x (H100, 8 timed, none slower by 3 %); the grid's picks do not change.
WS64_MIN_K = WS_FILL_MIN_K
WS64_MIN_K_LINES = 2560
WS64_TILE_NS = (192, 160, 144, 128, 96, 80)
# A 64-row tile's SM takes in its A and W boxes from L2 at WS64_SM_BYTES_PER_S, however few SMs
# are busy (the 128-row tiles' L2 term is the machine's L2 rate shared by the busy SMs, which gave
# fewer, wider 64-row tiles more each): at 256 x 4096 x 4096 on an H200 the 64 x 128 tiles (128 on
# 132 SMs) ran 16.4 us, 64 x 144 (116 tiles) 17.9, 64 x 160 (104) 18.8, each about 122 GB/s an SM
# (gemm-s39/grid2-4, mid2); the shared term ranked 144 or 160 first. Scored on the recorded
# timings with the chooser's candidates and pick (scripts/gemm_rank_eval.py --chooser): the
# thirty-ninth session's 997 H200 points within 3 % of the best timed 825 -> 858, within 5 % 878
# -> 907; the H100's 383 (gemm-s39/h100-*, gemm-s40/h100-*) 299 -> 310 and 345 -> 350; the
# thirty-fifth to thirty-eighth sessions' 1855 unchanged. 120-140 GB/s score the same (110: 846).
# (A floor of 105 GB/s under the shared term past two tile rows, this session's first form, took
# 840.) From 257 to WS64_MAX_ROWS rows the tiles were timed on an H100 at 384 and 512 x 2560 x 8192
# (64 x 128 28.5 us and 64 x 160 33.7, against 34.2 and 37.0 for the picks, cuBLAS 26.8 and 30.4:
# gemm-s40/h100-probe1), where 80-wide 128-row tiles split their B box in two (64 + 16).
WS64_SM_BYTES_PER_S = 125e9
# At 112-128 rows, two 64-row split-K tiles per tile column, unsplit, every unit on its own SM in
# one wave (two row tiles times the columns at most the SMs): the two tiles of a column run at
# once and read the same W tile, which comes from HBM once and from L2 for the other; priced as
# W's bytes halved (row_pair_shares_w). Timed on an H200 (bench/results/gemm-s37/rows64-*,
# pair-*): at 128 rows 64 x 64 x 128 ran 12.2-12.6 us at 4096 x 4096 against 18.3 for the former
# pick (cuBLAS 14.0), 17.9 against 24.7 at 2560 x 8192, 34.1-34.3 against 40.9-42.6 at
# 4096 x 14336 (cuBLAS 37.7), and within 2 % of it at 128 x {6144, 8192} x ... and 5120 x 5120.
# With a part-empty second tile it lost: 97 x 4096 x 14336 50.6 against 43.2 for 128 x 128 x 64
# in 3 splits, and 66-80 rows ran 0.42-0.68 of cuBLAS (the second tile streams all of W for 2-16
# rows); hence from 112 rows then (the second tile at least 3/4 full; see below). At 112, 120 and 127
# rows (pair-112/) the pair took 0.77-0.87x the time of the best 128-row schedule at 4096 x 4096,
# 2560 x 8192 and 4096 x 14336 (9 of 9), 0.99-1.00x at 6144 x 4096 and 5120 x 5120. Where W's
# rows are not whole 32-byte sectors the pairs ran slower (128 x 7000 x 5000 35.3 against 28.3),
# and split pairs were not timed: neither is priced so. Scored on the recorded timings of the current candidates (scripts/gemm_rank_eval.py's
# score): H200 pick within 3 % of the best timed at 1541 of 1758 points (1537 without the
# pairs), within 5 % at 1599 (1594); H100 689 / 723 of 761 (690 / 723).
# With A's partial tile row read through pointers (splitk_operands, the thirty-eighth session)
# the pairs were timed again at 66-100 rows (bench/results/gemm-s38/pairs*): the best pair ran
# 0.85-0.99 of cuBLAS where the pick (128-row tiles) ran 0.65-0.89 at 6144 x 4096, 4096 x 4096,
# 8192 x 7168, 8192 x 2048 and 5120 x 5120, but lost at K of 8192 and more (2560 x 8192, 4096 x
# 14336, 5120 x 12800: 0.66-0.90 against 0.70-0.95): under ROW_PAIR_FULL_ROWS rows (the second
# tile less than three quarters full) they are priced so only where a row of W is at most
# ROW_PAIR_PARTIAL_MAX_K_BYTES long. Scored on those 65 timed points (scripts/gemm_rank_eval.py):
# pick within 3 % of the best timed at 61 (34 with pairs from 112 rows only), geomean pick / best
# 1.006 (1.068). Not yet timed on shapes outside that set.
# From 129 to ROW_GROUP_MAX_ROWS rows, where M is not a multiple of 128 (a 128-row tile row part
# empty), the same for three or four 64-row tiles of a column where a row of W is at most
# ROW_PAIR_PARTIAL_MAX_K_BYTES: W's HBM bytes divided by their count, but each SM still takes in
# its A and W tiles from L2 at ROW_GROUP_SM_BYTES_PER_S at most. Timed on the H200 beside the WS
# widths and the 128-row tiles at 140-252 rows (bench/results/gemm-s39/mid-*), 64 x 128 x 128 ran
# 0.77-0.87x the others' best at 140 x 4096 x 4096, 200 x 4096 x 4096, 218 x 3496 x 5904 and 140 x
# 5120 x 5120 (taking in 85-89 GB/s an SM), but 1.1-1.2x at 200 x 2560 x 8192 and 200 x 4096 x
# 14336 (16-28 KB rows). Scored there (scripts/gemm_rank_eval.py, 71 points, the WS widths and
# the Triton tiles both weighed: candidates): within 3 % of the best timed at 56 (52 without),
# within 5 % at 61 (57); the 972 earlier H200 points as before.
ROW_PAIR_MIN_ROWS = 65
ROW_PAIR_FULL_ROWS = 112
ROW_PAIR_PARTIAL_MAX_K_BYTES = 14336
ROW_GROUP_MAX_ROWS = 256
ROW_GROUP_SM_BYTES_PER_S = 88e9
# The same for the two 128-row tiles of a tile column split in K where the second is at most half
# full (ROW_SPLIT_SHARE_ROWS, K at least ROW_SPLIT_SHARE_MIN_K, every unit on its own SM): a
# tile's two rows' units of a K part run at once and read the same W box, once from HBM. At
# 129-160 rows on an H100 the 128 x 128 tiles in 2-3 parts ran 0.6-0.7x the model's time
# without it (bench/results/gemm-s45/h100-row2, gemm-s43/h100-fresh2-*: 133 x 2560 x 8192 28.8 us
# in three parts against 37.3 for the pick, 128 x 64 unsplit; 135 x 2528 x 9664 31.6 against
# 52.0; cuBLAS 23.8, 27.0). Not for unsplit tiles: 128 x 64 at 140 rows priced so ran far slower
# than modelled (forty-fifth session). Scored on the recorded timings (scripts/gemm_rank_eval.py
# --chooser): H100 pick within 3 % of the best timed at 2364 of 2706 points (2360 without), H200
# 3946 of 4466 (3945); at K 4096 the H200 ran 140 x 4096 x 4096 in two parts 1.22x slower than the
# 64 x 128 tiles, hence the K floor.
ROW_SPLIT_SHARE_ROWS = (129, 192)
ROW_SPLIT_SHARE_MIN_K = 6144
# Where the chooser takes those split 128 x 128 Triton tiles, the WS kernel's split-K form of the
# same tiles and parts runs them faster (its two tile rows' units of a K part share W the same way;
# the second row's A in short boxes, its dead half without wgmma is not needed there): on an H100,
# at the 17 of 22 random shapes of 129-192 rows where the pick was such a schedule, the WS twin
# ran 0.70-0.99x its time (geomean pick / best timed 1.069 -> 1.003; cuBLAS / ours 0.786 -> 0.837;
# bench/results/gemm-s46/h100-row2-wssplit, h100-row2-fresh10, the second set drawn after the
# rule). The WS model prices it 1.1-1.3x the Triton model's (under)estimate there, so the twin is
# taken by this rule (ws_split_twin), not by the estimates.
ROW_SPLIT_WS_TWIN = True


# A whose rows are not whole 128-byte lines (K * element size a multiple of 16 but not of 128):
# every tile column re-reads A, and a load of a row that does not start on a line spans two.
# numasched.gemm copies A into whole-line rows first (options.gemm_align_a; kernels/copy_rows.py)
# where the rows' offsets make most of them cross a line: row r starts at r * (row bytes) mod 128,
# so with gcd(row bytes, 128) = 16 seven rows in eight are misaligned, with 32 three in four,
# with 64 one in two. Timed on an H200 with the row-copy kernel, forced on against off at 31
# shapes off the grid (bench/results/gemm-s37/oldA*, newA*: 2-3500 rows, every kernel kind):
# - rows 16 bytes off a line pattern (gcd 16) from 16 rows: faster at 19 of 20 shapes, 1.00-1.62x
#   (geomean about 1.10; 128 x 7000 x 5000 47.1 -> 29.1 us, 64 x 5000 x 3000 16.2 -> 11.9,
#   2048 x 3000 x 5000 (WS) 125.8 -> 113.4, 16 x 6144 x 4104 20.2 -> 18.4), the one slower 0.98x;
# - gcd 32, 64 or 96: 0.91-1.07x (geomean below 1: 1300 x 2608 x 10128 0.91, 96 x 10736 x 7696
#   0.96), not copied;
# - under 16 rows (7 x 14000 x 5000): 0.99x, not copied.
# The thirty-sixth session's rule (re-reads of 32 MB at 64-511 rows, torch's strided copy) took
# 8 of these shapes, three of them slower.
ALIGN_A_MIN_ROWS = 16
ALIGN_A_OFFSET_GCD = 16


def align_a_pays(M: int, K: int, elt: int, lead: Optional[int] = None) -> bool:
    """Whether numasched.matmul copies A (M rows of K elements of ``elt`` bytes, rows ``lead``
    elements apart, default K) into whole 128-byte rows first: from ALIGN_A_MIN_ROWS rows, where
    the rows' offsets into the lines have the pattern gcd(row bytes, 128) <= ALIGN_A_OFFSET_GCD
    (see above; a row stride that is not even a 16-byte multiple is worse still); never where K
    is not a multiple of 16 bytes (no vector loads either way)."""
    lead = K if lead is None else lead
    if (lead * elt) % 128 == 0 or (K * elt) % 16 or M < ALIGN_A_MIN_ROWS:
        return False
    return math.gcd(lead * elt, 128) <= ALIGN_A_OFFSET_GCD


# K whose rows are not 16-byte multiples (bf16 with an odd K): neither A's rows nor W's are
# aligned, so there is no TMA and the split-K kernel's pointer loads go one element at a time.
# numasched.gemm can copy A and W into zero-padded rows of Kp = K rounded up to whole 128-byte
# lines (options.gemm_pad_k; kernels/copy_rows.py with PAD) and run the aligned GEMM over Kp (the
# padded columns are zeros in both operands: the product is unchanged). The copies read
# (M + N) * K and write (M + N) * Kp elements at the HBM rate, a launch each; the misaligned
# GEMM's model underestimates it: on an H200 (bf16, y = x @ W.T) 301 x 7001 x 3011 was modelled
# 73.9 us and ran 157 (2.1x; cuBLAS 156), 97 x 3001 x 1537 modelled 16.4 and ran 24 (1.46x;
# cuBLAS 22), where an aligned GEMM of those sizes takes about 25-35 and 8-10 us (modelled 37.1 and
# 6.1 over Kp). The misaligned estimate is taken at PAD_K_MISALIGNED_COST times its value, a little
# under the lower of the two ratios, so the copy is made only where it pays against that reading;
# on the H200's figures that takes both shapes (modelled 62.8 against 103 us, 15.6 against 23)
# and leaves 17-32 x 4096 x 4099 (the copy of W about the aligned GEMM's time) misaligned.
# Never at M <= WEIGHT_STREAM_MAX_ROWS: there the misaligned split-K kernel already streams W once,
# and a copy of W costs more than that read (H200: 3 x 5003 x 4093 ran 23.5 us misaligned against
# cuBLAS's 51; 13 x 4111 x 2053 12.7 against 28; the model overestimates these: 28.0 and 14.8).
# Timed on an H100 (gemm-s40/h100-pad0, pad1, padauto: bf16, CUDA graphs, cuBLAS beside), us
# misaligned / padded (cuBLAS): 97 x 3001 x 1537 23.4 / 14.4 (22.4), 301 x 7001 x 3011 153 / 76.3
# (152), 200 x 5001 x 4099 114 / 62.1 (89-94), 1024 x 3001 x 1537 104 / 40.4 (107), 64 x 8191 x
# 2047 45.8 / 35.7 (41), but 33 x 4097 x 3001 25.3 / 27.9 (34.5), 3 x 5003 x 4093 25.0 / 47.1,
# 13 x 4111 x 2053 13.3 / 21.9: so not under PAD_K_MIN_ROWS rows either (the 64-row tiles read
# W about once; the copy of W costs about as much again).
PAD_K_MISALIGNED_COST = 1.4
PAD_K_MIN_ROWS = 64


def padded_k(K: int, elt: int) -> int:
    """K rounded up to whole 128-byte lines (elements)."""
    return _cdiv(K * elt, 128) * 128 // elt


def pad_k_copy_s(M: int, N: int, K: int, elt: int, machine: Machine) -> float:
    """The two copies of the K-padding path: A's and W's rows read (K) and written (Kp) at the
    HBM rate, a launch each."""
    return 2 * machine.launch_s + (M + N) * (K + padded_k(K, elt)) * elt / machine.hbm_bytes_per_s


def pad_k_pays(M: int, N: int, K: int, elt: int, machine: Machine, *, tma: bool = True, tail: bool = True) -> bool:
    """Whether numasched.matmul pads K (options.gemm_pad_k None): K not a multiple of 16 bytes,
    at least PAD_K_MIN_ROWS rows, and the copies plus the aligned GEMM over the padded K
    (``tma``: read through TMA as on Hopper; ``tail``: options.gemm_tail_split) modelled under
    PAD_K_MISALIGNED_COST times the misaligned GEMM's estimate (see above). The WS kernel is not
    weighed for the padded GEMM (it could only lower that side)."""
    if (K * elt) % 16 == 0 or M < PAD_K_MIN_ROWS:   # (PAD_K_MIN_ROWS > WEIGHT_STREAM_MAX_ROWS)
        return False
    misaligned = _choose(M, N, K, elt, machine, True, False, False, tail, False)
    padded = _choose(M, N, padded_k(K, elt), elt, machine, not tma, tma, True, tail, False)
    if misaligned is None or padded is None:
        return False
    return padded.est_s + pad_k_copy_s(M, N, K, elt, machine) < PAD_K_MISALIGNED_COST * misaligned.est_s


# How the split-K kernel reads its operands on Hopper (options.gemm_splitk_tma), by tile, timed
# on an H200 with the same schedule read three ways (bench/results/gemm-s38/rows-probe*: both
# through TMA descriptors, B only with A through masked pointer loads, both through pointers):
# - tiles of 64+ rows: through the descriptors, unless the last tile row is less than
#   SPLITK_A_BOX_MIN_FILL full: there A's box runs past its last row for a quarter of it or more,
#   and the same schedule ran up to 1.6x longer than with A through pointers (which that row
#   then takes; full rows keep the descriptor, which ran 3-16 % faster than pointers there) (64-row tiles at
#   M = 32: 5120 x 5120 64 x 64 x 128 20.3 against 16.4 us, 8192 x 7168 38.0 against 30.6, 2560 x
#   8192 64 x 32 x 256 26.7 against 17.1; at M = 40 through the descriptor 18.2, 33.0, 22.1 where
#   M = 32 through pointers took 16.5, 30.6, 17.2); with the last row three quarters full or more
#   (M = 48, 96-127 rows in 128-row tiles) within a few per cent either way (128 x 64 x 128 at
#   96 x 4096 x 4096: 17.9 through the descriptor against 20.5). Over 66 points of M = 36-88 on
#   the 11 projections the chooser's picks went from 0.822 to 0.915 of cuBLAS (geomean);
# - 16-row tiles (the whole box past M at M = 1 cost nothing measurable): 128 columns through
#   the descriptors 0.88x the pointers' time (geomean of 28 points, 14 shapes, at most 1.003x),
#   64 columns 0.95-1.0x, 32 columns through pointers (the descriptors 1.07-1.13x);
# - 32-row tiles: 32 and 128 columns through the descriptors (0.94-0.97x, 0.90x), 64 columns with
#   A through pointers (0.92x; both through the descriptors 1.03-1.08x); a last row under three
#   quarters full as the 64+-row tiles (B only), 32 columns there through pointers (B only ran
#   1.10-1.12x).
SPLITK_A_BOX_MIN_FILL = 0.75


def splitk_operands(block_m: int, block_n: int, M: int) -> str:
    """How the split-K kernel reads its operands on Hopper (options.gemm_splitk_operands "auto"):
    "tma" (both through descriptors), "b_tma" (B through its descriptor, A through masked
    pointer loads), "b_tma_last" (so in the last tile row, the others as "tma") or "pointer"
    (see SPLITK_A_BOX_MIN_FILL)."""
    if block_m <= 16:
        return "tma" if block_n >= 64 else "pointer"
    last = M % block_m
    ragged = 0 < last < SPLITK_A_BOX_MIN_FILL * block_m
    if block_m == 32 and block_n == 32:
        return "pointer" if ragged else "tma"
    if block_m == 32 and block_n == 64:
        return "b_tma"
    return "b_tma_last" if ragged else "tma"


@functools.lru_cache(maxsize=None)
def _machine_of_index(idx: int) -> Machine:
    props = torch.cuda.get_device_properties(idx)
    name = props.name.lower()
    for key, m in _KNOWN.items():
        if key in name:
            return replace(m, sms=props.multi_processor_count)
    return Machine(props.name, props.multi_processor_count, caps._smem_optin(idx), 2.0e12, 3.0e14, 6.0e12)


@dataclass(frozen=True)
class Schedule:
    """One way to run a GEMM: the kernel and its config, with the model's estimate."""

    kind: str  # "splitk", "tiled", "streamk" or "ws" (kernels/gemm_ws.py: block_n any of WS_TILE_NS)
    block_m: int
    block_n: int
    block_k: int
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3
    persistent: bool = False
    subtile: bool = False
    tail: bool = False   # split-K / WS: only the tiles past the last whole wave are split (split_k ways)
    est_s: float = float("nan")
    swap: bool = False   # "ws": the weight as the kernel's A, y stored transposed (block_m along N, block_n along M)

    def __post_init__(self):
        if self.tail and (self.kind not in ("splitk", "ws") or (self.kind == "ws" and self.split_k < 2)):
            raise ValueError(f"tail=True is a split-K or split WS schedule's (kind 'splitk', or 'ws' with split_k "
                             f">= 2), got kind {self.kind!r} split {self.split_k}")
        if self.swap and (self.kind != "ws" or self.split_k > 1):
            raise ValueError(f"swap=True is an unsplit WS schedule's (kind 'ws'), got {self.kind!r} split {self.split_k}")

    def describe(self) -> str:
        s = f"{self.kind} {self.block_m}x{self.block_n}x{self.block_k} w{self.num_warps} s{self.num_stages}"
        if self.split_k > 1:
            s += f" split{self.split_k}"
        if self.tail:
            s += " tail"
        if self.swap:
            s += " swap"
        if self.persistent:
            s += " persistent"
        return s

    @classmethod
    def parse(cls, text: str) -> "Schedule":
        """The schedule :meth:`describe` names, e.g. ``"streamk 128x256x64 w8 s4 persistent"`` or
        ``"splitk 128x128x64 w8 s6 split4 tail"``."""
        m = re.fullmatch(r"\s*(splitk|tiled|streamk|ws)\s+(\d+)x(\d+)x(\d+)\s+w(\d+)\s+s(\d+)"
                         r"(?:\s+split(\d+))?(\s+tail)?(\s+swap)?(\s+persistent)?\s*", str(text))
        if not m:
            raise ValueError(f"a schedule reads like 'streamk 128x256x64 w8 s4 persistent' "
                             f"(kind BMxBNxBK wWARPS sSTAGES [splitN] [tail] [swap] [persistent]), got {text!r}")
        kind, bm, bn, bk, w, st, split, tail, swap, pers = m.groups()
        # the name does not carry the epilogue: subtiled as the chooser's candidates have it (128 x 256)
        return cls(kind, int(bm), int(bn), int(bk), int(split or 1), int(w), int(st), bool(pers),
                   kind == "tiled" and int(bm) >= 128 and int(bn) >= 256, bool(tail), swap=bool(swap))

    def config(self) -> dict:
        """Keyword arguments of the kernel's launch."""
        cfg = dict(BLOCK_M=self.block_m, BLOCK_N=self.block_n, BLOCK_K=self.block_k, num_warps=self.num_warps,
                   num_stages=self.num_stages)
        if self.kind == "tiled":
            cfg.update(PERSISTENT=self.persistent, FLATTEN=self.persistent, WARP_SPECIALIZE=False,
                       EPILOGUE_SUBTILE=self.subtile)
        return cfg


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _stages(bm: int, bn: int, bk: int, elt: int, smem: int, want: int = 6) -> int:
    """The most pipeline stages (2..want) whose operand buffers fit in shared memory; 0 if even
    two stages do not fit."""
    from .kernels.gemm_splitk import shared_bytes

    for s in range(want, 1, -1):
        if shared_bytes(bm, bn, bk, s, elt) <= 0.95 * smem:
            return caps.cap_stages("gemm", s)
    return 0


def candidates(M: int, N: int, K: int, elt: int, machine: Machine, *, splitk_only: bool = False,
               tail: bool = False, ws: bool = False, ws_swap: bool = False, wide3: bool = False) -> list:
    out = _candidates(M, N, K, elt, machine, splitk_only=splitk_only, tail=tail, ws=ws, wide3=wide3)
    if ws and ws_swap and elt == 2 and M >= WS_SWAP_MIN_ROWS and K >= WS_FILL_MIN_K:
        out = out + _ws_swap_candidates(M, N, K, elt, machine)
    return out


# The WS kernel's transposed form (Schedule.swap, options.gemm_ws_swap): the weight as the kernel's
# A, the tokens as its N, y stored transposed (kernels/gemm_ws.py SWAP_C). A tile is WS_SWAP_ROWS
# weight rows (64 per consumer warpgroup; a box's rows are a power of two) by one of WS_TILE_NS
# tokens, so M is cut in widths of 16 where the plain form cuts it in 64 or 128 rows (271 tokens:
# three tiles of 96 instead of three of 128), as cuBLAS's ..._TNT kernels do. Weighed by the WS
# model with M and N exchanged, under rules from the H100 timings of bench/results/gemm-s43/ (116
# points: h100-swap-*, h100-fresh2-*): 128 weight rows (the 256-row tiles, four consumer
# warpgroups, ran 1.25-1.34x the model's time); from WS_SWAP_MIN_ROWS tokens and K >= WS_FILL_MIN_K
# (at 128 tokens it is the plain 128-row tile the chooser leaves out there; 229 x 4144 x 1256 lost
# 11.3 -> 13.1 us); tiles filling WS_SWAP_FILL of the SMs (190 x 1936 x 1912, 48 tiles: 13.8
# against 8.9); the last token tile WS_SWAP_LAST_MIN_FILL full (300 tokens in tiles of 128: 116.6
# against 79.5 us); and WS_SWAP_MARGIN ahead of the best plain estimate. Checked on 24 shapes it
# had not seen, where these rules change the pick (h100-check): 1.22x faster (geomean), 23 of 24
# by more than 3 %.
WS_SWAP_ROWS = (128,)
WS_SWAP_MIN_ROWS = 129
WS_SWAP_LAST_MIN_FILL = 0.85
WS_SWAP_FILL = 0.5
WS_SWAP_MARGIN = 0.95


def _ws_swap_candidates(M: int, N: int, K: int, elt: int, machine: Machine) -> list:
    """The transposed form's tiles weighed here: each width whose tiles fill WS_SWAP_FILL of the
    SMs and whose last tile along M holds at least
    WS_SWAP_LAST_MIN_FILL of its width in tokens."""
    from .gemm_ws import wide_config

    out = []
    for bm in WS_SWAP_ROWS:
        for n in WS_TILE_NS:
            cfg = wide_config(n, block_m=bm, swap=True)
            last = M - (_cdiv(M, n) - 1) * n
            if (cfg.smem_bytes(elt) <= machine.smem_bytes and _cdiv(N, bm) * _cdiv(M, n) >= WS_SWAP_FILL * machine.sms
                    and last >= WS_SWAP_LAST_MIN_FILL * n):
                out.append(Schedule("ws", bm, n, 64, 1, 4, cfg.stages, True, swap=True))
    return out


def _candidates(M: int, N: int, K: int, elt: int, machine: Machine, *, splitk_only: bool = False,
                tail: bool = False, ws: bool = False, wide3: bool = False) -> list:
    """The schedules the chooser weighs for this shape (estimates not filled in); ``tail``
    (options.gemm_tail_split): also the split-K schedules that split only the last wave's tiles
    (and with ``ws`` the WS tail form's, WS_TAIL_*);
    ``ws`` (the operands fit the warp-specialised kernel, options.gemm_ws): from WS_MIN_ROWS rows
    and WS_MIN_S of modelled time its widths instead of the Triton schedules; below, its widths
    (WS_FILL_MIN_ROWS), 64-row tiles (WS64_*) and split-K form (WS_SPLIT_*) beside them."""
    from .kernels import gemm_splitk as KS

    if ws and elt == 2 and (M >= WS_MIN_ROWS or (M >= WS_FILL_MIN_ROWS and K >= WS_FILL_MIN_K)):
        from .gemm_ws import wide_config

        wide = [Schedule("ws", 128, n, 64, 1, 4, wide_config(n).stages, True)
                for n in WS_TILE_NS + (WS_TILE_NS3 if wide3 else ())]
        t, best = min((_ws_estimate(s, M, N, K, elt, machine), i) for i, s in enumerate(wide))
        fills = _cdiv(M, 128) * _cdiv(N, wide[best].block_n) >= WS_FILL * machine.sms
        if t >= WS_MIN_S and M >= WS_MIN_ROWS:
            return (wide + _ws64_candidates(M, N, K, elt, machine)
                    + (_ws_tail_candidates(M, N, K, elt, machine) if tail else []))
        # under WS_MIN_ROWS (the fill rule) beside the Triton schedules: the 64-row tile groups
        # (row_group_share) ran faster than both at some 129-256-row shapes
        out = wide if t >= WS_MIN_S and fills else []
    else:
        out = []
    if ws:
        out = out + _ws64_candidates(M, N, K, elt, machine) + (_ws_tail_candidates(M, N, K, elt, machine) if tail else [])
    if ws and WS_SPLIT_MIN_ROWS <= M <= WS_SPLIT_MAX_ROWS and elt == 2:
        from .gemm_ws import split_config

        ks = _cdiv(K, 64)
        for n in WS_SPLIT_NS:
            tiles = _cdiv(M, 128) * _cdiv(N, n)
            for S in WS_SPLITS:
                if tiles * S <= machine.sms and S <= ks // 2:   # one unit per SM, two K steps a part
                    out.append(Schedule("ws", 128, n, 64, S, 4, split_config(n, S).stages, True))
    bms = sorted({bm for bm in KS.BLOCK_MS if bm >= min(M, 16) and (bm <= 2 * max(M, 16) or bm == 16)})
    for bm in bms:
        for bn in KS.BLOCK_NS:
            for bk in KS.BLOCK_KS:
                if bm * bk * elt > 64 * 1024 or bn * bk * elt > 64 * 1024:
                    continue
                warps = 4 if bm * bn <= 64 * 64 else 8
                stages = _stages(bm, bn, bk, elt, machine.smem_bytes)
                if stages < 2:
                    continue
                if bm >= 128 and (bn < 64 or stages < 3):
                    # 128-row tiles (TMA-fed, wgmma) with 32 columns or two stages ran 1.5-3x the
                    # model's time on the H200 (bench/results/gemm_inference-streamk-v1-*: e.g.
                    # 128x32x64 at 27 us against 18 modelled, 128x64x256 with 2 stages 19 vs 14)
                    continue
                max_split = max(1, K // (2 * bk))  # each split at least two K blocks
                for s in (1, 2, 3, 4, 6, 8, 12, 16):
                    if s > max_split:
                        break
                    out.append(Schedule("splitk", bm, bn, bk, s, warps, stages))
                    # tail: only where there is a whole wave and a remainder (else it is the plain one)
                    if tail and s > 1 and bm >= 64:
                        tailed = Schedule("splitk", bm, bn, bk, s, warps, stages, tail=True)
                        tiles = _cdiv(M, bm) * _cdiv(N, bn)
                        if 0 < tail_split(tailed, tiles, elt, machine)[0] < tiles:
                            out.append(tailed)
    if not splitk_only and elt <= 2 and not caps.is_hip():
        # the TMA tiles the autotuner used to pick for large problems (bench/results/gemm-h200-*),
        # persistent: one program per tile lost up to 1.4x at M = 512-2048 on the H200
        # (bench/results/gemm_inference-h200-*: every point where the model chose it)
        # (4 stages: timed faster than 3 at 20 of 44 medium-M points on the H200, never slower by
        # more than noise)
        out.append(Schedule("tiled", 128, 256, 64, 1, 8, 4, True, True))
        # smaller TMA tiles, so a medium M (128-1024) still gives every SM a tile. (Not 128 x
        # 128: the split-K kernel's unsplit 128 x 128 tiles, TMA-fed with 6 stages, which the
        # model prices the same, ran faster at 222 of 269 points timed side by side on the H200
        # and no more than 5 % slower at 258, median 1.07x, e.g. 256 x 6144 x 4096 23.8 against
        # 28.8 us; bench/results/gemm-s12/ and earlier gemm-* runs)
        out.append(Schedule("tiled", 64, 128, 64, 1, 4, 4, True, False))
        out.append(Schedule("tiled", 64, 256, 64, 1, 8, 4, True, False))
        # stream-K (kernels/gemm_streamk.py): whole waves of tiles, then the remainder's K
        # iterations in equal pieces, so a last wave that would be mostly empty is not paid whole.
        # Offered up to STREAMK_MAX_WAVES waves of tiles: beyond, the remainder is a small share of
        # the time and the tiled kernel's flattened loop and TMA-store epilogue are worth more
        for bm, bn in ((128, 256), (128, 128)):
            stages = _stages(bm, bn, 64, elt, machine.smem_bytes, want=4)
            if stages >= 2 and M >= STREAMK_MIN_ROWS and _cdiv(M, bm) * _cdiv(N, bn) <= STREAMK_MAX_WAVES * machine.sms:
                out.append(Schedule("streamk", bm, bn, 64, 1, 8, stages, True, False))
    return out


def ws_tail_fits(M: int, N: int, block_n: int, sms: int) -> bool:
    """Whether 128 x ``block_n`` tiles leave a part-empty last round after whole ones (WS tail form)."""
    from .gemm_ws import tail_columns

    return tail_columns(M, N, block_n, sms)[0] > 0


def _ws_tail_candidates(M: int, N: int, K: int, elt: int, machine: Machine) -> list:
    """The WS tail form's schedules weighed here (WS_TAIL_*; the operands fit the WS kernel)."""
    if not (elt == 2 and M >= WS_FILL_MIN_ROWS and K >= WS_TAIL_MIN_K):
        return []
    from .gemm_ws import tail_columns, wide_config

    out = []
    for n in WS_TAIL_NS:
        n0, tail_tiles = tail_columns(M, N, n, machine.sms)
        if n0:
            out += [Schedule("ws", 128, n, 64, S, 4, wide_config(n).stages, True, tail=True) for S in WS_TAIL_SPLITS
                    if tail_tiles * S <= machine.sms and S <= _cdiv(K, 64) // 2]
    return out


def _ws64_candidates(M: int, N: int, K: int, elt: int, machine: Machine) -> list:
    """The WS kernel's 64-row tiles weighed here (WS64_*; the operands fit the WS kernel)."""
    min_k = WS64_MIN_K_LINES if (K * elt) % 128 == 0 else WS64_MIN_K
    if not (elt == 2 and machine.ws64 and WS64_MIN_ROWS <= M <= WS64_MAX_ROWS and K >= min_k):
        return []
    from .gemm_ws import wide_config

    return [Schedule("ws", 64, n, 64, 1, 4, wide_config(n, block_m=64).stages, True) for n in WS64_TILE_NS
            if _cdiv(M, 64) * _cdiv(N, n) >= WS_FILL * machine.sms]


def ranked(M: int, N: int, K: int, elt: int, machine: Machine, *, splitk_only: bool = False, tail: bool = False,
           ws: bool = False, splitk_tma: bool = False, aligned: bool = True, ws_swap: bool = False,
           wide3: bool = False) -> list:
    """(estimate s, schedule) of every candidate (see :func:`candidates`), cheapest first (ties in
    candidate order): what ``tune-gemm`` and ``bench gemm_inference`` time after the pick."""
    cands = candidates(M, N, K, elt, machine, splitk_only=splitk_only, tail=tail, ws=ws, ws_swap=ws_swap,
                       wide3=wide3)
    scored = sorted((estimate(s, M, N, K, elt, machine, splitk_tma, aligned), i, s) for i, s in enumerate(cands))
    return [(t, s) for t, _, s in scored]


def estimate(s: Schedule, M: int, N: int, K: int, elt: int, machine: Machine, splitk_tma: bool = False,
             aligned: bool = True) -> float:
    """Modelled time of ``s`` in seconds (see the module doc)."""
    if s.kind == "ws" and s.tail:   # the data-parallel slab's launch, then the split slab's
        from .gemm_ws import tail_columns

        n0, _ = tail_columns(M, N, s.block_n, machine.sms)
        if not n0:   # no part-empty last round after whole ones: the form does not apply (gemm refuses it)
            return float("inf")
        whole = replace(s, split_k=1, tail=False)
        return (_ws_estimate(whole, M, n0, K, elt, machine)
                + _ws_estimate(replace(s, tail=False), M, N - n0, K, elt, machine))
    if s.kind == "ws":   # (swap: the weight's rows are the kernel's M, the tokens its N)
        return _ws_estimate(s, N, M, K, elt, machine) if s.swap else _ws_estimate(s, M, N, K, elt, machine)
    if (s.kind == "splitk" and s.block_m == 128 and M < 128
            and (s.split_k > 1 or s.block_n < 128)):   # (Machine.partial_row_cost)
        return machine.partial_row_cost * _estimate(s, M, N, K, elt, machine, splitk_tma, aligned)
    return _estimate(s, M, N, K, elt, machine, splitk_tma, aligned)


def _estimate(s: Schedule, M: int, N: int, K: int, elt: int, machine: Machine, splitk_tma: bool,
              aligned: bool) -> float:
    if s.tail:
        return _tail_estimate(s, M, N, K, elt, machine, splitk_tma, aligned)
    if s.kind == "splitk" and s.block_m <= WEIGHT_STREAM_MAX_ROWS and aligned:
        return _weight_stream_s(s, M, N, K, elt, machine, splitk_tma)
    tiles = _cdiv(M, s.block_m) * _cdiv(N, s.block_n)
    kps = _cdiv(_cdiv(K, s.split_k), s.block_k) * s.block_k
    units = tiles * s.split_k
    unit, slots = _unit_s(s, kps, units, elt, machine, splitk_tma, aligned,
                          row_group_share(s, M, K, units, elt, machine))
    waves = _cdiv(units, slots)
    if s.kind == "streamk":
        # whole waves, then the remainder's K iterations shared equally by every SM; each program
        # starts about two pieces and the split tiles' fp32 partials go through L2 and back
        dp_waves = units // slots
        rest = units - dp_waves * slots
        t = dp_waves * (unit + machine.unit_start_s) + machine.launch_s
        if rest:
            t += STREAMK_PIECE_COST * rest / slots * unit + 2 * machine.unit_start_s
            t += 2 * 2 * slots * s.block_m * s.block_n * 4 / machine.l2_bytes_per_s + machine.reduce_sync_s
        return max(t, _floor_s(M, N, K, elt, machine) + machine.launch_s)
    # a data-parallel grid, persistent or not, pays for its last wave whole: the SMs that run two
    # tiles set the time
    t = waves * (unit + machine.unit_start_s) + machine.launch_s + _splitk_merge_s(s, tiles, machine)
    t = max(t, _floor_s(M, N, K, elt, machine) + machine.launch_s)
    if (s.kind == "splitk" and machine.co_resident_split
            and WEIGHT_STREAM_MAX_ROWS < s.block_m <= CO_RESIDENT_MAX_ROWS
            and units > machine.sms and slots > machine.sms):   # (slots: SMs x programs an SM holds)
        t *= 1.0 + CO_RESIDENT_COST   # (see there)
    return t


def _splitk_merge_s(s: Schedule, tiles: int, machine: Machine) -> float:
    """A split-K schedule's merge: its fp32 partials written to L2 and read back, one sync."""
    if s.split_k <= 1:
        return 0.0
    return (machine.splitk_partial_cost * tiles * s.split_k * s.block_m * s.block_n * 4 * 2 / machine.l2_bytes_per_s
            + machine.reduce_sync_s)


def _weight_stream_s(s: Schedule, M: int, N: int, K: int, elt: int, machine: Machine, tma: bool = False) -> float:
    """A split-K schedule of at most WEIGHT_STREAM_MAX_ROWS-row tiles (see CO_RESIDENT_COST): the
    SMs' bytes shared out over HBM as they drain, one start, the co-residency cost, the merge
    (``tma``: the kernel may read through TMA descriptors, see WEIGHT_STREAM_TMA_LATENCY_S)."""
    tiles = _cdiv(M, s.block_m) * _cdiv(N, s.block_n)
    kps = _cdiv(_cdiv(K, s.split_k), s.block_k) * s.block_k
    units = tiles * s.split_k
    occ = _resident(s, elt, machine)
    n = machine.sms
    unit_bytes = (s.block_n + A_WEIGHT * s.block_m) * kps * elt
    sm_cap = machine.sm_bw_share * machine.hbm_bytes_per_s / n
    if units > n:   # SMs left to drain after a shared phase (measured there only)
        sm_cap = max(sm_cap, WEIGHT_STREAM_SM_BYTES_PER_S)
    if tma and splitk_operands(s.block_m, s.block_n, M) == "tma":
        in_flight = _tma_stream_depth(s, rate=True) * s.block_n * elt
        sm_cap = max(sm_cap, occ * in_flight / machine.stream_tma_latency_s)
    prog_cap = sm_cap / occ   # a program's rate
    q, r = divmod(units, n)   # round-robin: r SMs run q + 1 programs, the others q
    sms = []                  # [SMs, bytes left per SM, the SM's rate cap]
    for count, progs in ((r, q + 1), (n - r, q)):
        if count and progs:
            sms.append([count, progs * unit_bytes, progs * prog_cap / _cdiv(progs, occ)])
    t = _drain_s(sms, machine.hbm_bytes_per_s)
    if min(occ, q + (1 if r else 0)) > 1:   # two or more programs at once on an SM
        t *= 1.0 + CO_RESIDENT_COST
    t += machine.launch_s + machine.unit_start_s + _splitk_merge_s(s, tiles, machine)
    return max(t, _floor_s(M, N, K, elt, machine) + machine.launch_s)


def _drain_s(groups: list, bandwidth: float) -> float:
    """Seconds until groups of SMs (``[count, bytes left each, rate cap each]``) have read their
    bytes, sharing ``bandwidth``: each SM runs at min(its cap, a common level) with the level set
    so the SMs use the whole bandwidth (or every cap when that is less); a group that finishes
    leaves its share to the others."""
    groups = [list(g) + [g[1]] for g in groups if g[0] > 0 and g[1] > 0]   # + the bytes at the start
    t = 0.0
    while groups:
        caps = sorted({g[2] for g in groups})
        level = caps[-1]   # every SM at its cap, unless that needs more than the bandwidth
        if sum(g[0] * g[2] for g in groups) > bandwidth:   # the level where sum(count * min(cap, level)) == bandwidth
            used, left = 0.0, sum(g[0] for g in groups)
            for cap in caps:
                if used + left * cap >= bandwidth:
                    level = (bandwidth - used) / left
                    break
                took = sum(g[0] for g in groups if g[2] == cap)
                used += took * cap
                left -= took
        rates = [min(g[2], level) for g in groups]
        dt = min(g[1] / rate for g, rate in zip(groups, rates))
        t += dt
        for g, rate in zip(groups, rates):
            g[1] -= rate * dt
        groups = [g for g in groups if g[1] > 1e-9 * g[3]]
    return t


def _ws_estimate(s: Schedule, M: int, N: int, K: int, elt: int, machine: Machine) -> float:
    """The WS kernel's time (see WS_RATE): whole waves of tiles, each its K steps at the slowest
    of flops, HBM bytes and L2 bytes at its share of the machine."""
    W, bk = s.block_n, s.block_k
    nm, nn = _cdiv(M, s.block_m), _cdiv(N, W)
    tiles = nm * nn
    S = s.split_k
    active = min(tiles * S, machine.sms)
    b_box, a_box = W * bk * elt, s.block_m * bk * elt
    cols = W + WS_TWO_BOX_COLS * (bin(W).count("1") - 1)   # a box past the first: its wgmma's fixed cost
    flops = 2.0 * s.block_m * cols * bk / (WS_RATE * machine.tensor_flops / machine.sms)
    lines = 1.0 + ((WS64_MISALIGNED if s.block_m == 64 else WS_MISALIGNED) if (K * elt) % 128 else 0.0)
    hbm = lines * (b_box / min(nm, 8) + a_box / min(nn, 8)) / (WS_HBM * machine.hbm_bytes_per_s / active)
    if s.block_m == 64:   # an SM's own intake (WS64_SM_BYTES_PER_S)
        l2 = lines * (a_box + b_box) / WS64_SM_BYTES_PER_S
    else:
        l2 = lines * (a_box + b_box) / (WS_L2 * machine.l2_bytes_per_s / active)
    step = max(flops, hbm, l2)
    if S > 1:   # the split-K form: one wave of units of K / S steps, then the partials' merge
        rows = min(nm * s.block_m, _cdiv(M, s.block_m // 2) * (s.block_m // 2))   # half tiles below M store nothing
        partials = rows * nn * W * 4 * S
        return (_cdiv(tiles * S, machine.sms) * (_cdiv(_cdiv(K, bk), S) * step + WS_TILE_START_S) + machine.launch_s
                + partials / (WS_SPLIT_PARTIAL_L2 * machine.l2_bytes_per_s) + WS_SPLIT_SYNC_S)
    return _cdiv(tiles, machine.sms) * (_cdiv(K, bk) * step + WS_TILE_START_S) + machine.launch_s


def _floor_s(M: int, N: int, K: int, elt: int, machine: Machine) -> float:
    """The whole problem can go no faster than its bytes at full bandwidth and its flops at full rate."""
    return max(streaming_floor_s(M, N, K, elt, machine), 2.0 * M * N * K / machine.tensor_flops)


def row_pair_shares_w(s: Schedule, M: int, K: int, units: int, elt: int, machine: Machine) -> bool:
    """Whether the 64-row tiles of each tile column read W once from HBM between them (see
    row_group_share): unsplit split-K tiles of 64 rows at ROW_PAIR_MIN_ROWS-ROW_GROUP_MAX_ROWS
    rows (past 128 only where M is not a multiple of 128), every unit on its own SM in one wave,
    W's rows whole 32-byte sectors (and at most ROW_PAIR_PARTIAL_MAX_K_BYTES long under
    ROW_PAIR_FULL_ROWS rows and past 128)."""
    return (s.kind == "splitk" and s.block_m == 64 and s.split_k == 1 and not s.tail
            and ROW_PAIR_MIN_ROWS <= M <= ROW_GROUP_MAX_ROWS and (M <= 128 or M % 128)
            and units <= machine.sms and (K * elt) % 32 == 0
            and (ROW_PAIR_FULL_ROWS <= M <= 128 or K * elt <= ROW_PAIR_PARTIAL_MAX_K_BYTES))


def row_split_shares_w(s: Schedule, M: int, K: int, units: int, machine: Machine) -> bool:
    """Whether the two 128-row tiles of each tile column, split in K, read W once from HBM between
    them (ROW_SPLIT_SHARE_*): the second tile row at most half full, every unit on its own SM."""
    lo, hi = ROW_SPLIT_SHARE_ROWS
    return (s.kind == "splitk" and s.block_m == 128 and s.split_k > 1 and not s.tail and lo <= M <= hi
            and K >= ROW_SPLIT_SHARE_MIN_K and units <= machine.sms)


def ws_split_twin(s: Schedule, M: int, N: int, K: int, elt: int, machine: Machine) -> Optional[Schedule]:
    """The WS split-K form of the same tiles and parts as ``s`` where ROW_SPLIT_WS_TWIN takes it
    (``s`` a 128 x 128 Triton split-K schedule whose two tile rows share W, row_split_shares_w;
    16-bit), else None."""
    if not (ROW_SPLIT_WS_TWIN and elt == 2 and s.kind == "splitk" and s.block_m == 128 and s.block_n == 128):
        return None
    if not row_split_shares_w(s, M, K, _cdiv(M, 128) * _cdiv(N, 128) * s.split_k, machine):
        return None
    from .gemm_ws import split_config

    twin = Schedule("ws", 128, 128, 64, s.split_k, 4, split_config(128, s.split_k).stages, True)
    return replace(twin, est_s=_ws_estimate(twin, M, N, K, elt, machine))


def row_group_share(s: Schedule, M: int, K: int, units: int, elt: int, machine: Machine) -> int:
    """How many tiles of a tile column read each W tile between them, once from HBM: the 64-row
    tiles of a column where row_pair_shares_w (two to four), the two split 128-row ones where
    row_split_shares_w, else 1."""
    if row_pair_shares_w(s, M, K, units, elt, machine):
        return _cdiv(M, 64)
    return 2 if row_split_shares_w(s, M, K, units, machine) else 1


def _unit_s(s: Schedule, kps: int, units: int, elt: int, machine: Machine, splitk_tma: bool, aligned: bool,
            w_share: int = 1):
    """(seconds of one work unit of ``kps`` K columns when ``units`` of them run, the grid's
    slots): the slower of its bytes at its share of the bandwidth and its flops at its share of
    the tensor rate; ``w_share`` units read each W tile from HBM between them (the rest from L2)."""
    occ = _resident(s, elt, machine)
    slots = machine.sms * occ
    if s.kind == "tiled" and s.persistent:
        slots = machine.sms
    active = min(units, slots)
    fair = machine.hbm_bytes_per_s / active
    share = machine.sm_bw_share if aligned else MISALIGNED_SM_BW_SHARE
    bw = min(fair, share * machine.hbm_bytes_per_s / machine.sms / occ)
    t_mem = (s.block_n * kps * elt / w_share + A_WEIGHT * s.block_m * kps * elt) / bw
    if w_share > 2:   # a group of three or four: each SM still takes its A and W tiles in from L2
        t_mem = max(t_mem, (s.block_m + s.block_n) * kps * elt / ROW_GROUP_SM_BYTES_PER_S)
    rate = machine.tensor_flops / min(active, machine.sms) / (occ if active >= machine.sms else 1)
    if s.kind == "splitk" and s.block_m >= 64 and not splitk_tma:
        rate *= SPLITK_MMA_EFFICIENCY  # operands through registers, not TMA + wgmma from shared memory
    return max(t_mem, 2.0 * s.block_m * s.block_n * kps / rate), slots


def tail_split(s: Schedule, tiles: int, elt: int, machine: Machine, slots: Optional[int] = None) -> Tuple[int, int]:
    """(whole tiles, grid size) of a tail schedule: the tiles of the whole waves run whole, the
    remaining ones in ``s.split_k`` parts. ``slots``: programs resident at once (default: the
    SMs times the programs of ``s`` one SM holds)."""
    if slots is None:
        slots = machine.sms * _resident(s, elt, machine)
    whole = (tiles // max(1, slots)) * max(1, slots)
    return whole, whole + (tiles - whole) * s.split_k


def _tail_estimate(s: Schedule, M: int, N: int, K: int, elt: int, machine: Machine, splitk_tma: bool,
                   aligned: bool) -> float:
    """A tail schedule: the whole waves as the unsplit kernel runs them, then one (or a few)
    waves of the remainder's parts, plus their partials through L2."""
    tiles = _cdiv(M, s.block_m) * _cdiv(N, s.block_n)
    whole, _ = tail_split(s, tiles, elt, machine)
    plain = replace(s, split_k=1, tail=False)
    t = machine.launch_s
    if whole:
        unit, slots = _unit_s(plain, _cdiv(K, s.block_k) * s.block_k, whole, elt, machine, splitk_tma, aligned)
        t += (whole // slots) * (unit + machine.unit_start_s)
    rest = tiles - whole
    if rest:
        kps = _cdiv(_cdiv(K, s.split_k), s.block_k) * s.block_k
        units = rest * s.split_k
        unit, slots = _unit_s(s, kps, units, elt, machine, splitk_tma, aligned)
        t += _cdiv(units, slots) * (unit + machine.unit_start_s)
        if s.split_k > 1:
            t += (machine.splitk_partial_cost * units * s.block_m * s.block_n * 4 * 2 / machine.l2_bytes_per_s
                  + machine.reduce_sync_s)
    return max(t, _floor_s(M, N, K, elt, machine) + machine.launch_s)


def choose(M: int, N: int, K: int, dtype: torch.dtype, device: Optional[torch.device] = None, *,
           table: Optional[str] = None, splitk_only: bool = False, splitk_tma: bool = False,
           aligned: bool = True, tail: bool = False, ws: bool = False, ws_swap: bool = False) -> Schedule:
    """The schedule for this GEMM: a tuned table's entry if it has one, else the model's pick
    (``tail``: tail split-K schedules among the candidates, options.gemm_tail_split; ``ws``: the
    operands fit the warp-specialised kernel, ``ws_swap``: its transposed form too, see
    candidates)."""
    elt = torch.empty((), dtype=dtype).element_size()
    machine = Machine.of(device)
    if table is not None:
        hit = load_table(table).get(_table_key(M, N, K, dtype, machine.name))
        if hit is not None:
            return Schedule(**hit)
    return _choose(M, N, K, elt, machine, splitk_only, splitk_tma, aligned, tail, ws, ws_swap)


@functools.lru_cache(maxsize=4096)
def _choose(M: int, N: int, K: int, elt: int, machine: Machine, splitk_only: bool, splitk_tma: bool = False,
            aligned: bool = True, tail: bool = False, ws: bool = False, ws_swap: bool = False) -> Schedule:
    scored = []
    for s in candidates(M, N, K, elt, machine, splitk_only=splitk_only or elt > 2, tail=tail, ws=ws,
                        ws_swap=ws_swap):
        if not aligned and s.block_k > MISALIGNED_MAX_BLOCK_K:
            continue
        scored.append((s, estimate(s, M, N, K, elt, machine, splitk_tma, aligned)))
    best = pick(scored, M, elt, machine, splitk_tma)
    if ws and best is not None and aligned:   # (the operands fit the WS kernel)
        return ws_split_twin(best, M, N, K, elt, machine) or best
    return best


def pick(scored: list, M: int, elt: int, machine: Machine, splitk_tma: bool = False) -> Optional[Schedule]:
    """The chooser's pick among ``scored`` ((schedule, estimate s) in candidate order): the lowest
    estimate (the WS split-K form's with WS_SPLIT_MARGIN), then the ties' rule below; None if
    there is none. (scripts/gemm_rank_eval.py --chooser applies it to the timed schedules.)"""
    best, best_t = None, float("inf")
    for s, est in scored:
        t = (est / (WS_TAIL_MARGIN if s.tail else WS_SPLIT_MARGIN) if s.kind == "ws" and s.split_k > 1
             else est)   # (the schedule keeps its own estimate)
        t = t / WS_SWAP_MARGIN if s.swap else t
        if t < best_t * 0.999:
            best, best_t = replace(s, est_s=est), t
    if best is None:
        return best
    if best.kind == "ws" and best.tail:   # the WS tail form: the most K parts priced within WS_TAIL_TIE
        for s, t in scored:
            if (s.kind == "ws" and s.tail and s.block_n == best.block_n and s.split_k > best.split_k
                    and t <= best.est_s * WS_TAIL_TIE):
                best = replace(s, est_s=t)
        return best
    # the model prices bytes and flops, not the pipeline: among the pick's ties (the same kernel,
    # tile and split with another K block and stage count, estimated within 0.1 %) the deeper
    # pipeline wins (see inflight_bytes); 16-row tiles through TMA: the most B bytes in flight as
    # their model counts them (_tma_stream_depth); other tiles under TIE_MIN_BLOCK_M rows: the first
    if best.block_m >= TIE_MIN_BLOCK_M:
        def depth(x):
            return inflight_bytes(x, elt, machine)
    elif splitk_tma and best.kind == "splitk" and splitk_operands(best.block_m, best.block_n, M) == "tma":
        depth = _tma_stream_depth
    else:
        return best
    shape = (best.kind, best.block_m, best.block_n, best.split_k, best.tail)
    for s, t in scored:
        if ((s.kind, s.block_m, s.block_n, s.split_k, s.tail) == shape and t <= best.est_s * 1.001
                and depth(s) > depth(best)):
            best = replace(s, est_s=t)
    return best


def _tma_stream_depth(s: Schedule, rate: bool = False) -> float:
    """Elements of B a TMA-fed 16-row program has in flight per column as the weight-stream model
    counts them: the stages but one, K blocks up to WEIGHT_STREAM_TMA_MAX_BLOCK_K long (the ties'
    rule); ``rate``: as its rate cap counts them, the K past that at WEIGHT_STREAM_TMA_LONG_K."""
    long_k = max(0, s.block_k - WEIGHT_STREAM_TMA_MAX_BLOCK_K) * (WEIGHT_STREAM_TMA_LONG_K if rate else 0.0)
    return max(1, s.num_stages - 1) * (min(s.block_k, WEIGHT_STREAM_TMA_MAX_BLOCK_K) + long_k)


def inflight_bytes(s: Schedule, elt: int, machine: Machine) -> int:
    """Operand bytes an SM has in flight: the loads of ``stages - 1`` K blocks ahead, times the
    programs resident on the SM (split-K only; the TMA tiles are persistent, one per SM)."""
    occ = _resident(s, elt, machine) if s.kind == "splitk" else 1
    return occ * max(1, s.num_stages - 1) * (s.block_m + s.block_n) * s.block_k * elt


def _resident(s: Schedule, elt: int, machine: Machine) -> int:
    """Programs of ``s`` one SM holds at once (shared memory, warps; at most 4)."""
    from .kernels.gemm_splitk import shared_bytes

    smem = shared_bytes(s.block_m, s.block_n, s.block_k, s.num_stages, elt)
    return max(1, min(machine.smem_bytes // max(smem, 1), machine.warps_per_sm // (2 * s.num_warps), 4))


def _table_key(M: int, N: int, K: int, dtype: torch.dtype, machine: str) -> str:
    return f"{machine}:{str(dtype).replace('torch.', '')}:{M}x{N}x{K}"


@functools.lru_cache(maxsize=16)
def load_table(path: str) -> dict:
    """A tuned table written by ``numasched tune-gemm``: key -> Schedule fields."""
    with open(path) as f:
        data = json.load(f)
    if not isinstance(data, dict) or "schedules" not in data:
        raise ValueError(f"{path} is not a numasched GEMM table (no 'schedules')")
    return data["schedules"]


def table_entry(M: int, N: int, K: int, dtype: torch.dtype, machine: str, s: Schedule) -> tuple:
    """(key, value) of a tuned table."""
    d = {k: getattr(s, k) for k in ("kind", "block_m", "block_n", "block_k", "split_k", "num_warps", "num_stages",
                                    "persistent", "subtile", "tail", "est_s", "swap")}
    return _table_key(M, N, K, dtype, machine), d


def streaming_floor_s(M: int, N: int, K: int, elt: int, machine: Machine) -> float:
    """Time to read A and B and write C once at the machine's streaming rate."""
    return (M * K + K * N + M * N) * elt / machine.hbm_bytes_per_s
