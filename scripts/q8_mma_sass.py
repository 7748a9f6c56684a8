"""Compile ds4x.kernels.q8_mma for sm_90 offline (no GPU needed) and summarize its SASS.

Prints, per configuration: registers, local memory (spills), shared memory, the count of each SASS opcode family
that matters here (IMMA, LDGSTS, LDSM, LDS, BAR, FFMA / FMUL / FADD, I2FP, ...) over the whole kernel and inside its
K loop (the range closed by the backward branch around the IMMAs: one stage of KB blocks per iteration); and checks
that the float math was not contracted (no FFMA) and that the quantize kernel divides with IEEE rounding.

    PYTHONPATH=src python scripts/q8_mma_sass.py [--bt 8,16,32] [--split 1,4] [--warps 4] [--stages 3] [--dump DIR]
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

if __name__ == "__main__":  # compile real kernels even from a shell that set the interpreter
    os.environ.pop("TRITON_INTERPRET", None)

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler.compiler import ASTSource  # noqa: E402
from triton.experimental.gluon._runtime import GluonASTSource  # noqa: E402

from ds4x.kernels import q8_mma  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
FAMILIES = ("IMMA", "LDGSTS", "LDSM", "LDS", "STS", "LDG", "STG", "BAR", "DEPBAR", "ATOMG", "RED", "FFMA", "FMUL",
            "FADD", "I2FP", "I2F", "F2F", "HADD2", "PRMT", "SHF", "LOP3", "IMAD", "IADD3", "BRA")

KERNEL_ARGS = ("xq_ptr", "xs_ptr", "w_ptr", "y_ptr", "part_ptr", "count_ptr", "N", "K", "row_bytes", "n_tok",
               "groups", "stride_y")
POINTERS = {"xq_ptr": "*i8", "xs_ptr": "*fp32", "w_ptr": "*u8", "y_ptr": "*bf16", "part_ptr": "*fp32",
            "count_ptr": "*i32"}
DIVISIBLE = ("xq_ptr", "xs_ptr", "w_ptr", "y_ptr", "part_ptr", "count_ptr", "K", "row_bytes", "stride_y")


def _nvdisasm_tool(name: str) -> str:
    return str(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name)


def compile_mma(bt: int, split: int, num_warps: int, stages: int) -> triton.compiler.CompiledKernel:
    """The Gluon kernel for one configuration (pointers and K / row_bytes / stride_y 16-divisible, as in use)."""
    sig = {a: POINTERS.get(a, "i32") for a in KERNEL_ARGS}
    consts = {"BT": bt, "KB": q8_mma.KB, "STAGES": stages, "SPLIT": split, "num_warps": num_warps}
    sig.update(dict.fromkeys(consts, "constexpr"))
    attrs = {(KERNEL_ARGS.index(a),): [["tt.divisibility", 16]] for a in DIVISIBLE}
    src = GluonASTSource(q8_mma._q8_mma_kernel, sig, consts, attrs)
    return triton.compile(src, target=TARGET, options={"num_warps": num_warps, "enable_fp_fusion": False})


def compile_quantize() -> triton.compiler.CompiledKernel:
    names = ("x_ptr", "q_ptr", "s_ptr", "nb", "stride_x", "B")
    sig = {"x_ptr": "*bf16", "q_ptr": "*i8", "s_ptr": "*fp32", "nb": "i32", "stride_x": "i32", "B": "constexpr"}
    attrs = {(names.index(a),): [["tt.divisibility", 16]] for a in ("x_ptr", "q_ptr", "s_ptr", "stride_x")}
    src = ASTSource(q8_mma._quantize_32_kernel, sig, {"B": 32}, attrs)
    return triton.compile(src, target=TARGET, options={"num_warps": 4, "enable_fp_fusion": False})


def sass_of(kernel: triton.compiler.CompiledKernel, dump: Path | None, tag: str) -> list[tuple[int, str, str]]:
    """(address, opcode, operands) of each SASS instruction of the kernel's cubin (written to ``dump`` or /tmp)."""
    cubin = kernel.asm["cubin"]
    out = Path(dump or "/tmp") / f"q8_mma_{tag}.cubin"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_bytes(cubin)
    text = subprocess.run([_nvdisasm_tool("cuobjdump"), "-sass", str(out)], check=True, capture_output=True,
                          text=True).stdout
    if dump:
        (Path(dump) / f"q8_mma_{tag}.sass").write_text(text)
        (Path(dump) / f"q8_mma_{tag}.ptx").write_text(kernel.asm["ptx"])
        (Path(dump) / f"q8_mma_{tag}.ttgir").write_text(kernel.asm["ttgir"])
    pat = r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]+)([^;]*);"
    return [(int(m.group(1), 16), m.group(2), m.group(3)) for m in re.finditer(pat, text)]


