"""Type a composed config against the schema, with kvbench's words for what is wrong.

OmegaConf does the typing (``merge`` onto the structured schema, then ``to_object``); its errors name a key and
an internal type, so they are rewritten here into one line that says what the key accepts. A setting's range
check (``schema.setting(check=...)``) runs on the typed value.
"""

from __future__ import annotations

import dataclasses
import typing
from enum import Enum
from typing import Any, TypeVar

from omegaconf import OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException

from kvbench.config.schema import RunConfig, TaskConfig
from kvbench.config.spec import ConfigError

T = TypeVar("T")
_ABSENT = object()


def read_run(data: dict[str, Any]) -> RunConfig:
    """The composed config (plain data) typed as a ``RunConfig``. Top-level keys the schema does not have are a
    preset's own (roco_paper's ``stage_for_task``); Hydra already refused any the configs do not define. Of the
    task, only the settings every task shares are typed here: the task checks its own."""
    known = {f.name for f in dataclasses.fields(RunConfig)}
    shared = {f.name for f in dataclasses.fields(TaskConfig)}
    task = {k: v for k, v in dict(data.get("task") or {}).items() if k in shared}
    return typed(RunConfig, {**{k: v for k, v in data.items() if k in known}, "task": task})


def typed(schema: type[T], data: dict[str, Any]) -> T:
    """``data`` as an instance of the dataclass ``schema`` (enums and all), or ``ConfigError``."""
    try:
        instance = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(schema), data))
    except OmegaConfBaseException as err:
        raise ConfigError(_explain(schema, data, err)) from None
    _check_ranges(instance, data, "")
    return typing.cast(T, instance)


def _explain(schema: type, data: dict[str, Any], err: OmegaConfBaseException) -> str:
    key = str(getattr(err, "full_key", "") or "")
    hint = _field_type(schema, key.split("."))
    if isinstance(err, ConfigKeyError) or hint is None:
        return f"{key} is not a kvbench setting; remove it (the settings are in kvbench/config/schema.py)"
    value = _lookup(data, key)
    kind, meta = hint
    enum = _enum_in(kind)
    if enum is not None:
        return f"{key}={value!r} is unknown; choose one of {', '.join(m.value for m in enum)}"
    return f"{key}={value!r} must be {meta.get('expect', 'of another type')}"


def _check_ranges(instance: Any, data: Any, prefix: str) -> None:
    for f in dataclasses.fields(instance):
        value = getattr(instance, f.name)
        given = data.get(f.name, _ABSENT) if isinstance(data, dict) else _ABSENT
        if dataclasses.is_dataclass(value):
            _check_ranges(value, given if isinstance(given, dict) else {}, f"{prefix}{f.name}.")
            continue
        check = f.metadata.get("check")
        problem = check(value) if check else None
        if problem:
            shown = value if given is _ABSENT else given
            raise ConfigError(f"{prefix}{f.name}={shown!r} {problem}")


def _field_type(schema: type, parts: list[str]) -> tuple[Any, dict[str, Any]] | None:
    """The type hint and metadata of the dotted field ``parts`` below ``schema``; None when there is none."""
    hints = typing.get_type_hints(schema)
    fields = {f.name: f for f in dataclasses.fields(schema)}
    name = parts[0]
    if name not in fields:
        return None
    kind = hints[name]
    if len(parts) == 1:
        return kind, dict(fields[name].metadata)
    return _field_type(kind, parts[1:]) if isinstance(kind, type) and dataclasses.is_dataclass(kind) else None


def _enum_in(kind: Any) -> type[Enum] | None:
    """The enum a type hint allows (``Stage`` or ``Stage | None``), if any."""
    for option in (kind, *typing.get_args(kind)):
        if isinstance(option, type) and issubclass(option, Enum):
            return option
    return None


def _lookup(data: Any, key: str) -> Any:
    for part in key.split("."):
        if not isinstance(data, dict) or part not in data:
            return None
        data = data[part]
    return data
