"""The transformers ``Cache`` face of the ragged layout: one ``CacheLayer`` per decoder layer over one ``Entries``.

A step (``engine.step.Step``) feeds the same number of tokens to a range of lanes (one sequence's prompt chunk,
or one decode token for each of several sequences). ``begin`` returns the positions to feed the model; the
model's first ``update`` of the step inserts the step's entries in every layer's rows (``Feeding``), and each
``update`` hands the layer its keys and values (``CacheLayer.update``), which returns what the step attends to.
``finish`` hands the entries, the stores and the step to the ``Evictor``. The cache dispatches down, as
transformers' ``Cache`` does; nothing below calls back up.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, cast

import torch
from transformers.cache_utils import Cache

from kvbench.engine.cache.entries import Entries
from kvbench.engine.cache.evictor import Evictor
from kvbench.engine.cache.feeding import Feeding
from kvbench.engine.cache.layer import CacheLayer
from kvbench.engine.cache.row_sums import RowSums
from kvbench.engine.cache.store import KVStore
from kvbench.engine.plan import LayerPlan
from kvbench.engine.score_inputs import ScoreInputs
from kvbench.engine.step import Phase, Step
from kvbench.policies.policy import Policy
from kvbench.policies.positions import Rotary, layer_rotaries
from kvbench.policies.state import TokenState
from kvbench.policies.statistics import stored_names


@dataclass
class CacheStats:
    kept_per_layer: list[float] = field(default_factory=list)
    resident_bytes: int = 0
    capacity_bytes: int = 0
    resident_per_layer: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class Shapes:
    """What every layer's entries are: KV heads, key and value dims, dtype (read from the first write)."""

    heads: int
    k_dim: int
    v_dim: int
    dtype: torch.dtype


