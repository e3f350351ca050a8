"""A run on image prompts from a Config (assembly.build_job hands runs with image_column here): the examples and
rewards as for text, the mlx-vlm model loaded and wrapped (VisionPolicy) in its compute dtype with its float32
masters, LoRA/DoRA on the language model's blocks, the vision tower frozen unless train_vision, and the KL
reference sharing the feature table; the run's parts wired as for text (training/job.py), with ImagePrompts
(vlm/image_prompts.py) in the sampling stage."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten

from mlx_grpo.base.errors import UserError
from mlx_grpo.commands.vision_eval import vision_answer_records
from mlx_grpo.commands.vision_inference import load_vlm
from mlx_grpo.config import Config
from mlx_grpo.data.examples import subset
from mlx_grpo.data.prompts import WorkedExamples
from mlx_grpo.data.sources import run_examples
from mlx_grpo.models.adapters import apply_adapters
from mlx_grpo.models.precision import cast_floats, compute_dtype, dtype_name
from mlx_grpo.rewards.workers import build_reward_set
from mlx_grpo.rollout.engine import RolloutEngine
from mlx_grpo.rollout.sampler import pad_token_id
from mlx_grpo.training.distributed import World
from mlx_grpo.training.job import Job, make_job
from mlx_grpo.training.optimization import MasterWeights
from mlx_grpo.training.policy import Policies
from mlx_grpo.vlm.families import check_grpo_family, eos_ids, read_config
from mlx_grpo.vlm.image_prompts import ImagePrompts
from mlx_grpo.vlm.policy_model import VisionPolicy


def load_policy(cfg: Config, table=None) -> tuple[VisionPolicy, object]:
    """(VisionPolicy in the compute dtype, processor); table: share another policy's feature table."""
    kind = read_config(Path(cfg.model.model_name)).get("model_type", "")
    check_grpo_family(kind, cfg.model.model_name)
    vlm, processor = load_vlm(cfg.model.model_name)
    if any(k.endswith(".scales") for k, _ in tree_flatten(vlm.parameters())):
        raise UserError(f"model {cfg.model.model_name!r} is quantized: GRPO on images trains float weights; convert it "
                        "without --quantize")
    policy = VisionPolicy(vlm, table, cfg.training.train_vision)
    return policy, processor


def build_vision_job(cfg: Config, world: World | None = None) -> Job:
    from mlx_lm.tokenizer_utils import TokenizerWrapper

    train = run_examples(cfg, "train")
    evals = run_examples(cfg, "test") if cfg.eval.eval_every_updates or cfg.eval.eval_steps else None
    if cfg.data.max_train_samples:
        train = subset(train, cfg.data.max_train_samples, cfg.run.seed)
    rewards = build_reward_set(cfg, Path.cwd())
    model, processor = load_policy(cfg)
    dtype = compute_dtype(cfg.model.model_name, cfg.model.model_dtype, model)
    mixed = cfg.optimizer.master_weights and dtype != mx.float32
    adapter_config = None
    if cfg.model.train_type == "full":
        if not cfg.training.train_vision:
            model.vision_tower.freeze()
        masters = MasterWeights(model, mixed)
        cast_floats(model, dtype)
    else:
        cast_floats(model, dtype)
        mx.random.seed(cfg.run.seed)  # the adapters' initial weights come from the global generator
        m = cfg.model
        adapter_config = apply_adapters(model, m.train_type, m.lora_rank, m.lora_alpha, m.lora_dropout,
                                        m.lora_layers, m.lora_keys)
        if cfg.training.train_vision:
            model.vision_tower.unfreeze()
        adapter_config["mlx_grpo"] = {"base_model": m.model_name, "base_dir": str(Path(m.model_name).resolve()),
                                      "load_in_bits": 0, "model_dtype": dtype_name(dtype)}
        masters = MasterWeights(model, mixed)
        cast_floats(model, dtype)
    reference = None
    if cfg.objective.kl_coeff > 0 and adapter_config is None:
        reference = load_policy(cfg, table=model.table)[0]
        cast_floats(reference, dtype)
    tokenizer = TokenizerWrapper(processor.tokenizer,
                                 eos_token_ids=eos_ids(cfg.model.model_name, processor.tokenizer))
    engine = RolloutEngine(tokenizer, mode=cfg.rollout.rollout_engine, graph=cfg.rollout.decode_graph)
    policies = Policies(cfg, model, reference, engine, adapters=adapter_config is not None)
    prompts = ImagePrompts(cfg, processor, tokenizer, model, pad_token_id(tokenizer))

    def answer(model, tokenizer, examples, cfg, *, max_new_tokens: int, seed=None, system_prompt=None, **_):
        """Greedy answers to image prompts (commands/train.py's evaluation): one record per example, naming its
        images."""
        return vision_answer_records(model, processor, tokenizer, examples, cfg, max_new_tokens=max_new_tokens,
                                     eos=prompts.eos_ids, pad_id=prompts.pad_id, seed=seed, system_prompt=system_prompt)

    return make_job(cfg, world or World(), tokenizer, policies, rewards, train, evals, WorkedExamples(),
                    Path(cfg.model.model_name), adapter_config, masters, answer, prompts)

