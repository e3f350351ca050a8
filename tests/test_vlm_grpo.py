"""GRPO on image + text prompts (vlm/): log-probs equal a naive per-sample forward with the image, each
prompt's images are encoded once for its G samples, gradients reach only trainable parameters, a run resumes
exactly, and the shapes task's answers are right by construction."""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

from conftest import interrupt_before_update, run_metrics
from mlx_grpo.config import build_config

pytest.importorskip("mlx_vlm")


def vlm_cfg(model_dir, tmp_path, **over):
    items = {"model_name": str(model_dir), "dataset": "shapes", "image_column": "image", "batch_size": 2,
             "num_generations": 3, "max_new_tokens": 4, "max_train_samples": 4, "output_dir": str(tmp_path / "runs"),
             "run_name": "r", "save_steps": 1, "learning_rate": 1e-3, "temperature": 1.0, "max_prompt_length": 256,
             "train_type": "lora", "lora_rank": 2, **over}
    if items["train_type"] == "full":
        items.pop("lora_rank")
    return build_config("train", None, [(k, str(v)) for k, v in items.items()])


def test_shapes_answers_are_right_by_construction():
    from PIL import Image
    import io

    from mlx_grpo.data.shapes import COLOURS, make_shapes

    examples = make_shapes(12, seed=3, split="train")
    assert [e.prompt for e in make_shapes(12, seed=3, split="train")] == [e.prompt for e in examples]
    assert make_shapes(3, 3, "test")[0].columns["image"]["bytes"] != examples[0].columns["image"]["bytes"]
    for e in examples:  # count the shapes' connected blobs of their colour in the picture
        image = np.array(Image.open(io.BytesIO(e.columns["image"]["bytes"])))
        inked = (np.abs(image.astype(int) - COLOURS[e.columns["colour"]]).sum(-1) < 60)
        assert _blobs(inked) == int(e.answer) == len(e.columns["kinds"])


def _blobs(mask: np.ndarray) -> int:
    seen, count = np.zeros_like(mask), 0
    for y, x in zip(*np.nonzero(mask)):
        if seen[y, x]:
            continue
        count += 1
        stack = [(y, x)]
        while stack:
            a, b = stack.pop()
            if 0 <= a < mask.shape[0] and 0 <= b < mask.shape[1] and mask[a, b] and not seen[a, b]:
                seen[a, b] = True
                stack += [(a + 1, b), (a - 1, b), (a, b + 1), (a, b - 1)]
    return count


@pytest.fixture(scope="module")
def job(tiny_vlm_dir, tmp_path_factory):
    from mlx_grpo.commands.assembly import build_job

    return build_job(vlm_cfg(tiny_vlm_dir, tmp_path_factory.mktemp("t")))


