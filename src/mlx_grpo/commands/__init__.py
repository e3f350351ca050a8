"""The command entry points, the top layer: the `mlx-grpo` parser (cli.py, options.py) and one module per command
(train.py, sft.py, evaluate.py, inference.py: generate and chat, convert.py, fuse.py; vision_*.py: the same for
vision-language models), with a run assembled from a Config (assembly.py, vision_job.py); `mlx-grpo plot` is
reporting/plot.py's."""
