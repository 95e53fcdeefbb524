"""A policy is an importance score, an eviction scope and a budget allocation (RoCo's split), plus extras.

``Score`` ranks a layer's held tokens per KV head, ``Scope`` shields some of them from eviction whatever
their score, ``Allocation`` splits the budget across layers and (optionally) across the heads of a layer.
The extras compose with any of them: ``merge`` folds evicted entries into kept ones (policies.merge, policies.cam),
``quantize`` stores kept entries as int8/fp8, ``channels`` keeps some channels of each key (ThinK, policies.channels),
``positions`` chooses absolute RoPE positions or StreamingLLM's re-indexing. ``policies.policy.Policy`` puts the
parts and the extras together.

Named policies only choose the parts (configs/policy/*.yaml).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import Any

import torch

from kvbench.policies.inputs import Queries, Replay
from kvbench.policies.running import RowSum
from kvbench.policies.state import TokenState

POSITION_MODES = ("absolute", "reindex")
SLIDING_MODES = ("window", "evict")


class Score(ABC):
    """Importance of each held token, float [kv_heads, n]; higher is kept first."""

    # Per-token statistics the score reads from ``TokenState.stats`` (see policies.statistics).
    needs: frozenset[str] = frozenset()
    # Rows of the per-layer query log (attention of the most recent queries) the score reads; 0 = none.
    history: int = 0
    # Stages in which the score has no meaning (e.g. SnapKV's observation window needs a prompt).
    unsupported_stages: tuple[str, ...] = ()
    why_unsupported: str = ""
    # Per-entry quantities fixed when an entry is written (``features``), kept beside the statistics so that
    # a score reads them instead of recomputing them from every held key or value at every step.
    feature_names: frozenset[str] = frozenset()
    # Per-row running sums the cache keeps up to date as entries come and go (``TokenState.row_sums``).
    row_sums: tuple[RowSum, ...] = ()
    # The evicting step's queries the score reads (``TokenState.queries``), or None.
    queries: Queries | None = None
    # Layer weights its ``features`` read (names of ``policies.inputs.WEIGHTS``).
    weights: frozenset[str] = frozenset()
    # One kept set per layer (``shared: true``, here or in a base score): the heads of a layer must hold the same
    # entries, so per-head allocation is refused.
    shares_heads: bool = False
    # True: the score reads the model's RoPE (``TokenState.rope``): keys before it, vectors rotated to positions.
    rope: bool = False
    # True: the score reads every held entry's query, so the prompt must come in one step (``stride`` is refused).
    whole_prompt: bool = False
    # Replay passes after the prompt, whose attention the score reads (``policies.inputs.Replay``), or None.
    replay: Replay | None = None
    # True: the prompt is fed twice in a row (KVCompose's observation pass): the second pass's attention scores
    # the first pass's entries, then the second pass's entries are dropped and the positions go back to the
    # prompt's end. Only where the prompt's eviction drops something; implies ``whole_prompt``.
    rereads: bool = False
    # True: the score's observation window is the prompt's question (Finch): the engine compresses the context and
    # the question together and tells the score how many of the prompt's last tokens are the question
    # (``TokenState.observe``).
    question: bool = False

    @abstractmethod
    def __call__(self, state: TokenState) -> torch.Tensor:
        """Scores, float [kv_heads, n]. Padding (``state.valid``) may score anything: it is never kept."""

    def model_problem(self, config: Any) -> str | None:
        """Why the score cannot run on the model of ``config`` (its calibration belongs to another), or None;
        asked from the config before any weights load."""
        return None

    def features(
        self, keys: torch.Tensor, values: torch.Tensor, weights: Mapping[str, torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        """{name: [r, q]} for new entries, keys/values [r, q, D] as stored (``feature_names``). ``weights``: the
        layer's weights the score declared (``weights``), by name; a score that declares some gets the entries of
        one KV head per call, and that head's part of each weight (``policies.inputs.WEIGHTS``)."""
        return {}

    def log_rows(self, probs: torch.Tensor, nvis: torch.Tensor) -> torch.Tensor:
        """What the query log keeps of the newest queries: probs [H, r, n] (GQA group-mean attention rows,
        0 where a key was not visible), nvis [H, r] (keys each query saw). The rows themselves by default."""
        return probs


# What a score declares, so that a wrapper forwards all of it (``ScoreWrapper``).
DECLARATIONS = (
    "needs",
    "history",
    "unsupported_stages",
    "why_unsupported",
    "feature_names",
    "row_sums",
    "queries",
    "weights",
    "shares_heads",
    "rope",
    "whole_prompt",
    "replay",
    "rereads",
    "question",
)


