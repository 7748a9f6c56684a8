#!/usr/bin/env python3
"""Parity and timing of every quantized matmul kernel at DeepSeek-V4-Flash decode shapes (CUDA): random valid
GGML blocks, each call on its own weight copy (no L2 reuse), one CUDA graph of the calls, median of the replays;
GB/s and the share of the measured copy bandwidth, with a relative-error check against float64 for each row and
batch-invariance checks. Exit status 1 if a check fails.

    PYTHONPATH=src python scripts/quant_matmul_bench.py [out.json | out_dir [deadline_s]]
"""

from __future__ import annotations

import sys
from typing import Any

import torch
import triton

from ds4x.bench.timing import graph_replay_us
from ds4x.formats.ggml import GGMLQuantizationType, quantized_nbytes
from ds4x.formats.ggml_tensor import GGMLTensor
from ds4x.kernels import quant_matmul as qm
from ds4x.kernels.quant_matmul import (
    MATVEC_MAX_ROWS,
    int8_activations,
    kernel_layout,
    matmul_config,
    matvec_config,
    quant_grouped_linear,
    quant_linear,
    quant_matmul_routed,
)

T = GGMLQuantizationType


# (what, type, N, K, form, extra matvec configs timed beside the default): DeepSeek-V4-Flash decode shapes.
# "grouped": wo_a, 8 groups of [1024, 4096], one x row per group; "expert": one routed expert, then 6 experts
# in one launch (the real decode step: gate/up share the token's x, down has one x row per expert)
CASES: tuple[tuple[str, GGMLQuantizationType, int, int, str, tuple[tuple[int, int, int], ...]], ...] = (
    # (4, 512, 4) and (8, 512, 4): all of K in one step, so the weights are still loaded before the PDL wait, with
    # fewer programs; faster here, not in the step (see `matvec_config`)
    ("attn wq_a 4096->1024", T.Q8_0, 1024, 4096, "linear", ((4, 256, 4), (8, 128, 4), (4, 512, 4))),
    # the step launches wq_a stacked with wkv (ds4x.model.projections): one product of 1,536 rows
    ("attn wq_a+wkv 4096->1536 stacked", T.Q8_0, 1536, 4096, "linear", ((4, 256, 4), (4, 512, 4), (8, 512, 4))),
    ("attn wq_b 1024->32768", T.Q8_0, 32768, 1024, "linear", ((16, 128, 4),)),
    ("attn wo_a 4096->8x1024 grouped", T.Q8_0, 8192, 4096, "grouped", ((4, 256, 4),)),
    ("attn wo_b 8192->4096", T.Q8_0, 4096, 8192, "linear", ((4, 256, 4),)),
    ("expert gate 4096->2048", T.IQ2_XXS, 2048, 4096, "expert", ((16, 128, 4),)),
    ("expert down 2048->4096", T.Q2_K, 4096, 2048, "expert", ((16, 32, 1),)),
    ("expert gate 4096->2048", T.Q4_K, 2048, 4096, "linear", ()),
)
ROWS = {(T.Q8_0, "attn wo_b 8192->4096"): (2, 4, 8, 16), (T.IQ2_XXS, "expert gate 4096->2048"): (8,)}
"""Activation rows (tokens for routed experts) timed with both kernels, to place MATVEC_MAX_ROWS."""


