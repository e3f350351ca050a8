"""Model loading, conversion (Hugging Face, GGUF) and the embedded default model."""

from mlx_grpo.models.loading import cache_root, default_gguf_path, load_model, resolve_model_path

__all__ = ["cache_root", "default_gguf_path", "load_model", "resolve_model_path"]
