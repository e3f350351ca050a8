"""tool_calls.py: each syntax's find_call on complete, incomplete and malformed text, its results
rendered as the chat template would render them, prompts with tools, and choosing a format."""

from __future__ import annotations

import jinja2
import pytest
from transformers import AutoTokenizer

from conftest import write_tokenizer
from mlx_grpo.base.errors import UserError
from mlx_grpo.models.nanochat_tokenizer import CHAT_TEMPLATE as NANOCHAT_TEMPLATE
from mlx_grpo.tools.calls import (HermesFormat, NanochatFormat, ParsedCall, PlainFormat, call_output, render_prompt,
                                 tool_format_for)
from mlx_grpo.tools.registry import resolve_tools

# A ChatML template with Hermes-style tools (written for these tests, in the shape of Qwen2.5's):
# tools listed in the system turn, a tool message rendered as a user turn in <tool_response>.
TOOLS_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}\n\n"
    "{% endif %}# Tools\n<tools>\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}</tools>\n"
    "Call a tool as <tool_call>\n{\"name\": ..., \"arguments\": ...}\n</tool_call><|im_end|>\n"
    "{% elif messages[0]['role'] == 'system' %}<|im_start|>system\n{{ messages[0]['content'] }}<|im_end|>\n{% endif %}"
    "{% for m in messages %}{% if m['role'] == 'tool' %}"
    "<|im_start|>user\n<tool_response>\n{{ m['content'] }}\n</tool_response><|im_end|>\n"
    "{% elif m['role'] != 'system' %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TOOLS = resolve_tools(["calculator", "python"])
CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "6*7"}}\n</tool_call>'


@pytest.fixture(scope="module")
def chatml(tmp_path_factory):
    """The test tokenizer with its plain ChatML template (no tool support)."""
    path = tmp_path_factory.mktemp("tok")
    write_tokenizer(path)
    return AutoTokenizer.from_pretrained(str(path))


@pytest.fixture(scope="module")
def tools_tok(tmp_path_factory):
    path = tmp_path_factory.mktemp("tools_tok")
    write_tokenizer(path)
    tok = AutoTokenizer.from_pretrained(str(path))
    tok.chat_template = TOOLS_TEMPLATE
    return tok


class JinjaTokenizer:
    """Just enough of a tokenizer to render a chat template (nanochat's), without building its vocab."""

    def __init__(self, template: str, eos_token: str):
        env = jinja2.Environment()
        env.globals["raise_exception"] = lambda message: (_ for _ in ()).throw(ValueError(message))
        self.chat_template, self.eos_token, self._template = template, eos_token, env.from_string(template)

    def apply_chat_template(self, messages, add_generation_prompt=False, tokenize=False, **kwargs):
        return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt, **kwargs)


def test_hermes_find_call():
    fmt = HermesFormat()
    text = f"Let me compute. {CALL} ignored"
    call = fmt.find_call(text)
    assert (call.name, call.arguments, call.error) == ("calculator", {"expression": "6*7"}, None)
    assert text[call.start:call.end] == CALL and text[call.end:] == " ignored"
    assert call_output(call, TOOLS) == "42"
    for incomplete in ("Thinking...", CALL[:-3], CALL[:40], "</tool_call>"):
        assert fmt.find_call(incomplete) is None
    second = '<tool_call>{"name": "python", "arguments": {"code": "1"}}</tool_call>'
    assert fmt.find_call(CALL + second).arguments == {"expression": "6*7"}  # the first complete call
    # what models write instead of the canonical form
    as_string = fmt.find_call(
        '<tool_call>{"name": "calculator", "arguments": "{\\"expression\\": \\"1+1\\"}"}</tool_call>')
    assert as_string.arguments == {"expression": "1+1"}
    alias = fmt.find_call('<tool_call>{"name": "calculator", "parameters": {"expression": "2"}}</tool_call>')
    assert alias.arguments == {"expression": "2"}


@pytest.mark.parametrize("body, message", [
    ('{"name": "calculator", "arguments": {"expression": "1"}', "not valid JSON"),
    ("calculator(1+1)", "not valid JSON"),
    ('["calculator"]', "not valid JSON: expected a JSON object"),
    ('{"arguments": {}}', 'a tool call is {"name"'),
    ('{"name": "calculator", "arguments": [1]}', 'a tool call is {"name"'),
])
def test_hermes_malformed_calls_give_error_results(body, message):
    call = HermesFormat().find_call(f"<tool_call>{body}</tool_call> rest")
    assert call.name is None and message in call.error and call.end == len(f"<tool_call>{body}</tool_call>")
    assert call_output(call, TOOLS) == call.error


def test_call_output_for_unknown_tools_and_bad_arguments():
    assert call_output(ParsedCall("search", {}, 0, 1), TOOLS) == \
        "Error: unknown tool 'search' (available: calculator, python)"
    assert call_output(ParsedCall("calculator", {"expr": "1"}, 0, 1), TOOLS).startswith(
        "Error: calculator takes no argument 'expr'")
    assert call_output(ParsedCall(None, {}, 0, 1, "Error: " + "x" * 100), TOOLS, max_chars=20).endswith("cut]")


def test_hermes_result_is_what_the_template_renders_for_a_tool_message(tools_tok):
    fmt = HermesFormat(tools_tok)
    messages = [{"role": "user", "content": "What is 6*7?"}]
    prompt = fmt.render_prompt(messages, TOOLS)
    assert '"name": "calculator"' in prompt and "<tools>" in prompt
    full = tools_tok.apply_chat_template(
        [*messages, {"role": "assistant", "content": CALL}, {"role": "tool", "content": "42"}],
        tools=[t.schema for t in TOOLS.values()], add_generation_prompt=True, tokenize=False)
    # the row: prompt + the model's call + the forced result text == the template's conversation
    assert prompt + CALL + fmt.render_result("42") == full
    assert fmt.render_result("42") == "<|im_end|>\n<|im_start|>user\n<tool_response>\n42\n</tool_response>" \
                                      "<|im_end|>\n<|im_start|>assistant\n"


