"""Run one mlx-grpo command with MLX's buffer cache capped, so that two runs can share one GPU: each
process otherwise keeps freed buffers cached up to its memory limit (two runs side by side on an 80 GB
H100 ran out of memory at ~18 GB of live arrays each).

usage: python bench/with_cache_limit.py GIB <mlx-grpo arguments...>
"""

import sys

import mlx.core as mx

from mlx_grpo.commands.cli import main

if __name__ == "__main__":
    mx.set_cache_limit(int(float(sys.argv[1]) * 2 ** 30))
    sys.exit(main(sys.argv[2:]))
