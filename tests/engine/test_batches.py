"""Batches: each sequence of a batch gives exactly the tokens of its batch-1 run, and logits within ``TOL``.

The reference is the same engine at batch size 1, which the rest of the suite checks against the family's own
``generate`` and eager attention. Batched products may round differently from batch 1, and rows of different
lengths attend through kvbench's own product where a lone sequence uses SDPA. On SmolLM2 that moved logits by up
to 5e-5 of the largest logit, as much as SDPA and that product differ for one sequence alone (measured on these
prompts), so logits must agree within ``TOL`` of the largest logit. The only accepted
difference in tokens is a greedy tie, and ``assert_same_as_alone`` checks that this is the reason (the batch-1
run's top-2 logit gap at the first differing step is below that tolerance). Prompts have different lengths and
different ``max_new_tokens``, so sequences finish at different steps, their slots are refilled from the queue,
and the batch shrinks at the end.

The same rounding can part two kept sets where two entries' scores tie to float precision (a key norm, a leverage
score): then the runs differ from the first step whose kept sets differ, and ``check_batch`` accepts it only if
every entry kept by one run and not the other scored, in the batch-1 run's own eviction, within ``SCORE_TIE`` of the
others (relative); the two must agree up to that step.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch
from conftest import CONFIG_DIR, fit_layers, tiny_policy_cfg, with_calibration
from engine_run import generate, generate_batch
from family_models import FAMILIES, SLIDING, build
from omegaconf import OmegaConf

from kvbench.engine.engine import DecodeSettings, Engine, EngineSettings, Generation, Request
from kvbench.policies.policy import Policy
from kvbench.policies.registry import build_policy

pytestmark = pytest.mark.usefixtures("one_thread")
TOL = 1e-4  # of the batch-1 run's largest logit
SCORE_TIE = 1e-5  # of the largest finite score magnitude of the eviction
NAMED = sorted(p.stem for p in (CONFIG_DIR / "policy").glob("*.yaml"))
LENGTHS, NEW = (40, 25, 33, 50, 29), (12, 5, 9, 12, 7)
DEEP = ("qwen2-window", "gemma3", "gemma2-softcap", "mistral-window", "gpt2")  # every policy kind batched


TINY_LAYERS = 4  # tiny-llama's decoder layers


def named(name: str, model=None, **extra):
    """A named policy for tiny-llama; ``model``: where a score needs a calibration, what to measure it on."""
    cfg = fit_layers(tiny_policy_cfg(name, **extra), TINY_LAYERS)
    return build_policy(cfg if model is None else with_calibration(cfg, model))


def requests(
    lengths=LENGTHS, news=NEW, ids_seed: int = 0, high: int = 250, question: int = 0, **settings
) -> list[Request]:
    """Prompts of ``lengths`` tokens, the last ``question`` of each fed apart as its question (the suffix)."""
    g = torch.Generator().manual_seed(ids_seed)
    out = []
    for n, m in zip(lengths, news):
        ids = torch.randint(0, high, (n,), generator=g).tolist()
        out.append(Request(ids[: n - question], ids[n - question :], DecodeSettings(max_new_tokens=m, **settings)))
    return out


def assert_same_as_alone(batched: Generation, alone: Generation, where: str) -> None:
    """Tokens equal, or they part at a greedy tie of the batch-1 run; logits within tolerance up to there."""
    tol = TOL * float(alone.logits.abs().max())
    n = min(len(batched.tokens), len(alone.tokens))
    differ = next((i for i in range(n) if batched.tokens[i] != alone.tokens[i]), None)
    end = len(alone.tokens) if differ is None else differ + 1
    if differ is None:
        assert batched.tokens == alone.tokens, where
    else:
        top2 = alone.logits[differ].topk(2).values
        assert float(top2[0] - top2[1]) < tol, f"{where}: tokens part at step {differ} without a tie"
    torch.testing.assert_close(
        batched.logits[:end], alone.logits[:end], rtol=0, atol=tol, msg=lambda m: f"{where}: {m}"
    )


def assert_within_budget(
    g: Generation,
    heads: int,
    per_head: bool,
    stage: str,
    chunks: int,
    where: str,
    interval: int = 1,
    pools_layers: bool = False,
    replays: bool = False,
) -> None:
    """After every step that evicts, no row holds more than the allocation gives: in all, layers × budget per
    head (pyramid and per-layer budgets differ by layer), or heads × budget per layer under per-head allocation,
    or layers × heads × budget for the sequence under a global one; a decode step may hold up to
    ``interval - 1`` more, the growth between evictions. ``replays`` (KVzip): the prompt is evicted once, by its
    last replay pass, whose kept sets are the trace's entry for the prompt's last chunk."""
    first = {"prefill": 0, "decode": chunks + interval - 1, "both": 0}[stage]  # stage=decode: from its first eviction
    if replays:
        first = max(first, chunks - 1)
    last = chunks if stage == "prefill" else len(g.trace)
    for index in range(first, last):
        step = g.trace[index]
        budget = g.measures.budget_tokens + (interval - 1 if index >= chunks else 0)
        counts = [[len(set(h.tolist())) for h in held] for held in step]
        if pools_layers:
            assert sum(map(sum, counts)) <= len(step) * heads * budget, where
        elif per_head:
            assert all(sum(c) <= heads * budget for c in counts), where
        else:
            assert sum(max(c) for c in counts) <= len(step) * budget, where


@contextmanager
def scores_logged() -> Iterator[list[tuple[torch.Tensor, torch.Tensor]]]:
    """Every eviction's (positions [rows, n], scores [rows, n]) while active."""
    log: list[tuple[torch.Tensor, torch.Tensor]] = []
    scored = Policy.scored

    def logging(self, state, budget, padding=float("-inf")):
        out = scored(self, state, budget, padding)
        log.append((state.positions.clone(), out.clone()))
        return out

    Policy.scored = logging  # type: ignore[method-assign]
    try:
        yield log
    finally:
        Policy.scored = scored  # type: ignore[method-assign]


