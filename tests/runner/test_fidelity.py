"""Fidelity to the full cache: exact for the full cache, worse under compression, references reused,
and the KL / top-1 formulas checked by hand."""

from __future__ import annotations

import json
import os
import threading

import numpy as np
import pytest
import torch
from conftest import CONFIG_DIR, SHARED_DATA
from hydra import compose, initialize_config_dir

from kvbench.results.writer import read_rows
from kvbench.runner.cell import run_cell
from kvbench.runner.fidelity.metrics import (
    fidelity_rouge_l,
    kl_divergence,
    kl_per_step,
    summarize_logits,
    top1_agreement,
    topk_mass,
)
from kvbench.runner.fidelity.store import Reference, ReferenceStore, store_at


def xsum(n: int = 2, max_new_tokens: int = 8) -> list[str]:
    return [
        "model=tiny-llama",
        "task=xsum",
        f"task.data_dir={SHARED_DATA / 'xsum'}",
        f"task.n={n}",
        "task.max_prompt_tokens=300",
        f"task.max_new_tokens={max_new_tokens}",
    ]


XSUM = xsum()
FIDELITY = ("metric.fidelity_rougeL", "metric.fidelity_top1", "metric.fidelity_kl")


def cfg(overrides: list[str]):
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        return compose("config", overrides=overrides)


@pytest.fixture
def refs(tmp_path):
    """The runner keeps references in ``<results_dir>/.references``; ``run`` points results_dir here."""
    return tmp_path / "results" / ".references"


def run(tmp_path, name: str, overrides: list[str]) -> list[dict]:
    run_cell(cfg(overrides + [f"results_dir={tmp_path / 'results'}"]), tmp_path / name, "t")
    rows = read_rows(tmp_path / name / "rows.jsonl")
    assert rows and all(r["status"] == "ok" for r in rows), rows
    return rows


# ---------------------------------------------------------------- formulas


def test_kl_and_top1_match_a_hand_computation():
    logits_full = torch.tensor([[2.0, 1.0, 0.0, -1.0, 0.5], [0.0, 0.2, 3.0, -0.3, 0.1], [1.0, 2.0, 3.0, 4.0, 5.0]])
    logits_comp = torch.tensor([[1.0, 2.0, 0.0, -1.0, 0.5], [0.1, 0.0, 2.0, 0.3, 0.0], [1.0, 2.0, 3.0, 4.0, 5.0]])
    p = np.exp(logits_full.numpy().astype(np.float64))
    p /= p.sum(1, keepdims=True)
    q = np.exp(logits_comp.numpy().astype(np.float64))
    q /= q.sum(1, keepdims=True)
    # K covering the vocabulary: the plain KL of the softmaxes, per step and averaged.
    exact = (p * np.log(p / q)).sum(1)
    ref = summarize_logits(logits_full, k=5)
    assert np.allclose(kl_per_step(ref, logits_comp).numpy(), exact, atol=1e-6)
    assert kl_divergence(ref, logits_comp) == pytest.approx(exact.mean(), abs=1e-6)
    assert exact[2] == 0 and kl_per_step(ref, logits_comp)[2] == 0
    assert topk_mass(ref) == pytest.approx(1.0)
    # K = 2: the full cache's two likeliest tokens apart, every other token in one bucket.
    ref2 = summarize_logits(logits_full, k=2)
    coarse = []
    for t in range(3):
        top = np.argsort(-p[t])[:2]
        rest = [i for i in range(5) if i not in top]
        pp = np.append(p[t, top], p[t, rest].sum())
        qq = np.append(q[t, top], q[t, rest].sum())
        coarse.append((pp * np.log(pp / qq)).sum())
    assert np.allclose(kl_per_step(ref2, logits_comp).numpy(), coarse, atol=1e-6)
    assert all(c <= e + 1e-9 for c, e in zip(coarse, exact))  # merging outcomes never raises KL
    assert topk_mass(ref2) == pytest.approx(np.mean([np.sort(p[t])[-2:].sum() for t in range(3)]))
    # Top-1: the compressed argmax is 1, 2, 4 against the full-cache tokens 0, 2, 4.
    assert top1_agreement(logits_comp, [0, 2, 4]) == pytest.approx(2 / 3)
    assert top1_agreement(logits_full, [0, 2, 4]) == 1.0
    assert kl_divergence(ref, logits_full) == 0.0


