"""The test tiers (DEVELOPERS.md, "Tests in tiers"), read off each test's code so that no list of tests or files
needs editing when tests are added: tests/conftest.py marks every collected test with the tier this returns.

A test's code is its own function, the module-level functions and classes that it names from its file or from
another file of tests/ (conftest.py, test_distributed.py's helpers, ...), those they name in turn, and the fixtures
it requests that its file or conftest.py defines. A test marked by hand (`@pytest.mark.run`,
or a module's `pytestmark`) keeps its mark; otherwise it is
  bench  when that code names a script under bench/ (a "bench" path part);
  run    when it starts a whole run or another process: mlx_grpo.commands.train.train,
         mlx_grpo.commands.sft.run_sft, the CLI's main(["train" | "sft", ...]), the rollout worker
         (RolloutProcess) or anything from subprocess / multiprocessing;
  fast   otherwise: pure functions and tiny models in this process.
`gpu` is only ever marked by hand (tests that need a CUDA device)."""

from __future__ import annotations

import ast
from functools import lru_cache
from pathlib import Path

TIERS = ("fast", "run", "bench", "gpu")
RUN_CALLS = {"mlx_grpo.commands.train.train", "mlx_grpo.commands.sft.run_sft",
             "mlx_grpo.rollout.process.RolloutProcess"}
RUN_COMMANDS = {"train", "sft"}
CLI_MAIN = "mlx_grpo.commands.cli.main"
PROCESS_MODULES = {"subprocess", "multiprocessing"}


class ModuleCode:
    """One file's module-level functions and classes (and methods by class) and what its imports name."""

    def __init__(self, source: str):
        tree = ast.parse(source)
        self.functions: dict[str, ast.AST] = {}
        self.methods: dict[tuple[str, str], ast.AST] = {}
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                self.functions[node.name] = node
            elif isinstance(node, ast.ClassDef):
                self.functions[node.name] = node
                self.methods.update({(node.name, f.name): f for f in node.body
                                     if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))})
        self.aliases: dict[str, str] = {}  # imports anywhere in the file, function-level ones included
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                self.aliases.update({a.asname or a.name.split(".")[0]: a.name if a.asname else a.name.split(".")[0]
                                     for a in node.names})
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                self.aliases.update({a.asname or a.name: f"{node.module}.{a.name}" for a in node.names})

    def dotted(self, node: ast.AST) -> str | None:
        """`run_mod.train` -> "mlx_grpo.commands.train.train" through the file's imports; None for anything else."""
        parts = []
        while isinstance(node, ast.Attribute):
            parts.append(node.attr)
            node = node.value
        if not isinstance(node, ast.Name) or node.id not in self.aliases:
            return None
        return ".".join([self.aliases[node.id], *reversed(parts)])


@lru_cache(maxsize=None)
def module_code(path: str) -> ModuleCode:
    return ModuleCode(Path(path).read_text())


def names_bench(value: str) -> bool:
    return value == "bench" or value.startswith("bench/") or "/bench/" in value


def derive(code: ModuleCode, start: list[ast.AST], fixtures: list[str] = (), helpers: ModuleCode | None = None,
           sibling=lambda module: None) -> str:
    """The tier of the code reachable from `start` (a test's function node) and the fixtures it requests (defined
    in `code`'s file or in `helpers`, conftest.py); sibling(name) -> the ModuleCode of tests/<name>.py or None."""
    queue = [(code, node) for node in start]
    queue += [(where, where.functions[name]) for name in fixtures
              for where in (code, helpers) if where is not None and name in where.functions]
    seen, tier = set(), "fast"
    while queue:
        where, root = queue.pop()
        if id(root) in seen:
            continue
        seen.add(id(root))
        for node in ast.walk(root):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and names_bench(node.value):
                return "bench"
            if isinstance(node, ast.Call) and where.dotted(node.func) == CLI_MAIN and node.args:
                argv = node.args[0]
                if isinstance(argv, (ast.List, ast.Tuple)) and argv.elts and isinstance(argv.elts[0], ast.Constant) \
                        and argv.elts[0].value in RUN_COMMANDS:
                    tier = "run"
            if isinstance(node, (ast.Name, ast.Attribute)):
                name = where.dotted(node)
                if name and (name in RUN_CALLS or name.split(".")[0] in PROCESS_MODULES):
                    tier = "run"
                if isinstance(node, ast.Name):
                    if node.id in where.functions:  # a helper (function or class) of the same file
                        queue.append((where, where.functions[node.id]))
                    elif name and name.count(".") == 1:  # `from test_distributed import launch`
                        module, _, function = name.partition(".")
                        other = helpers if module == "conftest" and helpers is not None else sibling(module)
                        if other is not None and function in other.functions:
                            queue.append((other, other.functions[function]))
    return tier


def tier_of(item, conftest_path: str) -> str:
    """A collected pytest item's derived tier (see the module docstring)."""
    code = module_code(str(item.path))
    cls = getattr(item, "cls", None)
    name = getattr(item, "originalname", item.name)
    node = code.methods.get((cls.__name__, name)) if cls is not None else code.functions.get(name)
    if node is None:  # generated or imported tests: the tier of nothing we can read
        return "fast"
    helpers = module_code(conftest_path) if str(item.path) != conftest_path else None

    def sibling(module: str) -> ModuleCode | None:
        path = Path(item.path).parent / f"{module}.py"
        return module_code(str(path)) if path.is_file() else None

    return derive(code, [node], getattr(item, "fixturenames", ()), helpers, sibling)
