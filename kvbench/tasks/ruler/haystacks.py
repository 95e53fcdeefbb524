"""What RULER's prompts are made of: the repeated noise, the words of an essay haystack (a folder of text files, or
the hub's Paul Graham essays), and the word lists (``wonderwords``, as RULER draws its keys and common words)."""

from __future__ import annotations

import re
import uuid
from functools import cache
from pathlib import Path
from random import Random

from kvbench.tasks.base import TaskError

NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
ESSAY_REPO = "baber/paul_graham_essays"  # the essays RULER downloads, as one hub dataset (column ``text``)
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")


def sentences(text: str) -> list[str]:
    """``text`` cut after each sentence's final mark (RULER inserts essay needles between sentences)."""
    return [s for s in _SENTENCE_END.split(text.strip()) if s]


def essay_words(haystack_dir: str | None) -> list[str]:
    """The essay haystack as words, whitespace collapsed: every ``*.txt`` of ``haystack_dir`` in name order, or,
    with no folder, the hub's Paul Graham essays."""
    if haystack_dir is not None:
        return _words(tuple(p.read_text(encoding="utf-8") for p in text_files(haystack_dir)))
    check_essays_reachable()
    import datasets

    try:
        return _words(tuple(datasets.load_dataset(ESSAY_REPO, split="train")["text"]))
    except (OSError, RuntimeError, ValueError) as err:
        raise TaskError(f"{_no_essays(type(err).__name__ + ': ' + str(err))}") from err


@cache
def _words(texts: tuple[str, ...]) -> list[str]:
    return " ".join(texts).split()


def text_files(haystack_dir: str) -> list[Path]:
    """The folder's ``*.txt`` files, refused when the folder is missing or holds no text."""
    folder = Path(haystack_dir).expanduser()
    if not folder.is_dir():
        raise TaskError(f"task.haystack_dir={haystack_dir} is not a folder; point it at a folder of .txt files")
    files = sorted(p for p in folder.glob("*.txt") if p.is_file())
    if not any(p.stat().st_size for p in files):
        raise TaskError(f"task.haystack_dir={haystack_dir} holds no non-empty .txt file; the essay haystack reads them")
    return files


def check_essays_reachable() -> None:
    """With no haystack folder the essays come from the hub: refused at once when it cannot be read."""
    from kvbench.tasks.datasets import _hub_offline, _hub_reachable

    if _hub_offline():
        return  # the hub cache may hold them; a miss is refused when they are read
    if not _hub_reachable():
        raise TaskError(_no_essays("the hub is unreachable"))


def _no_essays(why: str) -> str:
    return (
        f"the essay haystack needs the hub's Paul Graham essays ({ESSAY_REPO}: {why}); set task.haystack_dir=DIR "
        "to a folder of .txt files to use as the haystack instead"
    )


@cache
def word_list(*categories: str) -> list[str]:
    """``wonderwords``' words of the given categories (noun, adjective, verb), sorted, without duplicates."""
    from wonderwords import RandomWord

    return sorted(set(RandomWord().filter(include_categories=list(categories))))


def random_value(rng: Random, kind: str) -> str:
    """A needle's key or value: a 7-digit number, an adjective-noun pair or a UUID."""
    if kind == "numbers":
        return str(rng.randint(1_000_000, 9_999_999))
    if kind == "words":
        return f"{rng.choice(word_list('adjective'))}-{rng.choice(word_list('noun'))}"  # RULER's adjective-noun
    if kind == "uuids":
        return str(uuid.UUID(int=rng.getrandbits(128), version=4))
    raise ValueError(f"unknown needle kind {kind!r}")
