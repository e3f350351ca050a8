"""Config resolution: precedence, strict keys and types, cross-field rules, help output."""

import json
from pathlib import Path

import pytest

from mlx_grpo.base.errors import UserError
from mlx_grpo.commands.cli import DESCRIPTIONS, build_parser, main
from mlx_grpo.config import SYSTEM_PROMPT, build_config, fields_for, from_json, parse_set, save_json


def test_precedence_defaults_toml_set(tmp_path):
    toml = tmp_path / "c.toml"
    toml.write_text('learning_rate = 2e-6\nbatch_size = 3\nrun_name = "from-toml"\n')
    cfg = build_config("train", str(toml), parse_set(["batch_size=5"]))
    assert cfg.optimizer.learning_rate == 2e-6  # TOML beats the default
    assert cfg.training.batch_size == 5  # --set beats TOML
    assert cfg.run.run_name == "from-toml"
    assert cfg.rollout.num_generations == 8  # untouched default
    assert cfg.data.system_prompt == SYSTEM_PROMPT


def test_table_form_and_command_defaults(tmp_path):
    toml = tmp_path / "c.toml"
    toml.write_text('[mlx_grpo]\nkl_coeff = 0.0\n')
    assert build_config("train", str(toml)).objective.kl_coeff == 0.0
    # interactive commands default to greedy and no system prompt; training samples at 1.0
    assert build_config("generate").rollout.temperature == 0.0
    assert build_config("generate").data.system_prompt == ""
    assert build_config("train").rollout.temperature == 1.0


def test_mixed_table_and_flat_keys_rejected(tmp_path):
    toml = tmp_path / "c.toml"
    toml.write_text('seed = 1\n[mlx_grpo]\nkl_coeff = 0.0\n')
    with pytest.raises(UserError, match="mlx_grpo"):
        build_config("train", str(toml))


@pytest.mark.parametrize("key,nearest", [("learning_rat", "learning_rate"), ("temprature", "temperature"),
                                         ("num_generation", "num_generations")])
def test_unknown_key_names_nearest(key, nearest, tmp_path):
    with pytest.raises(UserError, match=f"unknown config key '{key}'.*did you mean '{nearest}'"):
        build_config("train", overrides=parse_set([f"{key}=1"]))
    toml = tmp_path / "c.toml"
    toml.write_text(f"{key} = 1\n")
    with pytest.raises(UserError, match=f"in config file .*did you mean '{nearest}'"):
        build_config("train", str(toml))


@pytest.mark.parametrize("item,message", [
    ("batch_size=abc", "'batch_size' expects an integer, got 'abc'"),
    ("batch_size=1.5", "'batch_size' expects an integer"),
    ("learning_rate=fast", "'learning_rate' expects a number"),
    ("use_compile=maybe", "'use_compile' expects a boolean"),
    ("use_compile=2", "'use_compile' expects a boolean"),
])
def test_bad_values_name_field_type_and_value(item, message):
    with pytest.raises(UserError, match=message):
        build_config("train", overrides=parse_set([item]))


@pytest.mark.parametrize("text,value", [("true", True), ("1", True), ("yes", True), ("on", True),
                                        ("false", False), ("0", False), ("no", False), ("OFF", False)])
def test_bool_spellings(text, value):
    assert build_config("train", overrides=parse_set([f"use_compile={text}"])).training.use_compile is value


def test_int_accepts_exact_scientific():
    assert build_config("train", overrides=parse_set(["save_steps=1e3"])).run.save_steps == 1000
    with pytest.raises(UserError):
        build_config("train", overrides=parse_set(["save_steps=1.5e0"]))


def test_lists_from_set_and_toml(tmp_path):
    cfg = build_config("train", overrides=parse_set(["reward_funcs=correctness,xmlcount",
                                                      "reward_weights=[2, 0.5]"]))
    assert cfg.rewards.reward_funcs == ["correctness", "xmlcount"] and cfg.rewards.reward_weights == [2.0, 0.5]


def test_missing_config_file_is_error(tmp_path):
    with pytest.raises(UserError, match="config file not found"):
        build_config("train", str(tmp_path / "nope.toml"))


def test_key_for_other_command_rejected():
    with pytest.raises(UserError, match="does not apply to 'generate'"):
        build_config("generate", overrides=parse_set(["learning_rate=1"]))


