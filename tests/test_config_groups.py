"""The grouped config: one declaration per field read by validation, --help and docs/config.md; group tables
and group.field keys; every shipped file, the seed's smoke-test keys and stored flat configs still load;
one way to read a setting (its group), flat names as input; imports one way."""

import ast
import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

from mlx_grpo.base.errors import UserError
from mlx_grpo.commands.cli import DESCRIPTIONS, build_parser, main
from mlx_grpo.config import (FIELD_GROUP, FIELDS, GROUPS, Config, build_config, fields_for, from_json, parse_set,
                             save_json, to_dict)
from mlx_grpo.config.fields import choices_of, parse_range
from mlx_grpo.config.reference import markdown

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src/mlx_grpo/config"
SHIPPED = sorted((ROOT / "configs").glob("*.toml")) + sorted((ROOT / "examples").rglob("*.toml"))
# configs/smoke_test.toml as the seed shipped it (ad78738): flat keys that must keep loading unchanged.
SEED_SMOKE_TEST = """
model_name = "smollm2-135m-instruct"
output_dir = "runs"
run_name = "smoke_test"
dataset = "arith"
max_train_samples = 2
num_epochs = 1
batch_size = 1
num_generations = 4
gradient_accumulation_steps = 1
max_new_tokens = 32
max_prompt_length = 256
prefill = "<reasoning>\\n"
temperature = 1.0
learning_rate = 5e-6
warmup_ratio = 0.25
lr_scheduler_type = "cosine"
max_grad_norm = 1.0
adam_beta1 = 0.9
adam_beta2 = 0.99
weight_decay = 0.0
clip_eps = 0.2
kl_coeff = 0.04
micro_batch_size = 4
logging_steps = 1
log_jsonl = true
log_completions_steps = 1
save_steps = 0
eval_every_updates = 0
seed = 42
use_compile = false
quantize_for_rollouts = false
"""


def test_docs_config_md_is_generated_from_the_declarations():
    page = ROOT / "docs/config.md"
    assert page.read_text() == markdown(), "stale: python -m mlx_grpo.config.reference > docs/config.md"
    for name in FIELDS:
        assert f"| `{name}` |" in page.read_text()


def test_every_field_is_declared_once_with_help_and_commands():
    assert sum(len(dataclasses.fields(cls)) for cls in GROUPS.values()) == len(FIELDS) == len(FIELD_GROUP)
    for name, f in FIELDS.items():
        assert f.metadata["help"].strip() and f.metadata["commands"], name


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_every_shipped_file_loads_unchanged(path):
    for command in ("train", "eval"):
        build_config(command, str(path))


def test_seed_smoke_test_keys_load(tmp_path):
    (tmp_path / "seed.toml").write_text(SEED_SMOKE_TEST)
    cfg = build_config("train", str(tmp_path / "seed.toml"))
    assert (cfg.rollout.num_generations, cfg.training.micro_batch_size, cfg.objective.kl_coeff) == (4, 4, 0.04)


def test_group_tables_equal_flat_keys(tmp_path):
    flat = tmp_path / "flat.toml"
    flat.write_text('temperature = 0.7\nlearning_rate = 2e-6\nbatch_size = 3\n')
    grouped = tmp_path / "grouped.toml"
    grouped.write_text('[rollout]\ntemperature = 0.7\n[optimizer]\nlearning_rate = 2e-6\n[training]\nbatch_size = 3\n')
    wrapped = tmp_path / "wrapped.toml"
    wrapped.write_text('[mlx_grpo]\nbatch_size = 3\n[mlx_grpo.rollout]\ntemperature = 0.7\n'
                       '[mlx_grpo.optimizer]\nlearning_rate = 2e-6\n')
    mixed = tmp_path / "mixed.toml"  # flat keys before the first table are fine too
    mixed.write_text('batch_size = 3\n[rollout]\ntemperature = 0.7\n[optimizer]\nlearning_rate = 2e-6\n')
    want = build_config("train", str(flat))
    assert want.rollout.temperature == 0.7 and want.optimizer.learning_rate == 2e-6
    for path in (grouped, wrapped, mixed):
        assert build_config("train", str(path)) == want, path.name


