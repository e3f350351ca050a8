"""How tool calls look in generated text: finding a complete call, rendering its result, the prompt.

Owns the three call syntaxes, each a `ToolFormat`:

- "hermes", for chat templates that take `tools=` and use `<tool_call>` (Qwen2.5/3, Hermes, SmolLM3):
  the model writes `<tool_call>\\n{"name": "calculator", "arguments": {"expression": "2+2"}}\\n</tool_call>`;
  the result is fed back the way the model's chat template renders a `tool` message after the
  assistant's turn (read off the template with marker strings); a template without tool support
  gets the Qwen2.5 form `<|im_end|>\\n<|im_start|>user\\n<tool_response>\\n...\\n</tool_response>
  <|im_end|>\\n<|im_start|>assistant\\n`.
- "nanochat": `<|python_start|>2+2<|python_end|>` calls the calculator, the result is
  `<|output_start|>4<|output_end|>` (nanochat's SFT teaches exactly this; commas are dropped from the
  expression as nanochat's engine does, so "1,000*3" works).
- "plain", for models with neither: `<calc>2+2</calc>` calls the calculator and
  `<tool name="python">{"code": "print(1)"}</tool>` any tool by name; both results come back as
  `<result>4</result>`. A short description of this syntax and the tools goes into the system message.

The decode loop watches `stop_strings`, calls `find_call` on a row's text since its last tool result,
runs the call (`call_output`, never raises), and appends `render_result(output)` as forced tokens
right after the call's end. When a row ends its turn (end-of-turn token) and an environment answers,
`render_user(text)` is what follows that token. Malformed calls (bad JSON, unknown tool, wrong
arguments) give an error text as the result, never an exception.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from mlx_grpo.base.errors import UserError
from mlx_grpo.tools.registry import MAX_OUTPUT_CHARS, Tool, run_tool, truncate

# Marker strings rendered through a chat template to read off what it puts around a turn.
_CALL_MARK, _OUT_MARK = "MLXGRPOCALLMARK", "MLXGRPOOUTPUTMARK"
_QWEN_RESULT = ("<|im_end|>\n<|im_start|>user\n<tool_response>\n",
                "\n</tool_response><|im_end|>\n<|im_start|>assistant\n")


@dataclass(frozen=True)
class ParsedCall:
    name: str | None  # None when the call could not be read
    arguments: dict
    start: int  # where the call starts in the searched text
    end: int  # just past the call: tokens sampled after it are not part of the model's turn
    error: str | None = None  # set for a malformed call: this text is the call's result


def call_output(call: ParsedCall, tools: Mapping[str, Tool], max_chars: int = MAX_OUTPUT_CHARS) -> str:
    """The text result of a parsed call: the tool's output, or an error text for the model."""
    if call.error is not None:
        return truncate(call.error, max_chars)
    if call.name not in tools:
        return truncate(f"Error: unknown tool {call.name!r} (available: {', '.join(tools) or 'none'})", max_chars)
    return run_tool(tools[call.name], call.arguments, max_chars)


def _chat_template(tokenizer) -> str:
    template = getattr(tokenizer, "chat_template", None) if tokenizer is not None else None
    if isinstance(template, dict):  # named templates: "tool_use" is the one that renders tools
        template = template.get("tool_use") or template.get("default") or ""
    return template or ""


def _continuation(tokenizer, after: list[dict], **kwargs) -> tuple[str, str] | None:
    """Render [user, assistant <call mark>, *after] with the generation prompt and return the text
    after the assistant's content, split at the output mark: (head, tail). None when the template
    refuses these messages or transforms the marks."""
    messages = [{"role": "user", "content": "?"}, {"role": "assistant", "content": _CALL_MARK}, *after]
    try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **kwargs)
    except Exception:  # jinja's raise_exception, a missing tool_call_id, ...: fall back to a fixed form
        return None
    if not isinstance(text, str) or text.count(_CALL_MARK) != 1:
        return None
    rest = text.split(_CALL_MARK, 1)[1]
    if rest.count(_OUT_MARK) != 1:
        return None
    head, tail = rest.split(_OUT_MARK)
    return head, tail


def _render_messages(tokenizer, messages: list[dict], add_generation_prompt: bool) -> str:
    if _chat_template(tokenizer):
        return tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False)
    return "\n\n".join(m["content"] for m in messages) + "\n"  # as rollout.encode_chat_prompt joins them


def _with_system(messages: list[dict], text: str) -> list[dict]:
    """The messages with text appended to the system message (one is added first when there is none)."""
    messages = [dict(m) for m in messages]
    if messages and messages[0].get("role") == "system":
        messages[0]["content"] = f"{messages[0]['content']}\n\n{text}"
        return messages
    return [{"role": "system", "content": text}, *messages]


def _signature(tool: Tool) -> str:
    props = tool.parameters.get("properties", {})
    args = ", ".join(f"{k}: {v.get('type', 'any')}" for k, v in props.items())
    return f"{tool.name}({args})"


