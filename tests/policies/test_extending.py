"""docs/extending.md's code, run as written: the worked score (its module, the policy config, the sweep, the
report), the KeyDiff score written against the view, and the worked statistic.

The code is read from the document, so the guide cannot drift from what works. The score is checked on a hand
state first; then the sweep runs through the command-line entry point in this process (``kvbench.run.main``,
Hydra's basic launcher), so the score registered here is the one the cells build. KeyDiff is checked against
NumPy on padded rows; the statistic, declared from the guide's block, against NumPy in both attention kernels
(a prompt chunk's, in several block sizes, and a decode step's), then through a run.
"""

from __future__ import annotations

import re
import shlex
import sys
import types
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from conftest import REPO
from engine_run import generate
from guide_runs import run_guide_line
from omegaconf import OmegaConf
from test_score_view import numpy_keydiff, padded_view

from kvbench.engine import blocked
from kvbench.engine.attention import decode_attention
from kvbench.engine.engine import DecodeSettings
from kvbench.engine.visibility import KeyAccess
from kvbench.policies.base import Score
from kvbench.policies.parts import SCORES
from kvbench.policies.policy import Policy
from kvbench.policies.registry import build_policy
from kvbench.policies.scopes.everything import All
from kvbench.policies.state import TokenState
from kvbench.policies.statistics import STATISTICS, Collecting, Summed, declare, forget
from kvbench.report.cli import main as report_main

GUIDE = REPO / "docs" / "extending.md"
# Small enough for CPU: two examples of a 96-token prompt, three new tokens.
TINY = ["model.device=cpu", "task.n=2", "task.context_tokens=96", "task.max_new_tokens=3"]
pytestmark = pytest.mark.filterwarnings(r"ignore:(?s).*is validated against ConfigStore schema")


