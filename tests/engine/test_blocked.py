"""The blocked attention pass against NumPy: every statistic and the output, in every block configuration
(one block, blocks that straddle the diagonal, blocks that skip keys before their window, a chunk after a
kept past with holes), with GQA groups of one and of several heads."""

import numpy as np
import pytest
import torch

from kvbench.engine import blocked
from kvbench.engine.visibility import KeyAccess, Window
from kvbench.policies.statistics import Collecting

NEEDS = frozenset({"acc", "sumsq", "last", "qlog"})
HISTORY = 3


def numpy_attention(Q, K, V, past, k_pos, q_pos, visible_past, window, softcap):
    """Per query head: scaled logits, capped, masked (causal by index, the hidden past, the window by
    position), softmax; then the GQA mean per KV head and its statistics."""
    hq, q, d = Q.shape
    hkv, n, _ = K.shape
    group = hq // hkv
    logits = np.einsum("hqd,hnd->hqn", Q.astype(np.float64), np.repeat(K, group, 0).astype(np.float64)) * d**-0.5
    if softcap is not None:
        logits = softcap * np.tanh(logits / softcap)
    allowed = np.broadcast_to(np.arange(n)[None, :] <= np.arange(q)[:, None] + past, (hkv, q, n)).copy()
    if visible_past is not None:
        allowed[:, :, :past] &= visible_past[:, None, :]
    if window is not None:
        allowed &= (q_pos[:, None] - k_pos[None, :] < window)[None]
    logits = np.where(np.repeat(allowed, group, 0), logits, -np.inf)
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    output = np.einsum("hqn,hnd->qhd", p, np.repeat(V, group, 0).astype(np.float64))
    mean = p.reshape(hkv, group, q, n).mean(1)
    return {
        "acc": mean.sum(1),
        "sumsq": (mean**2).sum(1),
        "last": mean[:, -1],
        "qlog": mean[:, -HISTORY:],
        "qlog_nvis": allowed[:, -HISTORY:].sum(-1).astype(np.float64),
        "output": output,
    }


CASES = {  # name: (hq, hkv, past, q, window, softcap, hide past entries)
    "one chunk, causal, GQA": (4, 2, 0, 19, None, None, False),
    "chunk after a past, causal, MHA": (2, 2, 6, 13, None, None, False),
    "chunk after a past with hidden entries": (6, 2, 7, 11, None, None, True),
    "sliding window, one chunk": (4, 1, 0, 23, 5, None, False),
    "sliding window after a past with holes, softcapped": (4, 2, 6, 15, 6, 3.0, True),
}


@pytest.mark.parametrize("block", [1 << 22, 400, 7])  # one block; a few queries per block; one query per block
@pytest.mark.parametrize("case", list(CASES))
def test_blocked_pass_equals_numpy(case, block, monkeypatch):
    monkeypatch.setattr(blocked, "STATS_BLOCK_ELEMENTS", block)
    hq, hkv, past, q, window, softcap, hide = CASES[case]
    n, d = past + q, 8
    rng = np.random.default_rng(len(case) * 31 + block)
    Q, K, V = (rng.normal(size=s).astype(np.float32) * 1.5 for s in ((hq, q, d), (hkv, n, d), (hkv, n, d)))
    held = np.sort(rng.choice(np.arange(2 * past), size=past, replace=False)) if past else np.array([], int)
    k_pos = np.concatenate([held, 2 * past + np.arange(q)])
    q_pos = k_pos[past:]
    visible_past = rng.random((hkv, past)) > 0.3 if hide else None
    expected = numpy_attention(Q, K, V, past, k_pos, q_pos, visible_past, window, softcap)
    t = lambda a: torch.tensor(a).unsqueeze(0)  # noqa: E731
    win = None if window is None else Window(window, torch.tensor(k_pos).unsqueeze(0), torch.tensor(q_pos).unsqueeze(0))
    hidden = None if visible_past is None else torch.tensor(visible_past)
    schedule = list(blocked.query_blocks(0, q, past, n, hq, win))
    if block == 7:  # the configurations the case is meant to reach
        assert len(schedule) == q
        assert (window is None) or any(lo > 0 for _, _, lo in schedule)
    if block == 400 and window is None:
        assert 1 < len(schedule) < q  # blocks of several queries, each straddling the diagonal
    access = KeyAccess(d**-0.5, past, hidden, win, softcap)
    got = blocked.attention_statistics(t(Q), t(K), access, Collecting(NEEDS, HISTORY), t(V))
    for name, ref in expected.items():
        value = got[name][0] if name == "output" else got[name]
        np.testing.assert_allclose(value.double().numpy(), ref, rtol=2e-5, atol=2e-6, err_msg=name)
    # Each statistic alone (the sums alone skip the group's mean rows; the last rows alone skip the rest).
    for need in ("acc", "sumsq", "last", "qlog"):
        alone = blocked.attention_statistics(t(Q), t(K), access, Collecting(frozenset({need}), HISTORY))
        assert set(alone) == {need} | ({"qlog_nvis"} if need == "qlog" else set())
        for name, value in alone.items():
            np.testing.assert_allclose(value.double().numpy(), expected[name], rtol=2e-5, atol=2e-6, err_msg=name)


