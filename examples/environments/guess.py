"""A multi-turn environment for mlx-grpo: the model guesses a row's answer and is told higher or lower.

An environment writes an episode's first messages (reset) and answers each model turn (step) until it ends the
episode, with a reward that the built-in reward `environment_reward` passes on. max_new_tokens counts every turn:
an episode cut short by it gets no reward. docs/tools-and-environments.md ("Environments") runs it on the smoke
preset with the room it needs."""

import re

from mlx_grpo.tools.environments import Environment, StepResult, prompt_messages

RULES = "Answer with a number only. If it is wrong, you are told whether to go higher or lower."


class GuessAnswer(Environment):
    max_turns = 3  # model turns per episode

    def reset(self, row):  # row: the data row (prompt, answer, other columns)
        return [{"role": "system", "content": RULES}, *prompt_messages(row)]  # the rules, then the prompt

    def step(self, transcript):  # after each model turn: answer it or end the episode
        guess = re.findall(r"-?\d+", transcript.last_model_turn)
        gold = int(transcript.row["answer"])
        if guess and int(guess[-1]) == gold:
            return StepResult(done=True, reward=1.0)
        if len(transcript.model_turns) == self.max_turns:
            return StepResult(done=True, reward=0.0)
        hint = "higher" if guess and int(guess[-1]) < gold else "lower" if guess else "a number, please"
        return StepResult(observation=f"No: {hint}. Try again.")
