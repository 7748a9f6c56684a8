"""Command-line bugs found by probing ds4x as a user would; each test pins one fix (comments in src/ds4x/cli)."""

import json
import subprocess
import sys

import pytest
import torch

from ds4x.cli.main import main
from ds4x.runtime.engine import Engine
from ds4x.runtime.sampling import SamplingParams


def test_loaded_session_keeps_its_prefill_mode(tmp_path, capsys):
    # --prefill-mode defaulted to "default" and replaced the file's mode: a session saved in exact mode continued
    # with a prompt gave other logits than the uninterrupted session
    saved, dump = tmp_path / "s.ds4xsession", tmp_path / "l.json"
    base = ["generate", "-m", "tiny", "-n", "3", "-q", "--ignore-eos", "--device", "cpu"]  # as the session below
    assert main([*base, "--prompt-ids", "1,2,3,4,5,6,7,8,9", "--prefill-mode", "exact", "--prefill-chunk", "4",
                 "--save-session", str(saved)]) == 0
    assert main([*base, "--prompt-ids", "11,12,13,14,15,16,17", "--load-session", str(saved),
                 "--dump-logits", str(dump)]) == 0
    s = Engine.load("tiny", device="cpu").new_session(ctx=4096, cache="packed", prefill_chunk=4, prefill_mode="exact")
    first = [t for t, _ in s.generate([1, 2, 3, 4, 5, 6, 7, 8, 9], 3, SamplingParams(), stop_ids=())]
    s.step(first[-1])
    rows = [lg.float().tolist() for _, lg in s.generate([11, 12, 13, 14, 15, 16, 17], 3, SamplingParams(),
                                                        stop_ids=())]
    assert json.loads(dump.read_text())["logits"] == rows  # bit-identical, as the README promises
    capsys.readouterr()


@pytest.mark.parametrize("option", ["--save-session", "--dump-logits"])
@pytest.mark.parametrize("path, message", [("", "needs a file name"), (".", "is a directory"),
                                           ("no/such/folder/f", "does not exist")])
def test_output_files_are_checked_before_any_work(option, path, message, monkeypatch, capsys):
    # an empty path was skipped silently (exit 0, nothing written); a directory or a missing folder failed only
    # after the whole generation
    def no_load(*_a, **_k):
        raise AssertionError("the model was loaded before the output path was checked")

    monkeypatch.setattr(Engine, "load", no_load)
    assert main(["generate", "-p", "x", "-n", "2", option, path]) == 2
    err = capsys.readouterr().err
    assert f"{option}" in err and message in err and "Traceback" not in err


@pytest.mark.parametrize("seed", [2**64, -(2**63) - 1])
def test_seed_outside_64_bits_is_a_clear_error(seed, capsys):
    # failed after the prompt ran with torch's "Overflow when unpacking long long"
    assert main(["generate", "-m", "tiny", "--prompt-ids", "1", "-n", "2", "--temp", "1", "--seed", str(seed)]) == 2
    assert "--seed must be a 64-bit integer" in capsys.readouterr().err


def test_largest_seed_still_samples(capsys):
    assert main(["generate", "-m", "tiny", "--prompt-ids", "1", "-n", "2", "--temp", "1", "--seed",
                 str(2**64 - 1), "-q"]) == 0
    assert len(capsys.readouterr().out.split()) == 2


