"""``task=ruler``: one RULER subtask (``task.subset``) at ``task.context_tokens`` tokens of the model's tokenizer.

An example's questions and answers are drawn when the examples are listed (seeded, whatever the tokenizer); its
haystack is grown when it is rendered, to the largest that keeps prompt + answer tokens within the asked length.
The context is compressed alone by default and the question fed after it (``question_aware=false``), as kvpress
evaluates RULER, so the policy cannot know what will be asked; ``question_aware=true`` compresses the question too.
``niah_multiquery`` asks its keys in one question, as RULER does (``ask=together``); ``ask=each`` compresses the
context once and asks each key alone of its own copy (the ``shared_context`` protocol), a row per key.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvbench.metrics.ruler import clean_prediction, string_match_all, string_match_part
from kvbench.tasks.base import Example, GenerationSettings, Question, RenderedPrompt, Task, TaskError
from kvbench.tasks.datasets import sample_indices
from kvbench.tasks.prompting import chat_available, render_prompt
from kvbench.tasks.protocol import GENERATE, SHARED_CONTEXT, Protocol, SharedContextPrompt
from kvbench.tasks.registry import register_task
from kvbench.tasks.ruler import generators as g
from kvbench.tasks.ruler.fit import check_close, largest_fitting
from kvbench.tasks.ruler.haystacks import essay_words
from kvbench.tasks.ruler.qa import QaPool, load_pool
from kvbench.tasks.ruler.templates import SUBTASKS, Subtask

METRICS = {"string_match_all": string_match_all, "string_match_part": string_match_part}
Build = Callable[[int], g.Sample]


@register_task("ruler")
@dataclass
class Ruler(Task):
    """One RULER subtask; ``score`` is RULER's per-example score, x100 (string_match_all, or _part for QA)."""

    primary_metric = "score"

    subset: str = "niah_single_1"
    context_tokens: int = 4096  # prompt + the answer's max_new_tokens, in the model's tokenizer
    n: int = 20
    seed: int = 0
    haystack_dir: str | None = None  # essay haystack: a folder of .txt files; None: the hub's Paul Graham essays
    qa_path: str | None = None  # qa_1 / qa_2: a JSONL file of the hub's rows; None: the hub
    question_aware: bool = False  # true: the question is compressed with the context
    ask: str = "together"  # each: every asked key its own question of one compressed context (niah_multiquery)
    chat_template: bool = True
    max_new_tokens: int | None = None  # None: RULER's for the subset
    _pool: QaPool | None = field(default=None, init=False, repr=False, compare=False)
    _essay: list[str] | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.subset not in SUBTASKS:
            raise TaskError(f"unknown RULER subset {self.subset!r}; choose one of {list(SUBTASKS)}")
        if not isinstance(self.n, int) or isinstance(self.n, bool) or self.n < 1:
            raise TaskError(f"task.n must be a whole number >= 1 (RULER's prompts are generated), not {self.n!r}")
        if self.ask not in ("together", "each"):
            raise TaskError(f"task.ask={self.ask!r}: choose together or each")
        if self.ask == "each" and self.spec.n_queries < 2:
            raise TaskError(f"task.ask=each asks several keys one by one; {self.subset} asks one (use niah_multiquery)")
        if self.ask == "each" and self.question_aware:
            raise TaskError(
                "task.ask=each asks every question of one context compressed without them; use question_aware=false"
            )
        if self.context_tokens <= self.answer_tokens:
            raise TaskError(
                f"task.context_tokens={self.context_tokens} leaves no room for a prompt beside the answer's "
                f"{self.answer_tokens} tokens"
            )

    @property
    def protocol(self) -> Protocol:  # type: ignore[override]  # chosen by task.ask
        return SHARED_CONTEXT if self.ask == "each" else GENERATE

    @property
    def spec(self) -> Subtask:
        return SUBTASKS[self.subset]

    @property
    def answer_tokens(self) -> int:
        return self.max_new_tokens or self.spec.max_new_tokens

    def asked_length(self) -> int:
        return self.context_tokens

    def validate(self) -> None:
        """The haystack's texts and the QA rows are read now (from the folder, the file or the hub), so that a
        missing or empty source is refused before any model loads."""
        if self.spec.haystack == "essay" and not self.essay:
            raise TaskError(f"task.subset={self.subset}: the essay haystack holds no words")
        if self.spec.kind == "qa" and len(self.pool.items) < int(self.n or 0):
            raise TaskError(f"task.n={self.n}: {self.subset} has only {len(self.pool.items)} answerable questions")

    def examples(self) -> list[Example]:
        n = int(self.n or 0)  # checked in __post_init__
        picks = sample_indices(len(self.pool.items), n, self.seed) if self.spec.kind == "qa" else []
        out = []
        for i in range(n):
            seed = f"ruler/{self.subset}/{self.seed}/{i}"
            meta: dict[str, Any] = {"seed": seed, "subset": self.subset, "question_aware": self.question_aware}
            if self.spec.kind == "qa":
                meta["item"] = picks[i]
            sample = self._builder(meta)[0](self._lowest(meta))  # what is asked does not depend on the size
            if self.ask == "each":
                meta["ask"] = "each"
            out.append(
                Example(
                    id=f"{self.subset}-{i}",
                    prompt=sample.question,
                    references=sample.references,
                    question="" if self.question_aware else sample.question,
                    questions=[Question(str(k), q, refs) for k, (q, _, refs) in enumerate(sample.each)]
                    if self.ask == "each"
                    else [],
                    meta=meta,
                )
            )
        return out

    @property
    def pool(self) -> QaPool:
        if self._pool is None:
            self._pool = load_pool(self.spec.dataset, self.qa_path, self.subset)
        return self._pool

    @property
    def essay(self) -> list[str]:
        if self._essay is None:
            self._essay = essay_words(self.haystack_dir)
        return self._essay

    def _builder(self, meta: dict[str, Any]) -> tuple[Build, int]:
        """The example at a given size, and the largest size there is."""
        spec, seed, tokens = self.spec, meta["seed"], self.context_tokens
        if spec.kind == "niah":
            essay = self.essay if spec.haystack == "essay" else None
            most = len(essay) if essay is not None else tokens  # every noise copy or needle takes tokens
            return (lambda size: g.niah(spec, seed, size, essay)), most
        if spec.kind == "vt":
            return (lambda size: g.vt(seed, size)), tokens
        if spec.kind == "cwe":
            return (lambda size: g.cwe(seed, size, tokens)), g.cwe_most(tokens)
        if spec.kind == "fwe":
            return (lambda size: g.fwe(seed, size, tokens)), 4 * tokens
        pool, item = self.pool, meta["item"]
        candidates = g.qa_candidates(seed, pool, item)
        most = sum(len(pool.documents[i]) for i in candidates)
        return (lambda size: g.qa(seed, size, pool, item, candidates)), most

    def _lowest(self, meta: dict[str, Any]) -> int:
        spec = self.spec
        if spec.kind == "niah":
            return 1 if spec.haystack == "essay" else 0
        return {"vt": g.VT_HOPS, "cwe": 0, "fwe": g.FWE_LEAST, "qa": 0}[spec.kind]

    def render(self, example: Example, tokenizer: Any) -> RenderedPrompt:
        return self.fitted(example, tokenizer)[1]

    def fitted(self, example: Example, tokenizer: Any) -> tuple[g.Sample, RenderedPrompt]:
        """The example with the largest haystack whose prompt, with the answer's tokens, fits ``context_tokens``:
        its text in parts and its ids."""
        build, most = self._builder(example.meta)
        chat = chat_available(tokenizer, self.chat_template)

        def length(size: int) -> int:
            rendered = self.prompt(build(size), tokenizer, chat)
            asked = [len(q) for q in rendered.questions] if isinstance(rendered, SharedContextPrompt) else []
            return len(rendered.input_ids) + max([len(rendered.suffix_ids), *asked]) + self.answer_tokens

        size = largest_fitting(length, self.context_tokens, self._lowest(example.meta), most)
        check_close(length(size), self.context_tokens)
        sample = build(size)
        return sample, self.prompt(sample, tokenizer, chat)

    def prompt(self, sample: g.Sample, tokenizer: Any, chat: bool) -> RenderedPrompt:
        if self.ask == "each":
            asked = [
                render_prompt(tokenizer, sample.context, q, chat=chat, max_prompt_tokens=None, answer_prefix=prefix)
                for q, prefix, _ in sample.each
            ]
            return shared_context([p.input_ids + p.suffix_ids for p in asked])
        question = sample.question if not self.question_aware else ""
        context = sample.context if not self.question_aware else sample.context + sample.question
        return render_prompt(
            tokenizer, context, question, chat=chat, max_prompt_tokens=None, answer_prefix=sample.answer_prefix
        )

    def generation(self, example: Example) -> GenerationSettings:
        return GenerationSettings(max_new_tokens=self.answer_tokens)

    def postprocess(self, text: str, example: Example) -> str:
        return clean_prediction(text)

    def score(self, prediction: str, example: Example) -> dict[str, float]:
        value = METRICS[self.spec.metric](prediction, example.references)
        return {"score": value, self.spec.metric: value}


def shared_context(prompts: list[list[int]]) -> SharedContextPrompt:
    """Whole prompts that start with one context, as that context (the ids they all start with) and each one's
    rest: each question's ids are then exactly its whole prompt's tokenisation."""
    common, most = 0, min(len(p) for p in prompts) - 1  # every question keeps at least one token of its own
    while common < most and all(p[common] == prompts[0][common] for p in prompts):
        common += 1
    return SharedContextPrompt(input_ids=prompts[0][:common], questions=[p[common:] for p in prompts])
