"""Validation of a Config: range and cross-field rules, each failing with one UserError line that says
what to change. config.py owns the fields, their defaults and help texts, and calls `check`."""

from __future__ import annotations

import difflib

from mlx_grpo.config import DATA, Config, command_default
from mlx_grpo.errors import UserError
from mlx_grpo.reporting import REPORTERS
from mlx_grpo.sources import dataset_kind, unknown_dataset

ROLLOUT_CORRECTIONS = ("none", "token_truncate", "token_mask", "sequence_truncate", "sequence_mask")
ROLLOUT_ENGINES = ("auto", "copy", "model")
DEMONSTRATIONS = ("off", "zero_groups")  # demonstrations.py


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise UserError(message)


def check(c: Config, command: str) -> None:
    """Cross-field and range rules, each with a message saying what to change."""
    _require(c.max_new_tokens > 0, "max_new_tokens must be > 0")
    if c.image_column:  # settings the image rollouts (vlm/rollout.py) do not implement: refused, not ignored
        bad = [name for flag, name in [(c.update_every > 1, "update_every > 1"), (c.quantize_for_rollouts,
               "quantize_for_rollouts"), (bool(c.stop), "stop"), (c.demonstrations != "off", "demonstrations"),
               (c.use_compile, "use_compile"), (bool(c.tools or c.environment), "tools/environment"),
               (bool(c.prefill), "prefill")] if flag]
        _require(not bad, f"image_column (GRPO on images) does not support {', '.join(bad)}: drop them")
    _require(c.image_column or not c.train_vision, "train_vision needs image_column (a GRPO run on images)")
    _require(c.temperature >= 0, "temperature must be >= 0 (0 = greedy)")
    _require(0 < c.top_p <= 1, "top_p must be in (0, 1]; use 1.0 to turn it off")
    _require(c.top_k >= 0, "top_k must be >= 0 (0 = off)")
    _require(0 <= c.min_p < 1, "min_p must be in [0, 1)")
    _require(c.model_dtype in ("auto", "float32", "bfloat16", "float16"),
             f"model_dtype must be auto, float32, bfloat16 or float16, got {c.model_dtype!r}")
    _require(c.repetition_penalty > 0, "repetition_penalty must be > 0 (1.0 = off)")
    _require(all(s != "" for s in c.stop), "stop strings must not be empty: an empty string would end every "
             "completion after its first token")
    if command not in DATA:
        return
    _require(c.max_tool_turns >= 1, "max_tool_turns must be >= 1")
    _require(c.tool_format in ("auto", "hermes", "nanochat", "plain"),
             f"tool_format must be auto, hermes, nanochat or plain, got {c.tool_format!r}")
    _require(not (c.tools and c.environment), "set tools or environment, not both (an environment with tools "
             "subclasses ToolEnvironment)")
    _require(c.tool_format == "auto" or c.tools or c.environment,
             "tool_format applies to runs with tools or an environment: set tools, or leave tool_format = auto")
    _require(c.max_tool_turns == 4 or c.tools, "max_tool_turns applies to tools (an environment sets its own "
             "max_turns): set tools, or leave max_tool_turns at 4")
    _require(dataset_kind(c.dataset) != "unknown", unknown_dataset(c.dataset))
    for name in ("prompt_column", "answer_column"):
        _unused_unless(c, name, dataset_kind(c.dataset) != "builtin" or bool(c.dataset_path or c.eval_dataset_path),
                       "a data file, directory or hub id (dataset, dataset_path or eval_dataset_path)")
    _require(c.max_prompt_length > 0, "max_prompt_length must be > 0")
    _require(1 <= c.arith_max_steps <= 4, "arith_max_steps must be 1-4 (4 = every template)")
    _require(c.worked_examples >= 0, "worked_examples must be >= 0 (0 = none)")
    _require(c.worked_examples_seed >= 0, "worked_examples_seed must be >= 0")
    _require(all(t.strip() for t in c.worked_examples_text), "worked_examples_text entries must not be empty")
    _require(c.eval_subset_size > 0, "eval_subset_size must be > 0")
    _require(c.eval_max_new_tokens > 0, "eval_max_new_tokens must be > 0")
    _require(c.eval_batch_size > 0, "eval_batch_size must be > 0")
    _require(c.eval_num_samples >= 1, "eval_num_samples must be >= 1")
    _require(c.eval_num_samples == 1 or c.temperature > 0,
             "eval_num_samples > 1 (pass@k) needs temperature > 0; set temperature=1.0")
    if command == "train":
        _validate_train(c)
    elif command == "sft":
        _validate_tuning(c)
        _validate_adapters(c)


