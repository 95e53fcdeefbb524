"""Build a ``Policy`` from its config.

A policy config names its parts and carries their options (every option is a Hydra override away, e.g.
``policy.scope.n_sink=8`` or ``policy.allocation.beta=10``)::

    name: h2o
    score: {kind: accumulated}            # or a bare kind: ``score: accumulated``; ``none`` = full cache
    scope: {kind: sinks_window, n_sink: 0, window: 0.5}
    allocation: {kind: uniform}           # uniform | pyramid (beta) | adaptive (floor) | global (floor) | layers
    merge: false                          # true: fold evicted entries into their most similar kept entry; cam
    quantize: none                        # none | int8 | fp8
    channels: null                        # {kind: think, ratio, window}: key channels pruned (policies.channels)
    positions: absolute                   # absolute | reindex
    sliding_layers: window                # window | evict (hybrid models' sliding layers; see engine.plan)
    interval: 1                           # decode steps from one eviction to the next
    sparsity: none                        # {kind: quest, page_size, dense_layers}: with score none (policies.sparse)
    prefill: null                         # another policy's config for the prompt (kvbench.policies.phased)
    decode: null                          # another policy's config for decoding

A score may carry ``shared: true`` (one kept set per layer: the score averaged over KV heads).
"""

from __future__ import annotations

import inspect
import typing
from typing import Any, TypeVar

from kvbench.policies.base import Score
from kvbench.policies.channels import build_channels
from kvbench.policies.full import never_evicting
from kvbench.policies.merge import MERGES, Merge
from kvbench.policies.parts import ALLOCATIONS, SCOPES, SCORES, SPARSITIES
from kvbench.policies.phased import PhasedScope, PhasedScore
from kvbench.policies.policy import Policy
from kvbench.policies.quantize import build_quantizer
from kvbench.policies.scores.shared import SharedAcrossHeads
from kvbench.policies.sparse import Sparsity
from kvbench.policies.statistics import STATISTICS
from kvbench.registry import Registry
from kvbench.tasks.options import describe

P = TypeVar("P")
POLICY_KEYS = (
    "name",
    "score",
    "scope",
    "allocation",
    "merge",
    "quantize",
    "channels",
    "positions",
    "sliding_layers",
    "interval",
    "sparsity",
    "prefill",
    "decode",
)
PHASES = ("prefill", "decode")
# What shapes the cache, the run's for both phases of a policy per phase (the allocation is checked instead).
CACHE_KEYS = ("merge", "quantize", "channels", "positions", "sliding_layers", "interval")


def _options(spec: Any) -> dict[str, Any]:
    return dict(spec) if isinstance(spec, dict) or hasattr(spec, "items") else {"kind": spec}


def _part(table: Registry[type[P]], spec: Any) -> P:
    options = _options(spec)
    kind = options.pop("kind", None)
    what = table.what
    cls = table.get(kind)
    params = inspect.signature(cls.__init__).parameters
    unknown = sorted(set(options) - set(params) - {"self"})
    if unknown:
        allowed = sorted(p for p in params if p not in ("self", "args", "kwargs"))
        raise ValueError(
            f"{what} {kind!r} has no option {', '.join(unknown)}; its options are {', '.join(allowed) or 'none'}"
        )
    required = (p.name for p in params.values() if p.default is p.empty and p.kind is p.POSITIONAL_OR_KEYWORD)
    missing = [name for name in required if name not in options and name != "self"]
    if missing:
        raise ValueError(f"{what} {kind!r} needs option {', '.join(missing)} ({what}.{missing[0]}=...)")
    hints = typing.get_type_hints(cls.__init__)
    for key, value in options.items():
        if key in hints and not _accepts(hints[key], value):
            raise ValueError(f"{what}.{key}={value!r} must be {describe(hints[key])}")
    return cls(**options)


