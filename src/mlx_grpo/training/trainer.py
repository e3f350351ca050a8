"""The GRPO update of `mlx-grpo train` (run.py drives it; assembly.py builds the Trainer), top to bottom:

    batch_step(s)  sample -> score (submitted: rewards compute in the reward workers while...)
                   -> old/reference log-probs (...the GPU runs these passes)                   -> Batch
    update         scores collected -> advantages -> gradients -> clip -> optimizer step -> metrics
                                                                                    -> UpdateMetrics

One optimizer update consumes `gradient_accumulation_steps` batch steps of B prompts x G completions,
`num_iterations` times (each iteration is one `update` on the same batches, scored once). Rollout keys
derive from (seed, draw, row), so a run and its resumption sample the same tokens; checkpoints are written
only between rollout groups, where that holds. Data-parallel (distributed.py): every rank draws the same
batch of B prompts, samples and scores its own B / ranks of them with their global row keys, and the
update sums every rank's rows with the weights the whole batch gives them.
"""

from __future__ import annotations

from collections.abc import Callable

import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten

from mlx_grpo import checkpoint as ckpt
from mlx_grpo.config import Config
from mlx_grpo.data import EpochSampler, Example
from mlx_grpo.demonstrations import Demonstrator
from mlx_grpo.distributed import World, zero_gradients
from mlx_grpo.errors import UserError
from mlx_grpo.health import RunHealth
from mlx_grpo.loss import LossSums, empty_sums, group_advantages
from mlx_grpo.models.adapters import adapter_parameters
from mlx_grpo.models.precision import MasterWeights
from mlx_grpo.prompts import WorkedExamples, build_run_prompts
from mlx_grpo.rewards.scoring import RewardScores, RewardSet
from mlx_grpo.rewards.workers import RewardRunner
from mlx_grpo.rollout.engine import RolloutEngine
from mlx_grpo.rollout.multiturn import encode_prompts, multiturn_for, rollouts
from mlx_grpo.rollout.records import Rollout, SamplingParams
from mlx_grpo.training.compiled_update import CompiledUpdate
from mlx_grpo.training.draws import (add_rewards, batch_stats, collect, informative_batch, reward_inputs, row_keys,
                                     varied_groups)
