"""The path of one update (issue 46): the files of mlx_grpo that `Trainer.update` enters on the default path (full
fine-tuning, one process, no tools), traced with sys.setprofile over a tiny run's second update. The bound keeps
the update readable as one pass through a few rooms; a change that sends it through more files fails here and
names them, so the bound moves only on purpose (DEVELOPERS.md "One update, top to bottom"). What it cannot see: calls on
other threads (reward workers, async rollouts: the default path runs neither), and methods a dataclass generates
(their code has no file), so a module whose only part in the update is building a dataclass is not counted."""

from __future__ import annotations

import sys
from pathlib import Path

import mlx_grpo
from mlx_grpo.commands import train as train_mod
from mlx_grpo.config import build_config, parse_set
from mlx_grpo.training.trainer import Trainer

MAX_FILES = 12
ROOT = str(Path(mlx_grpo.__file__).parent) + "/"  # as the modules were imported: their code names files so


def traced_update(cfg, monkeypatch, which: int = 2) -> tuple[list[str], int]:
    """The files (relative to mlx_grpo/) entered during the `which`-th Trainer.update of a run, and the number of
    calls that moved from one file to another."""
    files, moves, last, seen = set(), [0], [None], [0]
    original = Trainer.update

    def profile(frame, event, arg):
        if event != "call" or not frame.f_code.co_filename.startswith(ROOT):
            return
        rel = frame.f_code.co_filename[len(ROOT):]
        files.add(rel)
        moves[0] += rel != last[0]
        last[0] = rel

    def update(self, *args, **kwargs):
        seen[0] += 1
        if seen[0] != which:
            return original(self, *args, **kwargs)
        before = sys.getprofile()
        sys.setprofile(profile)
        try:
            return original(self, *args, **kwargs)
        finally:
            sys.setprofile(before)

    monkeypatch.setattr(Trainer, "update", update)
    train_mod.train(cfg)
    return sorted(files), moves[0]


def test_one_update_goes_through_at_most_twelve_files(tiny_model_dir, tmp_path, monkeypatch):
    cfg = build_config("train", overrides=parse_set([
        f"model_name={tiny_model_dir}", f"output_dir={tmp_path}", "batch_size=2", "num_generations=2",
        "max_new_tokens=8", "max_train_samples=6", "system_prompt=", "save_steps=0", "log_completions_steps=0",
        "max_prompt_length=256", 'reward_funcs=["soft_format"]']))
    files, moves = traced_update(cfg, monkeypatch)
    assert "training/trainer.py" in files and "loss.py" in files  # the trace saw the update
    assert len(files) <= MAX_FILES, f"one update enters {len(files)} files ({moves} moves): {', '.join(files)}"
