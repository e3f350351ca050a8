"""Where a rollout decode step's time goes, at 64, 256 and 1,024 rows: host graph building, dispatch, and
waiting for the device, next to the per-step time of the trainer's own pipelined loop.

A step builder (STEP_BUILDERS; --builders picks) prefills the rows and hands back a Decoder whose
`step()` builds one decode step's lazy graph (the model on the KV cache, then the sampler) and returns
the arrays to evaluate. "trainer" is mlx_grpo.rollout.decode.generate_rollout (the loop before the rollout
engine; what models without a sampling copy still use): each prompt prefilled once and its cache repeated
G times, then the fixed-capacity StaticBatchCache with the CUDA decode-attention kernel (through
models/kernel_forward.decode_step) where the kernel serves the model, mlx-lm's BatchKVCache elsewhere, the
compiled sampler. "engine" is mlx_grpo.rollout.engine.RolloutEngine's step, what the trainer now samples
with: the fused sampling copy, one compiled graph per step (model + sampler; it reads the cache), the token's
keys/values written into the cache outside it (the engine's way where the fused CUDA kernel does not serve:
a cache copy a step); "engine_inplace" the same with the kernel writing them in place (write_in_step), the
engine's way where it serves (the same as "engine" elsewhere). "graph" is the engine's step under decode_graph (models/compiled_decode.py), "graph_split"
the same without its fused RoPE + attention launch (the same as "graph" where the CUDA kernel does not serve).
All run with no EOS (every row decodes). Another decode step plugs in as another entry of STEP_BUILDERS.

Per row count, after --warmup steps, over --steps steps each (milliseconds per step, medians):
  build     wall time of building the step's graph, nothing evaluated (Python + MLX graph construction)
  dispatch  wall time of mx.async_eval on it (graph walk, kernel launches; returns before the device ends)
  wait      from async_eval's return until mx.eval returns: device work still running
  eval      dispatch + wait: from async_eval to completion
  serial    build + eval: one step with nothing overlapped
  steady    the trainer's loop: step i+1 built while step i runs (async_eval, a sync every 8 steps as
            rollout/loop.decode_rows does), total wall time / steps
  host %    (build + dispatch) / serial: the share of a serial step the host spends
and the primitives (graph nodes) of one step: mx.export_to_dot of its outputs, unique primitive nodes
(weights and the cache are evaluated inputs, not nodes), with a count per primitive type in the JSON.
The graph is the one the device runs: on a CPU, mx.fast's RMSNorm/RoPE/attention build their unfused
fallbacks, so it has more nodes than on a GPU, and "dispatch" includes compute run on the host.

    python bench/decode_profile.py --out bench-results                        # SmolLM2-135M, bf16
    python bench/decode_profile.py --shape qwen2.5-0.5b --out bench-results
    python bench/decode_profile.py --shape tiny-qwen2 --rows 4,8 --dtype float32 --steps 4 --warmup 2 \\
        --max-new-tokens 16 --out /tmp/profile.json                            # a CPU smoke run

Prints a markdown table; writes the JSON record to --out (a .json file, or a directory for
decode_profile-<time>.json). The timings are wall-clock timers, not a trace: for kernel-level detail run
the same command under `nsys profile`.
"""

from __future__ import annotations

import argparse
import datetime as dt
import sys
from pathlib import Path

from mlx_grpo.base.blas import use_optimized_blas
from mlx_grpo.base.errors import UserError

PROG = "decode_profile"
try:
    BLAS = use_optimized_blas()  # before mlx.core is imported, as the CLI does
except UserError as exc:
    print(f"{PROG}: error: {exc}", file=sys.stderr)
    raise SystemExit(2) from None

import re  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from collections import Counter  # noqa: E402
from functools import partial  # noqa: E402
from contextlib import contextmanager  # noqa: E402

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

import shapes  # noqa: E402
from bench_util import device_name, versions, write_record  # noqa: E402

DTYPES = ("float32", "bfloat16", "float16")


