"""Any lm-eval task in kvbench's cells: lm-eval's docs, prompts and metrics, run under the cell's policy and budget.

``task=lm_eval task.tasks=[gsm8k]`` loads lm-eval's tasks (``harness``), makes each doc one example (id
``<task>/<doc index>``, so a killed cell resumes by doc), runs its requests through kvbench's engine and scores the
doc with lm-eval's own filters and ``process_results`` (``scoring``). ``generate_until`` requests are generated
(the rendered context as the prompt, lm-eval's stop strings and ``max_gen_toks``); ``loglikelihood`` requests (the
choices of a multiple-choice doc) teacher-force each continuation after its compressed context. Prompts are
tokenised as lm-eval's ``hf`` model tokenises them (``encoding``), with no chat template.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from kvbench.tasks.base import Example, GenerationSettings, RenderedPrompt, Task, TaskError
from kvbench.tasks.lm_eval.encoding import encode_context, encode_pair
from kvbench.tasks.lm_eval.harness import GENERATE_UNTIL, Doc, load_docs, require_lm_eval
from kvbench.tasks.lm_eval.scoring import doc_metrics
from kvbench.tasks.protocol import CONTINUATIONS, GENERATE, ContinuationsPrompt
from kvbench.tasks.registry import register_task

# lm-eval's default new-token cap for a request that names none (HFLM's max_gen_toks).
DEFAULT_MAX_GEN_TOKS = 256
# The metadata keys lm-eval's synthetic tasks read the tokenizer's name from (lm-eval passes its model arguments).
TOKENIZER_KEYS = ("tokenizer", "pretrained")


@register_task("lm_eval")
@dataclass
class LmEvalTask(Task):
    """lm-eval's tasks, a row per doc."""

    tasks: list[str] = field(default_factory=list)
    limit: float | None = None  # lm-eval's per task: a count of docs, or a fraction below 1
    n: int | None = None  # at most this many docs in all, after ``limit``
    num_fewshot: int | None = None  # null: each task's own
    include_path: str | None = None  # a folder of the user's task YAMLs
    metadata: dict[str, Any] | None = None  # lm-eval's --metadata (RULER's max_seq_lengths, ...)
    metric: str | None = None  # the row's score; null: the first metric lm-eval gives the first scored doc

    def __post_init__(self) -> None:
        if not self.tasks:
            raise TaskError("task=lm_eval needs task.tasks=[name, ...], lm-eval's task names (e.g. [gsm8k])")
        if self.limit is not None and self.limit <= 0:
            raise TaskError(f"task.limit={self.limit} must be a positive count or a fraction below 1 (or null)")
        require_lm_eval()
        self._docs: dict[str, Doc] | None = None
        self._model: dict[str, Any] = {}
        self._continuation_tokens: dict[str, int] = {}
        if self.metric:
            self.primary_metric = self.metric  # type: ignore[misc]  # the row's score follows the choice

    def use_model(self, model: dict[str, Any]) -> None:
        self._model = dict(model)

    def _metadata(self) -> dict[str, Any]:
        """lm-eval's task metadata: the model's tokenizer (as lm-eval hands its model arguments to the tasks that
        generate their data with it), then the user's ``task.metadata``."""
        metadata = dict(self.metadata or {})
        path = model_tokenizer_path(self._model)
        if path and not any(metadata.get(key) for key in TOKENIZER_KEYS):
            metadata["pretrained"] = path
        return metadata

    def docs(self) -> dict[str, Doc]:
        """Every doc by example id, loaded once."""
        if self._docs is None:
            metadata = json.dumps(self._metadata(), sort_keys=True)
            loaded = load_docs(tuple(self.tasks), self.include_path, metadata, self.limit, self.num_fewshot)
            kinds = {doc.request_type for doc in loaded}
            if len(kinds) > 1:
                raise TaskError(
                    f"task.tasks={self.tasks} mixes {sorted(kinds)} requests; run them as separate cells "
                    "(kvbench-run -m 'task.tasks=[a],[b]')"
                )
            self._docs = {doc.id: doc for doc in loaded[: self.n]}
            # The protocol follows the request type of lm-eval's tasks.
            self.protocol = GENERATE if kinds <= {GENERATE_UNTIL} else CONTINUATIONS  # type: ignore[misc]
        return self._docs

    def validate(self) -> None:
        """Load lm-eval's tasks now, so an unknown name or data it cannot build is refused before any model loads."""
        self.docs()

    def examples(self) -> list[Example]:
        return [
            Example(id=doc_id, prompt=doc.instances[0].arguments[0], meta={"task": doc.task_name})
            for doc_id, doc in self.docs().items()
        ]

    def render(self, example: Example, tokenizer: Any) -> RenderedPrompt:
        doc = self.docs()[example.id]
        if doc.request_type == GENERATE_UNTIL:
            return RenderedPrompt(input_ids=encode_context(tokenizer, example.prompt))
        pairs = [encode_pair(tokenizer, *inst.arguments) for inst in doc.instances]
        longest = max((context for context, _ in pairs), key=len)
        self._continuation_tokens[example.id] = max(len(continuation) for _, continuation in pairs)
        return ContinuationsPrompt(input_ids=longest, pairs=pairs)

    def generation(self, example: Example) -> GenerationSettings:
        doc = self.docs()[example.id]
        if doc.request_type != GENERATE_UNTIL:  # the longest continuation, counted when it was rendered
            return GenerationSettings(max_new_tokens=self._continuation_tokens.get(example.id, 1))
        kwargs = dict(doc.instances[0].arguments[1])
        until = kwargs.get("until") or []
        stops = [until] if isinstance(until, str) else list(until)
        new_tokens = kwargs.get("max_gen_toks") or kwargs.get("max_new_tokens") or DEFAULT_MAX_GEN_TOKS
        return GenerationSettings(max_new_tokens=int(new_tokens), stop_strings=[s for s in stops if s])

    def postprocess(self, text: str, example: Example) -> str:
        """Cut at the first stop string, as lm-eval cuts its own generations."""
        stops = self.generation(example).stop_strings
        cut = min((text.find(s) for s in stops if s in text), default=len(text))
        return text[:cut]

    def score(self, prediction: str, example: Example) -> dict[str, float]:
        return self._scored(doc_metrics(self.docs()[example.id], [prediction]))

    def score_continuations(self, example: Example, results: list[tuple[float, bool]]) -> dict[str, float]:
        return self._scored(doc_metrics(self.docs()[example.id], list(results)))

    def _scored(self, metrics: dict[str, float]) -> dict[str, float]:
        """The row's metrics; the first row fixes the primary metric when none was named."""
        if not self.metric and self.primary_metric not in metrics and metrics:
            self.primary_metric = next(iter(metrics))  # type: ignore[misc]
        return metrics


def model_tokenizer_path(model: dict[str, Any]) -> str | None:
    """Where the model's tokenizer loads from (a hub id or a folder), or None for the tiny test model, whose
    tokenizer lives in code."""
    source = model.get("source", "embedded")
    if source == "pretrained":
        return model.get("name_or_path")
    if source == "embedded":
        from kvbench.embedded import embedded_checkpoint

        return str(embedded_checkpoint(model.get("cache_dir"), model.get("embedded")))
    return None
