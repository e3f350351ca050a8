"""A table of inputs people get wrong, run through the command line as a user would: each one ends with
exit status 2, one error line, no traceback and nothing written."""

from __future__ import annotations

import json

import pytest

from mlx_grpo.commands.cli import main


@pytest.fixture
def files(tmp_path, tiny_model_dir):
    d = tmp_path / "inputs"
    d.mkdir()
    (d / "bad.jsonl").write_text('{"question": "q", "answer": "#### 1"}\nnot json\n')
    (d / "empty.jsonl").write_text("")
    (d / "noanswer.jsonl").write_text(json.dumps({"question": "q"}) + "\n")
    (d / "rw.py").write_text("def f(prompts, completions, completion_ids, **k):\n    return [0.0] * len(completions)\n")
    (d / "broken.py").write_text("def f(:\n")
    (d / "bad.toml").write_text("x = [\n")
    (d / "unknown.toml").write_text("learnin_rate = 1e-5\n")
    (d / "a_file").write_text("not a directory")
    (d / "long.jsonl").write_text(json.dumps({"prompt": "x " * 1500, "answer": "1"}) + "\n")
    (d / "nocompletion.jsonl").write_text(json.dumps({"prompt": "q", "completion": ""}) + "\n")
    (d / "nocolumns.jsonl").write_text(json.dumps({"text": "q"}) + "\n")
    (d / "sft.jsonl").write_text(json.dumps({"prompt": "q", "completion": "a"}) + "\n")
    (d / "noconfig").mkdir()
    (d / "unknownfamily").mkdir()
    (d / "unknownfamily" / "config.json").write_text(json.dumps({"model_type": "foo_bar"}))
    (d / "notckpt").mkdir()
    (d / "run" / "grpo").mkdir(parents=True)
    return {"d": d, "model": str(tiny_model_dir)}


