"""Worked examples in prompts (prompts.py): drawn from the training split only, never an evaluation question,
left out of training, the same seed giving the same prompt, and the one system prompt that training rollouts
and evaluation encode."""

import json
from pathlib import Path

import pytest

from mlx_grpo import evaluate
from mlx_grpo import run as run_mod
from mlx_grpo.assembly import build_trainer
from mlx_grpo.config import build_config, parse_set
from mlx_grpo.data import Example, load_examples, load_file, make_arith
from mlx_grpo.errors import UserError
from mlx_grpo.prompts import (RunPrompt, WorkedExamples, draw_worked_examples, run_prompt,
                              select_worked_examples)
from mlx_grpo.solutions import Style, reference_completion

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
    trainer = build_trainer(cfg)
    try:
        shown = trainer.worked.examples[0]
        assert shown.prompt in trainer.prompt.system and trainer.eval_prompt is trainer.prompt
        assert all(e.prompt != shown.prompt for e in trainer.train_examples + trainer.eval_examples)
        encoded = {}
        original = run_mod.answer_records

        def spy(*args, **kwargs):
            encoded["eval"] = kwargs["system_prompt"]
            return original(*args, **kwargs)

        trainer_ids = trainer.encode(trainer.train_examples[:2])[0][0]
        assert trainer.tokenizer.decode(trainer_ids).count(shown.prompt) == 1
    finally:
        trainer.reward_runner.close()
    out = capsys.readouterr().out
    assert "[mlx-grpo] prompt: the system prompt with 1 worked example (train #" in out
    assert "tokens for the worked examples; longest prompt" in out
    run_mod.answer_records = spy
    try:
        run = run_mod.train(train_cfg(tiny_model_dir, tmp_path, "worked_examples=1", "eval_every_updates=1",
                                      "eval_subset_size=2", "run_name=e"))
    finally:
        run_mod.answer_records = original
    assert encoded["eval"] == trainer.prompt.system
    assert json.loads((run / "eval.jsonl").read_text().splitlines()[-1])["worked_examples"] == 1
    # `mlx-grpo eval` draws the same example for the same seed, or evaluates without it when told
    eval_items = [f"model_name={tiny_model_dir}", "eval_max_new_tokens=4", "eval_subset_size=2",
                  "arith_max_steps=1", "worked_examples=1", "max_prompt_length=2048"]
    evaluate.run_eval(cfg_for("eval", *eval_items), output=str(tmp_path / "with.jsonl"))
    recorded = json.loads((tmp_path / "with.jsonl.config.json").read_text())["command_options"]["prompt"]
    assert recorded["system_prompt"] == trainer.prompt.system and recorded["worked_examples"] == 1
    evaluate.run_eval(cfg_for("eval", *eval_items, "eval_worked_examples=false"), output=str(tmp_path / "w.jsonl"))
    bare = json.loads((tmp_path / "w.jsonl.config.json").read_text())["command_options"]["prompt"]
    assert bare == {"worked_examples": 0, "sources": [], "system_prompt": cfg.data.system_prompt}
    err = capsys.readouterr().err
    assert "evaluating with the system prompt with 1 worked example (train #" in err
    assert "evaluating with the system prompt without worked examples" in err


def test_examples_that_overflow_the_prompt_are_refused(tiny_model_dir, tmp_path):
    with pytest.raises(UserError, match="over max_prompt_length = 96: .*raise max_prompt_length"):
        build_trainer(train_cfg(tiny_model_dir, tmp_path, "worked_examples=3", "max_prompt_length=96"))


def test_tool_runs_show_calculator_calls(tiny_model_dir, tmp_path):
    trainer = build_trainer(train_cfg(tiny_model_dir, tmp_path, "worked_examples=1", "tools=calculator",
                                      "tool_format=plain"))
    try:
        shown = trainer.worked.examples[0]
        assert reference_completion(shown, Style(tools=trainer.multiturn.fmt)) in trainer.prompt.system
        assert "<calc>" in trainer.prompt.system and "</calc><result>" in trainer.prompt.system
    finally:
        trainer.reward_runner.close()
    assert WorkedExamples() == WorkedExamples((), ())
