"""Prefix reuse: keep snapshots of finished sessions and hand out private copies of the longest match.

``store(session)`` keeps a snapshot of the session keyed by its tokens (its cache rows in use, copied on
the session's device). ``lookup(tokens)`` finds the stored snapshot sharing the longest prefix with
``tokens`` and returns a new session holding that prefix, to which the caller appends the rest.

Contract of ``lookup``: the returned length ``n`` is always at most ``len(tokens) - 1``, so the caller
always evaluates at least the last prompt token itself (its logits are what the next token is sampled
from) and ``session.prefill(tokens[n:])`` is never empty. A stored sequence that extends or diverges from
``tokens`` is used too, rewound to the shared prefix, when its cache can rewind that far (float and native
caches keep every row; a packed cache only about its last sliding window); a session rewound this way has
no logits until the caller prefills. Continuing a hit gives the same tokens as a fresh prefill would, up
to the float reduction order of different prefill chunking (bit-identical under ``exact`` prefill).

Memory: resident snapshots are evicted least recently used first once their bytes pass
``max_resident_bytes``. With a ``directory`` an evicted snapshot is written there as a session file
(session_file.py) instead of dropped, the directory is kept under ``max_disk_bytes`` by deleting the
files of oldest modification time (a hit touches its file), and a new PrefixCache on the same directory
finds them again. Files there of another model, another ABI version, or damaged, are removed: the
directory belongs to one cache.

Thread-safe: every method may be called from any thread. ``store`` must not run while the session is
being evaluated by another thread (it copies the session's cache).
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ds4x.model.cache import ModelCache
from ds4x.runtime.engine import Engine, Session
from ds4x.runtime.session_file import (
    SUFFIX,
    SessionFileError,
    SessionFileHeader,
    SessionSnapshot,
    model_description,
    model_fingerprint,
    read_header,
    read_snapshot,
    restore,
    snapshot,
    working_dtype,
    write_snapshot,
)

log = logging.getLogger(__name__)


@dataclass
class _Entry:
    tokens: np.ndarray  # int64, for fast prefix comparison
    rewind_floor: int
    layout: tuple[int, str, int]  # context, cache mode, prefill chunk
    snap: SessionSnapshot | None = None  # resident copy
    file: SessionFileHeader | None = None  # on-disk copy
    writing: SessionSnapshot | None = None  # evicted, being written to disk (still served meanwhile)
    file_used: int = 0  # when the file was last written or read (a counter: mtimes can tie)


def _key(tokens: tuple[int, ...] | list[int]) -> str:
    # a digest, not the tuple: hashing a long tuple costs O(n) on every dict access
    return hashlib.sha256(np.asarray(tokens, dtype="<i8").tobytes()).hexdigest()[:40]


def _shared_prefix(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if diff.size else n


class PrefixCache:
    """Snapshots of sessions by token sequence, in memory and (optionally) on disk; see the module doc."""

    def __init__(self, engine: Engine, max_resident_bytes: int, directory: str | Path | None = None,
                 max_disk_bytes: int = 8 * 2**30):
        if max_resident_bytes < 0 or max_disk_bytes < 0:
            raise ValueError(f"prefix cache sizes must be >= 0, got resident {max_resident_bytes}, "
                             f"disk {max_disk_bytes}")
        self.engine = engine
        self.max_resident_bytes, self.max_disk_bytes = max_resident_bytes, max_disk_bytes
        self.directory = Path(directory) if directory is not None else None
        self.hits = self.misses = self.reused_tokens = 0
        self._fingerprint, self._model = model_fingerprint(engine), model_description(engine)
        self._dtype = working_dtype(engine)
        self._lock = threading.Lock()
        self._entries: OrderedDict[str, _Entry] = OrderedDict()  # least recently used first
        self._resident_bytes = 0
        self._clock = 0  # orders file use within this process; across processes the files' mtimes do
        if self.directory is not None:
            self.directory.mkdir(parents=True, exist_ok=True)
            self._scan()

    # ---- public API -----------------------------------------------------------------------------

    def lookup(self, tokens: list[int], into: ModelCache | None = None, align: int = 1,
               layout: tuple[int, str, int] | None = None) -> tuple[Session | None, int]:
        """(a private session holding the longest reusable prefix of ``tokens``, its length n), or
        (None, 0). n <= len(tokens) - 1: the caller evaluates ``tokens[n:]``, never empty. ``into``: the cache
        the session gets (see :func:`ds4x.runtime.session_file.restore`). ``align``: n is a multiple of it (the
        session is rewound once, straight to n, which the entry's rewind floor admits). ``layout``: only entries
        of this (context, cache mode, prefill chunk) (default: ``into``'s)."""
        query = np.asarray(tokens, dtype=np.int64)
        if into is not None:
            layout = (into.ctx, into.mode, into.chunk)
        with self._lock:
            best, best_n = None, 0
            for key, e in self._entries.items():
                if layout is not None and e.layout != layout:
                    continue
                n = min(_shared_prefix(e.tokens, query), len(query) - 1)
                n -= n % align
                if n == 0:
                    continue
                usable = n == len(e.tokens) or n >= e.rewind_floor
                in_memory = e.snap is not None or e.writing is not None
                if usable and (n > best_n or (n == best_n and best is not None and not best[2] and in_memory)):
                    best, best_n = (key, e, in_memory), n
            if best is None:
                self.misses += 1
                return None, 0
            key, entry, _ = best
            self._entries.move_to_end(key)
            snap, header = entry.snap or entry.writing, entry.file
        if snap is None:
            assert header is not None
            snap = self._load(key, header)
            if snap is None:
                return None, 0
        session = restore(self.engine, snap, length=best_n, into=into)
        with self._lock:
            self.hits += 1
            self.reused_tokens += best_n
        return session, best_n

    def store(self, session: Session) -> None:
        """Keep a snapshot of ``session`` (a no-op beyond refreshing its recency if the same tokens with the
        same cache layout are already held)."""
        if not session.tokens:
            return
        key = _key(session.tokens)
        layout = (session.cache.ctx, session.cache.mode, session.cache.chunk)
        with self._lock:
            held = self._entries.get(key)
            if held is not None and held.layout == layout:
                self._entries.move_to_end(key)
                if held.file is not None:
                    self._touch(held)
                return
        snap = snapshot(session)
        entry = _Entry(np.asarray(snap.tokens, dtype=np.int64), snap.rewind_floor, layout, snap=snap)
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self._drop(old)
            self._entries[key] = entry
            self._resident_bytes += snap.nbytes
            evicted = self._evict()
        self._spill(evicted)

    @property
    def resident_bytes(self) -> int:
        return self._resident_bytes

    @property
    def disk_bytes(self) -> int:
        with self._lock:
            return sum(e.file.nbytes for e in self._entries.values() if e.file is not None)

    # ---- internals: _drop, _evict, _trim_disk and _touch run under the lock; the others take it ----------

    def _drop(self, entry: _Entry) -> None:
        """Forget an entry removed from the index: its resident bytes and its file."""
        if entry.snap is not None:
            self._resident_bytes -= entry.snap.nbytes
        if entry.file is not None:
            entry.file.path.unlink(missing_ok=True)

    def _evict(self) -> list[tuple[str, _Entry, SessionSnapshot]]:
        """Drop resident snapshots, oldest first, until within budget; return those to write to disk."""
        spill = []
        for key in list(self._entries):
            if self._resident_bytes <= self.max_resident_bytes:
                break
            e = self._entries[key]
            if e.snap is None:
                continue
            snap, e.snap = e.snap, None
            self._resident_bytes -= snap.nbytes
            if e.file is None:
                if self.directory is not None and snap.nbytes <= self.max_disk_bytes:
                    e.writing = snap
                    spill.append((key, e, snap))
                else:
                    del self._entries[key]
        return spill

    def _spill(self, evicted: list[tuple[str, _Entry, SessionSnapshot]]) -> None:
        assert self.directory is not None or not evicted
        for key, entry, snap in evicted:
            try:
                header = write_snapshot(snap, self.directory / f"{key}{SUFFIX}", self._fingerprint, self._model,
                                        self._dtype)
            except OSError as exc:
                log.warning("prefix cache: could not write a %d-token session to %s: %s", len(snap.tokens),
                            self.directory, exc)
                header = None
            with self._lock:
                entry.writing = None
                held = self._entries.get(key)
                # if stored again meanwhile with the same layout, the file still holds a state of its tokens
                if header is not None and held is not None and held.file is None and held.layout == entry.layout:
                    held.file = header
                    self._touch(held)
                elif header is not None and (held is None or held.file is None):
                    header.path.unlink(missing_ok=True)  # replaced by another layout meanwhile: unused
                if held is entry and entry.snap is None and entry.file is None:
                    del self._entries[key]  # the write failed: nothing of it is left
                self._trim_disk()

    def _trim_disk(self) -> None:
        on_disk = [(k, e) for k, e in self._entries.items() if e.file is not None]
        total = sum(e.file.nbytes for _, e in on_disk)
        for key, e in sorted(on_disk, key=lambda item: item[1].file_used):
            if total <= self.max_disk_bytes:
                break
            total -= e.file.nbytes
            e.file.path.unlink(missing_ok=True)
            e.file = None
            if e.snap is None:
                del self._entries[key]

    def _load(self, key: str, header: SessionFileHeader) -> SessionSnapshot | None:
        """Read an on-disk snapshot back into memory (outside the lock); None if the file went bad."""
        try:
            snap = read_snapshot(header)
        except (SessionFileError, OSError) as exc:
            log.warning("prefix cache: dropping %s: %s", header.path, exc)
            with self._lock:
                e = self._entries.get(key)
                if e is not None and e.file is header:  # else the file was replaced or trimmed meanwhile
                    header.path.unlink(missing_ok=True)
                    e.file = None
                    if e.snap is None:
                        del self._entries[key]
                self.misses += 1
            return None
        with self._lock:
            e = self._entries.get(key)
            if e is not None and e.file is header:
                self._touch(e)
            if e is not None and e.file is header and e.snap is None:
                e.snap = snap
                self._resident_bytes += snap.nbytes
                self._entries.move_to_end(key)
                evicted = self._evict()
            else:
                evicted = []
        self._spill(evicted)
        return snap

    def _scan(self) -> None:
        assert self.directory is not None

        def mtime(path: Path) -> int:
            try:
                return path.stat().st_mtime_ns
            except OSError:
                return -1

        def remove(path: Path) -> None:  # a start-up scan must not fail on an entry it cannot delete
            try:
                path.unlink(missing_ok=True)
            except OSError as exc:
                log.warning("prefix cache: could not remove %s: %s", path, exc)

        for path in sorted(self.directory.glob(f"*{SUFFIX}"), key=mtime):  # oldest first
            if path.is_dir():  # not a session file, and not ours to delete: skip it
                log.warning("prefix cache: ignoring %s: a directory", path)
                continue
            try:
                header = read_header(path, self._fingerprint, self._model, self.engine.cfg.vocab_size, self._dtype)
            except (SessionFileError, OSError) as exc:
                log.warning("prefix cache: removing %s: %s", path, exc)
                remove(path)
                continue
            meta, key = header.meta, _key(header.tokens)
            if key in self._entries:  # the same tokens twice (a copied file): keep one
                remove(path)
                continue
            self._clock += 1
            self._entries[key] = _Entry(
                np.asarray(header.tokens, dtype=np.int64), int(meta["rewind_floor"]),
                (int(meta["ctx"]), meta["cache_mode"], int(meta["prefill_chunk"])), file=header,
                file_used=self._clock)
        with self._lock:
            self._trim_disk()

    def _touch(self, entry: _Entry) -> None:
        """Mark an entry's file as just used (here, and in its mtime for the next process)."""
        assert entry.file is not None
        self._clock += 1
        entry.file_used = self._clock
        try:
            os.utime(entry.file.path)
        except OSError:
            pass  # deleted from outside: a lookup that fails to read it forgets it
