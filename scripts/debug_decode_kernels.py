"""GPU check of the decode kernels: packed vs float-row paths, error vs torch, and timing per block size.

Usage (on a GPU machine): PYTHONPATH=src python3 scripts/debug_decode_kernels.py
"""

import torch
import triton.testing

from ds4x.formats import hadamard128, mxfp4_roundtrip, pack_indexer_rows, pack_kv_rows, unpack_kv_rows
from ds4x.kernels.attention import attention_decode_triton
from ds4x.kernels.indexer import indexer_scores_triton


def main() -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    H, D = 64, 512
    rows = pack_kv_rows(torch.randn(8320, D, generator=g, device="cuda") * 3)
    plain = unpack_kv_rows(rows).contiguous()
    q = torch.randn(H, D, generator=g, device="cuda")
    sinks = torch.randn(H, generator=g, device="cuda")
    idx = torch.arange(8320, device="cuda")
    probs = torch.cat([q @ plain.T * D**-0.5, sinks[:, None]], 1).softmax(-1)
    ref = probs[:, :-1] @ plain
    for rps in (16, 32, 64, 128):  # rows per program; only 64 was measured bit-identical (first H200 run)
        out_p = attention_decode_triton(q, [(rows, idx)], sinks, D**-0.5, 448, True, rps)
        out_f = attention_decode_triton(q, [(plain, idx)], sinks, D**-0.5, 448, False, rps)
        t = triton.testing.do_bench(lambda r=rps: attention_decode_triton(q, [(rows, idx)], sinks, D**-0.5, 448,
                                                                          True, r), return_mode="median")
        print(f"attn rows/split {rps}: packed==float {torch.equal(out_p, out_f)} "
              f"max|p-f| {float((out_p - out_f).abs().max()):.2e} err {float((out_p - ref).abs().max()):.2e} "
              f"time {1000 * t:.1f} us")
    n = 262144
    irows = pack_indexer_rows(hadamard128(torch.randn(n, 128, generator=g, device="cuda")))
    qi = mxfp4_roundtrip(hadamard128(torch.randn(64, 128, generator=g, device="cuda")), 32)
    wi = torch.randn(64, generator=g, device="cuda")
    for bn in (64, 128, 256):
        t = triton.testing.do_bench(lambda b=bn: indexer_scores_triton(qi, wi, irows, n, True, b), return_mode="median")
        print(f"indexer block {bn}: {1000 * t:.1f} us, {n * 68 / t / 1e6:.0f} GB/s")


if __name__ == "__main__":
    main()
