"""One `mlx-grpo train` run's parts, wired together (commands/assembly.py and commands/vision_job.py call
`make_job`): the sampling stage and the step source over it, the Trainer that updates, the run's health checks, the
evaluation set and prompt; and the checkpoint state of them all (state, restore, save). commands/train.py's loop is
`while (steps := job.source.next()): job.trainer.update(steps)` with evaluation, logs and saving around it.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten, tree_unflatten

from mlx_grpo.base.errors import UserError
from mlx_grpo.config import Config
from mlx_grpo.data.demonstrations import Demonstrator
from mlx_grpo.data.examples import EpochSampler, Example
from mlx_grpo.data.prompts import RunPrompt, WorkedExamples, build_run_prompts
from mlx_grpo.models.adapters import adapter_parameters
from mlx_grpo.rewards.scoring import RewardSet
from mlx_grpo.rewards.workers import RewardRunner
from mlx_grpo.rollout.multiturn import multiturn_for
from mlx_grpo.rollout.sampler import pad_token_id
from mlx_grpo.storage import checkpoint as ckpt
from mlx_grpo.training.distributed import World
from mlx_grpo.training.health import RunHealth
from mlx_grpo.training.optimization import MasterWeights
from mlx_grpo.training.policy import Policies
from mlx_grpo.training.prefetch import PrefetchSteps
from mlx_grpo.training.records import Counters
from mlx_grpo.training.sampling import Sampling, TextPrompts
from mlx_grpo.training.step_sources import DynamicSteps, FreshSteps
from mlx_grpo.training.trainer import Trainer


@dataclass
class Job:
    cfg: Config
    world: World
    model: object  # the trained model (trainer.policies.model)
    tokenizer: object
    trainer: Trainer
    counters: Counters  # the run's position, shared by the trainer and the sampling stage
    sampling: Sampling
    source: object  # a step source (training/step_sources.py)
    health: RunHealth
    train_examples: list[Example]
    eval_examples: list[Example] | None
    prompt: RunPrompt  # the system prompt of the run's rollouts, its worked examples included
    eval_prompt: RunPrompt  # and of its evaluations
    answer: Callable  # evaluate.answer_records, or the image prompts' own
    run_dir: Path
    source_dir: Path  # the model's directory: its config and tokenizer files go into every checkpoint
    adapter_config: dict | None = None  # lora/dora: what checkpoints record next to the adapters
    worked: WorkedExamples = field(default_factory=WorkedExamples)
    resumed: tuple[Path, int] | None = None  # (checkpoint, update) resumed from: where a failed save points

    def state(self) -> dict:
        # Sampling keys derive from (seed, counters.draws, row): the counters are the whole random state.
        state = {"counters": vars(self.counters).copy(), "data_cursor": self.sampling.data.state(),
                 "total_updates": self.trainer.total_updates, "world_size": self.world.size,
                 "health": self.health.state()}
        if self.trainer.policies.teacher is not None:  # on-policy distillation: which teacher (a run directory moves on)
            state["teacher"] = self.trainer.policies.teacher_source
        return self.source.checkpoint_state(state)  # async_rollouts: from before the rollouts in flight

    def restore(self, path: Path, loaded: tuple, adapters: bool) -> None:
        """Continue from the checkpoint at `path`, as rank 0 read it: loaded is load_checkpoint's tuple,
        adapters holds_adapters' answer (other ranks get both sent and may have no `path` of their own)."""
        t = self.trainer
        ckpt.check_resume(path, loaded, adapters, model=self.model, total_updates=t.total_updates,
                          world_size=self.world.size, adapter_run=self.adapter_config is not None,
                          masters_active=t.masters.active)
        weights, opt_state, state, old, masters = loaded
        teacher = t.policies.teacher_source
        if state.get("teacher") is not None and state["teacher"] != teacher:
            raise UserError(f"--resume: {path} was distilled from the teacher {state['teacher']}, and the teacher is "
                            f"now {teacher}: set teacher_model (or teacher_url) = {state['teacher']} to continue "
                            "with the same teacher")
        ckpt.load_weights(self.model, weights, path, self.adapter_config is None, self.cfg.model.model_name)
        if t.masters.active:  # a checkpoint without masters (written without them) widens its weights
            t.masters.adopt(masters or dict(tree_flatten(self.model.trainable_parameters())))
            t.masters.sync(self.model)
        t.optimizer.state = opt_state
        c = state["counters"]  # checkpoints before applied_updates: every skip counted in skipped_updates
        applied = c["update_step"] - c["skipped_updates"]
        vars(self.counters).update(vars(Counters(**{"draws": c["batch_step"], "applied_updates": applied, **c})))
        self.sampling.rewind_data(state["data_cursor"])
        self.health.load_state(state.get("health"))
        if old is not None and self.adapter_config is not None:  # the old adapters on the shared base weights
            old = tree_unflatten(list({**dict(tree_flatten(self.model.parameters())), **dict(tree_flatten(old))}.items()))
        policies = t.policies
        if policies.separate_old:
            policies.refresh(old)
        elif old is not None:  # rollouts were in flight (async_rollouts): resample them from these
            self.source.resume(old, state)
        mx.eval(self.model.parameters(), t.optimizer.state, t.masters.arrays())
        policies.engine.refresh(policies.sampler)

    def save(self) -> Path:
        t = self.trainer
        config_json = json.loads((self.source_dir / "config.json").read_text())
        old = t.policies.old_params if t.policies.separate_old else self.source.sampling_weights
        if old is not None and self.adapter_config is not None:  # the base is frozen: only adapters differ
            keep = set(adapter_parameters(self.model))
            old = {k: v for k, v in tree_flatten(old) if k in keep}
        path = ckpt.save_checkpoint(self.run_dir, self.counters.update_step, model=self.model,
                                    optimizer=t.optimizer, trainer_state=self.state(), config=self.cfg,
                                    source_dir=self.source_dir, model_config=config_json, old_params=old,
                                    adapter_config=self.adapter_config, masters=t.masters.masters)
        ckpt.prune(self.run_dir, self.cfg.run.save_total_limit, path)
        return path

    def close(self, wait: bool = True) -> None:
        """End the rollouts in flight and the reward workers (wait=False: a failed run does not wait for them)."""
        self.source.close()
        self.sampling.reward_runner.close(wait=wait)


