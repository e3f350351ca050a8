"""grpo_bench's "short" section: rollout time follows generated tokens.

The issue's scenario, built from the real model's own samples: a batch of 256 rows whose mean answer is
~20 tokens, with exactly one row that runs to max_new_tokens (256), timed against the same 256 rows
decoding every token (ignore_eos). The target: the short batch takes <= 25% of the full one's time.

How the batch is built. The engine gives every row its own key, and a row's tokens depend only on its
prompt and that key (row keys [N, 2] can be passed as `key`). So:
  1. a pool of rows (--short-pool P x S: P prompts x S samples, row keys from mx.random.split) is sampled
     once with ignore_eos, every row to max_new_tokens;
  2. a set of very common tokens ("\\n", ".", " the", ...) is counted as end-of-sequence besides the real
     EOS (a tokenizer wrapper, EndsAt), and each pool row's length is read off its tokens: the first end
     token, included, else max_new_tokens. The set (CANDIDATE_ENDS, or --short-ends as given) is one
     with which the pool holds the scenario (a full-length row, and a batch mean within a token of
     --short-mean), the one whose median length is closest to --short-mean; if none does, more pools
     are drawn (up to `rounds` in all), then the closest median is taken anyway;
  3. the batch: one row that reached max_new_tokens (if none did, the longest row, and the record says
     so) plus the rows-1 others, a window of the pool sorted by length, whose mean makes the batch's
     mean closest to --short-mean;
  4. the batch (per-row prompts, group_size 1, its rows' keys [rows, 2]) decodes through the engine with
     the wrapper (EOS stopping at the ends), with ignore_eos (every row full length), through the engine
     without compaction (what a loop that keeps ended rows pays) and through generate_rollout on the model.
The measured rollout's own lengths are recorded next to the pool's prediction (bf16 rounding may differ
between batch shapes, so a row can end one token apart), with engine.row_steps (rows x decode steps
computed) for each engine run.
"""

from __future__ import annotations

import numpy as np
import mlx.core as mx

from mlx_grpo.rollout.decode import generate_rollout
from mlx_grpo.rollout.engine import RolloutEngine
from mlx_grpo.rollout.rollout_records import SamplingParams

from bench_util import timed

# Candidate extra end-of-sequence strings, from rare to common; each must encode as a single token.
CANDIDATE_ENDS = ([], ["\n\n"], ["\n"], ["."], ["\n", "."], ["\n", ".", ","], ["\n", ".", " the"],
                  ["\n", ".", " the", ","])
TARGET_RATIO = 0.25


class EndsAt:
    """The tokenizer with extra token ids counted as end-of-sequence; every other attribute (pad id,
    decode, chat template) is the wrapped tokenizer's."""

    def __init__(self, tokenizer, ends: set[int]):
        self._tokenizer = tokenizer
        self.eos_token_ids = set(tokenizer.eos_token_ids) | set(ends)

    def __getattr__(self, name):
        return getattr(self._tokenizer, name)


def single_token_ids(tokenizer, texts: list[str]) -> dict[str, int]:
    """The id of each text that encodes as exactly one token (others are left out)."""
    out = {}
    for text in texts:
        ids = tokenizer.encode(text, add_special_tokens=False)
        if len(ids) == 1:
            out[text] = ids[0]
    return out


def lengths_under(ids: np.ndarray, ends: set[int]) -> np.ndarray:
    """Each row's length if decoding stopped at the first id in `ends` (included): ids [N, T] -> [N]."""
    hit = np.isin(ids, list(ends))
    return np.where(hit.any(axis=1), hit.argmax(axis=1) + 1, ids.shape[1])


def choose_rows(lengths: np.ndarray, rows: int, mean: float, limit: int) -> tuple[np.ndarray, int, bool]:
    """Pick `rows` pool rows: one that reached `limit` (else the longest) and rows-1 others whose total
    brings the batch's mean closest to `mean`. -> (row indices sorted, the long row's index, reached)."""
    lengths = np.asarray(lengths)
    full = np.flatnonzero(lengths >= limit)
    reached = len(full) > 0
    long_row = int(full[0]) if reached else int(np.argmax(lengths))
    others = np.array([i for i in np.argsort(lengths, kind="stable") if i != long_row and lengths[i] < limit])
    if len(others) < rows - 1:
        raise ValueError(f"the pool has {len(others)} rows shorter than {limit} tokens; {rows - 1} are needed")
    sums = np.convolve(lengths[others], np.ones(rows - 1, dtype=np.int64), mode="valid")  # every window's total
    best = int(np.argmin(np.abs(sums + lengths[long_row] - mean * rows)))
    return np.sort(np.concatenate([[long_row], others[best:best + rows - 1]])), long_row, reached


