"""The query log under eviction: entries keep their slot while held, and the log keeps a running sum. Checked
against a reference that follows each entry by its position, through prompt chunks, many decode steps that each
evict, and several wraps of the ring, with uniform and per-head (Ada-KV) rows."""

from __future__ import annotations

from collections import defaultdict

import pytest
import torch

from kvbench.engine.cache.cache import KVCache
from kvbench.engine.cache.query_log import QueryLog
from kvbench.engine.plan import LayerPlan
from kvbench.engine.step import Phase, Step
from kvbench.policies.allocations.adaptive import Adaptive
from kvbench.policies.base import Allocation
from kvbench.policies.policy import Policy
from kvbench.policies.scopes.everything import All
from kvbench.policies.scores.snapkv import SnapKV

HEADS, DIM, HISTORY, BUDGET = 2, 4, 5, 7


def reference_sums(log: dict[int, list[tuple[int, float]]], fed: int, held: list[int]) -> list[float]:
    """Per held position, the sum of what the last HISTORY queries (positions fed - HISTORY .. fed - 1) gave it."""
    return [sum(v for t, v in log[p] if t >= fed - HISTORY) for p in held]


@pytest.mark.parametrize("chunks", [[6, 3] + [1] * 23, [6, 6] + [1] * 23])
@pytest.mark.parametrize("allocation", [Allocation(), Adaptive(floor=0.0)], ids=["uniform", "per-head"])
@pytest.mark.parametrize("kernel", [1, 3])
def test_running_sum_follows_entries_through_evictions(kernel, allocation, chunks):
    g = torch.Generator().manual_seed(kernel)
    policy = Policy("snap", SnapKV(window=HISTORY, kernel_size=kernel), All(), allocation=allocation)
    plans = [LayerPlan(BUDGET, prefill=16, decode=16, total=64)]
    cache = KVCache([plans], policy)
    cache.assign(0, plans)
    layer = cache.layers[0]
    refs = [defaultdict(list) for _ in range(HEADS)]  # per head: position -> [(query position, value)]
    fed = 0
    for q in chunks:  # a prompt of two chunks (the second evicts), then decode steps that each evict
        phase = Phase.prefill if q > 1 else Phase.decode
        step = Step(range(1), [list(range(fed, fed + q))], phase, evicts=True, collects=True)
        cache.begin(step)
        keys, _ = cache.update(
            torch.randn(1, HEADS, q, DIM, generator=g), torch.randn(1, HEADS, q, DIM, generator=g), 0
        )
        n = keys.shape[2]
        visible = torch.ones(HEADS, n, dtype=torch.bool)
        if layer.visible is not None:
            visible[:, : layer.visible.shape[1]] = layer.visible
        visible &= layer.key_positions >= 0
        r = min(q, HISTORY)
        rows = torch.rand(HEADS, r, n, generator=g) * visible.unsqueeze(1)
        for i in range(r):  # query i of the step's last r sees the past and the new entries up to itself
            if q > 1:
                rows[:, i, n - r + i + 1 :] = 0.0
            for h in range(HEADS):
                for j in visible[h].nonzero().flatten().tolist():
                    refs[h][int(layer.key_positions[h, j])].append((fed + q - r + i, float(rows[h, i, j])))
        layer.record({"qlog": rows, "qlog_nvis": torch.full((HEADS, r), float(n))})
        cache.finish(step)
        fed += q
        state = cache.layer_state(0)
        for h, held in enumerate(state.lengths().tolist()):
            expected = reference_sums(refs[h], fed, state.positions[h, :held].tolist())
            torch.testing.assert_close(state.derived("qlog_sum", None)[h, :held], torch.tensor(expected))
        torch.testing.assert_close(state.stats["qlog"].sum(dim=1), state.derived("qlog_sum", None))
    lengths = cache.layer_state(0).lengths().tolist()
    assert sum(lengths) == HEADS * BUDGET and fed > 2 * BUDGET  # entries were evicted all along


def test_the_running_sum_is_rebuilt_when_the_ring_wraps():
    """float32 cannot hold 1e8 + 1: updating the sum alone would lose the small values for good once the large
    one leaves the ring; rebuilding it from the rows at each wrap gives the exact sum again."""
    log = QueryLog(1, 2, 3, torch.device("cpu"))
    for p, value in enumerate([1e8, 1.0, 1.0, 1.0, 1.0, 1.0]):
        log.append(
            slice(0, 1),
            torch.full((1, 1, 2), value),
            torch.ones(1, 1),
            torch.tensor([p % 3]),
            [0] if p % 3 == 2 else [],
        )
    assert log.total.tolist() == [[3.0, 3.0]]
    assert log.rows[0].sum(dim=0).tolist() == [3.0, 3.0]