def _validate_tuning(c: Config) -> None:
    """The rules `train` and `sft` share: batches, optimizer, schedule, logs and checkpoints."""
    _require(c.max_minutes >= 0, "max_minutes must be >= 0 (0 = no limit)")
    for name in ("num_epochs", "batch_size", "gradient_accumulation_steps", "micro_batch_size",
                 "max_consecutive_skips", "logging_steps"):
        _require(getattr(c, name) >= 1, f"{name} must be >= 1")
    for name in ("max_train_samples", "save_steps", "save_total_limit", "eval_every_updates", "weight_decay",
                 "max_grad_norm", "micro_batch_tokens"):
        _require(getattr(c, name) >= 0, f"{name} must be >= 0")
    _require(c.learning_rate > 0, "learning_rate must be > 0")
    _require(0 <= c.warmup_ratio < 1, "warmup_ratio must be in [0, 1)")
    _require(0 <= c.adam_beta1 < 1 and 0 <= c.adam_beta2 < 1, "adam_beta1 and adam_beta2 must be in [0, 1)")
    _require(c.rollout_engine in ROLLOUT_ENGINES, f"rollout_engine must be one of {', '.join(ROLLOUT_ENGINES)}, "
             f"got {c.rollout_engine!r}")
    _require(c.lr_scheduler_type in ("cosine", "linear", "constant"),
             f"lr_scheduler_type must be cosine, linear or constant, got {c.lr_scheduler_type!r}")
    _require(c.run_name.strip() != "" and "/" not in c.run_name, "run_name must be a non-empty name without '/'")
    for name in c.report_to:
        match = difflib.get_close_matches(name, REPORTERS, n=1, cutoff=0.4)
        _require(name in REPORTERS, f"report_to: unknown reporter {name!r}; choose from {', '.join(REPORTERS)}"
                 + (f"; did you mean '{match[0]}'?" if match else ""))
    _require(len(set(c.report_to)) == len(c.report_to), f"report_to lists a reporter twice: {c.report_to}")


