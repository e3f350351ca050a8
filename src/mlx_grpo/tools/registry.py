"""Tools a model can call during a rollout: the `Tool` record, the built-ins and running a call.

Owns: `Tool` (name, description, JSON schema of the parameters, the callable), built from a plain
function with type hints and a Google-style docstring (the schema comes from transformers'
`get_json_schema`, the one chat templates expect); `resolve_tool`, which turns "calculator",
"python", "module:function" or "path/to/file.py:function" into a Tool; `run_tool`, which never
raises: a bad argument or a failing tool comes back as text for the model ("Error: ..."), cut to a
length cap. The two built-ins: `calculate` (safe arithmetic through `ast`, never `eval`) and
`run_python` (code in a fresh `python -I` subprocess with time, memory and output limits, no network
and no file writes outside its temporary directory).

It does not own the call syntax in generated text (tool_calls.py) nor the episode loop
(environments.py).
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from decimal import Decimal
from functools import cache
from pathlib import Path

from mlx_grpo.errors import UserError

MAX_OUTPUT_CHARS = 2000  # what run_tool returns at most: tool output is context the model must read


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: dict  # JSON schema of the arguments: {"type": "object", "properties": ..., "required": ...}
    fn: Callable[..., object]

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


# ---------------------------------------------------------------- calculator

MAX_MAGNITUDE = 10**300  # any intermediate value past this is refused (float overflows near 1.8e308)
MAX_EXPRESSION_CHARS = 1000  # bounds the parse tree, hence the evaluator's recursion
_BINARY = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b,
           ast.Div: lambda a, b: a / b, ast.FloorDiv: lambda a, b: a // b, ast.Mod: lambda a, b: a % b}
_UNARY = {ast.UAdd: lambda a: +a, ast.USub: lambda a: -a}
_CONSTANTS = {"pi": math.pi, "e": math.e}


def _factorial(n: int) -> int:
    if not isinstance(n, int) or n > 170:
        raise ValueError("factorial takes an integer up to 170")
    return math.factorial(n)


_FUNCTIONS = {"sqrt": math.sqrt, "exp": math.exp, "log": math.log, "log2": math.log2, "log10": math.log10,
              "sin": math.sin, "cos": math.cos, "tan": math.tan, "asin": math.asin, "acos": math.acos,
              "atan": math.atan, "floor": math.floor, "ceil": math.ceil, "abs": abs, "round": round,
              "min": min, "max": max, "factorial": _factorial}


def _power(base: int | float, exp: int | float) -> int | float:
    # Bound the size before computing: 10**10**9 would take minutes and gigabytes as an int.
    if base != 0 and exp * math.log10(abs(base)) > 300:
        raise OverflowError("the power is too large")
    return base**exp


def _evaluate(node: ast.AST) -> int | float:
    if isinstance(node, ast.Expression):
        return _evaluate(node.body)
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        value = node.value
    elif isinstance(node, ast.BinOp) and (type(node.op) in _BINARY or isinstance(node.op, ast.Pow)):
        left, right = _evaluate(node.left), _evaluate(node.right)
        value = _power(left, right) if isinstance(node.op, ast.Pow) else _BINARY[type(node.op)](left, right)
    elif isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        value = _UNARY[type(node.op)](_evaluate(node.operand))
    elif isinstance(node, ast.Name) and node.id in _CONSTANTS:
        value = _CONSTANTS[node.id]
    elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _FUNCTIONS
          and not node.keywords):
        value = _FUNCTIONS[node.func.id](*[_evaluate(arg) for arg in node.args])
    elif isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitXor):
        raise ValueError("^ is not supported: write ** for a power")
    else:
        raise ValueError(f"unsupported expression: {ast.unparse(node)[:60]}")
    if isinstance(value, complex) or not math.isfinite(value) or abs(value) > MAX_MAGNITUDE:
        raise OverflowError("the result is too large or not a real number")
    return value


def format_number(value: int | float) -> str:
    """Integers without ".0", floats to 12 significant digits in plain decimal notation where that is
    short (0.1 + 0.2 -> "0.3", 1e-7 -> "0.0000001", 2/3 -> "0.666666666667")."""
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e21:
        value = int(value)
    if isinstance(value, int):
        return str(value)
    short = f"{value:.12g}"
    if 1e-10 <= abs(value) < 1e21:
        return format(Decimal(short), "f")
    return short


def calculate(expression: str) -> str:
    """Evaluate an arithmetic expression: numbers, + - * / // % **, parentheses, pi, e, and
    sqrt exp log log2 log10 sin cos tan asin acos atan floor ceil abs round min max factorial.

    Args:
        expression: The expression to evaluate, for example "(3 + 4.5) * 2 / sqrt(16)".
    """
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ValueError(f"the expression is longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as e:
        raise ValueError(f"not an arithmetic expression: {e.msg}") from None
    return format_number(_evaluate(tree))


# ---------------------------------------------------------------- python

# Runs in the child before the user's code: resource limits, then an audit hook (PEP 578) refusing
# network, program starts, signals outside the process group, and file writes outside the working
# directory. The limits are set here and not in preexec_fn, which is unsafe when the parent has threads
# (the decode loop runs tools from worker threads).
_BOOTSTRAP = r"""
import ast, os, resource, sys, traceback
ROOT = os.path.realpath(os.getcwd())
for limit, value in zip((resource.RLIMIT_AS, resource.RLIMIT_CPU, resource.RLIMIT_FSIZE), map(int, sys.argv[1:4])):
    try:
        resource.setrlimit(limit, (value, value))
    except (ValueError, OSError):
        pass  # macOS refuses some RLIMIT_AS values: the wall-time limit still holds
WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC
PATH_EVENTS = {"os.remove": (0,), "os.rmdir": (0,), "os.mkdir": (0,), "os.rename": (0, 1), "os.link": (0, 1),
               "os.symlink": (1,), "os.truncate": (0,), "os.chmod": (0,), "os.chown": (0,), "os.utime": (0,),
               "os.chflags": (0,), "os.setxattr": (0,), "os.removexattr": (0,), "os.mkfifo": (0,),
               "os.mknod": (0,), "shutil.rmtree": (0,), "shutil.copyfile": (1,), "shutil.copymode": (1,),
               "shutil.copystat": (1,), "shutil.move": (0, 1), "shutil.chown": (0,),
               "shutil.unpack_archive": (1,), "sqlite3.connect": (0,)}
NET_EVENTS = {"socket.connect", "socket.bind", "socket.sendto", "socket.sendmsg", "socket.getaddrinfo",
              "socket.gethostbyname", "socket.gethostbyaddr", "socket.getnameinfo"}
EXEC_EVENTS = {"os.exec", "os.posix_spawn", "os.spawn", "os.system", "subprocess.Popen", "os.startfile"}

def inside(path):
    if isinstance(path, int) or path is None:
        return True  # an fd already open, or an argument that names no path
    real = os.path.realpath(os.fsdecode(path))
    return real == ROOT or real.startswith(ROOT + os.sep) or real == os.devnull

def hook(event, args):
    if event == "open":
        path, mode, flags = args
        if ((mode is not None and any(c in mode for c in "wax+")) or (flags or 0) & WRITE_FLAGS) and not inside(path):
            raise PermissionError(f"writing outside the working directory is disabled: {path}")
    elif event in PATH_EVENTS:
        for i in PATH_EVENTS[event]:
            if i < len(args) and not inside(args[i]):
                raise PermissionError(f"changing files outside the working directory is disabled: {args[i]}")
    elif event in NET_EVENTS:
        raise PermissionError("network access is disabled in the python tool")
    elif event in EXEC_EVENTS:
        raise PermissionError("starting programs is disabled in the python tool")
    elif (event == "os.kill" and args[0] not in (0, -os.getpgrp())
          and (args[0] < 0 or os.getpgid(args[0]) != os.getpgrp())):
        raise PermissionError("signals to other processes are disabled in the python tool")
    elif event == "os.killpg" and args[0] not in (0, os.getpgrp()):
        raise PermissionError("signals to other processes are disabled in the python tool")

sys.dont_write_bytecode = True
with open("main.py") as f:
    source = f.read()
