"""Worked examples in prompts (data/prompts.py): drawn from the training split only, never an evaluation question,
left out of training, the same seed giving the same prompt, and the one system prompt that training rollouts
and evaluation encode."""

import json
from pathlib import Path

import pytest

from mlx_grpo.base.errors import UserError
from mlx_grpo.commands import assembly as assembly_mod
from mlx_grpo.commands import evaluate
from mlx_grpo.commands import train as run_mod
from mlx_grpo.commands.assembly import build_job
from mlx_grpo.config import build_config, parse_set
from mlx_grpo.data.examples import Example, load_examples, load_file, make_arith
from mlx_grpo.data.prompts import (RunPrompt, WorkedExamples, draw_worked_examples, run_prompt,
                              select_worked_examples)
from mlx_grpo.data.solutions import Style, reference_completion

FIXTURES = Path(__file__).parent / "fixtures"


def cfg_for(command, *items):
    return build_config(command, overrides=parse_set(list(items)))


def test_draw_skips_evaluation_questions_and_rows_without_solutions():
    train = load_file(FIXTURES / "gsm8k_solutions.jsonl") + [Example("no worked solution here", "3")]
    evals = train[:5]  # a file whose questions overlap the training file's
    for seed in range(30):
        drawn = draw_worked_examples(train, 2, seed, [e.prompt for e in evals])
        assert len(drawn) == 2 and all(i in (5, 6, 7) for i in drawn)
    with pytest.raises(UserError, match="only 3 training examples carry a worked solution"):
        draw_worked_examples(train, 4, 0, [e.prompt for e in evals])


def test_same_seed_same_prompt_and_drawn_examples_leave_training():
    cfg = cfg_for("train", "worked_examples=2", "worked_examples_seed=5")
    train, test = make_arith(100, 42), load_examples("arith", "test", None, 42, arith_size=100)
    worked, rest = select_worked_examples(cfg, train, test)
    again, _ = select_worked_examples(cfg, make_arith(100, 42), test)
    assert worked == again and len(worked.examples) == 2
    assert run_prompt("S", worked.examples).system == run_prompt("S", again.examples).system
    assert len(rest) == 98 and not {e.prompt for e in worked.examples} & {e.prompt for e in rest}
    assert not {e.prompt for e in worked.examples} & {e.prompt for e in test}
    other, _ = select_worked_examples(cfg_for("train", "worked_examples=2", "worked_examples_seed=6"), train, test)
    assert other.indices != worked.indices


def test_system_prompt_shows_question_then_completion():
    example = make_arith(1, 42, max_steps=1)[0]
    prompt = run_prompt("\nRespond in the format.\n", [example], ["Example question: written\nExample response: 2"],
                        indices=[7])
    assert prompt.system == ("\nRespond in the format.\n\nExample question: " + example.prompt + "\nExample response:\n"
                             + reference_completion(example) + "\n\nExample question: written\nExample response: 2\n")
    assert prompt.sources == ("train #7", "worked_examples_text #1")
    assert prompt.describe() == ("the system prompt with 2 worked examples (train #7, worked_examples_text #1)")
    assert run_prompt("S") == RunPrompt("S") and "without worked examples" in RunPrompt("S").describe()


def test_written_example_with_an_evaluation_question_is_refused():
    test = load_examples("arith", "test", None, 42, arith_size=20)
    cfg = cfg_for("train", f"worked_examples_text=[{json.dumps('Q: ' + test[3].prompt + ' A: 1')}]")
    with pytest.raises(UserError, match="worked_examples_text #1 shows an evaluation question"):
        select_worked_examples(cfg, make_arith(20, 42), test)


def train_cfg(model_dir, out, *items):
    return cfg_for("train", f"model_name={model_dir}", f"output_dir={out}", "batch_size=2", "num_generations=2",
                   "max_new_tokens=4", "max_train_samples=4", "log_completions_steps=0", "save_steps=0",
                   "arith_max_steps=1", "reward_funcs=reasoned_correctness,reasoned_format", "max_prompt_length=2048",
                   *items)