class KVCache(Cache):
    """Rows for ``lanes`` sequences. ``plan_sets``: the layer plans of every sequence it will hold (capacities are
    the largest they need in the ``phases`` it serves: the prompt's, the decode's, or both). ``model`` is
    needed only for ``positions: reindex`` (its rotary embedding)."""

    def __init__(
        self,
        plan_sets: list[list[LayerPlan]],
        policy: Policy,
        lanes: int = 1,
        phases: tuple[Phase, ...] = (Phase.prefill, Phase.decode),
        seed: int = 0,
        device: torch.device | str = "cpu",
        model: Any = None,
    ):
        self.lanes, self.phases = lanes, phases
        self.device = torch.device(device)
        plans = plan_sets[0]
        self.plan_sets = plan_sets
        self.reindexes = policy.positions == "reindex"
        rotaries: list[Rotary | None] = [None] * len(plans)
        if self.reindexes:
            if model is None:
                raise ValueError("positions=reindex needs the model (its rotary embedding) to build the cache")
            rotaries = list(layer_rotaries(model))
        # The weights and the step's queries the score declared, shared by the layers and the evictor.
        self.inputs = ScoreInputs(model, policy, len(plans))
        super().__init__(
            layers=[
                CacheLayer(i, plan, plan.policy or policy, self.inputs, rotary)
                for i, (plan, rotary) in enumerate(zip(plans, rotaries))
            ]
        )
        layer_policies = [layer.policy for layer in self.kv_layers]
        self.evictor = Evictor(plans, layer_policies, lanes, seed, self.inputs, policy.interval)
        self.entries: Entries | None = None
        self.shapes: Shapes | None = None
        self.step: Step | None = None  # the step under way
        self.model_positions: torch.Tensor | None = None  # what begin told the model to feed for it
        self.feeding: Feeding | None = None  # its entries, once the first layer wrote them
        self._rows: dict[range, torch.Tensor] = {}  # each lane range's rows within a layer, built once

    @property
    def kv_layers(self) -> list[CacheLayer]:
        """The decoder layers, as built here (transformers types ``layers`` as any of its own layer kinds)."""
        return cast("list[CacheLayer]", self.layers)

    @property
    def allocated(self) -> Entries:
        """The entries; they exist from the first layer's write on, once the shapes are known (``allocate``)."""
        assert self.entries is not None, "the cache allocates its entries on its first write"
        return self.entries

    def stores(self) -> list[KVStore]:
        return [layer.store for layer in self.kv_layers]

    # -- allocation --------------------------------------------------------------------------------------
    def allocate(self, shapes: Shapes) -> None:
        """Buffers for every layer, from the shapes of one layer's keys and values."""
        policies = [layer.policy for layer in self.kv_layers]
        caps = [
            max(plans[layer].rows_capacity(shapes.heads, self.phases, policy, len(plans)) for plans in self.plan_sets)
            for layer, policy in enumerate(policies)
        ]
        columns = sorted(
            {n for policy in policies for n in stored_names(policy.needs)}
            | {n for policy in policies for n in policy.feature_names}
        )
        # a score observing the question logs all of its queries
        observed = [plans[0].observe or 0 for plans in self.plan_sets if plans and any(p.question for p in policies)]
        history = max([policy.history for policy in policies] + observed)
        rows = self.lanes * shapes.heads
        stores = [
            KVStore(rows, cap, shapes.k_dim, shapes.v_dim, shapes.dtype, self.device, policy.quantize)
            for policy, cap in zip(policies, caps)
        ]
        declared = [policy.row_sums for policy in policies]
        row_sums = RowSums(declared, stores, rows, self.device) if any(declared) else None
        self.entries = Entries(
            len(self.layers), self.lanes, shapes.heads, max(caps), columns, history, self.device, row_sums
        )
        self.shapes = shapes
        for layer, store in zip(self.kv_layers, stores):
            layer.attach(store, self.entries)

    def assign(self, lane: int, plans: list[LayerPlan]) -> None:
        """Lane ``lane`` now holds a sequence with these plans (its budgets)."""
        self.evictor.assign(lane, plans)

    # -- a step --------------------------------------------------------------------------------------------
    def begin(self, step: Step) -> torch.Tensor:
        """Start ``step``. Returns the positions to feed the model [lanes, q]: the step's own, or under
        ``positions: reindex`` each sequence's next contiguous positions after what it holds."""
        self.step, self.feeding = step, None
        if not self.reindexes:
            self.model_positions = torch.tensor(step.positions, dtype=torch.long, device=self.device)
            return self.model_positions
        held = [0] * len(step.lanes)
        if self.entries is not None:
            e = self.entries
            lengths = e.lengths[:, e.row_range(step.lanes.start, step.lanes.stop)]
            held = lengths.view(e.layers, len(step.lanes), e.heads).amax(dim=(0, 2)).tolist()
        self.model_positions = torch.tensor([[h + i for i in range(step.tokens)] for h in held], device=self.device)
        return self.model_positions

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``layer_idx``'s new entries; returns the step's keys and values [lanes, heads, n, D]."""
        shapes = Shapes(key_states.shape[1], key_states.shape[-1], value_states.shape[-1], key_states.dtype)
        if self.shapes is None:
            self.allocate(shapes)
        elif (
            shapes.heads != self.shapes.heads or shapes.k_dim != self.shapes.k_dim or shapes.v_dim != self.shapes.v_dim
        ):
            raise ValueError(
                f"layer {layer_idx} has {shapes.heads} KV heads of {shapes.k_dim} dims, unlike layer 0: kvbench's "
                "cache needs every layer alike"
            )
        if self.feeding is None:
            self.feeding = self._feed(shapes.heads)
        return self.kv_layers[layer_idx].update(key_states, value_states, self.feeding)

    def _feed(self, heads: int) -> Feeding:
        """The step's entries in every layer's rows (at its first layer write)."""
        step, e, model_positions = self.step, self.allocated, self.model_positions
        assert step is not None and model_positions is not None, "a forward runs between begin and finish"
        lo, hi = step.lanes.start, step.lanes.stop
        positions = torch.tensor(step.positions, device=self.device) if self.reindexes else model_positions
        before = e.lengths[:, e.row_range(lo, hi)].clone() if self.reindexes else None
        slots, key_spans, gapless = e.insert(lo, hi, positions)
        return Feeding(
            step=step,
            rows=self._rows_of(step.lanes, heads),
            slots=slots,
            key_spans=key_spans,
            gapless=gapless,
            positions=positions,
            model_positions=model_positions,
            query_positions=positions.repeat_interleave(heads, dim=0),
            lengths_before=before,
        )

    def _rows_of(self, lanes: range, heads: int) -> torch.Tensor:
        if lanes not in self._rows:
            self._rows[lanes] = torch.arange(lanes.start * heads, lanes.stop * heads, device=self.device)
        return self._rows[lanes]

    def finish(self, step: Step) -> None:
        """Evict every row over its budget and trim sliding layers to their window (``Evictor``); a replay pass's
        own entries leave first."""
        if step.replay is not None and self.feeding is not None:
            self.allocated.drop(step.lanes.start, step.lanes.stop, self.feeding.slots)
        self.evictor.evict(self.allocated, self.stores(), step)
        self.inputs.queries[:] = [None] * len(self.inputs.queries)  # read by this step's eviction only
        self.step, self.model_positions, self.feeding = None, None, None
        for layer in self.kv_layers:
            layer.finish()

    def prune_channels(self) -> None:
        """The context is in: every layer keeps the key channels ``policy.channels`` chooses (``CacheLayer.
        prune_channels``), and the running sums the policy reads are summed again over what is now kept."""
        for layer in self.kv_layers:
            layer.prune_channels()
        e = self.allocated
        if e.row_sums is not None:
            e.row_sums.rebuild(e.occupied, e.slots_used)

    def layer_state(self, layer: int, lane: int = 0) -> TokenState:
        """What decoder layer ``layer`` of the sequence in ``lane`` holds, as its policy ranks it."""
        self.kv_layers[layer].write_features()
        return self.evictor.state(self.allocated, self.stores(), layer, lane)

    # -- lanes -----------------------------------------------------------------------------------------------
    def copy_lane(self, source: KVCache, src: int, dst: int) -> None:
        """Lane ``src`` of ``source`` (this cache or a prompt's) becomes lane ``dst`` here."""
        for layer in self.kv_layers + source.kv_layers:  # the copy takes the features with the entries
            layer.write_features()
        if self.shapes is None:
            assert source.shapes is not None, "a lane is copied from a cache that holds it"
            self.allocate(source.shapes)
        mine_e, theirs_e = self.allocated, source.allocated
        mine_e.copy_lane(theirs_e, src, dst)
        for mine, theirs, n in zip(self.kv_layers, source.kv_layers, theirs_e.slots_used):
            if n > mine.store.capacity:
                raise RuntimeError(
                    f"layer {mine.layer_idx}: a sequence using {n} slots does not fit rows of "
                    f"capacity {mine.store.capacity}"
                )
            mine.store.copy_rows(theirs.store, theirs_e.row_range(src, src + 1), mine_e.row_range(dst, dst + 1), n)
        self.evictor.copy_lane(source.evictor, src, dst)

    def summary(self, lane: int = 0) -> CacheStats:
        if self.entries is None:
            return CacheStats([0.0] * len(self.layers), 0, 0, [0] * len(self.layers))
        e = self.entries
        lengths = e.lengths[:, e.row_range(lane, lane + 1)]
        counts = lengths.sum(dim=1).tolist()
        beside = self._sparsity_bytes(lengths).sum(dim=1).tolist()
        resident = [
            c * layer.store.row_bytes() + e.heads * layer.store.index_bytes() + b
            for c, b, layer in zip(counts, beside, self.kv_layers)
        ]
        capacities = torch.tensor([[layer.store.capacity] * e.heads for layer in self.kv_layers], device=self.device)
        return CacheStats(
            kept_per_layer=[c / e.heads for c in counts],
            resident_bytes=sum(resident),
            capacity_bytes=sum(layer.store.capacity_bytes() for layer in self.kv_layers) // self.lanes
            + int(self._sparsity_bytes(capacities).sum()),
            resident_per_layer=resident,
        )

    def held_by_lane(self, lanes: range) -> list[tuple[int, float]]:
        """What each of the lanes holds: resident bytes, and entries per row (mean over layers and KV heads)."""
        e = self.allocated
        lengths = e.lengths[:, e.row_range(lanes.start, lanes.stop)]
        counts = lengths.view(e.layers, len(lanes), e.heads).sum(dim=2)
        beside = self._sparsity_bytes(lengths).view(e.layers, len(lanes), e.heads).sum(dim=(0, 2))
        row_bytes = torch.tensor([layer.store.row_bytes() for layer in self.kv_layers], device=self.device)
        index = sum(e.heads * layer.store.index_bytes() for layer in self.kv_layers)  # each row's kept channels
        held = (counts * row_bytes.unsqueeze(1)).sum(dim=0) + beside + index
        resident, entries = torch.stack([held, counts.sum(dim=0)]).tolist()
        return [(b, n / (e.layers * e.heads)) for b, n in zip(resident, entries)]

    def _sparsity_bytes(self, lengths: torch.Tensor) -> torch.Tensor:
        """Bytes a decode-time sparsity (Quest's page bounds) keeps beside rows holding ``lengths`` [layers, r]
        entries, per row [layers, r]; zero in the layers it leaves dense."""
        out = torch.zeros_like(lengths)
        if self.shapes is None:
            return out
        element = self.shapes.dtype.itemsize
        for i, layer in enumerate(self.kv_layers):
            sparsity = layer.policy.sparsity
            if sparsity is not None and sparsity.applies(i):
                out[i] = sparsity.metadata_bytes(lengths[i], self.shapes.k_dim, element)
        return out

    def kept_positions(self, lane: int = 0) -> list[torch.Tensor]:
        """Per layer, the absolute positions each KV head of the lane holds, [heads, kept]."""
        e = self.allocated
        return [e.kept_positions(layer, lane) for layer in range(len(self.layers))]
