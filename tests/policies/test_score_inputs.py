"""What a score may declare besides statistics (``policies.inputs``): the evicting step's queries, before or after
RoPE, and the layer's output projection in its features. Each is checked against what the model itself computed
(hooks on its q_proj and on its attention's rotary inputs, its o_proj weight), not against kvbench's own code.
"""

from __future__ import annotations

from collections.abc import Mapping

import pytest
import torch
from engine_run import generate, generate_batch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from kvbench.engine.engine import DecodeSettings, Request
from kvbench.policies.allocations.adaptive import Adaptive
from kvbench.policies.base import Allocation, Score
from kvbench.policies.inputs import Queries
from kvbench.policies.policy import Policy
from kvbench.policies.registry import build_policy
from kvbench.policies.scopes.everything import All
from kvbench.policies.scores.shared import SharedAcrossHeads
from kvbench.policies.state import TokenState

LAST = 3


class ReadsQueries(Score):
    """Ranks by recency; records the queries the view hands over, by (layer, KV head) row key."""

    def __init__(self, rope: bool):
        self.queries = Queries(last=LAST, rope=rope)
        self.seen: list[tuple[torch.Tensor, torch.Tensor]] = []

    def __call__(self, view: TokenState) -> torch.Tensor:
        assert view.queries is not None
        self.seen.append((view.row_keys.flatten().clone(), view.queries.clone()))
        return view.positions.to(torch.float32)


def record_the_models_queries(model) -> tuple[list[list], list]:
    """Per layer, each forward's q_proj output [1, q, heads × D] and the (cos, sin) its attention rotated with."""
    projected: list[list] = [[] for _ in model.model.layers]
    rotations: list[list] = [[] for _ in model.model.layers]
    handles = []
    for index, layer in enumerate(model.model.layers):
        attn = layer.self_attn
        handles.append(
            attn.q_proj.register_forward_hook(lambda m, i, out, at=index: projected[at].append(out.detach()))
        )
        handles.append(
            attn.register_forward_pre_hook(
                lambda m, a, kw, at=index: rotations[at].append(kw["position_embeddings"]), with_kwargs=True
            )
        )
    return [projected, rotations], handles


@pytest.mark.parametrize("allocation", [Allocation(), Adaptive(floor=0.0)], ids=["uniform", "per-head"])
@pytest.mark.parametrize("rope", [False, True], ids=["before RoPE", "as attended"])
def test_the_view_holds_the_evicting_steps_queries(tiny, random_ids, rope, allocation) -> None:
    model = tiny.model
    cfg = model.config
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    dim, group = cfg.hidden_size // heads, heads // kv_heads
    score = ReadsQueries(rope)
    (projected, rotations), handles = record_the_models_queries(model)
    try:
        policy = Policy("queries", score, All(), allocation=allocation)
        ids = random_ids(30, seed=4)
        generate(model, None, ids, policy, 10, "both", DecodeSettings(max_new_tokens=4), stride=8, fused=False)
    finally:
        for handle in handles:
            handle.remove()
    # Every step evicts once its cache is over the budget: the prompt's chunks 2-4, then each decode step.
    steps = len(projected[0])
    assert len(score.seen) == steps - 1
    for (row_keys, queries), step in zip(score.seen, range(1, steps)):
        for row, key in enumerate(row_keys.tolist()):
            layer, head = divmod(key, kv_heads)
            q = projected[layer][step][0].view(-1, heads, dim).transpose(0, 1)  # [heads, q, D], before RoPE
            if rope:
                cos, sin = rotations[layer][step]
                q = apply_rotary_pos_emb(q.unsqueeze(0), q.unsqueeze(0), cos, sin)[0][0]
            expected = q[head * group : (head + 1) * group, -LAST:]
            torch.testing.assert_close(queries[row], expected, rtol=1e-5, atol=1e-5)


