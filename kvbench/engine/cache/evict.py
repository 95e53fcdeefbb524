"""One scoring and ranking per step for every row that must evict, whatever layer or sequence it belongs to.

Rows are grouped by what their eviction depends on: the layer's policy and window, the row's budget and how
many entries it holds (under per-head allocation, the (layer, sequence) unit's total). A group is scored as one
``TokenState``. Its rows come in whole units of ``heads`` consecutive rows, one unit per (layer, sequence), so a
part that mixes rows (Ada-KV's split, a kept set shared across heads) mixes the heads of one unit only: the
layout decides that, not the part. Rows of one group have one length (or, per head, are padded with ``valid``),
so every score sees each row as it would see it alone.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from kvbench.engine.cache.entries import Entries
from kvbench.engine.cache.store import KVStore, layer_runs
from kvbench.policies.merge import Merge
from kvbench.policies.policy import Policy
from kvbench.policies.positions import Rotary, RowRope
from kvbench.policies.state import Stats, TokenState
from kvbench.policies.statistics import FromPositions, declared


@dataclass
class Group:
    policy: Policy
    budget: int
    window: int | None
    units: list[tuple[int, int]] = field(default_factory=list)  # (layer, lane)
    observe: int | None = None  # the question's tokens at the prompt's end (``TokenState.observe``)


@dataclass
class StepRows:
    """What a state needs beyond the entries: per flat row, tokens fed so far and a key naming (layer, head)."""

    seen: torch.Tensor  # [layers × rows, 1] long
    prompt: torch.Tensor  # [layers × rows, 1] long: tokens each row's sequence was fed in prompt steps
    row_keys: torch.Tensor  # [layers × rows] long
    phase: str
    seed: int
    # Per layer, the step's queries a score declared ([rows of the step, group, k, D]), and the step's first row.
    queries: list[torch.Tensor | None] = field(default_factory=list)
    first_row: int = 0
    # Per layer, its RoPE, where a score reads it (``Score.rope``).
    rotaries: list[Rotary] | None = None


def unit_rows(entries: Entries, units: list[tuple[int, int]]) -> list[int]:
    h = entries.heads
    return [layer * entries.rows + s * h + i for layer, s in units for i in range(h)]


def group_state(
    entries: Entries,
    rows: torch.Tensor | None,
    n: int,
    group: Group,
    step: StepRows,
    lengths: torch.Tensor | None,
    stores: list[KVStore],
) -> TokenState:
    """The group's rows as one state of ``n`` entries each (``lengths`` [r]: per-head counts, padded)."""
    policy = group.policy
    order = entries.gather_rows(entries.order, rows)[:, :n]
    valid = None if lengths is None else torch.arange(n, device=order.device) < lengths.unsqueeze(1)
    positions = entries.gather_rows(entries.positions, rows).gather(1, order)
    mask = None if valid is None else valid.to(torch.float32)
    if valid is not None:
        positions = positions.masked_fill(~valid, 0)
    seen = step.seen if rows is None else step.seen.index_select(0, rows)
    prompt = step.prompt if rows is None else step.prompt.index_select(0, rows)
    eager: dict[str, torch.Tensor] = {}
    columns = [c for c in entries.columns if c in policy.needs or c in policy.feature_names]
    if columns:
        assert entries.table is not None, "entries keep a table wherever a policy has columns"
        table = entries.gather_rows(entries.table, rows)
        got = table.gather(1, order.unsqueeze(-1).expand(-1, -1, table.shape[-1]))
        for name in columns:
            value = got[..., entries.columns.index(name)]
            eager[name] = value if mask is None else value * mask
    for computed in declared(policy.needs, FromPositions):
        value = computed.of(seen, positions)
        eager[computed.name] = value if mask is None else value * mask
    lazy, derived = {}, {}
    log = entries.log
    if log is not None:
        log_rows = torch.arange(entries.layers * entries.rows, device=order.device) if rows is None else rows
        total = log.total.index_select(0, log_rows).gather(1, order)
        derived["qlog_sum"] = total if mask is None else total * mask

        def logged() -> torch.Tensor:
            ring = log.rows.index_select(0, log_rows)
            out = ring.gather(2, order.unsqueeze(1).expand(-1, ring.shape[1], -1))
            return out if mask is None else out * mask.unsqueeze(1)

        lazy["qlog"] = logged
    keys = step.row_keys if rows is None else step.row_keys.index_select(0, rows)
    return TokenState(
        queries=None if policy.queries is None else step_queries(entries, rows, step),
        row_sums={} if entries.row_sums is None else entries.row_sums.read(rows),
        positions=positions,
        stats=Stats(eager, lazy),
        phase=step.phase,
        valid=valid,
        load_kv=lambda: load_kv(entries, rows, order, stores),
        derived=derived,
        lengths=lengths,
        units=positions.shape[0] // entries.heads,
        window=group.window,
        seen=seen,
        prompt=prompt,
        seed=step.seed,
        row_keys=keys.unsqueeze(1),
        rope=row_rope(entries, rows, policy, step) if policy.rope else None,
        budget=group.budget,
        observe=group.observe,
    )


