"""grpo_bench's rollout section: generated tokens/s of B x G sampled completions through each decode path,
against a plain mlx-lm decode loop run in the same process on the same model and rows.

Variants (ROLLOUT_VARIANTS):
  engine            mlx_grpo.rollout.engine.RolloutEngine as the trainer builds it: the fused sampling copy, one
                    compiled graph per decode step, ended rows dropped from the batch (compaction)
  engine_nocompact  the same engine with compact=False: every row decodes until all have ended
  engine_graph      the engine with decode_graph = true (models/compiled_decode.py: the step with fewer primitives)
  model             rollout.generate_rollout on the model itself (the loop before the engine: fixed-capacity
                    cache with the CUDA decode-attention kernel where it serves the model)
each without EOS (every row decodes max_new_tokens: equal work) and with EOS stopping (real lengths),
plus the plain loop (every row prefilled, mlx-lm KVCache, categorical sampling, no stopping).
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from mlx_grpo.rollout.decode import generate_rollout
from mlx_grpo.rollout.engine import RolloutEngine
from mlx_grpo.rollout.rollout_records import SamplingParams

from bench_util import GB, timed


def plain_decode(model, rows: list[list[int]], max_new_tokens: int, temperature: float, pad_id: int) -> int:
    """The baseline: every row prefilled on its own (left-padded, no mask), then the model called step
    by step on an mlx-lm KV cache with categorical sampling and no stopping. -> tokens generated."""
    width = max(len(r) for r in rows)
    tokens = mx.array([[pad_id] * (width - len(r)) + r for r in rows], dtype=mx.int32)
    cache = make_prompt_cache(model)
    logits = model(tokens, cache=cache)[:, -1, :]
    y = mx.random.categorical(logits * (1 / temperature))
    out = [y]
    for _ in range(max_new_tokens - 1):
        logits = model(y[:, None], cache=cache)[:, -1, :]
        y = mx.random.categorical(logits * (1 / temperature))
        mx.async_eval(y)
        out.append(y)
    mx.eval(out)
    return len(rows) * max_new_tokens


def make_sampler_fn(name: str, model, tokenizer):
    """-> generate(prompts, group_size, params, key) -> Rollout for variant `name`, plus what it runs on."""
    if name == "model":
        return (lambda prompts, g, params, key: generate_rollout(model, tokenizer, prompts, g, params, key)), \
            {"uses_copy": False}
    engine = RolloutEngine(tokenizer, mode="copy", compact=name != "engine_nocompact",
                           graph=name == "engine_graph").refresh(model)
    return engine.generate, {"uses_copy": engine.uses_copy, "engine": engine}


ROLLOUT_VARIANTS = {
    "engine": "engine (fused copy, compiled step, compaction)",
    "engine_nocompact": "engine without compaction",
    "engine_graph": "engine with decode_graph (models/compiled_decode.py: fewer primitives)",
    "model": "generate_rollout on the model (static cache, decode kernel on CUDA)",
}


def bench_rollout(model, tokenizer, prompts, sizes, cfg, repeats, pad_id) -> list[dict]:
    samplers = {name: make_sampler_fn(name, model, tokenizer) for name in ROLLOUT_VARIANTS}
    out = []
    for b, g in sizes:
        batch = (prompts * (b // len(prompts) + 1))[:b]
        row = {"B": b, "G": g, "N": b * g}
        for name, (generate, info) in samplers.items():
            row[f"{name}_uses_copy"] = info["uses_copy"]
            for eos in (False, True):
                mx.reset_peak_memory()
                params = SamplingParams(cfg.rollout.max_new_tokens, cfg.rollout.temperature, ignore_eos=not eos)
                key = mx.random.key(cfg.run.seed)
                sec, r = timed(lambda: generate(batch, g, params, key), repeats)
                tag = f"{name}_{'eos' if eos else 'noeos'}"
                row[f"{tag}_tokens"] = int(r.lengths.sum())
                row[f"{tag}_steps"] = int(r.completion_ids.shape[1])
                row[f"{tag}_s"] = sec
                row[f"{tag}_tok_s"] = r.lengths.sum() / sec
                row[f"{tag}_peak_gb"] = mx.get_peak_memory() / GB  # process peak (weights included)
                if "engine" in info:
                    row[f"{tag}_row_steps"] = info["engine"].row_steps
        rows = [p for p in batch for _ in range(g)]
        sec, n_tokens = timed(lambda: plain_decode(model, rows, cfg.rollout.max_new_tokens, cfg.rollout.temperature,
                                                   pad_id), repeats)
        row["plain_s"], row["plain_tok_s"] = sec, n_tokens / sec
        for name in ROLLOUT_VARIANTS:
            row[f"ratio_{name}_vs_plain"] = row[f"{name}_noeos_tok_s"] / row["plain_tok_s"]
        print(f"rollout {b}x{g}, no EOS: " + ", ".join(f"{name} {row[f'{name}_noeos_tok_s']:.0f}"
                                                     for name in ROLLOUT_VARIANTS)
              + f", plain loop {row['plain_tok_s']:.0f} tok/s; with EOS: "
              + ", ".join(f"{name} {row[f'{name}_eos_s']:.2f} s" for name in ROLLOUT_VARIANTS), flush=True)
        out.append(row)
    return out


def markdown_rows(rows: list[dict]) -> list[str]:
    lines = []
    for r in rows:
        size = f"{r['B']}x{r['G']}"
        for name, label in ROLLOUT_VARIANTS.items():
            lines.append(f"| rollout {size} tok/s, no EOS: {label} | {r[f'{name}_noeos_tok_s']:,.0f} | "
                         f"{r['plain_tok_s']:,.0f} (plain loop) | {r[f'ratio_{name}_vs_plain']:.2f}x |")
        lines.append(f"| rollout {size} peak memory, engine, no EOS (weights included) | "
                     f"{r['engine_noeos_peak_gb']:.2f} GB | | |")
        for name, label in ROLLOUT_VARIANTS.items():
            lines.append(f"| rollout {size} s, EOS stopping: {label} ({r[f'{name}_eos_tokens']} tokens in "
                         f"{r[f'{name}_eos_steps']} steps) | {r[f'{name}_eos_s']:.2f} | | |")
    return lines


def ratio_lines(rows: list[dict]) -> list[str]:
    return [f"rollout {r['B']}x{r['G']} vs plain decode loop: engine {r['ratio_engine_vs_plain']:.2f}x, "
            f"model {r['ratio_model_vs_plain']:.2f}x" for r in rows]


def bench_refill(model, tokenizer, prompts, cfg, steps: int, b: int, g: int, ends: list[str], repeats: int) -> dict:
    """An update of `steps` batch steps of b x g rows: RolloutEngine.generate_many (the later steps'
    prompts refill slots freed by ended rows) against generating the steps one after another, same row
    keys, so both sample the same tokens (checked). `ends`: strings that also end a row, so that most
    rows end early and a few run long, as in the issue's case of one long row holding a batch."""
    from short_answers import EndsAt, given_ends

    short_tok = EndsAt(tokenizer, given_ends(tokenizer, ends)) if ends else tokenizer
    engine = RolloutEngine(short_tok, mode="copy").refresh(model)
    params = SamplingParams(cfg.rollout.max_new_tokens, cfg.rollout.temperature)
    jobs = [((prompts * (steps * b // len(prompts) + 1))[i * b:(i + 1) * b],
             mx.random.split(mx.random.key(cfg.run.seed + i), b * g)) for i in range(steps)]
    one_by_one = lambda: [engine.generate(p, g, params, k) for p, k in jobs]  # noqa: E731
    sec_alone, alone = timed(one_by_one, repeats)
    steps_alone = 0
    for p, k in jobs:
        engine.generate(p, g, params, k)
        steps_alone += engine.steps
    sec_together, together = timed(lambda: engine.generate_many(jobs, g, params), repeats)
    pairs = [(x, y) for a, t in zip(alone, together) for x, y in zip(a.texts, t.texts)]
    same = all(x == y for x, y in pairs)
    # on a GPU a row's logits can move in the last bits with the batch's row count (bf16 matmuls), and a
    # near-tie then picks another token: the share of rows whose text is unchanged says how often
    row = {"batch_steps": steps, "B": b, "G": g, "ends": ends, "same_texts": same,
           "same_rows_fraction": sum(x == y for x, y in pairs) / len(pairs),
           "mean_length": float(sum(r.lengths.sum() for r in alone) / (steps * b * g)),
           "max_length": int(max(r.lengths.max() for r in alone)),
           "one_by_one_s": sec_alone, "one_by_one_steps": steps_alone,
           "together_s": sec_together, "together_steps": engine.steps, "ratio": sec_together / sec_alone}
    print(f"refill, {steps} batch steps of {b}x{g}: together {sec_together:.2f} s ({engine.steps} decode steps) vs "
          f"one by one {sec_alone:.2f} s ({steps_alone} steps): {row['ratio']:.2f}x; mean length "
          f"{row['mean_length']:.1f}, max {row['max_length']}; rows with the same text: "
          f"{row['same_rows_fraction']:.1%}", flush=True)
    return row


def bench_overlap(model, tokenizer, prompts, cfg, b: int, g: int, repeats: int, pad_id: int) -> dict:
    """The issue's overlap question: one batch step's rollout decoding while the previous step's log-prob
    pass runs (a second thread on its own MLX stream), against the two one after the other."""
    import threading

    from mlx_grpo.training.policy import logprob_pass

    engine = RolloutEngine(tokenizer, mode="copy").refresh(model)
    params = SamplingParams(cfg.rollout.max_new_tokens, cfg.rollout.temperature)
    previous = engine.generate(prompts[:b], g, params, mx.random.key(cfg.run.seed))
    nxt = (prompts * 2)[b:2 * b]

    def logprobs():
        return logprob_pass(model, previous, cfg.rollout.temperature, cfg.training.micro_batch_size, pad_id,
                            cfg.training.micro_batch_tokens)

    def rollout():
        return engine.generate(nxt, g, params, mx.random.key(cfg.run.seed + 1))

    sec_lp, want = timed(logprobs, repeats)
    sec_roll, _ = timed(rollout, repeats)
    sec_seq, _ = timed(lambda: (logprobs(), rollout()), repeats)
    out = {}

    def both():
        def side():
            try:  # MLX streams belong to the thread that makes them
                with mx.stream(mx.new_stream(mx.default_device())):
                    out["lp"] = logprobs()
            except Exception as exc:  # noqa: BLE001 - reported below
                out["error"] = exc
        thread = threading.Thread(target=side)
        thread.start()
        rollout()
        thread.join()
        if "error" in out:
            raise out.pop("error")

    row = {"B": b, "G": g, "logprob_s": sec_lp, "rollout_s": sec_roll, "sequential_s": sec_seq}
    try:
        row["overlapped_s"], _ = timed(both, repeats)
        row["same_logprobs"] = bool(mx.allclose(out["lp"], want).item())
        row["ratio"] = row["overlapped_s"] / sec_seq
        print(f"overlap {b}x{g}: rollout {sec_roll:.2f} s + log-probs {sec_lp:.2f} s: sequential {sec_seq:.2f} s, "
              f"overlapped {row['overlapped_s']:.2f} s ({row['ratio']:.2f}x); same log-probs: "
              f"{row['same_logprobs']}", flush=True)
    except Exception as exc:  # noqa: BLE001 - the finding is that it does not run
        row["error"] = f"{type(exc).__name__}: {exc}"
        print(f"overlap {b}x{g}: failed: {row['error']}", flush=True)
    return row
