"""Attention profiling: what a model's attention looks like on a workload, how consistently each score predicts
the attention still to come, and per-layer budgets derived from it (``allocation=profiled``)."""
