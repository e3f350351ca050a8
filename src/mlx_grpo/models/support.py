"""Which model families take which path, as one table (docs/models.md's "Model families"), generated from
the tables the code reads: the sampling copy's families (models/decoder.FAMILIES), the CUDA decode kernel's
(models/kernel_forward.KERNEL_MODEL_TYPES), the hidden-state output head's (models/forward.LOGIT_SPLITS),
and the family matrix the tests train (models/tiny.FAMILY_CONFIGS, whose caches are read off mlx-lm's own
make_cache). tests/test_families.py compares the page with `markdown()`; regenerate the table with

    python -m mlx_grpo.models.support
"""

from __future__ import annotations

import importlib
from pathlib import Path

from mlx_grpo.models import decoder
from mlx_grpo.models.kernel_forward import KERNEL_MODEL_TYPES
from mlx_grpo.models.forward import LOGIT_SPLITS
from mlx_grpo.models.tiny import FAMILY_CONFIGS

BEGIN, END = "<!-- families: begin (python -m mlx_grpo.models.support) -->", "<!-- families: end -->"
PAGE = Path(__file__).resolve().parents[3] / "docs" / "models.md"


def cache_kinds(family: str) -> str:
    """The kinds of per-layer cache a tiny model of the family asks for, as the rollout decode batches them."""
    import mlx.core as mx

    module = importlib.import_module(f"mlx_lm.models.{family}")
    config = {**FAMILY_CONFIGS[family], "model_type": family, "vocab_size": 64, "vocab_size_per_layer_input": 64}
    mx.random.seed(0)
    model = module.Model(module.ModelArgs.from_dict(config))
    caches = model.make_cache() if hasattr(model, "make_cache") else [None] * len(model.layers)
    names = {"KVCache": "KV", "RotatingKVCache": "sliding-window KV", "ArraysCache": "recurrent state",
             type(None).__name__: "KV"}
    kinds = sorted({names.get(type(c).__name__, type(c).__name__) for c in caches})
    if len(caches) < len(model.layers):
        kinds.append("KV-shared layers")
    return ", ".join(kinds)


def _head(family: str) -> str:
    split = LOGIT_SPLITS.get(family)
    if split is None:
        return "full logits"
    notes = [n for n in ("soft cap" if split.softcap else "", "logits divisor" if split.divide else "") if n]
    return "hidden-state head" + (f" ({', '.join(notes)})" if notes else "")


def rows() -> list[list[str]]:
    families = sorted(set(LOGIT_SPLITS) | decoder.FAMILIES | set(FAMILY_CONFIGS))
    out = []
    for family in families:
        sampling = "sampling copy" if family in decoder.FAMILIES else "model"
        if family in KERNEL_MODEL_TYPES:
            sampling += " + CUDA kernel"
        tested = family in FAMILY_CONFIGS
        out.append([f"`{family}`", sampling, cache_kinds(family) if tested else "as mlx-lm's make_cache",
                    _head(family), "yes" if family in LOGIT_SPLITS else "no", "yes" if tested else "no"])
    return out


def markdown() -> str:
    header = ["model_type", "rollouts decode on", "rollout caches", "training log-probs", "grad_checkpoint",
              "family matrix (CI)"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows()]
    return "\n".join(lines)


def page_with_table(text: str) -> str:
    """text (docs/models.md) with the table between its markers replaced by markdown()."""
    head, rest = text.split(BEGIN)
    _, tail = rest.split(END)
    return f"{head}{BEGIN}\n{markdown()}\n{END}{tail}"


if __name__ == "__main__":
    PAGE.write_text(page_with_table(PAGE.read_text()))
    print(f"wrote {PAGE}")
