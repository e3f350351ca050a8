"""The one home of every setting: defaults, help texts, parsing (TOML + --set), validation.

Sources, in increasing precedence: field defaults < per-command defaults < TOML file (`--config`)
< command-line flags and `--set key=value`. Every field names the commands it applies to. A preset
file serves several commands (`train` and `eval` read the same TOML), so its keys for other commands
are type-checked and skipped; on the command line such a key is an error.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import tomllib
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mlx_grpo.errors import UserError

SYSTEM_PROMPT = (
    "\nRespond in the following format:\n\n<reasoning>\n...\n</reasoning>\n<answer>\n...\n</answer>\n"
)
DEFAULT_MODEL = "smollm2-135m-instruct"
# Columns searched, in order, for the prompt and the gold answer of a data file or hub data set (sources.py).
PROMPT_COLUMNS = ("prompt", "question", "problem", "query", "instruction", "input")
ANSWER_COLUMNS = ("answer", "solution", "final_answer", "ground_truth", "target", "output", "label")
BUILTIN_REWARD_NAMES = ["correctness", "int", "strict_format", "soft_format", "xmlcount"]
# Built-ins for the R1-style <think>/<answer> format (configs/reasoning.toml), not in the default list.
REASONING_REWARD_NAMES = ["think_format", "think_tags"]
# Rewards that empty reasoning or a made-up answer cannot earn (configs/prod.toml, configs/arith.toml).
REASONED_REWARD_NAMES = ["reasoned_correctness", "reasoned_format"]
# GSM8K's own "#### N" answers (nanochat), and the reward an environment gives (multiturn.py).
EPISODE_REWARD_NAMES = ["hash_answer", "environment_reward"]

INFER = frozenset({"generate", "chat"})
MODEL_CMDS = frozenset({"generate", "chat", "train", "eval", "sft"})
SAMPLING = frozenset({"generate", "chat", "train", "eval"})
TRAIN = frozenset({"train"})
# Training settings that mean the same for `mlx-grpo sft`, the supervised warm start (sft.py).
TUNE = frozenset({"train", "sft"})
DATA = frozenset({"train", "eval", "sft"})
COMMANDS = ("convert", "generate", "chat", "train", "eval", "sft", "fuse", "plot")


def _f(default: Any, help: str, commands: frozenset[str]) -> Any:
    """A config field: its default, its help text and the commands it applies to."""
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata={"help": help, "commands": commands})
    return field(default=default, metadata={"help": help, "commands": commands})


@dataclass
class Config:
    # --- model ---
    model_name: str = _f(DEFAULT_MODEL, "Model: 'smollm2-135m-instruct' (embedded default, offline), an MLX "
                         "model directory, a checkpoint directory, or a Hugging Face hub id.", MODEL_CMDS)
    model_dtype: str = _f("auto", "Compute dtype of the model's float weights (forward, backward, rollouts): "
                          "auto, float32, bfloat16 or float16. auto = bfloat16 for the embedded default on a GPU "
                          "or Apple Silicon (float32 on a CPU, where MLX's bfloat16 matmuls are ~30x slower), "
                          "the stored dtype for any other model. Training keeps float32 master weights "
                          "(master_weights).", MODEL_CMDS)
    master_weights: bool = _f(True, "Mixed precision: keep a float32 master copy of the trained weights (and "
                              "AdamW's state in float32) when model_dtype is bfloat16/float16; AdamW updates the "
                              "masters and the compute weights are refreshed from them after every update. "
                              "Without it, steps below half a bfloat16 spacing (most steps at learning rates "
                              "~1e-6..1e-5) round away: such a run is refused, naming the share lost. Costs 4 "
                              "bytes per trained weight (plus AdamW's 8 in float32 instead of 4).", TUNE)
    system_prompt: str = _f(SYSTEM_PROMPT, "System message put before each prompt through the chat template; "
                            "empty means none.", MODEL_CMDS)
    # --- sampling (rollouts, generate, chat) ---
    max_new_tokens: int = _f(256, "Maximum number of tokens generated per completion (eval: "
                             "eval_max_new_tokens).", INFER | TRAIN)
    temperature: float = _f(1.0, "Sampling temperature; 0 is greedy. Training log-probs use the same "
                            "temperature as the sampler.", SAMPLING)
    top_p: float = _f(1.0, "Nucleus sampling: keep the smallest token set with this total probability "
                      "(1.0 = off).", SAMPLING)
    top_k: int = _f(0, "Sample only among the k most likely tokens (0 = off).", SAMPLING)
    min_p: float = _f(0.0, "Drop tokens whose probability is below min_p times the top token's (0 = off).",
                      SAMPLING)
    repetition_penalty: float = _f(1.0, "Penalty for tokens in the last 20 tokens (1.0 = off).", INFER)
    seed: int = _f(42, "Random seed for sampling, data order and initialisation.", SAMPLING | {"sft"})
    # --- data ---
    dataset: str = _f("arith", "Data set: 'arith' (built-in, offline arithmetic word problems), 'gsm8k' "
                      "(openai/gsm8k from the Hugging Face hub), a JSONL/Parquet file (serves train and eval), a "
                      "saved data set directory or a hub id 'owner/name' (those two need the `data` extra). "
                      "Ignored where a *_dataset_path is set.", DATA)
    prompt_column: str = _f("", "Column holding the prompt (text or chat messages) in a data file or hub data set; "
                            f"empty = the first of {', '.join(PROMPT_COLUMNS)} that the data has.", DATA)
    answer_column: str = _f("", "Column holding the gold answer; empty = the first of "
                            f"{', '.join(ANSWER_COLUMNS)} that the data has. A GSM8K '#### N' line or a last "
                            "\\boxed{...} is reduced to the final answer; other columns reach the rewards.", DATA)
    # --- vision-language models (vlm/; docs/vision.md) ---
    image_column: str = _f("", "Column holding each example's image(s) (a file path relative to the working "
                           "directory, bytes, or a `datasets` Image value; or a list of them): set, `train` runs "
                           "GRPO on image + text prompts with a Qwen2-VL / Qwen2.5-VL model (the `vlm` extra). "
                           "The built-in 'shapes' data set keeps its images in 'image'.", DATA)
    train_vision: bool = _f(False, "With image_column: train the vision tower too (full: its weights; lora/dora: "
                            "adapters on the language model plus the whole tower). Off: the tower stays frozen and "
                            "each prompt's images are encoded once per rollout.", TRAIN)
    arith_max_steps: int = _f(4, "Built-in arith: most operations per problem. 4 = the mix of every template "
                              "(2-4 steps); 1-3 = running-count stories of 1 to N steps, which a small model "
                              "can learn (configs/arith.toml uses 1).", DATA)
    dataset_path: str = _f("", "Local JSONL/Parquet training file (GSM8K form or prompt/answer); overrides "
                           "`dataset` for training (and, in eval, for drawing the worked_examples). sft also "
                           "reads rows of prompt + completion (the target written after the prompt and prefill) "
                           "or chat `messages` (trained on the assistant turns).", DATA)
    eval_dataset_path: str = _f("", "Local JSONL/Parquet evaluation file; overrides `dataset` for eval.", DATA)
    max_train_samples: int = _f(0, "Use only the first N training examples after shuffling (0 = all).", TUNE)
    max_prompt_length: int = _f(512, "Prompts longer than this many tokens are cut from the left, keeping "
                                "the generation prompt; cuts are counted in the logs.", DATA)
    prefill: str = _f("", "Text appended after the generation prompt (e.g. '<reasoning>'); rewards see "
                      "prefill + completion.", DATA)
    worked_examples: int = _f(0, "Worked examples shown after the system prompt (prompts.py): this many drawn from "
                              "the training split with worked_examples_seed, each its question and its worked "
                              "solution written in the run's format (GSM8K's own solution, arith's, or a "
                              "'solution'/'completion' column; solutions.py). Never an example whose question is "
                              "in the evaluation set; the drawn examples are left out of training (their answers "
                              "are in every prompt). 0 = none.", DATA)
    worked_examples_seed: int = _f(0, "Seed of the draw of worked_examples: the same seed, the same prompt. Kept "
                                   "apart from `seed`: runs over several seeds show the same GSM8K or file "
                                   "examples (arith's training split itself follows `seed`).", DATA)
    worked_examples_text: list[str] = _f([], "Worked examples written out, each shown as is after the system "
                                         "prompt (after any drawn ones); an evaluation question may not appear "
                                         "in one.", DATA)
    eval_worked_examples: bool = _f(True, "Evaluate with the run's worked examples in the prompt; false = the "
                                    "system prompt alone (what training taught, without the examples).", DATA)
    # --- rewards ---
    reward_funcs: list[str] = _f(BUILTIN_REWARD_NAMES, "Reward functions: built-in names "
                                 f"({', '.join(BUILTIN_REWARD_NAMES + REASONED_REWARD_NAMES + REASONING_REWARD_NAMES)}, "
                                 f"{', '.join(EPISODE_REWARD_NAMES)}) or "
                                 "'file.py:function'.", TRAIN)
    reward_weights: list[float] = _f([], "One weight per reward function (empty = all 1.0).", TRAIN)
    reward_url: str = _f("", "HTTP reward server: each batch is POSTed as JSON {prompts, completions, <data "
                         "columns>} and the answer {rewards: [...]} (one float or null per completion) is added "
                         "as the reward 'reward_url'. Loopback hosts only, unless listed in "
                         "reward_url_allowed_hosts. Empty = none.", TRAIN)
    reward_url_weight: float = _f(1.0, "Weight of the reward_url reward.", TRAIN)
    reward_url_timeout: float = _f(30.0, "Seconds to wait for the reward server per request.", TRAIN)
    reward_url_retries: int = _f(3, "Retries after a timeout, a refused connection or an HTTP 5xx, waiting "
                                 "0.5, 1, 2, ... s between them.", TRAIN)
    reward_url_allowed_hosts: list[str] = _f([], "Non-loopback hosts reward_url may name (completions are "
                                             "sent to them).", TRAIN)
    reward_model: str = _f("", "Reward model: an MLX directory (convert --hf-path) or hub id of a Hugging Face "
                           "*ForSequenceClassification checkpoint (llama/mistral/qwen2/qwen3 backbone + score "
                           "head, e.g. Skywork-Reward). It reads each conversation in its own chat template; "
                           "its score is added as the reward 'reward_model'. Empty = none.", TRAIN)
    reward_model_weight: float = _f(1.0, "Weight of the reward_model reward.", TRAIN)
    reward_model_clip: float = _f(3.0, "Reward-model scores are clipped to [-clip, clip].", TRAIN)
    reward_model_answer_weight: float = _f(0.0, "w > 0: also score only the text inside <answer> and use "
                                           "(1 - w) * score + w * answer_score.", TRAIN)
    reward_model_batch_size: int = _f(16, "Conversations per reward-model forward pass.", TRAIN)
    reward_workers: int = _f(0, "Compute rewards in a pool of this many workers while the GPU goes on (the "
                             "log-prob passes, the next rollouts of an accumulation group); 0 = inline. The "
                             "scores, and so the run, are the same either way.", TRAIN)
    reward_executor: str = _f("thread", "Kind of reward workers: thread (shares memory; for I/O-bound or "
                              "GIL-releasing rewards, e.g. reward_url) or process (spawned processes that "
                              "re-import reward files; for CPU-bound Python rewards).", TRAIN)
    stop: list[str] = _f([], "Extra stop strings: a completion ends after the token that completes one (in "
                         "training rollouts and in evaluation).", DATA)
    max_minutes: float = _f(0.0, "Stop training once this many minutes of updates have passed (0 = no limit): "
                            "the run ends after the update that crosses it, with its checkpoint. The learning-rate schedule still spans every planned update. Counted "
                            "per session: a resumed run gets the budget again.", TUNE)
    # --- tools and environments (multiturn.py) ---
    tools: list[str] = _f([], "Tools the model may call during rollouts and evaluation: calculator (safe "
                          "arithmetic), python (code in a sandboxed subprocess), 'module:function' or "
                          "'file.py:function' (a typed, documented function). Empty = single-turn.", DATA)
    tool_format: str = _f("auto", "Tool-call syntax: auto (nanochat's python tokens for nanochat models, the chat "
                          "template's <tool_call> JSON where it has one, else plain <calc>/<tool> tags), "
                          "hermes, nanochat or plain.", DATA)
    max_tool_turns: int = _f(4, "Tool calls per completion; the model's turn after the last one gets no tool "
                             "answer. max_new_tokens counts every token of every turn, tool output included.", DATA)
    environment: str = _f("", "Multi-turn environment 'file.py:ClassName' (a subclass of "
                          "mlx_grpo.environments.Environment); list the reward 'environment_reward' in reward_funcs to "
                          "train on the rewards it gives. Empty = none.", DATA)
    # --- run ---
    distributed_backend: str = _f("any", "Backend joining the processes that mlx.launch started: any (the one "
                                  "the launcher set up), ring (TCP: Macs, CPUs), mpi, nccl (NVIDIA GPUs) or jaccl "
                                  "(Thunderbolt RDMA); a process started alone trains by itself.", TRAIN)
    distributed_timeout: float = _f(600.0, "Seconds a rank waits in a collective for the others before it stops "
                                    "with an error naming them (a dead or hung rank); 0 = wait forever. The "
                                    "start-up wait, while ranks load the model, allows at least an hour.", TRAIN)
    output_dir: str = _f("runs", "Directory that holds run directories.", TUNE)
    run_name: str = _f("grpo", "Run directory name under output_dir.", TUNE)
    num_epochs: int = _f(1, "Passes over the training data.", TUNE)
    batch_size: int = _f(4, "Prompts per batch step (B), across all ranks of a data-parallel run (each takes "
                         "batch_size / ranks of them). sft: examples per batch step.", TUNE)
    num_generations: int = _f(8, "Completions sampled per prompt (G); advantages are normalised within "
                              "each group of G.", TRAIN)
    gradient_accumulation_steps: int = _f(1, "Batch steps per optimizer update.", TUNE)
    micro_batch_size: int = _f(16, "Sequences per forward/backward chunk in log-prob and training passes; "
                               "bounds memory, does not change results.", TUNE)
    micro_batch_tokens: int = _f(8192, "Most padded prompt+completion tokens per forward/backward chunk "
                                 "(0 = no limit): bounds memory whatever the batch size; does not change "
                                 "results.", TUNE)
    # --- optimisation ---
    learning_rate: float = _f(1e-6, "Peak AdamW learning rate.", TUNE)
    lr_scheduler_type: str = _f("cosine", "Learning-rate schedule after warmup: cosine, linear or constant.",
                                TUNE)
    warmup_ratio: float = _f(0.1, "Fraction of the run's updates spent in linear warmup.", TUNE)
    adam_beta1: float = _f(0.9, "AdamW beta1.", TUNE)
    adam_beta2: float = _f(0.99, "AdamW beta2.", TUNE)
    weight_decay: float = _f(0.0, "AdamW decoupled weight decay.", TUNE)
    max_grad_norm: float = _f(1.0, "Clip the global gradient norm to this (0 = no clipping).", TUNE)
    clip_eps: float = _f(0.2, "PPO clipping range for the probability ratio.", TRAIN)
    kl_coeff: float = _f(0.04, "Weight of the KL penalty to the reference model (0 = no reference model).",
                         TRAIN)
    kl_estimator: str = _f("k3", "Per-token KL estimator for the penalty (Schulman 2020, 'Approximating KL "
                           "divergence'): k3 = exp(ref - logp) - (ref - logp) - 1, unbiased, low variance, always "
                           ">= 0 (DeepSeekMath/GRPO); k1 = logp - ref, unbiased but high variance and can be "
                           "negative; as a loss its expected gradient on fresh samples is 0, so it pulls "
                           "towards the reference only weakly. Needs kl_coeff > 0.", TRAIN)
    # --- objective variants (README, "The algorithm and its variants") ---
    loss_type: str = _f("grpo", "How token losses are averaged. grpo: mean over each sequence's tokens, then "
                        "over sequences (DeepSeekMath, Shao et al. 2024); bnpo: sum over the batch step's "
                        "tokens / their number; dr_grpo: sum / (sequences x max_new_tokens), no length bias "
                        "(Dr. GRPO, Liu et al. 2025 'Understanding R1-Zero-like training'); dapo: token mean "
                        "over the whole accumulated update (DAPO, Yu et al. 2025). Use dapo or dr_grpo for "
                        "long reasoning, where grpo under-weights each token of a long answer.", TRAIN)
    scale_rewards: str = _f("group", "Advantage scaling after subtracting the group mean: group = divide by "
                            "the group's reward std (GRPO); batch = by the std of the batch step's rewards "
                            "(more robust for near-flat groups); none = no division (Dr. GRPO recommends "
                            "none: the std division over-weights easy and hard prompts).", TRAIN)
    clip_eps_high: float = _f(0.0, "Upper clip range: the ratio is clipped to [1 - clip_eps, 1 + clip_eps_high] "
                              "(DAPO 'clip-higher', Yu et al. 2025, uses 0.28 with clip_eps 0.2: lets rare "
                              "good tokens grow, keeps entropy from collapsing). 0 = same as clip_eps. Like all "
                              "clipping it acts only when the ratio can leave 1: num_iterations >= 2, "
                              "update_every >= 2 or quantize_for_rollouts.", TRAIN)
    delta: float = _f(0.0, "Two-sided clipping: for negative advantages the ratio is also capped at delta "
                      "(> 1 + clip_eps_high), bounding the loss when the policy has moved far from the "
                      "sampler (INTELLECT-2, Prime Intellect 2025; e.g. 4.0). 0 = off. Needs an off-policy ratio, as "
                      "clip_eps_high.", TRAIN)
    importance_sampling_level: str = _f("token", "token: one importance ratio per token (PPO/GRPO); sequence: "
                                        "one length-normalised ratio per completion, exp(mean of token "
                                        "log-ratios), clipped per sequence (GSPO, Zheng et al. 2025; stabler "
                                        "for long answers and MoE models; use a small clip_eps such as "
                                        "3e-4 / clip_eps_high 4e-4). On-policy (num_iterations = update_every = 1) the ratio is 1 "
                                        "and GSPO equals GRPO, so it needs num_iterations >= 2 (as in the "
                                        "paper) or update_every >= 2.", TRAIN)
    mask_truncated_completions: bool = _f(False, "Leave completions cut by max_new_tokens out of the loss "
                                          "(DAPO's overlong filtering): an unfinished answer is not "
                                          "evidence against its reasoning. Their rewards still enter the "
                                          "group's advantages.", TRAIN)
    overlong_penalty: float = _f(0.0, "DAPO soft overlong punishment added to the reward: 0 up to "
                                 "max_new_tokens - overlong_buffer tokens, then falling linearly to "
                                 "-overlong_penalty at max_new_tokens (DAPO uses 1.0). 0 = off.", TRAIN)
    overlong_buffer: int = _f(0, "Length of the overlong_penalty ramp in tokens (DAPO: 4096 of 20480); needed "
                              "when overlong_penalty > 0.", TRAIN)
    dynamic_sampling: bool = _f(False, "DAPO dynamic sampling: drop groups whose rewards are all equal (they "
                                "give no gradient) and draw more prompts until the batch step has "
                                "batch_size informative groups or max_resample_batches extra draws were "
                                "made. Consumes more prompts per step; the run (and the learning-rate "
                                "schedule, which follows the data consumed) ends when the data does.",
                                TRAIN)
    max_resample_batches: int = _f(3, "With dynamic_sampling: most extra draws of batch_size prompts per batch "
                                   "step; a step still short trains on the groups it has.", TRAIN)
    demonstrations: str = _f("off", "Off-policy guidance in the group (LUFFY, Yan et al. 2025 'Learning to "
                             "Reason under Off-Policy Guidance'). zero_groups: when no completion of a group earns "
                             "anything (reward > 0; of demo_reward when set), its last completion is replaced by "
                             "the example's reference solution in the run's format (the data's 'completion' column "
                             "verbatim, prefill included; else GSM8K's worked solution or the one arith writes, "
                             "converted: solutions.py), scored by the same rewards and "
                             "trained with the clipped PPO ratio against the rollout policy's teacher-forced "
                             "log-probs, outside the rollout correction (docs/algorithms-demonstrations.md). "
                             "Logged as demo_fraction. off: never. Single-turn runs only.", TRAIN)
    demo_reward: str = _f("", "With demonstrations: the reward function (as named in reward_funcs; a custom "
                          "one by its function name) that no completion of a group may have earned for the "
                          "group to get a demonstration, e.g. reasoned_correctness; empty = the total reward.",
                          TRAIN)
    rollout_correction: str = _f("none", "Truncated importance sampling on the sampler ratio exp(trainer "
                                 "log-prob - sampler log-prob) of each sampled token (TIS, Yao et al. 2025 'Your "
                                 "efficient RL framework secretly brings you off-policy RL training'; TRL's "
                                 "vllm_importance_sampling_mode, verl's rollout_is): none; token_truncate = each "
                                 "token's loss times min(ratio, cap); token_mask = times the ratio, 0 where it "
                                 "exceeds cap; sequence_truncate / sequence_mask = the same with one ratio per "
                                 "completion (exp of the summed token differences). Corrects for the rollout engine's "
                                 "decoding differing from the training pass (half-precision kernels); with "
                                 "quantize_for_rollouts the old policy is the quantized copy, whose difference "
                                 "enters the clipped PPO ratio instead. The mismatch is logged either way "
                                 "(sampler_kl). Not with lora_dropout.", TRAIN)
    rollout_correction_cap: float = _f(2.0, "Cap C of rollout_correction's ratio (TRL's default 2.0).", TRAIN)
    num_iterations: int = _f(1, "Optimizer passes over each rollout batch.", TRAIN)
    update_every: int = _f(1, "Refresh the sampling (old) policy from the trained model every N updates.",
                           TRAIN)
    quantize_for_rollouts: bool = _f(False, "Sample from a 4-bit (group 64) copy of the old policy, "
                                     "re-quantized at each refresh. Measured 20x slower than float weights "
                                     "on MLX 0.32's CUDA backend (BENCHMARKS.md).", TRAIN)
    rollout_engine: str = _f("auto", "Where rollouts (and eval) decode. copy: a sampling copy of the policy (q/k/v "
                             "and gate/up fused, LoRA/DoRA merged, one compiled graph per step; llama, mistral, "
                             "qwen2, qwen3 with unquantized weights; costs one more copy of the layer weights); "
                             "model: the model itself through mlx-lm's modules; auto: copy on NVIDIA GPUs, model "
                             "elsewhere (off CUDA the copy has no fused attention kernel yet).", TUNE)
    # --- parameter-efficient training ---
    train_type: str = _f("full", "full: train every weight; lora: low-rank adapters on the chosen "
                         "projections (Hu et al. 2021); dora: weight-decomposed adapters (Liu et al. 2024). "
                         "With lora/dora the base weights stay frozen and shared by the sampler and the KL "
                         "reference (the adapters switched off), and checkpoints hold only the adapters. "
                         "Use a ~10x higher learning_rate than for full training.", TUNE)
    lora_rank: int = _f(16, "Rank of each adapter (lora/dora).", TUNE)
    lora_alpha: float = _f(32.0, "Adapter scale numerator: the update is (alpha / rank) * B @ A.", TUNE)
    lora_dropout: float = _f(0.0, "Dropout on the adapters' input in the gradient pass (0 = off). RL trainers "
                             "usually keep it off: the sampler and old-policy passes run without it, so ratios "
                             "start away from 1, and its masks depend on the micro-batch split. Not with "
                             "grad_checkpoint (the recomputed layer would draw another mask).", TUNE)
    lora_layers: int = _f(0, "Adapt the last N transformer blocks (0 = all).", TUNE)
    lora_keys: list[str] = _f([], "Projections to adapt, as named inside a block, e.g. self_attn.q_proj, "
                              "mlp.down_proj (empty = every linear layer of the block).", TUNE)
    load_in_bits: int = _f(0, "QLoRA (Dettmers et al. 2023): quantize the frozen base to 4 or 8 bits (group "
                           "64) at load time, adapters on top in float; 0 = keep the base as loaded. A model "
                           "already quantized on disk trains with lora/dora as it is.", TUNE)
    use_compile: bool = _f(False, "Compile the loss/gradient step with mx.compile.", TRAIN)
    grad_checkpoint: bool = _f(False, "Recompute each transformer layer in the backward pass instead of "
                               "keeping its activations: training memory drops to about the layers' inputs, "
                               "for ~1/3 more compute. Same results.", TUNE)
    max_updates_without_signal: int = _f(10, "Stop the run (one line, exit 2) after this many updates in a row "
                                         "in which no reward function gave any signal (each returned None, or "
                                         "one same value, for every completion drawn: every advantage is 0, "
                                         "nothing is learnt); an update where every function returned None "
                                         "stops it at once. 0 = never stop (the warnings still print).", TRAIN)
    plateau_updates: int = _f(20, "Warn once when a reward function has paid nothing (None or 0 for every "
                              "completion) for this many updates in a row while another one paid: the model "
                              "never produces what it rewards (the format plateau). 0 = off.", TRAIN)
    gaming_evals: int = _f(3, "Warn once when, over the last this-many evaluations, the training reward rose "
                           "(mean reward_mean of the updates before the last evaluation above that before the "
                           "first by > 1.96 standard errors) while eval accuracy did not rise above the first "
                           "one's 95 percent Wilson interval: the reward is being earned without solving the task. "
                           "Needs eval_every_updates; 0 = off.", TRAIN)
    max_consecutive_skips: int = _f(5, "Abort after this many consecutive updates skipped for a non-finite "
                                    "loss or gradient.", TUNE)
    # --- logging, checkpoints, eval ---
    logging_steps: int = _f(1, "Print a metrics line every N updates.", TUNE)
    log_jsonl: bool = _f(True, "Write metrics.jsonl and completions.jsonl in the run directory.", TUNE)
    log_completions_steps: int = _f(10, "Log every completion of one batch step to completions.jsonl every "
                                    "N updates (0 = never).", TRAIN)
    report_to: list[str] = _f([], "Also send each update's metrics and each evaluation to: tensorboard (event "
                              "files in the run directory's tensorboard/, for `tensorboard --logdir`; needs the "
                              "`tensorboard` extra) and/or wandb (Weights & Biases, a run named after the run "
                              "directory in project $WANDB_PROJECT or 'mlx-grpo'; offline unless logged in or "
                              "WANDB_MODE is set; needs the `wandb` extra). Empty = only the JSONL files.", TUNE)
    save_steps: int = _f(50, "Save a checkpoint every N updates (0 = only at the end).", TUNE)
    save_total_limit: int = _f(0, "Keep only the newest N checkpoints of the run directory, deleting older ones "
                               "once a new one is on disk (0 = keep all).", TUNE)
    eval_every_updates: int = _f(0, "Evaluate greedy accuracy every N updates (0 = off); sft also evaluates "
                                 "after its last update.", TUNE)
    eval_subset_size: int = _f(50, "Examples in the fixed, seeded eval subset.", DATA)
    eval_max_new_tokens: int = _f(256, "Maximum new tokens per eval answer.", DATA)
    eval_batch_size: int = _f(32, "Questions answered together in one batched decode during evaluation "
                              "(more rows cost little extra time per step on a GPU; bounds memory).", DATA)
    eval_steps: int = _f(0, "Legacy: also evaluate every N batch steps (0 = off).", TRAIN)
    eval_samples: int = _f(0, "Legacy: examples for eval_steps evaluations (0 = eval_subset_size).", TRAIN)
    eval_num_samples: int = _f(1, "Samples per eval question; >1 reports pass@k at `temperature`.",
                               frozenset({"eval"}))


FIELDS: dict[str, dataclasses.Field] = {f.name: f for f in dataclasses.fields(Config)}
# Keys of older versions and the field that replaced them (an alias that only had to equal its field).
RENAMED = {"max_completion_length": "max_new_tokens"}

# Where a command's natural default differs from training's (interactive use is greedy, no XML prompt).
COMMAND_DEFAULTS: dict[str, dict[str, Any]] = {
    "generate": {"temperature": 0.0, "system_prompt": ""},
    "chat": {"temperature": 0.0, "system_prompt": ""},
    "eval": {"temperature": 0.0},
    # Supervised steps follow one fixed target, not sampled rewards: a larger step is safe.
    "sft": {"run_name": "sft", "learning_rate": 1e-5},
}

# ----------------------------------------------------------------------------- parsing

_TRUE = {"true", "1", "yes", "on"}
_FALSE = {"false", "0", "no", "off"}


def _type_name(tp: Any) -> str:
    return {str: "a string", int: "an integer", float: "a number", bool: "a boolean (true/false)",
            list[str]: "a list of strings", list[float]: "a list of numbers"}.get(tp, str(tp))


def _field_type(name: str) -> Any:
    return typing.get_type_hints(Config)[name]


def _parse_scalar(tp: Any, value: Any) -> Any:
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, int) and value in (0, 1):
            return bool(value)
        if isinstance(value, str) and value.strip().lower() in _TRUE | _FALSE:
            return value.strip().lower() in _TRUE
        raise ValueError
    if tp is int:
        if isinstance(value, bool):
            raise ValueError
        if isinstance(value, int):
            return value
        number = float(value) if isinstance(value, (str, float)) else None
        if number is None or not math.isfinite(number) or number != int(number):
            raise ValueError
        if isinstance(value, str) and not any(c in value.lower() for c in ".e"):
            return int(value)
        return int(number)
    if tp is float:
        if isinstance(value, bool):
            raise ValueError
        number = float(value)
        if not math.isfinite(number):
            raise ValueError
        return number
    if tp is str:
        if not isinstance(value, str):
            raise ValueError
        return value
    raise TypeError(tp)


def parse_value(name: str, value: Any) -> Any:
    """Convert a TOML value or a --set string to the field's type, or raise UserError saying why."""
    tp = _field_type(name)
    try:
        if typing.get_origin(tp) is list:
            (item_tp,) = typing.get_args(tp)
            if isinstance(value, str):
                text = value.strip()
                if text.startswith("["):
                    value = json.loads(text)
                else:
                    value = [part.strip() for part in text.split(",") if part.strip()]
            if not isinstance(value, list):
                raise ValueError
            return [_parse_scalar(item_tp, v) for v in value]
        return _parse_scalar(tp, value)
    except (ValueError, TypeError, json.JSONDecodeError):
        raise UserError(f"config key '{name}' expects {_type_name(tp)}, got {value!r}") from None


