"""`mlx-grpo eval`: accuracy counting, pass@k, per-example JSONL, and the CLI's errors."""

import json
import re
import sys
from pathlib import Path

import numpy as np

from mlx_grpo.commands import evaluate
from mlx_grpo.commands.cli import main
from mlx_grpo.config import build_config, parse_set
from mlx_grpo.rollout.rollout_records import Rollout

FIXTURES = Path(__file__).parent / "fixtures"


def _cfg(model_dir, *items):
    return build_config("eval", overrides=parse_set([f"model_name={model_dir}", "eval_max_new_tokens=6",
                                                     f"eval_dataset_path={FIXTURES / 'gsm8k_tiny.jsonl'}",
                                                     *items]))


def test_eval_writes_records_for_the_fixed_subset(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "r.jsonl"
    result = evaluate.run_eval(_cfg(tiny_model_dir, "eval_subset_size=2"), output=str(out))
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 2 and all(len(r["completions"]) == 1 for r in rows)
    assert result.accuracy == 0.0  # a random model writes no <answer> tags
    again = evaluate.run_eval(_cfg(tiny_model_dir, "eval_subset_size=2"), output=str(tmp_path / "s.jsonl"))
    assert [r["prompt"] for r in again.records] == [r["prompt"] for r in rows]  # same subset every time
    assert "accuracy: 0.0000 (0/2)" in capsys.readouterr().out


def test_accuracy_and_pass_at_k_count_correct_answers(tiny_model_dir, monkeypatch):
    """Feed scripted completions: the first sample of question 0 is right, question 1 only in sample 2."""
    cfg = _cfg(tiny_model_dir, "eval_subset_size=2", "eval_num_samples=2", "temperature=1.0")
    examples = evaluate.subset(evaluate.run_examples(cfg, "test"), 2, 0)

    def scripted(engine, jobs, group, params, prefill="", on_done=None):
        texts = [f"<answer>\n{examples[0].answer}\n</answer>", "no", "7 apples", f"so {examples[1].answer}"]
        return [Rollout(jobs[0][0], None, None, None, np.zeros(4, bool), texts, group)]

    monkeypatch.setattr(evaluate.RolloutEngine, "generate_many", scripted)
    from mlx_lm import load

    model, tok = load(str(tiny_model_dir))
    result = evaluate.evaluate_model(model, tok, examples, cfg, max_new_tokens=4, num_samples=2,
                                     temperature=1.0)
    assert [r["correct"] for r in result.records] == [True, False]
    assert [r["lenient"] for r in result.records] == [True, True]  # last number counts when lenient
    assert result.accuracy == 0.5 and result.lenient_accuracy == 1.0 and result.format_rate == 0.5


def test_pass_at_k_needs_sampling(tiny_model_dir, capsys):
    code = main(["eval", "--model", str(tiny_model_dir), "--num-samples", "4"])
    assert code == 2 and "needs temperature > 0" in capsys.readouterr().err


def test_train_cli_bad_config_is_one_line(tmp_path, capsys):
    toml = tmp_path / "c.toml"
    toml.write_text("batch_sise = 2\n")
    assert main(["train", "--config", str(toml)]) == 2
    err = capsys.readouterr().err
    assert "did you mean 'batch_size'" in err and "Traceback" not in err


def test_eval_hint_names_the_eval_key_and_following_it_works(tiny_model_dir, tmp_path, monkeypatch, capsys):
    """Without the `data` extra, `eval --dataset gsm8k` names eval_dataset_path (dataset_path does not apply
    to eval); passing the key it names then evaluates."""
    from mlx_grpo.config import fields_for

    monkeypatch.setitem(sys.modules, "datasets", None)  # `import datasets` raises ImportError
    base = ["eval", "--model", str(tiny_model_dir), "--dataset", "gsm8k", "--samples", "2", "--max-tokens", "4",
            "--output", str(tmp_path / "r.jsonl")]
    assert main(base) == 2
    err = capsys.readouterr().err
    keys = re.findall(r"(\w+)=/path/to/", err)
    assert keys == ["eval_dataset_path"] and all(k in fields_for("eval") for k in keys), err
    assert main(base + ["--set", f"{keys[0]}={FIXTURES / 'gsm8k_tiny.jsonl'}"]) == 0
    assert len((tmp_path / "r.jsonl").read_text().splitlines()) == 2


def test_data_hints_name_the_key_of_the_split():
    import pytest

    from mlx_grpo.base.errors import UserError
    from mlx_grpo.data.examples import load_examples

    with pytest.raises(UserError, match=r"or set dataset_path\)"):
        load_examples("gsm8", "train", None, 0)
    with pytest.raises(UserError, match=r"or set eval_dataset_path\)"):
        load_examples("gsm8", "test", None, 0)
    with pytest.raises(UserError, match=r"or set eval_dataset_path\)"):  # eval --split train: still eval's key
        load_examples("gsm8", "train", None, 0, path_key="eval_dataset_path")


def _as_checkpoint(model_dir: Path, run_dir: Path) -> Path:
    """A copy of the tiny model laid out as a run's checkpoint (a model directory with trainer_state.json)."""
    import shutil

    path = run_dir / "checkpoint-3"
    shutil.copytree(model_dir, path)
    (path / "trainer_state.json").write_text("{}")
    return path


def test_eval_output_defaults_to_the_checkpoints_run_directory(tiny_model_dir, tmp_path, monkeypatch, capsys):
    """Without --output: a checkpoint's results go into its run directory, another model's under runs/eval/;
    the name carries the data set, the split and the subset size (another data set or --samples writes
    beside earlier results, not over them); the line on stderr says where; nothing lands loose in the current
    directory. Without a terminal, a line follows each batch of eval_batch_size questions."""
    from mlx_grpo.data.sources import run_examples

    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    checkpoint = _as_checkpoint(tiny_model_dir, tmp_path / "run")
    assert main(["eval", "--model", str(checkpoint), "--samples", "3", "--max-tokens", "4",
                 "--eval-batch-size", "2"]) == 0
    err = capsys.readouterr().err
    arith = len(run_examples(build_config("eval"), "test"))
    written = tmp_path / "run" / f"eval-checkpoint-3-arith-test-3of{arith}.jsonl"
    assert len(written.read_text().splitlines()) == 3 and Path(f"{written}.config.json").is_file()
    assert f"wrote 3 records to {written} (the checkpoint's run directory; --output FILE to choose)" in err
    progress = [line for line in err.splitlines() if line.startswith("[mlx-grpo] eval: ")]
    assert [re.fullmatch(r"\[mlx-grpo\] eval: (\d)/3 examples, 0 correct, \d+s", line)[1] for line in progress] \
        == ["2", "3"]
    assert list(work.iterdir()) == []
    # another data set of the same checkpoint, the whole of it: its own file, the first one untouched
    tiny = FIXTURES / "gsm8k_tiny.jsonl"
    assert main(["eval", "--model", str(checkpoint), "--eval-dataset-path", str(tiny), "--samples", "1000",
                 "--max-tokens", "4"]) == 0
    assert f"records to {tmp_path / 'run' / 'eval-checkpoint-3-gsm8k_tiny-test.jsonl'} (" in capsys.readouterr().err
    assert len(written.read_text().splitlines()) == 3

    assert main(["eval", "--model", str(tiny_model_dir), "--samples", "2", "--max-tokens", "4"]) == 0
    err = capsys.readouterr().err
    elsewhere = Path("runs") / "eval" / f"eval-{tiny_model_dir.name}-arith-test-2of{arith}.jsonl"
    assert f"wrote 2 records to {elsewhere} (not a checkpoint of a run; --output FILE to choose)" in err
    assert elsewhere.is_file() and [p.name for p in work.iterdir()] == ["runs"]


def test_an_output_that_cannot_be_written_stops_eval_before_the_model_loads(tiny_model_dir, tmp_path, monkeypatch,
                                                                           capsys):
    """An --output the system refuses (here a name longer than a file name may be; a read-only directory as
    well, but root writes there) is one line and exit 2 before the model loads, not after every question."""
    from mlx_grpo.models import model_loading

    def never(*args, **kwargs):
        raise AssertionError("the model loaded before the output was checked")

    monkeypatch.setattr(model_loading, "load_model", never)
    out = tmp_path / ("x" * 300 + ".jsonl")
    assert main(["eval", "--model", str(tiny_model_dir), "--samples", "2", "--output", str(out)]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith(f"mlx-grpo eval: error: --output {out}: cannot write ") and "name too long" in line
    assert list(tmp_path.iterdir()) == []


def test_eval_shows_a_bar_in_a_terminal(tiny_model_dir, tmp_path):
    """In a (pseudo-)terminal the eval command draws its bar over the questions and leaves it when done."""
    import fcntl
    import os
    import pty
    import struct
    import termios

    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(root / "src") + os.pathsep + os.environ.get("PYTHONPATH", "")}
    env.pop("TQDM_DISABLE", None)
    argv = [sys.executable, "-m", "mlx_grpo", "eval", "--model", str(tiny_model_dir), "--samples", "3",
            "--max-tokens", "4", "--eval-batch-size", "2", "--output", str(tmp_path / "r.jsonl")]
    pid, fd = pty.fork()
    if pid == 0:  # the child: a 100-column terminal, then the command
        fcntl.ioctl(0, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))
        os.execvpe(argv[0], argv, env)
    shown = b""
    while True:
        try:
            chunk = os.read(fd, 4096)
        except OSError:  # the terminal closed with the child
            break
        if not chunk:
            break
        shown += chunk
    _, status = os.waitpid(pid, 0)
    text = shown.decode(errors="replace")
    assert os.waitstatus_to_exitcode(status) == 0, text
    assert "eval:   0%|" in text and "0/3 [" in text and "eval: 100%|" in text and "3/3 [" in text
    assert "accuracy: 0.0000 (0/3)" in text.split("eval: 100%|")[-1]  # the finished bar stays above the result
    assert "[mlx-grpo] eval:" not in text  # lines only where there is no bar


