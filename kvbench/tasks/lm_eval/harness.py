"""lm-eval's tasks as kvbench reads them: loaded by name (or from the user's YAML folder), their requests built as
lm-eval builds them, and what kvbench cannot score per doc refused before any model loads.

lm-eval is imported here only, and only when a task of it is asked for: kvbench without the extra still imports
and runs its other tasks.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import random
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from kvbench.tasks.base import TaskError

INSTALL = "pip install 'kvbench[lm-eval]'"
GENERATE_UNTIL = "generate_until"
LOGLIKELIHOOD = "loglikelihood"


def require_lm_eval() -> None:
    """Refuse the task, naming the install command, where lm-eval is not installed."""
    try:
        import lm_eval  # noqa: F401
    except ImportError:
        raise TaskError(f"task=lm_eval needs the lm-eval package, which is not installed; {INSTALL}") from None


@functools.cache
def task_manager(include_path: str | None, metadata: str) -> Any:
    """lm-eval's index of tasks (seconds to build: one per process and settings). ``metadata`` is JSON: what lm-eval
    hands every task (its model arguments and ``--metadata``)."""
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=include_path, metadata=json.loads(metadata))


@dataclass
class Doc:
    """One lm-eval doc: its task, its index there, the doc itself, and its requests (``Instance`` objects) in
    lm-eval's order."""

    task_name: str
    task: Any
    doc_id: int
    doc: Any
    instances: list[Any]

    @property
    def id(self) -> str:
        return f"{self.task_name}/{self.doc_id}"

    @property
    def request_type(self) -> str:
        return str(self.instances[0].request_type)


@functools.cache
def load_docs(
    names: tuple[str, ...],
    include_path: str | None,
    metadata: str,
    limit: float | None,
    num_fewshot: int | None,
) -> list[Doc]:
    """Every doc of the named tasks (groups expand to their tasks), up to ``limit`` per task (lm-eval's: a count,
    or a fraction below 1), with its requests built as ``lm_eval.simple_evaluate`` builds them (no chat template,
    lm-eval's few-shot seed); ``metadata`` is JSON. Loaded once per process (the config's check and the cell share
    them, and so do a sweep's cells)."""
    require_lm_eval()
    manager = task_manager(include_path, metadata)
    unknown = [name for name in names if name not in manager.all_tasks]
    if unknown:
        where = f" or in task.include_path={include_path}" if include_path else ""
        raise TaskError(
            f"lm-eval has no task {unknown[0]!r}{where}; `lm-eval ls tasks` lists them, and task.include_path=DIR "
            "adds a folder of your own task YAMLs"
        )
    with lm_eval_seeds():
        try:
            tasks = manager.load(list(names))["tasks"]
        except Exception as err:  # a task whose data cannot be built (offline hub, a missing tokenizer, ...)
            raise TaskError(f"lm-eval could not build {names}: {type(err).__name__}: {err}") from err
        return [doc for name, task in tasks.items() for doc in task_docs(name, task, limit, num_fewshot)]


def task_docs(name: str, task: Any, limit: float | None, num_fewshot: int | None) -> list[Doc]:
    """One lm-eval task's docs, its requests built with lm-eval's few-shot settings and seed."""
    from lm_eval.defaults import DEFAULT_OTHER_SEED
    from lm_eval.evaluator_utils import get_sample_size

    check_task(name, task)
    if num_fewshot is not None and task.get_config("num_fewshot") != 0:
        task.set_config(key="num_fewshot", value=num_fewshot)
    elif task.get_config("num_fewshot") is None:
        task.set_config(key="num_fewshot", value=0)
    task.set_fewshot_seed(seed=DEFAULT_OTHER_SEED)  # simple_evaluate's fewshot_random_seed
    task.build_all_requests(limit=get_sample_size(task, limit), rank=0, world_size=1)
    by_doc: dict[int, list[Any]] = {}
    for instance in task.instances:
        by_doc.setdefault(instance.doc_id, []).append(instance)
    docs = []
    for doc_id, instances in sorted(by_doc.items()):
        instances.sort(key=lambda inst: inst.idx)
        check_instances(name, instances)
        docs.append(Doc(name, task, doc_id, instances[0].doc, instances))
    return docs


