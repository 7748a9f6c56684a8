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


def test_token_bytes_are_each_tokens_own_bytes(tmp_path):
    """``token_bytes`` (what logprobs report): the tokens' bytes join to the text's UTF-8, a token holding part
    of a character included, for the byte tokenizer, a byte-level tokenizer.json and a GGUF vocabulary."""
    from ds4x.runtime.gguf_tokenizer import GGUFTokenizer
    from ds4x.weights.gguf_writer import synthetic_vocab

    v = synthetic_vocab(600)
    toks = [ByteTokenizer(), HFTokenizer(_bpe(tmp_path), bos_id=0, eos_ids=(1,)), GGUFTokenizer(v.tokens, v.merges)]
    for tok in toks:
        ids = tok.encode(TEXT)
        parts = [tok.token_bytes(i) for i in ids]
        assert b"".join(parts) == TEXT.encode("utf-8"), type(tok).__name__
        # some token is part of a character only: its text alone is broken, its bytes are not lost
        assert any("\ufffd" in p.decode("utf-8", errors="replace") for p in parts), type(tok).__name__
    assert ByteTokenizer().token_bytes(1) == b""  # a special of the byte tokenizer decodes to no text


def test_malformed_tokenizer_json_is_a_clear_error(tmp_path, capsys):
    cfg = tiny_config(vocab_size=300)
    save_checkpoint(cfg, synthetic_weights(cfg, seed=4), tmp_path)
    (tmp_path / "tokenizer.json").write_text("{}")
    assert main(["generate", "-m", str(tmp_path), "-p", "hi", "-n", "2"]) == 2
    assert "tokenizer" in capsys.readouterr().err


# ---- the GGUF tokenizer of a converted checkpoint gives tokenizer.json's ids ---------------------

# newline / space / tab runs, CRLF, digit runs, CJK and kana (after a space, a letter, a digit), fullwidth
# and other non-ASCII punctuation, emoji, combining marks, NBSP / ideographic space, non-ASCII digits,
# runs of control characters, contractions, code, the source tokenizer's added tokens
VARIED = (
    "a\n\nb\n\n\nc\r\n\r\nd \n \n  e\t\t\tf   g    h\n    \n\n        return x\n\n\n"
    "def f(x, y=3):\n    '''doc'''\n    return {'k': [x ** 2, y // 7]}  # noqa: E501\n\n\nclass A:\n\tpass\n"
    "12 123 1234 1234567890 3.14159 1e-10 0x1F 2024-01-02 12:34:56 ١٢٣٤ x² ½ ①\n"
    "日本語 テキスト 中文，標點。 a日本語 1日本 「引用」 ひらがなカタカナ 한국어 ｆｕｌｌｗｉｄｔｈ\n"
    "naïve café e\u0301 — it’s “quoted” ‘x’ … « a » ─┬─ 🙂🚨🚨 👍🏽 x🙂y ☃\n"
    "a\u00a0b\u3000c\u2003d \x00\x00\x01x \v\f \x7f ~y `z` @#$%^&*()[]{}<>|\\/'\"-_+= ;;\n>;\n  )\n"
    "don't I'LL we've it's 'quoted' <eos>between<bos>tokens<pad> < eos> ｜x｜\n"
)

# the pre_tokenizer of DeepSeek-V3 / V4's tokenizer.json
DEEPSEEK_V4_PRE = {
    "type": "Sequence",
    "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": "\\p{N}{1,3}"}, "behavior": "Isolated", "invert": False},
        {"type": "Split", "pattern": {"Regex": "[一-龥\u3040-ゟ゠-ヿ]+"}, "behavior": "Isolated", "invert": False},
        {"type": "Split", "pattern": {"Regex": "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|"
                                               "[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+| ?[\\p{P}\\p{S}]+[\r\n]*|"
                                               "\\s*[\r\n]+|\\s+(?!\\S)|\\s+"},
         "behavior": "Isolated", "invert": False},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False},
    ],
}


