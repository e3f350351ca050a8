"""Run health: the signs that a run cannot learn, or learns the wrong thing, said while it runs.

Owns four checks, all pure functions of what the run logs (no MLX, no model):
- silent rewards: a reward function that returned None (not applicable) or one same value for every
  completion of an update gives no signal; an update where no function gives any trains nothing, and
  `max_updates_without_signal` such updates in a row stop the run (all-None stops it at once), as an error,
  or, when every function paid the same positive value to every completion in each of them, as done
  (`solved`: the data has nothing left to teach; decided again after a resume);
- plateau: a reward function that paid nothing (None or 0 for every completion) for `plateau_updates`
  updates in a row while another one paid: the model never produces what it rewards;
- gaming: over the last `gaming_evals` evaluations the training reward rose significantly while eval
  accuracy did not rise beyond its 95% interval (definition at `gaming_check`);
- prompt cutting: how many prompts max_prompt_length cuts and by how much, and when it guts them.
`RunHealth` keeps the state of the first three; it is plain data (`state` / `load_state`), saved in the
trainer's checkpoint state, so a resumed run warns exactly as the uninterrupted one would.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import numpy as np

PLATEAU_REMEDIES = ("show worked examples in the prompt, start from a supervised warm start (`mlx-grpo sft`), "
                    "or put demonstrations in the group (docs/run-health.md)")
GAMING_REMEDIES = ("read completions.jsonl for what the reward pays; weight correctness above the format "
                   "rewards or use reasoned_correctness / reasoned_format (rewards that empty reasoning cannot "
                   "earn); " + PLATEAU_REMEDIES)
Z95 = 1.959963984540054  # two-sided 95% normal quantile


def _value(v: float) -> str:
    return f"{v:g}"


def silence(values: np.ndarray) -> str | None:
    """What a reward function's values over every completion of an update say when they give no signal:
    'None' (all not applicable) or the one value they all got (None elsewhere allowed); None when they differ."""
    scored = values[~np.isnan(values)]
    if scored.size == 0:
        return "None"
    return _value(float(scored[0])) if np.all(scored == scored[0]) else None


def paid_nothing(values: np.ndarray) -> bool:
    """No completion got a nonzero reward from this function (None or 0 everywhere)."""
    return not np.any(np.nan_to_num(values, nan=0.0) != 0)


def silent_message(name: str, returned: str, update: int) -> str:
    if returned == "None":
        return (f"reward '{name}' returned None for every completion of update {update}: None means 'not "
                "applicable', so it scored nothing and adds nothing to the reward (check the data columns it "
                "reads and the completion format it expects)")
    said = (f"reward '{name}' returned {returned} for every completion of update {update}: one value for "
            "every completion of a group gives it no advantage, so this reward teaches nothing")
    if float(returned) <= 0:  # nothing earned, or a penalty everyone gets
        return said + " yet"
    # Full marks for everyone is what a learnt format looks like: say so, or a healthy run reads as broken.
    return said + " while every completion earns it (learnt already, or a reward that cannot tell completions apart)"


def wilson(p: float, n: int) -> tuple[float, float]:
    """The 95% Wilson score interval of a proportion p measured on n samples."""
    if n <= 0:
        return 0.0, 1.0
    denom = 1 + Z95 ** 2 / n
    centre = (p + Z95 ** 2 / (2 * n)) / denom
    half = Z95 * math.sqrt(p * (1 - p) / n + Z95 ** 2 / (4 * n * n)) / denom
    return max(0.0, centre - half), min(1.0, centre + half)


@dataclass
class EvalPoint:
    update: int
    accuracy: float
    num_examples: int
    rewards: list[float]  # reward_mean of each update since the previous evaluation (this one's included)


def gaming_check(points: list[EvalPoint]) -> str | None:
    """The gaming warning over `points` (the last k evaluations, oldest first), or None. It fires when
    (1) the training reward rose: the mean of the per-update reward_mean between the last two evaluations
    exceeds that of the updates up to the first one by more than 1.96 standard errors (Welch: each side's
    per-update spread; each side needs >= 2 updates), and (2) accuracy did not: the last evaluation's
    accuracy is not above the upper end of the 95% Wilson interval of the first one's."""
    first, last = points[0], points[-1]
    a, b = np.array(first.rewards, dtype=np.float64), np.array(last.rewards, dtype=np.float64)
    if len(a) < 2 or len(b) < 2:
        return None
    se = math.sqrt(a.var(ddof=1) / len(a) + b.var(ddof=1) / len(b))
    rise = float(b.mean() - a.mean())
    if rise <= Z95 * se or rise <= 0:
        return None
    low, high = wilson(first.accuracy, first.num_examples)
    if last.accuracy > high:
        return None
    return (f"gaming: the training reward rose from {a.mean():.3f} (updates up to {first.update}) to "
            f"{b.mean():.3f} (updates up to {last.update}) over the last {len(points)} evaluations while eval "
            f"accuracy did not ({first.accuracy:.3f} -> {last.accuracy:.3f}; 95% interval of the first "
            f"[{low:.3f}, {high:.3f}] on {first.num_examples} examples): the policy earns reward without "
            f"solving the task. Remedies: {GAMING_REMEDIES}")


