r"""GRPO throughput and memory benchmark for mlx-grpo, each figure next to a plain baseline run in the
same process on the same model, device and batch.

Sections (all by default; pick with --sections):
  rollout  generated tokens/s of B x G sampled completions (bench/rollout_bench.py): the rollout engine
           the trainer uses (fused sampling copy, compiled step, ended rows dropped), the engine
           without compaction, the engine with decode_graph, generate_rollout on the model (the loop
           before the engine: fixed cache + CUDA decode kernel), against a plain mlx-lm KV-cache loop with categorical sampling; with
           EOS stopping (real lengths) and without (equal lengths)
  refill   an update's batch steps decoded together (later steps refill freed slots) vs one by one
  overlap  a rollout decoding while the previous batch step's log-prob pass runs on a second stream
  short    rollout time follows generated tokens (bench/short_answers.py): a batch of --short-rows rows
           with a mean answer of --short-mean tokens and one full-length row, against the same rows at
           full length
  logprob  tokens/s and peak memory of the no-gradient log-prob pass
  train    tokens/s of forward+backward+AdamW update against a plain nn.value_and_grad + AdamW loop
  split    the training pass piece by piece (bench/train_split.py): forward, backward, clip, optimizer,
           master cast; eager against use_compile + compile_update
  chunking the same rollout under each micro-batch setting of --chunkings (rows x tokens, use_compile;
           bench/train_split.py): log-prob pass, layers alone (head = the rest), compiled fwd+bwd, peak
           memory, number of micro-batches
  memory   peak memory of the log-prob and training passes on a large synthetic batch (default
           256 rows x 512 completion tokens), against model + optimizer + 4 GB
  step     full GRPO updates of the trainer, as its training loop runs them (medians of --repeats after
           --warmup untimed ones): the config's step source draws the update's batch steps (dynamic
           sampling: again until enough groups vary), then the update; with their split, draws, decode
           passes, rows decoded per row trained, tool calls (tools runs) and peak memory

Standard workload (the defaults): the embedded SmolLM2-135M-Instruct in bf16, GSM8K prompts with the
XML system prompt, B=16, G=16, max_new_tokens=256, temperature 1.0:

    python bench/grpo_bench.py --data ../shared/data/gsm8k/train.jsonl --out bench-results

Other models: --shape NAME (bench/shapes.py: qwen2.5-0.5b, qwen2.5-1.5b, qwen3-0.6b, qwen3.5-0.8b,
gemma-3-1b, gemma-3-270m, lfm2-1.2b) swaps in a random-weight model of that architecture and vocabulary,
written once as an MLX model directory in a temporary folder with the tokenizer of --tokenizer (default:
the embedded model's) next to it, so every section, the trainer's `step` included, loads it as it would a
real checkpoint (--layers N keeps its first N layers: quick checks on a CPU). The rollout engine's sampling
copy and the CUDA decode kernel serve llama-family models only (qwen2.5-*, qwen3-0.6b); for the others the
engine decodes through generate_rollout on the model, so the rollout section runs the engine and the model
rows only, labelled so (its other rows would repeat the same run). --train-type lora (or dora) wraps the
model in the adapters the config's lora_* fields describe (apply_adapters, as the trainer does) in every
section:

    python bench/grpo_bench.py --shape qwen2.5-0.5b --train-type lora --sections rollout,step \
        --data ../shared/data/gsm8k/train.jsonl --out bench-results

A preset: --config PATH builds the bench's config on a TOML preset as `mlx-grpo train --config` does
(build_config), e.g. configs/prod_tools.toml (tools, prefill, dynamic sampling), so the step section times
the preset's own update. With --config the preset's values win for every option that sets a config field
(--model, --train-type, --dtype, --dataset, --batch, --group, --max-new-tokens, --temperature) unless it is
given on the command line; --data, then --set (last: it beats every option) apply on top. prod_tools'
update from its warm start, in the same sitting as the standard step (the command above with --sections step)
and TRL:

    python bench/grpo_bench.py --config configs/prod_tools.toml --model WARM_START --data GSM8K_TRAIN \
        --sections step --repeats 3

Prints a markdown table, then the ratios against the baselines; writes the JSON record to --out.
"""

from __future__ import annotations

import argparse
from contextlib import contextmanager
import datetime as dt
from dataclasses import replace
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten, tree_map

