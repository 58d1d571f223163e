"""What the fused GEMM + all-reduce's traffic costs when a tile leaves as an asynchronous TMA store.

The fused kernel (matmul_all_reduce, FLAT tile pairs) spends 50-70 us more than its own GEMM at
the TP prefill's shapes; `mar_sweep.py`'s ``nowait`` column puts most of that on the pushes
themselves (16-byte remote stores issued by the warps that run the MMA), not on the waits. Here
the warp-specialised GEMM (kernels/gemm_ws.py) stores each tile into its local C and, from the
same shared-memory tile, into a twin of C in the peer's symmetric heap (PEER_PUSH): the same
bytes over the link as the exchange (every tile once), issued by TMA, which the consumer
warpgroups never wait on for more than the shared-memory read. Columns (us, CUDA-graph replays,
two ranks): cuBLAS, numasched.matmul, the WS GEMM, the WS GEMM + peer push, the same second
store into a twin in our own memory (what a second TMA store costs without the link), the peer
push paced (64-column chunks spread over the next tile's K loop), the fused
matmul_all_reduce (default) and its no-exchange time. The peer's copy is checked after the runs.
Run: NCCL_NVLS_ENABLE=0 torchrun --nproc-per-node 2 scripts/ws_push_probe.py [MxNxK,...]
"""
import sys

import torch
import torch.distributed as dist

import numasched
import numasched.distributed as nd
from numasched.bench.common import dist_graph_us, init_rank
from numasched.distributed._common import run
from numasched.distributed._ws import peer_address
from numasched.gemm_ws import WsGemmPlan

SHAPES = "4096x4096x2048,4096x4096x7168,16384x4096x2048,1024x4096x2048,4096x14336x4096"


def main():
    R, W = init_rank()
    assert W == 2, "two ranks"
    ctx = nd.init(heap_bytes=16 << 30, timeout_s=30.0)
    peer = 1 - R
    shapes = sys.argv[1] if len(sys.argv) > 1 else SHAPES
    if R == 0:
        print(f"# {torch.cuda.get_device_name()} x {W}, torch {torch.__version__}", flush=True)
    for spec in shapes.split(","):
        M, N, K = (int(v) for v in spec.split("x"))
        torch.manual_seed(R + 11)
        a = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16) / K ** 0.5
        b = w.T
        out = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
        twin = ctx.alloc((M, N), torch.bfloat16, what="ws_push_probe twin")   # the peer writes here
        peer_ptr = peer_address(ctx, twin).data_ptr()   # the peer's twin (same offset in its heap)
        ws = WsGemmPlan(a, b, out)
        ws_push = WsGemmPlan(a, b, out, peer_out_ptr=peer_ptr)
        ws_local = WsGemmPlan(a, b, out, peer_out_ptr=twin.data_ptr())   # the twin in our own memory
        ws_paced = WsGemmPlan(a, b, out, peer_out_ptr=peer_ptr, peer_paced=True)
        line = [f"{M}x{N}x{K}"]

        def timed(name, fn):
            try:
                t = dist_graph_us(fn, calls=3, iters=10)
                ctx.check("ws_push_probe")
                line.append(f"{name} {t:.1f}")
            except Exception as e:  # noqa: BLE001 - a failing column is reported, the rest still run
                line.append(f"{name} ERR {type(e).__name__}: {str(e)[:100]}")

        timed("cublas", lambda: torch.matmul(a, b, out=out))
        timed("ns_gemm", lambda: numasched.matmul(a, b, out=out))
        timed("ws", lambda: ws.run(a, b, out))
        timed("ws_push", lambda: ws_push.run(a, b, out))
        timed("ws_push_local", lambda: ws_local.run(a, b, out))
        timed("ws_push_paced", lambda: ws_paced.run(a, b, out))
        out2 = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
        timed("fused", lambda: run(ctx, "matmul_all_reduce", a, b, out=out2, check=False))
        timed("fused_noremote", lambda: run(ctx, "matmul_all_reduce", a, b, out=out2, check=False,
                                            communicate=False))
        # the peer's copy: after one more push and a barrier, our twin holds the peer's C
        theirs = [torch.empty_like(out) for _ in range(W)]
        for name, plan in (("push", ws_push), ("paced", ws_paced)):
            twin.fill_(float("nan"))
            torch.cuda.synchronize()
            dist.barrier()
            plan.run(a, b, out)
            torch.cuda.synchronize()
            dist.barrier()
            dist.all_gather(theirs, out)
            line.append(f"{name} copy " + ("exact" if torch.equal(twin, theirs[peer]) else "WRONG"))
        if R == 0:
            print(" | ".join(line), flush=True)
        dist.barrier()


if __name__ == "__main__":
    main()
