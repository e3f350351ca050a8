"""The test tiers (tests/tiers.py, DEVELOPERS.md "Tests in tiers"): read off a test's code, they catch what they
are for and the entry points they look for exist; every collected test gets one, and pyproject.toml registers
each (--strict-markers)."""

import ast
import importlib
import textwrap
import tomllib
from pathlib import Path

from tiers import CLI_MAIN, RUN_CALLS, TIERS, ModuleCode, derive

ROOT = Path(__file__).resolve().parents[1]

SOURCE = textwrap.dedent('''
    import subprocess
    from mlx_grpo.commands import train as run_mod
    from mlx_grpo.commands.cli import main
    from conftest import started
    from test_other import launch

    ROOT = None

    def spawn():
        return subprocess.run(["true"])

    class Workdir:
        def go(self):
            return spawn()

    def test_pure():
        assert 1 + 1 == 2

    def test_trains(cfg):
        run_mod.train(cfg)

    def test_sft_function():
        from mlx_grpo.commands.sft import run_sft as go
        go(None)

    def test_through_a_helper():
        spawn()

    def test_through_a_class(workdir):
        workdir.go()

    def test_cli_train():
        main(["train", "--config", "x.toml"])

    def test_cli_generate():
        main(["generate", "--prompt", "hi"])

    def test_bench_script():
        subprocess.run([str(ROOT / "bench" / "grpo_bench.py")])

    def test_conftest_helper():
        started()

    def test_fixture(trained):
        pass

    def test_another_files_helper():
        launch(2)

    def workdir():
        return Workdir()
''')
HELPERS = textwrap.dedent('''
    from mlx_grpo.commands.train import train

    def started():
        return 1

    def trained(tiny_model_dir):
        return train(None)
''')
OTHER = "import subprocess\n\ndef launch(n):\n    return subprocess.run(['mlx.launch', '-n', str(n)])\n"


def test_the_tiers_catch_what_they_are_for():
    code, helpers, other = ModuleCode(SOURCE), ModuleCode(HELPERS), ModuleCode(OTHER)
    tier = {name: derive(code, [node], [n for n in ("workdir", "trained") if n in ast.unparse(node)], helpers,
                         lambda module: other if module == "test_other" else None)
            for name, node in code.functions.items() if name.startswith("test_")}
    assert tier == {"test_pure": "fast", "test_trains": "run", "test_sft_function": "run",
                    "test_through_a_helper": "run", "test_through_a_class": "run", "test_cli_train": "run",
                    "test_cli_generate": "fast", "test_bench_script": "bench", "test_conftest_helper": "fast",
                    "test_fixture": "run", "test_another_files_helper": "run"}


def test_the_run_entry_points_exist():
    """A renamed entry point would leave its runs in the fast tier: each name the rule looks for exists."""
    for dotted in sorted(RUN_CALLS | {CLI_MAIN}):
        module, _, name = dotted.rpartition(".")
        assert hasattr(importlib.import_module(module), name), dotted


def test_every_test_gets_a_tier(request):
    assert [m.name for m in request.node.iter_markers() if m.name in TIERS] == ["fast"]  # this one, read off its code


def test_the_tiers_are_registered():
    markers = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]["markers"]
    assert {m.split(":")[0] for m in markers} >= set(TIERS)