class Decoder:
    """One rollout's decode state. step() builds the next step's lazy graph and returns the arrays to
    evaluate, the last of them being what the loop synchronises on every `sync_every` steps."""

    def __init__(self, step, sync_every: int, info: dict):
        self._step, self.sync_every, self.info = step, sync_every, info
        self.index = 1  # the prefill's logits gave token 0

    def step(self) -> list[mx.array]:
        outputs = self._step(self.index)
        self.index += 1
        return outputs


@contextmanager
def trainer_step(model, prompts: list[list[int]], group: int, max_new_tokens: int, seed: int):
    """The decode step of mlx_grpo.rollout.decode.generate_rollout (default settings, ignore_eos, temperature 1,
    no top-k/top-p), from its own pieces; yields a Decoder over N = len(prompts) * group rows."""
    from mlx_grpo.rollout import decode as R
    from mlx_grpo.rollout.rollout_records import SamplingParams
    from mlx_grpo.rollout.sampler import make_sampler

    params = SamplingParams(max_new_tokens, 1.0, ignore_eos=True)
    eos = mx.array([-1], dtype=mx.int32)  # as generate_rollout with ignore_eos: no row ends
    logits, caches = R._prefill(model, prompts, pad_id=0)
    logits = mx.repeat(logits, group, axis=0)  # [N, V]
    n = logits.shape[0]
    row_keys = mx.random.split(mx.random.key(seed), n)
    plain = R.supports_static_cache(model)
    kernel = plain and R.kernel_serves(model, caches[0].keys.shape[-1])
    static = plain and kernel  # generate_rollout's default (static_cache=None)
    if static:
        caches = R._static_caches(caches, group, caches[0]._idx + max_new_tokens, True)
    else:
        R._repeat_caches(caches, group)
    forward = partial(R.decode_step, model) if static else model
    keys = mx.vmap(lambda k: mx.random.split(k, max_new_tokens))(row_keys)  # [N, T, 2]
    sampler = make_sampler(params, eos)
    state = list(sampler(logits, keys[:, 0], mx.zeros((n,), dtype=mx.bool_)))
    mx.eval(state, keys)

    def step(index: int) -> list[mx.array]:
        token, ended = state[0], state[3]
        out = forward(token[:, None], cache=caches)[:, -1, :]
        state[:] = sampler(out, keys[:, index], ended)  # token, logprob, entropy, ended
        return list(state)

    yield Decoder(step, sync_every=8, info={"cache": "StaticBatchCache" if static else "BatchKVCache",
                                            "attention_kernel": static})


def _prompt_batch(model, prompts: list[list[int]], max_new_tokens: int, graph: bool):
    """What both engine step builders start from: the engine with its sampling copy (decode_graph or not;
    the tokenizer is used only to end and decode rows), the sampling settings, and the prompts left-padded
    (pad id 0) to their bucket width. -> (engine, params, width, padding [B], tokens [B, width])."""
    from mlx_grpo.models.forward import bucket
    from mlx_grpo.rollout.engine import RolloutEngine
    from mlx_grpo.rollout.rollout_records import SamplingParams

    engine = RolloutEngine(None, mode="copy", graph=graph).refresh(model)
    if not engine.uses_copy:
        raise UserError(f"the engine has no sampling copy of this model ({type(model).__module__}): "
                        "no engine step to profile")
    params = SamplingParams(max_new_tokens, 1.0, ignore_eos=True)
    width = bucket(max(len(p) for p in prompts))
    padding = mx.array([width - len(p) for p in prompts], dtype=mx.int32)
    tokens = mx.array([[0] * (width - len(p)) + list(p) for p in prompts], dtype=mx.int32)
    return engine, params, width, padding, tokens


