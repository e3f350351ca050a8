"""`mlx-grpo eval`: accuracy counting, pass@k, per-example JSONL, and the CLI's errors."""

import json
from pathlib import Path

import numpy as np

from mlx_grpo import evaluate
from mlx_grpo.cli import main
from mlx_grpo.config import build_config, parse_set
from mlx_grpo.rollout import Rollout

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

    def scripted(engine, jobs, group, params, prefill=""):
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
