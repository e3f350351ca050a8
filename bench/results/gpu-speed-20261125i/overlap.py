"""Does a rollout slow a training pass (and the reverse) less when they run in two processes than in two
threads of one process? Session 21's probe for async_rollouts (BENCHMARKS.md, ninth sitting).

Jobs, on the standard workload (SmolLM2-135M-Instruct bf16, 16 GSM8K prompts x 16, <= 256 new tokens):
  rollout  the engine's generate of the 256 rows (with EOS), evaluated
  train    one gradient pass over a rollout of those prompts (default chunking, eager) + AdamW, evaluated
Phases, at fixed wall-clock times so two processes line up: the rollout alone (3 jobs), the training pass
alone (3 jobs), then both at once for WINDOW seconds, each repeating its job. Modes:
  python overlap.py DATA threads        one process, the rollout in a thread on its own stream (as prefetch.py)
  python overlap.py DATA processes      two processes (this script with ROLE rollout / train), spawned together
Prints each job's seconds per phase and a JSON line per role.
"""
import json, os, statistics, subprocess, sys, threading, time
sys.path.insert(0, "bench")
import mlx.core as mx
import mlx.optimizers as optim
from grpo_bench import encode_prompts, our_train_step, step_data
from mlx_grpo.config import build_config, parse_set
from mlx_grpo.data import load_examples
from mlx_grpo.models.loading import load_model
from mlx_grpo.rollout.engine import RolloutEngine
from mlx_grpo.rollout.records import SamplingParams
from mlx_grpo.training.gradients import make_grad_fn

# env MODEL, TOKENS, WINDOW, PHASE: a CPU dry run (PHASE: seconds between the processes' phases)
WINDOW, ALONE, PHASE = float(os.environ.get("WINDOW", 24)), 3, float(os.environ.get("PHASE", 10))


def setup(data):
    cfg = build_config("train", overrides=parse_set([f"dataset_path={data}"] + ([f"model_name={os.environ['MODEL']}"] if "MODEL" in os.environ else [])))
    model, tok = load_model(cfg.model.model_name, "bfloat16")
    ex = load_examples(cfg.data.dataset, "train", cfg.data.dataset_path, cfg.run.seed)
    prompts = encode_prompts(tok, ex[:16], cfg)
    engine = RolloutEngine(tok, mode="copy").refresh(model)
    params = SamplingParams(int(os.environ.get("TOKENS", 256)), 1.0)
    seed = [0]

    def rollout():
        seed[0] += 1
        r = engine.generate(prompts, 16, params, mx.random.key(seed[0]))
        mx.eval(r.completion_ids, r.sampler_logprobs)
        return r

    first = rollout()
    pad = tok.pad_token_id if tok.pad_token_id is not None else sorted(tok.eos_token_ids)[0]
    opt, grad_fn, steps = optim.AdamW(learning_rate=1e-7), make_grad_fn(cfg, model), [step_data(first, 0)]

    def train():
        our_train_step(model, opt, grad_fn, steps, cfg, pad)

    for _ in range(2):  # warm: kernels built, shapes seen
        rollout(), train()
    return {"rollout": rollout, "train": train}


def timed(job, n=None, until=None):
    out = []
    while (n is not None and len(out) < n) or (until is not None and time.time() < until):
        t0 = time.perf_counter(); job(); out.append(time.perf_counter() - t0)
    return out


def wait(t):
    time.sleep(max(0.0, t - time.time()))


def role_main(data, role, t0):
    # two processes on one GPU: each must hand freed buffers back (MLX keeps them cached by default: OOM)
    mx.set_cache_limit(2 << 30)
    jobs = setup(data)
    t0 = float(t0)
    res = {"role": role, "warm_late_s": time.time() - t0}
    wait(t0)
    if role == "rollout":
        res["alone"] = timed(jobs["rollout"], ALONE)
    wait(t0 + 2 * PHASE)
    if role == "train":
        res["alone"] = timed(jobs["train"], ALONE)
    wait(t0 + 3 * PHASE)
    res["together"] = timed(jobs[role], until=t0 + 3 * PHASE + WINDOW)
    print("RESULT " + json.dumps(res), flush=True)


def threads_main(data):
    jobs = setup(data)
    res = {"rollout": {"alone": timed(jobs["rollout"], ALONE)}, "train": {"alone": timed(jobs["train"], ALONE)}}
    end = time.time() + WINDOW
    box = {}

    def worker():
        with mx.stream(mx.new_stream(mx.default_device())):
            box["together"] = timed(jobs["rollout"], until=end)
    th = threading.Thread(target=worker, daemon=True); th.start()
    res["train"]["together"] = timed(jobs["train"], until=end)
    th.join()
    res["rollout"]["together"] = box["together"]
    for role, r in res.items():
        print("RESULT " + json.dumps({"role": role, **r}), flush=True)


def summary(lines):
    for line in lines:
        r = json.loads(line[len("RESULT "):])
        a, t = r.get("alone", []), r.get("together", [])
        print(f"{r['role']}: alone {', '.join(f'{x:.2f}' for x in a)} (median {statistics.median(a):.2f} s); "
              f"together {', '.join(f'{x:.2f}' for x in t)} (median {statistics.median(t) if t else float('nan'):.2f} s, "
              f"{len(t)} jobs in {WINDOW:.0f} s)" + (f"; warm-up ended {r['warm_late_s']:.1f} s after t0"
                                                      if "warm_late_s" in r else ""), flush=True)


if __name__ == "__main__":
    data, mode = sys.argv[1], sys.argv[2]
    if mode == "role":
        role_main(data, sys.argv[3], sys.argv[4])
    elif mode == "threads":
        out = subprocess.run([sys.executable, __file__, data, "threads-child"], capture_output=True, text=True)
        print(out.stderr[-1500:]); summary([l for l in out.stdout.splitlines() if l.startswith("RESULT ")])
    elif mode == "threads-child":
        threads_main(data)
    else:
        t0 = time.time() + float(sys.argv[3] if len(sys.argv) > 3 else 90)
        logs = [open(f"/tmp/overlap-{role}.log", "w+") for role in ("rollout", "train")]  # files: no pipe fills
        procs = [subprocess.Popen([sys.executable, __file__, data, "role", role, str(t0)], stdout=log, stderr=log,
                                  text=True) for role, log in zip(("rollout", "train"), logs)]
        for p in procs:
            p.wait()
        texts = [open(log.name).read() for log in logs]
        for text in texts:
            print(text[-1000:])
        summary([l for t in texts for l in t.splitlines() if l.startswith("RESULT ")])