@pytest.mark.parametrize("items,message", [
    (["max_completion_length=100"], "max_completion_length' .* is gone: set max_new_tokens instead"),
    (["num_generations=1"], "num_generations must be >= 2"),
    (["reward_weights=1,2"], "reward_weights has 2 entries but reward_funcs has 5"),
    (["top_p=0"], "top_p must be in"),
    (["temperature=0"], "temperature must be > 0"),
    (["lr_scheduler_type=step"], "lr_scheduler_type must be"),
    (["eval_samples=20"], "eval_samples only sizes the eval_steps evaluations"),
    (["loss_type=dr-grpo"], "loss_type must be one of grpo, bnpo, dr_grpo, dapo, cispo, sapo, got 'dr-grpo'; did you "
     "mean 'dr_grpo'"),
    (["cispo_cap=3"], "cispo_cap only applies with loss_type cispo; drop it"),
    (["loss_type=cispo", "cispo_cap=0.5", "num_iterations=2"], "cispo_cap must be >= 1"),
    (["loss_type=cispo", "cispo_cap=3"], "cispo_cap has no effect here"),
    (["loss_type=cispo", "clip_eps_high=0.28", "num_iterations=2"],
     "clip_eps_high only applies with loss_type grpo or bnpo or dr_grpo or dapo"),
    (["loss_type=sapo", "sapo_temperature_neg=0", "num_iterations=2"], "sapo temperatures must be > 0"),
    (["sapo_temperature_pos=2", "num_iterations=2"], "sapo_temperature_pos only applies with loss_type sapo"),
    (["loss_type=sapo", "sapo_temperature_pos=2"], "sapo_temperature_pos has no effect here"),
    (["scale_rewards=std"], "scale_rewards must be one of group, batch, none"),
    (["importance_sampling_level=seq"], "did you mean 'sequence'"),
    (["kl_estimator=k2"], "kl_estimator must be one of k3, k1"),
    (["delta=1.1"], r"delta must be 0 \(off\) or > 1 \+ clip_eps_high = 1.2"),
    (["clip_eps_high=0.28", "delta=1.25"], "> 1 \\+ clip_eps_high = 1.28"),
    (["overlong_penalty=1"], "overlong_penalty needs 0 < overlong_buffer <= max_new_tokens"),
    (["overlong_penalty=1", "overlong_buffer=300"], "overlong_buffer <= max_new_tokens"),
    (["lora_rank=8"], "lora_rank only apply with train_type = lora or dora"),
    (["train_type=qlora"], "train_type must be one of full, lora, dora"),
    (["train_type=lora", "lora_rank=0"], "lora_rank must be >= 1"),
    (["train_type=lora", "lora_dropout=1"], "lora_dropout must be in"),
    (["train_type=lora", "lora_dropout=0.1", "grad_checkpoint=true"], "lora_dropout with grad_checkpoint"),
    (["clip_eps_high=0.28"], "clip_eps_high has no effect here: with num_iterations = 1 and update_every = 1"),
    (["delta=4"], "delta has no effect here"),
    (["importance_sampling_level=sequence"], "importance_sampling_level has no effect here"),
    (["kl_coeff=0", "kl_estimator=k1"], "kl_estimator only applies with kl_coeff > 0"),
    (["overlong_buffer=16"], "overlong_buffer only applies with overlong_penalty > 0"),
    (["max_resample_batches=5"], "max_resample_batches only applies with dynamic_sampling = true"),
    (["reward_workers=2", "dynamic_sampling=true"], "reward_workers does nothing with dynamic_sampling"),
    (["dynamic_sampling_reward=reasoned_correctness"], "dynamic_sampling_reward only applies with dynamic_sampling"),
    (["dynamic_sampling=true", "dynamic_sampling_reward=accuracy"],
     "dynamic_sampling_reward must name one of the run's rewards"),
    (["reward_workers=2", "kl_coeff=0"], "reward_workers has nothing to overlap with"),
    (["reward_executor=process"], "reward_executor only applies with reward_workers > 0"),
])

def test_cross_field_rules(items, message):
    with pytest.raises(UserError, match=message):
        build_config("train", overrides=parse_set(items))


