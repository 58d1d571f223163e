"""What a kernel boundary costs inside a CUDA graph, and what programmatic dependent launch (PDL)
saves of it (GPU, sm_90+).

A chain of N dependent Triton kernels (each reads the previous one's output and writes its own),
captured in one CUDA graph, replayed; the time per kernel for three launch kinds:

* plain: stream order (the next kernel starts after the previous one has finished and its
  launch has been processed);
* pdl: launched with ``launch_pdl=True`` (CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION),
  each kernel calling ``gdc_wait`` before it reads its input: the launch and the prologue
  overlap the previous kernel;
* pdl+trigger: as pdl, and each kernel calls ``gdc_launch_dependents`` at its start, so the next
  one is launched as soon as every program of this one has started.

Two kernel sizes: tiny (1 program, 4 KB) and decode-sized (132 programs x 64 KB read = 8.4 MB,
what a GEMV of a 4096 x 1024 bf16 weight reads). Output: one line per (size, kind), us per kernel.

    python scripts/pdl_probe.py [--chain 64] [--reps 200]
"""
from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from numasched.bench.common import capture, warm_up_for_capture


@triton.jit
def _step(X, Y, W, n_w, PDL: tl.constexpr, TRIGGER: tl.constexpr, BLOCK: tl.constexpr, WBLOCK: tl.constexpr):
    pid = tl.program_id(0)
    if TRIGGER:
        gdc_launch_dependents()
    # the weight-like read does not depend on the previous kernel: it may start before the wait
    acc = tl.zeros([WBLOCK], tl.float32)
    for i in range(0, n_w, WBLOCK):
        offs = pid * n_w + i + tl.arange(0, WBLOCK)
        acc += tl.load(W + offs).to(tl.float32)
    if PDL:
        gdc_wait()
    offs = tl.arange(0, BLOCK)
    x = tl.load(X + offs)
    tl.store(Y + pid * BLOCK + offs, x + tl.sum(acc, 0) * 0.0 + 1.0)


def run(chain: int, reps: int, programs: int, w_per_prog: int) -> dict:
    dev = "cuda"
    block = 1024
    bufs = [torch.zeros(programs * block, device=dev) for _ in range(chain + 1)]
    w = torch.randn(max(1, programs * w_per_prog), device=dev).to(torch.bfloat16)
    res = {}
    for kind, pdl, trig in (("plain", False, False), ("pdl", True, False), ("pdl+trigger", True, True)):
        def launch_all():
            for i in range(chain):
                _step[(programs,)](bufs[i], bufs[i + 1], w, w_per_prog, PDL=pdl, TRIGGER=trig, BLOCK=block,
                                   WBLOCK=1024, launch_pdl=pdl, num_warps=4)
        launch_all()
        torch.cuda.synchronize()
        assert torch.all(bufs[chain] == bufs[0][:block].repeat(programs) + chain), kind  # every step ran in order
        warm_up_for_capture(launch_all)
        g = capture(launch_all)
        for b in bufs[1:]:
            b.zero_()
        g.replay()
        torch.cuda.synchronize()
        ok = bool(torch.all(bufs[chain] == bufs[0][:block].repeat(programs) + chain))
        for _ in range(10):
            g.replay()
        st, en = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        st.record()
        for _ in range(reps):
            g.replay()
        en.record()
        torch.cuda.synchronize()
        res[kind] = (st.elapsed_time(en) * 1e3 / reps / chain, ok)
    return res


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--chain", type=int, default=64)
    p.add_argument("--reps", type=int, default=200)
    a = p.parse_args()
    print(torch.cuda.get_device_name(0), torch.__version__, triton.__version__)
    for name, progs, wpp in (("tiny (1 program, no weight)", 1, 0), ("decode-sized (132 x 64 KB)", 132, 32768)):
        for kind, (us, ok) in run(a.chain, a.reps, progs, max(wpp, 1024) if wpp else 1024).items():
            print(f"{name:30s} {kind:12s} {us:7.2f} us per kernel   graph result {'ok' if ok else 'WRONG'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
