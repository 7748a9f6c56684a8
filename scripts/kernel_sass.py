"""Compile ds4x's quantized-product kernels for sm_90 offline (no GPU needed) and summarize their SASS.

Prints, per configuration: registers, local memory (spills), shared memory, the count of each SASS opcode family
that matters here (IMMA, IDP, LDGSTS, LDSM, LDS, STS, BAR, SHFL, FFMA / FMUL / FADD, I2FP, ...) over the whole kernel
and inside its K loop (the range closed by the first backward branch around the kernel's multiplies: IDP). A kernel
that spills, or whose wgmma ptxas serialized (its C7514 / C7515 note, which Triton's own ptxas run does not show:
each product then waits for the one before), is flagged with "!!" and the exit status is 1.

``qmv``: the matvec of ds4x.kernels.quant_matmul (``_qmv_kernel``) for the routed experts' types, int8 activations,
per (R rows, U units, warps) tile, x quantized in the kernel or beforehand.
``attention``: the Hopper decode attention's partial pass (ds4x.kernels.attention_wgmma, Gluon) as a decode step
launches it (window ring + compressed rows), per query dtype (float32, or the model's bf16).
``routed``: the routed experts' tensor-core kernel (ds4x.kernels.routed_wgmma) per tile and variant.
``indexer``: the Hopper indexer scoring (ds4x.kernels.indexer_wgmma) as a decode step launches it.
``select``: the multi-program top-k (ds4x.kernels.triton_indexer.radix_kernel).

    PYTHONPATH=src python scripts/kernel_sass.py qmv [--qtype iq2_xxs] [--tile 8,64,2 8,128,4] [--xq 1]
        [--dump DIR]   (--dump writes cubin / SASS / PTX / TTGIR)
    PYTHONPATH=src python scripts/kernel_sass.py attention [--block 16] [--query fp32,bf16] [--two-phase 0 5]
        [--overlap] [--tma-state] [--q-async] [--skip-empty] [--state-bf16] [--parts 1 2 4] [--dump DIR]
    PYTHONPATH=src python scripts/kernel_sass.py indexer [--maxnreg N] [--pipelined] [--dump DIR]
    PYTHONPATH=src python scripts/kernel_sass.py routed [--qtype q2_k] [--tile 128,64,4] [--variant "shared,regs"]
    PYTHONPATH=src python scripts/kernel_sass.py select [--tile 2048]
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

if __name__ == "__main__":  # compile real kernels even from a shell that set the interpreter
    os.environ.pop("TRITON_INTERPRET", None)

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler.compiler import ASTSource  # noqa: E402

from ds4x.kernels import quant_matmul  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
TARGET_ARCH = "sm_90a"  # the ptxas architecture of TARGET (wgmma needs the "a" features)
FAMILIES = ("HGMMA", "IMMA", "IDP", "LDGSTS", "LDSM", "LDS", "STS", "LDG", "STG", "LDL", "STL", "BAR", "DEPBAR",
            "SHFL", "ATOMG", "RED", "FFMA", "FMUL", "FADD", "FMNMX", "I2FP", "I2F", "F2F", "HADD2", "PRMT", "SHF",
            "LOP3", "IMAD", "IADD3", "BRA")


def _nvdisasm_tool(name: str) -> str:
    return str(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name)


def compile_qmv(code: int, tile: tuple[int, int, int], xq: bool) -> triton.compiler.CompiledKernel:
    """``_qmv_kernel`` as a decode step launches it for the routed experts: ids, int8 activations, PDL; IQ2_XXS (split
    rows, code 17) as the fused gate / up + SwiGLU, Q2_K (code 10) as the down projection."""
    fn = quant_matmul._kernels()._qmv_kernel
    names = fn.arg_names
    pointers = {"x_ptr": "*bf16", "xq_ptr": "*i32", "xs_ptr": "*fp32", "xsum_ptr": "*fp32", "w_ptr": "*u8",
                "grid_ptr": "*i32", "ids_ptr": "*i32", "y_ptr": "*bf16"}
    r, u, warps = tile
    consts = {"X_DIV": 1, "HAS_IDS": True, "QTYPE": code, "ACT8": True, "R": r, "U": u, "SWIGLU": code == 17,
              "XQ": xq, "INTERPRET": False, "PDL": True, "PRELOAD": False}
    sig = {a: "constexpr" if a in consts else pointers.get(a, "fp32" if a == "limit" else "i32") for a in names}
    divisible = set(pointers) | {"row_bytes", "expert_bytes", "up_bytes", "n_units", "stride_x", "stride_y"}
    attrs = {(i,): [["tt.divisibility", 16]] for i, a in enumerate(names) if a in divisible}
    src = ASTSource(fn, sig, {(names.index(a),): v for a, v in consts.items()}, attrs)
    return triton.compile(src, target=TARGET, options={"num_warps": warps})


def compile_gluon(fn, consts: dict, pointers: dict[str, str], options: dict) -> triton.compiler.CompiledKernel:
    """A Gluon kernel for sm_90 with ``consts`` as its constexprs, ``pointers`` the types of its pointer arguments
    (``scale`` is fp32, every other argument i32; a TMA descriptor's type ``tensordesc<...>`` goes there too), the
    pointers 16-byte aligned as Triton specializes them at launch (so vector loads compile as they run)."""
    from triton.experimental.gluon._runtime import GluonASTSource

    names = fn.arg_names
    sig = {a: "constexpr" if a in consts else pointers.get(a, "fp32" if a == "scale" else "i32") for a in names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, a in enumerate(names) if pointers.get(a, "").startswith("*")}
    src = GluonASTSource(fn, sig, {(names.index(a),): v for a, v in consts.items()}, attrs)
    return triton.compile(src, target=TARGET, options=options)


def compile_attention(block: int, query: str, two_phase: int = 0, overlap: bool = False, tma_state: bool = False,
                      q_async: bool = False, skip_empty: bool = False, state_bf16: bool = False, parts: int = 1
                      ) -> triton.compiler.CompiledKernel:
    """``attention_wgmma.partial_kernel`` for one decode query per program over a window ring (mode 1) and compressed
    rows by ratio (mode 2), PDL on; the query ``fp32`` or ``bf16``;
    ``two_phase`` its TWO_PHASE (blocks a program, 0: the online loop), ``overlap`` its OVERLAP (the two phases'
    decode beside the score products), ``tma_state`` its TMA_STATE (the partial state stored by the TMA unit),
    ``q_async`` its Q_ASYNC (the two phases' query copied by cp.async), ``skip_empty`` its SKIP_EMPTY (splits past
    the closed compressed rows store only m and l), ``state_bf16`` its STATE_BF16 (the accumulator stored as bf16),
    ``parts`` its PARTS (a split's output columns over that many programs)."""
    from triton.experimental.gluon import language as gl

    from ds4x.kernels import attention_wgmma

    consts = {"H": 64, "D": 512, "NOPE": 448, "BLOCK": block, "MODE_A": 1, "MODE_B": 2,
              "num_warps": attention_wgmma.WARPS, "PDL": True, "WHOLE": False, "TWO_PHASE": two_phase,
              "OVERLAP": overlap, "TMA_STATE": tma_state, "Q_ASYNC": q_async,
              "SKIP_EMPTY": skip_empty, "STATE_BF16": state_bf16, "PARTS": parts}
    # the TMA state's descriptor: float32 boxes of 32 columns, or bf16 ones of 64 (a bf16 state by TMA)
    layout = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16 if state_bf16 else 32, rank=2)
    box = "bf16[64, 64]" if state_bf16 else "fp32[64, 32]"
    pointers = {"q_ptr": f"*{query}", "rows_a": "*u8", "idx_a": "*i32", "pos_a": "*i64",
                "rows_b": "*u8", "idx_b": "*i32", "pos_b": "*i64", "m_ptr": "*fp32", "l_ptr": "*fp32",
                "acc_ptr": "*bf16" if state_bf16 else "*fp32", "sinks_ptr": "*fp32", "out_ptr": "*fp32",
                "acc_desc": f"tensordesc<{box},{layout!r}>"}
    return compile_gluon(attention_wgmma.partial_kernel, consts, pointers, {"num_warps": attention_wgmma.WARPS})


def compile_select(tile: int) -> triton.compiler.CompiledKernel:
    """The multi-program top-k (``radix_kernel`` of ds4x.kernels.triton_indexer) as a decode step launches it: every
    phase after the indexer's first level in one launch, shared-memory histograms, a device count, PDL, TILE scores
    a program."""
    from ds4x.kernels import select
    from ds4x.kernels.triton_indexer import radix_kernel

    names = radix_kernel.arg_names
    consts = {"TILE": tile, "KP": 512, "BITS": select.RADIX_BITS, "FIRST": 1, "LAST": 32 // select.RADIX_BITS + 1,
              "DEVICE_COUNT": True, "WS": select._WORKSPACE, "MAX_PROGRAMS": select._MAX_PROGRAMS, "PDL": True,
              "SHARED_BINS": True, "LOCAL": False}
    pointers = {"scores_ptr": "*fp32", "count_ptr": "*i64", "ws_ptr": "*i32", "index_ptr": "*i64", "valid_ptr": "*i8"}
    sig = {a: "constexpr" if a in consts else pointers.get(a, "i32") for a in names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, a in enumerate(names) if a in pointers}
    src = ASTSource(radix_kernel, sig, {(names.index(a),): v for a, v in consts.items()}, attrs)
    return triton.compile(src, target=TARGET, options={"num_warps": select.RADIX_WARPS})


def compile_indexer(maxnreg: int | None = None, pipelined: bool = False, fp8: bool = False
                    ) -> triton.compiler.CompiledKernel:
    """``indexer_wgmma.score_kernel`` as a decode step at 1M launches it (64 heads, a device row count, PDL on, the
    select's first level counted where FIRST_LEVEL_IN_INDEXER says), with a register ceiling if given;
    ``pipelined``: the PIPELINED variant at its tile; ``fp8``: FP8_KEYS (E4M3 operands), else fp16."""
    from ds4x.kernels import indexer_wgmma, select

    consts = {"H": 64, "DEVICE_COUNT": True, "num_warps": indexer_wgmma.WARPS, "PDL": True, "PIPELINED": pipelined,
              "BN": indexer_wgmma.PIPELINED_BLOCK_N if pipelined else indexer_wgmma.BLOCK_N,
              "HIST_BITS": select.RADIX_BITS if select.FIRST_LEVEL_IN_INDEXER else 0, "FP8": fp8}
    pointers = {"q_ptr": "*fp32", "w_ptr": "*fp32", "rows_ptr": "*i32", "out_ptr": "*fp32", "count_ptr": "*i32",
                "hist_ptr": "*i32"}
    return compile_gluon(indexer_wgmma.score_kernel, consts, pointers,
                         {"num_warps": indexer_wgmma.WARPS, **({"maxnreg": maxnreg} if maxnreg else {})})


def compile_routed(qtype: int, tile: tuple[int, int, int], variant: str) -> triton.compiler.CompiledKernel:
    """``routed_wgmma._routed_wgmma_kernel`` for IQ2_XXS split rows (17) / Q2_K (10) at (BT, BN, warps), as
    ``routed_wgmma`` launches it (int arguments and pointers 16-divisible, as Triton specializes them): the
    variant ``shared`` (default), ``x async`` (ASYNC_ACTIVATIONS) or ``regs`` (REGISTER_WEIGHTS too)."""
    from triton.experimental.gluon._runtime import GluonASTSource

    from ds4x.kernels import routed_wgmma

    bt, bn, warps = tile
    reg, xa = routed_wgmma.VARIANTS[variant]
    fn = routed_wgmma._routed_wgmma_kernel
    consts = {"X_DIV": 1, "QTYPE": qtype, "BT": bt, "BN": bn, "num_warps": warps, "REG_W": reg, "X_ASYNC": xa}
    pointers = {"x_ptr": "*bf16", "w_ptr": "*u8", "tab_ptr": "*i16", "c_expert": "*i32", "c_start": "*i32",
                "c_len": "*i32", "order_ptr": "*i32", "y_ptr": "*bf16"}
    names = fn.arg_names
    sig = {a: "constexpr" if a in consts else pointers.get(a, "i32") for a in names}
    divisible = set(pointers) | {"N", "K", "row_bytes", "expert_bytes", "stride_x", "stride_y"}
    attrs = {(i,): [["tt.divisibility", 16]] for i, a in enumerate(names) if a in divisible}
    src = GluonASTSource(fn, sig, {(names.index(a),): v for a, v in consts.items()}, attrs)
    return triton.compile(src, target=TARGET, options={"num_warps": warps})


def sass_of(kernel: triton.compiler.CompiledKernel, dump: Path | None, tag: str) -> list[tuple[int, str, str]]:
    """(address, opcode, operands) of each SASS instruction of the kernel's cubin (written to ``dump`` or /tmp)."""
    cubin = kernel.asm["cubin"]
    out = Path(dump or "/tmp") / f"{tag}.cubin"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_bytes(cubin)
    text = subprocess.run([_nvdisasm_tool("cuobjdump"), "-sass", str(out)], check=True, capture_output=True,
                          text=True).stdout
    if dump:
        (Path(dump) / f"{tag}.sass").write_text(text)
        (Path(dump) / f"{tag}.ptx").write_text(kernel.asm["ptx"])
        (Path(dump) / f"{tag}.ttgir").write_text(kernel.asm["ttgir"])
    pat = r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]+)([^;]*);"
    return [(int(m.group(1), 16), m.group(2), m.group(3)) for m in re.finditer(pat, text)]


