"""Running a user's Python file (reward functions, environments) as a fresh module."""

from __future__ import annotations

import hashlib
import importlib.util
import sys
from pathlib import Path
from typing import Any

from mlx_grpo.base.errors import UserError


def one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())


def import_file(path: Path) -> Any:
    """Execute a user's Python file as a fresh module; its own folder is importable while it loads."""
    digest = hashlib.sha1(str(path).encode()).hexdigest()[:12]
    name = f"mlx_grpo_user_reward_{path.stem}_{digest}"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise UserError(f"reward file {path} cannot be imported as Python (expected a .py file)")
    module = importlib.util.module_from_spec(spec)
    # dataclasses and pickling look the module up in sys.modules while it executes.
    sys.modules[name] = module
    sys.path.insert(0, str(path.parent))
    try:
        spec.loader.exec_module(module)
    except Exception as e:
        sys.modules.pop(name, None)
        raise UserError(f"reward file {path} failed to import: {type(e).__name__}: {one_line(e)}") from e
    finally:
        if str(path.parent) in sys.path:
            sys.path.remove(str(path.parent))
    return module
