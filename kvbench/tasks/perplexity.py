"""Perplexity of a long text with the policy active, next to the full cache's: the documents, how each is
cut, and the metrics of the scored tokens' NLLs. The runner does the scoring (:mod:`kvbench.runner.perplexity`).

Each document is tokenised as plain text (no chat template) and cut to ``prefix_tokens +
score_tokens`` tokens. The first ``prefix_tokens`` are the prompt; the next ``score_tokens`` are
teacher-forced one at a time and scored (a fractional budget is then a fraction of prefix + scored
tokens, as for generation); the prefix itself is not scored.

``perplexity`` = exp(mean NLL) over the scored tokens, ``perplexity_full`` the same with the full
cache, ``perplexity_delta`` their difference; the runner adds ``fidelity_kl`` / ``fidelity_top1``
comparing the two runs' next-token distributions along the text.

Texts: the long documents of a hub dataset, declared in the config as the dataset tasks declare theirs
(``source``, and ``columns.text``: LongBench ``context``, XSum ``document``, CNN/DailyMail ``article``), read by
the same loader (hub, or ``data_dir`` of JSONL files), or any JSONL file of ``{"text": ...}`` lines
(``path=...``). The default is LongBench gov_report, whose reports are far longer than the default 1024 + 256
tokens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvbench.tasks.base import Example, GenerationSettings, Task, TaskError
from kvbench.tasks.datasets import Columns, HubSource, check_records, load_records, read_jsonl, sample_indices
from kvbench.tasks.protocol import LIKELIHOOD, ScoredText
from kvbench.tasks.registry import register_task

# A document is used only if it has at least this many characters per needed token (a cheap
# pre-filter before any tokenizer is loaded; English BPE text has about 4 characters per token).
MIN_CHARS_PER_TOKEN = 3


@register_task("perplexity")
@dataclass
class PerplexityTask(Task):
    primary_metric = "perplexity"  # lower is better
    protocol = LIKELIHOOD

    source: HubSource = field(default_factory=HubSource)
    columns: Columns = field(default_factory=Columns)
    subset: str | None = None  # the rows' file (in the source's archive or data_dir); None: the split's
    split: str = "test"
    data_dir: str | None = None
    path: str | None = None  # a JSONL file of {"text": ...} lines, read instead of the source
    n: int | None = 8
    seed: int = 0
    prefix_tokens: int = 1024
    score_tokens: int = 256

    def __post_init__(self) -> None:
        if self.prefix_tokens < 1 or self.score_tokens < 1:
            raise TaskError("task.prefix_tokens and task.score_tokens must both be >= 1")

    def _label(self) -> str:
        return self.subset or f"split {self.split!r}"

    def validate(self) -> None:
        if self.path is not None:
            if not Path(self.path).is_file():
                raise FileNotFoundError(f"task.path={self.path} does not exist")
        else:
            check_records(self.source, self.subset or self.split, self._label(), self.data_dir)

    def _records(self) -> list[dict[str, Any]]:
        if self.path is not None:
            return read_jsonl(Path(self.path))
        return load_records(self.source, self.subset or self.split, self._label(), self.split, self.data_dir)

    def examples(self) -> list[Example]:
        need = MIN_CHARS_PER_TOKEN * (self.prefix_tokens + self.score_tokens)
        label = self.subset or "text"
        docs = []
        for index, record in enumerate(self._records()):
            text = record.get(self.columns.text) or ""
            if len(text) >= need:
                doc_id = record.get(self.columns.id or "") or f"{label}-{index}"
                docs.append(Example(id=str(doc_id), prompt=text, meta={"index": index}))
        if not docs:
            raise TaskError(
                f"no {label} document has the {need} characters that {self.prefix_tokens} + "
                f"{self.score_tokens} tokens need; lower task.prefix_tokens or task.score_tokens"
            )
        return [docs[i] for i in sample_indices(len(docs), self.n, self.seed)]

    def render(self, example: Example, tokenizer: Any) -> ScoredText:
        """The first ``prefix + score`` tokens; a shorter document is split in the same proportion."""
        ids = list(tokenizer(example.prompt)["input_ids"])
        total = self.prefix_tokens + self.score_tokens
        if len(ids) >= total:
            prefix, targets = ids[: self.prefix_tokens], ids[self.prefix_tokens : total]
        else:
            cut = min(len(ids) - 1, max(1, round(len(ids) * self.prefix_tokens / total)))
            prefix, targets = ids[:cut], ids[cut:]
        return ScoredText(input_ids=prefix, targets=targets, n_prompt_tokens_raw=len(ids))

    def generation(self, example: Example) -> GenerationSettings:
        return GenerationSettings(max_new_tokens=self.score_tokens)

    def score(self, prediction: str, example: Example) -> dict[str, float]:
        raise NotImplementedError("perplexity is scored from token NLLs (score_nll), not from generated text")

    def score_nll(self, nll: list[float], nll_full: list[float]) -> dict[str, float]:
        """The metrics of one text from its scored tokens' NLLs (nats) under the run's policy and the full cache:
        ``perplexity`` = exp(mean NLL), ``perplexity_full`` the full cache's, ``perplexity_delta`` the
        difference."""
        mean, mean_full = sum(nll) / len(nll), sum(nll_full) / len(nll_full)
        perplexity, perplexity_full = math.exp(mean), math.exp(mean_full)
        return {
            "perplexity": perplexity,
            "nll": mean,
            "perplexity_full": perplexity_full,
            "nll_full": mean_full,
            "perplexity_delta": perplexity - perplexity_full,
        }
