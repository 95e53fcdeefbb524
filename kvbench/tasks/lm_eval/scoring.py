"""A doc's metrics as lm-eval computes them: its responses through the task's filters, then the task's
``process_results``, the values kept under lm-eval's metric names (``metric,filter`` for a filter other than
``none``, as lm-eval reports them).

A metric lm-eval aggregates by a mean over docs keeps each doc's value; one aggregated by a mean over the docs that
have a value (RULER's -1 for "not asked at this length") keeps a doc's value only where it has one, so that the
report's mean over rows is lm-eval's aggregate. Every metric is declared with lm-eval's direction.
"""

from __future__ import annotations

from typing import Any

from kvbench.metrics.registry import METRICS, register_metric
from kvbench.tasks.base import TaskError
from kvbench.tasks.lm_eval.harness import MEAN, MEAN_OF_DEFINED, UNDEFINED, Doc, aggregation_kind

NO_FILTER = "none"


def metric_name(metric: str, filter_name: str) -> str:
    """A row's name for lm-eval's metric under a filter."""
    return metric if filter_name == NO_FILTER else f"{metric},{filter_name}"


def doc_metrics(doc: Doc, responses: list[Any]) -> dict[str, float]:
    """The doc's metric values from its responses (one per request, in lm-eval's order): a text for
    ``generate_until``, a (log-likelihood, is greedy) pair for ``loglikelihood``."""
    for instance, response in zip(doc.instances, responses, strict=True):
        instance.resps = [response]
        instance.filtered_resps = {}
    for ensemble in getattr(doc.task, "_filters", []):
        ensemble.apply(doc.instances)
    aggregations = doc.task.aggregation()
    out: dict[str, float] = {}
    for filter_name in doc.instances[0].filtered_resps:
        values = doc.task.process_results(doc.doc, [inst.filtered_resps[filter_name] for inst in doc.instances])
        for metric, value in values.items():
            kind = aggregation_kind(aggregations[metric]) if metric in aggregations else MEAN
            if kind == MEAN_OF_DEFINED and value == UNDEFINED:
                continue
            if not isinstance(value, int | float):
                raise TaskError(f"lm-eval task {doc.task_name}: metric {metric} is {value!r}, not a number")
            name = metric_name(metric, filter_name)
            declare(name, doc.task.higher_is_better().get(metric, True))
            out[name] = float(value)
    return out


def declare(name: str, higher_is_better: bool) -> None:
    """Declare a metric with lm-eval's direction; a name kvbench already declares keeps its label, and a clash of
    directions is refused."""
    if name in METRICS:
        held = METRICS.get(name)
        if held.higher_is_better != bool(higher_is_better):
            raise TaskError(
                f"lm-eval's metric {name} is {'higher' if higher_is_better else 'lower'}-is-better, but kvbench's "
                f"{name} is the other way; the report could not rank it"
            )
        return
    register_metric(name, higher_is_better=bool(higher_is_better), label=name, place=f"lm-eval metric {name}")
