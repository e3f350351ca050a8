"""Rollouts: the records a rollout hands on, sampling, the decode loop on the model, the engine over the
sampling copy, and multi-turn episodes over it. Nothing here knows about rewards or the
update's loss; rollout_records lays a rollout's rows out in micro-batches for the training forward (log-prob and
gradient passes)."""
