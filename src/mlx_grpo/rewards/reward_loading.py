"""Reward functions by name: a built-in (builtin.py) or a user's ``path/to/file.py:function``, whose file
is executed as a fresh module (base/user_files.py; environment files are loaded the same way)."""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any

from mlx_grpo.base.errors import UserError
from mlx_grpo.base.user_files import import_file
from mlx_grpo.rewards.builtin import BUILTIN_REWARDS, RewardFn


def _callables_in(module: Any) -> list[str]:
    """Public callables defined in the module itself (not the ones it imported)."""
    names = []
    for attr, value in vars(module).items():
        if attr.startswith("_") or not callable(value):
            continue
        if getattr(value, "__module__", None) == module.__name__:
            names.append(attr)
    return sorted(names)


def load_reward_function(spec: str, base_dir: Path | None = None) -> RewardFn:
    """Load ``"path/to/file.py:function_name"``; a relative path is taken from base_dir (default: cwd)."""
    file_part, sep, func_name = spec.rpartition(":")
    if not sep or not file_part or not func_name:
        raise UserError(f"custom reward '{spec}' must look like path/to/file.py:function_name")
    path = Path(file_part).expanduser()
    if not path.is_absolute():
        path = (base_dir if base_dir is not None else Path.cwd()) / path
    if not path.is_file():
        raise UserError(f"reward file not found: {path} (from reward '{spec}')")
    module = import_file(path.resolve())
    if not hasattr(module, func_name):
        found = ", ".join(_callables_in(module)) or "none"
        raise UserError(f"reward file {path} has no function '{func_name}' (callables found: {found})")
    fn = getattr(module, func_name)
    if not callable(fn):
        raise UserError(f"reward '{spec}': {func_name} is a {type(fn).__name__}, not a function")
    return fn


def _unknown_reward(name: str) -> UserError:
    close = difflib.get_close_matches(name, list(BUILTIN_REWARDS), n=1, cutoff=0.0)
    hint = f"did you mean '{close[0]}'? " if close else ""
    valid = ", ".join(BUILTIN_REWARDS)
    return UserError(
        f"unknown reward function '{name}' ({hint}built-ins: {valid}; custom: path/to/file.py:function)"
    )


def resolve_reward(name: str, base_dir: Path | None) -> tuple[str, RewardFn]:
    """A name with ':' is a custom file spec (keyed by its function name); anything else is a built-in."""
    if ":" in name:
        return name.rpartition(":")[2], load_reward_function(name, base_dir)
    if name not in BUILTIN_REWARDS:
        raise _unknown_reward(name)
    return name, BUILTIN_REWARDS[name]
