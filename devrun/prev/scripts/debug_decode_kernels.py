"""GPU check of packed vs native-unpacked decode (they must give bit-identical logits): finds the first step
whose logits differ and says whether the stored rows or the computation over them differ first.

Usage (on a GPU machine): PYTHONPATH=src python3 scripts/debug_decode_kernels.py [model] [tokens]
"""

import sys

import torch

import ds4x.model.attention as attention
from ds4x.formats import unpack_indexer_rows, unpack_kv_rows
from ds4x.runtime.engine import Engine


def stored_rows_differ(native, packed, length: int, cfg) -> list[str]:
    """Stores whose rows in use differ between the native cache and the unpacked packed cache."""
    out, rd = [], cfg.rope_head_dim
    for i, (a, b) in enumerate(zip(native.layers, packed.layers, strict=True)):
        ratio = cfg.compress_ratios[i]
        lo = max(0, length - cfg.sliding_window)
        pos = torch.arange(lo, length, device=a.raw.data.device)
        if not torch.equal(a.raw.data[pos], unpack_kv_rows(b.raw.data[pos % b.raw.capacity], rope_dim=rd)):
            out.append(f"layer {i} raw")
        if ratio:
            n = length // ratio
            if not torch.equal(a.comp_rows.data[:n], unpack_kv_rows(b.comp_rows.data[:n], rope_dim=rd)):
                out.append(f"layer {i} comp_rows ({n})")
            if a.idx_rows is not None and not torch.equal(a.idx_rows.data[:n],
                                                          unpack_indexer_rows(b.idx_rows.data[:n])):
                out.append(f"layer {i} idx_rows ({n})")
    return out


def main() -> None:
    model = sys.argv[1] if len(sys.argv) > 1 else "tiny"
    n_tokens = int(sys.argv[2]) if len(sys.argv) > 2 else 150
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":  # the Triton decode path in the interpreter (TRITON_INTERPRET=1), to check this script
        attention.use_triton = lambda dev: True
    engine = Engine.load(model, device=device)
    ids = torch.randint(3, 259, (n_tokens,), generator=torch.Generator().manual_seed(1)).tolist()
    outs: dict[str, list[torch.Tensor]] = {}
    decode = attention._decode_triton

    def record(step, q, mode):
        out = decode(step, q)
        outs.setdefault(mode, []).append(out.clone())
        return out

    sessions = {m: engine.new_session(ctx=512, cache=m, prefill_chunk=32, prefill_mode="exact") for m in
                ("native", "packed")}
    for t, tok in enumerate(ids):
        logits = {}
        for mode, s in sessions.items():
            outs[mode] = []
            attention._decode_triton = lambda step, q, m=mode: record(step, q, m)
            logits[mode] = s.step(tok)
        if not torch.equal(logits["native"], logits["packed"]):
            print(f"step {t}: logits differ, max {float((logits['native'] - logits['packed']).abs().max()):.3e}")
            print("  stored rows that differ:", stored_rows_differ(sessions["native"].cache, sessions["packed"].cache,
                                                                   t + 1, engine.cfg) or "none")
            for layer, (a, b) in enumerate(zip(outs["native"], outs["packed"], strict=True)):
                if not torch.equal(a, b):
                    print(f"  first attention output that differs: layer {layer} ({engine.cfg.attn_kinds[layer]}), "
                          f"max {float((a - b).abs().max()):.3e}")
                    break
            return
    print(f"all {n_tokens} steps bit-identical")


if __name__ == "__main__":
    main()
