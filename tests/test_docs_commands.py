"""Every command in the shell blocks of README.md and docs/*.md runs as written, in page order, each page in a
working directory of its own that starts as README command 1 leaves the checkout (as a reader following the
page would), on stand-ins for the models and data that need the network or a GPU (tests/docs_reader.py says
which). Each succeeds, or ends with the output the page shows after it: a ```text block right after the
command's block, each of whose lines is printed, `<...>` standing for a figure that depends on the model and
the machine. Python blocks compile, the ones that print print what the page shows, and a block shown as an
example file is that file. tests/test_readme.py checks that the commands parse and name paths that exist.
The commands that cannot run here are listed in EXCLUDED, each with its reason; a listed command missing
from the pages fails the test, so the list cannot go stale. docs/benchmarks-history.md is left out whole:
it records the commands of past GPU sittings as they were run."""

from __future__ import annotations

import contextlib
import io
import json
import re
import shutil
import textwrap
from pathlib import Path

import pytest

from docs_reader import (BLOCK, PAGES, ROOT, Command, Workdir, gsm8k_rows, jsonl, matches, page_commands,
                         write_default_standin)
from mlx_grpo.config import DEFAULT_MODEL
from mlx_grpo.data import examples as data_mod
from mlx_grpo.models import model_loading

EXCLUDED = {
    "bash scripts/setup.sh": "installs the packages (network); the environment running this test is its result",
    "bash scripts/setup.sh test": "the same, with the test extras",
    ".venv/bin/python -m pytest -q -n auto --dist loadfile":
        "the test suite itself (.ci/run runs it; tests/test_readme.py checks they agree)",
    ".venv/bin/mlx-grpo train --model Qwen/Qwen2.5-0.5B-Instruct --dataset AI-MO/NuminaMath-TIR --answer-column "
    "solution": "a hub data set (network; the `data` extra)",
    ".venv/bin/mlx.launch -n 2 --backend nccl -- .venv/bin/mlx-grpo train --config configs/prod.toml":
        "two NVIDIA GPUs (NCCL)",
    ".venv/bin/mlx.distributed_config --hosts mac1,mac2 --over ethernet --backend ring --output-hostfile hosts.json":
        "ssh to two Macs",
    ".venv/bin/mlx.distributed_config --hosts mac1,mac2 --over thunderbolt --backend jaccl --output-hostfile "
    "hosts.json": "two Macs joined by Thunderbolt",
    ".venv/bin/mlx.launch --hostfile hosts.json --python $PWD/.venv/bin/python --cwd $PWD -- -m mlx_grpo train "
    "--config configs/prod.toml": "the Macs of hosts.json",
    "huggingface-cli download karpathy/nanochat-d32 --local-dir nanochat-d32":
        "a hub download (network); a tiny nanochat checkpoint stands in for what it writes",
    "bash bench/learning_run.sh OUT GSM8K_DIR arith:42 arith:7 arith:1234": "GPU hours (docs/learning.md's runs)",
    "bash bench/learning_run.sh OUT GSM8K_DIR gsm8k_tools:42 tools:42 control:42": "GPU hours",
    "python bench/learning_report.py OUT": "reads the OUT folder of the GPU runs above",
    "python bench/crash_resume.py --tiny --kills 20 --workdir /tmp/cr20 --seed 0 --set max_train_samples=160":
        "20 kill-and-resume cycles take minutes; tests/test_crash_resume.py runs the script with 2 kills",
    "vllm serve HuggingFaceTB/SmolLM2-1.7B-Instruct --port 8000": "a vLLM server on a GPU (a hub model; vllm is "
        "not installed here): tests/test_served_teacher.py serves a tiny model in its format instead",
    ".venv/bin/mlx-grpo train --config configs/arith_distill.toml --teacher-model= --teacher-url "
    "http://127.0.0.1:8000/v1/completions": "needs the vLLM server above; tests/test_served_teacher.py runs "
        "teacher_url against its stub",
}
ALL = [c for page in PAGES for c in page_commands(page)]
RUN: list[Command] = []  # in page order; a command again on a later page only where it shows its output there
for _c in ALL:
    if _c.text not in EXCLUDED and (_c.expect or all((_c.argv or _c.tokens) != (r.argv or r.tokens) for r in RUN)):
        RUN.append(_c)
README_COMMAND_1 = RUN[0]


def test_the_excluded_commands_are_on_the_pages():
    texts = {c.text for c in ALL}
    assert not [c for c in EXCLUDED if c not in texts], "EXCLUDED lists commands no page has any more"
    assert {c.page for c in RUN} >= {"README.md", "docs/models.md", "docs/training.md",
                                     "docs/tools-and-environments.md", "docs/vision.md"}


