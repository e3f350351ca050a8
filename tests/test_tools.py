"""tools.py: the calculator (values, refusals, no eval), schemas from functions, the registry,
run_tool's error texts, and the python tool's limits (time, memory, network, file writes)."""

from __future__ import annotations

import builtins
import os
import select
import socket
import sys
from pathlib import Path

import warnings

import pytest

from mlx_grpo.base.errors import UserError
from mlx_grpo.tools.calculator import calculate, format_number
from mlx_grpo.tools.registry import Tool, resolve_tool, resolve_tools, run_tool, tool_from_function
from mlx_grpo.tools.sandbox import _unshare_works, run_python

LINUX = sys.platform == "linux"


@pytest.mark.parametrize("expression, expected", [
    ("1 + 2 * 3", "7"), ("(1 + 2) * 3", "9"), ("7 / 2", "3.5"), ("6 / 3", "2"), ("7 // 2", "3"),
    ("-7 // 2", "-4"), ("7 % 3", "1"), ("-3 % 5", "2"), ("2 ** 10", "1024"), ("2 ** -1", "0.5"),
    ("-(3)", "-3"), ("+4", "4"), ("0.1 + 0.2", "0.3"), ("2 / 3", "0.666666666667"), ("1e-7", "0.0000001"),
    ("sqrt(16)", "4"), ("sqrt(2)", "1.41421356237"), ("round(2.675, 2)", "2.67"), ("max(3, 9, 4)", "9"),
    ("factorial(5)", "120"), ("floor(pi)", "3"), ("log10(1000)", "3"), ("3 * 1.5", "4.5"),
    ("1e20", "100000000000000000000"), ("123456789 * 987654321", "121932631112635269"),
    (" 12 ", "12"), ("1e25", "1e+25"),
])
def test_calculator_values(expression, expected):
    assert calculate(expression) == expected


@pytest.mark.parametrize("expression, message", [
    ("x + 1", "unsupported expression"),  # names
    ("__import__('os').system('true')", "unsupported expression"),  # calls of anything but the math list
    ("open('f')", "unsupported expression"),
    ("(1).real", "unsupported expression"),  # attributes
    ("'a' * 3", "unsupported expression"),  # strings
    ("[1, 2]", "unsupported expression"),
    ("(lambda: 1)()", "unsupported expression"),
    ("True + 1", "unsupported expression"),
    ("round(2.5, ndigits=0)", "unsupported expression"),  # keywords
    ("2 ** 10 ** 10", "too large"),  # huge powers are refused before they are computed
    ("9 ** 9 ** 9", "too large"),
    ("0.5 ** -100000", "too large"),
    ("10 ** 300 * 10", "too large"),  # result magnitude
    ("(-8) ** 0.5", "not a real number"),
    ("2 ^ 3", r"write \*\* for a power"),
    ("1 +", "not an arithmetic expression"),
    ("1" * 1001, "longer than"),
])
def test_calculator_refuses(expression, message):
    with pytest.raises((ValueError, OverflowError), match=message):
        calculate(expression)


@pytest.mark.parametrize("expression, message", [
    *((e, "a number runs into a name") for e in ("2or 3", "1if 2 else 3", "0x1for", "3x4", "12and4", "2e", "1.or 2",
                                                 "1jor 2", "0b1for 1", "3pi")),
    *((e, "unsupported expression: strings") for e in ("'\\d'", "b'\\d' * 2", '"a"'))])
def test_what_python_would_warn_about_is_refused_without_a_warning(expression, message):
    # Python's parser warns (SyntaxWarning: invalid decimal literal, invalid escape sequence) on these: a line on
    # the trainer's console
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(ValueError, match=message):
            calculate(expression)


@pytest.mark.parametrize("expression, expected", [("2e3 + 1", "2001"), ("0x1f + 1_000", "1031"), ("1.5e-1 * 2", "0.3"),
                                                  ("floor(2.5) + log10(100)", "4"), (".5 * 4", "2"), ("0o17 + 1", "16"),
                                                  ("0b101 + 1", "6"), ("1.e5 / 10", "10000"), ("log2(8) * 2", "6"),
                                                  ("2*e - e*2", "0")])
def test_numbers_next_to_names_in_valid_expressions_still_evaluate(expression, expected):
    assert calculate(expression) == expected