@dataclass
class HealthState:
    no_signal_streak: int = 0  # consecutive updates in which no reward function gave a signal
    unpaid: dict[str, int] = field(default_factory=dict)  # function -> updates in a row it paid nothing, others paid
    fired: list[str] = field(default_factory=list)  # once-only warnings already given
    since_eval: list[float] = field(default_factory=list)  # reward_mean of the updates since the last evaluation
    evals: list[dict] = field(default_factory=list)  # the last gaming_evals EvalPoints, as dicts
    pending: dict[str, str] = field(default_factory=dict)  # warnings for the next update record
    paid_streak: int = 0  # consecutive updates in which every function paid every completion one value > 0
    solved: str = ""  # set when the run should end as done: every completion earned the same positive rewards


class RunHealth:
    """The running checks of one training run. Every rank feeds it the same merged figures, so every rank
    reaches the same stop decision."""

    def __init__(self, reward_names: list[str], max_updates_without_signal: int, plateau_updates: int,
                 gaming_evals: int):
        self.names = list(reward_names)
        self.max_without_signal = max_updates_without_signal
        self.plateau_updates = plateau_updates
        self.gaming_evals = gaming_evals
        self.s = HealthState()

    def observe_drawn(self, update: int, drawn: list) -> str | None:
        """observe_update for an update's RewardScores (one per batch step, every rank's rows)."""
        return self.observe_update(update, {n: np.concatenate([d.per_func[n] for d in drawn]) for n in self.names},
                                   float(np.concatenate([d.total for d in drawn]).mean()))

    def observe_update(self, update: int, per_func: dict[str, np.ndarray], reward_mean: float) -> str | None:
        """Record one update's rewards (every completion drawn, all ranks). Its warnings wait in `take_warnings`;
        returns the one line that stops the run, or None."""
        s = self.s
        s.since_eval.append(float(reward_mean))
        silent = {n: silence(per_func[n]) for n in self.names}
        for name, returned in silent.items():
            if returned is not None:
                s.pending[f"silent_reward/{name}"] = silent_message(name, returned, update)
        self._plateau(update, per_func)
        if any(v is None for v in silent.values()):
            s.no_signal_streak = s.paid_streak = 0
            return None
        s.no_signal_streak += 1
        # every function paid every completion the same positive value: full marks everywhere, not a failure
        paid = all(v not in ("None",) and float(v) > 0 for v in silent.values())
        s.paid_streak = s.paid_streak + 1 if paid else 0
        said = ", ".join(f"'{n}' returned {v}" for n, v in silent.items())
        allow = "; set max_updates_without_signal = 0 to train on anyway"
        if all(v == "None" for v in silent.values()) and self.max_without_signal:
            return (f"no reward function scored any completion of update {update} ({said} for every completion): "
                    f"nothing can be learnt; check the reward functions against the data's columns{allow}")
        if self.max_without_signal and s.no_signal_streak >= self.max_without_signal:
            if s.paid_streak >= s.no_signal_streak:
                # a model that earns every reward on every sample is done, not broken: no error
                s.solved = (f"every completion earned the same rewards in {s.no_signal_streak} "
                            f"update{'s' * (s.no_signal_streak != 1)} in a row (at "
                            f"update {update}: {said}): nothing is left to learn from this data, so the run ends "
                            f"here{allow}")
                return None
            return (f"no reward function gave any signal in {s.no_signal_streak} "
                    f"update{'s' * (s.no_signal_streak != 1)} in a row (at update "
                    f"{update}: {said} for every completion), so every advantage was 0 and nothing was learnt; "
                    f"{PLATEAU_REMEDIES}{allow}")
        return None

    def _plateau(self, update: int, per_func: dict[str, np.ndarray]) -> None:
        s = self.s
        if not self.plateau_updates or len(self.names) < 2:
            return
        unpaid = {n for n in self.names if paid_nothing(per_func[n])}
        payers = [n for n in self.names if n not in unpaid]
        for name in self.names:
            if name not in unpaid:
                s.unpaid[name] = 0
            elif payers:  # an update where nothing pays leaves the count as it is (the stop rule covers it)
                s.unpaid[name] = s.unpaid.get(name, 0) + 1
            kind = f"plateau/{name}"
            if s.unpaid.get(name, 0) >= self.plateau_updates and kind not in s.fired:
                s.fired.append(kind)
                s.pending[kind] = (f"plateau: reward '{name}' has paid nothing for {s.unpaid[name]} "
                                   f"update{'s' * (s.unpaid[name] != 1)} (up "
                                   f"to update {update}) while {', '.join(payers)} paid: the model has not once "
                                   "produced what it rewards, so GRPO has no sample of it to reinforce. Remedies: "
                                   f"{PLATEAU_REMEDIES}")

    def observe_eval(self, update: int, accuracy: float, num_examples: int) -> None:
        """Record an evaluation; the gaming warning, when it fires, waits in `take_warnings`."""
        s = self.s
        point = EvalPoint(update, float(accuracy), int(num_examples), s.since_eval)
        s.since_eval = []
        if not self.gaming_evals:
            return
        s.evals = (s.evals + [asdict(point)])[-self.gaming_evals:]
        if len(s.evals) == self.gaming_evals and "gaming" not in s.fired:
            message = gaming_check([EvalPoint(**e) for e in s.evals])
            if message is not None:
                s.fired.append("gaming")
                s.pending["gaming"] = message + f" (evaluation at update {update})"

    def take_warnings(self) -> dict[str, str]:
        """The warnings found since the last call (kind -> message), for the update record."""
        out, self.s.pending = self.s.pending, {}
        return out

    def state(self) -> dict:
        return asdict(self.s)

    def load_state(self, state: dict | None) -> None:
        self.s = HealthState(**state) if state else HealthState()
        self.s.solved = ""  # a resumed run decides again (max_updates_without_signal may have changed)


