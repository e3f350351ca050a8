"""Rollouts with tools against the same rollouts without: seconds per batch of B prompts x G samples of a
preset's own data and prompts (by default configs/arith.toml, configs/arith_tools.toml with its tools off,
and configs/arith_tools.toml), through the
rollout engine as the trainer calls it (the sampling copy: later turns join the running batch) and through
the model path (rollout_engine = model: later turns in waves), with the share of completions that called a
tool and the mean completion length. Nothing is trained: the tool-call rate is the base model's.

usage: python bench/tools_bench.py [--plain configs/arith.toml] [--tools configs/arith_tools.toml]
                                   [--batches 3] [--draws 1] [--out result.json]

--draws N decodes N batch steps together in each timed pass, as the trainer decodes dynamic sampling's draws
(draws_per_pass), in a running batch of one step's rows or of `--set running_rows=R`.

--host profiles the host side of one tools batch on the sampling copy instead (cProfile): the seconds in the
decode loop's refills, stop-string checks, rows kept between syncs and turns handed over, per sync and per
refill. On a CPU with a tiny model that calls a tool (--caller writes one: the tests' bigram caller,
tests/caller_model.py, writing longer turns; its steps cost little) this is the host work a GPU rollout pays at every sync:
  python bench/tools_bench.py --host --caller --set batch_size=32 --set num_generations=8 --set max_tool_turns=6

--phases then runs one more batch of each preset on the copy with the loop's parts timed to the device's end
(bench/loop_phases.py): where a GPU rollout's seconds go (refill copies, admissions, turns handed over, sync waits).
--unsynced times the same parts on the host alone (no synchronization around them): where the one thread of an
unprofiled pass spends its time, waits for the device included. --answers inline takes the environment's steps on
the loop's thread instead of the tool pool (an experiment: the pool's threads share the interpreter with the loop
that dispatches the decode steps); --switch-interval S sets the interpreter's thread switch interval.
--lookahead N makes the copy's syncs read the rows as of N steps before them (the engine's lookahead), their
host work running while those steps are still on the device; with MLX's CUDA settings that let the host queue
whole steps (MLX_MAX_MB_PER_BUFFER, MLX_MAX_OPS_PER_BUFFER in the environment) this tests how much of it overlaps.
--cold starts each pass as a trainer's update leaves the engine (its copy rebuilt, MLX's buffer cache emptied).
--train-minutes M instead trains the tools preset for M minutes (`mlx-grpo train`, the --set items applied) with
every rollout's loop parts timed as --phases times them: the trainer's passes against the bench's.
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
from mlx_grpo.models.model_loading import load_model  # noqa: E402
from mlx_grpo.rollout.engine import RolloutEngine  # noqa: E402
from mlx_grpo.rollout.multiturn import encode_prompts, multiturn_for, rollouts, tool_use  # noqa: E402
from mlx_grpo.rollout.rollout_records import SamplingParams  # noqa: E402

from bench_util import device_name, mlx_settings, positive, timed  # noqa: E402
from loop_phases import phase_times, train_phases  # noqa: E402


def batches(cfg, n: int) -> list[list]:
    d, size = cfg.data, cfg.training.batch_size
    examples = load_examples(d.dataset, "train", d.dataset_path or None, cfg.run.seed,
                             arith_max_steps=d.arith_max_steps)
    return [examples[i * size:(i + 1) * size] for i in range(n)]


def run(cfg, model, tokenizer, mode: str, n: int, repeats: int, phases: bool = False, sync_every: int = 8,
        draws: int = 1, cold: bool = False, unsynced: bool = False, turn_wait: int = 8, lookahead: int = 0) -> dict:
    # copy-recompute: the sampling copy re-prefilling each later turn's whole context (before session 26);
    # copy-outside: the loop writing each step's keys/values outside the step (before session 30: a cache copy a step)
    # copy-rebuild: refills rebuilding the batch (compaction gather + concatenation), as before admit_into
    engine = RolloutEngine(tokenizer, mode=mode.split("-")[0], keep_turn_cache=mode != "copy-recompute",
                           graph=cfg.rollout.decode_graph, write_in_step=mode not in ("copy-outside", "copy-before"),
                           admit_in_place=mode not in ("copy-rebuild", "copy-before"),
                           sync_every=sync_every, rows=cfg.rollout.running_rows, turn_wait=turn_wait,
                           lookahead=lookahead).refresh(model)
    multiturn = multiturn_for(cfg, tokenizer, getattr(getattr(model, "args", None), "model_type", None))
    params = SamplingParams(cfg.rollout.max_new_tokens, cfg.rollout.temperature, stop=tuple(cfg.rollout.stop))
    G, out = cfg.rollout.num_generations, []

    def one(i: int, group: list[list]) -> list:  # a pass: `draws` batch steps decoded together
        if cold:  # as a trainer's update leaves the engine: its copy to rebuild, MLX's buffer cache emptied
            engine.refresh(model)
            mx.clear_cache()
        jobs = []
        for j, examples in enumerate(group):
            n_rows = len(examples) * G
            key = mx.random.split(mx.random.key(cfg.run.seed), n_rows * (i * draws + j + 1))[-n_rows:]
            jobs.append(([ids for ids, _ in encode_prompts(multiturn, tokenizer, examples, cfg)], key, examples))
        return rollouts(engine, multiturn, jobs, G, params, cfg.data.prefill)

    drawn = batches(cfg, n * draws)
    for i in range(n):
        began = time.time()  # wall clock: where the batch's passes (warm-up included) fall in a utilization trace
        mx.reset_peak_memory()
        seconds, outs = timed(lambda: one(i, drawn[i * draws:(i + 1) * draws]), repeats)
        calls = np.concatenate([np.zeros(len(r.texts)) if r.transcripts is None else tool_use(r.transcripts)[0]
                                for r in outs])
        lengths = np.concatenate([np.asarray(r.lengths) for r in outs])
        extents = np.concatenate([np.asarray(r.extents) for r in outs])
        out.append({"seconds": seconds, "rows": len(calls), "tool_call_rate": float(np.mean([c > 0 for c in calls])),
                    "tool_calls_mean": float(np.mean(calls)),
                    "length_mean": float(lengths.mean()), "extent_mean": float(extents.mean()),
                    # sampled tokens (tool output excluded) per second: the throughput the target compares
                    "tokens_per_s": float(lengths.sum()) / seconds,
                    "decode_steps": engine.steps, "row_steps": engine.row_steps,
                    "prefilled_tokens": getattr(engine, "prefilled_tokens", None), "wall": [began, time.time()],
                    "peak_memory_gb": mx.get_peak_memory() / 1e9})  # the model's weights included
    if phases:  # one more batch with each part of the loop timed to the device's end (phase_times)
        with phase_times(synchronize=not unsynced) as timer:
            t0 = time.perf_counter()
            one(0, drawn[:draws])
            timer["total_s"] = time.perf_counter() - t0
        timer["decode_steps"], timer["row_steps"] = engine.steps, engine.row_steps
        print(json.dumps(timer), flush=True)
        return {"uses_copy": engine.uses_copy, "batches": out, "phases": timer,
                "seconds_mean": float(np.mean([b["seconds"] for b in out])),
                "tokens_per_s": float(np.mean([b["tokens_per_s"] for b in out]))}
    return {"uses_copy": engine.uses_copy, "batches": out,
            "seconds_mean": float(np.mean([b["seconds"] for b in out])),
            "tokens_per_s": float(np.mean([b["tokens_per_s"] for b in out]))}


def stop_scan_cost(tokenizer, rows: int, T: int, sync_every: int, stops: tuple[str, ...]) -> dict:
    """Host seconds the decode loop's stop-string checks take over one rollout of `rows` rows of T random
    tokens checked every sync_every tokens (none holds a stop: every row is checked at every sync): whole
    rows through stop_cut (before session 8) against rollout.StopScanner's tails."""
    import time

    from mlx_grpo.rollout.sampler import StopScanner, stop_cut

    rng = np.random.default_rng(0)
    ids = rng.integers(1000, min(20000, len(tokenizer.get_vocab())), size=(rows, T)).tolist()
    t0 = time.perf_counter()
    for n in range(sync_every, T + 1, sync_every):
        for row in ids:
            stop_cut(tokenizer, row[:n], stops)
    whole = time.perf_counter() - t0
    scanner, t0 = StopScanner(tokenizer, stops), time.perf_counter()
    for n in range(sync_every, T + 1, sync_every):
        for r, row in enumerate(ids):
            scanner.cut(r, row[:n])
    tails = time.perf_counter() - t0
    return {"rows": rows, "tokens": T, "sync_every": sync_every, "whole_rows_s": whole, "tails_s": tails,
            "ratio": whole / tails}


