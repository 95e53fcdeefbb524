"""A transformers ``Cache`` whose layers hold pre-allocated K/V buffers and evict through a policy.

Each layer keeps, per KV head, the absolute position of every kept token and the per-token
statistics its policy asked for. Eviction gathers the kept rows to the front of the same buffers,
so memory never grows past the capacity fixed before the run.

Two layer layouts:

- ``BudgetedLayer`` (uniform allocation): buffers [1, H, capacity, D]; every head holds the same count.
- ``PooledLayer`` (per-head allocation, Ada-KV): heads hold different counts, so the layer stores one flat
  pool of rows [1, 1, H × capacity, D], each row one (head, token) entry tagged with its head. Only kept
  entries are stored (no padding): resident bytes are rows × bytes per row, exactly what the tensors hold,
  and the pool's capacity equals the uniform layout's (the layer total never exceeds H × budget). A decode
  step's attention reads the pool where it lies, each head masked to its own rows (``owner_bias``); a
  prompt chunk's gathers a padded [1, H, longest head + new, D] view whose padding is masked out
  (``visible_past``), transient compute workspace freed after the layer's attention, not cache memory.

Layers wait for the step's last layer and are evicted together (one scoring, one ranking, one set of writes
instead of one per layer; a layer's cache is not read again before the next step):

- ``LayerStack``: ``BudgetedLayer`` buffers are slices of one stack [1, layers × H, capacity, D] when every layer
  has the same plan. Under different layer budgets (PyramidKV) each layer keeps its own K/V and only the
  bookkeeping is stacked, at the largest layer's capacity; rows are then ranked padded to the longest, in the
  steps where every layer evicts one entry per head (decode).
- ``PoolStack``: the bookkeeping of ``PooledLayer`` s (Ada-KV) in one set of buffers; ``evict_pools`` scores
  their heads' lists as one padded state in decode steps.

Both store K/V through ``KVStore``: the model's dtype, or int8/fp8 codes with float32 per-entry scales
(``policy.quantize``); resident bytes count the codes and the scales.

Everything else a layer knows per entry (statistics, write-time features) lives in one float32 *token
table* [G, rows, columns], so adding a token zeroes one slice and compaction moves one block of rows,
whatever the policy reads. The query log (``QueryLog``) is the exception: it is indexed by a slot each
entry keeps while held, so that compaction moves only the slot ids, not ``history`` values per entry.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from kvbench.engine.visibility import Window
from kvbench.engine.query_log import QueryLog
from kvbench.policies.base import Policy
from kvbench.policies.state import Stats, TokenState
from kvbench.policies.merge import merge_evicted
from kvbench.policies.positions import Rotary, layer_rotaries
from kvbench.policies.quantize import Quantizer

# Per-token statistics a layer accumulates; each is a column of the token table, seen as [kv_heads, capacity]
# ("mass": attention mass merged into an entry). Scores reading a query log also get ``qlog`` [kv_heads,
# history, held] (the most recent queries' rows, as the score logs them), its sum ``qlog_sum`` and
# ``qlog_nvis`` [kv_heads, history]. ``count`` (queries that saw an entry) is not stored: every query fed
# after an entry sees it, so it is the number of tokens fed minus the entry's position.
STAT_NAMES = ("acc", "sumsq", "last", "mass")
# Most bytes a compaction copies at once (see compact_rows).
COMPACT_BLOCK_BYTES = 1 << 23


@dataclass
class LayerPlan:
    """What one layer may hold: its token budget in the policy's evicting steps (None = the policy never evicts
    here) and its buffer capacity. A sliding-window layer (``window``) also drops, after every step, what its
    next query cannot see: each head keeps at most its newest ``window - 1`` entries (``hold``), which is exact.
    ``policy`` replaces the cache's policy in this layer (a sliding layer that only holds its window)."""

    budget: int | None
    capacity: int
    window: int | None = None
    policy: Policy | None = None

    @property
    def hold(self) -> int | None:
        return None if self.window is None else self.window - 1