def _validate_train(c: Config) -> None:
    _validate_tuning(c)
    for name in ("num_iterations", "update_every"):
        _require(getattr(c, name) >= 1, f"{name} must be >= 1")
    for name in ("eval_steps", "eval_samples", "log_completions_steps", "kl_coeff", "max_updates_without_signal",
                 "plateau_updates"):
        _require(getattr(c, name) >= 0, f"{name} must be >= 0")
    _require(c.gaming_evals == 0 or c.gaming_evals >= 2, "gaming_evals must be 0 (off) or >= 2: it compares the "
             "first and the last of that many evaluations")
    _require(c.num_generations >= 2, "num_generations must be >= 2: group-relative advantages need at "
             "least two completions per prompt")
    _require(c.temperature > 0, "training samples its rollouts: temperature must be > 0")
    _require(c.top_p == 1.0 and c.top_k == 0 and c.min_p == 0.0,
             "top_p, top_k and min_p must stay off (1.0, 0, 0.0) in training: they sample from a cut distribution "
             "while the trained and logged log-probs are the uncut one's, so the update would be off-policy; "
             "lower temperature instead")
    _require(0 < c.clip_eps < 1, "clip_eps must be in (0, 1)")
    _require(c.rollout_correction in ROLLOUT_CORRECTIONS, f"rollout_correction must be one of "
             f"{', '.join(ROLLOUT_CORRECTIONS)}, got {c.rollout_correction!r}")
    _require(c.rollout_correction_cap > 1, "rollout_correction_cap must be > 1 (TRL uses 2.0)")
    _require(not c.reward_weights or len(c.reward_weights) == len(c.reward_funcs),
             f"reward_weights has {len(c.reward_weights)} entries but reward_funcs has {len(c.reward_funcs)}: "
             "give one weight per function, or none")
    _require(c.eval_samples == 0 or c.eval_steps > 0,
             "eval_samples only sizes the eval_steps evaluations: set eval_steps > 0, or drop eval_samples")
    _require(len(c.reward_funcs) > 0 or c.reward_url or c.reward_model, "reward_funcs must name at least one "
             "reward function (or set reward_url / reward_model)")
    _require(c.reward_workers >= 0, "reward_workers must be >= 0 (0 = inline)")
    _require(c.reward_model_clip > 0, "reward_model_clip must be > 0")
    _require(0 <= c.reward_model_answer_weight <= 1, "reward_model_answer_weight must be in [0, 1]")
    _require(c.reward_model_batch_size >= 1, "reward_model_batch_size must be >= 1")
    for name in ("reward_model_weight", "reward_model_clip", "reward_model_answer_weight", "reward_model_batch_size"):
        _unused_unless(c, name, bool(c.reward_model), "reward_model set")
    _require(not (c.reward_model and c.reward_workers), "the reward model runs on the accelerator inside the "
             "training process: keep reward_workers = 0 with reward_model")
    _choice(c, "reward_executor", ("thread", "process"))
    _choice(c, "distributed_backend", ("any", "ring", "mpi", "nccl", "jaccl"))
    _require(c.distributed_timeout >= 0, "distributed_timeout must be >= 0 (0 = wait forever)")
    _unused_unless(c, "reward_executor", c.reward_workers > 0, "reward_workers > 0")
    _require(not (c.reward_workers and c.dynamic_sampling), "reward_workers does nothing with dynamic_sampling, "
             "which needs each draw's rewards before it can draw again: drop one of them")
    overlap = c.gradient_accumulation_steps > 1 or c.kl_coeff > 0 or c.num_iterations > 1 or c.update_every > 1 \
        or c.quantize_for_rollouts
    _require(not c.reward_workers or overlap, "reward_workers has nothing to overlap with: with one batch step per "
             "update and no log-prob passes (kl_coeff = 0, on-policy) the update needs the rewards at once; "
             "raise gradient_accumulation_steps or drop reward_workers")
    _require(c.reward_url_timeout > 0, "reward_url_timeout must be > 0")
    _require(c.reward_url_retries >= 0, "reward_url_retries must be >= 0")
    for name in ("reward_url_weight", "reward_url_timeout", "reward_url_retries", "reward_url_allowed_hosts"):
        _unused_unless(c, name, bool(c.reward_url), "reward_url set")
    _validate_objective(c)
    _validate_adapters(c)


def _choice(c: Config, name: str, choices: tuple[str, ...]) -> None:
    value = getattr(c, name)
    match = difflib.get_close_matches(str(value), choices, n=1, cutoff=0.4)
    _require(value in choices, f"{name} must be one of {', '.join(choices)}, got {value!r}"
             + (f"; did you mean '{match[0]}'?" if match else ""))


