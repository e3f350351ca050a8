"""Run by tests/test_distributed.py under mlx.launch (or alone): one update's gradient (all its
accumulation steps) of a data-parallel trainer, written by rank 0 to an .npz file.

    python tests/dist_worker.py OUT.npz key=value ...   (the --set items of a train config)
"""

import sys

import numpy as np
from mlx.utils import tree_flatten

from mlx_grpo.commands.assembly import build_job
from mlx_grpo.config import build_config, parse_set
from mlx_grpo.training.distributed import init_world


def main(out: str, items: list[str]) -> None:
    cfg = build_config("train", overrides=parse_set(items))
    world = init_world(cfg.run.distributed_backend, cfg.run.distributed_timeout)
    job = build_job(cfg, world)
    batches = [job.sampling.batch_step(job.sampling.next_examples()) for _ in range(cfg.training.gradient_accumulation_steps)]
    steps = [job.trainer.score(batch) for batch in batches]
    grads, sums = job.trainer.gradients(steps)
    if world.is_main:
        arrays = {f"grad/{k}": np.array(v) for k, v in tree_flatten(grads)}
        arrays.update({f"sum/{k}": np.array(v) for k, v in sums._asdict().items()})
        np.savez(out, world_size=world.size, **arrays)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
