"""Tools a model can call during a rollout: the `Tool` record, the built-ins and running a call.

Owns: `Tool` (name, description, JSON schema of the parameters, the callable), built from a plain
function with type hints and a Google-style docstring (the schema comes from transformers'
`get_json_schema`, the one chat templates expect); `resolve_tool`, which turns "calculator",
"python", "module:function" or "path/to/file.py:function" into a Tool; `run_tool`, which never
raises: a bad argument or a failing tool comes back as text for the model ("Error: ..."), cut to a
length cap. `BUILTINS`: "calculator" (calculator.py) and "python" (sandbox.py runs the code).

It does not own the call syntax in generated text (calls.py) nor the episode loop (environments.py).
"""

from __future__ import annotations

import importlib
import importlib.util
import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from pathlib import Path

from mlx_grpo.base.errors import UserError
from mlx_grpo.tools.calculator import calculate
from mlx_grpo.tools.sandbox import PYTHON_MEMORY_MB, PYTHON_TIMEOUT_S, run_python

MAX_OUTPUT_CHARS = 2000  # what run_tool returns at most: tool output is context the model must read


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: dict  # JSON schema of the arguments: {"type": "object", "properties": ..., "required": ...}
    fn: Callable[..., object]
    # answers in microseconds (pure computation, no process or I/O): the decode loop waits for it at the sync
    # that hands the call over, so the row's next turn joins the batch one sync sooner (rollout/multiturn.py)
    instant: bool = False

    @property
    def schema(self) -> dict:
        """The OpenAI/Hugging Face function schema, as `apply_chat_template(tools=...)` takes it."""
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": self.parameters}}


def tool_from_function(fn: Callable[..., object], name: str | None = None) -> Tool:
    """A Tool from a function whose parameters all have type hints and whose docstring has a summary
    and an `Args:` entry per parameter (transformers' `get_json_schema` rules)."""
    from transformers.utils import get_json_schema  # imported late: transformers takes ~1 s to import

    try:
        schema = get_json_schema(fn)["function"]
    except Exception as e:  # its TypeHintParsingException / DocstringParsingException
        raise UserError(f"tool {getattr(fn, '__name__', fn)!r}: {e}") from None
    return Tool(name or schema["name"], schema.get("description", ""), schema["parameters"], fn)


def resolve_tool(spec: str | Callable[..., object]) -> Tool:
    """"calculator", "python", "package.module:function", "path/to/file.py:function", or a function."""
    if callable(spec):
        return tool_from_function(spec)
    if spec in BUILTINS:
        return BUILTINS[spec]()
    source, sep, attr = spec.rpartition(":")
    if not sep or not source or not attr:
        raise UserError(f"tool {spec!r}: expected 'calculator', 'python', 'module:function' or "
                        f"'path/to/file.py:function'")
    if source.endswith(".py"):
        path = Path(source)
        if not path.is_file():
            raise UserError(f"tool {spec!r}: {path} is not a file")
        module_spec = importlib.util.spec_from_file_location(f"mlx_grpo_tool_{path.stem}", path)
        module = importlib.util.module_from_spec(module_spec)
        module_spec.loader.exec_module(module)
    else:
        try:
            module = importlib.import_module(source)
        except ImportError as e:
            raise UserError(f"tool {spec!r}: cannot import {source}: {e}") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise UserError(f"tool {spec!r}: {source} has no function {attr!r}")
    return tool_from_function(fn)


def resolve_tools(specs: Iterable[str | Callable[..., object]]) -> dict[str, Tool]:
    """Tools by name; two tools of one name are an error (the model could not tell them apart)."""
    tools: dict[str, Tool] = {}
    for spec in specs:
        tool = resolve_tool(spec)
        if tool.name in tools:
            raise UserError(f"two tools are named {tool.name!r}")
        tools[tool.name] = tool
    return tools


_JSON_TYPES = {"string": str, "integer": int, "number": (int, float), "boolean": bool, "array": list,
               "object": dict}


def _check_arguments(tool: Tool, arguments: object) -> str | None:
    """Why these arguments do not fit the tool's schema, or None. Only top-level names and types:
    enough to turn a model's slip into a message it can act on."""
    if not isinstance(arguments, dict):
        return f"arguments must be a JSON object, got {type(arguments).__name__}"
    props = tool.parameters.get("properties", {})
    unknown = sorted(set(arguments) - set(props))
    if unknown:
        return f"{tool.name} takes no argument {unknown[0]!r} (it takes: {', '.join(props) or 'none'})"
    missing = [k for k in tool.parameters.get("required", []) if k not in arguments]
    if missing:
        return f"{tool.name} needs the argument {missing[0]!r}"
    for key, value in arguments.items():
        kind = props[key].get("type")
        if value is None and props[key].get("nullable"):
            continue
        want = _JSON_TYPES.get(kind) if isinstance(kind, str) else None
        # bool is an int in Python, but not a JSON integer or number
        if want is not None and (not isinstance(value, want) or (isinstance(value, bool) and kind != "boolean")):
            return f"argument {key!r} must be of type {kind}, got {json.dumps(value)[:40]}"
    return None


def run_tool(tool: Tool, arguments: object, max_chars: int = MAX_OUTPUT_CHARS) -> str:
    """Call the tool and return its output as text, never raising: a bad argument or an exception in the
    tool becomes "Error: <type>: <message>". The text is cut to max_chars with a note of what was cut."""
    problem = _check_arguments(tool, arguments)
    if problem is not None:
        return truncate(f"Error: {problem}", max_chars)
    try:
        result = tool.fn(**arguments)
    except KeyboardInterrupt:
        raise
    except BaseException as e:  # SystemExit too: a custom tool must not end the training run
        return truncate(f"Error: {type(e).__name__}: {e}", max_chars)
    if not isinstance(result, str):
        try:
            result = json.dumps(result)
        except (TypeError, ValueError):
            result = str(result)
    return truncate(result, max_chars)


def truncate(text: str, max_chars: int) -> str:
    if len(text) <= max_chars:
        return text
    return f"{text[:max_chars]}\n... [{len(text) - max_chars} more characters cut]"



def python_tool(timeout_s: float = PYTHON_TIMEOUT_S, memory_mb: int = PYTHON_MEMORY_MB) -> Tool:
    """The built-in "python" tool with these limits."""

    def python(code: str) -> str:
        """Run Python code in a fresh interpreter and return what it printed, or the traceback. A final
        bare expression is printed, as in a notebook. No network; files only in the working directory.

        Args:
            code: Python source code to run; use print() to show results.
        """
        return run_python(code, timeout_s=timeout_s, memory_mb=memory_mb)

    return tool_from_function(python)


BUILTINS: dict[str, Callable[[], Tool]] = {
    "calculator": lambda: replace(tool_from_function(calculate, "calculator"), instant=True),
    "python": python_tool}
