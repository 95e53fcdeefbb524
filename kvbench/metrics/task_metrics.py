"""Declarations of the metrics computed outside kvbench.metrics' own functions: the retrieval task's, the
perplexity task's, and fidelity to the full cache (named by the runner and the perplexity task, computed by
``kvbench.runner.fidelity``)."""

from __future__ import annotations

from kvbench.metrics.registry import register_metric

register_metric("accuracy", higher_is_better=True, label="accuracy")
register_metric("exact_match", higher_is_better=True, label="exact match")

register_metric("perplexity", higher_is_better=False, label="perplexity")
register_metric("perplexity_full", higher_is_better=False, label="perplexity (full cache)")
register_metric("perplexity_delta", higher_is_better=False, label="perplexity - full cache's")
register_metric("nll", higher_is_better=False, label="NLL (nats/token)")
register_metric("nll_full", higher_is_better=False, label="NLL, full cache (nats/token)")

register_metric("fidelity_rougeL", higher_is_better=True, label="ROUGE-L to the full cache's output")
register_metric("fidelity_top1", higher_is_better=True, label="top-1 agreement with the full cache")
register_metric("fidelity_kl", higher_is_better=False, label="KL from the full cache (nats)")
# The full cache's own top-K mass: how tight fidelity_kl's bound is, a property of the reference, not a quality.
register_metric("fidelity_topk_mass", higher_is_better=True, label="full cache's top-K mass")
