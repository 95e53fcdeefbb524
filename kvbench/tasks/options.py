"""A task's options are the fields of its dataclass: typed here, before the task is built, so that a value of the
wrong type or a key the task does not take is refused with the task's own list of options.

OmegaConf does the typing (a structured config of the same fields), so ``task.context_tokens=abc`` and
``+task.bogus=1`` are refused before any model loads, and a nested option (``task.source.repo``) is typed as its
dataclass. ``fidelity`` and ``n`` are shared by every task and typed by the run schema (``kvbench.config.schema``).
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from kvbench.tasks.base import Task, TaskError

RUNNER_OPTIONS = ("fidelity",)  # read by the runner, not by the task


def typed_options(cls: type[Task], options: dict[str, Any]) -> dict[str, Any]:
    """``options`` typed against the fields of ``cls`` (nested dataclasses built), or a ``TaskError`` naming the
    key and what it accepts."""
    fields = _option_fields(cls)
    unknown = sorted(set(options) - set(fields))
    if unknown:
        accepted = ", ".join(sorted([*fields, *RUNNER_OPTIONS]))
        raise TaskError(f"task.{unknown[0]} is unknown; the task's options are {accepted}")
    mirror = dataclasses.make_dataclass(f"{cls.__name__}Options", [_mirror(f, fields[f.name]) for f in _fields(cls)])
    try:
        instance = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(mirror), options))
    except OmegaConfBaseException as err:
        raise TaskError(_explain(cls, options, err)) from None
    return {key: getattr(instance, key) for key in options}


def _fields(cls: type) -> list[dataclasses.Field[Any]]:
    return [f for f in dataclasses.fields(cls) if f.init] if dataclasses.is_dataclass(cls) else []


def _option_fields(cls: type) -> dict[str, Any]:
    """Each option's name and resolved type hint."""
    hints = typing.get_type_hints(cls) if dataclasses.is_dataclass(cls) else {}
    return {f.name: hints[f.name] for f in _fields(cls)}


def _mirror(f: dataclasses.Field[Any], hint: Any) -> tuple[str, Any, Any]:
    if f.default_factory is not dataclasses.MISSING:
        return f.name, hint, dataclasses.field(default_factory=f.default_factory)
    return f.name, hint, dataclasses.field(default=f.default)


def _explain(cls: type[Task], options: dict[str, Any], err: OmegaConfBaseException) -> str:
    key = str(getattr(err, "full_key", "") or "").split("[")[0]
    parts = key.split(".")
    hint: Any = cls
    for part in parts:
        fields = _option_fields(hint)
        if part not in fields:
            accepted = ", ".join(sorted(fields))
            return f"task.{key} is unknown; the options there are {accepted}"
        hint = fields[part]
    value: Any = options
    for part in parts:
        value = value.get(part) if isinstance(value, dict) else None
    return f"task.{key}={value!r} must be {describe(hint)}"


def describe(hint: Any) -> str:
    """What a type hint accepts, in the words of a refusal: ``int | None`` is "an integer or null"."""
    args = typing.get_args(hint)
    if type(None) in args:
        rest = [a for a in args if a is not type(None)]
        return f"{describe(rest[0]) if len(rest) == 1 else 'a value'} or null"
    if typing.get_origin(hint) is list:
        return f"a list of {_plural(describe(args[0]))}" if args else "a list"
    if args and set(args) <= {int, float}:
        return "a number"
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        return f"settings ({', '.join(sorted(_option_fields(hint)))})"
    return {bool: "true or false", int: "an integer", float: "a number", str: "text"}.get(hint, f"a {hint}")


def _plural(words: str) -> str:
    return {"an integer": "integers", "a number": "numbers", "text": "texts"}.get(words, words)
