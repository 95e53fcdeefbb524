"""The per-entry statistics a part may name in ``needs``: where each comes from and how a step's value joins it.

Parts read them from ``TokenState.stats`` by name. The engine reads this table to know which statistics cost an
attention pass (``ATTENTION_STATS``), which it keeps as a column per entry (``STORED_STATS``), and whether a
step's value adds to the column or replaces it (``fold``).

What an entry holds that is fixed when it is written (a norm of its key or value) is not a statistic: a score
declares it as a feature (``Score.feature_names`` and ``Score.features``), in its own module. A quantity over the
most recent queries' attention rows is not one either: a score keeps a query log (``Score.history``) and shapes
its rows (``Score.log_rows``). Only a new quantity summed over every query needs a row here and its computation
in the two attention paths (see docs/extending.md).
"""

from __future__ import annotations

from dataclasses import dataclass

SOURCES = ("attention", "cache", "merge")
FOLDS = ("sum", "replace", "log", "none")


@dataclass(frozen=True)
class Statistic:
    """``source``: who computes it (the attention function, the cache from positions, merging). ``fold``: how a
    step's value joins the entry's column ("sum": added, "replace": overwritten, "log": the query log's ring,
    "none": not stored, computed when a state is built)."""

    name: str
    source: str
    fold: str
    meaning: str

    def __post_init__(self) -> None:
        if self.source not in SOURCES or self.fold not in FOLDS:
            raise ValueError(f"statistic {self.name!r}: source in {SOURCES}, fold in {FOLDS}")


STATISTICS: dict[str, Statistic] = {
    s.name: s
    for s in (
        Statistic("acc", "attention", "sum", "attention probability received, summed over every query that saw it"),
        Statistic("sumsq", "attention", "sum", "the square of that probability, summed likewise"),
        Statistic("last", "attention", "replace", "the attention probability from the most recent query"),
        Statistic("qlog", "attention", "log", "the rows of the last `history` queries (Score.log_rows)"),
        Statistic("count", "cache", "none", "queries that could see the entry: tokens fed since it, itself included"),
        Statistic("mass", "merge", "sum", "attention weight of the entries merged into this one"),
    )
}

# Statistics only an attention pass gives (a policy needing none of them pays for no probabilities).
ATTENTION_STATS = frozenset(n for n, s in STATISTICS.items() if s.source == "attention")
# Statistics kept as one column per entry (the query log and ``count`` are kept otherwise).
STORED_STATS = tuple(n for n, s in STATISTICS.items() if s.fold in ("sum", "replace"))
# Attention statistics summed over every query of a step (a prompt chunk then needs every query's row).
SUMMED_STATS = frozenset(n for n in ATTENTION_STATS if STATISTICS[n].fold == "sum")
