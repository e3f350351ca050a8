"""Loading a Config: TOML files (flat keys, group tables such as [rollout], or either under [mlx_grpo]),
`--set field=value` / `--set group.field=value`, command-line flags, and stored configs (checkpoints'
config.resolved.json: flat, as every version wrote them; grouped is read too; `--config` takes them as it
takes TOML, so a refused resume's advice, `--config RUN/checkpoint-N/config.resolved.json`, works). Every
value is parsed to its field's type; unknown keys fail with one line and a did-you-mean; the result is
validated (validation.py).

Sources, in increasing precedence: field defaults < per-command defaults < TOML file (`--config`)
< command-line flags and `--set key=value`. Every field names the commands it applies to. A preset
file serves several commands (`train` and `eval` read the same TOML), so its keys for other commands
are type-checked and skipped; on the command line such a key is an error.
"""

from __future__ import annotations

import difflib
import json
import math
import tomllib
import typing
from pathlib import Path
from typing import Any

from mlx_grpo.config.root import COMMAND_DEFAULTS, FIELD_GROUP, FIELDS, GROUPS, Config
from mlx_grpo.config.validation import check
from mlx_grpo.base.errors import UserError

# Keys of older versions and the field that replaced them (an alias that only had to equal its field).
RENAMED = {"max_completion_length": "max_new_tokens"}

# ----------------------------------------------------------------------------- parsing

_TRUE = {"true", "1", "yes", "on"}
_FALSE = {"false", "0", "no", "off"}


def _type_name(tp: Any) -> str:
    return {str: "a string", int: "an integer", float: "a number", bool: "a boolean (true/false)",
            list[str]: "a list of strings", list[float]: "a list of numbers"}.get(tp, str(tp))


def _field_type(name: str) -> Any:
    return typing.get_type_hints(GROUPS[FIELD_GROUP[name]])[name]


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


def field_name(key: str, source: str) -> str:
    """The field a key names: 'temperature' or 'rollout.temperature'; one UserError line otherwise."""
    group, dot, name = key.rpartition(".")
    if not dot:
        if name in RENAMED:
            raise UserError(f"config key '{name}' ({source}) is gone: set {RENAMED[name]} instead")
        if name not in FIELDS:
            raise UserError(f"unknown config key '{name}' in {source}{_nearest(name, list(FIELDS))}")
        return name
    if group not in GROUPS:
        raise UserError(f"unknown config group '{group}' in {source} (key '{key}'){_nearest(group, list(GROUPS))}")
    if name in FIELDS and FIELD_GROUP[name] != group:
        raise UserError(f"config key '{name}' ({source}) is in [{FIELD_GROUP[name]}], not [{group}]: write "
                        f"{FIELD_GROUP[name]}.{name} or {name}")
    if name not in FIELDS:
        dotted = [f"{g}.{n}" for n, g in FIELD_GROUP.items()]
        raise UserError(f"unknown config key '{key}' in {source}{_nearest(key, dotted)}")
    return name


def check_key(name: str, command: str, source: str) -> str:
    """The field `name` sets, which must apply to `command` (a key for another command is an error here)."""
    name = field_name(name, source)
    if command not in FIELDS[name].metadata["commands"]:
        users = ", ".join(sorted(FIELDS[name].metadata["commands"]))
        raise UserError(f"config key '{name}' ({source}) does not apply to '{command}' (used by: {users})")
    return name


def flatten(data: dict[str, Any], source: str) -> dict[str, Any]:
    """{field: value} from flat keys and/or group tables ({"rollout": {"temperature": 1.0}}); each field once."""
    flat: dict[str, Any] = {}
    for key, value in data.items():
        if isinstance(value, dict):
            if key not in GROUPS:
                raise UserError(f"unknown config group [{key}] in {source}{_nearest(key, list(GROUPS))}")
            items = [(f"{key}.{name}", inner) for name, inner in value.items()]
        else:
            items = [(key, value)]
        for dotted, inner in items:
            if isinstance(inner, dict):
                raise UserError(f"config key '{dotted}' in {source} is a table; groups hold fields, not tables")
            name = field_name(dotted, source)
            if name in flat:
                raise UserError(f"config key '{name}' is set twice in {source} (flat and in [{FIELD_GROUP[name]}])")
            flat[name] = inner
    return flat


def read_toml(path: str | Path) -> dict[str, Any]:
    """{field: value} of a TOML file: flat keys and/or group tables ([rollout] ...), or the same inside an
    [mlx_grpo] table ([mlx_grpo.rollout] ...)."""
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
    return flatten(data, f"config file {path}")


def read_stored(path: str | Path) -> dict[str, Any]:
    """{field: value} of a stored config (save_json's JSON: flat, or grouped by hand), without the
    per-invocation options and the aliases older versions saved beside their fields."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise UserError(f"config file {path} is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise UserError(f"config file {path}: expected a JSON object of config keys")
    data.pop("command_options", None)
    for key in RENAMED:  # older runs saved these aliases; they always equalled their field
        data.pop(key, None)
    return flatten(data, f"config file {path}")


def read_config_file(path: str | Path) -> dict[str, Any]:
    """{field: value} of `--config`: a TOML file (read_toml) or, ending in .json, a stored config such as a
    checkpoint's config.resolved.json (read_stored)."""
    if Path(path).suffix.lower() == ".json" and Path(path).is_file():
        return read_stored(path)
    return read_toml(path)


def parse_set(items: list[str]) -> list[tuple[str, str]]:
    """`--set key=value` items as (key, value) pairs; the key may be 'field' or 'group.field'."""
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
        for key, value in read_config_file(toml_path).items():
            if command not in FIELDS[key].metadata["commands"]:
                parse_value(key, value)  # still type-checked; a preset serves several commands
                continue
            values[key] = parse_value(key, value)
    for key, value in overrides or []:
        name = check_key(key, command, "--set" if isinstance(value, str) else "command line")
        values[name] = parse_value(name, value)
    config = Config(**values)
    check(config, command)
    return config


def to_dict(config: Config) -> dict[str, Any]:
    """The flat {field: value} form that checkpoints, reporters and fingerprints store."""
    return config.flat()


def save_json(config: Config, path: str | Path, extra: dict[str, Any] | None = None) -> None:
    """Write the resolved config (plus per-invocation options) as flat JSON, the form every version reads."""
    data = to_dict(config)
    if extra:
        data = {**data, "command_options": extra}
    Path(path).write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def from_json(path: str | Path, command: str = "train") -> Config:
    """Load a resolved config saved by save_json (checkpoints; flat, or grouped by hand), re-validated."""
    values = read_stored(path)
    config = Config(**{key: parse_value(key, value) for key, value in values.items()})
    check(config, command)
    return config