class OutputNorm(Score):
    """CriticalKV's projected value norm, as a feature: ‖W_o v‖₁ over the KV head's GQA group."""

    weights = frozenset({"output_projection"})
    feature_names = frozenset({"projected_l1"})

    def features(
        self, keys: torch.Tensor, values: torch.Tensor, weights: Mapping[str, torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        w = weights["output_projection"]  # [hidden, group × D]
        per_head = w.view(w.shape[0], -1, values.shape[-1])  # [hidden, group, D]
        return {"projected_l1": torch.einsum("ogd,rqd->rqgo", per_head, values.float()).abs().sum(dim=(-1, -2))}

    def __call__(self, view: TokenState) -> torch.Tensor:
        return view.stats["projected_l1"]


@pytest.mark.parametrize("merge", [False, True], ids=["evicting", "merging"])
def test_features_read_the_layers_output_projection(tiny, random_ids, merge) -> None:
    """At every eviction, each held entry's feature is the NumPy-free product of its value with the model's own
    o_proj columns of its KV head's query heads (merged values included)."""
    model = tiny.model
    cfg = model.config
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    dim, group = cfg.hidden_size // heads, heads // kv_heads
    calls = []

    class Checked(OutputNorm):
        def __call__(self, view: TokenState) -> torch.Tensor:
            calls.append(view.phase)
            for row, key in enumerate(view.row_keys.flatten().tolist()):
                layer, head = divmod(key, kv_heads)
                w = model.model.layers[layer].self_attn.o_proj.weight.detach().double()
                expected = sum(
                    (view.values[row].double() @ w[:, j * dim : (j + 1) * dim].T).abs().sum(dim=-1)
                    for j in range(head * group, (head + 1) * group)
                )
                torch.testing.assert_close(view.stats["projected_l1"][row].double(), expected, rtol=1e-4, atol=1e-4)
            return super().__call__(view)

    policy = Policy("critical", Checked(), All(), merge=merge)
    generate(model, None, random_ids(30, seed=6), policy, 10, "both", DecodeSettings(max_new_tokens=3), stride=8)
    scored_apart = cfg.num_hidden_layers if merge else 1  # merging layers are scored one at a time
    assert calls.count("prefill") == 3 * scored_apart and calls.count("decode") == 2 * scored_apart


class QueryAffinity(Score):
    """The logit each entry's key gets from the mean of the step's queries (before RoPE): depends on the queries."""

    queries = Queries(last=LAST, rope=False)

    def __call__(self, view: TokenState) -> torch.Tensor:
        assert view.queries is not None
        return torch.einsum("rnd,rd->rn", view.keys.float(), view.queries.float().mean(dim=(1, 2)))


@pytest.mark.parametrize("allocation", [Allocation(), Adaptive(floor=0.0)], ids=["uniform", "per-head"])
def test_each_sequence_of_a_batch_sees_its_own_queries(tiny, random_ids, allocation) -> None:
    """Decoded three at a time, two slots: each sequence keeps what it keeps alone, so its tokens are the same."""
    policy = Policy("affinity", QueryAffinity(), All(), allocation=allocation)
    settings = DecodeSettings(max_new_tokens=8)
    reqs = [Request(random_ids(20 + 5 * i, seed=10 + i), settings=settings) for i in range(3)]
    batched = generate_batch(tiny.model, None, reqs, policy, 8, "both", batch_size=2, stride=8)
    for r, b in zip(reqs, batched):
        assert b.tokens == generate(tiny.model, None, r.input_ids, policy, 8, "both", settings, stride=8).tokens


def test_wrappers_forward_every_declaration() -> None:
    inner = ReadsQueries(rope=False)
    inner.needs = frozenset({"acc"})
    wrapped = SharedAcrossHeads(inner)
    assert (wrapped.queries, wrapped.needs, wrapped.weights) == (inner.queries, inner.needs, inner.weights)
    assert SharedAcrossHeads(OutputNorm()).weights == {"output_projection"}
    shared = build_policy({"name": "s", "score": {"kind": "value_aware", "base": "snapkv", "shared": True}})
    assert shared.history == 32 and shared.needs == {"qlog", "count"} and shared.unsupported_stages == ("decode",)
    assert shared.score.feature_names == {"value_norm"}


def test_an_unknown_weight_is_refused() -> None:
    class Unknown(OutputNorm):
        weights = frozenset({"gate_projection"})

    with pytest.raises(ValueError, match="unknown weight.*gate_projection.*output_projection"):
        Policy("u", Unknown(), All())
