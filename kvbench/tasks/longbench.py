"""LongBench v1: 21 long-context subsets, each with LongBench's own metric and decoding settings.

Per subset this keeps what decides the score (metric, max new tokens, first-line cut, chat template
or not, samsum's newline stop) as THUDM/LongBench has it; the prompt wording is kvbench's own.
Each prompt is ``head + context`` then ``tail`` (with the row's ``input`` in it), and the tail is
what ``question_aware=false`` feeds after the context has been compressed. ``ask=each`` groups the rows that
share a context into one example whose context is compressed once and whose rows' questions are each asked of
their own copy (:mod:`kvbench.tasks.shared_rows`), a row per question; ``n`` then counts contexts.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from kvbench.metrics.longbench import METRICS, best_over_references, first_line
from kvbench.tasks.base import Example, GenerationSettings, Question, RenderedPrompt, TaskError
from kvbench.tasks.datasets import DatasetTask, sample_indices
from kvbench.tasks.prompting import render_prompt
from kvbench.tasks.protocol import GENERATE, SHARED_CONTEXT, Protocol
from kvbench.tasks.registry import register_task
from kvbench.tasks.shared_rows import group_rows, shared_prompt


@dataclass(frozen=True)
class Subset:
    metric: str  # a name in kvbench.metrics.longbench.METRICS
    max_new_tokens: int
    head: str  # before the context
    tail: str  # after the context; "{input}" stands for the row's input
    chat: bool = True  # LongBench skips the chat template for few-shot and code subsets
    first_line: bool = False
    stop_strings: tuple[str, ...] = field(default=())


_ANSWER_ONLY = "Reply with the answer only, without explanation."
_QA_TAIL = "\n\nQuestion: {input}\nAnswer:"
_PASSAGES = f"Use the passages below to answer the question that follows them. {_ANSWER_ONLY}\n\n"
_NEXT_LINE = "\n\nWrite only the next line of the code.\n"

SUBSETS: dict[str, Subset] = {
    "narrativeqa": Subset(
        "qa_f1_score",
        128,
        "Read the story below (a book or a film script), then answer the question after it "
        "with a short phrase. Do not explain.\n\nStory:\n",
        _QA_TAIL,
    ),
    "qasper": Subset(
        "qa_f1_score",
        128,
        "Read the research paper below, then answer the question after it as briefly as you can. "
        'Reply "unanswerable" if the paper does not say; answer a yes/no question with "yes", '
        '"no" or "unanswerable".\n\nPaper:\n',
        _QA_TAIL,
    ),
    "multifieldqa_en": Subset(
        "qa_f1_score",
        64,
        f"Read the text below, then answer the question after it. {_ANSWER_ONLY}\n\nText:\n",
        _QA_TAIL,
    ),
    "multifieldqa_zh": Subset(
        "qa_f1_zh_score",
        64,
        "阅读下面的文字，然后回答后面的问题。只写出答案，不要解释。\n\n文字：\n",
        "\n\n问题：{input}\n答案：",
    ),
    "hotpotqa": Subset("qa_f1_score", 32, _PASSAGES, _QA_TAIL),
    "2wikimqa": Subset("qa_f1_score", 32, _PASSAGES, _QA_TAIL),
    "musique": Subset("qa_f1_score", 32, _PASSAGES, _QA_TAIL),
    "dureader": Subset(
        "rouge_zh_score", 128, "下面是几篇文章，请根据它们简洁地回答后面的问题。\n\n", "\n\n问题：{input}\n回答："
    ),
    "gov_report": Subset(
        "rouge_score",
        512,
        "Below is a report by a government agency.\n\nReport:\n",
        "\n\nSummarise the report above in about a page.\n\nSummary:",
    ),
    "qmsum": Subset(
        "rouge_score",
        512,
        "Below is the transcript of a meeting.\n\nTranscript:\n",
        "\n\nAnswer this query about the meeting in a few sentences: {input}\n\nAnswer:",
    ),
    "multi_news": Subset(
        "rouge_score",
        512,
        "Below are several news articles about one story.\n\nArticles:\n",
        "\n\nSummarise all of the articles above together in about a page.\n\nSummary:",
    ),
    "vcsum": Subset(
        "rouge_zh_score",
        512,
        "下面是一次会议的文字记录。\n\n会议记录：\n",
        "\n\n请用一段话概括上面的会议内容。\n\n会议概括：",
    ),
    "trec": Subset(
        "classification_score",
        64,
        "Say what type of answer each question asks for. Labelled examples:\n\n",
        "\n{input}",
        chat=False,
        first_line=True,
    ),
    "triviaqa": Subset(
        "qa_f1_score",
        32,
        "Answer the last question from its passage, as in the examples. Examples:\n\n",
        "\n{input}",
        chat=False,
        first_line=True,
    ),
    "samsum": Subset(
        "rouge_score",
        128,
        "Summarise the last dialogue in one sentence, as in the examples.\n\n",
        "\n{input}",
        chat=False,
        first_line=True,
        stop_strings=("\n",),
    ),
    "lsht": Subset(
        "classification_score",
        64,
        "判断最后一则新闻属于哪个类别。下面是一些已标注的例子。\n\n",
        "\n{input}",
        chat=False,
        first_line=True,
    ),
    "passage_count": Subset(
        "count_score",
        32,
        "Below are numbered paragraphs; some of them are repeats of others.\n\n",
        "\n\nHow many different paragraphs are there, once repeats are removed? Reply with a single number.\n\nAnswer:",
    ),
    "passage_retrieval_en": Subset(
        "retrieval_score",
        32,
        "Below are numbered paragraphs, then the abstract of one of them.\n\n",
        "\n\nAbstract: {input}\n\nWhich paragraph does this abstract describe? Reply in "
        'the form "Paragraph 7".\n\nAnswer:',
    ),
    "passage_retrieval_zh": Subset(
        "retrieval_zh_score",
        32,
        "下面是一些编号的段落，之后是其中一段的摘要。\n\n",
        "\n\n摘要：{input}\n\n这段摘要描述的是哪一段？请按“段落7”的格式回答。\n\n答案：",
    ),
    "lcc": Subset("code_sim_score", 64, "Complete the code below.\n\n", _NEXT_LINE, chat=False),
    "repobench-p": Subset(
        "code_sim_score",
        64,
        "Complete the code below. Related files from the same repository come first.\n\n",
        "\n{input}" + _NEXT_LINE,
        chat=False,
    ),
}


@register_task("longbench")
@dataclass
class LongBench(DatasetTask):
    """One LongBench v1 subset; ``score`` is LongBench's per-example score in [0, 1]."""

    primary_metric = "score"

    subset: str = "narrativeqa"
    ask: str = "together"  # each: rows sharing a context are one example, its context compressed once

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.subset not in SUBSETS:
            raise TaskError(f"unknown LongBench subset {self.subset!r}; choose one of {list(SUBSETS)}")
        if self.split != "test":
            raise TaskError(f"LongBench has only a 'test' split, not {self.split!r}")
        if self.ask not in ("together", "each"):
            raise TaskError(f"task.ask={self.ask!r}: choose together (a row each) or each (a context asked each row)")
        if self.ask == "each" and self.question_aware:
            raise TaskError(
                "task.ask=each compresses each context once, before any of its questions is seen; "
                "add task.question_aware=false"
            )

    @property
    def protocol(self) -> Protocol:  # type: ignore[override]  # chosen by task.ask
        return SHARED_CONTEXT if self.ask == "each" else GENERATE

    @property
    def spec(self) -> Subset:
        return SUBSETS[self.subset]

    def file_stem(self) -> str:
        return self.subset

    def label(self) -> str:
        return f"longbench/{self.subset}"

    def make_example(self, record: dict[str, Any], index: int) -> Example:
        return self.compose(
            self._row_id(record, index),
            self.spec.head + record[self.columns.text],
            self._asked(record),
            self._answers(record),
            self._meta(record, index),
        )

    def examples(self) -> list[Example]:
        if self.ask != "each":
            return super().examples()
        rows = self.records()
        # The class list is part of the key: the classification metric reads it per example.
        groups = group_rows([(r[self.columns.text], json.dumps(r.get("all_classes"))) for r in rows])
        return [self._shared(rows, groups[g]) for g in sample_indices(len(groups), self.n, self.seed)]

    def _shared(self, rows: list[dict[str, Any]], indices: list[int]) -> Example:
        """The rows ``indices`` (one context) as one example: its id the first row's, a question per row."""
        first = rows[indices[0]]
        asked = [Question(self._row_id(rows[i], i), self._asked(rows[i]), self._answers(rows[i])) for i in indices]
        meta = {**self._meta(first, indices[0]), "rows": indices}
        return Example(
            self._row_id(first, indices[0]), self.spec.head + first[self.columns.text], questions=asked, meta=meta
        )

    def _row_id(self, record: dict[str, Any], index: int) -> str:
        return str(record.get(self.columns.id or "") or f"{self.subset}-{index}")

    def _asked(self, record: dict[str, Any]) -> str:
        return self.spec.tail.replace("{input}", record.get(self.columns.question or "") or "")

    def _answers(self, record: dict[str, Any]) -> list[str]:
        assert self.columns.reference is not None  # required_columns
        return list(record[self.columns.reference])

    def _meta(self, record: dict[str, Any], index: int) -> dict[str, Any]:
        keys = ("all_classes", "length", "language")
        return {"index": index, "subset": self.subset, **{key: record.get(key) for key in keys}}

    def render(self, example: Example, tokenizer: Any) -> RenderedPrompt:
        if self.ask != "each":
            return super().render(example, tokenizer)
        chat = self.uses_chat(example, tokenizer)
        asked = [
            render_prompt(tokenizer, example.prompt, q.text, chat=chat, max_prompt_tokens=None)
            for q in example.questions
        ]
        return shared_prompt(asked, self.max_prompt_tokens)

    def uses_chat(self, example: Example, tokenizer: Any) -> bool:
        return self.spec.chat and super().uses_chat(example, tokenizer)

    def generation(self, example: Example) -> GenerationSettings:
        return GenerationSettings(
            max_new_tokens=self.max_new_tokens or self.spec.max_new_tokens, stop_strings=list(self.spec.stop_strings)
        )

    def postprocess(self, text: str, example: Example) -> str:
        return first_line(text) if self.spec.first_line else text

    def score(self, prediction: str, example: Example) -> dict[str, float]:
        value = best_over_references(
            METRICS[self.spec.metric], prediction, example.references, example.meta.get("all_classes")
        )
        return {"score": value, self.spec.metric: value}
