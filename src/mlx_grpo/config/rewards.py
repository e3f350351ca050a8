"""The `rewards` settings (cfg.rewards; TOML [rewards]): the reward functions and their weights, an HTTP
reward server, a reward model, the workers that compute rewards, and DAPO's overlong penalty (a reward
term). Read by the rewards modules."""

from __future__ import annotations

from dataclasses import dataclass

from mlx_grpo.config.fields import (BUILTIN_REWARD_NAMES, EPISODE_REWARD_NAMES, REASONED_REWARD_NAMES,
                                    REASONING_REWARD_NAMES, TRAIN, setting)


@dataclass(frozen=True)
class RewardsConfig:
    """What scores a completion (reward functions, an HTTP server, a reward model, the overlong penalty)
    and where the scoring runs."""

    reward_funcs: list[str] = setting(BUILTIN_REWARD_NAMES, "Reward functions: built-in names "
                                      f"({', '.join(BUILTIN_REWARD_NAMES + REASONED_REWARD_NAMES)}, "
                                      f"{', '.join(REASONING_REWARD_NAMES + EPISODE_REWARD_NAMES)}) or "
                                      "'file.py:function'.", TRAIN)
    reward_weights: list[float] = setting([], "One weight per reward function (empty = all 1.0).", TRAIN)
    reward_url: str = setting("", "HTTP reward server: each batch is POSTed as JSON {prompts, completions, <data "
                              "columns>} and the answer {rewards: [...]} (one float or null per completion) is added "
                              "as the reward 'reward_url'. Loopback hosts only, unless listed in "
                              "reward_url_allowed_hosts. Empty = none.", TRAIN)
    reward_url_weight: float = setting(1.0, "Weight of the reward_url reward.", TRAIN)
    reward_url_timeout: float = setting(30.0, "Seconds to wait for the reward server per request.", TRAIN, range="> 0",
                                        resume_may_change=True)
    reward_url_retries: int = setting(3, "Retries after a timeout, a refused connection or an HTTP 5xx, waiting 0.5, "
                                      "1, 2, ... s between them.", TRAIN, range=">= 0", resume_may_change=True)
    reward_url_allowed_hosts: list[str] = setting([], "Non-loopback hosts reward_url may name (completions are sent to "
                                                  "them).", TRAIN)
    reward_model: str = setting("", "Reward model: an MLX directory (convert --hf-path) or hub id of a Hugging Face "
                                "*ForSequenceClassification checkpoint (llama/mistral/qwen2/qwen3 backbone + score "
                                "head, e.g. Skywork-Reward). It reads each conversation in its own chat template; its "
                                "score is added as the reward 'reward_model'. Empty = none.", TRAIN)
    reward_model_weight: float = setting(1.0, "Weight of the reward_model reward.", TRAIN)
    reward_model_clip: float = setting(3.0, "Reward-model scores are clipped to [-clip, clip].", TRAIN, range="> 0")
    reward_model_answer_weight: float = setting(0.0, "w > 0: also score only the text inside <answer> and use (1 - w) "
                                                "* score + w * answer_score.", TRAIN, range="[0, 1]")
    reward_model_batch_size: int = setting(16, "Conversations per reward-model forward pass.", TRAIN, range=">= 1")
    reward_workers: int = setting(0, "Compute rewards in a pool of this many workers while the GPU goes on (the "
                                  "log-prob passes, the next rollouts of an accumulation group); 0 = inline. The "
                                  "scores, and so the run, are the same either way.", TRAIN,
                                  range=">= 0", note="0 = inline", resume_may_change=True)
    reward_executor: str = setting("thread", "Kind of reward workers: thread (shares memory; for I/O-bound or "
                                   "GIL-releasing rewards, e.g. reward_url) or process (spawned processes that "
                                   "re-import reward files; for CPU-bound Python rewards).", TRAIN,
                                   choices=("thread", "process"), resume_may_change=True)
    overlong_penalty: float = setting(0.0, "DAPO soft overlong punishment added to the reward: 0 up to max_new_tokens "
                                      "- overlong_buffer tokens, then falling linearly to -overlong_penalty at "
                                      "max_new_tokens (DAPO uses 1.0). 0 = off.", TRAIN, range=">= 0", note="0 = off")
    overlong_buffer: int = setting(0, "Length of the overlong_penalty ramp in tokens (DAPO: 4096 of 20480); needed "
                                   "when overlong_penalty > 0.", TRAIN, range=">= 0")