# (command line after `mlx-grpo`, a regex the one error line must match). {d}: the inputs folder,
# {model}: a tiny model, {out}: the output folder that must stay empty.
TRAIN = ["train", "--set", "model_name={model}", "--set", "output_dir={out}", "--set", "system_prompt="]
SFT = ["sft", "--set", "model_name={model}", "--set", "output_dir={out}"]
CASES = {
    # config
    "unknown key": (TRAIN + ["--set", "learnin_rate=1"], r"unknown config key 'learnin_rate'.*learning_rate"),
    "unknown key in a file": (TRAIN + ["--config", "{d}/unknown.toml"], r"unknown config key 'learnin_rate'"),
    "config file missing": (TRAIN + ["--config", "{d}/nope.toml"], r"config file not found"),
    "config not TOML": (TRAIN + ["--config", "{d}/bad.toml"], r"is not valid TOML"),
    "config is a directory": (TRAIN + ["--config", "{d}/noconfig"], r"config .*noconfig is a directory, not a TOML file$"),
    "wrong type": (TRAIN + ["--set", "learning_rate=fast"], r"learning_rate' expects a number"),
    "set without =": (TRAIN + ["--set", "learning_rate"], r"--set expects key=value"),
    "one completion per group": (TRAIN + ["--set", "num_generations=1"], r"num_generations must be >= 2"),
    "greedy training": (TRAIN + ["--set", "temperature=0"], r"temperature must be > 0"),
    "empty stop string": (TRAIN + ["--set", 'stop=[""]'], r"stop strings must not be empty"),
    "top_p in training": (TRAIN + ["--set", "top_p=0.9"], r"off-policy"),
    "removed alias": (TRAIN + ["--set", "max_completion_length=64"], r"is gone: set max_new_tokens"),
    "misspelt loss": (TRAIN + ["--set", "loss_type=dr-grpo"], r"did you mean 'dr_grpo'"),
    "weights per reward": (TRAIN + ["--set", "reward_weights=1,2"], r"reward_weights has 2 entries"),
    "zero batch": (TRAIN + ["--set", "batch_size=0"], r"batch_size must be >= 1"),
    "unknown dtype": (TRAIN + ["--set", "model_dtype=fp8"], r"model_dtype must be"),
    "unknown correction": (TRAIN + ["--set", "rollout_correction=tis"], r"rollout_correction must be one of"),
    "async without correction": (TRAIN + ["--set", "async_rollouts=1"],
                                 r"async_rollouts = 1 .* set rollout_correction = \"token_truncate\""),
    "async with dynamic sampling": (TRAIN + ["--set", "async_rollouts=1", "--set", "rollout_correction=token_mask",
                                             "--set", "dynamic_sampling=true", "--set", "num_iterations=2"],
                                    r"async_rollouts = 1 does not support dynamic_sampling, num_iterations > 1: drop"),
    "carry without dynamic sampling": (TRAIN + ["--set", "carry_surplus=true"],
                                       r"carry_surplus only applies with dynamic_sampling = true"),
    "carry without correction": (TRAIN + ["--set", "dynamic_sampling=true", "--set", "carry_surplus=true"],
                                 r"carry_surplus trains groups sampled by the weights of an earlier update .* set rollout_correction = "
                                 r"\"token_truncate\""),
    "carry with demonstrations": (TRAIN + ["--set", "dynamic_sampling=true", "--set", "carry_surplus=true", "--set",
                                           "rollout_correction=token_truncate", "--set", "demonstrations=zero_groups"],
                                  r"carry_surplus keeps a draw's groups for the next update; demonstrations"),
    "carry with image prompts": (TRAIN + ["--set", "dynamic_sampling=true", "--set", "carry_surplus=true", "--set",
                                          "rollout_correction=token_truncate", "--set", "image_column=image"],
                                 r"carry_surplus keeps a draw's groups for the next update; demonstrations and image"),
    "async out of range": (TRAIN + ["--set", "async_rollouts=2"], r"async_rollouts must be 0-1"),
    "rollout process without async": (TRAIN + ["--set", "rollout_worker=process"],
                                      r"rollout_worker only applies with async_rollouts = 1"),
    "rollout process with tools": (TRAIN + ["--set", "async_rollouts=1", "--set", "rollout_correction=token_mask",
                                            "--set", "rollout_worker=process", "--set", "tools=[\"calculator\"]"],
                                   r"rollout_worker = process decodes single-turn rollouts only .* set rollout_worker "
                                   r"= thread"),
    "rollout worker unknown": (TRAIN + ["--set", "rollout_worker=gpu"], r"rollout_worker must be one of"),
    "running rows off the copy": (TRAIN + ["--set", "rollout_engine=model", "--set", "running_rows=1024"],
                                  r"running_rows only applies with the sampling copy \(rollout_engine = copy or auto"),
    "running rows negative": (TRAIN + ["--set", "running_rows=-1"], r"running_rows must be >= 0"),
    "lookahead off the copy": (TRAIN + ["--set", "rollout_engine=model", "--set", "lookahead=2"],
                               r"lookahead only applies with the sampling copy \(rollout_engine = copy or auto"),
    "lookahead past a sync": (TRAIN + ["--set", "lookahead=8"], r"lookahead must be 0-7"),
    "decode graph off the copy": (TRAIN + ["--set", "rollout_engine=model", "--set", "decode_graph=true"],
                                  r"decode_graph only applies with the sampling copy \(rollout_engine = copy or auto"),
    "decode graph on a quantized copy": (TRAIN + ["--set", "quantize_for_rollouts=true", "--set", "decode_graph=true"],
                                         r"decode_graph only applies with the sampling copy .*without "
                                         r"quantize_for_rollouts"),
    "lookahead with async": (TRAIN + ["--set", "async_rollouts=1", "--set", "rollout_correction=token_mask",
                                      "--set", "lookahead=2"], r"async_rollouts = 1 does not support lookahead"),
    "arith steps": (TRAIN + ["--set", "arith_max_steps=9"], r"arith_max_steps must be 1-4"),
    "arith steps for gsm8k": (TRAIN + ["--set", "dataset=gsm8k", "--set", "arith_max_steps=2"],
                              r"arith_max_steps only applies with dataset = arith"),
    "correction with dropout": (TRAIN + ["--set", "train_type=lora", "--set", "lora_dropout=0.1", "--set",
                                         "rollout_correction=token_truncate"], r"would weight dropout noise"),
    "train key for eval": (["eval", "--set", "learning_rate=1"], r"does not apply to 'eval'"),
    "abbreviated flag": (TRAIN + ["--learning-rat", "1"], r"unrecognized arguments: --learning-rat"),
    # data
    "prompts cut to nothing": (TRAIN + ["--set", "max_prompt_length=1"],
                               r"max_prompt_length = 1 would cut more than half of the tokens of 100% of the prompts "
                               r"\(median \d+ tokens -> 1\), removing their question: set max_prompt_length = \d+ "
                               r"\(fits every prompt\)"),
    "unknown dataset": (TRAIN + ["--set", "dataset=gsm9k"], r"dataset must be 'arith' or 'gsm8k'"),
    "data file missing": (TRAIN + ["--set", "dataset_path={d}/nope.jsonl"], r"data file not found"),
    "data line not JSON": (TRAIN + ["--set", "dataset_path={d}/bad.jsonl"], r"bad.jsonl:2: invalid JSON"),
    "empty data file": (TRAIN + ["--set", "dataset_path={d}/empty.jsonl"], r"the data set is empty"),
    "row without answer": (TRAIN + ["--set", "dataset_path={d}/noanswer.jsonl"], r"noanswer.jsonl"),
    # rewards
    "unknown reward": (TRAIN + ["--set", "reward_funcs=correctnes"], r"unknown reward function 'correctnes'"),
    "reward file missing": (TRAIN + ["--set", "reward_funcs={d}/nope.py:f"], r"reward file not found"),
    "reward function missing": (TRAIN + ["--set", "reward_funcs={d}/rw.py:g"], r"has no function 'g'.*found: f"),
    "reward file broken": (TRAIN + ["--set", "reward_funcs={d}/broken.py:f"], r"failed to import: SyntaxError"),
    "reward url scheme": (TRAIN + ["--set", "reward_url=ftp://127.0.0.1/x"], r"http:// or https://"),
    "reward url off the machine": (TRAIN + ["--set", "reward_url=http://scorer.example.com/"], r"is not loopback"),
    # tools and environments
    "unknown tool": (TRAIN + ["--set", 'tools=["calculater"]'], r"tool 'calculater': expected 'calculator'"),
    "tool without docstring": (TRAIN + ["--set", 'tools=["{d}/rw.py:f"]'], r"tool 'f'"),
    "tools and environment": (TRAIN + ["--set", 'tools=["calculator"]', "--set", "environment={d}/rw.py:f"],
                              r"set tools or environment, not both"),
    "environment not a class": (TRAIN + ["--set", "environment={d}/rw.py:f"], r"is not a subclass of"),
    "nanochat syntax, other tool": (TRAIN + ["--set", 'tools=["calculator","python"]', "--set", "tool_format=nanochat"],
                                    r"nanochat models call only the calculator"),
    "zero tool turns": (TRAIN + ["--set", 'tools=["calculator"]', "--set", "max_tool_turns=0"],
                        r"max_tool_turns must be >= 1"),
    # models
    "model missing": (["train", "--set", "model_name={d}/nope", "--set", "output_dir={out}"], r"not found"),
    "model without config": (["train", "--set", "model_name={d}/noconfig", "--set", "output_dir={out}"],
                             r"has no config.json"),
    "family mlx-lm does not know": (["train", "--set", "model_name={d}/unknownfamily", "--set", "output_dir={out}"],
                                    r"mlx-lm .* has no model family 'foo_bar'"),
    "rollout too large": (TRAIN + ["--set", "num_generations=100000", "--set", "max_new_tokens=1000"],
                          r"need at least .* GB"),
    # checkpoints and output
    "resume without checkpoint": (TRAIN + ["--resume"], r"--resume: no checkpoint found"),
    "resume a non-checkpoint": (TRAIN + ["--resume", "{d}/notckpt"], r"is not a checkpoint directory"),
    "output dir is a file": (["train", "--set", "model_name={model}", "--set", "output_dir={d}/a_file"],
                             r"cannot use the run directory"),
    # checked before the model loads: the model here does not exist, and the run directory's line comes first
    "output dir is a file, before the model": (["train", "--set", "model_name={d}/nope", "--set",
                                                "output_dir={d}/a_file"], r"cannot use the run directory .*a_file "
                                                                          "is not a directory"),
    "sft output dir is a file, before the model": (["sft", "--set", "model_name={d}/nope", "--set",
                                                    "output_dir={d}/a_file"], r"cannot use the run directory"),
    "eval output is a directory": (["eval", "--set", "model_name={model}", "--samples", "1", "-o", "{d}/notckpt"],
                                   r"is a directory"),
    "plot without metrics": (["plot", "{d}/notckpt"], r"metrics.jsonl"),
    # sft
    "sft empty completion": (SFT + ["--set", "dataset_path={d}/nocompletion.jsonl"], r"nocompletion.jsonl:1: the "
                             "completion is empty"),
    "sft row without columns": (SFT + ["--set", "dataset_path={d}/nocolumns.jsonl"],
                                r"missing 'prompt' and 'completion'"),
    "sft without solutions": (SFT + ["--set", "dataset_path={d}/long.jsonl"], r"no training example has a worked "
                              "solution"),
    "grpo key for sft": (SFT + ["--set", "num_generations=4"], r"does not apply to 'sft'"),
    "sft resume without checkpoint": (SFT + ["--set", "dataset_path={d}/sft.jsonl", "--set", "batch_size=1",
                                             "--resume"], r"--resume: no checkpoint found"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_is_one_line_exit_2_nothing_written(case, files, tmp_path, capsys):
    argv, pattern = CASES[case]
    out = tmp_path / "out"
    argv = [a.format(d=files["d"], model=files["model"], out=out) for a in argv]
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse's own errors
        code = exc.code
    captured = capsys.readouterr()
    err_lines = [line for line in captured.err.splitlines() if line.strip() and not line.startswith("usage:")
                 and not line.startswith("  ")]
    assert code == 2, (case, captured.err)
    assert len(err_lines) == 1 and "error" in err_lines[0], (case, captured.err)
    import re

    assert re.search(pattern, err_lines[0]), (case, err_lines[0])
    assert "Traceback" not in captured.out + captured.err
    after = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    new = [p for p in after if p not in before and not str(p).startswith("out")]
    assert new == [] and not any((out / "grpo").glob("*")), (case, new)


# Runs that cannot learn, found after their first update(s): one error line and exit 2 as above, the
# per-function lines on stdout, and on disk the logs of the updates that ran (no checkpoint: nothing learnt).
SMALL = ["--set", "max_train_samples=8", "--set", "batch_size=2", "--set", "num_generations=4", "--set",
         "max_new_tokens=8", "--set", "max_prompt_length=256", "--set", "log_completions_steps=0"]
REWARDS = ("def nothing(prompts, completions, completion_ids, **k):\n    return [None] * len(completions)\n"
           "def always(prompts, completions, completion_ids, **k):\n    return [1.0] * len(completions)\n")


def _train(argv, files, tmp_path, capsys):
    (files["d"] / "rewards.py").write_text(REWARDS)
    out = tmp_path / "out"
    code = main([a.format(d=files["d"], model=files["model"], out=out) for a in TRAIN + SMALL + argv])
    captured = capsys.readouterr()
    assert "Traceback" not in captured.out + captured.err
    return code, captured.out, [line for line in captured.err.splitlines() if line.strip()], out / "grpo"


def test_a_reward_that_returns_none_stops_the_run_after_its_first_update(files, tmp_path, capsys):
    code, out, err, run = _train(["--set", "reward_funcs={d}/rewards.py:nothing"], files, tmp_path, capsys)
    assert code == 2 and err == [
        "mlx-grpo train: error: no reward function scored any completion of update 1 ('nothing' returned None for "
        "every completion): nothing can be learnt; check the reward functions against the data's columns; set "
        "max_updates_without_signal = 0 to train on anyway"]
    assert ("[mlx-grpo] WARNING (update 1): reward 'nothing' returned None for every completion of update 1: None "
            "means 'not applicable', so it scored nothing and adds nothing to the reward") in out
    assert "zero reward variance under this run's rewards (nothing)" in out and "soft_format, xmlcount)," not in out
    assert sorted(p.name for p in run.iterdir()) == [".lock", "config.resolved.json", "metrics.jsonl"]
    (record,) = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert record["update_step"] == 1 and record["reward/nothing"] is None and "silent_reward/nothing" in record["warnings"]


def test_the_setting_lets_a_run_without_signal_go_on(files, tmp_path, capsys):
    code, out, err, run = _train(["--set", "reward_funcs={d}/rewards.py:nothing", "--set",
                                  "max_updates_without_signal=0"], files, tmp_path, capsys)
    assert code == 0 and err == [] and out.count("reward 'nothing' returned None") == 1  # said when it appears
    assert len((run / "metrics.jsonl").read_text().splitlines()) == 4 and (run / "checkpoint-4").is_dir()


def test_constant_rewards_stop_after_max_updates_without_signal(files, tmp_path, capsys):
    code, out, err, run = _train(["--set", "reward_funcs={d}/rewards.py:always,{d}/rewards.py:nothing", "--set",
                                  "max_updates_without_signal=2"], files, tmp_path, capsys)
    assert code == 2 and len(err) == 1 and err[0].startswith(
        "mlx-grpo train: error: no reward function gave any signal in 2 updates in a row (at update 2: 'always' "
        "returned 1, 'nothing' returned None for every completion), so every advantage was 0 and nothing was learnt")
    assert "reward 'always' returned 1 for every completion of update 1: one value for every completion" in out
    assert len((run / "metrics.jsonl").read_text().splitlines()) == 2 and not list(run.glob("checkpoint-*"))


def test_a_run_that_earns_every_reward_everywhere_ends_as_done_with_its_checkpoint(files, tmp_path, capsys):
    # a model that aces its data (after a warm start, say) is finished, not broken: exit 0, checkpoint kept
    code, out, err, run = _train(["--set", "reward_funcs={d}/rewards.py:always", "--set",
                                  "max_updates_without_signal=2"], files, tmp_path, capsys)
    assert code == 0 and err == []
    assert ("[mlx-grpo] every completion earned the same rewards in 2 updates in a row (at update 2: 'always' "
            "returned 1): nothing is left to learn from this data, so the run ends here") in out
    assert len((run / "metrics.jsonl").read_text().splitlines()) == 2 and (run / "checkpoint-2").is_dir()


def test_prompts_cut_are_reported_at_start(files, tmp_path, capsys):
    code, out, err, run = _train(["--set", "max_prompt_length=120", "--set", "max_updates_without_signal=0"],
                                 files, tmp_path, capsys)
    import re

    assert code == 0 and err == []
    line = out.splitlines()[0]
    assert re.fullmatch(r"\[mlx-grpo\] warning: max_prompt_length = 120 cuts \d+% of the prompts from the left "
                        r"\(median \d+ tokens -> 120; \d+ lose more than half\): raise max_prompt_length to \d+ "
                        r"to keep them whole", line), line
