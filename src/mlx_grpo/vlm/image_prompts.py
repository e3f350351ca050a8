"""GRPO on image + text prompts: how they encode and decode in the sampling stage (training/sampling.py takes
ImagePrompts in place of TextPrompts). Prompts are built by the model's processor and drawn by vlm/image_rollout.py;
everything after the rollout (rewards, advantages, the old/reference log-prob passes, the micro-batched update
on float32 masters, TIS, checkpoints, resume) is the text run's own: the model is a VisionPolicy, whose forward
reads each prompt's image features from the shared table by token id."""

from __future__ import annotations

from pathlib import Path

from mlx_grpo.config import Config
from mlx_grpo.data.examples import Example
from mlx_grpo.rollout.rollout_records import Rollout, SamplingParams
from mlx_grpo.training.policy import Policies
from mlx_grpo.training.records import Batch
from mlx_grpo.vlm.image_rollout import encode_vision_prompt, vision_rollout
from mlx_grpo.vlm.images import image_name


class ImagePrompts:
    """Image + text prompts: the processor encodes them (never cut: vlm/image_rollout.py refuses a longer one), each
    prompt's image features are registered in the policy's table once, and vision_rollout decodes them."""

    multiturn = None  # image runs are single-turn (validation)

    def __init__(self, cfg: Config, processor, tokenizer, model, pad_id: int):
        self.cfg, self.processor, self.tokenizer, self.model, self.pad_id = cfg, processor, tokenizer, model, pad_id
        self.eos_ids = set(tokenizer.eos_token_ids)

    def encode(self, examples: list[Example], system: str, share: slice) -> tuple[list, int]:
        """(this rank's share of the prompts, encoded, 0 prompts cut)."""
        return [encode_vision_prompt(self.processor, e, self.cfg.data.image_column, system, Path.cwd(),
                                     self.cfg.data.max_prompt_length) for e in examples[share]], 0

    def generate(self, policies: Policies, jobs: list, params: SamplingParams) -> list[Rollout]:
        sampler = policies.sampler
        out = []
        for prompts, keys, _ in jobs:
            ids = [sampler.register(p.ids, p.pixel_values, p.grid_thw) for p in prompts]  # encoded once each
            out.append(vision_rollout(sampler, ids, keys, self.cfg.rollout.num_generations, params, self.eos_ids,
                                      self.pad_id, self.tokenizer))
        return out

    def new_update(self) -> None:
        """The previous update's steps are done with: a new feature table for these rollouts."""
        self.model.table.clear()

    def annotate(self, batch: Batch) -> None:
        """Each trained prompt's images, for the logs."""
        batch.stats.images = [[str(x) for x in _names(e, self.cfg.data.image_column)] for e in batch.stats.examples]


def _names(example: Example, column: str) -> list:
    value = example.columns.get(column)
    values = value if isinstance(value, (list, tuple)) else [value]
    return [image_name(v) for v in values]
