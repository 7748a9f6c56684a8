"""Session checkpoints (DESIGN §5): bit-exact round trips, clones, every refusal, and the CLI flags."""

import json
import struct
import zlib

import pytest
import torch

from ds4x.cli.main import main
from ds4x.runtime.engine import Engine
from ds4x.runtime.sampling import SamplingParams
from ds4x.runtime.session_file import (
    SESSION_ABI_VERSION,
    SessionFileError,
    load_session,
    model_fingerprint,
    save_session,
)


@pytest.fixture(scope="module")
def engine():
    return Engine.load("default", device="cpu")


def _ids(n, vocab, seed=0):
    return torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def sessions(engine):
    """One session per cache mode. The packed one holds more tokens than its raw ring (256 rows), so the
    file stores a wrapped ring and a partial compressor frontier."""
    out = {}
    for mode, n in (("float", 20), ("native", 20), ("packed", 270)):
        s = engine.new_session(ctx=1024, cache=mode, prefill_chunk=96)
        s.prefill(_ids(n, engine.cfg.vocab_size))
        out[mode] = s
    return out


def _continue(session, tokens):
    return [session.step(t) for t in tokens]


@pytest.mark.parametrize("mode", ["float", "native", "packed"])
def test_round_trip_is_bit_identical(engine, sessions, mode, tmp_path):
    original = sessions[mode]
    path = tmp_path / "s.ds4xsession"
    size = save_session(original, path)
    assert size == path.stat().st_size
    ref = original.clone()  # continue a copy: the fixture stays as it was
    loaded = load_session(engine, path)
    assert loaded.cache.mode == mode and loaded.ctx == original.ctx and loaded.tokens == original.tokens
    assert torch.equal(loaded.logits, original.logits)
    follow = [11, 400, 3000]
    for a, b in zip(_continue(ref, follow), _continue(loaded, follow), strict=True):
        assert torch.equal(a, b)
    # a further chunk evaluated in one pass matches too
    assert torch.equal(ref.prefill(_ids(6, engine.cfg.vocab_size, seed=5)),
                       loaded.prefill(_ids(6, engine.cfg.vocab_size, seed=5)))


def test_only_rows_in_use_are_written(engine, sessions, tmp_path):
    # float and native hold every row of the context (1024 x ...); the file holds the 20 in use
    for mode in ("float", "native"):
        s = sessions[mode]
        size = save_session(s, tmp_path / f"{mode}.ds4xsession")
        assert size < s.cache.nbytes() / 10
    packed = sessions["packed"]
    assert save_session(packed, tmp_path / "p.ds4xsession") < packed.cache.nbytes()


def test_clone_is_independent(engine, sessions):
    original = sessions["native"]
    before = original.cache.state()
    copy = original.clone()
    stepped = copy.step(9)
    assert len(copy.tokens) == len(original.tokens) + 1 and copy.cache.length == original.cache.length + 1
    after = original.cache.state()
    assert all(torch.equal(before[k], after[k]) for k in before)  # the original's rows are untouched
    again = original.clone()
    assert torch.equal(again.step(9), stepped)


def test_loaded_context_can_grow_and_prefill_mode_change(engine, sessions, tmp_path):
    path = tmp_path / "s.ds4xsession"
    save_session(sessions["packed"], path)
    loaded = load_session(engine, path, ctx=2048, prefill_mode="exact")
    assert loaded.ctx == 2048 and loaded.prefill_mode == "exact"
    ref = sessions["packed"].clone()
    assert torch.equal(ref.step(5), loaded.step(5))


# ---- refusals --------------------------------------------------------------------------------------

@pytest.fixture
def saved(sessions, tmp_path):
    path = tmp_path / "native.ds4xsession"
    save_session(sessions["native"], path)
    return path


def test_not_a_session_file(engine, tmp_path):
    bad = tmp_path / "x.ds4xsession"
    bad.write_bytes(b"PK\x03\x04 this is a zip, not a session")
    with pytest.raises(SessionFileError, match="not a ds4x session file"):
        load_session(engine, bad)
    bad.write_bytes(b"")
    with pytest.raises(SessionFileError, match="not a ds4x session file"):
        load_session(engine, bad)


def test_other_abi_version(engine, saved):
    data = bytearray(saved.read_bytes())
    struct.pack_into("<I", data, 8, SESSION_ABI_VERSION + 1)
    saved.write_bytes(bytes(data))
    with pytest.raises(SessionFileError, match=f"ABI version {SESSION_ABI_VERSION + 1}; this ds4x reads version "
                                               f"{SESSION_ABI_VERSION}"):
        load_session(engine, saved)


def test_other_model(engine, saved):
    other = Engine.load("tiny", device="cpu")  # synthetic: another config and other weights
    with pytest.raises(SessionFileError, match="saved with another model: .*tiny_v4.*the loaded model is tiny"):
        load_session(other, saved)


