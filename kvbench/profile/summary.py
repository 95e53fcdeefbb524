"""A profile of one model on one workload: per-example layer results, averaged over examples, as JSON and CSV.

Each example counts once: a layer's measures are first averaged over that example's prompt queries (and its
recall over its KV heads), then over examples. The std-by-age curve pools the moments of every example and head.
"""

from __future__ import annotations

import csv
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from kvbench.policies.policy import Policy
from kvbench.profile.collect import LayerProfile, PromptEnd
from kvbench.profile.consistency import ORACLE, Budgets, layer_recall
from kvbench.profile.measures import COVERAGE_LEVELS, std_from_moments

HEAD_MEASURES = ("entropy", "sink_mass", "recent_mass") + tuple(f"coverage_{round(100 * c)}" for c in COVERAGE_LEVELS)


@dataclass
class LayerResult:
    heads: dict[str, list[float]]  # measure -> per KV head, mean over the prompt's queries
    age: torch.Tensor  # [3, max_age]: moments pooled over heads
    future_prompt_share: float  # mean share of a continuation query's attention that goes to the prompt
    recall: dict[str, list[float]]  # candidate -> per budget, mean over KV heads


def layer_result(
    layer: int,
    profile: LayerProfile,
    end: PromptEnd,
    candidates: Mapping[str, Policy],
    budgets: Budgets,
    seed: int = 0,
) -> LayerResult:
    """What to keep of one layer of one example (its keys and future mass are dropped after this)."""
    q = profile.queries
    heads = {"entropy": profile.entropy / q, "sink_mass": profile.sink / q, "recent_mass": profile.recent / q}
    for i, name in enumerate(HEAD_MEASURES[3:]):
        heads[name] = profile.coverage[i] / q
    share = float(profile.future.sum() / (profile.future_queries * profile.future.shape[0]))
    return LayerResult(
        heads={k: [float(x) for x in v] for k, v in heads.items()},
        age=profile.age.sum(dim=1).cpu(),
        future_prompt_share=share,
        recall=layer_recall(layer, profile.future, end, candidates, budgets, seed),
    )


@dataclass
class Profile:
    """Running sums over examples; ``to_dict`` gives the averages."""

    model: str
    task: str
    windows: list[int | None]
    budgets: list[float | int]
    kinds: dict[str, str]  # candidate -> "score" | "policy" | "oracle"
    n_sink: int
    n_recent: int
    examples: int = 0
    prompt_tokens: list[int] = field(default_factory=list)
    continuation_tokens: list[int] = field(default_factory=list)
    _heads: dict[str, torch.Tensor] = field(default_factory=dict)
    _age: torch.Tensor | None = None
    _share: torch.Tensor | None = None
    _recall: dict[str, torch.Tensor] = field(default_factory=dict)

    def add(self, layers: Mapping[int, LayerResult], prompt: int, continuation: int) -> None:
        order = sorted(layers)
        if order != list(range(len(self.windows))):
            raise RuntimeError(f"profile got layers {order}, expected all {len(self.windows)}")
        rows = [layers[i] for i in order]
        for name in HEAD_MEASURES:
            value = torch.tensor([r.heads[name] for r in rows], dtype=torch.float64)
            self._heads[name] = self._heads.get(name, 0) + value
        age = torch.stack([r.age for r in rows])
        self._age = age if self._age is None else self._age + age
        share = torch.tensor([r.future_prompt_share for r in rows], dtype=torch.float64)
        self._share = share if self._share is None else self._share + share
        for name in rows[0].recall:
            value = torch.tensor([r.recall[name] for r in rows], dtype=torch.float64)
            self._recall[name] = self._recall.get(name, 0) + value
        self.examples += 1
        self.prompt_tokens.append(prompt)
        self.continuation_tokens.append(continuation)

    def budget_layers(self) -> list[int]:
        """The layers a budget applies to: full-attention ones (a hybrid model's sliding layers hold a window)."""
        full = [i for i, w in enumerate(self.windows) if w is None]
        return full or list(range(len(self.windows)))

    def to_dict(self) -> dict[str, Any]:
        if not self.examples or self._age is None or self._share is None:
            raise RuntimeError("no example was profiled")
        n = self.examples
        heads = {k: (v / n).tolist() for k, v in self._heads.items()}
        recall = {k: (v / n) for k, v in self._recall.items()}
        chosen = self.budget_layers()
        return {
            "model": self.model,
            "task": self.task,
            "examples": n,
            "prompt_tokens": self.prompt_tokens,
            "continuation_tokens": self.continuation_tokens,
            "windows": self.windows,
            "budget_layers": chosen,
            "n_sink": self.n_sink,
            "n_recent": self.n_recent,
            "heads": heads,
            "layers": {k: [sum(h) / len(h) for h in v] for k, v in heads.items()}
            | {"future_prompt_share": (self._share / n).tolist()},
            "age": {
                "count": self._age[:, 0].tolist(),
                "std": [
                    [None if x != x else x for x in row] for row in std_from_moments(self._age.transpose(0, 1)).tolist()
                ],
            },
            "budgets": self.budgets,
            "kinds": self.kinds,
            "recall": {k: v.tolist() for k, v in recall.items()},
            "recall_mean": {k: v[chosen].mean(dim=0).tolist() for k, v in recall.items()},
        }


def write_profile(data: dict[str, Any], out: Path) -> None:
    """``profile.json`` and its tables as CSV: ``heads.csv``, ``recall.csv``, ``age_std.csv``."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "profile.json").write_text(json.dumps(data, indent=1))
    with open(out / "heads.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["layer", "head", "window", *HEAD_MEASURES])
        for layer, window in enumerate(data["windows"]):
            for head in range(len(data["heads"]["entropy"][layer])):
                w.writerow([layer, head, window, *(data["heads"][m][layer][head] for m in HEAD_MEASURES)])
    with open(out / "recall.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["candidate", "kind", "budget", "layer", "recall"])
        for name, rows in data["recall"].items():
            for layer, row in enumerate(rows):
                for budget, value in zip(data["budgets"], row):
                    w.writerow([name, data["kinds"][name], budget, layer, value])
            for budget, value in zip(data["budgets"], data["recall_mean"][name]):
                w.writerow([name, data["kinds"][name], budget, "mean", value])
    with open(out / "age_std.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["layer", "age", "count", "std"])
        for layer, (counts, stds) in enumerate(zip(data["age"]["count"], data["age"]["std"])):
            for age, (count, std) in enumerate(zip(counts, stds)):
                if count:
                    w.writerow([layer, age, int(count), std])


def candidate_kinds(candidates: Mapping[str, Policy]) -> dict[str, str]:
    """Candidates are named ``score/<kind>`` (a score alone) or ``policy/<name>`` (a full policy)."""
    return {ORACLE: "oracle"} | {name: name.partition("/")[0] for name in candidates}