class InlineExecutor:
    """--answers inline: multiturn's tool pool replaced by steps taken on the calling thread, each one's Future
    already done (its result or its exception)."""

    def __init__(self, *args, **kwargs):
        pass

    def submit(self, fn, *args, **kwargs):
        from concurrent.futures import Future

        future = Future()
        try:
            future.set_result(fn(*args, **kwargs))
        except BaseException as e:  # as the pool's worker: the future holds whatever the step raised
            future.set_exception(e)
        return future

    def shutdown(self, *args, **kwargs):
        pass


# The decode loop's host parts (--host): label -> the functions (file, name) whose cumulative seconds add up to it
# (the names before and after issue 47's and issue 46's changes, so one command times both)
HOST_PARTS = {"refills": [("rollout/engine.py", "_refill"), ("rollout/copy_decoder.py", "admit"),
                          ("rollout/copy_decoder.py", "admit_into")],
              "stop checks": [("rollout/engine.py", "_stopped"), ("rollout/columns.py", "stopped")],
              "rows at syncs": [("rollout/columns.py", "update")],
              "turns handed over": [("rollout/turns.py", "report"), ("rollout/turns.py", "take")]}


def host_profile(cfg, model, tokenizer, repeats: int, sync_every: int = 8, turn_wait: int = 8,
                 lookahead: int = 0) -> dict:
    """One tools batch on the sampling copy: wall seconds (median of `repeats` after a warm-up), then the same
    batch under cProfile: seconds in each of HOST_PARTS, their calls, and the loop's syncs (Written.update calls)."""
    import cProfile
    import pstats

    engine = RolloutEngine(tokenizer, mode="copy", sync_every=sync_every, turn_wait=turn_wait,
                           lookahead=lookahead).refresh(model)
    multiturn = multiturn_for(cfg, tokenizer, getattr(getattr(model, "args", None), "model_type", None))
    params = SamplingParams(cfg.rollout.max_new_tokens, cfg.rollout.temperature, stop=tuple(cfg.rollout.stop))
    G, examples = cfg.rollout.num_generations, batches(cfg, 1)[0]
    key = mx.random.split(mx.random.key(cfg.run.seed), len(examples) * G)
    prompts = [ids for ids, _ in encode_prompts(multiturn, tokenizer, examples, cfg)]
    seconds, rollout = timed(lambda: rollouts(engine, multiturn, [(prompts, key, examples)], G, params,
                                              cfg.data.prefill)[0], repeats)
    prof = cProfile.Profile()
    prof.runcall(rollouts, engine, multiturn, [(prompts, key, examples)], G, params, cfg.data.prefill)
    stats = pstats.Stats(prof).stats  # (file, line, name) -> (primitive calls, calls, own s, cumulative s, callers)

    def part(functions) -> tuple[float, int]:
        hits = [v for (f, _, name), v in stats.items() for suffix, want in functions
                if f.endswith(suffix) and name == want]
        return sum(v[3] for v in hits), sum(v[1] for v in hits)

    total = part([("rollout/multiturn.py", "generate_many")])[0]
    parts = {label: part(fns) for label, fns in HOST_PARTS.items()}
    syncs, refills = parts["rows at syncs"][1], parts["refills"][1]
    calls = tool_use(rollout.transcripts)[0]
    return {"rows": len(rollout.texts), "tool_calls": int(calls.sum()), "tool_calls_max": int(calls.max()),
            "decode_steps": engine.steps, "seconds": seconds, "profiled_seconds": total, "syncs": syncs,
            "refills": refills, "parts_s": {k: v[0] for k, v in parts.items()},
            "host_per_sync_ms": 1e3 * sum(v[0] for v in parts.values()) / max(syncs, 1),
            "refill_ms": 1e3 * parts["refills"][0] / max(refills, 1)}


