"""Image rollouts (vlm/image_rollout.py): all prompts' samples decode together, their caches left-padded to the
longest prompt, and each row samples what its prompt decoded alone samples with the same keys."""

from __future__ import annotations

from dataclasses import replace

import mlx.core as mx
import numpy as np
import pytest

from mlx_grpo.config import build_config

pytest.importorskip("mlx_vlm")


def test_batched_rollout_samples_what_each_prompt_alone_does(tiny_vlm_dir, tmp_path):
    from mlx_grpo.commands.assembly import build_job
    from mlx_grpo.rollout.rollout_records import SamplingParams
    from mlx_grpo.vlm.image_rollout import encode_vision_prompt, vision_rollout

    items = {"model_name": str(tiny_vlm_dir), "dataset": "shapes", "image_column": "image", "batch_size": 3,
             "num_generations": 2, "max_new_tokens": 6, "max_train_samples": 3, "output_dir": str(tmp_path / "runs"),
             "run_name": "r", "temperature": 1.0, "max_prompt_length": 256, "train_type": "lora", "lora_rank": 2}
    job = build_job(build_config("train", None, [(k, str(v)) for k, v in items.items()]))
    model, G = job.model, 2
    # prompts of three lengths (the shorter ones' caches are padded) with different pictures
    examples = [replace(e, prompt="How many? " + "Look closely. " * i) for i, e in enumerate(job.sampling.next_examples())]
    prompts = [encode_vision_prompt(job.sampling.prompts.processor, e, "image", "", None, 256) for e in examples]
    assert len({len(p.ids) for p in prompts}) == 3
    ids = [model.register(p.ids, p.pixel_values, p.grid_thw) for p in prompts]
    keys = mx.random.split(mx.random.key(7), len(ids) * G)
    params = SamplingParams(6, 1.0)
    args = (job.sampling.prompts.eos_ids, job.trainer.pad_id, job.tokenizer)
    together = vision_rollout(model, ids, keys, G, params, *args)
    for b in range(len(ids)):
        alone = vision_rollout(model, [ids[b]], keys[b * G:(b + 1) * G], G, params, *args)
        rows = slice(b * G, (b + 1) * G)
        n = alone.mask.shape[1]
        assert together.texts[rows] == alone.texts
        np.testing.assert_array_equal(np.array(together.mask[rows, :n]), np.array(alone.mask))
        assert not np.array(together.mask[rows, n:]).any()  # nothing after the prompt's own rows ended
        np.testing.assert_array_equal(np.array(together.completion_ids[rows, :n]), np.array(alone.completion_ids))
        np.testing.assert_allclose(np.array(together.sampler_logprobs[rows, :n]), np.array(alone.sampler_logprobs),
                                   atol=1e-4)
        np.testing.assert_array_equal(together.truncated[rows], alone.truncated)
    assert np.array(together.mask).sum() > len(ids) * G  # the rows decoded past their first token
