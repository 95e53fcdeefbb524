"""LongBench with ``task.ask=each``: rows that share a context are one example, its context compressed once and
each row's question asked of its own copy, a row per question scored against that row's answers.

The rows are a small file in LongBench's field names: two contexts, interleaved in the file, asked three and two
questions; prompts are rendered with tiny-llama's tokenizer (its chat template) and checked against the
tokenizer's own rendering of each row's whole prompt.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from conftest import CONFIG_DIR, alone_text, task_from_config
from hydra import compose, initialize_config_dir

from kvbench.results.writer import read_rows
from kvbench.runner.cell import run_cell
from kvbench.tasks.base import Task, TaskError
from kvbench.tasks.longbench import SUBSETS
from kvbench.tasks.protocol import SharedContextPrompt

SUBSET = "multifieldqa_en"  # QA F1, chat template, no first-line cut
ISLAND = "The lighthouse on Karo Island was built in 1887 by the engineer Mara Lind, who also drew its lamp. " * 4
FARM = "Old Tom keeps forty goats and three dogs on a farm north of the river, and sells cheese on Fridays. " * 4
ROWS = [
    {"_id": "a1", "context": ISLAND, "input": "Who built the lighthouse?", "answers": ["Mara Lind"]},
    {"_id": "b1", "context": FARM, "input": "How many goats does Tom keep?", "answers": ["forty", "40"]},
    {"_id": "a2", "context": ISLAND, "input": "When was it built?", "answers": ["1887"]},
    {"_id": "b2", "context": FARM, "input": "When does he sell cheese at the market in town?", "answers": ["Fridays"]},
    {"_id": "a3", "context": ISLAND, "input": "Where is the lighthouse?", "answers": ["Karo Island"]},
]
BY_ID = {row["_id"]: row for row in ROWS}
QUESTIONS = {"a1": ["a1", "a2", "a3"], "b1": ["b1", "b2"]}


def write_rows(folder: Path, rows: list[dict[str, Any]]) -> str:
    extra = {"length": 60, "dataset": SUBSET, "language": "en", "all_classes": None}
    text = "".join(json.dumps({**row, **extra}) + "\n" for row in rows)
    (folder / f"{SUBSET}.jsonl").write_text(text, encoding="utf-8")
    return str(folder)


@pytest.fixture
def data_dir(tmp_path: Path) -> str:
    return write_rows(tmp_path, ROWS)


def longbench(data_dir: str, ask: str = "each", **options: Any) -> Task:
    options = {"subset": SUBSET, "data_dir": data_dir, "n": None, "question_aware": False, "ask": ask, **options}
    return task_from_config("longbench", **options)


def whole_prompt(tokenizer: Any, row: dict[str, Any]) -> list[int]:
    """The row's whole prompt as the tokenizer renders one chat turn of it."""
    spec = SUBSETS[SUBSET]
    user = spec.head + row["context"] + spec.tail.replace("{input}", row["input"])
    messages = [{"role": "user", "content": user}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)


def test_rows_sharing_a_context_are_one_example_asking_each_row(data_dir):
    examples = longbench(data_dir).examples()
    assert {ex.id: [q.id for q in ex.questions] for ex in examples} == QUESTIONS
    for ex in examples:
        assert ex.prompt.endswith(BY_ID[ex.id]["context"]) and ex.question == ""
        for question in ex.questions:
            row = BY_ID[question.id]
            assert question.references == row["answers"]
            assert row["context"] in ex.prompt and row["input"] in question.text and row["input"] not in ex.prompt
    assert [ex.id for ex in longbench(data_dir, ask="together").examples()] == [row["_id"] for row in ROWS]
    # task.n counts contexts: one context, with every question asked of it
    (one,) = longbench(data_dir, n=1).examples()
    assert [q.id for q in one.questions] == QUESTIONS[one.id]


def test_each_question_is_fed_the_tokens_its_row_alone_is_fed(data_dir, tiny):
    tokenizer = tiny.tokenizer
    alone = longbench(data_dir, ask="together")
    rows = {ex.id: alone.render(ex, tokenizer) for ex in alone.examples()}
    each = longbench(data_dir)
    for ex in each.examples():
        prompt = each.render(ex, tokenizer)
        assert isinstance(prompt, SharedContextPrompt) and not prompt.truncated
        for question, ids in zip(ex.questions, prompt.questions, strict=True):
            row = rows[question.id]
            assert (
                prompt.input_ids + ids == row.input_ids + row.suffix_ids == whole_prompt(tokenizer, BY_ID[question.id])
            )
            assert prompt.input_ids == row.input_ids and ids == row.suffix_ids  # the same split: the question apart
            assert BY_ID[question.id]["input"] in tokenizer.decode(ids)


