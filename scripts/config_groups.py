"""Rewrite flat config reads to group reads in the given modules: `cfg.temperature` -> `cfg.rollout.temperature`
(also `self.cfg.`, `trainer.cfg.`, `self.trainer.cfg.`). Mechanical and idempotent, so it can run again
after a merge; `--check` lists what it would change and exits 1 if anything is left.

    python scripts/config_groups.py src/mlx_grpo/run.py src/mlx_grpo/evaluate.py
    python scripts/config_groups.py --check src/mlx_grpo/*.py

Names other than these receivers (a local `c`, a group passed in) are left alone: review `git diff`. Files of
the config package itself are skipped (their docstrings show the flat aliases on purpose).
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from mlx_grpo.config import FIELD_GROUP  # noqa: E402

RECEIVERS = r"(?<![\w.])((?:self\.trainer\.|self\.|trainer\.)?cfg)"
PATTERN = re.compile(RECEIVERS + r"\.(" + "|".join(sorted(FIELD_GROUP, key=len, reverse=True)) + r")\b(?!\s*=[^=])")


def convert(text: str) -> tuple[str, int]:
    return PATTERN.subn(lambda m: f"{m[1]}.{FIELD_GROUP[m[2]]}.{m[2]}", text)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="+", type=Path)
    parser.add_argument("--check", action="store_true", help="only report; exit 1 if a flat read is left")
    args = parser.parse_args()
    left = 0
    for path in args.files:
        if path.resolve().parent.match("mlx_grpo/config"):
            continue
        text, count = convert(path.read_text())
        if count:
            print(f"{path}: {count} flat read(s)" + ("" if args.check else " converted"))
            left += count
            if not args.check:
                path.write_text(text)
    return 1 if args.check and left else 0


if __name__ == "__main__":
    raise SystemExit(main())
