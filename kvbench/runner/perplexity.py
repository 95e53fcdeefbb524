"""Perplexity as the runner does it: teacher-force a text's scored tokens through the run's policy and through
the full cache, and compare.

A task of the ``likelihood`` protocol (:mod:`kvbench.tasks.perplexity`) provides the documents, cuts each into a
prefix (the prompt) and the tokens to score, and turns negative log-likelihoods into its metrics; it knows nothing
of caches. Here the prefix is prefilled (and, for ``stage=prefill`` or ``both``, compressed to the budget) and the
targets are fed one at a time through the decode loop (evicting as they arrive for ``stage=decode`` or ``both``).
The NLL of each target is read from the logits that predict it, so the first is predicted by the prefill. The full
cache's NLLs and next-token distributions along the same text are a reference, computed once per example and
shared by every policy and budget; ``fidelity_top1`` / ``fidelity_kl`` compare the two runs' distributions
(top-1: the argmaxes agree).
"""

from __future__ import annotations

from kvbench.config import RunSpec
from kvbench.engine.engine import DecodeSettings
from kvbench.models import LoadedModel
from kvbench.results.schema import Outcome
from kvbench.runner.fidelity.metrics import token_nll
from kvbench.runner.fidelity.references import agreement, text_reference
from kvbench.runner.fidelity.store import ReferenceStore
from kvbench.runner.passes import outcome, policy_pass
from kvbench.tasks.base import Example, RenderedPrompt, Task
from kvbench.tasks.protocol import ScoredText


def score_text(
    lm: LoadedModel, task: Task, spec: RunSpec, ex: Example, prompt: RenderedPrompt, store: ReferenceStore
) -> Outcome:
    """One text's perplexity under the run's policy, next to the full cache's (from ``store``): the runner of the
    ``likelihood`` protocol."""
    if not isinstance(prompt, ScoredText) or not prompt.targets:
        raise ValueError(f"example {ex.id}: nothing to score (the text is too short)")
    targets = prompt.targets
    settings = DecodeSettings(max_new_tokens=len(targets), seed=spec.seed)
    ref, reference = text_reference(lm, spec, ex.id, prompt.input_ids, targets, settings, store)
    g = policy_pass(lm, spec, prompt, settings, targets)
    assert g.logits is not None and ref.nll is not None  # asked for, and a teacher-forced reference has them
    metrics = task.score_nll(token_nll(g.logits, targets).tolist(), ref.nll)
    metrics.update(agreement(ref, g.logits, ref.argmax))
    return outcome(task, metrics, g, prompt, fidelity_reference=reference, scored_tokens=len(targets))
