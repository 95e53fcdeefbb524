"""A cell's examples -> their outcomes, by the protocol their task declares: ``generate`` runs them under the
run's policy, ``batch_size`` sequences decoded together (1: one at a time), and scores each text as soon as it is
done (with fidelity to the full cache when asked for); ``shared_context`` runs the same way, one row per question,
each example's context prefilled and compressed once (:mod:`kvbench.runner.questions`); a protocol whose examples
run alone (``likelihood``: teacher-force each text, :mod:`kvbench.runner.perplexity`) has its runner in ``ALONE``.
A failure becomes the ``Failure`` of the examples it took down; the others go on."""

from __future__ import annotations

import logging
import traceback
from collections.abc import Callable, Iterator

import torch

from kvbench.config import ConfigError, RunSpec
from kvbench.engine.engine import DecodeSettings, Generation, Request
from kvbench.models import LoadedModel
from kvbench.results.schema import Failure, Outcome
from kvbench.runner import perplexity
from kvbench.runner.fidelity.references import generation_agreement, generation_reference, wants_fidelity
from kvbench.runner.fidelity.store import ReferenceStore
from kvbench.runner.passes import example_settings, outcome, policy_pass, run_engine
from kvbench.runner.questions import asked
from kvbench.tasks.base import Example, RenderedPrompt, Task
from kvbench.tasks.protocol import GENERATE, LIKELIHOOD, SHARED_CONTEXT

log = logging.getLogger("kvbench")


def generation_outcome(
    lm: LoadedModel,
    task: Task,
    spec: RunSpec,
    ex: Example,
    prompt: RenderedPrompt,
    g: Generation,
    decode: DecodeSettings,
    store: ReferenceStore,
) -> Outcome:
    """A generation scored by the task, with fidelity to the full cache when asked for: the full cache's output
    (computed once per prompt and settings) teacher-forced through the run's policy, its passes run alone."""
    prediction = task.postprocess(g.text, ex)
    metrics = task.score(prediction, ex)
    reference, reference_tokens = None, None
    if wants_fidelity(task, spec):
        ref, reference = generation_reference(lm, spec, ex.id, prompt, decode, store)
        forced = policy_pass(lm, spec, prompt, decode, ref.tokens)
        assert forced.logits is not None  # asked for
        metrics.update(generation_agreement(ref, forced.logits, prediction, task.postprocess(ref.text, ex)))
        reference_tokens = len(ref.tokens)
    return outcome(
        task,
        metrics,
        g,
        prompt,
        prediction=prediction,
        references=ex.references,
        fidelity_reference=reference,
        fidelity_reference_tokens=reference_tokens,
    )


def failure(err: BaseException) -> Failure:
    """An example's failure, logged; after a CUDA out-of-memory error the allocator's cache is emptied so that
    the next example starts clean."""
    if isinstance(err, torch.cuda.OutOfMemoryError):
        torch.cuda.empty_cache()
    log.warning("example failed: %s: %s", type(err).__name__, err)
    return Failure(error=f"{type(err).__name__}: {err}", traceback="".join(traceback.format_exception(err, limit=4)))


def example_outcomes(
    lm: LoadedModel,
    task: Task,
    spec: RunSpec,
    todo: list[Example],
    rendered: dict[str, RenderedPrompt],
    references: ReferenceStore,
    done: frozenset[str] = frozenset(),
) -> Iterator[tuple[Example, Outcome | Failure]]:
    """Each example's outcome as it is done (under ``shared_context``, each question's not in ``done``, as an
    example of its own). An engine failure is the failure of the examples it was prefilling or decoding; the
    others go on."""
    alone = ALONE.get(task.protocol.name)
    if alone is not None:
        for ex in todo:
            try:
                yield ex, alone(lm, task, spec, ex, rendered[ex.id], references)
            except Exception as err:  # one failing example must not end the sweep
                yield ex, failure(err)
        return
    engine = run_engine(lm, spec, spec.batch_size)
    context_ids: list[str | None] = [None] * len(todo)
    if task.protocol.name == SHARED_CONTEXT.name:
        todo, rendered, context_ids = asked(todo, rendered, done)
    settings = [example_settings(task, spec, ex) for ex in todo]
    requests = [
        Request(rendered[ex.id].input_ids, rendered[ex.id].suffix_ids, s, context_id=c)
        for ex, s, c in zip(todo, settings, context_ids)
    ]
    for finished in engine.steps(requests):
        for i, result in finished:
            ex = todo[i]
            if isinstance(result, Exception):
                yield ex, failure(result)
                continue
            try:
                yield ex, generation_outcome(lm, task, spec, ex, rendered[ex.id], result, settings[i], references)
            except Exception as err:  # one failing example must not end the sweep
                yield ex, failure(err)


OutcomeOf = Callable[[LoadedModel, Task, RunSpec, Example, RenderedPrompt, ReferenceStore], Outcome]
# The protocols (kvbench.tasks.protocol) whose examples run one at a time, each with its runner; ``generate``
# runs through the engine's batches above.
ALONE: dict[str, OutcomeOf] = {LIKELIHOOD.name: perplexity.score_text}


def check_protocol(task: Task) -> None:
    """Refuse, before any model loads, a task whose protocol the runner cannot run."""
    runs = sorted([GENERATE.name, SHARED_CONTEXT.name, *ALONE])
    if task.protocol.name not in runs:
        raise ConfigError(
            f"task={task.name} declares protocol {task.protocol.name!r}, which this runner cannot run yet "
            f"(it runs {runs})"
        )
