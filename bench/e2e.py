"""``numasched bench e2e``: a tensor-parallel Llama-3-8B / Qwen3-8B / Qwen3-32B decoder on numasched's ops
against the same model on torch ops (cuBLAS, NCCL, SDPA with cuDNN first), both in CUDA graphs.

    numasched bench e2e --model llama3-8b --tp 1 --batch 1,4,16 --context 2048,8192,32768 --prompt 4096 --new 32
    numasched bench e2e --model llama3-8b --tp 2 ...     # launches torchrun itself (or run it under torchrun)
    numasched bench e2e --quick --layers 4               # a few points on 4 layers
    numasched bench e2e --tp 2 --no-isolate ...          # both backends in one process (faster, biased)
    numasched bench e2e --dry-run                        # what it would run, without a GPU

The model is numasched.models.TPDecoder with random bf16 weights (the public config numbers,
no download), the same weights for both backends. Per (batch, context) each backend gets a KV
cache filled with random K/V up to ``context`` tokens (its own layout: paged for numasched,
contiguous for torch), and one decode step (all layers, final norm, lm_head) is captured in a
CUDA graph and replayed at that position (``--new`` replays back to back per timing sample).
Reported per point and backend: ms per step (graph), tokens/s (batch / step), the step's
fraction of its read floor (``read_floor_ms``: the K/V of context + 1 tokens and the weights a
rank reads, at the streaming read measured in the run; ``<backend>_of_floor`` = floor / step,
meant to compare machines whose HBM differs), the eager step, and the step split into its
components, each timed alone in its own CUDA graph x layers:

    gemm_in        the QKV and gate/up GEMMs (column-parallel, no communication); where the
                   backend runs gate/up and SwiGLU as one kernel (numasched's matmul_swiglu),
                   that kernel, and the activation leaves elementwise
    gemm_out       the o_proj and down_proj GEMMs alone (their local part)
    row_parallel   o_proj and down_proj with their all-reduce (numasched: the fused call;
                   torch: GEMM then NCCL all-reduce); = gemm_out at TP 1
    attention      decode attention over the cache
    elementwise    norms, RoPE, SwiGLU, residual adds, K/V writes (shared compiled kernels, or
                   the backend's fused RoPE + cache write where it has one)
    head           per-step work outside the layers: positions, embedding, final lm_head (+ gather)

(numasched with ``--prefill-seq-parallel``, prefill: gemm_in gathers its rows
(all_gather_matmul), row_parallel reduce-scatters them (matmul_reduce_scatter), and the norms and
residual adds of elementwise run on 1/tp of the rows, as the sequence-parallel step does; the
all-gathers then sit in gemm_in, so bulk_sync_tax counts the reduce-scatters only, and the final
gather of the rows for the logits falls in the locality tax)

and three taxes (docs/models.md has the definitions and their limits):

    bulk_sync_tax  layers x (row_parallel - gemm_out): communication the GEMMs do not hide
    locality_tax   step - sum of the components: what running the kernels back to back costs
                   beyond running each alone (cache state, tails, bubbles between kernels);
                   negative where they overlap
    launch_tax     eager step - graph step: the host's launch work that a graph removes

Prefill: ``--prompt`` tokens at batch 1, eager and as a CUDA-graph replay, with the same
components (at ``--prompt`` rows; attention is the causal prefill) and taxes; the step and
component graphs of both backends are timed in turns (three rounds, the median), so that GPU
clock and temperature drift does not favour the backend timed first. Turns do not remove a
second bias: side by side in one process, the backend built and captured second ran its prefill
step 2-4 % slower and its decode step up to 2 % slower (two H100s, TP 2, either order), whatever
the cause (memory placement beside the other backend's graphs is the likely one). ``--isolate``
(the default) runs each backend in a process (or torchrun launch) of its own and merges the
rows: the figures to compare; ``--no-isolate`` runs them side by side in one (faster). Generate: batch 1,
``--prompt`` prefilled then ``--new`` greedy steps (graph replays, argmax on the device), timed
as a whole. Targets (Llama-3-8B, H200): decode step >= 1.15x torch at TP 2, 4 and 8 and >= 1.00x at TP 1,
prefill of 4k tokens >= 1.10x at TP 2. Points whose weights + KV cache would not fit in
``--mem-fraction`` of the GPU's free memory are skipped with a note. Results:
bench/results/e2e-<model>-<tp>x<gpu>-<date>.csv/.json/.log/.png.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
from typing import Callable, Dict, List, Optional

ENV = dict(NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1",
           NUMASCHED_CHECK_DATA="0")
MODELS = ("llama3-8b", "qwen3-8b", "qwen3-32b")
BACKENDS = ("numasched", "torch")
TARGETS = {1: 1.00, 2: 1.15, 4: 1.15, 8: 1.15}   # decode step, ours vs torch, by TP
PREFILL_TARGET = {2: 1.10}
COMPONENTS = ("gemm_in", "gemm_out", "row_parallel", "attention", "elementwise", "head")
CONTENDERS = {
    "numasched": "numasched.matmul where it leads cuBLAS (W.T views; rows per cost.gemm_engine, cuBLAS elsewhere), flash_decode (paged KV, page "
                 "--page-size), the decode-step fusions, numasched.distributed.matmul_all_reduce for o_proj/down_proj "
                 "at TP > 1; the causal prefill's attention per --prefill-attention",
    "torch": "F.linear (cuBLAS), SDPA (cuDNN first, then flash/efficient/math) over a contiguous static cache, "
             "dist.all_reduce (NCCL) after o_proj/down_proj: bulk-synchronous, gpt-fast style",
}


# The numasched backend's switches (``NumaschedBackend``'s keyword of the same name), each on by
# default, ``--no-...`` for the alternative named in its help.
BACKEND_SWITCHES = (
    ("--weight-first", "numasched: the decode-size QKV, gate/up + SwiGLU and lm_head projections by the "
                       "weight-first GEMM (numasched.gemm_weight_first; sm_90: its programs read their first "
                       "weight blocks before their PDL wait; default on at TP > 1, --no-weight-first for the split-K GEMM)"),
    ("--fuse-norm", "numasched at TP > 1: all-reduce + residual add + RMSNorm in one kernel "
                    "(all_reduce_add_rmsnorm; default on, --no-fuse-norm for the unfused sequence)"),
    ("--fuse-swiglu", "numasched: gate/up projection + silu(gate) * up in one launch at decode sizes "
                      "(numasched.matmul_swiglu; default on: 0.2-1.0%% per step on two H100s; "
                      "--no-fuse-swiglu for the GEMM then the activation)"),
    ("--pdl-swiglu", "numasched: silu(gate) * up by numasched.swiglu (a PDL-launched kernel between the "
                     "decode-size GEMMs; default on, --no-pdl-swiglu for the compiled elementwise kernel)"),
    ("--fuse-rope-cache", "numasched: a decode step's QKV split + RoPE + paged cache write in one launch "
                          "(numasched.qkv_rope_cache; default on, --no-fuse-rope-cache for the unfused sequence)"),
    ("--fuse-residual", "numasched: the residual add in the fused GEMM + all-reduce's epilogue where a "
                        "row-parallel projection runs that kernel (prefill sizes), then the RMSNorm alone "
                        "(default on, --no-fuse-residual for the sum, then the compiled add + RMSNorm)"),
    ("--heap-residual", "numasched, TP 2: the prefill's residual stream in the symmetric heap, so the fused "
                        "GEMM + all-reduce stores each sum straight into the peer's (default on; "
                        "--no-heap-residual: receive slots and a copy)"),
    ("--fold-norms", "numasched: the model's norm weights folded into the QKV and gate/up weights "
                     "(TPDecoder.fold_norms), and its prefill norm-free: the RoPE + cache kernel and the SwiGLU "
                     "GEMM scale each row by its 1 / rms, no normalised rows written (default on: two H200s had the "
                     "step within the calls' spread of the norms' one; --no-fold-norms for the norms)"),
)


def _backends(text: str) -> List[str]:
    names = [x for x in text.split(",") if x]
    if not names or any(n not in BACKENDS for n in names):
        raise argparse.ArgumentTypeError(f"expected a comma-separated subset of {','.join(BACKENDS)}, got {text!r}")
    return names


def build_parser() -> argparse.ArgumentParser:
    from numasched.argtypes import nonneg_int, out_dir, positive_float, positive_int, positive_int_list, unit_float
    from numasched.models.backends import AR_IMPLS

    p = argparse.ArgumentParser(prog="numasched bench e2e", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=MODELS, default="llama3-8b", help="public config to build (random weights)")
    p.add_argument("--tp", type=positive_int, default=1, help="tensor-parallel ranks (GPUs); > 1 runs under torchrun")
    p.add_argument("--batch", type=positive_int_list, default=None, help="decode batch sizes, comma-separated (1,4,16)")
    p.add_argument("--context", type=positive_int_list, default=None,
                   help="decode context lengths in tokens, comma-separated (2048,8192,32768)")
    p.add_argument("--prompt", type=nonneg_int, default=None, help="prefill tokens at batch 1 (4096; 0: no prefill)")
    p.add_argument("--new", type=positive_int, default=32,
                   help="decode steps per timing sample, and tokens generated in the generate row")
    p.add_argument("--layers", type=positive_int, default=None, help="fewer layers than the model has (quick runs)")
    p.add_argument("--page-size", type=positive_int, default=16, help="numasched's KV page size (16 or 64)")
    p.add_argument("--backends", type=_backends, default=list(BACKENDS), help="numasched,torch (or one of them)")
    p.add_argument("--quick", action="store_true", help="batch 1,16, context 2048,8192, prompt 1024, fewer iterations")
    p.add_argument("--iters", type=positive_int, default=None, help="timed samples per measurement (20; quick 10)")
    p.add_argument("--warmup", type=nonneg_int, default=3, help="untimed samples before each measurement")
    p.add_argument("--no-taxes", action="store_true", help="skip the component timings (taxes)")
    p.add_argument("--no-eager", action="store_true", help="skip the eager step timing (launch tax)")
    p.add_argument("--no-generate", action="store_true", help="skip the batch-1 prefill + generate row")
    p.add_argument("--no-compile", action="store_true",
                   help="elementwise ops eagerly instead of torch.compile'd (both backends)")
    p.add_argument("--mem-fraction", type=unit_float, default=0.9,
                   help="skip points whose KV cache would exceed this fraction of the free GPU memory")
    for flag, text in BACKEND_SWITCHES:   # the numasched backend's fusions, each on by default
        # --weight-first: None (the backend's default: on at TP > 1) unless given either way
        p.add_argument(flag, action=argparse.BooleanOptionalAction, default=None if flag == "--weight-first" else True,
                       help=text)
    p.add_argument("--prefill-attention", choices=("auto", "numasched", "torch"), default="auto",
                   help="numasched backend's prefill attention: numasched.attention_forward, torch's SDPA "
                        "(cuDNN first) or auto (default: SDPA on NVIDIA GPUs, where cuDNN's was faster)")
    p.add_argument("--ar-impl", default="auto", choices=AR_IMPLS,
                   help="numasched's all-reduce impl for matmul_all_reduce / all_reduce (auto: their cost model)")
    p.add_argument("--prefill-overlap", type=positive_int, default=None,
                   help="numasched's prefill row chunks, overlapping all-reduces with compute (NumaschedBackend "
                        "prefill_overlap; default 1: one step)")
    p.add_argument("--prefill-seq-parallel", action=argparse.BooleanOptionalAction, default=False,
                   help="numasched's TP prefill sequence-parallel: all_gather_matmul / matmul_reduce_scatter "
                        "around each projection, norms on 1/tp of the rows (NumaschedBackend prefill_seq_parallel; "
                        "default off: all-reduces)")
    p.add_argument("--heap-gb", type=positive_float, default=2.0,
                   help="numasched.distributed symmetric heap per GPU at TP > 1 (GiB)")
    p.add_argument("--seed", type=nonneg_int, default=0, help="weight seed")
    p.add_argument("--out-dir", type=out_dir, default=None,
                   help="results folder (default: see numasched.bench.common; passed to the ranks)")
    p.add_argument("--isolate", action=argparse.BooleanOptionalAction, default=True,
                   help="each backend in a process of its own (one launch per backend, rows merged; the "
                        "default): side by side in one process (--no-isolate, faster) the backend that ran "
                        "second prefilled up to 4%% slower (two H100s)")
    p.add_argument("--timeline", action="store_true",
                   help="also replay each decode step's graph under torch.profiler: per step the kernels' own time "
                        "by kind and the idle time between kernels (bench/timeline.py; e2e-<model>-timeline-*)")
    p.add_argument("--dry-run", action="store_true", help="print the points and contenders and exit (no GPU needed)")
    return p


def _settle(args) -> None:
    """Fill in the defaults that depend on --quick."""
    q = args.quick
    args.batch = args.batch or ([1, 16] if q else [1, 4, 16])
    args.context = args.context or ([2048, 8192] if q else [2048, 8192, 32768])
    args.prompt = (1024 if q else 4096) if args.prompt is None else args.prompt
    args.iters = args.iters or (10 if q else 20)


def _spec(args):
    from numasched.models import preset_config, spec_from_config

    cfg = preset_config(args.model, layers=args.layers)
    return cfg, spec_from_config(cfg)


def _capacity(context: int, new: int, page: int) -> int:
    """Cache slots for a point: the context, the step's token and the generated ones, whole pages."""
    need = context + new + 1
    return -(-need // max(page, 64)) * max(page, 64)


def _layer_weights(spec, tp: int) -> int:
    """Elements of one rank's projection weights in all layers (QKV, o, gate/up, down; the norms'
    vectors left out)."""
    D = spec.head_dim
    attn = spec.hidden * (spec.heads + 2 * spec.kv_heads) * D + spec.heads * D * spec.hidden
    return spec.layers * (attn + 3 * spec.hidden * spec.intermediate) // tp


def _vocab_local(spec, tp: int) -> int:
    return spec.vocab // tp if spec.vocab % tp == 0 else spec.vocab


def _sizes(spec, args, batch: int, context: int) -> Dict[str, float]:
    """Per-rank GB of the weights (the embedding table whole, lm_head's rows: a tied head is
    still a rank's own copy) and of one backend's KV cache at a point."""
    D, HK = spec.head_dim, spec.kv_heads // args.tp
    cap = _capacity(context, args.new, args.page_size)
    kv = 2 * spec.layers * batch * cap * HK * D * 2
    w = 2 * (_layer_weights(spec, args.tp) + (spec.vocab + _vocab_local(spec, args.tp)) * spec.hidden)
    return {"kv_gb": kv / 1e9, "weights_gb": w / 1e9}


def read_bytes(spec, tp: int, batch: int, context: int) -> int:
    """Bytes one rank must read from HBM in a decode step at least: the K/V of ``context + 1``
    tokens (the step's token included) of every sequence, layer and local KV head, and every
    weight it multiplies by (its shards of the layers, its rows of lm_head; the embedding table
    only gives ``batch`` rows, not counted). The same for both backends (16-bit K/V and weights).
    ``tp`` must divide the heads (``spec.check_tp``)."""
    spec.check_tp(tp)
    kv = 2 * spec.layers * batch * (context + 1) * (spec.kv_heads // tp) * spec.head_dim
    return 2 * (kv + _layer_weights(spec, tp) + _vocab_local(spec, tp) * spec.hidden)


def _add_floor(row: dict, spec, args, bw: float) -> None:
    """The point's read floor at the measured streaming read ``bw`` (bytes/s; the slowest rank's):
    ``read_floor_ms`` and, per backend, ``<b>_of_floor`` (floor / step: 1.0 is every byte read
    once at the streaming rate and nothing else). Machines differ (two H200 pairs ran the same
    16 x 32k step 2 % apart); the fraction is meant to compare across them (not yet checked on
    two machines of different rates)."""
    row["stream_tb_s"] = bw / 1e12
    row["read_floor_ms"] = read_bytes(spec, args.tp, row["batch"], row["context"]) / bw * 1e3
    _floor_fractions(row)


def _floor_fractions(row: dict) -> None:
    """Every backend's ``<b>_of_floor`` from the row's ``read_floor_ms`` (none for a failed step)."""
    for k in [k for k in row if k.endswith("_of_floor")]:
        del row[k]
    for k, ms in list(row.items()):
        if k.endswith("_step_ms") and isinstance(ms, float) and ms == ms and ms > 0:
            row[k[:-len("_step_ms")] + "_of_floor"] = row["read_floor_ms"] / ms


def _dry_run(args) -> int:
    from .common import print_plan

    cfg, spec = _spec(args)
    spec.check_tp(args.tp)
    lines = []
    for b in args.batch:
        for c in args.context:
            s = _sizes(spec, args, b, c)
            lines.append(f"decode {args.model} ({spec.layers} layers) tp {args.tp}: batch {b}, context {c}: "
                         f"{s['kv_gb']:.2f} GB KV cache per rank per backend, {s['weights_gb']:.2f} GB weights per rank")
    if args.prompt:
        lines.append(f"prefill {args.model} tp {args.tp}: batch 1, {args.prompt} tokens (eager and CUDA graph)")
        if not args.no_generate:
            lines.append(f"generate {args.model} tp {args.tp}: batch 1, prefill {args.prompt} + {args.new} greedy steps")
    contenders = [f"{b}: {CONTENDERS[b]}" for b in args.backends]
    contenders.append(f"timing: CUDA-graph replays, {args.new} steps per sample, {args.warmup}+{args.iters} samples, "
                      f"slowest rank's median" + ("" if args.no_taxes else
                                                  "; components " + ", ".join(COMPONENTS) + " each in its own graph"))
    if "numasched" in args.backends:
        fused = [name for name, on in (("all-reduce + add + RMSNorm", args.fuse_norm and args.tp > 1),
                                        ("gate/up + SwiGLU", args.fuse_swiglu),
                                        ("SwiGLU by a PDL kernel", args.pdl_swiglu),
                                        ("QKV split + RoPE + cache write", args.fuse_rope_cache),
                                        ("weight-first GEMMs (QKV, gate/up, lm_head)",
                                         args.tp > 1 if args.weight_first is None else args.weight_first)) if on]
        contenders.append("numasched decode fusions: " + (", ".join(fused) or "none"))
        if args.prompt:
            if args.tp > 1:
                contenders.append("numasched prefill: residual add in the fused GEMM + all-reduce: "
                                  + ("on" if args.fuse_residual else "off")
                                  + (", residual stream in the symmetric heap" if args.fuse_residual
                                     and args.heap_residual and args.tp == 2 else ""))
            contenders.append("numasched prefill norms: " + ("folded into the QKV and gate/up weights, norm-free "
                                                             "(row scales in the RoPE + cache and SwiGLU kernels)"
                                                             if args.fold_norms else "RMSNorm kernels"))
            contenders.append(f"numasched prefill attention: {args.prefill_attention}"
                              + (" (SDPA, cuDNN first, on NVIDIA GPUs; numasched.attention_forward elsewhere)"
                                 if args.prefill_attention == "auto" else ""))
    if args.tp > 1:
        mode = ("sequence-parallel (all_gather_matmul / matmul_reduce_scatter, norms on 1/tp of the rows)"
                if args.prefill_seq_parallel else
                f"{args.prefill_overlap} overlapped row chunks" if (args.prefill_overlap or 1) > 1 else
                "one bulk step (all-reduces)")
        contenders.append(f"numasched prefill: {mode}")
        contenders.append(f"launch: torchrun --nproc-per-node {args.tp} (NCCL multicast off)")
    return print_plan("e2e", lines, contenders)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.prefill_seq_parallel and (args.prefill_overlap or 1) > 1:
        parser.error("--prefill-seq-parallel and --prefill-overlap are two ways to run the prefill: pass one")
    _settle(args)
    try:
        _spec(args)[1].check_tp(args.tp)
    except ValueError as e:
        print(f"numasched bench e2e: --tp: {e}", file=sys.stderr)
        return 2
    if args.dry_run:
        return _dry_run(args)
    if args.out_dir:   # the ranks (and this process) write there: numasched.bench.common.results_dir
        os.environ["NUMASCHED_RESULTS_DIR"] = str(os.path.abspath(args.out_dir))
    isolate = args.isolate and len(args.backends) > 1
    if isolate and "RANK" in os.environ:   # every rank would run both backends side by side again
        parser.error("--isolate (the default) launches one run per backend itself: start the bench "
                     "outside torchrun, or pass --no-isolate to run the backends side by side")
    if args.tp > 1 and not isolate and not ("RANK" in os.environ and "WORLD_SIZE" in os.environ):
        return _launch(args, argv)
    from .common import check_runnable

    rc = check_runnable("e2e")   # isolated: once, before any launch
    if rc is not None:
        return rc
    return _isolated(args, argv) if isolate else _worker(args)


def _launch(args, argv) -> int:
    import torch

    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if n < args.tp:
        print(f"numasched bench e2e --tp {args.tp} needs {args.tp} GPUs (found {n}); --dry-run shows what it would run",
              file=sys.stderr)
        return 2
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={args.tp}", "-m", "numasched.bench.e2e",
           *argv]
    print("launching:", " ".join(cmd), flush=True)
    return subprocess.call(cmd, env=dict(os.environ, **ENV))


def _drop(argv: List[str], *options: str) -> List[str]:
    """``argv`` without ``options`` (given as ``--opt value``, ``--opt=value`` or, for a flag, ``--opt``)."""
    flags = {"--isolate", "--no-isolate"}
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        name = a.split("=", 1)[0]
        if name in options:
            skip = "=" not in a and name not in flags
            continue
        out.append(a)
    return out


def merge_rows(runs: Dict[str, List[dict]], tp: int) -> List[dict]:
    """The rows of one-backend runs (``runs``: backend -> its rows) as one side-by-side table:
    rows of the same kind, batch and context merged, the speedup and target of each recomputed.
    Each run measured its own streaming read: the merged row keeps the slowest (its floor the
    longest) and every backend's fraction of the floor is recomputed against that one floor, so
    that the fractions' ratio is the speedup."""
    merged: Dict[tuple, dict] = {}
    rates: Dict[tuple, List[tuple]] = {}
    for rows in runs.values():
        for r in rows:
            key = (r.get("kind"), r.get("batch"), r.get("context"))
            merged.setdefault(key, {}).update({k: v for k, v in r.items() if k not in ("speedup", "target")})
            bw, floor = r.get("stream_tb_s"), r.get("read_floor_ms")
            if isinstance(bw, float) and isinstance(floor, float) and bw > 0 and floor > 0:
                rates.setdefault(key, []).append((bw, floor * bw))   # (TB/s, GB of the point)
    for key, got in rates.items():
        bw, gb = min(got)
        r = merged[key]
        r["stream_tb_s"], r["read_floor_ms"] = bw, gb / bw
        _floor_fractions(r)
    out = list(merged.values())
    for r in out:
        ns, tr = r.get("numasched_step_ms"), r.get("torch_step_ms")
        if isinstance(ns, (int, float)) and isinstance(tr, (int, float)) and ns == ns and tr == tr and ns > 0:
            r["speedup"] = tr / ns
            t = (TARGETS if r.get("kind") == "decode" else PREFILL_TARGET if r.get("kind") == "prefill" else {}).get(tp)
            if t is not None:
                r["target"] = f"{'met' if r['speedup'] >= t else 'missed'} (>= {t:.2f}x)"
    return out


def _isolated(args, argv) -> int:
    """``--isolate``: one run per backend (its own process, or torchrun launch at --tp > 1), each
    into ``OUT/isolated-<backend>/``, then their rows merged and written as one run's."""
    import json
    import time
    from pathlib import Path

    from .common import results_dir

    base = results_dir(args.out_dir)
    rest = _drop(argv, "--isolate", "--no-isolate", "--backends", "--out-dir") + ["--no-isolate"]
    runs, notes = {}, [f"isolated: each backend in its own process ({', '.join(args.backends)})"]
    for b in args.backends:
        sub = base / f"isolated-{b}"
        cmd = [sys.executable, "-m", "numasched.bench.e2e", *rest, "--backends", b, "--out-dir", str(sub)]
        print("isolated run:", " ".join(cmd), flush=True)
        start = time.time() - 1.0
        rc = subprocess.call(cmd)
        if rc:
            return rc
        # this launch's file only: the folder may hold earlier runs' (another TP size, GPU or date)
        files = sorted((p for p in Path(sub).glob(f"e2e-{args.model}-*.json")
                        if "-taxes-" not in p.name and "-timeline-" not in p.name and p.stat().st_mtime >= start),
                       key=lambda p: p.stat().st_mtime)
        if not files:
            print(f"numasched bench e2e --isolate: the {b} run wrote no e2e-{args.model}-*.json under {sub}",
                  file=sys.stderr)
            return 1
        got = json.loads(files[-1].read_text())
        runs[b] = got["rows"]
        notes += [f"{b}: {n}" for n in got.get("env", {}).get("notes", [])]
    _write(args, merge_rows(runs, args.tp), notes, _spec(args)[1])
    return 0


def _write(args, rows: List[dict], notes: List[str], spec) -> None:
    """Rank 0's output: the table, CSV/JSON/plot, the taxes table and a summary."""
    from .common import write_results

    dec = [r for r in rows if r["kind"] == "decode" and r.get("speedup") is not None]
    lines = []
    if dec:
        sp = [r["speedup"] for r in dec]
        lines.append(f"decode step speedup (torch / numasched, CUDA graphs): {min(sp):.3f}-{max(sp):.3f}x over "
                     f"{len(sp)} points" + (f"; target >= {TARGETS[args.tp]:.2f}x met at "
                                            f"{sum(s >= TARGETS[args.tp] for s in sp)}/{len(sp)}"
                                            if args.tp in TARGETS else ""))
    lines += [f"note: {n}" for n in notes]
    summary = "\n".join(lines)
    meta = dict(args={k: v for k, v in vars(args).items() if k != "out_dir"}, spec=spec.__dict__, notes=notes)
    paths = write_results(f"e2e-{args.model}", rows, columns=_columns(args.backends), plot=_plot,
                          out_dir=args.out_dir, gpus=args.tp, log=summary, meta=meta)
    taxes = _tax_rows(rows, args.backends)
    if taxes:   # components x layers and the taxes (ms), one row per point and backend
        paths.update({f"taxes_{k}": v for k, v in write_results(
            f"e2e-{args.model}-taxes", taxes, columns=TAX_COLUMNS, out_dir=args.out_dir, gpus=args.tp, log="",
            meta=meta).items()})
    timeline = timeline_rows(rows, args.backends)
    if timeline:   # --timeline: per point and backend, the graph's kernels by kind and the idle time
        paths.update({f"timeline_{k}": v for k, v in write_results(
            f"e2e-{args.model}-timeline", timeline, columns=TIMELINE_COLUMNS, out_dir=args.out_dir, gpus=args.tp,
            log="", meta=meta).items()})
    print(summary)
    print("written:", ", ".join(str(v) for v in paths.values()), flush=True)


TIMELINE_COLUMNS = ["kind", "batch", "context", "backend", "what", "ms_per_step", "owned_ms_per_step"]
# the GEMM launches of a layer of the decode step, in order (numasched/models/llama.py: the fused
# QKV projection, o_proj, the fused gate/up (+ SwiGLU), down_proj); the step ends with lm_head
LAYER_GEMM_ROLES = ("qkv", "o", "gate_up", "down")


def decode_gemm_roles(layers: int) -> List[str]:
    """The role of each GEMM launch of one decode step, in launch order (bench/timeline.py)."""
    return list(LAYER_GEMM_ROLES) * layers + ["lm_head"]


def timeline_rows(rows, backends) -> List[dict]:
    """The ``--timeline`` summaries of ``rows`` as a long table: per decode point and backend the
    step's span, the kernels' busy time, the idle time between kernels, then each kernel kind: its
    kernels' summed time and the part of the busy time it owns (bench/timeline.py)."""
    out = []
    for r in rows:
        for b in backends:
            t = r.get(f"{b}_timeline")
            if not isinstance(t, dict):
                continue
            base = dict(kind=r.get("kind"), batch=r.get("batch"), context=r.get("context"), backend=b)
            for what, key in (("(span)", "span_ms"), ("(kernels busy)", "busy_ms"),
                              ("(idle between kernels)", "gap_ms")):
                out.append(dict(base, what=what, ms_per_step=t[key], owned_ms_per_step=t[key]))
            own = t.get("own_by_kind", {})
            out += [dict(base, what=k, ms_per_step=v, owned_ms_per_step=own.get(k)) for k, v in t["by_kind"].items()]
            if t.get("by_role"):   # the GEMM launches by projection (where each step's launches matched)
                own_r = t.get("own_by_role") or {}
                out += [dict(base, what=f"gemm: {k}", ms_per_step=v, owned_ms_per_step=own_r.get(k))
                        for k, v in t["by_role"].items()]
    return out


# ============================================================================ worker (every rank)
class _Ctx:
    """Rank, world, timers and output of one rank."""

    def __init__(self, args):
        for k, v in ENV.items():
            os.environ.setdefault(k, v)
        self.args = args
        self.rank, self.world = 0, 1
        if args.tp > 1:
            from .common import init_rank

            if int(os.environ["WORLD_SIZE"]) != args.tp:
                raise SystemExit(f"--tp {args.tp} but torchrun started {os.environ['WORLD_SIZE']} ranks")
            self.rank, self.world = init_rank()
        self.notes: List[str] = []

    def say(self, msg: str) -> None:
        if self.rank == 0:
            print(msg, flush=True)

    def slowest(self, ms: float) -> float:
        """The largest of every rank's value (NaN if any rank failed)."""
        if self.world == 1:
            return ms
        import torch
        import torch.distributed as dist

        x = torch.tensor([ms if ms == ms else float("inf")], device="cuda")
        dist.all_reduce(x, op=dist.ReduceOp.MAX)
        v = float(x)
        return float("nan") if v == float("inf") else v

    def barrier(self) -> None:
        import torch

        torch.cuda.synchronize()
        if self.world > 1:
            import torch.distributed as dist

            dist.barrier()

    def timed(self, fn: Callable[[], object], calls: int = 1, iters: Optional[int] = None) -> float:
        """Median ms per call over a fixed number of samples (``iters``, default ``--iters``; every
        rank the same count)."""
        from .common import bench_fixed_ms

        self.barrier()
        return self.slowest(bench_fixed_ms(fn, warmup=self.args.warmup, iters=iters or self.args.iters, calls=calls))

    def timed_turns(self, fns: Dict[object, Callable[[], object]], rounds: int = 3) -> Dict[object, float]:
        """Median ms per call of each of ``fns``, timed in turns: every function once per round
        (``iters / rounds`` samples each), the median of its rounds. Contenders timed one after the
        other see the GPU in different states (clocks, temperature: identical cuBLAS calls differed
        by about 10 % between the two backends' turns on the H200s); in turns, each sees them all."""
        per = max(5, self.args.iters // rounds)
        samples: Dict[object, List[float]] = {k: [] for k in fns}
        for _ in range(rounds):
            for key, fn in fns.items():
                samples[key].append(self.timed(fn, iters=per))
        return {k: sorted(v)[len(v) // 2] for k, v in samples.items()}

    def capture(self, fn: Callable[[], object]):
        """``fn`` warmed up and captured in a CUDA graph (every rank at once)."""
        from .common import capture, warm_up_for_capture

        self.barrier()
        warm_up_for_capture(fn, 2)
        self.barrier()
        return capture(fn)

    def graph_ms(self, fn: Callable[[], object], calls: int = 1) -> float:
        """ms of one call of ``fn`` replayed from a CUDA graph (warmed up, captured, replayed ``calls``
        times per sample)."""
        g = self.capture(fn)
        ms = self.timed(g.replay, calls)
        del g
        return ms


def _backend(name, ctx, dctx):
    from numasched.models import NumaschedBackend, TorchBackend

    if name == "torch":
        return TorchBackend(ctx.world)
    # no status read per distributed call (it synchronises an eager step); ctx.check() after each point
    return NumaschedBackend(ctx.world, dctx, impl=ctx.args.ar_impl, check=False, fuse_norm=ctx.args.fuse_norm,
                            fuse_swiglu=ctx.args.fuse_swiglu, prefill_overlap=ctx.args.prefill_overlap,
                            prefill_seq_parallel=ctx.args.prefill_seq_parallel,
                            fuse_rope_cache=ctx.args.fuse_rope_cache, prefill_attention=ctx.args.prefill_attention,
                            pdl_swiglu=ctx.args.pdl_swiglu, fuse_residual=ctx.args.fuse_residual,
                            heap_residual=ctx.args.heap_residual, fold_norms=ctx.args.fold_norms,
                            weight_first=ctx.args.weight_first)


def _parts(model, be, cache, seq: Optional[int] = None) -> Dict[str, Callable[[], object]]:
    """The components of one step as closures over fresh inputs (one layer, or the per-step
    part): a decode step (``seq`` None: one token per sequence of ``cache``) or the prefill of
    ``seq`` tokens at batch 1 (``cache`` empty). See the module doc."""
    import torch
    import torch.nn.functional as F

    from numasched.models.llama import _elementwise

    L, s = model.layers[0], model.spec
    T = cache.batch if seq is None else seq     # rows of the step's GEMMs
    E, D = s.hidden, s.head_dim
    hq, hk, il = model.heads_local, model.kv_heads_local, model.inter_local
    dev, dt = model.device, model.dtype
    x = torch.randn(T, E, device=dev, dtype=dt)
    x2 = be.residual_stream(torch.randn(T, E, device=dev, dtype=dt), (L.wo, L.wdown))   # where the step keeps it
    a = torch.randn(T, hq * D, device=dev, dtype=dt)
    act = torch.randn(T, il, device=dev, dtype=dt)
    qkv = torch.randn(T, (hq + 2 * hk) * D, device=dev, dtype=dt)
    gu = torch.randn(T, 2 * il, device=dev, dtype=dt)
    ids = torch.zeros(T, dtype=torch.int64, device=dev)
    ew = lambda n: _elementwise(n, model.compile_elementwise)  # noqa: E731
    local = (lambda t, w: torch.matmul(t, w.t())) if be.name == "torch" else (  # noqa: E731
        lambda t, w: __import__("numasched").matmul(t, w.t(), mapping=be._maps["gemm"]))
    if seq is None:
        cs = model.rope_table(cache.capacity)[:T]
        q = torch.randn(T, hq, D, device=dev, dtype=dt)
        cache.begin_decode()   # the write slots the elementwise part uses
    else:
        cache.begin_prefill(seq)
        cs = model.rope_table(seq)[:seq]
        q, k, v = ew("qkv_rope")(qkv, cs[:, 0], cs[:, 1], hq, hk, D, L.q_norm, L.k_norm, s.eps)

    # a sequence-parallel prefill: the column-parallel GEMMs gather their rows, the row-parallel
    # ones reduce-scatter theirs, and the norms see 1/tp of the rows
    sp = seq is not None and be.seq_parallel(1, seq)
    xs, x2s = (x[:T // be.tp_size], x2[:T // be.tp_size]) if sp else (x, x2)

    # where the backend runs the gate/up projection and its activation as one kernel, that kernel
    # is a GEMM of gemm_in and the activation leaves elementwise
    glu = not sp and be.fuses_swiglu(x, il)
    # where the row-parallel projections add the residual in their kernel, the add leaves
    # elementwise (the norms there run alone)
    res_o, res_d = (not sp and be.fuses_residual(a, L.wo), not sp and be.fuses_residual(act, L.wdown))
    # a norm-free prefill (folded norms): the projections' consumers scale rows by 1 / rms, and
    # the norms give way to that reduction (rms_inv)
    free = seq is not None and not sp and model.norms_folded and be.norm_free(T)
    rs = torch.rand(T, device=dev, dtype=torch.float32) + 0.5 if free else None

    def gemm_in():
        if sp:
            be.all_gather_linear(xs, L.wqkv)
            be.all_gather_linear(xs, L.wgu)
            return
        be.linear(x, L.wqkv)
        if glu:
            be.linear_swiglu(x, L.wgu, il, ew("silu_mul"), row_scale=rs)
        else:
            be.linear(x, L.wgu)

    def gemm_out():
        local(a, L.wo)
        local(act, L.wdown)

    def row_parallel():
        if sp:
            be.linear_reduce_scatter(a, L.wo)
            be.linear_reduce_scatter(act, L.wdown)
            return
        be.row_parallel_residual(a, L.wo, x2) if res_o else be.row_parallel(a, L.wo)
        be.row_parallel_residual(act, L.wdown, x2) if res_d else be.row_parallel(act, L.wdown)

    def attention():
        if seq is None:
            be.decode_attention(q, cache, 0)
        else:
            be.prefill_attention(q, k, v, 1, seq)

    def elementwise():   # what one layer does besides its GEMMs, attention and collectives
        # (two norms: after the o projection and after the down projection, the next layer's
        # first; an RMSNorm at the layer's start counted the second one twice until 2026-11-26)
        if seq is None:   # the decode step's path (one launch where the backend fuses it)
            be.rope_cache_write(qkv, cs[:, 0], cs[:, 1], hq, hk, D, L.q_norm, L.k_norm, s.eps, cache, 0,
                                ew("qkv_rope"))
        elif sp:
            _, k_, v_ = ew("qkv_rope")(qkv, cs[:, 0], cs[:, 1], hq, hk, D, L.q_norm, L.k_norm, s.eps)
            cache.write(0, k_, v_)
        else:   # the one-step prefill's path (one launch where the backend fuses it)
            be.prefill_rope_cache(qkv, cs[:, 0], cs[:, 1], hq, hk, D, L.q_norm, L.k_norm, s.eps, cache, 0,
                                  ew("qkv_rope"), row_scale=rs)
        if free:   # the two norms' reductions (their adds are the projections' where res_o / res_d)
            ew("rms_inv")(x2s, s.eps)
            if not res_o:
                x2s.add_(xs)
            if not glu:
                ew("silu_mul")(gu, il)
            ew("rms_inv")(x2s, s.eps)
            if not res_d:
                x2s.add_(xs)
            return
        ew("rms_norm")(x2s, L.ln2, s.eps) if res_o else ew("add_rms_norm")(x2s, xs, L.ln2, s.eps)
        if not glu:
            ew("silu_mul")(gu, il)
        ew("rms_norm")(x2s, L.ln1, s.eps) if res_d else ew("add_rms_norm")(x2s, xs, L.ln1, s.eps)

    def head():
        if seq is None:
            cache.begin_decode()
            model.rope_table(cache.capacity).index_select(0, cache.positions)
            F.embedding(ids, model.embed)
            model._logits(x, be)
        else:
            model.rope_table(seq)[:seq].repeat(1, 1, 1)
            F.embedding(ids, model.embed)
            model._logits(x[-1:], be)   # the last prompt token's logits

    return dict(gemm_in=gemm_in, gemm_out=gemm_out, row_parallel=row_parallel, attention=attention,
                elementwise=elementwise, head=head)


def _components(ctx, model, be, cache) -> Dict[str, float]:
    """Each component of one decode step (:func:`_parts`) timed alone in its own CUDA graph (ms;
    the prefill's are timed in turns with the other backend's, in :func:`_prefill_rows`)."""
    out = {}
    for name, fn in _parts(model, be, cache).items():
        try:
            out[name] = ctx.graph_ms(fn)
        except Exception as e:  # noqa: BLE001 - reported, the step timing stands
            ctx.notes.append(f"{be.name} component {name}: {type(e).__name__}: {str(e)[:120]}")
            out[name] = float("nan")
    return out


def _taxes(row: dict, prefix: str, comp: Dict[str, float], layers: int) -> None:
    per_layer = comp["gemm_in"] + comp["row_parallel"] + comp["attention"] + comp["elementwise"]
    total = layers * per_layer + comp["head"]
    row[f"{prefix}_sum_components_ms"] = total
    row[f"{prefix}_bulk_sync_tax_ms"] = layers * (comp["row_parallel"] - comp["gemm_out"])
    row[f"{prefix}_locality_tax_ms"] = row[f"{prefix}_step_ms"] - total
    for k, v in comp.items():
        row[f"{prefix}_{k}_ms"] = layers * v if k != "head" else v


def _decode_point(ctx, model, backends, batch: int, context: int) -> dict:
    import torch

    from numasched.models import DecodeRunner

    args = ctx.args
    row = dict(kind="decode", model=args.model, tp=args.tp, layers=model.spec.layers, batch=batch, context=context)
    cap = _capacity(context, args.new, args.page_size)
    for name, be in backends.items():
        cache = be.new_cache(model, batch=batch, capacity=cap, page_size=args.page_size)
        cache.fill_random(context)
        if name == "torch":
            cache.set_window(context + 1)   # every sequence has context + 1 tokens after the step
        try:
            runner = DecodeRunner(model, be, cache, advance=False)
            row[f"{name}_step_ms"] = ctx.timed(runner.graph.replay, calls=args.new)
            row[f"{name}_tok_s"] = batch * 1e3 / row[f"{name}_step_ms"]
            if args.timeline:   # every rank replays (the graphs hold collectives); rank 0 reports its own
                from .timeline import describe, kernel_intervals, summarize

                ctx.barrier()
                row[f"{name}_timeline"] = summarize(kernel_intervals(runner.graph.replay, steps=8), 8,
                                                    gemm_roles=decode_gemm_roles(model.spec.layers))
                ctx.say(f"timeline {name} batch {batch} context {context}: {describe(row[f'{name}_timeline'])}")
            if not args.no_eager:
                row[f"{name}_eager_ms"] = ctx.timed(runner.step_eager, calls=1)
                row[f"{name}_launch_tax_ms"] = row[f"{name}_eager_ms"] - row[f"{name}_step_ms"]
            del runner
            if not args.no_taxes:
                _taxes(row, name, _components(ctx, model, be, cache), model.spec.layers)
        except Exception as e:  # noqa: BLE001 - the other backend's numbers still count
            ctx.notes.append(f"decode {name} batch {batch} context {context}: {type(e).__name__}: {str(e)[:200]}")
            row[f"{name}_step_ms"] = float("nan")
        del cache
        torch.cuda.empty_cache()
        if be.name == "numasched" and getattr(be, "ctx", None) is not None:
            be.ctx.check()   # a peer that timed out inside a replay raises here
    if "numasched_step_ms" in row and "torch_step_ms" in row:
        row["speedup"] = row["torch_step_ms"] / row["numasched_step_ms"]
        t = TARGETS.get(args.tp)
        if t is not None and row["speedup"] == row["speedup"]:
            row["target"] = f"{'met' if row['speedup'] >= t else 'missed'} (>= {t:.2f}x)"
    return row


def _prefill_rows(ctx, model, backends) -> List[dict]:
    import torch

    from numasched.models import DecodeRunner

    args = ctx.args
    S = args.prompt
    g = torch.Generator(device="cuda")
    g.manual_seed(1)
    ids = torch.randint(0, model.spec.vocab, (1, S), device="cuda", generator=g)
    pre = dict(kind="prefill", model=args.model, tp=args.tp, layers=model.spec.layers, batch=1, context=S)
    gen = dict(kind="generate", model=args.model, tp=args.tp, layers=model.spec.layers, batch=1, context=S)
    # 1. per backend: the eager prefill, then the step and (taxes) each component captured in graphs
    state: Dict[str, dict] = {}
    for name, be in backends.items():
        cache = be.new_cache(model, batch=1, capacity=_capacity(S, args.new, args.page_size),
                             page_size=args.page_size)
        graphs = {}
        state[name] = dict(be=be, cache=cache, graphs=graphs)
        try:
            fn = lambda be=be, cache=cache: model.prefill(ids, cache, be)  # noqa: E731
            pre[f"{name}_eager_ms"] = ctx.timed(fn)
            graphs["step"] = ctx.capture(fn)
        except Exception as e:  # noqa: BLE001
            ctx.notes.append(f"prefill {name}: {type(e).__name__}: {str(e)[:200]}")
            pre[f"{name}_step_ms"] = float("nan")
            continue
        if not args.no_taxes:
            cache.reset()
            try:
                parts = _parts(model, be, cache, S)
            except Exception as e:  # noqa: BLE001 - the step's figures stand
                ctx.notes.append(f"prefill {name} components: {type(e).__name__}: {str(e)[:200]}")
                parts = {}
            # the closures hold the components' inputs, which the graphs read: kept alive until
            # every graph of every backend has been timed (dropped with the next backend's
            # parts, their memory was reused or unmapped: an illegal address on two H200s)
            state[name]["parts"] = parts
            for part, pfn in parts.items():
                try:
                    graphs[part] = ctx.capture(pfn)
                except Exception as e:  # noqa: BLE001
                    ctx.notes.append(f"{name} prefill component {part}: {type(e).__name__}: {str(e)[:120]}")
    # 2. every graph of every backend timed in turns (_Ctx.timed_turns)
    times = ctx.timed_turns({(name, key): g.replay for name, st in state.items() for key, g in st["graphs"].items()})
    for name, st in state.items():
        if (name, "step") in times:
            pre[f"{name}_step_ms"] = times[(name, "step")]
            pre[f"{name}_tok_s"] = S * 1e3 / pre[f"{name}_step_ms"]
            pre[f"{name}_launch_tax_ms"] = pre[f"{name}_eager_ms"] - pre[f"{name}_step_ms"]
        comp = {key: times.get((name, key), float("nan")) for key in COMPONENTS}
        if not args.no_taxes and (name, "step") in times:
            _taxes(pre, name, comp, model.spec.layers)
        st["graphs"].clear()
        st.pop("parts", None)
    # 3. per backend: prefill + generate
    for name, st in state.items():
        be, cache = st["be"], st["cache"]
        if not args.no_generate:
            try:   # prefill, then --new greedy steps from one captured step (lens advances in the graph)
                cache.reset()
                runner = DecodeRunner(model, be, cache, advance=True)

                def generate():
                    cache.reset()
                    nxt = model.prefill(ids, cache, be).argmax(-1)
                    for _ in range(args.new):
                        nxt = runner(nxt).argmax(-1)
                    return nxt

                ms = ctx.timed(generate)
                gen[f"{name}_step_ms"] = ms
                gen[f"{name}_tok_s"] = args.new * 1e3 / ms
                del runner
            except Exception as e:  # noqa: BLE001
                ctx.notes.append(f"generate {name}: {type(e).__name__}: {str(e)[:200]}")
                gen[f"{name}_step_ms"] = float("nan")
        st.clear()
    state.clear()
    torch.cuda.empty_cache()
    rows = [pre] + ([] if args.no_generate else [gen])
    for r in rows:
        if r.get("numasched_step_ms") and r.get("torch_step_ms"):
            r["speedup"] = r["torch_step_ms"] / r["numasched_step_ms"]
    t = PREFILL_TARGET.get(args.tp)
    if t is not None and pre.get("speedup") == pre.get("speedup") and "speedup" in pre:
        pre["target"] = f"{'met' if pre['speedup'] >= t else 'missed'} (>= {t:.2f}x)"
    return rows


def _columns(backends) -> List[str]:
    cols = ["kind", "model", "tp", "layers", "batch", "context"]
    cols += [f"{b}_step_ms" for b in backends] + ["speedup", "target"]
    cols += [f"{b}_tok_s" for b in backends] + [f"{b}_eager_ms" for b in backends]
    cols += ["stream_tb_s", "read_floor_ms"] + [f"{b}_of_floor" for b in backends]
    return cols + ["note"]


TAX_COLUMNS = ["kind", "batch", "context", "backend", "step_ms", "sum_components_ms", "bulk_sync_tax_ms", "locality_tax_ms",
               "launch_tax_ms"] + [f"{c}_ms" for c in COMPONENTS]


def _tax_rows(rows, backends) -> List[dict]:
    """One row per (decode point or prefill, backend): the step, its components x layers and the
    taxes."""
    out = []
    for r in rows:
        if r["kind"] not in ("decode", "prefill"):
            continue
        for b in backends:
            if r.get(f"{b}_sum_components_ms") is None and r.get(f"{b}_launch_tax_ms") is None:
                continue
            row = dict(kind=r["kind"], batch=r["batch"], context=r["context"], backend=b)
            row.update({c: r.get(f"{b}_{c}") for c in TAX_COLUMNS[4:]})
            out.append(row)
    return out


def _plot(rows, path):
    import matplotlib.pyplot as plt
    from .common import save_plot

    dec = [r for r in rows if r["kind"] == "decode"]
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    colors = {}
    for b in sorted({r["batch"] for r in dec}):
        sub = sorted((r for r in dec if r["batch"] == b), key=lambda r: r["context"])
        for be, style in (("numasched", "-"), ("torch", "--")):
            pts = [(r["context"], r[f"{be}_step_ms"]) for r in sub if r.get(f"{be}_step_ms") == r.get(f"{be}_step_ms")
                   and r.get(f"{be}_step_ms") is not None]
            if pts:
                line, = axes[0].plot(*zip(*pts), style, marker="o", color=colors.get(b),
                                     label=f"{be} batch {b}")
                colors[b] = line.get_color()
        pts = [(r["context"], r["speedup"]) for r in sub if r.get("speedup") is not None]
        if pts:
            axes[1].plot(*zip(*pts), marker="o", color=colors.get(b), label=f"batch {b}")
    tp = rows[0]["tp"] if rows else 1
    if tp in TARGETS:
        axes[1].axhline(TARGETS[tp], color="gray", ls=":", label=f"target {TARGETS[tp]:.2f}x")
    for ax, yl in ((axes[0], "ms per decode step (CUDA graph)"), (axes[1], "speedup (torch / numasched)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context (tokens)")
        ax.set_ylabel(yl)
        ax.legend(fontsize=7)
    # taxes of the largest-context point per backend, stacked
    taxed = [r for r in dec if r.get("numasched_sum_components_ms") is not None or r.get("torch_sum_components_ms")]
    if taxed:
        r = max(taxed, key=lambda r: (r["batch"], r["context"]))
        names = [b for b in ("numasched", "torch") if r.get(f"{b}_step_ms") is not None]
        parts = [("gemm_in", "GEMM (QKV, gate/up)"), ("row_parallel", "row-parallel (GEMM + all-reduce)"),
                 ("attention", "attention"), ("elementwise", "elementwise"), ("head", "per step")]
        bottom = [0.0] * len(names)
        for key, label in parts:
            vals = [max(0.0, r.get(f"{b}_{key}_ms") or 0.0) for b in names]
            axes[2].bar(names, vals, bottom=bottom, label=label)
            bottom = [x + y for x, y in zip(bottom, vals)]
        axes[2].scatter(names, [r.get(f"{b}_step_ms") for b in names], color="k", zorder=3, label="measured step")
        axes[2].set_title(f"components x layers, batch {r['batch']}, context {r['context']}", fontsize=9)
        axes[2].set_ylabel("ms")
        axes[2].legend(fontsize=7)
    fig.suptitle(f"{rows[0]['model']} TP {tp}, {rows[0]['layers']} layers" if rows else "")
    fig.tight_layout()
    save_plot(fig, path)


def _worker(args) -> int:
    import torch

    import numasched
    from numasched.models import TPDecoder

    ctx = _Ctx(args)
    numasched.options.set(check_data=False)   # no host sync per flash_decode call (lengths are ours)
    try:
        import torch._dynamo.config as dc

        dc.recompile_limit = max(getattr(dc, "recompile_limit", 8), 64)   # one compile per batch size
    except (ImportError, AttributeError):
        pass
    cfg, spec = _spec(args)
    dctx = None
    if args.tp > 1 and "numasched" in args.backends:
        import numasched.distributed as nd

        # bounded_only: "auto" keeps the step's collectives on numasched's bounded kernels (no NCCL,
        # no torch symm_mem; two ranks never picked them for the default decode and prefill)
        dctx = nd.init(heap_bytes=int(args.heap_gb * (1 << 30)), timeout_s=60.0, bounded_only=True)
    ctx.say(f"building {args.model} ({spec.layers} layers, {spec.param_count() / 1e9:.2f}B parameters) with random "
            f"bf16 weights, TP {args.tp}")
    model = TPDecoder.random(cfg, dtype=torch.bfloat16, device="cuda", tp_rank=ctx.rank, tp_size=args.tp,
                             seed=args.seed, compile_elementwise=not args.no_compile)
    if "numasched" in args.backends and args.fold_norms:
        # the same function (unit norms after the fold; a run with both backends gives torch's the
        # folded model too: the same kernels, its norms with unit weights)
        model.fold_norms()
    backends = {n: _backend(n, ctx, dctx) for n in args.backends}
    rows = []
    free = -ctx.slowest(-float(torch.cuda.mem_get_info()[0]))   # the least free memory of any rank: all skip alike
    # the streaming read (1 GiB, before any cache): the slowest rank's
    from numasched.probe.bandwidth import stream_read_bw

    bw = -ctx.slowest(-stream_read_bw())
    ctx.say(f"streaming read {bw / 1e12:.3f} TB/s (the slowest rank's)")
    for batch in args.batch:
        for context in args.context:
            kv = _sizes(spec, args, batch, context)["kv_gb"] * 1e9
            if kv + 2e9 > args.mem_fraction * free:
                note = (f"skipped: KV cache {kv / 1e9:.1f} GB per rank + 2 GB > {args.mem_fraction:g} x "
                        f"{free / 1e9:.1f} GB free")
                ctx.say(f"batch {batch} context {context}: {note}")
                rows.append(dict(kind="decode", model=args.model, tp=args.tp, layers=spec.layers, batch=batch,
                                 context=context, note=note))
                continue
            row = _decode_point(ctx, model, backends, batch, context)
            if bw == bw:   # a rank whose probe failed (NaN): no floor
                _add_floor(row, spec, args, bw)
            rows.append(row)
            ctx.say("ROW " + " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()))
    if args.prompt:
        for row in _prefill_rows(ctx, model, backends):
            rows.append(row)
            ctx.say("ROW " + " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()))
    if ctx.rank == 0:
        _write(args, rows, ctx.notes, spec)
    if args.tp > 1:
        ctx.barrier()
        sys.stdout.flush()
        sys.stderr.flush()
        # no process-group teardown: graphs that captured NCCL and Iris calls can make it hang, and
        # everything is written
        os._exit(0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
