"""The source layout's rules (DEVELOPERS.md), read from src/ with `ast`, without importing it: imports go one
way (no cycle between mlx_grpo modules, no two folders importing each other, and no import from a lower layer to a
higher one: LAYERS; imports inside functions included), no module imports another's private (_name) names, and no
module is over MAX_LINES lines."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = "mlx_grpo"
MAX_LINES = 420  # the standard says "under ~400": 420 leaves room for a docstring line or two

# Each exemption names why it exists and who removes it; an exemption that no longer applies fails the test.
LONG_MODULES: dict[str, str] = {}
CYCLE_EDGES: dict[tuple[str, str], str] = {}  # (importer, imported): an import edge left out of the cycle check


# The layers, lowest first (DEVELOPERS.md "Layers"): a module imports its own layer and those below, never one
# above. A module takes the layer of its name here, else of its folder; a new flat module must be placed.
LAYERS = ("base", "config", "models", "stages", "training", "commands")
LAYER_OF = {
    # base: errors, platform set-up, console lines and pure math, importing nothing of the project above them
    "": "base", "base": "base", "loss": "base",
    "config": "config",
    # models: loading, converting and running the networks (vlm/: the vision-language ones; kernels/: the CUDA
    # kernels and their MLX references, which the networks' decode steps and the sampler call)
    "models": "models", "vlm": "models", "kernels": "models",
    # stages: what an update's stages need, and the data they read: rollouts, tools, rewards, examples, storage
    "tools": "stages", "rewards": "stages", "rollout": "stages", "data": "stages", "storage": "stages",
    "vlm.image_rollout": "stages",
    # training: the update, its state and logs (GRPO and SFT)
    "training": "training", "sft": "training", "reporting": "training", "vlm.image_prompts": "training",
    # commands: what the CLI runs, and the assembly of a run from a Config
    "commands": "commands", "__main__": "commands",
}

# Module file names shared by two or more modules (__init__.py, __main__.py aside), each with why no clearer name
# exists; a name no longer shared fails the test.
SHARED_BASENAMES: dict[str, str] = {}


def layer(name: str) -> int | None:
    """The layer index of module mlx_grpo.<name>: its own entry, else its folder's; None if unplaced."""
    rel = name.removeprefix(PACKAGE).lstrip(".")
    found = LAYER_OF.get(rel, LAYER_OF.get(rel.split(".")[0]))
    return None if found is None else LAYERS.index(found)


def modules(src: Path = SRC) -> dict[str, Path]:
    out = {}
    for path in sorted((src / PACKAGE).rglob("*.py")):
        parts = path.relative_to(src).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def imports(name: str, path: Path, known: dict[str, Path]) -> list[tuple[str, list[str], int]]:
    """(imported module, names taken from it, line) for every mlx_grpo import anywhere in the module."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [(a.name, [], node.lineno) for a in node.names if a.name.split(".")[0] == PACKAGE]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against this module's package
                parent = package.split(".")
                parent = parent[:len(parent) - node.level + 1]
                base = ".".join(parent + ([node.module] if node.module else []))
            if base.split(".")[0] != PACKAGE:
                continue
            for a in node.names:  # `from pkg import module` imports the module itself
                full = f"{base}.{a.name}"
                out.append((full, [], node.lineno) if full in known else (base, [a.name], node.lineno))
    return out


def graph(src: Path = SRC) -> dict[str, set[str]]:
    known = modules(src)
    edges = {name: set() for name in known}
    for name, path in known.items():
        for target, _, _ in imports(name, path, known):
            if target in known and target != name and (name, target) not in CYCLE_EDGES:
                edges[name].add(target)
    return edges


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One import cycle (a list of modules, the first repeated at the end), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(edges[node]):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(edges):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_no_import_cycles_not_even_inside_functions():
    cycle = find_cycle(graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def fake_package(root: Path, files: dict[str, str]) -> None:
    """A package mlx_grpo under root for the rules' own tests: files {path inside it: text}, each folder with an
    empty __init__.py."""
    pkg = root / PACKAGE
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    for rel, text in files.items():
        path = pkg / rel
        for parent in reversed(list(path.relative_to(pkg).parents)[:-1]):  # outermost first
            (pkg / parent).mkdir(exist_ok=True)
            (pkg / parent / "__init__.py").touch()
        path.write_text(text)


def folder(name: str, known: dict[str, Path]) -> str:
    """The package folder a module lives in (mlx_grpo.training.trainer -> training), or a flat module's own name."""
    parts = name.split(".")
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and known[name].name == "__init__.py") else name


def folder_graph(src: Path = SRC) -> dict[str, set[str]]:
    """Imports between folders (exempt module cycles included): a folder may import another only one way."""
    known = modules(src)
    edges = {folder(name, known): set() for name in known}
    for name, path in known.items():
        for target, _, _ in imports(name, path, known):
            if target in known and folder(target, known) != folder(name, known):
                edges[folder(name, known)].add(folder(target, known))
    return edges


def test_no_import_loop_between_folders():
    cycle = find_cycle(folder_graph())
    assert cycle is None, "folders importing each other: " + " -> ".join(cycle)


def test_the_folder_rule_catches_a_loop(tmp_path):
    fake_package(tmp_path, {"x/a.py": "from mlx_grpo.y.b import f\n", "y/b.py": "def f():\n    return 1\n",
                            "y/c.py": "from mlx_grpo.x import a\n"})  # no module cycle, a folder loop
    assert find_cycle(graph(tmp_path)) is None
    assert find_cycle(folder_graph(tmp_path)) == ["x", "y", "x"]


