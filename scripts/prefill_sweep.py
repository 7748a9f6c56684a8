"""Prefill pieces at DeepSeek-V4-Flash shapes on one GPU, timed with triton's do_bench (median):

- routed experts: the skinny tl.dot kernel (``quant_matmul_routed`` forced to it) against decoding the experts to
  bf16 (``dequantize_gpu``) and ``torch._grouped_mm`` (random valid blocks, random top-6 routing over 256 experts);
- attention of a chunk of queries over packed rows (``attention_prefill_triton``): blockings, against the torch
  reference on one layer's shapes (window 128 + CSA top-512, or HCA prefix rows).

    PYTHONPATH=src python scripts/prefill_sweep.py [--attention] [tokens ...]
"""

from __future__ import annotations

import sys

import torch
from triton.testing import do_bench

from ds4x.formats.ggml import GGMLQuantizationType as T
from ds4x.formats.ggml import random_blocks
from ds4x.formats.ggml_tensor import GGMLTensor
from ds4x.kernels import quant_matmul as qm


def _ms(fn) -> float:
    return do_bench(fn, warmup=5, rep=50, return_mode="median")


def main(token_counts: list[int]) -> None:
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    n_exp, k_sel = 256, 6
    table = []
    cases = (("gate IQ2_XXS 4096->2048", T.IQ2_XXS, 2048, 4096, False),
             ("down Q2_K 2048->4096", T.Q2_K, 4096, 2048, True))
    for name, qt, n, k, down in cases:
        w = GGMLTensor(random_blocks(qt, (n_exp, n, k), gen, std=0.02), qt, (n_exp, n, k))
        same = torch.equal(qm.dequantize_gpu(w, torch.bfloat16, slice(3, 5)), w[3:5].dequantize(torch.bfloat16))
        scratch = torch.empty(n_exp * n * k, dtype=torch.bfloat16, device=dev)
        t_deq = _ms(lambda w=w, s=scratch: qm.dequantize_gpu(w, torch.bfloat16, out=s))
        table.append((name, "-", "dequantize_gpu all experts", t_deq,
                      f"{(w.nbytes + scratch.numel() * 2) / t_deq / 1e6:.0f} GB/s; bf16 bit-exact {same}"))
        for tokens in token_counts:
            ids = torch.rand(tokens, n_exp, device=dev, generator=gen).topk(k_sel, dim=1).indices.to(torch.int32)
            rows, ids = (tokens * k_sel, ids.view(-1, 1)) if down else (tokens, ids)
            x = torch.randn(rows, k, device=dev, generator=gen).to(torch.bfloat16)
            y_mm = qm.quant_matmul_routed(x, w, ids, force="mm").view(-1, n).float()
            for cfg in (None, (64, 128, 64, 8), (64, 64, 64, 4), (128, 128, 64, 8)):
                t = _ms(lambda c=cfg, x=x, w=w, i=ids: qm.quant_matmul_routed(x, w, i, config=c, force="mm"))
                label = cfg or qm.matmul_config(qt, tokens * k_sel, n, k)
                table.append((name, tokens, f"skinny tl.dot {label}{' (default)' if cfg is None else ''}", t, ""))
            y = qm.quant_matmul_routed(x, w, ids).view(-1, n).float()
            err = float((y - y_mm).norm() / y_mm.norm())
            table.append((name, tokens, "quant_matmul_routed: bf16 decode + grouped GEMM (the model's path)",
                          _ms(lambda x=x, w=w, i=ids: qm.quant_matmul_routed(x, w, i)),
                          f"rel diff vs skinny {err:.1e}"))
        del w, scratch
        torch.cuda.empty_cache()

    # a Q8_0 attention projection at prefill: torch dequantize vs dequantize_gpu, then the dense GEMM
    w = GGMLTensor(random_blocks(T.Q8_0, (32768, 1024), gen, std=0.02), T.Q8_0, (32768, 1024))
    table.append(("wq_b Q8_0 1024->32768", "-", "torch dequantize(bf16)", _ms(lambda: w.dequantize(torch.bfloat16)),
                  ""))
    table.append(("wq_b Q8_0 1024->32768", "-", "dequantize_gpu bf16", _ms(lambda: qm.dequantize_gpu(w)),
                  f"bit-exact {torch.equal(qm.dequantize_gpu(w), w.dequantize(torch.bfloat16))}"))
    wd = qm.dequantize_gpu(w)
    x = torch.randn(2048, 1024, device=dev, generator=gen).to(torch.bfloat16)
    table.append(("wq_b Q8_0 1024->32768", 2048, "F.linear bf16", _ms(lambda: torch.nn.functional.linear(x, wd)), ""))
    print("\n| case | tokens | path | ms | note |\n|---|---|---|---|---|")
    for row in table:
        print(f"| {row[0]} | {row[1]} | {row[2]} | {row[3]:.3f} | {row[4]} |")


