"""`--dataset` as a file, a directory or a hub id, with the prompt/answer columns detected or named
(data/sources.py); starting `train` from a model and a data set alone, without a config."""

import json
import sys
import types
from pathlib import Path

import pytest

from mlx_grpo.base.errors import UserError
from mlx_grpo.commands.cli import main
from mlx_grpo.config import build_config, parse_set
from mlx_grpo.data.examples import Example
from mlx_grpo.data.sources import dataset_kind, detect_columns, final_answer, load_examples

FIXTURES = Path(__file__).parent / "fixtures"


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.parametrize("keys, expected", [
    (["prompt", "answer"], ("prompt", "answer")),
    (["question", "answer"], ("question", "answer")),
    (["problem", "solution", "level"], ("problem", "solution")),
    (["query", "ground_truth"], ("query", "ground_truth")),
    (["instruction", "input", "output"], ("instruction", "output")),  # instruction wins over input
    (["input", "target"], ("input", "target")),
    (["question", "final_answer", "answer"], ("question", "answer")),  # answer before final_answer
    (["text", "label", "prompt"], ("prompt", "label")),
])
def test_columns_are_detected_in_order(keys, expected):
    assert detect_columns(keys, "d.jsonl") == expected


def test_named_columns_win_and_must_exist():
    assert detect_columns(["q", "a", "answer"], "d.jsonl", prompt_column="q", answer_column="a") == ("q", "a")
    with pytest.raises(UserError, match=r"d\.jsonl: no column 'qq' \(prompt_column\); its columns are: q, a$"):
        detect_columns(["q", "a"], "d.jsonl", prompt_column="qq")
    with pytest.raises(UserError, match="both column 'q'"):
        detect_columns(["q"], "d.jsonl", prompt_column="q", answer_column="q")


def test_missing_columns_are_one_line_naming_the_columns_found():
    with pytest.raises(UserError) as err:
        detect_columns(["text", "gold"], "d.jsonl")
    msg = str(err.value)
    assert "\n" not in msg and "no prompt column among its columns (text, gold)" in msg and "prompt_column=" in msg
    with pytest.raises(UserError, match=r"no answer column among its columns \(prompt, gold\).*answer_column="):
        detect_columns(["prompt", "gold"], "d.jsonl")


@pytest.mark.parametrize("text, gold", [
    ("Half of 10 is 5.\n#### 1,234", "1234"),
    ("So the answer is $\\boxed{\\frac{1}{2}}$.", "\\frac{1}{2}"),
    ("\\boxed{1} first, then \\boxed{x^{2}}", "x^{2}"),
    ("  42 ", "42"),
    ("\\boxed{unclosed", "\\boxed{unclosed"),
])
def test_final_answer_of_a_solution_text(text, gold):
    assert final_answer(text) == gold


def test_dataset_kinds(tmp_path):
    (tmp_path / "dir").mkdir()
    assert [dataset_kind(n) for n in ("arith", "gsm8k", "train.jsonl", "d.Parquet", str(tmp_path / "dir"),
                                      "AI-MO/NuminaMath-TIR", "gsm9k")] == \
        ["builtin", "builtin", "file", "file", "directory", "hub", "unknown"]


def test_a_file_with_other_columns_loads_and_keeps_the_rest(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [
        {"problem": "1+1?", "solution": "It is \\boxed{2}.", "level": 1},
        {"problem": "2+2?", "solution": "#### 4", "level": 2}])
    examples = load_examples(str(path), "train", None, 0)
    assert examples == [Example("1+1?", "2", {"level": 1}), Example("2+2?", "4", {"level": 2})]
    # The same file as dataset_path, with the columns named: the answer column is another one.
    named = load_examples("arith", "train", str(path), 0, prompt_column="problem", answer_column="level")
    assert [(ex.answer, ex.columns) for ex in named] == [("1", {"solution": "It is \\boxed{2}."}),
                                                         ("2", {"solution": "#### 4"})]
    # A column called answer that is not the one named is left out (it would collide with the gold answer).
    path = write_jsonl(tmp_path / "e.jsonl", [{"q": "a", "gold": "1", "answer": "other"}])
    assert load_examples(str(path), "train", None, 0, prompt_column="q", answer_column="gold") == [
        Example("a", "1", {})]


