"""One decoder layer's face of the cache: its K/V store, and what the step under way gives its attention.

The cache hands each layer the step's ``Feeding`` (``update``); the layer writes its new entries to its store and
returns the keys and values the step attends to. Its attention then reads which of them each row sees
(``visible``, ``key_positions``, ``step_window``) and hands the layer the statistics it reduced (``record``),
which go into the shared ``Entries``. Nothing here reaches back into the cache.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import CacheLayerMixin

from kvbench.engine.cache.entries import Entries
from kvbench.engine.cache.feeding import Feeding
from kvbench.engine.cache.store import KVStore
from kvbench.engine.plan import LayerPlan
from kvbench.engine.score_inputs import ScoreInputs, per_head
from kvbench.engine.step import Reconstruction
from kvbench.engine.visibility import KeyAccess, Window
from kvbench.policies.policy import Policy
from kvbench.policies.positions import Rotary
from kvbench.policies.statistics import STATISTICS


def write_features(
    entries: Entries,
    layer: int,
    store: KVStore,
    policy: Policy,
    rows: torch.Tensor,
    slots: torch.Tensor,
    weights: dict[str, torch.Tensor],
) -> None:
    """Write-time features (e.g. value norms) of the layer's entries at (``rows`` [m], ``slots`` [m]), from them
    as stored; with the layer's declared ``weights``, one KV head at a time (``score_inputs.per_head``)."""
    keys, values = store.gather(rows, slots.unsqueeze(1))
    for at, head_weights in per_head(weights, rows, entries.heads):
        for name, value in policy.features(keys[at], values[at], head_weights).items():
            entries.write_column(name, layer, rows[at], slots[at], value)


