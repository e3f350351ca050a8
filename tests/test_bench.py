"""The benchmark harness runs end to end on a tiny model (CI proves it works; figures come from the GPU)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import write_tiny_model

ROOT = Path(__file__).resolve().parent.parent


def test_grpo_bench_runs_every_section_on_a_tiny_model(tmp_path):
    model = write_tiny_model(tmp_path / "model")
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"question": f"What is {i} + {i}?", "answer": f"#### {2 * i}"}) + "\n"
                            for i in range(4)))
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "grpo_bench.py"), "--model", str(model),
                           "--dtype", "float32", "--data", str(data), "--batch", "2", "--group", "2",
                           "--max-new-tokens", "6", "--sizes", "2x2", "--memory-shape", "4x6", "--memory-budgets", "0,16", "--repeats", "1",
                           "--short-pool", "4x8", "--short-rows", "8", "--short-mean", "3", "--short-ends",
                           json.dumps(list("abcdefghijklmnopqrstuvwxyz")), "--refill", "3x2x2",
                           "--refill-ends", json.dumps(list("abcdefghijklm")), "--out", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    record = json.loads(next(out.glob("grpo_bench-*.json")).read_text())
    assert set(record) >= {"rollout", "short", "refill", "overlap", "logprob", "train", "memory", "step", "device", "versions",
                           "date", "mlx_settings"}
    assert record["mlx_settings"] == {k: v for k, v in os.environ.items() if k.startswith("MLX_")}
    assert record["overlap"]["sequential_s"] > 0 and ("overlapped_s" in record["overlap"]
                                                       or "error" in record["overlap"])
    refill = record["refill"]
    assert refill["same_texts"] and refill["together_steps"] <= refill["one_by_one_steps"] and refill["ratio"] > 0
    rollout = record["rollout"][0]
    for name in _load_bench_module("rollout_bench").ROLLOUT_VARIANTS:  # every variant, a new one included
        assert rollout[f"{name}_noeos_tokens"] == 2 * 2 * 6  # no EOS: every row decodes max_new_tokens
        assert rollout[f"ratio_{name}_vs_plain"] > 0 and 0 < rollout[f"{name}_eos_tokens"] <= 2 * 2 * 6
    assert rollout["engine_uses_copy"] and rollout["engine_graph_uses_copy"] and not rollout["model_uses_copy"]
    assert rollout["engine_noeos_row_steps"] == 2 * 2 * 6 and record["train"]["ratio_vs_plain"] > 0
    assert [m["micro_batch_tokens"] for m in record["memory"]] == [0, 16]
    assert record["step"]["tokens"] > 0 and len(record["step"]["steps"]) == 2
    assert "vs plain decode loop: engine" in proc.stdout and proc.stdout.rstrip().splitlines()[-1].startswith("JSON:")


def _load_trl_script():
    import importlib.util

    spec = importlib.util.spec_from_file_location("trl_grpo", ROOT / "bench" / "trl_grpo.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # imports no torch/TRL at module level
    return module


def test_trl_comparison_uses_our_rewards_and_data(tmp_path):
    """The TRL script (run on the GPU machine, where torch lives) scores with mlx-grpo's own reward code,
    prefill included, and reads GSM8K rows as our loader does; its CLI parses without torch."""
    from mlx_grpo.rewards.builtin import BUILTIN_REWARDS

    trl = _load_trl_script()
    data = tmp_path / "gsm8k.jsonl"
    data.write_text(json.dumps({"question": "2 + 2?", "answer": "Add them.\n#### 4"}) + "\n")
    assert trl.load_gsm8k(str(data), 0) == [{"question": "2 + 2?", "answer": "4"}]
    body = "2 plus 2\n</reasoning>\n<answer>\n4\n</answer>\n"
    for prefill in ("", "<reasoning>\n"):
        funcs = trl.reward_functions(["correctness", "strict_format"], prefill)
        got = [f(prompts=["q"], completions=[body if prefill else "<reasoning>\n" + body], completion_ids=[[1]],
                 answer=["4"]) for f in funcs]
        want = [BUILTIN_REWARDS[n](prompts=["q"], completions=["<reasoning>\n" + body], completion_ids=[[1]],
                                   answer=["4"]) for n in ("correctness", "strict_format")]
        assert got == want and want[0] == [2.0]
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "trl_grpo.py"), "--help"], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0 and "--num-generations" in proc.stdout


def test_grpo_bench_bad_input_is_one_line_error(tmp_path, capsys):
    """The script's main() in this process (test_grpo_bench_runs_every_section_on_a_tiny_model runs it as a
    process): exit status 2 and the one line on stderr, no exception escaping."""
    bench = _load_bench_module("grpo_bench")

    def exit_code(argv: list[str]) -> tuple[int, str]:
        try:
            code = bench.main(argv)
        except SystemExit as exc:  # argparse's error(): usage and one line, exit 2
            code = exc.code
        return code, capsys.readouterr().err

    code, err = exit_code(["--data", str(tmp_path / "missing.jsonl"), "--set", "micro_batch_tokns=5"])
    assert code == 2 and "Traceback" not in err
    assert "did you mean 'micro_batch_tokens'" in err
    for bad in (["--warmup", "-1"], ["--repeats", "0"]):
        code, err = exit_code(bad)
        assert code == 2 and "Traceback" not in err and "--warmup >= 0" in err, bad
    # --warmup 0 and --repeats 1 pass the check: the run goes on to the missing data file
    code, err = exit_code(["--warmup", "0", "--repeats", "1", "--data", str(tmp_path / "missing.jsonl")])
    assert code == 2 and "--warmup" not in err and "missing.jsonl" in err


def test_nanochat_bench_runs_a_preset_on_a_tiny_random_nanochat(tmp_path):
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"question": f"What is {i} + {i}?", "answer": f"#### {2 * i}"}) + "\n"
                            for i in range(4)))
    out = tmp_path / "nanochat.json"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "nanochat_bench.py"), "--size", "tiny",
                           "--config", str(ROOT / "configs" / "nanochat_grpo.toml"), "--data", str(data),
                           "--updates", "2", "--set", "batch_size=1", "--set", "num_generations=2",
                           "--set", "max_new_tokens=4", "--out", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    record = json.loads(out.read_text())
    assert [r["update_step"] for r in record["rows"]] == [1, 2]
    assert all(0 < r["completion_length_mean"] <= 4 and r["peak_memory_gb"] > 0 for r in record["rows"])
    assert "| 2 |" in proc.stdout
    bad = subprocess.run([sys.executable, str(ROOT / "bench" / "nanochat_bench.py"), "--size", "tiny",
                          "--config", str(ROOT / "configs" / "nanochat_grpo.toml"), "--data", str(data),
                          "--set", "learning_rat=1"], capture_output=True, text=True, timeout=600)
    assert bad.returncode == 2 and "learning_rate" in bad.stderr and "Traceback" not in bad.stderr


def test_nanochat_bench_rollout_precision_section(tmp_path):
    out = tmp_path / "precision.json"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "nanochat_bench.py"), "--size", "tiny",
                           "--rollout-precision", "--rows", "16", "--tokens", "3", "--out", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(out.read_text())["rollout_precision"]
    assert [(r["dtype"], r["bits"]) for r in results] == [("float32", None), ("float32", 4), ("bfloat16", None),
                                                          ("bfloat16", 4)]
    assert all(r["ms_per_step"] > 0 and r["rows"] == 16 for r in results)


def test_adapter_bench_measures_each_variant_in_its_own_process(tiny_model_dir, tmp_path, capsys):
    """Full, LoRA and QLoRA-8 on the tiny model (hidden 32: its down_proj, 64 wide, is the layer that
    quantizes at group 64): every figure present and finite, adapters train fewer parameters."""
    import math

    out = tmp_path / "adapter.json"
    script = str(ROOT / "bench" / "adapter_bench.py")
    workload = ["--model", str(tiny_model_dir), "--updates", "2", "--set", "batch_size=2", "--set",
                "num_generations=2", "--set", "max_new_tokens=4"]
    proc = subprocess.run([sys.executable, script, *workload, "--variants", "full,lora,qlora8", "--json", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    record = json.loads(out.read_text())
    assert record["device"] and record["versions"]["mlx"] and record["workload"]["batch_size"] == 2
    results = {r["variant"]: r for r in record["variants"]}
    assert list(results) == ["full", "lora", "qlora8"]
    figures = ("trainable_params", "weights_gb", "trainable_weights_gb", "optimizer_state_gb", "peak_gb",
               "peak_after_load_gb", "s_per_update", "rollout_s", "train_s", "logprob_s")
    for r in results.values():
        assert all(isinstance(r[k], (int, float)) and math.isfinite(r[k]) and r[k] > 0 for k in figures), r
        assert r["updates"] == 2 and r["timed_updates"] == [2]  # update 1 is the warm-up
        assert r["peak_gb"] >= r["peak_after_load_gb"] and r["peak_gb"] >= r["weights_gb"]
    full, lora, qlora = results["full"], results["lora"], results["qlora8"]
    assert lora["trainable_params"] < full["trainable_params"] and qlora["trainable_params"] == lora["trainable_params"]
    assert full["reference_weights_gb"] == full["weights_gb"] and lora["reference_weights_gb"] == 0  # the KL copy
    assert full["quantized_layers"] == lora["quantized_layers"] == 0 < qlora["quantized_layers"]
    assert qlora["weights_gb"] < lora["weights_gb"]
    assert {"qlora8_peak_over_lora", "lora_peak_over_full"} <= set(record["ratios"])
    assert "| qlora8 |" in proc.stdout and "lora peak / full" in proc.stdout

    # bad input is caught up front, before any child starts: the script's main() in this process
    bench = _load_bench_module("adapter_bench")
    capsys.readouterr()
    for bad, says in [(["--data", str(tmp_path / "missing.jsonl")], "data file not found"),
                      (["--set", "lora_rnk=4"], "did you mean 'lora_rank'"),
                      (["--variants", "lora", "--set", "lora_keys=self_attn.q_prj"], "lora: unknown LoRA key")]:
        code = bench.main([*workload, *bad])
        err = capsys.readouterr().err
        assert code == 2 and says in err, err[-3000:]
        assert len(err.strip().splitlines()) == 1 and err.startswith("adapter_bench: error: ")


def test_dp_bench_compares_two_ranks_with_one(tiny_model_dir, tmp_path):
    """bench/dp_bench.py on the tiny model: a 1-process baseline and a 2-rank (ring) weak-scaling run,
    each timed from its own metrics.jsonl, with the ratio between them."""
    from test_distributed import LAUNCH, free_port

    if not LAUNCH.is_file():
        pytest.skip("mlx.launch is not installed next to this python")
    script = str(ROOT / "bench" / "dp_bench.py")
    proc = subprocess.run([sys.executable, script, "--model", str(tiny_model_dir), "--set", "dataset=arith",
                           "--set", "num_generations=4", "--set", "max_new_tokens=4", "--set", "model_dtype=float32",
                           "--batch", "2", "--updates", "2", "--scalings", "weak",
                           "--launcher", f"{LAUNCH} -p {free_port()}", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    record = json.loads(next(tmp_path.glob("dp_bench-*.json")).read_text())
    base, weak = record["rows"]
    assert (base["ranks"], base["batch"], weak["ranks"], weak["batch"]) == (1, 2, 2, 4)
    assert base["rows_per_rank"] == weak["rows_per_rank"] == 8 and base["throughput_ratio"] == 1.0
    assert weak["s_per_update"] > 0 and weak["throughput_ratio"] == pytest.approx(
        weak["completions_per_s"] / base["completions_per_s"])
    assert len(weak["per_update"]) == 2 and "2 ranks give" in proc.stdout


def test_grpo_bench_swaps_in_a_random_weight_shape_with_lora(tiny_model_dir, tmp_path):
    """--shape writes a random-weight qwen2 model directory (tokenizer from --tokenizer) that every section,
    the trainer's step included, loads; --train-type lora puts adapters on it in the bench and the trainer."""
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"question": f"What is {i} + {i}?", "answer": f"#### {2 * i}"}) + "\n"
                            for i in range(4)))
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "grpo_bench.py"), "--shape", "tiny-qwen2",
                           "--tokenizer", str(tiny_model_dir), "--train-type", "lora", "--dtype", "float32",
                           "--data", str(data), "--batch", "2", "--group", "2", "--max-new-tokens", "5",
                           "--sizes", "2x2", "--sections", "rollout,step", "--repeats", "1", "--warmup", "2",
                           "--set", "gradient_accumulation_steps=2", "--out", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    record = json.loads(next(out.glob("grpo_bench-*.json")).read_text())
    workload = record["workload"]
    assert workload["model"] == "tiny-qwen2" and workload["random_weights"] and workload["train_type"] == "lora"
    assert workload["adapters"]["lora_parameters"]["rank"] == 16  # the config's default lora_rank
    assert 0 < workload["trainable_parameters"] < workload["parameters"]
    rollout = record["rollout"][0]
    assert rollout["engine_noeos_tokens"] == 2 * 2 * 5 and rollout["engine_noeos_peak_gb"] > 0
    assert rollout["engine_uses_copy"]  # the adapters merged into the sampling copy
    assert record["step"]["trainable_parameters"] == workload["trainable_parameters"]  # the trainer's own LoRA
    assert record["step"]["peak_memory_gb"] > 0 and "model: shape tiny-qwen2" in proc.stdout
    step = record["step"]
    assert step["warmup"] == 2 and len(step["steps"]) == 3 and step["total_s"] == step["steps"][2]["total_s"]
    assert proc.stdout.count("(warm-up)") == 2
    # without dynamic sampling an update's two batch steps are two draws decoded together, in one pass
    assert all(s["draws"] == 2 and s["decode_passes"] == 1 and s["rows_decoded_per_trained"] == 1 for s in step["steps"])