class ScoreWrapper(Score):
    """A score computed from another (``inner``): it declares what the inner score declares, features and query
    log rows included, so a wrapper states only what it adds."""

    def __init__(self, inner: Score):
        self.inner = inner
        for name in DECLARATIONS:
            setattr(self, name, getattr(inner, name))

    def features(
        self, keys: torch.Tensor, values: torch.Tensor, weights: Mapping[str, torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        return self.inner.features(keys, values, weights)

    def log_rows(self, probs: torch.Tensor, nvis: torch.Tensor) -> torch.Tensor:
        return self.inner.log_rows(probs, nvis)

    def model_problem(self, config: Any) -> str | None:
        return self.inner.model_problem(config)


class Scope(ABC):
    """Which tokens may be evicted: returns the *protected* set."""

    needs: frozenset[str] = frozenset()

    @abstractmethod
    def protected(self, state: TokenState, budget: int) -> torch.Tensor:
        """Bool [kv_heads, n]; at most ``budget`` True per head, never True on padding."""

    def shield(self, scores: torch.Tensor, state: TokenState, budget: int) -> torch.Tensor:
        """``scores`` with +inf on the protected entries: what eviction ranks. Never writes into ``scores`` (it
        may be a view of the layer's statistics). Scopes override it with slices where heads share one length
        (every decode step of a uniform allocation), so that no mask is built."""
        return scores.masked_fill(self.protected(state, budget), float("inf"))

    def min_budget(self) -> int:
        """The smallest budget this scope can honour (its fixed protections plus one candidate)."""
        return 1

    def reserved(self, budget: int) -> int:
        """Tokens the scope protects whatever the scores at this budget (sinks, recent window): what a
        layer-wise allocation keeps out of its split (PyramidKV spreads only the rest)."""
        return min(budget, self.min_budget() - 1)


class Allocation:
    """How a budget splits. This base is the uniform split: every layer and every head gets ``budget``."""

    # True when heads of a layer get different budgets (the cache then stores per-head lengths).
    per_head: bool = False
    # True when what a row keeps follows its scores, not a count (a threshold): the allocation then decides at
    # every evicting step, under the budget or over it, and the budget only caps what a row keeps.
    thresholded: bool = False
    # True when one split spans every layer of a sequence (``global``): the cache then evicts a sequence's layers
    # together, once their total exceeds ``layers × heads × budget``, and a row may hold any share of it.
    pools_layers: bool = False
    # Statistics the allocation itself reads from the state (``keep_state``): CAKE's layer preferences read the
    # score's query log.
    needs: frozenset[str] = frozenset()

    def layers_problem(self, n_layers: int) -> str | None:
        """Why this allocation cannot split a budget over ``n_layers`` layers (an explicit list of another
        length), or None; asked from the model's config before any weights load."""
        return None

    def layer_budgets(self, budget: int, n_layers: int, limit: int | None = None, reserved: int = 0) -> list[int]:
        """Per-layer token budgets (per KV head, on average), summing to ``n_layers × budget``. ``limit`` is the
        most a layer can ever be asked to hold in an evicting step (a budget above it changes nothing);
        ``reserved`` is what the scope protects whatever the scores (see ``Scope.reserved``)."""
        return [budget] * n_layers

    def keep(self, scores: torch.Tensor, valid: torch.Tensor | None, budget: int, units: int = 1) -> torch.Tensor:
        """Bool keep mask [rows, n]. ``scores`` already carry +inf on protected entries; every row keeps
        ``budget`` entries (or all it holds, if fewer). ``units``: how many (layer, sequence) blocks the rows
        make (see ``TokenState.units``); a split across heads stays within one, here every row stands alone."""
        if valid is not None:
            scores = scores.masked_fill(~valid, float("-inf"))
        k = min(budget, scores.shape[-1])
        idx = torch.topk(scores, k, dim=-1, sorted=False).indices
        mask = torch.zeros_like(scores, dtype=torch.bool).scatter_(1, idx, True)
        return mask if valid is None else mask & valid

    def keep_rows(self, scores: torch.Tensor, state: TokenState, budget: int) -> torch.Tensor:
        """The keep mask of a view's rows: ``keep`` on their scores. An allocation whose split depends on which
        (layer, KV head) each row is (``headkv``'s saved per-head weights) reads ``state.row_keys``; one that
        depends on more of the state than the scores (CAKE's layer preferences) reads that."""
        return self.keep(scores, state.valid, budget, state.units)

    def heads_problem(self, n_layers: int, kv_heads: int) -> str | None:
        """Why this allocation cannot serve a model of ``n_layers`` layers of ``kv_heads`` KV heads (per-head
        weights measured on another model), or None; asked from the model's config before any weights load."""
        return None

    def describe(self) -> str:
        return "uniform"