def test_first_keys_holds_for_keys_in_any_order():
    """A key before the returned index is hidden from the query (and from every later one)."""
    positions = torch.tensor([[0, 9, 1, 2, 10, 3, 11, 12], [0, 1, 2, 3, 4, 10, 11, 12]])
    queries = torch.tensor([10, 11, 12, 13])
    window = Window(3, positions, queries.unsqueeze(0))
    firsts = window.first_keys([0, 1, 2, 3])
    for i, first in enumerate(firsts):
        assert bool((queries[i] - positions[:, :first] >= 3).all())
        assert bool((queries[i] - positions[:, first] < 3).any())  # and it is the first that is not


@pytest.mark.parametrize("extreme", ["overflow", "underflow"])
def test_logits_beyond_float32_exponentials_are_computed_again_shifted(extreme, monkeypatch):
    """The unshifted exponentials hold only inside float32's range; outside it the step is redone with the
    row maximum subtracted, and the statistics are still NumPy's."""
    calls = []
    original = blocked._blocked_pass
    monkeypatch.setattr(blocked, "_blocked_pass", lambda *args: calls.append(args[-1]) or original(*args))
    rng = np.random.default_rng(11)
    hq, hkv, q, d = 4, 2, 9, 8
    K = (np.abs(rng.normal(size=(hkv, q, d))) + 1).astype(np.float32)
    V = rng.normal(size=(hkv, q, d)).astype(np.float32)
    Q = (
        (rng.normal(size=(hq, q, d)) * 40).astype(np.float32)
        if extreme == "overflow"
        else np.full((hq, q, d), -40.0, dtype=np.float32)
    )  # every logit below -100: each row's sum underflows
    expected = numpy_attention(Q, K, V, 0, np.arange(q), np.arange(q), None, None, None)
    t = lambda a: torch.tensor(a).unsqueeze(0)  # noqa: E731
    got = blocked.attention_statistics(t(Q), t(K), KeyAccess(d**-0.5), Collecting(NEEDS, HISTORY), t(V))
    assert calls == [False, True]
    for name, ref in expected.items():
        value = got[name][0] if name == "output" else got[name]
        np.testing.assert_allclose(value.double().numpy(), ref, rtol=2e-5, atol=2e-6, err_msg=name)
    calls.clear()
    blocked.attention_statistics(t(Q / 100), t(K), KeyAccess(d**-0.5), Collecting(NEEDS, HISTORY), t(V))
    assert calls == [False]  # ordinary logits: one pass


def test_blocks_split_across_threads_give_the_one_thread_statistics(monkeypatch):
    """The threads' shares add up to the single-threaded pass (to float rounding), under inference mode as
    the engine runs it, and the caller's intra-op thread count is left as it was."""
    from kvbench.engine.workers import split_across_threads

    monkeypatch.setattr(blocked, "STATS_BLOCK_ELEMENTS", 4 * 300 * 20)  # blocks of 20 queries: 15 to share

    rng = np.random.default_rng(2)
    t = lambda *s: torch.tensor(rng.normal(size=s).astype(np.float32)).unsqueeze(0)  # noqa: E731
    Q, K, V = t(4, 300, 8), t(2, 300, 8), t(2, 300, 8)
    before = torch.get_num_threads()
    results = {}
    try:
        for threads in (1, 3):
            torch.set_num_threads(threads)
            with torch.inference_mode():
                results[threads] = blocked.attention_statistics(Q, K, KeyAccess(8**-0.5), Collecting(NEEDS, HISTORY), V)
            assert torch.get_num_threads() == threads
            if torch.backends.mkl.is_available():  # the threads' one-thread setting is global to MKL
                assert f"mkl_get_max_threads() : {threads}" in torch.__config__.parallel_info()
        assert [len(share) for share in split_across_threads(list, list(range(7)), torch.device("cpu"))] == [3, 2, 2]
    finally:
        torch.set_num_threads(before)
    for name, value in results[1].items():
        torch.testing.assert_close(results[3][name], value, rtol=1e-5, atol=1e-6)
