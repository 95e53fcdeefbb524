"""Name -> task class. A new task is one module in ``kvbench/tasks/`` that decorates its class, plus a config file:
every module of the package is imported the first time a task is looked up (``kvbench.registry``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvbench.registry import Registry
from kvbench.tasks.base import Task
from kvbench.tasks.options import typed_options

TASKS: Registry[type[Task]] = Registry("task", ("kvbench.tasks",), Task)


def register_task(name: str) -> Callable[[type[Task]], type[Task]]:
    """Class decorator: the task ``name: name`` in a task config (the class's ``name`` too)."""

    def wrap(cls: type[Task]) -> type[Task]:
        TASKS.register(name)(cls)
        cls.name = name
        return cls

    return wrap


def build_task(cfg: dict[str, Any], model: dict[str, Any] | None = None) -> Task:
    """Build a task from its config group: ``name`` picks the class, the other keys are its options (the fields of
    its dataclass, typed: an unknown key or a value of the wrong type is a ``TaskError``); ``model``: the run's model
    config, handed to ``Task.use_model``."""
    options = dict(cfg)
    name = options.pop("name")
    options.pop("fidelity", None)  # read by the runner (kvbench.runner.fidelity), not a task argument
    cls = TASKS.get(name)
    task = cls(**typed_options(cls, options))
    if model is not None:
        task.use_model(model)
    return task
