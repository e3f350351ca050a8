"""The trained VLM as the GRPO machinery sees it: a module whose forward takes token ids only.

Each prompt's image tokens are replaced by ids past the vocabulary that name rows of a shared feature table
(`VisionTable`): the vision tower encodes a prompt's images once, when its rollouts are drawn, and every one
of its G samples, in any micro-batch of the log-prob and gradient passes, reads the same rows. The forward
splices those rows into the embeddings and derives Qwen2-VL's multimodal RoPE positions (temporal, height,
width) from the ids alone, so packing, micro-batching, checkpoints and the objective work unchanged
(policy.py, models/forward.py). With train_vision the tower is run again inside the gradient pass, once per
prompt present in the micro-batch, so its weights get gradients.

Parameter names are mlx-vlm's own (vision_tower.*, language_model.*): checkpoints load with mlx-vlm.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np


class VisionTable:
    """The image features of the prompts in flight: rows [F, D] addressed by token ids base + row. A plain
    object (not an nn.Module dict), so its arrays are no parameters of the model holding it."""

    def __init__(self, base: int):
        self.base = base  # the first id past the vocabulary
        self.clear()

    def clear(self) -> None:
        self.parts: list[mx.array] = []  # features per prompt [k, D]
        self.offsets_np = np.zeros((0, 3), np.int32)  # (t, h, w) of each row inside its image grid
        self.extent_np = np.zeros((0,), np.int32)  # on an image's last row: its largest offset + 1, else 0
        self.prompt_np = np.zeros((0,), np.int32)  # which prompt a row belongs to
        self.inputs: list[tuple[mx.array, mx.array]] = []  # each prompt's (pixel_values, grid_thw)
        self._features = None
        self.encodings = 0  # vision-tower runs (counted by the tests)

    @property
    def rows(self) -> int:
        return len(self.prompt_np)

    def add(self, features: mx.array, pixel_values: mx.array, grid_thw: np.ndarray, merge: int) -> list[int]:
        """Register one prompt's features (its images in order) -> the ids of its image tokens."""
        start, prompt = self.rows, len(self.inputs)
        offsets, extent = [], []
        for t, h, w in grid_thw.tolist():
            h, w = h // merge, w // merge
            grid = np.stack(np.meshgrid(np.arange(t), np.arange(h), np.arange(w), indexing="ij"), -1).reshape(-1, 3)
            offsets.append(grid)
            e = np.zeros(len(grid), np.int32)
            e[-1] = max(t, h, w)  # the next text position follows the image's largest one
            extent.append(e)
        offsets = np.concatenate(offsets)
        if len(offsets) != features.shape[0]:
            raise ValueError(f"{features.shape[0]} image features for {len(offsets)} grid cells")
        self.parts.append(features)
        self.inputs.append((pixel_values, mx.array(grid_thw)))
        self.offsets_np = np.concatenate([self.offsets_np, offsets.astype(np.int32)])
        self.extent_np = np.concatenate([self.extent_np, np.concatenate(extent)])
        self.prompt_np = np.concatenate([self.prompt_np, np.full(len(offsets), prompt, np.int32)])
        self._features = None
        return list(range(self.base + start, self.base + start + len(offsets)))

    def features(self) -> mx.array:
        if self._features is None:
            self._features = mx.concatenate(self.parts) if self.parts else mx.zeros((0, 1))
        return self._features


def mrope_positions(inputs: mx.array, base: int, offsets: mx.array, extent: mx.array) -> mx.array:
    """Qwen2-VL's RoPE positions [3, n, L] of rows of ids where ids >= base are image rows of the table:
    a text token sits at its index minus the image tokens before it plus the extents of the images before
    it (all three axes equal); an image token at its image's start plus its (t, h, w) cell."""
    n, L = inputs.shape
    image = inputs >= base  # [n, L]
    rows = mx.where(image, inputs - base, 0)
    is_img = image.astype(mx.int32)
    ext = extent[rows] * is_img  # [n, L]
    before = mx.cumsum(is_img, axis=1) - is_img  # image tokens before each token
    extents = mx.cumsum(ext, axis=1) - ext  # extents of the images ended before each token
    start = mx.arange(L, dtype=mx.int32)[None] - before + extents  # [n, L]
    cell = offsets[rows] * is_img[..., None]  # [n, L, 3]
    return (start[..., None] + cell).transpose(2, 0, 1)  # [3, n, L]