def count(ops: list[tuple[int, str, str]]) -> Counter:
    c: Counter = Counter()
    for _, op, _ in ops:
        c[op.split(".")[0]] += 1
    return c


def loop_ops(ops: list[tuple[int, str, str]], marker: str | tuple[str, ...]) -> list[tuple[int, str, str]]:
    """The instructions of the K loop: from the target of the first backward branch that closes a range holding the
    ``marker`` opcode (the kernel's multiplies; one of them, if a tuple) through that branch."""
    for addr, op, rest in ops:
        target = re.match(r"\s*(0x[0-9a-f]+)", rest)
        if op == "BRA" and target and int(target.group(1), 16) < addr:
            body = [o for o in ops if int(target.group(1), 16) <= o[0] <= addr]
            if any(o[1].startswith(marker) for o in body):
                return body
    return []


def resources(dump: Path | None, tag: str) -> dict[str, int]:
    """REG / STACK / LOCAL / SHARED (static) of the cubin written by ``sass_of``, from ``cuobjdump -res-usage``."""
    out = Path(dump or "/tmp") / f"{tag}.cubin"
    text = subprocess.run([_nvdisasm_tool("cuobjdump"), "-res-usage", str(out)], check=True, capture_output=True,
                          text=True).stdout
    return {k: int(v) for k, v in re.findall(r"(REG|STACK|LOCAL|SHARED):(\d+)", text)}


