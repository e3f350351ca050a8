"""Every hint the CLI prints that names a command, a --set, a --config or a --resume to pass back: provoked on a
tiny model, the hint parsed out of the line as printed, run, and the run must succeed (or fail only for the
reason the hint states). The journeys follow what a user does next, one hint leading to the next.

Hints guarded elsewhere (not repeated here):
- a resume refused for changed settings -> `mlx-grpo train --config CHECKPOINT/config.resolved.json --resume
  [CHECKPOINT]` (checkpoint.resume_command, also behind check_resume's and sft's other refusals):
  test_checkpoint.py::test_a_refused_resume_names_a_command_that_works_when_pasted; its `sft` form here;
- out of memory -> `--resume` with the same settings: test_out_of_memory.py::
  test_a_run_that_runs_out_of_memory_says_one_line_and_resumes; its new-run form here;
- a missing `data` extra -> `eval_dataset_path=...`: test_evaluate.py::
  test_eval_hint_names_the_eval_key_and_following_it_works;
- Ctrl-C's line (cli._what_survives, the crash line's words): its text in test_interrupt.py, run here through the
  crash line;
- `mlx-grpo plot RUN` after curves that could not be drawn: the line in test_plot.py::
  test_curves_without_matplotlib_or_failing_never_fail_the_run, the command in test_plot_command_writes_a_png.
Not runnable here: install hints (pip, network), mlx.launch's (several processes), placeholders the user fills
(`answer_column=...`, `--output FILE`, `mlx-grpo train ... --resume latest` for another process count), commands
named without arguments (`mlx-grpo eval`, `mlx-grpo sft` in the plateau and summary advice).
"""

from __future__ import annotations

import contextlib
import errno
import io
import json
import re
import shlex
import shutil
from pathlib import Path

import pytest

from mlx_grpo.commands.cli import main
from mlx_grpo.rollout import engine

# a GRPO run of one update (two with max_train_samples=4), on the default data set
SMALL = ["--set", "batch_size=2", "--set", "num_generations=2", "--set", "max_new_tokens=4", "--set",
         "max_train_samples=2", "--set", "system_prompt=", "--set", "max_prompt_length=96"]
LORA = ["--set", "train_type=lora", "--set", "lora_rank=4"]
SFT_ROWS = [{"prompt": f"What is {i} + {i}?", "completion": f"<reasoning>\n{i} + {i} = {2 * i}\n</reasoning>\n"
             f"<answer>\n{2 * i}\n</answer>"} for i in range(4)]


def out(path: Path) -> list[str]:
    return ["--set", f"output_dir={path}"]


def sft_argv(model, data: Path, output: Path, *extra: str) -> list[str]:
    """`mlx-grpo sft` of one update (4 rows, batch 4)."""
    return ["sft", "--model", str(model), "--set", f"dataset_path={data}", *out(output), "--set", "batch_size=4",
            "--set", "num_epochs=1", "--set", "prefill=<reasoning>\n", *extra]


def error_line(capsys) -> str:
    """The one error line of a refused command (exit 2 was asserted by the caller)."""
    (line,) = capsys.readouterr().err.splitlines()
    return line


def fuse_of(line: str) -> list[str]:
    """The `mlx-grpo fuse ...` command a line names, as argv."""
    return shlex.split(re.search(r"mlx-grpo (fuse --checkpoint [^\s,]+ --output-dir [^\s,]+)", line)[1])


def sets_after(line: str, words: str) -> list[str]:
    """The `--set key=value` items the line names after `words`, as argv."""
    tail = line[line.index(words) + len(words):]
    return [a for item in re.findall(r"--set (\w+=[^\s,]+?)\.?(?=[\s,]|$)", tail) for a in ("--set", item)]


@pytest.fixture(scope="module")
def sft_runs(tiny_model_dir, tmp_path_factory):
    """One-update sft runs, full and LoRA, and what each printed: {kind: (checkpoint, stdout)}."""
    root = tmp_path_factory.mktemp("sft-runs")
    data = root / "sft.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in SFT_ROWS))
    runs = {}
    for kind, extra in (("full", []), ("lora", LORA)):
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            assert main(sft_argv(tiny_model_dir, data, root, "--set", f"run_name={kind}", *extra)) == 0
        runs[kind] = (root / kind / "checkpoint-1", printed.getvalue())
    return runs


