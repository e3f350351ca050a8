"""The built-in offline image task `shapes`: PIL-drawn pictures of 1 to 5 filled shapes (circles, squares,
triangles) of one colour on white, and the question how many there are. Drawn from (seed, split) alone, so
train and test differ and every run sees the same pictures; each answer is the number of shapes drawn, and
the shapes never overlap (placed in separate cells of a grid), so the answer is right by construction."""

from __future__ import annotations

import io
import random

from mlx_grpo.data.examples import Example

COLOURS = {"red": (220, 30, 30), "green": (30, 160, 60), "blue": (40, 70, 220), "yellow": (230, 200, 20),
           "purple": (140, 50, 170)}
KINDS = ("circle", "square", "triangle")
SIZE = 112  # pixels a side: 8x8 patches of 14 -> 16 image tokens after Qwen2-VL's 2x2 merge
GRID = 3  # shapes sit in distinct cells of a GRID x GRID grid, so none overlap
MAX_SHAPES = 5
QUESTION = "How many shapes are in the picture? Give the number as the final answer."
SPLIT_SEEDS = {"train": 0, "test": 1}


def draw(rng: random.Random, count: int, colour: str, size: int = SIZE) -> tuple[bytes, list[str]]:
    """A PNG of `count` shapes of `colour` -> (its bytes, the kinds drawn)."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (size, size), (255, 255, 255))
    pen = ImageDraw.Draw(image)
    cell = size // GRID
    kinds = []
    for index in rng.sample(range(GRID * GRID), count):
        kind = rng.choice(KINDS)
        kinds.append(kind)
        r = rng.randint(cell // 4, cell // 2 - 2)  # inside its cell, whatever the jitter
        cx = (index % GRID) * cell + cell // 2
        cy = (index // GRID) * cell + cell // 2
        box = (cx - r, cy - r, cx + r, cy + r)
        if kind == "circle":
            pen.ellipse(box, fill=COLOURS[colour])
        elif kind == "square":
            pen.rectangle(box, fill=COLOURS[colour])
        else:
            pen.polygon([(cx, cy - r), (cx - r, cy + r), (cx + r, cy + r)], fill=COLOURS[colour])
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue(), kinds


def make_shapes(n: int, seed: int, split: str) -> list[Example]:
    """n examples of the split: prompt the question, answer the count, column 'image' a datasets-style
    {'bytes', 'path'} value (path names it in completions.jsonl), 'colour' and 'kinds' for custom rewards."""
    rng = random.Random(seed * 1000 + SPLIT_SEEDS.get(split, 2))
    examples = []
    for i in range(n):
        count, colour = rng.randint(1, MAX_SHAPES), rng.choice(sorted(COLOURS))
        png, kinds = draw(rng, count, colour)
        examples.append(Example(QUESTION, str(count), {"image": {"bytes": png, "path": f"shapes/{split}/{i:05d}.png"},
                                                       "colour": colour, "kinds": kinds}))
    return examples