def wgmma_serialized(kernel: triton.compiler.CompiledKernel) -> str:
    """ptxas's note when it made every wgmma of the kernel wait for the one before (C7514 / C7515: a register of an
    accumulator or operand in use while a product may run, ...), else "" (Triton's own ptxas run keeps it quiet)."""
    if "wgmma" not in kernel.asm["ptx"]:
        return ""
    with tempfile.TemporaryDirectory() as tmp:
        ptx = Path(tmp) / "k.ptx"
        ptx.write_text(kernel.asm["ptx"])
        text = subprocess.run([_nvdisasm_tool("ptxas"), f"-arch={TARGET_ARCH}", str(ptx), "-o", str(ptx) + ".cubin"],
                              capture_output=True, text=True).stderr
    return next((line.strip() for line in text.splitlines() if "C751" in line), "")


def report(kernel: triton.compiler.CompiledKernel, dump: Path | None, tag: str,
           marker: str | tuple[str, ...]) -> tuple[Counter, int]:
    """Print a kernel's resources and opcode counts (whole, K loop); return the whole kernel's counts and its bytes
    of local memory (spills)."""
    ops = sass_of(kernel, dump, tag)
    loop = loop_ops(ops, marker)
    whole, in_loop = count(ops), count(loop)
    res = resources(dump, tag)
    spill = res.get("LOCAL", 0) + res.get("STACK", 0)
    print(f"{tag}: registers {res['REG']}, local / stack bytes {spill} (spills), shared {kernel.metadata.shared} B "
          f"dynamic + {res['SHARED']} B static, {len(ops)} instructions ({len(loop)} in the K loop)")
    print("   kernel: " + ", ".join(f"{f} {whole[f]}" for f in FAMILIES if whole[f]))
    print("   loop:   " + ", ".join(f"{f} {in_loop[f]}" for f in FAMILIES if in_loop[f]))
    return whole, spill


