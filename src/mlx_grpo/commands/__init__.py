"""The command entry points, the top layer: the `mlx-grpo` parser (cli.py, options.py) and one module per command
(train.py, sft.py, evaluate.py, inference.py: generate and chat, convert.py, fuse.py), with a run assembled from a
Config (assembly.py); `mlx-grpo plot` is reporting/plot.py's."""