def _json_object(body: str) -> dict:
    value = json.loads(body) if body.strip() else {}
    if not isinstance(value, dict):
        raise ValueError(f"expected a JSON object, got {type(value).__name__}")
    return value


@dataclass
class ToolFormat:
    """One call syntax. `tokenizer` (optional) is the model's: chat formats read their turn framing off
    its template; without one they use the ChatML (Qwen2.5) framing."""

    tokenizer: object = None
    name: str = field(default="", init=False)
    stop_strings: tuple[str, ...] = field(default=(), init=False)

    def find_call(self, text: str) -> ParsedCall | None:
        """The first complete call in text (a row's generated text since its last tool result), or None
        while no call is complete."""
        raise NotImplementedError

    def render_result(self, output: str) -> str:
        """The text fed into the row right after the call's end, carrying the tool's output."""
        raise NotImplementedError

    def check_tools(self, tools: Mapping[str, Tool]) -> None:
        """Raise UserError when this syntax cannot call one of these tools."""

    def describe_tools(self, tools: Mapping[str, Tool]) -> str:
        """System-prompt text teaching the syntax and listing the tools ("" when the model needs none)."""
        return ""

    def render_prompt(self, messages: list[dict], tools: Mapping[str, Tool], add_generation_prompt: bool = True) -> str:
        """The prompt text with the tools made known to the model."""
        description = self.describe_tools(tools)
        messages = _with_system(messages, description) if description else list(messages)
        return _render_messages(self.tokenizer, messages, add_generation_prompt)

    def render_user(self, text: str, after_end_token: bool = True) -> str:
        """The text that follows the model's turn when an environment answers with text: the user turn in
        the chat template, then the generation prompt for the model's next turn. after_end_token: the model
        closed its turn with its end token itself (else the frame keeps it, e.g. after a stop string)."""
        if not _chat_template(self.tokenizer):
            return f"\n\n{text}\n"
        frame = _continuation(self.tokenizer, [{"role": "user", "content": _OUT_MARK}])
        if frame is None:
            raise UserError("the chat template cannot render a user turn after an assistant turn")
        head, tail = frame
        eos = getattr(self.tokenizer, "eos_token", None)
        if after_end_token and eos and head.startswith(eos):  # the model sampled this token itself
            head = head[len(eos):]
        return head + text + tail


@dataclass
class HermesFormat(ToolFormat):
    _CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)

    def __post_init__(self) -> None:
        self.name, self.stop_strings = "hermes", ("</tool_call>",)
        frame = None
        if "tools" in _chat_template(self.tokenizer):
            frame = _continuation(self.tokenizer, [{"role": "tool", "content": _OUT_MARK}],
                                  tools=[_DUMMY_TOOL.schema])
        self._result = frame or _QWEN_RESULT

    def find_call(self, text: str) -> ParsedCall | None:
        match = self._CALL.search(text)
        if match is None:
            return None
        start, end = match.span()
        try:
            obj = _json_object(match.group(1))
            name = obj.get("name")
            # some models write "parameters", or the arguments as a JSON string (OpenAI's wire form)
            arguments = obj.get("arguments", obj.get("parameters", {}))
            arguments = _json_object(arguments) if isinstance(arguments, str) else arguments
        except ValueError as e:  # json.JSONDecodeError is a ValueError
            return ParsedCall(None, {}, start, end, f"Error: the tool call is not valid JSON: {e}")
        if not isinstance(name, str) or not isinstance(arguments, dict):
            return ParsedCall(None, {}, start, end,
                              'Error: a tool call is {"name": "<tool name>", "arguments": {<JSON object>}}')
        return ParsedCall(name, arguments, start, end)

    def render_result(self, output: str) -> str:
        head, tail = self._result
        return head + output + tail

    def describe_tools(self, tools: Mapping[str, Tool]) -> str:
        if not tools or "tools" in _chat_template(self.tokenizer):
            return ""  # nothing to describe, or the template renders the tools itself (render_prompt)
        listing = "\n".join(json.dumps(t.schema) for t in tools.values())
        return ("You can call these functions:\n<tools>\n" + listing + "\n</tools>\n\nTo call one, write "
                '<tool_call>\n{"name": "<function name>", "arguments": {<arguments as JSON>}}\n</tool_call>\n'
                "and wait for its result in <tool_response></tool_response>.")

    def render_prompt(self, messages: list[dict], tools: Mapping[str, Tool], add_generation_prompt: bool = True) -> str:
        if tools and "tools" in _chat_template(self.tokenizer):
            return self.tokenizer.apply_chat_template(list(messages), tools=[t.schema for t in tools.values()],
                                                      add_generation_prompt=add_generation_prompt, tokenize=False)
        return super().render_prompt(messages, tools, add_generation_prompt)