def test_logprobs_equal_a_naive_forward_with_the_image(job, tiny_vlm_dir):
    from mlx_vlm import load

    from mlx_grpo.training.policy import logprob_pass
    from mlx_grpo.vlm.image_rollout import encode_vision_prompt

    examples = job.sampling.next_examples()
    step = [job.sampling.batch_step(examples)][0]
    rollout = step.rollout
    lp = logprob_pass(job.model, rollout, 1.0, 2, job.trainer.pad_id)  # micro-batches mix the prompts' rows
    naive, _ = load(str(tiny_vlm_dir))
    G = job.cfg.rollout.num_generations
    for r in range(len(rollout.texts)):
        prompt = encode_vision_prompt(job.sampling.prompts.processor, examples[r // G], "image", job.prompt.system, None, 256)
        n = int(rollout.lengths[r])
        completion = np.array(rollout.completion_ids[r, :n]).tolist()
        ids = mx.array([prompt.ids + completion])
        logits = naive(ids, prompt.pixel_values, image_grid_thw=mx.array(prompt.grid_thw)).logits[0].astype(mx.float32)
        picked = logits[len(prompt.ids) - 1:-1]
        expect = picked[mx.arange(n), mx.array(completion)] - mx.logsumexp(picked, axis=-1)
        np.testing.assert_allclose(np.array(lp[r, :n]), np.array(expect), atol=1e-4)
        np.testing.assert_allclose(np.array(rollout.sampler_logprobs[r, :n]), np.array(expect), atol=1e-4)


def test_images_are_encoded_once_per_prompt_and_gradients_reach_only_adapters(job):
    table = job.model.table
    examples = job.sampling.next_examples()
    batches = [job.sampling.batch_step(examples)]
    before = table.encodings
    steps = [job.trainer.score(b) for b in batches]
    grads, _ = job.trainer.gradients(steps)
    assert table.encodings == before  # the gradient pass reads the rollout's features: no encoding
    assert len(steps[0].rollout.prompt_ids) == len(examples) and before >= len(examples)
    names = {k for k, _ in tree_flatten(grads)}
    trainable = {k for k, _ in tree_flatten(job.model.trainable_parameters())}
    assert names == trainable and names and all(".lora_" in k for k in names)
    assert not any(k.startswith("vision_tower.") for k in names)


def test_encodings_are_counted_per_prompt(tiny_vlm_dir, tmp_path):
    from mlx_grpo.commands.assembly import build_job

    t = build_job(vlm_cfg(tiny_vlm_dir, tmp_path))
    [t.sampling.batch_step(t.sampling.next_examples())]
    assert t.model.table.encodings == t.cfg.training.batch_size  # B prompts, B x G samples: B encodings


def test_train_vision_gives_the_tower_gradients(tiny_vlm_dir, tmp_path):
    from mlx_grpo.commands.assembly import build_job

    t = build_job(vlm_cfg(tiny_vlm_dir, tmp_path, train_type="full", train_vision="true"))
    steps = [t.trainer.score(b) for b in [t.sampling.batch_step(t.sampling.next_examples())]]
    before = t.model.table.encodings
    grads, _ = t.trainer.gradients(steps)
    names = {k for k, _ in tree_flatten(grads)}
    assert any(k.startswith("vision_tower.") for k in names) and any(k.startswith("language_model.") for k in names)
    assert t.model.table.encodings - before <= t.cfg.training.batch_size * 2  # once per prompt per micro-batch at most


REWARD = """
def image_reward(prompts, completions, completion_ids, image=None, colour=None, **columns):
    assert all(isinstance(i["bytes"], bytes) and i["path"].startswith("shapes/") for i in image)  # the images
    return [sum(t % 2 == 0 for t in ids) / max(len(ids), 1) for ids in completion_ids]
"""


def test_resume_is_exact_and_completions_name_the_images(tiny_vlm_dir, tmp_path, monkeypatch):
    from mlx_grpo.commands.train import train

    (tmp_path / "reward.py").write_text(REWARD)
    monkeypatch.chdir(tmp_path)
    over = {"reward_funcs": "reward.py:image_reward", "log_completions_steps": 1}
    whole = vlm_cfg(tiny_vlm_dir, tmp_path, run_name="whole", **over)
    train(whole)
    cut = vlm_cfg(tiny_vlm_dir, tmp_path, run_name="cut", **over)
    interrupt_before_update(train, cut, monkeypatch, 2)
    train(cut, resume="latest")
    runs = tmp_path / "runs"
    metrics = run_metrics(runs / "whole")
    assert metrics == run_metrics(runs / "cut") and len(metrics) == 2
    assert all(m["loss"] != 0 for m in metrics)  # the rewards differ within groups: the updates move weights
    rows = [json.loads(line) for line in (runs / "whole" / "completions.jsonl").read_text().splitlines()]
    assert rows[0]["images"][0].startswith("shapes/train/")


def test_unsupported_settings_are_refused(tiny_vlm_dir, tmp_path):
    from mlx_grpo.base.errors import UserError

    with pytest.raises(UserError, match="update_every"):
        vlm_cfg(tiny_vlm_dir, tmp_path, update_every=2)
    # the image rollouts sample through vlm/image_rollout.py, not the engine's running batch and its syncs
    for name, value in (("lookahead", 2), ("running_rows", 16)):
        with pytest.raises(UserError, match=f"image_column .* does not support {name}"):
            vlm_cfg(tiny_vlm_dir, tmp_path, **{name: value})
