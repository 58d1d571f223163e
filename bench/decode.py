"""``numasched bench decode``: Flash Decode against its peers, side by side in one run.

Per point (heads, batch, context), bf16, head dim 128, one query token per sequence:

* numasched.flash_decode on a contiguous cache in its native layout (batch, ctx, kv_heads, d),
  on the ``k.transpose(1, 2)`` view of a (batch, kv_heads, ctx, d) tensor (what SDPA users have),
  and on paged caches (``--pages``, default 16; random block table), each with the default
  ("auto") combine and, as a variant, the combine mode auto did not pick (fused or kernel);
* torch SDPA with each backend (FLASH / EFFICIENT / cuDNN through ``sdpa_kernel``; "n/a" where a
  backend has no kernel), FlexAttention's decode path (``torch.compile(flex_attention)``), and
  FlashInfer's ``BatchDecodeWithPagedKVCacheWrapper`` (paged, NHD) if importable.

Every contender is timed twice: eager calls (``fn()``; includes the host launch overhead) and a
CUDA-graph replay of one captured call (``*_graph_us``; what a serving engine's decode step
costs), each call alone between CUDA events after an L2 flush (``--flush``: by default a 256 MB
read, so the call starts with a cold L2 of clean lines; ``zero`` is triton's do_bench, whose
written flush leaves dirty lines that every contender writes back while it reads). Peers that
cannot be captured show "n/a" there and count with their eager time.
Bytes moved = K + V read + q read + out written. Reported: time, TB/s, fraction of the measured
streaming-read bandwidth (bench.common.stream_read_bw), and the ratio best peer time / our time
(> 1: we are faster) against the best peer at that point in any layout: ``ratio_vs_best_peer`` on
graph times, ``ratio_eager`` on eager times; FlashInfer there is the one with the row's page
size (contiguous rows: the first page size). Our figures are for the default ("auto") combine,
``combine`` says which it picked; ``ours_kernel_combine_*`` and ``ours_fused_combine_*`` are the
two modes forced (one of them is the auto pick). The first point runs twice and its first pass
is dropped (a run's first timings read up to 6 % slow). A line is printed per point as it
finishes and the CSV so far is rewritten (``*.partial.csv``), so a run cut short keeps its rows.

    numasched bench decode --host            # host time per eager call (GPU), SDPA cuDNN beside it
    numasched bench decode --dry-run         # the points and contenders, without a GPU

    numasched bench decode --quick
    numasched bench decode --heads gqa        # the full grid, one head config per run
    numasched bench decode --heads mha
    numasched bench decode --heads gqa --pages 16 64 --paged-only --no-eager   # the paged target alone

Multi-token decode (``--sq``: q_len new tokens per sequence, speculative decoding's verification
step; causal, bottom-right aligned), per point and q_len, bf16, head dim 128, every sequence the
whole context:

* numasched.flash_decode with q (batch, q_len, heads, d) on paged caches (``--pages``, default 16
  and 64, random block table) and on the ``k.transpose(1, 2)`` view of a contiguous
  (batch, kv_heads, ctx, d) cache (what HF's cache is);
* torch SDPA on the contiguous cache with a bottom-right causal mask: the
  ``torch.nn.attention.bias.causal_lower_right`` bias under each backend (FLASH / EFFICIENT /
  cuDNN; "n/a" where a backend refuses it) and an explicit boolean mask (torch's pick);
* FlashInfer's ``BatchPrefillWithPagedKVCacheWrapper(causal=True)`` (bottom-right aligned) on the
  same paged caches, if importable (its version is recorded; its decode wrapper takes one token).

Times, graph replays, TB/s and ratios as above; results go to ``decode_multi-<device>-<date>``.

    numasched bench decode --sq 2,4,8 --quick
    numasched bench decode --sq 4 --heads gqa --batch 1 8 --ctx 8192 32768 --pages 16 64

Ragged batches (``--ragged``: issue 12 item 3): per point (heads, batch B, context L), sequence
lengths drawn uniformly from [L/16, L] (``--seed``, default 0), bf16, head dim 128, one query token:

* numasched.flash_decode (the split kernel: every sequence cut into the same number of splits) and
  the work-list plan (``numasched.plan_decode_worklist``: the batch cut into equal per-program
  budgets, a persistent kernel; made once per point, its ``run`` timed) on a paged cache (page 16,
  each sequence its own pages, scattered) and on a contiguous (B, L, HK, D) cache with
  ``cache_seqlens``;
* FlashInfer's ``BatchDecodeWithPagedKVCacheWrapper`` on the same paged cache, if importable (its
  version is recorded);
* SDPA on the padded contiguous (B, HK, L, D) cache with a boolean length mask (it reads the whole
  padding: for scale, not a like-for-like peer).

Useful bytes = the K and V of the valid tokens + q + out. Reported per layout: times (eager and
CUDA-graph replay), work list / split kernel, the ratio best peer / work list, and the fraction of
the measured streaming read on the useful bytes. Targets (issue 12): >= 1.00x FlashInfer, and
>= 0.90 of the streaming read when the useful bytes are >= 1 GB. Results go to
``decode_ragged-<device>-<date>``.

    numasched bench decode --ragged --dry-run
    numasched bench decode --ragged --quick
    numasched bench decode --ragged --heads gqa --batch 8 32 128 --ctx 4096 16384 32768
"""
from __future__ import annotations

import argparse
import math
from typing import Callable, Dict, List, NamedTuple, Optional

# query / KV heads: the four configs (Llama-3-8B, Llama-3-70B, MHA, Qwen2-7B-like 28/4) and
# Llama-3-8B at tensor parallel 2 (16/4: what each GPU of the TP 2 decoder runs)
HEADS = {"gqa": (32, 8), "gqa64": (64, 8), "mha": (32, 32), "gqa28": (28, 4), "tp2": (16, 4)}
ALL_HEADS = ["gqa", "gqa64", "mha", "gqa28"]
# the grid (batch x context <= MAX_TOKENS; --batch / --ctx pick a part of it)
BATCHES = [1, 2, 4, 8, 16, 32, 64, 128]
CONTEXTS = [512, 1024, 2048, 4096, 8192, 16384, 32768, 131072]
MAX_TOKENS = 4 << 20
RAGGED_BATCHES = [8, 32, 128]
RAGGED_CONTEXTS = [4096, 16384, 32768]
RAGGED_QUICK_POINTS = [("gqa", 8, 32768), ("gqa", 32, 16384), ("gqa", 128, 4096), ("gqa", 128, 32768)]
QUICK_POINTS = [("gqa", 1, 8192), ("gqa", 1, 131072), ("gqa", 8, 32768), ("gqa", 32, 8192), ("mha", 8, 8192)]
HEAD_DIM = 128
PAGE = 16
SDPA_BACKENDS = ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION")
MULTI_PAGES = [16, 64]
QUICK_MULTI_POINTS = [("gqa", 1, 8192), ("gqa", 1, 32768), ("gqa", 8, 8192), ("gqa", 32, 4096), ("mha", 8, 8192)]
MAX_Q_LEN = 16  # numasched.decode.MAX_QUERY_TOKENS (not imported here: the parser needs no torch)
# issue 12's targets for this grid: ratio >= 1 (contiguous rows against the best peer, paged rows
# against FlashInfer with the same pages), and >= STREAM_TARGET of the streaming read from
# STREAM_MIN_TOKENS tokens (batch x context)
STREAM_TARGET = 0.92
STREAM_MIN_TOKENS = 256 * 1024


def _q_lens(text: str) -> List[int]:
    """argparse type of --sq: comma-separated query lengths in [1, MAX_Q_LEN] ("2,4,8")."""
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        out = []
    if not out or any(not 1 <= x <= MAX_Q_LEN for x in out):
        raise argparse.ArgumentTypeError(f"expected comma-separated query lengths in [1, {MAX_Q_LEN}] such as "
                                         f"2,4,8, got {text!r}")
    return list(dict.fromkeys(out))


def _fraction(text: str) -> float:
    """argparse type of --ragged-min: a number in (0, 1] ("0.0625", "1", or "1/16")."""
    try:
        num, _, den = text.partition("/")
        x = float(num) / float(den) if den else float(num)
    except (ValueError, ZeroDivisionError):
        x = float("nan")
    if not 0 < x <= 1:
        raise argparse.ArgumentTypeError(f"expected a fraction in (0, 1] such as 1/16 or 1, got {text!r}")
    return x


def _decode_mapping(text: str) -> str:
    """argparse type of --mapping: "auto" or a registered decode policy."""
    from numasched import mappings as M

    if text == "auto" or text in M.available("decode"):
        return text
    raise argparse.ArgumentTypeError(f"expected 'auto' or a decode policy ({', '.join(M.available('decode'))}), "
                                     f"got {text!r}")


def _option_variant(text: str):
    """argparse type of --variant: NAME=VALUE of a numasched option (``numasched.options.Options``),
    the value typed as the option's default is (bool: 1/0/true/false, int, or a string)."""
    import dataclasses

    from numasched import options

    name, sep, raw = text.partition("=")
    fields = {f.name: f for f in dataclasses.fields(options.Options)}
    if not sep or name not in fields:
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE with NAME one of {sorted(fields)}, got {text!r}")
    default = getattr(options.Options(), name)
    try:
        if isinstance(default, bool):
            if raw.lower() not in ("1", "0", "true", "false"):
                raise ValueError(raw)
            value = raw.lower() in ("1", "true")
        elif isinstance(default, int):
            value = int(raw)
        else:
            value = raw
        options.Options(**{name: value})
    except (ValueError, TypeError) as e:
        raise argparse.ArgumentTypeError(f"--variant {text!r}: {e}")
    return name, value