sys.addaudithook(hook)
scope = {"__name__": "__main__", "__builtins__": __builtins__}
try:
    tree = ast.parse(source, "main.py")
    # Like a notebook cell: a final bare expression is printed, so "2 ** 10" shows 1024.
    last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
    exec(compile(tree, "main.py", "exec"), scope)
    if last is not None:
        value = eval(compile(ast.Expression(last.value), "main.py", "eval"), scope)
        if value is not None:
            print(repr(value))
except SystemExit:
    raise
except BaseException as e:
    traceback.print_exception(type(e), e, e.__traceback__.tb_next)  # without this bootstrap's frame
    sys.stdout.flush()
    sys.exit(1)
"""

PYTHON_TIMEOUT_S = 10.0
PYTHON_MEMORY_MB = 1024
MAX_FILE_BYTES = 16 * 2**20  # RLIMIT_FSIZE: the output file and anything the code writes
_READ_BYTES = 64 * 1024  # output read back; run_tool cuts it further to max_chars


@cache
def _unshare_works() -> bool:
    """Whether `unshare -rn` (a new user + network namespace: no interface but a down loopback) runs
    here. Linux only; containers often forbid user namespaces."""
    exe = shutil.which("unshare")
    if sys.platform != "linux" or exe is None:
        return False
    try:
        return subprocess.run([exe, "-rn", "true"], capture_output=True, timeout=5).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


def run_python(code: str, timeout_s: float = PYTHON_TIMEOUT_S, memory_mb: int = PYTHON_MEMORY_MB) -> str:
    """Run Python code in a fresh interpreter and return what it printed (stdout and stderr), or the
    traceback. A final bare expression is printed, as in a notebook.

    What holds, and where: the wall-time limit kills the whole process group (children the code forked
    included) on every platform; the memory limit (RLIMIT_AS) holds on Linux, macOS does not enforce
    it; network: on Linux with user namespaces the code runs under `unshare -rn` (no network at all,
    for the code and anything it starts), and everywhere an audit hook refuses socket connect, bind,
    send and name lookups. Writes outside a temporary working directory, starting programs and signals
    to other processes are refused by the audit hook. This is a guard against a model's mistakes, not
    a sandbox against hostile code: ctypes, native extensions or paths relative to a directory file
    descriptor get around an audit hook. Run untrusted code in a container.

    Args:
        code: Python source code to run; use print() to show results.
    """
    cmd = [sys.executable, "-I", "-B", "-c", _BOOTSTRAP, str(memory_mb * 2**20),
           str(math.ceil(timeout_s) + 1), str(MAX_FILE_BYTES)]
    if _unshare_works():
        cmd = [shutil.which("unshare"), "-rn", *cmd]
    base = tempfile.mkdtemp(prefix="mlx-grpo-python-")
    work, output_path = os.path.join(base, "work"), os.path.join(base, "output")
    env = {"PATH": os.defpath, "HOME": work, "TMPDIR": work, "LANG": "C.UTF-8", "OMP_NUM_THREADS": "1",
           "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}  # BLAS thread pools reserve address space
    try:
        os.mkdir(work)
        with open(os.path.join(work, "main.py"), "w") as f:
            f.write(code)
        with open(output_path, "wb") as out:
            # A new session makes the child a process-group leader: one killpg reaches its forks too.
            proc = subprocess.Popen(cmd, cwd=work, env=env, stdin=subprocess.DEVNULL, stdout=out,
                                    stderr=subprocess.STDOUT, start_new_session=True)
            timed_out = False
            try:
                proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                timed_out = True
            finally:
                try:  # also after a normal exit: children it left running die with it
                    os.killpg(proc.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
                proc.wait()
        with open(output_path, "rb") as f:
            text = f.read(_READ_BYTES).decode("utf-8", errors="replace")
    finally:
        shutil.rmtree(base, ignore_errors=True)
    if timed_out:
        return f"{text.rstrip()}\nError: timed out after {timeout_s:g} s".lstrip()
    if proc.returncode < 0:  # e.g. SIGXCPU from the CPU-time limit
        name = signal.Signals(-proc.returncode).name if -proc.returncode in signal.valid_signals() else ""
        return f"{text.rstrip()}\nError: killed by signal {name or -proc.returncode}".lstrip()
    return text


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


BUILTINS: dict[str, Callable[[], Tool]] = {"calculator": lambda: tool_from_function(calculate, "calculator"),
                                           "python": python_tool}