from mlx_grpo import kernels
from mlx_grpo.base.errors import UserError
from mlx_grpo.config import build_config, parse_set
from mlx_grpo.data.examples import load_examples
from mlx_grpo.loss import group_advantages
from mlx_grpo.models.forward import pack
from mlx_grpo.models.model_loading import load_model
from mlx_grpo.reporting.logs import update_record
from mlx_grpo.rollout.decode import encode_chat_prompt, generate_rollout, supports_static_cache
from mlx_grpo.rollout.engine import uses_copy
from mlx_grpo.rollout.rollout_records import Rollout, SamplingParams
from mlx_grpo.training.optimization import accumulate_gradients, clip_by_global_norm, loss_weights, make_grad_fn
from mlx_grpo.training.policy import logprob_pass
from mlx_grpo.training.records import StepData, UpdateSteps

import rollout_bench
import shapes
import short_answers
import train_split
from bench_util import GB, device_name, mlx_settings, nbytes, peak_during, timed, versions

SECTIONS = ("rollout", "short", "refill", "overlap", "logprob", "train", "split", "chunking", "memory", "step")
# The options that set a config field: option -> (field, the bench's default). Without --config an option not
# given sets its default; with --config only the options given set their fields (the preset's values win).
CONFIG_OPTIONS = {"model": ("model_name", "smollm2-135m-instruct"), "train_type": ("train_type", "full"),
                  "dtype": ("model_dtype", "bfloat16"), "dataset": ("dataset", "gsm8k"), "batch": ("batch_size", 16),
                  "group": ("num_generations", 16), "max_new_tokens": ("max_new_tokens", 256),
                  "temperature": ("temperature", 1.0)}


# ----------------------------------------------------------------------------- baselines

def plain_train_step(model, optimizer, batches, advantages: list[mx.array], temperature: float, n_rows: int):
    """The baseline: nn.value_and_grad of the token-level GRPO loss (ratio 1, no KL) on full logits of
    each micro-batch as given, summed, then one AdamW update."""

    def loss_fn(m, inputs, positions, targets, mask, adv):
        logits = m(inputs).astype(mx.float32) / temperature  # [n, L, V]
        logp = nn.log_softmax(logits, axis=-1)
        picked = mx.take_along_axis(logp, positions[..., None], axis=1)  # [n, T, V]
        lp = mx.take_along_axis(picked, targets[..., None], axis=-1).squeeze(-1)  # [n, T]
        per_token = -mx.exp(lp - mx.stop_gradient(lp)) * adv[:, None]
        return ((per_token * mask).sum(axis=1) / mx.maximum(mask.sum(axis=1), 1)).sum() / n_rows

    grad_fn = nn.value_and_grad(model, loss_fn)
    grads = None
    for b, adv in zip(batches, advantages):
        _, g = grad_fn(model, b.inputs, b.positions, b.targets, b.mask, adv)
        grads = g if grads is None else tree_map(mx.add, grads, g)
        mx.eval(grads)
    optimizer.update(model, grads)
    mx.eval(model.parameters(), optimizer.state)


def vocab_size(model) -> int:
    """The output vocabulary (Qwen3.5's args hold it in text_config)."""
    args = model.args
    return args.vocab_size if hasattr(args, "vocab_size") else args.text_config["vocab_size"]


@contextmanager
def rollout_variants(variants: dict | None):
    """rollout_bench's variants (name -> label) as given while the block runs (None: all of them)."""
    saved = rollout_bench.ROLLOUT_VARIANTS
    if variants is not None:
        rollout_bench.ROLLOUT_VARIANTS = variants
    try:
        yield
    finally:
        rollout_bench.ROLLOUT_VARIANTS = saved


def rollout_paths(model) -> dict:
    """What the rollout section's variants run on for this model. Where the sampling copy does not serve it
    (models/decoder.py supports: llama-family full attention), RolloutEngine decodes through generate_rollout
    on the model whatever its compact/graph options, so only the engine and model rows run (the others would
    repeat that run), labelled so; where the static cache does not serve it, generate_rollout decodes on the
    batch caches of model.make_cache() (no CUDA decode kernel)."""
    copy, static = uses_copy("copy", model), supports_static_cache(model)
    out = {"sampling_copy": copy, "static_cache": static, "variants": None}
    if not copy:
        kind = getattr(model, "model_type", "this family")
        cache = "static cache, decode kernel on CUDA" if static else "batch caches from make_cache, no decode kernel"
        out["variants"] = {"engine": f"engine (no sampling copy for {kind}: generate_rollout on the model, {cache})",
                           "model": f"generate_rollout on the model ({cache})"}
    return out


