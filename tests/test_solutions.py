"""Reference solutions (data/solutions.py): real GSM8K worked solutions and arith's own, written as completions
that the format and reasoned rewards score in full."""

import dataclasses
import hashlib
import json
from pathlib import Path

import pytest

from mlx_grpo.config import Config
from mlx_grpo.data.examples import Example, load_file, make_arith
from mlx_grpo.data.solutions import (Segment, Style, after_prefill, reference_completion, reference_segments,
                                style_for)
from mlx_grpo.rewards import builtin as R
from mlx_grpo.tools.calculator import calculate
from mlx_grpo.tools.calls import NanochatFormat, PlainFormat

FIXTURES = Path(__file__).parent / "fixtures"
# Eight rows of GSM8K's train split (train_line: where), chosen for: calculator annotations with "$" and
# "x" in the prose (lines 1, 2), thousands commas in the final answer (346, 368, 463), negative answers
# (5716, 6190) and a solution without annotations (30). GSM8K's final answers are all integers; the
# decimal case is a made-up row in GSM8K's form below.
GSM8K = load_file(FIXTURES / "gsm8k_solutions.jsonl")


def scores(example, text):
    args = ([example.prompt], [text], [[]])
    return (R.strict_format(*args)[0], R.reasoned_format(*args)[0],
            R.reasoned_correctness(*args, answer=[example.answer])[0])


@pytest.mark.parametrize("example", GSM8K, ids=lambda e: str(e.columns["train_line"]))
def test_gsm8k_solutions_earn_every_reward(example):
    text = reference_completion(example)
    assert "<<" not in text and "####" not in text
    assert scores(example, text) == (0.5, 0.5, 2.0)
    assert R.extract_answer(text) == example.answer and "," not in example.answer


def test_gsm8k_conversion_texts():
    by_line = {e.columns["train_line"]: e for e in GSM8K}
    assert reference_completion(by_line[1]) == (
        "<reasoning>\nNatalia sold 48/2 = 24 clips in May.\nNatalia sold 48+24 = 72 clips altogether in April "
        "and May.\n</reasoning>\n<answer>\n72\n</answer>")
    # commas kept in the prose (answers_match reads "2,250" as 2250), dropped from the answer block
    assert reference_completion(by_line[463]).endswith(
        "They will skip 2,250 times because 150 x 15 = 2,250\n</reasoning>\n<answer>\n2250\n</answer>")
    assert "\n<answer>\n-12\n</answer>" in reference_completion(by_line[6190])


def test_decimal_answer():
    row = Example("A pen costs $1.25 and Ann buys 2 of them. How much does she pay?", "2.5",
                  solution="Each pen costs 1.25 dollars, so Ann pays 1.25 * 2 = $<<1.25*2=2.5>>2.5 for the two.\n#### 2.5")
    text = reference_completion(row)
    assert text == ("<reasoning>\nEach pen costs 1.25 dollars, so Ann pays 1.25 * 2 = $2.5 for the two.\n</reasoning>\n"
                    "<answer>\n2.5\n</answer>")
    assert scores(row, text) == (0.5, 0.5, 2.0)


def test_calculator_style_calls_what_the_annotation_computed():
    fmt = PlainFormat()
    for example in GSM8K:
        segments = reference_segments(example, Style(tools=fmt))
        model = "".join(s.text for s in segments if s.origin == "model")
        # the rewards read the model's own text (multiturn.model_texts): it must earn them without the results
        assert scores(example, model) == (0.5, 0.5, 2.0)
        for i, seg in enumerate(segments):
            if seg.origin == "tool":  # follows the call it answers, rendered as the run would feed it
                call = fmt.find_call(segments[i - 1].text)
                assert call is not None and call.end == len(segments[i - 1].text)
                assert seg.text == fmt.render_result(calculate(call.arguments["expression"]))
    first = reference_completion(GSM8K[0], Style(tools=fmt))
    assert first.startswith("<reasoning>\nNatalia sold <calc>48/2</calc><result>24</result> clips in May.\n")
    assert "The answer is 72.\n</reasoning>" in first
    # "$40 / 10 = $<<40/10=4>>4": the prose's expression, "$" and the repeated result become the call
    assert "pay is <calc>40/10</calc><result>4</result>." in reference_completion(GSM8K[2], Style(tools=fmt))


