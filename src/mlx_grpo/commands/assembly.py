"""Assembling a run from a Config (commands/train.py and the benches call `build_job`): the training and
evaluation examples, the reward set, the model loaded and cast to its compute dtype with its float32
masters, LoRA/DoRA adapters and the QLoRA base (`build_model`, which `mlx-grpo sft` shares), the KL
reference model, the start-up memory check for the rollouts (and the rollout engine's copy), and the
warnings about settings that will not do what they say
(check_prompt_lengths: prompts that max_prompt_length cuts, measured before the first update).
training/job.py wires the parts (sampling, step source, Trainer); training/ never imports this module.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, replace
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten

from mlx_grpo.base.errors import UserError
from mlx_grpo.commands.evaluate import answer_records
from mlx_grpo.config import COPY_SETTINGS, Config, command_default
from mlx_grpo.data.demonstrations import check_references
from mlx_grpo.data.examples import subset
from mlx_grpo.data.prompts import select_worked_examples
from mlx_grpo.data.sources import run_examples
from mlx_grpo.models import decoder
from mlx_grpo.models.adapters import ADAPTER_LAYERS, apply_adapters, quantize_base
from mlx_grpo.models.forward import supports_layer_checkpointing
from mlx_grpo.models.model_loading import load_model, resolve_model_path
from mlx_grpo.models.precision import cast_floats, check_rounding, compute_dtype, dtype_name
from mlx_grpo.rewards.workers import build_reward_set
from mlx_grpo.rollout.copy_decoder import cache_copies
from mlx_grpo.rollout.decode import machine_memory_bytes, rollout_memory_bytes
from mlx_grpo.rollout.engine import RolloutEngine, check_rollout_model, first_prompts, uses_copy
from mlx_grpo.rollout.loop import MIN_ROWS, rebuilt_rows
from mlx_grpo.rollout.multiturn import encode_prompts
from mlx_grpo.sft.steps import adapter_model_error
from mlx_grpo.storage.checkpoint import list_checkpoints, load_masters
from mlx_grpo.training.distributed import World
from mlx_grpo.training.health import prompt_cut_report
from mlx_grpo.training.job import Job, make_job
from mlx_grpo.training.optimization import MasterWeights
from mlx_grpo.training.policy import Policies
from mlx_grpo.training.served_teacher import ServedTeacher


@dataclass
class TrainedModel:
    """A model ready to train: in its compute dtype, with its float32 masters, adapters (lora/dora) and the
    QLoRA base as configured; what `build_job` and `mlx-grpo sft` (sft/steps.py) start from."""

    model: object
    tokenizer: object
    masters: MasterWeights
    adapter_config: dict | None  # lora/dora: what checkpoints record next to the adapters
    source_dir: Path  # the model's directory (its tokenizer files go into every checkpoint)
    dtype: mx.Dtype  # the compute dtype


def build_model(cfg: Config, say=print) -> TrainedModel:
    """Load cfg.model.model_name for training as train_type / load_in_bits / master_weights say. A full-weight
    checkpoint that holds float32 masters (a mixed-precision `train` or `sft` run) lends them to this
    run's masters, so a run started from it continues from exactly its weights. say: prints warnings."""
    spec = cfg.model  # what is trained; the other groups this reads are named in full
    source_dir = Path(resolve_model_path(spec.model_name))
    if not source_dir.is_dir():  # a hub id: mlx-lm downloads it; find its local snapshot
        from mlx_lm.utils import hf_repo_to_path

        source_dir = Path(hf_repo_to_path(spec.model_name))
    model, tokenizer = load_model(spec.model_name, spec.model_dtype, cast=False)
    dtype = compute_dtype(spec.model_name, spec.model_dtype, model)
    mixed = cfg.optimizer.master_weights and dtype != mx.float32  # float32 masters of the trained weights
    if any(isinstance(m, ADAPTER_LAYERS) for _, m in model.named_modules()):
        raise UserError(adapter_model_error(spec.model_name))
    quantized = any(k.endswith(".scales") for k, _ in tree_flatten(model.parameters()))
    adapter_config = None
    if spec.train_type == "full":
        if quantized:
            raise UserError(f"model {spec.model_name!r} is quantized; full fine-tuning needs float weights: convert "
                            "it without --quantize, or train adapters on it (train_type = lora: QLoRA)")
        masters = MasterWeights(model, mixed)  # from the weights as stored, before they are cast
        cast_floats(model, dtype)
        saved = load_masters(source_dir) if masters.active else None
        if saved is not None and {k: v.shape for k, v in saved.items()} == {k: v.shape for k, v in
                                                                          masters.masters.items()}:
            masters.adopt(saved)  # the stored weights are these masters rounded to the compute dtype
            masters.sync(model)
    else:
        cast_floats(model, dtype)  # the frozen base computes in the compute dtype; adapters get masters
        if spec.load_in_bits:
            quantize_base(model, spec.load_in_bits)
        elif quantized and cfg.rollout.quantize_for_rollouts:
            raise UserError(f"model {spec.model_name!r} is already quantized: quantize_for_rollouts has nothing to "
                            "do; drop it")
        mx.random.seed(cfg.run.seed)  # the adapters' initial weights come from the global generator
        adapter_config = apply_adapters(model, spec.train_type, spec.lora_rank, spec.lora_alpha, spec.lora_dropout,
                                        spec.lora_layers, spec.lora_keys)
        adapter_config["mlx_grpo"] = {"base_model": spec.model_name, "base_dir": str(source_dir.resolve()),
                                      "load_in_bits": spec.load_in_bits, "model_dtype": dtype_name(dtype)}
        masters = MasterWeights(model, mixed)  # mlx-lm creates the adapters in float32
        cast_floats(model, dtype)
    engine_warning = check_rollout_model(cfg.rollout.rollout_engine, model)
    if engine_warning:
        say(f"[mlx-grpo] warning: {engine_warning}")
    if cfg.training.grad_checkpoint and not supports_layer_checkpointing(model):
        say(f"[mlx-grpo] warning: grad_checkpoint has no effect for model type "
            f"{getattr(model, 'model_type', '?')!r}: its layers are not recomputed, memory stays as without it")
    if not masters.active:
        warning = check_rounding(dict(tree_flatten(model.trainable_parameters())), cfg.optimizer.learning_rate, dtype,
                                 "set master_weights = true (float32 masters) or model_dtype = float32")
        if warning:
            say(f"[mlx-grpo] warning: {warning}")
    return TrainedModel(model, tokenizer, masters, adapter_config, source_dir, dtype)