def _random_texts(n: int = 150):
    import random

    rng = random.Random(0)
    pools = ["abcXYZ019 \t\n\r.,;:!?()[]{}<>-_+=*/\\'\"`~@#$%^&|", "éàüßøñ中日カな한😀🎉—’，。\u00a0\u3000\u0301\x00",
             "    \n\n\n  \t", "0123456789"]
    return ["".join(rng.choice(rng.choice(pools)) for _ in range(rng.randint(0, 60))) for _ in range(n)]


def _convert_default_model(tmp, pre_tokenizer=None):
    """``ds4x convert`` of the embedded default model (f16: a few seconds), optionally with its tokenizer.json's
    pre_tokenizer replaced; returns (gguf path, tokenizer.json path)."""
    import json

    from ds4x.assets import default_model_path

    src = default_model_path()
    if pre_tokenizer is not None:
        ckpt = tmp / "ckpt"
        ckpt.mkdir()
        for f in src.iterdir():
            if f.name != "tokenizer.json":
                (ckpt / f.name).symlink_to(f)
        data = json.loads((src / "tokenizer.json").read_text())
        data["pre_tokenizer"] = pre_tokenizer
        (ckpt / "tokenizer.json").write_text(json.dumps(data, ensure_ascii=False))
        src = ckpt
    out = tmp / "model.gguf"
    assert main(["convert", str(src), str(out), "--mix", "f16", "-q"]) == 0
    return out, src / "tokenizer.json"


def _assert_same_ids(gguf_tok, hf_tok, texts):
    for text in texts:
        assert gguf_tok.encode(text) == hf_tok.encode(text), repr(text)


def test_converted_gguf_tokenizer_matches_tokenizer_json(tmp_path):
    """The embedded model's tokenizer.json splits with GPT-2's byte-level regex: the converted GGUF says so
    (tokenizer.ggml.pre = gpt-2) and its tokenizer gives the same ids, "\\n\\n" as two tokens included."""
    import pytest

    pytest.importorskip("gguf")
    from ds4x.runtime.gguf_tokenizer import GGUFTokenizer
    from ds4x.runtime.quality import heldout_text
    from ds4x.weights.gguf import open_gguf, read_metadata

    path, tok_json = _convert_default_model(tmp_path)
    meta = read_metadata(open_gguf(path))
    gguf_tok = GGUFTokenizer.from_metadata(meta)
    hf_tok = HFTokenizer(tok_json, 0, (1,))
    assert gguf_tok.encode("a\n\nb") == hf_tok.encode("a\n\nb")
    assert meta["tokenizer.ggml.pre"] == "gpt-2"
    _assert_same_ids(gguf_tok, hf_tok, [VARIED, heldout_text()[:20000], *_random_texts()])


def test_converted_gguf_tokenizer_matches_deepseek_v4_pre_tokenizer(tmp_path):
    """A tokenizer.json with DeepSeek-V4's pre-tokenizer (the embedded model's vocabulary): the GGUF says
    joyai-llm, and gives tokenizer.json's ids both from the stored pre-tokenizer and from the name alone
    (a ds4 GGUF), where antirez/ds4's hand-written split differs off ASCII (" 日本", " '—", "\\x00\\x00")."""
    import pytest

    pytest.importorskip("gguf")
    from ds4x.runtime.gguf_tokenizer import GGUFTokenizer
    from ds4x.weights.gguf import open_gguf, read_metadata

    path, tok_json = _convert_default_model(tmp_path, DEEPSEEK_V4_PRE)
    meta = read_metadata(open_gguf(path))
    assert meta["tokenizer.ggml.pre"] == "joyai-llm"
    hf_tok = HFTokenizer(tok_json, 0, (1,))
    texts = [VARIED, " '—x", "a\x00\x00b", " 日本語 x", *_random_texts()]
    _assert_same_ids(GGUFTokenizer.from_metadata(meta), hf_tok, texts)
    by_name = {k: v for k, v in meta.items() if not k.startswith("ds4x.tokenizer.")}
    _assert_same_ids(GGUFTokenizer.from_metadata(by_name), hf_tok, texts)
