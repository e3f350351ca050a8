"""Tests of mlx_grpo.rewards.builtin: parsers, each built-in reward (as tables), RewardSet and custom reward files."""

import re
from pathlib import Path

import numpy as np
import pytest

from mlx_grpo.base.errors import UserError
from mlx_grpo.rewards.builtin import BUILTIN_REWARDS, SYSTEM_PROMPT, answers_match, correctness, extract_answer
from mlx_grpo.rewards.reward_loading import load_reward_function
from mlx_grpo.rewards.scoring import RewardSet

FIXTURES = Path(__file__).parent / "fixtures"
GOOD = "<reasoning>\n2 + 3 = 5\n</reasoning>\n<answer>\n5\n</answer>\n"


def call(name: str, completions: list[str], answers: list[str] | None = None) -> list[float]:
    """Call a built-in the way RewardSet does (keywords only, 'answer' as a column)."""
    n = len(completions)
    columns = {"answer": answers if answers is not None else ["5"] * n}
    return BUILTIN_REWARDS[name](prompts=["q"] * n, completions=completions, completion_ids=[[1]] * n, **columns)


def test_system_prompt_is_exact():
    assert SYSTEM_PROMPT == "\nRespond in the following format:\n\n<reasoning>\n...\n</reasoning>\n<answer>\n...\n</answer>\n"


def test_every_builtin_is_named_in_the_reward_help_and_the_defaults_are_builtins():
    """Read off BUILTIN_REWARDS, not listed here: a reward added there must be named in reward_funcs' help (which
    --help and docs/config.md print); the default reward_funcs are built-ins."""
    from mlx_grpo.config import FIELDS, command_default

    help_text = FIELDS["reward_funcs"].metadata["help"]
    assert [name for name in BUILTIN_REWARDS if not re.search(rf"\b{name}\b", help_text)] == []
    assert set(command_default("train", "reward_funcs")) <= set(BUILTIN_REWARDS)


@pytest.mark.parametrize("text, expected", [
    (GOOD, "5"),
    ("<answer> 42 </answer>", "42"),
    ("<answer>1</answer> then <answer>\n2\n</answer> tail", "2"),  # the last one wins
    ("<answer>a <answer>b</answer>", "b"),  # innermost before the last closing tag
    ("<answer>7", None),
    ("no tags at all", None),
    ("</answer><answer>", None),
    ("<answer></answer>", ""),
])
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


@pytest.mark.parametrize("pred, gold, expected", [
    ("1,000", "1000", True),
    ("$5", "5", True),
    (" $ 5 ", "5", True),
    ("5.0", "5", True),
    ("-3", "-3.00", True),
    ("0.1", ".1", True),
    ("12345678901234567890", "12345678901234567891", False),  # no float rounding
    ("6", "5", False),
    ("Paris", " Paris ", True),
    ("paris", "Paris", False),
    ("5 apples", "5", False),
    ("1 2", "12", False),  # only surrounding spaces are dropped
    (None, "5", False),
])
def test_answers_match(pred, gold, expected):
    assert answers_match(pred, gold) is expected


@pytest.mark.parametrize("completion, gold, expected", [
    (GOOD, "5", 2.0),
    ("<answer>1,000</answer>", "1000", 2.0),
    ("<answer>$72</answer>", "72", 2.0),
    ("<answer>6</answer>", "5", 0.0),
    ("The answer is 5.", "5", 0.0),  # no answer tag
    ("<answer>5</answer><answer>4</answer>", "5", 0.0),  # only the last answer counts
])
def test_correctness(completion, gold, expected):
    assert call("correctness", [completion], [gold]) == [expected]


def test_correctness_without_answer_column_fails_clearly():
    with pytest.raises(ValueError, match="answer"):
        BUILTIN_REWARDS["correctness"](prompts=["q"], completions=[GOOD], completion_ids=[[1]])


@pytest.mark.parametrize("completion, expected", [
    (GOOD, 0.5),
    ("<answer>-12</answer>", 0.5),
    ("<answer>1,000</answer>", 0.5),
    ("<answer>$5</answer>", 0.5),
    ("<answer>5.5</answer>", 0.0),
    ("<answer>five</answer>", 0.0),
    ("<answer></answer>", 0.0),
    ("5", 0.0),
])
def test_int(completion, expected):
    assert call("int", [completion]) == [expected]


