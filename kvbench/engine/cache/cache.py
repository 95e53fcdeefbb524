"""The transformers ``Cache`` face of the ragged layout: one ``CacheLayer`` per decoder layer, one ``Entries``.

A step feeds the same number of tokens to a range of sequence slots ``lo:hi`` (one sequence's prompt chunk, or one
decode token for each of several sequences). ``begin_step`` sets their positions; each layer's ``update`` writes
its new entries and returns the step's keys and values, [slots, heads, n, D]; the attention function reads what
each key's visibility is (``CacheLayer.visible``) and hands its statistics back (``after_attention``); once every
layer has attended, ``end_step`` evicts (a layer's cache is not read again before the next step).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, cast

import torch
from transformers.cache_utils import Cache

from kvbench.engine.cache import schedule
from kvbench.engine.cache.entries import STAT_NAMES, Entries
from kvbench.engine.cache.layer import CacheLayer
from kvbench.engine.cache.store import KVStore
from kvbench.engine.plan import LayerPlan
from kvbench.engine.step import Step
from kvbench.policies.base import Policy
from kvbench.policies.positions import Rotary, layer_rotaries
from kvbench.policies.state import TokenState
from kvbench.policies.statistics import STATISTICS


@dataclass
class CacheStats:
    kept_per_layer: list[float] = field(default_factory=list)
    resident_bytes: int = 0
    capacity_bytes: int = 0
    resident_per_layer: list[int] = field(default_factory=list)


class KVCache(Cache):
    """Rows for ``slots`` sequences. ``plan_sets``: the layer plans of every sequence it will hold (capacities are
    the largest they need in ``role``: "prefill" for the prompt, "decode" for generating, "both"). ``model`` is
    needed only for ``positions: reindex`` (its rotary embedding)."""

    def __init__(
        self,
        plan_sets: list[list[LayerPlan]],
        policy: Policy,
        lanes: int = 1,
        role: str = "both",
        seed: int = 0,
        device: torch.device | str = "cpu",
        model: Any = None,
    ):
        self.policy, self.slots, self.role, self.seed = policy, lanes, role, seed
        self.device = torch.device(device)
        plans = plan_sets[0]
        self.plan_sets = plan_sets
        self.rotaries: list[Rotary] | None = None
        if policy.positions == "reindex":
            if model is None:
                raise ValueError("positions=reindex needs the model (its rotary embedding) to build the cache")
            self.rotaries = layer_rotaries(model)
        rotaries: list[Rotary | None] = list(self.rotaries) if self.rotaries else [None] * len(plans)
        super().__init__(
            layers=[CacheLayer(self, i, plan, rotary) for i, (plan, rotary) in enumerate(zip(plans, rotaries))]
        )
        self.budgets: list[list[int | None]] = [[None] * lanes for _ in plans]
        self.entries: Entries | None = None
        self.lo = self.hi = 0
        self.evicting, self.collecting, self.phase = False, True, "prefill"
        self._pending: torch.Tensor | None = None
        self._cache: dict[Any, torch.Tensor] = {}
        self.hidden: list[torch.Tensor] | None = None  # per layer, what masked replay lets each row see
        self.seen = [0] * lanes  # per lane, tokens fed so far

    @property
    def kv_layers(self) -> list[CacheLayer]:
        """The decoder layers, as built here (transformers types ``layers`` as any of its own layer kinds)."""
        return cast("list[CacheLayer]", self.layers)

    @property
    def allocated(self) -> Entries:
        """The entries; they exist from the first layer's write on, once the shapes are known (``allocate``)."""
        assert self.entries is not None, "the cache allocates its entries on its first write"
        return self.entries

    # -- allocation --------------------------------------------------------------------------------------
    def _capacity(self, layer: int, heads: int) -> int:
        return max(plans[layer].rows_capacity(heads, self.role, self.policy_of(layer)) for plans in self.plan_sets)

    def policy_of(self, layer: int) -> Policy:
        return self.kv_layers[layer].policy

    def allocate(self, heads: int, k_dim: int, v_dim: int, dtype: torch.dtype) -> None:
        """Buffers for every layer, from the shapes of one layer's keys and values."""
        caps = [self._capacity(l, heads) for l in range(len(self.layers))]
        columns = sorted(
            {n for l in range(len(self.layers)) for n in self.policy_of(l).needs if n in STAT_NAMES}
            | {n for l in range(len(self.layers)) for n in self.policy_of(l).feature_names}
        )
        history = max(self.policy_of(l).history for l in range(len(self.layers)))
        self.entries = Entries(len(self.layers), self.slots, heads, max(caps), columns, history, self.device)
        self.shapes = (heads, k_dim, v_dim, dtype)
        for layer, cap in zip(self.kv_layers, caps):
            layer.attach(KVStore(self.slots * heads, cap, k_dim, v_dim, dtype, self.device, layer.policy.quantize))
        e = self.entries
        head = torch.arange(e.layers * e.rows, device=self.device)
        self.row_keys = (head // e.rows) * heads + head % heads

    def assign(self, slot: int, plans: list[LayerPlan]) -> None:
        """Slot ``slot`` now holds a sequence with these plans (its budgets)."""
        for l, plan in enumerate(plans):
            self.budgets[l][slot] = plan.budget

    # -- a step --------------------------------------------------------------------------------------------
    def begin(self, step: Step) -> torch.Tensor:
        """Start ``step``. Returns the positions to feed the model [lanes, q]: the step's own, or under
        ``positions: reindex`` each sequence's next contiguous positions after what it holds."""
        lo, hi, positions = step.lanes.start, step.lanes.stop, step.positions
        self.lo, self.hi = lo, hi
        self.evicting, self.collecting, self.phase = step.evicts, step.collects, step.phase
        self.hidden = step.replay_masks
        self.host_positions = positions
        for s, p in zip(range(lo, hi), positions):
            self.seen[s] = p[-1] + 1
        pos = torch.tensor(positions, dtype=torch.long, device=self.device)
        self._pending = pos
        self.query_positions = pos.repeat_interleave(self.shapes[0] if self.entries else 1, dim=0)
        self.step_model_positions = pos
        if self.rotaries is not None:
            held = [0] * (hi - lo)
            if self.entries is not None:
                e = self.entries
                lengths = e.lengths[:, e.row_range(lo, hi)].view(e.layers, hi - lo, e.heads)
                held = lengths.amax(dim=(0, 2)).tolist()
            q = len(positions[0])
            self.step_model_positions = torch.tensor([[h + i for i in range(q)] for h in held], device=self.device)
        return self.step_model_positions

    def _rows(self, lo: int, hi: int) -> torch.Tensor:
        key = ("rows", lo, hi)
        if key not in self._cache:
            h = self.allocated.heads
            self._cache[key] = torch.arange(lo * h, hi * h, device=self.device)
        return self._cache[key]

    def write(self, l: int, key_states: torch.Tensor, value_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``l``'s new entries; returns the step's keys and values [slots, heads, n, D]."""
        b, h, q, _ = key_states.shape
        if self.entries is None:
            self.allocate(h, key_states.shape[-1], value_states.shape[-1], key_states.dtype)
            assert self._pending is not None, "a step's first layer writes the positions begin_step set"
            self.query_positions = self._pending.repeat_interleave(h, dim=0)
        if (h, key_states.shape[-1], value_states.shape[-1]) != self.shapes[:3]:
            raise ValueError(
                f"layer {l} has {h} KV heads of {key_states.shape[-1]} dims, unlike layer 0: kvbench's "
                "cache needs every layer alike"
            )
        e, layer = self.allocated, self.kv_layers[l]
        if self._pending is not None:
            self.lengths_before = e.lengths[:, e.row_range(self.lo, self.hi)].clone() if self.rotaries else None
            self.slots_new, self.spans, self.dense = e.insert(self.lo, self.hi, self._pending)
            self._pending = None
        rows = self._rows(self.lo, self.hi)
        slots = self.slots_new[l]
        stored = key_states
        if layer.rotary is not None:
            stored = layer.rotary.unrotate(key_states, self.step_model_positions.unsqueeze(1))
        layer.store.write(rows, slots, stored.reshape(b * h, q, -1), value_states.reshape(b * h, q, -1))
        if layer.policy.feature_names:
            self.write_features(l, rows.repeat_interleave(q), slots.reshape(-1))
        n = self.spans[l]
        keys, values = layer.store.read(self.lo * h, self.hi * h, n)
        rr = e.row_range(self.lo, self.hi)
        past = n if q == 1 else n - q
        visible = None if self.dense[l] else e.occupied[l, rr, :past]
        hidden = None if self.hidden is None else self.hidden[l]
        if hidden is not None:
            by_slot = hidden.gather(1, e.positions[l, rr, :past].clamp_min(0))
            visible = by_slot & e.occupied[l, rr, :past]
        layer.begin_step(n, past, visible, e.positions[l, rr, :n])
        if layer.rotary is not None:
            keys = layer.rotary.rotate(keys, self.reindexed_positions(l, n))
        return keys.view(b, h, n, -1), values.view(b, h, n, -1)

    def reindexed_positions(self, l: int, n: int) -> torch.Tensor:
        """Under reindex, where each slot's key sits: the row's entries, in order, end just before its new ones."""
        e = self.allocated
        assert self.lengths_before is not None, "write keeps the lengths before the step under reindex"
        rr = e.row_range(self.lo, self.hi)
        order = e.order[l, rr, :n]
        r = order.shape[0]
        held = torch.arange(n, device=self.device) < e.lengths[l, rr].unsqueeze(1)
        rank = torch.zeros(r, n + 1, dtype=torch.long, device=self.device)
        rank.scatter_(1, torch.where(held, order, n), torch.arange(n, device=self.device).expand(r, -1))
        rank = rank[:, :n]
        start = self.step_model_positions[:, :1].repeat_interleave(e.heads, dim=0) - self.lengths_before[l].unsqueeze(1)
        return start + rank

    def write_features(self, l: int, rows: torch.Tensor, slots: torch.Tensor) -> None:
        """Write-time features (e.g. value norms) of layer ``l``'s entries at (``rows`` [m], ``slots`` [m]), from
        them as stored."""
        layer = self.kv_layers[l]
        keys, values = layer.store.gather(rows, slots.unsqueeze(1))
        for name, value in layer.policy.features(keys, values).items():
            self.allocated.write_column(name, l, rows, slots, value)

    def after_attention(self, l: int, q: int, stats: dict[str, torch.Tensor]) -> None:
        """Fold the layer's statistics over its step keys (slots ``0:n``) into its rows."""
        if not stats:
            return
        e, layer = self.allocated, self.kv_layers[l]
        rr = e.row_range(self.lo, self.hi)
        for name, value in stats.items():
            if name in e.columns:
                assert e.table is not None, "entries with columns keep a table"
                column = e.table[l, rr, : value.shape[-1], e.columns.index(name)]
                if STATISTICS[name].fold == "replace":
                    column.copy_(value)
                else:
                    column += value
        if e.log is not None and "qlog" in stats:
            logged = layer.policy.score.log_rows(stats["qlog"], stats["qlog_nvis"])
            w = e.log.history
            flat = slice(l * e.rows + rr.start, l * e.rows + rr.stop)
            if q == 1:
                e.log.append(flat, logged, stats["qlog_nvis"], self.query_positions[:, 0] % w, self._wrapped(w))
            else:
                k = logged.shape[1]
                places = [p % w for p in self.host_positions[0][-k:]]
                e.log.append(flat, logged, stats["qlog_nvis"], places, [])

    def _wrapped(self, w: int) -> list[int]:
        h = self.allocated.heads
        return [s * h + i for s, p in enumerate(self.host_positions) if p[0] % w == w - 1 for i in range(h)]

    def finish(self, step: Step) -> None:
        """Evict every row over its budget and trim sliding layers to their window (``schedule``)."""
        schedule.end_step(self)
        self.hidden = None

    def layer_state(self, l: int, slot: int = 0) -> TokenState:
        """What layer ``l`` of the sequence in ``slot`` holds, as its policy ranks it."""
        return schedule.layer_state(self, l, slot)

    # -- slots -----------------------------------------------------------------------------------------------
    def copy_lane(self, source: KVCache, src: int, dst: int) -> None:
        """Slot ``src`` of ``source`` (this cache or a prompt's) becomes slot ``dst`` here."""
        if self.entries is None:
            self.allocate(*source.shapes)
        mine_e, theirs_e = self.allocated, source.allocated
        mine_e.copy_slot(theirs_e, src, dst)
        for mine, theirs, n in zip(self.kv_layers, source.kv_layers, theirs_e.spans):
            if n > mine.store.capacity:
                raise RuntimeError(
                    f"layer {mine.layer_idx}: a sequence using {n} slots does not fit rows of "
                    f"capacity {mine.store.capacity}"
                )
            mine.store.copy_rows(theirs.store, theirs_e.row_range(src, src + 1), mine_e.row_range(dst, dst + 1), n)
        for l in range(len(self.layers)):
            self.budgets[l][dst] = source.budgets[l][src]
        self.seen[dst] = source.seen[src]

    def summary(self, slot: int = 0) -> CacheStats:
        if self.entries is None:
            return CacheStats([0.0] * len(self.layers), 0, 0, [0] * len(self.layers))
        e = self.entries
        counts = e.lengths[:, e.row_range(slot, slot + 1)].sum(dim=1).tolist()
        resident = [c * layer.store.row_bytes() for c, layer in zip(counts, self.kv_layers)]
        return CacheStats(
            kept_per_layer=[c / e.heads for c in counts],
            resident_bytes=sum(resident),
            capacity_bytes=sum(layer.store.capacity_bytes() for layer in self.kv_layers) // self.slots,
            resident_per_layer=resident,
        )

    def resident_by_lane(self, lanes: range) -> list[int]:
        """Resident bytes of each of the lanes."""
        lo, hi = lanes.start, lanes.stop
        e = self.allocated
        counts = e.lengths[:, e.row_range(lo, hi)].view(e.layers, hi - lo, e.heads).sum(dim=2)
        row_bytes = torch.tensor([layer.store.row_bytes() for layer in self.kv_layers], device=self.device)
        return (counts * row_bytes.unsqueeze(1)).sum(dim=0).tolist()

    def kept_positions(self, slot: int = 0) -> list[torch.Tensor]:
        """Per layer, the absolute positions each KV head of the slot holds, [heads, kept]."""
        e = self.allocated
        return [e.kept_positions(l, slot) for l in range(len(self.layers))]
