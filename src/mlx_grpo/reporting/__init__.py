"""What a run reports: its JSONL logs and console lines (logs.py), TensorBoard / W&B (reporters.py), the run health
warnings (health.py) and the curves drawn from the logs (plot.py, `mlx-grpo plot`)."""
