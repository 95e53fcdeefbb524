"""A cell's examples -> their outcomes, by the protocol their task declares: ``generate`` runs them under the
run's policy, ``batch_size`` sequences decoded together (1: one at a time), each prompt ``sampling.n_samples``
times (seeded apart, made one row by :mod:`kvbench.runner.samples`), and scores each example as soon as its
samples are done (with fidelity to the full cache when asked for); ``shared_context`` runs the same way, one row per
question, each example's context prefilled and compressed once (:mod:`kvbench.runner.questions`); a protocol whose
examples run alone (``likelihood``: teacher-force each text, :mod:`kvbench.runner.perplexity`; ``continuations``:
each of an example's continuations, :mod:`kvbench.runner.continuations`) has its runner in ``ALONE``. A failure
becomes the ``Failure`` of the examples it took down; the others go on."""

from __future__ import annotations

import logging
import traceback
from collections.abc import Callable, Iterator

import torch

from kvbench.config import ConfigError, RunSpec
from kvbench.engine.engine import DecodeSettings, Generation, Request
from kvbench.models import LoadedModel
from kvbench.results.schema import Failure, Outcome
from kvbench.runner import continuations, perplexity
from kvbench.runner.fidelity.references import (
    generation_agreement,
    generation_reference,
    stored_generation_reference,
    wants_fidelity,
)
from kvbench.runner.fidelity.store import ReferenceStore
from kvbench.runner.passes import example_settings, policy_pass, run_engine
from kvbench.runner.questions import asked
from kvbench.runner.samples import Sample, combine
from kvbench.tasks.base import Example, RenderedPrompt, Task
from kvbench.tasks.protocol import CONTINUATIONS, GENERATE, LIKELIHOOD, SHARED_CONTEXT

log = logging.getLogger("kvbench")


def score_sample(
    lm: LoadedModel,
    task: Task,
    spec: RunSpec,
    ex: Example,
    prompt: RenderedPrompt,
    g: Generation,
    decode: DecodeSettings,
    store: ReferenceStore,
) -> Sample:
    """One generation scored by the task, with fidelity to the full cache when asked for: the full cache's output
    (computed once per prompt and settings) teacher-forced through the run's policy, its passes run alone. The
    full cache's length comes from that reference, or from one a run already stored; otherwise it is unknown."""
    prediction = task.postprocess(g.text, ex)
    metrics = task.score(prediction, ex)
    if not wants_fidelity(task, spec):
        stored = stored_generation_reference(lm, spec, ex.id, prompt, decode, store)
        return Sample(g, prediction, metrics, None if stored is None else len(stored.tokens))
    ref, name = generation_reference(lm, spec, ex.id, prompt, decode, store)
    forced = policy_pass(lm, spec, prompt, decode, ref.tokens)
    assert forced.logits is not None  # asked for
    metrics.update(generation_agreement(ref, forced.logits, prediction, task.postprocess(ref.text, ex)))
    return Sample(g, prediction, metrics, len(ref.tokens), name)


def generation_outcome(
    lm: LoadedModel,
    task: Task,
    spec: RunSpec,
    ex: Example,
    prompt: RenderedPrompt,
    generations: list[Generation],
    decodes: list[DecodeSettings],
    store: ReferenceStore,
) -> Outcome:
    """An example's row from its samples' generations (one unless ``sampling.n_samples`` > 1), in seed order."""
    samples = [score_sample(lm, task, spec, ex, prompt, g, d, store) for g, d in zip(generations, decodes)]
    return combine(task, prompt, ex.references, samples)


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
    if task.protocol.name == SHARED_CONTEXT.name:  # every question and sample of a context shares its compression
        todo, rendered, context_ids = asked(todo, rendered, done)
    n = spec.n_samples  # request i is sample i % n of example i // n
    settings = [example_settings(task, spec, ex, j) for ex in todo for j in range(n)]
    prompts = [rendered[todo[i // n].id] for i in range(len(settings))]
    requests = [
        Request(p.input_ids, p.suffix_ids, s, context_id=context_ids[i // n])
        for i, (p, s) in enumerate(zip(prompts, settings))
    ]
    pending: dict[int, dict[int, Generation | Exception]] = {}
    for finished in engine.steps(requests):
        for i, result in finished:
            k = i // n
            samples = pending.setdefault(k, {})
            samples[i % n] = result
            if len(samples) < n:
                continue
            del pending[k]
            ex, results = todo[k], [samples[j] for j in range(n)]
            failed = next((r for r in results if isinstance(r, Exception)), None)
            if failed is not None:
                yield ex, failure(failed)
                continue
            generations = [r for r in results if isinstance(r, Generation)]
            try:
                yield (
                    ex,
                    generation_outcome(
                        lm, task, spec, ex, rendered[ex.id], generations, settings[k * n : (k + 1) * n], references
                    ),
                )
            except Exception as err:  # one failing example must not end the sweep
                yield ex, failure(err)


OutcomeOf = Callable[[LoadedModel, Task, RunSpec, Example, RenderedPrompt, ReferenceStore], Outcome]
# The protocols (kvbench.tasks.protocol) whose examples run one at a time, each with its runner; ``generate``
# runs through the engine's batches above.
ALONE: dict[str, OutcomeOf] = {
    LIKELIHOOD.name: perplexity.score_text,
    CONTINUATIONS.name: continuations.score_continuations,
}


def check_protocol(task: Task) -> None:
    """Refuse, before any model loads, a task whose protocol the runner cannot run."""
    runs = sorted([GENERATE.name, SHARED_CONTEXT.name, *ALONE])
    if task.protocol.name not in runs:
        raise ConfigError(
            f"task={task.name} declares protocol {task.protocol.name!r}, which this runner cannot run yet "
            f"(it runs {runs})"
        )
