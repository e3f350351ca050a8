"""Do a preset's rollouts carry the log-probs of the model that sampled them? Rollouts of the first B prompts of a
preset's data (tools included) through the rollout engine as the trainer calls it, then, row by row, the model's
own forward over prompt + completion (the environment's tokens included, as the sampler's context held them):
the mean and largest |sampler log-prob - forward log-prob| over the model's tokens. In float32 on a CPU they agree to
rounding; in bfloat16 on a GPU each row's mean stays near 0.05. A row far above that decoded from a cache that did
not hold its context (a wrong slot, a write lost or out of place), whatever its text looks like.

Checked rows: the batch's first, second, middle and last rows, the row 200 before the end, and up to --called rows
that called a tool (their later turns decode on kept caches). Exits 1 when a row's mean is above --limit.

usage: python bench/sampler_check.py [--config configs/prod_tools.toml] [--sizes 16,64] [--set key=value ...]
                                     [--called 6] [--limit 0.3] [--out result.json]
Session 34 (H200, the base model, configs/prod_tools.toml, --sizes 16,48,64): 256 rows all near 0.05; at 768 rows all
six checked rows that called the calculator were off, at 1,024 rows five of six (0.50-3.42; the sixth presumably admitted
in place): their next turns were appended to a cache over 2^31 elements by MLX's concatenation. After the fix
(copy_decoder.placed) those of 768 rows are at 0.036-0.050 (bench/records/h200-session34-20261128/README.md).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from mlx_grpo.config import build_config, parse_set  # noqa: E402
from mlx_grpo.data.examples import load_examples  # noqa: E402
from mlx_grpo.models.forward import token_logprobs  # noqa: E402
from mlx_grpo.models.model_loading import load_model  # noqa: E402
from mlx_grpo.rollout.engine import RolloutEngine  # noqa: E402
from mlx_grpo.rollout.multiturn import encode_prompts, multiturn_for, rollouts, tool_use  # noqa: E402
from mlx_grpo.rollout.rollout_records import SamplingParams  # noqa: E402

from bench_util import device_name  # noqa: E402


def forward_logprobs(model, prompt: list[int], completion: list[int], temperature: float) -> np.ndarray:
    """log p(completion[t] | prompt, completion[:t]) under logits / temperature, one forward, float32."""
    logits = model(mx.array([prompt + completion]))[0, len(prompt) - 1:-1]
    return np.array(token_logprobs(logits, mx.array(completion), temperature))


def check(cfg, model, tokenizer, B: int, called: int, seed: int) -> dict:
    """One rollout of the data's first B prompts x G; the rows' disagreement with the forward."""
    d, G = cfg.data, cfg.rollout.num_generations
    examples = load_examples(d.dataset, "train", d.dataset_path or None, cfg.run.seed,
                             arith_max_steps=d.arith_max_steps)[:B]
    engine = RolloutEngine(tokenizer, mode=cfg.rollout.rollout_engine, graph=cfg.rollout.decode_graph).refresh(model)
    multiturn = multiturn_for(cfg, tokenizer, getattr(getattr(model, "args", None), "model_type", None))
    T, temperature = cfg.rollout.max_new_tokens, cfg.rollout.temperature
    r = cfg.rollout
    params = SamplingParams(T, temperature, top_p=r.top_p, top_k=r.top_k, min_p=r.min_p, stop=tuple(r.stop))
    prompts = [ids for ids, _ in encode_prompts(multiturn, tokenizer, examples, cfg)]
    keys = mx.random.split(mx.random.key(seed), len(examples) * G)
    t0 = time.perf_counter()
    rollout = rollouts(engine, multiturn, [(prompts, keys, examples)], G, params, cfg.data.prefill)[0]
    seconds = time.perf_counter() - t0
    ids, mask, lps = (np.array(a) for a in (rollout.completion_ids, rollout.mask, rollout.sampler_logprobs))
    calls = np.zeros(len(ids), int) if rollout.transcripts is None else tool_use(rollout.transcripts)[0]
    n = len(ids)
    rows = sorted({0, 1, n // 2, n - 1, max(0, n - 200), *np.flatnonzero(calls > 0)[:called].tolist()})
    out = []
    for row in rows:
        m = mask[row] > 0
        diff = np.abs(forward_logprobs(model, prompts[row // G], ids[row].tolist(), temperature or 1.0) - lps[row])[m]
        out.append({"row": int(row), "tool_calls": int(calls[row]), "tokens": int(m.sum()),
                    "mean": float(diff.mean()) if m.any() else 0.0, "max": float(diff.max()) if m.any() else 0.0})
    return {"prompts": B, "rows": n, "seconds": seconds, "tool_call_rate": float(np.mean(calls > 0)),
            "longest_prompt": max(len(p) for p in prompts), "checked": out}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="configs/prod_tools.toml")
    ap.add_argument("--sizes", default=[16, 64], type=lambda s: [int(b) for b in s.split(",")],
                    help="prompts per rollout (x num_generations rows), comma-separated")
    ap.add_argument("--set", dest="items", action="append", default=[], help="config key=value")
    ap.add_argument("--called", type=int, default=6, help="rows that called a tool checked besides the fixed ones")
    ap.add_argument("--limit", type=float, default=0.3, help="a row's mean |difference| above this fails")
    ap.add_argument("--seed", type=int, default=3)
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    cfg = build_config("train", args.config, parse_set(args.items))
    model, tokenizer = load_model(cfg.model.model_name, cfg.model.model_dtype)
    result = {"device": device_name(), "command": " ".join(sys.argv), "runs": []}
    bad = []
    for B in args.sizes:
        run = check(cfg, model, tokenizer, B, args.called, args.seed)
        result["runs"].append(run)
        rows = "  ".join(f"{c['row']}{'*' * min(c['tool_calls'], 3)}: {c['mean']:.3f}/{c['max']:.2f}" for c in run["checked"])
        print(f"{run['rows']} rows ({run['seconds']:.1f} s, {run['tool_call_rate']:.0%} called a tool; row*: its "
              f"calls): mean/max |sampler - forward| {rows}", flush=True)
        bad += [(run["rows"], c["row"]) for c in run["checked"] if not c["mean"] <= args.limit]  # NaN fails too
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))
    if bad:
        print(f"rows whose log-probs are not the model's: {bad}")
        sys.exit(1)


if __name__ == "__main__":
    main()