def make_job(cfg: Config, world: World, tokenizer, policies: Policies, rewards: RewardSet, train: list[Example],
             evals: list[Example] | None, worked: WorkedExamples, source_dir: Path, adapter_config: dict | None,
             masters: MasterWeights | None, answer: Callable, prompts=None) -> Job:
    """Wire a run's parts: the data cursor and update count, the sampling stage (`prompts`: how prompts
    encode and decode, text by default), the step source the config asks for, the Trainer, the health checks."""
    model = policies.model
    B = cfg.training.batch_size
    if B % world.size:
        fits = [n for n in range(2, B + 1) if B % n == 0]
        world.fail(f"batch_size = {B} prompts do not divide among {world.size} ranks: set batch_size to a "
                   f"multiple of {world.size} (e.g. {-(-B // world.size) * world.size})"
                   + (f", or launch {' / '.join(map(str, fits))} processes" if fits else ""))
    data = EpochSampler(len(train), B, cfg.training.num_epochs, cfg.run.seed)
    groups = data.num_batches_total // cfg.training.gradient_accumulation_steps
    if groups == 0:
        raise UserError(f"{len(train)} training examples give {data.num_batches_total} "
                        f"batch steps, fewer than gradient_accumulation_steps="
                        f"{cfg.training.gradient_accumulation_steps}: add data or lower batch_size/accumulation")
    total_updates = groups * cfg.objective.num_iterations
    pad_id = pad_token_id(tokenizer)
    demonstrator = None if cfg.objective.demonstrations == "off" else Demonstrator(
        cfg, tokenizer, rewards, pad_id, world.print)
    counters = Counters()
    trainer = Trainer(cfg, policies, masters or MasterWeights(model, enabled=False), counters, total_updates, pad_id,
                      demonstrator, world)
    # Dropout (lora_dropout) acts only in the gradient pass: rollouts and log-prob passes see the
    # deterministic model, so their log-probs are those of the policy that sampled.
    model.eval()
    args = getattr(model, "args", None)
    # Tools or an environment: rollouts are episodes (rollout/multiturn.py) over the same engine.
    multiturn = multiturn_for(cfg, tokenizer, getattr(args, "model_type", None))
    # The one system prompt of the run's rollouts (its worked examples included), and of its evaluations.
    prompt, eval_prompt = build_run_prompts(cfg, tokenizer, multiturn, worked, train + (evals or []), world.print)
    if prompts is None:
        prompts = TextPrompts(cfg, tokenizer, multiturn, getattr(args, "max_position_embeddings", None), world.print)
    sampling = Sampling(cfg, tokenizer, policies, prompts, prompt.system, train, data,
                        RewardRunner(rewards, cfg, Path.cwd()), demonstrator, counters, world, pad_id)
    r = cfg.rollout
    source = PrefetchSteps(sampling, total_updates) if r.async_rollouts else \
        DynamicSteps(sampling) if r.dynamic_sampling else FreshSteps(sampling)
    # Silent-reward, plateau and gaming checks (training/health.py); their state is part of the checkpoint's.
    # a teacher gives every sampled token a signal of its own: flat rewards are no reason to stop
    silent = 0 if cfg.objective.distill_coeff > 0 else cfg.health.max_updates_without_signal
    health = RunHealth(rewards.names, silent, cfg.health.plateau_updates, cfg.health.gaming_evals)
    return Job(cfg, world, model, tokenizer, trainer, counters, sampling, source, health, train, evals, prompt,
               eval_prompt, answer, Path(cfg.run.output_dir) / cfg.run.run_name, source_dir, adapter_config, worked)
