"""Rewards: the built-in reward functions, loading user reward files, scoring a batch (RewardSet,
RewardScores), the reward workers, HTTP rewards and reward models."""
