"""Reward models: a tiny random LlamaForSequenceClassification written here in Hugging Face form
(config + safetensors with `model.*` and `score.weight`) loads, converts and scores like a reference
forward pass; batches equal one-by-one scoring; clipping and answer mixing; a training run using it."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

from conftest import write_tokenizer
from mlx_grpo.base.errors import UserError
from mlx_grpo.commands.convert import run_convert
from mlx_grpo.rewards.reward_model import RewardModelReward, load_reward_model, render


@pytest.fixture(scope="module")
def rm_dir(tmp_path_factory) -> Path:
    from mlx_lm.models import llama

    path = tmp_path_factory.mktemp("rm") / "hf"
    path.mkdir()
    vocab = write_tokenizer(path)
    config = {"architectures": ["LlamaForSequenceClassification"], "model_type": "llama", "hidden_size": 32,
              "num_hidden_layers": 2, "intermediate_size": 64, "num_attention_heads": 2, "num_key_value_heads": 1,
              "rms_norm_eps": 1e-5, "vocab_size": vocab, "rope_theta": 10000.0, "tie_word_embeddings": False,
              "num_labels": 1, "pad_token_id": 0, "max_position_embeddings": 512}
    mx.random.seed(3)
    lm = llama.Model(llama.ModelArgs.from_dict(config))
    weights = {k: v for k, v in tree_flatten(lm.parameters()) if k.startswith("model.")}
    weights["score.weight"] = mx.random.normal((1, 32)) * 0.5
    mx.save_safetensors(str(path / "model.safetensors"), weights)
    (path / "config.json").write_text(json.dumps(config))
    return path


def reference_scores(rm_dir: Path, rows: list[list[int]]) -> list[float]:
    """One conversation at a time, unpadded: the backbone's last hidden state times the score head."""
    from mlx_lm.models import llama

    config = json.loads((rm_dir / "config.json").read_text())
    lm = llama.Model(llama.ModelArgs.from_dict(config))
    weights = mx.load(str(rm_dir / "model.safetensors"))
    lm.model.load_weights([(k[len("model."):], v) for k, v in weights.items() if k.startswith("model.")])
    head = np.array(weights["score.weight"], dtype=np.float64)  # [1, D]
    out = []
    for ids in rows:
        hidden = np.array(lm.model(mx.array([ids]))[0, -1], dtype=np.float64)  # [D]
        out.append(float((head @ hidden)[0]))
    return out


PROMPTS = ["What is 2+3?", [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a color."}],
           "Count to three.", "Hi"]
COMPLETIONS = ["<think>\nadd\n</think>\n<answer>\n5\n</answer>", "Blue.", "one two three, and then some more", "Hello!"]


def test_scores_equal_reference_forward_and_batching_changes_nothing(rm_dir):
    reward = RewardModelReward(str(rm_dir), clip=100.0, answer_weight=0.0, batch_size=3)
    rows = [render(reward.tokenizer, p, c) for p, c in zip(PROMPTS, COMPLETIONS)]
    expected = reference_scores(rm_dir, rows)
    np.testing.assert_allclose(reward.score_ids(rows), expected, rtol=1e-4, atol=1e-5)
    one_by_one = RewardModelReward(str(rm_dir), clip=100.0, answer_weight=0.0, batch_size=1)
    np.testing.assert_allclose(one_by_one.score_ids(rows), reward.score_ids(rows), rtol=1e-5, atol=1e-6)
    assert len(set(np.round(expected, 6))) == 4  # distinct conversations, distinct scores


def test_score_is_read_at_the_last_token_that_is_not_padding(rm_dir):
    """transformers reads the score at the rightmost non-pad token (config pad_token_id = 0 here)."""
    reward = RewardModelReward(str(rm_dir), clip=100.0, answer_weight=0.0, batch_size=2)
    row = render(reward.tokenizer, "Hi", "Hello!")
    assert reward.model.pad_token_id == 0 and 0 not in row
    a, b = reward.score_ids([row, row + [0, 0]])
    assert a == pytest.approx(b, abs=1e-6)


def test_render_uses_the_reward_models_chat_template(rm_dir):
    reward = RewardModelReward(str(rm_dir), clip=3.0, answer_weight=0.0, batch_size=4)
    text = reward.tokenizer.decode(render(reward.tokenizer, PROMPTS[1], "Blue."))
    assert text == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nName a color.<|im_end|>\n"
                    "<|im_start|>assistant\nBlue.<|im_end|>\n")


def test_clip_and_answer_mixing(rm_dir):
    raw = RewardModelReward(str(rm_dir), clip=1e9, answer_weight=0.0, batch_size=4)
    tok = raw.tokenizer
    full = raw.score_ids([render(tok, p, c) for p, c in zip(PROMPTS, COMPLETIONS)])
    answers = raw.score_ids([render(tok, p, a) for p, a in zip(PROMPTS, ["5", "", "", ""])])
    mixed = RewardModelReward(str(rm_dir), clip=50.0, answer_weight=0.25, batch_size=4)
    got = mixed(prompts=PROMPTS, completions=COMPLETIONS, completion_ids=[[1]] * 4)
    # only the first completion has an <answer>; the others get -clip as their answer score
    expected = [0.75 * full[0] + 0.25 * answers[0]] + [0.75 * f - 0.25 * 50.0 for f in full[1:]]
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
    clip = float(np.median(np.abs(full)))
    clipped = RewardModelReward(str(rm_dir), clip=clip, answer_weight=0.0, batch_size=4)(
        prompts=PROMPTS, completions=COMPLETIONS, completion_ids=[[1]] * 4)
    np.testing.assert_allclose(clipped, np.clip(full, -clip, clip), rtol=1e-5, atol=1e-6)


