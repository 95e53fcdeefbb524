"""Name -> task class. A new task is one module that decorates its class, plus a config file."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvbench.tasks.base import Task
from kvbench.tasks.options import typed_options

TASKS: dict[str, type[Task]] = {}


def register_task(name: str) -> Callable[[type[Task]], type[Task]]:
    def wrap(cls: type[Task]) -> type[Task]:
        cls.name = name
        TASKS[name] = cls
        return cls

    return wrap


def build_task(cfg: dict[str, Any]) -> Task:
    """Build a task from its config group: ``name`` picks the class, the other keys are its options (the fields of
    its dataclass, typed: an unknown key or a value of the wrong type is a ``TaskError``)."""
    import kvbench.tasks  # noqa: F401  (imports every task module so that they register)

    options = dict(cfg)
    name = options.pop("name")
    options.pop("fidelity", None)  # read by the runner (kvbench.runner.fidelity), not a task argument
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; choose one of {sorted(TASKS)}")
    cls = TASKS[name]
    return cls(**typed_options(cls, options))
