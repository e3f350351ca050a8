"""Generation on a tiny random model: stream == plain, batch order, chat history, CLI errors."""

import io
import json

import pytest
from mlx_lm import load

from mlx_grpo.commands.cli import main
from mlx_grpo.commands.inference import encode_prompt, generate, generate_batch, run_chat, run_generate
from mlx_grpo.config import build_config, parse_set


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    model, tokenizer = load(str(tiny_model_dir))
    return model, tokenizer


def _cfg(*items):
    return build_config("generate", overrides=parse_set(["max_new_tokens=12", *items]))


def test_streamed_equals_plain_at_temperature_0(tiny):
    model, tok = tiny
    ids = encode_prompt(tok, "Hello there", system="be brief")
    pieces = []
    streamed = generate(model, tok, ids, _cfg(), on_text=pieces.append)
    plain = generate(model, tok, ids, _cfg())
    assert "".join(pieces) == streamed.text == plain.text
    assert plain.generation_tokens == 12  # a random model does not stop early


def test_cli_stream_output_equals_plain(tiny_model_dir, capsys):
    args = ["generate", "--model", str(tiny_model_dir), "--prompt", "abc", "--max-tokens", "10"]
    assert main(args) == 0
    plain = capsys.readouterr().out
    assert main(args + ["--stream"]) == 0
    assert capsys.readouterr().out == plain and len(plain) > 1


def test_chat_template_and_raw_differ(tiny):
    _, tok = tiny
    templated = tok.decode(encode_prompt(tok, "hi", system="sys"))
    assert templated.startswith("<|im_start|>system\nsys<|im_end|>") and templated.endswith("assistant\n")
    assert tok.decode(encode_prompt(tok, "hi", raw=True)) == "hi"


def test_same_seed_same_sample(tiny):
    model, tok = tiny
    ids = encode_prompt(tok, "x")
    a = generate(model, tok, ids, _cfg("temperature=1.0", "seed=3")).text
    b = generate(model, tok, ids, _cfg("temperature=1.0", "seed=3")).text
    assert a == b


def test_batch_results_in_input_order(tiny):
    model, tok = tiny
    prompts = ["a", "a longer prompt here", "mid size", "zz"]
    ids = [encode_prompt(tok, p) for p in prompts]
    batched = generate_batch(model, tok, ids, _cfg(), batch_size=3)
    singles = [generate(model, tok, i, _cfg()).text for i in ids]
    assert batched == singles


def test_prompts_file_writes_jsonl(tiny_model_dir, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "one"}\n{"prompt": "two"}\n')
    out = tmp_path / "out" / "r.jsonl"
    run_generate(_cfg(f"model_name={tiny_model_dir}"), prompts_file=str(prompts), output=str(out))
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["prompt"] for r in rows] == ["one", "two"] and all("completion" in r for r in rows)
    assert json.loads((tmp_path / "out" / "r.jsonl.config.json").read_text())["max_new_tokens"] == 12


def test_chat_keeps_history_and_resets(tiny_model_dir):
    cfg = _cfg(f"model_name={tiny_model_dir}")
    out = io.StringIO()
    history = run_chat(cfg, lines=["first", "second"], out=out)
    assert [m["content"] for m in history if m["role"] == "user"] == ["first", "second"]
    assert len(history) == 4
    history = run_chat(cfg, lines=["first", "/reset", "second", "/exit", "never"], out=io.StringIO())
    assert [m["content"] for m in history if m["role"] == "user"] == ["second"]


def test_chat_second_turn_sees_first(tiny):
    _, tok = tiny
    history = [{"role": "user", "content": "first"}, {"role": "assistant", "content": "reply"}]
    text = tok.decode(encode_prompt(tok, "second", history=history))
    assert text.index("first") < text.index("reply") < text.index("second")


def test_ctrl_c_stops_the_answer_and_at_the_prompt_ends_the_chat(tiny_model_dir):
    """`mlx-grpo chat` as a user runs it: Ctrl-C while an answer streams stops that answer and the chat goes on
    (twice); Ctrl-C at the prompt then ends it, exit 0. Greedy answers of the random model never end by
    themselves within max_new_tokens, so each one streams until the signal."""
    import os
    import signal
    import subprocess
    import sys
    import threading
    import time
    from pathlib import Path

    from conftest import sigint_default

    src = Path(__file__).resolve().parents[1] / "src"
    env = {**os.environ, "PYTHONPATH": str(src) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.Popen([sys.executable, "-m", "mlx_grpo", "chat", "--model", str(tiny_model_dir), "--set",
                             "max_new_tokens=100000", "--set", "temperature=0"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, preexec_fn=sigint_default)
    shown = []
    reader = threading.Thread(target=lambda: shown.extend(iter(lambda: proc.stdout.read1(4096).decode(), "")),
                              daemon=True)
    reader.start()

    def wait_for(done, what: str) -> None:
        deadline = time.monotonic() + 60
        while not done("".join(shown)) and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert done("".join(shown)), f"{what}; shown: {''.join(shown)[-300:]!r}"

    try:
        for n, line in enumerate(["hello", "and again"], 1):
            proc.stdin.write(f"{line}\n".encode())
            proc.stdin.flush()
            # the answer is streaming: some of it after the banner's line (or after the last stopped answer)
            after = "[answer stopped]\n" if n > 1 else "Ctrl-C stops an answer.\n"
            wait_for(lambda text: text.rpartition(after)[2] != "", "no answer")
            proc.send_signal(signal.SIGINT)
            wait_for(lambda text: text.count("[answer stopped]") == n, "the answer did not stop")
            assert proc.poll() is None, "Ctrl-C during an answer ended the chat"
        time.sleep(0.5)  # back at the prompt, reading the next line
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=20) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    err = proc.stderr.read().decode()
    assert "interrupted" not in err and "Traceback" not in err, err


@pytest.mark.parametrize("argv,message", [
    (["generate", "--prompt", "x", "--model", "/no/such/dir"], "not found"),
    (["generate", "--model", "m"], "exactly one of --prompt or --prompts-file"),
    (["generate", "--prompts-file", "/no/file.txt"], "prompts file not found"),
])
def test_generate_bad_input(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
