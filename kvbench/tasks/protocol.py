"""How a task's examples run, declared by the task (``Task.protocol``), and the prompt each way feeds the engine.

The runner looks up what to do by the protocol a task declares, never by the task's type:

- ``generate``: the prompt (``RenderedPrompt``) is prefilled, compressed, and answered; the task scores the text.
- ``likelihood``: a prefix (``ScoredText.input_ids``) is prefilled, then the text's next tokens
  (``ScoredText.targets``) are teacher-forced and their log-likelihoods go to ``Task.score_nll`` (perplexity).
- ``continuations``: each of an example's (context, continuation) pairs (``ContinuationsPrompt.pairs``) is run
  alone: the context prefilled and compressed, the continuation teacher-forced; its summed log-likelihood and
  whether greedy decoding would have produced it go to ``Task.score_continuations`` (lm-eval's ``loglikelihood``
  requests: the choices of a multiple-choice question).
- ``shared_context``: one context (``SharedContextPrompt.input_ids``) is compressed once and several questions
  (``SharedContextPrompt.questions``) are each asked of that compressed context; the example's ``questions``
  hold their texts and references.

This module needs neither the engine nor torch: a task imports it to say how it runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RenderedPrompt:
    """Token ids ready for the engine. ``suffix_ids`` are fed after the context is compressed."""

    input_ids: list[int]
    suffix_ids: list[int] = field(default_factory=list)
    truncated: bool = False
    n_prompt_tokens_raw: int = 0


@dataclass
class ScoredText(RenderedPrompt):
    """The prefix as the prompt, plus the tokens to teacher-force and score."""

    targets: list[int] = field(default_factory=list)


@dataclass
class SharedContextPrompt(RenderedPrompt):
    """The context (``input_ids``) compressed once, then each question's ids, in the order of the example's
    ``questions``, fed after it as a suffix (each from the same compressed context, none seeing the others)."""

    questions: list[list[int]] = field(default_factory=list)


@dataclass
class ContinuationsPrompt(RenderedPrompt):
    """Pairs of (context ids, continuation ids), each scored alone; ``input_ids`` is the longest context (what the
    model must hold, checked with the longest continuation as the new tokens)."""

    pairs: list[tuple[list[int], list[int]]] = field(default_factory=list)


@dataclass(frozen=True)
class Protocol:
    """One way to run an example: its name, the prompt ``render`` returns, and whether examples may share a batch
    (``batch_size`` > 1); ``alone`` says why not, in the words of the refusal; ``samples``: whether it generates,
    so that ``sampling.n_samples`` can draw several texts."""

    name: str
    prompt: type[RenderedPrompt]
    batchable: bool = True
    alone: str = ""
    samples: bool = True


GENERATE = Protocol("generate", RenderedPrompt)
LIKELIHOOD = Protocol(
    "likelihood",
    ScoredText,
    batchable=False,
    alone="scores each text alone (teacher forcing)",
    samples=False,
)
SHARED_CONTEXT = Protocol("shared_context", SharedContextPrompt)
CONTINUATIONS = Protocol(
    "continuations",
    ContinuationsPrompt,
    batchable=False,
    alone="scores each continuation alone (teacher forcing)",
    samples=False,
)
