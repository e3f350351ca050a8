"""Multi-turn tasks: the `Environment` protocol, the `Transcript` rewards read, and `ToolEnvironment`.

An environment turns a data row into the first chat messages (`reset`) and answers each model turn
(`step`) with an observation, or ends the episode, optionally with a reward. It sees text only: the
decode loop renders observations into tokens through the model's `ToolFormat` (calls.py) with
`observation_text`. In the spirit of verifiers' `MultiTurnEnv` (env_response / is_completed) and
TRL's environments (reset / step), kept to plain methods and one record. Example, a guessing game::

    class GuessNumber(Environment):
        max_turns = 5

        def reset(self, row):
            return [{"role": "user", "content": "Guess my number from 1 to 100. Reply with one number."}]

        def step(self, transcript):
            guess = re.findall(r"-?\\d+", transcript.last_model_turn)
            secret = transcript.row["secret"]
            if guess and int(guess[-1]) == secret:
                return StepResult(done=True, reward=1.0)
            hint = "higher" if guess and int(guess[-1]) < secret else "lower" if guess else "a number, please"
            return StepResult(observation=f"No: {hint}.")

`Episode` runs the protocol for one row: it records every turn in a `Transcript` with its origin
("model", "tool" or "environment"), and ends the episode after `max_turns` model turns. The decode
loop's integration (pausing rows, feeding observations back as context) lives in rollout/multiturn.py.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Literal

from mlx_grpo.base.errors import UserError
from mlx_grpo.tools.calls import ToolFormat, call_output
from mlx_grpo.tools.registry import MAX_OUTPUT_CHARS, Tool, resolve_tools

Origin = Literal["model", "tool", "environment"]
ORIGINS = ("model", "tool", "environment")


@dataclass(frozen=True)
class Turn:
    origin: Origin
    text: str
    info: dict = field(default_factory=dict)


@dataclass
class Transcript:
    """What happened in one episode, for rewards: the data row, the first messages, every turn since."""

    row: dict
    messages: list[dict]  # from Environment.reset: the prompt
    turns: list[Turn] = field(default_factory=list)
    done: bool = False
    reward: float | None = None  # the environment's reward when it ended the episode with one

    def add(self, origin: Origin, text: str, **info) -> None:
        if origin not in ORIGINS:
            raise ValueError(f"turn origin {origin!r}: expected one of {', '.join(ORIGINS)}")
        self.turns.append(Turn(origin, text, info))

    @property
    def model_turns(self) -> list[str]:
        return [t.text for t in self.turns if t.origin == "model"]

    @property
    def last_model_turn(self) -> str:
        turns = self.model_turns
        return turns[-1] if turns else ""

    @property
    def completion(self) -> str:
        """The model's turns joined: what a single-turn reward (completion, example) would read."""
        return "".join(self.model_turns)

    def as_messages(self) -> list[dict]:
        """The whole episode as chat messages: model -> assistant, tool -> tool, environment -> user."""
        roles = {"model": "assistant", "tool": "tool", "environment": "user"}
        return [*self.messages, *({"role": roles[t.origin], "content": t.text} for t in self.turns)]


@dataclass(frozen=True)
class StepResult:
    observation: str | None = None  # text for the model's next turn; None when the episode ends
    done: bool = False
    reward: float | None = None  # read when done; None leaves scoring to the reward functions
    origin: Origin = "environment"  # "tool": a tool's output, fed right after the call
    info: dict = field(default_factory=dict)


class Environment:
    """Subclass and define `reset` and `step`. State that lives for one episode belongs in the
    transcript (its row, its turns), not on the environment: one environment serves every row."""

    max_turns: int = 8  # model turns per episode; the episode ends after the last one
    # step() returns in microseconds (no process, model or network call): the decode loop waits for its answers
    # at the sync that hands the turns over, and the rows' next turns join the batch one sync (8 decode steps)
    # sooner. Leave False for a step that takes time: the rows' answers then compute while the batch decodes.
    answers_at_once: bool = False

    def reset(self, row: Mapping) -> list[dict]:
        """The first messages of the episode for this data row. A function of the row alone: it is called
        when the prompt is encoded and again when the episode starts."""
        raise NotImplementedError

    def step(self, transcript: Transcript) -> StepResult:
        """Answer the model's last turn (transcript.last_model_turn) or end the episode."""
        raise NotImplementedError


