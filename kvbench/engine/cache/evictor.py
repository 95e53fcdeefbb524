"""The end of a step: which rows evict together, and the trims of sliding layers. The cache hands the ``Evictor``
its entries, its stores and the step; the Evictor never sees the cache.

Each (layer, lane) unit over its budget joins the group of units whose eviction depends on the same things
(``group_key``), and each group is scored once (``evict.evict_group``). Under an allocation that spans layers
(``global``) a sequence's layers form one group (``pool_key``) whenever their total is over budget (a thresholded
one, at every evicting step). Sliding
layers then keep their newest ``window - 1`` entries per row. After a prompt chunk, every layer that dropped entries
is packed again. A decode step evicts a lane only every ``policy.interval`` of its decode steps (``Evictor.due``);
in between its rows grow.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvbench.engine.cache import evict as evicting
from kvbench.engine.cache.entries import Entries
from kvbench.engine.cache.layer import write_features
from kvbench.engine.cache.store import KVStore
from kvbench.engine.plan import LayerPlan
from kvbench.engine.score_inputs import ScoreInputs
from kvbench.engine.step import Phase, Step
from kvbench.policies.policy import Policy
from kvbench.policies.state import TokenState


class Evictor:
    """Evicts each lane's rows to its budgets. It keeps, per lane, each layer's budget (``assign``), the
    tokens fed so far (what a score's ``count`` is counted from) and the decode steps since its last evicting
    one: a decode step evicts a lane's rows only every ``interval``-th of its steps (the decode schedule)."""

    def __init__(
        self,
        plans: Sequence[LayerPlan],
        policies: Sequence[Policy],
        lanes: int,
        seed: int,
        inputs: ScoreInputs,
        interval: int = 1,
    ):
        self.plans, self.policies, self.seed, self.interval = list(plans), list(policies), seed, interval
        self.inputs = inputs  # the score's declared weights, and the step's queries its layers left there
        self.history = max((p.history for p in policies), default=0)  # the query log's length, in steps
        self.budgets: list[list[int | None]] = [[None] * lanes for _ in plans]
        self.observes: list[int | None] = [None] * lanes  # each lane's question tokens (``LayerPlan.observe``)
        self.seen = [0] * lanes
        self.prompt = [0] * lanes  # tokens the lane's sequence was fed in prompt steps (its prompt and suffix)
        self.waited = [0] * lanes  # decode steps since the lane's last evicting one
        self.phase = Phase.prefill  # the last step's
        self._rows: dict[tuple, torch.Tensor] = {}  # index tensors of unit lists, built once
        self._row_keys: torch.Tensor | None = None  # (layer, KV head) of each flat row, built once

    def assign(self, lane: int, plans: Sequence[LayerPlan]) -> None:
        """Lane ``lane`` now holds a sequence with these plans (its budgets)."""
        for layer, plan in enumerate(plans):
            self.budgets[layer][lane] = plan.budget
        self.observes[lane] = plans[0].observe if plans else None
        self.waited[lane] = 0
        self.prompt[lane] = 0

    def copy_lane(self, source: Evictor, src: int, dst: int) -> None:
        for layer in range(len(self.plans)):
            self.budgets[layer][dst] = source.budgets[layer][src]
        self.seen[dst] = source.seen[src]
        self.prompt[dst] = source.prompt[src]
        self.observes[dst] = source.observes[src]
        self.waited[dst] = source.waited[src]

    def prepares(self, lanes: range) -> bool:
        """Whether a decode step of ``lanes`` prepares an eviction (``Step.prepares``): some lane evicts within the
        query log's length of steps, or in this step. The log is a ring by position, so the steps logged before an
        eviction fill it as logging every step would; features deferred until then are computed from the same
        stored values (only an eviction changes them)."""
        ahead = max(self.history, 1)
        return self.interval == 1 or any(self.interval - self.waited[lane] <= ahead for lane in lanes)

    def due(self, step: Step) -> list[bool]:
        """Whether each of the step's lanes evicts in it: every prompt chunk of an evicting stage, and every
        ``interval``-th decode step of the lane (its count restarts when it evicts)."""
        if not step.evicts or step.phase is not Phase.decode or self.interval == 1:
            return [step.evicts] * len(step.lanes)
        out = []
        for lane in step.lanes:
            self.waited[lane] += 1
            out.append(self.waited[lane] >= self.interval)
            if out[-1]:
                self.waited[lane] = 0
        return out

    def evict(self, entries: Entries, stores: list[KVStore], step: Step) -> None:
        """Evict every row of the step's lanes over its budget (when the step evicts) and trim sliding layers to
        their window; a prompt chunk's evicted layers are then packed again."""
        for lane, positions in zip(step.lanes, step.positions):
            if step.replay is None:  # a replay pass's tokens are not the sequence's
                self.seen[lane] = positions[-1] + 1
                if step.phase is Phase.prefill:
                    self.prompt[lane] = max(self.prompt[lane], positions[-1] + 1)
        self.phase = step.phase
        due = self.due(step)
        e, lo, hi = entries, step.lanes.start, step.lanes.stop
        lengths = e.lengths[:, e.row_range(lo, hi)].tolist()
        groups: dict[tuple, evicting.Group] = {}
        trims: dict[tuple, list[tuple[int, int]]] = {}
        ragged_trims: list[int] = []
        over = self._pools_over(lengths, step, due, e.heads)
        for layer, (plan, policy) in enumerate(zip(self.plans, self.policies)):
            keep, per_head = plan.window_keep, policy.allocation.per_head
            for s in step.lanes:
                counts = lengths[layer][(s - lo) * e.heads : (s - lo + 1) * e.heads]
                budget = self.budgets[layer][s]
                if due[s - lo] and policy.evicts and budget is not None:
                    size = sum(counts) if per_head else counts[0]
                    observe = self.observes[s]
                    if policy.allocation.pools_layers:
                        key = pool_key(plan, policy, budget, s)
                        joins = over[key] or policy.allocation.thresholded
                    else:
                        key = (*group_key(plan, policy, layer, budget, size), observe)
                        joins = size > (budget * e.heads if per_head else budget) or policy.allocation.thresholded
                    if joins:
                        group = evicting.Group(policy, budget, plan.window, observe=observe)
                        groups.setdefault(key, group).units.append((layer, s))
                        continue
                if keep is not None and max(counts) > keep:
                    if per_head:
                        ragged_trims.append(layer)
                    else:
                        trims.setdefault((keep, counts[0]), []).append((layer, s))
        if not groups and not trims and not ragged_trims and not (step.tokens > 1 and step.evicts):
            return
        rows_of_step = self._step_rows(e, lo)

        def features(layer: int, rows: torch.Tensor, slots: torch.Tensor) -> None:
            write_features(e, layer, stores[layer], self.policies[layer], rows, slots, self.inputs.weights[layer])

        changed: set[int] = set()
        for key, group in groups.items():
            rows = self._group_rows(e, group.units)
            per_head = group.policy.allocation.per_head
            n = (
                key[2]
                if not per_head
                else max(max(lengths[layer][(s - lo) * e.heads : (s - lo + 1) * e.heads]) for layer, s in group.units)
            )
            evicting.evict_group(e, rows, n, group, rows_of_step, per_head, stores, features)
            changed.update(layer for layer, _ in group.units)
        if ragged_trims or any(g.policy.allocation.per_head for g in groups.values()):
            ragged = sorted(
                set(ragged_trims)
                | {layer for g in groups.values() for layer, _ in g.units if self.plans[layer].window_keep is not None}
            )
            for layer in ragged:
                self._trim_ragged(e, layer, step.lanes)
                changed.add(layer)
        for (keep, n), units in trims.items():
            rows = self._group_rows(e, units)
            idx = torch.arange(n, device=e.device)
            r = len(units) * e.heads
            e.keep_sorted(rows, n, idx[n - keep :].expand(r, -1), idx[: n - keep].expand(r, -1))
            changed.update(layer for layer, _ in units)
        if step.tokens > 1:
            for layer in sorted(changed):
                e.pack(layer, lo, hi, stores[layer])

    def _pools_over(self, lengths: list[list[int]], step: Step, due: list[bool], heads: int) -> dict[tuple, bool]:
        """Per pool of an allocation that spans layers (``pool_key``: one sequence's layers of one policy, window
        and budget), whether its rows together hold more than ``layers × heads × budget``: then all of them evict
        together, including layers under their own share."""
        held: dict[tuple, int] = {}
        room: dict[tuple, int] = {}
        lo = step.lanes.start
        for layer, (plan, policy) in enumerate(zip(self.plans, self.policies)):
            if not (policy.evicts and policy.allocation.pools_layers):
                continue
            for s in step.lanes:
                budget = self.budgets[layer][s]
                if due[s - lo] and budget is not None:
                    key = pool_key(plan, policy, budget, s)
                    held[key] = held.get(key, 0) + sum(lengths[layer][(s - lo) * heads : (s - lo + 1) * heads])
                    room[key] = room.get(key, 0) + budget * heads
        return {key: held[key] > room[key] for key in held}

    def state(self, entries: Entries, stores: list[KVStore], layer: int, lane: int = 0) -> TokenState:
        """What decoder layer ``layer`` of the sequence in ``lane`` holds, as its policy ranks it."""
        e, policy = entries, self.policies[layer]
        rows = torch.tensor(evicting.unit_rows(e, [(layer, lane)]), device=e.device)
        lengths = e.lengths.view(-1).index_select(0, rows)
        n = int(lengths.max())
        ragged = policy.allocation.per_head or bool((lengths != n).any())
        group = evicting.Group(
            policy, self.budgets[layer][lane] or n, self.plans[layer].window, observe=self.observes[lane]
        )
        return evicting.group_state(e, rows, n, group, self._step_rows(e), lengths if ragged else None, stores)

    def _trim_ragged(self, e: Entries, layer: int, lanes: range) -> None:
        """A per-head row of a sliding layer keeps at most its newest ``window_keep`` entries."""
        keep_at_most = self.plans[layer].window_keep
        assert keep_at_most is not None, "only a sliding layer is trimmed"
        rr = e.row_range(lanes.start, lanes.stop)
        lengths = e.lengths[layer, rr]
        n = int(lengths.max())
        if n <= keep_at_most:
            return
        idx = torch.arange(n, device=e.device)
        valid = idx < lengths.unsqueeze(1)
        keep = valid & (idx >= (lengths - keep_at_most).unsqueeze(1))
        e.keep_mask(layer * e.rows + torch.arange(rr.start, rr.stop, device=e.device), keep, valid)

    def _group_rows(self, e: Entries, units: list[tuple[int, int]]) -> torch.Tensor | None:
        """The flat rows of ``units`` (None: every row of the cache)."""
        if len(units) == e.layers * e.lanes:
            return None
        key = tuple(units)
        if key not in self._rows:
            self._rows[key] = torch.tensor(evicting.unit_rows(e, units), device=e.device)
        return self._rows[key]

    def _step_rows(self, e: Entries, first_lane: int = 0) -> evicting.StepRows:
        """The step's per-row facts; its queries (where declared) are those of lanes from ``first_lane`` on."""
        seen = torch.tensor(self.seen, device=e.device).repeat_interleave(e.heads).repeat(e.layers)
        prompt = torch.tensor(self.prompt, device=e.device).repeat_interleave(e.heads).repeat(e.layers)
        if self._row_keys is None:
            head = torch.arange(e.layers * e.rows, device=e.device)
            self._row_keys = (head // e.rows) * e.heads + head % e.heads
        return evicting.StepRows(
            seen.view(-1, 1),
            prompt.view(-1, 1),
            self._row_keys,
            self.phase,
            self.seed,
            self.inputs.queries,
            first_lane * e.heads,
            self.inputs.rotaries,
        )


def group_key(plan: LayerPlan, policy: Policy, layer: int, budget: int, size: int) -> tuple:
    """What a (layer, lane) unit's eviction depends on: units of one key are scored as one state. Merging units
    stay within their layer (merged keys and values are written back to one layer's store); a thresholded
    allocation decides each row alone, so its units join whatever they hold."""
    held = None if policy.allocation.thresholded else size
    return (id(policy), plan.window, held, budget, layer if policy.merge else None)


def pool_key(plan: LayerPlan, policy: Policy, budget: int, lane: int) -> tuple:
    """The group of a (layer, lane) unit under an allocation that spans layers: every layer of the sequence with
    the same policy, window and budget, ranked as one state whatever each holds."""
    return ("pool", id(policy), plan.window, budget, lane)
