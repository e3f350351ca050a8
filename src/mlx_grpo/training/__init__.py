"""The GRPO update and where its steps come from: step sources over the sampling stage (sample -> rewards
submitted -> old/reference log-probs), the Trainer (score -> advantages -> gradients -> step), the policies,
the gradient passes, the run health checks (health.py), and the Job that wires a run's parts."""
