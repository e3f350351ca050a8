"""The one home of every setting, grouped: each field is declared once, with its default, help text, the
commands it applies to and, where it has them, its choices and range, in its group's module (model.py,
data.py, rollout.py, rewards.py, objective.py, training.py, run.py). Validation (validation.py), the CLI's
flags and --help (cli.py), and the reference table docs/config.md (reference.py) all read those declarations.

    cfg = build_config("train", "configs/arith.toml", parse_set(["rollout.temperature=0.7"]))
    cfg.rollout.temperature          # the one way to read a setting: through its group, what a module takes

Imports go one way: fields <- groups <- root <- validation <- loading <- this package.
"""

from mlx_grpo.config.data import BUILTIN_DATASETS, DataConfig, dataset_kind, unknown_dataset
from mlx_grpo.config.fields import (ANSWER_COLUMNS, BUILTIN_REWARD_NAMES, COMMANDS, DATA, DEFAULT_MODEL,
                                    EPISODE_REWARD_NAMES, PROMPT_COLUMNS, REASONED_REWARD_NAMES,
                                    REASONING_REWARD_NAMES, SYSTEM_PROMPT, TRAIN, TUNE)
from mlx_grpo.config.loading import (RENAMED, build_config, check_key, from_json, parse_set, parse_value, read_toml,
                                     save_json, to_dict)
from mlx_grpo.config.model import ModelConfig
from mlx_grpo.config.objective import ObjectiveConfig
from mlx_grpo.config.rewards import RewardsConfig
from mlx_grpo.config.rollout import COPY_SETTINGS, RolloutConfig
from mlx_grpo.config.root import (COMMAND_DEFAULTS, FIELD_GROUP, FIELDS, GROUPS, RESUME_MAY_CHANGE, Config,
                                  command_default, fields_for)
from mlx_grpo.config.run import EvalConfig, HealthConfig, RunConfig
from mlx_grpo.config.training import OptimizerConfig, TrainingConfig

__all__ = [
    "ANSWER_COLUMNS", "BUILTIN_DATASETS", "BUILTIN_REWARD_NAMES", "COMMANDS", "COMMAND_DEFAULTS", "COPY_SETTINGS", "Config",
    "DATA", "DEFAULT_MODEL", "DataConfig", "EPISODE_REWARD_NAMES", "EvalConfig", "FIELDS", "FIELD_GROUP", "GROUPS",
    "HealthConfig", "ModelConfig", "ObjectiveConfig", "OptimizerConfig", "PROMPT_COLUMNS", "REASONED_REWARD_NAMES",
    "REASONING_REWARD_NAMES", "RENAMED", "RESUME_MAY_CHANGE", "RewardsConfig", "RolloutConfig", "RunConfig",
    "SYSTEM_PROMPT", "TRAIN", "TUNE", "TrainingConfig", "build_config", "check_key", "command_default", "dataset_kind", "fields_for",
    "from_json", "parse_set", "parse_value", "read_toml", "save_json", "to_dict", "unknown_dataset",
]
