"""Per-session attention state: row stores with a storage codec, and the memory plan.

Every stream of state is a `RowStore`: rows indexed by position (raw KV rows, compressor projections)
or by compressed-row number (compressed KV rows, indexer keys), held in a ring of ``capacity`` rows in
the format of its codec. Everything the model needs at position p is a function of rows < p, so the
cache's only scalar state is ``length``; rewinding is moving ``length`` back while the rows it needs are
still resident.

Three modes, one switch (DESIGN §3.2, §5):
- ``float``: rows as computed, float32; matches transformers. Full history kept (rewind anywhere).
- ``native``: the official graph's round trips, unpacked: non-RoPE dims of every attention row through
  E4M3 with a power-of-two scale per 64 values, RoPE dims as FP16, indexer keys and queries
  Hadamard-rotated then MXFP4. Full history kept. The oracle for ``packed``.
- ``packed``: the same values stored in the DS4X ABI (583-byte KV rows, 68-byte indexer rows), raw rows
  in a ring of ``align_up(window + prefill_chunk, 256)`` rows, compressor projections only for the open
  windows (float32 frontier). Unpacks to exactly the ``native`` values, so logits are bit-identical.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from dataclasses import dataclass, fields
from typing import Any

import torch

from ds4x.config import CSA, SLIDING, ModelConfig
from ds4x.formats import (
    INDEXER_ROW_BYTES,
    e4m3_block_roundtrip,
    hadamard128,
    kv_row_bytes,
    mxfp4_roundtrip,
    pack_indexer_rows,
    pack_kv_rows,
    unpack_indexer_rows,
    unpack_kv_rows,
)
from ds4x.kernels.dispatch import use_triton
from ds4x.memory import free_memory

CACHE_MODES = ("float", "native", "packed")


class ContextOverflowError(ValueError):
    """More tokens than the session's context was created for."""


class CacheMemoryError(MemoryError):
    """The planned cache does not fit the device; the message carries the plan and the free memory."""


