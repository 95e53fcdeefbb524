"""Compress once, ask many: requests sharing a ``context_id`` prefill (and compress) their context once, and each
answer is what a run of its own gives.

The reference of each question is a plain request, [context, then the question as ``suffix_ids``]: its context is
compressed alone and the question fed after, the path the exactness tests hold to the family's ``generate``. With
the full cache the reference is the family's ``generate`` over context + question itself.
"""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_policy_cfg
from engine_run import generate_batch

from kvbench.engine.engine import DecodeSettings, Engine, EngineSettings, Request
from kvbench.policies.registry import build_policy

pytestmark = pytest.mark.usefixtures("one_thread")
CONTEXT, QUESTIONS, NEW = 48, (5, 3, 7, 4), (6, 9, 4, 7)


def context_and_questions(random_ids):
    return random_ids(CONTEXT, seed=11), [random_ids(n, seed=20 + i) for i, n in enumerate(QUESTIONS)]


def shared(context, questions, key: str = "c", **settings) -> list[Request]:
    return [
        Request(context, q, DecodeSettings(max_new_tokens=n, **settings), context_id=key)
        for q, n in zip(questions, NEW)
    ]


def alone(context, questions, **settings) -> list[Request]:
    return [Request(context, q, DecodeSettings(max_new_tokens=n, **settings)) for q, n in zip(questions, NEW)]


@pytest.mark.parametrize("batch_size", [1, 3])
@pytest.mark.parametrize(
    "name, stage, budget",
    [
        ("full", "prefill", 1.0),
        ("snapkv", "prefill", 0.5),
        ("h2o", "prefill", 20),
        ("streamingllm", "prefill", 0.4),
        ("h2o", "decode", 0.5),
        ("snapkv", "both", 30),
        ("think", "prefill", 1.0),  # key channels pruned once the context is in, the questions' keys alike
        ("think_snapkv", "both", 30),
    ],
)
def test_each_question_equals_its_own_run_and_the_context_is_prefilled_once(
    tiny, random_ids, forwards, name, stage, budget, batch_size
):
    context, questions = context_and_questions(random_ids)
    policy = build_policy(tiny_policy_cfg(name))
    references = generate_batch(
        tiny.model, None, alone(context, questions), policy, budget, stage, batch_size=1, return_logits=True
    )
    fed = forwards
    fed.clear()
    answers = generate_batch(
        tiny.model, None, shared(context, questions), policy, budget, stage, batch_size, return_logits=True
    )
    assert fed.count(CONTEXT) == 1, fed  # one prefill of the context, then each question's suffix
    assert sorted(n for n in fed if n > 1) == sorted([CONTEXT, *QUESTIONS])
    for i, (got, ref) in enumerate(zip(answers, references)):
        assert got.tokens == ref.tokens, f"question {i}"
        torch.testing.assert_close(got.logits, ref.logits, rtol=1e-5, atol=1e-5)
        assert got.measures.kept_tokens == ref.measures.kept_tokens
        assert got.measures.budget_achieved == ref.measures.budget_achieved
    assert [g.measures.prefill_shared for g in answers] == [False, True, True, True]
    assert not any(g.measures.prefill_shared for g in references)


def test_with_the_full_cache_each_answer_is_the_familys_generate(tiny, random_ids):
    context, questions = context_and_questions(random_ids)
    answers = generate_batch(
        tiny.model, None, shared(context, questions), build_policy({"name": "full"}), 1.0, return_logits=True
    )
    for question, n, got in zip(questions, NEW, answers):
        ids = torch.tensor([context + question])
        out = tiny.model.generate(
            ids, max_new_tokens=n, do_sample=False, output_logits=True, return_dict_in_generate=True
        )
        assert got.tokens == out.sequences[0, ids.shape[1] :].tolist()
        torch.testing.assert_close(got.logits, torch.stack(out.logits)[:, 0].float(), rtol=1e-5, atol=1e-5)


def test_two_contexts_in_one_run_each_prefilled_once(tiny, random_ids, forwards):
    context, questions = context_and_questions(random_ids)
    other = random_ids(CONTEXT + 5, seed=99)
    policy = build_policy(tiny_policy_cfg("snapkv"))
    requests = shared(context, questions[:2], "a") + shared(other, questions[2:], "b")
    references = generate_batch(
        tiny.model, None, alone(context, questions[:2]) + alone(other, questions[2:]), policy, 0.5
    )
    fed = forwards
    fed.clear()
    answers = generate_batch(tiny.model, None, requests, policy, 0.5, batch_size=2)
    assert fed.count(CONTEXT) == 1 and fed.count(CONTEXT + 5) == 1, fed
    assert [g.tokens for g in answers] == [g.tokens for g in references]


def test_requests_that_cannot_share_a_prefill_are_refused(tiny, random_ids):
    context, questions = context_and_questions(random_ids)
    # Pyramid's layer budgets near the prompt's length are capped by each sequence's whole length in stage=both.
    engine = Engine(tiny.model, None, EngineSettings(build_policy(tiny_policy_cfg("pyramidkv")), 40, "both"))
    requests = shared(context, questions[:2])
    results = dict(i for finished in engine.steps(requests) for i in finished)
    assert isinstance(results[1], ValueError) and "different layer budgets" in str(results[1])
    other = [requests[0], Request(context[:-1], questions[1], context_id="c")]
    engine = Engine(tiny.model, None, EngineSettings(build_policy(tiny_policy_cfg("snapkv")), 20, "prefill"))
    results = dict(i for finished in engine.steps(other) for i in finished)
    assert isinstance(results[1], ValueError) and "different context ids" in str(results[1])
