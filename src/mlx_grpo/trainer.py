"""The GRPO steps of `mlx-grpo train` (run.py drives them; assembly.py builds the Trainer): rollouts,
rewards, advantages, clipped updates, the state a checkpoint holds.

One optimizer update consumes `gradient_accumulation_steps` batch steps of B prompts x G completions,
`num_iterations` times. Rollout keys derive from (seed, draw, row), so a run and its resumption
sample the same tokens; checkpoints are written only between rollout groups, where that holds.
Data-parallel (distributed.py): every rank draws the same batch of B prompts, samples and scores its
own B / ranks of them with their global row keys, and the update sums every rank's rows with the
weights the whole batch gives them.
"""

from __future__ import annotations

import json
import math
import time
from concurrent.futures import BrokenExecutor
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten

from mlx_grpo import checkpoint as ckpt
from mlx_grpo.config import Config
from mlx_grpo.distributed import World, zero_gradients
from mlx_grpo.data import EpochSampler, Example, reward_columns
from mlx_grpo.demonstrations import Demonstrator
from mlx_grpo.errors import UserError
from mlx_grpo.health import RunHealth
from mlx_grpo.loss import LossSums, empty_sums, group_advantages
from mlx_grpo.models.adapters import adapter_parameters
from mlx_grpo.models.precision import MasterWeights, dtype_name
from mlx_grpo.policy import (Policies, StepData, accumulate_gradients, clip_by_global_norm, logprob_pass, loss_weights,
                             make_grad_fn)
from mlx_grpo.reward_workers import RewardRunner
from mlx_grpo.rewards import RewardScores, RewardSet, overlong_penalty
from mlx_grpo.engine import RolloutEngine
from mlx_grpo.multiturn import encode_prompts, model_texts, multiturn_for, rollouts, tool_use
from mlx_grpo.prompts import WorkedExamples, build_run_prompts
from mlx_grpo.rollout import SamplingParams, select_groups
from mlx_grpo.train_step import CompiledUpdate


def learning_rate_at(update: int, total: int, cfg: Config) -> float:
    """Linear warmup then cosine/linear/constant decay towards 0. update is 1-based; the decay
    starts from the peak at the first update after warmup, so no update has a zero rate."""
    warmup = int(math.ceil(cfg.warmup_ratio * total))
    if update <= warmup:
        return cfg.learning_rate * update / warmup
    if cfg.lr_scheduler_type == "constant" or total <= warmup:
        return cfg.learning_rate
    progress = (update - warmup - 1) / (total - warmup)
    if cfg.lr_scheduler_type == "linear":
        return cfg.learning_rate * max(0.0, 1.0 - progress)
    return cfg.learning_rate * 0.5 * (1.0 + math.cos(math.pi * progress))


def row_keys(seed: int, draw: int, rows: int, share: slice) -> mx.array:
    """The sampling keys [n, 2] of the rows in `share` of a draw's `rows` rows: a row's key depends on
    its place in the whole batch, not on which rank samples it."""
    draw_key = mx.random.split(mx.random.key(seed), draw + 1)[draw]
    return mx.random.split(draw_key, rows)[share]


@dataclass
class Counters:
    update_step: int = 0
    batch_step: int = 0
    skipped_updates: int = 0
    consecutive_skips: int = 0
    prompts_cut: int = 0
    draws: int = 0  # rollout generations: batch steps plus dynamic sampling's extra draws (rollout keys)


@dataclass
class Draw:
    """One generation of B prompts x G completions with its rewards."""

    examples: list[Example]  # this rank's share of the batch
    rollout: object
    scores: object
    t_rollout: float
    t_reward: float
    flags: np.ndarray | None = None  # [B] groups with reward variance, over all ranks (dynamic sampling)
    sampled: tuple | None = None  # demonstrations: (rollout, scores) as sampled, before demonstrations replaced rows


@dataclass
class PendingRewards:
    """What a batch step still needs from its rewards, which may be computing in the reward workers;
    Trainer.resolve collects them."""

    draws: list[Draw]  # every draw of the batch step (dynamic sampling may draw more than one)
    stats: dict  # the batch step's stats: resolve adds their reward part
    selected: RewardScores | None = None  # dynamic sampling: the scores of the groups trained on