def parting(batched: Generation, alone: Generation) -> tuple[int, set[int], set[int]] | None:
    """The first forward whose kept sets differ, with one such (layer, head)'s sets: alone's and batched's."""
    for forward, (mine, theirs) in enumerate(zip(alone.trace, batched.trace)):
        for a_layer, b_layer in zip(mine, theirs):
            for a, b in zip(a_layer, b_layer):
                if set(a.tolist()) != set(b.tolist()):
                    return forward, set(a.tolist()), set(b.tolist())
    return None


def assert_parted_at_a_tie(log: list[tuple[torch.Tensor, torch.Tensor]], kept: set[int], other: set[int], where: str):
    """Some eviction of the batch-1 run scored every entry of the two sets' difference alike, within SCORE_TIE."""
    swapped = kept ^ other
    for positions, scores in log:
        for row_positions, row_scores in zip(positions.tolist(), scores):
            if not (kept | other) <= set(row_positions):
                continue
            at = [row_positions.index(p) for p in swapped]
            finite = row_scores[torch.isfinite(row_scores)]
            scale = float(finite.abs().max()) if finite.numel() else 1.0
            values = row_scores[at]
            if bool(torch.isfinite(values).all()) and float(values.max() - values.min()) <= SCORE_TIE * scale:
                return
    raise AssertionError(f"{where}: kept sets part without a score tie ({sorted(swapped)})")