def test_fingerprint_tells_weights_apart(engine):
    assert model_fingerprint(engine) == model_fingerprint(Engine.load("default", device="cpu"))
    # same config, names and shapes; only the weights' contents differ
    assert model_fingerprint(Engine.load("tiny", device="cpu", seed=0)) != model_fingerprint(
        Engine.load("tiny", device="cpu", seed=1))


def test_other_cache_mode_chunk_or_context(engine, saved):
    with pytest.raises(SessionFileError, match="holds a native cache; it cannot be continued as a packed cache"):
        load_session(engine, saved, cache="packed")
    with pytest.raises(SessionFileError, match="prefill chunk 96.*cannot be loaded with prefill chunk 512"):
        load_session(engine, saved, prefill_chunk=512)
    with pytest.raises(SessionFileError, match="holds 20 tokens, more than a context of 16"):
        load_session(engine, saved, ctx=16)


@pytest.mark.parametrize("keep", [12, 100, -1])
def test_truncated_file(engine, saved, keep):
    data = saved.read_bytes()
    saved.write_bytes(data[:keep])
    with pytest.raises(SessionFileError, match="truncated"):
        load_session(engine, saved)


def test_trailing_bytes_and_damaged_payload(engine, saved):
    data = saved.read_bytes()
    saved.write_bytes(data + b"\0")
    with pytest.raises(SessionFileError, match="longer than its header says"):
        load_session(engine, saved)
    damaged = bytearray(data)
    damaged[-100] ^= 1  # one bit of one cached row
    saved.write_bytes(bytes(damaged))
    with pytest.raises(SessionFileError, match="damaged: its tensor payload does not match"):
        load_session(engine, saved)


def _rewrite(path, header=None, tokens=None, payload=None):
    """Replace parts of a saved file, keeping the rest (a payload given keeps a matching checksum)."""
    data = path.read_bytes()
    hlen = struct.unpack_from("<I", data, 12)[0]
    meta = json.loads(data[16 : 16 + hlen])
    tok0 = 16 + hlen
    pay0 = tok0 + 4 * meta["n_tokens"]
    toks, pay = (data[tok0:pay0] if tokens is None else tokens), (data[pay0:] if payload is None else payload)
    if payload is not None:
        meta.update(payload_bytes=len(pay), payload_crc32=zlib.crc32(pay))
    raw = header(meta) if callable(header) else json.dumps(meta).encode()
    path.write_bytes(data[:12] + struct.pack("<I", len(raw)) + raw + toks + pay)
    return data[tok0:pay0], data[pay0:]


def _with(**changes):
    return lambda meta: json.dumps({**meta, **changes}).encode()


@pytest.mark.parametrize("header", [
    _with(ctx="abc"), _with(ctx=None), _with(ctx=0), _with(prefill_chunk=0),
    _with(cache_mode="zip"), _with(prefill_mode="fast"), _with(rewind_floor="x"), _with(rewind_floor=10**6),
    _with(n_tokens=-1), _with(n_tokens=True), _with(payload_bytes=-5),
    lambda meta: b"[" * 100_000 + b"]" * 100_000,  # nesting past the JSON parser's recursion limit
], ids=["ctx-str", "ctx-null", "ctx-0", "chunk-0", "mode", "prefill-mode", "floor-str",
        "floor-past-end", "n-negative", "n-bool", "payload-negative", "deep-json"])
def test_corrupt_header_values(engine, saved, header):
    # valid JSON with values of the wrong type or range: refused by the header check, not by an int() or a
    # cache allocation deep inside the load
    _rewrite(saved, header=header)
    with pytest.raises(SessionFileError, match="corrupt header"):
        load_session(engine, saved)


def test_damaged_tokens(engine, saved):
    # the tokens sit outside the tensor payload: a flipped token must not load as another conversation
    tokens, _ = _rewrite(saved)
    damaged = bytearray(tokens)
    damaged[5] ^= 1
    _rewrite(saved, tokens=bytes(damaged))
    with pytest.raises(SessionFileError, match="damaged: its tokens do not match"):
        load_session(engine, saved)


@pytest.mark.parametrize("bad", [-1, 2**30 + 1], ids=["negative", "past-the-vocabulary"])
def test_token_ids_outside_the_vocabulary(engine, saved, bad):
    """A token id the model does not have is refused even where the checksum agrees (forged, or absent in older
    files): it indexed past the penalty's token counts (an IndexError) or penalised another token."""
    tokens, _ = _rewrite(saved)
    forged = struct.pack("<i", bad) + tokens[4:]
    _rewrite(saved, header=_with(tokens_crc32=zlib.crc32(forged)), tokens=forged)
    with pytest.raises(SessionFileError, match=f"token id {bad}, outside the vocabulary"):
        load_session(engine, saved)
    _rewrite(saved, header=lambda meta: json.dumps({k: v for k, v in meta.items() if k != "tokens_crc32"}).encode())
    with pytest.raises(SessionFileError, match=f"token id {bad}, outside the vocabulary"):
        load_session(engine, saved)


