"""The ds4x command line end to end, and its errors (a message, exit code 2, no traceback)."""

import io
import json
import shutil
import subprocess
import sys

import pytest
import torch

from ds4x.cli.main import main
from ds4x.config import tiny_config
from ds4x.runtime.engine import Engine
from ds4x.weights.checkpoint import save_checkpoint
from ds4x.weights.synthetic import synthetic_weights


def test_generate_default_model_streams_text(capsys):
    assert main(["generate", "-p", "def main():", "-n", "8", "--seed", "1", "--ignore-eos"]) == 0
    out, err = capsys.readouterr()
    assert out.endswith("\n") and len(out) > 1
    assert "generated 8 tok" in err and "cache packed" in err
    assert "prompt 4 tok" in err  # <bos> + 3 BPE tokens: the trained default model's tokenizer, not bytes


def test_dump_logits_matches_a_session(tmp_path, capsys):
    dump = tmp_path / "l.json"
    # on the CPU, as the session it is compared with (on a GPU the command would take CUDA and bf16)
    assert main(["generate", "-m", "tiny", "--prompt-ids", "5,6,7,8", "-n", "6", "--temp", "0", "--cache", "float",
                 "--dump-logits", str(dump), "-q", "--ignore-eos", "--device", "cpu"]) == 0
    data = json.loads(dump.read_text())
    assert data["prompt_ids"] == [5, 6, 7, 8]
    assert len(data["generated_ids"]) == 6 and len(data["logits"]) == 6
    assert all(len(row) == 259 for row in data["logits"])
    assert [int(torch.tensor(r).argmax()) for r in data["logits"]] == data["generated_ids"]
    ids = capsys.readouterr().out.split()
    assert [int(i) for i in ids] == data["generated_ids"]
    s = Engine.load("tiny", device="cpu").new_session(ctx=64, cache="float")
    logits = s.prefill([5, 6, 7, 8])
    assert torch.allclose(logits, torch.tensor(data["logits"][0]), atol=1e-5)


def test_checkpoint_without_tokenizer_runs_with_prompt_ids(tmp_path, capsys):
    cfg = tiny_config(vocab_size=300)
    save_checkpoint(cfg, synthetic_weights(cfg, seed=2), tmp_path, naming="hf")
    assert main(["generate", "-m", str(tmp_path), "--prompt-ids", "1,2,3", "-n", "3", "-q"]) == 0
    assert len(capsys.readouterr().out.split()) == 3
    assert main(["generate", "-m", str(tmp_path), "-p", "hello", "-n", "3"]) == 2
    assert "no tokenizer" in capsys.readouterr().err


def test_inspect_describes_the_preset_as_it_runs(capsys):
    """`inspect tiny` describes the model `-m tiny` runs (the byte tokenizer's 259-token vocabulary; it showed the
    preset's own 512 and parameter counts of that)."""
    from ds4x.runtime.engine import Engine

    assert main(["inspect", "tiny", "--json"]) == 0
    described = json.loads(capsys.readouterr().out)["config"]
    assert described["vocab_size"] == Engine.load("tiny", device="cpu").cfg.vocab_size == 259