# ----------------------------------------------------------------------------- workloads

def encode_prompts(tokenizer, examples, cfg) -> list[list[int]]:
    d = cfg.data
    return [encode_chat_prompt(tokenizer, e.prompt, d.system_prompt, d.prefill, d.max_prompt_length)[0]
            for e in examples]


def synthetic_rollout(prompts: list[list[int]], group_size: int, length: int, vocab: int, seed: int) -> Rollout:
    """Every row a full-length completion of random ids: the worst case for the log-prob/train passes."""
    n = len(prompts) * group_size
    ids = mx.array(np.random.default_rng(seed).integers(3, vocab, size=(n, length)).astype(np.int32))
    mask = mx.ones((n, length), dtype=mx.float32)
    return Rollout(prompt_ids=prompts, completion_ids=ids, mask=mask, sampler_logprobs=mx.zeros((n, length)),
                   truncated=np.ones(n, dtype=bool), texts=[""] * n, group_size=group_size)


def step_data(rollout: Rollout, seed: int) -> StepData:
    rewards = mx.array(np.random.default_rng(seed).normal(size=len(rollout.texts)).astype(np.float32))
    return StepData(rollout, group_advantages(rewards, rollout.group_size), None, None)


def our_train_step(model, optimizer, grad_fn, steps: list[StepData], cfg, pad_id: int) -> None:
    grads, sums = accumulate_gradients(grad_fn, steps, loss_weights(cfg, steps), cfg.training.micro_batch_size, pad_id,
                                       cfg.training.micro_batch_tokens)
    grads, _ = clip_by_global_norm(grads, cfg.optimizer.max_grad_norm)
    optimizer.update(model, grads)
    mx.eval(model.parameters(), optimizer.state, sums.loss)


# ----------------------------------------------------------------------------- sections

def bench_logprob(model, rollout: Rollout, cfg, repeats, pad_id) -> dict:
    tokens = int(rollout.lengths.sum())
    t = cfg.training
    sec, _ = timed(lambda: mx.eval(logprob_pass(model, rollout, cfg.rollout.temperature, t.micro_batch_size, pad_id,
                                                t.micro_batch_tokens)), repeats)
    peak, _, _ = peak_during(lambda: mx.eval(logprob_pass(model, rollout, cfg.rollout.temperature, t.micro_batch_size,
                                                          pad_id, t.micro_batch_tokens)))
    print(f"logprob pass: {tokens / sec:.0f} tok/s, peak +{peak / GB:.2f} GB", flush=True)
    return {"tokens": tokens, "s": sec, "tok_s": tokens / sec, "peak_gb": peak / GB}


def bench_train(model, rollout: Rollout, cfg, repeats, pad_id) -> dict:
    steps = [step_data(rollout, cfg.run.seed)]
    tokens = int(rollout.lengths.sum())
    opt = optim.AdamW(learning_rate=1e-6)
    grad_fn = make_grad_fn(cfg, model)
    sec, _ = timed(lambda: our_train_step(model, opt, grad_fn, steps, cfg, pad_id), repeats)
    # The baseline: the same rows in the same row micro-batches, unsorted, full logits, no token budget.
    n = len(rollout.texts)
    prompts = rollout.row_prompts
    size = cfg.training.micro_batch_size
    chunks = [list(range(i, min(n, i + size))) for i in range(0, n, size)]
    batches = [pack([prompts[r] for r in c], rollout.completion_ids[mx.array(c)], rollout.mask[mx.array(c)], pad_id)
               for c in chunks]
    advs = [steps[0].advantages[mx.array(c)] for c in chunks]
    plain_opt = optim.AdamW(learning_rate=1e-6)
    plain_sec, _ = timed(lambda: plain_train_step(model, plain_opt, batches, advs, cfg.rollout.temperature, n), repeats)
    row = {"tokens": tokens, "s": sec, "tok_s": tokens / sec, "plain_s": plain_sec,
           "plain_tok_s": tokens / plain_sec, "ratio_vs_plain": plain_sec / sec}
    print(f"train step: {row['tok_s']:.0f} tok/s, plain value_and_grad loop {row['plain_tok_s']:.0f} tok/s", flush=True)
    return row


