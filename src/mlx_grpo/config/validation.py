"""Validation of a Config, each failure one UserError line that says what to change: first every declared
range and choice of the command's fields (read from their `setting(...)` declarations), then the rules that
tie fields together. The declarations own the fields; this module owns only rules across them."""

from __future__ import annotations

import difflib

from mlx_grpo.config.data import dataset_kind, unknown_dataset
from mlx_grpo.config.fields import DATA, choices_of, in_range, range_words
from mlx_grpo.config.objective import loss_own_fields
from mlx_grpo.config.rollout import COPY_SETTINGS
from mlx_grpo.config.root import FIELD_GROUP, FIELDS, Config, command_default, fields_for
from mlx_grpo.base.errors import UserError


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise UserError(message)


def check(c: Config, command: str) -> None:
    """The declared ranges and choices of `command`'s fields, then the cross-field rules."""
    for name in fields_for(command):
        check_declared(name, getattr(getattr(c, FIELD_GROUP[name]), name))
    if command not in DATA:
        return
    _validate_data(c)
    _validate_images(c)
    if command == "train":
        _validate_train(c)
    elif command == "sft":
        _validate_tuning(c)
        _validate_adapters(c)


def check_declared(name: str, value) -> None:
    """The field's declared range and choices (each entry's, for a list)."""
    f = FIELDS[name]
    if f.metadata["range"]:
        note = f" ({f.metadata['note']})" if f.metadata["note"] else ""
        _require(in_range(value, f.metadata["range"]), f"{name} must be {range_words(f)}{note}")
    if not f.metadata["choices"]:
        return
    choices = choices_of(f)
    for item in (value if isinstance(value, list) else [value]):
        match = difflib.get_close_matches(str(item), [str(x) for x in choices], n=1, cutoff=0.4)
        hint = f"; did you mean '{match[0]}'?" if match else ""
        listed = ", ".join(map(str, choices))
        if isinstance(value, list):
            _require(item in choices, f"{name}: unknown {f.metadata['item']} {item!r}; choose from {listed}{hint}")
        else:
            _require(item in choices, f"{name} must be one of {listed}, got {item!r}{hint}")
    if isinstance(value, list):
        _require(len(set(value)) == len(value), f"{name} lists a {f.metadata['item']} twice: {value}")


def _validate_data(c: Config) -> None:
    d, r = c.data, c.rollout
    _require(all(s != "" for s in r.stop), "stop strings must not be empty: an empty string would end every "
             "completion after its first token")
    _require(not (r.tools and r.environment), "set tools or environment, not both (an environment with tools "
             "subclasses ToolEnvironment)")
    _require(r.tool_format == "auto" or r.tools or r.environment,
             "tool_format applies to runs with tools or an environment: set tools, or leave tool_format = auto")
    _require(r.max_tool_turns == 4 or r.tools, "max_tool_turns applies to tools (an environment sets its own "
             "max_turns): set tools, or leave max_tool_turns at 4")
    _require(dataset_kind(d.dataset) != "unknown", unknown_dataset(d.dataset))
    for name in ("prompt_column", "answer_column"):
        _unused_unless(c, name, dataset_kind(d.dataset) != "builtin" or bool(d.dataset_path or d.eval_dataset_path),
                       "a data file, directory or hub id (dataset, dataset_path or eval_dataset_path)")
    _require(all(t.strip() for t in d.worked_examples_text), "worked_examples_text entries must not be empty")
    _require(c.eval.eval_num_samples == 1 or r.temperature > 0,
             "eval_num_samples > 1 (pass@k) needs temperature > 0; set temperature=1.0")


def _validate_images(c: Config) -> None:
    """Settings the image rollouts (vlm/image_rollout.py) do not implement: refused, not ignored."""
    r, o = c.rollout, c.objective
    if c.data.image_column:
        bad = [name for flag, name in [(o.update_every > 1, "update_every > 1"), (r.quantize_for_rollouts,
               "quantize_for_rollouts"), (bool(r.stop), "stop"), (o.demonstrations != "off", "demonstrations"),
               (c.training.use_compile, "use_compile"), (bool(r.tools or r.environment), "tools/environment"),
               (bool(c.data.prefill), "prefill"), (r.decode_graph, "decode_graph"),
               (r.lookahead > 0, "lookahead"), (r.running_rows > 0, "running_rows")] if flag]
        _require(not bad, f"image_column (GRPO on images) does not support {', '.join(bad)}: drop them")
    _require(c.data.image_column or not c.training.train_vision,
             "train_vision needs image_column (a GRPO run on images)")


