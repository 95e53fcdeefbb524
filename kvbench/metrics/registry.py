"""What the report knows of a metric: its direction and its display name, declared where the metric is defined.

A metric is a key of the dict a task's ``score`` (or the runner) writes into each row (``metric.<name>``).
Whoever defines it declares it once::

    register_metric("rougeL", higher_is_better=True, label="ROUGE-L")

or, on a function whose name is the metric's, ``@metric_function(higher_is_better=True, label="QA F1")``. The
report reads the direction (which value is bold in a table, which way a Pareto front faces) and the label from
here, never from the name. A name nobody declared (an old row, a metric from a branch) is read as
higher-is-better under its own name, and the report says that the direction is assumed.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

F = TypeVar("F", bound=Callable[..., float])

# Modules whose import declares every metric a row may hold: the tasks (each task module, and the metric
# modules it uses) and the declarations of metrics computed outside kvbench.metrics.
DECLARING_MODULES = ("kvbench.tasks", "kvbench.metrics.task_metrics")


@dataclass(frozen=True)
class Metric:
    name: str
    higher_is_better: bool
    label: str
    # False for a name nobody declared (its direction is then an assumption).
    declared: bool = True


_METRICS: dict[str, Metric] = {}
_loaded = False


def register_metric(name: str, *, higher_is_better: bool, label: str | None = None) -> Metric:
    """Declare a metric (``label`` defaults to the name). Declaring it again the same way is fine; declaring it
    differently is an error (two definitions would make the report's reading depend on import order)."""
    declared = Metric(name, bool(higher_is_better), label or name)
    held = _METRICS.setdefault(name, declared)
    if held != declared:
        raise ValueError(f"metric {name!r} is already declared as {held}, not {declared}")
    return declared


def metric_function(*, higher_is_better: bool, label: str | None = None) -> Callable[[F], F]:
    """Decorator: declare the metric named as the decorated function."""

    def declare(fn: F) -> F:
        register_metric(fn.__name__, higher_is_better=higher_is_better, label=label)
        return fn

    return declare


def _load() -> None:
    global _loaded
    if not _loaded:
        _loaded = True
        for module in DECLARING_MODULES:
            importlib.import_module(module)


def metric_info(name: str) -> Metric:
    """The declared metric, or for an undeclared name: higher is better, labelled with the name itself."""
    _load()
    return _METRICS.get(name) or Metric(name, higher_is_better=True, label=name, declared=False)


def declared_metrics() -> list[Metric]:
    _load()
    return [_METRICS[name] for name in sorted(_METRICS)]