def write_caller(path: Path) -> Path:
    """The tests' tiny bigram llama (tests/caller_model.py) made to write like a reasoning model: runs of "x"
    (~30 tokens a turn) between calculator calls in nanochat's syntax, ~2 calls and ~100 tokens an episode."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from caller_model import END, write_caller_model

    return write_caller_model(path, {
        "\n": {"x": 1.0}, "x": {"x": 0.97, "<|python_start|>": 0.02, "5": 0.01}, "<|python_start|>": {"2": 1.0},
        "2": {"+": 1.0}, "+": {"3": 1.0}, "3": {"<|python_end|>": 0.7, "+": 0.3}, "<|output_end|>": {"x": 1.0},
        "5": {END: 1.0}})


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--plain", default="configs/arith.toml")
    ap.add_argument("--tools", default="configs/arith_tools.toml")
    ap.add_argument("--batches", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--modes", default="copy,model", help="copy, copy-recompute (later turns re-prefilled), "
                    "copy-outside (each step's keys/values written outside the step), copy-rebuild (refills rebuild the batch), "
                    "copy-before (both, as before session 30), model")
    ap.add_argument("--set", dest="items", action="append", default=[], help="config key=value for both presets")
    ap.add_argument("--stop-scan", action="store_true", help="only time the stop-string checks (host work)")
    ap.add_argument("--phases", action="store_true", help="then time the decode loop's parts over one more batch")
    ap.add_argument("--unsynced", action="store_true", help="with --phases: the parts timed on the host alone")
    ap.add_argument("--answers", choices=("pool", "inline"), default="pool",
                    help="inline: environments' steps on the loop's thread (an experiment)")
    ap.add_argument("--switch-interval", type=float, default=0, help="sys.setswitchinterval (seconds; 0: Python's)")
    ap.add_argument("--host", action="store_true", help="only profile one tools batch's host work on the copy")
    ap.add_argument("--caller", action="store_true", help="the model: the tests' tiny tool caller (for --host)")
    ap.add_argument("--sync-every", type=positive, default=8,
                    help="decode steps between the loop's syncs (the engine's 8; not with --train-minutes)")
    ap.add_argument("--turn-wait", type=positive, default=8,
                    help="the copy's next turns join once 1/N of the running batch is free (the engine's turn_wait, "
                         "8; the model mode decodes turns in waves; not with --train-minutes or --stop-scan)")
    ap.add_argument("--lookahead", type=int, default=0,
                    help="the copy's syncs read the rows as of N steps before, their host work beside those steps "
                         "on the device (the engine's lookahead, 0; below --sync-every; not with --train-minutes "
                         "or --stop-scan)")
    ap.add_argument("--presets", default="plain,prompt,tools", help="which of plain, prompt, tools to run")
    ap.add_argument("--draws", type=int, default=1, help="batch steps decoded together in each timed pass (the "
                    "trainer's draws_per_pass), in a running batch of --set running_rows=N rows")
    ap.add_argument("--cold", action="store_true", help="each pass starts as after a trainer's update: the engine's "
                    "copy rebuilt, MLX's buffer cache emptied (the trainer's mx.clear_cache)")
    ap.add_argument("--train-minutes", type=float, default=0,
                    help="train the tools preset this long with the loop's parts timed (phase_times)")
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    presets = args.presets.split(",")
    unknown = set(presets) - {"plain", "prompt", "tools"}
    if unknown:
        ap.error(f"--presets: unknown {sorted(unknown)}; choose from plain, prompt, tools")
    result = {"device": device_name(), "command": " ".join(sys.argv), "mlx_settings": mlx_settings(), "runs": {}}
    if args.train_minutes and (args.sync_every != 8 or args.turn_wait != 8 or args.lookahead):
        ap.error("--sync-every, --turn-wait and --lookahead set the bench's own engine, not the trainer's "
                 "(--train-minutes; the trainer's lookahead: --set lookahead=N)")
    if args.stop_scan and (args.turn_wait != 8 or args.lookahead):
        ap.error("--turn-wait and --lookahead move admissions: --stop-scan times stop checks alone")
    if not 0 <= args.lookahead < args.sync_every:
        ap.error(f"--lookahead {args.lookahead}: from 0 to --sync-every - 1 ({args.sync_every - 1})")
    if args.unsynced and not (args.phases or args.train_minutes):
        ap.error("--unsynced times the parts of --phases or --train-minutes: give one of them")
    if args.switch_interval:
        sys.setswitchinterval(args.switch_interval)
    if args.answers == "inline":
        import mlx_grpo.rollout.multiturn as multiturn_module
        multiturn_module.ThreadPoolExecutor = InlineExecutor
    if args.caller:
        import tempfile

        args.items.append(f"model_name={write_caller(Path(tempfile.mkdtemp()) / 'caller')}")
    if args.train_minutes:
        result["train"] = train_phases(build_config("train", args.tools, parse_set(
            args.items + [f"max_minutes={args.train_minutes}", "save_steps=0"])), not args.unsynced)
        print(json.dumps(result["train"]))
        if args.out:
            Path(args.out).write_text(json.dumps(result, indent=2))
        return
    if args.host:
        cfg = build_config("train", args.tools, parse_set(args.items))
        model, tokenizer = load_model(cfg.model.model_name, cfg.model.model_dtype)
        result["host"] = host_profile(cfg, model, tokenizer, args.repeats, args.sync_every, args.turn_wait,
                                      args.lookahead)
        print(json.dumps(result["host"], indent=1))
        if args.out:
            Path(args.out).write_text(json.dumps(result, indent=2))
        return
    if args.stop_scan:
        cfg = build_config("train", args.tools, parse_set(args.items))
        _, tokenizer = load_model(cfg.model.model_name, cfg.model.model_dtype)
        stops = multiturn_for(cfg, tokenizer).stop_strings
        result["stop_scan"] = stop_scan_cost(tokenizer, cfg.training.batch_size * cfg.rollout.num_generations,
                                             cfg.rollout.max_new_tokens, args.sync_every, stops)
        print(json.dumps(result["stop_scan"]))
        if args.out:
            Path(args.out).write_text(json.dumps(result, indent=2))
        return
    model = tokenizer = None
    # "prompt": the tools preset with its tools off (its system prompt, without the tools' description):
    # what the multi-turn machinery costs beyond the longer prompt and the answers it leads to
    variants = (("plain", args.plain, []), ("prompt", args.tools, ["tools=[]", "max_tool_turns=4"]),
                ("tools", args.tools, []))
    for name, preset, items in (v for v in variants if v[0] in presets):
        cfg = build_config("train", preset, parse_set(args.items + items))
        if model is None:
            model, tokenizer = load_model(cfg.model.model_name, cfg.model.model_dtype)  # the compute dtype, as training
        for mode in args.modes.split(","):
            result["runs"][f"{name}/{mode}"] = run(cfg, model, tokenizer, mode, args.batches, args.repeats,
                                                   args.phases and mode.startswith("copy"), args.sync_every,
                                                   args.draws, args.cold, args.unsynced, args.turn_wait,
                                                   args.lookahead)
            r = result["runs"][f"{name}/{mode}"]
            print(f"{name:5s} {mode:5s} copy={r['uses_copy']} {r['seconds_mean']:.3f} s/batch "
                  f"{r['tokens_per_s']:.0f} tok/s  "
                  + "  ".join(f"[{b['seconds']:.2f} s, calls {b['tool_call_rate']:.3f}, len {b['length_mean']:.0f}]"
                              for b in r["batches"]), flush=True)
    for mode in args.modes.split(","):
        for base in ("plain", "prompt"):
            if f"tools/{mode}" not in result["runs"] or f"{base}/{mode}" not in result["runs"]:
                continue
            ratio = result["runs"][f"tools/{mode}"]["seconds_mean"] / result["runs"][f"{base}/{mode}"]["seconds_mean"]
            result[f"ratio_tools_over_{base}/{mode}"] = ratio
            throughput = result["runs"][f"tools/{mode}"]["tokens_per_s"] / result["runs"][f"{base}/{mode}"]["tokens_per_s"]
            result[f"throughput_tools_over_{base}/{mode}"] = throughput
            print(f"{mode}: tools / {base} = {ratio:.2f}x the seconds, {throughput:.2f}x the tokens/s")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
