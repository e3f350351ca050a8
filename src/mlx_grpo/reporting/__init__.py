"""What a run reports: its JSONL logs and console lines (logs.py), TensorBoard / W&B (reporters.py) and the curves
drawn from the logs (plot.py, `mlx-grpo plot`). It reads the training layer's records; the run health checks, whose
state a checkpoint keeps, are training/health.py."""