def test_corrupt_payload_with_valid_checksum(engine, sessions, saved):
    # a payload that passes the checksum but is not a valid tensor file, or holds logits of another shape
    _rewrite(saved, payload=b"\0" * 64)
    with pytest.raises(SessionFileError, match="corrupt payload"):
        load_session(engine, saved)
    save_session(sessions["native"], saved)
    from safetensors.torch import load as st_load
    from safetensors.torch import save as st_save
    tensors = st_load(_rewrite(saved)[1])
    tensors["logits"] = tensors["logits"][:10].clone()
    _rewrite(saved, payload=st_save(tensors))
    with pytest.raises(SessionFileError, match="logits"):
        load_session(engine, saved)


# ---- command line ----------------------------------------------------------------------------------

def test_cli_save_then_continue(engine, tmp_path, capsys):
    path = tmp_path / "chat.ds4xsession"
    assert main(["generate", "--prompt-ids", "5,6,7", "-n", "4", "--ctx", "256", "--ignore-eos", "--device", "cpu",
                 "--save-session", str(path)]) == 0  # on the CPU, as the engine it is compared with
    out, err = capsys.readouterr()
    first = [int(t) for t in out.split()]
    assert len(first) == 4 and "saved the session (7 tokens" in err
    assert main(["generate", "--prompt-ids", "9", "-n", "3", "--ignore-eos", "--load-session", str(path),
                 "--device", "cpu", "-q"]) == 0
    second = [int(t) for t in capsys.readouterr().out.split()]
    # the same operations in one process: generate, evaluate the last token, append the prompt, generate
    s = engine.new_session(ctx=256, cache="packed")
    assert [t for t, _ in s.generate([5, 6, 7], 4, SamplingParams(), stop_ids=())] == first
    s.step(first[-1])
    assert [t for t, _ in s.generate([9], 3, SamplingParams(), stop_ids=())] == second
    # no prompt: continue from the saved logits
    assert main(["generate", "-n", "2", "--ignore-eos", "--load-session", str(path), "-q"]) == 0
    assert len(capsys.readouterr().out.split()) > 0


def test_a_session_continues_in_the_dtype_it_was_computed_in(tmp_path, capsys):
    """--dtype auto follows the file (a session saved on the CPU in float32 continues on a GPU in float32); a dtype
    given that differs is refused with both named."""
    path = tmp_path / "bf16.ds4xsession"
    args = ["generate", "--prompt-ids", "5,6", "-n", "1", "--ctx", "64", "--device", "cpu", "-q"]
    assert main([*args, "--dtype", "bfloat16", "--save-session", str(path)]) == 0
    capsys.readouterr()
    assert main(["generate", "-n", "1", "--device", "cpu", "--load-session", str(path), "-q"]) == 0
    assert len(capsys.readouterr().out.split()) == 1
    assert main(["generate", "-n", "1", "--device", "cpu", "--dtype", "float32", "--load-session", str(path)]) == 2
    err = capsys.readouterr().err
    assert "computed in bfloat16" in err and "computes in float32" in err and "load it in bfloat16" in err


def test_save_session_refuses_what_is_not_a_regular_file_and_writes_through_a_link(tmp_path, capsys):
    """The save renames a new file over the path: a pipe (or, as root, /dev/null) there would be replaced by an
    ordinary file, so it is refused before any work; a symbolic link is written through (the link stays)."""
    import os
    import stat

    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    args = ["generate", "--prompt-ids", "5,6", "-n", "1", "--ctx", "64", "--device", "cpu", "-q"]
    assert main([*args, "--save-session", str(fifo)]) == 2
    assert "not a regular file" in capsys.readouterr().err
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)
    target, link = tmp_path / "real.ds4xsession", tmp_path / "link.ds4xsession"
    target.write_bytes(b"old")
    link.symlink_to(target)
    assert main([*args, "--save-session", str(link)]) == 0
    assert link.is_symlink() and target.read_bytes()[:4] != b"old"
    assert main(["generate", "-n", "1", "--load-session", str(link), "-q"]) == 0


def test_cli_load_errors(tmp_path, capsys):
    path = tmp_path / "chat.ds4xsession"
    assert main(["generate", "--prompt-ids", "5,6,7", "-n", "1", "--cache", "float", "--ctx", "64",
                 "--save-session", str(path), "-q"]) == 0
    capsys.readouterr()
    assert main(["generate", "--prompt-ids", "9", "--cache", "packed", "--load-session", str(path)]) == 2
    assert "holds a float cache" in capsys.readouterr().err
    assert main(["generate", "-m", "tiny", "--prompt-ids", "9", "--load-session", str(path)]) == 2
    assert "saved with another model" in capsys.readouterr().err
    assert main(["generate", "--prompt-ids", "9", "--load-session", str(tmp_path / "missing")]) == 2
    assert "No such file" in capsys.readouterr().err
