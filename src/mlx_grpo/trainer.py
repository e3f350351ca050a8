"""`mlx-grpo train`: the GRPO loop — rollouts, rewards, advantages, clipped updates, logs, checkpoints.

One optimizer update consumes `gradient_accumulation_steps` batch steps of B prompts x G completions,
`num_iterations` times. Rollout keys derive from (seed, batch step), so a run and its resumption
sample the same tokens; checkpoints are written only between rollout groups, where that holds.
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
from tqdm import tqdm

from mlx_grpo import checkpoint as ckpt
from mlx_grpo.config import Config, save_json
from mlx_grpo.evaluate import evaluate_model
from mlx_grpo.logs import RunLogger, fmt, update_record
from mlx_grpo.data import EpochSampler, Example, load_examples, reward_columns, subset
from mlx_grpo.errors import UserError
from mlx_grpo.loss import LossSums, group_advantages, supports_layer_checkpointing
from mlx_grpo.models.adapters import ADAPTER_LAYERS, adapter_parameters, apply_adapters, quantize_base
from mlx_grpo.models.loading import load_model, resolve_model_path
from mlx_grpo.policy import (Policies, StepData, accumulate_gradients, clip_by_global_norm, logprob_pass, loss_weights,
                             make_grad_fn)
from mlx_grpo.reward_workers import RewardRunner, build_reward_set
from mlx_grpo.rewards import RewardScores, RewardSet, overlong_penalty
from mlx_grpo.rollout import SamplingParams, encode_chat_prompt, generate_rollout, select_groups


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


def rollout_key(seed: int, batch_step: int) -> mx.array:
    return mx.random.split(mx.random.key(seed), batch_step + 1)[batch_step]


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

    examples: list[Example]
    rollout: object
    scores: object
    t_rollout: float
    t_reward: float


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
    counters: Counters = field(default_factory=Counters)

    def __post_init__(self):
        cfg = self.cfg
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
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None \
            else sorted(self.tokenizer.eos_token_ids)[0]
        self.params = SamplingParams(cfg.max_new_tokens, cfg.temperature, cfg.top_p, cfg.top_k, cfg.min_p,
                                     tuple(cfg.stop))
        self._batches = iter(self.sampler)
        self.reward_runner = RewardRunner(self.rewards, cfg, Path.cwd())
        # Dropout (lora_dropout) acts only in the gradient pass: rollouts and log-prob passes see the
        # deterministic model, so their log-probs are those of the policy that sampled.
        self.model.eval()

    # ------------------------------------------------------------------ one batch step
    def _draw(self, examples: list[Example]) -> Draw:
        """Generate G completions for each example and submit them for scoring (inline or to the reward
        workers); _scores collects the result."""
        cfg, G = self.cfg, self.cfg.num_generations
        encoded = [encode_chat_prompt(self.tokenizer, e.prompt, cfg.system_prompt, cfg.prefill,
                                      cfg.max_prompt_length) for e in examples]
        self.counters.prompts_cut += sum(cut for _, cut in encoded)
        t0 = time.perf_counter()
        rollout = generate_rollout(self.policies.sampler, self.tokenizer, [ids for ids, _ in encoded], G,
                                   self.params, rollout_key(cfg.seed, self.counters.draws), cfg.prefill)
        self.counters.draws += 1
        t1 = time.perf_counter()
        columns = {k: [v for v in values for _ in range(G)] for k, values in reward_columns(examples).items()}
        prompts = [e.prompt for e in examples for _ in range(G)]
        pending = self.reward_runner.submit(prompts, rollout.texts, rollout.completion_ids.tolist(), columns)
        return Draw(examples, rollout, pending, t1 - t0, time.perf_counter() - t1)

    def _scores(self, draw: Draw) -> RewardScores:
        """A draw's rewards plus the length penalty, waiting for them if the workers are still at it."""
        if isinstance(draw.scores, RewardScores):
            return draw.scores
        t0 = time.perf_counter()
        try:
            scores = draw.scores.result()
        except BrokenExecutor as e:
            raise UserError(f"the reward workers stopped ({type(e).__name__}: {e}); try reward_executor = thread "
                            "or reward_workers = 0") from None
        draw.t_reward += time.perf_counter() - t0  # time the loop waited: the whole scoring when inline
        cfg = self.cfg
        if cfg.overlong_penalty > 0:
            scores = scores.with_penalty("overlong_penalty", overlong_penalty(
                draw.rollout.lengths, cfg.max_new_tokens, cfg.overlong_buffer, cfg.overlong_penalty))
        draw.scores = scores
        return scores

    def _informative_batch(self, draws: list[Draw]) -> tuple[list[Example], object, object]:
        """Dynamic sampling: the first batch_size groups, in draw order, whose rewards are not all equal."""
        G = self.cfg.num_generations
        picks = [(i, g) for i, d in enumerate(draws) for g, r in enumerate(self._scores(d).total.reshape(-1, G))
                 if r.max() > r.min()][:self.cfg.batch_size]
        rollout = select_groups([d.rollout for d in draws], picks, self.pad_id)
        scores = RewardScores.concat([draws[i].scores.select(range(g * G, (g + 1) * G)) for i, g in picks]) \
            if picks else draws[0].scores.select([])
        return [draws[i].examples[g] for i, g in picks], rollout, scores

    def batch_step(self, examples: list[Example]) -> tuple[StepData, dict]:
        """Generate (and, with dynamic sampling, filter) one batch step and run its old/reference log-prob
        passes. Its rewards may still be computing: `resolve` (called by update) collects them and sets
        the advantages and the reward stats."""
        cfg, G = self.cfg, self.cfg.num_generations
        draws = [self._draw(examples)]
        selected = None
        if cfg.dynamic_sampling:  # needs each draw's rewards before deciding to draw more
            def informative() -> int:
                return sum(int((np.ptp(self._scores(d).total.reshape(-1, G), axis=1) > 0).sum()) for d in draws)

            while informative() < cfg.batch_size and len(draws) <= cfg.max_resample_batches:
                more = self.next_examples()
                if more is None:  # the data is exhausted: train on what there is
                    break
                draws.append(self._draw(more))
            examples, rollout, selected = self._informative_batch(draws)
        else:
            rollout = draws[0].rollout
        t2 = time.perf_counter()
        old = ref = None
        if len(rollout.texts):
            if self.policies.needs_old_pass:
                old = logprob_pass(self.policies.sampler, rollout, cfg.temperature, cfg.micro_batch_size,
                                   self.pad_id, cfg.micro_batch_tokens)
            ref = self.policies.reference_logprobs(rollout, self.pad_id)
        t3 = time.perf_counter()
        self.counters.batch_step += 1
        drawn = [d.rollout for d in draws]
        entropies = [np.array(r.entropies) for r in drawn]
        stats = {"examples": examples, "texts": rollout.texts, "lengths": np.concatenate([r.lengths for r in drawn]),
                 "truncated": np.concatenate([r.truncated for r in drawn]), "draws": len(draws),
                 "groups_trained": len(examples), "entropy_sum": float(sum(e.sum() for e in entropies)),
                 "t_rollout": sum(d.t_rollout for d in draws), "t_logprob": t3 - t2,
                 "tokens": int(sum(r.lengths.sum() for r in drawn))}
        step = StepData(rollout, None, old, ref)
        step.resolve = lambda: self._resolve(step, stats, draws, selected)
        return step, stats

    def _resolve(self, step: StepData, stats: dict, draws: list[Draw], selected) -> None:
        """Collect a batch step's rewards: its advantages and the reward part of its stats."""
        G = self.cfg.num_generations
        scores = selected if selected is not None else self._scores(draws[0])
        step.advantages = group_advantages(mx.array(scores.total), G, self.cfg.scale_rewards)  # [N]
        drawn = RewardScores.concat([self._scores(d) for d in draws])
        grouped = drawn.total.reshape(-1, G)
        stats.update(rewards=scores.total, per_func=scores.per_func, advantages=np.array(step.advantages.tolist()),
                     drawn_scores=drawn, zero_std=float(np.mean(grouped.max(1) == grouped.min(1))),
                     t_reward=sum(d.t_reward for d in draws))
        step.resolve = None

    # ------------------------------------------------------------------ one update
    def update(self, steps: list[StepData]) -> dict:
        cfg = self.cfg
        self.counters.update_step += 1
        lr = learning_rate_at(self.schedule_position(), self.total_updates, cfg)
        self.optimizer.learning_rate = mx.array(lr, dtype=mx.float32)
        for s in steps:  # waiting for rewards counts in time_reward_s, not in the training time
            if s.resolve is not None:
                s.resolve()
        t0 = time.perf_counter()
        weights = loss_weights(cfg, steps)
        if cfg.lora_dropout > 0:  # dropout masks come from the global generator: derive them from the run's seed
            mx.random.seed(cfg.seed * 1_000_003 + self.counters.update_step)
        self.model.train()
        try:
            grads, sums = accumulate_gradients(self.grad_fn, steps, weights, cfg.micro_batch_size, self.pad_id,
                                               cfg.micro_batch_tokens)
        finally:
            self.model.eval()
        result = {"lr": lr, "loss": None, "grad_norm": None, "kl": None, "clip_fraction": None,
                  "clip_low_fraction": None, "clip_high_fraction": None, "ratio_min": None, "ratio_mean": None,
                  "ratio_max": None, "skipped": True, "loss_tokens": 0}
        if grads is None:
            print(f"[mlx-grpo] update {self.counters.update_step}: no completion entered the loss (every group "
                  "was dropped or every completion truncated and masked); update skipped", flush=True)
        else:
            self._apply(grads, sums, result)
        if self.policies.separate_old and self.counters.update_step % cfg.update_every == 0:
            self.policies.refresh()
        train_tokens = sum(int(s.rollout.lengths.sum()) for s in steps)
        dt = time.perf_counter() - t0
        return {**result, "t_train": dt, "train_tokens_per_s": train_tokens / dt if dt > 0 else 0.0}

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
        result.update(loss=loss, grad_norm=norm.item(), kl=per_token(sums.kl), skipped=not finite,
                      clip_low_fraction=per_token(sums.clipped_low), clip_high_fraction=per_token(sums.clipped_high),
                      clip_fraction=per_token(sums.clipped_low + sums.clipped_high), ratio_mean=per_token(sums.ratio),
                      ratio_min=sums.ratio_min.item() if tokens else None,
                      ratio_max=sums.ratio_max.item() if tokens else None, loss_tokens=int(tokens))
        if finite:
            self.optimizer.update(self.model, grads)
            mx.eval(self.model.parameters(), self.optimizer.state)
            # Hand this update's freed buffers (rollout KV caches, activations, optimizer transients) back
            # to the device rather than keep them cached beside AdamW's state for the next rollout: near
            # the memory limit (a 1.9B model on an H100) later updates slowed several-fold (BENCHMARKS.md).
            mx.clear_cache()
            self.counters.consecutive_skips = 0
            return
        self.counters.skipped_updates += 1
        self.counters.consecutive_skips += 1
        print(f"[mlx-grpo] update {self.counters.update_step}: non-finite loss or gradient "
              f"(loss={loss}, grad_norm={norm.item()}); update skipped", flush=True)
        if self.counters.consecutive_skips >= cfg.max_consecutive_skips:
            raise UserError(f"{self.counters.consecutive_skips} consecutive updates had a non-finite loss or "
                            "gradient; stopping (try a lower learning_rate or max_grad_norm). The weights "
                            "of the last finite update are in the latest checkpoint.")

    # ------------------------------------------------------------------ state
    def state(self) -> dict:
        return {"counters": vars(self.counters).copy(), "data_cursor": self.sampler.state(),
                "seed": self.cfg.seed, "rng": {"kind": "derived", "seed": self.cfg.seed,
                                               "next_draw": self.counters.draws},
                "total_updates": self.total_updates}

    def restore(self, path: Path) -> None:
        weights, opt_state, state, old = ckpt.load_checkpoint(path)
        if self.adapter_config is not None:
            self._check_adapter_keys(weights, path)
        elif (path / ckpt.ADAPTER_WEIGHTS).is_file():
            raise UserError(f"--resume: {path} holds lora/dora adapters but train_type is full; resume with the "
                            "run's own config (config.resolved.json)")
        self.model.load_weights(list(weights.items()), strict=self.adapter_config is None)
        self.optimizer.state = opt_state
        self.counters = Counters(**{"draws": state["counters"]["batch_step"], **state["counters"]})
        self.sampler.load_state(state["data_cursor"])
        self._batches = iter(self.sampler)
        if self.policies.separate_old:
            if self.adapter_config is not None:  # the old adapters on the shared base weights
                old = tree_unflatten(list({**dict(tree_flatten(self.model.parameters())),
                                           **dict(tree_flatten(old))}.items()))
            self.policies.refresh(old)
        mx.eval(self.model.parameters(), self.optimizer.state)

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
        return ckpt.save_checkpoint(self.run_dir, self.counters.update_step, model=self.model,
                                    optimizer=self.optimizer, trainer_state=self.state(), config=self.cfg,
                                    source_dir=self.source_dir, model_config=config_json, old_params=old,
                                    adapter_config=self.adapter_config)

    def next_examples(self) -> list[Example] | None:
        indices = next(self._batches, None)
        return None if indices is None else [self.train_examples[i] for i in indices]


