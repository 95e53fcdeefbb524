"""scripts/peer_agreement.py without the peer: the row comparison and its reasons on kept sets made by hand, the
method table's configs, and kvbench's side (kept positions and the scores behind them) on the tiny model."""

from __future__ import annotations

import ast
import sys

import numpy as np
import pytest
from conftest import REPO

from kvbench.models import load_model
from kvbench.policies.registry import build_policy

sys.path.insert(0, str(REPO / "scripts"))
import peer_agreement  # noqa: E402
from peer_compare import Agreement, compare, compare_row, differences, jaccard, table  # noqa: E402


def mask(n: int, kept: list[int]) -> np.ndarray:
    out = np.zeros(n, dtype=bool)
    out[kept] = True
    return out


def one_row(ours: list[int], peer: list[int], peer_scores: list[float], eps: float = 1e-5) -> str:
    n = len(peer_scores)
    scores = np.array(peer_scores, dtype=np.float32)
    return compare_row(mask(n, ours), mask(n, peer), scores, np.zeros(n, np.float32), eps)[0]


def test_identical_sets_agree():
    assert one_row([0, 2, 3], [0, 2, 3], [5, 1, 4, 3]) == "identical"


def test_a_swap_of_equal_scores_at_the_cut_is_a_tie():
    # The peer keeps 0 and 2 (scores 5, 3); 2 and 3 tie at the cut, so keeping 0 and 3 is as good a top-2.
    assert one_row([0, 3], [0, 2], [5, 1, 3, 3]) == "tie"


def test_a_tie_is_within_eps_of_the_cut_and_no_further():
    assert one_row([0, 3], [0, 2], [5, 1, 3.0, 3.0 - 3e-6]) == "tie"
    assert one_row([0, 3], [0, 2], [5, 1, 3.0, 3.0 - 3e-4]) == "unexplained"
    assert one_row([0, 3], [0, 2], [5, 1, 3.0, 3.0 - 3e-4], eps=1e-3) == "tie"


def test_a_swap_the_peer_scores_apart_is_unexplained():
    assert one_row([0, 1], [0, 2], [5, 1, 3, 2]) == "unexplained"


def test_different_counts_are_a_kept_count_difference():
    assert one_row([0, 2, 3], [0, 2], [5, 1, 3, 2]) == "kept count"
    a = compare(Agreement(), 0, mask(4, [0, 1, 3])[None, None], mask(4, [0, 2])[None, None], *np.zeros((2, 1, 1, 4)))
    assert a.reasons == {"kept count": 1} and a.nested == 0  # neither set inside the other


def test_unrecorded_or_protected_scores_are_never_a_tie():
    assert one_row([0, 3], [0, 2], [5, 1, float("nan"), 3]) == "unexplained"
    assert one_row([0, 3], [0, 2], [5, 1, float("inf"), float("inf")]) == "unexplained"


def test_jaccard():
    assert jaccard(mask(4, [0, 1]), mask(4, [1, 2])) == pytest.approx(1 / 3)
    assert jaccard(mask(4, []), mask(4, [])) == 1.0


def test_compare_counts_rows_and_keeps_both_scores_of_the_swapped_entries():
    layers, heads, n = 2, 3, 6
    peer = np.zeros((layers, heads, n), dtype=bool)
    peer[..., :3] = True
    ours = peer.copy()
    ours[1, 2] = mask(n, [0, 1, 3])  # swaps 2 for 3: a tie under the peer's scores
    ours[0, 1] = mask(n, [0, 1, 2, 3])  # one more kept
    peer_scores = np.tile(np.array([6, 5, 4, 4, 1, 0], dtype=np.float32), (layers, heads, 1))
    our_scores = peer_scores * 2
    a = compare(Agreement(), 7, ours, peer, peer_scores, our_scores)
    assert (a.rows, a.identical) == (6, 4)
    assert a.reasons == {"tie": 1, "kept count": 1}
    tie = next(d for d in a.diffs if d.reason == "tie")
    assert (tie.prompt, tie.layer, tie.head, tie.peer_only, tie.ours_only) == (7, 1, 2, [2], [3])
    assert tie.peer_scores == {2: 4.0, 3: 4.0} and tie.our_scores == {2: 8.0, 3: 8.0}
    assert a.mean_jaccard == pytest.approx((4 + 0.5 + 0.75) / 6)
    assert a.nested == 1 and next(d for d in a.diffs if d.reason == "kept count").nested
    assert differences(a) == "kept count: 1 (1 nested), tie: 1"
    row = "| `snapkv` | `SnapKVPress()` | `policy=snapkv` | 6 | 66.7 % | 0.8750 | kept count: 1 (1 nested), tie: 1 |"
    assert row in table([("snapkv", "SnapKVPress()", "policy=snapkv", a)])
    with pytest.raises(ValueError, match="cannot be compared"):
        compare(Agreement(), 0, ours[:1], peer, peer_scores, our_scores)