class CacheLayer(CacheLayerMixin):
    """One decoder layer: its plan, policy and K/V store, and the keys of the step under way: how many (slots
    ``0:n``), how many precede the step's own (``past``), which are visible ([rows, n] for a decode step,
    [rows, past] for a chunk; None: all) and their positions [rows, n]."""

    is_compileable = False
    is_sliding = False

    def __init__(
        self, layer_idx: int, plan: LayerPlan, policy: Policy, inputs: ScoreInputs, rotary: Rotary | None = None
    ):
        super().__init__()
        self.layer_idx, self.plan, self.policy, self.capacity = layer_idx, plan, policy, 0
        self.inputs = inputs  # the score's declared weights, and where this layer leaves the step's queries
        self._store: KVStore | None = None
        self._entries: Entries | None = None
        self._unfeatured: list[tuple[torch.Tensor, torch.Tensor]] = []  # (rows, slots) whose features wait
        # Under positions=reindex: this layer's RoPE (layers may differ: Gemma 3's local and global tables).
        self.rotary = rotary if rotary is not None and rotary.rot_dim > 0 else None
        self.n = self.past = 0
        self.visible: torch.Tensor | None = None
        self.key_positions: torch.Tensor | None = None
        self.feeding: Feeding | None = None
        # Under ``policy.channels``, until the context is in: the squares of its last queries [heads, <= window, D].
        self.window_queries: torch.Tensor | None = None
        # A replay pass's log weight of each query [q], where its score weighs them (``engine.replay``), and, in a
        # gradient pass, what its reconstruction attention is computed from once the gradient is known.
        self.query_log_weight: torch.Tensor | None = None
        self.pending_replay: tuple[torch.Tensor, torch.Tensor, torch.Tensor, Reconstruction, KeyAccess] | None = None

    def attach(self, store: KVStore, entries: Entries) -> None:
        """The layer's K/V buffers and the cache's bookkeeping, allocated once their shapes are known."""
        self._store, self._entries, self.capacity, self.is_initialized = store, entries, store.capacity, True

    @property
    def store(self) -> KVStore:
        """The layer's K/V buffers; they exist from the cache's first write on (``attach``)."""
        assert self._store is not None, "the cache attaches every layer's store on its first write"
        return self._store

    @property
    def entries(self) -> Entries:
        assert self._entries is not None, "the cache attaches its entries on its first write"
        return self._entries

    @property
    def current(self) -> Feeding:
        """The step under way."""
        assert self.feeding is not None, "a layer attends only after the step's write"
        return self.feeding

    def write_features(self) -> None:
        """The features of the entries written since the last call, in one batch: a decode step far from an
        eviction (not ``Step.prepares``) leaves them to the next step that prepares one."""
        if not self._unfeatured:
            return
        rows, slots = (torch.cat(parts) for parts in zip(*self._unfeatured))
        self._unfeatured.clear()
        weights = self.inputs.weights[self.layer_idx]
        write_features(self.entries, self.layer_idx, self.store, self.policy, rows, slots, weights)

    # -- transformers' cache layer ---------------------------------------------------------------------------
    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, feeding: Feeding, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the step's new entries; returns the keys and values the step attends to [lanes, heads, n, D]."""
        layer, e, store = self.layer_idx, self.entries, self.store
        b, h, q, _ = key_states.shape
        lanes = feeding.step.lanes
        rows, slots = feeding.rows, feeding.slots[layer]
        stored = key_states
        if self.rotary is not None:
            stored = self.rotary.unrotate(key_states, feeding.model_positions.unsqueeze(1))
        stored = store.narrow(rows, stored.reshape(b * h, q, -1))
        store.write(rows, slots, stored.detach(), value_states.reshape(b * h, q, -1).detach())
        if feeding.step.collects:  # no later eviction reads what a step that does not collect writes
            if self.policy.feature_names:
                self._unfeatured.append((rows.repeat_interleave(q), slots.reshape(-1)))
                if feeding.step.prepares:
                    self.write_features()
            if e.row_sums is not None:
                e.row_sums.add(layer, rows, slots)
        n = feeding.key_spans[layer]
        keys, values = store.read(lanes.start * h, lanes.stop * h, n)
        rr = e.row_range(lanes.start, lanes.stop)
        past = n if q == 1 else n - q
        visible = None if feeding.gapless[layer] else e.occupied[layer, rr, :past]
        masks = feeding.step.replay_masks
        if masks is not None:
            by_position = masks[layer].gather(1, e.positions[layer, rr, :past].clamp_min(0))
            visible = by_position & e.occupied[layer, rr, :past]
        self.n, self.past, self.visible, self.key_positions = n, past, visible, e.positions[layer, rr, :n]
        self.feeding = feeding
        if self.rotary is not None:
            keys = self.rotary.rotate(keys, self._reindexed_positions(n))
        if key_states.requires_grad:  # a gradient replay pass (KVgrad): its own entries carry the graph
            if self.rotary is not None or store.quantizer is not None or store.channels is not None:
                raise RuntimeError("a gradient replay pass needs plain stored keys: no reindex, quantization, channels")
            keys = torch.cat([keys[:, : n - q], key_states.reshape(b * h, q, -1)], dim=1)
            values = torch.cat([values[:, : n - q], value_states.reshape(b * h, q, -1)], dim=1)
        return keys.view(b, h, n, -1), values.view(b, h, n, -1)

    def finish(self) -> None:
        """The step is over: its feeding is not read again."""
        self.feeding = None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.is_initialized = True

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.n or query_length, 0

    def get_seq_length(self) -> int:
        return self.n

    def get_max_length(self) -> int:
        return self.capacity

    def reset(self) -> None:
        raise RuntimeError("a kvbench cache is built per run; it is never reset")

    # -- what the attention reads and hands back -------------------------------------------------------------
    def step_window(self, size: int | None) -> Window | None:
        """The step's sliding window over its keys, or None where every visible key is inside it."""
        if size is None:
            return None
        queries = self.current.query_positions  # [rows, q]
        keys = self.key_positions
        assert keys is not None, "update sets the step's key positions before the layer attends"
        held = (
            keys
            if self.visible is None or self.visible.shape[1] != keys.shape[1]
            else keys.masked_fill(~self.visible, -1)
        )
        oldest = held.masked_fill(held < 0, torch.iinfo(held.dtype).max).amin(dim=1)
        if bool((queries[:, -1] - oldest < size).all()):
            return None
        return Window(size, held, queries)

    def record(self, stats: dict[str, torch.Tensor]) -> None:
        """Fold the statistics the attention reduced over the step's keys (slots ``0:n``) into the rows."""
        if not stats:
            return
        if "queries" in stats:  # not a statistic: the step's queries, for this step's eviction
            self.inputs.queries[self.layer_idx] = stats.pop("queries")
        e, feeding = self.entries, self.current
        layer, lanes, q = self.layer_idx, feeding.step.lanes, feeding.step.tokens
        rr = e.row_range(lanes.start, lanes.stop)
        for name, value in stats.items():
            if name in e.columns:
                assert e.table is not None, "entries with columns keep a table"
                column = e.table[layer, rr, : value.shape[-1], e.columns.index(name)]
                if STATISTICS[name].fold == "replace":
                    column.copy_(value)
                elif STATISTICS[name].fold == "max":
                    torch.maximum(column, value, out=column)
                else:
                    column += value
        if e.log is not None and "qlog" in stats:
            logged = self.policy.score.log_rows(stats["qlog"], stats["qlog_nvis"])
            w = e.log.history
            flat = slice(layer * e.rows + rr.start, layer * e.rows + rr.stop)
            if q == 1:
                e.log.append(flat, logged, stats["qlog_nvis"], feeding.query_positions[:, 0] % w, self._wrapped(w))
            else:
                k = logged.shape[1]
                places = [p % w for p in feeding.step.positions[0][-k:]]
                e.log.append(flat, logged, stats["qlog_nvis"], places, [])

    # -- key channels (policy.channels) -----------------------------------------------------------------------
    def note_queries(self, query: torch.Tensor) -> None:
        """A context chunk's queries [1, heads, q, D], as attention saw them: the squares of the last ``window``
        so far are what ``prune_channels`` scores the channels with."""
        channels = self.policy.channels
        assert channels is not None, "only a layer that prunes channels notes its queries"
        squares = query[0, :, -channels.window :].to(torch.float32).square()
        held = self.window_queries
        joined = squares if held is None else torch.cat([held, squares], dim=1)
        self.window_queries = joined[:, -channels.window :]

    def prune_channels(self) -> None:
        """The context is in (one lane): each row keeps the key channels ``policy.channels`` ranks highest by the
        noted queries' mean square (over the window, then the GQA group) times the held keys' mean square."""
        channels, noted = self.policy.channels, self.window_queries
        assert channels is not None and noted is not None, "a layer prunes after noting the context's queries"
        e, layer, store = self.entries, self.layer_idx, self.store
        n = e.slots_used[layer]
        keys, _ = store.read(0, e.rows, n)
        held = e.occupied[layer, :, :n].unsqueeze(-1)
        key_energy = (keys.to(torch.float32).square() * held).sum(dim=1) / held.sum(dim=1).clamp_min(1)
        heads, _, dim = noted.shape
        query_energy = noted.mean(dim=1).view(e.rows, heads // e.rows, dim).mean(dim=1)
        store.prune(channels.keep(channels.scores(query_energy, key_energy)))
        self.window_queries = None
        if self.policy.feature_names:  # features of the held keys, as they are now kept
            rows, slots = e.occupied[layer, :, :n].nonzero(as_tuple=True)
            self._unfeatured.append((rows, slots))
            self.write_features()

    def narrow_queries(self, query: torch.Tensor) -> torch.Tensor:
        """The step's queries [B, heads, q, D] on their KV head's kept key channels [B, heads, q, kept]."""
        kept = self.store.channels
        assert kept is not None, "queries are narrowed to a pruned store's channels"
        lanes = self.current.step.lanes
        b, hq, q, _ = query.shape
        h = self.entries.heads
        at = kept[lanes.start * h : lanes.stop * h].to(torch.long).view(b, h, 1, 1, -1)
        narrowed = query.view(b, h, hq // h, q, -1).gather(-1, at.expand(-1, -1, hq // h, q, -1))
        return narrowed.view(b, hq, q, -1)

    def _wrapped(self, w: int) -> list[int]:
        """Rows (counted from the step's first) whose query-log ring wraps with this decode step."""
        h = self.entries.heads
        positions = self.current.step.positions
        return [s * h + i for s, p in enumerate(positions) if p[0] % w == w - 1 for i in range(h)]

    def _reindexed_positions(self, n: int) -> torch.Tensor:
        """Under reindex, where each slot's key sits: the row's entries, in order, end just before its new ones."""
        e, feeding = self.entries, self.current
        layer, lanes = self.layer_idx, feeding.step.lanes
        assert feeding.lengths_before is not None, "the cache keeps the lengths before the step under reindex"
        rr = e.row_range(lanes.start, lanes.stop)
        order = e.order[layer, rr, :n]
        r = order.shape[0]
        held = torch.arange(n, device=order.device) < e.lengths[layer, rr].unsqueeze(1)
        rank = torch.zeros(r, n + 1, dtype=torch.long, device=order.device)
        rank.scatter_(1, torch.where(held, order, n), torch.arange(n, device=order.device).expand(r, -1))
        rank = rank[:, :n]
        start = feeding.model_positions[:, :1].repeat_interleave(e.heads, dim=0) - feeding.lengths_before[
            layer
        ].unsqueeze(1)
        return start + rank