def test_set_field_and_group_field_are_the_same():
    a = build_config("train", overrides=parse_set(["temperature=0.5", "lora_rank=4", "train_type=lora"]))
    b = build_config("train", overrides=parse_set(["rollout.temperature=0.5", "model.lora_rank=4",
                                                    "model.train_type=lora"]))
    assert a == b and b.rollout.temperature == 0.5 and b.model.lora_rank == 4


@pytest.mark.parametrize("item,message", [
    ("rollout.temprature=1", r"unknown config key 'rollout.temprature' in --set; did you mean 'rollout.temperature'"),
    ("model.temperature=1", r"config key 'temperature' \(--set\) is in \[rollout\], not \[model\]: write "
                            r"rollout.temperature or temperature"),
    ("rolout.temperature=1", r"unknown config group 'rolout' in --set .*did you mean 'rollout'"),
    ("optimizer.learning_rate=fast", r"'learning_rate' expects a number"),
])
def test_grouped_key_errors_are_one_line(item, message):
    with pytest.raises(UserError, match=message):
        build_config("train", overrides=parse_set([item]))


@pytest.mark.parametrize("text,message", [
    ('[rolout]\ntemperature = 1.0\n', r"unknown config group \[rolout\] in config file .*did you mean 'rollout'"),
    ('[model]\ntemperature = 1.0\n', r"'temperature' .* is in \[rollout\], not \[model\]"),
    ('temperature = 1.0\n[rollout]\ntemperature = 0.5\n', r"'temperature' is set twice"),
    ('[rollout]\ntemprature = 1.0\n', r"unknown config key 'rollout.temprature' .*did you mean 'rollout.temperature'"),
])
def test_grouped_toml_errors(text, message, tmp_path):
    (tmp_path / "c.toml").write_text(text)
    with pytest.raises(UserError, match=message):
        build_config("train", str(tmp_path / "c.toml"))


