"""GRPO on image + text prompts: the Trainer with its prompts built by the model's processor and its rollouts
drawn by vlm/rollout.py. Everything after the rollout (rewards, advantages, the old/reference log-prob passes,
the micro-batched update on float32 masters, TIS, checkpoints, resume) is the text Trainer's own: the model is
a VisionPolicy, whose forward reads each prompt's image features from the shared table by token id."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from mlx_grpo.data import Example
from mlx_grpo.training.draws import row_keys
from mlx_grpo.training.records import Batch
from mlx_grpo.training.trainer import Trainer
from mlx_grpo.vlm.evaluate import vision_answer_records
from mlx_grpo.vlm.rollout import encode_vision_prompt, vision_rollout


@dataclass
class VisionTrainer(Trainer):
    processor: object = None  # the model's mlx-vlm processor (images -> pixels, the chat template)

    @property
    def eos_ids(self) -> set[int]:
        return set(self.tokenizer.eos_token_ids)

    def _prompts(self, examples: list[Example], system: str) -> list:
        return [encode_vision_prompt(self.processor, e, self.cfg.data.image_column, system, Path.cwd(),
                                     self.cfg.data.max_prompt_length) for e in examples]

    def encode(self, examples: list[Example]):
        cfg, G = self.cfg, self.cfg.rollout.num_generations
        share = self.world.share(len(examples))
        keys = row_keys(cfg.run.seed, self.counters.draws, len(examples) * G, slice(share.start * G, share.stop * G))
        self.counters.draws += 1
        return self._prompts(examples[share], self.prompt.system), keys, examples[share]

    def generate(self, jobs: list) -> list:
        sampler = self.policies.sampler
        out = []
        for prompts, keys, _ in jobs:
            ids = [sampler.register(p.ids, p.pixel_values, p.grid_thw) for p in prompts]  # encoded once each
            out.append(vision_rollout(sampler, ids, keys, self.cfg.rollout.num_generations, self.params, self.eos_ids,
                                      self.pad_id, self.tokenizer))
        return out

    def batch_steps(self, batches: list[list[Example]]) -> list:
        self.model.table.clear()  # the previous update's steps are done with: a new table for these rollouts
        return super().batch_steps(batches)

    def train_step(self, batches, *args, **kwargs):
        if batches and isinstance(batches[0], list):  # fresh prompts: the previous update's table is done with
            self.model.table.clear()
        return super().train_step(batches, *args, **kwargs)

    def logprob_passes(self, draws) -> Batch:
        batch = super().logprob_passes(draws)
        batch.stats.images = [[str(x) for x in _names(e, self.cfg.data.image_column)] for e in batch.stats.examples]
        return batch

    def answer_records(self, model, tokenizer, examples: list[Example], cfg, *, max_new_tokens: int, seed=None,
                       system_prompt=None, **_) -> list[dict]:
        """Greedy answers to image prompts (run.py's evaluation): one record per example, naming its images."""
        return vision_answer_records(model, self.processor, tokenizer, examples, cfg, max_new_tokens=max_new_tokens,
                                     eos=self.eos_ids, pad_id=self.pad_id, seed=seed, system_prompt=system_prompt)


def _names(example: Example, column: str) -> list:
    from mlx_grpo.vlm.images import image_name

    value = example.columns.get(column)
    values = value if isinstance(value, (list, tuple)) else [value]
    return [image_name(v) for v in values]
