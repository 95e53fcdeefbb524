"""task=math: GSM8K, MATH-500 and AIME files in their own field names (written here), the last \\boxed{} answer
scored by math-verify, checked on hand-worked cases."""

from __future__ import annotations

import json

import pytest

from kvbench.tasks.base import TaskError
from kvbench.tasks.registry import build_task


def write(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return str(path)


GSM8K = [
    {"question": "Ann has 3 apples and buys 4 more. How many?", "answer": "3 + 4 = <<3+4=7>>7\n#### 7"},
    {"question": "Half of a pie, as a decimal?", "answer": "1/2 = 0.5\n#### 0.5"},
    {"question": "A thousand and one?", "answer": "#### 1,001"},
]
MATH500 = [{"problem": "What is $\\frac{1}{2}+\\frac{1}{4}$?", "answer": "\\frac{3}{4}", "unique_id": "test/x/1.json"}]
AIME = [{"ID": "2024-I-1", "Problem": "Find 2^3 + 5.", "Answer": 13}, {"problem": "Find 6*7.", "answer": "42"}]


def task(path, fmt):
    return build_task({"name": "math", "path": path, "format": fmt})


def test_each_format_reads_its_fields(tmp_path):
    gsm = task(write(tmp_path / "gsm.jsonl", GSM8K), "gsm8k").examples()
    assert [e.references for e in gsm] == [["7"], ["0.5"], ["1,001"]]
    assert gsm[0].id == "1" and gsm[0].prompt.startswith("Ann has")
    math500 = task(write(tmp_path / "m.jsonl", MATH500), "math500").examples()
    assert math500[0].references == ["\\frac{3}{4}"] and math500[0].id == "test/x/1.json"
    aime = task(write(tmp_path / "a.jsonl", AIME), "aime").examples()
    assert [(e.id, e.prompt, e.references) for e in aime] == [
        ("2024-I-1", "Find 2^3 + 5.", ["13"]),
        ("2", "Find 6*7.", ["42"]),
    ]


@pytest.mark.parametrize(
    "prediction, gold, accuracy, boxed",
    [
        ("3 + 4 = 7, so the answer is \\boxed{7}.", "7", 1.0, 1.0),
        ("Half is \\boxed{\\frac{1}{2}}", "0.5", 1.0, 1.0),  # \frac and a decimal are one number
        ("so \\boxed{1/2}", "0.5", 1.0, 1.0),
        ("\\boxed{0.5}", "\\frac{1}{2}", 1.0, 1.0),
        ("\\boxed{1001}", "1,001", 1.0, 1.0),  # GSM8K's thousands separator
        ("\\boxed{\\frac{3}{4}}", "\\frac{3}{4}", 1.0, 1.0),
        ("It is \\boxed{8}", "7", 0.0, 1.0),  # wrong
        ("The answer is 7.", "7", 0.0, 0.0),  # right number, but not boxed: the prompt asked for a box
        ("first \\boxed{3}, then corrected: \\boxed{7}", "7", 1.0, 1.0),  # the last box is the answer
        ("\\boxed{7", "7", 0.0, 0.0),  # cut off before the box closed
        ("\\boxed{\\frac{7}{1}}", "7", 1.0, 1.0),  # nested braces
    ],
)
def test_scoring_by_hand(tmp_path, prediction, gold, accuracy, boxed):
    t = task(write(tmp_path / "m.jsonl", [{"problem": "p", "answer": gold}]), "math500")
    assert t.score(prediction, t.examples()[0]) == {"accuracy": accuracy, "boxed": boxed}


def test_the_prompt_asks_for_a_box(tmp_path, smollm):
    t = task(write(tmp_path / "gsm.jsonl", GSM8K), "gsm8k")
    text = smollm.tokenizer.decode(t.render(t.examples()[0], smollm.tokenizer).input_ids)
    assert "Ann has 3 apples" in text and "\\boxed{ANSWER}" in text


@pytest.mark.parametrize(
    "records, fmt, message",
    [
        ([{"problem": "p", "answer": "1"}], "gsm8k", "m.jsonl:1: task.format=gsm8k needs fields question and answer"),
        ([{"question": "q", "answer": "no marker"}], "gsm8k", "m.jsonl:1: a GSM8K answer ends with '#### <number>'"),
        ([{"problem": "p"}], "aime", "task.format=aime needs fields problem/Problem and answer/Answer"),
    ],
)
def test_bad_lines_are_refused_by_number(tmp_path, records, fmt, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        task(write(tmp_path / "m.jsonl", records), fmt).validate()


def test_unknown_format_is_refused(tmp_path):
    with pytest.raises(TaskError, match="task.format=gsm9k is unknown; choose one of gsm8k, math500, aime"):
        task(write(tmp_path / "m.jsonl", GSM8K), "gsm9k")
