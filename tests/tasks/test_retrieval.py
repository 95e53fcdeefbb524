"""The retrieval task's context/question split: with ``question_aware=false`` the question is the suffix, fed after
the compressed context; the tokens are those of the whole prompt either way."""

from __future__ import annotations

import math

import pytest
from conftest import CONFIG_DIR
from hydra import compose, initialize_config_dir

from kvbench.results.writer import read_rows
from kvbench.runner.cell import run_cell
from kvbench.tasks.retrieval import RetrievalTask


@pytest.mark.parametrize("needle", ["passkey", "kv"])
@pytest.mark.parametrize("chat_template", [True, False])
def test_the_question_is_the_suffix_when_fed_apart(tiny, needle, chat_template):
    options = dict(n=3, context_tokens=600, depths=[0.0, 0.5, 1.0], needle=needle, chat_template=chat_template)
    whole, apart = RetrievalTask(**options), RetrievalTask(**options, question_aware=False)
    tok = tiny.tokenizer
    for ex_whole, ex_apart in zip(whole.examples(), apart.examples()):
        assert ex_whole.question == "" and ex_apart.question == ex_apart.meta["question"]
        assert ex_whole.prompt == ex_apart.prompt and ex_whole.references == ex_apart.references
        r_whole, r_apart = whole.render(ex_whole, tok), apart.render(ex_apart, tok)
        assert r_whole.suffix_ids == [] and r_apart.suffix_ids
        assert r_apart.input_ids + r_apart.suffix_ids == r_whole.input_ids  # the same tokens, cut in two
        assert 500 <= len(r_whole.input_ids) <= 600
        context, suffix = tok.decode(r_apart.input_ids), tok.decode(r_apart.suffix_ids)
        assert ex_apart.meta["question"] in suffix and "Answer with" not in context
        assert ex_apart.references[0] in context  # the needle stays in the compressed part


def test_a_split_cell_compresses_the_context_alone(tmp_path, monkeypatch):
    monkeypatch.setenv("KVBENCH_REFERENCES", str(tmp_path / "refs"))
    overrides = ["model=tiny-llama", "task.n=2", "task.context_tokens=128", "task.max_new_tokens=3"]
    overrides += ["task.question_aware=false", "policy=window", "budget=0.5"]
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        cfg = compose("config", overrides=overrides)
    run_cell(cfg, tmp_path / "cell", "t")
    rows = read_rows(tmp_path / "cell" / "rows.jsonl")
    task = RetrievalTask(n=2, context_tokens=128, question_aware=False)
    from kvbench.models import load_tokenizer

    tok, _ = load_tokenizer(source="tiny")
    for ex, row in zip(task.examples(), rows):
        prompt = task.render(ex, tok)
        assert row["status"] == "ok" and row["prompt_tokens"] == len(prompt.input_ids) + len(prompt.suffix_ids)
        assert row["budget_tokens"] == math.ceil(0.5 * len(prompt.input_ids))
        # Everything fed after the cut (the question, the answer) is still held.
        assert row["kept_tokens"] == row["budget_tokens"] + len(prompt.suffix_ids) + row["new_tokens"] - 1
