"""Rollouts: the records a rollout hands on, sampling, the decode loop on the model, the engine over the
sampling copy, and multi-turn episodes over it. Nothing here knows about rewards or the update."""