def bench_memory(model, prompts, rows: int, length: int, cfg, pad_id, budgets: list[int]) -> list[dict]:
    """Peak memory and speed of both passes on rows x length full completions, for each micro-batch
    token budget; the target is model + optimizer + 4 GB."""
    group = cfg.rollout.num_generations
    batch_prompts = (prompts * (rows // group // len(prompts) + 1))[:max(1, rows // group)]
    vocab = vocab_size(model)
    rollout = synthetic_rollout(batch_prompts, group, length, vocab, cfg.run.seed)
    weights = nbytes(model.parameters())
    opt = optim.AdamW(learning_rate=1e-6)
    opt.init(model.trainable_parameters())
    mx.eval(opt.state)
    optimizer_bytes = nbytes(opt.state)
    full_logits = rollout.completion_ids.size * vocab * 4
    tokens = rollout.completion_ids.size
    out = []
    for budget in budgets:
        c = replace(cfg, micro_batch_tokens=budget)
        lp_peak, lp_s, _ = peak_during(lambda: mx.eval(logprob_pass(model, rollout, c.rollout.temperature,
                                                                    c.training.micro_batch_size, pad_id,
                                                                    c.training.micro_batch_tokens)))
        grad_fn = make_grad_fn(c, model)
        steps = [step_data(rollout, c.run.seed)]
        tr_peak, tr_s, _ = peak_during(lambda: our_train_step(model, opt, grad_fn, steps, c, pad_id))
        row = {"rows": rows, "length": length, "micro_batch_tokens": budget,
               "grad_checkpoint": c.training.grad_checkpoint,
               "full_logits_gb": full_logits / GB, "model_gb": weights / GB, "optimizer_gb": optimizer_bytes / GB,
               "logprob_peak_above_model_gb": lp_peak / GB, "train_peak_above_model_and_optimizer_gb": tr_peak / GB,
               "logprob_s": lp_s, "train_s": tr_s, "train_tok_s": tokens / tr_s, "budget_gb": 4.0}
        print(f"memory {rows}x{length}, micro_batch_tokens={budget}: full logits would be {full_logits / GB:.1f} GB; "
              f"log-prob pass peak +{lp_peak / GB:.2f} GB, train pass peak +{tr_peak / GB:.2f} GB above model + "
              f"optimizer, train {tokens / tr_s:.0f} tok/s", flush=True)
        out.append(row)
    return out


def step_record(job, steps: UpdateSteps, results: list, total: float) -> dict:
    """One timed update's figures: the split, rows decoded and trained, and the draws, decode passes, rows decoded
    per row trained and tool-call rate as the run's own metrics record gives them (reporting/logs.update_record),
    with the tool calls of the drawn rows."""
    stats = [b.stats for b in steps.batches]
    logged = update_record(job.cfg, job.counters, steps.position, stats, results[-1])
    rewards = np.concatenate([s.rewards for s in stats])
    rec = {"total_s": total, "rollout_s": sum(s.t_rollout for s in stats), "reward_s": sum(s.t_reward for s in stats),
           "logprob_s": sum(s.t_logprob for s in stats), "train_s": sum(r.t_train for r in results),
           "tokens": sum(s.tokens for s in stats), "reward_mean": float(np.mean(rewards)) if len(rewards) else None,
           "truncated": float(np.mean(np.concatenate([s.truncated for s in stats]))), "batch_steps": len(stats),
           "draws": logged["draws"], "rows_decoded": sum(len(s.lengths) for s in stats),
           "rows_trained": sum(len(s.texts) for s in stats),
           # the record has these with dynamic sampling only: otherwise an update's batch steps decode together,
           # in one pass, and train every row drawn
           "decode_passes": logged.get("decode_passes", 1),
           "rows_decoded_per_trained": logged.get("rows_decoded_per_trained", 1.0)}
    if "tool_call_rate" in logged:
        rec["tool_calls"] = int(sum(s.tool_calls.sum() for s in stats))
        rec["tool_call_rate"] = logged["tool_call_rate"]
    return rec


def step_line(rec: dict) -> str:
    """The figures of step_record past the split, for the step's printed line."""
    per = rec["rows_decoded_per_trained"]
    line = (f"{rec['draws']} draw{'s' * (rec['draws'] != 1)} in {rec['decode_passes']} decode "
            f"pass{'es' * (rec['decode_passes'] != 1)}, {rec['rows_decoded']} rows decoded, {rec['rows_trained']} "
            f"trained ({f'{per:.2f}' if per is not None else '-'} per row trained)")
    if "tool_calls" in rec:
        line += f"; {rec['tool_calls']} tool calls ({rec['tool_call_rate']:.0%} of rows)"
    return line


def median(values) -> float | None:
    """The median of the values that are not None (None: no update trained a row)."""
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def bench_step(cfg, repeats: int, warmup: int = 1) -> dict:
    """Full GRPO updates through the trainer itself, as commands/train.py's loop runs them: the config's step
    source (training/step_sources.py) draws the update's batch steps (rollout, rewards submitted, old/ref
    log-probs; dynamic sampling: more draws until enough groups vary), then num_iterations updates; medians
    of `repeats` updates after `warmup` untimed ones."""
    from mlx_grpo.commands.assembly import build_job

    job = build_job(cfg)
    records = []
    mx.reset_peak_memory()
    try:
        for i in range(warmup + repeats):
            t0 = time.perf_counter()
            steps = job.source.next()
            if steps is None:
                raise UserError(f"step section: the training data ran out after {i} updates")
            results = [job.trainer.update(steps) for _ in range(cfg.objective.num_iterations)]
            rec = step_record(job, steps, results, time.perf_counter() - t0)
            print(f"grpo step {i}{' (warm-up)' if i < warmup else ''}: {rec['total_s']:.2f} s = rollout "
                  f"{rec['rollout_s']:.2f} + reward {rec['reward_s']:.2f} + log-probs {rec['logprob_s']:.2f} + train "
                  f"{rec['train_s']:.2f}; {rec['tokens']} tokens; {step_line(rec)}", flush=True)
            records.append(rec)
    finally:
        job.close()
    measured = records[warmup:]  # main() refuses --repeats < 1, so never empty
    summary = {k: median(r[k] for r in measured) for k in measured[0]}
    summary["warmup"] = warmup
    summary["peak_memory_gb"] = mx.get_peak_memory() / GB
    summary["trainable_parameters"] = sum(p.size for _, p in tree_flatten(job.model.trainable_parameters()))
    summary["steps"] = records
    return summary


# ----------------------------------------------------------------------------- report

def markdown(result: dict) -> str:
    lines = ["| measurement | ours | baseline | ratio |", "| --- | ---: | ---: | ---: |"]
    with rollout_variants(result.get("rollout_paths", {}).get("variants")):
        lines += rollout_bench.markdown_rows(result.get("rollout", []))
    if "short" in result:
        lines += short_answers.markdown_rows(result["short"])
    if "logprob" in result:
        r = result["logprob"]
        lines.append(f"| log-prob pass tok/s (peak +{r['peak_gb']:.2f} GB) | {r['tok_s']:,.0f} | | |")
    if "train" in result:
        r = result["train"]
        lines.append(f"| train step tok/s (fwd+bwd+AdamW) | {r['tok_s']:,.0f} | {r['plain_tok_s']:,.0f} "
                     f"(plain value_and_grad) | {r['ratio_vs_plain']:.2f}x |")
    if "split" in result:
        lines += train_split.markdown_rows(result["split"])
    if "chunking" in result:
        lines += train_split.chunking_markdown_rows(result["chunking"])
    for r in result.get("memory", []):
        setting = f"micro_batch_tokens={r['micro_batch_tokens']}"
        lines.append(f"| log-prob pass peak above model, {r['rows']}x{r['length']} tokens, {setting} (full logits: "
                     f"{r['full_logits_gb']:.1f} GB) | {r['logprob_peak_above_model_gb']:.2f} GB | "
                     f"{r['budget_gb']:.0f} GB budget | |")
        lines.append(f"| train pass peak above model + optimizer ({r['model_gb']:.2f} + {r['optimizer_gb']:.2f} GB), "
                     f"{r['rows']}x{r['length']}, {setting}; {r['train_tok_s']:,.0f} tok/s | "
                     f"{r['train_peak_above_model_and_optimizer_gb']:.2f} GB | {r['budget_gb']:.0f} GB budget | |")
    if "step" in result:
        r = result["step"]
        per = f"{r['rows_decoded_per_trained']:.2f}" if r["rows_decoded_per_trained"] is not None else "-"
        tools = f", {r['tool_calls']:g} tool calls" if "tool_calls" in r else ""
        lines.append(f"| full GRPO step s: rollout {r['rollout_s']:.2f} + reward {r['reward_s']:.2f} + log-probs "
                     f"{r['logprob_s']:.2f} + train {r['train_s']:.2f}; {r['draws']:g} draw(s) in {r['decode_passes']:g} "
                     f"decode pass(es), {per} rows decoded per row trained{tools}; peak {r['peak_memory_gb']:.1f} GB "
                     f"| {r['total_s']:.2f} | | |")
    return "\n".join(lines)


def ratios(result: dict) -> list[str]:
    out = rollout_bench.ratio_lines(result.get("rollout", []))
    if "short" in result:
        out.append(short_answers.ratio_line(result["short"]))
    if "train" in result:
        out.append(f"train step vs plain value_and_grad + AdamW: {result['train']['ratio_vs_plain']:.2f}x")
    for m in result.get("memory", []):
        out.append(f"micro_batch_tokens={m['micro_batch_tokens']}: train pass peak above model + optimizer "
                   f"{m['train_peak_above_model_and_optimizer_gb']:.2f} GB, log-prob pass "
                   f"{m['logprob_peak_above_model_gb']:.2f} GB (budget 4 GB)")
    return out


def parse_sizes(text: str) -> list[tuple[int, int]]:
    return [tuple(int(x) for x in item.lower().split("x")) for item in text.split(",") if item]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="", metavar="PATH",
                    help="a TOML preset (e.g. configs/prod_tools.toml) the config is built on, as `mlx-grpo train "
                         "--config` builds it: its values win for the options marked [preset] unless they are given "
                         "here; --data and --set apply on top")
    ap.add_argument("--model", help="model name or MLX directory (default: smollm2-135m-instruct) [preset]")
    ap.add_argument("--shape", default="", choices=["", *shapes.SHAPES],
                    help="a random-weight model of this architecture instead of --model (bench/shapes.py)")
    ap.add_argument("--layers", type=int, default=0,
                    help="--shape with only its first N layers (quick checks on a CPU; default: all)")
    ap.add_argument("--tokenizer", default="",
                    help="model directory whose tokenizer --shape uses (default: the embedded default model's)")
    ap.add_argument("--train-type", choices=["full", "lora", "dora"],
                    help="train every weight (default), or adapters as the config's lora_* fields say "
                         "(--set lora_rank=...) [preset]")
    ap.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"],
                    help="model_dtype (default: bfloat16; --shape writes its weights in it) [preset]")
    ap.add_argument("--data", default="", help="GSM8K-style JSONL/Parquet file (default: --dataset)")
    ap.add_argument("--dataset", choices=["gsm8k", "arith"],
                    help="used when --data is not given (default: gsm8k, which downloads from the hub) [preset]")
    ap.add_argument("--batch", type=int, help="B prompts per step (default: 16) [preset]")
    ap.add_argument("--group", type=int, help="G completions per prompt (default: 16) [preset]")
    ap.add_argument("--max-new-tokens", type=int, help="(default: 256) [preset]")
    ap.add_argument("--temperature", type=float, help="(default: 1.0) [preset]")
    ap.add_argument("--sizes", default="4x16,16x16,32x16,64x16", help="rollout sizes BxG, comma-separated")
    ap.add_argument("--chunkings", default="16x8192,32x16384,64x32768,128x65536",
                    help="chunking section: micro-batch settings ROWSxTOKENS (micro_batch_size x micro_batch_tokens)")
    ap.add_argument("--memory-shape", default="256x512", help="rows x completion tokens for the memory section")
    ap.add_argument("--memory-budgets", default="",
                    help="micro_batch_tokens values to measure in the memory section (default: the config's)")
    ap.add_argument("--short-pool", default="16x64", help="short section: pool of prompts x samples")
    ap.add_argument("--short-rows", type=int, default=256, help="short section: rows of the timed batch")
    ap.add_argument("--short-mean", type=float, default=20.0, help="short section: the batch's mean answer length")
    ap.add_argument("--short-ends", default="", help="short section: extra end strings as a JSON list, e.g. "
                    "'[\"\\n\", \".\"]' (default: the candidate whose median pool length is nearest --short-mean)")
    ap.add_argument("--repeats", type=int, default=2,
                    help="timed repeats (after one warm-up; the step section: after --warmup)")
    ap.add_argument("--warmup", type=int, default=1,
                    help="untimed steps before the step section's timed ones (on a fresh GPU machine the compiled "
                         "step builds kernels in its first two)")
    ap.add_argument("--refill", default="4x16x16", help="refill section: batch steps x B x G of one update")
    ap.add_argument("--refill-ends", default='["."]', help="refill section: extra end strings (JSON list)")
    ap.add_argument("--sections", default=",".join(SECTIONS), help=f"any of {', '.join(SECTIONS)}")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="trainer config overrides (e.g. micro_batch_tokens=4096)")
    ap.add_argument("--out", default="bench-results", help="directory for the JSON record")
    args = ap.parse_args(argv)
    sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = set(sections) - set(SECTIONS)
    if unknown:
        ap.error(f"unknown section(s) {sorted(unknown)}; choose from {', '.join(SECTIONS)}")
    if args.layers and not args.shape:
        ap.error("--layers applies to --shape only")
    if args.repeats < 1 or args.warmup < 0:
        ap.error(f"--repeats must be >= 1 and --warmup >= 0 (got {args.repeats}, {args.warmup})")
    try:
        return run(args, sections, argv)
    except UserError as exc:  # bad data path, config key or value: one line, like the CLI
        print(f"grpo_bench: error: {exc}", file=sys.stderr)
        return 2