def _validate_tuning(c: Config) -> None:
    """The rules `train` and `sft` share: names that become paths."""
    _require(c.run.run_name.strip() != "" and "/" not in c.run.run_name,
             "run_name must be a non-empty name without '/'")


def _validate_train(c: Config) -> None:
    _validate_tuning(c)
    r, w, o, ev = c.rollout, c.rewards, c.objective, c.eval
    _require(c.health.gaming_evals == 0 or c.health.gaming_evals >= 2, "gaming_evals must be 0 (off) or >= 2: it "
             "compares the first and the last of that many evaluations")
    _require(r.temperature > 0, "training samples its rollouts: temperature must be > 0")
    _require(r.top_p == 1.0 and r.top_k == 0 and r.min_p == 0.0,
             "top_p, top_k and min_p must stay off (1.0, 0, 0.0) in training: they sample from a cut distribution "
             "while the trained and logged log-probs are the uncut one's, so the update would be off-policy; "
             "lower temperature instead")
    _require(not w.reward_weights or len(w.reward_weights) == len(w.reward_funcs),
             f"reward_weights has {len(w.reward_weights)} entries but reward_funcs has {len(w.reward_funcs)}: "
             "give one weight per function, or none")
    _require(ev.eval_samples == 0 or ev.eval_steps > 0,
             "eval_samples only sizes the eval_steps evaluations: set eval_steps > 0, or drop eval_samples")
    _require(len(w.reward_funcs) > 0 or w.reward_url or w.reward_model or o.distill_coeff > 0, "reward_funcs must "
             "name at least one reward function (or set reward_url / reward_model, or a teacher: distill_coeff > 0 "
             "with teacher_model or teacher_url)")
    _require(o.distill_coeff == 0 or o.teacher_model or o.teacher_url, "distill_coeff > 0 needs a teacher: set "
             "teacher_model (a local model) or teacher_url (a served one)")
    _require(not (o.teacher_model and o.teacher_url), "teacher_model and teacher_url both name a teacher: set one")
    _require(o.distill_coeff == 0 or not c.data.image_column, "on-policy distillation (distill_coeff > 0) takes text "
             "prompts; image_column runs train on rewards alone")
    for name in ("teacher_model", "teacher_url"):
        _unused_unless(c, name, o.distill_coeff > 0, "distill_coeff > 0")
    if o.distill_coeff > 0:  # what does not mix with a per-token teacher signal, each in one line
        _require(not r.dynamic_sampling, "dynamic_sampling drops groups whose rewards are all equal, and with a teacher "
                 "(distill_coeff > 0) every group carries a signal: drop dynamic_sampling")
        _require(o.demonstrations == "off", "demonstrations put reference solutions into groups that earned nothing; "
                 "with a teacher (distill_coeff > 0) the teacher's signal is on the student's own samples: set "
                 "demonstrations = \"off\"")
        _require(o.importance_sampling_level == "token", "importance_sampling_level = sequence gives each sequence one "
                 "ratio, which sums the teacher's per-token signal over the sequence: keep it token with distill_coeff")
        _require(c.model.lora_dropout == 0, "lora_dropout with distill_coeff: on-policy the student's log-probs come "
                 "from the dropout pass, so the teacher's signal would measure dropout noise; set lora_dropout = 0")
        _require(c.health.max_updates_without_signal in (0, command_default("train", "max_updates_without_signal")),
                 "max_updates_without_signal watches the rewards, and with a teacher (distill_coeff > 0) flat rewards "
                 "are no reason to stop, so it is off: drop it")
    _require(o.distill_topk == 0 or o.distill_coeff > 0, "distill_topk > 0 adds to on-policy distillation, whose "
             "teacher distill_coeff > 0 switches on: set distill_coeff > 0 and teacher_model or teacher_url")
    _unused_unless(c, "distill_topk_coeff", o.distill_topk > 0, "distill_topk > 0")
    for name in ("teacher_url_timeout", "teacher_url_retries", "teacher_url_allowed_hosts"):
        _unused_unless(c, name, bool(o.teacher_url), "teacher_url set")
    _require(not o.teacher_url or r.temperature == 1.0, f"teacher_url's server gives log-probs of the untempered "
             f"distribution, but the rollouts sample at temperature = {r.temperature:g}: set temperature = 1.0, or "
             "use teacher_model (scored at logits / temperature)")
    for name in ("reward_model_weight", "reward_model_clip", "reward_model_answer_weight", "reward_model_batch_size"):
        _unused_unless(c, name, bool(w.reward_model), "reward_model set")
    _require(not (w.reward_model and w.reward_workers), "the reward model runs on the accelerator inside the "
             "training process: keep reward_workers = 0 with reward_model")
    _unused_unless(c, "reward_executor", w.reward_workers > 0, "reward_workers > 0")
    _require(not (w.reward_workers and r.dynamic_sampling), "reward_workers does nothing with dynamic_sampling, "
             "which needs each draw's rewards before it can draw again: drop one of them")
    overlap = c.training.gradient_accumulation_steps > 1 or o.kl_coeff > 0 or o.num_iterations > 1 \
        or o.update_every > 1 or r.quantize_for_rollouts
    _require(not w.reward_workers or overlap, "reward_workers has nothing to overlap with: with one batch step per "
             "update and no log-prob passes (kl_coeff = 0, on-policy) the update needs the rewards at once; "
             "raise gradient_accumulation_steps or drop reward_workers")
    for name in ("reward_url_weight", "reward_url_timeout", "reward_url_retries", "reward_url_allowed_hosts"):
        _unused_unless(c, name, bool(w.reward_url), "reward_url set")
    _validate_objective(c)
    _validate_async(c)
    _validate_adapters(c)


