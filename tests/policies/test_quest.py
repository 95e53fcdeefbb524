"""Quest against the paper's equations (Tang et al. 2024, arXiv:2406.10774), written here in NumPy.

Per page of ``page_size`` positions and per channel, the min and max of the page's keys; a query's bound on a
page is ``sum_c max(q_c · min_c, q_c · max_c)``; each query head attends its ``ceil(budget / page_size)`` pages
of highest bound, the current token's page always among them. The reference builds that mask from the tensors
alone, and the end-to-end check runs the family's own eager attention over transformers' own cache with it.
"""

from __future__ import annotations

import math
import sys
from contextlib import contextmanager
from typing import Any

import numpy as np
import pytest
import torch
import transformers as tf
from engine_run import generate
from family_models import build, family_greedy

from kvbench.engine.engine import DecodeSettings
from kvbench.policies.registry import build_policy
from kvbench.policies.sparsity.quest import Quest


def reference_mask(
    q: np.ndarray, keys: np.ndarray, positions: np.ndarray, seen: np.ndarray, now: int, budget: int, page: int
) -> np.ndarray:
    """One row: q [group, D], keys [n, D], positions [n], seen [n] (bool), the query's position ``now``. Bool
    [group, n]: the keys each query head attends, from the paper's equations."""
    pages = sorted({int(p) // page for p, s in zip(positions, seen) if s})
    lows = {j: keys[seen & (positions // page == j)].min(axis=0) for j in pages}
    highs = {j: keys[seen & (positions // page == j)].max(axis=0) for j in pages}
    out = np.zeros((q.shape[0], len(positions)), dtype=bool)
    want = min(len(pages), max(1, math.ceil(budget / page)))
    for h in range(q.shape[0]):
        bound = {j: float(np.maximum(q[h] * lows[j], q[h] * highs[j]).sum()) for j in pages}
        bound[now // page] = math.inf  # the current token's page
        chosen = sorted(pages, key=lambda j: -bound[j])[:want]
        out[h] = seen & np.isin(positions // page, chosen)
    return out


def test_the_pages_each_query_head_attends_are_the_papers():
    """GQA rows (2 query heads a KV head) of several lengths, free slots and hidden keys, budgets below and above
    the row's length, a page size that splits no row evenly: the mask equals NumPy's from the equations."""
    g = torch.Generator().manual_seed(0)
    rows, group, n, dim, page = 6, 2, 45, 8, 4
    keys = torch.randn(rows, n, dim, generator=g)
    queries = torch.randn(rows, group, dim, generator=g)
    lengths = torch.tensor([45, 40, 33, 45, 12, 3])
    positions = torch.arange(n).expand(rows, n).clone()
    positions[torch.arange(n) >= lengths.unsqueeze(1)] = -1  # free slots
    visible = torch.rand(rows, n, generator=g) > 0.2
    visible[torch.arange(rows), lengths - 1] = True  # the current token is always held and visible
    budgets = torch.tensor([8, 1, 13, 100, 5, 4])
    now = lengths - 1
    quest = Quest(page_size=page, dense_layers=0)
    got = quest.select(queries, keys, positions, visible, now, budgets)
    for r in range(rows):
        seen = (visible[r] & (positions[r] >= 0)).numpy()
        ref = reference_mask(
            queries[r].double().numpy(),
            keys[r].double().numpy(),
            positions[r].numpy(),
            seen,
            int(now[r]),
            int(budgets[r]),
            page,
        )
        assert np.array_equal(got[r].numpy(), ref), f"row {r}"
    assert not got[0].all(dim=-1).any(), "a budget below the length leaves keys out"
    assert not torch.equal(got[0, 0], got[0, 1]), "the heads of a group choose apart"


@contextmanager
def quest_eager(model: Any, quest: Quest, budget: int) -> Any:
    """While active, the family's own eager attention hides from each decode query (one new token) of a layer
    Quest applies to every key outside the pages ``reference_mask`` chooses for it; transformers' own cache holds
    every key, at positions 0..n-1."""
    module = sys.modules[type(model).__module__]
    family_eager = module.eager_attention_forward

    def masked(attn: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: Any, **kwargs: Any):
        if query.shape[2] == 1 and quest.applies(attn.layer_idx):
            hq, hkv, n = query.shape[1], key.shape[1], key.shape[2]
            group = hq // hkv
            positions = np.arange(n)
            allowed = np.concatenate(
                [
                    reference_mask(
                        query[0, h * group : (h + 1) * group, 0].double().numpy(),
                        key[0, h].double().numpy(),
                        positions,
                        np.ones(n, dtype=bool),
                        n - 1,
                        budget,
                        quest.page_size,
                    )
                    for h in range(hkv)
                ]
            )  # [query heads, n]
            hide = torch.zeros(allowed.shape, dtype=query.dtype).masked_fill(
                ~torch.from_numpy(allowed), torch.finfo(query.dtype).min
            )[None, :, None, :]
            mask = hide if mask is None else mask + hide
        return family_eager(attn, query, key, value, mask, **kwargs)

    module.eager_attention_forward = masked
    try:
        yield
    finally:
        module.eager_attention_forward = family_eager


def eager_logits(model: Any, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """The family's logits for ``prompt`` then each of ``tokens`` fed one at a time (teacher-forced)."""
    cache = tf.DynamicCache(config=model.config)
    out = model(input_ids=torch.tensor([prompt]), past_key_values=cache, use_cache=True)
    logits = [out.logits[0, -1].float()]
    for j, token in enumerate(tokens[:-1]):
        at = len(prompt) + j
        out = model(
            input_ids=torch.tensor([[token]]), position_ids=torch.tensor([[at]]), past_key_values=cache, use_cache=True
        )
        logits.append(out.logits[0, -1].float())
    return torch.stack(logits)


PROMPT, NEW, PAGE, BUDGET = 23, 10, 4, 9


def quest_policy(dense_layers: int = 1) -> Any:
    sparsity = {"kind": "quest", "page_size": PAGE, "dense_layers": dense_layers}
    return build_policy({"name": "quest", "score": "none", "sparsity": sparsity})


@pytest.fixture(scope="module")
def llama() -> Any:
    return build("llama")  # GQA: 4 query heads on 2 KV heads, 2 layers


@pytest.fixture(scope="module")
def prompt() -> list[int]:
    return torch.randint(0, 300, (PROMPT,), generator=torch.Generator().manual_seed(1)).tolist()


@torch.inference_mode()
def test_quest_equals_the_familys_eager_attention_masked_to_the_papers_pages(llama, prompt):
    """kvbench's decode under Quest (budget 9 keys: 3 pages of 4 of up to 33 keys; the first layer dense) gives the
    logits of the family's eager attention masked by the NumPy pages, and those differ from the full cache's."""
    policy = quest_policy()
    g = generate(llama, None, prompt, policy, BUDGET, "decode", DecodeSettings(max_new_tokens=NEW), return_logits=True)
    assert policy.sparsity is not None
    with quest_eager(llama, policy.sparsity, BUDGET):
        reference = eager_logits(llama, prompt, g.tokens)
    torch.testing.assert_close(g.logits, reference, rtol=1e-4, atol=1e-4)
    full = eager_logits(llama, prompt, g.tokens)
    assert float((full[1:] - g.logits[1:]).abs().max()) > 1e-2, "the page mask changes the decode"
    torch.testing.assert_close(g.logits[0], full[0], rtol=1e-4, atol=1e-4)  # the prompt is attended in full


@torch.inference_mode()
def test_every_page_is_the_full_cache(llama, prompt):
    """A budget of the whole sequence attends every page in every layer: ``generate``'s tokens and logits."""
    tokens, logits = family_greedy(llama, prompt, NEW)
    g = generate(
        llama,
        None,
        prompt,
        quest_policy(0),
        PROMPT + NEW,
        "decode",
        DecodeSettings(max_new_tokens=NEW),
        stride=7,
        return_logits=True,
    )
    assert g.tokens == tokens
    torch.testing.assert_close(g.logits, logits, rtol=1e-5, atol=1e-5)


@torch.inference_mode()
def test_memory_is_the_full_caches_plus_the_page_bounds(llama, prompt):
    """Nothing is evicted: the row holds every token (budget_achieved 1), its budget column is the attended keys,
    and its resident bytes are the full cache's plus, in each layer Quest applies to, a min and a max key vector
    per page begun, per KV head (counted by hand here); the capacity counts them for every slot."""
    settings = DecodeSettings(max_new_tokens=NEW)
    quest = generate(llama, None, prompt, quest_policy(), BUDGET, "decode", settings).measures
    full = generate(llama, None, prompt, build_policy({"name": "full"}), BUDGET, "decode", settings).measures
    cfg = llama.config
    kv_heads, head_dim = cfg.num_key_value_heads, cfg.hidden_size // cfg.num_attention_heads
    held = PROMPT + NEW - 1  # the last token is chosen, never fed
    per_token = cfg.num_hidden_layers * kv_heads * 2 * head_dim * 4  # float32 keys and values
    assert full.kv_resident_bytes == held * per_token
    pages = math.ceil(held / PAGE)
    bounds = (cfg.num_hidden_layers - 1) * kv_heads * pages * 2 * head_dim * 4  # the dense first layer keeps none
    assert quest.kv_resident_bytes == full.kv_resident_bytes + bounds
    assert quest.kv_resident_peak_bytes == quest.kv_resident_bytes
    capacity = PROMPT + NEW  # a row's slots: every token of the sequence
    bounds_at_capacity = (cfg.num_hidden_layers - 1) * kv_heads * math.ceil(capacity / PAGE) * 2 * head_dim * 4
    assert quest.kv_capacity_bytes == full.kv_capacity_bytes + bounds_at_capacity
    assert quest.budget_tokens == BUDGET and quest.budget_achieved == 1.0 and quest.kept_tokens == held
