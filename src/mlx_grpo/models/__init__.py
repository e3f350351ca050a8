"""Model loading, conversion (Hugging Face, GGUF) and the embedded default model."""

from mlx_grpo.models.model_loading import default_gguf_path, load_model, resolve_model_path

__all__ = ["default_gguf_path", "load_model", "resolve_model_path"]
