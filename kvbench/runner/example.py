"""One example -> its outcome, by the protocol its task declares (``OUTCOMES``): generate under the run's policy
and score the text (with fidelity to the full cache when asked for), or teacher-force the text and score its
likelihood (:mod:`kvbench.runner.perplexity`). A cell's examples run one at a time or ``batch_size`` decoded
together; a failure becomes that example's ``Failure``."""

from __future__ import annotations

import logging
import traceback
from collections.abc import Callable, Iterator

import torch

from kvbench.config import ConfigError, RunSpec
from kvbench.engine.batch import BatchRun
from kvbench.engine.generate import DecodeSettings, Generation, Request
from kvbench.models import LoadedModel
from kvbench.results.schema import Failure, Outcome
from kvbench.runner import perplexity
from kvbench.runner.fidelity.references import generation_agreement, generation_reference, wants_fidelity
from kvbench.runner.fidelity.store import ReferenceStore, default_reference_dir, store_at
from kvbench.runner.passes import example_settings, measures, policy_pass
from kvbench.tasks.base import Example, RenderedPrompt, Task
from kvbench.tasks.protocol import GENERATE, LIKELIHOOD

log = logging.getLogger("kvbench")


def run_example(
    lm: LoadedModel,
    task: Task,
    spec: RunSpec,
    ex: Example,
    prompt: RenderedPrompt,
    references: ReferenceStore | None = None,
) -> Outcome:
    """One example, alone. Full-cache references live in ``references`` (default:
    :func:`kvbench.runner.fidelity.store.default_reference_dir`)."""
    store = references or store_at(default_reference_dir())
    return OUTCOMES[task.protocol.name](lm, task, spec, ex, prompt, store)


def generated(
    lm: LoadedModel, task: Task, spec: RunSpec, ex: Example, prompt: RenderedPrompt, store: ReferenceStore
) -> Outcome:
    """The ``generate`` protocol: the prompt answered under the run's policy, scored by the task."""
    decode = example_settings(task, spec, ex)
    return generation_outcome(lm, task, spec, ex, prompt, policy_pass(lm, spec, prompt, decode), decode, store)


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
        forced = policy_pass(lm, spec, prompt, decode, forced_tokens=ref.tokens, return_logits=True)
        assert forced.logits is not None  # asked for
        metrics.update(generation_agreement(ref, forced.logits, prediction, task.postprocess(ref.text, ex)))
        reference_tokens = len(ref.tokens)
    return Outcome(
        primary_metric=task.primary_metric,
        score=metrics.get(task.primary_metric),
        metrics=metrics,
        measures=measures(g),
        truncated=prompt.truncated,
        prediction=prediction,
        references=ex.references,
        fidelity_reference=reference,
        fidelity_reference_tokens=reference_tokens,
    )


def failure(err: Exception) -> Failure:
    """An example's failure, logged; after a CUDA out-of-memory error the allocator's cache is emptied so that
    the next example starts clean."""
    if isinstance(err, torch.cuda.OutOfMemoryError):
        torch.cuda.empty_cache()
    log.warning("example failed: %s: %s", type(err).__name__, err)
    return Failure(error=f"{type(err).__name__}: {err}", traceback=traceback.format_exc(limit=4))


def example_outcomes(
    lm: LoadedModel,
    task: Task,
    spec: RunSpec,
    todo: list[Example],
    rendered: dict[str, RenderedPrompt],
    references: ReferenceStore,
) -> Iterator[tuple[Example, Outcome | Failure]]:
    """Each example's outcome as it is done: one at a time, or ``batch_size`` decoded together (when the task's
    protocol is batchable). A failure is that example's (a batch's: every unfinished one's)."""
    if spec.batch_size == 1 or not task.protocol.batchable:
        for ex in todo:
            try:
                yield ex, run_example(lm, task, spec, ex, rendered[ex.id], references)
            except Exception as err:  # one failing example must not end the sweep
                yield ex, failure(err)
        return
    settings = [example_settings(task, spec, ex) for ex in todo]
    requests = [Request(rendered[ex.id].input_ids, rendered[ex.id].suffix_ids, s) for ex, s in zip(todo, settings)]
    done: set[int] = set()
    try:
        run = BatchRun(
            lm.model, lm.tokenizer, requests, spec.policy, spec.budget, spec.stage, spec.batch_size, spec.stride
        )
        while True:
            more = run.step()
            for i, seq in enumerate(run.sequences):
                if seq.generation is None or i in done:
                    continue
                done.add(i)
                ex = todo[i]
                try:
                    prompt = rendered[ex.id]
                    yield ex, generation_outcome(lm, task, spec, ex, prompt, seq.generation, settings[i], references)
                except Exception as err:
                    yield ex, failure(err)
            if not more:
                return
    except Exception as err:
        for i, ex in enumerate(todo):
            if i not in done:
                yield ex, failure(err)


OutcomeOf = Callable[[LoadedModel, Task, RunSpec, Example, RenderedPrompt, ReferenceStore], Outcome]
# What the runner does for each protocol (kvbench.tasks.protocol) it can run.
OUTCOMES: dict[str, OutcomeOf] = {GENERATE.name: generated, LIKELIHOOD.name: perplexity.score_text}


def check_protocol(task: Task) -> None:
    """Refuse, before any model loads, a task whose protocol the runner cannot run."""
    if task.protocol.name not in OUTCOMES:
        raise ConfigError(
            f"task={task.name} declares protocol {task.protocol.name!r}, which this runner cannot run yet "
            f"(it runs {sorted(OUTCOMES)})"
        )