def run(args: argparse.Namespace, sections: list[str], argv: list[str] | None) -> int:
    if not args.shape:
        return run_model(args, sections, argv, args.model)  # None with --config: the preset's model_name
    tokenizer_dir = Path(args.tokenizer) if args.tokenizer else shapes.default_tokenizer_dir()
    # the weights are written in the dtype the run computes in: --dtype, else the preset's, else bfloat16
    wanted = args.dtype or (build_config("train", args.config, []).model.model_dtype if args.config else "")
    name = wanted if wanted in ("float32", "float16") else "bfloat16"
    dtype = getattr(mx, name)
    with tempfile.TemporaryDirectory(prefix="grpo_bench-shape-") as tmp:
        model_dir = shapes.write_model_dir(args.shape, Path(tmp) / args.shape, tokenizer_dir, dtype, seed=0,
                                           layers=args.layers)
        depth = f" (first {args.layers} layers)" if args.layers else ""
        print(f"model: shape {args.shape}{depth}, random weights in {name}, tokenizer of {tokenizer_dir}", flush=True)
        return run_model(args, sections, argv, str(model_dir))


def adapt(model, cfg) -> dict | None:
    """train_type lora/dora: wrap the loaded model in adapters as the trainer does (QLoRA's quantized base
    with load_in_bits, adapters from the seeded global generator, then cast to the compute dtype)."""
    from mlx_grpo.models.adapters import apply_adapters, quantize_base
    from mlx_grpo.models.precision import cast_floats, compute_dtype

    if cfg.model.train_type == "full":
        return None
    if cfg.model.load_in_bits:
        quantize_base(model, cfg.model.load_in_bits)
    mx.random.seed(cfg.run.seed)
    m = cfg.model
    adapters = apply_adapters(model, m.train_type, m.lora_rank, m.lora_alpha, m.lora_dropout, m.lora_layers,
                              m.lora_keys)
    cast_floats(model, compute_dtype(cfg.model.model_name, cfg.model.model_dtype, model))
    mx.eval(model.parameters())
    return adapters


