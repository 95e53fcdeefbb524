"""Tasks say how their examples run (``Task.protocol``); the runner follows the declaration, never the task's type.

Toy tasks registered here stand in for new ones: a teacher-forced task that is not the perplexity task is scored
as one, and what a runner cannot run (a protocol it lacks, a batch of a task whose examples run alone, a prompt the
task refuses, a prompt of the wrong shape) is refused before any model loads.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from conftest import CONFIG_DIR
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from kvbench.config import ConfigError
from kvbench.results.writer import read_rows
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


class ToySharedContext(Toy):
    protocol = SHARED_CONTEXT

    def examples(self) -> list[Example]:
        return [Example(id="c", prompt="", questions=[Question("a", "?"), Question("b", "?")])]

    def render(self, example: Example, tokenizer: Any) -> SharedContextPrompt:
        return SharedContextPrompt(input_ids=TEXT, questions=[[50, 51], [52, 53]])


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
        ("toy_shared", [], "task=toy_shared declares protocol 'shared_context', which this runner cannot run yet"),
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
