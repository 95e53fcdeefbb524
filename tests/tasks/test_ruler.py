"""RULER's generators checked against RULER's task definitions, read off the generated text itself: the needles sit
at their depths and answer the question, chains resolve, word counts are RULER's, lengths are within the asked
length in SmolLM2's tokenizer (and within 5 % below); the metrics by hand."""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path

import pytest
from conftest import SHARED_DATA

from kvbench.metrics.ruler import clean_prediction, string_match_all, string_match_part
from kvbench.models import load_tokenizer
from kvbench.tasks.base import TaskError
from kvbench.tasks.ruler import haystacks, qa
from kvbench.tasks.ruler.task import Ruler

XSUM = SHARED_DATA / "xsum" / "test.jsonl"
needs_data = pytest.mark.skipif(not XSUM.is_file(), reason=f"sample data not found at {XSUM}")
NIAH = [f"niah_single_{i}" for i in (1, 2, 3)] + [f"niah_multikey_{i}" for i in (1, 2, 3)]
NIAH += ["niah_multivalue", "niah_multiquery"]
# RULER's tokens to generate per subtask (its synthetic config), independent of kvbench's table
ANSWER_TOKENS = {**{name: 128 for name in NIAH}, "vt": 30, "cwe": 120, "fwe": 50, "qa_1": 32, "qa_2": 32}
NEEDLE = re.compile(r"One of the special magic (\w+) for (\S+) is: (\S+)\.")


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(source="embedded", embedded="smollm2")[0]


def articles(n: int) -> list[str]:
    with XSUM.open(encoding="utf-8") as lines:
        return [json.loads(line)["document"] for _, line in zip(range(n), lines)]


@pytest.fixture(scope="module")
def essays(tmp_path_factory) -> str:
    """A haystack folder of news articles (the shared samples), written as text files."""
    folder = tmp_path_factory.mktemp("essays")
    for i, text in enumerate(articles(60)):
        (folder / f"{i:02d}.txt").write_text(text, encoding="utf-8")
    return str(folder)


@pytest.fixture(scope="module")
def squad(tmp_path_factory) -> str:
    """SQuAD v2 rows in the hub's columns: articles' paragraphs, one answerable question each and one not."""
    rows = []
    for i, text in enumerate(articles(40)):
        paragraph, title = text[:700], f"article {i % 8}"
        answer = paragraph.split()[3]
        rows.append(
            dict(
                id=f"q{i}",
                title=title,
                context=paragraph,
                question=f"Which word is fourth in {i}?",
                answers={"text": [answer, answer.upper()], "answer_start": [0, 0]},
            )
        )
        rows.append(
            dict(
                id=f"u{i}",
                title=title,
                context=paragraph,
                question="Unanswerable?",
                answers={"text": [], "answer_start": []},
            )
        )
    path = tmp_path_factory.mktemp("squad") / "dev.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows), encoding="utf-8")
    return str(path)


@pytest.fixture(scope="module")
def hotpot(tmp_path_factory) -> str:
    """HotpotQA distractor rows in the hub's columns: ten titled paragraphs each."""
    texts = articles(60)
    rows = []
    for i in range(6):
        titles = [f"title {i}-{k}" for k in range(10)]
        sentences = [[s + " " for s in texts[i * 10 + k][:300].split(". ")] for k in range(10)]
        rows.append(
            dict(
                id=f"h{i}",
                question=f"What is in {titles[0]}?",
                answer=f"answer{i}",
                type="bridge",
                level="easy",
                context={"title": titles, "sentences": sentences},
            )
        )
    path = tmp_path_factory.mktemp("hotpot") / "dev.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows), encoding="utf-8")
    return str(path)


def make(subset: str, tokens: int, essays: str | None = None, **options) -> Ruler:
    return Ruler(subset=subset, context_tokens=tokens, n=options.pop("n", 2), haystack_dir=essays, **options)


