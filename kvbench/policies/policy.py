"""The policy a run evicts by: its score, scope and allocation (``policies.base``) and the extras that compose with
any of them (merge, quantisation, key channels, positions, a decode-time sparsity), with what the engine asks of
them together: which statistics, inputs and passes the score needs, and how a row's entries are ranked and kept."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from kvbench.policies.base import POSITION_MODES, SLIDING_MODES, Allocation, Scope, Score
from kvbench.policies.channels import KeyChannels
from kvbench.policies.inputs import WEIGHTS, Queries, Replay
from kvbench.policies.merge import CosineMerge, Merge
from kvbench.policies.running import RowSum
from kvbench.policies.sparse import Sparsity
from kvbench.policies.state import TokenState
from kvbench.policies.statistics import attention_names


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
