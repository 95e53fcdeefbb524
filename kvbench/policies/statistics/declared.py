"""The kinds of statistic and the table of those declared (``declare``); see the package's docstring."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TypeVar

import torch


@dataclass(frozen=True)
class Statistic:
    """``name``: what parts list in ``needs``; ``meaning``: one line for the docs and messages. ``source``: who
        computes it (the attention kernels, the view from positions, merging); ``fold``: how a step's value joins
        the entry's column ("sum": added, "replace": overwritten, "max": the larger kept, "log": the query log's ring,
    "none": not stored)."""

    name: str
    meaning: str
    source = "attention"
    fold = "none"

    @property
    def stored(self) -> bool:
        """Kept as one column per entry."""
        return self.fold in ("sum", "replace", "max")


@dataclass(frozen=True)
class Summed(Statistic):
    """Σ over every query that saw the entry of ``of(p)``, p the query's (GQA group-mean) probability of it.
    ``of`` is elementwise (the kernels hand it blocks of probabilities of any shape) and never writes into its
    argument; None is the probability itself (the kernels then sum it in one product, without the per-query
    means)."""

    of: Callable[[torch.Tensor], torch.Tensor] | None = field(default=None, compare=False)
    fold = "sum"


@dataclass(frozen=True)
class Latest(Statistic):
    """The most recent query's (GQA group-mean) probability of the entry."""

    fold = "replace"


@dataclass(frozen=True)
class Logged(Statistic):
    """The rows of the most recent ``Score.history`` queries, as the score's ``log_rows`` shapes them."""

    fold = "log"


@dataclass(frozen=True)
class Replayed(Statistic):
    """Computed by the prompt's replay passes (``Score.replay``, ``engine/replay.py``), not by the attention of
    the fed tokens: the largest over the reconstruction queries of what they give the entry."""

    source = "replay"
    fold = "max"


@dataclass(frozen=True)
class FromPositions(Statistic):
    """Computed when a view is built: ``of(seen, positions)``, seen [rows, 1] (tokens fed so far) and positions
    [rows, n] -> float [rows, n]."""

    of: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = field(compare=False)
    source = "cache"


@dataclass(frozen=True)
class Merged(Statistic):
    """Written by merging (``policies.merge``): what the entries folded into this one brought, summed."""

    source = "merge"
    fold = "sum"


@dataclass(frozen=True)
class Collecting:
    """What one step's attention collects for its policy: the statistics ``needs`` names and, for a ``Logged``
    one, the rows of the last ``history`` queries (built once per layer and step)."""

    needs: frozenset[str] = frozenset()
    history: int = 0


NOTHING = Collecting()  # a policy that reads no attention statistics, or a step after which none evicts


S = TypeVar("S", bound=Statistic)
STATISTICS: dict[str, Statistic] = {}
_PLACES: dict[str, str] = {}
# ``declared``'s answers (the kernels ask at every layer of every step); emptied whenever the table changes.
_ANSWERS: dict[tuple[frozenset[str], type], tuple[Statistic, ...]] = {}


def declare(statistic: Statistic) -> Statistic:
    """Add ``statistic`` to the table. A name declared in two places is refused, naming both (declaring it again
    from the same place, as re-importing its module does, is fine)."""
    caller = inspect.currentframe()
    caller = caller.f_back if caller is not None else None
    place = "?" if caller is None else f"{caller.f_code.co_filename}:{caller.f_lineno}"
    name = statistic.name
    if name in STATISTICS and _PLACES[name] != place:
        raise ValueError(f"statistic {name!r} is declared twice: {_PLACES[name]} and {place}")
    STATISTICS[name], _PLACES[name] = statistic, place
    _ANSWERS.clear()
    return statistic


def forget(name: str) -> None:
    """Drop ``name`` (a statistic declared for a while, as a test's own, leaves the table as it found it)."""
    STATISTICS.pop(name, None)
    _PLACES.pop(name, None)
    _ANSWERS.clear()


def declared(names: Iterable[str], kind: type[S]) -> tuple[S, ...]:
    """The declarations of ``names`` of one kind, in name order (names not declared are left out)."""
    key = (frozenset(names), kind)
    if key not in _ANSWERS:
        _ANSWERS[key] = tuple(STATISTICS[n] for n in sorted(key[0]) if isinstance(STATISTICS.get(n), kind))
    return _ANSWERS[key]  # type: ignore[return-value]


def attention_names(names: Iterable[str]) -> frozenset[str]:
    """Those of ``names`` only an attention pass gives (a policy needing none pays for no probabilities)."""
    return frozenset(s.name for s in declared(names, Statistic) if s.source == "attention")


def stored_names(names: Iterable[str]) -> frozenset[str]:
    """Those of ``names`` kept as one column per entry."""
    return frozenset(s.name for s in declared(names, Statistic) if s.stored)