@pytest.mark.parametrize("items", [["clip_eps_high=0.28", "num_iterations=2"], ["delta=4", "update_every=2"],
                                   ["importance_sampling_level=sequence", "quantize_for_rollouts=true"],
                                   ["loss_type=cispo"], ["loss_type=cispo", "cispo_cap=2", "num_iterations=2"],
                                   ["loss_type=sapo"], ["loss_type=sapo", "sapo_temperature_neg=2", "update_every=2"]])
def test_off_policy_options_accepted_where_the_ratio_moves(items):
    build_config("train", overrides=parse_set(items))


def test_set_requires_key_value():
    with pytest.raises(UserError, match="key=value"):
        parse_set(["oops"])


def test_resolved_config_round_trips(tmp_path):
    cfg = build_config("train", overrides=parse_set(["batch_size=7", "stop=</answer>"]))
    save_json(cfg, tmp_path / "c.json")
    assert from_json(tmp_path / "c.json") == cfg
    assert json.loads((tmp_path / "c.json").read_text())["batch_size"] == 7


def test_objective_help_cites_papers(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["train", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    for citation in ("Dr. GRPO, Liu et al. 2025", "DAPO, Yu et al. 2025", "GSPO, Zheng et al. 2025",
                     "DeepSeekMath, Shao et al. 2024", "Hu et al. 2021", "Dettmers et al. 2023"):
        assert citation in out


@pytest.mark.parametrize("command", [c for c in DESCRIPTIONS if fields_for(c)])
def test_help_lists_every_field_with_default(command, capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args([command, "--help"])
    out = " ".join(capsys.readouterr().out.split())
    for name in fields_for(command):
        assert f"--{name.replace('_', '-')}" in out
    assert "(default: " in out


def test_cli_bad_input_is_one_line_and_exit_2(capsys):
    assert main(["generate", "--prompt", "hi", "--set", "temprature=1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "did you mean 'temperature'" in err and "Traceback" not in err


def test_cli_flag_equals_set():
    from mlx_grpo.commands.cli import _config_from_args

    args = build_parser().parse_args(["generate", "--temperature", "0.5", "--max-tokens", "9"])
    cfg = _config_from_args("generate", args)
    assert cfg.rollout.temperature == 0.5 and cfg.rollout.max_new_tokens == 9


def test_preset_serves_train_and_eval(tmp_path):
    toml = tmp_path / "c.toml"
    toml.write_text('learning_rate = 2e-6\neval_subset_size = 7\n')
    assert build_config("eval", str(toml)).eval.eval_subset_size == 7  # train-only key skipped for eval
    toml.write_text('learning_rate = "fast"\n')
    with pytest.raises(UserError, match="'learning_rate' expects a number"):
        build_config("eval", str(toml))  # but still type-checked


PRESETS = sorted((Path(__file__).parent.parent / "configs").glob("*.toml"))


@pytest.mark.parametrize("preset", PRESETS, ids=lambda p: p.name)
def test_presets_load_and_comment_every_key(preset):
    """Every shipped preset is valid for train and eval, and each block of keys opens with a comment."""
    cfg = build_config("train", str(preset))
    assert build_config("eval", str(preset)).model.model_name == cfg.model.model_name
    blocks = [block.splitlines() for block in preset.read_text().split("\n\n") if block.strip()]
    for lines in blocks:
        assert lines[0].startswith("#") or not any("=" in line for line in lines), (preset.name, lines[0])


def test_bad_inputs_get_one_line():
    """Inputs a new user gets wrong: each is refused with a line that says what to do."""
    with pytest.raises(UserError, match="stop strings must not be empty"):
        build_config("train", overrides=parse_set(['stop=[""]']))
    with pytest.raises(UserError, match="does not apply to 'eval'"):
        build_config("eval", overrides=parse_set(["max_new_tokens=10"]))  # eval_max_new_tokens sizes answers


def test_abbreviated_flags_are_refused_and_eval_max_tokens_sizes_answers(capsys):
    from mlx_grpo.commands.cli import build_parser

    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(["train", "--learning-rat", "1"])
    assert exit_info.value.code == 2 and "unrecognized arguments: --learning-rat" in capsys.readouterr().err
    args = build_parser().parse_args(["eval", "--max-tokens", "7"])
    assert args.field__eval_max_new_tokens == "7"