def test_hermes_without_a_tools_template_uses_the_qwen_form(chatml):
    qwen = "<|im_end|>\n<|im_start|>user\n<tool_response>\n4\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    assert HermesFormat().render_result("4") == qwen
    fmt = HermesFormat(chatml)
    assert fmt.render_result("4") == qwen
    prompt = fmt.render_prompt([{"role": "user", "content": "Hi"}], TOOLS)
    assert prompt.startswith("<|im_start|>system\nYou can call these functions:\n<tools>\n")
    assert '<tool_call>\n{"name": "<function name>"' in prompt
    assert prompt.endswith("Hi<|im_end|>\n<|im_start|>assistant\n")


def test_render_user_follows_the_models_end_of_turn(chatml):
    fmt = PlainFormat(chatml)
    messages = [{"role": "user", "content": "Guess"}]
    prompt = chatml.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    turns = [{"role": "assistant", "content": "50"}, {"role": "user", "content": "higher"}]
    full = chatml.apply_chat_template([*messages, *turns], add_generation_prompt=True, tokenize=False)
    # the model itself samples "<|im_end|>" (its EOS); the forced text starts after it
    assert prompt + "50" + chatml.eos_token + fmt.render_user("higher") == full
    nanochat = NanochatFormat(JinjaTokenizer(NANOCHAT_TEMPLATE, "<|assistant_end|>"))
    assert nanochat.render_user("higher") == "<|user_start|>higher<|user_end|><|assistant_start|>"
    assert PlainFormat().render_user("higher") == "\n\nhigher\n"


def test_nanochat_format():
    fmt = NanochatFormat()
    text = "3 boxes of 1,200: <|python_start|>3*1,200<|python_end|><|output_start|>"
    call = fmt.find_call(text)
    assert (call.name, call.arguments, text[call.end:]) == ("calculator", {"expression": "3*1200"}, "<|output_start|>")
    assert fmt.find_call("<|python_start|>3*12") is None
    assert fmt.render_result(call_output(call, TOOLS)) == "<|output_start|>3600<|output_end|>"
    bad = fmt.find_call("<|python_start|>'abc'.upper()<|python_end|>")
    assert call_output(bad, TOOLS).startswith("Error: ValueError: unsupported expression")
    assert fmt.stop_strings == ("<|python_end|>",)
    with pytest.raises(UserError, match="only the calculator"):
        render_prompt(fmt, [{"role": "user", "content": "x"}], TOOLS)
    calc = {"calculator": TOOLS["calculator"]}
    nano = NanochatFormat(JinjaTokenizer(NANOCHAT_TEMPLATE, "<|assistant_end|>"))
    assert render_prompt(nano, [{"role": "user", "content": "2+2?"}], calc) == \
        "<|bos|><|user_start|>2+2?<|user_end|><|assistant_start|>"  # nanochat learned the tool in SFT


def test_plain_format():
    fmt = PlainFormat()
    text = 'First <calc>12*(3+4)</calc> then <tool name="python">{"code": "print(1)"}</tool>'
    call = fmt.find_call(text)
    assert (call.name, call.arguments) == ("calculator", {"expression": "12*(3+4)"})
    assert text[call.end:call.end + 5] == " then"
    rest = text[call.end:]
    tool = fmt.find_call(rest)
    assert (tool.name, tool.arguments) == ("python", {"code": "print(1)"})
    assert call_output(tool, TOOLS) == "1\n"
    assert fmt.find_call("<tool name='calculator'></tool>").arguments == {}
    assert fmt.find_call("<calc>1+1") is None and fmt.find_call('<tool name="python">{"code": 1}') is None
    assert "write a tool call as" in fmt.find_call("<tool>{}</tool>").error
    assert "not a JSON object" in fmt.find_call('<tool name="python">print(1)</tool>').error
    assert fmt.render_result("84") == "<result>84</result>"
    assert fmt.stop_strings == ("</calc>", "</tool>")


def test_plain_prompt_describes_the_tools(chatml):
    prompt = render_prompt(PlainFormat(chatml), [{"role": "system", "content": "Be brief."},
                                                 {"role": "user", "content": "Hi"}], TOOLS)
    assert prompt.startswith("<|im_start|>system\nBe brief.\n\nYou can use tools.")
    assert '<tool name="python">{"code": ...}</tool>' in prompt and "NAME" not in prompt
    assert "- calculator(expression: string): Evaluate an arithmetic expression" in prompt
    assert "- python(code: string): Run Python code" in prompt and "<calc>expression</calc>" in prompt
    only_python = PlainFormat().describe_tools({"python": TOOLS["python"]})
    assert "<calc>" not in only_python
    assert PlainFormat().render_prompt([{"role": "user", "content": "Hi"}], {}) == "Hi\n"  # no tools: nothing added


def test_tool_format_for(chatml, tools_tok):
    assert tool_format_for(chatml).name == "plain"
    assert tool_format_for(chatml, model_type="nanochat").name == "nanochat"
    assert tool_format_for(tools_tok).name == "hermes"
    assert tool_format_for(chatml, name="hermes").name == "hermes"
    assert tool_format_for(None).name == "plain"
    from mlx_lm.tokenizer_utils import TokenizerWrapper

    assert tool_format_for(TokenizerWrapper(tools_tok)).name == "hermes"  # what mlx-lm's load returns
    with pytest.raises(UserError, match="tool format 'json'"):
        tool_format_for(chatml, name="json")
