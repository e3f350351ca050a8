"""report_to: TensorBoard event files read back, W&B through a fake `wandb` module, missing packages as
one-line errors before training, and the reporters wired into a tiny training run."""

import json
import struct
import sys
import types
from pathlib import Path

import pytest

from mlx_grpo.base.errors import UserError
from mlx_grpo.commands import train as run_mod
from mlx_grpo.commands.cli import main
from mlx_grpo.config import build_config, parse_set
from mlx_grpo.config.run import REPORTERS
from mlx_grpo.reporting.reporters import EXTRAS, Reporters, scalars


def make_cfg(model_dir, out, *items):
    """A tiny training run (as in test_trainer.py)."""
    base = [f"model_name={model_dir}", f"output_dir={out}", "batch_size=2", "num_generations=4",
            "max_new_tokens=8", "max_train_samples=4", "learning_rate=1e-3", "warmup_ratio=0",
            "log_completions_steps=0", "max_prompt_length=96", "system_prompt="]
    return build_config("train", overrides=parse_set(base + list(items)))


def read_events(logdir: Path) -> list:
    """Every event of the TFRecord event files under logdir, file by file (in name order)."""
    from tensorboardX.proto.event_pb2 import Event

    events = []
    for path in sorted(logdir.glob("events.out.tfevents.*")):
        data, i = path.read_bytes(), 0
        while i < len(data):
            (length,) = struct.unpack("<Q", data[i:i + 8])
            events.append(Event.FromString(data[i + 12:i + 12 + length]))  # length, its crc, data, data crc
            i += 12 + length + 4
    return events


def scalar_values(logdir: Path) -> dict[str, dict[int, float]]:
    """tag -> {step: value} of every scalar written (a later write of a step wins)."""
    out: dict[str, dict[int, float]] = {}
    for event in read_events(logdir):
        for value in event.summary.value:
            out.setdefault(value.tag, {})[event.step] = value.simple_value
    return out


RECORDS = [{"update_step": u, "batch_step": u, "reward_mean": 0.25 * u, "reward/correctness": 0.5 * u,
            "reward/xmlcount": None, "kl": 0.01 * u, "skipped": False, "warnings": {"zero_std": "..."},
            "lr": 1e-6, "epoch": 0} for u in (1, 2, 3)]


def test_scalars_keep_numbers_only():
    assert scalars(RECORDS[0]) == {"reward_mean": 0.25, "reward/correctness": 0.5, "kl": 0.01,
                                             "skipped": 0.0, "lr": 1e-6, "epoch": 0.0}
    assert scalars({"update_step": 2, "accuracy": 0.5, "trigger": "x", "ids": [1]}, "eval/") == \
        {"eval/accuracy": 0.5}


def test_tensorboard_event_files_hold_the_scalars(tmp_path):
    reporters = Reporters(["tensorboard"], tmp_path, {"learning_rate": 1e-6})
    for record in RECORDS:
        reporters.log(record, record["update_step"])
    reporters.log_eval({"update_step": 3, "batch_step": 3, "trigger": "eval_every_updates", "accuracy": 0.5,
                        "accuracy_lenient": 0.75, "format_rate": 1.0, "num_examples": 4}, 3)
    reporters.close()
    values = scalar_values(tmp_path / "tensorboard")
    assert values["reward_mean"] == {1: 0.25, 2: 0.5, 3: 0.75}
    assert values["reward/correctness"] == {1: 0.5, 2: 1.0, 3: 1.5}
    assert values["kl"][2] == pytest.approx(0.02) and values["skipped"] == {1: 0.0, 2: 0.0, 3: 0.0}
    assert values["eval/accuracy"] == {3: 0.5} and values["eval/accuracy_lenient"] == {3: 0.75}
    assert values["eval/num_examples"] == {3: 4.0}
    assert not {"reward/xmlcount", "warnings", "update_step", "batch_step", "eval/trigger"} & set(values)


