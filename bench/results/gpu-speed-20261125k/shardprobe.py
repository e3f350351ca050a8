"""Session 23 probe: does splitting one rollout's rows across rollout processes decode it faster?

The standard workload (16 GSM8K prompts x 16, <= 256 tokens, EOS on, bf16) decoded (a) in this process by
the engine, (b) by N rollout processes (rollout/process.py's RolloutProcess), each given a contiguous share
of the prompt groups with their row keys, all at once from threads. Wall seconds per rollout, medians of
runs 2..R; each worker's own seconds; tokens compared row by row with (a).
Usage (repository root's src/ on PYTHONPATH, from bench/): python shardprobe.py DATA 1,2,4 [repeats [model]]"""
import statistics
import sys
import threading
import time

import mlx.core as mx
import numpy as np
from grpo_bench import encode_prompts
from mlx_grpo.config import build_config, parse_set
from mlx_grpo.data import load_examples
from mlx_grpo.models.loading import load_model
from mlx_grpo.rollout.engine import RolloutEngine
from mlx_grpo.rollout.process import RolloutProcess
from mlx_grpo.rollout.records import SamplingParams
from mlx_grpo.training.draws import row_keys


def main():
    data, counts = sys.argv[1], [int(x) for x in sys.argv[2].split(",")]
    repeats = int(sys.argv[3]) if len(sys.argv) > 3 else 5
    model_name = sys.argv[4] if len(sys.argv) > 4 else None  # a tiny model for a CPU dry run
    cfg = build_config("train", overrides=parse_set([f"dataset_path={data}"] + ([f"model_name={model_name}"] if model_name else [])))
    model, tok = load_model(cfg.model.model_name, "bfloat16")
    ex = load_examples(cfg.data.dataset, "train", cfg.data.dataset_path, cfg.run.seed)
    prompts, G = encode_prompts(tok, ex[:16], cfg), 16
    params = SamplingParams(256, 1.0)
    outs = {}
    for draw in range(repeats):
        keys = row_keys(cfg.run.seed, draw, len(prompts) * G, slice(0, len(prompts) * G))
        mx.eval(keys)
        outs[draw] = keys
    engine = RolloutEngine(tok, mode="copy").refresh(model)
    walls, ref = [], {}
    for draw in range(repeats):
        mx.synchronize()
        t0 = time.perf_counter()
        r = engine.generate_many([(prompts, outs[draw])], G, params)[0]
        mx.eval(r.arrays)
        walls.append(time.perf_counter() - t0)
        ref[draw] = r
    print(f"in-process: {', '.join(f'{w:.3f}' for w in walls)} s; median of 2..: "
          f"{statistics.median(walls[1:]):.3f} s; tokens {sum(ref[d].lengths.sum() for d in ref) // repeats}/rollout",
          flush=True)
    weights = model.parameters()
    for n in counts:
        t_start = time.perf_counter()
        procs = [RolloutProcess(model, tok, "copy", False) for _ in range(n)]
        bounds = np.linspace(0, len(prompts), n + 1).round().astype(int)
        walls, own, same = [], [], []
        for draw in range(repeats):
            results = [None] * n

            def job(i, draw=draw):
                lo, hi = bounds[i], bounds[i + 1]
                results[i] = procs[i].sample(weights, [(prompts[lo:hi], outs[draw][lo * G:hi * G])], G, params, "")

            threads = [threading.Thread(target=job, args=(i,)) for i in range(n)]
            t0 = time.perf_counter()
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            walls.append(time.perf_counter() - t0)
            own.append([s for _, s in results])
            # rows whose tokens equal the in-process rollout's
            eq = 0
            for i, (rs, _) in enumerate(results):
                lo = bounds[i]
                a = np.array(rs[0].completion_ids.tolist())
                b = np.array(ref[draw].completion_ids.tolist())[lo * G:lo * G + a.shape[0]]
                m = np.array(rs[0].mask.tolist()) > 0
                w = min(a.shape[1], b.shape[1])
                eq += sum(bool((a[k, :w][m[k, :w]] == b[k, :w][m[k, :w]]).all()) for k in range(a.shape[0]))
            same.append(eq)
        for p in procs:
            p.stop(busy=False)
            p.release()
        print(f"{n} process(es): {', '.join(f'{w:.3f}' for w in walls)} s; median of 2..: "
              f"{statistics.median(walls[1:]):.3f} s; workers' own s (run 2): "
              f"{', '.join(f'{s:.3f}' for s in own[1])}; rows equal to in-process: {same}; "
              f"set-up + all runs {time.perf_counter() - t_start:.1f} s", flush=True)


if __name__ == "__main__":
    main()
