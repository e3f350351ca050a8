"""Issue 25's bench pieces on tiny models: decode_profile's "graph" builder is the engine's decode_graph step
(same tokens as engine.generate) with fewer primitives than the "engine" step; grpo_bench --sections split
times the training pass piece by piece, and --sections chunking the passes under each micro-batch setting."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np

from test_bench import _load_bench_module

ROOT = Path(__file__).resolve().parent.parent


def test_decode_profile_graph_step_is_the_engines_decode_graph(tiny_model_dir):
    from mlx_grpo.models.model_loading import load_model
    from mlx_grpo.rollout.engine import RolloutEngine
    from mlx_grpo.rollout.rollout_records import SamplingParams

    profile = _load_bench_module("decode_profile")
    shapes = _load_bench_module("shapes")
    model = shapes.build("tiny-qwen2", mx.float32)
    prompts = profile.make_prompts(2, 12, 300, seed=0)
    with profile.graph_step(model, prompts, 3, 10, seed=5) as decoder:
        steps = [decoder.step() for _ in range(6)]
        mx.eval(steps)
        graph = profile.count_primitives(decoder.step())  # one step's graph, its inputs evaluated
    got, got_logprobs = [s[0] for s in steps], mx.stack([s[1] for s in steps], axis=1)
    # on a CPU the fused launch never serves, so graph_split runs graph's arithmetic: this checks its plumbing
    with profile.graph_split_step(model, prompts, 3, 10, seed=5) as decoder:
        split = [decoder.step()[0] for _ in range(6)]
    with profile.engine_step(model, prompts, 3, 10, seed=5) as decoder:
        engine_logprobs = mx.stack([decoder.step()[1] for _ in range(6)], axis=1)
        today = profile.count_primitives(decoder.step())
    # every step reads the keys/values the previous steps wrote: a slot written one off moves the log-probs
    np.testing.assert_allclose(np.array(got_logprobs), np.array(engine_logprobs), atol=1e-5)
    tokenizer = load_model(str(tiny_model_dir), "float32")[1]
    want = RolloutEngine(tokenizer, mode="copy", graph=True).refresh(model).generate(
        prompts, 3, SamplingParams(10, 1.0, ignore_eos=True), mx.random.key(5))
    assert mx.array_equal(mx.stack(got, axis=1), want.completion_ids[:, 1:7])
    assert mx.array_equal(mx.stack(split, axis=1), want.completion_ids[:, 1:7])
    # per layer: no Flatten/Unflatten around matmuls, no weight transposes
    assert graph["primitives"] < today["primitives"]
    assert "Flatten" not in graph["by_type"] and graph["by_type"].get("Transpose", 0) < today["by_type"]["Transpose"]


def test_grpo_bench_split_section(tmp_path):
    from conftest import write_tiny_model

    model = write_tiny_model(tmp_path / "model")
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "grpo_bench.py"), "--model", str(model), "--dtype",
                           "bfloat16", "--dataset", "arith", "--batch", "2", "--group", "2", "--max-new-tokens", "6",
                           "--sections", "split", "--repeats", "1", "--out", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    split = json.loads(next(out.glob("grpo_bench-*.json")).read_text())["split"]
    assert split["masters"] and split["tokens"] == 2 * 2 * 6  # bfloat16 compute: float32 masters
    for key in ("forward_s", "fwd_bwd_eager_s", "fwd_bwd_compiled_s", "clip_s", "optimizer_s", "master_cast_s",
                "update_eager_s", "update_compiled_s"):
        assert split[key] > 0, key
    assert "| training pass split s" in proc.stdout


def test_grpo_bench_chunking_section(tmp_path):
    from conftest import write_tiny_model

    model = write_tiny_model(tmp_path / "model")
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "grpo_bench.py"), "--model", str(model), "--dtype",
                           "bfloat16", "--dataset", "arith", "--batch", "2", "--group", "2", "--max-new-tokens", "6",
                           "--sections", "chunking", "--chunkings", "2x256,4x512", "--repeats", "1", "--out", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(next(out.glob("grpo_bench-*.json")).read_text())["chunking"]
    assert [(r["micro_batch_size"], r["micro_batch_tokens"]) for r in rows] == [(2, 256), (4, 512)]
    for r in rows:
        assert r["chunks"] >= -(-4 // r["micro_batch_size"]) and r["tokens"] == 2 * 2 * 6  # 4 rows, 6 tokens each
        assert r["fwd_bwd_s"] > 0 and r["logprob_s"] > 0 and r["peak_gb"] > 0
        assert isinstance(r["layers_s"], float) and isinstance(r["head_s"], float)  # the tiny model is llama-type
    assert rows[0]["chunks"] > rows[1]["chunks"]  # two rows per micro-batch at most, then four
    assert "| chunking 2x256 (rows x tokens)" in proc.stdout and "| chunking 4x512 (rows x tokens)" in proc.stdout
