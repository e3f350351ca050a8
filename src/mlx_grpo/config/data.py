"""The `data` settings (cfg.data; TOML [data]): where examples come from and how each prompt is written
(system prompt, worked examples, prefill). Read by data/ (sources.py, examples.py, prompts.py, solutions.py)."""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass
from pathlib import Path

from mlx_grpo.config.fields import ANSWER_COLUMNS, DATA, MODEL_CMDS, PROMPT_COLUMNS, SYSTEM_PROMPT, TUNE, setting

# The built-in data sets (data/examples.py generates arith, loads gsm8k; data/shapes.py draws shapes, the image task);
# with the forms below, what `dataset` accepts.
BUILTIN_DATASETS = ("arith", "gsm8k", "shapes")
FILE_SUFFIXES = (".jsonl", ".json", ".parquet")
# "owner/name" as the hub spells repository ids.
HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")


def dataset_kind(name: str) -> str:
    """'builtin', 'file', 'directory', 'hub', or 'unknown' for a name that is none of them."""
    if name in BUILTIN_DATASETS:
        return "builtin"
    path = Path(name).expanduser()
    if path.suffix.lower() in FILE_SUFFIXES or path.is_file():
        return "file"
    if path.is_dir():
        return "directory"
    return "hub" if HUB_ID.match(name) else "unknown"


def unknown_dataset(name: str) -> str:
    """The error line for a `dataset` that is neither a built-in, a data file or directory, nor a hub id."""
    close = difflib.get_close_matches(name, BUILTIN_DATASETS, n=1, cutoff=0.6)
    hint = f" (did you mean '{close[0]}'?)" if close else ""
    return (f"dataset must be 'arith' or 'gsm8k' (or the image task 'shapes'), a .jsonl/.json/.parquet file, a "
            f"data set directory or a hub id 'owner/name'; got {name!r}{hint}")


@dataclass(frozen=True)
class DataConfig:
    """Where the training and evaluation examples come from, and the prompt each becomes: system prompt,
    worked examples, prefill, length limit."""

    dataset: str = setting("arith", "Data set: 'arith' (built-in, offline arithmetic word problems), 'gsm8k' "
                           "(openai/gsm8k from the Hugging Face hub), a JSONL/Parquet file (serves train and eval), a "
                           "saved data set directory or a hub id 'owner/name' (those two need the `data` extra). "
                           "Ignored where a *_dataset_path is set.", DATA)
    dataset_path: str = setting("", "Local JSONL/Parquet training file (GSM8K form or prompt/answer); overrides "
                                "`dataset` for training (and, in eval, for drawing the worked_examples). sft also "
                                "reads rows of prompt + completion (the target written after the prompt and prefill) "
                                "or chat `messages` (trained on the assistant turns).", DATA)
    eval_dataset_path: str = setting("", "Local JSONL/Parquet evaluation file; overrides `dataset` for eval.", DATA,
                                     resume_may_change=True)
    prompt_column: str = setting("", "Column holding the prompt (text or chat messages) in a data file or hub data "
                                 "set; "
                                 f"empty = the first of {', '.join(PROMPT_COLUMNS)} that the data has.", DATA)
    answer_column: str = setting("", "Column holding the gold answer; empty = the first of "
                                 f"{', '.join(ANSWER_COLUMNS)} that the data has. A GSM8K '#### N' line or a last "
                                 "\\boxed{...} is reduced to the final answer; other columns reach the rewards.", DATA)
    image_column: str = setting("", "Column holding each example's image(s) (a file path relative to the working "
                                "directory, bytes, or a `datasets` Image value; or a list of them): set, `train` runs "
                                "GRPO on image + text prompts with a Qwen2-VL / Qwen2.5-VL model (the `vlm` extra, "
                                "docs/vision.md). The built-in 'shapes' data set keeps its images in 'image'.", DATA)
    arith_max_steps: int = setting(4, "Built-in arith: most operations per problem. 4 = the mix of every template (2-4 "
                                   "steps); 1-3 = running-count stories of 1 to N steps, which a small model can learn "
                                   "(configs/arith.toml uses 1).", DATA, range="[1, 4]", note="4 = every template")
    max_train_samples: int = setting(0, "Use only the first N training examples after shuffling (0 = all).", TUNE,
                                     range=">= 0")
    max_prompt_length: int = setting(512, "Prompts longer than this many tokens are cut from the left, keeping the "
                                     "generation prompt; cuts are counted in the logs.", DATA, range="> 0")
    # Interactive use asks no XML format of the model.
    system_prompt: str = setting(SYSTEM_PROMPT, "System message put before each prompt through the chat template; "
                                 "empty means none.", MODEL_CMDS, per_command={"generate": "", "chat": ""})
    prefill: str = setting("", "Text appended after the generation prompt (e.g. '<reasoning>'); rewards see prefill + "
                           "completion.", DATA)
    worked_examples: int = setting(0, "Worked examples shown after the system prompt (data/prompts.py): this many "
                                   "drawn from the training split with worked_examples_seed, each its question and "
                                   "its worked solution written in the run's format (GSM8K's own solution, arith's, "
                                   "or a 'solution'/'completion' column; data/solutions.py). Never an example whose "
                                   "question is in the evaluation set; the drawn examples are left out of training (their answers "
                                   "are in every prompt). 0 = none.", DATA, range=">= 0", note="0 = none")
    worked_examples_seed: int = setting(0, "Seed of the draw of worked_examples: the same seed, the same prompt. Kept "
                                        "apart from `seed`: runs over several seeds show the same GSM8K or file "
                                        "examples (arith's training split itself follows `seed`).", DATA, range=">= 0")
    worked_examples_text: list[str] = setting([], "Worked examples written out, each shown as is after the system "
                                              "prompt (after any drawn ones); an evaluation question may not appear in "
                                              "one.", DATA)