def test_inspect_presets_and_checkpoint(tmp_path, capsys):
    assert main(["inspect", "flash"]) == 0
    out = capsys.readouterr().out
    assert "43 (sliding x2, csa/4 x21, hca/128 x20)" in out
    assert "284," in out  # ~284B parameters
    cfg = tiny_config()
    save_checkpoint(cfg, synthetic_weights(cfg), tmp_path)
    assert main(["inspect", str(tmp_path), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["bytes_by_dtype"]["F32"]["bytes"] > 0


@pytest.mark.parametrize(
    "argv, message",
    [
        (["generate", "-m", "/no/such/model", "-p", "x"], "neither a preset"),
        (["generate", "-m", "flash", "-p", "x"], "too large to synthesize"),
        (["generate", "-p", "x", "--temp", "-1"], "temperature"),
        (["generate", "-p", "x", "--top-p", "0"], "top_p"),
        (["generate", "-p", "x", "-n", "-3"], "max-tokens"),
        (["generate", "-p", "x", "--ctx", "0"], "--ctx"),
        (["generate", "-p", "x" * 40, "--ctx", "16"], "context overflow"),
        (["generate", "--prompt-ids", "1,a"], "comma-separated"),
        (["generate", "--prompt-ids", "100000"], "outside the vocabulary"),
        (["generate", "-p", "x", "--device", "cuda:7"] if not torch.cuda.is_available() else
         ["generate", "-p", "x", "--device", "bogus"], "device"),
        (["inspect", "/no/such"], "neither a preset"),
        # argv bytes that are not UTF-8 arrive as lone surrogates: the tokenizers library raised a bare TypeError
        (["generate", "-p", "a\udcff"], "not valid UTF-8"),
        (["chat", "-p", "a\udcff", "-q"], "not valid UTF-8"),
        (["chat", "-p", "x", "--system", "\udcff", "-q"], "--system is not valid UTF-8"),
        (["generate", "-p", "x", "--threads", "100000"], "--threads must be at most"),  # crashed the process
        (["bench", "caches", "-m", "tiny", "--prompt-len", "0"], "--prompt-len and --gen"),  # IndexError
        (["bench", "caches", "-m", "tiny", "--gen", "0"], "--prompt-len and --gen"),
        (["bench", "prefill", "-m", "tiny", "--contexts", "4k"], "--contexts must be comma-separated"),
        (["quality", "--tokens", "0"], "--tokens must be >= 1"),  # nan perplexities, exit 0
        (["quality", "--tokens", "-5"], "--tokens must be >= 1"),  # scored nearly the whole text
        (["quality", "--samples", "-1"], "--samples must be >= 0"),  # silently ignored
        (["quality", "--recall", "-5"], "--recall contexts must be positive"),  # IndexError
    ],
)
def test_bad_options_give_clear_errors(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_chat_line_that_is_not_text_is_refused_and_the_chat_goes_on(capsys):
    from ds4x.cli import chat as chat_cmd
    from ds4x.cli.main import build_parser

    args = build_parser().parse_args(["chat", "-n", "2", "-q"])
    stdin = io.StringIO("a\udcff\nhello\n")  # a non-UTF-8 line read under surrogateescape (C / POSIX locale)
    assert chat_cmd.run(args, stdin=stdin, out=io.StringIO()) == 0
    err = capsys.readouterr().err
    assert "the message is not valid UTF-8" in err and "Traceback" not in err


def test_corrupt_checkpoint_is_a_clear_error(tmp_path, capsys):
    cfg = tiny_config()
    save_checkpoint(cfg, synthetic_weights(cfg), tmp_path)
    data = (tmp_path / "model.safetensors").read_bytes()
    (tmp_path / "model.safetensors").write_bytes(data[: len(data) // 2])  # truncated
    assert main(["generate", "-m", str(tmp_path), "--prompt-ids", "1", "-n", "1"]) == 2
    err = capsys.readouterr().err
    assert "model.safetensors" in err and "Traceback" not in err
    (tmp_path / "config.json").write_text("{")
    assert main(["inspect", str(tmp_path)]) == 2
    assert "not valid JSON" in capsys.readouterr().err


def test_console_script_runs():
    exe = shutil.which("ds4x") or f"{sys.executable} -m ds4x.cli.main"
    r = subprocess.run([*exe.split(), "generate", "-p", "hi", "-n", "4", "-q"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr


def test_python_dash_m_ds4x_is_the_console_script():
    r = subprocess.run([sys.executable, "-m", "ds4x", "--help"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("usage: ds4x ") and "serve" in r.stdout


def test_quality_report_runs(capsys):
    assert main(["quality", "--tokens", "256", "--samples", "1", "--recall", "", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "held-out perplexity (packed cache" in out and "unigram perplexity" in out


def test_generate_with_logit_bias_and_penalties(capsys):
    from ds4x.runtime.sampling import SamplingParams

    args = ["generate", "-m", "tiny", "--prompt-ids", "5,6,7,8", "-n", "24", "--temp", "0", "-q", "--ignore-eos"]
    assert main([*args, "--logit-bias", "9=100, 10=-5"]) == 0
    assert capsys.readouterr().out.split() == ["9"] * 24
    assert main(args) == 0
    plain = [int(t) for t in capsys.readouterr().out.split()]
    assert main([*args, "--frequency-penalty", "2", "--repetition-penalty", "1.5"]) == 0
    penalized = [int(t) for t in capsys.readouterr().out.split()]
    session = Engine.load("tiny", device="cpu").new_session(cache="packed", announce=False)
    params = SamplingParams(frequency_penalty=2, repetition_penalty=1.5)
    assert penalized == [t for t, _ in session.generate([5, 6, 7, 8], 24, params, stop_ids=())] != plain
    for bad in (["--logit-bias", "9"], ["--logit-bias", "300=1"], ["--presence-penalty", "3"]):
        assert main([*args, *bad]) == 2
        assert "error:" in capsys.readouterr().err


def test_cpu_threads_policy(monkeypatch):
    from ds4x.cli import cpu_threads

    engine = Engine.load("tiny", device="cpu")
    before = torch.get_num_threads()
    try:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
        torch.set_num_threads(2)
        assert cpu_threads.apply_cpu_threads(engine, None) == 1  # a small model on the CPU: one thread
        assert cpu_threads.apply_cpu_threads(engine, 2) == 2  # --threads wins
        monkeypatch.setattr(cpu_threads, "SMALL_MODEL_BYTES", 1)
        assert cpu_threads.apply_cpu_threads(engine, None) == 2  # a larger model keeps torch's setting
        monkeypatch.setattr(cpu_threads, "SMALL_MODEL_BYTES", 1 << 40)
        monkeypatch.setenv("OMP_NUM_THREADS", "2")
        assert cpu_threads.apply_cpu_threads(engine, None) == 2  # and so does an explicit OMP_NUM_THREADS
        with pytest.raises(ValueError, match="--threads must be >= 1"):
            cpu_threads.apply_cpu_threads(engine, 0)
    finally:
        torch.set_num_threads(before)