def prompt_messages(row: Mapping) -> list[dict]:
    """A row's "prompt": a string (one user message) or chat messages [{role, content}, ...]."""
    prompt = row.get("prompt")
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    if isinstance(prompt, list) and all(isinstance(m, dict) and "role" in m and "content" in m for m in prompt):
        return [dict(m) for m in prompt]
    raise UserError(f"a row's prompt must be a string or a list of {{role, content}} messages, got {prompt!r:.80}")


class ToolEnvironment(Environment):
    """The single-task-with-tools case: each model turn that makes a tool call gets the tool's output
    (an error text for a malformed call); a turn without a call ends the episode. No reward of its own:
    the run's reward functions score the transcript."""

    def __init__(self, tools: Mapping[str, Tool] | Iterable[str | Callable], fmt: ToolFormat, max_turns: int = 4,
                 max_output_chars: int = MAX_OUTPUT_CHARS):
        self.tools = dict(tools) if isinstance(tools, Mapping) else resolve_tools(tools)
        fmt.check_tools(self.tools)
        if max_turns < 1:
            raise UserError(f"max_turns must be at least 1, got {max_turns}")
        self.fmt, self.max_turns, self.max_output_chars = fmt, max_turns, max_output_chars

    @property
    def answers_at_once(self) -> bool:
        """Every tool instant (the calculator), and this class's own step: a subclass whose step does more (a grader,
        a request) answers while the batch decodes, unless it sets answers_at_once itself (a class attribute, or
        in its constructor)."""
        if "_answers_at_once" in self.__dict__:
            return self._answers_at_once
        return type(self).step is ToolEnvironment.step and all(t.instant for t in self.tools.values())

    @answers_at_once.setter
    def answers_at_once(self, value: bool) -> None:
        self._answers_at_once = bool(value)

    def reset(self, row: Mapping) -> list[dict]:
        return prompt_messages(row)

    def prompt_text(self, messages: list[dict]) -> str:
        """The rendered prompt with the tools made known (the chat template's tools=, or a description)."""
        return self.fmt.render_prompt(messages, self.tools)

    def step(self, transcript: Transcript) -> StepResult:
        # a turn the model closed with its end-of-turn token is its answer, whatever it wrote before
        ended = transcript.turns[-1].info.get("ended") if transcript.turns else None
        call = None if ended == "eos" else self.fmt.find_call(transcript.last_model_turn)
        if call is None:
            return StepResult(done=True)
        if len(transcript.model_turns) >= self.max_turns:  # no answer would be fed: the tool does not run
            return StepResult(done=True, info={"max_turns": True, "unanswered_call": call.name})
        output = call_output(call, self.tools, self.max_output_chars)
        return StepResult(observation=output, origin="tool",
                          info={"tool": call.name, "error": call.error is not None or output.startswith("Error:")})


class Episode:
    """One row's run through an environment: what the decode loop keeps per row. Per turn::

        episode = Episode(env, row)             # episode.transcript.messages: the prompt
        result = episode.step(model_text)       # when the row ends a turn: a complete call, or end of turn
        if not result.done:
            forced = observation_text(fmt, result)  # the tokens to feed into the row
    """

    def __init__(self, env: Environment, row: Mapping):
        self.env = env
        self.transcript = Transcript(row=dict(row), messages=env.reset(row))

    @property
    def done(self) -> bool:
        return self.transcript.done

    def step(self, model_text: str, **info) -> StepResult:
        """Record the model's turn (info: how it ended, "eos" or "stop"), ask the environment, record its
        answer. After `max_turns` model turns the episode ends whatever the answer (info["max_turns"] is
        set, the reward is kept)."""
        if self.done:
            raise RuntimeError("step() on an episode that has ended")
        transcript = self.transcript
        transcript.add("model", model_text, **info)
        result = self.env.step(transcript)
        if not result.done and len(transcript.model_turns) >= self.env.max_turns:
            result = replace(result, done=True, info={**result.info, "max_turns": True})
        if result.observation is not None:  # also when done: a final message rewards can read
            transcript.add(result.origin, result.observation, **result.info)
        if result.done:
            transcript.done, transcript.reward = True, result.reward
        return result


def observation_text(fmt: ToolFormat, result: StepResult, after_end_token: bool = True) -> str:
    """The text to feed into the row for a step that did not end the episode: a tool's output right
    after the call, an environment's message after the model's turn (after_end_token: the model closed
    that turn with its end token)."""
    if result.done or result.observation is None:
        raise ValueError("an ended episode has no observation to feed")
    if result.origin == "tool":
        return fmt.render_result(result.observation)
    return fmt.render_user(result.observation, after_end_token)