def build_parser() -> argparse.ArgumentParser:
    from numasched.argtypes import nonneg_int, out_dir, positive_float, positive_int

    from .common import FLUSH_MODES

    p = argparse.ArgumentParser(prog="numasched bench decode", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help=f"a handful of points: {QUICK_POINTS}")
    p.add_argument("--heads", choices=list(HEADS) + ["all"], nargs="+", default=["all"],
                   help="head configs (query / KV heads): " + ", ".join(f"{k} {h}/{kv}" for k, (h, kv) in HEADS.items())
                        + f"; all: {' '.join(ALL_HEADS)} (the issue's grid)")
    p.add_argument("--batch", type=positive_int, nargs="+", default=None,
                   help=f"batch sizes (default {BATCHES}; --ragged: {RAGGED_BATCHES})")
    p.add_argument("--ctx", type=positive_int, nargs="+", default=None,
                   help=f"context lengths in tokens (default {CONTEXTS}; --ragged: the longest length, "
                        f"{RAGGED_CONTEXTS})")
    p.add_argument("--max-gb", type=positive_float, default=40.0, help="skip points whose K+V cache exceeds this (GB)")
    p.add_argument("--no-flex", action="store_true", help="skip FlexAttention (it compiles once per shape)")
    p.add_argument("--no-flashinfer", action="store_true", help="skip FlashInfer even if it is installed")
    p.add_argument("--mapping", type=_decode_mapping, default="auto", help="numasched mapping policy (default auto)")
    p.add_argument("--flashinfer-both", action="store_true",
                   help="time FlashInfer with and without tensor cores (default: tensor cores for group >= 4)")
    p.add_argument("--sweep-splits", type=positive_int, nargs="*", default=None,
                   help="also time numasched at these split counts (extra rows; data for the split heuristic)")
    p.add_argument("--variant", type=_option_variant, action="append", default=[],
                   help="also time numasched with this option set (NAME=VALUE, e.g. decode_tma=1; repeatable): "
                        "an extra row per layout, timed in the same run as the default")
    p.add_argument("--prefetch", action="store_true",
                   help="numasched's calls ask for the K/V prefetch before the PDL wait (flash_decode(..., "
                        "prefetch=True), as numasched's decoder calls it after its RoPE + cache write; default off, "
                        "as a standalone call); with --variant decode_prefetch=0 for an A/B")
    p.add_argument("--no-paged", action="store_true", help="contiguous layouts only (no paged cache, no FlashInfer)")
    p.add_argument("--paged-only", action="store_true",
                   help="the paged target alone: numasched on the paged caches (the default combine) against "
                        "FlashInfer with the same pages; no contiguous layouts, no SDPA or Flex peers (about a "
                        "third of a full point's timings). Each paged output is checked against a float64 "
                        "reference of its first sequence")
    p.add_argument("--rep", type=positive_int, default=100, help="timing window per measurement, ms")
    p.add_argument("--flush", choices=FLUSH_MODES, default="read",
                   help="the L2 flush before each timed call: read (default: 256 MB read, the L2 cold and clean, as "
                        "after a model's weight reads) or zero (triton's do_bench: 256 MB written, so every "
                        "contender's first L2-size of reads also writes back dirty lines; the 1st-51st sessions' "
                        "setting)")
    p.add_argument("--no-graph", action="store_true", help="skip the CUDA-graph timings")
    p.add_argument("--no-eager", action="store_true",
                   help="skip the eager timings of the single-token grid (each call still runs once, unmeasured, "
                        "before its graph is captured; a contender that cannot be captured is timed eagerly): "
                        "the target's ratios are on graph times, and this halves a point's timings. The eager "
                        "columns say 'skipped'")
    p.add_argument("--sq", type=_q_lens, default=None,
                   help=f"multi-token decode instead: these query lengths per sequence (comma list in 1..{MAX_Q_LEN}, "
                        f"e.g. 2,4,8), against SDPA with a bottom-right causal mask and FlashInfer's paged prefill")
    p.add_argument("--pages", type=positive_int, nargs="+", default=None,
                   help=f"page sizes of the paged caches (default: [{PAGE}]; --sq: {MULTI_PAGES})")
    p.add_argument("--ragged", action="store_true",
                   help="ragged batches instead: lengths uniform in [ctx/16, ctx]; the split kernel, the work-list "
                        "plan, FlashInfer's paged decode and SDPA with a length mask")
    p.add_argument("--seed", type=nonneg_int, default=0, help="--ragged: seed of the length draws")
    p.add_argument("--ragged-min", type=_fraction, default=RAGGED_MIN, metavar="FRAC",
                   help="--ragged: the shortest length as a fraction of ctx (default 1/16; 1: every sequence the "
                        "whole context, the split kernel against the work list on a uniform batch)")
    p.add_argument("--programs", type=positive_int, default=None,
                   help="--ragged: work-list programs (default numasched.decode_worklist.PROGRAMS_PER_SM per SM)")
    p.add_argument("--worklist-config", type=_worklist_config, default=None, metavar="BN/W/ST",
                   help="--ragged: the work-list kernel's config (BLOCK_N/num_warps/num_stages) instead of the model's "
                        "(a given config also means the work list at every point)")
    p.add_argument("--host", action="store_true",
                   help="only measure host time per eager numasched.flash_decode call, SDPA cuDNN beside it (GPU)")
    p.add_argument("--calls", type=positive_int, default=1000, help="calls per --host measurement")
    p.add_argument("--out-dir", type=out_dir, default=None, help="results folder (default: see numasched.bench.common)")
    p.add_argument("--dry-run", action="store_true",
                   help="print the points and contenders and exit (no GPU needed, nothing timed)")
    return p


def _parse(argv):
    args = build_parser().parse_args(argv)
    args.timing = Timing(args.rep, args.flush)
    if args.ragged and args.pages not in (None, [PAGE]):
        build_parser().error(f"--pages: --ragged times pages of {PAGE} only")
    if args.pages is None:
        args.pages = list(MULTI_PAGES) if args.sq else [PAGE]
    if args.no_paged:
        if args.sq or args.ragged:
            build_parser().error("--no-paged: the single-token grid only (not with --sq or --ragged)")
        args.pages = []
    if args.no_eager and (args.no_graph or args.sq or args.ragged or args.host):
        build_parser().error("--no-eager: the single-token grid's graph timings only (not with --no-graph, --sq, "
                             "--ragged or --host)")
    if args.paged_only:
        if args.no_paged:
            build_parser().error("--paged-only and --no-paged exclude each other")
        if args.sq or args.ragged or args.host:
            build_parser().error("--paged-only: the single-token grid only (not with --sq, --ragged or --host)")
        if args.no_flashinfer:
            build_parser().error("--paged-only times the paged caches against FlashInfer: drop --no-flashinfer")
    if args.variant and (args.sq or args.ragged):
        build_parser().error("--variant: the single-token grid only (not with --sq or --ragged)")
    if args.prefetch and (args.sq or args.ragged or args.host):
        build_parser().error("--prefetch: the single-token grid only (not with --sq, --ragged or --host)")
    if any(name == "decode_prefetch" for name, _ in args.variant) and not args.prefetch:
        build_parser().error("--variant decode_prefetch=N changes nothing without --prefetch "
                             "(flash_decode prefetches only when asked)")
    if (args.worklist_config is not None or args.programs is not None) and not args.ragged:
        build_parser().error("--worklist-config and --programs go with --ragged")
    if args.ragged_min != RAGGED_MIN and not args.ragged:
        build_parser().error("--ragged-min goes with --ragged")
    return args


def _dry_run(args) -> int:
    """The points (with the split count numasched would pick) and the contenders, nothing timed."""
    from .common import print_plan

    sms = 132  # H100 SXM: the split counts a GPU run would use there (an H200 takes two splits at
    # 64 pairs x 2k-4k where an H100 takes one: numasched.decode.stream_scale)
    if args.ragged and not args.host:
        return _dry_run_ragged(args, sms)
    if args.sq and not args.host:
        return _dry_run_multi(args, sms)
    if args.host:
        return print_plan("decode --host", ["gqa 32/8, batch 1, ctx 1024, d128: contiguous (auto splits, 1 split), "
                                            "paged 16, torch.ops.numasched.flash_decode"],
                          ["numasched.flash_decode", "SDPA cuDNN (with sdpa_kernel context)",
                           f"{args.calls} calls per measurement"])
    lines = []
    for hname, H, HK, B, L, kv_gb in _dry_points(args, lines):
        lines.append(f"{hname} {H}/{HK} batch {B} ctx {L} d{HEAD_DIM}: K+V {kv_gb:.3f} GB, "
                     f"{_splits_text(B, HK, L, sms, args.pages)} on {sms} SMs"
                     + (f", also splits {args.sweep_splits}" if args.sweep_splits else ""))
    ask = ", prefetch=True" if args.prefetch else ""
    if args.paged_only:
        contenders = [f"numasched ({args.mapping}{ask}) paged {p}, combine auto" for p in args.pages]
    else:
        contenders = [f"numasched ({args.mapping}{ask}) {layout}, combine auto, and fused or kernel (the other)"
                      for layout in ["contiguous (BHLD view)", "contiguous (BLHD)"] + [f"paged {p}" for p in args.pages]]
    contenders += [f"numasched with {name}={value}, each layout" for name, value in args.variant]
    if not args.paged_only:
        contenders += [f"SDPA {be}" for be in SDPA_BACKENDS]
        contenders += [] if args.no_flex else ["FlexAttention (torch.compile)"]
    contenders += [] if (args.no_flashinfer or not args.pages) else [
        f"FlashInfer paged decode, pages {args.pages} (if importable)"]
    contenders += [] if args.no_graph else [
        "each as a CUDA-graph replay only (--no-eager)" if args.no_eager else "each also as a CUDA-graph replay"]
    return print_plan("decode", lines, contenders)