def build_trainer(cfg: Config) -> Trainer:
    """Load data, rewards and the models for a run (no side effects on disk)."""
    train = load_examples(cfg.dataset, "train", cfg.dataset_path or None, cfg.seed)
    if cfg.max_train_samples:
        train = subset(train, cfg.max_train_samples, cfg.seed)
    rewards = build_reward_set(cfg, Path.cwd())
    source_dir = Path(resolve_model_path(cfg.model_name))
    if not source_dir.is_dir():  # a hub id: mlx-lm downloads it; find its local snapshot
        from mlx_lm.utils import hf_repo_to_path

        source_dir = Path(hf_repo_to_path(cfg.model_name))
    model, tokenizer = load_model(cfg.model_name, cfg.model_dtype)
    if any(isinstance(m, ADAPTER_LAYERS) for _, m in model.named_modules()):
        raise UserError(f"model {cfg.model_name!r} carries lora/dora adapters: continue its run with --resume, "
                        "or merge them first with `mlx-grpo fuse`")
    quantized = any(k.endswith(".scales") for k, _ in tree_flatten(model.parameters()))
    adapter_config = None
    if cfg.train_type == "full":
        if quantized:
            raise UserError(f"model {cfg.model_name!r} is quantized; full fine-tuning needs float weights: convert "
                            "it without --quantize, or train adapters on it (train_type = lora: QLoRA)")
        reference = load_model(cfg.model_name, cfg.model_dtype)[0] if cfg.kl_coeff > 0 else None
    else:
        if cfg.load_in_bits:
            quantize_base(model, cfg.load_in_bits)
        elif quantized and cfg.quantize_for_rollouts:
            raise UserError(f"model {cfg.model_name!r} is already quantized: quantize_for_rollouts has nothing to "
                            "do; drop it")
        mx.random.seed(cfg.seed)  # the adapters' initial weights come from the global generator
        adapter_config = apply_adapters(model, cfg.train_type, cfg.lora_rank, cfg.lora_alpha, cfg.lora_dropout,
                                        cfg.lora_layers, cfg.lora_keys)
        adapter_config["mlx_grpo"] = {"base_model": cfg.model_name, "base_dir": str(source_dir.resolve()),
                                      "load_in_bits": cfg.load_in_bits, "model_dtype": cfg.model_dtype}
        reference = None  # the KL reference is `model` with its adapters switched off
    if cfg.grad_checkpoint and not supports_layer_checkpointing(model):
        print(f"[mlx-grpo] warning: grad_checkpoint has no effect for model type "
              f"{getattr(model, 'model_type', '?')!r}: its layers are not recomputed, memory stays as without it",
              flush=True)
    policies = Policies(cfg, model, reference, adapters=adapter_config is not None)
    evals = None
    if cfg.eval_every_updates or cfg.eval_steps:
        evals = load_examples(cfg.dataset, "test", cfg.eval_dataset_path or None, cfg.seed)
    return Trainer(cfg, model, tokenizer, policies, rewards, train, Path(cfg.output_dir) / cfg.run_name,
                   source_dir, evals, adapter_config)