@dataclass
class NanochatFormat(ToolFormat):
    _CALL = re.compile(r"<\|python_start\|>(.*?)<\|python_end\|>", re.DOTALL)

    def __post_init__(self) -> None:
        self.name, self.stop_strings = "nanochat", ("<|python_end|>",)

    def find_call(self, text: str) -> ParsedCall | None:
        match = self._CALL.search(text)
        if match is None:
            return None
        return ParsedCall("calculator", {"expression": match.group(1).replace(",", "")}, *match.span())

    def render_result(self, output: str) -> str:
        return f"<|output_start|>{output}<|output_end|>"

    def check_tools(self, tools: Mapping[str, Tool]) -> None:
        others = sorted(set(tools) - {"calculator"})
        if others:
            raise UserError(f"nanochat models call only the calculator (<|python_start|>...), not {others[0]!r}")


@dataclass
class PlainFormat(ToolFormat):
    _CALC = re.compile(r"<calc>(.*?)</calc>", re.DOTALL)
    _TOOL = re.compile(r"<tool\b([^>]*)>(.*?)</tool>", re.DOTALL)
    _NAME = re.compile(r"""^\s*name\s*=\s*["']([^"']+)["']\s*$""")

    def __post_init__(self) -> None:
        self.name, self.stop_strings = "plain", ("</calc>", "</tool>")

    def find_call(self, text: str) -> ParsedCall | None:
        found = [m for m in (self._CALC.search(text), self._TOOL.search(text)) if m is not None]
        if not found:
            return None
        match = min(found, key=lambda m: m.start())
        start, end = match.span()
        if match.re is self._CALC:
            return ParsedCall("calculator", {"expression": match.group(1)}, start, end)
        name = self._NAME.match(match.group(1))
        if name is None:
            return ParsedCall(None, {}, start, end, 'Error: write a tool call as <tool name="NAME">{...}</tool>')
        try:
            return ParsedCall(name.group(1), _json_object(match.group(2)), start, end)
        except ValueError as e:
            return ParsedCall(None, {}, start, end, f"Error: the tool arguments are not a JSON object: {e}")

    def render_result(self, output: str) -> str:
        return f"<result>{output}</result>"

    def describe_tools(self, tools: Mapping[str, Tool]) -> str:
        if not tools:
            return ""
        if set(tools) == {"calculator"}:
            # the general form would only be noise to copy: on the H100, 82 of the 86 calls the base SmolLM2
            # made under it were that sentence, copied with its NAME placeholder (docs/learning.md, "Tools")
            return ("For arithmetic, write <calc>expression</calc> and stop; the result comes back as "
                    "<result>...</result>, e.g. <calc>12*(3+4)</calc> gives <result>84</result>.")
        # a real call as the example: a placeholder such as NAME is what a small model copies
        tool = next(t for t in tools.values() if t.name != "calculator") if set(tools) - {"calculator"} else None
        args = ", ".join(f'"{k}": ...' for k in tool.parameters.get("properties", {}))
        lines = [f'You can use tools. To call one, write its name and JSON arguments, e.g. '
                 f'<tool name="{tool.name}">{{{args}}}</tool>, and stop; its output comes back as '
                 '<result>...</result>.']
        if "calculator" in tools:
            lines.append("For arithmetic, <calc>expression</calc> is short for the calculator, "
                         "e.g. <calc>12*(3+4)</calc> gives <result>84</result>.")
        lines.append("Tools:")
        lines += [f"- {_signature(t)}: {' '.join(t.description.split())}" for t in tools.values()]
        return "\n".join(lines)


# Passed when reading the tool-message framing off a template: some render tool turns only with tools.
_DUMMY_TOOL = Tool("f", "A placeholder.", {"type": "object", "properties": {"x": {"type": "string"}},
                                            "required": ["x"]}, str)
FORMATS = {"hermes": HermesFormat, "nanochat": NanochatFormat, "plain": PlainFormat}


def tool_format_for(tokenizer, model_type: str | None = None, name: str = "auto") -> ToolFormat:
    """The call syntax of this model: `name` when given, else nanochat for nanochat models (its
    python tokens), hermes when the chat template uses `<tool_call>`, else plain text. A template that
    takes `tools=` with another call syntax (e.g. Llama 3.1's bare JSON) also gets plain text."""
    if name != "auto":
        if name not in FORMATS:
            raise UserError(f"tool format {name!r}: expected auto or one of {', '.join(FORMATS)}")
        return FORMATS[name](tokenizer)
    vocab = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else {}
    if model_type == "nanochat" or "<|python_start|>" in vocab:
        return NanochatFormat(tokenizer)
    if "<tool_call>" in _chat_template(tokenizer):
        return HermesFormat(tokenizer)
    return PlainFormat(tokenizer)


def render_prompt(fmt: ToolFormat, messages: Sequence[dict], tools: Mapping[str, Tool]) -> str:
    """The prompt of a tool-using row: checks that the format can call the tools, then renders."""
    fmt.check_tools(tools)
    return fmt.render_prompt(list(messages), tools)
