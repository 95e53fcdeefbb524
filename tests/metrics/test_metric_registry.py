"""The metric registry: every metric a task writes is declared, with the direction its definition implies."""

from __future__ import annotations

import pytest

from kvbench.metrics import longbench
from kvbench.metrics.registry import metric_info, register_metric
from kvbench.metrics.rouge import rouge_scores
from kvbench.tasks.base import Example
from kvbench.tasks.registry import TASKS
from kvbench.tasks.retrieval import RetrievalTask


def test_every_metric_a_task_scores_is_declared() -> None:
    written = set(RetrievalTask().score("12345", Example(id="0", prompt="", references=["12345"])))
    written |= set(rouge_scores("a b", "a c")) | set(longbench.METRICS) | {"score"}
    written |= {task.primary_metric for _, task in TASKS.items()}
    undeclared = sorted(name for name in written if not metric_info(name).declared)
    assert not undeclared, f"declare these with register_metric: {undeclared}"


@pytest.mark.parametrize(
    "name, higher",
    [
        ("accuracy", True),
        ("rougeL", True),
        ("qa_f1_score", True),
        ("fidelity_top1", True),
        ("perplexity", False),
        ("perplexity_delta", False),
        ("nll", False),
        ("fidelity_kl", False),
    ],
)
def test_directions(name: str, higher: bool) -> None:
    """Accuracy, overlap and agreement improve upwards; perplexity, NLL and divergence downwards."""
    assert metric_info(name).higher_is_better is higher


def test_an_undeclared_name_falls_back_to_higher_is_better_under_its_own_name() -> None:
    info = metric_info("no_such_metric_anywhere")
    assert (info.higher_is_better, info.label, info.declared) == (True, "no_such_metric_anywhere", False)


def test_a_second_declaration_must_agree() -> None:
    register_metric("registry_test_metric", higher_is_better=False, label="test")
    register_metric("registry_test_metric", higher_is_better=False, label="test")  # the same: fine
    with pytest.raises(ValueError, match="already registered"):
        register_metric("registry_test_metric", higher_is_better=True, label="test")
    assert metric_info("rougeLsum").label == "ROUGE-Lsum"
