"""The settings as people read them, generated from their declarations: each field's --help text (its help,
choices and range) and docs/config.md, the reference table by group. tests/test_config.py compares
docs/config.md with `markdown()`, so the page cannot go stale; regenerate it with

    python -m mlx_grpo.config.reference > docs/config.md
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from mlx_grpo.config.fields import COMMANDS, choice_notes, choices_of, default_of, range_words
from mlx_grpo.config.root import FIELD_GROUP, FIELDS, GROUPS


def field_help(f: dataclasses.Field, limits: bool = True) -> str:
    """The help text with the declared choices and range appended (what --help shows); without `limits`,
    only choices that are declared with a description (the table has a column for the rest)."""
    text = f.metadata["help"]
    if f.metadata["choices"] and (limits or choice_notes(f)):
        notes = choice_notes(f)
        listed = "; ".join(f"{k}: {v}" for k, v in notes.items()) if notes else ", ".join(map(str, choices_of(f)))
        text += f" One of: {listed}."
    if f.metadata["range"] and limits:
        text += f" Range: {range_words(f)}."
    if f.metadata["resume_may_change"] and limits:
        text += " May differ from the checkpoint's on --resume."
    return text


def _default(value: Any) -> str:
    return json.dumps(value) if isinstance(value, (list, str)) else str(value)


def _cell(text: str) -> str:
    """Markdown table cell: pipes escaped, tags shown as text."""
    return text.replace("|", "\\|").replace("<", "&lt;").replace(">", "&gt;")


def markdown() -> str:
    """docs/config.md: every field by group, with its default, commands, choices/range and help."""
    lines = [
        "# Configuration reference",
        "",
        "Generated from the declarations in `src/mlx_grpo/config/` (`python -m mlx_grpo.config.reference > "
        "docs/config.md`); tests/test_config.py fails when this page differs from them. "
        "[docs/training.md](training.md) explains how a run uses them.",
        "",
        "A field is set in a `--config` TOML file, flat (`temperature = 0.7`) or in its group's table "
        "(`[rollout]` then `temperature = 0.7`), either way optionally inside an `[mlx_grpo]` table; on the "
        "command line as `--set temperature=0.7`, `--set rollout.temperature=0.7` or the flag "
        "`--temperature 0.7`. Code reads it from its group: `cfg.rollout.temperature`. Field names are unique "
        "across groups. Defaults are training's; `generate`, `chat`, `eval` and `sft` change a few "
        "(`mlx-grpo <command> --help` shows each command's).",
        "",
        "Groups: " + ", ".join(f"[{g}](#{g})" for g in GROUPS) + ".",
    ]
    for group, cls in GROUPS.items():
        lines += ["", f"## {group}", "", " ".join((cls.__doc__ or "").split()), "",
                  "| Field | Default | Commands | Choices / range | On --resume | What it does |",
                  "|---|---|---|---|---|---|"]
        for name, f in FIELDS.items():
            if FIELD_GROUP[name] != group:
                continue
            commands = ", ".join(c for c in COMMANDS if c in f.metadata["commands"])
            limits = ", ".join(f"`{c}`" for c in choices_of(f)) if f.metadata["choices"] else ""
            if f.metadata["range"]:
                limits = (limits + "; " if limits else "") + _cell(range_words(f))
            default = f"`{_default(default_of(f))}`" + "".join(
                f"; {command}: `{_default(value)}`" for command, value in f.metadata["per_command"].items())
            default = default.replace("|", "\\|")  # code spans: tags stay as written
            resume = "may change" if f.metadata["resume_may_change"] else ""
            lines.append(f"| `{name}` | {default} | {commands} | {limits} | {resume} | {_cell(field_help(f, False))} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(markdown(), end="")
