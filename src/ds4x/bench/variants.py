"""A/B variants of module attributes for benchmarks run in one process (e.g. ``scripts/batched_decode.py
--variant``, ``scripts/routed_matvec_sweep.py``): a variant sets some module attributes (kernel switches, tiles)
and puts them back after."""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

Setting = tuple[Any, str, Any]  # (module, attribute, value)


def parse_variant(spec: str) -> tuple[str, list[Setting]]:
    """'NAME: pkg.module.attr=EXPR; ...' -> (NAME, [(module, attr, value)]): the attributes a variant sets."""
    name, sep, body = spec.partition(":")
    if not sep or not body.strip():
        raise SystemExit(f"--variant wants 'NAME: module.attr=EXPR; ...', got {spec!r}")
    sets = []
    for assignment in filter(None, (a.strip() for a in body.split(";"))):
        path, _, expr = assignment.partition("=")
        module, _, attr = path.strip().rpartition(".")
        mod = importlib.import_module(module)
        if not hasattr(mod, attr):
            raise SystemExit(f"--variant {name!r}: {module} has no attribute {attr!r}")
        sets.append((mod, attr, eval(expr)))  # a developer's own expression on the command line
    return name.strip(), sets


@contextmanager
def variant_applied(sets: list[Setting]) -> Iterator[None]:
    """The attributes set as ``sets`` says inside the block, their previous values restored after."""
    saved = [(mod, attr, getattr(mod, attr)) for mod, attr, _ in sets]
    try:
        for mod, attr, value in sets:
            setattr(mod, attr, value)
        yield
    finally:
        for mod, attr, value in saved:
            setattr(mod, attr, value)