def own_length(tok, sample, answer_tokens: int) -> int:
    """The prompt as a user turn of SmolLM2's chat template, then the answer prefix, plus the answer's tokens."""
    text = tok.apply_chat_template(
        [{"role": "user", "content": sample.context + sample.question}], tokenize=False, add_generation_prompt=True
    )
    return len(tok(text + sample.answer_prefix.lstrip(), add_special_tokens=False)["input_ids"]) + answer_tokens


# ---------------------------------------------------------------- metrics, by hand


def test_string_match_all_is_the_share_of_references_found_in_any_case():
    refs = ["Apple", "banana", "7 cherries"]
    assert string_match_all("apple, BANANA and 7 Cherries", refs) == 100.0
    assert string_match_all("I found an APPLE and a banana.", refs) == pytest.approx(200 / 3)
    assert string_match_all("a pear", refs) == 0.0
    assert string_match_all("7 cherrie", ["7 cherries"]) == 0.0  # a substring of the reference is not enough


def test_string_match_part_is_whether_any_reference_is_found():
    refs = ["Paris", "the city of Paris", "Île-de-France"]
    assert string_match_part("PARIS, of course", refs) == 100.0
    assert string_match_part("île-de-france", refs) == 100.0
    assert string_match_part("Lyon", refs) == 0.0


def test_predictions_are_cleaned_as_ruler_cleans_them():
    assert clean_prediction("  \x00 1234\t567 \n") == "1234\n567"


# ---------------------------------------------------------------- lengths


@needs_data
@pytest.mark.parametrize("subset", [*NIAH, "vt", "cwe", "fwe"])
@pytest.mark.parametrize("tokens", [1024, 2048])
def test_an_example_fills_the_asked_length_in_the_models_tokens(tok, essays, subset, tokens):
    task = make(subset, tokens, essays)
    for example in task.examples():
        sample, prompt = task.fitted(example, tok)
        total = own_length(tok, sample, ANSWER_TOKENS[subset])
        assert 0.95 * tokens <= total <= tokens
        assert len(prompt.input_ids) + len(prompt.suffix_ids) + ANSWER_TOKENS[subset] == total


@needs_data
@pytest.mark.parametrize("subset, path", [("qa_1", "squad"), ("qa_2", "hotpot")])
def test_qa_fills_the_length_with_distractors_around_its_own_documents(tok, request, subset, path):
    task = make(subset, 2048, qa_path=request.getfixturevalue(path), n=3)
    rows = [json.loads(line) for line in Path(task.qa_path).read_text().splitlines()]
    for example in task.examples():
        sample, _ = task.fitted(example, tok)
        assert 0.95 * 2048 <= own_length(tok, sample, 32) <= 2048
        asked = re.search(r"Question: (.*)$", sample.question).group(1)
        row = next(r for r in rows if r["question"] == asked)
        if subset == "qa_1":
            assert row["answers"]["text"] and example.references == row["answers"]["text"]
            assert row["context"] in sample.body  # the paragraph that answers it
        else:
            assert example.references == [row["answer"]]
            for title, lines in zip(row["context"]["title"], row["context"]["sentences"]):
                assert f"{title}\n{''.join(lines)}" in sample.body  # all ten of its paragraphs
        numbers = [int(n) for n in re.findall(r"^Document (\d+):$", sample.body, re.M)]
        assert numbers == list(range(1, len(numbers) + 1)) and len(numbers) > 10


def test_a_length_too_short_for_the_prompt_is_refused(tok):
    task = make("vt", 300)
    with pytest.raises(TaskError, match="raise task.context_tokens"):
        task.render(task.examples()[0], tok)


# ---------------------------------------------------------------- what is hidden, and where