def test_an_sft_lora_checkpoint_leads_to_grpo_through_its_merge(tiny_model_dir, sft_runs, tmp_path, capsys):
    """Issue 49's loop: `train --resume <sft LoRA checkpoint>` said to set model_name without --resume, and that
    said to continue with --resume or fuse. Now both name the one way out, the same `mlx-grpo fuse` command; once
    it ran, the checkpoint as model_name names the merged model; that model trains."""
    checkpoint = tmp_path / "warm" / "checkpoint-1"
    shutil.copytree(sft_runs["lora"][0], checkpoint)
    base = ["train", "--model", str(tiny_model_dir), *SMALL, *out(tmp_path / "runs")]
    assert main(base + ["--resume", str(checkpoint)]) == 2
    first = error_line(capsys)
    assert f"{checkpoint} is a checkpoint of `mlx-grpo sft`; to start GRPO from it, merge its adapters" in first
    assert main(base + ["--set", f"model_name={checkpoint}"]) == 2  # what the old advice said to do
    second = error_line(capsys)
    assert "--resume" not in second, "the advice sends the user back to --resume"  # its sft run is done
    assert fuse_of(second) == fuse_of(first)
    assert main(fuse_of(first)) == 0
    merged = Path(fuse_of(first)[-1])
    assert main(base + ["--set", f"model_name={checkpoint}"]) == 2  # once merged: the merge, not another
    third = error_line(capsys)
    assert f"its adapters are merged into {merged}: rerun with --set model_name={merged}" in third
    assert "mlx-grpo fuse" not in third
    assert main(base + sets_after(first, "rerun without --resume, with")) == 0
    assert f"train: model {merged}," in capsys.readouterr().out


def test_an_sft_checkpoint_given_to_train_resume_starts_grpo_from_it(tiny_model_dir, sft_runs, tmp_path, capsys):
    checkpoint = sft_runs["full"][0]
    base = ["train", "--model", str(tiny_model_dir), *SMALL, *out(tmp_path)]
    assert main(base + ["--resume", str(checkpoint)]) == 2
    line = error_line(capsys)
    assert line.endswith(f"to start GRPO from it, rerun without --resume, with --set model_name={checkpoint}")
    assert main(base + sets_after(line, "rerun without --resume, with")) == 0
    assert f"train: model {checkpoint}," in capsys.readouterr().out


def test_the_sft_summary_commands_run_as_printed(sft_runs, tmp_path, capsys):
    """sft's last line, `GRPO from it: [mlx-grpo fuse ..., then] mlx-grpo train --set model_name=...`, run as
    printed (plus settings that keep the run small). A one-update run says "1 update"."""
    for kind, (checkpoint, printed) in sft_runs.items():
        assert "[mlx-grpo] sft summary: 1 update, " in printed, kind
        (line,) = [x for x in printed.splitlines() if "GRPO from it: " in x]
        if kind == "lora":
            assert main(fuse_of(line)) == 0
        command = re.search(r"mlx-grpo (train --set model_name=\S+)", line)[1]
        assert main(shlex.split(command) + SMALL + out(tmp_path / kind)) == 0, kind
        assert (tmp_path / kind / "grpo" / "checkpoint-1").is_dir()
    capsys.readouterr()


def test_an_unfinished_train_lora_checkpoint_as_model_name_offers_its_resume(tiny_model_dir, tmp_path, capsys):
    base = ["train", "--model", str(tiny_model_dir), *SMALL, *out(tmp_path)]
    assert main(base + [*LORA, "--set", "max_train_samples=4", "--set", "save_steps=1", "--set", "run_name=lora"]) == 0
    checkpoint = tmp_path / "lora" / "checkpoint-1"  # update 1 of 2
    assert main(base + ["--set", f"model_name={checkpoint}", "--set", "run_name=other"]) == 2
    line = error_line(capsys)
    assert "merge its adapters into a model first: mlx-grpo fuse" in line
    command = re.search(r"or continue the `train` run that wrote it: mlx-grpo (.*)$", line)[1]
    assert command == f"train --config {checkpoint / 'config.resolved.json'} --resume {checkpoint}"
    assert main(shlex.split(command)) == 0
    assert f"resumed from {checkpoint} at update 1" in capsys.readouterr().out


def test_sft_from_a_train_checkpoint_and_its_refused_resume(tiny_model_dir, tmp_path, capsys):
    """`sft --resume <train checkpoint>` names the model_name that starts sft from it; a resume of that sft run
    with changed settings names `mlx-grpo sft --config ... --resume`, which resumes."""
    assert main(["train", "--model", str(tiny_model_dir), *SMALL, *out(tmp_path), "--set", "run_name=grpo"]) == 0
    checkpoint = tmp_path / "grpo" / "checkpoint-1"
    data = tmp_path / "sft.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in SFT_ROWS))
    sft = sft_argv(tiny_model_dir, data, tmp_path, "--set", "run_name=warm")
    assert main(sft + ["--resume", str(checkpoint)]) == 2
    line = error_line(capsys)
    assert line.endswith(f"to start sft from its weights, rerun without --resume, with --set model_name={checkpoint}")
    assert main(sft + sets_after(line, "rerun without --resume, with")) == 0
    assert f"sft: model {checkpoint}," in capsys.readouterr().out
    assert main(sft + ["--set", "learning_rate=1e-3", "--resume"]) == 2
    command = re.search(r"resume with its config: mlx-grpo (.*?), or start a new run", error_line(capsys))[1]
    assert command == f"sft --config {tmp_path / 'warm' / 'checkpoint-1' / 'config.resolved.json'} --resume"
    assert main(shlex.split(command)) == 0
    assert f"resumed from {tmp_path / 'warm' / 'checkpoint-1'} at update 1" in capsys.readouterr().out