def _accepts(hint: Any, value: Any) -> bool:
    """Whether ``value`` fits a plain type hint (int, float, str, bool, a union of them or a list of one; an int is
    a float); any other hint is left to the part."""
    if typing.get_origin(hint) is list:
        inner = typing.get_args(hint)
        return isinstance(value, list) and all(_accepts(inner[0], v) for v in value) if inner else True
    types = typing.get_args(hint) or (hint,)
    if not all(isinstance(t, type) for t in types):
        return True
    if isinstance(value, bool):
        return bool in types
    if isinstance(value, int) and float in types:
        return True
    return isinstance(value, types)


def _flag(value: Any, what: str) -> bool:
    if value in (None, False, "none", "false", "off", 0):
        return False
    if value in (True, "true", "on", "cosine", 1):
        return True
    raise ValueError(f"{what}={value!r} must be true or false")


def build_score(spec: Any) -> Score:
    """A score from its config, ``kind`` or ``{kind: ..., options}`` (a wrapper's ``base`` too); ``shared: true``
    averages it over the layer's KV heads."""
    options = _options(spec)
    shared = _flag(options.pop("shared", False), "score.shared")
    score = _part(SCORES, options)
    return SharedAcrossHeads(score) if shared else score


MERGE_CHOICES = "true or false, or a merge kind: cosine (true), cam, {kind: cam, merge_budget: ...}"


def merge_kind(spec: Any) -> tuple[Any, dict[str, Any]]:
    """A ``merge`` setting's kind (None: evicted entries are dropped) and options: false, true (``cosine``), a
    kind, or ``{kind: ..., options}``."""
    if spec in (None, False, "none", "false", "off", 0):
        return None, {}
    if spec in (True, "true", "on", 1):
        return "cosine", {}
    options = _options(spec)
    return options.pop("kind", None), options


def build_merge(spec: Any) -> Merge | None:
    """The ``Merge`` a policy's ``merge`` setting names (policies.merge, policies.cam), or None."""
    kind, options = merge_kind(spec)
    if kind is None:
        return None
    if not isinstance(kind, str) or kind not in MERGES:
        raise ValueError(f"merge={spec!r} must be {MERGE_CHOICES}")
    return MERGES.get(kind)(**options)


def build_sparsity(spec: Any) -> Sparsity | None:
    """The decode-time sparsity a policy's ``sparsity`` setting names (``kvbench.policies.sparse``), or None."""
    if spec in (None, False, "none"):
        return None
    return _part(SPARSITIES, spec)


