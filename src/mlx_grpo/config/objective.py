"""The `objective` settings (cfg.objective; TOML [objective]): the loss that turns scored groups into
gradients: loss aggregation (loss.LOSS_TYPES), advantage scaling, clipping, KL, importance sampling and
rollout correction, off-policy passes, demonstrations. Read by loss.py and the update."""

from __future__ import annotations

from dataclasses import dataclass

from mlx_grpo.config.fields import TRAIN, setting


def loss_types():
    """loss.LOSS_TYPES, the one declaration of the loss types. Imported when first needed: loss.py imports
    mlx.core, which the CLI may load only after choosing a BLAS (blas.py)."""
    from mlx_grpo.loss import LOSS_TYPES

    return LOSS_TYPES


def loss_own_fields() -> dict[str, tuple[str, ...]]:
    """{loss type: the settings only its policy term reads} from loss.LOSSES (imported when first needed, as
    loss_types)."""
    from mlx_grpo.loss import LOSSES

    return {name: tuple(t.fields) for name, t in LOSSES.items()}


@dataclass(frozen=True)
class ObjectiveConfig:
    """The loss that turns scored groups into gradients, and its variants: aggregation, advantage scaling,
    clipping, KL, importance sampling, rollout correction, off-policy passes, demonstrations."""

    loss_type: str = setting("grpo", "The objective: a per-token policy term and how token losses are averaged, one of "
                             "the types declared in loss.py's LOSSES (docs/algorithms.md; a wrong name lists them "
                             "all). grpo (DeepSeekMath, Shao et al. 2024): clipped surrogate, mean over each "
                             "sequence's tokens, then over sequences; dapo (DAPO, Yu et al. 2025), bnpo and dr_grpo "
                             "(Dr. GRPO, Liu et al. 2025): token mean over the update, the batch step, or sum / "
                             "(sequences x max_new_tokens), for long reasoning, where grpo under-weights each token of "
                             "a long answer; cispo (MiniMax-M1 2025): clipped, detached IS weight x A x logp, token "
                             "mean; sapo (SAPO, Qwen 2025): a soft temperature gate instead of the clip.", TRAIN,
                             choices=loss_types)
    cispo_cap: float = setting(5.0, "loss_type = cispo: the IS weight is sg(min(ratio, cispo_cap)) (MiniMax-M1, arXiv "
                               "2506.13585; TRL's epsilon_high under cispo; ScaleRL recommends 5.0). >= 1; acts only "
                               "off-policy (num_iterations >= 2 or update_every >= 2).", TRAIN, range=">= 1")
    sapo_temperature_pos: float = setting(1.0, "loss_type = sapo: gate temperature for tokens with A > 0 (SAPO, arXiv "
                                          "2511.20347; TRL's name): larger = harder gate, off-policy tokens fade "
                                          "faster.", TRAIN)
    sapo_temperature_neg: float = setting(1.05, "loss_type = sapo: gate temperature for tokens with A <= 0; SAPO uses a "
                                          "larger one than for A > 0 (negative updates destabilise more).", TRAIN)
    scale_rewards: str = setting("group", "Advantage scaling after subtracting the group mean: group = divide by the "
                                 "group's reward std (GRPO); batch = by the std of the batch step's rewards (more "
                                 "robust for near-flat groups); none = no division (Dr. GRPO recommends none: the std "
                                 "division over-weights easy and hard prompts).", TRAIN,
                                 choices=("group", "batch", "none"))
    clip_eps: float = setting(0.2, "PPO clipping range for the probability ratio.", TRAIN, range="(0, 1)")
    clip_eps_high: float = setting(0.0, "Upper clip range: the ratio is clipped to [1 - clip_eps, 1 + clip_eps_high] "
                                   "(DAPO 'clip-higher', Yu et al. 2025, uses 0.28 with clip_eps 0.2: lets rare good "
                                   "tokens grow, keeps entropy from collapsing). 0 = same as clip_eps. Like all "
                                   "clipping it acts only when the ratio can leave 1: num_iterations >= 2, "
                                   "update_every >= 2 or quantize_for_rollouts.", TRAIN,
                                   range="[0, 10)", note="0 = same as clip_eps")
    delta: float = setting(0.0, "Two-sided clipping: for negative advantages the ratio is also capped at delta (> 1 + "
                           "clip_eps_high), bounding the loss when the policy has moved far from the sampler "
                           "(INTELLECT-2, Prime Intellect 2025; e.g. 4.0). 0 = off. Needs an off-policy ratio, as "
                           "clip_eps_high.", TRAIN)
    importance_sampling_level: str = setting("token", "token: one importance ratio per token (PPO/GRPO); sequence: one "
                                             "length-normalised ratio per completion, exp(mean of token log-ratios), "
                                             "clipped per sequence (GSPO, Zheng et al. 2025; stabler for long answers "
                                             "and MoE models; use a small clip_eps such as 3e-4 / clip_eps_high 4e-4). "
                                             "On-policy (num_iterations = update_every = 1) the ratio is 1 and GSPO "
                                             "equals GRPO, so it needs num_iterations >= 2 (as in the paper) or "
                                             "update_every >= 2.", TRAIN, choices=("token", "sequence"))
    kl_coeff: float = setting(0.04, "Weight of the KL penalty to the reference model (0 = no reference model).", TRAIN,
                              range=">= 0")
    kl_estimator: str = setting("k3", "Per-token KL estimator for the penalty (Schulman 2020, 'Approximating KL "
                                "divergence'): k3 = exp(ref - logp) - (ref - logp) - 1, unbiased, low variance, always "
                                ">= 0 (DeepSeekMath/GRPO); k1 = logp - ref, unbiased but high variance and can be "
                                "negative; as a loss its expected gradient on fresh samples is 0, so it pulls towards "
                                "the reference only weakly. Needs kl_coeff > 0.", TRAIN, choices=("k3", "k1"))
    teacher_model: str = setting("", "On-policy distillation: the teacher, a model that scores every token the student "
                                 "samples (a local MLX directory, a hub id or a `train`/`sft` checkpoint; quantized "
                                 "weights are fine: a 4-bit teacher costs a quarter of the memory). It must use the "
                                 "student's tokenizer. Needs distill_coeff > 0; or teacher_url instead "
                                 "(docs/distillation.md).", TRAIN)
    teacher_url: str = setting("", "On-policy distillation with a served teacher, instead of teacher_model: an "
                               "OpenAI-compatible completions endpoint (vLLM's http://127.0.0.1:8000/v1/completions). "
                               "Each row's prompt + completion token ids are POSTed as the prompt with echo and "
                               "logprobs, and the answer's prompt log-probs (choices[0].prompt_logprobs or "
                               "logprobs.token_logprobs) score the sampled tokens. The server must use the student's "
                               "tokenizer (checked through its /tokenize where it has one). Served log-probs are "
                               "untempered, so it needs temperature = 1. Loopback hosts only, unless listed in "
                               "teacher_url_allowed_hosts (docs/distillation.md).", TRAIN)
    teacher_url_timeout: float = setting(60.0, "Seconds to wait for the teacher server per request (one row each).",
                                         TRAIN, range="> 0", resume_may_change=True)
    teacher_url_retries: int = setting(3, "Retries after a timeout, a refused connection or an HTTP 5xx from the "
                                       "teacher server, waiting 0.5, 1, 2, ... s between them.", TRAIN, range=">= 0",
                                       resume_may_change=True)
    teacher_url_allowed_hosts: list[str] = setting([], "Non-loopback hosts teacher_url may name (prompts and "
                                                   "completions are sent to them).", TRAIN)
    distill_coeff: float = setting(0.0, "On-policy distillation: weight of the teacher's per-token signal in each "
                                   "sampled token's advantage, A_it = A_i + distill_coeff * (log p_teacher - log "
                                   "p_student): the negated reverse KL to the teacher on the student's own samples "
                                   "(Thinking Machines 2025; TRL's DistillationTrainer). 0 = GRPO alone; with "
                                   "reward_funcs = [] the teacher is the only signal (pure distillation). Needs "
                                   "teacher_model or teacher_url.", TRAIN, range=">= 0")
    distill_topk: int = setting(0, "On-policy distillation's top-k forward KL (GKD, Agarwal et al. 2024): at every "
                                "sampled completion token the teacher's k most likely next tokens, and the loss "
                                "adds distill_topk_coeff * sum_i q_i (log q_i - log p_student(i)) over them, q the "
                                "teacher's probabilities renormalised over its top k; it teaches tokens the student "
                                "rarely samples (a tool call), which the sampled-token reverse KL of distill_coeff "
                                "cannot. Costs 8 bytes per token per k for the teacher's top k of a batch step "
                                "(docs/distillation.md). 0 = off. Needs distill_coeff > 0; teacher_url's server must "
                                "return k log-probs per token (vLLM: --max-logprobs >= k).", TRAIN,
                                range=">= 0", note="0 = off")
    distill_topk_coeff: float = setting(1.0, "Weight of distill_topk's forward-KL term in the loss, averaged over "
                                        "tokens as the policy term is (loss_type's normalisation).", TRAIN,
                                        range="> 0")
    mask_truncated_completions: bool = setting(False, "Leave completions cut by max_new_tokens out of the loss (DAPO's "
                                               "overlong filtering): an unfinished answer is not evidence against its "
                                               "reasoning. Their rewards still enter the group's advantages.", TRAIN)
    rollout_correction: str = setting("none", "Truncated importance sampling on the sampler ratio exp(trainer log-prob "
                                      "- sampler log-prob) of each sampled token (TIS, Yao et al. 2025 'Your efficient "
                                      "RL framework secretly brings you off-policy RL training'; TRL's "
                                      "vllm_importance_sampling_mode, verl's rollout_is): none; token_truncate = each "
                                      "token's loss times min(ratio, cap); token_mask = times the ratio, 0 where it "
                                      "exceeds cap; sequence_truncate / sequence_mask = the same with one ratio per "
                                      "completion (exp of the summed token differences). Corrects for the rollout "
                                      "engine's decoding differing from the training pass (half-precision kernels), and "
                                      "for async_rollouts' batches sampled one update stale; "
                                      "with quantize_for_rollouts the old policy is the quantized copy, whose "
                                      "difference enters the clipped PPO ratio instead. The mismatch is logged either "
                                      "way (sampler_kl). Not with lora_dropout.", TRAIN,
                                      choices=("none", "token_truncate", "token_mask", "sequence_truncate",
                                               "sequence_mask"))
    rollout_correction_cap: float = setting(2.0, "Cap C of rollout_correction's ratio (TRL's default 2.0).", TRAIN,
                                            range="> 1", note="TRL uses 2.0")
    num_iterations: int = setting(1, "Optimizer passes over each rollout batch.", TRAIN, range=">= 1")
    update_every: int = setting(1, "Refresh the sampling (old) policy from the trained model every N updates.", TRAIN,
                                range=">= 1")
    demonstrations: str = setting("off", "Off-policy guidance in the group (LUFFY, Yan et al. 2025 'Learning to Reason "
                                  "under Off-Policy Guidance'). zero_groups: when no completion of a group earns "
                                  "anything (reward > 0; of demo_reward when set), its last completion is replaced by "
                                  "the example's reference solution in the run's format (the data's 'completion' "
                                  "column verbatim, prefill included; else GSM8K's worked solution or the one arith "
                                  "writes, converted: data/solutions.py), scored by the same rewards and trained "
                                  "with the clipped PPO ratio against the rollout policy's teacher-forced log-probs, outside "
                                  "the rollout correction (docs/algorithms-demonstrations.md). Logged as "
                                  "demo_fraction. off: never. Single-turn runs only.", TRAIN,
                                  choices=("off", "zero_groups"))
    demo_reward: str = setting("", "With demonstrations: the reward function (as named in reward_funcs; a custom one "
                               "by its function name) that no completion of a group may have earned for the group to "
                               "get a demonstration, e.g. reasoned_correctness; empty = the total reward.", TRAIN)
