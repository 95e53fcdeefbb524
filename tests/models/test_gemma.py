"""Gemma 3 270M, the embedded hybrid model (5 sliding-window layers of 512 : 1 global, one KV head), on real
prompts: the full cache gives ``model.generate``'s greedy text, every named policy runs in every stage it
supports, and no sliding layer ever holds more than its window."""

from __future__ import annotations

import glob
import json

import pytest
import torch
from conftest import CONFIG_DIR, SHARED_DATA, fit_layers, with_calibration
from engine_run import generate
from omegaconf import OmegaConf

from kvbench.engine.engine import DecodeSettings
from kvbench.families import layer_windows, policy_problem
from kvbench.policies.registry import build_policy

XSUM = SHARED_DATA / "xsum" / "test.jsonl"
pytestmark = pytest.mark.skipif(not XSUM.is_file(), reason=f"sample data not found at {XSUM}")
NAMED = {
    cfg["name"]: cfg
    for cfg in (
        OmegaConf.to_container(OmegaConf.load(p), resolve=True)
        for p in sorted(glob.glob(str(CONFIG_DIR / "policy" / "*.yaml")))
    )
}


def articles(tokenizer, n: int, at_least: int, at_most: int) -> list[list[int]]:
    """The first ``n`` XSum articles of at least ``at_least`` tokens (past the window), cut to ``at_most``."""
    found = []
    for line in XSUM.read_text().splitlines():
        ids = tokenizer(f"Article: {json.loads(line)['document']}\nSummary:")["input_ids"]
        if len(ids) >= at_least:
            found.append(ids[:at_most])
        if len(found) == n:
            return found
    pytest.skip("too few long articles in the sample")


def reference(model, ids: list[int], n: int) -> list[int]:
    out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False)
    return out[0, len(ids) :].tolist()


def test_full_cache_gives_generates_greedy_text_on_real_prompts(gemma):
    for ids in articles(gemma.tokenizer, 2, 600, 800):
        expected = reference(gemma.model, ids, 16)
        g = generate(
            gemma.model,
            gemma.tokenizer,
            ids,
            build_policy(NAMED["full"]),
            1.0,
            "prefill",
            DecodeSettings(max_new_tokens=16),
        )
        assert g.tokens == expected[: len(g.tokens)]
        assert g.text == gemma.tokenizer.decode(expected[: len(g.tokens)], skip_special_tokens=True)
        # The sliding layers held their window, the global ones everything.
        assert g.measures.kv_resident_bytes_sliding == 15 * 511 * 256 * 2 * 4
        assert g.measures.kv_resident_bytes_full == 3 * (len(ids) + len(g.tokens) - 1) * 256 * 2 * 4


def test_policies_at_a_budget_of_the_length_equal_generate(gemma):
    ids = articles(gemma.tokenizer, 1, 600, 700)[0]
    expected = reference(gemma.model, ids, 6)
    for name in ("h2o", "tova", "snapkv", "adakv", "pyramidkv", "roco"):
        for stage, stride in (("both", 256), ("prefill", None)):
            g = generate(
                gemma.model,
                gemma.tokenizer,
                ids,
                build_policy(NAMED[name]),
                len(ids) + 6,
                stage,
                DecodeSettings(max_new_tokens=6),
                stride=stride,
            )
            assert g.tokens == expected[: len(g.tokens)], (name, stage)


def test_every_named_policy_runs_in_every_stage_and_sliding_layers_hold_at_most_their_window(gemma):
    ids = articles(gemma.tokenizer, 1, 600, 600)[0]
    windows = layer_windows(gemma.model.config)
    assert windows.count(512) == 15 and windows.count(None) == 3
    for name, cfg in NAMED.items():
        for extra in ({}, {"sliding_layers": "evict"}):
            fitted = with_calibration(fit_layers(cfg, windows.count(None)), gemma.model)  # a list: the global layers'
            policy = build_policy(fitted | extra)
            if extra and name not in ("h2o", "snapkv", "adakv", "streamingllm"):
                continue
            refused = policy_problem(gemma.model.config, policy)
            if refused:  # refused before the weights load (KVCompose's re-read cannot fit a sliding window)
                assert name == "kvcompose", (name, refused)
                continue
            asked = len(ids) - (16 if policy.question else 0)  # Finch observes a question: the last 16 tokens
            for stage in (s for s in ("prefill", "decode", "both") if s not in policy.unsupported_stages):
                g = generate(
                    gemma.model,
                    gemma.tokenizer,
                    ids[:asked],
                    policy,
                    0.25,
                    stage,
                    DecodeSettings(max_new_tokens=4),
                    ids[asked:],
                    stride=None if policy.whole_prompt else 256,  # a whole-prompt score reads every prompt query
                    trace=True,
                )
                assert len(g.tokens) == 4
                for layers in g.trace:
                    for window, held in zip(windows, layers):
                        if window is not None:
                            assert held.shape[-1] <= window - 1, (name, extra, stage)
                if policy.evicts and stage != "decode":  # the global layers hold the budget (on average: pyramid)
                    full_layers = [held.shape[-1] for window, held in zip(windows, g.trace[-1]) if window is None]
                    assert sum(full_layers) / len(full_layers) <= g.measures.budget_tokens + 4, (name, stage)