def report_all(jobs, dump: Path | None, marker: str | tuple[str, ...]) -> bool:
    """``report`` each (tag, compile thunk) of ``jobs``; False if any of them spills or has its wgmma serialized."""
    ok = True
    for tag, make in jobs:
        kernel = make()
        _, spill = report(kernel, dump, tag, marker)
        if spill:
            print("   !! local memory in use (spills)")
            ok = False
        serialized = wgmma_serialized(kernel)
        if serialized:
            print(f"   !! wgmma serialized: {serialized}")
            ok = False
    return ok


def main_qmv(args: argparse.Namespace) -> bool:
    code = {"iq2_xxs": 17, "q2_k": 10}[args.qtype]
    tiles = [tuple(int(v) for v in spec.split(",")) for spec in args.tile]
    xqs = [bool(int(v)) for v in args.xq.split(",")]
    return report_all([(f"qmv_{args.qtype}_r{t[0]}_u{t[1]}_w{t[2]}_xq{int(xq)}",
                        lambda t=t, xq=xq: compile_qmv(code, t, xq))  # type: ignore[arg-type]
                       for t in tiles for xq in xqs], args.dump, "IDP")


def main_attention(args: argparse.Namespace) -> bool:
    overlaps = sorted({False, bool(args.overlap)})
    return report_all([(f"attention_b{block}_{kind}_t{two}" + ("_overlap" if ov else "") + ("_tma" if tm else "")
                        + ("_qasync" if qa else "") + ("_skip" if sk else "") + ("_bf16state" if sb else "")
                        + (f"_parts{pa}" if pa > 1 else ""),
                        lambda block=block, kind=kind, two=two, ov=ov, tm=tm, qa=qa, sk=sk, sb=sb, pa=pa:
                        compile_attention(block, kind, two, ov, tm, qa, sk, sb, pa))
                       for block in args.block for kind in args.query.split(",") for two in args.two_phase
                       for ov in overlaps if two or not ov for tm in sorted({False, bool(args.tma_state)})
                       for qa in sorted({False, bool(args.q_async)}) if two or not qa
                       for sk in sorted({False, bool(args.skip_empty)})
                       for sb in sorted({False, bool(args.state_bf16)}) if not (sb and tm and not two)
                       for pa in args.parts if pa == 1 or (two and not (tm or sb))],
                      args.dump, "HGMMA")