def config_overrides(args: argparse.Namespace, model_name: str | None) -> list[str]:
    """The bench's overrides of the config (of --config's preset, else of the train defaults): the options of
    CONFIG_OPTIONS given (without --config: all, at their defaults), --data (then --dataset is not used), the
    bench's own run settings (no checkpoints, data that never runs out, run files under --out), then --set."""
    given = {**{k: getattr(args, k) for k in CONFIG_OPTIONS}, "model": model_name}
    if args.data:
        del given["dataset"]
    items = [f"{field}={default if given[k] is None else given[k]}" for k, (field, default) in CONFIG_OPTIONS.items()
             if k in given and (given[k] is not None or not args.config)]
    if args.data:
        items.append(f"dataset_path={args.data}")
    return items + ["save_steps=0", "num_epochs=1000", "output_dir=" + str(Path(args.out) / "runs"),
                    f"run_name=bench-{dt.datetime.now():%Y%m%d-%H%M%S}"] + args.set


def run_model(args: argparse.Namespace, sections: list[str], argv: list[str] | None, model_name: str | None) -> int:
    cfg = build_config("train", args.config or None, parse_set(config_overrides(args, model_name)))
    B, G = cfg.training.batch_size, cfg.rollout.num_generations
    model, tokenizer = load_model(cfg.model.model_name, cfg.model.model_dtype)
    adapters = adapt(model, cfg)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else sorted(tokenizer.eos_token_ids)[0]
    examples = load_examples(cfg.data.dataset, "train", cfg.data.dataset_path or None, cfg.run.seed)
    n_prompts = max(b for b, _ in parse_sizes(args.sizes) + [(B, 0), (int(args.short_pool.split("x")[0]), 0)])
    prompts = encode_prompts(tokenizer, examples[:n_prompts], cfg)

    result = {"date": dt.date.today().isoformat(), "device": device_name(), "versions": versions(),
              "mlx_settings": mlx_settings(),
              "command": " ".join([Path(sys.argv[0]).as_posix()] + (argv if argv is not None else sys.argv[1:])),
              "workload": {"model": args.shape or cfg.model.model_name, "random_weights": bool(args.shape),
                           "layers": args.layers or None, "vocab_size": vocab_size(model) if args.shape else None,
                           "train_type": cfg.model.train_type, "adapters": adapters,
                           "parameters": shapes.parameter_count(model),
                           "trainable_parameters": sum(p.size for _, p in tree_flatten(model.trainable_parameters())),
                           "dtype": cfg.model.model_dtype, "B": B, "G": G,
                           "max_new_tokens": cfg.rollout.max_new_tokens, "temperature": cfg.rollout.temperature,
                           "micro_batch_size": cfg.training.micro_batch_size,
                           "micro_batch_tokens": cfg.training.micro_batch_tokens,
                           "data": args.data or cfg.data.dataset_path or cfg.data.dataset, "config": args.config or None,
                           "dynamic_sampling": cfg.rollout.dynamic_sampling, "tools": cfg.rollout.tools}}
    w = result["workload"]
    print(f"device: {result['device']}; mlx {result['versions']['mlx']}, mlx-lm {result['versions']['mlx_lm']}; "
          f"model {w['model']}, {w['train_type']}: {w['trainable_parameters']:,} of {w['parameters']:,} parameters "
          "trained", flush=True)
    if "rollout" in sections:
        result["cuda_kernels"] = kernels.available()  # checked against their references by tests/test_cuda_kernels.py
        result["rollout_paths"] = paths = rollout_paths(model)
        if paths["variants"]:
            print("rollout: " + "; ".join(paths["variants"].values()), flush=True)
        with rollout_variants(paths["variants"]):
            result["rollout"] = rollout_bench.bench_rollout(model, tokenizer, prompts, parse_sizes(args.sizes), cfg,
                                                            args.repeats, pad_id)
    if "short" in sections:
        pool = tuple(int(x) for x in args.short_pool.lower().split("x"))
        ends = json.loads(args.short_ends) if args.short_ends else None
        try:
            result["short"] = short_answers.bench_short(model, tokenizer, prompts, cfg, args.repeats, pool,
                                                        args.short_rows, args.short_mean, ends)
        except ValueError as exc:
            raise UserError(f"short section: {exc}") from None
    if "refill" in sections:
        n_steps, b, g = (int(x) for x in args.refill.lower().split("x"))
        result["refill"] = rollout_bench.bench_refill(model, tokenizer, prompts, cfg, n_steps, b, g,
                                                      json.loads(args.refill_ends), args.repeats)
    if "overlap" in sections:
        result["overlap"] = rollout_bench.bench_overlap(model, tokenizer, prompts, cfg, B, G,
                                                        args.repeats, pad_id)
    if {"logprob", "train", "split", "chunking"} & set(sections):
        full = generate_rollout(model, tokenizer, prompts[:B], G,
                                SamplingParams(cfg.rollout.max_new_tokens, cfg.rollout.temperature, ignore_eos=True),
                                mx.random.key(cfg.run.seed))
        if "logprob" in sections:
            result["logprob"] = bench_logprob(model, full, cfg, args.repeats, pad_id)
        if "train" in sections:
            result["train"] = bench_train(model, full, cfg, args.repeats, pad_id)
        if "split" in sections:
            result["split"] = train_split.bench_split(model, [step_data(full, cfg.run.seed)], cfg, args.repeats, pad_id)
        if "chunking" in sections:
            result["chunking"] = train_split.bench_chunking(model, [step_data(full, cfg.run.seed)], cfg,
                                                            parse_sizes(args.chunkings), args.repeats, pad_id)
    if "memory" in sections:
        rows, length = (int(x) for x in args.memory_shape.lower().split("x"))
        budgets = [int(x) for x in args.memory_budgets.split(",") if x] or [cfg.training.micro_batch_tokens]
        result["memory"] = bench_memory(model, prompts, rows, length, cfg, pad_id, budgets)
    del model
    if "step" in sections:
        result["step"] = bench_step(cfg, args.repeats, args.warmup)

    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"grpo_bench-{dt.datetime.now():%Y%m%d-%H%M%S}.json"
    path.write_text(json.dumps(result, indent=2, default=float))
    print()
    print(markdown(result))
    print()
    for line in ratios(result):
        print(line)
    print(f"\nJSON: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
