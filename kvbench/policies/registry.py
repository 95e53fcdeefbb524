"""Build a ``Policy`` from its config: ``score`` and ``scope`` name their parts and carry their options."""
from __future__ import annotations

from typing import Any

from kvbench.policies.base import Policy
from kvbench.policies.scopes import SCOPES, Everything
from kvbench.policies.scores import SCORES, Recency


def _part(table: dict[str, type], spec: Any, what: str) -> Any:
    options = dict(spec) if isinstance(spec, dict) or hasattr(spec, "items") else {"kind": spec}
    kind = options.pop("kind")
    if kind not in table:
        raise ValueError(f"unknown {what} {kind!r}; choose one of {sorted(table)}")
    return table[kind](**options)


def build_policy(cfg: dict[str, Any]) -> Policy:
    """``score: none`` means the full cache: nothing is ever evicted."""
    name = cfg["name"]
    score_spec = cfg.get("score", "none")
    if score_spec in (None, "none"):
        return Policy(name=name, score=Recency(), scope=Everything(), evicts=False)
    score = _part(SCORES, score_spec, "score")
    scope = _part(SCOPES, cfg.get("scope", "all"), "scope")
    return Policy(name=name, score=score, scope=scope)
