"""The supervised steps of `mlx-grpo sft` (commands/sft.py drives them): the completion-only loss, its
micro-batched gradient, the AdamW update on the float32 masters, and the state a checkpoint holds.

The loss of an update is the mean negative log-likelihood over the trained (completion) tokens of all its
rows: sum over rows and tokens of -log p(token | everything before it) * mask, divided by the number of
trained tokens. Prompt tokens are context only: they are the packed rows' inputs and never a target.
Each micro-batch's sum is divided by the whole update's token count, so micro-batch size, token bounds and
gradient accumulation change only the float summation order, never the loss.
"""

from __future__ import annotations

import json
import math
import shlex
import time
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_map

from mlx_grpo.base.errors import UserError
from mlx_grpo.config import Config
from mlx_grpo.data.examples import EpochSampler
from mlx_grpo.models.adapters import ADAPTER_WEIGHTS, adapter_parameters
from mlx_grpo.models.forward import PackedBatch, bucket, completion_logprobs, pack, packed_width
from mlx_grpo.models.precision import dtype_name
from mlx_grpo.rollout.sampler import pad_token_id
from mlx_grpo.sft.rows import SFTRow
from mlx_grpo.storage import checkpoint as ckpt
from mlx_grpo.training.optimization import (
    MasterWeights, clip_by_global_norm, learning_rate_at, make_optimizer, optimizer_step)

# trainer_state.json's "command": an sft checkpoint is resumed by `sft`, never by `train`.
COMMAND = "sft"


def check_sft_checkpoint(path: Path, state: dict) -> None:
    """Refuse, in one line, to resume a `train` checkpoint (trainer_state.json `state`) with `sft`: said before
    the settings are compared, whose GRPO-only keys would otherwise read as changed settings."""
    if state.get("command") != COMMAND:
        raise UserError(f"--resume: {path} is a checkpoint of `mlx-grpo train`, not of `sft`; to start sft "
                        f"from its weights, {start_from(path, instead_of_resume=True)}")


def fused_dir(checkpoint: Path) -> tuple[Path, bool]:
    """(where `mlx-grpo fuse` merges an adapter checkpoint for start_from, whether that merge is there already):
    beside the checkpoint, under a name no --resume takes. A merge older than the checkpoint's adapters (of an
    earlier checkpoint of that name, before a resume set it aside) is not it: the next free name then."""
    fused, n = checkpoint.parent / f"fused-{checkpoint.name}", 1
    try:
        if (fused / "config.json").stat().st_mtime >= (checkpoint / ADAPTER_WEIGHTS).stat().st_mtime:
            return fused, True
    except OSError:  # no merge there (or no adapters): fuse writes one
        pass
    while fused.exists():  # fuse refuses an existing directory
        n += 1
        fused = checkpoint.parent / f"fused-{checkpoint.name}.{n}"
    return fused, False


def start_from(checkpoint: Path, instead_of_resume: bool = False) -> str:
    """The tail of a hint saying how a new run (train or sft) starts from `checkpoint`: its weights as
    model_name, or for lora/dora adapters, which no run starts from (assembly.build_model), their merge into a
    model (the `mlx-grpo fuse` command, unless done). instead_of_resume: the refused command had --resume."""
    model, first = checkpoint, ""
    if ckpt.holds_adapters(checkpoint):
        model, merged = fused_dir(checkpoint)
        first = (f"its adapters are merged into {shlex.quote(str(model))}: " if merged else
                 f"merge its adapters into a model first: mlx-grpo fuse --checkpoint {shlex.quote(str(checkpoint))} "
                 f"--output-dir {shlex.quote(str(model))}, then ")
    rerun = "rerun without --resume, with" if instead_of_resume else "rerun with"
    return f"{first}{rerun} --set model_name={shlex.quote(str(model))}"


