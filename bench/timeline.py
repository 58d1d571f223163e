"""Where a CUDA graph's time goes, kernel by kernel: the kernels' own time, by kind, and the idle
time between them (the kernel-boundary tax measured, not inferred).

    intervals = kernel_intervals(graph.replay, steps=8)   # [(name, start_us, end_us), ...] (GPU)
    s = summarize(intervals, steps=8)                      # per step: span, busy, gap, by kind

``kernel_intervals`` replays ``fn`` under torch.profiler (CUDA activity: CUPTI records each kernel
of a graph replay) and returns the kernels it saw. ``summarize`` is plain arithmetic on them
(tested on CPU): ``span`` is first start to last end over the steps, ``busy`` the union of the
kernels' intervals (kernels that overlap, e.g. under programmatic dependent launch, count once),
``gap`` = span - busy: time in which no kernel of the graph ran, ``by_kind`` each kind's
summed kernel time (overlaps counted in each kernel: under PDL a kernel's time includes its wait
for the one before), and ``own_by_kind`` each kind's share of the busy time: a kernel owns the
time by which it moves the end of the work done so far (its end minus the later of its start and
the latest end before it), so a kernel that launched early and waited costs only what it added
and the owned times sum to ``busy``; all per step in ms.
"""
from __future__ import annotations

from typing import Callable, Dict, List, Optional, Sequence, Tuple

# kernel-name fragment -> kind (first match wins; Triton names kernels after their functions, so
# numasched's own GEMMs come before the generic "gemm" of cuBLAS's names)
KINDS = (
    ("gemm_splitk", "gemm (numasched split-K)"),
    ("gemm_streamk", "gemm (numasched stream-K)"),
    ("matmul_all_reduce", "gemm + all-reduce (fused)"),
    ("all_gather_matmul", "all-gather + gemm (fused)"),
    ("matmul_reduce_scatter", "gemm + reduce-scatter (fused)"),
    ("gemm_ws", "gemm (numasched WS)"),
    ("weight_first", "gemm (numasched weight-first)"),
    ("glu_persistent", "gemm (numasched SwiGLU)"),
    ("gemm_kernel", "gemm (numasched tiled)"),
    ("all_reduce_add_rmsnorm", "all-reduce + add + norm"),
    ("all_reduce", "all-reduce"),
    ("flash_decode", "decode attention"),
    ("combine", "decode attention"),
    ("qkv_rope_cache", "rope + cache write"),
    ("swiglu", "swiglu"),
    ("nccl", "nccl"),
    ("gemm", "gemm (cuBLAS)"),
    ("nvjet", "gemm (cuBLAS)"),        # cuBLASLt's Hopper kernels (torch 2.11's F.linear)
    ("splitkreduce", "gemm (cuBLAS)"),
    ("sm90_xmma", "gemm (cuBLAS)"),
    ("cutlass", "gemm (cuBLAS)"),
    ("cudnn", "attention (cuDNN)"),
    ("fmha", "attention (cuDNN)"),
    ("flash", "attention (flash)"),
    ("attn_fwd", "prefill attention (numasched)"),
    ("batchdecode", "attention (FlashInfer)"),
    ("batchprefill", "attention (FlashInfer)"),
    ("triton_", "elementwise (compiled)"),
    ("elementwise", "elementwise (torch)"),
    ("reduce", "elementwise (torch)"),
    ("index", "elementwise (torch)"),
    ("copy", "copy"),
    ("memcpy", "copy"),
    ("memset", "copy"),
)


def kind_of(name: str) -> str:
    low = name.lower()
    for frag, kind in KINDS:
        if frag in low:
            return kind
    return "other"


def is_gemm(kind: str) -> bool:
    """Whether a kind is a GEMM launch (alone or fused with a collective)."""
    return kind.startswith("gemm") or kind.startswith("all-gather + gemm")