class KVStore:
    """Pre-allocated K/V rows [1, G, capacity, D]: plain (model dtype) or quantised (codes + scales)."""

    def __init__(self, groups: int, capacity: int, k_dim: int, v_dim: int, dtype: torch.dtype,
                 device: torch.device, quantizer: Quantizer | None):
        self.quantizer, self.dtype = quantizer, dtype
        store = dtype if quantizer is None else quantizer.storage_dtype
        self.k = torch.zeros(1, groups, capacity, k_dim, dtype=store, device=device)
        self.v = torch.zeros(1, groups, capacity, v_dim, dtype=store, device=device)
        self.k_scale = self.v_scale = None
        if quantizer is not None:
            self.k_scale = torch.zeros(1, groups, capacity, 1, dtype=torch.float32, device=device)
            self.v_scale = torch.zeros(1, groups, capacity, 1, dtype=torch.float32, device=device)

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.k, self.v, self.k_scale, self.v_scale) if t is not None]

    def groups(self, lo: int, hi: int) -> "KVStore":
        """Groups ``lo:hi`` as a store of their own, sharing these buffers."""
        part = copy.copy(self)
        part.k, part.v = self.k[:, lo:hi], self.v[:, lo:hi]
        if self.quantizer is not None:
            part.k_scale, part.v_scale = self.k_scale[:, lo:hi], self.v_scale[:, lo:hi]
        return part

    def write(self, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Rows ``start ...`` of every group: k [G, q, D]."""
        end = start + k.shape[1]
        if self.quantizer is None:
            self.k[0, :, start:end] = k
            self.v[0, :, start:end] = v
            return
        for codes, scales, x in ((self.k, self.k_scale, k), (self.v, self.v_scale, v)):
            c, s = self.quantizer.quantize(x)
            codes[0, :, start:end] = c
            scales[0, :, start:end] = s

    def write_rows(self, rows: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Rows ``rows`` (long [n]) of a single-group store: k [n, D]."""
        if self.quantizer is None:
            self.k[0, 0].index_copy_(0, rows, k)
            self.v[0, 0].index_copy_(0, rows, v)
            return
        for codes, scales, x in ((self.k, self.k_scale, k), (self.v, self.v_scale, v)):
            c, s = self.quantizer.quantize(x)
            codes[0, 0].index_copy_(0, rows, c)
            scales[0, 0].index_copy_(0, rows, s)

    def _decode(self, codes: torch.Tensor, scales: torch.Tensor | None) -> torch.Tensor:
        return codes if self.quantizer is None else self.quantizer.dequantize(codes, scales, self.dtype)

    def read(self, end: int, start: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows ``start:end`` of every group, [G, end - start, D] (views of the buffers when plain)."""
        ks = None if self.k_scale is None else self.k_scale[0, :, start:end]
        vs = None if self.v_scale is None else self.v_scale[0, :, start:end]
        return self._decode(self.k[0, :, start:end], ks), self._decode(self.v[0, :, start:end], vs)

    def gather(self, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows ``idx`` (any shape) of a single-group store, [*idx.shape, D]."""
        flat = idx.reshape(-1)

        def take(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t[0, 0].index_select(0, flat).view(*idx.shape, t.shape[-1])

        return (self._decode(take(self.k), take(self.k_scale)), self._decode(take(self.v), take(self.v_scale)))

    def flat_rows(self, keep: torch.Tensor) -> torch.Tensor:
        """Rows ``keep`` [G, k] of every group as indices into the flattened [G * capacity] rows."""
        return flat_rows(keep, self.k.shape[2])

    def compact(self, rows: torch.Tensor, groups: int) -> None:
        """Move ``rows`` (``flat_rows``) to the front of every group, in place."""
        for t in self.tensors():
            compact_rows(t[0], rows, groups)

    def row_bytes(self) -> int:
        """Bytes one row (one token of one group) holds: K and V, plus their scales when quantised."""
        return sum(t.shape[-1] * t.element_size() for t in self.tensors())

    def capacity_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())


def flat_rows(keep: torch.Tensor, capacity: int) -> torch.Tensor:
    """Entries ``keep`` [G, k] of buffers [G, capacity, ...] as indices into their flattened [G * capacity] rows."""
    return (keep + torch.arange(keep.shape[0], device=keep.device).unsqueeze(1) * capacity).reshape(-1)


def compact_rows(t: torch.Tensor, rows: torch.Tensor, groups: int) -> None:
    """t [G, capacity, X] (contiguous): move ``rows`` of the flattened [G * capacity, X] view to the front of
    every group, ``len(rows) / G`` each, in place. A row copy per kept token: several times faster than a
    ``gather`` with an index expanded over X. The rows go through a copy of at most ``COMPACT_BLOCK_BYTES``
    at a time (a stack of every layer's buffers would otherwise need one as large as the cache)."""
    k, width = rows.shape[0] // groups, t.shape[-1]
    flat = t.reshape(-1, width)
    block = max(1, COMPACT_BLOCK_BYTES // max(1, k * width * t.element_size()))
    for lo in range(0, groups, block):
        hi = min(groups, lo + block)
        t[lo:hi, :k] = flat.index_select(0, rows[lo * k : hi * k]).view(hi - lo, k, width)


def entry_buffers(policy: Policy, groups: int, rows: int, kv_heads: int, device: torch.device
                ) -> tuple[torch.Tensor, torch.Tensor | None, dict[str, torch.Tensor], QueryLog | None]:
    """What ``groups`` × ``rows`` entries carry beside K/V: positions, the token table (and its columns by name) and
    the query log with ``kv_heads`` rows of visibility counts."""
    positions = torch.zeros(groups, rows, dtype=torch.long, device=device)
    columns = sorted(n for n in policy.needs if n in STAT_NAMES) + sorted(policy.feature_names)
    table = torch.zeros(groups, rows, len(columns), dtype=torch.float32, device=device) if columns else None
    stats = {name: table[:, :, i] for i, name in enumerate(columns)}
    log = QueryLog(groups, rows, policy.history, kv_heads, device) if "qlog" in policy.needs and policy.history else None
    return positions, table, stats, log


class _LayerBase(CacheLayerMixin):
    is_compileable = False
    is_sliding = False

    def __init__(self, layer_idx: int, plan: LayerPlan, policy: Policy, cache: "BudgetedCache"):
        super().__init__()
        self.layer_idx = layer_idx
        self.plan = plan
        self.policy = plan.policy or policy
        self.cache = cache
        # Under positions=reindex: this layer's RoPE (layers may differ: Gemma 3's local and global bases).
        self.rotary: Rotary | None = None
        if cache.rotaries is not None and cache.rotaries[layer_idx].rot_dim > 0:
            self.rotary = cache.rotaries[layer_idx]
        self.positions: torch.Tensor | None = None
        self.table: torch.Tensor | None = None
        self.stats: dict[str, torch.Tensor] = {}
        self.log: QueryLog | None = None
        # Which past entries the next step may see ([kv_heads, past] bool; None = all): masked replay, and
        # the padding of a PooledLayer's per-step view.
        self.visible_past: torch.Tensor | None = None
        # When the step's keys are a PooledLayer's whole pool rather than a per-head view: per KV head and pool
        # row, 0 where the head holds the row and -inf elsewhere ([kv_heads, rows], added to the logits).
        self.pool_bias: torch.Tensor | None = None

    def get_max_length(self) -> int:
        return self.plan.capacity

    def step_window(self, size: int | None) -> Window | None:
        """The step's sliding window over its keys (``step_keys``: their positions), or None where every key is
        inside it (a trimmed layer's decode step)."""
        if size is None:
            return None
        keys, queries = self.step_keys, self.cache.step_positions
        if int(queries[-1]) - int(keys.min()) < size:
            return None
        return Window(size, keys, queries)

    def window_state(self) -> dict[str, Any]:
        """What a state needs to rank entries the next query cannot see last (see ``Policy.scored``)."""
        return {"window": self.plan.window, "seen": self.cache.seen}

    def _init_store(self, key_states: torch.Tensor, value_states: torch.Tensor, groups: int, rows: int,
                    kv_heads: int | None = None, kv: bool = True, bookkeeping: bool = True) -> None:
        """Buffers of ``groups`` × ``rows`` entries shaped like ``key_states`` / ``value_states`` [1, H, q, D];
        ``kv_heads`` (default H) rows of query-log visibility counts. ``kv=False``: the per-entry bookkeeping
        only, no K/V store; ``bookkeeping=False``: the K/V store only (a stack holds the rest)."""
        if key_states.shape[0] != 1:
            raise ValueError("BudgetedCache runs one sequence at a time (batch size 1)")
        self.device, self.dtype = key_states.device, key_states.dtype
        if kv:
            self._init_kv(key_states, value_states, groups, rows)
        self.is_initialized = True
        if not bookkeeping:
            return
        self.positions, self.table, self.stats, self.log = entry_buffers(self.policy, groups, rows,
                                                                       kv_heads or key_states.shape[1], self.device)

    def _init_kv(self, key_states: torch.Tensor, value_states: torch.Tensor, groups: int, rows: int) -> None:
        self.store = KVStore(groups, rows, key_states.shape[-1], value_states.shape[-1], key_states.dtype,
                             self.device, self.policy.quantize)
        self.keys, self.values = self.store.k, self.store.v

    def _logged(self, stats: dict[str, torch.Tensor]) -> torch.Tensor:
        """The step's query-log rows as the score keeps them (e.g. ScissorHands' hit indicators)."""
        return self.policy.score.log_rows(stats["qlog"], stats["qlog_nvis"])

    def _derived_stats(self, positions: torch.Tensor) -> dict[str, torch.Tensor]:
        """``count``: every query fed after an entry saw it (the step's own queries included)."""
        if "count" not in self.policy.needs:
            return {}
        return {"count": (self.cache.seen - positions).to(torch.float32)}

    def _stored_keys(self, key_states: torch.Tensor) -> torch.Tensor:
        """What is written: the keys as rotated by the model, or un-rotated under positions=reindex."""
        if self.rotary is None:
            return key_states
        return self.rotary.unrotate(key_states, self.cache.step_model_positions.view(1, -1))

    def _merge_inputs(self, state: TokenState) -> torch.Tensor:
        weights = state.stats["acc"]
        return weights + state.stats["mass"] if "mass" in state.stats else weights


class BudgetedLayer(_LayerBase):
    """Uniform allocation: buffers [1, kv_heads, capacity, D], every head holding ``length`` tokens.

    With a query log, ``log_slot`` [kv_heads, capacity] is a permutation of the log's slots: entry j of head h
    owns slot ``log_slot[h, j]`` for j < ``length``, the rest are free. Compaction permutes it (kept entries
    first, the evicted ones' slots freed behind them)."""

    # How many decoder layers' heads the rows hold (see LayerStack).
    stacked_layers = 1

    def __init__(self, layer_idx: int, plan: LayerPlan, policy: Policy, cache: "BudgetedCache"):
        super().__init__(layer_idx, plan, policy, cache)
        self.length = 0
        self.log_slot: torch.Tensor | None = None

    # -- transformers' layer contract ------------------------------------------------------
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        stack = self.cache.stack
        if stack is not None:
            if stack.adopt(self, key_states, value_states):
                return
            self.cache.unstack()
        self._init_store(key_states, value_states, key_states.shape[1], self.plan.capacity)
        if self.log is not None:
            self.log_slot = torch.arange(self.plan.capacity, device=self.device).repeat(key_states.shape[1], 1)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n = key_states.shape[-2]
        end = self.length + n
        if end > self.plan.capacity:
            raise RuntimeError(
                f"layer {self.layer_idx}: {end} tokens exceed the pre-allocated capacity {self.plan.capacity}"
            )
        self.store.write(self.length, self._stored_keys(key_states)[0], value_states[0])
        self.positions[:, self.length : end] = self.cache.step_positions
        if self.table is not None:
            self.table[:, self.length : end] = 0.0
            self._write_features(self.length, end)
        if self.log is not None:
            self.log.clear(self.log_slot[:, self.length : end])
        self.step_keys = self.positions[:, :end]
        keys, values = self.store.read(end)
        if self.rotary is not None:  # contiguous run ending at the step's last fed position
            start = int(self.cache.step_model_positions[0]) - self.length
            keys = self.rotary.rotate(keys, torch.arange(start, start + end, device=self.device).view(1, -1))
        return keys.unsqueeze(0), values.unsqueeze(0)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0

    def get_seq_length(self) -> int:
        return self.length

    def reset(self) -> None:
        self.length = 0
        if self.log is not None:
            self.log.reset()

    # -- kvbench's own steps -----------------------------------------------------------------
    def max_head_length(self) -> int:
        return self.length

    def _write_features(self, start: int, end: int) -> None:
        """Write-time features (e.g. value norms) of rows ``start:end``, from the entries as stored."""
        if self.policy.feature_names:
            keys, values = self.store.read(end, start)
            for name, value in self.policy.features(keys, values).items():
                self.stats[name][:, start:end] = value

    def observe(self, n_new: int, stats: dict[str, torch.Tensor]) -> None:
        """Fold this step's attention statistics in and count the new tokens as held."""
        total = self.length + n_new
        for name, value in stats.items():
            if name == "last":
                self.stats["last"][:, :total] = value
            elif name in self.stats:
                self.stats[name][:, :total] += value
        if self.log is not None and "qlog" in stats:
            self.log.append(self._logged(stats), stats["qlog_nvis"], self.log_slot[:, :total])
        self.length = total

    def state(self) -> TokenState:
        n = self.length
        positions = self.positions[:, :n]
        eager = {k: v[:, :n] for k, v in self.stats.items()} | self._derived_stats(positions)
        lazy, derived = {}, {}
        if self.log is not None:
            slots = self.log_slot[:, :n]
            eager["qlog_nvis"] = self.log.nvis
            lazy["qlog"] = lambda: self.log.gathered(slots)
            derived["qlog_sum"] = self.log.sums(slots)
        return TokenState(
            positions=positions,
            stats=Stats(eager, lazy),
            layer_idx=self.layer_idx,
            generator=self.cache.generator,
            phase=self.cache.phase,
            load_kv=lambda: self.store.read(n),
            derived=derived,
            layers=self.stacked_layers,
            **self.window_state(),
        )

    def evict_to_budget(self) -> None:
        budget = self.plan.budget
        if budget is None or self.length <= budget:
            return
        state = self.state()
        keep, evicted = self.policy.partition(state, budget)  # [kv_heads, budget] sorted, [kv_heads, rest]
        merged = None
        if self.policy.merge:
            mask = torch.zeros_like(state.positions, dtype=torch.bool).scatter_(1, keep, True)
            merged = merge_evicted(state.keys, state.values, self._merge_inputs(state), mask)
        self.compact(keep, evicted)
        if merged is not None:
            k_new, v_new, absorbed = merged
            idx = keep.unsqueeze(-1)
            self.store.write(0, k_new.gather(1, idx.expand(-1, -1, k_new.shape[-1])).to(self.dtype),
                             v_new.gather(1, idx.expand(-1, -1, v_new.shape[-1])).to(self.dtype))
            self.stats["mass"][:, : keep.shape[-1]] += absorbed.gather(1, keep)
            self._write_features(0, keep.shape[-1])

    def compact(self, keep: torch.Tensor, evicted: torch.Tensor) -> None:
        """Move the kept rows of every buffer to the front, in place; the evicted entries' log slots are freed."""
        groups, k = keep.shape
        rows = self.store.flat_rows(keep)
        self.store.compact(rows, groups)
        self.positions[:, :k] = self.positions.gather(1, keep)
        if self.table is not None:  # a view of a stack may be longer than the layer's own K/V
            capacity = self.table.shape[1]
            compact_rows(self.table, rows if capacity == self.store.k.shape[2] else flat_rows(keep, capacity), groups)
        if self.log_slot is not None:
            n = self.length
            self.log_slot[:, :n] = self.log_slot[:, :n].gather(1, torch.cat([keep, evicted], dim=1))
        self.length = k

    def trim_to_window(self) -> None:
        """A sliding layer keeps each head's newest ``hold`` entries (positions ascend along a row)."""
        hold, n = self.plan.hold, self.length
        if hold is None or n <= hold:
            return
        order = torch.arange(n, device=self.device)
        heads = self.positions.shape[0]
        self.compact(order[n - hold :].expand(heads, -1), order[: n - hold].expand(heads, -1))

    def kept_positions(self) -> torch.Tensor:
        return self.positions[:, : self.length].clone()

    def tokens_held(self) -> float:
        return float(self.length)

    def resident_bytes(self) -> int:
        if not self.is_initialized:
            return 0
        return self.length * self.store.k.shape[1] * self.store.row_bytes()

    def capacity_bytes(self) -> int:
        return self.store.capacity_bytes() if self.is_initialized else 0


class LayerStack(BudgetedLayer):
    """Every layer of a uniform cache at once: their per-entry buffers are slices of one set of buffers, layer l's
    heads being rows ``l·H : (l+1)·H``, so that one eviction (one scoring, one ranking, one compaction) serves all
    the layers of a step instead of one per layer. In eager mode a decode step's eviction is dozens of small ops,
    each paying a fixed dispatch cost; stacked, a model with L layers pays it once instead of L times.

    Layers of one plan share K/V as well. Layers of different budgets (PyramidKV) keep their own K/V, each of its
    own capacity; only the bookkeeping (positions, statistics, query log) is stacked, at the largest capacity, and
    rows of different lengths are ranked padded to the longest. They are evicted together in the steps where each
    of them evicts exactly one entry per head (every decode step once the budgets are full), where padding cannot
    change which entry is the least; the other steps (prompt chunks) evict layer by layer.

    Scores and scopes rank each row on its own (parts that mix the heads of a layer read
    ``TokenState.layers``), so the kept sets are those of evicting layer by layer. A layer can wait to be
    evicted until the step's last layer has attended: its cache is not read again before the next step."""

    def __init__(self, plans: list[LayerPlan], policy: Policy, cache: "BudgetedCache"):
        super().__init__(-1, LayerPlan(plans[0].budget, max(plan.capacity for plan in plans), plans[0].window),
                         policy, cache)
        self.plans = plans
        self.stacked_layers = len(plans)
        self.shares_kv = all(plan == plans[0] for plan in plans)
        self.layout: tuple | None = None
        self._rows: dict[tuple[int, ...], tuple[torch.Tensor, ...]] = {}

    def adopt(self, layer: BudgetedLayer, key_states: torch.Tensor, value_states: torch.Tensor) -> bool:
        """Make ``layer``'s buffers its slice of the stack's, allocating the stack for the first layer. False
        where its shapes differ from the first layer's: the layers then cannot share one eviction."""
        heads = key_states.shape[1]
        layout = (heads, key_states.shape[-1], value_states.shape[-1], key_states.dtype, key_states.device)
        if self.layout is None:
            self.layout = layout
            groups = heads * self.stacked_layers
            self._init_store(key_states, value_states, groups, self.plan.capacity, kv_heads=groups,
                             kv=self.shares_kv)
            if self.log is not None:
                self.log_slot = torch.arange(self.plan.capacity, device=self.device).repeat(groups, 1)
            if self.policy.needs_attention:
                self.step_rows = torch.zeros(groups, self.plan.capacity, device=self.device)
        elif layout != self.layout:
            return False
        lo, hi = layer.layer_idx * heads, (layer.layer_idx + 1) * heads
        layer.device, layer.dtype = self.device, self.dtype
        if self.shares_kv:
            layer.store = self.store.groups(lo, hi)
            layer.keys, layer.values = layer.store.k, layer.store.v
        else:
            layer._init_kv(key_states, value_states, heads, layer.plan.capacity)
        layer.positions = self.positions[lo:hi]
        if self.table is not None:
            layer.table = self.table[lo:hi]
            layer.stats = {name: layer.table[:, :, i] for i, name in enumerate(self.stats)}
        if self.log is not None:
            layer.log = self.log.groups(lo, hi)
            layer.log_slot = self.log_slot[lo:hi]
        layer.is_initialized = True
        return True

    def staged_row(self, layer_idx: int, n: int) -> torch.Tensor:
        """Where layer ``layer_idx``'s decode step leaves its attention row over its ``n`` entries."""
        heads = self.layout[0]
        return self.step_rows[layer_idx * heads : (layer_idx + 1) * heads, :n]

    def rows(self, lengths: tuple[int, ...]) -> tuple[torch.Tensor, ...]:
        """For layers holding ``lengths`` entries: per row its count (long [R, 1]) and as float, which of the
        longest layer's columns it holds ([R, longest]), the columns' indices, and where each row's K/V start
        in its layer's flattened rows ([R, 1]). Kept for the next step: in decode the counts repeat."""
        if lengths not in self._rows:
            heads = self.layout[0]
            held = torch.tensor(lengths, device=self.device).repeat_interleave(heads).unsqueeze(1)
            order = torch.arange(max(lengths), device=self.device)
            starts = torch.cat([torch.arange(heads, device=self.device) * plan.capacity for plan in self.plans])
            self._rows = {lengths: (held, held.to(torch.float32), order < held, order, starts.unsqueeze(1))}
        return self._rows[lengths]

    def fold_staged(self, layers: list[BudgetedLayer]) -> None:
        """Fold the step's staged rows (one decode query per layer, seeing every held entry) into every layer's
        statistics and query log at once, as each layer's ``observe`` would have. Past a shorter layer's entries
        the staged row holds nothing of that step; what it adds there lands on entries not held, which are
        cleared before they are handed out."""
        lengths = tuple(layer.length for layer in layers)  # the layers have counted the new token
        n = max(lengths)
        rows = self.step_rows[:, :n]
        if "acc" in self.stats:
            self.stats["acc"][:, :n] += rows
        if "sumsq" in self.stats:
            self.stats["sumsq"][:, :n] += rows.square()
        if "last" in self.stats:
            self.stats["last"][:, :n] = rows
        if self.log is not None:
            nvis = self.rows(lengths)[1]
            self.log.next = layers[0].log.next
            self.log.append(self.policy.score.log_rows(rows.unsqueeze(1), nvis), nvis, self.log_slot[:, :n])
            for layer in layers:
                layer.log.next = self.log.next

    def evict_layers(self, layers: list[BudgetedLayer]) -> None:
        """Evict every layer to its budget in one go: all at once when they share one plan (they hold the same
        count: they were fed the same tokens) or each evicts one entry per head; otherwise layer by layer."""
        if self.shares_kv:
            lengths = {layer.length for layer in layers}
            if len(lengths) != 1:
                raise RuntimeError(f"stacked layers hold different counts {sorted(lengths)}; they must be fed alike")
            self.length = lengths.pop()
            self.evict_to_budget()
            for layer in layers:
                layer.length = self.length
        elif all(layer.length == layer.plan.budget + 1 for layer in layers):
            self.evict_one_each(layers)
        else:
            for layer in layers:
                layer.evict_to_budget()

    def trim_layers(self, layers: list[BudgetedLayer]) -> None:
        """Every sliding layer to its window at once (they share one plan) or layer by layer."""
        if self.plan.hold is None or all(layer.length <= self.plan.hold for layer in layers):
            return
        if not self.shares_kv:
            for layer in layers:
                layer.trim_to_window()
            return
        self.length = layers[0].length
        self.trim_to_window()
        for layer in layers:
            layer.length = self.length

    def evict_one_each(self, layers: list[BudgetedLayer]) -> None:
        """Every head of every layer evicts its least entry. The rows are ranked padded to the longest, the padding
        scored +inf, so each row's least is the one it would have alone. The eviction moves the entries after it
        one place forward and its query-log slot behind them (a permutation of the columns, the identity past a
        row's own entries)."""
        lengths = tuple(layer.length for layer in layers)
        n = max(lengths)
        held, _, valid, order, starts = self.rows(lengths)
        state = self.padded_state(n, held, valid)
        # The scope shields alike at every layer's budget; padding scores +inf: never the least.
        scores = self.policy.scored(state, self.plan.budget, padding=float("inf"))
        evicted = scores.argmin(dim=-1, keepdim=True)
        source = torch.where(order == held - 1, evicted, order + (order >= evicted))
        source = torch.where(valid, source, order)
        self.positions[:, :n] = self.positions[:, :n].gather(1, source)
        if self.table is not None:
            compact_rows(self.table, flat_rows(source, self.plan.capacity), source.shape[0])
        if self.log_slot is not None:
            self.log_slot[:, :n] = self.log_slot[:, :n].gather(1, source)
        heads = self.layout[0]
        kv_rows = source + starts  # into each layer's own flattened K/V rows
        for l, layer in enumerate(layers):
            layer.store.compact(kv_rows[l * heads : (l + 1) * heads, : layer.plan.budget].reshape(-1), heads)
            layer.length = layer.plan.budget

    def padded_state(self, n: int, held: torch.Tensor, valid: torch.Tensor) -> TokenState:
        """The stacked rows as one state padded to ``n`` entries (``valid`` marks each row's own): padding reads
        as position 0 with every statistic exactly 0, as after the end of a layer's own state."""
        mask = valid.to(torch.float32)
        positions = self.positions[:, :n].masked_fill(~valid, 0)
        eager = {name: value[:, :n] * mask for name, value in self.stats.items()}
        eager |= {name: value * mask for name, value in self._derived_stats(positions).items()}
        lazy, derived = {}, {}
        if self.log is not None:
            slots = self.log_slot[:, :n]
            eager["qlog_nvis"] = self.log.nvis
            lazy["qlog"] = lambda: self.log.gathered(slots) * mask.unsqueeze(1)
            derived["qlog_sum"] = self.log.sums(slots) * mask
        return TokenState(positions=positions, stats=Stats(eager, lazy), layer_idx=self.layer_idx,
                          generator=self.cache.generator, phase=self.cache.phase, valid=valid, derived=derived,
                          lengths=held.squeeze(1), layers=self.stacked_layers, **self.window_state())


class PooledLayer(_LayerBase):
    """Per-head allocation: one pool of (head, token) rows; head h holds ``lengths[h]`` of them.

    ``head_rows`` [H, pool rows] lists each head's rows in sequence order, front-aligned (entry j of head h is
    row ``head_rows[h, j]`` for j < ``lengths[h]``; later slots are stale); new entries take rows from the
    ``free`` list and are appended to their head's list, evicted entries give their rows back. A decode step
    therefore rewrites only the rows of new entries and the small lists, never the held K/V, and sorts nothing;
    its attention reads the pool where it lies, each head masked to its own rows by ``owner_bias`` [H, pool
    rows] (0 where the head holds the row, -inf elsewhere, kept up to date as rows are taken and freed). Freed rows are
    taken again first, so the rows in use stay within a ``span`` little larger than the entries held; when
    an eviction leaves many holes (a prompt chunk's), the held entries are moved together once
    (``make_dense``). ``length`` is the mean count per head.
    """

    def __init__(self, layer_idx: int, plan: LayerPlan, policy: Policy, cache: "BudgetedCache"):
        super().__init__(layer_idx, plan, policy, cache)
        self.rows = 0
        self.heads = 0
        # Rows at or past ``span`` are free, in order at the tail of the free list; the ``holes`` free rows
        # below it come first in the list, so new entries fill holes before the span grows.
        self.span = 0
        self.holes = 0
        self.lengths: torch.Tensor | None = None
        self.longest = 0
        self.view_index: torch.Tensor | None = None
        self.owner_bias: torch.Tensor | None = None

    @property
    def length(self) -> float:
        return self.rows / self.heads if self.heads else 0.0

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.heads = key_states.shape[1]
        pool = self.heads * self.plan.capacity
        stack = self.cache.pools
        shared = stack is not None and stack.adopt(self, key_states, value_states)
        if stack is not None and not shared:
            self.cache.pools_apart()
        self._init_store(key_states, value_states, 1, pool, bookkeeping=not shared)
        if not shared:
            # A head may come to hold most of the pool (budgets move between heads), so each list spans it (and
            # one spare column, see evict_pools).
            self.head_rows = torch.zeros(self.heads, pool + 1, dtype=torch.long, device=self.device)
            self.owner_bias = torch.full((self.heads, pool), float("-inf"), device=self.device)
        self.lengths = torch.zeros(self.heads, dtype=torch.long, device=self.device)
        self.free = torch.arange(pool, device=self.device)
        self.head_ids = torch.arange(self.heads, device=self.device)
        # Column g of head_bias: what head h adds to the logit of a row held by head g.
        owns = self.head_ids.unsqueeze(1) == self.head_ids
        self.head_bias = torch.zeros(owns.shape, device=self.device).masked_fill_(~owns, float("-inf"))

    def index(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Per head, its rows in sequence order padded to the longest head: (rows [H, L], valid [H, L]). Padding
        reads row 0 (the lists' later slots hold stale rows, which may lie past the span)."""
        valid = torch.arange(self.longest, device=self.device).unsqueeze(0) < self.lengths.unsqueeze(1)
        rows = self.head_rows[:, : self.longest]
        return (rows if self.rows == self.heads * self.longest else rows.masked_fill(~valid, 0)), valid

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        h, q = key_states.shape[1], key_states.shape[2]
        if h * q > self.free.shape[0]:
            raise RuntimeError(
                f"layer {self.layer_idx}: {self.rows + h * q} rows exceed the pre-allocated pool {self.store.k.shape[2]}"
            )
        pool_step = q == 1 and self.rotary is None and self.visible_past is None
        if not pool_step:
            past_idx, past_valid = self.index()
            uneven = self.rows != h * self.longest
        taken, self.free = self.free[: h * q], self.free[h * q :]
        self.span += max(0, h * q - self.holes)
        self.holes = max(0, self.holes - h * q)
        new_rows = taken.view(h, q)
        stored = self._stored_keys(key_states)[0]
        self.store.write_rows(taken, stored.reshape(h * q, -1), value_states[0].reshape(h * q, -1))
        self.positions[0].index_copy_(0, taken, self.cache.step_positions.repeat(h) if q > 1
                                      else self.cache.step_positions.expand(h))
        self.owner_bias.index_copy_(1, taken, self.head_bias.repeat_interleave(q, dim=1) if q > 1 else self.head_bias)
        if self.table is not None:
            self.table[0].index_fill_(0, taken, 0.0)
            self._write_features(taken)
        if self.log is not None:
            self.log.clear(taken.unsqueeze(0))
        self.head_rows.scatter_(1, self.lengths.unsqueeze(1) + torch.arange(q, device=self.device), new_rows)
        lengths_before = self.lengths
        self.lengths = self.lengths + q
        self.longest += q
        self.rows += h * q
        if pool_step:
            # A decode step reads the pool as it lies, each head masked to its own rows: no per-head view.
            self.view_index = None
            self.pool_bias = self.owner_bias[:, : self.span]
            self.step_keys = self.positions[:, : self.span]
            keys, values = self.store.read(self.span)
            return keys.unsqueeze(0), values.unsqueeze(0)
        # The step's view: each head's past (padded to the longest head), then its new rows.
        self.view_index = torch.cat([past_idx, new_rows], dim=1)
        self.step_keys = self.positions[0][self.view_index]
        self.visible_past = past_valid if uneven else None
        keys, values = self.store.gather(self.view_index)
        if self.rotary is not None:
            p = int(self.cache.step_model_positions[0])
            cols = torch.arange(self.view_index.shape[1], device=self.device).unsqueeze(0)
            past = past_idx.shape[1]
            pos = torch.where(cols < past, p - lengths_before.unsqueeze(1) + cols, p + cols - past)
            keys = self.rotary.rotate(keys, pos)
        return keys.unsqueeze(0), values.unsqueeze(0)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.max_head_length() + query_length, 0

    def get_seq_length(self) -> int:
        return self.max_head_length()

    def reset(self) -> None:
        self.rows = 0
        self.longest = 0
        self.span = self.holes = 0
        if self.lengths is not None:
            self.lengths.zero_()
            self.free = torch.arange(self.store.k.shape[2], device=self.device)
            self.owner_bias.fill_(float("-inf"))
        if self.log is not None:
            self.log.reset()

    def max_head_length(self) -> int:
        return self.longest

    def _write_features(self, rows: torch.Tensor) -> None:
        """Write-time features (e.g. value norms) of pool ``rows``, from the entries as stored."""
        if self.policy.feature_names:
            keys, values = self.store.gather(rows.unsqueeze(0))
            for name, value in self.policy.features(keys, values).items():
                self.stats[name][0].index_copy_(0, rows, value[0])

    def observe(self, n_new: int, stats: dict[str, torch.Tensor]) -> None:
        """Stats arrive per head over the step's keys: the pool itself (a decode step: each row is non-zero only
        in its own head, so the sum over heads is the row's value) or the step's view [H, past + new], added to
        the pool rows the view was read from. Padding slots of the view point at some real row but carry exactly
        zero (their attention was masked out), so adding everything is exact; ``last`` is replaced by zeroing it
        first."""
        pooled = self.view_index is None
        rows = None if pooled else self.view_index.reshape(-1)
        for name, value in stats.items():
            if name in self.stats:
                column = self.stats[name][0]
                if pooled:
                    if name == "last":
                        column[: self.span] = value.sum(dim=0)
                    else:
                        column[: self.span] += value.sum(dim=0)
                    continue
                if name == "last":
                    column.zero_()
                column.index_add_(0, rows, value.reshape(-1))
        if self.log is not None and "qlog" in stats:
            logged = self._logged(stats)  # [H, r, entries of the step's keys]
            if pooled:  # the pool's rows in order: the log's slots 0..span-1
                self.log.append(logged.sum(dim=0, keepdim=True), stats["qlog_nvis"])
                return
            r = logged.shape[1]
            in_pool = logged.new_zeros(r, self.log.total.shape[1])
            in_pool.index_add_(1, rows, logged.permute(1, 0, 2).reshape(r, -1))
            self.log.append(in_pool.unsqueeze(0), stats["qlog_nvis"])

    def state(self) -> TokenState:
        idx, valid = self.index()
        self.state_index = idx
        mask = valid.to(torch.float32)
        positions = self.positions[0][idx].masked_fill(~valid, 0)
        eager = {name: value * mask for name, value in self._derived_stats(positions).items()}
        lazy, derived = {}, {}
        if self.table is not None:
            columns = len(self.stats)
            if columns:
                rows = self.table[0, :, :columns][idx]  # [H, L, columns]: one gather of each held entry's row
                eager |= {name: rows[..., i] * mask for i, name in enumerate(self.stats)}
        if self.log is not None:
            # Scores read the log's sum over its rows; the whole log is gathered and masked only if one reads it.
            derived["qlog_sum"] = self.log.total[0][idx] * mask
            lazy["qlog"] = lambda: self.log.rows[0][:, idx].transpose(0, 1) * mask.unsqueeze(1)
            eager["qlog_nvis"] = self.log.nvis
        return TokenState(
            positions=positions,
            stats=Stats(eager, lazy),
            layer_idx=self.layer_idx,
            generator=self.cache.generator,
            phase=self.cache.phase,
            valid=None if self.rows == self.heads * self.longest else valid,
            load_kv=lambda: self.store.gather(idx),
            derived=derived,
            lengths=self.lengths,
            **self.window_state(),
        )

    def evict_to_budget(self) -> None:
        budget = self.plan.budget
        if budget is None or self.rows <= self.heads * budget:
            return
        state = self.state()
        idx = self.state_index
        keep = self.policy.keep_mask(state, budget)  # [H, L], per-head counts vary, layer total H × budget
        merged = None
        if self.policy.merge:
            merged = merge_evicted(state.keys, state.values, self._merge_inputs(state), keep, state.valid)
        kept_rows = self.retain(idx, state.valid_mask(), keep)
        if merged is not None:
            k_new, v_new, absorbed = merged
            self.store.write_rows(kept_rows, k_new[keep].to(self.dtype), v_new[keep].to(self.dtype))
            self.stats["mass"][0].index_add_(0, kept_rows, absorbed[keep])
            self._write_features(kept_rows)

    def retain(self, idx: torch.Tensor, valid: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        """Keep the entries ``keep`` of the padded index ``idx`` [H, L], free the other ``valid`` ones; returns the
        rows the kept entries occupy, head-major in sequence order."""
        kept_rows = idx[keep]
        self.release(idx[valid & ~keep])
        self.relist(kept_rows, keep.sum(dim=1))
        if 4 * self.holes > self.rows:  # e.g. after a prompt chunk: a decode step reads the whole span
            kept_rows = self.make_dense()
        return kept_rows

    def trim_to_window(self) -> None:
        """A sliding layer keeps each head's newest ``hold`` entries (a head's list is in sequence order)."""
        hold = self.plan.hold
        if hold is None or self.longest <= hold:
            return
        idx, valid = self.index()
        newest = torch.arange(self.longest, device=self.device) >= (self.lengths - hold).unsqueeze(1)
        self.retain(idx, valid, valid & newest)

    def over_by_one_each(self) -> bool:
        """Whether the layer holds exactly one entry per head over its total (a decode step of a full pool)."""
        return self.plan.budget is not None and self.rows == self.heads * (self.plan.budget + 1)

    def release(self, freed: torch.Tensor) -> None:
        """The evicted entries' rows are free again, first in line: new entries fill them before the span grows."""
        self.free = torch.cat([freed, self.free])
        self.holes += freed.shape[0]
        self.owner_bias.index_fill_(1, freed, float("-inf"))

    def make_dense(self) -> torch.Tensor:
        """Move every held entry to rows ``0:rows``, head-major in sequence order, so that the span holds no
        holes; returns the rows the entries now occupy."""
        idx, valid = self.index()
        held = idx[valid]
        per_row = [t[0, 0] for t in self.store.tensors()] + [self.positions[0]]
        for t in per_row + ([self.table[0]] if self.table is not None else []):
            t[: self.rows] = t.index_select(0, held)
        if self.log is not None:
            self.log.move(held.unsqueeze(0))
        self.owner_bias[:, : self.rows] = self.owner_bias.index_select(1, held)
        self.owner_bias[:, self.rows :] = float("-inf")
        dense = torch.arange(self.rows, device=self.device)
        self.free = torch.arange(self.rows, self.owner_bias.shape[1], device=self.device)
        self.span, self.holes = self.rows, 0
        self.relist(dense, self.lengths)
        return dense

    def relist(self, kept_rows: torch.Tensor, lengths: torch.Tensor) -> None:
        """Each head's list becomes its kept rows: ``kept_rows`` head-major, ``lengths[h]`` for head h."""
        self.rows = kept_rows.shape[0]
        self.lengths = lengths
        self.longest = int(lengths.max())
        offsets = torch.cumsum(lengths, 0) - lengths
        at = (offsets.unsqueeze(1) + torch.arange(self.longest, device=self.device)).clamp_max(self.rows - 1)
        self.head_rows[:, : self.longest] = kept_rows[at]

    def kept_positions(self) -> torch.Tensor:
        """[H, longest head]; a head holding fewer entries repeats its newest position (a set, for replay)."""
        idx, valid = self.index()
        pos = self.positions[0][idx]
        last = pos.gather(1, (self.lengths - 1).clamp_min(0).unsqueeze(1))
        return torch.where(valid, pos, last)

    def head_lengths(self) -> list[int]:
        return self.lengths.tolist() if self.lengths is not None else []

    def tokens_held(self) -> float:
        return self.length

    def resident_bytes(self) -> int:
        return self.rows * self.store.row_bytes() if self.is_initialized else 0

    def capacity_bytes(self) -> int:
        return self.store.capacity_bytes() if self.is_initialized else 0


class PoolStack:
    """The bookkeeping of pooled layers that evict together (see ``evict_pools``): every layer's positions,
    statistics, query log, head lists and row owners are slices of one set of buffers (layer l's at index l), so
    that a step's eviction reads and writes all of them in single ops. Each layer keeps its own K/V pool."""

    def __init__(self, plan: LayerPlan, policy: Policy, layers: int):
        self.plan, self.policy, self.layers = plan, policy, layers
        self.layout: tuple | None = None

    def adopt(self, layer: "PooledLayer", key_states: torch.Tensor, value_states: torch.Tensor) -> bool:
        """Point ``layer``'s bookkeeping at its slice, allocating the stack for the first layer. False where its
        shapes differ from the first layer's."""
        heads = key_states.shape[1]
        layout = (heads, key_states.shape[-1], value_states.shape[-1], key_states.dtype, key_states.device)
        pool = heads * self.plan.capacity
        if self.layout is None:
            self.layout = layout
            device = key_states.device
            self.positions, self.table, self.stats, self.log = entry_buffers(self.policy, self.layers, pool,
                                                                           self.layers * heads, device)
            self.head_rows = torch.zeros(self.layers, heads, pool + 1, dtype=torch.long, device=device)
            self.owner_bias = torch.full((self.layers, heads, pool), float("-inf"), device=device)
        elif layout != self.layout:
            return False
        l = layer.layer_idx
        layer.positions = self.positions[l : l + 1]
        if self.table is not None:
            layer.table = self.table[l : l + 1]
            layer.stats = {name: layer.table[:, :, i] for i, name in enumerate(self.stats)}
        if self.log is not None:
            layer.log = self.log.groups(l, l + 1, heads=heads)
        layer.head_rows, layer.owner_bias = self.head_rows[l], self.owner_bias[l]
        return True


def evict_pools(layers: list["PooledLayer"]) -> None:
    """Evict pooled layers that each hold one entry per head over their total (every decode step once the pools are
    full) in one go. Their heads' lists, padded to the longest, are scored as one state of layers × H rows and the
    allocation splits each layer's total among its own heads (``TokenState.layers``); then every layer's lists,
    free rows and owners are set from the one keep mask. The kept sets are those of evicting each layer alone:
    every part ranks a row on its own, and padding is never kept."""
    stack = layers[0].cache.pools
    state, idx = pooled_state(layers)
    valid, heads, count, n = state.valid, layers[0].heads, len(layers), state.length
    keep = layers[0].policy.keep_mask(state, layers[0].plan.budget)
    freed = idx[valid & ~keep].view(count, heads)  # each layer drops one entry per head, in some heads
    stack.owner_bias.scatter_(2, freed.unsqueeze(1).expand(-1, heads, -1), float("-inf"))
    # Each head's kept rows, in order, to the front of its list (dropped ones to the spare column n).
    at = torch.where(keep, keep.cumsum(dim=1) - 1, n)
    stack.head_rows.view(count * heads, -1)[:, : n + 1].scatter_(1, at, idx)
    kept = keep.sum(dim=1)
    longest = kept.view(count, heads).amax(dim=1).tolist()
    for l, layer in enumerate(layers):
        layer.free = torch.cat([freed[l], layer.free])
        layer.holes += heads
        layer.lengths, layer.longest, layer.rows = kept[l * heads : (l + 1) * heads], longest[l], layer.rows - heads
        if 4 * layer.holes > layer.rows:
            layer.make_dense()


def pooled_state(layers: list["PooledLayer"]) -> tuple[TokenState, torch.Tensor]:
    """Pooled layers' states as one, their heads' lists padded to the longest (padding reads as position 0 with
    every statistic exactly 0, as in a layer's own state); and the pool row of every entry [layers × H, n]."""
    first, stack = layers[0], layers[0].cache.pools
    heads, device = first.heads, first.device
    count, n = len(layers), max(layer.longest for layer in layers)
    lengths = torch.cat([layer.lengths for layer in layers])
    valid = torch.arange(n, device=device) < lengths.unsqueeze(1)
    idx = stack.head_rows.view(count * heads, -1)[:, :n].masked_fill(~valid, 0)  # [layers × H, n]
    by_layer = idx.view(count, heads * n)
    mask = valid.to(torch.float32)

    def per_entry(values: torch.Tensor) -> torch.Tensor:
        """[layers, rows] (or [layers, X, rows]) read at each layer's heads' entries: [layers × H, n] ([.., X, n])."""
        if values.dim() == 2:
            return values.gather(1, by_layer).view(count * heads, n)
        at = by_layer.unsqueeze(1).expand(-1, values.shape[1], -1)
        return values.gather(2, at).view(count, -1, heads, n).transpose(1, 2).reshape(count * heads, -1, n)

    positions = per_entry(stack.positions).masked_fill(~valid, 0)
    eager = {name: value * mask for name, value in first._derived_stats(positions).items()}
    if stack.stats:
        rows = per_entry(stack.table.transpose(1, 2))  # [layers × H, columns, n]
        eager |= {name: rows[:, i] * mask for i, name in enumerate(stack.stats)}
    lazy, derived = {}, {}
    if stack.log is not None:
        derived["qlog_sum"] = per_entry(stack.log.total) * mask
        eager["qlog_nvis"] = stack.log.nvis
        lazy["qlog"] = lambda: per_entry(stack.log.rows) * mask.unsqueeze(1)

    def load_kv() -> tuple[torch.Tensor, torch.Tensor]:
        keys, values = zip(*(layer.store.gather(part) for layer, part in zip(layers, idx.split(heads))))
        return torch.cat(keys), torch.cat(values)

    state = TokenState(positions=positions, stats=Stats(eager, lazy), layer_idx=-1, generator=first.cache.generator,
                       phase=first.cache.phase, valid=valid, load_kv=load_kv, derived=derived, lengths=lengths,
                       layers=count, **first.window_state())
    return state, idx


def stackable(plans: list[LayerPlan], policy: Policy) -> bool:
    """Whether one eviction can serve every layer: several evicting layers under uniform allocation (every head of
    a layer holds the same count), all with one plan, or with different budgets where each row is scored on its
    own and the scope shields alike at every budget (see LayerStack). Merging is left per layer: it works on
    float32 copies of the evicted layer's keys and values, which for every layer at once would be a prompt-sized
    transient."""
    if len(plans) < 2 or not policy.evicts or policy.allocation.per_head or policy.merge:
        return False
    budgets = [plan.budget for plan in plans]
    if None in budgets or len({(plan.window, id(plan.policy)) for plan in plans}) > 1:
        return False
    return (all(plan == plans[0] for plan in plans)
            or (policy.score.row_local and policy.scope.shields_alike(budgets)))


@dataclass
class CacheStats:
    kept_per_layer: list[float] = field(default_factory=list)
    resident_bytes: int = 0
    capacity_bytes: int = 0
    resident_per_layer: list[int] = field(default_factory=list)


class BudgetedCache(Cache):
    """One layer per decoder layer (``PooledLayer`` under per-head allocation), sharing the policy and the
    positions of the step. ``model`` is needed only for ``positions: reindex`` (its rotary embedding)."""

    def __init__(self, plans: list[LayerPlan], policy: Policy, seed: int = 0, device: torch.device | str = "cpu",
                 model: Any = None):
        self.policy = policy
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)
        self.step_positions = torch.zeros(0, dtype=torch.long, device=device)
        self.step_model_positions = self.step_positions
        self.seen = 0
        self.evicting = False
        self.collecting = True
        self.staging = False
        self.phase = "prefill"
        self.rotaries: list[Rotary] | None = None
        if policy.positions == "reindex":
            if model is None:
                raise ValueError("positions=reindex needs the model (its rotary embedding) to build the cache")
            self.rotaries = layer_rotaries(model)
        super().__init__(layers=[(PooledLayer if (plan.policy or policy).allocation.per_head else BudgetedLayer)(
            i, plan, policy, self) for i, plan in enumerate(plans)])
        self.stack = LayerStack(plans, policy, self) if stackable(plans, policy) else None
        # Pooled layers of one plan, each ranking its rows on its own: decode steps evict them all at once.
        together = (policy.allocation.per_head and len(plans) > 1 and policy.evicts and not policy.merge
                    and policy.score.row_local and all(plan == plans[0] for plan in plans) and plans[0].policy is None)
        self.pools = PoolStack(plans[0], policy, len(plans)) if together else None
        self.waiting: list[PooledLayer] = []

    def begin_step(self, positions: torch.Tensor, evicting: bool, phase: str = "prefill",
                   collecting: bool = True) -> torch.Tensor:
        """Set the absolute positions of the tokens about to be fed, whether this step may evict, the phase
        ("prefill" for prompt chunks, "decode" for generated tokens) and whether attention statistics are still
        worth collecting (False once no step from this one on evicts: nobody will read them). Returns the
        positions to feed the model: the same absolute positions, or under ``positions: reindex`` the next
        contiguous positions."""
        self.step_positions = positions
        self.seen = positions[-1] + 1  # tokens fed by the end of this step (a tensor: no device sync)
        self.evicting = evicting
        self.collecting = collecting or evicting
        self.phase = phase
        # A stacked decode step whose query sees every held entry: each layer stages its attention row and the
        # last one folds them all (masked replay hides entries per layer, so its steps fold layer by layer).
        self.staging = (self.stack is not None and self.stack.is_initialized and positions.shape[0] == 1
                        and self.collecting and self.policy.needs_attention
                        and all(layer.visible_past is None for layer in self.layers))
        if self.rotaries is None:
            self.step_model_positions = positions
        else:
            held = max((layer.max_head_length() for layer in self.layers if layer.is_initialized), default=0)
            self.step_model_positions = held + torch.arange(positions.shape[0], device=positions.device)
        return self.step_model_positions

    def after_attention(self, layer_idx: int, n_new: int, stats: dict[str, torch.Tensor]) -> None:
        """Called by the attention function once the layer's output is computed (H2O's order). Stacked layers
        are evicted together once the last of them has attended."""
        layer = self.layers[layer_idx]
        layer.observe(n_new, stats)
        layer.visible_past = layer.pool_bias = None
        last = layer_idx == len(self.layers) - 1
        if self.stack is None:
            if self.evicting and self.pools is not None and layer.over_by_one_each():
                self.waiting.append(layer)  # its cache is not read again before the next step
            else:
                if self.evicting:
                    layer.evict_to_budget()
                layer.trim_to_window()
            if last and self.waiting:
                evict_pools(self.waiting)
                for waited in self.waiting:
                    waited.trim_to_window()
                self.waiting = []
            return
        if last:
            if self.staging:
                self.stack.fold_staged(self.layers)
            if self.evicting:
                self.stack.evict_layers(self.layers)
            self.stack.trim_layers(self.layers)

    def unstack(self) -> None:
        """Give up the shared eviction (a layer's shapes differ from the others'): the layers that have already
        attended in this step are evicted now, each later one after its own attention. (Layers allocate in the
        first step, which stages nothing.)"""
        self.stack = None
        self.staging = False
        if self.evicting:
            for layer in self.layers:
                if layer.is_initialized:
                    layer.evict_to_budget()

    def pools_apart(self) -> None:
        """Give up evicting the pooled layers together (a layer's shapes differ from the others'); those waiting
        in this step are evicted now."""
        self.pools = None
        for layer in self.waiting:
            layer.evict_to_budget()
        self.waiting = []

    def summary(self) -> CacheStats:
        resident = [layer.resident_bytes() for layer in self.layers]
        return CacheStats(
            kept_per_layer=[layer.tokens_held() for layer in self.layers],
            resident_bytes=sum(resident),
            capacity_bytes=sum(layer.capacity_bytes() for layer in self.layers),
            resident_per_layer=resident,
        )

    def kept_positions(self) -> list[torch.Tensor]:
        """Per layer, the absolute positions held by each KV head, [kv_heads, kept] (see PooledLayer for ragged)."""
        return [layer.kept_positions() for layer in self.layers]
