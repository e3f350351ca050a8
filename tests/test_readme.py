"""The README's set-up is what CI proves: .ci/run runs the README's test command verbatim."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_ci_runs_the_readme_test_command():
    ci_lines = [line for line in (ROOT / ".ci/run").read_text().splitlines()
                if line.strip() and not line.startswith(("#", "set ", "cd "))]
    assert len(ci_lines) == 1
    assert ci_lines[0] in (ROOT / "README.md").read_text()


def test_readme_main_command_uses_an_existing_config():
    readme = (ROOT / "README.md").read_text()
    assert "bash scripts/setup.sh && .venv/bin/mlx-grpo train --config configs/smoke_test.toml" in readme
    assert (ROOT / "configs/smoke_test.toml").is_file()