def _nearest(name: str, candidates: list[str]) -> str:
    match = difflib.get_close_matches(name, candidates, n=1, cutoff=0.4)
    return f"; did you mean '{match[0]}'?" if match else f"; valid keys: {', '.join(sorted(candidates))}"


def check_key(name: str, command: str, source: str) -> None:
    if name in RENAMED:
        raise UserError(f"config key '{name}' ({source}) is gone: set {RENAMED[name]} instead")
    if name not in FIELDS:
        raise UserError(f"unknown config key '{name}' in {source}{_nearest(name, list(FIELDS))}")
    if command not in FIELDS[name].metadata["commands"]:
        users = ", ".join(sorted(FIELDS[name].metadata["commands"]))
        raise UserError(f"config key '{name}' ({source}) does not apply to '{command}' (used by: {users})")


def read_toml(path: str | Path) -> dict[str, Any]:
    """Flat keys, or the same keys under a [mlx_grpo] table."""
    path = Path(path)
    if path.is_dir():
        tomls = sorted(p.name for p in path.glob("*.toml"))
        raise UserError(f"config {path} is a directory, not a TOML file" + (
            f": pass one of its files ({', '.join(tomls[:5])}{', ...' if len(tomls) > 5 else ''})" if tomls else ""))
    if not path.is_file():
        raise UserError(f"config file not found: {path}")
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise UserError(f"config file {path} is not valid TOML: {exc}") from None
    if "mlx_grpo" in data:
        if set(data) != {"mlx_grpo"} or not isinstance(data["mlx_grpo"], dict):
            raise UserError(f"config file {path}: put every key inside the [mlx_grpo] table or none")
        data = data["mlx_grpo"]
    return data