def test_the_page_is_rewritten_between_its_markers_only():
    page = f"intro\n{peer_agreement.BEGIN}\nold\n{peer_agreement.END}\noutro\n"
    assert (
        peer_agreement.with_section(page, "new") == f"intro\n{peer_agreement.BEGIN}\nnew\n{peer_agreement.END}\noutro\n"
    )
    with pytest.raises(SystemExit, match="markers"):
        peer_agreement.with_section("no markers", "new")


@pytest.mark.parametrize("name", sorted(peer_agreement.METHODS))
def test_every_method_names_a_config_that_builds_with_its_overrides(name):
    method = peer_agreement.METHODS[name]
    config = peer_agreement.policy_config(method)
    for key, value in method.overrides.items():
        node = config
        for part in key.split("."):
            node = node[part]
        assert node == value, f"{name}: policy.{key} did not take"
    built = build_policy(config)
    assert ("channels" in method.kinds) == (built.channels is not None)  # a channel method prunes channels
    assert ("tokens" in method.kinds) == built.evicts


def test_an_override_of_a_missing_key_is_refused():
    with pytest.raises(Exception, match="bogus"):
        peer_agreement.policy_config(peer_agreement.Method("SnapKVPress", "snapkv", overrides={"score.bogus": 1}))


def test_kvpress_kept_count_rounds_down():
    assert peer_agreement.kvpress_kept_count(1001, 0.5) == 500
    assert peer_agreement.kvpress_kept_count(10, 0.75) == 2
    assert peer_agreement.kvpress_kept_count(3, 0.99) == 1


def test_a_per_layer_press_is_budgeted_at_its_mean_ratio():
    """PerLayerCompressionPress evicts compression_ratios[l] in layer l: kvbench's run budget is their mean
    (layers_snapkv.yaml's shares 0.75, 0.5, 0.25, ten layers each), whatever --ratio says."""
    method = peer_agreement.METHODS["layers_snapkv"]
    assert method.kwargs["compression_ratios"] == [0.25] * 10 + [0.5] * 10 + [0.75] * 10
    assert method.mean_ratio(0.9) == 0.5 and peer_agreement.METHODS["snapkv"].mean_ratio(0.9) == 0.9


def test_a_press_that_sets_its_own_kept_count_gets_no_ratio_and_an_uncapped_budget():
    method = peer_agreement.METHODS["simlayerkv"]
    assert method.press_spec()["ratio"] is False and method.budget(1001, 0.5, "count") == 1.0
    snapkv = peer_agreement.METHODS["snapkv"]
    assert snapkv.press_spec()["ratio"] is True and snapkv.budget(1001, 0.5, "count") == 500
    assert snapkv.budget(1001, 0.5, "fraction") == 0.5


def test_finchs_question_goes_to_both_sides():
    """kvpress's FinchPress finds the question after its delimiter, kvbench takes it as the suffix: the method names
    its length for both, and only for a method that observes one."""
    finch = peer_agreement.METHODS["finch"]
    assert finch.press_spec()["question"] == 32 > 0 == peer_agreement.METHODS["snapkv"].press_spec()["question"]
    assert build_policy(peer_agreement.policy_config(finch)).question