def upward_imports(src: Path = SRC) -> list[str]:
    """Every import of a module in a higher layer than the importer's, as 'importer (layer) -> imported (layer)'."""
    known = modules(src)
    found = []
    for name, path in known.items():
        for target, _, line in imports(name, path, known):
            if target in known and target != name and layer(target) > layer(name):
                found.append(f"{path.relative_to(src)}:{line}: {name} ({LAYERS[layer(name)]}) -> {target} "
                             f"({LAYERS[layer(target)]})")
    return found


def test_every_module_has_a_layer():
    unplaced = [name for name in modules() if layer(name) is None]
    assert not unplaced, f"modules without a layer: {', '.join(unplaced)}: place them in LAYER_OF (DEVELOPERS.md)"


def test_imports_never_go_up_a_layer():
    found = upward_imports()
    assert not found, "imports from a lower layer to a higher one:\n" + "\n".join(found)


def test_the_layer_rule_catches_an_import_up(tmp_path):
    """The update (training) importing a command, inside a function: caught; the other way round: allowed."""
    fake_package(tmp_path, {"commands/train.py": "from mlx_grpo.training import step\n",
                            "training/step.py": "def f():\n    from mlx_grpo.commands import train\n"})
    assert upward_imports(tmp_path) == ["mlx_grpo/training/step.py:2: mlx_grpo.training.step (training) -> "
                                        "mlx_grpo.commands.train (commands)"]


def test_the_cycle_exemptions_are_still_needed():
    known = modules()
    for importer, imported in CYCLE_EDGES:
        targets = {t for t, _, _ in imports(importer, known[importer], known)}
        assert imported in targets, f"{importer} no longer imports {imported}: drop the exemption from CYCLE_EDGES"


def private_uses(src: Path = SRC) -> list[str]:
    """`from mlx_grpo.x import _name` in another module, or `x._name` through a module alias."""
    known = modules(src)
    found = []
    for name, path in known.items():
        for target, names, line in imports(name, path, known):
            found += [f"{path.relative_to(src)}:{line}: {target}.{n}" for n in names
                      if n.startswith("_") and not n.startswith("__") and target != name]
        tree = ast.parse(path.read_text())
        aliases = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == PACKAGE:
                aliases.update({a.asname or a.name: f"{node.module}.{a.name}" for a in node.names
                                if f"{node.module}.{a.name}" in known})
            elif isinstance(node, ast.Import):
                aliases.update({a.asname: a.name for a in node.names if a.asname and a.name in known})
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases \
                    and node.attr.startswith("_") and not node.attr.startswith("__"):
                found.append(f"{path.relative_to(src)}:{node.lineno}: {aliases[node.value.id]}.{node.attr}")
    return found


def test_no_module_imports_private_names_of_another():
    found = private_uses()
    assert not found, "private names used across modules:\n" + "\n".join(found)


def test_the_checks_catch_what_they_are_for(tmp_path):
    """A circle closed by an import inside a function, and private names taken from another module."""
    fake_package(tmp_path, {"a.py": "from mlx_grpo.sub.b import helper\n_secret = 1\n",
                            "sub/b.py": "def helper():\n    from mlx_grpo import a\n    return a._secret\n",
                            "c.py": "from mlx_grpo.a import _secret\n"})
    pkg = tmp_path / PACKAGE
    assert find_cycle(graph(tmp_path)) == ["mlx_grpo.a", "mlx_grpo.sub.b", "mlx_grpo.a"]
    assert sorted(private_uses(tmp_path)) == ["mlx_grpo/c.py:1: mlx_grpo.a._secret",
                                              "mlx_grpo/sub/b.py:3: mlx_grpo.a._secret"]
    (pkg / "sub" / "b.py").write_text("def helper():\n    return 1\n")
    assert find_cycle(graph(tmp_path)) is None


def test_modules_are_short():
    long = {name: len(path.read_text().splitlines()) for name, path in modules().items()}
    long = {name: n for name, n in long.items() if n > MAX_LINES}
    assert set(long) <= set(LONG_MODULES), f"modules over {MAX_LINES} lines: " + ", ".join(
        f"{name} ({n})" for name, n in sorted(long.items()) if name not in LONG_MODULES)
    stale = set(LONG_MODULES) - set(long)
    assert not stale, f"{', '.join(sorted(stale))} no longer over {MAX_LINES} lines: drop it from LONG_MODULES"


def shared_basenames(src: Path = SRC) -> dict[str, list[str]]:
    """Module file names (__init__.py, __main__.py aside) that more than one module has: name -> the modules."""
    found: dict[str, list[str]] = {}
    for name, path in modules(src).items():
        if path.name not in ("__init__.py", "__main__.py"):
            found.setdefault(path.name, []).append(name)
    return {base: names for base, names in found.items() if len(names) > 1}


def test_no_two_modules_share_a_basename():
    """A file name says what its module owns: two `loading.py`s make a reader (and a traceback) ask which one."""
    shared = shared_basenames()
    unexplained = {base: names for base, names in shared.items() if base not in SHARED_BASENAMES}
    assert not unexplained, "modules sharing a file name (rename one, or say why in SHARED_BASENAMES): " + \
        "; ".join(f"{base}: {', '.join(names)}" for base, names in sorted(unexplained.items()))
    stale = set(SHARED_BASENAMES) - set(shared)
    assert not stale, f"{', '.join(sorted(stale))} no longer shared: drop it from SHARED_BASENAMES"


def test_the_basename_rule_catches_a_shared_name(tmp_path):
    fake_package(tmp_path, {"models/loading.py": "", "rewards/loading.py": "", "__main__.py": "",
                            "models/forward.py": ""})
    assert shared_basenames(tmp_path) == {"loading.py": ["mlx_grpo.models.loading", "mlx_grpo.rewards.loading"]}
