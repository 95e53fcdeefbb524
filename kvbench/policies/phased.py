"""A policy per phase (kvpress's PrefillDecodingPress): one rule compresses the prompt, another evicts while
decoding, over one cache (``policy.prefill=snapkv policy.decode=h2o stage=both``).

Each phase brings its score and scope; a prompt chunk's eviction ranks with the prefill phase's, a decode step's
with the decode phase's (``TokenState.phase``). The cache is one layout for the whole run, so what shapes it is
the run's policy's: its allocation (which both phases must name), merging, quantisation, positions, sliding
layers and decode schedule. The cache keeps what either phase declared (statistics, features, running sums,
layer weights, the step's queries), so a decode rule that sums attention over every query finds the prompt's
queries summed when it first evicts, as it would had it compressed the prompt itself. One query log per layer
serves both: two phases that keep one must keep the same rows of the same length.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from kvbench.policies.base import Scope, Score, ScoreWrapper
from kvbench.policies.running import RowSum
from kvbench.policies.state import TokenState
from kvbench.stages import Phase


class PhasedScore(Score):
    """The prefill score in prompt chunks, the decode score in decode steps; declares what either declares."""

    why_unsupported = "a policy per phase compresses the prompt with one rule and evicts while decoding with the other"

    def __init__(self, prefill: Score, decode: Score):
        self.prefill, self.decode = prefill, decode
        self.needs = prefill.needs | decode.needs
        self.feature_names = prefill.feature_names | decode.feature_names
        self.weights = prefill.weights | decode.weights
        self.row_sums = _row_sums(prefill.row_sums, decode.row_sums)
        self.rope = prefill.rope or decode.rope  # the engine hands RoPE over when either phase reads it
        self.whole_prompt = prefill.whole_prompt  # only a prompt is scored whole
        self.replay = prefill.replay  # only a prompt is replayed
        self.rereads = prefill.rereads  # only a prompt is fed twice
        self.question = prefill.question  # only a prompt has a question
        if prefill.queries is not None and decode.queries is not None and prefill.queries != decode.queries:
            raise ValueError(
                f"the prefill and decode scores read different queries ({prefill.queries} and {decode.queries}); "
                "the cache keeps one set per step"
            )
        self.queries = prefill.queries or decode.queries
        logging = [s for s in (prefill, decode) if s.history]
        if len(logging) == 2 and (prefill.history != decode.history or _log_kind(prefill) != _log_kind(decode)):
            raise ValueError(
                f"the prefill and decode scores keep different query logs ({type(_innermost(prefill)).__name__}, "
                f"history {prefill.history}; {type(_innermost(decode)).__name__}, history {decode.history}); "
                "the cache keeps one per layer"
            )
        self.logger = logging[0] if logging else None
        self.history = self.logger.history if self.logger else 0

    def __call__(self, state: TokenState) -> torch.Tensor:
        return (self.prefill if state.phase == Phase.prefill else self.decode)(state)

    def model_problem(self, config: Any) -> str | None:
        return self.prefill.model_problem(config) or self.decode.model_problem(config)

    def features(
        self, keys: torch.Tensor, values: torch.Tensor, weights: Mapping[str, torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        out = self.prefill.features(keys, values, weights) if self.prefill.feature_names else {}
        if self.decode.feature_names:
            out.update(self.decode.features(keys, values, weights))
        return out

    def log_rows(self, probs: torch.Tensor, nvis: torch.Tensor) -> torch.Tensor:
        return self.logger.log_rows(probs, nvis) if self.logger else probs


class PhasedScope(Scope):
    """The prefill scope in prompt chunks, the decode scope in decode steps. It always protects what either
    does (``min_budget``, ``reserved``), so that a budget both can honour is the one accepted."""

    def __init__(self, prefill: Scope, decode: Scope):
        self.prefill, self.decode = prefill, decode
        self.needs = prefill.needs | decode.needs

    def _of(self, state: TokenState) -> Scope:
        return self.prefill if state.phase == Phase.prefill else self.decode

    def protected(self, state: TokenState, budget: int) -> torch.Tensor:
        return self._of(state).protected(state, budget)

    def shield(self, scores: torch.Tensor, state: TokenState, budget: int) -> torch.Tensor:
        return self._of(state).shield(scores, state, budget)

    def min_budget(self) -> int:
        return max(self.prefill.min_budget(), self.decode.min_budget())

    def reserved(self, budget: int) -> int:
        return max(self.prefill.reserved(budget), self.decode.reserved(budget))


def _row_sums(*declared: tuple[RowSum, ...]) -> tuple[RowSum, ...]:
    """Both phases' running sums, once each; one name declared twice must be one sum."""
    out: dict[str, RowSum] = {}
    for row_sum in (s for sums in declared for s in sums):
        if out.setdefault(row_sum.name, row_sum) != row_sum:
            raise ValueError(f"the prefill and decode scores declare two running sums named {row_sum.name!r}")
    return tuple(out.values())


def _innermost(score: Score) -> Score:
    return _innermost(score.inner) if isinstance(score, ScoreWrapper) else score


def _log_kind(score: Score) -> object:
    """What shapes a score's query log rows: the ``log_rows`` of the score a wrapper wraps."""
    return type(_innermost(score)).log_rows
