"""`Config`: one frozen record of the setting groups (cfg.model, cfg.data, cfg.rollout, ...) and the registry
of groups and fields. A setting is read one way, through its group: cfg.rollout.temperature.

A field's name is unique across groups, so `temperature`, `rollout.temperature` and a [rollout] table's
`temperature` name one field: flat names stay valid input (TOML keys, --set, Config(temperature=...),
dataclasses.replace(cfg, temperature=...)), and a stored config (config.resolved.json) stays one flat dict.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from mlx_grpo.config.data import DataConfig
from mlx_grpo.config.fields import default_of
from mlx_grpo.config.model import ModelConfig
from mlx_grpo.config.objective import ObjectiveConfig
from mlx_grpo.config.rewards import RewardsConfig
from mlx_grpo.config.rollout import RolloutConfig
from mlx_grpo.config.run import EvalConfig, HealthConfig, RunConfig
from mlx_grpo.config.training import OptimizerConfig, TrainingConfig

# The groups in the order of --help and docs/config.md: what is trained, on what, how it samples, how it is
# scored, the loss, the step, the batches, the run around it, its health checks, evaluation.
GROUPS: dict[str, type] = {
    "model": ModelConfig, "data": DataConfig, "rollout": RolloutConfig, "rewards": RewardsConfig,
    "objective": ObjectiveConfig, "optimizer": OptimizerConfig, "training": TrainingConfig, "run": RunConfig,
    "health": HealthConfig, "eval": EvalConfig,
}
# Every field by its (unique) name, in group order; and the group that holds it.
FIELDS: dict[str, dataclasses.Field] = {}
FIELD_GROUP: dict[str, str] = {}
for _group, _cls in GROUPS.items():
    for _f in dataclasses.fields(_cls):
        if _f.name in FIELDS or _f.name in GROUPS:
            raise TypeError(f"config field '{_f.name}' of [{_group}] is declared twice (or names a group)")
        FIELDS[_f.name], FIELD_GROUP[_f.name] = _f, _group
del _group, _cls, _f


@dataclass(frozen=True, init=False)
class Config:
    """Every setting of a command, by group. Build with build_config (loading.py), which validates;
    `Config(**flat)` and `dataclasses.replace(cfg, field=value)` take flat field names too."""

    model: ModelConfig
    data: DataConfig
    rollout: RolloutConfig
    rewards: RewardsConfig
    objective: ObjectiveConfig
    optimizer: OptimizerConfig
    training: TrainingConfig
    run: RunConfig
    health: HealthConfig
    eval: EvalConfig

    def __init__(self, **values: Any) -> None:
        """Groups by name (model=ModelConfig(...)) and/or flat fields (temperature=0.7), the latter applied
        on top of their group (this is what dataclasses.replace(cfg, temperature=0.7) passes)."""
        changes: dict[str, dict[str, Any]] = {}
        for name, value in values.items():
            if name in GROUPS:
                continue
            if name not in FIELD_GROUP:
                raise TypeError(f"Config has no field {name!r}")
            changes.setdefault(FIELD_GROUP[name], {})[name] = value
        for group, cls in GROUPS.items():
            part = values.get(group)
            if part is None:
                part = cls()
            elif not isinstance(part, cls):
                raise TypeError(f"Config.{group} must be a {cls.__name__}, got {type(part).__name__}")
            object.__setattr__(self, group, dataclasses.replace(part, **changes[group]) if group in changes else part)

    def flat(self) -> dict[str, Any]:
        """Every field by name, in group order (lists copied): the stored and logged form."""
        return {name: _copy(getattr(getattr(self, group), name)) for name, group in FIELD_GROUP.items()}


def _copy(value: Any) -> Any:
    return list(value) if isinstance(value, list) else value


# Where a command's natural default differs from training's: {command: {field: default}}, from the
# declarations' per_command.
COMMAND_DEFAULTS: dict[str, dict[str, Any]] = {}
for _name, _f in FIELDS.items():
    for _command, _value in _f.metadata["per_command"].items():
        COMMAND_DEFAULTS.setdefault(_command, {})[_name] = _value
del _name, _f, _command, _value

# The fields a resumed run may change (declared with resume_may_change=True); storage/checkpoint.py refuses others.
RESUME_MAY_CHANGE = frozenset(name for name, f in FIELDS.items() if f.metadata["resume_may_change"])


def command_default(command: str, name: str) -> Any:
    if name in COMMAND_DEFAULTS.get(command, {}):
        return COMMAND_DEFAULTS[command][name]
    return default_of(FIELDS[name])


def fields_for(command: str) -> list[str]:
    """The fields `command` reads, in group order."""
    return [name for name, f in FIELDS.items() if command in f.metadata["commands"]]