def draw_pool(engine, prompts: list[list[int]], samples: int, limit: int, temperature: float, seed: int):
    """-> (token ids [P*S, limit] as numpy, row keys [P*S, 2]): every row decoded to `limit` (ignore_eos)."""
    keys = mx.random.split(mx.random.key(seed), len(prompts) * samples)
    rollout = engine.generate(prompts, samples, SamplingParams(limit, temperature, ignore_eos=True), keys)
    return np.array(rollout.completion_ids), keys


def given_ends(tokenizer, given: list[str]) -> set[int]:
    """The end ids of --short-ends (the real EOS included); every string must be one token."""
    found = single_token_ids(tokenizer, given)
    missing = [t for t in given if t not in found]
    if missing:
        raise ValueError(f"--short-ends: {missing} are not single tokens of this tokenizer")
    return set(tokenizer.eos_token_ids) | set(found.values())


def feasible(lengths: np.ndarray, rows: int, mean: float, limit: int) -> bool:
    """Whether the pool holds the scenario: a full-length row, and rows-1 others that bring the batch's mean
    to within one token of `mean`."""
    if not (lengths >= limit).any() or (lengths < limit).sum() < rows - 1:
        return False
    picked = choose_rows(lengths, rows, mean, limit)[0]
    return abs(float(lengths[picked].mean()) - mean) <= 1.0


def pick_ends(tokenizer, ids: np.ndarray, mean: float, rows: int, limit: int) -> tuple[list[str], set[int], bool]:
    """The candidate end strings for the pool `ids`, their ids (EOS included) and whether the pool holds the
    scenario with them: among the candidates that do, the one whose median length is closest to `mean`;
    if none does, the closest median overall."""
    eos = set(tokenizer.eos_token_ids)
    best = None
    for texts in CANDIDATE_ENDS:
        found = single_token_ids(tokenizer, texts)
        if len(found) < len(texts):
            continue
        ends = eos | set(found.values())
        lengths = lengths_under(ids, ends)
        ok = feasible(lengths, rows, mean, limit)
        rank = (not ok, abs(float(np.median(lengths)) - mean))
        if best is None or rank < best[0]:
            best = (rank, texts, ends, ok)
    if best is None:
        raise ValueError("none of the candidate end strings is a single token of this tokenizer: pass --short-ends")
    return best[1], best[2], best[3]