def adapter_model_error(model_name: str) -> str:
    """Why model_name, an adapter checkpoint, cannot start a run, and what to run instead: the merge
    (start_from), or, for a checkpoint of ours whose run has updates left, continuing that run."""
    path = Path(model_name).expanduser()
    line = f"model {model_name!r} is a lora/dora adapter checkpoint, which a run cannot start from: {start_from(path)}"
    try:
        state = json.loads((path / "trainer_state.json").read_text())
        command, left = state.get("command", "train"), state["total_updates"] - state["counters"]["update_step"]
    except (OSError, ValueError, KeyError, TypeError, AttributeError):  # adapters no run of ours wrote
        return line
    if left <= 0:  # its run is done: a resume would end at once
        return line
    return f"{line}; or continue the `{command}` run that wrote it: {ckpt.resume_command(command, path)}"


def nll_sums(logprobs: mx.array, mask: mx.array) -> tuple[mx.array, mx.array]:
    """(sum of -log p over the masked-in tokens, their number). logprobs, mask [n, T] -> two scalars (float32)."""
    mask = mask.astype(mx.float32)
    return -(logprobs.astype(mx.float32) * mask).sum(), mask.sum()


def pack_rows(rows: list[SFTRow], pad_id: int) -> PackedBatch:
    """Rows as one right-padded batch (forward.pack): each row's tokens after its prompt are the targets,
    their mask the row's own (0 on padding); widths bucketed so the GPU reuses its kernels."""
    width = bucket(max(len(r.ids) for r in rows))
    ids = mx.array([r.ids + [pad_id] * (width - len(r.ids)) for r in rows], dtype=mx.int32)  # [n, T]
    mask = mx.array([r.mask + [0] * (width - len(r.mask)) for r in rows], dtype=mx.float32)  # [n, T]
    return pack([r.prompt_ids for r in rows], ids, mask, pad_id)


def micro_batches(rows: list[SFTRow], size: int, max_tokens: int = 0) -> list[list[int]]:
    """Indices of rows in micro-batches of at most `size` rows and (if max_tokens) at most max_tokens padded
    tokens as pack_rows lays them out; longest first (an out-of-memory shows at once); a row is never split."""
    order = sorted(range(len(rows)), key=lambda i: -len(rows[i].ids))
    chunks, current, widest_prompt = [], [], 0
    for i in order:
        longest = len(rows[current[0]].ids) if current else len(rows[i].ids)
        width = packed_width(max(widest_prompt, len(rows[i].prompt_ids)), bucket(longest))
        if current and (len(current) == size or (max_tokens and (len(current) + 1) * width > max_tokens)):
            chunks.append(current)
            current, widest_prompt = [], 0
        current.append(i)
        widest_prompt = max(widest_prompt, len(rows[i].prompt_ids))
    return chunks + ([current] if current else [])


def make_grad_fn(model: nn.Module, grad_checkpoint: bool = False):
    """step(batch, scale) -> ((nll sum * scale, nll sum), gradient of the first) for one micro-batch."""

    def loss_fn(_model, inputs, positions, targets, mask, scale):
        lp = completion_logprobs(model, PackedBatch(inputs, positions, targets, mask), 1.0,
                                 checkpoint_layers=grad_checkpoint)  # [n, T]
        nll, _ = nll_sums(lp, mask)
        return nll * scale, nll

    grad_fn = nn.value_and_grad(model, loss_fn)

    def step(batch: PackedBatch, scale: mx.array):
        return grad_fn(model, batch.inputs, batch.positions, batch.targets, batch.mask, scale)

    return step


def sft_gradients(grad_fn, rows: list[SFTRow], pad_id: int, micro_batch: int, max_tokens: int = 0):
    """The gradient (float32) of the mean NLL over the trained tokens of `rows`, and that mean (float32).
    -> (grads, loss, tokens)."""
    tokens = sum(r.trained for r in rows)
    scale = mx.array(1.0 / tokens, dtype=mx.float32)
    grads, total = None, mx.array(0.0, dtype=mx.float32)
    for chunk in micro_batches(rows, micro_batch, max_tokens):
        batch = pack_rows([rows[i] for i in chunk], pad_id)
        (_, nll), g = grad_fn(batch, scale)
        g = tree_map(lambda x: x.astype(mx.float32), g)
        grads = g if grads is None else tree_map(mx.add, grads, g)
        total = total + nll
        mx.eval(grads, total)  # one boundary per micro-batch bounds memory
    return grads, total / tokens, tokens


