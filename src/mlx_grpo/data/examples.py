"""Training and eval data: loading JSONL/Parquet files and the GSM8K hub set into ``Example``s,
the offline ``arith`` word-problem generator, seeded eval subsets, and ``EpochSampler``, the
resumable cursor that decides which examples form each training batch.
"""

from __future__ import annotations

import difflib
import json
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from mlx_grpo.base.errors import UserError
from mlx_grpo.config import BUILTIN_DATASETS as DATASETS
from mlx_grpo.rewards.builtin import RESERVED_ARGS

# Seed offset of the arith test split: far from any seed a user would pick for train.
TEST_SEED_OFFSET = 1_000_003


@dataclass(frozen=True)
class Example:
    prompt: str | list[dict]  # question text, or chat messages [{role, content}, ...]
    answer: str  # gold final answer, e.g. "72"
    columns: dict = field(default_factory=dict)  # every other column, passed to the rewards
    # The worked solution in GSM8K's form ("48/2 = <<48/2=24>>24 ...\n#### 24"): GSM8K's own, or the one arith
    # writes; "" when there is none. Not a column: rewards never see it; data/solutions.py writes it as a completion.
    solution: str = ""


def reward_columns(examples: Sequence[Example]) -> dict[str, list]:
    """Columns for ``RewardSet.score``: ``answer`` plus the union of extra columns (None where absent)."""
    keys = sorted({k for ex in examples for k in ex.columns})
    cols: dict[str, list] = {"answer": [ex.answer for ex in examples]}
    for k in keys:
        cols[k] = [ex.columns.get(k) for ex in examples]
    return cols



def parse_gsm8k_answer(answer: str) -> str:
    """The final answer after the last ``####`` of a GSM8K solution, commas removed."""
    _, sep, tail = answer.rpartition("####")
    if not sep:
        raise ValueError("GSM8K answer has no '#### <final answer>' line")
    gold = tail.replace(",", "").strip()
    if not gold:
        raise ValueError("GSM8K answer is empty after '####'")
    return gold


def _check_messages(messages: list, loc: str) -> list[dict]:
    """Chat prompts must be non-empty lists of {role: str, content: str}; keep just those two keys."""
    if not messages:
        raise UserError(f"{loc}: 'prompt' is an empty list of messages")
    out = []
    for i, m in enumerate(messages):
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            raise UserError(f"{loc}: prompt message {i} must be {{'role': str, 'content': str}}, got {m!r}")
        out.append({"role": m["role"], "content": m["content"]})
    return out


def _row_to_example(row: Any, loc: str) -> Example:
    """A 'prompt' row is generic (answer used as is); a 'question' row is GSM8K (answer ends '#### N')."""
    if not isinstance(row, dict):
        raise UserError(f"{loc}: expected a JSON object per row, got {type(row).__name__}")
    key = "prompt" if "prompt" in row else "question" if "question" in row else None
    if key is None:
        raise UserError(f"{loc}: row has neither 'question' nor 'prompt' (keys: {', '.join(row) or 'none'})")
    if "answer" not in row:
        raise UserError(f"{loc}: row is missing the 'answer' key")
    prompt, answer = row[key], row["answer"]
    if isinstance(prompt, list):
        prompt = _check_messages(prompt, loc)
    elif not isinstance(prompt, str) or not prompt.strip():
        raise UserError(f"{loc}: '{key}' must be non-empty text{' or a list of messages' * (key == 'prompt')}")
    solution = ""
    if key == "question":
        if not isinstance(answer, str):
            raise UserError(f"{loc}: GSM8K 'answer' must be text ending '#### N', got {answer!r}")
        try:
            solution, answer = answer, parse_gsm8k_answer(answer)
        except ValueError as e:
            raise UserError(f"{loc}: {e} (rows with a bare final answer should use 'prompt')") from None
    elif isinstance(answer, (int, float, str)) and not isinstance(answer, bool):
        answer = str(answer).strip()
    else:
        raise UserError(f"{loc}: 'answer' must be text or a number, got {answer!r}")
    columns = {k: v for k, v in row.items() if k not in (key, "answer")}
    clash = sorted(RESERVED_ARGS & set(columns))
    if clash:
        raise UserError(f"{loc}: column '{clash[0]}' clashes with a reward-function argument; rename it")
    return Example(prompt=prompt, answer=answer, columns=columns, solution=solution)