def row_rope(entries: Entries, rows: torch.Tensor | None, policy: Policy, step: StepRows) -> RowRope:
    """The group's rows' RoPE, each row its layer's."""
    assert step.rotaries is not None, "a cache whose score reads RoPE keeps the model's rotaries"
    flat = torch.arange(entries.layers * entries.rows, device=entries.device) if rows is None else rows
    runs = [(step.rotaries[layer], start, end) for layer, start, end in layer_runs(flat, entries.rows)]
    return RowRope(runs, stored_rotated=policy.positions != "reindex")


def step_queries(entries: Entries, rows: torch.Tensor | None, step: StepRows) -> torch.Tensor:
    """The group's rows' queries of this step, [r, group, k, D] (each layer's part from what its attention kept)."""
    flat = torch.arange(entries.layers * entries.rows, device=entries.device) if rows is None else rows
    parts = []
    for layer, start, end in layer_runs(flat, entries.rows):
        kept = step.queries[layer] if layer < len(step.queries) else None
        assert kept is not None, "an evicting step's attention keeps the queries its policy declared"
        parts.append(kept.index_select(0, flat[start:end] - layer * entries.rows - step.first_row))
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def load_kv(
    entries: Entries, rows: torch.Tensor | None, order: torch.Tensor, stores: list[KVStore]
) -> tuple[torch.Tensor, torch.Tensor]:
    """The group's keys and values in sequence order, [r, n, D] (each layer's part from its own store)."""
    flat = torch.arange(entries.layers * entries.rows, device=order.device) if rows is None else rows
    keys, values = [], []
    for layer, start, end in layer_runs(flat, entries.rows):
        k, v = stores[layer].gather(flat[start:end] - layer * entries.rows, order[start:end])
        keys.append(k)
        values.append(v)
    return (keys[0], values[0]) if len(keys) == 1 else (torch.cat(keys), torch.cat(values))


def evict_group(
    entries: Entries,
    rows: torch.Tensor | None,
    n: int,
    group: Group,
    step: StepRows,
    per_head: bool,
    stores: list[KVStore],
    features: Callable[[int, torch.Tensor, torch.Tensor], None],
) -> None:
    """Score the group once and free what it does not keep (merging first where the policy merges)."""
    policy, budget = group.policy, group.budget
    lengths = None
    if per_head:
        lengths = entries.lengths.view(-1) if rows is None else entries.lengths.view(-1).index_select(0, rows)
    state = group_state(entries, rows, n, group, step, lengths, stores)
    if per_head:
        keep = policy.keep_mask(state, budget)
    else:
        kept, evicted = policy.partition(state, budget)
        if not policy.merge:
            entries.keep_sorted(rows, n, kept, evicted)
            return
        keep = torch.zeros_like(state.positions, dtype=torch.bool).scatter_(1, kept, True)
    merged = None
    if isinstance(policy.merge, Merge):
        merged = policy.merge(state, keep)
        flat = torch.arange(entries.layers * entries.rows, device=keep.device) if rows is None else rows
        layer = int(flat[0]) // entries.rows
        local = (flat - layer * entries.rows).unsqueeze(1).expand(-1, n)[keep]
        slots = entries.gather_rows(entries.order, rows)[:, :n][keep]
    entries.keep_mask(rows, keep, state.valid_mask())
    if merged is not None:
        store = stores[layer]
        if entries.row_sums is not None:  # the kept entries' old keys and values leave the sums, the merged join
            entries.row_sums.remove(layer * entries.rows + local, slots.unsqueeze(1))
        store.write(local, slots.unsqueeze(1), merged.keys[keep].to(store.dtype), merged.values[keep].to(store.dtype))
        if entries.row_sums is not None:
            entries.row_sums.add(layer, local, slots.unsqueeze(1))
        if merged.absorbed is not None:
            entries.add_to_column("mass", layer, local, slots, merged.absorbed[keep])
        features(layer, local, slots)
