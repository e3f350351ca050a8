"""Run logs: metrics.jsonl (one record per update), completions.jsonl, eval.jsonl, console lines (printed
above the progress bar), the pace/ETA text and the end-of-run summary."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from pathlib import Path

import numpy as np

from mlx_grpo.base.console import console
from mlx_grpo.config import Config
from mlx_grpo.training.records import BatchStats, Counters, DataPosition, UpdateMetrics


def duration(seconds: float) -> str:
    """A wall time for the console: 42s, 4m10s, 2h05m."""
    seconds = max(0, round(seconds))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


def updates_left(elapsed_s: float, done: int, left: float, limit_s: float = 0.0, at: int = 0,
                 passes: int = 1) -> tuple[float, bool]:
    """The updates still to run, and whether the time limit (max_minutes, `limit_s` > 0) decides it: the
    run ends after the update that crosses the limit, so at this pace the time left rounded up to updates
    (none once it is crossed), then up to the end of that batch's `passes` (num_iterations; `at`: the
    updates so far)."""
    per = elapsed_s / max(done, 1)
    if limit_s > 0 and per > 0:
        timed = math.ceil(max(limit_s - elapsed_s, 0.0) / per)
        timed += -(at + timed) % passes
        if timed < left:
            return timed, True
    return left, False


def pace(elapsed_s: float, done: int, left: float, limit_s: float = 0.0, at: int = 0, passes: int = 1) -> str:
    """Elapsed time, mean seconds per update so far and the ETA (that mean x the updates left, as
    updates_left counts them), marked (max_minutes) when the time limit decides it."""
    per = elapsed_s / max(done, 1)
    left, limited = updates_left(elapsed_s, done, left, limit_s, at, passes)
    return (f"elapsed {duration(elapsed_s)}, {per:.1f} s/update, ETA {duration(per * left)}"
            + (" (max_minutes)" if limited else ""))


def fmt(value: float | None, spec: str) -> str:
    """A metric for the console; None (nothing entered the loss) prints as n/a."""
    return "n/a" if value is None else format(value, spec)


def _nan_mean(values: np.ndarray) -> float | None:
    """Mean over the completions a reward applied to (None marks 'not applicable'); None if none."""
    return None if np.all(np.isnan(values)) else float(np.nanmean(values))


def _credited(values: np.ndarray) -> float | None:
    """The share of the completions a reward applied to that it scored above 0; None if none."""
    applied = values[~np.isnan(values)]
    return float(np.mean(applied > 0)) if applied.size else None


def update_record(cfg: Config, c: Counters, position: DataPosition, stats: list[BatchStats],
                  result: UpdateMetrics) -> dict:
    """The metrics of one optimizer update, from the run's counters, where the data stood when its batch
    steps were drawn (async_rollouts: not the batch drawn after it), its batch steps' stats and the update's
    result. Reward, length and variance figures cover every completion drawn (dynamic sampling may train on
    fewer)."""
    epoch, prompts_cut = position.epoch, position.prompts_cut
    drawn = [s.drawn_scores for s in stats]
    rewards = np.concatenate([d.total for d in drawn])
    lengths = np.concatenate([s.lengths for s in stats])
    truncated = np.concatenate([s.truncated for s in stats])
    tokens = sum(s.tokens for s in stats)
    t_rollout = sum(s.t_rollout for s in stats)
    record = {
        "update_step": c.update_step, "batch_step": c.batch_step, "epoch": epoch,
        "lr": result.lr, "loss": result.loss, "grad_norm": result.grad_norm,
        "reward_mean": float(rewards.mean()), "reward_std": float(rewards.std()),
        **{f"reward/{n}": _nan_mean(np.concatenate([d.per_func[n] for d in drawn])) for n in drawn[0].per_func},
        # the share of completions each function gave any credit: for a tiered reward, its first tier
        **{f"reward_credited/{n}": _credited(np.concatenate([d.per_func[n] for d in drawn])) for n in drawn[0].per_func},
        "kl": result.kl, "clip_fraction": result.clip_fraction,
        "clip_low_fraction": result.clip_low_fraction, "clip_high_fraction": result.clip_high_fraction,
        "ratio_min": result.ratio_min, "ratio_mean": result.ratio_mean, "ratio_max": result.ratio_max,
        "sampler_kl": result.sampler_kl, "sampler_diff_max": result.sampler_diff_max,
        "is_weight_mean": result.is_weight_mean, "is_capped_fraction": result.is_capped_fraction,
        "entropy": sum(s.entropy_sum for s in stats) / tokens if tokens else None,
        "completion_length_mean": float(lengths.mean()), "completion_length_max": int(lengths.max()),
        "truncated_fraction": float(truncated.mean()),
        "zero_std_fraction": float(np.mean([s.zero_std for s in stats])),
        "loss_tokens": result.loss_tokens,
        "draws": sum(s.draws for s in stats), "groups_trained": sum(s.groups_trained for s in stats),
        "prompts_cut": prompts_cut, "skipped": result.skipped, "skipped_total": c.skipped_updates,
        "rollout_tokens_per_s": tokens / t_rollout if t_rollout > 0 else 0.0,
        "train_tokens_per_s": result.train_tokens_per_s,
        "time_rollout_s": t_rollout, "time_reward_s": sum(s.t_reward for s in stats),
        "time_logprob_s": sum(s.t_logprob for s in stats), "time_train_s": result.t_train,
        "time_step_s": result.time_step_s,
        "peak_memory_gb": result.peak_memory_gb,
    }
    if cfg.rollout.dynamic_sampling:  # the engine passes the draws took (waves), and the rows decoded per row trained
        record["decode_passes"] = sum(s.decode_passes for s in stats)
        trained = sum(len(s.texts) for s in stats)
        record["rows_decoded_per_trained"] = len(lengths) / trained if trained else None
        if cfg.rollout.carry_surplus:  # groups trained on that an earlier batch step drew
            record["groups_carried"] = sum(s.groups_carried for s in stats)
    if stats[0].tool_calls is not None:  # multi-turn: how often the drawn completions called a tool, how many failed
        calls = np.concatenate([s.tool_calls for s in stats])
        errors = np.concatenate([s.tool_errors for s in stats])
        record["tool_call_rate"] = float(np.mean(calls > 0)) if len(calls) else 0.0
        record["tool_calls_mean"] = float(np.mean(calls)) if len(calls) else 0.0
        record["tool_error_fraction"] = float(errors.sum() / calls.sum()) if calls.sum() else 0.0
    if result.teacher_kl is not None:  # on-policy distillation: how far the student's samples are from the teacher
        record["teacher_kl"] = result.teacher_kl
    if result.forward_kl is not None:  # distill_topk: the top-k forward KL to the teacher at the sampled positions
        record["forward_kl"] = result.forward_kl
    if result.rollout_staleness is not None:  # async_rollouts: updates applied since the batch was sampled
        record["rollout_staleness"] = result.rollout_staleness
    if stats[0].demo is not None:  # demonstrations: the share of trained groups that got one (one row each)
        groups = sum(s.groups_trained for s in stats)
        record["demo_fraction"] = sum(int(s.demo.sum()) for s in stats) / groups if groups else 0.0
    record["warnings"] = diagnose(record, cfg)
    return record


def merge_ranks(ranks: list[tuple[list[BatchStats], UpdateMetrics]]) -> tuple[list[BatchStats], UpdateMetrics]:
    """One update's (batch-step stats, result) of every rank of a data-parallel run, in rank order, as
    the (stats, result) of the whole batch: rows concatenated in rank order (the batch's prompt order),
    counts summed, times and memory the slowest rank's. A single rank's pair comes back unchanged. The
    result's loss and gradient figures are already global (the trainer reduced them)."""
    if len(ranks) == 1:
        return ranks[0]
    merged = []
    for parts in zip(*(stats for stats, _ in ranks)):  # one batch step, every rank
        drawn = [p.drawn_scores for p in parts]
        sizes = [len(d.total) for d in drawn]

        def rows(name: str):
            return None if getattr(parts[0], name) is None else np.concatenate([getattr(p, name) for p in parts])

        merged.append(BatchStats(
            examples=[e for p in parts for e in p.examples], texts=[t for p in parts for t in p.texts],
            transcripts=None if parts[0].transcripts is None else [t for p in parts for t in p.transcripts],
            lengths=rows("lengths"), truncated=rows("truncated"), rewards=rows("rewards"),
            advantages=rows("advantages"), tool_calls=rows("tool_calls"), tool_errors=rows("tool_errors"),
            demo=rows("demo"),
            per_func={k: np.concatenate([p.per_func[k] for p in parts]) for k in parts[0].per_func},
            drawn_scores=type(drawn[0]).concat(drawn),
            zero_std=float(np.average([p.zero_std for p in parts], weights=sizes)),
            draws=parts[0].draws,  # every rank draws its share of each batch
            decode_passes=parts[0].decode_passes,  # in the same waves (dynamic sampling's decisions are global)
            **{k: sum(getattr(p, k) for p in parts) for k in ("groups_trained", "groups_carried", "entropy_sum",
                                                              "tokens")},
            **{k: max(getattr(p, k) for p in parts) for k in ("t_rollout", "t_logprob", "t_reward")},
        ))
    results = [r for _, r in ranks]
    t_train = max(r.t_train for r in results)
    train_tokens = sum(r.train_tokens for r in results)
    result = dataclasses.replace(results[0], t_train=t_train, train_tokens=train_tokens,
                                 train_tokens_per_s=train_tokens / t_train if t_train > 0 else 0.0,
                                 peak_memory_gb=max(r.peak_memory_gb for r in results),
                                 time_step_s=max(r.time_step_s for r in results))
    return merged, result


# Above these fractions an update is flagged: GRPO learns (almost) nothing from such a batch.
ZERO_STD_ALARM = 0.9
TRUNCATED_ALARM = 0.9
# The sampler's log-probs against the trainer's over the tokens it drew: from a bfloat16 sampling copy sampler_kl is
# ~0.001 nats a token and sampler_diff_max (the largest token's difference) 0.4-1.6 (prod_tools on an H200, sessions
# 32-34), ~0 in float32. Rows decoded on a wrong KV cache (session 34's arrays past 2^31 elements) had tokens 7.9-18.9
# nats off; a few such rows barely move the update's mean, so the largest difference is checked as well.
SAMPLER_KL_ALARM = 0.05
SAMPLER_DIFF_ALARM = 5.0
# While a condition persists it is printed again every this many updates (it is in every log record).
WARN_EVERY = 10
# Conditions printed only when they say something new (health.py's one line per silent reward function and
# value; the plateau warning says it at length when one lasts).
ONSET_ONLY = ("silent_reward/",)


def diagnose(record: dict, cfg) -> dict[str, str]:
    """Warnings (kind -> message) for an update that gives (almost) no learning signal, each saying what
    to change."""
    out = {}
    # with a teacher (on-policy distillation) every token carries a signal, whatever the rewards do
    if record["zero_std_fraction"] >= ZERO_STD_ALARM and not cfg.objective.distill_coeff > 0:
        names = [k[len("reward/"):] for k in record if k.startswith("reward/")]  # this run's own rewards
        out["zero_std"] = (f"{record['zero_std_fraction']:.0%} of groups have zero reward variance under this "
                           f"run's rewards ({', '.join(names)}), so their advantages are 0 and they teach nothing: "
                           "add a reward that gives partial credit (e.g. the built-ins xmlcount, soft_format), "
                           "prefill the start of the format, raise num_generations or temperature, or use easier "
                           "data" + ("" if cfg.rollout.dynamic_sampling else "; dynamic_sampling skips such groups"))
    kl, worst = record.get("sampler_kl"), record.get("sampler_diff_max")
    # not `>=`: a NaN must warn too. Dropout in the gradient pass (lora_dropout) moves every token: no check there.
    if not cfg.model.lora_dropout and ((kl is not None and not kl < SAMPLER_KL_ALARM)
                                       or (worst is not None and not worst < SAMPLER_DIFF_ALARM)):
        said = (f"sampler_kl {fmt(kl, '.3f')} nats per sampled token, largest token difference "
                f"{fmt(worst, '.2f')}")
        out["sampler_mismatch"] = (f"the rollouts' log-probs differ from the trainer's: {said} (a bfloat16 sampling "
                                   "copy at the presets' settings logs ~0.001 and under 2). Either batches sampled "
                                   "before the last update (async_rollouts, carry_surplus) trained at a learning rate "
                                   "that moves the policy this far in one update, or the rollouts did not come from "
                                   "the model being trained (a NaN: from either side): check the engine with `python "
                                   "bench/sampler_check.py --config <this config>` (each row's sampler log-probs "
                                   "against the model's forward), or set rollout_engine = model")
    if record["truncated_fraction"] >= TRUNCATED_ALARM:
        out["truncated"] = (f"{record['truncated_fraction']:.0%} of completions hit max_new_tokens before ending: "
                            "raise max_new_tokens or add a stop string"
                            + ("" if cfg.objective.mask_truncated_completions else
                               "; mask_truncated_completions keeps them out of the loss"))
    return out


class RunLogger:
    """Appends JSON lines in the run directory; disabled files are simply not written."""

    def __init__(self, run_dir: Path, enabled: bool):
        self.run_dir = run_dir
        self.enabled = enabled
        self._warned: dict[str, int] = {}  # warning kind -> update it was last printed at
        self._said: dict[str, str] = {}  # ONSET_ONLY kind -> its last printed message, update number left out
        self._seen: dict[str, int] = {}  # ONSET_ONLY kind -> the last update whose record held it

    def _append(self, name: str, record: dict) -> None:
        if self.enabled:
            with open(self.run_dir / name, "a") as f:
                f.write(json.dumps(record) + "\n")

    def log_metrics(self, record: dict) -> None:
        self._append("metrics.jsonl", record)

    def warn(self, record: dict) -> None:
        """Print each warning of the record when it first appears, then every WARN_EVERY updates while it lasts
        (ONSET_ONLY kinds: when they say something other than their last line, or come back after WARN_EVERY
        updates or more without them)."""
        step = record["update_step"]
        for kind, message in record["warnings"].items():
            if kind.startswith(ONSET_ONLY):
                # A trained model's format reward flickers between "everyone earned 0.5" and not: one line per
                # thing said, not one per flicker (metrics.jsonl still records every update's warnings).
                said = re.sub(r"update \d+", "update N", message)
                back = step - self._seen.get(kind, step) > WARN_EVERY
                if back or self._said.get(kind) != said:
                    console(f"[mlx-grpo] WARNING (update {step}): {message}")
                    self._said[kind] = said
                self._seen[kind] = step
                continue
            last = self._warned.get(kind)
            if last is None or step - last >= WARN_EVERY:
                console(f"[mlx-grpo] WARNING (update {step}): {message}")
                self._warned[kind] = step
        # A condition that clears and comes back is announced again at once.
        self._warned = {k: v for k, v in self._warned.items() if k in record["warnings"]}

    def log_eval(self, record: dict) -> None:
        self._append("eval.jsonl", record)
        console(f"[mlx-grpo] eval at update {record['update_step']}: accuracy {record['accuracy']:.3f} "
                f"(lenient {record['accuracy_lenient']:.3f}, format {record['format_rate']:.3f}"
                + (f", tool calls {record['tool_call_rate']:.3f}" if "tool_call_rate" in record else "") + ") "
                f"on {record['num_examples']} example{'s' * (record['num_examples'] != 1)}")

    def log_completions(self, update_step: int, stats: BatchStats) -> None:
        """Every completion of one batch step with its rewards and advantage."""
        if not stats.examples:  # dynamic sampling found no informative group
            return
        G = len(stats.texts) // len(stats.examples)
        transcripts = stats.transcripts
        for row, text in enumerate(stats.texts):
            example = stats.examples[row // G]
            rewards = {n: (None if np.isnan(v[row]) else float(v[row])) for n, v in stats.per_func.items()}
            record = {"update_step": update_step, "prompt": example.prompt, "answer": example.answer,
                      "completion": text, "rewards": rewards, "reward": float(stats.rewards[row]),
                      "advantage": float(stats.advantages[row])}
            if stats.images is not None:  # image prompts (vlm/): the images it was asked about
                record["images"] = stats.images[row // G]
            if stats.demo is not None:  # a demonstration (the reference solution), not a sample of the policy
                record["demo"] = bool(stats.demo[row])
            if transcripts is not None:  # multi-turn: each turn with its origin (model, tool, environment)
                record["turns"] = [{"origin": t.origin, "text": t.text,
                                    "info": json.loads(json.dumps(t.info, default=str))}  # an environment's own
                                   for t in transcripts[row].turns]
            self._append("completions.jsonl", record)

    def truncate_after(self, update_step: int) -> None:
        """On resume, drop records of updates after the checkpoint (they will be redone)."""
        for name in ("metrics.jsonl", "completions.jsonl", "eval.jsonl"):
            path = self.run_dir / name
            if path.is_file():
                keep = [line for line in path.read_text().splitlines()
                        if line.strip() and json.loads(line).get("update_step", 0) <= update_step]
                # A new file renamed over the old: a kill mid-write leaves the old log whole, never an empty one.
                tmp = path.with_name(f".{name}.tmp")
                with open(tmp, "w") as f:
                    f.write("".join(line + "\n" for line in keep))
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, path)

    @staticmethod
    def print_line(record: dict, progress: str = "") -> None:
        """The per-update console line (when the progress bar is off), with `progress` (pace()) after it."""
        line = (f"[mlx-grpo] update {record['update_step']}: reward {record['reward_mean']:.3f} "
                f"loss {fmt(record['loss'], '.4f')} kl {fmt(record['kl'], '.4f')} "
                + (f"teacher_kl {fmt(record['teacher_kl'], '.4f')} " if "teacher_kl" in record else "")
                + (f"forward_kl {fmt(record['forward_kl'], '.4f')} " if "forward_kl" in record else "")
                + f"len {record['completion_length_mean']:.0f} lr {record['lr']:.2e}"
                + (f" draws {record['draws']} in {record['decode_passes']} pass{'es' * (record['decode_passes'] != 1)}"
                   if "decode_passes" in record else ""))
        console(line + (f", {progress}" if progress else ""))


def summary_lines(updates: int, session_updates: int, wall_s: float, rewards: list[tuple[int, float]],
                  last_eval: dict | None, checkpoint: Path | None, records: list[dict] = ()) -> list[str]:
    """The end-of-run summary: updates and wall time (of this session, when it resumed a run), reward_mean
    at the start vs the end of `rewards` (each the mean over its first / last min(5, n // 2) updates, named;
    commands/train.py passes a resumed run's whole log), then per reward function of `records` (the same metrics
    records) what rose and what did not, the teacher's KL with distillation, the last eval and the final
    checkpoint."""
    resumed = session_updates != updates
    lines = [f"[mlx-grpo] summary: {updates} update{'s' * (updates != 1)}"
             + (f" ({session_updates} in this session)" if resumed else "")
             + f", wall time {duration(wall_s)}" + (" (this session)" if resumed else "")]
    k = max(1, min(5, len(rewards) // 2))  # the first and the last k updates never overlap
    distilled = [r for r in records if r.get("teacher_kl") is not None]
    if len(distilled) > 1:  # on-policy distillation: how far the student's samples are from the teacher's
        lines.append(f"[mlx-grpo]   teacher_kl: {np.mean([r['teacher_kl'] for r in distilled[:k]]):.3f} (first "
                     f"updates) -> {np.mean([r['teacher_kl'] for r in distilled[-k:]]):.3f} (last updates)")
    forward = [r for r in records if r.get("forward_kl") is not None]
    if len(forward) > 1:  # distill_topk: the top-k forward KL to the teacher at the student's positions
        lines.append(f"[mlx-grpo]   forward_kl: {np.mean([r['forward_kl'] for r in forward[:k]]):.3f} (first "
                     f"updates) -> {np.mean([r['forward_kl'] for r in forward[-k:]]):.3f} (last updates)")
    scored = not records or any(key.startswith("reward/") for key in records[0])  # pure distillation: no reward
    if rewards and scored:

        def span(part: list[tuple[int, float]]) -> str:
            steps = f"update {part[0][0]}" if len(part) == 1 else f"mean of updates {part[0][0]}-{part[-1][0]}"
            return f"{np.mean([r for _, r in part]):.3f} ({steps})"

        lines.append(f"[mlx-grpo]   reward_mean: {span(rewards[:k])}"
                     + (f" -> {span(rewards[-k:])}" if len(rewards) > 1 else ""))
        if len(records) > 1:
            lines += reward_function_lines(records[:k], records[-k:])
    if last_eval is not None:
        lines.append(f"[mlx-grpo]   last eval (update {last_eval['update_step']}): accuracy "
                     f"{last_eval['accuracy']:.3f}, lenient {last_eval['accuracy_lenient']:.3f} on "
                     f"{last_eval['num_examples']} example{'s' * (last_eval['num_examples'] != 1)}")
    if checkpoint is not None:
        lines.append(f"[mlx-grpo]   final checkpoint: {checkpoint}")
    return lines


def reward_function_lines(first: list[dict], last: list[dict]) -> list[str]:
    """Which reward function moved the total: its mean and the share of completions it credited over the
    `first` vs the `last` updates' records, each marked rose / fell / flat at the printed precision. `eval`
    scores right answers, so a run whose correctness reward stayed flat says that it will show no gain."""
    names = [key.removeprefix("reward/") for key in first[0] if key.startswith("reward/")]

    def mean(part: list[dict], key: str) -> float | None:
        values = [r[key] for r in part if isinstance(r.get(key), (int, float))]
        return float(np.mean(values)) if values else None

    lines = ["[mlx-grpo]   by reward function (mean, share of completions credited; first -> last updates):"]
    flat_correctness = []
    for name in names:
        before, after = mean(first, f"reward/{name}"), mean(last, f"reward/{name}")
        if before is None or after is None:
            continue
        moved = (after > before) - (after < before) if f"{after:.3f}" != f"{before:.3f}" else 0
        credit = ""
        shares = mean(first, f"reward_credited/{name}"), mean(last, f"reward_credited/{name}")
        if None not in shares:
            credit = f", credited {shares[0]:.0%} -> {shares[1]:.0%}"
        lines.append(f"[mlx-grpo]     {name}: {before:.3f} -> {after:.3f}{credit} "
                     f"({('fell', 'flat', 'rose')[moved + 1]})")
        if "correct" in name and moved <= 0:
            flat_correctness.append(name)
    if flat_correctness:
        lines.append(f"[mlx-grpo]   {', '.join(flat_correctness)} did not rise: `mlx-grpo eval` (right answers) "
                     f"will show no gain yet")
    return lines
