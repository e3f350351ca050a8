"""The supervised warm start (`mlx-grpo sft`, run by commands/sft.py): its token rows, completion-only (rows.py),
and its steps: the loss, the micro-batched gradient, the update and its checkpoint state (steps.py)."""
