"""Vision-language models through mlx-vlm: the families and their checks, images, and GRPO on image + text
prompts (rollouts and the training forward that share each prompt's vision features among its samples). Needs the
`vlm` extra (mlx-vlm). Their commands (conversion, generation and chat, evaluation, a VLM run's Job) are
commands/vision_*.py, and the offline `shapes` task is data/shapes.py, so no folder imports vlm/ both ways."""
