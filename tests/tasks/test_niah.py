"""Needle in a haystack checked on the generated text itself, in SmolLM2's tokens: the needle sits at the sentence
boundary nearest the asked depth of the haystack, the prompt fills the asked length (within 5 % below), seeds
reproduce; exact match and the insertion point by hand; bad options refused."""

from __future__ import annotations

import json
import re

import pytest
from conftest import SHARED_DATA

from kvbench.models import load_tokenizer
from kvbench.tasks.base import TaskError
from kvbench.tasks.niah import Niah, exact_match, insertion_point

XSUM = SHARED_DATA / "xsum" / "test.jsonl"
needs_data = pytest.mark.skipif(not XSUM.is_file(), reason=f"sample data not found at {XSUM}")
NEEDLE = re.compile(r"The special magic number for (\S+) is: (\d+)\.")
ANSWER_TOKENS = 16


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(source="embedded", embedded="smollm2")[0]


@pytest.fixture(scope="module")
def articles(tmp_path_factory) -> str:
    """A haystack folder of news articles (the shared samples), written as text files."""
    folder = tmp_path_factory.mktemp("articles")
    with XSUM.open(encoding="utf-8") as lines:
        for i, line in zip(range(80), lines):
            (folder / f"{i:02d}.txt").write_text(json.loads(line)["document"], encoding="utf-8")
    return str(folder)


def count(tok, text: str) -> int:
    return len(tok(text, add_special_tokens=False)["input_ids"])


@needs_data
@pytest.mark.parametrize("tokens", [1024, 2048])
@pytest.mark.parametrize("depth", [0, 10, 50, 77, 100])
def test_needle_sits_at_the_boundary_nearest_the_depth(tok, articles, tokens, depth):
    task = Niah(context_tokens=tokens, depth=depth, n=2, haystack_dir=articles)
    for example in task.examples():
        sample, prompt = task.fitted(example, tok)
        (match,) = NEEDLE.finditer(sample.body)
        assert match.group(2) == example.references[0] and match.group(1) == example.meta["key"]
        start, end = match.span()
        # The haystack without the needle, and every place between its sentences (a mark, then a space).
        before, after = sample.body[:start].rstrip(" "), sample.body[end:].lstrip(" ")
        haystack = (before + " " + after).strip()
        boundaries = [0, len(haystack)] + [m.start() + 1 for m in re.finditer(r"[.!?](?= )", haystack)]
        target = depth / 100 * count(tok, haystack)
        distances = {b: abs(count(tok, haystack[:b].rstrip()) - target) for b in boundaries}
        assert distances[len(before)] == min(distances.values()), (depth, len(before), sorted(distances.items())[:5])
        if depth == 0:
            assert sample.body.startswith(match.group())
        if depth == 100:
            assert sample.body.endswith(match.group())
        # The needle is in the prompt's ids as the tokenizer cuts it there.
        needle_ids = tok(("" if depth == 0 else " ") + match.group(), add_special_tokens=False)["input_ids"]
        ids = prompt.input_ids
        assert any(ids[i : i + len(needle_ids)] == needle_ids for i in range(len(ids)))


@needs_data
@pytest.mark.parametrize("tokens", [1024, 2048, 3000])
def test_prompt_fills_the_asked_length(tok, articles, tokens):
    task = Niah(context_tokens=tokens, depth=50, n=3, haystack_dir=articles, max_new_tokens=ANSWER_TOKENS)
    for example in task.examples():
        prompt = task.render(example, tok)
        total = len(prompt.input_ids) + len(prompt.suffix_ids)
        assert 0.95 * tokens <= total + ANSWER_TOKENS <= tokens
        # The question and the answer prefix are fed after the compressed context (query-agnostic by default).
        suffix = tok.decode(prompt.suffix_ids)
        assert f"What is the special magic number for {example.meta['key']}" in suffix
        assert "What is the special magic" not in tok.decode(prompt.input_ids)