def count(ops: list[tuple[int, str, str]]) -> Counter:
    c: Counter = Counter()
    for _, op, _ in ops:
        c[op.split(".")[0]] += 1
    return c


def loop_ops(ops: list[tuple[int, str, str]]) -> list[tuple[int, str, str]]:
    """The instructions of the K loop: from the target of the backward branch that closes a range holding IMMA
    through that branch."""
    for addr, op, rest in ops:
        target = re.match(r"\s*(0x[0-9a-f]+)", rest)
        if op == "BRA" and target and int(target.group(1), 16) < addr:
            body = [o for o in ops if int(target.group(1), 16) <= o[0] <= addr]
            if any(o[1].startswith("IMMA") for o in body):
                return body
    return []


def resources(dump: Path | None, tag: str) -> dict[str, int]:
    """REG / STACK / LOCAL / SHARED (static) of the cubin written by ``sass_of``, from ``cuobjdump -res-usage``."""
    out = Path(dump or "/tmp") / f"q8_mma_{tag}.cubin"
    text = subprocess.run([_nvdisasm_tool("cuobjdump"), "-res-usage", str(out)], check=True, capture_output=True,
                          text=True).stdout
    return {k: int(v) for k, v in re.findall(r"(REG|STACK|LOCAL|SHARED):(\d+)", text)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bt", default="8,16,32")
    ap.add_argument("--split", default="1,4")
    ap.add_argument("--warps", default="4")
    ap.add_argument("--stages", default=str(q8_mma.STAGES))
    ap.add_argument("--dump", type=Path, default=None, help="write cubin / SASS / PTX / TTGIR here")
    args = ap.parse_args(argv)
    ok = True
    for nw in map(int, args.warps.split(",")):
        for stages in map(int, args.stages.split(",")):
            for split in map(int, args.split.split(",")):
                for bt in map(int, args.bt.split(",")):
                    tag = f"bt{bt}_split{split}_w{nw}_s{stages}"
                    k = compile_mma(bt, split, nw, stages)
                    ops = sass_of(k, args.dump, tag)
                    whole, loop = count(ops), count(loop_ops(ops))
                    res = resources(args.dump, tag)
                    spill = res.get("LOCAL", 0) + res.get("STACK", 0)
                    print(f"{tag}: registers {res['REG']}, local / stack bytes {spill} (spills), shared "
                          f"{k.metadata.shared} B dynamic + {res['SHARED']} B static, {len(ops)} instructions "
                          f"({len(loop_ops(ops))} in the K loop)")
                    print("   kernel: " + ", ".join(f"{f} {whole[f]}" for f in FAMILIES if whole[f]))
                    print("   loop:   " + ", ".join(f"{f} {loop[f]}" for f in FAMILIES if loop[f]))
                    if whole["IMMA"] == 0 or whole["LDGSTS"] == 0:
                        print("   !! no IMMA or no LDGSTS")
                        ok = False
                    if whole["FFMA"]:
                        print("   !! FFMA present: float math was contracted (the reference's bits need mul + add)")
                        ok = False
                    if spill:
                        print("   !! local memory in use (spills)")
                        ok = False
    qk = compile_quantize()
    ptx = qk.asm["ptx"]
    div_rn, div_approx = ptx.count("div.rn.f32"), ptx.count("div.full.f32") + ptx.count("div.approx.f32")
    fma = ptx.count("fma.rn.f32")
    print(f"quantize_activations_32: div.rn.f32 {div_rn}, approximate divisions "
          f"{div_approx}, fma.rn.f32 {fma}")
    if div_approx or fma or not div_rn:
        print("   !! the quantize kernel would not give the reference's bits")
        ok = False
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
