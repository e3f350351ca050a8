"""Where a training pass's time goes (grpo_bench.py --sections split): the same rollout and micro-batches
as the train section, timed piece by piece (medians after a warm-up, each piece evaluated on its own):

  forward       the log-prob pass over the same micro-batches (forward + head, no gradient)
  fwd+bwd       accumulate_gradients (value_and_grad per micro-batch, float32 accumulation), eager and with
                use_compile (the compiled gradient step); backward = fwd+bwd - forward
  clip          the global-norm clip of the summed gradients
  optimizer     AdamW on the float32 masters (the compute dtype is not float32) or on the model
  master cast   the compute copy refreshed from the masters (MasterWeights.sync)
  update        optimizer + master cast eager, against compile_update's one compiled function (training/compiled_update.py)

Each timed piece updates the weights (learning rate 1e-6), as the trainer's would.

The chunking section (grpo_bench.py --sections chunking, bench_chunking) times the same rollout under each
micro-batch setting ROWSxTOKENS (micro_batch_size x micro_batch_tokens, use_compile on):

  logprob       the no-gradient log-prob pass over that setting's micro-batches
  layers        the same micro-batches, packed before the clock starts, through the transformer layers only
                (hidden_states, no output head; families in forward.LOGIT_SPLITS only); head_s = logprob -
                layers: the output head plus what the pass does around the model (host packing, the gather
                of completion positions, the scatter into the [N, T] result), printed as "head+packing"
  fwd+bwd       the compiled gradient pass (accumulate_gradients with use_compile)
  peak          peak memory of one fwd+bwd call (weights included), and the number of micro-batches
"""

from __future__ import annotations

from dataclasses import replace

import mlx.core as mx
import mlx.optimizers as optim
from mlx.utils import tree_flatten, tree_unflatten

from mlx_grpo.models.forward import hidden_states, logit_split
from mlx_grpo.rollout.rollout_records import chunk_batch, row_chunks
from mlx_grpo.training.compiled_update import CompiledUpdate
from mlx_grpo.training.optimization import (
    MasterWeights, accumulate_gradients, clip_by_global_norm, loss_weights, make_grad_fn, optimizer_step)
from mlx_grpo.training.policy import logprob_pass

from bench_util import GB, timed


def bench_split(model, steps: list, cfg, repeats: int, pad_id: int) -> dict:
    """The training pass split on `steps` (policy.StepData list). -> seconds per piece."""
    rollout = steps[0].rollout
    tokens = int(sum(int(s.rollout.lengths.sum()) for s in steps))
    weights = loss_weights(cfg, steps)
    out = {"tokens": tokens}
    out["forward_s"], _ = timed(lambda: mx.eval(logprob_pass(model, rollout, cfg.rollout.temperature,
                                                             cfg.training.micro_batch_size, pad_id,
                                                             cfg.training.micro_batch_tokens)), repeats)
    grads = None
    for compiled in (False, True):
        grad_fn = make_grad_fn(replace(cfg, use_compile=compiled), model)

        def fwd_bwd(grad_fn=grad_fn):
            g, sums = accumulate_gradients(grad_fn, steps, weights, cfg.training.micro_batch_size, pad_id,
                                           cfg.training.micro_batch_tokens)
            mx.eval(g, sums)
            return g

        name = "compiled" if compiled else "eager"
        out[f"fwd_bwd_{name}_s"], grads = timed(fwd_bwd, repeats)
        out[f"backward_{name}_s"] = out[f"fwd_bwd_{name}_s"] - out["forward_s"]

    def clip():
        g, norm = clip_by_global_norm(grads, cfg.optimizer.max_grad_norm)
        mx.eval(g, norm)
        return g

    out["clip_s"], grads = timed(clip, repeats)
    compute = model.model.embed_tokens.weight.dtype if hasattr(model, "model") else mx.float32
    masters = MasterWeights(model, enabled=compute != mx.float32)
    out["masters"] = masters.active
    opt = optim.AdamW(learning_rate=1e-6)

    def optimizer_only():
        if masters.active:
            flat = [(k, g.astype(mx.float32)) for k, g in tree_flatten(grads)]  # as MasterWeights.step does
            new = opt.apply_gradients(tree_unflatten(flat), tree_unflatten(list(masters.masters.items())))
            mx.eval(new, opt.state)
            return new
        opt.update(model, grads)
        mx.eval(model.parameters(), opt.state)

    out["optimizer_s"], new = timed(optimizer_only, repeats)
    out["master_cast_s"] = 0.0
    if masters.active:
        out["master_cast_s"], _ = timed(lambda: (masters.sync(model), mx.eval(model.parameters())), repeats)

    def eager_update():
        optimizer_step(opt, model, grads, masters)
        mx.eval(model.parameters(), opt.state, masters.arrays())

    out["update_eager_s"], _ = timed(eager_update, repeats)
    compiled_update = CompiledUpdate(opt, model, masters)

    def compiled_step():
        compiled_update.step(grads)
        mx.eval(model.parameters(), opt.state, masters.arrays())

    out["update_compiled_s"], _ = timed(compiled_step, repeats)
    out["train_pass_eager_s"] = out["fwd_bwd_eager_s"] + out["clip_s"] + out["update_eager_s"]
    out["train_pass_compiled_s"] = out["fwd_bwd_compiled_s"] + out["clip_s"] + out["update_compiled_s"]
    print(f"training pass split ({tokens} tokens, masters {'on' if masters.active else 'off'}): forward "
          f"{out['forward_s']:.3f} s; backward {out['backward_eager_s']:.3f} eager / {out['backward_compiled_s']:.3f} "
          f"compiled; clip {out['clip_s']:.3f}; optimizer {out['optimizer_s']:.3f} + master cast "
          f"{out['master_cast_s']:.3f}; update eager {out['update_eager_s']:.3f} vs compiled "
          f"{out['update_compiled_s']:.3f}; pass {out['train_pass_eager_s']:.3f} s eager vs "
          f"{out['train_pass_compiled_s']:.3f} s with use_compile + compile_update", flush=True)
    return out