def test_tensorboard_after_resume_purges_the_redone_updates(tmp_path):
    first = Reporters(["tensorboard"], tmp_path, {})
    for record in RECORDS:
        first.log(record, record["update_step"])
    first.close()
    second = Reporters(["tensorboard"], tmp_path, {}, resumed_at=1)  # continues after update 1's checkpoint
    second.close()
    starts = [e.step for e in read_events(tmp_path / "tensorboard") if e.HasField("session_log")]
    assert starts == [2]  # TensorBoard hides the first session's events from step 2 on


class FakeWandb(types.ModuleType):
    """Records what the reporter asks of wandb."""

    def __init__(self):
        super().__init__("wandb")
        self.calls = []

    def init(self, **kwargs):
        self.calls.append(("init", kwargs))
        fake = self

        class Run:
            def log(self, data, step=None):
                fake.calls.append(("log", data, step))

            def finish(self, exit_code=0):
                fake.calls.append(("finish", exit_code))

        return Run()


@pytest.fixture
def fake_wandb(monkeypatch, tmp_path):
    """A fake wandb in sys.modules, and an environment without W&B settings or credentials."""
    fake = FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    for name in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_PROJECT", "WANDB_BASE_URL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    return fake


def test_wandb_offline_without_credentials(fake_wandb, tmp_path, capsys):
    run_dir = tmp_path / "my-run"
    reporters = Reporters(["wandb"], run_dir, {"learning_rate": 1e-6})
    reporters.log(RECORDS[0], 1)
    reporters.log_eval({"update_step": 1, "accuracy": 0.5, "trigger": "eval_every_updates"}, 1)
    reporters.close()
    assert fake_wandb.calls == [
        ("init", {"project": "mlx-grpo", "name": "my-run", "dir": str(run_dir), "config": {"learning_rate": 1e-6},
                  "mode": "offline"}),
        ("log", scalars(RECORDS[0]), 1), ("log", {"eval/accuracy": 0.5}, 1), ("finish", 0)]
    out = capsys.readouterr().out
    assert out.count("wandb: no API key or login found, logging offline") == 1 and "wandb sync" in out


@pytest.mark.parametrize("setting", ["api_key", "netrc", "mode"])
def test_wandb_online_when_logged_in_or_mode_set(fake_wandb, tmp_path, monkeypatch, capsys, setting):
    if setting == "api_key":
        monkeypatch.setenv("WANDB_API_KEY", "k" * 40)
    elif setting == "netrc":
        (tmp_path / "netrc").write_text("machine api.wandb.ai\n  login user\n  password " + "k" * 40 + "\n")
        monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))
    else:
        monkeypatch.setenv("WANDB_MODE", "online")
    monkeypatch.setenv("WANDB_PROJECT", "my-project")
    Reporters(["wandb"], tmp_path / "r", {}).close()
    init = fake_wandb.calls[0][1]
    assert "mode" not in init and init["project"] == "my-project"  # wandb itself reads WANDB_MODE
    assert "offline" not in capsys.readouterr().out


@pytest.mark.parametrize("name,modules", [("wandb", ["wandb"]), ("tensorboard", ["tensorboardX", "torch"])])
def test_missing_package_names_the_extra(monkeypatch, tmp_path, name, modules):
    for module in modules:
        monkeypatch.setitem(sys.modules, module, None)  # as if not installed
    with pytest.raises(UserError, match=rf"report_to = {name} needs .*pip install 'mlx-grpo\[{name}\]'"):
        Reporters([name], tmp_path, {})
    assert not (tmp_path / "tensorboard").exists()