def _sampling_start(engine, params, logits, padding, group: int, max_new_tokens: int, seed: int,
                    write_cache: bool = False):
    """The rows' start offsets [N], per-step keys [T, N, 2], the sampler's first state (from the prefill's
    logits, each prompt's repeated G times) and the engine's compiled step."""
    from mlx_grpo.models import decoder as D
    from mlx_grpo.rollout.sampler import make_sampler

    start = mx.repeat(padding, group)
    logits = mx.repeat(logits, group, axis=0)
    n = logits.shape[0]
    row_keys = mx.random.split(mx.random.key(seed), n)
    step_keys = mx.vmap(lambda k: mx.random.split(k, max_new_tokens))(row_keys).transpose(1, 0, 2)  # [T, N, 2]
    eos = mx.array([-1], dtype=mx.int32)
    state = list(make_sampler(params, eos)(logits, step_keys[0], mx.zeros((n,), dtype=mx.bool_)))
    kernel = D.kernel_serves(engine.spec)
    return start, step_keys, state, kernel, engine.step_fn(params, (), kernel, write_cache)


@contextmanager
def engine_step(model, prompts: list[list[int]], group: int, max_new_tokens: int, seed: int,
                in_place: bool = False):
    """The decode step of mlx_grpo.rollout.engine.RolloutEngine (its defaults, ignore_eos, temperature 1), from the
    engine's own pieces as rollout/copy_decoder.CopyDecoder puts them together: the sampling copy's prefill
    (decoder.prefill, each prompt once, its cache repeated G times into buffers with room for every token,
    laid out as the step reads them), then per step the engine's compiled step (model step + sampler) and
    the new keys/values written into the cache outside it. No row ends, so compaction never drops one; yields a Decoder over N rows."""
    from mlx_grpo.models import decoder as D

    engine, params, width, padding, tokens = _prompt_batch(model, prompts, max_new_tokens, graph=False)
    spec, weights = engine.spec, engine.weights
    logits, keys, values = D.prefill(spec, weights, tokens, padding)  # per layer [B, Hkv, width, Dh]
    tail = [(0, 0), (0, 0), (0, max_new_tokens), (0, 0)]  # room for every generated token
    keys = [mx.repeat(mx.pad(k, tail), group, axis=0) for k in keys]  # lazy: [N, Hkv, width + T, Dh] per layer
    values = [mx.repeat(mx.pad(v, tail), group, axis=0) for v in values]
    writes = in_place and D.fused_serves(engine.spec, D.kernel_serves(engine.spec))
    start, step_keys, state, kernel, compiled = _sampling_start(engine, params, logits, padding, group,
                                                                max_new_tokens, seed, writes)
    # The cache layout is the step's: one buffer for all layers [layers, N, Hkv, S, Dh] or one per layer.
    # Tracing the step on the stacked buffer (lazily: nothing is computed) tells which: a per-layer step
    # reads the stacked buffer's slices just as well, and hands back its new keys as a list.
    stacked = mx.stack(keys), mx.stack(values)
    probe = compiled(weights, state[0], *stacked, width - start, start, mx.array([width], dtype=mx.int32),
                     step_keys[1], state[3])
    per_layer = isinstance(probe[4], (list, tuple))
    del probe
    if not per_layer:
        keys, values = stacked
    mx.eval(keys, values, step_keys, state)

    def step(index: int) -> list[mx.array]:
        idx = width + index - 1  # the slot the fed token (generated at index - 1) is written to
        token, ended = state[0], state[3]
        token, logprob, entropy, ended, new_k, new_v = compiled(
            weights, token, keys, values, idx - start, start, mx.array([idx], dtype=mx.int32), step_keys[index],
            ended)
        if per_layer and not writes:  # outside the compiled graph (writes: the fused kernel wrote them)
            for layer, (k, v) in enumerate(zip(new_k, new_v)):
                keys[layer][..., idx:idx + 1, :] = k
                values[layer][..., idx:idx + 1, :] = v
        elif not writes:
            keys[..., idx:idx + 1, :] = new_k
            values[..., idx:idx + 1, :] = new_v
        state[:] = [token, logprob, entropy, ended]
        return list(state)

    yield Decoder(step, sync_every=engine.sync_every, info={"cache": "engine (fused copy, compiled step)",
                                                            "attention_kernel": bool(kernel),
                                                            "cache_layout": "per layer" if per_layer else "stacked"})


