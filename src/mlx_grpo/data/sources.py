"""Where a run's examples come from: `dataset` (or a `*_dataset_path`) as a built-in name, a JSONL/Parquet
file, a saved data set directory or a Hugging Face hub id, with the prompt and answer columns detected
(config.PROMPT_COLUMNS, config.ANSWER_COLUMNS) or named (`prompt_column`, `answer_column`).

Rows are mapped to data/examples.py's generic form (`prompt`, `answer`, every other column) and converted there, so
a file in the old forms (`prompt`/`answer`, GSM8K's `question`/`answer ... #### N`) loads as before.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from mlx_grpo.base.errors import UserError
from mlx_grpo.config import ANSWER_COLUMNS, PROMPT_COLUMNS, dataset_kind, unknown_dataset
from mlx_grpo.data.examples import Example, load_examples as load_builtin, read_rows, row_to_example

BOXED = "\\boxed{"


def detect_columns(keys: Iterable[str], source: str, prompt_column: str = "",
                   answer_column: str = "") -> tuple[str, str]:
    """The (prompt, answer) columns of data whose rows have `keys`: the ones named, else the first
    candidates present; a UserError naming the columns found otherwise."""
    keys = list(keys)
    found = ", ".join(keys) or "none"
    chosen = []
    for role, named, candidates in (("prompt", prompt_column, PROMPT_COLUMNS),
                                    ("answer", answer_column, ANSWER_COLUMNS)):
        if named:
            if named not in keys:
                raise UserError(f"{source}: no column '{named}' ({role}_column); its columns are: {found}")
            chosen.append(named)
            continue
        match = next((c for c in candidates if c in keys), None)
        if match is None:
            raise UserError(f"{source}: no {role} column among its columns ({found}); looked for "
                            f"{', '.join(candidates)}: name it with {role}_column=...")
        chosen.append(match)
    if chosen[0] == chosen[1]:
        raise UserError(f"{source}: the prompt and the answer are both column '{chosen[0]}'; set prompt_column "
                        "and answer_column")
    return chosen[0], chosen[1]


def final_answer(text: str) -> str:
    """The gold answer in a solution text: after GSM8K's last '####', else inside the last \\boxed{...}
    (braces balanced), else the text itself, stripped."""
    _, sep, tail = text.rpartition("####")
    if sep and tail.strip():
        return tail.replace(",", "").strip()
    start = text.rfind(BOXED)
    if start >= 0:
        depth, i = 1, start + len(BOXED)
        while i < len(text) and depth:
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            i += 1
        if depth == 0 and text[start + len(BOXED):i - 1].strip():
            return text[start + len(BOXED):i - 1].strip()
    return text.strip()


def to_examples(rows: Sequence[tuple[str, Any]], source: str, prompt_column: str = "",
                answer_column: str = "") -> list[Example]:
    """(location, row) pairs as Examples, with the columns detected from the first row."""
    if not rows:
        raise UserError(f"{source}: the data set is empty (no rows)")
    first = rows[0][1]
    if not isinstance(first, dict):
        raise UserError(f"{rows[0][0]}: expected a JSON object per row, got {type(first).__name__}")
    prompt_col, answer_col = detect_columns(first, source, prompt_column, answer_column)
    out = []
    for loc, row in rows:
        if not isinstance(row, dict):
            raise UserError(f"{loc}: expected a JSON object per row, got {type(row).__name__}")
        for col in (prompt_col, answer_col):
            if col not in row:
                raise UserError(f"{loc}: row has no '{col}' column (keys: {', '.join(row) or 'none'})")
        answer = row[answer_col]
        gsm8k = prompt_col == "question" and answer_col == "answer" and isinstance(answer, str) and "####" in answer
        if (prompt_col, answer_col) == ("prompt", "answer") or gsm8k:
            out.append(row_to_example(row, loc))  # data/examples.py's own forms, unchanged
            continue
        # Other columns named prompt/answer would collide with the generic form's two: left out.
        rest = {k: v for k, v in row.items() if k not in (prompt_col, answer_col, "prompt", "answer")}
        if isinstance(answer, str):
            answer = final_answer(answer)
        out.append(row_to_example({"prompt": row[prompt_col], "answer": answer, **rest}, loc))
    return out


def _hub_rows(name: str, split: str, directory: bool) -> list[tuple[str, Any]]:
    kind = "data set directory" if directory else "hub data set"
    try:
        import datasets
    except ImportError:
        raise UserError(f"dataset '{name}' ({'a directory' if directory else 'a hub id'}) needs the 'datasets' "
                        "package: bash scripts/setup.sh data (or pip install 'mlx-grpo[data]')") from None
    try:
        if directory and ((Path(name) / "dataset_info.json").is_file() or (Path(name) / "dataset_dict.json").is_file()):
            ds = datasets.load_from_disk(str(Path(name).expanduser()))
            if isinstance(ds, dict):  # a DatasetDict: one data set per split
                if split not in ds:
                    raise UserError(f"{kind} {name} has no split '{split}' (splits: {', '.join(ds)})")
                ds = ds[split]
        else:
            ds = datasets.load_dataset(str(Path(name).expanduser()) if directory else name, split=split)
    except UserError:
        raise
    except Exception as e:
        reason = " ".join(f"{type(e).__name__}: {e}".split())
        raise UserError(f"could not load {kind} '{name}' split '{split}' ({reason})") from None
    return [(f"{name}[{split}] row {i}", dict(row)) for i, row in enumerate(ds, 1)]


def load_examples(dataset: str, split: str, path: str | None, seed: int, *, arith_max_steps: int = 4,
                  prompt_column: str = "", answer_column: str = "", path_key: str | None = None) -> list[Example]:
    """The examples of a run's `split`: from `path` when given (a file or directory), else from `dataset`.
    path_key: the config key that gives a local file instead, named in hints (examples.load_examples)."""
    source = path or dataset
    if dataset == "shapes" and not path:  # the built-in image task (data/shapes.py), sized like arith's splits
        from mlx_grpo.data.shapes import make_shapes

        return make_shapes(1000 if split == "train" else 200, seed, split)
    kind = dataset_kind(source)
    if kind == "builtin" and not path:
        return load_builtin(dataset, split, None, seed, arith_max_steps=arith_max_steps, path_key=path_key)
    if kind == "file" or (path and kind != "directory"):
        rows = read_rows(source)  # a file serves every split: name a held-out one with eval_dataset_path
    elif kind in ("directory", "hub"):
        rows = _hub_rows(source, split, kind == "directory")
    else:
        raise UserError(unknown_dataset(source))
    return to_examples(rows, source, prompt_column, answer_column)


def run_examples(cfg, split: str, path: str | None = None, path_key: str | None = None) -> list[Example]:
    """``load_examples`` with a run's data settings (cfg: a Config); path defaults to dataset_path for the
    train split and eval_dataset_path for the others (path_key: the key named in hints, `eval` passes its own)."""
    data = cfg.data
    if path is None:
        path = data.dataset_path if split == "train" else data.eval_dataset_path
    return load_examples(data.dataset, split, path or None, cfg.run.seed, arith_max_steps=data.arith_max_steps,
                         prompt_column=data.prompt_column, answer_column=data.answer_column, path_key=path_key)