def test_the_decode_loop_reports_rows_as_they_end(tiny_model_dir):
    """Both decode paths (the model's loop, the sampling copy's) tell on_done, at their syncs, which rows have
    ended so far: rows whose limits differ end at different syncs. What the eval bar follows."""
    import mlx.core as mx
    from mlx_lm import load

    from mlx_grpo.rollout.engine import RolloutEngine
    from mlx_grpo.rollout.rollout_records import SamplingParams

    model, tok = load(str(tiny_model_dir))
    prompts = [tok.encode("a b"), tok.encode("c")]
    for mode in ("model", "copy"):
        engine = RolloutEngine(tok, mode=mode, sync_every=4).refresh(model)
        seen = []
        engine.generate_many([(prompts, mx.random.split(mx.random.key(0), 4))], 2, SamplingParams(16, 0.0),
                             limits=np.array([4, 8, 12, 16]),
                             on_done=lambda first, done: seen.append((first, done.astype(int).tolist())))
        assert seen == [(0, [1, 0, 0, 0]), (0, [1, 1, 0, 0]), (0, [1, 1, 1, 0])], mode


def test_the_eval_bar_moves_as_answers_end_within_one_batch(tiny_model_dir, monkeypatch):
    """All questions in one batch: the bar counts a question once all its samples have ended, as the decode
    reports them, instead of jumping from 0 to the end."""
    import io

    from mlx_lm import load
    from tqdm import tqdm

    cfg = _cfg(tiny_model_dir, "eval_subset_size=3", "eval_num_samples=2", "temperature=1.0", "eval_batch_size=8")
    examples = evaluate.subset(evaluate.run_examples(cfg, "test"), 3, 0)
    bars, positions = [], []

    class Shown(tqdm):  # a bar drawn as on a terminal
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **{**kwargs, "disable": False, "file": io.StringIO()})
            bars.append(self)

    def decoding(engine, multiturn, jobs, group, params, prefill="", on_done=None):
        rows = len(jobs[0][0]) * group
        for ended in ([1, 0, 0, 0, 0, 0], [1, 1, 0, 0, 1, 0], [1, 1, 1, 0, 1, 1], [1] * 6):
            on_done(0, np.array(ended, dtype=bool))
            positions.append(bars[0].n)
        return [Rollout(jobs[0][0], None, None, None, np.zeros(rows, bool), ["no"] * rows, group)]

    monkeypatch.setattr(evaluate, "tqdm", Shown)
    monkeypatch.setattr(evaluate, "rollouts", decoding)
    model, tok = load(str(tiny_model_dir))
    records = evaluate.answer_records(model, tok, examples, cfg, max_new_tokens=4, num_samples=2, temperature=1.0,
                                      progress=True)
    assert positions == [0, 1, 2, 3] and bars[0].n == 3 and len(records) == 3


def test_an_eval_that_fails_after_the_check_leaves_no_directory(tiny_model_dir, tmp_path, monkeypatch, capsys):
    """The writable check makes runs/eval/ to try the default output there and removes it again: an eval that
    then fails (here a device fault in the decode) leaves no empty directory where it ran."""
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)

    def fault(*args, **kwargs):
        raise RuntimeError("[metal] command buffer execution failed: a device fault")

    monkeypatch.setattr(evaluate, "answer_records", fault)
    assert main(["eval", "--model", str(tiny_model_dir), "--samples", "2", "--max-tokens", "2"]) == 1
    assert "device fault" in capsys.readouterr().err
    assert list(work.iterdir()) == []
