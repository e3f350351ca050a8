"""The family matrix: tiny random models built with mlx-lm's own classes for the families people fine-tune
(models/tiny.FAMILY_CONFIGS: attention, gated-delta and short-conv hybrids, Mamba2 hybrids, sliding windows,
KV-shared Gemma 4, experts) sample and train.

For each family: the rollout decode gives a row the same tokens and log-probs whatever the length of the
prompt beside it (left padding never enters a cache or a recurrent state); the training forward's log-probs
(hidden-state head, layer checkpointing) equal the model's own full-logits forward; one GRPO update, full and
LoRA, in float32 on two prompts of different lengths, has the sampler's log-probs equal to the trainer's
(sampler_diff_max <= 1e-5); `eval` runs. docs/models.md's table is checked against the code.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten

from mlx_grpo.commands import evaluate
from mlx_grpo.commands.train import train
from mlx_grpo.config import build_config, parse_set
from mlx_grpo.models.forward import completion_logprobs, logit_split, pack, supports_layer_checkpointing, token_logprobs
from mlx_grpo.models.model_loading import load_model
from mlx_grpo.models.tiny import FAMILY_CONFIGS, write_tiny_family
from mlx_grpo.rollout.decode import generate_rollout
from mlx_grpo.rollout.rollout_records import SamplingParams

FIXTURES = Path(__file__).parent / "fixtures"
FAMILIES = sorted(FAMILY_CONFIGS)
# float32 on a CPU: the sampler and the trainer compute the same logits in other op orders
SAMPLER_TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("families")
    return {family: write_tiny_family(root / family, family) for family in FAMILIES}


@pytest.mark.parametrize("family", FAMILIES)
def test_a_rows_sample_does_not_depend_on_the_prompt_beside_it(family_dirs, family):
    """Row 0's prompt alone, then beside a prompt ~70 tokens longer (so it is left-padded into another shape
    bucket): the same keys give it the same tokens and log-probs."""
    model, tok = load_model(str(family_dirs[family]), "float32")
    short, long = list(range(40, 52)), list(range(60, 140))
    params = SamplingParams(max_new_tokens=12, temperature=1.0)
    keys = mx.random.split(mx.random.key(7), 4)  # [rows, 2]
    alone = generate_rollout(model, tok, [short], 2, params, keys[:2])
    beside = generate_rollout(model, tok, [short, long], 2, params, keys)
    n = alone.completion_ids.shape[1]
    assert alone.mask.sum().item() >= 6  # the rows sampled something to compare
    np.testing.assert_array_equal(np.array(beside.completion_ids[:2, :n]), np.array(alone.completion_ids))
    np.testing.assert_allclose(np.array(beside.sampler_logprobs[:2, :n]), np.array(alone.sampler_logprobs),
                               atol=SAMPLER_TOLERANCE)


@pytest.mark.parametrize("family", FAMILIES)
def test_training_forward_equals_the_models_own_and_checkpointing_keeps_gradients(family_dirs, family):
    model, _ = load_model(str(family_dirs[family]), "float32")
    assert logit_split(model) is not None and supports_layer_checkpointing(model)
    mx.random.seed(0)
    completions = mx.random.randint(3, 200, (2, 6))
    batch = pack([list(range(5, 30)), [10, 11, 12]], completions, mx.ones((2, 6)), 0)
    full = token_logprobs(mx.take_along_axis(model(batch.inputs), batch.positions[..., None], axis=1),
                          batch.targets, 0.7)
    # gated-delta layers train through the chunked form: equal to the model's scan to float32 rounding
    np.testing.assert_allclose(np.array(completion_logprobs(model, batch, 0.7)), np.array(full), atol=SAMPLER_TOLERANCE)

    def grads(checkpoint_layers):
        loss = lambda m: completion_logprobs(m, batch, 0.7, checkpoint_layers=checkpoint_layers).sum()  # noqa: E731
        return dict(tree_flatten(nn.value_and_grad(model, loss)(model)[1]))

    plain, checkpointed = grads(False), grads(True)
    assert plain.keys() == checkpointed.keys()
    for name, g in plain.items():
        np.testing.assert_allclose(np.array(checkpointed[name]), np.array(g), rtol=1e-4, atol=1e-5, err_msg=name)


def _items(model_dir: Path, out: Path, name: str, *extra: str) -> list[str]:
    return [f"model_name={model_dir}", f"output_dir={out}", f"run_name={name}", "model_dtype=float32",
            f"dataset_path={FIXTURES / 'gsm8k_tiny.jsonl'}", "max_train_samples=2", "batch_size=2",
            "num_generations=4", "max_new_tokens=12", "system_prompt=", "save_steps=0", "log_completions_steps=0",
            f"reward_funcs={FIXTURES / 'toy_rewards.py'}:share_of_even_ids", "seed=3", *extra]


@pytest.mark.parametrize("train_type", ["full", "lora"])
@pytest.mark.parametrize("family", FAMILIES)
def test_one_grpo_update_trains_on_what_was_sampled(family_dirs, tmp_path, family, train_type):
    extra = ["train_type=lora", "lora_rank=4"] if train_type == "lora" else []
    run_dir = train(build_config("train", overrides=parse_set(_items(family_dirs[family], tmp_path, family, *extra))))
    (record,) = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert record["sampler_diff_max"] is not None and record["sampler_diff_max"] <= SAMPLER_TOLERANCE
    assert np.isfinite(record["loss"]) and record["grad_norm"] > 0


@pytest.mark.parametrize("family", FAMILIES)
def test_eval_runs(family_dirs, tmp_path, family):
    cfg = build_config("eval", overrides=parse_set([f"model_name={family_dirs[family]}", "eval_max_new_tokens=6",
                                                    "model_dtype=float32", "eval_subset_size=2",
                                                    f"eval_dataset_path={FIXTURES / 'gsm8k_tiny.jsonl'}"]))
    result = evaluate.run_eval(cfg, output=str(tmp_path / "eval.jsonl"))
    assert len(result.records) == 2


@pytest.mark.parametrize("family", ["qwen3_5", "gemma4_text", "lfm2"])
def test_rollout_process_stop_strings_and_evaluations(family_dirs, tmp_path, family):
    """The rollout worker process (the model pickled to it, weights through the shared file), stop strings
    and evaluations during training on hybrid and KV-shared models: the first update trains on what it sampled,
    the second on a batch sampled one update stale (rollout_staleness 1)."""
    items = _items(family_dirs[family], tmp_path, family, "async_rollouts=1",
                   "rollout_worker=process", "rollout_correction=token_truncate", 'stop=["ab"]',
                   "eval_every_updates=1", "eval_subset_size=2", "eval_max_new_tokens=4",
                   f"eval_dataset_path={FIXTURES / 'gsm8k_tiny.jsonl'}")
    # built-in arith questions, 4 of them: 2 updates
    items = [i for i in items if not i.startswith(("max_train_samples", "dataset_path"))] + ["max_train_samples=4"]
    run_dir = train(build_config("train", overrides=parse_set(items)))
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == 2 and records[0]["sampler_diff_max"] <= SAMPLER_TOLERANCE
    assert [r["rollout_staleness"] for r in records] == [0, 1]
    assert len((run_dir / "eval.jsonl").read_text().splitlines()) == 2


def test_a_cache_the_decode_cannot_batch_is_one_line(family_dirs, monkeypatch):
    from mlx_lm.models.cache import QuantizedKVCache

    from mlx_grpo.base.errors import UserError
    from mlx_grpo.rollout.engine import check_rollout_model

    model, _ = load_model(str(family_dirs["qwen3"]), "float32")
    assert check_rollout_model("auto", model) is None
    monkeypatch.setattr(type(model), "make_cache", lambda self: [QuantizedKVCache() for _ in self.layers],
                        raising=False)
    with pytest.raises(UserError, match="model family 'qwen3'.*QuantizedKVCache"):
        check_rollout_model("auto", model)


def test_copy_asked_for_a_family_it_does_not_serve_says_so(family_dirs):
    from mlx_grpo.rollout.engine import check_rollout_model

    model, _ = load_model(str(family_dirs["qwen3_5"]), "float32")
    assert "model family 'qwen3_5'" in check_rollout_model("copy", model)
    assert check_rollout_model("model", model) is None


def test_the_family_table_in_docs_is_current():
    from mlx_grpo.models.support import PAGE, page_with_table

    text = PAGE.read_text()
    assert text == page_with_table(text), "regenerate it: python -m mlx_grpo.models.support"
    assert "| `qwen3_5` | model | KV, recurrent state | hidden-state head | yes | yes |" in text


def test_rollout_memory_counts_only_the_caches_that_grow(family_dirs):
    """Up-front memory check: recurrent and KV-shared layers keep no keys and values, a sliding-window layer
    keeps its window."""
    from mlx_grpo.rollout.decode import rollout_memory_bytes

    rows, length, logits = 4, 100, 3 * 4 * 259 * 4
    per_token = 2 * 1 * 16 * 4  # keys and values, 1 KV head of 16, float32

    def need(family):
        return rollout_memory_bytes(load_model(str(family_dirs[family]), "float32")[0], rows, length)

    assert need("qwen3_5") == rows * per_token * 2 * length + logits  # 2 attention layers of 4
    assert need("gemma3_text") == rows * per_token * (length + 2 * 8) + logits  # 1 full layer, 2 windows of 8
    assert need("gemma4_text") == rows * per_token * (length + 8) + logits  # layers 3 and 4 share 1 and 2's