def build_policy(cfg: dict[str, Any]) -> Policy:
    """``score: none`` means the full cache: nothing is ever evicted (it may still be quantised)."""
    cfg = dict(cfg)
    unknown = sorted(set(cfg) - set(POLICY_KEYS))
    if unknown:
        raise ValueError(f"unknown policy key(s) {', '.join(unknown)}; a policy has {', '.join(POLICY_KEYS)}")
    phases = {phase: cfg.pop(phase, None) for phase in PHASES}
    if any(phases.values()):
        return _per_phase(cfg, phases)
    name = cfg["name"]
    quantize = build_quantizer(cfg.get("quantize"))
    channels = build_channels(cfg.get("channels"))
    positions = cfg.get("positions") or "absolute"
    merge = build_merge(cfg.get("merge", False))
    sliding = cfg.get("sliding_layers") or "window"
    score_spec = cfg.get("score", "none")
    sparsity = build_sparsity(cfg.get("sparsity"))
    if sparsity is not None and channels is not None:
        raise ValueError(
            "a decode-time sparsity bounds each page's keys over every channel, and pruned key channels leave some "
            "out: drop policy.channels or policy.sparsity"
        )
    if score_spec in (None, "none"):
        if ALLOCATIONS.get(str(_options(cfg.get("allocation") or "uniform").get("kind"))).thresholded:
            raise ValueError(
                "a threshold keeps the entries whose score reaches it, and score=none has no score: name a base "
                f"score (policy.score=key_norm, or one of {SCORES.choices()})"
            )
        return never_evicting(name, quantize, positions, sliding_layers=sliding, channels=channels, sparsity=sparsity)
    score = build_score(score_spec)
    if channels is not None and score.replay is not None:
        raise ValueError(
            "channels chooses key channels from the prompt's last queries, and the score's replay passes feed "
            "queries after them: drop policy.channels for a replaying score"
        )
    altered = [key for key, on in (("quantize", quantize is not None), ("positions", positions != "absolute")) if on]
    if score.replay is not None and score.replay.gradient and altered:
        raise ValueError(
            "KVgrad differentiates its replay passes through the keys and values as the model computes them, which "
            f"a quantised or re-indexed cache stores altered: drop {' and '.join(f'policy.{k}' for k in altered)}"
        )
    scope = _part(SCOPES, cfg.get("scope", "all"))
    allocation_spec = _options(cfg.get("allocation") or "uniform")
    allocation = _part(ALLOCATIONS, allocation_spec)
    if allocation.per_head and not allocation.thresholded and score.shares_heads:
        raise ValueError(
            "score.shared=true (on the score or its base) keeps one set per layer; it cannot combine with "
            f"allocation={allocation_spec.get('kind')}"
        )
    for part, what in ((score, "score"), (scope, "scope")):
        unknown = sorted(set(part.needs) - set(STATISTICS))
        if unknown:
            raise ValueError(
                f"{what} {type(part).__name__} needs unknown statistic(s) {', '.join(unknown)}; the statistics are "
                f"{sorted(STATISTICS)} (kvbench.policies.statistics); a per-entry quantity of keys or values is a "
                "feature (Score.feature_names)"
            )
    return Policy(
        name=name,
        score=score,
        scope=scope,
        allocation=allocation,
        merge=merge,
        quantize=quantize,
        positions=positions,
        sliding_layers=sliding,
        interval=cfg.get("interval", 1),
        channels=channels,
        sparsity=sparsity,
    )


def _per_phase(cfg: dict[str, Any], phases: dict[str, Any]) -> Policy:
    """The run's policy ``cfg`` with a score and scope per phase (``kvbench.policies.phased``): ``phases`` holds
    the config of the policy each phase names (None: the run's own); the cache's settings are the run's."""
    run = build_policy(cfg)
    built = {}
    for phase, spec in phases.items():
        if isinstance(spec, str):
            raise ValueError(
                f"{phase}={spec!r} names a policy config: give the config itself (kvbench-run reads "
                f"configs/policy/{spec}.yaml)"
            )
        label = f"policy.{phase}={spec['name']}" if spec else f"policy={cfg['name']} (policy.{phase} is not set)"
        policy = build_policy({**spec, **{k: cfg[k] for k in CACHE_KEYS if k in cfg}}) if spec else run
        if not policy.evicts:
            raise ValueError(f"{label} never evicts; a phase that keeps everything is stage=prefill or stage=decode")
        if phase in (policy.unsupported_stages or ()):
            raise ValueError(
                f"{label} cannot evict in the {phase} phase: {policy.why_unsupported}; name a policy that evicts "
                f"there for policy.{phase}"
            )
        ours, theirs = (_options((c or {}).get("allocation") or "uniform") for c in (cfg, spec))
        if spec and ours != theirs:
            raise ValueError(
                f"{label} splits the budget by allocation {theirs}, the run's policy by {ours}: one cache has one "
                "allocation, so both phases must name the same"
            )
        built[phase] = policy
    prefill, decode = built["prefill"], built["decode"]
    return Policy(
        name=cfg["name"],
        score=PhasedScore(prefill.score, decode.score),
        scope=PhasedScope(prefill.scope, decode.scope),
        allocation=prefill.allocation,
        merge=prefill.merge,
        quantize=prefill.quantize,
        positions=prefill.positions,
        sliding_layers=prefill.sliding_layers,
        interval=prefill.interval,
        channels=prefill.channels,
        unsupported_stages=("prefill", "decode"),
    )
