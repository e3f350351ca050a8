"""Generation on a tiny random model: stream == plain, batch order, chat history, CLI errors."""

import io
import json

import pytest
from mlx_lm import load

from mlx_grpo.cli import main
from mlx_grpo.config import build_config, parse_set
from mlx_grpo.inference import encode_prompt, generate, generate_batch, run_chat, run_generate


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


@pytest.mark.parametrize("argv,message", [
    (["generate", "--prompt", "x", "--model", "/no/such/dir"], "not found"),
    (["generate", "--model", "m"], "exactly one of --prompt or --prompts-file"),
    (["generate", "--prompts-file", "/no/file.txt"], "prompts file not found"),
])
def test_generate_bad_input(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
