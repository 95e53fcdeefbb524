"""What a policy's config declares that the report needs: the stages kvbench refuses to run it in (a cell there is
not missing, it cannot exist), whether its budget is only a cap (a threshold allocation keeps what scores well,
so its cells are placed by the budget they achieved, not the one asked for) and whether its budget counts the keys
each query attends rather than those held (a decode-time sparsity such as Quest holds every token, so its cells are
placed by the share attended)."""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd

from kvbench.config.phases import CONFIG_DIR, named_policy
from kvbench.config.spec import ConfigError
from kvbench.policies.registry import build_policy
from kvbench.report.labels import base_name
from kvbench.results.schema import BUDGET_ACHIEVED, POLICY, SETTINGS

BUDGET_TOKENS, SEEN_TOKENS = "budget_tokens", "seen_tokens"

PREFIX = "policy."


@dataclass(frozen=True)
class PolicyFacts:
    refused_stages: tuple[str, ...] = ()
    thresholded: bool = False
    sparse: bool = False


def _set(config: dict[str, Any], dotted: str, value: Any) -> None:
    *parents, leaf = dotted.split(".")
    node = config
    for key in parents:
        child = node.get(key)
        node[key] = child = dict(child) if isinstance(child, Mapping) else {"kind": child} if child else {}
        node = child
    node[leaf] = value


def _named_config(name: str) -> dict[str, Any]:
    """The config of the policy a cell names: ``configs/policy/<name>.yaml``, or one in a folder of it (a profiled
    policy, ``policy=profiled/headkv``, names itself ``headkv``)."""
    try:
        return named_policy(name)
    except ConfigError:
        folders = sorted(p.name for p in (CONFIG_DIR / "policy").iterdir() if p.is_dir())
        for folder in folders:
            if (CONFIG_DIR / "policy" / folder / f"{name}.yaml").is_file():
                return named_policy(f"{folder}/{name}")
        raise


@functools.cache
def facts(name: str, changes: tuple[tuple[str, Any], ...] = ()) -> PolicyFacts:
    """The facts of ``configs/policy/<name>.yaml`` with the cell's ``policy.*`` changes; none for a name that is no
    config (a policy registered by a user's code: nothing is assumed of it)."""
    try:
        config = _named_config(name)
        for key, value in changes:
            _set(config, key, value)
        policy = build_policy(config)
    except (ConfigError, ValueError, TypeError, KeyError):
        return PolicyFacts()
    return PolicyFacts(
        tuple(policy.unsupported_stages or ()), bool(policy.allocation.thresholded), policy.sparsity is not None
    )


def policy_facts(rows: pd.DataFrame) -> dict[str, PolicyFacts]:
    """Per policy label of ``rows`` (kvbench.report.labels), the facts of the config its cells ran."""
    out = {}
    for label, cells in rows.groupby(POLICY, sort=False):
        settings = cells[SETTINGS].iat[0] if SETTINGS in cells else None
        changes = settings.items() if isinstance(settings, Mapping) else ()
        own = tuple(sorted((k.removeprefix(PREFIX), _hashable(v)) for k, v in changes if k.startswith(PREFIX)))
        out[str(label)] = facts(base_name(str(label)), own)
    return out


def placed_share(rows: pd.DataFrame) -> pd.Series:
    """Per row, the share of the reference its cell is placed at: the share held (``budget_achieved``), or for a
    policy that holds everything and attends its budget (Quest) the keys attended per decode query,
    ``budget_tokens / seen_tokens``."""
    held = pd.to_numeric(rows.get(BUDGET_ACHIEVED, pd.Series(np.nan, index=rows.index)), errors="coerce")
    if POLICY not in rows or BUDGET_TOKENS not in rows or SEEN_TOKENS not in rows:
        return held
    facts = policy_facts(rows)
    sparse = rows[POLICY].map(lambda p: facts[str(p)].sparse).astype(bool)
    attended = pd.to_numeric(rows[BUDGET_TOKENS], errors="coerce") / pd.to_numeric(rows[SEEN_TOKENS], errors="coerce")
    return held.where(~sparse, attended.clip(upper=1.0))


def _hashable(value: Any) -> Any:
    return repr(value) if isinstance(value, (list, dict)) else value
