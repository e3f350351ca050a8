"""The README and docs/ say what the code does: .ci/run runs the README's test command verbatim; every
`mlx-grpo` command in README.md and docs/*.md parses, with keys and files that exist; the settings table
names real fields with their real defaults; links resolve. tests/test_docs_commands.py runs the commands."""

import json
import re
import shlex
from pathlib import Path

import pytest

from mlx_grpo.commands.cli import DESCRIPTIONS, build_parser
from mlx_grpo.config import DEFAULT_MODEL, build_config, command_default, fields_for, parse_set

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
# Examples of the built-in data sets: the arith generator's train size, GSM8K's train split.
DATA_SIZES = {"arith": 1000, "gsm8k": 7473, "shapes": 1000}
# Files the reader brings (their own data, prompts, a GGUF download) or that a doc's earlier step writes
# (hosts.json is written by mlx.distributed_config).
USER_FILES = {"train.jsonl", "test.jsonl", "d.jsonl", "prompts.jsonl", "pictures.jsonl", "model.Q4_1.gguf",
              "hosts.json", "~/.cache/nanochat/chatsft_checkpoints/d20", "nanochat-d32"}


def test_ci_runs_the_readme_test_command():
    ci_lines = [line for line in (ROOT / ".ci/run").read_text().splitlines()
                if line.strip() and not line.startswith(("#", "set ", "cd "))]
    assert len(ci_lines) == 1
    assert ci_lines[0] in README.read_text()


def test_readme_main_command_uses_an_existing_config():
    readme = README.read_text()
    assert "bash scripts/setup.sh && .venv/bin/mlx-grpo train --config configs/smoke_test.toml" in readme
    assert (ROOT / "configs/smoke_test.toml").is_file()


def test_readme_fits_on_a_page():
    assert len(README.read_text()) <= 12_000


def commands(page: Path, inline: bool = True) -> list[list[str]]:
    """The argv after `mlx-grpo` (or `-m mlx_grpo`) of each command in the page's shell blocks and (with
    `inline`) inline code, which may be part of a command; output lines (`mlx-grpo train: error: ...`) and
    placeholders (`<command>`) are not commands."""
    text = page.read_text()
    lines = [line for block in re.findall(r"```(?:bash|sh)\n(.*?)```", text, re.S)
             for line in block.replace("\\\n", " ").splitlines()]
    spans = re.findall(r"`((?:\.venv/bin/)?mlx-grpo [^`<]+)`", text) if inline else []
    lines += [span for span in spans if len(span.split()) > 2]  # `mlx-grpo plot` alone names the command
    out = []
    for line in lines:
        tokens = shlex.split(line, comments=True)
        for i, tok in enumerate(tokens):
            start = i + 1 if tok.endswith("mlx-grpo") else i + 2 if tokens[i:i + 2] == ["-m", "mlx_grpo"] else None
            if start is None or start >= len(tokens) or tokens[start] not in DESCRIPTIONS:
                continue
            argv = []
            for arg in tokens[start:]:
                if arg in ("&&", "|", ";", "||"):
                    break
                optional = arg.startswith("[-") and arg.endswith("]")  # `[--dequantize]`: an optional flag
                argv.append(arg[1:-1] if optional else arg)
            out.append(argv)
    return out


ALL = [(page.relative_to(ROOT).as_posix(), argv) for page in PAGES for argv in commands(page)]


def test_the_pages_have_commands():
    pages = {page for page, _ in ALL}
    assert {"README.md", "docs/training.md", "docs/models.md", "docs/distributed.md", "docs/nanochat.md",
            "docs/tools-and-environments.md"} <= pages, pages


def overrides(args) -> list[tuple[str, str]]:
    """A parsed command's settings: its config flags, then its --set items (later ones win)."""
    flags = [(k[len("field__"):], v) for k, v in vars(args).items() if k.startswith("field__") and v is not None]
    return flags + parse_set(getattr(args, "set_items", None) or [])


def _config(argv: list[str], monkeypatch):
    """Parse as the CLI does; resolve and validate the config of a config-taking command (in the repo root)."""
    if "--help" in argv:
        return None, None
    args = build_parser().parse_args(argv)
    if not fields_for(args.command):
        return args, None
    monkeypatch.chdir(ROOT)
    # learning.md's `$D/train.jsonl` stays as written: paths are checked below
    return args, build_config(args.command, args.config, overrides(args))


@pytest.mark.parametrize("page, argv", ALL, ids=[f"{p}:{' '.join(a)[:60]}" for p, a in ALL])
def test_every_command_parses_with_keys_that_exist(page, argv, monkeypatch):
    _config(argv, monkeypatch)  # argparse exits on an unknown flag; build_config raises on a bad key or value


