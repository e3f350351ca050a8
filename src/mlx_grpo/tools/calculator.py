"""The built-in "calculator" tool: arithmetic through `ast`, never `eval` (numbers, + - * / // % **, a few
math functions and constants), with bounds on the expression's length and on every intermediate value."""

from __future__ import annotations

import ast
import math
import re
from decimal import Decimal

MAX_MAGNITUDE = 10**300  # any intermediate value past this is refused (float overflows near 1.8e308)
MAX_EXPRESSION_CHARS = 1000  # bounds the parse tree, hence the evaluator's recursion
_BINARY = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b,
           ast.Div: lambda a, b: a / b, ast.FloorDiv: lambda a, b: a // b, ast.Mod: lambda a, b: a % b}
_UNARY = {ast.UAdd: lambda a: +a, ast.USub: lambda a: -a}
_CONSTANTS = {"pi": math.pi, "e": math.e}
# Number literals (ASCII digits), each matched whole (greedy). One that runs into a letter ("2or 3", "0x1for"), or a
# quote (a string's bad escape), would make Python's parser print a SyntaxWarning on the trainer's console for a
# model's bad expression, so both are refused before the parse.
_NUMBER = re.compile(r"\b(?:0[xX][0-9a-fA-F_]+|0[oO][0-7_]+|0[bB][01_]+|"
                     r"(?:[0-9][0-9_]*\.?[0-9_]*|\.[0-9][0-9_]*)(?:[eE][+-]?[0-9][0-9_]*)?[jJ]?)")


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
    if any(m.end() < len(expression) and (expression[m.end()].isalpha() or expression[m.end()] == "_")
           for m in _NUMBER.finditer(expression)):
        raise ValueError("not an arithmetic expression: a number runs into a name")
    if "'" in expression or '"' in expression:
        raise ValueError("unsupported expression: strings")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as e:
        raise ValueError(f"not an arithmetic expression: {e.msg}") from None
    return format_number(_evaluate(tree))