def guide_blocks(heading: str) -> list[tuple[str, str]]:
    """The fenced blocks (language, code) of the guide's section that starts with ``heading``."""
    text = GUIDE.read_text(encoding="utf-8")
    section = text.split(f"\n## {heading}", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```(\w+)\n(.*?)```", section, flags=re.S)


def worked_example() -> dict[str, str]:
    """The fenced blocks of the worked-example section, by language: python, yaml, shell."""
    blocks = guide_blocks("Worked example: a new score")
    assert [lang for lang, _ in blocks] == ["python", "yaml", "shell"], "the guide's worked example changed shape"
    return dict(blocks)


def run_block(code: str, name: str) -> types.ModuleType:
    """The guide's block as the module ``name`` (as if it were a file of the package)."""
    module = types.ModuleType(name)
    exec(compile(code, str(GUIDE), "exec"), module.__dict__)
    return module


@pytest.fixture(scope="module")
def example() -> dict[str, str]:
    return worked_example()


@pytest.fixture(scope="module")
def score_class(example: dict[str, str]) -> Iterator[type]:
    """Import the guide's module (as ``kvbench/policies/scores/acc_per_norm.py`` would be imported); other
    tests list the registered scores, so the toy one is gone again afterwards."""
    module = run_block(example["python"], "acc_per_norm_from_guide")
    sys.modules[module.__name__] = module
    yield SCORES.get("acc_per_norm")
    SCORES.unregister("acc_per_norm")
    del sys.modules[module.__name__]


def test_the_score_registers_and_ranks_by_attention_per_key_norm(score_class: type) -> None:
    # acc [1, 2, 3, 4] over key norms [1, 4, 1, 2] -> [1, 0.5, 3, 2]: budget 2 keeps entries 2 and 3, budget 3 also 0.
    keys = torch.tensor([[[1.0, 0.0], [0.0, 4.0], [0.6, 0.8], [2.0, 0.0]]])
    policy = Policy("acc_per_norm", score_class(), All())
    features = policy.features(keys, torch.zeros_like(keys), {})
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
    run_guide_line(run_line, TINY, tmp_path, tmp_path / "configs", monkeypatch)
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


def test_the_guides_keydiff_equals_numpy_on_padded_rows() -> None:
    ((lang, code),) = guide_blocks("What a score sees")
    keydiff = run_block(code, "keydiff_from_guide").KeyDiff
    view, held = padded_view([6, 3, 5])
    scores = keydiff()(view)
    for r, keys in enumerate(held):
        np.testing.assert_allclose(scores[r, : len(keys)].double().numpy(), numpy_keydiff(keys)[0], atol=1e-5)


@pytest.fixture
def entropy() -> Iterator[str]:
    """The guide's statistic, declared for the test and forgotten afterwards (other tests list the statistics)."""
    ((lang, code),) = guide_blocks("Worked example: a new statistic")
    assert lang == "python"
    run_block(code, "entropy_from_guide")
    yield "entropy"
    forget("entropy")


def numpy_entropy(probs: np.ndarray) -> np.ndarray:
    """Per KV head and key, -p log p of the group-mean probabilities [hkv, q, n], summed over the queries."""
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(probs > 0, -probs * np.log(probs), 0.0).sum(axis=1)


@pytest.mark.parametrize("block", [1 << 22, 400, 7])
def test_the_guides_statistic_in_a_prompt_chunk_equals_numpy(entropy, block, monkeypatch) -> None:
    monkeypatch.setattr(blocked, "STATS_BLOCK_ELEMENTS", block)
    hq, hkv, q, d = 4, 2, 19, 8
    rng = np.random.default_rng(block)
    Q, K, V = (rng.normal(size=s).astype(np.float32) * 1.5 for s in ((hq, q, d), (hkv, q, d), (hkv, q, d)))
    logits = np.einsum("hqd,hnd->hqn", Q.astype(np.float64), np.repeat(K, hq // hkv, 0).astype(np.float64)) * d**-0.5
    logits = np.where(np.tril(np.ones((q, q), bool)), logits, -np.inf)  # causal: query i sees keys 0..i
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs = (probs / probs.sum(-1, keepdims=True)).reshape(hkv, hq // hkv, q, q).mean(1)  # the GQA group's mean
    t = lambda a: torch.tensor(a).unsqueeze(0)  # noqa: E731
    for value in (None, t(V)):  # statistics alone, and with the output from the same probabilities
        got = blocked.attention_statistics(t(Q), t(K), KeyAccess(d**-0.5), Collecting(frozenset({entropy})), value)
        np.testing.assert_allclose(got[entropy].double().numpy(), numpy_entropy(probs), atol=2e-5)


def test_the_guides_statistic_in_a_decode_step_equals_numpy(entropy) -> None:
    b, hq, hkv, n, d = 2, 4, 2, 9, 8
    g = torch.Generator().manual_seed(0)
    query, key, value = (torch.randn(*s, generator=g) for s in ((b, hq, 1, d), (b, hkv, n, d), (b, hkv, n, d)))
    visible = torch.rand(b * hkv, n, generator=g) > 0.3
    _, stats = decode_attention(
        query, key, value, KeyAccess(d**-0.5, visible=visible), Collecting(frozenset({entropy}))
    )
    logits = torch.einsum("bhd,bhnd->bhn", query[:, :, 0].double(), key.double().repeat_interleave(2, dim=1))
    logits = logits.masked_fill(~visible.view(b, hkv, 1, n).repeat_interleave(2, dim=1).view(b, hq, n), -np.inf)
    probs = (logits * d**-0.5).softmax(dim=-1).view(b * hkv, 2, 1, n).mean(dim=1).numpy()
    np.testing.assert_allclose(stats[entropy].double().numpy(), numpy_entropy(probs), atol=1e-6)


def test_a_score_reads_the_guides_statistic_in_a_run(entropy, tiny, random_ids) -> None:
    seen = []

    class Entropy(Score):
        needs = frozenset({entropy})

        def __call__(self, view: TokenState) -> torch.Tensor:
            seen.append(view.stats[entropy])
            return view.stats[entropy]

    policy = Policy("entropy", Entropy(), All())
    assert policy.needs_attention
    generate(tiny.model, None, random_ids(30), policy, 10, "both", DecodeSettings(max_new_tokens=3), stride=8)
    assert seen and all(bool((s >= 0).all()) and float(s.sum()) > 0 for s in seen)


def test_a_statistic_declared_in_a_second_place_is_refused_naming_both(entropy) -> None:
    with pytest.raises(ValueError, match=r"'entropy' is declared twice: .*extending\.md:\d+ and .*test_extending\.py"):
        declare(Summed("entropy", "another meaning"))
    assert STATISTICS["entropy"].meaning.startswith("-p log p")