class VisionPolicy(nn.Module):
    """An mlx-vlm Qwen2-VL / Qwen2.5-VL model driven by token ids whose image tokens point into `table`."""

    def __init__(self, vlm: nn.Module, table: VisionTable | None = None, train_vision: bool = False):
        super().__init__()
        self.vision_tower = vlm.vision_tower
        self.language_model = vlm.language_model
        self.model_type = vlm.config.model_type  # not a models/forward.LOGIT_SPLITS family: full logits
        self.vlm_config = vlm.config
        self.merge = vlm.config.vision_config.spatial_merge_size
        self.image_token_id = vlm.config.image_token_id
        self.table = table or VisionTable(self.language_model.model.embed_tokens.weight.shape[0])
        self.train_vision = train_vision

    @property
    def layers(self):
        return self.language_model.model.layers

    def encode(self, pixel_values: mx.array, grid_thw: mx.array) -> mx.array:
        """The vision tower's features [k, D] of one prompt's images."""
        self.table.encodings += 1
        dtype = self.vision_tower.patch_embed.proj.weight.dtype
        return self.vision_tower(pixel_values.astype(dtype), grid_thw, output_hidden_states=False)

    def register(self, ids: list[int], pixel_values: mx.array, grid_thw: np.ndarray) -> list[int]:
        """A prompt's ids with its image tokens pointing at its newly encoded features in the table."""
        features = mx.stop_gradient(self.encode(pixel_values, mx.array(grid_thw)))
        mx.eval(features)
        slots = iter(self.table.add(features, pixel_values, grid_thw, self.merge))
        out = [next(slots) if t == self.image_token_id else t for t in ids]
        if next(slots, None) is not None:
            raise ValueError("fewer image tokens in the prompt than image features")
        return out

    def _table_rows(self, inputs: mx.array) -> tuple[mx.array, mx.array]:
        """(features to gather from, row index per token): the table's, or with train_vision features of the
        micro-batch's prompts encoded again (once each) so the tower gets gradients."""
        table = self.table
        rows = mx.where(inputs >= table.base, inputs - table.base, 0)
        if not (self.train_vision and self.training):
            return table.features(), rows
        used = np.unique(np.array(rows)[np.array(inputs) >= table.base])
        prompts = np.unique(table.prompt_np[used])
        feats, remap = [], np.zeros(table.rows, np.int32)
        start = 0
        for p in prompts.tolist():
            f = self.encode(*table.inputs[p])
            idx = np.flatnonzero(table.prompt_np == p)
            remap[idx] = np.arange(start, start + len(idx))
            start += len(idx)
            feats.append(f)
        return mx.concatenate(feats), mx.array(remap)[rows]

    def embed(self, inputs: mx.array) -> mx.array:
        table = self.table
        image = inputs >= table.base
        h = self.language_model.model.embed_tokens(mx.where(image, 0, inputs))
        if table.rows == 0:
            return h
        features, rows = self._table_rows(inputs)
        return mx.where(image[..., None], features[rows].astype(h.dtype), h)

    def head(self, hidden: mx.array) -> mx.array:
        lm = self.language_model
        return lm.model.embed_tokens.as_linear(hidden) if lm.args.tie_word_embeddings else lm.lm_head(hidden)

    def hidden(self, inputs: mx.array, positions: mx.array, cache=None, mask: mx.array | None = None) -> mx.array:
        """mask: which cached positions each row attends to (rollouts' left-padded caches); None: causal."""
        return self.language_model.model(None, inputs_embeds=self.embed(inputs), mask=mask, cache=cache,
                                         position_ids=positions)

    def positions(self, inputs: mx.array) -> mx.array:
        t = self.table
        return mrope_positions(inputs, t.base, mx.array(t.offsets_np if t.rows else np.zeros((1, 3), np.int32)),
                               mx.array(t.extent_np if t.rows else np.zeros((1,), np.int32)))

    def __call__(self, inputs: mx.array, cache=None) -> mx.array:
        """Logits [n, L, V] of whole rows (prompt from position 0), as the training forward needs them."""
        return self.head(self.hidden(inputs, self.positions(inputs), cache))