def test_closed_pipe_ends_quietly():
    # `ds4x generate ... | head -c 10` printed "error: [Errno 32] Broken pipe" and exited 2
    p = subprocess.Popen([sys.executable, "-m", "ds4x", "generate", "-m", "tiny", "--prompt-ids", "1,2", "-n", "4000",
                          "--ctx", "8192", "--ignore-eos", "-q"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert p.stdout is not None and p.stderr is not None
    p.stdout.read(8)
    p.stdout.close()
    err = p.stderr.read().decode()
    assert p.wait(timeout=60) == 141
    assert err == ""


def test_closed_stdout_is_a_clear_error(monkeypatch, capsys):
    # `ds4x generate ... >&-` died in an AttributeError traceback on its first write
    monkeypatch.setattr(sys, "stdout", None)
    assert main(["inspect", "tiny"]) == 2
    assert "standard output is closed" in capsys.readouterr().err


def test_inspect_plan_stops_at_the_models_context(capsys):
    assert main(["inspect", "flash", "--ctx", "1048576", "--prefill-chunk", "32"]) == 0
    assert "persistent_kv:    3,685,757,670 bytes" in capsys.readouterr().out
    # a plan for a context generate and serve refuse was printed as if usable
    assert main(["inspect", "flash", "--ctx", "1048577"]) == 2
    assert "exceeds the model's max_position_embeddings 1048576" in capsys.readouterr().err


def test_convert_synthetic_device_is_checked(tmp_path, capsys):
    out = tmp_path / "x.gguf"
    assert main(["convert", "--synthetic", "tiny", "--mix", "q8", "--out", str(out), "--device", "meta", "-q"]) == 2
    assert "takes cpu or cuda" in capsys.readouterr().err
    if not torch.cuda.is_available():  # torch's message was a paragraph about ATen_cuda
        assert main(["convert", "--synthetic", "tiny", "--mix", "q8", "--out", str(out), "--device", "cuda"]) == 2
        assert "CUDA is not available" in capsys.readouterr().err
    # 'auto' (refused by torch before) resolves like every other --device
    assert main(["convert", "--synthetic", "tiny", "--mix", "q8", "--out", str(out), "--device", "auto", "-q"]) == 0
    assert out.stat().st_size > 0


def test_bench_caches_prints_valid_json(capsys):
    # a top-k overlap with nothing to compare was printed as the bare token NaN, which is not JSON
    assert main(["bench", "caches", "-m", "tiny", "--prompt-len", "8", "--gen", "2", "--device", "cpu"]) == 0

    def refuse(token: str) -> None:
        raise AssertionError(f"not JSON: {token}")

    report = json.loads(capsys.readouterr().out, parse_constant=refuse)
    assert report["float_vs_native"]["topk_overlap"] is None


def test_a_gguf_without_the_gguf_suffix_is_recognised(tmp_path, capsys) -> None:
    """A GGUF saved under another name (model.bin, MODEL.GGUF) was taken for a checkpoint directory ("is not a
    directory"); the file's magic says what it is."""
    from ds4x.cli.main import main
    from ds4x.weights.gguf import is_gguf_file
    from tests.test_gguf_third_party import D, random_weights, write_third_party

    src = tmp_path / "m.gguf"
    write_third_party(src, random_weights(D, seed=0))
    for name in ("model.bin", "MODEL.GGUF"):
        other = tmp_path / name
        other.write_bytes(src.read_bytes())
        assert is_gguf_file(other)
        assert main(["inspect", str(other), "--json"]) == 0
        assert main(["generate", "-m", str(other), "--prompt-ids", "1,2,3", "-n", "2", "--cache", "float",
                     "--temp", "0"]) == 0
    assert not is_gguf_file(tmp_path) and not is_gguf_file(tmp_path / "missing.bin")


def test_an_interrupted_chat_reply_reports_its_rate(capsys):
    # Ctrl-C in a reply printed "0.0 tok/s": the decode time was only recorded when the generator ran to its end
    import io

    from ds4x.cli import chat as chat_cmd
    from ds4x.cli.main import build_parser

    class CtrlC(io.StringIO):
        writes = 0

        def write(self, s: str) -> int:
            self.writes += 1
            if self.writes == 5:
                raise KeyboardInterrupt
            return super().write(s)

    args = build_parser().parse_args(["chat", "-m", "tiny", "-p", "hi", "-n", "20", "--cache", "float"])
    assert chat_cmd.run(args, out=CtrlC()) == 0
    line = next(x for x in capsys.readouterr().err.splitlines() if x.startswith("[ds4x] prompt"))
    assert "stop: interrupted" in line
    n, rate = line.split("generated ")[1].split(" tok (")
    assert int(n) == 5 and float(rate.split()[0]) > 0  # the token being shown when Ctrl-C came counts


def test_quality_recall_beyond_the_context_fails_before_any_work(monkeypatch, capsys):
    # --recall 20000 ran the perplexity part, then failed with "context 19803 exceeds ... 16384"
    from ds4x.runtime import quality

    def no_work(*_a, **_k):
        raise AssertionError("the perplexity ran before --recall was checked")

    monkeypatch.setattr(quality, "perplexity", no_work)
    assert main(["quality", "-m", "tiny", "--device", "cpu", "--samples", "0", "--recall", "2048,8193"]) == 2
    err = capsys.readouterr().err
    assert "--recall" in err and "context of 8192 tokens" in err and "Traceback" not in err
    with pytest.raises(ValueError, match="context of 1..8192"):
        quality.recall(Engine.load("tiny", device="cpu"), "x = 1\n", 8193)


def test_convert_names_a_mix_that_fits(tmp_path, capsys):
    # the default --mix q2 on the tiny preset failed with only "rows of 128 values, not a multiple of the IQ2_XXS
    # block size 256"
    out = tmp_path / "t.gguf"
    assert main(["convert", "--synthetic", "tiny", "--out", str(out), "-q"]) == 2
    err = capsys.readouterr().err
    assert "--mix q2 does not fit" in err and "IQ2_XXS block size 256" in err and "use --mix q8" in err
    assert not out.exists()
    assert main(["convert", "--synthetic", "tiny", "--mix", "q8", "--type-experts", "IQ2_XXS", "--out", str(out)]) == 2
    assert "--type-experts IQ2_XXS does not fit" in capsys.readouterr().err


def test_a_chat_reply_fills_the_context_like_generate():
    # a reply stopped one token short of a full context with stop "length"; generate takes ctx - prompt + 1 tokens
    from ds4x.runtime.conversation import Conversation
    from ds4x.runtime.engine import GenerationStats

    engine = Engine.load("tiny", device="cpu")
    chat, stats = Conversation(engine.new_session(ctx=16, cache="float")), GenerationStats()
    chat.messages.append({"role": "user", "content": "hi"})
    prompt = chat.prompt_ids()
    chat.reset()
    reply = list(chat.reply("hi", 100, stats=stats))
    plain = [t for t, _ in engine.new_session(ctx=16, cache="float").generate(prompt, 100, stop_ids=())]
    assert reply == plain and len(reply) == 16 - len(prompt) + 1 and stats.stop_reason == "context"
    with pytest.raises(ValueError, match="no longer fits"):  # the next turn is refused as before; /reset goes on
        list(chat.reply("x", 4))
    chat.reset()
    assert len(list(chat.reply("x", 4))) == 4