def parse_set(items: list[str]) -> list[tuple[str, str]]:
    pairs = []
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise UserError(f"--set expects key=value, got {item!r}")
        pairs.append((key.strip(), value))
    return pairs


def build_config(command: str, toml_path: str | None = None,
                 overrides: list[tuple[str, Any]] | None = None) -> Config:
    """Resolve defaults < command defaults < TOML < overrides (flags, --set), then validate."""
    values: dict[str, Any] = dict(COMMAND_DEFAULTS.get(command, {}))
    if toml_path is not None:
        for key, value in read_toml(toml_path).items():
            if key in FIELDS and command not in FIELDS[key].metadata["commands"]:
                parse_value(key, value)  # still type-checked; a preset serves several commands
                continue
            check_key(key, command, f"config file {toml_path}")
            values[key] = parse_value(key, value)
    for key, value in overrides or []:
        check_key(key, command, "--set" if isinstance(value, str) else "command line")
        values[key] = parse_value(key, value)
    config = Config(**values)
    validate(config, command)
    return config


def validate(config: Config, command: str) -> None:
    """validation.py's rules for `command` (imported here: they read this module's defaults)."""
    from mlx_grpo.validation import check

    check(config, command)


def command_default(command: str, name: str) -> Any:
    if name in COMMAND_DEFAULTS.get(command, {}):
        return COMMAND_DEFAULTS[command][name]
    f = FIELDS[name]
    return f.default_factory() if f.default is dataclasses.MISSING else f.default


def fields_for(command: str) -> list[str]:
    return [name for name, f in FIELDS.items() if command in f.metadata["commands"]]


def to_dict(config: Config) -> dict[str, Any]:
    return dataclasses.asdict(config)


def save_json(config: Config, path: str | Path, extra: dict[str, Any] | None = None) -> None:
    """Write the resolved config (plus per-invocation options) as JSON."""
    data = to_dict(config)
    if extra:
        data = {**data, "command_options": extra}
    Path(path).write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def from_json(path: str | Path, command: str = "train") -> Config:
    """Load a resolved config saved by save_json (checkpoints), re-validated."""
    data = json.loads(Path(path).read_text())
    data.pop("command_options", None)
    for key in RENAMED:  # older runs saved these aliases; they always equalled their field
        data.pop(key, None)
    for key in data:
        if key not in FIELDS:
            raise UserError(f"unknown config key '{key}' in {path}{_nearest(key, list(FIELDS))}")
    config = Config(**{key: parse_value(key, value) for key, value in data.items()})
    validate(config, command)
    return config
