"""News summarisation (XSum, CNN/DailyMail) scored by ROUGE: the article is the context to compress.

The instruction comes after the article, so with ``question_aware=false`` the policy compresses
the article without knowing what will be asked of it.
"""

from __future__ import annotations

from typing import Any

from kvbench.metrics.rouge import rouge_scores
from kvbench.tasks.base import Example, GenerationSettings
from kvbench.tasks.datasets import DatasetTask
from kvbench.tasks.registry import register_task


class SummarizationTask(DatasetTask):
    """One hub dataset of (document, summary) rows (``columns.text``, ``columns.reference``, from the config);
    subclasses word the instruction."""

    instruction = ""
    default_max_new_tokens = 64
    primary_metric = "rougeL"

    def make_example(self, record: dict[str, Any], index: int) -> Example:
        columns = self.columns
        assert columns.reference is not None  # required_columns
        return self.compose(
            str(record.get(columns.id or "", index)),
            f"Article:\n{record[columns.text].strip()}",
            f"\n\n{self.instruction}\nSummary:",
            [record[columns.reference]],
            {"index": index},
        )

    def score(self, prediction: str, example: Example) -> dict[str, float]:
        return rouge_scores(prediction, example.references)

    def generation(self, example: Example) -> GenerationSettings:
        return GenerationSettings(max_new_tokens=self.max_new_tokens or self.default_max_new_tokens)

    def postprocess(self, text: str, example: Example) -> str:
        return text.strip()


@register_task("xsum")
class XSum(SummarizationTask):
    instruction = "Summarise the article above in a single sentence."


@register_task("cnn_dailymail")
class CNNDailyMail(SummarizationTask):
    instruction = "Summarise the article above in three or four short highlight sentences, one per line."
    default_max_new_tokens = 128
    primary_metric = "rougeLsum"
