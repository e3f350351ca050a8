"""environments.py: the episode protocol with scripted model turns: a guessing game, the tool
environment, max_turns, the transcript rewards read, and the text fed back into a row."""

from __future__ import annotations

import re

import pytest
from transformers import AutoTokenizer

from conftest import write_tokenizer
from mlx_grpo.base.errors import UserError
from mlx_grpo.tools.calls import NanochatFormat, PlainFormat
from mlx_grpo.tools.environments import (Environment, Episode, StepResult, ToolEnvironment, Transcript, Turn,
                                   observation_text, prompt_messages)


class GuessNumber(Environment):
    """The module docstring's example: guess a secret number from higher/lower hints."""

    max_turns = 5

    def reset(self, row):
        return [{"role": "user", "content": "Guess my number from 1 to 100. Reply with one number."}]

    def step(self, transcript):
        guess = re.findall(r"-?\d+", transcript.last_model_turn)
        secret = transcript.row["secret"]
        if guess and int(guess[-1]) == secret:
            return StepResult(done=True, reward=1.0)
        hint = "higher" if guess and int(guess[-1]) < secret else "lower" if guess else "a number, please"
        return StepResult(observation=f"No: {hint}.")


def test_guessing_game_with_scripted_turns(tmp_path):
    write_tokenizer(tmp_path)
    fmt = PlainFormat(AutoTokenizer.from_pretrained(str(tmp_path)))
    episode = Episode(GuessNumber(), {"secret": 62})
    assert episode.transcript.messages[0]["content"].startswith("Guess my number")
    fed = []
    for turn in ("50", "I think 75", "hmm", "62"):
        result = episode.step(turn)
        if not result.done:
            fed.append(observation_text(fmt, result))
    assert result.done and result.reward == 1.0 and episode.done and episode.transcript.reward == 1.0
    assert fed[0] == "\n<|im_start|>user\nNo: higher.<|im_end|>\n<|im_start|>assistant\n"
    t = episode.transcript
    assert [(turn.origin, turn.text) for turn in t.turns] == [
        ("model", "50"), ("environment", "No: higher."), ("model", "I think 75"), ("environment", "No: lower."),
        ("model", "hmm"), ("environment", "No: a number, please."), ("model", "62")]
    assert t.model_turns == ["50", "I think 75", "hmm", "62"] and t.completion == "50I think 75hmm62"
    assert [m["role"] for m in t.as_messages()] == ["user"] + ["assistant", "user"] * 3 + ["assistant"]
    with pytest.raises(RuntimeError, match="ended"):
        episode.step("63")
    with pytest.raises(ValueError, match="no observation"):
        observation_text(fmt, result)


def test_max_turns_ends_the_episode():
    episode = Episode(GuessNumber(), {"secret": 7})
    results = [episode.step(str(guess)) for guess in (1, 2, 3, 4, 5)]
    assert [r.done for r in results] == [False] * 4 + [True]
    assert results[-1].info["max_turns"] and results[-1].reward is None and episode.transcript.reward is None
    assert episode.transcript.turns[-1] == Turn("environment", "No: higher.", {"max_turns": True})


def test_tool_environment_with_scripted_turns():
    fmt = PlainFormat()
    env = ToolEnvironment(["calculator", "python"], fmt, max_turns=4)
    episode = Episode(env, {"prompt": "What is 6*7 plus the number of letters in 'banana'?", "answer": "48"})
    assert episode.transcript.messages == [{"role": "user", "content":
                                            "What is 6*7 plus the number of letters in 'banana'?"}]
    assert "You can use tools." in env.prompt_text(episode.transcript.messages)
    turns = ["First <calc>6*7</calc>", 'Then <tool name="python">{"code": "len(\'banana\')"}</tool>',
             '<tool name="search">{"q": "banana"}</tool>', "So 42 + 6 = 48."]
    results = [episode.step(turn) for turn in turns]
    assert [observation_text(fmt, r) for r in results[:3]] == [
        "<result>42</result>", "<result>6\n</result>",
        "<result>Error: unknown tool 'search' (available: calculator, python)</result>"]
    assert [r.info.get("error") for r in results[:3]] == [False, False, True]
    assert results[3].done and results[3].reward is None  # the run's reward functions score it
    t = episode.transcript
    assert [turn.origin for turn in t.turns] == ["model", "tool", "model", "tool", "model", "tool", "model"]

    def used_tools_and_right(transcript: Transcript) -> float:
        """A reward reading the whole transcript: right answer, with a bonus for tool calls that worked."""
        ok_calls = sum(1 for turn in transcript.turns if turn.origin == "tool" and not turn.info["error"])
        return float(transcript.completion.rstrip(".").endswith(transcript.row["answer"])) + 0.1 * ok_calls

    assert used_tools_and_right(t) == pytest.approx(1.2)


def test_tool_environment_stops_after_max_turns_of_calls():
    env = ToolEnvironment(["calculator"], PlainFormat(), max_turns=2)
    episode = Episode(env, {"prompt": [{"role": "user", "content": "Loop"}]})
    assert not episode.step("<calc>1</calc>").done
    last = episode.step("<calc>2</calc>")
    # the last turn's call gets no answer, so the tool does not run and no tool turn is recorded
    assert last.done and last.info["max_turns"] and last.info["unanswered_call"] == "calculator"
    assert [t.origin for t in episode.transcript.turns] == ["model", "tool", "model"]


def test_tool_environment_checks_its_inputs():
    with pytest.raises(UserError, match="only the calculator"):
        ToolEnvironment(["calculator", "python"], NanochatFormat())
    with pytest.raises(UserError, match="max_turns"):
        ToolEnvironment(["calculator"], PlainFormat(), max_turns=0)
    for bad in ({"prompt": 3}, {"question": "x"}, {"prompt": [{"content": "no role"}]}):
        with pytest.raises(UserError, match="prompt must be"):
            prompt_messages(bad)
    with pytest.raises(ValueError, match="origin"):
        Transcript(row={}, messages=[]).add("user", "x")


def test_only_instant_tools_make_an_environment_answer_at_once():
    """ToolEnvironment answers at once only when every tool is instant (the calculator) and its step is its own:
    with the python sandbox, the user's own function or a subclass's step its answers keep computing while the
    batch decodes."""

    def double(x: int) -> int:
        """Twice x.

        Args:
            x: a number.
        """
        return 2 * x

    assert ToolEnvironment(["calculator"], PlainFormat()).answers_at_once
    assert not ToolEnvironment(["calculator", "python"], PlainFormat()).answers_at_once
    assert not ToolEnvironment(["calculator", double], PlainFormat()).answers_at_once
    assert not Environment.answers_at_once

    class Graded(ToolEnvironment):  # a step of its own (a grader, a request): answered while the batch decodes
        def step(self, transcript):
            return super().step(transcript)

    class GradedAtOnce(Graded):  # unless the subclass says its step is instant
        answers_at_once = True

    assert not Graded(["calculator"], PlainFormat()).answers_at_once
    assert GradedAtOnce(["calculator"], PlainFormat()).answers_at_once
    env = Graded(["calculator"], PlainFormat())
    env.answers_at_once = True  # or set in the constructor
    assert env.answers_at_once