def test_convert_keeps_the_score_head(rm_dir, tmp_path):
    out = run_convert(hf_path=str(rm_dir), output_dir=str(tmp_path / "mlx"))
    assert "score.weight" in mx.load(str(out / "model.safetensors"))
    assert (out / "tokenizer.json").is_file() and (out / "mlx_grpo_convert.json").is_file()
    a, tok = load_reward_model(str(rm_dir))
    b, _ = load_reward_model(str(out))
    rows = [render(tok, p, c) for p, c in zip(PROMPTS, COMPLETIONS)]
    width = max(map(len, rows))
    ids, lengths = mx.array([r + [0] * (width - len(r)) for r in rows]), mx.array([len(r) for r in rows])
    np.testing.assert_array_equal(np.array(a(ids, lengths)), np.array(b(ids, lengths)))
    half = run_convert(hf_path=str(rm_dir), output_dir=str(tmp_path / "f16"), dtype="float16")
    c, _ = load_reward_model(str(half))
    np.testing.assert_allclose(np.array(c(ids, lengths)), np.array(a(ids, lengths)), atol=2e-2)


def test_not_a_sequence_classifier_is_refused(tiny_model_dir):
    with pytest.raises(UserError, match="not a \\*ForSequenceClassification checkpoint"):
        load_reward_model(str(tiny_model_dir))


def test_training_run_with_a_reward_model(rm_dir, tiny_model_dir, tmp_path):
    from mlx_grpo.commands import train as trainer
    from mlx_grpo.config import build_config, parse_set

    cfg = build_config("train", overrides=parse_set([
        f"model_name={tiny_model_dir}", f"output_dir={tmp_path}", "batch_size=2", "num_generations=4",
        "max_new_tokens=8", "max_train_samples=2", "system_prompt=", "reward_funcs=[]",
        f"reward_model={rm_dir}", "reward_model_clip=10", "log_completions_steps=1"]))
    run = trainer.train(cfg)
    record = json.loads((run / "metrics.jsonl").read_text().splitlines()[0])
    rows = [json.loads(x) for x in (run / "completions.jsonl").read_text().splitlines()]
    rewards = [r["rewards"]["reward_model"] for r in rows]
    assert len(rewards) == 8 and len(set(rewards)) > 1 and all(abs(r) < 10 for r in rewards)
    direct = RewardModelReward(str(rm_dir), clip=10, answer_weight=0.0, batch_size=16)(
        prompts=[r["prompt"] for r in rows], completions=[r["completion"] for r in rows], completion_ids=[[1]] * 8)
    np.testing.assert_allclose(rewards, direct, rtol=1e-4, atol=1e-5)
    assert record["reward/reward_model"] == pytest.approx(float(np.mean(rewards)), abs=1e-6)
    with pytest.raises(UserError, match="keep reward_workers = 0"):
        build_config("train", overrides=parse_set([f"reward_model={rm_dir}", "reward_workers=2"]))


def test_answer_mixing_clips_both_scores_first(rm_dir):
    """A disliked answer (scored below -clip) must not mix below a missing one, which gets exactly -clip."""
    raw = RewardModelReward(str(rm_dir), clip=1e9, answer_weight=0.0, batch_size=4)
    tok = raw.tokenizer
    full = np.array(raw.score_ids([render(tok, p, c) for p, c in zip(PROMPTS, COMPLETIONS)]))
    answer = raw.score_ids([render(tok, PROMPTS[0], "5")])[0]
    clip = max(abs(answer) / 2, 1e-3)  # the answer's score lies outside [-clip, clip]
    got = RewardModelReward(str(rm_dir), clip=clip, answer_weight=0.25, batch_size=4)(
        prompts=PROMPTS, completions=COMPLETIONS, completion_ids=[[1]] * 4)
    expected = [0.75 * np.clip(full[0], -clip, clip) + 0.25 * np.clip(answer, -clip, clip)] + \
        [0.75 * np.clip(f, -clip, clip) - 0.25 * clip for f in full[1:]]
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
    assert all(-clip - 1e-6 <= g <= clip + 1e-6 for g in got)


def test_a_mistral_checkpoint_builds_on_mlx_lms_llama_backbone(rm_dir, tmp_path):
    """mistral has no mlx-lm module of its own (mlx-lm maps it to llama): the same weights labelled mistral
    score exactly as the llama checkpoint does."""
    mistral = tmp_path / "mistral"
    mistral.mkdir()
    for f in rm_dir.iterdir():
        (mistral / f.name).write_bytes(f.read_bytes())
    config = json.loads((rm_dir / "config.json").read_text())
    config.update(model_type="mistral", architectures=["MistralForSequenceClassification"])
    (mistral / "config.json").write_text(json.dumps(config))
    a = RewardModelReward(str(rm_dir), clip=100.0, answer_weight=0.0, batch_size=2)
    b = RewardModelReward(str(mistral), clip=100.0, answer_weight=0.0, batch_size=2)
    rows = [render(a.tokenizer, p, c) for p, c in zip(PROMPTS, COMPLETIONS)]
    assert a.score_ids(rows) == b.score_ids(rows)