def test_the_peer_side_imports_nothing_from_kvbench():
    tree = ast.parse((REPO / "scripts" / "peer_kvpress_side.py").read_text(encoding="utf-8"))
    modules = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    modules |= {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert "kvpress" in modules and not any(m.split(".")[0] == "kvbench" for m in modules)


@pytest.mark.parametrize(
    ("policy", "overrides"),
    [("snapkv", {"score.window": 8}), ("adakv", {"score.window": 8}), ("tova", {})],
)
def test_kvbench_keeps_the_top_of_the_scores_it_records(policy, overrides):
    """kvbench's side, read back: every row keeps ``budget`` entries in all (per head under Ada-KV), and they
    are the highest of the scores the probe recorded."""
    lm = load_model("tiny", source="tiny", dtype="float32", device="cpu")
    ids = np.random.default_rng(0).integers(0, 250, 96).tolist()
    budget = 40
    kept, scores = peer_agreement.run_kvbench(lm, peer_agreement.Method("P", policy, overrides=overrides), ids, budget)
    layers, heads = lm.model.config.num_hidden_layers, lm.model.config.num_key_value_heads
    assert kept.shape == scores.shape == (layers, heads, 96)
    assert not np.isnan(scores).any()
    assert (kept.sum(axis=(1, 2)) == heads * budget).all()
    for layer in range(layers):
        flat = scores[layer].reshape(1, -1) if policy == "adakv" else scores[layer]  # Ada-KV ranks across heads
        flat_kept = kept[layer].reshape(flat.shape)
        for r in range(flat.shape[0]):
            assert flat[r][flat_kept[r]].min() >= flat[r][~flat_kept[r]].max()


def test_kvzip_prompts_start_with_the_chat_header_and_keep_a_whole_budget_per_row():
    """KVzipPress skips the chat template's opening at the start of every prompt, so both sides get it; it prunes
    ⌊rows·n·ratio⌋ over every row at once, which kvbench's whole tokens per row equal only at an even n (ratio
    0.5, 90 rows): an odd prompt loses its last token. Other methods get the context as it is."""
    kvzip, header, context = peer_agreement.METHODS["kvzip"], [7, 8, 9], list(range(100, 108))
    assert kvzip.chat_header and peer_agreement.METHODS["kvzip_plus"].kwargs == {"kvzip_plus_normalization": True}
    assert kvzip.prompt(context, header, 90, 0.5) == header + context[:-1]  # 11 ids, cut to 10
    assert kvzip.prompt(context[:-1], header, 90, 0.5) == header + context[:-1]
    assert peer_agreement.pooled_kept(11, 90, 0.5) == 495 != 90 * peer_agreement.kvpress_kept_count(11, 0.5)
    assert peer_agreement.pooled_kept(10, 90, 0.5) == 450 == 90 * peer_agreement.kvpress_kept_count(10, 0.5)
    assert peer_agreement.METHODS["snapkv"].prompt(context, header, 90, 0.5) == context


def test_a_composed_press_names_its_parts_each_with_the_ratio_it_takes_alone():
    """kvpress's ComposedPress([SnapKVPress, ThinKPress]): SnapKV takes the run's compression ratio, ThinK its own
    channel ratio; both kinds of kept set are compared, and kvbench's budget is kvpress's kept count of tokens."""
    method = peer_agreement.METHODS["think_snapkv"]
    spec = method.press_spec()
    assert spec["press"] == "ComposedPress" and spec["ratio"] is False
    assert [(p["press"], p["ratio"], p["channels"]) for p in spec["presses"]] == [
        ("SnapKVPress", True, False),
        ("ThinKPress", False, True),
    ]
    assert method.kinds == ("tokens", "channels")
    assert method.press_label() == (
        "ComposedPress([SnapKVPress(window_size=64, kernel_size=5), "
        "ThinKPress(key_channel_compression_ratio=0.5, window_size=32)])"
    )
    assert method.budget(1001, 0.5, "count") == 500
    assert peer_agreement.METHODS["think"].kinds == ("channels",) and peer_agreement.METHODS["tova"].kinds == (
        "tokens",
    )


def test_kvbench_side_of_a_composed_method_keeps_tokens_then_the_top_channels_of_each_row():
    """One run gives both kept sets: every row keeps ``budget`` tokens, and D - int(D · ratio) key channels, the
    highest of the channel scores the probe recorded."""
    lm = load_model("tiny", source="tiny", dtype="float32", device="cpu")
    ids = np.random.default_rng(0).integers(0, 250, 64).tolist()
    method = peer_agreement.Method(
        "ComposedPress",
        "think_snapkv",
        overrides={"score.window": 8, "channels.window": 8},
        parts=(peer_agreement.METHODS["think_snapkv"].parts),
    )
    got = peer_agreement.run_kvbench_kinds(lm, method, ids, 24)
    layers, heads = lm.model.config.num_hidden_layers, lm.model.config.num_key_value_heads
    kept, _ = got["tokens"]
    assert kept.shape == (layers, heads, 64) and (kept.sum(axis=-1) == 24).all()
    channels, scores = got["channels"]
    dim = channels.shape[-1]
    assert channels.shape == scores.shape == (layers, heads, dim)
    assert (channels.sum(axis=-1) == dim - int(dim * 0.5)).all()
    assert (np.where(channels, scores, np.inf).min(axis=-1) >= np.where(channels, -np.inf, scores).max(axis=-1)).all()