@pytest.mark.parametrize("completion, strict, soft", [
    (GOOD, 0.5, 0.5),
    (GOOD.rstrip("\n"), 0.5, 0.5),  # the final newline is optional
    ("<reasoning>\nmulti\nline\n</reasoning>\n<answer>\n5\n</answer>", 0.5, 0.5),
    ("<reasoning>2+3</reasoning><answer>5</answer>", 0.0, 0.5),  # no newlines: soft only
    ("<reasoning>\nx\n</reasoning>\n\n<answer>\n5\n</answer>\n", 0.0, 0.5),  # blank line between blocks
    ("Sure! " + GOOD, 0.0, 0.5),  # preamble
    (GOOD + "extra", 0.0, 0.5),  # trailing text
    ("<answer>\n5\n</answer>\n<reasoning>\nx\n</reasoning>", 0.0, 0.0),  # wrong order
    ("<reasoning>\nx\n</reasoning>\n", 0.0, 0.0),  # no answer
    ("", 0.0, 0.0),
])
def test_strict_and_soft_format(completion, strict, soft):
    assert call("strict_format", [completion]) == [strict]
    assert call("soft_format", [completion]) == [soft]


@pytest.mark.parametrize("completion, expected", [
    (GOOD, 0.5 - 0.001 * 1),  # the trailing "\n" counts
    (GOOD.rstrip("\n"), 0.5),
    (GOOD.rstrip("\n") + " and more", 0.5 - 0.001 * len(" and more")),
    ("<reasoning>x</reasoning>", 0.25),
    ("<answer>5</answer>", 0.25),
    ("<reasoning>a</reasoning><reasoning>b</reasoning><answer>5</answer>", 0.25),  # duplicates earn nothing
    ("<answer>1</answer><answer>2</answer>tail", -0.004),  # no tag once; tail still costs
    ("nothing", 0.0),
    ("<answer>5" + "x" * 50, 0.125),  # no </answer>: no tail penalty
])
def test_xmlcount(completion, expected):
    assert call("xmlcount", [completion]) == [pytest.approx(expected)]


def test_builtins_accept_conversational_completions():
    completion = [{"role": "assistant", "content": GOOD}]
    assert call("correctness", [completion]) == [2.0]


def test_reward_set_weights_total_and_per_func():
    rs = RewardSet(["correctness", "xmlcount"], [1.0, 2.0])
    completions = [GOOD.rstrip("\n"), "<answer>4</answer>"]
    scores = rs.score(["q1", "q2"], completions, [[1], [2]], {"answer": ["5", "5"]})
    assert scores.names == ["correctness", "xmlcount"]
    np.testing.assert_allclose(scores.per_func["correctness"], [2.0, 0.0])
    np.testing.assert_allclose(scores.per_func["xmlcount"], [0.5, 0.25])
    np.testing.assert_allclose(scores.total, [2.0 + 1.0, 0.5])
    assert scores.total.dtype == np.float32 and scores.per_func["xmlcount"].dtype == np.float32


@pytest.mark.parametrize("weights", [None, []])
def test_reward_set_default_weights_are_one(weights):
    rs = RewardSet(["int", "soft_format"], weights)
    assert rs.weights == [1.0, 1.0]
    np.testing.assert_allclose(rs.score(["q"], [GOOD], [[1]], {"answer": ["5"]}).total, [1.0])


def test_reward_set_none_is_nan_per_func_and_zero_in_total():
    rs = RewardSet(["int", "custom_reward.py:difficulty_bonus"], [1.0, 3.0], base_dir=FIXTURES)
    scores = rs.score(["a", "b", "c"], [GOOD, GOOD, "x"], [[1]] * 3,
                      {"answer": ["5"] * 3, "difficulty": ["hard", None, "hard"]})
    bonus = scores.per_func["difficulty_bonus"]
    assert bonus[0] == 1.0 and np.isnan(bonus[1]) and bonus[2] == 1.0
    np.testing.assert_allclose(scores.total, [0.5 + 3.0, 0.5, 3.0])


