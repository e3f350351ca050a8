"""GRPO on image + text prompts on a random-weight Qwen2-VL: rollout tokens/s, step time and peak memory.

Writes a random-weight Qwen2-VL (--shape small: 2B-like widths, 4 layers; 2b: Qwen2-VL-2B's full shape; tiny:
the tests' model) with transformers, converts it with `mlx-grpo convert`, and runs `--updates` GRPO updates on
the built-in shapes task (B prompts x G samples, max_new_tokens decoded), printing one JSON line per update.
    python bench/vlm_bench.py --shape small --updates 3
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

SHAPES = {  # text width/layers/heads/kv heads, vision width/depth
    "tiny": dict(hidden=32, layers=2, vision_depth=1, vision_dim=32),
    "small": dict(hidden=1536, layers=4, vision_depth=4, vision_dim=1280),
    "2b": dict(hidden=1536, layers=28, vision_depth=32, vision_dim=1280),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="small")
    ap.add_argument("--updates", type=int, default=3)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--generations", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--dtype", default="bfloat16")
    args = ap.parse_args()
    from mlx_grpo.base.blas import use_optimized_blas

    use_optimized_blas()
    import mlx.core as mx

    from mlx_grpo.commands.assembly import build_job
    from mlx_grpo.commands.convert import run_convert
    from mlx_grpo.config import build_config
    from mlx_grpo.training.records import UpdateSteps
    from mlx_grpo.vlm.tiny_vlm import write_tiny_vlm

    with tempfile.TemporaryDirectory() as tmp:
        shape = SHAPES[args.shape]
        hf = write_tiny_vlm(Path(tmp) / "hf", max_pixels=112 * 112, **shape)
        model = run_convert(hf_path=str(hf), output_dir=str(Path(tmp) / "mlx"), dtype=args.dtype)
        items = {"model_name": str(model), "dataset": "shapes", "image_column": "image",
                 "batch_size": args.batch_size, "num_generations": args.generations,
                 "max_new_tokens": args.max_new_tokens, "output_dir": str(Path(tmp) / "runs"), "run_name": "b",
                 "train_type": "lora", "model_dtype": args.dtype, "max_prompt_length": 512, "temperature": 1.0,
                 "reward_funcs": "int", "save_steps": 0}
        cfg = build_config("train", None, [(k, str(v)) for k, v in items.items()])
        job = build_job(cfg)
        for update in range(1, args.updates + 1):
            mx.reset_peak_memory()
            t0 = time.perf_counter()
            job.sampling.prompts.new_update()  # a fresh feature table for this update's prompts, as a run does
            steps = [job.sampling.batch_step(job.sampling.next_examples())]
            t_rollout = time.perf_counter() - t0
            result = job.trainer.update(UpdateSteps(steps, job.sampling.position()))
            tokens = int(steps[0].rollout.lengths.sum())
            print(json.dumps({"shape": args.shape, "update": update, "rollout_s": round(t_rollout, 3),
                              "rollout_tokens_per_s": round(tokens / t_rollout, 1),
                              "train_s": round(result.t_train, 3),
                              "step_s": round(time.perf_counter() - t0, 3),
                              "encodings": job.model.table.encodings,
                              "peak_memory_gb": round(mx.get_peak_memory() / 1e9, 3)}), flush=True)


if __name__ == "__main__":
    sys.exit(main())