@dataclass
class Trainer:
    cfg: Config
    model: object
    tokenizer: object
    policies: Policies
    rewards: RewardSet
    train_examples: list[Example]
    run_dir: Path
    source_dir: Path
    eval_examples: list[Example] | None = None
    adapter_config: dict | None = None  # lora/dora: what checkpoints record next to the adapters
    masters: MasterWeights | None = None  # float32 masters of the trained weights (None: train the model as is)
    world: World = field(default_factory=World)
    counters: Counters = field(default_factory=Counters)
    worked: WorkedExamples = field(default_factory=WorkedExamples)  # drawn for the prompt (prompts.py)

    def __post_init__(self):
        cfg, world = self.cfg, self.world
        if self.masters is None:
            self.masters = MasterWeights(self.model, enabled=False)
        if cfg.batch_size % world.size:
            fits = [n for n in range(2, cfg.batch_size + 1) if cfg.batch_size % n == 0]
            world.fail(f"batch_size = {cfg.batch_size} prompts do not divide among {world.size} ranks: set "
                       f"batch_size to a multiple of {world.size} (e.g. {-(-cfg.batch_size // world.size) * world.size})"
                       + (f", or launch {' / '.join(map(str, fits))} processes" if fits else ""))
        self.sampler = EpochSampler(len(self.train_examples), cfg.batch_size, cfg.num_epochs, cfg.seed)
        groups = self.sampler.num_batches_total // cfg.gradient_accumulation_steps
        if groups == 0:
            raise UserError(f"{len(self.train_examples)} training examples give {self.sampler.num_batches_total} "
                            f"batch steps, fewer than gradient_accumulation_steps="
                            f"{cfg.gradient_accumulation_steps}: add data or lower batch_size/accumulation")
        self.total_updates = groups * cfg.num_iterations
        self.optimizer = optim.AdamW(learning_rate=learning_rate_at(1, self.total_updates, cfg),
                                     betas=[cfg.adam_beta1, cfg.adam_beta2], weight_decay=cfg.weight_decay,
                                     bias_correction=True)
        self.grad_fn = make_grad_fn(cfg, self.model)
        self.compiled_update = CompiledUpdate(self.optimizer, self.model, self.masters) if cfg.compile_update else None
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None \
            else sorted(self.tokenizer.eos_token_ids)[0]
        self.params = SamplingParams(cfg.max_new_tokens, cfg.temperature, cfg.top_p, cfg.top_k, cfg.min_p,
                                     tuple(cfg.stop))
        self._batches = iter(self.sampler)
        self.reward_runner = RewardRunner(self.rewards, cfg, Path.cwd())
        self._warned_context = False
        self.demonstrator = None if cfg.demonstrations == "off" else Demonstrator(
            cfg, self.tokenizer, self.rewards, self.pad_id, self.world.print)
        # Dropout (lora_dropout) acts only in the gradient pass: rollouts and log-prob passes see the
        # deterministic model, so their log-probs are those of the policy that sampled.
        self.model.eval()
        # The engine samples from its own copy of the sampling policy, rebuilt whenever that policy changes.
        self.engine = RolloutEngine(self.tokenizer, mode=cfg.rollout_engine, graph=cfg.decode_graph).refresh(self.policies.sampler)
        # Tools or an environment: rollouts are episodes (multiturn.py) over the same engine.
        self.multiturn = multiturn_for(cfg, self.tokenizer, getattr(getattr(self.model, "args", None),
                                                                    "model_type", None))
        # The one system prompt of the run's rollouts (its worked examples included), and of its evaluations.
        self.prompt, self.eval_prompt = build_run_prompts(cfg, self.tokenizer, self.multiturn, self.worked,
                                                          self.train_examples + (self.eval_examples or []),
                                                          self.world.print)
        # Silent-reward, plateau and gaming checks (health.py); their state is part of the checkpoint's.
        self.health = RunHealth(self.rewards.names, cfg.max_updates_without_signal, cfg.plateau_updates,
                                cfg.gaming_evals)

    # ------------------------------------------------------------------ one batch step
    def _encode(self, examples: list[Example]) -> tuple[list[list[int]], mx.array, list[Example]]:
        """This rank's share of a draw: (its prompts' ids, their row keys, its examples)."""
        cfg, G = self.cfg, self.cfg.num_generations
        # Every rank encodes the whole batch (cheap), so prompts_cut counts it without a collective.
        encoded = encode_prompts(self.multiturn, self.tokenizer, examples, cfg, self.prompt.system)
        self.counters.prompts_cut += sum(cut for _, cut in encoded)
        context = getattr(getattr(self.model, "args", None), "max_position_embeddings", None)
        longest = max(len(ids) for ids, _ in encoded)
        if isinstance(context, int) and longest + cfg.max_new_tokens > context and not self._warned_context:
            # RoPE models run past it, on positions they never saw in training: say so once, do not stop
            self._warned_context = True
            self.world.print(f"[mlx-grpo] warning: a prompt of {longest} tokens + max_new_tokens "
                             f"({cfg.max_new_tokens}) exceed {cfg.model_name!r}'s context window of {context} "
                             "tokens: the model works past positions it was trained on; lower max_prompt_length "
                             "(prompts are cut to it from the left) or max_new_tokens")
        share = self.world.share(len(examples))
        keys = row_keys(cfg.seed, self.counters.draws, len(encoded) * G, slice(share.start * G, share.stop * G))
        self.counters.draws += 1
        return [ids for ids, _ in encoded[share]], keys, examples[share]

    def _submit(self, examples: list[Example], rollout, t_rollout: float) -> Draw:
        """Submit a draw's completions for scoring (inline or to the reward workers); _scores collects them."""
        G, t1 = self.cfg.num_generations, time.perf_counter()
        columns = {k: [v for v in values for _ in range(G)] for k, values in reward_columns(examples).items()}
        prompts = [e.prompt for e in examples for _ in range(G)]
        # Each completion's own ids, up to and including its end token (as TRL passes them), not padded rows.
        ids = [row[:n] for row, n in zip(rollout.completion_ids.tolist(), rollout.extents.tolist())]
        # multi-turn: rewards score what the model wrote, as evaluation does; `transcripts` gives them the
        # whole episode, completion_ids every token of it
        pending = self.reward_runner.submit(prompts, model_texts(rollout, self.cfg.prefill), ids, columns,
                                            rollout.transcripts)
        return Draw(examples, rollout, pending, t_rollout, time.perf_counter() - t1)

    def _draw(self, examples: list[Example]) -> Draw:
        """Generate G completions for each of this rank's share of the batch's examples, submitted for scoring."""
        prompts, keys, mine = self._encode(examples)
        t0 = time.perf_counter()
        rollout = self._generate([(prompts, keys, mine)])[0]
        return self._submit(mine, rollout, time.perf_counter() - t0)

    def _generate(self, jobs: list[tuple[list[list[int]], mx.array, list[Example]]]) -> list:
        """The rollouts of batch steps [(prompts, row keys, examples)], decoded together."""
        return rollouts(self.engine, self.multiturn, jobs, self.cfg.num_generations, self.params, self.cfg.prefill)

    def _scores(self, draw: Draw, sampled: bool = False) -> RewardScores:
        """A draw's rewards plus the length penalty, waiting for them if the workers are still at it; with
        demonstrations, those of the rows trained on (sampled: of the rows as sampled)."""
        if not isinstance(draw.scores, RewardScores):
            self._collect(draw)
        return draw.sampled[1] if sampled and draw.sampled is not None else draw.scores

    def _collect(self, draw: Draw) -> None:
        """Wait for a draw's scores, add the length penalty and put in its demonstrations (scored inline)."""
        t0 = time.perf_counter()
        try:
            scores = draw.scores.result()
        except BrokenExecutor as e:
            raise UserError(f"the reward workers stopped ({type(e).__name__}: {e}); try reward_executor = thread "
                            "or reward_workers = 0") from None
        cfg = self.cfg
        if cfg.overlong_penalty > 0:
            scores = scores.with_penalty("overlong_penalty", overlong_penalty(
                draw.rollout.extents, cfg.max_new_tokens, cfg.overlong_buffer, cfg.overlong_penalty))
        draw.scores = scores
        if self.demonstrator is not None:  # groups that earned nothing get a demonstration (demonstrations.py)
            draw.sampled = (draw.rollout, scores)
            draw.rollout, draw.scores = self.demonstrator.inject(draw.examples, draw.rollout, scores)
        draw.t_reward += time.perf_counter() - t0  # time the loop waited: the whole scoring when inline

    def _flags(self, draw: Draw) -> np.ndarray:
        """Which of a draw's B groups (all ranks) have rewards that are not all equal."""
        if draw.flags is None:
            mine = np.ptp(self._scores(draw).total.reshape(-1, self.cfg.num_generations), axis=1) > 0
            draw.flags = np.concatenate(self.world.gather(mine, "dynamic sampling"))
        return draw.flags

    def _informative_batch(self, draws: list[Draw]) -> tuple[list[Example], object, object]:
        """Dynamic sampling: the first batch_size groups, in draw order over all ranks, whose rewards are
        not all equal; this rank keeps those of its own share (ranks may train on unequal numbers)."""
        G = self.cfg.num_generations
        share = self.world.share(self.cfg.batch_size)
        chosen = [(i, g) for i, d in enumerate(draws) for g in np.flatnonzero(self._flags(d))][:self.cfg.batch_size]
        picks = [(i, int(g) - share.start) for i, g in chosen if share.start <= g < share.stop]
        rollout = select_groups([d.rollout for d in draws], picks, self.pad_id)
        scores = RewardScores.concat([draws[i].scores.select(range(g * G, (g + 1) * G)) for i, g in picks]) \
            if picks else draws[0].scores.select([])
        return [draws[i].examples[g] for i, g in picks], rollout, scores

    def batch_steps(self, batches: list[list[Example]]) -> list[tuple[StepData, dict]]:
        """An update's batch steps. Without dynamic sampling their rollouts decode together (the engine
        refills slots freed by ended rows with the next steps' prompts), each row with its own keys, so
        every step samples what it would alone; with it, each step draws in turn (more draws depend on
        the rewards of earlier ones)."""
        if self.cfg.dynamic_sampling or len(batches) == 1:
            return [self.batch_step(examples) for examples in batches]
        encoded = [self._encode(examples) for examples in batches]
        t0 = time.perf_counter()
        rollouts = self._generate(encoded)
        share = (time.perf_counter() - t0) / len(batches)  # one decode for all: each step is shown its share
        draws = [self._submit(mine, rollout, share) for (_, _, mine), rollout in zip(encoded, rollouts)]
        return [self._step_from([draw]) for draw in draws]

    def batch_step(self, examples: list[Example]) -> tuple[StepData, dict]:
        """Generate (and, with dynamic sampling, filter) one batch step and run its old/reference log-prob
        passes. Its rewards may still be computing: the step holds them as `pending`, and `resolve`
        (called by update) collects them and sets the advantages and the reward stats."""
        cfg = self.cfg
        draws = [self._draw(examples)]
        if cfg.dynamic_sampling:  # needs each draw's rewards before deciding to draw more
            def informative() -> int:
                return sum(int(self._flags(d).sum()) for d in draws)

            while informative() < cfg.batch_size and len(draws) <= cfg.max_resample_batches:
                more = self.next_examples()
                if more is None:  # the data is exhausted: train on what there is
                    break
                draws.append(self._draw(more))
        return self._step_from(draws)

    def _step_from(self, draws: list[Draw]) -> tuple[StepData, dict]:
        """A batch step from its draws (several: dynamic sampling keeps their informative groups): the
        old/reference log-prob passes and the stats."""
        cfg = self.cfg
        selected = None
        for d in draws if self.demonstrator is not None else ():  # demonstrations enter before the passes
            self._scores(d)
        if cfg.dynamic_sampling:
            examples, rollout, selected = self._informative_batch(draws)
        else:
            examples, rollout = draws[0].examples, draws[0].rollout  # this rank's share
        t2 = time.perf_counter()
        old = ref = None
        if len(rollout.texts):
            if self.policies.needs_old_pass:
                old = logprob_pass(self.policies.sampler, rollout, cfg.temperature, cfg.micro_batch_size,
                                   self.pad_id, cfg.micro_batch_tokens)
            ref = self.policies.reference_logprobs(rollout, self.pad_id)
        t3 = time.perf_counter()
        self.counters.batch_step += 1
        drawn = [d.rollout if d.sampled is None else d.sampled[0] for d in draws]  # the policy's samples
        entropies = [np.array(r.entropies) for r in drawn]
        stats = {"examples": examples, "texts": rollout.texts, "transcripts": rollout.transcripts,
                 "lengths": np.concatenate([r.lengths for r in drawn]),
                 "truncated": np.concatenate([r.truncated for r in drawn]), "draws": len(draws),
                 "groups_trained": len(examples), "entropy_sum": float(sum(e.sum() for e in entropies)),
                 "t_rollout": sum(d.t_rollout for d in draws), "t_logprob": t3 - t2,
                 "tokens": int(sum(r.lengths.sum() for r in drawn))}
        if rollout.demo is not None:  # which trained rows are demonstrations (demo_fraction, completions.jsonl)
            stats["demo"] = rollout.demo
        if drawn[0].transcripts is not None and self.multiturn.stop_strings:  # tools: calls (failed ones) per row
            stats["tool_calls"], stats["tool_errors"] = tool_use([t for r in drawn for t in r.transcripts])
        return StepData(rollout, None, old, ref, PendingRewards(draws, stats, selected)), stats

    def resolve(self, step: StepData) -> None:
        """Collect a batch step's pending rewards (waiting for them if the workers are still at it): its
        advantages and the reward part of its stats. Does nothing for a resolved step."""
        pending = step.pending
        if pending is None:
            return
        G, draws = self.cfg.num_generations, pending.draws
        scores = pending.selected if pending.selected is not None else self._scores(draws[0])
        step.advantages = self._advantages(scores.total)  # [N]
        drawn = RewardScores.concat([self._scores(d, sampled=True) for d in draws])
        grouped = drawn.total.reshape(-1, G)
        pending.stats.update(rewards=scores.total, per_func=scores.per_func,
                             advantages=np.array(step.advantages.tolist()),
                             drawn_scores=drawn, zero_std=float(np.mean(grouped.max(1) == grouped.min(1))),
                             t_reward=sum(d.t_reward for d in draws))
        step.pending = None

    def _advantages(self, totals: np.ndarray) -> mx.array:
        """Group-normalised advantages [N] of this rank's rows; scale_rewards = batch takes its std over
        the rows of every rank."""
        G, world = self.cfg.num_generations, self.world
        if self.cfg.scale_rewards != "batch" or world.size == 1:
            return group_advantages(mx.array(totals), G, self.cfg.scale_rewards)
        parts = world.gather(totals, "the batch reward scale")
        start = sum(len(p) for p in parts[:world.rank])
        return group_advantages(mx.array(np.concatenate(parts)), G, "batch")[start:start + len(totals)]

    def gradients(self, steps: list[StepData]) -> tuple[object, LossSums | None]:
        """The update's gradient and LossSums over the rows of every rank (None, None when no row enters
        the loss anywhere). Rewards must be resolved."""
        cfg = self.cfg
        weights = loss_weights(cfg, steps, self.world)
        if cfg.lora_dropout > 0:  # dropout masks come from the global generator: derive them from the run's seed
            mx.random.seed((self.world.seed(cfg.seed) * 1_000_003 + self.counters.update_step) % 2 ** 63)
        self.model.train()
        try:
            grads, sums = accumulate_gradients(self.grad_fn, steps, weights, cfg.micro_batch_size, self.pad_id,
                                               cfg.micro_batch_tokens)
        finally:
            self.model.eval()
        if self.world.size == 1:
            return grads, sums
        if grads is None:  # none of this rank's rows counts; the others' may
            grads, sums = zero_gradients(self.model), empty_sums()
        grads, sums = self.world.average_gradients(grads), self.world.reduce_sums(sums)
        return (grads, sums) if sums.tokens.item() > 0 else (None, None)

    # ------------------------------------------------------------------ one update
    def update(self, steps: list[StepData]) -> dict:
        cfg = self.cfg
        self.counters.update_step += 1
        lr = learning_rate_at(self.schedule_position(), self.total_updates, cfg)
        self.optimizer.learning_rate = mx.array(lr, dtype=mx.float32)
        for s in steps:  # waiting for rewards counts in time_reward_s, not in the training time
            self.resolve(s)
        t0 = time.perf_counter()
        grads, sums = self.gradients(steps)
        result = {"lr": lr, "loss": None, "grad_norm": None, "kl": None, "clip_fraction": None,
                  "clip_low_fraction": None, "clip_high_fraction": None, "ratio_min": None, "ratio_mean": None,
                  "ratio_max": None, "skipped": True, "loss_tokens": 0, "sampler_kl": None, "sampler_diff_max": None,
                  "is_weight_mean": None, "is_capped_fraction": None}
        if grads is None:
            self.world.print(f"[mlx-grpo] update {self.counters.update_step}: no completion entered the loss "
                             "(every group was dropped or every completion truncated and masked); update skipped")
        else:
            self._apply(grads, sums, result)
        refresh_old = self.policies.separate_old and self.counters.update_step % cfg.update_every == 0
        if refresh_old:
            self.policies.refresh()
        if refresh_old or not (self.policies.separate_old or result["skipped"]):  # the sampler's weights changed
            self.engine.refresh(self.policies.sampler)
        train_tokens = sum(int(s.rollout.lengths.sum()) for s in steps)
        dt = time.perf_counter() - t0
        return {**result, "t_train": dt, "train_tokens": train_tokens,
                "train_tokens_per_s": train_tokens / dt if dt > 0 else 0.0, "peak_memory_gb": mx.get_peak_memory() / 1e9}

    def schedule_position(self) -> int:
        """The update's place in the learning-rate schedule, by data consumed: the update count when every
        batch step draws once; ahead of it when dynamic sampling drew extra batches, so the decay ends
        where the data does. 1-based."""
        cfg = self.cfg
        groups = -(-self.sampler.batches_done // cfg.gradient_accumulation_steps)  # rollout groups consumed
        iteration = (self.counters.update_step - 1) % cfg.num_iterations + 1
        return min(max(groups - 1, 0) * cfg.num_iterations + iteration, self.total_updates)

    def _apply(self, grads, sums: LossSums, result: dict) -> None:
        """Clip, check and apply one update's gradients; fill result with its metrics."""
        cfg = self.cfg
        grads, norm = clip_by_global_norm(grads, cfg.max_grad_norm)
        mx.eval(grads, norm)
        loss = sums.loss.item()
        finite = math.isfinite(loss) and math.isfinite(norm.item())
        tokens = sums.tokens.item()
        per_token = (lambda x: x.item() / tokens) if tokens else (lambda x: None)
        drawn = sums.sampled_tokens.item()  # the sampler figures leave demonstrations out
        per_drawn = (lambda x: x.item() / drawn) if drawn else (lambda x: None)
        result.update(loss=loss, grad_norm=norm.item(), kl=per_token(sums.kl), skipped=not finite,
                      clip_low_fraction=per_token(sums.clipped_low), clip_high_fraction=per_token(sums.clipped_high),
                      clip_fraction=per_token(sums.clipped_low + sums.clipped_high), ratio_mean=per_token(sums.ratio),
                      ratio_min=sums.ratio_min.item() if tokens else None,
                      ratio_max=sums.ratio_max.item() if tokens else None, loss_tokens=int(tokens),
                      sampler_kl=per_drawn(sums.sampler_kl),
                      sampler_diff_max=sums.sampler_diff_max.item() if drawn else None,
                      is_weight_mean=per_drawn(sums.is_weight), is_capped_fraction=per_drawn(sums.is_capped))
        if finite:
            if self.compiled_update is not None:
                self.compiled_update.step(grads)
            else:
                self.masters.step(self.optimizer, self.model, grads)
            mx.eval(self.model.parameters(), self.optimizer.state, self.masters.arrays())
            # Hand this update's freed buffers (rollout KV caches, activations, optimizer transients) back
            # to the device rather than keep them cached beside AdamW's state for the next rollout: near
            # the memory limit (a 1.9B model on an H100) later updates slowed several-fold (BENCHMARKS.md).
            mx.clear_cache()
            self.counters.consecutive_skips = 0
            return
        self.counters.skipped_updates += 1
        self.counters.consecutive_skips += 1
        self.world.print(f"[mlx-grpo] update {self.counters.update_step}: non-finite loss or gradient "
                         f"(loss={loss}, grad_norm={norm.item()}); update skipped")
        if self.counters.consecutive_skips >= cfg.max_consecutive_skips:  # the same on every rank
            self.world.fail(f"{self.counters.consecutive_skips} consecutive updates had a non-finite loss or "
                            "gradient; stopping (try a lower learning_rate or max_grad_norm). The weights "
                            "of the last finite update are in the latest checkpoint.")

    # ------------------------------------------------------------------ state
    def state(self) -> dict:
        # Sampling keys derive from (seed, counters.draws, row): the counters are the whole random state.
        return {"counters": vars(self.counters).copy(), "data_cursor": self.sampler.state(),
                "total_updates": self.total_updates, "world_size": self.world.size, "health": self.health.state()}

    def restore(self, path: Path, loaded: tuple, adapters: bool) -> None:
        """Continue from the checkpoint at `path`, as rank 0 read it: loaded is load_checkpoint's tuple,
        adapters holds_adapters' answer (other ranks get both sent and may have no `path` of their own)."""
        weights, opt_state, state, old, masters = loaded
        if state.get("total_updates", self.total_updates) != self.total_updates:
            raise UserError(f"--resume: {path} belongs to a run of {state['total_updates']} updates and this config "
                            f"gives {self.total_updates}: the data, epochs or batch shape differ; resume with the "
                            "run's own config (config.resolved.json)")
        saved = state.get("world_size", 1)
        if saved != self.world.size:
            # Each rank's share of a batch, hence the float sums of the loss and of the gradients, depend
            # on the world size: another one would not continue the run exactly.
            raise UserError(f"--resume: {path} was written by a run of {saved} process(es) and this one has "
                            f"{self.world.size}; resume with {saved} (e.g. `mlx.launch -n {saved} -- mlx-grpo "
                            "train ... --resume latest`), or start a new run")
        if self.adapter_config is not None:
            self._check_adapter_keys(weights, path)
        elif adapters:
            raise UserError(f"--resume: {path} holds lora/dora adapters but train_type is full; resume with the "
                            "run's own config (config.resolved.json)")
        current = {k: v.dtype for k, v in tree_flatten(self.model.trainable_parameters())}
        saved = sorted({dtype_name(v.dtype) for k, v in weights.items() if k in current and v.dtype != current[k]})
        if saved:  # loading would silently train in the checkpoint's dtype (or round it to this one's)
            raise UserError(f"--resume: {path} holds {'/'.join(saved)} weights and this run computes in "
                            f"{dtype_name(next(iter(current.values())))}: set model_dtype = {saved[0]} to resume "
                            "it (model_dtype = auto resolves per machine)")
        if masters is not None and not self.masters.active:
            raise UserError(f"--resume: {path} holds float32 master weights but this run keeps none "
                            "(master_weights = false or float32 compute): resume with the run's own config")
        try:
            self.model.load_weights(list(weights.items()), strict=self.adapter_config is None)
        except ValueError as exc:  # another model's checkpoint: one line, not mlx's list of every tensor
            first = str(exc).splitlines()[0][:200]
            raise UserError(f"--resume: {path} does not fit model {self.cfg.model_name!r} ({first}); resume with "
                            "the model the run was trained from") from None
        if self.masters.active:  # a checkpoint without masters (written without them) widens its weights
            self.masters.adopt(masters or dict(tree_flatten(self.model.trainable_parameters())))
            self.masters.sync(self.model)
        self.optimizer.state = opt_state
        self.counters = Counters(**{"draws": state["counters"]["batch_step"], **state["counters"]})
        self.sampler.load_state(state["data_cursor"])
        self.health.load_state(state.get("health"))
        self._batches = iter(self.sampler)
        if self.policies.separate_old:
            if self.adapter_config is not None:  # the old adapters on the shared base weights
                old = tree_unflatten(list({**dict(tree_flatten(self.model.parameters())),
                                           **dict(tree_flatten(old))}.items()))
            self.policies.refresh(old)
        mx.eval(self.model.parameters(), self.optimizer.state, self.masters.arrays())
        self.engine.refresh(self.policies.sampler)

    def _check_adapter_keys(self, weights: dict, path: Path) -> None:
        expected = set(adapter_parameters(self.model))
        if set(weights) != expected:
            raise UserError(f"--resume: the adapters in {path} do not match this config's train_type/lora_* "
                            f"settings ({len(weights)} tensors saved, {len(expected)} expected); resume with the "
                            "run's own config (config.resolved.json)")

    def save(self) -> Path:
        config_json = json.loads((self.source_dir / "config.json").read_text())
        old = self.policies.old_params if self.policies.separate_old else None
        if old is not None and self.adapter_config is not None:  # the base is frozen: only adapters differ
            keep = set(adapter_parameters(self.model))
            old = {k: v for k, v in tree_flatten(old) if k in keep}
        path = ckpt.save_checkpoint(self.run_dir, self.counters.update_step, model=self.model,
                                    optimizer=self.optimizer, trainer_state=self.state(), config=self.cfg,
                                    source_dir=self.source_dir, model_config=config_json, old_params=old,
                                    adapter_config=self.adapter_config, masters=self.masters.masters)
        ckpt.prune(self.run_dir, self.cfg.save_total_limit, path)
        return path

    def next_examples(self) -> list[Example] | None:
        indices = next(self._batches, None)
        return None if indices is None else [self.train_examples[i] for i in indices]