def test_every_code_block_says_its_language():
    """An unlabelled block would hide its commands from this test (and its output from the check)."""
    bare = [f"{p.name}: {m[2].strip()[:50]}" for p in PAGES
            for m in BLOCK.finditer(p.read_text()) if not m[1]]
    assert not bare, bare


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """-> workdir(page, fixture): the page's Workdir. Shared: the default model's stand-in, GSM8K's."""
    shared, dirs = tmp_path_factory.mktemp("reader"), {}
    with pytest.MonkeyPatch.context() as mp:
        cache = shared / "cache"
        mp.setenv("MLX_GRPO_CACHE", str(cache))
        mp.setenv("TQDM_DISABLE", "1")
        write_default_standin(cache / "models" / f"{DEFAULT_MODEL}-{model_loading.DEFAULT_MODEL_DTYPE}")
        assert model_loading.resolve_model_path(DEFAULT_MODEL).startswith(str(cache))  # no conversion of the real one
        (shared / "gsm8k").mkdir()
        for split in ("train", "test"):
            (shared / f"gsm8k/{split}.jsonl").write_text(jsonl(gsm8k_rows()))
        mp.setattr(data_mod, "load_gsm8k_hub", lambda split, path_key="dataset_path":
                   data_mod.load_file(shared / f"gsm8k/{split}.jsonl"))

        def get(page: str, fixture) -> Workdir:
            if page not in dirs:
                dirs[page] = Workdir(shared / page.replace("/", "-"), shared, fixture, RUN)
                if page != README_COMMAND_1.page:  # every page follows README command 1
                    first = get(README_COMMAND_1.page, fixture)
                    code, out = first.run(README_COMMAND_1)
                    assert code == 0, out[-3000:]
                    run = first.run_dir(README_COMMAND_1.argv)
                    shutil.copytree(first.path / run, dirs[page].path / run)
            dirs[page].fixture = fixture
            return dirs[page]

        yield get


@pytest.mark.run
@pytest.mark.parametrize("cmd", RUN, ids=[f"{c.page}:{c.text[:70]}" for c in RUN])
def test_documented_command_runs_as_written(cmd, workdir, request):
    w = workdir(cmd.page, request.getfixturevalue)
    code, out = w.run(cmd)
    fails = any(": error: " in line for line in cmd.expect)
    assert code == (2 if fails else 0), out[-3000:]
    lines = out.splitlines()
    missing = [e for e in cmd.expect if not any(matches(e, line) for line in lines)]
    assert not missing, (missing, out[-3000:])
    argv = [w.word(a) for a in cmd.argv or []]
    if argv[:1] == ["plot"]:
        assert (w.path / argv[1] / "curves.png").is_file()
    if argv[:1] == ["train"] and w.config(argv).rollout.tools:  # what tools-and-environments.md says to read
        run = w.path / w.run_dir(argv)
        assert all("tool_call_rate" in json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines())
        logged = run / "completions.jsonl"  # written every log_completions_steps updates
        rows = logged.read_text().splitlines() if logged.exists() else []
        turns = [t for line in rows for t in json.loads(line)["turns"]]
        assert all(t["info"]["ended"] in ("eos", "stop", "length") for t in turns if t["origin"] == "model")
        assert turns or "log_completions_steps=1" not in cmd.text


def python_blocks() -> list[tuple[str, str, str]]:
    """(page, the prose since the previous block, the code) of every python block."""
    out = []
    for page in PAGES:
        text, end = page.read_text(), 0
        for m in BLOCK.finditer(text):
            if m[1] == "python":
                out.append((page.name, text[end:m.start()], textwrap.dedent(m[2])))
            end = m.end()
    return out


def test_example_files_are_shown_as_they_are():
    """A python block after a link to a file of examples/ is a part of that file, verbatim, so the page cannot
    drift from it."""
    shown = [(page, re.findall(r"\]\(\.\./(examples/[^)#]+\.py)\)", prose)[-1], code)
             for page, prose, code in python_blocks() if "](../examples/" in prose]
    assert {path for _, path, _ in shown} >= {"examples/tools/word_count.py", "examples/environments/guess.py"}
    for page, path, code in shown:
        assert code in (ROOT / path).read_text(), f"{page}: the block after the link to {path} is not in that file"


def test_python_snippets_compile_and_print_what_the_page_shows(monkeypatch):
    """Every python block compiles; one that prints runs from the repository root and prints the `# ` lines
    that end it."""
    ran = 0
    for page, _, code in python_blocks():
        compiled = compile(code, page, "exec")
        if "print(" not in code:
            continue
        lines = code.rstrip().splitlines()
        printed = len(lines) - next(i for i, line in enumerate(reversed(lines)) if not line.startswith("# "))
        expected = [line[2:] for line in lines[printed:]]
        monkeypatch.chdir(ROOT)
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            exec(compiled, {"__name__": "__docs__"})
        assert out.getvalue().splitlines() == expected, page
        ran += 1
    assert ran >= 1


@pytest.mark.run
def test_the_worked_example_shown_is_the_one_the_preset_draws(workdir, request):
    """docs/worked-examples.md's example is the one configs/arith.toml's prompt holds: the text its eval records."""
    page = ROOT / "docs/worked-examples.md"
    shown = [m[1] for m in re.finditer(r"```text\n(Example question:.*?)```", page.read_text(), re.S)]
    evals = [c for c in RUN if c.page == "docs/worked-examples.md" and c.argv[0] == "eval"
             and "eval_worked_examples=false" not in c.text]
    assert len(shown) == 1 and len(evals) == 1
    w = workdir(evals[0].page, request.getfixturevalue)
    code, out = w.run(evals[0])
    assert code == 0, out[-3000:]
    written = re.search(r"wrote \d+ records to (\S+)", out)[1]
    recorded = json.loads((w.path / f"{written}.config.json").read_text())["command_options"]["prompt"]
    assert shown[0].strip() in recorded["system_prompt"]