def _validate_objective(c: Config) -> None:
    o, r, w, d = c.objective, c.rollout, c.rewards, c.data
    high = o.clip_eps_high or o.clip_eps
    _require(o.delta == 0 or o.delta > 1 + high, f"delta must be 0 (off) or > 1 + clip_eps_high = {1 + high:g}: "
             "it caps ratios above the clip range")
    _require(w.overlong_penalty == 0 or 0 < w.overlong_buffer <= r.max_new_tokens,
             f"overlong_penalty needs 0 < overlong_buffer <= max_new_tokens ({r.max_new_tokens}), got "
             f"overlong_buffer={w.overlong_buffer}")
    _require(o.sapo_temperature_pos > 0 and o.sapo_temperature_neg > 0, "sapo temperatures must be > 0")
    own = loss_own_fields()
    for name in dict.fromkeys(f for fields in own.values() for f in fields):  # a loss type's own settings
        _unused_unless(c, name, name in own.get(o.loss_type, ()),
                       "loss_type " + " or ".join(k for k, fields in own.items() if name in fields))
    off_policy = o.num_iterations > 1 or o.update_every > 1 or r.quantize_for_rollouts
    for name, active in (("clip_eps_high", o.clip_eps_high > 0), ("delta", o.delta > 0),
                         ("importance_sampling_level", o.importance_sampling_level == "sequence"),
                         *((n, getattr(o, n) != command_default("train", n))  # the gate and cap act on rho != 1
                           for n in ("cispo_cap", "sapo_temperature_pos", "sapo_temperature_neg"))):
        _require(not active or off_policy, f"{name} has no effect here: with num_iterations = 1 and update_every = "
                 "1 the sampler is the policy being trained, every importance ratio is exactly 1 and nothing is "
                 "clipped; set num_iterations >= 2 (several optimizer passes per rollout) or update_every >= 2")
    _unused_unless(c, "kl_estimator", o.kl_coeff > 0, "kl_coeff > 0")
    _unused_unless(c, "arith_max_steps", d.dataset == "arith" and not (d.dataset_path and d.eval_dataset_path),
                   "dataset = arith without both dataset files")
    _require(o.rollout_correction == "none" or c.model.lora_dropout == 0,
             "rollout_correction with lora_dropout: on-policy the trainer's log-probs come from the dropout pass, "
             "so the sampler ratio would weight dropout noise; set lora_dropout = 0")
    _unused_unless(c, "overlong_buffer", w.overlong_penalty > 0, "overlong_penalty > 0")
    _unused_unless(c, "max_resample_batches", r.dynamic_sampling, "dynamic_sampling = true")
    _unused_unless(c, "draws_per_pass", r.dynamic_sampling, "dynamic_sampling = true")
    _unused_unless(c, "rollout_worker", r.async_rollouts > 0, "async_rollouts = 1")
    for name in COPY_SETTINGS:
        _unused_unless(c, name, r.rollout_engine != "model" and not r.quantize_for_rollouts,
                       "the sampling copy (rollout_engine = copy or auto, without quantize_for_rollouts)")
    _unused_unless(c, "carry_surplus", r.dynamic_sampling, "dynamic_sampling = true")
    if r.carry_surplus:
        _require(o.rollout_correction != "none", "carry_surplus trains groups sampled by the weights of an earlier "
                 "update and needs rollout_correction to weight that back: set rollout_correction = "
                 "\"token_truncate\" (or another mode), or carry_surplus = false")
        _require(o.demonstrations == "off" and not c.data.image_column, "carry_surplus keeps a draw's groups for the "
                 "next update; demonstrations and image prompts are built per update: drop them, or set "
                 "carry_surplus = false")
    _unused_unless(c, "dynamic_sampling_reward", r.dynamic_sampling, "dynamic_sampling = true")
    _unused_unless(c, "demo_reward", o.demonstrations != "off", "demonstrations on")
    _require(o.demonstrations == "off" or not (r.tools or r.environment), "demonstrations need single-turn "
             "rollouts (a reference solution has no tool or environment turns): drop tools/environment, or set "
             "demonstrations = off")
    names = [n.rpartition(":")[2] for n in w.reward_funcs] + ["reward_url"] * bool(w.reward_url) \
        + ["reward_model"] * bool(w.reward_model) + ["overlong_penalty"] * (w.overlong_penalty > 0)
    for field, value in (("demo_reward", o.demo_reward), ("dynamic_sampling_reward", r.dynamic_sampling_reward)):
        _require(value == "" or value in names, f"{field} must name one of the run's rewards ({', '.join(names)}), "
                 f"got {value!r}")