def test_reward_set_passes_columns_and_token_ids():
    rs = RewardSet(["custom_reward.py:length_penalty"], base_dir=FIXTURES)
    scores = rs.score(["q", "q"], ["a", "b"], [[1, 2, 3], [4]], {"answer": ["1", "2"]})
    np.testing.assert_allclose(scores.total, [-0.03, -0.01], rtol=1e-6)


def test_unknown_builtin_names_nearest():
    with pytest.raises(UserError, match="unknown reward function 'corectness'.*did you mean 'correctness'"):
        RewardSet(["corectness"])


def test_weight_count_mismatch():
    with pytest.raises(UserError, match="reward_weights has 1 values but there are 2 reward functions"):
        RewardSet(["int", "xmlcount"], [1.0])


def test_duplicate_and_empty_reward_lists():
    with pytest.raises(UserError, match="listed twice: int"):
        RewardSet(["int", "int"])
    with pytest.raises(UserError, match="no reward functions"):
        RewardSet([])


@pytest.mark.parametrize("func, message", [
    ("crashes", "reward function crashes failed: RuntimeError: boom"),
    ("too_short", "reward function too_short returned 1 values, expected 2"),
    ("gives_nan", "reward function gives_nan returned nan at index 0"),
    ("gives_text", "reward function gives_text returned a non-numeric value at index 0: 'high'"),
    ("gives_scalar", "reward function gives_scalar returned float, expected a list of 2 floats"),
])
def test_bad_reward_outputs(func, message):
    rs = RewardSet([f"custom_reward.py:{func}"], base_dir=FIXTURES)
    with pytest.raises(UserError) as info:
        rs.score(["q", "q"], ["a", "b"], [[1], [2]], {"answer": ["1", "2"]})
    assert message in str(info.value) and "\n" not in str(info.value)


def test_column_clashing_with_reward_argument():
    with pytest.raises(UserError, match="column 'completions' clashes"):
        RewardSet(["int"]).score(["q"], ["a"], [[1]], {"answer": ["1"], "completions": ["x"]})


def test_load_custom_reward_relative_to_base_dir_and_cwd(monkeypatch):
    fn = load_reward_function("custom_reward.py:length_penalty", base_dir=FIXTURES)
    assert fn([], ["a"], [[1, 2]]) == [pytest.approx(-0.02)]
    monkeypatch.chdir(FIXTURES.parent)
    assert load_reward_function("fixtures/custom_reward.py:crashes").__name__ == "crashes"


def test_custom_reward_missing_file():
    with pytest.raises(UserError, match=r"reward file not found: .*nope\.py"):
        load_reward_function("nope.py:f", base_dir=FIXTURES)


def test_custom_reward_bad_spec():
    with pytest.raises(UserError, match="path/to/file.py:function_name"):
        load_reward_function("custom_reward.py", base_dir=FIXTURES)


def test_custom_reward_missing_function_lists_callables():
    with pytest.raises(UserError) as info:
        load_reward_function("custom_reward.py:lenght_penalty", base_dir=FIXTURES)
    msg = str(info.value)
    assert "no function 'lenght_penalty'" in msg and "length_penalty" in msg and "difficulty_bonus" in msg
    assert "NOT_A_FUNCTION" not in msg


def test_custom_reward_not_callable():
    with pytest.raises(UserError, match="NOT_A_FUNCTION is a int, not a function"):
        load_reward_function("custom_reward.py:NOT_A_FUNCTION", base_dir=FIXTURES)


def test_custom_reward_syntax_error(tmp_path):
    (tmp_path / "broken.py").write_text("def f(:\n    pass\n")
    with pytest.raises(UserError) as info:
        load_reward_function("broken.py:f", base_dir=tmp_path)
    msg = str(info.value)
    assert "broken.py failed to import: SyntaxError:" in msg and "\n" not in msg


def test_custom_reward_import_error(tmp_path):
    (tmp_path / "needs.py").write_text("import surely_not_installed_pkg\n")
    with pytest.raises(UserError, match="needs.py failed to import: ModuleNotFoundError: .*surely_not_installed_pkg"):
        load_reward_function("needs.py:f", base_dir=tmp_path)


