"""Rewrite flat config reads to group reads in the given modules: `cfg.temperature` -> `cfg.rollout.temperature`
(also `self.cfg.`, `trainer.cfg.`, `self.trainer.cfg.`, `t.cfg.`). Mechanical and idempotent, so it can run
again after a merge; `--check` lists what it would change and exits 1 if anything is left.

    python scripts/config_groups.py src/mlx_grpo/commands/train.py src/mlx_grpo/commands/evaluate.py
    python scripts/config_groups.py --check src/mlx_grpo/*.py
    python scripts/config_groups.py --receiver probe --receiver workload bench/adapter_bench.py

Other names (a local `c`, a group passed in) are left alone unless named with --receiver, which only a Config
may be in the files given: review `git diff`. This file and the config package's are skipped.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from mlx_grpo.config import FIELD_GROUP  # noqa: E402

RECEIVERS = ("cfg", "self.cfg", "trainer.cfg", "self.trainer.cfg", "t.cfg")
FIELD_NAMES = "|".join(sorted(FIELD_GROUP, key=len, reverse=True))


def pattern(receivers: tuple[str, ...] = RECEIVERS) -> re.Pattern:
    """`receiver.field`, not preceded by a name or a dot, and not an assignment to it."""
    names = "|".join(re.escape(r) for r in sorted(receivers, key=len, reverse=True))
    return re.compile(r"(?<![\w.])(" + names + r")\.(" + FIELD_NAMES + r")\b(?!\s*=[^=])")


def convert(text: str, receivers: tuple[str, ...] = RECEIVERS) -> tuple[str, int]:
    return pattern(receivers).subn(lambda m: f"{m[1]}.{FIELD_GROUP[m[2]]}.{m[2]}", text)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="+", type=Path)
    parser.add_argument("--check", action="store_true", help="only report; exit 1 if a flat read is left")
    parser.add_argument("--receiver", action="append", default=[], metavar="NAME",
                        help="another name that holds a Config in these files (repeatable), e.g. c or probe")
    args = parser.parse_args()
    left = 0
    for path in args.files:
        if path.resolve().parent.match("mlx_grpo/config") or path.resolve() == Path(__file__).resolve():
            continue  # their docstrings show flat reads on purpose
        text, count = convert(path.read_text(), RECEIVERS + tuple(args.receiver))
        if count:
            print(f"{path}: {count} flat read(s)" + ("" if args.check else " converted"))
            left += count
            if not args.check:
                path.write_text(text)
    return 1 if args.check and left else 0


if __name__ == "__main__":
    raise SystemExit(main())
