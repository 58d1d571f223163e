"""Process-wide options that plans depend on, as one frozen dataclass.

    >>> numasched.options.current().autotune
    >>> numasched.options.set(autotune=False)            # from now on
    >>> with numasched.options.use(check_data=False):    # for a block
    ...     numasched.flash_decode(...)

Plans are cached with the :class:`Options` value in their key, so changing an option never
reuses a plan made under another value. Environment variables give the defaults, read once when
numasched is imported (they are not read per call):

    NUMASCHED_AUTOTUNE=0        autotune -> False
    NUMASCHED_CHECK_DATA=0      check_data -> False
    NUMASCHED_DECODE_COMBINE    decode_combine ("auto", "fused" or "kernel")
    NUMASCHED_GEMM_FLATTEN=0    gemm_flatten -> False
    NUMASCHED_DIST_TMA=0/1      dist_tma -> False / True
    NUMASCHED_GEMM_SCHEDULE     gemm_schedule ("model" or "autotune")
    NUMASCHED_DECODE_SCHEDULE   decode_schedule ("model" or "autotune")
    NUMASCHED_DECODE_CONFIG=BxWxS decode_config -> "BxWxS" (every decode kernel's tile, warps, stages)
    NUMASCHED_DECODE_SPLITS=N   decode_splits -> N (every decode plan's split count; unset: the rule)
    NUMASCHED_GEMM_TABLE        gemm_table (a path)
    NUMASCHED_GEMM_SPLITK_TMA=0 gemm_splitk_tma -> False
    NUMASCHED_GEMM_STREAMK_K_ALIGNED=0 gemm_streamk_k_aligned -> False
    NUMASCHED_GEMM_TAIL_SPLIT=0 gemm_tail_split -> False
    NUMASCHED_GEMM_WS=0         gemm_ws -> False
    NUMASCHED_PDL=0             pdl -> False
    NUMASCHED_PDL_TRIGGER       pdl_trigger ("early", "late" or "none"; 1 / 0 mean early / none)
    NUMASCHED_PDL_PREFETCH=1    pdl_prefetch -> True
    NUMASCHED_DECODE_PREFETCH=N decode_prefetch -> N (0: off)
    NUMASCHED_WEIGHT_FIRST_EARLY=N weight_first_early -> N (unset: every ring stage)
    NUMASCHED_DECODE_PREFETCH_WIDE=1 decode_prefetch_wide -> True
    NUMASCHED_WEIGHT_FIRST_ROW_PARALLEL=0 weight_first_row_parallel -> False
    NUMASCHED_WEIGHT_FIRST_PUSH=0 weight_first_push -> False
    NUMASCHED_WEIGHT_FIRST_PUSH_MIN_K=N weight_first_push_min_k -> N
    NUMASCHED_WEIGHT_FIRST_REDUCE=0/1 weight_first_reduce -> False / True
    NUMASCHED_WEIGHT_FIRST_ROW_SPLITS=N weight_first_row_splits -> N (0: the config's)
    NUMASCHED_WEIGHT_FIRST_ROW_SPLITS_MAX_K=N weight_first_row_splits_max_k -> N (0: every K)
    NUMASCHED_PAGED_KV_HEAD_MAJOR=0/1 paged_kv_head_major -> False / True
    NUMASCHED_DECODE_TMA=0/1    decode_tma -> False / True
    NUMASCHED_ARN_LL=0/1        arn_exchange -> "flag" / "ll"
    NUMASCHED_ARN_ONE_ROW=0     arn_one_row -> False
    NUMASCHED_FUSED_AR_STAGES=N fused_ar_stages -> N (pipeline stages; unset: the config's)
    NUMASCHED_FUSED_FLAT=0|1 fused_flat -> False / True (unset: the config's)
    NUMASCHED_FUSED_TMA_PUSH=0|1 fused_tma_push -> False / True (unset: the config's)
    NUMASCHED_GLU_PERSISTENT=0|1 glu_persistent -> False / True (unset: numasched.gemm_glu's default)
    NUMASCHED_GLU_WS=0|1        glu_ws -> False / True (unset: numasched.gemm_glu's default)
    NUMASCHED_GLU_FUSED=0|1     glu_fused -> False / True (unset: gemm_glu.glu_fused_pays)
    NUMASCHED_FUSED_WS=0|1      fused_ws -> False / True (unset: the config's)
    NUMASCHED_FUSED_RS_EARLY=0   fused_rs_early -> False
    NUMASCHED_FUSED_RS_PAIRS=0|1 fused_rs_pairs -> False / True (unset: distributed.cost.rs_ws_pairs)
    NUMASCHED_FUSED_WS_GROUP=N  fused_ws_group -> N (tile rows a group, 0: row by row; unset: distributed._ws.group_of)
    NUMASCHED_GEMM_ALIGN_A=0|1  gemm_align_a -> False / True (unset: where gemm_schedule.align_a_pays)
    NUMASCHED_GEMM_PAD_K=0|1    gemm_pad_k -> False / True (unset: where gemm_schedule.pad_k_pays)
    NUMASCHED_GEMM_SPLITK_OPERANDS gemm_splitk_operands ("auto", "tma", "b_tma", "b_tma_last", "pointer")
    NUMASCHED_GEMM_WS_LAST_BOX=0 gemm_ws_last_box -> False
    NUMASCHED_GEMM_WS_DEAD_HALF=0 gemm_ws_dead_half -> False
    NUMASCHED_GEMM_WS_SWAP=0    gemm_ws_swap -> False
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Optional

__all__ = ["Options", "current", "set", "use", "from_env"]

COMBINE_MODES = ("auto", "fused", "kernel")
SCHEDULE_MODES = ("model", "autotune")  # gemm_schedule, decode_schedule
TRIGGER_MODES = ("early", "late", "none")  # numasched.kernels.pdl.TRIGGER_MODES (not imported: no triton here)
ARN_EXCHANGES = ("auto", "flag", "ll")
SPLITK_OPERANDS = ("auto", "tma", "b_tma", "b_tma_last", "pointer")  # gemm_splitk_operands


@dataclass(frozen=True)
class Options:
    """What a plan may depend on besides its call's arguments.

    Attributes:
        autotune: on a GPU, tune kernel configs on the first call of a new shape class (prefill
            attention; decode and GEMM only with ``decode_schedule`` / ``gemm_schedule=
            "autotune"``; False: the fixed configs, no tuning; the interpreter never tunes).
        check_data: flash_decode reads ``cache_seqlens`` and ``block_table`` to range-check them
            (one device sync per call, skipped inside CUDA-graph capture). With False, an
            out-of-range page index is clamped by the kernel to the last page (wrong output for
            that sequence, never an out-of-bounds read); see docs/api.md.
        decode_combine: how flash_decode merges split partials: "auto" (fused up to 16 rows and
            numasched.decode.FUSED_MAX_SPLITS splits, else the kernel), "fused" (the last split
            to finish merges, one launch) or "kernel" (a second launch).
        gemm_flatten: fuse the persistent GEMM's tile and K loops (the pipeliner then prefetches
            the next tile during an epilogue).
        dist_tma: TMA descriptors in the fused distributed GEMMs; None: on Hopper+ NVIDIA GPUs.
        gemm_schedule: "model" (numasched.gemm_schedule picks kernel, tiles and split-K from a
            model of the GPU: no tuning at run time) or "autotune" (Triton's autotuner over the
            tiled kernel's configs, on the first call of each shape).
        decode_schedule: "model" (the kernel config from the programs and tokens per split,
            numasched.kernels.flash_decode.fixed_config: no tuning at run time) or "autotune"
            (Triton's autotuner over the layout's configs, on the first call of each
            tokens-per-split class; with ``autotune`` on). The model is the default since
            2026-11-23: on shapes off the issue grid (H200, batch 3-96 x 768-12000 tokens) the
            autotuner, tuned on the first shape of a class, ran 0.78-0.97x of what the model ran.
        decode_config: "BLOCK_NxWARPSxSTAGES" (e.g. "128x4x4"): every flash_decode plan made
            while it is set takes that kernel config instead of the model's pick, e.g. a TP
            decoder's attention in an e2e A/B (``NUMASCHED_DECODE_CONFIG``). None (default): the
            model (or the autotuner).
        decode_splits: every flash_decode plan made without ``num_splits`` while it is set takes
            this many splits per (batch, KV head) instead of the split rule's
            (numasched.decode.choose_num_splits), e.g. a TP decoder's attention in an e2e A/B
            (``NUMASCHED_DECODE_SPLITS``). None (default): the rule.
        gemm_table: a table of tuned schedules (``numasched tune-gemm``) the chooser consults
            first; None: the model alone.
        gemm_splitk_tma: the split-K GEMM reads its operands through TMA descriptors where they
            allow it (Hopper), so its tiles run at the tensor rate of the tiled kernel, and the
            chooser models them so (which operands, by tile: ``gemm_splitk_operands``). On by
            default: on the H200 it took M = 128-256 from 0.51-0.84x to 0.74-1.04x cuBLAS
            (bench/results/gemm_inference-h200-2026-11-23*).
        gemm_streamk_k_aligned: a stream-K piece that runs into the next tile computes that
            tile's head (K from 0) before the tail of the tile it starts in, so that all programs
            read nearby K columns at once (kernels/gemm_streamk.py). On by default: timed on an
            H200 at 16 medium-M points (bench/results/gemm-s12/gap/) it ran 0.64-1.08x the
            tail-first order's time (1024 x 2560 x 8192: 73 against 100 us; 320 x 8192 x 7168:
            82 against 118) and read 0.29x its DRAM bytes (Nsight Compute, 1024 x 2560 x 8192).
        gemm_tail_split: the chooser also weighs split-K schedules that split only the tiles past
            the last whole wave (``Schedule.tail``, kernels/gemm_splitk.py), the wave
            quantisation the medium-M GEMMs lose to (bench/results/README.md, twelfth session).
            On by default: timed on an H200 at the grid's 44 points of M = 128-1024
            (bench/results/gemm-s14-tail/) the chooser's pick went from cuBLAS / ours 0.883 to
            0.901 (geomean; 512 x 14336 x 8192: 242 -> 185 us, 512 x 5120 x 12800: 140 -> 107).
            With ``gemm_ws`` also the warp-specialised GEMM's tail form (gemm_ws.WsTailPlan:
            whole rounds data-parallel, the last round's tiles split in K; 1.05x over the pick
            without it at 16 random shapes on an H100, bench/results/gemm-s45/).
        gemm_ws: the chooser also weighs the warp-specialised Gluon GEMM (kernels/gemm_ws.py) on
            Hopper, with tiles of 80-256 columns (two power-of-two boxes), for bf16/fp16 (bias and
            residual added in its epilogue, the output in a's dtype): from gemm_schedule.WS_MIN_ROWS rows (and WS_MIN_S of modelled time)
            it takes those, the width by the model. On by default: on an H100 the issue's grid went
            from cuBLAS / ours 0.978 to 0.992 (geomean; 512 rows 0.852 -> 0.936, 1024 0.914 ->
            0.956, 4096 0.956 -> 0.999; bench/results/gemm-ws-s30/grid-ws-off, grid-ws-on2).
        pdl: launch numasched's kernels with programmatic dependent launch on NVIDIA sm_90+ (each
            kernel's launch and start overlap the kernel before it in the stream; the kernel
            waits for it before touching memory: kernels/pdl.py). Off elsewhere.
        pdl_trigger: with ``pdl``, when a kernel lets the next one launch (kernels/pdl.py): "early"
            (as soon as all its programs have started), "late" (GEMMs once their K loops are
            done, other kernels early) or "none" (when it completes; the launch is still
            prepared early). True and False mean "early" and "none". Default "late": on an H200,
            decode-size GEMMs back to back (M = 1-256, 44 shapes) ran at 1.006 / 0.939 / 0.999
            of cuBLAS (geomean) with late / early / none, and the Llama-3-8B decode step was the
            same with late and early (bench/results/README.md, eighth session).
        pdl_prefetch: with ``pdl``, the decode-size split-K GEMM (pointer path, a weight's W.T
            view; also matmul_swiglu) asks its weights into L2 before it waits for the previous
            kernel: one bulk prefetch (``cp.async.bulk.prefetch.L2``) per K run of each column,
            from the first programs, within half the L2 (kernels/pdl.py). Off: on two H100s
            (Llama-3-8B, TP 2, decode grid; bench/results/tp2-s18/prefetch-*) it made every step
            0.45-0.56 ms slower (1 x 2k 4.17 against 3.61 ms, 16 x 32k 15.50 against 15.03), as
            the earlier per-line prefetch did on an H200 (eighth session: 1.05-1.34x slower).
        decode_prefetch: with ``pdl``, the programs of a flash_decode called with
            ``prefetch=True`` (numasched's decoder does; one query token per sequence, batches of
            ``numasched.decode.PREFETCH_MIN_BATCH`` = 16 and more) ask the first
            this-many tokens of their K/V chunk into L2 before they wait for the previous kernel
            (kernels/flash_decode.py, step 4): in a decode step that kernel is the small RoPE +
            cache write, which leaves the memory bus idle. 0: off. Default 128: on two H100s
            (Llama-3-8B, TP 2, bench/results/tp2-s20d/) it made the batch-16 steps 25-67 us
            faster (16 x 8k 6.538 against 6.581 ms; 16 x 32k 14.820 against 14.887); at batch 1
            it cost 11-33 us and at batch 4 between 4 us faster and 9 slower, hence the batch
            floor. Only where the grid has no more programs than SMs and each split is at least
            eight times the prefetch (numasched.decode.PREFETCH_CHUNK_RATIO): back to back it cost
            up to 4.6 % with several programs per SM and 4-9 % on splits of 512 tokens
            (bench/results/decode-s21-tma/, decode-s21-prefetch/), and after the bench's read
            flush 1.1-1.6 us at 128 programs on an H200 (decode-s53/pf/): hence only on request.
            The count is rounded up to a power of two and to one token per thread.
        decode_prefetch_wide: the decode prefetch (``decode_prefetch``) also where the grid has up to
            two programs an SM (numasched.decode.PAGED_PROGRAMS_PER_SM), and the split rule's
            two-an-SM fill for the decoder's calls (64 paged pairs on an H200: four splits, 1-2 %
            faster alone, 3 % slower in the TP 2 step without the prefetch; bench/results/README.md,
            fifty-fifth session). Off: with it two H200s ran the TP 2 step at 16 x 32k in 11.13 ms
            against 10.69 (fifty-sixth session); an A/B knob.
        weight_first_early: the weight-first GEMM's ring stages (numasched.gemm_weight_first) whose
            weight boxes numasched's decoder issues before the PDL wait; None (default): all of
            them. Fewer leave more of the memory bus to the all-reduce + norm before the GEMM,
            whose owned time rose 0.51 -> 0.65 ms a step under the full stream on two H200s (TP 2,
            16 x 32k; bench/results/README.md, fifty-fifth session). Timed in the fifty-sixth
            session: 2 stages against all within 0.4 % at every point (the norm's time went back
            to the GEMMs), so the default stays.
        weight_first_row_parallel: numasched's decoder (where its ``weight_first`` is on) also runs
            the row-parallel projections of a decode step (o_proj, down_proj: the GEMM before the
            fused all-reduce + add + norm) by the weight-first GEMM, behind the attention and the
            gate/up GEMM; off: numasched's split-K GEMM there. On by default: two H200s ran the
            TP 2 Llama-3-8B decode step 0.1-3.6 % faster with it at every point of two A/B runs
            (batch 1, 4, 16 x 2k, 32k; bench/results/README.md, fifty-sixth session).
        weight_first_push: with ``weight_first_row_parallel``, that GEMM's epilogue also pushes
            each 64-column band of its output to the peers, counted, and the all-reduce + add +
            norm after it runs pushed (``all_reduce_add_rmsnorm(pushed=...)``: it sends nothing,
            it waits for the counts): the exchange starts band by band under the GEMM instead of
            after it. On by default: on two H200s the TP 2 Llama-3-8B decode step took 1.5-7.0 %
            less time with it at every point (batch 1, 4, 16 x 2k, 32k), the norm kernel's owned
            time about half (bench/results/README.md, fifty-seventh session).
        weight_first_push_min_k: the push (``weight_first_push``) only for row-parallel GEMMs of
            at least this many columns of K a rank (0, default: every one). An A/B knob: in the
            TP 2 Llama-3-8B step the push added 0.12-0.13 ms a step of owned time to o_proj's
            GEMM (K 2048 a rank) and 0.02 to down_proj's (K 7168; fifty-seventh session's
            timelines), while both norm kernels after them waited less; 4096 pushes down_proj's
            only.
        weight_first_reduce: with ``weight_first_push``, in a decode step of a model whose norm
            weights are folded into its projections (``TPDecoder.fold_norms``), the row-parallel
            GEMM finishes the all-reduce and the residual add itself and no norm kernel follows:
            each band's last program pushes the band, waits for the peers' copies of the same
            band, sums them in rank order, adds the residual in place and stores the band's sum
            of squares a row; the next projection's weight-first GEMM (QKV, gate/up) reads the
            residual stream as its x and scales its rows by 1 / rms from those sums
            (``numasched.distributed.reduce_target``). Not for the last layer's (the final norm
            keeps its weight). Off: on two H200s the TP 2 Llama-3-8B step took 0.1-0.5 % less
            time at batch 16 and 0.6-1.1 % more at batch 1 (bench/results/README.md, sixtieth
            session): the norm kernel's time moved into the GEMMs' wait for the peer's band.
        weight_first_row_splits: the K parts of the row-parallel projections' weight-first GEMM
            (o_proj, down_proj) of at most ``weight_first_row_splits_max_k`` columns of K a rank
            (0: every K); 0 leaves the GEMM's config (as many parts as fill the SMs once). The
            default, one part up to K 2048 (o_proj at TP 2 of Llama-3-8B, TP 4 of Llama-3-70B),
            takes the split-K ticket and the partials' round trip off the band's way to its push
            and leaves half the SMs to the kernels after it (launched early, PDL); a long K keeps
            its parts, as its programs' read rate matters more. On two H200s, TP 2 Llama-3-8B
            step: 0.1-1.3 % less time at batch 4, 8, 16 and 1 x 32k, 0.3-0.4 % more at 1 x 2k; one
            part for down_proj too (K 7168) was slower at every point, 6.6 % at 1 x 2k
            (bench/results/README.md, sixtieth session).
        paged_kv_head_major: numasched's decoder (numasched.models) keeps each page of its paged
            KV cache head-major, (kv_heads, page_size, head_dim) a page (FlashInfer's HND), and
            hands ``flash_decode`` the (num_pages, page_size, kv_heads, head_dim) view of it. A
            program then reads a page of its KV head as one run of page_size x head_dim elements
            (4 KB at 16 x 128 bf16) instead of page_size runs of one row (vLLM's NHD). Off: on
            H200s it changed nothing measurable. Standalone (scripts/paged_layout_probe.py, 14
            points of 0.07-2.15 GB, pages of 16 and 64) HND took 0.991-1.013x NHD's time, as
            FlashInfer's two layouts did; the TP 2 Llama-3-8B step at batch 16 took 3.180 / 10.215
            ms with it and 3.162 / 10.219 without at 2k / 32k (bench/results/README.md,
            fifty-eighth session). The 3 % by which a contiguous head-major cache read faster
            than pages of 16 (240.9 against 249.4 us, fifty-fifth session) is not the page layout.
        decode_tma: flash_decode loads the whole K/V tiles of a contiguous cache by TMA (bulk
            tensor copies into shared memory; NVIDIA sm_90+, 16-byte aligned rows, the model's or
            a given kernel config) instead of per-thread async copies; the last, partial tile of a
            split keeps the masked loads (kernels/flash_decode.py, ``_attend``). Off: on an H100
            (issue-12 grid, batch 1-128 x 512-128k, bench/results/decode-s21-tma/) it ran 0.990x
            the pointer loads (geomean), 0.95-0.97x on short contexts, equal from 32k tokens.
        arn_one_row: the distributed all-reduce + add + RMSNorm gives each program one row where
            the rows fit one wave (decode) and loads its own part, the residual and the weight
            before it waits for the peers (kernels/dist_allreduce.py). On by default: on two
            H100s it made the Llama-3-8B TP 2 decode step 19-44 us faster at all 9 grid points
            (bench/results/tp2-s19e/). False: the row loop of larger M at every size.
        arn_exchange: how that kernel's row-per-program path takes the peers' rows: "flag" (the
            rows, a fence, then a flag per program), "ll" (tagged 8-byte words: no fence and no
            flag, twice the bytes over the link; NVIDIA, rows of up to 8192 elements) or "auto"
            (LL up to ``numasched.distributed.all_reduce_add_rmsnorm.LL_AUTO_BYTES`` = 48 KB of
            rows per rank and rows of up to ``LL_AUTO_MAX_N`` = 4096 elements, the flag
            otherwise). Timed on two H100s (bench/results/tp2-s20/): 4096 columns, bf16, LL 6.82 /
            8.15 / 9.68 / 19.6 us against the flag's 7.05 / 8.38 / 8.90 / 10.4 at 1 / 4 / 16 / 64
            rows; the Llama-3-8B decode step 20-35 us faster at batch 1 and 4, 63-72 us slower at
            16. At 5120 columns LL was slower at every row count (tp2-s20b/, tp2-s20c/).
        fused_ar_stages: the pipeline stages (TMA loads in flight per K loop) of the fused GEMM +
            all-reduce's 128 x 256 tiles (numasched.distributed.matmul_all_reduce.FUSED_BIG_TILE);
            None: that config's. For measuring one against the other in a whole model (bench e2e
            reads the environment): 2-4 fit the shared memory of an H100 / H200.
        fused_flat: the fused GEMM + all-reduce's tile pairs (two ranks, TMA) and the fused GEMM +
            reduce-scatter's tiles (TMA) as one loop over (tile, K step), pipelined across tiles
            (True), or a K loop per tile (False); None: the configs' (FLAT: on). For A/Bs.
        fused_tma_push: the fused GEMM + all-reduce's pushes (FLAT tile pairs) as TMA stores
            into the peer's receive slots (True) or 16-byte remote stores (False); None: the
            config's (FUSED_BIG_TILE's TMA_PUSH).
        glu_persistent: matmul_swiglu at prefill sizes (numasched.gemm_glu.big_tiles) by the
            persistent kernel (True: GLU_PERSISTENT_SCHEDULE) or the split-K kernel's unsplit tiles
            (False: GLU_BIG_SCHEDULE); None: gemm_glu.GLU_PERSISTENT_BY_DEFAULT.
        glu_ws: matmul_swiglu at prefill sizes on Hopper by the warp-specialised Gluon kernel
            (True: kernels/gemm_ws.py) or the Triton kernels (False); None: gemm_glu.GLU_WS_BY_DEFAULT.
        glu_fused: matmul_swiglu under GLU_BIG_MIN_ROWS rows (without a row factor) by the fused
            split-K kernel (True) or by numasched.matmul into an (M, 2n) buffer then numasched.swiglu
            (False); None: gemm_glu.glu_fused_pays (fused at 1-16 rows, and at up to 64 where its
            GLU tiles are 64 columns or more).
        fused_ws: the two-rank fused GEMM + all-reduce's and GEMM + reduce-scatter's tile pairs
            on Hopper by the warp-specialised Gluon kernel (True: kernels/dist_gemm_ar_ws.py) or
            the Triton ones (False), eager or captured; None: on for two ranks of Hopper GPUs
            (matmul_all_reduce's tile pairs, DIRECT included; matmul_reduce_scatter where
            distributed.cost.rs_ws_pays; distributed._ws.ws_wanted).
        fused_rs_early: the warp-specialised reduce-scatter raises a partial's flag and fetches
            the peer's partial of an own tile inside the K loop (True: the copies over its first
            half, the flag at 5/8, the fetch at 7/8; the default) instead of after it (False).
            Two H100s (bench/results/tp2-s41/call4): 0.95-1.01x the time at 2048-16384 rows of
            Llama-3-8B down and Qwen3-32B o and down, geomean 0.984.
        fused_rs_pairs: the warp-specialised reduce-scatter's tile order: pairs (the peer slice's
            tile q, then ours: True) or one list (the peer's tiles first: False); None: pairs
            where they add no round (distributed.cost.rs_ws_pairs).
        fused_ws_group: the warp-specialised fused ops' tiles in groups of this many tile rows,
            column by column (0: row by row); None: distributed._ws.group_of (grouped for the
            reduce-scatter, and for the all-reduce where its weight exceeds twice the L2).
        gemm_align_a: numasched.matmul copies A into rows of whole 128-byte lines first where its
            rows are not (K * element size not a multiple of 128, A K-contiguous): every tile
            column re-reads A, and a misaligned row costs two lines per load (True: always there,
            also in the interpreter; False: never; None: on a GPU where
            gemm_schedule.align_a_pays: from 16 rows, most rows crossing a line).
        gemm_pad_k: where K * element size is not a multiple of 16 bytes (no TMA, the operands
            read an element at a time), numasched.matmul copies A and the weight W (B given as
            ``W.T`` of a row-major (N, K) W, A K-contiguous: the F.linear layout) into buffers
            whose rows are K rounded up to whole 128-byte lines, the tail zeros in both, and runs
            the GEMM planned for those over the padded K (True: always there, also in the
            interpreter; False: never; None: on a GPU where gemm_schedule.pad_k_pays: from
            PAD_K_MIN_ROWS (64) rows, where the modelled copies and aligned GEMM beat the
            misaligned GEMM). Other
            layouts of B take the misaligned kernel as before.
        gemm_splitk_operands: how the split-K GEMM reads its operands on Hopper where TMA can
            (``gemm_splitk_tma`` on, both operands describable): "tma" (both through descriptors,
            any tile), "b_tma" (the weight B through its descriptor, A through masked pointer
            loads: no box past A's last row), "b_tma_last" (so in the last tile row where it is
            partial, the others as "tma"), "pointer" (both through pointers) or "auto"
            (numasched.gemm_schedule.splitk_operands: by the tile's rows and M).
        gemm_ws_last_box: the warp-specialised GEMM (numasched.gemm_ws) reads the last tile row
            of A, where it is at most half full, in boxes of that row's rows (rounded up to a
            power of two, at least 16: gemm_ws.last_box_rows) instead of 128-row boxes running
            past A's last row (False: 128-row boxes).
        gemm_ws_dead_half: in the warp-specialised GEMM's data-parallel form a consumer
            warpgroup whose 64 rows of a tile lie wholly past M frees its ring slots without a
            wgmma (False: it multiplies the slot's stale rows, never stored).
        gemm_ws_swap: the chooser also weighs the warp-specialised GEMM's transposed form
            (``Schedule.swap``: the weight as the kernel's A, y stored transposed, so a tile's side
            along the tokens is 80-256 wide instead of 64 or 128 rows) where b is an F.linear
            weight's transpose. See gemm_schedule.WS_SWAP_*. On by default: at 24 shapes of
            129-944 rows where it changes the H100 pick (drawn from 4000 random ones), the pick
            ran 1.02-1.69x faster, geomean 1.22x (bench/results/gemm-s43/h100-check); on an
            H200 1.135x at the 16 where its model changes the pick, one 10 % slower (h200-check).
    """

    autotune: bool = True
    check_data: bool = True
    decode_combine: str = "auto"
    gemm_flatten: bool = True
    dist_tma: Optional[bool] = None
    gemm_schedule: str = "model"
    gemm_table: Optional[str] = None
    decode_schedule: str = "model"
    decode_config: Optional[str] = None
    decode_splits: Optional[int] = None
    gemm_splitk_tma: bool = True
    gemm_streamk_k_aligned: bool = True
    gemm_tail_split: bool = True
    gemm_ws: bool = True
    pdl: bool = True
    pdl_trigger: str = "late"
    pdl_prefetch: bool = False
    decode_prefetch: int = 128
    weight_first_early: Optional[int] = None
    decode_prefetch_wide: bool = False
    weight_first_row_parallel: bool = True
    weight_first_push: bool = True
    weight_first_push_min_k: int = 0
    weight_first_reduce: bool = False
    weight_first_row_splits: int = 1
    weight_first_row_splits_max_k: int = 2048
    paged_kv_head_major: bool = False
    decode_tma: bool = False
    arn_one_row: bool = True
    arn_exchange: str = "auto"
    fused_ar_stages: Optional[int] = None
    fused_flat: Optional[bool] = None
    glu_persistent: Optional[bool] = None
    fused_tma_push: Optional[bool] = None
    glu_ws: Optional[bool] = None
    glu_fused: Optional[bool] = None
    fused_ws: Optional[bool] = None
    fused_rs_early: bool = True
    fused_rs_pairs: Optional[bool] = None
    fused_ws_group: Optional[int] = None
    gemm_align_a: Optional[bool] = None
    gemm_pad_k: Optional[bool] = None
    gemm_splitk_operands: str = "auto"
    gemm_ws_last_box: bool = True
    gemm_ws_dead_half: bool = True
    gemm_ws_swap: bool = True

    def __post_init__(self):
        for f in ("autotune", "check_data", "gemm_flatten", "gemm_splitk_tma", "gemm_streamk_k_aligned",
                  "gemm_tail_split", "gemm_ws", "pdl", "pdl_prefetch", "arn_one_row", "decode_tma",
                  "gemm_ws_last_box", "gemm_ws_dead_half", "gemm_ws_swap", "fused_rs_early", "decode_prefetch_wide",
                  "weight_first_row_parallel", "weight_first_push", "weight_first_reduce", "paged_kv_head_major"):
            if not isinstance(getattr(self, f), bool):
                raise TypeError(f"Options.{f} must be a bool, got {getattr(self, f)!r}")
        if isinstance(self.pdl_trigger, bool):  # the former bool form
            object.__setattr__(self, "pdl_trigger", "early" if self.pdl_trigger else "none")
        if self.pdl_trigger not in TRIGGER_MODES:
            raise ValueError(f"Options.pdl_trigger must be one of {TRIGGER_MODES} (or a bool), "
                             f"got {self.pdl_trigger!r}")
        if isinstance(self.decode_prefetch, bool) or not isinstance(self.decode_prefetch, int) \
                or not 0 <= self.decode_prefetch <= 4096:
            raise ValueError(f"Options.decode_prefetch must be an int of tokens in [0, 4096], "
                             f"got {self.decode_prefetch!r}")
        if isinstance(self.weight_first_push_min_k, bool) or not isinstance(self.weight_first_push_min_k, int) \
                or self.weight_first_push_min_k < 0:
            raise ValueError(f"Options.weight_first_push_min_k must be an int >= 0 (columns of K), "
                             f"got {self.weight_first_push_min_k!r}")
        for f, what in (("weight_first_row_splits", "K parts; 0: the config's"),
                        ("weight_first_row_splits_max_k", "columns of K; 0: every K")):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"Options.{f} must be an int >= 0 ({what}), got {v!r}")
        if self.decode_splits is not None and (isinstance(self.decode_splits, bool) or not isinstance(
                self.decode_splits, int) or not 1 <= self.decode_splits <= 256):
            raise ValueError(f"Options.decode_splits must be None or an int in [1, 256] (splits per (batch, KV "
                             f"head)), got {self.decode_splits!r}")
        if self.weight_first_early is not None and (isinstance(self.weight_first_early, bool) or not isinstance(
                self.weight_first_early, int) or self.weight_first_early < 0):
            raise ValueError(f"Options.weight_first_early must be None or an int >= 0 (ring stages), "
                             f"got {self.weight_first_early!r}")
        if self.fused_ar_stages is not None and (isinstance(self.fused_ar_stages, bool) or self.fused_ar_stages
                                                 not in (2, 3, 4)):
            raise ValueError(f"Options.fused_ar_stages must be 2, 3, 4 or None, got {self.fused_ar_stages!r}")
        for f in ("fused_flat", "glu_persistent", "fused_tma_push", "glu_ws", "fused_ws", "gemm_align_a", "glu_fused",
                  "gemm_pad_k"):
            if getattr(self, f) is not None and not isinstance(getattr(self, f), bool):
                raise TypeError(f"Options.{f} must be a bool or None, got {getattr(self, f)!r}")
        if self.fused_rs_pairs is not None and not isinstance(self.fused_rs_pairs, bool):
            raise TypeError(f"Options.fused_rs_pairs must be a bool or None, got {self.fused_rs_pairs!r}")
        if self.fused_ws_group is not None and (isinstance(self.fused_ws_group, bool)
                                                or not isinstance(self.fused_ws_group, int)
                                                or not 0 <= self.fused_ws_group <= 64):
            raise ValueError(f"Options.fused_ws_group must be an int of tile rows in [0, 64] or None, "
                             f"got {self.fused_ws_group!r}")
        if self.gemm_splitk_operands not in SPLITK_OPERANDS:
            raise ValueError(f"Options.gemm_splitk_operands must be one of {SPLITK_OPERANDS}, "
                             f"got {self.gemm_splitk_operands!r}")
        if self.arn_exchange not in ARN_EXCHANGES:
            raise ValueError(f"Options.arn_exchange must be one of {ARN_EXCHANGES}, got {self.arn_exchange!r}")
        if self.decode_combine not in COMBINE_MODES:
            raise ValueError(f"Options.decode_combine must be one of {COMBINE_MODES}, got {self.decode_combine!r}")
        if self.dist_tma is not None and not isinstance(self.dist_tma, bool):
            raise TypeError(f"Options.dist_tma must be True, False or None, got {self.dist_tma!r}")
        for f in ("gemm_schedule", "decode_schedule"):
            if getattr(self, f) not in SCHEDULE_MODES:
                raise ValueError(f"Options.{f} must be 'model' or 'autotune', got {getattr(self, f)!r}")
        if self.gemm_table is not None and not isinstance(self.gemm_table, str):
            raise TypeError(f"Options.gemm_table must be a path string or None, got {self.gemm_table!r}")
        if self.decode_config is not None:
            decode_config_dict(self.decode_config)   # raises naming the option

    def __hash__(self):  # plan keys hash this on every call: compute once
        h = self.__dict__.get("_hash")
        if h is None:
            h = hash(tuple(getattr(self, f.name) for f in dataclasses.fields(self)))
            object.__setattr__(self, "_hash", h)
        return h

    def replace(self, **changes) -> "Options":
        unknown = {k for k in changes} - {f.name for f in dataclasses.fields(self)}
        if unknown:
            raise TypeError(f"unknown option(s) {sorted(unknown)}; options are "
                            f"{[f.name for f in dataclasses.fields(self)]}")
        return dataclasses.replace(self, **changes)


def _trigger(v: str) -> str:
    """NUMASCHED_PDL_TRIGGER: a mode (any case), or a flag (1/true/on/yes: early; 0/false/off/no:
    none); empty: the default."""
    v = v.strip().lower()
    if not v:
        return Options.pdl_trigger
    if v in ("1", "true", "on", "yes"):
        return "early"
    if v in ("0", "false", "off", "no"):
        return "none"
    return v


def from_env(environ=None) -> Options:
    """The options the environment variables ask for (see the module doc)."""
    env = os.environ if environ is None else environ

    def flag(name, default):
        v = env.get(name)
        return default if v is None else v != "0"

    tma = env.get("NUMASCHED_DIST_TMA")
    ll = env.get("NUMASCHED_ARN_LL", "").strip().lower()
    exchange = {"": "auto", "auto": "auto", "0": "flag", "flag": "flag", "1": "ll", "ll": "ll"}.get(ll)
    if exchange is None:
        raise ValueError(f"NUMASCHED_ARN_LL must be 1 / ll, 0 / flag or auto, got {env.get('NUMASCHED_ARN_LL')!r}")
    pre = env.get("NUMASCHED_DECODE_PREFETCH", "").strip()
    if pre and not pre.isdigit():
        raise ValueError(f"NUMASCHED_DECODE_PREFETCH must be a number of tokens (0: off), got {pre!r}")
    early = env.get("NUMASCHED_WEIGHT_FIRST_EARLY", "").strip()
    push_k = env.get("NUMASCHED_WEIGHT_FIRST_PUSH_MIN_K", "").strip()
    row_splits = env.get("NUMASCHED_WEIGHT_FIRST_ROW_SPLITS", "").strip()
    rs_k = env.get("NUMASCHED_WEIGHT_FIRST_ROW_SPLITS_MAX_K", "").strip()
    if rs_k and not rs_k.isdigit():
        raise ValueError(f"NUMASCHED_WEIGHT_FIRST_ROW_SPLITS_MAX_K must be a number of columns, got {rs_k!r}")
    if row_splits and not row_splits.isdigit():
        raise ValueError(f"NUMASCHED_WEIGHT_FIRST_ROW_SPLITS must be a number of K parts (0: the config's), "
                         f"got {row_splits!r}")
    if early and not early.isdigit():
        raise ValueError(f"NUMASCHED_WEIGHT_FIRST_EARLY must be a number of ring stages, got {early!r}")
    tri = {}
    for name in ("NUMASCHED_FUSED_FLAT", "NUMASCHED_GLU_PERSISTENT", "NUMASCHED_FUSED_TMA_PUSH", "NUMASCHED_GLU_WS",
                 "NUMASCHED_FUSED_WS", "NUMASCHED_GEMM_ALIGN_A", "NUMASCHED_GLU_FUSED", "NUMASCHED_GEMM_PAD_K"):
        v = env.get(name, "").strip()
        if v not in ("", "0", "1"):
            raise ValueError(f"{name} must be 0 or 1, got {v!r}")
        tri[name] = None if not v else v == "1"
    group = env.get("NUMASCHED_FUSED_WS_GROUP", "").strip()
    if group and not group.isdigit():
        raise ValueError(f"NUMASCHED_FUSED_WS_GROUP must be a number of tile rows (0: row by row), got {group!r}")
    pairs = env.get("NUMASCHED_FUSED_RS_PAIRS", "").strip()
    if pairs not in ("", "0", "1"):
        raise ValueError(f"NUMASCHED_FUSED_RS_PAIRS must be 0 or 1, got {pairs!r}")
    splits = env.get("NUMASCHED_DECODE_SPLITS", "").strip()
    if splits and not splits.isdigit():
        raise ValueError(f"NUMASCHED_DECODE_SPLITS must be a number of splits, got {splits!r}")
    stages = env.get("NUMASCHED_FUSED_AR_STAGES", "").strip()
    if stages and not stages.isdigit():
        raise ValueError(f"NUMASCHED_FUSED_AR_STAGES must be a number of stages, got {stages!r}")
    return Options(autotune=flag("NUMASCHED_AUTOTUNE", True), check_data=flag("NUMASCHED_CHECK_DATA", True),
                   decode_combine=env.get("NUMASCHED_DECODE_COMBINE", "auto"),
                   gemm_flatten=flag("NUMASCHED_GEMM_FLATTEN", True),
                   dist_tma=None if tma not in ("0", "1") else tma == "1",
                   gemm_schedule=env.get("NUMASCHED_GEMM_SCHEDULE", "model"),
                   gemm_table=env.get("NUMASCHED_GEMM_TABLE") or None,
                   decode_schedule=env.get("NUMASCHED_DECODE_SCHEDULE", "model"),
                   decode_config=env.get("NUMASCHED_DECODE_CONFIG", "").strip() or None,
                   decode_splits=int(splits) if splits else None,
                   gemm_splitk_tma=flag("NUMASCHED_GEMM_SPLITK_TMA", True),
                   gemm_streamk_k_aligned=flag("NUMASCHED_GEMM_STREAMK_K_ALIGNED", True),
                   gemm_tail_split=flag("NUMASCHED_GEMM_TAIL_SPLIT", True),
                   gemm_ws=flag("NUMASCHED_GEMM_WS", True),
                   pdl=flag("NUMASCHED_PDL", True),
                   pdl_trigger=_trigger(env.get("NUMASCHED_PDL_TRIGGER", "late")),
                   pdl_prefetch=flag("NUMASCHED_PDL_PREFETCH", False),
                   decode_prefetch=int(pre) if pre else Options.decode_prefetch,
                   weight_first_early=int(early) if early else None,
                   decode_prefetch_wide=flag("NUMASCHED_DECODE_PREFETCH_WIDE", Options.decode_prefetch_wide),
                   weight_first_row_parallel=flag("NUMASCHED_WEIGHT_FIRST_ROW_PARALLEL",
                                                  Options.weight_first_row_parallel),
                   weight_first_push=flag("NUMASCHED_WEIGHT_FIRST_PUSH", Options.weight_first_push),
                   weight_first_push_min_k=int(push_k) if push_k else Options.weight_first_push_min_k,
                   weight_first_reduce=flag("NUMASCHED_WEIGHT_FIRST_REDUCE", Options.weight_first_reduce),
                   weight_first_row_splits=int(row_splits) if row_splits else Options.weight_first_row_splits,
                   weight_first_row_splits_max_k=int(rs_k) if rs_k else Options.weight_first_row_splits_max_k,
                   paged_kv_head_major=flag("NUMASCHED_PAGED_KV_HEAD_MAJOR", Options.paged_kv_head_major),
                   decode_tma=flag("NUMASCHED_DECODE_TMA", Options.decode_tma),
                   arn_one_row=flag("NUMASCHED_ARN_ONE_ROW", True),
                   arn_exchange=exchange,
                   fused_ar_stages=int(stages) if stages else None,
                   fused_flat=tri["NUMASCHED_FUSED_FLAT"], glu_persistent=tri["NUMASCHED_GLU_PERSISTENT"],
                   fused_tma_push=tri["NUMASCHED_FUSED_TMA_PUSH"], glu_ws=tri["NUMASCHED_GLU_WS"],
                   fused_ws=tri["NUMASCHED_FUSED_WS"], gemm_align_a=tri["NUMASCHED_GEMM_ALIGN_A"],
                   glu_fused=tri["NUMASCHED_GLU_FUSED"], gemm_pad_k=tri["NUMASCHED_GEMM_PAD_K"],
                   gemm_splitk_operands=env.get("NUMASCHED_GEMM_SPLITK_OPERANDS", "auto").strip() or "auto",
                   gemm_ws_last_box=flag("NUMASCHED_GEMM_WS_LAST_BOX", True),
                   gemm_ws_dead_half=flag("NUMASCHED_GEMM_WS_DEAD_HALF", True),
                   gemm_ws_swap=flag("NUMASCHED_GEMM_WS_SWAP", Options.gemm_ws_swap),
                   fused_rs_early=flag("NUMASCHED_FUSED_RS_EARLY", Options.fused_rs_early),
                   fused_rs_pairs=None if not pairs else pairs == "1",
                   fused_ws_group=int(group) if group else None)


def decode_config_dict(spec: str) -> dict:
    """``"128x4x4"`` -> ``dict(BLOCK_N=128, num_warps=4, num_stages=4)`` (Options.decode_config):
    a tile of 16-256 tokens (a power of two), 1, 2, 4 or 8 warps, 1-12 stages (paged: (stages - 1)
    // 2 K/V tiles in flight)."""
    parts = spec.split("x") if isinstance(spec, str) else []
    if len(parts) != 3 or not all(p.strip().isdigit() for p in parts):
        raise ValueError(f"Options.decode_config (NUMASCHED_DECODE_CONFIG) must be 'BLOCK_NxWARPSxSTAGES', e.g. "
                         f"'128x4x4', got {spec!r}")
    block_n, warps, stages = (int(p) for p in parts)
    if block_n not in (16, 32, 64, 128, 256) or warps not in (1, 2, 4, 8) or not 1 <= stages <= 12:
        raise ValueError(f"Options.decode_config {spec!r}: BLOCK_N in 16..256 (a power of two), 1/2/4/8 warps and "
                         f"1-12 stages")
    return dict(BLOCK_N=block_n, num_warps=warps, num_stages=stages)


_CURRENT = from_env()


def current() -> Options:
    """The options in force now."""
    return _CURRENT


def set(options: Optional[Options] = None, **changes) -> Options:  # noqa: A001 - numasched.options.set
    """Replace the process-wide options (an Options, and/or field changes); returns the old ones."""
    global _CURRENT
    if options is not None and not isinstance(options, Options):
        raise TypeError(f"options must be an Options, got {type(options).__name__}")
    old = _CURRENT
    _CURRENT = (options or old).replace(**changes)
    return old


class use:
    """``with numasched.options.use(autotune=False): ...`` changes options for a block."""

    def __init__(self, options: Optional[Options] = None, **changes):
        base = options if options is not None else _CURRENT
        if not isinstance(base, Options):
            raise TypeError(f"options must be an Options, got {type(options).__name__}")
        self._new = base.replace(**changes)

    def __enter__(self) -> Options:
        self._old = set(self._new)
        return self._new

    def __exit__(self, *exc):
        set(self._old)
        return False