def main_indexer(args: argparse.Namespace) -> bool:
    tag = "indexer" + (f"_maxnreg{args.maxnreg}" if args.maxnreg else "")
    return report_all([(tag + ("_pipelined" if p else "") + ("_fp8" if f else "_fp16"),
                        lambda p=p, f=f: compile_indexer(args.maxnreg, p, f))
                       for p in sorted({False, bool(args.pipelined)}) for f in (True, False)], args.dump,
                      ("HGMMA", "QGMMA"))  # fp16 / fp8 products


def main_routed(args: argparse.Namespace) -> bool:
    from ds4x.kernels import routed_wgmma

    code = {"iq2_xxs": 17, "q2_k": 10}[args.qtype]
    tiles = [tuple(int(v) for v in spec.split(",")) for spec in args.tile]
    return report_all([(f"routed_{args.qtype}_bt{t[0]}_bn{t[1]}_w{t[2]}_{variant.replace(' ', '_')}",
                        lambda t=t, variant=variant: compile_routed(code, t, variant))  # type: ignore[arg-type]
                       for t in tiles for variant in args.variant.split(",")
                       if not routed_wgmma.VARIANTS[variant][0] or routed_wgmma.register_weights_fit(t[1], t[2])],
                      args.dump, "HGMMA")


def main_select(args: argparse.Namespace) -> bool:
    return report_all([(f"select_tile{args.tile}", lambda: compile_select(args.tile))], args.dump, "BAR")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="kernel", required=True)
    qmv = sub.add_parser("qmv", help="the routed experts' matvec of ds4x.kernels.quant_matmul")
    qmv.add_argument("--qtype", choices=("iq2_xxs", "q2_k"), default="iq2_xxs")
    qmv.add_argument("--tile", nargs="+", default=["8,64,2", "8,128,4"], help="R,U,warps tiles")
    qmv.add_argument("--xq", default="1", help="x quantized beforehand: 1, in the kernel: 0 (comma-separated)")
    qmv.add_argument("--dump", type=Path, default=None, help="write cubin / SASS / PTX / TTGIR here")
    att = sub.add_parser("attention", help="the Hopper decode attention of ds4x.kernels.attention_wgmma")
    att.add_argument("--block", nargs="+", type=int, default=[16], help="rows per block")
    att.add_argument("--query", default="fp32,bf16", help="query dtypes, comma-separated")
    att.add_argument("--two-phase", nargs="+", type=int, default=[0], help="TWO_PHASE values (0: the online loop)")
    att.add_argument("--overlap", action="store_true", help="also OVERLAP for TWO_PHASE > 0")
    att.add_argument("--tma-state", action="store_true", help="also TMA_STATE (the partial state by the TMA unit)")
    att.add_argument("--q-async", action="store_true", help="also Q_ASYNC for TWO_PHASE > 0 (the query by cp.async)")
    att.add_argument("--skip-empty", action="store_true",
                     help="also SKIP_EMPTY (splits past the closed compressed rows store only m and l)")
    att.add_argument("--state-bf16", action="store_true", help="also STATE_BF16 (the accumulator stored as bf16)")
    att.add_argument("--parts", nargs="+", type=int, default=[1],
                     help="PARTS values (a split's output columns over that many programs; > 1 with TWO_PHASE only)")
    att.add_argument("--dump", type=Path, default=None, help="write cubin / SASS / PTX / TTGIR here")
    idx = sub.add_parser("indexer", help="the Hopper indexer scoring of ds4x.kernels.indexer_wgmma")
    idx.add_argument("--maxnreg", type=int, default=None, help="register ceiling per thread")
    idx.add_argument("--pipelined", action="store_true", help="also the PIPELINED variant (two key tiles)")
    idx.add_argument("--dump", type=Path, default=None, help="write cubin / SASS / PTX / TTGIR here")
    rt = sub.add_parser("routed", help="the routed experts' tensor-core kernel of ds4x.kernels.routed_wgmma")
    rt.add_argument("--qtype", choices=("iq2_xxs", "q2_k"), default="iq2_xxs")
    rt.add_argument("--tile", nargs="+", default=["16,128,4", "128,64,4", "64,64,4"], help="BT,BN,warps tiles")
    rt.add_argument("--variant", default="shared,x async,regs", help="comma-separated: shared, x async, regs")
    rt.add_argument("--dump", type=Path, default=None, help="write cubin / SASS / PTX / TTGIR here")
    sel = sub.add_parser("select", help="the multi-program top-k of ds4x.kernels.triton_indexer")
    sel.add_argument("--tile", type=int, default=2048, help="scores a program (2,048: 262,144 scores on 128)")
    sel.add_argument("--dump", type=Path, default=None, help="write cubin / SASS / PTX / TTGIR here")
    args = ap.parse_args(argv)
    run = {"qmv": main_qmv, "attention": main_attention, "indexer": main_indexer, "routed": main_routed,
           "select": main_select}[args.kernel]
    return 0 if run(args) else 1


if __name__ == "__main__":
    sys.exit(main())