def failing_decode(monkeypatch, message: str) -> None:
    """Rollouts raise RuntimeError(message) from the second decode on (update 2 of a run of two)."""
    decode, calls = engine.generate_rollout, []

    def decode_once(*args, **kwargs):
        calls.append(1)
        if len(calls) > 1:
            raise RuntimeError(message)
        return decode(*args, **kwargs)

    monkeypatch.setattr(engine, "generate_rollout", decode_once)


def test_a_run_from_nothing_through_a_crash_and_back(tiny_model_dir, tmp_path, monkeypatch, capsys):
    """--resume before any run, a crash after checkpoint-1, the resume the crash line names, then a rerun
    over the finished run: each line's command runs."""
    argv = ["train", "--model", str(tiny_model_dir), *SMALL, *out(tmp_path), "--set", "max_train_samples=4",
            "--set", "save_steps=1", "--set", "run_name=crash"]
    assert main(argv + ["--resume"]) == 2
    assert error_line(capsys).endswith("no run has started there (check output_dir and run_name); without --resume "
                                       "a run starts there")
    failing_decode(monkeypatch, "[metal] Command buffer execution failed: GPU Timeout Error")  # no memory error
    assert main(argv) == 1
    last = capsys.readouterr().err.strip().splitlines()[-1]
    checkpoint = re.search(r"the command with --resume (\S+) continues from it\.$", last)[1]
    assert checkpoint == str(tmp_path / "crash" / "checkpoint-1")
    monkeypatch.undo()
    assert main(argv + ["--resume", checkpoint]) == 0
    assert f"resumed from {checkpoint} at update 1" in capsys.readouterr().out
    assert main(argv) == 2
    assert "already holds checkpoints: pass --resume to continue it, or choose another run_name" in \
        error_line(capsys)
    assert main(argv + ["--resume"]) == 0


def test_out_of_memory_on_an_adapter_run_names_a_resume_and_a_new_run_that_work(tiny_model_dir, tmp_path,
                                                                               monkeypatch, capsys):
    argv = ["train", "--model", str(tiny_model_dir), *SMALL, *LORA, *out(tmp_path), "--set", "max_train_samples=4",
            "--set", "save_steps=1", "--set", "run_name=oom"]
    failing_decode(monkeypatch, "cudaMallocAsync(&data, size, stream) failed: out of memory")
    assert main(argv) == 2
    line = error_line(capsys)
    checkpoint = tmp_path / "oom" / "checkpoint-1"
    assert f"--resume {checkpoint} continues from it with the same settings" in line
    monkeypatch.undo()  # the GPU freed
    assert main(argv + ["--resume", str(checkpoint)]) == 0
    assert f"resumed from {checkpoint} at update 1" in capsys.readouterr().out
    assert main(fuse_of(line)) == 0
    new_run = sets_after(line, ", then rerun with")
    assert new_run[-1] == "run_name=oom-from-checkpoint-1"
    assert main(argv + new_run) == 0
    assert (tmp_path / "oom-from-checkpoint-1" / "checkpoint-2").is_dir()


def test_a_failed_save_names_the_resume_that_continues(tiny_model_dir, tmp_path, monkeypatch, capsys):
    from mlx_grpo.storage import checkpoint as ckpt

    argv = ["train", "--model", str(tiny_model_dir), *SMALL, *out(tmp_path), "--set", "max_train_samples=4",
            "--set", "save_steps=1", "--set", "run_name=disk"]
    real, staged = ckpt.mx.save_safetensors, []

    def full_disk(path, *args, **kwargs):  # the second checkpoint's staged directory finds the disk full
        if ckpt.TMP_PREFIX in str(path) and Path(path).parent not in staged:
            staged.append(Path(path).parent)
        if len(staged) > 1:
            raise OSError(errno.ENOSPC, "No space left on device", path)
        return real(path, *args, **kwargs)

    monkeypatch.setattr(ckpt.mx, "save_safetensors", full_disk)
    assert main(argv) == 2
    checkpoint = re.search(r"once there is room, the command with --resume (\S+) continues from it$",
                           error_line(capsys))[1]
    monkeypatch.undo()  # room again
    assert main(argv + ["--resume", checkpoint]) == 0
    assert (tmp_path / "disk" / "checkpoint-2").is_dir()
