"""Perplexity of a long text with the policy active, next to the full cache's.

Each document is tokenised as plain text (no chat template) and cut to ``prefix_tokens +
score_tokens`` tokens. The first ``prefix_tokens`` are the prompt: prefilled (in chunks of
``stride``) and, for ``stage=prefill`` or ``both``, compressed to the budget. The next
``score_tokens`` are teacher-forced one token at a time through the decode loop, evicting as they
arrive for ``stage=decode`` or ``both`` (a fractional budget is then a fraction of prefix + scored
tokens, as for generation). The NLL of every scored token is read from the logits that predict it,
so the first scored token is predicted by the prefill; the prefix itself is not scored.

``perplexity`` = exp(mean NLL) over the scored tokens, ``perplexity_full`` the same with the full
cache (computed once per example through the same engine path and stored with the references),
``perplexity_delta`` their difference; ``fidelity_kl`` / ``fidelity_top1`` compare the two runs'
next-token distributions along the text (top-1: the argmaxes agree).

Texts: the long documents of a dataset task's records (LongBench ``context``, XSum ``document``,
CNN/DailyMail ``article``), read by the same loader (hub, or ``data_dir`` of JSONL files), or any
JSONL file of ``{"text": ...}`` lines (``dataset=jsonl path=...``). The default is LongBench
gov_report, whose reports are far longer than the default 1024 + 256 tokens.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvbench.tasks.base import Example, GenerationSettings, RenderedPrompt, Task
from kvbench.tasks.datasets import check_records, load_records, sample_indices
from kvbench.tasks.registry import register_task

TEXT_FIELDS = {"longbench": "context", "xsum": "document", "cnn_dailymail": "article", "jsonl": "text"}
# A document is used only if it has at least this many characters per needed token (a cheap
# pre-filter before any tokenizer is loaded; English BPE text has about 4 characters per token).
MIN_CHARS_PER_TOKEN = 3


@dataclass
class ScoredText(RenderedPrompt):
    """The prefix as the prompt, plus the tokens to teacher-force and score."""

    targets: list[int] = field(default_factory=list)


@register_task("perplexity")
class PerplexityTask(Task):
    primary_metric = "perplexity"  # lower is better

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
        self.dataset, self.split, self.data_dir, self.path = dataset, split, data_dir, path
        self.subset = subset if dataset == "longbench" else None
        self.text_field = text_field or TEXT_FIELDS[dataset]
        self.n, self.seed = n, int(seed)
        self.prefix_tokens, self.score_tokens = int(prefix_tokens), int(score_tokens)

    def validate(self) -> None:
        if self.dataset == "jsonl":
            if not Path(self.path).is_file():
                raise FileNotFoundError(f"task.path={self.path} does not exist")
        else:
            check_records(self.dataset, self.split, self.data_dir, self.subset)

    def _records(self) -> list[dict[str, Any]]:
        if self.dataset == "jsonl":
            lines = Path(self.path).read_text(encoding="utf-8").splitlines()
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
        raise NotImplementedError("perplexity is scored in evaluate(), not from generated text")

    def evaluate(self, lm: Any, spec: Any, example: Example, prompt: RenderedPrompt, references: Any) -> dict[str, Any]:
        from kvbench.engine.generate import DecodeSettings, generate
        from kvbench.fidelity import forced_reference, prompt_hash, reference_key
        from kvbench.metrics.fidelity import kl_divergence, token_nll, top1_agreement, topk_mass

        if not isinstance(prompt, ScoredText) or not prompt.targets:
            raise ValueError(f"example {example.id}: nothing to score (the text is too short)")
        targets = prompt.targets
        settings = DecodeSettings(max_new_tokens=len(targets), seed=spec.seed)
        key = reference_key(
            "teacher_forced", lm, spec, example.id, prompt_hash(prompt.input_ids, [], targets), settings
        )
        ref = references.get_or_create(
            key, lambda: forced_reference(lm, prompt.input_ids, targets, settings, spec.stride)
        )
        g = generate(
            lm.model,
            lm.tokenizer,
            prompt.input_ids,
            spec.policy,
            spec.budget,
            spec.stage,
            settings,
            stride=spec.stride,
            forced_tokens=targets,
            return_logits=True,
        )
        nll = float(token_nll(g.logits, targets).mean())
        nll_full = float(sum(ref.nll) / len(ref.nll))
        perplexity, perplexity_full = math.exp(nll), math.exp(nll_full)
        return {
            "metrics": {
                "perplexity": perplexity,
                "nll": nll,
                "perplexity_full": perplexity_full,
                "nll_full": nll_full,
                "perplexity_delta": perplexity - perplexity_full,
                "fidelity_top1": top1_agreement(g.logits, ref.argmax),
                "fidelity_kl": kl_divergence(ref.summary, g.logits),
                "fidelity_topk_mass": topk_mass(ref.summary),
            },
            "generation": g,
            "scored_tokens": len(targets),
            "fidelity_reference": references.path(key).name,
        }
