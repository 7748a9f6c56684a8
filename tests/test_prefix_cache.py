"""Prefix reuse: hits and misses, the leave-one-token contract, rewinding a stored sequence, LRU eviction,
spilling to a directory with a size cap, reloading it in a new PrefixCache, and concurrent use."""

import threading

import pytest
import torch

from ds4x.runtime.engine import Engine
from ds4x.runtime.prefix_cache import PrefixCache
from ds4x.runtime.session_file import SUFFIX, save_session, snapshot

CHUNK = 8  # a small prefill chunk keeps the packed frontier small, so a short session has a rewind floor > 0


@pytest.fixture(scope="module")
def engine():
    return Engine.load("default", device="cpu")


def _ids(n, seed):
    return torch.randint(3, 4096, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _session(engine, ids, mode="packed", prefill_mode="default"):
    s = engine.new_session(ctx=128, cache=mode, prefill_chunk=CHUNK, prefill_mode=prefill_mode, announce=False)
    s.prefill(ids)
    return s


@pytest.fixture(scope="module")
def three(engine):
    """Three sessions of 8 tokens (one prefill chunk each), same snapshot size."""
    return [_session(engine, _ids(8, seed)) for seed in (1, 2, 3)]


def test_miss_then_hit_continues_bit_identically(engine, three):
    pc = PrefixCache(engine, max_resident_bytes=2**30)
    a = three[0]
    assert pc.lookup(a.tokens + [5]) == (None, 0)
    pc.store(a)
    got, n = pc.lookup(a.tokens + [5, 6])
    assert n == 8 and got.tokens == a.tokens and torch.equal(got.logits, a.logits)
    assert torch.equal(got.prefill([5, 6]), a.clone().prefill([5, 6]))
    assert got.cache is not a.cache and len(a.tokens) == 8  # a private copy
    assert (pc.hits, pc.misses, pc.reused_tokens) == (1, 1, 8)
    assert pc.lookup(_ids(9, 99)) == (None, 0) and pc.misses == 2


def test_full_length_hit_leaves_the_last_token_to_evaluate(engine):
    # exact prefill: every token is a decode step, so evaluating the last token again is bit-identical
    ids = _ids(12, 4)
    s = _session(engine, ids, prefill_mode="exact")
    pc = PrefixCache(engine, max_resident_bytes=2**30)
    pc.store(s)
    got, n = pc.lookup(ids)
    assert n == 11 and got.tokens == ids[:11] and got.logits is None
    assert torch.equal(got.prefill(ids[n:]), s.logits)
    assert pc.lookup(ids[:1]) == (None, 0)  # one token: nothing can be reused


def test_stored_sequence_is_rewound_to_the_shared_prefix_within_its_floor(engine):
    ids = _ids(40, 5)
    s = _session(engine, ids)
    floor = s.cache.rewind_floor()
    assert 0 < floor <= 32  # the packed ring and frontier hold only the recent tokens
    pc = PrefixCache(engine, max_resident_bytes=2**30)
    pc.store(s)
    query = ids[:32] + [7, 8, 9]
    got, n = pc.lookup(query)
    assert n == 32 and got.tokens == ids[:32] and got.logits is None
    fresh = _session(engine, ids[:32])  # same chunk boundaries, so the same rows bit for bit
    assert torch.equal(got.prefill(query[n:]), fresh.prefill(query[n:]))
    assert pc.lookup(ids[: floor - 1] + [7]) == (None, 0)  # diverges before the floor: not reusable


def test_longest_prefix_wins(engine, three):
    pc = PrefixCache(engine, max_resident_bytes=2**30)
    a = three[0]
    longer = a.clone()
    longer.prefill([11, 12, 13, 14])
    pc.store(a)
    pc.store(longer)
    assert pc.lookup(longer.tokens + [1])[1] == 12
    assert pc.lookup(a.tokens + [1])[1] == 8


def test_lru_eviction_by_bytes(engine, three):
    a, b, c = three
    size = snapshot(a).nbytes
    pc = PrefixCache(engine, max_resident_bytes=int(2.5 * size))
    pc.store(a)
    pc.store(b)
    assert pc.lookup(a.tokens + [1])[1] == 8  # a is now the most recently used
    pc.store(c)  # over budget: b goes
    assert pc.resident_bytes == 2 * size
    assert pc.lookup(b.tokens + [1]) == (None, 0)
    assert pc.lookup(a.tokens + [1])[1] == 8 and pc.lookup(c.tokens + [1])[1] == 8
    pc.store(a)  # already held: refreshes, no copy
    assert pc.resident_bytes == 2 * size


def test_spill_to_disk_and_reload_in_a_new_cache(engine, three, tmp_path):
    a, b, _ = three
    pc = PrefixCache(engine, max_resident_bytes=0, directory=tmp_path)
    pc.store(a)
    pc.store(b)
    assert len(list(tmp_path.glob(f"*{SUFFIX}"))) == 2 and pc.resident_bytes == 0 and pc.disk_bytes > 0
    got, n = pc.lookup(a.tokens + [3])
    assert n == 8 and torch.equal(got.logits, a.logits)
    again = PrefixCache(engine, max_resident_bytes=2**30, directory=tmp_path)
    got, n = again.lookup(b.tokens + [3, 4])
    assert n == 8 and torch.equal(got.prefill([3, 4]), b.clone().prefill([3, 4]))
    assert again.resident_bytes > 0  # the file was read back into memory


def test_disk_cap_removes_least_recently_used_files(engine, three, tmp_path):
    a, b, c = three
    file_size = save_session(a, tmp_path / "probe") and (tmp_path / "probe").stat().st_size
    (tmp_path / "probe").unlink()
    pc = PrefixCache(engine, max_resident_bytes=0, directory=tmp_path, max_disk_bytes=int(2.5 * file_size))
    pc.store(a)
    pc.store(b)
    assert pc.lookup(a.tokens + [1])[1] == 8  # a's file is now the most recently used
    pc.store(c)
    assert pc.disk_bytes <= 2.5 * file_size and len(list(tmp_path.glob(f"*{SUFFIX}"))) == 2
    assert pc.lookup(b.tokens + [1]) == (None, 0)
    assert pc.lookup(a.tokens + [1])[1] == 8 and pc.lookup(c.tokens + [1])[1] == 8


def test_foreign_and_damaged_files_are_removed(engine, three, tmp_path):
    save_session(three[0], tmp_path / f"ours{SUFFIX}")
    other = Engine.load("tiny", device="cpu")
    save_session(_session(other, [5, 6, 7]), tmp_path / f"other-model{SUFFIX}")
    (tmp_path / f"junk{SUFFIX}").write_bytes(b"not a session")
    data = (tmp_path / f"ours{SUFFIX}").read_bytes()
    (tmp_path / f"cut{SUFFIX}").write_bytes(data[:-10])
    (tmp_path / "notes.txt").write_text("not ours: left alone")
    pc = PrefixCache(engine, max_resident_bytes=2**30, directory=tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt", f"ours{SUFFIX}"]
    assert pc.lookup(three[0].tokens + [1])[1] == 8


def test_bad_headers_damaged_tokens_and_directories_are_misses(engine, three, tmp_path):
    """A directory entry of corrupt header values or damaged tokens is removed at start (not a crash there,
    nor a failing or wrong hit later); a directory named like a session file is left alone."""
    import json
    import struct

    a, b, c = three
    for name, s in (("ours", a), ("badmode", b), ("tokflip", c)):
        save_session(s, tmp_path / f"{name}{SUFFIX}")
    data = (tmp_path / f"badmode{SUFFIX}").read_bytes()
    hlen = struct.unpack_from("<I", data, 12)[0]
    meta = json.loads(data[16 : 16 + hlen])
    for i, (key, value) in enumerate((("cache_mode", "zip"), ("ctx", "abc"), ("rewind_floor", None))):
        raw = json.dumps({**meta, key: value}).encode()
        (tmp_path / f"bad{i}{SUFFIX}").write_bytes(data[:12] + struct.pack("<I", len(raw)) + raw + data[16 + hlen :])
    (tmp_path / f"badmode{SUFFIX}").unlink()
    flip = bytearray((tmp_path / f"tokflip{SUFFIX}").read_bytes())
    flip[16 + struct.unpack_from("<I", flip, 12)[0]] ^= 1  # the first token
    (tmp_path / f"tokflip{SUFFIX}").write_bytes(bytes(flip))
    (tmp_path / f"subdir{SUFFIX}").mkdir()
    pc = PrefixCache(engine, max_resident_bytes=2**30, directory=tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"ours{SUFFIX}", f"subdir{SUFFIX}"]
    assert pc.lookup(b.tokens + [1]) == (None, 0)
    wrong = list(c.tokens)
    wrong[0] ^= 1
    assert pc.lookup(wrong + [1]) == (None, 0)
    assert pc.lookup(a.tokens + [1])[1] == 8


def test_concurrent_store_and_lookup(engine, three, tmp_path):
    pc = PrefixCache(engine, max_resident_bytes=int(1.5 * snapshot(three[0]).nbytes), directory=tmp_path)
    errors, lookups = [], 12

    def worker(i):
        try:
            for j in range(3):
                s = three[(i + j) % 3]
                pc.store(s)
                got, n = pc.lookup(s.tokens + [i])
                assert got is None or got.tokens == s.tokens[:n]
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert pc.hits + pc.misses == lookups and pc.hits == lookups  # every stored prefix is found again
