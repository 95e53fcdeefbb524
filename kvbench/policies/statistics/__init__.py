"""The per-entry statistics a part may name in ``needs``: one module each, declaring what the statistic is and
how it is reduced; every module here is imported with this package, so a new statistic is a new module.

A statistic of the attention probabilities is one of three kinds, and the attention kernels loop over the
declarations of each kind (``engine/attention.py`` for a decode step, ``engine/blocked.py`` for a prompt chunk):

- ``Summed``: a function of each query's probability of the key, summed over every query that saw the key
  (``acc``: the probability itself; ``sumsq``: its square). A new one is a declaration with its function.
- ``Latest``: the most recent query's probability, replacing the previous one (``last``).
- ``Logged``: the rows of the most recent queries, kept in a ring by the cache (``qlog``, see ``Score.history``).

Besides those, ``FromPositions`` statistics are computed from positions when a view is built (``count``) and
``Merged`` ones are written by merging (``mass``), and ``Replayed`` ones by the prompt's replay passes
(``replay_max``, KVzip's). Every attention statistic is per KV head: a GQA group's query
heads are reduced by the mean of their probabilities before anything is reduced over queries.

What an entry holds that is fixed when it is written (a norm of its key or value) is not a statistic but a
feature (``Score.feature_names``); a sum over a row's entries is a running row sum (``policies.running``).
"""

from __future__ import annotations

import importlib
import pkgutil

from kvbench.policies.statistics.declared import (
    NOTHING,
    STATISTICS,
    Collecting,
    FromPositions,
    Latest,
    Logged,
    Merged,
    Replayed,
    Statistic,
    Summed,
    attention_names,
    declare,
    declared,
    forget,
    stored_names,
)

__all__ = [
    "NOTHING",
    "STATISTICS",
    "Collecting",
    "FromPositions",
    "Latest",
    "Logged",
    "Merged",
    "Replayed",
    "Statistic",
    "Summed",
    "attention_names",
    "declare",
    "declared",
    "forget",
    "stored_names",
]

for _module in pkgutil.iter_modules(__path__):
    if _module.name != "declared":
        importlib.import_module(f"{__name__}.{_module.name}")
