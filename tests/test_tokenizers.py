"""Tokenizers: byte-level default, tokenizer.json checkpoints, streaming without broken characters."""

from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from tokenizers import decoders as tk_decoders

from ds4x.cli.main import main
from ds4x.config import tiny_config
from ds4x.runtime.tokenizer import ByteTokenizer, HFTokenizer, TextStream
from ds4x.weights.checkpoint import save_checkpoint
from ds4x.weights.synthetic import synthetic_weights

TEXT = "naïve café — 日本語 🙂 def f(x):\n    return x\n"


def test_byte_tokenizer_round_trips_utf8():
    tok = ByteTokenizer()
    ids = tok.encode(TEXT)
    assert len(ids) == len(TEXT.encode("utf-8"))
    assert tok.decode(ids) == TEXT


def test_stream_never_shows_a_split_character():
    tok = ByteTokenizer()
    stream = TextStream(tok)
    pieces = [stream.push(i) for i in tok.encode(TEXT)]
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) + stream.flush() == TEXT
    # the 4-byte emoji appears in one piece, after its last byte
    assert "🙂" in pieces


def _bpe(tmp_path):
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tk_decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=280, special_tokens=["<bos>", "<eos>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([TEXT * 20, "hello world " * 50], trainer)
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    return path


def test_tokenizer_json_round_trip_and_checkpoint_generation(tmp_path, capsys):
    path = _bpe(tmp_path)
    tok = HFTokenizer(path, bos_id=0, eos_ids=(1,))
    assert tok.decode(tok.encode(TEXT)) == TEXT
    cfg = tiny_config(vocab_size=300)
    save_checkpoint(cfg, synthetic_weights(cfg, seed=4), tmp_path)
    assert main(["generate", "-m", str(tmp_path), "-p", "hello world", "-n", "12", "--seed", "0", "--ignore-eos"]) == 0
    out, err = capsys.readouterr()
    assert out.strip() and "generated 12 tok" in err


def test_malformed_tokenizer_json_is_a_clear_error(tmp_path, capsys):
    cfg = tiny_config(vocab_size=300)
    save_checkpoint(cfg, synthetic_weights(cfg, seed=4), tmp_path)
    (tmp_path / "tokenizer.json").write_text("{}")
    assert main(["generate", "-m", str(tmp_path), "-p", "hi", "-n", "2"]) == 2
    assert "tokenizer" in capsys.readouterr().err