def _json_rows(path: Path) -> list[tuple[str, Any]]:
    """(``file:line``, row) pairs of a JSON-lines file; blank lines are skipped."""
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise UserError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    out = []
    # split("\n"), not splitlines(): U+2028 may legally sit unescaped inside a JSON string.
    for lineno, line in enumerate(text.split("\n"), 1):
        if not line.strip():
            continue
        try:
            out.append((f"{path}:{lineno}", json.loads(line)))
        except json.JSONDecodeError as e:
            raise UserError(f"{path}:{lineno}: invalid JSON ({e.msg}, column {e.colno}); "
                            "expected one JSON object per line") from None
    return out


def _parquet_rows(path: Path) -> list[tuple[str, Any]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise UserError(f"reading {path} needs pyarrow: pip install pyarrow") from None
    try:
        rows = pq.read_table(path).to_pylist()
    except Exception as e:
        reason = " ".join(f"{type(e).__name__}: {e}".split())
        raise UserError(f"{path}: not a readable Parquet file: {reason}") from None
    return [(f"{path}:row {i}", r) for i, r in enumerate(rows, 1)]


def row_to_example(row: Any, loc: str) -> Example:
    """One row (``prompt`` + ``answer``, or GSM8K's ``question`` + ``answer``) as an Example; ``loc`` names
    the row in errors."""
    return _row_to_example(row, loc)


def load_file(path: str | Path) -> list[Example]:
    """Examples from a JSON-lines (.jsonl/.json) or Parquet (.parquet) file."""
    return [_row_to_example(row, loc) for loc, row in read_rows(path)]


def read_rows(path: str | Path) -> list[tuple[str, Any]]:
    """(``file:line``, row) pairs of a JSON-lines (.jsonl/.json) or Parquet (.parquet) file; never empty."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise UserError(f"data file not found: {path}")
    suffix = path.suffix.lower()
    if suffix in (".jsonl", ".json"):
        rows = _json_rows(path)
    elif suffix == ".parquet":
        rows = _parquet_rows(path)
    else:
        raise UserError(f"{path}: unsupported data file type '{suffix}' (expected .jsonl, .json or .parquet)")
    if not rows:
        raise UserError(f"{path}: the data set is empty (no rows)")
    return rows


def load_gsm8k_hub(split: str, path_key: str = "dataset_path") -> list[Example]:
    """GSM8K ("openai/gsm8k", config "main") from the Hugging Face hub or its local cache. path_key: the
    config key that gives a local file instead, named in the hints (eval's is eval_dataset_path)."""
    local = f"{path_key}=/path/to/{split}.jsonl"
    try:
        import datasets
    except ImportError:
        raise UserError(f"dataset=gsm8k needs the 'datasets' package: pip install 'mlx-grpo[data]' "
                        f"(or pass {local})") from None
    try:
        ds = datasets.load_dataset("openai/gsm8k", "main", split=split)
    except Exception as e:
        reason = " ".join(f"{type(e).__name__}: {e}".split())
        raise UserError(f"could not load openai/gsm8k split '{split}' from the hub ({reason}); "
                        f"without network, pass {local}") from None
    return [_row_to_example(row, f"openai/gsm8k[{split}] row {i}") for i, row in enumerate(ds, 1)]


# (name, he, him, his); tuples so the tables stay immutable.
_HE, _SHE = ("he", "him", "his"), ("she", "her", "her")
_PEOPLE = tuple((name, *_HE) for name in ("Tom", "Sam", "Leo", "Ravi", "Kenji", "Omar")) + tuple(
    (name, *_SHE) for name in ("Maria", "Aisha", "Nina", "Emma", "Lucia", "Grace"))
_OBJECTS = ("apples", "marbles", "stickers", "books", "pencils", "cookies", "stamps", "shells", "cards", "coins")
_ITEMS = (("notebook", "notebooks"), ("pen", "pens"), ("apple", "apples"), ("comic", "comics"),
          ("sandwich", "sandwiches"))
_MAKERS = (("A baker", "bakes", "muffins"), ("A toy maker", "builds", "toys"), ("A printer", "prints", "posters"),
           ("A gardener", "plants", "flowers"))


def _step(a: int, op: str, b: int, value: int) -> str:
    """A computation as GSM8K writes it: "7 + 5 = <<7+5=12>>12" (the annotation is the calculator call)."""
    return f"{a} {op} {b} = <<{a}{op}{b}={value}>>{value}"


def _story(rng: random.Random, steps: int | None = None) -> tuple[str, str, int, str]:
    """A running count changed `steps` times (default 2-4) by +, -, *, or an exact division."""
    (name, he, him, his), obj, value = rng.choice(_PEOPLE), rng.choice(_OBJECTS), rng.randint(5, 40)
    He, expr, text = he.capitalize(), str(value), [f"{name} has {value} {obj}."]
    worked = list(text)
    for _ in range(rng.randint(2, 4) if steps is None else steps):
        divisors = [d for d in range(2, 7) if value % d == 0 and value > d]
        op = rng.choice(["+"] + ["-"] * (value >= 2) + ["*"] * (value * 2 <= 600) + ["/"] * bool(divisors))
        if op == "+":
            k = rng.randint(2, 30)
            text.append(rng.choice([f"{He} buys {k} more.", f"A friend gives {him} {k} more."]))
            expr, new = f"({expr} + {k})", value + k
        elif op == "-":
            k = rng.randint(1, value - 1)
            text.append(rng.choice([f"{He} gives away {k}.", f"{He} loses {k}."]))
            expr, new = f"({expr} - {k})", value - k
        elif op == "*":
            k = rng.choice([m for m in (2, 3, 4) if value * m <= 600])
            word = {2: "doubles", 3: "triples"}.get(k)
            text.append(f"Then {he} {word} {his} {obj}." if word else f"Then {he} ends up with {k} times as many.")
            expr, new = f"({expr} * {k})", value * k
        else:
            k = rng.choice(divisors)
            text.append(f"{He} splits {his} {obj} equally into {k} boxes and keeps one box.")
            expr, new = f"({expr} // {k})", value // k
        worked.append(f"{text[-1][:-1]}: {_step(value, op, k, new)}.")
        value = new
    text.append(f"How many {obj} does {name} have now?")
    worked.append(f"{name} has {value} {obj} now.")
    return " ".join(text), expr, value, " ".join(worked)


def _shopping(rng: random.Random) -> tuple[str, str, int, str]:
    name, he = rng.choice(_PEOPLE)[:2]
    (s1, p1), (s2, p2) = rng.sample(_ITEMS, 2)
    a, c1, b, c2 = rng.randint(2, 6), rng.randint(1, 9), rng.randint(1, 5), rng.randint(1, 9)
    cost = a * c1 + b * c2
    bill = rng.choice([x for x in (20, 50, 100) if x >= cost])
    q = (f"{name} buys {a} {p1} for ${c1} each and {b} {s2 if b == 1 else p2} for ${c2} each. "
         f"{he.capitalize()} pays with a ${bill} bill. How many dollars of change does {he} get?")
    worked = (f"The {p1} cost {_step(a, '*', c1, a * c1)} dollars and the {s2 if b == 1 else p2} cost "
              f"{_step(b, '*', c2, b * c2)} dollars, {_step(a * c1, '+', b * c2, cost)} dollars in all. "
              f"The change is {_step(bill, '-', cost, bill - cost)} dollars.")
    return q, f"({bill} - (({a} * {c1}) + ({b} * {c2})))", bill - cost, worked


def _teams(rng: random.Random) -> tuple[str, str, int, str]:
    a, b, d = rng.randint(2, 6), rng.randint(10, 30), rng.randint(2, 8)
    r = (a * b) % d
    # Absent = remainder + whole teams: keeps (a*b - c) divisible by d, positive, and c >= 1.
    c = r + d * rng.randint(0 if r else 1, min(3, (a * b - r - 1) // d))
    q = (f"A school has {a} classes with {b} students in each class. {c} students are absent today. "
         f"The students who are present are split equally into {d} teams. "
         "How many students are in each team?")
    worked = (f"The school has {_step(a, '*', b, a * b)} students. {c} are absent, so "
              f"{_step(a * b, '-', c, a * b - c)} are present. Each team has "
              f"{_step(a * b - c, '/', d, (a * b - c) // d)} students.")
    return q, f"((({a} * {b}) - {c}) // {d})", (a * b - c) // d, worked


def _production(rng: random.Random) -> tuple[str, str, int, str]:
    who, verb, things = rng.choice(_MAKERS)
    a, b, c, d = rng.randint(2, 12), rng.randint(2, 5), rng.randint(2, 12), rng.randint(2, 5)
    e = rng.randint(1, a * b + c * d - 1)
    q = (f"{who} {verb} {a} {things} per hour for {b} hours in the morning and {c} {things} per hour "
         f"for {d} hours in the afternoon. {e} of the {things} are sold. How many {things} are left?")
    made = a * b + c * d
    worked = (f"The morning gives {_step(a, '*', b, a * b)} {things} and the afternoon "
              f"{_step(c, '*', d, c * d)}, so {_step(a * b, '+', c * d, made)} in all. After {e} are sold, "
              f"{_step(made, '-', e, made - e)} {things} are left.")
    return q, f"((({a} * {b}) + ({c} * {d})) - {e})", made - e, worked


def _savings(rng: random.Random) -> tuple[str, str, int, str]:
    name, he, him, his = rng.choice(_PEOPLE)
    a, b = rng.randint(2, 15), rng.randint(2, 10)
    expr, value, text = f"({a} * {b})", a * b, [f"{name} saves ${a} every week for {b} weeks."]
    worked = [f"{name} saves {_step(a, '*', b, value)} dollars."]
    if rng.random() < 0.5:
        g = rng.randint(1, 30)
        text.append(f"{his.capitalize()} grandmother gives {him} ${g}.")
        worked.append(f"{his.capitalize()} grandmother gives {him} {g} more: {_step(value, '+', g, value + g)}.")
        expr, value = f"({expr} + {g})", value + g
    s = rng.randint(1, value)
    text.append(f"Then {he} spends ${s} on a game. How many dollars does {he} have left?")
    worked.append(f"After the game {he} has {_step(value, '-', s, value - s)} dollars left.")
    return " ".join(text), f"({expr} - {s})", value - s, " ".join(worked)


_TEMPLATES = (_story, _story, _shopping, _teams, _production, _savings)


def make_arith(n: int, seed: int, exclude: frozenset[str] = frozenset(), max_steps: int = 4) -> list[Example]:
    """n distinct multi-step word problems with non-negative integer answers, deterministic in seed.

    max_steps = 4: the mix of every template (2-4 operations); below 4, running-count stories of 1 to
    max_steps operations only. Questions in ``exclude`` are skipped (how the test split avoids the train
    split). Each example carries its fully parenthesised ``expression`` column (Python syntax) for checking,
    and its worked solution in GSM8K's form (``solution``), one computation per operation.
    """
    rng, seen, out = random.Random(seed), set(exclude), []
    for _ in range(100 * n + 100):  # bound the loop; the problem space is far larger than n
        if len(out) == n:
            break
        if max_steps >= 4:
            question, expr, value, worked = rng.choice(_TEMPLATES)(rng)
        else:
            question, expr, value, worked = _story(rng, rng.randint(1, max_steps))
        if question in seen:
            continue
        seen.add(question)
        out.append(Example(prompt=question, answer=str(value), columns={"expression": expr},
                           solution=f"{worked}\n#### {value}"))
    if len(out) < n:
        raise UserError(f"arith generator produced only {len(out)} distinct problems of the {n} asked for")
    return out



def load_examples(dataset: str, split: str, path: str | None, seed: int, arith_size: int = 1000,
                  arith_max_steps: int = 4, path_key: str | None = None) -> list[Example]:
    """The examples of a run: a file when ``path`` is given, else the named data set's split. path_key: the
    config key that gives ``path``, named in hints (default: dataset_path for the train split, else
    eval_dataset_path)."""
    path_key = path_key or ("dataset_path" if split == "train" else "eval_dataset_path")
    if path:
        return load_file(path)
    if dataset == "gsm8k":
        return load_gsm8k_hub(split, path_key)
    if dataset == "arith":
        if split == "train":
            return make_arith(arith_size, seed, max_steps=arith_max_steps)
        train = frozenset(str(ex.prompt) for ex in make_arith(arith_size, seed, max_steps=arith_max_steps))
        return make_arith(arith_size, seed + TEST_SEED_OFFSET, exclude=train, max_steps=arith_max_steps)
    close = difflib.get_close_matches(dataset, DATASETS, n=1, cutoff=0.0)
    hint = f"did you mean '{close[0]}'? " if close else ""
    raise UserError(f"unknown dataset '{dataset}' ({hint}valid: {', '.join(DATASETS)}; or set {path_key})")


def subset(examples: Sequence[Example], n: int, seed: int) -> list[Example]:
    """A fixed seeded subset of min(n, len) examples in their original order; nested as n grows."""
    if n < 0:
        raise ValueError(f"subset size must be >= 0, got {n}")
    keep = np.random.default_rng(seed).permutation(len(examples))[:n]
    return [examples[i] for i in sorted(keep.tolist())]


class EpochSampler:
    """Batches of example indices: a fresh permutation per epoch from ``default_rng([seed, epoch])``.

    The last incomplete batch of each epoch is dropped so every step sees exactly ``batch_size``
    prompts (constant shapes, no recompiles); the dropped examples differ each epoch. The cursor
    advances before a batch is handed out, so ``state()`` taken after using a batch resumes with
    the next one.
    """

    def __init__(self, num_examples: int, batch_size: int, num_epochs: int, seed: int):
        if batch_size < 1 or num_epochs < 1 or seed < 0:
            raise UserError(f"need batch_size >= 1, num_epochs >= 1, seed >= 0; got {batch_size}, {num_epochs}, "
                            f"{seed}")
        if num_examples < batch_size:
            raise UserError(f"the data set has {num_examples} example{'s' * (num_examples != 1)}, fewer than "
                            f"batch_size={batch_size}")
        self.num_examples, self.batch_size, self.num_epochs, self.seed = num_examples, batch_size, num_epochs, seed
        self.batches_per_epoch = num_examples // batch_size
        self.epoch, self.position = 0, 0

    @property
    def num_batches_total(self) -> int:
        return self.batches_per_epoch * self.num_epochs

    @property
    def batches_done(self) -> int:
        return self.epoch * self.batches_per_epoch + self.position

    def __iter__(self) -> Iterator[list[int]]:
        while self.epoch < self.num_epochs:
            order = np.random.default_rng([self.seed, self.epoch]).permutation(self.num_examples)
            while self.position < self.batches_per_epoch:
                start = self.position * self.batch_size
                batch = order[start : start + self.batch_size].tolist()
                self.position += 1
                yield batch
            self.epoch, self.position = self.epoch + 1, 0

    def state(self) -> dict:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed,
                "num_examples": self.num_examples, "batch_size": self.batch_size}

    def load_state(self, state: dict) -> None:
        """Resume; the data set size, batch size and seed must match (num_epochs may grow)."""
        for key in ("seed", "num_examples", "batch_size"):
            if key in state and state[key] != getattr(self, key):
                raise UserError(f"checkpoint data cursor has {key}={state[key]}, "
                                f"this run has {getattr(self, key)}")
        epoch, position = int(state["epoch"]), int(state["position"])
        if position == self.batches_per_epoch:  # saved right after an epoch's last batch: next epoch
            epoch, position = epoch + 1, 0
        if not (0 <= position < self.batches_per_epoch and 0 <= epoch):
            raise UserError(f"checkpoint data cursor is out of range: epoch={epoch}, position={position}")
        self.epoch, self.position = epoch, position
