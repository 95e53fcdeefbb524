"""Tasks say how their examples run (``Task.protocol``); the runner follows the declaration, never the task's type.

Toy tasks registered here stand in for new ones: a teacher-forced task that is not the perplexity task is scored
as one, and what a runner cannot run (a protocol it lacks, a batch of a task whose examples run alone, a prompt the
task refuses, a prompt of the wrong shape) is refused before any model loads.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from conftest import CONFIG_DIR, alone_text
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from kvbench.config import ConfigError
from kvbench.results.writer import CellResults, read_rows
from kvbench.runner import model_cache
from kvbench.runner.cell import run_cell
from kvbench.tasks.base import Example, Question, RenderedPrompt, Task, TaskError
from kvbench.tasks.protocol import LIKELIHOOD, SHARED_CONTEXT, ScoredText, SharedContextPrompt
from kvbench.tasks.registry import TASKS

TEXT = list(range(5, 45))  # 40 token ids: a prefix of 24 and 16 to score


@dataclass
class Toy(Task):
    """Two examples of fixed token ids; subclasses pick the protocol and the prompt."""

    n: int | None = None

    def examples(self) -> list[Example]:
        return [Example(id=f"t{i}", prompt="") for i in range(2)]

    def render(self, example: Example, tokenizer: Any) -> RenderedPrompt:
        return RenderedPrompt(input_ids=TEXT)

    def score(self, prediction: str, example: Example) -> dict[str, float]:
        return {"score": 1.0}


class ToyLikelihood(Toy):
    protocol = LIKELIHOOD
    primary_metric = "nll"

    def render(self, example: Example, tokenizer: Any) -> ScoredText:
        return ScoredText(input_ids=TEXT[:24], targets=TEXT[24:])

    def score_nll(self, nll: list[float], nll_full: list[float]) -> dict[str, float]:
        return {"nll": sum(nll) / len(nll), "nll_full": sum(nll_full) / len(nll_full)}


QUESTIONS = {"a": [50, 51], "b": [52, 53, 54], "c": [55]}


class ToySharedContext(Toy):
    """Two contexts (the second a shorter text), three questions each; a question scores 1 when its references
    reached it."""

    protocol = SHARED_CONTEXT

    def examples(self) -> list[Example]:
        asked = [Question(q, "?", [f"ref-{q}"]) for q in QUESTIONS]
        return [Example(id=f"t{i}", prompt="", questions=asked, meta={"i": i}) for i in range(2)]

    def render(self, example: Example, tokenizer: Any) -> SharedContextPrompt:
        return SharedContextPrompt(input_ids=TEXT[example.meta["i"] :], questions=list(QUESTIONS.values()))

    def score(self, prediction: str, example: Example) -> dict[str, float]:
        return {"score": float(example.references == [f"ref-{example.meta['question_id']}"])}


class ToyRefusing(Toy):
    def render(self, example: Example, tokenizer: Any) -> RenderedPrompt:
        raise TaskError("this example needs a longer context; raise task.context_tokens")


class ToyWrongShape(ToyLikelihood):
    def render(self, example: Example, tokenizer: Any) -> RenderedPrompt:  # type: ignore[override]
        return RenderedPrompt(input_ids=TEXT)


TOYS = {
    "toy_likelihood": ToyLikelihood,
    "toy_shared": ToySharedContext,
    "toy_refusing": ToyRefusing,
    "toy_shape": ToyWrongShape,
}


@pytest.fixture(autouse=True)
def toys(monkeypatch, tmp_path) -> Iterator[None]:
    monkeypatch.setenv("KVBENCH_REFERENCES", str(tmp_path / "refs"))
    for name, cls in TOYS.items():
        monkeypatch.setattr(cls, "name", name)
        TASKS.add(name, cls, f"{__name__}.{cls.__qualname__}")
    yield  # the conftest forgets the names a test registers


def cell_config(task: str, *overrides: str):
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        cfg = compose("config", overrides=["model=tiny-llama", "policy=window", "budget=0.5", *overrides])
    OmegaConf.set_struct(cfg, False)
    cfg.task = {"name": task, "n": 2, "fidelity": False}
    return cfg


@pytest.fixture
def no_model(monkeypatch):
    monkeypatch.setattr(model_cache, "get_model", lambda *_: pytest.fail("the model loaded before the refusal"))


def test_a_teacher_forced_task_is_scored_by_its_protocol_not_its_type(tmp_path, tiny):
    run_cell(cell_config("toy_likelihood", "policy=full"), tmp_path / "cell", "t")
    rows = read_rows(tmp_path / "cell" / "rows.jsonl")
    assert [r["status"] for r in rows] == ["ok", "ok"], rows
    with torch.no_grad():
        logprobs = tiny.model(torch.tensor([TEXT])).logits[0].double().log_softmax(-1)
    nll = -logprobs[23:-1].gather(-1, torch.tensor(TEXT[24:])[:, None]).mean().item()
    for row in rows:
        assert row["metric.nll"] == pytest.approx(nll, rel=1e-5) and row["score"] == row["metric.nll"]
        assert row["scored_tokens"] == 16 and row["prompt_tokens"] == 24 and row["prediction"] is None


@pytest.mark.usefixtures("no_model")
@pytest.mark.parametrize(
    "task, overrides, message",
    [
        ("toy_likelihood", ["batch_size=2"], "task=toy_likelihood scores each text alone (teacher forcing), so "),
        ("toy_refusing", [], "task=toy_refusing: example t0: this example needs a longer context"),
        ("toy_shape", [], "render returned a RenderedPrompt; its protocol 'likelihood' needs a ScoredText"),
    ],
)
def test_what_the_runner_cannot_run_is_refused_before_the_model_loads(tmp_path, task, overrides, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        run_cell(cell_config(task, *overrides), tmp_path / "cell", "t")
    assert not (tmp_path / "cell" / "rows.jsonl").exists()


def test_the_light_error_type_needs_no_engine():
    import subprocess
    import sys

    code = "import sys, kvbench.tasks.base as b; assert issubclass(b.TaskError, ValueError); print(sorted(sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "torch" not in out and "kvbench.engine" not in out and "kvbench.config" not in out


@pytest.mark.parametrize("batch_size", [1, 2])
def test_one_context_asked_several_questions_gives_a_row_each_from_one_prefill(tmp_path, tiny, forwards, batch_size):
    run_cell(cell_config("toy_shared", "max_new_tokens=4", f"batch_size={batch_size}"), tmp_path / "cell", "t")
    rows = read_rows(tmp_path / "cell" / "rows.jsonl")  # in the order they finished
    assert sorted(r["example_id"] for r in rows) == [f"t{i}/{q}" for i in range(2) for q in QUESTIONS]
    assert forwards.count(len(TEXT)) == 1 and forwards.count(len(TEXT) - 1) == 1, forwards  # each context once
    for row in rows:
        example, question = row["example_id"].split("/")
        context = TEXT[int(example[1:]) :]
        assert row["status"] == "ok" and row["score"] == 1.0 and row["references"] == [f"ref-{question}"]
        assert row["prediction"] == alone_text(tiny, context, QUESTIONS[question]), row["example_id"]
        assert row["prompt_tokens"] == len(context) + len(QUESTIONS[question])
        assert row["prefill_shared"] == (question != "a")
    summary = json.loads((tmp_path / "cell" / "summary.json").read_text())
    assert summary["n_ok"] == 6 and summary["n_expected"] == 6, summary


def test_a_shared_context_cell_killed_between_questions_resumes_without_losing_or_repeating_one(
    tmp_path, tiny, forwards, monkeypatch
):
    appended: list[str] = []
    append = CellResults.append

    def append_then_die(self, row):
        append(self, row)
        appended.append(row.example_id)
        if len(appended) == 2:
            raise KeyboardInterrupt  # killed after the second question of the first context

    cfg = cell_config("toy_shared", "max_new_tokens=4")
    monkeypatch.setattr(CellResults, "append", append_then_die)
    with pytest.raises(KeyboardInterrupt):
        run_cell(cfg, tmp_path / "cell", "t")
    monkeypatch.setattr(CellResults, "append", append)
    forwards.clear()
    run_cell(cfg, tmp_path / "cell", "t")
    rows = read_rows(tmp_path / "cell" / "rows.jsonl")
    assert [r["example_id"] for r in rows] == [f"t{i}/{q}" for i in range(2) for q in QUESTIONS]
    assert forwards.count(len(TEXT)) == 1 and forwards.count(len(TEXT) - 1) == 1, forwards
    assert [r["prefill_shared"] for r in rows] == [False, True, False, False, True, True]
    for row in rows:
        example, question = row["example_id"].split("/")
        assert row["prediction"] == alone_text(tiny, TEXT[int(example[1:]) :], QUESTIONS[question])
