"""The ``continuations`` protocol as the runner does it: each of an example's (context, continuation) pairs alone
under the run's policy, the context prefilled (and compressed, for ``stage=prefill`` or ``both``) and the
continuation teacher-forced through the budgeted cache, as perplexity does; its log-likelihood is the sum of the
continuation's token log-probabilities, and it is greedy when every token is the argmax of the logits that predict
it (lm-eval's ``loglikelihood`` answer).

The row's measures (memory, time, budget) are those of the pass over the example's longest context.
"""

from __future__ import annotations

from kvbench.config import RunSpec
from kvbench.engine.engine import DecodeSettings
from kvbench.models import LoadedModel
from kvbench.results.schema import Outcome
from kvbench.runner.fidelity.metrics import token_nll
from kvbench.runner.fidelity.store import ReferenceStore
from kvbench.runner.passes import outcome, policy_pass
from kvbench.tasks.base import Example, RenderedPrompt, Task
from kvbench.tasks.protocol import ContinuationsPrompt


def score_continuations(
    lm: LoadedModel, task: Task, spec: RunSpec, ex: Example, prompt: RenderedPrompt, store: ReferenceStore
) -> Outcome:
    """One example's pairs, each scored alone under the run's policy, and the task's metrics of their answers."""
    if not isinstance(prompt, ContinuationsPrompt) or not prompt.pairs:
        raise ValueError(f"example {ex.id}: no continuation to score")
    answers: list[tuple[float, bool]] = []
    measured = None
    for context, continuation in prompt.pairs:
        settings = DecodeSettings(max_new_tokens=len(continuation), seed=spec.seed)
        g = policy_pass(lm, spec, RenderedPrompt(input_ids=context), settings, continuation)
        assert g.logits is not None  # asked for
        logprob = -float(token_nll(g.logits, continuation).sum())
        greedy = g.logits.argmax(-1).cpu().tolist() == list(continuation)
        answers.append((logprob, greedy))
        if measured is None and len(context) == len(prompt.input_ids):
            measured = g
    assert measured is not None  # input_ids is the longest context
    metrics = task.score_continuations(ex, answers)
    return outcome(task, metrics, measured, prompt, scored_tokens=sum(len(c) for _, c in prompt.pairs))
