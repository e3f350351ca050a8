"""Tests of mlx_grpo.data.examples: file loading and its errors, the hub wrapper (faked), arith, subsets,
EpochSampler."""

import json
import re
import sys
import types
from pathlib import Path

import pytest

from mlx_grpo.base.errors import UserError
from mlx_grpo.data.examples import (
    EpochSampler,
    Example,
    load_examples,
    load_file,
    load_gsm8k_hub,
    make_arith,
    parse_gsm8k_answer,
    reward_columns,
    subset,
)

FIXTURES = Path(__file__).parent / "fixtures"


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


@pytest.mark.parametrize("text, gold", [
    ("step\n#### 72", "72"),
    ("a #### 1 b\n#### 1,500 ", "1500"),  # the last marker wins, commas dropped
    ("####-3", "-3"),
])
def test_parse_gsm8k_answer(text, gold):
    assert parse_gsm8k_answer(text) == gold


@pytest.mark.parametrize("text", ["no marker 72", "####   "])
def test_parse_gsm8k_answer_rejects(text):
    with pytest.raises(ValueError):
        parse_gsm8k_answer(text)


def test_load_gsm8k_form():
    examples = load_file(FIXTURES / "gsm8k_tiny.jsonl")  # has a blank line, which is skipped
    assert [ex.answer for ex in examples] == ["72", "1500", "10"]
    assert examples[0].prompt.startswith("Natalia sold clips")
    assert examples[0].columns == {} and examples[1].columns == {"source": "made-up"}


def test_load_generic_form_with_chat_messages():
    examples = load_file(str(FIXTURES / "generic_tiny.jsonl"))
    assert examples[0] == Example("What is 2 + 3?", "5", {"difficulty": "easy"})
    assert examples[1].prompt == [{"role": "system", "content": "You are terse."},
                                  {"role": "user", "content": "What is 6 * 7?"}]
    assert examples[1].answer == "42"  # numbers become text
    assert examples[2].answer == "Paris" and examples[2].columns == {"tags": ["geo", "easy"]}


def test_reward_columns_unions_extra_columns():
    cols = reward_columns(load_file(FIXTURES / "generic_tiny.jsonl"))
    assert cols == {"answer": ["5", "42", "Paris"], "difficulty": ["easy", None, None],
                    "tags": [None, None, ["geo", "easy"]]}


def test_load_parquet(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"question": "q1", "answer": "x\n#### 3"}, {"question": "q2", "answer": "#### 4"}]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "train.parquet")
    assert [ex.answer for ex in load_file(tmp_path / "train.parquet")] == ["3", "4"]


def test_parquet_without_pyarrow(tmp_path, monkeypatch):
    (tmp_path / "d.parquet").write_bytes(b"PAR1")
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    with pytest.raises(UserError, match="pip install pyarrow"):
        load_file(tmp_path / "d.parquet")


def test_corrupt_parquet(tmp_path):
    (tmp_path / "d.parquet").write_bytes(b"not parquet")
    with pytest.raises(UserError, match=r"d\.parquet: not a readable Parquet file"):
        load_file(tmp_path / "d.parquet")


@pytest.mark.parametrize("rows, message", [
    (['{"prompt": "a", "answer": "1"}', '{"prompt": "b", "answer": '], r"bad\.jsonl:2: invalid JSON"),
    ([{"prompt": "a", "answer": "1"}, {"text": "b", "answer": "2"}],
     r"bad\.jsonl:2: row has neither 'question' nor 'prompt' \(keys: text, answer\)"),
    ([{"prompt": "a"}], r"bad\.jsonl:1: row is missing the 'answer' key"),
    ([{"question": "a", "answer": "1"}, {"question": "b", "answer": "42"}],
     r"bad\.jsonl:1: GSM8K answer has no '#### <final answer>' line"),
    ([{"question": "a", "answer": 3}], r"bad\.jsonl:1: GSM8K 'answer' must be text"),
    ([{"prompt": "a", "answer": None}], r"bad\.jsonl:1: 'answer' must be text or a number"),
    ([{"prompt": "", "answer": "1"}], r"bad\.jsonl:1: 'prompt' must be non-empty text"),
    ([{"prompt": [], "answer": "1"}], r"bad\.jsonl:1: 'prompt' is an empty list"),
    ([{"prompt": [{"role": "user"}], "answer": "1"}], r"bad\.jsonl:1: prompt message 0 must be"),
    (["[1, 2]"], r"bad\.jsonl:1: expected a JSON object per row, got list"),
    ([{"prompt": "a", "answer": "1", "completions": "x"}], r"bad\.jsonl:1: column 'completions' clashes"),
])
def test_malformed_rows_name_file_and_line(tmp_path, rows, message):
    path = write_jsonl(tmp_path / "bad.jsonl", rows)
    with pytest.raises(UserError, match=message) as info:
        load_file(path)
    assert "\n" not in str(info.value)


def test_missing_empty_and_unsupported_files(tmp_path):
    with pytest.raises(UserError, match=r"data file not found: .*missing\.jsonl"):
        load_file(tmp_path / "missing.jsonl")
    (tmp_path / "empty.jsonl").write_text("\n\n")
    with pytest.raises(UserError, match=r"empty\.jsonl: the data set is empty"):
        load_file(tmp_path / "empty.jsonl")
    (tmp_path / "d.csv").write_text("a,b\n")
    with pytest.raises(UserError, match="unsupported data file type '.csv'"):
        load_file(tmp_path / "d.csv")


