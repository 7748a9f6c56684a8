"""Session checkpoints in the DS4X ABI (DESIGN §5): save a conversation to a file, load it back.

File layout (little-endian)::

    magic    8 bytes   b"DS4XSESS"
    version  u32       SESSION_ABI_VERSION
    hlen     u32       bytes of the header that follows
    header   hlen      UTF-8 JSON: model fingerprint and description, context, cache mode, prefill
                       chunk and mode, token count, rewind floor, payload bytes and CRC-32, tokens' CRC-32
                       (``tokens_crc32``), working dtype (``dtype``; these two optional: files written before
                       they were added lack them)
    tokens   4n bytes  int32, the n tokens the cache holds
    payload            safetensors: "logits" (float32 [vocab], if any) and the rows in use of every
                       cache store, "layers.{i}.{raw|comp_proj|comp_rows|idx_proj|idx_rows}", in the
                       cache's storage format (packed: the 583-byte KV and 68-byte indexer rows)

Magic and version come first and never move, so a file of any other version is refused by number.
Only rows in use are written (a packed session of n tokens costs its ring, its compressed rows up to
n / ratio and its compressor frontier, not the context's allocation). The tokens sit before the
payload so a prefix cache can index a directory by reading headers only.

A round trip restores the cache's state exactly, so the next-token logits and every later step are
bit-identical to continuing the original session.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from ds4x.files import replaceable_target
from ds4x.formats.ggml_tensor import GGMLTensor
from ds4x.model.cache import CACHE_MODES, ModelCache
from ds4x.runtime.engine import DTYPES, PREFILL_MODES, Engine, Session

SESSION_ABI_VERSION = 1
MAGIC = b"DS4XSESS"
SUFFIX = ".ds4xsession"
_PREFIX = struct.Struct("<8sII")  # magic, version, header length
_SAMPLED_TENSORS = 8  # weights whose bytes enter the fingerprint (a content sample, not a full hash)
_SAMPLE_ELEMS = 256
_HEADER_KEYS = {"model_fingerprint", "model", "ctx", "cache_mode", "prefill_chunk", "prefill_mode", "n_tokens",
                "rewind_floor", "payload_bytes", "payload_crc32"}
_MAX_HEADER_BYTES = 1 << 20  # a real header is a few hundred bytes


def _header_problem(meta: dict[str, Any]) -> str | None:
    """What is wrong with a parsed header's values (types and ranges), or None. Checked when the header is
    read so that a damaged or crafted value is refused there, not deep inside a load (an ``int()`` of a string,
    a cache of a huge chunk) or, in a prefix cache, at every lookup."""
    def nat(key: str, lo: int) -> bool:  # an int (bool is not one here) >= lo
        v = meta.get(key)
        return isinstance(v, int) and not isinstance(v, bool) and v >= lo

    for key, lo in (("ctx", 1), ("prefill_chunk", 1), ("n_tokens", 0), ("rewind_floor", 0), ("payload_bytes", 0),
                    ("payload_crc32", 0)):
        if not nat(key, lo):
            return f"{key} {meta.get(key)!r} is not an integer >= {lo}"
    if meta["rewind_floor"] > meta["n_tokens"]:
        return f"rewind floor {meta['rewind_floor']} is past the {meta['n_tokens']} tokens"
    if "tokens_crc32" in meta and not nat("tokens_crc32", 0):
        return f"tokens_crc32 {meta['tokens_crc32']!r} is not an integer >= 0"
    if meta.get("cache_mode") not in CACHE_MODES:
        return f"cache mode {meta.get('cache_mode')!r} is not one of {CACHE_MODES}"
    if meta.get("prefill_mode") not in PREFILL_MODES:
        return f"prefill mode {meta.get('prefill_mode')!r} is not one of {PREFILL_MODES}"
    return None


class SessionFileError(ValueError):
    """A session file that cannot be loaded here; the message names the file and what differs."""


# ---- model identity -----------------------------------------------------------------------------

def _weight_type(w: torch.Tensor | GGMLTensor) -> str:
    return w.qtype.name if isinstance(w, GGMLTensor) else str(w.dtype).removeprefix("torch.")


def _content_sample(w: torch.Tensor | GGMLTensor) -> bytes:
    """A few hundred elements from the start, middle and end of a weight's stored data (GGML weights: the
    file's bytes, whatever layout the kernels hold them in)."""
    k = _SAMPLE_ELEMS
    if isinstance(w, GGMLTensor):
        rows, rb = w.raw.reshape(-1, w.row_bytes), w.row_bytes

        def span(lo: int, hi: int) -> torch.Tensor:  # converts only the rows holding bytes lo..hi
            r0, r1 = lo // rb, -(-hi // rb)
            part = GGMLTensor(rows[r0:r1], w.qtype, (r1 - r0, w.shape[-1]), w.layout).blocks().raw.reshape(-1)
            return part[lo - r0 * rb : hi - r0 * rb]

        n = rows.numel()
    else:
        t = w.detach()
        # a contiguous tensor flattens as a view; otherwise sample its first row (no full copy)
        flat = t.reshape(-1) if t.is_contiguous() else t[(0,) * (t.dim() - 1)]
        n = flat.numel()

        def span(lo: int, hi: int) -> torch.Tensor:
            return flat[lo:hi]

    mid = max(0, n // 2 - k // 2)
    picked = torch.cat([span(0, min(n, k)), span(mid, min(n, mid + k)), span(max(0, n - k), n)])
    return picked.contiguous().cpu().view(torch.uint8).numpy().tobytes()


def model_fingerprint(engine: Engine) -> str:
    """SHA-256 over the canonical config, every tensor's name, shape and type, and a content sample of a
    few weights: another model, quantization or working dtype gives another fingerprint."""
    h = hashlib.sha256()
    cfg = {k: v for k, v in dataclasses.asdict(engine.cfg).items() if k != "extra"}  # extra: free-form metadata
    h.update(json.dumps(cfg, sort_keys=True, default=str).encode())
    h.update(str(engine.model.dtype).encode())  # the activations' dtype (GGML weights keep their own type)
    weights = engine.model.w
    names = sorted(weights)
    for name in names:
        w = weights[name]
        h.update(f"{name}|{list(w.shape)}|{_weight_type(w)}\n".encode())
    for name in names[:: max(1, len(names) // _SAMPLED_TENSORS)]:
        h.update(_content_sample(weights[name]))
    return h.hexdigest()


def working_dtype(engine: Engine) -> str:
    """The activations' dtype by name ("float32", "bfloat16", ...): part of a session's identity."""
    return str(engine.model.dtype).removeprefix("torch.")


def model_description(engine: Engine) -> str:
    cfg = engine.cfg
    return (f"{engine.name} ({cfg.num_layers} layers: {cfg.layer_summary()}; hidden {cfg.hidden_size}, "
            f"vocab {cfg.vocab_size}; {working_dtype(engine)})")


# ---- snapshots: a session's state detached from its cache ---------------------------------------

@dataclass(frozen=True)
class SessionSnapshot:
    """Everything a session holds, as immutable copies (what a file stores, and a prefix cache keeps)."""

    ctx: int
    cache_mode: str
    prefill_chunk: int
    prefill_mode: str
    tokens: tuple[int, ...]
    logits: torch.Tensor | None
    rows: dict[str, torch.Tensor]
    rewind_floor: int  # the shortest prefix a restored session can be rewound to without recomputing

    @property
    def nbytes(self) -> int:
        tensors = [*self.rows.values(), *([self.logits] if self.logits is not None else [])]
        return 4 * len(self.tokens) + sum(t.numel() * t.element_size() for t in tensors)


def snapshot(session: Session) -> SessionSnapshot:
    cache = session.cache
    if len(session.tokens) != cache.length:
        raise ValueError(f"session holds {len(session.tokens)} tokens but its cache {cache.length}; "
                         f"it is mid-update and cannot be saved")
    return SessionSnapshot(
        ctx=cache.ctx, cache_mode=cache.mode, prefill_chunk=cache.chunk, prefill_mode=session.prefill_mode,
        tokens=tuple(session.tokens), logits=None if session.logits is None else session.logits.clone(),
        rows=cache.state(), rewind_floor=cache.rewind_floor())


def restore(engine: Engine, snap: SessionSnapshot, length: int | None = None, ctx: int | None = None,
            announce: bool = False, into: ModelCache | None = None) -> Session:
    """A new session holding ``snap`` (rewound to its first ``length`` tokens if given; then it has no
    logits until the next token is evaluated), in a context of ``ctx`` tokens (default: the snapshot's).
    ``into``: an existing cache of the snapshot's layout to hold it (e.g. a server's decode slot), instead of a
    new one (its context counts, not ``ctx``)."""
    ctx = into.ctx if into is not None else snap.ctx if ctx is None else ctx
    if len(snap.tokens) > ctx:
        raise ValueError(f"the session holds {len(snap.tokens)} tokens, more than a context of {ctx}")
    if into is None:
        session = engine.new_session(ctx=ctx, cache=snap.cache_mode, prefill_chunk=snap.prefill_chunk,
                                     prefill_mode=snap.prefill_mode, announce=announce)
    else:
        if (into.mode, into.chunk) != (snap.cache_mode, snap.prefill_chunk):
            raise ValueError(f"a {snap.cache_mode} session of prefill chunk {snap.prefill_chunk} cannot go into a "
                             f"{into.mode} cache of chunk {into.chunk}")
        session = Session(engine, into, snap.prefill_chunk, snap.prefill_mode)
    session.cache.load_state(len(snap.tokens), snap.rows)
    session.tokens = list(snap.tokens)
    session.logits = None if snap.logits is None else snap.logits.to(engine.model.device, copy=True)
    if length is not None and length != len(snap.tokens):
        session.cache.rewind(length)
        del session.tokens[length:]
        session.logits = None
    return session


# ---- files --------------------------------------------------------------------------------------

@dataclass(frozen=True)
class SessionFileHeader:
    path: Path
    meta: dict[str, Any]
    tokens: tuple[int, ...]
    payload_offset: int

    @property
    def nbytes(self) -> int:
        return self.payload_offset + self.meta["payload_bytes"]


def write_snapshot(snap: SessionSnapshot, path: str | Path, fingerprint: str, model: str,
                   dtype: str) -> SessionFileHeader:
    """Write ``snap`` atomically (a temporary file renamed into place); return the file's header. ``dtype``: the
    working dtype it was computed in (`working_dtype`), which a later load names when it differs."""
    path = replaceable_target(path)
    tensors = {name: t.contiguous().cpu() for name, t in snap.rows.items()}
    if snap.logits is not None:
        tensors["logits"] = snap.logits.float().contiguous().cpu()
    payload = st_save(tensors)
    meta = {
        "model_fingerprint": fingerprint, "model": model, "ctx": snap.ctx, "cache_mode": snap.cache_mode,
        "prefill_chunk": snap.prefill_chunk, "prefill_mode": snap.prefill_mode, "n_tokens": len(snap.tokens),
        "rewind_floor": snap.rewind_floor, "payload_bytes": len(payload), "payload_crc32": zlib.crc32(payload),
        "dtype": dtype,
    }
    tokens = np.asarray(snap.tokens, dtype="<i4").tobytes()
    # the tokens lie outside the payload's checksum: without their own, a damaged token loads as another
    # conversation (and a prefix cache would hand this state out for the wrong prompt)
    meta["tokens_crc32"] = zlib.crc32(tokens)
    header = json.dumps(meta).encode()
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{id(snap):x}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(_PREFIX.pack(MAGIC, SESSION_ABI_VERSION, len(header)))
            f.write(header)
            f.write(tokens)
            f.write(payload)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return SessionFileHeader(path, meta, snap.tokens, _PREFIX.size + len(header) + len(tokens))


def _read_meta(f: BinaryIO, path: Path, size: int) -> tuple[dict[str, Any], int]:
    """The header of the session file open as ``f`` (``size`` bytes), checked for form (magic, version, lengths,
    keys and their values), and its length; raise SessionFileError."""
    head = f.read(_PREFIX.size)
    if len(head) < len(MAGIC) or head[: len(MAGIC)] != MAGIC:
        raise SessionFileError(f"{path} is not a ds4x session file (it starts with {head[:8]!r}, "
                               f"expected {MAGIC!r})")
    # the version right after the magic: a file of another version is named as such, whatever follows
    if len(head) >= 12 and (version := struct.unpack_from("<I", head, 8)[0]) != SESSION_ABI_VERSION:
        raise SessionFileError(f"{path} is a session file of ABI version {version}; this ds4x reads version "
                               f"{SESSION_ABI_VERSION} only (recreate the session with this version)")
    if len(head) < _PREFIX.size:
        raise SessionFileError(f"{path} is truncated: {size} bytes, shorter than the fixed header")
    hlen = _PREFIX.unpack(head)[2]
    if _PREFIX.size + hlen > size:  # checked before reading: a damaged length must not size an allocation
        raise SessionFileError(f"{path} is truncated: {size} bytes, the header alone needs "
                               f"{_PREFIX.size + hlen}")
    if hlen > _MAX_HEADER_BYTES:
        raise SessionFileError(f"{path} has a corrupt header (its length {hlen} is implausible)")
    raw = f.read(hlen)
    try:
        meta = json.loads(raw)
        if missing := _HEADER_KEYS - meta.keys():
            raise ValueError(f"no {', '.join(sorted(missing))}")
        if problem := _header_problem(meta):
            raise ValueError(problem)
    except (ValueError, TypeError, AttributeError, RecursionError) as exc:  # RecursionError: deep nesting
        raise SessionFileError(f"{path} has a corrupt header ({exc})") from None
    return meta, hlen


def read_header(path: str | Path, fingerprint: str, model: str, vocab: int, dtype: str) -> SessionFileHeader:
    """Read and check a session file's header and tokens (not its payload; each token an id below ``vocab``);
    raise SessionFileError. ``dtype``: the loaded model's working dtype, named when the file's differs."""
    path = Path(path)
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        meta, hlen = _read_meta(f, path, size)
        n, payload = meta["n_tokens"], meta["payload_bytes"]
        if meta.get("model_fingerprint") != fingerprint:
            saved = meta.get("dtype")
            if isinstance(saved, str) and saved != dtype:  # a state is its dtype's own
                raise SessionFileError(f"{path} was computed in {saved} by {meta.get('model', '?')}; the loaded "
                                       f"model computes in {dtype}: load it in {saved} to continue the session")
            raise SessionFileError(
                f"{path} was saved with another model: {meta.get('model', '?')} "
                f"(fingerprint {str(meta.get('model_fingerprint'))[:16]}); the loaded model is {model} "
                f"(fingerprint {fingerprint[:16]}); load the model the file was made with")
        offset = _PREFIX.size + hlen + 4 * n
        if size != offset + payload:
            what = "truncated" if size < offset + payload else "longer than its header says"
            raise SessionFileError(f"{path} is {what}: {size} bytes, the header promises {offset + payload}")
        raw_tokens = f.read(4 * n)
    if "tokens_crc32" in meta and zlib.crc32(raw_tokens) != meta["tokens_crc32"]:
        raise SessionFileError(f"{path} is damaged: its tokens do not match the header's checksum")
    ids = np.frombuffer(raw_tokens, dtype="<i4")
    if ids.size and not (0 <= int(ids.min()) and int(ids.max()) < vocab):  # a checksum can be forged or absent
        bad = int(ids[(ids < 0) | (ids >= vocab)][0])
        raise SessionFileError(f"{path} is damaged: it holds token id {bad}, outside the vocabulary [0, {vocab})")
    return SessionFileHeader(path, meta, tuple(ids.tolist()), offset)


def saved_dtype(path: str | Path) -> str | None:
    """The working dtype a session file was computed in, from its header (None if the file does not say one of
    ours: older files, or a file that is not a sound session file; loading it reports what is wrong)."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            meta, _ = _read_meta(f, path, os.fstat(f.fileno()).st_size)
    except (SessionFileError, OSError):
        return None
    dtype = meta.get("dtype")
    return dtype if isinstance(dtype, str) and dtype in DTYPES else None


def read_snapshot(header: SessionFileHeader) -> SessionSnapshot:
    """The snapshot a checked header belongs to (reads the payload)."""
    meta, path = header.meta, header.path
    with open(path, "rb") as f:
        f.seek(header.payload_offset)
        payload = f.read(meta["payload_bytes"])
    if len(payload) != meta["payload_bytes"]:
        raise SessionFileError(f"{path} is truncated: its payload ends after {len(payload)} of "
                               f"{meta['payload_bytes']} bytes")
    if zlib.crc32(payload) != meta["payload_crc32"]:
        raise SessionFileError(f"{path} is damaged: its tensor payload does not match the header's checksum")
    try:
        tensors = st_load(payload)
    except Exception as exc:  # safetensors raises its own SafetensorError: a payload matching a forged checksum
        raise SessionFileError(f"{path} has a corrupt payload ({exc})") from None
    logits = tensors.pop("logits", None)
    # the rows are checked against the cache's layout when loaded; the logits have no other check
    if logits is not None and (logits.dtype != torch.float32 or logits.dim() != 1):
        raise SessionFileError(f"{path} has a corrupt payload: its logits are {logits.dtype} "
                               f"{list(logits.shape)}, not a float32 vector")
    return SessionSnapshot(ctx=meta["ctx"], cache_mode=meta["cache_mode"], prefill_chunk=meta["prefill_chunk"],
                           prefill_mode=meta["prefill_mode"], tokens=header.tokens, logits=logits, rows=tensors,
                           rewind_floor=meta["rewind_floor"])


def save_session(session: Session, path: str | Path) -> int:
    """Write ``session`` (its tokens, last logits and cache rows in use) to ``path``; return the bytes."""
    engine = session.engine
    return write_snapshot(snapshot(session), path, model_fingerprint(engine), model_description(engine),
                          working_dtype(engine)).nbytes


def load_session(engine: Engine, path: str | Path, ctx: int | None = None, cache: str | None = None,
                 prefill_chunk: int | None = None, prefill_mode: str | None = None) -> Session:
    """The session saved in ``path``, continuing exactly where it stopped.

    The cache mode and prefill chunk are the file's: given ones must agree or the file is refused. The
    context defaults to the file's and may be changed if it holds the session's tokens; ``prefill_mode``
    (how later prompts are evaluated) may be changed freely.
    """
    header = read_header(path, model_fingerprint(engine), model_description(engine), engine.cfg.vocab_size,
                         working_dtype(engine))
    meta = header.meta
    if cache is not None and cache != meta["cache_mode"]:
        raise SessionFileError(f"{path} holds a {meta['cache_mode']} cache; it cannot be continued as a {cache} "
                               f"cache (load it with cache mode {meta['cache_mode']})")
    if prefill_chunk is not None and prefill_chunk != meta["prefill_chunk"]:
        raise SessionFileError(f"{path} was saved with prefill chunk {meta['prefill_chunk']} (it sizes the cache "
                               f"rings); it cannot be loaded with prefill chunk {prefill_chunk}")
    snap = read_snapshot(header)
    if snap.logits is not None and snap.logits.numel() != engine.cfg.vocab_size:
        raise SessionFileError(f"{path} has a corrupt payload: {snap.logits.numel()} logits, the model's "
                               f"vocabulary has {engine.cfg.vocab_size}")
    if prefill_mode is not None:
        snap = dataclasses.replace(snap, prefill_mode=prefill_mode)
    try:
        return restore(engine, snap, ctx=ctx, announce=True)
    except ValueError as exc:
        raise SessionFileError(f"{path}: {exc}") from None