def run(out_json: str | None = None, deadline_s: float = 1e9) -> int:
    """Parity and timing of every case; no new case starts after ``deadline_s`` seconds. ``out_json``: the
    results file, or a directory to write ``quant_matmul.json`` into."""
    import json
    import time
    from pathlib import Path

    if not torch.cuda.is_available():
        print("quant_matmul_bench.py needs a CUDA device", file=sys.stderr)
        return 2
    if out_json and Path(out_json).is_dir():
        out_json = str(Path(out_json) / "quant_matmul.json")

    from triton.testing import do_bench

    from ds4x.formats.ggml import random_blocks

    t_start = time.perf_counter()
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    rows: list[dict[str, Any]] = []
    checks: list[dict[str, Any]] = []

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - t_start:6.1f}s] {msg}", flush=True)

    def copy_bandwidth() -> float:
        src = torch.randint(0, 255, (1 << 30,), dtype=torch.uint8, device=dev)
        dst = torch.empty_like(src)
        ms = do_bench(lambda: dst.copy_(src), warmup=25, rep=200, return_mode="median")
        return 2 * src.numel() / (ms * 1e-3) / 1e9

    copy_bw = copy_bandwidth()
    preload_default = qm.PRELOAD_WEIGHTS
    log(f"{torch.cuda.get_device_name()} copy bandwidth {copy_bw:.0f} GB/s (read + write of 1 GiB)")

    def timed(fns: list, nbytes: int) -> tuple[float, float]:
        # every call reads its own weight copy (no L2 reuse); one CUDA graph of all calls, median
        us = graph_replay_us(fns, rep_ms=40)
        return us, nbytes / (us * 1e-6) / 1e9

    def rel(y: torch.Tensor, ref: torch.Tensor) -> float:
        if not torch.isfinite(y).all():
            return float("nan")
        return float((y.double() - ref).norm() / ref.norm())

    def record(**kw: Any) -> None:
        rows.append(kw)
        tol = 2e-2 if "int8" in kw["kernel"] or (kw["kernel"] == "mv" and int8_activations(T[kw["qtype"]])) else \
            3e-3 if kw["kernel"] == "mm" else 1e-5
        if not kw["err"] < tol:
            check(f"{kw['qtype']} {kw['what']} M={kw['m']} {kw['kernel']} {kw['config']} parity", False,
                  f"rel err {kw['err']:.1e} >= {tol:.0e}")
        log(f"{kw['qtype']:8} {kw['what']:34} M={kw['m']:<2} {kw['kernel']:18} {str(kw['config']):14} "
            f"{kw['us']:8.2f} us {kw['gbs']:6.0f} GB/s {kw['frac']:6.1%}  err {kw['err']:.1e}")

    def check(name: str, ok: bool, detail: str) -> None:
        checks.append({"check": name, "ok": bool(ok), "detail": detail})
        log(f"{'ok  ' if ok else 'FAIL'} {name}: {detail}")

    def variants(qt: GGMLQuantizationType, n: int, k: int, pairs: int, extra: tuple
                 ) -> list[tuple[str, tuple, bool, bool]]:
        # (label, config, int8, split): the default config in float (and int8 where the type has it), the extra
        # ones in the default mode; Q8_0 in the file's blocks and in split rows (kernel_layout)
        out = [("int8" if int8 else "f32", matvec_config(qt, n, k, pairs), int8, False)
               for int8 in ((False, True) if int8_activations(qt, True) else (False,))]
        label = "int8" if int8_activations(qt) else "f32"
        out += [(label, cfg, int8_activations(qt), False) for cfg in extra if cfg != matvec_config(qt, n, k, pairs)]
        return out + [(f"{lab} split", cfg, i8, True) for lab, cfg, i8, _ in out] if qt == T.Q8_0 else out

    for what, qt, n, k, form, extra in CASES:
        if time.perf_counter() - t_start > deadline_s:
            log(f"{qt.name} {what}: skipped (deadline)")
            continue
        try:
            nbytes_w = quantized_nbytes(qt, (n, k))
            copies = max(2, min(48, (256 << 20) // nbytes_w))
            blocks = [GGMLTensor(random_blocks(qt, (n, k), gen, std=0.02), qt, (n, k)) for _ in range(copies)]
            layouts = {False: blocks, True: [kernel_layout(w) for w in blocks] if qt == T.Q8_0 else blocks}
            ws = layouts[True]  # the layout the model runs
            wd = ws[0].dequantize().double()
            if form == "grouped":  # 8 groups of [n / 8, k], one activation row each
                g = 8
                x = torch.randn(1, g, k, device=dev, generator=gen)
                ref = torch.einsum("tgi,goi->tgo", x.double(), wd.view(g, n // g, k))
                for label, cfg, int8, split in variants(qt, n // g, k, g, extra):
                    err = rel(quant_grouped_linear(x, layouts[split][0], g, config=cfg, force="mv", int8=int8), ref)
                    us, gbs = timed([lambda x=x, w=w, g=g, c=cfg, i8=int8:
                                     quant_grouped_linear(x, w, g, config=c, force="mv", int8=i8)
                                     for w in layouts[split]],
                                    nbytes_w + 4 * g * (k + n // g))
                    record(qtype=qt.name, what=what, m=1, kernel=f"grouped-mv {label}", config=cfg, us=us, gbs=gbs,
                           frac=gbs / copy_bw, err=err)
            else:
                x = torch.randn(1, k, device=dev, generator=gen)
                ref = x.double() @ wd.T
                for label, cfg, int8, split in variants(qt, n, k, 1, extra):
                    # also with the weights loaded before the PDL wait where PRELOAD_WEIGHTS serves the launch
                    qm.PRELOAD_WEIGHTS = True
                    serves = qm.weights_preloaded(layouts[split][0], cfg[1])
                    for preload in (False, True) if serves else (False,):
                        qm.PRELOAD_WEIGHTS = preload
                        err = rel(quant_linear(x, layouts[split][0], config=cfg, force="mv", int8=int8), ref)
                        us, gbs = timed([lambda x=x, w=w, c=cfg, i8=int8:
                                         quant_linear(x, w, config=c, force="mv", int8=i8) for w in layouts[split]],
                                        nbytes_w + 4 * (k + n))
                        record(qtype=qt.name, what=what, m=1, kernel=f"matvec {label}{' preload' * preload}",
                               config=cfg, us=us, gbs=gbs, frac=gbs / copy_bw, err=err)
                    qm.PRELOAD_WEIGHTS = preload_default
                # batch invariance: a row's result with 1, 3 and MATVEC_MAX_ROWS rows (matvec), and one more
                # (skinny kernel)
                xs = torch.randn(MATVEC_MAX_ROWS + 1, k, device=dev, generator=gen)
                y1 = quant_linear(xs[:1], ws[0])
                same = all(torch.equal(y1[0], quant_linear(xs[:m], ws[0])[0]) for m in (3, MATVEC_MAX_ROWS))
                check(f"{qt.name} {what} batch invariance M=1, 3, {MATVEC_MAX_ROWS}", same, "bitwise")
                ymm = quant_linear(xs, ws[0])
                log(f"{qt.name} {what}: M={MATVEC_MAX_ROWS + 1} (skinny kernel) vs M=1 max diff "
                    f"{float((y1[0] - ymm[0]).abs().max()):.1e}, skinny rel err {rel(ymm, xs.double() @ wd.T):.1e}")
                for m in ROWS.get((qt, what), ()) if form == "linear" else ():
                    xm = torch.randn(m, k, device=dev, generator=gen)
                    for force in ("mv", "mm") if m >= 8 else ("mv",):
                        cfg = matvec_config(qt, n, k) if force == "mv" else matmul_config(qt, m, n, k)
                        us, gbs = timed([lambda x=xm, w=w, f=force: quant_linear(x, w, force=f) for w in ws],
                                        nbytes_w + 4 * m * (k + n))
                        err = rel(quant_linear(xm, ws[0], force=force), xm.double() @ wd.T)
                        record(qtype=qt.name, what=what, m=m, kernel=force, config=cfg, us=us, gbs=gbs,
                               frac=gbs / copy_bw, err=err)
            if form == "expert":  # 6 routed experts in one launch (gate: also 12 = gate and up stacked by expert)
                down = what.startswith("expert down")
                for slots in (6,) if down else (6, 12):
                    n_exp = 256 * slots // 6
                    experts = GGMLTensor(random_blocks(qt, (n_exp, n, k), gen, std=0.02), qt, (n_exp, n, k))
                    x = torch.randn(slots if down else 1, k, device=dev, generator=gen)
                    id_sets = [torch.randperm(n_exp, device=dev, generator=gen)[:slots].view(-1, 1) if down
                               else torch.randperm(n_exp, device=dev, generator=gen)[:slots].view(1, -1)
                               for _ in range(16)]
                    ref = torch.stack([x[j if down else 0].double() @ experts[int(e)].dequantize().double().T
                                       for j, e in enumerate(id_sets[0].view(-1).tolist())])
                    for label, cfg, int8, _split in variants(qt, n, k, slots, extra):
                        y = quant_matmul_routed(x, experts, id_sets[0], config=cfg, int8=int8).view(slots, n)
                        us, gbs = timed([lambda x=x, e=experts, i=i, c=cfg, i8=int8:
                                         quant_matmul_routed(x, e, i, config=c, int8=i8) for i in id_sets],
                                        slots * nbytes_w + 4 * (x.numel() + slots * n))
                        record(qtype=qt.name, what=f"{what} x{slots} routed", m=1, kernel=f"routed-mv {label}",
                               config=cfg, us=us, gbs=gbs, frac=gbs / copy_bw, err=rel(y, ref))
                for t in ROWS.get((qt, what), ()):  # t tokens, 6 experts each
                    xt = torch.randn(t, k, device=dev, generator=gen)
                    ids_t = [torch.randint(0, n_exp, (t, 6), device=dev, generator=gen) for _ in range(8)]
                    ref = torch.stack([xt[p // 6].double() @ experts[int(e)].dequantize().double().T
                                       for p, e in enumerate(ids_t[0].view(-1).tolist())])
                    for force in ("mv",):  # the skinny kernel took 4.3 ms here
                        us, gbs = timed([lambda x=xt, e=experts, i=i, f=force: quant_matmul_routed(x, e, i, force=f)
                                         for i in ids_t], 6 * t * nbytes_w + 4 * t * (k + 6 * n))
                        err = rel(quant_matmul_routed(xt, experts, ids_t[0], force=force).view(-1, n), ref)
                        record(qtype=qt.name, what=what + " x6 routed", m=t, kernel=force, config=None, us=us,
                               gbs=gbs, frac=gbs / copy_bw, err=err)
                del experts
            del ws, blocks, layouts
            torch.cuda.empty_cache()
        except Exception as exc:  # keep measuring the other cases
            log(f"{qt.name} {what}: ERROR {type(exc).__name__}: {exc}"[:400])
            checks.append({"check": f"{qt.name} {what}", "ok": False, "detail": f"{type(exc).__name__}: {exc}"[:300]})
    print("\n| type | case | M | kernel | config | us | GB/s | of copy | rel err |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['qtype']} | {r['what']} | {r['m']} | {r['kernel']} | {r['config']} | {r['us']:.2f} | "
              f"{r['gbs']:.0f} | {r['frac']:.1%} | {r['err']:.1e} |")
    print(f"checks failed: {[c['check'] for c in checks if not c['ok']]}")
    print(f"copy bandwidth {copy_bw:.0f} GB/s; triton {triton.__version__}, torch {torch.__version__}; "
          f"total {time.perf_counter() - t_start:.0f} s")
    if out_json:
        with open(out_json, "w") as f:
            json.dump({"copy_gbs": copy_bw, "rows": rows, "checks": checks, "gpu": torch.cuda.get_device_name()},
                      f, indent=1, default=str)
    return 0 if all(c["ok"] for c in checks) else 1


if __name__ == "__main__":
    sys.exit(run(sys.argv[1] if len(sys.argv) > 1 else None, float(sys.argv[2]) if len(sys.argv) > 2 else 1e9))