def test_grpo_bench_times_a_presets_update_with_dynamic_sampling(tiny_model_dir, tmp_path, capsys):
    """--config builds the bench's config on a preset (tools, prefill, dynamic sampling): its batch_size and
    num_generations win over the bench's defaults, --max-new-tokens given on the command line wins over the
    preset's, and the step section times the preset's update, recording its draws and decode passes; a
    missing preset is one line and exit 2."""
    data = tmp_path / "data.jsonl"  # half the answers even: flat_unless_even_answer varies in half the groups
    data.write_text("".join(json.dumps({"question": f"What is {i} + {i + i % 2}?", "answer": f"#### {2 * i + i % 2}"})
                            + "\n" for i in range(16)))
    preset = tmp_path / "preset.toml"
    reward = ROOT / "tests" / "fixtures" / "toy_rewards.py"
    preset.write_text(f"""batch_size = 2
num_generations = 4
max_new_tokens = 32
tools = ["calculator"]
prefill = "<reasoning>\\n"
reward_funcs = ["{reward}:flat_unless_even_answer"]
dynamic_sampling = true
max_resample_batches = 3
draws_per_pass = 2
dynamic_sampling_reward = "flat_unless_even_answer"
""")
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "grpo_bench.py"), "--config", str(preset),
                           "--model", str(tiny_model_dir), "--dtype", "float32", "--data", str(data),
                           "--max-new-tokens", "6", "--sections", "step", "--repeats", "3", "--out", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    record = json.loads(next(out.glob("grpo_bench-*.json")).read_text())
    w = record["workload"]
    assert (w["B"], w["G"], w["max_new_tokens"]) == (2, 4, 6)  # the preset's B and G (the bench's: 16), our 6
    assert w["config"] == str(preset) and w["dynamic_sampling"] and w["tools"] == ["calculator"]
    steps = record["step"]["steps"]
    assert len(steps) == 4
    for s in steps:
        assert 1 <= s["decode_passes"] <= s["draws"] <= 1 + 3  # at most max_resample_batches more draws
        assert s["rows_decoded"] == s["draws"] * 2 * 4 and 0 < s["rows_trained"] <= 2 * 4
        assert s["rows_decoded_per_trained"] == s["rows_decoded"] / s["rows_trained"]
        assert s["tool_calls"] >= 0 and 0 <= s["tool_call_rate"] <= 1  # a tools run counts them
    assert any(s["draws"] > 1 for s in steps)  # some update drew again: half the groups vary
    assert record["step"]["draws"] == sorted(s["draws"] for s in steps[1:])[1]  # the median of the timed ones
    assert proc.stdout.count("decode pass") >= 4 and "tool calls" in proc.stdout
    bench = _load_bench_module("grpo_bench")
    assert bench.main(["--config", str(tmp_path / "missing.toml"), "--data", str(data)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("grpo_bench: error: ") and "missing.toml" in err and len(err.strip().splitlines()) == 1


def _load_bench_module(name: str):
    import importlib.util

    sys.path.insert(0, str(ROOT / "bench"))
    try:
        spec = importlib.util.spec_from_file_location(name, ROOT / "bench" / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(ROOT / "bench"))
    return module


def test_decode_profile_times_the_trainers_decode_step(tiny_model_dir):
    """The profiled "trainer" step is generate_rollout's decode: the same row keys give the same tokens."""
    import mlx.core as mx

    from mlx_grpo.models.model_loading import load_model
    from mlx_grpo.rollout.decode import generate_rollout
    from mlx_grpo.rollout.rollout_records import SamplingParams

    profile = _load_bench_module("decode_profile")
    shapes = _load_bench_module("shapes")
    model = shapes.build("tiny-qwen2", mx.float32)
    prompts = profile.make_prompts(2, 12, 300, seed=0)
    assert {len(p) for p in prompts} != {12}  # rows of different lengths: left padding
    with profile.trainer_step(model, prompts, 3, 10, seed=5) as decoder:
        got = [decoder.step()[0] for _ in range(6)]
        assert decoder.info == {"cache": "BatchKVCache", "attention_kernel": False}  # on a CPU
    tokenizer = load_model(str(tiny_model_dir), "float32")[1]  # pad id 0, as the profile's rows
    want = generate_rollout(model, tokenizer, prompts, 3, SamplingParams(10, 1.0, ignore_eos=True), mx.random.key(5))
    assert mx.array_equal(mx.stack(got, axis=1), want.completion_ids[:, 1:7])


def test_decode_profile_engine_step_is_the_engines_decode(tiny_model_dir):
    """The profiled "engine" step is RolloutEngine's decode (its compiled step and cache writes): the same
    row keys give the tokens engine.generate samples."""
    import mlx.core as mx

    from mlx_grpo.models.model_loading import load_model
    from mlx_grpo.rollout.engine import RolloutEngine
    from mlx_grpo.rollout.rollout_records import SamplingParams

    profile = _load_bench_module("decode_profile")
    shapes = _load_bench_module("shapes")
    model = shapes.build("tiny-qwen2", mx.float32)
    prompts = profile.make_prompts(2, 12, 300, seed=0)
    with profile.engine_step(model, prompts, 3, 10, seed=5) as decoder:
        got = [decoder.step()[0] for _ in range(6)]
        assert decoder.info["cache"] == "engine (fused copy, compiled step)" and not decoder.info["attention_kernel"]
    tokenizer = load_model(str(tiny_model_dir), "float32")[1]  # pad id 0, as the profile's rows
    want = RolloutEngine(tokenizer, mode="copy").refresh(model).generate(prompts, 3, SamplingParams(10, 1.0, ignore_eos=True),
                                                            mx.random.key(5))
    assert mx.array_equal(mx.stack(got, axis=1), want.completion_ids[:, 1:7])


def test_decode_profile_runs_on_tiny_sizes(tmp_path):
    out = tmp_path / "profile.json"
    script = str(ROOT / "bench" / "decode_profile.py")
    proc = subprocess.run([sys.executable, script, "--shape", "tiny-qwen2", "--dtype", "float32", "--rows", "4,8",
                           "--group", "4", "--steps", "3", "--warmup", "1", "--max-new-tokens", "12",
                           "--prompt-len", "16", "--builders", "trainer,engine", "--out", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    record = json.loads(out.read_text())
    assert record["device"] and record["versions"]["mlx"] and record["workload"]["steps"] == 3
    assert [(r["builder"], r["rows"], r["B"], r["G"]) for r in record["rows"]] == [
        ("trainer", 4, 1, 4), ("trainer", 8, 2, 4), ("engine", 4, 1, 4), ("engine", 8, 2, 4)]
    for r in record["rows"]:
        assert all(r[k] > 0 for k in ("build_ms", "dispatch_ms", "wait_ms", "eval_ms", "serial_ms", "steady_ms"))
        assert 0 < r["host_share"] <= 1 and r["steady_tok_s"] == pytest.approx(r["rows"] / r["steady_ms"] * 1e3)
        assert r["primitives"] > 20 and sum(r["by_type"].values()) == r["primitives"] and "Matmul" in r["by_type"]
    assert "| trainer | 8 (2x4) |" in proc.stdout and "| engine | 8 (2x4) |" in proc.stdout
    bad = subprocess.run([sys.executable, script, "--shape", "tiny-qwen2", "--rows", "6", "--group", "4", "--steps",
                          "1", "--warmup", "0", "--max-new-tokens", "8", "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=600)
    assert bad.returncode == 2 and bad.stderr.strip() == "decode_profile: error: --rows 6 is not a multiple of --group 4"


def test_queue_depth_times_steps_queued_ahead_of_host_work(tmp_path):
    """bench/queue_depth.py on a tiny random model: per row count the engine's step time, per K the host's dispatch
    of K steps and the steps still queued at its return, and per host work X the wall time to the end, never below
    X, with the hidden share computed from its formula; too few cache slots for the measurements is one line, 2."""
    out = tmp_path / "queue.json"
    script = str(ROOT / "bench" / "queue_depth.py")
    proc = subprocess.run([sys.executable, script, "--shape", "tiny-qwen2", "--dtype", "float32", "--rows", "4,8",
                           "--group", "4", "--ahead", "1,3", "--host-ms", "2,6", "--warmup", "1", "--repeats", "1",
                           "--max-new-tokens", "48", "--prompt-len", "16", "--out", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    record = json.loads(out.read_text())
    assert record["workload"]["host_ms"] == [2.0, 6.0] and [r["rows"] for r in record["results"]] == [4, 8]
    for r in record["results"]:
        assert r["step_ms"] > 0 and [q["ahead_steps"] for q in r["ahead"]] == [1, 3]
        for q in r["ahead"]:
            assert q["dispatch_ms"] > 0
            assert q["queued_at_return"] == pytest.approx(q["ahead_steps"] - q["dispatch_ms"] / r["step_ms"])
            for h in q["hosts"]:
                assert h["total_ms"] >= h["host_ms"]
                assert h["hidden"] == pytest.approx((q["alone_ms"] + h["host_ms"] - h["total_ms"]) / h["host_ms"])
    assert "| engine_inplace | 8 |" in proc.stdout and "X = 6 ms: total, hidden" in proc.stdout
    # one warm-up-free repeat of K = 1 with one X: 2 + 2 x 2 steps after the prefill's token, whose key is the
    # first of max_new_tokens: 7 keys are enough, 6 are refused (a step past the keys would read garbage)
    small = [sys.executable, script, "--shape", "tiny-qwen2", "--dtype", "float32", "--rows", "4", "--group", "4",
             "--ahead", "1", "--host-ms", "1", "--warmup", "0", "--repeats", "1", "--prompt-len", "8",
             "--out", str(tmp_path)]
    bad = subprocess.run(small + ["--max-new-tokens", "6"], capture_output=True, text=True, timeout=600)
    assert bad.returncode == 2 and "--max-new-tokens 6: the measurements take 6 steps after the prefill's token " \
        "(7 needed)" in bad.stderr
    assert subprocess.run(small + ["--max-new-tokens", "7"], capture_output=True, timeout=600).returncode == 0
    bad = subprocess.run(small + ["--max-new-tokens", "64", "--rows", "4,6"], capture_output=True, text=True,
                         timeout=600)
    assert bad.returncode == 2 and "--rows 6 is not a multiple of --group 4" in bad.stderr


def test_short_answers_picks_one_full_row_and_the_mean(tiny_model_dir):
    """The short-answers batch: exactly one row that reached the limit, the rest a window of the pool
    whose total brings the batch's mean closest to the target; lengths read off tokens at the first end;
    the extra ends: the candidate whose median length is nearest the target, single tokens only."""
    import numpy as np

    from mlx_grpo.models.model_loading import load_model

    short = _load_bench_module("short_answers")
    tokenizer = load_model(str(tiny_model_dir), "float32")[1]
    newline, dot = (tokenizer.encode(t, add_special_tokens=False)[0] for t in ("\n", "."))
    pool = np.full((6, 40), 100)  # row 0 never ends: full length under every set
    pool[1:, 5], pool[1:, 20] = dot, newline  # rows 1-5: 6 tokens if "." ends them, 21 if "\n" alone does
    assert short.pick_ends(tokenizer, pool, 30.0, 2, 40) == (["\n"], {2, newline}, True)  # (40 + 21) / 2
    assert short.pick_ends(tokenizer, pool, 23.0, 2, 40) == (["."], {2, dot}, True)  # (40 + 6) / 2
    assert short.pick_ends(tokenizer, pool, 10.0, 2, 40) == (["."], {2, dot}, False)  # none holds: nearest median
    assert short.given_ends(tokenizer, ["."]) == {2, dot}
    with pytest.raises(ValueError, match="not single tokens"):
        short.given_ends(tokenizer, [" the"])  # 4 bytes: 4 tokens of the byte-level tokenizer
    ids = np.array([[5, 9, 7, 1], [9, 5, 5, 5], [5, 5, 5, 5]])
    assert short.lengths_under(ids, {9}).tolist() == [2, 1, 4]
    assert short.lengths_under(ids, {1, 7}).tolist() == [3, 4, 4]
    picked, long_row, reached = short.choose_rows(np.array([3, 16, 2, 5, 9, 16, 1, 4]), 4, 6.0, 16)
    assert picked.tolist() == [0, 1, 2, 7] and long_row == 1 and reached  # 16 + 3 + 2 + 4: mean 6.25
    picked, long_row, reached = short.choose_rows(np.array([3, 12, 2, 5]), 3, 5.0, 16)
    assert long_row == 1 and not reached and picked.tolist() == [0, 1, 2]  # the longest stands in: 12 + 3 + 2
    with pytest.raises(ValueError, match="rows shorter"):
        short.choose_rows(np.array([16, 16, 3]), 3, 5.0, 16)


def test_grpo_bench_short_section_times_a_short_batch_against_full_rows(tiny_model_dir, tmp_path):
    """grpo_bench --sections short on the tiny model: letters as extra ends give short rows; the batch has
    the pool's lengths, one full-length row, and compaction computes fewer row-steps than full rows do."""
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"question": f"What is {i} + {i}?", "answer": f"#### {2 * i}"}) + "\n"
                            for i in range(4)))
    out = tmp_path / "out"
    ends = json.dumps(list("abcdefghijklmnopqrstuvwxyz"))
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "grpo_bench.py"), "--model", str(tiny_model_dir),
                           "--dtype", "float32", "--data", str(data), "--max-new-tokens", "16", "--sizes", "2x2",
                           "--sections", "short", "--short-pool", "4x32", "--short-rows", "32", "--short-mean", "5",
                           "--short-ends", ends, "--repeats", "1", "--out", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(next(out.glob("grpo_bench-*.json")).read_text())["short"]
    assert r["pool_rows"] == 128 and r["rows"] == 32 and r["long_row_reached_limit"] and r["pool_holds_scenario"]
    assert r["short_uses_copy"] and r["ends"] == list("abcdefghijklmnopqrstuvwxyz")
    assert abs(r["predicted_mean"] - 5) < 1 and r["predicted_max"] == 16
    assert r["matches_pool"] == 32  # float32 on a CPU: every row's length is the pool's
    assert (r["short_mean"], r["short_max"], r["short_full_rows"]) == (r["predicted_mean"], 16, 1)
    assert r["full_tokens"] == r["full_row_steps"] == r["short_nocompact_row_steps"] == 32 * 16
    assert r["short_row_steps"] < r["full_row_steps"] and r["short_tokens"] == r["short_model_tokens"]
    assert r["ratio_short_vs_full"] == pytest.approx(r["short_s"] / r["full_s"])
    assert "short answers (mean" in proc.stdout and "| short answers, 32 rows" in proc.stdout
    bad = subprocess.run([sys.executable, str(ROOT / "bench" / "grpo_bench.py"), "--model", str(tiny_model_dir),
                          "--dtype", "float32", "--data", str(data), "--sections", "short", "--short-ends",
                          '["not one token"]', "--out", str(out)], capture_output=True, text=True, timeout=600)
    assert bad.returncode == 2 and "short section: --short-ends" in bad.stderr and "Traceback" not in bad.stderr


def test_tools_bench_times_rollouts_with_and_without_tools(tmp_path):
    sys.path.insert(0, str(ROOT / "tests"))
    from caller_model import CALLER, write_caller_model

    model = write_caller_model(tmp_path / "caller", CALLER)
    out = tmp_path / "tools.json"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "tools_bench.py"), "--set", f"model_name={model}",
                           "--set", "batch_size=2", "--set", "num_generations=2", "--set", "max_new_tokens=16",
                           "--set", "max_tool_turns=4", "--batches", "1", "--repeats", "1", "--phases",
                           "--out", str(out)], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(out.read_text())
    assert set(result["runs"]) == {f"{v}/{m}" for v in ("plain", "prompt", "tools") for m in ("copy", "model")}
    # --phases: the copy's loop timed by parts; a tool-calling batch admits next turns, a plain one does not
    tools, plain = result["runs"]["tools/copy"]["phases"], result["runs"]["plain/copy"]["phases"]
    assert "phases" not in result["runs"]["tools/model"]
    admitted = tools["refill: admit"][1] + tools["refill: admit in place"][1]  # rebuilt batches + in place
    assert admitted == len(tools["admits"]) > 0 and plain["admits"] == []
    assert sum(a[3] for a in tools["admits"]) == tools["refill: admit in place"][1]
    assert all(0 <= a[4] <= a[1] and a[5] > 0 for a in tools["admits"]) and sum(a[4] for a in tools["admits"]) > 0
    assert abs(sum(a[5] for a in tools["admits"] if a[3]) - tools["refill: admit in place"][0]) < 0.05
    assert tools["turns: report"][1] > 0 and tools["decode_steps"] > 0
    assert 0 < tools["turns: keep blocks"][1] <= tools["turns: report"][1]  # the gather, timed within report
    assert tools["turns: keep blocks"][0] <= tools["turns: report"][0]
    assert 0 < tools["sync wait"][0] + tools["refill: admit"][0] < tools["decode loop (all)"][0] <= tools["total_s"]
    assert result["runs"]["tools/copy"]["uses_copy"] and not result["runs"]["tools/model"]["uses_copy"]
    # the caller model writes calls in nanochat's syntax, which its tokenizer's special tokens make "auto"
    assert result["runs"]["tools/copy"]["batches"][0]["tool_call_rate"] > 0
    assert result["runs"]["plain/copy"]["batches"][0]["tool_call_rate"] == 0


def test_tools_bench_inline_answers_decode_the_same_rows_and_unsynced_parts_are_timed(tmp_path):
    """--answers inline (the environment's steps on the loop's thread) decodes what the pool does: the same
    steps, calls and lengths; --lookahead 3 the same calls and lengths in more steps; --unsynced times the loop's
    parts without synchronizing (each part timed, none over the loop)."""
    runs = {}
    settings = {}
    for name, extra in (("pool", []), ("inline", ["--answers", "inline"]), ("ahead", ["--lookahead", "3"])):
        out = tmp_path / f"{name}.json"
        env = {k: v for k, v in os.environ.items() if not k.startswith("MLX_")}
        if name == "ahead":  # MLX's settings in the environment go into the record (harmless on a CPU)
            env["MLX_MAX_OPS_PER_BUFFER"] = "400"
        proc = subprocess.run([sys.executable, str(ROOT / "bench" / "tools_bench.py"), "--caller", "--presets", "tools",
                               "--modes", "copy", "--set", "batch_size=4", "--set", "num_generations=4",
                               "--set", "max_new_tokens=64", "--batches", "1", "--repeats", "1", "--phases",
                               "--unsynced", *extra, "--out", str(out)],
                              capture_output=True, text=True, timeout=600, cwd=ROOT, env=env)
        assert proc.returncode == 0, proc.stderr[-2000:]
        record = json.loads(out.read_text())
        runs[name], settings[name] = record["runs"]["tools/copy"], record["mlx_settings"]
    assert settings == {"pool": {}, "inline": {}, "ahead": {"MLX_MAX_OPS_PER_BUFFER": "400"}}
    (pool,), (inline,), (ahead,) = (runs[name]["batches"] for name in ("pool", "inline", "ahead"))
    for key in ("decode_steps", "row_steps", "tool_calls_mean", "length_mean"):
        assert pool[key] == inline[key], key
    assert (ahead["tool_calls_mean"], ahead["length_mean"]) == (pool["tool_calls_mean"], pool["length_mean"])
    assert pool["wall"][0] < pool["wall"][1] <= inline["wall"][0] < inline["wall"][1]  # the batch's wall-clock span
    assert pool["peak_memory_gb"] > 0 and inline["peak_memory_gb"] > 0
    assert ahead["decode_steps"] > pool["decode_steps"]  # ended turns seen 3 steps later
    assert pool["tool_calls_mean"] > 0
    bad = subprocess.run([sys.executable, str(ROOT / "bench" / "tools_bench.py"), "--caller", "--lookahead", "8"],
                         capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert bad.returncode == 2 and "--lookahead 8: from 0 to --sync-every - 1 (7)" in bad.stderr
    phases = runs["inline"]["phases"]
    assert phases["turns: report"][1] > 0 and 0 < phases["turns: report"][0] < phases["decode loop (all)"][0]


def test_tools_bench_times_the_loop_parts_of_a_trainer_run(tmp_path):
    """--train-minutes (bench/loop_phases.train_phases): `mlx-grpo train` of the tools preset on the tiny caller,
    each rollout's decode loop timed by parts, one pass per update, beside the run's own metrics."""
    out = tmp_path / "train.json"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "tools_bench.py"), "--caller", "--train-minutes",
                           "0.01", "--set", "batch_size=2", "--set", "num_generations=4", "--set", "max_new_tokens=32",
                           "--set", "max_train_samples=8", "--set", "worked_examples=0", "--set", "rollout_engine=copy",
                           "--set", f"output_dir={tmp_path / 'runs'}", "--unsynced", "--out", str(out)],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    train = json.loads(out.read_text())["train"]
    assert train["updates"] == len(train["metrics"]) == len(train["passes"]) >= 1
    for p in train["passes"]:
        assert p["rows"] == 8 and p["decode_steps"] > 0 and p["calls"]["step dispatch"] == p["decode_steps"]
        assert 0 < p["parts"]["decode loop (all)"] <= p["seconds"] and p["calls"]["turns: report"] > 0
    assert all(m["time_rollout_s"] > 0 for m in train["metrics"])