# ----------------------------------------------------------------------------- prompt cutting

def prompt_cut_report(lengths: list[int], max_prompt_length: int) -> tuple[str | None, str | None]:
    """(warning, error) for prompts of `lengths` tokens (uncut) cut to max_prompt_length. A prompt is gutted
    when the cut removes more than half of its tokens (the question goes, the generation prompt stays);
    more than half of the prompts gutted is an error naming a value that fits them all."""
    lengths = np.asarray(lengths, dtype=np.int64)
    cut = lengths[lengths > max_prompt_length]
    if cut.size == 0:
        return None, None
    gutted = int(np.sum(lengths > 2 * max_prompt_length))
    before, after = int(np.median(cut)), max_prompt_length
    if gutted * 2 > len(lengths):
        return None, (f"max_prompt_length = {max_prompt_length} would cut more than half of the tokens of "
                      f"{gutted / len(lengths):.0%} of the prompts (median {before} tokens -> {after}), removing "
                      f"their question: set max_prompt_length = {int(lengths.max())} (fits every prompt) or more")
    return (f"max_prompt_length = {max_prompt_length} cuts {cut.size / len(lengths):.0%} of the prompts from the "
            f"left (median {before} tokens -> {after}; {gutted} lose more than half): raise max_prompt_length to "
            f"{int(lengths.max())} to keep them whole"), None