def check_batch(
    model,
    reqs: list[Request],
    policy,
    budget,
    stage: str,
    batch_size: int,
    stride=None,
    tokenizer=None,
    heads: int | None = None,
) -> list[Generation]:
    def batch(trace: bool) -> list[Generation]:
        return generate_batch(
            model, tokenizer, reqs, policy, budget, stage, batch_size, stride, return_logits=True, trace=trace
        )

    def alone(r: Request, trace: bool) -> Generation:
        settings = r.settings
        return generate(
            model, tokenizer, r.input_ids, policy, budget, stage, settings, r.suffix_ids, stride,
            return_logits=True, forced_tokens=r.forced_tokens, trace=trace,
        )  # fmt: skip

    batched, traced = batch(heads is not None), None
    for i, (r, b) in enumerate(zip(reqs, batched)):
        where = f"{policy.name} {stage} B={batch_size} sequence {i}"
        one = alone(r, False)
        if not same_as_alone(b, one):  # traced again, to see whether the kept sets parted at a score tie
            traced = traced or batch(True)
            with scores_logged() as log:
                one = alone(r, True)
            parted = parting(traced[i], one)
            if parted is None:
                assert_same_as_alone(b, one, where)
            else:
                forward, kept, other = parted
                assert_parted_at_a_tie(log, kept, other, where)
                chunks = len(one.trace) - len(one.tokens) + 1  # the prompt's forwards; the last gives token 0
                agreed = forward - chunks + 2  # tokens whose logits come from forwards up to the parting one
                assert b.tokens[:agreed] == one.tokens[:agreed], where
                tol = TOL * float(one.logits.abs().max())
                torch.testing.assert_close(b.logits[:agreed], one.logits[:agreed], rtol=0, atol=tol)
        assert b.batch_size == batch_size and len(b.decode_batch_sizes) == len(b.tokens) - 1
        if heads is not None and policy.evicts:
            chunks = -(-len(r.input_ids) // (stride or len(r.input_ids)))
            allocation = policy.allocation
            assert_within_budget(
                b,
                heads,
                allocation.per_head,
                stage,
                chunks,
                where,
                policy.interval,
                allocation.pools_layers,
                policy.replay is not None,
            )
    return batched


def same_as_alone(batched: Generation, alone: Generation) -> bool:
    try:
        assert_same_as_alone(batched, alone, "")
    except AssertionError:
        return False
    return True


@pytest.mark.parametrize("name", NAMED)
def test_every_named_policy_in_every_stage_batched_equals_alone(tiny, name):
    policy = named(name, tiny.model)
    if policy.interval > 2:  # a named buffer (R-KV's 128 steps) outlasts this run: evict every other step
        policy = named(name, tiny.model, interval=2)
    reqs = requests(question=4 if policy.question else 0)  # a policy observing the question (Finch) gets one
    for stage in [s for s in ("prefill", "decode", "both") if s not in policy.unsupported_stages]:
        stride = None if policy.whole_prompt else 8  # a score reading every prompt query needs it in one step
        out = check_batch(tiny.model, reqs, policy, 0.4, stage, batch_size=3, stride=stride, heads=2)
        if policy.evicts:  # the budget bit: something was evicted
            assert any(g.measures.budget_achieved < 0.99 for g in out), (name, stage)
        sizes = [s for g in out for s in g.decode_batch_sizes]
        assert max(sizes) == 3 and min(sizes) < 3  # full while the queue lasts, then shrinking


@pytest.mark.parametrize(
    "extra",
    [{"merge": True}, {"quantize": "int8"}, {"quantize": "fp8"}, {"positions": "reindex"}],
    ids=["merge", "int8", "fp8", "reindex"],
)
@pytest.mark.parametrize("name", ["h2o", "adakv", "streamingllm"])
def test_extras_batched_equal_alone(tiny, name, extra):
    policy = named(name, **extra)
    stage = "prefill" if name == "adakv" else "both"
    check_batch(tiny.model, requests(ids_seed=1), policy, 0.4, stage, batch_size=4, stride=8, heads=2)


def test_sequences_stopping_at_eos_leave_and_are_replaced(tiny, monkeypatch):
    """A token the first sequence samples is made the model's EOS: sequences stop wherever they produce it."""
    reqs = requests(ids_seed=2, news=(16,) * 5)
    first = generate(tiny.model, None, reqs[0].input_ids, named("h2o"), 0.4, "both", reqs[0].settings)
    monkeypatch.setattr(tiny.model.generation_config, "eos_token_id", first.tokens[3])
    out = check_batch(tiny.model, reqs, named("h2o"), 0.4, "both", batch_size=2, stride=8)
    assert out[0].measures.stop_reason == "eos" and len(out[0].tokens) == 4


def test_sampling_is_each_sequences_own(tiny):
    reqs = requests(ids_seed=3, do_sample=True, temperature=0.8, top_p=0.9, seed=5)
    check_batch(tiny.model, reqs, named("tova"), 0.4, "both", batch_size=3)


@pytest.mark.parametrize(
    "name, stage", [("h2o", "both"), ("adakv", "prefill"), ("roco", "decode"), ("scissorhands", "both")]
)
def test_masked_replay_per_sequence(tiny, name, stage):
    """A batched run's kept sets, replayed per sequence as masks over a batched full cache, give its logits."""
    policy, reqs = named(name), requests(ids_seed=4)
    g = generate_batch(tiny.model, None, reqs, policy, 0.4, stage, 3, 8, return_logits=True, trace=True)
    replays = [
        Request(r.input_ids, settings=r.settings, forced_tokens=x.tokens, replay_trace=x.trace) for r, x in zip(reqs, g)
    ]
    full = generate_batch(tiny.model, None, replays, named("full"), 1.0, stage, 3, 8, return_logits=True)
    for x, y in zip(g, full):
        torch.testing.assert_close(x.logits, y.logits, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("family", [f for f in FAMILIES if f != "llama"])
def test_every_family_batched_equals_alone(family):
    """Sliding windows (hybrid and all-sliding), softcaps, multi-query attention, models without RoPE."""
    model = build(family)
    names = ("h2o", "snapkv", "window", "adakv") if family in DEEP else ("h2o", "adakv")
    for name in names:
        policy = named(name)
        stage = "both" if "decode" not in policy.unsupported_stages else "prefill"
        check_batch(model, requests(ids_seed=5, high=300), policy, 0.4, stage, batch_size=3, stride=7)
    if family in SLIDING:
        check_batch(
            model, requests(ids_seed=6, high=300), named("h2o", sliding_layers="evict"), 0.4, "both", 3, stride=7
        )


@pytest.mark.real_model
def test_smollm_batched_equals_alone(smollm):
    """Real prompts' lengths (hundreds of tokens), a stop string and EOS active, B=4 over 6 sequences."""
    reqs = requests(
        lengths=(300, 180, 240, 120, 260, 200),
        news=(16, 8, 12, 16, 6, 10),
        ids_seed=7,
        high=20000,
        stop_strings=["\n\n"],
    )
    for name in ("full", "h2o", "roco", "tova", "snapkv", "window", "adakv"):
        policy = build_policy(
            OmegaConf.to_container(OmegaConf.load(CONFIG_DIR / "policy" / f"{name}.yaml"), resolve=True)
        )
        stage = "both" if "decode" not in policy.unsupported_stages else "prefill"
        check_batch(smollm.model, reqs, policy, 0.25, stage, batch_size=4, stride=128, tokenizer=smollm.tokenizer)


@pytest.mark.real_model
def test_gemma_batched_equals_alone(gemma):
    """Prompts past the 512-token window of the sliding layers, multi-query attention."""
    reqs = requests(lengths=(600, 540, 700), news=(8, 5, 8), ids_seed=8, high=50000)
    for name in ("full", "h2o", "snapkv"):
        policy = build_policy(
            OmegaConf.to_container(OmegaConf.load(CONFIG_DIR / "policy" / f"{name}.yaml"), resolve=True)
        )
        stage = "both" if "decode" not in policy.unsupported_stages else "prefill"
        check_batch(gemma.model, reqs, policy, 0.25, stage, batch_size=2, stride=256, tokenizer=gemma.tokenizer)


@pytest.mark.parametrize("name", ["random", "h2o", "adakv", "roco", "scissorhands"])
def test_sequences_of_one_length_are_scored_as_one_group_as_alone(tiny, name):
    """Equal lengths and budgets: every sequence's rows are scored in one state with the others' (random draws,
    Ada-KV's per-unit split, per-row scopes), and each still evicts what it evicts alone."""
    policy = named(name)
    stage = "prefill" if "decode" in policy.unsupported_stages else "both"
    check_batch(tiny.model, requests(lengths=(36,) * 4, news=(10,) * 4, ids_seed=9), policy, 0.4, stage, 4, 8, heads=2)


def test_a_request_that_cannot_run_fails_alone(tiny, random_ids):
    """An empty prompt is refused with its own error; the engine runs the others, and ``run`` raises it."""
    reqs = [Request([]), Request(random_ids(12, seed=3), settings=DecodeSettings(max_new_tokens=2))]
    for batch_size in (1, 2):
        engine = Engine(tiny.model, None, EngineSettings(named("window"), 0.5, "both", batch_size))
        finished = [item for unit in engine.steps(reqs) for item in unit]
        assert [i for i, _ in finished] == [0, 1]
        assert isinstance(finished[0][1], ValueError) and "empty" in str(finished[0][1])
        assert len(finished[1][1].tokens) == 2
        with pytest.raises(ValueError, match="the prompt is empty"):
            engine.run(reqs)
        only_bad = list(
            Engine(tiny.model, None, EngineSettings(named("window"), 0.5, "both", batch_size)).steps(reqs[:1])
        )
        assert [i for unit in only_bad for i, _ in unit] == [0]


def test_a_failing_unit_of_work_ends_only_the_requests_it_held(tiny, random_ids, monkeypatch):
    """A decode step that fails finishes its batch's live requests with the error; the queue goes on."""
    from kvbench.engine.batch import BatchLoop

    reqs = [Request(random_ids(12, seed=s), settings=DecodeSettings(max_new_tokens=3)) for s in range(4)]
    real, calls = BatchLoop._decode_step, []

    def fails_once(loop):
        calls.append(len(loop.live))
        if len(calls) == 1:
            raise RuntimeError("synthetic step failure")
        return real(loop)

    monkeypatch.setattr(BatchLoop, "_decode_step", fails_once)
    engine = Engine(tiny.model, None, EngineSettings(named("h2o"), 0.5, "both", 2))
    results = dict(item for unit in engine.steps(reqs) for item in unit)
    assert calls[0] == 2 and sorted(results) == [0, 1, 2, 3]
    assert all(isinstance(results[i], RuntimeError) for i in (0, 1))
    alone = generate_batch(tiny.model, None, reqs[2:], named("h2o"), 0.5, "both", 2)
    assert [results[i].tokens for i in (2, 3)] == [g.tokens for g in alone]