def build_job(cfg: Config, world: World | None = None) -> Job:
    """Load data, rewards and the models for a run (no side effects on disk); world: this process's place
    in a data-parallel run (default: alone)."""
    if cfg.data.image_column:  # GRPO on image + text prompts (vlm/)
        from mlx_grpo.commands.vision_job import build_vision_job

        return build_vision_job(cfg, world)
    train = run_examples(cfg, "train")
    evals = None
    if cfg.eval.eval_every_updates or cfg.eval.eval_steps or cfg.data.worked_examples \
            or cfg.data.worked_examples_text:
        evals = run_examples(cfg, "test")
    # the worked examples come from the whole training split, before max_train_samples, and leave it
    worked, train = select_worked_examples(cfg, train, evals or [])
    if cfg.data.max_train_samples:
        train = subset(train, cfg.data.max_train_samples, cfg.run.seed)
    rewards = build_reward_set(cfg, Path.cwd())
    main = world is None or world.is_main
    say = lambda line: print(line, flush=True) if main else None  # noqa: E731
    if cfg.objective.demonstrations != "off":  # before the model loads: refused where they can never apply
        note = check_references(cfg, train)
        if note and main:
            print(note, flush=True)
    built = build_model(cfg, say=say)
    model, tokenizer, masters, adapter_config = built.model, built.tokenizer, built.masters, built.adapter_config
    source_dir, dtype = built.source_dir, built.dtype
    # the KL reference: a frozen copy for full training; with adapters, `model` with its adapters switched off
    reference = load_model(cfg.model.model_name, cfg.model.model_dtype)[0] \
        if cfg.objective.kl_coeff > 0 and adapter_config is None else None
    r, G, sampled_by_copy = cfg.rollout, cfg.rollout.num_generations, uses_copy(cfg.rollout.rollout_engine, model)
    # the copy's settings where rollouts decode on the model itself (auto off NVIDIA GPUs, or a model the copy does
    # not serve): validation cannot know the device or the model, and presets travel between machines, so a warning
    ignored = [n for n in COPY_SETTINGS if getattr(r, n) != command_default("train", n)]
    if ignored and not sampled_by_copy:
        names = ", ".join(ignored[:-1]) + " and " * (len(ignored) > 1) + ignored[-1]
        say(f"[mlx-grpo] warning: {names} shape{'s' * (len(ignored) == 1)} the sampling copy's decode, "
            f"and rollouts decode on the model itself here (rollout_engine = {r.rollout_engine}): ignored")
    per_rank = " per rank" if world and world.size > 1 else ""
    rows = step_rows = cfg.training.batch_size // (world.size if world else 1) * G
    what = f"batch_size {cfg.training.batch_size} x num_generations {G}{per_rank}"
    lower = "num_generations, batch_size or max_new_tokens"
    first, copies, why = rows, 1.0, ""
    if sampled_by_copy:
        # the batch steps one decode holds (dynamic sampling's pass of draws, else an update's accumulated steps):
        # the copy starts running_rows of them (engine.first_prompts); while rows wait (later prompts, or turns), a
        # refill that rebuilds the batch pads it to a power of two (loop.rebuilt_rows); without, it only shrinks
        together = min(r.draws_per_pass, 1 + r.max_resample_batches) if r.dynamic_sampling \
            else cfg.training.gradient_accumulation_steps
        first = first_prompts(rows // G * together, rows // G, G, r.running_rows) * G
        if r.running_rows and first != rows:
            what = f"running_rows {r.running_rows}{per_rank}"
            lower = "running_rows or max_new_tokens"
        waiting = first < rows * together or bool(r.tools or r.environment)
        if waiting and rebuilt_rows(first) != first:
            what += f", {first} padded to a power of two, at least {MIN_ROWS}, by a refill"
        rows = rebuilt_rows(first) if waiting else first
        copies, why = cache_copies(first, waiting, decoder.steps_write_cache(model))
    longest = cfg.data.max_prompt_length + cfg.rollout.max_new_tokens
    need, have = rollout_memory_bytes(model, rows, longest, copies), machine_memory_bytes()
    copy = decoder.copy_bytes(model, dtype) if need and sampled_by_copy else 0
    # rollout_worker = process: the rollout process holds a second copy of the model (rollout/process.py)
    worker = sum(w.nbytes for _, w in tree_flatten(model.parameters())) \
        if cfg.rollout.async_rollouts and cfg.rollout.rollout_worker == "process" else 0
    if need and have and need + copy + worker > have:  # found up front, not by the OOM killer a minute in
        raise UserError(f"{rows} rollout rows ({what}) of up to "
                        f"{longest} tokens need at least {need / 1e9:.1f} GB for "
                        f"their KV cache" + (f" ({copies:.3g}x {why})" if copies > 1 else "") + " and logits"
                        + (f", plus {copy / 1e9:.1f} GB for the rollout engine's copy of the weights" if copy else "")
                        + (f", plus {worker / 1e9:.1f} GB for the rollout process's copy of the model"
                           if worker else "")
                        + f", more than this machine's {have / 1e9:.1f} GB: lower {lower}"
                        + (", or set rollout_engine = model" if copy and first == step_rows else "")
                        + (", or rollout_worker = thread" if worker else ""))
    teacher, teacher_source = load_teacher(cfg, tokenizer, say) if cfg.objective.distill_coeff > 0 else (None, None)
    engine = RolloutEngine(tokenizer, mode=cfg.rollout.rollout_engine, graph=cfg.rollout.decode_graph,
                           rows=cfg.rollout.running_rows, lookahead=cfg.rollout.lookahead)
    policies = Policies(cfg, model, reference, engine, adapters=adapter_config is not None, teacher=teacher,
                        teacher_source=teacher_source,
                        tokens=vocabulary_size(tokenizer))
    if not (cfg.eval.eval_every_updates or cfg.eval.eval_steps):
        evals = None  # loaded only to keep its questions out of the worked examples
    return make_job(cfg, world or World(), tokenizer, policies, rewards, train, evals, worked, source_dir,
                    adapter_config, masters, answer_records)


# Texts both tokenizers encode when a teacher is checked: prose, digits and arithmetic, code, accents, emoji.
TOKENIZER_PROBES = ("The answer is 42.", "What is 17 * 23 - 5? <answer>386</answer>", "def f(x):\n    return x ** 2",
                    "Café déjà vu, naïve façade.", "🙂 日本語 ∑ x_i")


def vocabulary_size(tokenizer) -> int | None:
    """The tokenizer's number of token ids (None for one that cannot list them)."""
    return len(tokenizer.get_vocab()) if hasattr(tokenizer, "get_vocab") else None


def load_teacher(cfg: Config, tokenizer, say=print) -> tuple[object, str]:
    """On-policy distillation's teacher, loaded in model_dtype (quantized weights stay quantized), or
    teacher_url's server (load_served_teacher); -> (teacher, what it is: the checkpoint a run directory
    resolved to, or the URL), which checkpoints record so that a resume keeps the same teacher. Its log-probs
    are of token ids: a teacher whose tokenizer encodes text differently from the student's would score other
    tokens, so it is refused in one line saying what differs."""
    vocab = vocabulary_size(tokenizer)
    if vocab is not None and cfg.objective.distill_topk > vocab:
        raise UserError(f"distill_topk = {cfg.objective.distill_topk} is more than the vocabulary's {vocab} "
                        "tokens: set distill_topk <= the vocabulary size")
    if cfg.objective.teacher_url:
        return load_served_teacher(cfg, tokenizer, say), cfg.objective.teacher_url
    name = cfg.objective.teacher_model
    run = Path(name)
    found = list_checkpoints(run) if run.is_dir() and not (run / "config.json").is_file() else []
    if found:
        name = str(found[-1])  # a run directory: its latest checkpoint
        say(f"[mlx-grpo] teacher_model: {name}, the latest checkpoint of {run}")
    teacher, theirs = load_model(name, cfg.model.model_dtype)
    sizes = [vocabulary_size(t) for t in (theirs, tokenizer)]
    if None not in sizes and sizes[0] != sizes[1]:
        raise UserError(f"teacher_model {name!r} has a vocabulary of {sizes[0]} tokens, the student "
                        f"{cfg.model.model_name!r} {sizes[1]}: on-policy distillation needs the same tokenizer "
                        "(a teacher of the student's family)")
    for text in TOKENIZER_PROBES:
        check_same_encoding(f"teacher_model {name!r}", cfg, text, theirs.encode(text), tokenizer.encode(text))
    if set(theirs.eos_token_ids) != set(tokenizer.eos_token_ids):  # a base and its instruct model: same ids
        say(f"[mlx-grpo] warning: teacher_model {name!r} ends its answers with tokens "
            f"{sorted(theirs.eos_token_ids)}, the student with {sorted(tokenizer.eos_token_ids)}: the teacher scores "
            "the student's end token as it would any other token")
    return teacher, str(Path(name).resolve()) if Path(name).exists() else name


def load_served_teacher(cfg: Config, tokenizer, say=print) -> ServedTeacher:
    """teacher_url's client, checked before any update: the server scores a probe (down, answering in another
    shape or without distill_topk's top k: one line now, not after the first rollout), and encodes
    TOKENIZER_PROBES as the student does where it has vLLM's /tokenize; without one, a warning says the
    tokenizer was not checked."""
    o = cfg.objective
    teacher = ServedTeacher(o.teacher_url, o.teacher_url_timeout, o.teacher_url_retries, o.teacher_url_allowed_hosts)
    probe = tokenizer.encode(TOKENIZER_PROBES[1])
    teacher.score_topk(probe, o.distill_topk) if o.distill_topk else teacher.score(probe)  # what training asks
    for text in TOKENIZER_PROBES:
        theirs, ours = teacher.tokenize(text), tokenizer.encode(text)
        if theirs is None:
            say(f"[mlx-grpo] warning: teacher_url {o.teacher_url}: the server has no /tokenize, so its tokenizer "
                f"could not be checked against the student's; it must be {cfg.model.model_name!r}'s")
            break
        check_same_encoding(f"teacher_url {o.teacher_url}", cfg, text, theirs, ours)
    return teacher


def check_same_encoding(teacher: str, cfg: Config, text: str, theirs: list[int], ours: list[int]) -> None:
    """One probe text's ids from the teacher and the student: different ids are one line naming both."""
    if theirs != ours:
        raise UserError(f"{teacher} uses another tokenizer than the student {cfg.model.model_name!r}: {text!r} "
                        f"encodes to {theirs[:8]}... there and {ours[:8]}... here; on-policy distillation needs "
                        "the same tokenizer (a teacher of the student's family)")


def check_prompt_lengths(job: Job, measured: int = 2000) -> None:
    """Say at start how much max_prompt_length cuts the training prompts (a seeded sample of them), and
    refuse a length that would cut the question out of most of them."""
    cfg = job.cfg
    if cfg.data.image_column:  # image prompts are never cut: vlm/image_rollout.py refuses a longer one
        return
    whole = replace(cfg, max_prompt_length=sys.maxsize)  # each prompt's length uncut
    examples = subset(job.train_examples, measured, cfg.run.seed)
    lengths = [len(ids) for ids, _ in encode_prompts(job.sampling.prompts.multiturn, job.tokenizer, examples, whole,
                                                    job.prompt.system)]
    warning, error = prompt_cut_report(lengths, cfg.data.max_prompt_length)
    if error:
        job.world.fail(error)
    if warning:
        job.world.print(f"[mlx-grpo] warning: {warning}")
