"""Shared fixtures: tiny random-weight llama models with a byte-level tokenizer and a chat template."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

# The builders live in the package (bench/crash_resume.py --tiny uses them without pytest); re-exported here
# for the tests that import them from conftest.
from mlx_grpo.models.tiny import write_tiny_model, write_tokenizer  # noqa: F401

# metrics.jsonl figures that measure the machine, not the run: left out when two runs are compared
TIMING = {"rollout_tokens_per_s", "train_tokens_per_s", "time_rollout_s", "time_reward_s", "time_logprob_s",
          "time_train_s", "time_step_s", "peak_memory_gb"}


def run_metrics(run_dir) -> list[dict]:
    """A run's metrics.jsonl records without the TIMING figures."""
    rows = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if k not in TIMING} for r in rows]


def same_last_checkpoint(a_run, b_run) -> bool:
    """Whether two runs' last checkpoints hold the same model weights, to the bit."""
    last = max(int(p.name.split("-")[1]) for p in Path(a_run).glob("checkpoint-*"))
    a = mx.load(str(Path(a_run) / f"checkpoint-{last}" / "model.safetensors"))
    b = mx.load(str(Path(b_run) / f"checkpoint-{last}" / "model.safetensors"))
    return a.keys() == b.keys() and all(np.array_equal(np.array(a[k]), np.array(b[k])) for k in a)


def begin_widths(monkeypatch) -> list[int]:
    """The rows each sampling-copy decode starts its batch with (CopyDecoder.begin), appended as decodes run."""
    from mlx_grpo.rollout.copy_decoder import CopyDecoder

    widths, begin = [], CopyDecoder.begin
    monkeypatch.setattr(CopyDecoder, "begin", lambda self, contexts, counts, T: widths.append(sum(counts)) or
                        begin(self, contexts, counts, T))
    return widths


def interrupt_before_update(train, cfg, monkeypatch, update: int, trainer_class=None) -> None:
    """Run train(cfg) and stop it with a KeyboardInterrupt just before `update` (what Ctrl-C leaves behind:
    the checkpoints written so far); trainer_class: whose update to stop (default: the GRPO Trainer; SFT's
    has an update too)."""
    if trainer_class is None:
        from mlx_grpo.training.trainer import Trainer as trainer_class
    name = "update"
    original = getattr(trainer_class, name)

    def crashing(self, steps, *args, **kwargs):
        if self.counters.update_step + 1 == update:
            raise KeyboardInterrupt
        return original(self, steps, *args, **kwargs)

    monkeypatch.setattr(trainer_class, name, crashing)
    with pytest.raises(KeyboardInterrupt):
        train(cfg)
    monkeypatch.setattr(trainer_class, name, original)


def sigint_default() -> None:
    """preexec_fn for a child that must see Ctrl-C: a test runner started as a background job ignores SIGINT,
    its children inherit that, and mlx-grpo then leaves SIGINT alone as a background job should."""
    import signal
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def ctrl_c_while_scoring_hangs(model_dir, tmp_path, *sets: str) -> tuple[int, str]:
    """`mlx-grpo train` (with --set items `sets`) whose scorer never returns: Ctrl-C once the scorer is
    entered. -> (exit code, stderr)."""
    import signal
    import subprocess
    import sys
    import time

    marker = tmp_path / "scoring"
    (tmp_path / "hang.py").write_text(
        "import pathlib, time\n"
        "def hang(prompts, completions, completion_ids, **columns):\n"
        f"    pathlib.Path({str(marker)!r}).touch()\n"
        "    time.sleep(600)\n")
    items = [f"model_name={model_dir}", f"output_dir={tmp_path}", "max_train_samples=8", "system_prompt=",
             f"reward_funcs={tmp_path / 'hang.py'}:hang", "max_new_tokens=8", *sets]
    cmd = [sys.executable, "-m", "mlx_grpo", "train", *(a for item in items for a in ("--set", item))]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=sigint_default)
    deadline = time.monotonic() + 120
    while not marker.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert marker.exists(), proc.communicate(timeout=5)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=20)
    return proc.returncode, err


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


def pytest_configure(config):
    config.addinivalue_line("markers", "curves: the test's training runs draw curves.png at their end")


@pytest.fixture(autouse=True)
def _no_end_of_run_curves(request, monkeypatch):
    """Drawing curves.png at the end of a run costs ~0.3 s of matplotlib per tiny run: only tests marked
    `curves` (tests/test_plot.py) draw them; the other runs print their summary without the PNG."""
    if request.node.get_closest_marker("curves") is None:
        from mlx_grpo.commands import train as run_mod

        monkeypatch.setattr(run_mod, "_curves", lambda run_dir: None)


@pytest.fixture(scope="session")
def tiny_vlm_hf_dir(tmp_path_factory) -> Path:
    """A 2-layer random-weight Qwen2-VL in Hugging Face form (transformers, torch CPU), written offline."""
    pytest.importorskip("mlx_vlm")
    from mlx_grpo.vlm.tiny_vlm import write_tiny_vlm

    return write_tiny_vlm(tmp_path_factory.mktemp("tiny-vlm") / "hf")


@pytest.fixture(scope="session")
def tiny_vlm_dir(tiny_vlm_hf_dir, tmp_path_factory) -> Path:
    """tiny_vlm_hf_dir converted to MLX by `mlx-grpo convert` (float32)."""
    from mlx_grpo.commands.convert import run_convert

    return run_convert(hf_path=str(tiny_vlm_hf_dir), output_dir=str(tmp_path_factory.mktemp("tiny-vlm") / "mlx"))


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Every test gets its tier's marker before `-m` selects: a hand-placed `fast`/`run`/`bench`/`gpu` mark, else
    the tier tests/tiers.py reads off its code (DEVELOPERS.md, "Tests in tiers"). `gpu` tests skip without CUDA."""
    from tiers import TIERS, tier_of

    cuda = None
    for item in items:
        marked = {mark.name for mark in item.iter_markers()} & set(TIERS)
        if not marked:
            item.add_marker(tier_of(item, __file__))
        elif "gpu" in marked:
            if cuda is None:
                cuda = hasattr(mx, "cuda") and mx.cuda.is_available()
            if not cuda:
                item.add_marker(pytest.mark.skip(reason="gpu tier: needs MLX's CUDA backend and a CUDA device"))