def test_tools_bench_profiles_the_host_work_of_a_tool_calling_rollout(tmp_path):
    """--host --caller: one tools batch of the tiny caller on the sampling copy under cProfile, its seconds split
    into the decode loop's refills, stop checks, rows at syncs and turns handed over."""
    out = tmp_path / "host.json"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "tools_bench.py"), "--host", "--caller",
                           "--set", "batch_size=4", "--set", "num_generations=4", "--set", "max_new_tokens=96",
                           "--repeats", "1", "--out", str(out)], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    host = json.loads(out.read_text())["host"]
    assert host["rows"] == 16 and host["tool_calls"] > 0 and host["syncs"] > 2 and host["refills"] > 0
    assert set(host["parts_s"]) == {"refills", "stop checks", "rows at syncs", "turns handed over"}
    assert all(v > 0 for v in host["parts_s"].values())
    assert 0 < sum(host["parts_s"].values()) < host["profiled_seconds"]


def test_sampler_check_agrees_on_tool_rows_and_fails_past_its_limit(tmp_path):
    """bench/sampler_check.py on the tests' tool caller (tests/caller_model.py, through tools_bench.write_caller):
    rows that called the calculator included, the sampler's log-probs are the forward's; a limit no row can meet
    (below 0) fails with exit 1 and names the rows."""
    sys.path.insert(0, str(ROOT / "bench"))
    from tools_bench import write_caller

    model = write_caller(tmp_path / "caller")
    command = [sys.executable, str(ROOT / "bench" / "sampler_check.py"), "--config", "configs/arith_tools.toml",
               "--sizes", "2", "--set", f"model_name={model}", "--set", "num_generations=4",
               "--set", "max_tool_turns=6", "--out", str(tmp_path / "check.json")]
    proc = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    checked = json.loads((tmp_path / "check.json").read_text())["runs"][0]["checked"]
    assert any(c["tool_calls"] for c in checked) and all(c["tokens"] for c in checked)
    assert max(c["mean"] for c in checked) < 1e-4
    cooler = subprocess.run(command + ["--set", "temperature=0.7", "--set", "rollout_engine=copy"], capture_output=True,
                            text=True, cwd=ROOT, timeout=300)  # the sampler's and the forward's temperature, the copy
    assert cooler.returncode == 0, cooler.stdout + cooler.stderr
    failed = subprocess.run(command + ["--limit", "-1"], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert failed.returncode == 1 and "not the model's" in failed.stdout


def test_sampler_check_forward_is_the_prefix_by_prefix_log_prob(tiny_model_dir):
    """forward_logprobs' one forward equals log softmax(logits / temperature) of each prefix fed alone."""
    import mlx.core as mx
    import numpy as np

    sys.path.insert(0, str(ROOT / "bench"))
    from sampler_check import forward_logprobs

    from mlx_grpo.models.model_loading import load_model

    model, _ = load_model(str(tiny_model_dir), "float32")
    prompt, completion = [5, 9, 2, 7], [11, 3, 3, 8, 1]
    naive = []
    for t, token in enumerate(completion):
        logits = model(mx.array([prompt + completion[:t]]))[0, -1].astype(mx.float32) / 0.7
        naive.append(float((logits - mx.logsumexp(logits))[token]))
    np.testing.assert_allclose(forward_logprobs(model, prompt, completion, 0.7), naive, atol=1e-5)


def test_verify_step_times_k_plus_one_tokens_on_filled_caches_without_growing_them(tmp_path, monkeypatch):
    """bench/verify_step.py: each timed step feeds T tokens per row onto caches holding `past` tokens, rewound
    after each, the caches' buffers a multiple of 256 slots with room for the largest T (a growth would time a
    copy); the JSON has a ratio and the milliseconds added per rows and T."""
    sys.path.insert(0, str(ROOT / "bench"))
    import mlx.core as mx
    import verify_step

    model = verify_step.smollm2_shaped(1, mx.float32)
    caches = verify_step.filled_caches(model, rows=3, past=5, room=4, dtype=mx.float32)
    assert caches[0].keys.shape == (3, 3, 256, 64) and caches[0].offset == 5
    verify_step.step_seconds(model, caches, rows=3, T=4, past=5, repeats=2, warmup=1)
    assert [c.offset for c in caches] == [9] and caches[0].keys.shape[2] == 256  # rewound before each step
    with pytest.raises(ValueError, match="do not fit"):
        verify_step.step_seconds(model, caches, rows=3, T=252, past=5, repeats=1, warmup=0)
    seen = []
    filled = verify_step.filled_caches
    monkeypatch.setattr(verify_step, "filled_caches", lambda *a: seen.append(a) or filled(*a))
    out = tmp_path / "v.json"
    verify_step.main(["--rows", "2", "--past", "254", "--tokens", "1,3", "--layers", "1", "--repeats", "1",
                      "--out", str(out)])
    assert [a[1:4] for a in seen] == [(2, 254, 3)]  # room for the largest T
    result = json.loads(out.read_text())
    assert result["command"] == "python bench/verify_step.py --rows 2 --past 254 --tokens 1,3 --layers 1 --repeats 1 " \
        f"--out {out}"
    runs = result["runs"]
    assert [(r["rows"], r["tokens"], r["slots"]) for r in runs] == [(2, 1, 512), (2, 3, 512)]
    assert runs[0]["vs_one"] == 1.0 and runs[0]["added_ms"] == 0 and all(r["seconds"] > 0 for r in runs)
    for bad in (["--tokens", "3,5"], ["--repeats", "0"]):
        with pytest.raises(SystemExit) as exit_:
            verify_step.main(bad)
        assert exit_.value.code == 2
