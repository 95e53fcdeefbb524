"""A policy is an importance score, an eviction scope and a budget allocation (RoCo's split), plus extras.

``Score`` ranks a layer's held tokens per KV head, ``Scope`` shields some of them from eviction whatever
their score, ``Allocation`` splits the budget across layers and (optionally) across the heads of a layer.
The extras compose with any of them: ``merge`` folds evicted entries into kept ones (policies.merge, policies.cam),
``quantize`` stores kept entries as int8/fp8, ``channels`` keeps some channels of each key (ThinK, policies.channels),
``positions`` chooses absolute RoPE positions or StreamingLLM's re-indexing.

Named policies only choose the parts (configs/policy/*.yaml).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from kvbench.policies.channels import KeyChannels
from kvbench.policies.inputs import WEIGHTS, Queries, Replay
from kvbench.policies.merge import CosineMerge, Merge
from kvbench.policies.running import RowSum
from kvbench.policies.sparse import Sparsity
from kvbench.policies.state import TokenState
from kvbench.policies.statistics import attention_names

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


@dataclass
class Policy:
    name: str
    score: Score
    scope: Scope
    evicts: bool = True
    allocation: Allocation = field(default_factory=Allocation)
    # What becomes of evicted entries (policies.merge): None (dropped), a Merge; True is the cosine merge.
    merge: Merge | bool | None = None
    # None, or a quantiser (see policies.quantize) applied to every stored entry.
    quantize: Any = None
    # "absolute": kept keys keep their true RoPE rotation. "reindex": StreamingLLM's positions within the cache.
    positions: str = "absolute"
    # Stages the policy refuses (read by config validation); derived from the score when not given.
    unsupported_stages: tuple[str, ...] | None = None
    # Sliding-window layers of a hybrid model: "window" (they hold their window, the budget is the full-attention
    # layers') or "evict" (the policy evicts there too, to at most the window). See kvbench.engine.plan.
    sliding_layers: str = "window"
    # Decode steps from one eviction to the next (kvpress's DecodingPress ``compression_interval``): between
    # evictions a row grows past its budget by up to ``interval - 1`` entries. 1: every decode step evicts.
    interval: int = 1
    # Key-channel pruning (ThinK, policies.channels): None keeps every channel.
    channels: KeyChannels | None = None
    # Decode-time sparsity (policies.sparse: Quest): which held keys each decode query attends; only with a policy
    # that never evicts, whose budget then counts attended keys.
    sparsity: Sparsity | None = None

    def __post_init__(self) -> None:
        if isinstance(self.merge, bool):
            self.merge = CosineMerge() if self.merge else None
        if isinstance(self.interval, bool) or not isinstance(self.interval, int) or self.interval < 1:
            raise ValueError(f"interval={self.interval!r} must be a positive integer (decode steps between evictions)")
        if self.positions not in POSITION_MODES:
            raise ValueError(f"positions {self.positions!r} must be one of {POSITION_MODES}")
        if self.sliding_layers not in SLIDING_MODES:
            raise ValueError(f"sliding_layers {self.sliding_layers!r} must be one of {SLIDING_MODES}")
        if self.merge and self.allocation.pools_layers:
            raise ValueError(
                f"allocation={self.allocation.describe()} ranks every layer together, and a merge folds entries "
                "within one layer; use policy.merge=false"
            )
        if self.sparsity is not None and self.evicts:
            raise ValueError(
                "a sparsity part chooses the keys a full cache's queries attend, and the budget counts them; it "
                "cannot combine with an evicting score: use score=none"
            )
        if self.unsupported_stages is None:
            self.unsupported_stages = (
                self.sparsity.unsupported_stages
                if self.sparsity is not None
                else tuple(self.score.unsupported_stages)
                if self.evicts
                else ()
            )
        reads = self.score.queries
        if self.positions == "reindex" and reads is not None and not reads.rope:
            raise ValueError(
                f"score {type(self.score).__name__} reads the queries before RoPE against keys at their true "
                "positions, which positions=reindex moves; use positions=absolute"
            )
        if self.channels is not None:
            self._check_channels()
        if "qlog" in self.allocation.needs and self.evicts and self.score.history < 1:
            raise ValueError(
                f"allocation={self.allocation.describe()} reads the attention of the score's observation window, "
                f"and score {type(self.score).__name__} keeps none; use a windowed score (score.kind=cake or snapkv)"
            )
        unknown = sorted(set(self.score.weights) - set(WEIGHTS))
        if unknown:
            raise ValueError(
                f"score {type(self.score).__name__} reads unknown weight(s) {unknown}; known: {sorted(WEIGHTS)}"
            )

    def _check_channels(self) -> None:
        """Pruned keys hold some channels of the rotated key: RoPE cannot turn them again, nor meet a query
        before it."""
        if self.positions == "reindex":
            raise ValueError(
                "channels prunes the rotated keys' channels, and positions=reindex rotates kept keys again, which "
                "needs every channel; use positions=absolute"
            )
        reads = self.score.queries
        if self.evicts and reads is not None and not reads.rope:
            raise ValueError(
                f"score {type(self.score).__name__} reads the queries before RoPE, which need every key channel; "
                "channels keeps some: use a score that reads none (or policy.channels=null)"
            )

    @property
    def needs(self) -> frozenset[str]:
        """Per-token statistics the layers keep for this policy (none for a cache that never evicts)."""
        if not self.evicts:
            return frozenset()
        merging = self.merge.needs if isinstance(self.merge, Merge) else frozenset()
        return self.score.needs | self.scope.needs | self.allocation.needs | merging

    @property
    def budgeted(self) -> bool:
        """Whether the budget changes what the policy does: it evicts to it, or (a sparsity) attends that many keys
        per decode query. A policy that is neither (the full cache) ignores it."""
        return self.evicts or self.sparsity is not None

    @property
    def needs_attention(self) -> bool:
        return bool(attention_names(self.needs))

    @property
    def feature_names(self) -> frozenset[str]:
        return self.score.feature_names if self.evicts else frozenset()

    def features(
        self, keys: torch.Tensor, values: torch.Tensor, weights: Mapping[str, torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        return self.score.features(keys, values, weights)

    @property
    def queries(self) -> Queries | None:
        """The evicting step's queries the score reads (None for a cache that never evicts)."""
        return self.score.queries if self.evicts else None

    @property
    def weights(self) -> frozenset[str]:
        """Layer weights the score's features read (none for a cache that never evicts)."""
        return self.score.weights if self.evicts else frozenset()

    @property
    def rope(self) -> bool:
        """Whether the score reads the model's RoPE (never for a cache that never evicts)."""
        return self.score.rope and self.evicts

    @property
    def whole_prompt(self) -> bool:
        """Whether the score needs the prompt fed in one step (never for a cache that never evicts)."""
        return (self.score.whole_prompt or self.score.rereads) and self.evicts

    def model_problem(self, config: Any) -> str | None:
        """Why the score cannot run on the model of ``config`` (never for a cache that never evicts)."""
        return self.score.model_problem(config) if self.evicts else None

    @property
    def rereads(self) -> bool:
        """Whether the prompt is fed a second time to score the first (never for a cache that never evicts)."""
        return self.score.rereads and self.evicts

    @property
    def replay(self) -> Replay | None:
        """The replay passes the score reads after the prompt (none for a cache that never evicts)."""
        return self.score.replay if self.evicts else None

    @property
    def question(self) -> bool:
        """Whether the score observes the prompt's question (never for a cache that never evicts)."""
        return self.score.question and self.evicts

    @property
    def row_sums(self) -> tuple[RowSum, ...]:
        """Running per-row sums the layers keep for this policy (none for a cache that never evicts)."""
        return self.score.row_sums if self.evicts else ()

    @property
    def history(self) -> int:
        """Rows of recent-query attention each layer keeps (a ring buffer), for scores that read it."""
        return self.score.history if self.evicts else 0

    @property
    def why_unsupported(self) -> str:
        """Why the unsupported stages are refused (one sentence), for messages."""
        return self.sparsity.why_unsupported if self.sparsity is not None else self.score.why_unsupported

    def layer_budgets(self, budget: int, n_layers: int, limit: int | None = None) -> list[int]:
        return self.allocation.layer_budgets(budget, n_layers, limit, self.scope.reserved(budget))

    def scored(self, state: TokenState, budget: int, padding: float = float("-inf")) -> torch.Tensor:
        """Scores with protected entries at +inf and padding at ``padding`` (-inf: never kept), float32 [H, n]. In a
        sliding-window layer the entries its next query cannot see rank last, whatever the scope protects: the
        budget is spent on what attention can still read."""
        state.evicting(budget, lambda s: self.ranked(s, state, budget), lambda s: self.kept_by(s, state, budget))
        return self.ranked(self.score(state), state, budget, padding)

    def ranked(
        self, scores: torch.Tensor, state: TokenState, budget: int, padding: float = float("-inf")
    ) -> torch.Tensor:
        """``scores`` as eviction ranks them (see ``scored``)."""
        scores = self.scope.shield(scores.to(torch.float32), state, budget)
        outside = state.outside_window()
        if outside is not None:
            scores = scores.masked_fill(outside, float("-inf"))
        if state.valid is not None:
            scores = scores.masked_fill(~state.valid, padding)
        return scores

    def kept_by(self, scores: torch.Tensor, state: TokenState, budget: int) -> torch.Tensor:
        """What the scope and allocation keep when ``scores`` rank the entries, bool [H, n]."""
        return self.allocation.keep_rows(self.ranked(scores, state, budget), state, budget)

    def keep_mask(self, state: TokenState, budget: int) -> torch.Tensor:
        """Bool [H, n]: what each head keeps. ``budget`` is the per-head budget (the average, under
        per-head allocation: the layer keeps ``heads × budget`` entries in all)."""
        return self.allocation.keep_rows(self.scored(state, budget), state, budget)

    def partition(self, state: TokenState, budget: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Heads sharing one length (uniform allocation within the layer): the indices each keeps, [kv_heads,
        budget], ascending so kept tokens stay in sequence order, and those it evicts, [kv_heads, n - budget] (in no
        particular order)."""
        scores = self.scored(state, budget)
        heads, n = scores.shape
        order = torch.arange(n, device=scores.device)
        if n - budget == 1:  # the decode step's usual case: one eviction per head, no sort needed
            evicted = scores.argmin(dim=-1, keepdim=True)
            return order[:budget] + (order[:budget] >= evicted), evicted
        evicted = torch.topk(scores, n - budget, dim=-1, largest=False, sorted=False).indices
        kept = torch.ones(heads, n, dtype=torch.bool, device=scores.device).scatter_(1, evicted, False)
        return order.expand(heads, n)[kept].view(heads, budget), evicted