def test_missing_package_stops_train_before_the_model_loads(monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(sys.modules, "wandb", None)
    monkeypatch.setattr(run_mod, "build_job", lambda *a: pytest.fail("the model was loaded"))
    assert main(["train", "--set", "report_to=wandb", "--set", f"output_dir={tmp_path}"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "pip install 'mlx-grpo[wandb]'" in err
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("value,message", [
    ("mlflow", "report_to: unknown reporter 'mlflow'; choose from tensorboard, wandb"),
    ("tensorbord", "did you mean 'tensorboard'"),
    ("wandb,wandb", "report_to lists a reporter twice"),
])
def test_report_to_values_are_checked(value, message):
    with pytest.raises(UserError, match=message):
        build_config("train", overrides=parse_set([f"report_to={value}"]))
    assert build_config("train", overrides=parse_set(["report_to=tensorboard,wandb"])).run.report_to == \
        ["tensorboard", "wandb"]


def test_training_run_reports_every_update_and_eval(tiny_model_dir, tmp_path, fake_wandb):
    run = run_mod.train(make_cfg(tiny_model_dir, tmp_path, "report_to=tensorboard,wandb", "eval_every_updates=2",
                                 "eval_subset_size=2", "eval_max_new_tokens=4"))
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    evals = [json.loads(line) for line in (run / "eval.jsonl").read_text().splitlines()]
    values = scalar_values(run / "tensorboard")
    assert values["reward_mean"] == {r["update_step"]: pytest.approx(r["reward_mean"]) for r in metrics}
    assert values["eval/accuracy"] == {2: pytest.approx(evals[0]["accuracy"])}
    kinds = [c[0] for c in fake_wandb.calls]
    assert kinds == ["init", "log", "log", "log", "finish"]
    assert fake_wandb.calls[0][1]["name"] == "grpo" and fake_wandb.calls[0][1]["config"]["report_to"] == \
        ["tensorboard", "wandb"]
    # the update-2 eval is logged before update 2's record, which carries what the eval showed (training/health.py)
    assert [c[2] for c in fake_wandb.calls[1:4]] == [1, 2, 2] and "eval/accuracy" in fake_wandb.calls[2][1]
    assert fake_wandb.calls[-1] == ("finish", 0)


def test_reporters_close_when_the_run_fails(tiny_model_dir, tmp_path, fake_wandb, monkeypatch):
    from mlx_grpo.training.trainer import Trainer

    update = Trainer.update

    def failing(self, steps):
        if self.counters.update_step >= 1:
            raise RuntimeError("boom")
        return update(self, steps)

    monkeypatch.setattr(Trainer, "update", failing)
    with pytest.raises(RuntimeError, match="boom"):
        run_mod.train(make_cfg(tiny_model_dir, tmp_path, "report_to=wandb"))
    assert [c[0] for c in fake_wandb.calls] == ["init", "log", "finish"] and fake_wandb.calls[-1] == ("finish", 1)


def test_no_reporters_by_default(tiny_model_dir, tmp_path, fake_wandb):
    run = run_mod.train(make_cfg(tiny_model_dir, tmp_path, "max_train_samples=2"))
    assert not fake_wandb.calls and not (run / "tensorboard").exists() and not (run / "wandb").exists()


def test_a_failing_reporter_is_dropped_with_one_line_and_training_goes_on(tmp_path, capsys):
    from mlx_grpo.reporting.reporters import Reporters

    class Broken:
        def log(self, values, step):
            raise OSError(28, "No space left on device")

        def close(self, failed):
            raise AssertionError("a dropped reporter is not closed again")

    reporters = Reporters([], tmp_path, {})
    reporters._backends = [Broken()]
    reporters.log({"loss": 1.0}, 1)
    reporters.log({"loss": 2.0}, 2)  # already dropped: no second warning
    reporters.close()
    out = capsys.readouterr().out
    assert out.count("report_to broken stopped (OSError") == 1


def test_every_report_to_choice_has_its_extra():
    """report_to's choices (config/run.py) and the extras that install them (reporting/reporters.py) name the same
    reporters: a choice without its extra would fail in the install hint instead of saying what to install."""
    assert sorted(EXTRAS) == sorted(REPORTERS)