def _dry_run_multi(args, sms: int) -> int:
    from numasched.kernels.flash_decode import row_tiling

    from .common import print_plan

    lines = []
    for hname, H, HK, B, L, kv_gb in _dry_points(args, lines):
        for sq in args.sq:
            block_g, groups = row_tiling(sq, H // HK)
            lines.append(f"{hname} {H}/{HK} batch {B} ctx {L} q_len {sq} d{HEAD_DIM}: K+V {kv_gb:.3f} GB, rows "
                         f"{block_g} x {groups} group(s), {_splits_text(B, HK * groups, L, sms, args.pages)} on "
                         f"{sms} SMs")
    contenders = [f"numasched ({args.mapping}) q (batch, q_len, heads, d), {layout}"
                  for layout in ["contiguous (BHLD view)"] + [f"paged {p}" for p in args.pages]]
    contenders += [f"SDPA causal_lower_right {be}" for be in SDPA_BACKENDS] + ["SDPA boolean bottom-right mask"]
    contenders += [] if args.no_flashinfer else [f"FlashInfer paged prefill causal, pages {args.pages} (if importable)"]
    contenders += [] if args.no_graph else ["each also as a CUDA-graph replay"]
    return print_plan("decode --sq", lines, contenders)


def _points(args):
    ragged = getattr(args, "ragged", False)
    if args.quick:
        return list(RAGGED_QUICK_POINTS if ragged else QUICK_MULTI_POINTS if args.sq else QUICK_POINTS)
    heads = list(dict.fromkeys(h for x in args.heads for h in (ALL_HEADS if x == "all" else [x])))
    batches = args.batch or (RAGGED_BATCHES if ragged else BATCHES)
    contexts = args.ctx or (RAGGED_CONTEXTS if ragged else CONTEXTS)
    # the cap (batch x context <= 4M tokens) on the default grid; points asked for
    # explicitly (--batch and --ctx both given) are all run
    capped = not ragged and not (args.batch and args.ctx)
    return [(h, b, c) for h in heads for b in batches for c in contexts if not capped or b * c <= MAX_TOKENS]


def _splits_text(B: int, pairs_per_seq: int, L: int, sms: int, pages) -> str:
    """The split count of a contiguous cache, and a paged one's where it differs (dry runs)."""
    from numasched.decode import choose_num_splits

    s = choose_num_splits(B, pairs_per_seq, L, sms)
    p = choose_num_splits(B, pairs_per_seq, L, sms, paged=True)
    return f"{s} splits" + (f" ({p} paged)" if pages and p != s else "")


def _dry_points(args, lines: list, what: str = "K+V"):
    """The dry runs' points whose (padded) K+V fits --max-gb, as (hname, H, HK, B, L, GB); a line
    in ``lines`` for each skipped one."""
    for hname, B, L in _points(args):
        H, HK = HEADS[hname]
        kv_gb = 2 * B * L * HK * HEAD_DIM * 2 / 1e9
        if kv_gb > args.max_gb:
            lines.append(f"{hname} {H}/{HK} batch {B} ctx {L}: skipped ({what} {kv_gb:.1f} GB > --max-gb "
                         f"{args.max_gb:g})")
            continue
        yield hname, H, HK, B, L, kv_gb


RAGGED_MIN = 1 / 16  # --ragged: the shortest length drawn, as a fraction of ctx


def ragged_lengths(batch: int, ctx: int, seed: int, min_frac: float = RAGGED_MIN):
    """The lengths of a ragged point: uniform in [ctx * min_frac, ctx] (ctx // 16 by default; NumPy,
    seeded per point). min_frac = 1 gives every sequence the whole context."""
    import numpy as np

    lo = max(1, min(ctx, int(ctx * min_frac)))
    return np.random.default_rng([seed, batch, ctx]).integers(lo, ctx + 1, batch)


def _dry_run_ragged(args, sms: int) -> int:
    """The ragged points (lengths, useful bytes, the split count and the work list numasched would
    plan on an H200-sized GPU) and the contenders; nothing timed, no GPU."""
    from numasched.decode import choose_num_splits
    from numasched.decode_worklist import PROGRAMS_PER_SM, build_worklist

    from .common import print_plan

    P = args.programs or PROGRAMS_PER_SM * sms
    lines = []
    for hname, H, HK, B, L, _ in _dry_points(args, lines, "padded K+V"):
        lens = ragged_lengths(B, L, args.seed, args.ragged_min)
        useful = 2 * int(lens.sum()) * HK * HEAD_DIM * 2
        wl = build_worklist(lens, HK, P, None, group=H // HK)
        lines.append(f"{hname} {H}/{HK} batch {B} ctx {L} d{HEAD_DIM}: lengths {int(lens.min())}..{int(lens.max())} "
                     f"(mean {lens.mean():.0f}), useful K+V {useful / 1e9:.3f} GB; split kernel "
                     f"{choose_num_splits(B, HK, L, sms)} splits; work list {wl.num_items} items on {P} programs, "
                     f"longest {wl.chunk_tokens} tokens, planned balance {wl.balance:.3f}")
    contenders = [f"numasched.flash_decode (split kernel) and plan_decode_worklist(...).run, {layout}"
                  for layout in (f"paged {PAGE}", "contiguous (BLHD) with cache_seqlens")]
    contenders += [] if args.no_flashinfer else [f"FlashInfer paged decode, page {PAGE} (if importable)"]
    contenders += ["SDPA with a boolean length mask on the padded (B, HK, L, D) cache"]
    contenders += [] if args.no_graph else ["each also as a CUDA-graph replay"]
    return print_plan("decode --ragged", lines, contenders)


class Timing(NamedTuple):
    """How each call is timed: ``rep`` ms of calls, each after an L2 flush of kind ``flush``
    (bench.common.bench_ms)."""
    rep: int
    flush: str


def _time(fn: Callable, timing: Timing) -> Optional[float]:
    from .common import bench_ms

    return bench_ms(fn, warmup=max(10, timing.rep // 4), rep=timing.rep, flush=timing.flush)


def _run(fn: Callable, notes: List[str], name: str):
    """Run fn once: (True, its output), or (False, None) with why in ``notes`` if it raises (e.g.
    an SDPA backend without a kernel: reported as n/a)."""
    import torch

    try:
        out = fn()
        torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001 - a peer that cannot run this case is "n/a", with why
        notes.append(f"{name}: {type(e).__name__}: {str(e).splitlines()[0][:80] if str(e) else ''}")
        return False, None
    return True, out


def _try(fn: Callable, timing: Timing, notes: List[str], name: str):
    """Time fn: (ms, output), or (None, None) if it cannot run (:func:`_run`)."""
    ran, out = _run(fn, notes, name)
    return (_time(fn, timing), out) if ran else (None, None)


def _flashinfer():
    try:
        import flashinfer  # noqa: F401

        return flashinfer, None
    except Exception as e:  # noqa: BLE001
        return None, f"{type(e).__name__}: {e}"


def _graph_ms(fn: Callable, timing: Timing, notes: List[str], name: str) -> Optional[float]:
    """Median ms of replaying a CUDA graph holding one call of fn (already run eagerly); None if fn cannot be captured."""
    import torch

    from .common import capture, warm_up_for_capture

    try:
        warm_up_for_capture(fn)
        graph = capture(fn)
    except Exception as e:  # noqa: BLE001 - not capturable: "n/a", with why
        notes.append(f"{name} graph: {type(e).__name__}: {str(e).splitlines()[0][:80] if str(e) else ''}")
        try:
            torch.cuda.synchronize()
        except Exception:  # noqa: BLE001
            pass
        return None
    return _time(graph.replay, timing)


def _host_overhead(calls: int) -> int:
    """Host microseconds per eager call: wall time of back-to-back calls on a small cache (GPU).

    The launches are real and the cache small (1 x 1024 tokens, GQA 32/8), so the loop is
    host-bound; SDPA (cuDNN) is timed the same way for scale. The data checks are off
    (``options.check_data=False``, as in a serving loop: they synchronise). The GPU is
    synchronised at the end of each round. ``numasched bench host_overhead`` compares every public
    call with torch's equivalent.
    """
    import time

    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import numasched

    dev, dt = "cuda", torch.bfloat16
    B, H, HK, D, L, page = 1, 32, 8, 128, 1024, 16
    q = torch.randn(B, H, D, device=dev, dtype=dt)
    k = torch.randn(B, L, HK, D, device=dev, dtype=dt)
    v = torch.randn_like(k)
    lens = torch.full((B,), L, dtype=torch.int32, device=dev)
    bt = torch.arange(L // page, dtype=torch.int32, device=dev).view(1, -1)
    kp, vp = k.view(L // page, page, HK, D), v.view(L // page, page, HK, D)
    kb, vb, q4 = k.transpose(1, 2), v.transpose(1, 2), q.view(B, H, 1, D)

    def sdpa():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(q4, kb, vb, enable_gqa=True)

    cases = {
        "numasched contiguous, auto splits": lambda: numasched.flash_decode(q, k, v, cache_seqlens=lens),
        "numasched contiguous, 1 split": lambda: numasched.flash_decode(q, k, v, cache_seqlens=lens, num_splits=1),
        "numasched paged 16": lambda: numasched.flash_decode(q, kp, vp, cache_seqlens=lens, block_table=bt),
        "torch.ops.numasched.flash_decode": lambda: torch.ops.numasched.flash_decode(q, k, v, lens, None, None,
                                                                                     None, "auto"),
        "SDPA cuDNN (with sdpa_kernel context)": sdpa,
    }
    print(f"host time per eager call (GPU launches), best of 3 x {calls} calls:")
    with numasched.options.use(check_data=False):
        for name, fn in cases.items():
            for _ in range(20):
                fn()
            best = float("inf")
            for _ in range(3):
                torch.cuda.synchronize()
                t = time.perf_counter()
                for _ in range(calls):
                    fn()
                torch.cuda.synchronize()
                best = min(best, (time.perf_counter() - t) / calls * 1e6)
            print(f"  {name:40s} {best:8.1f} us/call", flush=True)
    return 0


def main(argv=None) -> int:
    args = _parse(argv)
    if args.dry_run:
        return _dry_run(args)
    from .common import check_runnable

    if (rc := check_runnable("decode")) is not None:
        return rc
    if args.host:
        return _host_overhead(args.calls)
    import numasched

    # the data checks synchronise; a serving loop turns them off too
    with numasched.options.use(check_data=False):
        if args.ragged:
            return _bench_ragged(args)
        return _bench_multi(args) if args.sq else _bench(args)


def _setup(args):
    """What every decode bench starts from: the GPU, bf16, its measured streaming read, its SM
    count, and FlashInfer (or why not)."""
    import torch

    from .common import stream_read_bw

    dev = torch.device("cuda")
    fi = (None, "disabled (--no-flashinfer)") if args.no_flashinfer else _flashinfer()
    return dev, torch.bfloat16, stream_read_bw(), torch.cuda.get_device_properties(dev).multi_processor_count, fi


def _paged_cache(B: int, L: int, page: int, HK: int, D: int, dev, dt):
    """Random K and V pages (pages, page, HK, D) for B sequences of L tokens (a partial last page),
    scattered by a random permutation: ``(k_pages, v_pages, block_table (B, ceil(L / page)))``."""
    import torch

    per_seq = -(-L // page)
    pages = B * per_seq
    kp = torch.randn(pages, page, HK, D, device=dev, dtype=dt)
    vp = torch.randn(pages, page, HK, D, device=dev, dtype=dt)
    return kp, vp, torch.randperm(pages, device=dev, dtype=torch.int32).view(B, per_seq)


def _first_sequence_error(out, q, kp, vp, bt, L: int) -> Optional[float]:
    """Max abs error of ``out[0]`` (H, D), a decode of the paged cache (kp, vp, block table bt)
    for q (B, H, D), against a float64 softmax attention over the first sequence's L tokens
    gathered from its pages; None if ``out`` is None (the call failed)."""
    import torch

    if out is None:
        return None
    page, HK, D = kp.shape[1:]
    G = q.shape[1] // HK   # query heads per KV head: head h reads KV head h // G
    rows = bt[0, :-(-L // page)].long()
    k = kp[rows].reshape(-1, HK, D)[:L].double()   # (L, HK, D), no copy per query head
    v = vp[rows].reshape(-1, HK, D)[:L].double()
    scores = torch.einsum("kgd,lkd->kgl", q[0].double().view(HK, G, D), k) / D ** 0.5
    ref = torch.einsum("kgl,lkd->kgd", scores.softmax(-1), v).reshape(HK * G, D)
    return (out[0].double() - ref).abs().max().item()


def _flashinfer_pages(bt, L: int, page: int):
    """FlashInfer's page table for ``bt`` (B, pages per sequence), every sequence L tokens:
    ``(indptr, indices, last_page_len)``."""
    import torch

    B, per_seq = bt.shape
    indptr = torch.arange(B + 1, device=bt.device, dtype=torch.int32) * per_seq
    last = torch.full((B,), L - (per_seq - 1) * page, dtype=torch.int32, device=bt.device)
    return indptr, bt.reshape(-1), last


def _flashinfer_decode(fi, args, q, kp, vp, indptr, indices, last, dims, notes, timer):
    """FlashInfer's paged decode on (kp, vp) with this page table, with and without tensor cores
    (``--flashinfer-both``; else the one its docs advise for the group size): (best eager time,
    best graph time, an output). ``timer(fn, name)`` -> (t, t_graph, out)."""
    import torch

    H, HK, D, page, dt, dev = dims
    ws = torch.empty(256 * 1024 * 1024, dtype=torch.uint8, device=dev)
    best = best_g = out = None
    for tc in ((False, True) if args.flashinfer_both else (H // HK >= 4,)):
        try:
            w = fi.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_tensor_cores=tc)
            w.plan(indptr, indices, last, H, HK, D, page, pos_encoding_mode="NONE", q_data_type=dt, kv_data_type=dt)
        except Exception as e:  # noqa: BLE001
            notes.append(f"flashinfer tc={tc} plan: {type(e).__name__}: {str(e)[:80]}")
            continue
        t, tg, o = timer(lambda: w.run(q, (kp, vp)), f"flashinfer tc={tc}")  # noqa: B023
        out = o if o is not None else out
        if t is not None and (best is None or t < best):
            best = t
        if tg is not None and (best_g is None or tg < best_g):
            best_g = tg
    return best, best_g, out


def _kv_bytes(hname: str, B: int, L: int) -> int:
    """K + V bytes of a bf16 cache of B sequences of L tokens with the head config's KV heads."""
    return 2 * B * L * HEADS[hname][1] * HEAD_DIM * 2


def _schedule(pts: List[tuple], max_gb: float) -> List[tuple]:
    """((heads, batch, ctx), warm) in the order run: the first point within ``max_gb`` GB of K+V
    once more at the start, as a warm-up whose rows are dropped. A run's first timed contender of
    ours read 6 % slower than the same plan later in the point (H200, three runs of the
    thirty-fifth session's sweeps: 21.3 against 20.1 us at 32/8 8 x 1k), and one grid point read
    0.92 of cuDNN where the run before had 1.007."""
    fits = [p for p in pts if _kv_bytes(*p) <= max_gb * 1e9]
    return ([(fits[0], True)] if fits else []) + [(p, False) for p in pts]


def _bench(args) -> int:
    import torch
    import torch.nn.functional as F

    import numasched
    from numasched.decode import choose_num_splits, stream_scale

    from .common import progress, write_results

    dev, dt, read_bw, sms, (fi, fi_err) = _setup(args)
    streams = stream_scale(dev)   # the split rule's, as DecodePlan takes it
    flex = None
    if not (args.no_flex or args.paged_only):
        from torch.nn.attention.flex_attention import flex_attention

        # one compile per shape: lift dynamo's recompile limits, or later shapes would silently
        # run flex_attention eagerly (much slower) and be reported as FlexAttention
        for name, value in (("recompile_limit", 1024), ("cache_size_limit", 1024),
                            ("accumulated_recompile_limit", 8192), ("accumulated_cache_size_limit", 8192)):
            if hasattr(torch._dynamo.config, name):
                setattr(torch._dynamo.config, name, value)
        flex = torch.compile(flex_attention, dynamic=False)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    rows: List[Dict] = []
    pts = _points(args)
    graph = not args.no_graph

    def timed(fn, notes, name):
        """(eager ms, graph ms, output): None where it cannot run / be captured. --no-eager: the
        call runs once unmeasured and the graph time stands for both (the eager columns are then
        written as skipped); one that cannot be captured is timed eagerly after all."""
        if args.no_eager:
            ran, out = _run(fn, notes, name)
            if not ran:
                return None, None, None
            tg = _graph_ms(fn, args.timing, notes, name)
            return (tg if tg is not None else _time(fn, args.timing)), tg, out
        t, out = _try(fn, args.timing, notes, name)
        tg = _graph_ms(fn, args.timing, notes, name) if (graph and t is not None) else None
        return t, tg, out

    for (hname, B, L), warm in progress(_schedule(pts, args.max_gb), description="decode"):
        first_row = len(rows)
        H, HK = HEADS[hname]
        D = HEAD_DIM
        kv_bytes = _kv_bytes(hname, B, L)
        base = dict(heads=f"{H}/{HK}", batch=B, ctx=L, kv_GB=round(kv_bytes / 1e9, 3))
        if kv_bytes > args.max_gb * 1e9:
            if not warm:
                rows.append(dict(base, layout="-", note=f"skipped: K+V {kv_bytes / 1e9:.1f} GB > --max-gb"))
            continue
        nbytes = kv_bytes + 2 * B * H * D * 2
        splits = choose_num_splits(B, HK, L, sms, stream_scale=streams)
        q = torch.randn(B, H, D, device=dev, dtype=dt)
        q4 = q.view(B, H, 1, D)
        lens = torch.full((B,), L, dtype=torch.int32, device=dev)
        peers: Dict[str, Optional[float]] = {}  # eager ms
        peers_graph: Dict[str, Optional[float]] = {}  # graph-replay ms
        notes: List[str] = []
        ours: Dict[str, Dict[str, Optional[float]]] = {}

        def run_ours(layout, k, v, bt=None):
            # the default ("auto") combine, then the mode auto did not pick (with one split there
            # is no combine); plans are cached with the options in their key: each mode gets its own
            res = {}
            out = None
            with numasched.options.use(decode_combine="auto"):
                plan = numasched.plan_decode(q, k, v, cache_seqlens=lens, block_table=bt, mapping=args.mapping,
                                             prefetch=args.prefetch)
            picked = plan.combine
            res["combine"], res["splits"] = picked, plan.num_splits
            # --paged-only: the default combine alone (the target's row)
            modes = ["auto"] + ([] if args.paged_only else {"fused": ["kernel"], "kernel": ["fused"]}.get(picked, []))
            for combine in modes:
                with numasched.options.use(decode_combine=combine):
                    fn = lambda: numasched.flash_decode(q, k, v, cache_seqlens=lens, block_table=bt,  # noqa: E731
                                                        mapping=args.mapping, prefetch=args.prefetch)
                    t, tg, o = timed(fn, notes, f"numasched {layout} {combine}")
                for name in ((combine,) if combine != "auto" else ("auto", picked)):
                    res[name], res[f"{name}_graph"] = t, tg
                out = o if out is None else out
            ours[layout] = res
            for s in args.sweep_splits or ():
                fn = lambda: numasched.flash_decode(q, k, v, cache_seqlens=lens, block_table=bt,  # noqa: E731
                                                    num_splits=s, mapping=args.mapping, prefetch=args.prefetch)
                t, tg, _ = timed(fn, notes, f"numasched {layout} S={s}")
                with numasched.options.use(decode_combine="auto"):
                    comb = numasched.plan_decode(q, k, v, cache_seqlens=lens, block_table=bt, num_splits=s,
                                                 mapping=args.mapping).combine
                ours[f"{layout} S={s}"] = {"auto": t, "auto_graph": tg, "splits": s, "combine": comb}
            for name, value in args.variant:
                with numasched.options.use(**{name: value}):
                    fn = lambda: numasched.flash_decode(q, k, v, cache_seqlens=lens, block_table=bt,  # noqa: E731
                                                        mapping=args.mapping, prefetch=args.prefetch)
                    t, tg, o = timed(fn, notes, f"numasched {layout} {name}={value}")
                    vplan = numasched.plan_decode(q, k, v, cache_seqlens=lens, block_table=bt, mapping=args.mapping,
                                                  prefetch=args.prefetch)
                if (o is not None and out is not None
                        and not torch.allclose(o.float(), out.float(), atol=2e-2, rtol=2e-2)):
                    notes.append(f"{name}={value}: output differs from the default's by "
                                 f"{(o.float() - out.float()).abs().max().item():.3g}")
                ours[f"{layout} [{name}={value}]"] = {"auto": t, "auto_graph": tg, "splits": vplan.num_splits,
                                                      "combine": vplan.combine}
            return out

        err = None   # the contiguous SDPA check (--paged-only: each paged layout's own, errs)
        errs: Dict[str, Optional[float]] = {}
        if not args.paged_only:
            # -- contiguous (B, HK, L, D): the peers' layout; ours on its transpose view
            kb = torch.randn(B, HK, L, D, device=dev, dtype=dt)
            vb = torch.randn(B, HK, L, D, device=dev, dtype=dt)
            ref = None
            gqa = H != HK
            for be in SDPA_BACKENDS:
                name = f"sdpa_{be.split('_')[0].lower()}"

                def fn(be=be):
                    with sdpa_kernel(getattr(SDPBackend, be)):
                        return F.scaled_dot_product_attention(q4, kb, vb, enable_gqa=gqa)

                peers[name], peers_graph[name], out = timed(fn, notes, f"SDPA {be}")
                if ref is None and out is not None:
                    ref = out.view(B, H, D).float()
            if flex is not None:
                peers["flex"], peers_graph["flex"], _ = timed(lambda: flex(q4, kb, vb, enable_gqa=gqa), notes, "flex")
            out = run_ours("contiguous (BHLD view)", kb.transpose(1, 2), vb.transpose(1, 2))
            err = (out.float() - ref).abs().max().item() if (out is not None and ref is not None) else None
            del kb, vb
            torch.cuda.empty_cache()

            # -- contiguous (B, L, HK, D): the native layout
            kn = torch.randn(B, L, HK, D, device=dev, dtype=dt)
            vn = torch.randn(B, L, HK, D, device=dev, dtype=dt)
            run_ours("contiguous (BLHD)", kn, vn)
            del kn, vn
            torch.cuda.empty_cache()
        # -- paged: pages scattered by a random permutation (a context shorter than a page: one page)
        fi_pages: Dict[int, tuple] = {}  # page size -> FlashInfer's (eager ms, graph ms)
        for page in args.pages:
            kp, vp, bt = _paged_cache(B, L, page, HK, D, dev, dt)
            out = run_ours(f"paged {page}", kp, vp, bt)
            if args.paged_only:
                errs[f"paged {page}"] = _first_sequence_error(out, q, kp, vp, bt, L)
            if fi is not None:
                fi_pages[page] = _flashinfer_decode(
                    fi, args, q, kp, vp, *_flashinfer_pages(bt, L, page), (H, HK, D, page, dt, dev), notes,
                    lambda fn, name: timed(fn, notes, name))[:2]
            del kp, vp, bt
            torch.cuda.empty_cache()
        if fi is None:
            notes.append(f"flashinfer skipped: {fi_err}")

        # -- rows: a peer that cannot be captured counts with its eager time; FlashInfer is the
        # one of the row's page size (contiguous rows: of the first page size)
        for layout, res in ours.items():
            page = int(layout.split()[1]) if layout.startswith("paged") else (args.pages or [None])[0]
            if fi is not None:
                peers["flashinfer"], peers_graph["flashinfer"] = fi_pages.get(page, (None, None))
            got = {k: v for k, v in peers.items() if v is not None}
            got_g = {k: (peers_graph.get(k) or v) for k, v in got.items()}
            best_name = min(got_g, key=got_g.get) if got_g else None
            best_eager = min(got, key=got.get) if got else None
            t = res.get("auto")  # the default ("auto") combine
            tg = res.get("auto_graph")
            tk = res.get("kernel")
            t_eff = tg or t
            row = dict(base, layout=layout, splits=res.get("splits", splits), combine=res.get("combine"))
            row["ours_us"] = t * 1e3 if t else None
            row["ours_graph_us"] = tg * 1e3 if tg else ("n/a" if t else None)
            row["ours_kernel_combine_us"] = tk * 1e3 if tk else None
            row["ours_kernel_combine_graph_us"] = res["kernel_graph"] * 1e3 if res.get("kernel_graph") else None
            row["ours_fused_combine_us"] = res["fused"] * 1e3 if res.get("fused") else None
            row["ours_fused_combine_graph_us"] = res["fused_graph"] * 1e3 if res.get("fused_graph") else None
            row["ours_TBps"] = nbytes / (t_eff * 1e-3) / 1e12 if t_eff else None
            row["frac_stream_read"] = nbytes / (t_eff * 1e-3) / read_bw if t_eff else None
            row["best_peer"] = best_name
            row["best_peer_us"] = got_g[best_name] * 1e3 if best_name else None
            row["ratio_vs_best_peer"] = got_g[best_name] / t_eff if (best_name and t_eff) else None
            row["ratio_eager"] = got[best_eager] / t if (best_eager and t) else None
            for name in ("sdpa_flash", "sdpa_efficient", "sdpa_cudnn", "flex", "flashinfer"):
                v = peers.get(name, "skipped")
                row[f"{name}_us"] = "n/a" if v is None else (v * 1e3 if isinstance(v, float) else v)
                vg = peers_graph.get(name, "skipped")
                row[f"{name}_graph_us"] = "n/a" if vg is None else (vg * 1e3 if isinstance(vg, float) else vg)
            for name, v in got_g.items():
                row[f"{name}_TBps"] = nbytes / (v * 1e-3) / 1e12
            row["max_abs_err_vs_sdpa"] = errs.get(layout, err)
            row["note"] = "; ".join(notes)
            if args.no_eager:   # the graph time stood in for the eager one: not a measurement of it
                row["ratio_eager"] = None
                # (only where a graph time stood in: a contender that could not be captured keeps
                # the eager time it was measured at, which its ratios then use)
                for key in EAGER_COLUMNS:
                    if isinstance(row.get(key), float) and isinstance(row.get(key[:-3] + "_graph_us"), float):
                        row[key] = "skipped (--no-eager)"
            rows.append(row)
            if not warm:
                print(_line(row), flush=True)
        if warm:
            del rows[first_row:]
            continue
        _write_partial(rows, args.out_dir)

    write_results("decode", rows, columns=COLUMNS, plot=_plot, out_dir=args.out_dir,
                  meta=dict(stream_read_TBps=read_bw / 1e12, mapping=args.mapping, quick=args.quick,
                            graph=graph, flush=args.flush, paged_only=args.paged_only, no_eager=args.no_eager,
                            flashinfer=(getattr(fi, "__version__", "?") if fi else fi_err)))
    print(f"streaming read: {read_bw / 1e12:.2f} TB/s; ratio_vs_best_peer > 1 means numasched is faster "
          f"(CUDA-graph times; ratio_eager: eager calls). "
          f"Targets: ratio >= 1 everywhere (paged: against FlashInfer), frac_stream_read >= {STREAM_TARGET} at "
          f"batch x ctx >= {STREAM_MIN_TOKENS // 1024}k.")
    for line in summary(rows):
        print(line)
    return 0


def _timed(fn: Callable, notes: List[str], name: str, timing: Timing, graph: bool):
    """(eager ms, graph ms, output): None where it cannot run / be captured."""
    t, out = _try(fn, timing, notes, name)
    tg = _graph_ms(fn, timing, notes, name) if (graph and t is not None) else None
    return t, tg, out


MULTI_PEERS = ("sdpa_lr_flash", "sdpa_lr_efficient", "sdpa_lr_cudnn", "sdpa_mask", "flashinfer")


def _bench_multi(args) -> int:
    """Multi-token decode (--sq): numasched vs SDPA (bottom-right causal) and FlashInfer's paged prefill."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import numasched
    from numasched.decode import choose_num_splits, stream_scale
    from numasched.kernels.flash_decode import row_tiling

    from .common import progress, write_results

    try:
        from torch.nn.attention.bias import causal_lower_right
    except ImportError:  # older torch: the boolean mask peer remains
        causal_lower_right = None
    dev, dt, read_bw, sms, (fi, fi_err) = _setup(args)
    streams = stream_scale(dev)   # the split rule's, as DecodePlan takes it
    graph = not args.no_graph
    rows: List[Dict] = []

    for hname, B, L in progress(_points(args), description="decode --sq"):
        H, HK = HEADS[hname]
        D = HEAD_DIM
        gqa = H != HK
        kv_bytes = 2 * B * L * HK * D * 2
        base = dict(heads=f"{H}/{HK}", batch=B, ctx=L, kv_GB=round(kv_bytes / 1e9, 3))
        if kv_bytes > args.max_gb * 1e9:
            rows.append(dict(base, layout="-", note=f"skipped: K+V {kv_bytes / 1e9:.1f} GB > --max-gb"))
            continue
        lens = torch.full((B,), L, dtype=torch.int32, device=dev)
        qs = {sq: torch.randn(B, sq, H, D, device=dev, dtype=dt) for sq in args.sq}
        peers = {sq: {} for sq in args.sq}  # name -> eager ms
        peers_graph = {sq: {} for sq in args.sq}
        ours = {sq: {} for sq in args.sq}  # layout -> (eager ms, graph ms)
        notes = {sq: [] for sq in args.sq}
        err = {}

        def run_ours(sq, layout, k, v, bt=None):
            q = qs[sq]
            fn = lambda: numasched.flash_decode(q, k, v, cache_seqlens=lens, block_table=bt,  # noqa: E731
                                                mapping=args.mapping)
            t, tg, out = _timed(fn, notes[sq], f"numasched {layout}", args.timing, graph)
            ours[sq][layout] = (t, tg)
            return out

        # -- contiguous (B, HK, L, D): SDPA's layout (HF's cache); ours on its transpose view
        kb = torch.randn(B, HK, L, D, device=dev, dtype=dt)
        vb = torch.randn(B, HK, L, D, device=dev, dtype=dt)
        for sq in args.sq:
            q_bhsd = qs[sq].transpose(1, 2)  # (B, H, sq, D) view
            ref = None
            if causal_lower_right is not None:
                bias = causal_lower_right(sq, L)
                for be in SDPA_BACKENDS:
                    name = f"sdpa_lr_{be.split('_')[0].lower()}"

                    def fn(be=be, q_bhsd=q_bhsd, bias=bias):
                        with sdpa_kernel(getattr(SDPBackend, be)):
                            return F.scaled_dot_product_attention(q_bhsd, kb, vb, attn_mask=bias, enable_gqa=gqa)

                    peers[sq][name], peers_graph[sq][name], out = _timed(fn, notes[sq], f"SDPA lower-right {be}",
                                                                         args.timing, graph)
                    if ref is None and out is not None:
                        ref = out.transpose(1, 2).float()
            mask = (torch.arange(L, device=dev)[None, :] <= torch.arange(sq, device=dev)[:, None] + (L - sq))
            fn = lambda q_bhsd=q_bhsd, mask=mask: F.scaled_dot_product_attention(  # noqa: E731
                q_bhsd, kb, vb, attn_mask=mask, enable_gqa=gqa)
            peers[sq]["sdpa_mask"], peers_graph[sq]["sdpa_mask"], out = _timed(fn, notes[sq], "SDPA bool mask",
                                                                               args.timing, graph)
            if ref is None and out is not None:
                ref = out.transpose(1, 2).float()
            out = run_ours(sq, "contiguous (BHLD view)", kb.transpose(1, 2), vb.transpose(1, 2))
            err[sq] = (out.float() - ref).abs().max().item() if (out is not None and ref is not None) else None
        del kb, vb
        torch.cuda.empty_cache()

        # -- paged: pages scattered by a random permutation; FlashInfer's paged prefill beside ours
        for page in args.pages:
            kp, vp, bt = _paged_cache(B, L, page, HK, D, dev, dt)
            for sq in args.sq:
                run_ours(sq, f"paged {page}", kp, vp, bt)
                if fi is None:
                    continue
                ws = torch.empty(256 * 1024 * 1024, dtype=torch.uint8, device=dev)
                try:
                    w = fi.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD")
                    w.plan(torch.arange(B + 1, device=dev, dtype=torch.int32) * sq, *_flashinfer_pages(bt, L, page),
                           H, HK, D, page, causal=True, q_data_type=dt, kv_data_type=dt)
                except Exception as e:  # noqa: BLE001
                    notes[sq].append(f"flashinfer prefill page {page} plan: {type(e).__name__}: {str(e)[:80]}")
                    continue
                qf = qs[sq].reshape(B * sq, H, D)
                t, tg, _ = _timed(lambda: w.run(qf, (kp, vp)), notes[sq],  # noqa: B023
                                  f"flashinfer page {page}", args.timing, graph)
                peers[sq][f"flashinfer_{page}"], peers_graph[sq][f"flashinfer_{page}"] = t, tg
                del ws
            del kp, vp, bt
            torch.cuda.empty_cache()
        if fi is None:
            for sq in args.sq:
                notes[sq].append(f"flashinfer skipped: {fi_err}")

        # -- rows: per q_len and layout; the best peer at this point and q_len in any layout
        for sq in args.sq:
            nbytes = kv_bytes + 2 * B * sq * H * D * 2
            got = {k: v for k, v in peers[sq].items() if v is not None}
            got_g = {k: (peers_graph[sq].get(k) or v) for k, v in got.items()}
            best_name = min(got_g, key=got_g.get) if got_g else None
            best_eager = min(got, key=got.get) if got else None
            _, groups = row_tiling(sq, H // HK)
            for layout, (t, tg) in ours[sq].items():
                t_eff = tg or t
                row = dict(base, q_len=sq, layout=layout, row_groups=groups,
                           splits=choose_num_splits(B, HK * groups, L, sms, paged="paged" in layout,
                                                    stream_scale=streams))
                row["ours_us"] = t * 1e3 if t else None
                row["ours_graph_us"] = tg * 1e3 if tg else ("n/a" if t else None)
                row["ours_TBps"] = nbytes / (t_eff * 1e-3) / 1e12 if t_eff else None
                row["frac_stream_read"] = nbytes / (t_eff * 1e-3) / read_bw if t_eff else None
                row["best_peer"] = best_name
                row["best_peer_us"] = got_g[best_name] * 1e3 if best_name else None
                row["ratio_vs_best_peer"] = got_g[best_name] / t_eff if (best_name and t_eff) else None
                row["ratio_eager"] = got[best_eager] / t if (best_eager and t) else None
                page = layout.split()[-1] if layout.startswith("paged") else None
                for name in MULTI_PEERS:
                    key = f"flashinfer_{page}" if name == "flashinfer" else name
                    if name == "flashinfer" and page is None:
                        row["flashinfer_us"] = row["flashinfer_graph_us"] = "-"
                        continue
                    v = peers[sq].get(key, "skipped")
                    row[f"{name}_us"] = "n/a" if v is None else (v * 1e3 if isinstance(v, float) else v)
                    vg = peers_graph[sq].get(key, "skipped")
                    row[f"{name}_graph_us"] = "n/a" if vg is None else (vg * 1e3 if isinstance(vg, float) else vg)
                row["max_abs_err_vs_sdpa"] = err.get(sq)
                row["note"] = "; ".join(notes[sq])
                rows.append(row)
                print(_line_multi(row), flush=True)
        _write_partial(rows, args.out_dir, "decode_multi", MULTI_COLUMNS)

    write_results("decode_multi", rows, columns=MULTI_COLUMNS, out_dir=args.out_dir,
                  meta=dict(stream_read_TBps=read_bw / 1e12, mapping=args.mapping, quick=args.quick, graph=graph,
                            flush=args.flush, q_lens=args.sq, pages=args.pages,
                            flashinfer=(getattr(fi, "__version__", "?") if fi else fi_err),
                            sdpa_lower_right=causal_lower_right is not None))
    print(f"streaming read: {read_bw / 1e12:.2f} TB/s; ratio_vs_best_peer > 1 means numasched is faster "
          f"(CUDA-graph times; ratio_eager: eager calls); peers: SDPA with a bottom-right causal mask on the "
          f"contiguous cache, FlashInfer's paged prefill (causal) at each page size.")
    return 0


RAGGED_COLUMNS = ["heads", "batch", "ctx", "len_min", "len_mean", "useful_GB", "layout", "splits", "schedule", "items",
                  "programs", "balance", "static_us", "static_graph_us", "worklist_us", "worklist_graph_us",
                  "worklist_vs_static", "best_peer", "best_peer_us", "ratio_vs_best_peer", "ratio_eager", "frac_stream_read",
                  "static_frac_stream_read", "flashinfer_us", "flashinfer_graph_us", "sdpa_mask_us", "sdpa_mask_graph_us",
                  "max_abs_err_vs_static", "max_abs_err_vs_peer", "note"]


def _worklist_config(text: str) -> dict:
    """--worklist-config BN/W/ST -> the kernel config dict."""
    from numasched.decode_worklist import GRANULE

    try:
        bn, w, st = (int(x) for x in text.split("/"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"a config is BLOCK_N/num_warps/num_stages, e.g. 64/2/5; got {text!r}")
    if min(bn, w, st) < 1 or bn & (bn - 1) or GRANULE % bn or w & (w - 1):
        raise argparse.ArgumentTypeError(f"{text!r}: BLOCK_N must be a power of two dividing {GRANULE}, num_warps a "
                                         f"power of two and num_stages >= 1")
    return dict(BLOCK_N=bn, num_warps=w, num_stages=st)


def _bench_ragged(args) -> int:
    """--ragged: the split kernel, the work-list plan, FlashInfer and SDPA on ragged batches."""
    import torch
    import torch.nn.functional as F

    import numasched
    from numasched.decode import choose_num_splits, stream_scale

    from .common import progress, write_results

    dev, dt, read_bw, sms, (fi, fi_err) = _setup(args)
    streams = stream_scale(dev)   # the split rule's, as DecodePlan takes it
    graph = not args.no_graph
    rows: List[Dict] = []
    wl_config = args.worklist_config

    for hname, B, L in progress(_points(args), description="decode --ragged"):
        H, HK = HEADS[hname]
        D = HEAD_DIM
        lens_np = ragged_lengths(B, L, args.seed, args.ragged_min)
        useful = 2 * int(lens_np.sum()) * HK * D * 2
        nbytes = useful + 2 * B * H * D * 2
        base = dict(heads=f"{H}/{HK}", batch=B, ctx=L, len_min=int(lens_np.min()), len_mean=round(float(lens_np.mean())),
                    useful_GB=round(useful / 1e9, 3),
                    splits=choose_num_splits(B, HK, L, sms, stream_scale=streams))
        if 2 * B * L * HK * D * 2 > args.max_gb * 1e9:
            rows.append(dict(base, layout="-", note="skipped: padded K+V > --max-gb"))
            continue
        lens = torch.tensor(lens_np, dtype=torch.int32, device=dev)
        q = torch.randn(B, H, D, device=dev, dtype=dt)
        notes: List[str] = []
        peers: Dict[str, Optional[float]] = {}
        peers_graph: Dict[str, Optional[float]] = {}
        ours: Dict[str, Dict] = {}
        ref = {}

        def run_both(layout, k, v, bt=None):
            res = {}
            fn = lambda: numasched.flash_decode(q, k, v, cache_seqlens=lens, block_table=bt)  # noqa: E731
            res["static"], res["static_graph"], o_static = _timed(fn, notes, f"static {layout}", args.timing, graph)
            plan = numasched.plan_decode_worklist(q, k, v, lengths=lens_np, cache_seqlens=lens, block_table=bt,
                                                  num_programs=args.programs, config=wl_config)
            fn = lambda: plan.run(q, k, v, lens, bt)  # noqa: E731
            res["worklist"], res["worklist_graph"], o_wl = _timed(fn, notes, f"worklist {layout}", args.timing, graph)
            # schedule: what the "worklist" columns timed (the plan's choice; "split": the split kernel)
            res.update(items=plan.num_items, programs=plan.num_programs, balance=round(plan.balance, 4),
                       schedule=plan.schedule)
            if o_static is not None and o_wl is not None:
                res["err_static"] = (o_wl.float() - o_static.float()).abs().max().item()
            ours[layout] = res
            return o_wl

        # -- paged, page 16: each sequence its own pages (ceil(len / 16)), scattered; -1 past them
        per_seq = (lens_np + PAGE - 1) // PAGE
        n_pages = int(per_seq.sum())
        kp = torch.randn(n_pages, PAGE, HK, D, device=dev, dtype=dt)
        vp = torch.randn(n_pages, PAGE, HK, D, device=dev, dtype=dt)
        perm = torch.randperm(n_pages, device=dev, dtype=torch.int32)
        max_pages = -(-L // PAGE)
        bt = torch.full((B, max_pages), -1, dtype=torch.int32, device=dev)
        indptr = [0]
        for b in range(B):
            n_b = int(per_seq[b])
            bt[b, :n_b] = perm[indptr[-1]: indptr[-1] + n_b]
            indptr.append(indptr[-1] + n_b)
        out_paged = run_both(f"paged {PAGE}", kp, vp, bt)
        if fi is not None:
            ip = torch.tensor(indptr, dtype=torch.int32, device=dev)
            indices = torch.cat([bt[b, : int(per_seq[b])] for b in range(B)])
            last = torch.tensor(lens_np - (per_seq - 1) * PAGE, dtype=torch.int32, device=dev)
            peers["flashinfer"], peers_graph["flashinfer"], o = _flashinfer_decode(
                fi, args, q, kp, vp, ip, indices, last, (H, HK, D, PAGE, dt, dev), notes,
                lambda fn, name: _timed(fn, notes, name, args.timing, graph))
            if o is not None and out_paged is not None:
                ref["flashinfer"] = (out_paged.float() - o.float()).abs().max().item()
        else:
            notes.append(f"flashinfer skipped: {fi_err}")
        del kp, vp, bt
        torch.cuda.empty_cache()

        # -- contiguous (B, L, HK, D) with cache_seqlens; SDPA on the (B, HK, L, D) view with a length mask
        kn = torch.randn(B, L, HK, D, device=dev, dtype=dt)
        vn = torch.randn(B, L, HK, D, device=dev, dtype=dt)
        out_contig = run_both("contiguous (BLHD)", kn, vn)
        kb, vb = kn.transpose(1, 2), vn.transpose(1, 2)  # views, as SDPA users would pass them
        mask = (torch.arange(L, device=dev)[None, :] < lens[:, None])[:, None, None, :]
        fn = lambda: F.scaled_dot_product_attention(q.view(B, H, 1, D), kb, vb, attn_mask=mask,  # noqa: E731
                                                    enable_gqa=H != HK)
        peers["sdpa_mask"], peers_graph["sdpa_mask"], o = _timed(fn, notes, "SDPA length mask", args.timing, graph)
        if o is not None and out_contig is not None:
            ref["sdpa_mask"] = (out_contig.float() - o.view(B, H, D).float()).abs().max().item()
        del kn, vn, kb, vb
        torch.cuda.empty_cache()

        got = {k: v for k, v in peers.items() if v is not None}
        # the best peer among like-for-like ones (SDPA's length mask reads the padding: only when
        # nothing else ran)
        fair = {k: v for k, v in got.items() if k != "sdpa_mask"} or got
        got_g = {k: (peers_graph.get(k) or v) for k, v in fair.items()}
        best_name = min(got_g, key=got_g.get) if got_g else None
        best_eager = min(fair, key=fair.get) if fair else None
        for layout, res in ours.items():
            t, tg = res.get("worklist"), res.get("worklist_graph")
            ts, tsg = res.get("static"), res.get("static_graph")
            t_eff, ts_eff = tg or t, tsg or ts
            row = dict(base, layout=layout, schedule=res.get("schedule"), items=res.get("items"),
                       programs=res.get("programs"), balance=res.get("balance"),
                       splits=choose_num_splits(B, HK, L, sms, paged=layout.startswith("paged"),
                                                stream_scale=streams))
            row["static_us"] = ts * 1e3 if ts else None
            row["static_graph_us"] = tsg * 1e3 if tsg else ("n/a" if ts else None)
            row["worklist_us"] = t * 1e3 if t else None
            row["worklist_graph_us"] = tg * 1e3 if tg else ("n/a" if t else None)
            row["worklist_vs_static"] = ts_eff / t_eff if (t_eff and ts_eff) else None
            row["best_peer"] = best_name
            row["best_peer_us"] = got_g[best_name] * 1e3 if best_name else None
            row["ratio_vs_best_peer"] = got_g[best_name] / t_eff if (best_name and t_eff) else None
            row["ratio_eager"] = got[best_eager] / t if (best_eager and t) else None
            row["frac_stream_read"] = nbytes / (t_eff * 1e-3) / read_bw if t_eff else None
            row["static_frac_stream_read"] = nbytes / (ts_eff * 1e-3) / read_bw if ts_eff else None
            for name in ("flashinfer", "sdpa_mask"):
                v = peers.get(name, "skipped")
                row[f"{name}_us"] = "n/a" if v is None else (v * 1e3 if isinstance(v, float) else v)
                vg = peers_graph.get(name, "skipped")
                row[f"{name}_graph_us"] = "n/a" if vg is None else (vg * 1e3 if isinstance(vg, float) else vg)
            row["max_abs_err_vs_static"] = res.get("err_static")
            row["max_abs_err_vs_peer"] = ref.get("flashinfer" if layout.startswith("paged") else "sdpa_mask")
            row["note"] = "; ".join(notes)
            rows.append(row)
            print(_line_ragged(row), flush=True)
        _write_partial(rows, args.out_dir, "decode_ragged", RAGGED_COLUMNS)

    write_results("decode_ragged", rows, columns=RAGGED_COLUMNS, out_dir=args.out_dir,
                  meta=dict(stream_read_TBps=read_bw / 1e12, quick=args.quick, graph=graph, flush=args.flush,
                            seed=args.seed, ragged_min=args.ragged_min, programs=args.programs,
                            flashinfer=(getattr(fi, "__version__", "?") if fi else fi_err)))
    print(f"streaming read: {read_bw / 1e12:.2f} TB/s; ratio_vs_best_peer > 1 means the work list is faster than the "
          f"best peer (CUDA-graph times); frac_stream_read on the useful bytes (valid tokens' K and V, q, out). "
          f"Targets: ratio >= 1 vs FlashInfer, frac_stream_read >= 0.9 where useful_GB >= 1.")
    return 0


def _line_ragged(row: Dict) -> str:
    return (f"[decode --ragged] {row['heads']} B={row['batch']} ctx={row['ctx']} {row['layout']}: static graph "
            f"{_fmt(row['static_graph_us'])} us, work list graph {_fmt(row['worklist_graph_us'])} us "
            f"({_fmt(row['worklist_vs_static'])}x); best peer {row['best_peer']} {_fmt(row['best_peer_us'])} us, ratio "
            f"{_fmt(row['ratio_vs_best_peer'])}; {_fmt(row['frac_stream_read'])} of stream read on "
            f"{row['useful_GB']} GB")


MULTI_COLUMNS = ["heads", "batch", "ctx", "q_len", "kv_GB", "layout", "splits", "row_groups", "ours_us",
                 "ours_graph_us", "ours_TBps", "frac_stream_read", "best_peer", "best_peer_us", "ratio_vs_best_peer",
                 "ratio_eager"] + [f"{n}_{s}" for n in MULTI_PEERS for s in ("us", "graph_us")] + [
                 "max_abs_err_vs_sdpa", "note"]


def _line_multi(row: Dict) -> str:
    return (f"[decode --sq] {row['heads']} B={row['batch']} ctx={row['ctx']} q_len={row['q_len']} {row['layout']} "
            f"S={row['splits']}: ours eager {_fmt(row['ours_us'])} us, graph {_fmt(row['ours_graph_us'])} us; best "
            f"peer {row['best_peer']} {_fmt(row['best_peer_us'])} us; ratio graph {_fmt(row['ratio_vs_best_peer'])} "
            f"eager {_fmt(row['ratio_eager'])}; {_fmt(row['frac_stream_read'])} of stream read")


COLUMNS = ["heads", "batch", "ctx", "kv_GB", "layout", "splits", "combine", "ours_us", "ours_graph_us",
           "ours_kernel_combine_us", "ours_kernel_combine_graph_us", "ours_fused_combine_us",
           "ours_fused_combine_graph_us", "ours_TBps", "frac_stream_read", "best_peer", "best_peer_us",
           "ratio_vs_best_peer", "ratio_eager", "sdpa_flash_us", "sdpa_flash_graph_us", "sdpa_efficient_us",
           "sdpa_efficient_graph_us", "sdpa_cudnn_us", "sdpa_cudnn_graph_us", "flex_us", "flex_graph_us",
           "flashinfer_us", "flashinfer_graph_us", "max_abs_err_vs_sdpa", "note"]


# the single-token grid's eager times (--no-eager writes them as skipped)
EAGER_COLUMNS = ("ours_us", "ours_kernel_combine_us", "ours_fused_combine_us", "sdpa_flash_us", "sdpa_efficient_us",
                 "sdpa_cudnn_us", "flex_us", "flashinfer_us")


def _ratio_vs_target(row: Dict) -> Optional[float]:
    """The row's ratio for the issue's target: a paged row against FlashInfer (the same pages),
    a contiguous row against the best peer; None where that peer has no time."""
    if str(row.get("layout", "")).startswith("paged"):
        fi, ours = row.get("flashinfer_graph_us"), row.get("ours_graph_us")
        # a contender that did not run holds a note ("n/a"; "skipped" with --no-flashinfer), not a time
        return fi / ours if isinstance(fi, (int, float)) and isinstance(ours, (int, float)) and fi and ours else None
    x = row.get("ratio_vs_best_peer")
    return x if isinstance(x, (int, float)) else None


def summary(rows: List[Dict]) -> List[str]:
    """One line per layout kind (contiguous, paged P) of a grid run: the geometric mean of the
    target ratio, the points at >= 1.00 and >= 0.99, the worst point, and the points of at least
    STREAM_MIN_TOKENS tokens at >= STREAM_TARGET of the streaming read (the issue's figures)."""
    groups: Dict[str, List[Dict]] = {}
    for r in rows:
        layout = str(r.get("layout", ""))
        groups.setdefault("contiguous" if layout.startswith("contiguous") else layout, []).append(r)
    out = []
    for name, rs in groups.items():
        scored = [(x, r) for r in rs for x in [_ratio_vs_target(r)] if x]
        if not scored:
            continue
        xs = [x for x, _ in scored]
        worst, wr = min(scored, key=lambda t: t[0])
        big = [r["frac_stream_read"] for r in rs if r.get("frac_stream_read") is not None
               and r["batch"] * r["ctx"] >= STREAM_MIN_TOKENS]
        peer = "FlashInfer" if name.startswith("paged") else "the best peer"
        line = (f"{name} against {peer}: geomean {math.exp(sum(map(math.log, xs)) / len(xs)):.3f}, "
                f">= 1.00 at {sum(x >= 1 for x in xs)}/{len(xs)}, >= 0.99 at {sum(x >= 0.99 for x in xs)}, "
                f"worst {worst:.3f} ({wr['heads']} {wr['batch']} x {wr['ctx']} {wr['layout']})")
        if big:
            line += (f"; >= {STREAM_TARGET} of the streaming read at {sum(f >= STREAM_TARGET for f in big)}/{len(big)}"
                     f" points of >= {STREAM_MIN_TOKENS // 1024}k tokens (min {min(big):.3f})")
        out.append(line)
    return out


def _fmt(v) -> str:
    return f"{v:.4g}" if isinstance(v, float) else ("-" if v is None else str(v))


def _line(row: Dict) -> str:
    """One progress line per finished row (a run killed at its time limit still shows these)."""
    return (f"[decode] {row['heads']} B={row['batch']} ctx={row['ctx']} {row['layout']} S={row['splits']}: "
            f"ours eager {_fmt(row['ours_us'])} us, graph {_fmt(row['ours_graph_us'])} us; best peer "
            f"{row['best_peer']} {_fmt(row['best_peer_us'])} us; ratio graph {_fmt(row['ratio_vs_best_peer'])} "
            f"eager {_fmt(row['ratio_eager'])}; {_fmt(row['frac_stream_read'])} of stream read")


def _write_partial(rows: List[Dict], out_dir, suite: str = "decode", columns: Optional[List[str]] = None) -> None:
    """Rewrite the CSV of the rows so far (<suite>-<device>-<date>.partial.csv) after every point."""
    import csv

    from .common import device_slug, env_info, results_dir

    d = results_dir(out_dir)
    d.mkdir(parents=True, exist_ok=True)
    path = d / f"{suite}-{device_slug()}-{env_info()['date'][:10]}.partial.csv"
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=columns or COLUMNS, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)


def _plot(rows, path):
    import matplotlib.pyplot as plt
    from .common import save_plot

    heads = sorted({r["heads"] for r in rows if r.get("ours_TBps")})
    fig, axes = plt.subplots(1, max(1, len(heads)), figsize=(7 * max(1, len(heads)), 4.5), squeeze=False)
    for ax, h in zip(axes[0], heads):
        rs = [r for r in rows if r["heads"] == h and r.get("ours_TBps")]
        pts = sorted({(r["batch"], r["ctx"]) for r in rs}, key=lambda p: (p[0] * p[1], p))
        x = list(range(len(pts)))
        for layout in sorted({r["layout"] for r in rs if "S=" not in r["layout"]}):
            y = [next((r["ours_TBps"] for r in rs if (r["batch"], r["ctx"]) == p and r["layout"] == layout),
                      math.nan) for p in pts]
            ax.plot(x, y, "o-", label=f"numasched {layout}")
        for peer in ("sdpa_flash", "sdpa_cudnn", "sdpa_efficient", "flex", "flashinfer"):
            y = [next((r.get(f"{peer}_TBps", math.nan) for r in rs if (r["batch"], r["ctx"]) == p), math.nan)
                 for p in pts]
            if any(not math.isnan(v) for v in y):
                ax.plot(x, y, "x--", label=peer)
        ax.set_xticks(x)
        ax.set_xticklabels([f"{b}x{c // 1024}k" for b, c in pts], rotation=45, ha="right")
        ax.set_ylabel("TB/s (K+V+q+out)")
        ax.set_title(f"decode, heads {h}, d{HEAD_DIM}, bf16")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    save_plot(fig, path)
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())