def test_nanochat_calls_parse_back():
    fmt = NanochatFormat()
    segments = reference_segments(GSM8K[0], Style(tools=fmt))
    calls = [fmt.find_call(s.text) for s in segments if s.origin == "model" and "python_start" in s.text]
    assert [c.arguments["expression"] for c in calls] == ["48/2", "48+24"]
    assert [s.text for s in segments if s.origin == "tool"] == ["<|output_start|>24<|output_end|>",
                                                               "<|output_start|>72<|output_end|>"]


def test_think_style():
    text = reference_completion(GSM8K[0], Style(tag="think"))
    assert text.startswith("<think>\n") and R.think_format([""], [text], [[]]) == [0.5]


@pytest.mark.parametrize("steps", [1, 4])
def test_arith_solutions_earn_every_reward(steps):
    fmt = PlainFormat()
    for example in make_arith(200, 3, max_steps=steps):
        assert scores(example, reference_completion(example)) == (0.5, 0.5, 2.0)
        segments = reference_segments(example, Style(tools=fmt))
        model = "".join(s.text for s in segments if s.origin == "model")
        assert scores(example, model) == (0.5, 0.5, 2.0)
        # one calculator call per operation of the problem
        operations = sum(example.columns["expression"].count(op) for op in (" + ", " - ", " * ", " // "))
        assert sum(s.origin == "tool" for s in segments) == operations


def test_arith_solution_text():
    example = make_arith(1, 42, max_steps=1)[0]
    assert example.prompt == "Tom has 20 pencils. He gives away 5. How many pencils does Tom have now?"
    assert reference_completion(example) == ("<reasoning>\nTom has 20 pencils. He gives away 5: 20 - 5 = 15. "
                                             "Tom has 15 pencils now.\n</reasoning>\n<answer>\n15\n</answer>")


def test_arith_questions_unchanged_by_the_solutions():
    """Writing the solutions draws nothing from the generator: the questions are the ones published runs used."""
    out = [(e.prompt, e.answer, e.columns) for steps in (1, 4) for seed in (42, 7)
           for e in make_arith(300, seed, max_steps=steps)]
    assert hashlib.sha1(json.dumps(out).encode()).hexdigest() == "f8d4659f0e25b226af548873d457c58981a83359"


def test_user_rows(tmp_path):
    path = tmp_path / "rows.jsonl"
    rows = [{"prompt": "What is 6 * 7?", "answer": "42", "completion": "<reasoning>\nmine\n</reasoning>"},
            {"prompt": "What is 6 * 7?", "answer": 42, "solution": "Six sevens make 6 * 7 = 42 in all."},
            {"prompt": "What is 6 * 7?", "answer": "42"}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    verbatim, worked, bare = load_file(path)
    assert reference_segments(verbatim) == [Segment("<reasoning>\nmine\n</reasoning>")]
    assert reference_completion(worked) == ("<reasoning>\nSix sevens make 6 * 7 = 42 in all.\n</reasoning>\n"
                                            "<answer>\n42\n</answer>")
    assert reference_completion(bare) is None


def test_answer_sentence_added_when_reasoning_ends_elsewhere():
    row = Example("Tom has 3 bags of 4 apples. How many apples?", "12",
                  solution="He has 3 * 4 = <<3*4=12>>12 apples in 3 bags.\n#### 12")
    text = reference_completion(row)
    assert text.endswith("in 3 bags.\nThe answer is 12.\n</reasoning>\n<answer>\n12\n</answer>")
    assert scores(row, text) == (0.5, 0.5, 2.0)


def test_prefill_and_style_for():
    text = reference_completion(GSM8K[0])
    assert after_prefill(text, "<reasoning>\n") == text[len("<reasoning>\n"):]
    assert after_prefill(text, "<think>\n") is None

    think = Config(prefill="<think>\n", system_prompt="", tools=[])
    assert style_for(think) == Style("think")
    tools = dataclasses.replace(think, prefill="<reasoning>\n", tools=["calculator"])
    with pytest.raises(ValueError, match="tool format"):
        style_for(tools)
    fmt = PlainFormat()
    assert style_for(tools, fmt) == Style("reasoning", fmt)