@contextmanager
def graph_step(model, prompts: list[list[int]], group: int, max_new_tokens: int, seed: int, fuse: bool = True):
    """The engine's step under decode_graph = true (models/compiled_decode.py): 2-D hidden state, matrices
    stored transposed, the cache slot a device array the graph advances; the new keys/values written outside
    it at the loop's static slice, as the engine writes them. Otherwise as engine_step."""
    from mlx_grpo.models import compiled_decode as C
    from mlx_grpo.models import decoder as D

    engine, params, width, padding, tokens = _prompt_batch(model, prompts, max_new_tokens, graph=True)
    spec, weights = engine.spec, engine.weights
    logits, keys, values = D.prefill(spec, C.model_layout(weights), tokens, padding)
    tail = [(0, 0), (0, 0), (0, 0), (0, max_new_tokens), (0, 0)]
    keys = mx.repeat(mx.pad(mx.stack(keys), tail), group, axis=1)  # [layers, N, Hkv, width + T, Dh]
    values = mx.repeat(mx.pad(mx.stack(values), tail), group, axis=1)
    start, step_keys, state, kernel, compiled = _sampling_start(engine, params, logits, padding, group,
                                                                max_new_tokens, seed)
    if not fuse:  # graph_split: the same step with RoPE and attention as the default engine runs them
        from mlx_grpo.rollout.sampler import sample
        eos = mx.array([-1], dtype=mx.int32)  # ignore_eos, as _sampling_start's step
        compiled = C.make_step(spec, lambda logits, k: sample(logits, k, params), eos, kernel, fuse=False)
    n = start.shape[0]
    cache = [keys, values, mx.array([width], dtype=mx.int32), mx.ones((n,), dtype=mx.int32)]  # + slot, kstep
    mx.eval(cache, step_keys, state)

    def step(index: int) -> list[mx.array]:
        keys, values, slot, kstep = cache
        cache.clear()  # the old buffers' only owner is the write below (donated: written in place)
        token, logprob, entropy, ended, new_k, new_v, next_slot, kstep = compiled(
            weights, state[0], keys, values, slot, start, kstep, step_keys[index], state[3])
        idx = width + index - 1  # the fed token's slot (index counts from 1), as engine_step writes it
        keys[..., idx:idx + 1, :] = new_k  # static slice: in place, as the engine writes
        values[..., idx:idx + 1, :] = new_v
        cache[:] = [keys, values, next_slot, kstep]
        del keys, values
        state[:] = [token, logprob, entropy, ended]
        return list(state)

    yield Decoder(step, sync_every=engine.sync_every, info={"cache": "decode_graph (compiled_decode)",
                                                            "attention_kernel": bool(kernel),
                                                            "cache_layout": "stacked"})


def graph_split_step(model, prompts: list[list[int]], group: int, max_new_tokens: int, seed: int):
    """graph_step without its fused RoPE + attention launch: which part of decode_graph costs the GPU time."""
    return graph_step(model, prompts, group, max_new_tokens, seed, fuse=False)


def engine_in_place_step(model, prompts: list[list[int]], group: int, max_new_tokens: int, seed: int):
    """engine_step as the engine runs it where the fused kernel serves: the kernel writes each token's keys and
    values into the cache in place (write_in_step), where engine_step writes them outside (a copy a step)."""
    return engine_step(model, prompts, group, max_new_tokens, seed, in_place=True)


STEP_BUILDERS = {"trainer": trainer_step, "engine": engine_step, "engine_inplace": engine_in_place_step,
                 "graph": graph_step, "graph_split": graph_split_step}  # name -> context manager yielding a Decoder


