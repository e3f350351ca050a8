"""The `rollout` settings (cfg.rollout; TOML [rollout]): how completions are sampled (also by generate, chat
and eval), how many per prompt, which groups are kept, tool calls and environments, and which engine
decodes. Read by the rollout modules (engine, sampling, multi-turn, tools)."""

from __future__ import annotations

from dataclasses import dataclass

from mlx_grpo.config.fields import DATA, INFER, SAMPLING, TRAIN, TUNE, setting

# The sampling copy's own settings (its running batch, its loop's syncs, its step): they act only where the copy
# samples, which validation refuses where it cannot (rollout_engine = model, quantize_for_rollouts) and a run says
# where the device or the model rules it out (commands/assembly.build_job).
COPY_SETTINGS = ("running_rows", "lookahead", "decode_graph")


@dataclass(frozen=True)
class RolloutConfig:
    """How completions are sampled (training rollouts; also generate, chat and eval), how many per prompt,
    which groups are kept, tool calls and environments, and the engine that decodes them."""

    max_new_tokens: int = setting(256, "Maximum number of tokens generated per completion (eval: eval_max_new_tokens).",
                                  INFER | TRAIN, range="> 0")
    # Interactive use and evaluation are greedy by default; training samples.
    temperature: float = setting(1.0, "Sampling temperature; 0 is greedy. Training log-probs use the same temperature "
                                 "as the sampler.", SAMPLING, range=">= 0", note="0 = greedy",
                                 per_command={"generate": 0.0, "chat": 0.0, "eval": 0.0})
    top_p: float = setting(1.0, "Nucleus sampling: keep the smallest token set with this total probability (1.0 = "
                           "off).", SAMPLING, range="(0, 1]", note="1.0 = off")
    top_k: int = setting(0, "Sample only among the k most likely tokens (0 = off).", SAMPLING,
                         range=">= 0", note="0 = off")
    min_p: float = setting(0.0, "Drop tokens whose probability is below min_p times the top token's (0 = off).",
                           SAMPLING, range="[0, 1)", note="0 = off")
    repetition_penalty: float = setting(1.0, "Penalty for tokens in the last 20 tokens (1.0 = off).", INFER,
                                        range="> 0", note="1.0 = off")
    stop: list[str] = setting([], "Extra stop strings: a completion ends after the token that completes one (in "
                              "training rollouts and in evaluation).", DATA)
    num_generations: int = setting(8, "Completions sampled per prompt (G); advantages are normalised within each group "
                                   "of G.", TRAIN,
                                   range=">= 2",
                                   note="group-relative advantages need at least two completions per prompt")
    dynamic_sampling: bool = setting(False, "DAPO dynamic sampling: drop groups whose rewards are all equal (they give "
                                     "no gradient) and draw more prompts until the batch step has batch_size "
                                     "informative groups or max_resample_batches extra draws were made. Consumes more "
                                     "prompts per step; the run (and the learning-rate schedule, which follows the "
                                     "data consumed) ends when the data does.", TRAIN)
    max_resample_batches: int = setting(3, "With dynamic_sampling: most extra draws of batch_size prompts per batch "
                                        "step; a step still short trains on the groups it has.", TRAIN, range=">= 0")
    draws_per_pass: int = setting(1, "With dynamic_sampling: most draws decoded together in one pass (a wave sized "
                                  "by the run's varied-group rate; the groups trained on are those of drawing one "
                                  "at a time). 1 = one at a time. A pass's draws start together up to running_rows "
                                  "(default: the first draw's rows), the later ones taking the slots of rows that "
                                  "end, so a pass costs less than its draws one after another where decode is "
                                  "host-bound (a GPU); "
                                  "configs/prod_tools.toml with 4 (and running_rows = 1024): 40.8-45.4 GB at the "
                                  "peak in its chains on one H200 (sessions 38-40).",
                                  TRAIN, range=">= 1")
    carry_surplus: bool = setting(False, "With dynamic_sampling: up to batch_size - 1 varied groups a batch step drew "
                                  "beyond its batch_size are trained by the next batch step, ahead of its new "
                                  "draws, instead of dropped, so a pass of several draws (draws_per_pass > 1) that "
                                  "overshoots its deficit is not wasted. Each is trained once; a checkpoint drops "
                                  "them (in the run that writes it as in a run resumed from it, so resume stays "
                                  "exact), and so does the end of the data. Those carried into the next update were "
                                  "sampled num_iterations optimizer steps before it (more with update_every > 1), "
                                  "which rollout_correction weights back (required).", TRAIN)
    dynamic_sampling_reward: str = setting("", "With dynamic_sampling: the reward function (as named in reward_funcs; a "
                                           "custom one by its function name) whose scores must differ within a group "
                                           "for the group to be kept, e.g. reasoned_correctness: DAPO keeps the groups "
                                           "whose accuracy is neither 0 nor 1, not those that differ only in format. "
                                           "None counts as 0, so a group where the function never applies is "
                                           "dropped. Empty = the total reward.", TRAIN)
    tools: list[str] = setting([], "Tools the model may call during rollouts and evaluation: calculator (safe "
                               "arithmetic), python (code in a sandboxed subprocess), 'module:function' or "
                               "'file.py:function' (a typed, documented function). Empty = single-turn.", DATA)
    tool_format: str = setting("auto", "Tool-call syntax: auto (nanochat's python tokens for nanochat models, the chat "
                               "template's <tool_call> JSON where it has one, else plain <calc>/<tool> tags), hermes, "
                               "nanochat or plain.", DATA, choices=("auto", "hermes", "nanochat", "plain"))
    max_tool_turns: int = setting(4, "Tool calls per completion; the model's turn after the last one gets no tool "
                                  "answer. max_new_tokens counts every token of every turn, tool output included.",
                                  DATA, range=">= 1")
    environment: str = setting("", "Multi-turn environment 'file.py:ClassName' (a subclass of "
                               "mlx_grpo.tools.environments.Environment); list the reward 'environment_reward' in "
                               "reward_funcs to train on the rewards it gives. Empty = none.", DATA)
    rollout_engine: str = setting("auto", "Where rollouts (and eval) decode. copy: a sampling copy of the policy "
                                  "(q/k/v and gate/up fused, LoRA/DoRA merged, one compiled graph per step; llama, "
                                  "mistral, qwen2, qwen3 with unquantized weights; costs one more copy of the layer "
                                  "weights); model: the model itself through mlx-lm's modules; auto: copy on NVIDIA "
                                  "GPUs, model elsewhere (off CUDA the copy has no fused attention kernel yet).", TUNE,
                                  choices=("auto", "copy", "model"), resume_may_change=True)
    decode_graph: bool = setting(False, "The sampling copy's decode step with fewer primitives per step "
                                 "(models/compiled_decode.py: 2-D hidden state, transposed matrices, the cache slot "
                                 "a device array; one trace per cache capacity). Same tokens and log-probs as "
                                 "without it on CPU in float32 (tests); costs a copy of o_proj/down_proj. Off by "
                                 "default: on an H100 its step is 1.3x faster at 256 rows but slower at 1,024, and "
                                 "the standard GRPO step's rollout did not move (docs/benchmarks-history.md, issue "
                                 "25, third sitting). Needs the copy (rollout_engine = copy, or auto on NVIDIA GPUs) "
                                 "without quantize_for_rollouts.", TRAIN, resume_may_change=True)
    running_rows: int = setting(0, "Rows the sampling copy starts its running batch with (as vLLM's max_num_seqs; "
                                "per rank), of the batch steps one decode holds (dynamic sampling's draws in a pass, "
                                "draws_per_pass, else an update's gradient_accumulation_steps), the rest taking the "
                                "slots of rows that end; a refill that rebuilds the batch pads it to a power of two "
                                "(at least 8), which the memory check of training's rollouts counts. In-run evaluation, "
                                "on the same engine, starts at most this many of its rows (at least one prompt's). 0 = "
                                "one batch step's rows (batch_size x num_generations). "
                                "Where a decode step costs "
                                "about the same at more rows (a GPU: host-bound), a wider batch decodes a pass of "
                                "several draws in fewer steps, at the memory of the wider KV cache; a row's tokens "
                                "depend on its key and context, not on this (exactly on a CPU in float32). Needs the "
                                "copy (rollout_engine = copy, or auto on NVIDIA GPUs); not with image_column.", TRAIN,
                                range=">= 0",
                                resume_may_change=True)
    lookahead: int = setting(0, "The sampling copy's syncs (every 8 decode steps) read whether rows ended as of this "
                             "many steps before them, so their host work (stop checks, tool turns handed over, "
                             "refills) can run while those steps are still on the device (rollout/loop.py). The same "
                             "tokens (on a CPU in float32; log-probs up to the rounding of rows batched "
                             "differently); rows join and leave the running batch up to this many steps later. "
                             "In-run evaluation on the same engine too. 0 = the sync reads the step it follows. "
                             "Measured on one H200 (bench/records/h200-session43-20261129/): the calculator's 4-draw "
                             "pass of 1,024 rows 5.45-5.59 s with 4, 5.61-5.88 s with 0 (not interleaved); "
                             "prod_tools' updates 8.51 s with 4, 8.45 s with 0 (within their noise): not settled, "
                             "the presets keep 0. Needs the copy (rollout_engine = copy, or auto on NVIDIA GPUs, "
                             "without quantize_for_rollouts), async_rollouts = 0 and no image_column.", TRAIN,
                             range="[0, 7]", resume_may_change=True)
    async_rollouts: int = setting(0, "1: the next update's rollouts decode in a background thread, from the weights "
                                  "this update starts from, while this update trains (training/prefetch.py): every "
                                  "batch after the first is sampled one update stale (rollout_staleness in "
                                  "metrics.jsonl), which rollout_correction weights back, so it needs rollout_correction "
                                  "!= none. 0: sample, then train, in turn. Not with dynamic_sampling, num_iterations > "
                                  "1, update_every > 1, quantize_for_rollouts, demonstrations or image_column.", TRAIN,
                                  range="[0, 1]")
    rollout_worker: str = setting("thread", "Where async_rollouts' rollouts decode. thread: a thread of the "
                                  "training process; process: a process of its own (rollout/process.py), sent the "
                                  "trainable weights through a shared file after each update, with MLX's buffer cache "
                                  "capped at a tenth of the device's memory in each process; on an H100 it gave 1.22x "
                                  "the synchronous run's updates per minute where the thread gave 0.92-1.07x, and "
                                  "used ~55 GB of GPU memory against ~31-34 GB (docs/benchmarks-history.md, tenth sitting). "
                                  "process: single-turn rollouts (no tools or environment), one training process (no "
                                  "data parallelism), a model that pickles.", TRAIN, choices=("thread", "process"),
                                  resume_may_change=True)
    quantize_for_rollouts: bool = setting(False, "Sample from a 4-bit (group 64) copy of the old policy, re-quantized "
                                          "at each refresh. Measured 20x slower than float weights on MLX 0.32's CUDA "
                                          "backend (BENCHMARKS.md).", TRAIN)
