#!/usr/bin/env python3
"""One decode kernel at Flash shapes, launched a few times, for Nsight Compute to profile (CUDA). Each case builds
its inputs (random, seeded), compiles the kernel with one call, then launches it ``--launches`` times; `ncu`
profiles the launch it is told to (``bash scripts/device_ab.sh ncu`` runs every case under
``ncu --launch-skip 2 --launch-count 1`` with the kernel name below and prints the sections that say what bounds
it: its throughput per unit, the memory tables' warnings (bank conflicts, sector use), the schedulers' state).

    PYTHONPATH=src python scripts/ncu_cases.py CASE [--launches 4]
    PYTHONPATH=src python scripts/ncu_cases.py --list      # the cases and the kernel name ncu should select

The attention cases are `scripts/compressed_kernels_ab.py`'s (the model's bf16 query).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

import torch

# case -> (kernel name for ncu's --kernel-name regex:..., what it is)
CASES = {
    "indexer": ("score_kernel", "Gluon indexer scoring, one query, 262,144 packed rows (a CSA layer at 1M)"),
    "select": ("radix_kernel", "exact top-512 of 262,144 scores, the fused multi-program select"),
    "attention_window": ("partial_kernel", "Hopper decode attention, window 128 (its partial pass)"),
    "attention_csa": ("partial_kernel", "Hopper decode attention, CSA window + top-512 at 1M"),
    "attention_hca": ("partial_kernel", "Hopper decode attention, HCA window + 8,194 rows at 1M"),
    "attention_merge": ("combine_kernel", "the merge of HCA at 1M's splits"),
    "routed_gate_up": ("_qmv_kernel", "routed IQ2_XXS gate / up + SwiGLU matvec, 1 token x 6 of 256 experts"),
    "routed_down": ("_qmv_kernel", "routed Q2_K down matvec, 1 token x 6 of 256 experts"),
    "wq_a": ("_qmv_kernel", "Q8_0 matvec 4096 -> 1024 (the attention's wq_a), 1 token"),
    "routed_prompt_gate": ("_routed_wgmma_kernel", "routed IQ2_XXS gate on the tensor cores, 1,024 tokens x 6 experts"),
    "routed_prompt_down": ("_routed_wgmma_kernel", "routed Q2_K down on the tensor cores, 1,024 tokens x 6 experts"),
}


def build(case: str, g: torch.Generator, dev: torch.device) -> Callable[[], object]:
    """The call that launches ``case``'s kernel once on ``dev`` (built on the CPU too, where the paths differ)."""
    if case in ("indexer", "select"):
        from ds4x.formats import hadamard128, mxfp4_roundtrip, pack_indexer_rows
        from ds4x.kernels.indexer import indexer_scores_triton
        from ds4x.kernels.select import select_topk_radix

        n = 262_144
        q = mxfp4_roundtrip(hadamard128(torch.randn(64, 128, generator=g, device=dev)))
        w = torch.rand(64, generator=g, device=dev)
        packed = pack_indexer_rows(mxfp4_roundtrip(hadamard128(torch.randn(n, 128, generator=g, device=dev))))
        if case == "indexer":
            return lambda: indexer_scores_triton(q, w, packed, n, True)
        scores = indexer_scores_triton(q, w, packed, n, True)
        return lambda: select_topk_radix(scores, n, 512)
    if case.startswith("attention"):
        sys.path.insert(0, str(Path(__file__).parent))
        from compressed_kernels_ab import attention_cases

        from ds4x.kernels.attention import attention_decode_triton

        heads, dim = 64, 512
        _, _, cases = attention_cases(g, str(dev))
        name = {"attention_window": "window 128", "attention_csa": "CSA top-512 @1M"}.get(case, "HCA 8194 rows @1M")
        q = torch.nn.functional.rms_norm(torch.randn(heads, dim, generator=g, device=dev), (dim,)).bfloat16()
        sinks = torch.randn(heads, generator=g, device=dev)
        return lambda: attention_decode_triton(q, cases[name], sinks, dim**-0.5, dim - 64, True)
    from ds4x.formats.ggml import GGMLQuantizationType as T
    from ds4x.formats.ggml import random_blocks
    from ds4x.formats.ggml_tensor import GGMLTensor
    from ds4x.kernels import quant_matmul as qm

    if case == "wq_a":
        w = qm.kernel_layout(GGMLTensor(random_blocks(T.Q8_0, (1024, 4096), g, std=0.02), T.Q8_0, (1024, 4096)))
        x = torch.randn(1, 4096, generator=g, device=dev).bfloat16()
        return lambda: qm.quant_linear(x, w)
    n_exp, inter, hidden, k = 256, 2048, 4096, 6
    if case.startswith("routed_prompt"):  # a prompt's routed products: scripts/routed_wgmma_ab.py's weights
        from ds4x.kernels import routed_wgmma

        t = 1024
        if case == "routed_prompt_gate":
            w = qm.kernel_layout(GGMLTensor(random_blocks(T.IQ2_XXS, (n_exp, inter, hidden), g), T.IQ2_XXS,
                                            (n_exp, inter, hidden)))
        else:
            w = GGMLTensor(random_blocks(T.Q2_K, (n_exp, hidden, inter), g), T.Q2_K, (n_exp, hidden, inter))
        x = torch.randn(t, w.shape[2], generator=g, device=dev).bfloat16()
        ids = torch.stack([torch.randperm(n_exp, generator=g, device=dev)[:k] for _ in range(t)]).to(torch.int32)
        return lambda: routed_wgmma.routed_wgmma(x, w, ids, k)
    ids = torch.randperm(n_exp, generator=g, device=dev)[:k][None]
    if case == "routed_gate_up":
        w13 = qm.kernel_layout(GGMLTensor(random_blocks(T.IQ2_XXS, (2 * n_exp, inter, hidden), g), T.IQ2_XXS,
                                          (2 * n_exp, inter, hidden)))
        x = torch.randn(1, hidden, generator=g, device=dev).bfloat16()
        return lambda: qm.quant_routed_swiglu(x, w13, ids, 10.0)
    w2 = qm.kernel_layout(GGMLTensor(random_blocks(T.Q2_K, (n_exp, hidden, inter), g), T.Q2_K,
                                     (n_exp, hidden, inter)))
    h = (torch.randn(k, inter, generator=g, device=dev) * 0.1).bfloat16()
    return lambda: qm.quant_matmul_routed(h, w2, ids.reshape(k, 1))  # row i of h takes expert ids[i]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("case", nargs="?", choices=sorted(CASES))
    ap.add_argument("--launches", type=int, default=4, help="launches after the compiling call")
    ap.add_argument("--list", action="store_true", help="print each case and its kernel name, then exit")
    args = ap.parse_args(argv)
    if args.list:
        for case, (kernel, what) in CASES.items():
            print(f"{case} {kernel}  # {what}")
        return 0
    if args.case is None:
        ap.error("a case is needed (or --list)")
    if not torch.cuda.is_available():
        print("ncu_cases needs a CUDA GPU", file=sys.stderr)
        return 2
    call = build(args.case, torch.Generator(device="cuda").manual_seed(0), torch.device("cuda"))
    call()  # compiles
    torch.cuda.synchronize()
    for _ in range(args.launches):
        call()
    torch.cuda.synchronize()
    return 0


if __name__ == "__main__":
    sys.exit(main())