def count_primitives(outputs: list[mx.array]) -> dict:
    """Unique primitive nodes of the graph that computes `outputs` (not yet evaluated), by type."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "step.dot"
        mx.export_to_dot(str(path), *outputs)
        text = path.read_text()
    nodes = dict(re.findall(r'\{ (\d+) \[label ="([^"]*)", shape=rectangle\]', text))
    kinds = Counter(nodes.values())
    return {"primitives": len(nodes), "by_type": dict(kinds.most_common())}


def profile(decoder: Decoder, warmup: int, steps: int) -> dict:
    for _ in range(warmup):  # kernel compiles, the sampler's trace, allocator growth
        mx.eval(decoder.step())
    # the trainer's loop: build step i+1 while step i runs on the device
    outputs = decoder.step()
    mx.eval(outputs)
    t0 = time.perf_counter()
    for _ in range(steps):
        if decoder.sync_every and decoder.index % decoder.sync_every == 0:
            mx.eval(outputs[-1])
        outputs = decoder.step()
        mx.async_eval(outputs)
    mx.eval(outputs)
    steady = (time.perf_counter() - t0) / steps
    # one step at a time, nothing overlapped: build | dispatch | wait
    build, dispatch, wait = [], [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        outputs = decoder.step()
        t1 = time.perf_counter()
        mx.async_eval(outputs)
        t2 = time.perf_counter()
        mx.eval(outputs)
        t3 = time.perf_counter()
        build.append(t1 - t0)
        dispatch.append(t2 - t1)
        wait.append(t3 - t2)
    try:
        graph = count_primitives(decoder.step())
    except Exception as exc:  # noqa: BLE001 - a primitive export_to_dot cannot print: keep the timings
        graph = {"primitives": None, "error": f"{type(exc).__name__}: {exc}"}
    ms = lambda xs: 1e3 * statistics.median(xs)  # noqa: E731
    serial = [b + d + w for b, d, w in zip(build, dispatch, wait)]
    return {"build_ms": ms(build), "dispatch_ms": ms(dispatch), "wait_ms": ms(wait),
            "eval_ms": ms([d + w for d, w in zip(dispatch, wait)]), "serial_ms": ms(serial),
            "steady_ms": 1e3 * steady, "host_share": statistics.median(
                (b + d) / s for b, d, s in zip(build, dispatch, serial)),
            "build_ms_mean": 1e3 * statistics.mean(build), "eval_ms_mean": 1e3 * statistics.mean(
                [d + w for d, w in zip(dispatch, wait)]), **graph}


def make_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    """n prompts of random ids, lengths spread over [length / 2, length]: rows with left padding."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(max(1, length // 2), length + 1, size=n)
    return [rng.integers(3, vocab, size=int(k)).tolist() for k in lengths]


def load(args):
    """-> (model, description)."""
    dtype = getattr(mx, args.dtype)
    if args.shape:
        return shapes.build(args.shape, dtype), f"{args.shape} (random weights)"
    from mlx_grpo.models.model_loading import load_model

    return load_model(args.model, args.dtype)[0], args.model