def _validate_objective(c: Config) -> None:
    _choice(c, "loss_type", ("grpo", "bnpo", "dr_grpo", "dapo"))
    _choice(c, "scale_rewards", ("group", "batch", "none"))
    _choice(c, "importance_sampling_level", ("token", "sequence"))
    _choice(c, "kl_estimator", ("k3", "k1"))
    _require(0 <= c.clip_eps_high < 10, "clip_eps_high must be in [0, 10) (0 = same as clip_eps)")
    high = c.clip_eps_high or c.clip_eps
    _require(c.delta == 0 or c.delta > 1 + high, f"delta must be 0 (off) or > 1 + clip_eps_high = {1 + high:g}: "
             "it caps ratios above the clip range")
    _require(c.overlong_penalty >= 0, "overlong_penalty must be >= 0 (0 = off)")
    _require(c.overlong_penalty == 0 or 0 < c.overlong_buffer <= c.max_new_tokens,
             f"overlong_penalty needs 0 < overlong_buffer <= max_new_tokens ({c.max_new_tokens}), got "
             f"overlong_buffer={c.overlong_buffer}")
    _require(c.overlong_buffer >= 0, "overlong_buffer must be >= 0")
    _require(c.max_resample_batches >= 0, "max_resample_batches must be >= 0")
    off_policy = c.num_iterations > 1 or c.update_every > 1 or c.quantize_for_rollouts
    for name, active in (("clip_eps_high", c.clip_eps_high > 0), ("delta", c.delta > 0),
                         ("importance_sampling_level", c.importance_sampling_level == "sequence")):
        _require(not active or off_policy, f"{name} has no effect here: with num_iterations = 1 and update_every = "
                 "1 the sampler is the policy being trained, every importance ratio is exactly 1 and nothing is "
                 "clipped; set num_iterations >= 2 (several optimizer passes per rollout) or update_every >= 2")
    _unused_unless(c, "kl_estimator", c.kl_coeff > 0, "kl_coeff > 0")
    _unused_unless(c, "arith_max_steps", c.dataset == "arith" and not (c.dataset_path and c.eval_dataset_path),
                   "dataset = arith without both dataset files")
    _require(c.rollout_correction == "none" or c.lora_dropout == 0,
             "rollout_correction with lora_dropout: on-policy the trainer's log-probs come from the dropout pass, "
             "so the sampler ratio would weight dropout noise; set lora_dropout = 0")
    _unused_unless(c, "overlong_buffer", c.overlong_penalty > 0, "overlong_penalty > 0")
    _unused_unless(c, "max_resample_batches", c.dynamic_sampling, "dynamic_sampling = true")
    _choice(c, "demonstrations", DEMONSTRATIONS)
    _unused_unless(c, "demo_reward", c.demonstrations != "off", "demonstrations on")
    _require(c.demonstrations == "off" or not (c.tools or c.environment), "demonstrations need single-turn "
             "rollouts (a reference solution has no tool or environment turns): drop tools/environment, or set "
             "demonstrations = off")
    names = [n.rpartition(":")[2] for n in c.reward_funcs] + ["reward_url"] * bool(c.reward_url) \
        + ["reward_model"] * bool(c.reward_model) + ["overlong_penalty"] * (c.overlong_penalty > 0)
    _require(c.demo_reward == "" or c.demo_reward in names, f"demo_reward must name one of the run's rewards "
             f"({', '.join(names)}), got {c.demo_reward!r}")


def _unused_unless(c: Config, name: str, condition: bool, needs: str) -> None:
    """A field changed from its default where it cannot act is an error, not a silent no-op."""
    _require(condition or getattr(c, name) == command_default("train", name),
             f"{name} only applies with {needs}; drop it or set that too")


def _validate_adapters(c: Config) -> None:
    _choice(c, "train_type", ("full", "lora", "dora"))
    _require(c.load_in_bits in (0, 4, 8), f"load_in_bits must be 0 (off), 4 or 8, got {c.load_in_bits}")
    if c.train_type == "full":
        changed = [n for n in ("lora_rank", "lora_alpha", "lora_dropout", "lora_layers", "lora_keys",
                               "load_in_bits") if getattr(c, n) != command_default("train", n)]
        _require(not changed, f"{', '.join(changed)} only apply with train_type = lora or dora "
                 "(train_type is full)")
        return
    _require(c.lora_rank >= 1, "lora_rank must be >= 1")
    _require(c.lora_alpha > 0, "lora_alpha must be > 0")
    _require(0 <= c.lora_dropout < 1, "lora_dropout must be in [0, 1)")
    _require(c.lora_layers >= 0, "lora_layers must be >= 0 (0 = all blocks)")
    _require(not (c.lora_dropout > 0 and c.grad_checkpoint), "lora_dropout with grad_checkpoint would recompute "
             "each layer with a different dropout mask in the backward pass (wrong gradients): drop one of them")
    _require(not (c.load_in_bits and c.quantize_for_rollouts), "quantize_for_rollouts has nothing to do with "
             "load_in_bits: the base the rollouts use is already quantized; drop quantize_for_rollouts")
