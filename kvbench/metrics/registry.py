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

from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from kvbench.registry import Registry, caller, place_of

F = TypeVar("F", bound=Callable[..., float])


@dataclass(frozen=True)
class Metric:
    name: str
    higher_is_better: bool
    label: str
    # False for a name nobody declared (its direction is then an assumption).
    declared: bool = True


# Declared by the metric modules and by the tasks (each task module, and the metric modules it uses).
METRICS: Registry[Metric] = Registry("metric", ("kvbench.metrics", "kvbench.tasks"))


def register_metric(name: str, *, higher_is_better: bool, label: str | None = None, place: str = "") -> Metric:
    """Declare a metric (``label`` defaults to the name). Declaring it again the same way is fine; declaring it
    differently is an error (two definitions would make the report's reading depend on import order)."""
    return METRICS.add(name, Metric(name, bool(higher_is_better), label or name), place or caller())


def metric_function(*, higher_is_better: bool, label: str | None = None) -> Callable[[F], F]:
    """Decorator: declare the metric named as the decorated function."""

    def declare(fn: F) -> F:
        register_metric(fn.__name__, higher_is_better=higher_is_better, label=label, place=place_of(fn) or "")
        return fn

    return declare


def metric_info(name: str) -> Metric:
    """The declared metric, or for an undeclared name: higher is better, labelled with the name itself."""
    return METRICS.get(name) if name in METRICS else Metric(name, higher_is_better=True, label=name, declared=False)
