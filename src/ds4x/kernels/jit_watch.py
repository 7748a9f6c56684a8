"""Kernel specializations compiled while a process runs, counted and timed through Triton's JIT hooks.

Triton (and Gluon) compiles a kernel again for every new specialization it meets: other constexprs, another
divisibility of an integer argument, an integer equal to 1. The first launch of one waits for the compile (or for
the read of Triton's disk cache), seconds on a cold machine, and on a serving path every request waits with it.
The server's warm-up compiles what it can foresee; a :class:`CompileWatch` started after it records what it did
not foresee: which kernel, with which constants, and for how long.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class KernelCompile:
    kernel: str  # the kernel function's name
    constants: str  # its constexpr (and specialized) arguments, name=value; then its arguments that Triton did
    # not specialize as multiples of 16 (pointers not 16-byte aligned, integers not divisible by 16)
    seconds: float  # from the JIT cache miss to the compiled kernel (a disk-cache read counts too)


def _constants(fn: Any, compile_info: dict[str, Any]) -> str:
    """``name=value`` of the specialization's constants (keys are tuples of argument positions), then the
    arguments specialized as *not* multiples of 16 (``do_not_specialize`` ones left out): a launch with another
    alignment or divisibility of such an argument compiles the kernel again, which constants alone do not show."""
    jit = getattr(fn, "jit_function", None)
    names = getattr(jit, "arg_names", None) or []
    unspecialized = {p.name for p in getattr(jit, "params", None) or [] if getattr(p, "do_not_specialize", False)}

    def name_of(key: Any) -> str:
        pos = key[0] if isinstance(key, tuple) and len(key) == 1 else None
        return names[pos] if isinstance(pos, int) and pos < len(names) else str(key)

    parts = [f"{name_of(key)}={getattr(value, 'value', value)}"
             for key, value in (compile_info.get("constants") or {}).items()]
    attrs = (compile_info.get("configs") or [{}])[0] or {}
    odd = [name_of(key) for key, desc in attrs.items() if not desc and name_of(key) not in unspecialized]
    if odd:
        parts.append("not multiples of 16: " + " ".join(odd))
    return ", ".join(parts)


class CompileWatch:
    """Counts and times the kernel compiles of this process from its installation on (Triton's
    ``knobs.runtime.jit_cache_hook`` / ``jit_post_compile_hook``; hooks set before are still called). Each
    listener gets every :class:`KernelCompile` as it finishes, on the compiling thread. One per process: `watch`."""

    def __init__(self) -> None:
        self.listeners: list[Callable[[KernelCompile], None]] = []
        self.count: Counter[str] = Counter()
        self.seconds: Counter[str] = Counter()
        self._lock = threading.Lock()
        self._begun: dict[tuple[int, str], float] = {}  # (thread, JIT key) -> when the cache missed
        self._before: Any = None
        self._after: Any = None

    def install(self) -> bool:
        """Set the hooks; False (nothing will be recorded) where Triton is not installed."""
        try:
            from triton import knobs
        except ImportError:
            return False
        self._before, self._after = knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook
        knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook = self.cache_missed, self.compiled
        return True

    def cache_missed(self, **kw: Any) -> bool | None:
        """Triton's hook before a compile. Returns what a hook set before returns (True would skip the compile)."""
        with self._lock:
            self._begun[(threading.get_ident(), str(kw.get("key")))] = time.perf_counter()
        return self._before(**kw) if self._before is not None else None

    def compiled(self, **kw: Any) -> bool | None:
        """Triton's hook after a compile: count it, time it, tell the listeners."""
        now = time.perf_counter()
        fn = kw.get("fn")
        # the function's own name (a kernel defined in a function has a qualified one)
        name = (getattr(fn, "name", None) or str(kw.get("repr", "?")).split("[", 1)[0]).rsplit(".", 1)[-1]
        with self._lock:
            begun = self._begun.pop((threading.get_ident(), str(kw.get("key"))), now)
            self.count[name] += 1
            self.seconds[name] += now - begun
            listeners = list(self.listeners)
        if listeners:
            event = KernelCompile(name, _constants(fn, kw.get("compile") or {}), now - begun)
            for listener in listeners:
                listener(event)
        return self._after(**kw) if self._after is not None else None

    def totals(self) -> list[tuple[str, int, float]]:
        """(kernel, compiles, seconds) of every kernel compiled since installation, by name."""
        with self._lock:
            return [(k, self.count[k], self.seconds[k]) for k in sorted(self.count)]


_WATCH: CompileWatch | None = None
_WATCH_LOCK = threading.Lock()


def watch() -> CompileWatch:
    """The process's :class:`CompileWatch`, installed by the first call (Triton's hooks are process-wide, so one
    watch with listeners rather than one per caller)."""
    global _WATCH
    with _WATCH_LOCK:
        if _WATCH is None:
            _WATCH = CompileWatch()
            _WATCH.install()
        return _WATCH
