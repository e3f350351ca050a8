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


def check_attention_kernel() -> dict:
    """The CUDA decode kernels against MLX's masked attention in float32 on random left-padded rows (bf16
    inputs), for each head dim they serve: the plain kernel; the log-sum-exp one, its output and lse, on a
    stacked cache; the fused one (RoPE, the cached slots and the token's own) and the key it returns."""
    from mlx_grpo.models.decode_attention import (HEAD_DIMS, fused_decode_attention, fused_split, kernel_available,
                                                  left_padded_attention, left_padded_attention_lse)

    if not kernel_available():
        return {"kernel": False}
    mx.random.seed(0)
    errors = {}
    f32 = mx.float32
    # 64 rows run the fused kernel with one warp per (row, head), 256 with its split (fused_split); 63 and 255
    # leave the last block part idle (warps past the rows must write nothing)
    splits = set()
    for D, N in [(D, N) for D in HEAD_DIMS for N in (64, 256, 63, 255)]:
        Hq, Hkv, S, stop, scale = 9, 3, 300, 211, D ** -0.5
        split = fused_split(N, Hq, D)[0]
        splits.add(split)
        q = mx.random.normal((N, Hq, 1, D)).astype(mx.bfloat16)
        k = mx.random.normal((2, N, Hkv, S, D)).astype(mx.bfloat16)
        v = mx.random.normal((2, N, Hkv, S, D)).astype(mx.bfloat16)
        start = mx.random.randint(0, 150, (N,)).astype(mx.int32)
        stop_a = mx.array([stop], dtype=mx.int32)
        pos = mx.arange(S + 1)
        mask = ((pos[:S] >= start[:, None]) & (pos[:S] < stop))[:, None, None, :]
        ref = mx.fast.scaled_dot_product_attention(q.astype(f32), k[1].astype(f32), v[1].astype(f32), scale=scale,
                                                   mask=mask)
        scores = mx.repeat(k[1].astype(f32), Hq // Hkv, axis=1) @ (q.astype(f32) * scale).transpose(0, 1, 3, 2)
        ref_lse = mx.logsumexp(mx.where(mask.transpose(0, 1, 3, 2), scores, -mx.inf), axis=2)  # [N, Hq, 1]
        plain = left_padded_attention(q, k[1], v[1], scale, start, stop_a)
        out, lse = left_padded_attention_lse(q, k, v, scale, start, stop_a, 1)
        # fused: the token's projections, RoPE'd at positions up to 400 with rotate-half angles pos * theta
        qkv = mx.random.normal((N, (Hq + 2 * Hkv) * D)).astype(mx.bfloat16)
        positions = mx.random.randint(150, 400, (N,)).astype(mx.int32)
        theta = (10000.0 ** (-mx.arange(0, D, 2) / D)).astype(f32)
        angle = positions[:, None, None].astype(f32) * theta
        def rope(x):  # [N, H, D] -> the kernel's rounding to bf16
            a, b = x[..., :D // 2].astype(f32), x[..., D // 2:].astype(f32)
            c, s_ = mx.cos(angle), mx.sin(angle)
            return mx.concatenate([a * c - b * s_, b * c + a * s_], axis=-1).astype(mx.bfloat16)
        heads = qkv.reshape(N, Hq + 2 * Hkv, D)
        q_r, k_r, v_new = rope(heads[:, :Hq]), rope(heads[:, Hq:Hq + Hkv]), heads[:, Hq + Hkv:]
        k_ext = mx.concatenate([k[1][:, :, :stop], k_r[:, :, None]], axis=2).astype(f32)
        v_ext = mx.concatenate([v[1][:, :, :stop], v_new[:, :, None]], axis=2).astype(f32)
        start_f = mx.concatenate([mx.array([stop], dtype=mx.int32), start[1:]])  # row 0: its own slot only
        own_mask = (pos[:stop + 1] >= start_f[:, None])[:, None, None, :]
        ref_fused = mx.fast.scaled_dot_product_attention(q_r[:, :, None].astype(f32), k_ext, v_ext, scale=scale,
                                                         mask=own_mask)
        fused, new_k, new_v = fused_decode_attention(qkv, k, v, start_f, stop_a, positions, theta, scale, Hq, 1)
        err = {"plain": mx.abs(plain.astype(f32) - ref).max().item(),
               "lse_out": mx.abs(out.astype(f32) - ref).max().item(),
               "lse": mx.abs(lse - ref_lse).max().item(),
               "fused": mx.abs(fused.astype(f32) - ref_fused).max().item(),
               "fused_key": (mx.abs(new_k[:, :, 0].astype(f32) - k_r.astype(f32))  # relative: keys reach ~5
                             / mx.maximum(mx.abs(k_r.astype(f32)), 1)).max().item(),
               "fused_value": mx.abs(new_v[:, :, 0].astype(f32) - v_new.astype(f32)).max().item()}
        errors[f"{D}x{N} split {split}"] = err
        print(f"decode attention kernels, head dim {D}, {N} rows, vs masked attention (float32): max abs error "
              + ", ".join(f"{name} {e:.2e}" for name, e in err.items()), flush=True)
        # bf16 values ~N(0, 1): rounding errors of ~2^-8 relative; anything larger is a bug
        if not all(e < 2e-2 for e in err.values()):  # a NaN fails too
            raise SystemExit(f"decode attention kernels (head dim {D}, {N} rows) disagree with masked attention: {err}")
    if len(splits) < 2:
        raise SystemExit(f"the attention check ran the fused kernel with SPLIT {splits} only: adjust its row counts")
    return {"kernel": True, "max_abs_error": errors}


def check_sampler_kernel() -> dict:
    """The CUDA keyed-bits sampler (rollout/keyed_bits.py) against MLX's own draws for the same keys: its
    Gumbel noise bit for bit against mx.random.gumbel, its tokens against the vmapped mx.random.categorical,
    over the vocabularies it meets (odd and even)."""
    from mlx_grpo.models.decode_attention import kernel_available
    from mlx_grpo.rollout.keyed_bits import categorical_from_bits, gumbel_from_bits, keyed_bits

    if not kernel_available():
        return {"kernel": False}
    agree, noise_equal = {}, {}
    for rows, vocab in ((256, 49152), (64, 151936), (300, 1001)):
        logits = mx.random.normal((rows, vocab), key=mx.random.key(vocab)) * 3
        keys = mx.random.split(mx.random.key(rows), rows)
        bits = keyed_bits(keys, vocab)
        noise = mx.vmap(lambda key: mx.random.gumbel(shape=(vocab,), key=key))(keys)
        noise_equal[f"{rows}x{vocab}"] = bool(mx.array_equal(noise, gumbel_from_bits(bits)).item())
        want = mx.vmap(lambda row, key: mx.random.categorical(row, key=key))(logits, keys)
        agree[f"{rows}x{vocab}"] = mx.mean(want == categorical_from_bits(logits, bits)).item()
    print("keyed sampler vs MLX, same keys: Gumbel noise equal " + ", ".join(f"{k} {v}" for k, v in noise_equal.items())
          + "; share of equal tokens " + ", ".join(f"{k} {v:.4f}" for k, v in agree.items()), flush=True)
    if min(agree.values()) < 1 or not all(noise_equal.values()):
        raise SystemExit(f"keyed sampler draws other noise or tokens than MLX: {noise_equal} {agree}")
    return {"kernel": True, "noise_equal": noise_equal, "equal_tokens": agree}


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