def test_training_and_evaluation_encode_the_run_prompt(tiny_model_dir, tmp_path, capsys):
    cfg = train_cfg(tiny_model_dir, tmp_path, "worked_examples=1", "eval_every_updates=1", "eval_subset_size=2")
    job = build_job(cfg)
    try:
        shown = job.worked.examples[0]
        assert shown.prompt in job.prompt.system and job.eval_prompt is job.prompt
        assert all(e.prompt != shown.prompt for e in job.train_examples + job.eval_examples)
        encoded = {}
        original = assembly_mod.answer_records

        def spy(*args, **kwargs):
            encoded["eval"] = kwargs["system_prompt"]
            return original(*args, **kwargs)

        trainer_ids = job.sampling.encode(job.train_examples[:2])[0][0]
        assert job.tokenizer.decode(trainer_ids).count(shown.prompt) == 1
    finally:
        job.sampling.reward_runner.close()
    out = capsys.readouterr().out
    assert "[mlx-grpo] prompt: the system prompt with 1 worked example (train #" in out
    assert "tokens for the worked examples; longest prompt" in out
    assembly_mod.answer_records = spy
    try:
        run = run_mod.train(train_cfg(tiny_model_dir, tmp_path, "worked_examples=1", "eval_every_updates=1",
                                      "eval_subset_size=2", "run_name=e"))
    finally:
        assembly_mod.answer_records = original
    assert encoded["eval"] == job.prompt.system
    assert json.loads((run / "eval.jsonl").read_text().splitlines()[-1])["worked_examples"] == 1
    # `mlx-grpo eval` draws the same example for the same seed, or evaluates without it when told
    eval_items = [f"model_name={tiny_model_dir}", "eval_max_new_tokens=4", "eval_subset_size=2",
                  "arith_max_steps=1", "worked_examples=1", "max_prompt_length=2048"]
    evaluate.run_eval(cfg_for("eval", *eval_items), output=str(tmp_path / "with.jsonl"))
    recorded = json.loads((tmp_path / "with.jsonl.config.json").read_text())["command_options"]["prompt"]
    assert recorded["system_prompt"] == job.prompt.system and recorded["worked_examples"] == 1
    evaluate.run_eval(cfg_for("eval", *eval_items, "eval_worked_examples=false"), output=str(tmp_path / "w.jsonl"))
    bare = json.loads((tmp_path / "w.jsonl.config.json").read_text())["command_options"]["prompt"]
    assert bare == {"worked_examples": 0, "sources": [], "system_prompt": cfg.data.system_prompt}
    err = capsys.readouterr().err
    assert "evaluating with the system prompt with 1 worked example (train #" in err
    assert "evaluating with the system prompt without worked examples" in err


def test_examples_that_overflow_the_prompt_are_refused(tiny_model_dir, tmp_path):
    with pytest.raises(UserError, match="over max_prompt_length = 96: .*raise max_prompt_length"):
        build_job(train_cfg(tiny_model_dir, tmp_path, "worked_examples=3", "max_prompt_length=96"))


def test_tool_runs_show_calculator_calls(tiny_model_dir, tmp_path):
    job = build_job(train_cfg(tiny_model_dir, tmp_path, "worked_examples=1", "tools=calculator",
                                      "tool_format=plain"))
    try:
        shown = job.worked.examples[0]
        assert reference_completion(shown, Style(tools=job.sampling.prompts.multiturn.fmt)) in job.prompt.system
        assert "<calc>" in job.prompt.system and "</calc><result>" in job.prompt.system
    finally:
        job.sampling.reward_runner.close()
    assert WorkedExamples() == WorkedExamples((), ())


def test_worked_examples_that_leave_less_than_a_batch_are_named(tiny_model_dir, tmp_path, capsys):
    """worked_examples = 4 on a 4-row file: the line says all 4 became examples (train and sft, one line, exit 2,
    nothing written; the sampler's "the data set has 0 examples" would not say why). eval trains on nothing:
    it may show them all."""
    from mlx_grpo.commands.cli import main

    data = tmp_path / "four.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"What is {i} + {i}?", "answer": str(2 * i),
                                        "solution": f"{i} + {i} = {2 * i}"}) + "\n" for i in range(1, 5)))
    common = ["--model", str(tiny_model_dir), "--set", f"dataset_path={data}", "--set",
              f"output_dir={tmp_path / 'runs'}", "--set", "batch_size=2", "--set", "max_prompt_length=2048"]
    assert main(["train", *common, "--set", "worked_examples=4"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "mlx-grpo train: error: worked_examples = 4 takes all 4 training examples into the prompt (an example shown "
        "is not trained on), leaving 0 to train on, fewer than batch_size = 2: lower worked_examples or add training "
        "data"]
    assert main(["sft", *common, "--set", "worked_examples=3", "--set", "prefill=<reasoning>\n"]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("mlx-grpo sft: error: worked_examples = 3 takes 3 of the 4 training examples into the "
                           "prompt (an example shown is not trained on), leaving 1 to train on, fewer than batch_size")
    assert not (tmp_path / "runs").exists()
    assert main(["eval", "--model", str(tiny_model_dir), "--set", f"dataset_path={data}", "--set",
                 f"eval_dataset_path={FIXTURES / 'gsm8k_tiny.jsonl'}", "--set", "worked_examples=4", "--set",
                 "max_prompt_length=2048", "--samples", "1", "--max-tokens", "2", "-o", str(tmp_path / "e.jsonl")]) == 0
    assert "with 4 worked examples" in capsys.readouterr().err
