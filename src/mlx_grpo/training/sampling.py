"""The sampling stage of a GRPO update: prompts drawn from the training data, G completions sampled for each,
submitted to the reward workers, and the old/reference log-prob passes run while they score -> Batch.

The step sources (training/step_sources.py, training/prefetch.py) drive it; the Trainer never calls it.
What a prompt is and how it decodes is `prompts`, by composition: TextPrompts here (the chat template, the
rollout engine; tools and environments as episodes, rollout/multiturn.py), vlm/image_prompts.ImagePrompts for
image prompts. Rollout keys derive from (seed, draw, row): a run and its resumption sample the same tokens.
"""

from __future__ import annotations

import time

import mlx.core as mx
import numpy as np

from mlx_grpo.config import Config
from mlx_grpo.data.examples import EpochSampler, Example
from mlx_grpo.training.distributed import World
from mlx_grpo.rewards.scoring import RewardScores
from mlx_grpo.rewards.workers import RewardRunner
from mlx_grpo.rollout.multiturn import MultiTurn, encode_prompts, rollouts
from mlx_grpo.rollout.rollout_records import Rollout, SamplingParams
from mlx_grpo.training.draws import (RATE_WINDOW, batch_stats, choose_groups, draw_scores, informative_batch,
                                     reward_inputs, row_keys, varied_groups, wave_size)
from mlx_grpo.training.policy import Policies
from mlx_grpo.training.records import Batch, Counters, DataPosition, Draw


class TextPrompts:
    """Text prompts: encoded with the chat template (cut from the left to max_prompt_length) and decoded by
    the sampling policy's rollout engine, as episodes when the run has tools or an environment."""

    def __init__(self, cfg: Config, tokenizer, multiturn: MultiTurn | None, context: int | None, say):
        self.cfg, self.tokenizer, self.multiturn, self.context, self.say = cfg, tokenizer, multiturn, context, say
        self.warned_context = False

    def encode(self, examples: list[Example], system: str, share: slice) -> tuple[list, int]:
        """(this rank's share of the prompts' ids, prompts cut over the whole batch). Every rank encodes the
        whole batch (cheap), so prompts_cut counts it without a collective."""
        cfg = self.cfg
        encoded = encode_prompts(self.multiturn, self.tokenizer, examples, cfg, system)
        longest = max(len(ids) for ids, _ in encoded)
        if isinstance(self.context, int) and longest + cfg.rollout.max_new_tokens > self.context \
                and not self.warned_context:
            # RoPE models run past it, on positions they never saw in training: say so once, do not stop
            self.warned_context = True
            self.say(f"[mlx-grpo] warning: a prompt of {longest} tokens + max_new_tokens "
                     f"({cfg.rollout.max_new_tokens}) exceed {cfg.model.model_name!r}'s context window of "
                     f"{self.context} tokens: the model works past positions it was trained on; lower "
                     "max_prompt_length (prompts are cut to it from the left) or max_new_tokens")
        return [ids for ids, _ in encoded[share]], sum(cut for _, cut in encoded)

    def generate(self, policies: Policies, jobs: list, params: SamplingParams) -> list[Rollout]:
        """The rollouts of batch steps [(prompts, row keys, examples)], decoded together (the engine refills
        rows freed by ended ones)."""
        return rollouts(policies.engine, self.multiturn, jobs, self.cfg.rollout.num_generations, params,
                        self.cfg.data.prefill)

    def new_update(self) -> None:
        """Text prompts keep nothing between updates."""

    def annotate(self, batch: Batch) -> None:
        """Text batch steps log nothing beyond their rows."""