@needs_data
def test_seeds_reproduce_and_cells_share_their_needles(tok, articles):
    def ids(seed: int, tokens: int = 1024, depth: float = 30) -> list[list[int]]:
        task = Niah(context_tokens=tokens, depth=depth, n=3, seed=seed, haystack_dir=articles)
        return [task.render(ex, tok).input_ids for ex in task.examples()]

    def needles(seed: int, tokens: int, depth: float) -> list[str]:
        task = Niah(context_tokens=tokens, depth=depth, n=3, seed=seed, haystack_dir=articles)
        return [NEEDLE.search(task.fitted(ex, tok)[0].body).group() for ex in task.examples()]

    def openings(tokens: int, depth: float) -> list[str]:
        task = Niah(context_tokens=tokens, depth=depth, n=3, haystack_dir=articles)
        return [task.fitted(ex, tok)[0].body[:80] for ex in task.examples()]

    assert ids(0) == ids(0)
    assert ids(0) != ids(1)
    assert len(set(needles(0, 1024, 30))) == 3  # examples differ
    assert needles(0, 1024, 30) == needles(0, 2048, 90)  # every cell of the grid asks the same
    assert needles(0, 1024, 30) != needles(1, 1024, 30)
    assert len(set(openings(1024, 30))) == 3  # each example its own stretch of the haystack ...
    assert openings(1024, 30) == openings(2048, 30)  # ... the same at every length


def test_insertion_point_by_hand():
    parts = ["a b c.", "d.", "e f g h.", "i j."]  # 3, 1, 4, 2 words: boundaries after 0, 3, 4, 8, 10 words
    words = lambda text: len(text.split())  # noqa: E731
    assert [insertion_point(parts, depth, words) for depth in (0, 10, 20, 35, 40, 60, 80, 90, 100)] == [
        0,  # 0 words
        0,  # 1: 0 is nearer than 3
        1,  # 2: 3 is nearer than 0
        1,  # 3.5: a tie between 3 and 4 goes to the earlier
        2,  # 4
        2,  # 6: a tie between 4 and 8
        3,  # 8
        3,  # 9: a tie between 8 and 10
        4,  # 10
    ]


@pytest.mark.parametrize(
    "prediction, score",
    [
        ("4852913", 1.0),
        (": 4852913.", 1.0),
        ("is 4852913, as the text says", 1.0),
        ("48529130", 0.0),  # a longer number
        ("485291", 0.0),  # a shorter one
        ("1234567, no, 4852913", 0.0),  # the first number answers
        ("4,852,913", 0.0),
        ("no number here", 0.0),
        ("", 0.0),
    ],
)
def test_exact_match_by_hand(prediction, score):
    assert exact_match(prediction, "4852913") == score


@pytest.mark.parametrize("depth", [-1, 100.5, 250])
def test_depth_outside_percent_is_refused(depth):
    with pytest.raises(TaskError, match=rf"task.depth={depth} must be a percent in \[0, 100\]"):
        Niah(depth=depth, haystack_dir=".")


def test_missing_or_empty_haystack_is_refused(tmp_path):
    with pytest.raises(TaskError, match="is not a folder"):
        Niah(haystack_dir=str(tmp_path / "nope")).validate()
    (tmp_path / "empty.txt").write_text("", encoding="utf-8")
    with pytest.raises(TaskError, match="holds no non-empty .txt file"):
        Niah(haystack_dir=str(tmp_path)).validate()


def test_length_without_room_for_a_prompt_is_refused():
    with pytest.raises(TaskError, match="task.context_tokens=16 leaves no room"):
        Niah(context_tokens=16, max_new_tokens=16)


@needs_data
def test_haystack_too_small_for_the_length_is_refused(tok, tmp_path):
    (tmp_path / "short.txt").write_text("One sentence. Two sentences. Three.", encoding="utf-8")
    task = Niah(context_tokens=1024, haystack_dir=str(tmp_path), n=1)
    with pytest.raises(TaskError, match="the haystack is too small for this length"):
        task.render(task.examples()[0], tok)