@contextlib.contextmanager
def lm_eval_seeds() -> Iterator[None]:
    """The global seeds ``lm_eval.simple_evaluate`` sets before it loads tasks and builds their requests, so that
    a task that draws its docs (RULER's generated ones) draws the docs lm-eval's own run draws, and the same in every
    process (a resumed cell finds its docs again); the generators' states are put back afterwards."""
    import numpy as np
    import torch
    from lm_eval.defaults import DEFAULT_OTHER_SEED, DEFAULT_RANDOM_SEED

    states = random.getstate(), np.random.get_state(), torch.random.get_rng_state()
    random.seed(DEFAULT_RANDOM_SEED)
    np.random.seed(DEFAULT_OTHER_SEED)
    torch.manual_seed(DEFAULT_OTHER_SEED)
    try:
        yield
    finally:
        random.setstate(states[0])
        np.random.set_state(states[1])
        torch.random.set_rng_state(states[2])


def check_task(name: str, task: Any) -> None:
    """Refuse what kvbench cannot score one doc at a time: a request type it does not run, or a metric lm-eval
    aggregates otherwise than by a mean over docs (``aggregation_kind``)."""
    if task.OUTPUT_TYPE == "loglikelihood_rolling":
        raise TaskError(
            f"lm-eval task {name} scores rolling log-likelihoods (perplexity), aggregated over the corpus, not per "
            "doc; use kvbench's task=perplexity for perplexity under a policy"
        )
    for metric, aggregate in task.aggregation().items():
        if aggregation_kind(aggregate) is None:
            label = getattr(aggregate, "__name__", repr(aggregate))
            raise TaskError(
                f"lm-eval task {name}: metric {metric} is aggregated by {label}, not a mean over docs, so a row per "
                "doc cannot carry it; leave the task out of task.tasks"
            )


def check_instances(name: str, instances: list[Any]) -> None:
    """A doc's requests must be one kind kvbench runs, each asked once, a generated one greedily."""
    kinds = {inst.request_type for inst in instances}
    if len(kinds) != 1 or not kinds <= {GENERATE_UNTIL, LOGLIKELIHOOD}:
        raise TaskError(
            f"lm-eval task {name} asks {sorted(kinds)} requests of one doc; kvbench runs {GENERATE_UNTIL} "
            f"or {LOGLIKELIHOOD} requests, one kind per doc"
        )
    settings = instances[0].arguments[1] if kinds == {GENERATE_UNTIL} else {}
    if settings.get("do_sample") or settings.get("temperature"):
        raise TaskError(
            f"lm-eval task {name} samples its answers ({settings}); kvbench's rows compare greedy answers, so give "
            "it greedy settings in a task YAML of your own (task.include_path)"
        )
    if any(inst.repeats != 1 for inst in instances):
        raise TaskError(
            f"lm-eval task {name} repeats each request {instances[0].repeats} times; kvbench asks each once "
            "(draw samples with sampling.n_samples instead)"
        )


MEAN = "mean"
# A mean over the docs that have a value, -1 marking a doc that has none (RULER's score at each length).
MEAN_OF_DEFINED = "mean_of_defined"
UNDEFINED = -1.0
# Values whose mean no other common aggregation (median, max, a sum) gives.
PROBES = ([0.0, 0.0, 1.0], [0.25, 0.75, 0.5, 1.0], [1.0])


def aggregation_kind(aggregate: Any) -> str | None:
    """How lm-eval aggregates a metric over docs, told by what the aggregation does to a few values: ``mean``,
    ``mean_of_defined`` (a mean that skips -1), or None (anything else: corpus BLEU, F1 over all docs, ...),
    which a row per doc cannot carry."""
    try:
        means = [math.isclose(float(aggregate(values)), sum(values) / len(values)) for values in PROBES]
        with_undefined = float(aggregate([1.0, 0.0, UNDEFINED]))
    except Exception:  # an aggregation over other values than numbers (BLEU's pairs of texts, ...)
        return None
    if not all(means):
        return None
    return {0.0: MEAN, 0.5: MEAN_OF_DEFINED}.get(with_undefined)
