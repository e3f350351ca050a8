"""mlx-grpo: GRPO fine-tuning of language models on MLX."""

__version__ = "0.1.0"