def bench_short(model, tokenizer, prompts: list[list[int]], cfg, repeats: int, pool: tuple[int, int],
                rows: int, mean: float, ends: list[str] | None = None, rounds: int = 3) -> dict:
    limit, temperature = cfg.rollout.max_new_tokens, cfg.rollout.temperature
    n_prompts, samples = pool
    pool_prompts = (prompts * (n_prompts // len(prompts) + 1))[:n_prompts]
    fixed = given_ends(tokenizer, ends) if ends else None  # checked before the pool is drawn
    engine = RolloutEngine(tokenizer, mode="copy").refresh(model)
    ids, keys = draw_pool(engine, pool_prompts, samples, limit, temperature, cfg.run.seed + 1)
    row_prompt = [p for p in pool_prompts for _ in range(samples)]
    drawn = 1
    while True:
        if ends:
            texts, end_ids = ends, fixed
            ok = feasible(lengths_under(ids, end_ids), rows, mean, limit)
        else:
            texts, end_ids, ok = pick_ends(tokenizer, ids, mean, rows, limit)
        if ok or drawn >= rounds:
            break
        more, more_keys = draw_pool(engine, pool_prompts, samples, limit, temperature, cfg.run.seed + 1 + drawn)
        ids, keys = np.concatenate([ids, more]), mx.concatenate([keys, more_keys])  # a larger pool
        row_prompt += row_prompt[:len(more)]
        drawn += 1
    lengths = lengths_under(ids, end_ids)
    picked, long_row, reached = choose_rows(lengths, rows, mean, limit)
    batch = [row_prompt[i] for i in picked]
    batch_keys = keys[mx.array(picked)]  # [rows, 2]
    record = {"pool_rows": len(lengths), "pool_rounds": drawn, "pool_holds_scenario": ok, "ends": texts,
              "end_ids": sorted(end_ids),
              "pool_median": float(np.median(lengths)), "pool_mean": float(lengths.mean()),
              "pool_full_rows": int((lengths >= limit).sum()), "rows": rows, "max_new_tokens": limit,
              "target_mean": mean, "long_row_reached_limit": reached,
              "predicted_mean": float(lengths[picked].mean()), "predicted_max": int(lengths[picked].max())}
    if not reached:
        print(f"short answers: no pool row reached {limit} tokens in {drawn} round(s); the longest "
              f"({int(lengths[long_row])} tokens) stands in for it", flush=True)
    short_tok = EndsAt(tokenizer, end_ids)
    short_params = SamplingParams(limit, temperature)
    full_params = SamplingParams(limit, temperature, ignore_eos=True)
    del engine
    runs = {"short": (True, short_params), "full": (True, full_params),  # name -> (compact, params)
            "short_nocompact": (False, short_params), "short_model": (None, short_params)}
    for name, (compact, params) in runs.items():
        eng = None if compact is None else RolloutEngine(short_tok, mode="copy", compact=compact).refresh(model)
        if eng is None:  # the loop before the engine, on the model itself
            generate = lambda: generate_rollout(model, short_tok, batch, 1, params, batch_keys)  # noqa: E731
        else:
            generate = lambda: eng.generate(batch, 1, params, batch_keys)  # noqa: E731
        sec, rollout = timed(generate, repeats)
        got = rollout.lengths
        record[f"{name}_s"] = sec
        record[f"{name}_mean"] = float(got.mean())
        record[f"{name}_max"] = int(got.max())
        record[f"{name}_full_rows"] = int((got >= limit).sum())
        record[f"{name}_tokens"] = int(got.sum())
        if eng is not None:
            record[f"{name}_row_steps"] = eng.row_steps
            record[f"{name}_uses_copy"] = eng.uses_copy
        if name == "short":
            record["matches_pool"] = int((got == lengths[picked]).sum())  # rows whose length the pool predicted
    record["ratio_short_vs_full"] = record["short_s"] / record["full_s"]
    record["ratio_nocompact_vs_full"] = record["short_nocompact_s"] / record["full_s"]
    record["ratio_model_vs_full"] = record["short_model_s"] / record["full_s"]
    record["target_ratio"] = TARGET_RATIO
    print(f"short answers ({rows} rows, ends {texts}): mean {record['short_mean']:.1f} tokens, max "
          f"{record['short_max']} ({record['short_full_rows']} full-length); engine {record['short_s']:.3f} s "
          f"({record['short_row_steps']} row-steps) vs every row {limit} tokens {record['full_s']:.3f} s "
          f"({record['full_row_steps']} row-steps): {record['ratio_short_vs_full']:.2f}x (target <= "
          f"{TARGET_RATIO}); without compaction {record['short_nocompact_s']:.3f} s, generate_rollout "
          f"{record['short_model_s']:.3f} s", flush=True)
    return record


def markdown_rows(r: dict) -> list[str]:
    size = f"{r['rows']} rows, mean {r['short_mean']:.1f} / max {r['short_max']} tokens"
    return [f"| short answers, {size}: engine s ({r['short_row_steps']:,} row-steps) | {r['short_s']:.3f} | "
            f"{r['full_s']:.3f} (every row {r['max_new_tokens']} tokens, {r['full_row_steps']:,} row-steps) | "
            f"{r['ratio_short_vs_full']:.2f}x |",
            f"| short answers, {size}: engine without compaction s ({r['short_nocompact_row_steps']:,} row-steps) | "
            f"{r['short_nocompact_s']:.3f} | {r['full_s']:.3f} | {r['ratio_nocompact_vs_full']:.2f}x |",
            f"| short answers, {size}: generate_rollout on the model s | {r['short_model_s']:.3f} | "
            f"{r['full_s']:.3f} | {r['ratio_model_vs_full']:.2f}x |"]


def ratio_line(r: dict) -> str:
    return (f"short answers (mean {r['short_mean']:.1f}, max {r['short_max']} of {r['max_new_tokens']}): "
            f"{r['ratio_short_vs_full']:.2f}x the time of every row at full length (target <= {TARGET_RATIO})"
            + ("" if r["long_row_reached_limit"] else "; no pool row reached the limit"))