def attention(token_counts: list[int]) -> None:
    table = []
    gen = torch.Generator(device="cuda").manual_seed(1)
    for tokens in token_counts:
        table += _attention_case(tokens, gen)
    print("\n| layer | tokens | attention | ms | note |\n|---|---|---|---|---|")
    for row in table:
        print(f"| {row[0]} | {row[1]} | {row[2]} | {row[3]:.3f} | {row[4]} |")


def _attention_case(tokens: int, gen: torch.Generator) -> list[tuple]:
    """One CSA and one HCA layer's attention for a chunk of ``tokens`` queries after a context of 2 x tokens."""
    from ds4x.formats import pack_kv_rows, unpack_kv_rows
    from ds4x.kernels.attention import attention_prefill_triton

    dev = torch.device("cuda")
    heads, dim, w, k = 64, 512, 128, 512
    p0 = 2 * tokens
    ring = -(-(128 + tokens) // 256) * 256
    n_comp = (p0 + tokens) // 4
    ring_rows = pack_kv_rows(torch.randn(ring, dim, device=dev, generator=gen))
    comp = pack_kv_rows(torch.randn(n_comp, dim, device=dev, generator=gen))
    positions = torch.arange(p0, p0 + tokens, device=dev)
    q = torch.randn(tokens, heads, dim, device=dev, generator=gen).bfloat16().float()
    sinks = torch.randn(heads, device=dev, generator=gen)
    index = torch.rand(tokens, n_comp, device=dev, generator=gen).topk(k, dim=1).indices.to(torch.int32)
    plain_ring, plain_comp = unpack_kv_rows(ring_rows), unpack_kv_rows(comp)
    window_keys = plain_ring[torch.arange(p0 - w + 1, p0 + tokens, device=dev) % ring]

    def reference(kw: dict) -> torch.Tensor:
        # the torch reference's work for the same layer: float rows, einsum logits, softmax, weighted sum
        logits = torch.einsum("thd,kd->thk", q, window_keys)
        if "index" in kw:
            picked = plain_comp[kw["index"].long()]
            probs = torch.cat([logits, torch.einsum("thd,tkd->thk", q, picked)], -1).softmax(-1)
            return (torch.einsum("thk,kd->thd", probs[..., : window_keys.shape[0]], window_keys)
                    + torch.einsum("thk,tkd->thd", probs[..., window_keys.shape[0]:], picked))
        keys = torch.cat([window_keys, plain_comp[: kw["n_rows"]]])
        return torch.einsum("thk,kd->thd", torch.einsum("thd,kd->thk", q, keys).softmax(-1), keys)

    def kernel(kw: dict, config: tuple[int, int, int] | None) -> torch.Tensor:
        # None: on Hopper the decode kernel over the chunk in one pass
        return attention_prefill_triton(q, positions, (ring_rows, ring, w), comp, sinks, dim**-0.5, dim - 64,
                                        config=config, **kw)

    table = []
    for name, kw in {"csa": {"index": index}, "hca": {"ratio": 128, "n_rows": (p0 + tokens) // 128}}.items():
        table.append((name, tokens, "torch reference (shape of the work)", _ms(lambda kw=kw: reference(kw)), ""))
        first = None
        for cfg in ((16, 16, 4), (16, 16, 8), None):
            label = f"triton {cfg}" if cfg else "wgmma, one pass (default on Hopper)"
            try:
                out = kernel(kw, cfg)
                first = out if first is None else first
                table.append((name, tokens, label, _ms(lambda kw=kw, c=cfg: kernel(kw, c)),
                              f"relative difference to the first {float((out - first).norm() / first.norm()):.1e}"))
            except Exception as exc:  # noqa: BLE001
                table.append((name, tokens, label, float("nan"), f"{type(exc).__name__}: {exc}"[:80]))
    return table


if __name__ == "__main__":
    only_attention = sys.argv[1:2] == ["--attention"]
    counts = [int(a) for a in sys.argv[1 + only_attention:]] or [2048, 4096]
    if not only_attention:
        main(counts)
    attention(counts)
