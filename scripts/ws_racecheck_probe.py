"""Does compute-sanitizer's racecheck flag Triton's warp-specialisation hand-off itself?

A minimal Gluon kernel: one default partition (4 warps) and one worker (1 warp), each storing
its own global words, no shared memory of the kernel's own. If racecheck reports a hazard here
between the kernel's entry and the warp_specialize point, as it does for gemm_ws_kernel and
gemm_ws_streamk_kernel (bench/results/sanitizer-s61/), the hazard is the lowering's partition
hand-off, not those kernels' code. sm_90; run under `compute-sanitizer --tool racecheck`."""
import sys

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl


@gluon.jit
def _default(out):
    lay: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    offs = gl.arange(0, 128, layout=lay)
    gl.store(out + offs, gl.full([128], 1.0, gl.float32, lay))


@gluon.jit
def _worker(out):
    lay: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
    offs = gl.arange(0, 32, layout=lay)
    gl.store(out + 128 + offs, gl.full([32], 2.0, gl.float32, lay))


@gluon.jit
def ws_probe_kernel(out):
    gl.warp_specialize([(_default, (out,)), (_worker, (out,))], [1], [48])


if __name__ == "__main__":
    out = torch.zeros(160, device="cuda")
    ws_probe_kernel[(2,)](out, num_warps=4)
    torch.cuda.synchronize()
    ok = bool((out[:128] == 1).all() and (out[128:] == 2).all())
    print("ws probe", "ok" if ok else f"WRONG {out.tolist()}", flush=True)
    sys.exit(0 if ok else 1)