def preset_runs() -> dict[str, set[int]]:
    """The run directory of each preset, and of each documented train/sft command that names its own, and the
    checkpoints it writes: every save_steps updates and the last."""
    configs = [build_config("train", str(preset)) for preset in sorted((ROOT / "configs").glob("*.toml"))]
    for _, argv in ALL:
        if argv[0] in ("train", "sft") and "--help" not in argv:
            args = build_parser().parse_args(argv)
            configs.append(build_config(argv[0], args.config and str(ROOT / args.config), overrides(args)))
    runs = {}
    for cfg in configs:
        n = DATA_SIZES.get(cfg.data.dataset) if not cfg.data.dataset_path else None
        if n is None:
            continue
        n = min(n, cfg.data.max_train_samples or n)
        total = ((n // cfg.training.batch_size * cfg.training.num_epochs) // cfg.training.gradient_accumulation_steps
                 * cfg.objective.num_iterations)
        saved = {u for u in range(1, total + 1) if cfg.run.save_steps and u % cfg.run.save_steps == 0} | {total}
        runs.setdefault(f"{cfg.run.output_dir}/{cfg.run.run_name}", saved)  # a preset's own schedule first
    return runs


def named_paths(argv: list[str], monkeypatch) -> list[str]:
    args, cfg = _config(argv, monkeypatch)
    if args is None:
        return []
    paths = [getattr(args, name, None) for name in ("checkpoint", "prompts_file", "gguf", "nanochat", "run_dir")]
    resume = getattr(args, "resume", None)
    paths.append(None if resume in (None, "latest") else resume)
    if cfg is not None:
        paths += [cfg.model.model_name, cfg.data.eval_dataset_path, cfg.data.dataset_path]
        paths += [spec.rpartition(":")[0] for spec in cfg.rollout.tools if ".py:" in spec]
        paths += [cfg.rollout.environment.rpartition(":")[0]] if cfg.rollout.environment else []
        if cfg.data.dataset not in DATA_SIZES and "/" not in cfg.data.dataset.strip("/"):
            paths.append(cfg.data.dataset)
    return [p for p in paths if p]


def produced_by_docs() -> set[str]:
    """Directories that a documented convert/fuse command writes (`--output-dir`)."""
    out = set()
    for _, argv in ALL:
        if argv[0] in ("convert", "fuse") and "--output-dir" in argv:
            out.add(argv[argv.index("--output-dir") + 1])
    return out


def test_the_paths_commands_name_exist_or_are_written_by_a_documented_step(monkeypatch):
    runs, produced, unknown = preset_runs(), produced_by_docs(), []
    for page, argv in ALL:
        for path in named_paths(argv, monkeypatch):
            match = re.match(r"(runs/[^/]+)(?:/checkpoint-(\d+))?/?$", path)
            if match and match[1] in runs:
                if match[2] is not None and int(match[2]) not in runs[match[1]]:
                    unknown.append(f"{page}: {path} (the preset writes checkpoints {sorted(runs[match[1]])[-3:]})")
                continue
            if ((ROOT / path).exists() or path in USER_FILES or path in produced or path == DEFAULT_MODEL
                    or "$" in path or path.startswith(("/tmp/", "out/"))):
                continue
            if re.fullmatch(r"[\w.-]+/[\w.-]+", path) and not path.startswith(("runs/", "models/")):
                continue  # a hub id
            unknown.append(f"{page}: {path}")
    assert not unknown, unknown


def test_settings_table_names_real_fields_with_their_defaults():
    text = README.read_text()
    section = text[text.index("## The settings people change first"):]
    section = section[:section.index("\n## ", 1)]
    rows = re.findall(r"^\| `(\w+)` \| `([^`]*)` \|", section, re.M)
    assert len(rows) >= 10
    for key, default in rows:
        assert key in fields_for("train"), key  # KeyError-free: a renamed field fails here
        value = command_default("train", key)
        assert default == (json.dumps(value) if isinstance(value, list) else str(value)), key


def test_links_resolve():
    missing = []
    for page in PAGES:
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            if target.startswith(("http://", "https://", "#")):
                continue
            path, _, anchor = target.partition("#")
            resolved = (page.parent / path).resolve()
            if not resolved.exists():
                missing.append(f"{page.name}: {target}")
            elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
                missing.append(f"{page.name}: {target} (no such heading)")
    assert not missing, missing


def anchors(page: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces as hyphens."""
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-")
            for h in re.findall(r"^#+ (.*)$", page.read_text(), re.M)}


def smoke_checkpoint() -> int:
    """The last update of README command 1's preset: the checkpoint it leaves with save_steps = 0."""
    cfg = build_config("train", str(ROOT / "configs/smoke_test.toml"))
    n = min(DATA_SIZES[cfg.data.dataset], cfg.data.max_train_samples or DATA_SIZES[cfg.data.dataset])
    return ((n // cfg.training.batch_size * cfg.training.num_epochs) // cfg.training.gradient_accumulation_steps
            * cfg.objective.num_iterations)


def test_docs_name_the_checkpoint_that_command_1_writes():
    final = smoke_checkpoint()
    named = {int(n) for page in PAGES for n in re.findall(r"runs/smoke_test/checkpoint-(\d+)", page.read_text())}
    assert named == {final}
    assert f"`checkpoint-{final}/`" in README.read_text()


def test_readme_lists_the_columns_that_are_searched():
    from mlx_grpo.config import ANSWER_COLUMNS, PROMPT_COLUMNS

    text = " ".join(README.read_text().split())
    for columns in (PROMPT_COLUMNS, ANSWER_COLUMNS):
        listed = "the first of " + ", ".join(f"`{c}`" for c in columns)
        assert listed in text, listed
