"""RULER's QA rows: SQuAD v2 (``qa_1``) and HotpotQA (``qa_2``), from the hub or a local JSONL file in the hub's
columns (``task.qa_path``). Every distinct paragraph is a document; a question's own documents are its gold ones
(HotpotQA's ten, SQuAD's one) and, for SQuAD, the other paragraphs of the same article come first among the
distractors, as in RULER. SQuAD's unanswerable questions are left out."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

from kvbench.tasks.base import TaskError

# dataset -> (hub repo, config, split): RULER reads SQuAD v2's dev set and HotpotQA's distractor dev set
HUB = {
    "squad": ("rajpurkar/squad_v2", None, "validation"),
    "hotpotqa": ("hotpotqa/hotpot_qa", "distractor", "validation"),
}


@dataclass(frozen=True)
class QaItem:
    question: str
    answers: list[str]
    gold: list[int]  # indices of its own documents
    related: list[int] = field(default_factory=list)  # distractors taken first (SQuAD: the same article's)


@dataclass(frozen=True)
class QaPool:
    items: list[QaItem]
    documents: list[str]


def check_source(dataset: str, qa_path: str | None, subset: str) -> None:
    """Cheap, before any model loads: the local file exists, or the hub can be reached."""
    if qa_path is not None:
        if not Path(qa_path).expanduser().is_file():
            raise TaskError(f"task.qa_path={qa_path} does not exist; point it at a JSONL file of {_what(dataset)}")
        return
    from kvbench.tasks.datasets import _hub_offline, _hub_reachable

    if not _hub_offline() and not _hub_reachable():
        raise TaskError(_unreachable(dataset, subset, "the hub is unreachable"))


def load_pool(dataset: str, qa_path: str | None, subset: str) -> QaPool:
    rows = _rows(dataset, qa_path, subset)
    pool = _squad(rows) if dataset == "squad" else _hotpot(rows)
    if not pool.items:
        raise TaskError(f"task.subset={subset}: no answerable question in {qa_path or HUB[dataset][0]}")
    return pool


def _rows(dataset: str, qa_path: str | None, subset: str) -> list[dict[str, Any]]:
    if qa_path is not None:
        check_source(dataset, qa_path, subset)
        return _read_local(str(Path(qa_path).expanduser()))
    check_source(dataset, qa_path, subset)
    import datasets

    repo, config, split = HUB[dataset]
    try:
        return list(datasets.load_dataset(repo, config, split=split).to_list())
    except (OSError, RuntimeError, ValueError) as err:
        raise TaskError(_unreachable(dataset, subset, f"{type(err).__name__}: {err}")) from err


@cache
def _read_local(path: str) -> list[dict[str, Any]]:
    from kvbench.tasks.datasets import read_jsonl

    return read_jsonl(Path(path))


def _squad(rows: list[dict[str, Any]]) -> QaPool:
    documents = sorted({row["context"] for row in rows})
    index = {text: i for i, text in enumerate(documents)}
    by_title: dict[str, list[int]] = {}
    for row in rows:
        paragraphs = by_title.setdefault(row.get("title", ""), [])
        if index[row["context"]] not in paragraphs:
            paragraphs.append(index[row["context"]])
    items = []
    for row in rows:
        answers = list(row["answers"]["text"])
        if answers:
            own = index[row["context"]]
            related = [i for i in by_title[row.get("title", "")] if i != own]
            items.append(QaItem(row["question"], answers, [own], related))
    return QaPool(items, documents)


def _hotpot(rows: list[dict[str, Any]]) -> QaPool:
    def paragraphs(row: dict[str, Any]) -> list[str]:
        context = row["context"]
        return [f"{title}\n{''.join(lines)}" for title, lines in zip(context["title"], context["sentences"])]

    documents = sorted({text for row in rows for text in paragraphs(row)})
    index = {text: i for i, text in enumerate(documents)}
    items = [QaItem(row["question"], [row["answer"]], [index[t] for t in paragraphs(row)]) for row in rows]
    return QaPool(items, documents)


def _what(dataset: str) -> str:
    repo, config, split = HUB[dataset]
    return f"{repo}{' ' + config if config else ''} rows ({split} split, the hub's columns)"


def _unreachable(dataset: str, subset: str, why: str) -> str:
    return (
        f"task.subset={subset} reads {HUB[dataset][0]} from the hub ({why}); set task.qa_path=FILE to a JSONL "
        f"file of {_what(dataset)}"
    )