def test_hub_without_datasets_package(monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # makes `import datasets` raise ImportError
    with pytest.raises(UserError, match=r"pip install 'mlx-grpo\[data\]'"):
        load_gsm8k_hub("train")


def fake_datasets(load_dataset) -> types.ModuleType:
    module = types.ModuleType("datasets")
    module.load_dataset = load_dataset
    return module


def test_hub_unreachable_suggests_local_file(monkeypatch):
    def offline(*args, **kwargs):
        raise ConnectionError("no route to host\nhuggingface.co")

    monkeypatch.setitem(sys.modules, "datasets", fake_datasets(offline))
    with pytest.raises(UserError, match="ConnectionError: no route to host huggingface.co.*dataset_path=") as info:
        load_gsm8k_hub("train")
    assert "\n" not in str(info.value)


def test_hub_rows_become_examples(monkeypatch):
    calls = []

    def load_dataset(*args, **kwargs):
        calls.append((args, kwargs))
        return [{"question": "q", "answer": "so\n#### 2,000"}]

    monkeypatch.setitem(sys.modules, "datasets", fake_datasets(load_dataset))
    assert load_examples("gsm8k", "test", None, 0) == [Example("q", "2000", {}, solution="so\n#### 2,000")]
    assert calls == [(("openai/gsm8k", "main"), {"split": "test"})]


def test_arith_is_deterministic_and_seed_dependent():
    a, b, c = make_arith(50, 7), make_arith(50, 7), make_arith(50, 8)
    assert a == b
    assert [ex.prompt for ex in a] != [ex.prompt for ex in c]
    assert len({ex.prompt for ex in a}) == 50  # no duplicates within a split


def test_arith_answers_equal_their_arithmetic():
    for ex in make_arith(300, 0):
        expr = ex.columns["expression"]
        assert re.fullmatch(r"[\d\s()+\-*/]+", expr)
        value = eval(expr)  # only digits and operators, checked above
        assert ex.answer == str(value) and value >= 0
        # Every operand of the expression is stated in the question ("doubles"/"triples" as words).
        stated = ex.prompt.replace("doubles", "2").replace("triples", "3")
        question_numbers = set(re.findall(r"\d+", stated))
        assert set(re.findall(r"\d+", expr)) <= question_numbers, (expr, ex.prompt)
        assert ex.prompt.endswith("?")


def test_arith_answers_are_small_and_templates_vary():
    examples = make_arith(500, 1)
    answers = [int(ex.answer) for ex in examples]
    assert sum(a < 1000 for a in answers) / len(answers) > 0.95
    openings = {ex.prompt.split()[1] for ex in examples}  # "has", "buys", "school", "saves", ...
    assert len(openings) >= 5
    assert any("//" in ex.columns["expression"] for ex in examples)
    assert any("*" in ex.columns["expression"] for ex in examples)


def test_arith_train_and_test_do_not_overlap():
    train = load_examples("arith", "train", None, seed=3, arith_size=400)
    test = load_examples("arith", "test", None, seed=3, arith_size=400)
    assert len(train) == len(test) == 400
    assert not {ex.prompt for ex in train} & {ex.prompt for ex in test}
    assert train == make_arith(400, 3)


def test_path_overrides_dataset_and_unknown_dataset():
    assert len(load_examples("gsm8k", "train", str(FIXTURES / "gsm8k_tiny.jsonl"), 0)) == 3
    with pytest.raises(UserError, match="unknown dataset 'gsm8' \\(did you mean 'gsm8k'"):
        load_examples("gsm8", "train", None, 0)


def test_subset_is_stable_nested_and_ordered():
    examples = make_arith(100, 0)
    small = subset(examples, 10, seed=5)
    assert small == subset(examples, 10, seed=5)
    assert small != subset(examples, 10, seed=6)
    assert len(small) == 10 and len(set(ex.prompt for ex in small)) == 10
    positions = [examples.index(ex) for ex in small]
    assert positions == sorted(positions)
    assert set(ex.prompt for ex in small) <= set(ex.prompt for ex in subset(examples, 20, seed=5))
    assert subset(examples, 1000, seed=5) == examples


def test_epoch_sampler_permutations_and_drop_last():
    sampler = EpochSampler(num_examples=10, batch_size=3, num_epochs=2, seed=1)
    batches = list(sampler)
    assert sampler.num_batches_total == len(batches) == 6  # 3 full batches per epoch, 1 example dropped
    assert all(len(b) == 3 for b in batches)
    first, second = sum(batches[:3], []), sum(batches[3:], [])
    assert len(set(first)) == 9 and len(set(second)) == 9
    assert first != second  # a fresh permutation each epoch
    assert batches == list(EpochSampler(10, 3, 2, seed=1))
    assert batches != list(EpochSampler(10, 3, 2, seed=2))
    assert list(sampler) == []  # exhausted


@pytest.mark.parametrize("k", [0, 1, 2, 3, 4, 7, 9])
def test_epoch_sampler_resume_matches_uninterrupted(k):
    full = list(EpochSampler(11, 4, 3, seed=9))  # 2 batches per epoch, 6 in all
    interrupted = EpochSampler(11, 4, 3, seed=9)
    it = iter(interrupted)
    head = [next(it) for _ in range(min(k, len(full)))]
    state = json.loads(json.dumps(interrupted.state()))  # must survive a JSON checkpoint
    resumed = EpochSampler(11, 4, 3, seed=9)
    resumed.load_state(state)
    assert resumed.batches_done == len(head)
    assert head + list(resumed) == full


def test_epoch_sampler_errors():
    with pytest.raises(UserError, match="5 examples, fewer than batch_size=8"):
        EpochSampler(5, 8, 1, 0)
    sampler = EpochSampler(20, 4, 1, 0)
    with pytest.raises(UserError, match="checkpoint data cursor has num_examples=30, this run has 20"):
        sampler.load_state({"epoch": 0, "position": 1, "num_examples": 30})
    with pytest.raises(UserError, match="out of range"):
        sampler.load_state({"epoch": 0, "position": 9})