def test_a_long_context_is_cut_once_leaving_room_for_its_longest_question(data_dir, tiny):
    tokenizer = tiny.tokenizer
    farm = longbench(data_dir).examples()[1]
    wholes = {q.id: whole_prompt(tokenizer, BY_ID[q.id]) for q in farm.questions}
    shortest = min(len(ids) for ids in wholes.values())
    limit = shortest - 30  # every prompt of this context is cut
    alone = longbench(data_dir, ask="together", max_prompt_tokens=limit)
    cut_alone = {ex.id: alone.render(ex, tokenizer) for ex in alone.examples()}
    prompt = longbench(data_dir, max_prompt_tokens=limit).render(farm, tokenizer)
    assert isinstance(prompt, SharedContextPrompt) and prompt.truncated
    longest = max(farm.questions, key=lambda q: len(wholes[q.id])).id
    for question, ids in zip(farm.questions, prompt.questions, strict=True):
        assert len(prompt.input_ids) + len(ids) <= limit
        assert prompt.input_ids[: limit // 2] == wholes[question.id][: limit // 2]  # LongBench keeps the first half
        assert BY_ID[question.id]["input"] in tokenizer.decode(ids)
        if question.id == longest:  # the longest question is fed exactly what its row's cut prompt is
            row = cut_alone[question.id]
            assert (
                prompt.input_ids + ids == row.input_ids + row.suffix_ids
                and len(row.input_ids + row.suffix_ids) == limit
            )
    assert len(wholes["b2"]) > len(wholes["b1"])  # the fixture's second question is the longer one
    with pytest.raises(TaskError, match="task.max_prompt_tokens=20 leaves no room for the context beside its longest"):
        longbench(data_dir, max_prompt_tokens=20).render(farm, tokenizer)


def test_asking_each_question_needs_the_questions_fed_after_compression():
    with pytest.raises(TaskError, match="task.ask=each compresses each context once.*add task.question_aware=false"):
        task_from_config("longbench", subset=SUBSET, ask="each")
    with pytest.raises(TaskError, match="task.ask='both': choose together"):
        task_from_config("longbench", subset=SUBSET, ask="both", question_aware=False)


def test_a_cell_asking_each_writes_a_row_per_question_from_one_prefill_per_context(
    tmp_path, tiny, forwards, monkeypatch
):
    monkeypatch.setenv("KVBENCH_REFERENCES", "refs")
    task = longbench(write_rows(tmp_path, ROWS))
    prompts = {ex.id: task.render(ex, tiny.tokenizer) for ex in task.examples()}
    predicted = {
        q: alone_text(tiny, p.input_ids, ids)
        for ex, p in prompts.items()
        for q, ids in zip(QUESTIONS[ex], p.questions, strict=True)  # type: ignore[attr-defined]
    }
    # A context's questions get different answers around what a run of its own predicts (this random model predicts
    # the same for every question of a context), so each row's score says whose answers it was scored against: its
    # prediction exactly (F1 1), no word of it (0), or its n words and two more (F1 = 2n / (2n + 2)).
    words = {q: len(text.split()) for q, text in predicted.items()}
    answers = {q: [predicted[q], "zebra", predicted[q] + " zebra quagga"][int(q[1]) - 1] for q in predicted}
    expected = {q: [1.0, 0.0, words[q] / (words[q] + 1)][int(q[1]) - 1] for q in predicted}
    assert all(words.values()), predicted
    data_dir = write_rows(tmp_path, [{**row, "answers": [answers[row["_id"]]]} for row in ROWS])
    forwards.clear()
    overrides = ["model=tiny-llama", "policy=window", "budget=0.5", "max_new_tokens=4", "task=longbench"]
    overrides += [f"task.{k}={v}" for k, v in [("subset", SUBSET), ("data_dir", data_dir), ("n", "null")]]
    overrides += ["task.ask=each", "task.question_aware=false", "task.fidelity=false"]
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        run_cell(compose("config", overrides=overrides), tmp_path / "cell", "t")
    rows = read_rows(tmp_path / "cell" / "rows.jsonl")
    assert sorted(r["example_id"] for r in rows) == sorted(f"{ex}/{q}" for ex, qs in QUESTIONS.items() for q in qs)
    for prompt in prompts.values():
        assert forwards.count(len(prompt.input_ids)) == 1, forwards  # each context prefilled once
    for row in rows:
        example, question = row["example_id"].split("/")
        assert row["status"] == "ok" and row["references"] == [answers[question]]
        assert row["prediction"] == predicted[question] and row["score"] == pytest.approx(expected[question])
        assert row["prefill_shared"] == (question != example)  # the first question prefilled the context