def test_overlong_penalty_follows_dapo():
    """DAPO eq. 13 with L_max = 100, L_cache = 20, times the penalty: 0 up to 80 tokens, then linear."""
    from mlx_grpo.rewards.scoring import overlong_penalty

    lengths = np.array([1, 79, 80, 81, 90, 99, 100])
    expected = [0.0 if n <= 80 else ((100 - 20) - n) / 20 for n in lengths]
    np.testing.assert_allclose(overlong_penalty(lengths, 100, 20, 1.0), expected, rtol=1e-6)
    np.testing.assert_allclose(overlong_penalty(lengths, 100, 20, 0.5), np.array(expected) * 0.5, rtol=1e-6)


THINK = "<think>\nadd them\n</think>\n<answer>\n5\n</answer>"


@pytest.mark.parametrize("completion, fmt, tags", [
    (THINK, 0.5, 1.0),
    (THINK.replace("</think>\n", "</think>\n\n"), 0.5, 1.0),  # a blank line between the blocks
    (THINK + "\n", 0.5, 1.0),  # `$` allows one final newline
    ("<think>\nmulti\nline\n</think>\n<answer>\n5\n</answer>", 0.5, 1.0),  # dot matches newline
    (THINK.replace("</think>\n", "</think>\n\n\n"), 0.0, 1.0),  # two blank lines: no
    ("<think>add them</think><answer>5</answer>", 0.0, 1.0),  # tags not on their own lines
    ("Sure! " + THINK, 0.0, 1.0),  # text before the think block
    (THINK + " trailing", 0.0, 1.0),
    ("<think>\na\n</think>\n<answer>\n5\n</answer>\n<answer>\n6\n</answer>", 0.5, 0.5),  # answer twice
    ("<think>\nunfinished", 0.0, 0.25),
    ("no tags", 0.0, 0.0),
    ("<reasoning>\nx\n</reasoning>\n<answer>\n5\n</answer>", 0.0, 0.5),  # the other format
])
def test_think_format_and_tags(completion, fmt, tags):
    assert call("think_format", [completion]) == [fmt]
    assert call("think_tags", [completion]) == [tags]


def test_async_rewards_are_awaited_concurrently():
    """Each of the two waits for the other to start: sequential awaiting would time out."""
    rs = RewardSet(["custom_reward.py:waits_for_b", "int", "custom_reward.py:waits_for_a"], [1.0, 1.0, 0.5],
                   base_dir=FIXTURES)
    shared = {}
    scores = rs.score(["q"] * 2, ["ab", "<answer>\n3\n</answer>"], [[1], [2]],
                      {"answer": ["3", "3"], "rendezvous": [shared, shared]})
    assert scores.names == ["waits_for_b", "int", "waits_for_a"] and "events" in shared
    assert scores.total.tolist() == pytest.approx([1.0 + 0 + 1.0, 1.0 + 0.5 + 10.0])


def test_async_reward_failure_is_one_line():
    rs = RewardSet(["custom_reward.py:async_fails"], base_dir=FIXTURES)
    with pytest.raises(UserError, match="reward function async_fails failed: RuntimeError: scorer exploded"):
        rs.score(["q"], ["a"], [[1]], {})


REASONED = ("<reasoning>\nShe starts with 12 apples and buys 3 more, so she has 12 + 3 = 15 apples.\n</reasoning>\n"
            "<answer>\n15\n</answer>")
