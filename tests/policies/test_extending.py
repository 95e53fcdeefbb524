"""docs/extending.md's worked example, run as written: the score module, the policy config, the sweep, the report.

The code is read from the document, so the guide cannot drift from what works. The score is checked on a hand
state first; then the sweep runs through the command-line entry point in this process (``kvbench.run.main``,
Hydra's basic launcher), so the score registered here is the one the cells build.
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
import torch
from conftest import REPO
from hydra.core.global_hydra import GlobalHydra
from omegaconf import OmegaConf

import kvbench.run as runner
from kvbench.policies.base import Policy
from kvbench.policies.parts import SCORES
from kvbench.policies.registry import build_policy
from kvbench.policies.scopes.everything import Everything
from kvbench.policies.state import TokenState
from kvbench.report.cli import main as report_main

GUIDE = REPO / "docs" / "extending.md"
# Small enough for CPU: two examples of a 96-token prompt, three new tokens.
TINY = ["model.device=cpu", "task.n=2", "task.context_tokens=96", "task.max_new_tokens=3"]
pytestmark = pytest.mark.filterwarnings(r"ignore:(?s).*is validated against ConfigStore schema")


def worked_example() -> dict[str, str]:
    """The fenced blocks of the worked-example section, by language: python, yaml, shell."""
    text = GUIDE.read_text(encoding="utf-8")
    section = text.split("## Worked example", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```(\w+)\n(.*?)```", section, flags=re.S)
    assert [lang for lang, _ in blocks] == ["python", "yaml", "shell"], "the guide's worked example changed shape"
    return dict(blocks)


@pytest.fixture(scope="module")
def example() -> dict[str, str]:
    return worked_example()


@pytest.fixture(scope="module")
def score_class(example: dict[str, str]) -> Iterator[type]:
    """Import the guide's module (as ``kvbench/policies/scores/acc_per_norm.py`` would be imported); other
    tests list the registered scores, so the toy one is gone again afterwards."""
    module = types.ModuleType("acc_per_norm_from_guide")
    exec(compile(example["python"], str(GUIDE), "exec"), module.__dict__)
    sys.modules[module.__name__] = module
    yield SCORES.get("acc_per_norm")
    SCORES.unregister("acc_per_norm")
    del sys.modules[module.__name__]


def test_the_score_registers_and_ranks_by_attention_per_key_norm(score_class: type) -> None:
    # acc [1, 2, 3, 4] over key norms [1, 4, 1, 2] -> [1, 0.5, 3, 2]: budget 2 keeps entries 2 and 3, budget 3 also 0.
    keys = torch.tensor([[[1.0, 0.0], [0.0, 4.0], [0.6, 0.8], [2.0, 0.0]]])
    policy = Policy("acc_per_norm", score_class(), Everything())
    features = policy.features(keys, torch.zeros_like(keys))
    state = TokenState(positions=torch.arange(4).view(1, 4), stats={"acc": torch.tensor([[1.0, 2, 3, 4]]), **features})
    assert policy.partition(state, 2)[0].tolist() == [[2, 3]]
    assert policy.partition(state, 3)[0].tolist() == [[0, 2, 3]]
    assert policy.needs == {"acc"} and policy.feature_names == {"key_l2"}


def test_the_config_builds_the_policy(example: dict[str, str], score_class: type) -> None:
    policy = build_policy(OmegaConf.to_container(OmegaConf.create(example["yaml"])))
    assert isinstance(policy.score, score_class) and policy.name == "acc_per_norm"


def test_sweep_and_report(
    example: dict[str, str], score_class: type, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The guide's sweep (four cells) in this process, then its report: the new policy has rows in the table."""
    calls = []
    original = score_class.__call__

    def counted(self, state):
        calls.append(state.phase)
        return original(self, state)

    monkeypatch.setattr(score_class, "__call__", counted)
    configs = tmp_path / "configs" / "policy"
    configs.mkdir(parents=True)
    (configs / "acc_per_norm.yaml").write_text(example["yaml"])
    run_line, report_line = example["shell"].strip().splitlines()
    run_args = shlex.split(run_line)
    assert run_args[0] == "kvbench-run"
    argv = [
        *run_args,
        *TINY,
        f"results_dir={tmp_path / 'results'}",
        f"hydra.searchpath=[file://{tmp_path / 'configs'}]",
        "hydra/job_logging=none",
        "hydra/hydra_logging=none",
    ]
    monkeypatch.setattr(sys, "argv", argv)
    GlobalHydra.instance().clear()
    try:
        runner.main()
    except SystemExit as done:
        assert done.code in (0, None)
    finally:
        GlobalHydra.instance().clear()
    assert "prefill" in calls, "the cells never called the guide's score"

    report_args = shlex.split(report_line)
    assert report_args[:2] == ["kvbench-report", "results/extending"]
    sweep = tmp_path / "results" / "extending"
    assert report_main([str(sweep), "--bootstrap", "20"]) == 0
    table = pd.read_csv(sweep / "report" / "quality_table.csv")
    assert sorted(table["policy"]) == ["acc_per_norm", "window"]
    assert set(table.columns) >= {"25%", "50%"}
    assert table[["25%", "50%"]].notna().all().all()
    assert "| acc_per_norm |" in (sweep / "report" / "report.md").read_text()
