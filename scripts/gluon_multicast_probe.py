"""Whether this Triton's Gluon turns a TMA load into a CTA cluster's multicast on Hopper (offline,
no GPU): a 64 x 64 bf16 box loaded into a shared tile replicated over a cluster of ``--ctas`` CTAs
(``num_ctas``, CTA-broadcast layouts), compiled for sm_90; prints whether the PTX copy carries
``.multicast::cluster``. cuBLAS's kernels at the medium-M GEMM shapes run in clusters whose TMA
loads feed every CTA with one L2 read (bench/results/README.md, forty-sixth session); with
Triton 3.6 the copy compiles once per CTA, without multicast.

Run: python3 scripts/gluon_multicast_probe.py [--ctas 2]"""
from __future__ import annotations

import argparse


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ctas", type=int, default=2, help="CTAs per cluster (num_ctas), a power of two >= 2")
    args = p.parse_args(argv)
    if args.ctas < 2 or args.ctas & (args.ctas - 1):
        p.error(f"--ctas must be a power of two >= 2, got {args.ctas}")
    import triton
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma

    from numasched import portability as P

    bits = args.ctas.bit_length() - 1
    bar_layout = gl.constexpr(mbarrier.MBarrierLayout(cga_layout=[[0]] * bits))
    reg_layout = gl.constexpr(gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0], cga_layout=[[0, 0]] * bits))

    @gluon.jit
    def probe(a_desc, out_ptr):
        smem = gl.allocate_shared_memory(a_desc.dtype, a_desc.block_type.shape, a_desc.layout)
        bar = gl.allocate_shared_memory(gl.int64, [1], bar_layout)
        mbarrier.init(bar, count=1)
        mbarrier.expect(bar, a_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(a_desc, [0, 0], bar, smem)
        mbarrier.wait(bar, 0)
        x = smem.load(reg_layout)
        r = gl.arange(0, 64, layout=gl.SliceLayout(1, reg_layout))
        c = gl.arange(0, 64, layout=gl.SliceLayout(0, reg_layout))
        gl.store(out_ptr + r[:, None] * 64 + c[None, :], x)

    shared = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2, cga_layout=[[0, 0]] * bits)
    values = {"a_desc": f"tensordesc<bf16[64, 64],{shared!r}>", "out_ptr": "*bf16"}
    sig, const, attrs = P._signature(probe, values)
    k = triton.compile(GluonASTSource(probe, sig, const, attrs), target=P.parse_target("sm90"),
                       options=dict(num_warps=4, num_stages=1, num_ctas=args.ctas))
    copies = [line.strip() for line in k.asm["ptx"].splitlines() if "cp.async.bulk.tensor" in line]
    multicast = any(".multicast::cluster" in line for line in copies)
    print(f"triton {triton.__version__}, num_ctas={args.ctas}: {len(copies)} TMA copy instruction(s), "
          f"multicast: {'yes' if multicast else 'no'}")
    for line in copies:
        print("  " + line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