def _evaluate(trainer: Trainer, logger: RunLogger, examples: list[Example], trigger: str) -> None:
    cfg = trainer.cfg
    result = evaluate_model(trainer.model, trainer.tokenizer, examples, cfg, max_new_tokens=cfg.eval_max_new_tokens)
    logger.log_eval({"update_step": trainer.counters.update_step, "batch_step": trainer.counters.batch_step,
                     "trigger": trigger, "accuracy": result.accuracy, "accuracy_lenient": result.lenient_accuracy,
                     "format_rate": result.format_rate, "num_examples": len(examples)})


def train(cfg: Config, resume: str | None = None) -> Path:
    """Run GRPO as configured (or continue a checkpoint); returns the run directory."""
    trainer = build_trainer(cfg)
    try:
        run_dir = _run(trainer, cfg, resume)
    except BaseException:
        trainer.reward_runner.close(wait=False)
        raise
    trainer.reward_runner.close()
    return run_dir


def _run(trainer: Trainer, cfg: Config, resume: str | None) -> Path:
    run_dir = trainer.run_dir
    run_dir.mkdir(parents=True, exist_ok=True)
    if resume is None and ckpt.list_checkpoints(run_dir):
        raise UserError(f"run directory {run_dir} already holds checkpoints: pass --resume to continue it, "
                        "or choose another run_name")
    logger = RunLogger(run_dir, cfg.log_jsonl)
    if resume is not None:
        path = ckpt.resolve_resume(run_dir, resume)
        trainer.restore(path)
        logger.truncate_after(trainer.counters.update_step)
        print(f"[mlx-grpo] resumed from {path} at update {trainer.counters.update_step}", flush=True)
    save_json(cfg, run_dir / "config.resolved.json")
    evals = trainer.eval_examples
    eval_subset = subset(evals, cfg.eval_subset_size, cfg.seed) if evals else None
    legacy_subset = subset(evals, cfg.eval_samples or cfg.eval_subset_size, cfg.seed) if evals else None
    c = trainer.counters
    bar = tqdm(total=trainer.total_updates, initial=c.update_step, desc="grpo", unit="update", disable=None)
    last_saved = c.update_step if resume is not None else -1
    data_left = True
    while c.update_step < trainer.total_updates and data_left:
        steps, stats = [], []
        for _ in range(cfg.gradient_accumulation_steps):
            examples = trainer.next_examples()
            if examples is None:  # dynamic sampling drew extra prompts: the data ran out early
                data_left = False
                break
            step, st = trainer.batch_step(examples)
            steps.append(step)
            stats.append(st)
            if cfg.eval_steps and c.batch_step % cfg.eval_steps == 0:
                _evaluate(trainer, logger, legacy_subset, "eval_steps")
        if not steps:
            break
        save_due = False
        for _ in range(cfg.num_iterations):
            result = trainer.update(steps)
            record = update_record(trainer, stats, result)
            logger.log_metrics(record)
            logger.warn(record)
            if cfg.logging_steps and c.update_step % cfg.logging_steps == 0:
                bar.set_postfix(reward=fmt(record["reward_mean"], ".3f"), loss=fmt(record["loss"], ".4f"),
                                kl=fmt(record["kl"], ".4f"), refresh=False)
                if bar.disable:
                    logger.print_line(record)
            if cfg.log_completions_steps and c.update_step % cfg.log_completions_steps == 0:
                logger.log_completions(c.update_step, stats[-1])
            if cfg.eval_every_updates and c.update_step % cfg.eval_every_updates == 0:
                _evaluate(trainer, logger, eval_subset, "eval_every_updates")
            save_due = save_due or bool(cfg.save_steps and c.update_step % cfg.save_steps == 0)
            bar.update(1)
        if save_due:  # only between rollout groups, where resume reproduces the run exactly
            trainer.save()
            last_saved = c.update_step
    bar.close()
    if not data_left:
        print(f"[mlx-grpo] the training data ran out after {c.update_step} of {trainer.total_updates} updates: "
              f"dynamic sampling drew {c.draws - c.batch_step} extra batches of prompts", flush=True)
    if last_saved != c.update_step:
        trainer.save()
    if c.skipped_updates:
        print(f"[mlx-grpo] {c.skipped_updates} update(s) skipped for non-finite values", flush=True)
    print(f"[mlx-grpo] done: {c.update_step} updates; run directory {run_dir}", flush=True)
    return run_dir