@needs_data
@pytest.mark.parametrize("subset", NIAH)
def test_needles_sit_at_their_depths_and_answer_the_question(tok, essays, subset):
    task = make(subset, 2048, essays, n=3)
    for example in task.examples():
        sample, _ = task.fitted(example, tok)
        body = sample.body
        # The haystack's units, needles between them: lines (noise copies, distractor needles), an essay's sentences.
        units = body.split("\n") if "\n" in body else re.split(r"(?<=[.!?])\s+", body)
        hidden = [next(i for i, u in enumerate(units) if needle in u) for needle in sample.needles]
        haystack = len(units) - len(sample.needles)
        for needle, at in zip(sample.needles, hidden):
            before = sum(1 for i in range(at) if i not in hidden)
            depth = sample.depths[sorted(hidden).index(at)]
            assert abs(before / haystack - depth / 100) <= 1 / haystack, (needle, before, haystack, depth)
        # The values of the keys the question names, read from the text, are the references.
        found: dict[str, list[str]] = {}
        for _, key, value in NEEDLE.findall(body):
            found.setdefault(key, []).append(value)
        asked = re.search(r"for (.*) mentioned in the provided text\?", sample.question).group(1)
        keys = re.split(r", and |, ", asked)
        assert sorted(v for k in keys for v in found[k]) == sorted(example.references)
        assert all(body.count(value) == 1 for value in example.references)


@pytest.mark.parametrize("question_aware", [False, True])
def test_variable_chains_resolve_to_the_answer(tok, question_aware):
    task = make("vt", 2048, n=3, question_aware=question_aware)
    for example in task.examples():
        sample, _ = task.fitted(example, tok)
        value = re.search(r"assigned the value (\d+)", sample.question).group(1)
        holds: dict[str, str] = {}
        for name, source in re.findall(r"VAR (\w+) = (VAR \w+|\d+)", sample.body):
            holds[name] = holds[source[4:]] if source.startswith("VAR ") else source  # read in order
        assert sorted(n for n, v in holds.items() if v == value) == sorted(example.references)
        assert len(example.references) == 5


@needs_data
@pytest.mark.parametrize("tokens, common, rare", [(2048, 6, 1), (4096, 30, 3)])  # RULER's below / from 4096
def test_common_words_are_repeated_as_ruler_says(tok, tokens, common, rare):
    task = make("cwe", tokens, n=1)
    sample, _ = task.fitted(task.examples()[0], tok)
    items = re.findall(r"(\d+)\. (.+?)(?= \d+\. |$)", sample.body)
    assert [int(i) for i, _ in items] == list(range(1, len(items) + 1))
    counts = Counter(word for _, word in items)
    assert {counts[w] for w in sample.references} == {common} and len(sample.references) == 10
    assert {c for w, c in counts.items() if w not in sample.references} == {rare}


def test_frequent_words_follow_zipf_with_the_noise_first(tok):
    task = make("fwe", 2048, n=2)
    for example in task.examples():
        sample, _ = task.fitted(example, tok)
        ranked = Counter(sample.body.split()).most_common()
        assert ranked[0][0] == "..."
        assert [w for w, _ in ranked[1:4]] == example.references
        counts = [c for _, c in ranked]
        assert counts[3] > counts[4]  # the answer is strictly the top three
        for k in (2, 3, 4):  # count of rank k ~ count of rank 1 / k^2 (alpha = 2)
            assert abs(counts[k - 1] - counts[0] / k**2) <= 1 + counts[0] / k**2 * 0.02


# ---------------------------------------------------------------- seeds, the split


@needs_data
@pytest.mark.parametrize("subset", ["niah_multikey_3", "niah_multiquery", "vt", "cwe", "fwe"])
def test_a_seed_reproduces_its_examples_exactly(tok, essays, subset):
    first, again, other = (make(subset, 1024, essays, seed=seed) for seed in (0, 0, 1))
    ids = [first.render(ex, tok) for ex in first.examples()]
    assert [again.render(ex, tok) for ex in again.examples()] == ids
    assert [ex.references for ex in again.examples()] == [ex.references for ex in first.examples()]
    assert [other.render(ex, tok) for ex in other.examples()] != ids


@pytest.mark.parametrize("chat_template", [True, False])
def test_the_question_is_fed_after_the_compressed_context_unless_question_aware(tok, chat_template):
    apart = make("niah_single_1", 1024, chat_template=chat_template)
    together = make("niah_single_1", 1024, chat_template=chat_template, question_aware=True)
    for ex_apart, ex_together in zip(apart.examples(), together.examples()):
        sample, prompt = apart.fitted(ex_apart, tok)
        suffix, context = tok.decode(prompt.suffix_ids), tok.decode(prompt.input_ids)
        assert suffix.startswith(sample.question) and suffix.endswith(sample.answer_prefix.strip())
        assert sample.question not in context and ex_apart.references[0] in context
        joined = together.render(ex_together, tok)
        assert joined.suffix_ids == [] and joined.input_ids == prompt.input_ids + prompt.suffix_ids
        assert ex_apart.meta["question_aware"] is False and ex_together.meta["question_aware"] is True


