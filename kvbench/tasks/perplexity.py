"""Perplexity of a long text with the policy active, next to the full cache's: the documents, how each is
cut, and the metrics of the scored tokens' NLLs. The runner does the scoring (:mod:`kvbench.runner.perplexity`).

Each document is tokenised as plain text (no chat template) and cut to ``prefix_tokens +
score_tokens`` tokens. The first ``prefix_tokens`` are the prompt; the next ``score_tokens`` are
teacher-forced one at a time and scored (a fractional budget is then a fraction of prefix + scored
tokens, as for generation); the prefix itself is not scored.

``perplexity`` = exp(mean NLL) over the scored tokens, ``perplexity_full`` the same with the full
cache, ``perplexity_delta`` their difference; the runner adds ``fidelity_kl`` / ``fidelity_top1``
comparing the two runs' next-token distributions along the text.

Texts: the long documents of a dataset task's records (LongBench ``context``, XSum ``document``,
CNN/DailyMail ``article``), read by the same loader (hub, or ``data_dir`` of JSONL files), or any
JSONL file of ``{"text": ...}`` lines (``dataset=jsonl path=...``). The default is LongBench
gov_report, whose reports are far longer than the default 1024 + 256 tokens.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from kvbench.tasks.base import Example, GenerationSettings, Task
from kvbench.tasks.datasets import check_records, load_records, sample_indices
from kvbench.tasks.protocol import LIKELIHOOD, ScoredText
from kvbench.tasks.registry import register_task

TEXT_FIELDS = {"longbench": "context", "xsum": "document", "cnn_dailymail": "article", "jsonl": "text"}
# A document is used only if it has at least this many characters per needed token (a cheap
# pre-filter before any tokenizer is loaded; English BPE text has about 4 characters per token).
MIN_CHARS_PER_TOKEN = 3


@register_task("perplexity")
class PerplexityTask(Task):
    primary_metric = "perplexity"  # lower is better
    protocol = LIKELIHOOD

    def __init__(
        self,
        dataset: str = "longbench",
        subset: str | None = "gov_report",
        split: str = "test",
        data_dir: str | None = None,
        path: str | None = None,
        text_field: str | None = None,
        n: int | None = 8,
        seed: int = 0,
        prefix_tokens: int = 1024,
        score_tokens: int = 256,
    ) -> None:
        if dataset not in TEXT_FIELDS:
            raise ValueError(f"task.dataset={dataset!r} is unknown; choose one of {sorted(TEXT_FIELDS)}")
        if dataset == "jsonl" and not path:
            raise ValueError("task.dataset=jsonl needs task.path=<file.jsonl> with a 'text' field per line")
        if int(prefix_tokens) < 1 or int(score_tokens) < 1:
            raise ValueError("task.prefix_tokens and task.score_tokens must both be >= 1")
        self.dataset, self.split, self.data_dir = dataset, split, data_dir
        self.path = Path(path) if path else None
        self.subset = subset if dataset == "longbench" else None
        self.text_field = text_field or TEXT_FIELDS[dataset]
        self.n, self.seed = n, int(seed)
        self.prefix_tokens, self.score_tokens = int(prefix_tokens), int(score_tokens)

    def validate(self) -> None:
        if self.dataset == "jsonl":
            if self.path is None or not self.path.is_file():
                raise FileNotFoundError(f"task.path={self.path} does not exist")
        else:
            check_records(self.dataset, self.split, self.data_dir, self.subset)

    def _records(self) -> list[dict[str, Any]]:
        if self.dataset == "jsonl" and self.path is not None:
            lines = self.path.read_text(encoding="utf-8").splitlines()
            return [json.loads(line) for line in lines if line.strip()]
        return load_records(self.dataset, self.split, self.data_dir, self.subset)

    def examples(self) -> list[Example]:
        need = MIN_CHARS_PER_TOKEN * (self.prefix_tokens + self.score_tokens)
        label = self.subset or self.dataset
        docs = []
        for index, record in enumerate(self._records()):
            text = record.get(self.text_field) or ""
            if len(text) >= need:
                doc_id = record.get("_id") or record.get("id") or f"{label}-{index}"
                docs.append(Example(id=str(doc_id), prompt=text, meta={"index": index}))
        if not docs:
            raise ValueError(
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
