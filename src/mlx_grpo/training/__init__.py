"""The GRPO update: the Trainer (sample -> score -> advantages -> log-probs -> gradients -> step), the
policies it samples and anchors with, and the gradient passes."""