@dataclass
class SFTCounters:
    update_step: int = 0
    skipped_updates: int = 0
    consecutive_skips: int = 0
    tokens_seen: int = 0  # trained tokens of every applied update so far


@dataclass
class SFTTrainer:
    """Rows, model and optimizer of a supervised run; `update` takes one optimizer step."""

    cfg: Config
    model: nn.Module
    tokenizer: object
    rows: list[SFTRow]
    run_dir: Path
    source_dir: Path
    masters: MasterWeights
    adapter_config: dict | None = None
    counters: SFTCounters = field(default_factory=SFTCounters)
    resumed: tuple[Path, int] | None = None  # (checkpoint, update) resumed from: where a failed save points

    def __post_init__(self):
        cfg = self.cfg
        self.sampler = EpochSampler(len(self.rows), cfg.training.batch_size, cfg.training.num_epochs, cfg.run.seed)
        self.total_updates = self.sampler.num_batches_total // cfg.training.gradient_accumulation_steps
        if self.total_updates == 0:
            rows, steps = len(self.rows), self.sampler.num_batches_total
            raise UserError(f"{rows} training row{'s' * (rows != 1)} give{'s' * (rows == 1)} {steps} batch "
                            f"step{'s' * (steps != 1)}, fewer than gradient_accumulation_steps="
                            f"{cfg.training.gradient_accumulation_steps}: add data or lower batch_size/accumulation")
        self.optimizer = make_optimizer(cfg, learning_rate_at(1, self.total_updates, cfg))
        self.grad_fn = make_grad_fn(self.model, cfg.training.grad_checkpoint)
        self.pad_id = pad_token_id(self.tokenizer)
        self._batches = iter(self.sampler)
        self.model.eval()  # dropout (lora_dropout) only inside the gradient pass

    def next_rows(self) -> list[SFTRow] | None:
        """The rows of the next update (gradient_accumulation_steps batches), or None when the data is done."""
        rows = []
        for _ in range(self.cfg.training.gradient_accumulation_steps):
            indices = next(self._batches, None)
            if indices is None:
                return None
            rows += [self.rows[i] for i in indices]
        return rows

    def update(self, rows: list[SFTRow]) -> dict:
        """One optimizer update on the mean NLL of rows' trained tokens -> its metrics."""
        cfg, c = self.cfg, self.counters
        c.update_step += 1
        lr = learning_rate_at(c.update_step, self.total_updates, cfg)
        self.optimizer.learning_rate = mx.array(lr, dtype=mx.float32)
        if cfg.model.lora_dropout > 0:  # dropout masks come from the global generator: derive them from the seed
            mx.random.seed((cfg.run.seed * 1_000_003 + c.update_step) % 2 ** 63)
        t0 = time.perf_counter()
        self.model.train()
        try:
            grads, loss, tokens = sft_gradients(self.grad_fn, rows, self.pad_id, cfg.training.micro_batch_size,
                                                cfg.training.micro_batch_tokens)
        finally:
            self.model.eval()
        grads, norm = clip_by_global_norm(grads, cfg.optimizer.max_grad_norm)
        mx.eval(grads, norm)
        loss, norm = loss.item(), norm.item()
        finite = math.isfinite(loss) and math.isfinite(norm)
        if finite:
            optimizer_step(self.optimizer, self.model, grads, self.masters)
            c.consecutive_skips = 0
            c.tokens_seen += tokens
        else:
            c.skipped_updates += 1
            c.consecutive_skips += 1
            print(f"[mlx-grpo] sft update {c.update_step}: non-finite loss or gradient (loss={loss}, "
                  f"grad_norm={norm}); update skipped", flush=True)
            if c.consecutive_skips >= cfg.health.max_consecutive_skips:
                raise UserError(f"{c.consecutive_skips} consecutive updates had a non-finite loss or gradient; "
                                "stopping (try a lower learning_rate or max_grad_norm). The weights of the last "
                                "finite update are in the latest checkpoint.")
        dt = time.perf_counter() - t0
        return {"update_step": c.update_step, "epoch": self.sampler.epoch, "lr": lr, "loss": loss,
                "grad_norm": norm, "tokens": tokens, "tokens_total": c.tokens_seen, "sequences": len(rows),
                "skipped": not finite, "skipped_total": c.skipped_updates, "time_train_s": dt,
                "train_tokens_per_s": tokens / dt if dt > 0 else 0.0, "peak_memory_gb": mx.get_peak_memory() / 1e9}

    # ------------------------------------------------------------------ state
    def state(self) -> dict:
        return {"command": COMMAND, "counters": vars(self.counters).copy(), "data_cursor": self.sampler.state(),
                "total_updates": self.total_updates}

    def save(self) -> Path:
        """checkpoint-<update>/: a complete model directory (`train --set model_name=` opens it) plus what
        exact resume needs, written as `train` writes its checkpoints (checkpoint.save_checkpoint)."""
        config_json = json.loads((self.source_dir / "config.json").read_text())
        path = ckpt.save_checkpoint(self.run_dir, self.counters.update_step, model=self.model,
                                    optimizer=self.optimizer, trainer_state=self.state(), config=self.cfg,
                                    source_dir=self.source_dir, model_config=config_json,
                                    adapter_config=self.adapter_config, masters=self.masters.masters)
        ckpt.prune(self.run_dir, self.cfg.run.save_total_limit, path)
        return path

    def restore(self, path: Path, loaded: tuple) -> None:
        """Continue from checkpoint.read_for_resume's (weights, optimizer state, state, old, masters)."""
        weights, opt_state, state, _, masters = loaded
        check_sft_checkpoint(path, state)
        if state["total_updates"] != self.total_updates:
            raise UserError(f"--resume: {path} belongs to a run of {state['total_updates']} "
                            f"update{'s' * (state['total_updates'] != 1)} and this config "
                            f"gives {self.total_updates}: the data, epochs or batch shape differ; resume with the "
                            f"run's own config: {ckpt.resume_command('sft', path)}")
        if self.adapter_config is not None and set(weights) != set(adapter_parameters(self.model)):
            raise UserError(f"--resume: the adapters in {path} do not match this config's train_type/lora_* "
                            f"settings; resume with the run's own config: {ckpt.resume_command('sft', path)}")
        if self.adapter_config is None and ckpt.holds_adapters(path):
            raise UserError(f"--resume: {path} holds lora/dora adapters but train_type is full; resume with the "
                            f"run's own config: {ckpt.resume_command('sft', path)}")
        current = {k: v.dtype for k, v in tree_flatten(self.model.trainable_parameters())}
        other = sorted({dtype_name(v.dtype) for k, v in weights.items() if k in current and v.dtype != current[k]})
        if other:
            raise UserError(f"--resume: {path} holds {'/'.join(other)} weights and this run computes in "
                            f"{dtype_name(next(iter(current.values())))}: set model_dtype = {other[0]} to resume it")
        try:
            self.model.load_weights(list(weights.items()), strict=self.adapter_config is None)
        except ValueError as exc:
            raise UserError(f"--resume: {path} does not fit model {self.cfg.model.model_name!r} "
                            f"({str(exc).splitlines()[0][:200]})") from None
        if self.masters.active:
            self.masters.adopt(masters or dict(tree_flatten(self.model.trainable_parameters())))
            self.masters.sync(self.model)
        self.optimizer.state = opt_state
        self.counters = SFTCounters(**state["counters"])
        self.sampler.load_state(state["data_cursor"])
        self._batches = iter(self.sampler)
        mx.eval(self.model.parameters(), self.optimizer.state, self.masters.arrays())