def summarize(intervals: Sequence[Tuple[str, float, float]], steps: int,
              gemm_roles: Optional[Sequence[str]] = None) -> Dict[str, object]:
    """Per-step span, busy and gap (ms) and each kind's kernel time (ms) of ``intervals`` (name,
    start us, end us) recorded over ``steps`` replays.

    gemm_roles: the role of each GEMM launch of one step in launch order (a decoder's: "qkv", "o",
    "gate_up", "down" per layer, then "lm_head"). Where every step has exactly that many GEMM
    launches, ``by_role`` / ``own_by_role`` give each role's time per step as ``by_kind`` does;
    otherwise (a library that splits a GEMM into several launches) ``by_role`` is None."""
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    if not intervals:
        return dict(span_ms=0.0, busy_ms=0.0, gap_ms=0.0, kernels=0, by_kind={})
    iv = sorted((float(s), float(e), n) for n, s, e in intervals)
    busy, cur_s, cur_e = 0.0, iv[0][0], iv[0][1]
    for s, e, _ in iv[1:]:
        if s > cur_e:
            busy += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    busy += cur_e - cur_s
    span = max(e for _, e, _ in iv) - iv[0][0]
    by_kind: Dict[str, float] = {}
    own: Dict[str, float] = {}
    gemms = []   # (raw, owned) of each GEMM launch, in launch order
    frontier = iv[0][0]
    for s, e, n in iv:
        k = kind_of(n)
        raw, owned = (e - s) / 1e3 / steps, max(0.0, e - max(s, frontier)) / 1e3 / steps
        by_kind[k] = by_kind.get(k, 0.0) + raw
        own[k] = own.get(k, 0.0) + owned
        if is_gemm(k):
            gemms.append((raw, owned))
        frontier = max(frontier, e)
    out = dict(span_ms=span / 1e3 / steps, busy_ms=busy / 1e3 / steps, gap_ms=(span - busy) / 1e3 / steps,
               kernels=len(iv) / steps, by_kind=dict(sorted(by_kind.items(), key=lambda kv: -kv[1])),
               own_by_kind=dict(sorted(own.items(), key=lambda kv: -kv[1])))
    if gemm_roles is not None:
        by_role: Optional[Dict[str, float]] = None
        own_role: Optional[Dict[str, float]] = None
        if gemm_roles and len(gemms) == steps * len(gemm_roles):   # the steps' launches in order
            by_role, own_role = {}, {}
            for i, (raw, owned) in enumerate(gemms):
                role = gemm_roles[i % len(gemm_roles)]
                by_role[role] = by_role.get(role, 0.0) + raw
                own_role[role] = own_role.get(role, 0.0) + owned
        out.update(by_role=by_role, own_by_role=own_role, gemm_launches=len(gemms) / steps)
    return out


def kernel_intervals(fn: Callable[[], object], steps: int = 8) -> List[Tuple[str, float, float]]:
    """The kernels ``steps`` calls of ``fn`` ran (a graph's replay: each kernel of the graph), as
    (name, start us, end us), from torch.profiler's CUDA activity (GPU only)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    out = []
    for ev in prof.events():
        dev = getattr(ev, "device_type", None)
        if dev is None or "CUDA" not in str(dev):
            continue
        tr = ev.time_range
        if tr.end > tr.start:
            out.append((ev.name, float(tr.start), float(tr.end)))
    return out


def describe(s: Dict[str, object], top: int = 8) -> str:
    """One line: span, busy, gap, kernels per step and the largest kinds."""
    if not s["kernels"]:
        return "no kernels recorded (the profiler's CUDA activity saw none of the replays)"
    own = s.get("own_by_kind", {})
    kinds = ", ".join(f"{k} {v:.3f}" + (f" (owns {own[k]:.3f})" if k in own else "")
                      for k, v in list(s["by_kind"].items())[:top])
    text = (f"span {s['span_ms']:.3f} ms, kernels busy {s['busy_ms']:.3f}, idle between kernels {s['gap_ms']:.3f} "
            f"({s['kernels']:.0f} kernels a step); by kind (ms): {kinds}")
    if s.get("by_role"):
        text += "; GEMMs by role (owned ms): " + ", ".join(f"{k} {v:.3f}" for k, v in s["own_by_role"].items())
    elif "by_role" in s:
        text += f"; GEMMs by role: not matched ({s['gemm_launches']:g} GEMM launches a step)"
    return text