# Completions a policy could game the seed's rewards with, scored by the prod preset's rewards.
GAMED = {
    "empty reasoning": "<reasoning>\n\n</reasoning>\n<answer>\n15\n</answer>",
    "dots as reasoning": "<reasoning>\n...\n</reasoning>\n<answer>\n15\n</answer>",
    "words, no computation": "<reasoning>\nI think about the apples very carefully and then I know the answer.\n"
                             "</reasoning>\n<answer>\n15\n</answer>",
    "constant answer": "<reasoning>\nShe starts with 12 apples and buys 3 more, so she has 12 + 3 = 15 apples.\n"
                       "</reasoning>\n<answer>\n10\n</answer>",
    "answer without reasoning": "<answer>\n15\n</answer>",
    "tags repeated": "<reasoning>\n<reasoning>\n</reasoning>\n</reasoning>\n<answer>\n15\n</answer>",
    "rambling after the answer": REASONED + " and more" * 40,
    "one template for every question": "<reasoning>\na a a a a a a a a 1+1=2\n</reasoning>\n<answer>\n2\n</answer>",
    "filler words and the right number": "<reasoning>\nthe quick brown fox jumps over a lazy dog and 1+1=2\n"
                                         "</reasoning>\n<answer>\n15\n</answer>",
}
QUESTION = "She has 12 apples and buys 3 more. How many apples does she have?"


def _preset_rewards(text: str, gold: str = "15") -> float:
    from mlx_grpo.config import build_config

    cfg = build_config("train", str(Path(__file__).resolve().parents[1] / "configs" / "prod.toml"))
    total = 0.0
    for name, weight in zip(cfg.rewards.reward_funcs, cfg.rewards.reward_weights):
        total += weight * BUILTIN_REWARDS[name]([QUESTION], [text], [[1]], answer=[gold])[0]
    return total


@pytest.mark.parametrize("case", list(GAMED))
def test_prod_preset_pays_a_gamed_completion_less_than_a_correct_reasoned_one(case):
    best = _preset_rewards(REASONED)
    assert best == pytest.approx(2.5)
    assert _preset_rewards(GAMED[case]) < best
    if case in ("empty reasoning", "dots as reasoning", "words, no computation", "answer without reasoning",
                "tags repeated", "one template for every question", "filler words and the right number"):
        assert _preset_rewards(GAMED[case]) == 0.0  # not a cent for empty reasoning
    if case == "constant answer":
        assert _preset_rewards(GAMED[case]) == pytest.approx(0.25)  # only the reasoning tags: no answer credit


def test_correctness_compares_answers_of_any_length():
    """Fraction parses through int, which refuses more than 4,300 digits: the comparison must not."""
    huge = "9" * 5000
    assert correctness(None, [f"<answer>{huge}</answer>"], None, answer=[huge]) == [2.0]
    assert correctness(None, [f"<answer>{huge}1</answer>"], None, answer=[huge]) == [0.0]


def test_reasoned_format_keeps_the_sign_of_a_negative_answer():
    from mlx_grpo.rewards.builtin import reasoned_format

    text = ("<reasoning>\nThe temperature was 3 degrees and fell by 8 degrees, so it is 3 - 8 = -5 degrees now.\n"
            "</reasoning>\n<answer>\n-5\n</answer>")
    assert reasoned_format(["It was 3 degrees and fell by 8. What is it now?"], [text], [[1]]) == [0.5]


def test_reasoned_format_grounds_the_answer_in_the_last_tool_result():
    """In a tool run the model's own text ends at its call; the calculator's answer came back as context, so
    an answer equal to it is grounded (full format credit), and one equal to neither is not."""
    from mlx_grpo.rewards.builtin import reasoned_format
    from mlx_grpo.tools.environments import Transcript

    prompt = ["Emma has 17 pencils. A friend gives her 25 more. How many pencils does Emma have now?"]
    text = ("<reasoning>\nEmma starts with 17 pencils and a friend gives her 25 more: <calc>17+25</calc>\n"
            "</reasoning>\n<answer>\n{}\n</answer>")
    episode = Transcript(row={}, messages=[])
    episode.add("model", "Emma starts with 17 pencils and a friend gives her 25 more: <calc>17+25</calc>")
    episode.add("tool", "<result>42</result>")
    episode.add("model", "\n</reasoning>\n<answer>\n42\n</answer>")
    assert reasoned_format(prompt, [text.format(42)], [[1]], transcripts=[episode]) == [0.5]
    assert reasoned_format(prompt, [text.format(41)], [[1]], transcripts=[episode]) == [0.25]
    assert reasoned_format(prompt, [text.format(42)], [[1]]) == [0.25]  # no transcript: the last own number, 25
