#!/usr/bin/env python3
"""Scan every Triton kernel the CPU tests launch for sm_90 code hazards, without a GPU: each specialization the
tests run in Triton's interpreter (argument types, constexpr values, 16-divisible integers and pointers, warps) is
recorded, then compiled for sm_90 offline, and the ones whose SASS calls a software routine (an int64 division or
modulo compiles to a ``CALL`` of ~60-100 instructions) or spills registers to local memory are listed. The tests'
shapes are small, so register figures differ from real launches; calls do not depend on shapes.

    PYTHONPATH=src python scripts/kernel_scan.py [--tests tests/test_sparse_kernels.py ...] [--json scan.json]

(Gluon kernels have no interpreter path; ``scripts/kernel_sass.py`` compiles those.)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

DEFAULT_TESTS = ["tests/test_sparse_kernels.py", "tests/test_compressor_kernel.py", "tests/test_formats_triton.py",
                 "tests/test_hyper_kernels.py", "tests/test_moe_kernels.py", "tests/test_norm_rope_kernels.py",
                 "tests/test_quant_matmul.py", "tests/test_topk_selection.py", "tests/test_pdl.py"]
_DTYPES = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16", "int64": "i64", "int32": "i32", "int16": "i16",
           "int8": "i8", "uint8": "u8", "bool": "i1", "float64": "fp64", "float8_e4m3fn": "fp8e4nv"}


def _record(tests: list[str], out: Path) -> int:
    """Run ``tests`` in the interpreter with InterpretedFunction.run recording each launch's specialization."""
    os.environ["TRITON_INTERPRET"] = "1"
    import inspect

    import pytest
    import torch
    from triton.runtime.interpreter import InterpretedFunction

    seen: dict[str, dict] = {}
    original = InterpretedFunction.run

    def run(self, *args, grid, warmup, **kwargs):
        params = list(inspect.signature(self.fn).parameters.values())
        bound = dict(zip([p.name for p in params], args, strict=False)) | kwargs
        sig, consts, div = {}, {}, []
        for p in params:
            if p.name not in bound and (p.default is inspect.Parameter.empty or "constexpr" not in str(p.annotation)):
                continue
            v = bound.get(p.name, p.default)
            if "constexpr" in str(p.annotation):
                if p.name == "INTERPRET":
                    v = False  # the compiled kernel's own path
                consts[p.name] = (v if isinstance(v, (int, float, bool, str, type(None)))
                                  else f"tl.{v.name}" if hasattr(v, "primitive_bitwidth") else repr(v))
            elif isinstance(v, torch.Tensor):
                sig[p.name] = "*" + _DTYPES.get(str(v.dtype).removeprefix("torch."), "fp32")
                if v.data_ptr() % 16 == 0:
                    div.append(p.name)
            elif isinstance(v, bool):
                sig[p.name] = "i1"
            elif isinstance(v, int):
                if v == 1 and p.name not in getattr(self, "do_not_specialize", ()):
                    consts[p.name] = 1  # Triton specializes an int argument equal to 1
                    continue
                sig[p.name] = "i32" if -(2**31) <= v < 2**31 else "i64"
                if v % 16 == 0:
                    div.append(p.name)
            elif isinstance(v, float):
                sig[p.name] = "fp32"
            elif v is None:
                consts[p.name] = None
        record = {"module": self.fn.__module__, "name": self.fn.__name__, "sig": sig, "consts": consts, "div": div,
                  "num_warps": kwargs.get("num_warps", 4)}
        seen.setdefault(json.dumps(record, sort_keys=True, default=str), record)
        return original(self, *args, grid=grid, warmup=warmup, **kwargs)

    InterpretedFunction.run = run
    code = pytest.main(["-q", "-x", "-p", "no:cacheprovider", *tests])
    out.write_text(json.dumps(list(seen.values()), indent=1, default=str))
    print(f"recorded {len(seen)} kernel specializations from {len(tests)} test files (pytest exit {code})")
    return 0


def _compile(records: list[dict]) -> list[dict]:
    """Compile each record for sm_90 (no interpreter) and read its registers, local memory and CALLs."""
    import importlib

    import triton
    import triton.language as tl
    from triton.compiler.compiler import ASTSource

    sys.path.insert(0, str(Path(__file__).parent))
    import kernel_sass

    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, r in enumerate(records):
            row = {"kernel": f"{r['module'].removesuffix('_interp')}.{r['name']}", "consts": r["consts"]}
            try:
                module = importlib.import_module(r["module"].removesuffix("_interp").removesuffix("_jit"))
                holder = module._kernels() if hasattr(module, "_kernels") else module
                fn = getattr(holder, r["name"])  # (kernels made inside a builder function are not reachable)
                names = fn.arg_names
                consts = {k: tl.dtype(v[3:]) if isinstance(v, str) and v.startswith("tl.") else v
                          for k, v in r["consts"].items() if k in names}
                sig = {a: "constexpr" if a in consts else r["sig"].get(a, "i32") for a in names}
                attrs = {(j,): [["tt.divisibility", 16]] for j, a in enumerate(names) if a in r["div"]}
                src = ASTSource(fn, sig, {(names.index(a),): v for a, v in consts.items()}, attrs)
                k = triton.compile(src, target=kernel_sass.TARGET, options={"num_warps": r["num_warps"]})
                ops = kernel_sass.sass_of(k, Path(tmp), f"k{i}")
                res = kernel_sass.resources(Path(tmp), f"k{i}")
                row |= {"registers": res.get("REG", 0), "spills": res.get("LOCAL", 0) + res.get("STACK", 0),
                        "calls": sum(op.startswith("CALL") for _, op, _ in ops), "instructions": len(ops)}
            except Exception as e:  # a specialization the recorder described wrongly: report it, go on
                row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
            results.append(row)
    return results


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tests", nargs="+", default=DEFAULT_TESTS)
    ap.add_argument("--json", type=Path, default=None, help="write every compiled specialization's figures here")
    ap.add_argument("--records", type=Path, default=None,
                    help="the recorded specializations: read from here if the file exists, else recorded into it")
    ap.add_argument("--record-only", type=Path, default=None, help=argparse.SUPPRESS)  # the recording child
    args = ap.parse_args(argv)
    if args.record_only:
        return _record(args.tests, args.record_only)
    with tempfile.TemporaryDirectory() as tmp:
        rec = args.records or Path(tmp) / "records.json"
        if not rec.exists():
            env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
            subprocess.run([sys.executable, __file__, "--record-only", str(rec), "--tests", *args.tests], env=env,
                           check=False)
        records = json.loads(rec.read_text()) if rec.exists() else []
    os.environ.pop("TRITON_INTERPRET", None)
    results = _compile(records)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1, default=str))
    flagged = [r for r in results if r.get("calls") or r.get("spills") or "error" in r]
    by_kernel: dict[str, list[dict]] = {}
    for r in flagged:
        by_kernel.setdefault(r["kernel"], []).append(r)
    print(f"{len(results)} specializations of {len({r['kernel'] for r in results})} kernels compiled for sm_90; "
          f"{len(flagged)} flagged")
    for kernel, rows in sorted(by_kernel.items()):
        calls = max(r.get("calls", 0) for r in rows)
        spills = max(r.get("spills", 0) for r in rows)
        errors = [r["error"] for r in rows if "error" in r]
        print(f"  {kernel}: {len(rows)} specializations, up to {calls} CALLs, {spills} bytes spilled"
              + (f"; {len(errors)} did not compile: {errors[0]}" if errors else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