def test_the_old_file_forms_load_as_before():
    from mlx_grpo.data.examples import load_file

    for name in ("gsm8k_tiny.jsonl", "generic_tiny.jsonl"):
        assert load_examples(str(FIXTURES / name), "train", None, 0) == load_file(FIXTURES / name)


def test_a_row_without_the_detected_column_names_its_line(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"problem": "a", "solution": "1"}, {"problem": "b"}])
    with pytest.raises(UserError, match=r"d\.jsonl:2: row has no 'solution' column \(keys: problem\)"):
        load_examples(str(path), "train", None, 0)


def _fake_datasets(monkeypatch, rows_by_split):
    calls = []

    def load_dataset(name, split=None, **kwargs):
        calls.append((name, split))
        if split not in rows_by_split:
            raise ValueError(f'Unknown split "{split}". Should be one of {list(rows_by_split)}.')
        return rows_by_split[split]

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    return calls


def test_a_hub_id_loads_its_split_through_datasets(monkeypatch):
    calls = _fake_datasets(monkeypatch, {"train": [{"question": "Q1", "final_answer": "7"},
                                                   {"question": "Q2", "final_answer": "8"}]})
    examples = load_examples("owner/data", "train", None, 0)
    assert calls == [("owner/data", "train")]
    assert [(ex.prompt, ex.answer) for ex in examples] == [("Q1", "7"), ("Q2", "8")]
    with pytest.raises(UserError, match=r"could not load hub data set 'owner/data' split 'test' \(ValueError: "
                                        r"Unknown split"):
        load_examples("owner/data", "test", None, 0)


def test_a_hub_id_without_the_data_extra_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # import fails as when it is not installed
    with pytest.raises(UserError, match=r"dataset 'owner/data' \(a hub id\) needs the 'datasets' package: "
                                        r"bash scripts/setup.sh data"):
        load_examples("owner/data", "train", None, 0)


def test_a_data_set_directory_loads_through_datasets(monkeypatch, tmp_path):
    calls = _fake_datasets(monkeypatch, {"train": [{"prompt": "p", "answer": "1"}]})
    assert load_examples(str(tmp_path), "train", None, 0) == [Example("p", "1", {})]
    assert calls == [(str(tmp_path), "train")]


def test_config_accepts_paths_and_hub_ids_but_not_unknown_names():
    assert build_config("train", overrides=parse_set(["dataset=owner/data"])).data.dataset == "owner/data"
    cfg = build_config("eval", overrides=parse_set(["dataset=train.jsonl", "prompt_column=q"]))
    assert cfg.data.prompt_column == "q"
    with pytest.raises(UserError, match=r"got 'gsm9k' \(did you mean 'gsm8k'\?\)"):
        build_config("train", overrides=parse_set(["dataset=gsm9k"]))
    with pytest.raises(UserError, match="prompt_column only applies with a data file, directory or hub id"):
        build_config("train", overrides=parse_set(["prompt_column=q"]))  # the built-in arith has its own


def test_columns_not_found_is_one_line_and_exit_2(tiny_model_dir, tmp_path, capsys):
    data = write_jsonl(tmp_path / "d.jsonl", [{"text": "a", "gold": "1"}] * 2)
    code = main(["train", "--model", str(tiny_model_dir), "--dataset", str(data), "--output-dir", str(tmp_path)])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1
    assert "no prompt column among its columns (text, gold)" in err


def test_train_from_a_model_and_a_data_file_without_a_config(tiny_model_dir, tmp_path):
    data = write_jsonl(tmp_path / "train.jsonl", [{"problem": f"What is {i} + 1?", "solution": f"\\boxed{{{i + 1}}}"}
                                                  for i in range(4)])
    code = main(["train", "--model", str(tiny_model_dir), "--dataset", str(data), "--output-dir", str(tmp_path),
                 "--batch-size", "2", "--num-generations", "2", "--max-new-tokens", "4"])
    assert code == 0
    run_dir = tmp_path / "grpo"
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == 2  # 4 examples, 2 per update, 1 epoch
    assert (run_dir / "checkpoint-2").is_dir()
    resolved = json.loads((run_dir / "config.resolved.json").read_text())
    assert resolved["dataset"] == str(data) and resolved["prompt_column"] == ""