from mlx_grpo.training.gradients import accumulate_gradients, clip_by_global_norm, loss_weights, make_grad_fn
from mlx_grpo.training.optimizer import learning_rate_at, make_optimizer, optimizer_step
from mlx_grpo.training.policy import Policies, logprob_pass
from mlx_grpo.training.prefetch import RolloutPrefetch, data_position
from mlx_grpo.training.records import Batch, Counters, Draw, SampledUpdate, StepData, UpdateMetrics


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
    resumed: tuple[Path, int] | None = None  # (checkpoint, update) resumed from: where a failed save points
    worked: WorkedExamples = field(default_factory=WorkedExamples)  # drawn for the prompt (prompts.py)

    def __post_init__(self):
        cfg, world = self.cfg, self.world
        if self.masters is None:
            self.masters = MasterWeights(self.model, enabled=False)
        B = cfg.training.batch_size
        if B % world.size:
            fits = [n for n in range(2, B + 1) if B % n == 0]
            world.fail(f"batch_size = {B} prompts do not divide among {world.size} ranks: set batch_size to a "
                       f"multiple of {world.size} (e.g. {-(-B // world.size) * world.size})"
                       + (f", or launch {' / '.join(map(str, fits))} processes" if fits else ""))
        self.sampler = EpochSampler(len(self.train_examples), B, cfg.training.num_epochs, cfg.run.seed)
        groups = self.sampler.num_batches_total // cfg.training.gradient_accumulation_steps
        if groups == 0:
            raise UserError(f"{len(self.train_examples)} training examples give {self.sampler.num_batches_total} "
                            f"batch steps, fewer than gradient_accumulation_steps="
                            f"{cfg.training.gradient_accumulation_steps}: add data or lower batch_size/accumulation")
        self.total_updates = groups * cfg.objective.num_iterations
        self.optimizer = make_optimizer(cfg, learning_rate_at(1, self.total_updates, cfg))
        self.grad_fn = make_grad_fn(cfg, self.model)
        self.compiled_update = CompiledUpdate(self.optimizer, self.model, self.masters) \
            if cfg.training.compile_update else None
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None \
            else sorted(self.tokenizer.eos_token_ids)[0]
        r = cfg.rollout
        self.params = SamplingParams(r.max_new_tokens, r.temperature, r.top_p, r.top_k, r.min_p, tuple(r.stop))
        self._batches = iter(self.sampler)
        self.reward_runner = RewardRunner(self.rewards, cfg, Path.cwd())
        self._warned_context = False
        self.demonstrator = None if cfg.objective.demonstrations == "off" else Demonstrator(
            cfg, self.tokenizer, self.rewards, self.pad_id, self.world.print)
        # Dropout (lora_dropout) acts only in the gradient pass: rollouts and log-prob passes see the
        # deterministic model, so their log-probs are those of the policy that sampled.
        self.model.eval()
        # The engine samples from its own copy of the sampling policy, rebuilt whenever that policy changes.
        self.engine = RolloutEngine(self.tokenizer, mode=r.rollout_engine, graph=r.decode_graph).refresh(
            self.policies.sampler)
        # Tools or an environment: rollouts are episodes (rollout/multiturn.py) over the same engine.
        self.multiturn = multiturn_for(cfg, self.tokenizer, getattr(getattr(self.model, "args", None),
                                                                    "model_type", None))
        # The one system prompt of the run's rollouts (its worked examples included), and of its evaluations.
        self.prompt, self.eval_prompt = build_run_prompts(cfg, self.tokenizer, self.multiturn, self.worked,
                                                          self.train_examples + (self.eval_examples or []),
                                                          self.world.print)
        # Silent-reward, plateau and gaming checks (health.py); their state is part of the checkpoint's.
        self.health = RunHealth(self.rewards.names, cfg.health.max_updates_without_signal, cfg.health.plateau_updates,
                                cfg.health.gaming_evals)
        # async_rollouts: each update's rollouts decode during the update before it (training/prefetch.py)
        self.prefetch = RolloutPrefetch(self) if r.async_rollouts else None

    # ------------------------------------------------------------------ the update, top to bottom
    def batch_steps(self, batches: list[list[Example]]) -> list[Batch]:
        """Dynamic sampling's batch steps, sampled one by one apart from their update (train_step samples
        the others together): each step draws more prompts until enough groups have rewards that differ."""
        return [self.batch_step(examples) for examples in batches]

    def batch_step(self, examples: list[Example]) -> Batch:
        """One batch step: sample G completions per prompt, submit them for scoring, and (dynamic
        sampling: once enough groups have rewards that differ) run the old/reference log-prob passes
        while the rewards compute. `update` collects the rewards."""
        cfg = self.cfg
        draws = [self.draw(examples)]  # sample -> score (submitted)
        if cfg.rollout.dynamic_sampling:  # needs each draw's rewards before deciding to draw more
            while sum(int(self.flags(d).sum()) for d in draws) < cfg.training.batch_size \
                    and len(draws) <= cfg.rollout.max_resample_batches:  # the varied groups (all ranks) so far
                more = self.next_examples()
                if more is None:  # the data is exhausted: train on what there is
                    break
                draws.append(self.draw(more))
        return self.logprob_passes(draws)  # old/reference log-probs, rewards computing meanwhile

    def train_step(self, batches: list[list[Example]] | list[Batch | StepData] | SampledUpdate,
                   sampled: Callable[[list[Batch]], None] = lambda batches: None) -> tuple[list, UpdateMetrics]:
        """One GRPO update, top to bottom. `batches`: the prompts of each batch step (sampled here, their
        rollouts decoding together: the engine refills rows freed by ended ones), their draws sampled
        during the update before (async_rollouts: prefetch.py), or batch steps sampled before (dynamic
        sampling, num_iterations > 1 reuse: run.py). -> (the batch steps, the update's metrics). The reward
        workers score while the GPU computes the old/reference log-probs. sampled(batches): called once the
        fresh batches are sampled, before the update (run.py: its progress bar and eval_steps' evaluations)."""
        cfg = self.cfg
        staleness = batches.staleness if isinstance(batches, SampledUpdate) else None
        if isinstance(batches, SampledUpdate) or (batches and not isinstance(batches[0], (Batch, StepData))):
            draws = batches.draws if staleness is not None else self.sample(batches)
            batches = [self.logprob_passes([draw]) for draw in draws]  # old/reference log-probs meanwhile
            sampled(batches)
        self.counters.update_step += 1
        metrics = UpdateMetrics(lr=self.set_learning_rate())
        steps = [self.score(b) for b in batches]  # rewards (waiting counts in time_reward_s) -> advantages
        t0 = time.perf_counter()
        grads, sums = self.gradients(steps)  # every rank's rows
        if grads is None:
            self.world.print(f"[mlx-grpo] update {self.counters.update_step}: no completion entered the loss "
                             "(every group was dropped or every completion truncated and masked); update skipped")
        else:
            grads, norm = clip_by_global_norm(grads, cfg.optimizer.max_grad_norm)  # clip
            mx.eval(grads, norm)
            metrics = UpdateMetrics.from_sums(metrics.lr, sums, norm)  # not finite: skipped
            if metrics.skipped:
                self.skip(metrics)
            else:
                self.optimizer_step(grads)  # float32 masters, then the compute copy
        self.refresh_sampler(applied=not metrics.skipped)
        metrics.t_train = time.perf_counter() - t0
        metrics.train_tokens = sum(int(s.rollout.lengths.sum()) for s in steps)
        metrics.train_tokens_per_s = metrics.train_tokens / metrics.t_train if metrics.t_train > 0 else 0.0
        metrics.peak_memory_gb = mx.get_peak_memory() / 1e9
        metrics.rollout_staleness = staleness
        return batches, metrics

    def update(self, batches: list[Batch | StepData]) -> UpdateMetrics:
        """train_step on batch steps sampled before: the update's metrics."""
        return self.train_step(batches)[1]

    def optimizer_step(self, grads) -> None:
        """The optimizer step on the clipped gradient (compile_update: as one compiled function)."""
        if self.compiled_update is not None:
            self.compiled_update.step(grads)
        else:
            optimizer_step(self.optimizer, self.model, grads, self.masters)
        # Hand this update's freed buffers (rollout KV caches, activations, optimizer transients) back to
        # the device rather than keep them cached beside AdamW's state for the next rollout: near the
        # memory limit (a 1.9B model on an H100) later updates slowed several-fold (BENCHMARKS.md).
        mx.clear_cache()
        self.counters.consecutive_skips = 0
        self.counters.applied_updates += 1

    # ------------------------------------------------------------------ sample
    def sample(self, batches: list[list[Example]]) -> list[Draw]:
        """The draws of an update's batch steps, decoded together, their rewards submitted."""
        encoded = [self.encode(examples) for examples in batches]  # prompts, row keys
        t0 = time.perf_counter()
        rollouts = self.generate(encoded)  # sample
        share = (time.perf_counter() - t0) / len(batches)  # one decode for all: each step is shown its share
        return [self.submit_rewards(mine, rollout, share)  # score: submitted to the reward workers
                for (_, _, mine), rollout in zip(encoded, rollouts)]

    def encode(self, examples: list[Example]) -> tuple[list[list[int]], mx.array, list[Example]]:
        """This rank's share of a draw: (its prompts' ids, their row keys, its examples)."""
        cfg, G = self.cfg, self.cfg.rollout.num_generations
        # Every rank encodes the whole batch (cheap), so prompts_cut counts it without a collective.
        encoded = encode_prompts(self.multiturn, self.tokenizer, examples, cfg, self.prompt.system)
        self.counters.prompts_cut += sum(cut for _, cut in encoded)
        context = getattr(getattr(self.model, "args", None), "max_position_embeddings", None)
        longest = max(len(ids) for ids, _ in encoded)
        if isinstance(context, int) and longest + cfg.rollout.max_new_tokens > context and not self._warned_context:
            # RoPE models run past it, on positions they never saw in training: say so once, do not stop
            self._warned_context = True
            self.world.print(f"[mlx-grpo] warning: a prompt of {longest} tokens + max_new_tokens "
                             f"({cfg.rollout.max_new_tokens}) exceed {cfg.model.model_name!r}'s context window of "
                             f"{context} "
                             "tokens: the model works past positions it was trained on; lower max_prompt_length "
                             "(prompts are cut to it from the left) or max_new_tokens")
        share = self.world.share(len(examples))
        keys = row_keys(cfg.run.seed, self.counters.draws, len(encoded) * G, slice(share.start * G, share.stop * G))
        self.counters.draws += 1
        return [ids for ids, _ in encoded[share]], keys, examples[share]

    def generate(self, jobs: list[tuple[list[list[int]], mx.array, list[Example]]]) -> list[Rollout]:
        """The rollouts of batch steps [(prompts, row keys, examples)], decoded together."""
        return rollouts(self.engine, self.multiturn, jobs, self.cfg.rollout.num_generations, self.params,
                        self.cfg.data.prefill)

    def draw(self, examples: list[Example]) -> Draw:
        """Generate G completions for each of this rank's share of the batch's examples, submitted for scoring."""
        prompts, keys, mine = self.encode(examples)
        t0 = time.perf_counter()
        rollout = self.generate([(prompts, keys, mine)])[0]
        return self.submit_rewards(mine, rollout, time.perf_counter() - t0)

    # ------------------------------------------------------------------ score
    def submit_rewards(self, examples: list[Example], rollout: Rollout, t_rollout: float) -> Draw:
        """Submit a draw's completions for scoring (inline or to the reward workers); scores() collects them."""
        t1 = time.perf_counter()
        pending = self.reward_runner.submit(*reward_inputs(examples, rollout, self.cfg.rollout.num_generations,
                                                           self.cfg.data.prefill))
        return Draw(examples, rollout, pending, t_rollout, time.perf_counter() - t1)

    def scores(self, draw: Draw, sampled: bool = False) -> RewardScores:
        """A draw's rewards plus the length penalty, waiting for them if the workers are still at it; with
        demonstrations, those of the rows trained on (sampled: of the rows as sampled)."""
        if not isinstance(draw.scores, RewardScores):
            collect(draw, self.cfg, self.demonstrator)
        return draw.sampled[1] if sampled and draw.sampled is not None else draw.scores

    def flags(self, draw: Draw) -> np.ndarray:
        """Which of a draw's B groups (all ranks) vary in dynamic_sampling_reward (or the total reward)."""
        if draw.flags is None:
            r = self.cfg.rollout
            mine = varied_groups(self.scores(draw), r.num_generations, r.dynamic_sampling_reward)
            draw.flags = np.concatenate(self.world.gather(mine, "dynamic sampling"))
        return draw.flags

    # ------------------------------------------------------------------ old / reference log-probs
    def logprob_passes(self, draws: list[Draw]) -> Batch:
        """A batch step from its draws (several: dynamic sampling keeps their informative groups): the
        old/reference log-prob passes, while the draws' rewards may still be computing."""
        cfg = self.cfg
        selected = None
        for d in draws if self.demonstrator is not None else ():  # demonstrations enter before the passes
            self.scores(d)
        if cfg.rollout.dynamic_sampling:
            examples, rollout, selected = informative_batch(draws, [self.flags(d) for d in draws],
                                                            self.world.share(cfg.training.batch_size),
                                                            cfg.training.batch_size, self.pad_id)
        else:
            examples, rollout = draws[0].examples, draws[0].rollout  # this rank's share
        t0 = time.perf_counter()
        old = ref = None
        if len(rollout.texts):
            if self.policies.needs_old_pass:
                old = logprob_pass(self.policies.sampler, rollout, cfg.rollout.temperature,
                                   cfg.training.micro_batch_size, self.pad_id, cfg.training.micro_batch_tokens)
            ref = self.policies.reference_logprobs(rollout, self.pad_id)
        t_logprob = time.perf_counter() - t0
        self.counters.batch_step += 1
        stats = batch_stats(draws, examples, rollout, t_logprob, bool(self.multiturn and self.multiturn.stop_strings))
        return Batch(rollout, old, ref, draws, selected, stats)

    # ------------------------------------------------------------------ advantages
    def score(self, batch: Batch | StepData) -> StepData:
        """A batch step's rewards (waiting for them if the workers are still at it) and advantages, and the
        reward part of its stats; once per batch step (num_iterations reuse it). A StepData is scored."""
        if isinstance(batch, StepData):
            return batch
        if batch.scored is None:
            G, draws = self.cfg.rollout.num_generations, batch.draws
            scores = batch.selected if batch.selected is not None else self.scores(draws[0])
            advantages = self.advantages(scores.total)  # [N]
            drawn = RewardScores.concat([self.scores(d, sampled=True) for d in draws])
            add_rewards(batch.stats, scores, drawn, advantages, G, sum(d.t_reward for d in draws))
            batch.scored = StepData(batch.rollout, advantages, batch.old_logprobs, batch.ref_logprobs)
        return batch.scored

    def advantages(self, totals: np.ndarray) -> mx.array:
        """Group-normalised advantages [N] of this rank's rows; scale_rewards = batch takes its std over
        the rows of every rank."""
        G, world = self.cfg.rollout.num_generations, self.world
        if self.cfg.objective.scale_rewards != "batch" or world.size == 1:
            return group_advantages(mx.array(totals), G, self.cfg.objective.scale_rewards)
        parts = world.gather(totals, "the batch reward scale")
        start = sum(len(p) for p in parts[:world.rank])
        return group_advantages(mx.array(np.concatenate(parts)), G, "batch")[start:start + len(totals)]

    # ------------------------------------------------------------------ gradients, step
    def set_learning_rate(self) -> float:
        lr = learning_rate_at(self.schedule_position(), self.total_updates, self.cfg)
        self.optimizer.learning_rate = mx.array(lr, dtype=mx.float32)
        return lr

    def gradients(self, steps: list[StepData]) -> tuple[object, LossSums | None]:
        """The update's gradient and LossSums over the rows of every rank (None, None when no row enters
        the loss anywhere)."""
        cfg = self.cfg
        weights = loss_weights(cfg, steps, self.world)
        if cfg.model.lora_dropout > 0:  # dropout masks come from the global generator: derive them from the run's seed
            mx.random.seed((self.world.seed(cfg.run.seed) * 1_000_003 + self.counters.update_step) % 2 ** 63)
        self.model.train()
        try:
            grads, sums = accumulate_gradients(self.grad_fn, steps, weights, cfg.training.micro_batch_size, self.pad_id,
                                               cfg.training.micro_batch_tokens)
        finally:
            self.model.eval()
        if self.world.size == 1:
            return grads, sums
        if grads is None:  # none of this rank's rows counts; the others' may
            grads, sums = zero_gradients(self.model), empty_sums()
        grads, sums = self.world.average_gradients(grads), self.world.reduce_sums(sums)
        return (grads, sums) if sums.tokens.item() > 0 else (None, None)

    def skip(self, metrics: UpdateMetrics) -> None:
        """A non-finite loss or gradient: the update is not applied; too many in a row stop the run."""
        self.counters.skipped_updates += 1
        self.counters.consecutive_skips += 1
        self.world.print(f"[mlx-grpo] update {self.counters.update_step}: non-finite loss or gradient "
                         f"(loss={metrics.loss}, grad_norm={metrics.grad_norm}); update skipped")
        if self.counters.consecutive_skips >= self.cfg.health.max_consecutive_skips:  # the same on every rank
            self.world.fail(f"{self.counters.consecutive_skips} consecutive updates had a non-finite loss or "
                            "gradient; stopping (try a lower learning_rate or max_grad_norm). The weights "
                            "of the last finite update are in the latest checkpoint.")

    def refresh_sampler(self, applied: bool) -> None:
        """Point the old policy at the new weights every update_every updates, and the engine at the
        sampling policy whenever its weights changed."""
        refresh_old = self.policies.separate_old and self.counters.update_step % self.cfg.objective.update_every == 0
        if refresh_old:
            self.policies.refresh()
        if refresh_old or (applied and not self.policies.separate_old):
            self.engine.refresh(self.policies.sampler)

    def schedule_position(self) -> int:
        """The update's place in the learning-rate schedule, by data consumed: the update count when every
        batch step draws once; ahead of it when dynamic sampling drew extra batches, so the decay ends
        where the data does. 1-based."""
        cfg = self.cfg
        groups = -(-data_position(self)[0] // cfg.training.gradient_accumulation_steps)  # rollout groups consumed
        iteration = (self.counters.update_step - 1) % cfg.objective.num_iterations + 1
        return min(max(groups - 1, 0) * cfg.objective.num_iterations + iteration, self.total_updates)

    # ------------------------------------------------------------------ state
    def state(self) -> dict:
        # Sampling keys derive from (seed, counters.draws, row): the counters are the whole random state.
        state = {"counters": vars(self.counters).copy(), "data_cursor": self.sampler.state(),
                 "total_updates": self.total_updates, "world_size": self.world.size, "health": self.health.state()}
        return state if self.prefetch is None else self.prefetch.rewind(state)  # before rollouts in flight

    def restore(self, path: Path, loaded: tuple, adapters: bool) -> None:
        """Continue from the checkpoint at `path`, as rank 0 read it: loaded is load_checkpoint's tuple,
        adapters holds_adapters' answer (other ranks get both sent and may have no `path` of their own)."""
        ckpt.check_resume(path, loaded, adapters, model=self.model, total_updates=self.total_updates,
                          world_size=self.world.size, adapter_run=self.adapter_config is not None,
                          masters_active=self.masters.active)
        weights, opt_state, state, old, masters = loaded
        ckpt.load_weights(self.model, weights, path, self.adapter_config is None, self.cfg.model.model_name)
        if self.masters.active:  # a checkpoint without masters (written without them) widens its weights
            self.masters.adopt(masters or dict(tree_flatten(self.model.trainable_parameters())))
            self.masters.sync(self.model)
        self.optimizer.state = opt_state
        c = state["counters"]  # checkpoints before applied_updates: every skip counted in skipped_updates
        applied = c["update_step"] - c["skipped_updates"]
        self.counters = Counters(**{"draws": c["batch_step"], "applied_updates": applied, **c})
        self.sampler.load_state(state["data_cursor"])
        self.health.load_state(state.get("health"))
        self._batches = iter(self.sampler)
        if old is not None and self.adapter_config is not None:  # the old adapters on the shared base weights
            old = tree_unflatten(list({**dict(tree_flatten(self.model.parameters())), **dict(tree_flatten(old))}.items()))
        if self.policies.separate_old:
            self.policies.refresh(old)
        elif self.prefetch is not None and old is not None:  # rollouts were in flight: resample them from these
            self.prefetch.resume(old, state)
        mx.eval(self.model.parameters(), self.optimizer.state, self.masters.arrays())
        self.engine.refresh(self.policies.sampler)

    def save(self) -> Path:
        config_json = json.loads((self.source_dir / "config.json").read_text())
        old = self.policies.old_params if self.policies.separate_old else \
            self.prefetch.sampling_weights if self.prefetch is not None else None
        if old is not None and self.adapter_config is not None:  # the base is frozen: only adapters differ
            keep = set(adapter_parameters(self.model))
            old = {k: v for k, v in tree_flatten(old) if k in keep}
        path = ckpt.save_checkpoint(self.run_dir, self.counters.update_step, model=self.model,
                                    optimizer=self.optimizer, trainer_state=self.state(), config=self.cfg,
                                    source_dir=self.source_dir, model_config=config_json, old_params=old,
                                    adapter_config=self.adapter_config, masters=self.masters.masters)
        ckpt.prune(self.run_dir, self.cfg.run.save_total_limit, path)
        return path

    def next_examples(self) -> list[Example] | None:
        indices = next(self._batches, None)
        return None if indices is None else [self.train_examples[i] for i in indices]
