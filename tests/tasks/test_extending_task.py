"""docs/extending.md's worked task, run as written: the task module, its config, the sweep, the report.

The code is read from the document, so the guide cannot drift from what works. The task is checked on the tiny
model's tokenizer first (its chains, the context/question split, its refusals); then the sweep runs through the
command-line entry point in this process (``kvbench.run.main``), so the task registered here is the one the cells
build.
"""

from __future__ import annotations

import re
import shlex
import sys
import types
from collections.abc import Iterator
from pathlib import Path

import pandas as pd
import pytest
import yaml
from conftest import REPO
from guide_runs import run_guide_line

from kvbench.results.writer import read_rows
from kvbench.tasks.base import TaskError
from kvbench.tasks.registry import TASKS, build_task

GUIDE = REPO / "docs" / "extending.md"
# Small enough for CPU: two examples of two filler paragraphs, three new tokens.
TINY = ["task.n=2", "task.filler=2", "task.max_new_tokens=3", "model.device=cpu"]
pytestmark = pytest.mark.filterwarnings(r"ignore:(?s).*is validated against ConfigStore schema")


def worked_task() -> dict[str, str]:
    """The fenced blocks of the worked task's section, by language: python, yaml, shell."""
    text = GUIDE.read_text(encoding="utf-8")
    section = text.split("## Worked example: a new task", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```(\w+)\n(.*?)```", section, flags=re.S)
    assert [lang for lang, _ in blocks] == ["python", "yaml", "shell"], "the guide's worked task changed shape"
    return dict(blocks)


@pytest.fixture(scope="module")
def guide() -> dict[str, str]:
    return worked_task()


@pytest.fixture(scope="module")
def task_class(guide: dict[str, str]) -> Iterator[type]:
    """Import the guide's module (as ``kvbench/tasks/variable_tracking.py`` would be imported); other tests list
    the registered tasks, so the toy one is gone again afterwards."""
    module = types.ModuleType("variable_tracking_from_guide")
    sys.modules[module.__name__] = module  # a dataclass looks its module up while it is built
    exec(compile(guide["python"], str(GUIDE), "exec"), module.__dict__)
    yield TASKS.get("variable_tracking")
    TASKS.unregister("variable_tracking")
    del sys.modules[module.__name__]


def from_guide(guide: dict[str, str], **options) -> object:
    return build_task({**yaml.safe_load(guide["yaml"]), **options})


def test_every_chain_is_in_the_text_in_order(guide, task_class):
    task = from_guide(guide, n=3, hops=3, filler=5, question_aware=True)
    assert isinstance(task, task_class)
    for ex in task.examples():
        names = ex.references
        value = re.search(r"hold the value (\d+)", ex.prompt).group(1)
        spots = [ex.prompt.index(f"VAR {names[0]} = {value}.")]
        spots += [ex.prompt.index(f"VAR {b} = VAR {a}.") for a, b in zip(names, names[1:])]
        assert spots == sorted(spots) and len(names) == 4 and ex.question == ""
        assert task.score(" and ".join(names), ex) == {"recall": 1.0}
        assert task.score(names[0], ex) == {"recall": 0.25}


def test_the_question_is_fed_after_the_context(guide, task_class, tiny):
    tok = tiny.tokenizer
    apart, whole = from_guide(guide, n=2, filler=3), from_guide(guide, n=2, filler=3, question_aware=True)
    for ex_apart, ex_whole in zip(apart.examples(), whole.examples()):
        r_apart, r_whole = apart.render(ex_apart, tok), whole.render(ex_whole, tok)
        assert r_apart.input_ids + r_apart.suffix_ids == r_whole.input_ids and r_whole.suffix_ids == []
        assert "which variables" in tok.decode(r_apart.suffix_ids)
        assert "which variables" not in tok.decode(r_apart.input_ids)


def test_its_options_are_typed_and_checked(guide, task_class):
    with pytest.raises(TaskError, match="task.bogus is unknown; the task's options are chat_template, fidelity, "):
        from_guide(guide, bogus=1)
    with pytest.raises(TaskError, match="task.hops='many' must be an integer"):
        from_guide(guide, hops="many")
    with pytest.raises(TaskError, match="task.hops=0 must be at least 1"):
        from_guide(guide, hops=0)


def test_sweep_and_report(guide, task_class, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The guide's sweep (two cells) in this process, then its report: both policies have rows, recall scored."""
    from kvbench.report.cli import main as report_main

    monkeypatch.setenv("KVBENCH_REFERENCES", str(tmp_path / "refs"))
    configs = tmp_path / "configs" / "task"
    configs.mkdir(parents=True)
    (configs / "variable_tracking.yaml").write_text(guide["yaml"])
    run_line, report_line = guide["shell"].strip().splitlines()
    run_guide_line(run_line, TINY, tmp_path, tmp_path / "configs", monkeypatch)
    sweep = tmp_path / "results" / "tracking"
    rows = [r for path in sorted(sweep.rglob("rows.jsonl")) for r in read_rows(path)]
    assert sorted({r["policy"] for r in rows}) == ["h2o", "window"] and len(rows) == 4
    for r in rows:
        assert r["status"] == "ok" and r["task"] == "variable_tracking" and r["primary_metric"] == "recall"
        assert 0.0 <= r["metric.recall"] <= 1.0 and r["prompt_tokens"] > r["budget_tokens"] > 0

    report_args = shlex.split(report_line)
    assert report_args[:2] == ["kvbench-report", "results/tracking"]
    assert report_main([str(sweep), "--bootstrap", "20"]) == 0
    table = pd.read_csv(sweep / "report" / "quality_table.csv")
    assert sorted(table["policy"]) == ["h2o", "window"] and table["50%"].notna().all()
    assert "variables recalled" in (sweep / "report" / "report.md").read_text()