def test_cli_unknown_grouped_key_is_one_line_exit_2(capsys):
    assert main(["train", "--set", "rollout.temprature=1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "did you mean 'rollout.temperature'" in err


def test_flat_checkpoint_configs_still_load(tmp_path):
    """config.resolved.json is flat in every checkpoint written so far (and still): it loads for resume, with
    the per-invocation options and the renamed keys of older versions."""
    cfg = build_config("train", overrides=parse_set(["batch_size=7", "stop=</answer>", "temperature=0.9"]))
    save_json(cfg, tmp_path / "c.json", {"resume": None})
    stored = json.loads((tmp_path / "c.json").read_text())
    assert stored["batch_size"] == 7 and "rollout" not in stored  # flat on disk
    stored["max_completion_length"] = stored["max_new_tokens"]  # written by older versions
    (tmp_path / "old.json").write_text(json.dumps(stored))
    assert from_json(tmp_path / "old.json") == cfg
    grouped = {g: {n: v for n, v in to_dict(cfg).items() if FIELD_GROUP[n] == g} for g in GROUPS}
    (tmp_path / "grouped.json").write_text(json.dumps(grouped))
    assert from_json(tmp_path / "grouped.json") == cfg


def test_settings_read_through_groups_and_flat_names_stay_input():
    cfg = build_config("train", overrides=parse_set(["max_prompt_length=300"]))
    for name, group in FIELD_GROUP.items():
        assert hasattr(getattr(cfg, group), name) and not hasattr(cfg, name), name  # no second, flat read path
    cut = dataclasses.replace(cfg, max_prompt_length=1 << 30)
    assert cut.data.max_prompt_length == 1 << 30 and cfg.data.max_prompt_length == 300
    assert cut.rollout is cfg.rollout  # untouched groups are shared, not copied
    assert Config(temperature=0.5).rollout.temperature == 0.5 and Config() == build_config("train")
    with pytest.raises(TypeError, match="no field 'temprature'"):
        Config(temprature=0.5)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.rollout.temperature = 2.0


def _outside(text: str, is_int: bool) -> float:
    low, low_in, high, high_in = parse_range(text)
    step = 1 if is_int else 0.5
    if low is not None:
        return low - step if low_in else low
    return high + step if high_in else high


@pytest.mark.parametrize("name", [n for n, f in FIELDS.items() if f.metadata["range"]])
def test_every_declared_range_is_enforced(name):
    f = FIELDS[name]
    command = "train" if "train" in f.metadata["commands"] else sorted(f.metadata["commands"])[0]
    value = _outside(f.metadata["range"], f.type == "int")
    with pytest.raises(UserError, match=f"^{name} must be "):
        build_config(command, overrides=[(name, int(value) if f.type == "int" else value)])


@pytest.mark.parametrize("name", [n for n, f in FIELDS.items() if f.metadata["choices"]])
def test_every_declared_choice_is_enforced_and_listed_in_help(name, capsys):
    f = FIELDS[name]
    command = "train" if "train" in f.metadata["commands"] else sorted(f.metadata["commands"])[0]
    bad = 3 if f.type == "int" else ["nonsense"] if f.type.startswith("list") else "nonsense"
    with pytest.raises(UserError, match=f"^{name}"):
        build_config(command, overrides=[(name, bad)])
    with pytest.raises(SystemExit):
        build_parser().parse_args([command, "--help"])
    out = " ".join(capsys.readouterr().out.split())
    listed = out[out.rindex(f"--{name.replace('_', '-')} VALUE"):].split("(default: ")[0]  # its entry, not usage
    assert "One of: " in listed and all(str(choice) in listed for choice in choices_of(f)), listed


def test_loss_type_choices_are_loss_LOSS_TYPES(monkeypatch, capsys):
    """The one declaration of the loss types: a name added to loss.LOSS_TYPES is valid and in --help."""
    import mlx_grpo.loss as loss

    assert choices_of(FIELDS["loss_type"]) == tuple(loss.LOSS_TYPES)
    monkeypatch.setattr(loss, "LOSS_TYPES", (*tuple(loss.LOSS_TYPES), "new_loss"))
    assert build_config("train", overrides=parse_set(["loss_type=new_loss"])).objective.loss_type == "new_loss"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["train", "--help"])
    assert "new_loss" in capsys.readouterr().out


def test_help_has_a_section_per_group(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["train", "--help"])
    out = capsys.readouterr().out
    for group in GROUPS:
        assert f"{group} settings (cfg.{group}; TOML [{group}])" in out
    start = out.index("rollout settings")
    assert start < out.index("--temperature VALUE", start) < out.index("rewards settings")


def test_every_command_reads_only_declared_fields():
    for command in DESCRIPTIONS:
        assert set(fields_for(command)) <= set(FIELDS)


def test_config_imports_go_one_way_and_never_load_mlx():
    """Inside the package: fields <- groups <- root <- validation <- loading <- __init__ (function-level
    imports included); outside it only errors, reporting and, lazily, loss; mlx.core is not loaded."""
    groups = dict.fromkeys(cls.__module__.rpartition(".")[2] for cls in GROUPS.values())  # a new group's module too
    order = ["fields", *groups, "root", "validation", "loading", "reference", "__init__"]
    allowed = {"mlx_grpo.base.errors", "mlx_grpo.reporting.reporters", "mlx_grpo.loss"}
    for path in PACKAGE.glob("*.py"):
        assert path.stem in order, path.name
        assert len(path.read_text().splitlines()) <= 400, path.name
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("mlx_grpo"):
                if node.module.startswith("mlx_grpo.config."):
                    inner = node.module.rpartition(".")[2]
                    assert order.index(inner) < order.index(path.stem), (path.name, node.module)
                else:
                    assert node.module in allowed, (path.name, node.module)
    code = ("import sys, mlx_grpo.config, mlx_grpo.commands.cli; mlx_grpo.commands.cli.build_parser(); "
            "print('mlx.core' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={"PYTHONPATH": str(ROOT / "src")}).stdout
    assert out.strip() == "False"


def test_resume_may_change_is_declared_on_the_fields():
    """The fields a resumed run may change come from their declarations (checkpoint.config_changes reads them):
    logging, evaluation, saving, timeouts and memory/speed knobs; never the math or the data."""
    from mlx_grpo.config import RESUME_MAY_CHANGE
    from mlx_grpo.storage import checkpoint

    assert checkpoint.RESUME_MAY_CHANGE is RESUME_MAY_CHANGE
    assert {"save_steps", "eval_every_updates", "micro_batch_size", "report_to"} <= RESUME_MAY_CHANGE
    assert not {"learning_rate", "seed", "dataset", "loss_type", "batch_size", "model_name"} & RESUME_MAY_CHANGE