class Sampling:
    """Draws prompts (the data cursor), samples them, submits their rewards and runs the log-prob passes."""

    def __init__(self, cfg: Config, tokenizer, policies: Policies, prompts, system: str, examples: list[Example],
                 data: EpochSampler, reward_runner: RewardRunner, demonstrator, counters: Counters, world: World,
                 pad_id: int):
        self.cfg, self.tokenizer, self.policies, self.prompts, self.system = cfg, tokenizer, policies, prompts, system
        self.examples, self.data, self.reward_runner, self.demonstrator = examples, data, reward_runner, demonstrator
        self.counters, self.world, self.pad_id = counters, world, pad_id
        r = cfg.rollout
        self.params = SamplingParams(r.max_new_tokens, r.temperature, r.top_p, r.top_k, r.min_p, tuple(r.stop))
        self.batches = iter(data)
        # carry_surplus: earlier draws whose varied groups (the mask, over all ranks) no batch step took yet
        self.carried: list[tuple[Draw, np.ndarray]] = []

    def next_examples(self) -> list[Example] | None:
        indices = next(self.batches, None)
        return None if indices is None else [self.examples[i] for i in indices]

    def drop_carried(self) -> None:
        """carry_surplus: forget the carried groups. At a checkpoint, so that the run that writes it and a run
        resumed from it continue alike (a checkpoint holds no rollouts)."""
        self.carried = []

    def rewind_data(self, cursor: dict) -> None:
        """Continue the data from a checkpoint's cursor."""
        self.data.load_state(cursor)
        self.batches = iter(self.data)

    def position(self) -> DataPosition:
        return DataPosition(self.data.batches_done, self.data.epoch, self.counters.prompts_cut)

    # ------------------------------------------------------------------ sample
    def encode(self, examples: list[Example]) -> tuple[list, mx.array, list[Example]]:
        """This rank's share of a draw: (its prompts, their row keys, its examples)."""
        G = self.cfg.rollout.num_generations
        share = self.world.share(len(examples))
        prompts, cut = self.prompts.encode(examples, self.system, share)
        self.counters.prompts_cut += cut
        keys = row_keys(self.cfg.run.seed, self.counters.draws, len(examples) * G,
                        slice(share.start * G, share.stop * G))
        self.counters.draws += 1
        return prompts, keys, examples[share]

    def sample(self, batches: list[list[Example]]) -> list[Draw]:
        """The draws of an update's batch steps, decoded together, their rewards submitted."""
        encoded = [self.encode(examples) for examples in batches]  # prompts, row keys
        t0 = time.perf_counter()
        out = self.prompts.generate(self.policies, encoded, self.params)  # sample
        share = (time.perf_counter() - t0) / len(batches)  # one decode for all: each step is shown its share
        return [self.submit_rewards(mine, rollout, share)  # score: submitted to the reward workers
                for (_, _, mine), rollout in zip(encoded, out)]

    def draw(self, examples: list[Example]) -> Draw:
        """G completions for each of this rank's share of the examples, submitted for scoring."""
        return self.sample([examples])[0]

    def submit_rewards(self, examples: list[Example], rollout: Rollout, t_rollout: float) -> Draw:
        """Submit a draw's completions for scoring (inline or to the reward workers); Trainer.score collects them."""
        t1 = time.perf_counter()
        pending = self.reward_runner.submit(*reward_inputs(examples, rollout, self.cfg.rollout.num_generations,
                                                           self.cfg.data.prefill))
        return Draw(examples, rollout, pending, t_rollout, time.perf_counter() - t1)

    def flags(self, draw: Draw) -> np.ndarray:
        """Which of a draw's B groups (all ranks) vary in dynamic_sampling_reward (or the total reward)."""
        if draw.flags is None:
            r = self.cfg.rollout
            scores: RewardScores = draw_scores(draw, self.cfg, self.demonstrator)
            mine = varied_groups(scores, r.num_generations, r.dynamic_sampling_reward)
            draw.flags = np.concatenate(self.world.gather(mine, "dynamic sampling"))
        return draw.flags

    def batch_step(self, examples: list[Example]) -> Batch:
        """One batch step on its own: draw (dynamic sampling: in waves, `waves`), then the log-prob passes while
        the rewards compute."""
        if not self.cfg.rollout.dynamic_sampling:
            return self.logprob_passes([self.draw(examples)])
        draws, passes = self.waves(examples)
        batch = self.logprob_passes(draws)
        batch.stats.decode_passes = passes
        return batch

    def waves(self, examples: list[Example]) -> tuple[list[Draw], int]:
        """Dynamic sampling's draws for one batch step, starting with `examples`, and the decode passes they took.

        The rule is sequential: draw batch_size prompts, and while fewer than batch_size groups (all ranks) vary,
        draw again, at most max_resample_batches times more; informative_batch trains on the first batch_size
        varied groups in draw order. Where a decode step costs about the same at more rows (host-bound plain
        rollouts on a GPU), the draws are decoded in waves: each wave decodes together (engine refill; row keys
        from (seed, draw, row): the tokens of one-by-one decoding) as many draws as the missing groups need at
        the varied-group rate of the run's latest draws (draws.wave_size: one draw at a run's start), within
        the cap and draws_per_pass (1, the default: one draw a pass); another wave follows while groups are
        still missing. The waves make at least the draws the sequential rule would, so the first batch_size
        varied groups, the groups trained on, are the same. Draws a wave decodes beyond those the rule needed
        (surplus) advance the data cursor and the draw counter like any draw: later batch steps get later
        prompts than one-by-one drawing would give them. Every rank takes the same decisions (the flags and
        the rate are over all ranks). carry_surplus: the groups carried from the batch step before count first
        (at most batch_size - 1 of them, so a batch step always draws), and the surplus is trained on later."""
        cfg, c = self.cfg, self.counters
        B, cap = cfg.training.batch_size, 1 + cfg.rollout.max_resample_batches
        draws: list[Draw] = []
        varied = sum(int(mask.sum()) for _, mask in self.carried)
        passes = 0
        batches = [examples]
        while True:
            size = wave_size(c.varied_recent, B - varied, min(cap - len(draws), cfg.rollout.draws_per_pass))
            while len(batches) < size and (more := self.next_examples()) is not None:
                batches.append(more)
            if not batches:  # the data is exhausted: train on what there is
                return draws, passes
            wave = self.sample(batches)  # one decode pass
            passes += 1
            counts = [int(self.flags(d).sum()) for d in wave]
            c.varied_recent = (c.varied_recent + counts)[-RATE_WINDOW:]
            draws += wave
            varied += sum(counts)
            if varied >= B or len(draws) >= cap or len(batches) < size:  # enough, the cap, or the data ran out
                return draws, passes
            batches = []

    # ------------------------------------------------------------------ old / reference log-probs
    def logprob_passes(self, draws: list[Draw]) -> Batch:
        """A batch step from its draws (several: dynamic sampling keeps their informative groups, after those
        carried from the batch step before; carry_surplus keeps the varied ones it leaves for the next): the
        old/reference log-prob passes, while the draws' rewards may still be computing."""
        cfg = self.cfg
        selected = None
        for d in draws if self.demonstrator is not None else ():  # demonstrations enter before the passes
            draw_scores(d, cfg, self.demonstrator)
        carried = 0
        if cfg.rollout.dynamic_sampling:  # carried groups first, then the new draws' (Sampling.waves)
            pool = [d for d, _ in self.carried] + draws
            B = cfg.training.batch_size
            chosen, surplus = choose_groups([m for _, m in self.carried] + [self.flags(d) for d in draws], B,
                                            B - 1 if cfg.rollout.carry_surplus else 0)
            share = self.world.share(B)
            carried = sum(i < len(self.carried) and share.start <= g < share.stop for i, g in chosen)  # this rank's
            masks: dict[int, np.ndarray] = {}  # draw index -> its groups (all ranks) carried on, in draw order
            for i, g in surplus:
                masks.setdefault(i, np.zeros(B, dtype=bool))[g] = True
            self.carried = [(pool[i], mask) for i, mask in masks.items()]
            examples, rollout, selected = informative_batch(pool, chosen, share, self.pad_id)
        else:
            examples, rollout = draws[0].examples, draws[0].rollout  # this rank's share
        t0 = time.perf_counter()
        old = ref = teacher = topk = None
        if len(rollout.texts):
            if self.policies.needs_old_pass:
                old = self.policies.logprobs(self.policies.sampler, rollout, self.pad_id)
            ref = self.policies.reference_logprobs(rollout, self.pad_id)
            teacher, topk = self.policies.teacher_scores(rollout, self.pad_id)
        t_logprob = time.perf_counter() - t0
        self.counters.batch_step += 1
        multiturn = self.prompts.multiturn
        stats = batch_stats(draws, examples, rollout, t_logprob, bool(multiturn and multiturn.stop_strings))
        stats.groups_carried = carried
        batch = Batch(rollout, old, ref, draws, selected, stats, teacher, topk)
        self.prompts.annotate(batch)
        return batch