def _validate_async(c: Config) -> None:
    """async_rollouts = 1 (training/prefetch.py): what the pipelined rollouts support."""
    r, o = c.rollout, c.objective
    if not r.async_rollouts:
        return
    bad = [name for flag, name in [(r.dynamic_sampling, "dynamic_sampling"), (o.num_iterations > 1, "num_iterations > 1"),
           (o.update_every > 1, "update_every > 1"), (r.quantize_for_rollouts, "quantize_for_rollouts"),
           (o.demonstrations != "off", "demonstrations"), (bool(c.data.image_column), "image_column"),
           # its gathers queued ahead of the loop: checked on the one stream only
           (r.lookahead > 0, "lookahead")] if flag]
    _require(not bad, f"async_rollouts = 1 does not support {', '.join(bad)}: drop them, or set async_rollouts = 0")
    _require(r.rollout_worker == "thread" or not (r.tools or r.environment), "rollout_worker = process decodes "
             "single-turn rollouts only (the episodes' tools run in the training process): set rollout_worker = thread")
    _require(o.rollout_correction != "none", "async_rollouts = 1 samples each batch with the weights of one update "
             "before and needs rollout_correction to weight that back: set rollout_correction = \"token_truncate\" "
             "(or another mode), or async_rollouts = 0")


def _unused_unless(c: Config, name: str, condition: bool, needs: str) -> None:
    """A field changed from its default where it cannot act is an error, not a silent no-op."""
    _require(condition or getattr(getattr(c, FIELD_GROUP[name]), name) == command_default("train", name),
             f"{name} only applies with {needs}; drop it or set that too")


def _validate_adapters(c: Config) -> None:
    m = c.model
    if m.train_type == "full":
        changed = [n for n in ("lora_rank", "lora_alpha", "lora_dropout", "lora_layers", "lora_keys", "load_in_bits")
                   if getattr(m, n) != command_default("train", n)]
        _require(not changed, f"{', '.join(changed)} only apply with train_type = lora or dora "
                 "(train_type is full)")
        return
    _require(not (m.lora_dropout > 0 and c.training.grad_checkpoint), "lora_dropout with grad_checkpoint would "
             "recompute each layer with a different dropout mask in the backward pass (wrong gradients): drop one "
             "of them")
    _require(not (m.load_in_bits and c.rollout.quantize_for_rollouts), "quantize_for_rollouts has nothing to do "
             "with load_in_bits: the base the rollouts use is already quantized; drop quantize_for_rollouts")