def test_calculator_never_evals(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("eval/exec called")

    monkeypatch.setattr(builtins, "eval", refuse)
    monkeypatch.setattr(builtins, "exec", refuse)
    assert calculate("sqrt(81) + 2 ** 3") == "17"


@pytest.mark.parametrize("expression", ["7 ** 100000", "7 ** 123456789"])
def test_huge_power_is_refused_before_it_is_computed(expression):
    # "the power is too large" is the size check that runs before the power; computed (milliseconds for
    # the first, minutes for the second), the result would be refused by the check after it, "the result
    # is too large": the message, not a clock, shows which check refused it
    with pytest.raises(OverflowError, match="the power is too large"):
        calculate(expression)


def test_format_number():
    assert format_number(3.0) == "3"
    assert format_number(-0.25) == "-0.25"
    assert format_number(10**30) == str(10**30)  # ints stay exact


def _documented(city: str, days: int, metric: bool = True, tags: list[str] | None = None) -> str:
    """Forecast the weather.

    Args:
        city: Where.
        days: How many days ahead.
        metric: Celsius when true.
        tags: Extra labels.
    """
    return f"{city}: sunny for {days} days"


def test_schema_from_typed_documented_function():
    tool = tool_from_function(_documented)
    assert tool.name == "_documented" and tool.description == "Forecast the weather."
    props = tool.parameters["properties"]
    assert props["city"] == {"type": "string", "description": "Where."}
    assert props["days"]["type"] == "integer" and props["metric"]["type"] == "boolean"
    assert props["tags"]["type"] == "array" and props["tags"]["items"] == {"type": "string"}
    assert tool.parameters["required"] == ["city", "days"]
    assert tool.schema == {"type": "function", "function": {"name": "_documented", "description":
                           "Forecast the weather.", "parameters": tool.parameters}}


def test_functions_without_hints_or_docstring_are_refused():
    def no_doc(x: int) -> int:
        return x

    def no_hint(x):
        """Double.

        Args:
            x: a number
        """
        return 2 * x

    for fn in (no_doc, no_hint):
        with pytest.raises(UserError, match=fn.__name__):
            tool_from_function(fn)


def test_registry_resolves_builtins_modules_and_files(tmp_path, monkeypatch):
    assert resolve_tool("calculator").name == "calculator"
    assert resolve_tool("python").parameters["required"] == ["code"]
    source = 'def shout(text: str) -> str:\n    """Upper-case.\n\n    Args:\n        text: what\n    """\n' \
             "    return text.upper()\n"
    (tmp_path / "my_tools.py").write_text(source)
    by_path = resolve_tool(f"{tmp_path / 'my_tools.py'}:shout")
    assert run_tool(by_path, {"text": "hi"}) == "HI"
    monkeypatch.syspath_prepend(str(tmp_path))
    assert resolve_tool("my_tools:shout").name == "shout"
    assert resolve_tool(_documented).name == "_documented"
    for bad, message in [("nonsense", "expected"), ("my_tools:missing", "no function"),
                         ("no_such_module_x:f", "cannot import"), (f"{tmp_path}/none.py:f", "not a file")]:
        with pytest.raises(UserError, match=message):
            resolve_tool(bad)
    with pytest.raises(UserError, match="two tools are named"):
        resolve_tools(["calculator", "calculator"])


def test_run_tool_returns_errors_as_text():
    calc = resolve_tool("calculator")
    assert run_tool(calc, {"expression": "1/0"}) == "Error: ZeroDivisionError: division by zero"
    assert run_tool(calc, {}) == "Error: calculator needs the argument 'expression'"
    assert run_tool(calc, {"expression": "1", "x": 2}).startswith("Error: calculator takes no argument 'x'")
    assert run_tool(calc, {"expression": 12}).startswith("Error: argument 'expression' must be of type string")
    assert run_tool(calc, ["1+1"]) == "Error: arguments must be a JSON object, got list"
    weather = tool_from_function(_documented)
    assert run_tool(weather, {"city": "Oslo", "days": True}).startswith("Error: argument 'days' must be")
    assert run_tool(weather, {"city": "Oslo", "days": 2, "tags": None}) == "Oslo: sunny for 2 days"

    def leave(code: int) -> int:
        """Exit.

        Args:
            code: status
        """
        raise SystemExit(code)

    assert run_tool(tool_from_function(leave), {"code": 3}) == "Error: SystemExit: 3"
    listing = Tool("listing", "", {"type": "object", "properties": {}}, lambda: {"a": [1, 2]})
    assert run_tool(listing, {}) == '{"a": [1, 2]}'
    long = Tool("long", "", {"type": "object", "properties": {}}, lambda: "x" * 50)
    assert run_tool(long, {}, max_chars=10) == "x" * 10 + "\n... [40 more characters cut]"


def test_python_runs_code_and_prints_last_expression():
    assert run_python("print('hi')\nx = 6 * 7\nx") == "hi\n42\n"
    assert run_python("import math\nmath.pi > 3") == "True\n"
    out = run_python("def f():\n    return 1 / 0\nf()")
    assert "ZeroDivisionError: division by zero" in out and 'File "main.py", line 2' in out
    assert "bootstrap" not in out and "<string>" not in out.split("main.py")[0]
    assert run_tool(resolve_tool("python"), {"code": "print('y' * 5000)"}).endswith("more characters cut]")


def _state(pid: int) -> str | None:
    """A process's state letter from /proc, None once it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return None


def _exits_within(pid: int, bound_s: float) -> bool:
    """Whether process `pid` (not ours to wait for) has exited or exits within bound_s: its pidfd becomes
    readable at exit, an event, not a poll."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    try:
        return bool(select.select([fd], [], [], bound_s)[0])
    finally:
        os.close(fd)


@pytest.mark.skipif(not LINUX, reason="pidfd_open")
def test_python_timeout_kills_the_process_and_its_children():
    # No clock in the assertions: the code itself never ends in time (the parent sleeps 30 s, its fork an
    # hour), so the timeout's message proves the timeout fired, and the fork dead at once (long before its
    # hour; the bound only keeps a failing test from hanging) proves the kill reached the process group.
    code = ("import os, time\npid = os.fork()\nif pid == 0:\n    time.sleep(3600)\n"
            "else:\n    print('child', pid, flush=True)\n    time.sleep(30)")
    out = run_python(code, timeout_s=1)
    assert out.endswith("Error: timed out after 1 s")
    child = int(out.split()[1])
    assert _exits_within(child, 25)
    assert _state(child) in (None, "Z")  # a zombie is dead, not reaped


@pytest.mark.skipif(not LINUX, reason="macOS does not enforce RLIMIT_AS")
def test_python_memory_limit():
    assert run_python("x = bytearray(32 * 2**20)\nlen(x)", memory_mb=256) == f"{32 * 2**20}\n"
    out = run_python("x = bytearray(1024 * 2**20)", memory_mb=256)
    assert out.rstrip().endswith("MemoryError")


def test_python_has_no_network():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    server.settimeout(0.5)
    port = server.getsockname()[1]
    try:
        out = run_python(f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)\n"
                         "print('connected')")
        assert "PermissionError: network access is disabled" in out and "connected" not in out
        assert "PermissionError" in run_python("import urllib.request\nurllib.request.urlopen('http://example.com')")
        with pytest.raises(socket.timeout):
            server.accept()  # nothing reached the listening socket
    finally:
        server.close()