def align_up(n: int, a: int) -> int:
    return -(-n // a) * a


# ---- codecs: how a float row is stored and read back ------------------------------------------

def _copy_into_ring(data: torch.Tensor, index: torch.Tensor, stored: torch.Tensor) -> None:
    """Rows already in the storage format into the ring ``data`` at ``index % len(data)``; into a batch of rings
    ``data`` [B, ring, width], row b into ring b at ``index[b] % ring``."""
    if data.dim() == 3:
        data[torch.arange(data.shape[0], device=data.device), index % data.shape[1]] = stored.to(data.dtype)
    else:
        data.index_copy_(0, index % data.shape[0], stored.to(data.dtype))


class FloatCodec:
    def __init__(self, dim: int):
        self.dim, self.width, self.dtype = dim, dim, torch.float32

    def stored_values(self, x: torch.Tensor) -> torch.Tensor:
        """Rows whose values (as float32) the ring stores for ``x``, in any float dtype."""
        return x

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        return self.stored_values(x).float()

    def write_at(self, data: torch.Tensor, index: torch.Tensor, x: torch.Tensor) -> None:
        """Encode rows ``x`` into the ring ``data`` at ``index % len(data)``: on the GPU in one launch (the cast,
        the ring index and the copy; a decode step writes two compressor rings per layer)."""
        rt = _triton_rows(x)
        if rt is not None:
            rt.write_float_rows_triton(self.stored_values(x), data, index)
        else:
            _copy_into_ring(data, index, self.encode(x))

    def decode(self, stored: torch.Tensor) -> torch.Tensor:
        return stored


def _triton_rows(x: torch.Tensor, kv_dims: tuple[int, int] | None = None) -> Any:
    """The Triton row kernels (one launch each) for a CUDA tensor, else None: the torch versions take 40 to 130
    small kernels per call, which a decode step would pay for every layer. Both are bit-identical. With
    ``kv_dims`` (row width, RoPE dims): only if the KV row kernels take that layout."""
    if not use_triton(x.device):
        return None
    from ds4x.formats import rows_triton

    return rows_triton if kv_dims is None or rows_triton.kv_rows_supported(*kv_dims) else None


class NativeKVCodec(FloatCodec):
    """E4M3 (UE8M0 scale per 64) on the non-RoPE dims, FP16 on the RoPE dims; stored unpacked."""

    def __init__(self, dim: int, rope_dim: int):
        super().__init__(dim)
        self.nope, self.rope_dim = dim - rope_dim, rope_dim

    def stored_values(self, x: torch.Tensor) -> torch.Tensor:
        rt = _triton_rows(x, (self.dim, self.rope_dim))
        if rt is not None:  # the packed bytes, read back
            return rt.unpack_kv_rows_triton(rt.pack_kv_rows_triton(x, validate=False, rope_dim=self.rope_dim),
                                            rope_dim=self.rope_dim)
        x = x.float()
        return torch.cat([e4m3_block_roundtrip(x[..., : self.nope], 64), x[..., self.nope :].half().float()], -1)


class PackedKVCodec:
    def __init__(self, dim: int, rope_dim: int):
        self.dim, self.rope_dim, self.dtype = dim, rope_dim, torch.uint8
        self.width = kv_row_bytes(dim, rope_dim)

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        # finiteness is checked on the float rows by the caller's contract; skipping the check here
        # keeps the step free of host syncs
        rt = _triton_rows(x, (self.dim, self.rope_dim))
        if rt is not None:
            return rt.pack_kv_rows_triton(x, validate=False, rope_dim=self.rope_dim)
        return pack_kv_rows(x, validate=False, rope_dim=self.rope_dim)

    def write_at(self, data: torch.Tensor, index: torch.Tensor, x: torch.Tensor) -> None:
        """As FloatCodec.write_at; the Triton pack writes straight into the ring (one launch, no packed copy)."""
        rt = _triton_rows(x, (self.dim, self.rope_dim))
        if rt is not None:
            rt.pack_kv_rows_triton(x, validate=False, rope_dim=self.rope_dim, out=data, at=index)
        else:
            _copy_into_ring(data, index, self.encode(x))

    def decode(self, stored: torch.Tensor) -> torch.Tensor:
        rt = _triton_rows(stored, (self.dim, self.rope_dim))
        if rt is not None:
            return rt.unpack_kv_rows_triton(stored, rope_dim=self.rope_dim)
        return unpack_kv_rows(stored, rope_dim=self.rope_dim)


def rotate_mxfp4_roundtrip(x: torch.Tensor) -> torch.Tensor:
    """Indexer keys and queries as the native graph scores them: Hadamard-128, then through MXFP4 and back."""
    rt = _triton_rows(x)
    if rt is not None:
        return rt.rotate_mxfp4_roundtrip_triton(x)
    return mxfp4_roundtrip(hadamard128(x.float()), 32)


class NativeIndexerCodec(FloatCodec):
    """Indexer keys: Hadamard-128 rotation, then MXFP4; stored unpacked (rotated)."""

    def stored_values(self, x: torch.Tensor) -> torch.Tensor:
        return rotate_mxfp4_roundtrip(x)


class PackedIndexerCodec:
    def __init__(self) -> None:
        self.dim, self.width, self.dtype = 128, INDEXER_ROW_BYTES, torch.uint8

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        rt = _triton_rows(x)
        if rt is not None:
            return rt.pack_indexer_rows_triton(x, validate=False, rotate=True)
        return pack_indexer_rows(hadamard128(x.float()), validate=False)

    def write_at(self, data: torch.Tensor, index: torch.Tensor, x: torch.Tensor) -> None:
        """As FloatCodec.write_at; the Triton pack writes straight into the ring."""
        rt = _triton_rows(x)
        if rt is not None:
            rt.pack_indexer_rows_triton(x, validate=False, out=data, at=index, rotate=True)
        else:
            _copy_into_ring(data, index, self.encode(x))

    def decode(self, stored: torch.Tensor) -> torch.Tensor:
        rt = _triton_rows(stored)
        return rt.unpack_indexer_rows_triton(stored) if rt is not None else unpack_indexer_rows(stored)


Codec = FloatCodec | PackedKVCodec | PackedIndexerCodec


class RowStore:
    """Rows addressed by an absolute index, held in a ring of ``capacity`` slots.

    ``data`` is the ring [capacity, width], or (`batch_layer`) a batch of rings [B, capacity, width], one per
    session of a batched decode step; only ``write_at`` takes a batch (row b of the rows goes to ring b)."""

    def __init__(self, capacity: int, codec: Codec, device: torch.device, data: torch.Tensor | None = None):
        self.capacity, self.codec = capacity, codec
        self.data = torch.zeros(capacity, codec.width, dtype=codec.dtype, device=device) if data is None else data

    def _slots(self, start: int, stop: int) -> torch.Tensor | slice:
        if stop - start > self.capacity:
            raise ValueError(f"{stop - start} rows do not fit a ring of {self.capacity}")
        a, b = start % self.capacity, stop % self.capacity
        if stop - start == 0 or a < b or b == 0:
            return slice(a, a + (stop - start))
        return torch.arange(start, stop, device=self.data.device) % self.capacity

    def write(self, start: int, rows: torch.Tensor) -> None:
        self.data[self._slots(start, start + rows.shape[0])] = self.codec.encode(rows)

    def write_at(self, index: torch.Tensor, rows: torch.Tensor) -> None:
        """Write ``rows`` at absolute indices ``index`` (a device tensor of distinct indices, at most
        ``capacity`` of them): no host sync, so a CUDA graph can replay it at other positions."""
        self.codec.write_at(self.data, index, rows)

    def read(self, start: int, stop: int) -> torch.Tensor:
        """Rows [start, stop) as float32 [stop - start, dim]."""
        return self.codec.decode(self.data[self._slots(start, stop)])

    def gather(self, index: torch.Tensor) -> torch.Tensor:
        """Rows at absolute indices ``index`` (any shape) as float32 [..., dim]."""
        return self.codec.decode(self.data[index % self.capacity])

    def stored(self, start: int, stop: int) -> torch.Tensor:
        """A copy of rows [start, stop) in the storage format (packed bytes or float32)."""
        slots = self._slots(start, stop)
        rows = self.data[slots]
        return rows.clone() if isinstance(slots, slice) else rows  # a slice is a view of the ring

    def put_stored(self, start: int, rows: torch.Tensor) -> None:
        """Write rows already in the storage format (from ``stored``) at ``start``."""
        self.data[self._slots(start, start + rows.shape[0])] = rows.to(self.data.device)

    def clone(self) -> RowStore:
        other = copy.copy(self)
        other.data = self.data.clone()  # its own ring, outside any pool
        return other

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()


@dataclass
class LayerState:
    raw: RowStore  # KV rows after norm + RoPE, by position
    comp_proj: RowStore | None = None  # compressor [kv | gate] projections by position (float32 frontier)
    comp_rows: RowStore | None = None  # emitted compressed KV rows, by row number
    idx_proj: RowStore | None = None  # indexer compressor [kv | gate] projections by position
    idx_rows: RowStore | None = None  # emitted compressed indexer keys, by row number


# ---- memory plan --------------------------------------------------------------------------------

def plan_cache(cfg: ModelConfig, ctx: int, chunk: int, mode: str = "packed") -> dict[str, int]:
    """Bytes per component for a session of ``ctx`` tokens evaluated ``chunk`` tokens at a time."""
    rows = _capacities(cfg, ctx, chunk, mode)
    hd, ih = cfg.head_dim, cfg.index_head_dim
    kv_b = kv_row_bytes(hd, cfg.rope_head_dim) if mode == "packed" else 4 * hd
    ix_b = INDEXER_ROW_BYTES if mode == "packed" else 4 * ih
    plan = {"raw_rows": 0, "compressed_rows": 0, "indexer_rows": 0, "compressor_frontier": 0}
    for i, kind in enumerate(cfg.attn_kinds):
        r = rows[i]
        plan["raw_rows"] += r["raw"] * kv_b
        if kind != SLIDING:
            lanes = 2 if kind == CSA else 1
            plan["compressed_rows"] += r["comp_rows"] * kv_b
            plan["compressor_frontier"] += r["proj"] * 2 * lanes * hd * 4
        if kind == CSA:
            plan["indexer_rows"] += r["comp_rows"] * ix_b
            plan["compressor_frontier"] += r["proj"] * 2 * 2 * ih * 4
    plan["persistent_kv"] = plan["raw_rows"] + plan["compressed_rows"] + plan["indexer_rows"]
    plan["total"] = plan["persistent_kv"] + plan["compressor_frontier"]
    return plan


def _capacities(cfg: ModelConfig, ctx: int, chunk: int, mode: str) -> list[dict[str, int]]:
    out = []
    for ratio in cfg.compress_ratios:
        if mode == "packed":
            # the ring holds the window behind the oldest query of a chunk plus the chunk itself; the
            # frontier holds the open window, the previous one (CSA's overlap lane) and the chunk
            raw = align_up(cfg.sliding_window + chunk, 256)
            proj = 2 * ratio + chunk
        else:
            raw = proj = ctx
        out.append({"raw": raw, "proj": proj, "comp_rows": ctx // ratio + 2 if ratio else 0})
    return out


def format_plan(plan: dict[str, int]) -> str:
    return ", ".join(f"{k} {v / 2**20:.1f} MiB" for k, v in plan.items())


# ---- the cache ----------------------------------------------------------------------------------

class ModelCache:
    def __init__(self, cfg: ModelConfig, ctx: int, device: torch.device | str = "cpu", mode: str = "float",
                 chunk: int = 512, pool: CachePool | None = None, slot: int = 0):
        if mode not in CACHE_MODES:
            raise ValueError(f"cache mode must be one of {CACHE_MODES}, got {mode!r}")
        if mode != "float" and (why := cfg.native_cache_error()):
            raise ValueError(why)
        if ctx <= 0 or chunk <= 0:
            raise ValueError(f"context and prefill chunk must be positive, got ctx {ctx}, chunk {chunk}")
        self.cfg, self.ctx, self.mode, self.chunk = cfg, ctx, mode, chunk
        self.device = torch.device(device)
        self.length = 0
        # the furthest length the stores may hold rows up to: a rewind lowers ``length``, not the rows written past it
        self.written = 0
        # when a list, CSA layers append (layer, positions, selected row indices, valid) here (quality reports)
        self.selections: list[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]] | None = None
        self.plan = plan_cache(cfg, ctx, chunk, mode)
        # a cache of a pool keeps its rows in slot ``slot`` of the pool's tensors (allocated by the pool)
        self.pool, self.slot = pool, slot
        free = free_memory(self.device)
        if pool is None and self.plan["total"] > free:
            raise CacheMemoryError(
                f"a {mode} cache for {ctx} tokens needs {self.plan['total'] / 2**30:.2f} GiB "
                f"({format_plan(self.plan)}) but {self.device} has {free / 2**30:.2f} GiB free"
            )
        hd, ih, rd = cfg.head_dim, cfg.index_head_dim, cfg.rope_head_dim
        kv_codec: Codec
        ix_codec: Codec
        if mode == "float":
            kv_codec, ix_codec = FloatCodec(hd), FloatCodec(ih)
        elif mode == "native":
            kv_codec, ix_codec = NativeKVCodec(hd, rd), NativeIndexerCodec(ih)
        else:
            kv_codec, ix_codec = PackedKVCodec(hd, rd), PackedIndexerCodec()
        dev = self.device

        def store(layer: int, name: str, capacity: int, codec: Codec) -> RowStore:
            data = None if pool is None else pool.ring(layer, name, capacity, codec)[self.slot]
            return RowStore(capacity, codec, dev, data)

        self.layers: list[LayerState] = []
        for i, cap in enumerate(_capacities(cfg, ctx, chunk, mode)):
            kind = cfg.attn_kinds[i]
            st = LayerState(raw=store(i, "raw", cap["raw"], kv_codec))
            if kind != SLIDING:
                lanes = 2 if kind == CSA else 1
                st.comp_proj = store(i, "comp_proj", cap["proj"], FloatCodec(2 * lanes * hd))
                st.comp_rows = store(i, "comp_rows", cap["comp_rows"], kv_codec)
            if kind == CSA:
                st.idx_proj = store(i, "idx_proj", cap["proj"], FloatCodec(4 * ih))
                st.idx_rows = store(i, "idx_rows", cap["comp_rows"], ix_codec)
            self.layers.append(st)

    def check_room(self, n_new: int) -> None:
        if self.length + n_new > self.ctx:
            raise ContextOverflowError(
                f"context overflow: {self.length} tokens held + {n_new} new > context size {self.ctx}; "
                f"create the session with a larger --ctx"
            )
        if n_new > self.chunk:
            raise ValueError(f"{n_new} tokens in one pass exceed the cache's prefill chunk {self.chunk}")

    def can_rewind(self, length: int) -> bool:
        """Whether every row needed to continue from ``length`` is still resident.

        A ring of C rows holds the positions ``self.length - C + 1 ..``, not ``self.length - C``: the slot of
        position ``self.length`` may hold a row written past the length (a pool's step over a cache whose session
        is not stepping, or one whose token the session did not keep: `ds4x.runtime.batch.DecodeSlots`)."""
        if not 0 <= length <= self.length:
            return False
        top = max(self.length, self.written)  # after a rewind, the rows of the positions past it still overwrote
        oldest_raw = max(0, length - self.cfg.sliding_window + 1)
        for st, ratio in zip(self.layers, self.cfg.compress_ratios, strict=True):
            if oldest_raw <= top - st.raw.capacity:
                return False
            if st.comp_proj is not None:
                oldest_proj = max(0, (length // ratio - 1) * ratio)
                if oldest_proj <= top - st.comp_proj.capacity:
                    return False
        return True

    def reset(self) -> None:
        """Forget everything (rows are overwritten as the new sequence arrives)."""
        self.length = self.written = 0

    def rewind(self, length: int) -> None:
        if not self.can_rewind(length):
            raise ValueError(f"cannot rewind to {length}: the cache holds {self.length} tokens and keeps "
                             f"{'all' if self.mode != 'packed' else 'only the recent'} rows")
        self.written = max(self.written, self.length)
        self.length = length

    def rewind_floor(self) -> int:
        """The smallest length ``rewind`` accepts: every length from it up to ``length`` is reachable."""
        # can_rewind is monotonic in the target (the oldest row needed only moves forward), so bisect
        lo, hi = 0, self.length
        while lo < hi:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if self.can_rewind(mid) else (mid + 1, hi)
        return lo

    def nbytes(self) -> int:
        return sum(s.nbytes for st in self.layers for s in vars(st).values() if s is not None)

    # ---- copies and checkpoints -------------------------------------------------------------------

    def clone(self) -> ModelCache:
        """A deep copy on the same device (continuing either leaves the other untouched)."""
        other = copy.copy(self)
        other.pool, other.slot = None, 0  # its own rows (cloned below), outside any pool
        other.plan = dict(self.plan)
        other.selections = None if self.selections is None else list(self.selections)
        other.layers = [LayerState(**{f.name: None if (s := getattr(st, f.name)) is None else s.clone()
                                      for f in fields(LayerState)}) for st in self.layers]
        return other

    def _extents(self, length: int) -> Iterator[tuple[str, RowStore, int]]:
        """Every row store as (name, store, end): at ``length`` tokens its rows below ``end`` are in use."""
        for i, (st, ratio) in enumerate(zip(self.layers, self.cfg.compress_ratios, strict=True)):
            for f in fields(LayerState):
                store = getattr(st, f.name)
                if store is not None:
                    # compressed stores are indexed by row number: one row per closed window
                    end = length // ratio if f.name in ("comp_rows", "idx_rows") else length
                    yield f"layers.{i}.{f.name}", store, end

    def state(self) -> dict[str, torch.Tensor]:
        """The rows in use of every store, oldest first, in the storage format (copies), keyed by
        ``layers.{i}.{store}``; with ``length`` this is all a cache holds (rows past it are never read)."""
        return {name: s.stored(max(0, end - s.capacity), end) for name, s, end in self._extents(self.length)}

    def load_state(self, length: int, state: dict[str, torch.Tensor]) -> None:
        """Become the cache ``state()`` was taken from at ``length`` tokens (same config, mode and prefill
        chunk; the context may differ if it holds ``length``). Checks everything before changing anything."""
        if not 0 <= length <= self.ctx:
            raise ValueError(f"a cache state of {length} tokens does not fit a context of {self.ctx}")
        extents = list(self._extents(length))
        if (differ := {n for n, _, _ in extents} ^ state.keys()):
            raise ValueError(f"cache state does not match this model's stores: {sorted(differ)[:4]} differ")
        for name, s, end in extents:
            rows, want = state[name], (min(end, s.capacity), s.codec.width)
            if tuple(rows.shape) != want or rows.dtype != s.codec.dtype:
                raise ValueError(f"cache state {name}: expected {s.codec.dtype} rows of shape {list(want)}, "
                                 f"got {rows.dtype} {list(rows.shape)}")
        for name, s, end in extents:
            s.put_stored(end - state[name].shape[0], state[name])
        self.length, self.written = length, 0  # how far back the rows hold is the snapshot's rewind floor

    def indexer_query(self, q: torch.Tensor) -> torch.Tensor:
        """An indexer query as the cache's semantics score it (rotated and MXFP4 unless float)."""
        return q.float() if self.mode == "float" else rotate_mxfp4_roundtrip(q)


# ---- pools: the caches of a batched decode step -----------------------------------------------------

class CachePool:
    """``slots`` caches of one layout whose stores are slices of one tensor per store [slots, capacity, width].

    A decode step over caches 0..B-1 of a pool then reads every store of a layer as one batch of rings
    (`batch_layer`), so each cache kernel (row writes, compressor emit, indexer scoring, top-k, attention) runs
    once per layer for all B sessions instead of once per session. All slots are allocated up front (a captured
    step holds the pointers), after checking that they fit the device."""

    def __init__(self, cfg: ModelConfig, ctx: int, device: torch.device | str, mode: str, chunk: int, slots: int):
        if slots <= 0:
            raise ValueError(f"a cache pool needs at least one slot, got {slots}")
        self.slots, self.device = slots, torch.device(device)
        total = slots * plan_cache(cfg, ctx, chunk, mode)["total"]
        free = free_memory(self.device)
        if total > free:
            raise CacheMemoryError(f"{slots} {mode} caches for {ctx} tokens need {total / 2**30:.2f} GiB but "
                                   f"{self.device} has {free / 2**30:.2f} GiB free; lower the batch or the context")
        self.data: dict[tuple[int, str], torch.Tensor] = {}
        self.caches = [ModelCache(cfg, ctx, device, mode, chunk, pool=self, slot=i) for i in range(slots)]

    def ring(self, layer: int, name: str, capacity: int, codec: Codec) -> torch.Tensor:
        """The pool's tensor of one store [slots, capacity, width] (made on first use)."""
        key = (layer, name)
        if key not in self.data:
            self.data[key] = torch.zeros(self.slots, capacity, codec.width, dtype=codec.dtype, device=self.device)
        return self.data[key]


def batch_layer(caches: list[ModelCache], layer: int) -> LayerState | None:
    """The stores of ``layer`` of ``caches`` as batches of rings [B, capacity, width] (B = len(caches)): without a
    copy for one cache, or for caches 0..B-1 of one pool in order; None otherwise."""
    first, pool = caches[0], caches[0].pool
    if len(caches) > 1 and (pool is None or any(c.pool is not pool or c.slot != i for i, c in enumerate(caches))):
        return None

    def batched(name: str, s: RowStore) -> RowStore:
        data = s.data[None] if len(caches) == 1 else pool.data[(layer, name)][: len(caches)]
        return RowStore(s.capacity, s.codec, s.data.device, data)

    st = first.layers[layer]
    return LayerState(**{f.name: None if (s := getattr(st, f.name)) is None else batched(f.name, s)
                         for f in fields(LayerState)})
