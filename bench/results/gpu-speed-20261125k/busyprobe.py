"""Session 23 probe: is the GPU busy during a decode step, or waiting on the host?

The standard workload's rollout (16 GSM8K prompts x 16, <= 256 tokens, EOS on, bf16) by the engine, in this
process: (1) nvidia-smi's utilization.gpu (the share of each sample period in which a kernel ran) sampled
every 50 ms over 4 rollouts; (2) one rollout traced with CUPTI through torch.profiler (kernels launched by
MLX included, if CUPTI sees them): the kernels' summed time, the union of their intervals (GPU busy), the
gaps, and the top kernels by time.
Usage (src/ and bench/ on PYTHONPATH): python busyprobe.py DATA OUTDIR [graph]"""
import json
import statistics
import subprocess
import sys
import time
from collections import defaultdict

import mlx.core as mx
from grpo_bench import encode_prompts
from mlx_grpo.config import build_config, parse_set
from mlx_grpo.data import load_examples
from mlx_grpo.models.loading import load_model
from mlx_grpo.rollout.engine import RolloutEngine
from mlx_grpo.rollout.records import SamplingParams
from mlx_grpo.training.draws import row_keys


def main():
    data, out = sys.argv[1], sys.argv[2]
    graph = len(sys.argv) > 3 and sys.argv[3] == "graph"
    cfg = build_config("train", overrides=parse_set([f"dataset_path={data}"]))
    model, tok = load_model(cfg.model.model_name, "bfloat16")
    ex = load_examples(cfg.data.dataset, "train", cfg.data.dataset_path, cfg.run.seed)
    prompts, G = encode_prompts(tok, ex[:16], cfg), 16
    params = SamplingParams(256, 1.0)
    engine = RolloutEngine(tok, mode="copy", graph=graph).refresh(model)

    def rollout(draw):
        keys = row_keys(cfg.run.seed, draw, len(prompts) * G, slice(0, len(prompts) * G))
        mx.eval(keys)
        mx.synchronize()
        t0 = time.time()
        r = engine.generate_many([(prompts, keys)], G, params)[0]
        mx.eval(r.arrays)
        mx.synchronize()
        return t0, time.time(), int(r.lengths.sum())

    for d in range(2):
        rollout(d)
    smi = subprocess.Popen(["nvidia-smi", "--query-gpu=timestamp,utilization.gpu", "--format=csv,noheader,nounits",
                            "-lms", "50"], stdout=open(f"{out}/util.csv", "w"))
    time.sleep(1.0)
    spans = [rollout(d) for d in range(2, 6)]
    time.sleep(0.5)
    smi.terminate()
    smi.wait()
    print(f"graph={graph}; rollouts: {', '.join(f'{b - a:.3f} s ({n} tokens)' for a, b, n in spans)}", flush=True)
    util = []
    for line in open(f"{out}/util.csv"):
        try:
            stamp, value = [x.strip() for x in line.split(",")]
            t = time.mktime(time.strptime(stamp.split(".")[0], "%Y/%m/%d %H:%M:%S")) + float("0." + stamp.split(".")[1])
            util.append((t, float(value)))
        except (ValueError, IndexError):
            continue
    inside = [u for t, u in util if any(a + 0.1 <= t <= b for a, b, _ in spans)]
    outside = [u for t, u in util if all(not (a - 0.2 <= t <= b + 0.2) for a, b, _ in spans)]
    print(f"utilization.gpu during rollouts: median {statistics.median(inside) if inside else 'n/a'}%, mean "
          f"{statistics.mean(inside) if inside else 'n/a'} over {len(inside)} samples; idle outside "
          f"{statistics.mean(outside) if outside else 'n/a'} over {len(outside)}", flush=True)
    try:
        import torch
        from torch.profiler import ProfilerActivity, profile
        torch.cuda.init()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            a, b, n = rollout(6)
        prof.export_chrome_trace(f"{out}/trace-{'graph' if graph else 'engine'}.json")
        events = json.load(open(f"{out}/trace-{'graph' if graph else 'engine'}.json"))["traceEvents"]
        kernels = sorted([(e["ts"], e["dur"], e["name"]) for e in events
                          if e.get("cat") in ("kernel", "Kernel") and "dur" in e])
        print(f"CUPTI: {len(kernels)} kernels in the traced rollout ({b - a:.3f} s wall, {n} tokens)", flush=True)
        if kernels:
            total = sum(d for _, d, _ in kernels)
            busy, end, gaps = 0.0, None, []
            for ts, d, _ in kernels:
                if end is None or ts > end:
                    if end is not None:
                        gaps.append(ts - end)
                    busy += d
                    end = ts + d
                elif ts + d > end:
                    busy += ts + d - end
                    end = ts + d
            span = kernels[-1][0] + kernels[-1][1] - kernels[0][0]
            print(f"  kernel time summed {total / 1e3:.1f} ms; GPU busy (union) {busy / 1e3:.1f} ms of a "
                  f"{span / 1e3:.1f} ms span ({100 * busy / span:.1f}%); gaps: {len(gaps)}, median "
                  f"{statistics.median(gaps) if gaps else 0:.2f} us, summed {sum(gaps) / 1e3:.1f} ms; "
                  f"kernels per decode step ~{len(kernels) / 256:.0f}", flush=True)
            by = defaultdict(lambda: [0, 0.0])
            for _, d, name in kernels:
                by[name[:90]][0] += 1
                by[name[:90]][1] += d
            for name, (count, d) in sorted(by.items(), key=lambda kv: -kv[1][1])[:25]:
                print(f"  {d / 1e3:8.1f} ms {count:7d}x {d / count:7.2f} us  {name}", flush=True)
    except Exception as exc:  # the probe's second part is optional
        print(f"CUPTI trace failed: {type(exc).__name__}: {exc}", flush=True)


if __name__ == "__main__":
    main()
