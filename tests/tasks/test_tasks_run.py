"""The perplexity and instruction tasks end to end, and the context/question split at run level."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import CONFIG_DIR, SHARED_DATA
from hydra import compose, initialize_config_dir

from kvbench.config import validate
from kvbench.engine.engine import Engine
from kvbench.results.schema import COLUMNS, METRIC_PREFIX
from kvbench.results.writer import read_rows
from kvbench.runner.cell import run_cell
from kvbench.runner.model_cache import get_model
from kvbench.tasks.instructions import BUILTIN_PROMPTS
from kvbench.tasks.jsonl import read_prompts
from kvbench.tasks.registry import build_task

PPL = [
    "model=tiny-llama",
    "task=perplexity",
    f"task.data_dir={SHARED_DATA / 'longbench'}",
    "task.n=2",
    "task.prefix_tokens=48",
    "task.score_tokens=24",
]


def cfg(overrides: list[str]):
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        return compose("config", overrides=overrides)


@pytest.fixture(autouse=True)
def refs(tmp_path, monkeypatch):
    path = tmp_path / "refs"
    monkeypatch.setenv("KVBENCH_REFERENCES", str(path))
    return path


def run(tmp_path, name: str, overrides: list[str]) -> list[dict]:
    run_cell(cfg(overrides), tmp_path / name, "t")
    rows = read_rows(tmp_path / name / "rows.jsonl")
    assert rows and all(r["status"] == "ok" for r in rows), rows
    return rows


# ---------------------------------------------------------------- perplexity


def test_full_cache_perplexity_is_exp_mean_nll_of_a_plain_forward(tmp_path):
    config = cfg(PPL + ["policy=full"])
    rows = run(tmp_path, "full", PPL + ["policy=full"])
    spec = validate(config)
    task = build_task(spec.task_cfg)
    lm = get_model(spec.model)
    for ex, row in zip(task.examples(), rows):
        assert ex.id == row["example_id"]
        prompt = task.render(ex, lm.tokenizer)
        ids = torch.tensor([prompt.input_ids + prompt.targets])
        with torch.no_grad():
            logprobs = lm.model(ids).logits[0].double().log_softmax(-1)
        start = len(prompt.input_ids)
        nll = -logprobs[start - 1 : -1].gather(-1, ids[0, start:, None]).mean().item()
        assert row["metric.nll"] == pytest.approx(nll, rel=1e-5)
        assert row["metric.perplexity"] == pytest.approx(math.exp(nll), rel=1e-5)
        assert row["score"] == row["metric.perplexity"] and row["primary_metric"] == "perplexity"
        assert row["metric.perplexity_full"] == row["metric.perplexity"] and row["metric.perplexity_delta"] == 0.0
        assert (row["metric.fidelity_top1"], row["metric.fidelity_kl"]) == (1.0, 0.0)
        assert row["scored_tokens"] == 24 and row["prompt_tokens"] == 48 and row["new_tokens"] == 24
        assert {k for k in row if not k.startswith(METRIC_PREFIX)} <= COLUMNS  # every column is declared


@pytest.mark.parametrize("stage", ["prefill", "decode"])
def test_compressed_perplexity_is_compared_with_the_full_cache(tmp_path, stage):
    full = run(tmp_path, "full", PPL + ["policy=full"])
    rows = run(tmp_path, "small", PPL + ["policy=window", "budget=0.25", f"stage={stage}"])
    for f, r in zip(full, rows):
        assert r["metric.perplexity_full"] == f["metric.perplexity"]  # the stored full-cache reference
        assert r["metric.perplexity"] != r["metric.perplexity_full"] and r["metric.fidelity_kl"] > 0
        assert r["metric.perplexity_delta"] == pytest.approx(r["metric.perplexity"] - r["metric.perplexity_full"])
        assert r["fidelity_reference"] == f["fidelity_reference"]
        # prefill: the 48-token prefix is cut to 12; decode: 25% of prefix + scored tokens held throughout.
        assert r["budget_tokens"] == (12 if stage == "prefill" else 18)
        assert r["kept_tokens"] == (12 + 23 if stage == "prefill" else 18)


# ---------------------------------------------------------------- instructions


def test_builtin_instruction_prompts():
    examples = read_prompts(BUILTIN_PROMPTS)
    assert len(examples) >= 30 and len({ex.id for ex in examples}) == len(examples)
    assert len({ex.meta["category"] for ex in examples}) >= 8
    assert all(len(ex.prompt.split()) >= 10 and not ex.references for ex in examples)


def test_instructions_are_scored_by_fidelity(tmp_path):
    base = ["model=tiny-llama", "task=instructions", "task.n=2", "task.max_new_tokens=6"]
    rows = run(tmp_path, "full", base + ["policy=full"])
    for r in rows:
        assert r["primary_metric"] == "fidelity_rougeL" and r["score"] == 1.0
        assert r["metric.fidelity_kl"] == 0.0 and r["new_tokens"] == r["fidelity_reference_tokens"]
    # The prompt went through the chat template.
    assert validate(cfg(base)).task_cfg["chat_template"] is True
    rows = run(tmp_path, "decode", base + ["policy=window", "budget=0.5", "stage=decode", "task.fidelity=false"])
    assert all(r["score"] == r["metric.fidelity_rougeL"] and r["metric.fidelity_kl"] > 0 for r in rows)


# ---------------------------------------------------------------- question_aware


@pytest.mark.parametrize("question_aware", [True, False])
def test_question_aware_false_compresses_only_the_context(tmp_path, monkeypatch, question_aware):
    overrides = [
        "model=tiny-llama",
        "task=xsum",
        f"task.data_dir={SHARED_DATA / 'xsum'}",
        "task.n=1",
        "task.max_prompt_tokens=300",
        "task.max_new_tokens=4",
        "task.fidelity=false",
        f"task.question_aware={str(question_aware).lower()}",
        "policy=window",
        "budget=0.5",
    ]
    seen = []
    real = Engine.steps

    def spy(engine, requests):
        seen.extend((list(r.input_ids), list(r.suffix_ids)) for r in requests)
        return real(engine, requests)

    monkeypatch.setattr(Engine, "steps", spy)
    (row,) = run(tmp_path, "cell", overrides)
    context, suffix = seen[0]
    tokenizer = get_model(validate(cfg(overrides)).model).tokenizer
    assert row["prompt_tokens"] == len(context) + len(suffix)
    if question_aware:
        assert suffix == []  # the instruction is compressed with the article
        assert row["budget_tokens"] == math.ceil(0.5 * row["prompt_tokens"])
    else:
        # The instruction (and the assistant turn's start) is fed after the article was compressed...
        assert tokenizer.decode(suffix).lstrip().startswith("Summarise the article above")
        assert "Summarise" not in tokenizer.decode(context)
        assert row["budget_tokens"] == math.ceil(0.5 * len(context))
        # ...and never evicted: everything fed after the cut is still held.
        assert row["kept_tokens"] == row["budget_tokens"] + len(suffix) + row["new_tokens"] - 1