@needs_data
def test_asked_each_the_multiquery_keys_are_questions_of_one_context(tok, essays):
    together, each = (make("niah_multiquery", 1024, essays, ask=ask) for ask in ("together", "each"))
    for ex_together, ex_each in zip(together.examples(), each.examples()):
        sample, prompt = each.fitted(ex_each, tok)
        assert each.protocol.name == "shared_context" and together.protocol.name == "generate"
        needles = dict((key, value) for _, key, value in NEEDLE.findall(tok.decode(prompt.input_ids)))
        assert len(ex_each.questions) == 4 and len(prompt.questions) == 4
        assert sorted(r for q in ex_each.questions for r in q.references) == sorted(ex_together.references)
        for question, ids in zip(ex_each.questions, prompt.questions):
            key = re.search(r"for (\S+) mentioned", question.text).group(1)
            assert question.references == [needles[key]]  # the key's own needle answers it
            whole = tok.apply_chat_template(
                [{"role": "user", "content": sample.context + question.text}],
                tokenize=False,
                add_generation_prompt=True,
            )
            prefix = f"The special magic number for {key} mentioned in the provided text is"
            assert prompt.input_ids + ids == tok(whole + prefix, add_special_tokens=False)["input_ids"]
        longest = len(prompt.input_ids) + max(len(q) for q in prompt.questions) + 128
        assert 0.95 * 1024 <= longest <= 1024


def test_asking_each_needs_several_keys_and_a_context_compressed_alone():
    with pytest.raises(TaskError, match="niah_single_1 asks one"):
        Ruler(subset="niah_single_1", ask="each")
    with pytest.raises(TaskError, match="use question_aware=false"):
        Ruler(subset="niah_multiquery", ask="each", question_aware=True)
    with pytest.raises(TaskError, match="choose together or each"):
        Ruler(subset="niah_multiquery", ask="all")


# ---------------------------------------------------------------- refusals


def test_unknown_subsets_and_missing_haystacks_are_refused(tmp_path):
    with pytest.raises(TaskError, match="unknown RULER subset 'niah_single_9'; choose one of"):
        Ruler(subset="niah_single_9")
    with pytest.raises(TaskError, match="is not a folder"):
        Ruler(subset="niah_single_2", haystack_dir=str(tmp_path / "nope")).validate()
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(TaskError, match="holds no non-empty .txt file"):
        Ruler(subset="niah_single_2", haystack_dir=str(tmp_path)).validate()
    Ruler(subset="niah_single_1").validate()  # the repeated noise needs nothing


def test_offline_the_hub_sources_are_refused_with_the_fix(monkeypatch):
    from kvbench.tasks import datasets

    monkeypatch.setattr(datasets, "_hub_offline", lambda: False)
    monkeypatch.setattr(datasets, "_hub_reachable", lambda: False)
    with pytest.raises(TaskError, match="set task.haystack_dir=DIR"):
        Ruler(subset="niah_multivalue").validate()
    for subset, repo in [("qa_1", "rajpurkar/squad_v2"), ("qa_2", "hotpotqa/hotpot_qa")]:
        with pytest.raises(TaskError, match=f"task.subset={subset} reads {repo}.*set task.qa_path=FILE"):
            Ruler(subset=subset).validate()
    assert haystacks.ESSAY_REPO and qa.HUB  # the hub's names the messages give


def test_a_short_haystack_is_refused_rather_than_a_short_example(tok, tmp_path):
    (tmp_path / "a.txt").write_text("Only a few words here. " * 20)
    task = make("niah_single_2", 2048, str(tmp_path), n=1)
    with pytest.raises(TaskError, match="more than 5% below the asked 2048"):
        task.render(task.examples()[0], tok)
