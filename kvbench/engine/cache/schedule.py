"""Which rows evict together at the end of a step, and the trims of sliding layers.

Each (layer, sequence) unit over its budget joins the group of units whose eviction depends on the same things
(``group_key``), and each group is scored once (``evict.evict_group``). Sliding layers then keep their newest
``window - 1`` entries per row. After a prompt chunk, every layer that dropped entries is packed again.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kvbench.engine.cache import evict as evicting
from kvbench.policies.state import TokenState

if TYPE_CHECKING:
    from kvbench.engine.cache.cache import KVCache


def end_step(cache: KVCache) -> None:
    """Evict every row over its budget and trim sliding layers to their window; a prompt chunk's evicted
    layers are then densified."""
    e = cache.allocated
    rr = e.row_range(cache.lo, cache.hi)
    lengths = e.lengths[:, rr].tolist()
    q = len(cache.host_positions[0])
    groups: dict[tuple, evicting.Group] = {}
    trims: dict[tuple, list[tuple[int, int]]] = {}
    ragged_trims: list[int] = []
    for l, layer in enumerate(cache.kv_layers):
        policy, hold = layer.policy, layer.plan.hold
        per_head = policy.allocation.per_head
        for s in range(cache.lo, cache.hi):
            counts = lengths[l][(s - cache.lo) * e.heads : (s - cache.lo + 1) * e.heads]
            budget = cache.budgets[l][s]
            if cache.evicting and policy.evicts and budget is not None:
                size = sum(counts) if per_head else counts[0]
                if size > (budget * e.heads if per_head else budget):
                    key = group_key(cache, l, s, budget, size)
                    groups.setdefault(key, evicting.Group(policy, budget, layer.plan.window)).units.append((l, s))
                    continue
            if hold is not None and max(counts) > hold:
                if per_head:
                    ragged_trims.append(l)
                else:
                    trims.setdefault((hold, counts[0]), []).append((l, s))
    if not groups and not trims and not ragged_trims and not (q > 1 and cache.evicting):
        return
    step = step_rows(cache)
    changed: set[int] = set()
    for key, group in groups.items():
        rows = group_rows(cache, group.units)
        per_head = group.policy.allocation.per_head
        n = (
            key[2]
            if not per_head
            else max(max(lengths[l][(s - cache.lo) * e.heads : (s - cache.lo + 1) * e.heads]) for l, s in group.units)
        )
        evicting.evict_group(
            e, rows, n, group, step, per_head, [layer.store for layer in cache.kv_layers], cache.write_features
        )
        changed.update(l for l, _ in group.units)
    if ragged_trims or any(g.policy.allocation.per_head for g in groups.values()):
        ragged = sorted(
            set(ragged_trims)
            | {l for g in groups.values() for l, _ in g.units if cache.kv_layers[l].plan.hold is not None}
        )
        for l in ragged:
            trim_ragged(cache, l)
            changed.add(l)
    for (hold, n), units in trims.items():
        rows = group_rows(cache, units)
        idx = torch.arange(n, device=cache.device)
        r = len(units) * e.heads
        e.keep_sorted(rows, n, idx[n - hold :].expand(r, -1), idx[: n - hold].expand(r, -1))
        changed.update(l for l, _ in units)
    if q > 1:
        for l in sorted(changed):
            e.densify(l, cache.lo, cache.hi, cache.kv_layers[l].store)


def group_key(cache: KVCache, l: int, s: int, budget: int, size: int) -> tuple:
    """What a (layer, sequence) unit's eviction depends on: units of one key are scored as one state. Merging
    units stay within their layer (merged keys and values are written back to one layer's store)."""
    layer = cache.kv_layers[l]
    return (id(layer.policy), layer.plan.window, size, budget, l if layer.policy.merge else None)


def layer_state(cache: KVCache, l: int, slot: int = 0) -> TokenState:
    """What layer ``l`` of the sequence in ``slot`` holds, as its policy ranks it."""
    e, layer = cache.allocated, cache.kv_layers[l]
    rows = torch.tensor(evicting.unit_rows(e, [(l, slot)]), device=cache.device)
    lengths = e.lengths.view(-1).index_select(0, rows)
    n = int(lengths.max())
    ragged = layer.policy.allocation.per_head or bool((lengths != n).any())
    group = evicting.Group(layer.policy, cache.budgets[l][slot] or n, layer.plan.window)
    return evicting.group_state(
        e, rows, n, group, step_rows(cache), lengths if ragged else None, [x.store for x in cache.kv_layers]
    )


def trim_ragged(cache: KVCache, l: int) -> None:
    """A per-head row of a sliding layer keeps at most its newest ``hold`` entries."""
    e, hold = cache.allocated, cache.kv_layers[l].plan.hold
    assert hold is not None, "only a sliding layer is trimmed"
    rr = e.row_range(cache.lo, cache.hi)
    lengths = e.lengths[l, rr]
    n = int(lengths.max())
    if n <= hold:
        return
    idx = torch.arange(n, device=cache.device)
    valid = idx < lengths.unsqueeze(1)
    keep = valid & (idx >= (lengths - hold).unsqueeze(1))
    e.keep_mask(l * e.rows + cache._rows(cache.lo, cache.hi), keep, valid)


def group_rows(cache: KVCache, units: list[tuple[int, int]]) -> torch.Tensor | None:
    e = cache.allocated
    if len(units) == e.layers * e.slots:
        return None
    key = tuple(units)
    if key not in cache._cache:
        cache._cache[key] = torch.tensor(evicting.unit_rows(e, units), device=cache.device)
    return cache._cache[key]


def step_rows(cache: KVCache) -> evicting.StepRows:
    e = cache.allocated
    seen = torch.tensor(cache.seen, device=cache.device).repeat_interleave(e.heads).repeat(e.layers)
    return evicting.StepRows(
        seen.view(-1, 1), cache.row_keys, cache.phase, cache.seed, cache.inputs.queries, cache.lo * e.heads
    )