@pytest.mark.skipif(not _unshare_works(), reason="needs unshare -rn (Linux user namespaces)")
def test_network_namespace_holds_where_the_audit_hook_is_bypassed():
    # ctypes calls libc's connect directly, past the audit hook: only the empty network namespace stops it.
    code = ("import ctypes, socket, struct\nlibc = ctypes.CDLL(None, use_errno=True)\nfd = libc.socket(2, 1, 0)\n"
            "addr = struct.pack('=H', 2) + struct.pack('!H', 9) + socket.inet_aton('127.0.0.1') + bytes(8)\n"
            "print('rc', libc.connect(fd, addr, 16), 'errno', ctypes.get_errno())")
    out = run_python(code).split()
    assert out[:2] == ["rc", "-1"] and int(out[3]) == 101  # ENETUNREACH: loopback is down in the namespace


def test_python_writes_only_inside_its_directory(tmp_path):
    outside = tmp_path / "outside.txt"
    keep = tmp_path / "keep.txt"
    keep.write_text("keep")
    for code in (f"open({str(outside)!r}, 'w').write('x')",
                 f"import pathlib; pathlib.Path({str(outside)!r}).write_text('x')",
                 "open('../escape.txt', 'w').write('x')", f"import os; os.remove({str(keep)!r})",
                 f"import os; os.rename({str(keep)!r}, 'stolen.txt')",
                 f"import os; fd = os.open({str(outside)!r}, os.O_WRONLY | os.O_CREAT)",
                 f"import os; os.symlink({str(keep)!r}, 'link'); open('link', 'w').write('x')",
                 "import subprocess; subprocess.run(['touch', '/tmp/x'])", "import os; os.system('true')"):
        out = run_python(code)
        assert "PermissionError" in out, (code, out)
    assert not outside.exists() and keep.read_text() == "keep"
    inside = ("import os, tempfile\nopen('a.txt', 'w').write('data')\nos.mkdir('d')\nos.rename('a.txt', 'd/b.txt')\n"
              "with tempfile.NamedTemporaryFile('w', delete=False) as f:\n    f.write('t')\n"
              "print(open('d/b.txt').read(), os.path.exists(f.name))")
    assert run_python(inside) == "data True\n"
    assert "PermissionError" not in run_python(f"print(len(open({str(keep)!r}).read()))")  # reading is fine


def test_python_cannot_signal_other_processes():
    out = run_python(f"import os\nos.kill({os.getpid()}, 0)")  # signal 0 only probes: harmless if it got through
    assert "PermissionError: signals to other processes are disabled" in out