def markdown_rows(r: dict) -> list[str]:
    return [f"| training pass split s ({r['tokens']} tokens): forward {r['forward_s']:.3f} + backward "
            f"{r['backward_eager_s']:.3f} + clip {r['clip_s']:.3f} + optimizer {r['optimizer_s']:.3f} + master cast "
            f"{r['master_cast_s']:.3f} | {r['train_pass_compiled_s']:.3f} (use_compile + compile_update; backward "
            f"{r['backward_compiled_s']:.3f}, update {r['update_compiled_s']:.3f}) | {r['train_pass_eager_s']:.3f} "
            f"(eager) | {r['train_pass_eager_s'] / r['train_pass_compiled_s']:.2f}x |"]


def bench_chunking(model, steps: list, cfg, settings: list[tuple[int, int]], repeats: int, pad_id: int) -> list[dict]:
    """Log-prob pass, layers alone and the compiled fwd+bwd on `steps` for each (rows, tokens) micro-batch
    setting. -> one row per setting (seconds, peak GB, micro-batches)."""
    rollout = steps[0].rollout
    tokens = int(sum(int(s.rollout.lengths.sum()) for s in steps))
    split = logit_split(model)
    out = []
    for rows, budget in settings:
        c = replace(cfg, micro_batch_size=rows, micro_batch_tokens=budget, use_compile=True)
        chunks = row_chunks(rollout, rows, budget)
        row = {"micro_batch_size": rows, "micro_batch_tokens": budget, "tokens": tokens, "chunks": len(chunks)}
        row["logprob_s"], _ = timed(lambda: mx.eval(logprob_pass(model, rollout, c.rollout.temperature, rows, pad_id,
                                                                 budget)), repeats)
        row["layers_s"] = row["head_s"] = None
        if split is not None:
            inner = split.inner
            batches = [chunk_batch(rollout, r, pad_id)[0] for r in chunks]

            def layers():
                for batch in batches:
                    mx.eval(hidden_states(inner, batch.inputs))

            row["layers_s"], _ = timed(layers, repeats)
            row["head_s"] = row["logprob_s"] - row["layers_s"]
        grad_fn = make_grad_fn(c, model)
        weights = loss_weights(c, steps)

        def fwd_bwd():
            g, sums = accumulate_gradients(grad_fn, steps, weights, rows, pad_id, budget)
            mx.eval(g, sums)

        row["fwd_bwd_s"], _ = timed(fwd_bwd, repeats)
        mx.reset_peak_memory()
        fwd_bwd()
        row["peak_gb"] = mx.get_peak_memory() / GB
        layers_text = "" if row["layers_s"] is None else \
            f" (layers {row['layers_s']:.3f} + head+packing {row['head_s']:.3f})"
        print(f"chunking {rows}x{budget} ({row['chunks']} micro-batches, {tokens} tokens): log-prob pass "
              f"{row['logprob_s']:.3f} s{layers_text}; compiled fwd+bwd {row['fwd_bwd_s']:.3f} s, peak "
              f"{row['peak_gb']:.2f} GB", flush=True)
        out.append(row)
    return out


def chunking_markdown_rows(rows: list[dict]) -> list[str]:
    """One table row per micro-batch setting of bench_chunking."""
    out = []
    for r in rows:
        layers = "" if r["layers_s"] is None else f" (layers {r['layers_s']:.3f} + head+packing {r['head_s']:.3f})"
        out.append(f"| chunking {r['micro_batch_size']}x{r['micro_batch_tokens']} (rows x tokens): {r['chunks']} "
                   f"micro-batches, {r['tokens']} tokens, peak {r['peak_gb']:.2f} GB; compiled fwd+bwd s | "
                   f"{r['fwd_bwd_s']:.3f} | log-prob pass {r['logprob_s']:.3f} s{layers} | |")
    return out
