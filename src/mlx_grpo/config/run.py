"""The `run` settings (cfg.run; TOML [run]): the run directory, seed, time budget, processes, logging,
reporters and checkpoints; `health` (cfg.health; TOML [health]): when a run warns or stops itself; and
`eval` (cfg.eval; TOML [eval]): evaluations during training and by `mlx-grpo eval`."""

from __future__ import annotations

from dataclasses import dataclass

from mlx_grpo.config.fields import DATA, EVAL, SAMPLING, TRAIN, TUNE, setting

# report_to's choices (reporting/reporters.py builds each)
REPORTERS = ("tensorboard", "wandb")


@dataclass(frozen=True)
class RunConfig:
    """The run directory, seed, time budget, processes, logs and checkpoints."""

    output_dir: str = setting("runs", "Directory that holds run directories.", TUNE, resume_may_change=True)
    run_name: str = setting("grpo", "Run directory name under output_dir.", TUNE, per_command={"sft": "sft"},
                            resume_may_change=True)
    seed: int = setting(42, "Random seed for sampling, data order and initialisation.", SAMPLING | {"sft"})
    max_minutes: float = setting(0.0, "Stop training once this many minutes of updates have passed (0 = no limit): the "
                                 "run ends after the update that crosses it (with num_iterations > 1, after that "
                                 "batch's last pass), with its checkpoint. The learning-rate schedule still spans "
                                 "every planned update. Counted per session: a resumed run gets the budget again.",
                                 TUNE, range=">= 0", note="0 = no limit", resume_may_change=True)
    distributed_backend: str = setting("any", "Backend joining the processes that mlx.launch started: any (the one the "
                                       "launcher set up), ring (TCP: Macs, CPUs), mpi, nccl (NVIDIA GPUs) or jaccl "
                                       "(Thunderbolt RDMA); a process started alone trains by itself.", TRAIN,
                                       choices=("any", "ring", "mpi", "nccl", "jaccl"), resume_may_change=True)
    distributed_timeout: float = setting(600.0, "Seconds a rank waits in a collective for the others before it stops "
                                         "with an error naming them (a dead or hung rank); 0 = wait forever. The "
                                         "start-up wait, while ranks load the model, allows at least an hour.", TRAIN,
                                         range=">= 0", note="0 = wait forever", resume_may_change=True)
    logging_steps: int = setting(1, "Print a metrics line every N updates.", TUNE, range=">= 1", resume_may_change=True)
    log_jsonl: bool = setting(True, "Write metrics.jsonl and completions.jsonl in the run directory.", TUNE,
                              resume_may_change=True)
    log_completions_steps: int = setting(10, "Log every completion of one batch step to completions.jsonl every N "
                                         "updates (0 = never).", TRAIN, range=">= 0", resume_may_change=True)
    report_to: list[str] = setting([], "Also send each update's metrics and each evaluation to: tensorboard (event "
                                   "files in the run directory's tensorboard/, for `tensorboard --logdir`; needs the "
                                   "`tensorboard` extra) and/or wandb (Weights & Biases, a run named after the run "
                                   "directory in project $WANDB_PROJECT or 'mlx-grpo'; offline unless logged in or "
                                   "WANDB_MODE is set; needs the `wandb` extra). Empty = only the JSONL files.", TUNE,
                                   choices=REPORTERS, item="reporter", resume_may_change=True)
    save_steps: int = setting(50, "Save a checkpoint every N updates (0 = only at the end).", TUNE, range=">= 0",
                              resume_may_change=True)
    save_total_limit: int = setting(0, "Keep only the newest N checkpoints of the run directory, deleting older ones "
                                    "once a new one is on disk (0 = keep all).", TUNE, range=">= 0",
                                    resume_may_change=True)


@dataclass(frozen=True)
class HealthConfig:
    """When a run warns about, or stops, training that learns nothing (no reward signal, a reward that never
    pays, reward gaming, non-finite steps)."""

    max_consecutive_skips: int = setting(5, "Abort after this many consecutive updates skipped for a non-finite loss "
                                         "or gradient.", TUNE, range=">= 1", resume_may_change=True)
    max_updates_without_signal: int = setting(10, "Stop the run (one line, exit 2) after this many updates in a row in "
                                              "which no reward function gave any signal (each returned None, or one "
                                              "same value, for every completion drawn: every advantage is 0, nothing "
                                              "is learnt); an update where every function returned None stops it at "
                                              "once. 0 = never stop (the warnings still print).", TRAIN, range=">= 0",
                                              resume_may_change=True)
    plateau_updates: int = setting(20, "Warn once when a reward function has paid nothing (None or 0 for every "
                                   "completion) for this many updates in a row while another one paid: the model never "
                                   "produces what it rewards (the format plateau). 0 = off.", TRAIN, range=">= 0",
                                   resume_may_change=True)
    gaming_evals: int = setting(3, "Warn once when, over the last this-many evaluations, the training reward rose "
                                "(mean reward_mean of the updates before the last evaluation above that before the "
                                "first by > 1.96 standard errors) while eval accuracy did not rise above the first "
                                "one's 95 percent Wilson interval: the reward is being earned without solving the "
                                "task. Needs eval_every_updates; 0 = off.", TRAIN, resume_may_change=True)


@dataclass(frozen=True)
class EvalConfig:
    """Evaluation: during training (eval_every_updates) and by `mlx-grpo eval`."""

    eval_every_updates: int = setting(0, "Evaluate greedy accuracy every N updates (0 = off); sft also evaluates after "
                                      "its last update.", TUNE, range=">= 0", resume_may_change=True)
    eval_subset_size: int = setting(50, "Examples in the fixed, seeded eval subset.", DATA, range="> 0",
                                    resume_may_change=True)
    eval_max_new_tokens: int = setting(256, "Maximum new tokens per eval answer.", DATA, range="> 0",
                                       resume_may_change=True)
    eval_batch_size: int = setting(32, "Questions answered together in one batched decode during evaluation (more rows "
                                   "cost little extra time per step on a GPU; bounds memory).", DATA, range="> 0",
                                   resume_may_change=True)
    eval_num_samples: int = setting(1, "Samples per eval question; >1 reports pass@k at `temperature`.", EVAL,
                                    range=">= 1", resume_may_change=True)
    eval_worked_examples: bool = setting(True, "Evaluate with the run's worked examples in the prompt; false = the "
                                         "system prompt alone (what training taught, without the examples).", DATA)
    eval_steps: int = setting(0, "Legacy: also evaluate every N batch steps (0 = off).", TRAIN, range=">= 0",
                              resume_may_change=True)
    eval_samples: int = setting(0, "Legacy: examples for eval_steps evaluations (0 = eval_subset_size).", TRAIN,
                                range=">= 0", resume_may_change=True)