def test_fidelity_rouge_l():
    assert fidelity_rouge_l("The cat sat.", "The cat sat.") == 1.0
    assert fidelity_rouge_l("", "") == 1.0
    assert fidelity_rouge_l("the cat sat on the mat", "the cat lay on the mat") == pytest.approx(5 / 6)
    assert fidelity_rouge_l("", "something") == 0.0
    # Text without spaces between words (Chinese) is compared character by character, not scored 0.
    assert 0.0 < fidelity_rouge_l("会议讨论了预算", "会议讨论了计划") < 1.0


def test_reference_round_trips_through_json(tmp_path):
    ref = Reference(
        tokens=[3, 1],
        text="hi",
        stop_reason="eos",
        argmax=[3, 1],
        summary=summarize_logits(torch.randn(2, 300), k=7),
        nll=[0.5, 0.25],
    )
    back = Reference.from_json(json.loads(json.dumps(ref.to_json())))
    assert torch.equal(back.summary.ids, ref.summary.ids) and torch.equal(back.summary.logprobs, ref.summary.logprobs)
    assert torch.equal(back.summary.rest, ref.summary.rest)
    assert (back.tokens, back.text, back.nll, back.argmax) == ([3, 1], "hi", [0.5, 0.25], [3, 1])


def test_store_computes_each_reference_once_across_threads(tmp_path):
    calls = []

    def compute():
        calls.append(1)
        return Reference(tokens=[1], text="x", stop_reason="eos", summary=summarize_logits(torch.zeros(1, 4), 2))

    key = {"example": "a"}
    stores = [ReferenceStore(tmp_path) for _ in range(4)]  # separate objects: only the lock file is shared
    threads = [threading.Thread(target=s.get_or_create, args=(key, compute)) for s in stores]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1
    assert [p.name for p in tmp_path.glob("*.json")] == [stores[0].path(key).name]
    assert not list(tmp_path.glob(".*.tmp-*"))


# ---------------------------------------------------------------- through the runner


def test_full_cache_is_exactly_faithful_and_compression_is_not(tmp_path, refs):
    full = run(tmp_path, "full", XSUM + ["policy=full"])
    for r in full:  # xsum scores fidelity by default (task.fidelity: true), no fidelity=true needed
        assert (r["metric.fidelity_rougeL"], r["metric.fidelity_top1"], r["metric.fidelity_kl"]) == (1.0, 1.0, 0.0)
        assert r["fidelity_reference_tokens"] == r["new_tokens"]
    files = sorted(refs.glob("*.json"))
    assert len(files) == 2 and {r["fidelity_reference"] for r in full} == {f.name for f in files}
    stamps = {f: os.stat(f).st_mtime_ns for f in files}
    store = store_at(refs)
    computed = store.computed

    small = run(tmp_path, "small", XSUM + ["policy=streamingllm", "budget=0.1"])
    for r in small:
        assert r["metric.fidelity_kl"] > 0 and r["metric.fidelity_top1"] < 1 and r["metric.fidelity_rougeL"] < 1
    # The references were read, not recomputed or rewritten, by the compressed cell.
    assert store.computed == computed
    assert sorted(refs.glob("*.json")) == files and all(os.stat(f).st_mtime_ns == s for f, s in stamps.items())
    assert [r["fidelity_reference"] for r in small] == [r["fidelity_reference"] for r in full]
    # Another budget and stage share them too; a different max_new_tokens does not.
    run(tmp_path, "decode", XSUM + ["policy=window", "budget=0.3", "stage=decode"])
    assert store.computed == computed and len(list(refs.glob("*.json"))) == 2
    run(tmp_path, "longer", xsum(max_new_tokens=6) + ["policy=window"])
    assert store.computed == computed + 2 and len(list(refs.glob("*.json"))) == 4


def test_fidelity_off_and_on(tmp_path, refs):
    rows = run(tmp_path, "off", xsum(1, 4) + ["task.fidelity=false", "policy=window"])
    assert not any(k.startswith("metric.fidelity") for k in rows[0]) and not refs.exists()
    retrieval = ["model=tiny-llama", "task.n=1", "task.context_tokens=120", "task.max_new_tokens=4", "policy=window"]
    rows = run(tmp_path, "retrieval", retrieval)
    assert "metric.fidelity_kl" not in rows[0]  # fidelity stays opt-in for other tasks
    rows = run(tmp_path, "retrieval-on", retrieval + ["fidelity=true"])
    assert all(k in rows[0] for k in FIDELITY) and rows[0]["primary_metric"] == "accuracy"