def markdown(result: dict) -> str:
    lines = ["| step | rows (BxG) | build ms | dispatch ms | wait ms | eval ms | serial ms | steady ms | "
             "steady tok/s | host % | primitives |", "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | "
             "---: | ---: | ---: |"]
    for r in result["rows"]:
        lines.append(f"| {r['builder']} | {r['rows']} ({r['B']}x{r['G']}) | {r['build_ms']:.2f} | "
                     f"{r['dispatch_ms']:.2f} | {r['wait_ms']:.2f} | {r['eval_ms']:.2f} | {r['serial_ms']:.2f} | "
                     f"{r['steady_ms']:.2f} | {r['steady_tok_s']:,.0f} | {100 * r['host_share']:.0f}% | "
                     f"{r['primitives'] if r['primitives'] is not None else 'n/a'} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct", help="model name or MLX directory")
    ap.add_argument("--shape", default="", choices=["", *shapes.SHAPES],
                    help="a random-weight model of this architecture instead of --model (bench/shapes.py)")
    ap.add_argument("--dtype", default="bfloat16", choices=DTYPES)
    ap.add_argument("--rows", default="64,256,1024", help="decode rows N = B x G, comma-separated")
    ap.add_argument("--group", type=int, default=16, help="G completions per prompt (B = N / G prompts)")
    ap.add_argument("--prompt-len", type=int, default=160, help="longest prompt; lengths spread over [1/2, 1]x")
    ap.add_argument("--max-new-tokens", type=int, default=256, help="the rollout's length: the cache capacity")
    ap.add_argument("--warmup", type=int, default=8)
    ap.add_argument("--steps", type=int, default=32, help="steps timed in each mode")
    ap.add_argument("--builders", default=",".join(STEP_BUILDERS), help=f"any of {', '.join(STEP_BUILDERS)}")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="bench-results", help="JSON file (*.json) or directory for the record")
    args = ap.parse_args(argv)
    builders = [b.strip() for b in args.builders.split(",") if b.strip()]
    if set(builders) - set(STEP_BUILDERS) or not builders:
        ap.error(f"--builders: choose from {', '.join(STEP_BUILDERS)}")
    try:
        rows = [int(x) for x in args.rows.split(",") if x.strip()]
    except ValueError:
        ap.error(f"--rows: comma-separated integers, got {args.rows!r}")
    needed = args.warmup + 2 * args.steps + 3
    if not rows or min(rows) < 1 or args.steps < 1 or args.warmup < 0 or args.group < 1:
        ap.error("--rows, --steps and --group must be positive, --warmup not negative")
    if args.max_new_tokens < needed:
        ap.error(f"--max-new-tokens {args.max_new_tokens} is shorter than the {needed} steps profiled "
                 "(warm-up + 2 x steps + 3)")
    try:
        return run(args, rows, builders, argv)
    except UserError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2


def run(args, rows: list[int], builders: list[str], argv) -> int:
    model, name = load(args)
    vocab = model.args.vocab_size
    result = {"date": dt.date.today().isoformat(), "device": device_name(), "versions": versions(), "blas": BLAS,
              "command": " ".join([Path(sys.argv[0]).as_posix()] + (argv if argv is not None else sys.argv[1:])),
              "workload": {"model": name, "dtype": args.dtype, "parameters": shapes.parameter_count(model),
                           "prompt_len": args.prompt_len, "max_new_tokens": args.max_new_tokens,
                           "warmup": args.warmup, "steps": args.steps, "group": args.group},
              "rows": []}
    print(f"device: {result['device']}; mlx {result['versions']['mlx']}, mlx-lm {result['versions']['mlx_lm']}; "
          f"model {name}, {args.dtype}", flush=True)
    for builder in builders:
        for n in rows:
            g = min(args.group, n)
            b = n // g
            if b * g != n:
                raise UserError(f"--rows {n} is not a multiple of --group {g}")
            prompts = make_prompts(b, args.prompt_len, min(vocab, 49152), args.seed)
            with STEP_BUILDERS[builder](model, prompts, g, args.max_new_tokens, args.seed) as decoder:
                r = {"builder": builder, "rows": n, "B": b, "G": g, **decoder.info,
                     **profile(decoder, args.warmup, args.steps)}
            r["steady_tok_s"] = n / (r["steady_ms"] / 1e3)
            print(f"{builder} {n} rows: build {r['build_ms']:.2f} + eval {r['eval_ms']:.2f} ms serial; steady "
                  f"{r['steady_ms']:.2f} ms/step ({r['steady_tok_s']:,.0f} tok/s); {r['primitives']} primitives",
                  flush=True)
            result["rows"].append(r)
            mx.clear_cache()
    out = write_record(args.out, "decode_profile", result)
    print()
    print(markdown(result))
    for r in result["rows"]:
        top = ", ".join(f"{k} {v}" for k, v in list(r.get("by_type", {}).items())[:6])
        print(f"{r['builder']} {r['rows']} rows, primitives per step by type: {top or r.get('error', 'n/a')}")
    print(f"\nJSON: {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
