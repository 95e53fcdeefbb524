"""The query log under eviction: entries keep a slot while held (a uniform layer's slot ids, a pooled layer's
rows), and the log keeps a running sum. Checked against a reference that follows each entry by its position,
through prompt chunks, many decode steps that each evict, and several wraps of the ring."""
from __future__ import annotations

from collections import defaultdict

import pytest
import torch

from kvbench.engine.cache import BudgetedCache, LayerPlan
from kvbench.engine.query_log import QueryLog
from kvbench.policies.allocation import Adaptive
from kvbench.policies.base import Policy
from kvbench.policies.scopes import Everything
from kvbench.policies.scores import ObservationWindow

HEADS, DIM, HISTORY, BUDGET = 2, 4, 5, 7


def reference_sums(log: dict[int, list[tuple[int, float]]], step: int, held: list[int]) -> list[float]:
    """Per held position, the sum of what the last HISTORY logged queries gave it."""
    return [sum(v for t, v in log[p] if t > step - HISTORY) for p in held]


@pytest.mark.parametrize("kernel", [1, 3])
def test_running_sum_follows_entries_through_evictions(kernel):
    g = torch.Generator().manual_seed(0)
    policy = Policy("snap", ObservationWindow(window=HISTORY, kernel_size=kernel), Everything())
    cache = BudgetedCache([LayerPlan(BUDGET, 12)], policy)
    layer = cache.layers[0]
    refs = [defaultdict(list) for _ in range(HEADS)]  # per head: position -> [(query step, value)]
    step, fed = 0, 0
    for q in [6, 3] + [1] * 23:  # a prompt of two chunks (the second evicts), then decode steps
        positions = torch.arange(fed, fed + q)
        cache.begin_step(positions, evicting=True, phase="prefill" if q > 1 else "decode")
        layer.update(torch.randn(1, HEADS, q, DIM, generator=g), torch.randn(1, HEADS, q, DIM, generator=g))
        n = layer.length + q
        held = layer.positions[:, :n].tolist()
        r = min(q, HISTORY)
        rows = torch.rand(HEADS, r, n, generator=g)
        for i in range(r):  # query i of the step's last r sees the past and the new entries up to itself
            rows[:, i, n - r + i + 1 :] = 0.0
            for h in range(HEADS):
                for j, p in enumerate(held[h]):
                    refs[h][p].append((step + i, float(rows[h, i, j])))
        cache.after_attention(0, q, {"qlog": rows, "qlog_nvis": torch.full((HEADS, r), float(n))})
        step, fed = step + r, fed + q
        state = layer.state()
        for h in range(HEADS):
            expected = reference_sums(refs[h], step - 1, state.positions[h].tolist())
            torch.testing.assert_close(state.derived("qlog_sum", None)[h], torch.tensor(expected))
        torch.testing.assert_close(state.stats["qlog"].sum(dim=1), state.derived("qlog_sum", None))
    assert layer.length == BUDGET and fed > 2 * BUDGET  # entries were evicted all along


def test_pooled_log_follows_entries_through_evictions():
    """Ada-KV's pool: freed rows are handed to new entries of any head, a prompt chunk's eviction packs the
    pool (``make_dense``), decode steps log over the pool's rows, prompt chunks over a padded per-head view."""
    g = torch.Generator().manual_seed(1)
    policy = Policy("ada", ObservationWindow(window=HISTORY, kernel_size=1), Everything(), allocation=Adaptive(floor=0.0))
    cache = BudgetedCache([LayerPlan(BUDGET, 12)], policy)
    layer = cache.layers[0]
    refs = [defaultdict(list) for _ in range(HEADS)]
    step, fed = 0, 0
    for q in [6, 6] + [1] * 23:
        cache.begin_step(torch.arange(fed, fed + q), evicting=True, phase="prefill" if q > 1 else "decode")
        keys, _ = layer.update(torch.randn(1, HEADS, q, DIM, generator=g), torch.randn(1, HEADS, q, DIM, generator=g))
        r = min(q, HISTORY)
        if layer.view_index is None:  # a decode step: one row per pool row, non-zero only in the row's own head
            rows_pos = layer.positions[0, : keys.shape[2]]
            visible = layer.pool_bias == 0  # [H, span]: each head's own rows
            view_pos = rows_pos.expand(HEADS, -1)
        else:  # a prompt chunk: each head's past (padded) then its new rows
            past = keys.shape[2] - q
            visible = torch.ones(HEADS, keys.shape[2], dtype=torch.bool)
            if layer.visible_past is not None:
                visible[:, :past] = layer.visible_past
            view_pos = layer.positions[0][layer.view_index]
        rows = torch.rand(HEADS, r, keys.shape[2], generator=g) * visible.unsqueeze(1)
        if layer.view_index is not None:
            for i in range(r):  # causal within the chunk
                rows[:, i, keys.shape[2] - r + i + 1 :] = 0.0
        for h in range(HEADS):
            for i in range(r):
                for j in visible[h].nonzero().flatten().tolist():
                    refs[h][int(view_pos[h, j])].append((step + i, float(rows[h, i, j])))
        cache.after_attention(0, q, {"qlog": rows, "qlog_nvis": torch.full((HEADS, r), 1.0)})
        step, fed = step + r, fed + q
        state = layer.state()
        for h, n in enumerate(layer.head_lengths()):
            expected = reference_sums(refs[h], step - 1, state.positions[h, :n].tolist())
            torch.testing.assert_close(state.derived("qlog_sum", None)[h, :n], torch.tensor(expected))
    lengths = layer.head_lengths()
    assert sum(lengths) == HEADS * BUDGET and len(set(lengths)) > 1 and fed > 2 * BUDGET


def test_the_running_sum_is_rebuilt_when_the_ring_wraps():
    """float32 cannot hold 1e8 + 1: updating the sum alone would lose the small values for good once the large
    one leaves the ring; rebuilding it from the rows at each wrap gives the exact sum again."""
    log = QueryLog(1, 4, 3, 1, torch.device("cpu"))
    ids = torch.tensor([[2, 0]])
    log.clear(ids)
    for value in [1e8, 1.0, 1.0, 1.0, 1.0, 1.0]:
        log.append(torch.full((1, 1, 2), value), torch.ones(1, 1), ids)
    assert log.sums(ids).tolist() == [[3.0, 3.0]]
    assert log.gathered(ids)[0].sum(dim=0).tolist() == [3.0, 3.0]
