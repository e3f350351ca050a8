"""grpo_bench's rollout section: generated tokens/s of B x G sampled completions through each decode path,
against a plain mlx-lm decode loop run in the same process on the same model and rows.

Variants (ROLLOUT_VARIANTS):
  engine            mlx_grpo.engine.RolloutEngine as the trainer builds it: the fused sampling copy, one
                    compiled graph per decode step, ended rows dropped from the batch (compaction)
  engine_nocompact  the same engine with compact=False: every row decodes until all have ended
  model             rollout.generate_rollout on the model itself (the loop before the engine: fixed-capacity
                    cache with the CUDA decode-attention kernel where it serves the model)
each without EOS (every row decodes max_new_tokens: equal work) and with EOS stopping (real lengths),
plus the plain loop (every row prefilled, mlx-lm KVCache, categorical sampling, no stopping).
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from mlx_grpo.engine import RolloutEngine
from mlx_grpo.rollout import SamplingParams, generate_rollout

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
    engine = RolloutEngine(tokenizer, mode="copy", compact=name == "engine").refresh(model)
    return engine.generate, {"uses_copy": engine.uses_copy, "engine": engine}


ROLLOUT_VARIANTS = {
    "engine": "engine (fused copy, compiled step, compaction)",
    "engine_nocompact": "engine without compaction",
    "model": "generate_rollout on the model (static cache, decode kernel on CUDA)",
}


def check_attention_kernel() -> dict:
    """The CUDA decode kernel against MLX's masked attention in float32 on random left-padded rows, for
    each head dim it serves."""
    from mlx_grpo.models.decode_attention import HEAD_DIMS, kernel_available, left_padded_attention

    if not kernel_available():
        return {"kernel": False}
    mx.random.seed(0)
    errors = {}
    for D in HEAD_DIMS:
        N, Hq, Hkv, S, stop = 64, 9, 3, 300, 211
        q = mx.random.normal((N, Hq, 1, D)).astype(mx.bfloat16)
        k = mx.random.normal((N, Hkv, S, D)).astype(mx.bfloat16)
        v = mx.random.normal((N, Hkv, S, D)).astype(mx.bfloat16)
        start = mx.random.randint(0, 150, (N,))
        pos = mx.arange(S)
        mask = ((pos >= start[:, None]) & (pos < stop))[:, None, None, :]
        ref = mx.fast.scaled_dot_product_attention(q.astype(mx.float32), k.astype(mx.float32),
                                                   v.astype(mx.float32), scale=D ** -0.5, mask=mask)
        got = left_padded_attention(q, k, v, D ** -0.5, start.astype(mx.int32), mx.array([stop], dtype=mx.int32))
        errors[D] = mx.abs(got.astype(mx.float32) - ref).max().item()
        print(f"decode attention kernel, head dim {D}, vs masked attention (float32): max abs error "
              f"{errors[D]:.2e}", flush=True)
        # bf16 output of values ~N(0, 1): a rounding error of ~2^-8 relative; anything larger is a bug
        if not errors[D] < 1e-2:
            raise SystemExit(f"decode attention kernel (head dim {D}) disagrees with masked attention: {errors[D]}")
    return {"kernel": True, "max_abs_error": errors}


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
                params = SamplingParams(cfg.max_new_tokens, cfg.temperature, ignore_eos=not eos)
                key = mx.random.key(cfg.seed)
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
        sec, n_tokens = timed(lambda: plain_decode(model, rows, cfg.max_new_tokens, cfg.temperature, pad_id), repeats)
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
